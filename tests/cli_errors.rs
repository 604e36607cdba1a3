//! Bad input gives a clear one-line error and a non-zero exit, never a panic.

mod common;

use common::{fails_with, write_file as write};

use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

fn llama() -> String {
    common::fixtures()
        .join("llama")
        .to_string_lossy()
        .to_string()
}

/// A copy of the llama fixture whose safetensors file went through `edit`.
fn edited_model(dir: &Path, edit: impl Fn(&str, Vec<usize>) -> Option<Vec<usize>>) -> PathBuf {
    let src = common::fixtures().join("llama");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(src.join("config.json"), model.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<common::RawTensor> = Vec::new();
    for (name, view) in st.tensors() {
        if let Some(shape) = edit(&name, view.shape().to_vec()) {
            let n: usize = shape.iter().product();
            let data = view.data()[..n.min(view.data().len() / 4) * 4].to_vec();
            let mut data = data;
            data.resize(n * 4, 0);
            kept.push((name, safetensors::Dtype::F32, shape, data));
        }
    }
    common::write_safetensors(&model.join("model.safetensors"), &kept);
    model
}

#[test]
fn config_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    fails_with(
        &["inspect", "/definitely/missing/config.json"],
        &["cannot read", "missing"],
    );
    fails_with(
        &["inspect", &write(d, "bad.json", "{ nope")],
        &["malformed JSON"],
    );
    fails_with(
        &[
            "inspect",
            &write(d, "bert.json", r#"{"model_type": "bert"}"#),
        ],
        &["unknown model_type", "bert"],
    );
    fails_with(
        &[
            "inspect",
            &write(
                d,
                "nohidden.json",
                r#"{"model_type": "llama", "vocab_size": 10}"#,
            ),
        ],
        &["hidden_size", "missing"],
    );
}

#[test]
fn run_input_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let out = d.join("out.json").to_string_lossy().to_string();
    let run = |tokens: &str, extra: &[&str], needles: &[&str]| {
        let model = llama();
        let mut args = vec!["run", &model, "--tokens", tokens, "--out", &out];
        args.extend(extra);
        let owned: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
        fails_with(&refs, needles);
    };
    run(
        &write(d, "big.json", "[[1, 2, 256]]"),
        &[],
        &["token id 256", "[0][2]", "vocabulary size 256"],
    );
    run(&write(d, "neg.json", "[[1, -1]]"), &[], &["token id -1"]);
    run(
        &write(d, "ragged.json", "[[1, 2, 3], [4, 5]]"),
        &[],
        &["ragged", "row 1"],
    );
    run(
        &write(d, "notlist.json", r#"{"ids": 1}"#),
        &[],
        &["list of lists"],
    );
    run(&write(d, "float.json", "[[1.5]]"), &[], &["not an integer"]);
    run(&write(d, "garbage.json", "[[1,"), &[], &["malformed JSON"]);
    run(
        &d.join("absent.json").to_string_lossy(),
        &[],
        &["reading tokens"],
    );
    let long: Vec<String> = (0..129).map(|i| (i % 256).to_string()).collect();
    run(
        &write(d, "long.json", &format!("[[{}]]", long.join(","))),
        &[],
        &["sequence length 129", "maximum positions 128"],
    );
    let ok = write(d, "ok.json", "[[1, 2, 3]]");
    run(
        &ok,
        &["--attention-mask", &write(d, "m.json", "[[1, 1]]")],
        &["attention mask", "[1, 2]", "[1, 3]"],
    );
    run(&ok, &["--mesh", "tp=3"], &["heads=8", "tp=3"]);
    run(
        &ok,
        &["--mesh", "xx=2"],
        &["unknown mesh axis `xx`", "dp, tp"],
    );
    run(
        &ok,
        &["--mesh", "tp=2", "--strategy", "magic"],
        &["unknown strategy `magic`", "sp"],
    );
    run(&ok, &["--mesh", "dp=2"], &["batch=1", "dp=2"]);
    run(&ok, &["--mesh", "ep=2"], &["mixture-of-experts"]);
}

#[test]
fn weight_errors_name_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let out = d.join("out.json").to_string_lossy().to_string();
    let ok = write(d, "ok.json", "[[1, 2, 3]]");
    let missing = edited_model(&d.join("a"), |n, s| {
        (n != "model.layers.1.mlp.up_proj.weight").then_some(s)
    });
    fails_with(
        &[
            "run",
            &missing.to_string_lossy(),
            "--tokens",
            &ok,
            "--out",
            &out,
        ],
        &["model.layers.1.mlp.up_proj.weight"],
    );
    let misshaped = edited_model(&d.join("b"), |n, s| {
        Some(if n == "model.layers.0.self_attn.q_proj.weight" {
            vec![32, 64]
        } else {
            s
        })
    });
    fails_with(
        &[
            "run",
            &misshaped.to_string_lossy(),
            "--tokens",
            &ok,
            "--out",
            &out,
        ],
        &[
            "model.layers.0.self_attn.q_proj.weight",
            "[64, 64]",
            "[32, 64]",
        ],
    );
}

#[test]
fn compile_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let plan = d.join("p.json").to_string_lossy().to_string();
    let gpt2 = common::fixtures()
        .join("gpt2")
        .to_string_lossy()
        .to_string();
    fails_with(
        &["compile", &gpt2, "--mesh", "tp=3", "-o", &plan],
        &["heads=4", "tp=3"],
    );
    let real_gpt2 = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2.json");
    fails_with(
        &["compile", real_gpt2, "--mesh", "tp=2", "-o", &plan],
        &["vocab=50257", "tp=2"],
    );
    fails_with(
        &[
            "compile",
            &gpt2,
            "--mesh",
            "tp=2",
            "--strategy",
            "sp",
            "--seq",
            "15",
            "-o",
            &plan,
        ],
        &["seq=15", "tp=2"],
    );
    fails_with(
        &["explain", &write(d, "notplan.json", "{}")],
        &["plan format version 0"],
    );
}
