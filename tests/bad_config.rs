//! Bad model configs: every size, type, ratio and parameter a `config.json` can get wrong is a
//! one-line error naming the file and the key, from every command that reads a config; sizes
//! that would exhaust memory are refused with the estimate before anything is allocated.

mod common;

use common::{fails_with, fails_with_env, run_shardc};

use serde_json::{json, Value};
use std::path::Path;

/// The llama fixture's config with `edit` merged in (`null` removes a key), as
/// `<dir>/<name>.json`.
fn llama_with(dir: &Path, name: &str, edit: Value) -> String {
    with(dir, "llama", name, edit)
}

fn with(dir: &Path, fixture: &str, name: &str, edit: Value) -> String {
    let text =
        std::fs::read_to_string(common::fixtures().join(fixture).join("config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&text).unwrap();
    for (k, v) in edit.as_object().unwrap() {
        if v.is_null() {
            cfg.as_object_mut().unwrap().remove(k);
        } else {
            cfg[k] = v.clone();
        }
    }
    let p = dir.join(format!("{name}.json"));
    std::fs::write(&p, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    p.to_string_lossy().to_string()
}

/// The config error reaches the user from every command that reads a config, before any
/// other input is looked at; today's divide-by-zero of `num_key_value_heads: 0` included.
#[test]
fn zero_kv_heads_is_an_error_in_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let model = d.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        std::fs::read_to_string(llama_with(d, "kv0", json!({"num_key_value_heads": 0}))).unwrap(),
    )
    .unwrap();
    let m = model.to_string_lossy().to_string();
    let tokens = d.join("t.json");
    std::fs::write(&tokens, "[[1, 2, 3, 4], [5, 6, 7, 8]]").unwrap();
    let t = tokens.to_string_lossy().to_string();
    let out = d.join("out.json").to_string_lossy().to_string();
    let want = ["config.json: num_key_value_heads: must be > 0 (found 0)"];
    fails_with(&["inspect", &m], &want);
    fails_with(&["compile", &m, "-o", &out], &want);
    fails_with(&["compile", &m, "--train", "-o", &out], &want);
    fails_with(&["simulate", &m], &want);
    fails_with(&["simulate", &m, "--train"], &want);
    fails_with(&["run", &m, "--tokens", &t, "--out", &out], &want);
    fails_with(&["train", &m, "--tokens", &t], &want);
    assert!(!Path::new(&out).exists(), "nothing written");
}

#[test]
fn wrong_json_types_name_the_key_and_the_value() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for (edit, needles) in [
        (
            json!({"hidden_size": "abc"}),
            &["hidden_size: expected an integer, found \"abc\""][..],
        ),
        (
            json!({"num_hidden_layers": 2.5}),
            &["num_hidden_layers: expected an integer, found 2.5"],
        ),
        (
            json!({"intermediate_size": -176}),
            &["intermediate_size: expected a non-negative integer, found -176"],
        ),
        (
            json!({"rms_norm_eps": "tiny"}),
            &["rms_norm_eps: expected a number, found \"tiny\""],
        ),
        (
            json!({"tie_word_embeddings": 1}),
            &["tie_word_embeddings: expected true or false, found 1"],
        ),
        (
            json!({"hidden_act": 5}),
            &["hidden_act: expected a string, found 5"],
        ),
        (
            json!({"model_type": ["llama"]}),
            &["model_type: expected a string"],
        ),
        (
            json!({"rope_parameters": "fast"}),
            &["rope_parameters: expected an object, found \"fast\""],
        ),
        (
            json!({"rope_parameters": null, "rope_scaling": {"rope_type": 3}}),
            &["rope_scaling.rope_type: expected a string, found 3"],
        ),
    ] {
        let p = llama_with(d, "typed", edit);
        let mut want = vec!["typed.json: "];
        want.extend(needles);
        fails_with(&["inspect", &p], &want);
    }
    let root = d.join("array.json");
    std::fs::write(&root, "[1, 2]").unwrap();
    fails_with(
        &["inspect", &root.to_string_lossy()],
        &["array.json: <root>: expected a JSON object, found an array"],
    );
}

