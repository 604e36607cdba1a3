//! Passes over the SPMD training program, after partitioning.
//!
//! - [`strip_output_reshards`]: outputs read in their natural layout (the runner assembles
//!   partial sums and shards), so the step carries no collective only an output needed.
//! - [`embedding_grad_offsets`]: an `EmbeddingGrad` whose table is vocabulary-sharded reads
//!   shard-local ids (`RankOffset`), as the forward `Embedding` does.
//! - [`ddp_buckets`]: PyTorch DDP's gradient buckets: the `dp` all-reduces of the parameters'
//!   gradients grouped in reverse parameter order into buckets of at least 25 MiB (the first
//!   1 MiB), each one all-reduce of the concatenated gradients issued as soon as the last of
//!   them is computed.

use crate::autodiff::TrainGraph;
use crate::ir::{Graph, Op, TensorType, ValueId, ValueRole};
use crate::shard::{
    Provenance, ReshardReason, ShardError, ShardedBuilder, ShardedGraph, TensorSharding,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// DDP bucket size caps, in bytes (PyTorch: `bucket_cap_mb = 25`, first bucket 1 MiB).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketCaps {
    /// Cap of the first bucket (the last gradients computed).
    pub first_bytes: u64,
    /// Cap of every other bucket.
    pub bytes: u64,
}

impl Default for BucketCaps {
    fn default() -> BucketCaps {
        BucketCaps {
            first_bytes: 1 << 20,
            bytes: 25 << 20,
        }
    }
}

/// One DDP gradient bucket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Parameter labels, in bucket order (reverse parameter order).
    pub params: Vec<String>,
    /// Bytes per rank (local gradient sizes).
    pub bytes: u64,
    /// The node after which the bucket is reduced (the last of its gradients computed).
    pub ready_after: String,
}

/// Rebuilds a sharded graph node by node with remapped operands.
pub(super) struct Rebuild {
    /// The copy so far.
    pub(super) out: ShardedBuilder,
    /// Old node → its copy.
    pub(super) map: Vec<Option<ValueId>>,
}

impl Rebuild {
    pub(super) fn new(n: usize) -> Rebuild {
        Rebuild {
            out: ShardedBuilder::new("rebuilding"),
            map: vec![None; n],
        }
    }

    /// Copies node `v` of `old` with its operands remapped.
    fn copy(&mut self, old: &ShardedGraph, v: ValueId) -> Result<ValueId, ShardError> {
        let node = old.graph.node(v);
        self.copy_as(old, v, node.op.clone(), node.name.clone())
    }

    /// Copies node `v` of `old` as `op` labelled `name` (type, layer, role, layout and
    /// provenance kept; an `Input` takes no operands), its operands remapped.
    pub(super) fn copy_as(
        &mut self,
        old: &ShardedGraph,
        v: ValueId,
        op: Op,
        name: String,
    ) -> Result<ValueId, ShardError> {
        let node = old.graph.node(v);
        let inputs: Vec<ValueId> = match op {
            Op::Input { .. } => Vec::new(),
            _ => node
                .inputs
                .iter()
                .map(|i| self.map[i.index()].expect("invariant: operands are copied first"))
                .collect(),
        };
        let x = self.out.push(
            op,
            &inputs,
            Some(node.ty.clone()),
            name,
            (node.layer, node.role),
            old.shardings[v.index()].clone(),
            old.provenance[v.index()].clone(),
        )?;
        self.map[v.index()] = Some(x);
        Ok(x)
    }

    /// Slices each of `values` (a node of `old` with its label and layer) in turn out of the
    /// flat `packed`, laid out `flat`, and shapes it as the node (type, role, layout): the
    /// node's copy.
    fn unpack(
        &mut self,
        old: &ShardedGraph,
        packed: ValueId,
        flat: &TensorSharding,
        values: impl IntoIterator<Item = (ValueId, String, Option<u32>)>,
    ) -> Result<(), ShardError> {
        let mut start = 0;
        for (v, name, layer) in values {
            let node = old.graph.node(v);
            let len = node.ty.numel();
            let slice = self.out.push(
                Op::Slice { dim: 0, start, len },
                &[packed],
                None,
                format!("{name}.slice"),
                (layer, node.role),
                flat.clone(),
                None,
            )?;
            let x = self.out.push(
                Op::Reshape,
                &[slice],
                Some(node.ty.clone()),
                name,
                (layer, node.role),
                old.shardings[v.index()].clone(),
                None,
            )?;
            self.map[v.index()] = Some(x);
            start += len;
        }
        Ok(())
    }

    /// The copy, with `old`'s outputs pointing at their copies.
    fn finish(mut self, old: ShardedGraph) -> ShardedGraph {
        for (name, v) in &old.graph.outputs {
            let x = self.map[v.index()].expect("invariant: outputs are kept");
            self.out.graph.set_output(name, x);
        }
        self.into_graph(&old.mesh)
    }

