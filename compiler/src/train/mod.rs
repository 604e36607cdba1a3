//! The training compile driver: one optimizer step of a model as an SPMD program.
//!
//! ```text
//! config ─► forward graph (one micro-batch) ─► training graph (autodiff: forward + backward
//!   of one micro-batch, accumulation, AdamW)
//!   ─► annotations (forward presets carried over, plus gradients, optimizer state and ZeRO
//!   layouts) ─► SPMD graph (partition + reshard) ─► passes: output reshards of gradients
//!   dropped, vocabulary-shard ids for embedding gradients, the rewriter
//!   (`TrainOptions::rewrite`), DDP gradient buckets ─► split: the micro-batch's program and
//!   the step's program ─► memory and communication accounting
//! ```
//!
//! The plan's size and the compile time do not depend on the number of micro-batches: the
//! graph is built for one micro-batch with the whole step's loss divisor and cut at the
//! gradient boundary ([`split_step`]); the runtime runs the micro-batch's program once per
//! micro-batch, sums its gradients and runs the step program once. A pipeline chunk is split
//! the same way, and the pipeline schedule invokes its micro-batch program (per pass) for
//! each micro-batch in flight.
//!
//! How the strategies become annotations (the sharding machinery inserts the collectives):
//! - every strategy's forward annotations apply to each micro-batch's forward values, and the
//!   same layouts to their gradients;
//! - a gradient of a replicated parameter is a partial sum over the data axes; `dp` annotates
//!   the accumulated gradient like its parameter, so it is all-reduced as soon as it is
//!   complete, then a pass groups those all-reduces into DDP buckets;
//! - `zero1`: optimizer state sharded over `dp` (one dim of each tensor); the gradient is
//!   reduce-scattered into it after the backward pass, the updated shard all-gathered;
//! - `zero2`: as `zero1`, and each micro-batch's gradient is reduce-scattered as soon as it is
//!   complete (gradients live sharded);
//! - `zero3`/`fsdp`: as `zero2`, and parameters live sharded: every forward and backward pass
//!   reads them through a `gather.<label>` node, all-gathered there and freed after use.

mod annotate;
mod comm;
mod memory;
mod passes;
mod pipe;
mod split;

pub use crate::plan::{
    boundary_name, check_boundary_types, is_received_input, sent_value, ChunkGraphs,
    CollectiveVolume, CommVolume, LayerActivations, Precision, TrainMemory,
};
pub use comm::{comm_volume, comm_volume_of};
pub use memory::memory_report;
pub use passes::{Bucket, BucketCaps};
pub(crate) use pipe::compile_pipeline_logged;
pub use pipe::{
    activation_peaks, activation_values, chunk_specs, compile_pipeline, pass_nodes, phase_index,
    CompiledPipeline, PipelineChunk, PipelineOptions,
};
pub use split::{grad_name, split_step, StepSplit};

use crate::autodiff::{build_train_graph, AutodiffError, Recompute, TrainGraph, TrainGraphOptions};
use crate::ir::{AdamWSpec, Graph, Op, ValueRole};
use crate::model::{build_forward, BuildOptions, ModelConfig, ModelError};
use crate::pass::{Pass, PassLog, VerifyError};
use crate::plan::{Plan, PlanParam, PlanStep, PlanTrain};
use crate::rewrite::{self, RewriteError, RewriteOptions, RewriteReport};
use crate::shard::{self, Annotations, Mesh, ShardError, ShardedGraph, Strategy};
use thiserror::Error;

/// The first `k` decoder layers of `forward` (a pipeline chunk's, or the whole model's).
pub(crate) fn first_layers(forward: &crate::ir::Graph, k: usize) -> Vec<u32> {
    let layers: std::collections::BTreeSet<u32> =
        forward.nodes.iter().filter_map(|n| n.layer).collect();
    layers.into_iter().take(k).collect()
}

