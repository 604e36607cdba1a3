//! Per-token op motion across all-gathers (`gather-sink`): an op that treats the rows of the
//! gathered dim independently is computed on the local rows and gathered after. With
//! `allreduce-split` and the slice/gather cancellations this is how Megatron sequence
//! parallelism emerges from plain tensor parallelism: norms and residual adds move onto
//! sequence shards between a reduce-scatter and an all-gather.

use super::{add, add_like, nodes_where, op_at, op_id, rep_over, ty, RuleImpl};
use crate::ir::{NormWrt, Op};
use crate::rewrite::analysis::SpmdEGraph;
use egg::Id;
use std::sync::Arc;

/// The rules of this file.
pub(crate) fn rules() -> Vec<Arc<dyn RuleImpl>> {
    vec![
        Arc::new(SinkRowwise { checked: true }),
        Arc::new(SinkElementwise),
        Arc::new(SinkBinary),
        Arc::new(SinkMatMul),
        Arc::new(SinkReshape),
        Arc::new(SinkRope),
        Arc::new(SinkMoe),
        Arc::new(SinkNormGrad),
        Arc::new(SinkParamGrad),
        Arc::new(ScatterHoist),
    ]
}

/// Deliberately wrong variants, selectable by name in tests only.
pub(crate) fn broken_rules() -> Vec<Arc<dyn RuleImpl>> {
    vec![Arc::new(SinkRowwise { checked: false })]
}

fn row_wise(op: &Op) -> bool {
    matches!(
        op,
        Op::RmsNorm { .. } | Op::LayerNorm { .. } | Op::Softmax | Op::Router { .. }
    )
}

/// `gather-sink-norm`: `f(AllGather_a,d(x), w..) ⇒ AllGather_a,d(f(x, w..))` for a
/// row-wise `f` (RMSNorm, LayerNorm, softmax, router: functions of the last dim) when `d` is not
/// the last dim and the weights are replicated over `a`. With `checked: false` the dim
/// condition is dropped: the test-only `broken-gather-sink-norm`, which the property tests
/// must catch.
pub(crate) struct SinkRowwise {
    checked: bool,
}

