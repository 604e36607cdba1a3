//! shardc-compiler: the tensor IR, model import, sharding, rewriting, planning and cost model.
//! No GPU dependency.
#![deny(missing_docs)]

pub mod autodiff;
pub mod checkpoint;
pub mod compile;
pub mod cost;
pub mod ir;
pub mod model;
pub mod pass;
pub mod plan;
pub mod rewrite;
pub mod schedule;
pub mod search;
pub mod shard;
pub mod train;
