//! Compute time: a roofline per kernel, `max(flops / (peak · eff), bytes / (hbm · eff_mem),
//! launch_floor)`, with the GEMM efficiency chosen by shape class (the smallest of M, N, K).
//!
//! [`node_cost`] turns one IR node into the kernels it runs forward and, for the training
//! model, backward. Element sizes: `f32` values of the (CPU-reference) IR are costed at the
//! simulated compute dtype (bf16 by default); `i32` stays 4 bytes. FLOPs are counted as
//! Megatron-LM does (2 per multiply-add; attention scores and values over the full sequence,
//! causal masking not subtracted); `exec_flops` is what the kernel executes (a causal flash
//! attention skips about half) and sets its time. Mixture-of-experts layers, which the IR
//! computes densely over `[experts, ..]` (zeros where a token is not routed), are costed at
//! their routed fraction `top_k / experts` ([`routed_fraction`]), as grouped GEMMs run them.
//! Fused ops the rewriter makes (`FusedMatMul`, `AgMatMul`, `MatMulRs`, `FusedElementwise`,
//! `AddRmsNorm`) and the training ops `autodiff/` emits (`WeightGrad`, `AttentionGrad`, ...)
//! are costed too, so rewritten and training plans replay as they are.

use super::collective::CollectiveKind;
use super::profile::DeviceProfile;
use super::units::Seconds;
use crate::ir::{AttnWrt, DType, Graph, Op, Role, TensorType, ValueId};
use serde::{Deserialize, Serialize};

/// How attention runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionImpl {
    /// One fused kernel (FlashAttention): reads q, k, v, writes the output; causal masking skips
    /// half the blocks; the backward executes 2.5× the forward's FLOPs (5 GEMMs for 2).
    Flash,
    /// The score matrix is materialised (Megatron-LM 2021): batched GEMM `q·kᵀ`, fused
    /// scale-mask-softmax, dropout (when training with dropout), batched GEMM with `v`.
    Unfused,
}

/// The share of score tiles a fused attention kernel executes over `s` keys: half under a
/// causal mask, a window's share of the keys under a sliding window.
fn flash_fraction(share: f64, window: Option<usize>, s: usize) -> f64 {
    let keys = window.map_or(1.0, |w| (w.min(s) as f64 / s.max(1) as f64).min(1.0));
    share * keys
}

/// The share of the `T × S` score tiles a causal attention's busiest rank computes: half of
/// them, except for context parallelism's contiguous order, where the last rank's queries
/// (the sequence's last `T` of `S` positions) see `1 − T/(2S)` of the keys — `(2N−1)/N`
/// times the mean rank's work. The head-tail order gives every rank half. `v` is an
/// `Attention` or `AttentionProbs` node (its query indices name the order) or an
/// `AttentionGrad` (read through its probabilities).
fn causal_share(g: &Graph, v: ValueId, causal: bool) -> f64 {
    if !causal {
        return 1.0;
    }
    let mut node = g.node(v);
    if let Op::AttentionGrad { .. } = node.op {
        match node.inputs.get(4).map(|&p| g.node(p)) {
            Some(p) if matches!(p.op, Op::AttentionProbs(_)) => node = p,
            _ => return 0.5,
        }
    }
    let (spec, ring) = match &node.op {
        Op::Attention(s) | Op::AttentionProbs(s) => (s, 1),
        Op::RingAttention { spec, parts, .. } | Op::RingAttentionGrad { spec, parts, .. } => {
            (spec, *parts)
        }
        _ => return 0.5,
    };
    let n = node.inputs.len();
    if !spec.indexed || n < 2 {
        return 0.5;
    }
    // The query indices: a slice (or view) of a `SeqIndex`.
    let mut x = node.inputs[n - 2];
    let order = loop {
        match &g.node(x).op {
            Op::SeqIndex { order, .. } => break Some(*order),
            Op::LocalSlice { .. } | Op::Reshape | Op::AllGather { .. } => x = g.node(x).inputs[0],
            _ => break None,
        }
    };
    let (t, s) = (
        g.ty(node.inputs[0]).dim(1),
        g.ty(node.inputs[1]).dim(1) * ring,
    );
    match order {
        Some(crate::ir::SeqOrder::Contiguous) if s > 0 => 1.0 - t as f64 / (2.0 * s as f64),
        _ => 0.5,
    }
}

