//! The rewrite report: what ran, why it stopped, how big the e-graph got, what the program
//! costs before and after, how repeated layers were planned, and for each communicating node
//! of the result where it came from (the partitioner or a rule) and the cost that chose it.
//!
//! Everything but [`Timing`] is a function of the input, so a plan that embeds the report
//! stays byte-identical across runs; timing is not serialised.

use super::Limits;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// The cost of a whole program per rank (each node once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProgramCost {
    /// Kernel time, µs.
    pub compute_us: f64,
    /// Communication time, µs.
    pub comm_us: f64,
    /// Activation bytes produced (without reuse).
    pub activation_bytes: u64,
    /// The extractor's objective: time plus weighted memory, µs.
    pub weighted_us: f64,
}

/// How repeated layers were planned.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LayerPlanning {
    /// Planned through a window and replicated.
    Window {
        /// Layers in the program.
        layers: usize,
        /// Nodes of the window that was rewritten.
        window_nodes: usize,
    },
    /// The whole program was rewritten.
    Whole {
        /// Why no window was used.
        reason: String,
    },
}

/// The best other node a class had: its op and the program's cost with it instead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alternative {
    /// Its op (mnemonic).
    pub op: String,
    /// The (planned part of the) program's exact cost with it, µs (weighted).
    pub program_us: f64,
}

/// One communicating node of the result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollectiveChoice {
    /// Its value id in the result.
    pub value: u32,
    /// Its label.
    pub name: String,
    /// Its op (mnemonic).
    pub op: String,
    /// Mesh axis.
    pub axis: String,
    /// Layer.
    pub layer: Option<u32>,
    /// The rule that created it; `None`: inserted by the partitioner.
    pub rule: Option<String>,
    /// Its own cost, µs (weighted).
    pub own_us: f64,
    /// The exact cost of the planned program (the window when layers were planned once)
    /// with this choice, µs (weighted): what the extractor minimised.
    pub program_us: f64,
    /// The cheapest other node of its class, if any.
    pub alternative: Option<Alternative>,
}

/// Wall-clock time of the phases (not serialised: it varies between runs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timing {
    /// Equality saturation.
    pub saturate: Duration,
    /// Extraction and conversion back.
    pub extract: Duration,
    /// The whole pass (loading, layer replication and reporting included).
    pub total: Duration,
}

/// The report of one rewrite pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RewriteReport {
    /// Rules that ran, by name.
    pub rules: Vec<String>,
    /// Applications that changed the e-graph, per rule.
    pub fired: BTreeMap<String, usize>,
    /// Why saturation stopped (`Saturated`, `IterationLimit(n)`, `NodeLimit(n)`).
    pub stop_reason: String,
    /// Iterations run.
    pub iterations: usize,
    /// E-nodes at the end.
    pub egraph_nodes: usize,
    /// E-classes at the end.
    pub egraph_classes: usize,
    /// The limits.
    pub limits: Limits,
    /// The memory weight, µs per MiB.
    pub memory_us_per_mib: f64,
    /// The device whose rates costed the nodes (the cluster profile's: `compile --cluster`).
    #[serde(default)]
    pub device: String,
    /// The program's cost before.
    pub before: ProgramCost,
    /// And after.
    pub after: ProgramCost,
    /// How repeated layers were planned.
    pub layers: LayerPlanning,
    /// Communicating nodes of the result, in program order.
    pub collectives: Vec<CollectiveChoice>,
    /// Phase times.
    #[serde(skip)]
    pub timing: Timing,
    /// The optimizer state's layout, where the compiler chose it (plain data parallelism
    /// rewritten with `weight-update-sharding`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_layout: Option<StateLayoutChoice>,
}

/// The optimizer state's layout chosen by cost: the training step rewritten with the state
/// whole on every data-parallel rank (DDP) and sharded over the data axis (ZeRO-1), each
/// program's weighted cost per rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateLayoutChoice {
    /// The data axis the state may be sharded over.
    pub axis: String,
    /// The weighted cost of the step with the state whole, µs.
    pub whole_us: f64,
    /// With the state sharded, µs.
    pub sharded_us: f64,
}

