//! Multi-process communicator over TCP, like PyTorch's gloo backend: one process (or thread)
//! per rank, a full mesh of sockets, and the same algorithms as [`super::engine`] (ring
//! all_reduce/reduce_scatter/all_gather, binary-tree broadcast/reduce, pairwise all_to_all),
//! shared through its internal `Transport` trait.
//!
//! Setup ([`TcpComm::connect`], [`TcpComm::from_listener`]): rank `r` dials every lower rank
//! and accepts every higher one, retrying until the timeout; each connection starts with a
//! handshake checking the group name, size and ranks. One reader thread per peer then drains
//! its socket into this rank's inbox, so sends never wait for the peer to post a receive.
//!
//! Wire format (little-endian): a 24-byte header `[type u8, collective u8, 0 × 2, check u32,
//! seq u64, len u64]` then, for data, `len` f32s; for an abort, `len` bytes of UTF-8 reason; a
//! goodbye has no payload. `check` is a checksum of the header's other fields and the payload
//! ([`checksum`]): a frame that arrives altered, or cut short, aborts the group naming the
//! sender, rather than feeding a collective wrong numbers.
//!
//! Postconditions, beyond those of [`super::engine`]:
//! - A wait past the timeout, or a socket write blocked past it, gives
//!   [`CommError::Timeout`].
//! - Dropping a handle sends a goodbye: peers' later waits on (and sends to) that rank return
//!   [`CommError::Aborted`] naming it. A connection that breaks without one (the peer process
//!   died) aborts the whole handle, as does [`TcpComm::abort`] on any rank.
//! - Setup failures (bind, connect, handshake, timeout) are [`CommError::Transport`].

use super::engine::{Engine, GroupInfo, Inbox, Op, Tag, Transport};
use super::{CommError, Communicator, ReduceOp};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Handshake magic, sent by the dialling rank.
const HELLO: &[u8; 4] = b"SHDC";
/// Handshake reply of the accepting rank.
const ACK: &[u8; 4] = b"SHOK";
/// Wire format version, part of the handshake.
const VERSION: u32 = 2;
/// Frame header length in bytes.
const HEADER: usize = 24;
/// Frame types.
const DATA: u8 = 0;
const BYE: u8 = 1;
const ABORT: u8 = 2;
/// Largest payload a reader accepts (a bigger length means a corrupt stream).
const MAX_PAYLOAD_BYTES: usize = 1 << 34;
/// Longest group name in a handshake.
const MAX_NAME_BYTES: usize = 4096;
/// Pause between connection attempts while a peer is not listening yet.
const RETRY: Duration = Duration::from_millis(10);
/// Pause between polls of a non-blocking listener.
const ACCEPT_POLL: Duration = Duration::from_millis(2);

/// One rank's handle on a group whose ranks talk over TCP (see the module docs). `Send`, not
/// `Sync`. Dropping it says goodbye to every peer and closes its sockets.
pub struct TcpComm {
    engine: Engine<TcpLink>,
}

impl TcpComm {
    /// Binds `addrs[rank]`, then joins the group as [`TcpComm::from_listener`] does. `addrs[i]`
    /// is rank `i`'s listen address.
    pub fn connect(
        name: &str,
        rank: usize,
        size: usize,
        addrs: &[SocketAddr],
        timeout: Duration,
    ) -> Result<TcpComm, CommError> {
        check_args(name, rank, size, addrs)?;
        let listener = TcpListener::bind(addrs[rank])
            .map_err(|e| setup_err(name, rank, format!("cannot listen on {}: {e}", addrs[rank])))?;
        TcpComm::from_listener(name, rank, size, listener, addrs, timeout)
    }

