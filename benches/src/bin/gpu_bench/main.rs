//! `gpu_bench`: shardc's CUDA backend on one GPU, as a table.
//!
//! Sections (each row: section, case, dtype, shape, ms, metric, value, % of ceiling):
//! - `copy`: device-to-device copy bandwidth at 512 MiB (bytes read + written), the ceiling
//!   of the memory-bound rows;
//! - `membound`: add+RMSNorm, SwiGLU (fused and unfused), RoPE and softmax at Llama-3-8B
//!   shapes (4096 tokens), *effective* GB/s (the minimal bytes the op must move, e.g. 4 tensors
//!   for add+RMSNorm, whether or not it is fused) against the copy;
//! - `gemm`: an 8192³ bf16 GEMM as the ceiling, then Llama-3-8B's layer GEMMs at 4096 tokens
//!   in bf16 and a 4096³ true-fp32 GEMM;
//! - `attention`: Llama-3-8B attention (32 query / 8 KV heads, head_dim 128, causal) at 4k and
//!   16k tokens, TFLOP/s (causal FLOPs), on the tensor-core kernel and on the scalar one; then
//!   one decode step (1 query against a 4k / 16k cache), GB/s of the K/V read, on the split-KV
//!   pair and on the ordinary kernel;
//! - `layer`: one Llama-3-8B decoder layer forward, bf16, batch 1 × 4096, fused and unfused;
//! - `moe`: Mixtral-8x7B's expert MLP (8 experts, top-2, SwiGLU) at 4096 tokens, bf16, its
//!   expert GEMMs on the routed tokens (`CudaOptions::routed_experts`) and dense, TFLOP/s of
//!   the routed work (what a dense run spends 4× on);
//! - `overlap`: `AgMatMul` vs all-gather then GEMM, and `MatMulRs` vs GEMM then
//!   reduce-scatter, on 2 virtual ranks of this GPU (local-gpu communicator), Llama-3-8B MLP
//!   shapes;
//! - `graphs`: the same layer's launches eager against a CUDA graph replay
//!   (`CudaOptions::graphs`), bf16 fused, at 16 tokens (launch-bound, as in decoding) and at the
//!   `layer` section's tokens: device ms per run, and the host's µs to enqueue one run
//!   (`host µs/run`, the launch overhead a graph removes).
//!
//! Times are CUDA-event milliseconds per run of the whole (one-op or one-layer) program on the
//! compute stream, after warm-up. Before it is timed, every program runs once and its outputs
//! are checked against the CPU reference (`check.rs`: on the leading rows, relative L2 below
//! 2e-2 in bf16, no NaN); a `# check` line reports each, and a failed check fails the section. Usage: `gpu_bench [--quick] [--only SECTION]`. Without a GPU
//! it prints why and exits with status 2. `benches/gpu/torch_peer.py` prints the same table
//! for PyTorch eager and torch.compile.

use check::{cpu_outputs, small_inputs, CheckError, Reference};
use cudarc::driver::{result as drv, sys, DevicePtr};
use shardc_compiler::ir::{
    AttnSpec, AttnWrt, DType, Float, Graph, Op, RopeScaling, RopeSpec, RopeStyle, ShardSpec,
    TensorType, UnaryOp, ValueId,
};
use shardc_runtime::cuda::comm::device::DeviceCommunicator;
use shardc_runtime::cuda::comm::local_gpu::group;
use shardc_runtime::cuda::{
    CudaDevice, CudaError, CudaOptions, CudaProgram, CudaRankCtx, GpuDType, ParamInit,
};
use shardc_runtime::Tensor;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod check;

/// Tokens (rows) of the CPU reference runs that check a program's leading rows.
const CHECK_TOKENS: usize = 64;

/// A section's failure: the GPU's, or an output that does not match the CPU reference.
#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Check(#[from] CheckError),
}

/// Llama-3-8B dimensions.
const HIDDEN: usize = 4096;
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const FFN: usize = 14336;
const MOE_EXPERTS: usize = 8;
const MOE_TOP_K: usize = 2;

struct Bench {
    dev: Arc<CudaDevice>,
    quick: bool,
    rows: Vec<Row>,
    copy_gbs: f64,
    gemm_tflops: f64,
}

