//! `shardc simulate`: predict a plan's step time, throughput, MFU, communication and memory on
//! a cluster it need not have. Without `--train` the compiled forward plan is replayed over
//! every rank; with `--train` one training step is modelled (backward, recomputation, ZeRO,
//! pipeline schedule) from one layer's plan.

use super::args::{at_least, check_seq, config_and_seq, ShardArgs};
use super::fmt::{bytes, thousands};
use anyhow::{anyhow, bail, Context};
use clap::Args;
use shardc::compiler::compile::simulate_training;
use shardc::compiler::compile::{compile, CompileSpec, Job};
use shardc::compiler::cost::{
    chrome_trace, forward_plan_memory, simulate_plan, AttentionImpl, Cluster, ComputeOptions,
    PipeSchedule, Recompute, SimReport, Simulation, TrainOptions,
};
use shardc::compiler::ir::DType;
use shardc::compiler::model::{
    check_budget, product, simulated_pipeline_bytes, ForwardOutput, IrWork, ModelConfig,
};
use shardc::compiler::plan::Plan;
use shardc::compiler::schedule::pp::{parse_stage_layers, ScheduleKind};
use shardc::compiler::shard::{Mesh, Strategy};
use shardc::runtime::output::Outputs;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct SimulateArgs {
    #[command(flatten)]
    pub shard: ShardArgs,
    /// Cluster profile and node count: `dgx-h100x128`, `dgx-a100`, or a `.toml` path
    /// (optionally followed by `xNODES`). Without a count, just enough nodes for the mesh.
    #[arg(long, default_value = "dgx-h100")]
    pub cluster: String,
    /// Global batch: sequences per forward pass, or per optimizer step with --train
    /// (`--global-batch` is the same flag) [default: 8; with --train, 8 micro-batches per
    /// data-parallel rank].
    #[arg(long, visible_alias = "global-batch")]
    pub batch: Option<usize>,
    /// Tokens per sequence (default: min(max positions, 4096)).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Forward mode: what the compiled plan returns: `last` (the last position's logits),
    /// `logits` (every position's), `hidden` (no head) or `loss` (vocabulary-parallel
    /// cross-entropy) [default: last].
    #[arg(long)]
    pub returns: Option<String>,
    /// Replay this compiled plan (`shardc compile -o`, forward or training) instead of
    /// compiling the model.
    #[arg(long, conflicts_with = "train")]
    pub plan: Option<PathBuf>,
    /// Model one training step instead of replaying the forward plan.
    #[arg(long)]
    pub train: bool,
    /// Training: sequences per micro-batch on each data-parallel rank [default: 1].
    #[arg(long, conflicts_with = "micro_batches")]
    pub micro_batch: Option<usize>,
    /// Training: micro-batches per step (per pipeline), instead of --micro-batch (the global
    /// batch = micro-batch × micro-batches × dp × ep).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// Training: activation recomputation: none, selective or full [default: none].
    #[arg(long)]
    pub recompute: Option<String>,
    /// Training: fully recompute the first N decoder layers of each pipeline chunk, the
    /// others under --recompute (Megatron-LM's `--recompute-method block
    /// --recompute-num-layers N`).
    #[arg(long, value_name = "N")]
    pub recompute_num_layers: Option<usize>,
    /// Training: ZeRO stage over the dp axis (0-3) [default: 0, or the --strategy zeroN].
    #[arg(long)]
    pub zero: Option<u8>,
    /// Training: pipeline schedule: gpipe, 1f1b, interleaved or zb-h1 [default: 1f1b].
    #[arg(long)]
    pub schedule: Option<String>,
    /// Training: model chunks per stage for the interleaved schedule [default: 2].
    #[arg(long)]
    pub virtual_stages: Option<usize>,
    /// Training, meshes with `pp`: decoder layers per chunk, e.g. `17,15` [default: the
    /// compiler's split, balanced by forward FLOPs, as `compile` and `train` use].
    #[arg(long)]
    pub stage_layers: Option<String>,
    /// Training: overlap the data-parallel gradient reduction with the last backward.
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// Training: dropout on attention probabilities and residual branches (masks kept).
    #[arg(long)]
    pub dropout: bool,
    /// Training: send whole activations between stages (no scatter/gather over tp).
    #[arg(long)]
    pub no_scatter_gather: bool,
    /// Training, mixture-of-experts on an `ep` axis: tokens routed to the busiest rank's
    /// experts over the mean (1 = balanced) [default: 1].
    #[arg(long)]
    pub moe_imbalance: Option<f64>,
    /// Print the arithmetic behind the numbers (the MoE terms of an `ep` training step).
    #[arg(long)]
    pub explain: bool,
    /// Compute dtype the f32 IR is simulated in: bf16, f16 or f32 (tf32 tensor cores)
    /// [default: a plan's own (`compile --dtype`), else bf16].
    #[arg(long)]
    pub dtype: Option<String>,
    /// Attention implementation: flash or unfused (score matrix materialised).
    #[arg(long, default_value = "flash")]
    pub attention: String,
    /// Cost elementwise ops one kernel each (no fusion of elementwise chains).
    #[arg(long)]
    pub no_fusion: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Write a Chrome trace (Perfetto: one process per rank, one track per stream).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Ranks to put in the trace: `0-15`, `0,8,16` (default: all).
    #[arg(long)]
    pub trace_ranks: Option<String>,
    /// Allow `--trace` to replace a file this command reads (still atomically).
    #[arg(long)]
    pub overwrite: bool,
}

