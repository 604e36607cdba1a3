//! Shared helpers of the training tests: the hf-tiny training references
//! (`train_b2_s16.{json,safetensors}`) and the checks their README prescribes.
#![allow(dead_code)]

use serde_json::Value;
use shardc::compiler::autodiff::Recompute;
use shardc::compiler::ir::{AdamWSpec, ValueRole};
use shardc::compiler::model::ModelConfig;
use shardc::compiler::plan::Plan;
use shardc::compiler::schedule::pp::ScheduleKind;
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{
    compile_pipeline, compile_train, CompiledPipeline, CompiledTrain, PipelineOptions, Precision,
    TrainOptions,
};
use shardc::runtime::pipeline::pipeline_step;
use shardc::runtime::train::{
    save_safetensors, stored_tensors, train_step, Batch, Fill, TrainState,
};
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
        if let Some(n) = ValueRole::gradient_label(&name) {
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

/// The plan the runtime executes for compiled step `c` of `cfg`.
pub fn plan_of(c: &CompiledTrain, cfg: &ModelConfig) -> Plan {
    c.plan("", cfg.arch.name(), cfg.layers, Precision::f32())
}

/// The plan the runtime executes for compiled pipeline `c` of `cfg`.
pub fn pipe_plan_of(c: &CompiledPipeline, cfg: &ModelConfig) -> Plan {
    c.plan("", cfg.arch.name(), cfg.layers, Precision::f32())
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
    run_with(model, mesh, extra, micro_batches, rc, dup, |_| {})
}

/// As [`run`], with the compile options adjusted by `adjust` (e.g. a rewrite selection).
pub fn run_with(
    model: &str,
    mesh: &str,
    extra: &[&str],
    micro_batches: usize,
    rc: Recompute,
    dup: usize,
    adjust: impl FnOnce(&mut TrainOptions),
) -> Run {
    let batch = fixture_batch(model, dup);
    let mesh = if mesh.is_empty() {
        Mesh::single()
    } else {
        Mesh::parse(mesh, 8).unwrap()
    };
    let mut o = TrainOptions::new(batch.batch, batch.seq, mesh);
    o.extra_strategies = extra.iter().map(|s| s.to_string()).collect();
    o.micro_batches = micro_batches;
    o.recompute = rc;
    adjust(&mut o);
    run_step(&dir(model), &o, &batch, &format!("{model} {extra:?}"))
}

/// What a step produced, in stored names and layouts.
pub trait Outcome {
    /// The loss.
    fn loss(&self) -> f32;
    /// Gradients.
    fn grads(&self) -> &BTreeMap<String, Tensor>;
    /// Updated weights.
    fn updated(&self) -> &BTreeMap<String, Tensor>;
}

/// [`Outcome`] for step results that keep it in fields `loss`, `grads` and `updated`.
macro_rules! outcome_fields {
    ($($t:ty),*) => {
        $(impl Outcome for $t {
            fn loss(&self) -> f32 {
                self.loss
            }
            fn grads(&self) -> &BTreeMap<String, Tensor> {
                &self.grads
            }
            fn updated(&self) -> &BTreeMap<String, Tensor> {
                &self.updated
            }
        })*
    };
}

outcome_fields!(Run, PipeRun);

/// One pipeline-parallel training step's results.
pub struct PipeRun {
    pub compiled: CompiledPipeline,
    pub peak_bytes: Vec<usize>,
    pub timelines: Vec<shardc::compiler::cost::Timeline>,
    pub loss: f32,
    pub grads: BTreeMap<String, Tensor>,
    pub updated: BTreeMap<String, Tensor>,
}

/// A pipeline configuration: mesh (with `pp`), extra strategies, micro-batches, schedule,
/// virtual stages, optional `--stage-layers`.
pub struct Pipe<'a> {
    pub mesh: &'a str,
    pub extra: &'a [&'a str],
    pub micro_batches: usize,
    pub schedule: ScheduleKind,
    pub virtual_stages: usize,
    pub stage_layers: Option<Vec<usize>>,
}

/// A pipeline of `m` micro-batches on `mesh` under `schedule` (interleaved: 2 chunks per rank),
/// the layers split as the compiler splits them.
pub fn pipe<'a>(mesh: &'a str, extra: &'a [&'a str], m: usize, schedule: ScheduleKind) -> Pipe<'a> {
    Pipe {
        mesh,
        extra,
        micro_batches: m,
        schedule,
        virtual_stages: if schedule == ScheduleKind::Interleaved {
            2
        } else {
            1
        },
        stage_layers: None,
    }
}

