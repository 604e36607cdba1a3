//! The transport-generic half of the host communicators: the internal [`Transport`] trait
//! (tagged point-to-point messages into an [`Inbox`]) and the collective algorithms written once
//! over it ([`Engine`]), shared by the `thread` and `tcp` transports:
//!
//! - `all_reduce`: ring reduce-scatter, then ring all-gather; the buffer is split into `size`
//!   balanced chunks (any length, including lengths below `size` and 0).
//! - `reduce_scatter`, `all_gather`: ring. `broadcast`, `reduce`: binary tree rooted at `root`.
//! - `gather`, `scatter`: direct to/from the root. `all_to_all`: pairwise exchange (step `s`
//!   sends to rank `r + s` and receives from rank `r - s`). `send`/`recv`: matched in order per
//!   (sender, receiver) pair.
//!
//! Preconditions: the ranks of a group call the same collectives in the same order with
//! matching sizes (see [`Communicator`]); a handle is used by one thread at a time (it is
//! `Send`, not `Sync`).
//!
//! Postconditions:
//! - Reductions are deterministic: the reduction order is fixed by the algorithm, so the same
//!   inputs give bit-identical outputs on every run, and `all_reduce` leaves bit-identical
//!   buffers on every rank (each chunk is reduced once, by its owner, then copied). Results may
//!   differ in the last bits from a sequential rank-order reduction.
//! - Every wait for a peer is bounded by the group timeout, giving [`CommError::Timeout`]
//!   naming the collective, its sequence number, this rank, the awaited rank and the group.

use super::{CollectiveKind, CommError, ReduceOp};
use std::cell::Cell;
use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Implements [`Communicator`] for a handle whose `engine` field (an `Engine` over its
/// transport) runs the algorithms; the thread and tcp handles share it.
macro_rules! communicator_via_engine {
    ($ty:ty) => {
        impl Communicator for $ty {
            fn rank(&self) -> usize {
                self.engine.rank()
            }
            fn size(&self) -> usize {
                self.engine.size()
            }
            fn name(&self) -> &str {
                self.engine.name()
            }
            fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
                self.engine.broadcast(buf, root)
            }
            fn reduce(
                &self,
                send: &[f32],
                recv: &mut [f32],
                op: ReduceOp,
                root: usize,
            ) -> Result<(), CommError> {
                self.engine.reduce(send, recv, op, root)
            }
            fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
                self.engine.all_reduce(buf, op)
            }
            fn gather(&self, send: &[f32], recv: &mut [f32], root: usize) -> Result<(), CommError> {
                self.engine.gather(send, recv, root)
            }
            fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
                self.engine.all_gather(send, recv)
            }
            fn scatter(
                &self,
                send: &[f32],
                recv: &mut [f32],
                root: usize,
            ) -> Result<(), CommError> {
                self.engine.scatter(send, recv, root)
            }
            fn reduce_scatter(
                &self,
                send: &[f32],
                recv: &mut [f32],
                op: ReduceOp,
            ) -> Result<(), CommError> {
                self.engine.reduce_scatter(send, recv, op)
            }
            fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
                self.engine.all_to_all(send, recv)
            }
            fn send(&self, buf: &[f32], peer: usize) -> Result<(), CommError> {
                self.engine.send(buf, peer)
            }
            fn recv(&self, buf: &mut [f32], peer: usize) -> Result<(), CommError> {
                self.engine.recv(buf, peer)
            }
        }
    };
}
pub(crate) use communicator_via_engine;

// ---------------------------------------------------------------------------------------------

/// Who this rank is, for routing and for errors.
pub(crate) struct GroupInfo {
    /// The group's name (its mesh axis).
    pub(crate) name: String,
    /// This rank.
    pub(crate) rank: usize,
    /// Number of ranks.
    pub(crate) size: usize,
    /// Bound on every wait for a peer.
    pub(crate) timeout: Duration,
}

