//! Pipeline-parallel training steps on thread ranks: every rank of the mesh is a thread with
//! a thread communicator per group of every mesh axis, and executes its stage's instructions
//! (the plan's `pipeline_program`) in order ([`run_stage`]): a pass runs the values the
//! compiler listed for it (the plan's `pipeline_nodes`, see
//! [`shardc_compiler::train::instruction_nodes`]) with [`Stepwise`]; a send hands a boundary
//! tensor (with a header: what, micro-batch, boundary) to the same stage-mesh coordinates of
//! the other stage through the `pp` axis's communicator (point-to-point, buffered, matched in
//! order per peer); a receive blocks for it (bounded by the communicator's timeout) and checks
//! the header. Any [`Communicator`](crate::comm::Communicator) carries the transfers, so [`run_stage`] serves processes
//! (tcp) as it serves threads.
//!
//! Every rank of a stage runs the same programs and node lists, so its collectives agree; the
//! instructions were verified deadlock-free at compile time. A rank that fails aborts all its
//! groups, so its peers stop at once; the error returned is the root cause, with the rank and
//! its mesh coordinates.

use crate::exec::{load_params, ParamCache, RankCtx, Stepwise};
use crate::spmd::{root_cause, run_threads, thread_comms};
use crate::train::{
    assemble, at_step, check_batch, kept_state, reduce_loss, train_section, Batch, StepCheck,
    StepOutput, StepUpdate, TrainError, TrainState,
};
use crate::{RuntimeError, Tensor, Weights};
use shardc_compiler::cost::{Slice, Timeline};
use shardc_compiler::ir::ValueRole;
use shardc_compiler::plan::{Plan, PlanTrain};
use shardc_compiler::schedule::pp::{Carry, Phase, PipeOp};
use shardc_compiler::shard::AxisId;
use shardc_compiler::train::{activation_values, boundary_name, phase_index, sent_value};
use std::collections::BTreeMap;
use std::time::Duration;
use std::time::Instant;

/// What a rank returns from [`run_stage`].
#[derive(Clone, Debug)]
pub struct StageOutputs {
    /// Each of its chunks' outputs (local values), by chunk.
    pub outputs: BTreeMap<usize, BTreeMap<String, Tensor>>,
    /// The most bytes of activations it held after any instruction.
    pub peak_activation_bytes: usize,
    /// When each instruction ran, seconds from the step's start: passes and the optimizer
    /// on track 0 (`forward`, `backward`, `weight-gradient`, `optimizer`), transfers on track
    /// 1 (`send`, `recv`: a receive's slice includes its wait).
    pub timeline: Timeline,
}

/// `a + b` elementwise (same shape).
fn add_tensors(a: &Tensor, b: &Tensor) -> Tensor {
    let (x, y) = (a.as_f32().unwrap_or(&[]), b.as_f32().unwrap_or(&[]));
    Tensor::f32(
        a.shape.clone(),
        x.iter().zip(y).map(|(p, q)| p + q).collect(),
    )
}

fn pipe_err(op: &PipeOp, detail: impl Into<String>) -> RuntimeError {
    RuntimeError::Pipeline {
        op: op.to_string(),
        detail: detail.into(),
    }
}

/// The training section and the `pp` axis of pipeline plan `plan`, or the error of a plan
/// that is not one.
pub fn pipe_section(plan: &Plan) -> Result<(&PlanTrain, AxisId), TrainError> {
    let t = train_section(plan)?;
    plan.chunk_graphs()
        .map_err(|e| TrainError::PlanKind(e.to_string()))?;
    match (plan.pipeline.as_ref(), plan.mesh.axis("pp")) {
        (Some(_), Some(pp)) => Ok((t, pp)),
        _ => Err(TrainError::PlanKind(format!(
            "the plan of {} has no pipeline schedule: it runs as one SPMD program",
            plan.model.source
        ))),
    }
}

