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
//! Cost: the greedy visits nodes in program order (so a node is normally priced once) and
//! keeps each sub-DAG as a bit set over the classes, priced incrementally from the largest
//! operand's; the local search prices a switch by reference counts (only the classes it adds
//! or drops), and proves it acyclic by a topological labelling, evaluating the whole program
//! only when the labelling cannot tell. A switch never costs a pass over the program, so the
//! extractor scales with program size, not its square.
//!
//! Ties keep the earlier candidate; every iteration order comes from the e-graph's insertion
//! order, so the result is deterministic.

use super::analysis::SpmdEGraph;
use super::lang::ENode;
use egg::Id;
use indexmap::{IndexMap, IndexSet};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::rc::Rc;

/// A per-node cost (the node's own, not its sub-DAG's).
pub(crate) trait NodeCostFn {
    /// The cost of `node` (in class `class`).
    fn cost(&mut self, eg: &SpmdEGraph, class: Id, node: &ENode) -> f64;
}

/// Discount of the nodes a biased greedy run favours.
const BIAS: [f64; 2] = [0.5, 0.1];
/// Spacing of the local search's topological labels.
const LABEL_GAP: u64 = 1 << 12;
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
    own: Vec<Vec<f64>>,
}

impl Costs {
    /// Every node's own cost.
    fn new(eg: &SpmdEGraph, cost: &mut impl NodeCostFn) -> Costs {
        let n = eg
            .classes()
            .map(|c| usize::from(c.id) + 1)
            .max()
            .unwrap_or(0);
        let mut own = vec![Vec::new(); n];
        for class in eg.classes() {
            own[usize::from(class.id)] = class
                .nodes
                .iter()
                .map(|node| cost.cost(eg, class.id, node))
                .collect();
        }
        Costs { own }
    }

    fn get(&self, c: Id, i: usize) -> f64 {
        self.own
            .get(usize::from(c))
            .and_then(|v| v.get(i))
            .copied()
            .unwrap_or(f64::INFINITY)
    }
}

/// A choice map: class → node index.
type Choice = IndexMap<Id, usize>;

/// The exact cost of the program of `choice` rooted at `roots`; `None` when a class has no
/// choice or the choices form a cycle.
fn evaluate(eg: &SpmdEGraph, costs: &Costs, choice: &Choice, roots: &[Id]) -> Option<f64> {
    evaluate_with(eg, costs, &|c| choice.get(&c).copied(), roots)
}

/// [`evaluate`] with the choice map as a function.
fn evaluate_with(
    eg: &SpmdEGraph,
    costs: &Costs,
    choice: &dyn Fn(Id) -> Option<usize>,
    roots: &[Id],
) -> Option<f64> {
    // Iterative DFS with colours: 1 open, 2 done.
    let mut colour: Vec<u8> = vec![0; costs.own.len()];
    let mut total = 0.0;
    for &r in roots {
        let mut stack: Vec<(Id, usize)> = vec![(eg.find(r), 0)];
        while let Some((c, k)) = stack.pop() {
            if k == 0 {
                match colour[usize::from(c)] {
                    2 => continue,
                    1 => return None,
                    _ => {}
                }
                colour[usize::from(c)] = 1;
            }
            let i = choice(c)?;
            let node = &eg[c].nodes[i];
            if let Some(&child) = node.children.get(k) {
                stack.push((c, k + 1));
                let child = eg.find(child);
                match colour[usize::from(child)] {
                    2 => {}
                    1 => return None,
                    _ => stack.push((child, 0)),
                }
            } else {
                colour[usize::from(c)] = 2;
                total += costs.get(c, i);
            }
        }
    }
    Some(total)
}

/// Dense numbering of the e-graph's classes (bit positions of the greedy's sets).
struct Dense {
    ids: Vec<Id>,
    index: HashMap<Id, usize>,
}

impl Dense {
    fn new(eg: &SpmdEGraph) -> Dense {
        let ids: Vec<Id> = eg.classes().map(|c| c.id).collect();
        let index = ids.iter().enumerate().map(|(i, &c)| (c, i)).collect();
        Dense { ids, index }
    }
}

