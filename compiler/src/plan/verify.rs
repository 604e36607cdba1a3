//! The plan verifier, run on every plan read from a file ([`Plan::verify`]).
//!
//! Pre: a plan that deserialised. Post (on `Ok`): every index the plan holds is in range
//! (node operands and outputs, steps, buffers, provenance, shardings, pipeline instructions
//! and node lists, chunk programs, streams, events); every node's type equals what its op
//! infers from its operands and no tensor is absurdly large; every axis an op or a sharding
//! names is a mesh axis of the size the op was partitioned for; the steps run every node once,
//! after its operands, each wait after its record; the arena's live buffers do not overlap;
//! layer labels cover the model's layers; the collective order agrees across ranks and a
//! pipeline's transfers match ([`Plan::check_pipeline`]). Consumers (explain, simulate,
//! schedule) may then index the plan freely.

use super::{esc, Plan, PlanError};
use crate::ir::{Graph, Op, TensorType, ValueId};
use crate::schedule::pp::{Carry, Phase, PipeOp, PipelineSchedule};
use crate::schedule::{collective_bytes, Step};
use crate::shard::{Mesh, TensorSharding, KNOWN_AXES};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Range;

/// Most ranks a plan's mesh may have.
pub const MAX_WORLD: usize = 1 << 20;
/// Largest tensor a plan may hold, in bytes (1 PiB).
pub const MAX_TENSOR_BYTES: u64 = 1 << 50;
/// Largest sum of a program's tensor sizes, so that sums over a program cannot overflow.
const MAX_PROGRAM_BYTES: u64 = 1 << 60;
/// Largest `batch × seq` (tokens per step), exact in an `f64`.
const MAX_TOKENS: usize = 1 << 53;

fn field(path: impl Into<String>, msg: impl Into<String>) -> PlanError {
    PlanError::Field {
        path: path.into(),
        msg: msg.into(),
    }
}

impl Plan {
    /// The structural verifier (see the module docs): everything [`Plan::from_json`] checks
    /// but the syntax, the version and the hash.
    pub fn verify(&self) -> Result<(), PlanError> {
        check_mesh(&self.mesh)?;
        if !matches!(
            self.dtype,
            crate::ir::DType::Bf16 | crate::ir::DType::F16 | crate::ir::DType::F32
        ) {
            return Err(field(
                "dtype",
                format!(
                    "compute dtype {} is not a floating-point type (bf16, f16 or f32)",
                    self.dtype.name()
                ),
            ));
        }
        let tokens = self.model.batch.checked_mul(self.model.seq);
        if tokens.is_none_or(|t| t > MAX_TOKENS) {
            return Err(field(
                "model.batch",
                format!(
                    "batch {} × seq {} is more than {MAX_TOKENS} tokens",
                    self.model.batch, self.model.seq
                ),
            ));
        }
        let mesh = self.program_mesh();
        match &self.pipeline {
            None => {
                for (name, empty) in [
                    ("chunks", self.chunks.is_empty()),
                    ("pipeline_program", self.pipeline_program.is_empty()),
                    ("pipeline_nodes", self.pipeline_nodes.is_empty()),
                ] {
                    if !empty {
                        return Err(field(name, "present in a plan without a pipeline schedule"));
                    }
                }
                let labels = check_graph("program", "program", &self.program, &mesh, None)?;
                check_layer_cover("model.layers", &labels, 0..self.model.layers)?;
            }
            Some(_) => {
                self.check_pipeline()?;
                for (i, c) in self.chunks.iter().enumerate() {
                    let path = format!("chunks[{i}]");
                    let [a, b] = c.layers;
                    let labels = check_graph(
                        &format!("chunk {i}"),
                        &format!("{path}.program"),
                        &c.program,
                        &mesh,
                        Some(a..b),
                    )?;
                    check_layer_cover(&format!("{path}.layers"), &labels, a..b)?;
                    let s = format!("{path}.shardings");
                    check_shardings(&s, &c.shardings, &c.program, &mesh)?;
                    let st = c.step.as_ref().ok_or_else(|| {
                        field(
                            format!("{path}.step"),
                            "missing (every chunk has its step program)",
                        )
                    })?;
                    check_step(
                        &format!("{path}.step"),
                        &format!("chunk {i}'s step program"),
                        st,
                        &mesh,
                    )?;
                    super::train::check_step_names(
                        &c.program,
                        &c.shardings,
                        st,
                        &mesh,
                        &format!("{path}.step.program"),
                    )?;
                }
                if self.program != self.chunks[0].program {
                    return Err(field("program", "differs from chunk 0's program"));
                }
                if self.shardings != self.chunks[0].shardings {
                    return Err(field("shardings", "differ from chunk 0's shardings"));
                }
            }
        }
        check_shardings("shardings", &self.shardings, &self.program, &mesh)?;
        let programs: Vec<super::train::TrainPrograms> = if self.chunks.is_empty() {
            vec![(&self.program, &self.shardings, self.step.as_ref())]
        } else {
            self.chunks
                .iter()
                .map(|c| (&c.program, &c.shardings[..], c.step.as_ref()))
                .collect()
        };
        if let Some(st) = &self.step {
            if self.pipeline.is_some() || self.train.is_none() {
                return Err(field(
                    "step",
                    "a step program belongs to a training plan without a pipeline",
                ));
            }
            check_step("step", "step program", st, &mesh)?;
            super::train::check_step_names(
                &self.program,
                &self.shardings,
                st,
                &mesh,
                "step.program",
            )?;
        }
        super::train::check_train(self, &programs, &mesh)?;
        let n = self.program.len();
        if let Some(&k) = self.provenance.keys().find(|&&k| k as usize >= n) {
            return Err(field(
                "provenance",
                format!("key {k} is not a node of the program (it has {n})"),
            ));
        }
        self.check_steps()?;
        self.check_buffers()?;
        self.check_collective_order()
    }

