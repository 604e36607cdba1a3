//! Training on the CPU reference backend: the state of a run (weights in graph layout, AdamW
//! moments, step count), one step of a training [`Plan`] (its program and its training
//! section, [`PlanTrain`]) on thread ranks, and checkpoints in the checkpoint's own tensor
//! names and layouts.
//!
//! A step feeds every rank the global state and batch (each takes its shard), runs the SPMD
//! program, and assembles each output from the ranks' local values by its layout: shards are
//! concatenated, partial sums added (so gradients are the reduced gradients whatever layout
//! they end the step in), replicas read once.

use crate::cpu::layout::permute;
use crate::spmd::{run_spmd, RankError};
use crate::{execute_with_params, ParamCache, RankCtx, RuntimeError, Tensor, Weights};
use shardc_compiler::autodiff::input_name;
use shardc_compiler::checkpoint::StateKind;
use shardc_compiler::ir::ValueRole;
use shardc_compiler::plan::{Plan, PlanParam, PlanTrain};
use shardc_compiler::shard::{Mesh, TensorSharding};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use thiserror::Error;

/// The label PyTorch's cross-entropy ignores.
pub const IGNORE_INDEX: i32 = -100;

/// An error training or saving.
#[derive(Debug, Error)]
pub enum TrainError {
    /// Loading, executing or a kernel failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A rank failed.
    #[error(transparent)]
    Rank(#[from] RankError),
    /// Another backend's executor failed (the CUDA backend's `CudaError` or a CUDA rank's).
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync>),
    /// The batch does not fit the compiled step.
    #[error("batch is [{batch}, {seq}] but the step was compiled for [{want_batch}, {want_seq}]")]
    BatchShape {
        /// Sequences given.
        batch: usize,
        /// Tokens per sequence given.
        seq: usize,
        /// Sequences compiled for.
        want_batch: usize,
        /// Tokens compiled for.
        want_seq: usize,
    },
    /// The program lacks an output the runner reads (a compiler bug).
    #[error("the training program has no output `{0}`")]
    MissingOutput(String),
    /// The plan cannot run as asked: a forward plan given to a trainer, a pipeline plan to
    /// the single-program trainer or the reverse.
    #[error("{0}")]
    PlanKind(String),
    /// A step computed a NaN or infinite loss, gradient or updated parameter: training
    /// stopped there, before anything is written from the poisoned state.
    #[error("step {step}{}: {what} is {value}", micro.map_or(String::new(), |k| format!(", micro-batch {k}")))]
    NonFinite {
        /// The step (1-based).
        step: u64,
        /// The micro-batch (0-based) whose loss it is, for a loss.
        micro: Option<usize>,
        /// What: `loss`, `gradient of <stored tensor>`, `<stored tensor> after the optimizer
        /// update`.
        what: String,
        /// The value (NaN where any is NaN).
        value: f32,
    },
    /// A checkpoint could not be written.
    #[error("writing {}: {msg}", path.display())]
    Save {
        /// The file.
        path: PathBuf,
        /// What failed.
        msg: String,
    },
}

impl TrainError {
    /// True when every rank of a process group reaches this error by itself, so none needs
    /// aborting (which could overtake a peer's last message): the end-of-step finiteness
    /// check ([`RankTrainer::step`], `StageTrainer::step` of the pipeline runtime), whose codes all
    /// ranks reduce before reporting. A micro-batch's non-finite loss is seen only by the
    /// ranks computing it; their peers may be waiting for them.
    pub fn every_rank_fails(&self) -> bool {
        matches!(self, TrainError::NonFinite { micro: None, .. })
    }
}

/// One step's batch: token ids, positions, attention mask and causal-LM labels, `[B, T]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Token ids.
    pub ids: Vec<i32>,
    /// Position ids.
    pub positions: Vec<i32>,
    /// Attention mask (1 keep, 0 padding).
    pub mask: Vec<f32>,
    /// Labels: the next token, [`IGNORE_INDEX`] at the last position.
    pub labels: Vec<i32>,
}

impl Batch {
    /// A causal-LM batch as transformers builds it from `labels = input_ids`: position `t`
    /// predicts token `t + 1`; positions `0..T`, no padding.
    /// `ids` holds `batch · seq` ids, row-major ([`train_step`] rejects a batch that does not).
    pub fn causal_lm(ids: Vec<i32>, batch: usize, seq: usize) -> Batch {
        let labels = (0..batch * seq)
            .map(|i| match ids.get(i + 1) {
                Some(&next) if i % seq + 1 < seq => next,
                _ => IGNORE_INDEX,
            })
            .collect();
        Batch {
            batch,
            seq,
            positions: (0..batch).flat_map(|_| 0..seq as i32).collect(),
            mask: vec![1.0; batch * seq],
            labels,
            ids,
        }
    }

    /// Labels that count (≥ 0): the loss divisor.
    pub fn predicted_tokens(&self) -> usize {
        self.labels.iter().filter(|&&y| y >= 0).count()
    }

    /// Rows `[lo, lo + n)` of a `[B, T]` field.
    fn rows<T: Copy>(&self, v: &[T], lo: usize, n: usize) -> Vec<T> {
        v[lo * self.seq..(lo + n) * self.seq].to_vec()
    }
}

/// The state of a training run: weights (global, graph layout) and AdamW moments per
/// parameter label, and the number of steps taken.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainState {
    /// Weights by parameter label.
    pub params: BTreeMap<String, Tensor>,
    /// First moments.
    pub m: BTreeMap<String, Tensor>,
    /// Second moments.
    pub v: BTreeMap<String, Tensor>,
    /// Steps taken.
    pub step: u64,
}

