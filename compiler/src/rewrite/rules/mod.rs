//! Rules as data: one directional identity per rule, each with a kebab-case name, a group
//! (the name `--rewrite` also accepts) and its identity as text. The policy is in
//! `README.md` next to this file.
//!
//! A rule is a [`RuleImpl`]: `find` lists the matches rooted at one e-class (a match is a
//! short list of ids: operand classes, plus small integers such as a dim or an interned op id
//! encoded as ids), `apply` builds the right-hand side and returns its class, which the runner
//! unions with the matched class. An adapter turns a `RuleImpl` into an `egg` searcher and
//! applier, so rules run under egg's `Runner` (its limits, scheduler and stop reasons).
//!
//! Every node a rule adds goes through `add`, which type-checks it with the IR's own type
//! rule first (a rule never adds an ill-typed node) and logs which rule created it (the
//! provenance the report gives for each collective).

/// The descriptive methods of a [`RuleImpl`] whose name, group and identity are fixed text:
/// `name`, `group` and `identity`, and `in_all` where the rule gives `in_all: false`.
macro_rules! rule_header {
    (
        name: $name:literal,
        group: $group:literal,
        identity: $identity:literal,
        $(in_all: $in_all:literal,)?
    ) => {
        fn name(&self) -> &'static str {
            $name
        }
        fn group(&self) -> &'static str {
            $group
        }
        fn identity(&self) -> &'static str {
            $identity
        }
        $(
            fn in_all(&self) -> bool {
                $in_all
            }
        )?
    };
}

pub(crate) mod collectives;
pub(crate) mod fusion;
pub(crate) mod layout;
pub(crate) mod optimizer;
pub(crate) mod overlap;
pub(crate) mod sequence_parallel;

use super::analysis::{SpmdAnalysis, SpmdEGraph};
use super::lang::{ENode, OpId};
use super::RewriteError;
use crate::ir::{Op, TensorType};
use egg::{Applier, Id, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Symbol, Var};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// One rewrite rule.
pub trait RuleImpl: Send + Sync + 'static {
    /// Kebab-case name (`allreduce-split`).
    fn name(&self) -> &'static str;
    /// The group `--rewrite` selects it by (the rule families).
    fn group(&self) -> &'static str;
    /// The identity, as text (`AllReduce(x) ⇒ AllGather(ReduceScatter(x, d), d)`).
    fn identity(&self) -> &'static str;
    /// True for deliberately wrong rules that only tests select (by name, never by `all`).
    fn test_only(&self) -> bool {
        false
    }
    /// False for rules `all` leaves out: the `layout` rules, which change which weights a
    /// rank holds (selected by name or group).
    fn in_all(&self) -> bool {
        true
    }
    /// Appends to `out` every match rooted at class `class`.
    fn find(&self, eg: &SpmdEGraph, class: Id, out: &mut Vec<Vec<Id>>);
    /// Builds the right-hand side of match `m` at `class`; `None` when it does not apply.
    fn apply(&self, eg: &mut SpmdEGraph, class: Id, m: &[Id]) -> Option<Id>;
}

/// A rule's description, for listings and the README test.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleInfo {
    /// Name.
    pub name: String,
    /// Group.
    pub group: String,
    /// Identity.
    pub identity: String,
    /// Test-only (deliberately broken).
    pub test_only: bool,
}

/// Every rule, in the order they run (test-only ones last).
pub fn registry() -> Vec<Arc<dyn RuleImpl>> {
    let mut v: Vec<Arc<dyn RuleImpl>> = Vec::new();
    v.extend(collectives::rules());
    v.extend(sequence_parallel::rules());
    v.extend(overlap::rules());
    v.extend(fusion::rules());
    v.extend(optimizer::rules());
    v.extend(layout::rules());
    v.extend(sequence_parallel::broken_rules());
    v
}

/// Descriptions of every rule.
pub fn list() -> Vec<RuleInfo> {
    registry()
        .iter()
        .map(|r| RuleInfo {
            name: r.name().into(),
            group: r.group().into(),
            identity: r.identity().into(),
            test_only: r.test_only(),
        })
        .collect()
}

