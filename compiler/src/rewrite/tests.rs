//! Tests of the pass on the fixture and bundled models. The differential tests on thread
//! ranks (every rule on random programs; rewritten fixture models against transformers'
//! logits) are in the repository's `tests/rewrite_*.rs`.

use super::*;
use crate::compile::{compile_forward, compile_forward_with, CompileOptions};
use crate::model::ModelConfig;
use crate::plan::Plan;
use std::path::PathBuf;

/// A bundled config (`*.json` under `models/`) or an hf-tiny fixture by name.
pub(super) fn cfg(name: &str) -> ModelConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = if name.ends_with(".json") {
        root.join("models").join(name)
    } else {
        root.join("tests/fixtures/hf-tiny").join(name)
    };
    ModelConfig::from_path(&p).expect("config")
}

fn opts(mesh: &str, extra: &[&str], b: usize, t: usize) -> CompileOptions {
    CompileOptions {
        batch: b,
        seq: t,
        mesh: Mesh::parse(mesh, 8).expect("mesh"),
        extra_strategies: extra.iter().map(|s| s.to_string()).collect(),
    }
}

fn sel(s: &str) -> RewriteOptions {
    RewriteOptions::with_rules(s.parse().expect("rules"))
}

/// `g` with only the output `logits` (and what it needs).
fn logits_only(g: &Graph) -> Graph {
    let mut g = g.clone();
    g.outputs.retain(|(n, _)| n == "logits");
    g
}

#[test]
fn readme_lists_every_rule() {
    let readme = include_str!("rules/README.md");
    for r in rules::list() {
        let row = format!("| `{}` | `{}` |", r.name, r.group);
        assert!(
            readme.contains(&row),
            "README.md lacks the row of {}",
            r.name
        );
    }
    let all = RuleSelection::All.resolve().expect("all");
    assert!(all.iter().all(|r| !r.test_only()));
    let group = RuleSelection::Named(vec!["gather-sink".into()])
        .resolve()
        .expect("group");
    assert!(group.iter().all(|r| !r.test_only()) && group.len() >= 4);
    let broken = RuleSelection::Named(vec!["broken-gather-sink-norm".into()])
        .resolve()
        .expect("by name");
    assert_eq!(broken.len(), 1);
}

#[test]
fn unknown_rules_are_errors_naming_the_valid_ones() {
    let e = "allreduce-split,frobnicate"
        .parse::<RuleSelection>()
        .expect_err("unknown");
    let msg = e.to_string();
    assert!(msg.contains("frobnicate") && msg.contains("gather-sink") && msg.contains("all"));
    assert_eq!("none".parse::<RuleSelection>(), Ok(RuleSelection::None));
    assert_eq!("all".parse::<RuleSelection>(), Ok(RuleSelection::All));
}

/// Loading a program and extracting it with no rule applied gives it back node for node.
#[test]
fn round_trip_is_exact_when_no_rule_fires() {
    let cases = [
        ("llama", "tp=2", vec![]),
        ("llama", "dp=2,tp=2", vec!["sp"]),
        ("gpt2", "tp=4", vec![]),
        ("mixtral", "ep=2,tp=2", vec![]),
        ("mixtral", "tp=2", vec!["sp"]),
    ];
    for (model, mesh, extra) in cases {
        let c = compile_forward(&cfg(model), &opts(mesh, &extra, 2, 16)).expect("compile");
        let sg = &c.sharded;
        let run = run_once(sg, &[], &RewriteOptions::default()).expect("run");
        let out = &run.emitted.sharded;
        assert!(run.fired.is_empty());
        assert_eq!(out.graph, sg.graph, "{model} {mesh}");
        assert_eq!(out.graph.to_string(), sg.graph.to_string());
        assert_eq!(out.shardings, sg.shardings, "{model} {mesh}");
        assert_eq!(out.provenance, sg.provenance, "{model} {mesh}");
    }
    // A selection whose rules find nothing to rewrite: no rule fires, the program is kept.
    let c = compile_forward(&cfg("llama"), &opts("tp=2", &[], 2, 16)).expect("compile");
    let r = rewrite(&c.sharded, &sel("collective-matmul")).expect("rewrite");
    assert!(r.report.fired.is_empty(), "{:?}", r.report.fired);
    assert_eq!(r.sharded.graph, c.sharded.graph);
}

