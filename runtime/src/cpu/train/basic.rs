//! Gradients of the elementwise, linear-algebra, rotary, embedding, loss and layout ops:
//! `UnaryGrad`, `BiasGrad`, `WeightGrad`, `RopeGrad`, `EmbeddingGrad`, `CrossEntropyGrad`,
//! `CrossEntropyShardGrad` (run by the executor, which knows the rank's shard), `RepeatGrad`.

use crate::cpu::layout::split3;
use crate::cpu::linalg::strided_gemm;
use crate::cpu::rope::rotate_pairs;
use crate::cpu::vocab::{self, cross_entropy_operands};
use crate::cpu::{f32_of, for_each_row, i32_of, prod, shape_err};
use crate::{RuntimeError, Tensor};
use rayon::prelude::*;
use shardc_compiler::ir::{RopeSpec, UnaryOp, CROSS_ENTROPY_STATS};

/// √(2/π), the GeLU tanh-approximation constant.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// 1/√(2π), the standard normal density at 0.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// f'(x) of a unary op, in f64.
pub(crate) fn unary_derivative(u: UnaryOp, x: f64) -> f64 {
    match u {
        UnaryOp::GeluTanh => {
            let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
            let t = inner.tanh();
            let dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
        }
        UnaryOp::GeluErf => {
            let cdf = 0.5 * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2);
            cdf + x * INV_SQRT_2PI * (-0.5 * x * x).exp()
        }
        UnaryOp::Silu => {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 + x * (1.0 - s))
        }
        // PyTorch's threshold_backward: the gradient passes where x > 0.
        UnaryOp::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        UnaryOp::Exp => x.exp(),
        UnaryOp::Neg => -1.0,
    }
}

/// `UnaryGrad(u)`: `dy · f'(x)`.
pub(crate) fn unary_grad(u: UnaryOp, x: &Tensor, dy: &Tensor) -> Result<Tensor, RuntimeError> {
    const OP: &str = "unary_grad";
    let (xd, gd) = (f32_of(OP, x, 0)?, f32_of(OP, dy, 1)?);
    if x.shape != dy.shape {
        return Err(shape_err(OP, &[x, dy], "x and dy must have one shape"));
    }
    let out: Vec<f32> = xd
        .par_iter()
        .zip(gd.par_iter())
        .map(|(&a, &g)| (g as f64 * unary_derivative(u, a as f64)) as f32)
        .collect();
    Ok(Tensor::f32(x.shape.clone(), out))
}

/// `BiasGrad`: Σ of `dy[.., N]` over the leading dims, shaped like `b[N]`.
pub(crate) fn bias_grad(dy: &Tensor, b: &Tensor) -> Result<Tensor, RuntimeError> {
    const OP: &str = "bias_grad";
    let gd = f32_of(OP, dy, 0)?;
    let n = b.shape.first().copied().unwrap_or(0);
    if b.shape.len() != 1 || dy.shape.last() != Some(&n) {
        return Err(shape_err(
            OP,
            &[dy, b],
            "b must be [N] with N the last dim of dy",
        ));
    }
    let mut acc = vec![0.0f64; n];
    for row in gd.chunks(n.max(1)) {
        for (a, &g) in acc.iter_mut().zip(row) {
            *a += g as f64;
        }
    }
    Ok(Tensor::f32(
        vec![n],
        acc.into_iter().map(|a| a as f32).collect(),
    ))
}

