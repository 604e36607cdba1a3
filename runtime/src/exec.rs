//! The CPU executor: runs a [`Graph`]'s nodes in order on host tensors, one rank at a time.
//!
//! Pre: the graph is in topological order (operands before users) and the caller supplies
//! every `Input` by name as the GLOBAL tensor (each rank takes its own chunk per the input's
//! `shards`). A rank's [`RankCtx`] holds one [`Communicator`] per mesh axis the graph uses
//! (an empty context runs an unsharded graph); `coord(axis)` is the communicator's rank.
//! Post: the graph's named outputs, each of its node's declared shape. Intermediates are
//! freed after their last use; parameters are loaded once per call (or once per
//! [`ParamCache`] with [`execute_with_params`]).

use crate::comm::{CommError, Communicator};
use crate::cpu::{self, collective, collective_matmul, elementwise, vocab};
use crate::weights::round_to;
use crate::{RuntimeError, Tensor, Weights};
use shardc_compiler::ir::{DType, Graph, IrError, Node, Op, ParamSource, ShardSpec, ValueId};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

/// One rank's view of the mesh: a communicator per mesh axis.
#[derive(Default)]
pub struct RankCtx<'a> {
    comms: BTreeMap<String, &'a dyn Communicator>,
}

impl std::fmt::Debug for RankCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut m = f.debug_map();
        for (axis, c) in &self.comms {
            m.entry(axis, &format_args!("{}/{}", c.rank(), c.size()));
        }
        m.finish()
    }
}

impl<'a> RankCtx<'a> {
    /// An empty context: an unsharded run.
    pub fn new() -> RankCtx<'a> {
        RankCtx::default()
    }

    /// This context with `comm` serving mesh axis `axis`.
    pub fn with_axis(mut self, axis: impl Into<String>, comm: &'a dyn Communicator) -> RankCtx<'a> {
        self.insert(axis, comm);
        self
    }

    /// Sets the communicator of mesh axis `axis`.
    pub fn insert(&mut self, axis: impl Into<String>, comm: &'a dyn Communicator) {
        self.comms.insert(axis.into(), comm);
    }

    /// The communicator of `axis`, or [`RuntimeError::MissingAxis`].
    pub fn comm(&self, axis: &str) -> Result<&'a dyn Communicator, RuntimeError> {
        self.comms
            .get(axis)
            .copied()
            .ok_or_else(|| RuntimeError::MissingAxis {
                axis: axis.to_string(),
            })
    }

    /// `(coord, size)` of this rank on `axis`, if the axis is in the context.
    pub fn coord(&self, axis: &str) -> Option<(usize, usize)> {
        self.comms.get(axis).map(|c| (c.rank(), c.size()))
    }
}

/// Parameters loaded for one graph on one rank, keyed by the Param node. Identical sources
/// (same [`ParamSource`] and type) share one tensor.
#[derive(Debug, Default)]
pub struct ParamCache {
    slots: Vec<Option<usize>>,
    tensors: Vec<Tensor>,
}

impl ParamCache {
    /// The tensor of Param node `v`.
    pub fn get(&self, v: ValueId) -> Option<&Tensor> {
        self.slots
            .get(v.index())
            .copied()
            .flatten()
            .map(|i| &self.tensors[i])
    }

    /// Number of distinct tensors held.
    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// Bytes held (4 per element: every tensor is stored as f32).
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| 4 * t.numel()).sum()
    }
}

