//! The training-step graph: parameters as inputs, the forward and backward pass of each
//! micro-batch, gradient accumulation and the AdamW step (see the module docs of
//! [`crate::autodiff`]).

use super::{AutodiffError, Recompute};
use crate::ir::{AdamWSpec, DType, Graph, Op, ParamSource, TensorType, ValueId, ValueRole};
use std::collections::HashMap;

/// What [`build_train_graph`] builds.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainGraphOptions {
    /// Micro-batches per step (gradient accumulation); the forward graph is one micro-batch.
    pub micro_batches: usize,
    /// Predicted tokens in the whole step (all micro-batches and ranks): the loss divisor.
    pub denom: usize,
    /// Activation checkpointing.
    pub recompute: Recompute,
    /// Layers recomputed fully whatever `recompute` says (Megatron-LM's block method: the
    /// first `k` of each pipeline chunk).
    pub full_layers: Vec<u32>,
    /// Optimizer hyperparameters.
    pub adamw: AdamWSpec,
    /// Read parameters through one `gather.<label>` node per micro-batch and pass (forward,
    /// backward) instead of directly: the places ZeRO-3 all-gathers them.
    pub gather_params: bool,
    /// End each micro-batch's gradient of a parameter with an identity node (`grad.<label>`,
    /// the sum of its uses being `bwd.grad.<label>`): the value ZeRO-2/3 annotate, so the
    /// sharding machinery reduce-scatters the gradient there rather than laying out the
    /// gradient computation itself by the shard.
    pub sync_grads: bool,
    /// Parameters another pipeline chunk also holds (tied embeddings split over stages):
    /// the optimizer steps each with its gradient plus the other copy's, read from the input
    /// `pipe.tied.<label>` (laid out like the gradient).
    pub tied: Vec<String>,
}

/// The input a pipeline chunk reads the other copy's gradient of tied parameter `label`
/// from.
pub fn tied_input(label: &str) -> String {
    format!("{PIPE_TIED_PREFIX}{label}")
}

/// The parameter label of input `name` when [`tied_input`] names it.
pub fn tied_label(name: &str) -> Option<&str> {
    name.strip_prefix(PIPE_TIED_PREFIX)
}

/// Name prefix of the inputs [`tied_input`] names.
pub const PIPE_TIED_PREFIX: &str = "pipe.tied.";

impl Default for TrainGraphOptions {
    fn default() -> TrainGraphOptions {
        TrainGraphOptions {
            micro_batches: 1,
            denom: 1,
            recompute: Recompute::None,
            full_layers: Vec::new(),
            adamw: AdamWSpec::default(),
            gather_params: false,
            sync_grads: false,
            tied: Vec::new(),
        }
    }
}

/// One trainable parameter and its nodes in the training graph.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainParam {
    /// The forward graph's label (`layers.0.attn.q_proj.weight`, `embed`, ...).
    pub label: String,
    /// Where its data lives in the checkpoint (unsharded).
    pub source: ParamSource,
    /// Its (global) type, graph layout.
    pub ty: TensorType,
    /// The forward graph's `Param` node.
    pub fwd: ValueId,
    /// The input `param.<label>`.
    pub input: ValueId,
    /// Its gradient from each micro-batch (summed over the parameter's uses; with
    /// `sync_grads`, the identity node after that sum).
    pub mb_grads: Vec<ValueId>,
    /// The accumulated gradient `grad.<label>` (output of the same name).
    pub grad: ValueId,
    /// Input `adam_m.<label>`.
    pub m_in: ValueId,
    /// Input `adam_v.<label>`.
    pub v_in: ValueId,
    /// Updated first moment (output `adam_m.<label>`).
    pub m_out: ValueId,
    /// Updated second moment (output `adam_v.<label>`).
    pub v_out: ValueId,
    /// Updated parameter (output `param.<label>`).
    pub update: ValueId,
}

