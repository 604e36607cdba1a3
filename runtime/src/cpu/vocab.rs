//! Vocabulary ops: `Embedding` (row lookup), `CrossEntropy` (summed token loss), and the
//! two halves of the vocabulary-parallel loss: `CrossEntropyStats` (a shard's per-row stats)
//! and `CrossEntropyFromStats` (the loss from every shard's stats).

use super::{f32_of, for_each_row, i32_of, shape_err};
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::CROSS_ENTROPY_STATS;

/// `Embedding`: `(table[V,H], ids[..]) -> [.., H]`; ids outside `[0, V)` give zero rows.
pub(crate) fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor, RuntimeError> {
    const OP: &str = "embedding";
    let td = f32_of(OP, table, 0)?;
    let id = i32_of(OP, ids, 1)?;
    if table.shape.len() != 2 {
        return Err(shape_err(OP, &[table, ids], "table must be 2-D"));
    }
    let (v, h) = (table.shape[0], table.shape[1]);
    let mut shape = ids.shape.clone();
    shape.push(h);
    let mut out = vec![0.0f32; id.len() * h];
    for_each_row(&mut out, h, |r, row| {
        let t = id[r];
        if t >= 0 && (t as usize) < v {
            let t = t as usize;
            row.copy_from_slice(&td[t * h..(t + 1) * h]);
        }
    });
    Ok(Tensor::f32(shape, out))
}

/// (batch, position) of flat index `i` of a tensor shaped `shape`: the index along the first
/// dim, and the flat index within the remaining dims.
pub(crate) fn batch_pos(shape: &[usize], i: usize) -> (usize, usize) {
    let rest: usize = shape.iter().skip(1).product();
    if shape.is_empty() || rest == 0 {
        (0, i)
    } else {
        (i / rest, i % rest)
    }
}

/// The first id outside `[0, vocab)`, as a [`RuntimeError::TokenOutOfRange`].
pub(crate) fn check_ids(ids: &Tensor, vocab: usize) -> Result<(), RuntimeError> {
    let id = i32_of("embedding", ids, 1)?;
    match id.iter().position(|&t| t < 0 || t as usize >= vocab) {
        None => Ok(()),
        Some(i) => {
            let (batch, pos) = batch_pos(&ids.shape, i);
            Err(RuntimeError::TokenOutOfRange {
                id: id[i],
                vocab,
                batch,
                pos,
            })
        }
    }
}

/// The operands of `CrossEntropy` and its gradient, checked: logits `[.., V]`, labels `[..]`
/// (i32), every label < V (negative ones are ignored). Returns the data and V.
pub(crate) fn cross_entropy_operands<'a>(
    op: &'static str,
    logits: &'a Tensor,
    labels: &'a Tensor,
) -> Result<(&'a [f32], &'a [i32], usize), RuntimeError> {
    shard_operands(op, logits, labels, 1)
}

/// The operands of a cross-entropy over one of `parts` vocabulary shards, checked: logits
/// `[.., Vl]`, labels `[..]` (i32), every label < `parts·Vl` (negative ones are ignored).
/// Returns the data and Vl.
pub(crate) fn shard_operands<'a>(
    op: &'static str,
    logits: &'a Tensor,
    labels: &'a Tensor,
    parts: usize,
) -> Result<(&'a [f32], &'a [i32], usize), RuntimeError> {
    let ld = f32_of(op, logits, 0)?;
    let yd = i32_of(op, labels, 1)?;
    let r = labels.shape.len();
    if logits.shape.len() != r + 1 || logits.shape[..r] != labels.shape[..] {
        return Err(shape_err(
            op,
            &[logits, labels],
            "logits must be labels' shape plus [V]",
        ));
    }
    let v = logits.shape[r];
    let vocab = v.saturating_mul(parts);
    if let Some(i) = yd.iter().position(|&y| y >= 0 && y as usize >= vocab) {
        let (batch, pos) = batch_pos(&labels.shape, i);
        return Err(RuntimeError::LabelOutOfRange {
            label: yd[i],
            vocab,
            batch,
            pos,
        });
    }
    Ok((ld, yd, v))
}

/// Gathered stats `[.., 3·P]` over labels `[..]`, checked. Returns the data and P.
pub(crate) fn stats_operand<'a>(
    op: &'static str,
    stats: &'a Tensor,
    labels: &Tensor,
    operand: usize,
) -> Result<(&'a [f32], usize), RuntimeError> {
    let sd = f32_of(op, stats, operand)?;
    let r = labels.shape.len();
    let w = stats.shape.last().copied().unwrap_or(0);
    if stats.shape.len() != r + 1
        || stats.shape[..r] != labels.shape[..]
        || w == 0
        || w % CROSS_ENTROPY_STATS != 0
    {
        return Err(shape_err(
            op,
            &[stats, labels],
            "stats must be labels' shape plus [3·shards]",
        ));
    }
    Ok((sd, w / CROSS_ENTROPY_STATS))
}

