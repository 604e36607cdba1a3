//! The attention backward without the probabilities: a training program's `AttentionProbs`
//! and the three `AttentionGrad` nodes (wrt q, k, v) that read it run as one fused group, the
//! FlashAttention-2 sequence of `attention_bwd.cu` (issued by `train_node.rs`) — the forward again with its log-sum-exp
//! (`attention_lse_*`, its output into scratch), `D = rowsum(dO ⊙ O)` and the dQ accumulator
//! zeroed (`attention_bwd_prep_*`), then one pass over key tiles writing dK and dV into their
//! slots and dQ through the f32 accumulator (`attention_bwd_*`; cast for bf16). The
//! `[B, Hq, T, S]` probabilities never exist: the planner gives them no bytes.
//!
//! A group forms when (see [`flash_candidates`]): the probabilities are used only by the three
//! gradients, which sit next to each other in program order and take the same q and k; the
//! attention is not context-parallel (no indices) and its head_dim is at most 128. The three
//! gradients share every operand, so nothing that lives at the first of them dies before the
//! last: writing the other two's slots at the first clobbers nothing (the planner still checks
//! it). Without fusion (`CudaOptions::fuse` off) the materialised kernels run instead.
//!
//! The forward is not run again when the program's own forward attention of the same q, k, v
//! and mask is there (FlashAttention-2 keeps O and the log-sum-exp from the forward): that node
//! ([`FlashBwd::forward`]) runs the lse-writing kernel into one slot holding its output and,
//! [`saved_lse_offset`] bytes in, the lse rows; the planner keeps the slot live until the group,
//! which reads both from there. Without such a node (its output not kept, or a backward of its
//! own) the group runs the forward into scratch first.

use super::dtype::{GpuDType, Storage};
use shardc_compiler::ir::{AttnWrt, Graph, Op, ValueId};
use shardc_kernels::launch::ATTENTION_BWD_MAX_HEAD_DIM;

/// The values of one attention backward group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashBwd {
    /// The `AttentionProbs` node (skipped, no bytes).
    pub probs: ValueId,
    /// The gradients wrt q, k and v.
    pub dq: ValueId,
    /// Wrt k.
    pub dk: ValueId,
    /// Wrt v.
    pub dv: ValueId,
    /// The forward `Attention` node whose output and lse the group reads, if any (module docs).
    pub forward: Option<ValueId>,
}

/// Byte offset of the lse rows (f32, one per query and head) in the slot of a forward
/// attention node `attention` of `g` that keeps them for a backward group
/// ([`FlashBwd::forward`]): its output stored as `dt`, rounded up to 256 bytes.
pub fn saved_lse_offset(g: &Graph, attention: ValueId, dt: GpuDType) -> usize {
    (g.ty(attention).numel() * dt.size_bytes()).div_ceil(256) * 256
}

/// Bytes of the slot of such a forward attention node: its output, then its lse rows.
pub fn saved_forward_bytes(g: &Graph, attention: ValueId, dt: GpuDType) -> usize {
    let ty = g.ty(attention);
    saved_lse_offset(g, attention, dt) + 4 * (ty.numel() / ty.last().max(1))
}

impl FlashBwd {
    /// The first of the three gradients in program order, where the group is issued.
    pub fn head(&self) -> ValueId {
        self.dq.min(self.dk).min(self.dv)
    }

    /// The last of the three gradients in program order.
    pub fn tail(&self) -> ValueId {
        self.dq.max(self.dk).max(self.dv)
    }

    /// The three gradients.
    pub fn grads(&self) -> [ValueId; 3] {
        [self.dq, self.dk, self.dv]
    }
}

/// `v` with reshapes that keep its shape looked through (the training program reads saved
/// forward values through such reshapes).
pub(super) fn through_reshapes(g: &Graph, mut v: ValueId) -> ValueId {
    while let Op::Reshape = g.node(v).op {
        let x = g.node(v).inputs[0];
        if !g.ty(x).same_shape(g.ty(v)) {
            break;
        }
        v = x;
    }
    v
}

