//! SPMD partitioning: from a logical graph, a mesh and annotations, the per-rank program with
//! local shapes and explicit collectives.
//!
//! Pre: the graph verifies; annotations divide the tensors they annotate (checked here).
//! Post: the result verifies; each op's operands arrive in the layout its factor rule needs
//! (inserted by [`super::reshard`], memoised per value and layout); each collective carries a
//! [`Provenance`] saying which op's rule required it. A cross-entropy (or its gradient) whose
//! logits arrive split over one mesh axis along the vocabulary becomes Megatron's
//! vocabulary-parallel form: per-row stats of each shard, gathered (a reshard like any other),
//! then the loss, or the gradient of the rank's shard laid out like the logits.

use super::mesh::{AxisId, Mesh};
use super::reshard::reshard;
use super::rules::{rule, FactorRule, PartialRule};
use super::sharding::TensorSharding;
use super::ShardError;
use crate::ir::{Graph, Node, Op, ShardSpec, TensorType, ValueId, ValueRole};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// Layout constraints written by strategy presets (or a user): values and outputs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Annotations {
    /// Required layout of logical values (params, inputs, chosen intermediates).
    pub values: BTreeMap<ValueId, TensorSharding>,
    /// Required layout of named outputs (replicated when absent).
    pub outputs: BTreeMap<String, TensorSharding>,
    /// Why each value annotation was written (preset and role), for `explain`.
    pub why: BTreeMap<ValueId, String>,
}

impl Annotations {
    /// Sets the layout of `v`, with a reason.
    pub fn set(&mut self, v: ValueId, s: TensorSharding, why: impl Into<String>) {
        self.values.insert(v, s);
        self.why.insert(v, why.into());
    }
}

/// Why a collective (or local slice) exists.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// The logical value that was resharded.
    pub value: String,
    /// Its layout before.
    pub from: String,
    /// The layout required.
    pub to: String,
    /// Who required it: the consuming op and operand, an annotation, an output, a DDP bucket
    /// or a rewrite rule.
    pub required_by: ReshardReason,
}

/// Who required a reshard (typed; `Display` gives the sentence `explain` prints).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ReshardReason {
    /// Operand `index` of node `node` (op `op`) needs this layout.
    Operand {
        /// The consuming node's name.
        node: String,
        /// Its op's mnemonic.
        op: String,
        /// Which operand.
        index: usize,
    },
    /// The strategies annotated the value with this layout.
    Annotation {
        /// The annotated node's name.
        node: String,
        /// The preset and role that wrote the annotation.
        why: String,
    },
    /// A named output of the program is required in this layout.
    Output {
        /// The output's name.
        name: String,
    },
    /// A DDP bucket's all-reduce of the gradients in it.
    DdpBucket {
        /// Its index, in reduction order.
        bucket: usize,
        /// Its bytes.
        bytes: u64,
        /// The parameters whose gradients it holds.
        params: Vec<String>,
        /// The node after which every gradient in it is complete.
        ready_after: String,
    },
    /// A rewrite rule made the node.
    Rule {
        /// The rule's name.
        rule: String,
    },
}

impl ReshardReason {
    /// Maps the node names it holds through `f` (a layer's nodes replicated as another
    /// layer's).
    pub fn map_names(&mut self, f: impl Fn(&str) -> String) {
        let r = |s: &mut String| *s = f(s);
        match self {
            ReshardReason::Operand { node, .. } | ReshardReason::Annotation { node, .. } => r(node),
            ReshardReason::Output { name } => r(name),
            ReshardReason::DdpBucket {
                params,
                ready_after,
                ..
            } => {
                params.iter_mut().for_each(r);
                r(ready_after);
            }
            ReshardReason::Rule { .. } => {}
        }
    }
}

