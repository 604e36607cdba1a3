//! `shardc schedule`: diagram rows, bubble fraction as the textbook formulas give, trace file.

mod common;

use common::run_shardc;

fn schedule(args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["schedule"];
    all.extend_from_slice(args);
    run_shardc(&all, &[])
}

fn bubble(out: &str) -> f64 {
    let i = out.find("bubble fraction ").unwrap() + "bubble fraction ".len();
    out[i..].split(',').next().unwrap().trim().parse().unwrap()
}

#[test]
fn schedules_print_rows_and_textbook_bubbles() {
    for (kind, p, m, v, want) in [
        ("gpipe", 4, 8, 1, 3.0 / 11.0),
        ("1f1b", 4, 8, 1, 3.0 / 11.0),
        ("interleaved", 4, 8, 2, 3.0 / 19.0),
    ] {
        let (ok, out, err) = schedule(&[
            "--pp",
            &p.to_string(),
            "--micro-batches",
            &m.to_string(),
            "--schedule",
            kind,
            "--virtual-stages",
            &v.to_string(),
        ]);
        assert!(ok, "{err}");
        assert_eq!(
            out.lines().filter(|l| l.starts_with("stage ")).count(),
            p,
            "{out}"
        );
        assert!((bubble(&out) - want).abs() < 1e-4, "{kind}: {out}");
    }
    let (_, out, _) = schedule(&["--pp", "4", "--micro-batches", "8", "--schedule", "gpipe"]);
    assert!(
        out.contains("peak in-flight micro-batches per stage [8, 8, 8, 8]"),
        "{out}"
    );
    let (_, out, _) = schedule(&["--pp", "4", "--micro-batches", "8", "--schedule", "1f1b"]);
    assert!(
        out.contains("peak in-flight micro-batches per stage [4, 3, 2, 1]"),
        "{out}"
    );
}

#[test]
fn trace_and_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("trace.json");
    let (ok, _, err) = schedule(&["--schedule", "zb-h1", "--trace", t.to_str().unwrap()]);
    assert!(ok, "{err}");
    let v = common::read_json(&t);
    let slices = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .count();
    assert_eq!(
        slices,
        3 * 8 * 4,
        "F, B and W for 8 micro-batches on 4 stages"
    );
    let (ok, _, err) = schedule(&["--schedule", "magic"]);
    assert!(
        !ok && err.contains("unknown pipeline schedule `magic`"),
        "{err}"
    );
    let (ok, _, err) = schedule(&[
        "--schedule",
        "interleaved",
        "--pp",
        "4",
        "--micro-batches",
        "6",
    ]);
    assert!(!ok && err.contains("6 % 4"), "{err}");
}