impl GroupInfo {
    /// `CommError::Timeout` for `op` waiting on `peer`.
    pub(crate) fn timeout_err(&self, op: Op, peer: usize) -> CommError {
        CommError::Timeout {
            kind: op.kind,
            seq: op.seq,
            rank: self.rank,
            waiting_for: peer,
            group: self.name.clone(),
            timeout_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// `CommError::Aborted` for `op`.
    pub(crate) fn aborted_err(&self, op: Op, reason: String) -> CommError {
        CommError::Aborted {
            kind: op.kind,
            seq: op.seq,
            rank: self.rank,
            group: self.name.clone(),
            reason,
        }
    }

    /// Why waits on `peer` fail once it has dropped its handle.
    pub(crate) fn left_reason(&self, peer: usize) -> String {
        format!(
            "rank {peer} left group `{}` (its communicator was dropped)",
            self.name
        )
    }

    fn refused(&self, op: Op, peer: usize, refusal: Refusal) -> CommError {
        match refusal {
            Refusal::Timeout => self.timeout_err(op, peer),
            Refusal::Aborted(why) | Refusal::Left(why) => self.aborted_err(op, why),
        }
    }

    /// Shared `Debug` body of the public handles.
    pub(crate) fn debug(&self, ty: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(ty)
            .field("group", &self.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// One call of a collective (or one point-to-point message), for tagging and errors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Op {
    /// The collective.
    pub(crate) kind: CollectiveKind,
    /// Collectives: index of the collective in this group. Send/recv: index of the message on
    /// the (sender, receiver) pair.
    pub(crate) seq: u64,
}

impl Op {
    /// The tag its messages carry; a `recv` matches the `send` with the same index.
    pub(crate) fn tag(self) -> Tag {
        let kind = match self.kind {
            CollectiveKind::Recv => CollectiveKind::Send,
            k => k,
        };
        Tag {
            kind: kind as u8,
            seq: self.seq,
        }
    }
}

/// What a receive is matched on: the collective (as its discriminant) and its sequence number,
/// so a peer in another collective is never mistaken for this one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tag {
    /// `CollectiveKind as u8` of the sender's op.
    pub(crate) kind: u8,
    /// The sender's [`Op::seq`].
    pub(crate) seq: u64,
}

/// Why a wait or send was refused.
enum Refusal {
    Timeout,
    Aborted(String),
    Left(String),
}

/// A message waiting to be received.
struct Msg {
    tag: Tag,
    data: Vec<f32>,
}

/// Whether (and why) a group is aborted; the first reason wins.
#[derive(Default)]
pub(crate) struct AbortCell(Mutex<Option<String>>);

impl AbortCell {
    pub(super) fn set(&self, why: &str) {
        let mut cell = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        cell.get_or_insert_with(|| why.to_owned());
    }

    fn get(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// One rank's mailbox: a FIFO per source rank, whether each source has left, and the group's
/// abort state (shared by the inboxes of an in-process group). Producers are peer threads
/// (in-process) or socket reader threads (TCP).
pub(crate) struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
    /// Lock order: `state`, then `aborted` (never the reverse).
    aborted: Arc<AbortCell>,
}

struct InboxState {
    /// `queues[src]`: messages from `src`, in arrival order.
    queues: Vec<VecDeque<Msg>>,
    /// `left[src]`: `Some(why)` once `src` has left the group.
    left: Vec<Option<String>>,
}

impl Inbox {
    /// An empty inbox for a group of `size` ranks, with its own abort state.
    pub(crate) fn new(size: usize) -> Self {
        Inbox::sharing_abort(size, Arc::default())
    }

    /// An empty inbox whose abort state is `aborted`.
    pub(super) fn sharing_abort(size: usize, aborted: Arc<AbortCell>) -> Self {
        Inbox {
            state: Mutex::new(InboxState {
                queues: (0..size).map(|_| VecDeque::new()).collect(),
                left: vec![None; size],
            }),
            arrived: Condvar::new(),
            aborted,
        }
    }

    fn lock(&self) -> MutexGuard<'_, InboxState> {
        // Nothing panics while holding the lock, so a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `data` from `src`.
    pub(crate) fn push(&self, src: usize, tag: Tag, data: Vec<f32>) {
        let mut st = self.lock();
        if let Some(q) = st.queues.get_mut(src) {
            q.push_back(Msg { tag, data });
        }
        drop(st);
        self.arrived.notify_all();
    }

    /// Records that `src` has left: waits on it fail once its queued messages are consumed.
    pub(crate) fn close(&self, src: usize, why: &str) {
        let mut st = self.lock();
        if let Some(slot) = st.left.get_mut(src) {
            slot.get_or_insert_with(|| why.to_owned());
        }
        drop(st);
        self.arrived.notify_all();
    }

    /// Marks the group aborted (the first reason wins) and wakes the waiter.
    pub(crate) fn abort(&self, why: &str) {
        self.aborted.set(why);
        self.wake();
    }

    /// Wakes the waiter to re-check the abort state. Taking the lock first means a waiter
    /// either has not checked yet or is already waiting, so the wake-up is never lost.
    pub(super) fn wake(&self) {
        drop(self.lock());
        self.arrived.notify_all();
    }

    /// Whether a message may still be sent to `peer`.
    fn check_send(&self, peer: usize) -> Result<(), Refusal> {
        let st = self.lock();
        if let Some(why) = self.aborted.get() {
            return Err(Refusal::Aborted(why));
        }
        match st.left.get(peer) {
            Some(Some(why)) => Err(Refusal::Left(why.clone())),
            _ => Ok(()),
        }
    }

    /// Takes the first message from `src` tagged `tag`, waiting at most `timeout`.
    fn take(&self, src: usize, tag: Tag, timeout: Duration) -> Result<Vec<f32>, Refusal> {
        let deadline = Instant::now().checked_add(timeout);
        let mut st = self.lock();
        loop {
            if let Some(why) = self.aborted.get() {
                return Err(Refusal::Aborted(why));
            }
            if let Some(q) = st.queues.get_mut(src) {
                if let Some(msg) = q
                    .iter()
                    .position(|m| m.tag == tag)
                    .and_then(|i| q.remove(i))
                {
                    return Ok(msg.data);
                }
            }
            if let Some(Some(why)) = st.left.get(src) {
                return Err(Refusal::Left(why.clone()));
            }
            st = match deadline {
                None => self
                    .arrived
                    .wait(st)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Refusal::Timeout);
                    }
                    self.arrived
                        .wait_timeout(st, deadline - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }
}

/// Tagged point-to-point messages between the ranks of one group: the only thing a
/// communicator backend provides; the collectives are written once over it in [`Engine`].
pub(crate) trait Transport {
    /// This rank and its group.
    fn info(&self) -> &GroupInfo;
    /// Where messages to this rank arrive.
    fn inbox(&self) -> &Inbox;
    /// Hands `data` to `peer` tagged `op.tag()`. Must not wait for the peer to receive it
    /// (the algorithms send before they receive); may wait up to the timeout for buffer space.
    fn deliver(&self, peer: usize, op: Op, data: &[f32]) -> Result<(), CommError>;

    /// Sends `data` to `peer`, unless the group is aborted or `peer` has left.
    fn send_to(&self, peer: usize, op: Op, data: &[f32]) -> Result<(), CommError> {
        self.inbox()
            .check_send(peer)
            .map_err(|r| self.info().refused(op, peer, r))?;
        self.deliver(peer, op, data)
    }

    /// Receives the next message of `op` from `peer`, which must hold `len` elements.
    fn recv_from(&self, peer: usize, op: Op, len: usize) -> Result<Vec<f32>, CommError> {
        let info = self.info();
        let data = self
            .inbox()
            .take(peer, op.tag(), info.timeout)
            .map_err(|r| info.refused(op, peer, r))?;
        if data.len() != len {
            return Err(CommError::Size {
                kind: op.kind,
                rank: info.rank,
                detail: format!(
                    "received {} elements from rank {peer} where {len} were expected \
                     (#{}: do the ranks' buffer sizes differ?)",
                    data.len(),
                    op.seq
                ),
            });
        }
        Ok(data)
    }
}

/// The collectives over a [`Transport`], with argument checks and sequence numbers.
pub(crate) struct Engine<T> {
    link: T,
    /// Next collective's sequence number.
    seq: Cell<u64>,
    /// `sent[p]`: messages sent to `p` so far.
    sent: Vec<Cell<u64>>,
    /// `received[p]`: messages received from `p` so far.
    received: Vec<Cell<u64>>,
}

impl<T: Transport> Engine<T> {
    /// Wraps a transport.
    pub(crate) fn new(link: T) -> Self {
        let size = link.info().size;
        Engine {
            link,
            seq: Cell::new(0),
            sent: (0..size).map(|_| Cell::new(0)).collect(),
            received: (0..size).map(|_| Cell::new(0)).collect(),
        }
    }

    /// The transport.
    pub(crate) fn link(&self) -> &T {
        &self.link
    }

    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.link.info().rank
    }

    /// Number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.link.info().size
    }

    /// Group name.
    pub(crate) fn name(&self) -> &str {
        &self.link.info().name
    }

    /// Numbers a collective that passed its checks.
    fn start(&self, kind: CollectiveKind) -> Op {
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        Op { kind, seq }
    }

    /// Checks and numbers a collective between `root` and every rank: `root` is a rank and the
    /// root's `whole` buffer holds `size()` of every rank's `chunk`.
    fn start_rooted(
        &self,
        kind: CollectiveKind,
        root: usize,
        whole: (&str, usize),
        chunk: (&str, usize),
    ) -> Result<Op, CommError> {
        self.check_root(kind, root)?;
        if self.rank() == root {
            self.check_chunks(kind, whole, chunk)?;
        }
        Ok(self.start(kind))
    }

    /// Checks and numbers a point-to-point `kind` with `peer`, counted in `counts[peer]`.
    fn start_p2p(
        &self,
        kind: CollectiveKind,
        peer: usize,
        counts: &[Cell<u64>],
    ) -> Result<Op, CommError> {
        self.check_peer(kind, peer)?;
        let seq = counts[peer].get();
        counts[peer].set(seq + 1);
        Ok(Op { kind, seq })
    }

    fn check_root(&self, kind: CollectiveKind, root: usize) -> Result<(), CommError> {
        if root < self.size() {
            Ok(())
        } else {
            Err(self.bad_peer(kind, root))
        }
    }

    fn check_peer(&self, kind: CollectiveKind, peer: usize) -> Result<(), CommError> {
        if peer < self.size() && peer != self.rank() {
            Ok(())
        } else {
            Err(self.bad_peer(kind, peer))
        }
    }

    fn bad_peer(&self, kind: CollectiveKind, peer: usize) -> CommError {
        CommError::BadPeer {
            kind,
            rank: self.rank(),
            peer,
            size: self.size(),
        }
    }

    /// `Ok` when `len == chunk * size()`, else a `Size` error saying so.
    fn check_chunks(
        &self,
        kind: CollectiveKind,
        (what, len): (&str, usize),
        (chunk_name, chunk): (&str, usize),
    ) -> Result<(), CommError> {
        if chunk.checked_mul(self.size()) == Some(len) {
            return Ok(());
        }
        Err(CommError::Size {
            kind,
            rank: self.rank(),
            detail: format!(
                "{what} has {len} elements but must have {chunk_name}.len() ({chunk}) * \
                 group size ({}) elements",
                self.size()
            ),
        })
    }

    /// Binary tree from `root` (relative rank `v` receives from `(v - 1) / 2`, then sends to
    /// `2v + 1` and `2v + 2`).
    pub(crate) fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.check_root(CollectiveKind::Broadcast, root)?;
        let op = self.start(CollectiveKind::Broadcast);
        let tree = Tree::new(self.rank(), self.size(), root);
        if let Some(parent) = tree.parent() {
            buf.copy_from_slice(&self.link.recv_from(parent, op, buf.len())?);
        }
        for child in tree.children() {
            self.link.send_to(child, op, buf)?;
        }
        Ok(())
    }

    /// Binary tree towards `root` (each rank folds its children in, left then right).
    pub(crate) fn reduce(
        &self,
        send: &[f32],
        recv: &mut [f32],
        rop: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        let kind = CollectiveKind::Reduce;
        self.check_root(kind, root)?;
        if self.rank() == root && recv.len() != send.len() {
            return Err(CommError::Size {
                kind,
                rank: self.rank(),
                detail: format!(
                    "the root's recv has {} elements but send has {}",
                    recv.len(),
                    send.len()
                ),
            });
        }
        let op = self.start(kind);
        let tree = Tree::new(self.rank(), self.size(), root);
        let mut acc = send.to_vec();
        for child in tree.children() {
            let data = self.link.recv_from(child, op, acc.len())?;
            combine(rop, &mut acc, &data);
        }
        match tree.parent() {
            Some(parent) => self.link.send_to(parent, op, &acc),
            None => {
                finish(rop, self.size(), &mut acc);
                recv.copy_from_slice(&acc);
                Ok(())
            }
        }
    }

    /// Ring reduce-scatter over `size()` balanced chunks, then ring all-gather.
    pub(crate) fn all_reduce(&self, buf: &mut [f32], rop: ReduceOp) -> Result<(), CommError> {
        let op = self.start(CollectiveKind::AllReduce);
        let (rank, size, len) = (self.rank(), self.size(), buf.len());
        if size == 1 {
            return Ok(()); // Avg over one rank divides by 1.
        }
        let span = |c: usize| balanced(len, size, c);
        ring_reduce_scatter(&self.link, op, rop, buf, &span, 0)?;
        // Rank r now owns the fully reduced chunk r + 1.
        finish(rop, size, &mut buf[span((rank + 1) % size)]);
        ring_all_gather(&self.link, op, buf, &span, 1)
    }

    /// Each rank sends its chunk to the root.
    pub(crate) fn gather(
        &self,
        send: &[f32],
        recv: &mut [f32],
        root: usize,
    ) -> Result<(), CommError> {
        let (rank, m) = (self.rank(), send.len());
        let kind = CollectiveKind::Gather;
        let op = self.start_rooted(kind, root, ("recv", recv.len()), ("send", m))?;
        if rank != root {
            return self.link.send_to(root, op, send);
        }
        recv[rank * m..(rank + 1) * m].copy_from_slice(send);
        for peer in (0..self.size()).filter(|&p| p != root) {
            let data = self.link.recv_from(peer, op, m)?;
            recv[peer * m..(peer + 1) * m].copy_from_slice(&data);
        }
        Ok(())
    }

    /// Ring all-gather.
    pub(crate) fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let kind = CollectiveKind::AllGather;
        let (rank, m) = (self.rank(), send.len());
        self.check_chunks(kind, ("recv", recv.len()), ("send", m))?;
        let op = self.start(kind);
        recv[rank * m..(rank + 1) * m].copy_from_slice(send);
        ring_all_gather(&self.link, op, recv, &|c| c * m..(c + 1) * m, 0)
    }

    /// The root sends chunk i to rank i.
    pub(crate) fn scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        root: usize,
    ) -> Result<(), CommError> {
        let (rank, m) = (self.rank(), recv.len());
        let kind = CollectiveKind::Scatter;
        let op = self.start_rooted(kind, root, ("send", send.len()), ("recv", m))?;
        if rank != root {
            recv.copy_from_slice(&self.link.recv_from(root, op, m)?);
            return Ok(());
        }
        for peer in (0..self.size()).filter(|&p| p != root) {
            self.link
                .send_to(peer, op, &send[peer * m..(peer + 1) * m])?;
        }
        recv.copy_from_slice(&send[rank * m..(rank + 1) * m]);
        Ok(())
    }