    /// Joins group `name` as `rank` of `size`, accepting peers on `listener` (already bound,
    /// so tests can use ephemeral ports without races) and dialling `addrs[j]` for every rank
    /// `j < rank` (`addrs[rank]` is not used). Returns once connected to every peer, or fails
    /// with [`CommError::Transport`] when that takes longer than `timeout`, which also bounds
    /// every later wait on a peer.
    pub fn from_listener(
        name: &str,
        rank: usize,
        size: usize,
        listener: TcpListener,
        addrs: &[SocketAddr],
        timeout: Duration,
    ) -> Result<TcpComm, CommError> {
        check_args(name, rank, size, addrs)?;
        let deadline = Instant::now().checked_add(timeout);
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        for (peer, addr) in addrs.iter().enumerate().take(rank) {
            streams[peer] = Some(dial(name, rank, size, peer, *addr, deadline)?);
        }
        accept_peers(name, rank, size, &listener, deadline, &mut streams)?;
        drop(listener);

        let info = GroupInfo {
            name: name.to_owned(),
            rank,
            size,
            timeout,
        };
        let mut link = TcpLink {
            inbox: Arc::new(Inbox::new(size)),
            writers: (0..size).map(|_| None).collect(),
            readers: Vec::new(),
            closing: Arc::new(AtomicBool::new(false)),
            info,
        };
        // On an error below, dropping `link` says goodbye to the peers set up so far.
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else { continue };
            let io = |e: io::Error| setup_err(name, rank, format!("socket to rank {peer}: {e}"));
            // A zero timeout is rejected by the socket API; one microsecond is as good.
            let write_timeout = timeout.max(Duration::from_micros(1));
            stream.set_read_timeout(None).map_err(io)?;
            stream.set_write_timeout(Some(write_timeout)).map_err(io)?;
            let reader = stream.try_clone().map_err(io)?;
            link.writers[peer] = Some(Mutex::new(stream));
            let (inbox, closing) = (Arc::clone(&link.inbox), Arc::clone(&link.closing));
            let handle = thread::Builder::new()
                .name(format!("shardc-tcp-{name}-{rank}<-{peer}"))
                .spawn(move || read_loop(reader, peer, &inbox, &closing))
                .map_err(io)?;
            link.readers.push(handle);
        }
        Ok(TcpComm {
            engine: Engine::new(link),
        })
    }

    /// Aborts the group: this rank's current or next wait returns [`CommError::Aborted`] with
    /// `reason`, and so do those of every peer this rank can still reach (best effort). Call it
    /// when this rank fails. Idempotent; the first reason wins locally.
    pub fn abort(&self, reason: &str) {
        let link = self.engine.link();
        let why = format!("rank {} aborted: {reason}", link.info.rank);
        link.inbox.abort(&why);
        let frame = seal(frame(
            ABORT,
            Tag { kind: 0, seq: 0 },
            why.len(),
            why.as_bytes(),
        ));
        for peer in 0..link.info.size {
            let _ = link.write_frame(peer, &frame); // Best effort: the peer may be gone.
        }
    }

    /// The group's timeout for each wait on a peer.
    pub fn timeout(&self) -> Duration {
        self.engine.link().info.timeout
    }
}

impl fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.engine.link().info.debug("TcpComm", f)
    }
}

super::engine::communicator_via_engine!(TcpComm);

/// The TCP transport: a socket per peer, written under a lock, read by a thread per peer.
struct TcpLink {
    info: GroupInfo,
    inbox: Arc<Inbox>,
    /// `writers[p]`: the socket to peer `p` (`None` for this rank).
    writers: Vec<Option<Mutex<TcpStream>>>,
    readers: Vec<JoinHandle<()>>,
    /// Set on drop, so readers take their sockets' closing for a goodbye, not a failure.
    closing: Arc<AtomicBool>,
}

impl TcpLink {
    fn write_frame(&self, peer: usize, frame: &[u8]) -> io::Result<()> {
        let writer = self
            .writers
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no socket to this rank"))?;
        let mut stream = writer.lock().unwrap_or_else(PoisonError::into_inner);
        stream.write_all(frame)
    }
}

impl Transport for TcpLink {
    fn info(&self) -> &GroupInfo {
        &self.info
    }
    fn inbox(&self) -> &Inbox {
        &self.inbox
    }
    fn deliver(&self, peer: usize, op: Op, data: &[f32]) -> Result<(), CommError> {
        let mut frame = frame(DATA, op.tag(), data.len(), &[]);
        frame.reserve_exact(4 * data.len());
        data.iter()
            .for_each(|x| frame.extend_from_slice(&x.to_le_bytes()));
        self.write_frame(peer, &seal(frame))
            .map_err(|e| match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    self.info.timeout_err(op, peer)
                }
                _ => self
                    .info
                    .aborted_err(op, format!("connection to rank {peer} lost: {e}")),
            })
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
        let bye = seal(frame(BYE, Tag { kind: 0, seq: 0 }, 0, &[]));
        for writer in self.writers.iter().flatten() {
            let mut stream = writer.lock().unwrap_or_else(PoisonError::into_inner);
            let _ = stream.write_all(&bye); // Best effort: the peer may be gone.
            let _ = stream.shutdown(Shutdown::Both); // Also wakes our reader.
        }
        for reader in self.readers.drain(..) {
            let _ = reader.join(); // A reader never panics; nothing to report if it did.
        }
    }
}

