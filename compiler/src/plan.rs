//! The Plan: the versioned, serialisable, deterministic artifact a compile produces and a
//! runtime or simulator consumes (DESIGN §6). Same inputs ⇒ byte-identical JSON.
//!
//! Written with a content hash ([`Plan::to_json`]); read only through [`Plan::from_json`] or
//! [`Plan::load`], which refuse a file that is not a well-formed plan of this format version,
//! that fails the structural verifier ([`Plan::verify`]: every index in range, every type
//! re-derived, steps in dependency order, collectives and pipeline transfers matched), or
//! whose content no longer matches its hash. A loaded plan is safe to index.

mod accounting;
mod boundary;
mod load;
mod train;
mod verify;

pub use accounting::{CollectiveVolume, CommVolume, LayerActivations, Precision, TrainMemory};
pub use boundary::{
    boundary_name, check_boundary_types, is_received_input, sent_value, ChunkGraphs,
};
pub use load::{content_hash, rehash};
pub use train::{PlanParam, PlanStep, PlanTrain};
pub(crate) use verify::{check_layout, check_program};
pub use verify::{MAX_TENSOR_BYTES, MAX_WORLD};

use crate::ir::{DType, Graph, Op, ValueId};
use crate::schedule::{self, BufferSlot, Step};
use crate::shard::{Mesh, Provenance, ShardedGraph, TensorSharding};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use thiserror::Error;

/// Version of the plan format; bumped on any incompatible change.
pub const PLAN_FORMAT_VERSION: u32 = 6;

/// What the plan was compiled from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanModel {
    /// Model source as given (path).
    pub source: String,
    /// HF model_type.
    pub model_type: String,
    /// Decoder layers.
    pub layers: usize,
    /// Sequences per batch (global).
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

/// Per-rank memory, from the program.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanMemory {
    /// Parameter bytes per rank.
    pub param_bytes: u64,
    /// Activation arena bytes per rank (peak of live activations).
    pub activation_arena_bytes: u64,
    /// Sum of all activation bytes (without reuse).
    pub activation_total_bytes: u64,
    /// Training step accounting: parameters, gradients, optimizer states, activations kept
    /// for backward (per layer), communication buffers, peak (training plans only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train: Option<TrainMemory>,
}

/// One model chunk of a pipeline-parallel training plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanChunk {
    /// Position in the model.
    pub index: usize,
    /// The pipeline rank that runs it.
    pub stage: usize,
    /// Decoder layers `[start, end)`.
    pub layers: [usize; 2],
    /// Starts with the embedding.
    pub embed: bool,
    /// Ends with the final norm and head.
    pub head: bool,
    /// Its micro-batch's SPMD program on the stage mesh: forward, loss and backward of one
    /// micro-batch (boundary tensors unsuffixed), run once per micro-batch.
    pub program: Graph,
    /// Layout of each program value.
    pub shardings: Vec<TensorSharding>,
    /// Its optimizer step, run once per step on the sums of the micro-batches' `grad.*`
    /// outputs (and a tied copy's gradient received).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<PlanStep>,
    /// Memory per rank of this chunk.
    pub memory: PlanMemory,
    /// Communication volume per rank of this chunk (inside its stage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<CommVolume>,
}

impl PlanChunk {
    /// `embedding + layers 0..9` (see [`crate::model::StageSpec::describe`]).
    pub fn describe(&self) -> String {
        crate::model::StageSpec {
            layers: self.layers[0]..self.layers[1],
            embed: self.embed,
            head: self.head,
        }
        .describe()
    }

    /// `chunk 1 on stage 1: layers 16..31 + head`, as the command line lists a pipeline.
    pub fn placement(&self) -> String {
        format!(
            "chunk {} on stage {}: {}",
            self.index,
            self.stage,
            self.describe()
        )
    }
}

fn f32_dtype() -> DType {
    DType::F32
}

fn is_f32(d: &DType) -> bool {
    *d == DType::F32
}

