//! The rendezvous: a one-shot TCP store at `MASTER_ADDR:MASTER_PORT`, hosted by rank 0's
//! process ([`Rendezvous::join`]) or by anyone else ([`RendezvousServer::start`]).
//!
//! Protocol: every rank connects (retrying until the store is up), registers its rank, the
//! world size, the fingerprint of the plan it will run, the listen addresses of its data plane
//! and, on rank 0, the job's opaque bootstrap bytes. Once every rank of the world has
//! registered, the store answers each one with the same [`RendezvousTable`] (every rank's
//! addresses, rank 0's bootstrap bytes) and exits. A rank registering twice, a rank or world
//! size out of range, or a plan fingerprint differing from the first registered rank's (ranks
//! that would run different programs, and deadlock or compute garbage together) makes the store
//! answer every rank, then and until the timeout, with one error naming the ranks concerned;
//! ranks still missing at the timeout make it answer the registered ones with an error naming
//! the missing ones. Connections that do not speak the protocol are dropped.
//!
//! Wire format (little-endian, `str` = `u64` length + UTF-8, `bytes` = `u64` length + bytes):
//! registration `"SHRV", version u32, rank u64, world u64, bytes plan, n u64, n × str address,
//! has_bootstrap u8, bytes`; answer `"SHRZ", 0u8, world u64, world × (n u64, n × str),
//! bytes` or `"SHRZ", 1u8, str error`.
//!
//! Every wait is bounded by the timeout given; nothing blocks forever.

use super::env::{host_port, WorldEnv};
use super::LaunchError;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

const REGISTER: &[u8; 4] = b"SHRV";
const ANSWER: &[u8; 4] = b"SHRZ";
const VERSION: u32 = 2;
/// Limits on what a registration may carry (larger means a corrupt or foreign stream).
const MAX_WORLD: u64 = 1 << 20;
const MAX_ADDRS: u64 = 1024;
const MAX_STR: u64 = 1024;
const MAX_BOOTSTRAP: u64 = 1 << 24;
const MAX_PLAN: u64 = 1024;
/// Pause between connection attempts while the store is not up yet.
const RETRY: Duration = Duration::from_millis(20);
/// Pause between polls of the store's listener.
const POLL: Duration = Duration::from_millis(2);
/// How much longer a client waits for the answer than the store waits for the ranks, so the
/// store's error (naming the missing ranks) arrives before the client gives up.
const ANSWER_SLACK: Duration = Duration::from_secs(2);

/// What every rank receives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousTable {
    /// `addrs[r]`: the addresses rank `r` registered, in its order.
    pub addrs: Vec<Vec<SocketAddr>>,
    /// Rank 0's bootstrap bytes (empty if it sent none).
    pub bootstrap: Vec<u8>,
}

/// One rank's registration.
#[derive(Debug)]
struct Registration {
    rank: usize,
    world: usize,
    plan: Vec<u8>,
    addrs: Vec<SocketAddr>,
    bootstrap: Option<Vec<u8>>,
}

/// The store, running on a background thread until every rank has registered or the
/// timeout passes.
#[derive(Debug)]
pub struct RendezvousServer {
    addr: SocketAddr,
    handle: JoinHandle<Result<(), LaunchError>>,
}

