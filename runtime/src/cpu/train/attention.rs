//! `AttentionProbs` (the softmax of attention, computed exactly as the forward `Attention`
//! kernel computes it) and `AttentionGrad` (the gradient wrt q, k or v given those
//! probabilities), per (batch, head).
//!
//! With `P` the probabilities, `dO` the output gradient and `scale` the score scale:
//! `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ⊙ (dP − rowsum(P ⊙ dP))`, `dQ = scale·dS·K`,
//! `dK = scale·dSᵀ·Q`; `dK` and `dV` sum over the query heads sharing a KV head. Masked keys
//! have `P = 0`, so they receive nothing. Gradients accumulate in f64.

use crate::cpu::attention::{dims, masked_softmax_row, Keys};
use crate::cpu::linalg::strided_gemm;
use crate::cpu::{f32_of, shape_err};
use crate::{RuntimeError, Tensor};
use rayon::prelude::*;
use shardc_compiler::ir::{AttnSpec, AttnWrt};

/// Validated sizes: (B, T, Hq, D, S, Hkv).
/// `AttentionProbs(spec)`: `q[B,T,Hq,D]`, `k[B,S,Hkv,D]`, optional `mask[B,S]` →
/// `[B,Hq,T,S]`.
pub(crate) fn probs(
    q: &Tensor,
    k: &Tensor,
    keys: Keys,
    spec: &AttnSpec,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "attention_probs";
    let mut all = vec![q, k];
    all.extend(keys.all());
    let (qd, kd) = (f32_of(OP, q, 0)?, f32_of(OP, k, 1)?);
    let (b, t, hq, d, s, hkv) = dims(OP, q, k, &all)?;
    let visible = keys.visible(OP, 2, &all, spec, (b, t, s))?;
    let rep = hq / hkv;
    let scale = spec.scale.0;
    let mut out = vec![0.0f32; b * hq * t * s];
    if out.is_empty() {
        return Ok(Tensor::f32(vec![b, hq, t, s], out));
    }
    out.par_chunks_mut(t * s).enumerate().for_each(|(i, p)| {
        let (bi, h) = (i / hq, i % hq);
        let kh = h / rep;
        let q0 = bi * t * hq * d + h * d;
        let k0 = bi * s * hkv * d + kh * d;
        // The forward kernel's score GEMM, so the probabilities match it bit for bit.
        strided_gemm(
            t,
            d,
            s,
            &qd[q0..],
            (hq * d, 1),
            &kd[k0..],
            (1, hkv * d),
            p,
            s,
        );
        for (ti, row) in p.chunks_mut(s).enumerate() {
            masked_softmax_row(row, scale, |si| visible(bi, ti, si));
        }
    });
    Ok(Tensor::f32(vec![b, hq, t, s], out))
}

