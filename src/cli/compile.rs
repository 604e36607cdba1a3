//! `shardc compile`: model + mesh + strategies → plan.json and a summary. The forward pass by
//! default; with `--train` one training step (forward, backward, AdamW per micro-batch; a
//! pipeline over a `pp` axis), from the config alone: no weights or tokens are read.

use super::args::{at_least, check_seq, config_and_seq, options, ShardArgs};
use super::fmt::{bytes, thousands};
use anyhow::{bail, Context};
use clap::Args;
use shardc::compiler::autodiff::Recompute;
use shardc::compiler::compile::{compile_logged, CompileOptions, CompileSpec, Job, Pass, PassLog};
use shardc::compiler::cost::Cluster;
use shardc::compiler::ir::DType;
use shardc::compiler::model::{ForwardOutput, IrWork, ModelConfig};
use shardc::compiler::plan::{Plan, Precision};
use shardc::compiler::rewrite::{RewriteOptions, RuleSelection};
use shardc::compiler::schedule::pp::{parse_stage_layers, PassCosts, ScheduleKind};
use shardc::compiler::train::{PipelineOptions, TrainMemory, TrainOptions};
use shardc::runtime::output::Outputs;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct CompileArgs {
    #[command(flatten)]
    pub shard: ShardArgs,
    /// Global batch: sequences per forward pass or optimizer step (`--global-batch` is the
    /// same flag, in every subcommand).
    #[arg(
        long,
        visible_alias = "global-batch",
        default_value_t = 8,
        allow_negative_numbers = true
    )]
    pub batch: usize,
    /// Sequence length (default: min(max positions, 4096)).
    #[arg(long, allow_negative_numbers = true)]
    pub seq: Option<usize>,
    /// GPUs per node (axes that fit inside a node use NVLink).
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// Where to write the plan.
    #[arg(short = 'o', long, default_value = "plan.json")]
    pub output: PathBuf,
    /// Allow `-o` to replace a file this command reads (still atomically).
    #[arg(long)]
    pub overwrite: bool,
    /// Cluster profile: every rank must fit its device memory, and the rewriter costs nodes
    /// with its rates (`dgx-h100`, `dgx-a100`, a `.toml` path).
    #[arg(long, default_value = "dgx-h100")]
    pub cluster: String,
    /// Write the plan even when a rank's memory exceeds the device's.
    #[arg(long)]
    pub allow_oom: bool,
    /// Rewrite rules: `none`, `all`, `sequence-parallel`, or rule and group names,
    /// comma-separated (e.g. `allreduce-split,gather-sink,collective-matmul`).
    #[arg(long, default_value = "none")]
    pub rewrite: String,
    /// What a forward plan returns: `last` (the last position's logits, what generation
    /// reads), `logits` (every position's: a vocabulary-parallel plan gathers them all),
    /// `hidden` (no head) or `loss` (the causal-LM loss against the input `labels`;
    /// vocabulary-parallel: no logits gathered) [default: last].
    #[arg(long)]
    pub returns: Option<String>,
    /// Compute dtype the plan is accounted in (memory, traffic, fit check, the simulator's
    /// default): bf16 as a GPU runs it, or f32; the CPU reference executes f32 either way.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Weight of the rewriter's activation-memory term, µs per MiB (0: time only).
    #[arg(long, allow_hyphen_values = true, default_value_t = shardc::compiler::rewrite::cost::DEFAULT_MEMORY_US_PER_MIB)]
    pub memory_weight: f64,
    /// Compile one training step (forward, backward, AdamW) instead of the forward pass; a
    /// mesh with a `pp` axis compiles a pipeline. Memory is accounted in mixed precision.
    #[arg(long)]
    pub train: bool,
    /// Training: micro-batches per step (gradient accumulation; the pipeline's micro-batches).
    #[arg(long, default_value_t = 1, requires = "train")]
    pub micro_batches: usize,
    /// Training: sequences per micro-batch on each data-parallel rank, instead of
    /// --micro-batches (`--global-batch` = micro-batch × micro-batches × dp × ep).
    #[arg(long, requires = "train", conflicts_with = "micro_batches")]
    pub micro_batch: Option<usize>,
    /// Training: activation checkpointing: none, full or selective.
    #[arg(long, default_value = "none", requires = "train")]
    pub recompute: String,
    /// Training: fully recompute the first N decoder layers of each pipeline chunk, the others
    /// under --recompute (Megatron-LM's `--recompute-method block --recompute-num-layers N`).
    #[arg(long, value_name = "N", requires = "train")]
    pub recompute_num_layers: Option<usize>,
    /// Training, meshes with `pp`: the schedule: gpipe, 1f1b, interleaved or zb-h1 [default: 1f1b].
    #[arg(long, requires = "train")]
    pub schedule: Option<String>,
    /// Training, meshes with `pp`: model chunks per pipeline rank for the interleaved schedule
    /// [default: 2].
    #[arg(long, requires = "train")]
    pub virtual_stages: Option<usize>,
    /// Training, meshes with `pp`: decoder layers per chunk, e.g. `21,20,20,19` (default:
    /// balanced by cost).
    #[arg(long, requires = "train")]
    pub stage_layers: Option<String>,
    /// Print the program's text IR after this pass (build, autodiff, annotate, partition,
    /// grad-layout, rewrite, buckets, split, prefetch, stages, schedule, plan) and stop before writing.
    #[arg(long, value_name = "PASS")]
    pub dump_after: Option<String>,
    /// Check every pass's result (the IR verifier, layouts, collectives, the plan as loaded);
    /// always on in debug builds.
    #[arg(long)]
    pub verify: bool,
    /// Print each pass's wall time.
    #[arg(long)]
    pub pass_times: bool,
}

