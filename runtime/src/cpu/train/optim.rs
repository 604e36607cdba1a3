//! The AdamW step, PyTorch semantics (`torch.optim.AdamW`, single-tensor path): moments in
//! f32 as PyTorch stores them, the parameter update in f64 rounded once.

use crate::cpu::{f32_of, shape_err};
use crate::{RuntimeError, Tensor};
use rayon::prelude::*;
use shardc_compiler::ir::AdamWSpec;

/// `AdamMoment { beta, squared }`: `m + (1 − β)·(g − m)` (PyTorch's `lerp_` with weight
/// `1 − β` < ½), or `β·v + (1 − β)·g·g` (`mul_(β).addcmul_(g, g, 1 − β)`), in f32.
pub(crate) fn moment(
    m: &Tensor,
    g: &Tensor,
    beta: f32,
    squared: bool,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "adam_moment";
    let (md, gd) = (f32_of(OP, m, 0)?, f32_of(OP, g, 1)?);
    if m.shape != g.shape {
        return Err(shape_err(OP, &[m, g], "moment and gradient differ"));
    }
    let w = (1.0 - beta as f64) as f32;
    let out: Vec<f32> = md
        .par_iter()
        .zip(gd.par_iter())
        .map(|(&m, &g)| {
            if squared {
                m * beta + w * g * g
            } else {
                m + w * (g - m)
            }
        })
        .collect();
    Ok(Tensor::f32(m.shape.clone(), out))
}

/// `AdamWUpdate(spec)`: `w·(1 − lr·λ) − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)`, `t` the
/// scalar `step`, in f64.
pub(crate) fn update(
    w: &Tensor,
    m: &Tensor,
    v: &Tensor,
    step: &Tensor,
    spec: &AdamWSpec,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "adamw_update";
    let all = [w, m, v, step];
    let (wd, md, vd) = (f32_of(OP, w, 0)?, f32_of(OP, m, 1)?, f32_of(OP, v, 2)?);
    let sd = f32_of(OP, step, 3)?;
    if m.shape != w.shape || v.shape != w.shape || sd.len() != 1 || !step.shape.is_empty() {
        return Err(shape_err(
            OP,
            &all,
            "expects w, m, v of one shape and a scalar step",
        ));
    }
    let t = sd[0] as f64;
    let (lr, b1, b2) = (spec.lr.0 as f64, spec.beta1.0 as f64, spec.beta2.0 as f64);
    let (eps, wdecay) = (spec.eps.0 as f64, spec.weight_decay.0 as f64);
    let step_size = lr / (1.0 - b1.powf(t));
    let bc2_sqrt = (1.0 - b2.powf(t)).sqrt();
    let decay = 1.0 - lr * wdecay;
    let out: Vec<f32> = (0..wd.len())
        .into_par_iter()
        .map(|i| {
            let denom = (vd[i] as f64).sqrt() / bc2_sqrt + eps;
            (wd[i] as f64 * decay - step_size * md[i] as f64 / denom) as f32
        })
        .collect();
    Ok(Tensor::f32(w.shape.clone(), out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_compiler::ir::Float;

    #[test]
    fn first_step_is_sign_descent_with_decay() {
        let spec = AdamWSpec::default();
        let w = Tensor::f32(vec![4], vec![1.0, -2.0, 0.5, 3.0]);
        let g = Tensor::f32(vec![4], vec![0.3, -1e-3, 0.0, 5.0]);
        let z = Tensor::f32(vec![4], vec![0.0; 4]);
        let m = moment(&z, &g, 0.9, false).unwrap();
        let v = moment(&z, &g, 0.95, true).unwrap();
        let step = Tensor::f32(vec![], vec![1.0]);
        let w1 = update(&w, &m, &v, &step, &spec).unwrap();
        let (lr, wd, eps) = (1e-3f64, 0.1f64, 1e-8f64);
        for i in 0..4 {
            let (wi, gi) = (w.as_f32().unwrap()[i] as f64, g.as_f32().unwrap()[i] as f64);
            let want = wi * (1.0 - lr * wd) - lr * gi / (gi.abs() + eps);
            assert!((w1.as_f32().unwrap()[i] as f64 - want).abs() < 1e-7, "{i}");
        }
        // A second step with the same gradient keeps the bias-corrected ratio at ±1.
        let m2 = moment(&m, &g, 0.9, false).unwrap();
        let v2 = moment(&v, &g, 0.95, true).unwrap();
        let s2 = Tensor::f32(vec![], vec![2.0]);
        let spec0 = AdamWSpec {
            weight_decay: Float(0.0),
            ..spec
        };
        let w2 = update(&w1, &m2, &v2, &s2, &spec0).unwrap();
        let d = w1.as_f32().unwrap()[3] - w2.as_f32().unwrap()[3];
        // Within the f32 rounding of w (≈ 3): 2.4e-7.
        assert!((d as f64 - 1e-3).abs() < 5e-7, "{d}");
    }
}
