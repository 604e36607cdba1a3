//! The rewriter: the SPMD program in an `egg` e-graph, named rules saturated under explicit
//! limits, and the cheapest program extracted by a cost model (DESIGN §5).
//!
//! An e-class is "the same local tensor on every rank", so its local type, the axes it is
//! replicated over, its layout and its per-token dims are class invariants (the `analysis` module);
//! the choice between layouts is made by which e-nodes (collectives, slices) the extractor
//! picks. The pass, in order:
//!
//! 1. Select rules ([`RuleSelection`]); `none` returns the program unchanged.
//! 2. Repeated layers: when at least four layer blocks are identical, rewrite a window of
//!    three layers instead of the program (the `dedup` module for forward programs, a chain of
//!    blocks; the `window` module for training steps, whose backward blocks read the next
//!    layer's), so rewriting time does not grow with depth.
//! 3. Load the program into an e-graph and run the rules under [`Limits`] (iterations and
//!    nodes, never time: the result is the same on every machine).
//! 4. Extract with the greedy DAG extractor under the [`CostModel`] (per-rank time from a
//!    roofline and ring alpha-beta model, plus a weighted activation-memory term).
//! 5. Convert back to a graph (node for node the input when no rule fired), replicate the
//!    template layer when a window was used, and report ([`RewriteReport`]).
//!
//! Pre: the program verifies. Post: the result verifies and computes, on every rank, the same
//! outputs as the input (up to the order of floating-point sums); the same input and options
//! give the same result, byte for byte.

pub(crate) mod analysis;
mod canon;
mod convert;
pub mod cost;
mod dedup;
mod extract;
pub(crate) mod lang;
mod report;
pub mod rules;
mod window;

pub use canon::{canonical, canonical_text};
pub use cost::{Bytes, CostModel, DeviceProfile, LinkProfile, Micros, NodeCost};
pub use report::{
    Alternative, CollectiveChoice, LayerPlanning, ProgramCost, RewriteReport, StateLayoutChoice,
    Timing,
};
pub use rules::{RuleInfo, RuleSelection};

use crate::ir::{Graph, TensorType};
use crate::shard::{Mesh, ShardedGraph};
use analysis::{SpmdAnalysis, SpmdEGraph};
use convert::{Emitted, NodeNote};
use extract::NodeCostFn;
use lang::ENode;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Saturation limits. Never a time limit: a result must not depend on the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Iterations of the rule set.
    pub iters: usize,
    /// E-nodes (checked between rule applications; one application can overshoot).
    pub nodes: usize,
}

/// Default iteration limit.
pub const DEFAULT_ITER_LIMIT: usize = 32;
/// Default e-node limit.
pub const DEFAULT_NODE_LIMIT: usize = 200_000;

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            iters: DEFAULT_ITER_LIMIT,
            nodes: DEFAULT_NODE_LIMIT,
        }
    }
}

/// What the extractor minimises.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Objective {
    /// The cost model.
    #[default]
    Model,
    /// Testing only: pseudo-random node costs from a seed, nodes made by rules usually
    /// cheaper, so property tests run arbitrary (mostly rewritten) programs of the e-graph.
    Shuffle(u64),
}

/// Options of the rewrite pass.
#[derive(Clone, Debug, PartialEq)]
pub struct RewriteOptions {
    /// Which rules run.
    pub rules: RuleSelection,
    /// Saturation limits.
    pub limits: Limits,
    /// The cost model.
    pub cost: CostModel,
    /// Plan repeated layers once (a window of three layers, replicated).
    pub dedup: bool,
    /// The extraction objective.
    pub objective: Objective,
}

impl Default for RewriteOptions {
    fn default() -> RewriteOptions {
        RewriteOptions {
            rules: RuleSelection::None,
            limits: Limits::default(),
            cost: CostModel::default(),
            dedup: true,
            objective: Objective::Model,
        }
    }
}