impl std::fmt::Display for ReshardReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReshardReason::Operand { node, op, index } => {
                write!(f, "operand {index} of `{node}` ({op})")
            }
            ReshardReason::Annotation { node, why } => write!(f, "annotation of `{node}` ({why})"),
            ReshardReason::Output { name } => write!(f, "output `{name}`"),
            ReshardReason::DdpBucket {
                bucket,
                bytes,
                params,
                ready_after,
            } => write!(
                f,
                "DDP bucket {bucket} ({bytes} bytes): gradients of {} ready after `{ready_after}`",
                params.join(", ")
            ),
            ReshardReason::Rule { rule } => write!(f, "rewrite rule `{rule}`"),
        }
    }
}

/// The SPMD program and its side tables (indexed by the new graph's value ids).
#[derive(Clone, Debug)]
pub struct ShardedGraph {
    /// Per-rank program: local shapes, collectives explicit.
    pub graph: Graph,
    /// Layout of each value.
    pub shardings: Vec<TensorSharding>,
    /// For collectives and local slices, why they exist.
    pub provenance: Vec<Option<Provenance>>,
    /// The mesh.
    pub mesh: Mesh,
}

/// A [`ShardedGraph`] being built node by node: the per-rank graph with each value's layout
/// and provenance alongside.
pub(crate) struct ShardedBuilder {
    /// The per-rank graph so far.
    pub(crate) graph: Graph,
    /// The layout of each value so far.
    pub(crate) shardings: Vec<TensorSharding>,
    /// The provenance of each value so far.
    pub(crate) provenance: Vec<Option<Provenance>>,
    /// What a failed append says was under way (`building`, `rebuilding`).
    doing: &'static str,
}

impl ShardedBuilder {
    /// An empty graph; a failed append's error starts with `doing`.
    pub(crate) fn new(doing: &'static str) -> ShardedBuilder {
        ShardedBuilder {
            graph: Graph::new(),
            shardings: Vec::new(),
            provenance: Vec::new(),
            doing,
        }
    }

    /// Appends `op` of `inputs` (typed `ty`, or inferred) named `name`, in layer `layer` and
    /// role `role`, laid out as `s`, with provenance `prov`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push(
        &mut self,
        op: Op,
        inputs: &[ValueId],
        ty: Option<TensorType>,
        name: String,
        (layer, role): (Option<u32>, ValueRole),
        s: TensorSharding,
        prov: Option<Provenance>,
    ) -> Result<ValueId, ShardError> {
        self.graph.current_layer = layer;
        self.graph.current_role = role;
        let v = self
            .graph
            .add_typed(op, inputs, ty, name.clone())
            .map_err(|e| ShardError::Internal(format!("{} `{name}`: {e}", self.doing)))?;
        self.shardings.push(s);
        self.provenance.push(prov);
        Ok(v)
    }

    /// The sharded graph on `mesh` (the graph left in no layer, in the forward role).
    pub(crate) fn finish(mut self, mesh: Mesh) -> ShardedGraph {
        self.graph.current_layer = None;
        self.graph.current_role = ValueRole::Forward;
        ShardedGraph {
            graph: self.graph,
            shardings: self.shardings,
            provenance: self.provenance,
            mesh,
        }
    }
}

struct Ctx<'a> {
    g: &'a Graph,
    mesh: &'a Mesh,
    out: ShardedBuilder,
    /// (logical value, layout) → value in `out`.
    versions: HashMap<(ValueId, TensorSharding), ValueId>,
    /// Current layout of each logical value (its primary version).
    cur: Vec<TensorSharding>,
    offsets: HashMap<(ValueId, AxisId), ValueId>,
    /// Vocabulary-parallel cross-entropy: (logits in `out`, seen through views of the same
    /// type; labels in `out`; axis) → the gathered per-row stats, shared by the loss and its
    /// gradient.
    ce_stats: HashMap<(ValueId, ValueId, AxisId), ValueId>,
}

fn shard_specs(mesh: &Mesh, s: &TensorSharding) -> Vec<ShardSpec> {
    let mut v = Vec::new();
    for (d, axes) in s.dims.iter().enumerate() {
        for &a in axes {
            v.push(ShardSpec {
                dim: d,
                axis: mesh.axis_name(a).to_string(),
                parts: mesh.axis_size(a),
            });
        }
    }
    v
}

