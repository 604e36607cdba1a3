//! Argument helpers shared by the subcommands: the mesh and strategies of a compile, size
//! flags checked with the flag's name.

use anyhow::bail;
use shardc::compiler::compile::CompileOptions;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::shard::Mesh;

/// Default mesh and strategies of a bare `shardc compile`.
const DEFAULT_MESH: &str = "dp=2,tp=4";
const DEFAULT_EXTRA: &str = "sp";

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

/// `--flag: must be at least MIN (found X)`.
pub fn at_least(flag: &str, value: usize, min: usize) -> anyhow::Result<()> {
    if value < min {
        bail!("{flag}: must be at least {min} (found {value})");
    }
    Ok(())
}

/// A sequence length of 1 up to the model's maximum positions.
pub fn check_seq(flag: &str, seq: usize, cfg: &ModelConfig) -> anyhow::Result<()> {
    at_least(flag, seq, 1)?;
    if seq > cfg.max_positions {
        bail!(
            "{flag}: {seq} exceeds the model's maximum positions {}",
            cfg.max_positions
        );
    }
    Ok(())
}