    /// Ring reduce-scatter over `size()` chunks of `recv.len()`.
    pub(crate) fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        rop: ReduceOp,
    ) -> Result<(), CommError> {
        let kind = CollectiveKind::ReduceScatter;
        let (rank, size, m) = (self.rank(), self.size(), recv.len());
        self.check_chunks(kind, ("send", send.len()), ("recv", m))?;
        let op = self.start(kind);
        let mut work = send.to_vec();
        let span = |c: usize| c * m..(c + 1) * m;
        // Offset size - 1: rank r ends owning chunk r.
        ring_reduce_scatter(&self.link, op, rop, &mut work, &span, size - 1)?;
        recv.copy_from_slice(&work[span(rank)]);
        finish(rop, size, recv);
        Ok(())
    }

    /// Pairwise exchange: step s sends to rank r + s and receives from rank r - s.
    pub(crate) fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let kind = CollectiveKind::AllToAll;
        let (rank, size) = (self.rank(), self.size());
        if send.len() != recv.len() || send.len() % size != 0 {
            return Err(CommError::Size {
                kind,
                rank,
                detail: format!(
                    "send ({}) and recv ({}) must have the same number of elements, \
                     divisible by the group size ({size})",
                    send.len(),
                    recv.len()
                ),
            });
        }
        let op = self.start(kind);
        let m = send.len() / size;
        let span = |c: usize| c * m..(c + 1) * m;
        recv[span(rank)].copy_from_slice(&send[span(rank)]);
        for step in 1..size {
            let (to, from) = ((rank + step) % size, (rank + size - step) % size);
            self.link.send_to(to, op, &send[span(to)])?;
            recv[span(from)].copy_from_slice(&self.link.recv_from(from, op, m)?);
        }
        Ok(())
    }

    /// Point-to-point send; the k-th send to `peer` matches `peer`'s k-th receive from us.
    pub(crate) fn send(&self, buf: &[f32], peer: usize) -> Result<(), CommError> {
        let op = self.start_p2p(CollectiveKind::Send, peer, &self.sent)?;
        self.link.send_to(peer, op, buf)
    }

    /// Point-to-point receive of the next message from `peer`.
    pub(crate) fn recv(&self, buf: &mut [f32], peer: usize) -> Result<(), CommError> {
        let op = self.start_p2p(CollectiveKind::Recv, peer, &self.received)?;
        buf.copy_from_slice(&self.link.recv_from(peer, op, buf.len())?);
        Ok(())
    }
}

