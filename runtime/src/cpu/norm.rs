//! Row-wise normalisations over the last dim: `RmsNorm` (HF Llama), `LayerNorm`, `Softmax`.
//! Statistics accumulate in f64; outputs are f32.

use super::{f32_of, for_each_row, shape_err, softmax_row};
use crate::{RuntimeError, Tensor};

fn check_weight(op: &'static str, x: &Tensor, ws: &[&Tensor]) -> Result<usize, RuntimeError> {
    let h = x.shape.last().copied().unwrap_or(0);
    if x.shape.is_empty() || ws.iter().any(|w| w.shape != [h]) {
        let mut all = vec![x];
        all.extend_from_slice(ws);
        return Err(shape_err(
            op,
            &all,
            "weights must be [H] with H the last dim of x",
        ));
    }
    Ok(h)
}

/// `RmsNorm { eps }`: `w · (x · rsqrt(mean(x²) + eps))` over the last dim (HF `LlamaRMSNorm`).
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor, RuntimeError> {
    const OP: &str = "rms_norm";
    let h = check_weight(OP, x, &[w])?;
    let wd = f32_of(OP, w, 1)?;
    let mut out = f32_of(OP, x, 0)?.to_vec();
    for_each_row(&mut out, h, |_, row| {
        let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
        let inv = (1.0 / (ss / h as f64 + eps as f64).sqrt()) as f32;
        for (v, &g) in row.iter_mut().zip(wd) {
            *v = g * (*v * inv);
        }
    });
    Ok(Tensor::f32(x.shape.clone(), out))
}

/// `LayerNorm { eps }`: `(x − mean) / √(var + eps) · w + b` over the last dim, biased variance.
pub(crate) fn layer_norm(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "layer_norm";
    let h = check_weight(OP, x, &[w, b])?;
    let wd = f32_of(OP, w, 1)?;
    let bd = f32_of(OP, b, 2)?;
    let mut out = f32_of(OP, x, 0)?.to_vec();
    for_each_row(&mut out, h, |_, row| {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
        let rstd = 1.0 / (var + eps as f64).sqrt();
        for ((v, &g), &c) in row.iter_mut().zip(wd).zip(bd) {
            *v = ((*v as f64 - mean) * rstd * g as f64 + c as f64) as f32;
        }
    });
    Ok(Tensor::f32(x.shape.clone(), out))
}

/// `Softmax` over the last dim (max-subtracted).
pub(crate) fn softmax(x: &Tensor) -> Result<Tensor, RuntimeError> {
    let mut out = f32_of("softmax", x, 0)?.to_vec();
    let h = x.shape.last().copied().unwrap_or(1);
    for_each_row(&mut out, h, |_, row| softmax_row(row));
    Ok(Tensor::f32(x.shape.clone(), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_weight_gives_unit_rms() {
        let x = Tensor::f32(vec![2, 4], vec![1.0, -2.0, 3.0, 0.5, 0.0, 0.0, 0.0, 0.0]);
        let w = Tensor::f32(vec![4], vec![1.0; 4]);
        let y = rms_norm(&x, &w, 0.0).unwrap();
        let r = &y.as_f32().unwrap()[..4];
        let ms: f32 = r.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
        let y = rms_norm(&x, &w, 1e-5).unwrap();
        assert_eq!(&y.as_f32().unwrap()[4..], &[0.0; 4]);
    }

    #[test]
    fn softmax_is_shift_invariant_and_sums_to_one() {
        let x = Tensor::f32(vec![1, 3], vec![1000.0, 1001.0, 1002.0]);
        let y = softmax(&x).unwrap();
        let v = y.as_f32().unwrap();
        assert!((v.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((v[2] - 0.665_240_9).abs() < 1e-6);
    }

    #[test]
    fn layer_norm_rejects_bad_weight() {
        let x = Tensor::f32(vec![2, 4], vec![0.0; 8]);
        let w = Tensor::f32(vec![3], vec![0.0; 3]);
        assert!(matches!(
            layer_norm(&x, &w, &w, 1e-5),
            Err(RuntimeError::Shape { .. })
        ));
    }
}