/// What to compile.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    /// Sequences per step (global, all micro-batches).
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The mesh.
    pub mesh: Mesh,
    /// Strategies beyond the mesh axes' defaults (`sp`, `zero1`, ...).
    pub extra_strategies: Vec<String>,
    /// Micro-batches per step (gradient accumulation).
    pub micro_batches: usize,
    /// Activation checkpointing.
    pub recompute: Recompute,
    /// Full recomputation of the first `k` decoder layers of each pipeline chunk (of the
    /// step without a pipeline), the others under `recompute` (Megatron-LM's `--recompute-method
    /// block --recompute-num-layers k`).
    pub recompute_layers: Option<usize>,
    /// Optimizer.
    pub adamw: AdamWSpec,
    /// Predicted tokens per step (the loss divisor); `None`: `batch · (seq − 1)`.
    pub denom: Option<usize>,
    /// DDP bucket sizes.
    pub buckets: BucketCaps,
    /// Pipeline schedule and stages (meshes with a `pp` axis; see [`compile_pipeline`]).
    pub pipeline: PipelineOptions,
    /// The rewrite pass over the SPMD step (forward, backward and optimizer); no rules by
    /// default.
    pub rewrite: RewriteOptions,
}

impl TrainOptions {
    /// Defaults for a batch × seq step on `mesh`: one micro-batch, no recomputation, PyTorch
    /// AdamW defaults of the fixtures (lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1),
    /// DDP's bucket sizes.
    pub fn new(batch: usize, seq: usize, mesh: Mesh) -> TrainOptions {
        TrainOptions {
            batch,
            seq,
            mesh,
            extra_strategies: Vec::new(),
            micro_batches: 1,
            recompute: Recompute::None,
            recompute_layers: None,
            adamw: AdamWSpec::default(),
            denom: None,
            buckets: BucketCaps::default(),
            pipeline: PipelineOptions::default(),
            rewrite: RewriteOptions::default(),
        }
    }
}

/// A compiled training step.
#[derive(Clone, Debug)]
pub struct CompiledTrain {
    /// The forward graph of one micro-batch.
    pub forward: Graph,
    /// The logical training graph.
    pub train: TrainGraph,
    /// Strategies applied.
    pub strategies: Vec<Strategy>,
    /// ZeRO stage (0: none).
    pub zero_stage: u8,
    /// The annotations the training graph was partitioned under.
    pub annotations: Annotations,
    /// The SPMD program: every micro-batch of a pipeline chunk; one micro-batch, the gradient
    /// synchronisation and the optimizer of a step without a pipeline (see `split`).
    pub sharded: ShardedGraph,
    /// A step without a pipeline: `sharded` cut into the program run once per micro-batch
    /// and the program run once per step.
    pub split: Option<StepSplit>,
    /// DDP gradient buckets (empty unless plain `dp`), in reduction order.
    pub buckets: Vec<Bucket>,
    /// What was compiled.
    pub options: TrainOptions,
    /// The rewrite pass's report, when rules ran.
    pub report: Option<RewriteReport>,
}

impl CompiledTrain {
    /// The plan of this step, with its memory and communication accounting under `precision`.
    pub fn plan(
        &self,
        source: &str,
        model_type: &str,
        layers: usize,
        precision: Precision,
    ) -> Plan {
        let model = crate::plan::PlanModel {
            source: source.to_string(),
            model_type: model_type.to_string(),
            layers,
            batch: self.options.batch,
            seq: self.options.seq,
        };
        let strategies = self
            .strategies
            .iter()
            .map(|s| s.name().to_string())
            .collect();
        // A step without a pipeline: the micro-batch's program, then the step's.
        let program = self.split.as_ref().map_or(&self.sharded, |s| &s.micro);
        let mut plan = Plan::assemble(model, program, strategies, self.report.clone());
        plan.dtype = precision.dtype();
        // Parameters are the program's parameter inputs (local, program dtype).
        let g = &program.graph;
        plan.memory.param_bytes = g
            .ids()
            .filter(|&v| {
                let n = g.node(v);
                matches!(n.op, Op::Input { .. }) && n.role == ValueRole::Parameter
            })
            .map(|v| g.ty(v).size_bytes() as u64)
            .sum();
        plan.memory.train = Some(memory_report(self, precision));
        plan.comm = Some(match &self.split {
            Some(s) => comm_volume_of(
                &s.micro.mesh,
                &[
                    (&s.micro.graph, self.options.micro_batches as u64),
                    (&s.step.graph, 1),
                ],
            ),
            None => comm_volume(&self.sharded),
        });
        plan.train = Some(self.plan_train(0));
        plan.step = self.split.as_ref().map(|s| PlanStep::of(&s.step));
        plan
    }

