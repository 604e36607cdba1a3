//! The Plan: the versioned, serialisable, deterministic artifact a compile produces and a
//! runtime or simulator consumes (DESIGN §6). Same inputs ⇒ byte-identical JSON.

use crate::ir::{Graph, Op, ValueId};
use crate::pipeline::Compiled;
use crate::schedule::{self, BufferSlot, Step};
use crate::shard::{Mesh, Provenance, TensorSharding};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use thiserror::Error;

/// Version of the plan format; bumped on any incompatible change.
pub const PLAN_FORMAT_VERSION: u32 = 1;

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
    pub train: Option<crate::train::TrainMemory>,
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
    /// Its SPMD training program on the stage mesh (every micro-batch, its optimizer step).
    pub program: Graph,
    /// Layout of each program value.
    pub shardings: Vec<TensorSharding>,
    /// Memory per rank of this chunk.
    pub memory: PlanMemory,
    /// Communication volume per rank of this chunk (inside its stage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<crate::train::CommVolume>,
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
    pub pipeline: Option<crate::schedule::pipeline::PipelineSchedule>,
    /// Each pipeline rank's instructions: passes and the send/recv around them
    /// (pipeline-parallel training plans; `program` is then chunk 0's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pipeline_program: Vec<Vec<crate::schedule::pipeline::PipeOp>>,
    /// Per pipeline rank and instruction, the values of its chunk's program it computes, in
    /// order (a receive: the input it fills; a send: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pipeline_nodes: Vec<Vec<Vec<ValueId>>>,
    /// The model chunks of a pipeline-parallel training plan, in model order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<PlanChunk>,
    /// Communication volume per rank per step (training plans only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<crate::train::CommVolume>,
    /// What the rewrite pass did (when rules ran).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewrite: Option<crate::rewrite::RewriteReport>,
}

/// A plan that fails a static check or cannot be read.
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
    /// Malformed JSON.
    #[error("malformed plan: {0}")]
    Json(String),
    /// The pipeline's transfers do not match, could deadlock, or disagree on a boundary.
    #[error("plan verifier: {0}")]
    Pipeline(String),
}

/// Collectives of one layer: (op mnemonic, axis, bytes, value).
pub type LayerCollectives = Vec<(String, String, u64, ValueId)>;

/// A collective as a rank issues it, for the order check.
fn collective_sig(g: &Graph, v: ValueId) -> String {
    let n = g.node(v);
    format!("{}({} → {})", n.op.mnemonic(), g.ty(n.inputs[0]), n.ty)
}