fn local_type(mesh: &Mesh, ty: &TensorType, s: &TensorSharding) -> Option<TensorType> {
    let shape = s.local_shape(mesh, &ty.shape()).ok()?;
    Some(ty.with_shape_of(&shape))
}

impl Ctx<'_> {
    /// The version of logical `v` laid out as `to`, inserting the reshard if needed.
    fn version(
        &mut self,
        v: ValueId,
        to: &TensorSharding,
        required_by: &ReshardReason,
    ) -> Result<ValueId, ShardError> {
        let from = self.cur[v.index()].clone();
        if let Some(&x) = self.versions.get(&(v, to.clone())) {
            return Ok(x);
        }
        let x = *self
            .versions
            .get(&(v, from.clone()))
            .expect("invariant: current version exists");
        let (g, mesh) = (self.g, self.mesh);
        let type_err = |detail: &str| indivisible(g, v, detail, mesh, to);
        let name = &g.node(v).name;
        let steps = self.reshard_steps(x, &from, to, name, required_by, &type_err)?;
        let mut last = x;
        for (y, s) in steps {
            self.versions.insert((v, s), y);
            last = y;
        }
        Ok(last)
    }

    /// Lays `x`, a value of the program being built laid out as `from`, out as `to`: the
    /// collectives [`reshard`] gives, each tagged like `x`, named after `value` and carrying
    /// its provenance. Returns each step's value and layout, in order.
    fn reshard_steps(
        &mut self,
        mut x: ValueId,
        from: &TensorSharding,
        to: &TensorSharding,
        value: &str,
        required_by: &ReshardReason,
        type_err: &dyn Fn(&str) -> ShardError,
    ) -> Result<Vec<(ValueId, TensorSharding)>, ShardError> {
        let ops = reshard(self.mesh, from, to).ok_or_else(|| {
            ShardError::Internal(format!(
                "no reshard of `{value}` from {} to {}",
                from.display(self.mesh),
                to.display(self.mesh)
            ))
        })?;
        let mut s = from.clone();
        let tag = (self.out.graph.node(x).layer, self.out.graph.node(x).role);
        let mut steps = Vec::with_capacity(ops.len());
        for op in ops {
            s = super::reshard::apply_public(self.mesh, &s, &op);
            let prov = Provenance {
                value: value.to_string(),
                from: from.display(self.mesh),
                to: to.display(self.mesh),
                required_by: required_by.clone(),
            };
            let name = format!("{value}.{}", op.mnemonic());
            let ty = self.out.graph.ty(x).clone();
            let res = op
                .infer(&[&ty], None)
                .map_err(|e| type_err(&e.to_string()))?;
            x = self
                .out
                .push(op, &[x], Some(res), name, tag, s.clone(), Some(prov))?;
            steps.push((x, s.clone()));
        }
        Ok(steps)
    }

    /// Megatron's vocabulary-parallel cross-entropy: `node` (`CrossEntropy` or
    /// `CrossEntropyGrad`) on `inputs`, logits split over the vocabulary on mesh axis `a`
    /// and labels laid out like the logits' leading dims, computed without gathering the
    /// logits. Each rank reduces its shard to per-row stats (`CrossEntropyStats`), the stats
    /// of every shard are gathered over `a` (a reshard, like every collective), and the loss
    /// (`CrossEntropyFromStats`) or the gradient of the rank's shard
    /// (`CrossEntropyShardGrad`) follows from them. The result is laid out as `s`.
    fn vocab_parallel(
        &mut self,
        node: &Node,
        inputs: &[ValueId],
        a: AxisId,
        s: TensorSharding,
    ) -> Result<ValueId, ShardError> {
        let axis = self.mesh.axis_name(a).to_string();
        let tag = (node.layer, node.role);
        // The logits behind views of the same type (the backward pass reads the saved view
        // of the forward's logits): one set of stats for the loss and its gradient.
        let mut root = inputs[0];
        while let Some(&x) = self.out.graph.node(root).inputs.first().filter(|_| {
            matches!(self.out.graph.node(root).op, Op::Reshape)
                && self.out.graph.ty(self.out.graph.node(root).inputs[0]) == self.out.graph.ty(root)
        }) {
            root = x;
        }
        let key = (root, inputs[1], a);
        let (op, index) = match node.op {
            Op::CrossEntropyGrad { denom } => (
                Op::CrossEntropyShardGrad {
                    axis: axis.clone(),
                    denom,
                },
                2,
            ),
            Op::CrossEntropy { denom } => (Op::CrossEntropyFromStats { denom }, 0),
            _ => {
                return Err(ShardError::Internal(format!(
                    "`{}`: {} is not a cross-entropy",
                    node.name,
                    node.op.mnemonic()
                )))
            }
        };
        let gathered = match self.ce_stats.get(&key) {
            Some(&gathered) => gathered,
            None => {
                let gathered = self.gathered_ce_stats(node, inputs, a, &op, index)?;
                self.ce_stats.insert(key, gathered);
                gathered
            }
        };
        let operands = match op {
            Op::CrossEntropyShardGrad { .. } => vec![inputs[0], inputs[1], gathered],
            _ => vec![gathered, inputs[1]],
        };
        self.out
            .push(op, &operands, None, node.name.clone(), tag, s, None)
    }

    /// The per-row stats of this rank's vocabulary shard of `inputs[0]` (labels
    /// `inputs[1]`), gathered over mesh axis `a` for operand `index` of `op`.
    fn gathered_ce_stats(
        &mut self,
        node: &Node,
        inputs: &[ValueId],
        a: AxisId,
        op: &Op,
        index: usize,
    ) -> Result<ValueId, ShardError> {
        let tag = (node.layer, node.role);
        let split = TensorSharding {
            dims: self.out.shardings[inputs[0].index()].dims.clone(),
            partial: Vec::new(),
        };
        let stats_op = Op::CrossEntropyStats {
            axis: self.mesh.axis_name(a).to_string(),
            parts: self.mesh.axis_size(a),
        };
        let stats_name = format!("{}.stats", node.name);
        let local = &[inputs[0], inputs[1]];
        let stats = self.out.push(
            stats_op,
            local,
            None,
            stats_name.clone(),
            tag,
            split.clone(),
            None,
        )?;
        let mut whole = split.clone();
        if let Some(last) = whole.dims.last_mut() {
            last.clear();
        }
        let why = ReshardReason::Operand {
            node: node.name.clone(),
            op: op.mnemonic().to_string(),
            index,
        };
        let type_err =
            |detail: &str| ShardError::Internal(format!("gathering `{stats_name}`: {detail}"));
        let steps = self.reshard_steps(stats, &split, &whole, &stats_name, &why, &type_err)?;
        Ok(steps.last().map_or(stats, |&(x, _)| x))
    }
}

