//! The micro-batch / step split of a training step's SPMD program.
//!
//! A step of `k` micro-batches runs one program `k` times and another once. The training
//! graph is built for one micro-batch (with the loss divisor of the whole step), partitioned
//! and passed; this module cuts the result at the gradient boundary:
//!
//! - the **micro program**: forward, loss and backward of one micro-batch, with every
//!   collective that happens per micro-batch (tensor-parallel all-reduces, ZeRO-2/3
//!   reduce-scatters of each micro-batch's gradient, ZeRO-3 parameter gathers). Its outputs are
//!   `loss` (this micro-batch's share of the step's loss) and `grad.<label>`, each parameter's
//!   gradient contribution in its local layout (partial sums included);
//! - the **step program**: what happens once per step: the gradient synchronisation (DDP
//!   buckets, the ZeRO-1 reduce-scatter), AdamW and the all-gather of updated shards. Its
//!   inputs `grad.<label>` take the sums of the micro program's outputs of the same names
//!   (same local type and layout: partial sums add linearly), the others are the step's
//!   state inputs (`param.*`, `adam_m.*`, `adam_v.*`, `step`).
//!
//! Pre-condition: the first node named `grad.<label>` is the parameter's gradient as the
//! backward pass leaves it (after the per-micro-batch reduce-scatter of ZeRO-2/3, before any
//! once-per-step collective). Post-condition: running the micro program `k` times,
//! summing its outputs and running the step program computes what the unrolled step computes,
//! up to the order of floating-point additions.

use super::passes::Rebuild;
use crate::autodiff::TrainGraph;
use crate::ir::ShardSpec;
use crate::ir::{Op, ValueId, ValueRole};
use crate::shard::{ShardError, ShardedGraph, TensorSharding};

/// A step's two programs (see the module docs).
#[derive(Clone, Debug)]
pub struct StepSplit {
    /// Forward, loss and backward of one micro-batch.
    pub micro: ShardedGraph,
    /// Gradient synchronisation and the optimizer, once per step.
    pub step: ShardedGraph,
}

/// The name of the gradient output (micro program) and input (step program) of `label`.
pub fn grad_name(label: &str) -> String {
    ValueRole::Gradient.name(label)
}

/// The shard specs of an input laid out as `s` (its split dims; partial axes hold no part of
/// a global tensor and have none).
fn input_shards(sg: &ShardedGraph, s: &TensorSharding) -> Vec<ShardSpec> {
    let mut out = Vec::new();
    for (dim, axes) in s.dims.iter().enumerate() {
        for &a in axes {
            out.push(ShardSpec {
                dim,
                axis: sg.mesh.axis_name(a).to_string(),
                parts: sg.mesh.axis_size(a),
            });
        }
    }
    out
}

/// Cuts `sg`, the SPMD program of a one-micro-batch step of `train`, into its micro and step
/// programs (see the module docs).
pub fn split_step(sg: &ShardedGraph, train: &TrainGraph) -> Result<StepSplit, ShardError> {
    let g = &sg.graph;
    let n = g.len();
    // The gradient boundary: each parameter's gradient as the backward pass leaves it, the
    // first node named `grad.<label>` (the partitioner keeps logical names; the collectives
    // it adds after it for the gradient's annotated layout carry other names).
    let mut first: std::collections::HashMap<&str, ValueId> = std::collections::HashMap::new();
    for v in g.ids() {
        first.entry(g.node(v).name.as_str()).or_insert(v);
    }
    let mut boundary: Vec<Option<String>> = vec![None; n];
    let mut grads = Vec::new();
    for p in &train.params {
        let name = grad_name(&p.label);
        let v = *first.get(name.as_str()).ok_or_else(|| {
            ShardError::Internal(format!("the step has no node `{name}` to split at"))
        })?;
        boundary[v.index()] = Some(name.clone());
        grads.push((name, v));
    }
    // The micro program: everything the boundary values and the other per-micro-batch
    // outputs (the loss, not a parameter's gradient, update or moments) need.
    let step_output = |name: &str| {
        matches!(
            ValueRole::of_output(name),
            Some((
                ValueRole::Update | ValueRole::FirstMoment | ValueRole::SecondMoment,
                _
            ))
        )
    };
    let micro_outputs: Vec<(String, ValueId)> = g
        .outputs
        .iter()
        .filter(|(name, _)| ValueRole::of_output(name).is_none())
        .cloned()
        .chain(grads)
        .collect();
    let mut micro = vec![false; n];
    let mut stack: Vec<ValueId> = micro_outputs.iter().map(|&(_, v)| v).collect();
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut micro[v.index()], true) {
            continue;
        }
        stack.extend(g.node(v).inputs.iter().copied());
    }
    let mut m = Rebuild::new(n);
    for v in g.ids().filter(|v| micro[v.index()]) {
        let node = g.node(v);
        m.copy_as(sg, v, node.op.clone(), node.name.clone())?;
    }
    for (name, v) in &micro_outputs {
        m.out
            .graph
            .set_output(name, m.map[v.index()].expect("invariant: kept"));
    }
    // The step program: the rest, reading the boundary values and the step's state as
    // inputs.
    let mut s = Rebuild::new(n);
    for v in g.ids().filter(|v| !micro[v.index()]) {
        let node = g.node(v);
        for &i in &node.inputs {
            if !micro[i.index()] || s.map[i.index()].is_some() {
                continue;
            }
            let input = g.node(i);
            let (op, name) = match (&input.op, &boundary[i.index()]) {
                (Op::Input { name, .. }, _) => (input.op.clone(), name.clone()),
                (_, Some(name)) => {
                    let shards = input_shards(sg, &sg.shardings[i.index()]);
                    let op = Op::Input {
                        name: name.clone(),
                        shards,
                    };
                    (op, name.clone())
                }
                _ => {
                    return Err(ShardError::Internal(format!(
                        "`{}` of the step's once-per-step part reads `{}` of a micro-batch, \
                         which is neither an input nor a gradient",
                        node.name, input.name
                    )))
                }
            };
            s.copy_as(sg, i, op, name)?;
        }
        s.copy_as(sg, v, node.op.clone(), node.name.clone())?;
    }
    for (name, v) in g.outputs.iter().filter(|(name, _)| step_output(name)) {
        let x = s.map[v.index()].ok_or_else(|| {
            ShardError::Internal(format!(
                "output `{name}` is computed per micro-batch, not once per step"
            ))
        })?;
        s.out.graph.set_output(name, x);
    }
    Ok(StepSplit {
        micro: m.into_graph(&sg.mesh),
        step: s.into_graph(&sg.mesh),
    })
}
