//! Subcommands.

mod compile;
mod explain;
mod fmt;
mod inspect;
mod run;
mod schedule;

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
    /// Run a model on token ids (CPU reference; `--mesh` runs the sharded plan on thread ranks).
    Run(run::RunArgs),
    /// Show a pipeline schedule: per-stage timeline, bubble fraction, in-flight micro-batches.
    Schedule(schedule::ScheduleArgs),
}

/// Runs a parsed command line.
pub fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Command::Inspect(a) => inspect::run(a),
        Command::Compile(a) => compile::run(a),
        Command::Explain(a) => explain::run(a),
        Command::Run(a) => run::run(a),
        Command::Schedule(a) => schedule::run(a),
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
