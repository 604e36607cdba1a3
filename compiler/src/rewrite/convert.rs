//! Graph → e-graph, and an extraction → graph.
//!
//! Loading adds every node of the SPMD program as an e-node (leaves carry their index, so
//! none merge, and so does a node that repeats an earlier one) and records, per class, the original node's type, layout, name and layer.
//!
//! Emitting walks the chosen nodes from the outputs and lays them out in a priority
//! topological order: an original node keeps its index as priority, a node made by a rule goes
//! right after its latest operand. When no rule fired every class's chosen node is its
//! original node, so the emitted graph is the input graph, node for node (names, layers,
//! types, layouts and provenance included). New nodes are named like the partitioner names
//! them: a collective or local slice `<operand name>.<mnemonic>`, any other node after the
//! value it computes.

use super::analysis::{Meta, SpmdAnalysis, SpmdEGraph};
use super::extract::Extraction;
use super::lang::{ENode, OpKey};
use super::RewriteError;
use crate::ir::{Graph, Op, ValueId, ValueRole};
use crate::shard::{Provenance, ShardedGraph, TensorSharding};
use egg::Id;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// A program loaded into an e-graph.
pub(crate) struct Loaded {
    /// The e-graph (rebuilt).
    pub eg: SpmdEGraph,
    /// The outputs: name and class.
    pub roots: Vec<(String, Id)>,
    /// The e-node of each original node, by value id.
    pub originals: Vec<ENode>,
}

/// Loads `sg` into a fresh e-graph.
pub(crate) fn load(sg: &ShardedGraph) -> Loaded {
    let mut eg = SpmdEGraph::new(SpmdAnalysis::new(sg.mesh.clone()));
    let g = &sg.graph;
    let mut ids: Vec<Id> = Vec::with_capacity(g.len());
    let mut originals = Vec::with_capacity(g.len());
    for (v, node) in g.nodes.iter().enumerate() {
        let leaf = matches!(node.op, Op::Param(_) | Op::Input { .. }).then_some(v as u32);
        let key = OpKey {
            op: node.op.clone(),
            declared: node.op.needs_declared_type().then(|| node.ty.clone()),
            leaf,
        };
        let children: Vec<Id> = node.inputs.iter().map(|i| ids[i.index()]).collect();
        let mut enode = ENode::new(eg.analysis.ops.intern(key.clone()), children);
        if eg.lookup(enode.clone()).is_some() {
            // A node computing what an earlier one does (a ZeRO-3 re-gather of a parameter
            // for the backward pass, a recomputed activation) stays a node of its own: the
            // program frees and recomputes on purpose, and the round trip keeps it.
            let distinct = OpKey {
                leaf: Some(v as u32),
                ..key
            };
            enode.op = eg.analysis.ops.intern(distinct);
        }
        let existed = eg.lookup(enode.clone()).is_some();
        let id = eg.add(enode.clone());
        if !existed {
            let d = &mut eg[id].data;
            d.ty = node.ty.clone();
            if let Some(s) = sg.shardings.get(v) {
                d.sharding = s.clone();
            }
            d.meta = Meta {
                name: node.name.clone(),
                layer: node.layer,
                role: node.role,
                anchor: v as u32,
                seq: 0,
                original: true,
                derived: false,
            };
        }
        ids.push(id);
        originals.push(enode);
    }
    eg.rebuild();
    let roots = g
        .outputs
        .iter()
        .map(|(n, v)| (n.clone(), eg.find(ids[v.index()])))
        .collect();
    Loaded {
        eg,
        roots,
        originals,
    }
}

/// What the emitter knows about one emitted node, for the report.
#[derive(Clone, Debug)]
pub(crate) struct NodeNote {
    /// The class it was chosen for.
    pub class: Id,
    /// The rule that created the chosen e-node (`None`: an original node).
    pub rule: Option<&'static str>,
    /// For communicating nodes: the program's exact cost and the class's best alternative.
    pub choice: Option<(f64, Option<super::Alternative>)>,
}

/// An emitted program and its notes (one per node).
pub(crate) struct Emitted {
    /// The program with its side tables.
    pub sharded: ShardedGraph,
    /// One note per node.
    pub notes: Vec<NodeNote>,
}