/// What the compute model assumes about kernels.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ComputeOptions {
    /// The dtype `f32` IR values are simulated in (GEMMs run at its tensor-core peak).
    pub dtype: DType,
    /// Attention implementation.
    pub attention: AttentionImpl,
    /// Dropout on attention probabilities and residual branches (training).
    pub dropout: bool,
    /// Chains of elementwise ops run as one kernel (the rewriter's `fuse-elementwise`): an
    /// elementwise op whose only user is elementwise does not write its result.
    pub fuse_elementwise: bool,
}

impl Default for ComputeOptions {
    fn default() -> Self {
        ComputeOptions {
            dtype: DType::Bf16,
            attention: AttentionImpl::Flash,
            dropout: false,
            fuse_elementwise: true,
        }
    }
}

/// A GEMM's shape: `batch` independent `[m, k] · [k, n]` products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GemmShape {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// Contracted dim.
    pub k: usize,
    /// Independent products.
    pub batch: usize,
}

/// GEMM shape class, by the smallest of M, N, K.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GemmClass {
    /// Smallest dim ≥ 1024.
    Large,
    /// 256 ≤ smallest dim < 1024.
    Medium,
    /// 64 ≤ smallest dim < 256.
    Small,
    /// Smallest dim < 64.
    Tiny,
}

impl GemmShape {
    /// Its class.
    pub fn class(&self) -> GemmClass {
        match self.m.min(self.n).min(self.k) {
            d if d >= 1024 => GemmClass::Large,
            d if d >= 256 => GemmClass::Medium,
            d if d >= 64 => GemmClass::Small,
            _ => GemmClass::Tiny,
        }
    }
}

/// One kernel launch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// FLOPs as Megatron-LM counts them (reported, MFU).
    pub flops: f64,
    /// FLOPs the kernel executes (its time).
    pub exec_flops: f64,
    /// HBM bytes read and written.
    pub bytes: f64,
    /// `Some` for tensor-core GEMMs (and flash attention).
    pub gemm: Option<GemmShape>,
    /// Pays the launch floor (false inside a fused chain).
    pub launch: bool,
}

impl Kernel {
    /// A memory-bound kernel moving `bytes`.
    pub fn memory(bytes: f64) -> Kernel {
        Kernel {
            flops: 0.0,
            exec_flops: 0.0,
            bytes,
            gemm: None,
            launch: true,
        }
    }

    /// A GEMM of `shape` moving `bytes`.
    pub fn gemm(shape: GemmShape, bytes: f64) -> Kernel {
        let f = 2.0 * shape.m as f64 * shape.n as f64 * shape.k as f64 * shape.batch as f64;
        Kernel {
            flops: f,
            exec_flops: f,
            bytes,
            gemm: Some(shape),
            launch: true,
        }
    }
}

/// The backward GEMMs of a forward `[m, k]·[k, n]` product of `shape` whose output gradient
/// is `out` bytes, input `a` and weight `w`: the input gradient dA = dC · Wᵀ (`[m, n]·[n, k]`)
/// and the weight gradient dW = Aᵀ · dC (`[k, m]·[m, n]`).
fn gemm_backward(shape: GemmShape, out: f64, a: f64, w: f64) -> (Kernel, Kernel) {
    let GemmShape { m, n, k, batch } = shape;
    let dgrad = Kernel::gemm(
        GemmShape {
            m,
            n: k,
            k: n,
            batch,
        },
        out + w + a,
    );
    let wgrad = Kernel::gemm(
        GemmShape {
            m: k,
            n,
            k: m,
            batch,
        },
        out + a + w,
    );
    (dgrad, wgrad)
}

