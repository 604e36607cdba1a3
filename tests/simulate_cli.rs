//! `shardc simulate`, `shardc calibrate` and `compile`'s fit check from the command line.

mod common;

use common::{run_shardc, TINY_TP2};

use std::path::Path;
use std::process::Command;

fn shardc(args: &[&str]) -> (bool, String, String) {
    run_shardc(args, &[])
}

fn ok_json(args: &[&str]) -> serde_json::Value {
    let (ok, out, err) = shardc(args);
    assert!(ok, "{args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

const KEYS: [&str; 6] = [
    "step_time_s",
    "tflops_per_gpu",
    "mfu",
    "peak_memory_bytes_per_rank",
    "exposed_comm_s",
    "bubble_fraction",
];

/// Simulated training of Llama-3-70B on 1024 GPUs, sequence parallel.
const LLAMA_70B_TRAIN: [&str; 7] = [
    "simulate",
    "models/llama-3-70b.json",
    "--train",
    "--mesh",
    "pp=8,dp=16,tp=8",
    "--strategy",
    "sp",
];

/// The tiny Llama on `dp=2,tp=2` at batch 4 × seq 16, the forward the report and trace tests
/// simulate.
const LLAMA_DP2_TP2: [&str; 7] = [
    "tests/fixtures/hf-tiny/llama",
    "--mesh",
    "dp=2,tp=2",
    "--batch",
    "4",
    "--seq",
    "16",
];

#[test]
fn forward_json_has_the_report_keys() {
    let model = [&LLAMA_DP2_TP2[..], &["--strategy", "sp"]].concat();
    let v = ok_json(
        &[
            &["simulate"],
            &model[..],
            &["--cluster", "dgx-h100", "--json"],
        ]
        .concat(),
    );
    for k in KEYS {
        let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"));
        assert!(x.is_finite() && x >= 0.0, "{k} = {x}");
    }
    assert!(v["step_time_s"].as_f64().unwrap() > 0.0);
    assert!(v["mfu"].as_f64().unwrap() < 1.0);
    assert_eq!(v["gpus"], 4);
    assert_eq!(v["mode"], "forward");
    assert_eq!(v["cluster"], "dgx-h100x1");
    // The same plan compiled to a file and replayed with --plan gives the same numbers.
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    common::succeeds(&[&["compile"], &model[..], &["-o", plan.to_str().unwrap()]].concat());
    let w = ok_json(&["simulate", "--plan", plan.to_str().unwrap(), "--json"]);
    for k in KEYS {
        assert_eq!(v[k], w[k], "{k}");
    }
}

#[test]
fn llama_70b_training_on_1024_h100s() {
    let v = ok_json(
        &[
            &LLAMA_70B_TRAIN[..],
            &[
                "--global-batch",
                "1024",
                "--seq",
                "8192",
                "--recompute",
                "selective",
                "--zero",
                "1",
                "--overlap-grad-reduce",
                "--cluster",
                "dgx-h100x128",
                "--json",
            ],
        ]
        .concat(),
    );
    assert_eq!(v["gpus"], 1024);
    assert_eq!(v["micro_batches"], 64);
    assert_eq!(v["stages"].as_array().unwrap().len(), 8);
    let mfu = v["mfu"].as_f64().unwrap();
    assert!(mfu > 0.2 && mfu < 0.7, "mfu {mfu}");
    let bubble = v["bubble_fraction"].as_f64().unwrap();
    // 1F1B with 8 stages and 64 micro-batches idles at least (p−1)/(m+p−1) ≈ 9.9%.
    assert!(bubble > 0.09 && bubble < 0.3, "bubble {bubble}");
    assert_eq!(v["fits"], true);
    let peak = v["peak_memory_bytes_per_rank"].as_u64().unwrap();
    assert_eq!(common::sum_u64(&v["memory_breakdown"]), peak);
}

#[test]
fn trace_opens_as_a_chrome_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let trace_flag = ["--trace", trace.to_str().unwrap()];
    let out = common::succeeds(&[&["simulate"], &LLAMA_DP2_TP2[..], &trace_flag].concat());
    assert!(out.contains("step time"), "{out}");
    let v = common::read_json(&trace);
    let ev = v["traceEvents"].as_array().unwrap();
    let procs: Vec<i64> = ev
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| e["pid"].as_i64().unwrap())
        .collect();
    assert_eq!(procs, [0, 1, 2, 3], "one process per rank");
    let threads: Vec<&str> = ev
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["pid"] == 0)
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(threads, ["compute", "comm"], "one track per stream");
    let slices: Vec<&serde_json::Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
    assert!(slices.iter().all(|e| e["args"]["bytes"].is_u64()
        && e["args"]["flops"].is_number()
        && e["dur"].as_f64().unwrap() >= 0.0));
    assert!(slices.iter().any(|e| e["cat"] == "collective"
        && e["tid"] == 1
        && e["args"]["bytes"].as_u64() > Some(0)));
    assert!(slices
        .iter()
        .any(|e| e["cat"] == "gemm" && e["args"]["flops"].as_f64() > Some(0.0)));
    assert!(ev.iter().any(|e| e["ph"] == "C" && e["name"] == "memory"));
}

