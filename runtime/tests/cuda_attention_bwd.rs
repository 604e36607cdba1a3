//! The attention backward kernels (kernels/src/cu/attention_bwd.cu) on the GPU: the forward
//! with log-sum-exp (`attention_lse_*`), the `D = rowsum(dO * O)` pre-pass, the KV-tile
//! backward with its f32 atomic dQ, and the cast of dQ for bf16, launched directly with the
//! `shardc_kernels::launch` helpers. The gradients are checked against a double-precision
//! reference written here from the formulas of `runtime/src/cpu/train/attention.rs` (its
//! functions are crate-private): `dV = Pᵀ·dO`, `dS = P ⊙ (dO·Vᵀ − rowsum(P ⊙ dO·Vᵀ))`,
//! `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`, dK and dV summed over a KV head's query heads.
//! Rows that see nothing (a query with no visible key, a key no query sees) must be exactly 0.
mod cuda_common;

use cuda_common::{device, Rng};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;
use rayon::prelude::*;
use shardc_kernels::launch::{
    attention_bwd_launch, attention_bwd_prep_launch, attention_launch, elementwise_launch,
};
use shardc_runtime::cuda::CudaDevice;
use std::sync::Arc;

/// One backward problem.
#[derive(Debug, Clone, Copy)]
struct Case {
    b: usize,
    t: usize,
    s: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    /// 0 = no window.
    window: usize,
    q_offset: usize,
    /// Drop every third key of batch 0 and key 0 (so causal query 0 sees nothing), and every
    /// key of the last batch when B > 1.
    masked: bool,
}

impl Case {
    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
    fn visible(&self, mask: Option<&[f32]>, b: usize, t: usize, s: usize) -> bool {
        let tp = t + self.q_offset;
        (!self.causal || s <= tp)
            && (self.window == 0 || tp < s + self.window)
            && mask.is_none_or(|m| m[b * self.s + s] != 0.0)
    }
    fn mask(&self) -> Option<Vec<f32>> {
        self.masked.then(|| {
            let mut m = vec![1.0f32; self.b * self.s];
            for (i, x) in m.iter_mut().enumerate() {
                let (b, s) = (i / self.s, i % self.s);
                if (b == 0 && (s % 3 == 1 || s == 0)) || (self.b > 1 && b == self.b - 1) {
                    *x = 0.0;
                }
            }
            m
        })
    }
}

/// Gradients (and the forward's lse), f64 for the reference, f32 from the GPU.
struct Grads<T> {
    lse: Vec<T>,
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
}

/// Inputs: q, k, v, dO as f32 (already rounded to bf16 for a bf16 case).
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    mask: Option<Vec<f32>>,
}

