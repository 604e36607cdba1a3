//! The scratch buffers a CUDA program reserves at prepare time, sized from the graph alone:
//! the compute scratch (the largest temporary any node or fused group needs: attention's f32
//! mask and split-KV workspace, loss rows, a training op's statistics or accumulators, the
//! attention backward group's recomputed forward), the two halves of the collective scratch,
//! and the collective matmuls' ring buffers.

use super::dtype::{GpuDType, Storage};
use super::flash::FlashScratch;
use super::plan::{attention_scratch, Action, FusedGroup, FusionPlan};
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
            // A node a fused group runs (an attention gradient of a flash group) needs none
            // of its own: the group's is counted below.
            _ if fusion.actions[v.index()] == Action::Run => {
                compute = compute.max(train_scratch_bytes(g, node, storage));
            }
            _ => {}
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::plan::plan_memory;
    use shardc_compiler::ir::{AttnSpec, DType, Float, TensorType};

    /// An attention backward run as a flash group reserves the group's temporaries, not the
    /// `[B, H, T, S]` f32 `dS` its gradient nodes would need on their own.
    #[test]
    fn flash_groups_reserve_no_probability_sized_scratch() {
        let (b, t, h, d) = (1, 512, 4, 64);
        let mut g = Graph::new();
        let ty = |s: &[usize]| TensorType::plain(DType::F32, s);
        let q = g.input("q", ty(&[b, t, h, d]));
        let k = g.input("k", ty(&[b, t, h, d]));
        let v = g.input("v", ty(&[b, t, h, d]));
        let dy = g.input("dy", ty(&[b, t, h, d]));
        let spec = AttnSpec {
            causal: true,
            window: None,
            scale: Float(0.125),
            indexed: false,
        };
        let p = g.add(Op::AttentionProbs(spec), &[q, k], "probs").unwrap();
        for (wrt, name) in [(AttnWrt::Q, "dq"), (AttnWrt::K, "dk"), (AttnWrt::V, "dv")] {
            let x = g
                .add(Op::AttentionGrad { spec, wrt }, &[q, k, v, dy, p], name)
                .unwrap();
            g.set_output(name, x);
        }
        let storage = vec![Storage::Float(GpuDType::Bf16); g.len()];
        let ds_bytes = b * h * t * t * 4;
        let (_, flash) = plan_memory(&g, GpuDType::Bf16, true);
        let (compute, _, _) = scratch_sizes(&g, &storage, &flash, 132, true);
        assert!(
            compute < ds_bytes / 4,
            "{compute} bytes of scratch with the flash group"
        );
        let (_, unfused) = plan_memory(&g, GpuDType::Bf16, false);
        let (compute, _, _) = scratch_sizes(&g, &storage, &unfused, 132, true);
        assert!(
            compute >= ds_bytes,
            "{compute} bytes for the materialised dS"
        );
    }
}