/// The binary tree of a rooted collective, in ranks relative to the root.
struct Tree {
    /// This rank relative to the root.
    v: usize,
    size: usize,
    root: usize,
}

impl Tree {
    fn new(rank: usize, size: usize, root: usize) -> Self {
        Tree {
            v: (rank + size - root) % size,
            size,
            root,
        }
    }

    fn real(&self, v: usize) -> usize {
        (v + self.root) % self.size
    }

    fn parent(&self) -> Option<usize> {
        (self.v > 0).then(|| self.real((self.v - 1) / 2))
    }

    fn children(&self) -> impl Iterator<Item = usize> + '_ {
        [2 * self.v + 1, 2 * self.v + 2]
            .into_iter()
            .filter(|&c| c < self.size)
            .map(|c| self.real(c))
    }
}

/// Chunk `c` of `len` elements split into `parts` chunks whose lengths differ by at most one
/// (the first `len % parts` chunks are one longer; chunks may be empty).
fn balanced(len: usize, parts: usize, c: usize) -> Range<usize> {
    let (q, rem) = (len / parts, len % parts);
    let start = c * q + c.min(rem);
    start..start + q + usize::from(c < rem)
}

/// Ring reduce-scatter of `buf` split by `span` into `size` chunks: at step `s` rank `r` sends
/// chunk `r + offset - s` to `r + 1` and folds chunk `r + offset - s - 1` received from
/// `r - 1` into its own. Afterwards rank `r` holds chunk `r + offset + 1` reduced over all ranks
/// (not yet divided for `Avg`); other chunks hold partial results.
fn ring_reduce_scatter<T: Transport>(
    link: &T,
    op: Op,
    rop: ReduceOp,
    buf: &mut [f32],
    span: &dyn Fn(usize) -> Range<usize>,
    offset: usize,
) -> Result<(), CommError> {
    ring(link, op, buf, span, offset, &|acc, data| {
        combine(rop, acc, data)
    })
}