/// The reference, one (batch, KV head) group per rayon task: its query heads' lse and dQ rows,
/// and its dK and dV rows.
fn reference(c: &Case, x: &Inputs) -> Grads<f64> {
    let (d, g) = (c.d, c.hq / c.hkv);
    let scale = f64::from(c.scale());
    let mask = x.mask.as_deref();
    let parts: Vec<_> = (0..c.b * c.hkv)
        .into_par_iter()
        .map(|bk| {
            let (b, hk) = (bk / c.hkv, bk % c.hkv);
            let (mut lse, mut dq) = (vec![f64::NEG_INFINITY; g * c.t], vec![0.0; g * c.t * d]);
            let (mut dk, mut dv) = (vec![0.0; c.s * d], vec![0.0; c.s * d]);
            let krow = |s: usize| &x.k[((b * c.s + s) * c.hkv + hk) * d..][..d];
            let vrow = |s: usize| &x.v[((b * c.s + s) * c.hkv + hk) * d..][..d];
            let dot = |a: &[f32], b: &[f32]| -> f64 {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| f64::from(*x) * f64::from(*y))
                    .sum()
            };
            for hi in 0..g {
                let h = hk * g + hi;
                for t in 0..c.t {
                    let row = (b * c.t + t) * c.hq + h;
                    let (q, dout) = (&x.q[row * d..][..d], &x.dout[row * d..][..d]);
                    let keys: Vec<usize> = (0..c.s).filter(|&s| c.visible(mask, b, t, s)).collect();
                    if keys.is_empty() {
                        continue;
                    }
                    let scores: Vec<f64> = keys.iter().map(|&s| dot(q, krow(s)) * scale).collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let l = m + scores.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                    lse[hi * c.t + t] = l;
                    let p: Vec<f64> = scores.iter().map(|x| (x - l).exp()).collect();
                    let dp: Vec<f64> = keys.iter().map(|&s| dot(dout, vrow(s))).collect();
                    let di: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                    for (j, &s) in keys.iter().enumerate() {
                        let ds = p[j] * (dp[j] - di);
                        for i in 0..d {
                            dq[(hi * c.t + t) * d + i] += scale * ds * f64::from(krow(s)[i]);
                            dk[s * d + i] += scale * ds * f64::from(q[i]);
                            dv[s * d + i] += p[j] * f64::from(dout[i]);
                        }
                    }
                }
            }
            (lse, dq, dk, dv)
        })
        .collect();
    let mut out = Grads {
        lse: vec![0.0; c.b * c.t * c.hq],
        dq: vec![0.0; c.b * c.t * c.hq * d],
        dk: vec![0.0; c.b * c.s * c.hkv * d],
        dv: vec![0.0; c.b * c.s * c.hkv * d],
    };
    for (bk, (lse, dq, dk, dv)) in parts.into_iter().enumerate() {
        let (b, hk) = (bk / c.hkv, bk % c.hkv);
        for hi in 0..g {
            for t in 0..c.t {
                let row = (b * c.t + t) * c.hq + hk * g + hi;
                out.lse[row] = lse[hi * c.t + t];
                out.dq[row * d..][..d].copy_from_slice(&dq[(hi * c.t + t) * d..][..d]);
            }
        }
        for s in 0..c.s {
            let kv = ((b * c.s + s) * c.hkv + hk) * d;
            out.dk[kv..][..d].copy_from_slice(&dk[s * d..][..d]);
            out.dv[kv..][..d].copy_from_slice(&dv[s * d..][..d]);
        }
    }
    out
}

fn launch_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    stream
        .clone_htod(v)
        .unwrap_or_else(|e| panic!("upload: {e}"))
}

fn download<T: DeviceRepr + Default + Clone>(stream: &Arc<CudaStream>, v: &CudaSlice<T>) -> Vec<T> {
    stream
        .clone_dtoh(v)
        .unwrap_or_else(|e| panic!("download: {e}"))
}