impl TrainState {
    /// Its weights or one of its moments, by parameter label.
    pub fn of(&self, kind: StateKind) -> &BTreeMap<String, Tensor> {
        match kind {
            StateKind::Param => &self.params,
            StateKind::ExpAvg => &self.m,
            StateKind::ExpAvgSq => &self.v,
        }
    }

    /// [`TrainState::of`], to change.
    pub fn of_mut(&mut self, kind: StateKind) -> &mut BTreeMap<String, Tensor> {
        match kind {
            StateKind::Param => &mut self.params,
            StateKind::ExpAvg => &mut self.m,
            StateKind::ExpAvgSq => &mut self.v,
        }
    }

    /// The initial state of training plan `plan`: the checkpoint's weights, zero moments,
    /// step 0.
    pub fn load(plan: &Plan, weights: &Weights) -> Result<TrainState, TrainError> {
        Ok(TrainState::load_params(
            &train_section(plan)?.params,
            weights,
        )?)
    }

    /// Adds the next step's parameter, optimizer-state and step-count inputs of `params` to
    /// `inputs` (global tensors; the step count is `step + 1`).
    pub fn add_inputs<'a>(
        &self,
        params: impl IntoIterator<Item = &'a PlanParam>,
        inputs: &mut BTreeMap<String, Tensor>,
    ) {
        self.add_inputs_at(params, self.step + 1, inputs);
    }

    /// [`TrainState::add_inputs`] with step count `step` (1-based).
    pub fn add_inputs_at<'a>(
        &self,
        params: impl IntoIterator<Item = &'a PlanParam>,
        step: u64,
        inputs: &mut BTreeMap<String, Tensor>,
    ) {
        // A parameter the state does not hold (a resumed rank starts from its own blocks,
        // given to its trainer as locals) is left out: a program that still reads it fails
        // naming the input.
        for p in params {
            let l = &p.label;
            for (name, map) in [
                (&p.param, &self.params),
                (&p.adam_m, &self.m),
                (&p.adam_v, &self.v),
            ] {
                if let Some(t) = map.get(l) {
                    inputs.insert(name.clone(), t.clone());
                }
            }
        }
        inputs.insert("step".into(), Tensor::f32(vec![], vec![step as f32]));
    }

    /// The initial state of parameters `params` (e.g. every chunk's of a pipeline).
    pub fn load_params<'a>(
        params: impl IntoIterator<Item = &'a PlanParam>,
        weights: &Weights,
    ) -> Result<TrainState, RuntimeError> {
        let mut s = TrainState {
            params: BTreeMap::new(),
            m: BTreeMap::new(),
            v: BTreeMap::new(),
            step: 0,
        };
        for p in params {
            let t = weights.load(&p.source, &p.ty, &|_| None)?;
            let zeros = Tensor::zeros(p.ty.dtype, p.ty.shape());
            s.params.insert(p.label.clone(), t);
            s.m.insert(p.label.clone(), zeros.clone());
            s.v.insert(p.label.clone(), zeros);
        }
        Ok(s)
    }

    /// Makes `update` the state of step `step` once the step checks out (loss, gradients and
    /// updated parameters finite): a poisoned step leaves the state as it was.
    pub(crate) fn commit<'a>(
        &mut self,
        params: impl IntoIterator<Item = &'a PlanParam>,
        step: u64,
        loss: f32,
        grads: &BTreeMap<String, Tensor>,
        update: StepUpdate,
    ) -> Result<(), TrainError> {
        StepCheck::new(params).check_global(step, loss, grads, &update.params)?;
        self.params.extend(update.params);
        self.m.extend(update.m);
        self.v.extend(update.v);
        self.step = step;
        Ok(())
    }
}

/// A step's updated parameters and AdamW moments by label, gathered from its outputs and
/// kept until [`TrainState::commit`].
#[derive(Default)]
pub(crate) struct StepUpdate {
    params: BTreeMap<String, Tensor>,
    m: BTreeMap<String, Tensor>,
    v: BTreeMap<String, Tensor>,
}

impl StepUpdate {
    /// Takes parameter `p`'s updated weight and moments, each read by `get` (a step output by
    /// name).
    pub(crate) fn take(
        &mut self,
        p: &PlanParam,
        get: &impl Fn(&str) -> Result<Tensor, TrainError>,
    ) -> Result<(), TrainError> {
        let l = &p.label;
        self.params.insert(l.clone(), get(&p.param)?);
        self.m.insert(l.clone(), get(&p.adam_m)?);
        self.v.insert(l.clone(), get(&p.adam_v)?);
        Ok(())
    }
}

/// What one step returns.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// The loss (mean over predicted tokens) before the update.
    pub loss: f32,
    /// Gradients by parameter label (global, graph layout).
    pub grads: BTreeMap<String, Tensor>,
}

/// Adds local tensor `x` of rank coordinates `coords` into `out` (the global tensor), at the
/// block its layout `s` gives it.
fn add_block(
    out: &mut [f64],
    global: &[usize],
    x: &Tensor,
    s: &TensorSharding,
    mesh: &Mesh,
    coords: &[usize],
) {
    let local = &x.shape;
    let xd = x.as_f32().map(<[f32]>::to_vec).unwrap_or_else(|| {
        x.as_i32()
            .map(|v| v.iter().map(|&e| e as f32).collect())
            .unwrap_or_default()
    });
    let r = local.len();
    // Block offset along each dim: the shard index (major to minor axes) times the local size.
    let offset: Vec<usize> = (0..r)
        .map(|d| {
            let idx = s.dims[d]
                .iter()
                .fold(0, |acc, &a| acc * mesh.axis_size(a) + coords[a.0 as usize]);
            idx * local[d]
        })
        .collect();
    let mut gstride = vec![1usize; r];
    for d in (0..r.saturating_sub(1)).rev() {
        gstride[d] = gstride[d + 1] * global[d + 1];
    }
    for (i, &val) in xd.iter().enumerate() {
        let mut rem = i;
        let mut gi = 0;
        for d in (0..r).rev() {
            let c = rem % local[d].max(1);
            rem /= local[d].max(1);
            gi += (c + offset[d]) * gstride[d];
        }
        out[gi] += val as f64;
    }
}