/// `AttentionGrad { spec, wrt }`: `(q, k, v, dy, probs)` → `dq`, `dk` or `dv`.
pub(crate) fn grad(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dy: &Tensor,
    probs: &Tensor,
    spec: &AttnSpec,
    wrt: AttnWrt,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "attention_grad";
    let all = [q, k, v, dy, probs];
    let (qd, kd, vd) = (f32_of(OP, q, 0)?, f32_of(OP, k, 1)?, f32_of(OP, v, 2)?);
    let (gd, pd) = (f32_of(OP, dy, 3)?, f32_of(OP, probs, 4)?);
    let (b, t, hq, d, s, hkv) = dims(OP, q, k, &all)?;
    if v.shape != k.shape || dy.shape != q.shape || probs.shape != [b, hq, t, s] {
        return Err(shape_err(
            OP,
            &all,
            "expects v like k, dy like q, probs [B, Hq, T, S]",
        ));
    }
    let rep = hq / hkv;
    let scale = spec.scale.0 as f64;
    // Offsets of row (b, t|s, head) in q/dy, k/v and of row (b, head, t) in probs.
    let qi = |bi: usize, ti: usize, h: usize| ((bi * t + ti) * hq + h) * d;
    let ki = |bi: usize, si: usize, h: usize| ((bi * s + si) * hkv + h) * d;
    let pi = |bi: usize, h: usize, ti: usize| ((bi * hq + h) * t + ti) * s;
    // dS for one (batch, query head): [T, S].
    let d_scores = |bi: usize, h: usize| -> Vec<f64> {
        let kh = h / rep;
        let mut ds = vec![0.0f64; t * s];
        for ti in 0..t {
            let p = &pd[pi(bi, h, ti)..pi(bi, h, ti) + s];
            let g = &gd[qi(bi, ti, h)..qi(bi, ti, h) + d];
            let row = &mut ds[ti * s..(ti + 1) * s];
            let mut dot = 0.0f64;
            for (si, r) in row.iter_mut().enumerate() {
                if p[si] == 0.0 {
                    continue;
                }
                let vv = &vd[ki(bi, si, kh)..ki(bi, si, kh) + d];
                let dp: f64 = g.iter().zip(vv).map(|(&x, &y)| x as f64 * y as f64).sum();
                *r = dp;
                dot += p[si] as f64 * dp;
            }
            for (si, r) in row.iter_mut().enumerate() {
                *r = p[si] as f64 * (*r - dot);
            }
        }
        ds
    };
    let out: Vec<f32> = match wrt {
        AttnWrt::Q => per_head_rows((b, hq), (t, d), qd.len(), scale, &qi, |bi, h| {
            let kh = h / rep;
            let ds = d_scores(bi, h);
            let mut dq = vec![0.0f64; t * d];
            for ti in 0..t {
                for si in 0..s {
                    let w = ds[ti * s + si];
                    if w == 0.0 {
                        continue;
                    }
                    let kk = &kd[ki(bi, si, kh)..ki(bi, si, kh) + d];
                    add_scaled(&mut dq[ti * d..(ti + 1) * d], w, kk);
                }
            }
            dq
        }),
        AttnWrt::K | AttnWrt::V => per_head_rows((b, hkv), (s, d), kd.len(), 1.0, &ki, |bi, kh| {
            let mut acc = vec![0.0f64; s * d];
            for h in kh * rep..(kh + 1) * rep {
                if wrt == AttnWrt::K {
                    let ds = d_scores(bi, h);
                    for ti in 0..t {
                        let qq = &qd[qi(bi, ti, h)..qi(bi, ti, h) + d];
                        for si in 0..s {
                            let w = ds[ti * s + si];
                            if w == 0.0 {
                                continue;
                            }
                            add_scaled(&mut acc[si * d..(si + 1) * d], scale * w, qq);
                        }
                    }
                } else {
                    for ti in 0..t {
                        let p = &pd[pi(bi, h, ti)..pi(bi, h, ti) + s];
                        let g = &gd[qi(bi, ti, h)..qi(bi, ti, h) + d];
                        for (si, &w) in p.iter().enumerate() {
                            if w == 0.0 {
                                continue;
                            }
                            add_scaled(&mut acc[si * d..(si + 1) * d], w as f64, g);
                        }
                    }
                }
            }
            acc
        }),
    };
    let shape = if wrt == AttnWrt::Q {
        q.shape.clone()
    } else {
        k.shape.clone()
    };
    Ok(Tensor::f32(shape, out))
}

/// The `[len]` gradient whose `(batch, head)` blocks are `block(bi, h)`, computed in parallel
/// over `heads = (batch, heads)`: `[rows, d]` in f64, row `r` written at `at(bi, r, h)` times
/// `scale`.
fn per_head_rows(
    (batch, heads): (usize, usize),
    (rows, d): (usize, usize),
    len: usize,
    scale: f64,
    at: &(impl Fn(usize, usize, usize) -> usize + Sync),
    block: impl Fn(usize, usize) -> Vec<f64> + Sync,
) -> Vec<f32> {
    let blocks: Vec<(usize, Vec<f64>)> = (0..batch * heads)
        .into_par_iter()
        .map(|i| (i, block(i / heads, i % heads)))
        .collect();
    let mut out = vec![0.0f32; len];
    for (i, acc) in blocks {
        let (bi, h) = (i / heads, i % heads);
        for r in 0..rows {
            for di in 0..d {
                out[at(bi, r, h) + di] = (scale * acc[r * d + di]) as f32;
            }
        }
    }
    out
}

