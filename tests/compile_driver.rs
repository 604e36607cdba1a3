//! The compile driver: one entry for forward, training and pipelined plans, its pass list,
//! `--dump-after`, `--verify` and `--pass-times`.

mod common;

use common::{fails_with, fixtures, run_shardc};
use shardc::compiler::compile::{
    compile, compile_forward, compile_logged, CompileOptions, CompileSpec, Job, Pass,
};
use shardc::compiler::ir::Graph;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::plan::Plan;
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{compile_pipeline, compile_train, Precision, TrainOptions};

fn cfg(model: &str) -> ModelConfig {
    ModelConfig::from_path(&fixtures().join(model)).expect("fixture config")
}

fn forward(mesh: &str, extra: &[&str], batch: usize, seq: usize) -> Job {
    Job::Forward(CompileOptions {
        batch,
        seq,
        mesh: Mesh::parse(mesh, 8).expect("mesh"),
        extra_strategies: extra.iter().map(|s| s.to_string()).collect(),
    })
}

fn train(mesh: &str, extra: &[&str], micro: usize) -> TrainOptions {
    let mut t = TrainOptions::new(4, 8, Mesh::parse(mesh, 8).expect("mesh"));
    t.extra_strategies = extra.iter().map(|s| s.to_string()).collect();
    t.micro_batches = micro;
    t
}

/// The driver's plan is the plan the passes build when called one by one: forward, training,
/// pipeline; byte for byte.
#[test]
fn the_driver_builds_the_same_plan_as_the_passes_alone() {
    let c = cfg("llama");
    let job = forward("dp=2,tp=2", &["sp"], 2, 16);
    let Job::Forward(opts) = &job else {
        unreachable!()
    };
    let mut by_hand = Plan::new(
        &compile_forward(&c, opts).expect("forward"),
        "m",
        "llama",
        3,
    );
    // The spec's mixed precision: a bf16 plan.
    by_hand.dtype = shardc::compiler::ir::DType::Bf16;
    let driven = compile(&CompileSpec::new(c.clone(), "m", job)).expect("driver");
    assert_eq!(driven.to_json(), by_hand.to_json());

    let t = train("dp=2,tp=2", &["sp", "zero1"], 2);
    let by_hand = compile_train(&c, &t)
        .expect("train")
        .plan("m", "llama", 3, Precision::mixed());
    let driven =
        compile(&CompileSpec::new(c.clone(), "m", Job::Train(Box::new(t)))).expect("driver");
    assert_eq!(driven.to_json(), by_hand.to_json());

    let t = train("pp=2,dp=2", &[], 2);
    let by_hand =
        compile_pipeline(&c, &t)
            .expect("pipeline")
            .plan("m", "llama", 3, Precision::mixed());
    let driven = compile(&CompileSpec::new(c, "m", Job::Train(Box::new(t)))).expect("driver");
    assert_eq!(driven.to_json(), by_hand.to_json());
    assert!(driven.pipeline.is_some());
}

/// Every pass that runs for a job is timed (once per pipeline chunk for the per-chunk passes),
/// in the order of [`Pass::ALL`].
#[test]
fn every_pass_of_each_job_runs_in_order() {
    let c = cfg("llama");
    let cases = [
        (forward("tp=2", &[], 2, 8), false, false, 1),
        (
            Job::Train(Box::new(train("dp=2,tp=2", &[], 1))),
            true,
            false,
            1,
        ),
        (
            Job::Train(Box::new(train("pp=2,dp=2", &[], 2))),
            true,
            true,
            2,
        ),
    ];
    for (job, is_train, pipelined, chunks) in cases {
        let spec = CompileSpec::new(c.clone(), "m", job);
        assert_eq!(spec.pipelined(), pipelined);
        let (_, log) = compile_logged(&spec).expect("compile");
        for p in Pass::ALL {
            let runs = log.timings.iter().filter(|t| t.pass == p).count();
            let want = match p {
                Pass::Build
                | Pass::Annotate
                | Pass::Partition
                | Pass::GradLayout
                | Pass::Rewrite
                | Pass::Buckets
                | Pass::Split
                | Pass::Prefetch
                    if pipelined =>
                {
                    chunks
                }
                Pass::Autodiff if pipelined => chunks,
                _ if p.runs_for(is_train, pipelined) => 1,
                _ => 0,
            };
            assert_eq!(runs, want, "{p} for train={is_train} pipelined={pipelined}");
        }
        let order: Vec<usize> = log
            .timings
            .iter()
            .filter(|t| t.chunk.is_none_or(|c| c == 0))
            .map(|t| Pass::ALL.iter().position(|&p| p == t.pass).expect("a pass"))
            .collect();
        assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
    }
}

