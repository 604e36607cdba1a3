//! Running a forward [`Plan`]: its SPMD program on thread ranks (an axis-less mesh: in the
//! calling thread) with the caller's global inputs, after checking that the inputs and the
//! checkpoint are the ones the plan was compiled for. The plan's own program runs, never a
//! recompiled one; training plans run through [`crate::train`] and [`crate::pipeline`].

use crate::spmd::{run_spmd, RankError, RankOutputs};
use crate::{execute, RankCtx, RuntimeError, Tensor, Weights};
use shardc_compiler::ir::{Graph, Op};
use shardc_compiler::plan::Plan;
use shardc_compiler::shard::{Mesh, TensorSharding};
use std::collections::BTreeMap;
use std::time::Duration;
use thiserror::Error;

/// A plan that cannot run on what it was given.
#[derive(Debug, Error)]
pub enum PlanRunError {
    /// A training plan given to the forward runner.
    #[error("the plan of {model} is a training plan: run it with `shardc train --plan`")]
    NotForward {
        /// The plan's model source.
        model: String,
    },
    /// An input whose global shape differs from the plan's.
    #[error("input `{name}` is {found:?} but the plan was compiled for {expected:?}")]
    InputShape {
        /// The input.
        name: String,
        /// The plan's global shape.
        expected: Vec<usize>,
        /// The shape given.
        found: Vec<usize>,
    },
    /// A rank failed.
    #[error(transparent)]
    Rank(#[from] RankError),
    /// Executing in this thread failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// The global type of value `v` of `g` laid out by `s` over `mesh`.
fn global_shape(
    g: &Graph,
    v: shardc_compiler::ir::ValueId,
    s: &TensorSharding,
    mesh: &Mesh,
) -> Vec<usize> {
    let ty = g.ty(v);
    (0..ty.rank())
        .map(|d| ty.dim(d) * s.parts(mesh, d))
        .collect()
}

/// Every input of forward plan `plan` that `inputs` supplies has the plan's global shape.
pub fn check_inputs(plan: &Plan, inputs: &BTreeMap<String, Tensor>) -> Result<(), PlanRunError> {
    let g = &plan.program;
    for (name, t) in inputs {
        let Some(v) = g.input_named(name) else {
            continue;
        };
        let expected = global_shape(g, v, &plan.shardings[v.index()], &plan.mesh);
        if t.shape != expected {
            return Err(PlanRunError::InputShape {
                name: name.clone(),
                expected,
                found: t.shape.clone(),
            });
        }
    }
    Ok(())
}

/// Checks that `weights` holds every tensor `plan` binds, in the shape its programs imply
/// (forward parameters, every chunk's, and a training plan's trainable parameters): a
/// checkpoint of another model (other layers, hidden size, vocabulary) is refused naming the
/// first tensor that differs, before anything runs.
pub fn check_weights(plan: &Plan, weights: &Weights) -> Result<(), RuntimeError> {
    let programs: Vec<&Graph> = if plan.chunks.is_empty() {
        vec![&plan.program]
    } else {
        plan.chunks.iter().map(|c| &c.program).collect()
    };
    for g in programs {
        for v in g.ids() {
            if let Op::Param(src) = &g.node(v).op {
                weights.check_binding(src, g.ty(v))?;
            }
        }
    }
    for p in plan.train.iter().flat_map(|t| &t.params) {
        weights.check_binding(&p.source, &p.ty)?;
    }
    Ok(())
}

/// Runs forward plan `plan` on global `inputs` (each rank takes its shard): on one thread
/// rank per rank of its mesh, each waiting at most `timeout` for a peer. Returns every rank's
/// outputs (local values), in rank order.
pub fn execute_plan(
    plan: &Plan,
    weights: &Weights,
    inputs: &BTreeMap<String, Tensor>,
    timeout: Duration,
) -> Result<RankOutputs, PlanRunError> {
    if plan.train.is_some() || plan.pipeline.is_some() {
        return Err(PlanRunError::NotForward {
            model: plan.model.source.clone(),
        });
    }
    check_inputs(plan, inputs)?;
    if plan.mesh.axes.is_empty() {
        return Ok(vec![execute(
            &plan.program,
            weights,
            inputs,
            &RankCtx::new(),
        )?]);
    }
    Ok(run_spmd(
        &plan.program,
        &plan.mesh,
        weights,
        inputs,
        timeout,
    )?)
}