    /// The mesh the SPMD program runs on: a pipeline stage's (without `pp`) for pipeline plans.
    fn program_mesh(&self) -> Mesh {
        if self.pipeline.is_some() {
            self.mesh.without_axis("pp")
        } else {
            self.mesh.clone()
        }
    }

    /// Every node of the program scheduled once, as a step of its kind, after its operands;
    /// collectives on their axis with their size; streams named; each wait after its record.
    fn check_steps(&self) -> Result<(), PlanError> {
        self.check_steps_of("program", &self.program, &self.steps)?;
        match &self.step {
            Some(st) => self.check_steps_of("step program", &st.program, &st.steps),
            None => Ok(()),
        }
    }

    /// [`Plan::check_steps`] of one program (`label` names it in errors).
    fn check_steps_of(&self, label: &str, g: &Graph, steps: &[Step]) -> Result<(), PlanError> {
        let scheduled = |op: &Op| !matches!(op, Op::Input { .. } | Op::Param(_));
        // Where each value is first computed.
        let mut at: Vec<Option<usize>> = vec![None; g.len()];
        for (k, s) in steps.iter().enumerate() {
            let (value, stream) = match s {
                Step::Kernel { value, stream }
                | Step::Gemm { value, stream }
                | Step::Collective { value, stream, .. } => (Some(*value), *stream),
                Step::Record { stream, .. } | Step::Wait { stream, .. } => (None, *stream),
            };
            if stream as usize >= self.streams.len() {
                return Err(PlanError::Step {
                    step: k,
                    what: step_kind(s).into(),
                    msg: format!(
                        "stream {stream} is not a stream of the plan (it has {})",
                        self.streams.len()
                    ),
                });
            }
            if let Some(v) = value {
                if v.index() >= g.len() {
                    return Err(PlanError::Step {
                        step: k,
                        what: format!("{} {v}", step_kind(s)),
                        msg: format!("not a node of the program (it has {})", g.len()),
                    });
                }
                at[v.index()].get_or_insert(k);
            }
        }
        let mut done = vec![false; g.len()];
        let mut recorded: HashMap<u32, usize> = HashMap::new();
        for (k, s) in steps.iter().enumerate() {
            let v = match s {
                Step::Record { event, .. } => {
                    if let Some(j) = recorded.insert(*event, k) {
                        return Err(PlanError::Step {
                            step: k,
                            what: "record".into(),
                            msg: format!("event {event} is recorded twice (first at step {j})"),
                        });
                    }
                    continue;
                }
                Step::Wait { event, .. } => {
                    if !recorded.contains_key(event) {
                        return Err(PlanError::Step {
                            step: k,
                            what: "wait".into(),
                            msg: format!("waits for event {event}, which no earlier step records"),
                        });
                    }
                    continue;
                }
                Step::Kernel { value, .. }
                | Step::Gemm { value, .. }
                | Step::Collective { value, .. } => *value,
            };
            let node = g.node(v);
            let what = format!("{} {v} `{}`", step_kind(s), esc(&node.name));
            let bad = |msg: String| {
                Err(PlanError::Step {
                    step: k,
                    what: what.clone(),
                    msg,
                })
            };
            if !scheduled(&node.op) {
                return bad(format!(
                    "{} nodes are not steps (the caller provides them)",
                    node.op.mnemonic()
                ));
            }
            let kind = if node.op.is_collective() {
                "collective"
            } else if matches!(node.op, Op::MatMul { .. }) {
                "gemm"
            } else {
                "kernel"
            };
            if kind != step_kind(s) {
                return bad(format!(
                    "a {} node must be a {kind} step",
                    node.op.mnemonic()
                ));
            }
            if done[v.index()] {
                return bad(format!(
                    "scheduled twice (first at step {})",
                    at[v.index()].unwrap_or(k)
                ));
            }
            for &i in &node.inputs {
                if scheduled(&g.node(i).op) && !done[i.index()] {
                    let when = match at[i.index()] {
                        Some(j) => format!("scheduled at step {j}"),
                        None => "never scheduled".into(),
                    };
                    return bad(format!(
                        "runs before its operand {i} `{}` ({when})",
                        esc(&g.node(i).name)
                    ));
                }
            }
            if let Step::Collective { axis, bytes, .. } = s {
                let want = node.op.axis().unwrap_or_default();
                if axis != want {
                    return bad(format!(
                        "on axis `{}`, but the node communicates over `{want}`",
                        esc(axis)
                    ));
                }
                let size = collective_bytes(g, v);
                if *bytes != size {
                    return bad(format!(
                        "{bytes} bytes, but the node's buffers are {size} bytes"
                    ));
                }
            }
            done[v.index()] = true;
        }
        if let Some(v) = g
            .ids()
            .find(|&v| scheduled(&g.node(v).op) && !done[v.index()])
        {
            return Err(PlanError::Node {
                program: label.into(),
                node: v,
                name: esc(&g.node(v).name),
                msg: "no step computes it".into(),
            });
        }
        Ok(())
    }

