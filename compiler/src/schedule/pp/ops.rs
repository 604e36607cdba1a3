//! The instructions of a pipeline rank: passes of a chunk and the transfers between chunks.

use super::{Phase, Slot};
use serde::{Deserialize, Serialize};
use std::fmt;

/// What crosses a chunk boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Carry {
    /// The residual stream of a micro-batch, chunk `b` → chunk `b + 1`.
    Act,
    /// Its gradient, chunk `b + 1` → chunk `b`.
    Grad,
    /// The gradient of a tied embedding's copy, from chunk `b` (the first or the last) to
    /// the other end, before their optimizer steps.
    Tied,
}

/// One instruction of a pipeline rank's program: the schedule's slots with the point-to-point
/// transfers around them. Boundary `b` lies between chunks `b` and `b + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PipeOp {
    /// Receive from pipeline rank `from` (blocking).
    Recv {
        /// Sending rank.
        from: usize,
        /// What.
        carry: Carry,
        /// Micro-batch.
        micro: usize,
        /// Boundary.
        boundary: usize,
    },
    /// Run a pass of a chunk.
    Run(Slot),
    /// Send to pipeline rank `to` (buffered: the sender goes on).
    Send {
        /// Receiving rank.
        to: usize,
        /// What.
        carry: Carry,
        /// Micro-batch.
        micro: usize,
        /// Boundary.
        boundary: usize,
    },
    /// The optimizer step of a chunk, after all its passes.
    Step {
        /// The chunk.
        chunk: usize,
    },
}

impl Carry {
    /// The chunk that receives this message across `boundary`, of `n` chunks (a tied
    /// gradient: the other end of the model).
    pub fn receiver(self, boundary: usize, n: usize) -> usize {
        match self {
            Carry::Act => boundary + 1,
            Carry::Grad => boundary,
            Carry::Tied if boundary == 0 => n - 1,
            Carry::Tied => 0,
        }
    }

    /// The chunk that sends this message across `boundary`.
    pub fn sender(self, boundary: usize) -> usize {
        match self {
            Carry::Act | Carry::Tied => boundary,
            Carry::Grad => boundary + 1,
        }
    }
}

impl PipeOp {
    /// The chunk (of `n`) whose program this instruction computes values of: a pass's or
    /// optimizer step's, a receive's receiving chunk, the sender of a tied gradient (which it
    /// completes first); `None` for other sends.
    pub fn chunk(&self, n: usize) -> Option<usize> {
        match *self {
            PipeOp::Recv {
                carry, boundary, ..
            } => Some(carry.receiver(boundary, n)),
            PipeOp::Run(s) => Some(s.chunk),
            PipeOp::Step { chunk } => Some(chunk),
            PipeOp::Send {
                carry: Carry::Tied,
                boundary,
                ..
            } => Some(boundary),
            PipeOp::Send { .. } => None,
        }
    }
}

impl PipeOp {
    /// What the instruction is, for traces: `forward`, `backward`, `weight-gradient`,
    /// `optimizer`, `send`, `recv`.
    pub fn category(&self) -> &'static str {
        match self {
            PipeOp::Run(s) => match s.phase {
                Phase::F => "forward",
                Phase::B => "backward",
                Phase::W => "weight-gradient",
            },
            PipeOp::Step { .. } => "optimizer",
            PipeOp::Send { .. } => "send",
            PipeOp::Recv { .. } => "recv",
        }
    }
}

impl fmt::Display for PipeOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = |c: &Carry| match c {
            Carry::Act => "activation",
            Carry::Grad => "gradient",
            Carry::Tied => "tied-embedding gradient",
        };
        match self {
            PipeOp::Recv {
                from,
                carry,
                micro,
                boundary,
            } => write!(
                f,
                "recv {} of micro-batch {micro} (boundary {boundary}) from rank {from}",
                what(carry)
            ),
            PipeOp::Send {
                to,
                carry,
                micro,
                boundary,
            } => write!(
                f,
                "send {} of micro-batch {micro} (boundary {boundary}) to rank {to}",
                what(carry)
            ),
            PipeOp::Run(s) => write!(f, "{s}"),
            PipeOp::Step { chunk } => write!(f, "optimizer step of chunk {chunk}"),
        }
    }
}