impl RendezvousServer {
    /// Binds `host:port` (a host name or address of this machine; if it is not one, every
    /// interface on that port) and serves one rendezvous of `world_size` ranks, giving up
    /// `timeout` from now. Port 0 picks a free port ([`RendezvousServer::local_addr`]).
    pub fn start(
        host: &str,
        port: u16,
        world_size: usize,
        timeout: Duration,
    ) -> Result<RendezvousServer, LaunchError> {
        let shown = host_port(host, port);
        let fail = |detail| store_err(&shown, detail);
        if world_size == 0 || world_size as u64 > MAX_WORLD {
            return Err(fail(format!("world size {world_size} is out of range")));
        }
        let listener = bind_store(host, port).map_err(|e| {
            fail(match e.kind() {
                io::ErrorKind::AddrInUse => {
                    format!("cannot host the store: port {port} is already in use on this host")
                }
                _ => format!("cannot host the store: {e}"),
            })
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| fail(format!("cannot host the store: {e}")))?;
        let deadline = Instant::now().checked_add(timeout);
        let handle = thread::Builder::new()
            .name("shardc-rendezvous".into())
            .spawn(move || serve(listener, world_size, timeout, deadline, &shown))
            .map_err(|e| LaunchError::Io {
                what: "starting the rendezvous thread".into(),
                source: e,
            })?;
        Ok(RendezvousServer { addr, handle })
    }

    /// The address the store listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for the store to finish: `Ok` once it has answered every rank; after a failure,
    /// the error, at the deadline (it answers latecomers until then).
    pub fn wait(self) -> Result<(), LaunchError> {
        self.handle
            .join()
            .unwrap_or_else(|_| Err(LaunchError::Config("the rendezvous thread panicked".into())))
    }
}

/// One rank's connection to the store, between connecting and exchanging.
#[derive(Debug)]
pub struct Rendezvous {
    stream: TcpStream,
    shown: String,
    rank: usize,
    world_size: usize,
    deadline: Option<Instant>,
    server: Option<RendezvousServer>,
}

impl Rendezvous {
    /// Joins the job's rendezvous as `env` describes it: rank 0 hosts the store at
    /// `MASTER_ADDR:MASTER_PORT`; every rank (rank 0 included) connects to it, retrying until
    /// `timeout`, which also bounds the wait for the other ranks in [`Rendezvous::exchange`].
    pub fn join(env: &WorldEnv, timeout: Duration) -> Result<Rendezvous, LaunchError> {
        let server = if env.rank == 0 {
            Some(RendezvousServer::start(
                &env.master_addr,
                env.master_port,
                env.world_size,
                timeout,
            )?)
        } else {
            None
        };
        let mut me = Rendezvous::connect(
            &env.master_addr,
            env.master_port,
            env.rank,
            env.world_size,
            timeout,
        )?;
        me.server = server;
        Ok(me)
    }

    /// Connects to a store at `host:port` hosted by someone else, as `rank` of `world_size`,
    /// retrying until `timeout`.
    pub fn connect(
        host: &str,
        port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Rendezvous, LaunchError> {
        let shown = host_port(host, port);
        let fail = |detail| store_err(&shown, detail);
        let targets: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| fail(format!("cannot resolve `{host}`: {e}")))?
            .collect();
        if targets.is_empty() {
            return Err(fail(format!("`{host}` resolves to no address")));
        }
        let deadline = Instant::now().checked_add(timeout);
        let mut last: Option<io::Error> = None;
        let stream = 'found: loop {
            for addr in &targets {
                let Some(left) = remaining(deadline) else {
                    let last = last.map_or_else(String::new, |e| format!(" (last error: {e})"));
                    return Err(fail(format!(
                        "rank {rank}: no store answered within {timeout:?}{last}; is rank 0 \
                         running, and do MASTER_ADDR/MASTER_PORT point at it?"
                    )));
                };
                match TcpStream::connect_timeout(addr, left.min(Duration::from_secs(1))) {
                    // Retrying a local port nobody listens on yet can connect a socket to
                    // itself (TCP simultaneous open); that is not the store.
                    Ok(s) if s.local_addr().ok() == s.peer_addr().ok() => {}
                    Ok(s) => break 'found s,
                    Err(e) => last = Some(e),
                }
            }
            thread::sleep(RETRY);
        };
        stream
            .set_nodelay(true)
            .map_err(|e| fail(format!("rank {rank}: {e}")))?;
        Ok(Rendezvous {
            stream,
            shown,
            rank,
            world_size,
            deadline,
            server: None,
        })
    }

