//! Host tensors: a shape and a flat row-major buffer (f32 or i32).

use shardc_compiler::ir::DType;

/// Flat row-major storage.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    /// f32 elements (the CPU reference computes every float dtype in f32).
    F32(Vec<f32>),
    /// i32 elements (token ids, positions).
    I32(Vec<i32>),
}

/// A host tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Dims, outermost first.
    pub shape: Vec<usize>,
    /// Elements.
    pub data: Buffer,
}

impl Tensor {
    /// An f32 tensor. Panics if `data.len()` differs from the shape's product (caller bug).
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        Tensor::new(shape, data.len(), Buffer::F32(data))
    }
    /// An i32 tensor. Panics if `data.len()` differs from the shape's product (caller bug).
    pub fn i32(shape: Vec<usize>, data: Vec<i32>) -> Tensor {
        Tensor::new(shape, data.len(), Buffer::I32(data))
    }
    /// A tensor of `len` elements stored in `data`: the shape check of [`Tensor::f32`] and
    /// [`Tensor::i32`].
    fn new(shape: Vec<usize>, len: usize, data: Buffer) -> Tensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            len,
            "invariant: shape matches data"
        );
        Tensor { shape, data }
    }
    /// Zeros of a dtype (i32 for `I32`, f32 for every float dtype).
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Tensor {
        let n = shape.iter().product();
        match dtype {
            DType::I32 => Tensor::i32(shape, vec![0; n]),
            _ => Tensor::f32(shape, vec![0.0; n]),
        }
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// The f32 elements, if this is an f32 tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            Buffer::F32(v) => Some(v),
            Buffer::I32(_) => None,
        }
    }
    /// The i32 elements, if this is an i32 tensor.
    pub fn as_i32(&self) -> Option<&[i32]> {
        match &self.data {
            Buffer::I32(v) => Some(v),
            Buffer::F32(_) => None,
        }
    }
    /// The dtype name (`f32` or `i32`).
    pub fn dtype_name(&self) -> &'static str {
        match self.data {
            Buffer::F32(_) => "f32",
            Buffer::I32(_) => "i32",
        }
    }
}
