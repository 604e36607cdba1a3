//! Scheduling: streams and events for a program, and a buffer arena from liveness.
//!
//! Compute runs on stream 0 and collectives on stream 1. A collective waits on an event
//! recorded after its operand's producer; its first compute consumer waits on an event recorded
//! after it (collectives reading it follow it on the communication stream; the compute stream
//! waits at the program's end for a collective no compute reads), so communication overlaps
//! independent compute. Activation buffers are placed in one
//! arena by first-fit over their live ranges (parameters are held separately).

pub mod pp;

use crate::ir::{Graph, Op, ValueId};
use serde::{Deserialize, Serialize};

/// The compute stream.
pub const COMPUTE_STREAM: u32 = 0;
/// The communication stream.
pub const COMM_STREAM: u32 = 1;

/// One step of a rank's program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Step {
    /// A kernel (non-GEMM op) producing `value`.
    Kernel {
        /// The node.
        value: ValueId,
        /// Stream.
        stream: u32,
    },
    /// A GEMM producing `value`.
    Gemm {
        /// The node.
        value: ValueId,
        /// Stream.
        stream: u32,
    },
    /// A collective producing `value`.
    Collective {
        /// The node.
        value: ValueId,
        /// Stream.
        stream: u32,
        /// Mesh axis.
        axis: String,
        /// Bytes of the larger of its send / receive buffers (nccl-tests' "size").
        bytes: u64,
    },
    /// Record `event` on `stream`.
    Record {
        /// Event id.
        event: u32,
        /// Stream.
        stream: u32,
    },
    /// `stream` waits for `event`.
    Wait {
        /// Event id.
        event: u32,
        /// Stream.
        stream: u32,
    },
}

/// Where an activation lives in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferSlot {
    /// The value.
    pub value: ValueId,
    /// Byte offset in the arena.
    pub offset: u64,
    /// Bytes.
    pub size: u64,
}

/// Bytes of the larger buffer of a collective node.
pub fn collective_bytes(g: &Graph, v: ValueId) -> u64 {
    let n = g.node(v);
    let out = n.ty.size_bytes() as u64;
    let inp = n.inputs.first().map_or(0, |&i| g.ty(i).size_bytes() as u64);
    out.max(inp)
}

/// The steps of `g`: nodes in order, collectives on the comm stream with events.
pub fn schedule(g: &Graph) -> Vec<Step> {
    let users = g.users();
    let mut steps = Vec::new();
    let mut next_event = 0u32;
    // Events a node must wait on before it runs (collective results it consumes).
    let mut pending: Vec<Vec<u32>> = vec![Vec::new(); g.len()];
    // Collectives whose results only leave the program (outputs): waited for at its end.
    let mut at_end: Vec<u32> = Vec::new();
    for v in g.ids() {
        let node = g.node(v);
        if matches!(node.op, Op::Input { .. } | Op::Param(_)) {
            continue;
        }
        for e in std::mem::take(&mut pending[v.index()]) {
            steps.push(Step::Wait {
                event: e,
                stream: if node.op.is_collective() {
                    COMM_STREAM
                } else {
                    COMPUTE_STREAM
                },
            });
        }
        if node.op.is_collective() {
            let ready = next_event;
            next_event += 1;
            steps.push(Step::Record {
                event: ready,
                stream: COMPUTE_STREAM,
            });
            steps.push(Step::Wait {
                event: ready,
                stream: COMM_STREAM,
            });
            steps.push(Step::Collective {
                value: v,
                stream: COMM_STREAM,
                axis: node.op.axis().unwrap_or_default().to_string(),
                bytes: collective_bytes(g, v),
            });
            let done = next_event;
            next_event += 1;
            steps.push(Step::Record {
                event: done,
                stream: COMM_STREAM,
            });
            // Collectives run in program order on the one communication stream, so a
            // collective reading this one needs no event; the first compute reader waits (and
            // every later compute reader runs after it on the compute stream). Read by no
            // compute node, the result is waited for at the program's end.
            let first_compute = users[v.index()]
                .iter()
                .find(|&&u| !g.node(u).op.is_collective());
            match first_compute {
                Some(&u) => pending[u.index()].push(done),
                None => at_end.push(done),
            }
        } else if matches!(node.op, Op::MatMul { .. }) {
            steps.push(Step::Gemm {
                value: v,
                stream: COMPUTE_STREAM,
            });
        } else {
            steps.push(Step::Kernel {
                value: v,
                stream: COMPUTE_STREAM,
            });
        }
    }
    steps.extend(at_end.into_iter().map(|event| Step::Wait {
        event,
        stream: COMPUTE_STREAM,
    }));
    steps
}

