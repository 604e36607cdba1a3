//! `compile --cluster` reaches the rewriter: its extractor costs nodes with the cluster
//! profile's rates (the report names the device), so the same program costs more compute
//! time on an A100 than on an H100; the default is the DGX H100 profile.

mod common;

use common::{run_shardc, TINY_TP2};

/// (device, compute µs after rewriting) from the report's cost line.
fn rewrite_cost(cluster: Option<&str>) -> (String, f64) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.json");
    let mut args = [
        &["compile", "tests/fixtures/hf-tiny/llama"],
        &TINY_TP2[..],
        &["--rewrite", "all", "-o", out.to_str().unwrap()],
    ]
    .concat();
    if let Some(c) = cluster {
        args.extend_from_slice(&["--cluster", c]);
    }
    let (ok, stdout, err) = run_shardc(&args, &[]);
    assert!(ok, "{err}");
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("cost per rank ("))
        .unwrap_or_else(|| panic!("no cost line: {stdout}"));
    let device = line["  cost per rank (".len()..]
        .split(',')
        .next()
        .unwrap()
        .to_string();
    let after = line.rsplit("→").next().unwrap();
    let compute: f64 = after
        .split("compute ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The plan records it too.
    let plan = common::read_json(&out);
    assert_eq!(plan["rewrite"]["device"], device.as_str());
    (device, compute)
}

#[test]
fn the_cluster_profile_prices_the_rewrite() {
    let (d, h100) = rewrite_cost(None);
    assert_eq!(d, "h100-sxm");
    let (d, a100) = rewrite_cost(Some("dgx-a100"));
    assert_eq!(d, "a100-80gb-sxm");
    // Same program, slower device: more compute time (fp32 19.5 vs 66.9 TFLOP/s, HBM 2.0 vs
    // 3.35 TB/s, launch floors aside).
    assert!(a100 > h100, "{a100} vs {h100}");
    assert_eq!(rewrite_cost(Some("dgx-h100")).1, h100);
}
