//! Mixture-of-experts ops: `Router` (softmax then top-k gates), `Dispatch` (rows copied into
//! expert slots) and `Combine` (gate-weighted sum of expert outputs), HF Mixtral semantics.

use super::{f32_of, for_each_row, shape_err, softmax_row};
use crate::{RuntimeError, Tensor};

/// `Router { top_k, normalize }`: softmax over the last dim, keep the `top_k` largest (ties to
/// the lower index), others 0; with `normalize`, kept gates divided by their sum (summed in
/// descending order, as PyTorch sums `topk`'s output).
pub(crate) fn router(x: &Tensor, top_k: usize, normalize: bool) -> Result<Tensor, RuntimeError> {
    const OP: &str = "router";
    let e = x.shape.last().copied().unwrap_or(0);
    if top_k == 0 || top_k > e {
        return Err(shape_err(OP, &[x], "top_k out of range for the expert dim"));
    }
    let mut out = f32_of(OP, x, 0)?.to_vec();
    for_each_row(&mut out, e, |_, row| {
        softmax_row(row);
        // Selection of the top_k by (value desc, index asc); no allocation: repeated scans.
        let mut kept = 0u64; // bitset for e <= 64, else fallback below
        let mut order = [0usize; 64];
        if e <= 64 {
            for slot in order.iter_mut().take(top_k) {
                let mut best = usize::MAX;
                for (i, &v) in row.iter().enumerate() {
                    if kept & (1 << i) == 0 && (best == usize::MAX || v > row[best]) {
                        best = i;
                    }
                }
                kept |= 1 << best;
                *slot = best;
            }
            let sum: f32 = order[..top_k].iter().map(|&i| row[i]).sum();
            for (i, v) in row.iter_mut().enumerate() {
                if kept & (1 << i) == 0 {
                    *v = 0.0;
                } else if normalize {
                    *v /= sum;
                }
            }
        } else {
            let mut idx: Vec<usize> = (0..e).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let sum: f32 = idx[..top_k].iter().map(|&i| row[i]).sum();
            let mut keep = vec![false; e];
            idx[..top_k].iter().for_each(|&i| keep[i] = true);
            for (v, k) in row.iter_mut().zip(keep) {
                if !k {
                    *v = 0.0;
                } else if normalize {
                    *v /= sum;
                }
            }
        }
    });
    Ok(Tensor::f32(x.shape.clone(), out))
}

/// `Dispatch`: `(x[B,T,H], gates[B,T,E]) -> [E,B,T,H]`, row (b,t) copied into expert e's
/// slot where `gates[b,t,e] != 0`, zeros elsewhere.
pub(crate) fn dispatch(x: &Tensor, g: &Tensor) -> Result<Tensor, RuntimeError> {
    const OP: &str = "dispatch";
    let (xd, gd) = (f32_of(OP, x, 0)?, f32_of(OP, g, 1)?);
    if x.shape.len() != 3 || g.shape.len() != 3 || x.shape[..2] != g.shape[..2] {
        return Err(shape_err(OP, &[x, g], "expects x[B,T,H] and gates[B,T,E]"));
    }
    let (bt, h, e) = (x.shape[0] * x.shape[1], x.shape[2], g.shape[2]);
    let mut out = vec![0.0f32; e * bt * h];
    for_each_row(&mut out, bt * h, |ei, slot| {
        for r in 0..bt {
            if gd[r * e + ei] != 0.0 {
                slot[r * h..(r + 1) * h].copy_from_slice(&xd[r * h..(r + 1) * h]);
            }
        }
    });
    Ok(Tensor::f32(vec![e, x.shape[0], x.shape[1], h], out))
}

/// `Combine`: `(y[E,B,T,H], gates[B,T,E]) -> [B,T,H]`, `Σₑ gates[b,t,e] · y[e,b,t]`,
/// accumulated in f32 in expert order over the non-zero gates only (as HF's `index_add_`
/// over routed tokens does; unrouted slots never contribute, even if non-finite).
pub(crate) fn combine(y: &Tensor, g: &Tensor) -> Result<Tensor, RuntimeError> {
    const OP: &str = "combine";
    let (yd, gd) = (f32_of(OP, y, 0)?, f32_of(OP, g, 1)?);
    if y.shape.len() != 4
        || g.shape.len() != 3
        || y.shape[1..3] != g.shape[..2]
        || y.shape[0] != g.shape[2]
    {
        return Err(shape_err(
            OP,
            &[y, g],
            "expects y[E,B,T,H] and gates[B,T,E]",
        ));
    }
    let (e, bt, h) = (y.shape[0], y.shape[1] * y.shape[2], y.shape[3]);
    let mut out = vec![0.0f32; bt * h];
    for_each_row(&mut out, h, |r, row| {
        for ei in 0..e {
            let w = gd[r * e + ei];
            if w != 0.0 {
                let src = &yd[(ei * bt + r) * h..(ei * bt + r + 1) * h];
                for (o, &v) in row.iter_mut().zip(src) {
                    *o += v * w;
                }
            }
        }
    });
    Ok(Tensor::f32(y.shape[1..].to_vec(), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_ties_go_to_lower_index() {
        let x = Tensor::f32(vec![1, 4], vec![1.0, 2.0, 2.0, 2.0]);
        let g = router(&x, 2, false).unwrap();
        let v = g.as_f32().unwrap();
        assert_eq!(v[0], 0.0);
        assert!(v[1] > 0.0 && v[2] > 0.0);
        assert_eq!(v[3], 0.0);
        let g = router(&x, 2, true).unwrap();
        assert_eq!(&g.as_f32().unwrap()[1..3], &[0.5, 0.5]);
    }

    #[test]
    fn router_many_experts_uses_sort_path() {
        let vals: Vec<f32> = (0..70)
            .map(|i| if i == 3 || i == 65 { 5.0 } else { 0.0 })
            .collect();
        let x = Tensor::f32(vec![70], vals);
        let g = router(&x, 2, true).unwrap();
        let v = g.as_f32().unwrap();
        assert_eq!((v[3], v[65]), (0.5, 0.5));
        assert_eq!(v.iter().filter(|&&a| a != 0.0).count(), 2);
    }
}
