//! `shardc checkpoint`: what a sharded checkpoint (`shardc train --save DIR`) holds and the
//! copy that takes it to another layout (`inspect`), its weights as a HuggingFace directory
//! (`export`), and a HuggingFace model as a checkpoint of step 0 on any mesh (`import`).

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use shardc::compiler::checkpoint::{reshard_reads, StateKind};
use shardc::compiler::compile::{compile, CompileSpec, Job};
use shardc::compiler::model::ModelConfig;
use shardc::compiler::plan::Plan;
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{Precision, TrainOptions};
use shardc::runtime::checkpoint::{self, Checkpoint, ExportDType, ELEM_BYTES};
use shardc::runtime::output::Outputs;
use shardc::runtime::train::TrainState;
use shardc::runtime::Weights;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::fmt::bytes as fmt_bytes;

#[derive(Args, Debug)]
pub struct CheckpointArgs {
    #[command(subcommand)]
    cmd: CheckpointCmd,
}

#[derive(Subcommand, Debug)]
enum CheckpointCmd {
    /// What a checkpoint holds: step, data position, the layout it was saved from, tensors,
    /// bytes per state and rank; every chunk verified (coverage and checksums). With
    /// `--to-mesh`, the bytes each rank of that layout would read, and from which files.
    Inspect(InspectArgs),
    /// Write a checkpoint's weights as a HuggingFace directory (config.json +
    /// model.safetensors, or shards with model.safetensors.index.json).
    Export(ExportArgs),
    /// Write a HuggingFace model as a checkpoint of step 0 (zero AdamW moments) sharded for a
    /// mesh, which `shardc train --resume` continues on any mesh.
    Import(ImportArgs),
}

/// The layout flags of `--to-mesh` and `import`.
#[derive(Args, Debug, Clone, Default)]
struct LayoutArgs {
    /// Strategies beyond the mesh axes' defaults (`sp`, `zero1`, `zero2`, `zero3`, `fsdp`).
    #[arg(long)]
    strategy: Vec<String>,
}

