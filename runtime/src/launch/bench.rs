//! Collective benchmarks in the manner of nccl-tests, over any communicator kind.
//!
//! For each collective and each size (from `min_bytes`, times `step_factor`, up to
//! `max_bytes`), every rank first runs the collective once on a known pattern and counts the
//! elements that differ from the expected result (`#wrong`, as nccl-tests' `-c 1`), then warms
//! up, then times `iters` calls. The time of a size is the slowest rank's mean per call.
//!
//! Sizes, counts and bandwidths follow nccl-tests (`doc/PERFORMANCE.md`): `size` is the
//! largest per-rank buffer in bytes (for all_gather the gathered output, for reduce_scatter
//! the input, for all_to_all either), `count` its element count, `algbw = size / time`, and
//! `busbw = algbw · factor` with the factor of [`Collective::bus_factor`] (all_reduce
//! `2(n−1)/n`; all_gather, reduce_scatter, all_to_all `(n−1)/n`; broadcast, reduce `1`), which
//! makes busbw comparable with the hardware's link bandwidth whatever the rank count.
//!
//! The element type is f32 (the communicators' only type). The seam for other backends is
//! [`CommKind`] + [`make_group`]: `local-gpu` and `nccl` return
//! [`LaunchError::Unavailable`] until the CUDA backend implements them.

use super::LaunchError;
use crate::comm::tcp::TcpComm;
use crate::comm::thread::group;
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::rank::on_threads;
use serde::Serialize;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::str::FromStr;
use std::time::{Duration, Instant};

/// Which communicator a benchmark (or a run) uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommKind {
    /// In-process thread ranks ([`crate::comm::thread`]).
    Thread,
    /// TCP over loopback, one thread per rank ([`crate::comm::tcp`]).
    Tcp,
    /// Virtual ranks on one GPU (needs the CUDA backend).
    LocalGpu,
    /// NCCL (needs the CUDA backend).
    Nccl,
}

impl CommKind {
    /// Every kind, in the order `--help` lists them.
    pub const ALL: [CommKind; 4] = [
        CommKind::Thread,
        CommKind::Tcp,
        CommKind::LocalGpu,
        CommKind::Nccl,
    ];

    /// The kind's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            CommKind::Thread => "thread",
            CommKind::Tcp => "tcp",
            CommKind::LocalGpu => "local-gpu",
            CommKind::Nccl => "nccl",
        }
    }
}

impl fmt::Display for CommKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CommKind {
    type Err = LaunchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        by_name(&CommKind::ALL, "communicator", s, |k| k.name() == s)
    }
}

/// The first of `all` that `matches`, or an error saying `s` is no known `what` and listing
/// every name.
fn by_name<T: Copy + fmt::Display>(
    all: &[T],
    what: &str,
    s: &str,
    matches: impl Fn(T) -> bool,
) -> Result<T, LaunchError> {
    all.iter().copied().find(|&t| matches(t)).ok_or_else(|| {
        let names: Vec<String> = all.iter().map(T::to_string).collect();
        LaunchError::Config(format!(
            "unknown {what} `{s}` (expected one of {})",
            names.join(", ")
        ))
    })
}

/// The handles of one group of `n` ranks of `kind` in this process, named `name`: element `i`
/// is rank `i`; move each to its own thread.
pub fn make_group(
    kind: CommKind,
    name: &str,
    n: usize,
    timeout: Duration,
) -> Result<Vec<Box<dyn Communicator>>, LaunchError> {
    match kind {
        CommKind::Thread => Ok(group(name, n, timeout)
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect()),
        CommKind::Tcp => Ok(loopback_tcp_group(name, n, timeout)?
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect()),
        CommKind::LocalGpu | CommKind::Nccl => Err(LaunchError::Unavailable {
            kind: kind.name().to_string(),
            reason: "needs the CUDA backend, which this build does not provide yet".to_string(),
        }),
    }
}