impl RewriteOptions {
    /// Default options with `rules` selected.
    pub fn with_rules(rules: RuleSelection) -> RewriteOptions {
        RewriteOptions {
            rules,
            ..RewriteOptions::default()
        }
    }
}

/// A rewrite that could not run.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RewriteError {
    /// A rule or group name is not known.
    #[error("unknown rewrite rule `{name}`; valid: none, all, {valid}")]
    UnknownRule {
        /// The name given.
        name: String,
        /// Valid rule and group names.
        valid: String,
    },
    /// A rewriter invariant failed (a bug).
    #[error("rewrite internal error: {0}")]
    Internal(String),
}

/// The rewritten program and its report.
#[derive(Clone, Debug)]
pub struct Rewritten {
    /// The program.
    pub sharded: ShardedGraph,
    /// What the pass did.
    pub report: RewriteReport,
}

/// One saturation and extraction.
struct Run {
    emitted: Emitted,
    fired: BTreeMap<String, usize>,
    stop_reason: String,
    iterations: usize,
    nodes: usize,
    classes: usize,
    saturate: Duration,
    extract: Duration,
}

/// Node costs from the cost model.
struct ModelCost<'a>(&'a CostModel);

impl NodeCostFn for ModelCost<'_> {
    fn cost(&mut self, eg: &SpmdEGraph, class: egg::Id, node: &ENode) -> f64 {
        let op = &eg.analysis.ops.get(node.op).op;
        let tys: Vec<&TensorType> = node.children.iter().map(|&c| &eg[c].data.ty).collect();
        let d = &eg[class].data;
        let c =
            self.0.node(&eg.analysis.mesh, op, &tys, &d.ty) + self.0.held(d.meta.role, op, &d.ty);
        self.0.weigh(&c)
    }
}

/// Pseudo-random node costs (see [`Objective::Shuffle`]).
struct ShuffleCost {
    seed: u64,
    made_by_rules: HashSet<ENode>,
}

impl NodeCostFn for ShuffleCost {
    fn cost(&mut self, eg: &SpmdEGraph, _class: egg::Id, node: &ENode) -> f64 {
        // FNV-1a over the seed, the op and the operand classes.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ self.seed;
        let mut mix = |x: u64| {
            h ^= x;
            h = h.wrapping_mul(0x0100_0000_01b3);
        };
        mix(u64::from(node.op.0));
        for &c in &node.children {
            mix(usize::from(eg.find(c)) as u64);
        }
        let r = (h >> 11) as f64 / (1u64 << 53) as f64;
        let canon = ENode::new(node.op, node.children.iter().map(|&c| eg.find(c)).collect());
        if self.made_by_rules.contains(&canon) {
            r
        } else {
            0.6 + r
        }
    }
}

