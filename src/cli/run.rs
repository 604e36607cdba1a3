//! `shardc run`: execute a model on the CPU reference backend, unsharded or as a sharded plan
//! on thread ranks, with the `--tokens/--out` JSON contract.
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
use shardc::compiler::compile::compile_forward;
use shardc::compiler::model::{build_forward, BuildOptions, ModelConfig};
use shardc::compiler::plan::Plan;
use shardc::runtime::cuda::{
    execute_cuda, run_spmd_local_gpu, CudaDevice, CudaOptions, GpuDType, ParamInit,
};
use shardc::runtime::launch::{plan_fingerprint, ProcessGroup, WorldEnv};
use shardc::runtime::output::Outputs;
use shardc::runtime::spmd::run_spmd;
use shardc::runtime::{execute, RankCtx, Tensor, Weights};
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
    /// Allow `--out` to replace a file this command reads (still atomically).
    #[arg(long)]
    overwrite: bool,
    /// Run the sharded plan for this mesh on thread ranks (e.g. `tp=2`, `dp=2,tp=2`), or,
    /// when RANK/WORLD_SIZE are set (`shardc launch`), this process's rank of it.
    #[arg(long)]
    mesh: Option<String>,
    /// Strategies beyond the mesh axes' defaults (e.g. `sp`).
    #[arg(long)]
    strategy: Vec<String>,
    /// Backend: `cpu` (reference) or `cuda` (one GPU; with `--mesh`, every rank as a
    /// virtual rank of GPU 0 with the local-gpu communicator).
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Element type of the CUDA backend (`f32` or `bf16`).
    #[arg(long, default_value = "f32")]
    dtype: String,
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
fn read_matrix(path: &Path, what: &str) -> anyhow::Result<(usize, usize, Vec<i64>)> {
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

/// Reads an attention mask: a batch × seq matrix of 0 (padding) and 1 (keep).
fn read_mask(path: &Path) -> anyhow::Result<(usize, usize, Vec<i64>)> {
    let (b, t, v) = read_matrix(path, "attention mask")?;
    if let Some(i) = v.iter().position(|&x| x != 0 && x != 1) {
        bail!(
            "attention mask {}: [{}][{}] = {} is not 0 (padding) or 1 (keep)",
            path.display(),
            i / t,
            i % t,
            v[i]
        );
    }
    Ok((b, t, v))
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    let files = Outputs::new(a.overwrite).inputs([
        Some(a.model.as_path()),
        Some(&a.tokens),
        a.attention_mask.as_deref(),
        a.position_ids.as_deref(),
    ]);
    files.check_file("--out", &a.out)?;
    let cuda = match a.backend.as_str() {
        "cpu" => None,
        "cuda" => Some(cuda_backend(&a)?),
        other => bail!("backend `{other}` is not available (available: cpu, cuda)"),
    };
    // A rank of a multi-process job (validated before any work).
    let world = if WorldEnv::detected() {
        Some(WorldEnv::from_env()?)
    } else {
        None
    };
    if let (None, Some(w)) = (&a.mesh, &world) {
        if w.world_size > 1 {
            bail!(
                "this process is rank {} of {} (RANK/WORLD_SIZE are set) but no --mesh was given; \
                 a multi-process run needs a mesh of {} ranks",
                w.rank,
                w.world_size,
                w.world_size
            );
        }
    }
    let cfg = ModelConfig::from_path(&a.model)?;
    let (b, t, ids) = read_matrix(&a.tokens, "tokens")?;
    if t > cfg.max_positions {
        bail!(
            "sequence length {t} exceeds the model's maximum positions {}",
            cfg.max_positions
        );
    }
    for (i, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= cfg.vocab {
            bail!(
                "token id {id} at [{}][{}] is out of range for vocabulary size {}",
                i / t,
                i % t,
                cfg.vocab
            );
        }
    }
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
            if let Some((i, &x)) = v
                .iter()
                .enumerate()
                .find(|(_, &x)| x < 0 || x as usize >= cfg.max_positions)
            {
                bail!(
                    "position id {x} at [{}][{}] is outside [0, {})",
                    i / t,
                    i % t,
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
    let t0 = Instant::now();
    let (outputs, how) = match &a.mesh {
        _ if cuda.is_some() => {
            if world.is_some() {
                bail!("--backend cuda runs one process (--mesh runs every rank on GPU 0); multi-process CUDA runs are not wired into `shardc run` yet");
            }
            let (dev, opts) = cuda.as_ref().expect("invariant: matched");
            run_cuda(dev, opts, &cfg, &a, &weights, &inputs, b, t)?
        }
        None => {
            let g = build_forward(&cfg, BuildOptions::new(b, t))?;
            (
                execute(&g, &weights, &inputs, &RankCtx::new())?,
                "unsharded".to_string(),
            )
        }
        Some(m) if world.is_some() => {
            let env = world.as_ref().expect("invariant: matched");
            let opts = super::args::options(&cfg, Some(m), &a.strategy, b, t, 8)?;
            let c = compile_forward(&cfg, &opts)?;
            // Ranks must agree on the program (not on where each found the model).
            let plan = Plan::new(&c, "", cfg.arch.name(), cfg.layers);
            let fingerprint = plan_fingerprint(plan.to_json().as_bytes());
            let pg = ProcessGroup::connect(env, &opts.mesh, &fingerprint, None, a.comm_timeout)?;
            test_fault_hook(env.rank)?;
            let out = pg.run(&c.sharded.graph, &weights, &inputs)?;
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
            let names: Vec<&str> = c.strategies.iter().map(|s| s.name()).collect();
            (
                out,
                format!(
                    "mesh {} ({}) as rank 0 of {} processes (tcp; job {job})",
                    opts.mesh,
                    names.join(","),
                    env.world_size
                ),
            )
        }
        Some(m) => {
            let opts = super::args::options(&cfg, Some(m), &a.strategy, b, t, 8)?;
            let c = compile_forward(&cfg, &opts)?;
            let mut outs = run_spmd(
                &c.sharded.graph,
                &opts.mesh,
                &weights,
                &inputs,
                a.comm_timeout,
            )?;
            let names: Vec<&str> = c.strategies.iter().map(|s| s.name()).collect();
            (
                outs.swap_remove(0),
                format!(
                    "mesh {} ({}) on {} thread ranks",
                    opts.mesh,
                    names.join(","),
                    opts.mesh.world_size()
                ),
            )
        }
    };
    let elapsed = t0.elapsed();
    let get = |name: &str| -> anyhow::Result<&Tensor> {
        outputs
            .get(name)
            .with_context(|| format!("the program has no `{name}` output"))
    };
    let (logits, hidden) = (get("logits")?, get("hidden")?);
    check_finite_output("logits", logits)?;
    check_finite_output("hidden", hidden)?;
    let f = |x: &Tensor| x.as_f32().map(<[f32]>::to_vec).unwrap_or_default();
    let out = json!({
        "logits_shape": logits.shape,
        "logits": f(logits),
        "hidden_shape": hidden.shape,
        "hidden": f(hidden),
    });
    files.write("--out", &a.out, serde_json::to_string(&out)?.as_bytes())?;
    println!(
        "ran {} ({} layers) {how}: batch {b} × {t} tokens in {:.1} ms; logits {:?} → {}",
        cfg.arch.name(),
        cfg.layers,
        elapsed.as_secs_f64() * 1e3,
        logits.shape,
        a.out.display()
    );
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

/// The CUDA device and options for `--backend cuda`, or the clear error of a machine without
/// a driver (checked before any other work).
fn cuda_backend(a: &RunArgs) -> anyhow::Result<(Arc<CudaDevice>, CudaOptions)> {
    let Some(dtype) = GpuDType::parse(&a.dtype) else {
        bail!(
            "--dtype {} is not supported by the CUDA backend (f32, bf16)",
            a.dtype
        );
    };
    // Probes for libcuda before any cudarc call: no driver is an error, never a panic.
    let dev = CudaDevice::open(0).map_err(|e| anyhow::anyhow!("{e}; use --backend cpu"))?;
    let opts = CudaOptions {
        dtype,
        timeout: a.comm_timeout,
        ..CudaOptions::default()
    };
    Ok((dev, opts))
}

/// `--backend cuda`: the unsharded graph on GPU 0, or the plan for `--mesh` on virtual ranks
/// of GPU 0 (local-gpu communicator). Returns rank 0's outputs and a description.
#[allow(clippy::too_many_arguments)]
fn run_cuda(
    dev: &Arc<CudaDevice>,
    opts: &CudaOptions,
    cfg: &ModelConfig,
    a: &RunArgs,
    weights: &Weights,
    inputs: &BTreeMap<String, Tensor>,
    b: usize,
    t: usize,
) -> anyhow::Result<(BTreeMap<String, Tensor>, String)> {
    let params = ParamInit::Weights(weights);
    Ok(match &a.mesh {
        None => {
            let g = build_forward(cfg, BuildOptions::new(b, t))?;
            let out = execute_cuda(dev, &g, &params, inputs, opts.clone())?;
            (out, format!("unsharded on {} ({})", dev.name(), opts.dtype))
        }
        Some(m) => {
            let o = super::args::options(cfg, Some(m), &a.strategy, b, t, 8)?;
            let c = compile_forward(cfg, &o)?;
            let mut outs =
                run_spmd_local_gpu(dev, &c.sharded.graph, &o.mesh, &params, inputs, opts)?;
            (
                outs.swap_remove(0),
                format!(
                    "mesh {} on {} virtual ranks of {} (local-gpu, {})",
                    o.mesh,
                    o.mesh.world_size(),
                    dev.name(),
                    opts.dtype
                ),
            )
        }
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
            overwrite: false,
            mesh: None,
            strategy: vec![],
            backend: "cuda".into(),
            dtype: "bf16".into(),
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