/// The flags of `compile` that take a size, checked before the model is built: no zero
/// batch, sequence, node or micro-batch count, a finite non-negative memory weight, the IR and
/// activations within the limits.
fn check_args(a: &CompileArgs, cfg: &ModelConfig, path: &Path, seq: usize) -> anyhow::Result<()> {
    at_least("--batch", a.batch, 1)?;
    check_seq("--seq", seq, cfg)?;
    at_least("--gpus-per-node", a.gpus_per_node, 1)?;
    at_least("--micro-batches", a.micro_batches, 1)?;
    if !(a.memory_weight.is_finite() && a.memory_weight >= 0.0) {
        bail!(
            "--memory-weight: must be finite and >= 0 (found {})",
            a.memory_weight
        );
    }
    // One program serves every micro-batch (a pipeline chunk's too).
    let work = if a.train {
        IrWork::Train { micro_batches: 1 }
    } else {
        IrWork::Forward
    };
    cfg.check_ir(work).map_err(|e| e.at(path))?;
    cfg.check_activations(&format!("--batch {} × --seq {seq}", a.batch), a.batch, seq)?;
    Ok(())
}

pub fn run(a: CompileArgs) -> anyhow::Result<()> {
    let path = a.shard.model_path();
    let outputs =
        Outputs::new(a.overwrite).inputs([Some(path.as_path()), Some(Path::new(&a.cluster))]);
    outputs.check_file("-o", &a.output)?;
    let (cfg, seq) = config_and_seq(&path, a.seq)?;
    check_args(&a, &cfg, &path, seq)?;
    let opts = options(
        &cfg,
        a.shard.mesh.as_deref(),
        &a.shard.strategies()?,
        a.batch,
        seq,
        a.gpus_per_node,
    )?;
    let dump_after = a.dump_after.as_deref().map(Pass::from_name).transpose()?;
    let mut rw = RewriteOptions::with_rules(a.rewrite.parse::<RuleSelection>()?);
    rw.cost.memory_us_per_mib = a.memory_weight;
    rw.cost.device = Cluster::resolve(&a.cluster)?.rewrite_device();
    let job = if a.train {
        Job::Train(Box::new(train_options(&a, &cfg, opts)?))
    } else {
        Job::Forward(opts)
    };
    let mut spec = CompileSpec::new(cfg.clone(), path.display().to_string(), job);
    spec.rewrite = rw;
    if a.train && a.returns.is_some() {
        bail!("--returns is what a forward plan returns; a training step returns its loss and gradients");
    }
    spec.output = super::args::forward_output(a.returns.as_deref(), ForwardOutput::Last)?;
    spec.precision = Precision::of_dtype(match a.dtype.as_str() {
        "bf16" => DType::Bf16,
        "f32" | "fp32" => DType::F32,
        other => bail!("--dtype `{other}`: expected bf16 or f32"),
    });
    spec.verify = a.verify;
    spec.dump_after = dump_after;
    let t0 = std::time::Instant::now();
    let (plan, log) = compile_logged(&spec)?;
    if !log.dumps.is_empty() {
        for d in &log.dumps {
            match d.chunk {
                Some(c) => println!("// after pass `{}`, pipeline chunk {c}", d.pass),
                None => println!("// after pass `{}`", d.pass),
            }
            print!("{}", d.text);
        }
        return Ok(());
    }
    if a.pass_times {
        print_pass_times(&log);
    }
    if let Job::Train(opts) = &spec.job {
        return finish_train(&a, &plan, opts, t0.elapsed(), &outputs);
    }
    super::simulate::fit_check(&plan, &a.cluster, a.allow_oom)?;
    let elapsed = t0.elapsed();
    let json = plan.to_json();
    outputs.write("-o", &a.output, json.as_bytes())?;
    print_summary(&plan);
    let contents = format!("{} steps", thousands(plan.steps.len() as u64));
    print_written(&plan, &a.output, elapsed, &contents, json.len());
    Ok(())
}

