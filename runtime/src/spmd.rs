//! Runs an SPMD program on thread ranks: one thread per rank of the mesh, one thread
//! communicator per mesh-axis group. The CPU oracle for every sharded plan.

use crate::comm::thread::{group, ThreadComm};
use crate::comm::Communicator;
use crate::exec::{execute_with_params, load_params, RankCtx};
use crate::{RuntimeError, Tensor, Weights};
use shardc_compiler::ir::Graph;
use shardc_compiler::shard::Mesh;
use std::collections::BTreeMap;
use std::time::Duration;
use thiserror::Error;

/// A rank failed.
#[derive(Debug, Error)]
#[error("rank {rank} (mesh coordinates {coords}): {error}")]
pub struct RankError {
    /// The failing rank.
    pub rank: usize,
    /// Its coordinates, `dp=0,tp=1`.
    pub coords: String,
    /// What went wrong.
    pub error: RuntimeError,
}

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
    let world = mesh.world_size();
    // comms[rank] = (axis name, handle) for every axis.
    let mut comms: Vec<Vec<(String, ThreadComm)>> = (0..world).map(|_| Vec::new()).collect();
    for a in mesh.axis_ids() {
        let name = mesh.axis_name(a).to_string();
        for ranks in mesh.groups(a) {
            for (k, h) in group(&name, ranks.len(), timeout).into_iter().enumerate() {
                comms[ranks[k]].push((name.clone(), h));
            }
        }
    }
    let coords_of = |rank: usize| -> String {
        mesh.coords(rank)
            .iter()
            .zip(&mesh.axes)
            .map(|(c, a)| format!("{}={c}", a.name))
            .collect::<Vec<_>>()
            .join(",")
    };
    let results: Vec<Result<BTreeMap<String, Tensor>, RuntimeError>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mine| {
                s.spawn(move || {
                    let mut ctx = RankCtx::new();
                    for (axis, h) in &mine {
                        ctx.insert(axis.clone(), h as &dyn Communicator);
                    }
                    let out = load_params(program, weights, &ctx)
                        .and_then(|p| execute_with_params(program, &p, inputs, &ctx));
                    if let Err(e) = &out {
                        for (_, h) in &mine {
                            h.abort(&e.to_string());
                        }
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("invariant: rank threads do not panic"))
            .collect()
    });
    // Prefer a root cause over the aborts it caused in its peers.
    let mut first_abort = None;
    let mut outs = Vec::with_capacity(world);
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(o) => outs.push(o),
            Err(e) => {
                let aborted = e.to_string().contains("aborted");
                let err = RankError {
                    rank,
                    coords: coords_of(rank),
                    error: e,
                };
                if !aborted {
                    return Err(err);
                }
                first_abort.get_or_insert(err);
            }
        }
    }
    match first_abort {
        Some(e) => Err(e),
        None => Ok(outs),
    }
}
