//! Sharding: device mesh, per-tensor layouts, one factor rule per op, SPMD partitioning with
//! `reshard` as the one place collectives are created, and strategy presets.

mod mesh;
mod partition;
mod presets;
mod reshard;
mod rules;
mod sharding;
#[cfg(test)]
mod vocab_tests;

pub use mesh::{AxisId, LinkClass, Mesh, MeshAxis, MeshError, DATA_AXES, KNOWN_AXES};
pub(crate) use partition::ShardedBuilder;
pub use partition::{partition, Annotations, Provenance, ReshardReason, ShardedGraph};
pub(crate) use presets::data_axes;
pub use presets::{
    annotate, check_model, cp_build_order, cp_layout, kv_repeat, resolve, resolve_stage, CpAlgo,
    CpLayout, Strategy,
};
pub use reshard::{apply_public as apply_reshard_step, reshard};
pub use rules::{rule, FactorRule, PartialRule};
pub use sharding::TensorSharding;

use thiserror::Error;

/// An error sharding a model.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ShardError {
    /// A model dimension does not divide over a mesh axis.
    #[error("{what}={size} is not divisible by {axis}={parts}")]
    ModelIndivisible {
        /// The model dimension (`heads`, `vocab`, `batch`, ...).
        what: String,
        /// Its size.
        size: usize,
        /// The mesh axis.
        axis: String,
        /// The axis size.
        parts: usize,
    },
    /// An annotated tensor does not divide.
    #[error("tensor `{tensor}`: dim {dim}={size} is not divisible by {axes} ({parts} parts)")]
    Indivisible {
        /// Tensor (node label).
        tensor: String,
        /// Dim role.
        dim: String,
        /// Dim size.
        size: usize,
        /// Axes, `tp=3`.
        axes: String,
        /// Product of their sizes.
        parts: usize,
    },
    /// Unknown strategy name.
    #[error("unknown strategy `{name}`; valid strategies: {valid}")]
    UnknownStrategy {
        /// The name.
        name: String,
        /// Valid names.
        valid: String,
    },
    /// Two strategies that exclude each other (two ZeRO stages, two context-parallel
    /// variants).
    #[error("--strategy: `{first}` and `{second}` conflict: {choose}")]
    ConflictingStrategies {
        /// One strategy.
        first: String,
        /// The other.
        second: String,
        /// What to choose instead.
        choose: String,
    },
    /// Mesh error.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// Not supported in this version.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A compiler invariant failed (a bug).
    #[error("internal error: {0}")]
    Internal(String),
}
