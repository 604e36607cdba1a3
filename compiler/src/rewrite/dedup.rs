//! Repeated layers planned once.
//!
//! A program splits into a prefix (untagged nodes that no layer node feeds), one block per
//! layer (nodes tagged with the layer), and a suffix (the other untagged nodes). It is a
//! *chain* when each block reads only the prefix and the block before it, and the suffix only
//! the prefix and the last block. Blocks are *identical* when their signatures match: every
//! node's op, type and operands, with parameter names left out, `layers.<l>.` in labels read
//! as `layers.#.`, operands from the previous block numbered by first use, and operands from
//! the prefix by their index.
//!
//! With at least four layers, blocks `1..L` identical and their reads from the previous block
//! at the same positions, the rewriter plans a *window* instead of the program: the prefix,
//! layers `0`, `1` and `L−1` (the last one reading layer 1 where it read layer `L−2`), and the
//! suffix. Layer 1 of the planned window is the template: [`Plan::expand`] replicates it for
//! layers `1..L−1`, each copy with its own layer's parameters, labels and layer tag. Copy `l`
//! reads from copy `l − 1` the values of the same roles (label, op, type, layout) that layer 1
//! read from layer 0, and the last layer reads the last copy where the window's last layer
//! read layer 1 (the last layer may be planned differently: the suffix can absorb part of
//! it). Rewriting time is then that of a three-layer model whatever the depth. When layer 1
//! has no counterpart of a value it read from layer 0, the caller plans the whole program.

use super::convert::NodeNote;
use crate::ir::{Graph, Op, ParamSource, ValueId, ValueRole};
use crate::shard::{Provenance, ShardedGraph, TensorSharding};
use std::collections::HashMap;
use std::fmt::Write as _;

/// Where each node of a program sits.
#[derive(Clone, Debug)]
pub(crate) struct Blocks {
    /// Untagged nodes no layer node feeds.
    pub prefix: Vec<usize>,
    /// Layer tag of each block, ascending, and its nodes in program order.
    pub layers: Vec<(u32, Vec<usize>)>,
    /// The other untagged nodes.
    pub suffix: Vec<usize>,
}

/// Which part of a program a node is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Prefix,
    Block(usize),
    Suffix,
}

impl Blocks {
    /// Splits `g`; `None` when it is not a chain of blocks.
    pub fn split(g: &Graph) -> Option<Blocks> {
        let mut tags: Vec<u32> = g.nodes.iter().filter_map(|n| n.layer).collect();
        tags.sort_unstable();
        tags.dedup();
        let slot: HashMap<u32, usize> = tags.iter().enumerate().map(|(i, &t)| (t, i)).collect();
        let mut part = Vec::with_capacity(g.len());
        let mut b = Blocks {
            prefix: Vec::new(),
            layers: tags.iter().map(|&t| (t, Vec::new())).collect(),
            suffix: Vec::new(),
        };
        for (i, n) in g.nodes.iter().enumerate() {
            let p = match n.layer {
                Some(t) => Part::Block(slot[&t]),
                None if n.inputs.iter().all(|x| part[x.index()] == Part::Prefix) => Part::Prefix,
                None => Part::Suffix,
            };
            for x in &n.inputs {
                let ok = match (p, part[x.index()]) {
                    (_, Part::Prefix) => true,
                    (Part::Block(l), Part::Block(k)) => k == l || k + 1 == l,
                    (Part::Suffix, Part::Suffix) => true,
                    (Part::Suffix, Part::Block(k)) => k + 1 == tags.len(),
                    _ => false,
                };
                if !ok {
                    return None;
                }
            }
            match p {
                Part::Prefix => b.prefix.push(i),
                Part::Block(l) => b.layers[l].1.push(i),
                Part::Suffix => b.suffix.push(i),
            }
            part.push(p);
        }
        Some(b)
    }