impl Plan {
    /// Builds the plan of a compiled program.
    pub fn new(c: &Compiled, source: &str, model_type: &str, layers: usize) -> Plan {
        let g = &c.sharded.graph;
        let steps = schedule::schedule(g);
        let (buffers, arena) = schedule::arena(g);
        let param_bytes = g.params().map(|v| g.ty(v).size_bytes() as u64).sum();
        let activation_total_bytes = buffers.iter().map(|b| b.size).sum();
        let provenance = c
            .sharded
            .provenance
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.clone().map(|p| (i as u32, p)))
            .collect();
        let batch = c
            .logical
            .input_named("input_ids")
            .map_or(0, |v| c.logical.ty(v).dim(0));
        let seq = c
            .logical
            .input_named("input_ids")
            .map_or(0, |v| c.logical.ty(v).dim(1));
        Plan {
            format_version: PLAN_FORMAT_VERSION,
            model: PlanModel {
                source: source.to_string(),
                model_type: model_type.to_string(),
                layers,
                batch,
                seq,
            },
            mesh: c.sharded.mesh.clone(),
            strategies: c.strategies.iter().map(|s| s.name().to_string()).collect(),
            program: g.clone(),
            shardings: c.sharded.shardings.clone(),
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
            rewrite: c.report.clone(),
        }
    }

    /// Deterministic pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("invariant: a plan serialises")
    }

    /// Reads a plan, checking its version.
    pub fn from_json(s: &str) -> Result<Plan, PlanError> {
        let v: serde_json::Value =
            serde_json::from_str(s).map_err(|e| PlanError::Json(e.to_string()))?;
        let found = v
            .get("format_version")
            .and_then(|x| x.as_u64())
            .unwrap_or(0) as u32;
        if found != PLAN_FORMAT_VERSION {
            return Err(PlanError::Version {
                found,
                expected: PLAN_FORMAT_VERSION,
            });
        }
        serde_json::from_value(v).map_err(|e| PlanError::Json(e.to_string()))
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
        self.check_collective_order_with(&|r| self.collectives_of(r))
    }

    /// The order check over per-rank collective sequences given by `seqs` (rank → axis →
    /// signatures in issue order), for schedules whose ranks run different programs.
    pub fn check_collective_order_with(
        &self,
        seqs: &dyn Fn(usize) -> BTreeMap<String, Vec<String>>,
    ) -> Result<(), PlanError> {
        let per_rank: Vec<_> = (0..self.mesh.world_size()).map(seqs).collect();
        for a in self.mesh.axis_ids() {
            let name = self.mesh.axis_name(a).to_string();
            for group in self.mesh.groups(a) {
                let first = per_rank[group[0]].get(&name).cloned().unwrap_or_default();
                for &r in &group[1..] {
                    let other = per_rank[r].get(&name).cloned().unwrap_or_default();
                    for pos in 0..first.len().max(other.len()) {
                        let (l, rr) = (first.get(pos), other.get(pos));
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
    /// [`crate::schedule::pipeline::PipelineSchedule::check_program`]); each boundary tensor
    /// is sent with the local type its receiver's program expects; the node lists run every
    /// value of every chunk once, on the chunk's rank, after its operands, a received input
    /// only at its receive.
    pub fn check_pipeline(&self) -> Result<(), PlanError> {
        let Some(s) = &self.pipeline else {
            return Ok(());
        };
        s.check_program(&self.pipeline_program)
            .map_err(|e| PlanError::Pipeline(e.to_string()))?;
        if self.chunks.len() != s.chunks() {
            return Err(PlanError::Pipeline(format!(
                "the schedule has {} chunks, the plan {}",
                s.chunks(),
                self.chunks.len()
            )));
        }
        self.check_pipeline_nodes(s.stages)?;
        let graphs: Vec<&Graph> = self.chunks.iter().map(|c| &c.program).collect();
        crate::train::check_boundary_types(&graphs, s.micro_batches)
            .map_err(|e| PlanError::Pipeline(e.to_string()))
    }

    fn check_pipeline_nodes(&self, p: usize) -> Result<(), PlanError> {
        use crate::schedule::pipeline::PipeOp;
        let err = |m: String| Err(PlanError::Pipeline(m));
        if self.pipeline_nodes.len() != self.pipeline_program.len()
            || self
                .pipeline_nodes
                .iter()
                .zip(&self.pipeline_program)
                .any(|(n, o)| n.len() != o.len())
        {
            return err("node lists do not match the instructions".into());
        }
        let mut done: Vec<Vec<bool>> = self
            .chunks
            .iter()
            .map(|c| vec![false; c.program.len()])
            .collect();
        for (r, (ops, lists)) in self
            .pipeline_program
            .iter()
            .zip(&self.pipeline_nodes)
            .enumerate()
        {
            for (k, (op, list)) in ops.iter().zip(lists).enumerate() {
                // (A tied gradient is completed before it is sent; other sends compute none.)
                let Some(chunk) = op.chunk(self.chunks.len()) else {
                    if !list.is_empty() {
                        return err(format!("rank {r}, instruction {k} ({op}) computes values"));
                    }
                    continue;
                };
                let Some(c) = self
                    .chunks
                    .get(chunk)
                    .filter(|c| c.stage == r && c.index % p == r)
                else {
                    return err(format!(
                        "rank {r}, instruction {k} ({op}): chunk {chunk} is not this rank's"
                    ));
                };
                let g = &c.program;
                for &v in list {
                    if v.index() >= g.len() || done[chunk][v.index()] {
                        return err(format!(
                            "rank {r}, instruction {k} ({op}): value {v} of chunk {chunk} runs twice or does not exist"
                        ));
                    }
                    let node = g.node(v);
                    if let Some(i) = node.inputs.iter().find(|i| !done[chunk][i.index()]) {
                        return err(format!(
                            "rank {r}, instruction {k} ({op}): `{}` of chunk {chunk} runs before its operand {i}",
                            node.name
                        ));
                    }
                    let boundary = crate::train::is_received_input(g, v);
                    if boundary != matches!(op, PipeOp::Recv { .. }) {
                        return err(format!(
                            "rank {r}, instruction {k} ({op}): `{}` of chunk {chunk} is a received input filled elsewhere, or a receive fills something else",
                            node.name
                        ));
                    }
                    done[chunk][v.index()] = true;
                }
            }
        }
        for (c, d) in done.iter().enumerate() {
            if let Some(v) = d.iter().position(|x| !x) {
                return err(format!(
                    "value %{v} `{}` of chunk {c} never runs",
                    self.chunks[c].program.node(ValueId(v as u32)).name
                ));
            }
        }
        Ok(())
    }

    /// Collectives per layer (`None`: outside layers): (op, axis, bytes, value).
    pub fn collectives_by_layer(&self) -> BTreeMap<Option<u32>, LayerCollectives> {
        let mut m: BTreeMap<Option<u32>, Vec<_>> = BTreeMap::new();
        for s in &self.steps {
            if let Step::Collective {
                value, axis, bytes, ..
            } = s
            {
                let n = self.program.node(*value);
                m.entry(n.layer).or_default().push((
                    n.op.mnemonic().to_string(),
                    axis.clone(),
                    *bytes,
                    *value,
                ));
            }
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
