//! `shardc search --space layers`: each matmul's layout chosen by the e-graph.
//!
//! The forward program is built with its `tp` axis `replicated` (every rank holds and computes
//! the whole model) and rewritten with the `layout` rules and the sequence-parallel groups
//! ([`LAYER_SEARCH`]): the e-graph then holds, for every matmul, the replicated, column- and
//! row-parallel forms, and for every per-token op its form on sequence shards, and the
//! extractor chooses under the rewriter's cost model (time plus weighted activation memory).
//! That is the intra-operator half of Alpa's search done by equality saturation: the choice is
//! per matmul and per layer (repeated layers planned once, as every rewrite plans them), and
//! it can mix what no preset expresses (head-parallel attention beside a token-parallel MLP,
//! say).
//!
//! The objective is time (kernels and collectives, each node once), and memory a constraint:
//! the weights a rank holds must fit the usable device memory (a forward pass's activations
//! live about a layer). The extractor weighs memory (activations and weights alike) by a
//! factor λ µs per MiB, 0 first and doubled from 1/64 until the chosen program's weights fit
//! (a Lagrangian relaxation of the constraint); the report gives λ.
//!
//! The result is compared, under the same cost model, with the programs the presets give on
//! the same mesh: replicated, Megatron `tp`, `tp` + `sp`, and `tp` rewritten by the
//! sequence-parallel rules.

use crate::compile::{compile_forward_with, CompileError, CompileOptions, Compiled};
use crate::ir::{Graph, Op, Role, ValueId};
use crate::model::ModelConfig;
use crate::rewrite::rules::LAYER_SEARCH;
use crate::rewrite::{program_cost, CostModel, RewriteOptions, RuleSelection};
use crate::shard::{Mesh, ShardedGraph};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Instant;

/// What the layer search runs on.
#[derive(Clone, Debug)]
pub struct LayerSearchOptions {
    /// Sequences per forward pass.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The mesh (its `tp` axis is the one whose layouts are chosen).
    pub mesh: Mesh,
    /// The rewriter's cost model (device rates; its memory weights are the search's).
    pub cost: CostModel,
    /// Bytes of weights a rank may hold (the usable device memory).
    pub capacity: u64,
}

/// One program's cost per rank under the rewriter's cost model.
#[derive(Clone, Debug, Serialize)]
pub struct ProgramRow {
    /// What produced it (`layers`, `tp`, `tp+sp`, ...).
    pub name: String,
    /// Kernel time, µs (each node once, no overlap).
    pub compute_us: f64,
    /// Communication time, µs.
    pub comm_us: f64,
    /// Compute plus communication, µs: the objective.
    pub time_us: f64,
    /// Activation bytes produced (without reuse).
    pub activation_bytes: u64,
    /// Weight bytes a rank holds (bf16).
    pub weight_bytes: u64,
    /// The weights fit the capacity.
    pub fits: bool,
}

/// How one matmul is laid out over the searched axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MatMulLayout {
    /// Whole weight, whole input: every rank computes all of it.
    Replicated,
    /// Weight split along its output dim (Megatron column-parallel).
    Column,
    /// Weight split along its input dim, partial sums reduced (Megatron row-parallel).
    Row,
    /// Whole weight, the input's tokens split (data/sequence parallel inside the layer).
    Tokens,
}

impl MatMulLayout {
    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            MatMulLayout::Replicated => "replicated",
            MatMulLayout::Column => "column",
            MatMulLayout::Row => "row",
            MatMulLayout::Tokens => "tokens",
        }
    }
}

/// The layout chosen for one matmul (by name, layer index as `*`) over a run of layers.
#[derive(Clone, Debug, Serialize)]
pub struct Choice {
    /// The matmul's label with the layer index replaced by `*` (`layers.*.mlp.up_proj`).
    pub op: String,
    /// First and last layer of the run (`None`: outside the layers).
    pub layers: Option<(u32, u32)>,
    /// The layout the search chose.
    pub layout: MatMulLayout,
    /// The Megatron `tp` preset's layout of the same matmul.
    pub preset: Option<MatMulLayout>,
}