/// A TCP group of `n` ranks over 127.0.0.1, connected by one thread per rank.
pub fn loopback_tcp_group(
    name: &str,
    n: usize,
    timeout: Duration,
) -> Result<Vec<TcpComm>, LaunchError> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| LaunchError::Io {
            what: "binding loopback listeners".into(),
            source: e,
        })?;
    let addrs = listeners
        .iter()
        .map(TcpListener::local_addr)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| LaunchError::Io {
            what: "loopback listener address".into(),
            source: e,
        })?;
    let joined = on_threads(listeners.into_iter().enumerate(), |(rank, l)| {
        TcpComm::from_listener(name, rank, n, l, &addrs, timeout)
    });
    Ok(joined
        .into_iter()
        .map(|r| r.expect("invariant: set-up threads do not panic"))
        .collect::<Result<Vec<_>, _>>()?)
}

/// A benchmarked collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// all_reduce (sum, in place).
    AllReduce,
    /// all_gather.
    AllGather,
    /// reduce_scatter (sum).
    ReduceScatter,
    /// all_to_all.
    AllToAll,
    /// broadcast from rank 0 (in place).
    Broadcast,
    /// reduce (sum) to rank 0.
    Reduce,
}

impl Collective {
    /// Every benchmarked collective, in report order.
    pub const ALL: [Collective; 6] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
        Collective::Broadcast,
        Collective::Reduce,
    ];

    /// Its name, `all_reduce`.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
        }
    }

    /// nccl-tests' bus bandwidth factor for `n` ranks: all_reduce `2(n−1)/n`; all_gather,
    /// reduce_scatter and all_to_all `(n−1)/n`; broadcast and reduce `1`.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => {
                (n - 1.0) / n
            }
            Collective::Broadcast | Collective::Reduce => 1.0,
        }
    }

    /// The reduction, as nccl-tests prints it (`none` for data movement).
    pub fn redop(self) -> &'static str {
        match self {
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce => "sum",
            _ => "none",
        }
    }

    /// The root, as nccl-tests prints it (`-1` for unrooted collectives).
    pub fn root(self) -> i64 {
        match self {
            Collective::Broadcast | Collective::Reduce => 0,
            _ => -1,
        }
    }

    /// The buffers for a nominal `bytes` on `n` ranks, rounded as nccl-tests rounds them:
    /// at least one element per rank and a multiple of `n` where the collective splits.
    pub fn layout(self, bytes: u64, n: usize) -> Layout {
        let n = n.max(1);
        let elems = usize::try_from(bytes / 4).unwrap_or(usize::MAX).max(1);
        let (count, send, recv) = match self {
            Collective::AllReduce | Collective::Broadcast | Collective::Reduce => {
                (elems, elems, elems)
            }
            Collective::AllGather => {
                let chunk = (elems / n).max(1);
                (chunk * n, chunk, chunk * n)
            }
            Collective::ReduceScatter => {
                let chunk = (elems / n).max(1);
                (chunk * n, chunk * n, chunk)
            }
            Collective::AllToAll => {
                let total = (elems / n).max(1) * n;
                (total, total, total)
            }
        };
        Layout {
            count,
            bytes: 4 * count as u64,
            send,
            recv,
        }
    }

    /// `busbw` from `algbw`.
    pub fn bus_bw(self, algbw: f64, n: usize) -> f64 {
        algbw * self.bus_factor(n)
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Collective {
    type Err = LaunchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.replace('-', "_");
        by_name(&Collective::ALL, "collective", s, |c| {
            c.name() == norm || c.name().replace('_', "") == norm
        })
    }
}

/// One rank's buffers for one size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The element count nccl-tests prints (of the largest buffer).
    pub count: usize,
    /// The size in bytes nccl-tests prints (`4 · count`).
    pub bytes: u64,
    /// Elements of the send buffer (the in-place buffer for all_reduce and broadcast).
    pub send: usize,
    /// Elements of the receive buffer.
    pub recv: usize,
}