    /// One arena buffer per activation (non-input, non-parameter value), each at least its
    /// type's size, none overlapping another while both are live; the memory totals agree.
    fn check_buffers(&self) -> Result<(), PlanError> {
        let g = &self.program;
        let n = g.len();
        let mut last: Vec<usize> = (0..n).collect();
        for v in g.ids() {
            for &i in &g.node(v).inputs {
                last[i.index()] = v.index();
            }
        }
        for &(_, v) in &g.outputs {
            last[v.index()] = n;
        }
        let mut slot: Vec<Option<usize>> = vec![None; n];
        let (mut end, mut total) = (0u64, 0u64);
        for (i, b) in self.buffers.iter().enumerate() {
            let bad = |what: String, msg: String| {
                Err(PlanError::Buffer {
                    index: i,
                    what,
                    msg,
                })
            };
            let v = b.value;
            if v.index() >= n {
                return bad(
                    format!("{v}"),
                    format!("not a node of the program (it has {n})"),
                );
            }
            let node = g.node(v);
            let what = format!("{v} `{}`", esc(&node.name));
            if matches!(node.op, Op::Input { .. } | Op::Param(_)) {
                return bad(
                    what,
                    format!("a {} is not an arena activation", node.op.mnemonic()),
                );
            }
            if let Some(j) = slot[v.index()].replace(i) {
                return bad(what, format!("the value already has buffer {j}"));
            }
            let need = node.ty.size_bytes() as u64;
            if b.size < need {
                return bad(
                    what,
                    format!(
                        "{} bytes, smaller than its type {} ({need} bytes)",
                        b.size, node.ty
                    ),
                );
            }
            let Some(e) = b.offset.checked_add(b.size) else {
                return bad(
                    what,
                    format!("offset {} + size {} overflows", b.offset, b.size),
                );
            };
            end = end.max(e);
            total = total.saturating_add(b.size);
        }
        if let Some(v) = g.ids().find(|&v| {
            !matches!(g.node(v).op, Op::Input { .. } | Op::Param(_)) && slot[v.index()].is_none()
        }) {
            return Err(PlanError::Node {
                program: "program".into(),
                node: v,
                name: esc(&g.node(v).name),
                msg: "has no arena buffer".into(),
            });
        }
        // Live ranges [def, last use] in program order; overlapping ones must not share bytes.
        let mut live: Vec<usize> = Vec::new();
        for v in g.ids() {
            let Some(i) = slot[v.index()] else { continue };
            live.retain(|&j| last[self.buffers[j].value.index()] >= v.index());
            let b = &self.buffers[i];
            if let Some(&j) = live.iter().find(|&&j| {
                let o = &self.buffers[j];
                b.offset < o.offset + o.size && o.offset < b.offset + b.size
            }) {
                return Err(PlanError::Buffer {
                    index: i,
                    what: format!("{v} `{}`", esc(&g.node(v).name)),
                    msg: format!(
                        "bytes {}..{} overlap buffer {j} of {} while both are live",
                        b.offset,
                        b.offset + b.size,
                        self.buffers[j].value
                    ),
                });
            }
            live.push(i);
        }
        let m = &self.memory;
        if m.activation_arena_bytes != end {
            return Err(field(
                "memory.activation_arena_bytes",
                format!(
                    "{}, but the buffers end at byte {end}",
                    m.activation_arena_bytes
                ),
            ));
        }
        if m.activation_total_bytes != total {
            return Err(field(
                "memory.activation_total_bytes",
                format!(
                    "{}, but the buffers add up to {total}",
                    m.activation_total_bytes
                ),
            ));
        }
        Ok(())
    }
}

