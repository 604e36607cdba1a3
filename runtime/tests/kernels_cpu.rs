//! The CPU reference kernels against direct (f64, loop-by-loop) implementations on seeded
//! random inputs at odd sizes, and the executor on tiny hand-built graphs with checkpoints
//! written by the test.

mod comm_common;
mod cuda_common;

use comm_common::on_threads;
use cuda_common::{ty_of, Rng};
use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use shardc_compiler::ir::{
    AttnSpec, DType, Float, Graph, Op, ParamSource, ParamView, RopeScaling, RopeSpec, RopeStyle,
    ShardSpec, TensorType, UnaryOp, ValueId,
};
use shardc_runtime::comm::{CommError, Communicator, ReduceOp};
use shardc_runtime::{
    eval_op, execute, execute_with_params, load_params, ParamCache, RankCtx, RuntimeError, Tensor,
    Weights,
};
use std::collections::BTreeMap;
use std::path::Path;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Type-checks `op` on the operands (as the IR would) and evaluates it.
fn run(op: Op, ins: &[&Tensor]) -> Tensor {
    run_declared(op, ins, None)
}

fn run_declared(op: Op, ins: &[&Tensor], declared: Option<TensorType>) -> Tensor {
    let tys: Vec<TensorType> = ins.iter().map(|t| ty_of(t)).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let out = op
        .infer(&refs, declared.as_ref())
        .unwrap_or_else(|e| panic!("{} does not type-check: {e}", op.mnemonic()));
    let t = eval_op(&op, ins, &out).unwrap_or_else(|e| panic!("{} failed: {e}", op.mnemonic()));
    assert_eq!(
        t.shape,
        out.shape(),
        "{}: shape differs from its type rule",
        op.mnemonic()
    );
    t
}

fn f(t: &Tensor) -> &[f32] {
    t.as_f32().expect("f32 tensor")
}

fn assert_close(got: &[f32], want: &[f64], atol: f64, rtol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: element count");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = atol + rtol * w.abs();
        assert!(
            (g as f64 - w).abs() <= tol,
            "{what}: element {i}: got {g}, want {w} (|Δ| = {:e})",
            (g as f64 - w).abs()
        );
    }
}

fn to64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

// ---------------------------------------------------------------------------------------------
// MatMul
// ---------------------------------------------------------------------------------------------

/// c[r, n] = Σ_k a[r, k] · b(k, n) over `rows` rows, `b(k, n)` from `[K, N]` or `[N, K]`.
/// A matmul's result `c` against the naive product `want` (1e-5 absolute and relative).
fn assert_matmul(c: &Tensor, want: &[f64], what: &str) {
    assert_close(f(c), want, 1e-5, 1e-5, what);
}

fn naive_mm(a: &[f32], b: &[f32], rows: usize, k: usize, n: usize, tb: bool) -> Vec<f64> {
    let mut c = vec![0.0; rows * n];
    for r in 0..rows {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                s += a[r * k + p] as f64 * bv as f64;
            }
            c[r * n + j] = s;
        }
    }
    c
}

const MM_SIZES: [(usize, usize, usize); 5] =
    [(1, 1, 1), (3, 7, 5), (50, 3, 7), (7, 783, 3), (1, 50, 783)];

#[test]
fn matmul_2d_matches_naive_at_odd_sizes() {
    let mut rng = Rng::new(1);
    for (m, k, n) in MM_SIZES {
        for lead in [vec![], vec![3], vec![2, 1]] {
            let mut ash = lead.clone();
            ash.extend([m, k]);
            let a = rng.tensor(&ash, 1.0);
            let b = rng.tensor(&[k, n], 1.0);
            let c = run(Op::MatMul { transpose_b: false }, &[&a, &b]);
            let rows = a.numel() / k;
            let want = naive_mm(f(&a), f(&b), rows, k, n, false);
            assert_matmul(&c, &want, &format!("matmul {ash:?} x [{k},{n}]"));
        }
    }
}

#[test]
fn matmul_transpose_b_matches_naive() {
    let mut rng = Rng::new(2);
    for (m, k, n) in MM_SIZES {
        let a = rng.tensor(&[2, m, k], 1.0);
        let b = rng.tensor(&[n, k], 1.0);
        let c = run(Op::MatMul { transpose_b: true }, &[&a, &b]);
        let want = naive_mm(f(&a), f(&b), 2 * m, k, n, true);
        assert_matmul(&c, &want, &format!("matmul^T m{m} k{k} n{n}"));
    }
}

#[test]
fn matmul_batched_both_layouts_match_naive() {
    let mut rng = Rng::new(3);
    for (m, k, n) in MM_SIZES {
        for tb in [false, true] {
            let e = 3;
            let a = rng.tensor(&[e, 2, m, k], 1.0);
            let bsh = if tb { [e, n, k] } else { [e, k, n] };
            let b = rng.tensor(&bsh, 1.0);
            let c = run(Op::MatMul { transpose_b: tb }, &[&a, &b]);
            assert_eq!(c.shape, vec![e, 2, m, n]);
            let mut want = Vec::new();
            for ei in 0..e {
                let ae = &f(&a)[ei * 2 * m * k..(ei + 1) * 2 * m * k];
                let be = &f(&b)[ei * k * n..(ei + 1) * k * n];
                want.extend(naive_mm(ae, be, 2 * m, k, n, tb));
            }
            assert_matmul(&c, &want, &format!("batched tb={tb} m{m} k{k} n{n}"));
        }
    }
}

