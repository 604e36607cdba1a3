//! The two views of a training step are one set of numbers: the analytic model
//! (`simulate --train MODEL`) and the replay of the compiled plan (`compile --train -o` then
//! `simulate --plan`), same configuration: step time within 5%, peak memory per GPU within 2%.
//!
//! Configurations that agree today are checked below (Llama-3-8B `tp=8` since the partitioner
//! lowers the loss to Megatron's vocabulary-parallel cross-entropy, as the analytic model
//! assumes: +11% time before, when the plan gathered the logits twice per micro-batch). Known
//! gaps, measured 2026-11-24 (plan replay vs analytic), for the cost-model work still open:
//! `dp=2,tp=4` with sp +7.4% time (the plan's backward, compiled, has more collectives and
//! kernels than the analytic model's backward derived from the forward); `fsdp` +50% time
//! (the plan does not prefetch the parameter all-gathers the analytic model hides); `pp=2`
//! +6.6% memory.

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
    let cases = [
        ("models/llama-3-8b.json", "dp=8", "", "16", "2048", "none"),
        (
            "models/llama-3-8b.json",
            "dp=8",
            "zero1",
            "16",
            "2048",
            "selective",
        ),
        (
            "models/mixtral-8x7b.json",
            "ep=8",
            "",
            "16",
            "2048",
            "selective",
        ),
        ("models/llama-3-8b.json", "tp=8", "", "8", "2048", "none"),
    ];
    for (model, mesh, strategy, gb, seq, rc) in cases {
        let [a, r] = both(model, mesh, strategy, gb, seq, rc);
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
    }
}