    /// Signature of block `k` and the positions, in block `k − 1`, of the values it reads
    /// from there (in order of first use).
    pub fn signature(&self, g: &Graph, k: usize) -> (String, Vec<usize>) {
        let (tag, nodes) = &self.layers[k];
        let local: HashMap<usize, usize> = nodes.iter().enumerate().map(|(p, &i)| (i, p)).collect();
        let prev: HashMap<usize, usize> = match k.checked_sub(1) {
            Some(j) => self.layers[j]
                .1
                .iter()
                .enumerate()
                .map(|(p, &i)| (i, p))
                .collect(),
            None => HashMap::new(),
        };
        let mut imports: Vec<usize> = Vec::new();
        let mut s = String::new();
        for &i in nodes {
            let n = &g.nodes[i];
            let op = match &n.op {
                Op::Param(src) => Op::Param(ParamSource {
                    name: String::new(),
                    ..src.clone()
                }),
                o => o.clone(),
            };
            let _ = write!(s, "{}|{}|{}|", n.ty, op, relabel(&n.name, *tag, "#"));
            for x in &n.inputs {
                let x = x.index();
                if let Some(p) = local.get(&x) {
                    let _ = write!(s, "l{p},");
                } else if let Some(&p) = prev.get(&x) {
                    let k = match imports.iter().position(|&q| q == p) {
                        Some(k) => k,
                        None => {
                            imports.push(p);
                            imports.len() - 1
                        }
                    };
                    let _ = write!(s, "i{k},");
                } else {
                    let _ = write!(s, "p{x},");
                }
            }
            s.push('\n');
        }
        (s, imports)
    }
}

/// `name` with a leading `layers.<from>.` replaced by `layers.<to>.`.
pub(crate) fn relabel(name: &str, from: u32, to: &str) -> String {
    match name.strip_prefix(&format!("layers.{from}.")) {
        Some(rest) => format!("layers.{to}.{rest}"),
        None => name.to_string(),
    }
}

/// A program that can be planned through a window.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    blocks: Blocks,
}

/// What dedup did, for the report.
#[derive(Clone, Debug)]
pub(crate) struct WindowInfo {
    /// Layers in the program.
    pub layers: usize,
    /// Nodes in the window.
    pub window_nodes: usize,
}

impl Plan {
    /// A plan for `g` when it has at least four identical layer blocks after the first.
    pub fn new(g: &Graph) -> Option<Plan> {
        let blocks = Blocks::split(g)?;
        let n = blocks.layers.len();
        if n < 4
            || blocks
                .layers
                .iter()
                .enumerate()
                .any(|(i, (t, _))| *t != i as u32)
        {
            return None;
        }
        let (sig1, _) = blocks.signature(g, 1);
        let (_, pos2) = blocks.signature(g, 2);
        for k in 2..n {
            let (s, p) = blocks.signature(g, k);
            if s != sig1 || p != pos2 {
                return None;
            }
        }
        Some(Plan { blocks })
    }

    /// The window: prefix, layers 0, 1 and L−1 (reading layer 1), suffix.
    pub fn window(&self, sg: &ShardedGraph) -> Option<(ShardedGraph, WindowInfo)> {
        let g = &sg.graph;
        let b = &self.blocks;
        let last = b.layers.len() - 1;
        let mut keep: Vec<usize> = b.prefix.clone();
        for k in [0, 1, last] {
            keep.extend(&b.layers[k].1);
        }
        keep.extend(&b.suffix);
        keep.sort_unstable();
        // Layer L−2's node at position p is layer 1's node at position p.
        let mut alias: HashMap<usize, usize> = HashMap::new();
        for (&x, &y) in b.layers[last - 1].1.iter().zip(&b.layers[1].1) {
            alias.insert(x, y);
        }
        let mut new_id: HashMap<usize, ValueId> = HashMap::new();
        let mut out = Graph::new();
        let (mut shardings, mut provenance) = (Vec::new(), Vec::new());
        for &i in &keep {
            let n = &g.nodes[i];
            let mut inputs = Vec::with_capacity(n.inputs.len());
            for x in &n.inputs {
                let x = alias.get(&x.index()).copied().unwrap_or(x.index());
                inputs.push(*new_id.get(&x)?);
            }
            out.current_layer = n.layer;
            out.current_role = n.role;
            let v = out
                .add_typed(n.op.clone(), &inputs, Some(n.ty.clone()), n.name.clone())
                .ok()?;
            new_id.insert(i, v);
            shardings.push(sg.shardings.get(i)?.clone());
            provenance.push(sg.provenance.get(i).cloned().flatten());
        }
        out.current_layer = None;
        out.current_role = ValueRole::Forward;
        for (name, v) in &g.outputs {
            out.set_output(name, *new_id.get(&v.index())?);
        }
        let info = WindowInfo {
            layers: b.layers.len(),
            window_nodes: out.len(),
        };
        Some((
            ShardedGraph {
                graph: out,
                shardings,
                provenance,
                mesh: sg.mesh.clone(),
            },
            info,
        ))
    }

