//! Whole-model gradient check for the architectures without training fixtures: Mistral
//! (sliding-window attention, GQA) and Qwen2 (q/k/v biases, tied head) with random weights.
//! For each parameter of the first layer and outside the layers, the gradient of one
//! `shardc train` step matches the loss's directional derivative (central differences of the
//! step's own loss, Richardson-extrapolated) along a random direction on that parameter.

use serde_json::json;
use shardc::compiler::autodiff::Recompute;
use shardc::compiler::plan::Plan;
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{compile_train, Precision, TrainOptions};
use shardc::runtime::train::{train_step, Batch, TrainState};
use shardc::runtime::{Tensor, Weights};
use std::time::Duration;
use train_support::{random_model, Lcg};

mod train_support;

fn loss_at(c: &Plan, state: &TrainState, batch: &Batch, w: &Weights) -> f64 {
    let mut s = state.clone();
    train_step(c, &mut s, batch, w, Duration::from_secs(30))
        .unwrap()
        .loss as f64
}

fn gradcheck(config: serde_json::Value, seq: usize, mesh: &str, extra: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, w) = random_model(tmp.path(), config, seq);
    let mut rng = Lcg(7);
    let ids: Vec<i32> = (0..2 * seq)
        .map(|_| ((rng.next() + 1.0) * 0.5 * (cfg.vocab - 1) as f32) as i32)
        .collect();
    let batch = Batch::causal_lm(ids, 2, seq);
    let mut o = TrainOptions::new(2, seq, Mesh::parse(mesh, 8).unwrap());
    o.extra_strategies = extra.iter().map(|s| s.to_string()).collect();
    o.recompute = Recompute::Selective;
    let compiled = compile_train(&cfg, &o).unwrap();
    let c = compiled.plan("", cfg.arch.name(), cfg.layers, Precision::f32());
    let state = TrainState::load(&c, &w).unwrap();
    let mut s = state.clone();
    let grads = train_step(&c, &mut s, &batch, &w, Duration::from_secs(30))
        .unwrap()
        .grads;
    let mut checked = 0;
    for p in &compiled.train.params {
        if p.label.starts_with("layers.") && !p.label.starts_with("layers.0.") {
            continue;
        }
        let g = grads[&p.label].as_f32().unwrap();
        let e: Vec<f32> = (0..g.len()).map(|_| rng.next()).collect();
        let at = |h: f32| {
            let mut st = state.clone();
            let x = st.params.get_mut(&p.label).unwrap();
            let v: Vec<f32> = x
                .as_f32()
                .unwrap()
                .iter()
                .zip(&e)
                .map(|(a, b)| a + h * b)
                .collect();
            *x = Tensor::f32(x.shape.clone(), v);
            loss_at(&c, &st, &batch, &w)
        };
        let h = 2e-2f32;
        let d = |h: f32| (at(h) - at(-h)) / (2.0 * h as f64);
        let fd = (4.0 * d(h / 2.0) - d(h)) / 3.0;
        let an: f64 = g.iter().zip(&e).map(|(&a, &b)| a as f64 * b as f64).sum();
        // Loss rounding (≈ 1e-6 relative) over the step h bounds the difference's noise.
        let tol = 2e-3 * an.abs().max(fd.abs()) + 2e-4;
        assert!(
            (an - fd).abs() <= tol,
            "{mesh} `{}`: ⟨grad, e⟩ = {an}, finite difference {fd}",
            p.label
        );
        checked += 1;
    }
    assert!(checked >= 8, "{checked} parameters checked");
}

fn mistral() -> serde_json::Value {
    json!({
        "model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": 5, "hidden_act": "silu", "tie_word_embeddings": false
    })
}

fn qwen2() -> serde_json::Value {
    json!({
        "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "hidden_act": "silu", "tie_word_embeddings": true
    })
}

#[test]
fn mistral_gradients_match_finite_differences() {
    gradcheck(mistral(), 12, "dp=1", &[]);
}

#[test]
fn qwen2_gradients_match_finite_differences() {
    gradcheck(qwen2(), 12, "dp=1", &[]);
}

#[test]
fn sharded_gradients_match_finite_differences() {
    gradcheck(mistral(), 12, "dp=2,tp=2", &["sp", "zero3"]);
    gradcheck(qwen2(), 12, "tp=2", &["sp"]);
}