/// The global value of an output from every rank's local value (rank order) and its layout.
pub fn assemble(mesh: &Mesh, s: &TensorSharding, locals: &[&Tensor]) -> Tensor {
    let local = &locals[0].shape;
    let global: Vec<usize> = (0..local.len())
        .map(|d| local[d] * s.parts(mesh, d))
        .collect();
    let used = s.used_axes();
    let mut out = vec![0.0f64; global.iter().product()];
    for (rank, x) in locals.iter().enumerate() {
        let coords = mesh.coords(rank);
        // One replica of every replicated axis.
        let replica = mesh
            .axis_ids()
            .all(|a| used.contains(&a) || coords[a.0 as usize] == 0);
        if replica {
            add_block(&mut out, &global, x, s, mesh, &coords);
        }
    }
    let data = out.into_iter().map(|v| v as f32).collect();
    if locals[0].as_i32().is_some() {
        let v: Vec<f32> = data;
        return Tensor::i32(global, v.into_iter().map(|e| e as i32).collect());
    }
    Tensor::f32(global, data)
}

/// The training section of `plan`, or the error of a forward plan.
pub fn train_section(plan: &Plan) -> Result<&PlanTrain, TrainError> {
    plan.train.as_ref().ok_or_else(|| {
        TrainError::PlanKind(format!(
            "the plan of {} is a forward plan (no `train` section): compile a training step \
             with `shardc compile --train`",
            plan.model.source
        ))
    })
}

/// The training section of a plan of one SPMD program (no pipeline).
fn flat_section(plan: &Plan) -> Result<&PlanTrain, TrainError> {
    if plan.pipeline.is_some() {
        return Err(TrainError::PlanKind(
            "a pipeline plan runs with the pipeline trainer, not one SPMD program".into(),
        ));
    }
    train_section(plan)
}

/// Runs one step of training plan `plan` (no pipeline) on thread ranks (an axis-less mesh:
/// in this thread) and updates `state`.
/// `weights` is the model's checkpoint (a training program reads its parameters as inputs,
/// not from the checkpoint).
pub fn train_step(
    plan: &Plan,
    state: &mut TrainState,
    batch: &Batch,
    weights: &Weights,
    timeout: Duration,
) -> Result<StepOutput, TrainError> {
    let t = flat_section(plan)?;
    check_batch(batch, plan.model.batch, plan.model.seq)?;
    let (g, mesh) = (&plan.program, &plan.mesh);
    let step = state.step + 1;
    let outs = match &plan.step {
        // The micro-batch's program per micro-batch, then the step program.
        Some(sp) => {
            let k = t.micro_batches;
            let batches: Vec<_> = (0..k).map(|i| micro_batch_inputs(batch, k, i)).collect();
            let mut st = BTreeMap::new();
            state.add_inputs(&t.params, &mut st);
            let none = BTreeMap::new();
            if mesh.axes.is_empty() {
                let cache = ParamCache::default();
                let ctx = RankCtx::new();
                vec![
                    crate::micro::run_rank_step(g, sp, &cache, &batches, &st, &none, &ctx)
                        .map_err(|e| at_step(step, e))?,
                ]
            } else {
                let comms = crate::spmd::thread_comms(mesh, |_| true, timeout);
                let results = crate::spmd::run_threads(comms, |_, ctx| {
                    let cache = crate::load_params(g, weights, ctx)?;
                    crate::micro::run_rank_step(g, sp, &cache, &batches, &st, &none, ctx)
                });
                crate::spmd::root_cause(mesh, results).map_err(|e| at_step(step, e))?
            }
        }
        None => {
            return train_step_with(plan, state, batch, |inputs| {
                Ok(if mesh.axes.is_empty() {
                    vec![execute_with_params(
                        g,
                        &ParamCache::default(),
                        inputs,
                        &RankCtx::new(),
                    )?]
                } else {
                    run_spmd(g, mesh, weights, inputs, timeout)?
                })
            })
        }
    };
    finish_step(plan, state, step, &outs)
}

/// One training step of `plan` whose program runs on another backend: `run` executes the
/// program on the step's global inputs (batch, parameters, AdamW moments, step count; each
/// rank takes its shard) and returns every rank's outputs in rank order. The outputs are
/// assembled and committed as [`train_step`] does. Plans with a separate step program
/// (several micro-batches) or a pipeline are refused by name.
pub fn train_step_with(
    plan: &Plan,
    state: &mut TrainState,
    batch: &Batch,
    run: impl FnOnce(&BTreeMap<String, Tensor>) -> Result<Vec<BTreeMap<String, Tensor>>, TrainError>,
) -> Result<StepOutput, TrainError> {
    let t = flat_section(plan)?;
    check_batch(batch, plan.model.batch, plan.model.seq)?;
    if plan.step.is_some() {
        return Err(TrainError::PlanKind(format!(
            "this backend runs training plans of one program per step; the plan accumulates \
             {} micro-batches through a separate step program (run it on the CPU backend)",
            t.micro_batches
        )));
    }
    let step = state.step + 1;
    let mut inputs = batch_inputs(batch, t.micro_batches);
    state.add_inputs(&t.params, &mut inputs);
    let outs = run(&inputs).map_err(|e| at_step(step, e))?;
    finish_step(plan, state, step, &outs)
}

