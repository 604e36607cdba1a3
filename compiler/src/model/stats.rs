//! Analytic statistics of a model: parameter counts (tied parameters once, from the built
//! graph's parameter sources), FLOPs per token as Megatron-LM counts them, and the static
//! memory of mixed-precision AdamW training and of bf16 inference.

use super::build::{build_forward, BuildOptions};
use super::config::{ModelConfig, ModelError};
use super::limits::{product, IrWork};
use crate::ir::{Op, ParamSource};
use std::collections::BTreeMap;
use std::collections::HashSet;

/// A component parameters are counted under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ParamGroup {
    /// Token and position embeddings.
    Embedding,
    /// Attention projections (q, k, v, o and their biases).
    Attention,
    /// MLP projections, or the experts of an MoE layer.
    Mlp,
    /// MoE router.
    Router,
    /// Norm weights and biases.
    Norm,
    /// Untied output head.
    LmHead,
}

impl ParamGroup {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            ParamGroup::Embedding => "embedding",
            ParamGroup::Attention => "attention",
            ParamGroup::Mlp => "mlp",
            ParamGroup::Router => "router",
            ParamGroup::Norm => "norm",
            ParamGroup::LmHead => "lm_head",
        }
    }

    fn of_label(label: &str) -> ParamGroup {
        if label.contains("norm") {
            ParamGroup::Norm
        } else if label.starts_with("embed") || label.starts_with("pos_embed") {
            ParamGroup::Embedding
        } else if label.starts_with("lm_head") {
            ParamGroup::LmHead
        } else if label.contains(".router") {
            ParamGroup::Router
        } else if label.contains(".attn.") {
            ParamGroup::Attention
        } else {
            ParamGroup::Mlp
        }
    }
}

/// What `shardc inspect` reports.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelStats {
    /// Total parameters, tied ones once.
    pub params: u64,
    /// Parameters per component.
    pub by_group: BTreeMap<ParamGroup, u64>,
    /// Parameters a token touches in matmuls (MoE: router + top-k experts; lm_head included).
    pub active_matmul_params: u64,
    /// Sequence length the attention FLOPs assume.
    pub seq: usize,
    /// Forward FLOPs per token (Megatron-LM convention: 2 per multiply-add, attention scores
    /// and values over the full sequence).
    pub forward_flops_per_token: u64,
    /// Training FLOPs per token: 3× forward (no recompute).
    pub training_flops_per_token: u64,
    /// Static bytes of mixed-precision AdamW training: 16 per parameter (bf16 weight and
    /// gradient, fp32 master weight, momentum and variance).
    pub training_static_bytes: u64,
    /// Bytes of bf16 inference weights: 2 per parameter.
    pub inference_bf16_bytes: u64,
}

impl ModelStats {
    /// Computes the statistics; `seq` is the context length for attention FLOPs (1 ≤ `seq` ≤
    /// the model's maximum positions).
    pub fn compute(cfg: &ModelConfig, seq: usize) -> Result<ModelStats, ModelError> {
        if seq == 0 || seq > cfg.max_positions {
            return Err(ModelError::Key {
                key: "seq".into(),
                msg: format!(
                    "must be in 1..={} (the model's maximum positions; found {seq})",
                    cfg.max_positions
                ),
            });
        }
        cfg.check_ir(IrWork::Graph)?;
        let g = build_forward(cfg, BuildOptions::new(1, 1))
            .map_err(|e| ModelError::Unsupported(format!("cannot build the graph: {e}")))?;
        let mut seen: HashSet<ParamSource> = HashSet::new();
        let mut by_group = BTreeMap::new();
        let mut params = 0u64;
        let mut matmul_params = 0u64;
        let mut expert_params = 0u64;
        let users = g.users();
        for v in g.params() {
            let node = g.node(v);
            let Op::Param(src) = &node.op else { continue };
            let n = node.ty.numel() as u64;
            if seen.insert(src.clone()) {
                params += n;
                *by_group
                    .entry(ParamGroup::of_label(&node.name))
                    .or_insert(0) += n;
            }
            // FLOPs: every matmul use of a weight counts (a tied embedding is also the head).
            for &u in &users[v.index()] {
                if matches!(g.node(u).op, Op::MatMul { .. }) {
                    if node.ty.rank() == 3 {
                        expert_params += n;
                    } else {
                        matmul_params += n;
                    }
                }
            }
        }
        let active_experts = match cfg.moe {
            Some(m) => expert_params * m.top_k as u64 / m.experts as u64,
            None => 0,
        };
        let active = matmul_params + active_experts;
        // In u128: attention FLOPs grow with seq × width × layers.
        let attn = product(&[
            4,
            seq as u128,
            cfg.heads as u128 * cfg.head_dim as u128,
            cfg.layers as u128,
        ]);
        let fwd = (2 * active as u128).saturating_add(attn);
        let fits = |x: u128| {
            u64::try_from(x).map_err(|_| {
                ModelError::key("seq", format!("{seq}: FLOPs per token beyond 64 bits"))
            })
        };
        Ok(ModelStats {
            params,
            by_group,
            active_matmul_params: active,
            seq,
            forward_flops_per_token: fits(fwd)?,
            training_flops_per_token: fits(3 * fwd)?,
            training_static_bytes: 16 * params,
            inference_bf16_bytes: 2 * params,
        })
    }
}
