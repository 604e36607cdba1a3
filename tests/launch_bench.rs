//! `shardc bench collectives`: every collective on every size checks clean against its
//! definition (`#wrong` 0), and sizes and bandwidths follow nccl-tests' definitions.

mod common;

use common::run_shardc;

use serde_json::Value;

fn bench(args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["bench", "collectives"];
    all.extend_from_slice(args);
    run_shardc(&all, &[])
}

/// nccl-tests' bus bandwidth factors (doc/PERFORMANCE.md), written out independently.
fn factor(op: &str, n: f64) -> f64 {
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" => (n - 1.0) / n,
        "broadcast" | "reduce" => 1.0,
        other => panic!("unexpected collective {other}"),
    }
}

#[test]
fn json_rows_are_correct_and_follow_nccl_tests() {
    for comm in ["thread", "tcp"] {
        let (ok, out, err) = bench(&[
            "--comm",
            comm,
            "--nranks",
            "3",
            "--min-bytes",
            "8",
            "--max-bytes",
            "64K",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--json",
        ]);
        assert!(ok, "{comm}: {err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["comm"], comm);
        assert_eq!(v["nranks"], 3);
        let rows = v["results"].as_array().unwrap();
        let mut ops: Vec<&str> = Vec::new();
        for r in rows {
            let op = r["op"].as_str().unwrap();
            if !ops.contains(&op) {
                ops.push(op);
            }
            let bytes = r["bytes"].as_u64().unwrap();
            let count = r["count"].as_u64().unwrap();
            assert_eq!(r["wrong"], 0, "{comm} {r}");
            assert_eq!(r["type"], "float");
            assert_eq!(bytes, 4 * count, "{r}");
            if matches!(op, "all_gather" | "reduce_scatter" | "all_to_all") {
                assert_eq!(count % 3, 0, "split evenly over 3 ranks: {r}");
            }
            let (time, alg, bus) = (
                r["time_us"].as_f64().unwrap(),
                r["algbw_gbs"].as_f64().unwrap(),
                r["busbw_gbs"].as_f64().unwrap(),
            );
            assert!(time > 0.0, "{r}");
            let want_alg = bytes as f64 / (time * 1e-6) / 1e9;
            assert!((alg - want_alg).abs() <= 1e-9 * want_alg.max(1e-9), "{r}");
            assert!(
                (bus - alg * factor(op, 3.0)).abs() <= 1e-12 + 1e-9 * alg,
                "{r}"
            );
        }
        assert_eq!(
            ops,
            [
                "all_reduce",
                "all_gather",
                "reduce_scatter",
                "all_to_all",
                "broadcast",
                "reduce"
            ]
        );
        // all_reduce covers 8 B..64 KiB in powers of two.
        let ar: Vec<u64> = rows
            .iter()
            .filter(|r| r["op"] == "all_reduce")
            .map(|r| r["bytes"].as_u64().unwrap())
            .collect();
        assert_eq!(ar, (3..=16).map(|k| 1u64 << k).collect::<Vec<_>>());
    }
}

#[test]
fn table_and_errors() {
    let (ok, out, err) = bench(&[
        "--nranks",
        "2",
        "--max-bytes",
        "1K",
        "--ops",
        "all_reduce,broadcast",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("(GB/s)") && out.contains("#wrong"), "{out}");
    assert!(
        out.contains("\nall_reduce\n") && out.contains("\nbroadcast\n"),
        "{out}"
    );
    assert!(!out.contains("\nall_gather\n"), "{out}");
    assert!(out.contains("# wrong values: 0 OK"), "{out}");

    // The GPU communicators need the CUDA backend (a clear error on this machine).
    for comm in ["local-gpu", "nccl"] {
        let (ok, _, err) = bench(&["--comm", comm]);
        assert!(!ok, "{comm}");
        assert!(
            err.starts_with("error: ") && err.to_lowercase().contains("cuda"),
            "{err}"
        );
    }
    for (args, needle) in [
        (&["--comm", "gloo"][..], "unknown communicator `gloo`"),
        (
            &["--ops", "allreduce,scan"][..],
            "unknown collective `scan`",
        ),
        (&["--max-bytes", "12Q"][..], "not a positive size"),
        (&["--nranks", "0"][..], "--nranks must be at least 1"),
        (
            &["--min-bytes", "1M", "--max-bytes", "1K"][..],
            "--min-bytes",
        ),
    ] {
        let (ok, _, err) = bench(args);
        assert!(!ok && err.contains(needle), "{args:?}: {err}");
    }
}
