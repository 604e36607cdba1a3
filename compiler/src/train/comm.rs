//! Communication volume of a step: for each collective of the SPMD program, the elements one
//! rank sends with the textbook ring algorithms over an axis of `n` ranks — all-reduce of `N`
//! elements `2N(n−1)/n`, reduce-scatter of `N` (input) and all-gather to `N` (output)
//! `N(n−1)/n` each, all-to-all of `N` `N(n−1)/n`, broadcast `N`. Data-parallel training
//! therefore sends `2Ψ(n−1)/n` per step (Ψ gradient elements all-reduced) and ZeRO-3
//! `3Ψ(n−1)/n` (parameters gathered for forward and backward, gradients reduce-scattered).

use crate::ir::Graph;
use crate::ir::Op;
use crate::plan::{CollectiveVolume, CommVolume};
use crate::shard::{Mesh, ShardedGraph};
use std::collections::BTreeMap;

/// Counts the collectives of `sg` (every rank runs the same program).
pub fn comm_volume(sg: &ShardedGraph) -> CommVolume {
    comm_volume_of(&sg.mesh, &[(&sg.graph, 1)])
}

/// Counts the collectives of a step that runs each program `(g, times)` `times` times (a
/// micro-batch's program once per micro-batch, the step's once).
pub fn comm_volume_of(mesh: &Mesh, programs: &[(&Graph, u64)]) -> CommVolume {
    // (op, axis) → (ranks, count, elements, n · elements sent, bytes per element)
    type Acc = (usize, usize, u64, u128, u64);
    let mut acc: BTreeMap<(String, String), Acc> = BTreeMap::new();
    for (g, v, times) in programs
        .iter()
        .flat_map(|&(g, times)| g.ids().map(move |v| (g, v, times)))
    {
        let node = g.node(v);
        if !node.op.communicates() {
            continue;
        }
        let Some(axis) = node.op.axis() else { continue };
        let Some(a) = mesh.axis(axis) else {
            continue;
        };
        let n = mesh.axis_size(a) as u64;
        let input = node.inputs.first().map_or(0, |&i| g.ty(i).numel()) as u64;
        let output = node.ty.numel() as u64;
        let (elements, sent_x_n) = match &node.op {
            Op::AllReduce { .. } => (output, 2 * output * (n - 1)),
            Op::ReduceScatter { .. } | Op::AllToAll { .. } => (input, input * (n - 1)),
            Op::AllGather { .. } => (output, output * (n - 1)),
            Op::Broadcast { .. } => (output, output * n),
            // Collective matmuls move the gathered operand or the scattered product.
            Op::AgMatMul { .. } => (input * n, input * n * (n - 1)),
            Op::MatMulRs { .. } => (output * n, output * n * (n - 1)),
            _ => continue,
        };
        let e = acc
            .entry((node.op.mnemonic().to_string(), axis.to_string()))
            .or_insert((n as usize, 0, 0, 0, node.ty.dtype.size_bytes() as u64));
        e.1 += times as usize;
        e.2 += elements * times;
        e.3 += sent_x_n as u128 * times as u128;
    }
    let mut out = CommVolume::default();
    for ((op, axis), (n, count, elements, weighted, bytes)) in acc {
        let sent = (weighted / n as u128) as u64;
        out.sent_elements += sent;
        out.sent_bytes += sent * bytes;
        out.collectives.push(CollectiveVolume {
            op,
            axis,
            ranks: n,
            count,
            elements,
            sent_elements: sent,
            sent_bytes: sent * bytes,
        });
    }
    out
}
