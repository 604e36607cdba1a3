//! One rank's training step of a plan without a pipeline: the micro-batch's program once per
//! micro-batch, its `loss` and `grad.<label>` outputs summed over the micro-batches in this
//! rank's local layout (partial sums add linearly), then the step program on the sums
//! (gradient synchronisation, AdamW). The micro-batches run in order and the sums are taken
//! in that order, as the unrolled step added them.
//!
//! Inputs come two ways: global tensors (each rank takes its shard as the program's inputs
//! say) and this rank's own tensors (its parameter and optimizer shards kept from the previous
//! step), the latter winning.

use crate::{ParamCache, RankCtx, RuntimeError, Stepwise, Tensor};
use shardc_compiler::ir::{Graph, ValueRole};
use shardc_compiler::plan::PlanStep;
use std::collections::BTreeMap;

/// `acc += x`, elementwise (f32; same shapes): one micro-batch's output added to the sum.
pub(crate) fn accumulate(acc: &mut Tensor, x: &Tensor, name: &str) -> Result<(), RuntimeError> {
    match (&mut acc.data, &x.data) {
        (crate::Buffer::F32(a), crate::Buffer::F32(b)) if a.len() == b.len() => {
            for (a, b) in a.iter_mut().zip(b) {
                *a += b;
            }
            Ok(())
        }
        _ => Err(RuntimeError::InputShape {
            name: format!("{name} (summed over micro-batches)"),
            expected: acc.shape.clone(),
            found: x.shape.clone(),
        }),
    }
}

/// Runs `g` with global `inputs` and this rank's `locals` (those `g` reads), returning its
/// outputs.
fn run(
    g: &Graph,
    cache: &ParamCache,
    inputs: &BTreeMap<String, Tensor>,
    locals: &BTreeMap<String, Tensor>,
    ctx: &RankCtx,
) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
    let mut st = Stepwise::new(g, cache, inputs, ctx)?;
    for (n, t) in locals {
        if g.input_named(n).is_some() {
            st.provide(n, t.clone())?;
        }
    }
    st.finish()
}

/// This rank's step (see the module docs): `micro` is the micro-batch's program, run once per
/// entry of `batches` (each micro-batch's global batch inputs) with the global `state`
/// inputs and this rank's `locals`; then `step` on the sums. Returns the micro program's
/// summed outputs (`loss`, `grad.*`) and the step program's outputs (`param.*`, `adam_m.*`,
/// `adam_v.*`), all local. A non-finite loss names its micro-batch.
#[allow(clippy::too_many_arguments)]
pub fn run_rank_step(
    micro: &Graph,
    step: &PlanStep,
    cache: &ParamCache,
    batches: &[BTreeMap<String, Tensor>],
    state: &BTreeMap<String, Tensor>,
    locals: &BTreeMap<String, Tensor>,
    ctx: &RankCtx,
) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
    let mut inputs = state.clone();
    let mut sums: BTreeMap<String, Tensor> = BTreeMap::new();
    for (i, b) in batches.iter().enumerate() {
        inputs.extend(b.iter().map(|(n, t)| (n.clone(), t.clone())));
        let out = run(micro, cache, &inputs, locals, ctx).map_err(|e| match e {
            RuntimeError::NonFiniteLoss { value, .. } => {
                RuntimeError::NonFiniteLoss { micro: i, value }
            }
            e => e,
        })?;
        for (name, t) in out {
            match sums.get_mut(&name) {
                Some(acc) => accumulate(acc, &t, &name)?,
                None => {
                    sums.insert(name, t);
                }
            }
        }
    }
    let mut step_locals = locals.clone();
    step_locals.extend(
        sums.iter()
            .filter(|(n, _)| ValueRole::gradient_label(n).is_some())
            .map(|(n, t)| (n.clone(), t.clone())),
    );
    let out = run(&step.program, cache, state, &step_locals, ctx)?;
    sums.extend(out);
    Ok(sums)
}
