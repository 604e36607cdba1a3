//! The CPU reference executor reproduces transformers' logits and hidden states on every
//! hf-tiny fixture (max |Δ| < 1e-4), through the library and through `shardc run`.

mod common;

use shardc::compiler::model::{build_forward, BuildOptions, ModelConfig};
use shardc::runtime::{execute, RankCtx, Weights};
use std::process::Command;

#[test]
fn library_reproduces_every_fixture() {
    let cases = common::cases();
    assert_eq!(
        cases.len(),
        7,
        "every reference file, the left-padded one included"
    );
    for case in cases {
        let dir = common::fixtures().join(&case.model);
        let cfg = ModelConfig::from_path(&dir).unwrap();
        let g = build_forward(&cfg, BuildOptions::new(case.batch, case.seq)).unwrap();
        let w = Weights::open(&dir).unwrap();
        let out = execute(&g, &w, &case.inputs(), &RankCtx::new()).unwrap();
        case.check(&out, "unsharded");
    }
}

#[test]
fn cli_run_reproduces_every_fixture() {
    let tmp = tempfile::tempdir().unwrap();
    for case in common::cases() {
        let write = |name: &str, v: &serde_json::Value| {
            let p = tmp
                .path()
                .join(format!("{}_{}_{name}.json", case.model, case.name));
            std::fs::write(&p, v.to_string()).unwrap();
            p
        };
        let ids = write("ids", &case.json["input_ids"]);
        let out = tmp
            .path()
            .join(format!("{}_{}_out.json", case.model, case.name));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_shardc"));
        cmd.arg("run")
            .arg(common::fixtures().join(&case.model))
            .arg("--tokens")
            .arg(&ids)
            .arg("--out")
            .arg(&out);
        if let Some(m) = case.json.get("attention_mask") {
            cmd.arg("--attention-mask").arg(write("mask", m));
        }
        if let Some(p) = case.json.get("position_ids") {
            cmd.arg("--position-ids").arg(write("pos", p));
        }
        let res = cmd.output().unwrap();
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        let stdout = String::from_utf8_lossy(&res.stdout);
        assert_eq!(stdout.lines().count(), 1, "one-line summary: {stdout}");
        let got = common::read_json(&out);
        assert_eq!(got["logits_shape"], case.json["logits_shape"]);
        assert_eq!(got["hidden_shape"], case.json["hidden_shape"]);
        let f = |k: &str| -> Vec<f32> {
            got[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        };
        let outputs = std::collections::BTreeMap::from([
            (
                "logits".to_string(),
                shardc::runtime::Tensor::f32(
                    vec![got["logits"].as_array().unwrap().len()],
                    f("logits"),
                ),
            ),
            (
                "hidden".to_string(),
                shardc::runtime::Tensor::f32(
                    vec![got["hidden"].as_array().unwrap().len()],
                    f("hidden"),
                ),
            ),
        ]);
        case.check(&outputs, "cli");
    }
}
