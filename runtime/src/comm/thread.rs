//! In-process communicator: every rank of a group is a thread of this process holding a
//! [`ThreadComm`] (made by [`group`]); ranks exchange messages through per-rank mailboxes, and
//! the collective algorithms of [`super::engine`] run over them (see there for the algorithms,
//! pre- and postconditions).
//!
//! - [`ThreadComm::abort`] makes the current or next wait of every rank return
//!   [`CommError::Aborted`]; dropping a handle makes waits on (and sends to) that rank return
//!   `Aborted` naming it, once the messages it sent are consumed.
//! - After a `Timeout` or `Aborted` error the group is out of step and cannot be reused: call
//!   `abort` (so the other ranks fail fast) and drop it.
//! - Misuse (buffer sizes, out-of-range root or peer) returns [`CommError::Size`] or
//!   [`CommError::BadPeer`] before any message is sent. Mismatched sizes across ranks are
//!   detected on receipt ([`CommError::Size`]) or end in a timeout. Nothing panics.

use super::engine::{communicator_via_engine, AbortCell, Engine, GroupInfo, Inbox, Op, Transport};
use super::{CommError, Communicator, ReduceOp};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

// ---------------------------------------------------------------------------------------------
// Public API: the in-process group.
// ---------------------------------------------------------------------------------------------

/// Creates the handles of one in-process group of `size` ranks named `name`: element `i` is
/// rank `i`. Move each handle to its own thread. Every wait for a peer gives up after `timeout`
/// with [`CommError::Timeout`]. `size == 0` gives no handles.
pub fn group(name: &str, size: usize, timeout: Duration) -> Vec<ThreadComm> {
    let aborted = Arc::new(AbortCell::default());
    let shared = Arc::new(Mailboxes {
        inboxes: (0..size)
            .map(|_| Inbox::sharing_abort(size, Arc::clone(&aborted)))
            .collect(),
        aborted,
    });
    (0..size)
        .map(|rank| ThreadComm {
            engine: Engine::new(ThreadLink {
                info: GroupInfo {
                    name: name.to_owned(),
                    rank,
                    size,
                    timeout,
                },
                shared: Arc::clone(&shared),
            }),
        })
        .collect()
}

/// One rank's handle on an in-process group (see the module docs for the algorithms and
/// guarantees). Dropping it tells the other ranks that this rank has left.
pub struct ThreadComm {
    engine: Engine<ThreadLink>,
}

impl ThreadComm {
    /// Aborts the whole group: the current or next wait of every rank (this one included)
    /// returns [`CommError::Aborted`] carrying `reason` and this rank, promptly rather than
    /// after the timeout. Call it when this rank fails. Idempotent; the first reason wins.
    pub fn abort(&self, reason: &str) {
        let link = self.engine.link();
        let why = format!("rank {} aborted: {reason}", link.info.rank);
        // Set once for everyone before waking anyone, so no rank sees a consequence of the
        // abort (another rank leaving) before the abort itself.
        link.shared.aborted.set(&why);
        for inbox in &link.shared.inboxes {
            inbox.wake();
        }
    }

    /// The group's timeout for each wait on a peer.
    pub fn timeout(&self) -> Duration {
        self.engine.link().info.timeout
    }
}

impl fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.engine.link().info.debug("ThreadComm", f)
    }
}

communicator_via_engine!(ThreadComm);

/// The mailboxes of an in-process group: `inboxes[r]` receives everything sent to rank `r`.
struct Mailboxes {
    inboxes: Vec<Inbox>,
    /// Shared by every inbox.
    aborted: Arc<AbortCell>,
}

/// The in-process transport: a send pushes a copy into the receiver's inbox (never blocks).
struct ThreadLink {
    info: GroupInfo,
    shared: Arc<Mailboxes>,
}

impl Transport for ThreadLink {
    fn info(&self) -> &GroupInfo {
        &self.info
    }
    fn inbox(&self) -> &Inbox {
        &self.shared.inboxes[self.info.rank]
    }
    fn deliver(&self, peer: usize, op: Op, data: &[f32]) -> Result<(), CommError> {
        let inbox = self.shared.inboxes.get(peer).ok_or(CommError::BadPeer {
            kind: op.kind,
            rank: self.info.rank,
            peer,
            size: self.info.size,
        })?;
        inbox.push(self.info.rank, op.tag(), data.to_vec());
        Ok(())
    }
}

impl Drop for ThreadLink {
    fn drop(&mut self) {
        let why = self.info.left_reason(self.info.rank);
        for (peer, inbox) in self.shared.inboxes.iter().enumerate() {
            if peer != self.info.rank {
                inbox.close(self.info.rank, &why);
            }
        }
    }
}
