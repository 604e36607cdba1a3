//! `shardc run`: execute a forward plan on the CPU reference backend, unsharded or sharded on
//! thread ranks, with the `--tokens/--out` JSON contract. `--plan` runs a compiled plan file
//! (the model gives the weights); without it the model is compiled in memory for `--mesh`
//! into a plan, and that plan runs.
//!
//! Multi-process: when `RANK`/`WORLD_SIZE` are set (by `shardc launch`, torchrun or mpirun;
//! see `shardc::runtime::launch::env`) and `--mesh` is given, this process runs only its
//! rank's program, with TCP communicators to the other ranks; rank 0 writes `--out`, after a
//! world barrier. `--comm-timeout` bounds every wait on a peer (rendezvous, connection, each
//! collective): a peer that dies or stalls makes this rank exit non-zero with an error naming
//! its rank, the collective, its sequence number and the mesh axis.
//!
//! Test hook (for the fault-handling tests only): `SHARDC_TEST_FAIL_RANK=<rank>` with
//! `SHARDC_TEST_FAIL_MODE=exit|hang` makes that rank, once connected and before its first
//! collective, exit with status 3 without saying goodbye (as a crash) or sleep for 600 s (a
//! stall).

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};
use shardc::compiler::compile::{compile, CompileOptions, CompileSpec, Job};
use shardc::compiler::model::{ForwardOutput, ModelConfig};
use shardc::compiler::plan::Plan;
use shardc::compiler::shard::Mesh;
use shardc::runtime::cuda::comm::nccl::NcclId;
use shardc::runtime::cuda::{
    execute_cuda, run_nccl_rank, run_spmd_local_gpu, CudaDevice, CudaOptions, ParamInit,
};
use shardc::runtime::launch::{fingerprint_of, ProcessGroup, WorldEnv};
use shardc::runtime::output::Outputs;
use shardc::runtime::{check_inputs, execute_plan, Tensor, Weights};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Model directory (config.json + safetensors).
    model: PathBuf,
    /// Token ids, a JSON list of equal-length lists (batch × seq).
    #[arg(long)]
    tokens: PathBuf,
    /// Attention mask (1 keep, 0 padding), same shape as the tokens.
    #[arg(long)]
    attention_mask: Option<PathBuf>,
    /// Position ids, same shape as the tokens (default 0..seq).
    #[arg(long)]
    position_ids: Option<PathBuf>,
    /// Where to write logits and final hidden states.
    #[arg(long)]
    out: PathBuf,
    /// What the compiled plan returns: `logits` (every position's, the default here),
    /// `last` (the last position's), `hidden` (no head) or `loss` (the causal-LM loss of the
    /// tokens, vocabulary-parallel under tp). A `--plan` returns what it was compiled to.
    #[arg(long)]
    returns: Option<String>,
    /// Allow `--out` to replace a file this command reads (still atomically).
    #[arg(long)]
    overwrite: bool,
    /// Run this compiled forward plan (`shardc compile -o plan.json`); the model gives the
    /// weights. The plan's mesh and strategies apply (`--mesh`/`--strategy` are refused).
    #[arg(long)]
    plan: Option<PathBuf>,
    /// Compile and run the sharded plan for this mesh on thread ranks (e.g. `tp=2`,
    /// `dp=2,tp=2`), or, when RANK/WORLD_SIZE are set (`shardc launch`), this process's rank
    /// of it.
    #[arg(long)]
    mesh: Option<String>,
    /// Strategies beyond the mesh axes' defaults (e.g. `sp`).
    #[arg(long)]
    strategy: Vec<String>,
    #[command(flatten)]
    cp: super::args::CpArgs,
    #[command(flatten)]
    backend: super::args::BackendArgs,
    /// Seconds a rank waits for a peer (in a collective; multi-process: also at the
    /// rendezvous and connection) before failing.
    #[arg(long, alias = "timeout", value_parser = super::launch::parse_secs, default_value = "60")]
    comm_timeout: Duration,
}

