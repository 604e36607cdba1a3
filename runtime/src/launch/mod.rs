//! Multi-process execution: one process per rank, started by `shardc launch`, torchrun or
//! mpirun, as PyTorch's distributed runtime does it.
//!
//! The pieces, in the order a rank uses them:
//!
//! - [`WorldEnv`] ([`env`]): who this process is, from torchrun's variables (`RANK`,
//!   `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, with Open
//!   MPI / PMI fallbacks), with an error naming any missing or invalid variable.
//! - [`Rendezvous`] ([`rendezvous`]): a TCP store hosted by rank 0 at
//!   `MASTER_ADDR:MASTER_PORT`. Every rank registers the listen addresses of its data plane;
//!   once all have, every rank receives the full address table and rank 0's opaque bootstrap
//!   bytes (an `ncclUniqueId`, or a random job id on the CPU).
//! - [`ProcessGroup`] ([`group`]): given the mesh, one [`TcpComm`](crate::comm::tcp::TcpComm)
//!   per mesh axis for this rank (one listener per (rank, axis), registered at the
//!   rendezvous), and [`ProcessGroup::run`], which executes this rank's SPMD program, aborts
//!   every group when it fails so the peers stop promptly, and ends with a world barrier.
//! - [`launch()`] ([`spawn`]): the launcher: spawns the ranks of this node as child processes
//!   with that environment, prefixes their output with `[rank i]`, and when one fails or the job
//!   runs past its timeout, stops the others and returns an error naming the rank.
//! - [`bench`]: nccl-tests-style collective benchmarks over any [`bench::CommKind`].
//!
//! Fault handling: every wait on a peer (rendezvous, connection set-up, each collective) is
//! bounded by one timeout; a rank that dies breaks its sockets (peers abort at once), a rank
//! that stalls makes its peers time out, and a rank that fails aborts its groups, which
//! spreads the failure to every rank. Nothing waits forever.

pub mod bench;
pub mod env;
pub mod group;
pub mod rendezvous;
pub mod spawn;

pub use env::WorldEnv;
pub use group::{fingerprint_of, plan_fingerprint, ProcessGroup};
pub use rendezvous::{Rendezvous, RendezvousServer, RendezvousTable};
pub use spawn::{launch, LaunchConfig, LaunchReport};

use crate::comm::CommError;
use crate::RuntimeError;
use std::time::Duration;
use thiserror::Error;

/// A multi-process launch, rendezvous or rank failed.
#[derive(Debug, Error)]
pub enum LaunchError {
    /// A required environment variable is not set.
    #[error(
        "environment variable {name} is not set; a multi-process rank needs RANK, WORLD_SIZE, \
         MASTER_ADDR and MASTER_PORT (set by `shardc launch`, torchrun, or by hand)"
    )]
    MissingVar {
        /// The variable.
        name: &'static str,
    },
    /// An environment variable has an invalid value.
    #[error("environment variable {name}=`{value}`: {reason}")]
    InvalidVar {
        /// The variable (possibly a fallback such as `OMPI_COMM_WORLD_RANK`).
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// The mesh does not have one rank per process.
    #[error("mesh {mesh} has {mesh_size} ranks but WORLD_SIZE is {world_size}")]
    MeshSize {
        /// The mesh, as text.
        mesh: String,
        /// Its world size.
        mesh_size: usize,
        /// The environment's world size.
        world_size: usize,
    },
    /// The rendezvous failed (store unreachable, timed out, inconsistent registrations).
    #[error("rendezvous at {addr}: {detail}")]
    Rendezvous {
        /// The store's address (`MASTER_ADDR:MASTER_PORT`).
        addr: String,
        /// What went wrong.
        detail: String,
    },
    /// Setting up the communicator of a mesh axis failed.
    #[error("rank {rank}: connecting mesh axis `{axis}` (global ranks {ranks:?}): {source}")]
    Connect {
        /// This rank.
        rank: usize,
        /// The mesh axis.
        axis: String,
        /// The global ranks of the group, in group order.
        ranks: Vec<usize>,
        /// The communicator's error (boxed to keep `LaunchError` small).
        #[source]
        source: Box<CommError>,
    },
    /// This rank's program failed (its groups were aborted).
    #[error("rank {rank} (mesh coordinates {coords}; groups {groups}): {error}")]
    Rank {
        /// This (global) rank.
        rank: usize,
        /// Its mesh coordinates, `dp=0,tp=1`.
        coords: String,
        /// Its group per axis as global ranks, `dp:[1,3] tp:[0,1]`, to decode the
        /// group-local ranks in the communicator's message.
        groups: String,
        /// The executor's error (shown in the message, not chained: it already carries the
        /// communicator's).
        error: Box<RuntimeError>,
    },
    /// The world barrier after the program failed (a peer failed or stalled).
    #[error("rank {rank} (mesh coordinates {coords}; groups {groups}): final barrier: {error}")]
    Barrier {
        /// This (global) rank.
        rank: usize,
        /// Its mesh coordinates.
        coords: String,
        /// Its groups, as in [`LaunchError::Rank`].
        groups: String,
        /// The communicator's error (in the message, not chained).
        error: Box<CommError>,
    },
    /// The launcher's arguments are invalid.
    #[error("{0}")]
    Config(String),
    /// A system call of the launcher or rendezvous failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A launched rank exited unsuccessfully; the launcher stopped the rest.
    #[error("rank {rank} failed ({status}){}", others_summary(others, killed))]
    RankExited {
        /// The first rank that failed.
        rank: usize,
        /// Its exit status, as the OS describes it.
        status: String,
        /// Ranks that failed after it, with their statuses, in exit order.
        others: Vec<(usize, String)>,
        /// Ranks still running after the grace period, killed by the launcher.
        killed: Vec<usize>,
    },
    /// The job ran longer than the launcher's timeout; the running ranks were killed.
    #[error("the job ran past its timeout of {timeout:?}; killed ranks {killed:?}")]
    JobTimeout {
        /// The timeout.
        timeout: Duration,
        /// Ranks killed.
        killed: Vec<usize>,
    },
    /// A communicator kind is not available in this build or on this machine.
    #[error("communicator `{kind}` is not available: {reason}")]
    Unavailable {
        /// The kind (`nccl`, ...).
        kind: String,
        /// Why.
        reason: String,
    },
    /// A collective failed outside a program (benchmarks).
    #[error(transparent)]
    Comm(Box<CommError>),
}

impl From<CommError> for LaunchError {
    fn from(e: CommError) -> Self {
        LaunchError::Comm(Box::new(e))
    }
}

fn others_summary(others: &[(usize, String)], killed: &[usize]) -> String {
    let mut s = String::new();
    for (rank, status) in others {
        s.push_str(&format!("; then rank {rank} failed ({status})"));
    }
    if !killed.is_empty() {
        s.push_str(&format!(
            "; ranks {killed:?} were still running after the grace period and were killed"
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    /// Every fallible launch call returns `Result<_, LaunchError>`: keep it small (large
    /// payloads are boxed).
    #[test]
    fn launch_error_stays_small() {
        assert!(std::mem::size_of::<super::LaunchError>() <= 96);
    }
}
