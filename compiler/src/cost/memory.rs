//! Memory model: the static bytes of mixed-precision Adam training with ZeRO (Rajbhandari et
//! al., SC'20: `2Ψ` bf16 weights, `2Ψ` bf16 gradients, `KΨ = 12Ψ` fp32 master weights, momentum
//! and variance, each sharded over the data-parallel ranks from stage 3, 2 and 1 on), and the
//! activations a layer keeps for its backward, derived from the layer's SPMD graph.
//!
//! [`saved_activations`] walks one layer's nodes and counts what each needs in the backward:
//! a GEMM its activation operand (or, when that operand is an all-gather's result, the sharded
//! input, re-gathered in the backward as Megatron sequence parallelism does), a norm or an
//! activation function its input, a product both factors, attention `q`, `k`, `v` plus its
//! score matrix, softmax output and dropout mask and output when unfused (the output and the
//! log-sum-exp with FlashAttention), and a 1-byte dropout mask per residual branch. Views
//! share their base; a value saved twice counts once. On a GPT layer this gives exactly
//! Korthikanti et al. (2022), Table 2: `sbh(34 + 5as/h)` unsharded, `sbh(10 + 24/t + 5as/(ht))`
//! with tensor parallelism, `sbh/t·(34 + 5as/h)` with sequence parallelism, without the `5as/h`
//! term under selective recomputation, and `2sbh` (the layer input) under full recomputation
//! — [`korthikanti_per_layer`] is that closed form, for tests.

use super::roofline::{is_expert_major, routed_fraction, sim_bytes, AttentionImpl};
use super::units::Bytes;
use crate::ir::{DType, Graph, Op, ValueId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Activation recomputation: the compiler's (the model and the plans mean the same thing).
pub use crate::autodiff::Recompute;

/// Per-rank memory at its peak, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// Weights (bf16 for training, the simulated dtype for inference).
    pub params: Bytes,
    /// Weight gradients.
    pub grads: Bytes,
    /// Optimizer states (fp32 master weights, Adam momentum and variance).
    pub optimizer: Bytes,
    /// Activations kept for the backward (every in-flight microbatch), or the live
    /// activations of a forward plan.
    pub activations: Bytes,
    /// Short-lived working memory at the peak: a layer's recomputed activations, logits.
    pub transient: Bytes,
    /// Communication buffers (ZeRO-3 gathered parameters).
    pub comm_buffers: Bytes,
}

impl MemoryBreakdown {
    /// The sum.
    pub fn total(&self) -> Bytes {
        self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.transient
            + self.comm_buffers
    }
}

/// ZeRO's static bytes for `psi` parameters on `dp` data-parallel ranks at `stage` (0..=3):
/// (weights, gradients, optimizer states), with 2 + 2 + 12 bytes per parameter unsharded.
pub fn zero_static(psi: u64, dp: usize, stage: u8) -> (Bytes, Bytes, Bytes) {
    let dp = dp.max(1) as u64;
    let shard = |bytes: u64, on: bool| Bytes(if on { bytes.div_ceil(dp) } else { bytes });
    (
        shard(2 * psi, stage >= 3),
        shard(2 * psi, stage >= 2),
        shard(12 * psi, stage >= 1),
    )
}

/// Korthikanti et al. (2022), Table 2: activation bytes per layer of a GPT layer (16-bit
/// activations, dropout) for sequence `s`, micro-batch `b`, hidden `h`, heads `a`, tensor
/// parallel `t`.
pub fn korthikanti_per_layer(
    s: f64,
    b: f64,
    h: f64,
    a: f64,
    t: f64,
    sp: bool,
    recompute: Recompute,
) -> f64 {
    let sbh = s * b * h;
    match (recompute, sp) {
        (Recompute::Full, false) => 2.0 * sbh,
        (Recompute::Full, true) => 2.0 * sbh / t,
        (Recompute::Selective, false) => sbh * (10.0 + 24.0 / t),
        (Recompute::Selective, true) => sbh * 34.0 / t,
        (Recompute::None, false) => sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)),
        (Recompute::None, true) => sbh / t * (34.0 + 5.0 * a * s / h),
    }
}

/// Options of [`saved_activations`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SavedOptions {
    /// Activation dtype for `f32` IR values.
    pub dtype: DType,
    /// Attention implementation.
    pub attention: AttentionImpl,
    /// Dropout (masks on attention probabilities and residual branches).
    pub dropout: bool,
    /// Recomputation.
    pub recompute: Recompute,
}