    /// The copy on `mesh`, with the outputs set so far.
    pub(super) fn into_graph(self, mesh: &crate::shard::Mesh) -> ShardedGraph {
        self.out.finish(mesh.clone())
    }
}

/// Points the outputs named by `strip` at the value before the reshards the partitioner added
/// for them, and drops reshards no output needs any more.
pub(super) fn strip_output_reshards(
    sg: ShardedGraph,
    strip: impl Fn(&str) -> bool,
) -> Result<ShardedGraph, ShardError> {
    let n = sg.graph.len();
    let boundary = (0..n)
        .find(|&i| {
            sg.provenance[i]
                .as_ref()
                .is_some_and(|p| matches!(p.required_by, ReshardReason::Output { .. }))
        })
        .unwrap_or(n);
    let mut outputs = sg.graph.outputs.clone();
    for (name, v) in outputs.iter_mut() {
        if strip(name) {
            while v.index() >= boundary {
                *v = sg.graph.node(*v).inputs[0];
            }
        }
    }
    let mut keep = vec![false; n];
    keep[..boundary].fill(true);
    for (_, v) in &outputs {
        let mut x = *v;
        while x.index() >= boundary && !keep[x.index()] {
            keep[x.index()] = true;
            x = sg.graph.node(x).inputs[0];
        }
    }
    let mut r = Rebuild::new(n);
    for v in sg.graph.ids().filter(|v| keep[v.index()]) {
        r.copy(&sg, v)?;
    }
    for (name, v) in &outputs {
        let x = r.map[v.index()].expect("invariant: kept");
        r.out.graph.set_output(name, x);
    }
    Ok(r.out.finish(sg.mesh))
}

/// Gives every `EmbeddingGrad` whose table is vocabulary-sharded shard-local ids.
pub(super) fn embedding_grad_offsets(sg: ShardedGraph) -> Result<ShardedGraph, ShardError> {
    let g = &sg.graph;
    let mut fixes: BTreeMap<ValueId, (String, usize)> = BTreeMap::new();
    for v in g.ids() {
        if !matches!(g.node(v).op, Op::EmbeddingGrad) {
            continue;
        }
        let s = &sg.shardings[v.index()];
        match s.dims[0][..] {
            [] => {}
            [a] => {
                let axis = sg.mesh.axis_name(a).to_string();
                fixes.insert(v, (axis, g.ty(v).dim(0)));
            }
            _ => {
                return Err(ShardError::Unsupported(format!(
                    "gradient `{}`: vocabulary sharded over several axes ({})",
                    g.node(v).name,
                    s.display(&sg.mesh)
                )))
            }
        }
    }
    if fixes.is_empty() {
        return Ok(sg);
    }
    let mut r = Rebuild::new(g.len());
    // (ids value in the new graph, axis, stride) → offset ids.
    let mut offsets: BTreeMap<(ValueId, String, usize), ValueId> = BTreeMap::new();
    for v in g.ids() {
        let node = g.node(v);
        if let Op::RankOffset { axis, stride } = &node.op {
            let x = r.copy(&sg, v)?;
            let ids = r.map[node.inputs[0].index()].expect("invariant: copied");
            offsets.entry((ids, axis.clone(), *stride)).or_insert(x);
            continue;
        }
        let Some((axis, stride)) = fixes.get(&v) else {
            r.copy(&sg, v)?;
            continue;
        };
        let ids = r.map[node.inputs[0].index()].expect("invariant: copied");
        let key = (ids, axis.clone(), *stride);
        let local = match offsets.get(&key) {
            Some(&x) => x,
            None => {
                let op = Op::RankOffset {
                    axis: axis.clone(),
                    stride: *stride,
                };
                let s = sg.shardings[node.inputs[0].index()].clone();
                let id = g.node(node.inputs[0]);
                let name = format!("{}.rank_offset", id.name);
                let x = r
                    .out
                    .push(op, &[ids], None, name, (node.layer, id.role), s, None)?;
                offsets.insert(key, x);
                x
            }
        };
        let mut inputs: Vec<ValueId> = node
            .inputs
            .iter()
            .map(|i| r.map[i.index()].expect("invariant: copied"))
            .collect();
        inputs[0] = local;
        let x = r.out.push(
            node.op.clone(),
            &inputs,
            Some(node.ty.clone()),
            node.name.clone(),
            (node.layer, node.role),
            sg.shardings[v.index()].clone(),
            sg.provenance[v.index()].clone(),
        )?;
        r.map[v.index()] = Some(x);
    }
    Ok(r.finish(sg))
}

/// Whether `v` reads nothing but a parameter: a program input holding a parameter (shard), or
/// a view of one.
fn param_only(g: &Graph, v: ValueId) -> bool {
    let n = g.node(v);
    match n.op {
        Op::Input { .. } => n.role == ValueRole::Parameter,
        Op::Reshape => n.inputs.len() == 1 && param_only(g, n.inputs[0]),
        _ => false,
    }
}

