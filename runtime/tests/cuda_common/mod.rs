//! Shared helpers of the GPU tests (`cuda_*.rs`): the device, seeded random tensors,
//! single-op graphs run on the GPU and on the CPU reference, fixtures and comparisons. The CPU
//! kernel tests (`kernels_cpu.rs`) draw their inputs from the same RNG.
#![allow(dead_code)]

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use shardc_compiler::compile::CompileOptions;
use shardc_compiler::ir::{DType, Graph, Op, TensorType, ValueId};
use shardc_compiler::model::ModelConfig;
use shardc_compiler::shard::Mesh;
use shardc_runtime::cuda::{
    execute_cuda, CudaDevice, CudaError, CudaOptions, CudaProgram, CudaRankCtx, GpuDType, ParamInit,
};
use shardc_runtime::{eval_op, Tensor, Weights};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// GPU 0. These tests are `#[ignore = "needs a GPU"]`; run them with `--include-ignored` on a
/// machine with one (a missing driver is a test failure there, by design).
pub fn device() -> Arc<CudaDevice> {
    // One device (context, module and GEMM caches) per test binary, shared by every check.
    static DEVICE: std::sync::OnceLock<Arc<CudaDevice>> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| {
            CudaDevice::open(0).unwrap_or_else(|e| panic!("this test needs a GPU: {e}"))
        })
        .clone()
}

/// xorshift64* with a fixed seed per test.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-scale, scale).
    pub fn sym(&mut self, scale: f32) -> f32 {
        (self.unit() * 2.0 - 1.0) * scale
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(scale)).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn tensor(&mut self, shape: &[usize], scale: f32) -> Tensor {
        let n = shape.iter().product();
        Tensor::f32(shape.to_vec(), self.vec(n, scale))
    }
    pub fn ids(&mut self, shape: &[usize], lo: i32, hi: i32) -> Tensor {
        let n = shape.iter().product();
        let span = (hi - lo) as usize;
        Tensor::i32(
            shape.to_vec(),
            (0..n).map(|_| lo + self.below(span) as i32).collect(),
        )
    }
}

/// The graph type of a host tensor (f32 data declares f32).
pub fn ty_of(t: &Tensor) -> TensorType {
    let dt = if t.as_i32().is_some() {
        DType::I32
    } else {
        DType::F32
    };
    TensorType::plain(dt, &t.shape)
}

/// `t` with its f32 values rounded to bf16 (what a bf16 run sees).
pub fn round_bf16(t: &Tensor) -> Tensor {
    match t.as_f32() {
        Some(v) => Tensor::f32(
            t.shape.clone(),
            v.iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect(),
        ),
        None => t.clone(),
    }
}

/// Options of a kernel test: poisoned arena, the given dtype and fusion.
pub fn opts(dtype: GpuDType, fuse: bool) -> CudaOptions {
    CudaOptions {
        dtype,
        fuse,
        poison: true,
        ..CudaOptions::default()
    }
}

/// A graph `y = op(x0, x1, ..)` over inputs named `x0`, `x1`, ... (`declared` for ops whose
/// type is declared, e.g. `Reshape`).
pub fn op_graph(op: &Op, ins: &[&Tensor], declared: Option<TensorType>) -> Graph {
    let mut g = Graph::new();
    let ids: Vec<ValueId> = ins
        .iter()
        .enumerate()
        .map(|(i, t)| g.input(&format!("x{i}"), ty_of(t)))
        .collect();
    let y = g
        .add_typed(op.clone(), &ids, declared, "y")
        .unwrap_or_else(|e| panic!("{}: {e}", op.mnemonic()));
    g.set_output("y", y);
    g
}

/// Runs `y = op(ins)` on the GPU (poisoned arena) and on the CPU reference. For bf16 the
/// float inputs are rounded to bf16 first for both.
pub fn gpu_and_cpu(
    dev: &Arc<CudaDevice>,
    op: &Op,
    ins: &[&Tensor],
    declared: Option<TensorType>,
    dtype: GpuDType,
) -> (Tensor, Tensor) {
    gpu_and_cpu_with(dev, op, ins, declared, opts(dtype, true))
}