fn step_kind(s: &Step) -> &'static str {
    match s {
        Step::Kernel { .. } => "kernel",
        Step::Gemm { .. } => "gemm",
        Step::Collective { .. } => "collective",
        Step::Record { .. } => "record",
        Step::Wait { .. } => "wait",
    }
}

/// Axis sizes positive, names known and unique, the world bounded.
pub(super) fn check_mesh(mesh: &Mesh) -> Result<(), PlanError> {
    let err = |m: String| Err(PlanError::Mesh(m));
    if mesh.gpus_per_node == 0 {
        return err("gpus_per_node is 0".into());
    }
    let mut seen = HashSet::new();
    let mut world = 1usize;
    for a in &mesh.axes {
        if !KNOWN_AXES.contains(&a.name.as_str()) {
            return err(format!(
                "axis `{}` is not a known axis (valid: {})",
                esc(&a.name),
                KNOWN_AXES.join(", ")
            ));
        }
        if !seen.insert(a.name.as_str()) {
            return err(format!("axis `{}` appears twice", a.name));
        }
        if a.size == 0 {
            return err(format!("axis `{}` has size 0", a.name));
        }
        world = match world.checked_mul(a.size).filter(|&w| w <= MAX_WORLD) {
            Some(w) => w,
            None => return err(format!("more than {MAX_WORLD} ranks (axis `{}`)", a.name)),
        };
    }
    Ok(())
}

