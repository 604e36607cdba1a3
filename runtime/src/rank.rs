//! The rank core both backends share: what one rank of an SPMD program does that does not
//! depend on where it computes — its chunk of each global input, which values hold
//! vocabulary-local token ids, which failure among the ranks of a run is the root cause, and
//! the scoped thread each rank runs on.

use crate::cpu::layout;
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::{DType, Graph, Node, Op, ShardSpec};
use shardc_compiler::shard::{AxisId, Mesh};
use std::borrow::Cow;
use std::collections::BTreeMap;

/// A rank's coordinate on a mesh axis and the axis size, by axis name.
pub(crate) type CoordOf<'a> = dyn Fn(&str) -> Result<(usize, usize), RuntimeError> + 'a;

/// Per value, whether it holds vocabulary-local token ids: a `RankOffset` and what is derived
/// from it by data movement or an add. Such ids index a vocabulary shard, so they are not
/// checked against the (sharded) table's size.
pub(crate) fn local_ids(g: &Graph) -> Vec<bool> {
    let mut local = vec![false; g.len()];
    for v in g.ids() {
        let node = g.node(v);
        local[v.index()] = match node.op {
            Op::RankOffset { .. } => true,
            Op::Reshape
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Concat { .. }
            | Op::Repeat { .. }
            | Op::Cast(_)
            | Op::Add
            | Op::LocalSlice { .. }
            | Op::AllGather { .. }
            | Op::AllToAll { .. }
            | Op::Broadcast { .. } => node.inputs.iter().any(|i| local[i.index()]),
            _ => false,
        };
    }
    local
}

/// This rank's coordinate on `axis` (`(coordinate, axis size)`), for an op split `parts` ways
/// over it: a named error when the axis has another size.
pub(crate) fn part_coord(
    (coord, size): (usize, usize),
    axis: &str,
    parts: usize,
) -> Result<usize, RuntimeError> {
    if size != parts {
        return Err(RuntimeError::AxisSize {
            axis: axis.to_string(),
            expected: parts,
            found: size,
        });
    }
    Ok(coord)
}

/// This rank's chunk of `x` along `spec.dim`: chunk `coord` of `spec.parts`, where `coord` and
/// the axis size come from `coord_of(spec.axis)`. The axis must have `spec.parts` ranks and the
/// dim must divide.
pub(crate) fn chunk_of(
    x: &Tensor,
    spec: &ShardSpec,
    coord_of: &CoordOf,
) -> Result<Tensor, RuntimeError> {
    let (coord, size) = coord_of(&spec.axis)?;
    if size != spec.parts {
        return Err(RuntimeError::AxisSize {
            axis: spec.axis.clone(),
            expected: spec.parts,
            found: size,
        });
    }
    if spec.dim >= x.shape.len() || x.shape[spec.dim] % spec.parts != 0 {
        return Err(crate::cpu::shape_err(
            "local_slice",
            &[x],
            "dim out of range or not divisible by the axis size",
        ));
    }
    let chunk = x.shape[spec.dim] / spec.parts;
    layout::slice(x, spec.dim, coord * chunk, chunk)
}

/// The `Input` node `node` (named `name`, split by `shards`): the caller's global tensor from
/// `inputs`, checked (present, of the node's dtype class, of the global shape the node's local
/// type and shards give), then this rank's chunk of it.
pub(crate) fn input_chunk<'t>(
    node: &Node,
    name: &str,
    shards: &[ShardSpec],
    inputs: &'t BTreeMap<String, Tensor>,
    coord_of: &CoordOf,
) -> Result<Cow<'t, Tensor>, RuntimeError> {
    let t = inputs.get(name).ok_or_else(|| RuntimeError::MissingInput {
        name: name.to_string(),
    })?;
    if (node.ty.dtype == DType::I32) != t.as_i32().is_some() {
        return Err(RuntimeError::InputDType {
            name: name.to_string(),
            expected: node.ty.dtype,
            found: t.dtype_name(),
        });
    }
    let mut global = node.ty.shape();
    for s in shards {
        if let Some(d) = global.get_mut(s.dim) {
            *d *= s.parts;
        }
    }
    if t.shape != global {
        return Err(RuntimeError::InputShape {
            name: name.to_string(),
            expected: global,
            found: t.shape.clone(),
        });
    }
    let mut cur = Cow::Borrowed(t);
    for s in shards {
        cur = Cow::Owned(chunk_of(&cur, s, coord_of)?);
    }
    Ok(cur)
}

/// A failure of one rank of a run (`RankError` on the CPU backend, `CudaRankError` on CUDA).
#[derive(Debug, thiserror::Error)]
#[error("rank {rank} (mesh coordinates {coords}): {error}")]
pub struct RankFailure<E: std::error::Error + 'static> {
    /// The failing rank.
    pub rank: usize,
    /// Its coordinates, `dp=0,tp=1`.
    pub coords: String,
    /// What went wrong.
    pub error: E,
}

/// One communicator per group of every mesh axis `pick` selects, from `group(axis name,
/// group size)` (a group's handles in group-rank order): per rank, its (axis name, handle)
/// pairs.
pub(crate) fn axis_comms<C>(
    mesh: &Mesh,
    pick: impl Fn(AxisId) -> bool,
    group: impl Fn(&str, usize) -> Vec<C>,
) -> Vec<Vec<(String, C)>> {
    let mut comms: Vec<Vec<(String, C)>> = (0..mesh.world_size()).map(|_| Vec::new()).collect();
    for a in mesh.axis_ids().filter(|&a| pick(a)) {
        let name = mesh.axis_name(a).to_string();
        for ranks in mesh.groups(a) {
            for (k, h) in group(&name, ranks.len()).into_iter().enumerate() {
                comms[ranks[k]].push((name.clone(), h));
            }
        }
    }
    comms
}

/// Runs `f(item)` for every item, each on its own scoped thread (one per rank); the join
/// results in item order, `Err` where a thread panicked.
pub(crate) fn on_threads<T: Send, R: Send>(
    items: impl IntoIterator<Item = T>,
    f: impl Fn(T) -> R + Sync,
) -> Vec<std::thread::Result<R>> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = items.into_iter().map(|t| s.spawn(move || f(t))).collect();
        handles.into_iter().map(|h| h.join()).collect()
    })
}

/// Every rank's output, or the first root-cause failure: one other than the knock-on ones it
/// caused in its peers (an aborted collective, a neighbour found stopped), which are reported
/// only when nothing else failed.
pub(crate) fn root_cause<T, E: std::error::Error + 'static>(
    mesh: &Mesh,
    results: Vec<Result<T, E>>,
) -> Result<Vec<T>, RankFailure<E>> {
    let mut knock_on = None;
    let mut outs = Vec::with_capacity(results.len());
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(o) => outs.push(o),
            Err(error) => {
                let text = error.to_string();
                let secondary = text.contains("aborted") || text.contains("stopped");
                let failure = RankFailure {
                    rank,
                    coords: mesh.coords_label(rank),
                    error,
                };
                if !secondary {
                    return Err(failure);
                }
                knock_on.get_or_insert(failure);
            }
        }
    }
    match knock_on {
        Some(e) => Err(e),
        None => Ok(outs),
    }
}
