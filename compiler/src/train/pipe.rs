//! Pipeline-parallel training: the model split into chunks over the mesh's `pp` axis, each
//! chunk a training program of its own on the rest of the mesh (data, tensor, sequence
//! parallelism and ZeRO compose inside a stage), and a schedule that orders the chunks'
//! passes per micro-batch with the transfers between them.
//!
//! ```text
//! config ─► chunks (layers balanced by cost, embedding with the first, head with the last;
//!   or --stage-layers) ─► per chunk: forward graph (input `pipe.act_in`, output
//!   `pipe.act_out`) ─► training graph (backward seeded by `pipe.grad_in`, input gradient
//!   `pipe.grad_out`) of ONE micro-batch ─► SPMD program on the mesh without `pp` ─► split:
//!   the micro program (its F, B and W node lists, the same for every micro-batch) and the
//!   chunk's step program (gradient syncs, the tied copy's gradient, AdamW)
//! schedule (GPipe / 1F1B / interleaved / ZB-H1) ─► per pp rank: passes + send/recv
//!   ─► verified: matched FIFO transfers, no deadlock, boundary types agree
//! ```
//!
//! The runtime keeps one execution of a chunk's micro program per micro-batch in flight (its
//! activations live from F to W), sums each micro-batch's gradients, and runs the step
//! program at the chunk's optimizer instruction; so the plan does not grow with the number of
//! micro-batches.
//!
//! Chunk `j` of `p·v` lives on pipeline rank `j mod p`. The tensors crossing a boundary are
//! split over the data axes like the batch and whole on the other axes, so pipeline rank `s`
//! at stage-mesh coordinates `c` exchanges them with rank `s ± 1` at the same `c`.

use super::{compile_chunk, CompiledTrain, TrainCompileError, TrainOptions};
use crate::autodiff::{TrainParam, PIPE_GRAD_IN, PIPE_GRAD_OUT, PIPE_LOSS};
use crate::ir::{Graph, Op, ValueId, ValueRole};
use crate::model::{ModelConfig, StageSpec, STAGE_INPUT, STAGE_OUTPUT};
use crate::pass::{Pass, PassLog};
use crate::plan::{
    boundary_name, check_boundary_types, is_received_input, sent_value, ChunkGraphs, Plan,
    PlanChunk,
};
use crate::schedule::pp::{balance, PipeOp, PipelineError, PipelineSchedule, ScheduleKind};
use crate::schedule::pp::{Carry, Phase};
use crate::shard::{self, Mesh, Strategy};

/// How to pipeline a training step.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineOptions {
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank (interleaved schedule).
    pub virtual_stages: usize,
    /// Decoder layers per chunk, overriding the balance (`--stage-layers 9,8,8,7`).
    pub stage_layers: Option<Vec<usize>>,
}

impl Default for PipelineOptions {
    /// 1F1B, one chunk per rank, balanced by cost.
    fn default() -> PipelineOptions {
        PipelineOptions {
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            stage_layers: None,
        }
    }
}

/// One model chunk and its training program.
#[derive(Clone, Debug)]
pub struct PipelineChunk {
    /// Position in the model (`0..p·v`).
    pub index: usize,
    /// The pipeline rank that runs it (`index mod p`).
    pub stage: usize,
    /// Its layers, embedding and head.
    pub spec: StageSpec,
    /// Its training step on the stage mesh: one micro-batch's program and its own optimizer
    /// step's (`train.split`).
    pub train: CompiledTrain,
}

impl PipelineChunk {
    /// Its micro-batch's and step's programs.
    pub fn graphs(&self) -> ChunkGraphs<'_> {
        let s = self
            .train
            .split
            .as_ref()
            .expect("invariant: a pipeline chunk is split into its micro-batch and step");
        ChunkGraphs {
            micro: &s.micro.graph,
            step: &s.step.graph,
        }
    }
}