/// The log-sum-exp of a row over every vocabulary shard and the label's logit, from the row's
/// gathered stats `[m₀, s₀, t₀, m₁, ..]`: `M + ln Σᵢ sᵢ·exp(mᵢ − M)` with `M = maxᵢ mᵢ`, and
/// `Σᵢ tᵢ` (one shard holds the label). In f64.
pub(crate) fn row_lse(stats: &[f32]) -> (f64, f64) {
    let shards = stats.chunks_exact(CROSS_ENTROPY_STATS);
    let max = shards
        .clone()
        .fold(f64::NEG_INFINITY, |m, c| m.max(c[0] as f64));
    let (mut sum, mut target) = (0.0f64, 0.0f64);
    for c in shards {
        if c[1] != 0.0 {
            sum += c[1] as f64 * (c[0] as f64 - max).exp();
        }
        target += c[2] as f64;
    }
    (max + sum.ln(), target)
}

/// `CrossEntropyStats { parts }` on vocabulary shard `coord`: `(logits[.., Vl], labels[..])
/// -> f32[.., 3]`, per row the max `m`, `Σ exp(x − m)` (f64, rounded once; 0 for a row of
/// −∞) and the label's logit when the label is one of columns `coord·Vl ..` (else 0).
pub(crate) fn cross_entropy_stats(
    logits: &Tensor,
    labels: &Tensor,
    coord: usize,
    parts: usize,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "cross_entropy_stats";
    let (ld, yd, v) = shard_operands(OP, logits, labels, parts)?;
    let lo = coord.saturating_mul(v);
    let mut out = vec![0.0f32; yd.len() * CROSS_ENTROPY_STATS];
    for_each_row(&mut out, CROSS_ENTROPY_STATS, |i, st| {
        let row = &ld[i * v..(i + 1) * v];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let sum = if max == f32::NEG_INFINITY {
            0.0
        } else {
            row.iter()
                .map(|&x| (x as f64 - max as f64).exp())
                .sum::<f64>()
        };
        let y = yd[i];
        let target = match usize::try_from(y) {
            Ok(y) if (lo..lo + v).contains(&y) => row[y - lo],
            _ => 0.0,
        };
        st.copy_from_slice(&[max, sum as f32, target]);
    });
    let mut shape = labels.shape.clone();
    shape.push(CROSS_ENTROPY_STATS);
    Ok(Tensor::f32(shape, out))
}

/// `CrossEntropyFromStats { denom }`: `(stats[.., 3·P], labels[..]) -> f32[]`, the sum over
/// positions with label ≥ 0 of the row's log-sum-exp minus its label's logit (from the
/// gathered stats, [`row_lse`]), divided by `denom`. In f64, rounded once.
pub(crate) fn cross_entropy_from_stats(
    stats: &Tensor,
    labels: &Tensor,
    denom: usize,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "cross_entropy_from_stats";
    let yd = i32_of(OP, labels, 1)?;
    let (sd, p) = stats_operand(OP, stats, labels, 0)?;
    let w = p * CROSS_ENTROPY_STATS;
    let mut total = 0.0f64;
    for (i, &y) in yd.iter().enumerate() {
        if y >= 0 {
            let (lse, target) = row_lse(&sd[i * w..(i + 1) * w]);
            total += lse - target;
        }
    }
    Ok(Tensor::f32(vec![], vec![(total / denom as f64) as f32]))
}

/// `CrossEntropy { denom }`: `(logits[.., V], labels[..]) -> f32[]`, the sum over positions
/// with label ≥ 0 of `logsumexp(logits) − logits[label]`, divided by `denom`. Computed in f64.
pub(crate) fn cross_entropy(
    logits: &Tensor,
    labels: &Tensor,
    denom: usize,
) -> Result<Tensor, RuntimeError> {
    const OP: &str = "cross_entropy";
    let (ld, yd, v) = cross_entropy_operands(OP, logits, labels)?;
    let mut total = 0.0f64;
    for (i, &y) in yd.iter().enumerate() {
        if y < 0 {
            continue;
        }
        let row = &ld[i * v..(i + 1) * v];
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let lse = max
            + row
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        total += lse - row[y as usize] as f64;
    }
    Ok(Tensor::f32(vec![], vec![(total / denom as f64) as f32]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_out_of_range_rows_are_zero() {
        let table = Tensor::f32(vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]);
        let ids = Tensor::i32(vec![4], vec![1, -1, 2, 0]);
        let y = embedding(&table, &ids).unwrap();
        assert_eq!(
            y.as_f32().unwrap(),
            &[3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0]
        );
        let err = check_ids(&Tensor::i32(vec![2, 3], vec![0, 1, 1, 0, 5, 0]), 2).unwrap_err();
        assert!(matches!(
            err,
            RuntimeError::TokenOutOfRange {
                id: 5,
                vocab: 2,
                batch: 1,
                pos: 1
            }
        ));
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_log_v() {
        let logits = Tensor::f32(vec![1, 2, 4], vec![0.0; 8]);
        let labels = Tensor::i32(vec![1, 2], vec![3, -100]);
        let l = cross_entropy(&logits, &labels, 1).unwrap();
        assert!((l.as_f32().unwrap()[0] - 4f32.ln()).abs() < 1e-6);
        let bad = Tensor::i32(vec![1, 2], vec![4, 0]);
        assert!(matches!(
            cross_entropy(&logits, &bad, 1),
            Err(RuntimeError::LabelOutOfRange { label: 4, .. })
        ));
    }
}
