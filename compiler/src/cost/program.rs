//! [`Program`]: one rank's timed work on its streams, the simulator's input. This is the seam
//! between plans and the simulator:
//!
//! - [`Program::from_steps`] reads a plan's steps (kernels, GEMMs, collectives, event record
//!   and wait) and costs each kernel with the roofline; a forward plan today, and a training
//!   plan (forward + backward + optimizer nodes, once `autodiff/` emits them) the same way,
//!   with no derived backward.
//! - [`Program::derive_backward`] is the stand-in until then: the backward of a forward program
//!   from the forward's own ops, in reverse, each kernel replaced by its gradient kernels
//!   (GEMMs: input gradient, then weight gradient), each collective by its conjugate
//!   (all-gather ↔ reduce-scatter, all-reduce ↔ all-reduce), every event record turned into a
//!   wait and every wait into a record. Weight-gradient GEMMs are issued after the records that
//!   follow their input gradient, so the conjugate collective overlaps them (Megatron-LM's
//!   asynchronous gradient all-reduce). Under sequence parallelism the mirrored positions
//!   are exactly Megatron's; under plain tensor parallelism the backward all-reduce sits at
//!   the mirror of the forward one (after the row-parallel GEMM's consumer) rather than after
//!   the column-parallel GEMM's input gradient, so it is exposed, as in Megatron-LM before
//!   `--async-tensor-model-parallel-allreduce` — same count and bytes, less overlap.
//!
//! Post: every `Wait` names an event some `Record` of the program records; event ids are below
//! [`Program::events`].

use super::collective::CollectiveKind;
use super::profile::DeviceProfile;
use super::roofline::{
    fused_into_consumer, is_expert_major, kernels_bytes, kernels_flops, kernels_time,
    node_cost_routed, routed_fraction, sim_bytes, AttentionImpl, ComputeOptions,
};
use super::units::Seconds;
use crate::ir::{Graph, Op, ValueId};
use crate::schedule::Step;
use std::collections::{BTreeMap, BTreeSet};

/// The compute stream.
pub const COMPUTE: u32 = 0;
/// The communication stream.
pub const COMM: u32 = 1;

/// Time, FLOPs and bytes of some kernel work.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Roofline time.
    pub time: Seconds,
    /// Counted FLOPs (Megatron-LM convention).
    pub flops: f64,
    /// HBM bytes.
    pub bytes: f64,
}

/// How a forward kernel's backward is derived.
#[derive(Clone, Debug, PartialEq)]
pub struct Grad {
    /// Gradient of the inputs.
    pub dgrad: Work,
    /// Gradient of a weight (GEMMs with a parameter operand).
    pub wgrad: Option<Work>,
    /// The all-gather to repeat before the weight gradient (sequence parallelism): axis, bytes.
    pub regather: Option<(String, u64)>,
    /// The node is an attention core (recomputed by selective recomputation).
    pub attention: bool,
    /// Context parallelism's K/V (attention reading them gathered over an axis, or passed
    /// round its ring): the backward gathers them again before the gradient, as the compiled
    /// step does (the forward keeps them split), and after a ring reduce-scatters dK/dV (after
    /// a gather, the gather's own gradient does); the compiled ring backward
    /// (`RingAttentionGrad`) moves the same K/V and dK/dV round the ring, plus K once more
    /// for the softmax statistics, which this leaves out. Axis, gathered bytes, ring.
    pub exchange: Option<(String, u64, bool)>,
}

/// What an op does.
#[derive(Clone, Debug, PartialEq)]
pub enum ProgKind {
    /// A kernel on the op's stream.
    Kernel {
        /// Its cost.
        work: Work,
        /// A tensor-core GEMM (or attention).
        gemm: bool,
    },
    /// A collective over the groups of a mesh axis.
    Collective {
        /// Mesh axis name.
        axis: String,
        /// Which collective.
        kind: CollectiveKind,
        /// nccl-tests size at the simulated dtype.
        bytes: u64,
    },
    /// Record an event on the op's stream.
    Record(u32),
    /// The op's stream waits for an event.
    Wait(u32),
}

/// One op of a program.
#[derive(Clone, Debug, PartialEq)]
pub struct ProgOp {
    /// Stream index.
    pub stream: u32,
    /// Label (the IR node's name, or what was derived).
    pub label: String,
    /// What it does.
    pub kind: ProgKind,
    /// Bytes allocated when it starts.
    pub alloc: u64,
    /// Bytes freed when it ends.
    pub free: u64,
    /// How to derive its backward (kernels only).
    pub grad: Option<Grad>,
}

