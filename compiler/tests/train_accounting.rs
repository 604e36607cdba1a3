//! The training plan's accounting against the textbook formulas:
//! - communication per rank per step: data parallelism `2Ψ(n−1)/n`, ZeRO-3 `3Ψ(n−1)/n`;
//! - static memory per rank (ZeRO paper, mixed-precision Adam, Llama-2-7B): `(2+2+12)Ψ`,
//!   `(2+2+12/N)Ψ`, `(2+(2+12)/N)Ψ`, `(2+2+12)Ψ/N` for stages 0–3;
//! - activations per layer (Korthikanti et al. 2022, Table 2, 16-bit, their GPT
//!   configurations): `sbh(34 + 5as/h)`, `sbh(10 + 24/t + 5as/(ht))`, `sbh/t·(34 + 5as/h)`,
//!   `34·sbh/t`.

use serde_json::json;
use shardc_compiler::autodiff::Recompute;
use shardc_compiler::model::ModelConfig;
use shardc_compiler::shard::Mesh;
use shardc_compiler::train::{compile_train, CompiledTrain, Precision, TrainOptions};
use std::path::PathBuf;

fn fixture(model: &str) -> ModelConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-tiny");
    ModelConfig::from_path(&root.join(model)).unwrap()
}

fn compile(
    cfg: &ModelConfig,
    batch: usize,
    seq: usize,
    mesh: &str,
    extra: &[&str],
    rc: Recompute,
) -> CompiledTrain {
    let mesh = if mesh.is_empty() {
        Mesh::single()
    } else {
        Mesh::parse(mesh, 8).unwrap()
    };
    let mut o = TrainOptions::new(batch, seq, mesh);
    o.extra_strategies = extra.iter().map(|s| s.to_string()).collect();
    o.recompute = rc;
    compile_train(cfg, &o).unwrap_or_else(|e| panic!("{extra:?}: {e}"))
}

fn psi(c: &CompiledTrain) -> u64 {
    c.train.params.iter().map(|p| p.ty.numel() as u64).sum()
}

#[test]
fn data_parallel_sends_two_psi_per_step() {
    for model in ["llama", "gpt2", "mixtral"] {
        let cfg = fixture(model);
        for n in [2u64, 4] {
            let c = compile(
                &cfg,
                n as usize,
                16,
                &format!("dp={n}"),
                &[],
                Recompute::None,
            );
            let p = psi(&c);
            let vol = shardc_compiler::train::comm_volume(&c.sharded);
            assert_eq!(
                vol.sent_elements,
                2 * p * (n - 1) / n,
                "{model} dp={n}: {vol:?}"
            );
            // All of it is gradient all-reduce, in DDP buckets.
            assert!(vol
                .collectives
                .iter()
                .all(|c| c.op == "all_reduce" && c.axis == "dp"));
            let bucketed: u64 = c.buckets.iter().map(|b| b.bytes).sum();
            assert_eq!(bucketed, 4 * p, "{model}: every gradient is in a bucket");
        }
    }
}

#[test]
fn zero3_sends_three_psi_per_step_and_zero12_two() {
    for model in ["llama", "gpt2", "mixtral"] {
        let cfg = fixture(model);
        for n in [2u64, 4] {
            let mesh = format!("dp={n}");
            let p = psi(&compile(&cfg, n as usize, 16, &mesh, &[], Recompute::None));
            for (zero, factor) in [("zero1", 2), ("zero2", 2), ("zero3", 3), ("fsdp", 3)] {
                let c = compile(&cfg, n as usize, 16, &mesh, &[zero], Recompute::None);
                let vol = shardc_compiler::train::comm_volume(&c.sharded);
                assert_eq!(
                    vol.sent_elements,
                    factor * p * (n - 1) / n,
                    "{model} {zero} dp={n}: {vol:?}"
                );
            }
            // ZeRO-3: parameters gathered twice (forward, backward), gradients scattered once.
            let c = compile(&cfg, n as usize, 16, &mesh, &["zero3"], Recompute::None);
            let vol = shardc_compiler::train::comm_volume(&c.sharded);
            let by = |op: &str| {
                vol.collectives
                    .iter()
                    .filter(|c| c.op == op)
                    .map(|c| c.elements)
                    .sum::<u64>()
            };
            assert_eq!(
                (by("all_gather"), by("reduce_scatter")),
                (2 * p, p),
                "{model} dp={n}"
            );
        }
    }
}

fn llama2_7b() -> ModelConfig {
    ModelConfig::from_json(&json!({
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": false
    }))
    .unwrap()
}

#[test]
fn zero_static_memory_matches_the_zero_paper_on_llama2_7b() {
    let cfg = llama2_7b();
    let n = 64u64;
    let mesh = format!("dp={n}");
    let mut psi_seen = None;
    for (stage, extra) in [
        (0, vec![]),
        (1, vec!["zero1"]),
        (2, vec!["zero2"]),
        (3, vec!["zero3"]),
    ] {
        let c = compile(&cfg, n as usize, 4, &mesh, &extra, Recompute::None);
        let psi = psi(&c);
        assert_eq!(psi, 6_738_415_616, "Llama-2-7B parameters");
        psi_seen = Some(psi);
        let m = shardc_compiler::train::memory_report(&c, Precision::mixed());
        let want = match stage {
            0 => 16 * psi,
            1 => 4 * psi + 12 * psi / n,
            2 => 2 * psi + 14 * psi / n,
            _ => 16 * psi / n,
        };
        assert_eq!(m.static_bytes, want, "stage {stage}: {m:?}");
    }
    assert!(psi_seen.is_some());
}

/// A GPT layer of Korthikanti et al.'s Table 3 (two layers are enough: per-layer counts).
fn gpt(h: usize, a: usize) -> ModelConfig {
    ModelConfig::from_json(&json!({
        "model_type": "gpt2",
        "n_embd": h,
        "n_head": a,
        "n_layer": 2,
        "n_positions": 2048,
        "n_inner": null,
        "vocab_size": 51200,
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "tie_word_embeddings": true
    }))
    .unwrap()
}

#[test]
fn activations_per_layer_match_korthikanti() {
    let (s, b, t) = (2048u64, 1u64, 8u64);
    // 22B (a = 64, h = 6144) and 175B (a = 96, h = 12288).
    for (h, a) in [(6144u64, 64u64), (12288, 96)] {
        let cfg = gpt(h as usize, a as usize);
        let sbh = s * b * h;
        let attn = 5 * a * s * s * b;
        let cases: [(&str, &[&str], Recompute, u64); 4] = [
            ("", &[], Recompute::None, 34 * sbh + attn),
            (
                "tp=8",
                &[],
                Recompute::None,
                10 * sbh + 24 * sbh / t + attn / t,
            ),
            ("tp=8", &["sp"], Recompute::None, (34 * sbh + attn) / t),
            ("tp=8", &["sp"], Recompute::Selective, 34 * sbh / t),
        ];
        for (mesh, extra, rc, want) in cases {
            let c = compile(&cfg, b as usize, s as usize, mesh, extra, rc);
            let m = shardc_compiler::train::memory_report(&c, Precision::mixed());
            assert_eq!(m.activations_per_layer.len(), 2, "{mesh} {extra:?} {rc}");
            for l in &m.activations_per_layer {
                assert_eq!(
                    l.bytes, want,
                    "h={h} {mesh} {extra:?} {rc}: layer {}",
                    l.layer
                );
            }
        }
    }
}
