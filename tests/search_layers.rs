//! `shardc search --space layers`: the e-graph's per-matmul layouts, end to end. Every
//! program the e-graph holds for a fixture (the cost model's choice, and arbitrary ones drawn
//! by random extraction) reproduces transformers' logits on thread ranks; on the bundled
//! configs the search's choice is at least as fast as the best preset on the same mesh where
//! the presets' layouts are in its space, and fits the device.

mod common;

use common::run_shardc;
use shardc::compiler::compile::{compile_forward_with, CompileOptions};
use shardc::compiler::cost::Cluster;
use shardc::compiler::ir::Op;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::rewrite::rules::LAYER_SEARCH;
use shardc::compiler::rewrite::{CostModel, Objective, RewriteOptions, RuleSelection};
use shardc::compiler::search::layers::MatMulLayout;
use shardc::compiler::search::{search_layers, LayerSearch, LayerSearchError, LayerSearchOptions};
use shardc::compiler::shard::Mesh;
use std::path::Path;

fn options(mesh: &str, b: usize, t: usize) -> CompileOptions {
    CompileOptions {
        batch: b,
        seq: t,
        mesh: Mesh::parse(mesh, 8).expect("mesh"),
        extra_strategies: vec!["replicated".into()],
    }
}

fn layer_rules(objective: Objective) -> RewriteOptions {
    RewriteOptions {
        rules: RuleSelection::Named(LAYER_SEARCH.iter().map(|s| s.to_string()).collect()),
        objective,
        ..RewriteOptions::default()
    }
}

/// The programs the layout rules reach from a replicated fixture model, extracted by the
/// cost model (whose activation-memory term splits the tiny models' layers) and at random,
/// all compute transformers' logits on every rank.
#[test]
fn every_extracted_layout_reproduces_the_fixtures() {
    let mut split_weights = 0;
    let mut fired: std::collections::BTreeMap<String, usize> = Default::default();
    let objectives = [
        Objective::Model,
        Objective::Shuffle(1),
        Objective::Shuffle(7),
    ];
    let variants: Vec<(&str, Objective)> = ["tp=2", "dp=2,tp=2"]
        .into_iter()
        .flat_map(|mesh| objectives.map(|objective| (mesh, objective)))
        .collect();
    let ran = common::check_every_case(
        &variants,
        |cfg, case, &(mesh, objective)| {
            let opts = options(mesh, case.batch, case.seq);
            compile_forward_with(cfg, &opts, &layer_rules(objective)).ok()
        },
        |c| {
            let report = c.report.as_ref().expect("rules ran");
            for (k, v) in &report.fired {
                *fired.entry(k.clone()).or_default() += v;
            }
            split_weights += c
                .sharded
                .graph
                .nodes
                .iter()
                .filter(|n| matches!(&n.op, Op::Param(p) if !p.shards.is_empty()))
                .count();
        },
    );
    eprintln!("{ran} runs, {split_weights} split weights; fired {fired:?}");
    assert!(ran >= 12, "only {ran} runs");
    assert!(split_weights > 0, "no program split a weight");
    let layout_rules = [
        "tp-column",
        "tp-row",
        "slice-leaf",
        "gather-sink-reshape-split",
        "gather-sink-rope-heads",
        "gather-sink-attention",
        "reduce-sink-linear",
    ];
    common::assert_each_counted(&fired, layout_rules, |rule| format!("{rule} never fired"));
}

fn search(model: &str, mesh: &str, batch: usize, seq: usize) -> LayerSearch {
    try_search(model, mesh, batch, seq).expect("search")
}

fn try_search(
    model: &str,
    mesh: &str,
    batch: usize,
    seq: usize,
) -> Result<LayerSearch, LayerSearchError> {
    let cfg = ModelConfig::from_path(Path::new(model)).expect("config");
    let cluster = Cluster::resolve("dgx-h100").expect("cluster");
    let o = LayerSearchOptions {
        batch,
        seq,
        mesh: Mesh::parse(mesh, 8).expect("mesh"),
        cost: CostModel {
            device: cluster.rewrite_device(),
            ..CostModel::default()
        },
        capacity: (0.95 * cluster.device.memory().0 as f64) as u64,
    };
    search_layers(&cfg, &o)
}

fn layout_of(r: &LayerSearch, op: &str) -> MatMulLayout {
    r.choices
        .iter()
        .find(|c| c.op == op)
        .unwrap_or_else(|| panic!("no choice for {op}: {:?}", r.choices))
        .layout
}

fn time_of(r: &LayerSearch, name: &str) -> f64 {
    r.programs
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no program {name}"))
        .time_us
}