/// The test hook of the module docs.
fn test_fault_hook(rank: usize) -> anyhow::Result<()> {
    let Ok(which) = std::env::var("SHARDC_TEST_FAIL_RANK") else {
        return Ok(());
    };
    if which.trim().parse::<usize>().ok() != Some(rank) {
        return Ok(());
    }
    match std::env::var("SHARDC_TEST_FAIL_MODE").as_deref() {
        Ok("exit") => {
            eprintln!(
                "rank {rank}: SHARDC_TEST_FAIL_MODE=exit: exiting before the first collective"
            );
            std::process::exit(3)
        }
        Ok("hang") => {
            eprintln!(
                "rank {rank}: SHARDC_TEST_FAIL_MODE=hang: stalling before the first collective"
            );
            std::thread::sleep(Duration::from_secs(600));
            Ok(())
        }
        other => bail!(
            "SHARDC_TEST_FAIL_MODE must be `exit` or `hang` (got {:?})",
            other.unwrap_or_default()
        ),
    }
}

/// Reads a JSON `[[int, ...], ...]` file as a rectangular batch × seq matrix.
pub(super) fn read_matrix(path: &Path, what: &str) -> anyhow::Result<(usize, usize, Vec<i64>)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading {what} {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{what} {}: malformed JSON", path.display()))?;
    let rows = v.as_array().with_context(|| {
        format!(
            "{what} {}: expected a list of lists [[...], ...]",
            path.display()
        )
    })?;
    if rows.is_empty() {
        bail!("{what} {}: empty batch", path.display());
    }
    let mut out = Vec::new();
    let mut width = None;
    for (b, row) in rows.iter().enumerate() {
        let row = row
            .as_array()
            .with_context(|| format!("{what} {}: row {b} is not a list", path.display()))?;
        match width {
            None => width = Some(row.len()),
            Some(w) if w != row.len() => bail!(
                "{what} {}: ragged rows: row 0 has {w} entries, row {b} has {}",
                path.display(),
                row.len()
            ),
            _ => {}
        }
        for (t, x) in row.iter().enumerate() {
            let x = x.as_i64().with_context(|| {
                format!(
                    "{what} {}: [{b}][{t}] = {x} is not an integer{}",
                    path.display(),
                    if x.is_u64() { " below 2^63" } else { "" }
                )
            })?;
            out.push(x);
        }
    }
    let width = width.unwrap_or(0);
    if width == 0 {
        bail!("{what} {}: empty sequences", path.display());
    }
    Ok((rows.len(), width, out))
}

/// Reads a token file for model `cfg`: a batch × seq matrix of ids inside the vocabulary,
/// no longer than the model's positions.
pub(super) fn read_tokens(
    path: &Path,
    cfg: &ModelConfig,
) -> anyhow::Result<(usize, usize, Vec<i64>)> {
    let (b, t, ids) = read_matrix(path, "tokens")?;
    if t > cfg.max_positions {
        bail!(
            "sequence length {t} exceeds the model's maximum positions {}",
            cfg.max_positions
        );
    }
    if let Some((id, at)) = first_outside(&ids, t, |id| id >= 0 && (id as usize) < cfg.vocab) {
        bail!(
            "token id {id} at {at} is out of range for vocabulary size {}",
            cfg.vocab
        );
    }
    Ok((b, t, ids))
}

/// The first entry of row-major matrix `v` (rows of `t`) that is not `inside`, with its
/// place `[b][t]`.
fn first_outside(v: &[i64], t: usize, inside: impl Fn(i64) -> bool) -> Option<(i64, String)> {
    let i = v.iter().position(|&x| !inside(x))?;
    Some((v[i], format!("[{}][{}]", i / t, i % t)))
}

/// Reads an attention mask: a batch × seq matrix of 0 (padding) and 1 (keep).
fn read_mask(path: &Path) -> anyhow::Result<(usize, usize, Vec<i64>)> {
    let (b, t, v) = read_matrix(path, "attention mask")?;
    if let Some((x, at)) = first_outside(&v, t, |x| x == 0 || x == 1) {
        bail!(
            "attention mask {}: {at} = {x} is not 0 (padding) or 1 (keep)",
            path.display()
        );
    }
    Ok((b, t, v))
}

