//! shardc-runtime: executes graphs and plans. The CPU backend is the reference (every rank a
//! thread); communicators implement the collectives.

pub mod checkpoint;
pub mod comm;
mod cpu;
pub mod cuda;
mod error;
mod exec;
pub mod launch;
mod micro;
pub mod output;
pub mod pipeline;
mod plan_run;
mod rank;
pub mod spmd;
pub mod tensor;
pub mod train;
mod weights;

pub use cpu::eval_op;
pub use error::RuntimeError;
pub use exec::{execute, execute_with_params, load_params, ParamCache, RankCtx, Stepwise};
pub use plan_run::{check_inputs, check_weights, execute_plan, PlanRunError};
pub use tensor::{Buffer, Tensor};
pub use weights::Weights;
