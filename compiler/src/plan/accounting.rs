//! The accounting a training plan carries: memory per rank at a precision, communication
//! volume per rank. Computed by the training compile (`train::memory_report`,
//! `train::comm_volume`); plain data here.

use serde::{Deserialize, Serialize};

/// Bytes per element of each kind of state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Precision {
    /// Per parameter element.
    pub param_bytes: u64,
    /// Per gradient element.
    pub grad_bytes: u64,
    /// Per parameter element of optimizer state.
    pub optimizer_bytes: u64,
    /// Per activation element.
    pub activation_bytes: u64,
}

impl Precision {
    /// Everything in f32 (the CPU reference): 4-byte parameters, gradients and activations;
    /// Adam's m and v (8 bytes).
    pub fn f32() -> Precision {
        Precision {
            param_bytes: 4,
            grad_bytes: 4,
            optimizer_bytes: 8,
            activation_bytes: 4,
        }
    }

    /// Mixed-precision Adam (ZeRO paper): 16-bit parameters, gradients and activations;
    /// fp32 master weights, momentum and variance (12 bytes).
    pub fn mixed() -> Precision {
        Precision {
            param_bytes: 2,
            grad_bytes: 2,
            optimizer_bytes: 12,
            activation_bytes: 2,
        }
    }

    /// The compute dtype of this precision: bf16 for 16-bit activations, else f32.
    pub fn dtype(&self) -> crate::ir::DType {
        if self.activation_bytes == 2 {
            crate::ir::DType::Bf16
        } else {
            crate::ir::DType::F32
        }
    }

    /// The precision of compute dtype `dtype`: mixed for 16-bit ones, f32 otherwise.
    pub fn of_dtype(dtype: crate::ir::DType) -> Precision {
        match dtype {
            crate::ir::DType::Bf16 | crate::ir::DType::F16 => Precision::mixed(),
            _ => Precision::f32(),
        }
    }
}

/// Activations one layer keeps for its backward pass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerActivations {
    /// The layer.
    pub layer: u32,
    /// Bytes per rank (one micro-batch).
    pub bytes: u64,
}

/// Memory per rank of one training step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainMemory {
    /// The precision the bytes are counted at.
    pub precision: Precision,
    /// Parameter elements per rank.
    pub param_elements: u64,
    /// Parameter bytes.
    pub param_bytes: u64,
    /// Gradient-buffer bytes.
    pub grad_bytes: u64,
    /// Optimizer-state bytes.
    pub optimizer_bytes: u64,
    /// Parameters + gradients + optimizer states.
    pub static_bytes: u64,
    /// Activations kept for backward (one micro-batch, all layers and outside them).
    pub activation_bytes: u64,
    /// The same, per transformer layer.
    pub activations_per_layer: Vec<LayerActivations>,
    /// Largest collective buffer.
    pub comm_buffer_bytes: u64,
    /// Peak over the step.
    pub peak_bytes: u64,
}

/// The collectives of one kind on one axis.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveVolume {
    /// Op mnemonic (`all_reduce`, ...).
    pub op: String,
    /// Mesh axis.
    pub axis: String,
    /// Ranks on the axis.
    pub ranks: usize,
    /// Number of collectives.
    pub count: usize,
    /// Σ of their sizes `N` (elements; the input of a reduce-scatter, the output of an
    /// all-gather).
    pub elements: u64,
    /// Elements one rank sends (ring algorithms), rounded down.
    pub sent_elements: u64,
    /// Bytes one rank sends.
    pub sent_bytes: u64,
}

/// Per-rank communication of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommVolume {
    /// By (op, axis), sorted.
    pub collectives: Vec<CollectiveVolume>,
    /// Σ elements sent by one rank.
    pub sent_elements: u64,
    /// Σ bytes sent by one rank.
    pub sent_bytes: u64,
}

impl CommVolume {
    /// Elements sent on `axis` (all kinds).
    pub fn sent_on(&self, axis: &str) -> u64 {
        self.collectives
            .iter()
            .filter(|c| c.axis == axis)
            .map(|c| c.sent_elements)
            .sum()
    }
}