/// Loads every Param of `graph` for the rank described by `ctx` (its shards of each).
pub fn load_params(
    graph: &Graph,
    weights: &Weights,
    ctx: &RankCtx,
) -> Result<ParamCache, RuntimeError> {
    let mut cache = ParamCache {
        slots: vec![None; graph.len()],
        tensors: Vec::new(),
    };
    let mut seen: HashMap<(&ParamSource, Vec<usize>, DType), usize> = HashMap::new();
    for v in graph.params() {
        let node = graph.node(v);
        let Op::Param(src) = &node.op else {
            unreachable!("invariant: Graph::params yields Param nodes")
        };
        let key = (src, node.ty.shape(), node.ty.dtype);
        let slot = match seen.get(&key) {
            Some(&i) => i,
            None => {
                let t = weights.load(src, &node.ty, &|axis| ctx.coord(axis))?;
                cache.tensors.push(t);
                seen.insert(key, cache.tensors.len() - 1);
                cache.tensors.len() - 1
            }
        };
        cache.slots[v.index()] = Some(slot);
    }
    Ok(cache)
}

/// Runs `graph` on this rank: loads its parameters from `weights`, then
/// [`execute_with_params`].
pub fn execute(
    graph: &Graph,
    weights: &Weights,
    inputs: &BTreeMap<String, Tensor>,
    ctx: &RankCtx,
) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
    let params = load_params(graph, weights, ctx)?;
    execute_with_params(graph, &params, inputs, ctx)
}

/// Runs `graph` on this rank with parameters already loaded by [`load_params`] (for the same
/// graph and rank). Returns the named outputs.
pub fn execute_with_params(
    graph: &Graph,
    params: &ParamCache,
    inputs: &BTreeMap<String, Tensor>,
    ctx: &RankCtx,
) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
    Run::new(graph, params, inputs, ctx)?.run()
}

/// An execution driven piece by piece: the caller asks for values (and everything they need
/// that is not computed yet), supplies some inputs as rank-local tensors as they arrive (a
/// pipeline stage's received activations and gradients), and finally takes the outputs.
/// Nodes always run in graph order among those computed together, so ranks running the same
/// program and the same requests issue the same collectives in the same order. A value is
/// freed once every user has run (outputs are kept).
pub struct Stepwise<'g, 'p> {
    run: Run<'g, 'p>,
    done: Vec<bool>,
    users_left: Vec<usize>,
    /// Bytes of each value this run holds (computed or supplied; 0 for inputs it reads).
    held: Vec<usize>,
    /// Values moved out by [`Stepwise::take`].
    taken: Vec<bool>,
    live: usize,
    peak: usize,
}

impl<'g, 'p> Stepwise<'g, 'p> {
    /// A run of `graph` on this rank; `inputs` are global tensors, as for [`execute`].
    pub fn new(
        graph: &'g Graph,
        params: &'p ParamCache,
        inputs: &'p BTreeMap<String, Tensor>,
        ctx: &'g RankCtx<'g>,
    ) -> Result<Self, RuntimeError> {
        let run = Run::new(graph, params, inputs, ctx)?;
        let mut users_left = vec![0usize; graph.len()];
        for v in graph.ids() {
            for &i in &graph.node(v).inputs {
                users_left[i.index()] += 1;
            }
        }
        Ok(Stepwise {
            run,
            done: vec![false; graph.len()],
            users_left,
            held: vec![0; graph.len()],
            taken: vec![false; graph.len()],
            live: 0,
            peak: 0,
        })
    }

    /// Supplies input `name` as this rank's local tensor (already its shard).
    pub fn provide(&mut self, name: &str, t: Tensor) -> Result<(), RuntimeError> {
        let g = self.run.graph;
        let v = g
            .input_named(name)
            .ok_or_else(|| RuntimeError::MissingInput {
                name: format!("{name} (the program has no such input)"),
            })?;
        let node = g.node(v);
        if t.shape != node.ty.shape() || (node.ty.dtype == DType::I32) != t.as_i32().is_some() {
            return Err(RuntimeError::InputShape {
                name: name.to_string(),
                expected: node.ty.shape(),
                found: t.shape.clone(),
            });
        }
        self.hold(v, 4 * t.numel());
        self.run.vals[v.index()] = Some(Cow::Owned(t));
        self.done[v.index()] = true;
        Ok(())
    }