/// Assembles step `step`'s loss, gradients and updated state from every rank's outputs
/// `outs` (rank order) and commits the state ([`TrainState::commit`]).
fn finish_step(
    plan: &Plan,
    state: &mut TrainState,
    step: u64,
    outs: &[BTreeMap<String, Tensor>],
) -> Result<StepOutput, TrainError> {
    let t = flat_section(plan)?;
    let (g, mesh) = (&plan.program, &plan.mesh);
    let get = |name: &str| -> Result<Tensor, TrainError> {
        let (v, shardings) = match (g.output(name), &plan.step) {
            (Some(v), _) => (v, &plan.shardings),
            (None, Some(sp)) => (
                sp.program
                    .output(name)
                    .ok_or_else(|| TrainError::MissingOutput(name.to_string()))?,
                &sp.shardings,
            ),
            (None, None) => return Err(TrainError::MissingOutput(name.to_string())),
        };
        let locals = outs
            .iter()
            .map(|o| {
                o.get(name)
                    .ok_or_else(|| TrainError::MissingOutput(name.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(assemble(mesh, &shardings[v.index()], &locals))
    };
    let loss = get("loss")?.as_f32().map_or(f32::NAN, |v| v[0]);
    let (mut grads, mut update) = (BTreeMap::new(), StepUpdate::default());
    for p in &t.params {
        grads.insert(p.label.clone(), get(&p.grad)?);
        update.take(p, &get)?;
    }
    state.commit(&t.params, step, loss, &grads, update)?;
    Ok(StepOutput { loss, grads })
}

/// `e`, a step's failure, with the step named when it is a non-finite loss (which the
/// executor reports by micro-batch, not knowing the step).
pub(crate) fn at_step(step: u64, e: impl Into<TrainError>) -> TrainError {
    let e = e.into();
    let loss = match &e {
        TrainError::Runtime(RuntimeError::NonFiniteLoss { micro, value })
        | TrainError::Rank(RankError {
            error: RuntimeError::NonFiniteLoss { micro, value },
            ..
        }) => Some((*micro, *value)),
        _ => None,
    };
    match loss {
        Some((micro, value)) => TrainError::NonFinite {
            step,
            micro: Some(micro),
            what: "loss".into(),
            value,
        },
        None => e,
    }
}

/// A code for the worst non-finite value in `x`: 0 all finite, 1 +inf, 2 −inf, 3 NaN (so
/// codes combine by max, across tensors and across ranks).
fn non_finite_code(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |worst, &v| {
        let c = if v.is_nan() {
            3.0
        } else if v == f32::INFINITY {
            1.0
        } else if v == f32::NEG_INFINITY {
            2.0
        } else {
            0.0
        };
        worst.max(c)
    })
}

/// The value a [`non_finite_code`] stands for.
fn code_value(code: f32) -> f32 {
    match code as u8 {
        1 => f32::INFINITY,
        2 => f32::NEG_INFINITY,
        _ => f32::NAN,
    }
}

/// The end-of-step finiteness check: the loss, every parameter's gradient and every updated
/// parameter, the last two per stored tensor (a stacked parameter's entries apart), in that
/// order. Each rank codes the values it holds ([`non_finite_code`]), the codes are reduced
/// with max over the whole mesh, and every rank reports the same first non-finite value, so
/// all of them fail together (none waits for a peer that stopped). It is as cheap as reading
/// the gradients once; the per-micro-batch loss is checked earlier, as it is computed.
pub(crate) struct StepCheck {
    /// Stored tensor names, by entry.
    names: Vec<String>,
    /// Per parameter label, its first entry and whether it is stacked.
    entries: BTreeMap<String, (usize, bool)>,
}

/// Which value of a parameter a code is about.
#[derive(Clone, Copy)]
pub(crate) enum Checked {
    /// Its gradient.
    Grad,
    /// Its value after the optimizer step.
    Updated,
}

impl StepCheck {
    /// The check of a step over `params` (a label met twice, a tied copy, counts once).
    pub(crate) fn new<'a>(params: impl IntoIterator<Item = &'a PlanParam>) -> StepCheck {
        let mut c = StepCheck {
            names: Vec::new(),
            entries: BTreeMap::new(),
        };
        for p in params {
            if c.entries.contains_key(&p.label) {
                continue;
            }
            let n = p.source.stack.unwrap_or(1);
            c.entries
                .insert(p.label.clone(), (c.names.len(), p.source.stack.is_some()));
            c.names.extend((0..n).map(|i| p.source.stored_name(i)));
        }
        c
    }

    /// All-finite codes: the loss, then the gradients, then the updated parameters.
    pub(crate) fn codes(&self) -> Vec<f32> {
        vec![0.0; 1 + 2 * self.names.len()]
    }

    /// Codes the loss.
    pub(crate) fn loss(&self, codes: &mut [f32], loss: f32) {
        codes[0] = codes[0].max(non_finite_code(&[loss]));
    }

    /// Codes `t`, the `what` of parameter `label` or this rank's block of it, which starts at
    /// stack entry `first` when the parameter is stacked (its dim 0).
    pub(crate) fn tensor(
        &self,
        codes: &mut [f32],
        what: Checked,
        label: &str,
        t: &Tensor,
        first: usize,
    ) {
        let Some(&(at, stacked)) = self.entries.get(label) else {
            return;
        };
        let base = 1 + at + self.names.len() * usize::from(matches!(what, Checked::Updated));
        let data = t.as_f32().unwrap_or(&[]);
        let rows = if stacked {
            t.shape.first().copied().unwrap_or(1).max(1)
        } else {
            1
        };
        let per = data.len() / rows;
        for (i, chunk) in data.chunks(per.max(1)).enumerate() {
            let k = base + if stacked { first + i } else { 0 };
            if let Some(c) = codes.get_mut(k) {
                *c = c.max(non_finite_code(chunk));
            }
        }
    }

    /// The first non-finite value the (reduced) `codes` record, as the error of step `step`.
    pub(crate) fn report(&self, step: u64, codes: &[f32]) -> Result<(), TrainError> {
        let Some(k) = codes.iter().position(|&c| c > 0.0) else {
            return Ok(());
        };
        let n = self.names.len();
        let what = match k {
            0 => "loss".to_string(),
            k if k <= n => format!("gradient of {}", self.names[k - 1]),
            k => format!("{} after the optimizer update", self.names[k - 1 - n]),
        };
        Err(TrainError::NonFinite {
            step,
            micro: None,
            what,
            value: code_value(codes[k]),
        })
    }

    /// Checks a step's global loss, gradients and updated parameters (by label).
    pub(crate) fn check_global(
        &self,
        step: u64,
        loss: f32,
        grads: &BTreeMap<String, Tensor>,
        updated: &BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        let mut codes = self.codes();
        self.loss(&mut codes, loss);
        for (what, values) in [(Checked::Grad, grads), (Checked::Updated, updated)] {
            for (label, t) in values {
                self.tensor(&mut codes, what, label, t, 0);
            }
        }
        self.report(step, &codes)
    }

    /// Codes the `grad.<label>` and `param.<label>` outputs of a program `g` this rank ran
    /// (local values, laid out by `shardings` over `mesh`, of which this rank sits where `ctx`
    /// says).
    pub(crate) fn outputs(
        &self,
        codes: &mut [f32],
        g: &shardc_compiler::ir::Graph,
        shardings: &[TensorSharding],
        mesh: &Mesh,
        ctx: &RankCtx,
        out: &BTreeMap<String, Tensor>,
    ) {
        for (what, role) in [
            (Checked::Grad, ValueRole::Gradient),
            (Checked::Updated, ValueRole::Update),
        ] {
            for (name, t) in out {
                let Some((r, label)) = ValueRole::of_output(name) else {
                    continue;
                };
                let Some(v) = g.output(name) else { continue };
                if r != role {
                    continue;
                }
                // The block's first stack entry: its shard index along dim 0 × local size.
                let first = shardings[v.index()].dims.first().map_or(0, |axes| {
                    let idx = axes.iter().fold(0, |acc, &a| {
                        let coord = ctx.coord(mesh.axis_name(a)).map_or(0, |c| c.0);
                        acc * mesh.axis_size(a) + coord
                    });
                    idx * t.shape.first().copied().unwrap_or(0)
                });
                self.tensor(codes, what, label, t, first);
            }
        }
    }

    /// Reduces `codes` with max over every axis of `mesh` (the communicators of `ctx`), then
    /// reports: the same result on every rank.
    pub(crate) fn agree(
        &self,
        step: u64,
        mut codes: Vec<f32>,
        mesh: &Mesh,
        ctx: &RankCtx,
    ) -> Result<(), TrainError> {
        for a in mesh.axis_ids().filter(|&a| mesh.axis_size(a) > 1) {
            let c = ctx.comm(mesh.axis_name(a))?;
            c.all_reduce(&mut codes, crate::comm::ReduceOp::Max)
                .map_err(|e| RuntimeError::Pipeline {
                    op: format!(
                        "all_reduce of the step's finiteness check over `{}`",
                        c.name()
                    ),
                    detail: e.to_string(),
                })?;
        }
        self.report(step, &codes)
    }
}

/// Checks that `batch` is `[want_batch, want_seq]` with every field of that size.
pub fn check_batch(batch: &Batch, want_batch: usize, want_seq: usize) -> Result<(), TrainError> {
    let n = want_batch * want_seq;
    let lens = [
        batch.ids.len(),
        batch.positions.len(),
        batch.mask.len(),
        batch.labels.len(),
    ];
    if (batch.batch, batch.seq) != (want_batch, want_seq) || lens.iter().any(|&l| l != n) {
        return Err(TrainError::BatchShape {
            batch: batch.batch,
            seq: batch.seq,
            want_batch,
            want_seq,
        });
    }
    Ok(())
}

/// The batch inputs of a step of `k` micro-batches (global tensors, named per micro-batch).
pub fn batch_inputs(batch: &Batch, k: usize) -> BTreeMap<String, Tensor> {
    let mb = batch.batch / k;
    let mut inputs: BTreeMap<String, Tensor> = BTreeMap::new();
    for i in 0..k {
        let shape = vec![mb, batch.seq];
        let name = |base: &str| input_name(base, i, k);
        let lo = i * mb;
        inputs.insert(
            name("input_ids"),
            Tensor::i32(shape.clone(), batch.rows(&batch.ids, lo, mb)),
        );
        inputs.insert(
            name("position_ids"),
            Tensor::i32(shape.clone(), batch.rows(&batch.positions, lo, mb)),
        );
        inputs.insert(
            name("attention_mask"),
            Tensor::f32(shape.clone(), batch.rows(&batch.mask, lo, mb)),
        );
        inputs.insert(
            name("labels"),
            Tensor::i32(shape, batch.rows(&batch.labels, lo, mb)),
        );
    }
    inputs
}

/// The batch inputs of micro-batch `i` of `k` (global tensors, under the program's names).
pub fn micro_batch_inputs(batch: &Batch, k: usize, i: usize) -> BTreeMap<String, Tensor> {
    let mut all = batch_inputs(batch, k);
    let names = ["input_ids", "position_ids", "attention_mask", "labels"];
    names
        .into_iter()
        .filter_map(|base| {
            let name = shardc_compiler::autodiff::input_name(base, i, k);
            all.remove(&name).map(|t| (base.to_string(), t))
        })
        .collect()
}

/// The outputs a rank keeps from one step to the next: its parameter and optimizer-state
/// shards (the program's updated-weight and moment outputs, in its inputs' layout).
pub(crate) fn kept_state(out: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    out.iter()
        .filter(|(n, _)| {
            matches!(
                ValueRole::of_output(n),
                Some((
                    ValueRole::Update | ValueRole::FirstMoment | ValueRole::SecondMoment,
                    _
                ))
            )
        })
        .map(|(n, t)| (n.clone(), t.clone()))
        .collect()
}

/// This rank's `loss` output of program `g` (in its outputs `out`) reduced over the mesh axes
/// its layout in `shardings` is partial on (the communicators of `ctx`): the global loss, on
/// every rank of those groups.
pub(crate) fn reduce_loss(
    g: &shardc_compiler::ir::Graph,
    shardings: &[TensorSharding],
    out: &BTreeMap<String, Tensor>,
    mesh: &Mesh,
    ctx: &RankCtx,
) -> Result<f32, TrainError> {
    let missing = || TrainError::MissingOutput("loss".into());
    let v = g.output("loss").ok_or_else(missing)?;
    let local = out.get("loss").ok_or_else(missing)?;
    let mut buf = [local.as_f32().map_or(f32::NAN, |v| v[0])];
    for &ax in &shardings[v.index()].partial {
        let c = ctx.comm(mesh.axis_name(ax))?;
        c.all_reduce(&mut buf, crate::comm::ReduceOp::Sum)
            .map_err(|e| RuntimeError::Pipeline {
                op: format!("all_reduce of the loss over `{}`", c.name()),
                detail: e.to_string(),
            })?;
    }
    Ok(buf[0])
}

/// One rank's part of a training run in a process group (`shardc launch`, torchrun): its
/// shard of the step's SPMD program, run with the communicators of a [`RankCtx`], and its
/// parameter and optimizer shards kept between steps (the first step takes its shards of the
/// global initial state).
pub struct RankTrainer<'c> {
    plan: &'c Plan,
    train: &'c PlanTrain,
    cache: ParamCache,
    locals: BTreeMap<String, Tensor>,
}

impl<'c> RankTrainer<'c> {
    /// A trainer for this rank (`ctx`) of training plan `plan` (no pipeline).
    pub fn new(plan: &'c Plan, weights: &Weights, ctx: &RankCtx) -> Result<Self, TrainError> {
        Ok(RankTrainer {
            plan,
            train: flat_section(plan)?,
            cache: crate::load_params(&plan.program, weights, ctx)?,
            locals: BTreeMap::new(),
        })
    }

    /// This rank's block of program input `name` (a parameter or AdamW moment) as the last
    /// step left it; `None` before the first step.
    pub fn local(&self, name: &str) -> Option<&Tensor> {
        self.locals.get(name)
    }

    /// Starts from this rank's own blocks of the state (by program input, e.g. read from a
    /// checkpoint) instead of the global initial state.
    pub fn with_locals(mut self, locals: BTreeMap<String, Tensor>) -> Self {
        self.locals = locals;
        self
    }

    /// Runs step `step` (1-based) on `batch`; `initial` is the global state before the
    /// run's first step. Returns the global loss (on every rank).
    pub fn step(
        &mut self,
        initial: &TrainState,
        batch: &Batch,
        step: u64,
        ctx: &RankCtx,
    ) -> Result<f32, TrainError> {
        let (plan, t) = (self.plan, self.train);
        check_batch(batch, plan.model.batch, plan.model.seq)?;
        let g = &plan.program;
        let out = match &plan.step {
            Some(sp) => {
                let k = t.micro_batches;
                let batches: Vec<_> = (0..k).map(|i| micro_batch_inputs(batch, k, i)).collect();
                let mut st = BTreeMap::new();
                initial.add_inputs_at(&t.params, step, &mut st);
                crate::micro::run_rank_step(g, sp, &self.cache, &batches, &st, &self.locals, ctx)
                    .map_err(|e| at_step(step, e))?
            }
            None => {
                let mut inputs = batch_inputs(batch, t.micro_batches);
                initial.add_inputs_at(&t.params, step, &mut inputs);
                let mut st = crate::Stepwise::new(g, &self.cache, &inputs, ctx)?;
                for (n, t) in &self.locals {
                    st.provide(n, t.clone())?;
                }
                st.finish().map_err(|e| at_step(step, e))?
            }
        };
        let mesh = &plan.mesh;
        let loss = reduce_loss(g, &plan.shardings, &out, mesh, ctx)?;
        let check = StepCheck::new(&t.params);
        let mut codes = check.codes();
        check.loss(&mut codes, loss);
        check.outputs(&mut codes, g, &plan.shardings, mesh, ctx, &out);
        if let Some(sp) = &plan.step {
            check.outputs(&mut codes, &sp.program, &sp.shardings, mesh, ctx, &out);
        }
        check.agree(step, codes, mesh, ctx)?;
        self.locals = kept_state(&out);
        Ok(loss)
    }
}

/// What fills the parts of a stored tensor no parameter covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// The checkpoint's own values (saving weights).
    Original,
    /// Zeros (saving gradients).
    Zeros,
}

