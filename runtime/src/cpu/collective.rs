//! Collectives of the IR on top of a [`Communicator`]: the data is packed so that the
//! communicator sees contiguous per-rank chunks (the collective's dim moved to the front),
//! then unpacked into the result's row-major layout.
//!
//! i32 values cross the communicator bit-cast to f32 for pure data movement (exact); sums of
//! i32 values convert them to f32, which is exact only up to 2²⁴ in magnitude (larger values
//! are an [`RuntimeError::Unsupported`] error).

use super::layout::{pack_chunks, unpack_chunks};
use super::shape_err;
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::{Buffer, RuntimeError, Tensor};

/// Turns a communicator error into a runtime error naming the node.
pub(crate) type Wrap<'a> = &'a dyn Fn(CommError) -> RuntimeError;

/// Largest i32 magnitude an f32 holds exactly.
const I32_EXACT: i32 = 1 << 24;

/// How a tensor's elements travel as f32.
#[derive(Clone, Copy, PartialEq)]
enum Wire {
    F32,
    /// i32 bit patterns (data movement).
    I32Bits,
    /// i32 values converted to f32 (reductions).
    I32Value,
}

fn to_wire(op: &'static str, x: &Tensor, reduce: bool) -> Result<(Vec<f32>, Wire), RuntimeError> {
    Ok(match &x.data {
        Buffer::F32(v) => (v.clone(), Wire::F32),
        Buffer::I32(v) if !reduce => (bytemuck::cast_slice::<i32, f32>(v).to_vec(), Wire::I32Bits),
        Buffer::I32(v) => {
            if v.iter().any(|e| e.unsigned_abs() > I32_EXACT as u32) {
                return Err(RuntimeError::Unsupported {
                    op,
                    detail: format!("sum of i32 values beyond ±{I32_EXACT} (not exact in f32)"),
                });
            }
            (v.iter().map(|&e| e as f32).collect(), Wire::I32Value)
        }
    })
}

fn from_wire(shape: Vec<usize>, v: Vec<f32>, w: Wire) -> Tensor {
    match w {
        Wire::F32 => Tensor::f32(shape, v),
        Wire::I32Bits => Tensor::i32(shape, bytemuck::cast_slice::<f32, i32>(&v).to_vec()),
        Wire::I32Value => Tensor::i32(shape, v.iter().map(|&e| e as i32).collect()),
    }
}

fn check_size(comm: &dyn Communicator, parts: usize) -> Result<(), RuntimeError> {
    if comm.size() == parts {
        Ok(())
    } else {
        Err(RuntimeError::AxisSize {
            axis: comm.name().to_string(),
            expected: parts,
            found: comm.size(),
        })
    }
}

fn check_dim(
    op: &'static str,
    x: &Tensor,
    dim: usize,
    parts: usize,
    divide: bool,
) -> Result<(), RuntimeError> {
    if dim >= x.shape.len() || parts == 0 || (divide && x.shape[dim] % parts != 0) {
        return Err(shape_err(
            op,
            &[x],
            "dim out of range or not divisible by the axis size",
        ));
    }
    Ok(())
}

/// `AllReduce`: the sum over the group, on every rank.
pub(crate) fn all_reduce(
    comm: &dyn Communicator,
    x: &Tensor,
    wrap: Wrap,
) -> Result<Tensor, RuntimeError> {
    let (mut buf, w) = to_wire("all_reduce", x, true)?;
    comm.all_reduce(&mut buf, ReduceOp::Sum).map_err(wrap)?;
    Ok(from_wire(x.shape.clone(), buf, w))
}

/// `ReduceScatter { dim, parts }`: the sum over the group; rank i keeps chunk i of `dim`.
pub(crate) fn reduce_scatter(
    comm: &dyn Communicator,
    x: &Tensor,
    dim: usize,
    parts: usize,
    wrap: Wrap,
) -> Result<Tensor, RuntimeError> {
    check_size(comm, parts)?;
    check_dim("reduce_scatter", x, dim, parts, true)?;
    let (buf, w) = to_wire("reduce_scatter", x, true)?;
    let send = pack_chunks(&buf, &x.shape, dim, parts);
    let mut recv = vec![0.0f32; send.len() / parts];
    comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum)
        .map_err(wrap)?;
    let mut shape = x.shape.clone();
    shape[dim] /= parts;
    Ok(from_wire(shape, recv, w))
}

/// `AllGather { dim, parts }`: every rank's value concatenated along `dim` in rank order.
pub(crate) fn all_gather(
    comm: &dyn Communicator,
    x: &Tensor,
    dim: usize,
    parts: usize,
    wrap: Wrap,
) -> Result<Tensor, RuntimeError> {
    check_size(comm, parts)?;
    check_dim("all_gather", x, dim, parts, false)?;
    let (send, w) = to_wire("all_gather", x, false)?;
    let mut recv = vec![0.0f32; send.len() * parts];
    comm.all_gather(&send, &mut recv).map_err(wrap)?;
    Ok(concat_chunks(&recv, x.shape.clone(), dim, parts, w))
}

/// `AllToAll { split_dim, concat_dim, parts }`: chunk j of `split_dim` goes to rank j; the
/// chunks received are concatenated along `concat_dim` in rank order.
pub(crate) fn all_to_all(
    comm: &dyn Communicator,
    x: &Tensor,
    split_dim: usize,
    concat_dim: usize,
    parts: usize,
    wrap: Wrap,
) -> Result<Tensor, RuntimeError> {
    check_size(comm, parts)?;
    check_dim("all_to_all", x, split_dim, parts, true)?;
    check_dim("all_to_all", x, concat_dim, parts, false)?;
    let (buf, w) = to_wire("all_to_all", x, false)?;
    let send = pack_chunks(&buf, &x.shape, split_dim, parts);
    let mut recv = vec![0.0f32; send.len()];
    comm.all_to_all(&send, &mut recv).map_err(wrap)?;
    let mut chunk = x.shape.clone();
    chunk[split_dim] /= parts;
    Ok(concat_chunks(&recv, chunk, concat_dim, parts, w))
}

/// The `parts` chunks of `recv` (one per rank, each of shape `chunk`) concatenated along
/// `dim` in rank order.
fn concat_chunks(recv: &[f32], chunk: Vec<usize>, dim: usize, parts: usize, w: Wire) -> Tensor {
    let data = unpack_chunks(recv, &chunk, dim, parts);
    let mut shape = chunk;
    shape[dim] *= parts;
    from_wire(shape, data, w)
}

/// `Broadcast { root }`: rank `root`'s value on every rank.
pub(crate) fn broadcast(
    comm: &dyn Communicator,
    x: &Tensor,
    root: usize,
    wrap: Wrap,
) -> Result<Tensor, RuntimeError> {
    let (mut buf, w) = to_wire("broadcast", x, false)?;
    comm.broadcast(&mut buf, root).map_err(wrap)?;
    Ok(from_wire(x.shape.clone(), buf, w))
}