/// A frame: header, then `payload` (`len` counts elements for data, bytes otherwise).
/// The checksum is filled in by [`seal`] once the payload is complete.
fn frame(ty: u8, tag: Tag, len: usize, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(&[ty, tag.kind, 0, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&tag.seq.to_le_bytes());
    out.extend_from_slice(&(len as u64).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Writes the checksum of a complete frame into its header.
fn seal(mut frame: Vec<u8>) -> Vec<u8> {
    let c = checksum(&frame[..HEADER], &frame[HEADER..]);
    frame[4..8].copy_from_slice(&c.to_le_bytes());
    frame
}

/// A Fletcher-style checksum over 8-byte words of the header (its `check` field excluded) and
/// the payload: cheap next to the socket, and any single flipped bit or reordered word changes
/// it.
pub(crate) fn checksum(header: &[u8], payload: &[u8]) -> u32 {
    let (mut a, mut b) = (0x9e37_79b9_7f4a_7c15u64, 0u64);
    let mut add = |w: u64| {
        a = a.wrapping_add(w).rotate_left(5) ^ w;
        b = b.wrapping_add(a);
    };
    add(u64::from(header[0]) | (u64::from(header[1]) << 8));
    add(le_u64(&header[8..]));
    add(le_u64(&header[16..]));
    let mut words = payload.chunks_exact(8);
    for w in &mut words {
        add(le_u64(w));
    }
    let mut tail = [0u8; 8];
    let rest = words.remainder();
    tail[..rest.len()].copy_from_slice(rest);
    add(u64::from_le_bytes(tail) ^ ((rest.len() as u64) << 56));
    let h = a ^ b.rotate_left(29);
    (h ^ (h >> 32)) as u32
}

/// `read_exact` that says how many bytes arrived before a failure.
fn read_full(stream: &mut impl Read, buf: &mut [u8]) -> Result<(), (usize, io::Error)> {
    let mut at = 0;
    while at < buf.len() {
        match stream.read(&mut buf[at..]) {
            Ok(0) => return Err((at, io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((at, e)),
        }
    }
    Ok(())
}

fn le_u64(bytes: &[u8]) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(b)
}

/// Drains the socket from `peer` into `inbox` until a goodbye, an abort or a failure.
fn read_loop(mut stream: TcpStream, peer: usize, inbox: &Inbox, closing: &AtomicBool) {
    let failure = loop {
        let mut header = [0u8; HEADER];
        if let Err(e) = stream.read_exact(&mut header) {
            break format!("connection to rank {peer} lost: {e}");
        }
        let (ty, kind, seq, len) = (
            header[0],
            header[1],
            le_u64(&header[8..]),
            le_u64(&header[16..]),
        );
        let bytes = usize::try_from(len)
            .ok()
            .and_then(|n| n.checked_mul(if ty == DATA { 4 } else { 1 }))
            .filter(|&n| n <= MAX_PAYLOAD_BYTES);
        let Some(bytes) = bytes else {
            break format!("rank {peer} sent a corrupt frame (payload length {len})");
        };
        let mut payload = vec![0u8; bytes];
        if let Err(e) = read_full(&mut stream, &mut payload) {
            break format!(
                "rank {peer} sent a truncated frame ({} of its {bytes} payload bytes arrived \
                 before the connection ended: {})",
                e.0, e.1
            );
        }
        let sent = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        let got = checksum(&header, &payload);
        if sent != got {
            break format!(
                "rank {peer} sent a corrupt frame (collective #{seq}: checksum {got:08x}, the \
                 sender's {sent:08x})"
            );
        }
        match ty {
            DATA => {
                let data = payload
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                inbox.push(peer, Tag { kind, seq }, data);
            }
            BYE => {
                inbox.close(
                    peer,
                    &format!("rank {peer} left the group (its communicator was dropped)"),
                );
                return;
            }
            ABORT => {
                inbox.abort(&String::from_utf8_lossy(&payload));
                return;
            }
            _ => break format!("rank {peer} sent a corrupt frame (type {ty})"),
        }
    };
    if !closing.load(Ordering::Acquire) {
        inbox.abort(&failure);
    }
}

fn setup_err(name: &str, rank: usize, what: String) -> CommError {
    CommError::Transport(format!("tcp group `{name}`, rank {rank}: {what}"))
}

fn check_args(name: &str, rank: usize, size: usize, addrs: &[SocketAddr]) -> Result<(), CommError> {
    if rank >= size || addrs.len() != size {
        return Err(setup_err(
            name,
            rank,
            format!(
                "need rank < size ({size}) and one address per rank (got {})",
                addrs.len()
            ),
        ));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(setup_err(
            name,
            rank,
            format!("group name longer than {MAX_NAME_BYTES} bytes"),
        ));
    }
    Ok(())
}

fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    match deadline {
        None => Some(Duration::MAX),
        Some(d) => Some(d.saturating_duration_since(Instant::now())).filter(|r| !r.is_zero()),
    }
}

/// Connects to `peer` at `addr`, retrying until `deadline`, and shakes hands.
fn dial(
    name: &str,
    rank: usize,
    size: usize,
    peer: usize,
    addr: SocketAddr,
    deadline: Option<Instant>,
) -> Result<TcpStream, CommError> {
    let fail = |what: String| {
        setup_err(
            name,
            rank,
            format!("connecting to rank {peer} at {addr}: {what}"),
        )
    };
    let mut last = None;
    let mut stream = loop {
        let Some(left) = remaining(deadline) else {
            let last = last.map_or_else(String::new, |e: io::Error| format!(" (last error: {e})"));
            return Err(fail(format!("timed out{last}")));
        };
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))) {
            Ok(s) => break s,
            Err(e) => {
                last = Some(e);
                thread::sleep(RETRY.min(left));
            }
        }
    };
    let io = |e: io::Error| fail(format!("handshake: {e}"));
    let left = remaining(deadline).unwrap_or(Duration::from_micros(1));
    stream.set_nodelay(true).map_err(io)?;
    stream.set_read_timeout(Some(left)).map_err(io)?;
    stream.set_write_timeout(Some(left)).map_err(io)?;
    let mut hello = Vec::with_capacity(32 + name.len());
    hello.extend_from_slice(HELLO);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    for n in [rank, size, name.len()] {
        hello.extend_from_slice(&(n as u64).to_le_bytes());
    }
    hello.extend_from_slice(name.as_bytes());
    stream.write_all(&hello).map_err(io)?;
    let mut ack = [0u8; 4];
    stream.read_exact(&mut ack).map_err(io)?;
    if &ack != ACK {
        return Err(fail("handshake: not a shardc rank".to_owned()));
    }
    Ok(stream)
}