/// The global inputs of each chunk of pipeline plan `plan` (training section `t`) for step
/// `step` (1-based) on `batch` from `state`, per micro-batch: its batch (under the micro-batch
/// program's names), the chunk's parameters and optimizer state, the step count.
pub fn chunk_inputs(
    plan: &Plan,
    t: &PlanTrain,
    state: &TrainState,
    batch: &Batch,
    step: u64,
) -> Vec<Vec<BTreeMap<String, Tensor>>> {
    let k = t.micro_batches.max(1);
    let batches: Vec<_> = (0..k)
        .map(|i| crate::train::micro_batch_inputs(batch, k, i))
        .collect();
    plan.chunks
        .iter()
        .map(|ch| {
            let mut common = BTreeMap::new();
            state.add_inputs_at(t.params_of(ch.index), step, &mut common);
            batches
                .iter()
                .map(|b| {
                    let mut x = common.clone();
                    x.extend(b.iter().map(|(n, t)| (n.clone(), t.clone())));
                    x
                })
                .collect()
        })
        .collect()
}

/// One rank's part of a pipelined training run in a process group (`shardc launch`,
/// torchrun): its stage's chunks run by [`run_stage`] with the communicators of a
/// [`RankCtx`], their parameter and optimizer shards kept between steps.
pub struct StageTrainer<'c> {
    plan: &'c Plan,
    train: &'c PlanTrain,
    stage: usize,
    locals: Vec<BTreeMap<String, Tensor>>,
}

impl<'c> StageTrainer<'c> {
    /// A trainer for global rank `rank` of pipeline plan `plan`'s mesh.
    pub fn new(plan: &'c Plan, rank: usize) -> Result<StageTrainer<'c>, TrainError> {
        let (train, pp) = pipe_section(plan)?;
        Ok(StageTrainer {
            plan,
            train,
            stage: plan
                .mesh
                .coords(rank)
                .get(pp.0 as usize)
                .copied()
                .unwrap_or(0),
            locals: vec![BTreeMap::new(); plan.chunks.len()],
        })
    }

    /// This rank's block of chunk `chunk`'s program input `name` (a parameter or AdamW
    /// moment) as the last step left it; `None` before the first step or for another
    /// stage's chunk.
    pub fn local(&self, chunk: usize, name: &str) -> Option<&Tensor> {
        self.locals.get(chunk)?.get(name)
    }

    /// Starts from this rank's own blocks of the state (per chunk, by program input, e.g.
    /// read from a checkpoint) instead of the global initial state.
    pub fn with_locals(mut self, mut locals: BTreeMap<usize, BTreeMap<String, Tensor>>) -> Self {
        for (j, l) in self.locals.iter_mut().enumerate() {
            if let Some(mine) = locals.remove(&j) {
                *l = mine;
            }
        }
        self
    }

    /// Runs step `step` (1-based) on `batch`; `initial` is the global state before step 1.
    /// Returns the global loss on the ranks of stage 0 (sent there from the last chunk's
    /// stage), NaN elsewhere.
    pub fn step(
        &mut self,
        initial: &TrainState,
        batch: &Batch,
        step: u64,
        ctx: &RankCtx,
        weights: &Weights,
    ) -> Result<f32, TrainError> {
        let (plan, t) = (self.plan, self.train);
        check_batch(batch, plan.model.batch, plan.model.seq)?;
        let inputs = chunk_inputs(plan, t, initial, batch, step);
        let stage_mesh = plan.mesh.without_axis("pp");
        let run = run_stage(
            plan,
            self.stage,
            ctx,
            &inputs,
            &self.locals,
            weights,
            Instant::now(),
        )
        .map_err(|e| at_step(step, e))?;
        let head = plan
            .chunks
            .last()
            .ok_or_else(|| TrainError::MissingOutput("loss".into()))?;
        let mut loss = [f32::NAN];
        if self.stage == head.stage {
            let out = run
                .outputs
                .get(&head.index)
                .ok_or_else(|| TrainError::MissingOutput("loss".into()))?;
            loss[0] = reduce_loss(&head.program, &head.shardings, out, &stage_mesh, ctx)?;
        }
        if head.stage != 0 && (self.stage == head.stage || self.stage == 0) {
            let pp = ctx.comm("pp")?;
            let r = if self.stage == head.stage {
                pp.send(&loss, 0)
            } else {
                pp.recv(&mut loss, head.stage)
            };
            r.map_err(|e| RuntimeError::Pipeline {
                op: "the loss to stage 0".into(),
                detail: e.to_string(),
            })?;
        }
        // Every rank of every stage agrees on the step's first non-finite value, if any.
        let check = StepCheck::new(&t.params);
        let mut codes = check.codes();
        if self.stage == head.stage {
            check.loss(&mut codes, loss[0]);
        }
        for (j, o) in &run.outputs {
            let ch = &plan.chunks[*j];
            check.outputs(&mut codes, &ch.program, &ch.shardings, &stage_mesh, ctx, o);
            if let Some(st) = &ch.step {
                check.outputs(&mut codes, &st.program, &st.shardings, &stage_mesh, ctx, o);
            }
        }
        check.agree(step, codes, &plan.mesh, ctx)?;
        for (j, o) in &run.outputs {
            self.locals[*j] = kept_state(o);
        }
        Ok(loss[0])
    }
}

/// What a pipeline step returns.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineStep {
    /// Loss and gradients.
    pub output: StepOutput,
    /// Per pipeline rank, the most bytes of activations (values of one micro-batch: kept for
    /// backward, received from a neighbour, or in flight inside a pass; not the
    /// micro-batch's weight gradients, which go into the accumulation) any of its ranks held
    /// at once, measured after every instruction: the activation memory the schedule costs.
    pub peak_activation_bytes: Vec<usize>,
    /// Per rank (of the whole mesh), when each of its instructions ran and its activation
    /// bytes after each (see [`StageOutputs::timeline`]): the executed schedule, for a trace.
    pub timelines: Vec<Timeline>,
}