#[test]
fn matmul_rejects_mismatched_contraction() {
    let a = Tensor::f32(vec![2, 3], vec![0.0; 6]);
    let b = Tensor::f32(vec![4, 5], vec![0.0; 20]);
    let out = TensorType::plain(DType::F32, &[2, 5]);
    let err = eval_op(&Op::MatMul { transpose_b: false }, &[&a, &b], &out).unwrap_err();
    assert!(
        matches!(err, RuntimeError::Shape { op: "matmul", .. }),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Elementwise
// ---------------------------------------------------------------------------------------------

#[test]
fn add_and_mul_broadcast_suffixes() {
    let mut rng = Rng::new(4);
    let a = rng.tensor(&[3, 7, 5], 2.0);
    for bsh in [vec![5], vec![7, 5], vec![3, 7, 5], vec![]] {
        let b = rng.tensor(&bsh, 2.0);
        let nb = b.numel();
        for (op, g) in [
            (Op::Add, (|x, y| x + y) as fn(f64, f64) -> f64),
            (Op::Mul, |x, y| x * y),
        ] {
            let c = run(op.clone(), &[&a, &b]);
            let want: Vec<f64> = f(&a)
                .iter()
                .enumerate()
                .map(|(i, &x)| g(x as f64, f(&b)[i % nb] as f64) as f32 as f64)
                .collect();
            assert_close(
                f(&c),
                &want,
                0.0,
                0.0,
                &format!("{} by {bsh:?}", op.mnemonic()),
            );
        }
    }
    let ai = Tensor::i32(vec![2, 2], vec![1, 2, 3, 4]);
    let bi = Tensor::i32(vec![2], vec![10, -1]);
    assert_eq!(run(Op::Add, &[&ai, &bi]).as_i32().unwrap(), &[11, 1, 13, 3]);
    assert_eq!(
        run(Op::Mul, &[&ai, &bi]).as_i32().unwrap(),
        &[10, -2, 30, -4]
    );
}

/// erf by its Maclaurin series (|z| < 2.5, where it is accurate in f64).
fn series_erf(z: f64) -> f64 {
    let mut term = z;
    let mut sum = z;
    for n in 1..200 {
        term *= -z * z / n as f64;
        let add = term / (2 * n + 1) as f64;
        sum += add;
        if add.abs() < 1e-18 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// A unary op's exact value at `x` (second argument: √(2/π)).
type Reference = fn(f64, f64) -> f64;

#[test]
fn unary_ops_match_f64_formulas() {
    let mut rng = Rng::new(5);
    let mut xs = rng.vec(783, 8.0);
    xs.extend([0.0, -0.0, 1e-8, -1e-8, 20.0, -20.0, 3.5, -3.5]);
    let x = Tensor::f32(vec![xs.len()], xs.clone());
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let cases: [(UnaryOp, Reference); 6] = [
        (UnaryOp::GeluTanh, |x, c| {
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }),
        (UnaryOp::GeluErf, |x, _| {
            if x.abs() < 3.5 {
                0.5 * x * (1.0 + series_erf(x / 2f64.sqrt()))
            } else {
                f64::NAN // checked against the reference table instead
            }
        }),
        (UnaryOp::Silu, |x, _| x / (1.0 + (-x).exp())),
        (UnaryOp::Relu, |x, _| x.max(0.0)),
        (UnaryOp::Exp, |x, _| x.exp()),
        (UnaryOp::Neg, |x, _| -x),
    ];
    for (u, g) in cases {
        let y = run(Op::Unary(u), &[&x]);
        for (i, (&got, &xi)) in f(&y).iter().zip(&xs).enumerate() {
            let want = g(xi as f64, c);
            if want.is_nan() {
                continue;
            }
            // Within one f32 ulp of the exact value (plus a tiny absolute floor).
            let tol = want.abs() * 1.2e-7 + 1e-30;
            assert!(
                (got as f64 - want).abs() <= tol,
                "{}({xi}) [{i}] = {got}, want {want}",
                u.name()
            );
        }
    }
}

#[test]
fn gelu_erf_matches_reference_values() {
    // 0.5·x·erfc(−x/√2) at the f32 value of x, from Python's math.erfc (C libm).
    let table: [(f32, f64); 14] = [
        (-9.0, -1.015729565358458e-18),
        (-6.5, -2.6104003795084313e-10),
        (-4.0, -0.00012668496733247986),
        (-2.25, -0.027505063473850584),
        (-1.0, -0.15865525393145707),
        (-0.3, -0.11462657653421583),
        (-0.001, -0.0004996010814969171),
        (0.0, 0.0),
        (0.001, 0.0005003989660005341),
        (0.5, 0.34573123063700656),
        (1.7, 1.6242387664929818),
        (3.3, 3.298404652398412),
        (5.0, 4.99999856674214),
        (7.25, 7.249999999998489),
    ];
    let x = Tensor::f32(vec![table.len()], table.iter().map(|p| p.0).collect());
    let y = run(Op::Unary(UnaryOp::GeluErf), &[&x]);
    for (&got, &(xi, want)) in f(&y).iter().zip(&table) {
        // Correctly rounded to f32: within half an ulp (2⁻²⁴ relative).
        let tol = want.abs() * 6e-8;
        assert!(
            (got as f64 - want).abs() <= tol,
            "gelu_erf({xi}) = {got}, want {want}"
        );
    }
}

#[test]
fn scale_and_cast() {
    let mut rng = Rng::new(6);
    let x = rng.tensor(&[3, 50], 100.0);
    let y = run(Op::Scale(Float(0.125)), &[&x]);
    let want: Vec<f64> = f(&x).iter().map(|&v| (v * 0.125) as f64).collect();
    assert_close(f(&y), &want, 0.0, 0.0, "scale");

    let b = run(Op::Cast(DType::Bf16), &[&x]);
    let want: Vec<f64> = f(&x)
        .iter()
        .map(|&v| bf16::from_f32(v).to_f32() as f64)
        .collect();
    assert_close(f(&b), &want, 0.0, 0.0, "cast bf16");
    let h = run(Op::Cast(DType::F16), &[&x]);
    let want: Vec<f64> = f(&x)
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32() as f64)
        .collect();
    assert_close(f(&h), &want, 0.0, 0.0, "cast f16");
    let i = run(Op::Cast(DType::I32), &[&x]);
    let want: Vec<i32> = f(&x).iter().map(|&v| v.trunc() as i32).collect();
    assert_eq!(i.as_i32().unwrap(), &want[..]);
    let back = run(Op::Cast(DType::F32), &[&i]);
    assert_close(
        f(&back),
        &want.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        0.0,
        0.0,
        "i32→f32",
    );
}

// ---------------------------------------------------------------------------------------------
// Norms and softmax
// ---------------------------------------------------------------------------------------------

#[test]
fn rms_norm_matches_hf_formula() {
    let mut rng = Rng::new(7);
    for h in [1, 3, 50, 783] {
        let x = rng.tensor(&[2, 3, h], 3.0);
        let w = Tensor::f32(vec![h], (0..h).map(|_| 1.0 + rng.sym(0.5)).collect());
        let eps = 1e-5f32;
        let y = run(Op::RmsNorm { eps: Float(eps) }, &[&x, &w]);
        let mut want = Vec::new();
        for row in f(&x).chunks(h) {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / h as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            want.extend(
                row.iter()
                    .zip(f(&w))
                    .map(|(&v, &g)| v as f64 * inv * g as f64),
            );
        }
        assert_close(f(&y), &want, 1e-6, 1e-6, &format!("rms_norm h={h}"));
    }
}

#[test]
fn layer_norm_matches_naive() {
    let mut rng = Rng::new(8);
    for h in [1, 3, 50, 783] {
        let x = rng.tensor(&[7, h], 3.0);
        let w = rng.tensor(&[h], 1.5);
        let b = rng.tensor(&[h], 0.5);
        let y = run(Op::LayerNorm { eps: Float(1e-5) }, &[&x, &w, &b]);
        let mut want = Vec::new();
        for row in f(&x).chunks(h) {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
            for ((&v, &g), &c) in row.iter().zip(f(&w)).zip(f(&b)) {
                want.push((v as f64 - mean) / (var + 1e-5).sqrt() * g as f64 + c as f64);
            }
        }
        assert_close(f(&y), &want, 1e-6, 1e-6, &format!("layer_norm h={h}"));
    }
}

fn naive_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let e: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

#[test]
fn softmax_matches_naive() {
    let mut rng = Rng::new(9);
    for n in [1, 3, 7, 50, 783] {
        let x = rng.tensor(&[3, n], 30.0);
        let y = run(Op::Softmax, &[&x]);
        let want: Vec<f64> = f(&x).chunks(n).flat_map(naive_softmax).collect();
        assert_close(f(&y), &want, 1e-7, 1e-6, &format!("softmax n={n}"));
    }
}

// ---------------------------------------------------------------------------------------------
// Rope
// ---------------------------------------------------------------------------------------------

/// HF's inverse frequencies, computed independently: base^(−2i/d) rounded to f32, then the
/// rope_type's adjustment (HF `_compute_llama3_parameters` / linear).
fn hf_inv_freq(theta: f64, d: usize, scaling: Option<RopeScaling>) -> Vec<f32> {
    let base: Vec<f64> = (0..d / 2)
        .map(|i| (1.0 / theta.powf((2 * i) as f64 / d as f64)) as f32 as f64)
        .collect();
    let out: Vec<f64> = match scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor.0 as f64).collect(),
        Some(RopeScaling::Llama3 {
            factor: fac,
            low_freq_factor: lo,
            high_freq_factor: hi,
            original_max_positions: old,
        }) => {
            let (fac, lo, hi, old) = (fac.0 as f64, lo.0 as f64, hi.0 as f64, old as f64);
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let scaled = if wavelen > old / lo { f / fac } else { f };
                    let smooth = (old / wavelen - lo) / (hi - lo);
                    let medium = wavelen >= old / hi && wavelen <= old / lo;
                    if medium {
                        (1.0 - smooth) * scaled / fac + smooth * scaled
                    } else {
                        scaled
                    }
                })
                .collect()
        }
    };
    out.into_iter().map(|f| f as f32).collect()
}