/// A rank's timed program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    /// Stream names, by index.
    pub streams: Vec<String>,
    /// Ops in issue order.
    pub ops: Vec<ProgOp>,
    /// Number of event ids used.
    pub events: u32,
    /// Bytes live before the first op (inputs).
    pub initial_live: u64,
}

fn canon(g: &Graph, mut v: ValueId) -> ValueId {
    while matches!(g.node(v).op, Op::Reshape) {
        v = g.node(v).inputs[0];
    }
    v
}

impl Program {
    /// An empty program with the compute and comm streams.
    pub fn new() -> Program {
        Program {
            streams: vec!["compute".into(), "comm".into()],
            ops: Vec::new(),
            events: 0,
            initial_live: 0,
        }
    }

    /// The program of `steps` over `g`, keeping the nodes `keep` accepts. Records and waits
    /// that belong to a dropped collective are dropped with it.
    /// `comm` gives the time of a collective (axis, kind, nccl-tests size) on this mesh; it
    /// costs the communication inside collective matmuls, which overlaps their GEMMs.
    pub fn from_steps(
        g: &Graph,
        steps: &[Step],
        dev: &DeviceProfile,
        opts: &ComputeOptions,
        keep: &dyn Fn(ValueId) -> bool,
        comm: &dyn Fn(&str, CollectiveKind, u64) -> Seconds,
    ) -> Program {
        Program::from_steps_with(g, steps, dev, opts, keep, comm, &|_| false)
    }

