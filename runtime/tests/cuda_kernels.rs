//! Every CUDA kernel against the CPU reference (`shardc_runtime::eval_op`), in f32 and bf16,
//! on seeded random inputs at odd sizes (3, 50, 783, 4097), each run with the activation
//! arena poisoned with NaN first (a kernel that leaves part of its output unwritten fails).
//!
//! Needs a GPU: `cargo test -p shardc-runtime --test cuda_kernels -- --include-ignored`.

mod cuda_common;

use cuda_common::*;
use shardc_compiler::ir::{
    AttnSpec, DType, EwExpr, EwStep, Float, Graph, Op, RopeScaling, RopeSpec, RopeStyle,
    TensorType, UnaryOp,
};
use shardc_runtime::cuda::{execute_cuda, CudaOptions, CudaRankCtx, GpuDType, ParamInit};
use shardc_runtime::{execute, RankCtx, Tensor};
use std::collections::BTreeMap;

const SIZES: [usize; 4] = [3, 50, 783, 4097];
const DTYPES: [GpuDType; 2] = [GpuDType::F32, GpuDType::Bf16];

/// `(atol, rtol)` for plain elementwise / row kernels.
fn tol(dt: GpuDType) -> (f32, f32) {
    match dt {
        GpuDType::F32 => (1e-5, 1e-5),
        GpuDType::Bf16 => (1e-2, 1.0 / 64.0),
    }
}

fn check(op: &Op, ins: &[&Tensor], dt: GpuDType, atol: f32, rtol: f32, what: &str) {
    let dev = device();
    let (got, want) = gpu_and_cpu(&dev, op, ins, None, dt);
    assert_close(&format!("{what} {dt}"), &got, &want, atol, rtol);
}

