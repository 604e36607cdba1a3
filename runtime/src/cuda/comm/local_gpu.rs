//! The `local-gpu` device communicator: N virtual ranks on one GPU, so a sharded plan runs and
//! is checked on a single device (NOTES-cuda.md §5.3, item 3).
//!
//! Each rank is a host thread with its own streams and buffers (one shared context). A
//! collective is two host rendezvous plus device work on the calling rank's stream:
//! 1. every rank posts its buffers and an event recorded on its stream ("my send is ready");
//! 2. each rank's stream waits for every peer's event, then computes *its own* result by
//!    reading the peers' send buffers directly: device-to-device copies for gathers,
//!    all-to-all and broadcast, and `shardc_kernels`' `reduce_accumulate`/`reduce_average`
//!    (in rank order, so every rank gets bit-identical sums) for reductions;
//! 3. every rank posts an event recorded after its reads ("done reading your buffers") and its
//!    stream waits for all of them, so no rank overwrites a send buffer a peer still reads.
//!
//! The host never blocks on the device. A rank that does not arrive within the timeout fails
//! the group: the waiting rank gets [`CommError::Timeout`] naming the missing rank, the others
//! [`CommError::Aborted`]. Reductions support `Sum` and `Avg` on f32 and bf16; i32 values move
//! but do not sum here (NCCL sums them).

use super::device::{
    check_peer, check_sizes, DeviceBuffer, DeviceCollective, DeviceCommunicator, DeviceDType,
};
use crate::comm::{CollectiveKind, CommError, ReduceOp};
use crate::cuda::ops::Launcher;
use crate::cuda::{CudaDevice, CudaError};
use cudarc::driver::{CudaEvent, CudaStream};
use shardc_kernels::KernelDType;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a rank posts in the first rendezvous of a collective.
#[derive(Clone)]
struct Post {
    kind: CollectiveKind,
    send: DeviceBuffer,
    recv: DeviceBuffer,
    root: usize,
    op: ReduceOp,
    ready: Arc<CudaEvent>,
}

#[derive(Clone)]
enum Msg {
    Post(Box<Post>),
    Done(Arc<CudaEvent>),
}

/// A point-to-point message: the sender's buffer and readiness, and where to reply.
struct Mail {
    buf: DeviceBuffer,
    ready: Arc<CudaEvent>,
    reply: Reply,
}

/// Where a receiver puts the event recorded after its copy.
type Reply = Arc<(Mutex<Option<Arc<CudaEvent>>>, Condvar)>;

#[derive(Default)]
struct State {
    arrived: usize,
    departed: usize,
    round: u64,
    slots: Vec<Option<Msg>>,
    aborted: Option<String>,
    mail: HashMap<(usize, usize), VecDeque<Mail>>,
}

struct Shared {
    name: String,
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One virtual rank's handle. `Send` (move it to the rank's thread), not `Sync`.
pub struct LocalGpuComm {
    shared: Arc<Shared>,
    rank: usize,
    dev: Arc<CudaDevice>,
    seq: Cell<u64>,
    pending: RefCell<VecDeque<(u64, CollectiveKind, CudaEvent, Instant)>>,
}

impl std::fmt::Debug for LocalGpuComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LocalGpuComm(`{}` rank {}/{})",
            self.shared.name, self.rank, self.shared.size
        )
    }
}

/// `size` connected handles of a group named `name` (a mesh axis) on `dev`; give handle i to
/// rank i's thread.
pub fn group(
    dev: &Arc<CudaDevice>,
    name: &str,
    size: usize,
    timeout: Duration,
) -> Vec<LocalGpuComm> {
    let shared = Arc::new(Shared {
        name: name.to_string(),
        size,
        timeout,
        state: Mutex::new(State {
            slots: vec![None; size],
            ..State::default()
        }),
        cv: Condvar::new(),
    });
    (0..size)
        .map(|rank| LocalGpuComm {
            shared: shared.clone(),
            rank,
            dev: dev.clone(),
            seq: Cell::new(0),
            pending: RefCell::new(VecDeque::new()),
        })
        .collect()
}

