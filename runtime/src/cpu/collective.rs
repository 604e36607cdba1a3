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
use shardc_compiler::ir::Op;

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

/// A collective's group: the axis' communicator, and how its errors name the node.
#[derive(Clone, Copy)]
struct Group<'a> {
    comm: &'a dyn Communicator,
    wrap: Wrap<'a>,
}

/// The collective `op` (`AllReduce`, `ReduceScatter`, `AllGather`, `AllToAll`, `Broadcast`)
/// of `x` over `comm`.
pub(crate) fn collective(
    comm: &dyn Communicator,
    op: &Op,
    x: &Tensor,
    wrap: Wrap,
) -> Result<Tensor, RuntimeError> {
    let g = Group { comm, wrap };
    match *op {
        Op::AllReduce { .. } => all_reduce(g, x),
        Op::ReduceScatter { dim, parts, .. } => reduce_scatter(g, x, dim, parts),
        Op::AllGather { dim, parts, .. } => all_gather(g, x, dim, parts),
        Op::AllToAll {
            split_dim,
            concat_dim,
            parts,
            ..
        } => all_to_all(g, x, (split_dim, concat_dim), parts),
        Op::Broadcast { root, .. } => broadcast(g, x, root),
        _ => unreachable!("invariant: called for collectives only"),
    }
}

/// The checks of a collective over `parts` ranks (each `(dim, split)`: a dim of `x` split
/// into or gathered from `parts` chunks), then `x` on the wire (`reduce`: summed).
fn checked_wire(
    op: &'static str,
    g: Group,
    x: &Tensor,
    (dims, parts): (&[(usize, bool)], usize),
    reduce: bool,
) -> Result<(Vec<f32>, Wire), RuntimeError> {
    check_size(g.comm, parts)?;
    for &(dim, split) in dims {
        check_dim(op, x, dim, parts, split)?;
    }
    to_wire(op, x, reduce)
}

/// `AllReduce`: the sum over the group, on every rank.
fn all_reduce(g: Group, x: &Tensor) -> Result<Tensor, RuntimeError> {
    let (mut buf, w) = to_wire("all_reduce", x, true)?;
    g.comm.all_reduce(&mut buf, ReduceOp::Sum).map_err(g.wrap)?;
    Ok(from_wire(x.shape.clone(), buf, w))
}

/// `ReduceScatter { dim, parts }`: the sum over the group; rank i keeps chunk i of `dim`.
fn reduce_scatter(g: Group, x: &Tensor, dim: usize, parts: usize) -> Result<Tensor, RuntimeError> {
    let (buf, w) = checked_wire("reduce_scatter", g, x, (&[(dim, true)], parts), true)?;
    let send = pack_chunks(&buf, &x.shape, dim, parts);
    let mut recv = vec![0.0f32; send.len() / parts];
    g.comm
        .reduce_scatter(&send, &mut recv, ReduceOp::Sum)
        .map_err(g.wrap)?;
    let mut shape = x.shape.clone();
    shape[dim] /= parts;
    Ok(from_wire(shape, recv, w))
}

/// `AllGather { dim, parts }`: every rank's value concatenated along `dim` in rank order.
fn all_gather(g: Group, x: &Tensor, dim: usize, parts: usize) -> Result<Tensor, RuntimeError> {
    let (send, w) = checked_wire("all_gather", g, x, (&[(dim, false)], parts), false)?;
    let mut recv = vec![0.0f32; send.len() * parts];
    g.comm.all_gather(&send, &mut recv).map_err(g.wrap)?;
    Ok(concat_chunks(&recv, x.shape.clone(), dim, parts, w))
}

/// `AllToAll { split_dim, concat_dim, parts }`: chunk j of `split_dim` goes to rank j; the
/// chunks received are concatenated along `concat_dim` in rank order.
fn all_to_all(
    g: Group,
    x: &Tensor,
    (split_dim, concat_dim): (usize, usize),
    parts: usize,
) -> Result<Tensor, RuntimeError> {
    let dims = [(split_dim, true), (concat_dim, false)];
    let (buf, w) = checked_wire("all_to_all", g, x, (&dims, parts), false)?;
    let send = pack_chunks(&buf, &x.shape, split_dim, parts);
    let mut recv = vec![0.0f32; send.len()];
    g.comm.all_to_all(&send, &mut recv).map_err(g.wrap)?;
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
fn broadcast(g: Group, x: &Tensor, root: usize) -> Result<Tensor, RuntimeError> {
    let (mut buf, w) = to_wire("broadcast", x, false)?;
    g.comm.broadcast(&mut buf, root).map_err(g.wrap)?;
    Ok(from_wire(x.shape.clone(), buf, w))
}