/// The tensors of a checkpoint, by stored name and in stored layout, from per-label values in
/// graph layout (weights or gradients): stacked parameters split back into their tensors,
/// transposed ones transposed back, views written into their block. With [`Fill::Original`],
/// stored tensors no parameter reads are copied from `weights` unchanged.
pub fn stored_tensors(
    plan: &Plan,
    values: &BTreeMap<String, Tensor>,
    weights: &Weights,
    fill: Fill,
) -> Result<BTreeMap<String, Tensor>, TrainError> {
    Ok(stored_tensors_of(
        &train_section(plan)?.params,
        values,
        weights,
        fill,
    )?)
}

/// [`stored_tensors`] for the parameters `params` (e.g. every chunk's of a pipeline).
pub fn stored_tensors_of<'a>(
    params: impl IntoIterator<Item = &'a PlanParam>,
    values: &BTreeMap<String, Tensor>,
    weights: &Weights,
    fill: Fill,
) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
    let mut out: BTreeMap<String, Tensor> = BTreeMap::new();
    for p in params {
        let Some(val) = values.get(&p.label) else {
            continue;
        };
        let src = &p.source;
        let data = val.as_f32().unwrap_or(&[]);
        let n = src.stack.unwrap_or(1);
        let per = if src.stack.is_some() {
            &val.shape[1..]
        } else {
            &val.shape[..]
        };
        let per_len: usize = per.iter().product();
        for i in 0..n {
            let name = src.stored_name(i);
            let mut block = data[i * per_len..(i + 1) * per_len].to_vec();
            let mut shape = per.to_vec();
            if src.transposed && shape.len() >= 2 {
                let r = shape.len();
                let mut perm: Vec<usize> = (0..r).collect();
                perm.swap(r - 2, r - 1);
                block = permute(&block, &shape, &perm);
                shape.swap(r - 2, r - 1);
            }
            match src.view {
                None => {
                    out.insert(name, Tensor::f32(shape, block));
                }
                Some(view) => {
                    if !out.contains_key(&name) {
                        let base = match fill {
                            Fill::Original => weights.get(&name)?,
                            Fill::Zeros => {
                                let s = weights.shape(&name).ok_or_else(|| {
                                    RuntimeError::MissingTensor {
                                        name: name.clone(),
                                        file: weights.path().to_path_buf(),
                                    }
                                })?;
                                Tensor::zeros(shardc_compiler::ir::DType::F32, s)
                            }
                        };
                        out.insert(name.clone(), base);
                    }
                    let t = out.get_mut(&name).expect("invariant: inserted above");
                    write_block(t, &block, &shape, view.dim, view.start)?;
                }
            }
        }
    }
    if fill == Fill::Original {
        for name in weights.names() {
            if let std::collections::btree_map::Entry::Vacant(e) = out.entry(name) {
                let t = weights.get(e.key())?;
                e.insert(t);
            }
        }
    }
    Ok(out)
}