/// [`gpu_and_cpu`] with explicit options (`opts.dtype` is the device dtype).
pub fn gpu_and_cpu_with(
    dev: &Arc<CudaDevice>,
    op: &Op,
    ins: &[&Tensor],
    declared: Option<TensorType>,
    opts: CudaOptions,
) -> (Tensor, Tensor) {
    let dtype = opts.dtype;
    let ins: Vec<Tensor> = ins
        .iter()
        .map(|t| {
            if dtype == GpuDType::Bf16 {
                round_bf16(t)
            } else {
                (*t).clone()
            }
        })
        .collect();
    let refs: Vec<&Tensor> = ins.iter().collect();
    let g = op_graph(op, &refs, declared);
    let out_ty = g.ty(g.output("y").expect("y")).clone();
    let want = eval_op(op, &refs, &out_ty).unwrap_or_else(|e| panic!("cpu {}: {e}", op.mnemonic()));
    let inputs: BTreeMap<String, Tensor> = ins
        .iter()
        .enumerate()
        .map(|(i, t)| (format!("x{i}"), t.clone()))
        .collect();
    let params = ParamInit::Random {
        seed: 1,
        scale: 1.0,
    };
    let mut got = execute_cuda(dev, &g, &params, &inputs, opts)
        .unwrap_or_else(|e| panic!("gpu {}: {e}", op.mnemonic()));
    (got.remove("y").expect("output y"), want)
}

/// Max |got − want| ≤ atol + rtol·|want| elementwise, no NaN anywhere (poison must not leak).
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, atol: f32, rtol: f32) {
    assert_eq!(got.shape, want.shape, "{what}: shape");
    match (got.as_i32(), want.as_i32()) {
        (Some(g), Some(w)) => {
            assert_eq!(g, w, "{what}");
            return;
        }
        (None, None) => {}
        _ => panic!("{what}: dtype differs"),
    }
    let (g, w) = (got.as_f32().expect("f32"), want.as_f32().expect("f32"));
    let mut worst = (0usize, 0f32);
    for (i, (a, b)) in g.iter().zip(w).enumerate() {
        assert!(!a.is_nan() || b.is_nan(), "{what}: NaN at {i} (want {b})");
        let excess = (a - b).abs() - (atol + rtol * b.abs());
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    assert!(
        worst.1 <= 0.0,
        "{what}: element {} is {} but want {} (atol {atol}, rtol {rtol})",
        worst.0,
        g[worst.0],
        w[worst.0]
    );
    // Elementwise bounds alone pass an output of zeros wherever the reference is within
    // `atol` of 0: the whole tensor must also be close in relative L2 — within what the
    // elementwise bounds allow on average, and never as far as half the reference (an all-zero
    // output is at 1).
    let rms = (w.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / w.len().max(1) as f64).sqrt();
    if rms > 0.0 {
        let bound = (8.0 * rtol as f64)
            .max(2.0 * atol as f64 / rms)
            .clamp(1e-3, 0.5);
        let e = rel_l2(g, w);
        assert!(
            e <= bound,
            "{what}: relative L2 error {e:.3e} over {bound:.1e}"
        );
    }
}

/// Relative L2 error ‖got − want‖ / ‖want‖.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        num += ((a - b) as f64).powi(2);
        den += (*b as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// Fraction of rows of `width` whose argmax agrees, over the rows where the reference's best
/// beats its runner-up by more than `margin`: a near tie is decided by rounding (bf16 keeps 8
/// bits), not by the kernel, and would make the check flaky.
pub fn top1_agreement(got: &[f32], want: &[f32], width: usize, margin: f32) -> f64 {
    let argmax = |r: &[f32]| {
        r.iter().enumerate().fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
    };
    let decisive = |r: &[f32]| {
        let (i, best) = argmax(r);
        let second = r
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, &x)| x)
            .fold(f32::NEG_INFINITY, f32::max);
        best - second > margin
    };
    let rows: Vec<(&[f32], &[f32])> = got
        .chunks(width)
        .zip(want.chunks(width))
        .filter(|(_, b)| decisive(b))
        .collect();
    let same = rows
        .iter()
        .filter(|(a, b)| argmax(a).0 == argmax(b).0)
        .count();
    same as f64 / rows.len().max(1) as f64
}

/// The repository's hf-tiny fixtures: `$SHARDC_FIXTURES`, else next to this crate's sources,
/// else `tests/fixtures/hf-tiny` under the working directory (prebuilt test binaries run from
/// the repository root of another machine, see benches/gpu/README.md).
pub fn fixtures() -> PathBuf {
    if let Some(p) = std::env::var_os("SHARDC_FIXTURES") {
        return PathBuf::from(p);
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-tiny");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures/hf-tiny")
    }
}

/// `g` prepared on `dev` and `ctx` with the parameters of checkpoint `w`.
pub fn prepare(
    dev: &Arc<CudaDevice>,
    g: &Graph,
    w: &Weights,
    ctx: &CudaRankCtx,
    opts: CudaOptions,
) -> Result<CudaProgram, CudaError> {
    CudaProgram::prepare(dev.clone(), g, &ParamInit::Weights(w), ctx, opts)
}