fn transport(what: &str) -> impl Fn(CudaError) -> CommError + '_ {
    move |e| CommError::Transport(format!("local-gpu {what}: {e}"))
}

impl LocalGpuComm {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking rank thread poisons the lock; the state itself stays consistent.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn aborted(&self, kind: CollectiveKind, seq: u64, reason: &str) -> CommError {
        CommError::Aborted {
            kind,
            seq,
            rank: self.rank,
            group: self.shared.name.clone(),
            reason: reason.to_string(),
        }
    }

    /// Waits on the condvar until `done(state)` or the deadline; on timeout the group is
    /// aborted and `Err(waiting_for)` names a rank that did not arrive.
    fn wait_until<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        deadline: Instant,
        done: impl Fn(&State) -> bool,
        missing: impl Fn(&State) -> usize,
    ) -> Result<MutexGuard<'a, State>, (MutexGuard<'a, State>, usize)> {
        while !done(&st) && st.aborted.is_none() {
            let now = Instant::now();
            if now >= deadline {
                let m = missing(&st);
                return Err((st, m));
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(st)
    }

    /// Every rank contributes `msg` and receives all ranks' messages (a host all-gather).
    fn exchange(&self, msg: Msg, kind: CollectiveKind, seq: u64) -> Result<Vec<Msg>, CommError> {
        let n = self.shared.size;
        let deadline = Instant::now() + self.shared.timeout;
        let timeout = |st: &mut State, waiting_for: usize| {
            let reason = format!(
                "rank {} timed out in {kind} #{seq} waiting for rank {waiting_for}",
                self.rank
            );
            st.aborted.get_or_insert(reason);
            self.shared.cv.notify_all();
            self.timed_out(kind, seq, waiting_for)
        };
        // Wait for the previous round to drain (everyone has read its result).
        let st = self.lock();
        let mut st = match self.wait_until(st, deadline, |s| s.arrived < n, |_| self.rank) {
            Ok(st) => st,
            Err((mut st, m)) => return Err(timeout(&mut st, m)),
        };
        if let Some(r) = &st.aborted {
            return Err(self.aborted(kind, seq, r));
        }
        st.slots[self.rank] = Some(msg);
        st.arrived += 1;
        let round = st.round;
        if st.arrived == n {
            self.shared.cv.notify_all();
        }
        let missing = |s: &State| s.slots.iter().position(Option::is_none).unwrap_or(0);
        let mut st = match self.wait_until(
            st,
            deadline,
            |s| s.round == round && s.arrived == n,
            missing,
        ) {
            Ok(st) => st,
            Err((mut st, m)) => return Err(timeout(&mut st, m)),
        };
        if let Some(r) = &st.aborted {
            return Err(self.aborted(kind, seq, r));
        }
        let all: Vec<Msg> = st
            .slots
            .iter()
            .map(|m| m.clone().expect("invariant: every rank posted this round"))
            .collect();
        st.departed += 1;
        if st.departed == n {
            st.arrived = 0;
            st.departed = 0;
            st.round += 1;
            st.slots.iter_mut().for_each(|s| *s = None);
            self.shared.cv.notify_all();
        }
        Ok(all)
    }

    fn record(&self, stream: &CudaStream) -> Result<CudaEvent, CommError> {
        stream
            .record_event(None)
            .map_err(|e| CommError::Transport(format!("local-gpu record event: {e}")))
    }

    fn wait(&self, stream: &CudaStream, ev: &CudaEvent) -> Result<(), CommError> {
        stream
            .wait(ev)
            .map_err(|e| CommError::Transport(format!("local-gpu wait event: {e}")))
    }

    /// The whole protocol of one collective (module docs); `work` does this rank's part given
    /// every rank's post.
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        kind: CollectiveKind,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        root: usize,
        op: ReduceOp,
        stream: &CudaStream,
        work: impl FnOnce(&Launcher, &[Post]) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let (rank, n) = (self.rank, self.shared.size);
        check_sizes(kind, rank, n, &send, &recv)?;
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        let ready = Arc::new(self.record(stream)?);
        let post = Post {
            kind,
            send,
            recv,
            root,
            op,
            ready,
        };
        let posts: Vec<Post> = self
            .exchange(Msg::Post(Box::new(post)), kind, seq)?
            .into_iter()
            .map(|m| match m {
                Msg::Post(p) => *p,
                Msg::Done(_) => unreachable!("invariant: round 1 carries posts"),
            })
            .collect();
        for (j, p) in posts.iter().enumerate() {
            if p.kind != kind
                || p.send.len != send.len
                || p.recv.len != recv.len
                || p.send.dtype != send.dtype
                || p.root != root
                || p.op != op
            {
                return Err(CommError::Size {
                    kind,
                    rank,
                    detail: format!(
                        "rank {j} called {} with {} {} elements (root {}, {:?}) but this rank {kind} with {} {} (root {root}, {op:?})",
                        p.kind, p.send.len, p.send.dtype, p.root, p.op, send.len, send.dtype
                    ),
                });
            }
            if j != rank {
                self.wait(stream, &p.ready)?;
            }
        }
        let l = Launcher::new(&self.dev, stream);
        work(&l, &posts)?;
        let done = Arc::new(self.record(stream)?);
        let dones = self.exchange(Msg::Done(done), kind, seq)?;
        for (j, m) in dones.iter().enumerate() {
            if let (true, Msg::Done(e)) = (j != rank, m) {
                self.wait(stream, e)?;
            }
        }
        let end = self.record(stream)?;
        self.pending
            .borrow_mut()
            .push_back((seq, kind, end, Instant::now()));
        Ok(())
    }

    /// A reduction `kind` (all-reduce, reduce-scatter): `recv` = the reduction of
    /// `part(send_j)` over every rank j.
    fn reduction(
        &self,
        kind: CollectiveKind,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        op: ReduceOp,
        stream: &CudaStream,
        part: impl Fn(DeviceBuffer) -> DeviceBuffer,
    ) -> Result<(), CommError> {
        let rank = self.rank;
        self.collective(kind, send, recv, 0, op, stream, |l, posts| {
            let srcs: Vec<DeviceBuffer> = posts.iter().map(|p| part(p.send)).collect();
            Self::reduce_into(l, op, recv, &srcs, kind, rank)
        })
    }

    /// Chunk j (of `c` elements) of `recv` = `part(send_j)`, for every rank j.
    fn gather_chunks(
        l: &Launcher,
        recv: DeviceBuffer,
        c: usize,
        posts: &[Post],
        part: impl Fn(DeviceBuffer) -> DeviceBuffer,
    ) -> Result<(), CommError> {
        for (j, p) in posts.iter().enumerate() {
            let (dst, src) = (recv.sub(j * c, c), part(p.send));
            l.copy(dst.ptr, src.ptr, dst.bytes())
                .map_err(transport("copy"))?;
        }
        Ok(())
    }

    /// `out = Σ_j src_j` (in rank order), or the average; `srcs` never overlap `out`.
    fn reduce_into(
        l: &Launcher,
        op: ReduceOp,
        out: DeviceBuffer,
        srcs: &[DeviceBuffer],
        kind: CollectiveKind,
        rank: usize,
    ) -> Result<(), CommError> {
        let dt = match out.dtype {
            DeviceDType::F32 => KernelDType::F32,
            DeviceDType::Bf16 => KernelDType::Bf16,
            other => {
                return Err(CommError::Transport(format!(
                "local-gpu {kind} on rank {rank}: {other} reductions are not supported (f32, bf16)"
            )))
            }
        };
        if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            return Err(CommError::Transport(format!(
                "local-gpu {kind} on rank {rank}: {op:?} is not supported (Sum, Avg)"
            )));
        }
        for s in srcs {
            let disjoint =
                s.ptr + s.bytes() as u64 <= out.ptr || out.ptr + out.bytes() as u64 <= s.ptr;
            if !disjoint {
                return Err(CommError::Size {
                    kind,
                    rank,
                    detail: "in-place reductions are not supported by local-gpu".into(),
                });
            }
        }
        let n = srcs.len();
        l.copy(out.ptr, srcs[0].ptr, out.bytes())
            .map_err(transport("copy"))?;
        for (j, s) in srcs.iter().enumerate().skip(1) {
            if op == ReduceOp::Avg && j == n - 1 {
                l.average(dt, out.ptr, s.ptr, out.len, 1.0 / n as f32)
            } else {
                l.accumulate(dt, out.ptr, s.ptr, out.len)
            }
            .map_err(transport("reduce"))?;
        }
        Ok(())
    }

    /// This rank waited longer than the timeout for `waiting_for` in `kind` #`seq`.
    fn timed_out(&self, kind: CollectiveKind, seq: u64, waiting_for: usize) -> CommError {
        CommError::Timeout {
            kind,
            seq,
            rank: self.rank,
            waiting_for,
            group: self.shared.name.clone(),
            timeout_ms: self.shared.timeout.as_millis() as u64,
        }
    }

    fn check_peer(&self, kind: CollectiveKind, peer: usize) -> Result<(), CommError> {
        if peer < self.shared.size && peer != self.rank {
            Ok(())
        } else {
            Err(CommError::BadPeer {
                kind,
                rank: self.rank,
                peer,
                size: self.shared.size,
            })
        }
    }

    /// Posts `buf` (ready once `stream` reaches this point) for `peer`; returns where the
    /// receiver's "copied" event will arrive.
    fn post_mail(
        &self,
        kind: CollectiveKind,
        buf: DeviceBuffer,
        peer: usize,
        stream: &CudaStream,
    ) -> Result<Reply, CommError> {
        let reply: Reply = Arc::new((Mutex::new(None), Condvar::new()));
        let ready = Arc::new(self.record(stream)?);
        let mut st = self.lock();
        if let Some(r) = &st.aborted {
            return Err(self.aborted(kind, self.seq.get(), r));
        }
        st.mail
            .entry((self.rank, peer))
            .or_default()
            .push_back(Mail {
                buf,
                ready,
                reply: reply.clone(),
            });
        self.shared.cv.notify_all();
        Ok(reply)
    }

    /// Waits (host) for the receiver's "copied" event, then orders `stream` after it, so the
    /// sent buffer is not rewritten before the copy.
    fn await_reply(
        &self,
        kind: CollectiveKind,
        reply: &Reply,
        peer: usize,
        stream: &CudaStream,
    ) -> Result<(), CommError> {
        let deadline = Instant::now() + self.shared.timeout;
        let (lock, cv) = &**reply;
        let mut got = lock.lock().unwrap_or_else(|p| p.into_inner());
        while got.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out(kind, self.seq.get(), peer));
            }
            got = cv
                .wait_timeout(got, (deadline - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if got.is_none() {
                if let Some(r) = &self.lock().aborted {
                    return Err(self.aborted(kind, self.seq.get(), r));
                }
            }
        }
        let done = got.take().expect("invariant: checked above");
        self.wait(stream, &done)
    }

    /// Waits (host) for mail from `peer`, copies it into `buf` on `stream` after the sender's
    /// ready event, and replies with an event recorded after the copy.
    fn take_mail(
        &self,
        kind: CollectiveKind,
        buf: DeviceBuffer,
        peer: usize,
        stream: &CudaStream,
    ) -> Result<(), CommError> {
        let deadline = Instant::now() + self.shared.timeout;
        let st = self.lock();
        let has_mail = |s: &State| {
            s.mail
                .get(&(peer, self.rank))
                .is_some_and(|q| !q.is_empty())
        };
        let mut st = match self.wait_until(st, deadline, has_mail, |_| peer) {
            Ok(st) => st,
            Err(_) => return Err(self.timed_out(kind, self.seq.get(), peer)),
        };
        if let Some(r) = &st.aborted {
            return Err(self.aborted(kind, self.seq.get(), r));
        }
        let mail = st
            .mail
            .get_mut(&(peer, self.rank))
            .and_then(VecDeque::pop_front)
            .expect("invariant: waited for mail");
        drop(st);
        if mail.buf.len != buf.len || mail.buf.dtype != buf.dtype {
            return Err(CommError::Size {
                kind,
                rank: self.rank,
                detail: format!(
                    "rank {peer} sent {} {} elements, this rank expects {} {}",
                    mail.buf.len, mail.buf.dtype, buf.len, buf.dtype
                ),
            });
        }
        self.wait(stream, &mail.ready)?;
        let l = Launcher::new(&self.dev, stream);
        l.copy(buf.ptr, mail.buf.ptr, buf.bytes())
            .map_err(transport("copy"))?;
        let done = Arc::new(self.record(stream)?);
        let (lock, cv) = &*mail.reply;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = Some(done);
        cv.notify_all();
        Ok(())
    }
}