    /// The plan's training section for this step as program `chunk` of its plan.
    pub(crate) fn plan_train(&self, chunk: usize) -> PlanTrain {
        let o = &self.options;
        PlanTrain {
            micro_batches: o.micro_batches,
            denom: o.denom.unwrap_or(o.batch * o.seq.saturating_sub(1)),
            adamw: o.adamw,
            recompute: o.recompute,
            recompute_layers: o.recompute_layers,
            zero_stage: self.zero_stage,
            params: self
                .train
                .params
                .iter()
                .map(|p| PlanParam::of(p, chunk))
                .collect(),
            tied: Vec::new(),
        }
    }
}

/// A training compile error.
#[derive(Debug, Error)]
pub enum TrainCompileError {
    /// Model config or forward graph.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Sharding.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// Differentiation.
    #[error(transparent)]
    Autodiff(#[from] AutodiffError),
    /// Options that do not fit together.
    #[error("{0}")]
    Options(String),
    /// A pipeline schedule or stage split that cannot be built.
    #[error(transparent)]
    Pipeline(#[from] crate::schedule::pp::PipelineError),
    /// A pass's result failed its check.
    #[error("compiler bug: {0}")]
    Verify(#[from] VerifyError),
    /// An optimizer hyperparameter outside its domain.
    #[error("AdamW {0}")]
    AdamW(#[from] crate::ir::AdamWError),
    /// Rewriting.
    #[error(transparent)]
    Rewrite(#[from] RewriteError),
}

/// Compiles one training step of `cfg` for `opts`. A mesh with a `pp` axis is compiled by
/// [`compile_pipeline`].
pub fn compile_train(
    cfg: &ModelConfig,
    opts: &TrainOptions,
) -> Result<CompiledTrain, TrainCompileError> {
    compile_train_logged(cfg, opts, &mut PassLog::default())
}

/// [`compile_train`], each pass checked by `log`.
pub(crate) fn compile_train_logged(
    cfg: &ModelConfig,
    opts: &TrainOptions,
    log: &mut PassLog,
) -> Result<CompiledTrain, TrainCompileError> {
    check_sizes(cfg, opts, 1)?;
    check_rules(opts)?;
    let strategies = shard::resolve(&opts.mesh, &opts.extra_strategies)?;
    compile_step(cfg, opts, strategies, log)
}

/// The `layout` rules (which change the parameters a rank holds) on a training step: refused
/// by name, as the step's parameters, gradients and optimizer state keep the layouts the
/// strategies declare.
pub(crate) fn check_rules(opts: &TrainOptions) -> Result<(), TrainCompileError> {
    let rules = opts.rewrite.rules.resolve()?;
    match rules.iter().find(|r| r.group() == "layout") {
        Some(r) => Err(TrainCompileError::Options(format!(
            "rewrite rule `{}` chooses a forward program's layouts (`shardc search --space \
             layers`); a training step's parameters, gradients and optimizer state keep the \
             layouts its strategies declare",
            r.name()
        ))),
        None => Ok(()),
    }
}

/// Before anything is built: the IR of `micro_batches` micro-batches (one: programs are
/// built per micro-batch) within the memory budget, the step's activations within byte
/// accounting.
pub(crate) fn check_sizes(
    cfg: &ModelConfig,
    opts: &TrainOptions,
    micro_batches: usize,
) -> Result<(), ModelError> {
    cfg.check_ir(crate::model::IrWork::Train { micro_batches })?;
    cfg.check_activations(
        &format!("batch {} × seq {}", opts.batch, opts.seq),
        opts.batch,
        opts.seq,
    )
}

/// Context parallelism's ring exchange (`--cp-algo ring`): the attentions whose K/V are
/// all-gathered over `cp` read them round the ring instead (rule `ring-attention`); any other
/// program is returned as it is. Runs after the rewriter, which does not know the ring op.
pub(crate) fn ring_pass(
    sg: ShardedGraph,
    mesh: &Mesh,
    strategies: &[Strategy],
) -> Result<ShardedGraph, shard::ShardError> {
    match shard::cp_layout(mesh, strategies) {
        Some(c) if c.algo == shard::CpAlgo::Ring => {
            passes::ring_attention(sg, mesh.axis_name(c.axis))
        }
        _ => Ok(sg),
    }
}

/// Whether the optimizer state's layout is the compiler's choice: plain data parallelism (no
/// ZeRO strategy) on a `dp` axis of more than one rank, rewritten with the
/// `weight-update-sharding` rule.
fn state_layout_is_chosen(
    opts: &TrainOptions,
    mesh: &Mesh,
    strategies: &[Strategy],
) -> Result<bool, TrainCompileError> {
    let dp = mesh.axis("dp").map(|a| mesh.axis_size(a)).unwrap_or(1);
    let plain = strategies.iter().all(|s| s.zero_stage() == 0);
    if dp < 2 || !plain || !strategies.contains(&Strategy::Dp) {
        return Ok(false);
    }
    let rules = opts.rewrite.rules.resolve()?;
    Ok(rules.iter().any(|r| r.name() == "weight-update-sharding"))
}

/// Compiles one training step of `cfg` without a pipeline.
///
/// On plain data parallelism rewritten with `weight-update-sharding`, the layout of the
/// optimizer state (the moments the step reads and writes, kept from step to step) is a choice
/// the rewrite cannot make alone: a rewrite keeps the program's interface, so the sharded
/// update it finds would have to gather the moments back to their declared whole layout. The
/// step is compiled with the state whole (DDP) and sharded over `dp` (ZeRO-1: the gradient
/// reduce-scattered, the update on each rank's slice, the weight all-gathered), both rewritten,
/// and the program the cost model weighs cheaper is kept — with the memory term on, the
/// sharded state (`1/dp` the moments and update temporaries, the same traffic); the report
/// records both costs ([`rewrite::StateLayoutChoice`]). A pipeline keeps the declared layout:
/// its chunks would choose apart, and one plan carries one ZeRO stage.
fn compile_step(
    cfg: &ModelConfig,
    opts: &TrainOptions,
    strategies: Vec<Strategy>,
    log: &mut PassLog,
) -> Result<CompiledTrain, TrainCompileError> {
    let mesh = &opts.mesh;
    if !state_layout_is_chosen(opts, mesh, &strategies)? {
        return compile_chunk(cfg, opts, mesh, strategies, None, &[], log);
    }
    let mut zero1 = strategies.clone();
    zero1.push(Strategy::Zero1);
    let (mut whole_log, mut sharded_log) = (log.fork(), log.fork());
    let whole = compile_chunk(cfg, opts, mesh, strategies, None, &[], &mut whole_log)?;
    let sharded = compile_chunk(cfg, opts, mesh, zero1, None, &[], &mut sharded_log)?;
    let cost = |c: &CompiledTrain| c.report.as_ref().map_or(0.0, |r| r.after.weighted_us);
    let choice = rewrite::StateLayoutChoice {
        whole_us: cost(&whole),
        sharded_us: cost(&sharded),
        axis: "dp".into(),
    };
    let (mut kept, kept_log, other_log) = if choice.sharded_wins() {
        (sharded, sharded_log, whole_log)
    } else {
        (whole, whole_log, sharded_log)
    };
    log.join(kept_log, other_log);
    if let Some(r) = kept.report.as_mut() {
        r.state_layout = Some(choice);
    }
    Ok(kept)
}

/// Compiles one training step of `cfg` (or of one pipeline chunk of it, `stage`) on `mesh`
/// (the mesh without its `pp` axis for a chunk) under exactly `strategies`.
pub(crate) fn compile_chunk(
    cfg: &ModelConfig,
    opts: &TrainOptions,
    mesh: &Mesh,
    strategies: Vec<Strategy>,
    stage: Option<crate::model::StageSpec>,
    tied: &[String],
    log: &mut PassLog,
) -> Result<CompiledTrain, TrainCompileError> {
    // 1. The optimizer's hyperparameters are in their domains; the micro-batch must divide.
    opts.adamw.validate()?;
    let k = opts.micro_batches;
    if k == 0 || opts.batch % k != 0 {
        return Err(TrainCompileError::Options(format!(
            "batch {} does not split into {k} micro-batches",
            opts.batch
        )));
    }
    if opts.seq < 2 {
        return Err(TrainCompileError::Options(format!(
            "sequence length {} leaves no token to predict (need at least 2)",
            opts.seq
        )));
    }
    let micro = opts.batch / k;
    shard::check_model(cfg, mesh, &strategies, micro, opts.seq).map_err(|e| match e {
        ShardError::ModelIndivisible {
            what,
            size,
            axis,
            parts,
        } if what == "batch" && k > 1 => ShardError::ModelIndivisible {
            what: "micro-batch".into(),
            size,
            axis,
            parts,
        },
        e => e,
    })?;
    let zero_stage = strategies.iter().map(|s| s.zero_stage()).max().unwrap_or(0);
    // 2. The forward graph of one micro-batch (KV heads repeated when tp exceeds them).
    let build = BuildOptions {
        batch: micro,
        seq: opts.seq,
        kv_repeat: shard::kv_repeat(cfg, mesh, &strategies),
        stage,
        output: crate::model::ForwardOutput::Logits,
        cp: shard::cp_build_order(mesh, &strategies),
    };
    let forward = build_forward(cfg, build)
        .map_err(|e| ModelError::Unsupported(format!("building the forward graph: {e}")))?;
    log.graph(Pass::Build, &forward)?;
    // 3. The training graph: forward, loss, backward per micro-batch, accumulation, AdamW.
    let denom = opts.denom.unwrap_or(opts.batch * (opts.seq - 1));
    let train = build_train_graph(
        &forward,
        &TrainGraphOptions {
            micro_batches: 1,
            denom,
            recompute: opts.recompute,
            full_layers: first_layers(&forward, opts.recompute_layers.unwrap_or(0)),
            adamw: opts.adamw,
            gather_params: zero_stage == 3,
            sync_grads: zero_stage >= 2,
            tied: tied
                .iter()
                .filter(|l| forward.params().any(|v| forward.node(v).name == **l))
                .cloned()
                .collect(),
        },
    )?;
    log.graph(Pass::Autodiff, &train.graph)?;
    // 4. Annotations: the forward presets per micro-batch, gradients, optimizer, ZeRO; a
    //    pipeline chunk's boundary tensors (activations and their gradients) are split over
    //    the data axes like its inputs (and along the sequence over cp), whole on the other
    //    axes.
    let fwd_ann = shard::annotate(&forward, mesh, &strategies);
    let mut annotations = annotate::train_annotations(&train, &fwd_ann, mesh, zero_stage);
    let data = shard::data_axes(mesh, &strategies);
    // Context parallelism keeps the activations split along the sequence across stages.
    let cp = shard::cp_layout(mesh, &strategies);
    let boundary = |rank: usize| {
        let mut s = shard::TensorSharding::split(rank, 0, &data);
        if let (Some(c), true) = (cp, rank > 2) {
            s.dims[1].push(c.axis);
        }
        s
    };
    for &v in &train.grad_in {
        let rank = train.graph.ty(v).rank();
        annotations.set(
            v,
            boundary(rank),
            "pipeline: gradient received from the next stage",
        );
    }
    // The other copy's gradient of a tied parameter arrives laid out like this copy's.
    for p in &train.params {
        let input = train
            .graph
            .input_named(&crate::autodiff::tied_input(&p.label));
        if let (Some(v), Some(mut s)) = (input, annotations.values.get(&p.grad).cloned()) {
            // The other copy sends its gradient summed over its micro-batches, before the
            // data-parallel sync (the step program's): a partial sum over the data axes, which
            // the partitioner reduces before adding it to this copy's synced gradient.
            for a in &data {
                if !s.partial.contains(a) && !s.used_axes().contains(a) {
                    s.partial.push(*a);
                }
            }
            s.partial.sort();
            annotations.set(v, s, "pipeline: the tied copy's gradient");
        }
    }
    let kk = train.micro_batches;
    for i in 0..kk {
        for base in [crate::model::STAGE_OUTPUT, crate::autodiff::PIPE_GRAD_OUT] {
            let name = crate::autodiff::input_name(base, i, kk);
            if let Some(v) = train.graph.output(&name) {
                let rank = train.graph.ty(v).rank();
                annotations.outputs.insert(name, boundary(rank));
            }
        }
    }
    log.annotated(&train.graph, mesh, &annotations)?;
    // 5. SPMD partitioning: propagate layouts, insert reshards.
    let sharded = shard::partition(&train.graph, mesh, &annotations)?;
    log.sharded(Pass::Partition, &sharded)?;
    // 6. Gradients and the loss are read in their natural layout (partial sums included).
    let sharded = passes::strip_output_reshards(sharded, |n| {
        n == "loss"
            || ValueRole::gradient_label(n).is_some()
            || n.starts_with(crate::autodiff::PIPE_LOSS)
    })?;
    // 7. Vocabulary-sharded embedding gradients read shard-local token ids.
    let sharded = passes::embedding_grad_offsets(sharded)?;
    log.sharded(Pass::GradLayout, &sharded)?;
    // 8. Rewriting: collectives split, moved, cancelled, overlapped; kernels fused. It runs
    //    on the program with its final outputs and shard-local ids (the passes above read the
    //    partitioner's node order and provenance) and keeps the names and provenance of the
    //    nodes it does not replace, which the bucket pass reads.
    let (sharded, report) = if opts.rewrite.rules.resolve()?.is_empty() {
        (sharded, None)
    } else {
        let r = rewrite::rewrite(&sharded, &opts.rewrite)?;
        (r.sharded, Some(r.report))
    };
    let sharded = ring_pass(sharded, mesh, &strategies)?;
    log.sharded(Pass::Rewrite, &sharded)?;
    // 9. DDP: gradient all-reduces over `dp` grouped into buckets, each reduced when ready.
    let ddp = zero_stage == 0 && strategies.contains(&Strategy::Dp);
    let (sharded, buckets) = if ddp {
        passes::ddp_buckets(sharded, &train, &opts.buckets)?
    } else {
        (sharded, Vec::new())
    };
    log.sharded(Pass::Buckets, &sharded)?;
    // 10. The micro-batch's program and the step's, cut at the gradients.
    let split = {
        let s = split_step(&sharded, &train)?;
        let check = |sg: &ShardedGraph| {
            crate::plan::check_program(&sg.graph, &sg.shardings, &sg.mesh)
                .map_err(|e| e.to_string())
        };
        log.other(
            Pass::Split,
            || check(&s.micro).and_then(|()| check(&s.step)),
            || {
                format!(
                    "// micro-batch program\n{}// step program\n{}",
                    crate::pass::sharded_text(&s.micro),
                    crate::pass::sharded_text(&s.step)
                )
            },
        )?;
        // 11. ZeRO-3 / FSDP: parameter all-gathers one layer block ahead of their use.
        let micro = passes::prefetch_param_gathers(s.micro)?;
        let s = StepSplit { micro, ..s };
        log.other(
            Pass::Prefetch,
            || check(&s.micro),
            || crate::pass::sharded_text(&s.micro),
        )?;
        Some(s)
    };
    let mut options = opts.clone();
    options.mesh = mesh.clone();
    Ok(CompiledTrain {
        forward,
        train,
        strategies,
        zero_stage,
        annotations,
        sharded,
        split,
        buckets,
        options,
        report,
    })
}