/// Whether node `v` is an all-gather of a parameter (a ZeRO-3 / FSDP gather of a parameter
/// shard, or of a view of one).
fn param_gather(g: &Graph, v: ValueId) -> bool {
    let n = g.node(v);
    matches!(n.op, Op::AllGather { .. }) && n.inputs.len() == 1 && param_only(g, n.inputs[0])
}

/// The block key of a node of a layer: its layer and whether it runs in the backward pass (a
/// layer's forward and backward blocks are far apart in program order). Nodes outside the
/// layers, program inputs, parameter gathers and the views of saved values (placed where the
/// backward pass reads them) belong to no block.
fn block_key(g: &Graph, v: ValueId) -> Option<(u32, bool)> {
    let n = g.node(v);
    if matches!(n.op, Op::Input { .. } | Op::Param(_))
        || n.role == ValueRole::Saved
        || param_only(g, v)
        || param_gather(g, v)
    {
        return None;
    }
    let backward = matches!(
        n.role,
        ValueRole::Backward | ValueRole::Gradient | ValueRole::Recompute
    );
    Some((n.layer?, backward))
}

/// Context parallelism's ring (rule `ring-attention`): an indexed attention whose keys and
/// values are all-gathered over `axis` along the sequence becomes one `RingAttention` that
/// reads this rank's blocks and passes them round the ring, each block's attention
/// overlapping the next transfer. In a training step its backward goes round the ring too:
/// the three `AttentionGrad`s of the gathered K/V (and the reduce-scatters that return dK/dV
/// to the blocks) become one `RingAttentionGrad`, whose packed dq, dk, dv are sliced out
/// where they were read. What is left without readers (the gathers, the probabilities the
/// forward saved for the backward) is dropped.
pub(crate) fn ring_attention(sg: ShardedGraph, axis: &str) -> Result<ShardedGraph, ShardError> {
    let g = &sg.graph;
    let n = g.len();
    // Attention → (k source, v source, parts).
    let mut ring: BTreeMap<usize, (ValueId, ValueId, usize)> = BTreeMap::new();
    for v in g.ids() {
        let node = g.node(v);
        let Op::Attention(spec) = node.op else {
            continue;
        };
        let (k, vv) = (node.inputs[1], node.inputs[2]);
        if let (true, Some((ks, p)), Some((vs, q))) = (
            spec.indexed,
            seq_gather(g, axis, k),
            seq_gather(g, axis, vv),
        ) {
            if p == q {
                ring.insert(v.index(), (ks, vs, p));
            }
        }
    }
    if ring.is_empty() {
        return Ok(sg);
    }
    let backward = ring_backward(&sg, axis, &ring);
    let mut r = Rebuild::new(n);
    let live = live_after(g, &ring, &backward);
    for v in g.ids() {
        if let Some(group) = backward.first.get(&v.index()) {
            push_ring_grad(&mut r, &sg, axis, group)?;
        }
        if !live[v.index()] || r.map[v.index()].is_some() {
            continue;
        }
        let node = g.node(v);
        let Some(&(ks, vs, parts)) = ring.get(&v.index()) else {
            r.copy(&sg, v)?;
            continue;
        };
        let Op::Attention(spec) = node.op else {
            unreachable!("invariant: ring holds attentions");
        };
        let op = Op::RingAttention {
            spec,
            axis: axis.to_string(),
            parts,
        };
        let mut inputs = vec![node.inputs[0], ks, vs];
        inputs.extend(&node.inputs[3..]);
        let inputs: Vec<ValueId> = inputs
            .iter()
            .map(|i| r.map[i.index()].expect("invariant: operands are copied first"))
            .collect();
        let x = r.out.push(
            op,
            &inputs,
            Some(node.ty.clone()),
            node.name.clone(),
            (node.layer, node.role),
            sg.shardings[v.index()].clone(),
            Some(ring_provenance(&sg, ks, node.inputs[1])),
        )?;
        r.map[v.index()] = Some(x);
    }
    Ok(r.finish(sg))
}

/// When `x` is an all-gather over `axis` along the sequence (dim 1): its operand and the
/// number of parts.
fn seq_gather(g: &Graph, axis: &str, x: ValueId) -> Option<(ValueId, usize)> {
    match &g.node(x).op {
        Op::AllGather {
            axis: a,
            dim: 1,
            parts,
        } if a == axis => Some((g.node(x).inputs[0], *parts)),
        _ => None,
    }
}

/// Why a ring op exchanges: K/V read in blocks where the layout gathered them.
fn ring_provenance(sg: &ShardedGraph, local: ValueId, gathered: ValueId) -> Provenance {
    Provenance {
        value: sg.graph.node(local).name.clone(),
        from: sg.shardings[local.index()].display(&sg.mesh),
        to: sg.shardings[gathered.index()].display(&sg.mesh),
        required_by: ReshardReason::Rule {
            rule: "ring-attention".into(),
        },
    }
}

