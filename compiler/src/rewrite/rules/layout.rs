//! Layout choice (`layout`): the rules by which a program whose ranks each compute the whole
//! model (a `tp` axis under the `replicated` strategy) holds, per matmul, the replicated,
//! column-parallel and row-parallel forms at once, so the extractor picks each layer's
//! layout under the cost model (the intra-operator half of Alpa's search, done by equality
//! saturation). A column-parallel matmul's gather moves down through the per-head ops
//! (reshapes, rotary embedding, attention) and cancels against the next row-parallel
//! matmul's slice (`slice-of-gather`): Megatron's layout is one program of the e-graph, a
//! replicated attention with a split MLP another.
//!
//! These rules change which weights a rank holds (`slice-leaf` turns the slice of a whole
//! parameter into a sharded parameter), so `all` leaves them out: they are selected by name,
//! by the group `layout`, or by `shardc search --space layers`.

use super::{add, add_like, int, nodes_where, op_at, op_id, ty};
use super::{rep_over, RuleImpl};
use crate::ir::{Op, ShardSpec};
use crate::rewrite::analysis::SpmdEGraph;
use crate::rewrite::lang::OpKey;
use egg::Id;
use std::sync::Arc;

/// The rules of this file.
pub(crate) fn rules() -> Vec<Arc<dyn RuleImpl>> {
    vec![
        Arc::new(TpColumn),
        Arc::new(TpRow),
        Arc::new(SliceLeaf),
        Arc::new(SinkReshapeSplit),
        Arc::new(SinkRopeHeads),
        Arc::new(SinkAttention),
        Arc::new(ReduceSink),
    ]
}

/// The mesh axes of more than one rank over which every class of `cs` is replicated: their
/// positions in the mesh and sizes.
fn shared_axes(eg: &SpmdEGraph, cs: &[Id]) -> Vec<(usize, usize)> {
    let mesh = &eg.analysis.mesh;
    (0..mesh.axes.len())
        .filter(|&i| {
            let a = &mesh.axes[i];
            a.size > 1 && cs.iter().all(|&c| rep_over(eg, c, &a.name))
        })
        .map(|i| (i, mesh.axes[i].size))
        .collect()
}

/// The name and size of the mesh axis at position `m` of a match.
fn axis_at(eg: &SpmdEGraph, m: Id) -> Option<(String, usize)> {
    let a = eg.analysis.mesh.axes.get(usize::from(m))?;
    Some((a.name.clone(), a.size))
}

/// The matmuls of `class`: `(node op, x, w, the weight's output dim, its input dim)` (the
/// weight's last two dims are the matrix; a 3-D weight holds one matrix per expert).
fn matmuls(eg: &SpmdEGraph, class: Id) -> Vec<(Id, Id, Id, usize, usize)> {
    nodes_where(eg, class, |o| matches!(o, Op::MatMul { .. }))
        .filter_map(|(n, op)| {
            let Op::MatMul { transpose_b } = op else {
                return None;
            };
            let (x, w) = (n.children[0], n.children[1]);
            let r = ty(eg, w).rank();
            if r < 2 || ty(eg, x).rank() < 2 {
                return None;
            }
            let (out, inp) = if *transpose_b {
                (r - 2, r - 1)
            } else {
                (r - 1, r - 2)
            };
            Some((op_id(n.op), x, w, out, inp))
        })
        .collect()
}

/// The matches `[op, x, w, d, axis]` that split a matmul of `class` over a mesh axis of more
/// than one rank both its operands are replicated over: `d` the weight dim `pick` chooses of
/// (output, input), divisible by the axis size, and `x` one that `x_splits(x, size)` accepts.
fn split_matmuls(
    eg: &SpmdEGraph,
    class: Id,
    out: &mut Vec<Vec<Id>>,
    pick: fn(usize, usize) -> usize,
    x_splits: impl Fn(Id, usize) -> bool,
) {
    for (op, x, w, n, k) in matmuls(eg, class) {
        let d = pick(n, k);
        for (a, parts) in shared_axes(eg, &[x, w]) {
            if ty(eg, w).dim(d) % parts == 0 && x_splits(x, parts) {
                out.push(vec![op, x, w, int(d), int(a)]);
            }
        }
    }
}

/// `tp-column`: `matmul(x, w) ⇒ all_gather_a,last(matmul(x, local_slice_a,n(w)))`, `n` the
/// output dim of the weight's matrix (experts' stacked matrices alike), `x` and `w` replicated over `a` (each rank computes a block of
/// output columns).
pub(crate) struct TpColumn;

impl RuleImpl for TpColumn {
    rule_header! {
        name: "tp-column",
        group: "layout",
        identity: "matmul(x, w) => all_gather_a,last(matmul(x, local_slice_a,n(w))), n the output dim of w's matrix (its last two dims), x and w replicated over a",
        in_all: false,
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        split_matmuls(eg, class, out, |n, _| n, |_, _| true);
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let f = op_at(eg, m[0]);
        let (x, w, n) = (m[1], m[2], usize::from(m[3]));
        let (axis, parts) = axis_at(eg, m[4])?;
        let ws = add(eg, self.name(), slice(&axis, n, parts), vec![w])?;
        let local = add_like(eg, self.name(), f, vec![x, ws], class)?;
        let last = ty(eg, class).rank() - 1;
        let ag = Op::AllGather {
            axis,
            dim: last,
            parts,
        };
        add(eg, self.name(), ag, vec![local])
    }
}