/// The rule groups that turn Megatron tensor parallelism into sequence parallelism
/// (`--rewrite sequence-parallel` selects them).
pub const SEQUENCE_PARALLEL: [&str; 5] = [
    "allreduce-split",
    "gather-sink",
    "scatter-hoist",
    "slice-of-gather",
    "gather-of-slice",
];

/// The rule groups `shardc search --space layers` runs on a `replicated` program: each
/// matmul's layout (`layout`) and the sequence-parallel groups that move its collectives.
pub const LAYER_SEARCH: [&str; 6] = [
    "layout",
    "allreduce-split",
    "gather-sink",
    "scatter-hoist",
    "slice-of-gather",
    "gather-of-slice",
];

/// Which rules a compile runs: `none`, `all`, or named rules and groups.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RuleSelection {
    /// No rewriting (the SPMD program as partitioned).
    #[default]
    None,
    /// Every rule (test-only ones excluded).
    All,
    /// Rules and groups by name.
    Named(Vec<String>),
}

impl RuleSelection {
    /// The rules selected, in registry order.
    pub fn resolve(&self) -> Result<Vec<Arc<dyn RuleImpl>>, RewriteError> {
        let reg = registry();
        match self {
            RuleSelection::None => Ok(Vec::new()),
            RuleSelection::All => Ok(reg
                .into_iter()
                .filter(|r| !r.test_only() && r.in_all())
                .collect()),
            RuleSelection::Named(given) => {
                let mut names: Vec<&str> = Vec::new();
                for n in given {
                    if n == "sequence-parallel" {
                        names.extend(SEQUENCE_PARALLEL);
                    } else {
                        names.push(n);
                    }
                }
                for &n in &names {
                    let known = reg.iter().any(|r| r.name() == n || r.group() == n);
                    if !known {
                        let mut valid: Vec<&str> = vec!["sequence-parallel"];
                        for r in reg.iter().filter(|r| !r.test_only()) {
                            for s in [r.group(), r.name()] {
                                if !valid.contains(&s) {
                                    valid.push(s);
                                }
                            }
                        }
                        return Err(RewriteError::UnknownRule {
                            name: n.to_string(),
                            valid: valid.join(", "),
                        });
                    }
                }
                Ok(reg
                    .into_iter()
                    .filter(|r| {
                        names
                            .iter()
                            .any(|&n| r.name() == n || (r.group() == n && !r.test_only()))
                    })
                    .collect())
            }
        }
    }
}

impl std::str::FromStr for RuleSelection {
    type Err = RewriteError;
    /// `none`, `all`, or a comma-separated list of rule and group names (and
    /// `sequence-parallel`, the groups in [`SEQUENCE_PARALLEL`]).
    fn from_str(s: &str) -> Result<RuleSelection, RewriteError> {
        let sel = match s.trim() {
            "none" | "" => RuleSelection::None,
            "all" => RuleSelection::All,
            "sequence-parallel" => {
                RuleSelection::Named(SEQUENCE_PARALLEL.iter().map(|s| s.to_string()).collect())
            }
            list => RuleSelection::Named(
                list.split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(String::from)
                    .collect(),
            ),
        };
        sel.resolve()?;
        Ok(sel)
    }
}

impl fmt::Display for RuleSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleSelection::None => f.write_str("none"),
            RuleSelection::All => f.write_str("all"),
            RuleSelection::Named(v) => f.write_str(&v.join(",")),
        }
    }
}

/// Turns a [`RuleImpl`] into an egg `Rewrite`.
pub(crate) fn to_rewrite(r: &Arc<dyn RuleImpl>) -> Rewrite<ENode, SpmdAnalysis> {
    let a = Adapter(Arc::clone(r));
    Rewrite::new(r.name(), a.clone(), a).expect("invariant: adapters bind no pattern variables")
}

/// Searcher and applier of one rule. A match travels in a `Subst` as ids under the numbered
/// variables `?#0..`, its length under [`LEN`].
#[derive(Clone)]
pub(crate) struct Adapter(Arc<dyn RuleImpl>);

/// The variable holding a match's length.
const LEN: u32 = 1 << 20;