/// Reads plan file `path` (verified) for model `cfg`: a forward plan of the same
/// architecture and layer count, whose every parameter the checkpoint holds in the shape the
/// plan expects.
pub fn load_plan(
    path: &Path,
    model: &Path,
    cfg: &ModelConfig,
    weights: &Weights,
) -> anyhow::Result<Plan> {
    let plan = Plan::load(path).with_context(|| format!("plan {}", path.display()))?;
    check_plan_model(&plan, path, model, cfg, weights)?;
    Ok(plan)
}

/// The model of `plan` (read from `path`) is the model at `model`: architecture, layers and
/// every parameter's shape.
pub fn check_plan_model(
    plan: &Plan,
    path: &Path,
    model: &Path,
    cfg: &ModelConfig,
    weights: &Weights,
) -> anyhow::Result<()> {
    let m = &plan.model;
    if m.model_type != cfg.arch.name() || m.layers != cfg.layers {
        bail!(
            "plan {} was compiled for another model: a {} with {} layers ({}), but {} is a {}              with {} layers",
            path.display(),
            m.model_type,
            m.layers,
            m.source,
            model.display(),
            cfg.arch.name(),
            cfg.layers
        );
    }
    shardc::runtime::check_weights(plan, weights).with_context(|| {
        format!(
            "plan {} was compiled for another model ({}): the checkpoint of {} does not fit it",
            path.display(),
            m.source,
            model.display()
        )
    })
}

/// Tokens of `b` sequences of `t` for a plan compiled for another batch or sequence length.
pub fn check_plan_tokens(
    plan: &Plan,
    path: &Path,
    tokens: &Path,
    b: usize,
    t: usize,
) -> anyhow::Result<()> {
    let m = &plan.model;
    if (m.batch, m.seq) != (b, t) {
        bail!(
            "tokens {} are [{b}, {t}] (batch × seq) but plan {} was compiled for batch {} × seq {}",
            tokens.display(),
            path.display(),
            m.batch,
            m.seq
        );
    }
    Ok(())
}