/// Checks one program: operands defined before use, outputs defined, input names unique,
/// every node's type re-derived by type inference and equal to the stored one, tensor sizes
/// bounded, axes of the mesh with the partitioned sizes, layer labels in `layers` (any when
/// `None`). Returns the layer labels used. `label` names the program in node errors
/// (`program`, `chunk 1`), `path` in field errors.
fn check_graph(
    label: &str,
    path: &str,
    g: &Graph,
    mesh: &Mesh,
    layers: Option<Range<usize>>,
) -> Result<BTreeSet<u32>, PlanError> {
    let node_err = |v: ValueId, msg: String| PlanError::Node {
        program: label.to_string(),
        node: v,
        name: esc(&g.nodes[v.index()].name),
        msg,
    };
    check_indices(label, path, g)?;
    let mut labels = BTreeSet::new();
    let mut input_names = HashSet::new();
    let mut total = 0u64;
    for v in g.ids() {
        let n = g.node(v);
        let bytes =
            n.ty.checked_numel()
                .and_then(|e| (e as u64).checked_mul(n.ty.dtype.size_bytes() as u64))
                .filter(|&b| b <= MAX_TENSOR_BYTES);
        let Some(bytes) = bytes else {
            return Err(node_err(
                v,
                format!("type {} is larger than {MAX_TENSOR_BYTES} bytes", n.ty),
            ));
        };
        total = total.saturating_add(bytes);
        if total > MAX_PROGRAM_BYTES {
            return Err(node_err(
                v,
                format!("the program's tensors add up to more than {MAX_PROGRAM_BYTES} bytes"),
            ));
        }
        if let Op::Input { name, shards } = &n.op {
            if !input_names.insert(name.as_str()) {
                return Err(node_err(
                    v,
                    format!("input `{}` is defined twice", esc(name)),
                ));
            }
            for s in shards {
                check_axis(mesh, &s.axis, Some(s.parts), "input shard")
                    .map_err(|m| node_err(v, m))?;
                if s.dim >= n.ty.rank() {
                    return Err(node_err(
                        v,
                        format!("shard of dim {} of a rank-{} input", s.dim, n.ty.rank()),
                    ));
                }
            }
        }
        let tys: Vec<&TensorType> = n.inputs.iter().map(|&i| g.ty(i)).collect();
        match n.op.infer(&tys, Some(&n.ty)) {
            Ok(t) if t.dtype == n.ty.dtype && t.same_shape(&n.ty) => {}
            Ok(t) => {
                return Err(node_err(
                    v,
                    format!(
                        "stored type {} but its operands give {t} ({})",
                        n.ty,
                        n.op.mnemonic()
                    ),
                ))
            }
            Err(e) => return Err(node_err(v, esc(&e.to_string()))),
        }
        if let Some(axis) = n.op.axis() {
            let parts = match &n.op {
                Op::ReduceScatter { parts, .. }
                | Op::AllGather { parts, .. }
                | Op::AllToAll { parts, .. }
                | Op::LocalSlice { parts, .. }
                | Op::CrossEntropyStats { parts, .. }
                | Op::AgMatMul { parts, .. }
                | Op::MatMulRs { parts, .. }
                | Op::RingAttention { parts, .. }
                | Op::RingAttentionGrad { parts, .. } => Some(*parts),
                _ => None,
            };
            check_axis(mesh, axis, parts, n.op.mnemonic()).map_err(|m| node_err(v, m))?;
            if let Op::Broadcast { root, .. } = &n.op {
                let size = mesh.axis(axis).map_or(0, |a| mesh.axis_size(a));
                if *root >= size {
                    return Err(node_err(
                        v,
                        format!("root {root} outside the {size} ranks of `{axis}`"),
                    ));
                }
            }
        }
        if let Some(l) = n.layer {
            if layers.as_ref().is_some_and(|r| !r.contains(&(l as usize))) {
                let r = layers.as_ref().expect("invariant: checked above");
                return Err(node_err(
                    v,
                    format!("labelled layer {l}, outside this program's layers {r:?}"),
                ));
            }
            labels.insert(l);
        }
    }
    Ok(labels)
}

/// The indices of a program alone (operands defined before use, outputs defined): what the
/// pipeline checks need before [`check_graph`] (which starts with them) re-derives the types.
fn check_indices(label: &str, path: &str, g: &Graph) -> Result<(), PlanError> {
    for v in g.ids() {
        let n = g.node(v);
        if let Some(&bad) = n.inputs.iter().find(|i| i.index() >= v.index()) {
            return Err(PlanError::Node {
                program: label.to_string(),
                node: v,
                name: esc(&n.name),
                msg: format!("operand {bad} is not a node defined before it"),
            });
        }
    }
    for (i, (name, v)) in g.outputs.iter().enumerate() {
        if v.index() >= g.len() {
            return Err(field(
                format!("{path}.outputs[{i}]"),
                format!(
                    "output `{}` = {v} is not a node (the program has {})",
                    esc(name),
                    g.len()
                ),
            ));
        }
    }
    Ok(())
}

/// `axis` is a mesh axis and, when the op is partitioned into `parts`, of that size.
fn check_axis(mesh: &Mesh, axis: &str, parts: Option<usize>, what: &str) -> Result<(), String> {
    let Some(a) = mesh.axis(axis) else {
        return Err(format!(
            "{what} over `{}`, which is not an axis of mesh {mesh}",
            esc(axis)
        ));
    };
    let size = mesh.axis_size(a);
    match parts {
        Some(p) if p != size => Err(format!(
            "{what} over `{axis}` in {p} parts, but `{axis}` has {size} ranks in mesh {mesh}"
        )),
        _ => Ok(()),
    }
}