#[test]
fn every_size_must_be_positive() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for key in [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "head_dim",
    ] {
        let p = llama_with(d, key, json!({ key: 0 }));
        fails_with(
            &["inspect", &p],
            &[&format!("{key}: must be > 0 (found 0)")],
        );
    }
    fails_with(
        &["inspect", &llama_with(d, "v1", json!({"vocab_size": 1}))],
        &["vocab_size: must be at least 2 (found 1)"],
    );
    for key in ["n_embd", "n_layer", "n_head", "n_positions", "n_inner"] {
        let p = with(d, "gpt2", key, json!({ key: 0 }));
        fails_with(
            &["inspect", &p],
            &[&format!("{key}: must be > 0 (found 0)")],
        );
    }
    for key in ["num_local_experts", "num_experts_per_tok"] {
        let p = with(d, "mixtral", key, json!({ key: 0 }));
        fails_with(
            &["inspect", &p],
            &[&format!("{key}: must be > 0 (found 0)")],
        );
    }
    fails_with(
        &[
            "inspect",
            &with(d, "mixtral", "topk", json!({"num_experts_per_tok": 5})),
        ],
        &["num_experts_per_tok: 5 exceeds 4 experts"],
    );
    fails_with(
        &[
            "inspect",
            &with(d, "mixtral", "window", json!({"sliding_window": 0})),
        ],
        &["sliding_window: must be > 0 (found 0)"],
    );
    // A window that is present and positive is fine.
    let (ok, _, err) = run_shardc(
        &[
            "inspect",
            &with(d, "mixtral", "window8", json!({"sliding_window": 8})),
        ],
        &[],
    );
    assert!(ok, "{err}");
}

#[test]
fn shapes_must_fit_together() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    fails_with(
        &[
            "inspect",
            &llama_with(d, "kv3", json!({"num_key_value_heads": 3})),
        ],
        &["num_key_value_heads: 8 heads is not a multiple of 3 KV heads"],
    );
    fails_with(
        &["inspect", &llama_with(d, "odd", json!({"head_dim": 7}))],
        &["head_dim: must be even for rotary embeddings (found 7)"],
    );
    fails_with(
        &[
            "inspect",
            &llama_with(d, "nodiv", json!({"head_dim": null, "hidden_size": 60})),
        ],
        &["num_attention_heads: hidden_size 60 is not divisible by 8 heads"],
    );
    fails_with(
        &[
            "inspect",
            &with(d, "gpt2", "gpt2div", json!({"n_embd": 66})),
        ],
        &["n_head: n_embd 66 is not divisible by 4 heads"],
    );
}

