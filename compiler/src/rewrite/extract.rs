//! DAG-aware extraction: the program (one e-node per needed class) whose total cost, each
//! class counted once, is smallest. A shared sub-term is paid once, unlike egg's tree-cost
//! `Extractor`.
//!
//! Exact DAG extraction is NP-hard (an ILP); this is a deterministic heuristic in three steps:
//!
//! 1. **Greedy DAG** (extraction-gym's `faster-greedy-dag`): every class adopts the node
//!    whose sub-DAG (its children's solutions united, each class once) is cheapest, to a fixed
//!    point; a node whose children's solutions contain its own class closes a cycle and is
//!    skipped.
//! 2. **Portfolio.** Greedy decides each class for its own sub-DAG, so it misses a layout that
//!    only pays when every layer adopts it (sequence parallelism: sharding the residual stream
//!    costs more at the first norm and less everywhere after). The greedy also runs with the
//!    nodes made by each rule group, and by all rules, at a discount; every candidate program
//!    is then priced exactly with the true costs, and the cheapest wins.
//! 3. **Local search**: single-class switches to another node (newly needed classes take the
//!    unbiased greedy choice) are kept while they lower the exact total.
//!
//! Ties keep the earlier candidate; every iteration order comes from the e-graph's insertion
//! order, so the result is deterministic.

use super::analysis::SpmdEGraph;
use super::lang::ENode;
use egg::Id;
use indexmap::{IndexMap, IndexSet};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::rc::Rc;

/// A per-node cost (the node's own, not its sub-DAG's).
pub(crate) trait NodeCostFn {
    /// The cost of `node` (in class `class`).
    fn cost(&mut self, eg: &SpmdEGraph, class: Id, node: &ENode) -> f64;
}

/// Discount of the nodes a biased greedy run favours.
const BIAS: [f64; 2] = [0.5, 0.1];
/// Rounds of local search.
const LOCAL_ROUNDS: usize = 8;

/// The chosen program.
#[derive(Clone, Debug, Default)]
pub(crate) struct Extraction {
    /// The chosen node of each class of the program (and of other classes where known).
    pub choice: IndexMap<Id, ENode>,
    /// The exact cost of the program rooted at the roots.
    pub total: f64,
}

impl Extraction {
    /// The classes reachable from `roots` through chosen nodes, each once, in DFS order.
    pub fn reachable(&self, eg: &SpmdEGraph, roots: &[Id]) -> Vec<Id> {
        let mut seen = IndexSet::new();
        let mut stack: Vec<Id> = roots.iter().rev().map(|&r| eg.find(r)).collect();
        while let Some(c) = stack.pop() {
            if !seen.insert(c) {
                continue;
            }
            if let Some(n) = self.choice.get(&c) {
                stack.extend(n.children.iter().rev().map(|&k| eg.find(k)));
            }
        }
        seen.into_iter().collect()
    }
}

/// Every node's own cost, by (class, index in the class).
struct Costs {
    own: IndexMap<(Id, usize), f64>,
}

/// A choice map: class → node index.
type Choice = IndexMap<Id, usize>;

/// The exact cost of the program of `choice` rooted at `roots`; `None` when a class has no
/// choice or the choices form a cycle.
fn evaluate(eg: &SpmdEGraph, costs: &Costs, choice: &Choice, roots: &[Id]) -> Option<f64> {
    // Iterative DFS with colours: 1 open, 2 done.
    let mut colour: HashMap<Id, u8> = HashMap::new();
    let mut total = 0.0;
    for &r in roots {
        let mut stack: Vec<(Id, usize)> = vec![(eg.find(r), 0)];
        while let Some((c, k)) = stack.pop() {
            if k == 0 {
                match colour.get(&c) {
                    Some(2) => continue,
                    Some(_) => return None,
                    None => {}
                }
                colour.insert(c, 1);
            }
            let i = *choice.get(&c)?;
            let node = &eg[c].nodes[i];
            if let Some(&child) = node.children.get(k) {
                stack.push((c, k + 1));
                let child = eg.find(child);
                match colour.get(&child) {
                    Some(2) => {}
                    Some(_) => return None,
                    None => stack.push((child, 0)),
                }
            } else {
                colour.insert(c, 2);
                total += costs.own[&(c, i)];
            }
        }
    }
    Some(total)
}