    /// [`Program::from_steps`] with the values `resident` says live in buffers accounted
    /// elsewhere (a training micro-batch's gradients, which accumulate into the step's
    /// gradient buffers): they take no activation memory here. Every other value holds its
    /// bytes at the simulated dtype from its kernel to its last reader, but a fused one
    /// (never written) and, with flash attention, attention probabilities: a fused kernel
    /// keeps only each row's log-sum-exp (`[B, T, heads]` f32), not the `[.., T, S]` matrix.
    pub fn from_steps_with(
        g: &Graph,
        steps: &[Step],
        dev: &DeviceProfile,
        opts: &ComputeOptions,
        keep: &dyn Fn(ValueId) -> bool,
        comm: &dyn Fn(&str, CollectiveKind, u64) -> Seconds,
        resident: &dyn Fn(ValueId) -> bool,
    ) -> Program {
        let fused = fused_into_consumer(g, opts);
        let routed = routed_fraction(g);
        let held = |v: ValueId| -> u64 {
            let node = g.node(v);
            if resident(v) || fused[v.index()] || matches!(node.op, Op::Reshape) {
                return 0;
            }
            match node.op {
                Op::AttentionProbs(_) if opts.attention == AttentionImpl::Flash => {
                    let t = &node.ty;
                    // [B, heads, T, S] → one f32 per row.
                    (t.numel() / t.dims.last().map_or(1, |d| d.size.max(1))) as u64 * 4
                }
                // A dense `[experts, ..]` value holds only its routed tokens.
                _ if is_expert_major(&node.ty) => (sim_bytes(&node.ty, opts.dtype) * routed) as u64,
                _ => sim_bytes(&node.ty, opts.dtype) as u64,
            }
        };
        // Which collective each event belongs to (schedule(): record, wait, collective, record).
        let mut owner: BTreeMap<u32, ValueId> = BTreeMap::new();
        for (i, s) in steps.iter().enumerate() {
            if let Step::Collective { value, .. } = s {
                if let Some(Step::Wait { event, .. }) = i.checked_sub(1).map(|j| &steps[j]) {
                    owner.insert(*event, *value);
                }
                if let Some(Step::Record { event, .. }) = steps.get(i + 1) {
                    owner.insert(*event, *value);
                }
            }
        }
        let event_kept = |e: u32| owner.get(&e).is_none_or(|&v| keep(v));
        // Liveness: last use of each (view-canonical) value among kept nodes.
        let mut last: Vec<Option<ValueId>> = vec![None; g.len()];
        for v in g.ids().filter(|&v| keep(v)) {
            for &i in &g.node(v).inputs {
                last[canon(g, i).index()] = Some(v);
            }
        }
        for &(_, v) in &g.outputs {
            last[canon(g, v).index()] = None;
        }
        let mut frees: BTreeMap<ValueId, u64> = BTreeMap::new();
        for v in g.ids() {
            if v != canon(g, v) || !keep(v) {
                continue;
            }
            if let Some(u) = last[v.index()] {
                if matches!(g.node(v).op, Op::Param(_)) {
                    continue;
                }
                // An input holds its bytes from the start (`initial_live`).
                *frees.entry(u).or_insert(0) += if matches!(g.node(v).op, Op::Input { .. }) {
                    if resident(v) {
                        0
                    } else {
                        sim_bytes(g.ty(v), opts.dtype) as u64
                    }
                } else {
                    held(v)
                };
            }
        }
        let mut p = Program::new();
        p.initial_live = g
            .ids()
            .filter(|&v| matches!(g.node(v).op, Op::Input { .. }) && !resident(v))
            .map(|v| sim_bytes(g.ty(v), opts.dtype) as u64)
            .sum();
        let mut max_event = 0u32;
        for s in steps {
            match s {
                Step::Record { event, stream } | Step::Wait { event, stream } => {
                    if !event_kept(*event) {
                        continue;
                    }
                    max_event = max_event.max(event + 1);
                    let kind = if matches!(s, Step::Record { .. }) {
                        ProgKind::Record(*event)
                    } else {
                        ProgKind::Wait(*event)
                    };
                    p.ops.push(ProgOp {
                        stream: *stream,
                        label: String::new(),
                        kind,
                        alloc: 0,
                        free: 0,
                        grad: None,
                    });
                }
                Step::Kernel { value, stream } | Step::Gemm { value, stream } => {
                    if !keep(*value) {
                        continue;
                    }
                    let node = g.node(*value);
                    let c = node_cost_routed(g, *value, opts, &fused, routed);
                    let work = |ks: &[super::roofline::Kernel]| Work {
                        time: kernels_time(dev, opts.dtype, ks),
                        flops: kernels_flops(ks),
                        bytes: kernels_bytes(ks),
                    };
                    let view = matches!(node.op, Op::Reshape);
                    let grad = (!view).then(|| Grad {
                        dgrad: work(&c.dgrad),
                        wgrad: (!c.wgrad.is_empty()).then(|| work(&c.wgrad)),
                        regather: c.gathered_input.map(|ag| {
                            let n = g.node(ag);
                            (
                                n.op.axis().unwrap_or_default().to_string(),
                                collective_bytes_routed(g, ag, opts, routed),
                            )
                        }),
                        attention: matches!(node.op, Op::Attention(_) | Op::RingAttention { .. }),
                        exchange: match (&node.op, &c.embedded_comm) {
                            (Op::RingAttention { .. }, Some((axis, _, bytes, _))) => {
                                Some((axis.clone(), *bytes as u64, true))
                            }
                            (Op::Attention(_), _) => {
                                // K and V each all-gathered over the same axis.
                                let kv: Vec<&crate::ir::Node> =
                                    node.inputs[1..3].iter().map(|&i| g.node(i)).collect();
                                match (&kv[0].op, &kv[1].op) {
                                    (
                                        Op::AllGather { axis, dim: 1, .. },
                                        Op::AllGather {
                                            axis: a2, dim: 1, ..
                                        },
                                    ) if axis == a2 => Some((
                                        axis.clone(),
                                        node.inputs[1..3]
                                            .iter()
                                            .map(|&i| collective_bytes_routed(g, i, opts, routed))
                                            .sum(),
                                        false,
                                    )),
                                    _ => None,
                                }
                            }
                            _ => None,
                        },
                    });
                    let alloc = held(*value);
                    let mut fwd = work(&c.fwd);
                    if let Some((axis, kind, bytes, parts)) = &c.embedded_comm {
                        // A ring of `parts` partial GEMMs: communication overlaps all but
                        // one step of the shorter of the two.
                        let t = comm(axis, *kind, *bytes as u64);
                        let (long, short) = (fwd.time.max(t), fwd.time.min(t));
                        fwd.time = long + short * (1.0 / (*parts).max(1) as f64);
                    }
                    p.ops.push(ProgOp {
                        stream: *stream,
                        label: node.name.clone(),
                        kind: ProgKind::Kernel {
                            work: fwd,
                            gemm: c.fwd.iter().any(|k| k.gemm.is_some()),
                        },
                        alloc,
                        free: frees.get(value).copied().unwrap_or(0),
                        grad,
                    });
                }
                Step::Collective {
                    value,
                    stream,
                    axis,
                    ..
                } => {
                    if !keep(*value) {
                        continue;
                    }
                    let node = g.node(*value);
                    let kind = CollectiveKind::of_op(&node.op)
                        .expect("invariant: a collective step holds a collective op");
                    p.ops.push(ProgOp {
                        stream: *stream,
                        label: node.name.clone(),
                        kind: ProgKind::Collective {
                            axis: axis.clone(),
                            kind,
                            bytes: collective_bytes_routed(g, *value, opts, routed),
                        },
                        alloc: held(*value),
                        free: frees.get(value).copied().unwrap_or(0),
                        grad: None,
                    });
                }
            }
        }
        p.events = max_event;
        p.drop_dangling_waits();
        p
    }

