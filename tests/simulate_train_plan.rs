//! A compiled training plan without a pipeline, replayed (`simulate --plan`): reported as a
//! training step (micro-batches, recompute, ZeRO stage from the plan), with the parameters,
//! gradients and optimizer state the compiler accounted, the activations of one micro-batch
//! (collective outputs among them), and the
//! micro-batch program run once per micro-batch.

mod common;

use common::run_shardc;

fn json(args: &[&str]) -> serde_json::Value {
    let (ok, out, err) = run_shardc(args, &[]);
    assert!(ok, "{args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Compiles a Llama-3-8B training step with `flags` (memory fit not checked) into `plan`.
fn compile_train(plan: &std::path::Path, flags: &[&str]) {
    let head = ["compile", "models/llama-3-8b.json", "--train"];
    let tail = ["--allow-oom", "-o", plan.to_str().unwrap()];
    let (ok, _, err) = run_shardc(&[&head[..], flags, &tail].concat(), &[]);
    assert!(ok, "{err}");
}

#[test]
fn training_plan_replay_is_a_training_step() {
    let dir = tempfile::tempdir().unwrap();
    let plan = |m: usize| {
        let p = dir.path().join(format!("p{m}.json"));
        let (batch, micro) = ((4 * m).to_string(), m.to_string());
        let flags = [
            "--mesh",
            "dp=2,tp=4",
            "--strategy",
            "sp,zero1",
            "--batch",
            &batch,
            "--seq",
            "2048",
            "--micro-batches",
            &micro,
            "--recompute",
            "selective",
        ];
        compile_train(&p, &flags);
        p
    };
    let p2 = plan(2);
    let file = common::read_json(&p2);
    let r = json(&["simulate", "--plan", p2.to_str().unwrap(), "--json"]);
    assert_eq!(r["mode"], "train", "{r}");
    assert_eq!(r["micro_batches"], 2);
    assert_eq!(r["micro_batch"], 2, "4 sequences per micro-batch over dp=2");
    assert_eq!(r["recompute"], "selective");
    assert_eq!(r["zero"], 1);
    let t = &file["memory"]["train"];
    let m = &r["memory_breakdown"];
    for (got, want) in [
        ("params", "param_bytes"),
        ("grads", "grad_bytes"),
        ("optimizer", "optimizer_bytes"),
    ] {
        assert_eq!(m[got], t[want], "{got}: {r}");
        assert!(m[got].as_u64().unwrap() > 0, "{got}");
    }
    // Collective outputs are live bytes of the replay, not a separate buffer.
    assert_eq!(m["comm_buffers"], 0);
    assert!(m["activations"].as_u64().unwrap() > 0);
    let step = r["step_time_s"].as_f64().unwrap();
    let opt = r["optimizer_s"].as_f64().unwrap();
    assert!(opt > 0.0 && opt < step, "{r}");
    assert!((r["pipeline_s"].as_f64().unwrap() + opt - step).abs() < 1e-9 * step.max(1.0));
    // Twice the micro-batches of the same size: the micro-batch part takes twice as long,
    // the step program the same.
    let r4 = json(&["simulate", "--plan", plan(4).to_str().unwrap(), "--json"]);
    let micro = |r: &serde_json::Value| r["pipeline_s"].as_f64().unwrap();
    assert!(
        (micro(&r4) / micro(&r) - 2.0).abs() < 0.02,
        "{} {}",
        micro(&r4),
        micro(&r)
    );
    assert!((r4["optimizer_s"].as_f64().unwrap() / opt - 1.0).abs() < 1e-6);
    // Micro-batches run one after the other: the activations of one, whatever their number
    // (each one's gradients go to the step's gradient buffers, counted once).
    assert_eq!(
        r4["memory_breakdown"]["activations"], m["activations"],
        "{r4}"
    );
}

/// A pipeline plan replayed reports its tensor-parallel collectives as communication (inside
/// its passes), not only the transfers between stages.
#[test]
fn pipeline_plan_replay_counts_the_collectives_inside_passes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("pp.json");
    let flags = [
        "--mesh",
        "pp=2,tp=4",
        "--strategy",
        "sp",
        "--batch",
        "8",
        "--seq",
        "2048",
        "--micro-batches",
        "8",
    ];
    compile_train(&p, &flags);
    let r = json(&["simulate", "--plan", p.to_str().unwrap(), "--json"]);
    let f = |k: &str| r[k].as_f64().unwrap();
    let p2p: f64 = r["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["p2p_exposed_s"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(f("comm_s") > 2.0 * p2p, "{r}");
    assert!(f("exposed_comm_s") <= f("comm_s") + 1e-12, "{r}");
    assert!(
        (f("exposed_comm_s") + f("hidden_comm_s") - f("comm_s")).abs() < 1e-9,
        "{r}"
    );
    assert!(
        f("compute_s") > 0.0 && f("compute_s") < f("step_time_s"),
        "{r}"
    );
}
