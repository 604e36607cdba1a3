//! Fused ops the rewriter creates, defined by the unfused kernels they replace:
//! `FusedElementwise` runs its program step by step with the `Add`/`Mul`/`Unary`/`Scale`/`Cast`
//! kernels, `FusedMatMul` is `MatMul` then its epilogue, `AddRmsNorm` is `Add` then
//! `RmsNorm`. Results are therefore bit-identical to the chains they replace; a GPU backend
//! fuses them into one kernel.

use super::{elementwise, linalg, norm, shape_err};
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::{EwExpr, EwStep};
use std::borrow::Cow;

/// `FusedElementwise { expr }` on `inputs`.
pub(crate) fn elementwise(expr: &EwExpr, inputs: &[&Tensor]) -> Result<Tensor, RuntimeError> {
    run(expr, inputs.iter().map(|t| Cow::Borrowed(*t)).collect())
}

/// Runs `expr` with `vals` as its operands.
fn run<'t>(expr: &EwExpr, mut vals: Vec<Cow<'t, Tensor>>) -> Result<Tensor, RuntimeError> {
    const OP: &str = "fused_elementwise";
    if expr.steps.is_empty() {
        let args: Vec<&Tensor> = vals.iter().map(|c| c.as_ref()).collect();
        return Err(shape_err(OP, &args, "the program has no steps"));
    }
    for s in &expr.steps {
        let arg = |i: u32| -> Result<&Tensor, RuntimeError> {
            vals.get(i as usize).map(|c| c.as_ref()).ok_or_else(|| {
                let args: Vec<&Tensor> = vals.iter().map(|c| c.as_ref()).collect();
                shape_err(OP, &args, "a step reads a value not defined before it")
            })
        };
        let t = match *s {
            EwStep::Add { a, b } => elementwise::add(arg(a)?, arg(b)?)?,
            EwStep::Mul { a, b } => elementwise::mul(arg(a)?, arg(b)?)?,
            EwStep::Unary { f, x } => elementwise::unary(f, arg(x)?)?,
            EwStep::Scale { c, x } => elementwise::scale(arg(x)?, c.0)?,
            EwStep::Cast { to, x } => elementwise::cast(arg(x)?, to)?,
        };
        vals.push(Cow::Owned(t));
    }
    Ok(vals
        .pop()
        .expect("invariant: a step was pushed")
        .into_owned())
}

/// `FusedMatMul { transpose_b, epilogue }` on `(a, b, x₁, ..)`.
pub(crate) fn matmul(
    transpose_b: bool,
    epilogue: &EwExpr,
    inputs: &[&Tensor],
) -> Result<Tensor, RuntimeError> {
    if inputs.len() < 2 {
        return Err(shape_err(
            "fused_matmul",
            inputs,
            "needs at least 2 operands",
        ));
    }
    let p = linalg::matmul(inputs[0], inputs[1], transpose_b)?;
    let mut vals = vec![Cow::Owned(p)];
    vals.extend(inputs[2..].iter().map(|t| Cow::Borrowed(*t)));
    run(epilogue, vals)
}

/// `AddRmsNorm { eps }` on `(a, b, w)`.
pub(crate) fn add_rms_norm(
    a: &Tensor,
    b: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<Tensor, RuntimeError> {
    norm::rms_norm(&elementwise::add(a, b)?, w, eps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_compiler::ir::{DType, Float, UnaryOp};

    fn t(shape: &[usize], seed: u32) -> Tensor {
        let n = shape.iter().product();
        let v = (0..n)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 1000.0 - 1.0)
            .collect();
        Tensor::f32(shape.to_vec(), v)
    }

    #[test]
    fn programs_compute_exactly_their_unfused_chains() {
        use DType::Bf16;
        use EwStep::{Add, Cast, Mul, Scale, Unary};
        use UnaryOp::{GeluTanh, Silu};
        let (x, y, bias) = (t(&[3, 5], 1), t(&[3, 5], 2), t(&[5], 3));
        let c = Float(0.75);
        let expr = EwExpr {
            steps: vec![
                Add { a: 0, b: 2 },
                Unary { f: Silu, x: 3 },
                Mul { a: 4, b: 1 },
                Scale { c, x: 5 },
                Cast { to: Bf16, x: 6 },
            ],
        };
        let got = elementwise(&expr, &[&x, &y, &bias]).expect("fused");
        let s = elementwise::add(&x, &bias).expect("add");
        let s = elementwise::unary(Silu, &s).expect("silu");
        let s = elementwise::mul(&s, &y).expect("mul");
        let s = elementwise::scale(&s, 0.75).expect("scale");
        let want = elementwise::cast(&s, Bf16).expect("cast");
        assert_eq!(got, want);
        // Epilogue: (x·w + bias) then GeLU.
        let w = t(&[5, 4], 4);
        let b4 = t(&[4], 5);
        let ep = EwExpr {
            steps: vec![Add { a: 0, b: 1 }, Unary { f: GeluTanh, x: 2 }],
        };
        let got = matmul(false, &ep, &[&x, &w, &b4]).expect("fused matmul");
        let p = linalg::matmul(&x, &w, false).expect("gemm");
        let p = elementwise::add(&p, &b4).expect("bias");
        assert_eq!(got, elementwise::unary(GeluTanh, &p).expect("gelu"));
        let got = add_rms_norm(&x, &y, &bias, 1e-5).expect("add rms norm");
        let s = elementwise::add(&x, &y).expect("add");
        assert_eq!(got, norm::rms_norm(&s, &bias, 1e-5).expect("norm"));
        // A step reading a value not defined yet is an error, not a panic.
        let bad = EwExpr {
            steps: vec![Add { a: 0, b: 9 }],
        };
        assert!(elementwise(&bad, &[&x]).is_err());
    }
}