fn naive_rope(x: &Tensor, pos: &[i32], inv: &[f32], style: RopeStyle) -> Vec<f64> {
    let (n, d) = (x.shape[2], x.shape[3]);
    let h = d / 2;
    let mut out = to64(f(x));
    for (r, &p) in pos.iter().enumerate() {
        for head in 0..n {
            let b = (r * n + head) * d;
            for (i, &fr) in inv.iter().enumerate() {
                // HF: angle = inv_freq · pos in float32.
                let ang = (fr * p as f32) as f64;
                let (lo, hi) = match style {
                    RopeStyle::Half => (i, i + h),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (a, c) = (f(x)[b + lo] as f64, f(x)[b + hi] as f64);
                out[b + lo] = a * ang.cos() - c * ang.sin();
                out[b + hi] = c * ang.cos() + a * ang.sin();
            }
        }
    }
    out
}

fn check_rope(seed: u64, style: RopeStyle, scaling: Option<RopeScaling>, d: usize) {
    let mut rng = Rng::new(seed);
    let (b, t, n) = (2, 7, 3);
    let x = rng.tensor(&[b, t, n, d], 2.0);
    let posv: Vec<i32> = (0..b * t).map(|_| rng.below(300) as i32).collect();
    let pos = Tensor::i32(vec![b, t], posv.clone());
    let spec = RopeSpec {
        theta: Float(10000.0),
        style,
        scaling,
    };
    let y = run(Op::Rope(spec), &[&x, &pos]);
    let inv = hf_inv_freq(10000.0, d, scaling);
    assert_eq!(inv, spec.inv_freq(d), "inv_freq differs from HF's formula");
    let want = naive_rope(&x, &posv, &inv, style);
    assert_close(
        f(&y),
        &want,
        2e-6,
        2e-6,
        &format!("rope {style:?} {scaling:?} d={d}"),
    );
}

#[test]
fn rope_half_matches_naive() {
    for d in [2, 8, 50] {
        check_rope(10, RopeStyle::Half, None, d);
    }
}

#[test]
fn rope_interleaved_matches_naive() {
    for d in [2, 8, 50] {
        check_rope(11, RopeStyle::Interleaved, None, d);
    }
}

#[test]
fn rope_llama3_and_linear_scaling_match_hf() {
    let llama3 = RopeScaling::Llama3 {
        factor: Float(8.0),
        low_freq_factor: Float(1.0),
        high_freq_factor: Float(4.0),
        original_max_positions: 64,
    };
    check_rope(12, RopeStyle::Half, Some(llama3), 64);
    check_rope(
        13,
        RopeStyle::Half,
        Some(RopeScaling::Linear { factor: Float(4.0) }),
        16,
    );
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------

struct AttnCase {
    b: usize,
    t: usize,
    s: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    window: Option<usize>,
    mask: bool,
}

impl AttnCase {
    /// Causal attention, no window or mask, of sizes `[B, T, S, Hq, Hkv, D]`.
    fn causal([b, t, s, hq, hkv, d]: [usize; 6]) -> AttnCase {
        AttnCase {
            b,
            t,
            s,
            hq,
            hkv,
            d,
            causal: true,
            window: None,
            mask: false,
        }
    }
    fn non_causal(self) -> AttnCase {
        AttnCase {
            causal: false,
            ..self
        }
    }
    fn window(self, w: usize) -> AttnCase {
        AttnCase {
            window: Some(w),
            ..self
        }
    }
    /// A random key mask; the last batch row masks every key.
    fn masked(self) -> AttnCase {
        AttnCase { mask: true, ..self }
    }
}

fn naive_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    c: &AttnCase,
    scale: f64,
) -> Vec<f64> {
    let mut out = vec![0.0; c.b * c.t * c.hq * c.d];
    let off = c.s as isize - c.t as isize;
    for b in 0..c.b {
        for h in 0..c.hq {
            let kh = h / (c.hq / c.hkv);
            for t in 0..c.t {
                let qp = t as isize + off;
                let qi = ((b * c.t + t) * c.hq + h) * c.d;
                let mut scores = Vec::new();
                for s in 0..c.s {
                    let vis = (!c.causal || s as isize <= qp)
                        && c.window.is_none_or(|w| qp - (s as isize) < w as isize)
                        && mask.is_none_or(|m| m[b * c.s + s] != 0.0);
                    if vis {
                        let ki = ((b * c.s + s) * c.hkv + kh) * c.d;
                        let dot: f64 = (0..c.d).map(|i| q[qi + i] as f64 * k[ki + i] as f64).sum();
                        scores.push((s, dot * scale));
                    }
                }
                if scores.is_empty() {
                    continue;
                }
                let max = scores.iter().fold(f64::NEG_INFINITY, |m, p| m.max(p.1));
                let z: f64 = scores.iter().map(|p| (p.1 - max).exp()).sum();
                for (s, sc) in scores {
                    let p = (sc - max).exp() / z;
                    let vi = ((b * c.s + s) * c.hkv + kh) * c.d;
                    for i in 0..c.d {
                        out[qi + i] += p * v[vi + i] as f64;
                    }
                }
            }
        }
    }
    out
}

fn check_attention(seed: u64, c: AttnCase) -> Tensor {
    let mut rng = Rng::new(seed);
    let q = rng.tensor(&[c.b, c.t, c.hq, c.d], 1.5);
    let k = rng.tensor(&[c.b, c.s, c.hkv, c.d], 1.5);
    let v = rng.tensor(&[c.b, c.s, c.hkv, c.d], 1.0);
    let mask = c.mask.then(|| {
        let mut m: Vec<f32> = (0..c.b * c.s)
            .map(|_| if rng.below(4) == 0 { 0.0 } else { 1.0 })
            .collect();
        // The last batch row sees nothing at all.
        let last = c.b - 1;
        m[last * c.s..].fill(0.0);
        Tensor::f32(vec![c.b, c.s], m)
    });
    let scale = 1.0 / (c.d as f32).sqrt();
    let spec = AttnSpec {
        causal: c.causal,
        window: c.window,
        scale: Float(scale),
        indexed: false,
    };
    let mut ins = vec![&q, &k, &v];
    ins.extend(mask.as_ref());
    let y = run(Op::Attention(spec), &ins);
    let want = naive_attention(f(&q), f(&k), f(&v), mask.as_ref().map(f), &c, scale as f64);
    let what = format!(
        "attention b{} t{} s{} hq{} hkv{} d{} causal {} window {:?} mask {}",
        c.b, c.t, c.s, c.hq, c.hkv, c.d, c.causal, c.window, c.mask
    );
    assert_close(f(&y), &want, 2e-6, 1e-5, &what);
    y
}

#[test]
fn attention_gqa_causal_matches_naive() {
    for (t, d) in [(1, 8), (7, 8), (50, 3), (13, 64)] {
        check_attention(20, AttnCase::causal([2, t, t, 8, 2, d]));
    }
    check_attention(21, AttnCase::causal([1, 7, 7, 3, 3, 5]).non_causal());
}

#[test]
fn attention_window_and_mask_match_naive() {
    for window in [1, 3, 50] {
        check_attention(
            22,
            AttnCase::causal([3, 11, 11, 4, 1, 8])
                .window(window)
                .masked(),
        );
    }
    check_attention(
        23,
        AttnCase::causal([2, 9, 9, 2, 2, 4])
            .non_causal()
            .window(3)
            .masked(),
    );
}

#[test]
fn attention_fully_masked_rows_are_zero() {
    let y = check_attention(24, AttnCase::causal([2, 5, 5, 2, 1, 3]).masked());
    // Batch row 1 has an all-zero mask.
    assert!(f(&y)[5 * 2 * 3..].iter().all(|&v| v == 0.0));
}

#[test]
fn attention_more_keys_than_queries_aligns_the_last_query() {
    // T < S: query t sits at position t + S − T (decode with a KV cache).
    check_attention(25, AttnCase::causal([2, 3, 7, 4, 2, 8]));
    check_attention(26, AttnCase::causal([1, 1, 50, 2, 1, 8]).window(7));
}

// ---------------------------------------------------------------------------------------------
// MoE, vocabulary and layout ops
// ---------------------------------------------------------------------------------------------

fn naive_router(row: &[f32], k: usize, normalize: bool) -> Vec<f64> {
    let p = naive_softmax(row);
    let mut idx: Vec<usize> = (0..row.len()).collect();
    // Stable sort by value descending: ties keep the lower index first.
    idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap());
    let kept = &idx[..k];
    let sum: f64 = kept.iter().map(|&i| p[i]).sum();
    (0..row.len())
        .map(|i| {
            if !kept.contains(&i) {
                0.0
            } else if normalize {
                p[i] / sum
            } else {
                p[i]
            }
        })
        .collect()
}