    /// This host's address on the route to the store: where peers can reach this rank, so
    /// the address to bind the data plane's listeners on.
    pub fn local_ip(&self) -> IpAddr {
        self.stream
            .local_addr()
            .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip())
    }

    /// Registers `addrs` (and, on rank 0, `bootstrap`; ignored elsewhere) with the
    /// fingerprint of this rank's `plan` (at most 1 KiB; every rank's must be equal), and waits
    /// for the table. On rank 0, also waits for its store to finish answering.
    pub fn exchange(
        self,
        plan: &[u8],
        addrs: &[SocketAddr],
        bootstrap: Option<&[u8]>,
    ) -> Result<RendezvousTable, LaunchError> {
        let Rendezvous {
            mut stream,
            shown,
            rank,
            world_size,
            deadline,
            server,
        } = self;
        let fail = |detail| store_err(&shown, detail);
        let answer = (|| -> io::Result<Result<RendezvousTable, String>> {
            let wait = remaining(deadline).map_or(ANSWER_SLACK, |l| l.saturating_add(ANSWER_SLACK));
            stream.set_read_timeout(Some(wait))?;
            stream.set_write_timeout(Some(wait))?;
            let mut msg = Vec::new();
            msg.extend_from_slice(REGISTER);
            msg.extend_from_slice(&VERSION.to_le_bytes());
            put_u64(&mut msg, rank as u64);
            put_u64(&mut msg, world_size as u64);
            put_bytes(&mut msg, &plan[..plan.len().min(MAX_PLAN as usize)]);
            put_u64(&mut msg, addrs.len() as u64);
            for a in addrs {
                put_bytes(&mut msg, a.to_string().as_bytes());
            }
            let bootstrap = bootstrap.filter(|_| rank == 0);
            msg.push(u8::from(bootstrap.is_some()));
            put_bytes(&mut msg, bootstrap.unwrap_or_default());
            stream.write_all(&msg)?;
            read_answer(&mut stream)
        })();
        let client = match answer {
            Ok(Ok(table)) if table.addrs.len() == world_size => Ok(table),
            Ok(Ok(table)) => Err(fail(format!(
                "the store answered with {} ranks, expected {world_size}",
                table.addrs.len()
            ))),
            Ok(Err(detail)) => Err(fail(detail)),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(fail(format!(
                    "rank {rank}: no answer from the store in time"
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(fail(format!(
                "rank {rank}: the store closed the connection (did rank 0 fail?)"
            ))),
            Err(e) => Err(fail(format!("rank {rank}: {e}"))),
        };
        // On success the store has answered everyone and is finishing. On failure it keeps
        // answering latecomers until its deadline: leave it (it ends with the process).
        let table = client?;
        server.map_or(Ok(()), RendezvousServer::wait)?;
        Ok(table)
    }
}

/// Binds the store: `host:port` if `host` is an address of this machine, else every interface
/// of the same family on `port`.
fn bind_store(host: &str, port: u16) -> io::Result<TcpListener> {
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("`{host}` has no address"));
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = e,
        }
    }
    if last.kind() == io::ErrorKind::AddrNotAvailable {
        if let Some(a) = addrs.first() {
            let any = match a {
                SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            };
            return TcpListener::bind(SocketAddr::new(any, port));
        }
    }
    Err(last)
}

fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    match deadline {
        None => Some(Duration::MAX),
        Some(d) => Some(d.saturating_duration_since(Instant::now())).filter(|r| !r.is_zero()),
    }
}

/// An error of the store at `shown` (`host:port`).
fn store_err(shown: &str, detail: String) -> LaunchError {
    LaunchError::Rendezvous {
        addr: shown.to_string(),
        detail,
    }
}