fn indivisible(g: &Graph, v: ValueId, detail: &str, mesh: &Mesh, s: &TensorSharding) -> ShardError {
    let node = g.node(v);
    ShardError::Internal(format!(
        "`{}` {} cannot be laid out as {}: {detail}",
        node.name,
        node.ty,
        s.display(mesh)
    ))
}

/// Checks that `s` divides `v`'s type; the error names the tensor, the dim role and sizes.
fn check_divides(g: &Graph, mesh: &Mesh, v: ValueId, s: &TensorSharding) -> Result<(), ShardError> {
    let ty = &g.node(v).ty;
    if s.dims.len() != ty.rank() {
        return Err(ShardError::Internal(format!(
            "annotation of `{}` has {} dims, the tensor {}",
            g.node(v).name,
            s.dims.len(),
            ty.rank()
        )));
    }
    if let Err((d, size, parts)) = s.local_shape(mesh, &ty.shape()) {
        let axes: Vec<String> = s.dims[d]
            .iter()
            .map(|&a| format!("{}={}", mesh.axis_name(a), mesh.axis_size(a)))
            .collect();
        return Err(ShardError::Indivisible {
            tensor: g.node(v).name.clone(),
            dim: ty.dims[d].role.name().to_string(),
            size,
            axes: axes.join("*"),
            parts,
        });
    }
    Ok(())
}

