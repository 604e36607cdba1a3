//! The tensor IR: typed values produced by ops in a [`Graph`], a text form that prints and
//! parses back, and a verifier run after every pass.

mod error;
mod fused;
mod grad;
mod graph;
mod ids;
mod op;
mod role;
mod text;
mod types;
mod verify;

pub use error::IrError;
pub use fused::{EwExpr, EwStep};
pub use grad::{AdamWError, AdamWSpec, AttnWrt, CombineWrt, NormWrt};
pub use graph::{Graph, Node};
pub use ids::{Float, ValueId};
pub use op::{
    dims, AttnSpec, AxisName, Op, ParamSource, ParamView, RingMatMul, RopeScaling, RopeSpec,
    RopeStyle, SeqOrder, ShardSpec, UnaryOp, CROSS_ENTROPY_STATS,
};
pub use role::ValueRole;
pub use text::parse_graph;
pub use types::{DType, Dim, Role, TensorType};
pub use verify::{verify, verify_if_debug};
