//! Data movement: `Reshape`, `Transpose`, `Slice`, `Concat`, `Repeat`, for f32 and i32, plus
//! the chunking helpers the collectives use. Every kernel copies whole contiguous runs
//! (`inner` = product of the dims after the moved one) where it can.

use super::{prod, shape_err, PAR_MIN};
use crate::{Buffer, RuntimeError, Tensor};
use rayon::prelude::*;
use shardc_compiler::ir::SeqOrder;

/// An element type a host tensor can hold.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// The tensor's data, if it holds this type.
    fn data(t: &Tensor) -> Option<&[Self]>;
    /// A tensor of this type.
    fn tensor(shape: Vec<usize>, v: Vec<Self>) -> Tensor;
}

impl Elem for f32 {
    fn data(t: &Tensor) -> Option<&[f32]> {
        t.as_f32()
    }
    fn tensor(shape: Vec<usize>, v: Vec<f32>) -> Tensor {
        Tensor::f32(shape, v)
    }
}

impl Elem for i32 {
    fn data(t: &Tensor) -> Option<&[i32]> {
        t.as_i32()
    }
    fn tensor(shape: Vec<usize>, v: Vec<i32>) -> Tensor {
        Tensor::i32(shape, v)
    }
}

/// Runs a generic kernel on the tensor's element type.
macro_rules! by_elem {
    ($t:expr, $f:ident($($arg:expr),*)) => {
        match &$t.data {
            Buffer::F32(_) => $f::<f32>($($arg),*),
            Buffer::I32(_) => $f::<i32>($($arg),*),
        }
    };
}

/// (outer, mid, inner) sizes around `dim`.
pub(crate) fn split3(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (prod(&shape[..dim]), shape[dim], prod(&shape[dim + 1..]))
}

/// `Reshape`: same elements, new shape.
pub(crate) fn reshape(x: &Tensor, shape: Vec<usize>) -> Result<Tensor, RuntimeError> {
    if prod(&shape) != x.numel() {
        return Err(RuntimeError::Shape {
            op: "reshape",
            shapes: vec![x.shape.clone(), shape],
            reason: "element counts differ",
        });
    }
    Ok(Tensor {
        shape,
        data: x.data.clone(),
    })
}

/// Output dim `i` is input dim `perm[i]`; `data` is row-major over `shape`.
pub(crate) fn permute<T: Copy + Send + Sync>(
    data: &[T],
    shape: &[usize],
    perm: &[usize],
) -> Vec<T> {
    if perm.iter().enumerate().all(|(i, &p)| i == p) || data.is_empty() {
        return data.to_vec();
    }
    let r = shape.len();
    let mut in_strides = vec![1usize; r];
    for i in (0..r - 1).rev() {
        in_strides[i] = in_strides[i + 1] * shape[i + 1];
    }
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    let inner = out_shape[r - 1];
    let inner_stride = strides[r - 1];
    let mut out = vec![data[0]; data.len()];
    let fill = |row: usize, o: &mut [T]| {
        // Decompose the row index into the outer dims' indices.
        let mut rem = row;
        let mut base = 0;
        for d in (0..r - 1).rev() {
            base += (rem % out_shape[d]) * strides[d];
            rem /= out_shape[d];
        }
        for (j, e) in o.iter_mut().enumerate() {
            *e = data[base + j * inner_stride];
        }
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(inner)
            .enumerate()
            .for_each(|(i, o)| fill(i, o));
    } else {
        out.chunks_mut(inner)
            .enumerate()
            .for_each(|(i, o)| fill(i, o));
    }
    out
}

/// `Transpose { perm }`.
pub(crate) fn transpose(x: &Tensor, perm: &[usize]) -> Result<Tensor, RuntimeError> {
    let r = x.shape.len();
    let mut seen = vec![false; r];
    if perm.len() != r
        || perm
            .iter()
            .any(|&p| p >= r || std::mem::replace(&mut seen[p], true))
    {
        return Err(shape_err(
            "transpose",
            &[x],
            "not a permutation of the dims",
        ));
    }
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    fn go<T: Elem>(x: &Tensor, perm: &[usize], shape: Vec<usize>) -> Tensor {
        let d = T::data(x).expect("invariant: dispatched on buffer type");
        T::tensor(shape, permute(d, &x.shape, perm))
    }
    Ok(by_elem!(x, go(x, perm, shape)))
}

