//! Gradients of the mixture-of-experts ops: `RouterGrad` (through the softmax, the top-k
//! selection and the renormalisation), `DispatchGrad` and `CombineGrad`.

use crate::cpu::{f32_of, for_each_row, shape_err, softmax_row};
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::CombineWrt;

/// The experts `Router { top_k }` keeps for one row of f32 probabilities: by value
/// descending, ties to the lower index (the forward kernel's order).
fn kept(p: &[f32], top_k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(top_k);
    idx
}

/// `RouterGrad { top_k, normalize }`: with `p = softmax(logits)`, kept set `K` and
/// `S = Σ_K p`: `dp_e = (dg_e − Σ_K dg·g) / S` on `K` (renormalised) or `dg_e` (not), zero
/// off `K`; then `dlogits = p ⊙ (dp − Σ p·dp)`. Selection from the forward's f32
/// probabilities, derivatives in f64.
pub(crate) fn router_grad(
    logits: &Tensor,
    dgates: &Tensor,
    top_k: usize,
    normalize: bool,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "router_grad";
    let (ld, gd) = (f32_of(OP, logits, 0)?, f32_of(OP, dgates, 1)?);
    let e = logits.shape.last().copied().unwrap_or(0);
    if logits.shape != dgates.shape || top_k == 0 || top_k > e {
        return Err(shape_err(
            OP,
            &[logits, dgates],
            "logits and dgates differ or top_k out of range",
        ));
    }
    let mut out = vec![0.0f32; ld.len()];
    for_each_row(&mut out, e, |r, o| {
        let row = &ld[r * e..(r + 1) * e];
        let dg = &gd[r * e..(r + 1) * e];
        let mut p32 = row.to_vec();
        softmax_row(&mut p32);
        let keep = kept(&p32, top_k);
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let ex: Vec<f64> = row.iter().map(|&x| (x as f64 - max).exp()).collect();
        let z: f64 = ex.iter().sum();
        let p: Vec<f64> = ex.iter().map(|x| x / z).collect();
        let mut dp = vec![0.0f64; e];
        if normalize {
            let s: f64 = keep.iter().map(|&i| p[i]).sum();
            let dot: f64 = keep.iter().map(|&i| dg[i] as f64 * p[i] / s).sum();
            for &i in &keep {
                dp[i] = (dg[i] as f64 - dot) / s;
            }
        } else {
            for &i in &keep {
                dp[i] = dg[i] as f64;
            }
        }
        let dot: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        for ((o, pi), di) in o.iter_mut().zip(&p).zip(&dp) {
            *o = (pi * (di - dot)) as f32;
        }
    });
    Ok(Tensor::f32(logits.shape.clone(), out))
}

/// Checks `y[E,B,T,H]` (or any `[E, rows.., H]` operand) against `gates[B,T,E]`; returns
/// `(E, B·T, H)`.
fn moe_dims(
    op: &'static str,
    y: &Tensor,
    g: &Tensor,
    all: &[&Tensor],
) -> Result<(usize, usize, usize), RuntimeError> {
    if y.shape.len() != 4
        || g.shape.len() != 3
        || y.shape[1..3] != g.shape[..2]
        || y.shape[0] != g.shape[2]
    {
        return Err(shape_err(op, all, "expects [E,B,T,H] and gates[B,T,E]"));
    }
    Ok((y.shape[0], y.shape[1] * y.shape[2], y.shape[3]))
}

/// `DispatchGrad`: `dx[b,t] = Σₑ dxe[e,b,t]` over the experts whose gate is non-zero.
pub(crate) fn dispatch_grad(dxe: &Tensor, gates: &Tensor) -> Result<Tensor, RuntimeError> {
    const OP: &str = "dispatch_grad";
    let (xd, gd) = (f32_of(OP, dxe, 0)?, f32_of(OP, gates, 1)?);
    let (e, bt, h) = moe_dims(OP, dxe, gates, &[dxe, gates])?;
    let mut out = vec![0.0f32; bt * h];
    for_each_row(&mut out, h, |r, o| {
        for (j, o) in o.iter_mut().enumerate() {
            let s: f64 = (0..e)
                .filter(|&ei| gd[r * e + ei] != 0.0)
                .map(|ei| xd[(ei * bt + r) * h + j] as f64)
                .sum();
            *o = s as f32;
        }
    });
    Ok(Tensor::f32(dxe.shape[1..].to_vec(), out))
}

