//! IR errors: shape and type mismatches, malformed graphs, text-form parse errors.

use super::{DType, ValueId};
use thiserror::Error;

/// An error building, verifying or parsing a graph.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum IrError {
    /// An op got the wrong number of operands.
    #[error("{op}: expected {expected} operand(s), found {found}")]
    Arity {
        /// Op mnemonic.
        op: &'static str,
        /// Expected count (text, e.g. "2" or "3 or 4").
        expected: &'static str,
        /// Found count.
        found: usize,
    },
    /// Operand shapes do not fit the op.
    #[error("{op}: {detail}")]
    Shape {
        /// Op mnemonic.
        op: &'static str,
        /// What does not fit, with the shapes.
        detail: String,
    },
    /// An operand has the wrong dtype.
    #[error("{op}: operand {operand} has dtype {found}, expected {expected}")]
    DType {
        /// Op mnemonic.
        op: &'static str,
        /// Operand index.
        operand: usize,
        /// Expected dtype.
        expected: DType,
        /// Found dtype.
        found: DType,
    },
    /// An operand refers to a value defined later (or not at all).
    #[error("node {node}: operand {operand} is not defined before it")]
    Undefined {
        /// The node.
        node: ValueId,
        /// The operand.
        operand: ValueId,
    },
    /// The declared type of a node differs from its inferred type.
    #[error("node {node} ({op}): declared type {declared} but operands give {inferred}")]
    TypeMismatch {
        /// The node.
        node: ValueId,
        /// Op mnemonic.
        op: &'static str,
        /// Declared type (text form).
        declared: String,
        /// Inferred type (text form).
        inferred: String,
    },
    /// Something else is wrong with the graph.
    #[error("invalid graph: {0}")]
    Invalid(String),
    /// Text form could not be parsed.
    #[error("parse error at line {line}: {msg}")]
    Parse {
        /// 1-based line.
        line: usize,
        /// What went wrong.
        msg: String,
    },
}