/// What a row measures: the metric's unit, its value, and its share of a ceiling (%).
type Measure = (&'static str, f64, Option<f64>);

struct Row {
    section: &'static str,
    case: String,
    dtype: &'static str,
    shape: String,
    ms: f64,
    metric: &'static str,
    value: f64,
    ceiling: Option<f64>,
}

/// Deterministic inputs (xorshift), as host tensors.
struct Rng(u64);

impl Rng {
    fn tensor(&mut self, shape: &[usize], scale: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| {
                self.0 ^= self.0 >> 12;
                self.0 ^= self.0 << 25;
                self.0 ^= self.0 >> 27;
                let u = (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / 16_777_216.0;
                (2.0 * u - 1.0) * scale
            })
            .collect();
        Tensor::f32(shape.to_vec(), v)
    }
    fn positions(&mut self, b: usize, t: usize) -> Tensor {
        Tensor::i32(vec![b, t], (0..b).flat_map(|_| 0..t as i32).collect())
    }

    /// `ins` with a value for every parameter of `g` (its [`param`]s): matrices uniform in
    /// ±0.02, vectors (norm weights) in 1 ± 0.1.
    fn weights(
        &mut self,
        g: &Graph,
        mut ins: BTreeMap<String, Tensor>,
    ) -> BTreeMap<String, Tensor> {
        for v in g.ids() {
            let Op::Param(src) = &g.node(v).op else {
                continue;
            };
            let name = &src.name;
            if ins.contains_key(name) {
                continue;
            }
            let shape = g.ty(v).shape();
            let t = if shape.len() == 1 {
                let n = self.tensor(&shape, 0.1);
                let one = n.as_f32().expect("f32").iter().map(|x| 1.0 + x).collect();
                Tensor::f32(shape, one)
            } else {
                self.tensor(&shape, 0.02)
            };
            ins.insert(name.clone(), t);
        }
        ins
    }
}

fn ty(dt: DType, shape: &[usize]) -> TensorType {
    TensorType::plain(dt, shape)
}

/// A weight of the program: a parameter, uploaded at prepare time from the values
/// [`Rng::weights`] puts beside the inputs ([`ParamInit::Host`]); the CPU check reads the same
/// values as inputs (`check::cpu_outputs`).
fn param(g: &mut Graph, name: &str, shape: &[usize]) -> ValueId {
    g.param(name, ty(DType::F32, shape))
}

fn add(g: &mut Graph, op: Op, ins: &[ValueId], name: &str) -> ValueId {
    g.add(op, ins, name)
        .unwrap_or_else(|e| panic!("invariant: bench graph node `{name}` is well typed: {e}"))
}

fn reshape(g: &mut Graph, x: ValueId, shape: &[usize], name: &str) -> ValueId {
    g.add_typed(Op::Reshape, &[x], Some(ty(DType::F32, shape)), name)
        .unwrap_or_else(|e| panic!("invariant: reshape `{name}`: {e}"))
}

fn opts(dtype: GpuDType, fuse: bool) -> CudaOptions {
    CudaOptions {
        dtype,
        fuse,
        poison: false,
        timeout: Duration::from_secs(300),
        graphs: false,
        tensor_core_attention: true,
        split_kv_attention: true,
        routed_experts: true,
    }
}

impl Bench {
    fn iters(&self, heavy: bool) -> usize {
        match (self.quick, heavy) {
            (true, _) => 3,
            (false, true) => 10,
            (false, false) => 50,
        }
    }

    /// Milliseconds per run of `g` (unsharded) with `inputs`, after its outputs checked out
    /// against `reference`.
    fn time(
        &self,
        case: &str,
        (g, inputs, reference): (&Graph, &BTreeMap<String, Tensor>, &Reference),
        dtype: GpuDType,
        fuse: bool,
        heavy: bool,
    ) -> Result<f64, BenchError> {
        self.time_with(case, (g, inputs, reference), opts(dtype, fuse), heavy)
    }

    /// [`Bench::time`] with explicit options.
    fn time_with(
        &self,
        case: &str,
        (g, inputs, reference): (&Graph, &BTreeMap<String, Tensor>, &Reference),
        opts: CudaOptions,
        heavy: bool,
    ) -> Result<f64, BenchError> {
        let ctx = CudaRankCtx::new();
        let dt = opts.dtype;
        let mut p = self.prepare(&ctx, g, inputs, opts.clone())?;
        let got = p.run(inputs, &ctx)?;
        match reference {
            Reference::Smaller(small) => {
                check::finite(case, &got)?;
                let ins = small_inputs(small, inputs);
                let small_got = self.prepare(&ctx, small, &ins, opts)?.run(&ins, &ctx)?;
                let case = format!(
                    "{case} (at {} values)",
                    small_got.values().map(|t| t.numel()).sum::<usize>()
                );
                self.check(&case, &small_got, (small, &ins, &Reference::Whole), dt)?;
            }
            _ => self.check(case, &got, (g, inputs, reference), dt)?,
        }
        let iters = self.iters(heavy);
        Ok(p.time(&ctx, 2.min(iters), iters)?)
    }

    /// Checks a run's outputs `got` of `g` on `inputs` against the CPU reference (see
    /// `check.rs`) and prints the result as a `# check` line.
    fn check(
        &self,
        case: &str,
        got: &BTreeMap<String, Tensor>,
        (g, inputs, reference): (&Graph, &BTreeMap<String, Tensor>, &Reference),
        dt: GpuDType,
    ) -> Result<(), CheckError> {
        let (want, how) = match reference {
            Reference::Prefix(small) => {
                let ins = small_inputs(small, inputs);
                (cpu_outputs(case, small, &ins)?, "leading rows")
            }
            Reference::Whole | Reference::Smaller(_) => (cpu_outputs(case, g, inputs)?, "whole"),
        };
        let e = check::compare(case, got, &want, dt);
        match &e {
            Ok(e) => println!(
                "# check {case} {}: {how}, relative L2 {e:.2e} vs the CPU: ok",
                dt.name()
            ),
            Err(err) => println!("# check {case} {}: FAILED: {err}", dt.name()),
        }
        e.map(|_| ())
    }

    /// `g` prepared on `ctx` with its parameters from `inputs` (by name), `inputs` uploaded.
    fn prepare<'c>(
        &self,
        ctx: &CudaRankCtx<'c>,
        g: &Graph,
        inputs: &BTreeMap<String, Tensor>,
        opts: CudaOptions,
    ) -> Result<CudaProgram, CudaError> {
        let params = ParamInit::Host(inputs);
        let mut p = CudaProgram::prepare(self.dev.clone(), g, &params, ctx, opts)?;
        p.upload_inputs(inputs)?;
        Ok(p)
    }

    fn row(
        &mut self,
        section: &'static str,
        case: impl Into<String>,
        dtype: GpuDType,
        shape: impl Into<String>,
        ms: f64,
        (metric, value, ceiling): Measure,
    ) {
        let r = Row {
            section,
            case: case.into(),
            dtype: dtype.name(),
            shape: shape.into(),
            ms,
            metric,
            value,
            ceiling,
        };
        print_row(&r);
        self.rows.push(r);
    }

    /// `tf` TFLOP/s, against the bf16 GEMM ceiling.
    fn tflops(&self, tf: f64) -> Measure {
        ("TFLOP/s", tf, pct(tf, self.gemm_tflops))
    }

    /// `bytes` moved in `ms` milliseconds, in GB/s against the copy bandwidth.
    fn gbs(&self, bytes: f64, ms: f64) -> Measure {
        let gbs = bytes / (ms * 1e-3) / 1e9;
        ("GB/s", gbs, pct(gbs, self.copy_gbs))
    }

    /// The rows `<name> fused` and `<name> unfused` of `section`: `g` (of `shape`) checked
    /// against `reference` and timed with and without fusion, each measured by
    /// `measure(self, ms)`.
    fn fused_and_unfused(
        &mut self,
        (section, name): (&'static str, &str),
        program: (&Graph, &BTreeMap<String, Tensor>, &Reference),
        (dt, heavy): (GpuDType, bool),
        shape: String,
        measure: impl Fn(&Self, f64) -> Measure,
    ) -> Result<(), BenchError> {
        for fuse in [true, false] {
            let case = format!("{name} {}", if fuse { "fused" } else { "unfused" });
            let ms = self.time(&case, program, dt, fuse, heavy)?;
            let m = measure(self, ms);
            self.row(section, case, dt, shape.clone(), ms, m);
        }
        Ok(())
    }

    /// Device-to-device copy bandwidth (read + write bytes) of a 512 MiB buffer.
    fn copy(&mut self) -> Result<(), BenchError> {
        let bytes = if self.quick { 256 << 20 } else { 512 << 20 };
        let s = self.dev.new_stream()?;
        let drvr = |op: &'static str| {
            move |error| CudaError::Driver {
                op: op.to_string(),
                error,
            }
        };
        // SAFETY: scratch buffers whose contents are irrelevant to a bandwidth measurement.
        let (a, b) = unsafe { (s.alloc::<u8>(bytes), s.alloc::<u8>(bytes)) };
        let (a, b) = (a.map_err(drvr("alloc"))?, b.map_err(drvr("alloc"))?);
        let (pa, pb) = (a.device_ptr(&s).0, b.device_ptr(&s).0);
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let iters = self.iters(false);
        let copy = || {
            // SAFETY: both buffers hold `bytes` bytes of this context.
            unsafe { drv::memcpy_dtod_async(pb, pa, bytes, s.cu_stream()) }
        };
        for _ in 0..3 {
            copy().map_err(drvr("copy"))?;
        }
        let start = s.record_event(timing).map_err(drvr("record event"))?;
        for _ in 0..iters {
            copy().map_err(drvr("copy"))?;
        }
        let end = s.record_event(timing).map_err(drvr("record event"))?;
        let ms = start.elapsed_ms(&end).map_err(drvr("elapsed"))? as f64 / iters as f64;
        self.copy_gbs = 2.0 * bytes as f64 / (ms * 1e-3) / 1e9;
        let gbs = self.copy_gbs;
        self.row(
            "copy",
            "device-to-device",
            GpuDType::Bf16,
            format!("{} MiB", bytes >> 20),
            ms,
            ("GB/s", gbs, Some(100.0)),
        );
        Ok(())
    }

    /// Tokens (rows) of a memory-bound case moving `bytes_per_token` bytes per token: the
    /// fewest (a power of two) that move at least 256 MiB, so the row is not launch-bound and
    /// compares with the 512 MiB copy; 1024 with `--quick`.
    fn membound_tokens(&self, bytes_per_token: usize) -> usize {
        if self.quick {
            return 1024;
        }
        (256usize << 20)
            .div_ceil(bytes_per_token)
            .next_power_of_two()
    }

    /// Memory-bound kernels at Llama-3-8B widths, each moving at least 256 MiB, GB/s against
    /// the copy.
    fn membound(&mut self) -> Result<(), BenchError> {
        let mut rng = Rng(0x1234_5678);
        let dt = GpuDType::Bf16;
        let e = dt.size_bytes() as f64;
        // add + RMSNorm (fused: one launch writing the sum and the norm).
        let add_norm = |t: usize| {
            let mut g = Graph::new();
            let x = g.input("x", ty(DType::F32, &[1, t, HIDDEN]));
            let r = g.input("r", ty(DType::F32, &[1, t, HIDDEN]));
            let w = param(&mut g, "w", &[HIDDEN]);
            let s = add(&mut g, Op::Add, &[x, r], "sum");
            let n = add(&mut g, Op::RmsNorm { eps: Float(1e-5) }, &[s, w], "norm");
            g.set_output("sum", s);
            g.set_output("norm", n);
            g
        };
        let t = self.membound_tokens(4 * HIDDEN * 2);
        let g = add_norm(t);
        let ins = BTreeMap::from([
            ("x".to_string(), rng.tensor(&[1, t, HIDDEN], 1.0)),
            ("r".to_string(), rng.tensor(&[1, t, HIDDEN], 1.0)),
        ]);
        let ins = rng.weights(&g, ins);
        let check = Reference::Prefix(add_norm(CHECK_TOKENS));
        let elems = (t * HIDDEN) as f64;
        let bytes = 4.0 * elems * e; // minimal traffic: read x, r; write sum, norm
        let shape = format!("[{t},{HIDDEN}]");
        let section = ("membound", "add+rmsnorm");
        self.fused_and_unfused(section, (&g, &ins, &check), (dt, false), shape, |b, ms| {
            b.gbs(bytes, ms)
        })?;
        // SwiGLU: silu(gate) · up.
        let swiglu = |t: usize| {
            let mut g = Graph::new();
            let gate = g.input("gate", ty(DType::F32, &[1, t, FFN]));
            let up = g.input("up", ty(DType::F32, &[1, t, FFN]));
            let sl = add(&mut g, Op::Unary(UnaryOp::Silu), &[gate], "silu");
            let m = add(&mut g, Op::Mul, &[sl, up], "mul");
            g.set_output("y", m);
            g
        };
        let t = self.membound_tokens(3 * FFN * 2);
        let g = swiglu(t);
        let ins = BTreeMap::from([
            ("gate".to_string(), rng.tensor(&[1, t, FFN], 2.0)),
            ("up".to_string(), rng.tensor(&[1, t, FFN], 2.0)),
        ]);
        let check = Reference::Prefix(swiglu(CHECK_TOKENS));
        let elems = (t * FFN) as f64;
        let bytes = 3.0 * elems * e; // minimal traffic: read gate, up; write out
        let shape = format!("[{t},{FFN}]");
        let section = ("membound", "swiglu");
        self.fused_and_unfused(section, (&g, &ins, &check), (dt, false), shape, |b, ms| {
            b.gbs(bytes, ms)
        })?;
        // RoPE on the query heads.
        let rope = |t: usize| {
            let mut g = Graph::new();
            let q = g.input("q", ty(DType::F32, &[1, t, HEADS, HEAD_DIM]));
            let pos = g.input("pos", ty(DType::I32, &[1, t]));
            let y = add(&mut g, Op::Rope(llama3_rope()), &[q, pos], "rope");
            g.set_output("y", y);
            g
        };
        let t = self.membound_tokens(2 * HEADS * HEAD_DIM * 2);
        let g = rope(t);
        let ins = BTreeMap::from([
            ("q".to_string(), rng.tensor(&[1, t, HEADS, HEAD_DIM], 1.0)),
            ("pos".to_string(), rng.positions(1, t)),
        ]);
        let check = Reference::Prefix(rope(CHECK_TOKENS));
        let ms = self.time("rope", (&g, &ins, &check), dt, true, false)?;
        let measure = self.gbs(2.0 * (t * HEADS * HEAD_DIM) as f64 * e, ms);
        let shape = format!("[{t},{HEADS},{HEAD_DIM}]");
        self.row("membound", "rope", dt, shape, ms, measure);
        // Softmax over 4096-wide rows.
        let softmax = |rows: usize| {
            let mut g = Graph::new();
            let x = g.input("x", ty(DType::F32, &[rows, 4096]));
            let y = add(&mut g, Op::Softmax, &[x], "softmax");
            g.set_output("y", y);
            g
        };
        let rows = self.membound_tokens(2 * 4096 * 2);
        let g = softmax(rows);
        let ins = BTreeMap::from([("x".to_string(), rng.tensor(&[rows, 4096], 4.0))]);
        let check = Reference::Prefix(softmax(CHECK_TOKENS));
        let ms = self.time("softmax", (&g, &ins, &check), dt, true, false)?;
        let measure = self.gbs(2.0 * (rows * 4096) as f64 * e, ms);
        let shape = format!("[{rows},4096]");
        self.row("membound", "softmax", dt, shape, ms, measure);
        Ok(())
    }

    /// One GEMM `[m,k]·[n,k]ᵀ` in TFLOP/s.
    fn gemm_case(
        &mut self,
        name: &str,
        (m, k, n): (usize, usize, usize),
        dt: GpuDType,
    ) -> Result<(f64, f64), BenchError> {
        let build = |m: usize| {
            let mut g = Graph::new();
            let a = g.input("a", ty(DType::F32, &[m, k]));
            let w = param(&mut g, "w", &[n, k]);
            let y = add(&mut g, Op::MatMul { transpose_b: true }, &[a, w], "y");
            g.set_output("y", y);
            g
        };
        let g = build(m);
        let mut rng = Rng(99);
        let ins = BTreeMap::from([("a".to_string(), rng.tensor(&[m, k], 1.0))]);
        let ins = rng.weights(&g, ins);
        let check = Reference::Prefix(build(CHECK_TOKENS.min(m)));
        let ms = self.time(name, (&g, &ins, &check), dt, true, true)?;
        Ok((ms, tflops(2.0 * (m * n * k) as f64, ms)))
    }

    fn gemm(&mut self) -> Result<(), BenchError> {
        let big = if self.quick { 4096 } else { 8192 };
        let (ms, tf) = self.gemm_case("gemm ceiling", (big, big, big), GpuDType::Bf16)?;
        self.gemm_tflops = tf;
        self.row(
            "gemm",
            "ceiling",
            GpuDType::Bf16,
            format!("{big}x{big}x{big}"),
            ms,
            ("TFLOP/s", tf, Some(100.0)),
        );
        let t = if self.quick { 1024 } else { 4096 };
        let qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM;
        for (name, n, k) in [
            ("qkv_proj", qkv, HIDDEN),
            ("o_proj", HIDDEN, HIDDEN),
            ("gate_up_proj", 2 * FFN, HIDDEN),
            ("down_proj", HIDDEN, FFN),
        ] {
            let (ms, tf) = self.gemm_case(name, (t, k, n), GpuDType::Bf16)?;
            let measure = self.tflops(tf);
            self.row(
                "gemm",
                name,
                GpuDType::Bf16,
                format!("{t}x{k}x{n}"),
                ms,
                measure,
            );
        }
        let f = if self.quick { 1024 } else { 4096 };
        let (ms, tf) = self.gemm_case("gemm fp32", (f, f, f), GpuDType::F32)?;
        self.row(
            "gemm",
            "fp32 (no TF32)",
            GpuDType::F32,
            format!("{f}x{f}x{f}"),
            ms,
            ("TFLOP/s", tf, None),
        );
        Ok(())
    }

    fn attention(&mut self) -> Result<(), BenchError> {
        let lens: &[usize] = if self.quick { &[1024] } else { &[4096, 16384] };
        for &t in lens {
            let (g, ins) = attention_graph(t, t, 0xabc);
            let check = Reference::Prefix(attention_graph(CHECK_TOKENS, CHECK_TOKENS, 0).0);
            // The tensor-core kernel (attention_tc_bf16), then the scalar one (attention_bf16).
            for (tensor_core, kernel) in [(true, "tensor cores"), (false, "scalar")] {
                let run = CudaOptions {
                    tensor_core_attention: tensor_core,
                    split_kv_attention: false,
                    ..opts(GpuDType::Bf16, true)
                };
                let case = format!("attention causal {}k {kernel}", t / 1024);
                let ms = self.time_with(&case, (&g, &ins, &check), run, true)?;
                // Causal: half of the 4·T·S·D·H multiply-adds of full attention.
                let flops = 2.0 * (HEADS * t * t * HEAD_DIM) as f64;
                let tf = tflops(flops, ms);
                let measure = self.tflops(tf);
                self.row(
                    "attention",
                    format!("causal {}k, {kernel}", t / 1024),
                    GpuDType::Bf16,
                    format!("1x{t} h{HEADS}/{KV_HEADS} d{HEAD_DIM}"),
                    ms,
                    measure,
                );
            }
        }
        for &t in lens {
            self.attention_backward(t)?;
        }
        for &s in lens {
            self.decode_attention(s)?;
        }
        Ok(())
    }

    /// The training backward of causal attention at `t` tokens: `AttentionProbs` and its
    /// three gradients, which the planner runs as one FlashAttention-2 group (dQ, dK, dV; the
    /// probabilities never stored).
    ///
    /// - Backward alone, with no forward node in the program: the group runs the forward again
    ///   for its output and log-sum-exp, on the tensor-core kernel and on the scalar one.
    ///   TFLOP/s of 2.5× the causal forward's FLOPs (FlashAttention-2's accounting of the
    ///   backward alone), the recomputed forward included in the time.
    /// - Forward and backward, as a training step has them: the forward attention keeps its
    ///   output and lse rows in its slot and the group reads them (no forward run twice), on
    ///   tensor cores. TFLOP/s of 3.5× the causal forward's FLOPs.
    fn attention_backward(&mut self, t: usize) -> Result<(), BenchError> {
        let both: &[(bool, &str)] = &[(true, "tensor cores"), (false, "scalar")];
        for (forward, kernels) in [(false, both), (true, &both[..1])] {
            let (g, ins) = attention_bwd_graph(t, 0xb4c, forward);
            let check = Reference::Smaller(attention_bwd_graph(256, 0, forward).0);
            let what = if forward { "fwd+bwd" } else { "bwd" };
            let passes = if forward { 3.5 } else { 2.5 };
            for &(tensor_core, kernel) in kernels {
                let run = CudaOptions {
                    tensor_core_attention: tensor_core,
                    ..opts(GpuDType::Bf16, true)
                };
                let case = format!("attention {what} {}k {kernel}", t / 1024);
                let ms = self.time_with(&case, (&g, &ins, &check), run, true)?;
                let flops = passes * 2.0 * (HEADS * t * t * HEAD_DIM) as f64;
                let measure = self.tflops(tflops(flops, ms));
                self.row(
                    "attention",
                    format!("{what} causal {}k, {kernel}", t / 1024),
                    GpuDType::Bf16,
                    format!("1x{t} h{HEADS}/{KV_HEADS} d{HEAD_DIM}"),
                    ms,
                    measure,
                );
            }
        }
        Ok(())
    }

    /// One decode step's attention (1 query, causal, `q_offset = S - 1`) against an `s`-key
    /// cache, on the split-KV pair (`attention_decode_bf16`) and on the ordinary kernel; GB/s of
    /// the K and V cache read once.
    fn decode_attention(&mut self, s: usize) -> Result<(), BenchError> {
        let (g, ins) = attention_graph(1, s, 0xdec0de);
        for (split, kernel) in [(true, "split-KV"), (false, "non-split")] {
            let run = CudaOptions {
                split_kv_attention: split,
                ..opts(GpuDType::Bf16, true)
            };
            let case = format!("attention decode {}k {kernel}", s / 1024);
            let ms = self.time_with(&case, (&g, &ins, &Reference::Whole), run, false)?;
            let bytes = 2.0 * (s * KV_HEADS * HEAD_DIM * 2) as f64;
            let measure = self.gbs(bytes, ms);
            self.row(
                "attention",
                format!("decode {}k, {kernel}", s / 1024),
                GpuDType::Bf16,
                format!("1x1 s{s} h{HEADS}/{KV_HEADS} d{HEAD_DIM}"),
                ms,
                measure,
            );
        }
        Ok(())
    }

    fn layer(&mut self) -> Result<(), BenchError> {
        let t = if self.quick { 1024 } else { 4096 };
        let (g, ins) = layer_program(t);
        let check = Reference::Prefix(llama_layer(CHECK_TOKENS));
        let flops = layer_flops(t);
        let section = ("layer", "llama-3-8b layer");
        let run = (GpuDType::Bf16, true);
        let shape = format!("1x{t}");
        self.fused_and_unfused(section, (&g, &ins, &check), run, shape, |b, ms| {
            b.tflops(tflops(flops, ms))
        })?;
        Ok(())
    }

    /// Mixtral-8x7B's expert MLP with its expert GEMMs on the routed tokens and dense.
    fn moe(&mut self) -> Result<(), BenchError> {
        let t = if self.quick { 1024 } else { 4096 };
        let g = moe_block(t);
        let mut rng = Rng(0x3e);
        let ins = BTreeMap::from([
            ("x".to_string(), rng.tensor(&[1, t, HIDDEN], 1.0)),
            ("logits".to_string(), rng.tensor(&[1, t, MOE_EXPERTS], 2.0)),
        ]);
        let ins = rng.weights(&g, ins);
        let check = Reference::Prefix(moe_block(CHECK_TOKENS));
        // The routed work: each token through top-k experts' three GEMMs.
        let flops = 2.0 * (t * MOE_TOP_K * 3 * HIDDEN * FFN) as f64;
        for routed in [true, false] {
            let case = format!(
                "mixtral experts {}",
                if routed { "routed" } else { "dense" }
            );
            let o = CudaOptions {
                routed_experts: routed,
                ..opts(GpuDType::Bf16, true)
            };
            let ms = self.time_with(&case, (&g, &ins, &check), o, true)?;
            let m = self.tflops(tflops(flops, ms));
            self.row("moe", case, GpuDType::Bf16, format!("1x{t}"), ms, m);
        }
        Ok(())
    }

    /// One layer eager against its CUDA graph replay: a row of device ms per run and a row of
    /// host µs per enqueue for each.
    fn graphs(&mut self) -> Result<(), BenchError> {
        let big = if self.quick { 1024 } else { 4096 };
        for t in [16, big] {
            let (g, ins) = layer_program(t);
            let check = Reference::Prefix(llama_layer(CHECK_TOKENS.min(t)));
            let iters = self.iters(t == big);
            for graphs in [false, true] {
                let ctx = CudaRankCtx::new();
                let o = CudaOptions {
                    graphs,
                    ..opts(GpuDType::Bf16, true)
                };
                let mut p = self.prepare(&ctx, &g, &ins, o)?;
                // Two warm-up runs: eager, then (graph mode) the capture.
                let ms = p.time(&ctx, 2, iters)?;
                if graphs && !p.has_graph() {
                    eprintln!("gpu_bench: graphs: the layer at {t} tokens was not captured");
                }
                let start = Instant::now();
                for _ in 0..iters {
                    p.enqueue(&ctx)?;
                }
                let host_us = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
                p.synchronize(&ctx)?;
                let case = format!("layer {}", if graphs { "graph replay" } else { "eager" });
                // What the last (replayed) run left in the outputs.
                let what = format!("{case} {t} tokens");
                self.check(&what, &p.outputs()?, (&g, &ins, &check), GpuDType::Bf16)?;
                let shape = format!("1x{t}");
                self.row(
                    "graphs",
                    case.clone(),
                    GpuDType::Bf16,
                    shape.clone(),
                    ms,
                    ("ms", ms, None),
                );
                self.row(
                    "graphs",
                    case,
                    GpuDType::Bf16,
                    shape,
                    ms,
                    ("host µs/run", host_us, None),
                );
            }
        }
        Ok(())
    }

    /// Collective matmuls vs their unfused forms on 2 virtual ranks (local-gpu).
    fn overlap(&mut self) -> Result<(), BenchError> {
        let t = if self.quick { 1024 } else { 4096 };
        let parts = 2;
        let f = FFN / parts;
        let tp = || "tp".to_string();
        let shard = vec![ShardSpec {
            dim: 1,
            axis: tp(),
            parts,
        }];
        let mut rng = Rng(0x55);
        let x_global = rng.tensor(&[1, t, HIDDEN], 1.0);
        let m_global = rng.tensor(&[1, t, f], 1.0);
        // AgMatMul and AllGather + MatMul: x [1, t/2, H] per rank → [1, t, F/2].
        let ag = |fused: bool| {
            let mut g = Graph::new();
            let x = g
                .add_typed(
                    Op::Input {
                        name: "x".into(),
                        shards: shard.clone(),
                    },
                    &[],
                    Some(ty(DType::F32, &[1, t / parts, HIDDEN])),
                    "x",
                )
                .expect("invariant: input");
            let w = param(&mut g, "w_up", &[f, HIDDEN]);
            let y = if fused {
                add(
                    &mut g,
                    Op::AgMatMul {
                        axis: tp(),
                        dim: 1,
                        parts,
                        transpose_b: true,
                    },
                    &[x, w],
                    "agmm",
                )
            } else {
                let xg = add(
                    &mut g,
                    Op::AllGather {
                        axis: tp(),
                        dim: 1,
                        parts,
                    },
                    &[x],
                    "ag",
                );
                add(&mut g, Op::MatMul { transpose_b: true }, &[xg, w], "mm")
            };
            g.set_output("y", y);
            g
        };
        // MatMulRs and MatMul + ReduceScatter: m [1, t, F/2] → [1, t/2, H].
        let rs = |fused: bool| {
            let mut g = Graph::new();
            let m = g.input("m", ty(DType::F32, &[1, t, f]));
            let w = param(&mut g, "w_down", &[HIDDEN, f]);
            let y = if fused {
                add(
                    &mut g,
                    Op::MatMulRs {
                        axis: tp(),
                        dim: 1,
                        parts,
                        transpose_b: true,
                    },
                    &[m, w],
                    "mmrs",
                )
            } else {
                let p = add(&mut g, Op::MatMul { transpose_b: true }, &[m, w], "mm");
                add(
                    &mut g,
                    Op::ReduceScatter {
                        axis: tp(),
                        dim: 1,
                        parts,
                    },
                    &[p],
                    "rs",
                )
            };
            g.set_output("y", y);
            g
        };
        // The CPU references of rank 0's output on the leading rows: the whole product for the
        // gathers; for the scatters twice it (both ranks hold the same `m`), rank 0's rows.
        let reference = |gather: bool| {
            let mut g = Graph::new();
            let (input, w, k, n) = if gather {
                ("x", "w_up", HIDDEN, f)
            } else {
                ("m", "w_down", f, HIDDEN)
            };
            let x = g.input(input, ty(DType::F32, &[1, CHECK_TOKENS, k]));
            let w = param(&mut g, w, &[n, k]);
            let y = add(&mut g, Op::MatMul { transpose_b: true }, &[x, w], "y");
            let y = if gather {
                y
            } else {
                add(&mut g, Op::Scale(Float(2.0)), &[y], "y2")
            };
            g.set_output("y", y);
            g
        };
        let gemm_flops = 2.0 * (t * f * HIDDEN) as f64;
        for (label, g, (input, global)) in [
            ("ag+gemm", ag(false), ("x", &x_global)),
            ("AgMatMul", ag(true), ("x", &x_global)),
            ("gemm+rs", rs(false), ("m", &m_global)),
            ("MatMulRs", rs(true), ("m", &m_global)),
        ] {
            let ins = rng.weights(&g, BTreeMap::from([(input.to_string(), global.clone())]));
            let (ms, rank0) = self.time_ranks(&g, &ins, parts)?;
            let check = Reference::Prefix(reference(input == "x"));
            let case = format!("tp=2 {label} (rank 0)");
            self.check(&case, &rank0, (&g, &ins, &check), GpuDType::Bf16)?;
            let tf = tflops(gemm_flops, ms);
            let measure = self.tflops(tf);
            self.row(
                "overlap",
                format!("tp=2 {label}"),
                GpuDType::Bf16,
                format!("{t}x{HIDDEN}x{f}"),
                ms,
                measure,
            );
        }
        Ok(())
    }

    /// Milliseconds per run of `g` on `parts` virtual ranks (the slowest rank), and rank 0's
    /// outputs of a first run.
    fn time_ranks(
        &self,
        g: &Graph,
        inputs: &BTreeMap<String, Tensor>,
        parts: usize,
    ) -> Result<(f64, BTreeMap<String, Tensor>), CudaError> {
        type Timed = (f64, BTreeMap<String, Tensor>);
        let comms = group(&self.dev, "tp", parts, Duration::from_secs(300));
        let iters = self.iters(true);
        let results: Vec<Result<Timed, CudaError>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let ctx = CudaRankCtx::new().with_axis("tp", &c as &dyn DeviceCommunicator);
                        let mut p = self.prepare(&ctx, g, inputs, opts(GpuDType::Bf16, true))?;
                        let r = p.barrier(&ctx).and_then(|()| {
                            let out = p.run(inputs, &ctx)?;
                            Ok((p.time(&ctx, 2.min(iters), iters)?, out))
                        });
                        if r.is_err() {
                            c.abort("a rank failed");
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or(Err(CudaError::NoDevice {
                        reason: "a rank panicked".into(),
                    }))
                })
                .collect()
        });
        let mut worst = 0f64;
        let mut rank0 = None;
        for r in results {
            let (ms, out) = r?;
            worst = worst.max(ms);
            rank0.get_or_insert(out);
        }
        Ok((worst, rank0.unwrap_or_default()))
    }
}

