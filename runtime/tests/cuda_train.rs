//! The CUDA backend's training ops against the CPU reference (`shardc_runtime::eval_op`), in
//! f32 and bf16, on seeded random inputs at odd sizes with the arena poisoned, and whole
//! training steps of the hf-tiny fixtures (`CudaTrainer`) against the CPU trainer: unsharded,
//! and on meshes of virtual ranks (tp, dp, sp, zero1).
//!
//! Needs a GPU: `cargo test -p shardc-runtime --test cuda_train -- --include-ignored`.

mod cuda_common;

use cuda_common::*;
use shardc_compiler::compile::{compile, CompileSpec, Job};
use shardc_compiler::ir::{
    AdamWSpec, AttnSpec, AttnWrt, CombineWrt, Float, NormWrt, Op, RopeSpec, RopeStyle, TensorType,
    UnaryOp,
};
use shardc_compiler::model::ModelConfig;
use shardc_compiler::shard::Mesh;
use shardc_compiler::train::{Precision, TrainOptions};
use shardc_runtime::cuda::{CudaOptions, CudaTrainer, GpuDType};
use shardc_runtime::train::{train_step, Batch, StepOutput, TrainState};
use shardc_runtime::{eval_op, Tensor, Weights};
use std::time::Duration;

const DTYPES: [GpuDType; 2] = [GpuDType::F32, GpuDType::Bf16];

/// `(atol, rtol)` of the gradient kernels: f32 sums in another order than the CPU's f64;
/// bf16 rounds every operand and result.
fn tol(dt: GpuDType) -> (f32, f32) {
    match dt {
        GpuDType::F32 => (2e-5, 2e-4),
        GpuDType::Bf16 => (2e-2, 2e-2),
    }
}

fn check(op: &Op, ins: &[&Tensor], dt: GpuDType, what: &str) {
    let (atol, rtol) = tol(dt);
    check_tol(op, ins, dt, atol, rtol, what);
}

fn check_tol(op: &Op, ins: &[&Tensor], dt: GpuDType, atol: f32, rtol: f32, what: &str) {
    let dev = device();
    let (got, want) = gpu_and_cpu(&dev, op, ins, None, dt);
    assert_close(&format!("{what} {dt}"), &got, &want, atol, rtol);
}

/// The CPU reference's result of `op` on `ins`.
fn cpu(op: &Op, ins: &[&Tensor]) -> Tensor {
    let g = op_graph(op, ins, None);
    let ty = g.ty(g.output("y").expect("y")).clone();
    eval_op(op, ins, &ty).unwrap_or_else(|e| panic!("cpu {}: {e}", op.mnemonic()))
}

