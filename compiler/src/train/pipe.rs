//! Pipeline-parallel training: the model split into chunks over the mesh's `pp` axis, each
//! chunk a training program of its own on the rest of the mesh (data, tensor, sequence
//! parallelism and ZeRO compose inside a stage), and a schedule that orders the chunks'
//! passes per micro-batch with the transfers between them.
//!
//! ```text
//! config ─► chunks (layers balanced by cost, embedding with the first, head with the last;
//!   or --stage-layers) ─► per chunk: forward graph (input `pipe.act_in`, output
//!   `pipe.act_out`) ─► training graph (backward seeded by `pipe.grad_in`, input gradient
//!   `pipe.grad_out`) ─► SPMD program on the mesh without `pp`
//! schedule (GPipe / 1F1B / interleaved / ZB-H1) ─► per pp rank: passes + send/recv
//!   ─► verified: matched FIFO transfers, no deadlock, boundary types agree
//! ```
//!
//! Chunk `j` of `p·v` lives on pipeline rank `j mod p`. The tensors crossing a boundary are
//! split over the data axes like the batch and whole on the other axes, so pipeline rank `s`
//! at stage-mesh coordinates `c` exchanges them with rank `s ± 1` at the same `c`.

use super::{compile_chunk, CompiledTrain, TrainCompileError, TrainOptions};
use crate::autodiff::{
    input_name, TrainParam, PIPE_GRAD_IN, PIPE_GRAD_OUT, PIPE_LOSS, PIPE_TIED_PREFIX,
};
use crate::ir::{Graph, Op, ValueId};
use crate::model::{ModelConfig, StageSpec, STAGE_INPUT, STAGE_OUTPUT};
use crate::pass::{Pass, PassLog};
use crate::plan::{
    boundary_name, check_boundary_types, is_received_input, sent_value, Plan, PlanChunk,
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
    /// Its training step on the stage mesh (every micro-batch; its own optimizer step).
    pub train: CompiledTrain,
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
    /// Per pipeline rank and instruction, the values of its chunk's program it computes, in
    /// order (a receive: the input it fills; a send: nothing).
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
        let graphs: Vec<&Graph> = self.chunks.iter().map(|c| &c.train.sharded.graph).collect();
        activation_peaks(
            &graphs,
            &self.program,
            &self.nodes,
            self.stages(),
            self.options.micro_batches,
            elem_bytes,
        )
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
    super::check_sizes(cfg, opts, opts.micro_batches)?;
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
    let graphs: Vec<&Graph> = chunks.iter().map(|c| &c.train.sharded.graph).collect();
    check_boundary_types(&graphs, opts.micro_batches)?;
    let nodes = instruction_nodes(&graphs, &program, p, opts.micro_batches)?;
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

/// Which micro-batches a value of a chunk program depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MicroDep {
    /// None: parameters, optimizer state, the step count, what derives from them alone.
    Free,
    /// Micro-batch `i` alone.
    One(usize),
    /// Several: accumulated gradients, the summed loss, the optimizer update.
    Many,
}

impl MicroDep {
    fn join(self, o: MicroDep) -> MicroDep {
        match (self, o) {
            (MicroDep::Free, x) | (x, MicroDep::Free) => x,
            (MicroDep::One(a), MicroDep::One(b)) if a == b => MicroDep::One(a),
            _ => MicroDep::Many,
        }
    }
}

/// The micro-batch of a program input of a step with `m` micro-batches (`input_ids.mb3` → 3;
/// with one micro-batch the batch inputs are unsuffixed); `None` for parameters, optimizer
/// state and the step count.
pub fn input_micro(name: &str, m: usize) -> Option<usize> {
    if m > 1 {
        let (_, k) = name.rsplit_once(".mb")?;
        return k.parse().ok();
    }
    let batch = [
        "input_ids",
        "position_ids",
        "attention_mask",
        "labels",
        STAGE_INPUT,
        PIPE_GRAD_IN,
    ];
    batch.contains(&name).then_some(0)
}

/// The [`MicroDep`] of every value of `g`. The optimizer's own inputs (moments, step count,
/// a tied copy's gradient) count as [`MicroDep::Many`]: the optimizer step reads them after
/// every micro-batch, even when there is only one.
pub fn micro_deps(g: &Graph, m: usize) -> Vec<MicroDep> {
    let optimizer_input = |name: &str| {
        name == "step"
            || name.starts_with("adam_m.")
            || name.starts_with("adam_v.")
            || name.starts_with(PIPE_TIED_PREFIX)
    };
    let mut out: Vec<MicroDep> = Vec::with_capacity(g.len());
    for v in g.ids() {
        let n = g.node(v);
        let d = match &n.op {
            Op::Input { name, .. } if optimizer_input(name) => MicroDep::Many,
            Op::Input { name, .. } => input_micro(name, m).map_or(MicroDep::Free, MicroDep::One),
            _ => n
                .inputs
                .iter()
                .fold(MicroDep::Free, |acc, i| acc.join(out[i.index()])),
        };
        out.push(d);
    }
    out
}