/// Bytes layer `layer` of the SPMD graph `g` keeps for its backward, per micro-batch.
pub fn saved_activations(g: &Graph, layer: u32, o: &SavedOptions) -> Bytes {
    let in_layer: Vec<ValueId> = g
        .ids()
        .filter(|&v| g.node(v).layer == Some(layer))
        .collect();
    let canon = |mut v: ValueId| {
        while matches!(g.node(v).op, Op::Reshape) {
            v = g.node(v).inputs[0];
        }
        v
    };
    let is_param = |v: ValueId| matches!(g.node(v).op, Op::Param(_));
    let routed = routed_fraction(g);
    let bytes = |v: ValueId| {
        let ty = g.ty(v);
        let x = sim_bytes(ty, o.dtype);
        if is_expert_major(ty) {
            x * routed
        } else {
            x
        }
    };
    if o.recompute == Recompute::Full {
        // The layer's input: the residual stream entering its first norm.
        let first = in_layer
            .iter()
            .copied()
            .find(|&v| matches!(g.node(v).op, Op::RmsNorm { .. } | Op::LayerNorm { .. }));
        return Bytes(first.map_or(0.0, |v| bytes(canon(g.node(v).inputs[0]))) as u64);
    }
    let mut saved: BTreeSet<ValueId> = BTreeSet::new();
    let mut extra = 0.0f64;
    let save = |x: ValueId, saved: &mut BTreeSet<ValueId>| {
        let x = canon(x);
        if !is_param(x) {
            saved.insert(x);
        }
    };
    for &v in &in_layer {
        let n = g.node(v);
        match &n.op {
            Op::MatMul { .. } => {
                let a = canon(n.inputs[0]);
                let a = match g.node(a).op {
                    Op::AllGather { .. } => canon(g.node(a).inputs[0]),
                    _ => a,
                };
                save(a, &mut saved);
                if !is_param(n.inputs[1]) {
                    save(n.inputs[1], &mut saved);
                }
            }
            Op::RmsNorm { .. } | Op::LayerNorm { .. } | Op::Unary(_) => {
                save(n.inputs[0], &mut saved)
            }
            Op::Mul => {
                for &i in &n.inputs {
                    save(i, &mut saved);
                }
            }
            Op::Router { .. } | Op::Dispatch | Op::Combine => {
                for &i in &n.inputs {
                    save(i, &mut saved);
                }
            }
            Op::Attention(_) | Op::RingAttention { .. } => {
                for &i in &n.inputs[..3] {
                    save(i, &mut saved);
                }
                let ring = match n.op {
                    Op::RingAttention { parts, .. } => parts,
                    _ => 1,
                };
                let q = g.ty(n.inputs[0]);
                let k = g.ty(n.inputs[1]);
                let (b, t, h) = (q.dim(0), q.dim(1), q.dim(2));
                let scores = (b * h * t * k.dim(1) * ring) as f64;
                let el = o.dtype.size_bytes() as f64;
                match o.attention {
                    AttentionImpl::Unfused => {
                        if o.recompute == Recompute::None {
                            // Softmax output, and with dropout its mask (1 byte) and output.
                            let drop = if o.dropout { 1.0 + el } else { 0.0 };
                            extra += scores * (el + drop);
                        }
                    }
                    AttentionImpl::Flash => {
                        save(v, &mut saved);
                        extra += (b * h * t) as f64 * 4.0;
                    }
                }
            }
            Op::Add if o.dropout && n.name.ends_with(".residual") => {
                // Dropout on the branch added to the residual stream: a 1-byte mask.
                extra += g.ty(n.inputs[1]).numel() as f64;
            }
            _ => {}
        }
    }
    let total: f64 = saved.iter().map(|&x| bytes(x)).sum::<f64>() + extra;
    Bytes(total as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_paper_figure_1() {
        // Rajbhandari et al., Figure 1: Ψ = 7.5B, N_d = 64, K = 12.
        let psi = 7_500_000_000u64;
        let gb = |(p, g, o): (Bytes, Bytes, Bytes)| (p + g + o).0 as f64 / 1e9;
        assert!((gb(zero_static(psi, 64, 0)) - 120.0).abs() < 0.01);
        assert!((gb(zero_static(psi, 64, 1)) - 31.4).abs() < 0.05);
        assert!((gb(zero_static(psi, 64, 2)) - 16.6).abs() < 0.05);
        assert!((gb(zero_static(psi, 64, 3)) - 1.88).abs() < 0.01);
    }

    #[test]
    fn korthikanti_closed_forms_are_consistent() {
        let (s, b, h, a) = (2048.0, 1.0, 12288.0, 96.0);
        let t = 8.0;
        // Sequence parallelism divides the 10sbh term too.
        let tp = korthikanti_per_layer(s, b, h, a, t, false, Recompute::None);
        let sp = korthikanti_per_layer(s, b, h, a, t, true, Recompute::None);
        assert!((tp - sp - s * b * h * 10.0 * (1.0 - 1.0 / t)).abs() < 1.0);
        assert_eq!(
            korthikanti_per_layer(s, b, h, a, 1.0, false, Recompute::None),
            s * b * h * (34.0 + 5.0 * a * s / h)
        );
    }
}