/// The tiny Llama fixture's directory, for a command line.
fn llama() -> String {
    fixtures().join("llama").display().to_string()
}

/// `--mesh tp=2 --batch 2 --seq 8`: the tensor-parallel shape this file compiles the tiny
/// Llama at.
const TP2_B2_T8: [&str; 6] = ["--mesh", "tp=2", "--batch", "2", "--seq", "8"];

/// `--dump-after` gives the text IR of the program after that pass: it parses back to a graph
/// that verifies, its layouts follow as comments, and each pipeline chunk is dumped.
#[test]
fn dump_after_prints_text_ir_that_parses_back() {
    let m = &llama();
    for pass in ["build", "annotate", "partition", "rewrite"] {
        let args = [
            &["compile", m][..],
            &TP2_B2_T8,
            &["--rewrite", "all", "--dump-after", pass],
        ]
        .concat();
        let (ok, out, err) = run_shardc(&args, &[]);
        assert!(ok, "{pass}: {err}");
        let body = out
            .strip_prefix(&format!("// after pass `{pass}`\n"))
            .unwrap_or_else(|| panic!("{pass}: header missing in {out}"));
        let g: Graph = body
            .parse()
            .unwrap_or_else(|e| panic!("{pass}: {e}\n{body}"));
        shardc::compiler::ir::verify(&g).expect("verifies");
        if pass != "build" {
            assert!(out.contains("\n// %"), "{pass}: no layouts");
        }
        assert!(
            !out.contains("compiled in"),
            "a dump does not write the plan"
        );
    }
    for pass in ["autodiff", "grad-layout", "buckets"] {
        let (ok, out, err) = run_shardc(
            &[
                "compile",
                m,
                "--train",
                "--mesh",
                "pp=2,dp=2",
                "--batch",
                "4",
                "--seq",
                "8",
                "--micro-batches",
                "2",
                "--dump-after",
                pass,
            ],
            &[],
        );
        assert!(ok, "{pass}: {err}");
        for chunk in 0..2 {
            let header = format!("// after pass `{pass}`, pipeline chunk {chunk}\n");
            let at = out
                .find(&header)
                .unwrap_or_else(|| panic!("{header} in {out}"));
            let rest = &out[at + header.len()..];
            let end = rest.find("// after pass").unwrap_or(rest.len());
            let g: Graph = rest[..end]
                .parse()
                .unwrap_or_else(|e| panic!("{pass}: {e}"));
            shardc::compiler::ir::verify(&g).expect("verifies");
        }
    }
}

/// The pass list's vocabulary: an unknown pass names the valid ones; a pass the job does not
/// run says so.
#[test]
fn dump_after_names_its_errors() {
    fails_with(
        &["compile", "--dump-after", "lower"],
        &["unknown pass `lower`", "build, autodiff, annotate"],
    );
    fails_with(
        &["compile", "--dump-after", "autodiff"],
        &["pass `autodiff` does not run for this job"],
    );
    assert!(Pass::from_name("grad-layout").is_ok());
}

