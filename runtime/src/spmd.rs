//! Runs an SPMD program on thread ranks: one thread per rank of the mesh, one thread
//! communicator per mesh-axis group. The CPU oracle for every sharded plan.

use crate::comm::thread::{group, ThreadComm};
use crate::comm::Communicator;
use crate::exec::{execute_with_params, load_params, RankCtx};
use crate::{RuntimeError, Tensor, Weights};
use shardc_compiler::ir::Graph;
use shardc_compiler::shard::{AxisId, Mesh};
use std::collections::BTreeMap;
use std::time::Duration;

pub use crate::rank::RankFailure;
use crate::rank::{axis_comms, on_threads};

/// A rank failed.
pub type RankError = RankFailure<RuntimeError>;

/// Outputs of every rank.
pub type RankOutputs = Vec<BTreeMap<String, Tensor>>;

/// Runs `program` on `mesh.world_size()` thread ranks with the caller's global `inputs`
/// (each rank takes its shard). A rank that fails aborts its groups so the others stop
/// promptly; the first root-cause error is returned (not a peer's "aborted").
pub fn run_spmd(
    program: &Graph,
    mesh: &Mesh,
    weights: &Weights,
    inputs: &BTreeMap<String, Tensor>,
    timeout: Duration,
) -> Result<RankOutputs, RankError> {
    let results = run_threads(thread_comms(mesh, |_| true, timeout), |_, ctx| {
        load_params(program, weights, ctx)
            .and_then(|p| execute_with_params(program, &p, inputs, ctx))
    });
    root_cause(mesh, results)
}

/// Runs `f(rank, ctx)` on one thread per rank, `ctx` serving each of the rank's `comms`. A
/// rank whose `f` fails aborts its groups, so its peers stop promptly. Results in rank order.
pub(crate) fn run_threads<T: Send>(
    comms: Vec<Vec<(String, ThreadComm)>>,
    f: impl Fn(usize, &RankCtx) -> Result<T, RuntimeError> + Sync,
) -> Vec<Result<T, RuntimeError>> {
    on_threads(comms.into_iter().enumerate(), |(rank, mine)| {
        let mut ctx = RankCtx::new();
        for (axis, h) in &mine {
            ctx.insert(axis.clone(), h as &dyn Communicator);
        }
        let out = f(rank, &ctx);
        if let Err(e) = &out {
            for (_, h) in &mine {
                h.abort(&e.to_string());
            }
        }
        out
    })
    .into_iter()
    .map(|r| r.expect("invariant: rank threads do not panic"))
    .collect()
}

/// One thread communicator per group of every mesh axis `pick` selects: per rank, its
/// (axis name, handle) pairs.
pub(crate) fn thread_comms(
    mesh: &Mesh,
    pick: impl Fn(AxisId) -> bool,
    timeout: Duration,
) -> Vec<Vec<(String, ThreadComm)>> {
    axis_comms(mesh, pick, |name, n| group(name, n, timeout))
}

/// Every rank's output, or the first root-cause error (see [`crate::rank::root_cause`]).
pub(crate) fn root_cause<T>(
    mesh: &Mesh,
    results: Vec<Result<T, RuntimeError>>,
) -> Result<Vec<T>, RankError> {
    crate::rank::root_cause(mesh, results)
}