/// The first line of both summaries: `model (type, N layers){what} on mesh M (R ranks, G
/// GPUs/node), strategies S, batch B × seq T`.
fn headline(plan: &Plan, what: &str) -> String {
    let strategies = plan.strategies.join(",");
    format!(
        "{} ({}, {} layers){what} on mesh {} ({} ranks, {} GPUs/node), strategies {}, batch {} × seq {}",
        plan.model.source,
        plan.model.model_type,
        plan.model.layers,
        plan.mesh,
        plan.mesh.world_size(),
        plan.mesh.gpus_per_node,
        if strategies.is_empty() {
            "none"
        } else {
            &strategies
        },
        plan.model.batch,
        plan.model.seq
    )
}

/// The summary `compile` prints (also used by `explain`).
/// The plan's context parallelism: exchange, sequence order and the causal load balance it
/// gives (the busiest rank's attention work over the mean).
fn context_parallel_line(plan: &Plan) -> Option<String> {
    use shardc::compiler::ir::SeqOrder;
    use shardc::compiler::shard::{cp_layout, CpAlgo, Strategy};
    let strategies: Vec<Strategy> = plan
        .strategies
        .iter()
        .filter_map(|s| Strategy::from_name(s).ok())
        .collect();
    let c = cp_layout(&plan.mesh, &strategies)?;
    let n = c.size;
    let contiguous = (2 * n - 1) as f64 / n as f64;
    let exchange = match c.algo {
        CpAlgo::Ring => "K/V passed round a ring (forward and backward)",
        _ => "all-gather K/V",
    };
    Some(match (c.algo, c.order) {
        (CpAlgo::Ulysses, _) => format!(
            "context parallel: cp={n}, all-to-all over heads (Ulysses): every rank attends over \
             the whole sequence for 1/{n} of the heads (balanced)"
        ),
        (_, SeqOrder::HeadTail { .. }) => format!(
            "context parallel: cp={n}, {exchange}, head-tail order (the sequence in {} \
             chunks, rank i holds chunks i and {}−i): every rank does the mean causal attention \
             work (contiguous parts would give the last rank {contiguous:.2}× the mean)",
            2 * n,
            2 * n - 1
        ),
        (_, SeqOrder::Contiguous) => format!(
            "context parallel: cp={n}, {exchange}, contiguous parts: the last rank does \
             {contiguous:.2}× the mean causal attention work and every rank waits for it \
             (--cp-balance headtail evens it)"
        ),
    })
}