#[derive(Args, Debug)]
struct InspectArgs {
    /// A checkpoint directory (its latest step) or a step directory.
    dir: PathBuf,
    /// Plan the copy to this mesh (e.g. `tp=2`, `pp=2,dp=2`): per rank, the bytes it reads
    /// and from which saved ranks' files.
    #[arg(long)]
    to_mesh: Option<String>,
    #[command(flatten)]
    layout: LayoutArgs,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct ExportArgs {
    /// A checkpoint directory (its latest step) or a step directory.
    dir: PathBuf,
    /// The HuggingFace directory to write.
    out: PathBuf,
    /// Tensor dtype: `source` (each tensor's dtype in the model trained; default), `f32`
    /// (training's values, bit for bit), `bf16` or `f16`.
    #[arg(long, default_value = "source")]
    dtype: String,
    /// Largest safetensors file, e.g. `5GB` (transformers' default), `500MB`, `1000000`.
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
    /// Replace an export directory that holds other files (they are kept) or is an input.
    #[arg(long)]
    overwrite: bool,
}

#[derive(Args, Debug)]
struct ImportArgs {
    /// A HuggingFace model directory (config.json + safetensors).
    model: PathBuf,
    /// The checkpoint directory to write (its step 0).
    out: PathBuf,
    /// Shard it as this mesh saves (default: unsharded, one file).
    #[arg(long)]
    mesh: Option<String>,
    #[command(flatten)]
    layout: LayoutArgs,
}

pub fn run(a: CheckpointArgs) -> anyhow::Result<()> {
    match a.cmd {
        CheckpointCmd::Inspect(a) => inspect(a),
        CheckpointCmd::Export(a) => export(a),
        CheckpointCmd::Import(a) => import(a),
    }
}

/// A training plan for `mesh` (and `strategy`) of model `cfg`, for its layout alone: the
/// smallest batch the mesh divides, one micro-batch per pipeline stage.
fn layout_plan(
    cfg: &ModelConfig,
    source: &str,
    mesh: Option<&str>,
    strategy: &[String],
) -> anyhow::Result<Plan> {
    let mesh = match mesh {
        Some(m) => Mesh::parse(m, 8)?,
        None => Mesh::single(),
    };
    let size = |name: &str| mesh.axis(name).map_or(1, |a| mesh.axis_size(a));
    let micro = size("pp");
    let (batch, seq) = (mesh.data_ranks() * micro, 16 * size("cp"));
    let mut opts = TrainOptions::new(batch, seq, mesh);
    opts.extra_strategies = strategy.to_vec();
    opts.micro_batches = micro;
    let mut spec = CompileSpec::new(cfg.clone(), source.to_string(), Job::Train(Box::new(opts)));
    spec.precision = Precision::f32();
    Ok(compile(&spec)?)
}

/// The model config a checkpoint holds.
fn config_of(ck: &Checkpoint) -> anyhow::Result<ModelConfig> {
    ModelConfig::from_json(&ck.manifest.model.config).with_context(|| {
        format!(
            "checkpoint {}: its model config does not parse",
            ck.dir.display()
        )
    })
}

fn inspect(a: InspectArgs) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let ck = Checkpoint::open(&a.dir)?;
    ck.verify_data()?;
    let verify_ms = t0.elapsed().as_secs_f64() * 1e3;
    let m = &ck.manifest;
    let mut per_kind: BTreeMap<StateKind, u64> = BTreeMap::new();
    let mut per_rank: Vec<(u64, usize)> = vec![(0, 0); m.files.len()];
    for c in &m.chunks {
        *per_kind.entry(c.kind).or_default() += c.bytes();
        per_rank[c.rank].0 += c.bytes();
        per_rank[c.rank].1 += 1;
    }
    let stored: u64 = per_rank.iter().map(|r| r.0).sum();
    let elements: usize = m
        .tensors
        .values()
        .map(|t| t.shape.iter().product::<usize>())
        .sum();
    let trained = m.tensors.values().filter(|t| t.trained).count();
    let reshard = match &a.to_mesh {
        Some(mesh) => {
            let cfg = config_of(&ck)?;
            let plan = layout_plan(&cfg, &m.model.source, Some(mesh), &a.layout.strategy)?;
            let saved: Vec<_> = m.chunks.iter().map(|c| c.saved()).collect();
            Some((plan.clone(), reshard_reads(&saved, &plan, ELEM_BYTES)?))
        }
        None => None,
    };
    if a.json {
        let mut v = serde_json::json!({
            "dir": ck.dir.display().to_string(),
            "step": m.step,
            "data": m.data,
            "model": { "arch": m.model.arch, "source": m.model.source },
            "layout": m.layout,
            "adamw": m.adamw,
            "tensors": m.tensors.len(),
            "trained_tensors": trained,
            "elements": elements,
            "bytes": stored,
            "bytes_per_state": per_kind.iter().map(|(k, b)| (k.name().to_string(), *b)).collect::<BTreeMap<_, _>>(),
            "files": m.files.iter().zip(&per_rank).map(|(f, (b, n))| serde_json::json!({"name": f.name, "bytes": b, "chunks": n})).collect::<Vec<_>>(),
            "chunks": m.chunks.len(),
            "verified": true,
        });
        if let Some((plan, reads)) = &reshard {
            v["reshard"] = serde_json::json!({
                "mesh": plan.mesh.to_string(),
                "strategies": plan.strategies,
                "ranks": reads.iter().map(|r| serde_json::json!({
                    "bytes": r.bytes(),
                    "chunks": r.chunks,
                    "from": r.from.iter().map(|(k, b)| (k.to_string(), *b)).collect::<BTreeMap<_, _>>(),
                })).collect::<Vec<_>>(),
            });
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "checkpoint {} ({} v{})",
        ck.dir.display(),
        m.format,
        m.format_version
    );
    if m.data.tokens.is_empty() {
        println!("  step {}; data: none read yet (imported)", m.step);
    } else {
        println!(
            "  step {}; data: next sample {} (batch {} × {} tokens, tokens {})",
            m.step,
            m.data.next_sample,
            m.data.batch,
            m.data.seq,
            short(&m.data.tokens)
        );
    }
    println!("  model: {} from {}", m.model.arch, m.model.source);
    let l = &m.layout;
    let mesh = if l.mesh.is_empty() {
        "unsharded".to_string()
    } else {
        format!("mesh {} ({})", l.mesh, l.strategies.join(","))
    };
    let schedule = l
        .schedule
        .as_ref()
        .map_or(String::new(), |s| format!(", schedule {s}"));
    println!(
        "  saved from: {mesh}, ZeRO {}, {} micro-batch(es), recompute {}{schedule}; plan {}",
        l.zero_stage,
        l.micro_batches,
        l.recompute,
        short(&l.plan_hash)
    );
    let w = &m.adamw;
    println!(
        "  AdamW: lr {} β₁ {} β₂ {} ε {} weight decay {}",
        w.lr.0, w.beta1.0, w.beta2.0, w.eps.0, w.weight_decay.0
    );
    println!(
        "  tensors: {} ({trained} trained), {elements} elements",
        m.tensors.len()
    );
    let kinds: Vec<String> = per_kind
        .iter()
        .map(|(k, b)| format!("{k} {}", fmt_bytes(*b)))
        .collect();
    println!(
        "  state: {}; {} chunks in {} files ({})",
        kinds.join(", "),
        m.chunks.len(),
        m.files.len(),
        fmt_bytes(stored)
    );
    for (f, (b, n)) in m.files.iter().zip(&per_rank) {
        println!("    {} {} ({n} chunks)", f.name, fmt_bytes(*b));
    }
    println!(
        "  verified: every tensor's state covered exactly once, {} checksums match ({verify_ms:.1} ms)",
        m.chunks.len()
    );
    if let Some((plan, reads)) = reshard {
        println!(
            "reshard to mesh {} ({}): bytes each rank reads, from which saved ranks' files",
            plan.mesh,
            plan.strategies.join(",")
        );
        for (r, rr) in reads.iter().enumerate() {
            let from: Vec<String> = rr
                .from
                .iter()
                .map(|(k, b)| format!("{k} ({})", fmt_bytes(*b)))
                .collect();
            println!(
                "  rank {r} ({}): {} in {} chunk reads, from rank(s) {}",
                plan.mesh.coords_label(r),
                fmt_bytes(rr.bytes()),
                rr.chunks,
                from.join(", ")
            );
        }
        let total: u64 = reads.iter().map(|r| r.bytes()).sum();
        let max = reads.iter().map(|r| r.bytes()).max().unwrap_or(0);
        println!(
            "  total {} read of {} stored; at most {} per rank",
            fmt_bytes(total),
            fmt_bytes(stored),
            fmt_bytes(max)
        );
    }
    Ok(())
}

/// `blake3:0123456789ab…`: a digest shortened for a summary line.
fn short(d: &str) -> String {
    match d.char_indices().nth(19) {
        Some((i, _)) => format!("{}…", &d[..i]),
        None => d.to_string(),
    }
}

/// `5GB`, `500MB`, `64KiB`, `1000000`: bytes.
fn parse_size(flag: &str, text: &str) -> anyhow::Result<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        u => bail!("{flag}: unknown unit `{u}` in `{text}` (B, KB, MB, GB, KiB, MiB, GiB)"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("{flag}: `{text}` is not a size (e.g. 5GB, 500MB)"))?;
    let b = (n * scale).round();
    if !(b >= 1.0 && b.is_finite()) {
        bail!("{flag}: must be at least 1 byte (found `{text}`)");
    }
    Ok(b as u64)
}

