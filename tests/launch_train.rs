//! `shardc launch -- train`: a training run in real processes (one per rank, tcp
//! communicators; a pipeline's transfers over the `pp` groups) prints, step by step, the
//! losses the same run prints on thread ranks — flat (dp, tp, sp, ZeRO-2) and pipelined
//! (1F1B, ZB-H1, GPT-2's tied embeddings exchanged between the end stages) — so each rank
//! kept its own parameter and optimizer shards correctly between steps.

mod common;

use common::shardc_clean as shardc;
use std::path::Path;

fn model(name: &str) -> String {
    common::fixtures().join(name).display().to_string()
}

fn tokens(dir: &Path) -> String {
    let rows: Vec<Vec<i64>> = (0..4)
        .map(|b| {
            (0..16)
                .map(|t| ((b * 16 + t) * 37 % 250 + 1) as i64)
                .collect()
        })
        .collect();
    let p = dir.join("toks.json");
    std::fs::write(&p, serde_json::to_string(&rows).unwrap()).unwrap();
    p.display().to_string()
}

/// The `step N: loss X` values printed (with or without the launcher's `[rank 0]` prefix).
fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| {
            let l = l.strip_prefix("[rank 0] ").unwrap_or(l);
            let rest = l.strip_prefix("step ")?;
            let (_, after) = rest.split_once(": loss ")?;
            after.split_whitespace().next()?.parse().ok()
        })
        .collect()
}

fn run(args: &[&str]) -> String {
    let out = shardc().args(args).output().unwrap();
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "{args:?} failed:\n{o}\n{e}");
    o
}

#[test]
fn launched_training_prints_the_thread_rank_losses() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tokens(tmp.path());
    // Model, mesh, further `train` flags.
    let cases = [
        (
            "llama",
            "dp=2,tp=2",
            "--strategy sp,zero2 --micro-batches 2",
        ),
        ("llama", "pp=2,dp=2", "--micro-batches 2"),
        ("llama", "pp=2,dp=2,tp=2", "--strategy sp --micro-batches 2"),
        ("llama", "pp=2", "--schedule zb-h1 --micro-batches 4"),
        ("gpt2", "pp=2", "--micro-batches 2"),
        ("llama", "dp=2,cp=2", "--micro-batches 2"),
        ("llama", "cp=2", "--cp-algo ulysses"),
    ];
    for (m, mesh, extra) in cases {
        let dir = model(m);
        let mut base = vec!["train", dir.as_str(), "--tokens", ids.as_str()];
        base.extend(["--mesh", mesh, "--steps", "3", "--timeout", "30"]);
        base.extend(extra.split_whitespace());
        let threads = losses(&run(&base));
        assert_eq!(threads.len(), 3, "{m} {mesh}: three steps on thread ranks");
        let n: usize = mesh
            .split(',')
            .map(|a| a.split_once('=').unwrap().1.parse::<usize>().unwrap())
            .product();
        let nproc = n.to_string();
        let mut launched = vec!["launch", "--nproc-per-node", nproc.as_str(), "--"];
        launched.extend(&base);
        let out = run(&launched);
        assert!(
            out.contains(&format!("as rank 0 of {n} processes (tcp)")),
            "{m} {mesh}:\n{out}"
        );
        let procs = losses(&out);
        assert_eq!(
            procs.len(),
            3,
            "{m} {mesh}: three steps in processes:\n{out}"
        );
        for (a, b) in threads.iter().zip(&procs) {
            assert!((a - b).abs() < 2e-6, "{m} {mesh}: {threads:?} vs {procs:?}");
        }
        // Training happened: the loss moved.
        assert!(procs[2] < procs[0], "{m} {mesh}: {procs:?}");
    }
}

#[test]
fn launched_training_refuses_what_needs_every_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tokens(tmp.path());
    let dir = model("llama");
    let ckpt = tmp.path().join("ckpt").display().to_string();
    let out = shardc()
        .args(["launch", "--nproc-per-node", "2", "--"])
        .args([
            "train", &dir, "--tokens", &ids, "--mesh", "dp=2", "--export", &ckpt,
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("--export, --dump-grads and --trace"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
}
