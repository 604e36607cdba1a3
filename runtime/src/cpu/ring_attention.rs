//! Ring attention (`RingAttention`): a rank's queries against the keys and values of every rank
//! of the ring, the K/V blocks passed on by send/recv while the current block is attended to
//! (how a GPU backend overlaps the transfer with the block's compute; on the CPU the steps run
//! in order). Each block contributes its row maximum, sum of exponentials and weighted values;
//! the partial results are merged by their log-sum-exp, so the result equals `Attention` of the
//! gathered keys up to the order of the softmax sums.
//!
//! Pre: the communicator's size is `parts`; rank `i` holds keys `[i·c, (i+1)·c)` of the
//! `S = parts·c` the mask and key indices span; every rank of the group runs the same op.

use super::attention::{dims, Keys};
use super::collective::Wrap;
use super::{f32_of, layout, shape_err};
use crate::comm::Communicator;
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::{AttnSpec, Op};

/// The ring of a ring attention op: the axis' communicator (of `parts` ranks), the attention
/// spec, and how a communicator error names the node.
struct Ring<'a> {
    comm: &'a dyn Communicator,
    spec: &'a AttnSpec,
    parts: usize,
    wrap: Wrap<'a>,
}

/// `op` (`RingAttention` or `RingAttentionGrad`) of its operands `args` (the tensors, then
/// the keys) over `comm`.
pub(crate) fn ring_attention_op(
    comm: &dyn Communicator,
    op: &Op,
    args: &[&Tensor],
    wrap: Wrap,
) -> Result<Tensor, RuntimeError> {
    let (grad, spec, parts) = match op {
        Op::RingAttention { spec, parts, .. } => (false, spec, *parts),
        Op::RingAttentionGrad { spec, parts, .. } => (true, spec, *parts),
        _ => unreachable!("invariant: called for RingAttention and RingAttentionGrad only"),
    };
    let ring = Ring {
        comm,
        spec,
        parts,
        wrap,
    };
    let tensors = if grad { 5 } else { 3 };
    let keys = Keys::of(spec, &args[tensors..]);
    if grad {
        ring_attention_grad(&ring, &args[..tensors], keys)
    } else {
        ring_attention(&ring, &args[..tensors], keys)
    }
}