/// `tp-row`: `matmul(x, w) ⇒ all_reduce_a(matmul(local_slice_a,last(x), local_slice_a,k(w)))`,
/// `k` the weight's input dim, `x` and `w` replicated over `a` (each rank sums a block of the
/// contraction).
pub(crate) struct TpRow;

impl RuleImpl for TpRow {
    rule_header! {
        name: "tp-row",
        group: "layout",
        identity: "matmul(x, w) => all_reduce_a(matmul(local_slice_a,last(x), local_slice_a,k(w))), k the input dim of w's matrix (its last two dims), x and w replicated over a",
        in_all: false,
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        split_matmuls(
            eg,
            class,
            out,
            |_, k| k,
            |x, parts| ty(eg, x).last() % parts == 0,
        );
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let f = op_at(eg, m[0]);
        let (x, w, k) = (m[1], m[2], usize::from(m[3]));
        let (axis, parts) = axis_at(eg, m[4])?;
        let last = ty(eg, x).rank() - 1;
        let xs = add(eg, self.name(), slice(&axis, last, parts), vec![x])?;
        let ws = add(eg, self.name(), slice(&axis, k, parts), vec![w])?;
        let partial = add_like(eg, self.name(), f, vec![xs, ws], class)?;
        add(eg, self.name(), Op::AllReduce { axis }, vec![partial])
    }
}

fn slice(axis: &str, dim: usize, parts: usize) -> Op {
    Op::LocalSlice {
        axis: axis.into(),
        dim,
        parts,
    }
}

/// `slice-leaf`: `local_slice_a,d(p) ⇒ p'` for a parameter `p` replicated over `a` and not
/// yet split along `d`, `p'` the same parameter split over `a` along `d` (each rank loads only
/// its block: a weight sliced for a tensor-parallel matmul is stored sharded). Inputs keep
/// their one declared layout (a program names each input once).
pub(crate) struct SliceLeaf;