/// `len` indices from `start` along `dim` of row-major `data`.
pub(crate) fn slice_data<T: Copy>(
    data: &[T],
    shape: &[usize],
    dim: usize,
    start: usize,
    len: usize,
) -> Vec<T> {
    let (outer, mid, inner) = split3(shape, dim);
    let mut out = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        let b = (o * mid + start) * inner;
        out.extend_from_slice(&data[b..b + len * inner]);
    }
    out
}

/// `Slice { dim, start, len }`.
pub(crate) fn slice(
    x: &Tensor,
    dim: usize,
    start: usize,
    len: usize,
) -> Result<Tensor, RuntimeError> {
    if dim >= x.shape.len() || start + len > x.shape[dim] {
        return Err(shape_err("slice", &[x], "slice out of range"));
    }
    let mut shape = x.shape.clone();
    shape[dim] = len;
    fn go<T: Elem>(x: &Tensor, dim: usize, start: usize, len: usize, shape: Vec<usize>) -> Tensor {
        let d = T::data(x).expect("invariant: dispatched on buffer type");
        T::tensor(shape, slice_data(d, &x.shape, dim, start, len))
    }
    Ok(by_elem!(x, go(x, dim, start, len, shape)))
}

/// `SeqIndex { len, order }`: the original index of each position.
pub(crate) fn seq_index(len: usize, order: SeqOrder) -> Result<Tensor, RuntimeError> {
    if !order.divides(len) {
        return Err(shape_err(
            "seq_index",
            &[],
            "the order does not divide the length",
        ));
    }
    let idx = (0..len).map(|j| order.original(len, j) as i32).collect();
    Ok(Tensor::i32(vec![len], idx))
}

/// `SeqPermute { dim, order, inverse }`: position `j` of the result along `dim` is position
/// `order.original(j)` of `x` (inverse: the other way round).
pub(crate) fn seq_permute(
    x: &Tensor,
    dim: usize,
    order: SeqOrder,
    inverse: bool,
) -> Result<Tensor, RuntimeError> {
    if dim >= x.shape.len() || !order.divides(x.shape[dim]) {
        return Err(shape_err(
            "seq_permute",
            &[x],
            "dim out of range or not divisible by the order's chunks",
        ));
    }
    let n = x.shape[dim];
    // Source position of each result position.
    let src: Vec<usize> = (0..n)
        .map(|j| {
            if inverse {
                order.position_of(n, j)
            } else {
                order.original(n, j)
            }
        })
        .collect();
    fn go<T: Elem>(x: &Tensor, dim: usize, src: &[usize]) -> Tensor {
        let d = T::data(x).expect("invariant: dispatched on buffer type");
        let (outer, mid, inner) = split3(&x.shape, dim);
        let mut out = Vec::with_capacity(d.len());
        for o in 0..outer {
            for &j in src {
                let b = (o * mid + j) * inner;
                out.extend_from_slice(&d[b..b + inner]);
            }
        }
        T::tensor(x.shape.clone(), out)
    }
    Ok(by_elem!(x, go(x, dim, &src)))
}

