//! The e-graph language: one e-node kind per IR op instance, children are e-classes.
//!
//! An [`ENode`] is an interned op ([`OpId`], an index into the [`OpTable`]) plus its operand
//! classes in order. Interning keeps e-nodes small, `Ord` and cheap to hash, while the op
//! itself (with all its attributes) stays the IR's [`Op`]. The interned key carries what the
//! node's identity needs beyond the op: the declared type of ops whose type does not follow
//! from their operands (`Reshape`, `Param`, `Input`), and for leaves (`Param`, `Input`) the
//! index of the original node, so that two parameter nodes never merge by hash-consing (a
//! round trip keeps every node of the input graph).
//!
//! Op ids are given in insertion order, so the same input always interns to the same ids
//! (the e-graph's `deterministic` feature does the rest).

use crate::ir::{Op, TensorType};
use egg::{Id, Language};
use std::collections::HashMap;
use std::fmt;

/// An interned op. Displays as `o12`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u32);

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "o{}", self.0)
    }
}

/// What an [`OpId`] stands for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OpKey {
    /// The IR op with its attributes.
    pub op: Op,
    /// The node's declared type, for ops that need one (`Reshape`, `Param`, `Input`).
    pub declared: Option<TensorType>,
    /// For leaves, and nodes repeating an earlier node: the index of the original node, so
    /// they stay distinct.
    pub leaf: Option<u32>,
}

/// The op interner. Lookups go through a hash map; nothing iterates it, so its order never
/// affects a result.
#[derive(Clone, Debug, Default)]
pub struct OpTable {
    keys: Vec<OpKey>,
    ids: HashMap<OpKey, OpId>,
}

impl OpTable {
    /// The id of `key`, interning it if new.
    pub fn intern(&mut self, key: OpKey) -> OpId {
        if let Some(&id) = self.ids.get(&key) {
            return id;
        }
        let id = OpId(self.keys.len() as u32);
        self.keys.push(key.clone());
        self.ids.insert(key, id);
        id
    }

    /// The id of a computed op (no declared type, not a leaf).
    pub fn op(&mut self, op: Op) -> OpId {
        self.intern(OpKey {
            op,
            declared: None,
            leaf: None,
        })
    }

    /// What `id` stands for.
    pub fn get(&self, id: OpId) -> &OpKey {
        &self.keys[id.0 as usize]
    }

    /// Number of interned ops.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// True when nothing is interned.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// An e-node: an interned op applied to operand classes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ENode {
    /// The op.
    pub op: OpId,
    /// Operand classes, in operand order.
    pub children: Vec<Id>,
}

impl ENode {
    /// An e-node.
    pub fn new(op: OpId, children: Vec<Id>) -> ENode {
        ENode { op, children }
    }
}

impl Language for ENode {
    type Discriminant = OpId;

    fn discriminant(&self) -> OpId {
        self.op
    }

    fn matches(&self, other: &Self) -> bool {
        self.op == other.op && self.children.len() == other.children.len()
    }

    fn children(&self) -> &[Id] {
        &self.children
    }

    fn children_mut(&mut self) -> &mut [Id] {
        &mut self.children
    }
}

impl fmt::Display for ENode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.op)?;
        for c in &self.children {
            write!(f, " {c}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interning_is_stable_and_distinguishes_leaves() {
        let mut t = OpTable::default();
        let a = t.op(Op::Add);
        let m = t.op(Op::Mul);
        assert_eq!(t.op(Op::Add), a);
        assert_ne!(a, m);
        let leaf = |i| OpKey {
            op: Op::Softmax,
            declared: None,
            leaf: Some(i),
        };
        let l0 = t.intern(leaf(0));
        let l1 = t.intern(leaf(1));
        assert_ne!(l0, l1);
        assert_eq!(t.len(), 4);
        assert_eq!(t.get(m).op, Op::Mul);
        assert_eq!(OpId(3).to_string(), "o3");
    }
}
