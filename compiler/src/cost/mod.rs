//! The cost model and simulator (DESIGN §7): device and cluster profiles as data, a roofline
//! per kernel, alpha-beta collectives, a discrete-event replay of plans over every rank, a
//! training step model, a memory model, and a Chrome-trace writer.
//!
//! Two layers:
//!
//! - [`simulate_plan`] replays a compiled plan: every rank's steps on its compute and
//!   communication streams, events between them, collectives that synchronise their group,
//!   kernel times from the roofline and a memory timeline from liveness ([`replay`]).
//! - [`simulate_training`] models one training step from one layer's plan: the layer's
//!   forward replayed, its backward derived from it ([`Program::derive_backward`]),
//!   recomputation, data-parallel gradient synchronisation with ZeRO, the optimizer, and the
//!   pipeline schedule ([`PipeSchedule`]: any of [`crate::schedule::pp`]'s, replayed by that
//!   module's one event-driven replay with the simulated pass durations). Repeated layers are
//!   simulated once, which keeps a 1,024-GPU step well under a second.
//!
//! The seam for real training plans: once `autodiff/` emits forward + backward + optimizer
//! graphs and `schedule/` pipelines them, [`Program::from_steps`] reads those plans as they are
//! and [`replay`] runs them; [`Program::derive_backward`] and the analytic parts of
//! [`simulate_training`] are what they replace.
//!
//! ```
//! use shardc_compiler::cost::{Cluster, CollectiveKind, GroupTopology, collective_time};
//! use shardc_compiler::cost::Bytes;
//! let c = Cluster::resolve("dgx-h100x2").unwrap();
//! let t = collective_time(&c, CollectiveKind::AllReduce, Bytes(1 << 30), GroupTopology::intra(8));
//! assert!(t.0 > 0.0 && t.0 < 0.01);
//! ```

mod calibrate;
mod collective;
mod memory;
mod pipe;
mod pipeplan;
mod profile;
mod program;
mod published;
mod replay;
mod report;
mod roofline;
mod simulate;
mod trace;
mod train;
mod units;

pub use calibrate::{
    fit_profile, fit_profile_report, CollectiveSample, CopySample, GemmSample, Measurements,
    ProfileFit, MAX_OVERSHOOT,
};
pub use collective::{
    collective_time, ring_time, tree_allreduce_time, CollectiveKind, GroupTopology, Link,
};
pub use memory::{
    korthikanti_per_layer, saved_activations, zero_static, MemoryBreakdown, Recompute, SavedOptions,
};
pub use pipe::PipeSchedule;
pub use pipeplan::simulate_pipeline_plan;
pub use profile::{
    Cluster, ClusterProfile, DeviceProfile, Efficiency, PeakFlops, Sourced, BUILTIN_PROFILES,
};
pub use program::{collective_bytes, Grad, ProgKind, ProgOp, Program, Work, COMM, COMPUTE};
pub use published::{gpt_config, megatron_flops_per_step, MegatronRun, MEGATRON_SC21_TABLE1};
pub use replay::{replay, OpTime, RankReplay, Replay, Topology};
pub use report::{SimReport, Simulation, Slice, StageReport, Timeline};
pub use roofline::{
    fused_into_consumer, gemm_efficiency, is_expert_major, kernel_time, node_cost,
    node_cost_routed, routed_fraction, AttentionImpl, ComputeOptions, GemmClass, GemmShape, Kernel,
    NodeCost,
};
pub use simulate::{forward_plan_memory, simulate_plan};
pub use trace::{chrome_trace, timelines_trace};
pub use train::{
    layer_plan_spec, simulate_training_on, LayerPlanSpec, StepBound, TrainMemo, TrainOptions,
};
pub use units::{Bytes, Seconds};

use thiserror::Error;

/// An error of the cost model or simulator.
#[derive(Debug, Error)]
pub enum CostError {
    /// A profile could not be read or is invalid.
    #[error("profile `{profile}`: {msg}")]
    Profile {
        /// Name or path.
        profile: String,
        /// What is wrong.
        msg: String,
    },
    /// No such profile.
    #[error("unknown profile `{name}`; {valid}")]
    UnknownProfile {
        /// What was asked for.
        name: String,
        /// What exists.
        valid: String,
    },
    /// The mesh needs more GPUs than the cluster has.
    #[error("mesh {mesh} needs {needed} GPUs; cluster {cluster} has {available} (add nodes: `--cluster {name}x{nodes}`)")]
    TooFewGpus {
        /// The mesh.
        mesh: String,
        /// Its world size.
        needed: usize,
        /// The cluster label.
        cluster: String,
        /// GPUs in it.
        available: usize,
        /// Cluster profile name.
        name: String,
        /// Nodes that would suffice.
        nodes: usize,
    },
    /// A model dimension does not divide as the training configuration needs.
    #[error("{what}={size} is not divisible by {by}={parts}")]
    Indivisible {
        /// The dimension (`layers`, `global batch`, ...).
        what: String,
        /// Its size.
        size: usize,
        /// What divides it (`pp*v`, `dp*micro-batch`).
        by: String,
        /// The divisor.
        parts: usize,
    },
    /// A mesh axis the training model does not simulate.
    #[error("mesh axis `{axis}` (size {size}) is not simulated in training mode; supported axes: dp, tp, pp, ep, cp (fsdp is `--strategy fsdp` on dp)")]
    UnsupportedAxis {
        /// Axis name.
        axis: String,
        /// Its size.
        size: usize,
    },
    /// The replay could not finish.
    #[error("replay: {0}")]
    Replay(String),
    /// The training configuration is invalid.
    #[error("training: {0}")]
    Train(String),
    /// A model the cost model reads is unusable.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// Calibration data is unusable.
    #[error("calibration: {0}")]
    Calibrate(String),
}

impl From<crate::schedule::pp::PipelineError> for CostError {
    fn from(e: crate::schedule::pp::PipelineError) -> CostError {
        CostError::Replay(e.to_string())
    }
}