/// What to benchmark.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Communicator kind.
    pub kind: CommKind,
    /// Ranks.
    pub nranks: usize,
    /// Smallest nominal size in bytes.
    pub min_bytes: u64,
    /// Largest nominal size in bytes.
    pub max_bytes: u64,
    /// Each size is the previous one times this (≥ 2).
    pub step_factor: u64,
    /// Most warm-up calls per size (fewer for sizes slower than a quarter of `budget`).
    pub warmup: usize,
    /// Most timed calls per size (fewer for sizes slower than `budget / iters`).
    pub iters: usize,
    /// Rough time budget of the timed calls of one size.
    pub budget: Duration,
    /// Collectives, in order.
    pub ops: Vec<Collective>,
    /// The communicators' timeout.
    pub timeout: Duration,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            kind: CommKind::Thread,
            nranks: 2,
            min_bytes: 8,
            max_bytes: 64 << 20,
            step_factor: 2,
            warmup: 5,
            iters: 20,
            budget: Duration::from_millis(200),
            ops: Collective::ALL.to_vec(),
            timeout: Duration::from_secs(60),
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    /// The collective.
    pub op: Collective,
    /// Size in bytes (see the module docs).
    pub bytes: u64,
    /// Elements.
    pub count: usize,
    /// Element type.
    #[serde(rename = "type")]
    pub dtype: &'static str,
    /// Reduction (`none` for data movement).
    pub redop: &'static str,
    /// Root (`-1` when unrooted).
    pub root: i64,
    /// Timed calls.
    pub iters: usize,
    /// Slowest rank's mean time per call, µs.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s (10⁹ bytes).
    pub algbw_gbs: f64,
    /// Bus bandwidth, GB/s.
    pub busbw_gbs: f64,
    /// Elements that differed from the expected result, over all ranks.
    pub wrong: u64,
}

/// The nominal sizes: `min`, `min · factor`, … up to `max` inclusive.
pub fn sizes(min: u64, max: u64, factor: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        out.push(s);
        match s.checked_mul(factor.max(2)) {
            Some(next) => s = next,
            None => break,
        }
    }
    out
}

/// Most ranks of one benchmark: each is a thread of this process (with its sockets for
/// `tcp`).
pub const MAX_BENCH_RANKS: usize = 1024;

/// Estimated bytes of the benchmark's buffers at its largest size: every rank's send and
/// receive buffers, with as much again for the communicator's staging copies.
pub fn buffer_bytes(opts: &BenchOptions) -> u128 {
    let n = opts.nranks.max(1);
    let per_rank = opts
        .ops
        .iter()
        .map(|op| {
            let l = op.layout(opts.max_bytes, n);
            4 * (l.send as u128 + l.recv as u128)
        })
        .max()
        .unwrap_or(0);
    2 * per_rank * n as u128
}

/// Runs the benchmark (see the module docs) on a fresh group of `opts.kind`. Refuses, before
/// allocating, more than [`MAX_BENCH_RANKS`] ranks and buffers beyond the memory budget.
pub fn run(opts: &BenchOptions) -> Result<Vec<BenchRow>, LaunchError> {
    if opts.nranks == 0 {
        return Err(LaunchError::Config("--nranks must be at least 1".into()));
    }
    if opts.nranks > MAX_BENCH_RANKS {
        return Err(LaunchError::Config(format!(
            "--nranks: at most {MAX_BENCH_RANKS} ranks, each a thread of this process (found {})",
            opts.nranks
        )));
    }
    if opts.iters == 0 {
        return Err(LaunchError::Config(
            "--iters: must be at least 1 (found 0)".into(),
        ));
    }
    if opts.min_bytes == 0 || opts.min_bytes > opts.max_bytes {
        return Err(LaunchError::Config(format!(
            "need 0 < --min-bytes ({}) ≤ --max-bytes ({})",
            opts.min_bytes, opts.max_bytes
        )));
    }
    if opts.step_factor < 2 {
        return Err(LaunchError::Config(
            "--step-factor must be at least 2".into(),
        ));
    }
    shardc_compiler::model::check_budget(buffer_bytes(opts), || {
        format!(
            "--max-bytes {} on {} ranks: the buffers",
            opts.max_bytes, opts.nranks
        )
    })
    .map_err(|e| LaunchError::Config(e.to_string()))?;
    let comms = make_group(opts.kind, "bench", opts.nranks, opts.timeout)?;
    run_on(comms, opts)
}

