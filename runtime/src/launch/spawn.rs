//! The launcher behind `shardc launch`: starts this node's ranks as child processes with the
//! torchrun environment and watches them.
//!
//! Contract:
//! - Node `node_rank` of `nnodes` runs global ranks `node_rank · nproc_per_node + i` for
//!   `i < nproc_per_node`, each with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!   `MASTER_ADDR`, `MASTER_PORT` and `GROUP_RANK` set (see [`super::env`]). Without a master
//!   port (one node only) the launcher picks a free one.
//! - Each line a rank prints is forwarded to the same stream of the launcher, prefixed
//!   `[rank i] `.
//! - When a rank exits unsuccessfully, the others get `grace` to exit on their own (they
//!   normally fail promptly, with their own message naming the collective), then the rest are
//!   killed, and [`launch`] returns [`LaunchError::RankExited`] naming the first failing rank.
//!   When the whole job runs past `timeout`, every running rank is killed
//!   ([`LaunchError::JobTimeout`]). The launcher never waits without a bound once a rank
//!   failed; without a job timeout it waits as long as the ranks run.

use super::env::{self, host_port};
use super::LaunchError;
use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How often the launcher polls its children.
const POLL: Duration = Duration::from_millis(5);

/// What to launch.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// The executable of every rank.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Ranks on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Host of rank 0 (on node 0).
    pub master_addr: String,
    /// Port of rank 0's rendezvous store; `None`: a free port (single node only).
    pub master_port: Option<u16>,
    /// Kill every rank when the job runs longer than this.
    pub timeout: Option<Duration>,
    /// After a rank fails, how long the others may take to exit before they are killed.
    pub grace: Duration,
}

/// A successful launch.
#[derive(Clone, Debug)]
pub struct LaunchReport {
    /// The global ranks this node ran.
    pub ranks: Vec<usize>,
    /// The store's port.
    pub master_port: u16,
    /// Wall time of the job.
    pub elapsed: Duration,
}

/// One child.
struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