/// A compiled pipeline-parallel training step.
#[derive(Clone, Debug)]
pub struct CompiledPipeline {
    /// The chunks in model order.
    pub chunks: Vec<PipelineChunk>,
    /// The schedule.
    pub schedule: PipelineSchedule,
    /// Each pipeline rank's instructions (passes and transfers), verified.
    pub program: Vec<Vec<PipeOp>>,
    /// Per chunk and pass (`F`, `B`, `W`), the values of its micro-batch's program the pass
    /// computes, in order (see [`pass_nodes`]).
    pub nodes: Vec<Vec<Vec<ValueId>>>,
    /// The whole mesh.
    pub mesh: Mesh,
    /// The mesh without its `pp` axis: what each chunk's program is partitioned over.
    pub stage_mesh: Mesh,
    /// Strategies applied inside each stage.
    pub strategies: Vec<Strategy>,
    /// What was compiled.
    pub options: TrainOptions,
}

impl CompiledPipeline {
    /// Pipeline ranks.
    pub fn stages(&self) -> usize {
        self.schedule.stages
    }

    /// Every trainable parameter, in model order (each lives in exactly one chunk).
    pub fn params(&self) -> impl Iterator<Item = &TrainParam> {
        self.chunks.iter().flat_map(|c| c.train.train.params.iter())
    }

    /// Per pipeline rank, the most bytes of activations held at once at `elem_bytes` per
    /// element (see [`activation_peaks`]).
    pub fn activation_peaks(&self, elem_bytes: f64) -> Vec<u64> {
        let graphs: Vec<ChunkGraphs> = self.chunks.iter().map(PipelineChunk::graphs).collect();
        activation_peaks(&graphs, &self.program, &self.nodes, elem_bytes)
    }

    /// The chunks pipeline rank `stage` runs.
    pub fn chunks_of(&self, stage: usize) -> impl Iterator<Item = &PipelineChunk> {
        self.chunks.iter().filter(move |c| c.stage == stage)
    }