#[test]
fn router_matches_naive_with_ties() {
    let mut rng = Rng::new(30);
    for (e, k) in [(1, 1), (4, 2), (7, 3), (8, 8), (50, 5)] {
        // Quantised logits make ties frequent.
        let x: Vec<f32> = (0..3 * e).map(|_| rng.below(4) as f32 * 0.5).collect();
        let xt = Tensor::f32(vec![3, e], x.clone());
        for normalize in [false, true] {
            let g = run(
                Op::Router {
                    top_k: k,
                    normalize,
                },
                &[&xt],
            );
            let want: Vec<f64> = x
                .chunks(e)
                .flat_map(|r| naive_router(r, k, normalize))
                .collect();
            assert_close(
                f(&g),
                &want,
                1e-7,
                1e-6,
                &format!("router e{e} k{k} norm {normalize}"),
            );
        }
    }
}

#[test]
fn dispatch_and_combine_match_naive() {
    let mut rng = Rng::new(31);
    let (b, t, h, e) = (2, 3, 7, 4);
    let x = rng.tensor(&[b, t, h], 1.0);
    let logits = rng.tensor(&[b, t, e], 2.0);
    let g = run(
        Op::Router {
            top_k: 2,
            normalize: true,
        },
        &[&logits],
    );
    let d = run(Op::Dispatch, &[&x, &g]);
    assert_eq!(d.shape, vec![e, b, t, h]);
    for ei in 0..e {
        for r in 0..b * t {
            let slot = &f(&d)[(ei * b * t + r) * h..(ei * b * t + r + 1) * h];
            if f(&g)[r * e + ei] != 0.0 {
                assert_eq!(slot, &f(&x)[r * h..(r + 1) * h]);
            } else {
                assert!(slot.iter().all(|&v| v == 0.0));
            }
        }
    }
    let y = rng.tensor(&[e, b, t, h], 1.0);
    let c = run(Op::Combine, &[&y, &g]);
    let mut want = vec![0.0; b * t * h];
    for r in 0..b * t {
        for ei in 0..e {
            for i in 0..h {
                want[r * h + i] +=
                    f(&g)[r * e + ei] as f64 * f(&y)[(ei * b * t + r) * h + i] as f64;
            }
        }
    }
    assert_close(f(&c), &want, 1e-6, 1e-6, "combine");
}

#[test]
fn embedding_and_cross_entropy_match_naive() {
    let mut rng = Rng::new(32);
    let (v, h) = (50, 7);
    let table = rng.tensor(&[v, h], 1.0);
    let ids: Vec<i32> = (0..6)
        .map(|i| {
            if i == 4 {
                -3
            } else if i == 5 {
                v as i32
            } else {
                rng.below(v) as i32
            }
        })
        .collect();
    let idt = Tensor::i32(vec![2, 3], ids.clone());
    let y = run(Op::Embedding, &[&table, &idt]);
    assert_eq!(y.shape, vec![2, 3, h]);
    for (r, &id) in ids.iter().enumerate() {
        let row = &f(&y)[r * h..(r + 1) * h];
        if (0..v as i32).contains(&id) {
            assert_eq!(row, &f(&table)[id as usize * h..(id as usize + 1) * h]);
        } else {
            assert!(
                row.iter().all(|&x| x == 0.0),
                "id {id} must give a zero row"
            );
        }
    }

    let logits = rng.tensor(&[2, 3, v], 4.0);
    let labels: Vec<i32> = vec![1, -100, 49, 0, 7, -1];
    let lt = Tensor::i32(vec![2, 3], labels.clone());
    let l = run(Op::CrossEntropy { denom: 4 }, &[&logits, &lt]);
    assert!(l.shape.is_empty());
    let mut want = 0.0;
    for (r, &y) in labels.iter().enumerate() {
        if y >= 0 {
            let row = &f(&logits)[r * v..(r + 1) * v];
            want -= naive_softmax(row)[y as usize].ln();
        }
    }
    assert_close(f(&l), &[want / 4.0], 1e-6, 1e-6, "cross_entropy");
}

/// Element of a row-major tensor at a multi-index.
fn at(shape: &[usize], idx: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &s)| acc * s + i)
}

fn unravel(shape: &[usize], mut flat: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = flat % shape[d];
        flat /= shape[d];
    }
    idx
}

