//! Argument helpers shared by the subcommands: the mesh and strategies of a compile, size
//! flags checked with the flag's name.

use anyhow::bail;
use shardc::compiler::compile::CompileOptions;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::shard::Mesh;
use shardc::runtime::cuda::{CudaDevice, CudaOptions, GpuDType};
use shardc::runtime::launch::WorldEnv;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

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
    let (mesh, extra) = mesh_or_default(mesh, strategy.to_vec());
    let _ = cfg;
    Ok(CompileOptions {
        batch,
        seq,
        mesh: Mesh::parse(&mesh, gpus_per_node)?,
        extra_strategies: extra,
    })
}

/// The model and its sharding, shared by `compile` and `simulate`: the config, the mesh,
/// strategies beyond the mesh axes' defaults and context parallelism's flags.
#[derive(clap::Args, Debug)]
pub struct ShardArgs {
    /// A `config.json` or model directory (default: the bundled Llama-3-8B config).
    pub model: Option<PathBuf>,
    /// Device mesh, e.g. `dp=2,tp=4` or `pp=8,dp=16,tp=8` (default dp=2,tp=4 with sp when
    /// nothing is given).
    #[arg(long)]
    pub mesh: Option<String>,
    /// Strategies beyond the mesh axes' defaults, comma-separated (e.g. `sp`).
    #[arg(long)]
    pub strategy: Vec<String>,
    #[command(flatten)]
    pub cp: CpArgs,
}

impl ShardArgs {
    /// The model path: `MODEL`, or the bundled default.
    pub fn model_path(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(super::default_model)
    }

    /// `--strategy` with the strategies the context-parallel flags name.
    pub fn strategies(&self) -> anyhow::Result<Vec<String>> {
        self.cp.with(&self.strategy)
    }

    /// The mesh text and strategies to compile, the defaults filled in as [`options`] does.
    pub fn mesh_and_strategies(&self) -> anyhow::Result<(String, Vec<String>)> {
        Ok(mesh_or_default(self.mesh.as_deref(), self.strategies()?))
    }
}

/// The mesh and strategies to compile: `mesh` and `strategy` as given, or without a mesh the
/// default one (with `sp` when no strategy is given either).
fn mesh_or_default(mesh: Option<&str>, strategy: Vec<String>) -> (String, Vec<String>) {
    match mesh {
        Some(m) => (m.to_string(), strategy),
        None if strategy.is_empty() => (DEFAULT_MESH.to_string(), vec![DEFAULT_EXTRA.to_string()]),
        None => (DEFAULT_MESH.to_string(), strategy),
    }
}

/// Context parallelism's flags, shared by `compile`, `run`, `train` and `simulate`: they
/// name strategies (`cp-ulysses`, `cp-contiguous`), as `--strategy` could.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CpArgs {
    /// Context parallelism's exchange of keys and values on a `cp` mesh axis: `ring` (K/V
    /// blocks passed round the ring, overlapped with each block's attention, and the backward
    /// round the ring too: Ring Attention, Megatron `p2p`; the default), `allgather` (K/V
    /// all-gathered, queries stay split: Llama 3, Megatron `allgather`) or `ulysses`
    /// (all-to-all from sequence-split to head-split and back: DeepSpeed-Ulysses).
    #[arg(long, value_name = "ALGO")]
    pub cp_algo: Option<String>,
    /// Causal load balancing of a `cp` axis: `headtail` (the sequence in 2·cp chunks, rank
    /// i holding chunks i and 2·cp−1−i; the default) or `none` (contiguous parts).
    #[arg(long, value_name = "ORDER")]
    pub cp_balance: Option<String>,
}

impl CpArgs {
    /// The strategies the flags name, appended to `strategy`.
    pub fn with(&self, strategy: &[String]) -> anyhow::Result<Vec<String>> {
        let mut out = strategy.to_vec();
        match self.cp_algo.as_deref() {
            None | Some("ring") => {}
            Some("allgather") => out.push("cp-allgather".into()),
            Some("ulysses") => out.push("cp-ulysses".into()),
            Some(x) => bail!("--cp-algo `{x}`: expected allgather, ring or ulysses"),
        }
        match self.cp_balance.as_deref() {
            None | Some("headtail") => {}
            Some("none") => out.push("cp-contiguous".into()),
            Some(x) => bail!("--cp-balance `{x}`: expected headtail or none"),
        }
        if self.cp_algo.as_deref() == Some("ulysses")
            && self.cp_balance.as_deref() == Some("headtail")
        {
            bail!(
                "--cp-balance headtail applies to --cp-algo ring and allgather: under ulysses every \
                 rank's attention sees the whole sequence, so there is nothing to balance"
            );
        }
        Ok(out)
    }
}

