//! The pass on training steps (forward, backward, AdamW): the round trip, sequence
//! parallelism emerging in the backward pass, repeated layers planned once. The numerics of
//! rewritten steps against the fixtures are in the repository's `tests/train_rewrite.rs`.

use super::*;
use crate::model::ModelConfig;
use crate::train::{compile_train, CompiledTrain, TrainOptions};
use std::path::PathBuf;

fn cfg(name: &str) -> ModelConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = if name.ends_with(".json") {
        root.join("models").join(name)
    } else {
        root.join("tests/fixtures/hf-tiny").join(name)
    };
    ModelConfig::from_path(&p).expect("config")
}

fn train(model: &str, mesh: &str, extra: &[&str], rules: &str) -> CompiledTrain {
    let mut o = TrainOptions::new(2, 16, Mesh::parse(mesh, 8).expect("mesh"));
    o.extra_strategies = extra.iter().map(|s| s.to_string()).collect();
    o.rewrite = RewriteOptions::with_rules(rules.parse().expect("rules"));
    compile_train(&cfg(model), &o).unwrap_or_else(|e| panic!("{model} {mesh} {extra:?}: {e}"))
}

/// Loading a training program and extracting it with no rule applied gives it back node for
/// node: every op of the forward, backward and optimizer loads into the e-graph.
#[test]
fn training_round_trip_is_exact_when_no_rule_fires() {
    let cases: [(&str, &str, &[&str]); 7] = [
        ("llama", "tp=2", &[]),
        ("llama", "dp=2", &[]),
        ("llama", "dp=2", &["zero1"]),
        ("llama", "dp=2,tp=2", &["sp", "zero3"]),
        ("gpt2", "tp=4", &[]),
        ("mixtral", "ep=2,tp=2", &[]),
        ("mixtral", "dp=2", &["zero2"]),
    ];
    for (model, mesh, extra) in cases {
        let c = train(model, mesh, extra, "none");
        let sg = &c.sharded;
        let run = run_once(sg, &[], &RewriteOptions::default()).expect("run");
        let out = &run.emitted.sharded;
        assert!(run.fired.is_empty());
        let (a, b) = (out.graph.to_string(), sg.graph.to_string());
        if let Some((x, y)) = a.lines().zip(b.lines()).find(|(x, y)| x != y) {
            let _ = std::fs::write("/tmp/rt_out.txt", &a);
            let _ = std::fs::write("/tmp/rt_in.txt", &b);
            panic!("{model} {mesh} {extra:?}: round trip differs:\n{x}\n{y}");
        }
        assert_eq!(out.graph, sg.graph, "{model} {mesh} {extra:?}");
        assert_eq!(out.shardings, sg.shardings, "{model} {mesh} {extra:?}");
        assert_eq!(out.provenance, sg.provenance, "{model} {mesh} {extra:?}");
    }
}