/// The files this command reads, against which `--trace` is checked.
fn outputs(a: &SimulateArgs) -> Outputs {
    Outputs::new(a.overwrite).inputs([
        a.shard.model.as_deref(),
        a.plan.as_deref(),
        Some(Path::new(&a.cluster)),
    ])
}

fn parse_ranks(s: &str, world: usize) -> anyhow::Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |x: &str| -> anyhow::Result<usize> {
            x.trim()
                .parse()
                .with_context(|| format!("--trace-ranks: `{x}` is not a rank"))
        };
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if a > b || b >= world {
            bail!("--trace-ranks: `{part}` is outside ranks 0..{}", world - 1);
        }
        out.extend(a..=b);
    }
    Ok(out)
}

fn compute_options(a: &SimulateArgs, default: DType) -> anyhow::Result<ComputeOptions> {
    let dtype = match a.dtype.as_deref().unwrap_or(default.name()) {
        "bf16" => DType::Bf16,
        "f16" | "fp16" => DType::F16,
        "f32" | "fp32" | "tf32" => DType::F32,
        other => bail!("--dtype `{other}`: expected bf16, f16 or f32"),
    };
    let attention = match a.attention.as_str() {
        "flash" => AttentionImpl::Flash,
        "unfused" => AttentionImpl::Unfused,
        other => bail!("--attention `{other}`: expected flash or unfused"),
    };
    Ok(ComputeOptions {
        dtype,
        attention,
        dropout: a.dropout,
        fuse_elementwise: !a.no_fusion,
    })
}

/// Flags that only apply in another mode (`--plan`, `--train`, forward) are errors rather than
/// ignored.
fn check_modes(a: &SimulateArgs) -> anyhow::Result<()> {
    if a.trace_ranks.is_some() && a.trace.is_none() {
        bail!("--trace-ranks selects the ranks of --trace; give --trace too");
    }
    if a.plan.is_some() {
        let model_flags = [
            (a.shard.model.is_some(), "MODEL"),
            (a.shard.mesh.is_some(), "--mesh"),
            (!a.shard.strategy.is_empty(), "--strategy"),
            (a.shard.cp.cp_algo.is_some(), "--cp-algo"),
            (a.shard.cp.cp_balance.is_some(), "--cp-balance"),
            (a.batch.is_some(), "--batch"),
            (a.seq.is_some(), "--seq"),
            (a.returns.is_some(), "--returns"),
        ];
        if let Some((_, f)) = model_flags.iter().find(|(given, _)| *given) {
            bail!("{f} describes a model to compile; --plan replays a compiled plan as it is");
        }
    }
    let train_flags = [
        (a.micro_batch.is_some(), "--micro-batch"),
        (a.micro_batches.is_some(), "--micro-batches"),
        (a.recompute.is_some(), "--recompute"),
        (a.recompute_num_layers.is_some(), "--recompute-num-layers"),
        (a.zero.is_some(), "--zero"),
        (a.schedule.is_some(), "--schedule"),
        (a.virtual_stages.is_some(), "--virtual-stages"),
        (a.stage_layers.is_some(), "--stage-layers"),
        (a.overlap_grad_reduce, "--overlap-grad-reduce"),
        (a.no_scatter_gather, "--no-scatter-gather"),
        (a.moe_imbalance.is_some(), "--moe-imbalance"),
    ];
    if a.train && a.returns.is_some() {
        bail!("--returns is what a forward plan returns; a training step returns its loss and gradients");
    }
    if !a.train {
        if let Some((_, f)) = train_flags.iter().find(|(given, _)| *given) {
            bail!("{f} applies to training steps; add --train");
        }
    }
    Ok(())
}

