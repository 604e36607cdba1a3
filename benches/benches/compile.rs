//! Compile time with the rewriter: Llama-3-70B on `tp=8`, plain Megatron TP rewritten with
//! every rule (`--rewrite all`), at 8, 16, 32 and 80 layers: build, partition, rewrite
//! (saturation, extraction, layer replication), schedule, plan, JSON. The same without
//! rewriting, and with layer planning off (every layer in the e-graph), for comparison.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use shardc_compiler::compile::{compile_forward_with, CompileOptions};
use shardc_compiler::model::ModelConfig;
use shardc_compiler::plan::Plan;
use shardc_compiler::rewrite::{RewriteOptions, RuleSelection};
use shardc_compiler::shard::Mesh;
use std::hint::black_box;
use std::path::PathBuf;

fn llama_70b(layers: usize) -> ModelConfig {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/llama-3-70b.json");
    let mut c = ModelConfig::from_path(&p).expect("bundled config");
    c.layers = layers;
    c
}

fn compile(cfg: &ModelConfig, opts: &CompileOptions, rw: &RewriteOptions) -> usize {
    let compiled = compile_forward_with(cfg, opts, rw).expect("compiles");
    let plan = Plan::new(&compiled, "llama-3-70b", "llama", cfg.layers);
    plan.check_collective_order().expect("ordered");
    plan.to_json().len()
}

fn bench(c: &mut Criterion) {
    let opts = CompileOptions {
        batch: 8,
        seq: 4096,
        mesh: Mesh::parse("tp=8", 8).expect("mesh"),
        extra_strategies: vec![],
    };
    let all = RewriteOptions::with_rules(RuleSelection::All);
    let none = RewriteOptions::with_rules(RuleSelection::None);
    let mut whole = RewriteOptions::with_rules(RuleSelection::All);
    whole.dedup = false;
    let mut g = c.benchmark_group("compile llama-3-70b tp=8");
    g.sample_size(10);
    for layers in [8, 16, 32, 80] {
        let cfg = llama_70b(layers);
        g.bench_with_input(BenchmarkId::new("rewrite all", layers), &cfg, |b, cfg| {
            b.iter(|| black_box(compile(black_box(cfg), &opts, &all)))
        });
        g.bench_with_input(BenchmarkId::new("no rewrite", layers), &cfg, |b, cfg| {
            b.iter(|| black_box(compile(black_box(cfg), &opts, &none)))
        });
        if layers <= 32 {
            g.bench_with_input(
                BenchmarkId::new("rewrite all, every layer planned", layers),
                &cfg,
                |b, cfg| b.iter(|| black_box(compile(black_box(cfg), &opts, &whole))),
            );
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
