//! The compile driver: one entry, [`compile`], for forward plans, training steps and pipelined
//! training steps, as one list of named passes ([`Pass::ALL`]):
//!
//! ```text
//! build ─► autodiff* ─► annotate ─► partition ─► grad-layout* ─► rewrite ─► buckets* ─► split* ─► prefetch*
//!       ─► stages** ─► schedule ─► plan          (* training only, ** pipelines only)
//! ```
//!
//! - `build`: the logical forward graph of the model (one micro-batch; one chunk of a pipeline);
//! - `autodiff`: forward, loss, backward (per micro-batch in a pipeline chunk), AdamW;
//! - `annotate`: the strategies' layouts on parameters, inputs, gradients, optimizer state;
//! - `partition`: layouts propagated op by op, reshards (collectives) inserted: the SPMD program;
//! - `grad-layout`: gradients and the loss read in their natural layout, vocabulary-shard ids for
//!   embedding gradients;
//! - `rewrite`: the e-graph rewriter (rules selected by `--rewrite`, cost extraction);
//! - `buckets`: DDP gradient all-reduces grouped into buckets;
//! - `split`: the step cut at the gradients into the program of one micro-batch (run once per
//!   micro-batch) and the step program (gradient syncs, AdamW), so the plan does not grow
//!   with the micro-batch count;
//! - `stages`: the pipeline's chunks and each rank's instructions, verified;
//! - `schedule`: steps on streams, activation buffers in the arena, memory and communication
//!   accounting;
//! - `plan`: the serialisable [`Plan`], verified as a loaded plan would be.
//!
//! After every pass a [`PassLog`] checks the result (the IR verifier on logical graphs; on SPMD
//! programs every type re-derived, every layout of the node's rank over axes of the mesh, every
//! collective on an axis of its size; on the plan the whole loader's verifier): always in debug
//! and test builds, in release with `--verify`. A failed check is a [`CompileError::Verify`]
//! naming the pass, never a panic. `--dump-after PASS` prints the text IR after a pass.

use crate::ir::Graph;
use crate::model::{build_forward, BuildOptions, ForwardOutput, IrWork, ModelConfig, ModelError};
use crate::plan::{Plan, PlanError, PlanModel};
use crate::rewrite::{self, RewriteError, RewriteOptions, RewriteReport};
use crate::shard::{self, Mesh, ShardError, ShardedGraph, Strategy};
use crate::train::{Precision, TrainCompileError, TrainOptions};
use std::fmt::Write as _;
use thiserror::Error;

pub use crate::pass::{
    sharded_text, Pass, PassDump, PassLog, PassTiming, UnknownPass, VerifyError,
};

/// What to compile: a forward plan or a training step.
#[derive(Clone, Debug)]
pub enum Job {
    /// The forward pass.
    Forward(CompileOptions),
    /// One training step (a pipeline when the mesh has a `pp` axis of size > 1). Its
    /// `rewrite` options are replaced by the spec's ([`CompileSpec::rewrite`]).
    Train(Box<TrainOptions>),
}

/// Everything [`compile`] needs.
#[derive(Clone, Debug)]
pub struct CompileSpec {
    /// The model.
    pub model: ModelConfig,
    /// Where it came from (recorded in the plan).
    pub source: String,
    /// Forward or training.
    pub job: Job,
    /// The rewriter's rules and cost model.
    pub rewrite: RewriteOptions,
    /// Memory is accounted at this precision, and the plan's compute dtype is its
    /// ([`Precision::dtype`]: bf16 for mixed precision, the default).
    pub precision: Precision,
    /// What a forward plan returns (training steps return their loss and gradients).
    pub output: ForwardOutput,
    /// Check every pass's result (on in debug and test builds regardless).
    pub verify: bool,
    /// Dump the program after this pass.
    pub dump_after: Option<Pass>,
}

