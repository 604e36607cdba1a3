//! Model import: HuggingFace `config.json` → [`ModelConfig`] → forward [`crate::ir::Graph`],
//! plus the analytic statistics `shardc inspect` prints.

mod build;
mod config;
mod stats;

pub use build::{build_forward, BuildOptions, StageSpec, STAGE_INPUT, STAGE_OUTPUT};
pub use config::{Arch, ModelConfig, ModelError, MoeConfig, NormKind};
pub use stats::{ModelStats, ParamGroup};