/// The layer search's result.
#[derive(Clone, Debug, Serialize)]
pub struct LayerSearch {
    /// The model's name.
    pub model: String,
    /// The mesh.
    pub mesh: String,
    /// Sequences × tokens.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The searched program first, then the presets', fastest first.
    pub programs: Vec<ProgramRow>,
    /// The presets that do not compile on this mesh, with why.
    pub refused: Vec<(String, String)>,
    /// Each matmul's layout, runs of equal layers merged.
    pub choices: Vec<Choice>,
    /// The memory weight λ (µs per MiB) the fitting extraction used.
    pub memory_weight: f64,
    /// E-graph size and rules fired of the chosen extraction.
    pub egraph_nodes: usize,
    /// Rule applications by rule.
    pub fired: BTreeMap<String, usize>,
    /// Wall time of the whole search, s.
    pub search_time_s: f64,
    /// What compiles the searched program again through the one driver (`-o`): the
    /// forward job on the `replicated` mesh, and the rewrite with the λ found.
    #[serde(skip)]
    pub compile: (CompileOptions, RewriteOptions),
}

/// A layer search that could not run.
#[derive(Debug, thiserror::Error)]
pub enum LayerSearchError {
    /// The model does not compile on the mesh.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// The mesh has no `tp` axis of more than one rank.
    #[error("--space layers chooses layouts over a `tp` mesh axis of more than one rank; mesh is {0} (e.g. --mesh tp=8)")]
    NoTpAxis(String),
    /// Not even the most sharded extraction fits.
    #[error("no layout the e-graph holds fits: its most split one holds {:.1} GB of weights per rank, the device {:.1} GB usable (more tp ranks, or a larger device)", *need as f64 / 1e9, *capacity as f64 / 1e9)]
    DoesNotFit {
        /// Weight bytes of the most memory-weighted extraction.
        need: u64,
        /// The capacity.
        capacity: u64,
    },
}

/// Bytes of bf16 weights a rank of `g` holds.
fn weight_bytes(g: &Graph) -> u64 {
    g.nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Param(_)))
        .map(|n| 2 * n.ty.numel() as u64)
        .sum()
}

/// The time-only cost model of `cost`'s device.
fn time_only(cost: &CostModel) -> CostModel {
    memory_weighted(cost, 0.0)
}

/// `cost` with memory, activations and weights alike, weighed `lambda` µs per MiB.
fn memory_weighted(cost: &CostModel, lambda: f64) -> CostModel {
    CostModel {
        memory_us_per_mib: lambda,
        saved_factor: 0.0,
        weight_factor: 1.0,
        ..cost.clone()
    }
}

fn row(name: &str, sg: &ShardedGraph, cost: &CostModel, capacity: u64) -> ProgramRow {
    let c = program_cost(&time_only(cost), &sg.graph, &sg.mesh);
    let weights = weight_bytes(&sg.graph);
    ProgramRow {
        name: name.into(),
        compute_us: c.compute_us,
        comm_us: c.comm_us,
        time_us: c.compute_us + c.comm_us,
        activation_bytes: c.activation_bytes,
        weight_bytes: weights,
        fits: weights <= capacity,
    }
}

/// The layout of each matmul of `sg` over axis `axis`, by label: `(label, layer, layout)`.
pub fn matmul_layouts(sg: &ShardedGraph, axis: &str) -> Vec<(String, Option<u32>, MatMulLayout)> {
    let g = &sg.graph;
    let Some(a) = sg.mesh.axis(axis) else {
        return Vec::new();
    };
    let split = |v: ValueId| -> Option<usize> {
        sg.shardings
            .get(v.index())
            .and_then(|s| s.dims.iter().position(|d| d.contains(&a)))
    };
    let mut out = Vec::new();
    for v in g.ids() {
        let n = g.node(v);
        let tb = match n.op {
            Op::MatMul { transpose_b } | Op::FusedMatMul { transpose_b, .. } => transpose_b,
            _ => continue,
        };
        let (x, w) = (n.inputs[0], n.inputs[1]);
        let r = g.ty(w).rank();
        if r < 2 {
            continue;
        }
        // A weight's split: a parameter's own shards, else its layout.
        let wsplit = match &g.node(w).op {
            Op::Param(p) => p.shards.iter().find(|s| s.axis == axis).map(|s| s.dim),
            _ => split(w),
        };
        let (out_dim, in_dim) = if tb { (r - 2, r - 1) } else { (r - 1, r - 2) };
        let layout = match wsplit {
            Some(d) if d == out_dim => MatMulLayout::Column,
            Some(d) if d == in_dim => MatMulLayout::Row,
            _ => {
                let xt = g.ty(x);
                let tokens = split(x).is_some_and(|d| {
                    matches!(
                        xt.dims.get(d).map(|d| d.role),
                        Some(Role::Batch | Role::Seq)
                    )
                });
                if tokens {
                    MatMulLayout::Tokens
                } else {
                    MatMulLayout::Replicated
                }
            }
        };
        out.push((layer_free(&n.name, n.layer), n.layer, layout));
    }
    out
}