/// TFLOP/s of `flops` in `ms` milliseconds.
fn tflops(flops: f64, ms: f64) -> f64 {
    flops / (ms * 1e-3) / 1e12
}

fn pct(v: f64, ceiling: f64) -> Option<f64> {
    (ceiling > 0.0).then(|| 100.0 * v / ceiling)
}

fn llama3_rope() -> RopeSpec {
    RopeSpec {
        theta: Float(500_000.0),
        style: RopeStyle::Half,
        scaling: Some(RopeScaling::Llama3 {
            factor: Float(8.0),
            low_freq_factor: Float(1.0),
            high_freq_factor: Float(4.0),
            original_max_positions: 8192,
        }),
    }
}

/// Mixtral-8x7B's sparse MLP block for `t` tokens (batch 1): router (top-2 of 8, normalised)
/// on given logits, dispatch, SwiGLU experts (`w1`, `w3` `[E, F, H]`, `w2` `[E, H, F]`, all
/// read transposed as stored), combine.
fn moe_block(t: usize) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", ty(DType::F32, &[1, t, HIDDEN]));
    let logits = g.input("logits", ty(DType::F32, &[1, t, MOE_EXPERTS]));
    let router = Op::Router {
        top_k: MOE_TOP_K,
        normalize: true,
    };
    let gates = add(&mut g, router, &[logits], "gates");
    let d = add(&mut g, Op::Dispatch, &[x, gates], "dispatch");
    let mm = Op::MatMul { transpose_b: true };
    let w1 = param(&mut g, "w1", &[MOE_EXPERTS, FFN, HIDDEN]);
    let w3 = param(&mut g, "w3", &[MOE_EXPERTS, FFN, HIDDEN]);
    let w2 = param(&mut g, "w2", &[MOE_EXPERTS, HIDDEN, FFN]);
    let gate = add(&mut g, mm.clone(), &[d, w1], "gate");
    let up = add(&mut g, mm.clone(), &[d, w3], "up");
    let act = add(&mut g, Op::Unary(UnaryOp::Silu), &[gate], "act");
    let m = add(&mut g, Op::Mul, &[act, up], "gate_mul");
    let down = add(&mut g, mm, &[m, w2], "down");
    let y = add(&mut g, Op::Combine, &[down, gates], "combine");
    g.set_output("y", y);
    g
}

