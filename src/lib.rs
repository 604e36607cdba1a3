//! shardc: a compiler and runtime for sharded transformer execution.
//!
//! This facade re-exports the workspace crates; the `shardc` binary (in `main.rs` and `cli/`)
//! only parses arguments and prints.

pub use shardc_compiler as compiler;
pub use shardc_kernels as kernels;
pub use shardc_runtime as runtime;