/// Efficiency of a GEMM class on `dev`.
pub fn gemm_efficiency(dev: &DeviceProfile, shape: &GemmShape) -> f64 {
    let e = &dev.efficiency;
    match shape.class() {
        GemmClass::Large => e.gemm_large.value,
        GemmClass::Medium => e.gemm_medium.value,
        GemmClass::Small => e.gemm_small.value,
        GemmClass::Tiny => e.gemm_tiny.value,
    }
}

/// The roofline time of one kernel.
pub fn kernel_time(dev: &DeviceProfile, dtype: DType, k: &Kernel) -> Seconds {
    let compute = match &k.gemm {
        Some(shape) => k.exec_flops / (dev.peak(dtype) * gemm_efficiency(dev, shape)),
        None => k.exec_flops / dev.peak_flops.fp32.value,
    };
    let memory = k.bytes / (dev.hbm_bandwidth.value * dev.efficiency.memory.value);
    let floor = if k.launch {
        dev.launch_floor.value
    } else {
        0.0
    };
    Seconds(compute.max(memory).max(floor))
}

/// The kernels of one node, forward and backward.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeCost {
    /// Forward kernels (empty for views and for collectives, which the communication model
    /// costs).
    pub fwd: Vec<Kernel>,
    /// Backward kernels producing the gradient of the inputs.
    pub dgrad: Vec<Kernel>,
    /// Backward kernels producing the gradient of the weights (GEMMs with a parameter).
    pub wgrad: Vec<Kernel>,
    /// For a GEMM whose activation operand is an all-gather's result: that all-gather (its
    /// value), which the backward repeats to get the input for the weight gradient (Megatron
    /// sequence parallelism keeps only the sharded input).
    pub gathered_input: Option<ValueId>,
    /// Communication inside the kernel, overlapped with its GEMM (collective matmuls): axis,
    /// collective, nccl-tests size, ring steps.
    pub embedded_comm: Option<(String, CollectiveKind, f64, usize)>,
}

/// Bytes of a value at the simulated dtype.
pub fn sim_bytes(ty: &TensorType, dtype: DType) -> f64 {
    let per = match ty.dtype {
        DType::F32 => dtype.size_bytes(),
        d => d.size_bytes(),
    };
    ty.numel() as f64 * per as f64
}

/// The fraction of a dense `[experts, ..]` tensor a mixture-of-experts layer really moves and
/// multiplies: the IR dispatches every token to every expert slot (zeros where unrouted), a
/// GPU implementation only the `top_k` of `experts` it is routed to. 1 without a router.
pub fn routed_fraction(g: &Graph) -> f64 {
    g.ids()
        .find_map(|v| match g.node(v).op {
            Op::Router { top_k, .. } => {
                let e = g.ty(v).last().max(1);
                Some((top_k as f64 / e as f64).min(1.0))
            }
            _ => None,
        })
        .unwrap_or(1.0)
}

/// True for a value laid out `[experts, ..]` (an MoE layer's dispatched tokens).
pub fn is_expert_major(ty: &TensorType) -> bool {
    ty.dims.first().is_some_and(|d| d.role == Role::Expert)
}

fn is_elementwise(op: &Op) -> bool {
    matches!(
        op,
        Op::Add | Op::Mul | Op::Unary(_) | Op::Scale(_) | Op::Cast(_)
    )
}