    fn drop_dangling_waits(&mut self) {
        let recorded: BTreeSet<u32> = self
            .ops
            .iter()
            .filter_map(|o| match o.kind {
                ProgKind::Record(e) => Some(e),
                _ => None,
            })
            .collect();
        self.ops
            .retain(|o| !matches!(o.kind, ProgKind::Wait(e) if !recorded.contains(&e)));
    }

    fn push(&mut self, stream: u32, label: impl Into<String>, kind: ProgKind) {
        self.ops.push(ProgOp {
            stream,
            label: label.into(),
            kind,
            alloc: 0,
            free: 0,
            grad: None,
        });
    }

    /// A collective of `bytes` over `axis` on `stream`.
    fn push_collective(
        &mut self,
        stream: u32,
        label: String,
        axis: &str,
        kind: CollectiveKind,
        bytes: u64,
    ) {
        let axis = axis.to_string();
        self.push(stream, label, ProgKind::Collective { axis, kind, bytes });
    }

    /// Total counted FLOPs of the program's kernels.
    pub fn flops(&self) -> f64 {
        self.ops
            .iter()
            .map(|o| match &o.kind {
                ProgKind::Kernel { work, .. } => work.flops,
                _ => 0.0,
            })
            .sum()
    }

    /// Sum of kernel times (the compute stream's busy time).
    pub fn compute_time(&self) -> Seconds {
        self.ops.iter().fold(Seconds::ZERO, |acc, o| match &o.kind {
            ProgKind::Kernel { work, .. } => acc + work.time,
            _ => acc,
        })
    }