/// A class's best greedy solution: its node, the classes of its sub-DAG (a bit set over
/// [`Dense`]) and the sub-DAG's cost.
struct Solution {
    node: usize,
    set: Rc<Vec<u64>>,
    len: u32,
    total: f64,
}

fn has(set: &[u64], i: usize) -> bool {
    set[i / 64] >> (i % 64) & 1 == 1
}

/// One greedy DAG run with node costs `own(class, index)`.
///
/// Nodes are processed in the classes' program order (the analysis's anchor, then creation
/// order), so that a node is normally priced once, after its operands; a class whose solution
/// improves re-queues its users. A solution's sub-DAG is a bit set, and the union of the
/// operands' sets is priced incrementally (the largest operand's total plus the classes the
/// others add, each at its class's current best node's cost): one pass over `classes / 64`
/// words per node, so a run is near-linear in practice instead of quadratic.
fn greedy(eg: &SpmdEGraph, dense: &Dense, own: &dyn Fn(Id, usize) -> f64) -> Choice {
    let n = dense.ids.len();
    let words = n.div_ceil(64);
    let mut parents: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
    type Key = Reverse<(u32, u32, usize, usize)>;
    let key = |c: usize, i: usize| -> Key {
        let m = &eg[dense.ids[c]].data.meta;
        Reverse((m.anchor, m.seq, c, i))
    };
    let mut work: BinaryHeap<Key> = BinaryHeap::new();
    let mut queued: HashSet<(usize, usize)> = HashSet::new();
    for (ci, &id) in dense.ids.iter().enumerate() {
        for (i, node) in eg[id].nodes.iter().enumerate() {
            if node.children.is_empty() {
                work.push(key(ci, i));
                queued.insert((ci, i));
            }
            for &k in &node.children {
                parents[dense.index[&eg.find(k)]].push((ci, i));
            }
        }
    }
    let mut best: Vec<Option<Solution>> = (0..n).map(|_| None).collect();
    // The own cost of each class's current best node.
    let mut cur = vec![0.0f64; n];
    while let Some(Reverse((_, _, c, i))) = work.pop() {
        queued.remove(&(c, i));
        let id = dense.ids[c];
        let node = &eg[id].nodes[i];
        let kids: Option<Vec<usize>> = node
            .children
            .iter()
            .map(|&k| {
                let k = dense.index[&eg.find(k)];
                best[k].as_ref().map(|_| k)
            })
            .collect();
        let Some(kids) = kids else { continue };
        let sol = |k: usize| best[k].as_ref().expect("invariant: kids have solutions");
        if kids.iter().any(|&k| has(&sol(k).set, c)) {
            continue;
        }
        let self_cost = own(id, i);
        // The union, priced from the largest operand set (first of the largest on ties).
        let big = kids
            .iter()
            .copied()
            .reduce(|a, b| if sol(b).len > sol(a).len { b } else { a });
        let (mut set, mut total) = match big {
            Some(b) => ((*sol(b).set).clone(), sol(b).total),
            None => (vec![0u64; words], 0.0),
        };
        for &k in &kids {
            if Some(k) == big || Rc::ptr_eq(&sol(k).set, &sol(big.expect("kids")).set) {
                continue;
            }
            for (w, (m, &o)) in set.iter_mut().zip(sol(k).set.iter()).enumerate() {
                let mut add = o & !*m;
                *m |= o;
                while add != 0 {
                    let b = add.trailing_zeros() as usize;
                    add &= add - 1;
                    total += cur[w * 64 + b];
                }
            }
        }
        let total = total + self_cost;
        let better = match &best[c] {
            None => true,
            Some(s) => total < s.total - 1e-9 * s.total.abs().max(1.0),
        };
        if !better {
            continue;
        }
        set[c / 64] |= 1 << (c % 64);
        best[c] = Some(Solution {
            node: i,
            len: count(&set),
            set: Rc::new(set),
            total,
        });
        cur[c] = self_cost;
        for &(pc, pi) in &parents[c] {
            if queued.insert((pc, pi)) {
                work.push(key(pc, pi));
            }
        }
    }
    dense
        .ids
        .iter()
        .zip(best)
        .filter_map(|(&id, s)| s.map(|s| (id, s.node)))
        .collect()
}

