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
    assemble, at_step, batch_inputs, check_batch, kept_state, reduce_loss, train_section, Batch,
    StepCheck, StepOutput, TrainError, TrainState,
};
use crate::{RuntimeError, Tensor, Weights};
use shardc_compiler::cost::{Slice, Timeline};
use shardc_compiler::plan::{Plan, PlanTrain};
use shardc_compiler::schedule::pp::{Carry, PipeOp};
use shardc_compiler::shard::AxisId;
use shardc_compiler::train::{activation_values, boundary_name, micro_deps, sent_value};
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
    match (plan.pipeline.as_ref(), plan.mesh.axis("pp")) {
        (Some(_), Some(pp)) => Ok((t, pp)),
        _ => Err(TrainError::PlanKind(format!(
            "the plan of {} has no pipeline schedule: it runs as one SPMD program",
            plan.model.source
        ))),
    }
}

/// The global inputs of each chunk of pipeline plan `plan` (training section `t`) for step
/// `step` (1-based) on `batch` from `state`: the batch (per micro-batch), the chunk's
/// parameters and optimizer state, the step count.
pub fn chunk_inputs(
    plan: &Plan,
    t: &PlanTrain,
    state: &TrainState,
    batch: &Batch,
    step: u64,
) -> Vec<BTreeMap<String, Tensor>> {
    let common = batch_inputs(batch, t.micro_batches);
    plan.chunks
        .iter()
        .map(|ch| {
            let mut x = common.clone();
            state.add_inputs_at(t.params_of(ch.index), step, &mut x);
            x
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
            let v = head
                .program
                .output("loss")
                .ok_or_else(|| TrainError::MissingOutput("loss".into()))?;
            let local = run
                .outputs
                .get(&head.index)
                .and_then(|o| o.get("loss"))
                .ok_or_else(|| TrainError::MissingOutput("loss".into()))?;
            loss[0] = reduce_loss(local, &head.shardings[v.index()], &stage_mesh, ctx)?;
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
    let (mut grads, mut params, mut m, mut v) = (
        BTreeMap::new(),
        BTreeMap::new(),
        BTreeMap::new(),
        BTreeMap::new(),
    );
    for ch in &plan.chunks {
        let ranks = ranks_of(ch.stage);
        let get = |name: &str| -> Result<Tensor, TrainError> {
            let v = ch
                .program
                .output(name)
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
            Ok(assemble(sm, &ch.shardings[v.index()], &locals))
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
            params.insert(l.clone(), get(&prm.param)?);
            m.insert(l.clone(), get(&prm.adam_m)?);
            v.insert(l.clone(), get(&prm.adam_v)?);
        }
    }
    // A poisoned step leaves the state as it was.
    StepCheck::new(&t.params).check_global(step, loss, &grads, &params)?;
    state.params.extend(params);
    state.m.extend(m);
    state.v.extend(v);
    state.step = step;
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

/// One rank of pipeline stage `stage`: its chunks' programs driven by the stage's
/// instructions, transfers over the `pp` axis's communicator in `ctx` (point-to-point; the
/// k-th send to a peer matches its k-th receive), the stage-mesh axes' communicators for the
/// programs' collectives. Any [`Communicator`](crate::comm::Communicator) serves: thread ranks here, a process group
/// across processes. Inputs are global tensors per chunk (each rank takes its shard), except
/// those in `locals` (per chunk, already this rank's: e.g. its parameter shards from the
/// previous step's outputs). Returns each chunk's outputs (local values), the most bytes of
/// activations its programs held at once, and its timeline.
pub fn run_stage(
    plan: &Plan,
    stage: usize,
    ctx: &RankCtx,
    inputs: &[BTreeMap<String, Tensor>],
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
    let m = plan.pipeline.as_ref().map_or(1, |s| s.micro_batches).max(1);
    let chunks = &plan.chunks;
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
        .map(|&j| {
            let g = &chunks[j].program;
            activation_values(g, &micro_deps(g, m))
        })
        .collect();
    let mut steppers: Vec<Option<Stepwise>> = mine
        .iter()
        .zip(&caches)
        .map(|(&j, cache)| Stepwise::new(&chunks[j].program, cache, &inputs[j], ctx).map(Some))
        .collect::<Result<_, _>>()?;
    for (st, &j) in steppers.iter_mut().zip(&mine) {
        if let (Some(st), Some(l)) = (st.as_mut(), locals.get(j)) {
            for (name, t) in l {
                st.provide(name, t.clone())?;
            }
        }
    }
    let slot_of = |chunk: usize| mine.iter().position(|&j| j == chunk);
    let mut outputs = BTreeMap::new();
    let mut peak = 0usize;
    let mut timeline = Timeline {
        tracks: vec!["compute".into(), "p2p".into()],
        ..Timeline::default()
    };
    let (Some(ops), Some(lists)) = (
        plan.pipeline_program.get(stage),
        plan.pipeline_nodes.get(stage),
    ) else {
        return Err(RuntimeError::Pipeline {
            op: format!("stage {stage}"),
            detail: "the plan has no instructions for it".into(),
        });
    };
    for (op, nodes) in ops.iter().zip(lists) {
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
                let g = &chunks[chunk].program;
                let name = boundary_name(g, carry, micro, m)
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
                let st = steppers[k]
                    .as_mut()
                    .ok_or_else(|| pipe_err(op, "after the chunk's optimizer step"))?;
                buf.drain(..3);
                st.provide(&name, Tensor::f32(ty.shape(), buf))?;
            }
            PipeOp::Send {
                to,
                carry,
                micro,
                boundary,
            } => {
                let chunk = carry.sender(boundary);
                let k = slot_of(chunk).ok_or_else(|| pipe_err(op, "not a chunk of this rank"))?;
                let g = &chunks[chunk].program;
                let v = sent_value(g, carry, micro, m)
                    .ok_or_else(|| pipe_err(op, "the chunk has no output to send"))?;
                let st = steppers[k]
                    .as_mut()
                    .ok_or_else(|| pipe_err(op, "after the chunk's optimizer step"))?;
                // Boundary tensors are handed over; a tied gradient is also an output of the
                // step, so it is copied (after the values it still needs).
                st.run_nodes(nodes)?;
                let tensor = match carry {
                    Carry::Tied => st.value(v).cloned(),
                    _ => st.take(v),
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
                let st = steppers[k]
                    .as_mut()
                    .ok_or_else(|| pipe_err(op, "after the chunk's optimizer step"))?;
                st.run_nodes(nodes)?;
            }
            PipeOp::Step { chunk } => {
                let k = slot_of(chunk).ok_or_else(|| pipe_err(op, "not a chunk of this rank"))?;
                let mut st = steppers[k]
                    .take()
                    .ok_or_else(|| pipe_err(op, "the chunk stepped twice"))?;
                st.run_nodes(nodes)?;
                outputs.insert(chunk, st.finish()?);
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
        let live: usize = steppers
            .iter()
            .zip(&activation)
            .filter_map(|(s, a)| s.as_ref().map(|s| s.live_bytes_of(|v| a[v.index()])))
            .sum();
        peak = peak.max(live);
        timeline
            .memory
            .push((epoch.elapsed().as_secs_f64(), live as u64));
    }
    if let Some(k) = steppers.iter().position(Option::is_some) {
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