/// The graph of one training step and where each of its parts lives.
#[derive(Clone, Debug)]
pub struct TrainGraph {
    /// The graph.
    pub graph: Graph,
    /// Parameters in forward order.
    pub params: Vec<TrainParam>,
    /// Micro-batches.
    pub micro_batches: usize,
    /// Per micro-batch, the node computing each forward value (`None` for parameters).
    pub fwd_maps: Vec<Vec<Option<ValueId>>>,
    /// Per micro-batch, the node holding each forward value's gradient (when it has one).
    pub cotangents: Vec<Vec<Option<ValueId>>>,
    /// `gather.<label>` nodes and the parameter (index into `params`) each reads.
    pub gathers: Vec<(ValueId, usize)>,
    /// The summed loss (output `loss`); `None` in a pipeline chunk without the head.
    pub loss: Option<ValueId>,
    /// The step-count input `step`.
    pub step: ValueId,
    /// Pipeline chunks: per micro-batch, the loss of that micro-batch (chunks with the head).
    pub mb_losses: Vec<ValueId>,
    /// Pipeline chunks: per micro-batch, the residual stream handed to the next chunk
    /// (output [`crate::model::STAGE_OUTPUT`], suffixed per micro-batch like the inputs).
    pub act_out: Vec<ValueId>,
    /// Pipeline chunks: per micro-batch, the gradient this chunk receives for its
    /// `act_out` (input `pipe.grad_in`).
    pub grad_in: Vec<ValueId>,
    /// Pipeline chunks: per micro-batch, the gradient of the chunk's input
    /// [`crate::model::STAGE_INPUT`], handed back to the previous chunk (output
    /// `pipe.grad_out`).
    pub grad_out: Vec<ValueId>,
}

/// The input of a pipeline chunk that receives its output's gradient.
pub const PIPE_GRAD_IN: &str = "pipe.grad_in";
/// The output of a pipeline chunk holding its input's gradient.
pub const PIPE_GRAD_OUT: &str = "pipe.grad_out";
/// The output of a pipeline chunk holding one micro-batch's loss.
pub const PIPE_LOSS: &str = "pipe.loss";

impl TrainGraph {
    /// The parameter labelled `label`.
    pub fn param(&self, label: &str) -> Option<&TrainParam> {
        self.params.iter().find(|p| p.label == label)
    }
}

/// The name of batch input `base` (`input_ids`, `labels`, ...) of micro-batch `k`.
pub fn input_name(base: &str, k: usize, micro_batches: usize) -> String {
    if micro_batches <= 1 {
        base.to_string()
    } else {
        format!("{base}.mb{k}")
    }
}

/// Builder state. Per-micro-batch tables are reset by [`Builder::start_micro_batch`].
pub(super) struct Builder<'f> {
    pub(super) fwd: &'f Graph,
    pub(super) g: Graph,
    pub(super) opts: TrainGraphOptions,
    /// Parameter index of each forward node that is a `Param`.
    pub(super) param_of: Vec<Option<usize>>,
    pub(super) params: Vec<TrainParam>,
    pub(super) gathers: Vec<(ValueId, usize)>,
    /// Name prefix of this micro-batch's nodes (`""` or `mb<k>.`).
    pub(super) prefix: String,
    /// Layer of the forward node whose gradient is being built.
    pub(super) cur_layer: Option<u32>,
    /// Role of the nodes [`Builder::add`] appends: the phase being built.
    pub(super) role: ValueRole,
    pub(super) map: Vec<Option<ValueId>>,
    pub(super) ct: Vec<Vec<ValueId>>,
    pub(super) cot: Vec<Option<ValueId>>,
    pub(super) pgrads: Vec<Vec<ValueId>>,
    /// `saved.*` node of each train value read by the backward.
    pub(super) saved: HashMap<ValueId, ValueId>,
    /// Recomputed forward values (full recomputation), by forward node.
    pub(super) recomputed: HashMap<ValueId, ValueId>,
    /// Probabilities computed in the forward pass, by forward attention node.
    pub(super) probs: HashMap<ValueId, ValueId>,
    /// Gather node of (parameter, backward phase).
    pub(super) uses: HashMap<(usize, bool), ValueId>,
    /// The forward input [`crate::model::STAGE_INPUT`] of a pipeline chunk: an input that
    /// receives a gradient.
    pub(super) diff_input: Option<ValueId>,
}

