//! Every rank of a mesh on one GPU: one host thread per rank, each with its own
//! [`CudaProgram`] (streams, arena, parameters), connected by `local-gpu` or `nccl`
//! communicators, one per mesh-axis group. The GPU counterpart of `spmd::run_spmd`.

use super::{CudaDevice, CudaError, CudaOptions, CudaProgram, CudaRankCtx, ParamInit};
use crate::cuda::comm::device::DeviceCommunicator;
use crate::cuda::comm::local_gpu::group;
use crate::cuda::comm::nccl::{NcclComm, NcclId};
use crate::rank::{axis_comms, on_threads};
use crate::Tensor;
use shardc_compiler::ir::Graph;
use shardc_compiler::shard::Mesh;
use std::collections::BTreeMap;
use std::sync::Arc;

/// A GPU rank failed.
pub type CudaRankError = crate::rank::RankFailure<CudaError>;

/// Runs `rank(t)` for every rank's `t` (in rank order), each on its own thread; the first
/// root-cause error (not a peer's knock-on failure), or every rank's outputs.
fn on_rank_threads<T: Send>(
    mesh: &Mesh,
    per_rank: Vec<T>,
    rank: impl Fn(T) -> Result<BTreeMap<String, Tensor>, CudaError> + Sync,
) -> Result<Vec<BTreeMap<String, Tensor>>, CudaRankError> {
    let results = on_threads(per_rank, rank)
        .into_iter()
        .map(|r| r.unwrap_or_else(|_| Err(panicked())))
        .collect();
    crate::rank::root_cause(mesh, results)
}

/// Runs one rank: prepare, run; on failure abort the rank's communicators so peers stop.
fn run_rank<C: DeviceCommunicator>(
    dev: &Arc<CudaDevice>,
    program: &Graph,
    params: &ParamInit,
    inputs: &BTreeMap<String, Tensor>,
    opts: &CudaOptions,
    comms: &[(String, C)],
) -> Result<BTreeMap<String, Tensor>, CudaError> {
    let mut ctx = CudaRankCtx::new();
    for (axis, c) in comms {
        ctx.insert(axis.clone(), c);
    }
    // Every rank prepared (kernels loaded, GEMM plans built) before any enqueues a
    // collective: see `warm.rs`.
    let out = CudaProgram::prepare(dev.clone(), program, params, &ctx, opts.clone())
        .and_then(|mut p| p.barrier(&ctx).and_then(|()| p.run(inputs, &ctx)));
    if let Err(e) = &out {
        for (_, c) in comms {
            c.abort(&e.to_string());
        }
    }
    out
}

/// Runs `program` on `mesh.world_size()` virtual ranks on `dev` with the `local-gpu`
/// communicator; each rank takes its shard of the global `inputs`.
pub fn run_spmd_local_gpu(
    dev: &Arc<CudaDevice>,
    program: &Graph,
    mesh: &Mesh,
    params: &ParamInit,
    inputs: &BTreeMap<String, Tensor>,
    opts: &CudaOptions,
) -> Result<Vec<BTreeMap<String, Tensor>>, CudaRankError> {
    let comms = axis_comms(mesh, |_| true, |name, n| group(dev, name, n, opts.timeout));
    on_rank_threads(mesh, comms, |mine| {
        run_rank(dev, program, params, inputs, opts, &mine)
    })
}

fn panicked() -> CudaError {
    CudaError::NoDevice {
        reason: "a rank thread panicked".to_string(),
    }
}

/// Runs `program` on `mesh.world_size()` ranks on `dev` with real NCCL communicators, one
/// thread per rank in this process (a world communicator, split per mesh axis). Several ranks
/// on one GPU need NCCL ≥ 2.30 and `NCCL_MULTI_RANK_GPU_ENABLE=1` (NOTES-cuda.md §5.2).
pub fn run_spmd_nccl_threads(
    dev: &Arc<CudaDevice>,
    program: &Graph,
    mesh: &Mesh,
    params: &ParamInit,
    inputs: &BTreeMap<String, Tensor>,
    opts: &CudaOptions,
) -> Result<Vec<BTreeMap<String, Tensor>>, CudaRankError> {
    let world = mesh.world_size();
    let id = NcclId::new().map_err(|error| CudaRankError {
        rank: 0,
        coords: mesh.coords_label(0),
        error,
    })?;
    on_rank_threads(mesh, (0..world).collect(), |rank| {
        run_nccl_rank(dev, program, mesh, rank, id, params, inputs, opts)
    })
}

/// Runs `rank` of `mesh` on `dev` with real NCCL communicators: the world communicator from
/// `id` (rank 0's, the same on every rank), split per mesh axis. One rank of a multi-process
/// job on its own GPU, or one thread of [`run_spmd_nccl_threads`].
#[allow(clippy::too_many_arguments)]
pub fn run_nccl_rank(
    dev: &Arc<CudaDevice>,
    program: &Graph,
    mesh: &Mesh,
    rank: usize,
    id: NcclId,
    params: &ParamInit,
    inputs: &BTreeMap<String, Tensor>,
    opts: &CudaOptions,
) -> Result<BTreeMap<String, Tensor>, CudaError> {
    let world_comm = NcclComm::init(dev, rank, mesh.world_size(), id, "world", opts.timeout)?;
    let axes = world_comm.for_mesh(mesh).map_err(|e| CudaError::CommPoll {
        axis: "world".to_string(),
        source: Box::new(e),
    })?;
    let out = run_rank(dev, program, params, inputs, opts, &axes);
    drop(axes);
    out
}
