//! Simulation time of `shardc simulate`: one Llama-3-70B training step on 1,024 H100s
//! (128 DGX H100 nodes; pp=8, dp=16, tp=8 with sequence parallelism, 1F1B, 128 micro-batches
//! per pipeline), and the forward plan of the same model replayed over every one of 1,024
//! ranks (dp=128, tp=8).

use criterion::{criterion_group, criterion_main, Criterion};
use shardc_compiler::compile::simulate_training;
use shardc_compiler::compile::{compile_forward, CompileOptions};
use shardc_compiler::cost::{
    chrome_trace, simulate_plan, Cluster, ComputeOptions, Recompute, TrainOptions,
};
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
    let cluster = Cluster::resolve("dgx-h100x128").expect("profile");
    let mesh = Mesh::parse("pp=8,dp=16,tp=8", 8).expect("mesh");
    let mut t = TrainOptions::new(2048, 1, 8192);
    t.recompute = Recompute::Selective;
    t.zero = 1;
    t.overlap_grad_reduce = true;
    t.strategies = vec!["sp".into()];
    let copts = ComputeOptions::default();
    let mut g = c.benchmark_group("simulate");
    g.sample_size(10);
    g.bench_function("llama-3-70b train 1024xH100 pp=8,dp=16,tp=8 sp", |b| {
        b.iter(|| {
            let s = simulate_training(
                black_box(&cfg),
                "llama-3-70b",
                black_box(&mesh),
                &t,
                &cluster,
                &copts,
            )
            .expect("simulates");
            black_box(s.report.step_time_s)
        })
    });
    g.bench_function(
        "llama-3-70b train 1024xH100 + chrome trace (all ranks)",
        |b| {
            b.iter(|| {
                let s = simulate_training(&cfg, "llama-3-70b", &mesh, &t, &cluster, &copts)
                    .expect("simulates");
                black_box(chrome_trace(&s, None).len())
            })
        },
    );
    let fwd_mesh = Mesh::parse("dp=128,tp=8", 8).expect("mesh");
    let opts = CompileOptions {
        batch: 128,
        seq: 4096,
        mesh: fwd_mesh,
        extra_strategies: vec!["sp".into()],
    };
    g.bench_function(
        "llama-3-70b forward plan replay, 1024 ranks dp=128,tp=8 sp",
        |b| {
            b.iter(|| {
                let compiled = compile_forward(&cfg, &opts).expect("compiles");
                let plan = Plan::new(&compiled, "llama-3-70b", "llama", cfg.layers);
                let s = simulate_plan(&plan, &cluster, &copts).expect("simulates");
                black_box(s.report.step_time_s)
            })
        },
    );
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