/// The plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// [`PLAN_FORMAT_VERSION`].
    pub format_version: u32,
    /// Source model.
    pub model: PlanModel,
    /// Mesh.
    pub mesh: Mesh,
    /// Strategies applied.
    pub strategies: Vec<String>,
    /// The compute dtype the plan is accounted in (memory, traffic, the simulator's default):
    /// bf16 for a GPU plan. The program's values are f32, which the CPU reference runs; a
    /// plan without the field (or `f32`) is accounted in f32.
    #[serde(default = "f32_dtype", skip_serializing_if = "is_f32")]
    pub dtype: DType,
    /// The SPMD program every rank runs (local shapes; rank-dependent slices come from the
    /// rank's mesh coordinates).
    pub program: Graph,
    /// Layout of each program value.
    pub shardings: Vec<TensorSharding>,
    /// Why each collective exists.
    pub provenance: BTreeMap<u32, Provenance>,
    /// Streams by id.
    pub streams: Vec<String>,
    /// Steps in issue order.
    pub steps: Vec<Step>,
    /// Activation buffers in the arena.
    pub buffers: Vec<BufferSlot>,
    /// Memory per rank.
    pub memory: PlanMemory,
    /// The pipeline schedule, when the mesh has a `pp` axis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<crate::schedule::pp::PipelineSchedule>,
    /// Each pipeline rank's instructions: passes and the send/recv around them
    /// (pipeline-parallel training plans; `program` is then chunk 0's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pipeline_program: Vec<Vec<crate::schedule::pp::PipeOp>>,
    /// Per chunk and pass (`F`, `B`, `W`), the values of its micro-batch's program the pass
    /// computes, in order: the same for every micro-batch (received inputs are filled by
    /// their receives; the optimizer step runs the chunk's step program).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pipeline_nodes: Vec<Vec<Vec<ValueId>>>,
    /// The model chunks of a pipeline-parallel training plan, in model order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<PlanChunk>,
    /// Communication volume per rank per step (training plans only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<CommVolume>,
    /// How a training plan steps: micro-batches, loss divisor, optimizer, and every trainable
    /// parameter's checkpoint binding and program inputs/outputs (training plans only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train: Option<PlanTrain>,
    /// What the rewrite pass did (when rules ran).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewrite: Option<crate::rewrite::RewriteReport>,
    /// A training plan without a pipeline: the program run once per step after `program`
    /// (then the micro-batch's program) ran once per micro-batch (see [`PlanStep`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<PlanStep>,
}

/// A plan that fails a static check or cannot be read. Every message is one line and names
/// what is wrong: the field, node, step, buffer, rank or instruction.
#[derive(Debug, Error)]
pub enum PlanError {
    /// Ranks of a group would issue different collective sequences (a deadlock).
    #[error("ranks {a} and {b} of `{axis}` group {group:?} issue different collectives at position {pos}: {left} vs {right}")]
    CollectiveOrder {
        /// Axis.
        axis: String,
        /// The group's ranks.
        group: Vec<usize>,
        /// First rank.
        a: usize,
        /// Second rank.
        b: usize,
        /// Position in the sequence.
        pos: usize,
        /// What rank `a` issues.
        left: String,
        /// What rank `b` issues.
        right: String,
    },
    /// Wrong format version.
    #[error("plan format version {found}, this shardc reads version {expected}")]
    Version {
        /// Found.
        found: u32,
        /// Expected.
        expected: u32,
    },
    /// The file could not be read.
    #[error("cannot read the plan: {0}")]
    Io(String),
    /// The file is empty.
    #[error("empty plan file (no JSON at all)")]
    Empty,
    /// The JSON ends before the plan does.
    #[error("plan file ends early at line {line}, column {column} (truncated?)")]
    Truncated {
        /// 1-based line of the end.
        line: usize,
        /// Column of the end.
        column: usize,
    },
    /// Malformed JSON, or JSON that is not a plan object.
    #[error("malformed plan: {0}")]
    Json(String),
    /// A field is missing, has the wrong JSON type, or holds a value out of range.
    #[error("plan field `{path}`: {msg}")]
    Field {
        /// Where, e.g. `program.nodes[12].ty` or `steps[40]`.
        path: String,
        /// What is wrong.
        msg: String,
    },
    /// The mesh is not a valid mesh.
    #[error("plan mesh: {0}")]
    Mesh(String),
    /// A node of a program fails verification (type re-derivation, operands, axes, sizes).
    #[error("{program} node {node} `{name}`: {msg}")]
    Node {
        /// `program`, or `chunk 1` of a pipeline plan.
        program: String,
        /// The node.
        node: ValueId,
        /// Its name (escaped).
        name: String,
        /// What is wrong.
        msg: String,
    },
    /// A step of the program's schedule is out of range or out of order.
    #[error("step {step} ({what}): {msg}")]
    Step {
        /// Index in `steps`.
        step: usize,
        /// The step, e.g. ``kernel %6 `layers.0.mlp.act` ``.
        what: String,
        /// What is wrong.
        msg: String,
    },
    /// An arena buffer is out of range, too small, or overlaps a live one.
    #[error("buffer {index} ({what}): {msg}")]
    Buffer {
        /// Index in `buffers`.
        index: usize,
        /// The buffer's value.
        what: String,
        /// What is wrong.
        msg: String,
    },
    /// The pipeline's transfers do not match, could deadlock, or disagree on a boundary.
    #[error("plan verifier: {0}")]
    Pipeline(String),
    /// The plan has no content hash.
    #[error(
        "plan has no `hash` field: it was not written by `shardc compile` of this format version"
    )]
    MissingHash,
    /// The content does not hash to the recorded hash.
    #[error("plan hash mismatch: the file was edited after compile (expected {expected}, found {found})")]
    HashMismatch {
        /// The hash recorded in the file.
        expected: String,
        /// The hash of the file's content.
        found: String,
    },
}