/// `WeightGrad { transpose_b }`: the gradient of `a · b` (or `a · bᵀ`) wrt `b`, summed over the
/// rows of `a` and `dy`; per leading index for a batched (3-D) `b`. Computed in f64.
pub(crate) fn weight_grad(
    a: &Tensor,
    dy: &Tensor,
    b: &Tensor,
    transpose_b: bool,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "weight_grad";
    let (ad, gd) = (f32_of(OP, a, 0)?, f32_of(OP, dy, 1)?);
    let all = [a, dy, b];
    let (ar, br) = (a.shape.len(), b.shape.len());
    if ar < 2
        || dy.shape.len() != ar
        || a.shape[..ar - 1] != dy.shape[..ar - 1]
        || !(br == 2 || br == 3)
    {
        return Err(shape_err(
            OP,
            &all,
            "expects a[.., M, K], dy[.., M, N], b of rank 2 or 3",
        ));
    }
    let (k, n) = (a.shape[ar - 1], dy.shape[ar - 1]);
    let want: Vec<usize> = if transpose_b { vec![n, k] } else { vec![k, n] };
    let batches = if br == 3 { b.shape[0] } else { 1 };
    if b.shape[br - 2..] != want[..] || (br == 3 && (ar < 3 || a.shape[0] != batches)) {
        return Err(shape_err(OP, &all, "b's shape does not fit a and dy"));
    }
    let rows = prod(&a.shape[..ar - 1]) / batches.max(1);
    let a64: Vec<f64> = ad.iter().map(|&x| x as f64).collect();
    let g64: Vec<f64> = gd.iter().map(|&x| x as f64).collect();
    let mut out = vec![0.0f64; batches * k * n];
    out.par_chunks_mut((k * n).max(1))
        .enumerate()
        .for_each(|(e, c)| {
            let ae = &a64[e * rows * k..(e + 1) * rows * k];
            let ge = &g64[e * rows * n..(e + 1) * rows * n];
            if transpose_b {
                // [n, k] = dyᵀ · a
                strided_gemm(n, rows, k, ge, (1, n), ae, (k, 1), c, k);
            } else {
                // [k, n] = aᵀ · dy
                strided_gemm(k, rows, n, ae, (1, k), ge, (n, 1), c, n);
            }
        });
    Ok(Tensor::f32(
        b.shape.clone(),
        out.into_iter().map(|x| x as f32).collect(),
    ))
}

/// `RopeGrad(spec)`: the inverse rotation of `Rope(spec)` (angles computed exactly as the
/// forward kernel computes them).
pub(crate) fn rope_grad(
    dy: &Tensor,
    pos: &Tensor,
    spec: &RopeSpec,
) -> Result<Tensor, RuntimeError> {
    let turn = |a: f32, b: f32, s: f64, c: f64| {
        let (a, b) = (a as f64, b as f64);
        ((a * c + b * s) as f32, (b * c - a * s) as f32)
    };
    rotate_pairs(
        "rope_grad",
        dy,
        pos,
        spec,
        "expects dy[B,T,N,D] and pos[B,T]",
        turn,
    )
}

/// `EmbeddingGrad`: row `i` of the result is the sum of the rows of `dy` whose id is `i`;
/// ids outside `[0, V)` contribute nothing (a vocabulary shard keeps its own rows).
pub(crate) fn embedding_grad(
    ids: &Tensor,
    dy: &Tensor,
    table: &Tensor,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "embedding_grad";
    let id = i32_of(OP, ids, 0)?;
    let gd = f32_of(OP, dy, 1)?;
    let all = [ids, dy, table];
    if table.shape.len() != 2
        || dy.shape.len() != ids.shape.len() + 1
        || dy.shape[..ids.shape.len()] != ids.shape[..]
        || dy.shape.last() != Some(&table.shape[1])
    {
        return Err(shape_err(
            OP,
            &all,
            "expects ids[..], dy[.., H], table[V, H]",
        ));
    }
    let (v, h) = (table.shape[0], table.shape[1]);
    let mut acc = vec![0.0f64; v * h];
    for (r, &t) in id.iter().enumerate() {
        if t >= 0 && (t as usize) < v {
            let dst = &mut acc[t as usize * h..(t as usize + 1) * h];
            for (a, &g) in dst.iter_mut().zip(&gd[r * h..(r + 1) * h]) {
                *a += g as f64;
            }
        }
    }
    Ok(Tensor::f32(
        vec![v, h],
        acc.into_iter().map(|a| a as f32).collect(),
    ))
}

/// `CrossEntropyGrad { denom }`: `(softmax(logits) − onehot(label)) / denom` on rows whose
/// label is ≥ 0, zero rows elsewhere. Softmax in f64.
pub(crate) fn cross_entropy_grad(
    logits: &Tensor,
    labels: &Tensor,
    denom: usize,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "cross_entropy_grad";
    let (ld, yd, v) = cross_entropy_operands(OP, logits, labels)?;
    let scale = 1.0 / denom.max(1) as f64;
    let mut out = vec![0.0f32; ld.len()];
    for_each_row(&mut out, v, |i, row| {
        let y = yd[i];
        if y < 0 {
            return;
        }
        let src = &ld[i * v..(i + 1) * v];
        let max = src.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let sum: f64 = src.iter().map(|&x| (x as f64 - max).exp()).sum();
        for (j, (o, &x)) in row.iter_mut().zip(src).enumerate() {
            let p = (x as f64 - max).exp() / sum;
            let t = if j == y as usize { 1.0 } else { 0.0 };
            *o = ((p - t) * scale) as f32;
        }
    });
    Ok(Tensor::f32(logits.shape.clone(), out))
}