/// Builds the program of the chosen nodes reachable from `roots`.
pub(crate) fn emit(
    eg: &SpmdEGraph,
    ex: &Extraction,
    roots: &[(String, Id)],
    src: &ShardedGraph,
    originals: &[ENode],
) -> Result<Emitted, RewriteError> {
    let canon =
        |n: &ENode| -> ENode { ENode::new(n.op, n.children.iter().map(|&c| eg.find(c)).collect()) };
    let mut original_of: HashMap<ENode, u32> = HashMap::new();
    for (i, n) in originals.iter().enumerate() {
        original_of.entry(canon(n)).or_insert(i as u32);
    }
    let mut rule_of: HashMap<ENode, &'static str> = HashMap::new();
    for (n, r) in &eg.analysis.origins {
        rule_of.entry(canon(n)).or_insert(r);
    }
    let root_ids: Vec<Id> = roots.iter().map(|(_, r)| eg.find(*r)).collect();
    let needed = ex.reachable(eg, &root_ids);
    let mut chosen: HashMap<Id, (ENode, Option<u32>)> = HashMap::new();
    for &c in &needed {
        let n = ex
            .choice
            .get(&c)
            .ok_or_else(|| RewriteError::Internal(format!("class {c} has no extracted node")))?;
        let n = canon(n);
        let orig = original_of.get(&n).copied();
        chosen.insert(c, (n, orig));
    }
    // Kahn's algorithm with priorities.
    let key = |c: Id| -> (u32, u32) {
        match chosen[&c].1 {
            Some(i) => (i, 0),
            None => (eg[c].data.meta.anchor, eg[c].data.meta.seq.max(1)),
        }
    };
    let mut waiting: HashMap<Id, usize> = HashMap::new();
    let mut users: HashMap<Id, Vec<Id>> = HashMap::new();
    for &c in &needed {
        let mut kids = chosen[&c].0.children.clone();
        kids.sort();
        kids.dedup();
        waiting.insert(c, kids.len());
        for k in kids {
            users.entry(k).or_default().push(c);
        }
    }
    let mut ready: BinaryHeap<Reverse<((u32, u32), Id)>> = needed
        .iter()
        .filter(|c| waiting[c] == 0)
        .map(|&c| Reverse((key(c), c)))
        .collect();
    let mut out = Graph::new();
    let mut shardings: Vec<TensorSharding> = Vec::new();
    let mut provenance: Vec<Option<Provenance>> = Vec::new();
    let mut notes: Vec<NodeNote> = Vec::new();
    let mut value: HashMap<Id, ValueId> = HashMap::new();
    while let Some(Reverse((_, c))) = ready.pop() {
        let (node, orig) = &chosen[&c];
        let op = eg.analysis.ops.get(node.op).op.clone();
        let inputs: Vec<ValueId> = node.children.iter().map(|k| value[k]).collect();
        let (ty, name, (layer, role), sharding, prov) = match orig {
            Some(i) => {
                let n = &src.graph.nodes[*i as usize];
                let s = src.shardings.get(*i as usize).cloned();
                let p = src.provenance.get(*i as usize).cloned().flatten();
                let s = s.unwrap_or_else(|| eg[c].data.sharding.clone());
                (n.ty.clone(), n.name.clone(), (n.layer, n.role), s, p)
            }
            None => {
                let d = &eg[c].data;
                let first = inputs.first().map(|&v| out.node(v));
                let (name, tag) = match first {
                    Some(f) if op.is_collective() || matches!(op, Op::LocalSlice { .. }) => {
                        (format!("{}.{}", f.name, op.mnemonic()), (f.layer, f.role))
                    }
                    _ => (d.meta.name.clone(), (d.meta.layer, d.meta.role)),
                };
                let prov = op.communicates().then(|| {
                    let from = inputs
                        .first()
                        .map(|&v| shardings[v.index()].display(&src.mesh))
                        .unwrap_or_default();
                    Provenance {
                        value: first.map(|f| f.name.clone()).unwrap_or_default(),
                        from,
                        to: d.sharding.display(&src.mesh),
                        required_by: crate::shard::ReshardReason::Rule {
                            rule: rule_of.get(node).copied().unwrap_or("?").to_string(),
                        },
                    }
                });
                (d.ty.clone(), name, tag, d.sharding.clone(), prov)
            }
        };
        out.current_layer = layer;
        out.current_role = role;
        let v = out
            .add_typed(op, &inputs, Some(ty), name.clone())
            .map_err(|e| RewriteError::Internal(format!("emitting `{name}`: {e}")))?;
        value.insert(c, v);
        shardings.push(sharding);
        provenance.push(prov);
        notes.push(NodeNote {
            class: c,
            rule: if orig.is_some() {
                None
            } else {
                rule_of.get(node).copied()
            },
            choice: None,
        });
        for &u in users.get(&c).into_iter().flatten() {
            let w = waiting
                .get_mut(&u)
                .expect("invariant: users are needed classes");
            *w -= 1;
            if *w == 0 {
                ready.push(Reverse((key(u), u)));
            }
        }
    }
    if value.len() != needed.len() {
        return Err(RewriteError::Internal(
            "the extracted program has a cycle".into(),
        ));
    }
    out.current_layer = None;
    out.current_role = ValueRole::Forward;
    for ((name, _), r) in roots.iter().zip(&root_ids) {
        out.set_output(name, value[r]);
    }
    crate::ir::verify_if_debug(&out, "rewrite");
    Ok(Emitted {
        sharded: ShardedGraph {
            graph: out,
            shardings,
            provenance,
            mesh: src.mesh.clone(),
        },
        notes,
    })
}