/// One ring attention's backward: its operands and the nodes its packed gradient replaces.
struct RingGrad {
    spec: crate::ir::AttnSpec,
    /// The attention's output (forward, or recomputed).
    o: ValueId,
    /// The mask and indices the probabilities were computed with.
    keys: Vec<ValueId>,
    /// A name for the packed gradient.
    name: String,
    q: ValueId,
    k: ValueId,
    v: ValueId,
    dy: ValueId,
    parts: usize,
    /// Read where dq was: the `AttentionGrad` wrt q.
    dq: ValueId,
    /// Read where dk and dv were: the reduce-scatters of the gathered gradients.
    dk: ValueId,
    dv: ValueId,
    /// The nodes no longer computed: the gathered gradients wrt k and v.
    gone: [ValueId; 2],
}

/// The ring attentions' backward passes found in a program.
struct RingBackward {
    /// By the index of the group's first node (where the packed gradient is made).
    first: BTreeMap<usize, RingGrad>,
}

/// The `AttentionGrad`s of the attentions going round the ring: for each, the three
/// gradients of the same forward (through its probabilities) and upstream gradient, read
/// from K/V gathered over `axis`, with dK and dV reduce-scattered back over it and read
/// nowhere else. Attentions whose backward has another shape keep it.
fn ring_backward(
    sg: &ShardedGraph,
    axis: &str,
    ring: &BTreeMap<usize, (ValueId, ValueId, usize)>,
) -> RingBackward {
    use crate::ir::AttnWrt;
    let g = &sg.graph;
    let users = g.users();
    let through_views = |mut x: ValueId| {
        while matches!(g.node(x).op, Op::Reshape) {
            x = g.node(x).inputs[0];
        }
        x
    };
    let gather_of = |x: ValueId| seq_gather(g, axis, x);
    // An attention by its query and the keys its gather reads (through views: the backward
    // reads the saved copies).
    let qk = |q: ValueId, kg: ValueId| -> Option<(usize, usize)> {
        let (k, _) = gather_of(kg)?;
        Some((through_views(q).index(), through_views(k).index()))
    };
    let by_qk: BTreeMap<(usize, usize), ValueId> = ring
        .keys()
        .filter_map(|&a| {
            let n = g.node(ValueId(a as u32));
            Some((qk(n.inputs[0], n.inputs[1])?, ValueId(a as u32)))
        })
        .collect();
    // (attention, dy) → the gradient node per operand.
    let mut grads: BTreeMap<(usize, usize), [Option<ValueId>; 3]> = BTreeMap::new();
    for v in g.ids() {
        let node = g.node(v);
        let Op::AttentionGrad { wrt, spec } = node.op else {
            continue;
        };
        if !spec.indexed || node.inputs.len() != 5 {
            continue;
        }
        let probs = g.node(through_views(node.inputs[4]));
        if !matches!(probs.op, Op::AttentionProbs(_)) {
            continue;
        }
        let Some(&a) = qk(probs.inputs[0], probs.inputs[1]).and_then(|key| by_qk.get(&key)) else {
            continue;
        };
        let slot = match wrt {
            AttnWrt::Q => 0,
            AttnWrt::K => 1,
            AttnWrt::V => 2,
        };
        grads
            .entry((a.index(), node.inputs[3].index()))
            .or_default()[slot] = Some(v);
    }
    let mut first = BTreeMap::new();
    for ((a, dy), [gq, gk, gv]) in grads {
        let (Some(gq), Some(gk), Some(gv)) = (gq, gk, gv) else {
            continue;
        };
        let gnode = g.node(gq);
        // The three read the same operands; k and v gathered over the ring's axis.
        let same = [gk, gv].iter().all(|&x| g.node(x).inputs == gnode.inputs);
        let (Some((k, p)), Some((v, p2))) =
            (gather_of(gnode.inputs[1]), gather_of(gnode.inputs[2]))
        else {
            continue;
        };
        // dK, dV each reduce-scattered back to the blocks, and read nowhere else.
        let scattered = |x: ValueId| -> Option<ValueId> {
            let us = &users[x.index()];
            if us.len() != 1 || g.outputs.iter().any(|(_, o)| *o == x) {
                return None;
            }
            match &g.node(us[0]).op {
                Op::ReduceScatter {
                    axis: ax,
                    dim: 1,
                    parts,
                } if ax == axis && *parts == p => Some(us[0]),
                _ => None,
            }
        };
        let (Some(dk), Some(dv)) = (scattered(gk), scattered(gv)) else {
            continue;
        };
        if !same || p != p2 || ring[&a].2 != p {
            continue;
        }
        let at = gq.index().min(gk.index()).min(gv.index());
        let probs = g.node(through_views(gnode.inputs[4]));
        let Op::AttentionProbs(spec) = probs.op else {
            continue;
        };
        first.insert(
            at,
            RingGrad {
                spec,
                o: ValueId(a as u32),
                keys: probs.inputs[2..].to_vec(),
                name: format!("{}.ring_grad", g.node(ValueId(a as u32)).name),
                q: gnode.inputs[0],
                k,
                v,
                dy: ValueId(dy as u32),
                parts: p,
                dq: gq,
                dk,
                dv,
                gone: [gk, gv],
            },
        );
    }
    RingBackward { first }
}

