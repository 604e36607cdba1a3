//! The training section of a plan: what a runtime needs beyond the programs to run optimizer
//! steps from a plan file alone: the step's micro-batches, loss divisor and AdamW
//! hyperparameters, and every trainable parameter's binding (the checkpoint tensors it reads
//! and writes, its global type, the program inputs and outputs that carry it, its gradient and
//! its optimizer state).
//!
//! Post-condition of [`check_train`]: every name the section gives is an input or output of
//! the program it points at, every parameter's local types times its layout's parts equal its
//! global type, and a tied parameter lives in exactly two chunks (any other in exactly one).

use super::{Plan, PlanError};
use crate::autodiff::{Recompute, TrainParam};
use crate::ir::{AdamWSpec, Graph, Op, ParamSource, TensorType, ValueRole};
use crate::schedule::Step;
use crate::shard::{Mesh, Provenance, ShardedGraph, TensorSharding};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How a training plan steps (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanTrain {
    /// Micro-batches per step (gradient accumulation; the pipeline's micro-batches).
    pub micro_batches: usize,
    /// Predicted tokens per step: the loss divisor.
    pub denom: usize,
    /// The optimizer.
    pub adamw: AdamWSpec,
    /// Activation checkpointing.
    pub recompute: Recompute,
    /// Layers of each chunk fully recomputed first, the others under `recompute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_layers: Option<usize>,
    /// ZeRO stage inside a stage (0: none).
    pub zero_stage: u8,
    /// Every trainable parameter, in model order (a tied one once per chunk holding a copy).
    pub params: Vec<PlanParam>,
    /// Labels of parameters with a copy on two pipeline chunks (their gradients summed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tied: Vec<String>,
}

/// One trainable parameter of a training plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanParam {
    /// The forward graph's label (`layers.0.attn.q_proj.weight`, `embed`, ...).
    pub label: String,
    /// The checkpoint tensor(s) it binds (unsharded: no `shards`).
    pub source: ParamSource,
    /// Its global type, graph layout.
    pub ty: TensorType,
    /// The program holding it: 0 for a plan without a pipeline, else the chunk's index.
    pub chunk: usize,
    /// The input holding it before the step and the output holding it after.
    pub param: String,
    /// The output holding its accumulated gradient.
    pub grad: String,
    /// Input and output of its AdamW first moment.
    pub adam_m: String,
    /// Input and output of its AdamW second moment.
    pub adam_v: String,
}

impl PlanParam {
    /// The binding of `p`, a parameter of program `chunk`.
    pub fn of(p: &TrainParam, chunk: usize) -> PlanParam {
        let l = &p.label;
        PlanParam {
            label: l.clone(),
            source: ParamSource {
                shards: Vec::new(),
                ..p.source.clone()
            },
            ty: p.ty.clone(),
            chunk,
            param: ValueRole::Parameter.name(l),
            grad: ValueRole::Gradient.name(l),
            adam_m: ValueRole::FirstMoment.name(l),
            adam_v: ValueRole::SecondMoment.name(l),
        }
    }
}

/// The once-per-step program of a training plan without a pipeline: the gradient
/// synchronisation, AdamW and the all-gather of updated shards. The plan's `program` is then
/// the micro-batch's program (forward, loss and backward of one micro-batch), run
/// `train.micro_batches` times per step; the step program's `grad.<label>` inputs take the
/// sums of its `grad.<label>` outputs (same local types and layouts), its other inputs the
/// step's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanStep {
    /// The SPMD program (local shapes).
    pub program: Graph,
    /// Layout of each value.
    pub shardings: Vec<TensorSharding>,
    /// Why each collective exists.
    pub provenance: BTreeMap<u32, Provenance>,
    /// Steps in issue order (on the plan's streams).
    pub steps: Vec<Step>,
}

impl PlanStep {
    /// The step program of SPMD program `sg`, scheduled.
    pub fn of(sg: &ShardedGraph) -> PlanStep {
        PlanStep {
            program: sg.graph.clone(),
            shardings: sg.shardings.clone(),
            provenance: sg
                .provenance
                .iter()
                .enumerate()
                .filter_map(|(i, p)| p.clone().map(|p| (i as u32, p)))
                .collect(),
            steps: crate::schedule::schedule(&sg.graph),
        }
    }
}

/// The micro-batch and step programs agree: every gradient input of the step program is an
/// output of the micro-batch's program of the same local type and layout.
pub(super) fn check_step_names(
    micro: &Graph,
    micro_shardings: &[TensorSharding],
    st: &PlanStep,
    mesh: &Mesh,
    path: &str,
) -> Result<(), PlanError> {
    let (g, s) = (&st.program, &st.shardings);
    for v in g.ids() {
        let Op::Input { name, .. } = &g.node(v).op else {
            continue;
        };
        if ValueRole::gradient_label(name).is_none() {
            continue;
        }
        let path = path.to_string();
        let Some(m) = micro.output(name) else {
            return Err(field(
                path,
                format!(
                    "input `{}` is not an output of the micro-batch's program",
                    super::esc(name)
                ),
            ));
        };
        if micro.ty(m) != g.ty(v) || micro_shardings[m.index()] != s[v.index()] {
            return Err(field(
                path,
                format!(
                    "input `{}` is {} laid out {}, the micro-batch's output {} laid out {}",
                    super::esc(name),
                    g.ty(v),
                    s[v.index()].display(mesh),
                    micro.ty(m),
                    micro_shardings[m.index()].display(mesh)
                ),
            ));
        }
    }
    Ok(())
}