/// Ring all-gather of `buf` split by `span` into `size` chunks, where rank `r` starts with
/// chunk `r + offset`: at step `s` it sends chunk `r + offset - s` to `r + 1` and stores chunk
/// `r + offset - s - 1` received from `r - 1`. Afterwards every rank has every chunk.
fn ring_all_gather<T: Transport>(
    link: &T,
    op: Op,
    buf: &mut [f32],
    span: &dyn Fn(usize) -> Range<usize>,
    offset: usize,
) -> Result<(), CommError> {
    ring(link, op, buf, span, offset, &|chunk, data| {
        chunk.copy_from_slice(data)
    })
}

/// The `size - 1` steps of a ring over `buf` split by `span` into `size` chunks: at step `s`
/// rank `r` sends chunk `r + offset - s` to `r + 1` and `merge`s chunk `r + offset - s - 1`
/// received from `r - 1` into its own.
fn ring<T: Transport>(
    link: &T,
    op: Op,
    buf: &mut [f32],
    span: &dyn Fn(usize) -> Range<usize>,
    offset: usize,
    merge: &dyn Fn(&mut [f32], &[f32]),
) -> Result<(), CommError> {
    let GroupInfo { rank, size, .. } = *link.info();
    let (left, right) = ((rank + size - 1) % size, (rank + 1) % size);
    for step in 0..size.saturating_sub(1) {
        let out = (rank + offset + size - step) % size;
        let inc = (rank + offset + 2 * size - step - 1) % size;
        link.send_to(right, op, &buf[span(out)])?;
        let data = link.recv_from(left, op, span(inc).len())?;
        merge(&mut buf[span(inc)], &data);
    }
    Ok(())
}

