//! Communicators: the collectives of the NCCL API plus the textbook ones, over one group of
//! ranks (one mesh axis). Every rank of a group must call the same collectives in the same
//! order with the same sizes; implementations return [`CommError`] (never hang forever) when a
//! peer fails or stalls past the group's timeout. The device communicators (NCCL, local GPU)
//! live with the CUDA backend, in `cuda::comm`.

mod engine;
pub mod tcp;
pub mod thread;

use std::fmt;
use thiserror::Error;

/// Reduction operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Average (sum / group size).
    Avg,
}

/// Which collective, for error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectiveKind {
    /// broadcast
    Broadcast,
    /// reduce
    Reduce,
    /// all_reduce
    AllReduce,
    /// gather
    Gather,
    /// all_gather
    AllGather,
    /// scatter
    Scatter,
    /// reduce_scatter
    ReduceScatter,
    /// all_to_all
    AllToAll,
    /// send
    Send,
    /// recv
    Recv,
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Reduce => "reduce",
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::Gather => "gather",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Scatter => "scatter",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Send => "send",
            CollectiveKind::Recv => "recv",
        })
    }
}

/// A collective failed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CommError {
    /// Buffer sizes do not fit the collective.
    #[error("{kind} on rank {rank}: {detail}")]
    Size {
        /// Collective.
        kind: CollectiveKind,
        /// This rank (in the group).
        rank: usize,
        /// What is wrong.
        detail: String,
    },
    /// A peer rank or root index is out of range.
    #[error("{kind} on rank {rank}: peer/root {peer} is not in a group of {size}")]
    BadPeer {
        /// Collective.
        kind: CollectiveKind,
        /// This rank.
        rank: usize,
        /// Offending peer.
        peer: usize,
        /// Group size.
        size: usize,
    },
    /// A peer did not arrive in time (it died, hung, or called another collective).
    #[error("{kind} #{seq} on rank {rank} of group `{group}`: timed out after {timeout_ms} ms waiting for rank {waiting_for}")]
    Timeout {
        /// Collective.
        kind: CollectiveKind,
        /// Sequence number of the collective in this group (0-based).
        seq: u64,
        /// This rank.
        rank: usize,
        /// The rank it waited for (when known; else this rank).
        waiting_for: usize,
        /// The group's name (its mesh axis).
        group: String,
        /// The timeout.
        timeout_ms: u64,
    },
    /// The group was aborted because a peer failed.
    #[error("{kind} #{seq} on rank {rank} of group `{group}`: aborted: {reason}")]
    Aborted {
        /// Collective.
        kind: CollectiveKind,
        /// Sequence number.
        seq: u64,
        /// This rank.
        rank: usize,
        /// Group name.
        group: String,
        /// Why (the failing peer's error).
        reason: String,
    },
    /// Transport failure (sockets, NCCL, CUDA).
    #[error("{0}")]
    Transport(String),
}

/// One rank's handle on a group of ranks. All buffers are f32 (the CPU reference dtype).
///
/// Sizes: `all_gather`/`gather`: `recv.len() == send.len() * size()`; `reduce_scatter`/
/// `scatter`: `send.len() == recv.len() * size()`; `all_to_all`: `send.len() == recv.len()`,
/// divisible by `size()`, chunk j of `send` goes to rank j and chunk i of `recv` came from
/// rank i. Rooted collectives read/write the rooted buffer only on the root.
pub trait Communicator: Send {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// The group's name (its mesh axis), for errors.
    fn name(&self) -> &str;
    /// `buf` of `root` copied to every rank.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Reduction of every rank's `send` into `recv` on `root` (`recv` unused elsewhere).
    fn reduce(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError>;
    /// Reduction of every rank's `buf`, in place, on every rank.
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError>;
    /// Concatenation of every rank's `send` into `recv` on `root`.
    fn gather(&self, send: &[f32], recv: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Concatenation of every rank's `send` into `recv` on every rank.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;
    /// Chunk i of `send` on `root` into `recv` on rank i.
    fn scatter(&self, send: &[f32], recv: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Reduction of every rank's `send`; rank i keeps chunk i.
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp)
        -> Result<(), CommError>;
    /// Chunk j of `send` to rank j; chunk i of `recv` from rank i.
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;
    /// Point-to-point send to `peer`.
    fn send(&self, buf: &[f32], peer: usize) -> Result<(), CommError>;
    /// Point-to-point receive from `peer`.
    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<(), CommError>;
}
