//! The optimizer step: weight-update sharding (Xu et al. 2020, "Automatic Cross-Replica
//! Sharding of Weight Update in Data-Parallel Training"; XLA's pass of that name). Data
//! parallel replicas all-reduce a gradient and then all run the same elementwise AdamW update
//! on the whole weight; instead each replica reduce-scatters the gradient, updates its slice of
//! the weight and moments, and all-gathers the updated weight. Communication is the same (an
//! all-reduce is a reduce-scatter and an all-gather), the update's compute and its temporaries
//! are `1/|a|` the size.

use super::{add, axis_size, int, nodes_where, op_at, op_id, rep_over, RuleImpl};
use crate::ir::Op;
use crate::rewrite::analysis::SpmdEGraph;
use egg::Id;
use std::sync::Arc;

/// The rules of this file.
pub(crate) fn rules() -> Vec<Arc<dyn RuleImpl>> {
    vec![Arc::new(WeightUpdateSharding)]
}

/// `weight-update-sharding`: `adamw_update(w, adam_moment(m, all_reduce_a(g)),
/// adam_moment(v, all_reduce_a(g)), t) ⇒ all_gather_a,d(adamw_update(local_slice_a,d(w),
/// adam_moment(local_slice_a,d(m), reduce_scatter_a,d(g)), adam_moment(local_slice_a,d(v),
/// reduce_scatter_a,d(g)), t))` for `w`, `m`, `v`, `t` replicated over `a` and `d` the dim the
/// ZeRO layout picks (the first unsharded dim `|a|` divides, else the first it divides). Every
/// op of the update is elementwise, so slicing commutes with it.
pub(crate) struct WeightUpdateSharding;

/// The dim of `c` the ZeRO layout shards over `parts` ranks (`train::annotate::zero_layout`).
fn update_dim(eg: &SpmdEGraph, c: Id, parts: usize) -> Option<usize> {
    let t = &eg[c].data.ty;
    let s = &eg[c].data.sharding;
    let free = |d: usize| s.dims.get(d).is_none_or(|x| x.is_empty());
    (0..t.rank())
        .find(|&d| free(d) && t.dim(d) % parts == 0)
        .or_else(|| (0..t.rank()).find(|&d| t.dim(d) % parts == 0))
}

impl RuleImpl for WeightUpdateSharding {
    rule_header! {
        name: "weight-update-sharding",
        group: "weight-update-sharding",
        identity: "adamw_update(w, adam_moment(m, all_reduce_a(g)), adam_moment(v, all_reduce_a(g)), t) => all_gather_a,d(adamw_update(local_slice_a,d(w), adam_moment(local_slice_a,d(m), reduce_scatter_a,d(g)), adam_moment(local_slice_a,d(v), reduce_scatter_a,d(g)), t)), w, m, v, t replicated over a",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        let moment = |o: &Op| matches!(o, Op::AdamMoment { .. });
        for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::AdamWUpdate(_))) {
            let [w, mc, vc, t] = n.children[..] else {
                continue;
            };
            for (mn, _) in nodes_where(eg, mc, moment) {
                for (vn, _) in nodes_where(eg, vc, moment) {
                    let (m, g) = (mn.children[0], mn.children[1]);
                    if eg.find(g) != eg.find(vn.children[1]) {
                        continue;
                    }
                    let v = vn.children[0];
                    for (ar, aop) in nodes_where(eg, g, |o| matches!(o, Op::AllReduce { .. })) {
                        let Op::AllReduce { axis } = aop else {
                            continue;
                        };
                        let Some(parts) = axis_size(eg, axis).filter(|&p| p > 1) else {
                            continue;
                        };
                        if ![w, m, v, t].iter().all(|&c| rep_over(eg, c, axis)) {
                            continue;
                        }
                        let Some(d) = update_dim(eg, w, parts) else {
                            continue;
                        };
                        out.push(vec![
                            op_id(n.op),
                            op_id(mn.op),
                            op_id(vn.op),
                            op_id(ar.op),
                            w,
                            m,
                            v,
                            t,
                            ar.children[0],
                            int(d),
                            int(parts),
                        ]);
                    }
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, _class: Id, m: &[Id]) -> Option<Id> {
        let Op::AllReduce { axis } = op_at(eg, m[3]) else {
            return None;
        };
        let (upd, mom1, mom2) = (op_at(eg, m[0]), op_at(eg, m[1]), op_at(eg, m[2]));
        let [w, mm, vv, t, g] = [m[4], m[5], m[6], m[7], m[8]];
        let (dim, parts) = (usize::from(m[9]), usize::from(m[10]));
        let name = self.name();
        let slice = |eg: &mut SpmdEGraph, x: Id| {
            let op = Op::LocalSlice {
                axis: axis.clone(),
                dim,
                parts,
            };
            add(eg, name, op, vec![x])
        };
        let rs = Op::ReduceScatter {
            axis: axis.clone(),
            dim,
            parts,
        };
        let gs = add(eg, name, rs, vec![g])?;
        let (ws, ms, vs) = (slice(eg, w)?, slice(eg, mm)?, slice(eg, vv)?);
        let m1 = add(eg, name, mom1, vec![ms, gs])?;
        let m2 = add(eg, name, mom2, vec![vs, gs])?;
        let u = add(eg, name, upd, vec![ws, m1, m2, t])?;
        let gather = Op::AllGather {
            axis: axis.clone(),
            dim,
            parts,
        };
        add(eg, name, gather, vec![u])
    }
}