#[test]
fn transpose_slice_concat_repeat_match_naive() {
    let mut rng = Rng::new(33);
    let shape = [3, 1, 5, 7];
    let x = rng.tensor(&shape, 1.0);
    let xi = Tensor::i32(shape.to_vec(), (0..x.numel() as i32).collect());
    for perm in [
        vec![0, 1, 2, 3],
        vec![3, 2, 1, 0],
        vec![2, 0, 3, 1],
        vec![1, 3, 0, 2],
    ] {
        let y = run(Op::Transpose { perm: perm.clone() }, &[&x]);
        let yi = run(Op::Transpose { perm: perm.clone() }, &[&xi]);
        for o in 0..y.numel() {
            let oi = unravel(&y.shape, o);
            let mut ii = vec![0; 4];
            for (k, &p) in perm.iter().enumerate() {
                ii[p] = oi[k];
            }
            assert_eq!(f(&y)[o], f(&x)[at(&shape, &ii)], "transpose {perm:?}");
            assert_eq!(yi.as_i32().unwrap()[o], at(&shape, &ii) as i32);
        }
    }
    // Slice dim 2, 1..4.
    let s = run(
        Op::Slice {
            dim: 2,
            start: 1,
            len: 3,
        },
        &[&x],
    );
    for o in 0..s.numel() {
        let mut i = unravel(&s.shape, o);
        i[2] += 1;
        assert_eq!(f(&s)[o], f(&x)[at(&shape, &i)]);
    }
    // Concat along dim 3 of three pieces.
    let a = rng.tensor(&[3, 1, 5, 2], 1.0);
    let c = run(Op::Concat { dim: 3 }, &[&x, &a, &x]);
    assert_eq!(c.shape, vec![3, 1, 5, 16]);
    for o in 0..c.numel() {
        let i = unravel(&c.shape, o);
        let want = match i[3] {
            j if j < 7 => f(&x)[at(&shape, &[i[0], i[1], i[2], j])],
            j if j < 9 => f(&a)[at(&[3, 1, 5, 2], &[i[0], i[1], i[2], j - 7])],
            j => f(&x)[at(&shape, &[i[0], i[1], i[2], j - 9])],
        };
        assert_eq!(f(&c)[o], want);
    }
    // Repeat (repeat_interleave) dim 0 ×3.
    let r = run(Op::Repeat { dim: 0, times: 3 }, &[&xi]);
    for o in 0..r.numel() {
        let mut i = unravel(&r.shape, o);
        i[0] /= 3;
        assert_eq!(r.as_i32().unwrap()[o], at(&shape, &i) as i32);
    }
    // Reshape keeps elements.
    let re = run_declared(
        Op::Reshape,
        &[&x],
        Some(TensorType::plain(DType::F32, &[15, 7])),
    );
    assert_eq!(f(&re), f(&x));
}

#[test]
fn eval_op_rejects_ops_needing_a_rank_context() {
    let x = Tensor::f32(vec![2], vec![1.0, 2.0]);
    let ty = TensorType::plain(DType::F32, &[2]);
    let err = eval_op(&Op::AllReduce { axis: "tp".into() }, &[&x], &ty).unwrap_err();
    assert!(
        matches!(
            err,
            RuntimeError::Unsupported {
                op: "all_reduce",
                ..
            }
        ),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Checkpoints and the executor
// ---------------------------------------------------------------------------------------------

/// A tensor to write: name, dtype, shape, f32 values (converted when written).
struct Stored {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    values: Vec<f32>,
}

impl Stored {
    fn new(name: &str, dtype: Dtype, shape: &[usize], rng: &mut Rng) -> Stored {
        let n = shape.iter().product();
        let mut values = rng.vec(n, 1.0);
        if dtype == Dtype::BF16 {
            // Make the values bf16-representable so the checks can be exact.
            values
                .iter_mut()
                .for_each(|v| *v = bf16::from_f32(*v).to_f32());
        }
        Stored {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            values,
        }
    }
    fn bytes(&self) -> Vec<u8> {
        match self.dtype {
            Dtype::F32 => self.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::BF16 => self
                .values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            Dtype::I64 => self
                .values
                .iter()
                .flat_map(|v| (*v as i64).to_le_bytes())
                .collect(),
            other => panic!("test writes no {other:?}"),
        }
    }
}

fn write_safetensors(path: &Path, tensors: &[&Stored]) {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|t| t.bytes()).collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), b).expect("valid view"),
            )
        })
        .collect();
    let data = safetensors::serialize(views, None).expect("serialize");
    std::fs::write(path, data).expect("write checkpoint");
}

fn param(g: &mut Graph, src: ParamSource, shape: &[usize], name: &str) -> ValueId {
    g.add_typed(
        Op::Param(src),
        &[],
        Some(TensorType::plain(DType::F32, shape)),
        name,
    )
    .expect("param")
}

/// The tiny model: embedding, a fused-weight view, a transposed BF16 weight, and a stacked
/// BF16 expert weight read plain and transposed.
struct Tiny {
    dir: tempfile::TempDir,
    emb: Stored,
    fused: Stored,
    wt: Stored,
    experts: Vec<Stored>,
}

const V: usize = 11;
const H: usize = 6;

fn tiny() -> Tiny {
    let mut rng = Rng::new(40);
    let dir = tempfile::tempdir().expect("tempdir");
    let emb = Stored::new("emb", Dtype::F32, &[V, H], &mut rng);
    let fused = Stored::new("fused", Dtype::F32, &[14, H], &mut rng);
    let wt = Stored::new("wt", Dtype::BF16, &[5, H], &mut rng);
    let experts: Vec<Stored> = (0..3)
        .map(|i| Stored::new(&format!("exp.{i}.w"), Dtype::BF16, &[H, 4], &mut rng))
        .collect();
    let ids = Stored::new("ids", Dtype::I64, &[2], &mut rng);
    let mut all = vec![&emb, &fused, &wt, &ids];
    all.extend(&experts);
    write_safetensors(&dir.path().join("model.safetensors"), &all);
    Tiny {
        dir,
        emb,
        fused,
        wt,
        experts,
    }
}

/// The stored tensor `name`'s rows `start..start + len`: a view along dim 0.
fn rows_view(name: &str, start: usize, len: usize) -> ParamSource {
    ParamSource {
        view: Some(ParamView { dim: 0, start, len }),
        ..ParamSource::whole(name)
    }
}

fn tiny_graph() -> Graph {
    let mut g = Graph::new();
    let ids = g.input("input_ids", TensorType::plain(DType::I32, &[2, 3]));
    let emb = param(&mut g, ParamSource::whole("emb"), &[V, H], "emb");
    let x = g.add(Op::Embedding, &[emb, ids], "x").unwrap();
    let view = rows_view("fused", 6, 4);
    let wq = param(&mut g, view, &[4, H], "wq");
    let q = g
        .add(Op::MatMul { transpose_b: true }, &[x, wq], "q")
        .unwrap();
    let wt_src = ParamSource {
        transposed: true,
        ..ParamSource::whole("wt")
    };
    let wt = param(&mut g, wt_src, &[H, 5], "wt");
    let y = g
        .add(Op::MatMul { transpose_b: false }, &[x, wt], "y")
        .unwrap();
    let stacked = ParamSource {
        stack: Some(3),
        ..ParamSource::whole("exp.{}.w")
    };
    let ex = param(&mut g, stacked.clone(), &[3, H, 4], "ex");
    let ex_t = param(
        &mut g,
        ParamSource {
            transposed: true,
            ..stacked
        },
        &[3, 4, H],
        "ex_t",
    );
    let x4 = g
        .add_typed(
            Op::Reshape,
            &[x],
            Some(TensorType::plain(DType::F32, &[1, 2, 3, H])),
            "x4",
        )
        .unwrap();
    let xr = g.add(Op::Repeat { dim: 0, times: 3 }, &[x4], "xr").unwrap();
    let z = g
        .add(Op::MatMul { transpose_b: false }, &[xr, ex], "z")
        .unwrap();
    let z2 = g
        .add(Op::MatMul { transpose_b: true }, &[xr, ex_t], "z2")
        .unwrap();
    g.set_output("x", x);
    g.set_output("q", q);
    g.set_output("y", y);
    g.set_output("z", z);
    g.set_output("z2", z2);
    g
}

fn ids_input(ids: Vec<i32>) -> BTreeMap<String, Tensor> {
    BTreeMap::from([("input_ids".to_string(), Tensor::i32(vec![2, 3], ids))])
}

