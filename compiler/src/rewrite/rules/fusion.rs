//! Kernel fusion (`fuse-elementwise`): elementwise chains into one `FusedElementwise`,
//! elementwise consumers of a GEMM into its epilogue (`FusedMatMul`), and a residual add into
//! the RMSNorm that reads it (`AddRmsNorm`). Whether a fused form wins is the cost's call: a
//! fused op recomputes what it absorbs, so absorbing a value that other ops still need only
//! pays when it saves more memory traffic than it repeats.

use super::{add_like, int, nodes_where, op_at, op_id, RuleImpl};
use crate::ir::{EwExpr, EwStep, Op};
use crate::rewrite::analysis::SpmdEGraph;
use egg::Id;
use std::sync::Arc;

/// The largest program a fusion builds (bounds the e-graph on long chains).
pub(crate) const MAX_STEPS: usize = 6;
/// The most operands a fused op reads.
pub(crate) const MAX_OPERANDS: usize = 4;

/// The rules of this file.
pub(crate) fn rules() -> Vec<Arc<dyn RuleImpl>> {
    vec![
        Arc::new(FuseElementwise),
        Arc::new(GemmEpilogue),
        Arc::new(AddRmsNormRule),
    ]
}

fn elementwise(op: &Op) -> bool {
    plain_elementwise(op) || matches!(op, Op::FusedElementwise { .. })
}

fn plain_elementwise(op: &Op) -> bool {
    matches!(
        op,
        Op::Add | Op::Mul | Op::Unary(_) | Op::Scale(_) | Op::Cast(_)
    )
}

/// An elementwise op with `n` operands as a program.
fn program(op: &Op, n: usize) -> Option<EwExpr> {
    if let Op::FusedElementwise { expr } = op {
        return Some(expr.clone());
    }
    let args: Vec<u32> = (0..n as u32).collect();
    EwStep::from_op(op, &args).map(|s| EwExpr { steps: vec![s] })
}

/// An operand of a composed program: the GEMM result of an epilogue, or a class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Gemm,
    Class(Id),
}

/// `outer` (over `outer_ops`) with `inner` (over `inner_ops`) substituted for every outer
/// operand equal to class `at`. An `inner` with no steps stands for its operand 0. The new
/// operands are the inner ones, then the other outer ones, each once, in order.
fn compose(
    outer: &EwExpr,
    outer_ops: &[Id],
    at: Id,
    inner: &EwExpr,
    inner_ops: &[Slot],
) -> (EwExpr, Vec<Slot>) {
    let mut ops: Vec<Slot> = Vec::new();
    let outer_rest = outer_ops
        .iter()
        .filter(|&&c| c != at)
        .map(|&c| Slot::Class(c));
    for s in inner_ops.iter().copied().chain(outer_rest) {
        if !ops.contains(&s) {
            ops.push(s);
        }
    }
    let pos = |s: Slot| {
        ops.iter()
            .position(|&o| o == s)
            .expect("invariant: every operand is listed") as u32
    };
    let n = ops.len() as u32;
    let (n_in, n_out) = (inner_ops.len() as u32, outer_ops.len() as u32);
    let mut steps: Vec<EwStep> = inner
        .steps
        .iter()
        .map(|s| {
            s.map_args(|a| {
                if a < n_in {
                    pos(inner_ops[a as usize])
                } else {
                    n + (a - n_in)
                }
            })
        })
        .collect();
    let result = if inner.steps.is_empty() {
        pos(inner_ops[0])
    } else {
        n + inner.steps.len() as u32 - 1
    };
    let base = n + inner.steps.len() as u32;
    steps.extend(outer.steps.iter().map(|s| {
        s.map_args(|a| {
            if a >= n_out {
                base + (a - n_out)
            } else if outer_ops[a as usize] == at {
                result
            } else {
                pos(Slot::Class(outer_ops[a as usize]))
            }
        })
    }));
    (EwExpr { steps }, ops)
}