impl RuleImpl for SliceLeaf {
    rule_header! {
        name: "slice-leaf",
        group: "layout",
        identity: "local_slice_a,d(p) => p split over a along d, p a parameter replicated over a and not split along d",
        in_all: false,
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, op) in nodes_where(eg, class, |o| matches!(o, Op::LocalSlice { .. })) {
            let Op::LocalSlice { axis, dim, .. } = op else {
                continue;
            };
            let p = n.children[0];
            if !rep_over(eg, p, axis) {
                continue;
            }
            for leaf in &eg[p].nodes {
                let Op::Param(src) = &eg.analysis.ops.get(leaf.op).op else {
                    continue;
                };
                let shards = &src.shards;
                if shards.iter().all(|s| s.dim != *dim && s.axis != *axis) {
                    out.push(vec![op_id(n.op), op_id(leaf.op), p]);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let Op::LocalSlice { axis, dim, parts } = op_at(eg, m[0]) else {
            return None;
        };
        let key = eg
            .analysis
            .ops
            .get(super::OpId(usize::from(m[1]) as u32))
            .clone();
        let spec = ShardSpec { dim, axis, parts };
        let Op::Param(mut src) = key.op else {
            return None;
        };
        src.shards.push(spec);
        let op = Op::Param(src);
        let key = OpKey {
            op,
            declared: Some(ty(eg, class).clone()),
            leaf: key.leaf,
        };
        // The new leaf takes the parameter's name, layer and role.
        super::add_key(eg, self.name(), key, Vec::new(), m[2])
    }
}

/// `gather-sink-reshape-split`: `reshape(all_gather_a,d(x)) ⇒ all_gather_a,d(reshape'(x))`
/// when the reshape keeps dims `0..d` and regroups `d` with the dims after it (a hidden dim
/// split into heads, heads merged back), the result's dim `d` divisible by `|a|`: rank `r`'s
/// block of the flattened tail is the `r`-th block of the result's dim `d` either way.
pub(crate) struct SinkReshapeSplit;

impl RuleImpl for SinkReshapeSplit {
    rule_header! {
        name: "gather-sink-reshape-split",
        group: "layout",
        identity: "reshape(all_gather_a,d(x)) => all_gather_a,d(reshape'(x)), dims 0..d unchanged, dim d regrouped with the dims after it, the result's dim d divisible by |a|",
        in_all: false,
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        super::reshape_gathers(eg, class, out, |from, to, d, parts| {
            d < to.rank()
                && d < from.rank()
                && (0..d).all(|i| from.dim(i) == to.dim(i))
                && from.dim(d) != to.dim(d)
                && to.dim(d) % parts == 0
        });
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        super::sink_reshape(eg, self.name(), class, m)
    }
}

/// `gather-sink-rope-heads`: `rope(all_gather_a,2(x), pos) ⇒ all_gather_a,2(rope(x, pos))`:
/// the rotary embedding turns each head by its position alone.
pub(crate) struct SinkRopeHeads;

impl RuleImpl for SinkRopeHeads {
    rule_header! {
        name: "gather-sink-rope-heads",
        group: "layout",
        identity: "rope(all_gather_a,heads(x), pos) => all_gather_a,heads(rope(x, pos))",
        in_all: false,
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::Rope(_))) {
            let gathers = nodes_where(eg, n.children[0], |o| {
                matches!(o, Op::AllGather { dim: 2, .. })
            });
            for (g, _) in gathers {
                out.push(vec![op_id(n.op), op_id(g.op), g.children[0], n.children[1]]);
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        super::sink(eg, self.name(), class, m[0], m[1], vec![m[2], m[3]])
    }
}

/// `gather-sink-attention`: `attention(all_gather_a,heads(q), k, v, m..) ⇒
/// all_gather_a,heads(attention(q, local_slice_a,heads(k), local_slice_a,heads(v), m..))` for
/// `k`, `v` and the masks replicated over `a` and KV heads divisible by `|a|` (rank `r`'s
/// query heads read exactly the `r`-th block of KV heads).
pub(crate) struct SinkAttention;

impl RuleImpl for SinkAttention {
    rule_header! {
        name: "gather-sink-attention",
        group: "layout",
        identity: "attention(all_gather_a,heads(q), k, v, m..) => all_gather_a,heads(attention(q, local_slice_a,heads(k), local_slice_a,heads(v), m..)), k, v, m replicated over a, kv heads divisible by |a|",
        in_all: false,
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::Attention(_))) {
            let k = n.children[1];
            for (g, gop) in nodes_where(eg, n.children[0], |o| {
                matches!(o, Op::AllGather { dim: 2, .. })
            }) {
                let Op::AllGather { axis, parts, .. } = gop else {
                    continue;
                };
                let rest_rep = n.children[1..].iter().all(|&c| rep_over(eg, c, axis));
                if rest_rep && ty(eg, k).dim(2) % parts == 0 {
                    let mut m = vec![op_id(n.op), op_id(g.op), g.children[0]];
                    m.extend_from_slice(&n.children[1..]);
                    out.push(m);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let (f, ag) = (op_at(eg, m[0]), op_at(eg, m[1]));
        let Op::AllGather { axis, dim, parts } = ag.clone() else {
            return None;
        };
        let k = add(eg, self.name(), slice(&axis, dim, parts), vec![m[3]])?;
        let v = add(eg, self.name(), slice(&axis, dim, parts), vec![m[4]])?;
        let mut operands = vec![m[2], k, v];
        operands.extend_from_slice(&m[5..]);
        let inner = add_like(eg, self.name(), f, operands, class)?;
        add(eg, self.name(), ag, vec![inner])
    }
}

/// `reduce-sink-linear`: `f(all_reduce_a(y), g..) ⇒ all_reduce_a(f(y, g..))` for `f` linear
/// in `y` (an MoE combine, a product with a replicated factor, a scale) and `g` replicated
/// over `a`: the partial sums are combined first and reduced once, on the smaller tensor (a
/// row-parallel expert matmul's partial sums reduced after the combine, not per expert).
pub(crate) struct ReduceSink;

impl RuleImpl for ReduceSink {
    rule_header! {
        name: "reduce-sink-linear",
        group: "layout",
        identity: "f(all_reduce_a(y), g..) => all_reduce_a(f(y, g..)), f in {combine, mul, scale} linear in y, g replicated over a",
        in_all: false,
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        let linear = |o: &Op| matches!(o, Op::Combine | Op::Mul | Op::Scale(_));
        for (n, op) in nodes_where(eg, class, linear) {
            // The operand positions `f` is linear in: a combine's first, either factor.
            let sides: &[usize] = match op {
                Op::Mul => &[0, 1],
                _ => &[0],
            };
            for &side in sides {
                let y_cls = n.children[side];
                for (r, rop) in nodes_where(eg, y_cls, |o| matches!(o, Op::AllReduce { .. })) {
                    let Op::AllReduce { axis } = rop else {
                        continue;
                    };
                    let others_rep = (0..n.children.len())
                        .filter(|&i| i != side)
                        .all(|i| rep_over(eg, n.children[i], axis));
                    // A product's factor must not broadcast the partial sums over more
                    // elements than they have (the sum stays one sum per element).
                    let same_shape = ty(eg, class).shape() == ty(eg, y_cls).shape();
                    if others_rep && (same_shape || !matches!(op, Op::Mul)) {
                        let mut m = vec![op_id(n.op), op_id(r.op), int(side)];
                        m.extend(n.children.iter().copied());
                        m[3 + side] = r.children[0];
                        out.push(m);
                    }
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        super::sink(eg, self.name(), class, m[0], m[1], m[3..].to_vec())
    }
}