    /// The plan: chunk 0's program as `program` (for tools that read one), every chunk's
    /// program with its memory and communication accounting, the schedule and each pipeline
    /// rank's instructions. Memory at the top is the busiest pipeline rank's (its chunks'
    /// parameters summed).
    pub fn plan(
        &self,
        source: &str,
        model_type: &str,
        layers: usize,
        precision: super::Precision,
    ) -> Plan {
        let plans: Vec<Plan> = self
            .chunks
            .iter()
            .map(|c| c.train.plan(source, model_type, layers, precision))
            .collect();
        let mut plan = plans[0].clone();
        plan.dtype = precision.dtype();
        plan.mesh = self.mesh.clone();
        plan.strategies = std::iter::once("pp".to_string())
            .chain(self.strategies.iter().map(|s| s.name().to_string()))
            .collect();
        plan.model.batch = self.options.batch;
        plan.model.seq = self.options.seq;
        plan.memory.param_bytes = (0..self.stages())
            .map(|s| {
                self.chunks_of(s)
                    .map(|c| plans[c.index].memory.param_bytes)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0);
        plan.memory.train = None;
        plan.comm = None;
        plan.step = None;
        let mut train = self.chunks[0].train.plan_train(0);
        train.params = self
            .chunks
            .iter()
            .flat_map(|c| c.train.plan_train(c.index).params)
            .collect();
        let mut tied: Vec<String> = Vec::new();
        for p in &train.params {
            if train.params.iter().filter(|q| q.label == p.label).count() > 1
                && !tied.contains(&p.label)
            {
                tied.push(p.label.clone());
            }
        }
        train.tied = tied;
        plan.train = Some(train);
        plan.pipeline = Some(self.schedule.clone());
        plan.pipeline_program = self.program.clone();
        plan.pipeline_nodes = self.nodes.clone();
        plan.chunks = self
            .chunks
            .iter()
            .zip(plans)
            .map(|(c, p)| PlanChunk {
                index: c.index,
                stage: c.stage,
                layers: [c.spec.layers.start, c.spec.layers.end],
                embed: c.spec.embed,
                head: c.spec.head,
                program: p.program,
                shardings: p.shardings,
                step: p.step,
                memory: p.memory,
                comm: p.comm,
            })
            .collect();
        plan
    }
}

/// Forward FLOPs per token of one decoder layer, the embedding and the head: the costs the
/// stages are balanced by.
fn item_costs(cfg: &ModelConfig, seq: usize) -> Vec<f64> {
    let (h, q, kv) = (
        cfg.hidden as f64,
        (cfg.heads * cfg.head_dim) as f64,
        (cfg.kv_heads * cfg.head_dim) as f64,
    );
    let attn = 2.0 * h * (2.0 * q + 2.0 * kv) + 2.0 * 2.0 * seq as f64 * q;
    let mats = if cfg.gated_mlp { 3.0 } else { 2.0 };
    let experts = cfg.moe.map_or(1.0, |m| m.top_k as f64);
    let mlp = 2.0 * mats * h * cfg.ffn as f64 * experts;
    let layer = attn + mlp;
    let head = 2.0 * h * cfg.vocab as f64;
    std::iter::once(h)
        .chain(std::iter::repeat_n(layer, cfg.layers))
        .chain(std::iter::once(head))
        .collect()
}

/// The model's `chunks` chunks: with `stage_layers`, that many decoder layers each (the
/// embedding with the first, the head with the last); otherwise the embedding, each layer
/// and the head balanced by forward FLOPs (a chunk may then hold the embedding or the head
/// alone when there are few layers).
pub fn chunk_specs(
    cfg: &ModelConfig,
    chunks: usize,
    seq: usize,
    stage_layers: Option<&[usize]>,
) -> Result<Vec<StageSpec>, PipelineError> {
    let l = cfg.layers;
    let counts: Vec<usize> = match stage_layers {
        Some(v) => {
            if v.len() != chunks || v.iter().sum::<usize>() != l || v.contains(&0) {
                return Err(PipelineError::Invalid(format!(
                    "--stage-layers {v:?}: need {chunks} chunks (pp × virtual stages) of at \
                     least one layer covering the model's {l} layers"
                )));
            }
            // As items: the embedding joins the first chunk, the head the last.
            let mut c = v.to_vec();
            c[0] += 1;
            c[chunks - 1] += 1;
            c
        }
        None => {
            if chunks > l + 2 {
                return Err(PipelineError::Invalid(format!(
                    "{chunks} pipeline chunks (pp × virtual stages) for a model of {l} layers \
                     plus embedding and head: at most {}",
                    l + 2
                )));
            }
            balance(&item_costs(cfg, seq), chunks)?
        }
    };
    // Items: 0 = embedding, 1..=l = layers, l + 1 = head.
    let mut out = Vec::with_capacity(chunks);
    let mut a = 0;
    for n in counts {
        let b = a + n;
        out.push(StageSpec {
            layers: a.max(1) - 1..b.min(l + 1) - 1,
            embed: a == 0,
            head: b == l + 2,
        });
        a = b;
    }
    Ok(out)
}

/// Compiles a pipeline-parallel training step: `opts.mesh` has a `pp` axis; `opts.pipeline`
/// gives the schedule; `opts.micro_batches` is the pipeline's micro-batch count.
pub fn compile_pipeline(
    cfg: &ModelConfig,
    opts: &TrainOptions,
) -> Result<CompiledPipeline, TrainCompileError> {
    compile_pipeline_logged(cfg, opts, &mut PassLog::default())
}

/// [`compile_pipeline`], each pass (of each chunk) checked by `log`.
pub(crate) fn compile_pipeline_logged(
    cfg: &ModelConfig,
    opts: &TrainOptions,
    log: &mut PassLog,
) -> Result<CompiledPipeline, TrainCompileError> {
    super::check_sizes(cfg, opts, 1)?;
    super::check_rules(opts)?;
    let mesh = &opts.mesh;
    let pp = mesh.axis("pp").ok_or_else(|| {
        TrainCompileError::Options(format!("mesh {mesh} has no `pp` axis to pipeline over"))
    })?;
    let p = mesh.axis_size(pp);
    let stage_mesh = mesh.without_axis("pp");
    let strategies = shard::resolve_stage(mesh, &opts.extra_strategies)?;
    if let Some(s) = strategies.iter().find(|s| s.zero_stage() == 3) {
        return Err(TrainCompileError::Options(format!(
            "`{s}` with pipeline parallelism: parameters would be all-gathered for every \
             micro-batch of every chunk; use zero1 or zero2 with pp"
        )));
    }
    let po = &opts.pipeline;
    let schedule = PipelineSchedule::new(po.schedule, p, opts.micro_batches, po.virtual_stages)?;
    let n = schedule.chunks();
    // Tied embeddings split over stages: a copy on the first and on the last chunk, their
    // gradients exchanged and summed before each copy's (identical) optimizer step.
    let tied: Vec<String> = if cfg.tied && n > 1 {
        if let Some(s) = strategies.iter().find(|s| s.zero_stage() > 0) {
            return Err(TrainCompileError::Options(format!(
                "`{s}` with tied embeddings split over pipeline stages: the embedding's two \
                 copies exchange whole gradients; use plain dp with this model, or pp=1"
            )));
        }
        if (n - 1) % p == 0 {
            return Err(TrainCompileError::Options(
                "tied embeddings need the first and last chunks on different pipeline ranks".into(),
            ));
        }
        vec!["embed".to_string()]
    } else {
        Vec::new()
    };
    let mut program = schedule.program();
    if !tied.is_empty() {
        add_tied_exchange(&mut program, p, n);
    }
    schedule.check_program(&program)?;
    let specs = chunk_specs(cfg, n, opts.seq, po.stage_layers.as_deref())?;
    let mut chunks = Vec::with_capacity(specs.len());
    for (index, spec) in specs.into_iter().enumerate() {
        log.chunk = Some(index);
        let train = compile_chunk(
            cfg,
            opts,
            &stage_mesh,
            strategies.clone(),
            Some(spec.clone()),
            &tied,
            log,
        )
        .map_err(|e| match e {
            TrainCompileError::Options(m) => {
                TrainCompileError::Options(format!("pipeline chunk {index}: {m}"))
            }
            e => e,
        })?;
        chunks.push(PipelineChunk {
            index,
            stage: index % p,
            spec,
            train,
        });
    }
    let graphs: Vec<ChunkGraphs> = chunks.iter().map(PipelineChunk::graphs).collect();
    check_boundary_types(&graphs)?;
    let nodes = pass_nodes(&graphs)?;
    log.chunk = None;
    log.other(
        Pass::Stages,
        || Ok(()),
        || stages_text(&schedule, &chunks, &program),
    )?;
    Ok(CompiledPipeline {
        chunks,
        schedule,
        program,
        nodes,
        mesh: mesh.clone(),
        stage_mesh,
        strategies,
        options: opts.clone(),
    })
}

/// Puts the exchange of the tied embedding's gradients before the optimizer steps of the
/// first and last chunks: each sends its copy's gradient to the other's rank, then receives
/// the other's (buffered sends: no wait on each other).
fn add_tied_exchange(program: &mut [Vec<PipeOp>], p: usize, n: usize) {
    for (mine, other) in [(0, n - 1), (n - 1, 0)] {
        let (r, o) = (mine % p, other % p);
        let at = program[r]
            .iter()
            .position(|x| matches!(x, PipeOp::Step { chunk } if *chunk == mine))
            .expect("invariant: every chunk has its optimizer step");
        program[r].splice(
            at..at,
            [
                PipeOp::Send {
                    to: o,
                    carry: Carry::Tied,
                    micro: 0,
                    boundary: mine,
                },
                PipeOp::Recv {
                    from: o,
                    carry: Carry::Tied,
                    micro: 0,
                    boundary: other,
                },
            ],
        );
    }
}

/// The batch inputs of a chunk's micro-batch program: what makes a value one micro-batch's.
const BATCH_INPUTS: [&str; 6] = [
    "input_ids",
    "position_ids",
    "attention_mask",
    "labels",
    STAGE_INPUT,
    PIPE_GRAD_IN,
];

/// The activations of a chunk's micro-batch program `g`: values that depend on the
/// micro-batch (its batch inputs or boundary tensors), except its gradient and loss outputs,
/// which go into the sums over micro-batches.
pub fn activation_values(g: &Graph) -> Vec<bool> {
    let mut a = vec![false; g.len()];
    for v in g.ids() {
        let n = g.node(v);
        a[v.index()] = match &n.op {
            Op::Input { name, .. } => BATCH_INPUTS.contains(&name.as_str()),
            _ => n.inputs.iter().any(|i| a[i.index()]),
        };
    }
    for (name, v) in &g.outputs {
        if name == "loss" || name == PIPE_LOSS || ValueRole::gradient_label(name).is_some() {
            a[v.index()] = false;
        }
    }
    a
}

/// `roots` and every value they need that is not `done`; an error names a received input
/// that is needed but not received before the pass.
fn pending(g: &Graph, mut stack: Vec<ValueId>, done: &[bool]) -> Result<Vec<bool>, String> {
    let mut need = vec![false; g.len()];
    while let Some(v) = stack.pop() {
        if need[v.index()] || done[v.index()] {
            continue;
        }
        if is_received_input(g, v) {
            return Err(format!("needs `{}` before it is received", g.node(v).name));
        }
        need[v.index()] = true;
        stack.extend(g.node(v).inputs.iter().copied());
    }
    Ok(need)
}

/// What each pass of a micro-batch computes on its chunk's micro-batch program, the same for
/// every micro-batch: `F`, the chunk's output (its loss, on the last chunk) and what it needs
/// (the activation received before it); `B`, the input's gradient and what it needs beyond
/// `F` (the output's gradient received before it); `W`, the rest (weight gradients). The
/// schedule runs `W` of every micro-batch (right after its `B` where it does not split
/// them); the optimizer step runs the chunk's step program. A pass that would need a boundary
/// input received only later is an error.
pub fn pass_nodes(chunks: &[ChunkGraphs]) -> Result<Vec<Vec<Vec<ValueId>>>, PipelineError> {
    chunks
        .iter()
        .enumerate()
        .map(|(c, ch)| {
            let g = ch.micro;
            let mut done = vec![false; g.len()];
            let mut lists = Vec::with_capacity(3);
            for phase in [Phase::F, Phase::B, Phase::W] {
                let (received, roots): (_, Vec<ValueId>) = match phase {
                    Phase::F => {
                        let mut r: Vec<ValueId> = [STAGE_OUTPUT, PIPE_LOSS]
                            .iter()
                            .filter_map(|b| g.output(b))
                            .collect();
                        if r.is_empty() {
                            r.extend(g.output("loss"));
                        }
                        (g.input_named(STAGE_INPUT), r)
                    }
                    Phase::B => (
                        g.input_named(PIPE_GRAD_IN),
                        g.output(PIPE_GRAD_OUT).into_iter().collect(),
                    ),
                    Phase::W => (
                        None,
                        g.ids()
                            .filter(|&v| !done[v.index()] && !is_received_input(g, v))
                            .collect(),
                    ),
                };
                if let Some(v) = received {
                    done[v.index()] = true;
                }
                let need = pending(g, roots, &done).map_err(|m| {
                    PipelineError::Invalid(format!("chunk {c}, pass {phase:?}: {m}"))
                })?;
                let list: Vec<ValueId> = g.ids().filter(|v| need[v.index()]).collect();
                for &v in &list {
                    done[v.index()] = true;
                }
                lists.push(list);
            }
            Ok(lists)
        })
        .collect()
}

/// One micro-batch's run of a chunk's micro-batch program, as [`activation_peaks`] follows
/// it: readers left per value, outputs still held, bytes held.
struct Flight {
    users: Vec<usize>,
    output: Vec<bool>,
    held: Vec<f64>,
}

impl Flight {
    fn new(g: &Graph) -> Flight {
        let mut users = vec![0; g.len()];
        for v in g.ids() {
            for &i in &g.node(v).inputs {
                users[i.index()] += 1;
            }
        }
        let mut output = vec![false; g.len()];
        for (_, v) in &g.outputs {
            output[v.index()] = true;
        }
        Flight {
            users,
            output,
            held: vec![0.0; g.len()],
        }
    }
}

/// Per pipeline rank, the most bytes of activations ([`activation_values`]) held at once
/// after any instruction, at `elem_bytes` per element: the static account of what the thread
/// runtime measures (`shardc_runtime::pipeline::PipelineStep::peak_activation_bytes` with
/// `elem_bytes` 4). Each micro-batch in flight on a chunk has its own values, from its first
/// receive or pass until its `W` pass, which hands its gradients and loss to the chunk's sums.
/// A value is held from the instruction that computes (or receives) it until its last reader
/// has run; outputs are kept, except boundary tensors, which are handed over by their send.
pub fn activation_peaks(
    chunks: &[ChunkGraphs],
    program: &[Vec<PipeOp>],
    nodes: &[Vec<Vec<ValueId>>],
    elem_bytes: f64,
) -> Vec<u64> {
    let n = chunks.len();
    let act: Vec<Vec<bool>> = chunks.iter().map(|c| activation_values(c.micro)).collect();
    let size = |g: &Graph, v: ValueId| g.ty(v).numel() as f64 * elem_bytes;
    let mut peaks = vec![0u64; program.len()];
    for (r, ops) in program.iter().enumerate() {
        let mut flights: std::collections::BTreeMap<(usize, usize), Flight> =
            std::collections::BTreeMap::new();
        for op in ops {
            match *op {
                PipeOp::Recv {
                    carry,
                    micro,
                    boundary,
                    ..
                } if carry != Carry::Tied => {
                    let c = carry.receiver(boundary, n);
                    let g = chunks[c].micro;
                    let f = flights.entry((c, micro)).or_insert_with(|| Flight::new(g));
                    let v = boundary_name(&chunks[c], carry).and_then(|x| g.input_named(&x));
                    if let Some(v) = v {
                        if f.users[v.index()] > 0 || f.output[v.index()] {
                            f.held[v.index()] = size(g, v);
                        }
                    }
                }
                // Boundary tensors are handed over.
                PipeOp::Send {
                    carry,
                    micro,
                    boundary,
                    ..
                } if carry != Carry::Tied => {
                    let c = carry.sender(boundary);
                    if let (Some(v), Some(f)) =
                        (sent_value(&chunks[c], carry), flights.get_mut(&(c, micro)))
                    {
                        f.output[v.index()] = false;
                        if f.users[v.index()] == 0 {
                            f.held[v.index()] = 0.0;
                        }
                    }
                }
                PipeOp::Run(slot) => {
                    let c = slot.chunk;
                    let g = chunks[c].micro;
                    let f = flights
                        .entry((c, slot.micro))
                        .or_insert_with(|| Flight::new(g));
                    let list = nodes.get(c).and_then(|l| l.get(phase_index(slot.phase)));
                    for &v in list.into_iter().flatten() {
                        let node = g.node(v);
                        for &i in &node.inputs {
                            f.users[i.index()] -= 1;
                            if f.users[i.index()] == 0 && !f.output[i.index()] {
                                f.held[i.index()] = 0.0;
                            }
                        }
                        let kept = f.users[v.index()] > 0 || f.output[v.index()];
                        let computed = !matches!(node.op, Op::Input { .. } | Op::Param(_));
                        if kept && computed {
                            f.held[v.index()] = size(g, v);
                        }
                    }
                    if slot.phase == Phase::W {
                        flights.remove(&(c, slot.micro));
                    }
                }
                _ => {}
            }
            let live: f64 = flights
                .iter()
                .map(|(&(c, _), f)| {
                    f.held
                        .iter()
                        .zip(&act[c])
                        .filter(|(_, &a)| a)
                        .map(|(b, _)| b)
                        .sum::<f64>()
                })
                .sum();
            peaks[r] = peaks[r].max(live as u64);
        }
    }
    peaks
}

/// The position of pass `phase` in a chunk's node lists (`F`, `B`, `W`).
pub fn phase_index(phase: Phase) -> usize {
    match phase {
        Phase::F => 0,
        Phase::B => 1,
        Phase::W => 2,
    }
}

/// The `stages` dump: the schedule, each chunk's layers and rank, each rank's instructions.
fn stages_text(s: &PipelineSchedule, chunks: &[PipelineChunk], program: &[Vec<PipeOp>]) -> String {
    use std::fmt::Write as _;
    let mut t = String::new();
    let _ = writeln!(t, "// {}", s.describe().unwrap_or_else(|e| e.to_string()));
    for c in chunks {
        let _ = writeln!(
            t,
            "chunk {} on stage {}: {}",
            c.index,
            c.stage,
            c.spec.describe()
        );
    }
    for (r, ops) in program.iter().enumerate() {
        let list: Vec<String> = ops.iter().map(ToString::to_string).collect();
        let _ = writeln!(t, "rank {r}: {}", list.join("; "));
    }
    t
}