/// The dialling side's handshake, as read by the accepting side.
struct Hello {
    version: u32,
    rank: usize,
    size: usize,
    name: Vec<u8>,
}

/// Reads a handshake; `None` for anything that is not a shardc rank.
fn read_hello(stream: &mut TcpStream) -> Option<Hello> {
    let mut head = [0u8; 32];
    stream.read_exact(&mut head).ok()?;
    if &head[..4] != HELLO {
        return None;
    }
    let version = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    let [rank, size, len] = [8, 16, 24].map(|at| usize::try_from(le_u64(&head[at..])).ok());
    let len = len.filter(|&l| l <= MAX_NAME_BYTES)?;
    let mut name = vec![0u8; len];
    stream.read_exact(&mut name).ok()?;
    Some(Hello {
        version,
        rank: rank?,
        size: size?,
        name,
    })
}

/// Accepts and checks one connection from every rank above `rank`, until `deadline`.
/// Connections that do not speak the handshake are dropped.
fn accept_peers(
    name: &str,
    rank: usize,
    size: usize,
    listener: &TcpListener,
    deadline: Option<Instant>,
    streams: &mut [Option<TcpStream>],
) -> Result<(), CommError> {
    let fail = |what: String| setup_err(name, rank, what);
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(format!("listener: {e}")))?;
    while let Some(first_missing) = (rank + 1..size).find(|&p| streams[p].is_none()) {
        let Some(left) = remaining(deadline) else {
            let missing: Vec<_> = (rank + 1..size).filter(|&p| streams[p].is_none()).collect();
            return Err(fail(format!(
                "timed out waiting for ranks {missing:?} to connect"
            )));
        };
        let mut stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(ACCEPT_POLL.min(left));
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(fail(format!("accepting rank {first_missing}: {e}"))),
        };
        let ready = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_nodelay(true))
            .and_then(|()| stream.set_read_timeout(Some(left)))
            .and_then(|()| stream.set_write_timeout(Some(left)));
        if ready.is_err() {
            continue;
        }
        let Some(hello) = read_hello(&mut stream) else {
            continue;
        };
        if hello.version != VERSION || hello.name != name.as_bytes() || hello.size != size {
            return Err(fail(format!(
                "a peer joined group `{}` of size {} with wire version {}, expected `{name}` of \
                 size {size} with version {VERSION}",
                String::from_utf8_lossy(&hello.name),
                hello.size,
                hello.version
            )));
        }
        let peer = hello.rank;
        if peer <= rank || peer >= size || streams[peer].is_some() {
            return Err(fail(format!(
                "unexpected connection claiming to be rank {peer}"
            )));
        }
        stream
            .write_all(ACK)
            .map_err(|e| fail(format!("handshake with rank {peer}: {e}")))?;
        streams[peer] = Some(stream);
    }
    Ok(())
}
