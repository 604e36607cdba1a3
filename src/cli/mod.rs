//! Subcommands.

mod args;
mod bench;
mod calibrate;
mod checkpoint;
mod compile;
mod explain;
mod fmt;
mod inspect;
mod launch;
mod run;
mod schedule;
mod search;
mod simulate;
mod train;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// Bundled default model, relative to the repository root.
pub const DEFAULT_MODEL: &str = "models/llama-3-8b.json";

/// shardc: compile transformers into sharded execution plans, run them, predict their cost.
#[derive(Parser, Debug)]
#[command(name = "shardc", version, about)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Parameters, FLOPs per token and static memory of a model.
    Inspect(inspect::InspectArgs),
    /// Compile a model for a mesh into a sharded plan (plan.json) and print a summary.
    Compile(compile::CompileArgs),
    /// Show per layer which collective sits where in a plan, and why.
    Explain(explain::ExplainArgs),
    /// Run a forward plan on token ids (CPU reference): `--plan` a compiled one, else the model
    /// compiled here (`--mesh` shards it on thread ranks).
    Run(run::RunArgs),
    /// Show a pipeline schedule: per-stage timeline, bubble fraction, in-flight micro-batches.
    Schedule(schedule::ScheduleArgs),
    /// Start one process per rank (torchrun-style env + TCP rendezvous) running a shardc
    /// command, e.g. `shardc launch --nproc-per-node 2 -- run MODEL --mesh tp=2 ...`.
    Launch(launch::LaunchArgs),
    /// Benchmarks (`bench collectives`: nccl-tests-style bandwidth of each collective).
    Bench(bench::BenchArgs),
    /// Predict step time, TFLOP/s, MFU, communication and memory on a cluster profile
    /// (`--train` for a training step), optionally with a Perfetto trace.
    Simulate(simulate::SimulateArgs),
    /// Search every layout of a training step on a cluster (dp, tp, sp, pp, cp, ep, ZeRO,
    /// recomputation, micro-batch, schedule) by the cost model: the fastest that fit, why.
    Search(search::SearchArgs),
    /// Fit a device/cluster profile to GEMM, copy and collective micro-benchmarks.
    Calibrate(calibrate::CalibrateArgs),
    /// Train on token ids (causal-LM loss, AdamW; CPU reference, `--mesh` on thread ranks) by
    /// running a training plan (`--plan` a compiled one): prints the loss per step; `--save`
    /// writes a sharded checkpoint, `--resume` continues one on any mesh.
    Train(train::TrainArgs),
    /// Sharded checkpoints: `inspect` (what one holds, the copy to another mesh), `export` (a
    /// HuggingFace directory), `import` (a HuggingFace model as step 0 on any mesh).
    Checkpoint(checkpoint::CheckpointArgs),
}

/// Runs a parsed command line.
pub fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Command::Inspect(a) => inspect::run(a),
        Command::Compile(a) => compile::run(a),
        Command::Explain(a) => explain::run(a),
        Command::Run(a) => run::run(a),
        Command::Launch(a) => launch::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Simulate(a) => simulate::run(a),
        Command::Search(a) => search::run(a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::Schedule(a) => schedule::run(a),
        Command::Train(a) => train::run(a),
        Command::Checkpoint(a) => checkpoint::run(a),
    }
}

/// The bundled default model path: relative to the working directory if it exists there,
/// else to the crate root (so `cargo run` works from any directory of the checkout).
pub fn default_model() -> PathBuf {
    let p = PathBuf::from(DEFAULT_MODEL);
    if p.exists() {
        p
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(DEFAULT_MODEL)
    }
}