/// The training options of `simulate --train`, every flag checked.
fn train_options(
    a: &SimulateArgs,
    cfg: &ModelConfig,
    mesh: &Mesh,
    seq: usize,
    extra: Vec<String>,
) -> anyhow::Result<TrainOptions> {
    let size = |n: &str| mesh.axis(n).map_or(1, |x| mesh.axis_size(x));
    // Ranks holding different tokens: dp, and ep outside the experts.
    let dp = mesh.data_ranks();
    let pp = size("pp");
    let micro_batch = match (a.micro_batch, a.micro_batches, a.batch) {
        (_, Some(m), Some(gb)) => {
            at_least("--micro-batches", m, 1)?;
            at_least("--global-batch", gb, 1)?;
            if gb % (dp * m) != 0 {
                bail!(
                    "--micro-batches {m}: the global batch {gb} does not split into {m} \
                     micro-batches on each of the {dp} data-parallel rank(s) (dp × ep)"
                );
            }
            gb / (dp * m)
        }
        (_, Some(_), None) => {
            bail!("--micro-batches: give the global batch too (--global-batch), or --micro-batch")
        }
        (size, None, _) => size.unwrap_or(1),
    };
    at_least("--micro-batch", micro_batch, 1)?;
    let gb = match a.batch {
        Some(g) => g,
        None => product(&[8, dp as u128, micro_batch as u128])
            .try_into()
            .context(
                "--micro-batch: the default global batch (8 per data-parallel rank) overflows",
            )?,
    };
    at_least("--global-batch", gb, 1)?;
    cfg.check_activations(
        &format!("--micro-batch {micro_batch} × --seq {seq}"),
        micro_batch,
        seq,
    )?;
    let mut t = TrainOptions::new(gb, micro_batch, seq);
    let recompute = a.recompute.as_deref().unwrap_or("none");
    t.recompute = Recompute::from_name(recompute)
        .with_context(|| format!("--recompute `{recompute}`: expected none, selective or full"))?;
    t.recompute_layers = super::args::recompute_layers(a.recompute_num_layers, t.recompute)?;
    // --strategy: known names, one ZeRO stage, which --zero may repeat but not contradict.
    let mut zero_strategy = None;
    for name in extra.iter().flat_map(|e| e.split(',')).map(str::trim) {
        if name.is_empty() {
            continue;
        }
        let s = Strategy::from_name(name)?;
        if s.zero_stage() > 0 {
            if let Some(z) = zero_strategy.filter(|&z: &Strategy| z != s) {
                bail!(
                    "--strategy: `{z}` and `{s}` conflict: choose one ZeRO stage (zero1, zero2, \
                     zero3 or fsdp, which is zero3)"
                );
            }
            zero_strategy = Some(s);
        }
    }
    t.zero = match (a.zero, zero_strategy) {
        (Some(z), _) if z > 3 => bail!("--zero: must be 0, 1, 2 or 3 (found {z})"),
        (Some(z), Some(s)) if z != s.zero_stage() => {
            bail!(
                "--zero {z} contradicts --strategy {s} (ZeRO stage {})",
                s.zero_stage()
            )
        }
        (Some(z), _) => z,
        (None, s) => s.map_or(0, Strategy::zero_stage),
    };
    let schedule = a.schedule.as_deref().unwrap_or("1f1b");
    let kind = ScheduleKind::from_name(schedule).map_err(|e| anyhow!("--schedule: {e}"))?;
    if let Some(v) = a.virtual_stages {
        at_least("--virtual-stages", v, 1)?;
        if v > 1 && kind != ScheduleKind::Interleaved {
            bail!(
                "--virtual-stages {v} applies to --schedule interleaved (the {schedule} schedule \
                 runs one chunk per pipeline rank)"
            );
        }
    }
    let v = a.virtual_stages.unwrap_or(2);
    t.schedule = PipeSchedule::of(kind, v);
    // The simulated pipeline's passes, before they are allocated.
    let m = gb / (dp * micro_batch).max(1);
    let v = if pp > 1 { t.schedule.chunks() } else { 1 };
    check_budget(simulated_pipeline_bytes(pp, m, v), || {
        format!("--global-batch {gb}: {m} micro-batches × pp={pp} × {v} chunk(s): the simulated pipeline")
    })?;
    if let Some(text) = &a.stage_layers {
        if pp < 2 {
            bail!("--stage-layers needs a mesh with a pp axis (mesh is {mesh})");
        }
        let layers = parse_stage_layers(text, cfg.layers, pp * v)
            .map_err(|e| anyhow!("--stage-layers: {e}"))?;
        t.stage_layers = Some(layers);
    }
    t.overlap_grad_reduce = a.overlap_grad_reduce;
    t.scatter_gather = !a.no_scatter_gather;
    if let Some(f) = a.moe_imbalance {
        if !(f.is_finite() && f >= 1.0) {
            bail!(
                "--moe-imbalance {f}: the busiest rank's routed tokens over the mean, at least 1"
            );
        }
        if size("ep") < 2 {
            bail!(
                "--moe-imbalance applies to experts split over an `ep` mesh axis (mesh is {mesh})"
            );
        }
        t.moe_imbalance = f;
    }
    t.strategies = extra;
    Ok(t)
}