/// `CrossEntropyShardGrad { denom }` on vocabulary shard `coord`: `(exp(x − lse) −
/// onehot(label)) / denom` over columns `coord·Vl ..` of rows whose label is ≥ 0, zero rows
/// elsewhere, with the row's log-sum-exp over every shard from the gathered stats. In f64.
pub(crate) fn cross_entropy_shard_grad(
    logits: &Tensor,
    labels: &Tensor,
    stats: &Tensor,
    coord: usize,
    denom: usize,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "cross_entropy_shard_grad";
    let (sd, p) = vocab::stats_operand(OP, stats, labels, 2)?;
    let (ld, yd, v) = vocab::shard_operands(OP, logits, labels, p)?;
    if coord >= p {
        return Err(shape_err(
            OP,
            &[logits, labels, stats],
            "the rank's shard is not among the gathered stats",
        ));
    }
    let w = p * CROSS_ENTROPY_STATS;
    let lo = coord * v;
    let scale = 1.0 / denom.max(1) as f64;
    let mut out = vec![0.0f32; ld.len()];
    for_each_row(&mut out, v, |i, row| {
        let Ok(y) = usize::try_from(yd[i]) else {
            return;
        };
        let (lse, _) = vocab::row_lse(&sd[i * w..(i + 1) * w]);
        let src = &ld[i * v..(i + 1) * v];
        for (j, (o, &x)) in row.iter_mut().zip(src).enumerate() {
            let t = if lo + j == y { 1.0 } else { 0.0 };
            *o = (((x as f64 - lse).exp() - t) * scale) as f32;
        }
    });
    Ok(Tensor::f32(logits.shape.clone(), out))
}

/// `RepeatGrad { dim, times }`: each run of `times` consecutive indices along `dim` summed.
pub(crate) fn repeat_grad(dy: &Tensor, dim: usize, times: usize) -> Result<Tensor, RuntimeError> {
    const OP: &str = "repeat_grad";
    let gd = f32_of(OP, dy, 0)?;
    if dim >= dy.shape.len() || times == 0 || dy.shape[dim] % times != 0 {
        return Err(shape_err(
            OP,
            &[dy],
            "dim out of range or not a multiple of times",
        ));
    }
    let (outer, mid, inner) = split3(&dy.shape, dim);
    let groups = mid / times;
    let mut out = vec![0.0f32; outer * groups * inner];
    for o in 0..outer {
        for gi in 0..groups {
            let dst = &mut out[(o * groups + gi) * inner..(o * groups + gi + 1) * inner];
            for (j, d) in dst.iter_mut().enumerate() {
                let s: f64 = (0..times)
                    .map(|r| gd[(o * mid + gi * times + r) * inner + j] as f64)
                    .sum();
                *d = s as f32;
            }
        }
    }
    let mut shape = dy.shape.clone();
    shape[dim] = groups;
    Ok(Tensor::f32(shape, out))
}

#[cfg(test)]
mod tests {
    use super::super::check::{check_vjp, rand_tensor, Rng};
    use super::*;
    use crate::cpu::{elementwise, linalg, rope, vocab};
    use shardc_compiler::ir::{Float, RopeStyle};

    #[test]
    fn unary_grads_match_finite_differences() {
        let mut rng = Rng::new(1);
        for u in UnaryOp::ALL {
            // Away from 0, where ReLU has its kink.
            let mut x = rand_tensor(&mut rng, &[3, 7], 2.0);
            if let crate::Buffer::F32(v) = &mut x.data {
                v.iter_mut().for_each(|e| *e += 0.1f32.copysign(*e));
            }
            let dy = rand_tensor(&mut rng, &[3, 7], 1.0);
            let g = unary_grad(u, &x, &dy).unwrap();
            check_vjp(&format!("unary {}", u.name()), &[x], 0, &dy, &g, |xs| {
                elementwise::unary(u, &xs[0]).unwrap()
            });
        }
    }