/// The store's loop (see the module docs). After a fatal inconsistency it keeps answering
/// latecomers with the same error until the deadline, so every rank reports the cause.
fn serve(
    listener: TcpListener,
    world: usize,
    timeout: Duration,
    deadline: Option<Instant>,
    shown: &str,
) -> Result<(), LaunchError> {
    let fail = |detail| store_err(shown, detail);
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(format!("store: {e}")))?;
    let (tx, rx) = mpsc::channel::<(TcpStream, Option<Registration>)>();
    let mut slots: Vec<Option<(TcpStream, Registration)>> = (0..world).map(|_| None).collect();
    let mut failure: Option<String> = None;
    loop {
        if failure.is_none() && slots.iter().all(Option::is_some) {
            break;
        }
        if remaining(deadline).is_none() {
            if failure.is_none() {
                let missing: Vec<usize> = (0..world).filter(|&r| slots[r].is_none()).collect();
                let have: Vec<usize> = (0..world).filter(|&r| slots[r].is_some()).collect();
                let why = format!(
                    "timed out after {timeout:?} waiting for ranks {missing:?} to register \
                     (registered: {have:?})"
                );
                for (s, _) in slots.iter_mut().filter_map(Option::take) {
                    answer(s, &error_answer(&why));
                }
                failure = Some(why);
            }
            break;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                let tx = tx.clone();
                // A thread per connection, so a silent connection cannot hold up the rest.
                let spawned = thread::Builder::new()
                    .name("shardc-rendezvous-conn".into())
                    .spawn(move || {
                        let mut stream = stream;
                        let reg = read_registration(&mut stream, deadline);
                        let _ = tx.send((stream, reg)); // The store may have finished.
                    });
                if let Err(e) = spawned {
                    failure.get_or_insert(format!("store: {e}"));
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => {
                failure.get_or_insert(format!("store: accept: {e}"));
            }
        }
        while let Ok((stream, reg)) = rx.try_recv() {
            let Some(reg) = reg else { continue }; // Not a shardc rank.
            if failure.is_none() {
                match check(&reg, world, &slots) {
                    Ok(()) => {
                        let r = reg.rank;
                        slots[r] = Some((stream, reg));
                        continue;
                    }
                    Err(why) => failure = Some(why),
                }
            }
            let why = failure.as_deref().expect("invariant: set above");
            answer(stream, &error_answer(why));
            for (s, _) in slots.iter_mut().filter_map(Option::take) {
                answer(s, &error_answer(why));
            }
        }
        thread::sleep(POLL);
    }
    if let Some(why) = failure {
        return Err(fail(why));
    }
    let mut msg = Vec::new();
    msg.extend_from_slice(ANSWER);
    msg.push(0);
    put_u64(&mut msg, world as u64);
    let regs: Vec<(TcpStream, Registration)> = slots.into_iter().flatten().collect();
    for (_, reg) in &regs {
        put_u64(&mut msg, reg.addrs.len() as u64);
        for a in &reg.addrs {
            put_bytes(&mut msg, a.to_string().as_bytes());
        }
    }
    let bootstrap = regs
        .first()
        .and_then(|(_, r)| r.bootstrap.as_deref())
        .unwrap_or_default();
    put_bytes(&mut msg, bootstrap);
    for (s, _) in regs {
        answer(s, &msg);
    }
    Ok(())
}

/// Whether `reg` may join the ranks registered so far; else why the rendezvous fails.
fn check(
    reg: &Registration,
    world: usize,
    slots: &[Option<(TcpStream, Registration)>],
) -> Result<(), String> {
    let r = reg.rank;
    if reg.world != world {
        return Err(format!(
            "rank {r} registered with a world size of {} but the store (rank 0) expects \
             {world}; do all ranks have the same WORLD_SIZE?",
            reg.world
        ));
    }
    if r >= world {
        return Err(format!(
            "a rank registered as rank {r} in a world of {world}"
        ));
    }
    if slots[r].is_some() {
        return Err(format!(
            "rank {r} registered twice (two processes with RANK={r}?)"
        ));
    }
    if let Some((_, first)) = slots.iter().flatten().min_by_key(|(_, g)| g.rank) {
        if first.plan != reg.plan {
            return Err(format!(
                "rank {r} joined with plan {} but rank {} with plan {}: every rank must run the \
                 same plan (same command, model, mesh and options)",
                hex(&reg.plan),
                first.rank,
                hex(&first.plan)
            ));
        }
    }
    Ok(())
}