/// One Llama-3-8B decoder layer for `t` tokens (batch 1).
fn llama_layer(t: usize) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", ty(DType::F32, &[1, t, HIDDEN]));
    let pos = g.input("pos", ty(DType::I32, &[1, t]));
    let eps = Float(1e-5);
    let ln1 = param(&mut g, "ln1", &[HIDDEN]);
    let n1 = add(&mut g, Op::RmsNorm { eps }, &[x, ln1], "attn_norm");
    let lin = |g: &mut Graph, x: ValueId, n: usize, k: usize, name: &str| {
        let w = param(g, &format!("{name}.weight"), &[n, k]);
        add(g, Op::MatMul { transpose_b: true }, &[x, w], name)
    };
    let q = lin(&mut g, n1, HEADS * HEAD_DIM, HIDDEN, "q_proj");
    let k = lin(&mut g, n1, KV_HEADS * HEAD_DIM, HIDDEN, "k_proj");
    let v = lin(&mut g, n1, KV_HEADS * HEAD_DIM, HIDDEN, "v_proj");
    let q = reshape(&mut g, q, &[1, t, HEADS, HEAD_DIM], "q");
    let k = reshape(&mut g, k, &[1, t, KV_HEADS, HEAD_DIM], "k");
    let v = reshape(&mut g, v, &[1, t, KV_HEADS, HEAD_DIM], "v");
    let q = add(&mut g, Op::Rope(llama3_rope()), &[q, pos], "q_rope");
    let k = add(&mut g, Op::Rope(llama3_rope()), &[k, pos], "k_rope");
    let spec = AttnSpec {
        causal: true,
        window: None,
        scale: Float(1.0 / (HEAD_DIM as f32).sqrt()),
        indexed: false,
    };
    let a = add(&mut g, Op::Attention(spec), &[q, k, v], "attn");
    let a = reshape(&mut g, a, &[1, t, HIDDEN], "attn_flat");
    let o = lin(&mut g, a, HIDDEN, HIDDEN, "o_proj");
    let h = add(&mut g, Op::Add, &[x, o], "attn_residual");
    let ln2 = param(&mut g, "ln2", &[HIDDEN]);
    let n2 = add(&mut g, Op::RmsNorm { eps }, &[h, ln2], "mlp_norm");
    let gt = lin(&mut g, n2, FFN, HIDDEN, "gate_proj");
    let up = lin(&mut g, n2, FFN, HIDDEN, "up_proj");
    let s = add(&mut g, Op::Unary(UnaryOp::Silu), &[gt], "act");
    let m = add(&mut g, Op::Mul, &[s, up], "gate_mul");
    let d = lin(&mut g, m, HIDDEN, FFN, "down_proj");
    let y = add(&mut g, Op::Add, &[h, d], "mlp_residual");
    g.set_output("y", y);
    g
}

