//! Memory per rank of a training step, read off the SPMD program (local shapes) and the
//! annotations it was partitioned under, at a chosen [`Precision`].
//!
//! - Parameters: the local parameter inputs (sharded under ZeRO-3).
//! - Gradients: each parameter's gradient buffer in the layout it is accumulated in — the
//!   parameter's layout for `dp` and `zero1` (reduced after the backward pass), the `dp`-sharded
//!   optimizer layout for `zero2`/`zero3` (reduce-scattered as soon as computed).
//! - Optimizer states: the local first-moment inputs, times the optimizer bytes per element
//!   (f32: m, v; mixed precision: fp32 master weights, m, v — the ZeRO paper's K = 12).
//! - Activations kept for backward (one micro-batch): what the saved nodes read, at the
//!   activation precision, per layer. To compare with Korthikanti et al. (2022), who count a
//!   GPT layer with dropout, the accounting adds what their dropouts keep — our IR has no
//!   dropout, its kernels are deterministic — wherever they sit: a 1-byte mask per element of
//!   each residual branch (after the attention output projection and after the MLP), and, for
//!   saved attention probabilities, the attention-dropout mask (1 byte) and output
//!   (activation precision) per element. Under full recomputation the masks are regenerated and
//!   not counted. With 16-bit activations this reproduces their per-layer formulas exactly:
//!   `sbh(34 + 5as/h)`, `sbh(10 + 24/t + 5as/(ht))` (tp), `sbh/t·(34 + 5as/h)` (tp + sp) and
//!   `34·sbh/t` (tp + sp, selective recomputation).
//! - Communication buffers: the largest send/receive buffer of any collective (a DDP bucket,
//!   a ZeRO-3 parameter gather, ...), at the activation precision.
//! - Peak: the static bytes plus the largest set of simultaneously live transient values
//!   (activations, re-gathered parameters, gradients in flight, buffers) in program order, each
//!   at the activation precision.

use super::CompiledTrain;
use crate::ir::{DType, Graph, Op, ValueId, ValueRole};
use crate::plan::{LayerActivations, Precision, TrainMemory};
use crate::shard::TensorSharding;
use std::collections::{BTreeMap, HashMap};

/// The local element count of a tensor of global shape `shape` laid out as `s`.
fn local_numel(c: &CompiledTrain, shape: &[usize], s: &TensorSharding) -> u64 {
    let mesh = &c.sharded.mesh;
    shape
        .iter()
        .enumerate()
        .map(|(d, &n)| (n / s.parts(mesh, d).max(1)) as u64)
        .product()
}

/// The first node of `g` named `name` (the partitioner keeps logical names).
fn named(g: &Graph, name: &str) -> Option<ValueId> {
    g.ids().find(|&v| g.node(v).name == name)
}

fn float_numel(g: &Graph, v: ValueId) -> u64 {
    let t = g.ty(v);
    if t.dtype == DType::I32 {
        0
    } else {
        t.numel() as u64
    }
}