    /// Bytes of the values computed or supplied that are alive now (4 per element): the
    /// activations, gradients and optimizer values this rank holds for the program.
    pub fn live_bytes(&self) -> usize {
        self.live
    }

    /// Moves computed value `v` out of the run (an output handed elsewhere, e.g. sent to
    /// another pipeline stage): it is freed here and [`Stepwise::finish`] omits it.
    /// While later nodes still read it, it stays (and the caller gets a copy).
    pub fn take(&mut self, v: ValueId) -> Option<Tensor> {
        if self.users_left.get(v.index()).copied().unwrap_or(0) > 0 {
            self.taken[v.index()] = true;
            self.run.is_output[v.index()] = false;
            return self.value(v).cloned();
        }
        let t = self.run.vals.get_mut(v.index())?.take()?.into_owned();
        self.live -= std::mem::take(&mut self.held[v.index()]);
        self.run.is_output[v.index()] = false;
        self.taken[v.index()] = true;
        Some(t)
    }

    /// [`Stepwise::live_bytes`] of the values `pick` selects.
    pub fn live_bytes_of(&self, pick: impl Fn(ValueId) -> bool) -> usize {
        self.held
            .iter()
            .enumerate()
            .filter(|&(i, &b)| b > 0 && pick(ValueId(i as u32)))
            .map(|(_, &b)| b)
            .sum()
    }

    /// The most [`Stepwise::live_bytes`] reached so far.
    pub fn peak_bytes(&self) -> usize {
        self.peak
    }

    fn hold(&mut self, v: ValueId, bytes: usize) {
        self.held[v.index()] = bytes;
        self.live += bytes;
        self.peak = self.peak.max(self.live);
    }

    fn release(&mut self, v: ValueId) {
        self.live -= std::mem::take(&mut self.held[v.index()]);
        self.run.vals[v.index()] = None;
    }

    /// True once `v` has been computed (or supplied).
    pub fn is_done(&self, v: ValueId) -> bool {
        self.done.get(v.index()).copied().unwrap_or(false)
    }

    /// The value of `v`, while it is alive.
    pub fn value(&self, v: ValueId) -> Option<&Tensor> {
        self.run.vals.get(v.index())?.as_deref()
    }

    /// Computes `nodes` in the order given; each one's operands must be computed already.
    pub fn run_nodes(&mut self, nodes: &[ValueId]) -> Result<(), RuntimeError> {
        let g = self.run.graph;
        for &v in nodes {
            if v.index() >= g.len() || self.done[v.index()] {
                continue;
            }
            if let Some(&i) = g.node(v).inputs.iter().find(|i| !self.done[i.index()]) {
                return Err(IrError::Undefined {
                    node: v,
                    operand: i,
                }
                .into());
            }
            self.step(v)?;
        }
        Ok(())
    }

    /// Computes every remaining value, then returns the named outputs.
    pub fn finish(mut self) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        let g = self.run.graph;
        for v in g.ids() {
            if !self.done[v.index()] {
                self.step(v)?;
            }
        }
        let mut out = BTreeMap::new();
        for (name, v) in g.outputs.iter().filter(|(_, v)| !self.taken[v.index()]) {
            let t = self.run.vals[v.index()]
                .as_deref()
                .expect("invariant: outputs are kept")
                .clone();
            out.insert(name.clone(), t);
        }
        Ok(out)
    }

    fn step(&mut self, v: ValueId) -> Result<(), RuntimeError> {
        let node = self.run.graph.node(v);
        let val = self.run.node(v, node)?;
        check_type(v, node, &val)?;
        for &i in &node.inputs {
            let left = &mut self.users_left[i.index()];
            *left = left.saturating_sub(1);
            if *left == 0 && !self.run.is_output[i.index()] {
                self.release(i);
            }
        }
        self.done[v.index()] = true;
        if self.users_left[v.index()] > 0 || self.run.is_output[v.index()] {
            if !matches!(node.op, Op::Input { .. } | Op::Param(_)) {
                self.hold(v, 4 * val.numel());
            }
            self.run.vals[v.index()] = Some(val);
        }
        Ok(())
    }
}