    /// The whole program from the planned window `w` (with its notes): layer 1 replicated for
    /// layers `1..L−1`. `Err` says why the window cannot be replicated.
    pub fn expand(
        &self,
        src: &ShardedGraph,
        w: &ShardedGraph,
        notes: &[NodeNote],
    ) -> Result<(ShardedGraph, Vec<NodeNote>), String> {
        let g = &w.graph;
        let b = Blocks::split(g).ok_or("the planned window is not a chain of layer blocks")?;
        let last = self.blocks.layers.len() - 1;
        let tags: Vec<u32> = b.layers.iter().map(|(t, _)| *t).collect();
        if tags != [0, 1, last as u32] {
            return Err(format!(
                "the planned window has layers {tags:?}, expected [0, 1, {last}]"
            ));
        }
        // What layer 1 reads from layer 0, and where each such value is in layer 1 (the
        // same role: label, op, type and layout), which is what copy l reads from copy l − 1.
        let (_, imports1) = b.signature(g, 1);
        // A role is the value a node computes (its label, which names the value, not the
        // op computing it) in a form (type and layout).
        let role = |i: usize, tag: u32| -> String {
            let n = &g.nodes[i];
            format!(
                "{}|{}|{}",
                relabel(&n.name, tag, "#"),
                n.ty,
                w.shardings[i].display(&w.mesh)
            )
        };
        let mut in_layer1: HashMap<String, Option<usize>> = HashMap::new();
        for (p, &i) in b.layers[1].1.iter().enumerate() {
            in_layer1
                .entry(role(i, 1))
                .and_modify(|e| *e = None)
                .or_insert(Some(p));
        }
        let mut pos_mid = Vec::with_capacity(imports1.len());
        for &p in &imports1 {
            let i = b.layers[0].1[p];
            let at = match in_layer1.get(&role(i, 0)) {
                Some(Some(at)) => *at,
                Some(None) => {
                    return Err(format!(
                        "layer 1 computes `{}` in this form more than once",
                        g.nodes[i].name
                    ))
                }
                None => {
                    return Err(format!(
                        "layer 1 reads `{}` from layer 0 but computes no counterpart",
                        g.nodes[i].name
                    ))
                }
            };
            pos_mid.push(at);
        }
        let (_, pos_last) = b.signature(g, 2);
        // Original parameters of a layer, in block order; the template's are layer 1's.
        let params = |l: usize| -> Vec<usize> {
            self.blocks.layers[l]
                .1
                .iter()
                .copied()
                .filter(|&i| matches!(src.graph.nodes[i].op, Op::Param(_)))
                .collect()
        };
        // By source without shards: a parameter the `layout` rules split is the template's
        // parameter with more shards.
        let unsharded = |p: &ParamSource| ParamSource {
            shards: Vec::new(),
            ..p.clone()
        };
        let template_params = params(1);
        let param_pos: HashMap<ParamSource, usize> = template_params
            .iter()
            .enumerate()
            .filter_map(|(j, &i)| match &src.graph.nodes[i].op {
                Op::Param(p) => Some((unsharded(p), j)),
                _ => None,
            })
            .collect();
        let mut e = Emit {
            out: Graph::new(),
            shardings: Vec::new(),
            provenance: Vec::new(),
            notes: Vec::new(),
            map: HashMap::new(),
        };
        for &i in b.prefix.iter().chain(&b.layers[0].1) {
            e.copy(w, notes, i)?;
        }
        let mut prev: Option<Vec<ValueId>> = None;
        for l in 1..last {
            let reads = match prev.take() {
                None => Reads::Window,
                Some(ids) => Reads::Copy(ids, pos_mid.clone()),
            };
            let ps = params(l);
            let pmap = |op: &Op| match op {
                Op::Param(p) => param_pos
                    .get(&unsharded(p))
                    .and_then(|&j| ps.get(j).copied()),
                _ => None,
            };
            prev = Some(e.copy_block(w, notes, &b, 1, l as u32, &reads, src, &pmap)?);
        }
        let reads = Reads::Copy(prev.ok_or("no middle layer")?, pos_last);
        e.copy_block(w, notes, &b, 2, last as u32, &reads, src, &|_| None)?;
        for &i in &b.suffix {
            e.copy(w, notes, i)?;
        }
        e.out.current_layer = None;
        e.out.current_role = ValueRole::Forward;
        for (name, v) in &g.outputs {
            let id = *e.map.get(&v.index()).ok_or("an output is not emitted")?;
            e.out.set_output(name, id);
        }
        let (graph, keep) = live(&e.out);
        crate::ir::verify_if_debug(&graph, "rewrite (layer replication)");
        Ok((
            ShardedGraph {
                graph,
                shardings: pick(e.shardings, &keep),
                provenance: pick(e.provenance, &keep),
                mesh: w.mesh.clone(),
            },
            pick(e.notes, &keep),
        ))
    }
}

