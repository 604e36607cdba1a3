//! Repeated layers planned once in training programs.
//!
//! A training step is not a chain of layer blocks (the `dedup` module's case): layer `l`'s
//! backward nodes read layer `l + 1`'s, its forward nodes read layer `l − 1`'s, and its
//! parameters, optimizer state and optimizer update are untagged nodes named after it. Here a
//! node *belongs* to layer `l` when it is tagged `l`, or untagged and named `…layers.<l>.…`;
//! the other nodes are global (embedding, final norm, loss, inputs).
//!
//! With at least four layers whose middle layers `1..L−1` are identical (every member's op,
//! type and label with layer numbers read relative to `l`, its operands by position in the
//! layer, by label in layer `l ± 1`, or by index when global), the rewriter plans a *window*:
//! the globals and layers `0`, `1` and `L−1`, where layer `L−1` reads layer 1 where it read
//! layer `L−2`, and layer 1 reads layer `L−1` where it read layer 2: the training step of a
//! three-layer model. [`TrainPlan::expand`] then replicates the planned layer 1 for layers
//! `1..L−1`: walking the planned window in order, each maximal run of layer-1 nodes is copied
//! once per layer, upwards when it reads the layer below (forward) and downwards when it reads
//! the layer above (backward), each copy reading the copies of the neighbouring layers where
//! the template read layers 0 and `L−1` (by label, type and layout), and each with its own
//! layer's parameters, optimizer state, labels and tags. When a run reads both neighbours, or
//! a read has no counterpart, the caller plans the whole program.

use super::convert::NodeNote;
use super::dedup::Emit;
use crate::ir::{Graph, Op, ValueId, ValueRole};
use crate::shard::ShardedGraph;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt::Write as _;

