//! Model import: published parameter counts, transformers 4/5 config layouts, bad configs.

use shardc_compiler::ir::{verify, RopeScaling};
use shardc_compiler::model::{build_forward, BuildOptions, ModelConfig, ModelError, ModelStats};
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn params_of(path: PathBuf) -> u64 {
    let cfg = ModelConfig::from_path(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ModelStats::compute(&cfg, 128).expect("stats").params
}

#[test]
fn published_parameter_counts() {
    let cases = [
        ("gpt2.json", 124_439_808u64),
        ("llama-2-7b.json", 6_738_415_616),
        ("llama-3-8b.json", 8_030_261_248),
        ("mixtral-8x7b.json", 46_702_792_704),
        ("llama-3-70b.json", 70_553_706_496),
    ];
    for (file, want) in cases {
        assert_eq!(params_of(root().join("models").join(file)), want, "{file}");
    }
}

#[test]
fn fixture_parameter_counts() {
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/hf-tiny/index.json")).unwrap(),
    )
    .unwrap();
    for (name, m) in index["models"].as_object().unwrap() {
        let want = m["n_params_unique"].as_u64().unwrap();
        let got = params_of(root().join("tests/fixtures/hf-tiny").join(name));
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn forward_graphs_verify() {
    for name in ["gpt2", "llama", "mixtral"] {
        let cfg =
            ModelConfig::from_path(&root().join("tests/fixtures/hf-tiny").join(name)).unwrap();
        let g = build_forward(&cfg, BuildOptions::new(2, 5)).unwrap();
        verify(&g).unwrap();
        assert_eq!(g.ty(g.output("logits").unwrap()).shape(), vec![2, 5, 256]);
    }
}

fn llama_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    })
}

#[test]
fn transformers_4_and_5_rope_layouts_agree() {
    let v4 = llama_json();
    let mut v5 = llama_json();
    v5.as_object_mut().unwrap().remove("rope_theta");
    v5["rope_parameters"] = serde_json::json!({"rope_theta": 500000.0, "rope_type": "default"});
    v5["head_dim"] = serde_json::Value::Null;
    let a = ModelConfig::from_json(&v4).unwrap();
    let b = ModelConfig::from_json(&v5).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.head_dim, 8);
    assert_eq!(a.rope.unwrap().theta.0, 500000.0);
}

#[test]
fn llama31_rope_scaling() {
    let mut v = llama_json();
    v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let cfg = ModelConfig::from_json(&v).unwrap();
    let rope = cfg.rope.unwrap();
    assert!(matches!(
        rope.scaling,
        Some(RopeScaling::Llama3 {
            original_max_positions: 8192,
            ..
        })
    ));
    // Reference values from transformers' _compute_llama3_parameters (theta 500000, dim 8).
    let inv = rope.inv_freq(8);
    let plain = {
        let mut r = rope;
        r.scaling = None;
        r.inv_freq(8)
    };
    // Highest frequency untouched (wavelength < high_wavelen), lowest divided by the factor.
    assert_eq!(inv[0], plain[0]);
    assert!((inv[3] - plain[3] / 8.0).abs() < 1e-12);
}

#[test]
fn qwen2_biases_and_tied_head() {
    let mut v = llama_json();
    v["model_type"] = "qwen2".into();
    v["tie_word_embeddings"] = true.into();
    let cfg = ModelConfig::from_json(&v).unwrap();
    assert!(cfg.qkv_bias && !cfg.o_bias && cfg.tied);
    let s = ModelStats::compute(&cfg, 16).unwrap();
    // embed 128·64 + per layer (q 64·64+64, k 16·64+16, v 16·64+16, o 64·64, mlp 3·64·96,
    // norms 2·64) + final norm.
    let layer = (64 * 64 + 64) + 2 * (16 * 64 + 16) + 64 * 64 + 3 * 64 * 96 + 2 * 64;
    assert_eq!(s.params, (128 * 64 + 2 * layer + 64) as u64);
}

#[test]
fn mistral_sliding_window() {
    let mut v = llama_json();
    v["model_type"] = "mistral".into();
    v["sliding_window"] = 32.into();
    assert_eq!(ModelConfig::from_json(&v).unwrap().window, Some(32));
}

#[test]
fn bad_configs_are_clear_errors() {
    let mut v = llama_json();
    v["model_type"] = "bert".into();
    let e = ModelConfig::from_json(&v).unwrap_err();
    assert!(matches!(e, ModelError::UnknownModelType { .. }));
    assert!(e.to_string().contains("bert"), "{e}");

    let mut v = llama_json();
    v.as_object_mut().unwrap().remove("hidden_size");
    let e = ModelConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("hidden_size") && e.contains("missing"), "{e}");

    let mut v = llama_json();
    v["num_key_value_heads"] = 3.into();
    let e = ModelConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("num_key_value_heads"), "{e}");

    let mut v = llama_json();
    v["hidden_size"] = "wide".into();
    let e = ModelConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("hidden_size"), "{e}");

    let dir = std::env::temp_dir().join(format!("shardc-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    let e = ModelConfig::from_path(&dir).unwrap_err();
    assert!(matches!(e, ModelError::Json { .. }), "{e}");
    let e = ModelConfig::from_path(&dir.join("missing.json")).unwrap_err();
    assert!(matches!(e, ModelError::Io { .. }), "{e}");
}
