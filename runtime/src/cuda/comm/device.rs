//! The GPU-side communicator interface: collectives over device buffers, enqueued on a CUDA
//! stream (the CPU [`Communicator`](crate::comm::Communicator) trait moves host `f32` slices and
//! stays as it is).
//!
//! Contract shared by every implementation (`nccl`, `local_gpu`):
//! - every rank of a group issues the same collectives in the same order with the same sizes
//!   and dtypes (the compiler guarantees it for plans);
//! - a call *enqueues* the collective on `stream` and returns; the data is ready once `stream`
//!   has executed it (order later work with an event recorded on `stream`);
//! - the buffers are read/written by the device after the call returns: they must stay
//!   allocated, and must not be rewritten by other streams, until the collective completed;
//! - a peer that never arrives, or a collective that never completes, ends in
//!   [`CommError::Timeout`] naming the rank, the collective, its sequence number and the group
//!   (the mesh axis) within the group's timeout, from the call itself or from [`DeviceCommunicator::poll`].
//!
//! Sizes (elements): `all_gather`: `recv.len == send.len · size`; `reduce_scatter`:
//! `send.len == recv.len · size`; `all_to_all`: `send.len == recv.len`, divisible by `size`
//! (chunk j of `send` to rank j, chunk i of `recv` from rank i); `all_reduce`, `broadcast`:
//! equal lengths.

use crate::comm::{CollectiveKind, CommError, ReduceOp};
use cudarc::driver::CudaStream;
use std::fmt;

/// Element type of a device buffer as it crosses a communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceDType {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
    /// 32-bit signed integer (data movement; sums on NCCL only).
    I32,
}

impl DeviceDType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DeviceDType::F32 | DeviceDType::I32 => 4,
            DeviceDType::Bf16 | DeviceDType::F16 => 2,
        }
    }
}

impl fmt::Display for DeviceDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceDType::F32 => "f32",
            DeviceDType::Bf16 => "bf16",
            DeviceDType::F16 => "f16",
            DeviceDType::I32 => "i32",
        })
    }
}

/// A non-owning view of device memory: a raw `CUdeviceptr`, an element count and a dtype.
/// Whoever builds one guarantees the memory outlives every collective it is passed to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    /// Device address of element 0.
    pub ptr: u64,
    /// Number of elements.
    pub len: usize,
    /// Element type.
    pub dtype: DeviceDType,
}

impl DeviceBuffer {
    /// A buffer of `len` elements of `dtype` at `ptr`.
    pub fn new(ptr: u64, len: usize, dtype: DeviceDType) -> DeviceBuffer {
        DeviceBuffer { ptr, len, dtype }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size_bytes()
    }

    /// Elements `[start, start + len)` of this buffer.
    pub fn sub(&self, start: usize, len: usize) -> DeviceBuffer {
        debug_assert!(start + len <= self.len, "invariant: sub-buffer in range");
        DeviceBuffer {
            ptr: self.ptr + (start * self.dtype.size_bytes()) as u64,
            len,
            dtype: self.dtype,
        }
    }
}

/// One collective over device buffers (element counts: the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceCollective {
    /// Reduction of every rank's `send` into `recv` on every rank.
    AllReduce {
        send: DeviceBuffer,
        recv: DeviceBuffer,
        op: ReduceOp,
    },
    /// Reduction of every rank's `send`; rank i keeps chunk i in `recv`.
    ReduceScatter {
        send: DeviceBuffer,
        recv: DeviceBuffer,
        op: ReduceOp,
    },
    /// Concatenation of every rank's `send` into `recv`, in rank order.
    AllGather {
        send: DeviceBuffer,
        recv: DeviceBuffer,
    },
    /// Chunk j of `send` to rank j; chunk i of `recv` from rank i.
    AllToAll {
        send: DeviceBuffer,
        recv: DeviceBuffer,
    },
    /// `send` of rank `root` into `recv` on every rank (`send` is read on the root only).
    Broadcast {
        send: DeviceBuffer,
        recv: DeviceBuffer,
        root: usize,
    },
    /// Point-to-point send of `buf` to `peer`.
    Send { buf: DeviceBuffer, peer: usize },
    /// Point-to-point receive into `buf` from `peer`.
    Recv { buf: DeviceBuffer, peer: usize },
    /// Sends `send` to rank `to` and receives `recv` from rank `from` as one step, so a ring
    /// of ranks each sending to the next and receiving from the previous cannot deadlock.
    SendRecv {
        send: DeviceBuffer,
        to: usize,
        recv: DeviceBuffer,
        from: usize,
    },
}

/// One half of a point-to-point transfer: the buffer and the peer, if any.
pub type Transfer = Option<(DeviceBuffer, usize)>;

impl DeviceCollective {
    /// The kind errors name (a [`DeviceCollective::SendRecv`] is a send).
    pub fn kind(&self) -> CollectiveKind {
        match self {
            DeviceCollective::AllReduce { .. } => CollectiveKind::AllReduce,
            DeviceCollective::ReduceScatter { .. } => CollectiveKind::ReduceScatter,
            DeviceCollective::AllGather { .. } => CollectiveKind::AllGather,
            DeviceCollective::AllToAll { .. } => CollectiveKind::AllToAll,
            DeviceCollective::Broadcast { .. } => CollectiveKind::Broadcast,
            DeviceCollective::Send { .. } | DeviceCollective::SendRecv { .. } => {
                CollectiveKind::Send
            }
            DeviceCollective::Recv { .. } => CollectiveKind::Recv,
        }
    }