/// A cluster whose device has `memory` bytes, as user-supplied profile files.
fn small_device_cluster(dir: &Path, memory: f64) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("compiler/src/cost/profiles");
    let dev = std::fs::read_to_string(root.join("h100-sxm.toml")).unwrap();
    let dev = dev.replace(
        "memory_bytes = { value = 80e9,",
        &format!("memory_bytes = {{ value = {memory:e},"),
    );
    std::fs::write(dir.join("tiny-gpu.toml"), dev).unwrap();
    let cl = std::fs::read_to_string(root.join("dgx-h100.toml"))
        .unwrap()
        .replace("device = \"h100-sxm\"", "device = \"tiny-gpu.toml\"");
    let p = dir.join("tiny-cluster.toml");
    std::fs::write(&p, cl).unwrap();
    p.to_string_lossy().to_string()
}

#[test]
fn plans_that_do_not_fit_warn_in_simulate_and_fail_compile() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = small_device_cluster(dir.path(), 1e5);
    let model = "tests/fixtures/hf-tiny/llama";
    let simulate = |cluster: &str| {
        shardc(&[&["simulate", model], &TINY_TP2[..], &["--cluster", cluster]].concat())
    };
    let (ok, _, err) = simulate(&cluster);
    assert!(ok, "simulate only warns: {err}");
    assert!(
        err.contains("warning: does not fit") && err.contains("params"),
        "{err}"
    );
    let plan = dir.path().join("plan.json");
    let plan = plan.to_str().unwrap();
    let args = [
        &["compile", model],
        &TINY_TP2[..],
        &["--cluster", &cluster, "-o", plan],
    ]
    .concat();
    let (ok, _, err) = shardc(&args);
    assert!(!ok, "compile must refuse");
    assert!(err.starts_with("error: plan does not fit"), "{err}");
    assert!(
        err.contains("--allow-oom") && err.contains("activations"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(!Path::new(plan).exists());
    let mut args = args;
    args.push("--allow-oom");
    let (ok, _, err) = shardc(&args);
    assert!(ok, "{err}");
    assert!(err.contains("warning: plan does not fit"), "{err}");
    assert!(Path::new(plan).exists());
    // A device that fits: no warning.
    let big = small_device_cluster(dir.path(), 80e9);
    let (ok, _, err) = simulate(&big);
    assert!(ok && !err.contains("does not fit"), "{err}");
}

#[test]
fn calibrate_needs_the_cuda_backend_or_measurements() {
    // With no device visible (as on CI; `CUDA_VISIBLE_DEVICES=""` hides a GPU elsewhere) a
    // bare calibrate fails clearly instead of measuring.
    let out = Command::new(env!("CARGO_BIN_EXE_shardc"))
        .arg("calibrate")
        .env("CUDA_VISIBLE_DEVICES", "")
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    let (ok, err) = (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(!ok);
    assert!(err.contains("CUDA backend"), "{err}");
    assert!(err.contains("--measurements"), "{err}");
    // Measurements taken elsewhere fit offline into loadable profiles.
    let dir = tempfile::tempdir().unwrap();
    let m = serde_json::json!({
        "device": "NVIDIA H100 80GB HBM3",
        "gemm": [{"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "seconds": 0.00185}],
        "copy": [{"bytes": 1073741824u64, "seconds": 0.00075}, {"bytes": 4096, "seconds": 0.0000025}],
        "collectives": [
            {"kind": "all_reduce", "ranks": 8, "bytes": 1073741824u64, "seconds": 0.0052, "network": false},
            {"kind": "all_reduce", "ranks": 8, "bytes": 1024, "seconds": 0.000015, "network": false}
        ]
    });
    let mp = dir.path().join("m.json");
    std::fs::write(&mp, m.to_string()).unwrap();
    let out = dir.path().join("cal.toml");
    let stdout = common::succeeds(&[
        "calibrate",
        "--measurements",
        mp.to_str().unwrap(),
        "--cluster",
        "dgx-h100",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(stdout.contains("gemm large"), "{stdout}");
    let text = std::fs::read_to_string(&out).unwrap();
    // 2·8192³ / 1.85 ms / 989.4 TFLOP/s.
    let want = 2.0 * 8192f64.powi(3) / 0.00185 / 989.4e12;
    assert!(text.contains(&format!("{want}")), "{text}");
    assert!(text.contains("measured by `shardc calibrate` on NVIDIA H100 80GB HBM3"));
    let cluster = dir.path().join("cal-cluster.toml");
    let v = ok_json(
        &[
            &["simulate", "tests/fixtures/hf-tiny/llama"],
            &TINY_TP2[..],
            &["--cluster", cluster.to_str().unwrap(), "--json"],
        ]
        .concat(),
    );
    assert_eq!(v["device"], "cal");
}

#[test]
fn bad_cluster_and_too_small_cluster_are_clear_errors() {
    let (ok, _, err) = shardc(&["simulate", "--cluster", "nope"]);
    assert!(
        !ok && err.contains("unknown profile `nope`") && err.contains("dgx-h100"),
        "{err}"
    );
    let (ok, _, err) = shardc(&[
        "simulate",
        "tests/fixtures/hf-tiny/llama",
        "--mesh",
        "dp=4,tp=4",
        "--cluster",
        "dgx-h100x1",
    ]);
    assert!(!ok, "16 ranks on 8 GPUs");
    assert!(
        err.contains("needs 16 GPUs") && err.contains("dgx-h100x2"),
        "{err}"
    );
    // Three layers on two stages: the compiler's split (uneven), simulated as compiled; a
    // `--stage-layers` that does not cover the model is refused by name.
    let pipeline = [
        "simulate",
        "tests/fixtures/hf-tiny/llama",
        "--train",
        "--mesh",
        "pp=2,tp=2",
        "--seq",
        "16",
    ];
    let out = common::succeeds(&pipeline);
    assert!(out.contains("stage  layers"), "{out}");
    let (ok, _, err) = shardc(&[&pipeline[..], &["--stage-layers", "2,2"]].concat());
    assert!(!ok && err.contains("--stage-layers"), "{err}");
}

#[test]
fn train_runs_every_pipeline_schedule() {
    let run = |extra: &[&str]| {
        let mut args = LLAMA_70B_TRAIN.to_vec();
        args.extend_from_slice(&[
            "--global-batch",
            "512",
            "--seq",
            "4096",
            "--cluster",
            "dgx-h100x128",
            "--json",
        ]);
        args.extend_from_slice(extra);
        ok_json(&args)
    };
    let bubble = |v: &serde_json::Value| v["bubble_fraction"].as_f64().unwrap();
    let one = run(&["--schedule", "1f1b"]);
    let zb = run(&["--schedule", "zb-h1"]);
    assert_eq!(zb["schedule"], "zb-h1");
    // ZB-H1 fills 1F1B's bubble with the deferred weight-gradient passes.
    assert!(
        bubble(&zb) < bubble(&one),
        "{} vs {}",
        bubble(&zb),
        bubble(&one)
    );
    assert_eq!(run(&["--schedule", "gpipe"])["schedule"], "gpipe");
    let il = run(&["--schedule", "interleaved", "--virtual-stages", "2"]);
    assert_eq!(il["schedule"], "interleaved(v=2)");
    assert!(bubble(&il) < bubble(&one));
    // An unknown name: one line naming the flag and the valid names.
    let (ok, _, err) = shardc(&[
        "simulate",
        "models/llama-3-70b.json",
        "--train",
        "--mesh",
        "pp=8,dp=16,tp=8",
        "--cluster",
        "dgx-h100x128",
        "--schedule",
        "zb-h2",
    ]);
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("--schedule") && err.contains("gpipe, 1f1b, interleaved, zb-h1"),
        "{err}"
    );
}

/// `--recompute-num-layers k`: the first k layers of each stage fully recomputed, the others
/// under `--recompute`. The step time and memory lie between no and full recomputation and
/// move monotonically with k; k at least the stage's layers is full recomputation; a k with
/// `--recompute full`, or 0, is refused by name.
#[test]
fn block_recomputation_lies_between_none_and_full() {
    let at = |extra: &[&str]| {
        let v = ok_json(
            &[
                &LLAMA_70B_TRAIN[..],
                &[
                    "--global-batch",
                    "128",
                    "--seq",
                    "4096",
                    "--cluster",
                    "dgx-h100x128",
                ],
                extra,
                &["--json"],
            ]
            .concat(),
        );
        (
            v["step_time_s"].as_f64().unwrap(),
            v["peak_memory_bytes_per_rank"].as_u64().unwrap(),
            v["recompute"].as_str().unwrap().to_string(),
        )
    };
    let none = at(&[]);
    let full = at(&["--recompute", "full"]);
    let mut last = none.clone();
    for k in ["1", "4", "8"] {
        let b = at(&["--recompute-num-layers", k]);
        assert_eq!(b.2, format!("full×{k}+none"));
        assert!(
            b.0 > last.0 && b.0 < full.0,
            "k={k}: {b:?} vs {last:?}, {full:?}"
        );
        assert!(
            b.1 < last.1 && b.1 > full.1,
            "k={k}: {b:?} vs {last:?}, {full:?}"
        );
        last = b;
    }
    let all = at(&["--recompute-num-layers", "80"]);
    assert_eq!((all.0, all.1), (full.0, full.1));
    for (args, needle) in [
        (
            vec!["--recompute", "full", "--recompute-num-layers", "2"],
            "--recompute none or selective",
        ),
        (
            vec!["--recompute-num-layers", "0"],
            "--recompute-num-layers",
        ),
    ] {
        let a: Vec<&str> = [&LLAMA_70B_TRAIN[..], &args[..]].concat();
        common::fails_with(&a, &[needle]);
    }
}