fn run_once(
    sg: &ShardedGraph,
    rules: &[std::sync::Arc<dyn rules::RuleImpl>],
    opts: &RewriteOptions,
) -> Result<Run, RewriteError> {
    let t0 = Instant::now();
    let loaded = convert::load(sg);
    let rewrites: Vec<egg::Rewrite<ENode, SpmdAnalysis>> =
        rules.iter().map(rules::to_rewrite).collect();
    let runner: egg::Runner<ENode, SpmdAnalysis, ()> =
        egg::Runner::new(SpmdAnalysis::new(sg.mesh.clone()))
            .with_egraph(loaded.eg)
            .with_iter_limit(opts.limits.iters)
            .with_node_limit(opts.limits.nodes)
            .with_time_limit(Duration::MAX)
            .with_scheduler(egg::SimpleScheduler)
            .run(&rewrites);
    let mut fired: BTreeMap<String, usize> = BTreeMap::new();
    for it in &runner.iterations {
        for (rule, n) in &it.applied {
            *fired.entry(rule.to_string()).or_default() += n;
        }
    }
    let stop_reason = match &runner.stop_reason {
        Some(r) => format!("{r:?}"),
        None => "none".into(),
    };
    let iterations = runner.iterations.len();
    let eg = runner.egraph;
    let saturate = t0.elapsed();
    let t1 = Instant::now();
    let roots: Vec<egg::Id> = loaded.roots.iter().map(|(_, r)| eg.find(*r)).collect();
    // The group of the rule that made each e-node (the extraction portfolio's biases).
    let group_of_rule: HashMap<&str, &'static str> =
        rules.iter().map(|r| (r.name(), r.group())).collect();
    let mut groups: HashMap<ENode, &'static str> = HashMap::new();
    for (n, r) in &eg.analysis.origins {
        let canon = ENode::new(n.op, n.children.iter().map(|&c| eg.find(c)).collect());
        if let Some(&g) = group_of_rule.get(r) {
            groups.entry(canon).or_insert(g);
        }
    }
    let (ex, model_cost) = match opts.objective {
        Objective::Model => {
            let mut cf = ModelCost(&opts.cost);
            let ex = extract::extract(&eg, &roots, &mut cf, &groups);
            (ex, Some(cf))
        }
        Objective::Shuffle(seed) => {
            let mut cf = ShuffleCost {
                seed,
                made_by_rules: groups.keys().cloned().collect(),
            };
            (
                extract::extract(&eg, &roots, &mut cf, &HashMap::new()),
                None,
            )
        }
    };
    for r in &roots {
        if !ex.choice.contains_key(r) {
            return Err(RewriteError::Internal(format!(
                "output class {r} has no extracted program"
            )));
        }
    }
    let mut emitted = convert::emit(&eg, &ex, &loaded.roots, sg, &loaded.originals)?;
    // The cost that chose each communicating node: the program's exact cost, and what it
    // would be with the class's best other node.
    if let Some(mut cf) = model_cost {
        let comm: Vec<usize> = (0..emitted.notes.len())
            .filter(|&v| {
                let node = emitted.sharded.graph.node(crate::ir::ValueId(v as u32));
                node.op.communicates()
            })
            .collect();
        let classes: Vec<egg::Id> = comm.iter().map(|&v| emitted.notes[v].class).collect();
        let alts = extract::best_alternatives(&eg, &ex, &roots, &classes, &mut cf);
        for (v, alt) in comm.into_iter().zip(alts) {
            let alternative = alt.map(|(n, program_us)| Alternative {
                op: eg.analysis.ops.get(n.op).op.mnemonic().to_string(),
                program_us,
            });
            emitted.notes[v].choice = Some((ex.total, alternative));
        }
    }
    Ok(Run {
        emitted,
        fired,
        stop_reason,
        iterations,
        nodes: eg.total_size(),
        classes: eg.number_of_classes(),
        saturate,
        extract: t1.elapsed(),
    })
}

/// The cost of a whole program under `model` (each node once).
pub fn program_cost(model: &CostModel, g: &Graph, mesh: &Mesh) -> ProgramCost {
    let mut total = NodeCost::ZERO;
    let mut weighted = 0.0;
    for node in &g.nodes {
        let tys: Vec<&TensorType> = node.inputs.iter().map(|&i| g.ty(i)).collect();
        let c =
            model.node(mesh, &node.op, &tys, &node.ty) + model.held(node.role, &node.op, &node.ty);
        weighted += model.weigh(&c);
        total = total + c;
    }
    ProgramCost {
        compute_us: total.compute.0,
        comm_us: total.comm.0,
        activation_bytes: total.memory.0,
        weighted_us: weighted,
    }
}