/// `s` with every `layers.<n>.` rewritten by `f(n)` (kept when `f` gives `None`).
fn relayer(s: &str, f: &dyn Fn(u32) -> Option<String>) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find("layers.") {
        let (head, tail) = rest.split_at(at + "layers.".len());
        out.push_str(head);
        let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && tail.as_bytes().get(digits) == Some(&b'.') {
            if let Ok(n) = tail[..digits].parse::<u32>() {
                out.push_str(&f(n).unwrap_or_else(|| tail[..digits].to_string()));
                rest = &tail[digits..];
                continue;
            }
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// The layer a name mentions first.
fn named_layer(s: &str) -> Option<u32> {
    let mut rest = s;
    while let Some(at) = rest.find("layers.") {
        let tail = &rest[at + "layers.".len()..];
        let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && tail.as_bytes().get(digits) == Some(&b'.') {
            return tail[..digits].parse().ok();
        }
        rest = tail;
    }
    None
}

/// The layer each node belongs to.
fn membership(g: &Graph) -> Vec<Option<u32>> {
    g.nodes
        .iter()
        .map(|n| n.layer.or_else(|| named_layer(&n.name)))
        .collect()
}

/// Relative form of a label or op text of layer `l`: `#`, `#-1`, `#+1`.
fn relative(s: &str, l: u32) -> String {
    relayer(s, &|n| match n {
        _ if n == l => Some("#".into()),
        _ if n + 1 == l => Some("#-1".into()),
        _ if n == l + 1 => Some("#+1".into()),
        _ => None,
    })
}

/// A training program that can be planned through a window.
#[derive(Clone, Debug)]
pub(crate) struct TrainPlan {
    /// Layers in the program.
    pub layers: u32,
}

/// The window and how it was cut, for the report.
pub(crate) struct TrainWindow {
    /// The window program.
    pub sharded: ShardedGraph,
    /// Nodes in the window.
    pub nodes: usize,
}

impl TrainPlan {
    /// A plan for `g` when it has at least four layers and its layers `1..L−1` are identical.
    pub fn new(g: &Graph) -> Option<TrainPlan> {
        let member = membership(g);
        let layers = member.iter().flatten().max()? + 1;
        if layers < 4 || g.nodes.iter().all(|n| n.layer.is_none()) {
            return None;
        }
        let mut of: Vec<Vec<usize>> = vec![Vec::new(); layers as usize];
        for (i, m) in member.iter().enumerate() {
            if let Some(l) = m {
                of[*l as usize].push(i);
            }
        }
        let sig = |l: u32| -> Option<String> {
            let pos: HashMap<usize, usize> = of[l as usize]
                .iter()
                .enumerate()
                .map(|(p, &i)| (i, p))
                .collect();
            let mut s = String::new();
            for &i in &of[l as usize] {
                let n = &g.nodes[i];
                let _ = write!(
                    s,
                    "{}|{}|{}|{:?}|",
                    n.ty,
                    relative(&n.op.to_string(), l),
                    relative(&n.name, l),
                    n.layer.map(|t| t == l)
                );
                for x in &n.inputs {
                    let x = x.index();
                    match member[x] {
                        Some(k) if k == l => {
                            let _ = write!(s, "l{},", pos[&x]);
                        }
                        Some(k) if k + 1 == l || k == l + 1 => {
                            let _ = write!(s, "n{},", relative(&g.nodes[x].name, l));
                        }
                        Some(_) => return None,
                        None => {
                            let _ = write!(s, "g{x},");
                        }
                    }
                }
                s.push('\n');
            }
            Some(s)
        };
        let first = sig(1)?;
        for l in 2..layers - 1 {
            if sig(l)? != first {
                return None;
            }
        }
        Some(TrainPlan { layers })
    }

    /// The window: globals and layers 0, 1 and L−1, layer L−1 reading layer 1 for L−2 and
    /// layer 1 reading layer L−1 for layer 2 (counterparts by relative label).
    pub fn window(&self, sg: &ShardedGraph) -> Result<TrainWindow, String> {
        let g = &sg.graph;
        let member = membership(g);
        let last = self.layers - 1;
        let keep = |m: Option<u32>| m.is_none_or(|l| l == 0 || l == 1 || l == last);
        // Labels of layers 1 and L−1, relative, for the aliases (`None`: ambiguous).
        let mut by_label: HashMap<(u32, String), Option<usize>> = HashMap::new();
        for (i, m) in member.iter().enumerate() {
            if let Some(l) = *m {
                if l == 1 || l == last {
                    by_label
                        .entry((l, relative(&g.nodes[i].name, l)))
                        .and_modify(|e| *e = None)
                        .or_insert(Some(i));
                }
            }
        }
        // What a node of layer `reader` reads at `x`.
        let alias = |reader: Option<u32>, x: usize| -> Option<usize> {
            match (reader, member[x]) {
                (Some(r), Some(k)) if r == last && k + 1 == last => {
                    *by_label.get(&(1, relative(&g.nodes[x].name, k)))?
                }
                (Some(1), Some(2)) => *by_label.get(&(last, relative(&g.nodes[x].name, 2)))?,
                _ => Some(x),
            }
        };
        let mut new_id: HashMap<usize, ValueId> = HashMap::new();
        let mut out = Graph::new();
        let (mut shardings, mut provenance) = (Vec::new(), Vec::new());
        for (i, n) in g.nodes.iter().enumerate() {
            if !keep(member[i]) {
                continue;
            }
            let mut inputs = Vec::with_capacity(n.inputs.len());
            for x in &n.inputs {
                let what = || format!("`{}` reads `{}`", n.name, g.nodes[x.index()].name);
                let y = alias(member[i], x.index())
                    .ok_or_else(|| format!("{}: no single counterpart", what()))?;
                if g.nodes[y].ty != g.nodes[x.index()].ty
                    || sg.shardings.get(y) != sg.shardings.get(x.index())
                {
                    return Err(format!(
                        "{}: the counterpart differs in type or layout",
                        what()
                    ));
                }
                inputs.push(
                    *new_id
                        .get(&y)
                        .ok_or_else(|| format!("{}: not in the window", what()))?,
                );
            }
            out.current_layer = n.layer;
            out.current_role = n.role;
            let v = out
                .add_typed(n.op.clone(), &inputs, Some(n.ty.clone()), n.name.clone())
                .map_err(|e| e.to_string())?;
            new_id.insert(i, v);
            shardings.push(sg.shardings.get(i).ok_or("no layout")?.clone());
            provenance.push(sg.provenance.get(i).cloned().flatten());
        }
        out.current_layer = None;
        out.current_role = ValueRole::Forward;
        for (name, v) in &g.outputs {
            // Outputs of the layers left out come back with the copies.
            if let Some(&id) = new_id.get(&v.index()) {
                out.set_output(name, id);
            }
        }
        let nodes = out.len();
        Ok(TrainWindow {
            sharded: ShardedGraph {
                graph: out,
                shardings,
                provenance,
                mesh: sg.mesh.clone(),
            },
            nodes,
        })
    }

    /// The whole program from the planned window `w` (with its notes). `Err` says why the
    /// window cannot be replicated.
    pub fn expand(
        &self,
        src: &ShardedGraph,
        w: &ShardedGraph,
        notes: &[NodeNote],
    ) -> Result<(ShardedGraph, Vec<NodeNote>), String> {
        let g = &w.graph;
        let last = self.layers - 1;
        let member = membership(g);
        // Roles of the template (layer 1): relative label, type and layout.
        let role = |i: usize, l: u32| -> String {
            format!(
                "{}|{}|{}",
                relative(&g.nodes[i].name, l),
                g.nodes[i].ty,
                w.shardings[i].display(&w.mesh)
            )
        };
        let mut template: HashMap<String, Option<usize>> = HashMap::new();
        for (i, m) in member.iter().enumerate() {
            if *m == Some(1) {
                template
                    .entry(role(i, 1))
                    .and_modify(|e| *e = None)
                    .or_insert(Some(i));
            }
        }
        let counterpart = |x: usize, l: u32| -> Result<usize, String> {
            match template.get(&role(x, l)) {
                Some(Some(t)) => Ok(*t),
                Some(None) => Err(format!(
                    "layer 1 computes `{}` in this form more than once",
                    g.nodes[x].name
                )),
                None => Err(format!(
                    "layer 1 has no counterpart of `{}`",
                    g.nodes[x].name
                )),
            }
        };
        // Leaves of the source by label (each layer's parameters and optimizer state).
        let leaves: HashMap<&str, usize> = src
            .graph
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| matches!(n.op, Op::Param(_) | Op::Input { .. }))
            .map(|(i, n)| (n.name.as_str(), i))
            .collect();
        // The program's nodes: each window node outside layer 1 once (`l = 0`), each node of
        // layer 1 once per middle layer `l` in `1..=L−2`; and what each reads.
        let mid = last - 1;
        let items: Vec<(usize, u32)> = (0..g.len())
            .flat_map(|j| {
                let ls: Vec<u32> = if member[j] == Some(1) {
                    (1..=mid).collect()
                } else {
                    vec![0]
                };
                ls.into_iter().map(move |l| (j, l))
            })
            .collect();
        let index: HashMap<(usize, u32), usize> =
            items.iter().enumerate().map(|(k, &it)| (it, k)).collect();
        let mut reads: Vec<Vec<usize>> = Vec::with_capacity(items.len());
        for &(j, l) in &items {
            let n = &g.nodes[j];
            let mut r = Vec::with_capacity(n.inputs.len());
            for x in &n.inputs {
                let x = x.index();
                let it = match (l, member[x]) {
                    // Outside layer 1: layer 0 reads copy 1, layer L−1 copy L−2.
                    (0, Some(1)) => match member[j] {
                        Some(0) => (x, 1),
                        Some(k) if k == last => (x, mid),
                        _ => return Err(format!("`{}` reads layer 1", n.name)),
                    },
                    (0, _) => (x, 0),
                    (_, Some(1)) => (x, l),
                    (1, Some(0)) => (x, 0),
                    (_, Some(0)) => (counterpart(x, 0)?, l - 1),
                    (_, Some(k)) if k == last && l == mid => (x, 0),
                    (_, Some(k)) if k == last => (counterpart(x, last)?, l + 1),
                    _ => (x, 0),
                };
                r.push(index[&it]);
            }
            reads.push(r);
        }
        // Kahn's algorithm, earliest window node first (copies of one node by layer).
        let mut waiting: Vec<usize> = reads.iter().map(Vec::len).collect();
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); items.len()];
        for (k, r) in reads.iter().enumerate() {
            for &x in r {
                users[x].push(k);
            }
        }
        let mut ready: BinaryHeap<Reverse<((usize, u32), usize)>> = (0..items.len())
            .filter(|&k| waiting[k] == 0)
            .map(|k| Reverse((items[k], k)))
            .collect();
        let mut e = Emit::default();
        let mut emitted: Vec<Option<ValueId>> = vec![None; items.len()];
        while let Some(Reverse(((j, l), k))) = ready.pop() {
            let n = &g.nodes[j];
            let inputs: Vec<ValueId> = reads[k]
                .iter()
                .map(|&x| emitted[x].expect("invariant: operands are emitted first"))
                .collect();
            let v = if l == 0 {
                e.push(
                    w,
                    notes,
                    j,
                    n.op.clone(),
                    inputs,
                    n.name.clone(),
                    n.layer,
                    None,
                )?
            } else {
                let relabel = |s: &str| {
                    relayer(s, &|m| match m {
                        0 => Some((l - 1).to_string()),
                        1 => Some(l.to_string()),
                        _ if m == 2 || m == last => Some((l + 1).to_string()),
                        _ => None,
                    })
                };
                let name = relabel(&n.name);
                let op = match n.op {
                    Op::Param(_) | Op::Input { .. } => {
                        let i = *leaves
                            .get(name.as_str())
                            .ok_or_else(|| format!("no leaf `{name}` in the program"))?;
                        src.graph.nodes[i].op.clone()
                    }
                    _ => n.op.clone(),
                };
                let layer = n.layer.map(|_| l);
                let v = e.push(w, notes, j, op, inputs, name, layer, None)?;
                if let Some(p) = e.provenance.last_mut().and_then(Option::as_mut) {
                    p.value = relabel(&p.value);
                    p.required_by.map_names(relabel);
                }
                v
            };
            emitted[k] = Some(v);
            for &u in &users[k] {
                waiting[u] -= 1;
                if waiting[u] == 0 {
                    ready.push(Reverse((items[u], u)));
                }
            }
        }
        if emitted.iter().any(Option::is_none) {
            return Err("the replicated layers read each other in a cycle".into());
        }
        let copy = |j: usize, l: u32| emitted[index[&(j, l)]];
        // The source's outputs, in its order: a middle layer's from its copy of layer 1's.
        let window_out: HashMap<&str, usize> = g
            .outputs
            .iter()
            .map(|(n, v)| (n.as_str(), v.index()))
            .collect();
        let src_member = membership(&src.graph);
        for (name, v) in &src.graph.outputs {
            let id = match src_member[v.index()] {
                Some(l) if (1..last).contains(&l) => {
                    let as1 = relayer(name, &|n| (n == l).then(|| "1".to_string()));
                    let j = *window_out
                        .get(as1.as_str())
                        .ok_or_else(|| format!("no output `{as1}` in the window"))?;
                    if member[j] != Some(1) {
                        return Err(format!("output `{as1}` is not layer 1's"));
                    }
                    copy(j, l)
                }
                _ => match window_out.get(name.as_str()) {
                    Some(&j) if member[j] != Some(1) => copy(j, 0),
                    _ => None,
                },
            };
            e.out.set_output(
                name,
                id.ok_or_else(|| format!("output `{name}` is not emitted"))?,
            );
        }
        crate::ir::verify_if_debug(&e.out, "rewrite (training layer replication)");
        Ok((
            ShardedGraph {
                graph: e.out,
                shardings: e.shardings,
                provenance: e.provenance,
                mesh: w.mesh.clone(),
            },
            e.notes,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relabelling_reads_whole_layer_numbers() {
        let f = |n: u32| (n == 1).then(|| "7".to_string());
        assert_eq!(relayer("bwd.layers.1.x", &f), "bwd.layers.7.x");
        assert_eq!(
            relayer("layers.10.x layers.1.y", &f),
            "layers.10.x layers.7.y"
        );
        assert_eq!(relayer("layers.1", &f), "layers.1");
        assert_eq!(named_layer("opt.m.layers.12.w"), Some(12));
        assert_eq!(named_layer("param.embed"), None);
        assert_eq!(relative("saved.layers.2.r", 3), "saved.layers.#-1.r");
    }
}