/// Every probabilities node of `g` whose backward can run as one group (module docs), with
/// its key mask (an operand of the probabilities that the group reads at its head). The
/// probabilities may reach the gradients through shape-keeping reshapes (the program's saved
/// values), each used only on that path.
pub fn flash_candidates(g: &Graph) -> Vec<(FlashBwd, Option<ValueId>)> {
    let users = g.users();
    let is_output = |v: ValueId| g.outputs.iter().any(|&(_, o)| o == v);
    let mut out = Vec::new();
    for p in g.ids() {
        let node = g.node(p);
        let Op::AttentionProbs(spec) = &node.op else {
            continue;
        };
        if spec.indexed || g.ty(node.inputs[0]).last() > ATTENTION_BWD_MAX_HEAD_DIM {
            continue;
        }
        // The probabilities and their reshapes, down to the value the gradients read.
        let mut last = p;
        let mut ok = !is_output(p);
        while let [u] = users[last.index()].as_slice() {
            if !matches!(g.node(*u).op, Op::Reshape) || is_output(*u) {
                break;
            }
            last = *u;
        }
        let grads: Vec<(AttnWrt, ValueId)> = users[last.index()]
            .iter()
            .filter_map(|&u| match &g.node(u).op {
                Op::AttentionGrad { spec: s, wrt } if s == spec => Some((*wrt, u)),
                _ => None,
            })
            .collect();
        ok &= grads.len() == 3 && users[last.index()].len() == 3 && through_reshapes(g, last) == p;
        let of = |w: AttnWrt| grads.iter().find(|(x, _)| *x == w).map(|(_, u)| *u);
        let (Some(dq), Some(dk), Some(dv)) = (of(AttnWrt::Q), of(AttnWrt::K), of(AttnWrt::V))
        else {
            continue;
        };
        let ins = &g.node(dq).inputs;
        let same = |i: usize| through_reshapes(g, ins[i]) == through_reshapes(g, node.inputs[i]);
        let mut ids = [dq.index(), dk.index(), dv.index()];
        ids.sort_unstable();
        ok &= same(0)
            && same(1)
            && ins[4] == last
            && [dk, dv].iter().all(|&u| g.node(u).inputs == *ins)
            && ids[2] - ids[0] == 2;
        if ok {
            let mut f = FlashBwd {
                probs: p,
                dq,
                dk,
                dv,
                forward: None,
            };
            f.forward = saved_forward(g, &f, &out);
            out.push((f, node.inputs.get(2).copied()));
        }
    }
    out
}

/// The forward attention node group `f` of `g` can read its output and lse from: the last
/// `Attention` before the group with the probabilities' spec whose q, k, v and mask are the
/// group's (looked through shape-keeping reshapes), not already the forward of a group in
/// `taken`.
fn saved_forward(
    g: &Graph,
    f: &FlashBwd,
    taken: &[(FlashBwd, Option<ValueId>)],
) -> Option<ValueId> {
    let Op::AttentionProbs(spec) = &g.node(f.probs).op else {
        return None;
    };
    let grad = &g.node(f.dq).inputs;
    let probs = &g.node(f.probs).inputs;
    let root = |v: ValueId| through_reshapes(g, v);
    (0..f.head().index())
        .rev()
        .map(|i| ValueId(i as u32))
        .find(|&a| {
            let node = g.node(a);
            let Op::Attention(s) = &node.op else {
                return false;
            };
            s == spec
                && node.inputs.len() == probs.len() + 1
                && (0..3).all(|i| root(node.inputs[i]) == root(grad[i]))
                && node.inputs.get(3).map(|&m| root(m)) == probs.get(2).map(|&m| root(m))
        })
        .filter(|&a| !taken.iter().any(|(t, _)| t.forward == Some(a)))
}

/// Where a group's temporaries sit in the compute scratch (byte offsets, 256-aligned): the
/// recomputed forward output and the log-sum-exp (no bytes when the group reads its forward's),
/// the `D` rows (f32), and under bf16 the f32 dQ accumulator and the f32 mask.
pub(super) struct FlashScratch {
    pub out: usize,
    pub lse: usize,
    pub delta: usize,
    pub dq_acc: usize,
    pub mask: usize,
    /// Bytes in all.
    pub total: usize,
}

impl FlashScratch {
    /// The layout of group `f` of `g` stored as `storage`.
    pub fn of(g: &Graph, f: &FlashBwd, storage: &[Storage]) -> FlashScratch {
        let align = |b: usize| b.div_ceil(256) * 256;
        let q = g.ty(g.node(f.dq).inputs[0]);
        let rows = q.numel() / q.last().max(1);
        let elem = storage[f.dq.index()].size_bytes();
        let bf16 = storage[f.dq.index()] == Storage::Float(GpuDType::Bf16);
        let mask_len = match g.node(f.probs).inputs.get(2) {
            Some(&m) if bf16 => g.ty(m).numel() * 4,
            _ => 0,
        };
        let recompute = f.forward.is_none() as usize;
        let out = 0;
        let lse = out + recompute * align(q.numel() * elem);
        let delta = lse + recompute * align(rows * 4);
        let dq_acc = delta + align(rows * 4);
        let mask = dq_acc + if bf16 { align(q.numel() * 4) } else { 0 };
        FlashScratch {
            out,
            lse,
            delta,
            dq_acc,
            mask,
            total: mask + align(mask_len),
        }
    }
}