/// Runs forward-with-lse, prep, backward (and the dQ cast for bf16) on the GPU; element type
/// `E` is f32 or bf16, `to`/`from` convert.
fn run_gpu<E: DeviceRepr + Default + Clone + Copy + cudarc::driver::ValidAsZeroBits>(
    dev: &CudaDevice,
    c: &Case,
    x: &Inputs,
    dtype: &str,
    to: fn(f32) -> E,
    from: fn(E) -> f32,
) -> Grads<f32> {
    let stream = dev.new_stream().unwrap_or_else(|e| panic!("stream: {e}"));
    let conv = |v: &[f32]| -> Vec<E> { v.iter().map(|&f| to(f)).collect() };
    let (q, k, v, dout) = (
        upload(&stream, &conv(&x.q)),
        upload(&stream, &conv(&x.k)),
        upload(&stream, &conv(&x.v)),
        upload(&stream, &conv(&x.dout)),
    );
    let mask = x.mask.as_ref().map(|m| upload(&stream, m));
    let rows = c.b * c.t * c.hq;
    let (nq, nk) = (rows * c.d, c.b * c.s * c.hkv * c.d);
    let zeros = |n| {
        stream
            .alloc_zeros::<f32>(n)
            .unwrap_or_else(|e| panic!("alloc: {e}"))
    };
    let ezeros = |n| {
        stream
            .alloc_zeros::<E>(n)
            .unwrap_or_else(|e| panic!("alloc: {e}"))
    };
    let (lse, delta, dq_acc) = (zeros(rows), zeros(rows), zeros(nq));
    let (out, dq, dk, dv) = (ezeros(nq), ezeros(nq), ezeros(nk), ezeros(nk));
    let null = 0u64;
    let i = |n: usize| i32::try_from(n).expect("invariant: test sizes fit i32");
    let (b, t, s, hq, hkv, d) = (i(c.b), i(c.t), i(c.s), i(c.hq), i(c.hkv), i(c.d));
    let (causal, window, qoff, scale) =
        (i32::from(c.causal), i(c.window), i(c.q_offset), c.scale());
    let (rows64, nq64) = (rows as i64, nq as i64);
    let func = |name: String| {
        dev.function(&name)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let go = |cfg: LaunchConfig, what: &str, b: &mut cudarc::driver::LaunchArgs| {
        // SAFETY: each argument list below follows attention.cu's / attention_bwd.cu's /
        // cast.cu's documented signature in order; the buffers are live, sized for the case,
        // and the launch shapes come from the launch helpers.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(launch_err(what))
            .unwrap_or_else(|e| panic!("{e}"));
    };

    let f = func(format!("attention_lse_{dtype}"));
    let mut a = stream.launch_builder(&f);
    a.arg(&q).arg(&k).arg(&v).arg(&out);
    match &mask {
        Some(m) => a.arg(m),
        None => a.arg(&null),
    };
    a.arg(&b).arg(&t).arg(&s).arg(&hq).arg(&hkv).arg(&d);
    a.arg(&scale).arg(&causal).arg(&window).arg(&qoff).arg(&lse);
    let cfg = attention_launch(c.b, c.t, c.hq, c.hkv, c.d).unwrap_or_else(|e| panic!("{e}"));
    go(cfg, "attention_lse", &mut a);

    let f = func(format!("attention_bwd_prep_{dtype}"));
    let mut a = stream.launch_builder(&f);
    a.arg(&out)
        .arg(&dout)
        .arg(&delta)
        .arg(&dq_acc)
        .arg(&rows64)
        .arg(&d);
    go(
        attention_bwd_prep_launch(rows),
        "attention_bwd_prep",
        &mut a,
    );

    let f = func(format!("attention_bwd_{dtype}"));
    let mut a = stream.launch_builder(&f);
    a.arg(&q).arg(&k).arg(&v).arg(&dout).arg(&lse).arg(&delta);
    match &mask {
        Some(m) => a.arg(m),
        None => a.arg(&null),
    };
    a.arg(&dq_acc).arg(&dk).arg(&dv);
    a.arg(&b).arg(&t).arg(&s).arg(&hq).arg(&hkv).arg(&d);
    a.arg(&scale).arg(&causal).arg(&window).arg(&qoff);
    let cfg = attention_bwd_launch(c.b, c.s, c.hq, c.hkv, c.d).unwrap_or_else(|e| panic!("{e}"));
    go(cfg, "attention_bwd", &mut a);

    let dq = if dtype == "bf16" {
        let f = func("cast_f32_bf16".into());
        let mut a = stream.launch_builder(&f);
        a.arg(&dq_acc).arg(&dq).arg(&nq64);
        go(elementwise_launch(nq), "cast_f32_bf16", &mut a);
        download(&stream, &dq).into_iter().map(from).collect()
    } else {
        download(&stream, &dq_acc)
    };
    let back = |v: &CudaSlice<E>| download(&stream, v).into_iter().map(from).collect();
    Grads {
        lse: download(&stream, &lse),
        dq,
        dk: back(&dk),
        dv: back(&dv),
    }
}

/// Every value within `atol + rtol·|want|`; rows of `width` values whose `live` flag is false
/// exactly zero; and at least one live row (a check of zeros alone would test nothing).
fn assert_grad(
    what: &str,
    got: &[f32],
    want: &[f64],
    width: usize,
    live: &[bool],
    atol: f64,
    rtol: f64,
) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f64::NEG_INFINITY && f64::from(g) == w {
            continue;
        }
        let err = (f64::from(g) - w).abs();
        let within = err <= atol + rtol * w.abs(); // false for NaN
        if !within && worst.is_none_or(|(_, e)| err > e) {
            worst = Some((i, err));
        }
    }
    if let Some((i, err)) = worst {
        panic!(
            "{what}: at {i} got {} want {} (error {err:e})",
            got[i], want[i]
        );
    }
    assert!(live.iter().any(|&l| l), "{what}: no row sees anything");
    for (r, _) in live.iter().enumerate().filter(|(_, l)| !**l) {
        let row = &got[r * width..][..width];
        assert!(
            row.iter().all(|&x| x == 0.0),
            "{what}: row {r} sees nothing but is {row:?}"
        );
    }
    eprintln!("ok {what} ({} values)", got.len());
}

