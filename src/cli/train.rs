//! `shardc train`: training steps (causal-LM loss, AdamW) on the CPU reference backend,
//! unsharded or sharded on thread ranks, or with `--backend cuda` on a GPU (a mesh's ranks as
//! virtual ranks of GPU 0); prints the loss per step. What runs is a training
//! plan: the compiled file given by `--plan` (`shardc compile --train -o FILE`; the model
//! gives the weights), or the model compiled here for `--mesh` and the step flags (which
//! `--save-plan` writes). A plan with a pipeline runs its chunks on stages, its schedule's
//! instructions with send/recv between them. With RANK/WORLD_SIZE set (`shardc launch`,
//! torchrun) and `--mesh` or `--plan`, this process runs only its rank, over tcp; rank 0
//! prints the loss.

use super::run::read_tokens;
use anyhow::{bail, Context};
use clap::Args;
use shardc::compiler::autodiff::Recompute;
use shardc::compiler::compile::{compile, CompileSpec, Job};
use shardc::compiler::cost::timelines_trace;
use shardc::compiler::ir::{AdamWSpec, Float, ValueRole};
use shardc::compiler::model::ModelConfig;
use shardc::compiler::plan::Plan;
use shardc::compiler::rewrite::{RewriteOptions, RuleSelection};
use shardc::compiler::schedule::pp::{parse_stage_layers, ScheduleKind};
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{PipelineOptions, Precision, TrainOptions};
use shardc::runtime::checkpoint;
use shardc::runtime::cuda::CudaTrainer;
use shardc::runtime::launch::{fingerprint_of, ProcessGroup, WorldEnv};
use shardc::runtime::output::{Outputs, StagedDir};
use shardc::runtime::pipeline::{pipeline_step, StageTrainer};
use shardc::runtime::train::{
    save_safetensors, stored_tensors_of, train_section, train_step, Batch, Fill, RankTrainer,
    StepOutput, TrainError, TrainState,
};
use shardc::runtime::Weights;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Model directory (config.json + safetensors).
    model: PathBuf,
    /// Token ids, a JSON list of equal-length lists (batch × seq); labels are the next tokens.
    #[arg(long)]
    tokens: PathBuf,
    /// Run this compiled training plan (`shardc compile --train -o FILE`); the model gives the
    /// weights. The plan fixes the mesh, strategies, micro-batches, recomputation, schedule and
    /// optimizer (the flags that set them are refused).
    #[arg(long)]
    plan: Option<PathBuf>,
    /// Compile and run the sharded step for this mesh on thread ranks (e.g. `dp=2`,
    /// `dp=2,tp=2`, `pp=2,dp=2,tp=2`).
    #[arg(long)]
    mesh: Option<String>,
    /// Pipeline schedule (meshes with `pp`): gpipe, 1f1b (default), interleaved or zb-h1.
    #[arg(long)]
    schedule: Option<String>,
    /// Model chunks per pipeline rank for the interleaved schedule (default 2).
    #[arg(long)]
    virtual_stages: Option<usize>,
    /// Decoder layers per pipeline chunk, e.g. `9,8,8,7` (default: balanced by cost).
    #[arg(long)]
    stage_layers: Option<String>,
    /// Strategies beyond the mesh axes' defaults (`sp`, `zero1`, `zero2`, `zero3`, `fsdp`).
    #[arg(long)]
    strategy: Vec<String>,
    #[command(flatten)]
    cp: super::args::CpArgs,
    /// Optimizer steps (each on the same tokens).
    #[arg(long, default_value_t = 1)]
    steps: usize,
    /// Micro-batches per step (gradient accumulation; default 1).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// Sequences per micro-batch on each data-parallel rank, instead of --micro-batches
    /// (the token file's batch = micro-batch × micro-batches × dp × ep).
    #[arg(long, conflicts_with = "micro_batches")]
    micro_batch: Option<usize>,
    /// Activation checkpointing: none (default), full or selective.
    #[arg(long)]
    recompute: Option<String>,
    /// Fully recompute the first N decoder layers of each pipeline chunk, the others under
    /// --recompute (Megatron-LM's `--recompute-method block --recompute-num-layers N`).
    #[arg(long, value_name = "N")]
    recompute_num_layers: Option<usize>,
    /// AdamW learning rate (default 1e-3).
    #[arg(long, allow_hyphen_values = true)]
    lr: Option<f32>,
    /// AdamW β₁ (default 0.9).
    #[arg(long, allow_hyphen_values = true)]
    beta1: Option<f32>,
    /// AdamW β₂ (default 0.95).
    #[arg(long, allow_hyphen_values = true)]
    beta2: Option<f32>,
    /// AdamW ε (default 1e-8).
    #[arg(long, allow_hyphen_values = true)]
    eps: Option<f32>,
    /// AdamW decoupled weight decay (default 0.1).
    #[arg(long, allow_hyphen_values = true)]
    weight_decay: Option<f32>,
    /// Save a sharded checkpoint to this directory after the last step (and every
    /// `--save-every` steps): each rank's weights and AdamW moments in the model's tensor
    /// names and coordinates, the step count and data position; `--resume` continues it on
    /// any mesh, `shardc checkpoint export` turns it into a HuggingFace directory.
    #[arg(long)]
    save: Option<PathBuf>,
    /// With --save: also save after every N-th step (counted from the run's first step 1,
    /// across resumes).
    #[arg(long, requires = "save")]
    save_every: Option<u64>,
    /// Continue from this checkpoint (a `--save` directory's latest step, or a step directory):
    /// its weights, AdamW moments, step count and data position, on this run's mesh and
    /// strategies, whatever the checkpoint was saved from.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Write the trained weights as a HuggingFace directory (model.safetensors with the
    /// checkpoint's tensor names, plus config.json) after the last step.
    #[arg(long)]
    export: Option<PathBuf>,
    /// Write the last step's gradients as `grad.<tensor name>` to this safetensors file.
    #[arg(long)]
    dump_grads: Option<PathBuf>,
    /// Write the step's plan (with memory and communication accounting) to this JSON file;
    /// `--plan` runs it later.
    #[arg(long)]
    save_plan: Option<PathBuf>,
    /// Rewrite rules for the step (`none`, `all`, `sequence-parallel`, or rule and group
    /// names, as for `shardc compile`): the rewritten step is what trains.
    #[arg(long)]
    rewrite: Option<String>,
    /// Pipelines: write the last step as executed (every rank's passes, transfers and
    /// activation bytes, measured) as a Chrome/Perfetto trace.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Seconds a rank waits for its peers in a collective before failing.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    #[command(flatten)]
    backend: super::args::BackendArgs,
    /// Allow an output to replace a file this command reads (e.g. `--save` onto the model's
    /// own directory); the replacement is still atomic.
    #[arg(long)]
    overwrite: bool,
}