    /// The backward of this forward program (see the module docs). With `regather`, GEMMs
    /// whose input came from an all-gather repeat it before their weight gradient; with
    /// `recompute_attention`, attention cores run their forward again first (selective
    /// recomputation).
    pub fn derive_backward(&self, regather: bool, recompute_attention: bool) -> Program {
        let mut out = Program::new();
        out.streams = self.streams.clone();
        let mut next_event = self.events;
        let mut pending: Vec<ProgOp> = Vec::new();
        let flush = |out: &mut Program, pending: &mut Vec<ProgOp>| out.ops.append(pending);
        for op in self.ops.iter().rev() {
            let on_compute = op.stream == COMPUTE;
            match &op.kind {
                ProgKind::Wait(e) => {
                    // A forward wait becomes a record; on the compute stream it stays ahead of
                    // the deferred weight gradient, so the collective it enables overlaps it.
                    if !on_compute {
                        flush(&mut out, &mut pending);
                    }
                    out.push(op.stream, "", ProgKind::Record(*e));
                }
                ProgKind::Record(e) => {
                    flush(&mut out, &mut pending);
                    out.push(op.stream, "", ProgKind::Wait(*e));
                }
                ProgKind::Collective { axis, kind, bytes } => {
                    flush(&mut out, &mut pending);
                    out.push_collective(
                        op.stream,
                        format!("{}.grad", op.label),
                        axis,
                        kind.conjugate(),
                        *bytes,
                    );
                }
                ProgKind::Kernel { work, gemm } => {
                    flush(&mut out, &mut pending);
                    let Some(g) = &op.grad else { continue };
                    // Selective recomputation redoes the attention's scores for its
                    // backward; the ring's backward computes them itself (below).
                    let ring = matches!(g.exchange, Some((_, _, true)));
                    if recompute_attention && g.attention && !ring {
                        out.push(
                            op.stream,
                            format!("{}.recompute", op.label),
                            ProgKind::Kernel {
                                work: *work,
                                gemm: *gemm,
                            },
                        );
                    }
                    if let (true, Some((axis, bytes)), Some(_)) = (regather, &g.regather, &g.wgrad)
                    {
                        let label = format!("{}.regather", op.label);
                        out.push_collective(COMM, label, axis, CollectiveKind::AllGather, *bytes);
                        out.push(COMM, "", ProgKind::Record(next_event));
                        pending.push(ProgOp {
                            stream: op.stream,
                            label: String::new(),
                            kind: ProgKind::Wait(next_event),
                            alloc: 0,
                            free: 0,
                            grad: None,
                        });
                        next_event += 1;
                    }
                    // Context parallelism's K/V gathered again on the communication stream
                    // (the gradient waits for them); dK/dV are the gather's own gradient.
                    if let Some((axis, bytes, false)) = &g.exchange {
                        let label = format!("{}.kv_regather", op.label);
                        out.push_collective(COMM, label, axis, CollectiveKind::AllGather, *bytes);
                        out.push(COMM, "", ProgKind::Record(next_event));
                        out.push(op.stream, "", ProgKind::Wait(next_event));
                        next_event += 1;
                    }
                    let mut dgrad = g.dgrad;
                    let ring_done = match &g.exchange {
                        Some((axis, bytes, true)) => {
                            // The ring's backward (`RingAttentionGrad`): the scores once more
                            // for the softmax statistics (half the forward's work; recomputed,
                            // no model FLOPs counted), then the gradient, while K, then K, V
                            // and their dK/dV accumulators go round the ring (2.5 times the
                            // forward's K/V) on the communication stream from the same start;
                            // the gradients are ready when both are.
                            dgrad.time += work.time * 0.5;
                            dgrad.bytes += 0.5 * work.bytes;
                            out.push(op.stream, "", ProgKind::Record(next_event));
                            out.push(COMM, "", ProgKind::Wait(next_event));
                            let label = format!("{}.ring_grad", op.label);
                            let ag = CollectiveKind::AllGather;
                            out.push_collective(COMM, label, axis, ag, *bytes * 5 / 2);
                            out.push(COMM, "", ProgKind::Record(next_event + 1));
                            next_event += 2;
                            Some(next_event - 1)
                        }
                        _ => None,
                    };
                    out.push(
                        op.stream,
                        format!("{}.dgrad", op.label),
                        ProgKind::Kernel {
                            work: dgrad,
                            gemm: *gemm,
                        },
                    );
                    if let Some(e) = ring_done {
                        out.push(op.stream, "", ProgKind::Wait(e));
                    }
                    if let Some(w) = g.wgrad {
                        pending.push(ProgOp {
                            stream: op.stream,
                            label: format!("{}.wgrad", op.label),
                            kind: ProgKind::Kernel {
                                work: w,
                                gemm: *gemm,
                            },
                            alloc: 0,
                            free: 0,
                            grad: None,
                        });
                    }
                }
            }
        }
        flush(&mut out, &mut pending);
        out.events = next_event;
        out
    }

    /// `self` then `other`, `other`'s events renumbered after `self`'s.
    pub fn then(&self, other: &Program) -> Program {
        Program::concat([self, other])
    }

    /// `parts` one after another (the first's initial bytes; events renumbered as by
    /// [`Program::then`]).
    pub fn concat<'a>(parts: impl IntoIterator<Item = &'a Program>) -> Program {
        let mut parts = parts.into_iter();
        let Some(first) = parts.next() else {
            return Program::new();
        };
        let mut p = first.clone();
        for other in parts {
            let off = p.events;
            p.ops.extend(other.ops.iter().map(|op| {
                let mut op = op.clone();
                op.kind = match op.kind {
                    ProgKind::Record(e) => ProgKind::Record(e + off),
                    ProgKind::Wait(e) => ProgKind::Wait(e + off),
                    k => k,
                };
                op
            }));
            p.events = off + other.events;
        }
        p
    }

    /// A derived backward ([`Program::derive_backward`]) split in two, as zero-bubble
    /// schedules run it: the input-gradient pass (everything but the weight-gradient GEMMs,
    /// `*.wgrad`, and the all-gathers repeated for them, `*.regather`) and the weight-gradient
    /// pass (those alone). Both keep every event record and wait, so each replays on its own.
    pub fn split_weight_grad(&self) -> (Program, Program) {
        let weight = |o: &ProgOp| match &o.kind {
            ProgKind::Kernel { .. } => o.label.ends_with(".wgrad"),
            ProgKind::Collective { .. } => o.label.ends_with(".regather"),
            ProgKind::Record(_) | ProgKind::Wait(_) => true,
        };
        let input =
            |o: &ProgOp| matches!(o.kind, ProgKind::Record(_) | ProgKind::Wait(_)) || !weight(o);
        let keep = |f: &dyn Fn(&ProgOp) -> bool| Program {
            ops: self.ops.iter().filter(|o| f(o)).cloned().collect(),
            ..self.clone()
        };
        (keep(&input), keep(&weight))
    }

    /// A copy without memory bookkeeping (for recomputed or derived parts).
    pub fn without_memory(&self) -> Program {
        let mut p = self.clone();
        for o in &mut p.ops {
            o.alloc = 0;
            o.free = 0;
        }
        p.initial_live = 0;
        p
    }
}