/// A class's best greedy solution.
struct Solution {
    node: usize,
    set: Rc<BTreeMap<Id, f64>>,
    total: f64,
}

/// One greedy DAG run with node costs `own(class, index)`.
fn greedy(eg: &SpmdEGraph, own: &dyn Fn(Id, usize) -> f64) -> Choice {
    let mut parents: IndexMap<Id, Vec<(Id, usize)>> = IndexMap::new();
    let mut work: VecDeque<(Id, usize)> = VecDeque::new();
    let mut queued: IndexSet<(Id, usize)> = IndexSet::new();
    for class in eg.classes() {
        for (i, n) in class.nodes.iter().enumerate() {
            if n.children.is_empty() {
                work.push_back((class.id, i));
                queued.insert((class.id, i));
            }
            for &k in &n.children {
                parents.entry(eg.find(k)).or_default().push((class.id, i));
            }
        }
    }
    let mut best: IndexMap<Id, Solution> = IndexMap::new();
    while let Some((c, i)) = work.pop_front() {
        queued.swap_remove(&(c, i));
        let node = &eg[c].nodes[i];
        let mut kids: Vec<&Solution> = Vec::with_capacity(node.children.len());
        for &k in &node.children {
            match best.get(&eg.find(k)) {
                Some(s) => kids.push(s),
                None => break,
            }
        }
        if kids.len() != node.children.len() {
            continue;
        }
        let self_cost = own(c, i);
        let set = union(&kids);
        if set.contains_key(&c) {
            continue;
        }
        let total = set.values().sum::<f64>() + self_cost;
        let better = match best.get(&c) {
            None => true,
            Some(s) => total < s.total - 1e-9 * s.total.abs().max(1.0),
        };
        if !better {
            continue;
        }
        let mut set = (*set).clone();
        set.insert(c, self_cost);
        best.insert(
            c,
            Solution {
                node: i,
                set: Rc::new(set),
                total,
            },
        );
        for &p in parents.get(&c).into_iter().flatten() {
            if queued.insert(p) {
                work.push_back(p);
            }
        }
    }
    best.into_iter().map(|(c, s)| (c, s.node)).collect()
}

/// The union of solutions (the largest one reused when it is the only one).
fn union(kids: &[&Solution]) -> Rc<BTreeMap<Id, f64>> {
    let Some(big) = kids.iter().max_by_key(|s| s.set.len()) else {
        return Rc::new(BTreeMap::new());
    };
    if kids.iter().all(|s| Rc::ptr_eq(&s.set, &big.set)) {
        return Rc::clone(&big.set);
    }
    let mut m = (*big.set).clone();
    for s in kids {
        if Rc::ptr_eq(&s.set, &big.set) {
            continue;
        }
        for (&k, &v) in s.set.iter() {
            m.entry(k).or_insert(v);
        }
    }
    Rc::new(m)
}