/// Matches of an elementwise node at class `class` whose operand class holds a node that
/// `inner` accepts: `[outer op, inner op, operand class, #outer operands, outer operands..,
/// inner operands..]`.
/// `gemm` counts the two GEMM operands, which an epilogue does not read.
fn find_nested(
    eg: &SpmdEGraph,
    class: Id,
    inner: impl Fn(&Op) -> bool + Copy,
    inner_steps: impl Fn(&Op) -> usize,
    gemm: bool,
    out: &mut Vec<Vec<Id>>,
) {
    for (n, op) in nodes_where(eg, class, elementwise) {
        let outer_steps = program(op, n.children.len()).map_or(0, |p| p.steps.len());
        let mut seen: Vec<Id> = Vec::new();
        for &c in &n.children {
            if seen.contains(&c) {
                continue;
            }
            seen.push(c);
            for (m, mop) in nodes_where(eg, c, inner) {
                let operands = n.children.len() - 1 + m.children.len() - 2 * usize::from(gemm);
                if outer_steps + inner_steps(mop) > MAX_STEPS || operands > MAX_OPERANDS {
                    continue;
                }
                let mut v = vec![op_id(n.op), op_id(m.op), c, int(n.children.len())];
                v.extend_from_slice(&n.children);
                v.extend_from_slice(&m.children);
                out.push(v);
            }
        }
    }
}

/// The parts of a nested match, with every class canonical.
fn parts(eg: &SpmdEGraph, m: &[Id]) -> (Op, Op, Id, Vec<Id>, Vec<Id>) {
    let k = usize::from(m[3]);
    let outer: Vec<Id> = m[4..4 + k].iter().map(|&c| eg.find(c)).collect();
    let inner: Vec<Id> = m[4 + k..].iter().map(|&c| eg.find(c)).collect();
    (
        op_at(eg, m[0]),
        op_at(eg, m[1]),
        eg.find(m[2]),
        outer,
        inner,
    )
}

/// `fuse-elementwise`: `f(.., g(y..), ..) ⇒ FusedElementwise[g; f](.., y.., ..)` for
/// elementwise `f` (possibly fused already) and a plain elementwise `g`: programs grow one op
/// at a time from the consumer, so each fusion of a chain is built one way only.
pub(crate) struct FuseElementwise;

impl RuleImpl for FuseElementwise {
    rule_header! {
        name: "fuse-elementwise",
        group: "fuse-elementwise",
        identity: "f(.., g(y..), ..) => fused_elementwise[g; f](.., y.., ..), f and g elementwise",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        find_nested(eg, class, plain_elementwise, |_| 1, false, out);
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let (fo, go, at, outer, inner) = parts(eg, m);
        let (po, pi) = (program(&fo, outer.len())?, program(&go, inner.len())?);
        let slots: Vec<Slot> = inner.iter().map(|&c| Slot::Class(c)).collect();
        let (expr, ops) = compose(&po, &outer, at, &pi, &slots);
        let children = ops
            .into_iter()
            .map(|s| match s {
                Slot::Class(c) => Some(c),
                Slot::Gemm => None,
            })
            .collect::<Option<Vec<Id>>>()?;
        add_like(
            eg,
            self.name(),
            Op::FusedElementwise { expr },
            children,
            class,
        )
    }
}

/// `gemm-epilogue`: `f(.., MatMul(a, b), ..) ⇒ FusedMatMul[f](a, b, ..)` for elementwise `f`
/// (bias, activation, gating into the GEMM's epilogue; an existing epilogue is extended).
pub(crate) struct GemmEpilogue;