pub fn print_summary(plan: &Plan) {
    println!("{}", headline(plan, ""));
    print_axes(&plan.mesh);
    if let Some(line) = context_parallel_line(plan) {
        println!("{line}");
    }
    // The program's f32 values at the plan's compute dtype.
    let dt = plan.dtype;
    let at = |b: u64| b / 4 * dt.size_bytes() as u64;
    println!(
        "per rank ({}): params {}, activations {} peak (arena), {} without reuse; norm+residual activations {}",
        if dt == DType::F32 {
            "f32".to_string()
        } else {
            format!("{}; the CPU reference runs f32", dt.name())
        },
        bytes(at(plan.memory.param_bytes)),
        bytes(at(plan.memory.activation_arena_bytes)),
        bytes(at(plan.memory.activation_total_bytes)),
        bytes(at(plan.norm_residual_bytes()))
    );
    let by_layer = plan.collectives_by_layer();
    let sig = |l: Option<u32>| -> Vec<(String, String, u64)> {
        by_layer
            .get(&l)
            .map(|v| {
                v.iter()
                    .map(|(o, a, b, _)| (o.clone(), a.clone(), *b))
                    .collect()
            })
            .unwrap_or_default()
    };
    let layers = plan.model.layers as u32;
    let first = sig(Some(0));
    let same = (1..layers).all(|l| sig(Some(l)) == first);
    let print_list = |title: String, list: &[(String, String, u64)]| {
        println!("{title}");
        if list.is_empty() {
            println!("  (none)");
        }
        for (op, axis, b) in list {
            println!("  {op:<15} {axis:<4} {:>12}", bytes(at(*b)));
        }
    };
    if layers > 0 && same {
        print_list(
            format!(
                "collectives per layer (every layer identical, {} per layer):",
                first.len()
            ),
            &first,
        );
    } else {
        for l in 0..layers {
            print_list(format!("collectives of layer {l}:"), &sig(Some(l)));
        }
    }
    print_list(
        "collectives outside layers (embedding, head, outputs):".into(),
        &sig(None),
    );
    let total: u64 = by_layer.values().flatten().map(|(_, _, b, _)| *b).sum();
    let count: usize = by_layer.values().map(Vec::len).sum();
    println!(
        "total per forward: {count} collectives, {} per rank ({})",
        bytes(at(total)),
        dt.name()
    );
}

/// The training options of `compile --train`: the forward options' mesh, strategies, batch
/// and sequence, plus micro-batches, recomputation and (meshes with `pp` > 1) the pipeline.
fn train_options(
    a: &CompileArgs,
    cfg: &ModelConfig,
    fwd: CompileOptions,
) -> anyhow::Result<TrainOptions> {
    let Some(recompute) = Recompute::from_name(&a.recompute) else {
        bail!(
            "unknown recompute mode `{}`; valid modes: none, full, selective",
            a.recompute
        );
    };
    let schedule = ScheduleKind::from_name(a.schedule.as_deref().unwrap_or("1f1b"))?;
    if fwd.seq > cfg.max_positions {
        bail!(
            "sequence length {} exceeds the model's maximum positions {}",
            fwd.seq,
            cfg.max_positions
        );
    }
    let mut t = TrainOptions::new(fwd.batch, fwd.seq, fwd.mesh);
    t.extra_strategies = fwd.extra_strategies;
    t.micro_batches = match a.micro_batch {
        Some(size) => super::args::micro_batch_count(a.batch, size, &t.mesh)?,
        None => a.micro_batches,
    };
    t.recompute = recompute;
    t.recompute_layers = super::args::recompute_layers(a.recompute_num_layers, recompute)?;
    let pp = t
        .mesh
        .axis("pp")
        .map(|x| t.mesh.axis_size(x))
        .filter(|&p| p > 1);
    let Some(p) = pp else {
        if a.schedule.is_some() || a.virtual_stages.is_some() || a.stage_layers.is_some() {
            bail!(
                "--schedule, --virtual-stages and --stage-layers need a mesh with a pp axis of \
                 size > 1 (e.g. --mesh pp=2,dp=2); mesh {} has none",
                t.mesh
            );
        }
        return Ok(t);
    };
    // Model chunks per rank: 2 for the interleaved schedule unless given (as `simulate` and
    // `schedule` default), 1 for the others.
    let v = a
        .virtual_stages
        .unwrap_or(if schedule == ScheduleKind::Interleaved {
            2
        } else {
            1
        });
    at_least("--virtual-stages", v, 1)?;
    if v > 1 && schedule != ScheduleKind::Interleaved {
        bail!(
            "--virtual-stages {v} needs --schedule interleaved (the {} schedule runs one chunk \
             per pipeline rank)",
            schedule.name()
        );
    }
    t.pipeline = PipelineOptions {
        schedule,
        virtual_stages: v,
        stage_layers: a
            .stage_layers
            .as_deref()
            .map(|s| parse_stage_layers(s, cfg.layers, p * v))
            .transpose()?,
    };
    Ok(t)
}

