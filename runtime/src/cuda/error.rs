//! Errors of the CUDA backend. Every failure is a structured variant; a machine without a
//! driver gets [`CudaError::NoDriver`], never a panic.

use crate::comm::CommError;
use crate::RuntimeError;
use cudarc::cublaslt::result::CublasError;
use cudarc::driver::DriverError;
use shardc_compiler::ir::ValueId;
use shardc_kernels::{KernelError, Unavailable};
use thiserror::Error;

/// An error of the CUDA backend.
#[derive(Debug, Error)]
pub enum CudaError {
    /// `libcuda.so` cannot be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver found (libcuda.so not loadable)")]
    NoDriver,
    /// The driver loaded but offers no usable device (no device, a stub driver, ...).
    #[error("no usable CUDA device: {reason}")]
    NoDevice {
        /// What the driver said.
        reason: String,
    },
    /// The requested device ordinal does not exist.
    #[error("CUDA device {ordinal} does not exist ({count} devices)")]
    BadOrdinal {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A CUDA library other than the driver is missing.
    #[error("{library} not found: {hint}")]
    MissingLibrary {
        /// Library stem (`libcublasLt`, `libnccl`).
        library: &'static str,
        /// How to fix it.
        hint: &'static str,
    },
    /// A driver call failed.
    #[error("CUDA {op}: {error}")]
    Driver {
        /// What was being done (`alloc arena (123 bytes)`, `launch rmsnorm_bf16`, ...).
        op: String,
        /// The driver's error code.
        error: DriverError,
    },
    /// A cuBLASLt call failed.
    #[error("cuBLASLt {op} for {gemm}: {error}")]
    Cublas {
        /// Which call.
        op: &'static str,
        /// The GEMM (its cache key).
        gemm: String,
        /// cuBLASLt's status.
        error: CublasError,
    },
    /// Compiling or finding a kernel failed (NVRTC missing, a compile error with its log).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A host-side error shared with the CPU executor (inputs, weights, shapes, ids).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A collective failed (enqueue, peer, timeout).
    #[error("node {node} `{name}` ({op}) over `{axis}`: {source}")]
    Comm {
        /// The collective's node.
        node: ValueId,
        /// Its label.
        name: String,
        /// Its mnemonic.
        op: &'static str,
        /// The mesh axis.
        axis: String,
        /// The communicator's error.
        #[source]
        source: Box<CommError>,
    },
    /// A communicator failed outside a specific node (while draining the streams).
    #[error("communicator `{axis}`: {source}")]
    CommPoll {
        /// The mesh axis.
        axis: String,
        /// The communicator's error.
        #[source]
        source: Box<CommError>,
    },
    /// The streams did not drain within the timeout and no communicator reported a stall.
    #[error("the GPU did not finish the program within {timeout_ms} ms")]
    Timeout {
        /// The timeout.
        timeout_ms: u64,
    },
    /// Host data larger than the device buffer it is to be written into.
    #[error("{what}: {bytes} bytes do not fit its device buffer of {capacity} bytes")]
    BufferTooSmall {
        /// What was written.
        what: String,
        /// Bytes of the data.
        bytes: usize,
        /// Bytes of the buffer.
        capacity: usize,
    },
    /// A launch whose arguments do not match the compiled kernel's parameters.
    #[error(
        "launch of kernel `{entry}`: it takes {} parameters of {params:?} bytes, the launch \
         passes {} of {passed:?} bytes",
        params.len(),
        passed.len()
    )]
    LaunchArgs {
        /// The kernel's entry point.
        entry: String,
        /// Its parameters' sizes (bytes).
        params: Vec<usize>,
        /// The arguments' sizes (bytes).
        passed: Vec<usize>,
    },
    /// An op (or this use of it) has no CUDA implementation.
    #[error("node {node} `{name}` ({op}): not supported by the CUDA backend: {detail}")]
    Unsupported {
        /// The node.
        node: ValueId,
        /// Its label.
        name: String,
        /// Its mnemonic.
        op: &'static str,
        /// Why.
        detail: String,
    },
}

impl CudaError {
    /// A driver error while doing `op`.
    pub(crate) fn driver(op: impl Into<String>) -> impl FnOnce(DriverError) -> CudaError {
        let op = op.into();
        move |error| CudaError::Driver { op, error }
    }

    /// Maps a [`KernelError::CudaUnavailable`] from the probe to [`CudaError::NoDriver`] /
    /// [`CudaError::NoDevice`]; other kernel errors pass through.
    pub(crate) fn from_probe(e: KernelError) -> CudaError {
        match e {
            KernelError::CudaUnavailable {
                reason: Unavailable::LibraryNotFound { .. },
            } => CudaError::NoDriver,
            KernelError::CudaUnavailable { reason } => CudaError::NoDevice {
                reason: reason.to_string(),
            },
            other => CudaError::Kernel(other),
        }
    }

    /// True for the errors that mean "this machine cannot run CUDA at all".
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            CudaError::NoDriver | CudaError::NoDevice { .. } | CudaError::MissingLibrary { .. }
        ) || matches!(
            self,
            CudaError::Kernel(KernelError::NvrtcUnavailable { .. })
                | CudaError::Kernel(KernelError::CudaUnavailable { .. })
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_errors_map_to_clear_messages() {
        let e = CudaError::from_probe(KernelError::CudaUnavailable {
            reason: Unavailable::LibraryNotFound { library: "libcuda" },
        });
        assert_eq!(
            e.to_string(),
            "no CUDA driver found (libcuda.so not loadable)"
        );
        assert!(e.is_unavailable());
        let e = CudaError::from_probe(KernelError::CudaUnavailable {
            reason: Unavailable::NoDevices,
        });
        assert!(matches!(e, CudaError::NoDevice { .. }), "{e}");
    }
}