pub fn run(a: SimulateArgs) -> anyhow::Result<()> {
    check_modes(&a)?;
    if let Some(out) = &a.trace {
        outputs(&a).check_file("--trace", out)?;
    }
    if let Some(p) = &a.plan {
        let plan = Plan::load(p).with_context(|| format!("reading {}", p.display()))?;
        let copts = compute_options(&a, plan.dtype)?;
        let cluster = Cluster::resolve_for(&a.cluster, plan.mesh.world_size())?;
        let sim = simulate_plan(&plan, &cluster, &copts)?;
        return finish(&a, &sim);
    }
    let copts = compute_options(&a, DType::Bf16)?;
    let path = a.shard.model_path();
    let (cfg, seq) = config_and_seq(&path, a.seq)?;
    check_seq("--seq", seq, &cfg)?;
    let source = path.display().to_string();
    // The mesh's world size decides the default node count; parse it once with a provisional
    // node size, then again with the cluster's.
    let (mesh_text, extra) = a.shard.mesh_and_strategies()?;
    let world = Mesh::parse(&mesh_text, 8)?.world_size();
    let cluster = Cluster::resolve_for(&a.cluster, world)?;
    let mesh = Mesh::parse(&mesh_text, cluster.gpus_per_node())?;
    let sim = if a.train {
        let t = train_options(&a, &cfg, &mesh, seq, extra)?;
        simulate_training(&cfg, &source, &mesh, &t, &cluster, &copts)?
    } else {
        let batch = a.batch.unwrap_or(8);
        at_least("--batch", batch, 1)?;
        cfg.check_ir(IrWork::Forward).map_err(|e| e.at(&path))?;
        cfg.check_activations(&format!("--batch {batch} × --seq {seq}"), batch, seq)?;
        let opts = super::args::options(
            &cfg,
            Some(&mesh_text),
            &extra,
            batch,
            seq,
            cluster.gpus_per_node(),
        )?;
        let mut spec = CompileSpec::new(cfg.clone(), source, Job::Forward(opts));
        spec.output = super::args::forward_output(a.returns.as_deref(), ForwardOutput::Last)?;
        let plan = compile(&spec)?;
        simulate_plan(&plan, &cluster, &copts)?
    };
    finish(&a, &sim)
}

/// Trace, report, fit warning.
fn finish(a: &SimulateArgs, sim: &Simulation) -> anyhow::Result<()> {
    if let Some(out) = &a.trace {
        let ranks = match &a.trace_ranks {
            Some(s) => Some(parse_ranks(s, sim.rank_timeline.len())?),
            None => None,
        };
        outputs(a).write(
            "--trace",
            out,
            chrome_trace(sim, ranks.as_deref()).as_bytes(),
        )?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&sim.report)?);
    } else {
        print_report(sim);
        if a.explain {
            if sim.report.notes.is_empty() {
                println!("explain: no terms beyond the lines above for this configuration");
            }
            for n in &sim.report.notes {
                println!("  {n}");
            }
        }
        if let Some(out) = &a.trace {
            println!("wrote {} (open in https://ui.perfetto.dev)", out.display());
        }
    }
    if !sim.report.fits {
        eprintln!("warning: {}", not_fitting(&sim.report));
    }
    Ok(())
}

