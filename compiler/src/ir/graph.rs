//! `Graph`: a list of nodes in topological order, each producing one typed value.
//!
//! Invariant (checked by [`crate::ir::verify`]): every operand of node `i` is a node `j < i`,
//! and each node's type equals what its op infers from its operands.

use super::{IrError, Op, ParamSource, TensorType, ValueId, ValueRole};
use serde::{Deserialize, Serialize};

/// One node: an op over earlier values, its result type, and labels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The op.
    pub op: Op,
    /// Operands, all defined earlier.
    pub inputs: Vec<ValueId>,
    /// Result type.
    pub ty: TensorType,
    /// A readable label (`layers.0.attn.q_proj`); may be empty.
    pub name: String,
    /// The transformer layer this node belongs to, when it belongs to one.
    pub layer: Option<u32>,
    /// The part of a training step it belongs to (forward when not given).
    #[serde(default, skip_serializing_if = "ValueRole::is_forward")]
    pub role: ValueRole,
}

/// A tensor program: nodes in topological order and named outputs. Equality compares nodes
/// and outputs (not the builder's `current_layer` and `current_role`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Graph {
    /// Nodes; a node's index is its `ValueId`.
    pub nodes: Vec<Node>,
    /// Named outputs, in order.
    pub outputs: Vec<(String, ValueId)>,
    /// Layer label given to nodes added from now on (builders set it).
    #[serde(skip)]
    pub current_layer: Option<u32>,
    /// Role given to nodes added from now on (builders and passes set it).
    #[serde(skip)]
    pub current_role: ValueRole,
}

impl PartialEq for Graph {
    fn eq(&self, other: &Graph) -> bool {
        self.nodes == other.nodes && self.outputs == other.outputs
    }
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node producing `v`.
    pub fn node(&self, v: ValueId) -> &Node {
        &self.nodes[v.index()]
    }

    /// The type of `v`.
    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.nodes[v.index()].ty
    }

    /// All value ids in order.
    pub fn ids(&self) -> impl Iterator<Item = ValueId> + '_ {
        (0..self.nodes.len() as u32).map(ValueId)
    }

    /// Appends a node whose type is inferred from its operands.
    pub fn add(
        &mut self,
        op: Op,
        inputs: &[ValueId],
        name: impl Into<String>,
    ) -> Result<ValueId, IrError> {
        self.add_typed(op, inputs, None, name)
    }

    /// Appends a node; `ty` is required for ops with declared types and checked for the others.
    pub fn add_typed(
        &mut self,
        op: Op,
        inputs: &[ValueId],
        ty: Option<TensorType>,
        name: impl Into<String>,
    ) -> Result<ValueId, IrError> {
        let id = ValueId(self.nodes.len() as u32);
        for &i in inputs {
            if i.index() >= self.nodes.len() {
                return Err(IrError::Undefined {
                    node: id,
                    operand: i,
                });
            }
        }
        let tys: Vec<&TensorType> = inputs.iter().map(|&i| self.ty(i)).collect();
        let inferred = op.infer(&tys, ty.as_ref())?;
        if let Some(t) = &ty {
            if !op.needs_declared_type() && !t.same_shape(&inferred) {
                return Err(IrError::TypeMismatch {
                    node: id,
                    op: op.mnemonic(),
                    declared: t.to_string(),
                    inferred: inferred.to_string(),
                });
            }
        }
        let ty = match ty {
            // Keep declared roles (builders name dims more precisely than inference).
            Some(t) if t.dtype == inferred.dtype => t,
            Some(t) => {
                return Err(IrError::TypeMismatch {
                    node: id,
                    op: op.mnemonic(),
                    declared: t.to_string(),
                    inferred: inferred.to_string(),
                })
            }
            None => inferred,
        };
        self.nodes.push(Node {
            op,
            inputs: inputs.to_vec(),
            ty,
            name: name.into(),
            layer: self.current_layer,
            role: self.current_role,
        });
        Ok(id)
    }

    /// Appends a graph input.
    pub fn input(&mut self, name: &str, ty: TensorType) -> ValueId {
        self.leaf(
            Op::Input {
                name: name.to_string(),
                shards: Vec::new(),
            },
            name,
            ty,
        )
    }

    /// Appends the whole, unsharded parameter `name` of type `ty` (a leaf).
    pub fn param(&mut self, name: &str, ty: TensorType) -> ValueId {
        self.leaf(Op::Param(ParamSource::whole(name)), name, ty)
    }

    fn leaf(&mut self, op: Op, name: &str, ty: TensorType) -> ValueId {
        self.add_typed(op, &[], Some(ty), name)
            .expect("invariant: a leaf has no operands")
    }

    /// Names `v` as an output.
    pub fn set_output(&mut self, name: &str, v: ValueId) {
        self.outputs.push((name.to_string(), v));
    }

    /// The output named `name`.
    pub fn output(&self, name: &str) -> Option<ValueId> {
        self.outputs
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, v)| v)
    }

    /// The input node named `name`.
    pub fn input_named(&self, name: &str) -> Option<ValueId> {
        self.ids()
            .find(|&v| matches!(&self.node(v).op, Op::Input { name: n, .. } if n == name))
    }

    /// For each value, the nodes that use it (in order, with repeats for repeated operands).
    pub fn users(&self) -> Vec<Vec<ValueId>> {
        let mut users = vec![Vec::new(); self.nodes.len()];
        for v in self.ids() {
            for &i in &self.node(v).inputs {
                users[i.index()].push(v);
            }
        }
        users
    }

    /// For each value, the index of the last node that reads it (its own index when none
    /// does; `len()` for an output, which lives to the end): the end of its live range.
    pub fn last_uses(&self) -> Vec<usize> {
        let n = self.nodes.len();
        let mut last = vec![0usize; n];
        for v in self.ids() {
            last[v.index()] = v.index();
            for &i in &self.node(v).inputs {
                last[i.index()] = v.index();
            }
        }
        for (_, v) in &self.outputs {
            last[v.index()] = n;
        }
        last
    }

    /// Param nodes, in order.
    pub fn params(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.ids()
            .filter(|&v| matches!(self.node(v).op, Op::Param(_)))
    }
}