/// Which nodes the ring program keeps: everything the outputs (and inputs) still need once
/// the ring attentions read K/V blocks and their backward is one ring op.
fn live_after(
    g: &Graph,
    ring: &BTreeMap<usize, (ValueId, ValueId, usize)>,
    backward: &RingBackward,
) -> Vec<bool> {
    // Each node's operands in the new program.
    let replaced: BTreeMap<usize, Vec<ValueId>> = backward
        .first
        .values()
        .flat_map(|r| {
            let mut ins = vec![r.q, r.k, r.v, r.o, r.dy];
            ins.extend(&r.keys);
            [r.dq, r.dk, r.dv].map(|x| (x.index(), ins.clone()))
        })
        .collect();
    let operands = |v: ValueId| -> Vec<ValueId> {
        if let Some(ins) = replaced.get(&v.index()) {
            return ins.clone();
        }
        let node = g.node(v);
        match ring.get(&v.index()) {
            Some(&(ks, vs, _)) => {
                let mut ins = vec![node.inputs[0], ks, vs];
                ins.extend(&node.inputs[3..]);
                ins
            }
            None => node.inputs.clone(),
        }
    };
    let mut live = vec![false; g.len()];
    let mut stack: Vec<ValueId> = g.outputs.iter().map(|(_, v)| *v).collect();
    stack.extend(
        g.ids()
            .filter(|&v| matches!(g.node(v).op, Op::Input { .. })),
    );
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut live[v.index()], true) {
            continue;
        }
        stack.extend(operands(v));
    }
    live
}

/// Pushes ring attention backward `r` (its packed gradient, then dq, dk and dv sliced out
/// and shaped as the values they replace, which map to them).
fn push_ring_grad(
    rb: &mut Rebuild,
    sg: &ShardedGraph,
    axis: &str,
    r: &RingGrad,
) -> Result<(), ShardError> {
    let g = &sg.graph;
    let mut inputs = vec![r.q, r.k, r.v, r.o, r.dy];
    inputs.extend(&r.keys);
    let inputs: Vec<ValueId> = inputs
        .iter()
        .map(|i| rb.map[i.index()].expect("invariant: operands are copied first"))
        .collect();
    let dq = g.node(r.dq);
    // The pack differs on every rank of the axes that split any of its parts.
    let mut axes: Vec<crate::shard::AxisId> = [r.dq, r.dk, r.dv]
        .iter()
        .flat_map(|x| sg.shardings[x.index()].used_axes())
        .collect();
    axes.extend(sg.mesh.axis(axis));
    axes.sort();
    axes.dedup();
    let flat = TensorSharding::split(1, 0, &axes);
    let packed = rb.out.push(
        Op::RingAttentionGrad {
            spec: r.spec,
            axis: axis.to_string(),
            parts: r.parts,
        },
        &inputs,
        None,
        r.name.clone(),
        (dq.layer, dq.role),
        flat.clone(),
        Some(ring_provenance(sg, r.k, g.node(r.gone[0]).inputs[1])),
    )?;
    // Named as the gradients they are (dk and dv no longer come from a reduce-scatter).
    let names = [r.dq, r.gone[0], r.gone[1]].map(|x| g.node(x).name.clone());
    let grads = [r.dq, r.dk, r.dv].into_iter().zip(names);
    let grads = grads.map(|(x, name)| (x, name, g.node(x).layer));
    rb.unpack(sg, packed, &flat, grads)
}

