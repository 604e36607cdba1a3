//! The CUDA backend: runs an SPMD [`Graph`](shardc_compiler::ir::Graph) — the same programs
//! the CPU executor runs — on NVIDIA GPUs, in f32 or bf16.
//!
//! - [`CudaDevice`]: driver probe (a `dlopen`, before any cudarc call: no driver gives
//!   [`CudaError::NoDriver`], never a panic), context with event tracking off, the `sm_XY`
//!   arch, kernels from `shardc_kernels`' registry compiled by NVRTC through the PTX cache.
//! - [`CudaProgram`]: one rank's graph prepared on a device — activation arena from liveness,
//!   fused groups, parameters uploaded in the run's dtype, cuBLASLt GEMMs with cached
//!   per-shape plans, compute and comm streams ordered by the plan's events; with
//!   `CudaOptions::graphs`, runs replayed from a CUDA graph (programs without collectives).
//! - [`run_spmd_local_gpu`] / [`run_spmd_nccl_threads`]: every rank of a mesh on one GPU,
//!   with the `local-gpu` or `nccl` device communicator.
//! - [`CudaTrainer`]: training steps of a training plan (the backward and AdamW kernels of
//!   `train_ops.rs`, weight gradients on cuBLASLt), assembled and committed as on the CPU.
//!
//! ```no_run
//! # fn main() -> Result<(), shardc_runtime::cuda::CudaError> {
//! use shardc_runtime::cuda::{execute_cuda, CudaDevice, CudaOptions, GpuDType, ParamInit};
//! # let (graph, weights, inputs): (shardc_compiler::ir::Graph, shardc_runtime::Weights,
//! #     std::collections::BTreeMap<String, shardc_runtime::Tensor>) = todo!();
//! let dev = CudaDevice::open(0)?; // Err(NoDriver) on a machine without a GPU
//! let opts = CudaOptions { dtype: GpuDType::Bf16, ..CudaOptions::default() };
//! let outputs = execute_cuda(&dev, &graph, &ParamInit::Weights(&weights), &inputs, opts)?;
//! # Ok(()) }
//! ```

pub mod calibrate;
mod collective;
pub mod comm;
mod device;
mod dtype;
mod error;
mod flash;
mod gemm;
mod host;
mod node;
#[macro_use]
pub(crate) mod ops;
mod plan;
mod program;
mod rank;
mod routed;
mod scratch;
mod spmd;
mod strided;
mod support;
mod train_node;
mod train_ops;
mod trainer;
mod warm;

pub use device::{cuda_device_count, CudaDevice, Kernel};
pub use error::CudaError;
pub use flash::{flash_candidates, FlashBwd};
pub use gemm::{Epilogue, GemmCache, GemmKey};
pub use node::cublas_epilogue;
pub use plan::{
    early_write_ok, fused_expr, last_uses, plan_arena, plan_memory, plan_memory_routed,
    reshape_aliases, retyped, sibling_stride, Action, ArenaPlan, FusedGroup, FusionPlan, GpuDType,
    SiblingGemms, Slot, Storage,
};
pub use program::{execute_cuda, graph_blocker, CudaProgram};
pub use rank::{CudaOptions, CudaRankCtx, ParamInit};
pub use routed::{zero_rows, Packed, RoutedGemm, Routing};
pub use spmd::{run_nccl_rank, run_spmd_local_gpu, run_spmd_nccl_threads, CudaRankError};
pub use strided::{contiguous_strides, StridedSpec, MAX_RANK};
pub use trainer::CudaTrainer;

/// The config of hf-tiny fixture `model` (the planning unit tests).
#[cfg(test)]
fn fixture(model: &str) -> shardc_compiler::model::ModelConfig {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf-tiny")
        .join(model);
    shardc_compiler::model::ModelConfig::from_path(&dir).expect("fixture config")
}