/// For each node: its result stays in registers, consumed by the one elementwise op that uses
/// it (so it is neither written nor read back). Only with `fuse_elementwise`.
pub fn fused_into_consumer(g: &Graph, opts: &ComputeOptions) -> Vec<bool> {
    let mut fused = vec![false; g.len()];
    if !opts.fuse_elementwise {
        return fused;
    }
    let users = g.users();
    let outputs: Vec<ValueId> = g.outputs.iter().map(|&(_, v)| v).collect();
    for v in g.ids() {
        let n = g.node(v);
        if !is_elementwise(&n.op) || outputs.contains(&v) {
            continue;
        }
        if let [u] = users[v.index()][..] {
            let un = g.node(u);
            if is_elementwise(&un.op) && un.ty.same_shape(&n.ty) && un.inputs[0] == v {
                fused[v.index()] = true;
            }
        }
    }
    fused
}

/// The kernels node `v` runs. `fused` comes from [`fused_into_consumer`].
pub fn node_cost(g: &Graph, v: ValueId, opts: &ComputeOptions, fused: &[bool]) -> NodeCost {
    node_cost_routed(g, v, opts, fused, routed_fraction(g))
}

/// [`node_cost`] with the graph's [`routed_fraction`] given (it is a whole-graph scan).
pub fn node_cost_routed(
    g: &Graph,
    v: ValueId,
    opts: &ComputeOptions,
    fused: &[bool],
    routed: f64,
) -> NodeCost {
    let node = g.node(v);
    let dt = opts.dtype;
    // Dense [experts, ..] activations count at the routed fraction; weights (parameters, and
    // a training program's `[experts, out, in]` weight inputs and gradients) in full.
    let scaled = |ty: &TensorType, is_param: bool| {
        let x = sim_bytes(ty, dt);
        if !is_param && is_expert_major(ty) && ty.rank() > 3 {
            x * routed
        } else {
            x
        }
    };
    let b = |x: ValueId| scaled(g.ty(x), matches!(g.node(x).op, Op::Param(_)));
    let out = scaled(&node.ty, false);
    let read = |x: ValueId| if fused[x.index()] { 0.0 } else { b(x) };
    let mut c = NodeCost::default();
    match &node.op {
        Op::Input { .. } | Op::Param(_) | Op::Reshape => {}
        op if op.is_collective() => {}
        Op::MatMul { .. } => {
            let (a, w) = (node.inputs[0], node.inputs[1]);
            let ta = g.ty(a);
            let tw = g.ty(w);
            let k = ta.last();
            let n = node.ty.last();
            let batch = if tw.rank() == 3 { tw.dim(0) } else { 1 };
            let mut m = node.ty.numel() / n.max(1) / batch.max(1);
            if is_expert_major(&node.ty) {
                m = ((m as f64 * routed).ceil() as usize).max(1);
            }
            let shape = GemmShape { m, n, k, batch };
            c.fwd.push(Kernel::gemm(shape, read(a) + b(w) + out));
            let (dgrad, wgrad) = gemm_backward(shape, out, b(a), b(w));
            c.dgrad.push(dgrad);
            if matches!(g.node(w).op, Op::Param(_)) {
                c.wgrad.push(wgrad);
            } else {
                c.dgrad.push(wgrad);
            }
            if matches!(g.node(a).op, Op::AllGather { .. }) {
                c.gathered_input = Some(a);
            }
        }
        Op::FusedMatMul { .. } | Op::AgMatMul { .. } | Op::MatMulRs { .. } => {
            // A GEMM with an epilogue (extra operands read once) or with its all-gather /
            // reduce-scatter decomposed into a ring of partial GEMMs.
            let (a, w) = (node.inputs[0], node.inputs[1]);
            let k = g.ty(a).last();
            let n = node.ty.last();
            let tw = g.ty(w);
            let batch = if tw.rank() == 3 { tw.dim(0) } else { 1 };
            let (m_total, comm) = match &node.op {
                Op::AgMatMul { axis, parts, .. } => (
                    node.ty.numel() / n.max(1) / batch.max(1),
                    Some((
                        axis.clone(),
                        CollectiveKind::AllGather,
                        b(a) * *parts as f64,
                        *parts,
                    )),
                ),
                Op::MatMulRs { axis, parts, .. } => {
                    let full = node.ty.numel() * parts / n.max(1) / batch.max(1);
                    (
                        full,
                        Some((
                            axis.clone(),
                            CollectiveKind::ReduceScatter,
                            out * *parts as f64,
                            *parts,
                        )),
                    )
                }
                _ => (node.ty.numel() / n.max(1) / batch.max(1), None),
            };
            let extra: f64 = node.inputs[2..].iter().map(|&i| read(i)).sum();
            let shape = GemmShape {
                m: m_total,
                n,
                k,
                batch,
            };
            c.fwd
                .push(Kernel::gemm(shape, read(a) + b(w) + extra + out));
            let (dgrad, wgrad) = gemm_backward(shape, out, b(a), b(w));
            c.dgrad.push(dgrad);
            c.wgrad.push(wgrad);
            c.embedded_comm = comm;
        }
        Op::WeightGrad { .. } => {
            // (a, dy, b) -> db: aᵀ·dy over every leading row.
            let (a, dy) = (node.inputs[0], node.inputs[1]);
            let k = g.ty(a).last();
            let n = g.ty(dy).last();
            let batch = if node.ty.rank() == 3 {
                node.ty.dim(0)
            } else {
                1
            };
            let mut rows = g.ty(a).numel() / k.max(1) / batch.max(1);
            if is_expert_major(g.ty(a)) {
                // Only the routed tokens of each expert contribute.
                rows = ((rows as f64 * routed).ceil() as usize).max(1);
            }
            c.fwd.push(Kernel::gemm(
                GemmShape {
                    m: k,
                    n,
                    k: rows,
                    batch,
                },
                b(a) + b(dy) + out,
            ));
        }
        Op::AttentionProbs(spec) => {
            let (q, k) = (g.ty(node.inputs[0]), g.ty(node.inputs[1]));
            let heads = q.dim(0) * q.dim(2);
            let (t, s2, d) = (q.dim(1), k.dim(1), q.dim(3));
            let shape = GemmShape {
                m: t,
                n: s2,
                k: d,
                batch: heads,
            };
            if opts.attention == AttentionImpl::Flash {
                // The fused backward recomputes the scores tile by tile in on-chip memory.
                let mut k = Kernel::gemm(shape, b(node.inputs[0]) + b(node.inputs[1]));
                k.exec_flops *= flash_fraction(causal_share(g, v, spec.causal), spec.window, s2);
                c.fwd.push(k);
            } else {
                c.fwd.push(Kernel::gemm(
                    shape,
                    b(node.inputs[0]) + b(node.inputs[1]) + out,
                ));
                c.fwd.push(Kernel::memory(2.0 * out));
            }
        }
        Op::AttentionGrad { wrt, spec } => {
            let (q, k) = (g.ty(node.inputs[0]), g.ty(node.inputs[1]));
            let heads = q.dim(0) * q.dim(2);
            let (t, s2, d) = (q.dim(1), k.dim(1), q.dim(3));
            let probs = b(node.inputs[4]);
            let shape = GemmShape {
                m: t,
                n: d,
                k: s2,
                batch: heads,
            };
            // dP = dy·vᵀ: the score matrix's shape.
            let scores = GemmShape {
                m: t,
                n: s2,
                k: d,
                batch: heads,
            };
            let ins: f64 = node.inputs.iter().map(|&i| b(i)).sum();
            let flash = opts.attention == AttentionImpl::Flash;
            // FlashAttention-2's backward: 5 GEMMs for the forward's 2 (scores recomputed,
            // dV, dP, dQ, dK), the probabilities never in memory: dP, computed once for dQ
            // and dK, is priced with dQ.
            let ins_flash = ins - probs;
            match wrt {
                AttnWrt::V if flash => c.fwd.push(Kernel::gemm(shape, ins_flash + out)),
                AttnWrt::Q if flash => {
                    c.fwd.push(Kernel::gemm(scores, ins_flash));
                    c.fwd.push(Kernel::gemm(shape, out));
                }
                AttnWrt::K if flash => c.fwd.push(Kernel::gemm(shape, ins_flash + out)),
                AttnWrt::V => c.fwd.push(Kernel::gemm(shape, ins + out)),
                AttnWrt::Q | AttnWrt::K => {
                    // dP, softmax backward, then dS·k (or dSᵀ·q).
                    c.fwd.push(Kernel::gemm(scores, ins));
                    c.fwd.push(Kernel::memory(3.0 * probs));
                    c.fwd.push(Kernel::gemm(shape, probs + out));
                }
            }
            if flash {
                // Causal masking skips half the tiles (Megatron still counts them all).
                let frac = flash_fraction(causal_share(g, v, spec.causal), spec.window, s2);
                for k in &mut c.fwd {
                    k.exec_flops *= frac;
                }
            }
        }
        Op::Attention(spec) => attention_cost(g, v, spec.causal, spec.window, 1, opts, &mut c),
        Op::RingAttention { spec, axis, parts } => {
            // The attention over every rank's keys, its K/V blocks passed round the ring
            // while each block is attended to (overlapped like a collective matmul's chunks).
            attention_cost(g, v, spec.causal, spec.window, *parts, opts, &mut c);
            let kv: f64 = node.inputs[1..3].iter().map(|&i| b(i)).sum();
            c.embedded_comm = Some((
                axis.clone(),
                CollectiveKind::AllGather,
                kv * *parts as f64,
                *parts,
            ));
        }
        Op::RingAttentionGrad { spec, axis, parts } => {
            // The scores once more for the softmax statistics, then the FlashAttention
            // backward, block by block round the ring: what the attention's forward and
            // backward kernels cost over every rank's keys.
            let mut whole = NodeCost::default();
            attention_cost(g, v, spec.causal, spec.window, *parts, opts, &mut whole);
            // The statistics pass: the scores alone, half the forward's work, recomputed (no
            // model FLOPs counted).
            c.fwd.extend(whole.fwd.into_iter().map(|mut k| {
                k.flops = 0.0;
                k.exec_flops *= 0.5;
                k.bytes *= 0.5;
                k
            }));
            c.fwd.extend(whole.dgrad);
            // K passed once, then K, V and their dK/dV accumulators.
            let (k, vv) = (b(node.inputs[1]), b(node.inputs[2]));
            c.embedded_comm = Some((
                axis.clone(),
                CollectiveKind::AllGather,
                (3.0 * k + 2.0 * vv) * *parts as f64,
                *parts,
            ));
        }
        Op::Embedding => {
            // Gather rows: read them, write the result; backward scatter-adds into the table.
            c.fwd.push(Kernel::memory(2.0 * out + b(node.inputs[1])));
            c.wgrad.push(Kernel::memory(3.0 * out));
        }
        Op::RmsNorm { .. } | Op::LayerNorm { .. } => {
            let ins: f64 = node.inputs.iter().map(|&i| read(i)).sum();
            c.fwd.push(Kernel::memory(ins + out));
            // Read x and dy, write dx (weight gradients reduce alongside).
            c.dgrad.push(Kernel::memory(b(node.inputs[0]) + 2.0 * out));
        }
        Op::CrossEntropy { .. } => {
            let logits = b(node.inputs[0]);
            c.fwd.push(Kernel::memory(logits + b(node.inputs[1])));
            c.dgrad.push(Kernel::memory(2.0 * logits));
        }
        Op::CrossEntropyStats { .. } => {
            // One pass over the logits shard (max, then the exponentials from registers or
            // cache, and the label's logit); the per-row stats written.
            c.fwd
                .push(Kernel::memory(b(node.inputs[0]) + b(node.inputs[1]) + out));
        }
        Op::CrossEntropyFromStats { .. } => {
            c.fwd
                .push(Kernel::memory(b(node.inputs[0]) + b(node.inputs[1])));
        }
        Op::CrossEntropyShardGrad { .. } => {
            // Read the logits shard (and the tiny stats and labels), write its gradient.
            let ins: f64 = node.inputs.iter().map(|&i| b(i)).sum();
            c.fwd.push(Kernel::memory(ins + out));
        }
        _ => {
            let ins: f64 = node.inputs.iter().map(|&i| read(i)).sum();
            let write = if fused[v.index()] { 0.0 } else { out };
            let mut k = Kernel::memory(ins + write);
            if fused[v.index()] {
                k.launch = false;
            }
            c.fwd.push(k);
            // Backward of elementwise ops: read the saved input(s) and dy, write dx.
            let mut bk = Kernel::memory(ins + 2.0 * out);
            bk.launch = !fused[v.index()];
            c.dgrad.push(bk);
        }
    }
    c
}