/// State of one execution.
struct Run<'g, 'p> {
    graph: &'g Graph,
    params: &'p ParamCache,
    inputs: &'p BTreeMap<String, Tensor>,
    ctx: &'g RankCtx<'g>,
    /// Node index of each value's last user (its own index when unused).
    last_use: Vec<usize>,
    /// Values that are graph outputs (never freed).
    is_output: Vec<bool>,
    /// Values derived from a `RankOffset` (vocabulary-local token ids).
    local_ids: Vec<bool>,
    vals: Vec<Option<Cow<'p, Tensor>>>,
}

impl<'g, 'p> Run<'g, 'p> {
    fn new(
        graph: &'g Graph,
        params: &'p ParamCache,
        inputs: &'p BTreeMap<String, Tensor>,
        ctx: &'g RankCtx<'g>,
    ) -> Result<Self, RuntimeError> {
        let n = graph.len();
        let mut last_use: Vec<usize> = (0..n).collect();
        for v in graph.ids() {
            let node = graph.node(v);
            for &i in &node.inputs {
                if i.index() >= v.index() {
                    return Err(IrError::Undefined {
                        node: v,
                        operand: i,
                    }
                    .into());
                }
                last_use[i.index()] = v.index();
            }
        }
        let mut is_output = vec![false; n];
        for (name, v) in &graph.outputs {
            if v.index() >= n {
                return Err(RuntimeError::BadOutput {
                    name: name.clone(),
                    value: *v,
                });
            }
            is_output[v.index()] = true;
        }
        Ok(Run {
            graph,
            params,
            inputs,
            ctx,
            last_use,
            is_output,
            local_ids: crate::rank::local_ids(graph),
            vals: (0..n).map(|_| None).collect(),
        })
    }