/// Number of classes in a set.
fn count(set: &[u64]) -> u32 {
    set.iter().map(|w| w.count_ones()).sum()
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
    let mut group_of: HashMap<(Id, usize), &'static str> = HashMap::new();
    let mut group_names: Vec<&'static str> = Vec::new();
    for class in eg.classes() {
        for (i, n) in class.nodes.iter().enumerate() {
            let canon = ENode::new(n.op, n.children.iter().map(|&c| eg.find(c)).collect());
            if let Some(&g) = groups.get(&canon) {
                group_of.insert((class.id, i), g);
                if !group_names.contains(&g) {
                    group_names.push(g);
                }
            }
        }
    }
    let costs = Costs::new(eg, cost);
    let dense = Dense::new(eg);
    let base = greedy(eg, &dense, &|c, i| costs.get(c, i));
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
                let x = costs.get(c, i);
                match group_of.get(&(c, i)) {
                    Some(g) if only.is_none_or(|o| o == *g) => x * b,
                    _ => x,
                }
            };
            let mut cand = greedy(eg, &dense, &f);
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
    // Local search: single-class switches, priced incrementally, each improvement confirmed
    // by an exact evaluation (which also rejects a switch that closes a cycle).
    if best_total.is_finite() {
        let mut prog = Incremental::new(eg, &costs, best, &roots);
        prog.total = best_total;
        for _ in 0..LOCAL_ROUNDS {
            let mut improved = false;
            for c in prog.reachable() {
                if !prog.in_program(c) {
                    continue;
                }
                let n = eg[c].nodes.len();
                for i in 0..n {
                    let Some(cur) = prog.chosen(c) else {
                        continue;
                    };
                    let eps = 1e-9 * best_total.abs().max(1.0);
                    if cur == i || !prog.may_gain(c, cur, i, best_total - eps - prog.total) {
                        continue;
                    }
                    if prog.closes_cycle(c, i) {
                        continue;
                    }
                    let before = prog.total;
                    let Some(old) = prog.switch(c, i) else {
                        continue;
                    };
                    if prog.missing == 0 && prog.total < best_total - eps {
                        if !prog.labels_allow(c, i) {
                            prog.label_all();
                        }
                        best_total = prog.total;
                        improved = true;
                        continue;
                    }
                    prog.switch(c, old);
                    prog.relabel_added();
                    prog.total = before;
                }
            }
            if !improved {
                break;
            }
        }
        best = prog.into_choice();
        // The exact total (the incremental one carries rounding).
        if let Some(t) = evaluate(eg, &costs, &best, &roots) {
            best_total = t;
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

/// A program (a choice map and its roots) under single-class switches, priced incrementally:
/// each class's reference count (uses through the chosen nodes of the program's classes, and
/// the roots), so a switch costs the classes it adds or drops rather than a pass over the
/// program. The total is exact up to rounding while the program is acyclic; a switch that
/// closes a cycle must be detected by the caller. Per-class state is in vectors indexed by the
/// class id.
struct Incremental<'a> {
    eg: &'a SpmdEGraph,
    costs: &'a Costs,
    roots: Vec<Id>,
    /// The chosen node of each class ([`NONE`]: none).
    choice: Vec<u32>,
    refs: Vec<u32>,
    total: f64,
    /// Classes of the program without a choice.
    missing: usize,
    /// Classes the last switch brought into the program.
    added: Vec<Id>,
    /// A topological labelling of the program's classes ([`UNLABELLED`]: none): every chosen
    /// node's operands are labelled lower than its class (so the program is acyclic).
    label: Vec<u64>,
    /// Scratch: classes on the labelling walk's path.
    open: Vec<bool>,
    /// Scratch of [`Incremental::may_gain`]: uses a dry run drops, and a visit stamp.
    pend: Vec<u32>,
    seen: Vec<u32>,
    stamp: u32,
}

const NONE: u32 = u32::MAX;
const UNLABELLED: u64 = u64::MAX;

impl<'a> Incremental<'a> {
    fn new(eg: &'a SpmdEGraph, costs: &'a Costs, choice: Choice, roots: &[Id]) -> Self {
        let n = costs.own.len();
        let mut v = vec![NONE; n];
        for (c, i) in choice {
            if let Some(x) = v.get_mut(usize::from(c)) {
                *x = i as u32;
            }
        }
        let mut p = Incremental {
            eg,
            costs,
            roots: roots.to_vec(),
            choice: v,
            refs: vec![0; n],
            total: 0.0,
            missing: 0,
            added: Vec::new(),
            label: vec![UNLABELLED; n],
            open: vec![false; n],
            pend: vec![0; n],
            seen: vec![0; n],
            stamp: 0,
        };
        for &r in roots {
            p.inc(r);
        }
        p.label_all();
        p
    }

    fn chosen(&self, c: Id) -> Option<usize> {
        match self.choice[usize::from(c)] {
            NONE => None,
            i => Some(i as usize),
        }
    }

    fn in_program(&self, c: Id) -> bool {
        self.refs[usize::from(c)] > 0
    }

    fn kids(&self, c: Id) -> &'a [Id] {
        let eg = self.eg;
        match self.chosen(c) {
            Some(i) => &eg[c].nodes[i].children,
            None => &[],
        }
    }

    /// The choice map (classes with a choice).
    fn into_choice(self) -> Choice {
        self.choice
            .iter()
            .enumerate()
            .filter(|(_, &i)| i != NONE)
            .map(|(c, &i)| (Id::from(c), i as usize))
            .collect()
    }

    /// The exact total, `None` when the program is cyclic or a class has no choice.
    fn evaluate(&self) -> Option<f64> {
        evaluate_with(self.eg, self.costs, &|c| self.chosen(c), &self.roots)
    }

    /// One more use of `c` (and of its chosen node's operands when it enters the program).
    fn inc(&mut self, c: Id) {
        let mut stack = vec![self.eg.find(c)];
        while let Some(c) = stack.pop() {
            let r = &mut self.refs[usize::from(c)];
            *r += 1;
            if *r > 1 {
                continue;
            }
            self.added.push(c);
            match self.chosen(c) {
                Some(i) => {
                    self.total += self.costs.get(c, i);
                    stack.extend(self.kids(c).iter().map(|&k| self.eg.find(k)));
                }
                None => self.missing += 1,
            }
        }
    }

    /// One use of `c` fewer (and of its chosen node's operands when it leaves the program).
    fn dec(&mut self, c: Id) {
        let mut stack = vec![self.eg.find(c)];
        while let Some(c) = stack.pop() {
            let r = &mut self.refs[usize::from(c)];
            *r -= 1;
            if *r > 0 {
                continue;
            }
            self.label[usize::from(c)] = UNLABELLED;
            match self.chosen(c) {
                Some(i) => {
                    self.total -= self.costs.get(c, i);
                    stack.extend(self.kids(c).iter().map(|&k| self.eg.find(k)));
                }
                None => self.missing -= 1,
            }
        }
    }

    /// Whether choosing node `j` for class `c` of the program (now on `old`) changes the total
    /// by less than `limit`. A dry run (nothing changes): it prices the classes the switch
    /// drops, then walks the classes it adds and stops as soon as the change reaches `limit`,
    /// so a switch that would pull in a long chain of other classes is refused early.
    fn may_gain(&mut self, c: Id, old: usize, j: usize, limit: f64) -> bool {
        let eg = self.eg;
        let mut delta = self.costs.get(c, j) - self.costs.get(c, old);
        let mut touched: Vec<usize> = Vec::new();
        let mut stack: Vec<Id> = eg[c].nodes[old]
            .children
            .iter()
            .map(|&k| eg.find(k))
            .collect();
        while let Some(x) = stack.pop() {
            let xi = usize::from(x);
            if self.pend[xi] == 0 {
                touched.push(xi);
            }
            self.pend[xi] += 1;
            if self.pend[xi] == self.refs[xi] {
                if let Some(i) = self.chosen(x) {
                    delta -= self.costs.get(x, i);
                    stack.extend(self.kids(x).iter().map(|&k| eg.find(k)));
                }
            }
        }
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.seen.iter_mut().for_each(|s| *s = 0);
            self.stamp = 1;
        }
        let mut ok = delta < limit;
        if ok {
            stack.extend(eg[c].nodes[j].children.iter().map(|&k| eg.find(k)));
        }
        while let Some(x) = stack.pop() {
            let xi = usize::from(x);
            if self.refs[xi] > self.pend[xi] || self.seen[xi] == self.stamp {
                continue;
            }
            self.seen[xi] = self.stamp;
            let Some(i) = self.chosen(x) else {
                ok = false;
                break;
            };
            delta += self.costs.get(x, i);
            if delta >= limit {
                ok = false;
                break;
            }
            stack.extend(self.kids(x).iter().map(|&k| eg.find(k)));
        }
        for xi in touched {
            self.pend[xi] = 0;
        }
        ok
    }

    /// Whether choosing node `j` for class `c` would close a cycle (a dry run): a walk from
    /// `j`'s operands through the chosen nodes reaches `c`, or loops among classes outside
    /// the program. Program classes labelled below `c` cannot reach it and are not entered.
    fn closes_cycle(&mut self, c: Id, j: usize) -> bool {
        let eg = self.eg;
        let lc = self.label[usize::from(c)];
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.seen.iter_mut().for_each(|s| *s = 0);
            self.stamp = 1;
        }
        let mut cycle = false;
        let mut path: Vec<usize> = Vec::new();
        let mut stack: Vec<(Id, bool)> = eg[c].nodes[j]
            .children
            .iter()
            .map(|&k| (eg.find(k), false))
            .collect();
        while let Some((x, done)) = stack.pop() {
            let xi = usize::from(x);
            if done {
                self.open[xi] = false;
                continue;
            }
            if x == c || self.open[xi] {
                cycle = true;
                break;
            }
            if self.seen[xi] == self.stamp || (self.in_program(x) && self.label[xi] < lc) {
                continue;
            }
            self.seen[xi] = self.stamp;
            self.open[xi] = true;
            path.push(xi);
            stack.push((x, true));
            stack.extend(self.kids(x).iter().map(|&k| (eg.find(k), false)));
        }
        for xi in path {
            self.open[xi] = false;
        }
        cycle
    }

    /// Chooses node `i` for class `c` of the program; returns the previous choice.
    fn switch(&mut self, c: Id, i: usize) -> Option<usize> {
        let eg = self.eg;
        let old = self.chosen(c)?;
        if !self.in_program(c) {
            return None;
        }
        self.choice[usize::from(c)] = i as u32;
        self.total += self.costs.get(c, i) - self.costs.get(c, old);
        self.added.clear();
        for &k in &eg[c].nodes[i].children {
            self.inc(k);
        }
        for &k in &eg[c].nodes[old].children {
            self.dec(k);
        }
        Some(old)
    }

    /// The program's classes, each once, in DFS order from the roots.
    fn reachable(&self) -> Vec<Id> {
        let mut seen = vec![false; self.refs.len()];
        let mut out = Vec::new();
        let mut stack: Vec<Id> = self.roots.iter().rev().copied().collect();
        while let Some(c) = stack.pop() {
            if std::mem::replace(&mut seen[usize::from(c)], true) {
                continue;
            }
            out.push(c);
            stack.extend(self.kids(c).iter().rev().map(|&k| self.eg.find(k)));
        }
        out
    }

    /// Labels every class of the program afresh: post-order ranks spaced by [`LABEL_GAP`],
    /// so that classes a later switch adds fit below their user.
    fn label_all(&mut self) {
        self.label.iter_mut().for_each(|l| *l = UNLABELLED);
        self.added = (0..self.refs.len())
            .filter(|&c| self.refs[c] > 0)
            .map(Id::from)
            .collect();
        self.label_added(true);
    }

    /// Labels the classes of `added` still in the program (one above their highest
    /// operand); `false` when they close a cycle.
    fn relabel_added(&mut self) -> bool {
        self.label_added(false)
    }

    fn label_added(&mut self, spaced: bool) -> bool {
        let eg = self.eg;
        let mut next: u64 = 0;
        let added = std::mem::take(&mut self.added);
        let mut ok = true;
        for &a in &added {
            if !self.in_program(a) || self.label[usize::from(a)] != UNLABELLED {
                continue;
            }
            let mut stack: Vec<(Id, bool)> = vec![(a, false)];
            while let Some((x, done)) = stack.pop() {
                let xi = usize::from(x);
                if done {
                    self.open[xi] = false;
                    if spaced {
                        next += 1;
                        self.label[xi] = next * LABEL_GAP;
                        continue;
                    }
                    let h = self
                        .kids(x)
                        .iter()
                        .map(|&k| match self.label[usize::from(eg.find(k))] {
                            UNLABELLED => 0,
                            l => l,
                        })
                        .max()
                        .map_or(0, |m| m + 1);
                    self.label[xi] = h;
                    continue;
                }
                if self.label[xi] != UNLABELLED || self.open[xi] {
                    if self.open[xi] {
                        ok = false;
                    }
                    continue;
                }
                self.open[xi] = true;
                stack.push((x, true));
                for &k in self.kids(x) {
                    let k = eg.find(k);
                    if self.open[usize::from(k)] {
                        ok = false;
                    } else if self.label[usize::from(k)] == UNLABELLED {
                        stack.push((k, false));
                    }
                }
            }
        }
        if !ok {
            // Clear the scratch a cycle may have left set.
            self.open.iter_mut().for_each(|o| *o = false);
        }
        self.added = added;
        ok
    }

    /// After `switch(c, i)`: labels the classes it added and says whether the labelling shows
    /// the program still acyclic (every operand of the new node labelled below `c`). `false`
    /// is inconclusive.
    fn labels_allow(&mut self, c: Id, i: usize) -> bool {
        let eg = self.eg;
        if !self.relabel_added() {
            return false;
        }
        let lc = self.label[usize::from(c)];
        if lc == UNLABELLED {
            return false;
        }
        eg[c].nodes[i]
            .children
            .iter()
            .all(|&k| self.label[usize::from(eg.find(k))] < lc)
    }
}