#[test]
#[ignore = "needs a GPU"]
fn elementwise_and_reduction_gradients() {
    let mut rng = Rng::new(31);
    for dt in DTYPES {
        for n in [3, 50, 783, 4097] {
            let x = rng.tensor(&[n], 3.0);
            let dy = rng.tensor(&[n], 1.0);
            for u in UnaryOp::ALL {
                check(
                    &Op::UnaryGrad(u),
                    &[&x, &dy],
                    dt,
                    &format!("unary_grad {} n={n}", u.name()),
                );
            }
        }
        for (rows, n) in [(1, 3), (5, 50), (37, 783), (129, 64)] {
            let dy = rng.tensor(&[rows, n], 1.0);
            let b = rng.tensor(&[n], 1.0);
            check(
                &Op::BiasGrad,
                &[&dy, &b],
                dt,
                &format!("bias_grad {rows}x{n}"),
            );
        }
        // Repeat along the heads of [B, T, H, D] (a GQA expansion) and along a last dim.
        let dy = rng.tensor(&[2, 5, 12, 40], 1.0);
        check(
            &Op::RepeatGrad { dim: 2, times: 3 },
            &[&dy],
            dt,
            "repeat_grad heads x3",
        );
        let dy = rng.tensor(&[7, 50], 1.0);
        check(
            &Op::RepeatGrad { dim: 1, times: 5 },
            &[&dy],
            dt,
            "repeat_grad last x5",
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn weight_gradients_contract_over_the_rows() {
    let mut rng = Rng::new(32);
    for dt in DTYPES {
        // (a, dy, b, transpose_b): a linear layer's [N, K] weight, a [K, N] one, experts.
        for (a, dy, b, t) in [
            (vec![2, 16, 64], vec![2, 16, 176], vec![176, 64], true),
            (vec![37, 50], vec![37, 3], vec![50, 3], false),
            (vec![3, 783], vec![3, 50], vec![50, 783], true),
            (vec![4, 2, 9, 40], vec![4, 2, 9, 24], vec![4, 24, 40], true),
            (vec![4, 2, 9, 40], vec![4, 2, 9, 24], vec![4, 40, 24], false),
        ] {
            let (a, dy, w) = (
                rng.tensor(&a, 1.0),
                rng.tensor(&dy, 1.0),
                rng.tensor(&b, 1.0),
            );
            let (atol, rtol) = tol(dt);
            // A sum of up to 783 products: the absolute error grows with the row count.
            check_tol(
                &Op::WeightGrad { transpose_b: t },
                &[&a, &dy, &w],
                dt,
                atol * 10.0,
                rtol,
                &format!("weight_grad {:?}·{:?} → {:?}", a.shape, dy.shape, w.shape),
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn norm_and_rope_gradients() {
    let mut rng = Rng::new(33);
    let eps = Float(1e-5);
    for dt in DTYPES {
        for h in [3, 50, 783, 4097] {
            let x = rng.tensor(&[5, h], 3.0);
            let w = rng.tensor(&[h], 1.5);
            let dy = rng.tensor(&[5, h], 1.0);
            for wrt in [NormWrt::X, NormWrt::Weight] {
                for op in [Op::RmsNormGrad { eps, wrt }, Op::LayerNormGrad { eps, wrt }] {
                    check(
                        &op,
                        &[&x, &w, &dy],
                        dt,
                        &format!("{} {wrt:?} h={h}", op.mnemonic()),
                    );
                }
            }
        }
        for style in [RopeStyle::Half, RopeStyle::Interleaved] {
            let spec = RopeSpec {
                theta: Float(10000.0),
                style,
                scaling: None,
            };
            let dy = rng.tensor(&[2, 7, 3, 40], 1.0);
            let pos = rng.ids(&[2, 7], 0, 4096);
            check(
                &Op::RopeGrad(spec),
                &[&dy, &pos],
                dt,
                &format!("rope_grad {style:?}"),
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn embedding_and_cross_entropy_gradients() {
    let mut rng = Rng::new(34);
    for dt in DTYPES {
        for (v, h, n) in [(7, 5, 6), (50, 783, 37), (4097, 64, 300)] {
            // Ids out of range (a vocabulary shard's foreign tokens) add nothing; repeats add up.
            let ids = rng.ids(&[n], -3, v as i32 + 3);
            let dy = rng.tensor(&[n, h], 1.0);
            let table = rng.tensor(&[v, h], 1.0);
            check(
                &Op::EmbeddingGrad,
                &[&ids, &dy, &table],
                dt,
                &format!("embedding_grad V={v}"),
            );
        }
        for (rows, vocab) in [(3, 50), (37, 783), (8, 4097)] {
            let logits = rng.tensor(&[rows, vocab], 4.0);
            // Position 0 ignored (PyTorch's -100): a zero row.
            let mut l = rng
                .ids(&[rows], 0, vocab as i32)
                .as_i32()
                .expect("ids")
                .to_vec();
            l[0] = -100;
            let labels = Tensor::i32(vec![rows], l);
            check(
                &Op::CrossEntropyGrad { denom: rows - 1 },
                &[&logits, &labels],
                dt,
                &format!("cross_entropy_grad {rows}x{vocab}"),
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn attention_probabilities_and_gradients() {
    let mut rng = Rng::new(35);
    // (B, T, S, Hq, Hkv, D, causal, window, mask)
    let cases = [
        (1, 37, 37, 2, 1, 64, true, None, false),
        (2, 45, 45, 4, 2, 40, false, None, true),
        (2, 29, 29, 2, 1, 64, true, Some(7), true),
        (1, 17, 41, 2, 1, 40, true, None, false),
        (1, 1, 50, 4, 1, 64, true, None, false),
        (1, 64, 64, 8, 8, 128, true, None, false),
    ];
    for dt in DTYPES {
        for (b, t, s, hq, hkv, d, causal, window, masked) in cases {
            let spec = AttnSpec {
                causal,
                window,
                scale: Float(1.0 / (d as f32).sqrt()),
                indexed: false,
            };
            let q = rng.tensor(&[b, t, hq, d], 1.0);
            let k = rng.tensor(&[b, s, hkv, d], 1.0);
            let v = rng.tensor(&[b, s, hkv, d], 1.0);
            let dy = rng.tensor(&[b, t, hq, d], 1.0);
            // A mask hiding every key of batch 0's last row of keys and a few others.
            let mask = Tensor::f32(
                vec![b, s],
                (0..b * s)
                    .map(|i| if i % 5 == 3 { 0.0 } else { 1.0 })
                    .collect(),
            );
            let what = format!("B{b} T{t} S{s} Hq{hq} Hkv{hkv} D{d} causal={causal} window={window:?} mask={masked}");
            let mut pin: Vec<&Tensor> = vec![&q, &k];
            if masked {
                pin.push(&mask);
            }
            check(
                &Op::AttentionProbs(spec),
                &pin,
                dt,
                &format!("attention_probs {what}"),
            );
            // The gradients from the CPU's probabilities (rounded for bf16 as every input is).
            let probs = cpu(&Op::AttentionProbs(spec), &pin);
            for wrt in [AttnWrt::Q, AttnWrt::K, AttnWrt::V] {
                check(
                    &Op::AttentionGrad { spec, wrt },
                    &[&q, &k, &v, &dy, &probs],
                    dt,
                    &format!("attention_grad {wrt:?} {what}"),
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn mixture_of_experts_gradients() {
    let mut rng = Rng::new(36);
    for dt in DTYPES {
        for (tokens, experts, top_k, normalize, hidden) in [
            (6, 4, 1, false, 37),
            (37, 8, 2, true, 64),
            (50, 8, 2, false, 40),
        ] {
            // A tie in token 0: the lower index wins, as in the forward router.
            let mut l = rng.vec(tokens * experts, 2.0);
            l[1] = l[0];
            let logits = Tensor::f32(vec![1, tokens, experts], l);
            let router = Op::Router { top_k, normalize };
            let gates = cpu(&router, &[&logits]);
            let dgates = rng.tensor(&[1, tokens, experts], 1.0);
            let what = format!("tokens {tokens} experts {experts} top {top_k} norm={normalize}");
            check(
                &Op::RouterGrad { top_k, normalize },
                &[&logits, &dgates],
                dt,
                &format!("router_grad {what}"),
            );
            let dxe = rng.tensor(&[experts, 1, tokens, hidden], 1.0);
            check(
                &Op::DispatchGrad,
                &[&dxe, &gates],
                dt,
                &format!("dispatch_grad {what}"),
            );
            let y = rng.tensor(&[experts, 1, tokens, hidden], 1.0);
            let dy = rng.tensor(&[1, tokens, hidden], 1.0);
            for wrt in [CombineWrt::Y, CombineWrt::Gates] {
                check(
                    &Op::CombineGrad { wrt },
                    &[&y, &gates, &dy],
                    dt,
                    &format!("combine_grad {wrt:?} {what}"),
                );
            }
        }
    }
}

/// `AttentionProbs` and its three gradients as one graph: with fusion they run as the
/// FlashAttention-2 backward group (no probabilities stored), without it on the materialised
/// kernels; both against the CPU reference, including Llama-3-8B's attention shape. Each graph
/// also with the forward attention of the same q, k, v (and mask) ahead of it, whose output and
/// lse rows the group then reads instead of running the forward again.
#[test]
#[ignore = "needs a GPU"]
fn attention_backward_group_matches_the_materialised_path() {
    let dev = device();
    let mut rng = Rng::new(38);
    // (B, T, S, Hq, Hkv, D, causal, window, mask)
    let cases = [
        (1, 37, 37, 2, 1, 64, true, None, false),
        (2, 45, 45, 4, 2, 40, false, None, true),
        (2, 29, 29, 2, 1, 64, true, Some(7), true),
        (1, 17, 41, 2, 1, 40, true, None, false),
        (1, 512, 512, 32, 8, 128, true, None, false),
    ];
    let with_forward = [false, true];
    for ((b, t, s, hq, hkv, d, causal, window, masked), forward) in
        cases.into_iter().flat_map(|c| with_forward.map(|f| (c, f)))
    {
        let spec = AttnSpec {
            causal,
            window,
            scale: Float(1.0 / (d as f32).sqrt()),
            indexed: false,
        };
        let mut g = shardc_compiler::ir::Graph::new();
        let ty = |shape: &[usize]| TensorType::plain(shardc_compiler::ir::DType::F32, shape);
        let q = g.input("q", ty(&[b, t, hq, d]));
        let k = g.input("k", ty(&[b, s, hkv, d]));
        let v = g.input("v", ty(&[b, s, hkv, d]));
        let dy = g.input("dy", ty(&[b, t, hq, d]));
        let mut pin = vec![q, k];
        if masked {
            pin.push(g.input("mask", ty(&[b, s])));
        }
        let mut outputs = vec!["dq", "dk", "dv"];
        let y = forward.then(|| {
            let mut ins = vec![q, k, v];
            ins.extend(&pin[2..]);
            let y = g.add(Op::Attention(spec), &ins, "y").expect("attention");
            g.set_output("y", y);
            outputs.push("y");
            y
        });
        let p = g
            .add(Op::AttentionProbs(spec), &pin, "probs")
            .expect("probs");
        for (wrt, name) in [(AttnWrt::Q, "dq"), (AttnWrt::K, "dk"), (AttnWrt::V, "dv")] {
            let x = g
                .add(Op::AttentionGrad { spec, wrt }, &[q, k, v, dy, p], name)
                .expect("grad");
            g.set_output(name, x);
        }
        let groups = shardc_runtime::cuda::flash_candidates(&g);
        assert_eq!(groups.len(), 1);
        assert_eq!(
            groups[0].0.forward, y,
            "the group reads the forward when there is one"
        );
        let mut inputs = std::collections::BTreeMap::from([
            ("q".to_string(), rng.tensor(&[b, t, hq, d], 1.0)),
            ("k".to_string(), rng.tensor(&[b, s, hkv, d], 1.0)),
            ("v".to_string(), rng.tensor(&[b, s, hkv, d], 1.0)),
            ("dy".to_string(), rng.tensor(&[b, t, hq, d], 1.0)),
        ]);
        if masked {
            let m = (0..b * s)
                .map(|i| if i % 5 == 3 { 0.0 } else { 1.0 })
                .collect();
            inputs.insert("mask".into(), Tensor::f32(vec![b, s], m));
        }
        for dt in DTYPES {
            let ins: std::collections::BTreeMap<String, Tensor> = inputs
                .iter()
                .map(|(n, x)| {
                    let x = if dt == GpuDType::Bf16 {
                        round_bf16(x)
                    } else {
                        x.clone()
                    };
                    (n.clone(), x)
                })
                .collect();
            let want = shardc_runtime::execute_with_params(
                &g,
                &shardc_runtime::ParamCache::default(),
                &ins,
                &shardc_runtime::RankCtx::new(),
            )
            .expect("cpu");
            // The flash group on the tensor-core backward (bf16, head_dim 64/128) and on the
            // scalar one, and the materialised kernels.
            for (fuse, tensor_core, path) in [
                (true, true, "flash group"),
                (true, false, "flash group, scalar"),
                (false, true, "materialised"),
            ] {
                let params = shardc_runtime::cuda::ParamInit::Random {
                    seed: 1,
                    scale: 1.0,
                };
                let o = CudaOptions {
                    tensor_core_attention: tensor_core,
                    ..opts(dt, fuse)
                };
                let got =
                    shardc_runtime::cuda::execute_cuda(&dev, &g, &params, &ins, o).expect("gpu");
                let (atol, rtol) = tol(dt);
                for &name in &outputs {
                    let what = format!(
                        "{name} B{b} T{t} S{s} Hq{hq} Hkv{hkv} D{d} causal={causal} window={window:?} \
                         mask={masked} forward={forward} {dt} {path}"
                    );
                    assert_close(&what, &got[name], &want[name], atol * 5.0, rtol);
                }
            }
        }
    }
}

/// f32 AdamW on the GPU is the CPU's bit for bit: the moments in f32 without fused
/// multiply-adds, the update in f64 from the same host constants.
#[test]
#[ignore = "needs a GPU"]
fn adamw_is_the_cpu_bit_for_bit_in_f32() {
    let mut rng = Rng::new(37);
    let n = 4097;
    let (m, g, w) = (
        rng.tensor(&[n], 1e-2),
        rng.tensor(&[n], 1.0),
        rng.tensor(&[n], 1.0),
    );
    let v = Tensor::f32(vec![n], rng.vec(n, 1e-3).iter().map(|x| x.abs()).collect());
    for (beta, squared) in [(0.9, false), (0.95, true)] {
        check_tol(
            &Op::AdamMoment {
                beta: Float(beta),
                squared,
            },
            &[&m, &g],
            GpuDType::F32,
            0.0,
            0.0,
            &format!("adam_moment beta {beta}"),
        );
    }
    let spec = AdamWSpec {
        lr: Float(3e-4),
        ..AdamWSpec::default()
    };
    for step in [1.0, 7.0, 1000.0] {
        let t = Tensor::f32(vec![], vec![step]);
        check_tol(
            &Op::AdamWUpdate(spec),
            &[&w, &m, &v, &t],
            GpuDType::F32,
            0.0,
            0.0,
            &format!("adamw_update step {step}"),
        );
    }
    // bf16 storage: within the rounding of the weights.
    let t = Tensor::f32(vec![], vec![3.0]);
    check_tol(
        &Op::AdamWUpdate(spec),
        &[&w, &m, &v, &t],
        GpuDType::Bf16,
        1e-2,
        1e-2,
        "adamw bf16",
    );
}

/// The fixture's token ids `[2, 16]` as a causal-LM batch.
fn fixture_batch(model: &str) -> Batch {
    let path = fixtures().join(model).join("reference_b2_s16.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("reference")).expect("json");
    let ids: Vec<i32> = json["input_ids"]
        .as_array()
        .expect("rows")
        .iter()
        .flat_map(|r| {
            r.as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_i64().expect("id") as i32)
        })
        .collect();
    Batch::causal_lm(ids, 2, 16)
}

/// The training plan of `model` for `mesh` with `extra` strategies (f32, one micro-batch).
fn train_plan(
    model: &str,
    cfg: &ModelConfig,
    mesh: &str,
    extra: &[&str],
) -> shardc_compiler::plan::Plan {
    let mesh = if mesh.is_empty() {
        Mesh::single()
    } else {
        Mesh::parse(mesh, 8).expect("mesh")
    };
    let mut o = TrainOptions::new(2, 16, mesh);
    o.extra_strategies = extra.iter().map(|s| s.to_string()).collect();
    o.denom = Some(2 * 15);
    let mut spec = CompileSpec::new(cfg.clone(), model.to_string(), Job::Train(Box::new(o)));
    spec.precision = Precision::f32();
    compile(&spec).unwrap_or_else(|e| panic!("{model}: {e}"))
}

/// Relative L2 distance between two gradient maps, over every tensor.
fn grads_rel_l2(got: &StepOutput, want: &StepOutput) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (name, w) in &want.grads {
        let g = got
            .grads
            .get(name)
            .unwrap_or_else(|| panic!("no gradient {name}"));
        assert_eq!(g.shape, w.shape, "{name}");
        for (a, b) in g
            .as_f32()
            .expect("f32")
            .iter()
            .zip(w.as_f32().expect("f32"))
        {
            assert!(a.is_finite(), "{name}: {a}");
            num += ((a - b) as f64).powi(2);
            den += (*b as f64).powi(2);
        }
    }
    (num / den.max(1e-30)).sqrt()
}

/// Three steps of every fixture on the GPU against the CPU trainer (f32): each step's loss
/// within 1e-5 relative, the gradients within 1e-4 relative L2, and the weights after the
/// last step within 1e-5.
#[test]
#[ignore = "needs a GPU"]
fn fixture_training_steps_reproduce_the_cpu_trainer() {
    let dev = device();
    let timeout = Duration::from_secs(60);
    for model in ["llama", "gpt2", "mixtral"] {
        let dir = fixtures().join(model);
        let cfg = ModelConfig::from_path(&dir).expect("config");
        let weights = Weights::open(&dir).expect("weights");
        let batch = fixture_batch(model);
        for (mesh, extra) in [
            ("", &[][..]),
            ("tp=2", &[][..]),
            ("tp=2", &["sp"][..]),
            ("dp=2", &["zero1"][..]),
            ("dp=2,tp=2", &[][..]),
        ] {
            let plan = train_plan(model, &cfg, mesh, extra);
            let mut cpu_state = TrainState::load(&plan, &weights).expect("state");
            // f32 with every fused group (the attention backward as FlashAttention-2), and on
            // the materialised kernels.
            for fuse in [true, false] {
                let dt = GpuDType::F32;
                let what = format!("{model} mesh `{mesh}` {extra:?} {dt} fuse={fuse}");
                let opts = CudaOptions {
                    dtype: dt,
                    fuse,
                    poison: true,
                    ..CudaOptions::default()
                };
                let mut trainer =
                    CudaTrainer::new(dev.clone(), &plan, &weights, opts).expect("trainer");
                let mut gpu_state = TrainState::load(&plan, &weights).expect("state");
                let mut want_state = cpu_state.clone();
                for step in 1..=3 {
                    let want = train_step(&plan, &mut want_state, &batch, &weights, timeout)
                        .unwrap_or_else(|e| panic!("{what} cpu step {step}: {e}"));
                    let got = trainer
                        .step(&mut gpu_state, &batch)
                        .unwrap_or_else(|e| panic!("{what} gpu step {step}: {e}"));
                    let rel = ((got.loss - want.loss) / want.loss).abs();
                    assert!(
                        rel <= 1e-5,
                        "{what} step {step}: loss {} vs {} (rel {rel:.2e})",
                        got.loss,
                        want.loss
                    );
                    let e = grads_rel_l2(&got, &want);
                    assert!(e <= 1e-4, "{what} step {step}: gradients rel L2 {e:.2e}");
                    assert_eq!(gpu_state.step, step);
                }
                for (name, w) in &want_state.params {
                    let g = &gpu_state.params[name];
                    let e = rel_l2(g.as_f32().expect("f32"), w.as_f32().expect("f32"));
                    assert!(
                        e <= 1e-5,
                        "{what}: weights of {name} after 3 steps rel L2 {e:.2e}"
                    );
                }
                cpu_state = TrainState::load(&plan, &weights).expect("state");
            }
        }
    }
}

/// Unsharded training steps with CUDA graphs (the first eager, the second captured, the rest
/// replayed) give the eager steps' losses, gradients and weights to the bit: the replays write
/// each step's state and batch into the captured buffers and read each step's AdamW constants.
#[test]
#[ignore = "needs a GPU"]
fn training_steps_replayed_as_cuda_graphs_equal_eager_steps() {
    let dev = device();
    for model in ["llama", "mixtral"] {
        let dir = fixtures().join(model);
        let cfg = ModelConfig::from_path(&dir).expect("config");
        let weights = Weights::open(&dir).expect("weights");
        let batch = fixture_batch(model);
        let plan = train_plan(model, &cfg, "", &[]);
        let run = |graphs: bool| {
            let opts = CudaOptions {
                graphs,
                ..CudaOptions::default()
            };
            let mut trainer =
                CudaTrainer::new(dev.clone(), &plan, &weights, opts).expect("trainer");
            let mut state = TrainState::load(&plan, &weights).expect("state");
            let steps: Vec<StepOutput> = (1..=5)
                .map(|step| {
                    trainer
                        .step(&mut state, &batch)
                        .unwrap_or_else(|e| panic!("{model} graphs={graphs} step {step}: {e}"))
                })
                .collect();
            (steps, state)
        };
        let (eager, eager_state) = run(false);
        let (graphs, graph_state) = run(true);
        for (step, (a, b)) in eager.iter().zip(&graphs).enumerate() {
            assert_eq!(
                a.loss.to_bits(),
                b.loss.to_bits(),
                "{model} step {}",
                step + 1
            );
            assert_eq!(grads_rel_l2(a, b), 0.0, "{model} step {}", step + 1);
        }
        for (name, w) in &eager_state.params {
            assert_eq!(
                &graph_state.params[name], w,
                "{model}: {name} after 5 steps"
            );
        }
    }
}

/// A pipeline plan, bf16, and CUDA graphs on a mesh are refused by name before anything runs.
#[test]
#[ignore = "needs a GPU"]
fn unsupported_training_plans_are_refused_by_name() {
    let dev = device();
    let dir = fixtures().join("llama");
    let cfg = ModelConfig::from_path(&dir).expect("config");
    let weights = Weights::open(&dir).expect("weights");
    let mut o = TrainOptions::new(2, 16, Mesh::parse("pp=2", 8).expect("mesh"));
    o.micro_batches = 2;
    let mut spec = CompileSpec::new(cfg.clone(), "llama", Job::Train(Box::new(o)));
    spec.precision = Precision::f32();
    let plan = compile(&spec).expect("pipeline plan");
    let err = CudaTrainer::new(dev.clone(), &plan, &weights, CudaOptions::default())
        .err()
        .expect("refused");
    assert!(err.to_string().contains("pipeline"), "{err}");
    let plan = train_plan("llama", &cfg, "", &[]);
    let bf16 = CudaOptions {
        dtype: GpuDType::Bf16,
        ..CudaOptions::default()
    };
    let err = CudaTrainer::new(dev.clone(), &plan, &weights, bf16)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("--dtype f32"), "{err}");
    let graphs = CudaOptions {
        graphs: true,
        ..CudaOptions::default()
    };
    let tp = train_plan("llama", &cfg, "tp=2", &[]);
    let err = CudaTrainer::new(dev.clone(), &tp, &weights, graphs)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("CUDA graphs"), "{err}");
}

/// A training step at Llama-3-8B's layer scale: one decoder layer of Llama-3-8B (hidden 4096,
/// 32/8 heads of 128, ffn 14336; the vocabulary cut to 8192 so the CPU reference stays quick),
/// random weights (±0.02, norms 1), batch 1 × 256 tokens, f32, on the GPU against the CPU
/// trainer: the loss within 1e-4 relative, the gradients within 1e-3 relative L2 (sums of
/// thousands of products in another order), the tensor-core-free f32 path throughout.
#[test]
#[ignore = "needs a GPU"]
fn llama3_8b_layer_training_step_matches_the_cpu() {
    let dev = device();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/llama-3-8b.json");
    let mut cfg = ModelConfig::from_path(&path).expect("llama-3-8b config");
    cfg.layers = 1;
    cfg.vocab = 8192;
    let (b, t) = (1, 256);
    let mut o = TrainOptions::new(b, t, Mesh::single());
    o.denom = Some(b * (t - 1));
    let mut spec = CompileSpec::new(cfg.clone(), "llama-3-8b", Job::Train(Box::new(o)));
    spec.precision = Precision::f32();
    let plan = compile(&spec).expect("training plan");
    let params = &plan.train.as_ref().expect("a training plan").params;
    let mut rng = Rng::new(39);
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = params
        .iter()
        .map(|p| {
            assert!(
                p.source.view.is_none() && p.source.stack.is_none() && !p.source.transposed,
                "{}: stored as it is used",
                p.source.name
            );
            let shape = p.ty.shape();
            let n: usize = shape.iter().product();
            let data = if shape.len() == 1 {
                (0..n).map(|_| 1.0 + rng.sym(0.1)).collect()
            } else {
                rng.vec(n, 0.02)
            };
            (p.source.name.clone(), shape, data)
        })
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let named: Vec<(&str, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .map(|(n, s, d)| (n.as_str(), s.clone(), d.clone()))
        .collect();
    let weights = checkpoint(dir.path(), &named);
    let ids: Vec<i32> = (0..b * t).map(|_| rng.below(cfg.vocab) as i32).collect();
    let batch = Batch::causal_lm(ids, b, t);
    let mut cpu_state = TrainState::load(&plan, &weights).expect("state");
    let want = train_step(
        &plan,
        &mut cpu_state,
        &batch,
        &weights,
        Duration::from_secs(600),
    )
    .expect("cpu step");
    let opts = CudaOptions {
        poison: true,
        ..CudaOptions::default()
    };
    let mut trainer = CudaTrainer::new(dev, &plan, &weights, opts).expect("trainer");
    let mut gpu_state = TrainState::load(&plan, &weights).expect("state");
    let got = trainer.step(&mut gpu_state, &batch).expect("gpu step");
    let rel = ((got.loss - want.loss) / want.loss).abs();
    assert!(
        rel <= 1e-4,
        "loss {} vs {} (rel {rel:.2e})",
        got.loss,
        want.loss
    );
    let e = grads_rel_l2(&got, &want);
    assert!(e <= 1e-3, "gradients rel L2 {e:.2e}");
}
