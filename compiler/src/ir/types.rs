//! Tensor types: dtype plus dims, each dim with a size and a role name (`batch`, `seq`, ...).
//! Shardings and error messages speak in the role names.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// 32-bit signed integer (token ids, positions).
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

text_names!(DType { F32 => "f32", Bf16 => "bf16", F16 => "f16", I32 => "i32" });

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a tensor dim means. Builders set it where they know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Sequences in the batch.
    Batch,
    /// Token positions.
    Seq,
    /// Model width.
    Hidden,
    /// Attention (query) heads.
    Heads,
    /// Key/value heads (GQA).
    KvHeads,
    /// Per-head width.
    HeadDim,
    /// MLP intermediate width.
    Ffn,
    /// Vocabulary.
    Vocab,
    /// MoE experts.
    Expert,
    /// No known role.
    Other,
}

text_names!(Role {
    Batch => "batch", Seq => "seq", Hidden => "hidden", Heads => "heads", KvHeads => "kv_heads",
    HeadDim => "head_dim", Ffn => "ffn", Vocab => "vocab", Expert => "expert", Other => "_",
});

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One dim: size and role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Dim {
    /// Number of elements along this dim.
    pub size: usize,
    /// What the dim means.
    pub role: Role,
}

impl Dim {
    /// A dim with a role.
    pub fn new(role: Role, size: usize) -> Dim {
        Dim { size, role }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.role == Role::Other {
            write!(f, "{}", self.size)
        } else {
            write!(f, "{}={}", self.role, self.size)
        }
    }
}

/// The type of a tensor value: element type and dims (row-major).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Dims, outermost first.
    pub dims: Vec<Dim>,
}

impl TensorType {
    /// A type from dtype and dims.
    pub fn new(dtype: DType, dims: Vec<Dim>) -> TensorType {
        TensorType { dtype, dims }
    }
    /// A type with every dim's role `Other`.
    pub fn plain(dtype: DType, shape: &[usize]) -> TensorType {
        TensorType {
            dtype,
            dims: shape.iter().map(|&s| Dim::new(Role::Other, s)).collect(),
        }
    }
    /// Sizes of the dims.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().map(|d| d.size).collect()
    }
    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().map(|d| d.size).product()
    }
    /// Number of elements, or `None` on overflow.
    pub fn checked_numel(&self) -> Option<usize> {
        self.dims
            .iter()
            .try_fold(1usize, |acc, d| acc.checked_mul(d.size))
    }
    /// Size in bytes.
    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }
    /// Size of dim `i`.
    pub fn dim(&self, i: usize) -> usize {
        self.dims[i].size
    }
    /// The last dim's size (0 for a scalar).
    pub fn last(&self) -> usize {
        self.dims.last().map_or(0, |d| d.size)
    }
    /// One of `parts` equal parts of this type along dim `dim`; `None` when it has no dim
    /// `dim` or `parts` does not divide it.
    pub fn part(&self, dim: usize, parts: usize) -> Option<TensorType> {
        if dim >= self.rank() || parts == 0 || self.dim(dim) % parts != 0 {
            return None;
        }
        let mut t = self.clone();
        t.dims[dim].size /= parts;
        Some(t)
    }
    /// The same type with another dtype.
    pub fn with_dtype(&self, dtype: DType) -> TensorType {
        TensorType {
            dtype,
            dims: self.dims.clone(),
        }
    }
    /// The same shape with the sizes of dims replaced.
    pub fn with_shape_of(&self, shape: &[usize]) -> TensorType {
        let mut t = self.clone();
        for (d, &s) in t.dims.iter_mut().zip(shape) {
            d.size = s;
        }
        t
    }
    /// True when the shapes (not roles) agree.
    pub fn same_shape(&self, other: &TensorType) -> bool {
        self.dims.len() == other.dims.len()
            && self
                .dims
                .iter()
                .zip(&other.dims)
                .all(|(a, b)| a.size == b.size)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}