/// Rewrites `sg` under `opts`.
pub fn rewrite(sg: &ShardedGraph, opts: &RewriteOptions) -> Result<Rewritten, RewriteError> {
    let t0 = Instant::now();
    let rules = opts.rules.resolve()?;
    let names: Vec<String> = rules.iter().map(|r| r.name().to_string()).collect();
    let before = program_cost(&opts.cost, &sg.graph, &sg.mesh);
    let report = |run: Option<&Run>, after: &ShardedGraph, notes: &[NodeNote], layers| {
        let g = &after.graph;
        let collectives = g
            .ids()
            .filter(|&v| g.node(v).op.communicates())
            .map(|v| {
                let n = g.node(v);
                let note = notes.get(v.index());
                let (program_us, alternative) =
                    note.and_then(|x| x.choice.clone()).unwrap_or((0.0, None));
                let tys: Vec<&TensorType> = n.inputs.iter().map(|&i| g.ty(i)).collect();
                let own = opts.cost.node(&after.mesh, &n.op, &tys, &n.ty);
                CollectiveChoice {
                    value: v.0,
                    name: n.name.clone(),
                    op: n.op.mnemonic().to_string(),
                    axis: n.op.axis().unwrap_or_default().to_string(),
                    layer: n.layer,
                    rule: note.and_then(|x| x.rule).map(str::to_string),
                    own_us: opts.cost.weigh(&own),
                    program_us,
                    alternative,
                }
            })
            .collect();
        RewriteReport {
            rules: names.clone(),
            fired: run.map(|r| r.fired.clone()).unwrap_or_default(),
            stop_reason: run.map_or("not run".into(), |r| r.stop_reason.clone()),
            iterations: run.map_or(0, |r| r.iterations),
            egraph_nodes: run.map_or(0, |r| r.nodes),
            egraph_classes: run.map_or(0, |r| r.classes),
            limits: opts.limits,
            memory_us_per_mib: opts.cost.memory_us_per_mib,
            device: opts.cost.device.name.clone(),
            before,
            after: program_cost(&opts.cost, g, &after.mesh),
            layers,
            collectives,
            timing: Timing {
                saturate: run.map_or(Duration::ZERO, |r| r.saturate),
                extract: run.map_or(Duration::ZERO, |r| r.extract),
                total: t0.elapsed(),
            },
            state_layout: None,
        }
    };
    // The rewritten program `sharded` with its report, the total time taken last.
    let finish = |run: Option<&Run>, sharded: ShardedGraph, notes: &[NodeNote], layers| {
        let mut report = report(run, &sharded, notes, layers);
        report.timing.total = t0.elapsed();
        Rewritten { sharded, report }
    };
    if rules.is_empty() {
        let layers = LayerPlanning::Whole {
            reason: "no rules selected".into(),
        };
        return Ok(finish(None, sg.clone(), &[], layers));
    }
    let mut why = String::from("layer planning off");
    if opts.dedup {
        why = "fewer than four identical layer blocks".into();
        if let Some(plan) = dedup::Plan::new(&sg.graph) {
            why = "the window could not be built".into();
            if let Some((win, info)) = plan.window(sg) {
                let run = run_once(&win, &rules, opts)?;
                match plan.expand(sg, &run.emitted.sharded, &run.emitted.notes) {
                    Ok((full, notes)) => {
                        let layers = LayerPlanning::Window {
                            layers: info.layers,
                            window_nodes: info.window_nodes,
                        };
                        return Ok(finish(Some(&run), full, &notes, layers));
                    }
                    Err(e) => why = format!("window not replicable: {e}"),
                }
            }
        } else if let Some(plan) = window::TrainPlan::new(&sg.graph) {
            match plan.window(sg) {
                Err(e) => why = format!("the training window could not be built: {e}"),
                Ok(win) => {
                    let run = run_once(&win.sharded, &rules, opts)?;
                    match plan.expand(sg, &run.emitted.sharded, &run.emitted.notes) {
                        Ok((full, notes)) => {
                            let layers = LayerPlanning::Window {
                                layers: plan.layers as usize,
                                window_nodes: win.nodes,
                            };
                            return Ok(finish(Some(&run), full, &notes, layers));
                        }
                        Err(e) => why = format!("training window not replicable: {e}"),
                    }
                }
            }
        }
    }
    let run = run_once(sg, &rules, opts)?;
    let layers = LayerPlanning::Whole { reason: why };
    let mut r = report(Some(&run), &run.emitted.sharded, &run.emitted.notes, layers);
    r.timing.total = t0.elapsed();
    Ok(Rewritten {
        sharded: run.emitted.sharded,
        report: r,
    })
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod train_tests;
