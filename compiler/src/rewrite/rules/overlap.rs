//! Collective matmul (`collective-matmul`): a gather feeding a GEMM, or a GEMM feeding a
//! reduce-scatter, becomes one op run as a ring of partial GEMMs whose chunks travel by
//! send/recv while the next chunk is multiplied, so communication overlaps compute.

use super::{add, nodes_where, op_at, op_id, ty, RuleImpl};
use crate::ir::Op;
use crate::rewrite::analysis::SpmdEGraph;
use egg::Id;
use std::sync::Arc;

/// The rules of this file.
pub(crate) fn rules() -> Vec<Arc<dyn RuleImpl>> {
    vec![Arc::new(AgMatMulRule), Arc::new(MatMulRsRule)]
}

/// `ag-matmul`: `MatMul(AllGather_a,d(x), w) ⇒ AgMatMul_a,d(x, w)` for a row dim `d`.
pub(crate) struct AgMatMulRule;

impl RuleImpl for AgMatMulRule {
    rule_header! {
        name: "ag-matmul",
        group: "collective-matmul",
        identity: "matmul(all_gather_a,d(x), w) => ag_matmul_a,d(x, w), d a row dim",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::MatMul { .. })) {
            let (a, w) = (n.children[0], n.children[1]);
            let last = ty(eg, a).rank().saturating_sub(1);
            for (g, gop) in nodes_where(eg, a, |o| matches!(o, Op::AllGather { .. })) {
                if matches!(gop, Op::AllGather { dim, .. } if *dim < last) {
                    out.push(vec![op_id(n.op), op_id(g.op), g.children[0], w]);
                }
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, _class: Id, m: &[Id]) -> Option<Id> {
        collective_matmul(eg, self.name(), m[0], m[1], vec![m[2], m[3]])
    }
}

/// `matmul-rs`: `ReduceScatter_a,d(MatMul(x, w)) ⇒ MatMulRs_a,d(x, w)` for a row dim `d`.
pub(crate) struct MatMulRsRule;

impl RuleImpl for MatMulRsRule {
    rule_header! {
        name: "matmul-rs",
        group: "collective-matmul",
        identity: "reduce_scatter_a,d(matmul(x, w)) => matmul_rs_a,d(x, w), d a row dim",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, op) in nodes_where(eg, class, |o| matches!(o, Op::ReduceScatter { .. })) {
            let Op::ReduceScatter { dim, .. } = op else {
                continue;
            };
            let p = n.children[0];
            if *dim + 1 >= ty(eg, p).rank() {
                continue;
            }
            for (mm, _) in nodes_where(eg, p, |o| matches!(o, Op::MatMul { .. })) {
                out.push(vec![
                    op_id(n.op),
                    op_id(mm.op),
                    mm.children[0],
                    mm.children[1],
                ]);
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, _class: Id, m: &[Id]) -> Option<Id> {
        collective_matmul(eg, self.name(), m[1], m[0], vec![m[2], m[3]])
    }
}

/// The collective matmul of the matmul `mm` and the collective `c` (an all-gather of its
/// input: `AgMatMul`; a reduce-scatter of its product: `MatMulRs`) over `operands`.
fn collective_matmul(
    eg: &mut SpmdEGraph,
    rule: &'static str,
    mm: Id,
    c: Id,
    operands: Vec<Id>,
) -> Option<Id> {
    let Op::MatMul { transpose_b } = op_at(eg, mm) else {
        return None;
    };
    let op = match op_at(eg, c) {
        Op::AllGather { axis, dim, parts } => Op::AgMatMul {
            axis,
            dim,
            parts,
            transpose_b,
        },
        Op::ReduceScatter { axis, dim, parts } => Op::MatMulRs {
            axis,
            dim,
            parts,
            transpose_b,
        },
        _ => return None,
    };
    add(eg, rule, op, operands)
}