/// `layers.12.mlp.up_proj` → `layers.*.mlp.up_proj` (for the node's own layer).
fn layer_free(name: &str, layer: Option<u32>) -> String {
    match layer {
        Some(l) => name.replacen(&format!("layers.{l}."), "layers.*.", 1),
        None => name.to_string(),
    }
}

/// Runs of equal layouts per matmul label, in program order of first appearance.
fn choices(
    found: &[(String, Option<u32>, MatMulLayout)],
    preset: &[(String, Option<u32>, MatMulLayout)],
) -> Vec<Choice> {
    let preset_of: BTreeMap<(&str, Option<u32>), MatMulLayout> = preset
        .iter()
        .map(|(n, l, x)| ((n.as_str(), *l), *x))
        .collect();
    let mut order: Vec<&str> = Vec::new();
    for (n, _, _) in found {
        if !order.contains(&n.as_str()) {
            order.push(n);
        }
    }
    let mut out: Vec<Choice> = Vec::new();
    for name in order {
        let mut rows: Vec<(Option<u32>, MatMulLayout)> = found
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, l, x)| (*l, *x))
            .collect();
        rows.sort();
        for (layer, layout) in rows {
            let preset = preset_of.get(&(name, layer)).copied();
            if let Some(last) = out.last_mut() {
                let extends = last.op == name
                    && last.layout == layout
                    && last.preset == preset
                    && matches!((last.layers, layer), (Some((_, b)), Some(l)) if l == b + 1);
                if extends {
                    if let (Some((a, _)), Some(l)) = (last.layers, layer) {
                        last.layers = Some((a, l));
                    }
                    continue;
                }
            }
            out.push(Choice {
                op: name.to_string(),
                layers: layer.map(|l| (l, l)),
                layout,
                preset,
            });
        }
    }
    out
}

/// Searches each matmul's layout of `cfg`'s forward pass on `o.mesh`'s `tp` axis.
pub fn search_layers(
    cfg: &ModelConfig,
    o: &LayerSearchOptions,
) -> Result<LayerSearch, LayerSearchError> {
    let t0 = Instant::now();
    if o.mesh.axis("tp").is_none_or(|a| o.mesh.axis_size(a) < 2) {
        return Err(LayerSearchError::NoTpAxis(o.mesh.to_string()));
    }
    let copts = |extra: &[&str]| CompileOptions {
        batch: o.batch,
        seq: o.seq,
        mesh: o.mesh.clone(),
        extra_strategies: extra.iter().map(|s| s.to_string()).collect(),
    };
    let rules = RuleSelection::Named(LAYER_SEARCH.iter().map(|s| s.to_string()).collect());
    let rewrite_with = |lambda: f64| RewriteOptions {
        cost: memory_weighted(&o.cost, lambda),
        ..RewriteOptions::with_rules(rules.clone())
    };
    let searched = |lambda: f64| -> Result<Compiled, CompileError> {
        compile_forward_with(cfg, &copts(&["replicated"]), &rewrite_with(lambda))
    };
    // λ = 0, then 1/64, doubling, until the weights fit (at 2^20 µs per MiB, memory is all
    // the extractor sees).
    let mut lambda = 0.0;
    let mut found = searched(lambda)?;
    while weight_bytes(&found.sharded.graph) > o.capacity {
        lambda = if lambda == 0.0 {
            1.0 / 64.0
        } else {
            2.0 * lambda
        };
        if lambda > f64::from(1u32 << 20) {
            return Err(LayerSearchError::DoesNotFit {
                need: weight_bytes(&found.sharded.graph),
                capacity: o.capacity,
            });
        }
        found = searched(lambda)?;
    }
    let preset = |extra: &[&str], rw: RewriteOptions| -> Result<Compiled, CompileError> {
        compile_forward_with(cfg, &copts(extra), &rw)
    };
    let plain = RewriteOptions {
        cost: time_only(&o.cost),
        ..RewriteOptions::default()
    };
    let sp_rules = RewriteOptions {
        rules: "sequence-parallel".parse().map_err(CompileError::Rewrite)?,
        ..plain.clone()
    };
    let mut programs = vec![row("layers (e-graph)", &found.sharded, &o.cost, o.capacity)];
    let mut refused = Vec::new();
    let mut tp_layouts = Vec::new();
    let presets: [(&str, &[&str], &RewriteOptions); 4] = [
        ("tp (Megatron)", &[], &plain),
        ("tp+sp (Megatron)", &["sp"], &plain),
        ("tp rewritten (sequence-parallel)", &[], &sp_rules),
        ("replicated", &["replicated"], &plain),
    ];
    for (name, extra, rw) in presets {
        match preset(extra, rw.clone()) {
            Ok(c) => {
                if extra.is_empty() && rw.rules == RuleSelection::None {
                    tp_layouts = matmul_layouts(&c.sharded, "tp");
                }
                programs.push(row(name, &c.sharded, &o.cost, o.capacity));
            }
            Err(e) => refused.push((name.to_string(), e.to_string())),
        }
    }
    programs[1..].sort_by(|a, b| a.time_us.total_cmp(&b.time_us));
    let report = found.report.clone();
    let choices = choices(&matmul_layouts(&found.sharded, "tp"), &tp_layouts);
    Ok(LayerSearch {
        model: cfg.arch.name().to_string(),
        mesh: o.mesh.to_string(),
        batch: o.batch,
        seq: o.seq,
        programs,
        refused,
        choices,
        memory_weight: lambda,
        egraph_nodes: report.as_ref().map_or(0, |r| r.egraph_nodes),
        fired: report.map(|r| r.fired).unwrap_or_default(),
        search_time_s: t0.elapsed().as_secs_f64(),
        compile: (copts(&["replicated"]), rewrite_with(lambda)),
    })
}

