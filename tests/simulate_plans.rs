//! Layer (a) of the simulator: compiled plans replayed over every rank — a forward plan, and a
//! training plan from `compile_train` read through the same seam (`Program::from_steps`),
//! checked against the training step model's derived backward.

use shardc::compiler::compile::simulate_training;
use shardc::compiler::compile::{compile_forward, CompileOptions};
use shardc::compiler::cost::{
    simulate_plan, AttentionImpl, Cluster, ComputeOptions, Recompute, TrainOptions,
};
use shardc::compiler::ir::DType;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::plan::Plan;
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{compile_train, Precision, TrainOptions as TrainCompile};
use std::path::PathBuf;

fn llama() -> ModelConfig {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny/llama");
    ModelConfig::from_path(&p).unwrap()
}

fn opts() -> ComputeOptions {
    ComputeOptions {
        dtype: DType::Bf16,
        attention: AttentionImpl::Unfused,
        dropout: false,
        fuse_elementwise: false,
    }
}

#[test]
fn forward_plan_replays_every_rank() {
    let cfg = llama();
    let mesh = Mesh::parse("dp=2,tp=2", 8).unwrap();
    let c = CompileOptions {
        batch: 4,
        seq: 16,
        mesh,
        extra_strategies: vec!["sp".into()],
    };
    let compiled = compile_forward(&cfg, &c).unwrap();
    let plan = Plan::new(&compiled, "llama", "llama", cfg.layers);
    let cluster = Cluster::resolve("dgx-h100x1").unwrap();
    let sim = simulate_plan(&plan, &cluster, &opts()).unwrap();
    let r = &sim.report;
    assert_eq!(r.gpus, 4);
    assert_eq!(sim.rank_timeline.len(), 4);
    // Symmetric SPMD plan: every rank does the same at the same times.
    assert_eq!(sim.timelines.len(), 1, "ranks diverged");
    // The step is at least the compute and at most compute plus communication.
    assert!(r.step_time_s >= r.compute_s - 1e-12);
    assert!(r.step_time_s <= r.compute_s + r.comm_s + 1e-12);
    assert!(r.comm_s > 0.0, "dp=2,tp=2 with sp communicates");
    assert!((r.exposed_comm_s + r.hidden_comm_s - r.comm_s).abs() < 1e-12);
    // One slice per kernel and collective of the plan on every rank.
    let tl = &sim.timelines[0];
    let kernels = plan
        .steps
        .iter()
        .filter(|s| {
            !matches!(
                s,
                shardc::compiler::schedule::Step::Record { .. }
                    | shardc::compiler::schedule::Step::Wait { .. }
            )
        })
        .count();
    assert_eq!(tl.slices.len(), kernels);
    // Memory: parameters plus the live activations at the peak.
    let m = r.memory_breakdown;
    assert_eq!(m.total().0, r.peak_memory_bytes_per_rank);
    let params: u64 = plan
        .program
        .params()
        .map(|v| plan.program.ty(v).numel() as u64 * 2)
        .sum();
    assert_eq!(m.params.0, params);
    assert!(r.fits);
    // Counted FLOPs: what the plan's GEMMs and attention do, on every rank.
    let per_rank: f64 = tl.slices.iter().map(|s| s.flops).sum();
    assert!((r.flops_per_step - 4.0 * per_rank).abs() < 1e-6 * r.flops_per_step);
}

/// The seam: a real training plan (forward, backward and AdamW nodes from `autodiff/`) replays
/// as it is; its GEMM work matches the step model's derived backward (3× the forward GEMMs).
#[test]
fn training_plan_replays_through_the_seam() {
    let cfg = llama();
    let mesh = Mesh::parse("dp=2,tp=2", 8).unwrap();
    let mut t = TrainCompile::new(4, 16, mesh.clone());
    t.micro_batches = 1;
    let ct = compile_train(&cfg, &t).unwrap();
    let plan = ct.plan("llama", "llama", cfg.layers, Precision::mixed());
    let cluster = Cluster::resolve("dgx-h100x1").unwrap();
    let replayed = simulate_plan(&plan, &cluster, &opts()).unwrap();
    assert_eq!(replayed.report.gpus, 4);
    assert!(replayed.report.step_time_s > 0.0);
    // The same step from the model: one layer's forward, derived backward.
    let mut tr = TrainOptions::new(4, 2, 16);
    tr.recompute = Recompute::None;
    let modelled = simulate_training(&cfg, "llama", &mesh, &tr, &cluster, &opts()).unwrap();
    // Both count GEMMs and attention (measured: the plan does 1.3% more, as its attention
    // gradients recompute the probabilities' GEMM).
    let (a, b) = (
        replayed.report.flops_per_step,
        modelled.report.flops_per_step,
    );
    assert!(
        a >= 0.99 * b && a <= 1.1 * b,
        "plan {a:.3e} vs model {b:.3e}"
    );
}