/// Runs one step of pipeline plan `plan` on thread ranks and updates `state` (which holds
/// every chunk's parameters: [`TrainState::load`]).
pub fn pipeline_step(
    plan: &Plan,
    state: &mut TrainState,
    batch: &Batch,
    timeout: Duration,
    weights: &Weights,
) -> Result<PipelineStep, TrainError> {
    let (t, pp) = pipe_section(plan)?;
    check_batch(batch, plan.model.batch, plan.model.seq)?;
    let mesh = &plan.mesh;
    let p = mesh.axis_size(pp);

    let step = state.step + 1;
    let inputs = chunk_inputs(plan, t, state, batch, step);

    // A thread communicator per group of every axis; the `pp` groups carry the transfers.
    let comms = thread_comms(mesh, |_| true, timeout);
    let epoch = Instant::now();
    let results = run_threads(comms, |rank, ctx| {
        let stage = mesh.coords(rank)[pp.0 as usize];
        run_stage(plan, stage, ctx, &inputs, &[], weights, epoch)
    });

    // Prefer a root cause over the aborts and hang-ups it caused in its peers.
    let outs = root_cause(mesh, results).map_err(|e| at_step(step, e))?;

    // Each chunk's outputs from the ranks of its stage, in stage-mesh rank order.
    let sm = &mesh.without_axis("pp");
    let ranks_of = |stage: usize| -> Vec<usize> {
        (0..sm.world_size())
            .map(|q| {
                let sc = sm.coords(q);
                let mut co = Vec::with_capacity(mesh.axes.len());
                let mut it = sc.into_iter();
                for a in mesh.axis_ids() {
                    co.push(if a == pp {
                        stage
                    } else {
                        it.next().unwrap_or(0)
                    });
                }
                mesh.rank_of(&co)
            })
            .collect()
    };
    let mut loss = f32::NAN;
    let (mut grads, mut update) = (BTreeMap::new(), StepUpdate::default());
    for ch in &plan.chunks {
        let ranks = ranks_of(ch.stage);
        let get = |name: &str| -> Result<Tensor, TrainError> {
            let (v, shardings) = chunk_output(ch, name)
                .ok_or_else(|| TrainError::MissingOutput(name.to_string()))?;
            let locals = ranks
                .iter()
                .map(|&r| {
                    outs[r]
                        .outputs
                        .get(&ch.index)
                        .and_then(|o| o.get(name))
                        .ok_or_else(|| TrainError::MissingOutput(name.to_string()))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(assemble(sm, &shardings[v.index()], &locals))
        };
        if ch.head {
            loss = get("loss")?.as_f32().map_or(f32::NAN, |v| v[0]);
        }
        for prm in t.params_of(ch.index) {
            let l = &prm.label;
            // A tied parameter's two copies: its gradient is the sum of theirs (each copy's
            // update already used it, so the copies' updates agree).
            let g = get(&prm.grad)?;
            let g = match grads.remove(l) {
                Some(other) => add_tensors(&other, &g),
                None => g,
            };
            grads.insert(l.clone(), g);
            update.take(prm, &get)?;
        }
    }
    state.commit(&t.params, step, loss, &grads, update)?;
    let mut peak_activation_bytes = vec![0; p];
    for (r, o) in outs.iter().enumerate() {
        let s = mesh.coords(r)[pp.0 as usize];
        peak_activation_bytes[s] = peak_activation_bytes[s].max(o.peak_activation_bytes);
    }
    Ok(PipelineStep {
        output: StepOutput { loss, grads },
        peak_activation_bytes,
        timelines: outs.into_iter().map(|o| o.timeline).collect(),
    })
}

/// Where output `name` of chunk `ch` comes from: its micro-batch program (loss, gradients:
/// summed over the micro-batches) or its step program (parameters, optimizer state); the
/// value and the layouts of that program.
fn chunk_output<'a>(
    ch: &'a shardc_compiler::plan::PlanChunk,
    name: &str,
) -> Option<(
    shardc_compiler::ir::ValueId,
    &'a [shardc_compiler::shard::TensorSharding],
)> {
    if let Some(st) = &ch.step {
        if let Some(v) = st.program.output(name) {
            return Some((v, &st.shardings));
        }
    }
    ch.program.output(name).map(|v| (v, &ch.shardings[..]))
}

/// One rank of pipeline stage `stage`: its chunks' programs driven by the stage's
/// instructions, transfers over the `pp` axis's communicator in `ctx` (point-to-point; the
/// k-th send to a peer matches its k-th receive), the stage-mesh axes' communicators for the
/// programs' collectives. Any [`Communicator`](crate::comm::Communicator) serves: thread ranks here, a process group
/// across processes. Inputs are global tensors per chunk and micro-batch (each rank takes
/// its shard), except those in `locals` (per chunk, already this rank's: e.g. its parameter
/// shards from the previous step's outputs). Each micro-batch in flight on a chunk has its
/// own run of the chunk's micro-batch program, from its first receive or pass to its `W`
/// pass, which adds its `loss` and `grad.*` outputs to the chunk's sums (in micro-batch
/// order, as the schedules finish them); the optimizer step runs the chunk's step program on
/// the sums. Returns each chunk's outputs (local values: the sums and the step's outputs),
/// the most bytes of activations its runs held at once, and its timeline.
pub fn run_stage(
    plan: &Plan,
    stage: usize,
    ctx: &RankCtx,
    inputs: &[Vec<BTreeMap<String, Tensor>>],
    locals: &[BTreeMap<String, Tensor>],
    weights: &Weights,
    epoch: Instant,
) -> Result<StageOutputs, RuntimeError> {
    let pp = ctx.comm("pp")?;
    let code = |carry: Carry| match carry {
        Carry::Act => 0.0,
        Carry::Grad => 1.0,
        Carry::Tied => 2.0,
    };
    let transfer_err = |op: &PipeOp, e: crate::comm::CommError| {
        let text = e.to_string();
        if text.contains("timed out") {
            pipe_err(op, format!("nothing arrived within the timeout ({text})"))
        } else {
            pipe_err(op, text)
        }
    };
    let chunks = &plan.chunks;
    let graphs = plan.chunk_graphs().map_err(|e| RuntimeError::Pipeline {
        op: format!("stage {stage}"),
        detail: e.to_string(),
    })?;
    let mine: Vec<usize> = chunks
        .iter()
        .filter(|ch| ch.stage == stage)
        .map(|ch| ch.index)
        .collect();
    let caches: Vec<ParamCache> = mine
        .iter()
        .map(|&j| load_params(&chunks[j].program, weights, ctx))
        .collect::<Result<_, _>>()?;
    let activation: Vec<Vec<bool>> = mine
        .iter()
        .map(|&j| activation_values(&chunks[j].program))
        .collect();
    let no_locals = BTreeMap::new();
    let locals_of = |j: usize| locals.get(j).unwrap_or(&no_locals);
    let input_of = |j: usize, i: usize| -> Result<&BTreeMap<String, Tensor>, RuntimeError> {
        inputs
            .get(j)
            .and_then(|x| x.get(i))
            .ok_or_else(|| RuntimeError::Pipeline {
                op: format!("chunk {j}"),
                detail: format!("no inputs for micro-batch {i}"),
            })
    };
    // Per chunk of this rank: the runs of the micro-batches in flight, the sums of the
    // finished ones, the tied copy's gradient received, whether it stepped.
    let mut flights: Vec<BTreeMap<usize, Stepwise>> =
        mine.iter().map(|_| BTreeMap::new()).collect();
    let mut sums: Vec<BTreeMap<String, Tensor>> = vec![BTreeMap::new(); mine.len()];
    let mut tied: Vec<Option<(String, Tensor)>> = vec![None; mine.len()];
    let mut stepped = vec![false; mine.len()];
    // Boundary tensors of finished runs not sent yet (a `B` pass's input gradient when its
    // `W` follows it before the send), by chunk slot, carry and micro-batch.
    let mut unsent: BTreeMap<(usize, u8, usize), Tensor> = BTreeMap::new();
    let slot_of = |chunk: usize| mine.iter().position(|&j| j == chunk);
    let mut outputs = BTreeMap::new();
    let mut peak = 0usize;
    let mut timeline = Timeline {
        tracks: vec!["compute".into(), "p2p".into()],
        ..Timeline::default()
    };
    let (Some(ops), Some(lists)) = (plan.pipeline_program.get(stage), Some(&plan.pipeline_nodes))
    else {
        return Err(RuntimeError::Pipeline {
            op: format!("stage {stage}"),
            detail: "the plan has no instructions for it".into(),
        });
    };
    // The run of micro-batch `i` on chunk slot `k` (started on first use).
    macro_rules! flight {
        ($op:expr, $k:expr, $i:expr) => {{
            let (k, i) = ($k, $i);
            if stepped[k] {
                return Err(pipe_err($op, "after the chunk's optimizer step"));
            }
            if !flights[k].contains_key(&i) {
                let j = mine[k];
                let mut st = Stepwise::new(&chunks[j].program, &caches[k], input_of(j, i)?, ctx)?;
                let g = &chunks[j].program;
                for (name, t) in locals_of(j) {
                    if g.input_named(name).is_some() {
                        st.provide(name, t.clone())?;
                    }
                }
                flights[k].insert(i, st);
            }
            flights[k].get_mut(&i).expect("invariant: just inserted")
        }};
    }
    for op in ops {
        let start = epoch.elapsed().as_secs_f64();
        let mut bytes = 0u64;
        match *op {
            PipeOp::Recv {
                from,
                carry,
                micro,
                boundary,
            } => {
                let chunk = carry.receiver(boundary, chunks.len());
                let k = slot_of(chunk).ok_or_else(|| pipe_err(op, "not a chunk of this rank"))?;
                let g = graphs[chunk].receiver(carry);
                let name = boundary_name(&graphs[chunk], carry)
                    .ok_or_else(|| pipe_err(op, "the chunk has no input for it"))?;
                let ty = g
                    .input_named(&name)
                    .map(|v| g.ty(v).clone())
                    .ok_or_else(|| pipe_err(op, "the chunk has no input for it"))?;
                // A header (what, micro-batch, boundary), then the tensor.
                let mut buf = vec![0.0f32; 3 + ty.numel()];
                pp.recv(&mut buf, from).map_err(|e| transfer_err(op, e))?;
                bytes = 4 * (buf.len() as u64 - 3);
                let want = [code(carry), micro as f32, boundary as f32];
                if buf[..3] != want {
                    return Err(pipe_err(
                        op,
                        format!(
                            "received (kind {}, micro-batch {}, boundary {}) instead",
                            buf[0], buf[1], buf[2]
                        ),
                    ));
                }
                buf.drain(..3);
                let t = Tensor::f32(ty.shape(), buf);
                if carry == Carry::Tied {
                    if stepped[k] {
                        return Err(pipe_err(op, "after the chunk's optimizer step"));
                    }
                    tied[k] = Some((name, t));
                } else {
                    flight!(op, k, micro).provide(&name, t)?;
                }
            }
            PipeOp::Send {
                to,
                carry,
                micro,
                boundary,
            } => {
                let chunk = carry.sender(boundary);
                let k = slot_of(chunk).ok_or_else(|| pipe_err(op, "not a chunk of this rank"))?;
                let v = sent_value(&graphs[chunk], carry)
                    .ok_or_else(|| pipe_err(op, "the chunk has no output to send"))?;
                // Boundary tensors are handed over; a tied copy's gradient is its sum over
                // the micro-batches, also an output of the step, so it is copied.
                let tensor = match carry {
                    Carry::Tied => {
                        let name = chunks[chunk].program.node(v).name.clone();
                        let out = chunks[chunk]
                            .program
                            .outputs
                            .iter()
                            .find(|(_, x)| *x == v)
                            .map_or(name, |(n, _)| n.clone());
                        sums[k].get(&out).cloned()
                    }
                    _ => match unsent.remove(&(k, code(carry) as u8, micro)) {
                        Some(t) => Some(t),
                        None => flight!(op, k, micro).take(v),
                    },
                }
                .ok_or_else(|| pipe_err(op, "the value was not computed"))?;
                let data = tensor
                    .as_f32()
                    .ok_or_else(|| pipe_err(op, "the value is not f32"))?;
                let mut buf = Vec::with_capacity(3 + data.len());
                buf.extend([code(carry), micro as f32, boundary as f32]);
                buf.extend_from_slice(data);
                pp.send(&buf, to).map_err(|e| transfer_err(op, e))?;
                bytes = 4 * data.len() as u64;
            }
            PipeOp::Run(slot) => {
                let k =
                    slot_of(slot.chunk).ok_or_else(|| pipe_err(op, "not a chunk of this rank"))?;
                let nodes = lists
                    .get(slot.chunk)
                    .and_then(|l| l.get(phase_index(slot.phase)))
                    .ok_or_else(|| pipe_err(op, "the plan has no node list for it"))?;
                flight!(op, k, slot.micro)
                    .run_nodes(nodes)
                    .map_err(|e| match e {
                        // Every micro-batch runs the same program: name the one this is.
                        RuntimeError::NonFiniteLoss { value, .. } => RuntimeError::NonFiniteLoss {
                            micro: slot.micro,
                            value,
                        },
                        e => e,
                    })?;
                if slot.phase == Phase::W {
                    let mut st = flights[k]
                        .remove(&slot.micro)
                        .expect("invariant: the run exists");
                    for carry in [Carry::Act, Carry::Grad] {
                        if let Some(t) =
                            sent_value(&graphs[slot.chunk], carry).and_then(|v| st.take(v))
                        {
                            unsent.insert((k, code(carry) as u8, slot.micro), t);
                        }
                    }
                    for (name, t) in st.finish()? {
                        match sums[k].get_mut(&name) {
                            Some(acc) => crate::micro::accumulate(acc, &t, &name)?,
                            None => {
                                sums[k].insert(name, t);
                            }
                        }
                    }
                }
            }
            PipeOp::Step { chunk } => {
                let k = slot_of(chunk).ok_or_else(|| pipe_err(op, "not a chunk of this rank"))?;
                if std::mem::replace(&mut stepped[k], true) {
                    return Err(pipe_err(op, "the chunk stepped twice"));
                }
                if let Some(&i) = flights[k].keys().next() {
                    return Err(pipe_err(op, format!("micro-batch {i} has not finished")));
                }
                let step = chunks[chunk]
                    .step
                    .as_ref()
                    .ok_or_else(|| pipe_err(op, "the chunk has no step program"))?;
                let g = &step.program;
                let mut st = Stepwise::new(g, &caches[k], input_of(chunk, 0)?, ctx)?;
                let given = locals_of(chunk)
                    .iter()
                    .chain(
                        sums[k]
                            .iter()
                            .filter(|(n, _)| ValueRole::gradient_label(n).is_some()),
                    )
                    .chain(tied[k].iter().map(|(n, t)| (n, t)));
                for (name, t) in given {
                    if g.input_named(name).is_some() {
                        st.provide(name, t.clone())?;
                    }
                }
                let mut out = std::mem::take(&mut sums[k]);
                out.extend(st.finish()?);
                outputs.insert(chunk, out);
            }
        }
        let transfer = matches!(op, PipeOp::Send { .. } | PipeOp::Recv { .. });
        timeline.slices.push(Slice {
            track: u32::from(transfer),
            name: op.to_string(),
            cat: op.category().into(),
            start,
            dur: epoch.elapsed().as_secs_f64() - start,
            bytes,
            flops: 0.0,
        });
        let live: usize = flights
            .iter()
            .zip(&activation)
            .flat_map(|(f, a)| f.values().map(move |s| s.live_bytes_of(|v| a[v.index()])))
            .sum();
        peak = peak.max(live);
        timeline
            .memory
            .push((epoch.elapsed().as_secs_f64(), live as u64));
    }
    if let Some(k) = stepped.iter().position(|s| !s) {
        return Err(RuntimeError::Pipeline {
            op: "end of instructions".into(),
            detail: format!("chunk {} never ran its optimizer step", mine[k]),
        });
    }
    Ok(StageOutputs {
        outputs,
        peak_activation_bytes: peak,
        timeline,
    })
}