impl StateLayoutChoice {
    /// Whether the sharded state is kept (strictly cheaper; a tie keeps the declared layout).
    pub fn sharded_wins(&self) -> bool {
        self.sharded_us < self.whole_us
    }
}

impl fmt::Display for StateLayoutChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kept, layout) = if self.sharded_wins() {
            (
                self.sharded_us,
                format!("sharded over {} (ZeRO-1)", self.axis),
            )
        } else {
            (self.whole_us, "whole on every rank (DDP)".to_string())
        };
        write!(
            f,
            "optimizer state {layout}: {kept:.1} µs weighted (whole {:.1}, sharded over {} {:.1})",
            self.whole_us, self.axis, self.sharded_us
        )
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl fmt::Display for RewriteReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "rewrite rules: {}", self.rules.join(", "))?;
        writeln!(
            f,
            "  stop: {} after {} iterations (limits: {} iterations, {} nodes); e-graph {} nodes, {} classes",
            self.stop_reason,
            self.iterations,
            self.limits.iters,
            self.limits.nodes,
            self.egraph_nodes,
            self.egraph_classes
        )?;
        writeln!(
            f,
            "  time: {:.1} ms (saturation {:.1} ms, extraction {:.1} ms)",
            ms(self.timing.total),
            ms(self.timing.saturate),
            ms(self.timing.extract)
        )?;
        let fired: Vec<String> = self
            .fired
            .iter()
            .map(|(r, n)| format!("{r} ×{n}"))
            .collect();
        writeln!(
            f,
            "  fired: {}",
            if fired.is_empty() {
                "nothing".to_string()
            } else {
                fired.join(", ")
            }
        )?;
        if let Some(c) = &self.state_layout {
            writeln!(f, "  {c}")?;
        }
        match &self.layers {
            LayerPlanning::Window {
                layers,
                window_nodes,
            } => writeln!(
                f,
                "  layers: {layers} layers planned once (window of layers 0, 1, {} with {window_nodes} nodes), layer 1 replicated",
                layers.saturating_sub(1)
            )?,
            LayerPlanning::Whole { reason } => {
                writeln!(f, "  layers: whole program rewritten ({reason})")?
            }
        }
        let c = |p: &ProgramCost| {
            format!(
                "{:.1} µs (compute {:.1}, comm {:.1}, activations {:.2} MiB)",
                p.weighted_us,
                p.compute_us,
                p.comm_us,
                p.activation_bytes as f64 / (1u64 << 20) as f64
            )
        };
        writeln!(
            f,
            "  cost per rank ({}, memory weight {} µs/MiB): {} → {}",
            self.device,
            self.memory_us_per_mib,
            c(&self.before),
            c(&self.after)
        )?;
        let last = self.collectives.iter().filter_map(|x| x.layer).max();
        let shown = |l: Option<u32>| l.is_none_or(|l| l <= 1 || Some(l) == last);
        writeln!(f, "  communication ({} nodes):", self.collectives.len())?;
        let mut hidden = 0usize;
        for x in &self.collectives {
            if !shown(x.layer) {
                hidden += 1;
                continue;
            }
            let why = x.rule.as_deref().unwrap_or("partitioner");
            let alt = match &x.alternative {
                Some(a) => format!(
                    "; with {} instead {:+.1} µs",
                    a.op,
                    a.program_us - x.program_us
                ),
                None => String::new(),
            };
            writeln!(
                f,
                "    %{:<5} {:<15} {:<3} {:<44} [{why}] own {:.1} µs{alt}",
                x.value, x.op, x.axis, x.name, x.own_us
            )?;
        }
        if hidden > 0 {
            writeln!(
                f,
                "    ({hidden} more in layers 2..{}, as in layer 1)",
                last.unwrap_or(0).saturating_sub(1)
            )?;
        }
        Ok(())
    }
}