fn export(a: ExportArgs) -> anyhow::Result<()> {
    let Some(dtype) = ExportDType::from_name(&a.dtype) else {
        bail!(
            "--dtype: unknown dtype `{}`; valid: source, f32, bf16, f16",
            a.dtype
        );
    };
    let max = parse_size("--max-shard-size", &a.max_shard_size)?;
    let t0 = Instant::now();
    let ck = Checkpoint::open(&a.dir)?;
    let outputs = Outputs::new(a.overwrite).input(&ck.dir);
    outputs.check_dir_matching("OUT", &a.out, &checkpoint::is_model_file)?;
    let done = checkpoint::export(&ck, &a.out, dtype, max)?;
    println!(
        "exported step {} of {}: {} tensors, {} in {} → {} ({:.1} ms)",
        ck.manifest.step,
        ck.dir.display(),
        done.tensors,
        fmt_bytes(done.bytes),
        done.files.join(", "),
        a.out.display(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

fn import(a: ImportArgs) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let cfg = ModelConfig::from_path(&a.model)?;
    let weights = Weights::open(&a.model)?;
    let outputs = Outputs::new(false).input(&a.model);
    outputs.check_dir_matching("OUT", &a.out, &checkpoint::is_checkpoint_entry)?;
    let source = a.model.display().to_string();
    let plan = layout_plan(&cfg, &source, a.mesh.as_deref(), &a.layout.strategy)?;
    let state = TrainState::load(&plan, &weights)?;
    let info = checkpoint::SaveInfo {
        data: checkpoint::DataPosition {
            next_sample: 0,
            batch: 0,
            seq: 0,
            tokens: String::new(),
        },
        model: checkpoint::SavedModel {
            source,
            arch: cfg.arch.name().to_string(),
            config: config_json(&a.model)?,
        },
        weights: &weights,
        before_publish: None,
    };
    let at = checkpoint::save_global(&a.out, &plan, &state, &info)?;
    let how = if plan.mesh.world_size() == 1 {
        "unsharded".to_string()
    } else {
        format!("for mesh {} ({})", plan.mesh, plan.strategies.join(","))
    };
    println!(
        "imported {} {how} → {} ({:.1} ms)",
        a.model.display(),
        at.display(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

/// The model's `config.json` as JSON (a directory's, or the file given).
pub fn config_json(model: &Path) -> anyhow::Result<serde_json::Value> {
    let src = if model.is_dir() {
        model.join("config.json")
    } else {
        model.to_path_buf()
    };
    let text =
        std::fs::read_to_string(&src).with_context(|| format!("reading {}", src.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", src.display()))
}
