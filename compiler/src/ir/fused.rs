//! Elementwise programs: the body of the fused ops the rewriter creates
//! ([`Op::FusedElementwise`] and the epilogue of [`Op::FusedMatMul`]).
//!
//! An [`EwExpr`] is a straight-line program over its operands. Step `i` of a program with `n`
//! operands defines value `n + i`; a step reads operands and earlier steps only; the result is
//! the last step. Each step has exactly the semantics (and the type rule) of the unfused op it
//! names (`Add`, `Mul`, `Unary`, `Scale`, `Cast`), so a fused op computes bit for bit what the
//! chain it replaces computes.

use super::{DType, Float, IrError, Op, TensorType, UnaryOp};
use serde::{Deserialize, Serialize};

/// One step of an [`EwExpr`]. Arguments index the program's values (operands, then steps).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum EwStep {
    /// `a + b` (as [`Op::Add`]: `b` broadcast onto `a` by suffix).
    Add {
        /// Left value.
        a: u32,
        /// Right value.
        b: u32,
    },
    /// `a · b` (as [`Op::Mul`]).
    Mul {
        /// Left value.
        a: u32,
        /// Right value.
        b: u32,
    },
    /// `f(x)` (as [`Op::Unary`]).
    Unary {
        /// The function.
        f: UnaryOp,
        /// Argument.
        x: u32,
    },
    /// `x · c` (as [`Op::Scale`]).
    Scale {
        /// The constant.
        c: Float,
        /// Argument.
        x: u32,
    },
    /// Change of dtype (as [`Op::Cast`]).
    Cast {
        /// Target dtype.
        to: DType,
        /// Argument.
        x: u32,
    },
}

impl EwStep {
    /// The unfused op this step computes.
    pub fn op(&self) -> Op {
        match self {
            EwStep::Add { .. } => Op::Add,
            EwStep::Mul { .. } => Op::Mul,
            EwStep::Unary { f, .. } => Op::Unary(*f),
            EwStep::Scale { c, .. } => Op::Scale(*c),
            EwStep::Cast { to, .. } => Op::Cast(*to),
        }
    }

    /// The values this step reads, in operand order.
    pub fn args(&self) -> Vec<u32> {
        match *self {
            EwStep::Add { a, b } | EwStep::Mul { a, b } => vec![a, b],
            EwStep::Unary { x, .. } | EwStep::Scale { x, .. } | EwStep::Cast { x, .. } => vec![x],
        }
    }

    /// The same step with every argument index mapped by `f`.
    pub fn map_args(&self, f: impl Fn(u32) -> u32) -> EwStep {
        match *self {
            EwStep::Add { a, b } => EwStep::Add { a: f(a), b: f(b) },
            EwStep::Mul { a, b } => EwStep::Mul { a: f(a), b: f(b) },
            EwStep::Unary { f: u, x } => EwStep::Unary { f: u, x: f(x) },
            EwStep::Scale { c, x } => EwStep::Scale { c, x: f(x) },
            EwStep::Cast { to, x } => EwStep::Cast { to, x: f(x) },
        }
    }

    /// The step computing `op` on `args`, if `op` is elementwise (`Add`, `Mul`, `Unary`,
    /// `Scale`, `Cast`) and `args` has its arity.
    pub fn from_op(op: &Op, args: &[u32]) -> Option<EwStep> {
        Some(match (op, args) {
            (Op::Add, &[a, b]) => EwStep::Add { a, b },
            (Op::Mul, &[a, b]) => EwStep::Mul { a, b },
            (Op::Unary(f), &[x]) => EwStep::Unary { f: *f, x },
            (Op::Scale(c), &[x]) => EwStep::Scale { c: *c, x },
            (Op::Cast(to), &[x]) => EwStep::Cast { to: *to, x },
            _ => return None,
        })
    }
}

/// A straight-line elementwise program; its result is the last step.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EwExpr {
    /// The steps, in order.
    pub steps: Vec<EwStep>,
}

impl EwExpr {
    /// The type of every value of the program (operands, then steps) for operands of types
    /// `inputs`; each step is checked by its op's type rule.
    pub fn value_types(
        &self,
        op: &'static str,
        inputs: &[&TensorType],
    ) -> Result<Vec<TensorType>, IrError> {
        if self.steps.is_empty() {
            return Err(IrError::Shape {
                op,
                detail: "an elementwise program needs at least one step".into(),
            });
        }
        let mut tys: Vec<TensorType> = inputs.iter().map(|t| (*t).clone()).collect();
        for (i, s) in self.steps.iter().enumerate() {
            let args = s.args();
            let mut arg_tys = Vec::with_capacity(args.len());
            for a in args {
                let Some(t) = tys.get(a as usize) else {
                    return Err(IrError::Shape {
                        op,
                        detail: format!(
                            "step {i} reads value {a}, which is not defined before it \
                             ({} operands, {i} earlier steps)",
                            inputs.len()
                        ),
                    });
                };
                arg_tys.push(t);
            }
            let t = s.op().infer(&arg_tys, None).map_err(|e| IrError::Shape {
                op,
                detail: format!("step {i}: {e}"),
            })?;
            tys.push(t);
        }
        Ok(tys)
    }

    /// The result type for operands of types `inputs`.
    pub fn infer(&self, op: &'static str, inputs: &[&TensorType]) -> Result<TensorType, IrError> {
        let mut tys = self.value_types(op, inputs)?;
        Ok(tys
            .pop()
            .expect("invariant: a program has at least one step"))
    }
}