/// One Llama-3-8B decoder layer for `t` tokens with its inputs: the residual stream, the
/// positions and the weights.
fn layer_program(t: usize) -> (Graph, BTreeMap<String, Tensor>) {
    let g = llama_layer(t);
    let mut rng = Rng(0x77);
    let ins = BTreeMap::from([
        ("x".to_string(), rng.tensor(&[1, t, HIDDEN], 1.0)),
        ("pos".to_string(), rng.positions(1, t)),
    ]);
    let ins = rng.weights(&g, ins);
    (g, ins)
}

/// Llama-3-8B causal attention, `t` queries against `s` keys (`q_offset = s - t`), with its
/// inputs `q`, `k`, `v` drawn from `seed`.
fn attention_graph(t: usize, s: usize, seed: u64) -> (Graph, BTreeMap<String, Tensor>) {
    let mut rng = Rng(seed);
    let mut g = Graph::new();
    let shapes = [
        ("q", [1, t, HEADS, HEAD_DIM]),
        ("k", [1, s, KV_HEADS, HEAD_DIM]),
        ("v", [1, s, KV_HEADS, HEAD_DIM]),
    ];
    let qkv: Vec<ValueId> = shapes
        .iter()
        .map(|(name, shape)| g.input(name, ty(DType::F32, shape)))
        .collect();
    let spec = AttnSpec {
        causal: true,
        window: None,
        scale: Float(1.0 / (HEAD_DIM as f32).sqrt()),
        indexed: false,
    };
    let y = add(&mut g, Op::Attention(spec), &qkv, "attn");
    g.set_output("y", y);
    let ins = shapes
        .iter()
        .map(|(name, shape)| (name.to_string(), rng.tensor(shape, 1.0)))
        .collect();
    (g, ins)
}