/// `--verify` runs in a release binary as in debug: the plan is checked as the loader would,
/// and `--pass-times` lists each pass.
#[test]
fn verify_and_pass_times_on_every_job() {
    let m = &llama();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("p.json");
    let o = out.to_str().expect("utf-8");
    for args in [
        vec!["--mesh", "dp=2,tp=2", "--batch", "2", "--seq", "8"],
        vec!["--train", "--mesh", "dp=2,tp=2", "--strategy", "sp,zero1"],
        vec!["--train", "--mesh", "pp=2,tp=2", "--micro-batches", "2"],
    ] {
        let mut a = vec!["compile", m, "--verify", "--pass-times", "-o", o];
        if args.contains(&"--train") {
            a.extend(["--batch", "4", "--seq", "8"]);
        }
        a.extend(args.iter().copied());
        let (ok, stdout, err) = run_shardc(&a, &[]);
        assert!(ok, "{a:?}: {err}");
        assert!(stdout.contains("passes:\n  build"), "{stdout}");
        assert!(stdout.contains("  plan "), "{stdout}");
        Plan::load(&out).expect("the written plan loads");
    }
}

/// `shardc train --rewrite` trains the rewritten step: the same losses and gradients as the
/// step without rewriting (1e-5), and `--plan` refuses it (the plan fixes the program).
#[test]
fn train_with_rewrite_matches_the_plain_step() {
    let m = &llama();
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = dir.path().join("b.json");
    std::fs::write(&tokens, "[[1,2,3,4,5,6,7,8],[9,10,11,12,13,14,15,16]]").expect("write");
    let t = tokens.to_str().expect("utf-8");
    let run = |extra: &[&str], grads: &str| {
        let g = dir.path().join(grads);
        let mut a = vec!["train", m, "--tokens", t, "--mesh", "tp=2", "--steps", "2"];
        a.extend(["--dump-grads", g.to_str().expect("utf-8")]);
        a.extend(extra.iter().copied());
        let (ok, out, err) = run_shardc(&a, &[]);
        assert!(ok, "{a:?}: {err}");
        let losses: Vec<f32> = out
            .lines()
            .filter_map(|l| l.strip_prefix("step ")?.split("loss ").nth(1))
            .map(|x| {
                x.split_whitespace()
                    .next()
                    .expect("a number")
                    .parse()
                    .expect("f32")
            })
            .collect();
        let bytes = std::fs::read(&g).expect("grads written");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        let grads: Vec<(String, Vec<f32>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                let f = v
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                (n, f)
            })
            .collect();
        (out, losses, grads)
    };
    let (_, plain, g0) = run(&[], "plain.safetensors");
    let (out, rewritten, g1) = run(&["--rewrite", "all"], "rw.safetensors");
    assert!(out.contains("rewritten: "), "{out}");
    assert_eq!(plain.len(), 2);
    for (a, b) in plain.iter().zip(&rewritten) {
        assert!((a - b).abs() <= 1e-5, "loss {a} vs {b}");
    }
    let mut g0 = g0;
    let mut g1 = g1;
    g0.sort_by(|a, b| a.0.cmp(&b.0));
    g1.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(g0.len(), g1.len());
    for ((n0, a), (n1, b)) in g0.iter().zip(&g1) {
        assert_eq!(n0, n1);
        let d = common::max_abs_diff(a, b);
        assert!(d <= 1e-5, "{n0}: max |Δ| {d}");
    }
    let plan = dir.path().join("p.json");
    let args = [
        &["compile", m, "--train"][..],
        &TP2_B2_T8,
        &["-o", plan.to_str().expect("utf-8")],
    ]
    .concat();
    let (ok, _, err) = run_shardc(&args, &[]);
    assert!(ok, "{err}");
    fails_with(
        &[
            "train",
            m,
            "--tokens",
            t,
            "--plan",
            plan.to_str().expect("utf-8"),
            "--rewrite",
            "all",
        ],
        &["--rewrite"],
    );
}