/// The first 8 bytes of a fingerprint as hex (enough to tell two apart).
fn hex(b: &[u8]) -> String {
    if b.is_empty() {
        return "(none)".into();
    }
    b.iter().take(8).map(|x| format!("{x:02x}")).collect()
}

fn error_answer(why: &str) -> Vec<u8> {
    let mut msg = Vec::new();
    msg.extend_from_slice(ANSWER);
    msg.push(1);
    put_bytes(&mut msg, why.as_bytes());
    msg
}

/// Sends `msg`, best effort: a rank that went away fails on its own.
fn answer(mut stream: TcpStream, msg: &[u8]) {
    let _ = stream.set_write_timeout(Some(ANSWER_SLACK));
    let _ = stream.write_all(msg);
}

fn put_u64(out: &mut Vec<u8>, x: u64) {
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u64(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn get_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn get_bytes(r: &mut impl Read, max: u64) -> io::Result<Vec<u8>> {
    let n = get_u64(r)?;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("field of {n} bytes exceeds {max}"),
        ));
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn get_addr(r: &mut impl Read) -> io::Result<SocketAddr> {
    let b = get_bytes(r, MAX_STR)?;
    std::str::from_utf8(&b)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a socket address"))
}

/// Reads a registration; `None` for anything that is not one.
fn read_registration(stream: &mut TcpStream, deadline: Option<Instant>) -> Option<Registration> {
    stream.set_nonblocking(false).ok()?;
    stream.set_read_timeout(Some(remaining(deadline)?)).ok()?;
    let mut head = [0u8; 8];
    stream.read_exact(&mut head).ok()?;
    if &head[..4] != REGISTER || u32::from_le_bytes([head[4], head[5], head[6], head[7]]) != VERSION
    {
        return None;
    }
    let rank = get_u64(stream).ok()?;
    let world = get_u64(stream).ok()?;
    if world > MAX_WORLD || rank > MAX_WORLD {
        return None;
    }
    let plan = get_bytes(stream, MAX_PLAN).ok()?;
    let n = get_u64(stream).ok().filter(|&n| n <= MAX_ADDRS)?;
    let addrs = (0..n)
        .map(|_| get_addr(stream))
        .collect::<io::Result<Vec<_>>>()
        .ok()?;
    let mut has = [0u8; 1];
    stream.read_exact(&mut has).ok()?;
    let bytes = get_bytes(stream, MAX_BOOTSTRAP).ok()?;
    Some(Registration {
        rank: rank as usize,
        world: world as usize,
        plan,
        addrs,
        bootstrap: (has[0] != 0).then_some(bytes),
    })
}

/// Reads the store's answer: the table, or the store's error message.
fn read_answer(stream: &mut TcpStream) -> io::Result<Result<RendezvousTable, String>> {
    let mut head = [0u8; 5];
    stream.read_exact(&mut head)?;
    let corrupt = || io::Error::new(io::ErrorKind::InvalidData, "not a shardc rendezvous store");
    if &head[..4] != ANSWER {
        return Err(corrupt());
    }
    match head[4] {
        0 => {
            let world = get_u64(stream)?;
            if world > MAX_WORLD {
                return Err(corrupt());
            }
            let mut addrs = Vec::with_capacity(world as usize);
            for _ in 0..world {
                let n = get_u64(stream)?;
                if n > MAX_ADDRS {
                    return Err(corrupt());
                }
                addrs.push(
                    (0..n)
                        .map(|_| get_addr(stream))
                        .collect::<io::Result<_>>()?,
                );
            }
            let bootstrap = get_bytes(stream, MAX_BOOTSTRAP)?;
            Ok(Ok(RendezvousTable { addrs, bootstrap }))
        }
        1 => Ok(Err(
            String::from_utf8_lossy(&get_bytes(stream, 1 << 20)?).into_owned()
        )),
        _ => Err(corrupt()),
    }
}
