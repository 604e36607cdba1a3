//! `shardc compile`: model + mesh + strategies → plan.json and a summary.

use super::fmt::{bytes, thousands};
use anyhow::Context;
use clap::Args;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::pipeline::{compile_forward_with, CompileOptions};
use shardc::compiler::plan::Plan;
use shardc::compiler::rewrite::{RewriteOptions, RuleSelection};
use shardc::compiler::shard::Mesh;
use std::path::PathBuf;

/// Default mesh and strategies of a bare `shardc compile`.
const DEFAULT_MESH: &str = "dp=2,tp=4";
const DEFAULT_EXTRA: &str = "sp";

#[derive(Args, Debug)]
pub struct CompileArgs {
    /// A `config.json` or model directory (default: the bundled Llama-3-8B config).
    pub model: Option<PathBuf>,
    /// Device mesh, e.g. `dp=2,tp=4` (default dp=2,tp=4 with sp when nothing is given).
    #[arg(long)]
    pub mesh: Option<String>,
    /// Strategies beyond the mesh axes' defaults, comma-separated (e.g. `sp`).
    #[arg(long)]
    pub strategy: Vec<String>,
    /// Global batch (sequences).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Sequence length (default: min(max positions, 4096)).
    #[arg(long)]
    pub seq: Option<usize>,
    /// GPUs per node (axes that fit inside a node use NVLink).
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// Where to write the plan.
    #[arg(short = 'o', long, default_value = "plan.json")]
    pub output: PathBuf,
    /// Cluster profile whose device memory every rank must fit (`dgx-h100`, a `.toml` path).
    #[arg(long, default_value = "dgx-h100")]
    pub cluster: String,
    /// Write the plan even when a rank's memory exceeds the device's.
    #[arg(long)]
    pub allow_oom: bool,
    /// Rewrite rules: `none`, `all`, `sequence-parallel`, or rule and group names,
    /// comma-separated (e.g. `allreduce-split,gather-sink,collective-matmul`).
    #[arg(long, default_value = "none")]
    pub rewrite: String,
    /// Weight of the rewriter's activation-memory term, µs per MiB (0: time only).
    #[arg(long, default_value_t = shardc::compiler::rewrite::cost::DEFAULT_MEMORY_US_PER_MIB)]
    pub memory_weight: f64,
}

/// Resolved inputs shared by `compile` and sharded `run`.
pub fn options(
    cfg: &ModelConfig,
    mesh: Option<&str>,
    strategy: &[String],
    batch: usize,
    seq: usize,
    gpus_per_node: usize,
) -> anyhow::Result<CompileOptions> {
    let (mesh, extra) = match mesh {
        Some(m) => (m.to_string(), strategy.to_vec()),
        None if strategy.is_empty() => (DEFAULT_MESH.to_string(), vec![DEFAULT_EXTRA.to_string()]),
        None => (DEFAULT_MESH.to_string(), strategy.to_vec()),
    };
    let _ = cfg;
    Ok(CompileOptions {
        batch,
        seq,
        mesh: Mesh::parse(&mesh, gpus_per_node)?,
        extra_strategies: extra,
    })
}

pub fn run(a: CompileArgs) -> anyhow::Result<()> {
    let path = a.model.clone().unwrap_or_else(super::default_model);
    let cfg = ModelConfig::from_path(&path)?;
    let seq = a.seq.unwrap_or(cfg.max_positions.min(4096));
    let opts = options(
        &cfg,
        a.mesh.as_deref(),
        &a.strategy,
        a.batch,
        seq,
        a.gpus_per_node,
    )?;
    let mut rw = RewriteOptions::with_rules(a.rewrite.parse::<RuleSelection>()?);
    rw.cost.memory_us_per_mib = a.memory_weight;
    let t0 = std::time::Instant::now();
    let compiled = compile_forward_with(&cfg, &opts, &rw)?;
    let plan = Plan::new(
        &compiled,
        &path.display().to_string(),
        cfg.arch.name(),
        cfg.layers,
    );
    plan.check_collective_order()?;
    super::simulate::fit_check(&plan, &a.cluster, a.allow_oom)?;
    let elapsed = t0.elapsed();
    let json = plan.to_json();
    std::fs::write(&a.output, &json).with_context(|| format!("writing {}", a.output.display()))?;
    print_summary(&plan);
    if let Some(r) = &compiled.report {
        print!("{r}");
    }
    println!(
        "compiled in {:.1} ms; wrote {} (plan format v{}, {} steps, {})",
        elapsed.as_secs_f64() * 1e3,
        a.output.display(),
        plan.format_version,
        thousands(plan.steps.len() as u64),
        bytes(json.len() as u64)
    );
    Ok(())
}

/// The summary `compile` prints (also used by `explain`).
pub fn print_summary(plan: &Plan) {
    let strategies = plan.strategies.join(",");
    println!(
        "{} ({}, {} layers) on mesh {} ({} ranks, {} GPUs/node), strategies {}, batch {} × seq {}",
        plan.model.source,
        plan.model.model_type,
        plan.model.layers,
        plan.mesh,
        plan.mesh.world_size(),
        plan.mesh.gpus_per_node,
        if strategies.is_empty() {
            "none".into()
        } else {
            strategies
        },
        plan.model.batch,
        plan.model.seq
    );
    for a in &plan.mesh.axes {
        println!(
            "  axis {:<3} size {:<4} link {}",
            a.name,
            a.size,
            a.link.name()
        );
    }
    println!(
        "per rank: params {}, activations {} peak (arena), {} without reuse; norm+residual activations {}",
        bytes(plan.memory.param_bytes),
        bytes(plan.memory.activation_arena_bytes),
        bytes(plan.memory.activation_total_bytes),
        bytes(plan.norm_residual_bytes())
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
            println!("  {op:<15} {axis:<4} {:>12}", bytes(*b));
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
        "total per forward: {count} collectives, {} per rank",
        bytes(total)
    );
}