/// The replay's counted FLOPs of a forward plan are `ModelStats`' (2 per multiply-add of the
/// parameters a token touches, mixture-of-experts at top-k of the experts, plus attention over
/// the full sequence), for every fixture architecture and with tensor parallelism (whose
/// ranks split the work, except a replicated GEMM every rank repeats).
#[test]
fn forward_flops_match_model_stats() {
    use shardc::compiler::model::ModelStats;
    let cluster = Cluster::resolve("dgx-h100x1").unwrap();
    for (fixture, mesh) in [
        ("llama", "tp=2"),
        ("mixtral", "tp=2"),
        ("gpt2", "dp=2"),
        ("mixtral", "dp=1"),
    ] {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/hf-tiny")
            .join(fixture);
        let cfg = ModelConfig::from_path(&p).unwrap();
        let (batch, seq) = (2usize, 16usize);
        let c = CompileOptions {
            batch,
            seq,
            mesh: Mesh::parse(mesh, 8).unwrap(),
            extra_strategies: Vec::new(),
        };
        let compiled = compile_forward(&cfg, &c).unwrap();
        let plan = Plan::new(&compiled, fixture, cfg.arch.name(), cfg.layers);
        let sim = simulate_plan(&plan, &cluster, &opts()).unwrap();
        let stats = ModelStats::compute(&cfg, seq).unwrap();
        let want = stats.forward_flops_per_token as f64 * (batch * seq) as f64;
        // Summed over the ranks: tensor or data parallelism splits the work, not adds to it.
        let got = sim.report.flops_per_step;
        // ... except what every tp rank repeats: the (replicated) MoE router GEMM.
        let tp = if mesh == "tp=2" { 2.0 } else { 1.0 };
        let router = cfg.moe.map_or(0.0, |m| {
            2.0 * (batch * seq) as f64 * (cfg.hidden * m.experts) as f64 * cfg.layers as f64
        });
        let want = want + router * (tp - 1.0);
        assert!(
            (got / want - 1.0).abs() < 1e-9,
            "{fixture} {mesh}: replay {got} vs ModelStats {want}"
        );
    }
}

/// Attention's backward in a training plan (the probabilities recomputed, then the gradients
/// of v, q and k) is priced as FlashAttention-2's fused backward under `AttentionImpl::Flash`:
/// 2.5× the forward's counted FLOPs (5 GEMMs for 2), no pass over the probabilities in memory,
/// half the tiles executed under the causal mask; unfused, 6 GEMMs and the probabilities'
/// memory passes.
#[test]
fn attention_backward_is_priced_like_flash_attention() {
    use shardc::compiler::cost::node_cost;
    use shardc::compiler::ir::Op;
    let cfg = llama();
    let t = TrainCompile::new(2, 16, Mesh::single());
    let c = compile_train(&cfg, &t).unwrap();
    let g = &c.sharded.graph;
    let fused = vec![false; g.len()];
    let sum = |o: &ComputeOptions, pick: &dyn Fn(&Op) -> bool| {
        let (mut flops, mut exec, mut mem) = (0.0, 0.0, 0usize);
        for v in g.ids().filter(|&v| pick(&g.node(v).op)) {
            for k in node_cost(g, v, o, &fused).fwd {
                flops += k.flops;
                exec += k.exec_flops;
                mem += usize::from(k.gemm.is_none());
            }
        }
        (flops, exec, mem)
    };
    let fwd = |op: &Op| matches!(op, Op::Attention(_));
    let bwd = |op: &Op| matches!(op, Op::AttentionProbs(_) | Op::AttentionGrad { .. });
    let mut flash = opts();
    flash.attention = AttentionImpl::Flash;
    let (f, _, _) = sum(&flash, &fwd);
    let (b, b_exec, b_mem) = sum(&flash, &bwd);
    assert!(
        (b / f - 2.5).abs() < 1e-9,
        "flash backward / forward = {}",
        b / f
    );
    assert!((b_exec / b - 0.5).abs() < 1e-9, "causal: half the tiles");
    assert_eq!(b_mem, 0, "no memory pass over the probabilities");
    let (fu, _, _) = sum(&opts(), &fwd);
    let (bu, _, bu_mem) = sum(&opts(), &bwd);
    assert!(
        (bu / fu - 3.0).abs() < 1e-9,
        "unfused backward / forward = {}",
        bu / fu
    );
    assert!(bu_mem > 0);
}
