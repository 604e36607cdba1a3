//! The compile driver: each pass in order, one line each.
//!
//! config ─► forward graph ─► annotations (presets) ─► SPMD graph (partition + reshard)

use crate::ir::Graph;
use crate::model::{build_forward, BuildOptions, ModelConfig, ModelError};
use crate::shard::{self, Mesh, ShardError, ShardedGraph, Strategy};
use thiserror::Error;

/// What to compile.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// Sequences per batch (global).
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The mesh.
    pub mesh: Mesh,
    /// Strategies beyond the mesh axes' defaults (`sp`, ...).
    pub extra_strategies: Vec<String>,
}

/// A compiled forward program.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The logical (unsharded) graph.
    pub logical: Graph,
    /// The strategies applied.
    pub strategies: Vec<Strategy>,
    /// The SPMD program.
    pub sharded: ShardedGraph,
}

/// A compile error.
#[derive(Debug, Error)]
pub enum CompileError {
    /// Model config or graph construction.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Sharding.
    #[error(transparent)]
    Shard(#[from] ShardError),
}

/// Compiles the forward pass of `cfg` for `opts`.
pub fn compile_forward(cfg: &ModelConfig, opts: &CompileOptions) -> Result<Compiled, CompileError> {
    // 1. Strategies: mesh axis defaults plus extras; model-level divisibility.
    let strategies = shard::resolve(&opts.mesh, &opts.extra_strategies)?;
    shard::check_model(cfg, &opts.mesh, &strategies, opts.batch, opts.seq)?;
    // 2. The logical forward graph (KV heads repeated when tp exceeds them).
    let build = BuildOptions {
        batch: opts.batch,
        seq: opts.seq,
        kv_repeat: shard::kv_repeat(cfg, &opts.mesh, &strategies),
    };
    let logical = build_forward(cfg, build)
        .map_err(|e| ModelError::Unsupported(format!("building the forward graph: {e}")))?;
    // 3. Annotations from the presets.
    let ann = shard::annotate(&logical, &opts.mesh, &strategies);
    // 4. SPMD partitioning: propagate layouts, insert reshards.
    let sharded = shard::partition(&logical, &opts.mesh, &ann)?;
    Ok(Compiled {
        logical,
        strategies,
        sharded,
    })
}