#[test]
fn execute_tiny_graph_with_view_stack_transposed_and_bf16() {
    let m = tiny();
    let w = Weights::open(m.dir.path()).expect("open dir");
    let g = tiny_graph();
    let ids = vec![0, 3, 10, 7, 7, 1];
    let out = execute(&g, &w, &ids_input(ids.clone()), &RankCtx::new()).expect("execute");

    let x: Vec<f32> = ids
        .iter()
        .flat_map(|&i| m.emb.values[i as usize * H..(i as usize + 1) * H].to_vec())
        .collect();
    assert_eq!(f(&out["x"]), &x[..]);
    // q = x · fused[6..10]ᵀ
    let wq = &m.fused.values[6 * H..10 * H];
    assert_close(
        f(&out["q"]),
        &naive_mm(&x, wq, 6, H, 4, true),
        1e-6,
        1e-6,
        "q",
    );
    // y = x · wtᵀ (stored [5, H], bf16)
    assert_close(
        f(&out["y"]),
        &naive_mm(&x, &m.wt.values, 6, H, 5, true),
        1e-6,
        1e-6,
        "y",
    );
    // z[e] = x · exp.e.w; z2 reads the same weights transposed twice.
    let mut want = Vec::new();
    for e in &m.experts {
        want.extend(naive_mm(&x, &e.values, 6, H, 4, false));
    }
    assert_eq!(out["z"].shape, vec![3, 2, 3, 4]);
    assert_close(f(&out["z"]), &want, 1e-6, 1e-6, "z");
    assert_close(f(&out["z2"]), &want, 1e-6, 1e-6, "z2");

    // The same through a cache, twice; identical sources would share a tensor.
    let params = load_params(&g, &w, &RankCtx::new()).expect("load");
    assert_eq!(params.num_tensors(), 5);
    for _ in 0..2 {
        let again =
            execute_with_params(&g, &params, &ids_input(ids.clone()), &RankCtx::new()).unwrap();
        assert_eq!(again, out);
    }
}

#[test]
fn weights_open_sharded_checkpoint_index() {
    let mut rng = Rng::new(41);
    let dir = tempfile::tempdir().unwrap();
    let a = Stored::new("a.weight", Dtype::F32, &[3, 5], &mut rng);
    let b = Stored::new("b.weight", Dtype::BF16, &[7], &mut rng);
    let c = Stored::new("c.weight", Dtype::F32, &[2, 2, 2], &mut rng);
    write_safetensors(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &[&a, &b],
    );
    write_safetensors(&dir.path().join("model-00002-of-00002.safetensors"), &[&c]);
    let index = serde_json::json!({
        "metadata": {"total_size": 0},
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00001-of-00002.safetensors",
            "c.weight": "model-00002-of-00002.safetensors",
        }
    });
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let w = Weights::open(dir.path()).expect("open sharded");
    assert_eq!(w.names(), vec!["a.weight", "b.weight", "c.weight"]);
    assert_eq!(w.shape("c.weight"), Some(vec![2, 2, 2]));
    assert_eq!(w.shape("nope"), None);
    for s in [&a, &b, &c] {
        let t = w.get(&s.name).unwrap();
        assert_eq!(t.shape, s.shape);
        assert_eq!(f(&t), &s.values[..], "{}", s.name);
    }
    // A single file opens directly too.
    let one = Weights::open(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    assert_eq!(one.names(), vec!["c.weight"]);
}

#[test]
fn load_shards_read_the_right_chunk() {
    let mut rng = Rng::new(42);
    let dir = tempfile::tempdir().unwrap();
    let w0 = Stored::new("w", Dtype::F32, &[6, 8], &mut rng);
    let f0 = Stored::new("fused", Dtype::BF16, &[12, 5], &mut rng);
    let ex: Vec<Stored> = (0..4)
        .map(|i| Stored::new(&format!("e.{i}"), Dtype::F32, &[2, 3], &mut rng))
        .collect();
    let mut all = vec![&w0, &f0];
    all.extend(&ex);
    let path = dir.path().join("m.safetensors");
    write_safetensors(&path, &all);
    let w = Weights::open(&path).unwrap();
    let shard = |dim, axis: &str, parts| ShardSpec {
        dim,
        axis: axis.into(),
        parts,
    };
    let ty = |s: &[usize]| TensorType::plain(DType::F32, s);

    // Transposed, column shard: graph layout wᵀ [8, 6], rank 1 of 2 along dim 1.
    let src = ParamSource {
        transposed: true,
        shards: vec![shard(1, "tp", 2)],
        ..ParamSource::whole("w")
    };
    let t = w.load(&src, &ty(&[8, 3]), &|_| Some((1, 2))).unwrap();
    for i in 0..8 {
        for j in 0..3 {
            assert_eq!(f(&t)[i * 3 + j], w0.values[(3 + j) * 8 + i]);
        }
    }
    // View of rows 4..10 of the fused tensor, sharded by tp (2) then dp (3) along dim 0.
    let src = ParamSource {
        shards: vec![shard(0, "tp", 2), shard(0, "dp", 3)],
        ..rows_view("fused", 4, 6)
    };
    let coords = |a: &str| {
        if a == "tp" {
            Some((1, 2))
        } else {
            Some((2, 3))
        }
    };
    let t = w.load(&src, &ty(&[1, 5]), &coords).unwrap();
    // Rows 4..10 → tp chunk 1 = rows 7..10 → dp chunk 2 = row 9.
    assert_eq!(f(&t), &f0.values[9 * 5..10 * 5]);
    // Stacked experts, expert-parallel: rank 1 of 2 holds experts 2 and 3.
    let src = ParamSource {
        stack: Some(4),
        shards: vec![shard(0, "ep", 2)],
        ..ParamSource::whole("e.{}")
    };
    let t = w.load(&src, &ty(&[2, 2, 3]), &|_| Some((1, 2))).unwrap();
    let want: Vec<f32> = ex[2].values.iter().chain(&ex[3].values).copied().collect();
    assert_eq!(f(&t), &want[..]);
    // A missing axis and a wrong axis size are errors.
    let src = ParamSource {
        shards: vec![shard(0, "tp", 2)],
        ..ParamSource::whole("w")
    };
    assert!(matches!(
        w.load(&src, &ty(&[3, 8]), &|_| None),
        Err(RuntimeError::MissingAxis { .. })
    ));
    assert!(matches!(
        w.load(&src, &ty(&[3, 8]), &|_| Some((0, 4))),
        Err(RuntimeError::AxisSize {
            expected: 2,
            found: 4,
            ..
        })
    ));
}

#[test]
fn missing_tensor_error_names_it() {
    let m = tiny();
    let w = Weights::open(m.dir.path().join("model.safetensors")).unwrap();
    let mut g = Graph::new();
    let p = param(
        &mut g,
        ParamSource::whole("lm_head.weight"),
        &[V, H],
        "lm_head",
    );
    g.set_output("w", p);
    let err = execute(&g, &w, &BTreeMap::new(), &RankCtx::new()).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::MissingTensor { name, .. } if name == "lm_head.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("lm_head.weight"));
    // A stacked parameter names the missing entry.
    let src = ParamSource {
        stack: Some(4),
        ..ParamSource::whole("exp.{}.w")
    };
    let err = w
        .load(&src, &TensorType::plain(DType::F32, &[4, H, 4]), &|_| None)
        .unwrap_err();
    assert!(
        matches!(&err, RuntimeError::MissingTensor { name, .. } if name == "exp.3.w"),
        "{err}"
    );
    // An integer tensor does not load as a float parameter.
    let err = w
        .load(
            &ParamSource::whole("ids"),
            &TensorType::plain(DType::F32, &[2]),
            &|_| None,
        )
        .unwrap_err();
    assert!(
        matches!(&err, RuntimeError::TensorDType { name, dtype } if name == "ids" && dtype == "I64"),
        "{err}"
    );
    // No checkpoint in a directory.
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        Weights::open(empty.path()),
        Err(RuntimeError::NoCheckpoint { .. })
    ));
}

