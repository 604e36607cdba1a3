//! The CPU reference backend: one float32 kernel per [`Op`], the numerical oracle every other
//! backend is tested against. One file per op family.
//!
//! Pre: operands have the shapes and buffer types the op's type rule (`Op::infer`) accepts;
//! kernels re-check what they rely on and return [`RuntimeError::Shape`] /
//! [`RuntimeError::OperandDType`] instead of panicking. Float dtypes (f32, bf16, f16) are all
//! computed in f32; only `Cast` rounds to a lower precision.
//! Post: results follow the semantics written in `shardc_compiler::ir::op` exactly.

pub(crate) mod attention;
pub(crate) mod collective;
pub(crate) mod collective_matmul;
pub(crate) mod elementwise;
pub(crate) mod fused;
pub(crate) mod layout;
pub(crate) mod linalg;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod ring_attention;
pub(crate) mod rope;
pub(crate) mod train;
pub(crate) mod vocab;

use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::{Op, TensorType};

/// Element count above which elementwise kernels split work over rayon.
pub(crate) const PAR_MIN: usize = 1 << 15;

/// Evaluates one context-free op on the CPU: every op except `Input`, `Param`, the
/// collectives, `AgMatMul`, `MatMulRs`, `RingAttention`, `RingAttentionGrad`, `LocalSlice`, `RankOffset`, `CrossEntropyStats` and
/// `CrossEntropyShardGrad` (those need the executor's rank context).
/// `out` is the node's type: it supplies the shape of `Reshape` and the dtype of `Cast`.
///
/// Embedding ids outside the table give zero rows here; the executor validates ids for
/// unsharded tables.
pub fn eval_op(op: &Op, inputs: &[&Tensor], out: &TensorType) -> Result<Tensor, RuntimeError> {
    if let Some(r) = train::eval(op, inputs) {
        return r;
    }
    let m = op.mnemonic();
    let want = |n: usize| arity(m, inputs, n);
    match op {
        Op::Embedding => {
            want(2)?;
            vocab::embedding(inputs[0], inputs[1])
        }
        Op::MatMul { transpose_b } => {
            want(2)?;
            linalg::matmul(inputs[0], inputs[1], *transpose_b)
        }
        Op::Add => {
            want(2)?;
            elementwise::add(inputs[0], inputs[1])
        }
        Op::Mul => {
            want(2)?;
            elementwise::mul(inputs[0], inputs[1])
        }
        Op::Unary(u) => {
            want(1)?;
            elementwise::unary(*u, inputs[0])
        }
        Op::Scale(c) => {
            want(1)?;
            elementwise::scale(inputs[0], c.0)
        }
        Op::Cast(dt) => {
            want(1)?;
            elementwise::cast(inputs[0], *dt)
        }
        Op::RmsNorm { eps } => {
            want(2)?;
            norm::rms_norm(inputs[0], inputs[1], eps.0)
        }
        Op::LayerNorm { eps } => {
            want(3)?;
            norm::layer_norm(inputs[0], inputs[1], inputs[2], eps.0)
        }
        Op::Rope(spec) => {
            want(2)?;
            rope::rope(inputs[0], inputs[1], spec)
        }
        Op::Attention(spec) => {
            let keys = attention::Keys::after(m, spec, inputs, 3)?;
            attention::attention(inputs[0], inputs[1], inputs[2], keys, spec)
        }
        Op::SeqIndex { len, order } => {
            want(0)?;
            layout::seq_index(*len, *order)
        }
        Op::SeqPermute {
            dim,
            order,
            inverse,
        } => {
            want(1)?;
            layout::seq_permute(inputs[0], *dim, *order, *inverse)
        }
        Op::Softmax => {
            want(1)?;
            norm::softmax(inputs[0])
        }
        Op::Reshape => {
            want(1)?;
            layout::reshape(inputs[0], out.shape())
        }
        Op::Transpose { perm } => {
            want(1)?;
            layout::transpose(inputs[0], perm)
        }
        Op::Slice { dim, start, len } => {
            want(1)?;
            layout::slice(inputs[0], *dim, *start, *len)
        }
        Op::Concat { dim } => layout::concat(inputs, *dim),
        Op::Repeat { dim, times } => {
            want(1)?;
            layout::repeat(inputs[0], *dim, *times)
        }
        Op::Router { top_k, normalize } => {
            want(1)?;
            moe::router(inputs[0], *top_k, *normalize)
        }
        Op::Dispatch => {
            want(2)?;
            moe::dispatch(inputs[0], inputs[1])
        }
        Op::Combine => {
            want(2)?;
            moe::combine(inputs[0], inputs[1])
        }
        Op::CrossEntropy { denom } => {
            want(2)?;
            vocab::cross_entropy(inputs[0], inputs[1], *denom)
        }
        Op::CrossEntropyFromStats { denom } => {
            want(2)?;
            vocab::cross_entropy_from_stats(inputs[0], inputs[1], *denom)
        }
        Op::FusedElementwise { expr } => fused::elementwise(expr, inputs),
        Op::FusedMatMul {
            transpose_b,
            epilogue,
        } => fused::matmul(*transpose_b, epilogue, inputs),
        Op::AddRmsNorm { eps } => {
            want(3)?;
            fused::add_rms_norm(inputs[0], inputs[1], inputs[2], eps.0)
        }
        Op::Input { .. }
        | Op::Param(_)
        | Op::AgMatMul { .. }
        | Op::MatMulRs { .. }
        | Op::RingAttention { .. }
        | Op::RingAttentionGrad { .. }
        | Op::AllReduce { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGather { .. }
        | Op::AllToAll { .. }
        | Op::Broadcast { .. }
        | Op::LocalSlice { .. }
        | Op::RankOffset { .. }
        | Op::CrossEntropyStats { .. }
        | Op::CrossEntropyShardGrad { .. } => Err(RuntimeError::Unsupported {
            op: m,
            detail: "needs the executor's rank context; use `execute`".into(),
        }),
        // Evaluated by `train::eval` above.
        shardc_compiler::training_ops!() => Err(RuntimeError::Unsupported {
            op: m,
            detail: "a training op outside the training kernels".into(),
        }),
    }
}

/// `Ok` when `op` got `n` operands, else a [`RuntimeError::Shape`] listing them.
pub(crate) fn arity(op: &'static str, inputs: &[&Tensor], n: usize) -> Result<(), RuntimeError> {
    if inputs.len() == n {
        Ok(())
    } else {
        Err(shape_err(op, inputs, "wrong number of operands"))
    }
}

/// A [`RuntimeError::Shape`] listing the operands' shapes.
pub(crate) fn shape_err(
    op: &'static str,
    inputs: &[&Tensor],
    reason: &'static str,
) -> RuntimeError {
    RuntimeError::Shape {
        op,
        shapes: inputs.iter().map(|t| t.shape.clone()).collect(),
        reason,
    }
}

/// Operand `i`'s f32 data, or an [`RuntimeError::OperandDType`].
pub(crate) fn f32_of<'t>(
    op: &'static str,
    t: &'t Tensor,
    operand: usize,
) -> Result<&'t [f32], RuntimeError> {
    data_of(op, t, operand, "f32", t.as_f32())
}

