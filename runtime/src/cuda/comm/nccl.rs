//! The `nccl` device communicator: cudarc's raw NCCL bindings, one communicator per mesh axis.
//!
//! Setup: one process (or, for tests, one thread) per GPU rank. Rank 0 creates an
//! [`NcclId`] and ships its 128 bytes to the others (the launcher's rendezvous does this);
//! every rank calls [`NcclComm::init`] for the world, then [`NcclComm::for_mesh`] splits it
//! (`ncclCommSplit`, color = the rank's group on the axis, key = its coordinate) into one
//! communicator per mesh axis.
//!
//! Every communicator is created non-blocking (`config.blocking = 0`): each NCCL call that
//! reports `ncclInProgress` is polled with `ncclCommGetAsyncError` up to the timeout, and each
//! enqueued collective records an event that [`DeviceCommunicator::poll`] checks. A call that
//! stays in progress or a collective that does not complete within the timeout aborts the
//! communicator (`ncclCommAbort`) and fails with [`CommError::Timeout`] naming the rank, the
//! collective, its sequence number and the axis. cudarc's `NcclError` has no `Display`; it is
//! wrapped in [`NcclCallError`].
//!
//! Library: cudarc looks for `libnccl.so` (not the wheel's `libnccl.so.2`); see
//! NOTES-cuda.md §1.3. Several ranks on one GPU need NCCL ≥ 2.30 with
//! `NCCL_MULTI_RANK_GPU_ENABLE=1` (§5.2).