/// The activations of a chunk program: values of one micro-batch that no value combining
/// micro-batches reads (which leaves out a micro-batch's weight gradients on their way into
/// the accumulation).
pub fn activation_values(g: &Graph, deps: &[MicroDep]) -> Vec<bool> {
    let mut a: Vec<bool> = deps.iter().map(|d| matches!(d, MicroDep::One(_))).collect();
    for v in g.ids() {
        if deps[v.index()] == MicroDep::Many {
            for &i in &g.node(v).inputs {
                a[i.index()] = false;
            }
        }
    }
    a
}

/// The values pass `phase` of micro-batch `i` asks for on a chunk program: `F`, the chunk's
/// output (its loss, on the last chunk); `B`, its input gradient; `W`, everything else of
/// micro-batch `i` (weight gradients).
fn roots(g: &Graph, deps: &[MicroDep], phase: Phase, i: usize, m: usize) -> Vec<ValueId> {
    let out = |b: &str| g.output(&input_name(b, i, m));
    match phase {
        Phase::F => {
            let mut r: Vec<ValueId> = [STAGE_OUTPUT, PIPE_LOSS]
                .iter()
                .filter_map(|b| out(b))
                .collect();
            if r.is_empty() {
                r.extend(g.output("loss"));
            }
            r
        }
        Phase::B => out(PIPE_GRAD_OUT).into_iter().collect(),
        Phase::W => g
            .ids()
            .filter(|v| deps[v.index()] == MicroDep::One(i))
            .collect(),
    }
}

/// `roots` and every value they need that is not `done`; an error names a received input
/// (`received`) that is needed but not there yet.
fn pending(
    g: &Graph,
    mut stack: Vec<ValueId>,
    done: &[bool],
    received: &dyn Fn(&Graph, ValueId) -> bool,
) -> Result<Vec<bool>, String> {
    let mut need = vec![false; g.len()];
    while let Some(v) = stack.pop() {
        if need[v.index()] || done[v.index()] {
            continue;
        }
        if received(g, v) {
            return Err(format!("needs `{}` before it is received", g.node(v).name));
        }
        need[v.index()] = true;
        stack.extend(g.node(v).inputs.iter().copied());
    }
    Ok(need)
}

/// What each instruction computes, derived once for every rank: a pass computes the values
/// it asks for (see `roots`) and every value they need that is not computed yet, in program
/// order, then the values combining micro-batches whose operands are all there (gradient
/// accumulation as early as it can); a receive fills its input; the optimizer step computes
/// the rest. A pass that would need a boundary input not received yet is an error (the
/// schedule would read data before it arrives).
pub fn instruction_nodes(
    graphs: &[&Graph],
    program: &[Vec<PipeOp>],
    p: usize,
    m: usize,
) -> Result<Vec<Vec<Vec<ValueId>>>, PipelineError> {
    let deps: Vec<Vec<MicroDep>> = graphs.iter().map(|g| micro_deps(g, m)).collect();
    let boundary_input = is_received_input;
    let n = graphs.len();
    let mut out = Vec::with_capacity(program.len());
    for (r, ops) in program.iter().enumerate() {
        let mut done: Vec<Vec<bool>> = graphs
            .iter()
            .enumerate()
            .map(|(c, g)| {
                if c % p == r {
                    vec![false; g.len()]
                } else {
                    Vec::new()
                }
            })
            .collect();
        let mut lists = Vec::with_capacity(ops.len());
        for (k, op) in ops.iter().enumerate() {
            let bad = |msg: String| {
                PipelineError::Invalid(format!("pipeline rank {r}, instruction {k} ({op}): {msg}"))
            };
            let mut list = Vec::new();
            match *op {
                PipeOp::Recv {
                    carry,
                    micro,
                    boundary,
                    ..
                } => {
                    let c = carry.receiver(boundary, n);
                    let g = graphs.get(c).ok_or_else(|| bad("no such chunk".into()))?;
                    let name = boundary_name(g, carry, micro, m)
                        .ok_or_else(|| bad(format!("chunk {c} receives no {carry:?}")))?;
                    let v = g
                        .input_named(&name)
                        .ok_or_else(|| bad(format!("chunk {c} has no input `{name}`")))?;
                    done[c][v.index()] = true;
                    list.push(v);
                }
                PipeOp::Send {
                    carry: Carry::Tied,
                    boundary,
                    ..
                } => {
                    // The complete gradient the tied copy sends, and what it still needs.
                    let c = boundary;
                    let g = graphs.get(c).ok_or_else(|| bad("no such chunk".into()))?;
                    let v = sent_value(g, Carry::Tied, 0, m)
                        .ok_or_else(|| bad(format!("chunk {c} has no tied gradient")))?;
                    let need = pending(g, vec![v], &done[c], &boundary_input).map_err(bad)?;
                    for v in g.ids().filter(|v| need[v.index()]) {
                        done[c][v.index()] = true;
                        list.push(v);
                    }
                }
                PipeOp::Send { .. } => {}
                PipeOp::Run(slot) => {
                    let c = slot.chunk;
                    let g = graphs[c];
                    let d = &deps[c];
                    let roots = roots(g, d, slot.phase, slot.micro, m);
                    let need = pending(g, roots, &done[c], &boundary_input).map_err(bad)?;
                    for v in g.ids() {
                        let ready = || g.node(v).inputs.iter().all(|i| done[c][i.index()]);
                        let eager = !done[c][v.index()]
                            && d[v.index()] == MicroDep::Many
                            && !g.node(v).inputs.is_empty()
                            && ready();
                        if need[v.index()] || eager {
                            done[c][v.index()] = true;
                            list.push(v);
                        }
                    }
                }
                PipeOp::Step { chunk } => {
                    let g = graphs[chunk];
                    for v in g.ids() {
                        if !done[chunk][v.index()] {
                            if boundary_input(g, v) {
                                return Err(bad(format!("`{}` is never received", g.node(v).name)));
                            }
                            done[chunk][v.index()] = true;
                            list.push(v);
                        }
                    }
                }
            }
            lists.push(list);
        }
        out.push(lists);
    }
    Ok(out)
}