impl Searcher<ENode, SpmdAnalysis> for Adapter {
    fn search_eclass_with_limit(
        &self,
        eg: &SpmdEGraph,
        eclass: Id,
        limit: usize,
    ) -> Option<SearchMatches<'_, ENode>> {
        let mut found = Vec::new();
        self.0.find(eg, eclass, &mut found);
        found.truncate(limit);
        if found.is_empty() {
            return None;
        }
        let substs = found
            .into_iter()
            .map(|m| {
                let mut s = Subst::with_capacity(m.len() + 1);
                s.insert(Var::from(LEN), Id::from(m.len()));
                for (i, id) in m.into_iter().enumerate() {
                    s.insert(Var::from(i as u32), id);
                }
                s
            })
            .collect();
        Some(SearchMatches {
            eclass,
            substs,
            ast: None,
        })
    }

    fn vars(&self) -> Vec<Var> {
        Vec::new()
    }
}

impl Applier<ENode, SpmdAnalysis> for Adapter {
    fn apply_one(
        &self,
        eg: &mut SpmdEGraph,
        eclass: Id,
        subst: &Subst,
        _ast: Option<&PatternAst<ENode>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let n = subst.get(Var::from(LEN)).map_or(0, |&l| usize::from(l));
        let m: Vec<Id> = (0..n)
            .filter_map(|i| subst.get(Var::from(i as u32)).copied())
            .collect();
        let class = eg.find(eclass);
        match self.0.apply(eg, class, &m) {
            Some(new) if eg.union(class, new) => vec![class],
            _ => Vec::new(),
        }
    }
}

// ---- helpers shared by the rule files ----

/// The op of an e-node.
pub(crate) fn op_of<'a>(eg: &'a SpmdEGraph, n: &ENode) -> &'a Op {
    &eg.analysis.ops.get(n.op).op
}

/// The e-nodes of class `c` whose op satisfies `pred`, with their ops.
pub(crate) fn nodes_where<'a>(
    eg: &'a SpmdEGraph,
    c: Id,
    pred: impl Fn(&Op) -> bool + 'a,
) -> impl Iterator<Item = (&'a ENode, &'a Op)> + 'a {
    eg[c].nodes.iter().filter_map(move |n| {
        let op = op_of(eg, n);
        pred(op).then_some((n, op))
    })
}

/// The local type of class `c`.
pub(crate) fn ty(eg: &SpmdEGraph, c: Id) -> &TensorType {
    &eg[c].data.ty
}

/// True when class `c` is replicated over mesh axis `axis`.
pub(crate) fn rep_over(eg: &SpmdEGraph, c: Id, axis: &str) -> bool {
    eg.analysis
        .axis(axis)
        .is_some_and(|a| eg[c].data.rep.has(a))
}

/// The size of mesh axis `axis`.
pub(crate) fn axis_size(eg: &SpmdEGraph, axis: &str) -> Option<usize> {
    eg.analysis
        .axis(axis)
        .map(|a| eg.analysis.mesh.axis_size(a))
}

/// An interned op id as a match entry, and back.
pub(crate) fn op_id(id: OpId) -> Id {
    Id::from(id.0 as usize)
}
/// See [`op_id`].
pub(crate) fn op_at(eg: &SpmdEGraph, m: Id) -> Op {
    eg.analysis.ops.get(OpId(usize::from(m) as u32)).op.clone()
}
/// A small integer as a match entry (read back with `usize::from`).
pub(crate) fn int(n: usize) -> Id {
    Id::from(n)
}

/// Adds `op(children)` if it type-checks, logging `rule` as its creator when the e-node is
/// new. Returns its class.
pub(crate) fn add(
    eg: &mut SpmdEGraph,
    rule: &'static str,
    op: Op,
    children: Vec<Id>,
) -> Option<Id> {
    let children: Vec<Id> = children.into_iter().map(|c| eg.find(c)).collect();
    {
        let tys: Vec<&TensorType> = children.iter().map(|&c| &eg[c].data.ty).collect();
        op.infer(&tys, None).ok()?;
    }
    let id = eg.analysis.ops.op(op);
    let node = ENode::new(id, children);
    if let Some(c) = eg.lookup(node.clone()) {
        return Some(c);
    }
    eg.analysis.origins.push((node.clone(), rule));
    Some(eg.add(node))
}