impl Builder<'_> {
    /// Appends a node in layer `layer`, in the role of the phase being built.
    pub(super) fn add(
        &mut self,
        op: Op,
        inputs: &[ValueId],
        ty: Option<TensorType>,
        name: String,
        layer: Option<u32>,
    ) -> Result<ValueId, AutodiffError> {
        self.add_as(self.role, op, inputs, ty, name, layer)
    }

    /// Appends a node in layer `layer` and role `role`.
    pub(super) fn add_as(
        &mut self,
        role: ValueRole,
        op: Op,
        inputs: &[ValueId],
        ty: Option<TensorType>,
        name: String,
        layer: Option<u32>,
    ) -> Result<ValueId, AutodiffError> {
        self.g.current_layer = layer;
        self.g.current_role = role;
        self.g
            .add_typed(op, inputs, ty, name.clone())
            .map_err(|source| AutodiffError::Build { node: name, source })
    }

    /// Appends the graph input `name` (in no layer).
    pub(super) fn input(&mut self, name: &str, ty: TensorType, role: ValueRole) -> ValueId {
        self.g.current_layer = None;
        self.g.current_role = role;
        self.g.input(name, ty)
    }

    fn start_micro_batch(&mut self, k: usize) {
        let n = self.fwd.len();
        self.prefix = if self.opts.micro_batches > 1 {
            format!("mb{k}.")
        } else {
            String::new()
        };
        self.map = vec![None; n];
        self.ct = vec![Vec::new(); n];
        self.cot = vec![None; n];
        self.pgrads = vec![Vec::new(); self.params.len()];
        self.saved.clear();
        self.recomputed.clear();
        self.probs.clear();
        self.uses.clear();
    }

    /// The value of parameter `p` as read in the forward (`bwd` false) or backward pass.
    pub(super) fn param_use(&mut self, p: usize, bwd: bool) -> Result<ValueId, AutodiffError> {
        let input = self.params[p].input;
        if !self.opts.gather_params {
            return Ok(input);
        }
        if let Some(&x) = self.uses.get(&(p, bwd)) {
            return Ok(x);
        }
        let (phase, role) = if bwd {
            ("bwd.gather", ValueRole::Backward)
        } else {
            ("gather", ValueRole::Forward)
        };
        let name = format!("{}{phase}.{}", self.prefix, self.params[p].label);
        let ty = self.params[p].ty.clone();
        let x = self.add_as(role, Op::Reshape, &[input], Some(ty), name, self.cur_layer)?;
        self.uses.insert((p, bwd), x);
        self.gathers.push((x, p));
        Ok(x)
    }

    /// The node a forward-pass operand reads.
    fn fwd_operand(&mut self, v: ValueId) -> Result<ValueId, AutodiffError> {
        match self.param_of[v.index()] {
            Some(p) => self.param_use(p, false),
            None => Ok(self.map[v.index()].expect("invariant: operands are copied first")),
        }
    }

    /// Forward pass of one micro-batch; returns (logits, labels) when the graph has a head.
    fn forward(&mut self, k: usize) -> Result<Option<(ValueId, ValueId)>, AutodiffError> {
        let fwd = self.fwd;
        let kk = self.opts.micro_batches;
        self.role = ValueRole::Forward;
        // Outputs put back into natural order (context parallelism's head-tail order) serve
        // callers of the forward pass only: the loss reads the logits as computed, with the
        // labels permuted alike (the mean over tokens does not depend on their order).
        let natural: Vec<ValueId> = fwd
            .outputs
            .iter()
            .map(|(_, v)| *v)
            .filter(|&v| matches!(fwd.node(v).op, Op::SeqPermute { inverse: true, .. }))
            .collect();
        for v in fwd.ids() {
            let node = fwd.node(v);
            if natural.contains(&v) {
                continue;
            }
            match &node.op {
                Op::Param(_) => continue,
                Op::Input { name, .. } => {
                    let name = input_name(name, k, kk);
                    let x = self.input(&name, node.ty.clone(), ValueRole::Forward);
                    self.map[v.index()] = Some(x);
                    continue;
                }
                _ => {}
            }
            self.cur_layer = node.layer;
            let inputs = node
                .inputs
                .iter()
                .map(|&i| self.fwd_operand(i))
                .collect::<Result<Vec<_>, _>>()?;
            let declared = node.op.needs_declared_type().then(|| node.ty.clone());
            let name = format!("{}{}", self.prefix, node.name);
            let x = self.add(node.op.clone(), &inputs, declared, name.clone(), node.layer)?;
            self.map[v.index()] = Some(x);
            let probs_kept = self.opts.recompute == Recompute::None
                && !node
                    .layer
                    .is_some_and(|l| self.opts.full_layers.contains(&l));
            if let (Op::Attention(spec), true) = (&node.op, probs_kept) {
                // q, k and what follows v: the mask and the indices.
                let mut qk = vec![inputs[0], inputs[1]];
                qk.extend(inputs.iter().skip(3).copied());
                let p = self.add(
                    Op::AttentionProbs(*spec),
                    &qk,
                    None,
                    format!("{name}.probs"),
                    node.layer,
                )?;
                self.probs.insert(v, p);
            }
        }
        let Some(logits) = fwd.output("logits") else {
            return match fwd.output(crate::model::STAGE_OUTPUT) {
                Some(_) => Ok(None),
                None => Err(AutodiffError::Forward("no `logits` output".into())),
            };
        };
        let ids = fwd
            .input_named("input_ids")
            .or_else(|| fwd.input_named("position_ids"))
            .ok_or_else(|| AutodiffError::Forward("no `input_ids` input".into()))?;
        let mut labels = self.input(
            &input_name("labels", k, kk),
            fwd.ty(ids).clone(),
            ValueRole::Forward,
        );
        let mut logits = logits;
        if let (true, Op::SeqPermute { dim, order, .. }) =
            (natural.contains(&logits), &fwd.node(logits).op)
        {
            let op = Op::SeqPermute {
                dim: *dim,
                order: *order,
                inverse: false,
            };
            let name = format!("{}labels.cp_order", self.prefix);
            labels = self.add(op, &[labels], None, name, None)?;
            logits = fwd.node(logits).inputs[0];
        }
        Ok(Some((logits, labels)))
    }

    /// The sum of `parts` (in order); the last node is named `name`.
    pub(super) fn sum(
        &mut self,
        parts: &[ValueId],
        name: &str,
        layer: Option<u32>,
    ) -> Result<ValueId, AutodiffError> {
        let mut acc = parts[0];
        for (i, &p) in parts.iter().enumerate().skip(1) {
            let n = if i + 1 == parts.len() {
                name.to_string()
            } else {
                format!("{name}.part{i}")
            };
            acc = self.add(Op::Add, &[acc, p], None, n, layer)?;
        }
        Ok(acc)
    }

    /// Sums parameter `p`'s gradient contributions of this micro-batch and accumulates it.
    fn finish_param(&mut self, p: usize, k: usize) -> Result<(), AutodiffError> {
        let parts = std::mem::take(&mut self.pgrads[p]);
        let label = self.params[p].label.clone();
        if parts.is_empty() {
            return Err(AutodiffError::Forward(format!(
                "parameter `{label}` does not affect the loss"
            )));
        }
        let kk = self.opts.micro_batches;
        let grad = ValueRole::Gradient.name(&label);
        let own = if kk > 1 {
            format!("mb{k}.{grad}")
        } else {
            grad.clone()
        };
        let (sum_name, sum_role) = if self.opts.sync_grads {
            (format!("{}bwd.{grad}", self.prefix), ValueRole::Backward)
        } else {
            (own.clone(), ValueRole::Gradient)
        };
        let layer = self
            .g
            .node(*parts.last().expect("invariant: non-empty"))
            .layer;
        let mut g = if parts.len() == 1 {
            let node = &mut self.g.nodes[parts[0].index()];
            (node.name, node.role) = (sum_name, sum_role);
            parts[0]
        } else {
            self.role = sum_role;
            let sum = self.sum(&parts, &sum_name, layer);
            self.role = ValueRole::Backward;
            sum?
        };
        if self.opts.sync_grads {
            let ty = self.params[p].ty.clone();
            g = self.add_as(ValueRole::Gradient, Op::Reshape, &[g], Some(ty), own, layer)?;
        }
        self.params[p].mb_grads.push(g);
        if k > 0 {
            let prev = self.params[p].grad;
            let name = if k + 1 == kk {
                grad
            } else {
                format!("{grad}.acc{k}")
            };
            let layer = self.g.node(g).layer;
            let acc = self.add_as(ValueRole::Gradient, Op::Add, &[prev, g], None, name, layer);
            self.params[p].grad = acc?;
        } else {
            self.params[p].grad = g;
        }
        Ok(())
    }

    /// Backward pass of one micro-batch, from the loss (`head`: logits and labels) or, in a
    /// pipeline chunk without the head, from the gradient input of its output. Returns that
    /// gradient input and the chunk input's gradient (pipeline chunks).
    fn backward(
        &mut self,
        k: usize,
        head: Option<(ValueId, ValueId)>,
    ) -> Result<(Option<ValueId>, Option<ValueId>), AutodiffError> {
        let fwd = self.fwd;
        // Each parameter's gradient is complete after its first user's gradient.
        let mut finish_at: Vec<Vec<usize>> = vec![Vec::new(); fwd.len()];
        let users = fwd.users();
        let mut pending = vec![false; self.params.len()];
        for (p, tp) in self.params.iter().enumerate() {
            if let Some(&first) = users[tp.fwd.index()].first() {
                finish_at[first.index()].push(p);
                pending[p] = true;
            }
        }
        self.cur_layer = None;
        self.role = ValueRole::Backward;
        let mut seed_input = None;
        match head {
            Some((logits, labels)) => {
                let l = self.saved_fwd(logits)?;
                let d = self.add(
                    Op::CrossEntropyGrad {
                        denom: self.opts.denom,
                    },
                    &[l, labels],
                    None,
                    format!("{}bwd.loss.dlogits", self.prefix),
                    None,
                )?;
                self.ct[logits.index()].push(d);
            }
            None => {
                let out = fwd
                    .output(crate::model::STAGE_OUTPUT)
                    .ok_or_else(|| AutodiffError::Forward("no `logits` output".into()))?;
                let name = input_name(PIPE_GRAD_IN, k, self.opts.micro_batches);
                let d = self.input(&name, fwd.ty(out).clone(), ValueRole::Backward);
                self.ct[out.index()].push(d);
                seed_input = Some(d);
            }
        }
        for v in (0..fwd.len() as u32).rev().map(ValueId) {
            let node = fwd.node(v);
            if !self.ct[v.index()].is_empty() && !matches!(node.op, Op::Input { .. } | Op::Param(_))
            {
                self.cur_layer = node.layer;
                let parts = std::mem::take(&mut self.ct[v.index()]);
                let dy = if parts.len() == 1 {
                    parts[0]
                } else {
                    let name = format!("{}bwd.{}.sum", self.prefix, node.name);
                    self.sum(&parts, &name, node.layer)?
                };
                self.cot[v.index()] = Some(dy);
                self.vjp(v, dy)?;
            }
            for p in std::mem::take(&mut finish_at[v.index()]) {
                self.finish_param(p, k)?;
                pending[p] = false;
            }
        }
        if let Some(p) = pending.iter().position(|&x| x) {
            return Err(AutodiffError::Forward(format!(
                "parameter `{}` does not affect the loss",
                self.params[p].label
            )));
        }
        // A pipeline chunk's input gradient, handed to the previous chunk.
        let mut input_grad = None;
        if let Some(u) = self.diff_input {
            let parts = std::mem::take(&mut self.ct[u.index()]);
            if parts.is_empty() {
                return Err(AutodiffError::Forward(format!(
                    "the chunk input `{}` does not affect the loss",
                    crate::model::STAGE_INPUT
                )));
            }
            let name = format!("{}bwd.{}", self.prefix, crate::model::STAGE_INPUT);
            input_grad = Some(self.sum(&parts, &name, None)?);
        }
        Ok((seed_input, input_grad))
    }

    /// The AdamW step of every parameter; returns the step input.
    fn optimizer(&mut self) -> Result<ValueId, AutodiffError> {
        let step = self.input("step", TensorType::plain(DType::F32, &[]), ValueRole::Step);
        let spec = self.opts.adamw;
        for p in 0..self.params.len() {
            let (label, ty, input, grad) = {
                let tp = &self.params[p];
                (tp.label.clone(), tp.ty.clone(), tp.input, tp.grad)
            };
            let grad = if self.opts.tied.contains(&label) {
                let other = self.input(&tied_input(&label), ty.clone(), ValueRole::Gradient);
                self.add_as(
                    ValueRole::Gradient,
                    Op::Add,
                    &[grad, other],
                    None,
                    format!("opt.tied_grad.{label}"),
                    None,
                )?
            } else {
                grad
            };
            // The first and second moments: their inputs, then their updates.
            let moments = [
                (ValueRole::FirstMoment, "m", spec.beta1, false),
                (ValueRole::SecondMoment, "v", spec.beta2, true),
            ];
            let [m_in, v_in] =
                moments.map(|(role, ..)| self.input(&role.name(&label), ty.clone(), role));
            let mut outs = [m_in, v_in];
            for (out, (role, tag, beta, squared)) in outs.iter_mut().zip(moments) {
                let op = Op::AdamMoment { beta, squared };
                let name = format!("opt.{tag}.{label}");
                *out = self.add_as(role, op, &[*out, grad], None, name, None)?;
            }
            let [m_out, v_out] = outs;
            let update = self.add_as(
                ValueRole::Update,
                Op::AdamWUpdate(spec),
                &[input, m_out, v_out, step],
                None,
                format!("opt.update.{label}"),
                None,
            )?;
            let tp = &mut self.params[p];
            (tp.m_in, tp.v_in, tp.m_out, tp.v_out, tp.update) = (m_in, v_in, m_out, v_out, update);
        }
        Ok(step)
    }
}