impl DeviceCommunicator for LocalGpuComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn kind(&self) -> &'static str {
        "local-gpu"
    }

    unsafe fn enqueue(&self, c: DeviceCollective, stream: &CudaStream) -> Result<(), CommError> {
        let (kind, rank, n) = (c.kind(), self.rank, self.shared.size);
        match c {
            DeviceCollective::AllReduce { send, recv, op } => {
                self.reduction(kind, send, recv, op, stream, |s| s)
            }
            DeviceCollective::ReduceScatter { send, recv, op } => {
                let c = recv.len;
                self.reduction(kind, send, recv, op, stream, |s| s.sub(rank * c, c))
            }
            DeviceCollective::AllGather { send, recv } => {
                self.collective(kind, send, recv, 0, ReduceOp::Sum, stream, |l, posts| {
                    Self::gather_chunks(l, recv, send.len, posts, |s| s)
                })
            }
            DeviceCollective::AllToAll { send, recv } => {
                self.collective(kind, send, recv, 0, ReduceOp::Sum, stream, |l, posts| {
                    let c = send.len / n;
                    Self::gather_chunks(l, recv, c, posts, |s| s.sub(rank * c, c))
                })
            }
            DeviceCollective::Broadcast { send, recv, root } => {
                check_peer(kind, rank, root, n)?;
                self.collective(kind, send, recv, root, ReduceOp::Sum, stream, |l, posts| {
                    l.copy(recv.ptr, posts[root].send.ptr, recv.bytes())
                        .map_err(transport("copy"))
                })
            }
            DeviceCollective::Send { .. }
            | DeviceCollective::Recv { .. }
            | DeviceCollective::SendRecv { .. } => {
                let (out, inp) = c.transfers();
                for (_, peer) in out.iter().chain(&inp) {
                    self.check_peer(kind, *peer)?;
                }
                // Post first, then receive: every rank of a ring posts before it blocks, so
                // the receives all find their mail.
                let reply = match out {
                    Some((buf, to)) => Some((self.post_mail(kind, buf, to, stream)?, to)),
                    None => None,
                };
                if let Some((buf, from)) = inp {
                    self.take_mail(kind, buf, from, stream)?;
                }
                match reply {
                    Some((reply, to)) => self.await_reply(kind, &reply, to, stream),
                    None => Ok(()),
                }
            }
        }
    }

    fn poll(&self) -> Result<bool, CommError> {
        if let Some(r) = &self.lock().aborted {
            return Err(self.aborted(CollectiveKind::AllReduce, self.seq.get(), r));
        }
        let mut pending = self.pending.borrow_mut();
        while let Some((seq, kind, ev, issued)) = pending.front() {
            match ev.try_is_complete() {
                Ok(true) => {
                    pending.pop_front();
                }
                Ok(false) if issued.elapsed() > self.shared.timeout => {
                    return Err(self.timed_out(*kind, *seq, self.rank))
                }
                Ok(false) => break,
                Err(e) => {
                    return Err(CommError::Transport(format!(
                        "local-gpu {kind} #{seq} on rank {}: {e}",
                        self.rank
                    )))
                }
            }
        }
        Ok(pending.is_empty())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.lock();
        st.aborted.get_or_insert_with(|| reason.to_string());
        self.shared.cv.notify_all();
    }
}