/// Refuses flags that describe a plan to compile when `--plan` gives a compiled one.
pub fn refuse_with_plan(flags: &[(&str, bool)]) -> anyhow::Result<()> {
    if let Some((f, _)) = flags.iter().find(|(_, given)| *given) {
        bail!("{f} describes a plan to compile; --plan runs a compiled plan as it is (drop {f})");
    }
    Ok(())
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    let files = Outputs::new(a.overwrite).inputs([
        Some(a.model.as_path()),
        Some(&a.tokens),
        a.attention_mask.as_deref(),
        a.position_ids.as_deref(),
        a.plan.as_deref(),
    ]);
    files.check_file("--out", &a.out)?;
    if a.plan.is_some() {
        refuse_with_plan(&[
            ("--mesh", a.mesh.is_some()),
            ("--strategy", !a.strategy.is_empty()),
            ("--returns", a.returns.is_some()),
        ])?;
    } else if a.mesh.is_none() && !a.strategy.is_empty() {
        bail!("--strategy applies to a sharded run: give --mesh too");
    }
    // A rank of a multi-process job (validated before any work).
    let world = if WorldEnv::detected() {
        Some(WorldEnv::from_env()?)
    } else {
        None
    };
    let cuda = a.backend.cuda(world.as_ref(), a.comm_timeout)?;
    if let (None, None, Some(w)) = (&a.mesh, &a.plan, &world) {
        if w.world_size > 1 {
            bail!(
                "this process is rank {} of {} (RANK/WORLD_SIZE are set) but no --mesh was given; \
                 a multi-process run needs a mesh of {} ranks (or a --plan for one)",
                w.rank,
                w.world_size,
                w.world_size
            );
        }
    }
    let cfg = ModelConfig::from_path(&a.model)?;
    let (b, t, ids) = read_tokens(&a.tokens, &cfg)?;
    let same_shape =
        |what: &str, (bb, tt, v): (usize, usize, Vec<i64>)| -> anyhow::Result<Vec<i64>> {
            if (bb, tt) != (b, t) {
                bail!("{what} has shape [{bb}, {tt}] but tokens are [{b}, {t}]");
            }
            Ok(v)
        };
    let mask: Vec<f32> = match &a.attention_mask {
        Some(p) => same_shape("attention mask", read_mask(p)?)?
            .into_iter()
            .map(|x| x as f32)
            .collect(),
        None => vec![1.0; b * t],
    };
    let pos: Vec<i32> = match &a.position_ids {
        Some(p) => {
            let v = same_shape("position ids", read_matrix(p, "position ids")?)?;
            let inside = |x: i64| x >= 0 && (x as usize) < cfg.max_positions;
            if let Some((x, at)) = first_outside(&v, t, inside) {
                bail!(
                    "position id {x} at {at} is outside [0, {})",
                    cfg.max_positions
                );
            }
            v.into_iter().map(|x| x as i32).collect()
        }
        None => (0..b).flat_map(|_| 0..t as i32).collect(),
    };
    let mut inputs = BTreeMap::new();
    inputs.insert(
        "input_ids".to_string(),
        Tensor::i32(vec![b, t], ids.iter().map(|&x| x as i32).collect()),
    );
    inputs.insert("position_ids".to_string(), Tensor::i32(vec![b, t], pos));
    inputs.insert("attention_mask".to_string(), Tensor::f32(vec![b, t], mask));

    let weights = Weights::open(&a.model)?;
    // The plan that runs: the compiled file, or the model compiled here for `--mesh`.
    let plan = match &a.plan {
        Some(p) => {
            let plan = load_plan(p, &a.model, &cfg, &weights)?;
            check_plan_tokens(&plan, p, &a.tokens, b, t)?;
            plan
        }
        None => {
            let opts = match &a.mesh {
                Some(m) => super::args::options(&cfg, Some(m), &a.cp.with(&a.strategy)?, b, t, 8)?,
                None => CompileOptions {
                    batch: b,
                    seq: t,
                    mesh: Mesh::single(),
                    extra_strategies: Vec::new(),
                },
            };
            let source = a.model.display().to_string();
            let mut spec = CompileSpec::new(cfg.clone(), source, Job::Forward(opts));
            spec.output = super::args::forward_output(a.returns.as_deref(), ForwardOutput::Logits)?;
            compile(&spec)?
        }
    };
    if plan.train.is_some() {
        bail!(
            "plan {} is a training plan: run it with `shardc train --plan`",
            a.plan.as_deref().unwrap_or(Path::new("")).display()
        );
    }
    // A plan returning the loss reads the labels: the next token at each position (the last
    // one predicts nothing), as transformers shifts `labels = input_ids`.
    if plan.program.input_named("labels").is_some() {
        if a.attention_mask.is_some() {
            bail!(
                "--attention-mask with a plan returning the loss: the loss is averaged over \
                 every predicted position (B·(T−1)), padding included; run without a mask"
            );
        }
        let labels: Vec<i32> = ids
            .chunks(t)
            .flat_map(|row| {
                row.iter()
                    .skip(1)
                    .map(|&x| x as i32)
                    .chain(std::iter::once(-100))
            })
            .collect();
        inputs.insert("labels".to_string(), Tensor::i32(vec![b, t], labels));
    }
    check_inputs(&plan, &inputs)?;
    let strategies = if plan.strategies.is_empty() {
        "none".to_string()
    } else {
        plan.strategies.join(",")
    };
    let distributed = world.is_some() && (a.mesh.is_some() || a.plan.is_some());
    let t0 = Instant::now();
    let (outputs, how) = match &world {
        _ if cuda.is_some() => {
            let (dev, opts) = cuda.as_ref().expect("invariant: matched");
            match &world {
                Some(env) if distributed => {
                    // Rank 0's NCCL id reaches every rank as the rendezvous' bootstrap bytes.
                    let fingerprint = fingerprint_of(&plan);
                    let id = if env.rank == 0 {
                        Some(NcclId::new()?)
                    } else {
                        None
                    };
                    let bootstrap = id.as_ref().map(|i| &i.0[..]);
                    let pg = ProcessGroup::connect(
                        env,
                        &plan.mesh,
                        &fingerprint,
                        bootstrap,
                        a.comm_timeout,
                    )?;
                    let id = NcclId::from_bootstrap(pg.bootstrap())?;
                    let params = ParamInit::Weights(&weights);
                    let out = run_nccl_rank(
                        dev,
                        &plan.program,
                        &plan.mesh,
                        env.rank,
                        id,
                        &params,
                        &inputs,
                        opts,
                    )
                    .with_context(|| format!("rank {} ({})", env.rank, pg.coords()))?;
                    if env.rank != 0 {
                        println!(
                            "rank {} ({}) of {} done on {}; rank 0 writes {}",
                            env.rank,
                            pg.coords(),
                            env.world_size,
                            dev.name(),
                            a.out.display()
                        );
                        return Ok(());
                    }
                    (
                        out,
                        format!(
                            "mesh {} ({strategies}) as rank 0 of {} processes (nccl, one GPU \
                             per local rank, {})",
                            plan.mesh, env.world_size, opts.dtype
                        ),
                    )
                }
                _ => run_cuda(dev, opts, &plan, &weights, &inputs)?,
            }
        }
        Some(env) if distributed => {
            // Ranks must agree on the program (not on where each found the model).
            let fingerprint = fingerprint_of(&plan);
            let pg = ProcessGroup::connect(env, &plan.mesh, &fingerprint, None, a.comm_timeout)?;
            test_fault_hook(env.rank)?;
            let out = pg.run(&plan.program, &weights, &inputs)?;
            let job: String = pg.bootstrap().iter().map(|x| format!("{x:02x}")).collect();
            if env.rank != 0 {
                println!(
                    "rank {} ({}) of {} done; job {job}; rank 0 writes {}",
                    env.rank,
                    pg.coords(),
                    env.world_size,
                    a.out.display()
                );
                return Ok(());
            }
            (
                out,
                format!(
                    "mesh {} ({strategies}) as rank 0 of {} processes (tcp; job {job})",
                    plan.mesh, env.world_size
                ),
            )
        }
        _ => {
            let mut outs = execute_plan(&plan, &weights, &inputs, a.comm_timeout)?;
            let how = if plan.mesh.world_size() == 1 {
                "unsharded".to_string()
            } else {
                format!(
                    "mesh {} ({strategies}) on {} thread ranks",
                    plan.mesh,
                    plan.mesh.world_size()
                )
            };
            (outs.swap_remove(0), how)
        }
    };
    let elapsed = t0.elapsed();
    let backend = match &cuda {
        Some((_, opts)) => format!("CUDA, {}", opts.dtype),
        None => "CPU reference, f32".to_string(),
    };
    // The summary line, ending with what the run returned.
    let ran = |returned: &str| {
        println!(
            "ran {} ({} layers) {how}: batch {b} × {t} tokens in {:.1} ms ({backend}); {returned} → {}",
            cfg.arch.name(),
            cfg.layers,
            elapsed.as_secs_f64() * 1e3,
            a.out.display()
        )
    };
    let get = |name: &str| -> anyhow::Result<&Tensor> {
        outputs
            .get(name)
            .with_context(|| format!("the program has no `{name}` output"))
    };
    if let Some(loss) = outputs.get("loss") {
        check_finite_output("loss", loss)?;
        let x = loss
            .as_f32()
            .and_then(|v| v.first().copied())
            .unwrap_or(f32::NAN);
        files.write(
            "--out",
            &a.out,
            serde_json::to_string(&json!({ "loss": x }))?.as_bytes(),
        )?;
        ran(&format!("loss {x:.6}"));
        return Ok(());
    }
    // What the plan returns: logits (every position's or the last one's) and the final hidden
    // states, or the hidden states alone.
    let hidden = get("hidden")?;
    let logits = outputs.get("logits");
    check_finite_output("hidden", hidden)?;
    if let Some(l) = logits {
        check_finite_output("logits", l)?;
    }
    let f = |x: &Tensor| x.as_f32().map(<[f32]>::to_vec).unwrap_or_default();
    let mut out = json!({
        "hidden_shape": hidden.shape,
        "hidden": f(hidden),
    });
    if let Some(l) = logits {
        out["logits_shape"] = json!(l.shape);
        out["logits"] = json!(f(l));
    }
    files.write("--out", &a.out, serde_json::to_string(&out)?.as_bytes())?;
    let returned = match logits {
        Some(l) => format!("logits {:?}", l.shape),
        None => format!("hidden {:?}", hidden.shape),
    };
    ran(&returned);
    Ok(())
}