/// Factor → axes assignment for one op: the result's annotation first, then operands in the
/// rule's priority order; a factor keeps the first layout offered that is consistent
/// (unused axes — the major part of a layout before an axis already used —, not fixed,
/// divides every tensor that has the factor).
fn assign_factors(
    mesh: &Mesh,
    r: &FactorRule,
    ins: &[&TensorType],
    out: &TensorType,
    offers: &[(Vec<Option<usize>>, TensorSharding)],
    single_axis: &[usize],
) -> (Vec<Vec<AxisId>>, Vec<AxisId>) {
    let mut fa: Vec<Vec<AxisId>> = vec![Vec::new(); r.factors];
    let mut used: Vec<AxisId> = Vec::new();
    // Sizes of the dims of each factor, over every tensor.
    let mut sizes: Vec<Vec<usize>> = vec![Vec::new(); r.factors];
    for (fm, t) in r
        .operands
        .iter()
        .zip(ins)
        .chain(std::iter::once((&r.result, &out)))
    {
        for (d, f) in fm.iter().enumerate() {
            if let Some(f) = f {
                sizes[*f].push(t.dim(d));
            }
        }
    }
    for (fm, s) in offers {
        for (d, axes) in s.dims.iter().enumerate() {
            let Some(Some(f)) = fm.get(d).copied() else {
                continue;
            };
            if axes.is_empty() || r.fixed.contains(&f) || !fa[f].is_empty() {
                continue;
            }
            // Axes another factor took already: the layout's major part before the first of
            // them is still on offer (`[dp, ep]` with `ep` taken keeps `dp`: the batch stays
            // split over the data replicas while the experts take `ep`).
            let free = axes.iter().take_while(|a| !used.contains(a)).count();
            let axes = &axes[..free];
            if axes.is_empty() {
                continue;
            }
            if single_axis.contains(&f) && axes.len() != 1 {
                continue;
            }
            let p: usize = axes.iter().map(|&a| mesh.axis_size(a)).product();
            if sizes[f].iter().any(|&n| n % p != 0) {
                continue;
            }
            fa[f] = axes.to_vec();
            used.extend(axes);
        }
    }
    (fa, used)
}

fn layout(fm: &[Option<usize>], fa: &[Vec<AxisId>], partial: Vec<AxisId>) -> TensorSharding {
    TensorSharding {
        dims: fm
            .iter()
            .map(|f| f.map(|f| fa[f].clone()).unwrap_or_default())
            .collect(),
        partial,
    }
}

/// The vocabulary factor of a `CrossEntropy` or `CrossEntropyGrad` whose logits (laid out as
/// `logits`) are split over exactly one mesh axis, of more than one rank, along the
/// vocabulary; `None` otherwise.
fn vocab_factor(mesh: &Mesh, op: &Op, r: &FactorRule, logits: &TensorSharding) -> Option<usize> {
    let ce = matches!(op, Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. });
    match logits.dims.last().map(Vec::as_slice) {
        Some(&[a]) if ce && mesh.axis_size(a) > 1 => r.operands.first()?.last().copied().flatten(),
        _ => None,
    }
}

/// A parameter: a `Param`, a training graph's [`ValueRole::Parameter`] input, or a view of
/// one.
fn is_parameter(g: &Graph, mut v: ValueId) -> bool {
    loop {
        match &g.node(v).op {
            Op::Param(_) => return true,
            Op::Input { .. } => return g.node(v).role == ValueRole::Parameter,
            Op::Reshape => v = g.node(v).inputs[0],
            _ => return false,
        }
    }
}