/// Attention of `v`'s queries against `ring` times its keys operand (ring attention reads
/// every rank's block in turn).
#[allow(clippy::too_many_arguments)]
fn attention_cost(
    g: &Graph,
    v: ValueId,
    causal: bool,
    window: Option<usize>,
    ring: usize,
    opts: &ComputeOptions,
    c: &mut NodeCost,
) {
    let node = g.node(v);
    let dt = opts.dtype;
    let tq = g.ty(node.inputs[0]);
    let tk = g.ty(node.inputs[1]);
    let (bsz, t, hq, d) = (tq.dim(0), tq.dim(1), tq.dim(2), tq.dim(3));
    let s = tk.dim(1) * ring;
    let heads = bsz * hq;
    let b = |x: ValueId| sim_bytes(g.ty(x), dt);
    let (q, k, vv) = (
        b(node.inputs[0]),
        b(node.inputs[1]) * ring as f64,
        b(node.inputs[2]) * ring as f64,
    );
    let out = sim_bytes(&node.ty, dt);
    let el = dt.size_bytes() as f64;
    // Keys a query sees when executing (a window bounds them); Megatron counts all of them.
    let s_exec = window.map_or(s, |w| w.min(s));
    let counted = 4.0 * heads as f64 * t as f64 * s as f64 * d as f64;
    // A product per head: `[m, k]·[k, n]`.
    let per_head = |m: usize, n: usize, k: usize| GemmShape {
        m,
        n,
        k,
        batch: heads,
    };
    match opts.attention {
        AttentionImpl::Flash => {
            let frac = causal_share(g, v, causal);
            let exec = 4.0 * heads as f64 * t as f64 * s_exec as f64 * d as f64 * frac;
            let shape = per_head(t, s_exec, d);
            let mut f = Kernel::gemm(shape, q + k + vv + out);
            f.flops = counted;
            f.exec_flops = exec;
            c.fwd.push(f);
            let mut bk = Kernel::gemm(shape, 2.0 * (q + k + vv + out));
            bk.flops = 2.0 * counted;
            bk.exec_flops = 2.5 * exec;
            c.dgrad.push(bk);
        }
        AttentionImpl::Unfused => {
            let scores = heads as f64 * t as f64 * s as f64;
            let qk = per_head(t, s, d);
            let av = per_head(t, d, s);
            // dV = Pᵀ·dO and dK = dSᵀ·Q.
            let st = per_head(s, d, t);
            // Forward: q·kᵀ writes scores; scale-mask-softmax reads and writes them; dropout
            // reads, writes and stores a 1-byte mask; ·v reads the probabilities.
            c.fwd.push(Kernel::gemm(qk, q + k + scores * el));
            let drop = if opts.dropout { 2.0 * el + 1.0 } else { 0.0 };
            c.fwd.push(Kernel::memory(scores * (2.0 * el + drop)));
            c.fwd.push(Kernel::gemm(av, scores * el + vv + out));
            // Backward: dV = Pᵀ·dO, dP = dO·Vᵀ, softmax (and dropout) backward, dQ = dS·K,
            // dK = dSᵀ·Q.
            c.dgrad.push(Kernel::gemm(st, scores * el + out + vv));
            c.dgrad.push(Kernel::gemm(qk, out + vv + scores * el));
            c.dgrad.push(Kernel::memory(scores * (3.0 * el + drop)));
            c.dgrad.push(Kernel::gemm(av, scores * el + k + q));
            c.dgrad.push(Kernel::gemm(st, scores * el + q + k));
        }
    }
}