impl LayerSearch {
    /// The matmuls whose chosen layout no preset gives them, with the tp preset's.
    pub fn beyond_presets(&self) -> Vec<&Choice> {
        self.choices
            .iter()
            .filter(|c| c.preset.is_some_and(|p| p != c.layout))
            .collect()
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl fmt::Display for LayerSearch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "layer search: {} on {}, batch {} × seq {} (forward; each matmul's layout chosen by \
             the e-graph)",
            self.model, self.mesh, self.batch, self.seq
        )?;
        let fired: usize = self.fired.values().sum();
        let lambda = if self.memory_weight == 0.0 {
            "0: the fastest layouts' weights fit".to_string()
        } else {
            format!(
                "{} µs/MiB, raised until the weights fit",
                self.memory_weight
            )
        };
        writeln!(
            f,
            "  e-graph {} nodes, {fired} rule applications; memory weight {lambda}; {:.2} s",
            self.egraph_nodes, self.search_time_s
        )?;
        writeln!(
            f,
            "\n  {:<34} {:>10} {:>11} {:>10} {:>10} {:>12} {:>8}",
            "program (per rank)",
            "time µs",
            "compute µs",
            "comm µs",
            "act MiB",
            "weights MiB",
            "vs layers"
        )?;
        let best = self.programs[0].time_us;
        for p in &self.programs {
            writeln!(
                f,
                "  {:<34} {:>10.1} {:>11.1} {:>10.1} {:>10.2} {:>12.2} {:>+7.1}%{}",
                p.name,
                p.time_us,
                p.compute_us,
                p.comm_us,
                mib(p.activation_bytes),
                mib(p.weight_bytes),
                100.0 * (p.time_us / best - 1.0),
                if p.fits { "" } else { "  (weights do not fit)" }
            )?;
        }
        for (name, why) in &self.refused {
            writeln!(f, "  {name:<34} refused: {why}")?;
        }
        writeln!(
            f,
            "\n  matmul layouts chosen (the tp preset's where it differs):"
        )?;
        for c in &self.choices {
            let layers = match c.layers {
                Some((a, b)) if a == b => format!("layer {a}"),
                Some((a, b)) => format!("layers {a}-{b}"),
                None => String::new(),
            };
            let preset = match c.preset {
                Some(p) if p != c.layout => format!("  [tp: {}]", p.name()),
                _ => String::new(),
            };
            writeln!(
                f,
                "    {:<28} {:<13} {}{preset}",
                c.op,
                layers,
                c.layout.name()
            )?;
        }
        let beyond = self.beyond_presets();
        if beyond.is_empty() {
            writeln!(f, "\n  every matmul as the tp preset lays it out")?;
        } else {
            // Each matmul once (its runs of layers are consecutive), each layout once.
            let mut names: Vec<&str> = beyond.iter().map(|c| c.op.as_str()).collect();
            names.dedup();
            let layouts: std::collections::BTreeSet<&str> =
                beyond.iter().map(|c| c.layout.name()).collect();
            let layouts: Vec<&str> = layouts.into_iter().collect();
            writeln!(
                f,
                "\n  beyond the presets: {} laid out otherwise than Megatron's tp ({})",
                names.join(", "),
                layouts.join(", ")
            )?;
        }
        Ok(())
    }
}
