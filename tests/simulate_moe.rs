//! Expert parallelism in the training model (`simulate --train` with an `ep` axis): per-rank
//! memory against the parameter arithmetic of the config (experts split over `ep`, dense
//! parameters ZeRO-sharded over `dp × ep`, experts over `dp`), load imbalance, the named
//! errors, and the CLI (`--moe-imbalance`, `--explain`, tokens/s/GPU, `--strategy fsdp` ≡
//! `--zero 3`).

mod common;

use common::{fails_with, run_shardc};
use shardc::compiler::compile::{simulate_training, SimulateError};
use shardc::compiler::cost::{Cluster, ComputeOptions, Recompute, Simulation, TrainOptions};
use shardc::compiler::model::{ModelConfig, ModelStats};
use shardc::compiler::shard::Mesh;

const MIXTRAL: &str = "models/mixtral-8x7b.json";

fn sim(model: &str, mesh: &str, zero: u8, imbalance: f64) -> Result<Simulation, SimulateError> {
    let cfg = ModelConfig::from_path(std::path::Path::new(model)).unwrap();
    let mesh = Mesh::parse(mesh, 8).unwrap();
    let c = Cluster::resolve_for("dgx-h100", mesh.world_size()).unwrap();
    let data = mesh.data_ranks();
    let mut t = TrainOptions::new(4 * data, 1, 1024);
    t.zero = zero;
    t.recompute = Recompute::Selective;
    t.moe_imbalance = imbalance;
    simulate_training(&cfg, model, &mesh, &t, &c, &ComputeOptions::default())
}

/// (dense, expert) parameters of the config: experts' `w1`, `w3`, `w2` are
/// `layers × experts × 3 × hidden × ffn`, the rest (attention, norms, routers, embedding,
/// head) dense.
fn mixtral_params() -> (f64, f64) {
    let cfg = ModelConfig::from_path(std::path::Path::new(MIXTRAL)).unwrap();
    let moe = cfg.moe.unwrap();
    let expert = (cfg.layers * moe.experts * 3 * cfg.hidden * cfg.ffn) as f64;
    let total = ModelStats::compute(&cfg, 1024).unwrap().params as f64;
    (total - expert, expert)
}

fn rel(a: f64, b: f64) -> f64 {
    (a / b - 1.0).abs()
}

#[test]
fn expert_parallel_memory_matches_the_parameter_arithmetic() {
    let (dense, expert) = mixtral_params();
    // Mixtral-8x7B: 46.7B parameters, 45.1B of them in experts.
    assert!(rel(dense + expert, 46.70e9) < 0.01, "{}", dense + expert);
    // (mesh, dp, ep, ZeRO stage)
    for (mesh, dp, ep, zero) in [
        ("ep=8", 1.0, 8.0, 0),
        ("dp=2,ep=4", 2.0, 4.0, 0),
        ("dp=2,ep=4", 2.0, 4.0, 1),
        ("dp=2,ep=4", 2.0, 4.0, 3),
    ] {
        let r = sim(MIXTRAL, mesh, zero, 1.0).unwrap().report;
        let m = r.memory_breakdown;
        // Local parameters: all dense ones, `1/ep` of the experts.
        let local_dense = dense;
        let local_expert = expert / ep;
        let shard = |x: f64, n: f64, on: bool| if on { x / n } else { x };
        let zeroed = |on: bool| shard(local_dense, dp * ep, on) + shard(local_expert, dp, on);
        let want = [
            ("params", m.params.0 as f64, 2.0 * zeroed(zero >= 3)),
            ("grads", m.grads.0 as f64, 2.0 * zeroed(zero >= 2)),
            ("optimizer", m.optimizer.0 as f64, 12.0 * zeroed(zero >= 1)),
        ];
        for (what, got, want) in want {
            assert!(
                rel(got, want) < 1e-6,
                "{mesh} zero{zero} {what}: {got} vs {want}"
            );
        }
        assert!(
            r.strategies.contains(&"ep".to_string()),
            "{:?}",
            r.strategies
        );
        assert!(!r.notes.is_empty());
    }
}

#[test]
fn load_imbalance_slows_the_step_and_only_the_experts() {
    let base = sim(MIXTRAL, "ep=8", 0, 1.0).unwrap().report;
    let skew = sim(MIXTRAL, "ep=8", 0, 1.5).unwrap().report;
    assert!(
        skew.step_time_s > base.step_time_s * 1.05,
        "{} {}",
        skew.step_time_s,
        base.step_time_s
    );
    // Only the expert GEMMs and the all-to-all scale: the step is less than 1.5× slower.
    assert!(skew.step_time_s < base.step_time_s * 1.5);
    // The useful work (model FLOPs) is the same, memory too.
    assert_eq!(skew.model_flops_per_step, base.model_flops_per_step);
    assert_eq!(skew.memory_breakdown.params, base.memory_breakdown.params);
}