/// The layer labels of a program are exactly `range` (each layer has nodes).
fn check_layer_cover(
    path: &str,
    labels: &BTreeSet<u32>,
    range: Range<usize>,
) -> Result<(), PlanError> {
    let inside = labels.iter().all(|&l| range.contains(&(l as usize)));
    if !inside || labels.len() != range.len() {
        let have = match (labels.first(), labels.last()) {
            (Some(a), Some(b)) => format!("{} distinct layers in {a}..={b}", labels.len()),
            _ => "no layer labels".into(),
        };
        return Err(field(
            path,
            format!("layers {range:?}, but the program's nodes carry {have}"),
        ));
    }
    Ok(())
}

/// An SPMD program alone (the compile driver's check after each pass): [`check_graph`] with
/// any layer labels, then [`check_shardings`].
pub(crate) fn check_program(
    g: &Graph,
    shardings: &[TensorSharding],
    mesh: &Mesh,
) -> Result<(), PlanError> {
    check_graph("program", "program", g, mesh, None)?;
    check_shardings("shardings", shardings, g, mesh)
}

/// A layout of a rank-`rank` value over distinct axes of `mesh`.
pub(crate) fn check_layout(s: &TensorSharding, rank: usize, mesh: &Mesh) -> Result<(), String> {
    if s.dims.len() != rank {
        return Err(format!(
            "layout of {} dims for a value of rank {rank}",
            s.dims.len()
        ));
    }
    let mut seen = HashSet::new();
    for a in s.used_axes() {
        if a.0 as usize >= mesh.axes.len() {
            return Err(format!(
                "axis {a} is not an axis of mesh {mesh} (it has {})",
                mesh.axes.len()
            ));
        }
        if !seen.insert(a) {
            return Err(format!("axis `{}` is used twice", mesh.axis_name(a)));
        }
    }
    Ok(())
}

/// One entry per node, of the node's rank, over distinct axes of `mesh`.
fn check_shardings(
    path: &str,
    shardings: &[TensorSharding],
    g: &Graph,
    mesh: &Mesh,
) -> Result<(), PlanError> {
    if shardings.len() != g.len() {
        return Err(field(
            path,
            format!(
                "{} entries for a program of {} nodes",
                shardings.len(),
                g.len()
            ),
        ));
    }
    for (i, (s, n)) in shardings.iter().zip(&g.nodes).enumerate() {
        check_layout(s, n.ty.rank(), mesh)
            .map_err(|m| field(format!("{path}[{i}]"), format!("node %{i}: {m}")))?;
    }
    Ok(())
}