    #[test]
    fn bias_and_weight_grads_match_finite_differences() {
        let mut rng = Rng::new(2);
        let a = rand_tensor(&mut rng, &[2, 3, 5], 1.0);
        let bias = rand_tensor(&mut rng, &[5], 1.0);
        let dy = rand_tensor(&mut rng, &[2, 3, 5], 1.0);
        let g = bias_grad(&dy, &bias).unwrap();
        check_vjp("bias", &[a.clone(), bias], 1, &dy, &g, |xs| {
            elementwise::add(&xs[0], &xs[1]).unwrap()
        });
        for tb in [false, true] {
            let w = rand_tensor(&mut rng, if tb { &[4, 5] } else { &[5, 4] }, 1.0);
            let dy = rand_tensor(&mut rng, &[2, 3, 4], 1.0);
            let g = weight_grad(&a, &dy, &w, tb).unwrap();
            check_vjp("weight", &[a.clone(), w], 1, &dy, &g, |xs| {
                linalg::matmul(&xs[0], &xs[1], tb).unwrap()
            });
        }
        // Batched (experts): a[E, B, T, K], b[E, N, K].
        let a = rand_tensor(&mut rng, &[3, 2, 2, 5], 1.0);
        let w = rand_tensor(&mut rng, &[3, 4, 5], 1.0);
        let dy = rand_tensor(&mut rng, &[3, 2, 2, 4], 1.0);
        let g = weight_grad(&a, &dy, &w, true).unwrap();
        check_vjp("batched weight", &[a, w], 1, &dy, &g, |xs| {
            linalg::matmul(&xs[0], &xs[1], true).unwrap()
        });
    }

    #[test]
    fn rope_grad_is_the_transpose_of_rope() {
        let mut rng = Rng::new(3);
        for style in [RopeStyle::Half, RopeStyle::Interleaved] {
            let spec = RopeSpec {
                theta: Float(10000.0),
                style,
                scaling: None,
            };
            let x = rand_tensor(&mut rng, &[2, 3, 2, 8], 1.0);
            let pos = Tensor::i32(vec![2, 3], vec![0, 5, 11, 3, 2, 40]);
            let dy = rand_tensor(&mut rng, &[2, 3, 2, 8], 1.0);
            let g = rope_grad(&dy, &pos, &spec).unwrap();
            let p = pos.clone();
            check_vjp("rope", &[x], 0, &dy, &g, |xs| {
                rope::rope(&xs[0], &p, &spec).unwrap()
            });
        }
    }

    #[test]
    fn embedding_and_cross_entropy_grads_match_finite_differences() {
        let mut rng = Rng::new(4);
        let table = rand_tensor(&mut rng, &[6, 3], 1.0);
        let ids = Tensor::i32(vec![2, 3], vec![1, 5, 1, 0, 7, -1]);
        let dy = rand_tensor(&mut rng, &[2, 3, 3], 1.0);
        let g = embedding_grad(&ids, &dy, &table).unwrap();
        let i2 = ids.clone();
        check_vjp("embedding", &[table], 0, &dy, &g, |xs| {
            vocab::embedding(&xs[0], &i2).unwrap()
        });
        let logits = rand_tensor(&mut rng, &[2, 3, 6], 2.0);
        let labels = Tensor::i32(vec![2, 3], vec![1, 5, -100, 0, 2, 2]);
        let g = cross_entropy_grad(&logits, &labels, 5).unwrap();
        // The loss is a scalar: dy = 1.
        let one = Tensor::f32(vec![], vec![1.0]);
        let l2 = labels.clone();
        check_vjp("cross entropy", &[logits], 0, &one, &g, |xs| {
            vocab::cross_entropy(&xs[0], &l2, 5).unwrap()
        });
    }

