//! Elementwise ops: `Add`/`Mul` with suffix broadcast, `Unary`, `Scale`, `Cast`, `RankOffset`.
//!
//! Transcendental functions are evaluated in f64 and rounded once, so each result is within
//! an ulp of the correctly rounded f32 value (what PyTorch's f32 kernels also aim for).

use super::{f32_of, i32_of, shape_err, PAR_MIN};
use crate::weights::round_to;
use crate::{Buffer, RuntimeError, Tensor};
use rayon::prelude::*;
use shardc_compiler::ir::{DType, UnaryOp};

/// √(2/π), the GeLU tanh-approximation constant.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// Applies `f` to every element of `v` in place, in parallel for large slices.
pub(crate) fn map_in_place<T: Copy + Send + Sync>(v: &mut [T], f: impl Fn(T) -> T + Sync) {
    if v.len() >= PAR_MIN {
        v.par_chunks_mut(PAR_MIN / 4)
            .for_each(|c| c.iter_mut().for_each(|x| *x = f(*x)));
    } else {
        v.iter_mut().for_each(|x| *x = f(*x));
    }
}

/// `a op b` with `b` broadcast over `a` (b's shape a suffix of a's).
fn broadcast<T: Copy + Send + Sync>(a: &[T], b: &[T], f: impl Fn(T, T) -> T + Sync) -> Vec<T> {
    let mut out = a.to_vec();
    let nb = b.len();
    if nb == 0 {
        return out;
    }
    let apply = |chunk: &mut [T]| {
        for row in chunk.chunks_mut(nb) {
            for (x, &y) in row.iter_mut().zip(b) {
                *x = f(*x, y);
            }
        }
    };
    if out.len() >= PAR_MIN {
        let rows = (PAR_MIN / 4 / nb).max(1);
        out.par_chunks_mut(rows * nb).for_each(apply);
    } else {
        apply(&mut out);
    }
    out
}

fn binary(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    ff: impl Fn(f32, f32) -> f32 + Sync,
    fi: impl Fn(i32, i32) -> i32 + Sync,
) -> Result<Tensor, RuntimeError> {
    let (ar, br) = (a.shape.len(), b.shape.len());
    if br > ar || a.shape[ar - br..] != b.shape[..] {
        return Err(shape_err(op, &[a, b], "b's shape must be a suffix of a's"));
    }
    let shape = a.shape.clone();
    match (&a.data, &b.data) {
        (Buffer::F32(x), Buffer::F32(y)) => Ok(Tensor::f32(shape, broadcast(x, y, ff))),
        (Buffer::I32(x), Buffer::I32(y)) => Ok(Tensor::i32(shape, broadcast(x, y, fi))),
        _ => Err(RuntimeError::OperandDType {
            op,
            operand: 1,
            expected: a.dtype_name(),
            found: b.dtype_name(),
        }),
    }
}

/// `Add`: `a + b`, `b` broadcast as a suffix (i32 wraps).
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor, RuntimeError> {
    binary("add", a, b, |x, y| x + y, i32::wrapping_add)
}

/// `Mul`: `a · b`, `b` broadcast as a suffix (i32 wraps).
pub(crate) fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor, RuntimeError> {
    binary("mul", a, b, |x, y| x * y, i32::wrapping_mul)
}

/// The scalar function of a unary op.
pub(crate) fn unary_fn(u: UnaryOp) -> fn(f32) -> f32 {
    match u {
        UnaryOp::GeluTanh => gelu_tanh,
        UnaryOp::GeluErf => gelu_erf,
        UnaryOp::Silu => silu,
        UnaryOp::Relu => relu,
        UnaryOp::Exp => |x| (x as f64).exp() as f32,
        UnaryOp::Neg => |x| -x,
    }
}

/// GeLU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())) as f32
}

/// GeLU, exact: 0.5·x·(1 + erf(x/√2)), evaluated as 0.5·x·erfc(−x/√2) so the negative tail
/// keeps its relative precision.
pub(crate) fn gelu_erf(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2)) as f32
}

/// SiLU: x·sigmoid(x).
pub(crate) fn silu(x: f32) -> f32 {
    let x = x as f64;
    (x / (1.0 + (-x).exp())) as f32
}