/// The optimizer and run-length flags, checked before anything runs (every rank of a
/// multi-process run checks its own): AdamW's hyperparameters in their domains
/// ([`AdamWSpec::validate`], reported by flag), at least one step, virtual stage and second
/// of timeout (zero micro-batches is the compiler's error).
fn hyper_params(a: &TrainArgs) -> anyhow::Result<AdamWSpec> {
    let spec = AdamWSpec {
        lr: Float(a.lr.unwrap_or(1e-3)),
        beta1: Float(a.beta1.unwrap_or(0.9)),
        beta2: Float(a.beta2.unwrap_or(0.95)),
        eps: Float(a.eps.unwrap_or(1e-8)),
        weight_decay: Float(a.weight_decay.unwrap_or(0.1)),
    };
    if let Err(e) = spec.validate() {
        bail!(
            "--{}: must be {} (found {})",
            e.name.replace('_', "-"),
            e.requirement,
            e.found
        );
    }
    for (flag, n) in [
        ("--steps", a.steps as u64),
        ("--virtual-stages", a.virtual_stages.unwrap_or(1) as u64),
        ("--timeout", a.timeout),
    ] {
        if n == 0 {
            bail!("{flag} must be at least 1 (found 0)");
        }
    }
    Ok(spec)
}

/// This process's rank of a multi-process run: connects its groups (tcp, torchrun's
/// variables), runs its part of every step (its shard of the SPMD program, or its pipeline
/// stage, whose transfers go over the `pp` groups), keeps its parameter and optimizer shards
/// between steps, and reduces the loss to rank 0, which prints it.
#[allow(clippy::too_many_arguments)]
fn run_rank(
    a: &TrainArgs,
    plan: &Plan,
    env: &WorldEnv,
    batch: &Batch,
    weights: &Weights,
    (state, locals): (TrainState, Option<Locals>),
    cfg: &ModelConfig,
) -> anyhow::Result<()> {
    if a.export.is_some() || a.dump_grads.is_some() || a.trace.is_some() {
        bail!(
            "--export, --dump-grads and --trace assemble every rank's shards or timelines: run \
             them on thread ranks (without RANK/WORLD_SIZE); --save writes each rank's own shards"
        );
    }
    let timeout = Duration::from_secs(a.timeout);
    // Ranks must agree on the program (not on where each found the model).
    let fingerprint = fingerprint_of(plan);
    let pg = ProcessGroup::connect(env, &plan.mesh, &fingerprint, None, timeout)?;
    let ctx = pg.ctx();
    if env.rank == 0 {
        println!(
            "training mesh {} ({}) as rank 0 of {} processes (tcp): batch {} × {} tokens, {} micro-batch(es)",
            plan.mesh,
            plan.strategies.join(","),
            env.world_size,
            batch.batch,
            batch.seq,
            train_section(plan)?.micro_batches
        );
    }
    let run = || -> anyhow::Result<()> {
        enum Trainer<'c> {
            Flat(RankTrainer<'c>),
            Stage(StageTrainer<'c>),
        }
        let mut trainer = match (plan.pipeline.is_some(), locals) {
            (true, None) => Trainer::Stage(StageTrainer::new(plan, env.rank)?),
            (true, Some(l)) => Trainer::Stage(StageTrainer::new(plan, env.rank)?.with_locals(l)),
            (false, l) => {
                let t = RankTrainer::new(plan, weights, &ctx)?;
                Trainer::Flat(match l {
                    Some(mut l) => t.with_locals(l.remove(&0).unwrap_or_default()),
                    None => t,
                })
            }
        };
        let (first, last) = (state.step + 1, state.step + a.steps as u64);
        for step in first..=last {
            let t0 = Instant::now();
            let loss = match &mut trainer {
                Trainer::Stage(t) => t.step(&state, batch, step, &ctx, weights)?,
                Trainer::Flat(t) => t.step(&state, batch, step, &ctx)?,
            };
            if env.rank == 0 {
                println!(
                    "step {step}: loss {loss:.6} ({:.1} ms)",
                    t0.elapsed().as_secs_f64() * 1e3
                );
            }
            let due = step == last || a.save_every.is_some_and(|n| step % n == 0);
            if let (Some(dir), true) = (&a.save, due) {
                let local = |chunk: usize, name: &str| -> Option<shardc::runtime::Tensor> {
                    match &trainer {
                        Trainer::Stage(t) => t.local(chunk, name).cloned(),
                        Trainer::Flat(t) => t.local(name).cloned(),
                    }
                };
                let barrier = || -> Result<(), checkpoint::CheckpointError> {
                    pg.barrier().map_err(|e| checkpoint::CheckpointError::Io {
                        path: dir.clone(),
                        source: std::io::Error::other(format!("waiting for the other ranks: {e}")),
                    })
                };
                let info = save_info(a, cfg, batch, weights, step)?;
                let t0 = Instant::now();
                if let Some(at) =
                    checkpoint::save_rank(dir, plan, env.rank, step, &local, &info, &barrier)?
                {
                    println!(
                        "checkpoint of step {step} → {} ({:.1} ms)",
                        at.display(),
                        t0.elapsed().as_secs_f64() * 1e3
                    );
                }
            }
        }
        Ok(())
    };
    let r = run();
    if let Err(e) = &r {
        let agreed = e
            .downcast_ref::<TrainError>()
            .is_some_and(TrainError::every_rank_fails);
        if !agreed {
            pg.abort(&e.to_string());
        }
    }
    r?;
    if env.rank != 0 {
        println!(
            "rank {} ({}) of {} done",
            env.rank,
            pg.coords(),
            env.world_size
        );
    }
    Ok(())
}

/// Chunk placement and the schedule's bubble.
fn describe_pipeline(p: &Plan) -> anyhow::Result<()> {
    let Some(s) = &p.pipeline else {
        return Ok(());
    };
    println!("pipeline: {}", s.describe()?);
    for ch in &p.chunks {
        println!("  {}", ch.placement());
    }
    Ok(())
}

/// The step compiled from the model and the step flags, as a plan (the CPU runtime runs f32).
fn compile_plan(
    a: &TrainArgs,
    cfg: &ModelConfig,
    batch: &Batch,
    adamw: AdamWSpec,
) -> anyhow::Result<Plan> {
    let recompute_name = a.recompute.as_deref().unwrap_or("none");
    let Some(recompute) = Recompute::from_name(recompute_name) else {
        bail!("unknown recompute mode `{recompute_name}`; valid modes: none, full, selective");
    };
    let mesh = match &a.mesh {
        Some(m) => Mesh::parse(m, 8)?,
        None => Mesh::single(),
    };
    let (b, t) = (batch.batch, batch.seq);
    let mut opts = TrainOptions::new(b, t, mesh);
    opts.extra_strategies = a.cp.with(&a.strategy)?;
    opts.micro_batches = match a.micro_batch {
        Some(size) => super::args::micro_batch_count(b, size, &opts.mesh)?,
        None => a.micro_batches.unwrap_or(1),
    };
    opts.recompute = recompute;
    opts.recompute_layers = super::args::recompute_layers(a.recompute_num_layers, recompute)?;
    opts.denom = Some(batch.predicted_tokens());
    opts.adamw = adamw;
    let pipelined = opts
        .mesh
        .axis("pp")
        .is_some_and(|p| opts.mesh.axis_size(p) > 1);
    let virtual_stages = a.virtual_stages.unwrap_or(1);
    if pipelined {
        let schedule = ScheduleKind::from_name(a.schedule.as_deref().unwrap_or("1f1b"))?;
        // 2 chunks per rank for the interleaved schedule unless given, as everywhere.
        let virtual_stages = a
            .virtual_stages
            .unwrap_or(if schedule == ScheduleKind::Interleaved {
                2
            } else {
                1
            });
        let chunks = opts.mesh.axis_size(opts.mesh.axis("pp").expect("checked"))
            * if schedule == ScheduleKind::Interleaved {
                virtual_stages
            } else {
                1
            };
        opts.pipeline = PipelineOptions {
            schedule,
            virtual_stages,
            stage_layers: a
                .stage_layers
                .as_deref()
                .map(|t| parse_stage_layers(t, cfg.layers, chunks))
                .transpose()?,
        };
    } else if a.trace.is_some() {
        bail!("--trace records a pipeline's executed schedule: it needs a mesh with a pp axis");
    } else if a.stage_layers.is_some() || virtual_stages != 1 {
        bail!("--stage-layers and --virtual-stages need a mesh with a pp axis (e.g. --mesh pp=2)");
    }
    let mut spec = CompileSpec::new(
        cfg.clone(),
        a.model.display().to_string(),
        Job::Train(Box::new(opts)),
    );
    spec.precision = Precision::f32();
    if let Some(r) = &a.rewrite {
        spec.rewrite = RewriteOptions::with_rules(r.parse::<RuleSelection>()?);
    }
    Ok(compile(&spec)?)
}

pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let adamw = hyper_params(&a)?;
    let cuda = a.backend.cuda(None, Duration::from_secs(a.timeout))?;
    let outputs = Outputs::new(a.overwrite).inputs([
        Some(a.model.as_path()),
        Some(&a.tokens),
        a.plan.as_deref(),
    ]);
    for (flag, p) in [
        ("--save-plan", &a.save_plan),
        ("--dump-grads", &a.dump_grads),
        ("--trace", &a.trace),
    ] {
        if let Some(p) = p {
            outputs.check_file(flag, p)?;
        }
    }
    if let Some(dir) = &a.export {
        outputs.check_dir("--export", dir, &EXPORT_FILES)?;
    }
    if let Some(dir) = &a.save {
        outputs.check_dir_matching("--save", dir, &checkpoint::is_checkpoint_entry)?;
    }
    if a.save_every == Some(0) {
        bail!("--save-every must be at least 1 (found 0)");
    }
    let cfg = ModelConfig::from_path(&a.model)?;
    let (b, t, ids) = read_tokens(&a.tokens, &cfg)?;
    if t < 2 {
        bail!("sequences of {t} token(s) have nothing to predict; need at least 2");
    }
    let batch = Batch::causal_lm(ids.iter().map(|&x| x as i32).collect(), b, t);
    // The plan that runs: the compiled file, or the model compiled here for the flags.
    let (plan, weights) = match &a.plan {
        Some(p) => {
            super::run::refuse_with_plan(&[
                ("--mesh", a.mesh.is_some()),
                ("--strategy", !a.strategy.is_empty()),
                ("--micro-batches", a.micro_batches.is_some()),
                ("--micro-batch", a.micro_batch.is_some()),
                ("--recompute", a.recompute.is_some()),
                ("--recompute-num-layers", a.recompute_num_layers.is_some()),
                ("--schedule", a.schedule.is_some()),
                ("--virtual-stages", a.virtual_stages.is_some()),
                ("--stage-layers", a.stage_layers.is_some()),
                ("--lr", a.lr.is_some()),
                ("--beta1", a.beta1.is_some()),
                ("--beta2", a.beta2.is_some()),
                ("--eps", a.eps.is_some()),
                ("--weight-decay", a.weight_decay.is_some()),
                ("--save-plan", a.save_plan.is_some()),
                ("--rewrite", a.rewrite.is_some()),
            ])?;
            let weights = Weights::open(&a.model)?;
            let plan = super::run::load_plan(p, &a.model, &cfg, &weights)?;
            let Some(tr) = &plan.train else {
                bail!(
                    "plan {} is a forward plan: `shardc train --plan` runs a training plan \
                     (`shardc compile --train -o FILE`); `shardc run --plan` runs this one",
                    p.display()
                );
            };
            super::run::check_plan_tokens(&plan, p, &a.tokens, b, t)?;
            if tr.denom != batch.predicted_tokens() {
                bail!(
                    "plan {} divides the loss by {} predicted tokens, but tokens {} predict {}",
                    p.display(),
                    tr.denom,
                    a.tokens.display(),
                    batch.predicted_tokens()
                );
            }
            if a.trace.is_some() && plan.pipeline.is_none() {
                bail!(
                    "--trace records a pipeline's executed schedule: plan {} has no pipeline",
                    p.display()
                );
            }
            (plan, weights)
        }
        None => {
            let plan = compile_plan(&a, &cfg, &batch, adamw)?;
            (plan, Weights::open(&a.model)?)
        }
    };
    let tr = train_section(&plan)?;
    // One rank of a multi-process run (`shardc launch`, torchrun): RANK/WORLD_SIZE set.
    let world = ((a.mesh.is_some() || a.plan.is_some()) && WorldEnv::detected())
        .then(WorldEnv::from_env)
        .transpose()?;
    if let Some(p) = a
        .save_plan
        .as_ref()
        .filter(|_| world.as_ref().is_none_or(|w| w.rank == 0))
    {
        outputs.write("--save-plan", p, plan.to_json().as_bytes())?;
    }
    let (mut state, locals) = match &a.resume {
        Some(dir) => resume(dir, &plan, &cfg, &batch, world.as_ref().map(|w| w.rank))?,
        None => (TrainState::load(&plan, &weights)?, None),
    };
    if let Some(env) = &world {
        if cuda.is_some() {
            bail!(
                "--backend cuda trains in one process (a mesh's ranks as virtual ranks of GPU 0); \
                 a launched rank trains on the CPU backend in this version"
            );
        }
        return run_rank(&a, &plan, env, &batch, &weights, (state, locals), &cfg);
    }
    let mut cuda_trainer = match &cuda {
        Some((dev, opts)) => Some(CudaTrainer::new(
            dev.clone(),
            &plan,
            &weights,
            opts.clone(),
        )?),
        None => None,
    };
    let mesh = &plan.mesh;
    let ranks = if cuda.is_some() {
        "virtual ranks of one GPU"
    } else {
        "thread ranks"
    };
    let how = if mesh.world_size() == 1 {
        "unsharded".to_string()
    } else {
        format!(
            "mesh {mesh} ({}) on {} {ranks}",
            plan.strategies.join(","),
            mesh.world_size()
        )
    };
    let backend = match &cuda {
        Some((dev, opts)) => format!("CUDA on {}, {}", dev.name(), opts.dtype),
        None => "CPU reference, f32".to_string(),
    };
    println!(
        "training {} ({} layers) {how}: batch {b} × {t} tokens, {} micro-batch(es), recompute {} ({backend})",
        cfg.arch.name(),
        cfg.layers,
        tr.micro_batches,
        match tr.recompute_layers {
            Some(k) => format!("full on the first {k} layers of each chunk, {} on the others", tr.recompute),
            None => tr.recompute.to_string(),
        }
    );
    if let Some(r) = &plan.rewrite {
        let fired: usize = r.fired.values().sum();
        let which = if plan.pipeline.is_some() {
            " (chunk 0)"
        } else {
            ""
        };
        println!(
            "rewritten{which}: {fired} rule applications ({} of the {} selected rules fired)",
            r.fired.values().filter(|&&n| n > 0).count(),
            r.rules.len()
        );
    }
    describe_pipeline(&plan)?;
    let mut grads = BTreeMap::new();
    let mut timelines = Vec::new();
    let timeout = Duration::from_secs(a.timeout);
    let first = state.step + 1;
    let last = state.step + a.steps as u64;
    let save = |state: &TrainState| -> anyhow::Result<()> {
        if let Some(dir) = &a.save {
            let t0 = Instant::now();
            let at = save_checkpoint(&a, dir, &plan, state, &cfg, &batch, &weights)?;
            println!(
                "checkpoint of step {} → {} ({:.1} ms)",
                state.step,
                at.display(),
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
        Ok(())
    };
    for step in first..=last {
        let t0 = Instant::now();
        let (out, peaks): (StepOutput, Option<Vec<usize>>) = if plan.pipeline.is_some() {
            let s = pipeline_step(&plan, &mut state, &batch, timeout, &weights)?;
            timelines = s.timelines;
            (s.output, Some(s.peak_activation_bytes))
        } else if let Some(trainer) = &mut cuda_trainer {
            (trainer.step(&mut state, &batch)?, None)
        } else {
            (
                train_step(&plan, &mut state, &batch, &weights, timeout)?,
                None,
            )
        };
        let peaks = peaks.map_or(String::new(), |p| {
            let kib: Vec<String> = p
                .iter()
                .map(|b| format!("{:.1}", *b as f64 / 1024.0))
                .collect();
            format!(", peak activations per stage [{}] KiB", kib.join(", "))
        });
        println!(
            "step {step}: loss {:.6} ({:.1} ms{peaks})",
            out.loss,
            t0.elapsed().as_secs_f64() * 1e3
        );
        grads = out.grads;
        if a.save_every.is_some_and(|n| step % n == 0) && step != last {
            save(&state)?;
        }
    }
    save(&state)?;
    if let Some(path) = &a.trace {
        let labels: Vec<String> = (0..mesh.world_size())
            .map(|r| mesh.coords_label(r))
            .collect();
        let index: Vec<u32> = (0..timelines.len() as u32).collect();
        outputs.write(
            "--trace",
            path,
            timelines_trace(&timelines, &index, &labels, None).as_bytes(),
        )?;
        println!(
            "executed schedule of step {} → {} (open in https://ui.perfetto.dev)",
            a.steps,
            path.display()
        );
    }
    if let Some(path) = &a.dump_grads {
        let stored = stored_tensors_of(&tr.params, &grads, &weights, Fill::Zeros)?;
        let named = stored
            .into_iter()
            .map(|(k, v)| (ValueRole::Gradient.name(&k), v))
            .collect();
        save_safetensors(path, &named)?;
        println!("gradients → {}", path.display());
    }
    if let Some(dir) = &a.export {
        // Built whole beside `dir` (tensors first, config.json last), then swapped into place:
        // a failed or killed export leaves the previous one as it was.
        let stage = StagedDir::new(dir)?;
        let stored = stored_tensors_of(&tr.params, &state.params, &weights, Fill::Original)?;
        save_safetensors(&stage.path("model.safetensors"), &stored)?;
        let cfg_src = if a.model.is_dir() {
            a.model.join("config.json")
        } else {
            a.model.clone()
        };
        let cfg_bytes =
            std::fs::read(&cfg_src).with_context(|| format!("reading {}", cfg_src.display()))?;
        stage.write("config.json", &cfg_bytes)?;
        test_hook_kill_before_publish();
        stage.publish()?;
        println!("weights (HuggingFace layout) → {}", dir.display());
    }
    Ok(())
}

/// The files an `--export` directory holds.
const EXPORT_FILES: [&str; 2] = ["model.safetensors", "config.json"];

/// The tokens' digest, as a checkpoint's data position records it.
fn tokens_digest(batch: &Batch) -> String {
    let bytes: Vec<u8> = batch.ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    checkpoint::digest(&bytes)
}

/// What a checkpoint of step `step` records besides the state.
fn save_info<'w>(
    a: &TrainArgs,
    cfg: &ModelConfig,
    batch: &Batch,
    weights: &'w Weights,
    step: u64,
) -> anyhow::Result<checkpoint::SaveInfo<'w>> {
    Ok(checkpoint::SaveInfo {
        data: checkpoint::DataPosition {
            next_sample: step * batch.batch as u64,
            batch: batch.batch,
            seq: batch.seq,
            tokens: tokens_digest(batch),
        },
        model: checkpoint::SavedModel {
            source: a.model.display().to_string(),
            arch: cfg.arch.name().to_string(),
            config: super::checkpoint::config_json(&a.model)?,
        },
        weights,
        before_publish: Some(&test_hook_kill_before_publish),
    })
}

