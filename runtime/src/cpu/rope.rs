//! Rotary position embedding, HF semantics: `angle = inv_freq[i] · pos` in f32 (HF computes
//! `inv_freq @ position_ids` in float32), cos/sin of the f32 angle, then
//! `x·cos + rotate(x)·sin` in f32.

use super::{f32_of, for_each_row, i32_of, shape_err};
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::{RopeSpec, RopeStyle};

/// `Rope(spec)`: `x[B, T, N, D]`, `pos[B, T]` (i32) → `[B, T, N, D]`.
///
/// `Half` pairs element `i` with `i + D/2` (`rotate_half`); `Interleaved` pairs `2i` with
/// `2i + 1`. Pair `i` rotates by `pos · inv_freq[i]`, with `inv_freq` from
/// [`RopeSpec::inv_freq`] (which applies any frequency scaling).
pub(crate) fn rope(x: &Tensor, pos: &Tensor, spec: &RopeSpec) -> Result<Tensor, RuntimeError> {
    let turn = |a: f32, b: f32, sin: f64, cos: f64| {
        let (s, c) = (sin as f32, cos as f32);
        (a * c + (-b) * s, b * c + a * s)
    };
    rotate_pairs(
        "rope",
        x,
        pos,
        spec,
        "expects x[B,T,N,D] and pos[B,T]",
        turn,
    )
}

/// Checks `x[B, T, N, D]` and `pos[B, T]` (D even) and returns `x` with every head's rotary
/// pair `(a, b)` replaced by `turn(a, b, sin, cos)` of its angle, `pos · inv_freq[i]` computed
/// in f32 (the forward kernel and its gradient share the pairing and the angles).
pub(crate) fn rotate_pairs(
    op: &'static str,
    x: &Tensor,
    pos: &Tensor,
    spec: &RopeSpec,
    expects: &'static str,
    turn: impl Fn(f32, f32, f64, f64) -> (f32, f32) + Sync,
) -> Result<Tensor, RuntimeError> {
    let pd = i32_of(op, pos, 1)?;
    if x.shape.len() != 4 || pos.shape.len() != 2 || x.shape[..2] != pos.shape[..] {
        return Err(shape_err(op, &[x, pos], expects));
    }
    let (n, d) = (x.shape[2], x.shape[3]);
    if d % 2 != 0 {
        return Err(shape_err(op, &[x, pos], "head dim must be even"));
    }
    let half = d / 2;
    let inv = spec.inv_freq(d);
    let style = spec.style;
    let mut out = f32_of(op, x, 0)?.to_vec();
    for_each_row(&mut out, n * d, |r, row| {
        let p = pd[r] as f32;
        for (i, &f) in inv.iter().enumerate() {
            let angle = (f * p) as f64;
            let (s, c) = (angle.sin(), angle.cos());
            let (lo, hi) = match style {
                RopeStyle::Half => (i, i + half),
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            };
            for head in row.chunks_mut(d) {
                (head[lo], head[hi]) = turn(head[lo], head[hi], s, c);
            }
        }
    });
    Ok(Tensor::f32(x.shape.clone(), out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_compiler::ir::Float;

    #[test]
    fn position_zero_is_identity_and_norm_is_kept() {
        let spec = RopeSpec {
            theta: Float(10000.0),
            style: RopeStyle::Half,
            scaling: None,
        };
        let xs: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.5).collect();
        let x = Tensor::f32(vec![1, 2, 2, 4], xs.clone());
        let pos = Tensor::i32(vec![1, 2], vec![0, 7]);
        let y = rope(&x, &pos, &spec).unwrap();
        let v = y.as_f32().unwrap();
        assert_eq!(&v[..8], &xs[..8]);
        let n0: f32 = xs[8..].iter().map(|a| a * a).sum();
        let n1: f32 = v[8..].iter().map(|a| a * a).sum();
        assert!((n0 - n1).abs() < 1e-5);
    }
}