    /// The two halves of a point-to-point transfer: what this rank sends and to which peer,
    /// what it receives and from which peer (both `None` for the group collectives).
    pub fn transfers(&self) -> (Transfer, Transfer) {
        match *self {
            DeviceCollective::Send { buf, peer } => (Some((buf, peer)), None),
            DeviceCollective::Recv { buf, peer } => (None, Some((buf, peer))),
            DeviceCollective::SendRecv {
                send,
                to,
                recv,
                from,
            } => (Some((send, to)), Some((recv, from))),
            _ => (None, None),
        }
    }
}

/// One rank's handle on a group of GPU ranks (one mesh axis). See the module docs for the
/// contract. Implementations are not required to be `Send`: NCCL communicators live on the
/// thread that created them.
pub trait DeviceCommunicator {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// The group's name (its mesh axis), for errors.
    fn name(&self) -> &str;
    /// Which implementation (`nccl`, `local-gpu`), for messages.
    fn kind(&self) -> &'static str;

    /// Enqueues collective `c` on `stream`.
    ///
    /// # Safety
    /// Every buffer of `c` is valid device memory of this communicator's context for its
    /// whole length and stays allocated until the collective has executed on `stream`.
    unsafe fn enqueue(&self, c: DeviceCollective, stream: &CudaStream) -> Result<(), CommError>;

    /// Non-blocking health check: `Ok(true)` when every enqueued collective has completed,
    /// `Ok(false)` while some are in flight, `Err` on an asynchronous failure or when the
    /// oldest incomplete collective is older than the group's timeout (the communicator is
    /// aborted first, and the error names rank, collective, sequence number and group).
    fn poll(&self) -> Result<bool, CommError>;

    /// Aborts the group: pending and later calls of every rank fail promptly with `reason`.
    fn abort(&self, reason: &str);
}

/// Checks that `peer` (a peer or a root) is a rank of a group of `size`; `Ok` or a
/// [`CommError::BadPeer`] naming the collective and this `rank`.
pub fn check_peer(
    kind: CollectiveKind,
    rank: usize,
    peer: usize,
    size: usize,
) -> Result<(), CommError> {
    if peer < size {
        Ok(())
    } else {
        Err(CommError::BadPeer {
            kind,
            rank,
            peer,
            size,
        })
    }
}

/// Checks the element counts of a collective against the contract; `Ok` or a
/// [`CommError::Size`] naming the collective and the rank.
pub fn check_sizes(
    kind: CollectiveKind,
    rank: usize,
    size: usize,
    send: &DeviceBuffer,
    recv: &DeviceBuffer,
) -> Result<(), CommError> {
    let bad = |detail: String| Err(CommError::Size { kind, rank, detail });
    if send.dtype != recv.dtype {
        return bad(format!("send is {} but recv is {}", send.dtype, recv.dtype));
    }
    let ok = match kind {
        CollectiveKind::AllGather | CollectiveKind::Gather => recv.len == send.len * size,
        CollectiveKind::ReduceScatter | CollectiveKind::Scatter => send.len == recv.len * size,
        CollectiveKind::AllToAll => send.len == recv.len && send.len % size.max(1) == 0,
        _ => send.len == recv.len,
    };
    if ok {
        Ok(())
    } else {
        bad(format!(
            "send has {} elements and recv {} in a group of {size}",
            send.len, recv.len
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_buffers_offset_by_bytes() {
        let b = DeviceBuffer::new(0x1000, 10, DeviceDType::Bf16);
        let s = b.sub(4, 3);
        assert_eq!((s.ptr, s.len, s.bytes()), (0x1008, 3, 6));
        assert_eq!(DeviceBuffer::new(0, 3, DeviceDType::F32).bytes(), 12);
    }

    #[test]
    fn size_rules() {
        let f = |n| DeviceBuffer::new(0, n, DeviceDType::F32);
        assert!(check_sizes(CollectiveKind::AllGather, 0, 4, &f(3), &f(12)).is_ok());
        assert!(check_sizes(CollectiveKind::AllGather, 0, 4, &f(3), &f(11)).is_err());
        assert!(check_sizes(CollectiveKind::ReduceScatter, 1, 2, &f(8), &f(4)).is_ok());
        assert!(check_sizes(CollectiveKind::AllToAll, 1, 2, &f(7), &f(7)).is_err());
        assert!(check_sizes(CollectiveKind::AllReduce, 1, 2, &f(7), &f(7)).is_ok());
        let mixed = check_sizes(
            CollectiveKind::AllReduce,
            1,
            2,
            &f(7),
            &DeviceBuffer::new(0, 7, DeviceDType::Bf16),
        );
        assert!(matches!(mixed, Err(CommError::Size { rank: 1, .. })));
    }
}