    /// The vocabulary-parallel loss and gradient against the unsplit ones: logits split into
    /// 1..4 shards, labels in every shard, ignored labels, a shard whose rows are all −∞, and
    /// logits large enough that an unshifted exponential would overflow.
    #[test]
    fn vocab_parallel_cross_entropy_matches_the_unsplit_one() {
        let mut rng = Rng::new(6);
        for (parts, vl, spread) in [(1, 7, 3.0), (2, 5, 3.0), (3, 4, 40.0), (4, 6, 120.0)] {
            let v = parts * vl;
            let mut logits = rand_tensor(&mut rng, &[3, 4, v], spread);
            // Row 11 is −∞ on shard 0 (a masked-out part of the vocabulary).
            if parts > 1 {
                if let crate::Buffer::F32(d) = &mut logits.data {
                    d[11 * v..11 * v + vl].fill(f32::NEG_INFINITY);
                }
            }
            // Labels in every shard (the first column and the last), ignored positions between.
            let labels: Vec<i32> = (0..12usize)
                .map(|i| match (i, i - i / 4) {
                    (11, _) => (v - 1) as i32,
                    (_, _) if i % 4 == 3 => -100,
                    (_, k) => ((k % parts) * vl + (3 * k) % vl) as i32,
                })
                .collect();
            let labels = Tensor::i32(vec![3, 4], labels);
            let denom = 9;
            let want = vocab::cross_entropy(&logits, &labels, denom).unwrap();
            let want_grad = cross_entropy_grad(&logits, &labels, denom).unwrap();
            let shards: Vec<Tensor> = (0..parts)
                .map(|c| crate::cpu::layout::slice(&logits, 2, c * vl, vl).unwrap())
                .collect();
            let stats: Vec<Tensor> = shards
                .iter()
                .enumerate()
                .map(|(c, x)| vocab::cross_entropy_stats(x, &labels, c, parts).unwrap())
                .collect();
            let refs: Vec<&Tensor> = stats.iter().collect();
            let gathered = crate::cpu::layout::concat(&refs, 2).unwrap();
            let got = vocab::cross_entropy_from_stats(&gathered, &labels, denom).unwrap();
            let (w, g) = (want.as_f32().unwrap()[0], got.as_f32().unwrap()[0]);
            assert!(w.is_finite(), "{parts} shards: reference loss {w}");
            assert!(
                ((g - w) / w).abs() < 1e-6,
                "{parts} shards: loss {g} vs {w}"
            );
            for (c, x) in shards.iter().enumerate() {
                let got = cross_entropy_shard_grad(x, &labels, &gathered, c, denom).unwrap();
                let want = crate::cpu::layout::slice(&want_grad, 2, c * vl, vl).unwrap();
                let (got, want) = (got.as_f32().unwrap(), want.as_f32().unwrap());
                for (i, (a, b)) in got.iter().zip(want).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-7 + 1e-6 * b.abs(),
                        "{parts} shards, shard {c}, element {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn vocab_parallel_cross_entropy_rejects_labels_beyond_the_whole_vocabulary() {
        let logits = Tensor::f32(vec![1, 2, 3], vec![0.0; 6]);
        // Shard 1 of 2: columns 3..6 of a vocabulary of 6.
        let ok = Tensor::i32(vec![1, 2], vec![5, -100]);
        let st = vocab::cross_entropy_stats(&logits, &ok, 1, 2).unwrap();
        assert_eq!(st.as_f32().unwrap(), &[0.0, 3.0, 0.0, 0.0, 3.0, 0.0]);
        let bad = Tensor::i32(vec![1, 2], vec![0, 6]);
        assert!(matches!(
            vocab::cross_entropy_stats(&logits, &bad, 1, 2),
            Err(RuntimeError::LabelOutOfRange {
                label: 6,
                vocab: 6,
                batch: 0,
                pos: 1
            })
        ));
        let gathered = Tensor::f32(vec![1, 2, 6], vec![0.0; 12]);
        assert!(matches!(
            cross_entropy_shard_grad(&logits, &bad, &gathered, 1, 1),
            Err(RuntimeError::LabelOutOfRange { label: 6, .. })
        ));
        // A rank outside the gathered shards, and stats that are not 3 per shard.
        assert!(cross_entropy_shard_grad(&logits, &ok, &gathered, 2, 1).is_err());
        let odd = Tensor::f32(vec![1, 2, 4], vec![0.0; 8]);
        assert!(vocab::cross_entropy_from_stats(&odd, &ok, 1).is_err());
    }

    #[test]
    fn repeat_grad_matches_finite_differences() {
        let mut rng = Rng::new(5);
        let x = rand_tensor(&mut rng, &[2, 3, 2, 4], 1.0);
        let dy = rand_tensor(&mut rng, &[2, 3, 6, 4], 1.0);
        let g = repeat_grad(&dy, 2, 3).unwrap();
        check_vjp("repeat", &[x], 0, &dy, &g, |xs| {
            crate::cpu::layout::repeat(&xs[0], 2, 3).unwrap()
        });
    }
}