fn check_case(c: Case, bf: bool, rng: &mut Rng) {
    let dev = device();
    let round = |v: Vec<f32>| -> Vec<f32> {
        if bf {
            v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect()
        } else {
            v
        }
    };
    let x = Inputs {
        q: round(rng.vec(c.b * c.t * c.hq * c.d, 1.0)),
        k: round(rng.vec(c.b * c.s * c.hkv * c.d, 1.0)),
        v: round(rng.vec(c.b * c.s * c.hkv * c.d, 1.0)),
        dout: round(rng.vec(c.b * c.t * c.hq * c.d, 1.0)),
        mask: c.mask(),
    };
    let want = reference(&c, &x);
    let got = if bf {
        run_gpu(&dev, &c, &x, "bf16", bf16::from_f32, bf16::to_f32)
    } else {
        run_gpu(&dev, &c, &x, "f32", |f| f, |f| f)
    };
    let mask = x.mask.as_deref();
    let q_live: Vec<bool> = want.lse.iter().map(|&l| l != f64::NEG_INFINITY).collect();
    let kv_live: Vec<bool> = (0..c.b * c.s * c.hkv)
        .map(|r| {
            let (b, s) = (r / (c.s * c.hkv), (r / c.hkv) % c.s);
            (0..c.t).any(|t| c.visible(mask, b, t, s))
        })
        .collect();
    let (atol, rtol) = if bf { (2e-2, 2e-2) } else { (2e-4, 1e-3) };
    let what = format!("{c:?} {}", if bf { "bf16" } else { "f32" });
    // lse: -inf (not 0) where a query sees nothing, compared as a value.
    let all = vec![true; q_live.len()];
    assert_grad(
        &format!("lse {what}"),
        &got.lse,
        &want.lse,
        1,
        &all,
        1e-4,
        1e-5,
    );
    assert!(
        got.lse
            .iter()
            .zip(&q_live)
            .all(|(&l, &live)| live == (l != f32::NEG_INFINITY)),
        "lse {what}: -inf exactly for the queries that see nothing"
    );
    assert_grad(
        &format!("dQ {what}"),
        &got.dq,
        &want.dq,
        c.d,
        &q_live,
        atol,
        rtol,
    );
    assert_grad(
        &format!("dK {what}"),
        &got.dk,
        &want.dk,
        c.d,
        &kv_live,
        atol,
        rtol,
    );
    assert_grad(
        &format!("dV {what}"),
        &got.dv,
        &want.dv,
        c.d,
        &kv_live,
        atol,
        rtol,
    );
}

const fn case(b: usize, t: usize, s: usize, hq: usize, hkv: usize, d: usize) -> Case {
    Case {
        b,
        t,
        s,
        hq,
        hkv,
        d,
        causal: true,
        window: 0,
        q_offset: 0,
        masked: false,
    }
}

/// Llama-like prefill: Hq 32, Hkv 8, D 128, T = S = 512, causal, f32 and bf16.
#[test]
#[ignore = "needs a GPU"]
fn attention_backward_llama_shapes() {
    let mut rng = Rng::new(19);
    for bf in [false, true] {
        check_case(case(1, 512, 512, 32, 8, 128), bf, &mut rng);
    }
}

/// The masking rules and odd sizes: window, key mask with a fully masked batch, GQA 4:2,
/// a chunk (T < S, q_offset), non-causal cross attention, head_dim 40, decode.
#[test]
#[ignore = "needs a GPU"]
fn attention_backward_masks_gqa_and_odd_sizes() {
    let mut rng = Rng::new(20);
    let cases = [
        Case {
            window: 64,
            masked: true,
            ..case(2, 200, 200, 8, 2, 64)
        },
        Case {
            q_offset: 96,
            ..case(1, 100, 196, 4, 2, 40)
        },
        Case {
            causal: false,
            masked: true,
            ..case(2, 37, 150, 4, 4, 128)
        },
        Case {
            q_offset: 299,
            ..case(1, 1, 300, 32, 8, 128)
        },
    ];
    for c in cases {
        for bf in [false, true] {
            check_case(c, bf, &mut rng);
        }
    }
}
