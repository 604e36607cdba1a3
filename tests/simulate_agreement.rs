//! The two views of a training step are one set of numbers: the analytic model
//! (`simulate --train MODEL`) and the replay of the compiled plan (`compile --train -o` then
//! `simulate --plan`), same configuration: step time within 5%, peak memory per GPU within 2%.
//!
//! Nineteen configurations are checked below (BENCHMARKS.md has the table): data, tensor
//! (with and without sp), pipeline, context (all-gather and ring), expert parallelism, ZeRO-1,
//! ZeRO-3 / FSDP. Known gaps,
//! measured 2026-11-24 (plan replay vs analytic): Llama-3-8B `dp=2,tp=4` with sp at global
//! batch 8 +7.4% time and `pp=2,tp=4` with sp +11% time (the compiled backward under sp has
//! more collectives and kernels than the backward the analytic model derives from the
//! forward); ZeRO-2 −6.7% time / +6.9% memory (the replay overlaps each micro-batch's gradient
//! reduce-scatter with the backward and holds the unreduced gradients meanwhile); context
//! parallelism `dp=2,cp=4` with cp-ulysses +9.2% time (the compiled backward exchanges the
//! saved q, k, v and output again; the analytic backward derived from the forward does not),
//! and ZeRO over dp × cp beyond stage 1 (`dp=2,cp=4` zero2 +26%, fsdp +57%: the compiled step
//! reduce-scatters over dp and then over cp, per micro-batch).

mod common;

use common::run_shardc;

fn json(args: &[&str]) -> serde_json::Value {
    let (ok, out, err) = run_shardc(args, &[]);
    assert!(ok, "{args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// (analytic, replay) reports of one configuration.
fn both(
    model: &str,
    mesh: &str,
    strategy: &str,
    gb: &str,
    seq: &str,
    rc: &str,
) -> [serde_json::Value; 2] {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("p.json");
    let mut common = vec![
        model,
        "--train",
        "--mesh",
        mesh,
        "--global-batch",
        gb,
        "--micro-batch",
        "1",
        "--seq",
        seq,
        "--recompute",
        rc,
    ];
    if !strategy.is_empty() {
        common.extend_from_slice(&["--strategy", strategy]);
    }
    let mut sim = vec!["simulate"];
    sim.extend_from_slice(&common);
    sim.push("--json");
    let analytic = json(&sim);
    let mut compile = vec!["compile"];
    compile.extend_from_slice(&common);
    compile.extend_from_slice(&["--allow-oom", "-o", plan.to_str().unwrap()]);
    let (ok, _, err) = run_shardc(&compile, &[]);
    assert!(ok, "{err}");
    let replay = json(&["simulate", "--plan", plan.to_str().unwrap(), "--json"]);
    [analytic, replay]
}

#[test]
fn analytic_model_and_plan_replay_agree() {
    let (l, m) = ("models/llama-3-8b.json", "models/mixtral-8x7b.json");
    // (model, mesh, strategy, global batch, recompute): data, tensor (with and without sp),
    // pipeline, expert parallelism, ZeRO-1, ZeRO-3 / FSDP, every recompute mode.
    let cases = [
        (l, "dp=8", "", "16", "none"),
        (l, "dp=8", "zero1", "16", "selective"),
        (l, "dp=8", "fsdp", "16", "full"),
        (l, "dp=8", "fsdp", "16", "selective"),
        (l, "tp=8", "", "8", "none"),
        (l, "tp=4,dp=2", "", "16", "none"),
        (l, "tp=2,dp=4", "", "16", "none"),
        (l, "dp=4,tp=2", "sp", "16", "selective"),
        (l, "pp=2,dp=4", "", "16", "selective"),
        (l, "pp=4,dp=2", "", "16", "selective"),
        (l, "pp=2,dp=2,tp=2", "sp", "16", "selective"),
        (l, "cp=8", "", "16", "selective"),
        (l, "dp=2,cp=4", "", "16", "selective"),
        (l, "dp=2,cp=4", "zero1,cp-allgather", "16", "selective"),
        (l, "dp=2,cp=4", "cp-allgather", "16", "selective"),
        (l, "cp=4,tp=2", "sp", "16", "selective"),
        (m, "ep=8", "", "16", "selective"),
        (m, "ep=4,tp=2", "", "16", "selective"),
        (m, "dp=2,ep=4", "", "16", "selective"),
    ];
    for (model, mesh, strategy, gb, rc) in cases {
        let [a, r] = both(model, mesh, strategy, gb, "2048", rc);
        let what = format!("{model} {mesh} {strategy} {rc}");
        let rel = |k: &str| r[k].as_f64().unwrap() / a[k].as_f64().unwrap() - 1.0;
        let (t, m) = (rel("step_time_s"), rel("peak_memory_bytes_per_rank"));
        eprintln!("{what}: time {t:+.3}, memory {m:+.3}");
        assert!(t.abs() < 0.05, "{what}: step time differs by {t:+.3}");
        assert!(m.abs() < 0.02, "{what}: memory differs by {m:+.3}");
        // Parameters, gradients and optimizer state: one accounting.
        for k in ["params", "grads", "optimizer"] {
            assert_eq!(
                a["memory_breakdown"][k], r["memory_breakdown"][k],
                "{what}: {k}"
            );
        }
        // The same pipeline stages: the analytic model splits the layers as the compiler does.
        let layers = |x: &serde_json::Value| -> Vec<u64> {
            x["stages"]
                .as_array()
                .map(|v| v.iter().map(|s| s["layers"].as_u64().unwrap()).collect())
                .unwrap_or_default()
        };
        if mesh.contains("pp=") {
            assert_eq!(layers(&a), layers(&r), "{what}: stage layers");
        }
    }
}
