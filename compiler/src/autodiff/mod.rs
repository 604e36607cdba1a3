//! Reverse-mode automatic differentiation over the IR, and the graph of one training step.
//!
//! [`build_train_graph`] takes a forward graph (from [`crate::model::build_forward`], built for
//! one micro-batch) and emits one optimizer step as a single graph:
//!
//! 1. Every parameter becomes a graph input `param.<label>` (the runner feeds the current
//!    weights each step), with AdamW state inputs `adam_m.<label>`, `adam_v.<label>` and the
//!    step count `step` (f32 scalar).
//! 2. For each micro-batch `k`: the forward pass on its own inputs (`input_ids`, ...,
//!    `labels`; suffixed `.mb<k>` when there are several micro-batches), the causal-LM loss
//!    `CrossEntropy { denom }` (denom = predicted tokens of the whole global batch, so the
//!    summed loss is the mean), then its backward pass: vector-Jacobian products in reverse
//!    order (`backward.rs`), reading forward values through `saved.<name>` nodes (the
//!    activations kept for backward), recomputing them per [`Recompute`].
//! 3. Gradient accumulation: a parameter's gradient is summed over its uses as soon as its
//!    last use's gradient exists, then over the micro-batches (`grad.<label>`).
//! 4. The AdamW step for every parameter: `AdamMoment` twice, `AdamWUpdate`.
//!
//! Outputs: `loss`, and per parameter `grad.<label>`, `param.<label>` (updated),
//! `adam_m.<label>`, `adam_v.<label>`.
//!
//! Each node gets its [`crate::ir::ValueRole`] here, where what it is is known (forward,
//! saved, recomputed, backward, gradient, parameter, moment, update, step, loss); later passes
//! carry it, and the interface names above are formatted by [`crate::ir::ValueRole::name`].
//!
//! Pre: the forward graph verifies and has a `logits` output `[B, T, V]`; its ops are those
//! the five architectures use (others are an [`AutodiffError::NoGradient`]).
//! Post: the result verifies; no node reads a parameter except through its input (or, with
//! [`TrainGraphOptions::gather_params`], a per-phase `gather.<label>` node the sharding
//! machinery turns into ZeRO-3's all-gather).

mod backward;
mod builder;

pub use builder::{
    build_train_graph, input_name, tied_input, tied_label, TrainGraph, TrainGraphOptions,
    TrainParam, PIPE_GRAD_IN, PIPE_GRAD_OUT, PIPE_LOSS, PIPE_TIED_PREFIX,
};

use serde::{Deserialize, Serialize};
use std::fmt;
use thiserror::Error;

/// Activation checkpointing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// Keep every activation the backward reads, the attention probabilities included
    /// (computed in the forward pass by `AttentionProbs`).
    #[default]
    None,
    /// Recompute each transformer layer's forward from its input in the backward pass (only
    /// the layer inputs are kept).
    Full,
    /// Recompute attention's scores and softmax in the backward pass (Korthikanti et al.
    /// 2022); keep everything else.
    Selective,
}

text_names!(Recompute { None => "none", Full => "full", Selective => "selective" });

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An error differentiating a graph.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AutodiffError {
    /// The forward graph uses an op (or operand form) with no gradient rule.
    #[error("no gradient for `{op}` (node `{node}`): {detail}")]
    NoGradient {
        /// Op mnemonic.
        op: &'static str,
        /// Node label.
        node: String,
        /// Which form is unsupported.
        detail: String,
    },
    /// The forward graph lacks what a training step needs.
    #[error("cannot train this graph: {0}")]
    Forward(String),
    /// Building a node failed (a bug: the rules produced an ill-typed node).
    #[error("internal error building `{node}`: {source}")]
    Build {
        /// Node label.
        node: String,
        /// The type error.
        #[source]
        source: crate::ir::IrError,
    },
}

#[cfg(test)]
mod tests;