/// Refuses an output holding NaN or ±inf (JSON has no such numbers: they would be written as
/// `null`), naming it, how many, and the first one's position.
fn check_finite_output(name: &str, t: &Tensor) -> anyhow::Result<()> {
    let data = t.as_f32().unwrap_or(&[]);
    let Some(first) = data.iter().position(|x| !x.is_finite()) else {
        return Ok(());
    };
    let count = data.iter().filter(|x| !x.is_finite()).count();
    let mut at = vec![0; t.shape.len()];
    let mut rem = first;
    for (i, &d) in t.shape.iter().enumerate().rev() {
        at[i] = rem % d.max(1);
        rem /= d.max(1);
    }
    bail!(
        "output `{name}` {:?} has {count} non-finite value{} (first at {at:?}: {}); nothing \
         was written",
        t.shape,
        if count == 1 { "" } else { "s" },
        data[first]
    )
}

/// `--backend cuda`: an unsharded plan on GPU 0, or a sharded one on virtual ranks of GPU 0
/// (local-gpu communicator). Returns rank 0's outputs and a description.
fn run_cuda(
    dev: &Arc<CudaDevice>,
    opts: &CudaOptions,
    plan: &Plan,
    weights: &Weights,
    inputs: &BTreeMap<String, Tensor>,
) -> anyhow::Result<(BTreeMap<String, Tensor>, String)> {
    let params = ParamInit::Weights(weights);
    let mesh = &plan.mesh;
    Ok(if mesh.axes.is_empty() {
        let out = execute_cuda(dev, &plan.program, &params, inputs, opts.clone())?;
        (out, format!("unsharded on {} ({})", dev.name(), opts.dtype))
    } else {
        let mut outs = run_spmd_local_gpu(dev, &plan.program, mesh, &params, inputs, opts)?;
        (
            outs.swap_remove(0),
            format!(
                "mesh {} on {} virtual ranks of {} (local-gpu, {})",
                mesh,
                mesh.world_size(),
                dev.name(),
                opts.dtype
            ),
        )
    })
}