/// Writes `block` (shaped `shape`) into `t` at offset `start` along `dim`.
fn write_block(
    t: &mut Tensor,
    block: &[f32],
    shape: &[usize],
    dim: usize,
    start: usize,
) -> Result<(), RuntimeError> {
    let ok = t.shape.len() == shape.len()
        && dim < shape.len()
        && (0..shape.len()).all(|d| d == dim || t.shape[d] == shape[d])
        && start + shape[dim] <= t.shape[dim];
    if !ok {
        return Err(RuntimeError::TensorShape {
            name: "view".into(),
            expected: shape.to_vec(),
            found: t.shape.clone(),
        });
    }
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let (mid, tmid) = (shape[dim], t.shape[dim]);
    if let crate::Buffer::F32(dst) = &mut t.data {
        for o in 0..outer {
            let src = &block[o * mid * inner..(o + 1) * mid * inner];
            let d0 = (o * tmid + start) * inner;
            dst[d0..d0 + mid * inner].copy_from_slice(src);
        }
    }
    Ok(())
}

/// Writes `tensors` as an f32 safetensors file (metadata `format: pt`, as transformers
/// writes it).
pub fn save_safetensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<(), TrainError> {
    let err = |msg: String| TrainError::Save {
        path: path.to_path_buf(),
        msg,
    };
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(k, t)| {
            let data: Vec<u8> = t
                .as_f32()
                .unwrap_or(&[])
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            (k.clone(), data, t.shape.clone())
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(k, d, s)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                .map(|v| (k.clone(), v))
                .map_err(|e| err(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let buf = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| err(e.to_string()))?;
    crate::output::write_atomic(path, &buf).map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assemble_concatenates_shards_and_sums_partials() {
        let mesh = Mesh::parse("dp=2,tp=2", 8).unwrap();
        let (dp, tp) = (mesh.axis("dp").unwrap(), mesh.axis("tp").unwrap());
        // Dim 1 split over tp, partial over dp: rank (d, t) holds (d+1) × block t.
        let mut s = TensorSharding::split(2, 1, &[tp]);
        s.partial = vec![dp];
        let locals: Vec<Tensor> = (0..4)
            .map(|r| {
                let (d, t) = (r / 2, r % 2);
                let base = [[1.0, 2.0], [3.0, 4.0]][t];
                Tensor::f32(
                    vec![1, 2],
                    base.iter().map(|x| x * (d + 1) as f32).collect(),
                )
            })
            .collect();
        let refs: Vec<&Tensor> = locals.iter().collect();
        let g = assemble(&mesh, &s, &refs);
        assert_eq!(g.shape, vec![1, 4]);
        assert_eq!(g.as_f32().unwrap(), &[3.0, 6.0, 9.0, 12.0]);
        // Replicated: one copy.
        let r = TensorSharding::replicated(2);
        let g = assemble(&mesh, &r, &refs);
        assert_eq!(g.as_f32().unwrap(), &[1.0, 2.0]);
    }

    fn param(label: &str, name: &str, stack: Option<usize>) -> PlanParam {
        use shardc_compiler::ir::ParamSource;
        PlanParam {
            label: label.into(),
            source: ParamSource {
                stack,
                ..ParamSource::whole(name)
            },
            ty: shardc_compiler::ir::TensorType::plain(shardc_compiler::ir::DType::F32, &[1]),
            chunk: 0,
            param: ValueRole::Parameter.name(label),
            grad: ValueRole::Gradient.name(label),
            adam_m: ValueRole::FirstMoment.name(label),
            adam_v: ValueRole::SecondMoment.name(label),
        }
    }

    /// An embedding and three stacked experts (two rows each).
    fn params() -> Vec<PlanParam> {
        vec![
            param("embed", "model.embed_tokens.weight", None),
            param("w1", "model.layers.0.experts.{}.w1.weight", Some(3)),
        ]
    }

    fn values(embed: f32, expert2: f32) -> BTreeMap<String, Tensor> {
        BTreeMap::from([
            ("embed".to_string(), Tensor::f32(vec![2], vec![0.5, embed])),
            (
                "w1".to_string(),
                Tensor::f32(vec![3, 2], vec![1.0, 2.0, 3.0, 4.0, expert2, 6.0]),
            ),
        ])
    }

    #[test]
    fn step_check_names_the_first_non_finite_value_by_stored_tensor() {
        let check = StepCheck::new(&params());
        let ok = values(1.0, 5.0);
        assert!(check.check_global(3, 2.5, &ok, &ok).is_ok());
        let err = |loss: f32, grads: &_, updated: &_| {
            check
                .check_global(3, loss, grads, updated)
                .unwrap_err()
                .to_string()
        };
        let inf = values(1.0, f32::INFINITY);
        assert_eq!(
            err(2.5, &inf, &ok),
            "step 3: gradient of model.layers.0.experts.2.w1.weight is inf"
        );
        // NaN wins within a tensor; the loss comes first, then gradients, then updates.
        let nan = values(f32::NAN, f32::NEG_INFINITY);
        assert_eq!(
            err(2.5, &values(f32::NAN, 5.0), &nan),
            "step 3: gradient of model.embed_tokens.weight is NaN"
        );
        assert_eq!(
            err(2.5, &ok, &nan),
            "step 3: model.embed_tokens.weight after the optimizer update is NaN"
        );
        assert_eq!(
            err(2.5, &ok, &values(1.0, f32::NEG_INFINITY)),
            "step 3: model.layers.0.experts.2.w1.weight after the optimizer update is -inf"
        );
        assert_eq!(err(f32::INFINITY, &nan, &nan), "step 3: loss is inf");
        // Only an agreed check spares the other ranks an abort.
        let e = check.check_global(3, f32::NAN, &ok, &ok).unwrap_err();
        assert!(e.every_rank_fails());
    }

    #[test]
    fn step_check_agrees_across_ranks() {
        // Expert 2 (rank 1's first row of its block of two: rows 2..4 of four) is inf on
        // rank 1 only; rank 0's loss is finite, rank 1 has none.
        let check = StepCheck::new(&[
            param("embed", "model.embed_tokens.weight", None),
            param("w1", "model.layers.0.experts.{}.w1.weight", Some(4)),
        ]);
        let mesh = Mesh::parse("dp=2", 8).unwrap();
        let comms = crate::spmd::thread_comms(&mesh, |_| true, Duration::from_secs(10));
        let results = crate::spmd::run_threads(comms, |rank, ctx| {
            let mut codes = check.codes();
            if rank == 0 {
                check.loss(&mut codes, 1.5);
            }
            let bad = if rank == 1 { f32::INFINITY } else { 1.0 };
            let block = Tensor::f32(vec![2, 1], vec![bad, 2.0]);
            check.tensor(&mut codes, Checked::Grad, "w1", &block, 2 * rank);
            Ok(check.agree(7, codes, &mesh, ctx).map_err(|e| e.to_string()))
        });
        for r in results {
            assert_eq!(
                r.unwrap(),
                Err("step 7: gradient of model.layers.0.experts.2.w1.weight is inf".to_string())
            );
        }
    }

    #[test]
    fn at_step_names_the_step_of_a_non_finite_loss() {
        let loss = RuntimeError::NonFiniteLoss {
            micro: 1,
            value: f32::NAN,
        };
        let e = at_step(2, loss);
        assert_eq!(e.to_string(), "step 2, micro-batch 1: loss is NaN");
        assert!(!e.every_rank_fails());
        let rank = RankError {
            rank: 3,
            coords: "dp=1,tp=1".into(),
            error: RuntimeError::NonFiniteLoss {
                micro: 0,
                value: f32::INFINITY,
            },
        };
        assert_eq!(
            at_step(5, rank).to_string(),
            "step 5, micro-batch 0: loss is inf"
        );
        let other = at_step(5, RuntimeError::MissingAxis { axis: "tp".into() });
        assert_eq!(
            other.to_string(),
            "mesh axis `tp` is not in this rank's context"
        );
    }

    #[test]
    fn causal_lm_labels_are_shifted_ids() {
        let b = Batch::causal_lm(vec![5, 6, 7, 8, 9, 10], 2, 3);
        assert_eq!(b.labels, vec![6, 7, -100, 9, 10, -100]);
        assert_eq!(b.predicted_tokens(), 4);
        assert_eq!(b.positions, vec![0, 1, 2, 0, 1, 2]);
    }
}