#[test]
fn expert_parallel_errors_are_named() {
    let e = sim("models/llama-3-8b.json", "ep=2", 0, 1.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`ep`") && e.contains("has none"), "{e}");
    let e = sim(MIXTRAL, "dp=1,ep=3", 0, 1.0).unwrap_err().to_string();
    assert!(e.contains("experts") && e.contains('3'), "{e}");
    let e = sim(MIXTRAL, "ep=8", 0, 0.5).unwrap_err().to_string();
    assert!(e.contains("imbalance"), "{e}");
    // The global batch splits over dp × ep × micro-batch.
    let cfg = ModelConfig::from_path(std::path::Path::new(MIXTRAL)).unwrap();
    let mesh = Mesh::parse("dp=2,ep=4", 8).unwrap();
    let c = Cluster::resolve_for("dgx-h100", 8).unwrap();
    let t = TrainOptions::new(4, 1, 1024);
    let e = simulate_training(&cfg, MIXTRAL, &mesh, &t, &c, &ComputeOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("dp*ep*micro-batch"), "{e}");
}

#[test]
fn cli_simulates_expert_parallel_training() {
    let args = [
        "simulate",
        MIXTRAL,
        "--train",
        "--mesh",
        "dp=2,ep=8,tp=4",
        "--strategy",
        "sp",
        "--global-batch",
        "64",
        "--seq",
        "1024",
        "--recompute",
        "selective",
        "--explain",
    ];
    let out = common::succeeds(&args);
    assert!(out.contains("strategies dp,ep,tp,sp"), "{out}");
    assert!(out.contains("tokens/s/GPU"), "{out}");
    assert!(
        out.contains("moe: 8 experts, top-2 routing; ep=8: 1 expert(s) per rank"),
        "{out}"
    );
    assert!(out.contains("all-to-all per layer"), "{out}");
    let mut skewed = args.to_vec();
    skewed.extend_from_slice(&["--moe-imbalance", "1.3", "--json"]);
    let (ok, out, err) = run_shardc(&skewed, &[]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["step_time_s"].as_f64().unwrap() > 0.0);
    fails_with(
        &["simulate", MIXTRAL, "--moe-imbalance", "1.3"],
        &["--moe-imbalance", "--train"],
    );
    fails_with(
        &[
            "simulate",
            MIXTRAL,
            "--train",
            "--mesh",
            "dp=8",
            "--moe-imbalance",
            "1.3",
        ],
        &["--moe-imbalance", "`ep`"],
    );
    fails_with(
        &[
            "simulate",
            MIXTRAL,
            "--train",
            "--mesh",
            "ep=8",
            "--moe-imbalance",
            "0.5",
        ],
        &["--moe-imbalance", "at least 1"],
    );
}

/// The FSDP case: Llama-3-8B on 8 H100s, global batch 16 × 8192, micro-batch 2:
/// `--strategy fsdp` and `--zero 3` are one configuration, printed with tokens/s/GPU, MFU and
/// the memory breakdown.
#[test]
fn fsdp_strategy_and_zero_3_are_the_same_step() {
    let base = [
        "simulate",
        "models/llama-3-8b.json",
        "--train",
        "--mesh",
        "dp=8",
        "--global-batch",
        "16",
        "--seq",
        "8192",
        "--micro-batch",
        "2",
    ];
    let run = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        let (ok, out, err) = run_shardc(&a, &[]);
        assert!(ok, "{extra:?}: {err}");
        out
    };
    let fsdp = run(&["--strategy", "fsdp"]);
    let zero3 = run(&["--zero", "3"]);
    for want in ["tokens/s/GPU", "MFU", "optimizer", "activations", "zero 3"] {
        assert!(fsdp.contains(want), "{want}: {fsdp}");
    }
    assert_eq!(fsdp, zero3);
    let json = |extra: &[&str]| {
        let mut a = extra.to_vec();
        a.push("--json");
        serde_json::from_str::<serde_json::Value>(&run(&a)).unwrap()
    };
    assert_eq!(json(&["--strategy", "fsdp"]), json(&["--zero", "3"]));
}