/// `RingAttention { spec, parts }` of `[q, k, v]`: `q[B,T,Hq,D]`, this rank's `k`, `v` blocks
/// `[B,c,Hkv,D]`, and `keys` (mask `[B,S]`, indices `i32[T]`, `i32[S]`) over the whole ring.
fn ring_attention(ring: &Ring, qkv: &[&Tensor], keys: Keys) -> Result<Tensor, RuntimeError> {
    const OP: &str = "ring_attention";
    let Ring {
        comm,
        spec,
        parts,
        wrap,
    } = *ring;
    let (q, k, v) = (qkv[0], qkv[1], qkv[2]);
    let mut all = vec![q, k, v];
    all.extend(keys.all());
    let (b, t, hq, d, c, hkv) = ring_dims(OP, comm, &all, &keys, parts)?;
    let s = c * parts;
    let visible = keys.visible(OP, 3, &all, spec, (b, t, s))?;
    let qd = f32_of(OP, q, 0)?;
    let rep = hq / hkv;
    let scale = spec.scale.0;
    // Per (b, h, t): running maximum, sum of exponentials, weighted sum of values.
    let rows = b * hq * t;
    let mut max = vec![f32::NEG_INFINITY; rows];
    let mut sum = vec![0.0f64; rows];
    let mut acc = vec![0.0f64; rows * d];
    let (n, r) = (parts, comm.rank());
    let block = k.numel();
    // The K and V blocks travel together: `[k; v]` flattened.
    let mut cur: Vec<f32> = [f32_of(OP, k, 1)?, f32_of(OP, v, 2)?].concat();
    let mut scores = vec![0.0f32; c];
    for step in 0..n {
        if step + 1 < n {
            comm.send(&cur, (r + 1) % n).map_err(wrap)?;
        }
        // This step's block came from rank `r − step`: keys `[src·c, (src+1)·c)`.
        let src = (r + n - step) % n;
        let (kd, vd) = cur.split_at(block);
        for bi in 0..b {
            for h in 0..hq {
                let kh = h / rep;
                for ti in 0..t {
                    let row = (bi * hq + h) * t + ti;
                    let qrow = &qd[((bi * t + ti) * hq + h) * d..][..d];
                    let mut m = max[row];
                    for (j, sc) in scores.iter_mut().enumerate() {
                        *sc = if visible(bi, ti, src * c + j) {
                            let krow = &kd[((bi * c + j) * hkv + kh) * d..][..d];
                            let dot: f32 = qrow.iter().zip(krow).map(|(x, y)| x * y).sum();
                            m = m.max(dot * scale);
                            dot * scale
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                    if m == f32::NEG_INFINITY {
                        continue; // nothing visible yet
                    }
                    // Rescale what earlier blocks contributed to the new maximum.
                    let old = max[row];
                    if old != f32::NEG_INFINITY && old < m {
                        let f = ((old - m) as f64).exp();
                        sum[row] *= f;
                        acc[row * d..][..d].iter_mut().for_each(|a| *a *= f);
                    }
                    max[row] = m;
                    for (j, &sc) in scores.iter().enumerate() {
                        if sc == f32::NEG_INFINITY {
                            continue;
                        }
                        let p = ((sc - m) as f64).exp();
                        sum[row] += p;
                        let vrow = &vd[((bi * c + j) * hkv + kh) * d..][..d];
                        for (a, &x) in acc[row * d..][..d].iter_mut().zip(vrow) {
                            *a += p * x as f64;
                        }
                    }
                }
            }
        }
        if step + 1 < n {
            comm.recv(&mut cur, (r + n - 1) % n).map_err(wrap)?;
        }
    }
    // [B, Hq, T, D] normalised (a query that saw no key gives zeros), then [B, T, Hq, D].
    let out: Vec<f32> = (0..rows * d)
        .map(|i| {
            let row = i / d;
            if sum[row] > 0.0 {
                (acc[i] / sum[row]) as f32
            } else {
                0.0
            }
        })
        .collect();
    let out = layout::permute(&out, &[b, hq, t, d], &[0, 2, 1, 3]);
    Ok(Tensor::f32(q.shape.clone(), out))
}

/// The operands of ring op `op` (`all`: q, this rank's k and v blocks first) checked against
/// the ring of `parts` ranks on `comm`: their dims `(B, T, Hq, D, c, Hkv)` (`c` keys a block,
/// the ring `c·parts`), the mask against the whole ring.
fn ring_dims(
    op: &'static str,
    comm: &dyn Communicator,
    all: &[&Tensor],
    keys: &Keys,
    parts: usize,
) -> Result<super::attention::Dims, RuntimeError> {
    if comm.size() != parts || parts == 0 {
        return Err(RuntimeError::AxisSize {
            axis: comm.name().to_string(),
            expected: parts,
            found: comm.size(),
        });
    }
    let (q, k, v) = (all[0], all[1], all[2]);
    if k.shape != v.shape {
        return Err(shape_err(
            op,
            all,
            "expects q, k, v of rank 4 with k and v alike",
        ));
    }
    let dims = dims(op, q, k, all)?;
    let (b, c) = (dims.0, dims.4);
    if keys.mask.is_some_and(|m| m.shape != [b, c * parts]) {
        return Err(shape_err(op, all, "mask must be [B, S] of the whole ring"));
    }
    Ok(dims)
}

/// `RingAttentionGrad { spec, parts }` of `[q, k, v, o, dy]`: `q`, this rank's `k`, `v`
/// blocks, the forward's output `o` and its gradient `dy` (both `[B,T,Hq,D]`), and `keys` →
/// `dq`, `dk`, `dv` packed
/// (flat, in that order). Two passes round the ring: the K blocks, for each query row's
/// softmax statistics (maximum and sum of exponentials); then the K/V blocks with their dK/dV
/// accumulators, each rank adding its queries' contributions before passing them on, so that
/// after `parts` hops every block's accumulators are back at its owner, complete. With
/// `δᵢ = dyᵢ·oᵢ` and `pᵢⱼ = exp(sᵢⱼ − lseᵢ)`: `dsᵢⱼ = pᵢⱼ (dyᵢ·vⱼ − δᵢ)`, `dqᵢ += scale·dsᵢⱼ kⱼ`,
/// `dkⱼ += scale·dsᵢⱼ qᵢ`, `dvⱼ += pᵢⱼ dyᵢ` (GQA: a KV head sums its query heads).
fn ring_attention_grad(ring: &Ring, ops: &[&Tensor], keys: Keys) -> Result<Tensor, RuntimeError> {
    const OP: &str = "ring_attention_grad";
    let (comm, spec, parts, wrap) = (ring.comm, ring.spec, ring.parts, ring.wrap);
    let (q, k, v, o, dy) = (ops[0], ops[1], ops[2], ops[3], ops[4]);
    let mut all = vec![q, k, v, o, dy];
    all.extend(keys.all());
    if o.shape != q.shape || dy.shape != q.shape {
        return Err(shape_err(OP, &all, "expects o and dy shaped as q"));
    }
    let (b, t, hq, d, c, hkv) = ring_dims(OP, comm, &all, &keys, parts)?;
    let s = c * parts;
    let visible = keys.visible(OP, 5, &all, spec, (b, t, s))?;
    let (qd, od, dyd) = (f32_of(OP, q, 0)?, f32_of(OP, o, 3)?, f32_of(OP, dy, 4)?);
    let rep = hq / hkv;
    let scale = spec.scale.0 as f64;
    let (n, r) = (parts, comm.rank());
    let rows = b * hq * t;
    let qrow = |bi: usize, ti: usize, h: usize| ((bi * t + ti) * hq + h) * d;
    let krow = |bi: usize, j: usize, kh: usize| ((bi * c + j) * hkv + kh) * d;
    let dot =
        |x: &[f32], y: &[f32]| -> f64 { x.iter().zip(y).map(|(a, b)| *a as f64 * *b as f64).sum() };
    // The score of query row (bi, h, ti) against key j of the block from rank `src`, if seen.
    let score = |kd: &[f32], bi: usize, h: usize, ti: usize, src: usize, j: usize| {
        visible(bi, ti, src * c + j).then(|| {
            let qr = &qd[qrow(bi, ti, h)..][..d];
            let kr = &kd[krow(bi, j, h / rep)..][..d];
            // As the forward computes it: an f32 dot product, then the scale.
            let dot32: f32 = qr.iter().zip(kr).map(|(x, y)| x * y).sum();
            (dot32 * spec.scale.0) as f64
        })
    };

    // Pass 1: every row's log-sum-exp over all the keys it sees.
    let mut max = vec![f64::NEG_INFINITY; rows];
    let mut sum = vec![0.0f64; rows];
    let mut cur: Vec<f32> = f32_of(OP, k, 1)?.to_vec();
    for step in 0..n {
        if step + 1 < n {
            comm.send(&cur, (r + 1) % n).map_err(wrap)?;
        }
        let src = (r + n - step) % n;
        for bi in 0..b {
            for h in 0..hq {
                for ti in 0..t {
                    let row = (bi * hq + h) * t + ti;
                    for j in 0..c {
                        let Some(x) = score(&cur, bi, h, ti, src, j) else {
                            continue;
                        };
                        if x > max[row] {
                            sum[row] *= (max[row] - x).exp();
                            max[row] = x;
                        }
                        sum[row] += (x - max[row]).exp();
                    }
                }
            }
        }
        if step + 1 < n {
            comm.recv(&mut cur, (r + n - 1) % n).map_err(wrap)?;
        }
    }
    let lse: Vec<f64> = (0..rows)
        .map(|i| {
            if sum[i] > 0.0 {
                max[i] + sum[i].ln()
            } else {
                f64::INFINITY
            }
        })
        .collect();
    // δ per row: dy · o.
    let delta: Vec<f64> = (0..rows)
        .map(|row| {
            let (bi, rest) = (row / (hq * t), row % (hq * t));
            let (h, ti) = (rest / t, rest % t);
            let at = qrow(bi, ti, h);
            dot(&dyd[at..at + d], &od[at..at + d])
        })
        .collect();

    // Pass 2: [k; v; dk; dv] round the ring.
    let blk = k.numel();
    let mut cur: Vec<f32> = [
        f32_of(OP, k, 1)?,
        f32_of(OP, v, 2)?,
        &vec![0.0; blk],
        &vec![0.0; blk],
    ]
    .concat();
    let mut dq = vec![0.0f64; q.numel()];
    for step in 0..n {
        let src = (r + n - step) % n;
        let mut dk = vec![0.0f64; blk];
        let mut dv = vec![0.0f64; blk];
        {
            let (kd, rest) = cur.split_at(blk);
            let vd = &rest[..blk];
            for bi in 0..b {
                for h in 0..hq {
                    let kh = h / rep;
                    for ti in 0..t {
                        let row = (bi * hq + h) * t + ti;
                        let qa = qrow(bi, ti, h);
                        let dyr = &dyd[qa..qa + d];
                        for j in 0..c {
                            let Some(x) = score(kd, bi, h, ti, src, j) else {
                                continue;
                            };
                            let p = (x - lse[row]).exp();
                            let ka = krow(bi, j, kh);
                            let dp = dot(dyr, &vd[ka..ka + d]);
                            let ds = p * (dp - delta[row]);
                            for e in 0..d {
                                dq[qa + e] += scale * ds * kd[ka + e] as f64;
                                dk[ka + e] += scale * ds * qd[qa + e] as f64;
                                dv[ka + e] += p * dyr[e] as f64;
                            }
                        }
                    }
                }
            }
        }
        let (_, acc) = cur.split_at_mut(2 * blk);
        for (a, x) in acc.iter_mut().zip(dk.iter().chain(&dv)) {
            *a += *x as f32;
        }
        // The last hop takes the accumulators home; K/V have been everywhere.
        let from = if step + 1 < n { 0 } else { 2 * blk };
        if n > 1 {
            comm.send(&cur[from..], (r + 1) % n).map_err(wrap)?;
            comm.recv(&mut cur[from..], (r + n - 1) % n).map_err(wrap)?;
        }
    }
    // Back home: this rank's own block, its accumulators complete.
    let mut out: Vec<f32> = dq.into_iter().map(|x| x as f32).collect();
    out.extend_from_slice(&cur[2 * blk..]);
    Ok(Tensor::f32(vec![out.len()], out))
}