/// Each pass's wall time (summed over pipeline chunks), in order.
fn print_pass_times(log: &PassLog) {
    println!("passes:");
    for p in Pass::ALL {
        if log.timings.iter().any(|t| t.pass == p) {
            println!(
                "  {:<12} {:>10.2} ms",
                p.name(),
                log.time_of(p).as_secs_f64() * 1e3
            );
        }
    }
}

/// `compile --train`, after the driver: checks the memory fit, writes the plan and prints its
/// summary.
fn finish_train(
    a: &CompileArgs,
    plan: &Plan,
    opts: &TrainOptions,
    elapsed: std::time::Duration,
    outputs: &Outputs,
) -> anyhow::Result<()> {
    let ranks = rank_memory(plan)?;
    train_fit_check(&ranks, &a.cluster, a.allow_oom)?;
    let json = plan.to_json();
    outputs.write("-o", &a.output, json.as_bytes())?;
    print_train_summary(plan, opts, &ranks)?;
    let nodes = plan.program.len()
        + plan.step.as_ref().map_or(0, |s| s.program.len())
        + plan
            .chunks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                usize::from(i > 0) * c.program.len()
                    + c.step.as_ref().map_or(0, |s| s.program.len())
            })
            .sum::<usize>();
    let programs = if plan.chunks.is_empty() {
        1 + usize::from(plan.step.is_some())
    } else {
        2 * plan.chunks.len()
    };
    let contents = format!("{} nodes in {programs} program(s)", thousands(nodes as u64));
    print_written(plan, &a.output, elapsed, &contents, json.len());
    Ok(())
}

/// The rewrite report (when rules ran) and the closing line: the compile time, where the plan
/// went, its format version, `contents` and its size.
fn print_written(
    plan: &Plan,
    output: &Path,
    elapsed: std::time::Duration,
    contents: &str,
    json_bytes: usize,
) {
    if let Some(r) = &plan.rewrite {
        print!("{r}");
    }
    println!(
        "compiled in {:.1} ms; wrote {} (plan format v{}, {contents}, {})",
        elapsed.as_secs_f64() * 1e3,
        output.display(),
        plan.format_version,
        bytes(json_bytes as u64)
    );
}

/// Training memory of one rank (of one pipeline stage), at the plan's precision.
struct RankMemory {
    /// The pipeline stage (`None`: no pipeline).
    stage: Option<usize>,
    /// Parameters + gradients + optimizer states.
    static_bytes: u64,
    /// The peak beyond the static bytes of one pass: the program's (one chunk's, the largest
    /// of the stage's), holding one micro-batch's activations at a time.
    pass_bytes: u64,
    /// Micro-batches in flight beyond the pass's own (a pipeline stage's peak in-flight
    /// micro-batches minus one; 0 without a pipeline).
    more_in_flight: f64,
    /// Activations one micro-batch keeps for backward (all the stage's chunks).
    kept_bytes: u64,
    /// static + pass + more in flight × kept.
    total_bytes: u64,
}

