//! What the CUDA backend can run: each node checked before anything is allocated, and the
//! labels of a cross-entropy checked against the vocabulary as the CPU reference checks them.

use super::{CudaError, GpuDType};
use crate::cpu::vocab;
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::{DType, Graph, Op, ValueId};
use std::collections::BTreeMap;

/// Rejects, before anything is allocated, what the CUDA backend cannot run.
pub(super) fn check_supported(
    g: &Graph,
    v: ValueId,
    coords: &BTreeMap<String, (usize, usize)>,
    dt: GpuDType,
) -> Result<(), CudaError> {
    let node = g.node(v);
    let bad = |detail: String| CudaError::Unsupported {
        node: v,
        name: node.name.clone(),
        op: node.op.mnemonic(),
        detail,
    };
    if let Some(axis) = node.op.axis() {
        if !coords.contains_key(axis) {
            return Err(RuntimeError::MissingAxis {
                axis: axis.to_string(),
            }
            .into());
        }
    }
    let Some(operands) = kernel_operands(&node.op) else {
        return Err(bad("no CUDA kernel for this op".into()));
    };
    if operands == Operands::FloatOnly && node.ty.dtype == DType::I32 {
        return Err(bad("i32 arithmetic (the kernels are f32/bf16)".into()));
    }
    match &node.op {
        Op::FusedElementwise { expr } | Op::FusedMatMul { epilogue: expr, .. } => {
            let k = node.inputs.len()
                - if matches!(node.op, Op::FusedMatMul { .. }) {
                    1
                } else {
                    0
                };
            if super::plan::fused_expr(expr, k, dt).is_none() {
                return Err(bad("a cast inside the fused program".into()));
            }
        }
        Op::Cast(to) => {
            let from = g.ty(node.inputs[0]).dtype;
            if matches!(to, DType::I32 | DType::F16) || from == DType::I32 {
                return Err(bad(format!("cast {from} → {to}")));
            }
        }
        Op::Attention(spec) | Op::AttentionProbs(spec) | Op::AttentionGrad { spec, .. } => {
            if spec.indexed {
                return Err(bad(
                    "context-parallel attention (query and key indices) runs on the CPU \
                     backend in this version"
                        .into(),
                ));
            }
            let d = g.ty(node.inputs[0]).last();
            if d > shardc_kernels::launch::ATTENTION_MAX_HEAD_DIM {
                return Err(bad(format!("head_dim {d} above 256")));
            }
            if spec.window == Some(0) {
                return Err(bad(
                    "a sliding window of 0 keys (the kernels read 0 as no window)".into(),
                ));
            }
            let mask_at = match node.op {
                Op::Attention(_) => Some(3),
                Op::AttentionProbs(_) => Some(2),
                _ => None,
            };
            if let Some(&m) = mask_at.and_then(|i| node.inputs.get(i)) {
                if g.ty(m).dtype == DType::I32 {
                    return Err(bad("an i32 key mask (the kernels read a float mask)".into()));
                }
            }
        }
        Op::AllReduce { .. } | Op::ReduceScatter { .. } if node.ty.dtype == DType::I32 => {
            // NCCL sums i32 natively; local-gpu refuses at run time with a clear error.
        }
        _ => {}
    }
    Ok(())
}

/// What an op's CUDA kernels take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Operands {
    /// Float tensors only (arithmetic).
    FloatOnly,
    /// Any storage: data movement, token ids and labels, collectives.
    Any,
}

/// What the CUDA kernels of `op` take, or `None` where the backend has none (context-parallel
/// ring attention).
fn kernel_operands(op: &Op) -> Option<Operands> {
    use Op::*;
    Some(match op {
        Add
        | Mul
        | Unary(_)
        | Scale(_)
        | MatMul { .. }
        | RmsNorm { .. }
        | LayerNorm { .. }
        | Softmax
        | FusedElementwise { .. }
        | FusedMatMul { .. }
        | AddRmsNorm { .. }
        | AgMatMul { .. }
        | MatMulRs { .. }
        | UnaryGrad(_)
        | BiasGrad
        | WeightGrad { .. }
        | RmsNormGrad { .. }
        | LayerNormGrad { .. }
        | AttentionGrad { .. }
        | AdamMoment { .. }
        | AdamWUpdate(_) => Operands::FloatOnly,
        Input { .. }
        | Param(_)
        | Embedding
        | Cast(_)
        | Rope(_)
        | Attention(_)
        | Reshape
        | Transpose { .. }
        | Slice { .. }
        | Concat { .. }
        | Repeat { .. }
        | Router { .. }
        | Dispatch
        | Combine
        | CrossEntropy { .. }
        | CrossEntropyStats { .. }
        | CrossEntropyFromStats { .. }
        | CrossEntropyShardGrad { .. }
        | AllReduce { .. }
        | ReduceScatter { .. }
        | AllGather { .. }
        | AllToAll { .. }
        | Broadcast { .. }
        | RankOffset { .. }
        | LocalSlice { .. }
        | RopeGrad(_)
        | AttentionProbs(_)
        | EmbeddingGrad
        | RouterGrad { .. }
        | DispatchGrad
        | CombineGrad { .. }
        | CrossEntropyGrad { .. }
        | RepeatGrad { .. } => Operands::Any,
        _ => return None,
    })
}

/// A label ≥ the vocabulary, as the CPU reference reports it.
pub(super) fn check_labels(labels: &Tensor, vocab_n: usize) -> Result<(), RuntimeError> {
    let Some(l) = labels.as_i32() else {
        return Ok(());
    };
    match l.iter().position(|&x| x >= 0 && x as usize >= vocab_n) {
        None => Ok(()),
        Some(i) => {
            let (batch, pos) = vocab::batch_pos(&labels.shape, i);
            Err(RuntimeError::LabelOutOfRange {
                label: l[i],
                vocab: vocab_n,
                batch,
                pos,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_beyond_the_vocabulary_are_reported() {
        let l = Tensor::i32(vec![2, 3], vec![0, 1, -1, 2, 9, 0]);
        let e = check_labels(&l, 5).unwrap_err();
        assert!(
            matches!(
                e,
                RuntimeError::LabelOutOfRange {
                    label: 9,
                    batch: 1,
                    pos: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(check_labels(&l, 10).is_ok());
    }
}