/// `prefetch`: every parameter all-gather moved to the start of the layer block that runs
/// before the block of its first use (in the backward pass the next layer's block, which runs
/// first), so that the schedule's communication stream runs it while that block computes —
/// FSDP's forward and backward prefetch of one layer. The order is otherwise unchanged (a
/// gather reads only a program input, so moving it earlier keeps the program valid); the
/// gathered parameters of two blocks are live at once, as under FSDP. The views that name a
/// collective's result as an output (a gradient reduce-scattered per micro-batch under ZeRO-2/3)
/// are dropped where they change nothing, else moved to the end, so the compute stream does not
/// stop at each reduce-scatter. Programs with neither are returned as they are.
pub(super) fn prefetch_param_gathers(sg: ShardedGraph) -> Result<ShardedGraph, ShardError> {
    let g = &sg.graph;
    let n = g.len();
    let users = g.users();
    // For each node, where its block run starts and where the run before it starts.
    let mut start: Vec<Option<usize>> = vec![None; n];
    let mut prev_start: Vec<Option<usize>> = vec![None; n];
    let (mut cur, mut cur_start, mut before) = (None, 0usize, None);
    for v in g.ids() {
        if let Some(k) = block_key(g, v) {
            if cur != Some(k) {
                before = cur.map(|_| cur_start);
                cur = Some(k);
                cur_start = v.index();
            }
        }
        start[v.index()] = cur.map(|_| cur_start);
        prev_start[v.index()] = before;
    }
    // Each parameter gather goes to the start of the block before its first user's (the first
    // block's to its own start, ahead of the next block's; a user outside the layers, such as
    // the LM head, to the start of the block it follows), in program order.
    let mut moved: BTreeMap<usize, Vec<ValueId>> = BTreeMap::new();
    let mut is_moved = vec![false; n];
    for v in g.ids().filter(|&v| param_gather(g, v)) {
        let Some(&u) = users[v.index()].iter().min() else {
            continue;
        };
        let t = match block_key(g, u) {
            Some(_) => prev_start[u.index()].or(start[u.index()]),
            None => start[u.index()],
        };
        if let Some(t) = t.filter(|&t| t < v.index()) {
            moved.entry(t).or_default().push(v);
            is_moved[v.index()] = true;
        }
    }
    // A view naming a collective's result as a program output (a gradient reduce-scattered per
    // micro-batch) would make the compute stream wait for that collective where it stands:
    // an identity view is dropped (the output names the collective's result), another moves to
    // the end of the program.
    let mut elided = vec![false; n];
    for v in g.ids() {
        let node = g.node(v);
        let view = matches!(node.op, Op::Reshape)
            && users[v.index()].is_empty()
            && node.inputs.len() == 1
            && g.node(node.inputs[0]).op.is_collective();
        if !view {
            continue;
        }
        if g.ty(node.inputs[0]) == &node.ty
            && sg.shardings[node.inputs[0].index()] == sg.shardings[v.index()]
        {
            elided[v.index()] = true;
        } else {
            moved.entry(n).or_default().push(v);
            is_moved[v.index()] = true;
        }
    }
    if moved.is_empty() && !elided.contains(&true) {
        return Ok(sg);
    }
    let mut r = Rebuild::new(n);
    // A moved gather takes its parameter's view (and input) along.
    fn emit(r: &mut Rebuild, sg: &ShardedGraph, v: ValueId) -> Result<(), ShardError> {
        for &i in &sg.graph.node(v).inputs {
            if r.map[i.index()].is_none() {
                emit(r, sg, i)?;
            }
        }
        r.copy(sg, v).map(|_| ())
    }
    for v in g.ids() {
        for &c in moved.get(&v.index()).into_iter().flatten() {
            emit(&mut r, &sg, c)?;
        }
        if elided[v.index()] {
            r.map[v.index()] = r.map[g.node(v).inputs[0].index()];
            continue;
        }
        if is_moved[v.index()] || r.map[v.index()].is_some() {
            continue;
        }
        r.copy(&sg, v)?;
    }
    for &c in moved.get(&n).into_iter().flatten() {
        emit(&mut r, &sg, c)?;
    }
    Ok(r.finish(sg))
}