    fn run(mut self) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
        for v in self.graph.ids() {
            let node = self.graph.node(v);
            let val = self.node(v, node)?;
            check_type(v, node, &val)?;
            for &i in &node.inputs {
                if self.last_use[i.index()] == v.index() && !self.is_output[i.index()] {
                    self.vals[i.index()] = None;
                }
            }
            if self.last_use[v.index()] > v.index() || self.is_output[v.index()] {
                self.vals[v.index()] = Some(val);
            }
        }
        let outputs = &self.graph.outputs;
        let mut out = BTreeMap::new();
        for (k, (name, v)) in outputs.iter().enumerate() {
            let last = !outputs[k + 1..].iter().any(|(_, w)| w == v);
            let t = if last {
                self.vals[v.index()].take()
            } else {
                self.vals[v.index()].clone()
            };
            out.insert(
                name.clone(),
                t.expect("invariant: outputs are kept").into_owned(),
            );
        }
        Ok(out)
    }

    /// Computes one node.
    fn node(&self, v: ValueId, node: &'g Node) -> Result<Cow<'p, Tensor>, RuntimeError> {
        let args: Vec<&Tensor> = node
            .inputs
            .iter()
            .map(|i| {
                self.vals[i.index()]
                    .as_deref()
                    .expect("invariant: operands are alive until their last use")
            })
            .collect();
        let at_node = |e: RuntimeError| match e {
            RuntimeError::Shape { .. }
            | RuntimeError::OperandDType { .. }
            | RuntimeError::Unsupported { .. } => RuntimeError::InNode {
                node: v,
                name: node.name.clone(),
                source: Box::new(e),
            },
            other => other,
        };
        let wrap = |source: CommError| RuntimeError::Comm {
            node: v,
            name: node.name.clone(),
            op: node.op.mnemonic(),
            source: Box::new(source),
        };
        let owned = |r: Result<Tensor, RuntimeError>| r.map(Cow::Owned).map_err(at_node);
        match &node.op {
            Op::Input { name, shards } => self.input(name, shards, node),
            Op::Param(_) => {
                self.params
                    .get(v)
                    .map(Cow::Borrowed)
                    .ok_or_else(|| RuntimeError::ParamNotLoaded {
                        node: v,
                        name: node.name.clone(),
                    })
            }
            Op::AllReduce { axis }
            | Op::ReduceScatter { axis, .. }
            | Op::AllGather { axis, .. }
            | Op::AllToAll { axis, .. }
            | Op::Broadcast { axis, .. } => owned(collective::collective(
                self.ctx.comm(axis)?,
                &node.op,
                args[0],
                &wrap,
            )),
            Op::LocalSlice { axis, dim, parts } => {
                let spec = ShardSpec {
                    dim: *dim,
                    axis: axis.clone(),
                    parts: *parts,
                };
                owned(self.take_chunk(args[0], &spec))
            }
            Op::AgMatMul { axis, .. } | Op::MatMulRs { axis, .. } => {
                owned(collective_matmul::ring_matmul(
                    self.ctx.comm(axis)?,
                    &node.op,
                    args[0],
                    args[1],
                    &wrap,
                ))
            }
            Op::RingAttention { axis, .. } | Op::RingAttentionGrad { axis, .. } => {
                owned(cpu::ring_attention::ring_attention_op(
                    self.ctx.comm(axis)?,
                    &node.op,
                    &args,
                    &wrap,
                ))
            }
            Op::RankOffset { axis, stride } => {
                let (coord, _) = self.coord(axis)?;
                owned(elementwise::rank_offset(args[0], coord, *stride))
            }
            Op::Embedding => {
                let (table, ids) = (args[0], args[1]);
                if !self.local_ids[node.inputs[1].index()] && table.shape.len() == 2 {
                    vocab::check_ids(ids, table.shape[0]).map_err(at_node)?;
                }
                owned(cpu::eval_op(&node.op, &args, &node.ty))
            }
            Op::CrossEntropyStats { axis, parts } => {
                let coord = crate::rank::part_coord(self.coord(axis)?, axis, *parts)?;
                owned(vocab::cross_entropy_stats(args[0], args[1], coord, *parts))
            }
            Op::CrossEntropyShardGrad { axis, denom } => {
                let (coord, _) = self.coord(axis)?;
                owned(cpu::train::basic::cross_entropy_shard_grad(
                    args[0], args[1], args[2], coord, *denom,
                ))
            }
            Op::CrossEntropy { .. } | Op::CrossEntropyFromStats { .. } => {
                let loss = cpu::eval_op(&node.op, &args, &node.ty).map_err(at_node)?;
                check_loss(node, &loss)?;
                Ok(Cow::Owned(loss))
            }
            op => owned(cpu::eval_op(op, &args, &node.ty)),
        }
    }

    fn coord(&self, axis: &str) -> Result<(usize, usize), RuntimeError> {
        self.ctx
            .coord(axis)
            .ok_or_else(|| RuntimeError::MissingAxis {
                axis: axis.to_string(),
            })
    }

    /// This rank's chunk `coord(axis)` of `spec.parts` along `spec.dim`.
    fn take_chunk(&self, x: &Tensor, spec: &ShardSpec) -> Result<Tensor, RuntimeError> {
        crate::rank::chunk_of(x, spec, &|a| self.coord(a))
    }

    /// An `Input` node: the caller's global tensor, checked, then this rank's chunk of it.
    fn input(
        &self,
        name: &str,
        shards: &[ShardSpec],
        node: &Node,
    ) -> Result<Cow<'p, Tensor>, RuntimeError> {
        let mut cur =
            crate::rank::input_chunk(node, name, shards, self.inputs, &|a| self.coord(a))?;
        if matches!(node.ty.dtype, DType::Bf16 | DType::F16) {
            let mut owned = cur.into_owned();
            if let crate::Buffer::F32(v) = &mut owned.data {
                round_to(node.ty.dtype, v);
            }
            cur = Cow::Owned(owned);
        }
        Ok(cur)
    }
}