/// Operand `i`'s i32 data, or an [`RuntimeError::OperandDType`].
pub(crate) fn i32_of<'t>(
    op: &'static str,
    t: &'t Tensor,
    operand: usize,
) -> Result<&'t [i32], RuntimeError> {
    data_of(op, t, operand, "i32", t.as_i32())
}

/// Operand `i`'s `data` as read for the `expected` dtype, or an
/// [`RuntimeError::OperandDType`] naming the dtype `t` holds.
fn data_of<'t, T>(
    op: &'static str,
    t: &Tensor,
    operand: usize,
    expected: &'static str,
    data: Option<&'t [T]>,
) -> Result<&'t [T], RuntimeError> {
    data.ok_or(RuntimeError::OperandDType {
        op,
        operand,
        expected,
        found: t.dtype_name(),
    })
}

/// Product of the dims of a shape (1 for a scalar).
pub(crate) fn prod(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Softmax of one row in place: max-subtracted exponentials rounded to f32 (as PyTorch
/// stores them), summed in f64, each divided by the sum. A row of `-inf` gives NaN; callers
/// that mask rows handle empty rows themselves.
pub(crate) fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for r in row.iter_mut() {
        *r = ((*r - max) as f64).exp() as f32;
        sum += *r as f64;
    }
    for r in row.iter_mut() {
        *r = (*r as f64 / sum) as f32;
    }
}

/// Runs `f(row_index, row)` over the rows of width `width` of `out`, in parallel when `out`
/// is large. A zero width runs nothing.
pub(crate) fn for_each_row(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    use rayon::prelude::*;
    if width == 0 {
        return;
    }
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(width)
            .enumerate()
            .for_each(|(i, r)| f(i, r));
    } else {
        out.chunks_mut(width).enumerate().for_each(|(i, r)| f(i, r));
    }
}
