//! The scratch buffers a CUDA program reserves at prepare time, sized from the graph alone:
//! the compute scratch (the largest temporary any node or fused group needs: attention's f32
//! mask and split-KV workspace, loss rows, a training op's statistics or accumulators, the
//! attention backward group's recomputed forward), the two halves of the collective scratch,
//! and the collective matmuls' ring buffers.

use super::dtype::{GpuDType, Storage};
use super::flash::FlashScratch;
use super::plan::{attention_scratch, FusedGroup, FusionPlan};
use shardc_compiler::ir::{AttnWrt, Graph, Node, NormWrt, Op, ValueId};

/// `(compute scratch bytes, bytes of each of the two collective scratch halves, ring buffer
/// bytes of the collective matmuls)` of `g` stored as `storage` with the fused groups of
/// `fusion`.
pub(super) fn scratch_sizes(
    g: &Graph,
    storage: &[Storage],
    fusion: &FusionPlan,
    sm_count: usize,
    split_kv: bool,
) -> (usize, u64, usize) {
    let align = |b: usize| b.div_ceil(256) * 256;
    let mut compute = 256usize;
    let mut comm = 256u64;
    let mut ring = 256usize;
    for v in g.ids() {
        let node = g.node(v);
        let e = storage[v.index()].size_bytes();
        let x_bytes = node.inputs.first().map_or(0, |&x| g.ty(x).numel() * e);
        let out_bytes = node.ty.numel() * e;
        match &node.op {
            Op::Attention(_) => {
                compute = compute.max(attention_scratch(g, node, sm_count, split_kv).total());
            }
            Op::CrossEntropy { .. } | Op::CrossEntropyFromStats { .. } => {
                let rows = g.ty(node.inputs[1]).numel();
                compute = compute.max(align(rows * 4) + 256);
            }
            Op::AddRmsNorm { .. } => compute = compute.max(out_bytes),
            Op::AgMatMul { parts, .. } => {
                compute = compute.max(out_bytes);
                ring = ring.max(2 * align(x_bytes));
                let _ = parts;
            }
            Op::MatMulRs { parts, .. } => {
                compute = compute.max(x_bytes / (*parts).max(1));
                ring = ring.max(4 * align(out_bytes));
            }
            op if op.is_collective() => {
                comm = comm.max(align(out_bytes.max(x_bytes)) as u64);
            }
            _ => compute = compute.max(train_scratch_bytes(g, node, storage)),
        }
    }
    for grp in &fusion.groups {
        if let FusedGroup::AttentionBwd(f) = grp {
            compute = compute.max(FlashScratch::of(g, f, storage).total);
        }
    }
    (compute, comm, ring)
}

/// Bytes of compute scratch a training node needs (0 for every other node).
fn train_scratch_bytes(g: &Graph, node: &Node, storage: &[Storage]) -> usize {
    let elem = |v: ValueId| storage[v.index()].size_bytes();
    let bf16 = storage.contains(&Storage::Float(GpuDType::Bf16));
    match &node.op {
        Op::RmsNormGrad {
            wrt: NormWrt::Weight,
            ..
        }
        | Op::LayerNormGrad {
            wrt: NormWrt::Weight,
            ..
        } => {
            let x = g.ty(node.inputs[0]);
            x.numel() / x.last().max(1) * 2 * 4
        }
        Op::AttentionGrad {
            wrt: AttnWrt::Q | AttnWrt::K,
            ..
        } => g.ty(node.inputs[4]).numel() * 4,
        Op::AttentionProbs(_) if bf16 => node.inputs.get(2).map_or(0, |&m| g.ty(m).numel() * 4),
        Op::EmbeddingGrad if bf16 => node.ty.numel() * 4,
        Op::CrossEntropyGrad { .. } => {
            g.ty(node.inputs[1]).numel()
                * shardc_compiler::ir::CROSS_ENTROPY_STATS
                * elem(node.inputs[0])
        }
        _ => 0,
    }
}