/// One fixture reference case: inputs and transformers' logits.
pub struct Case {
    pub model: String,
    pub name: String,
    pub batch: usize,
    pub seq: usize,
    pub inputs: BTreeMap<String, Tensor>,
    pub mask: Vec<f32>,
    pub logits: Vec<f32>,
}

fn flat(v: &serde_json::Value) -> Vec<f64> {
    match v {
        serde_json::Value::Array(a) => a.iter().flat_map(flat).collect(),
        x => vec![x.as_f64().expect("number")],
    }
}

/// Every `reference_*.json` of every fixture model.
pub fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for model in ["gpt2", "llama", "mixtral"] {
        let dir = fixtures().join(model);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .expect("fixture dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| {
                let n = p.file_name().unwrap_or_default().to_string_lossy();
                n.starts_with("reference_") && n.ends_with(".json")
            })
            .collect();
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f).expect("read reference");
            let json: serde_json::Value = serde_json::from_str(&text).expect("json");
            let shape: Vec<usize> = flat(&json["logits_shape"])
                .iter()
                .map(|&x| x as usize)
                .collect();
            let (b, t) = (shape[0], shape[1]);
            let ids: Vec<i32> = flat(&json["input_ids"]).iter().map(|&x| x as i32).collect();
            let mask: Vec<f32> = match json.get("attention_mask") {
                Some(m) => flat(m).iter().map(|&x| x as f32).collect(),
                None => vec![1.0; b * t],
            };
            let pos: Vec<i32> = match json.get("position_ids") {
                Some(p) => flat(p).iter().map(|&x| x as i32).collect(),
                None => (0..b).flat_map(|_| 0..t as i32).collect(),
            };
            let inputs = BTreeMap::from([
                ("input_ids".to_string(), Tensor::i32(vec![b, t], ids)),
                ("position_ids".to_string(), Tensor::i32(vec![b, t], pos)),
                (
                    "attention_mask".to_string(),
                    Tensor::f32(vec![b, t], mask.clone()),
                ),
            ]);
            out.push(Case {
                model: model.to_string(),
                name: f
                    .file_stem()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .to_string(),
                batch: b,
                seq: t,
                inputs,
                mask,
                logits: flat(&json["logits"]).iter().map(|&x| x as f32).collect(),
            });
        }
    }
    out
}

impl Case {
    /// Options compiling the case's batch and sequence for `mesh` with the `extra` strategy
    /// (none when empty).
    pub fn options(&self, mesh: &str, extra: &str) -> CompileOptions {
        CompileOptions {
            batch: self.batch,
            seq: self.seq,
            mesh: Mesh::parse(mesh, 8).expect("mesh"),
            extra_strategies: if extra.is_empty() {
                vec![]
            } else {
                vec![extra.to_string()]
            },
        }
    }

    /// The case's model: its config and weights.
    pub fn load(&self) -> (ModelConfig, Weights) {
        let dir = fixtures().join(&self.model);
        let cfg = ModelConfig::from_path(&dir).expect("config");
        (cfg, Weights::open(&dir).expect("weights"))
    }

    /// Max |Δ| over tokens whose mask is 1.
    pub fn max_diff(&self, got: &[f32], want: &[f32]) -> f32 {
        let width = want.len() / (self.batch * self.seq);
        let mut m = 0f32;
        for (tok, (g, w)) in got.chunks(width).zip(want.chunks(width)).enumerate() {
            if self.mask[tok] == 0.0 {
                continue;
            }
            for (a, b) in g.iter().zip(w) {
                assert!(!a.is_nan(), "{} {}: NaN logit", self.model, self.name);
                m = m.max((a - b).abs());
            }
        }
        m
    }

    /// The rows of `v` (width `width`) whose token is not masked out, concatenated.
    pub fn unmasked(&self, v: &[f32]) -> Vec<f32> {
        let width = v.len() / (self.batch * self.seq);
        v.chunks(width)
            .enumerate()
            .filter(|(tok, _)| self.mask[*tok] != 0.0)
            .flat_map(|(_, r)| r.iter().copied())
            .collect()
    }
}

/// Writes `tensors` (name, shape, f32 data) as a safetensors checkpoint in `dir` and opens it.
pub fn checkpoint(dir: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) -> Weights {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, d)| d.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            (
                n.to_string(),
                TensorView::new(Dtype::F32, s.clone(), b).expect("valid view"),
            )
        })
        .collect();
    let data = safetensors::serialize(views, None).expect("serialize");
    let path = dir.join("model.safetensors");
    std::fs::write(&path, data).expect("write checkpoint");
    Weights::open(dir).expect("open checkpoint")
}

/// A whole-tensor f32 parameter node.
pub fn param(g: &mut Graph, name: &str, shape: &[usize]) -> ValueId {
    g.param(name, TensorType::plain(DType::F32, shape))
}