/// `outer(f(operands))` for the ops interned at match entries `f` and `outer` (a gather or
/// reduction moved past `f`); the new `f` node takes the name, layer and role of `class`.
pub(crate) fn sink(
    eg: &mut SpmdEGraph,
    rule: &'static str,
    class: Id,
    f: Id,
    outer: Id,
    operands: Vec<Id>,
) -> Option<Id> {
    let (f, outer) = (op_at(eg, f), op_at(eg, outer));
    let inner = add_like(eg, rule, f, operands, class)?;
    add(eg, rule, outer, vec![inner])
}

/// The matches `[gather, x]` of `Reshape(AllGather_a,d(x))` at `class` whose reshape
/// `moves(from, to, d, |a|)` accepts (`from` the gathered type, `to` the reshape's).
pub(crate) fn reshape_gathers(
    eg: &SpmdEGraph,
    class: Id,
    out: &mut Vec<Vec<Id>>,
    moves: impl Fn(&TensorType, &TensorType, usize, usize) -> bool,
) {
    let to = ty(eg, class);
    for (n, _) in nodes_where(eg, class, |o| matches!(o, Op::Reshape)) {
        let from = ty(eg, n.children[0]);
        for (g, gop) in nodes_where(eg, n.children[0], |o| matches!(o, Op::AllGather { .. })) {
            let Op::AllGather { dim, parts, .. } = gop else {
                continue;
            };
            if moves(from, to, *dim, *parts) {
                out.push(vec![op_id(g.op), g.children[0]]);
            }
        }
    }
}

/// `AllGather_a,d(Reshape'(x))` for a match of [`reshape_gathers`]: the reshape to `class`'s
/// type with dim `d` divided by `|a|` (`None` where it does not divide).
pub(crate) fn sink_reshape(
    eg: &mut SpmdEGraph,
    rule: &'static str,
    class: Id,
    m: &[Id],
) -> Option<Id> {
    let ag = op_at(eg, m[0]);
    let Op::AllGather { dim, parts, .. } = ag else {
        return None;
    };
    let local = ty(eg, class).part(dim, parts)?;
    let inner = add_declared(eg, rule, Op::Reshape, local, vec![m[1]], class)?;
    add(eg, rule, ag, vec![inner])
}

/// As [`add`]; a new class takes the name, layer and role of class `like` (the value it computes
/// a form of).
pub(crate) fn add_like(
    eg: &mut SpmdEGraph,
    rule: &'static str,
    op: Op,
    children: Vec<Id>,
    like: Id,
) -> Option<Id> {
    let before = eg.number_of_classes();
    let c = add(eg, rule, op, children)?;
    if eg.number_of_classes() > before {
        take_meta(eg, c, like);
    }
    Some(c)
}

/// Gives the new class `c` the name, layer, role and derivation of class `like`.
fn take_meta(eg: &mut SpmdEGraph, c: Id, like: Id) {
    let meta = eg[like].data.meta.clone();
    let m = &mut eg[c].data.meta;
    m.name = meta.name;
    m.layer = meta.layer;
    m.role = meta.role;
    m.derived = meta.derived;
}

/// As [`add_like`] for an op whose type is declared (`Reshape`): the node is interned with
/// `ty` and type-checked against it.
pub(crate) fn add_declared(
    eg: &mut SpmdEGraph,
    rule: &'static str,
    op: Op,
    ty: TensorType,
    children: Vec<Id>,
    like: Id,
) -> Option<Id> {
    let key = super::lang::OpKey {
        op,
        declared: Some(ty),
        leaf: None,
    };
    add_key(eg, rule, key, children, like)
}

/// As [`add_declared`] for a whole interned key (a leaf keeps its original node's index).
pub(crate) fn add_key(
    eg: &mut SpmdEGraph,
    rule: &'static str,
    key: super::lang::OpKey,
    children: Vec<Id>,
    like: Id,
) -> Option<Id> {
    let children: Vec<Id> = children.into_iter().map(|c| eg.find(c)).collect();
    {
        let tys: Vec<&TensorType> = children.iter().map(|&c| &eg[c].data.ty).collect();
        key.op.infer(&tys, key.declared.as_ref()).ok()?;
    }
    let id = eg.analysis.ops.intern(key);
    let node = ENode::new(id, children);
    if let Some(c) = eg.lookup(node.clone()) {
        return Some(c);
    }
    eg.analysis.origins.push((node.clone(), rule));
    let c = eg.add(node);
    take_meta(eg, c, like);
    Some(c)
}