/// nccl-tests size of a collective node at the simulated dtype. A dense `[experts, ..]`
/// tensor counts at the graph's [`routed_fraction`] (only routed tokens travel).
pub fn collective_bytes(g: &Graph, v: ValueId, opts: &ComputeOptions) -> u64 {
    collective_bytes_routed(g, v, opts, routed_fraction(g))
}

fn collective_bytes_routed(g: &Graph, v: ValueId, opts: &ComputeOptions, routed: f64) -> u64 {
    let n = g.node(v);
    let size = |ty: &crate::ir::TensorType| {
        let b = sim_bytes(ty, opts.dtype);
        if is_expert_major(ty) {
            b * routed
        } else {
            b
        }
    };
    let out = size(&n.ty);
    let inp = n.inputs.first().map_or(0.0, |&i| size(g.ty(i)));
    out.max(inp) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(label: &str, t: f64, wgrad: bool) -> ProgOp {
        let w = Work {
            time: Seconds(t),
            flops: 1.0,
            bytes: 0.0,
        };
        ProgOp {
            stream: COMPUTE,
            label: label.into(),
            kind: ProgKind::Kernel {
                work: w,
                gemm: true,
            },
            alloc: 0,
            free: 0,
            grad: Some(Grad {
                dgrad: w,
                wgrad: wgrad.then_some(w),
                regather: None,
                exchange: None,
                attention: false,
            }),
        }
    }

    #[test]
    fn backward_reverses_and_swaps_events() {
        // Forward: P; record 0; (comm) wait 0; all_reduce; record 1; (compute) wait 1; U.
        let mut f = Program::new();
        f.ops.push(kernel("p", 1.0, true));
        f.push(COMPUTE, "", ProgKind::Record(0));
        f.push(COMM, "", ProgKind::Wait(0));
        f.push(
            COMM,
            "ar",
            ProgKind::Collective {
                axis: "tp".into(),
                kind: CollectiveKind::AllGather,
                bytes: 8,
            },
        );
        f.push(COMM, "", ProgKind::Record(1));
        f.push(COMPUTE, "", ProgKind::Wait(1));
        f.ops.push(kernel("u", 1.0, true));
        f.events = 2;
        let b = f.derive_backward(false, false);
        let labels: Vec<String> = b
            .ops
            .iter()
            .map(|o| match &o.kind {
                ProgKind::Record(e) => format!("rec{e}@{}", o.stream),
                ProgKind::Wait(e) => format!("wait{e}@{}", o.stream),
                ProgKind::Collective { kind, .. } => kind.name().to_string(),
                ProgKind::Kernel { .. } => o.label.clone(),
            })
            .collect();
        assert_eq!(
            labels,
            [
                "u.dgrad",
                "rec1@0",
                "u.wgrad",
                "wait1@1",
                "reduce_scatter",
                "rec0@1",
                "wait0@0",
                "p.dgrad",
                "p.wgrad"
            ]
        );
        // Split for a zero-bubble schedule: the weight gradients apart, the events in both.
        let (input, weight) = b.split_weight_grad();
        let kernels = |p: &Program| -> Vec<String> {
            p.ops
                .iter()
                .filter(|o| matches!(o.kind, ProgKind::Kernel { .. }))
                .map(|o| o.label.clone())
                .collect()
        };
        assert_eq!(kernels(&input), ["u.dgrad", "p.dgrad"]);
        assert_eq!(kernels(&weight), ["u.wgrad", "p.wgrad"]);
        assert_eq!(input.flops() + weight.flops(), b.flops());
        assert!(input
            .ops
            .iter()
            .any(|o| matches!(o.kind, ProgKind::Collective { .. })));
        assert_eq!(
            weight
                .ops
                .iter()
                .filter(|o| matches!(o.kind, ProgKind::Wait(_)))
                .count(),
            2
        );
    }
}
