//! Attention: `softmax(q·kᵀ·scale + masks)·v` per (batch, head), HF eager semantics.
//!
//! Visibility of key `s` to query `t`: with positions `qpos = t + S − T` (the last query is
//! the last position when T ≠ S) and `kpos = s`, or `qpos = qidx[t]`, `kpos = kidx[s]` for an
//! indexed spec (context parallelism: a rank's queries are a chunk of a possibly permuted
//! sequence): causal `kpos ≤ qpos`; window `qpos − kpos < window`; mask `mask[b, s] != 0`.
//! Masked keys get probability exactly 0; a query with no visible key outputs zeros. Query head
//! `h` reads KV head `h / (Hq / Hkv)`.

use super::layout::permute;
use super::linalg::strided_gemm;
use super::{f32_of, shape_err};
use crate::{RuntimeError, Tensor};
use rayon::prelude::*;
use shardc_compiler::ir::AttnSpec;

/// What decides which keys a query sees besides the spec: the key mask `[B,S]` and, for an
/// indexed spec, the query and key indices (`i32[T]`, `i32[S]`).
#[derive(Clone, Copy, Default)]
pub(crate) struct Keys<'a> {
    pub(crate) mask: Option<&'a Tensor>,
    pub(crate) index: Option<(&'a Tensor, &'a Tensor)>,
}

impl<'a> Keys<'a> {
    /// The operands after `q, k, v` (or `q, k`) of an op with `spec`.
    pub(crate) fn of(spec: &AttnSpec, rest: &[&'a Tensor]) -> Keys<'a> {
        let (mask, index) = spec.extra(rest);
        Keys { mask, index }
    }

    /// The operands after the first `tensors` (`q, k, v` or `q, k`) of an op with `spec`, as
    /// [`Keys::of`]; an error when `inputs` has too few or too many for `spec`.
    pub(crate) fn after(
        op: &'static str,
        spec: &AttnSpec,
        inputs: &[&'a Tensor],
        tensors: usize,
    ) -> Result<Keys<'a>, RuntimeError> {
        let extra = if spec.indexed { 2 } else { 0 };
        if !(tensors + extra..=tensors + 1 + extra).contains(&inputs.len()) {
            return Err(shape_err(op, inputs, "wrong number of operands"));
        }
        Ok(Keys::of(spec, &inputs[tensors..]))
    }

    /// A mask alone.
    #[cfg(test)]
    pub(crate) fn mask(mask: Option<&'a Tensor>) -> Keys<'a> {
        Keys { mask, index: None }
    }

    /// Which keys each query sees under `spec` ([`visibility`]), from the mask's data (operand
    /// `first`, checked to be `[b, s]`) and the indices checked against `t` queries and `s`
    /// keys.
    pub(crate) fn visible<'s>(
        &self,
        op: &'static str,
        first: usize,
        all: &[&Tensor],
        spec: &'s AttnSpec,
        (b, t, s): (usize, usize, usize),
    ) -> Result<impl Fn(usize, usize, usize) -> bool + 's, RuntimeError>
    where
        'a: 's,
    {
        if self.mask.is_some_and(|m| m.shape != [b, s]) {
            return Err(shape_err(op, all, "mask must be [B, S]"));
        }
        let md = self.mask.map(|m| f32_of(op, m, first)).transpose()?;
        let index = match self.index {
            None => None,
            Some((qi, ki)) => match (qi.as_i32(), ki.as_i32()) {
                (Some(a), Some(b)) if a.len() == t && b.len() == s => Some((a, b)),
                _ => {
                    return Err(shape_err(
                        op,
                        all,
                        "query and key indices must be i32[T] and i32[S]",
                    ))
                }
            },
        };
        Ok(visibility(spec, t, s, md, index))
    }

    pub(crate) fn all(&self) -> Vec<&'a Tensor> {
        let mut v: Vec<&Tensor> = self.mask.into_iter().collect();
        if let Some((a, b)) = self.index {
            v.extend([a, b]);
        }
        v
    }
}

/// `Attention(spec)`: `q[B,T,Hq,D]`, `k[B,S,Hkv,D]`, `v[B,S,Hkv,D]`, optional `mask[B,S]`
/// and indices.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    keys: Keys,
    spec: &AttnSpec,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "attention";
    let mut all = vec![q, k, v];
    all.extend(keys.all());
    let (qd, kd, vd) = (f32_of(OP, q, 0)?, f32_of(OP, k, 1)?, f32_of(OP, v, 2)?);
    if k.shape != v.shape {
        return Err(shape_err(
            OP,
            &all,
            "expects q, k, v of rank 4 with k and v alike",
        ));
    }
    let (b, t, hq, d, s, hkv) = dims(OP, q, k, &all)?;
    let visible = keys.visible(OP, 3, &all, spec, (b, t, s))?;
    let rep = hq / hkv;
    let scale = spec.scale.0;
    // Per (b, h): [T, D] blocks, laid out [B, Hq, T, D]; permuted to [B, T, Hq, D] at the end.
    let mut tmp = vec![0.0f32; b * hq * t * d];
    if tmp.is_empty() {
        return Ok(Tensor::f32(q.shape.clone(), tmp));
    }
    tmp.par_chunks_mut(t * d).enumerate().for_each(|(i, o)| {
        let (bi, h) = (i / hq, i % hq);
        let kh = h / rep;
        let q0 = bi * t * hq * d + h * d;
        let k0 = bi * s * hkv * d + kh * d;
        let mut p = vec![0.0f32; t * s];
        if s > 0 {
            // scores[t, s] = q[t, :] · k[s, :]
            strided_gemm(
                t,
                d,
                s,
                &qd[q0..],
                (hq * d, 1),
                &kd[k0..],
                (1, hkv * d),
                &mut p,
                s,
            );
        }
        for (ti, row) in p.chunks_mut(s.max(1)).enumerate().take(t) {
            masked_softmax_row(row, scale, |si| visible(bi, ti, si));
        }
        // o[t, :] = p[t, :] · v
        strided_gemm(t, s, d, &p, (s, 1), &vd[k0..], (hkv * d, 1), o, d);
    });
    let out = permute(&tmp, &[b, hq, t, d], &[0, 2, 1, 3]);
    Ok(Tensor::f32(q.shape.clone(), out))
}