impl PlanTrain {
    /// The parameters of program `chunk`.
    pub fn params_of(&self, chunk: usize) -> impl Iterator<Item = &PlanParam> {
        self.params.iter().filter(move |p| p.chunk == chunk)
    }
}

fn field(path: String, msg: String) -> PlanError {
    PlanError::Field { path, msg }
}

/// A program of a training plan, its layouts and its step program (when it has one).
pub(super) type TrainPrograms<'a> = (&'a Graph, &'a [TensorSharding], Option<&'a PlanStep>);

/// The training section's check (see the module docs); `programs` are the plan's programs
/// with their layouts (one, or one per chunk), on `mesh` (a stage's for pipelines). Runs
/// after the programs themselves are verified.
pub(super) fn check_train(
    plan: &Plan,
    programs: &[TrainPrograms],
    mesh: &Mesh,
) -> Result<(), PlanError> {
    let Some(t) = &plan.train else {
        if plan.pipeline.is_some() {
            return Err(field(
                "train".into(),
                "missing in a pipeline plan (pipelines are training plans)".into(),
            ));
        }
        return Ok(());
    };
    let bad = |what: &str, msg: String| Err(field(format!("train.{what}"), msg));
    if t.micro_batches == 0 || plan.model.batch % t.micro_batches != 0 {
        return bad(
            "micro_batches",
            format!(
                "{} does not split the batch of {}",
                t.micro_batches, plan.model.batch
            ),
        );
    }
    if let Some(s) = &plan.pipeline {
        if s.micro_batches != t.micro_batches {
            return bad(
                "micro_batches",
                format!(
                    "{}, but the schedule has {}",
                    t.micro_batches, s.micro_batches
                ),
            );
        }
    }
    if t.denom == 0 {
        return bad("denom", "must be at least 1 (found 0)".into());
    }
    if t.zero_stage > 3 {
        return bad(
            "zero_stage",
            format!("must be 0..=3 (found {})", t.zero_stage),
        );
    }
    if let Err(e) = t.adamw.validate() {
        return bad("adamw", super::esc(&e.to_string()));
    }
    let mut copies: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, p) in t.params.iter().enumerate() {
        let path = format!("train.params[{i}]");
        let label = super::esc(&p.label);
        let Some(&(g, shardings, step)) = programs.get(p.chunk) else {
            return Err(field(
                format!("{path}.chunk"),
                format!(
                    "`{label}`: program {} does not exist (the plan has {})",
                    p.chunk,
                    programs.len()
                ),
            ));
        };
        if !p.source.shards.is_empty() {
            return Err(field(
                format!("{path}.source"),
                format!("`{label}`: the checkpoint binding of a training parameter is unsharded"),
            ));
        }
        *copies.entry(&p.label).or_default() += 1;
        let program = if plan.pipeline.is_some() {
            format!("chunk {}", p.chunk)
        } else {
            "the program".into()
        };
        // (what, name, program, its label, layouts, wanted as input, wanted as output)
        let micro = (g, shardings, program.clone());
        let mut names = Vec::new();
        match step {
            None => {
                for (what, name, input) in [
                    ("param", &p.param, true),
                    ("grad", &p.grad, false),
                    ("adam_m", &p.adam_m, true),
                    ("adam_v", &p.adam_v, true),
                ] {
                    names.push((what, name, micro.clone(), input, true));
                }
            }
            Some(st) => {
                let step = (
                    &st.program,
                    &st.shardings[..],
                    "the step program".to_string(),
                );
                let micro = (g, shardings, "the micro-batch's program".to_string());
                names.push(("param", &p.param, micro.clone(), true, false));
                names.push(("grad", &p.grad, micro, false, true));
                names.push(("grad", &p.grad, step.clone(), true, false));
                for (what, name) in [
                    ("param", &p.param),
                    ("adam_m", &p.adam_m),
                    ("adam_v", &p.adam_v),
                ] {
                    names.push((what, name, step.clone(), true, true));
                }
            }
        }
        for (what, name, (g, shardings, program), input, output) in names {
            let checks = [
                (input, g.input_named(name), "an input"),
                (output, g.output(name), "an output"),
            ];
            for (wanted, v, kind) in checks {
                if !wanted {
                    continue;
                }
                let Some(v) = v else {
                    return Err(field(
                        format!("{path}.{what}"),
                        format!(
                            "`{}` of `{label}` is not {kind} of {program}",
                            super::esc(name)
                        ),
                    ));
                };
                let local = g.ty(v);
                let s = &shardings[v.index()];
                let global: Option<Vec<usize>> = (local.rank() == p.ty.rank()).then(|| {
                    (0..local.rank())
                        .map(|d| local.dim(d) * s.parts(mesh, d))
                        .collect()
                });
                if global.as_deref() != Some(&p.ty.shape()[..]) || local.dtype != p.ty.dtype {
                    return Err(field(
                        format!("{path}.ty"),
                        format!(
                            "`{label}` is {}, but {kind} `{}` of {program} is {local} laid out {}",
                            p.ty,
                            super::esc(name),
                            s.display(mesh)
                        ),
                    ));
                }
            }
        }
    }
    for (label, n) in copies {
        let tied = t.tied.iter().any(|l| l == label);
        let want = if tied { 2 } else { 1 };
        if n != want {
            return bad(
                "params",
                format!(
                    "`{}` appears {n} time(s); a {} parameter appears {want}",
                    super::esc(label),
                    if tied { "tied" } else { "untied" }
                ),
            );
        }
    }
    if let Some(l) = t
        .tied
        .iter()
        .find(|l| !t.params.iter().any(|p| &p.label == *l))
    {
        return bad("tied", format!("`{}` is not a parameter", super::esc(l)));
    }
    Ok(())
}