/// Partitions `g` over `mesh` under `ann`.
pub fn partition(g: &Graph, mesh: &Mesh, ann: &Annotations) -> Result<ShardedGraph, ShardError> {
    for (&v, s) in &ann.values {
        check_divides(g, mesh, v, s)?;
    }
    let mut cx = Ctx {
        g,
        mesh,
        out: ShardedBuilder::new("building"),
        versions: HashMap::new(),
        cur: Vec::with_capacity(g.len()),
        offsets: HashMap::new(),
        ce_stats: HashMap::new(),
    };
    for v in g.ids() {
        let node = g.node(v);
        let annotated = ann.values.get(&v).cloned();
        let ins: Vec<&TensorType> = node.inputs.iter().map(|&i| g.ty(i)).collect();
        let mut r = rule(&node.op, &ins, &node.ty).ok_or_else(|| {
            ShardError::Internal(format!(
                "`{}`: {} in a logical graph",
                node.name,
                node.op.mnemonic()
            ))
        })?;
        if node.inputs.is_empty() {
            let s = annotated.unwrap_or_else(|| TensorSharding::replicated(node.ty.rank()));
            let ty =
                local_type(mesh, &node.ty, &s).ok_or_else(|| indivisible(g, v, "", mesh, &s))?;
            let op = match &node.op {
                Op::Param(src) => {
                    let mut src = src.clone();
                    src.shards = shard_specs(mesh, &s);
                    Op::Param(src)
                }
                Op::Input { name, .. } => Op::Input {
                    name: name.clone(),
                    shards: shard_specs(mesh, &s),
                },
                other => other.clone(),
            };
            let x = cx.out.push(
                op,
                &[],
                Some(ty),
                node.name.clone(),
                (node.layer, node.role),
                s.clone(),
                None,
            )?;
            cx.versions.insert((v, s.clone()), x);
            cx.cur.push(s);
            continue;
        }

        // Offers: parameters' layouts (they are fixed), the result's annotation, then the
        // other operands by the rule's priority. In a training graph parameters are inputs
        // (`param.<label>`), read directly or through a view (ZeRO-3's gathers).
        let is_param = |i: usize| is_parameter(g, node.inputs[i]);
        let mut offers = Vec::new();
        let operand_offer = |i: usize| {
            (
                r.operands[i].clone(),
                cx.cur[node.inputs[i].index()].clone(),
            )
        };
        for &i in r.priority.iter().filter(|&&i| is_param(i)) {
            offers.push(operand_offer(i));
        }
        if let Some(a) = &annotated {
            offers.push((r.result.clone(), a.clone()));
        }
        for &i in r.priority.iter().filter(|&&i| !is_param(i)) {
            offers.push(operand_offer(i));
        }
        let single: Vec<usize> = match node.op {
            Op::Embedding => r.operands[0][..1].iter().flatten().copied().collect(),
            _ => vec![],
        };
        // A cross-entropy whose logits arrive split over one axis along the vocabulary keeps
        // them split (vocabulary-parallel); anything else gathers the vocabulary.
        let vocab = vocab_factor(mesh, &node.op, &r, &cx.cur[node.inputs[0].index()]);
        if let Some(f) = vocab {
            r.fixed.retain(|&x| x != f);
        }
        let (mut fa, mut used) = assign_factors(mesh, &r, &ins, &node.ty, &offers, &single);
        let vocab_axis = vocab.and_then(|f| match fa[f][..] {
            [a] => Some((f, a)),
            _ => None,
        });
        if let (Some(f), None) = (vocab, vocab_axis) {
            r.fixed.push(f);
            (fa, used) = assign_factors(mesh, &r, &ins, &node.ty, &offers, &single);
        }

        // Partial operands the op may keep.
        let op_partial: Vec<Vec<AxisId>> = node
            .inputs
            .iter()
            .map(|&i| cx.cur[i.index()].partial.clone())
            .collect();
        let clean = |p: &Vec<AxisId>| !p.is_empty() && p.iter().all(|a| !used.contains(a));
        let mut keep: Vec<Vec<AxisId>> = vec![Vec::new(); node.inputs.len()];
        match &r.partial {
            PartialRule::None => {}
            PartialRule::AllSame => {
                let mut p0 = op_partial[0].clone();
                p0.sort();
                let same = op_partial.iter().all(|p| {
                    let mut q = p.clone();
                    q.sort();
                    q == p0
                });
                if same && clean(&op_partial[0]) {
                    keep = op_partial.clone();
                }
            }
            PartialRule::OneOf(list) => {
                if let Some(&i) = r
                    .priority
                    .iter()
                    .filter(|i| list.contains(i))
                    .find(|&&i| clean(&op_partial[i]))
                {
                    keep[i] = op_partial[i].clone();
                }
            }
        }

        // Operands in the required layouts.
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for (i, &x) in node.inputs.iter().enumerate() {
            let req = layout(&r.operands[i], &fa, keep[i].clone());
            let why = ReshardReason::Operand {
                node: node.name.clone(),
                op: node.op.mnemonic().to_string(),
                index: i,
            };
            inputs.push(cx.version(x, &req, &why)?);
        }
        // Vocabulary-parallel lookup: ids made local to this rank's rows.
        if let Op::Embedding = node.op {
            if let Some(f) = r.operands[0][0] {
                if let [a] = fa[f][..] {
                    let key = (node.inputs[1], a);
                    let rows = cx.out.graph.ty(inputs[0]).dim(0);
                    let ids = match cx.offsets.get(&key) {
                        Some(&x) => x,
                        None => {
                            let s = cx.out.shardings[inputs[1].index()].clone();
                            let op = Op::RankOffset {
                                axis: mesh.axis_name(a).to_string(),
                                stride: rows,
                            };
                            let id = g.node(node.inputs[1]);
                            let name = format!("{}.rank_offset", id.name);
                            let tag = (node.layer, id.role);
                            let x = cx.out.push(op, &[inputs[1]], None, name, tag, s, None)?;
                            cx.offsets.insert(key, x);
                            x
                        }
                    };
                    inputs[1] = ids;
                }
            }
        }

        // The result: dims from factors; partial from kept partials and contracted factors.
        let mut partial: Vec<AxisId> = keep
            .iter()
            .find(|p| !p.is_empty())
            .cloned()
            .unwrap_or_default();
        let in_result: Vec<usize> = r.result.iter().flatten().copied().collect();
        let mut contracted: Vec<usize> = r
            .operands
            .iter()
            .flatten()
            .flatten()
            .copied()
            .filter(|f| !in_result.contains(f))
            .collect();
        contracted.sort();
        contracted.dedup();
        for f in contracted {
            // The vocabulary-parallel loss sums over the vocabulary itself.
            if vocab_axis.is_none_or(|(vf, _)| vf != f) {
                partial.extend(&fa[f]);
            }
        }
        let s = layout(&r.result, &fa, partial);
        let declared = if node.op.needs_declared_type() {
            Some(local_type(mesh, &node.ty, &s).ok_or_else(|| indivisible(g, v, "", mesh, &s))?)
        } else {
            None
        };
        let x = match vocab_axis {
            Some((_, a)) => cx.vocab_parallel(node, &inputs, a, s.clone())?,
            None => cx.out.push(
                node.op.clone(),
                &inputs,
                declared,
                node.name.clone(),
                (node.layer, node.role),
                s.clone(),
                None,
            )?,
        };
        cx.versions.insert((v, s.clone()), x);
        cx.cur.push(s.clone());
        if let Some(a) = annotated {
            if a != s {
                let why = ann
                    .why
                    .get(&v)
                    .cloned()
                    .unwrap_or_else(|| "annotation".into());
                let why = ReshardReason::Annotation {
                    node: node.name.clone(),
                    why,
                };
                let y = cx.version(v, &a, &why)?;
                cx.cur[v.index()] = a.clone();
                cx.versions.insert((v, a), y);
            }
        }
    }
    for (name, v) in &g.outputs {
        let want = ann
            .outputs
            .get(name)
            .cloned()
            .unwrap_or_else(|| TensorSharding::replicated(g.ty(*v).rank()));
        let why = ReshardReason::Output { name: name.clone() };
        let x = cx.version(*v, &want, &why)?;
        cx.out.graph.set_output(name, x);
    }
    crate::ir::verify_if_debug(&cx.out.graph, "partition");
    Ok(cx.out.finish(mesh.clone()))
}