/// Total time of a list of kernels.
pub fn kernels_time(dev: &DeviceProfile, dtype: DType, ks: &[Kernel]) -> Seconds {
    ks.iter()
        .fold(Seconds::ZERO, |acc, k| acc + kernel_time(dev, dtype, k))
}

/// Counted FLOPs of a list of kernels.
pub fn kernels_flops(ks: &[Kernel]) -> f64 {
    ks.iter().map(|k| k.flops).sum()
}

/// Bytes of a list of kernels.
pub fn kernels_bytes(ks: &[Kernel]) -> f64 {
    ks.iter().map(|k| k.bytes).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Dim, Role};

    fn dev() -> DeviceProfile {
        DeviceProfile::load("h100-sxm").unwrap()
    }

    #[test]
    fn gemm_time_is_flops_over_effective_rate() {
        let d = dev();
        let shape = GemmShape {
            m: 8192,
            n: 8192,
            k: 8192,
            batch: 1,
        };
        let k = Kernel::gemm(shape, 3.0 * 8192.0 * 8192.0 * 2.0);
        let t = kernel_time(&d, DType::Bf16, &k).0;
        let expect = 2.0 * 8192f64.powi(3) / (989.4e12 * d.efficiency.gemm_large.value);
        assert!((t / expect - 1.0).abs() < 1e-12);
        assert_eq!(shape.class(), GemmClass::Large);
    }

    #[test]
    fn memory_bound_and_launch_floor() {
        let d = dev();
        let k = Kernel::memory(1e9);
        let t = kernel_time(&d, DType::Bf16, &k).0;
        assert!((t - 1e9 / (3.35e12 * 0.85)).abs() < 1e-12);
        let tiny = Kernel::memory(8.0);
        assert_eq!(kernel_time(&d, DType::Bf16, &tiny).0, d.launch_floor.value);
        let mut fused = tiny;
        fused.launch = false;
        assert!(kernel_time(&d, DType::Bf16, &fused).0 < 1e-9);
    }

    #[test]
    fn matmul_node_flops_and_backward() {
        let mut g = Graph::new();
        let act = |n| {
            TensorType::new(
                DType::F32,
                vec![
                    Dim::new(Role::Batch, 2),
                    Dim::new(Role::Seq, 16),
                    Dim::new(Role::Hidden, n),
                ],
            )
        };
        let x = g.input("x", act(64));
        let w = g
            .add_typed(
                Op::Param(crate::ir::ParamSource::whole("w")),
                &[],
                Some(TensorType::plain(DType::F32, &[128, 64])),
                "w",
            )
            .unwrap();
        let y = g
            .add(Op::MatMul { transpose_b: true }, &[x, w], "y")
            .unwrap();
        let fused = vec![false; g.len()];
        let c = node_cost(&g, y, &ComputeOptions::default(), &fused);
        assert_eq!(kernels_flops(&c.fwd), 2.0 * 32.0 * 64.0 * 128.0);
        assert_eq!(kernels_flops(&c.dgrad), kernels_flops(&c.fwd));
        assert_eq!(kernels_flops(&c.wgrad), kernels_flops(&c.fwd));
        // bf16: x 2·16·64·2 bytes, w 128·64·2, y 2·16·128·2.
        assert_eq!(kernels_bytes(&c.fwd), 4096.0 + 16384.0 + 8192.0);
    }
}