/// Runs this node's ranks to completion (see the module docs).
pub fn launch(cfg: &LaunchConfig) -> Result<LaunchReport, LaunchError> {
    let bad = |m: String| Err(LaunchError::Config(m));
    if cfg.nproc_per_node == 0 {
        return bad("--nproc-per-node must be at least 1".into());
    }
    if cfg.nnodes == 0 {
        return bad("--nnodes must be at least 1".into());
    }
    if cfg.node_rank >= cfg.nnodes {
        return bad(format!(
            "--node-rank {} must be below --nnodes {}",
            cfg.node_rank, cfg.nnodes
        ));
    }
    if cfg.nnodes > 1 && cfg.master_port.is_none() {
        return bad("with --nnodes > 1, every node must be given the same --master-port".into());
    }
    if cfg.master_port == Some(0) {
        return bad("--master-port must be 1..=65535".into());
    }
    let world = cfg
        .nproc_per_node
        .checked_mul(cfg.nnodes)
        .ok_or_else(|| LaunchError::Config("--nproc-per-node × --nnodes overflows".into()))?;
    let master_port = match cfg.master_port {
        Some(p) => p,
        None => free_port(&cfg.master_addr)?,
    };
    let t0 = Instant::now();
    let mut ranks: Vec<Rank> = Vec::with_capacity(cfg.nproc_per_node);
    // (rank, forwarder returning when the rank's pipe closed, i.e. when it exited).
    let mut forwarders: Vec<(usize, JoinHandle<Instant>)> = Vec::new();
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local;
        let mut cmd = Command::new(&cfg.program);
        cmd.args(&cfg.args)
            .env(env::RANK, rank.to_string())
            .env(env::WORLD_SIZE, world.to_string())
            .env(env::LOCAL_RANK, local.to_string())
            .env(env::LOCAL_WORLD_SIZE, cfg.nproc_per_node.to_string())
            .env(env::MASTER_ADDR, &cfg.master_addr)
            .env(env::MASTER_PORT, master_port.to_string())
            .env(env::GROUP_RANK, cfg.node_rank.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop(&mut ranks);
                return Err(LaunchError::Io {
                    what: format!("starting rank {rank} ({})", cfg.program.display()),
                    source: e,
                });
            }
        };
        if let Some(out) = child.stdout.take() {
            forwarders.push((rank, forward(rank, out, false)));
        }
        if let Some(err) = child.stderr.take() {
            forwarders.push((rank, forward(rank, err, true)));
        }
        ranks.push(Rank {
            rank,
            child,
            status: None,
        });
    }

    let job_deadline = cfg.timeout.and_then(|t| t0.checked_add(t));
    let mut failures: Vec<(usize, String)> = Vec::new();
    let mut grace_deadline: Option<Instant> = None;
    let mut killed: Vec<usize> = Vec::new();
    let mut timed_out = false;
    loop {
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    r.status = Some(status);
                    if !status.success() {
                        failures.push((r.rank, status.to_string()));
                        grace_deadline.get_or_insert_with(|| Instant::now() + cfg.grace);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    failures.push((r.rank, format!("cannot wait for it: {e}")));
                    let _ = r.child.kill();
                    r.status = r.child.wait().ok();
                    grace_deadline.get_or_insert_with(|| Instant::now() + cfg.grace);
                }
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        let now = Instant::now();
        let grace_over = grace_deadline.is_some_and(|d| now >= d);
        let job_over = job_deadline.is_some_and(|d| now >= d);
        if grace_over || job_over {
            timed_out = job_over && !grace_over;
            killed = stop(&mut ranks);
            break;
        }
        thread::sleep(POLL);
    }
    // When each rank's pipes closed: its exit, seen by a blocked reader the moment it happens,
    // so more precise than the polling above for telling a root cause from the ranks it
    // brought down a millisecond later.
    let mut closed: Vec<(usize, Instant)> = Vec::new();
    for (rank, f) in forwarders {
        // Forwarders do not panic; a lost line is not worth failing for.
        if let Ok(at) = f.join() {
            closed.push((rank, at));
        }
    }
    let exit_time = |rank: usize| {
        closed
            .iter()
            .filter(|(r, _)| *r == rank)
            .map(|(_, at)| *at)
            .max()
    };
    failures.sort_by_key(|(rank, _)| exit_time(*rank)); // Stable: ties keep polling order.
    if let Some(((rank, status), others)) = failures.split_first() {
        return Err(LaunchError::RankExited {
            rank: *rank,
            status: status.clone(),
            others: others.to_vec(),
            killed,
        });
    }
    if timed_out {
        return Err(LaunchError::JobTimeout {
            timeout: cfg.timeout.unwrap_or_default(),
            killed,
        });
    }
    Ok(LaunchReport {
        ranks: ranks.iter().map(|r| r.rank).collect(),
        master_port,
        elapsed: t0.elapsed(),
    })
}

/// Kills and reaps every rank still running; returns their ranks.
fn stop(ranks: &mut [Rank]) -> Vec<usize> {
    let mut killed = Vec::new();
    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
        let _ = r.child.kill(); // It may have exited meanwhile; the wait below reaps it.
        r.status = r.child.wait().ok();
        killed.push(r.rank);
    }
    killed
}

/// Copies `from` line by line to the launcher's stdout or stderr, prefixed `[rank i] `;
/// returns when `from` closes, with the time it did.
fn forward(rank: usize, from: impl Read + Send + 'static, to_stderr: bool) -> JoinHandle<Instant> {
    thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return Instant::now(),
                Ok(_) => {}
            }
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            let text = String::from_utf8_lossy(&line);
            // A closed launcher stream is not the rank's failure: keep draining its pipe.
            let _ = if to_stderr {
                io::stderr()
                    .lock()
                    .write_all(format!("[rank {rank}] {text}").as_bytes())
            } else {
                io::stdout()
                    .lock()
                    .write_all(format!("[rank {rank}] {text}").as_bytes())
            };
        }
    })
}

/// A port that is free on `host` right now (the OS picks it; released before returning, so
/// another process could take it before rank 0 binds it, as with torchrun's free ports).
fn free_port(host: &str) -> Result<u16, LaunchError> {
    let io_err = |e: io::Error| LaunchError::Io {
        what: format!("finding a free port on {}", host_port(host, 0)),
        source: e,
    };
    let addrs: Vec<SocketAddr> = (host, 0).to_socket_addrs().map_err(io_err)?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("`{host}` has no address"));
    for a in addrs {
        match TcpListener::bind(a).and_then(|l| l.local_addr()) {
            Ok(bound) => return Ok(bound.port()),
            Err(e) => last = e,
        }
    }
    Err(io_err(last))
}