/// Builds the training step of forward graph `fwd` (one micro-batch).
pub fn build_train_graph(
    fwd: &Graph,
    opts: &TrainGraphOptions,
) -> Result<TrainGraph, AutodiffError> {
    if opts.micro_batches == 0 {
        return Err(AutodiffError::Forward(
            "micro_batches must be at least 1".into(),
        ));
    }
    let mut b = Builder {
        fwd,
        g: Graph::new(),
        opts: opts.clone(),
        param_of: vec![None; fwd.len()],
        params: Vec::new(),
        gathers: Vec::new(),
        prefix: String::new(),
        cur_layer: None,
        role: ValueRole::Forward,
        map: Vec::new(),
        ct: Vec::new(),
        cot: Vec::new(),
        pgrads: Vec::new(),
        saved: HashMap::new(),
        recomputed: HashMap::new(),
        probs: HashMap::new(),
        uses: HashMap::new(),
        diff_input: fwd.input_named(crate::model::STAGE_INPUT),
    };
    // 1. Parameters become inputs, in forward order.
    for v in fwd.params() {
        let node = fwd.node(v);
        let Op::Param(src) = &node.op else {
            unreachable!("invariant: Graph::params yields Param nodes")
        };
        if b.params.iter().any(|p| p.label == node.name) {
            return Err(AutodiffError::Forward(format!(
                "two parameters are labelled `{}`",
                node.name
            )));
        }
        let name = ValueRole::Parameter.name(&node.name);
        let input = b.input(&name, node.ty.clone(), ValueRole::Parameter);
        b.param_of[v.index()] = Some(b.params.len());
        b.params.push(TrainParam {
            label: node.name.clone(),
            source: src.clone(),
            ty: node.ty.clone(),
            fwd: v,
            input,
            mb_grads: Vec::new(),
            grad: input,
            m_in: input,
            v_in: input,
            m_out: input,
            v_out: input,
            update: input,
        });
    }
    // 2–3. Forward, loss and backward of each micro-batch; gradients accumulate.
    let mut fwd_maps = Vec::new();
    let mut cotangents = Vec::new();
    let mut losses = Vec::new();
    let (mut act_out, mut grad_in, mut grad_out) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..opts.micro_batches {
        b.start_micro_batch(k);
        let head = b.forward(k)?;
        if let Some((logits, labels)) = head {
            let lv = b.map[logits.index()].expect("invariant: logits were computed");
            let loss = b.add_as(
                ValueRole::Loss,
                Op::CrossEntropy { denom: opts.denom },
                &[lv, labels],
                None,
                format!("{}loss", b.prefix),
                None,
            )?;
            losses.push(loss);
        } else if let Some(out) = fwd.output(crate::model::STAGE_OUTPUT) {
            act_out.push(b.map[out.index()].expect("invariant: the output was computed"));
        }
        let (seed, input_grad) = b.backward(k, head)?;
        grad_in.extend(seed);
        grad_out.extend(input_grad);
        fwd_maps.push(std::mem::take(&mut b.map));
        cotangents.push(std::mem::take(&mut b.cot));
    }
    b.role = ValueRole::Loss;
    let loss = match losses.len() {
        0 => None,
        1 => Some(losses[0]),
        _ => Some(b.sum(&losses, "loss", None)?),
    };
    // 4. The optimizer.
    let step = b.optimizer()?;
    let mut g = std::mem::take(&mut b.g);
    g.current_layer = None;
    g.current_role = ValueRole::Forward;
    let kk = opts.micro_batches;
    if let Some(loss) = loss {
        g.set_output("loss", loss);
    }
    for (k, &l) in losses.iter().enumerate() {
        if fwd.input_named(crate::model::STAGE_INPUT).is_some() {
            g.set_output(&input_name(PIPE_LOSS, k, kk), l);
        }
    }
    for (k, &v) in act_out.iter().enumerate() {
        g.set_output(&input_name(crate::model::STAGE_OUTPUT, k, kk), v);
    }
    for (k, &v) in grad_out.iter().enumerate() {
        g.set_output(&input_name(PIPE_GRAD_OUT, k, kk), v);
    }
    for p in &b.params {
        let l = &p.label;
        g.set_output(&ValueRole::Gradient.name(l), p.grad);
        g.set_output(&ValueRole::Update.name(l), p.update);
        g.set_output(&ValueRole::FirstMoment.name(l), p.m_out);
        g.set_output(&ValueRole::SecondMoment.name(l), p.v_out);
    }
    crate::ir::verify_if_debug(&g, "build_train_graph");
    Ok(TrainGraph {
        graph: g,
        params: b.params,
        micro_batches: opts.micro_batches,
        fwd_maps,
        cotangents,
        gathers: b.gathers,
        loss,
        step,
        mb_losses: losses,
        act_out,
        grad_in,
        grad_out,
    })
}