/// Per pipeline rank, the most bytes of activations ([`activation_values`]) held at once
/// after any instruction, at `elem_bytes` per element: the static account of what the thread
/// runtime measures (`shardc_runtime::pipeline::PipelineStep::peak_activation_bytes` with
/// `elem_bytes` 4). A value is held from the instruction that computes (or receives) it until
/// its last reader has run; outputs are kept, except boundary tensors, which are handed over
/// by their send; a chunk's values are gone after its optimizer step.
pub fn activation_peaks(
    graphs: &[&Graph],
    program: &[Vec<PipeOp>],
    nodes: &[Vec<Vec<ValueId>>],
    p: usize,
    m: usize,
    elem_bytes: f64,
) -> Vec<u64> {
    let act: Vec<Vec<bool>> = graphs
        .iter()
        .map(|g| activation_values(g, &micro_deps(g, m)))
        .collect();
    let mut peaks = vec![0u64; program.len()];
    for (r, (ops, lists)) in program.iter().zip(nodes).enumerate() {
        let mine: Vec<usize> = (0..graphs.len()).filter(|c| c % p == r).collect();
        let mut users: Vec<Vec<usize>> = graphs
            .iter()
            .map(|g| {
                let mut u = vec![0; g.len()];
                for v in g.ids() {
                    for &i in &g.node(v).inputs {
                        u[i.index()] += 1;
                    }
                }
                u
            })
            .collect();
        let mut output: Vec<Vec<bool>> = graphs
            .iter()
            .map(|g| {
                let mut o = vec![false; g.len()];
                for (_, v) in &g.outputs {
                    o[v.index()] = true;
                }
                o
            })
            .collect();
        let mut held: Vec<Vec<f64>> = graphs.iter().map(|g| vec![0.0; g.len()]).collect();
        let mut live_chunks: Vec<bool> = (0..graphs.len()).map(|c| mine.contains(&c)).collect();
        let size = |g: &Graph, v: ValueId| g.ty(v).numel() as f64 * elem_bytes;
        for (op, list) in ops.iter().zip(lists) {
            if let Some(c) = op.chunk(graphs.len()) {
                let g = graphs[c];
                for &v in list {
                    let node = g.node(v);
                    for &i in &node.inputs {
                        users[c][i.index()] -= 1;
                        if users[c][i.index()] == 0 && !output[c][i.index()] {
                            held[c][i.index()] = 0.0;
                        }
                    }
                    let kept = users[c][v.index()] > 0 || output[c][v.index()];
                    let computed = !matches!(node.op, Op::Input { .. } | Op::Param(_));
                    let received = matches!(op, PipeOp::Recv { .. });
                    if kept && (computed || received) {
                        held[c][v.index()] = size(g, v);
                    }
                }
            }
            match *op {
                // Boundary tensors are handed over (a tied gradient is copied: it is also an
                // output of the step).
                PipeOp::Send {
                    carry,
                    micro,
                    boundary,
                    ..
                } if carry != Carry::Tied => {
                    let c = carry.sender(boundary);
                    if let Some(v) = sent_value(graphs[c], carry, micro, m) {
                        output[c][v.index()] = false;
                        if users[c][v.index()] == 0 {
                            held[c][v.index()] = 0.0;
                        }
                    }
                }
                PipeOp::Step { chunk } => live_chunks[chunk] = false,
                _ => {}
            }
            let live: f64 = (0..graphs.len())
                .filter(|&c| live_chunks[c])
                .map(|c| {
                    held[c]
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