impl RuleImpl for GemmEpilogue {
    rule_header! {
        name: "gemm-epilogue",
        group: "fuse-elementwise",
        identity: "f(.., matmul(a, b), ..) => fused_matmul[f](a, b, ..), f elementwise",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        let gemm = |o: &Op| matches!(o, Op::MatMul { .. } | Op::FusedMatMul { .. });
        let steps = |o: &Op| match o {
            Op::FusedMatMul { epilogue, .. } => epilogue.steps.len(),
            _ => 0,
        };
        find_nested(eg, class, gemm, steps, true, out);
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let (fo, go, at, outer, inner) = parts(eg, m);
        let po = program(&fo, outer.len())?;
        let (transpose_b, pi) = match go {
            Op::MatMul { transpose_b } => (transpose_b, EwExpr { steps: Vec::new() }),
            Op::FusedMatMul {
                transpose_b,
                epilogue,
            } => (transpose_b, epilogue),
            _ => return None,
        };
        if inner.len() < 2 {
            return None;
        }
        let mut slots = vec![Slot::Gemm];
        slots.extend(inner[2..].iter().map(|&c| Slot::Class(c)));
        let (epilogue, ops) = compose(&po, &outer, at, &pi, &slots);
        let mut children = vec![inner[0], inner[1]];
        for s in ops.into_iter().skip(1) {
            match s {
                Slot::Class(c) => children.push(c),
                Slot::Gemm => return None,
            }
        }
        let op = Op::FusedMatMul {
            transpose_b,
            epilogue,
        };
        add_like(eg, self.name(), op, children, class)
    }
}

/// `add-rms-norm`: `RmsNorm(Add(a, b), w) ⇒ AddRmsNorm(a, b, w)`.
pub(crate) struct AddRmsNormRule;

impl RuleImpl for AddRmsNormRule {
    rule_header! {
        name: "add-rms-norm",
        group: "fuse-elementwise",
        identity: "rms_norm(add(a, b), w) => add_rms_norm(a, b, w)",
    }
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>) {
        for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::RmsNorm { .. })) {
            for (a, _) in nodes_where(eg, n.children[0], |o| matches!(o, Op::Add)) {
                out.push(vec![
                    op_id(n.op),
                    a.children[0],
                    a.children[1],
                    n.children[1],
                ]);
            }
        }
    }
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id> {
        let Op::RmsNorm { eps } = op_at(eg, m[0]) else {
            return None;
        };
        add_like(
            eg,
            self.name(),
            Op::AddRmsNorm { eps },
            m[1..4].to_vec(),
            class,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::UnaryOp;

    #[test]
    fn compose_inlines_and_shares_operands() {
        // outer: mul(x0, x1) over [g, u]; inner (at g): silu(x0) over [z].
        let outer = program(&Op::Mul, 2).expect("mul");
        let inner = program(&Op::Unary(UnaryOp::Silu), 1).expect("silu");
        let (g, u, z) = (Id::from(7usize), Id::from(8usize), Id::from(9usize));
        let (e, ops) = compose(&outer, &[g, u], g, &inner, &[Slot::Class(z)]);
        assert_eq!(ops, vec![Slot::Class(z), Slot::Class(u)]);
        assert_eq!(
            e.steps,
            vec![
                EwStep::Unary {
                    f: UnaryOp::Silu,
                    x: 0
                },
                EwStep::Mul { a: 2, b: 1 }
            ]
        );
        // x·x where x = z + u: the inner program is used for both operands.
        let outer = program(&Op::Mul, 2).expect("mul");
        let inner = program(&Op::Add, 2).expect("add");
        let (e, ops) = compose(
            &outer,
            &[g, g],
            g,
            &inner,
            &[Slot::Class(z), Slot::Class(u)],
        );
        assert_eq!(ops.len(), 2);
        assert_eq!(
            e.steps,
            vec![EwStep::Add { a: 0, b: 1 }, EwStep::Mul { a: 2, b: 2 }]
        );
        // An epilogue: the GEMM result stays operand 0.
        let outer = program(&Op::Add, 2).expect("add");
        let (e, ops) = compose(&outer, &[g, u], g, &EwExpr { steps: vec![] }, &[Slot::Gemm]);
        assert_eq!(ops, vec![Slot::Gemm, Slot::Class(u)]);
        assert_eq!(e.steps, vec![EwStep::Add { a: 0, b: 1 }]);
    }
}
