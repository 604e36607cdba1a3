//! `shardc train --mesh pp=...` and `shardc schedule plan.json` end to end: the pipelined
//! run prints the unsharded run's losses and its chunk placement; the plan it writes verifies
//! and draws; a tampered plan is rejected naming the rank and instruction; `--export` and
//! `--dump-grads` write what the unsharded run writes.

mod common;

use serde_json::Value;
use shardc::compiler::ir::ValueRole;
use shardc::runtime::Weights;
use std::path::{Path, PathBuf};

/// Runs `shardc args…` and expects success; returns stdout.
fn ok(args: &[&str]) -> String {
    let (ok, out, err) = common::run_shardc(args, &[]);
    assert!(ok, "{args:?} failed: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    out
}

fn llama() -> String {
    common::fixtures()
        .join("llama")
        .to_string_lossy()
        .to_string()
}

/// The `step N: loss X` lines: (N, X).
fn losses(out: &str) -> Vec<(usize, f64)> {
    out.lines()
        .filter_map(|l| {
            let (n, rest) = l.strip_prefix("step ")?.split_once(": loss ")?;
            Some((n.parse().ok()?, rest.split(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// The `  chunk J on stage S: …` lines: (J, S, description).
fn placement(out: &str) -> Vec<(usize, usize, String)> {
    out.lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix("chunk ")?;
            let (j, rest) = rest.split_once(" on stage ")?;
            let (s, what) = rest.split_once(": ")?;
            Some((j.parse().ok()?, s.parse().ok()?, what.to_string()))
        })
        .collect()
}

/// The decoder layers `layers a..b` of a placement description (inclusive), if any.
fn layer_range(what: &str) -> Option<(usize, usize)> {
    let i = what.find("layers ")? + "layers ".len();
    let (a, rest) = what[i..].split_once("..")?;
    let b: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Asserts two runs printed the same per-step losses (within 1e-5), `steps` of them.
fn same_losses(what: &str, got: &str, want: &str, steps: usize) {
    let (g, w) = (losses(got), losses(want));
    assert_eq!(g.len(), steps, "{what}: {got}");
    assert_eq!(w.len(), steps, "unsharded: {want}");
    for ((gn, gl), (wn, wl)) in g.iter().zip(&w) {
        assert_eq!(gn, wn, "{what}: step numbers");
        assert!(
            (gl - wl).abs() < 1e-5,
            "{what}: step {gn}: loss {gl} vs unsharded {wl}"
        );
    }
    // The optimizer did something: the second step's loss differs from the first.
    assert!((w[1].1 - w[0].1).abs() > 1e-3, "unsharded: {want}");
}

#[test]
fn pipelined_losses_equal_the_unsharded_run_and_chunks_are_placed() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, ids) = (llama(), common::tokens_4x16(tmp.path()));
    let base = ok(&["train", &m, "--tokens", &ids, "--steps", "2"]);
    assert!(base.contains("unsharded"), "{base}");

    // Default split (balanced by cost), 1F1B.
    let pipelined = [
        "train",
        &m,
        "--tokens",
        &ids,
        "--steps",
        "2",
        "--mesh",
        "pp=2,dp=2",
        "--micro-batches",
        "2",
    ];
    let out = ok(&pipelined);
    assert!(
        out.contains("mesh pp=2,dp=2 (pp,dp) on 4 thread ranks"),
        "{out}"
    );
    assert!(
        out.contains("pipeline: 1f1b schedule, 2 stages × 1 chunk(s), 2 micro-batches"),
        "{out}"
    );
    same_losses("pp=2,dp=2 1f1b", &out, &base, 2);
    let chunks = placement(&out);
    assert_eq!(chunks.len(), 2, "{out}");
    for (k, (j, s, _)) in chunks.iter().enumerate() {
        assert_eq!((*j, *s), (k, k), "chunk j on stage j: {out}");
    }
    assert!(chunks[0].2.starts_with("embedding"), "{out}");
    assert!(!chunks[0].2.contains("head"), "{out}");
    assert!(chunks[1].2.ends_with("head"), "{out}");
    assert!(!chunks[1].2.contains("embedding"), "{out}");
    // The chunks' layers cover the model's 3 layers in order, each once.
    let mut next = 0;
    for (_, _, what) in &chunks {
        if let Some((a, b)) = layer_range(what) {
            assert_eq!(a, next, "contiguous layers: {out}");
            assert!(b >= a, "{out}");
            next = b + 1;
        }
    }
    assert_eq!(next, 3, "all 3 layers placed: {out}");

    // An explicit split and another schedule: placement follows `--stage-layers`, same losses.
    let out = ok(&[
        &pipelined[..],
        &["--schedule", "gpipe", "--stage-layers", "1,2"],
    ]
    .concat());
    same_losses("pp=2,dp=2 gpipe 1,2", &out, &base, 2);
    let chunks = placement(&out);
    assert_eq!(
        chunks,
        vec![
            (0, 0, "embedding + layers 0..0".to_string()),
            (1, 1, "layers 1..2 + head".to_string()),
        ],
        "{out}"
    );
}

/// Trains one pipelined step writing its plan; returns the plan's path.
fn pipeline_plan(dir: &Path) -> PathBuf {
    let (m, ids) = (llama(), common::tokens_4x16(dir));
    let plan = dir.join("p.json");
    ok(&[
        "train",
        &m,
        "--tokens",
        &ids,
        "--mesh",
        "pp=2,dp=2",
        "--micro-batches",
        "2",
        "--save-plan",
        plan.to_str().unwrap(),
    ]);
    plan
}

/// The number after `bubble fraction `.
fn bubble(out: &str) -> f64 {
    let i = out.find("bubble fraction ").expect("a bubble fraction") + "bubble fraction ".len();
    out[i..].split(',').next().unwrap().trim().parse().unwrap()
}

#[test]
fn the_plan_verifies_and_schedule_draws_it() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = pipeline_plan(tmp.path());
    let out = ok(&["schedule", plan.to_str().unwrap()]);
    assert!(out.contains("verified"), "{out}");
    // 2 micro-batches × 1 boundary × (activation + gradient).
    assert!(out.contains("4 send/recv pairs matched in order"), "{out}");
    assert!(out.contains("mesh pp=2,dp=2, 2 chunks"), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("stage ")).collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(rows[0].starts_with("stage 0 |"), "{out}");
    assert!(rows[1].starts_with("stage 1 |"), "{out}");
    for (s, row) in rows.iter().enumerate() {
        for pass in ["F0", "F1", "B0", "B1"] {
            assert!(row.contains(pass), "stage {s} runs {pass}: {out}");
        }
    }
    // 1F1B, p = 2, m = 2, backward = 2 × forward: (p − 1)/(m + p − 1) = 1/3.
    assert!((bubble(&out) - 1.0 / 3.0).abs() < 1e-4, "{out}");
    // The chunk placement agrees with what the plan's JSON says.
    let v = common::read_json(&plan);
    assert_eq!(v["chunks"].as_array().unwrap().len(), 2);
    assert_eq!(v["pipeline_program"].as_array().unwrap().len(), 2);
    assert!(
        out.contains("chunk 0 on stage 0: embedding") && out.contains("+ head ("),
        "{out}"
    );
}

/// `plan` with `edit` applied to its JSON `pipeline_program`, written next to it as `name`.
fn tampered(plan: &Path, name: &str, edit: impl FnOnce(&mut Vec<Vec<Value>>)) -> String {
    let mut v = common::read_json(plan);
    let mut prog: Vec<Vec<Value>> = serde_json::from_value(v["pipeline_program"].take()).unwrap();
    edit(&mut prog);
    v["pipeline_program"] = serde_json::to_value(prog).unwrap();
    let p = plan.with_file_name(name);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
    p.to_string_lossy().to_string()
}

/// Index of the `n`-th (from 0) instruction of kind `kind` (`send`, `recv`, …) whose fields
/// match `carry` and `micro`.
fn find(ops: &[Value], kind: &str, carry: &str, micro: u64) -> usize {
    ops.iter()
        .position(|o| o[kind]["carry"] == carry && o[kind]["micro"] == micro)
        .unwrap_or_else(|| panic!("no {kind} {carry} {micro} in {ops:?}"))
}

/// Expects `shardc schedule` to reject `plan` with `edit` applied to its pipeline program
/// (written next to it as `name`): no panic, a one-line error naming every needle.
fn rejects(plan: &Path, name: &str, edit: impl FnOnce(&mut Vec<Vec<Value>>), needles: &[&str]) {
    let path = tampered(plan, name, edit);
    let (ok, out, err) = common::run_shardc(&["schedule", &path], &[]);
    assert!(!ok, "{path} should be rejected: {out}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(
        !out.contains("stage 0 |"),
        "no diagram for a bad plan: {out}"
    );
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
}

#[test]
fn tampered_plans_are_rejected_naming_rank_and_instruction() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = pipeline_plan(tmp.path());

    // Stage 1's two activation receives swapped: F0 now runs before its activation arrives.
    rejects(
        &plan,
        "swapped.json",
        |prog| {
            let (a, b) = (
                find(&prog[1], "recv", "act", 0),
                find(&prog[1], "recv", "act", 1),
            );
            prog[1].swap(a, b);
        },
        &[
            "reading",
            "pipeline rank 1, instruction 1",
            "runs before its input arrives",
        ],
    );

    // Both receives moved to the front of stage 1, in the wrong order: each pass still sees
    // its input, but the FIFO channel delivers micro-batch 0 first.
    rejects(
        &plan,
        "reordered.json",
        |prog| {
            let k1 = find(&prog[1], "recv", "act", 1);
            let r1 = prog[1].remove(k1);
            let k0 = find(&prog[1], "recv", "act", 0);
            let r0 = prog[1].remove(k0);
            prog[1].insert(0, r0);
            prog[1].insert(0, r1);
        },
        &[
            "pipeline rank 1, instruction 0",
            "recv activation of micro-batch 1",
            "send/recv mismatch",
            "micro-batch 0",
        ],
    );

    // Stage 0's activation send of a micro-batch deleted.
    let missing_sends: [(u64, &[&str]); 2] = [
        // The first: stage 1's first receive gets micro-batch 1 instead.
        (
            0,
            &[
                "pipeline rank 1, instruction 0",
                "recv activation of micro-batch 0",
                "send/recv mismatch",
            ],
        ),
        // The last: both ranks wait forever.
        (1, &["deadlock", "waits at slot", "recv"]),
    ];
    for (micro, needles) in missing_sends {
        let delete = |prog: &mut Vec<Vec<Value>>| {
            let k = find(&prog[0], "send", "act", micro);
            prog[0].remove(k);
        };
        rejects(&plan, &format!("no-send{micro}.json"), delete, needles);
    }

    // An extra send nobody receives.
    rejects(
        &plan,
        "extra-send.json",
        |prog| {
            let k = find(&prog[0], "send", "act", 1);
            let dup = prog[0][k].clone();
            prog[0].insert(k + 1, dup);
        },
        &["rank 0 sends 1 message(s) rank 1 never receives"],
    );

    // The untouched plan still verifies (the edits above are what broke it).
    let out = ok(&["schedule", plan.to_str().unwrap()]);
    assert!(out.contains("verified"), "{out}");
}

/// Max |Δ| per tensor between two safetensors files with the same tensor names; names whose
/// Δ is at least `tol` with their Δ.
fn diff_files(a: &Path, b: &Path, tol: f32) -> Vec<(String, f32)> {
    let (wa, wb) = (Weights::open(a).unwrap(), Weights::open(b).unwrap());
    assert_eq!(wa.names(), wb.names(), "{} vs {}", a.display(), b.display());
    assert!(!wa.names().is_empty());
    let mut bad = Vec::new();
    for n in wa.names() {
        let (x, y) = (wa.get(&n).unwrap(), wb.get(&n).unwrap());
        assert_eq!(x.shape, y.shape, "`{n}`");
        let d = common::max_abs_diff(x.as_f32().unwrap(), y.as_f32().unwrap());
        if d.is_nan() || d >= tol {
            bad.push((n, d));
        }
    }
    bad
}

#[test]
fn pipelined_checkpoint_and_gradients_equal_the_unsharded_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, ids) = (llama(), common::tokens_4x16(tmp.path()));
    let mut files = Vec::new();
    for (tag, mesh) in [("base", None), ("pp", Some("pp=2,dp=2"))] {
        let save = tmp.path().join(format!("{tag}-ckpt"));
        let grads = tmp.path().join(format!("{tag}-grads.safetensors"));
        let mut args = vec![
            "train",
            &m,
            "--tokens",
            &ids,
            "--export",
            save.to_str().unwrap(),
            "--dump-grads",
            grads.to_str().unwrap(),
        ];
        if let Some(mesh) = mesh {
            args.extend(["--mesh", mesh, "--micro-batches", "2"]);
        }
        let out = ok(&args);
        assert!(out.contains("weights (HuggingFace layout) →"), "{out}");
        assert!(out.contains("gradients →"), "{out}");
        assert!(save.join("config.json").exists());
        files.push((save.join("model.safetensors"), grads));
    }
    let (base, pp) = (&files[0], &files[1]);
    // The checkpoint has the original's tensor names: the trained weights moved.
    let orig = common::fixtures().join("llama");
    assert_eq!(
        Weights::open(&orig).unwrap().names(),
        Weights::open(&pp.0).unwrap().names()
    );
    let moved = diff_files(&orig.join("model.safetensors"), &pp.0, 1e-4);
    assert!(!moved.is_empty(), "the step changed no weight");

    let bad = diff_files(&pp.0, &base.0, 1e-6);
    assert!(
        bad.is_empty(),
        "checkpoint tensors differ from the unsharded run's: {bad:?}"
    );
    let bad = diff_files(&pp.1, &base.1, 1e-5);
    assert!(
        bad.is_empty(),
        "gradients differ from the unsharded run's: {bad:?}"
    );
    let g = Weights::open(&pp.1).unwrap();
    assert!(g
        .names()
        .iter()
        .all(|n| ValueRole::gradient_label(n).is_some()));
    let gnorm: f32 = g
        .names()
        .iter()
        .map(|n| {
            g.get(n)
                .unwrap()
                .as_f32()
                .unwrap()
                .iter()
                .map(|x| x * x)
                .sum::<f32>()
        })
        .sum();
    assert!(gnorm > 0.0, "all gradients are zero");
}