#[test]
fn misshaped_tensor_error_names_tensor_and_shapes() {
    let m = tiny();
    let w = Weights::open(m.dir.path()).unwrap();
    let ty = |s: &[usize]| TensorType::plain(DType::F32, s);
    let expect = |src: ParamSource,
                  local: &[usize],
                  coords: &dyn Fn(&str) -> Option<(usize, usize)>,
                  name: &str,
                  e: &[usize],
                  fnd: &[usize]| {
        let err = w.load(&src, &ty(local), coords).unwrap_err();
        match &err {
            RuntimeError::TensorShape {
                name: n,
                expected,
                found,
            } => {
                assert_eq!(
                    (n.as_str(), &expected[..], &found[..]),
                    (name, e, fnd),
                    "{err}"
                );
            }
            other => panic!("expected TensorShape, got {other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(name)
                && msg.contains(&format!("{e:?}"))
                && msg.contains(&format!("{fnd:?}")),
            "{msg}"
        );
    };
    let none = |_: &str| None;
    // Plain: emb is [11, 6].
    expect(
        ParamSource::whole("emb"),
        &[11, 7],
        &none,
        "emb",
        &[11, 7],
        &[11, 6],
    );
    // Transposed: the graph wants [5, 6]ᵀ = [6, 5]; reported in the stored layout.
    expect(
        ParamSource {
            transposed: true,
            ..ParamSource::whole("wt")
        },
        &[7, 5],
        &none,
        "wt",
        &[5, 7],
        &[5, 6],
    );
    // Sharded: local [3, 6] × 4 parts = global [12, 6] against stored [11, 6].
    let src = ParamSource {
        shards: vec![ShardSpec {
            dim: 0,
            axis: "tp".into(),
            parts: 4,
        }],
        ..ParamSource::whole("emb")
    };
    expect(src, &[3, 6], &|_| Some((0, 4)), "emb", &[12, 6], &[11, 6]);
    // A view past the end: rows 10..16 of the [14, 6] fused tensor.
    let src = rows_view("fused", 10, 6);
    expect(src, &[6, 6], &none, "fused", &[16, 6], &[14, 6]);
    // Stack count differs from the parameter's leading dim.
    let src = ParamSource {
        stack: Some(3),
        ..ParamSource::whole("exp.{}.w")
    };
    expect(src, &[2, H, 4], &none, "exp.{}.w", &[2, H, 4], &[3, H, 4]);

    // Through execute, the error is the same.
    let mut g = Graph::new();
    let p = param(&mut g, ParamSource::whole("emb"), &[12, H], "emb");
    g.set_output("w", p);
    let err = execute(&g, &w, &BTreeMap::new(), &RankCtx::new()).unwrap_err();
    assert!(matches!(err, RuntimeError::TensorShape { .. }), "{err}");
}

#[test]
fn bf16_checkpoint_converts_and_bf16_params_round() {
    let m = tiny();
    let w = Weights::open(m.dir.path()).unwrap();
    let t = w.get("wt").unwrap();
    assert_eq!(f(&t), &m.wt.values[..]);
    // An f32 tensor loaded as a bf16 parameter is rounded to bf16 (kept as f32).
    let t = w
        .load(
            &ParamSource::whole("emb"),
            &TensorType::plain(DType::Bf16, &[V, H]),
            &|_| None,
        )
        .unwrap();
    let want: Vec<f32> = m
        .emb
        .values
        .iter()
        .map(|&v| bf16::from_f32(v).to_f32())
        .collect();
    assert_eq!(f(&t), &want[..]);
}

#[test]
fn token_out_of_range_is_reported_for_unsharded_tables() {
    let m = tiny();
    let w = Weights::open(m.dir.path()).unwrap();
    let g = tiny_graph();
    let err = execute(&g, &w, &ids_input(vec![0, 1, 2, 3, 4, 11]), &RankCtx::new()).unwrap_err();
    assert!(
        matches!(
            err,
            RuntimeError::TokenOutOfRange {
                id: 11,
                vocab: 11,
                batch: 1,
                pos: 2
            }
        ),
        "{err}"
    );
    let err = execute(&g, &w, &ids_input(vec![0, -1, 2, 3, 4, 5]), &RankCtx::new()).unwrap_err();
    assert!(
        matches!(
            err,
            RuntimeError::TokenOutOfRange {
                id: -1,
                batch: 0,
                pos: 1,
                ..
            }
        ),
        "{err}"
    );

    // Behind a RankOffset the ids are shard-local: out-of-range ids give zero rows.
    let one = One::new("vocab", false);
    let ctx = RankCtx::new().with_axis("vocab", &one);
    let mut g = Graph::new();
    let ids = g.input("input_ids", TensorType::plain(DType::I32, &[2, 3]));
    let local = g
        .add(
            Op::RankOffset {
                axis: "vocab".into(),
                stride: V,
            },
            &[ids],
            "local",
        )
        .unwrap();
    let emb = param(&mut g, ParamSource::whole("emb"), &[V, H], "emb");
    let x = g.add(Op::Embedding, &[emb, local], "x").unwrap();
    g.set_output("x", x);
    let out = execute(&g, &w, &ids_input(vec![0, 1, 2, 3, 4, 11]), &ctx).unwrap();
    assert!(f(&out["x"])[5 * H..].iter().all(|&v| v == 0.0));
}

#[test]
fn input_errors_name_the_input() {
    let m = tiny();
    let w = Weights::open(m.dir.path()).unwrap();
    let g = tiny_graph();
    let err = execute(&g, &w, &BTreeMap::new(), &RankCtx::new()).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::MissingInput { name } if name == "input_ids"),
        "{err}"
    );
    let bad = BTreeMap::from([("input_ids".to_string(), Tensor::i32(vec![3, 2], vec![0; 6]))]);
    let err = execute(&g, &w, &bad, &RankCtx::new()).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::InputShape { name, expected, found } if name == "input_ids" && expected == &[2, 3] && found == &[3, 2]),
        "{err}"
    );
    let bad = BTreeMap::from([(
        "input_ids".to_string(),
        Tensor::f32(vec![2, 3], vec![0.0; 6]),
    )]);
    let err = execute(&g, &w, &bad, &RankCtx::new()).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::InputDType { name, expected: DType::I32, found: "f32" } if name == "input_ids"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Collectives through execute
// ---------------------------------------------------------------------------------------------

/// A group of one rank; optionally every collective fails.
struct One {
    name: String,
    fail: bool,
}

impl One {
    fn new(name: &str, fail: bool) -> One {
        One {
            name: name.into(),
            fail,
        }
    }
    fn check(&self) -> Result<(), CommError> {
        if self.fail {
            Err(CommError::Transport("link down".into()))
        } else {
            Ok(())
        }
    }
}