/// `(B, T, Hq, D, S, Hkv)` of attention operands `q[B,T,Hq,D]`, `k[B,S,Hkv,D]`.
pub(crate) type Dims = (usize, usize, usize, usize, usize, usize);

/// The dims of `q` and `k`, checked: rank 4, the same batch and head width, query heads a
/// multiple of the KV heads. `all` are the op's operands, for the error.
pub(crate) fn dims(
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    all: &[&Tensor],
) -> Result<Dims, RuntimeError> {
    if q.shape.len() != 4 || k.shape.len() != 4 {
        return Err(shape_err(op, all, "expects q and k of rank 4"));
    }
    let (b, t, hq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (s, hkv) = (k.shape[1], k.shape[2]);
    if k.shape[0] != b || k.shape[3] != d || hkv == 0 || hq % hkv != 0 {
        return Err(shape_err(
            op,
            all,
            "batch/head_dim differ or heads not a multiple of kv heads",
        ));
    }
    Ok((b, t, hq, d, s, hkv))
}

/// Turns one row of raw scores `q·k` into attention probabilities in place: scaled, keys the
/// query cannot see dropped, softmax with max subtraction (sum in f64); a row with no visible
/// key becomes zeros. The forward kernel and the backward's recomputation share it, so both
/// see bit-identical probabilities.
/// Whether query `ti` of batch row `bi` sees key `si` (of `s`, the queries being the last `t`
/// positions, or at `index`'s positions): causal, inside the sliding window, and not masked
/// out (`mask` `[B, S]`, 0 hides).
pub(crate) fn visibility<'a>(
    spec: &'a AttnSpec,
    t: usize,
    s: usize,
    mask: Option<&'a [f32]>,
    index: Option<(&'a [i32], &'a [i32])>,
) -> impl Fn(usize, usize, usize) -> bool + 'a {
    let off = s as isize - t as isize;
    move |bi: usize, ti: usize, si: usize| -> bool {
        let (qpos, kpos) = match index {
            Some((qi, ki)) => (qi[ti] as isize, ki[si] as isize),
            None => (ti as isize + off, si as isize),
        };
        (!spec.causal || kpos <= qpos)
            && spec.window.is_none_or(|w| qpos - kpos < w as isize)
            && mask.is_none_or(|m| m[bi * s + si] != 0.0)
    }
}

pub(crate) fn masked_softmax_row(row: &mut [f32], scale: f32, visible: impl Fn(usize) -> bool) {
    let mut max = f32::NEG_INFINITY;
    let mut any = false;
    for (si, x) in row.iter_mut().enumerate() {
        if visible(si) {
            *x *= scale;
            max = max.max(*x);
            any = true;
        } else {
            *x = f32::NEG_INFINITY;
        }
    }
    if !any {
        row.fill(0.0);
        return;
    }
    let mut sum = 0.0f64;
    for x in row.iter_mut() {
        *x = if *x == f32::NEG_INFINITY {
            0.0
        } else {
            ((*x - max) as f64).exp() as f32
        };
        sum += *x as f64;
    }
    for x in row.iter_mut() {
        *x = (*x as f64 / sum) as f32;
    }
}