/// The driver reports each kernel's parameter sizes (`cuFuncGetParamInfo`, CUDA 12.4+), which
/// every launch is checked against: pointers and i64 are 8 bytes, ints and floats 4.
#[test]
#[ignore = "needs a GPU"]
fn kernel_parameter_sizes_are_known_to_the_launch_check() {
    let dev = device();
    for (entry, want) in [
        ("cast_f32_bf16", &[8, 8, 8][..]),
        ("adamw_update_f32", &[8, 8, 8, 8, 8, 8]),
        ("routed_gemm_bf16", &[8, 8, 8, 8, 8, 8, 4, 4, 4, 4]),
        (
            "attention_tc_lse_bf16",
            &[8, 8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 8],
        ),
    ] {
        let k = dev.kernel(entry).unwrap_or_else(|e| panic!("{entry}: {e}"));
        assert_eq!(k.params.as_deref(), Some(want), "{entry}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn unary_scale_and_binary() {
    let mut rng = Rng::new(1);
    for dt in DTYPES {
        let (a, r) = tol(dt);
        for n in SIZES {
            let x = rng.tensor(&[n], 4.0);
            for u in UnaryOp::ALL {
                let (a, r) = if u == UnaryOp::Exp {
                    (a, r.max(2e-5))
                } else {
                    (a, r)
                };
                check(
                    &Op::Unary(u),
                    &[&x],
                    dt,
                    a,
                    r,
                    &format!("{} n={n}", u.name()),
                );
            }
            check(
                &Op::Scale(Float(0.37)),
                &[&x],
                dt,
                a,
                r,
                &format!("scale n={n}"),
            );
            let y = rng.tensor(&[n], 2.0);
            check(&Op::Add, &[&x, &y], dt, a, r, &format!("add n={n}"));
            check(&Op::Mul, &[&x, &y], dt, a, r, &format!("mul n={n}"));
            // suffix broadcast of a bias
            let m = rng.tensor(&[7, n], 2.0);
            check(&Op::Add, &[&m, &y], dt, a, r, &format!("add bias n={n}"));
            check(&Op::Mul, &[&m, &y], dt, a, r, &format!("mul bias n={n}"));
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn norms_and_softmax() {
    let mut rng = Rng::new(2);
    for dt in DTYPES {
        let (a, r) = tol(dt);
        for h in SIZES {
            let x = rng.tensor(&[3, h], 3.0);
            let w = rng.tensor(&[h], 1.5);
            let b = rng.tensor(&[h], 0.5);
            let eps = Float(1e-5);
            check(
                &Op::RmsNorm { eps },
                &[&x, &w],
                dt,
                a,
                r,
                &format!("rmsnorm h={h}"),
            );
            check(
                &Op::LayerNorm { eps },
                &[&x, &w, &b],
                dt,
                a,
                r.max(2e-5),
                &format!("layernorm h={h}"),
            );
            check(&Op::Softmax, &[&x], dt, a, r, &format!("softmax cols={h}"));
            let y = rng.tensor(&[3, h], 3.0);
            check(
                &Op::AddRmsNorm { eps },
                &[&x, &y, &w],
                dt,
                a,
                r,
                &format!("add_rms_norm h={h}"),
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn rope_both_styles_with_scaling() {
    let mut rng = Rng::new(3);
    let scalings = [
        None,
        Some(RopeScaling::Llama3 {
            factor: Float(8.0),
            low_freq_factor: Float(1.0),
            high_freq_factor: Float(4.0),
            original_max_positions: 8192,
        }),
        Some(RopeScaling::Linear { factor: Float(2.0) }),
    ];
    for dt in DTYPES {
        let (a, r) = tol(dt);
        for (d, t) in [(8, 3), (64, 50), (80, 7), (128, 33)] {
            let x = rng.tensor(&[2, t, 3, d], 2.0);
            let pos = rng.ids(&[2, t], 0, 4097);
            for style in [RopeStyle::Half, RopeStyle::Interleaved] {
                for scaling in scalings {
                    let spec = RopeSpec {
                        theta: Float(500_000.0),
                        style,
                        scaling,
                    };
                    // Large positions: sin/cos of f32 angles agree to ~1e-4 absolute.
                    let at = if dt == GpuDType::F32 { 2e-4 } else { a };
                    check(
                        &Op::Rope(spec),
                        &[&x, &pos],
                        dt,
                        at,
                        r,
                        &format!("rope {style:?} d={d}"),
                    );
                }
            }
        }
    }
}

/// An attention case: (batch, t, s, heads_q, heads_kv, head_dim, causal, window, masked).
type AttnCase = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    bool,
    Option<usize>,
    bool,
);

#[test]
#[ignore = "needs a GPU"]
fn attention_causal_window_mask_gqa_decode() {
    let mut rng = Rng::new(4);
    let cases: &[AttnCase] = &[
        (1, 3, 3, 2, 2, 64, true, None, false),
        (2, 50, 50, 8, 2, 80, true, None, true),
        (1, 37, 37, 4, 1, 128, true, Some(8), false),
        (2, 17, 17, 4, 4, 256, false, None, true),
        (1, 1, 50, 8, 2, 128, true, None, false), // decode: q_offset = 49
        (1, 5, 783, 4, 2, 64, true, Some(100), true),
        (2, 9, 9, 3, 1, 3, false, None, false), // odd head_dim
    ];
    for dt in DTYPES {
        for &(b, t, s, hq, hkv, d, causal, window, masked) in cases {
            let q = rng.tensor(&[b, t, hq, d], 1.0);
            let k = rng.tensor(&[b, s, hkv, d], 1.0);
            let v = rng.tensor(&[b, s, hkv, d], 1.0);
            let spec = AttnSpec {
                causal,
                window,
                scale: Float(1.0 / (d as f32).sqrt()),
                indexed: false,
            };
            let what = format!("attention b{b} t{t} s{s} h{hq}/{hkv} d{d} causal={causal} window={window:?} mask={masked}");
            let (a, r) = match dt {
                GpuDType::F32 => (3e-5, 1e-4),
                GpuDType::Bf16 => (2e-2, 1.0 / 32.0),
            };
            if masked {
                // Drop a few keys, including every key of batch 0 up to position 2.
                let mut m = vec![1.0f32; b * s];
                for (i, x) in m.iter_mut().enumerate() {
                    if i % s < 3 || rng.below(5) == 0 {
                        *x = 0.0;
                    }
                }
                let mask = Tensor::f32(vec![b, s], m);
                check(&Op::Attention(spec), &[&q, &k, &v, &mask], dt, a, r, &what);
            } else {
                check(&Op::Attention(spec), &[&q, &k, &v], dt, a, r, &what);
            }
        }
    }
}

/// The tensor-core kernel (`attention_tc_bf16`: bf16, head_dim 64 and 128) against the scalar
/// `attention_bf16` and the CPU reference, at Llama-like shapes: prefill, decode, chunked
/// prefill with a window, and a masked non-causal case.
#[test]
#[ignore = "needs a GPU"]
fn tensor_core_attention_matches_scalar_and_cpu() {
    let dev = device();
    assert!(
        dev.compute_capability().0 >= 8,
        "attention_tc_bf16 needs sm_80 or newer, this is {:?}",
        dev.compute_capability()
    );
    let mut rng = Rng::new(41);
    // q_offset = s - t.
    let cases: &[AttnCase] = &[
        (1, 512, 512, 32, 8, 128, true, None, false), // Llama-3-8B prefill
        (1, 1, 1000, 32, 8, 128, true, None, false),  // decode, q_offset 999
        (1, 300, 700, 16, 4, 128, true, Some(256), false), // chunk, q_offset 400
        (2, 200, 200, 8, 8, 64, false, None, true),
        (1, 77, 77, 4, 2, 64, true, None, true),
    ];
    let tc = |tensor_core_attention| CudaOptions {
        tensor_core_attention,
        ..opts(GpuDType::Bf16, true)
    };
    let (a, r) = (2e-2, 1.0 / 32.0);
    for &(b, t, s, hq, hkv, d, causal, window, masked) in cases {
        let q = rng.tensor(&[b, t, hq, d], 1.0);
        let k = rng.tensor(&[b, s, hkv, d], 1.0);
        let v = rng.tensor(&[b, s, hkv, d], 1.0);
        let mut m = vec![1.0f32; b * s];
        for (i, x) in m.iter_mut().enumerate() {
            if i % s < 3 || rng.below(4) == 0 {
                *x = 0.0;
            }
        }
        let mask = Tensor::f32(vec![b, s], m);
        let ins = attention_inputs([&q, &k, &v], masked.then_some(&mask));
        let op = attention_op(causal, window, d);
        let what = format!(
            "b{b} t{t} s{s} h{hq}/{hkv} d{d} causal={causal} window={window:?} mask={masked}"
        );
        let (got, want) = gpu_and_cpu_with(&dev, &op, &ins, None, tc(true));
        let (scalar, _) = gpu_and_cpu_with(&dev, &op, &ins, None, tc(false));
        assert_close(&format!("tensor-core attention {what}"), &got, &want, a, r);
        assert_close(&format!("scalar attention {what}"), &scalar, &want, a, r);
        assert_close(
            &format!("tensor-core vs scalar {what}"),
            &got,
            &scalar,
            a,
            r,
        );
        let f32s = |x: &Tensor| {
            x.as_f32()
                .expect("invariant: attention outputs f32")
                .to_vec()
        };
        let (g, sc, w) = (f32s(&got), f32s(&scalar), f32s(&want));
        // Different kernels: their f32 sums differ somewhere (the same bits everywhere would
        // mean the tensor-core kernel was not chosen).
        assert!(g != sc, "{what}: the two runs are bit-identical");
        assert_rel_l2_nonzero(&what, &g, &w);
    }
}

/// q, k, v and the mask when there is one: an attention op's inputs.
fn attention_inputs<'a>(qkv: [&'a Tensor; 3], mask: Option<&'a Tensor>) -> Vec<&'a Tensor> {
    qkv.into_iter().chain(mask).collect()
}

/// Attention with scale 1/sqrt(`d`).
fn attention_op(causal: bool, window: Option<usize>, d: usize) -> Op {
    Op::Attention(AttnSpec {
        causal,
        window,
        scale: Float(1.0 / (d as f32).sqrt()),
        indexed: false,
    })
}

/// `got` within 1e-2 relative L2 of the CPU's `want`, and `want` not all zeros (a case that
/// checks nothing).
fn assert_rel_l2_nonzero(what: &str, got: &[f32], want: &[f32]) {
    let err = rel_l2(got, want);
    assert!(
        err < 1e-2,
        "{what}: relative L2 error {err} against the CPU"
    );
    assert!(
        want.iter().any(|&x| x != 0.0),
        "{what}: the reference is all zeros"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn embedding_router_dispatch_combine_cross_entropy() {
    let mut rng = Rng::new(5);
    for dt in DTYPES {
        let (a, r) = tol(dt);
        for h in SIZES {
            let table = rng.tensor(&[50, h], 1.0);
            let ids = rng.ids(&[2, 7], 0, 50);
            check(
                &Op::Embedding,
                &[&table, &ids],
                dt,
                0.0,
                0.0,
                &format!("embedding h={h}"),
            );
        }
        for (e, k) in [(8, 2), (50, 3), (3, 1)] {
            let mut logits = rng.tensor(&[2, 5, e], 2.0);
            if let shardc_runtime::Buffer::F32(v) = &mut logits.data {
                v[1] = v[0]; // a tie: goes to the lower index
            }
            for normalize in [false, true] {
                check(
                    &Op::Router {
                        top_k: k,
                        normalize,
                    },
                    &[&logits],
                    dt,
                    a,
                    r,
                    &format!("router e{e} k{k}"),
                );
            }
            let gates = shardc_runtime::eval_op(
                &Op::Router {
                    top_k: k,
                    normalize: true,
                },
                &[&round_bf16(&logits)],
                &ty_of(&logits),
            )
            .expect("cpu router");
            let x = rng.tensor(&[2, 5, 783], 1.0);
            check(
                &Op::Dispatch,
                &[&x, &gates],
                dt,
                0.0,
                0.0,
                &format!("dispatch e{e}"),
            );
            let y = rng.tensor(&[e, 2, 5, 783], 1.0);
            check(
                &Op::Combine,
                &[&y, &gates],
                dt,
                a,
                r,
                &format!("combine e{e}"),
            );
        }
        for v in [3, 50, 783, 4097] {
            let logits = rng.tensor(&[2, 7, v], 3.0);
            let mut labels = rng.ids(&[2, 7], 0, v as i32);
            if let shardc_runtime::Buffer::I32(l) = &mut labels.data {
                l[3] = -1; // ignored position
            }
            let (a, r) = match dt {
                GpuDType::F32 => (1e-5, 1e-5),
                GpuDType::Bf16 => (1e-2, 1e-2),
            };
            check(
                &Op::CrossEntropy { denom: 13 },
                &[&logits, &labels],
                dt,
                a,
                r,
                &format!("cross_entropy v={v}"),
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn layout_ops_and_cast_are_exact() {
    let mut rng = Rng::new(6);
    let dev = device();
    for dt in DTYPES {
        let x = rng.tensor(&[3, 50, 7, 4], 1.0);
        for op in [
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            Op::Transpose {
                perm: vec![3, 2, 1, 0],
            },
            Op::Slice {
                dim: 1,
                start: 13,
                len: 29,
            },
            Op::Repeat { dim: 2, times: 3 },
        ] {
            check(&op, &[&x], dt, 0.0, 0.0, op.mnemonic());
        }
        let y = rng.tensor(&[3, 11, 7, 4], 1.0);
        check(
            &Op::Concat { dim: 1 },
            &[&x, &y, &x],
            dt,
            0.0,
            0.0,
            "concat",
        );
        let declared = TensorType::plain(DType::F32, &[150, 28]);
        let (got, want) = gpu_and_cpu(&dev, &Op::Reshape, &[&x], Some(declared), dt);
        assert_close("reshape", &got, &want, 0.0, 0.0);
        // Cast to bf16 rounds to nearest even in both paths.
        let c = rng.tensor(&[4097], 3.0);
        check(&Op::Cast(DType::Bf16), &[&c], dt, 0.0, 0.0, "cast bf16");
        check(&Op::Cast(DType::F32), &[&c], dt, 0.0, 0.0, "cast f32");
        // i32 data moves bit-exactly.
        let ids = rng.ids(&[3, 50, 7], -1000, 1000);
        check(
            &Op::Transpose {
                perm: vec![2, 0, 1],
            },
            &[&ids],
            dt,
            0.0,
            0.0,
            "transpose i32",
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gemms_plain_transposed_batched_and_fused_ops() {
    let mut rng = Rng::new(7);
    for dt in DTYPES {
        for (m, k, n) in [(3, 50, 783), (50, 783, 3), (7, 4097, 50), (783, 3, 50)] {
            let a = rng.tensor(&[m, k], 1.0);
            let (at, rt) = match dt {
                GpuDType::F32 => (1e-5 * (k as f32).sqrt(), 1e-5),
                GpuDType::Bf16 => (2e-2 * (k as f32).sqrt() / 8.0, 1.0 / 32.0),
            };
            for tb in [false, true] {
                let shape = if tb { [n, k] } else { [k, n] };
                let b = rng.tensor(&shape, 1.0);
                check(
                    &Op::MatMul { transpose_b: tb },
                    &[&a, &b],
                    dt,
                    at,
                    rt,
                    &format!("matmul {m}x{k}x{n} tb={tb}"),
                );
            }
            // FusedMatMul with a bias (cuBLASLt epilogue) and with a generic epilogue kernel.
            let w = rng.tensor(&[n, k], 1.0);
            let bias = rng.tensor(&[n], 1.0);
            let bias_gelu = EwExpr {
                steps: vec![
                    EwStep::Add { a: 0, b: 1 },
                    EwStep::Unary {
                        f: UnaryOp::GeluTanh,
                        x: 2,
                    },
                ],
            };
            check(
                &Op::FusedMatMul {
                    transpose_b: true,
                    epilogue: bias_gelu,
                },
                &[&a, &w, &bias],
                dt,
                at,
                rt,
                &format!("fused_matmul bias+gelu {m}x{k}x{n}"),
            );
            let resid = rng.tensor(&[m, n], 1.0);
            let gated = EwExpr {
                steps: vec![
                    EwStep::Unary {
                        f: UnaryOp::Silu,
                        x: 0,
                    },
                    EwStep::Mul { a: 2, b: 1 },
                ],
            };
            check(
                &Op::FusedMatMul {
                    transpose_b: true,
                    epilogue: gated,
                },
                &[&a, &w, &resid],
                dt,
                at,
                rt,
                &format!("fused_matmul silu*x {m}x{k}x{n}"),
            );
        }
        // Batched (experts): a [E, B, T, K] · w [E, N, K]ᵀ.
        let a = rng.tensor(&[4, 2, 25, 64], 1.0);
        let w = rng.tensor(&[4, 783, 64], 1.0);
        let (at, rt) = match dt {
            GpuDType::F32 => (1e-4, 1e-5),
            GpuDType::Bf16 => (3e-2, 1.0 / 32.0),
        };
        check(
            &Op::MatMul { transpose_b: true },
            &[&a, &w],
            dt,
            at,
            rt,
            "batched matmul",
        );
        // A fused elementwise program with broadcast operands.
        let x = rng.tensor(&[5, 783], 2.0);
        let b = rng.tensor(&[783], 1.0);
        let prog = EwExpr {
            steps: vec![
                EwStep::Add { a: 0, b: 1 },
                EwStep::Unary {
                    f: UnaryOp::GeluErf,
                    x: 2,
                },
                EwStep::Scale {
                    c: Float(0.5),
                    x: 3,
                },
                EwStep::Mul { a: 4, b: 0 },
            ],
        };
        let (a2, r2) = tol(dt);
        check(
            &Op::FusedElementwise { expr: prog },
            &[&x, &b],
            dt,
            a2,
            r2.max(2e-5),
            "fused_elementwise",
        );
    }
}

/// The executor's own fused groups (GEMM bias/GeLU epilogues, add+RMSNorm, SwiGLU) give the
/// CPU result of the unfused graph, and fused and unfused GPU runs agree.
#[test]
#[ignore = "needs a GPU"]
fn planner_fusions_match_the_unfused_graph() {
    let dev = device();
    let mut rng = Rng::new(8);
    let (t, h, f) = (50, 64, 783);
    let dir = tempfile::tempdir().expect("tempdir");
    let w = checkpoint(
        dir.path(),
        &[
            (
                "w_up",
                vec![f, h],
                rng.tensor(&[f, h], 0.2).as_f32().unwrap().to_vec(),
            ),
            (
                "b_up",
                vec![f],
                rng.tensor(&[f], 0.5).as_f32().unwrap().to_vec(),
            ),
            (
                "w_gate",
                vec![f, h],
                rng.tensor(&[f, h], 0.2).as_f32().unwrap().to_vec(),
            ),
            (
                "w_down",
                vec![h, f],
                rng.tensor(&[h, f], 0.05).as_f32().unwrap().to_vec(),
            ),
            (
                "norm",
                vec![h],
                rng.tensor(&[h], 1.0).as_f32().unwrap().to_vec(),
            ),
        ],
    );
    let mut g = Graph::new();
    let x = g.input("x", TensorType::plain(DType::F32, &[1, t, h]));
    let r = g.input("r", TensorType::plain(DType::F32, &[1, t, h]));
    let w_up = param(&mut g, "w_up", &[f, h]);
    let b_up = param(&mut g, "b_up", &[f]);
    let w_gate = param(&mut g, "w_gate", &[f, h]);
    let w_down = param(&mut g, "w_down", &[h, f]);
    let norm_w = param(&mut g, "norm", &[h]);
    let sum = g.add(Op::Add, &[x, r], "residual").unwrap();
    let n = g
        .add(Op::RmsNorm { eps: Float(1e-5) }, &[sum, norm_w], "norm")
        .unwrap();
    let u = g
        .add(Op::MatMul { transpose_b: true }, &[n, w_up], "up")
        .unwrap();
    let ub = g.add(Op::Add, &[u, b_up], "up.bias").unwrap();
    let gl = g.add(Op::Unary(UnaryOp::GeluTanh), &[ub], "gelu").unwrap();
    let gt = g
        .add(Op::MatMul { transpose_b: true }, &[n, w_gate], "gate")
        .unwrap();
    let s = g.add(Op::Unary(UnaryOp::Silu), &[gt], "silu").unwrap();
    let m = g.add(Op::Mul, &[s, gl], "gate_mul").unwrap();
    let d = g
        .add(Op::MatMul { transpose_b: true }, &[m, w_down], "down")
        .unwrap();
    let y = g.add(Op::Add, &[sum, d], "out").unwrap();
    g.set_output("y", y);
    let inputs = BTreeMap::from([
        ("x".to_string(), rng.tensor(&[1, t, h], 1.0)),
        ("r".to_string(), rng.tensor(&[1, t, h], 1.0)),
    ]);
    let want = execute(&g, &w, &inputs, &RankCtx::new()).expect("cpu")["y"].clone();
    for dt in DTYPES {
        let ctx = CudaRankCtx::new();
        let mut fused = prepare(&dev, &g, &w, &ctx, opts(dt, true)).expect("prepare fused");
        let labels: Vec<&str> = fused.fused_groups().iter().map(|x| x.label()).collect();
        assert!(labels.contains(&"gemm+bias+gelu"), "{labels:?}");
        assert!(labels.contains(&"add+rmsnorm"), "{labels:?}");
        assert!(labels.contains(&"swiglu"), "{labels:?}");
        let got = fused.run(&inputs, &ctx).expect("run fused")["y"].clone();
        let unfused = execute_cuda(&dev, &g, &ParamInit::Weights(&w), &inputs, opts(dt, false))
            .expect("run unfused")["y"]
            .clone();
        let (a, r) = match dt {
            GpuDType::F32 => (1e-4, 1e-4),
            GpuDType::Bf16 => (5e-2, 5e-2),
        };
        assert_close(&format!("fused {dt} vs cpu"), &got, &want, a, r);
        assert_close(&format!("unfused {dt} vs cpu"), &unfused, &want, a, r);
        // A second run reuses every GEMM plan.
        let (built, _) = fused.gemm_stats();
        fused.run(&inputs, &ctx).expect("rerun");
        assert_eq!(fused.gemm_stats().0, built, "no new plans on a rerun");
    }
}

/// Expert GEMMs on their routed rows (`moe_route_index` + `routed_gemm`, and the weight
/// gradients by `routed_weight_grad`) against the dense ones and the CPU: a MoE block (router,
/// dispatch, both weight layouts, combine) and weight gradients of both layouts, at sizes that
/// are no tile multiple, with one expert no token chooses; the arena poisoned, so a row the
/// kernels leave unwritten shows. The dispatch and `down` are stored packed (`routed.rs`: the
/// routed rows only), written and read through the packed rows' map and by the routed kernels;
/// `up` and `act` too when `up` is no output (the case is run both ways).
#[test]
#[ignore = "needs a GPU"]
fn routed_expert_gemms_match_dense_and_cpu() {
    for up_is_output in [true, false] {
        routed_expert_gemms_case(up_is_output);
    }
}

fn routed_expert_gemms_case(up_is_output: bool) {
    let dev = device();
    let mut rng = Rng::new(11);
    let (e, t, h, f) = (3, 35, 72, 136);
    let dir = tempfile::tempdir().expect("tempdir");
    let w = checkpoint(
        dir.path(),
        &[
            (
                "w_up",
                vec![e, f, h],
                rng.tensor(&[e, f, h], 0.2).as_f32().unwrap().to_vec(),
            ),
            (
                "w_down",
                vec![e, f, h],
                rng.tensor(&[e, f, h], 0.1).as_f32().unwrap().to_vec(),
            ),
        ],
    );
    let mut g = Graph::new();
    let x = g.input("x", TensorType::plain(DType::F32, &[2, t, h]));
    let logits = g.input("logits", TensorType::plain(DType::F32, &[2, t, e]));
    let w_up = param(&mut g, "w_up", &[e, f, h]);
    let w_down = param(&mut g, "w_down", &[e, f, h]);
    let gates = g
        .add(
            Op::Router {
                top_k: 1,
                normalize: false,
            },
            &[logits],
            "gates",
        )
        .unwrap();
    let d = g.add(Op::Dispatch, &[x, gates], "dispatch").unwrap();
    let up = g
        .add(Op::MatMul { transpose_b: true }, &[d, w_up], "up")
        .unwrap();
    let act = g.add(Op::Unary(UnaryOp::Silu), &[up], "act").unwrap();
    let down = g
        .add(Op::MatMul { transpose_b: false }, &[act, w_down], "down")
        .unwrap();
    let y = g.add(Op::Combine, &[down, gates], "combine").unwrap();
    // Weight gradients with routed operands ([E, f, h] from dyᵀ·a, and from aᵀ·dy).
    let dw_up = g
        .add(
            Op::WeightGrad { transpose_b: true },
            &[d, up, w_up],
            "dw_up",
        )
        .unwrap();
    let dw_down = g
        .add(
            Op::WeightGrad { transpose_b: false },
            &[act, down, w_down],
            "dw_down",
        )
        .unwrap();
    if up_is_output {
        g.set_output("up", up);
    }
    g.set_output("y", y);
    g.set_output("dw_up", dw_up);
    g.set_output("dw_down", dw_down);
    // Expert 2 is never chosen.
    let mut l = rng.tensor(&[2, t, e], 2.0);
    if let shardc_runtime::Buffer::F32(v) = &mut l.data {
        for row in v.chunks_mut(e) {
            row[2] = -100.0;
        }
    }
    let inputs = BTreeMap::from([
        ("x".to_string(), rng.tensor(&[2, t, h], 1.0)),
        ("logits".to_string(), l),
    ]);
    let want = execute(&g, &w, &inputs, &RankCtx::new()).expect("cpu");
    for dt in DTYPES {
        let ctx = CudaRankCtx::new();
        let mut routed = prepare(&dev, &g, &w, &ctx, opts(dt, true)).expect("prepare routed");
        let n_routed = routed.routing().gemms.iter().flatten().count();
        assert_eq!(n_routed, 2, "{dt}: up and down are routed");
        let n_wg = routed.routing().weight_grads.iter().flatten().count();
        assert_eq!(n_wg, 2, "{dt}: both weight gradients are routed");
        let n_packed = routed.routing().packed.iter().flatten().count();
        // The dispatch and down always; up and act unless up is an output.
        let want_packed = if up_is_output { 2 } else { 4 };
        assert_eq!(n_packed, want_packed, "{dt}: packed values");
        let got = routed.run(&inputs, &ctx).expect("run routed");
        let dense_opts = CudaOptions {
            routed_experts: false,
            ..opts(dt, true)
        };
        let dense = execute_cuda(&dev, &g, &ParamInit::Weights(&w), &inputs, dense_opts)
            .expect("run dense");
        let (a, r) = match dt {
            GpuDType::F32 => (1e-4, 1e-4),
            GpuDType::Bf16 => (5e-2, 5e-2),
        };
        let outs: &[&str] = if up_is_output {
            &["up", "y", "dw_up", "dw_down"]
        } else {
            &["y", "dw_up", "dw_down"]
        };
        for &out in outs {
            assert_close(
                &format!("routed {out} {dt} vs cpu"),
                &got[out],
                &want[out],
                a,
                r,
            );
            assert_close(
                &format!("dense {out} {dt} vs cpu"),
                &dense[out],
                &want[out],
                a,
                r,
            );
        }
        // Rows of unchosen experts are exactly zero.
        if up_is_output {
            let up_got = got["up"].as_f32().unwrap();
            assert!(up_got[2 * 2 * t * f..].iter().all(|&v| v == 0.0), "{dt}");
        }
    }
}

/// The checks the GPU tests rely on can fail (these run on any machine): bf16's elementwise
/// bounds alone would pass an all-zero output where the reference is small, the relative-L2
/// bound does not; a near tie of the reference's top two logits is not counted either way.
#[test]
fn the_gpu_checks_can_fail() {
    let want = Tensor::f32(vec![4], vec![0.004, -0.006, 0.008, 0.002]);
    let zeros = Tensor::f32(vec![4], vec![0.0; 4]);
    let (a, r) = tol(GpuDType::Bf16);
    let zero_passes = std::panic::catch_unwind(|| assert_close("zeros", &zeros, &want, a, r));
    assert!(
        zero_passes.is_err(),
        "an all-zero output passed the bf16 check"
    );
    assert_close("itself", &want, &want, a, r);
    // Row 0: decisive, agreeing; row 1: a near tie (ignored); row 2: decisive, disagreeing.
    let want = [3.0, 1.0, 2.0, 2.001, 0.0, 5.0];
    let got = [3.0, 1.0, 2.001, 2.0, 5.0, 0.0];
    let top1 = top1_agreement(&got, &want, 2, 2e-2);
    assert!((top1 - 0.5).abs() < 1e-12, "{top1}");
}

/// Reshapes of computed values run as views of their root's slot (no copy): a chain of two
/// reshapes read by a later kernel and named as outputs, with a value computed in between that
/// must not land in the root's bytes, matches the CPU reference (f32).
#[test]
#[ignore = "needs a GPU"]
fn reshape_of_a_computed_value_is_a_view() {
    let mut rng = Rng::new(23);
    let x = rng.tensor(&[6, 40], 1.0);
    let mut g = Graph::new();
    let xi = g.input("x", ty_of(&x));
    let a = g.add(Op::Unary(UnaryOp::Silu), &[xi], "a").expect("silu");
    let r1 = g
        .add_typed(
            Op::Reshape,
            &[a],
            Some(TensorType::plain(DType::F32, &[240])),
            "r1",
        )
        .expect("reshape");
    let b = g.add(Op::Unary(UnaryOp::Exp), &[xi], "b").expect("exp");
    let r2 = g
        .add_typed(
            Op::Reshape,
            &[r1],
            Some(TensorType::plain(DType::F32, &[4, 60])),
            "r2",
        )
        .expect("reshape");
    let bb = g
        .add_typed(
            Op::Reshape,
            &[b],
            Some(TensorType::plain(DType::F32, &[4, 60])),
            "bb",
        )
        .expect("reshape");
    let s = g.add(Op::Add, &[r2, bb], "s").expect("add");
    g.set_output("r2", r2);
    g.set_output("s", s);
    let inputs = BTreeMap::from([("x".to_string(), x)]);
    let dir = tempfile::tempdir().expect("tempdir");
    let w = checkpoint(dir.path(), &[]);
    let want = execute(&g, &w, &inputs, &RankCtx::new()).expect("cpu");
    let dev = device();
    let params = ParamInit::Random {
        seed: 1,
        scale: 1.0,
    };
    let got = execute_cuda(&dev, &g, &params, &inputs, opts(GpuDType::F32, true)).expect("gpu");
    let (atol, rtol) = tol(GpuDType::F32);
    for name in ["r2", "s"] {
        assert_close(name, &got[name], &want[name], atol, rtol);
    }
}

/// The split-KV decode path (`attention_decode_*` + `attention_decode_combine_*`) against the
/// ordinary kernel (`CudaOptions::split_kv_attention` off) and the CPU reference at Llama-3-8B
/// decode shapes (32 query / 8 KV heads, head_dim 128, q_offset = S - Tq), in bf16 and f32;
/// the plan is checked to take the split path on this device first.
#[test]
#[ignore = "needs a GPU"]
fn split_kv_decode_matches_ordinary_and_cpu() {
    use shardc_kernels::launch::{attention_plan, split_kv_reserve_bytes, AttentionPlan};
    use shardc_kernels::KernelDType;
    let dev = device();
    let mut rng = Rng::new(43);
    let cases: &[AttnCase] = &[
        (1, 1, 4096, 32, 8, 128, true, None, false),
        (1, 1, 16384, 32, 8, 128, true, None, false),
        (2, 4, 4099, 32, 8, 128, true, Some(1500), true), // odd S, window, mask
    ];
    let split = |split_kv_attention, dt| CudaOptions {
        split_kv_attention,
        ..opts(dt, true)
    };
    for &(b, t, s, hq, hkv, d, causal, window, masked) in cases {
        let dims = [b, t, s, hq, hkv, d];
        let ws = split_kv_reserve_bytes(dims, dev.sm_count());
        let cap = (dev.compute_capability().0, dev.sm_count());
        let aligned = [256, 256, 256];
        for kdt in [KernelDType::Bf16, KernelDType::F32] {
            let plan = attention_plan(kdt, cap, true, ws, dims, aligned).expect("valid shape");
            assert!(
                matches!(plan, AttentionPlan::SplitKv(_)),
                "{dims:?} on {} SMs: {plan:?}",
                dev.sm_count()
            );
        }
        let q = rng.tensor(&[b, t, hq, d], 1.0);
        let k = rng.tensor(&[b, s, hkv, d], 1.0);
        let v = rng.tensor(&[b, s, hkv, d], 1.0);
        let mut m = vec![1.0f32; b * s];
        for (i, x) in m.iter_mut().enumerate() {
            // Every key of batch 0 below 1024 (whole splits) and a random fifth.
            if (i < s && i < 1024) || rng.below(5) == 0 {
                *x = 0.0;
            }
        }
        let mask = Tensor::f32(vec![b, s], m);
        let ins = attention_inputs([&q, &k, &v], masked.then_some(&mask));
        let op = attention_op(causal, window, d);
        for dt in DTYPES {
            let what =
                format!("{dt} b{b} t{t} s{s} h{hq}/{hkv} d{d} window={window:?} mask={masked}");
            let (a, r) = match dt {
                GpuDType::F32 => (3e-5, 1e-4),
                GpuDType::Bf16 => (2e-2, 1.0 / 32.0),
            };
            let (got, want) = gpu_and_cpu_with(&dev, &op, &ins, None, split(true, dt));
            let (plain, _) = gpu_and_cpu_with(&dev, &op, &ins, None, split(false, dt));
            assert_close(&format!("split-KV {what}"), &got, &want, a, r);
            assert_close(&format!("ordinary {what}"), &plain, &want, a, r);
            assert_close(&format!("split-KV vs ordinary {what}"), &got, &plain, a, r);
            let f32s = |x: &Tensor| {
                x.as_f32()
                    .expect("invariant: attention outputs f32")
                    .to_vec()
            };
            assert_rel_l2_nonzero(&what, &f32s(&got), &f32s(&want));
        }
    }
}