/// DDP's bucket assignment: parameters in reverse order, a bucket closes once its size reaches
/// its cap (the first cap for the first bucket). Returns indices into `sizes`.
pub(super) fn assign_buckets(sizes: &[u64], caps: &BucketCaps) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut bytes = 0u64;
    for i in (0..sizes.len()).rev() {
        cur.push(i);
        bytes += sizes[i];
        let cap = if out.is_empty() {
            caps.first_bytes
        } else {
            caps.bytes
        };
        if bytes >= cap {
            out.push(std::mem::take(&mut cur));
            bytes = 0;
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Groups the `dp` all-reduces of gradients into DDP buckets.
pub(super) fn ddp_buckets(
    sg: ShardedGraph,
    tg: &TrainGraph,
    caps: &BucketCaps,
) -> Result<(ShardedGraph, Vec<Bucket>), ShardError> {
    let g = &sg.graph;
    // The dp all-reduce of each parameter's gradient (the annotation's reshard).
    let mut ar_of: BTreeMap<String, ValueId> = BTreeMap::new();
    for v in g.ids() {
        let node = g.node(v);
        let (Op::AllReduce { axis }, Some(p)) = (&node.op, &sg.provenance[v.index()]) else {
            continue;
        };
        let Some(label) = ValueRole::gradient_label(&p.value) else {
            continue;
        };
        if axis == "dp" && matches!(p.required_by, ReshardReason::Annotation { .. }) {
            ar_of.insert(label.to_string(), v);
        }
    }
    let members: Vec<(usize, ValueId)> = tg
        .params
        .iter()
        .enumerate()
        .filter_map(|(i, p)| ar_of.get(&p.label).map(|&v| (i, v)))
        .collect();
    if members.is_empty() {
        return Ok((sg, Vec::new()));
    }
    let sizes: Vec<u64> = members
        .iter()
        .map(|&(_, v)| g.ty(v).size_bytes() as u64)
        .collect();
    let groups = assign_buckets(&sizes, caps);
    // Each bucket is reduced right after the last operand of its members is computed.
    let mut at: BTreeMap<ValueId, Vec<usize>> = BTreeMap::new();
    let mut buckets = Vec::new();
    let mut skip: BTreeSet<ValueId> = BTreeSet::new();
    for (b, group) in groups.iter().enumerate() {
        let ready = group
            .iter()
            .map(|&i| g.node(members[i].1).inputs[0])
            .max()
            .expect("invariant: buckets are not empty");
        at.entry(ready).or_default().push(b);
        for &i in group {
            skip.insert(members[i].1);
        }
        buckets.push(Bucket {
            params: group
                .iter()
                .map(|&i| tg.params[members[i].0].label.clone())
                .collect(),
            bytes: group.iter().map(|&i| sizes[i]).sum(),
            ready_after: g.node(ready).name.clone(),
        });
    }
    // Nodes that read a reduced gradient before its bucket (e.g. a further reduction over
    // another axis) wait until the bucket is emitted; order is otherwise kept.
    let mut r = Rebuild::new(g.len());
    let mut pending: Vec<ValueId> = Vec::new();
    let ready_inputs =
        |r: &Rebuild, v: ValueId| g.node(v).inputs.iter().all(|i| r.map[i.index()].is_some());
    for v in g.ids() {
        if skip.contains(&v) {
            continue;
        }
        pending.push(v);
        while let Some(pos) = pending.iter().position(|&u| ready_inputs(&r, u)) {
            let u = pending.remove(pos);
            r.copy(&sg, u)?;
            for &b in at.get(&u).map(Vec::as_slice).unwrap_or(&[]) {
                emit_bucket(&mut r, &sg, b, &groups[b], &members, &buckets[b])?;
            }
        }
    }
    if let Some(&u) = pending.first() {
        return Err(ShardError::Internal(format!(
            "`{}` waits for a gradient bucket that is never reduced",
            g.node(u).name
        )));
    }
    Ok((r.finish(sg), buckets))
}

/// Flatten, concatenate, one all-reduce, split: the bucket's reduction.
fn emit_bucket(
    r: &mut Rebuild,
    sg: &ShardedGraph,
    b: usize,
    group: &[usize],
    members: &[(usize, ValueId)],
    bucket: &Bucket,
) -> Result<(), ShardError> {
    let g = &sg.graph;
    // The bucket's own nodes hold gradients; a member's keep its gradient's role.
    let layer = (None, ValueRole::Gradient);
    let flat_s = |partial: bool| {
        let mut s = TensorSharding::replicated(1);
        if partial {
            s.partial = sg.mesh.axis("dp").into_iter().collect();
        }
        s
    };
    let mut flats = Vec::with_capacity(group.len());
    for &i in group {
        let ar = members[i].1;
        let src = g.node(ar).inputs[0];
        let x = r.map[src.index()].expect("invariant: ready before the bucket");
        let n = g.ty(ar).numel();
        let ty = TensorType::plain(g.ty(ar).dtype, &[n]);
        let name = format!("{}.flat", g.node(src).name);
        let tag = (None, g.node(src).role);
        flats.push(
            r.out
                .push(Op::Reshape, &[x], Some(ty), name, tag, flat_s(true), None)?,
        );
    }
    let cat = r.out.push(
        Op::Concat { dim: 0 },
        &flats,
        None,
        format!("ddp.bucket{b}"),
        layer,
        flat_s(true),
        None,
    )?;
    let prov = Provenance {
        value: format!("ddp.bucket{b}"),
        from: "partial(dp)".into(),
        to: "replicated".into(),
        required_by: ReshardReason::DdpBucket {
            bucket: b,
            bytes: bucket.bytes,
            params: bucket.params.clone(),
            ready_after: bucket.ready_after.clone(),
        },
    };
    let op = Op::AllReduce { axis: "dp".into() };
    let red = r.out.push(
        op,
        &[cat],
        None,
        format!("ddp.bucket{b}.all_reduce"),
        layer,
        flat_s(false),
        Some(prov),
    )?;
    let reduced = group.iter().map(|&i| {
        let ar = members[i].1;
        (ar, g.node(ar).name.clone(), None)
    });
    r.unpack(sg, red, &flat_s(false), reduced)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_ddp_reverse_order_and_caps() {
        let mib = 1u64 << 20;
        let caps = BucketCaps::default();
        // Reverse order: 5 (0.5 MiB), 4 (0.75 MiB) → 1.25 MiB ≥ 1 MiB closes the first bucket;
        // then 3, 2 (20 + 10 MiB) close the second; 1, 0 remain.
        let sizes = [mib, 2 * mib, 10 * mib, 20 * mib, 3 * mib / 4, mib / 2];
        assert_eq!(
            assign_buckets(&sizes, &caps),
            vec![vec![5, 4], vec![3, 2], vec![1, 0]]
        );
        // Everything fits the first bucket.
        assert_eq!(assign_buckets(&[10, 20], &caps), vec![vec![1, 0]]);
    }

    fn compile_fixture(
        model: &str,
        mesh: &str,
        strategies: &[&str],
        layers: usize,
    ) -> crate::train::CompiledTrain {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = root.join("tests/fixtures/hf-tiny").join(model);
        let mut cfg = crate::model::ModelConfig::from_path(&dir).expect("config");
        cfg.layers = layers;
        let mesh = crate::shard::Mesh::parse(mesh, 8).expect("mesh");
        let mut o = crate::train::TrainOptions::new(4, 16, mesh);
        o.extra_strategies = strategies.iter().map(|s| s.to_string()).collect();
        crate::train::compile_train(&cfg, &o).expect("compile")
    }

    fn fixture_step(strategy: &str, layers: usize) -> crate::train::CompiledTrain {
        compile_fixture("llama", "dp=2", &[strategy], layers)
    }

    /// Experts over `ep` with data replicas over `dp`: the tokens routed to the experts stay
    /// split over `dp` (an all-to-all over `ep` moves them, nothing gathers them), so no
    /// expert-major value is ever all-gathered.
    #[test]
    fn experts_on_ep_keep_the_batch_split_over_dp() {
        let c = compile_fixture("mixtral", "dp=2,ep=2", &[], 2);
        let g = &c.sharded.graph;
        let mut to_all = 0;
        for v in g.ids() {
            let n = g.node(v);
            let expert_major =
                n.ty.dims
                    .first()
                    .is_some_and(|d| d.role == crate::ir::Role::Expert);
            match n.op {
                Op::AllGather { .. } => {
                    assert!(!expert_major, "`{}` gathers experts' tokens", n.name)
                }
                Op::AllToAll { .. } => to_all += 1,
                _ => {}
            }
        }
        assert!(to_all > 0);
    }

    /// FSDP's micro-batch program: every parameter gather but the first layer's (and the
    /// embedding's, used first) is issued a whole layer block before its first use, the first
    /// layer's ahead of its block; the reduce-scattered gradients' output views come last.
    #[test]
    fn parameter_gathers_run_one_layer_block_ahead() {
        let c = fixture_step("fsdp", 4);
        let g = &c.split.as_ref().expect("split").micro.graph;
        let users = g.users();
        let mut ahead = 0;
        for v in g.ids().filter(|&v| param_gather(g, v)) {
            let u = *users[v.index()].iter().min().expect("used");
            let Some(ku) = block_key(g, u) else {
                continue;
            };
            if ku == (0, false) {
                continue;
            }
            let other_block = (v.index() + 1..u.index())
                .filter_map(|i| block_key(g, ValueId(i as u32)))
                .any(|k| k != ku);
            assert!(
                other_block,
                "`{}` is issued in the block of its use",
                g.node(v).name
            );
            ahead += 1;
        }
        assert!(ahead >= 2 * 3 * 9, "{ahead} gathers ahead");
        // The gradients leave as the reduce-scatters' results (no view for the compute stream
        // to wait on), and the schedule waits for them at the end.
        let grads: Vec<ValueId> = g
            .outputs
            .iter()
            .filter(|(name, _)| ValueRole::gradient_label(name).is_some())
            .map(|&(_, v)| v)
            .collect();
        assert!(!grads.is_empty());
        for &v in &grads {
            assert_eq!(
                g.node(v).op.mnemonic(),
                "reduce_scatter",
                "{}",
                g.node(v).name
            );
        }
        let steps = crate::schedule::schedule(g);
        let last_compute = steps
            .iter()
            .rposition(|s| {
                matches!(
                    s,
                    crate::schedule::Step::Kernel { .. } | crate::schedule::Step::Gemm { .. }
                )
            })
            .expect("compute");
        let waits_after = steps[last_compute..]
            .iter()
            .filter(|s| matches!(s, crate::schedule::Step::Wait { stream: 0, .. }))
            .count();
        assert!(
            waits_after >= grads.len() - 1,
            "{waits_after} waits at the end"
        );
        // Without parameter gathers or reduce-scattered outputs the program is unchanged.
        let z1 = fixture_step("zero1", 4);
        let s = z1.split.as_ref().expect("split");
        let again = prefetch_param_gathers(s.micro.clone()).expect("prefetch");
        assert_eq!(again.graph, s.micro.graph);
    }
}