/// The backward of Llama-3-8B causal attention at `t` tokens as a training program has it:
/// the probabilities of `q`, `k` and the gradients wrt q, k and v given the output gradient
/// `dy`, with its inputs drawn from `seed`; with `forward`, also the forward attention of the
/// same q, k, v (output `y`), whose output and lse the backward then reads.
fn attention_bwd_graph(t: usize, seed: u64, forward: bool) -> (Graph, BTreeMap<String, Tensor>) {
    let mut rng = Rng(seed);
    let mut g = Graph::new();
    let shapes = [
        ("q", [1, t, HEADS, HEAD_DIM]),
        ("k", [1, t, KV_HEADS, HEAD_DIM]),
        ("v", [1, t, KV_HEADS, HEAD_DIM]),
        ("dy", [1, t, HEADS, HEAD_DIM]),
    ];
    let [q, k, v, dy] = shapes.map(|(name, shape)| g.input(name, ty(DType::F32, &shape)));
    let spec = AttnSpec {
        causal: true,
        window: None,
        scale: Float(1.0 / (HEAD_DIM as f32).sqrt()),
        indexed: false,
    };
    if forward {
        let y = add(&mut g, Op::Attention(spec), &[q, k, v], "y");
        g.set_output("y", y);
    }
    let p = add(&mut g, Op::AttentionProbs(spec), &[q, k], "probs");
    for (wrt, name) in [(AttnWrt::Q, "dq"), (AttnWrt::K, "dk"), (AttnWrt::V, "dv")] {
        let x = add(
            &mut g,
            Op::AttentionGrad { spec, wrt },
            &[q, k, v, dy, p],
            name,
        );
        g.set_output(name, x);
    }
    let ins = shapes
        .iter()
        .map(|(name, shape)| (name.to_string(), rng.tensor(shape, 1.0)))
        .collect();
    (g, ins)
}

