//! Collective counts of the presets on the bundled and fixture models.

use shardc_compiler::compile::{compile_forward, CompileOptions};
use shardc_compiler::ir::Graph;
use shardc_compiler::model::ModelConfig;
use shardc_compiler::shard::Mesh;
use std::collections::BTreeMap;
use std::path::PathBuf;

fn cfg(name: &str) -> ModelConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = if name.ends_with(".json") {
        root.join("models").join(name)
    } else {
        root.join("tests/fixtures/hf-tiny").join(name)
    };
    ModelConfig::from_path(&p).unwrap()
}

fn counts(g: &Graph, layer: Option<u32>) -> BTreeMap<&'static str, usize> {
    let mut m = BTreeMap::new();
    for v in g.ids() {
        let n = g.node(v);
        if n.op.is_collective() && n.layer == layer {
            *m.entry(n.op.mnemonic()).or_insert(0) += 1;
        }
    }
    m
}

fn compile(name: &str, mesh: &str, extra: &[&str], b: usize, t: usize) -> Graph {
    let opts = CompileOptions {
        batch: b,
        seq: t,
        mesh: Mesh::parse(mesh, 8).unwrap(),
        extra_strategies: extra.iter().map(|s| s.to_string()).collect(),
    };
    compile_forward(&cfg(name), &opts).unwrap().sharded.graph
}

#[test]
fn megatron_tp_two_all_reduces_per_layer() {
    for model in ["llama", "gpt2", "llama-3-8b.json"] {
        let g = compile(model, "tp=2", &[], 2, 16);
        for l in 0..2 {
            assert_eq!(
                counts(&g, Some(l)),
                BTreeMap::from([("all_reduce", 2)]),
                "{model} layer {l}"
            );
        }
        // Embedding all-reduce and the lm_head's all-gather of vocabulary shards.
        assert_eq!(
            counts(&g, None),
            BTreeMap::from([("all_gather", 1), ("all_reduce", 1)]),
            "{model}"
        );
    }
}

#[test]
fn sequence_parallel_two_rs_two_ag_per_layer() {
    for model in ["llama", "gpt2", "llama-3-8b.json"] {
        let g = compile(model, "tp=2", &["sp"], 2, 16);
        for l in 0..2 {
            assert_eq!(
                counts(&g, Some(l)),
                BTreeMap::from([("all_gather", 2), ("reduce_scatter", 2)]),
                "{model} layer {l}"
            );
        }
    }
}
