//! The compile driver: each pass in order, one line each.
//!
//! config ─► forward graph ─► annotations (presets) ─► SPMD graph (partition + reshard)
//! ─► rewritten SPMD graph (egg rules + cost extraction; optional, off by default)

use crate::ir::Graph;
use crate::model::{build_forward, BuildOptions, IrWork, ModelConfig, ModelError};
use crate::rewrite::{self, RewriteError, RewriteOptions, RewriteReport};
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
    /// The rewrite pass's report, when rules ran.
    pub report: Option<RewriteReport>,
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
    /// Rewriting.
    #[error(transparent)]
    Rewrite(#[from] RewriteError),
}

/// Compiles the forward pass of `cfg` for `opts` (no rewriting).
pub fn compile_forward(cfg: &ModelConfig, opts: &CompileOptions) -> Result<Compiled, CompileError> {
    compile_forward_with(cfg, opts, &RewriteOptions::default())
}

/// Compiles the forward pass of `cfg` for `opts`, then rewrites it under `rw`.
pub fn compile_forward_with(
    cfg: &ModelConfig,
    opts: &CompileOptions,
    rw: &RewriteOptions,
) -> Result<Compiled, CompileError> {
    // 0. Sizes: the IR within the memory budget, activations within byte accounting.
    cfg.check_ir(IrWork::Forward)?;
    cfg.check_activations(
        &format!("batch {} × seq {}", opts.batch, opts.seq),
        opts.batch,
        opts.seq,
    )?;
    // 1. Strategies: mesh axis defaults plus extras; model-level divisibility.
    let strategies = shard::resolve(&opts.mesh, &opts.extra_strategies)?;
    shard::check_model(cfg, &opts.mesh, &strategies, opts.batch, opts.seq)?;
    // 2. The logical forward graph (KV heads repeated when tp exceeds them).
    let build = BuildOptions {
        batch: opts.batch,
        seq: opts.seq,
        kv_repeat: shard::kv_repeat(cfg, &opts.mesh, &strategies),
        stage: None,
    };
    let logical = build_forward(cfg, build)
        .map_err(|e| ModelError::Unsupported(format!("building the forward graph: {e}")))?;
    // 3. Annotations from the presets.
    let ann = shard::annotate(&logical, &opts.mesh, &strategies);
    // 4. SPMD partitioning: propagate layouts, insert reshards.
    let sharded = shard::partition(&logical, &opts.mesh, &ann)?;
    // 5. Rewriting: collectives split, moved, cancelled, overlapped; kernels fused.
    let (sharded, report) = if rw.rules.resolve()?.is_empty() {
        (sharded, None)
    } else {
        let r = rewrite::rewrite(&sharded, rw)?;
        (r.sharded, Some(r.report))
    };
    Ok(Compiled {
        logical,
        strategies,
        sharded,
        report,
    })
}