/// `--flag: must be at least MIN (found X)`.
/// Micro-batches per step from `--micro-batch` (sequences per micro-batch per data-parallel
/// rank, Megatron-LM's `--micro-batch-size`): the global batch over `dp × ep` ranks and
/// `size`, which must divide it.
pub fn micro_batch_count(
    batch: usize,
    size: usize,
    mesh: &shardc::compiler::shard::Mesh,
) -> anyhow::Result<usize> {
    at_least("--micro-batch", size, 1)?;
    let data = mesh.data_ranks();
    match data.checked_mul(size) {
        Some(per_step) if batch % per_step == 0 => Ok(batch / per_step),
        _ => bail!(
            "--micro-batch {size}: the global batch {batch} does not split into micro-batches of \
             {size} sequences on each of the {data} data-parallel rank(s) (dp × ep)"
        ),
    }
}

/// `--returns`: what a forward plan returns (`logits`, `last`, `hidden` or `loss`).
pub fn forward_output(
    given: Option<&str>,
    default: shardc::compiler::model::ForwardOutput,
) -> anyhow::Result<shardc::compiler::model::ForwardOutput> {
    use shardc::compiler::model::ForwardOutput;
    match given {
        None => Ok(default),
        Some(s) => ForwardOutput::from_name(s).ok_or_else(|| {
            anyhow::anyhow!(
                "--returns `{s}`: expected {} (every position's logits, the last position's, \
                 the final hidden states alone, or the causal-LM loss)",
                ForwardOutput::ALL.map(ForwardOutput::name).join(", ")
            )
        }),
    }
}

pub fn at_least(flag: &str, value: usize, min: usize) -> anyhow::Result<()> {
    if value < min {
        bail!("{flag}: must be at least {min} (found {value})");
    }
    Ok(())
}

/// The model config at `path` and the sequence length: `seq`, or by default min(max
/// positions, 4096).
pub fn config_and_seq(path: &Path, seq: Option<usize>) -> anyhow::Result<(ModelConfig, usize)> {
    let cfg = ModelConfig::from_path(path)?;
    let seq = seq.unwrap_or(cfg.max_positions.min(4096));
    Ok((cfg, seq))
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

/// `--recompute-num-layers N` under `--recompute mode`: at least 1, and the other layers'
/// mode none or selective (full already recomputes every layer).
pub fn recompute_layers(
    n: Option<usize>,
    mode: shardc::compiler::autodiff::Recompute,
) -> anyhow::Result<Option<usize>> {
    let Some(k) = n else { return Ok(None) };
    at_least("--recompute-num-layers", k, 1)?;
    if mode == shardc::compiler::autodiff::Recompute::Full {
        anyhow::bail!("--recompute-num-layers {k} recomputes some layers fully and the others under --recompute: give --recompute none or selective");
    }
    Ok(Some(k))
}

/// The backend of `run` and `train`.
#[derive(clap::Args, Debug, Clone)]
pub struct BackendArgs {
    /// Backend: `cpu` (reference) or `cuda` (one GPU; with `--mesh`, every rank as a virtual
    /// rank of GPU 0 with the local-gpu communicator; a launched rank runs on the GPU of its
    /// `LOCAL_RANK`).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Element type of the CUDA backend (`f32` or `bf16`).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Replay the program's launches as a CUDA graph (`--backend cuda`, one rank: a mesh's
    /// ranks communicate, which a graph cannot capture): the second run is captured and later
    /// runs replay it, so `train` saves the host's launch work from its third step on.
    #[arg(long)]
    pub cuda_graphs: bool,
}

impl Default for BackendArgs {
    fn default() -> BackendArgs {
        BackendArgs {
            backend: "cpu".into(),
            dtype: "f32".into(),
            cuda_graphs: false,
        }
    }
}

impl BackendArgs {
    /// `None` for the CPU backend; for `--backend cuda` the device (probed for a driver before
    /// any other work: none is an error, never a panic) and the options, `timeout` bounding
    /// every wait on the GPU and on peers. A rank of a launched job opens the GPU of its local
    /// rank (torchrun's convention).
    pub fn cuda(
        &self,
        world: Option<&WorldEnv>,
        timeout: Duration,
    ) -> anyhow::Result<Option<(Arc<CudaDevice>, CudaOptions)>> {
        match self.backend.as_str() {
            "cpu" if self.cuda_graphs => bail!("--cuda-graphs needs --backend cuda"),
            "cpu" => return Ok(None),
            "cuda" => {}
            other => bail!("backend `{other}` is not available (available: cpu, cuda)"),
        }
        let Some(dtype) = GpuDType::parse(&self.dtype) else {
            bail!(
                "--dtype {} is not supported by the CUDA backend (f32, bf16)",
                self.dtype
            );
        };
        let ordinal = world.map_or(0, |w| w.local_rank);
        let dev = CudaDevice::open(ordinal).map_err(|e| match world {
            Some(w) if !e.is_unavailable() => anyhow::anyhow!(
                "{e}; rank {} is local rank {ordinal} and runs on GPU {ordinal} (one GPU per \
                 local rank: --nproc-per-node at most this node's GPU count)",
                w.rank
            ),
            _ => anyhow::anyhow!("{e}; use --backend cpu"),
        })?;
        let opts = CudaOptions {
            dtype,
            timeout,
            graphs: self.cuda_graphs,
            ..CudaOptions::default()
        };
        Ok(Some((dev, opts)))
    }
}
