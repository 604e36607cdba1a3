//! Shared helpers of the training tests: the hf-tiny training references
//! (`train_b2_s16.{json,safetensors}`) and the checks their README prescribes.
#![allow(dead_code)]

use serde_json::Value;
use shardc::compiler::autodiff::Recompute;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{compile_train, CompiledTrain, TrainOptions};
use shardc::runtime::train::{stored_tensors, train_step, Batch, Fill, TrainState};
use shardc::runtime::{Tensor, Weights};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// The fixture directory of `model`.
pub fn dir(model: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf-tiny")
        .join(model)
}

/// One model's training reference, by stored tensor name.
pub struct Reference {
    pub loss: f32,
    pub batch: usize,
    pub seq: usize,
    pub ids: Vec<i32>,
    pub grads: BTreeMap<String, Tensor>,
    pub updated: BTreeMap<String, Tensor>,
    pub lr: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

fn json(path: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Rows `[lo, lo + n)` of a 2-D tensor.
fn rows(t: &Tensor, lo: usize, n: usize) -> Tensor {
    let c = t.shape[1];
    let d = t.as_f32().unwrap()[lo * c..(lo + n) * c].to_vec();
    Tensor::f32(vec![n, c], d)
}

/// transformers 5 keeps Mixtral's experts fused in memory (`mlp.experts.gate_up_proj`
/// `[E, 2F, H]` = w1 then w3 per expert, `mlp.experts.down_proj` `[E, H, F]` = w2,
/// `mlp.gate.weight` = the router); the checkpoint stores them per expert.
fn to_stored(name: &str, t: Tensor, out: &mut BTreeMap<String, Tensor>) {
    let Some((layer, rest)) = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
    else {
        out.insert(name.to_string(), t);
        return;
    };
    let moe = format!("model.layers.{layer}.block_sparse_moe");
    match rest {
        "mlp.gate.weight" => {
            out.insert(format!("{moe}.gate.weight"), t);
        }
        "mlp.experts.gate_up_proj" => {
            let (e, f2) = (t.shape[0], t.shape[1]);
            for i in 0..e {
                let one = Tensor::f32(t.shape[1..].to_vec(), rows_of(&t, i));
                out.insert(
                    format!("{moe}.experts.{i}.w1.weight"),
                    rows(&one, 0, f2 / 2),
                );
                out.insert(
                    format!("{moe}.experts.{i}.w3.weight"),
                    rows(&one, f2 / 2, f2 / 2),
                );
            }
        }
        "mlp.experts.down_proj" => {
            for i in 0..t.shape[0] {
                out.insert(
                    format!("{moe}.experts.{i}.w2.weight"),
                    Tensor::f32(t.shape[1..].to_vec(), rows_of(&t, i)),
                );
            }
        }
        _ => {
            out.insert(name.to_string(), t);
        }
    }
}

fn rows_of(t: &Tensor, i: usize) -> Vec<f32> {
    let per: usize = t.shape[1..].iter().product();
    t.as_f32().unwrap()[i * per..(i + 1) * per].to_vec()
}

/// Loads `model`'s training reference.
pub fn reference(model: &str) -> Reference {
    let d = dir(model);
    let j = json(d.join("train_b2_s16.json"));
    let r = json(d.join("reference_b2_s16.json"));
    let ids: Vec<i32> = r["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap() as i32)
        })
        .collect();
    let w = Weights::open(d.join("train_b2_s16.safetensors")).unwrap();
    let (mut grads, mut updated) = (BTreeMap::new(), BTreeMap::new());
    for name in w.names() {
        let t = w.get(&name).unwrap();
        if let Some(n) = name.strip_prefix("grad.") {
            to_stored(n, t, &mut grads);
        } else if let Some(n) = name.strip_prefix("updated.") {
            to_stored(n, t, &mut updated);
        }
    }
    let opt = &j["optimizer"];
    Reference {
        loss: j["loss"].as_f64().unwrap() as f32,
        batch: 2,
        seq: 16,
        ids,
        grads,
        updated,
        lr: opt["lr"].as_f64().unwrap(),
        weight_decay: opt["weight_decay"].as_f64().unwrap(),
        eps: opt["eps"].as_f64().unwrap(),
    }
}

/// One training step's results in stored names and layouts.
pub struct Run {
    pub compiled: CompiledTrain,
    pub loss: f32,
    pub grads: BTreeMap<String, Tensor>,
    pub updated: BTreeMap<String, Tensor>,
}

/// One step of `model` on `mesh` (`""`: unsharded) with `extra` strategies, on the fixture
/// tokens repeated `dup` times per row (a batch of `2·dup` with the same loss and gradients).
pub fn run(
    model: &str,
    mesh: &str,
    extra: &[&str],
    micro_batches: usize,
    rc: Recompute,
    dup: usize,
) -> Run {
    let r = reference(model);
    let cfg = ModelConfig::from_path(&dir(model)).unwrap();
    let ids: Vec<i32> = r
        .ids
        .chunks(r.seq)
        .flat_map(|row| std::iter::repeat_n(row, dup).flatten().copied())
        .collect();
    let b = r.batch * dup;
    let batch = Batch::causal_lm(ids, b, r.seq);
    let mesh = if mesh.is_empty() {
        Mesh::single()
    } else {
        Mesh::parse(mesh, 8).unwrap()
    };
    let mut o = TrainOptions::new(b, r.seq, mesh);
    o.extra_strategies = extra.iter().map(|s| s.to_string()).collect();
    o.micro_batches = micro_batches;
    o.recompute = rc;
    let c = compile_train(&cfg, &o).unwrap_or_else(|e| panic!("{model} {extra:?}: {e}"));
    let w = Weights::open(dir(model)).unwrap();
    let mut state = TrainState::load(&c, &w).unwrap();
    let out = train_step(&c, &mut state, &batch, &w, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{model}: {e}"));
    let grads = stored_tensors(&c, &out.grads, &w, Fill::Zeros).unwrap();
    let updated = stored_tensors(&c, &state.params, &w, Fill::Original).unwrap();
    Run {
        compiled: c,
        loss: out.loss,
        grads,
        updated,
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.shape, b.shape);
    a.as_f32()
        .unwrap()
        .iter()
        .zip(b.as_f32().unwrap())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The README's checks: loss within 1e-5, every gradient within 1e-5, the updated weights
/// equal to AdamW's first step on our own gradients within 1e-6 everywhere, and to the
/// reference within 1e-6 where the reference gradient exceeds 1e-4.
pub fn check(model: &str, what: &str, run: &Run) {
    let r = reference(model);
    let w = Weights::open(dir(model)).unwrap();
    assert!(
        (run.loss - r.loss).abs() < 1e-5,
        "{model} {what}: loss {} vs {}",
        run.loss,
        r.loss
    );
    assert_eq!(
        run.grads.keys().collect::<Vec<_>>(),
        r.grads.keys().collect::<Vec<_>>(),
        "{model} {what}: gradient names"
    );
    let mut worst = (0.0f32, String::new());
    for (name, want) in &r.grads {
        let d = max_diff(&run.grads[name], want);
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    assert!(
        worst.0 < 1e-5,
        "{model} {what}: gradient `{}` off by {}",
        worst.1,
        worst.0
    );
    for (name, g) in &run.grads {
        let w0 = w.get(name).unwrap();
        let got = run.updated[name].as_f32().unwrap();
        let ref_g = r.grads[name].as_f32().unwrap();
        let ref_u = r.updated[name].as_f32().unwrap();
        for (i, (&gi, &wi)) in g
            .as_f32()
            .unwrap()
            .iter()
            .zip(w0.as_f32().unwrap())
            .enumerate()
        {
            let (gi, wi) = (gi as f64, wi as f64);
            let formula = wi * (1.0 - r.lr * r.weight_decay) - r.lr * gi / (gi.abs() + r.eps);
            assert!(
                (got[i] as f64 - formula).abs() < 1e-6,
                "{model} {what}: `{name}`[{i}] updated {} vs AdamW formula {formula}",
                got[i]
            );
            if ref_g[i].abs() > 1e-4 {
                assert!(
                    (got[i] - ref_u[i]).abs() < 1e-6,
                    "{model} {what}: `{name}`[{i}] updated {} vs reference {}",
                    got[i],
                    ref_u[i]
                );
            }
        }
    }
}

/// Max |Δ| between two runs' gradients.
pub fn grad_diff(a: &Run, b: &Run) -> f32 {
    a.grads
        .iter()
        .map(|(k, v)| max_diff(v, &b.grads[k]))
        .fold(0.0, f32::max)
}