/// `acc[i] = acc[i] (op) other[i]`; `Avg` sums (see [`finish`]).
fn combine(rop: ReduceOp, acc: &mut [f32], other: &[f32]) {
    let pairs = acc.iter_mut().zip(other);
    match rop {
        ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(a, b)| *a += b),
        ReduceOp::Prod => pairs.for_each(|(a, b)| *a *= b),
        ReduceOp::Max => pairs.for_each(|(a, b)| *a = a.max(*b)),
        ReduceOp::Min => pairs.for_each(|(a, b)| *a = a.min(*b)),
    }
}

/// Turns a full reduction into the result: `Avg` divides the sum by the group size.
fn finish(rop: ReduceOp, size: usize, acc: &mut [f32]) {
    if rop == ReduceOp::Avg {
        let n = size as f32;
        acc.iter_mut().for_each(|a| *a /= n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_chunks_tile_the_buffer() {
        for len in [0, 1, 3, 7, 50] {
            for parts in 1..9 {
                let spans: Vec<_> = (0..parts).map(|c| balanced(len, parts, c)).collect();
                assert_eq!(spans[0].start, 0);
                assert_eq!(spans[parts - 1].end, len);
                for w in spans.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len() && w[0].len() <= w[1].len() + 1);
                }
            }
        }
    }

    #[test]
    fn tree_covers_every_rank_once() {
        for size in 1..10 {
            for root in 0..size {
                let mut parents = vec![0; size];
                for rank in 0..size {
                    for child in Tree::new(rank, size, root).children() {
                        parents[child] += 1;
                        assert_eq!(Tree::new(child, size, root).parent(), Some(rank));
                    }
                }
                assert_eq!(parents[root], 0);
                assert!((0..size).filter(|&r| r != root).all(|r| parents[r] == 1));
            }
        }
    }
}