/// Fails at the first loss that is not finite, naming its micro-batch (from the node's
/// `mb<k>.` prefix, which the training graph gives every value of micro-batch `k` when there
/// are several): nothing after it (gradients, the optimizer step) would be meaningful. A
/// rank's loss is a partial sum of the global one, so a non-finite local value makes the
/// global value non-finite too.
fn check_loss(node: &Node, loss: &Tensor) -> Result<(), RuntimeError> {
    let Some(&value) = loss
        .as_f32()
        .and_then(|v| v.iter().find(|x| !x.is_finite()))
    else {
        return Ok(());
    };
    let micro = node
        .name
        .strip_prefix("mb")
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(k, _)| k.parse().ok())
        .unwrap_or(0);
    Err(RuntimeError::NonFiniteLoss { micro, value })
}

/// Checks a computed value against the node's declared type.
fn check_type(v: ValueId, node: &Node, t: &Tensor) -> Result<(), RuntimeError> {
    let shape_ok = t.shape.len() == node.ty.rank()
        && t.shape.iter().zip(&node.ty.dims).all(|(a, d)| *a == d.size);
    let dtype_ok = (node.ty.dtype == DType::I32) == t.as_i32().is_some();
    if shape_ok && dtype_ok {
        Ok(())
    } else {
        Err(RuntimeError::NodeType {
            node: v,
            name: node.name.clone(),
            expected_dtype: node.ty.dtype,
            expected: node.ty.shape(),
            found_dtype: if t.as_i32().is_some() {
                DType::I32
            } else {
                DType::F32
            },
            found: t.shape.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_compiler::ir::TensorType;

    /// A graph whose only loss, `name`, is the cross-entropy of `[2, 4]` logits.
    fn loss_graph(name: &str) -> Graph {
        let mut g = Graph::new();
        let logits = g.input("logits", TensorType::plain(DType::F32, &[2, 4]));
        let labels = g.input("labels", TensorType::plain(DType::I32, &[2]));
        let loss = g
            .add(Op::CrossEntropy { denom: 2 }, &[logits, labels], name)
            .unwrap();
        g.set_output("loss", loss);
        g
    }

    fn inputs(bad: f32) -> BTreeMap<String, Tensor> {
        BTreeMap::from([
            (
                "logits".to_string(),
                Tensor::f32(vec![2, 4], vec![0.5, 1.0, bad, 0.0, 1.0, 2.0, 3.0, 4.0]),
            ),
            ("labels".to_string(), Tensor::i32(vec![2], vec![1, 3])),
        ])
    }

    #[test]
    fn a_non_finite_loss_stops_the_run_naming_its_micro_batch() {
        let ctx = RankCtx::new();
        let none = ParamCache::default();
        for (name, micro) in [("mb1.loss", 1), ("mb12.loss", 12), ("loss", 0)] {
            let g = loss_graph(name);
            let ok = execute_with_params(&g, &none, &inputs(2.0), &ctx).unwrap();
            assert!(ok["loss"].as_f32().unwrap()[0].is_finite());
            let err = execute_with_params(&g, &none, &inputs(f32::NAN), &ctx).unwrap_err();
            assert!(
                matches!(err, RuntimeError::NonFiniteLoss { micro: m, value } if m == micro && value.is_nan()),
                "{name}: {err}"
            );
            assert_eq!(err.to_string(), format!("micro-batch {micro}: loss is NaN"));
            // Piecewise execution checks it too.
            let ins = inputs(f32::INFINITY);
            let st = Stepwise::new(&g, &none, &ins, &ctx).unwrap();
            let err = st.finish().unwrap_err();
            assert!(
                matches!(err, RuntimeError::NonFiniteLoss { micro: m, .. } if m == micro),
                "{name}: {err}"
            );
        }
    }
}