/// `acc += w · x`, in f64.
fn add_scaled(acc: &mut [f64], w: f64, x: &[f32]) {
    for (o, &x) in acc.iter_mut().zip(x) {
        *o += w * x as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::super::check::{check_vjp, rand_tensor, Rng};
    use super::*;
    use crate::cpu::attention::attention;
    use shardc_compiler::ir::Float;

    #[test]
    fn probs_reproduce_the_forward_attention() {
        let mut rng = Rng::new(21);
        let q = rand_tensor(&mut rng, &[2, 5, 4, 3], 1.0);
        let k = rand_tensor(&mut rng, &[2, 5, 2, 3], 1.0);
        let v = rand_tensor(&mut rng, &[2, 5, 2, 3], 1.0);
        let mask = Tensor::f32(vec![2, 5], vec![1., 1., 1., 1., 1., 0., 0., 1., 1., 1.]);
        let spec = AttnSpec {
            causal: true,
            window: None,
            scale: Float(0.7),
            indexed: false,
        };
        let p = probs(&q, &k, Keys::mask(Some(&mask)), &spec).unwrap();
        let o = attention(&q, &k, &v, Keys::mask(Some(&mask)), &spec).unwrap();
        // o[b,t,h,:] = Σ_s p[b,h,t,s] v[b,s,h/2,:]
        let (pd, vd, od) = (
            p.as_f32().unwrap(),
            v.as_f32().unwrap(),
            o.as_f32().unwrap(),
        );
        for bi in 0..2 {
            for ti in 0..5 {
                for h in 0..4 {
                    for di in 0..3 {
                        let want: f64 = (0..5)
                            .map(|si| {
                                pd[((bi * 4 + h) * 5 + ti) * 5 + si] as f64
                                    * vd[((bi * 5 + si) * 2 + h / 2) * 3 + di] as f64
                            })
                            .sum();
                        let got = od[((bi * 5 + ti) * 4 + h) * 3 + di] as f64;
                        assert!((want - got).abs() < 1e-6, "{want} vs {got}");
                    }
                }
            }
        }
        // A query with every key masked has a zero row.
        assert!(pd[((4) * 5) * 5..((4) * 5) * 5 + 5]
            .iter()
            .all(|&x| x == 0.0));
    }

    #[test]
    fn attention_grads_match_finite_differences() {
        let mut rng = Rng::new(22);
        for (causal, window, masked) in [
            (true, None, true),
            (true, Some(2), false),
            (false, None, false),
        ] {
            let spec = AttnSpec {
                causal,
                window,
                scale: Float(0.8),
                indexed: false,
            };
            let q = rand_tensor(&mut rng, &[2, 4, 4, 3], 1.0);
            let k = rand_tensor(&mut rng, &[2, 4, 2, 3], 1.0);
            let v = rand_tensor(&mut rng, &[2, 4, 2, 3], 1.0);
            let dy = rand_tensor(&mut rng, &[2, 4, 4, 3], 1.0);
            let mask = Tensor::f32(vec![2, 4], vec![1., 1., 1., 1., 0., 1., 1., 1.]);
            let mask = masked.then_some(mask);
            let p = probs(&q, &k, Keys::mask(mask.as_ref()), &spec).unwrap();
            let inputs = [q.clone(), k.clone(), v.clone()];
            for wrt in [AttnWrt::Q, AttnWrt::K, AttnWrt::V] {
                let g = grad(&q, &k, &v, &dy, &p, &spec, wrt).unwrap();
                let m2 = mask.clone();
                check_vjp(
                    &format!("attention {wrt:?}"),
                    &inputs,
                    wrt.operand(),
                    &dy,
                    &g,
                    |xs| attention(&xs[0], &xs[1], &xs[2], Keys::mask(m2.as_ref()), &spec).unwrap(),
                );
            }
        }
    }
}
