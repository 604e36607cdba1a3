//! `shardc launch`: start one process per rank, torchrun-style, and watch them.
//!
//! `shardc launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]
//! -- <shardc args>` runs `shardc <shardc args>` N times on this node with `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` set; rank 0
//! hosts the rendezvous store at `MASTER_ADDR:MASTER_PORT`. See
//! `shardc::runtime::launch::spawn` for the failure contract.

use anyhow::bail;
use clap::Args;
use shardc::compiler::model::MAX_RANKS;
use shardc::runtime::launch::{launch, LaunchConfig};
use std::ffi::OsString;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Ranks (processes) to start on this node.
    #[arg(long)]
    nproc_per_node: usize,
    /// Nodes in the job (run `shardc launch` once per node).
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Host of rank 0 (node 0), where its rendezvous store listens.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the store (default: a free port; required with --nnodes > 1).
    #[arg(long)]
    master_port: Option<u16>,
    /// Kill every rank when the job runs longer than this many seconds (default: no limit;
    /// each rank's own `--comm-timeout` bounds its waits on peers).
    #[arg(long, value_parser = parse_secs)]
    timeout: Option<Duration>,
    /// Seconds the other ranks get to exit on their own after one fails, before being killed.
    #[arg(long, value_parser = parse_secs, default_value = "5")]
    grace: Duration,
    /// The shardc command line of every rank, after `--` (e.g. `-- run model --mesh tp=2 ...`).
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<OsString>,
}

/// Parses a positive number of seconds (`3`, `0.5`).
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let x: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(x.is_finite() && x > 0.0 && x < 1e9) {
        return Err(format!("`{s}` must be a positive number of seconds"));
    }
    Ok(Duration::from_secs_f64(x))
}

/// Most processes `launch` starts on one node.
const MAX_NPROC_PER_NODE: usize = 1024;

pub fn run(a: LaunchArgs) -> anyhow::Result<()> {
    if a.command.first().is_some_and(|c| c == "launch") {
        bail!("`shardc launch -- launch ...` would launch launchers; give the rank's command, e.g. `-- run ...`");
    }
    if a.nproc_per_node > MAX_NPROC_PER_NODE {
        bail!(
            "--nproc-per-node: at most {MAX_NPROC_PER_NODE} processes per node (found {})",
            a.nproc_per_node
        );
    }
    let world = a.nproc_per_node as u128 * a.nnodes as u128;
    if world > MAX_RANKS as u128 {
        bail!(
            "--nproc-per-node {} × --nnodes {}: {world} ranks, more than the {MAX_RANKS} supported",
            a.nproc_per_node,
            a.nnodes
        );
    }
    let program = std::env::current_exe()?;
    let cfg = LaunchConfig {
        program,
        args: a.command,
        nproc_per_node: a.nproc_per_node,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master_addr: a.master_addr,
        master_port: a.master_port,
        timeout: a.timeout,
        grace: a.grace,
    };
    let report = launch(&cfg)?;
    let (first, last) = (
        report.ranks.first().copied().unwrap_or(0),
        report.ranks.last().copied().unwrap_or(0),
    );
    eprintln!(
        "shardc launch: ranks {first}..={last} of {} finished in {:.2} s (store port {})",
        cfg.nproc_per_node * cfg.nnodes,
        report.elapsed.as_secs_f64(),
        report.master_port
    );
    Ok(())
}