/// Memory per rank: the plan's training report, or per pipeline stage an estimate from its
/// chunks' reports and the schedule's peak in-flight micro-batches: the static state of its
/// chunks, the largest peak of one chunk's pass, and the activations of the other micro-batches
/// in flight. (Conservative where a chunk's peak is the optimizer step, when nothing is in
/// flight.)
fn rank_memory(plan: &Plan) -> anyhow::Result<Vec<RankMemory>> {
    let Some(s) = &plan.pipeline else {
        let m = plan
            .memory
            .train
            .as_ref()
            .context("the training plan has no memory report")?;
        return Ok(vec![RankMemory {
            stage: None,
            static_bytes: m.static_bytes,
            pass_bytes: m.peak_bytes.saturating_sub(m.static_bytes),
            more_in_flight: 0.0,
            kept_bytes: m.activation_bytes,
            total_bytes: m.peak_bytes,
        }]);
    };
    let replay = s.replay(PassCosts::uniform(1.0))?;
    let mut out = Vec::with_capacity(s.stages);
    for stage in 0..s.stages {
        let mems: Vec<&TrainMemory> = plan
            .chunks
            .iter()
            .filter(|c| c.stage == stage)
            .map(|c| {
                c.memory
                    .train
                    .as_ref()
                    .with_context(|| format!("pipeline chunk {} has no memory report", c.index))
            })
            .collect::<anyhow::Result<_>>()?;
        let static_bytes: u64 = mems.iter().map(|m| m.static_bytes).sum();
        let kept_bytes: u64 = mems.iter().map(|m| m.activation_bytes).sum();
        let pass_bytes = mems
            .iter()
            .map(|m| m.peak_bytes.saturating_sub(m.static_bytes))
            .max()
            .unwrap_or(0);
        let in_flight = replay.peak_in_flight.get(stage).copied().unwrap_or(1.0);
        let more_in_flight = (in_flight - 1.0).max(0.0);
        out.push(RankMemory {
            stage: Some(stage),
            static_bytes,
            pass_bytes,
            more_in_flight,
            kept_bytes,
            total_bytes: static_bytes
                + pass_bytes
                + (kept_bytes as f64 * more_in_flight).round() as u64,
        });
    }
    Ok(out)
}

impl RankMemory {
    /// `20.15 GiB static + 19.95 GiB one pass + 3 × 3.15 GiB in flight`.
    fn parts(&self) -> String {
        let mut s = format!(
            "{} static + {} one pass",
            bytes(self.static_bytes),
            bytes(self.pass_bytes)
        );
        if self.more_in_flight > 0.0 {
            s += &format!(
                " + {} × {} activations of more micro-batches in flight",
                self.more_in_flight,
                bytes(self.kept_bytes)
            );
        }
        s
    }
}

/// `compile --train`'s fit check: an error when the busiest rank's training memory exceeds
/// the device memory of `cluster`, a warning with `allow_oom`.
fn train_fit_check(ranks: &[RankMemory], cluster: &str, allow_oom: bool) -> anyhow::Result<()> {
    let c = Cluster::resolve(cluster)?;
    let device = c.device.memory().0;
    let Some(worst) = ranks.iter().max_by_key(|r| r.total_bytes) else {
        return Ok(());
    };
    if worst.total_bytes <= device {
        return Ok(());
    }
    let who = match worst.stage {
        Some(s) => format!("a rank of pipeline stage {s}"),
        None => "each rank".to_string(),
    };
    let msg = format!(
        "training plan does not fit: {who} needs {} ({}) but {} has {}",
        bytes(worst.total_bytes),
        worst.parts(),
        c.device.name,
        bytes(device)
    );
    if allow_oom {
        eprintln!("warning: {msg}");
        Ok(())
    } else {
        bail!(
            "{msg}; try --recompute selective or full, or a larger mesh, or pass --allow-oom to \
             write it anyway"
        )
    }
}

/// `4.0 GiB` for one value, `1.0 GiB..1.2 GiB` for a range.
fn byte_range(v: impl Iterator<Item = u64> + Clone) -> String {
    let (lo, hi) = (v.clone().min().unwrap_or(0), v.max().unwrap_or(0));
    if lo == hi {
        bytes(lo)
    } else {
        format!("{}..{}", bytes(lo), bytes(hi))
    }
}

/// One line of a training memory report.
fn train_memory_line(m: &TrainMemory) -> String {
    format!(
        "params {}, grads {}, optimizer {} (static {}); activations kept {} per micro-batch ({} per layer); largest collective buffer {}; peak {}",
        bytes(m.param_bytes),
        bytes(m.grad_bytes),
        bytes(m.optimizer_bytes),
        bytes(m.static_bytes),
        bytes(m.activation_bytes),
        byte_range(m.activations_per_layer.iter().map(|l| l.bytes)),
        bytes(m.comm_buffer_bytes),
        bytes(m.peak_bytes)
    )
}

