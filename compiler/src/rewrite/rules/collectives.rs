//! Collective algebra: splitting an all-reduce, and cancelling a slice against a gather.

use super::{add, axis_size, int, nodes_where, op_at, op_id, rep_over, ty, RuleImpl};
use crate::ir::Op;
use crate::rewrite::analysis::SpmdEGraph;
use egg::Id;
use std::sync::Arc;

/// The rules of this file.
pub(crate) fn rules() -> Vec<Arc<dyn RuleImpl>> {
    vec![
        Arc::new(AllReduceSplit),
        Arc::new(SliceOfGather),
        Arc::new(GatherOfSlice),
        Arc::new(GatherSliceToAllToAll),
    ]
}

/// `allreduce-split`: `AllReduce_a(x) ⇒ AllGather_a,d(ReduceScatter_a,d(x))` for a
/// per-token dim `d` of `x` that `|a|` divides (ring all-reduce is exactly these two
/// phases, so the split costs nothing and lets the halves move apart).
pub(crate) struct AllReduceSplit;

impl RuleImpl for AllReduceSplit {
    rule_header! {
        name: "allreduce-split",
        group: "allreduce-split",
        identity: "all_reduce_a(x) => all_gather_a,d(reduce_scatter_a,d(x)), d a per-token dim divisible by |a|",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, op) in nodes_where(eg, class, |o| matches!(o, Op::AllReduce { .. })) {
            let Op::AllReduce { axis } = op else { continue };
            let Some(parts) = axis_size(eg, axis).filter(|&p| p > 1) else {
                continue;
            };
            let x = n.children[0];
            let t = ty(eg, x);
            for &d in &eg[x].data.token_dims {
                if t.dim(d) % parts == 0 {
                    out.push(vec![op_id(n.op), x, int(d), int(parts)]);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, _class: Id, m: &[Id]) -> Option<Id> {
        let Op::AllReduce { axis } = op_at(eg, m[0]) else {
            return None;
        };
        let (dim, parts) = (usize::from(m[2]), usize::from(m[3]));
        let rs = Op::ReduceScatter {
            axis: axis.clone(),
            dim,
            parts,
        };
        let rs = add(eg, self.name(), rs, vec![m[1]])?;
        add(
            eg,
            self.name(),
            Op::AllGather { axis, dim, parts },
            vec![rs],
        )
    }
}

/// `slice-of-gather`: `LocalSlice_a,d(AllGather_a,d(x)) ⇒ x` (rank r's chunk of the
/// concatenation in rank order is its own value).
pub(crate) struct SliceOfGather;

impl RuleImpl for SliceOfGather {
    rule_header! {
        name: "slice-of-gather",
        group: "slice-of-gather",
        identity: "local_slice_a,d(all_gather_a,d(x)) => x",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, op) in nodes_where(eg, class, |o| matches!(o, Op::LocalSlice { .. })) {
            let Op::LocalSlice { axis, dim, parts } = op else {
                continue;
            };
            let gathers = nodes_where(eg, n.children[0], |o| {
                matches!(o, Op::AllGather { axis: a, dim: d, parts: p }
                    if a == axis && d == dim && p == parts)
            });
            for (g, _) in gathers {
                out.push(vec![g.children[0]]);
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, _class: Id, m: &[Id]) -> Option<Id> {
        Some(eg.find(m[0]))
    }
}

/// `gather-of-slice`: `AllGather_a,d(LocalSlice_a,d(y)) ⇒ y` for `y` replicated over `a`
/// (the chunks of one value, concatenated back).
pub(crate) struct GatherOfSlice;

impl RuleImpl for GatherOfSlice {
    rule_header! {
        name: "gather-of-slice",
        group: "gather-of-slice",
        identity: "all_gather_a,d(local_slice_a,d(y)) => y, y replicated over a",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, op) in nodes_where(eg, class, |o| matches!(o, Op::AllGather { .. })) {
            let Op::AllGather { axis, dim, parts } = op else {
                continue;
            };
            let slices = nodes_where(eg, n.children[0], |o| {
                matches!(o, Op::LocalSlice { axis: a, dim: d, parts: p }
                    if a == axis && d == dim && p == parts)
            });
            for (s, _) in slices {
                let y = s.children[0];
                if rep_over(eg, y, axis) {
                    out.push(vec![y]);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, _class: Id, m: &[Id]) -> Option<Id> {
        Some(eg.find(m[0]))
    }
}

/// `gather-slice-to-all-to-all`: `LocalSlice_a,e(AllGather_a,d(x)) ⇒ AllToAll_a(x, split e,
/// concat d)` for `e ≠ d`: rank r keeps chunk r of dim e of every rank's value, concatenated
/// along d, which is what the all-to-all delivers at `1/|a|` of the gather's traffic.
pub(crate) struct GatherSliceToAllToAll;

impl RuleImpl for GatherSliceToAllToAll {
    rule_header! {
        name: "gather-slice-to-all-to-all",
        group: "slice-of-gather",
        identity: "local_slice_a,e(all_gather_a,d(x)) => all_to_all_a(x, split e, concat d), e != d",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, op) in nodes_where(eg, class, |o| matches!(o, Op::LocalSlice { .. })) {
            let Op::LocalSlice {
                axis,
                dim: e,
                parts,
            } = op
            else {
                continue;
            };
            let gathers = nodes_where(eg, n.children[0], |o| {
                matches!(o, Op::AllGather { axis: a, dim: d, parts: p }
                    if a == axis && d != e && p == parts)
            });
            for (g, gop) in gathers {
                let Op::AllGather { dim: d, .. } = gop else {
                    continue;
                };
                out.push(vec![op_id(n.op), g.children[0], int(*d)]);
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, _class: Id, m: &[Id]) -> Option<Id> {
        let Op::LocalSlice { axis, dim, parts } = op_at(eg, m[0]) else {
            return None;
        };
        let op = Op::AllToAll {
            axis,
            split_dim: dim,
            concat_dim: usize::from(m[2]),
            parts,
        };
        add(eg, self.name(), op, vec![m[1]])
    }
}
