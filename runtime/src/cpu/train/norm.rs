//! Gradients of `RmsNorm` and `LayerNorm` over the last dim, in f64 per row. Bias gradients
//! of `LayerNorm` are `BiasGrad`s.
//!
//! With `x̂` the normalised row, `r` its reciprocal scale and `g = w ⊙ dy`:
//! RMSNorm `dx = r · (g − x̂ · mean(g ⊙ x̂))`; LayerNorm `dx = r · (g − mean(g) − x̂ · mean(g ⊙ x̂))`;
//! both `dw = Σ_rows dy ⊙ x̂`.

use crate::cpu::{f32_of, for_each_row, shape_err};
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::NormWrt;

/// `(H, x, w, dy)`: the row width and the operands' data.
type Operands<'t> = (usize, &'t [f32], &'t [f32], &'t [f32]);

/// Checks `(x, w, dy)` and returns their data.
fn operands<'t>(
    op: &'static str,
    x: &'t Tensor,
    w: &'t Tensor,
    dy: &'t Tensor,
) -> Result<Operands<'t>, RuntimeError> {
    let h = x.shape.last().copied().unwrap_or(0);
    if x.shape.is_empty() || w.shape != [h] || dy.shape != x.shape {
        return Err(shape_err(
            op,
            &[x, w, dy],
            "expects x[.., H], w[H], dy like x",
        ));
    }
    Ok((h, f32_of(op, x, 0)?, f32_of(op, w, 1)?, f32_of(op, dy, 2)?))
}

/// The normalised row and its reciprocal scale: RMS (`center` false) or LayerNorm.
fn normalise(row: &[f32], eps: f32, center: bool) -> (Vec<f64>, f64) {
    let h = row.len() as f64;
    let mean = if center {
        row.iter().map(|&v| v as f64).sum::<f64>() / h
    } else {
        0.0
    };
    let ms = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h;
    let r = 1.0 / (ms + eps as f64).sqrt();
    (row.iter().map(|&v| (v as f64 - mean) * r).collect(), r)
}

/// The gradient with respect to `x`, row by row.
fn dx((h, xd, wd, gd): Operands, eps: f32, center: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; xd.len()];
    for_each_row(&mut out, h, |i, o| {
        let (xh, r) = normalise(&xd[i * h..(i + 1) * h], eps, center);
        let g: Vec<f64> = gd[i * h..(i + 1) * h]
            .iter()
            .zip(wd)
            .map(|(&d, &w)| d as f64 * w as f64)
            .collect();
        let n = h as f64;
        let mean_g = if center {
            g.iter().sum::<f64>() / n
        } else {
            0.0
        };
        let mean_gx = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / n;
        for ((o, gi), xi) in o.iter_mut().zip(&g).zip(&xh) {
            *o = (r * (gi - mean_g - xi * mean_gx)) as f32;
        }
    });
    out
}

/// The gradient with respect to `w`, summed over the rows.
fn dw((h, xd, _, gd): Operands, eps: f32, center: bool) -> Vec<f32> {
    let mut acc = vec![0.0f64; h];
    if h > 0 {
        for (xr, gr) in xd.chunks(h).zip(gd.chunks(h)) {
            let (xh, _) = normalise(xr, eps, center);
            for ((a, &g), xi) in acc.iter_mut().zip(gr).zip(&xh) {
                *a += g as f64 * xi;
            }
        }
    }
    acc.into_iter().map(|a| a as f32).collect()
}

/// `RmsNormGrad` (`center` false) or `LayerNormGrad` (`center` true) with respect to `wrt`.
pub(crate) fn norm_grad(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f32,
    center: bool,
    wrt: NormWrt,
) -> Result<Tensor, RuntimeError> {
    let op = if center {
        "layer_norm_grad"
    } else {
        "rms_norm_grad"
    };
    let ops = operands(op, x, w, dy)?;
    Ok(match wrt {
        NormWrt::X => Tensor::f32(x.shape.clone(), dx(ops, eps, center)),
        NormWrt::Weight => Tensor::f32(vec![ops.0], dw(ops, eps, center)),
    })
}

#[cfg(test)]
mod tests {
    use super::super::check::{check_vjp, rand_tensor, Rng};
    use super::*;
    use crate::cpu::norm;

    #[test]
    fn norm_grads_match_finite_differences() {
        let mut rng = Rng::new(11);
        let x = rand_tensor(&mut rng, &[2, 3, 8], 2.0);
        let w = rand_tensor(&mut rng, &[8], 1.5);
        let b = rand_tensor(&mut rng, &[8], 1.0);
        let dy = rand_tensor(&mut rng, &[2, 3, 8], 1.0);
        let eps = 1e-5;
        let rms = |xs: &[Tensor]| norm::rms_norm(&xs[0], &xs[1], eps).unwrap();
        let inputs = [x.clone(), w.clone()];
        check_vjp(
            "rms dx",
            &inputs,
            0,
            &dy,
            &norm_grad(&x, &w, &dy, eps, false, NormWrt::X).unwrap(),
            rms,
        );
        check_vjp(
            "rms dw",
            &inputs,
            1,
            &dy,
            &norm_grad(&x, &w, &dy, eps, false, NormWrt::Weight).unwrap(),
            rms,
        );
        let b2 = b.clone();
        let ln = move |xs: &[Tensor]| norm::layer_norm(&xs[0], &xs[1], &b2, eps).unwrap();
        check_vjp(
            "ln dx",
            &inputs,
            0,
            &dy,
            &norm_grad(&x, &w, &dy, eps, true, NormWrt::X).unwrap(),
            &ln,
        );
        check_vjp(
            "ln dw",
            &inputs,
            1,
            &dy,
            &norm_grad(&x, &w, &dy, eps, true, NormWrt::Weight).unwrap(),
            &ln,
        );
    }
}