/// For each class of `classes` in the extracted program: the cheapest other node of the class
/// and the program's cost with it instead (`None` when no other node gives a valid program).
pub(crate) fn best_alternatives(
    eg: &SpmdEGraph,
    ex: &Extraction,
    roots: &[Id],
    classes: &[Id],
    cost: &mut impl NodeCostFn,
) -> Vec<Option<(ENode, f64)>> {
    let roots: Vec<Id> = roots.iter().map(|&r| eg.find(r)).collect();
    let costs = Costs::new(eg, cost);
    let mut choice: Choice = IndexMap::new();
    for (&k, n) in &ex.choice {
        if let Some(i) = eg[k].nodes.iter().position(|m| m == n) {
            choice.insert(k, i);
        }
    }
    let mut prog = Incremental::new(eg, &costs, choice, &roots);
    if let Some(t) = prog.evaluate() {
        prog.total = t;
    }
    let base = prog.total;
    let mut out = Vec::with_capacity(classes.len());
    for &class in classes {
        {
            let c = eg.find(class);
            let mut best: Option<(ENode, f64)> = None;
            for (i, n) in eg[c].nodes.iter().enumerate() {
                let Some(cur) = prog.chosen(c) else {
                    continue;
                };
                let limit = best.as_ref().map_or(f64::INFINITY, |(_, b)| b - base);
                if cur == i || !prog.in_program(c) || !prog.may_gain(c, cur, i, limit) {
                    continue;
                }
                if prog.closes_cycle(c, i) {
                    continue;
                }
                let Some(old) = prog.switch(c, i) else {
                    continue;
                };
                let t = prog.total;
                if prog.missing == 0 && best.as_ref().is_none_or(|(_, b)| t < *b) {
                    best = Some((n.clone(), t));
                }
                prog.switch(c, old);
                prog.relabel_added();
                prog.total = base;
            }
            out.push(best);
        }
    }
    out
}