/// `g` without the nodes no output needs (a copy of the template may compute a value only the
/// window's last layer read), in order; and which nodes were kept.
fn live(g: &Graph) -> (Graph, Vec<bool>) {
    let mut keep = vec![false; g.len()];
    for (_, v) in &g.outputs {
        keep[v.index()] = true;
    }
    for i in (0..g.len()).rev() {
        if keep[i] {
            for x in &g.nodes[i].inputs {
                keep[x.index()] = true;
            }
        }
    }
    let mut new_id = vec![None; g.len()];
    let mut out = Graph::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if !keep[i] {
            continue;
        }
        let mut n = n.clone();
        for x in &mut n.inputs {
            *x = new_id[x.index()].expect("invariant: operands of kept nodes are kept");
        }
        new_id[i] = Some(ValueId(out.nodes.len() as u32));
        out.nodes.push(n);
    }
    for (name, v) in &g.outputs {
        let v = new_id[v.index()].expect("invariant: outputs are kept");
        out.outputs.push((name.clone(), v));
    }
    (out, keep)
}

/// The entries of `v` whose `keep` is set.
fn pick<T>(v: Vec<T>, keep: &[bool]) -> Vec<T> {
    v.into_iter()
        .zip(keep)
        .filter_map(|(x, &k)| k.then_some(x))
        .collect()
}

/// Where a copied block's reads of the previous block come from.
enum Reads {
    /// The window's own previous block (already emitted as is).
    Window,
    /// The previous copy's nodes, at these positions (one per import, in order of first use).
    Copy(Vec<ValueId>, Vec<usize>),
}

/// The program being assembled (here, and by the training steps' layer window).
#[derive(Default)]
pub(super) struct Emit {
    pub(super) out: Graph,
    pub(super) shardings: Vec<TensorSharding>,
    pub(super) provenance: Vec<Option<Provenance>>,
    pub(super) notes: Vec<NodeNote>,
    /// Window node → emitted node, for nodes emitted once (prefix, layer 0, suffix, last).
    map: HashMap<usize, ValueId>,
}

