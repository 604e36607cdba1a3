//! `shardc bench collectives`: nccl-tests-style collective benchmarks (size, count, type,
//! time, algbw, busbw, #wrong) for a communicator kind. The measurement is
//! `shardc::runtime::launch::bench`; this file parses and prints.

use super::launch::parse_secs;
use clap::{Args, Subcommand};
use serde_json::json;
use shardc::runtime::launch::bench::{self, BenchOptions, BenchRow, Collective, CommKind};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(Subcommand, Debug)]
enum BenchWhat {
    /// Every collective over a range of sizes, like nccl-tests: time, algbw and busbw.
    Collectives(CollectivesArgs),
}

#[derive(Args, Debug)]
struct CollectivesArgs {
    /// Communicator: thread, tcp (loopback, one thread per rank), local-gpu, nccl.
    #[arg(long, default_value = "thread", value_parser = parse_kind)]
    comm: CommKind,
    /// Ranks.
    #[arg(long, default_value_t = 2)]
    nranks: usize,
    /// Smallest size (bytes; K, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "8", value_parser = parse_bytes)]
    min_bytes: u64,
    /// Largest size (64M by default on the CPU; up to 1G and beyond if memory allows).
    #[arg(long, default_value = "64M", value_parser = parse_bytes)]
    max_bytes: u64,
    /// Each size is the previous one times this.
    #[arg(long, default_value_t = 2)]
    step_factor: u64,
    /// Most timed calls per size (fewer for slow sizes, within about 0.2 s per size).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Most warm-up calls per size.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Collectives, comma-separated (default: all_reduce, all_gather, reduce_scatter,
    /// all_to_all, broadcast, reduce).
    #[arg(long, value_delimiter = ',', value_parser = parse_op)]
    ops: Vec<Collective>,
    /// Seconds a rank waits for a peer before failing.
    #[arg(long, value_parser = parse_secs, default_value = "60")]
    timeout: Duration,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

fn parse_kind(s: &str) -> Result<CommKind, String> {
    s.parse()
        .map_err(|e: shardc::runtime::launch::LaunchError| e.to_string())
}

fn parse_op(s: &str) -> Result<Collective, String> {
    s.parse()
        .map_err(|e: shardc::runtime::launch::LaunchError| e.to_string())
}

/// Parses `8`, `64K`, `64M`, `1G`, `1GiB`, `512B` (binary multiples, as nccl-tests).
fn parse_bytes(s: &str) -> Result<u64, String> {
    shardc::compiler::model::parse_size(s)
        .ok_or_else(|| format!("`{s}` is not a positive size in bytes (e.g. 8, 64K, 1G)"))
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    match a.what {
        BenchWhat::Collectives(c) => collectives(c),
    }
}

fn collectives(a: CollectivesArgs) -> anyhow::Result<()> {
    let opts = BenchOptions {
        kind: a.comm,
        nranks: a.nranks,
        min_bytes: a.min_bytes,
        max_bytes: a.max_bytes,
        step_factor: a.step_factor,
        warmup: a.warmup,
        iters: a.iters,
        ops: if a.ops.is_empty() {
            Collective::ALL.to_vec()
        } else {
            a.ops.clone()
        },
        timeout: a.timeout,
        ..BenchOptions::default()
    };
    let rows = bench::run(&opts)?;
    if a.json {
        let out = json!({
            "comm": opts.kind.name(),
            "nranks": opts.nranks,
            "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    print_table(&opts, &rows);
    Ok(())
}

fn print_table(opts: &BenchOptions, rows: &[BenchRow]) {
    println!(
        "# shardc bench collectives: comm {}, {} ranks, sizes {}..{} B ×{}, ≤{} warm-up + ≤{} timed calls per size",
        opts.kind, opts.nranks, opts.min_bytes, opts.max_bytes, opts.step_factor, opts.warmup, opts.iters
    );
    println!("# time: slowest rank's mean per call; algbw = size/time; busbw = algbw × factor");
    println!("# (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1)");
    println!("#");
    println!(
        "# {:>12} {:>12} {:>6} {:>6} {:>5} {:>11} {:>9} {:>9} {:>7}",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
    );
    println!(
        "# {:>12} {:>12} {:>6} {:>6} {:>5} {:>11} {:>9} {:>9} {:>7}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
    let mut wrong = 0;
    for op in &opts.ops {
        let mine: Vec<&BenchRow> = rows.iter().filter(|r| r.op == *op).collect();
        if mine.is_empty() {
            continue;
        }
        println!("{op}");
        for r in &mine {
            println!(
                "  {:>12} {:>12} {:>6} {:>6} {:>5} {:>11.2} {:>9.3} {:>9.3} {:>7}",
                r.bytes,
                r.count,
                r.dtype,
                r.redop,
                r.root,
                r.time_us,
                r.algbw_gbs,
                r.busbw_gbs,
                r.wrong
            );
            wrong += r.wrong;
        }
        let avg = mine.iter().map(|r| r.busbw_gbs).sum::<f64>() / mine.len() as f64;
        println!("# {op}: avg bus bandwidth {avg:.3} GB/s");
    }
    println!(
        "# wrong values: {wrong} {}",
        if wrong == 0 { "OK" } else { "FAILED" }
    );
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    /// The suffixes are `parse_size`'s (tested with it); a size it refuses is an error
    /// naming the text.
    #[test]
    fn sizes_parse_through_parse_size() {
        assert_eq!(parse_bytes("64M"), Ok(64 << 20));
        assert_eq!(
            parse_bytes("x"),
            Err("`x` is not a positive size in bytes (e.g. 8, 64K, 1G)".to_string())
        );
        assert!(parse_bytes("0").is_err());
    }
}