/// `Concat { dim }`: all operands of one buffer type and equal dims except `dim`.
pub(crate) fn concat(xs: &[&Tensor], dim: usize) -> Result<Tensor, RuntimeError> {
    let Some(first) = xs.first() else {
        return Err(shape_err("concat", xs, "needs at least one operand"));
    };
    let r = first.shape.len();
    let ok = dim < r
        && xs.iter().all(|y| {
            y.shape.len() == r
                && y.dtype_name() == first.dtype_name()
                && (0..r).all(|i| i == dim || y.shape[i] == first.shape[i])
        });
    if !ok {
        return Err(shape_err(
            "concat",
            xs,
            "operands differ outside the concatenated dim",
        ));
    }
    let mut shape = first.shape.clone();
    shape[dim] = xs.iter().map(|y| y.shape[dim]).sum();
    fn go<T: Elem>(xs: &[&Tensor], dim: usize, shape: Vec<usize>) -> Tensor {
        let (outer, _, inner) = split3(&shape, dim);
        let mut out = Vec::with_capacity(prod(&shape));
        for o in 0..outer {
            for y in xs {
                let run = y.shape[dim] * inner;
                let d = T::data(y).expect("invariant: buffer types checked");
                out.extend_from_slice(&d[o * run..(o + 1) * run]);
            }
        }
        T::tensor(shape, out)
    }
    Ok(by_elem!(first, go(xs, dim, shape)))
}

/// `Repeat { dim, times }`: each index along `dim` repeated `times` times in place.
pub(crate) fn repeat(x: &Tensor, dim: usize, times: usize) -> Result<Tensor, RuntimeError> {
    if dim >= x.shape.len() || times == 0 {
        return Err(shape_err("repeat", &[x], "bad dim or zero repeat count"));
    }
    let mut shape = x.shape.clone();
    shape[dim] *= times;
    fn go<T: Elem>(x: &Tensor, dim: usize, times: usize, shape: Vec<usize>) -> Tensor {
        let d = T::data(x).expect("invariant: dispatched on buffer type");
        let (outer, mid, inner) = split3(&x.shape, dim);
        let mut out = Vec::with_capacity(prod(&shape));
        for o in 0..outer {
            for m in 0..mid {
                let b = (o * mid + m) * inner;
                for _ in 0..times {
                    out.extend_from_slice(&d[b..b + inner]);
                }
            }
        }
        T::tensor(shape, out)
    }
    Ok(by_elem!(x, go(x, dim, times, shape)))
}

/// Splits `data` (row-major over `shape`) into `parts` chunks along `dim` and lays them out
/// one after another: chunk `j` is contiguous and row-major over `shape` with `dim` divided.
pub(crate) fn pack_chunks<T: Copy>(
    data: &[T],
    shape: &[usize],
    dim: usize,
    parts: usize,
) -> Vec<T> {
    let c = shape[dim] / parts;
    let mut out = Vec::with_capacity(data.len());
    for j in 0..parts {
        out.extend(slice_data(data, shape, dim, j * c, c));
    }
    out
}

/// The inverse of concatenating chunks: `parts` contiguous chunks, each row-major over
/// `chunk_shape`, concatenated along `dim`.
pub(crate) fn unpack_chunks<T: Copy>(
    data: &[T],
    chunk_shape: &[usize],
    dim: usize,
    parts: usize,
) -> Vec<T> {
    let (outer, mid, inner) = split3(chunk_shape, dim);
    let chunk = outer * mid * inner;
    let run = mid * inner;
    let mut out = Vec::with_capacity(data.len());
    for o in 0..outer {
        for j in 0..parts {
            let b = j * chunk + o * run;
            out.extend_from_slice(&data[b..b + run]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_then_unpack_round_trips() {
        let shape = [2, 6, 3];
        let data: Vec<i32> = (0..36).collect();
        for parts in [1, 2, 3, 6] {
            let packed = pack_chunks(&data, &shape, 1, parts);
            let chunk = [2, 6 / parts, 3];
            assert_eq!(unpack_chunks(&packed, &chunk, 1, parts), data);
        }
    }

    #[test]
    fn permute_3d() {
        let data: Vec<i32> = (0..24).collect();
        let out = permute(&data, &[2, 3, 4], &[2, 0, 1]);
        // out[k, i, j] = data[i, j, k]
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..4 {
                    assert_eq!(out[k * 6 + i * 3 + j], data[i * 12 + j * 4 + k]);
                }
            }
        }
    }
}