use super::device::{
    check_peer, check_sizes, DeviceBuffer, DeviceCollective, DeviceCommunicator, DeviceDType,
    Transfer,
};
use crate::comm::{CollectiveKind, CommError, ReduceOp};
use crate::cuda::{CudaDevice, CudaError};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::result as nres;
use cudarc::nccl::sys as nsys;
use shardc_compiler::shard::Mesh;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::ffi::{c_void, CStr};
use std::mem::MaybeUninit;
use std::panic::catch_unwind;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A failed NCCL call (cudarc's `NcclError`, which has no `Display`, with its error string).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NCCL {call} failed: {code:?} ({text})")]
pub struct NcclCallError {
    /// The NCCL function.
    pub call: &'static str,
    /// NCCL's result code.
    pub code: nsys::ncclResult_t,
    /// `ncclGetErrorString` of the code.
    pub text: String,
}

impl NcclCallError {
    fn new(call: &'static str, code: nsys::ncclResult_t) -> NcclCallError {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string (or null).
        let text = unsafe {
            let p = nsys::ncclGetErrorString(code);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        NcclCallError { call, code, text }
    }
}

impl From<NcclCallError> for CommError {
    fn from(e: NcclCallError) -> CommError {
        CommError::Transport(e.to_string())
    }
}

/// The NCCL version code (`23007` for 2.30.7), probing for `libnccl.so` first.
pub fn nccl_version() -> Result<i32, CudaError> {
    // SAFETY: a `dlopen` probe only.
    if !unsafe { nsys::is_culib_present() } {
        return Err(CudaError::MissingLibrary {
            library: "libnccl",
            hint: "cudarc loads libnccl.so: symlink the wheel's libnccl.so.2 to libnccl.so on LD_LIBRARY_PATH (NOTES-cuda.md §1.3)",
        });
    }
    match catch_unwind(nres::get_nccl_version) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(CudaError::NoDevice {
            reason: NcclCallError::new("ncclGetVersion", e.0).to_string(),
        }),
        Err(_) => Err(CudaError::MissingLibrary {
            library: "libnccl",
            hint: "cudarc could not load an NCCL symbol (version mismatch?)",
        }),
    }
}

/// An `ncclUniqueId`: 128 bytes rank 0 creates and every rank passes to [`NcclComm::init`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({:02x?}..)", &self.0[..8])
    }
}

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`; works without a GPU when libnccl is present).
    pub fn new() -> Result<NcclId, CudaError> {
        nccl_version()?;
        let id = catch_unwind(nres::get_uniqueid)
            .map_err(|_| CudaError::MissingLibrary {
                library: "libnccl",
                hint: "cudarc could not load ncclGetUniqueId",
            })?
            .map_err(|e| CudaError::NoDevice {
                reason: NcclCallError::new("ncclGetUniqueId", e.0).to_string(),
            })?;
        let mut bytes = [0u8; 128];
        for (b, c) in bytes.iter_mut().zip(id.internal.iter()) {
            *b = *c as u8;
        }
        Ok(NcclId(bytes))
    }

    /// The id rank 0 sent through the launcher's rendezvous (its bootstrap bytes): exactly
    /// 128 bytes, else a named error (a rank 0 that sent no NCCL id, or another program).
    pub fn from_bootstrap(bytes: &[u8]) -> Result<NcclId, CudaError> {
        let id: [u8; 128] = bytes.try_into().map_err(|_| CudaError::NoDevice {
            reason: format!(
                "rank 0 sent {} bootstrap bytes through the rendezvous, not a 128-byte NCCL \
                 unique id: do all ranks run `--backend cuda`?",
                bytes.len()
            ),
        })?;
        Ok(NcclId(id))
    }

    fn raw(&self) -> nsys::ncclUniqueId {
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(self.0.iter()) {
            *c = *b as std::ffi::c_char;
        }
        nsys::ncclUniqueId { internal }
    }
}

/// `NCCL_CONFIG_INITIALIZER` of the 2.30 header with `blocking = 0`.
fn nonblocking_config() -> nsys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    nsys::ncclConfig_t {
        size: std::mem::size_of::<nsys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 2 * 10_000 + 30 * 100, // NCCL_VERSION(2, 30, 0): the bindings' header
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// A collective enqueued and not yet seen complete.
struct Pending {
    seq: u64,
    kind: CollectiveKind,
    event: CudaEvent,
    issued: Instant,
}

/// One rank's NCCL communicator over one group (the world, or a mesh axis). Not `Send`: use
/// it on the thread that created it.
pub struct NcclComm {
    comm: nsys::ncclComm_t,
    ctx: Arc<CudaContext>,
    rank: usize,
    size: usize,
    name: String,
    timeout: Duration,
    seq: Cell<u64>,
    pending: RefCell<VecDeque<Pending>>,
    failed: RefCell<Option<CommError>>,
    aborted: Cell<bool>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(`{}` rank {}/{})",
            self.name, self.rank, self.size
        )
    }
}

fn nccl_type(d: DeviceDType) -> nsys::ncclDataType_t {
    match d {
        DeviceDType::F32 => nsys::ncclDataType_t::ncclFloat32,
        DeviceDType::Bf16 => nsys::ncclDataType_t::ncclBfloat16,
        DeviceDType::F16 => nsys::ncclDataType_t::ncclFloat16,
        DeviceDType::I32 => nsys::ncclDataType_t::ncclInt32,
    }
}

fn nccl_op(op: ReduceOp) -> nsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nsys::ncclRedOp_t::ncclSum,
        ReduceOp::Prod => nsys::ncclRedOp_t::ncclProd,
        ReduceOp::Max => nsys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => nsys::ncclRedOp_t::ncclMin,
        ReduceOp::Avg => nsys::ncclRedOp_t::ncclAvg,
    }
}

fn ok_or_progress(r: nsys::ncclResult_t) -> bool {
    matches!(
        r,
        nsys::ncclResult_t::ncclSuccess | nsys::ncclResult_t::ncclInProgress
    )
}

impl NcclComm {
    /// Joins the world communicator as `rank` of `size` (`ncclCommInitRankConfig`,
    /// non-blocking), on `dev`, named `name`. Every rank must call it with the same `id`.
    pub fn init(
        dev: &CudaDevice,
        rank: usize,
        size: usize,
        id: NcclId,
        name: &str,
        timeout: Duration,
    ) -> Result<NcclComm, CudaError> {
        nccl_version()?;
        let ctx = dev.context().clone();
        ctx.bind_to_thread()
            .map_err(CudaError::driver("bind context for NCCL"))?;
        let mut config = nonblocking_config();
        let mut raw = MaybeUninit::<nsys::ncclComm_t>::zeroed();
        // SAFETY: out-pointer to a live local; the config is a fully initialised struct of the
        // bindings' layout; rank/size fit in i32 (checked by the casts' callers: mesh sizes).
        let r = unsafe {
            nsys::ncclCommInitRankConfig(
                raw.as_mut_ptr(),
                size as i32,
                id.raw(),
                rank as i32,
                &mut config,
            )
        };
        // SAFETY: zero-initialised above; NCCL writes the handle before returning.
        let comm = unsafe { raw.assume_init() };
        let c = NcclComm::wrap(comm, ctx, rank, size, name, timeout);
        if !ok_or_progress(r) {
            let e: CommError = NcclCallError::new("ncclCommInitRankConfig", r).into();
            return Err(comm_err(c.fail(e)));
        }
        c.wait_ready(CollectiveKind::Broadcast, 0, "ncclCommInitRankConfig")
            .map_err(comm_err)?;
        Ok(c)
    }

    fn wrap(
        comm: nsys::ncclComm_t,
        ctx: Arc<CudaContext>,
        rank: usize,
        size: usize,
        name: &str,
        timeout: Duration,
    ) -> NcclComm {
        NcclComm {
            comm,
            ctx,
            rank,
            size,
            name: name.to_string(),
            timeout,
            seq: Cell::new(0),
            pending: RefCell::new(VecDeque::new()),
            failed: RefCell::new(None),
            aborted: Cell::new(comm.is_null()),
        }
    }

    /// A sub-communicator of the ranks that pass the same `color`, ordered by `key`
    /// (`ncclCommSplit`, non-blocking). Collective over this communicator: every rank calls
    /// it, in the same order.
    pub fn split(&self, name: &str, color: usize, key: usize) -> Result<NcclComm, CommError> {
        self.check_failed()?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| CommError::Transport(format!("bind context: {e}")))?;
        let mut config = nonblocking_config();
        let mut raw = MaybeUninit::<nsys::ncclComm_t>::zeroed();
        // SAFETY: live parent communicator; out-pointer and config are live locals.
        let r = unsafe {
            nsys::ncclCommSplit(
                self.comm,
                color as i32,
                key as i32,
                raw.as_mut_ptr(),
                &mut config,
            )
        };
        if !ok_or_progress(r) {
            return Err(NcclCallError::new("ncclCommSplit", r).into());
        }
        self.wait_ready(CollectiveKind::Broadcast, 0, "ncclCommSplit (parent)")?;
        // SAFETY: zero-initialised; NCCL writes the handle (null when the rank is excluded).
        let comm = unsafe { raw.assume_init() };
        if comm.is_null() {
            return Err(CommError::Transport(format!(
                "ncclCommSplit of `{}` gave rank {} no communicator",
                self.name, self.rank
            )));
        }
        let mut c = NcclComm::wrap(comm, self.ctx.clone(), 0, 0, name, self.timeout);
        c.wait_ready(CollectiveKind::Broadcast, 0, "ncclCommSplit")?;
        // SAFETY: `comm` is a live, initialised communicator.
        let (size, rank) = unsafe { (nres::comm_count(comm), nres::comm_user_rank(comm)) };
        let size = size.map_err(|e| c.fail(NcclCallError::new("ncclCommCount", e.0).into()))?;
        let rank = rank.map_err(|e| c.fail(NcclCallError::new("ncclCommUserRank", e.0).into()))?;
        c.size = size as usize;
        c.rank = rank as usize;
        Ok(c)
    }

    /// One communicator per axis of `mesh` for this world rank, in the mesh's axis order.
    /// `self` must be the world communicator (rank = the mesh rank).
    pub fn for_mesh(&self, mesh: &Mesh) -> Result<Vec<(String, NcclComm)>, CommError> {
        let mut out = Vec::new();
        for a in mesh.axis_ids() {
            let name = mesh.axis_name(a).to_string();
            let groups = mesh.groups(a);
            let (color, key) = groups
                .iter()
                .enumerate()
                .find_map(|(g, ranks)| ranks.iter().position(|&r| r == self.rank).map(|k| (g, k)))
                .ok_or_else(|| CommError::BadPeer {
                    kind: CollectiveKind::Broadcast,
                    rank: self.rank,
                    peer: self.rank,
                    size: mesh.world_size(),
                })?;
            out.push((name.clone(), self.split(&name, color, key)?));
        }
        Ok(out)
    }

    fn check_failed(&self) -> Result<(), CommError> {
        match &*self.failed.borrow() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn fail(&self, e: CommError) -> CommError {
        self.abort_raw();
        self.failed.borrow_mut().get_or_insert_with(|| e.clone());
        e
    }

    fn abort_raw(&self) {
        if !self.aborted.replace(true) {
            // SAFETY: live communicator, aborted once.
            unsafe {
                let _ = nsys::ncclCommAbort(self.comm);
            }
        }
    }

    /// Collective `kind` #`seq` of this rank did not complete within the timeout.
    fn timed_out(&self, kind: CollectiveKind, seq: u64) -> CommError {
        CommError::Timeout {
            kind,
            seq,
            rank: self.rank,
            waiting_for: self.rank,
            group: self.name.clone(),
            timeout_ms: self.timeout.as_millis() as u64,
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator is no longer in progress.
    fn wait_ready(
        &self,
        kind: CollectiveKind,
        seq: u64,
        call: &'static str,
    ) -> Result<(), CommError> {
        self.wait_until(Instant::now() + self.timeout, kind, seq, call)
    }

    /// [`NcclComm::wait_ready`] up to `deadline`.
    fn wait_until(
        &self,
        deadline: Instant,
        kind: CollectiveKind,
        seq: u64,
        call: &'static str,
    ) -> Result<(), CommError> {
        loop {
            let mut state = nsys::ncclResult_t::ncclInProgress;
            // SAFETY: live communicator; out-pointer to a live local.
            let r = unsafe { nsys::ncclCommGetAsyncError(self.comm, &mut state) };
            if r != nsys::ncclResult_t::ncclSuccess {
                return Err(self.fail(NcclCallError::new("ncclCommGetAsyncError", r).into()));
            }
            match state {
                nsys::ncclResult_t::ncclSuccess => return Ok(()),
                nsys::ncclResult_t::ncclInProgress => {}
                other => return Err(self.fail(NcclCallError::new(call, other).into())),
            }
            if Instant::now() > deadline {
                return Err(self.fail(self.timed_out(kind, seq)));
            }
            std::thread::yield_now();
        }
    }

    /// Runs one enqueue call (`f`) as collective `kind`: checks, polls, records completion.
    fn issue(
        &self,
        kind: CollectiveKind,
        call: &'static str,
        stream: &CudaStream,
        f: impl FnOnce(nsys::cudaStream_t) -> nsys::ncclResult_t,
    ) -> Result<(), CommError> {
        self.check_failed()?;
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.fail(CommError::Transport(format!("bind context: {e}"))))?;
        let r = f(stream.cu_stream() as nsys::cudaStream_t);
        if !ok_or_progress(r) {
            return Err(self.fail(NcclCallError::new(call, r).into()));
        }
        self.wait_ready(kind, seq, call)?;
        let event = stream
            .record_event(None)
            .map_err(|e| self.fail(CommError::Transport(format!("record event: {e}"))))?;
        self.pending.borrow_mut().push_back(Pending {
            seq,
            kind,
            event,
            issued: Instant::now(),
        });
        Ok(())
    }

    /// Checks `send` → `recv` against collective `kind`'s size rules, then issues NCCL's `call`
    /// as `f` makes it from the send and receive pointers and their NCCL dtype.
    fn issue_buffers(
        &self,
        kind: CollectiveKind,
        call: &'static str,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        stream: &CudaStream,
        f: impl FnOnce(
            *const c_void,
            *mut c_void,
            nsys::ncclDataType_t,
            nsys::cudaStream_t,
        ) -> nsys::ncclResult_t,
    ) -> Result<(), CommError> {
        check_sizes(kind, self.rank, self.size, &send, &recv)?;
        let ty = nccl_type(send.dtype);
        self.issue(kind, call, stream, |s| {
            f(send.ptr as *const c_void, recv.ptr as *mut c_void, ty, s)
        })
    }

    /// `ncclGroupStart` … `f` … `ncclGroupEnd` as one collective (all-to-all as send/recv).
    fn grouped(
        &self,
        kind: CollectiveKind,
        stream: &CudaStream,
        f: impl FnOnce(nsys::cudaStream_t) -> nsys::ncclResult_t,
    ) -> Result<(), CommError> {
        self.issue(kind, "ncclGroupEnd", stream, |s| {
            // SAFETY: group calls take no pointers; `f` issues calls on this communicator.
            unsafe {
                let r = nsys::ncclGroupStart();
                if r != nsys::ncclResult_t::ncclSuccess {
                    return r;
                }
                let r = f(s);
                let end = nsys::ncclGroupEnd();
                if ok_or_progress(r) {
                    end
                } else {
                    r
                }
            }
        })
    }

    /// Enqueues `ncclSend` of the buffer of `out` to its peer, then, unless it failed,
    /// `ncclRecv` into the buffer of `inp` from its peer (inside a group, the two are one
    /// step), on `s`.
    ///
    /// # Safety
    /// The buffers are valid device memory of this communicator's context (the trait
    /// contract).
    unsafe fn p2p_raw(
        &self,
        out: Transfer,
        inp: Transfer,
        s: nsys::cudaStream_t,
    ) -> nsys::ncclResult_t {
        let raw = |(buf, peer): (DeviceBuffer, usize)| {
            (
                buf.ptr as *mut c_void,
                buf.len,
                nccl_type(buf.dtype),
                peer as i32,
            )
        };
        // SAFETY: forwarded from the caller.
        unsafe {
            let mut r = nsys::ncclResult_t::ncclSuccess;
            if let Some((ptr, len, ty, to)) = out.map(raw) {
                r = nsys::ncclSend(ptr, len, ty, to, self.comm, s);
                if !ok_or_progress(r) {
                    return r;
                }
            }
            match inp.map(raw) {
                Some((ptr, len, ty, from)) => nsys::ncclRecv(ptr, len, ty, from, self.comm, s),
                None => r,
            }
        }
    }
}

fn comm_err(e: CommError) -> CudaError {
    CudaError::CommPoll {
        axis: "world".to_string(),
        source: Box::new(e),
    }
}

/// The longest a healthy teardown waits for `ncclCommFinalize` before aborting: a peer that
/// failed never finalizes, and a rank must not hang its whole timeout on the way out.
const TEARDOWN_WAIT: Duration = Duration::from_secs(5);

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.aborted.get() {
            return;
        }
        // After a failure of this communicator, or while the rank unwinds from one elsewhere,
        // the peers may never finalize: abort at once.
        if self.failed.borrow().is_some() || std::thread::panicking() {
            self.abort_raw();
            return;
        }
        // Healthy teardown: finalize (flushes outstanding work), wait a bounded time,
        // destroy. Anything unexpected falls back to abort. Errors cannot be reported from
        // Drop.
        let deadline = Instant::now() + self.timeout.min(TEARDOWN_WAIT);
        // SAFETY: live communicator, destroyed once.
        unsafe {
            let r = nsys::ncclCommFinalize(self.comm);
            if ok_or_progress(r)
                && self
                    .wait_until(
                        deadline,
                        CollectiveKind::Broadcast,
                        self.seq.get(),
                        "ncclCommFinalize",
                    )
                    .is_ok()
            {
                let _ = nsys::ncclCommDestroy(self.comm);
            } else {
                self.abort_raw();
            }
        }
    }
}

impl DeviceCommunicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "nccl"
    }

    unsafe fn enqueue(&self, c: DeviceCollective, stream: &CudaStream) -> Result<(), CommError> {
        let (kind, comm) = (c.kind(), self.comm);
        // SAFETY (every NCCL call below): the caller guarantees the buffers (trait contract).
        match c {
            DeviceCollective::AllReduce { send, recv, op } => self.issue_buffers(
                kind,
                "ncclAllReduce",
                send,
                recv,
                stream,
                |src, dst, ty, s| unsafe {
                    nsys::ncclAllReduce(src, dst, send.len, ty, nccl_op(op), comm, s)
                },
            ),
            DeviceCollective::ReduceScatter { send, recv, op } => {
                let call = "ncclReduceScatter";
                self.issue_buffers(kind, call, send, recv, stream, |src, dst, ty, s| unsafe {
                    nsys::ncclReduceScatter(src, dst, recv.len, ty, nccl_op(op), comm, s)
                })
            }
            DeviceCollective::AllGather { send, recv } => self.issue_buffers(
                kind,
                "ncclAllGather",
                send,
                recv,
                stream,
                |src, dst, ty, s| unsafe { nsys::ncclAllGather(src, dst, send.len, ty, comm, s) },
            ),
            DeviceCollective::AllToAll { send, recv } => {
                check_sizes(kind, self.rank, self.size, &send, &recv)?;
                let c = send.len / self.size;
                self.grouped(kind, stream, |s| {
                    for peer in 0..self.size {
                        let (sb, rb) = (send.sub(peer * c, c), recv.sub(peer * c, c));
                        let r = unsafe { self.p2p_raw(Some((sb, peer)), Some((rb, peer)), s) };
                        if !ok_or_progress(r) {
                            return r;
                        }
                    }
                    nsys::ncclResult_t::ncclSuccess
                })
            }
            DeviceCollective::Broadcast { send, recv, root } => {
                check_sizes(kind, self.rank, self.size, &send, &recv)?;
                check_peer(kind, self.rank, root, self.size)?;
                self.issue(kind, "ncclBroadcast", stream, |s| unsafe {
                    nsys::ncclBroadcast(
                        send.ptr as *const c_void,
                        recv.ptr as *mut c_void,
                        recv.len,
                        nccl_type(recv.dtype),
                        root as i32,
                        comm,
                        s,
                    )
                })
            }
            DeviceCollective::Send { .. }
            | DeviceCollective::Recv { .. }
            | DeviceCollective::SendRecv { .. } => {
                let (out, inp) = c.transfers();
                for (_, peer) in out.iter().chain(&inp) {
                    check_peer(kind, self.rank, *peer, self.size)?;
                }
                let raw = |s| unsafe { self.p2p_raw(out, inp, s) };
                match (out, inp) {
                    (Some(_), Some(_)) => self.grouped(kind, stream, raw),
                    (Some(_), None) => self.issue(kind, "ncclSend", stream, raw),
                    _ => self.issue(kind, "ncclRecv", stream, raw),
                }
            }
        }
    }

    fn poll(&self) -> Result<bool, CommError> {
        self.check_failed()?;
        let mut state = nsys::ncclResult_t::ncclSuccess;
        // SAFETY: live communicator; out-pointer to a live local.
        let r = unsafe { nsys::ncclCommGetAsyncError(self.comm, &mut state) };
        if r != nsys::ncclResult_t::ncclSuccess {
            return Err(self.fail(NcclCallError::new("ncclCommGetAsyncError", r).into()));
        }
        if !ok_or_progress(state) {
            return Err(self.fail(NcclCallError::new("asynchronous collective", state).into()));
        }
        let mut pending = self.pending.borrow_mut();
        while let Some(p) = pending.front() {
            match p.event.try_is_complete() {
                Ok(true) => {
                    pending.pop_front();
                }
                Ok(false) => break,
                Err(e) => {
                    let e = CommError::Transport(format!("{} #{}: {e}", p.kind, p.seq));
                    drop(pending);
                    return Err(self.fail(e));
                }
            }
        }
        if let Some(p) = pending.front() {
            if p.issued.elapsed() > self.timeout {
                let e = self.timed_out(p.kind, p.seq);
                drop(pending);
                return Err(self.fail(e));
            }
        }
        Ok(pending.is_empty())
    }

    fn abort(&self, reason: &str) {
        let seq = self.seq.get();
        let e = CommError::Aborted {
            kind: CollectiveKind::AllReduce,
            seq,
            rank: self.rank,
            group: self.name.clone(),
            reason: reason.to_string(),
        };
        self.fail(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rendezvous carries rank 0's id as bootstrap bytes: 128 of them round-trip, any
    /// other length (a CPU job's 16-byte job id, nothing) is an error naming the length.
    #[test]
    fn nccl_id_from_bootstrap_bytes() {
        let bytes: Vec<u8> = (0..128u32).map(|i| (i * 7) as u8).collect();
        let id = NcclId::from_bootstrap(&bytes).expect("128 bytes");
        assert_eq!(id.0.to_vec(), bytes);
        assert_eq!(NcclId::from_bootstrap(&id.0).expect("its own bytes"), id);
        for n in [0, 16, 127, 129] {
            let e = NcclId::from_bootstrap(&vec![0; n]).expect_err("wrong length");
            let text = e.to_string();
            assert!(
                text.contains(&format!("sent {n} bootstrap bytes")),
                "{text}"
            );
            assert!(text.contains("--backend cuda"), "{text}");
        }
    }

    #[test]
    fn config_is_the_2_30_initializer_made_nonblocking() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<nsys::ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafe_beef, 23000, 0));
        assert_eq!(c.maxCTAs, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn dtype_and_op_mapping() {
        assert_eq!(
            nccl_type(DeviceDType::Bf16),
            nsys::ncclDataType_t::ncclBfloat16
        );
        assert_eq!(nccl_type(DeviceDType::I32), nsys::ncclDataType_t::ncclInt32);
        assert_eq!(nccl_op(ReduceOp::Avg), nsys::ncclRedOp_t::ncclAvg);
        let e = NcclCallError {
            call: "ncclAllReduce",
            code: nsys::ncclResult_t::ncclInvalidUsage,
            text: "invalid usage".into(),
        };
        assert_eq!(
            e.to_string(),
            "NCCL ncclAllReduce failed: ncclInvalidUsage (invalid usage)"
        );
    }

    /// Without libnccl the probe is a clean error, never a panic.
    #[test]
    fn probe_never_panics() {
        match nccl_version() {
            Ok(v) => assert!(v >= 20000),
            Err(e) => assert!(
                e.is_unavailable() || matches!(e, CudaError::NoDevice { .. }),
                "{e}"
            ),
        }
    }
}