/// Saves `state` (after step `state.step`) as a sharded checkpoint under `dir`.
fn save_checkpoint(
    a: &TrainArgs,
    dir: &std::path::Path,
    plan: &Plan,
    state: &TrainState,
    cfg: &ModelConfig,
    batch: &Batch,
    weights: &Weights,
) -> anyhow::Result<PathBuf> {
    let info = save_info(a, cfg, batch, weights, state.step)?;
    Ok(checkpoint::save_global(dir, plan, state, &info)?)
}

/// The state of plan `plan` from checkpoint `dir`: its weights and moments in this plan's
/// layout, its step count; a note when the tokens differ from those it was trained on.
/// With `rank` (a process of a multi-process run), only that rank's blocks are read, as the
/// locals its trainer starts from (per pipeline chunk, by program input); the state then
/// holds the step count alone.
fn resume(
    dir: &std::path::Path,
    plan: &Plan,
    cfg: &ModelConfig,
    batch: &Batch,
    rank: Option<usize>,
) -> anyhow::Result<(TrainState, Option<Locals>)> {
    let ck = checkpoint::Checkpoint::open(dir)?;
    let m = &ck.manifest;
    if m.model.arch != cfg.arch.name() {
        bail!(
            "checkpoint {} holds a {} model; this run trains a {}",
            ck.dir.display(),
            m.model.arch,
            cfg.arch.name()
        );
    }
    let (state, locals) = match rank {
        None => (ck.load_state(plan)?, None),
        Some(r) => {
            let state = TrainState {
                params: BTreeMap::new(),
                m: BTreeMap::new(),
                v: BTreeMap::new(),
                step: m.step,
            };
            (state, Some(ck.load_locals(plan, r)?))
        }
    };
    if rank.is_some_and(|r| r != 0) {
        return Ok((state, locals));
    }
    let saved_on = if m.layout.mesh.is_empty() {
        "unsharded".to_string()
    } else {
        format!("mesh {} ({})", m.layout.mesh, m.layout.strategies.join(","))
    };
    println!(
        "resumed {} at step {} (saved {saved_on}); next sample {}",
        ck.dir.display(),
        m.step,
        m.data.next_sample
    );
    if !m.data.tokens.is_empty() && m.data.tokens != tokens_digest(batch) {
        println!(
            "note: the tokens differ from the ones the checkpoint was trained on ({} × {})",
            m.data.batch, m.data.seq
        );
    }
    Ok((state, locals))
}

/// A rank's own blocks of the training state, per pipeline chunk and program input.
type Locals = BTreeMap<usize, BTreeMap<String, shardc::runtime::Tensor>>;

/// Test hook: `SHARDC_TEST_KILL_DURING_SAVE=1` kills the process after a checkpoint's files are
/// written and before it is published, as a crash at the worst moment would.
fn test_hook_kill_before_publish() {
    if std::env::var_os("SHARDC_TEST_KILL_DURING_SAVE").is_some_and(|v| v == "1") {
        std::process::abort();
    }
}
