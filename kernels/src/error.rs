//! The crate's error type. Every failure is a structured variant; nothing here panics because a
//! CUDA library is missing.

use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;

/// Why a CUDA library or device could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// The shared library could not be `dlopen`ed under any of cudarc's candidate names.
    #[error(
        "{library} not found (searched {library}.so, {library}.so.13, ... on the library path)"
    )]
    LibraryNotFound {
        /// Library stem, e.g. `libnvrtc`.
        library: &'static str,
    },
    /// The driver loaded and initialised but reports no device.
    #[error("the CUDA driver reports 0 devices")]
    NoDevices,
    /// The driver returned an error (a stub `libcuda`, no device node, ...).
    #[error("CUDA driver error: {error}")]
    Driver {
        /// The driver's error code.
        error: DriverError,
    },
    /// The library call returned an error code.
    #[error("{library}: {error}")]
    Nvrtc {
        /// Library stem.
        library: &'static str,
        /// NVRTC's error code.
        error: NvrtcError,
    },
    /// cudarc panicked while loading the library (a missing symbol, usually a version mismatch).
    #[error("cudarc panicked while loading {library}: {message}")]
    Panicked {
        /// Library stem.
        library: &'static str,
        /// The panic message.
        message: String,
    },
}

/// The errors of `shardc-kernels`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KernelError {
    /// libnvrtc is missing or unusable, so nothing can be compiled.
    #[error("NVRTC unavailable: {reason}; install the CUDA 13 NVRTC (kernels/ci-nvrtc.sh) and put its lib directory on LD_LIBRARY_PATH")]
    NvrtcUnavailable {
        /// What went wrong.
        reason: Unavailable,
    },
    /// No usable CUDA driver or device.
    #[error("CUDA unavailable: {reason}")]
    CudaUnavailable {
        /// What went wrong.
        reason: Unavailable,
    },
    /// NVRTC rejected the source. `source_excerpt` shows the offending lines, numbered.
    #[error("kernel `{kernel}` failed to compile\n{source_excerpt}\n--- NVRTC log ---\n{log}")]
    Compile {
        /// Source name (the NVRTC program name, e.g. `norm.cu`).
        kernel: String,
        /// The full NVRTC log.
        log: String,
        /// The lines the log points at, with line numbers (see [`source_excerpt`](crate::source_excerpt)).
        source_excerpt: String,
    },
    /// An NVRTC call other than the compilation itself failed.
    #[error("kernel `{kernel}`: NVRTC {stage} failed: {error}")]
    Nvrtc {
        /// Source name.
        kernel: String,
        /// Which step: `create program`, `get PTX`, ...
        stage: &'static str,
        /// NVRTC's error code.
        error: NvrtcError,
    },
    /// The source or program name holds a NUL byte, which NVRTC's C API cannot take.
    #[error("kernel `{kernel}`: NUL byte at offset {offset} of the {what}")]
    NulByte {
        /// Source name.
        kernel: String,
        /// `source`, `name` or `options`.
        what: &'static str,
        /// Byte offset of the NUL.
        offset: usize,
    },
    /// No kernel family with this name (or entry point) is registered.
    #[error("no kernel source `{name}` is registered")]
    UnknownKernel {
        /// The name looked up.
        name: String,
    },
    /// The device's compute capability has no entry in the arch table.
    #[error("compute capability {major}.{minor} is not supported (known: sm_75 ... sm_121)")]
    UnsupportedArch {
        /// Major version.
        major: i32,
        /// Minor version.
        minor: i32,
    },
    /// A launch helper was asked for a shape its kernel cannot run.
    #[error("kernel `{kernel}`: {param} = {value} is out of range ({allowed})")]
    InvalidLaunch {
        /// Entry point family, e.g. `attention`.
        kernel: &'static str,
        /// Offending parameter.
        param: &'static str,
        /// Its value.
        value: usize,
        /// What would be accepted.
        allowed: &'static str,
    },
}