/// Norm ε and RoPE parameters: finite and positive (a negative ε ran to NaN), scaling
/// factors that the frequency formula can use.
#[test]
fn norm_and_rope_parameters_are_finite_and_positive() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for (name, edit, needle) in [
        (
            "eps",
            json!({"rms_norm_eps": -1}),
            "rms_norm_eps: must be finite and > 0 in float32 (found -1)",
        ),
        (
            "eps0",
            json!({"rms_norm_eps": 0.0}),
            "rms_norm_eps: must be finite and > 0",
        ),
        (
            "eps_underflow",
            json!({"rms_norm_eps": 1e-50}),
            "rms_norm_eps: must be finite and > 0 in float32 (found 1e-50)",
        ),
        (
            "eps_overflow",
            json!({"rms_norm_eps": 1e300}),
            "rms_norm_eps: must be finite and > 0 in float32",
        ),
        (
            "theta",
            json!({"rope_parameters": {"rope_theta": 0.0, "rope_type": "default"}}),
            "rope_parameters.rope_theta: must be finite and > 0",
        ),
        (
            "theta4",
            json!({"rope_parameters": null, "rope_theta": -10000.0}),
            "rope_theta: must be finite and > 0",
        ),
        (
            "linear",
            json!({"rope_parameters": null, "rope_scaling": {"type": "linear", "factor": 0}}),
            "rope_scaling.factor: must be finite and > 0",
        ),
        (
            "linear_missing",
            json!({"rope_parameters": null, "rope_scaling": {"rope_type": "linear"}}),
            "rope_scaling.factor: missing (required by rope_type \"linear\")",
        ),
        (
            "llama3",
            json!({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                "original_max_position_embeddings": 64}}),
            "rope_parameters.high_freq_factor: must be greater than low_freq_factor 4 (found 1)",
        ),
        (
            "llama3_orig",
            json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 0}}),
            "rope_parameters.original_max_position_embeddings: must be > 0 (found 0)",
        ),
        (
            "dynamic",
            json!({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),
            "rope_parameters.rope_type: unsupported \"dynamic\"",
        ),
        (
            "act",
            json!({"hidden_act": "tanh"}),
            "hidden_act: unsupported activation \"tanh\"",
        ),
    ] {
        let p = llama_with(d, name, edit);
        fails_with(&["inspect", &p], &[&format!("{name}.json: "), needle]);
    }
    fails_with(
        &[
            "inspect",
            &with(d, "gpt2", "ln", json!({"layer_norm_epsilon": -1e-5})),
        ],
        &["layer_norm_epsilon: must be finite and > 0"],
    );
    // A valid llama3 scaling loads.
    let ok = llama_with(
        d,
        "llama3_ok",
        json!({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}}),
    );
    let (ok, out, err) = run_shardc(&["inspect", &ok], &[]);
    assert!(ok && out.contains("parameters"), "{err}");
}

/// Sizes past what ids, arithmetic or memory can hold: refused with the limit or the estimate
/// before anything is allocated (a 10¹²-layer config used to abort on a failed allocation).
#[test]
fn sizes_beyond_the_limits_are_refused_up_front() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let huge_layers = llama_with(
        d,
        "deep",
        json!({"num_hidden_layers": 1_000_000_000_000u64}),
    );
    for cmd in [
        &["inspect", &huge_layers][..],
        &["compile", &huge_layers, "-o", "/dev/null"],
        &["simulate", &huge_layers, "--train", "--seq", "16"],
    ] {
        fails_with(
            cmd,
            &[
                "deep.json: num_hidden_layers=1000000000000: the IR would need ~",
                "PiB, more than the ",
                "memory cap",
                "SHARDC_MAX_MEMORY",
            ],
        );
    }
    // The cap comes from SHARDC_MAX_MEMORY when set; the estimate grows with the layers.
    let deep = llama_with(d, "deep2", json!({"num_hidden_layers": 50_000}));
    fails_with_env(
        &["inspect", &deep],
        &[("SHARDC_MAX_MEMORY", "1G")],
        &[
            "deep2.json: num_hidden_layers=50000: the IR would need ~",
            "more than the 1.0 GiB memory cap (SHARDC_MAX_MEMORY)",
        ],
    );
    // Past the hard limit on layers even when memory would allow the IR.
    let deeper = llama_with(d, "deep3", json!({"num_hidden_layers": 200_000}));
    fails_with_env(
        &["inspect", &deeper],
        &[("SHARDC_MAX_MEMORY", "1T")],
        &["num_hidden_layers: at most 2048 layers are supported (found 200000)"],
    );
    fails_with_env(
        &["inspect", &deeper],
        &[("SHARDC_MAX_MEMORY", "lots")],
        &["SHARDC_MAX_MEMORY=`lots`: expected a positive size in bytes"],
    );
    fails_with(
        &[
            "inspect",
            &llama_with(d, "vocab", json!({"vocab_size": 4294967296u64})),
        ],
        &["vocab_size: must be at most 2147483648 (found 4294967296"],
    );
    fails_with(
        &[
            "inspect",
            &llama_with(
                d,
                "wide",
                json!({"hidden_size": 1_000_000_000, "intermediate_size": 1_000_000_000}),
            ),
        ],
        &[
            "hidden_size=1000000000, intermediate_size=1000000000",
            "parameters, more than the 1.13e15 shardc supports",
        ],
    );
}
