//! Runtime errors: checkpoint loading, graph inputs, data validation, collectives and kernels.
//!
//! Every variant carries the structured facts a user needs to fix the problem (tensor and
//! input names, expected and found shapes, the node and collective that failed). Shapes are
//! printed as `[2, 16, 64]`.

use crate::comm::CommError;
use shardc_compiler::ir::{DType, IrError, ValueId};
use std::path::PathBuf;
use thiserror::Error;

/// An error loading weights or executing a graph.
#[derive(Debug, Error)]
pub enum RuntimeError {
    /// A stored tensor named by a parameter is not in the checkpoint.
    #[error("tensor `{name}` not found in checkpoint {}", file.display())]
    MissingTensor {
        /// Stored tensor name.
        name: String,
        /// The checkpoint (file, directory or index) that was searched.
        file: PathBuf,
    },
    /// A stored tensor's shape does not fit the parameter that reads it. Both shapes are in
    /// the checkpoint's (stored, unsharded) layout.
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    TensorShape {
        /// Stored tensor name (the name template for a stacked parameter).
        name: String,
        /// The shape the graph needs.
        expected: Vec<usize>,
        /// The shape in the checkpoint.
        found: Vec<usize>,
    },
    /// A stored tensor has a dtype that does not load as the parameter's dtype.
    #[error(
        "tensor `{name}` is stored as {dtype}; only F32, BF16 and F16 load as float parameters"
    )]
    TensorDType {
        /// Stored tensor name.
        name: String,
        /// The stored dtype (safetensors name, e.g. `I64`).
        dtype: String,
    },
    /// A stored tensor holds NaN or infinite values (refused at load: they would only turn
    /// into NaN outputs, losses and checkpoints).
    #[error(
        "{}: tensor {name} has {count} non-finite value{} (first at index {first}: {value})",
        file.display(),
        if *count == 1 { "" } else { "s" }
    )]
    NonFiniteWeight {
        /// The safetensors file holding it.
        file: PathBuf,
        /// Stored tensor name.
        name: String,
        /// How many of its elements are NaN or ±inf.
        count: usize,
        /// Flat (row-major, stored layout) index of the first.
        first: usize,
        /// Its value.
        value: f32,
    },
    /// A parameter is declared with a dtype the loader cannot produce.
    #[error("parameter `{name}` is declared {dtype}; only float parameters can be loaded")]
    ParamDType {
        /// Stored tensor name.
        name: String,
        /// Declared dtype.
        dtype: DType,
    },
    /// A file could not be opened, read or mapped.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A file is not a valid safetensors file.
    #[error("{}: invalid safetensors file: {source}", path.display())]
    SafeTensors {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A safetensors file whose header does not describe its bytes (too short, a header
    /// length past the end, a tensor whose dtype × shape disagrees with its offsets, data
    /// missing or left over).
    #[error("{}: invalid safetensors file: {msg}", path.display())]
    BadCheckpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the tensor where one is at fault.
        msg: String,
    },
    /// A sharded checkpoint's index file is not valid JSON with a `weight_map`.
    #[error("{}: invalid checkpoint index: {source}", path.display())]
    Index {
        /// The index file.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// A directory holds neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{}: no model.safetensors or model.safetensors.index.json", path.display())]
    NoCheckpoint {
        /// The directory.
        path: PathBuf,
    },
    /// A graph input was not supplied by the caller.
    #[error("input `{name}` was not supplied")]
    MissingInput {
        /// Input name.
        name: String,
    },
    /// A graph input has the wrong (global) shape.
    #[error("input `{name}`: expected shape {expected:?}, found {found:?}")]
    InputShape {
        /// Input name.
        name: String,
        /// The global shape the graph expects.
        expected: Vec<usize>,
        /// The shape supplied.
        found: Vec<usize>,
    },
    /// A graph input has the wrong element type.
    #[error("input `{name}`: expected {expected} data, found {found}")]
    InputDType {
        /// Input name.
        name: String,
        /// The graph's dtype (float dtypes take f32 data).
        expected: DType,
        /// The supplied buffer's type (`f32` or `i32`).
        found: &'static str,
    },
    /// A token id is outside an (unsharded) embedding table.
    #[error("token id {id} at batch {batch}, position {pos} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: i32,
        /// Rows of the table.
        vocab: usize,
        /// Index along the first dim of the ids.
        batch: usize,
        /// Flat index within the rest of the ids' dims.
        pos: usize,
    },
    /// A cross-entropy label is ≥ the vocabulary size.
    #[error("label {label} at batch {batch}, position {pos} is outside the vocabulary of {vocab}")]
    LabelOutOfRange {
        /// The label.
        label: i32,
        /// The vocabulary size (the logits' last dim; times the shards of a cross-entropy
        /// split over the vocabulary).
        vocab: usize,
        /// Index along the first dim of the labels.
        batch: usize,
        /// Flat index within the rest of the labels' dims.
        pos: usize,
    },
    /// A micro-batch's loss (a `CrossEntropy` or `CrossEntropyFromStats` node) is NaN or infinite: training diverged
    /// or its inputs are poisoned.
    #[error("micro-batch {micro}: loss is {value}")]
    NonFiniteLoss {
        /// The micro-batch (0-based; the node's `mb<k>.` prefix, 0 without one).
        micro: usize,
        /// The loss (this rank's partial sum of it, where the loss is split over ranks).
        value: f32,
    },
    /// A collective failed.
    #[error("node {node} `{name}` ({op}): {source}")]
    Comm {
        /// The collective's node.
        node: ValueId,
        /// The node's label.
        name: String,
        /// The collective's mnemonic (`all_gather`, ...).
        op: &'static str,
        /// The communicator's error (boxed to keep `RuntimeError` small).
        #[source]
        source: Box<CommError>,
    },
    /// A mesh axis used by the graph has no communicator in the rank context.
    #[error("mesh axis `{axis}` is not in this rank's context")]
    MissingAxis {
        /// The axis.
        axis: String,
    },
    /// A mesh axis has another size than the graph assumes.
    #[error("mesh axis `{axis}` has {found} ranks but the graph splits it into {expected}")]
    AxisSize {
        /// The axis.
        axis: String,
        /// The size named by the graph.
        expected: usize,
        /// The communicator's size.
        found: usize,
    },
    /// A kernel's operand shapes do not fit the op.
    #[error("{op}: operand shapes {shapes:?}: {reason}")]
    Shape {
        /// Op mnemonic.
        op: &'static str,
        /// Shapes of the operands.
        shapes: Vec<Vec<usize>>,
        /// What does not fit.
        reason: &'static str,
    },
    /// A kernel's operand has the wrong element type.
    #[error("{op}: operand {operand} must be {expected}, found {found}")]
    OperandDType {
        /// Op mnemonic.
        op: &'static str,
        /// Operand index.
        operand: usize,
        /// Expected buffer type (`f32` or `i32`).
        expected: &'static str,
        /// Found buffer type.
        found: &'static str,
    },
    /// A node computed a value whose shape or element type differs from its declared type.
    #[error("node {node} `{name}`: computed {found_dtype}{found:?} but the graph declares {expected_dtype}{expected:?}")]
    NodeType {
        /// The node.
        node: ValueId,
        /// Its label.
        name: String,
        /// Declared dtype.
        expected_dtype: DType,
        /// Declared shape.
        expected: Vec<usize>,
        /// Computed buffer type (`F32` or `I32`: float dtypes are held as f32).
        found_dtype: DType,
        /// Computed shape.
        found: Vec<usize>,
    },
    /// The graph is malformed (an operand defined after its user, ...).
    #[error("invalid graph: {0}")]
    Graph(#[from] IrError),
    /// A parameter node has no tensor in the [`crate::ParamCache`] passed in.
    #[error("node {node} `{name}`: parameter not in the cache (was it loaded for this graph?)")]
    ParamNotLoaded {
        /// The node.
        node: ValueId,
        /// Its label.
        name: String,
    },
    /// A graph output names a value the graph does not define.
    #[error("output `{name}` refers to undefined value {value}")]
    BadOutput {
        /// Output name.
        name: String,
        /// The value.
        value: ValueId,
    },
    /// The op (or this use of it) is not supported by the backend.
    #[error("{op}: unsupported: {detail}")]
    Unsupported {
        /// Op mnemonic.
        op: &'static str,
        /// What is unsupported.
        detail: String,
    },
    /// A kernel error, with the node it happened in.
    #[error("node {node} `{name}`: {source}")]
    InNode {
        /// The node.
        node: ValueId,
        /// Its label.
        name: String,
        /// The kernel's error.
        #[source]
        source: Box<RuntimeError>,
    },
    /// A pipeline transfer between stages failed (a peer stopped, timed out, or sent
    /// something else).
    #[error("pipeline {op}: {detail}")]
    Pipeline {
        /// The transfer, e.g. `recv activation of micro-batch 3 (boundary 1) from rank 0`.
        op: String,
        /// What went wrong.
        detail: String,
    },
}

#[cfg(test)]
mod tests {
    /// Every fallible runtime call returns `Result<_, RuntimeError>`, and callers wrap it
    /// (rank errors): keep it small (large payloads are boxed).
    #[test]
    fn runtime_error_stays_small() {
        assert!(std::mem::size_of::<super::RuntimeError>() <= 80);
    }
}