impl Communicator for One {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn broadcast(&self, _buf: &mut [f32], _root: usize) -> Result<(), CommError> {
        self.check()
    }
    fn reduce(
        &self,
        send: &[f32],
        recv: &mut [f32],
        _op: ReduceOp,
        _root: usize,
    ) -> Result<(), CommError> {
        recv.copy_from_slice(send);
        self.check()
    }
    fn all_reduce(&self, _buf: &mut [f32], _op: ReduceOp) -> Result<(), CommError> {
        self.check()
    }
    fn gather(&self, send: &[f32], recv: &mut [f32], _root: usize) -> Result<(), CommError> {
        recv.copy_from_slice(send);
        self.check()
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        recv.copy_from_slice(send);
        self.check()
    }
    fn scatter(&self, send: &[f32], recv: &mut [f32], _root: usize) -> Result<(), CommError> {
        recv.copy_from_slice(send);
        self.check()
    }
    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        _op: ReduceOp,
    ) -> Result<(), CommError> {
        recv.copy_from_slice(send);
        self.check()
    }
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        recv.copy_from_slice(send);
        self.check()
    }
    fn send(&self, _buf: &[f32], _peer: usize) -> Result<(), CommError> {
        self.check()
    }
    fn recv(&self, _buf: &mut [f32], _peer: usize) -> Result<(), CommError> {
        self.check()
    }
}

/// Every collective of the IR over axis `tp` of `parts` ranks, on an input sharded along
/// dim 1; outputs name each stage.
fn collectives_graph(parts: usize) -> Graph {
    let mut g = Graph::new();
    let tp = || "tp".to_string();
    let mut input = |name: &str, dtype, shape: &[usize]| {
        let shards = vec![ShardSpec {
            dim: 1,
            axis: tp(),
            parts,
        }];
        let op = Op::Input {
            name: name.into(),
            shards,
        };
        let ty = TensorType::plain(dtype, shape);
        g.add_typed(op, &[], Some(ty), name).unwrap()
    };
    let x = input("x", DType::F32, &[2, 4 / parts, 6]);
    let ids = input("ids", DType::I32, &[2, 4 / parts]);
    let mut add = |op, from, name: &str| g.add(op, &[from], name).unwrap();
    let gather = |dim| Op::AllGather {
        axis: tp(),
        dim,
        parts,
    };
    let ag = add(gather(1), x, "ag");
    let rs = add(
        Op::ReduceScatter {
            axis: tp(),
            dim: 2,
            parts,
        },
        ag,
        "rs",
    );
    let a2a = add(
        Op::AllToAll {
            axis: tp(),
            split_dim: 2,
            concat_dim: 1,
            parts,
        },
        x,
        "a2a",
    );
    let ar = add(Op::AllReduce { axis: tp() }, x, "ar");
    let bc = add(
        Op::Broadcast {
            axis: tp(),
            root: parts - 1,
        },
        x,
        "bc",
    );
    let ls = add(
        Op::LocalSlice {
            axis: tp(),
            dim: 2,
            parts,
        },
        ag,
        "ls",
    );
    let ids_ag = add(gather(1), ids, "ids_ag");
    for (n, v) in [
        ("ag", ag),
        ("rs", rs),
        ("a2a", a2a),
        ("ar", ar),
        ("bc", bc),
        ("ls", ls),
        ("ids_ag", ids_ag),
    ] {
        g.set_output(n, v);
    }
    g
}

fn collective_inputs() -> BTreeMap<String, Tensor> {
    let mut rng = Rng::new(50);
    BTreeMap::from([
        ("x".to_string(), rng.tensor(&[2, 4, 6], 1.0)),
        // Large ids check that i32 data crosses the f32 communicator bit-exactly.
        (
            "ids".to_string(),
            Tensor::i32(
                vec![2, 4],
                vec![0, -1, i32::MAX, 7, 1 << 30, 5, -(1 << 29), 3],
            ),
        ),
    ])
}

#[test]
fn single_rank_collectives_are_identities() {
    let g = collectives_graph(1);
    let one = One::new("tp", false);
    let ctx = RankCtx::new().with_axis("tp", &one);
    let ins = collective_inputs();
    let out = execute_with_params(&g, &ParamCache::default(), &ins, &ctx).unwrap();
    for name in ["ag", "rs", "a2a", "ar", "bc", "ls"] {
        assert_eq!(out[name], ins["x"], "{name}");
    }
    assert_eq!(out["ids_ag"], ins["ids"]);
    // Without the axis in the context, the graph cannot run.
    let err = execute_with_params(&g, &ParamCache::default(), &ins, &RankCtx::new()).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::MissingAxis { axis } if axis == "tp"),
        "{err}"
    );
}

#[test]
fn comm_error_names_the_node_and_collective() {
    let g = collectives_graph(1);
    let bad = One::new("tp", true);
    let ctx = RankCtx::new().with_axis("tp", &bad);
    let err =
        execute_with_params(&g, &ParamCache::default(), &collective_inputs(), &ctx).unwrap_err();
    match &err {
        RuntimeError::Comm {
            node,
            name,
            op,
            source,
        } if matches!(**source, CommError::Transport(_)) => {
            assert_eq!((node.0, name.as_str(), *op), (2, "ag", "all_gather"));
        }
        other => panic!("expected a Comm error, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("%2") && msg.contains("all_gather") && msg.contains("link down"),
        "{msg}"
    );
}

#[test]
fn two_rank_collectives_on_inner_dims_match_the_global_result() {
    use shardc_runtime::comm::thread::group;
    let ins = collective_inputs();
    let comms = group("tp", 2, std::time::Duration::from_secs(20));
    let g = collectives_graph(2);
    let outs: Vec<BTreeMap<String, Tensor>> = on_threads(comms, |c| {
        let ctx = RankCtx::new().with_axis("tp", &c);
        execute_with_params(&g, &ParamCache::default(), &ins, &ctx).expect("rank runs")
    });
    let x = &ins["x"];
    let slice =
        |t: &Tensor, dim: usize, start: usize, len: usize| run(Op::Slice { dim, start, len }, &[t]);
    for (r, out) in outs.iter().enumerate() {
        // AllGather along dim 1 restores the global tensor (f32 and i32).
        assert_eq!(&out["ag"], x, "rank {r} ag");
        assert_eq!(out["ids_ag"], ins["ids"], "rank {r} ids_ag");
        // ReduceScatter of two equal copies along dim 2: twice this rank's chunk.
        let want: Vec<f64> = f(&slice(x, 2, 3 * r, 3))
            .iter()
            .map(|&v| 2.0 * v as f64)
            .collect();
        assert_close(f(&out["rs"]), &want, 0.0, 0.0, "rs");
        // AllToAll split dim 2, concat dim 1: the global rows, this rank's columns.
        assert_eq!(out["a2a"], slice(x, 2, 3 * r, 3), "rank {r} a2a");
        // AllReduce of the two row chunks.
        let (a, b) = (slice(x, 1, 0, 2), slice(x, 1, 2, 2));
        let want: Vec<f64> = f(&a)
            .iter()
            .zip(f(&b))
            .map(|(p, q)| (p + q) as f64)
            .collect();
        assert_close(f(&out["ar"]), &want, 0.0, 0.0, "ar");
        // Broadcast from rank 1: its row chunk everywhere.
        assert_eq!(out["bc"], b, "rank {r} bc");
        // LocalSlice of the gathered tensor along dim 2.
        assert_eq!(out["ls"], slice(x, 2, 3 * r, 3), "rank {r} ls");
    }
}