/// GEMM FLOPs plus causal attention FLOPs of one layer.
fn layer_flops(t: usize) -> f64 {
    let qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM;
    let gemm = 2.0 * t as f64 * (HIDDEN * qkv + HIDDEN * HIDDEN + 3 * HIDDEN * FFN) as f64;
    gemm + 2.0 * (HEADS * t * t * HEAD_DIM) as f64
}

fn header() {
    println!(
        "{:<10} {:<28} {:<5} {:<22} {:>10} {:>8} {:>10} {:>9}",
        "section", "case", "dtype", "shape", "ms", "metric", "value", "% ceil"
    );
}

fn print_row(r: &Row) {
    println!(
        "{:<10} {:<28} {:<5} {:<22} {:>10.4} {:>8} {:>10.1} {:>9}",
        r.section,
        r.case,
        r.dtype,
        r.shape,
        r.ms,
        r.metric,
        r.value,
        r.ceiling.map_or("-".to_string(), |c| format!("{c:.1}"))
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "usage: gpu_bench [--quick] [--only copy|membound|gemm|attention|layer|overlap|graphs]"
        );
        return;
    }
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu_bench: {e}; this benchmark needs an NVIDIA GPU with its driver (run it on the GPU machine, see benches/gpu/README.md)");
            std::process::exit(2);
        }
    };
    println!(
        "# shardc gpu_bench on {} ({}), {}",
        dev.name(),
        dev.arch(),
        if quick {
            "quick shapes"
        } else {
            "Llama-3-8B shapes"
        }
    );
    header();
    let mut b = Bench {
        dev,
        quick,
        rows: Vec::new(),
        copy_gbs: 0.0,
        gemm_tflops: 0.0,
    };
    type Section = fn(&mut Bench) -> Result<(), BenchError>;
    let sections: [(&str, Section); 8] = [
        ("copy", Bench::copy),
        ("membound", Bench::membound),
        ("gemm", Bench::gemm),
        ("attention", Bench::attention),
        ("layer", Bench::layer),
        ("moe", Bench::moe),
        ("overlap", Bench::overlap),
        ("graphs", Bench::graphs),
    ];
    let mut failed = false;
    for (name, f) in sections {
        // The ceilings are measured by their sections; keep them when another is selected.
        let needed = only.as_deref().is_none_or(|o| o == name)
            || (name == "copy" && only.as_deref() == Some("membound"))
            || (name == "gemm"
                && matches!(
                    only.as_deref(),
                    Some("attention" | "layer" | "moe" | "overlap")
                ));
        if !needed {
            continue;
        }
        if let Err(e) = f(&mut b) {
            eprintln!("gpu_bench: section {name} failed: {e}");
            failed = true;
        }
    }
    println!("# {} rows", b.rows.len());
    if failed {
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_runtime::cuda::{plan_memory, FusedGroup};

    /// The attention backward rows time what they say: without a forward node the group runs
    /// the forward again; with one, it reads that node's output and lse.
    #[test]
    fn attention_backward_graphs_plan_one_group_reading_the_forward_when_there() {
        for forward in [false, true] {
            let (g, _) = attention_bwd_graph(256, 0, forward);
            let (_, plan) = plan_memory(&g, GpuDType::Bf16, true);
            let groups: Vec<_> = plan
                .groups
                .iter()
                .filter_map(|grp| match grp {
                    FusedGroup::AttentionBwd(f) => Some(f.forward),
                    _ => None,
                })
                .collect();
            let y = g.outputs.iter().find(|(n, _)| n == "y").map(|&(_, v)| v);
            assert_eq!(groups, vec![y], "forward {forward}");
        }
    }

    /// The `moe` section's routed row times packed expert values: the dispatch, gate, up, silu,
    /// the SwiGLU product and the down projection hold `tokens · top_k` rows, a quarter of the
    /// dense `[E, tokens, ·]`.
    #[test]
    fn moe_block_stores_its_expert_values_packed() {
        use shardc_runtime::cuda::Routing;
        let g = moe_block(64);
        let r = Routing::of(&g, true, GpuDType::Bf16);
        let packed: Vec<&str> = g
            .ids()
            .filter(|v| r.packed[v.index()].is_some())
            .map(|v| g.node(v).name.as_str())
            .collect();
        assert_eq!(
            packed,
            ["dispatch", "gate", "up", "act", "gate_mul", "down"]
        );
        for v in g.ids().filter(|v| r.packed[v.index()].is_some()) {
            assert_eq!(
                r.stored_numel(&g, v) * MOE_EXPERTS / MOE_TOP_K,
                g.ty(v).numel()
            );
        }
    }

    /// The section's activation arena at 4096 tokens, bf16: 960 MiB routed (packed) against
    /// 3840 MiB dense, the top-2-of-8 quarter.
    #[test]
    fn moe_block_arena_is_a_quarter_of_the_dense_one() {
        use shardc_runtime::cuda::{plan_memory_routed, Routing};
        let g = moe_block(4096);
        let arena = |routed: bool| {
            let r = Routing::of(&g, routed, GpuDType::Bf16);
            plan_memory_routed(&g, GpuDType::Bf16, true, &r.packed)
                .0
                .total
        };
        let mib = |b: u64| b >> 20;
        assert_eq!((mib(arena(true)), mib(arena(false))), (960, 3840));
    }
}