/// The compile options of `pipe` for `batch` sequences of `seq` tokens.
pub fn pipe_options(pipe: &Pipe, batch: usize, seq: usize) -> TrainOptions {
    let mut o = TrainOptions::new(batch, seq, Mesh::parse(pipe.mesh, 8).unwrap());
    o.extra_strategies = pipe.extra.iter().map(|s| s.to_string()).collect();
    o.micro_batches = pipe.micro_batches;
    o.pipeline = PipelineOptions {
        schedule: pipe.schedule,
        virtual_stages: pipe.virtual_stages,
        stage_layers: pipe.stage_layers.clone(),
    };
    o
}

/// One pipeline-parallel step of the model in `model_dir` on `batch`.
pub fn run_pipeline_on(model_dir: &std::path::Path, pipe: &Pipe, batch: &Batch) -> PipeRun {
    run_pipeline_opts(
        model_dir,
        &pipe_options(pipe, batch.batch, batch.seq),
        batch,
    )
}

/// One pipeline-parallel step compiled with options `o`.
pub fn run_pipeline_opts(model_dir: &std::path::Path, o: &TrainOptions, batch: &Batch) -> PipeRun {
    let cfg = ModelConfig::from_path(model_dir).unwrap();
    let c = compile_pipeline(&cfg, o).unwrap_or_else(|e| panic!("{}: {e}", o.mesh));
    let plan = pipe_plan_of(&c, &cfg);
    let w = Weights::open(model_dir).unwrap();
    let mut state = TrainState::load(&plan, &w).unwrap();
    let step = pipeline_step(&plan, &mut state, batch, Duration::from_secs(60), &w)
        .unwrap_or_else(|e| panic!("{}: {e}", o.mesh));
    let out = step.output;
    let (grads, updated) = stored_results(&plan, &out.grads, &state, &w);
    PipeRun {
        compiled: c,
        loss: out.loss,
        grads,
        updated,
        peak_bytes: step.peak_activation_bytes,
        timelines: step.timelines,
    }
}

/// The fixture batch of `model` with every sequence repeated `dup` times.
pub fn fixture_batch(model: &str, dup: usize) -> Batch {
    let r = reference(model);
    let ids: Vec<i32> = r
        .ids
        .chunks(r.seq)
        .flat_map(|row| std::iter::repeat_n(row, dup).flatten().copied())
        .collect();
    Batch::causal_lm(ids, r.batch * dup, r.seq)
}

/// One unsharded step of the model in `model_dir` on `batch`.
pub fn run_unsharded_on(model_dir: &std::path::Path, batch: &Batch) -> Run {
    let o = TrainOptions::new(batch.batch, batch.seq, Mesh::single());
    run_opts_on(model_dir, &o, batch)
}

/// One step (no pipeline) of the model in `model_dir` compiled with options `o`.
pub fn run_opts_on(model_dir: &std::path::Path, o: &TrainOptions, batch: &Batch) -> Run {
    run_step(model_dir, o, batch, &o.mesh.to_string())
}