fn assert_discovers_sp(model: &str, mesh: &str, b: usize, t: usize) {
    let c = cfg(model);
    let sp = compile_forward(&c, &opts(mesh, &["sp"], b, t)).expect("sp preset");
    let tp = compile_forward_with(&c, &opts(mesh, &[], b, t), &sel("sequence-parallel"))
        .expect("tp rewritten");
    let report = tp.report.as_ref().expect("report");
    assert!(report.fired.get("allreduce-split").copied().unwrap_or(0) > 0);
    assert_eq!(
        canonical_text(&tp.sharded.graph),
        canonical_text(&sp.sharded.graph),
        "{model} {mesh}: tp rewritten is not the sp preset\n{report}"
    );
    // With every rule the two starting points meet again (fused kernels, collective matmuls).
    let all_tp = compile_forward_with(&c, &opts(mesh, &[], b, t), &sel("all")).expect("tp all");
    let all_sp = compile_forward_with(&c, &opts(mesh, &["sp"], b, t), &sel("all")).expect("sp all");
    assert_eq!(
        canonical_text(&all_tp.sharded.graph),
        canonical_text(&all_sp.sharded.graph),
        "{model} {mesh}: --rewrite all from tp and from sp differ"
    );
}

#[test]
fn megatron_tp_rewritten_is_megatron_sp() {
    assert_discovers_sp("llama", "tp=2", 2, 16);
    // Four ranks, two KV heads: replicated KV projections move onto sequence shards too.
    assert_discovers_sp("llama", "tp=4", 2, 16);
    assert_discovers_sp("gpt2", "tp=2", 2, 16);
    assert_discovers_sp("gpt2", "tp=4", 1, 36);
}

#[test]
fn megatron_tp_rewritten_is_megatron_sp_at_scale() {
    // 32 layers: planned through a window and replicated.
    let c = cfg("llama-3-8b.json");
    assert_discovers_sp("llama-3-8b.json", "tp=8", 8, 4096);
    let r = compile_forward_with(&c, &opts("tp=8", &[], 8, 4096), &sel("all")).expect("all");
    let report = r.report.expect("report");
    assert!(
        matches!(report.layers, LayerPlanning::Window { layers: 32, .. }),
        "{:?}",
        report.layers
    );
    assert!(report.after.weighted_us < report.before.weighted_us);
}

#[test]
fn on_data_and_tensor_parallel_meshes_only_the_output_gather_differs() {
    for model in ["llama", "gpt2"] {
        let c = cfg(model);
        let sp = compile_forward(&c, &opts("dp=2,tp=2", &["sp"], 2, 16)).expect("sp");
        let tp = compile_forward_with(
            &c,
            &opts("dp=2,tp=2", &[], 2, 16),
            &sel("sequence-parallel"),
        )
        .expect("tp");
        // The logits path is the preset's, node for node.
        assert_eq!(
            canonical_text(&logits_only(&tp.sharded.graph)),
            canonical_text(&logits_only(&sp.sharded.graph)),
            "{model}"
        );
        // For `hidden` the rewrite reuses the tensor-parallel gather the lm_head already
        // needs; the preset gathers again. One collective fewer, and cheaper.
        let count = |g: &Graph| g.nodes.iter().filter(|n| n.op.is_collective()).count();
        assert_eq!(
            count(&tp.sharded.graph) + 1,
            count(&sp.sharded.graph),
            "{model}"
        );
        let m = CostModel::default();
        let mesh = &tp.sharded.mesh;
        assert!(
            program_cost(&m, &tp.sharded.graph, mesh).weighted_us
                < program_cost(&m, &sp.sharded.graph, mesh).weighted_us
        );
    }
}

#[test]
fn the_memory_term_is_what_makes_sequence_parallelism_win_on_tiny_models() {
    let c = cfg("llama");
    let collectives = |w: f64| {
        let mut o = sel("sequence-parallel");
        o.cost.memory_us_per_mib = w;
        let r = compile_forward_with(&c, &opts("tp=2", &[], 2, 16), &o).expect("compile");
        let g = r.sharded.graph;
        let n = |m: &str| g.nodes.iter().filter(|n| n.op.mnemonic() == m).count();
        (n("all_reduce"), n("reduce_scatter"))
    };
    // Time only: an all-reduce is one launch where the split pays two, and at 8 KiB the
    // smaller norms save nothing: plain tensor parallelism stays.
    assert_eq!(collectives(0.0), (7, 0));
    // With the memory term, the norm and residual activations 1/tp the size decide.
    assert_eq!(collectives(cost::DEFAULT_MEMORY_US_PER_MIB), (0, 7));
}

