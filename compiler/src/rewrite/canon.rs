//! The canonical form of a graph, for comparing programs built in different orders.
//!
//! Nodes are renumbered in the post-order of a depth-first walk from the outputs (outputs in
//! order, operands in order); nodes no output reaches are dropped. Two programs that compute
//! the same nodes (same ops, types, labels, layers, operands) print the same canonical text
//! whatever order their builders emitted them in.

use crate::ir::{Graph, ValueId};

/// `g` renumbered in canonical order, dead nodes dropped.
pub fn canonical(g: &Graph) -> Graph {
    let n = g.len();
    let mut order: Vec<usize> = Vec::with_capacity(n);
    let mut state = vec![0u8; n]; // 0 unseen, 1 open, 2 done
    for &(_, root) in &g.outputs {
        let mut stack: Vec<(usize, usize)> = vec![(root.index(), 0)];
        while let Some((v, k)) = stack.pop() {
            if k == 0 {
                if state[v] != 0 {
                    continue;
                }
                state[v] = 1;
            }
            let inputs = &g.nodes[v].inputs;
            if let Some(x) = inputs.get(k) {
                stack.push((v, k + 1));
                if state[x.index()] == 0 {
                    stack.push((x.index(), 0));
                }
            } else {
                state[v] = 2;
                order.push(v);
            }
        }
    }
    let mut new_id = vec![None; n];
    let mut out = Graph::new();
    for (i, &v) in order.iter().enumerate() {
        new_id[v] = Some(ValueId(i as u32));
        let mut node = g.nodes[v].clone();
        for x in &mut node.inputs {
            *x = new_id[x.index()].expect("invariant: operands come first in post-order");
        }
        out.nodes.push(node);
    }
    for (name, v) in &g.outputs {
        out.outputs.push((
            name.clone(),
            new_id[v.index()].expect("invariant: outputs are reached"),
        ));
    }
    out
}

/// The text of [`canonical`].
pub fn canonical_text(g: &Graph) -> String {
    canonical(g).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Op, TensorType};

    #[test]
    fn order_and_dead_nodes_do_not_matter() {
        let t = TensorType::plain(DType::F32, &[2, 3]);
        let mut a = Graph::new();
        let x = a.input("x", t.clone());
        let y = a.input("y", t.clone());
        let s = a.add(Op::Add, &[x, y], "s").expect("add");
        a.add(Op::Softmax, &[s], "dead").expect("softmax");
        a.set_output("out", s);
        let mut b = Graph::new();
        let y = b.input("y", t.clone());
        let x = b.input("x", t);
        let s = b.add(Op::Add, &[x, y], "s").expect("add");
        b.set_output("out", s);
        assert_ne!(a.to_string(), b.to_string());
        assert_eq!(canonical_text(&a), canonical_text(&b));
        assert_eq!(canonical(&b).len(), 3);
    }
}
