//! shardc kernels: the CUDA C sources of the CUDA backend, the generator for fused elementwise
//! kernels, NVRTC compilation with an on-disk PTX cache, and run-time probes for the driver
//! and NVRTC.
//!
//! The crate builds and its tests pass with no CUDA installed: cudarc is used with
//! `dynamic-loading`, and every entry point that needs a CUDA library probes for it first and
//! returns [`KernelError::NvrtcUnavailable`] / [`KernelError::CudaUnavailable`] instead of
//! panicking.
//!
//! - [`KERNELS`]: every hand-written source (one `.cu` per op family, `include_str!`), with its
//!   entry points `{op}_{dtype}` (dtype `f32` or `bf16`). Each file's header comment is the
//!   kernel's contract: argument list, layout, semantics and launch shape ([`launch`] helpers).
//! - [`generate_fused_kernel`]: a complete `.cu` source for one [`FusedExpr`].
//! - [`compile`] / [`PtxCache`]: NVRTC to PTX, `-lineinfo` always on, cached by blake3 of
//!   (source name, source, options, arch, NVRTC version).
//! - [`compile_cubin`]: NVRTC to a CUBIN for a real `sm_XY`, no cache; ptxas assembles the
//!   PTX, so malformed inline `asm` (the tensor-core wrappers of `mma.cuh`) fails there.
//! - [`cuda_available`], [`nvrtc_version`]: probes that never panic.
//!
//! ```no_run
//! # fn main() -> Result<(), shardc_kernels::KernelError> {
//! let norm = shardc_kernels::kernel_source("norm")?;
//! let ptx = norm.compile("sm_90")?; // Err(NvrtcUnavailable) without libnvrtc
//! assert!(ptx.has_entry("rmsnorm_bf16"));
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod cache;
mod compile;
mod dtype;
mod error;
mod excerpt;
mod fused;
pub mod launch;
mod probe;
mod registry;

pub use cache::{CacheKey, CacheOutcome, PtxCache};
pub use compile::{
    compile, compile_cubin, effective_options, ptx_entries, CompiledPtx, ALWAYS_OPTIONS,
};
pub use dtype::{entry_name, KernelDType};
pub use error::{KernelError, Unavailable};
pub use excerpt::{parse_diagnostics, source_excerpt, Diagnostic};
pub use fused::{generate_fused_kernel, FusedBinary, FusedExpr, FusedUnary};
pub use probe::{arch_for_compute_capability, cuda_available, nvrtc_available, nvrtc_version};
pub use registry::{
    expand_includes, kernel_source, source_for_entry, KernelSource, ATTENTION_CUH, COMMON_CUH,
    KERNELS, MMA_CUH,
};