/// One step (no pipeline) of the model in `model_dir` compiled with options `o`; failures
/// panic naming `what`.
fn run_step(model_dir: &std::path::Path, o: &TrainOptions, batch: &Batch, what: &str) -> Run {
    let cfg = ModelConfig::from_path(model_dir).unwrap();
    let c = compile_train(&cfg, o).unwrap_or_else(|e| panic!("{what}: {e}"));
    let plan = plan_of(&c, &cfg);
    let w = Weights::open(model_dir).unwrap();
    let mut state = TrainState::load(&plan, &w).unwrap();
    let out = train_step(&plan, &mut state, batch, &w, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let (grads, updated) = stored_results(&plan, &out.grads, &state, &w);
    Run {
        compiled: c,
        loss: out.loss,
        grads,
        updated,
    }
}

/// A step's gradients `grads` and the updated weights of `state` in stored names and layouts.
fn stored_results(
    plan: &Plan,
    grads: &BTreeMap<String, Tensor>,
    state: &TrainState,
    w: &Weights,
) -> (BTreeMap<String, Tensor>, BTreeMap<String, Tensor>) {
    let grads = stored_tensors(plan, grads, w, Fill::Zeros).unwrap();
    let updated = stored_tensors(plan, &state.params, w, Fill::Original).unwrap();
    (grads, updated)
}

/// Checks the compiler's static account of `r`'s activation peaks per stage (f32) against
/// what the run measured, byte for byte.
pub fn check_activation_peaks(what: &str, r: &PipeRun) {
    let predicted: Vec<usize> = r
        .compiled
        .activation_peaks(4.0)
        .into_iter()
        .map(|b| b as usize)
        .collect();
    assert_eq!(predicted, r.peak_bytes, "{what}: static account vs runtime");
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
pub fn check(model: &str, what: &str, run: &impl Outcome) {
    let r = reference(model);
    let w = Weights::open(dir(model)).unwrap();
    let (loss, grads) = (run.loss(), run.grads());
    assert!(
        (loss - r.loss).abs() < 1e-5,
        "{model} {what}: loss {} vs {}",
        loss,
        r.loss
    );
    assert_eq!(
        grads.keys().collect::<Vec<_>>(),
        r.grads.keys().collect::<Vec<_>>(),
        "{model} {what}: gradient names"
    );
    let mut worst = (0.0f32, String::new());
    for (name, want) in &r.grads {
        let d = max_diff(&grads[name], want);
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
    let what = format!("{model} {what}");
    check_updates(
        &what,
        run,
        &r.grads,
        &r.updated,
        &w,
        (r.lr, r.weight_decay, r.eps),
    );
}

/// The AdamW first step: every updated weight equals the formula on the run's own gradient
/// (1e-6, wider where the gradient is rounding away from zero), and the reference's update `ref_updated` where the reference gradient `ref_grads`
/// exceeds 1e-4 (1e-6). `hyper`: (lr, weight decay, eps).
fn check_updates(
    what: &str,
    run: &impl Outcome,
    ref_grads: &BTreeMap<String, Tensor>,
    ref_updated: &BTreeMap<String, Tensor>,
    w: &Weights,
    (lr, wd, eps): (f64, f64, f64),
) {
    for (name, g) in run.grads() {
        let w0 = w.get(name).unwrap();
        let got = run.updated()[name].as_f32().unwrap();
        let ref_g = ref_grads[name].as_f32().unwrap();
        let ref_u = ref_updated[name].as_f32().unwrap();
        for (i, (&gi, &wi)) in g
            .as_f32()
            .unwrap()
            .iter()
            .zip(w0.as_f32().unwrap())
            .enumerate()
        {
            let (gi, wi) = (gi as f64, wi as f64);
            let formula = wi * (1.0 - lr * wd) - lr * gi / (gi.abs() + eps);
            // The optimizer read the gradient as the program summed it (partial sums in f32,
            // in ring order); the run reports it summed in f64. Where the gradient is within
            // that rounding of zero, the first step (≈ lr·sign(g)) turns it into an update
            // difference: allow the update's sensitivity to a 1e-8 change of the gradient.
            let sensitivity = lr * eps / (gi.abs() + eps).powi(2);
            assert!(
                (got[i] as f64 - formula).abs() < 1e-6 + sensitivity * 1e-8,
                "{what}: `{name}`[{i}] updated {} vs AdamW formula {formula}",
                got[i]
            );
            if ref_g[i].abs() > 1e-4 {
                assert!(
                    (got[i] - ref_u[i]).abs() < 1e-6,
                    "{what}: `{name}`[{i}] updated {} vs reference {}",
                    got[i],
                    ref_u[i]
                );
            }
        }
    }
}

/// Max |Δ| between two runs' gradients.
pub fn grad_diff(a: &impl Outcome, b: &impl Outcome) -> f32 {
    a.grads()
        .iter()
        .map(|(k, v)| max_diff(v, &b.grads()[k]))
        .fold(0.0, f32::max)
}

/// A deeper llama with random weights: hf-tiny llama's config with `layers` decoder layers,
/// layer `ℓ` a perturbed copy of fixture layer `ℓ mod 3` (deterministic), written once per
/// process under the system temp dir. Returns its directory.
pub fn deep_llama(layers: usize) -> PathBuf {
    let out =
        std::env::temp_dir().join(format!("shardc-deep-llama-{layers}-{}", std::process::id()));
    if out.join("model.safetensors").exists() {
        return out;
    }
    let src = dir("llama");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = Value::from(layers);
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = out.with_extension(format!("tmp{n}"));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    let w = Weights::open(&src).unwrap();
    let mut tensors = BTreeMap::new();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut noise = move || {
        // xorshift64*: a fixed sequence in [-1, 1).
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let x = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11;
        (x as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    };
    for name in w.names() {
        let Some(rest) = name.strip_prefix("model.layers.") else {
            tensors.insert(name.clone(), w.get(&name).unwrap());
            continue;
        };
        let (l, tail) = rest.split_once('.').unwrap();
        if l != "0" {
            continue;
        }
        for layer in 0..layers {
            let from = format!("model.layers.{}.{tail}", layer % 3);
            let t = w.get(&from).unwrap();
            let data = t
                .as_f32()
                .unwrap()
                .iter()
                .map(|&x| x * (1.0 + 0.2 * noise()))
                .collect();
            tensors.insert(
                format!("model.layers.{layer}.{tail}"),
                Tensor::f32(t.shape.clone(), data),
            );
        }
    }
    shardc::runtime::train::save_safetensors(&tmp.join("model.safetensors"), &tensors).unwrap();
    // Another test thread may have won the race: either copy is the same.
    if std::fs::rename(&tmp, &out).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    out
}

/// A batch of `batch` sequences of `seq` tokens below `vocab` (deterministic).
pub fn token_batch(batch: usize, seq: usize, vocab: usize) -> Batch {
    let ids = (0..batch * seq)
        .map(|i| ((i * 7919 + 13) % vocab) as i32)
        .collect();
    Batch::causal_lm(ids, batch, seq)
}

/// Checks a pipeline run against the unsharded run of the same model and batch: loss and
/// gradients within 1e-5, updated weights within 1e-6 of the unsharded update where the
/// gradient exceeds 1e-4, and the first-step formula of `adamw` (the optimizer both ran) on
/// the run's own gradients everywhere.
pub fn check_against(
    what: &str,
    run: &impl Outcome,
    base: &impl Outcome,
    model_dir: &std::path::Path,
    adamw: &AdamWSpec,
) {
    let w = Weights::open(model_dir).unwrap();
    assert!(
        (run.loss() - base.loss()).abs() < 1e-5,
        "{what}: loss {} vs unsharded {}",
        run.loss(),
        base.loss()
    );
    assert_eq!(
        run.grads().keys().collect::<Vec<_>>(),
        base.grads().keys().collect::<Vec<_>>(),
        "{what}: gradient names"
    );
    let d = grad_diff(run, base);
    assert!(
        d < 1e-5,
        "{what}: gradients differ from the unsharded step by {d}"
    );
    let hyper = (
        adamw.lr.0 as f64,
        adamw.weight_decay.0 as f64,
        adamw.eps.0 as f64,
    );
    check_updates(what, run, base.grads(), base.updated(), &w, hyper);
}

/// A small deterministic generator of uniform values in [-1, 1).
pub struct Lcg(pub u64);
impl Lcg {
    pub fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Writes `config` and random weights for every parameter it needs into `dir`.
pub fn random_model(
    dir: &std::path::Path,
    config: serde_json::Value,
    seq: usize,
) -> (ModelConfig, Weights) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let cfg = ModelConfig::from_path(dir).unwrap();
    let c = compile_train(&cfg, &TrainOptions::new(2, seq, Mesh::single())).unwrap();
    let mut rng = Lcg(42);
    let mut tensors = BTreeMap::new();
    for p in &c.train.params {
        let n = p.ty.numel();
        let fan_in = *p.ty.shape().last().unwrap() as f32;
        let norm = p.label.contains("norm");
        let bias = p.label.ends_with(".bias");
        let data = (0..n)
            .map(|_| {
                let u = rng.next();
                if norm {
                    1.0 + 0.25 * u
                } else if bias {
                    0.2 * u
                } else if p.label == "embed" {
                    0.5 * u
                } else {
                    1.7 * u / fan_in.sqrt()
                }
            })
            .collect();
        assert!(p.source.view.is_none() && p.source.stack.is_none() && !p.source.transposed);
        tensors.insert(p.source.name.clone(), Tensor::f32(p.ty.shape(), data));
    }
    save_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
    (cfg, Weights::open(dir).unwrap())
}