/// `compile`'s fit check: an error when a rank of `plan` (as compiled, f32) exceeds the
/// device memory of `cluster`, a warning with `allow_oom`.
pub fn fit_check(plan: &Plan, cluster: &str, allow_oom: bool) -> anyhow::Result<()> {
    let c = Cluster::resolve(cluster)?;
    let m = forward_plan_memory(plan, plan.dtype);
    let device = c.device.memory();
    if m.total() <= device {
        return Ok(());
    }
    let msg = format!(
        "plan does not fit: each rank needs {} ({}) but {} has {}",
        bytes(m.total().0),
        breakdown(&m),
        c.device.name,
        bytes(device.0)
    );
    if allow_oom {
        eprintln!("warning: {msg}");
        Ok(())
    } else {
        bail!("{msg}; pass --allow-oom to write it anyway")
    }
}

/// One line: which rank does not fit, by how much, and its breakdown.
pub fn not_fitting(r: &SimReport) -> String {
    let m = &r.memory_breakdown;
    format!(
        "does not fit: rank {} needs {} ({}) but {} has {}",
        r.peak_memory_rank,
        bytes(r.peak_memory_bytes_per_rank),
        breakdown(m),
        r.device,
        bytes(r.device_memory_bytes)
    )
}

fn breakdown(m: &shardc::compiler::cost::MemoryBreakdown) -> String {
    let parts = [
        ("params", m.params.0),
        ("grads", m.grads.0),
        ("optimizer", m.optimizer.0),
        ("activations", m.activations.0),
        ("transient", m.transient.0),
        ("comm buffers", m.comm_buffers.0),
    ];
    parts
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(n, b)| format!("{n} {}", bytes(*b)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else {
        format!("{:.3} ms", s * 1e3)
    }
}

fn print_report(sim: &Simulation) {
    let r = &sim.report;
    println!(
        "{} ({}) on {} ({} GPUs, {}), mesh {}, strategies {}",
        r.model,
        r.mode,
        r.cluster,
        r.gpus,
        r.device,
        r.mesh,
        if r.strategies.is_empty() {
            "none".to_string()
        } else {
            r.strategies.join(",")
        }
    );
    match (r.micro_batch, r.micro_batches) {
        (Some(b), Some(m)) => println!(
            "  batch          {} sequences × {} tokens, micro-batch {b}, {m} micro-batches per pipeline, schedule {}, recompute {}, zero {}",
            r.global_batch,
            r.seq,
            r.schedule.clone().unwrap_or_default(),
            r.recompute.clone().unwrap_or_default(),
            r.zero.unwrap_or(0)
        ),
        _ => println!("  batch          {} sequences × {} tokens ({})", r.global_batch, r.seq, r.dtype),
    }
    println!(
        "  step time      {}  ({} tokens/s, {} tokens/s/GPU)",
        secs(r.step_time_s),
        thousands(r.tokens_per_s as u64),
        thousands((r.tokens_per_s / r.gpus.max(1) as f64) as u64)
    );
    println!(
        "  throughput     {:.1} TFLOP/s per GPU (Megatron-LM count), model {:.1} TFLOP/s, MFU {:.1}%",
        r.tflops_per_gpu,
        r.model_tflops_per_gpu,
        r.mfu * 100.0
    );
    println!(
        "  compute        {}; communication {} ({} exposed, {} hidden)",
        secs(r.compute_s),
        secs(r.comm_s),
        secs(r.exposed_comm_s),
        secs(r.hidden_comm_s)
    );
    if r.mode == "train" {
        let b = r.bubble_fraction;
        println!(
            "  pipeline       {} (bubble {:.1}% of the step, {:.1}% of the ideal time as Megatron-LM counts it), optimizer {}",
            secs(r.pipeline_s),
            b * 100.0,
            if b < 1.0 { b / (1.0 - b) * 100.0 } else { f64::INFINITY },
            secs(r.optimizer_s)
        );
    }
    println!(
        "  memory / rank  {} of {} (rank {}): {}",
        bytes(r.peak_memory_bytes_per_rank),
        bytes(r.device_memory_bytes),
        r.peak_memory_rank,
        breakdown(&r.memory_breakdown)
    );
    if r.stages.len() > 1 {
        println!("  stage  layers   end        bubble     p2p exp.   dp exp.    in-flight  memory");
        for s in &r.stages {
            println!(
                "  {:<6} {:<8} {:<10} {:<10} {:<10} {:<10} {:<10} {}",
                s.stage,
                s.layers,
                secs(s.end_s),
                secs(s.bubble_s),
                secs(s.p2p_exposed_s),
                secs(s.dp_sync_exposed_s),
                s.peak_in_flight,
                bytes(s.memory.total().0)
            );
        }
    }
}