impl CompileSpec {
    /// A spec for `job` on `model`: no rewriting, mixed precision, verification as the build.
    pub fn new(model: ModelConfig, source: impl Into<String>, job: Job) -> CompileSpec {
        CompileSpec {
            model,
            source: source.into(),
            job,
            rewrite: RewriteOptions::default(),
            precision: Precision::mixed(),
            output: ForwardOutput::Logits,
            verify: cfg!(debug_assertions),
            dump_after: None,
        }
    }

    /// The training options the driver compiles: `opts` with this spec's rewrite options
    /// (the spec's are the ones that apply to every job).
    fn train_options(&self, opts: &TrainOptions) -> TrainOptions {
        TrainOptions {
            rewrite: self.rewrite.clone(),
            ..opts.clone()
        }
    }

    /// Whether the job is a pipeline (a `pp` axis of size > 1 in a training mesh).
    pub fn pipelined(&self) -> bool {
        match &self.job {
            Job::Forward(_) => false,
            Job::Train(t) => t.mesh.axis("pp").is_some_and(|p| t.mesh.axis_size(p) > 1),
        }
    }
}

/// Compiles `spec` to its plan.
pub fn compile(spec: &CompileSpec) -> Result<Plan, CompileError> {
    compile_logged(spec).map(|(plan, _)| plan)
}

/// [`compile`], returning the pass log too (dumps, timings).
pub fn compile_logged(spec: &CompileSpec) -> Result<(Plan, PassLog), CompileError> {
    let mut log = PassLog::new(spec.verify || cfg!(debug_assertions), spec.dump_after);
    if let Some(p) = spec.dump_after {
        if !p.runs_for(matches!(spec.job, Job::Train(_)), spec.pipelined()) {
            return Err(CompileError::PassNotRun(p));
        }
    }
    let cfg = &spec.model;
    let (source, model_type) = (spec.source.as_str(), cfg.arch.name());
    let plan = match &spec.job {
        Job::Forward(opts) => {
            let compiled = compile_forward_logged(cfg, opts, spec.output, &spec.rewrite, &mut log)?;
            let plan = Plan::new(&compiled, source, model_type, cfg.layers);
            log.other(Pass::Schedule, || Ok(()), || schedule_text(&plan))?;
            plan
        }
        Job::Train(opts) if spec.pipelined() => {
            let opts = &spec.train_options(opts);
            let c = crate::train::compile_pipeline_logged(cfg, opts, &mut log)?;
            log.chunk = None;
            let plan = c.plan(source, model_type, cfg.layers, spec.precision);
            log.other(Pass::Schedule, || Ok(()), || schedule_text(&plan))?;
            plan
        }
        Job::Train(opts) => {
            let opts = &spec.train_options(opts);
            let c = crate::train::compile_train_logged(cfg, opts, &mut log)?;
            let plan = c.plan(source, model_type, cfg.layers, spec.precision);
            log.other(Pass::Schedule, || Ok(()), || schedule_text(&plan))?;
            plan
        }
    };
    let mut plan = plan;
    plan.dtype = spec.precision.dtype();
    // Every plan: collectives in the same order on every rank of a group, pipeline transfers
    // matched. With verification, everything the loader checks.
    plan.check_collective_order()?;
    plan.check_pipeline()?;
    log.other(
        Pass::Plan,
        || plan.verify().map_err(|e| e.to_string()),
        || plan.to_json(),
    )?;
    Ok((plan, log))
}

impl Plan {
    /// The plan of a compiled forward program (the `schedule` and `plan` passes).
    pub fn new(c: &Compiled, source: &str, model_type: &str, layers: usize) -> Plan {
        let dims = c
            .logical
            .input_named("input_ids")
            .map(|v| (c.logical.ty(v).dim(0), c.logical.ty(v).dim(1)));
        let (batch, seq) = dims.unwrap_or((0, 0));
        let model = PlanModel {
            source: source.to_string(),
            model_type: model_type.to_string(),
            layers,
            batch,
            seq,
        };
        let strategies = c.strategies.iter().map(|s| s.name().to_string()).collect();
        Plan::assemble(model, &c.sharded, strategies, c.report.clone())
    }
}

