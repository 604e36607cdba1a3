//! Pipeline-parallel training plans replayed on a cluster (`simulate_pipeline_plan`): the
//! replayed schedule's bubble is the textbook one when stages cost the same, zero-bubble and
//! interleaved schedules beat 1F1B, activation memory follows the schedule, the work is the
//! same as the unpipelined step's, and the step time agrees with the analytical training
//! model within its modelling differences.

use shardc::compiler::compile::simulate_training;
use shardc::compiler::cost::{
    simulate_plan, Cluster, ComputeOptions, PipeSchedule, Recompute, Simulation,
    TrainOptions as SimTrain,
};
use shardc::compiler::model::ModelConfig;
use shardc::compiler::schedule::pp::ScheduleKind;
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{
    compile_pipeline, compile_train, PipelineOptions, Precision, TrainOptions,
};
use std::path::PathBuf;

/// Llama-3-8B with a small vocabulary: 32 equal layers, a negligible head.
fn uniform_llama() -> ModelConfig {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/llama-3-8b.json");
    let mut c = ModelConfig::from_path(&p).unwrap();
    c.vocab = 1024;
    c
}

fn pipelined(
    cfg: &ModelConfig,
    mesh: &str,
    kind: ScheduleKind,
    m: usize,
    batch: usize,
) -> Simulation {
    let mut o = TrainOptions::new(batch, 1024, Mesh::parse(mesh, 8).unwrap());
    o.micro_batches = m;
    let p = Mesh::parse(mesh, 8)
        .unwrap()
        .axis_size(Mesh::parse(mesh, 8).unwrap().axis("pp").unwrap());
    let v = if kind == ScheduleKind::Interleaved {
        2
    } else {
        1
    };
    o.pipeline = PipelineOptions {
        schedule: kind,
        virtual_stages: v,
        stage_layers: Some(vec![cfg.layers / (p * v); p * v]),
    };
    let c = compile_pipeline(cfg, &o).unwrap();
    let plan = c.plan("llama", "llama", cfg.layers, Precision::mixed());
    let cluster = Cluster::resolve("dgx-h100").unwrap();
    simulate_plan(&plan, &cluster, &ComputeOptions::default()).unwrap()
}

/// Bubble of the passes alone (the optimizer step after the flush left out).
fn pass_bubble(sim: &Simulation, p: usize) -> f64 {
    let passes = |cat: &str| matches!(cat, "forward" | "backward" | "weight-gradient");
    let mut busy = 0.0;
    let mut end: f64 = 0.0;
    for tl in &sim.timelines {
        for s in tl.slices.iter().filter(|s| passes(&s.cat)) {
            busy += s.dur;
            end = end.max(s.start + s.dur);
        }
    }
    1.0 - busy / (p as f64 * end)
}

#[test]
fn replayed_bubble_is_textbook_for_equal_stages() {
    let cfg = uniform_llama();
    let p = 4;
    for m in [4, 8] {
        let want = (p - 1) as f64 / (m + p - 1) as f64;
        let mut got = Vec::new();
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            let sim = pipelined(&cfg, "pp=4", kind, m, m);
            let b = pass_bubble(&sim, p);
            assert!(
                (b - want).abs() < 0.03,
                "{} m={m}: replayed bubble {b:.4}, textbook {want:.4}",
                kind.name()
            );
            got.push(b);
        }
        let zb = pass_bubble(&pipelined(&cfg, "pp=4", ScheduleKind::ZbH1, m, m), p);
        let il = pass_bubble(&pipelined(&cfg, "pp=4", ScheduleKind::Interleaved, m, m), p);
        // (ZB-H1 fills the bubble with the weight-gradient passes; here W is ~0.8 of B, and the
        // gradient all-reduce is the step program's, not the last W's.)
        assert!(
            zb < got[1] - 0.01,
            "m={m}: zb-h1 {zb:.4} vs 1f1b {:.4}",
            got[1]
        );
        assert!(
            il < got[1] - 0.02,
            "m={m}: interleaved {il:.4} vs 1f1b {:.4}",
            got[1]
        );
    }
}

#[test]
fn replayed_memory_follows_the_schedule() {
    let cfg = uniform_llama();
    let (g, f) = (
        pipelined(&cfg, "pp=4", ScheduleKind::Gpipe, 8, 8),
        pipelined(&cfg, "pp=4", ScheduleKind::OneFOneB, 8, 8),
    );
    let act = |s: &Simulation, i: usize| s.report.stages[i].memory.activations.0 as f64;
    // GPipe's first stage holds all 8 micro-batches, 1F1B's p = 4.
    let ratio = act(&g, 0) / act(&f, 0);
    assert!(
        (ratio - 2.0).abs() < 0.1,
        "GPipe / 1F1B stage 0 activations: {ratio}"
    );
    // 1F1B: fewer in flight on later stages.
    assert!((1..4).all(|i| act(&f, i) < act(&f, i - 1)));
    // Parameters, gradients and optimizer state: a quarter of the model per stage each.
    let params: u64 = f.report.stages.iter().map(|s| s.memory.params.0).sum();
    let per = f.report.stages[1].memory.params.0 as f64;
    assert!(
        (per / params as f64 - 0.25).abs() < 0.02,
        "{per} of {params}"
    );
}

#[test]
fn pipelined_work_equals_the_flat_step_and_the_model_agrees() {
    let cfg = uniform_llama();
    let (batch, m) = (8, 4);
    let sim = pipelined(&cfg, "pp=4,dp=2", ScheduleKind::OneFOneB, m, batch);
    // The same step without a pipeline, on the data-parallel ranks alone.
    let mut o = TrainOptions::new(batch, 1024, Mesh::parse("dp=2", 8).unwrap());
    o.micro_batches = m;
    let flat = compile_train(&cfg, &o).unwrap();
    let plan = flat.plan("llama", "llama", cfg.layers, Precision::mixed());
    let cluster = Cluster::resolve("dgx-h100").unwrap();
    let flat = simulate_plan(&plan, &cluster, &ComputeOptions::default()).unwrap();
    let (a, b) = (sim.report.flops_per_step, flat.report.flops_per_step);
    assert!(
        (a / b - 1.0).abs() < 0.01,
        "pipelined {a:.4e} vs flat {b:.4e} FLOPs"
    );
    // The analytical training model (per-layer forward, derived backward, the schedule's
    // replay): an independent estimate of the same step.
    let mut t = SimTrain::new(batch, batch / m / 2, 1024);
    t.recompute = Recompute::None;
    t.schedule = PipeSchedule::OneFOneB;
    let model = simulate_training(
        &cfg,
        "llama",
        &Mesh::parse("pp=4,dp=2", 8).unwrap(),
        &t,
        &cluster,
        &ComputeOptions::default(),
    )
    .unwrap();
    let (x, y) = (sim.report.step_time_s, model.report.step_time_s);
    eprintln!(
        "replayed plan {:.1} ms, training model {:.1} ms",
        x * 1e3,
        y * 1e3
    );
    // Measured 2026-11-24: 161.5 vs 164 ms (225 vs 164 ms while each chunk's program was
    // unrolled per micro-batch: the gradient all-reduces sat in the last micro-batch's
    // backward, ahead of its gradient send, and so delayed every stage before it; they now run
    // in the step program after the pipeline flush, as Megatron-LM's default does). The
    // replay costs the real backward kernels, the model derives them; the schedule itself
    // replays to the textbook bubble (test above).
    assert!(
        (0.8..1.6).contains(&(x / y)),
        "replayed {x:.4} s vs model {y:.4} s"
    );
}