/// Runs the benchmark on the ranks of one in-process group (element `i` is rank `i`).
pub fn run_on(
    comms: Vec<Box<dyn Communicator>>,
    opts: &BenchOptions,
) -> Result<Vec<BenchRow>, LaunchError> {
    let n = comms.len();
    let plan: Vec<(Collective, Layout)> = opts
        .ops
        .iter()
        .flat_map(|&op| {
            let mut seen = Vec::new();
            sizes(opts.min_bytes, opts.max_bytes, opts.step_factor)
                .into_iter()
                .filter_map(move |b| {
                    let l = op.layout(b, n);
                    // Small sizes can round to the same buffers; report each once.
                    (!seen.contains(&l.count)).then(|| {
                        seen.push(l.count);
                        (op, l)
                    })
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let per_rank = on_threads(comms, |comm| {
        let out = bench_rank(comm.as_ref(), &plan, opts);
        if out.is_err() {
            // Let the peers fail promptly: dropping the handle tells them.
            drop(comm);
        }
        out
    });
    let per_rank = per_rank
        .into_iter()
        .map(|r| r.expect("invariant: bench ranks do not panic"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(plan
        .iter()
        .enumerate()
        .map(|(i, &(op, l))| {
            let secs = per_rank.iter().map(|r| r[i].secs).fold(0.0, f64::max);
            let wrong = per_rank.iter().map(|r| r[i].wrong).sum();
            let algbw = if secs > 0.0 {
                l.bytes as f64 / secs / 1e9
            } else {
                0.0
            };
            BenchRow {
                op,
                bytes: l.bytes,
                count: l.count,
                dtype: "float",
                redop: op.redop(),
                root: op.root(),
                iters: per_rank[0][i].iters,
                time_us: secs * 1e6,
                algbw_gbs: algbw,
                busbw_gbs: op.bus_bw(algbw, n),
                wrong,
            }
        })
        .collect())
}

/// One rank's result for one (collective, size).
struct Sample {
    secs: f64,
    wrong: u64,
    iters: usize,
}

/// Rank `r`'s input element `i`: small integers, so every sum is exact in f32.
fn pattern(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 17) as f32
}

fn bench_rank(
    comm: &dyn Communicator,
    plan: &[(Collective, Layout)],
    opts: &BenchOptions,
) -> Result<Vec<Sample>, CommError> {
    let mut out = Vec::with_capacity(plan.len());
    for &(op, l) in plan {
        let mut send = vec![0f32; l.send];
        let mut recv = vec![0f32; l.recv];
        // Check once on the pattern.
        fill(comm.rank(), &mut send);
        call(comm, op, &mut send, &mut recv)?;
        let wrong = count_wrong(op, comm.rank(), comm.size(), &send, &recv);
        // One warm-up call, timed; every rank adopts the slowest time, so all choose the same
        // number of calls.
        let t = Instant::now();
        call(comm, op, &mut send, &mut recv)?;
        let mut slowest = [t.elapsed().as_secs_f32().max(1e-9)];
        comm.all_reduce(&mut slowest, ReduceOp::Max)?;
        let per_call = f64::from(slowest[0]);
        let budget = opts.budget.as_secs_f64();
        let warm_more = ((budget / 4.0 / per_call) as usize).min(opts.warmup.saturating_sub(1));
        let iters = ((budget / per_call) as usize).clamp(1, opts.iters.max(1));
        for _ in 0..warm_more {
            call(comm, op, &mut send, &mut recv)?;
        }
        let mut token = [0f32];
        comm.all_reduce(&mut token, ReduceOp::Sum)?; // Start together.
        let t = Instant::now();
        for _ in 0..iters {
            call(comm, op, &mut send, &mut recv)?;
        }
        out.push(Sample {
            secs: t.elapsed().as_secs_f64() / iters as f64,
            wrong,
            iters,
        });
    }
    Ok(out)
}

fn fill(rank: usize, buf: &mut [f32]) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = pattern(rank, i);
    }
}

fn call(
    comm: &dyn Communicator,
    op: Collective,
    send: &mut [f32],
    recv: &mut [f32],
) -> Result<(), CommError> {
    match op {
        Collective::AllReduce => comm.all_reduce(send, ReduceOp::Sum),
        Collective::AllGather => comm.all_gather(send, recv),
        Collective::ReduceScatter => comm.reduce_scatter(send, recv, ReduceOp::Sum),
        Collective::AllToAll => comm.all_to_all(send, recv),
        Collective::Broadcast => comm.broadcast(send, 0),
        Collective::Reduce => comm.reduce(send, recv, ReduceOp::Sum, 0),
    }
}

/// Elements of this rank's result that differ from the definition of `op` on the pattern.
fn count_wrong(op: Collective, rank: usize, n: usize, send: &[f32], recv: &[f32]) -> u64 {
    let sum = |i: usize| (0..n).map(|r| pattern(r, i)).sum::<f32>();
    let expected: Box<dyn Fn(usize) -> f32> = match op {
        Collective::AllReduce => Box::new(sum),
        Collective::AllGather => {
            let chunk = send.len();
            Box::new(move |j| pattern(j / chunk, j % chunk))
        }
        Collective::ReduceScatter => {
            let chunk = recv.len();
            Box::new(move |j| sum(rank * chunk + j))
        }
        Collective::AllToAll => {
            let chunk = recv.len() / n;
            Box::new(move |j| pattern(j / chunk, rank * chunk + j % chunk))
        }
        Collective::Broadcast => Box::new(|j| pattern(0, j)),
        Collective::Reduce if rank == 0 => Box::new(sum),
        Collective::Reduce => return 0,
    };
    let got = match op {
        Collective::AllReduce | Collective::Broadcast => send,
        _ => recv,
    };
    got.iter()
        .enumerate()
        .filter(|&(j, &x)| x != expected(j))
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_are_nccl_tests() {
        // nccl-tests doc/PERFORMANCE.md: allreduce 2(n-1)/n, reducescatter / allgather /
        // alltoall (n-1)/n, broadcast / reduce 1.
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        for (n, ar, ag) in [
            (1, 0.0, 0.0),
            (2, 1.0, 0.5),
            (4, 1.5, 0.75),
            (8, 1.75, 0.875),
        ] {
            assert!(close(Collective::AllReduce.bus_factor(n), ar), "n={n}");
            for c in [
                Collective::AllGather,
                Collective::ReduceScatter,
                Collective::AllToAll,
            ] {
                assert!(close(c.bus_factor(n), ag), "{c} n={n}");
            }
            assert!(close(Collective::Broadcast.bus_factor(n), 1.0));
            assert!(close(Collective::Reduce.bus_factor(n), 1.0));
        }
        // busbw of an 8-GPU all_reduce at algbw 100 GB/s: 175 GB/s.
        assert!(close(Collective::AllReduce.bus_bw(100.0, 8), 175.0));
    }

    #[test]
    fn layouts_round_like_nccl_tests() {
        let l = Collective::AllGather.layout(1 << 20, 4);
        assert_eq!(
            (l.count, l.bytes, l.send, l.recv),
            (1 << 18, 1 << 20, 1 << 16, 1 << 18)
        );
        let l = Collective::ReduceScatter.layout(8, 4); // 2 elements < 4 ranks: 1 each.
        assert_eq!((l.count, l.bytes, l.send, l.recv), (4, 16, 4, 1));
        let l = Collective::AllToAll.layout(100, 3); // 25 elements → 8 per rank.
        assert_eq!((l.count, l.send, l.recv), (24, 24, 24));
        let l = Collective::AllReduce.layout(8, 4);
        assert_eq!((l.count, l.bytes, l.send, l.recv), (2, 8, 2, 2));
    }

    #[test]
    fn sizes_double_up_to_max() {
        assert_eq!(sizes(8, 64, 2), vec![8, 16, 32, 64]);
        assert_eq!(sizes(8, 100, 4), vec![8, 32]);
        assert_eq!(sizes(1 << 30, 1 << 30, 2), vec![1 << 30]);
        assert_eq!(sizes(u64::MAX / 2 + 1, u64::MAX, 2).len(), 1);
    }

    #[test]
    fn buffers_are_refused_before_allocation() {
        let opts = BenchOptions {
            max_bytes: 1 << 40,
            ..BenchOptions::default()
        };
        // 2 ranks of 1 TiB send + receive (all_reduce's in-place buffer and its receive
        // buffer), doubled for the communicator's copies.
        assert_eq!(buffer_bytes(&opts), 2 * 2 * (2 << 40));
        let cap = shardc_compiler::model::MemoryCap {
            bytes: 16 << 30,
            source: shardc_compiler::model::CapSource::Env,
        };
        assert!(cap.check(buffer_bytes(&opts), String::new).is_err());
        let small = BenchOptions {
            max_bytes: 1 << 20,
            ..BenchOptions::default()
        };
        assert!(cap.check(buffer_bytes(&small), String::new).is_ok());
        let e = run(&BenchOptions {
            nranks: MAX_BENCH_RANKS + 1,
            ..BenchOptions::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("--nranks"), "{e}");
    }

    #[test]
    fn names_parse() {
        for c in Collective::ALL {
            assert_eq!(c.name().parse::<Collective>().unwrap(), c);
        }
        assert_eq!(
            "allreduce".parse::<Collective>().unwrap(),
            Collective::AllReduce
        );
        assert!("gather3".parse::<Collective>().is_err());
        for k in CommKind::ALL {
            assert_eq!(k.name().parse::<CommKind>().unwrap(), k);
        }
    }

    #[test]
    fn gpu_kinds_are_a_clear_error() {
        for k in [CommKind::LocalGpu, CommKind::Nccl] {
            let e = make_group(k, "x", 2, Duration::from_secs(1)).err().unwrap();
            assert!(e.to_string().contains("needs the CUDA backend"), "{e}");
        }
    }

    #[test]
    fn every_collective_checks_clean_on_thread_and_tcp_ranks() {
        for kind in [CommKind::Thread, CommKind::Tcp] {
            for n in [1, 3, 4] {
                let opts = BenchOptions {
                    kind,
                    nranks: n,
                    min_bytes: 4,
                    max_bytes: 4096,
                    step_factor: 4,
                    warmup: 1,
                    iters: 2,
                    budget: Duration::from_millis(5),
                    timeout: Duration::from_secs(20),
                    ..BenchOptions::default()
                };
                let rows = run(&opts).unwrap();
                // Tiny sizes that round to the same buffers are reported once.
                let expected: usize = Collective::ALL
                    .iter()
                    .map(|op| {
                        let mut counts: Vec<usize> = sizes(4, 4096, 4)
                            .iter()
                            .map(|&b| op.layout(b, n).count)
                            .collect();
                        counts.dedup();
                        counts.len()
                    })
                    .sum();
                assert!(expected >= 6 * 5, "{kind} n={n}");
                assert_eq!(rows.len(), expected, "{kind} n={n}");
                for r in &rows {
                    assert_eq!(r.wrong, 0, "{kind} n={n} {r:?}");
                    assert!(r.time_us > 0.0 && r.iters >= 1, "{r:?}");
                    let f = r.op.bus_factor(n);
                    assert!((r.busbw_gbs - r.algbw_gbs * f).abs() <= 1e-9 * r.algbw_gbs.max(1.0));
                    assert_eq!(r.bytes, 4 * r.count as u64);
                }
            }
        }
    }

    #[test]
    fn the_check_catches_a_wrong_result() {
        // all_gather result with one element off.
        let n = 2;
        let send: Vec<f32> = (0..3).map(|i| pattern(0, i)).collect();
        let mut recv: Vec<f32> = (0..6).map(|j| pattern(j / 3, j % 3)).collect();
        assert_eq!(count_wrong(Collective::AllGather, 0, n, &send, &recv), 0);
        recv[4] += 1.0;
        assert_eq!(count_wrong(Collective::AllGather, 0, n, &send, &recv), 1);
    }
}