#[test]
fn mixture_of_experts_rewrites_no_worse_than_the_preset() {
    for mesh in ["tp=2", "tp=4", "dp=2,tp=2"] {
        let c = cfg("mixtral");
        let m = CostModel::default();
        for rules in ["sequence-parallel", "all"] {
            let tp = compile_forward_with(&c, &opts(mesh, &[], 2, 16), &sel(rules)).expect("tp");
            let sp = if rules == "all" {
                compile_forward_with(&c, &opts(mesh, &["sp"], 2, 16), &sel(rules))
            } else {
                compile_forward(&c, &opts(mesh, &["sp"], 2, 16))
            }
            .expect("sp");
            let mesh_ = &tp.sharded.mesh;
            let a = program_cost(&m, &tp.sharded.graph, mesh_).weighted_us;
            let b = program_cost(&m, &sp.sharded.graph, mesh_).weighted_us;
            assert!(a <= b + 1e-6, "{mesh} {rules}: rewrite {a} preset {b}");
        }
    }
}

#[test]
fn same_input_gives_byte_identical_plans() {
    for (model, mesh, b, t) in [
        ("llama-3-8b.json", "dp=2,tp=4", 8, 2048),
        ("mixtral", "tp=2", 2, 16),
    ] {
        let c = cfg(model);
        let plan = || {
            let r = compile_forward_with(&c, &opts(mesh, &[], b, t), &sel("all")).expect("compile");
            Plan::new(&r, model, "llama", c.layers).to_json()
        };
        let (a, b) = (plan(), plan());
        assert!(a.contains("\"rewrite\""));
        assert!(a == b, "{model}: plans differ between two compiles");
    }
}

#[test]
fn repeated_layers_planned_once_match_planning_them_all() {
    for model in ["llama", "gpt2"] {
        let mut c = cfg(model);
        c.layers = 6;
        for rules in ["sequence-parallel", "all"] {
            let mut once = sel(rules);
            once.dedup = true;
            let mut whole = sel(rules);
            whole.dedup = false;
            let a = compile_forward_with(&c, &opts("tp=2", &[], 2, 16), &once).expect("once");
            let b = compile_forward_with(&c, &opts("tp=2", &[], 2, 16), &whole).expect("whole");
            let ra = a.report.as_ref().expect("report");
            assert!(
                matches!(ra.layers, LayerPlanning::Window { layers: 6, .. }),
                "{model} {rules}: {:?}",
                ra.layers
            );
            let m = &a.sharded.mesh;
            let ca = program_cost(&once.cost, &a.sharded.graph, m).weighted_us;
            let cb = program_cost(&once.cost, &b.sharded.graph, m).weighted_us;
            // Planning the template once never does worse here than planning every layer.
            assert!(ca <= cb + 1e-6, "{model} {rules}: once {ca} whole {cb}");
            if rules == "sequence-parallel" {
                assert_eq!(
                    canonical_text(&a.sharded.graph),
                    canonical_text(&b.sharded.graph),
                    "{model} {rules}"
                );
            }
            assert_eq!(a.sharded.shardings.len(), a.sharded.graph.len());
            assert_eq!(a.sharded.provenance.len(), a.sharded.graph.len());
            crate::ir::verify(&a.sharded.graph).expect("verifies");
        }
    }
}

#[test]
fn the_report_names_each_collectives_rule_and_cost() {
    let c = cfg("llama");
    let r = compile_forward_with(&c, &opts("tp=2", &[], 2, 16), &sel("all")).expect("compile");
    let report = r.report.expect("report");
    assert_eq!(report.stop_reason, "Saturated");
    assert!(report.egraph_nodes > r.sharded.graph.len() / 2);
    let g = &r.sharded.graph;
    let communicating = g.nodes.iter().filter(|n| n.op.communicates()).count();
    assert_eq!(report.collectives.len(), communicating);
    for x in &report.collectives {
        let n = g.node(crate::ir::ValueId(x.value));
        assert_eq!(n.op.mnemonic(), x.op);
        assert_eq!(n.name, x.name);
        assert!(x.program_us > 0.0 && x.own_us > 0.0);
        if let Some(a) = &x.alternative {
            // The choice was at least as good as the best alternative (a local optimum).
            assert!(a.program_us >= x.program_us - 1e-6, "{x:?}");
        }
    }
    assert!(report
        .collectives
        .iter()
        .any(|x| x.rule.as_deref() == Some("allreduce-split")));
    assert!(report.collectives.iter().any(|x| x.rule.is_none()));
    let text = report.to_string();
    assert!(text.contains("stop: Saturated") && text.contains("fired:"));
}