impl Emit {
    /// Appends window node `i` with a new op, operands, label and layer; `relayer` renames
    /// its provenance from one layer to another.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push(
        &mut self,
        w: &ShardedGraph,
        notes: &[NodeNote],
        i: usize,
        op: Op,
        inputs: Vec<ValueId>,
        name: String,
        layer: Option<u32>,
        relayer: Option<(u32, u32)>,
    ) -> Result<ValueId, String> {
        let n = &w.graph.nodes[i];
        self.out.current_layer = layer;
        self.out.current_role = n.role;
        let v = self
            .out
            .add_typed(op, &inputs, Some(n.ty.clone()), name)
            .map_err(|e| format!("replicating `{}`: {e}", n.name))?;
        self.shardings.push(w.shardings[i].clone());
        let mut p = w.provenance[i].clone();
        if let (Some(p), Some((from, to))) = (&mut p, relayer) {
            let (a, b) = (format!("layers.{from}."), format!("layers.{to}."));
            p.value = p.value.replace(&a, &b);
            p.required_by.map_names(|s| s.replace(&a, &b));
        }
        self.provenance.push(p);
        self.notes.push(notes[i].clone());
        Ok(v)
    }

    /// Copies window node `i` unchanged.
    fn copy(&mut self, w: &ShardedGraph, notes: &[NodeNote], i: usize) -> Result<ValueId, String> {
        let n = &w.graph.nodes[i];
        let inputs = n
            .inputs
            .iter()
            .map(|x| self.map.get(&x.index()).copied())
            .collect::<Option<Vec<_>>>()
            .ok_or("an operand is not emitted before its user")?;
        let v = self.push(
            w,
            notes,
            i,
            n.op.clone(),
            inputs,
            n.name.clone(),
            n.layer,
            None,
        )?;
        self.map.insert(i, v);
        Ok(v)
    }

    /// Copies block `k` of the window as layer `to`, its reads of the previous block from
    /// `reads`; `param` maps a template parameter's op to the original node of layer `to`
    /// holding the same position. Returns the copy's nodes, by position.
    #[allow(clippy::too_many_arguments)]
    fn copy_block(
        &mut self,
        w: &ShardedGraph,
        notes: &[NodeNote],
        b: &Blocks,
        k: usize,
        to: u32,
        reads: &Reads,
        src: &ShardedGraph,
        param: &dyn Fn(&Op) -> Option<usize>,
    ) -> Result<Vec<ValueId>, String> {
        let (tag, nodes) = &b.layers[k];
        let (_, imports) = b.signature(&w.graph, k);
        let prev_nodes = &b.layers[k - 1].1;
        let ordinal: HashMap<usize, usize> = imports
            .iter()
            .enumerate()
            .map(|(j, &p)| (prev_nodes[p], j))
            .collect();
        let mut local: HashMap<usize, ValueId> = HashMap::new();
        let mut ids = Vec::with_capacity(nodes.len());
        for &i in nodes {
            let n = &w.graph.nodes[i];
            let mut inputs = Vec::with_capacity(n.inputs.len());
            for x in &n.inputs {
                let x = x.index();
                let v = if let Some(&v) = local.get(&x) {
                    v
                } else if let Some(&j) = ordinal.get(&x) {
                    match reads {
                        Reads::Window => self.map.get(&x).copied(),
                        Reads::Copy(prev, pos) => pos.get(j).and_then(|&p| prev.get(p)).copied(),
                    }
                    .ok_or("a read of the previous layer is not emitted")?
                } else {
                    *self
                        .map
                        .get(&x)
                        .ok_or("a read of the prefix is not emitted")?
                };
                inputs.push(v);
            }
            let (op, name) = match (param(&n.op), &n.op) {
                (Some(j), Op::Param(window)) => {
                    let o = &src.graph.nodes[j];
                    // Layer `to`'s tensor, split as the window's parameter is.
                    let op = match &o.op {
                        Op::Param(p) => Op::Param(ParamSource {
                            shards: window.shards.clone(),
                            ..p.clone()
                        }),
                        other => other.clone(),
                    };
                    (op, o.name.clone())
                }
                _ => (n.op.clone(), relabel(&n.name, *tag, &to.to_string())),
            };
            let v = self.push(w, notes, i, op, inputs, name, Some(to), Some((*tag, to)))?;
            local.insert(i, v);
            // The suffix reads the last block through the map (later copies overwrite).
            self.map.insert(i, v);
            ids.push(v);
        }
        Ok(ids)
    }
}