/// The steps of a plan, one per line (the `schedule` dump).
fn schedule_text(plan: &Plan) -> String {
    let mut t = String::new();
    for (i, s) in plan.steps.iter().enumerate() {
        let _ = writeln!(t, "{i}: {s:?}");
    }
    for b in &plan.buffers {
        let _ = writeln!(t, "buffer {b:?}");
    }
    t
}

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
    /// A training step.
    #[error(transparent)]
    Train(#[from] TrainCompileError),
    /// A pass's result failed its check.
    #[error("compiler bug: {0}")]
    Verify(#[from] VerifyError),
    /// The plan fails a static check.
    #[error(transparent)]
    Plan(Box<PlanError>),
    /// `--dump-after` names no pass.
    #[error(transparent)]
    UnknownPass(#[from] UnknownPass),
    /// `--dump-after` names a pass this job does not run.
    #[error("pass `{0}` does not run for this job (autodiff, grad-layout and buckets run for --train, stages for a pp axis)")]
    PassNotRun(Pass),
}

impl From<PlanError> for CompileError {
    fn from(e: PlanError) -> CompileError {
        CompileError::Plan(Box::new(e))
    }
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
    compile_forward_logged(
        cfg,
        opts,
        ForwardOutput::Logits,
        rw,
        &mut PassLog::default(),
    )
}

/// The forward passes, each checked by `log`.
fn compile_forward_logged(
    cfg: &ModelConfig,
    opts: &CompileOptions,
    output: ForwardOutput,
    rw: &RewriteOptions,
    log: &mut PassLog,
) -> Result<Compiled, CompileError> {
    // Sizes: the IR within the memory budget, activations within byte accounting.
    cfg.check_ir(IrWork::Forward)?;
    cfg.check_activations(
        &format!("batch {} × seq {}", opts.batch, opts.seq),
        opts.batch,
        opts.seq,
    )?;
    // Strategies: mesh axis defaults plus extras; model-level divisibility.
    let strategies = shard::resolve(&opts.mesh, &opts.extra_strategies)?;
    shard::check_model(cfg, &opts.mesh, &strategies, opts.batch, opts.seq)?;
    // build: the logical forward graph (KV heads repeated when tp exceeds them).
    let build = BuildOptions {
        batch: opts.batch,
        seq: opts.seq,
        kv_repeat: shard::kv_repeat(cfg, &opts.mesh, &strategies),
        stage: None,
        output,
        cp: shard::cp_build_order(&opts.mesh, &strategies),
    };
    let logical = build_forward(cfg, build)
        .map_err(|e| ModelError::Unsupported(format!("building the forward graph: {e}")))?;
    log.graph(Pass::Build, &logical)?;
    // annotate: layouts from the presets.
    let ann = shard::annotate(&logical, &opts.mesh, &strategies);
    log.annotated(&logical, &opts.mesh, &ann)?;
    // partition: propagate layouts, insert reshards.
    let sharded = shard::partition(&logical, &opts.mesh, &ann)?;
    log.sharded(Pass::Partition, &sharded)?;
    // rewrite: collectives split, moved, cancelled, overlapped; kernels fused.
    let (sharded, report) = if rw.rules.resolve()?.is_empty() {
        (sharded, None)
    } else {
        let r = rewrite::rewrite(&sharded, rw)?;
        (r.sharded, Some(r.report))
    };
    let sharded = crate::train::ring_pass(sharded, &opts.mesh, &strategies)?;
    log.sharded(Pass::Rewrite, &sharded)?;
    Ok(Compiled {
        logical,
        strategies,
        sharded,
        report,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::TensorSharding;

    fn tiny() -> (ModelConfig, CompileOptions) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/hf-tiny/llama");
        let cfg = ModelConfig::from_path(&dir).expect("fixture");
        let opts = CompileOptions {
            batch: 2,
            seq: 8,
            mesh: Mesh::parse("tp=2", 8).expect("mesh"),
            extra_strategies: Vec::new(),
        };
        (cfg, opts)
    }

    /// A pass whose SPMD program is inconsistent is reported as a compiler bug naming the
    /// pass and the node, not a panic; with verification off it passes unchecked.
    #[test]
    fn a_broken_pass_result_is_a_verify_error_naming_the_pass() {
        let (cfg, opts) = tiny();
        let c = compile_forward(&cfg, &opts).expect("compile");
        let mut bad = c.sharded.clone();
        bad.shardings[5] = TensorSharding::replicated(7);
        let e = PassLog::new(true, None)
            .sharded(Pass::Rewrite, &bad)
            .expect_err("caught");
        assert_eq!(e.pass, Pass::Rewrite);
        assert!(e.to_string().contains("after pass `rewrite`"), "{e}");
        assert!(e.to_string().contains("shardings[5]"), "{e}");
        PassLog::new(false, None)
            .sharded(Pass::Rewrite, &bad)
            .expect("unchecked");

        let mut bad = c.sharded.clone();
        bad.graph.nodes[6].ty = crate::ir::TensorType::plain(bad.graph.nodes[6].ty.dtype, &[3]);
        let mut log = PassLog::new(true, None);
        log.chunk = Some(1);
        let e = log.sharded(Pass::Partition, &bad).expect_err("caught");
        assert!(
            e.to_string()
                .starts_with("after pass `partition` (pipeline chunk 1): program node %6"),
            "{e}"
        );
    }

    /// A dump is taken after its pass only.
    #[test]
    fn the_dump_is_of_its_pass() {
        let (cfg, opts) = tiny();
        let mut log = PassLog::new(true, Some(Pass::Partition));
        compile_forward_logged(
            &cfg,
            &opts,
            ForwardOutput::Logits,
            &RewriteOptions::default(),
            &mut log,
        )
        .expect("compile");
        assert_eq!(log.dumps.len(), 1);
        assert_eq!(log.dumps[0].pass, Pass::Partition);
        assert!(log.dumps[0].text.contains("all_reduce{axis=tp}"));
        assert_eq!(log.timings.len(), 4, "build, annotate, partition, rewrite");
    }
}

/// A training step simulated by the analytic model that could not be compiled or costed.
#[derive(Debug, Error)]
pub enum SimulateError {
    /// The two-layer plan did not compile.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// The configuration or the cost model refused it.
    #[error(transparent)]
    Cost(#[from] crate::cost::CostError),
}

/// One training step of `cfg` on `mesh` simulated by the analytic model
/// ([`crate::cost::simulate_training_on`]) on the two-layer plan it replays
/// ([`crate::cost::layer_plan_spec`]), compiled here: the cost model never compiles a model.
pub fn simulate_training(
    cfg: &ModelConfig,
    source: &str,
    mesh: &Mesh,
    t: &crate::cost::TrainOptions,
    cluster: &crate::cost::Cluster,
    copts: &crate::cost::ComputeOptions,
) -> Result<crate::cost::Simulation, SimulateError> {
    let spec = crate::cost::layer_plan_spec(cfg, mesh, t, cluster)?;
    let plan = layer_plan(cfg, source, &spec)?;
    Ok(crate::cost::simulate_training_on(
        cfg, &plan, source, mesh, t, cluster, copts,
    )?)
}

/// The two-layer plan `spec` describes, compiled (what [`simulate_training`] replays; a
/// search compiles each distinct one once).
pub fn layer_plan(
    cfg: &ModelConfig,
    source: &str,
    spec: &crate::cost::LayerPlanSpec,
) -> Result<Plan, SimulateError> {
    let compiled = compile_forward(
        &spec.model,
        &CompileOptions {
            batch: spec.batch,
            seq: spec.seq,
            mesh: spec.mesh.clone(),
            extra_strategies: spec.strategies.clone(),
        },
    )?;
    Ok(Plan::new(
        &compiled,
        source,
        cfg.arch.name(),
        spec.model.layers,
    ))
}
