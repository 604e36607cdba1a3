//! What one CUDA rank is given: the run's options, where its parameters come from, and its
//! communicators and mesh coordinates.

use super::GpuDType;
use crate::cuda::comm::device::DeviceCommunicator;
use crate::{RuntimeError, Tensor, Weights};
use std::collections::BTreeMap;
use std::time::Duration;

/// How a program runs on the GPU.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Element type of every float tensor on the device.
    pub dtype: GpuDType,
    /// Run fused groups (GEMM epilogues, add+RMSNorm, SwiGLU, sibling GEMMs, the flash
    /// attention backward) as single launches.
    pub fuse: bool,
    /// Fill the activation arena with NaN bytes (0xFF) before every run, so a kernel that
    /// leaves part of its output unwritten shows up in the results (tests).
    pub poison: bool,
    /// How long the host waits for the GPU (and collectives) before failing.
    pub timeout: Duration,
    /// Replay each run's launches from a CUDA graph: the first run with a given set of input
    /// buffers is eager, the second is captured (stream capture, thread-local mode) and every
    /// later one replays the graph, one launch instead of one per kernel. Programs with
    /// collectives (or collective matmuls) are refused with `CudaError::Unsupported`
    /// (the communicators' host-side progress and watchdog do not fit in a graph); run them
    /// eagerly. Off by default.
    pub graphs: bool,
    /// Run bf16 attention on the tensor-core kernels (`attention_tc_bf16` forward,
    /// `attention_bwd_tc_bf16` for the training backward) where they apply (head_dim 64 or
    /// 128, sm_80 or newer); `false` keeps the scalar kernels everywhere (comparisons,
    /// benchmarks).
    pub tensor_core_attention: bool,
    /// Run attention calls that leave the GPU mostly idle (decode: few queries against a long
    /// KV cache) on the split-KV pair `attention_decode_*` (`launch::attention_plan`), its
    /// workspace reserved in the compute scratch at prepare time; `false` keeps the ordinary
    /// kernels everywhere (comparisons, benchmarks).
    pub split_kv_attention: bool,
    /// Compute mixture-of-experts GEMMs on the tokens routed to each expert only
    /// (`cuda::Routing`: the dense result, at the routed share of the work); `false` runs them
    /// densely over every token (comparisons, benchmarks).
    pub routed_experts: bool,
}

impl Default for CudaOptions {
    fn default() -> CudaOptions {
        CudaOptions {
            dtype: GpuDType::F32,
            fuse: true,
            poison: false,
            timeout: Duration::from_secs(60),
            graphs: false,
            tensor_core_attention: true,
            split_kv_attention: true,
            routed_experts: true,
        }
    }
}

/// Where parameters come from.
#[derive(Clone, Copy, Debug)]
pub enum ParamInit<'a> {
    /// A checkpoint (each rank loads its shards).
    Weights(&'a Weights),
    /// Host tensors by stored name, each the whole parameter in the graph's layout (no view,
    /// stack, transpose or shards): a benchmark's weights, the same values its CPU check reads.
    Host(&'a BTreeMap<String, Tensor>),
    /// Deterministic uniform values in `[-scale, scale]` (benchmarks).
    Random {
        /// Generator seed.
        seed: u64,
        /// Half-width of the distribution.
        scale: f32,
    },
}

/// One GPU rank's view of the mesh: a device communicator per mesh axis (empty: unsharded).
#[derive(Default)]
pub struct CudaRankCtx<'a> {
    comms: BTreeMap<String, &'a dyn DeviceCommunicator>,
}

impl<'a> CudaRankCtx<'a> {
    /// An empty context (an unsharded run).
    pub fn new() -> CudaRankCtx<'a> {
        CudaRankCtx::default()
    }

    /// Sets the communicator of mesh axis `axis`.
    pub fn insert(&mut self, axis: impl Into<String>, comm: &'a dyn DeviceCommunicator) {
        self.comms.insert(axis.into(), comm);
    }

    /// This context with `comm` serving `axis`.
    pub fn with_axis(mut self, axis: impl Into<String>, comm: &'a dyn DeviceCommunicator) -> Self {
        self.insert(axis, comm);
        self
    }

    /// The communicator of `axis`.
    pub fn comm(&self, axis: &str) -> Result<&'a dyn DeviceCommunicator, RuntimeError> {
        self.comms
            .get(axis)
            .copied()
            .ok_or_else(|| RuntimeError::MissingAxis {
                axis: axis.to_string(),
            })
    }

    /// `(coord, size)` of this rank on every axis.
    pub fn coords(&self) -> BTreeMap<String, (usize, usize)> {
        self.comms
            .iter()
            .map(|(a, c)| (a.clone(), (c.rank(), c.size())))
            .collect()
    }

    /// Every communicator, by axis.
    pub fn comms(&self) -> impl Iterator<Item = (&str, &'a dyn DeviceCommunicator)> + '_ {
        self.comms.iter().map(|(a, c)| (a.as_str(), *c))
    }
}