/// `CombineGrad { wrt }`: wrt `y`, `gates[b,t,e]·dy[b,t]` where the gate is non-zero; wrt
/// `gates`, `dy[b,t]·y[e,b,t]` where the gate is non-zero; zero elsewhere.
pub(crate) fn combine_grad(
    y: &Tensor,
    gates: &Tensor,
    dy: &Tensor,
    wrt: CombineWrt,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "combine_grad";
    let all = [y, gates, dy];
    let (yd, gd, dd) = (f32_of(OP, y, 0)?, f32_of(OP, gates, 1)?, f32_of(OP, dy, 2)?);
    let (e, bt, h) = moe_dims(OP, y, gates, &all)?;
    if dy.shape != y.shape[1..] {
        return Err(shape_err(OP, &all, "dy must be [B,T,H]"));
    }
    match wrt {
        CombineWrt::Y => {
            let mut out = vec![0.0f32; e * bt * h];
            for_each_row(&mut out, h, |i, o| {
                let (ei, r) = (i / bt, i % bt);
                let w = gd[r * e + ei];
                if w != 0.0 {
                    for (o, &g) in o.iter_mut().zip(&dd[r * h..(r + 1) * h]) {
                        *o = (w as f64 * g as f64) as f32;
                    }
                }
            });
            Ok(Tensor::f32(y.shape.clone(), out))
        }
        CombineWrt::Gates => {
            let mut out = vec![0.0f32; bt * e];
            for_each_row(&mut out, e, |r, o| {
                for (ei, o) in o.iter_mut().enumerate() {
                    if gd[r * e + ei] != 0.0 {
                        let yy = &yd[(ei * bt + r) * h..(ei * bt + r + 1) * h];
                        let s: f64 = yy
                            .iter()
                            .zip(&dd[r * h..(r + 1) * h])
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum();
                        *o = s as f32;
                    }
                }
            });
            Ok(Tensor::f32(gates.shape.clone(), out))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::check::{check_vjp, check_vjp_masked, rand_tensor, Rng};
    use super::*;
    use crate::cpu::moe;

    #[test]
    fn router_grad_matches_finite_differences() {
        let mut rng = Rng::new(31);
        // Well-separated logits, so a small step never changes the selection.
        let mut logits = rand_tensor(&mut rng, &[2, 3, 5], 0.2);
        if let crate::Buffer::F32(v) = &mut logits.data {
            for (i, x) in v.iter_mut().enumerate() {
                *x += ((i * 7) % 5) as f32;
            }
        }
        let dg = rand_tensor(&mut rng, &[2, 3, 5], 1.0);
        for (k, norm) in [(2, true), (2, false), (5, true), (1, true)] {
            let g = router_grad(&logits, &dg, k, norm).unwrap();
            check_vjp(
                &format!("router k={k} {norm}"),
                &[logits.clone()],
                0,
                &dg,
                &g,
                |xs| moe::router(&xs[0], k, norm).unwrap(),
            );
        }
    }

    #[test]
    fn dispatch_and_combine_grads_match_finite_differences() {
        let mut rng = Rng::new(32);
        let x = rand_tensor(&mut rng, &[2, 3, 4], 1.0);
        // Gates with zeros in fixed places (the routing), non-zero elsewhere.
        let mut gates = rand_tensor(&mut rng, &[2, 3, 3], 1.0);
        if let crate::Buffer::F32(v) = &mut gates.data {
            for (i, g) in v.iter_mut().enumerate() {
                *g = if i % 3 == 1 { 0.0 } else { 0.5 + g.abs() };
            }
        }
        let dxe = rand_tensor(&mut rng, &[3, 2, 3, 4], 1.0);
        let g = dispatch_grad(&dxe, &gates).unwrap();
        let g2 = gates.clone();
        check_vjp("dispatch", &[x], 0, &dxe, &g, |xs| {
            moe::dispatch(&xs[0], &g2).unwrap()
        });
        let y = rand_tensor(&mut rng, &[3, 2, 3, 4], 1.0);
        let dy = rand_tensor(&mut rng, &[2, 3, 4], 1.0);
        let inputs = [y.clone(), gates.clone()];
        let gy = combine_grad(&y, &gates, &dy, CombineWrt::Y).unwrap();
        check_vjp("combine y", &inputs, 0, &dy, &gy, |xs| {
            moe::combine(&xs[0], &xs[1]).unwrap()
        });
        // The gate gradient is defined on the routed (non-zero) gates only.
        let gg = combine_grad(&y, &gates, &dy, CombineWrt::Gates).unwrap();
        let routed: Vec<bool> = gates.as_f32().unwrap().iter().map(|&g| g != 0.0).collect();
        check_vjp_masked("combine gates", &inputs, 1, &dy, &gg, Some(&routed), |xs| {
            moe::combine(&xs[0], &xs[1]).unwrap()
        });
    }
}