/// ReLU: max(x, 0), NaN preserved.
pub(crate) fn relu(x: f32) -> f32 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// `Unary(u)` on an f32 tensor.
pub(crate) fn unary(u: UnaryOp, x: &Tensor) -> Result<Tensor, RuntimeError> {
    let mut v = f32_of("unary", x, 0)?.to_vec();
    map_in_place(&mut v, unary_fn(u));
    Ok(Tensor::f32(x.shape.clone(), v))
}

/// `Scale(c)`: `x · c` in f32.
pub(crate) fn scale(x: &Tensor, c: f32) -> Result<Tensor, RuntimeError> {
    let mut v = f32_of("scale", x, 0)?.to_vec();
    map_in_place(&mut v, |e| e * c);
    Ok(Tensor::f32(x.shape.clone(), v))
}

/// `Cast(dt)`: to i32 truncates toward zero (saturating, NaN → 0); to bf16/f16 rounds to
/// nearest-even at that precision and keeps f32 storage; from i32 converts exactly up to 2²⁴.
pub(crate) fn cast(x: &Tensor, dt: DType) -> Result<Tensor, RuntimeError> {
    let shape = x.shape.clone();
    Ok(match (&x.data, dt) {
        (Buffer::I32(v), DType::I32) => Tensor::i32(shape, v.clone()),
        (Buffer::F32(v), DType::I32) => Tensor::i32(shape, v.iter().map(|&e| e as i32).collect()),
        (Buffer::I32(v), _) => {
            let mut f: Vec<f32> = v.iter().map(|&e| e as f32).collect();
            round_to(dt, &mut f);
            Tensor::f32(shape, f)
        }
        (Buffer::F32(v), _) => {
            let mut f = v.clone();
            round_to(dt, &mut f);
            Tensor::f32(shape, f)
        }
    })
}

/// `RankOffset`: `x − coord · stride` on i32 values (wrapping).
pub(crate) fn rank_offset(x: &Tensor, coord: usize, stride: usize) -> Result<Tensor, RuntimeError> {
    let off = (coord * stride) as i32;
    let v = i32_of("rank_offset", x, 0)?
        .iter()
        .map(|&e| e.wrapping_sub(off))
        .collect();
    Ok(Tensor::i32(x.shape.clone(), v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_gelu_matches_known_values() {
        // 0.5·x·(1 + erf(x/√2)) from high-precision references.
        let cases = [
            (1.0f32, 0.841_344_746_068_542_9f64),
            (-1.0, -0.158_655_253_931_457_05),
            (2.5, 2.484_475_836_685_559_7),
            (-3.0, -0.004_049_694_094_890_287),
        ];
        for (x, want) in cases {
            let got = gelu_erf(x) as f64;
            assert!(
                (got - want).abs() < 1e-7 * want.abs().max(1e-3),
                "gelu_erf({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn broadcast_suffix_and_i32() {
        let a = Tensor::i32(vec![2, 3], vec![1, 2, 3, 4, 5, 6]);
        let b = Tensor::i32(vec![3], vec![10, 20, 30]);
        assert_eq!(
            add(&a, &b).unwrap().as_i32().unwrap(),
            &[11, 22, 33, 14, 25, 36]
        );
        let bad = Tensor::i32(vec![2], vec![1, 2]);
        assert!(matches!(
            add(&a, &bad),
            Err(RuntimeError::Shape { op: "add", .. })
        ));
    }

    #[test]
    fn cast_rounds_and_truncates() {
        let x = Tensor::f32(vec![3], vec![1.0 + 1.0 / 512.0, -2.7, 65519.0]);
        let bf = cast(&x, DType::Bf16).unwrap();
        assert_eq!(bf.as_f32().unwrap()[0], 1.0); // ties to even at 8 mantissa bits
        let h = cast(&x, DType::F16).unwrap();
        assert_eq!(h.as_f32().unwrap()[2], 65504.0);
        let i = cast(&x, DType::I32).unwrap();
        assert_eq!(i.as_i32().unwrap(), &[1, -2, 65519]);
        let back = cast(&i, DType::F32).unwrap();
        assert_eq!(back.as_f32().unwrap(), &[1.0, -2.0, 65519.0]);
    }

    #[test]
    fn rank_offset_shifts_ids() {
        let x = Tensor::i32(vec![3], vec![0, 70, 140]);
        let y = rank_offset(&x, 2, 64).unwrap();
        assert_eq!(y.as_i32().unwrap(), &[-128, -58, 12]);
    }
}
