//! Compile time of the sharding pipeline (build → annotate → partition → plan) on
//! Llama-3-70B (80 layers) for dp=8,tp=8 with Megatron TP + SP.

use criterion::{criterion_group, criterion_main, Criterion};
use shardc_compiler::compile::{compile_forward, CompileOptions};
use shardc_compiler::model::ModelConfig;
use shardc_compiler::plan::Plan;
use shardc_compiler::shard::Mesh;
use std::hint::black_box;
use std::path::PathBuf;

fn llama_70b() -> ModelConfig {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/llama-3-70b.json");
    ModelConfig::from_path(&p).expect("bundled config")
}

fn bench(c: &mut Criterion) {
    let cfg = llama_70b();
    let opts = CompileOptions {
        batch: 8,
        seq: 4096,
        mesh: Mesh::parse("dp=8,tp=8", 8).expect("mesh"),
        extra_strategies: vec!["sp".into()],
    };
    let mut g = c.benchmark_group("shard");
    g.sample_size(10);
    g.bench_function("llama-3-70b dp=8,tp=8 tp+sp: compile + plan", |b| {
        b.iter(|| {
            let compiled = compile_forward(black_box(&cfg), black_box(&opts)).expect("compiles");
            let plan = Plan::new(&compiled, "llama-3-70b", "llama", cfg.layers);
            plan.check_collective_order().expect("ordered");
            black_box(plan.to_json().len())
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