#[cfg(test)]
mod cuda_tests {
    use super::*;
    use shardc::runtime::cuda::CudaError;

    /// `--backend cuda` on a machine without a driver fails first, with the clear message; on a
    /// GPU machine it gets past the probe and fails on the (missing) model instead.
    #[test]
    fn cuda_backend_without_a_driver_is_a_clear_error() {
        let args = RunArgs {
            model: PathBuf::from("/nonexistent/model"),
            tokens: PathBuf::from("/nonexistent/ids.json"),
            attention_mask: None,
            position_ids: None,
            out: PathBuf::from("/nonexistent/out.json"),
            returns: None,
            overwrite: false,
            plan: None,
            mesh: None,
            strategy: vec![],
            cp: Default::default(),
            backend: super::super::args::BackendArgs {
                backend: "cuda".into(),
                dtype: "bf16".into(),
                cuda_graphs: false,
            },
            comm_timeout: Duration::from_secs(5),
        };
        let err = run(args).expect_err("no model here").to_string();
        match shardc::runtime::cuda::cuda_device_count() {
            Err(CudaError::NoDriver) => assert_eq!(
                err,
                "no CUDA driver found (libcuda.so not loadable); use --backend cpu"
            ),
            Err(_) => assert!(err.ends_with("; use --backend cpu"), "{err}"),
            Ok(_) => assert!(err.contains("/nonexistent/model"), "{err}"),
        }
    }
}
