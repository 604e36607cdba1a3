//! Pipeline parallelism: compile time of a pipelined training step of Llama-3-70B (80 layers,
//! `pp=8,dp=2,tp=8`, sp + zero1, 8 micro-batches: eight chunk programs, schedule, verified
//! instructions, plan), the replay of that plan on a cluster (`simulate --plan`), and one
//! training step of the hf-tiny llama fixture on thread ranks, pipelined (`pp=2`, each
//! schedule) against the unsharded step measured in the same run.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use shardc_compiler::cost::{simulate_plan, Cluster, ComputeOptions};
use shardc_compiler::model::ModelConfig;
use shardc_compiler::schedule::pp::ScheduleKind;
use shardc_compiler::shard::Mesh;
use shardc_compiler::train::{
    compile_pipeline, compile_train, PipelineOptions, Precision, TrainOptions,
};
use shardc_runtime::pipeline::pipeline_step;
use shardc_runtime::train::{train_step, Batch, TrainState};
use shardc_runtime::Weights;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn compile(c: &mut Criterion) {
    let cfg = ModelConfig::from_path(&root().join("models/llama-3-70b.json")).expect("config");
    let mut o = TrainOptions::new(16, 4096, Mesh::parse("pp=8,dp=2,tp=8", 8).expect("mesh"));
    o.extra_strategies = vec!["sp".into(), "zero1".into()];
    o.micro_batches = 8;
    let mut g = c.benchmark_group("pipeline compile llama-3-70b pp=8,dp=2,tp=8 sp+zero1 m=8");
    g.sample_size(10);
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::Interleaved] {
        let mut o = o.clone();
        o.pipeline = PipelineOptions {
            schedule: kind,
            virtual_stages: if kind == ScheduleKind::Interleaved {
                2
            } else {
                1
            },
            stage_layers: None,
        };
        g.bench_with_input(
            BenchmarkId::new("compile + plan", kind.name()),
            &o,
            |b, o| {
                b.iter(|| {
                    let p = compile_pipeline(black_box(&cfg), o).expect("compiles");
                    let plan = p.plan("llama-3-70b", "llama", cfg.layers, Precision::mixed());
                    plan.check_pipeline().expect("verified");
                    black_box(plan.to_json().len())
                })
            },
        );
    }
    g.finish();
    let mut o = o.clone();
    o.pipeline.schedule = ScheduleKind::OneFOneB;
    let plan = compile_pipeline(&cfg, &o).expect("compiles").plan(
        "llama-3-70b",
        "llama",
        cfg.layers,
        Precision::mixed(),
    );
    let cluster = Cluster::resolve("dgx-h100x16").expect("cluster");
    let copts = ComputeOptions::default();
    let mut g = c.benchmark_group("pipeline simulate llama-3-70b pp=8,dp=2,tp=8 m=8");
    g.sample_size(10);
    g.bench_function("replay plan (1f1b)", |b| {
        b.iter(|| {
            let s = simulate_plan(black_box(&plan), &cluster, &copts).expect("replays");
            black_box(s.report.step_time_s)
        })
    });
    g.finish();
}

fn step(c: &mut Criterion) {
    let dir = root().join("tests/fixtures/hf-tiny/llama");
    let cfg = ModelConfig::from_path(&dir).expect("config");
    let w = Weights::open(&dir).expect("weights");
    let (b, t) = (8, 16);
    let ids = (0..b * t)
        .map(|i| ((i * 7919 + 13) % cfg.vocab) as i32)
        .collect();
    let batch = Batch::causal_lm(ids, b, t);
    let timeout = Duration::from_secs(60);
    let mut g = c.benchmark_group("train step hf-tiny llama b=8 s=16 (thread ranks)");
    g.sample_size(20);
    let mut o = TrainOptions::new(b, t, Mesh::single());
    o.micro_batches = 4;
    let flat =
        compile_train(&cfg, &o)
            .expect("compiles")
            .plan("", "llama", cfg.layers, Precision::f32());
    g.bench_function("unsharded m=4", |bn| {
        bn.iter(|| {
            let mut s = TrainState::load(&flat, &w).expect("state");
            black_box(
                train_step(&flat, &mut s, &batch, &w, timeout)
                    .expect("step")
                    .loss,
            )
        })
    });
    for kind in [
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
    ] {
        let mut o = TrainOptions::new(b, t, Mesh::parse("pp=2", 8).expect("mesh"));
        o.micro_batches = 4;
        o.pipeline.schedule = kind;
        o.pipeline.virtual_stages = if kind == ScheduleKind::Interleaved {
            2
        } else {
            1
        };
        let p = compile_pipeline(&cfg, &o).expect("compiles").plan(
            "",
            "llama",
            cfg.layers,
            Precision::f32(),
        );
        g.bench_function(BenchmarkId::new("pp=2 m=4", kind.name()), |bn| {
            bn.iter(|| {
                let mut s = TrainState::load(&p, &w).expect("state");
                let out = pipeline_step(&p, &mut s, &batch, timeout, &w).expect("step");
                black_box(out.output.loss)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, compile, step);
criterion_main!(benches);