/// Extracts the program rooted at `roots`. `groups` gives, for each e-node made by a rule,
/// the rule's group (the portfolio's biases).
pub(crate) fn extract(
    eg: &SpmdEGraph,
    roots: &[Id],
    cost: &mut impl NodeCostFn,
    groups: &HashMap<ENode, &'static str>,
) -> Extraction {
    let roots: Vec<Id> = roots.iter().map(|&r| eg.find(r)).collect();
    let mut own = IndexMap::new();
    let mut group_of: HashMap<(Id, usize), &'static str> = HashMap::new();
    let mut group_names: Vec<&'static str> = Vec::new();
    for class in eg.classes() {
        for (i, n) in class.nodes.iter().enumerate() {
            own.insert((class.id, i), cost.cost(eg, class.id, n));
            let canon = ENode::new(n.op, n.children.iter().map(|&c| eg.find(c)).collect());
            if let Some(&g) = groups.get(&canon) {
                group_of.insert((class.id, i), g);
                if !group_names.contains(&g) {
                    group_names.push(g);
                }
            }
        }
    }
    let costs = Costs { own };
    let base = greedy(eg, &|c, i| costs.own[&(c, i)]);
    let mut best = base.clone();
    let mut best_total = evaluate(eg, &costs, &base, &roots).unwrap_or(f64::INFINITY);
    // The portfolio: all rule-made nodes discounted, then each group's.
    let mut biases: Vec<Option<&'static str>> = vec![None];
    if group_names.len() > 1 {
        biases.extend(group_names.iter().map(|&g| Some(g)));
    }
    for &b in &BIAS {
        for &only in &biases {
            let f = |c: Id, i: usize| {
                let x = costs.own[&(c, i)];
                match group_of.get(&(c, i)) {
                    Some(g) if only.is_none_or(|o| o == *g) => x * b,
                    _ => x,
                }
            };
            let mut cand = greedy(eg, &f);
            // Classes the biased run left without a solution keep the unbiased one.
            for (c, i) in &base {
                cand.entry(*c).or_insert(*i);
            }
            if let Some(t) = evaluate(eg, &costs, &cand, &roots) {
                if t < best_total - 1e-9 * best_total.abs().max(1.0) {
                    best = cand;
                    best_total = t;
                }
            }
        }
    }
    // Local search: single-class switches.
    for _ in 0..LOCAL_ROUNDS {
        let mut improved = false;
        let current = Extraction {
            choice: best
                .iter()
                .map(|(&c, &i)| (c, eg[c].nodes[i].clone()))
                .collect(),
            total: best_total,
        };
        for c in current.reachable(eg, &roots) {
            let n = eg[c].nodes.len();
            for i in 0..n {
                if best.get(&c) == Some(&i) {
                    continue;
                }
                let mut cand = best.clone();
                cand.insert(c, i);
                if let Some(t) = evaluate(eg, &costs, &cand, &roots) {
                    if t < best_total - 1e-9 * best_total.abs().max(1.0) {
                        best = cand;
                        best_total = t;
                        improved = true;
                    }
                }
            }
        }
        if !improved {
            break;
        }
    }
    Extraction {
        choice: best
            .iter()
            .map(|(&c, &i)| (c, eg[c].nodes[i].clone()))
            .collect(),
        total: best_total,
    }
}

/// For class `class` of the extracted program: the cheapest other node of the class and the
/// program's exact cost with it instead (`None` when no other node gives a valid program).
pub(crate) fn best_alternative(
    eg: &SpmdEGraph,
    ex: &Extraction,
    roots: &[Id],
    class: Id,
    cost: &mut impl NodeCostFn,
) -> Option<(ENode, f64)> {
    let c = eg.find(class);
    let roots: Vec<Id> = roots.iter().map(|&r| eg.find(r)).collect();
    let mut own = IndexMap::new();
    let mut choice: Choice = IndexMap::new();
    for (&k, n) in &ex.choice {
        let i = eg[k].nodes.iter().position(|m| m == n)?;
        choice.insert(k, i);
    }
    for k in ex.reachable(eg, &roots) {
        for (i, n) in eg[k].nodes.iter().enumerate() {
            own.insert((k, i), cost.cost(eg, k, n));
        }
    }
    for (i, n) in eg[c].nodes.iter().enumerate() {
        own.entry((c, i)).or_insert_with(|| cost.cost(eg, c, n));
    }
    let mut best: Option<(ENode, f64)> = None;
    for (i, n) in eg[c].nodes.iter().enumerate() {
        if choice.get(&c) == Some(&i) {
            continue;
        }
        let mut cand = choice.clone();
        cand.insert(c, i);
        // Price every class the candidate reaches.
        let reach = Extraction {
            choice: cand
                .iter()
                .map(|(&k, &j)| (k, eg[k].nodes[j].clone()))
                .collect(),
            total: 0.0,
        }
        .reachable(eg, &roots);
        for k in reach {
            if let Some(&j) = cand.get(&k) {
                let node = &eg[k].nodes[j];
                own.entry((k, j)).or_insert_with(|| cost.cost(eg, k, node));
            }
        }
        let costs = Costs { own: own.clone() };
        if let Some(t) = evaluate(eg, &costs, &cand, &roots) {
            if best.as_ref().is_none_or(|(_, b)| t < *b) {
                best = Some((n.clone(), t));
            }
        }
    }
    best
}
