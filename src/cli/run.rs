//! `shardc run`: execute a model on the CPU reference backend, unsharded or as a sharded plan
//! on thread ranks, with the `--tokens/--out` JSON contract.

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};
use shardc::compiler::model::{build_forward, BuildOptions, ModelConfig};
use shardc::compiler::pipeline::compile_forward;
use shardc::runtime::spmd::run_spmd;
use shardc::runtime::{execute, RankCtx, Tensor, Weights};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
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
    /// Run the sharded plan for this mesh on thread ranks (e.g. `tp=2`, `dp=2,tp=2`).
    #[arg(long)]
    mesh: Option<String>,
    /// Strategies beyond the mesh axes' defaults (e.g. `sp`).
    #[arg(long)]
    strategy: Vec<String>,
    /// Backend.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Seconds a rank waits for its peers in a collective before failing.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
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
                    "{what} {}: [{b}][{t}] = {x} is not an integer",
                    path.display()
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

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    if a.backend != "cpu" {
        bail!(
            "backend `{}` is not available in this build (available: cpu)",
            a.backend
        );
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
        Some(p) => same_shape("attention mask", read_matrix(p, "attention mask")?)?
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
        None => {
            let g = build_forward(&cfg, BuildOptions::new(b, t))?;
            (
                execute(&g, &weights, &inputs, &RankCtx::new())?,
                "unsharded".to_string(),
            )
        }
        Some(m) => {
            let opts = super::compile::options(&cfg, Some(m), &a.strategy, b, t, 8)?;
            let c = compile_forward(&cfg, &opts)?;
            let mut outs = run_spmd(
                &c.sharded.graph,
                &opts.mesh,
                &weights,
                &inputs,
                Duration::from_secs(a.timeout),
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
    let f = |x: &Tensor| x.as_f32().map(<[f32]>::to_vec).unwrap_or_default();
    let out = json!({
        "logits_shape": logits.shape,
        "logits": f(logits),
        "hidden_shape": hidden.shape,
        "hidden": f(hidden),
    });
    std::fs::write(&a.out, serde_json::to_string(&out)?)
        .with_context(|| format!("writing {}", a.out.display()))?;
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
