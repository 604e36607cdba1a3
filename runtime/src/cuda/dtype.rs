//! The element type the CUDA backend computes float tensors in, and how each value is stored.

use crate::cuda::comm::device::DeviceDType;
use shardc_compiler::ir::DType;
use shardc_kernels::KernelDType;
use std::fmt;

/// Element type the CUDA backend computes float tensors in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GpuDType {
    /// IEEE binary32 everywhere (GEMMs with true fp32 compute, no TF32).
    #[default]
    F32,
    /// bfloat16 storage, f32 accumulation.
    Bf16,
}

impl GpuDType {
    /// Parses `f32` / `bf16`.
    pub fn parse(s: &str) -> Option<GpuDType> {
        match s {
            "f32" | "fp32" | "float32" => Some(GpuDType::F32),
            "bf16" | "bfloat16" => Some(GpuDType::Bf16),
            _ => None,
        }
    }

    /// `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            GpuDType::F32 => "f32",
            GpuDType::Bf16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            GpuDType::F32 => 4,
            GpuDType::Bf16 => 2,
        }
    }

    /// The kernels' dtype (entry suffix).
    pub fn kernel(self) -> KernelDType {
        match self {
            GpuDType::F32 => KernelDType::F32,
            GpuDType::Bf16 => KernelDType::Bf16,
        }
    }

    /// The IR dtype.
    pub fn ir(self) -> DType {
        match self {
            GpuDType::F32 => DType::F32,
            GpuDType::Bf16 => DType::Bf16,
        }
    }
}

impl fmt::Display for GpuDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How one value is stored on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// A float value in the backend's dtype.
    Float(GpuDType),
    /// Token ids, positions, labels.
    I32,
}

impl Storage {
    /// The storage of a value declared `dtype` under backend dtype `dt`.
    pub fn of(dtype: DType, dt: GpuDType) -> Storage {
        if dtype == DType::I32 {
            Storage::I32
        } else {
            Storage::Float(dt)
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            Storage::Float(d) => d.size_bytes(),
            Storage::I32 => 4,
        }
    }

    /// The communicator dtype.
    pub fn device(self) -> DeviceDType {
        match self {
            Storage::Float(GpuDType::F32) => DeviceDType::F32,
            Storage::Float(GpuDType::Bf16) => DeviceDType::Bf16,
            Storage::I32 => DeviceDType::I32,
        }
    }
}