/// Llama-3-8B on a node: head-parallel attention (column q/k/v, row o) beside an MLP on
/// sequence shards with whole weights, which no preset expresses, faster than every preset by
/// the same cost model, and its weights fit; Llama-3-70B's weights do not fit that way, so the
/// memory weight rises until the search lands on Megatron's layout, as fast as `tp+sp`.
#[test]
fn the_layer_search_mixes_layouts_where_they_fit() {
    let r = search("models/llama-3-8b.json", "tp=8", 1, 4096);
    assert_eq!(r.memory_weight, 0.0);
    assert_eq!(layout_of(&r, "layers.*.attn.q_proj"), MatMulLayout::Column);
    assert_eq!(layout_of(&r, "layers.*.attn.o_proj"), MatMulLayout::Row);
    assert_eq!(layout_of(&r, "layers.*.mlp.up_proj"), MatMulLayout::Tokens);
    assert_eq!(r.programs[0].name, "layers (e-graph)");
    assert!(r.programs[0].fits);
    let best_preset = r.programs[1..]
        .iter()
        .map(|p| p.time_us)
        .fold(f64::INFINITY, f64::min);
    assert!(r.programs[0].time_us < best_preset, "{r}");
    assert!(!r.beyond_presets().is_empty());

    let r = search("models/llama-3-70b.json", "tp=8", 1, 4096);
    assert!(r.memory_weight > 0.0, "{r}");
    assert!(r.programs[0].fits);
    for op in ["layers.*.mlp.up_proj", "layers.*.attn.q_proj"] {
        assert_eq!(layout_of(&r, op), MatMulLayout::Column, "{op}\n{r}");
    }
    assert_eq!(layout_of(&r, "layers.*.mlp.down_proj"), MatMulLayout::Row);
    let sp = time_of(&r, "tp+sp (Megatron)");
    assert!(r.programs[0].time_us <= sp * 1.01, "{r}");

    // 405B's weights do not fit eight H100s however they are split: a named error.
    let e = try_search("models/llama-3.1-405b.json", "tp=8", 1, 4096).expect_err("too big");
    assert!(matches!(e, LayerSearchError::DoesNotFit { .. }), "{e}");
    assert!(e.to_string().contains("GB of weights per rank"), "{e}");
}

/// The tiny fixtures are launch-bound: splitting buys nothing, so the search keeps them whole.
#[test]
fn tiny_models_stay_replicated() {
    let r = search("tests/fixtures/hf-tiny/llama/config.json", "tp=2", 2, 16);
    assert!(r
        .choices
        .iter()
        .all(|c| c.layout == MatMulLayout::Replicated));
    assert!((r.programs[0].time_us - time_of(&r, "replicated")).abs() < 1e-6);
}

/// `-o` compiles the search's choice through the one driver; `run --plan` runs it and
/// reproduces transformers' logits. Text and JSON name the layouts; bad flags are refused.
#[test]
fn the_cli_writes_a_plan_that_runs() {
    let dir = tempfile::tempdir().expect("tmp");
    let plan = dir.path().join("plan.json");
    let fixture = "tests/fixtures/hf-tiny/llama";
    let case = common::cases()
        .into_iter()
        .find(|c| c.model == "llama" && c.batch == 2 && c.seq == 16)
        .expect("llama b2 s16 case");
    let args = [
        "search",
        fixture,
        "--space",
        "layers",
        "--mesh",
        "tp=2",
        "--batch",
        "2",
        "--seq",
        "16",
        "-o",
        plan.to_str().unwrap(),
    ];
    let (ok, out, err) = run_shardc(&args, &[]);
    assert!(ok, "{err}");
    assert!(
        out.contains("layers (e-graph)") && out.contains("matmul layouts"),
        "{out}"
    );
    let tokens = dir.path().join("tokens.json");
    std::fs::write(&tokens, case.json["input_ids"].to_string()).unwrap();
    let logits = dir.path().join("out.json");
    let (ok, _, err) = run_shardc(
        &[
            "run",
            fixture,
            "--plan",
            plan.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
            "--out",
            logits.to_str().unwrap(),
        ],
        &[],
    );
    assert!(ok, "{err}");
    let v = common::read_json(&logits);
    let got: Vec<f32> = common::flat_f32(&v["logits"]);
    let d = got
        .iter()
        .zip(&case.logits)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert_eq!(got.len(), case.logits.len());
    assert!(d < 1e-4, "max |Δlogit| {d}");

    let (ok, out, err) = run_shardc(&[&args[..10], &["--json"]].concat(), &[]);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(j["programs"][0]["name"], "layers (e-graph)");
    assert!(j["choices"].as_array().is_some_and(|c| !c.is_empty()));

    // A training step keeps its declared layouts: the layout rules are refused by name.
    let (ok, _, err) = run_shardc(
        &[
            "compile",
            fixture,
            "--train",
            "--mesh",
            "tp=2",
            "--strategy",
            "replicated",
            "--batch",
            "2",
            "--seq",
            "16",
            "--rewrite",
            "layout",
            "-o",
            dir.path().join("t.json").to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        !ok && err.contains("rewrite rule `tp-column` chooses a forward program"),
        "{err}"
    );

    for (bad, needle) in [
        (vec!["--space", "cubes"], "--space `cubes`"),
        (vec!["--space", "layers", "--gpus", "16"], "--gpus"),
        (vec!["--mesh", "tp=2"], "--mesh"),
        (
            vec!["--space", "layers", "--mesh", "dp=2"],
            "`tp` mesh axis",
        ),
    ] {
        let mut a = vec!["search", fixture, "--batch", "2", "--seq", "16"];
        a.extend(bad);
        let (ok, _, err) = run_shardc(&a, &[]);
        assert!(!ok && err.contains(needle), "{a:?}: {err}");
    }
}
