//! `shardc inspect`: parameters, FLOPs per token and static memory.

use super::fmt::{bytes, si, thousands};
use anyhow::Context;
use clap::Args;
use serde_json::json;
use shardc::compiler::model::ModelStats;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A `config.json` or a model directory (default: the bundled Llama-3-8B config).
    model: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Context length for attention FLOPs (default: min(max positions, 4096)).
    #[arg(long)]
    seq: Option<usize>,
}

pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let path = a.model.unwrap_or_else(super::default_model);
    let (cfg, seq) = super::args::config_and_seq(&path, a.seq)?;
    super::args::check_seq("--seq", seq, &cfg)?;
    let s = ModelStats::compute(&cfg, seq).context("computing model statistics")?;
    if a.json {
        let groups: serde_json::Map<String, serde_json::Value> = s
            .by_group
            .iter()
            .map(|(g, n)| (g.name().to_string(), json!(n)))
            .collect();
        let out = json!({
            "model": path.display().to_string(),
            "model_type": cfg.arch.name(),
            "params": s.params,
            "params_by_component": groups,
            "layers": cfg.layers,
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "ffn": cfg.ffn,
            "vocab": cfg.vocab,
            "experts": cfg.moe.map(|m| m.experts),
            "experts_per_token": cfg.moe.map(|m| m.top_k),
            "tied_embeddings": cfg.tied,
            "active_matmul_params": s.active_matmul_params,
            "seq": s.seq,
            "flops_per_token": {
                "forward": s.forward_flops_per_token,
                "training": s.training_flops_per_token,
            },
            "memory_bytes": {
                "training_adamw_mixed": s.training_static_bytes,
                "inference_bf16": s.inference_bf16_bytes,
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} ({}): {} parameters{}",
        path.display(),
        cfg.arch.name(),
        thousands(s.params),
        if cfg.tied {
            " (tied embeddings counted once)"
        } else {
            ""
        }
    );
    println!(
        "  {} layers, hidden {}, {} heads / {} KV heads × {}, ffn {}, vocab {}{}",
        cfg.layers,
        cfg.hidden,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
        cfg.ffn,
        cfg.vocab,
        cfg.moe
            .map(|m| format!(", {} experts top-{}", m.experts, m.top_k))
            .unwrap_or_default()
    );
    println!("parameters by component:");
    for (g, n) in &s.by_group {
        println!(
            "  {:<10} {:>18}  {:5.1}%",
            g.name(),
            thousands(*n),
            100.0 * *n as f64 / s.params as f64
        );
    }
    println!(
        "FLOPs per token at seq {}: forward {}FLOP, training {}FLOP (3× forward)",
        s.seq,
        si(s.forward_flops_per_token as f64),
        si(s.training_flops_per_token as f64)
    );
    println!(
        "static memory: mixed-precision AdamW training {} (16 B/param), bf16 inference weights {} (2 B/param)",
        bytes(s.training_static_bytes),
        bytes(s.inference_bf16_bytes)
    );
    Ok(())
}
