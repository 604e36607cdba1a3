//! Published training runs the simulator is checked against, as data.
//!
//! Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
//! Megatron-LM", SC'21 (arXiv:2104.04473), Table 1: GPT models (vocabulary 51,200, sequence
//! 2,048, mixed precision, full activation recomputation) on Selene (DGX A100 80GB, 8x 200 Gb/s
//! HDR InfiniBand per node), weak scaling from 1.7B to 1T parameters. TFLOP/s per GPU are as
//! the paper counts them ([`megatron_flops_per_step`], recomputation included).

use crate::model::{ModelConfig, ModelError};

/// One row of Table 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MegatronRun {
    /// Parameters, billions.
    pub params_b: f64,
    /// Attention heads.
    pub heads: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Layers.
    pub layers: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// GPUs.
    pub gpus: usize,
    /// Global batch (sequences).
    pub batch: usize,
    /// Achieved TFLOP/s per GPU.
    pub tflops_per_gpu: f64,
    /// Percentage of the 312 TFLOP/s peak.
    pub percent_peak: u32,
    /// Aggregate PFLOP/s.
    pub aggregate_pflops: f64,
}

// One argument per column of the table, in its order.
#[allow(clippy::too_many_arguments)]
const fn row(
    params_b: f64,
    heads: usize,
    hidden: usize,
    layers: usize,
    tp: usize,
    pp: usize,
    gpus: usize,
    batch: usize,
    tflops_per_gpu: f64,
    percent_peak: u32,
    aggregate_pflops: f64,
) -> MegatronRun {
    MegatronRun {
        params_b,
        heads,
        hidden,
        layers,
        tp,
        pp,
        gpus,
        batch,
        tflops_per_gpu,
        percent_peak,
        aggregate_pflops,
    }
}

/// Table 1 of Narayanan et al., SC'21.
pub const MEGATRON_SC21_TABLE1: [MegatronRun; 10] = [
    row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137.0, 44, 4.4),
    row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138.0, 44, 8.8),
    row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142.0, 46, 18.2),
    row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135.0, 43, 34.6),
    row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138.0, 44, 70.8),
    row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140.0, 45, 143.8),
    row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148.0, 47, 227.1),
    row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155.0, 50, 297.4),
    row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163.0, 52, 410.2),
    row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163.0, 52, 502.0),
];

/// A GPT (gpt2 architecture: learned positions, LayerNorm, GeLU MLP of 4h, tied head) with the
/// given shape, as Megatron-LM's GPT models are.
pub fn gpt_config(
    layers: usize,
    hidden: usize,
    heads: usize,
    vocab: usize,
    positions: usize,
) -> Result<ModelConfig, ModelError> {
    ModelConfig::from_json(&serde_json::json!({
        "model_type": "gpt2",
        "n_layer": layers,
        "n_embd": hidden,
        "n_head": heads,
        "vocab_size": vocab,
        "n_positions": positions,
        "activation_function": "gelu_new",
    }))
}

/// FLOPs of one iteration as the paper counts them (its Eq. 3, full recomputation):
/// `96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`.
pub fn megatron_flops_per_step(
    batch: usize,
    seq: usize,
    layers: usize,
    hidden: usize,
    vocab: usize,
) -> f64 {
    let (b, s, l, h, v) = (
        batch as f64,
        seq as f64,
        layers as f64,
        hidden as f64,
        vocab as f64,
    );
    96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_self_consistent() {
        for r in MEGATRON_SC21_TABLE1 {
            // Aggregate = per-GPU × GPUs, and % of the 312 TFLOP/s peak, within rounding.
            let agg = r.tflops_per_gpu * r.gpus as f64 / 1000.0;
            assert!((agg / r.aggregate_pflops - 1.0).abs() < 0.02, "{r:?}");
            let pct = r.tflops_per_gpu / 312.0 * 100.0;
            assert!((pct - r.percent_peak as f64).abs() < 1.0, "{r:?}");
            // Parameters: 12lh²(1 + 13/12h + (V+s)/12lh).
            let (l, h) = (r.layers as f64, r.hidden as f64);
            let p =
                12.0 * l * h * h * (1.0 + 13.0 / (12.0 * h) + (51200.0 + 2048.0) / (12.0 * l * h));
            // The table rounds (1.65B is listed as 1.7).
            assert!((p / 1e9 / r.params_b - 1.0).abs() < 0.04, "{r:?} {p}");
        }
        let c = gpt_config(24, 2304, 24, 51200, 2048).unwrap();
        assert_eq!(c.ffn, 4 * 2304);
        assert!(c.tied);
    }
}