/// The memory report of a compiled step.
pub fn memory_report(c: &CompiledTrain, p: Precision) -> TrainMemory {
    let g = &c.sharded.graph;
    let tg = &c.train;
    let inputs: HashMap<&str, ValueId> = g
        .ids()
        .filter_map(|v| match &g.node(v).op {
            Op::Input { name, .. } => Some((name.as_str(), v)),
            _ => None,
        })
        .collect();
    let local_input = |name: &str| inputs.get(name).map_or(0, |&v| g.ty(v).numel() as u64);
    let mut param_elements = 0;
    let mut opt_elements = 0;
    let mut grad_elements = 0;
    for tp in &tg.params {
        param_elements += local_input(&ValueRole::Parameter.name(&tp.label));
        opt_elements += local_input(&ValueRole::FirstMoment.name(&tp.label));
        // The gradient buffer: the annotated layout of the per-micro-batch (zero2/3) or
        // accumulated (dp) gradient, else the accumulated gradient's own layout.
        let ann = c
            .annotations
            .values
            .get(&tp.mb_grads[0])
            .or_else(|| c.annotations.values.get(&tp.grad));
        grad_elements += match ann {
            Some(s) => local_numel(c, &tp.ty.shape(), s),
            None => {
                named(g, &ValueRole::Gradient.name(&tp.label)).map_or(0, |v| g.ty(v).numel() as u64)
            }
        };
    }
    let param_bytes = param_elements * p.param_bytes;
    let grad_bytes = grad_elements * p.grad_bytes;
    let optimizer_bytes = opt_elements * p.optimizer_bytes;
    let static_bytes = param_bytes + grad_bytes + optimizer_bytes;

    // Activations kept for backward: the operands of micro-batch 0's saved nodes (the
    // builder prefixes each micro-batch's node names with `mb<k>.` when there are several).
    let mb_prefix = if tg.micro_batches > 1 { "mb0." } else { "" };
    let full_layers = super::first_layers(g, c.options.recompute_layers.unwrap_or(0));
    let full = |l: u32| {
        c.options.recompute == crate::autodiff::Recompute::Full || full_layers.contains(&l)
    };
    let mut per_layer: BTreeMap<u32, u64> = BTreeMap::new();
    let mut activation_bytes = 0u64;
    for v in g.ids() {
        let node = g.node(v);
        let mut bytes = 0;
        let saved = node.role == ValueRole::Saved && node.name.starts_with(mb_prefix);
        if matches!(node.op, Op::Reshape) && saved {
            let src = node.inputs[0];
            let n = float_numel(g, src);
            bytes += n * p.activation_bytes;
            if matches!(g.node(src).op, Op::AttentionProbs(_)) {
                // Attention dropout: its mask and output.
                bytes += n * (1 + p.activation_bytes);
            }
        }
        let residual = matches!(node.op, Op::Add)
            && node.name.ends_with(".residual")
            && node.name.starts_with(mb_prefix)
            && node.role != ValueRole::Recompute;
        if residual && node.layer.is_some_and(|l| !full(l)) {
            // The 1-byte dropout mask of the residual branch.
            bytes += float_numel(g, node.inputs[1]);
        }
        if bytes > 0 {
            activation_bytes += bytes;
            if let Some(l) = node.layer {
                *per_layer.entry(l).or_default() += bytes;
            }
        }
    }

    // The larger of a collective's send and receive buffers, at the activation precision.
    let comm_buffer_bytes = g
        .ids()
        .filter(|&v| g.node(v).op.communicates())
        .map(|v| {
            let n = g.node(v);
            let input = n.inputs.first().map_or(0, |&i| float_numel(g, i));
            input.max(float_numel(g, v)) * p.activation_bytes
        })
        .max()
        .unwrap_or(0);

    // Peak: static state plus the live transient values at each point.
    let persistent = |v: ValueId| -> bool {
        let node = g.node(v);
        match &node.op {
            Op::Input { .. } => matches!(
                node.role,
                ValueRole::Parameter
                    | ValueRole::FirstMoment
                    | ValueRole::SecondMoment
                    | ValueRole::Step
            ),
            _ => node.role.is_moment(),
        }
    };
    let n = g.len();
    let last = g.last_uses();
    let mut frees: Vec<u64> = vec![0; n + 1];
    let mut live = 0u64;
    let mut peak = 0u64;
    for v in g.ids() {
        if !persistent(v) {
            let b = float_numel(g, v) * p.activation_bytes;
            live += b;
            frees[last[v.index()]] += b;
        }
        peak = peak.max(live);
        live -= frees[v.index()];
    }
    TrainMemory {
        precision: p,
        param_elements,
        param_bytes,
        grad_bytes,
        optimizer_bytes,
        static_bytes,
        activation_bytes,
        activations_per_layer: per_layer
            .into_iter()
            .map(|(layer, bytes)| LayerActivations { layer, bytes })
            .collect(),
        comm_buffer_bytes,
        peak_bytes: static_bytes + peak,
    }
}