/// Places every activation (non-input, non-param value) in one arena by first-fit over live
/// ranges `[def, last use]` (outputs live to the end). Returns the slots and the arena size.
pub fn arena(g: &Graph) -> (Vec<BufferSlot>, u64) {
    const ALIGN: u64 = 256;
    let last = g.last_uses();
    let mut live: Vec<(usize, u64, u64)> = Vec::new(); // (end, offset, size)
    let mut slots = Vec::new();
    let mut total = 0u64;
    for v in g.ids() {
        let node = g.node(v);
        if matches!(node.op, Op::Input { .. } | Op::Param(_)) {
            continue;
        }
        live.retain(|&(end, _, _)| end >= v.index());
        let size = (node.ty.size_bytes() as u64).div_ceil(ALIGN) * ALIGN;
        live.sort_by_key(|&(_, off, _)| off);
        let mut offset = 0u64;
        for &(_, off, sz) in &live {
            if offset + size <= off {
                break;
            }
            offset = offset.max(off + sz);
        }
        live.push((last[v.index()], offset, size));
        total = total.max(offset + size);
        slots.push(BufferSlot {
            value: v,
            offset,
            size,
        });
    }
    (slots, total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, TensorType, UnaryOp};

    /// A collective read first by another collective and then by compute: the compute reader
    /// waits for the first collective's completion (it used to be waited for only by its first
    /// reader, the other collective, leaving the compute reader racing it).
    #[test]
    fn every_compute_reader_of_a_collective_waits_for_it() {
        let mut g = Graph::new();
        let x = g.input("x", TensorType::plain(DType::F32, &[8]));
        let a = g.add(Op::Unary(UnaryOp::Exp), &[x], "a").unwrap();
        let ar = g
            .add(Op::AllReduce { axis: "tp".into() }, &[a], "ar")
            .unwrap();
        let ag = g
            .add(
                Op::AllGather {
                    axis: "dp".into(),
                    dim: 0,
                    parts: 2,
                },
                &[ar],
                "ag",
            )
            .unwrap();
        let b = g.add(Op::Unary(UnaryOp::Exp), &[ar], "b").unwrap();
        g.set_output("ag", ag);
        g.set_output("b", b);
        let steps = schedule(&g);
        let done_of = |v: ValueId| {
            let i = steps
                .iter()
                .position(|s| matches!(s, Step::Collective { value, .. } if *value == v))
                .expect("collective");
            match steps[i + 1] {
                Step::Record { event, stream } if stream == COMM_STREAM => event,
                ref s => panic!("{s:?}"),
            }
        };
        let (ar_done, ag_done) = (done_of(ar), done_of(ag));
        let b_at = steps
            .iter()
            .position(|s| matches!(s, Step::Kernel { value, .. } if *value == b))
            .expect("b");
        let waits_before_b: Vec<u32> = steps[..b_at]
            .iter()
            .filter_map(|s| match s {
                Step::Wait { event, stream } if *stream == COMPUTE_STREAM => Some(*event),
                _ => None,
            })
            .collect();
        assert!(waits_before_b.contains(&ar_done), "{steps:?}");
        // The gather is read by no compute: the compute stream waits for it at the end.
        assert!(matches!(
            steps.last(),
            Some(Step::Wait { event, stream }) if *event == ag_done && *stream == COMPUTE_STREAM
        ));
    }

    #[test]
    fn arena_reuses_dead_buffers() {
        let mut g = Graph::new();
        let x = g.input("x", TensorType::plain(DType::F32, &[64]));
        let a = g.add(Op::Unary(UnaryOp::Exp), &[x], "a").unwrap();
        let b = g.add(Op::Unary(UnaryOp::Exp), &[a], "b").unwrap();
        let c = g.add(Op::Unary(UnaryOp::Exp), &[b], "c").unwrap();
        g.set_output("c", c);
        let (slots, total) = arena(&g);
        assert_eq!(slots.len(), 3);
        // a dies when c is defined, so c reuses a's slot; peak is two buffers.
        assert_eq!(total, 512);
        assert_eq!(slots[0].offset, slots[2].offset);
        // No two simultaneously live buffers overlap.
        assert_ne!(slots[0].offset, slots[1].offset);
    }
}