/// The summary `compile --train` prints.
fn print_train_summary(
    plan: &Plan,
    opts: &TrainOptions,
    ranks: &[RankMemory],
) -> anyhow::Result<()> {
    let k = opts.micro_batches;
    println!(
        "{}, {k} micro-batch(es) of {}, recompute {}",
        headline(plan, " training step"),
        plan.model.batch / k.max(1),
        match opts.recompute_layers {
            Some(n) => format!(
                "full on the first {n} layers of each chunk, {} on the others",
                opts.recompute
            ),
            None => opts.recompute.to_string(),
        }
    );
    print_axes(&plan.mesh);
    println!(
        "per rank: parameters {} as compiled (f32 program inputs{})",
        bytes(plan.memory.param_bytes),
        if plan.pipeline.is_some() {
            ", busiest pipeline rank"
        } else {
            ""
        }
    );
    let precision = plan
        .memory
        .train
        .as_ref()
        .or_else(|| plan.chunks.iter().find_map(|c| c.memory.train.as_ref()))
        .map(|m| m.precision)
        .context("the training plan has no memory report")?;
    let at = format!(
        "at {} B per parameter, gradient and activation element, {} B of optimizer state per parameter",
        precision.param_bytes, precision.optimizer_bytes
    );
    let Some(s) = &plan.pipeline else {
        if let Some(m) = &plan.memory.train {
            println!("training memory per rank ({at}):");
            println!("  {}", train_memory_line(m));
        }
        if let Some(c) = &plan.comm {
            print_comm(c);
        }
        return Ok(());
    };
    println!("pipeline: {}", s.describe()?);
    println!("chunks (training memory per rank {at}):");
    for ch in &plan.chunks {
        println!("  {}", ch.placement());
        if let Some(m) = &ch.memory.train {
            println!("    {}", train_memory_line(m));
        }
    }
    println!(
        "memory per pipeline rank (estimate: its chunks' static state + the largest peak of one pass + the activations of the other micro-batches in flight):"
    );
    for r in ranks {
        println!(
            "  stage {}: {} = {}",
            r.stage.unwrap_or(0),
            r.parts(),
            bytes(r.total_bytes)
        );
    }
    println!(
        "communication per pipeline rank per step (program dtype; collectives by ring algorithms, sends of boundary activations and gradients):"
    );
    for stage in 0..s.stages {
        let on = || plan.chunks.iter().filter(move |c| c.stage == stage);
        let (mut count, mut collectives) = (0usize, 0u64);
        for c in on().filter_map(|c| c.comm.as_ref()) {
            count += c.collectives.iter().map(|x| x.count).sum::<usize>();
            collectives += c.sent_bytes;
        }
        let sends: Vec<u64> = on()
            .flat_map(|c| {
                c.program
                    .outputs
                    .iter()
                    .filter(|(n, _)| {
                        n.starts_with(shardc::compiler::model::STAGE_OUTPUT)
                            || n.starts_with(shardc::compiler::autodiff::PIPE_GRAD_OUT)
                    })
                    .map(|&(_, v)| c.program.ty(v).size_bytes() as u64)
            })
            .collect();
        // A chunk's program is one micro-batch's: its sends happen once per micro-batch.
        let m = s.micro_batches as u64;
        println!(
            "  stage {stage}: {count} collectives {}, {} sends {}",
            bytes(collectives),
            sends.len() as u64 * m,
            bytes(sends.iter().sum::<u64>() * m)
        );
    }
    Ok(())
}

/// Per-rank collective volume of a step, by (op, axis).
fn print_comm(c: &shardc::compiler::train::CommVolume) {
    let count: usize = c.collectives.iter().map(|x| x.count).sum();
    println!(
        "communication per rank per step: {count} collectives, {} sent (ring algorithms, program dtype):",
        bytes(c.sent_bytes)
    );
    if c.collectives.is_empty() {
        println!("  (none)");
    }
    for x in &c.collectives {
        println!(
            "  {:<15} {:<4} ×{:<6} {:>12}",
            x.op,
            x.axis,
            x.count,
            bytes(x.sent_bytes)
        );
    }
}

/// One line per mesh axis: name, size, link class.
fn print_axes(mesh: &shardc::compiler::shard::Mesh) {
    for a in &mesh.axes {
        println!(
            "  axis {:<3} size {:<4} link {}",
            a.name,
            a.size,
            a.link.name()
        );
    }
}
