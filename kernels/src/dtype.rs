//! The element types the kernels are instantiated for.

use std::fmt;

/// Element type of a kernel's tensors. Entry points are named `{op}_{suffix}`.
///
/// bf16 is handled in the CUDA sources as `unsigned short` with bit casts (no CUDA headers);
/// arithmetic is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelDType {
    /// IEEE binary32.
    F32,
    /// bfloat16 (the top half of an f32), rounded to nearest even on store.
    Bf16,
}

impl KernelDType {
    /// Both dtypes, in suffix order.
    pub const ALL: [KernelDType; 2] = [KernelDType::F32, KernelDType::Bf16];

    /// Entry-point suffix: `f32` or `bf16`.
    pub fn suffix(self) -> &'static str {
        match self {
            KernelDType::F32 => "f32",
            KernelDType::Bf16 => "bf16",
        }
    }

    /// The C type used for this dtype in the sources (`float`, `bf16`).
    pub fn c_type(self) -> &'static str {
        match self {
            KernelDType::F32 => "float",
            KernelDType::Bf16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            KernelDType::F32 => 4,
            KernelDType::Bf16 => 2,
        }
    }

    /// Elements per 16-byte vector access of the memory-bound kernels (`VecWidth<T>::N` in
    /// `common.cuh`): 4 f32 or 8 bf16.
    pub fn vector_lanes(self) -> usize {
        16 / self.size_bytes()
    }
}

impl fmt::Display for KernelDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.suffix())
    }
}

/// The entry-point name of `op` for `dtype`: `entry_name("rmsnorm", Bf16) == "rmsnorm_bf16"`.
pub fn entry_name(op: &str, dtype: KernelDType) -> String {
    format!("{op}_{}", dtype.suffix())
}