impl RuleImpl for SinkRowwise {
    fn name(&self) -> &'static str {
        if self.checked {
            "gather-sink-norm"
        } else {
            "broken-gather-sink-norm"
        }
    }
    fn group(&self) -> &'static str {
        "gather-sink"
    }
    fn identity(&self) -> &'static str {
        if self.checked {
            "f(all_gather_a,d(x), w..) => all_gather_a,d(f(x, w..)), f in {rms_norm, layer_norm, softmax, router}, d not the last dim, w replicated over a"
        } else {
            "BROKEN (test only): as gather-sink-norm without the dim condition"
        }
    }
    fn test_only(&self) -> bool {
        !self.checked
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, _) in nodes_where(eg, class, row_wise) {
            let x = n.children[0];
            let last = ty(eg, x).rank().saturating_sub(1);
            for (g, gop) in nodes_where(eg, x, |o| matches!(o, Op::AllGather { .. })) {
                let Op::AllGather { axis, dim, .. } = gop else {
                    continue;
                };
                let weights_rep = n.children[1..].iter().all(|&w| rep_over(eg, w, axis));
                if (*dim < last || !self.checked) && weights_rep {
                    let mut m = vec![op_id(n.op), op_id(g.op), g.children[0]];
                    m.extend_from_slice(&n.children[1..]);
                    out.push(m);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        super::sink(eg, self.name(), class, m[0], m[1], m[2..].to_vec())
    }
}

/// `gather-sink-elementwise`: `f(AllGather_a,d(x)) ⇒ AllGather_a,d(f(x))` for a unary
/// elementwise `f` (unary functions, scale, cast) or a repeat along another dim.
pub(crate) struct SinkElementwise;

impl RuleImpl for SinkElementwise {
    rule_header! {
        name: "gather-sink-elementwise",
        group: "gather-sink",
        identity: "f(all_gather_a,d(x)) => all_gather_a,d(f(x)), f in {unary, scale, cast, repeat along a dim other than d}",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        let unary = |o: &Op| {
            matches!(
                o,
                Op::Unary(_) | Op::Scale(_) | Op::Cast(_) | Op::Repeat { .. }
            )
        };
        for (n, op) in nodes_where(eg, class, unary) {
            for (g, gop) in nodes_where(eg, n.children[0], |o| matches!(o, Op::AllGather { .. })) {
                let clash = matches!((op, gop), (Op::Repeat { dim: r, .. }, Op::AllGather { dim, .. }) if r == dim);
                if !clash {
                    out.push(vec![op_id(n.op), op_id(g.op), g.children[0]]);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        super::sink(eg, self.name(), class, m[0], m[1], vec![m[2]])
    }
}

/// `gather-sink-binary`: `f(AllGather_a,d(x), y) ⇒ AllGather_a,d(f(x, LocalSlice_a,d(y)))`
/// for `f` in {add, mul} and a partner `y` replicated over `a` (a broadcast partner that does
/// not span `d` is used whole); likewise with the gathered value second (same shapes). The
/// residual add with a sliced partner: after `slice-of-gather` the slice of a gathered
/// partner is the partner's shard.
pub(crate) struct SinkBinary;

impl SinkBinary {
    /// Matches with the gather at operand `side` of `n` (whose operands are `c`).
    fn side(eg: &SpmdEGraph, n: &crate::rewrite::lang::ENode, side: usize, out: &mut Vec<Vec<Id>>) {
        let (g_cls, y) = (n.children[side], n.children[1 - side]);
        let (r_out, r_y) = (ty(eg, n.children[0]).rank(), ty(eg, y).rank());
        if side == 1 && r_out != r_y {
            return;
        }
        for (g, gop) in nodes_where(eg, g_cls, |o| matches!(o, Op::AllGather { .. })) {
            let Op::AllGather { axis, dim, .. } = gop else {
                continue;
            };
            if !rep_over(eg, y, axis) {
                continue;
            }
            // The partner's dim that lines up with the gathered dim, if it spans it.
            let off = r_out - r_y;
            let slice = usize::from(*dim >= off);
            out.push(vec![
                op_id(n.op),
                op_id(g.op),
                g.children[0],
                y,
                super::int(slice),
                super::int(side),
            ]);
        }
    }
}

impl RuleImpl for SinkBinary {
    rule_header! {
        name: "gather-sink-binary",
        group: "gather-sink",
        identity: "f(all_gather_a,d(x), y) => all_gather_a,d(f(x, local_slice_a,d(y))), f in {add, mul}, y replicated over a (and mirrored)",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::Add | Op::Mul)) {
            SinkBinary::side(eg, n, 0, out);
            SinkBinary::side(eg, n, 1, out);
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let (f, ag) = (op_at(eg, m[0]), op_at(eg, m[1]));
        let Op::AllGather { axis, dim, parts } = ag.clone() else {
            return None;
        };
        let (x, y) = (m[2], m[3]);
        let (slice, side) = (usize::from(m[4]) == 1, usize::from(m[5]));
        let y = if slice {
            let off = ty(eg, class).rank() - ty(eg, y).rank();
            let ls = Op::LocalSlice {
                axis,
                dim: dim - off,
                parts,
            };
            add(eg, self.name(), ls, vec![y])?
        } else {
            y
        };
        let operands = if side == 0 { vec![x, y] } else { vec![y, x] };
        let inner = add_like(eg, self.name(), f, operands, class)?;
        add(eg, self.name(), ag, vec![inner])
    }
}

/// `gather-sink-matmul`: `MatMul(AllGather_a,d(x), w) ⇒ AllGather_a,d(MatMul(x, w))` for a
/// row dim `d` and a weight `w` replicated over `a` (the rows are independent).
pub(crate) struct SinkMatMul;

impl RuleImpl for SinkMatMul {
    rule_header! {
        name: "gather-sink-matmul",
        group: "gather-sink",
        identity: "matmul(all_gather_a,d(x), w) => all_gather_a,d(matmul(x, w)), d a row dim, w 2-D and replicated over a",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::MatMul { .. })) {
            let (x, w) = (n.children[0], n.children[1]);
            if ty(eg, w).rank() != 2 {
                continue;
            }
            let last = ty(eg, x).rank().saturating_sub(1);
            for (g, gop) in nodes_where(eg, x, |o| matches!(o, Op::AllGather { .. })) {
                let Op::AllGather { axis, dim, .. } = gop else {
                    continue;
                };
                if *dim < last && rep_over(eg, w, axis) {
                    out.push(vec![op_id(n.op), op_id(g.op), g.children[0], w]);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        super::sink(eg, self.name(), class, m[0], m[1], vec![m[2], m[3]])
    }
}

/// `gather-sink-reshape`: `Reshape(AllGather_a,d(x)) ⇒ AllGather_a,d(Reshape'(x))` when the
/// reshape keeps dims `0..=d` (splitting or merging only dims after `d`).
pub(crate) struct SinkReshape;

impl RuleImpl for SinkReshape {
    rule_header! {
        name: "gather-sink-reshape",
        group: "gather-sink",
        identity: "reshape(all_gather_a,d(x)) => all_gather_a,d(reshape'(x)), dims 0..=d unchanged by the reshape",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        super::reshape_gathers(eg, class, out, |from, to, d, _| {
            d < to.rank() && d < from.rank() && (0..=d).all(|i| from.dim(i) == to.dim(i))
        });
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        super::sink_reshape(eg, self.name(), class, m)
    }
}

/// `gather-sink-rope`: `Rope(AllGather_a,d(x), pos) ⇒ AllGather_a,d(Rope(x,
/// LocalSlice_a,d(pos)))` for `d` the batch or sequence dim and positions replicated over `a`.
pub(crate) struct SinkRope;

impl RuleImpl for SinkRope {
    rule_header! {
        name: "gather-sink-rope",
        group: "gather-sink",
        identity: "rope(all_gather_a,d(x), pos) => all_gather_a,d(rope(x, local_slice_a,d(pos))), d in {batch, seq}, pos replicated over a",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::Rope(_))) {
            let pos = n.children[1];
            for (g, gop) in nodes_where(eg, n.children[0], |o| matches!(o, Op::AllGather { .. })) {
                let Op::AllGather { axis, dim, .. } = gop else {
                    continue;
                };
                if *dim < 2 && rep_over(eg, pos, axis) {
                    out.push(vec![op_id(n.op), op_id(g.op), g.children[0], pos]);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let (f, ag) = (op_at(eg, m[0]), op_at(eg, m[1]));
        let Op::AllGather { axis, dim, parts } = ag.clone() else {
            return None;
        };
        let ls = Op::LocalSlice { axis, dim, parts };
        let pos = add(eg, self.name(), ls, vec![m[3]])?;
        let inner = add_like(eg, self.name(), f, vec![m[2], pos], class)?;
        add(eg, self.name(), ag, vec![inner])
    }
}

/// Where the token dims (batch, then sequence) of a mixture-of-experts op's operands and
/// result start: 1 for the expert-major `[E,B,T,H]` tensors, 0 for `[B,T,..]`.
fn moe_token_dims(op: &Op) -> Option<(&'static [usize], usize)> {
    Some(match op {
        Op::Dispatch => (&[0, 0], 1),
        Op::Combine | Op::DispatchGrad => (&[1, 0], 0),
        Op::CombineGrad { wrt } => (&[1, 0, 0], usize::from(*wrt == crate::ir::CombineWrt::Y)),
        Op::RouterGrad { .. } => (&[0, 0], 0),
        _ => return None,
    })
}

/// `gather-sink-moe`: `f(.., AllGather_a,d(x), ..) ⇒ AllGather_a,d'(f(.., x, ..))` for the
/// per-token ops of a mixture of experts (dispatch, combine and their gradients, the router's
/// gradient) gathered along a token dim (batch or sequence) of one operand, the other
/// operands replicated over `a` and sliced along their own token dim (`LocalSlice`, which
/// `slice-of-gather` cancels against their gathers), `d'` the result's token dim: each token is
/// routed, combined and differentiated on its own.
pub(crate) struct SinkMoe;

impl RuleImpl for SinkMoe {
    rule_header! {
        name: "gather-sink-moe",
        group: "gather-sink",
        identity: "f(.., all_gather_a,d(x), ..) => all_gather_a,d'(f(.., x, local_slice(y).., ..)), f in {dispatch, combine, dispatch_grad, combine_grad, router_grad}, d a token dim (batch or seq) of x, the other operands y replicated over a and sliced along their token dim, d' the result's",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, op) in nodes_where(eg, class, |o| moe_token_dims(o).is_some()) {
            let Some((offs, _)) = moe_token_dims(op) else {
                continue;
            };
            if offs.len() != n.children.len() {
                continue;
            }
            for (i, &c) in n.children.iter().enumerate() {
                for (g, axis, dim, inner) in gathers(eg, c) {
                    let Some(k) = dim.checked_sub(offs[i]).filter(|&k| k < 2) else {
                        continue;
                    };
                    let others = n.children.iter().enumerate().filter(|&(j, _)| j != i);
                    if others.clone().all(|(_, &y)| rep_over(eg, y, &axis)) {
                        let mut m = vec![op_id(n.op), g, super::int(i), super::int(k), inner];
                        m.extend_from_slice(&n.children);
                        out.push(m);
                    }
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let (f, ag) = (op_at(eg, m[0]), op_at(eg, m[1]));
        let Op::AllGather { axis, parts, .. } = ag else {
            return None;
        };
        let (offs, res) = moe_token_dims(&f)?;
        let (i, k) = (usize::from(m[2]), usize::from(m[3]));
        let children = &m[5..];
        let mut operands = Vec::with_capacity(children.len());
        for (j, &c) in children.iter().enumerate() {
            if j == i {
                operands.push(m[4]);
            } else {
                let ls = Op::LocalSlice {
                    axis: axis.clone(),
                    dim: offs[j] + k,
                    parts,
                };
                operands.push(add(eg, self.name(), ls, vec![c])?);
            }
        }
        let inner = add_like(eg, self.name(), f, operands, class)?;
        let ag = Op::AllGather {
            axis,
            dim: res + k,
            parts,
        };
        add(eg, self.name(), ag, vec![inner])
    }
}

/// The gathers of class `c`: (node op id, axis, dim, the gathered class).
fn gathers(eg: &SpmdEGraph, c: Id) -> Vec<(Id, String, usize, Id)> {
    nodes_where(eg, c, |o| matches!(o, Op::AllGather { .. }))
        .filter_map(|(g, gop)| match gop {
            Op::AllGather { axis, dim, .. } => {
                Some((op_id(g.op), axis.clone(), *dim, g.children[0]))
            }
            _ => None,
        })
        .collect()
}

/// Matches of a norm gradient `(x, w, dy)` whose `x` and `dy` are both gathered along the
/// same row dim (not the last) of the same axis, `w` replicated over it: `[op, gather op, x',
/// w, dy']`.
fn norm_grad_matches(eg: &SpmdEGraph, class: Id, wrt: NormWrt, out: &mut Vec<Vec<Id>>) {
    let is = |o: &Op| matches!(o, Op::RmsNormGrad { wrt: w, .. } | Op::LayerNormGrad { wrt: w, .. } if *w == wrt);
    for (n, _) in nodes_where(eg, class, is) {
        let [x, w, dy] = n.children[..] else {
            continue;
        };
        let last = ty(eg, x).rank().saturating_sub(1);
        for (gx, ax, dx, xs) in gathers(eg, x) {
            if dx >= last || !rep_over(eg, w, &ax) {
                continue;
            }
            for (_, ay, dyd, dys) in gathers(eg, dy) {
                if ay == ax && dyd == dx {
                    out.push(vec![op_id(n.op), gx, xs, w, dys]);
                }
            }
        }
    }
}

/// `gather-sink-norm-grad`: `g(AllGather_a,d(x), w, AllGather_a,d(dy)) ⇒
/// AllGather_a,d(g(x, w, dy))` for the input gradient `g` of RMSNorm or LayerNorm (a function
/// of each row's `x`, `w` and `dy`), `d` not the last dim, `w` replicated over `a`. In a
/// training step the norm's input gradient then stays on sequence shards between the
/// reduce-scatter of its incoming gradient and the gather the next GEMM's backward needs: the
/// backward half of Megatron sequence parallelism.
pub(crate) struct SinkNormGrad;

impl RuleImpl for SinkNormGrad {
    rule_header! {
        name: "gather-sink-norm-grad",
        group: "gather-sink",
        identity: "g(all_gather_a,d(x), w, all_gather_a,d(dy)) => all_gather_a,d(g(x, w, dy)), g in {rms_norm_grad, layer_norm_grad} wrt x, d not the last dim, w replicated over a",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        norm_grad_matches(eg, class, NormWrt::X, out);
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let (g, ag) = (op_at(eg, m[0]), op_at(eg, m[1]));
        let inner = add_like(eg, self.name(), g, m[2..5].to_vec(), class)?;
        add(eg, self.name(), ag, vec![inner])
    }
}

/// `gather-sink-param-grad`: `gw(AllGather_a,d(x), w, AllGather_a,d(dy)) ⇒
/// AllReduce_a(gw(x, w, dy))` for the weight gradient `gw` of RMSNorm or LayerNorm (`w`
/// replicated over `a`), and `bias_grad(AllGather_a,d(dy), b) ⇒ AllReduce_a(bias_grad(dy, b))`
/// (`b` replicated over `a`), `d` not the last dim: these
/// gradients sum over the rows, so each rank sums its own rows and the partial sums are
/// all-reduced (Megatron sequence parallelism's all-reduce of the norm weights' gradients).
pub(crate) struct SinkParamGrad;

impl RuleImpl for SinkParamGrad {
    rule_header! {
        name: "gather-sink-param-grad",
        group: "gather-sink",
        identity: "gw(all_gather_a,d(x), w, all_gather_a,d(dy)) => all_reduce_a(gw(x, w, dy)), gw in {rms_norm_grad, layer_norm_grad} wrt weight; bias_grad(all_gather_a,d(dy), b) => all_reduce_a(bias_grad(dy, b)); d not the last dim, w and b replicated over a",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        norm_grad_matches(eg, class, NormWrt::Weight, out);
        for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::BiasGrad)) {
            let [dy, b] = n.children[..] else {
                continue;
            };
            let last = ty(eg, dy).rank().saturating_sub(1);
            for (g, axis, d, dys) in gathers(eg, dy) {
                if d < last && rep_over(eg, b, &axis) {
                    out.push(vec![op_id(n.op), g, dys, b]);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let (g, ag) = (op_at(eg, m[0]), op_at(eg, m[1]));
        let Op::AllGather { axis, .. } = ag else {
            return None;
        };
        let inner = add_like(eg, self.name(), g, m[2..].to_vec(), class)?;
        add(eg, self.name(), Op::AllReduce { axis }, vec![inner])
    }
}

/// `scatter-hoist`: `ReduceScatter_a,d(f(y, g)) ⇒ f(ReduceScatter_a,d'(y), LocalSlice_a,d(g))`
/// for `f` linear in `y` and per-token along `d` (MoE combine with `d` the batch or sequence
/// dim, `d' = d + 1`; mul by a full-shape `g`; scale) and `g` replicated over `a`: the sum of
/// `f` over ranks is `f` of the sum, computed on the local rows only.
pub(crate) struct ScatterHoist;

impl RuleImpl for ScatterHoist {
    rule_header! {
        name: "scatter-hoist",
        group: "scatter-hoist",
        identity: "reduce_scatter_a,d(f(y, g)) => f(reduce_scatter_a,d'(y), local_slice_a,d(g)), f in {combine, mul, scale} linear in y, g replicated over a",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, op) in nodes_where(eg, class, |o| matches!(o, Op::ReduceScatter { .. })) {
            let Op::ReduceScatter { axis, dim, .. } = op else {
                continue;
            };
            let c = n.children[0];
            let linear = |o: &Op| matches!(o, Op::Combine | Op::Mul | Op::Scale(_));
            for (f, fop) in nodes_where(eg, c, linear) {
                let ok = match fop {
                    Op::Combine => *dim < 2 && rep_over(eg, f.children[1], axis),
                    Op::Mul => {
                        ty(eg, f.children[1]).rank() == ty(eg, c).rank()
                            && rep_over(eg, f.children[1], axis)
                    }
                    _ => true,
                };
                if ok {
                    let mut m = vec![op_id(n.op), op_id(f.op)];
                    m.extend_from_slice(&f.children);
                    out.push(m);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let (rs, f) = (op_at(eg, m[0]), op_at(eg, m[1]));
        let Op::ReduceScatter { axis, dim, parts } = rs else {
            return None;
        };
        let y_dim = if matches!(f, Op::Combine) {
            dim + 1
        } else {
            dim
        };
        let rs_y = Op::ReduceScatter {
            axis: axis.clone(),
            dim: y_dim,
            parts,
        };
        let y = add(eg, self.name(), rs_y, vec![m[2]])?;
        let mut operands = vec![y];
        if let Some(&g) = m.get(3) {
            let ls = Op::LocalSlice { axis, dim, parts };
            operands.push(add(eg, self.name(), ls, vec![g])?);
        }
        add_like(eg, self.name(), f, operands, class)
    }
}
