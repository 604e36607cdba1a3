//! Vocabulary ops: `Embedding` (row lookup) and `CrossEntropy` (summed token loss).

use super::{f32_of, for_each_row, i32_of, shape_err};
use crate::{RuntimeError, Tensor};

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
    if let Some(i) = yd.iter().position(|&y| y >= 0 && y as usize >= v) {
        let (batch, pos) = batch_pos(&labels.shape, i);
        return Err(RuntimeError::LabelOutOfRange {
            label: yd[i],
            vocab: v,
            batch,
            pos,
        });
    }
    Ok((ld, yd, v))
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