/// `s` with control characters escaped, so that a name read from a file keeps a message on
/// one line.
pub(crate) fn esc(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let e: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            e
        })
        .collect()
}

/// Collectives of one layer: (op mnemonic, axis, bytes, value).
pub type LayerCollectives = Vec<(String, String, u64, ValueId)>;

/// A collective as a rank issues it, for the order check.
fn collective_sig(g: &Graph, v: ValueId) -> String {
    let n = g.node(v);
    format!("{}({} → {})", n.op.mnemonic(), g.ty(n.inputs[0]), n.ty)
}

impl Plan {
    /// A plan from an SPMD program and what it was compiled from: its steps on the streams
    /// and its activation buffers scheduled here (DESIGN §6), memory per rank from them.
    pub fn assemble(
        model: PlanModel,
        sharded: &ShardedGraph,
        strategies: Vec<String>,
        rewrite: Option<crate::rewrite::RewriteReport>,
    ) -> Plan {
        let g = &sharded.graph;
        let steps = schedule::schedule(g);
        let (buffers, arena) = schedule::arena(g);
        let param_bytes = g.params().map(|v| g.ty(v).size_bytes() as u64).sum();
        let activation_total_bytes = buffers.iter().map(|b| b.size).sum();
        let provenance = sharded
            .provenance
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.clone().map(|p| (i as u32, p)))
            .collect();
        Plan {
            format_version: PLAN_FORMAT_VERSION,
            model,
            mesh: sharded.mesh.clone(),
            strategies,
            dtype: DType::F32,
            program: g.clone(),
            shardings: sharded.shardings.clone(),
            provenance,
            streams: vec!["compute".into(), "comm".into()],
            steps,
            buffers,
            memory: PlanMemory {
                param_bytes,
                activation_arena_bytes: arena,
                activation_total_bytes,
                train: None,
            },
            pipeline: None,
            pipeline_program: Vec::new(),
            pipeline_nodes: Vec::new(),
            chunks: Vec::new(),
            comm: None,
            train: None,
            rewrite,
            step: None,
        }
    }

    /// Deterministic pretty JSON, with the content hash of everything else as its last field
    /// (`"hash": "blake3:…"`, see [`content_hash`]).
    pub fn to_json(&self) -> String {
        load::stamp(self)
    }

    /// Reads a plan from JSON text: the syntax, the format version, every field's type (an
    /// error names its path), the structural verifier ([`Plan::verify`]), then the content
    /// hash. Structural errors come before the hash check, so an edit that breaks the plan is
    /// named precisely; a consistent edit is caught by the hash.
    pub fn from_json(s: &str) -> Result<Plan, PlanError> {
        load::parse(s)
    }

    /// Reads and verifies the plan file at `path` (as [`Plan::from_json`]).
    pub fn load(path: &Path) -> Result<Plan, PlanError> {
        let bytes = std::fs::read(path).map_err(|e| PlanError::Io(e.to_string()))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            PlanError::Json(format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ))
        })?;
        Plan::from_json(&text)
    }

    /// The collectives rank `rank` issues on each axis, in order. Every rank runs the same
    /// SPMD program here; a schedule that differs per rank (pipelines) plugs in its own.
    pub fn collectives_of(&self, _rank: usize) -> BTreeMap<String, Vec<String>> {
        let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for s in &self.steps {
            if let Step::Collective { value, axis, .. } = s {
                m.entry(axis.clone())
                    .or_default()
                    .push(collective_sig(&self.program, *value));
            }
        }
        m
    }

    /// Static check: every rank of every group issues the same collectives in the same order.
    pub fn check_collective_order(&self) -> Result<(), PlanError> {
        // Every rank runs the one SPMD program: one sequence, shared.
        let same = self.collectives_of(0);
        self.check_order(&|_| Cow::Borrowed(&same))
    }

    /// The order check over per-rank collective sequences given by `seqs` (rank → axis →
    /// signatures in issue order), for schedules whose ranks run different programs.
    pub fn check_collective_order_with(
        &self,
        seqs: &dyn Fn(usize) -> BTreeMap<String, Vec<String>>,
    ) -> Result<(), PlanError> {
        self.check_order(&|r| Cow::Owned(seqs(r)))
    }

    fn check_order<'a>(
        &self,
        seqs: &dyn Fn(usize) -> Cow<'a, BTreeMap<String, Vec<String>>>,
    ) -> Result<(), PlanError> {
        let per_rank: Vec<_> = (0..self.mesh.world_size()).map(seqs).collect();
        let none = Vec::new();
        for a in self.mesh.axis_ids() {
            let name = self.mesh.axis_name(a).to_string();
            for group in self.mesh.groups(a) {
                let first = &per_rank[group[0]];
                for &r in &group[1..] {
                    let other = &per_rank[r];
                    if std::ptr::eq(first.as_ref(), other.as_ref()) {
                        continue;
                    }
                    let (f, o) = (
                        first.get(&name).unwrap_or(&none),
                        other.get(&name).unwrap_or(&none),
                    );
                    for pos in 0..f.len().max(o.len()) {
                        let (l, rr) = (f.get(pos), o.get(pos));
                        if l != rr {
                            return Err(PlanError::CollectiveOrder {
                                axis: name.clone(),
                                group: group.clone(),
                                a: group[0],
                                b: r,
                                pos,
                                left: l.cloned().unwrap_or_else(|| "nothing".into()),
                                right: rr.cloned().unwrap_or_else(|| "nothing".into()),
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The plan verifier's pipeline check (plans with a schedule): the instructions run
    /// every pass once in order, every send is received in the order sent (FIFO per rank
    /// pair) and no rank can wait forever (see
    /// [`crate::schedule::pp::PipelineSchedule::check_program`]); each boundary tensor
    /// is sent with the local type its receiver's program expects; the node lists run every
    /// value of every chunk once, on the chunk's rank, after its operands, a received input
    /// only at its receive. Sizes, indices and chunk programs are checked first, so any plan
    /// (one read from a file included) gets an error rather than a panic.
    pub fn check_pipeline(&self) -> Result<(), PlanError> {
        let Some(s) = &self.pipeline else {
            return Ok(());
        };
        verify::pipeline_ranges(self, s)?;
        s.check_program(&self.pipeline_program)
            .map_err(|e| PlanError::Pipeline(esc(&e.to_string())))?;
        if self.chunks.len() != s.chunks() {
            return Err(PlanError::Pipeline(format!(
                "the schedule has {} chunks, the plan {}",
                s.chunks(),
                self.chunks.len()
            )));
        }
        let chunks = self.chunk_graphs()?;
        self.check_pipeline_nodes()?;
        check_boundary_types(&chunks).map_err(|e| PlanError::Pipeline(esc(&e.to_string())))
    }

    /// Each chunk's micro-batch and step programs; an error names a chunk without a step
    /// program.
    pub fn chunk_graphs(&self) -> Result<Vec<ChunkGraphs<'_>>, PlanError> {
        self.chunks
            .iter()
            .map(|c| {
                let step = c.step.as_ref().ok_or_else(|| PlanError::Field {
                    path: format!("chunks[{}].step", c.index),
                    msg: "missing (every chunk has its step program)".into(),
                })?;
                Ok(ChunkGraphs {
                    micro: &c.program,
                    step: &step.program,
                })
            })
            .collect()
    }

    fn check_pipeline_nodes(&self) -> Result<(), PlanError> {
        use crate::schedule::pp::Phase;
        let err = |m: String| Err(PlanError::Pipeline(m));
        if self.pipeline_nodes.len() != self.chunks.len()
            || self.pipeline_nodes.iter().any(|n| n.len() != 3)
        {
            return err("node lists: need three passes (F, B, W) per chunk".into());
        }
        for (c, (chunk, lists)) in self.chunks.iter().zip(&self.pipeline_nodes).enumerate() {
            let g = &chunk.program;
            let mut done = vec![false; g.len()];
            let phases = [Phase::F, Phase::B, Phase::W];
            for (phase, list) in phases.into_iter().zip(lists) {
                // The receive of this pass's boundary input comes before it.
                let received = match phase {
                    Phase::F => g.input_named(crate::model::STAGE_INPUT),
                    Phase::B => g.input_named(crate::autodiff::PIPE_GRAD_IN),
                    Phase::W => None,
                };
                if let Some(v) = received {
                    done[v.index()] = true;
                }
                for &v in list {
                    if v.index() < g.len() && is_received_input(g, v) {
                        return err(format!(
                            "chunk {c}, pass {phase:?}: `{}` is a received input, filled by its receive",
                            esc(&g.node(v).name)
                        ));
                    }
                    if v.index() >= g.len() || done[v.index()] {
                        return err(format!(
                            "chunk {c}, pass {phase:?}: value {v} runs twice or does not exist"
                        ));
                    }
                    let node = g.node(v);
                    if let Some(i) = node.inputs.iter().find(|i| !done[i.index()]) {
                        return err(format!(
                            "chunk {c}, pass {phase:?}: `{}` runs before its operand {i}",
                            esc(&node.name)
                        ));
                    }
                    done[v.index()] = true;
                }
            }
            if let Some(v) = done.iter().position(|x| !x) {
                return err(format!(
                    "value %{v} `{}` of chunk {c} never runs",
                    esc(&g.node(ValueId(v as u32)).name)
                ));
            }
        }
        Ok(())
    }

    /// Collectives per layer (`None`: outside layers): (op, axis, bytes, value).
    pub fn collectives_by_layer(&self) -> BTreeMap<Option<u32>, LayerCollectives> {
        let mut m: BTreeMap<Option<u32>, Vec<_>> = BTreeMap::new();
        let g = &self.program;
        for s in &self.steps {
            let (value, axis, bytes) = match s {
                Step::Collective {
                    value, axis, bytes, ..
                } => (*value, axis.clone(), *bytes),
                // A compute op with its exchange inside (ring attention, collective matmuls):
                // the gathered operands' bytes, as the collective it replaces would count them.
                Step::Kernel { value, .. } | Step::Gemm { value, .. } => {
                    let n = g.node(*value);
                    let (Some(axis), true) = (n.op.axis(), n.op.communicates()) else {
                        continue;
                    };
                    let bytes = match &n.op {
                        Op::RingAttention { parts, .. } => n.inputs[1..3]
                            .iter()
                            .map(|&i| g.ty(i).size_bytes() as u64 * *parts as u64)
                            .sum(),
                        // K once for the statistics, then K, V and their accumulators.
                        Op::RingAttentionGrad { parts, .. } => {
                            let (k, v) = (g.ty(n.inputs[1]), g.ty(n.inputs[2]));
                            (3 * k.size_bytes() + 2 * v.size_bytes()) as u64 * *parts as u64
                        }
                        Op::AgMatMul { parts, .. } => {
                            g.ty(n.inputs[0]).size_bytes() as u64 * *parts as u64
                        }
                        Op::MatMulRs { parts, .. } => n.ty.size_bytes() as u64 * *parts as u64,
                        _ => 0,
                    };
                    (*value, axis.to_string(), bytes)
                }
                _ => continue,
            };
            let n = g.node(value);
            m.entry(n.layer)
                .or_default()
                .push((n.op.mnemonic().to_string(), axis, bytes, value));
        }
        m
    }

    /// Bytes of values produced by norms and residual adds (per rank): the activations that
    /// sequence parallelism shards.
    pub fn norm_residual_bytes(&self) -> u64 {
        self.program
            .ids()
            .filter(|&v| {
                let n = self.program.node(v);
                matches!(n.op, Op::RmsNorm { .. } | Op::LayerNorm { .. })
                    || (matches!(n.op, Op::Add) && n.name.ends_with(".residual"))
            })
            .map(|v| self.program.ty(v).size_bytes() as u64)
            .sum()
    }
}
