//! Model import: HuggingFace `config.json` → [`ModelConfig`] → forward [`crate::ir::Graph`],
//! plus the analytic statistics `shardc inspect` prints, and the limits on sizes and memory
//! every command checks before building anything.

mod budget;
mod build;
mod config;
mod limits;
mod stats;

pub use build::{build_forward, BuildOptions, ForwardOutput, StageSpec, STAGE_INPUT, STAGE_OUTPUT};
pub use config::{Arch, ModelConfig, ModelError, MoeConfig, NormKind};
pub use limits::{
    check_budget, human_bytes, parse_size, product, scale_to_unit, schedule_bytes,
    simulated_pipeline_bytes, CapSource, IrWork, LimitError, MemoryCap, ACCOUNTING_LIMIT, MAX_DIM,
    MAX_LAYERS, MAX_MEMORY_ENV, MAX_PARAMS, MAX_RANKS,
};
pub use stats::{ModelStats, ParamGroup};