/// The pipeline plan's sizes and indices, before any check that indexes with them: the `pp`
/// axis and the schedule agree, chunks in order on their ranks covering the model's layers,
/// each chunk program's indices in range (its types are re-derived by [`Plan::verify`] after
/// the pipeline checks), every instruction's ranks, micro-batches, boundaries and chunks in
/// range, and each rank's passes those of the schedule.
pub(super) fn pipeline_ranges(plan: &Plan, s: &PipelineSchedule) -> Result<(), PlanError> {
    check_mesh(&plan.mesh)?;
    let Some(pp) = plan.mesh.axis("pp") else {
        return Err(PlanError::Pipeline(format!(
            "the plan has a pipeline schedule but its mesh {} has no `pp` axis",
            plan.mesh
        )));
    };
    let p = plan.mesh.axis_size(pp);
    if s.stages != p {
        return Err(field(
            "pipeline.stages",
            format!("{}, but the mesh's `pp` axis has {p} ranks", s.stages),
        ));
    }
    let v = s.virtual_stages;
    let n = p.checked_mul(v).filter(|&n| n == plan.chunks.len());
    let Some(n) = n.filter(|_| v > 0) else {
        return Err(field(
            "chunks",
            format!(
                "{} chunks, but the schedule has {p} stages × {v} virtual stages",
                plan.chunks.len()
            ),
        ));
    };
    let instructions: usize = plan.pipeline_program.iter().map(Vec::len).sum();
    let m = s.micro_batches;
    if m == 0 || m > instructions {
        return Err(field(
            "pipeline.micro_batches",
            format!("{m}, but the plan has {instructions} pipeline instructions"),
        ));
    }
    if plan.pipeline_program.len() != p {
        return Err(field(
            "pipeline_program",
            format!(
                "{} ranks, but the schedule has {p}",
                plan.pipeline_program.len()
            ),
        ));
    }
    if s.per_rank.len() != p {
        return Err(field(
            "pipeline.per_rank",
            format!("{} ranks, but the schedule has {p}", s.per_rank.len()),
        ));
    }
    // Chunks: in order, on rank `index mod p`, consecutive layer ranges covering the model.
    let mut next = 0usize;
    for (i, c) in plan.chunks.iter().enumerate() {
        let path = format!("chunks[{i}]");
        if c.index != i {
            return Err(field(
                format!("{path}.index"),
                format!("{}, expected {i}", c.index),
            ));
        }
        if c.stage != i % p {
            return Err(field(
                format!("{path}.stage"),
                format!("{}, but chunk {i} runs on pipeline rank {}", c.stage, i % p),
            ));
        }
        let [a, b] = c.layers;
        if a != next || b < a {
            return Err(field(
                format!("{path}.layers"),
                format!("[{a}, {b}), but the previous chunk ends at layer {next}"),
            ));
        }
        next = b;
        check_indices(
            &format!("chunk {i}"),
            &format!("{path}.program"),
            &c.program,
        )?;
    }
    if next != plan.model.layers {
        return Err(field(
            "model.layers",
            format!(
                "{}, but the chunks cover layers 0..{next}",
                plan.model.layers
            ),
        ));
    }
    // Instructions: every rank, micro-batch, boundary and chunk in range.
    for (r, ops) in plan.pipeline_program.iter().enumerate() {
        for (k, op) in ops.iter().enumerate() {
            let bad = |msg: String| {
                Err(PlanError::Pipeline(format!(
                    "rank {r}, instruction {k} ({op}): {msg}"
                )))
            };
            match *op {
                PipeOp::Recv {
                    from: peer,
                    carry,
                    micro,
                    boundary,
                }
                | PipeOp::Send {
                    to: peer,
                    carry,
                    micro,
                    boundary,
                } => {
                    if peer >= p {
                        return bad(format!("rank {peer} is not one of the {p} pipeline ranks"));
                    }
                    if micro >= m {
                        return bad(format!("micro-batch {micro} of {m}"));
                    }
                    let ok = match carry {
                        Carry::Act | Carry::Grad => boundary + 1 < n,
                        Carry::Tied => n > 1 && (boundary == 0 || boundary == n - 1),
                    };
                    if !ok {
                        return bad(format!("no such boundary between {n} chunks"));
                    }
                }
                PipeOp::Run(slot) => {
                    if slot.micro >= m || slot.chunk >= n {
                        return bad(format!("not a pass of {m} micro-batches and {n} chunks"));
                    }
                }
                PipeOp::Step { chunk } => {
                    if chunk >= n {
                        return bad(format!("chunk {chunk} of {n}"));
                    }
                }
            }
        }
    }
    // The schedule's slots are the passes of the instructions (`W` after `B` added where the
    // schedule does not split weight gradients).
    let split = s.splits_weight_grad();
    for (r, (slots, ops)) in s.per_rank.iter().zip(&plan.pipeline_program).enumerate() {
        let runs: Vec<_> = ops
            .iter()
            .filter_map(|o| match o {
                PipeOp::Run(x) if split || x.phase != Phase::W => Some(*x),
                _ => None,
            })
            .collect();
        if *slots != runs {
            let j = slots
                .iter()
                .zip(&runs)
                .position(|(a, b)| a != b)
                .unwrap_or(slots.len().min(runs.len()));
            return Err(PlanError::Pipeline(format!(
                "rank {r}: the schedule's slot {j} differs from the passes of its instructions"
            )));
        }
    }
    Ok(())
}

/// A step program (`path`: its field; `what`: its name in messages): its graph, layouts and
/// provenance keys.
fn check_step(path: &str, what: &str, st: &super::PlanStep, mesh: &Mesh) -> Result<(), PlanError> {
    check_graph(what, &format!("{path}.program"), &st.program, mesh, None)?;
    check_shardings(
        &format!("{path}.shardings"),
        &st.shardings,
        &st.program,
        mesh,
    )?;
    let n = st.program.len();
    if let Some(&k) = st.provenance.keys().find(|&&k| k as usize >= n) {
        return Err(field(
            format!("{path}.provenance"),
            format!("key {k} is not a node of the step program (it has {n})"),
        ));
    }
    Ok(())
}
