//! What a simulation returns: a [`SimReport`] (what `shardc simulate --json` prints) and the
//! per-rank timelines the trace writer turns into a Chrome trace. Ranks with identical
//! timelines share one [`Timeline`] (every rank of a pipeline stage, every rank of a symmetric
//! SPMD plan).

use super::memory::MemoryBreakdown;
use serde::{Deserialize, Serialize};

/// One pipeline stage of a training step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageReport {
    /// Stage index.
    pub stage: usize,
    /// Decoder layers it holds (all chunks).
    pub layers: usize,
    /// When its step ends (pipeline, gradient sync, optimizer), seconds.
    pub end_s: f64,
    /// Busy time in forward and backward ops, seconds.
    pub busy_s: f64,
    /// Pipeline bubble, seconds.
    pub bubble_s: f64,
    /// Exposed point-to-point transfers, seconds.
    pub p2p_exposed_s: f64,
    /// Data-parallel gradient synchronisation not hidden by the backward, seconds.
    pub dp_sync_exposed_s: f64,
    /// Peak (micro-batch, chunk) activations held.
    pub peak_in_flight: usize,
    /// Peak memory of each of its ranks.
    pub memory: MemoryBreakdown,
}

/// The simulation's numbers (by default every one zero or empty).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// `forward` (a plan replayed) or `train` (the training step model).
    pub mode: String,
    /// Model source.
    pub model: String,
    /// Mesh.
    pub mesh: String,
    /// Strategies.
    pub strategies: Vec<String>,
    /// Cluster (`dgx-h100x128`).
    pub cluster: String,
    /// Device profile name.
    pub device: String,
    /// Ranks simulated.
    pub gpus: usize,
    /// Simulated compute dtype.
    pub dtype: String,
    /// Sequences per step.
    pub global_batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Sequences per micro-batch (training).
    pub micro_batch: Option<usize>,
    /// Micro-batches per pipeline per step (training).
    pub micro_batches: Option<usize>,
    /// Pipeline schedule (training).
    pub schedule: Option<String>,
    /// Recomputation (training).
    pub recompute: Option<String>,
    /// ZeRO stage (training).
    pub zero: Option<u8>,
    /// Step time: one forward (forward mode) or one optimizer step (training), seconds.
    pub step_time_s: f64,
    /// Tokens processed per second.
    pub tokens_per_s: f64,
    /// FLOPs executed per step over all GPUs, counted as Megatron-LM does (recomputation
    /// included: its "achieved" throughput).
    pub flops_per_step: f64,
    /// Model FLOPs per step: forward 2·params·tokens plus attention, training 3× that
    /// (recomputation not counted).
    pub model_flops_per_step: f64,
    /// `flops_per_step / step / gpus`, in TFLOP/s (Megatron-LM's per-GPU throughput).
    pub tflops_per_gpu: f64,
    /// `model_flops_per_step / step / gpus`, in TFLOP/s.
    pub model_tflops_per_gpu: f64,
    /// Model FLOPs utilisation: model FLOP/s per GPU over the dense bf16 (or chosen dtype) peak.
    pub mfu: f64,
    /// Compute-stream busy time on the critical rank, seconds.
    pub compute_s: f64,
    /// Communication time on the critical rank (all collectives and transfers), seconds.
    pub comm_s: f64,
    /// Communication on the critical path (nothing computes meanwhile), seconds.
    pub exposed_comm_s: f64,
    /// Communication hidden behind compute, seconds.
    pub hidden_comm_s: f64,
    /// Idle pipeline time (not waiting on a transfer) over the step, averaged over stages.
    pub bubble_fraction: f64,
    /// Forward/backward pipeline time (training), seconds.
    pub pipeline_s: f64,
    /// Optimizer step time (training), seconds: with a training plan replayed, its step
    /// program (the gradient synchronisation left after the last micro-batch, AdamW and the
    /// ZeRO parameter gathers).
    pub optimizer_s: f64,
    /// Peak memory of the most loaded rank, bytes.
    pub peak_memory_bytes_per_rank: u64,
    /// That rank.
    pub peak_memory_rank: usize,
    /// Its peak, by kind.
    pub memory_breakdown: MemoryBreakdown,
    /// Device memory, bytes.
    pub device_memory_bytes: u64,
    /// Whether every rank's peak fits in device memory.
    pub fits: bool,
    /// Per pipeline stage (training).
    pub stages: Vec<StageReport>,
    /// The arithmetic behind the numbers, one line each (`simulate --explain`): today the
    /// mixture-of-experts terms of an expert-parallel training step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl SimReport {
    /// This report with the throughput of a step of `step` seconds over its `gpus` ranks:
    /// `tokens` processed, `flops` executed and `model_flops` of the model, against a
    /// per-GPU `peak` FLOP/s (all rates 0 for a zero-length step).
    pub(crate) fn with_throughput(
        self,
        step: f64,
        tokens: f64,
        flops: f64,
        model_flops: f64,
        peak: f64,
    ) -> SimReport {
        let per_gpu = |f: f64| {
            if step > 0.0 {
                f / step / self.gpus as f64
            } else {
                0.0
            }
        };
        SimReport {
            step_time_s: step,
            tokens_per_s: if step > 0.0 { tokens / step } else { 0.0 },
            flops_per_step: flops,
            model_flops_per_step: model_flops,
            tflops_per_gpu: per_gpu(flops) / 1e12,
            model_tflops_per_gpu: per_gpu(model_flops) / 1e12,
            mfu: per_gpu(model_flops) / peak,
            ..self
        }
    }
}

/// A slice on a track: a kernel, a collective, a pipeline op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slice {
    /// Track index into [`Timeline::tracks`].
    pub track: u32,
    /// Name.
    pub name: String,
    /// Category (`kernel`, `gemm`, `collective`, `forward`, `backward`, `p2p`, ...).
    pub cat: String,
    /// Start, seconds.
    pub start: f64,
    /// Duration, seconds.
    pub dur: f64,
    /// Bytes moved (HBM for kernels, nccl-tests size for collectives).
    pub bytes: u64,
    /// Counted FLOPs.
    pub flops: f64,
}

/// One rank's timeline.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Track names (one per stream).
    pub tracks: Vec<String>,
    /// Slices.
    pub slices: Vec<Slice>,
    /// Memory: (time, bytes) after each change.
    pub memory: Vec<(f64, u64)>,
}

/// A simulation: the report and every rank's timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// The numbers.
    pub report: SimReport,
    /// Distinct timelines.
    pub timelines: Vec<Timeline>,
    /// Per rank, its timeline's index.
    pub rank_timeline: Vec<u32>,
    /// Per rank, a label (its mesh coordinates).
    pub rank_labels: Vec<String>,
}
