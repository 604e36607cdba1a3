//! Kernel launches on raw device pointers: one method per kernel family, with the argument
//! lists and launch shapes of each `.cu` file's contract (`shardc_kernels::launch`).
//!
//! Pre (every method): the pointers are device memory of the launcher's context holding the
//! sizes the arguments imply; outputs do not overlap inputs unless the kernel's contract
//! allows it. Launches are asynchronous on the launcher's stream.

use super::device::Kernel;
use super::routed::RoutedGemm;
use super::strided::StridedSpec;
use super::{CudaDevice, CudaError};
use cudarc::driver::{result as drv, CudaStream, PushKernelArg};
use shardc_compiler::ir::{RopeStyle, UnaryOp};
use shardc_kernels::launch::{
    attention_plan, elementwise_launch, loss_sum_launch, moe_route_index_launch, rope_launch,
    routed_gemm_launch, routed_weight_grad_launch, router_launch, rows_launch, vector_launch,
    AttentionPlan,
};
use shardc_kernels::{entry_name, KernelDType};

/// Launches kernels of `dev` on `stream`.
pub(crate) struct Launcher<'a> {
    /// The device (kernel table).
    pub dev: &'a CudaDevice,
    /// The stream work goes to.
    pub stream: &'a CudaStream,
}

/// Launches `$entry` with `$cfg` and the listed arguments (references to live locals).
macro_rules! launch {
    ($self:expr, $entry:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let entry: &str = &$entry;
        let k = $self.dev.kernel(entry)?;
        // The arguments' sizes against the kernel's parameters, where the driver reports them.
        k.check_args(&[$(std::mem::size_of_val($arg)),*])?;
        let mut b = $self.stream.launch_builder(&k.function);
        $( b.arg($arg); )*
        // SAFETY: the argument list matches the kernel's signature in its .cu contract (each
        // call site passes the documented types in order, and their sizes were checked against
        // the compiled kernel's where the driver reports them); the pointers are valid per the
        // module's pre-condition; the launch shape is the one the contract requires.
        unsafe { b.launch($cfg) }
            .map(|_| ())
            .map_err(CudaError::driver(format!("launch {entry}")))
    }};
}

pub(crate) fn i(n: usize) -> i64 {
    n as i64
}

impl<'a> Launcher<'a> {
    /// Launches kernels of `dev` on `stream`.
    pub fn new(dev: &'a CudaDevice, stream: &'a CudaStream) -> Self {
        Launcher { dev, stream }
    }

    /// `out = f(x)` elementwise.
    pub fn unary(
        &self,
        u: UnaryOp,
        dt: KernelDType,
        x: u64,
        out: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let n64 = i(n);
        launch!(self, entry_name(u.name(), dt), vector_launch(n, dt); &x, &out, &n64)
    }

    /// `out = x · c`.
    pub fn scale(
        &self,
        dt: KernelDType,
        x: u64,
        out: u64,
        n: usize,
        c: f32,
    ) -> Result<(), CudaError> {
        let n64 = i(n);
        launch!(self, entry_name("scale", dt), vector_launch(n, dt); &x, &out, &n64, &c)
    }

    /// `out[i] = a[i] op b[i % nb]` for `op` in `add`, `mul`.
    #[allow(clippy::too_many_arguments)]
    pub fn binary(
        &self,
        op: &str,
        dt: KernelDType,
        a: u64,
        b: u64,
        out: u64,
        n: usize,
        nb: usize,
    ) -> Result<(), CudaError> {
        let (n64, nb64) = (i(n), i(nb.max(1)));
        launch!(self, entry_name(op, dt), vector_launch(n, dt); &a, &b, &out, &n64, &nb64)
    }

    /// `out = silu(a) · b`.
    pub fn swiglu(
        &self,
        dt: KernelDType,
        a: u64,
        b: u64,
        out: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let n64 = i(n);
        launch!(self, entry_name("swiglu", dt), vector_launch(n, dt); &a, &b, &out, &n64)
    }

    /// RMSNorm over rows of `hidden`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        dt: KernelDType,
        x: u64,
        w: u64,
        out: u64,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let (r, h) = (i(rows), i(hidden));
        launch!(self, entry_name("rmsnorm", dt), rows_launch(rows, hidden); &x, &w, &out, &r, &h, &eps)
    }

    /// LayerNorm over rows of `hidden`.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm(
        &self,
        dt: KernelDType,
        x: u64,
        w: u64,
        b: u64,
        out: u64,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let (r, h) = (i(rows), i(hidden));
        launch!(self, entry_name("layernorm", dt), rows_launch(rows, hidden); &x, &w, &b, &out, &r, &h, &eps)
    }

    /// `sum = x + residual; out = rmsnorm(sum) · w`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rmsnorm(
        &self,
        dt: KernelDType,
        x: u64,
        residual: u64,
        sum: u64,
        w: u64,
        out: u64,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let (r, h) = (i(rows), i(hidden));
        launch!(self, entry_name("add_rmsnorm", dt), rows_launch(rows, hidden);
            &x, &residual, &sum, &w, &out, &r, &h, &eps)
    }

    /// Rotary embedding of `x[b, t, heads, d]` (full rotary: `rot_dim = d`).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        style: RopeStyle,
        dt: KernelDType,
        x: u64,
        out: u64,
        pos: u64,
        inv_freq: u64,
        shape: [usize; 4],
    ) -> Result<(), CudaError> {
        let op = match style {
            RopeStyle::Half => "rope_half",
            RopeStyle::Interleaved => "rope_interleaved",
        };
        let [b, t, h, d] = shape.map(i);
        let pairs = shape.iter().product::<usize>() / 2;
        launch!(self, entry_name(op, dt), rope_launch(pairs, dt);
            &x, &out, &pos, &inv_freq, &b, &t, &h, &d, &d)
    }

    /// Softmax over rows of `cols`.
    pub fn softmax(
        &self,
        dt: KernelDType,
        x: u64,
        out: u64,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        let (r, c) = (i(rows), i(cols));
        launch!(self, entry_name("softmax", dt), rows_launch(rows, cols); &x, &out, &r, &c)
    }

    /// Flash-style attention. `dims = [batch, seq_q, seq_k, heads_q, heads_kv, head_dim]`;
    /// `mask` is an f32 `[B, S]` pointer or 0. With `tensor_core`, bf16 calls the kernel
    /// supports (head_dim 64 or 128, sm_80+, 16-byte aligned q/k/v) run `attention_tc_bf16`;
    /// everything else runs the scalar `attention_{dtype}` (`attention_kernel`). Calls whose
    /// grid would leave the SMs idle (decode against a long cache) run the split-KV pair
    /// `attention_decode_{dtype}` + `attention_decode_combine_{dtype}` instead when
    /// `workspace = (device pointer, bytes)` holds its f32 workspace (`attention_plan`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        dt: KernelDType,
        q: u64,
        k: u64,
        v: u64,
        out: u64,
        mask: u64,
        dims: [usize; 6],
        scale: f32,
        causal: bool,
        window: Option<usize>,
        q_offset: i64,
        tensor_core: bool,
        workspace: (u64, usize),
    ) -> Result<(), CudaError> {
        let [b, t, s, hq, hkv, d] = dims;
        if b == 0 || t == 0 || hq == 0 {
            return Ok(());
        }
        let device = (self.dev.compute_capability().0, self.dev.sm_count());
        let plan = attention_plan(dt, device, tensor_core, workspace.1, dims, [q, k, v])?;
        let c32 = |x: usize| x as i32;
        let (b32, t32, s32, hq32, hkv32, d32) = (c32(b), c32(t), c32(s), c32(hq), c32(hkv), c32(d));
        let causal = causal as i32;
        let window = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let off = q_offset as i32;
        match plan {
            AttentionPlan::Single(entry, cfg) => launch!(self, entry, cfg;
                &q, &k, &v, &out, &mask, &b32, &t32, &s32, &hq32, &hkv32, &d32, &scale, &causal,
                &window, &off),
            AttentionPlan::SplitKv(split) => {
                let (ws, splits) = (workspace.0, c32(split.num_splits));
                for (entry, cfg) in [
                    (split.partial, split.partial_cfg),
                    (split.combine, split.combine_cfg),
                ] {
                    launch!(self, entry, cfg;
                        &q, &k, &v, &out, &mask, &b32, &t32, &s32, &hq32, &hkv32, &d32, &scale,
                        &causal, &window, &off, &ws, &splits)?;
                }
                Ok(())
            }
        }
    }

    /// Row lookup `out[n] = table[ids[n] - id_offset]` (zero rows outside the table).
    #[allow(clippy::too_many_arguments)]
    pub fn embedding(
        &self,
        dt: KernelDType,
        table: u64,
        ids: u64,
        out: u64,
        n_ids: usize,
        vocab: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        let (n, v, h, off) = (i(n_ids), i(vocab), i(hidden), 0i64);
        launch!(self, entry_name("embedding", dt), vector_launch(n_ids * hidden, dt);
            &table, &ids, &out, &n, &v, &h, &off)
    }

    /// MoE router: softmax, top-k, optional renormalisation.
    #[allow(clippy::too_many_arguments)]
    pub fn router(
        &self,
        dt: KernelDType,
        logits: u64,
        gates: u64,
        tokens: usize,
        experts: usize,
        top_k: usize,
        normalize: bool,
    ) -> Result<(), CudaError> {
        let cfg = router_launch(tokens, experts)?;
        let (n, e, k, norm) = (i(tokens), experts as i32, top_k as i32, normalize as i32);
        launch!(self, entry_name("router", dt), cfg; &logits, &gates, &n, &e, &k, &norm)
    }

    /// `dispatch` (`op = "dispatch"`, out `[E, N, H]`) or `combine` (`op = "combine"`, out
    /// `[N, H]`); `pos` (non-zero) the packed rows' map of a packed `[E, N, H]` side.
    pub fn moe_move(
        &self,
        op: &str,
        dt: KernelDType,
        [x, gates, out, pos]: [u64; 4],
        tokens: usize,
        experts: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        let total = if op == "dispatch" && pos == 0 {
            experts * tokens * hidden
        } else {
            tokens * hidden
        };
        let (n, e, h) = (i(tokens), experts as i32, i(hidden));
        launch!(self, entry_name(op, dt), elementwise_launch(total);
            &x, &gates, &out, &n, &e, &h, &pos)
    }

    /// Per-expert lists of routed token rows from `gates [tokens, experts]`: `counts[e]` and
    /// `rows[e · tokens ..]`, ascending, then the packed rows' map `pos[tokens · experts]`
    /// (`moe_gemm.cu`'s `moe_route_index` and `moe_route_positions`).
    pub fn moe_route_index(
        &self,
        dt: KernelDType,
        gates: u64,
        [counts, rows, pos]: [u64; 3],
        tokens: usize,
        experts: usize,
    ) -> Result<(), CudaError> {
        let (n, e) = (i(tokens), experts as i32);
        let cfg = moe_route_index_launch(experts);
        launch!(self, entry_name("moe_route_index", dt), cfg;
            &gates, &counts, &rows, &n, &e)?;
        launch!(self, entry_name("moe_route_positions", dt), cfg;
            &gates, &counts, &rows, &pos, &n, &e)
    }

    /// One of `moe_gemm.cu`'s routed expert kernels over the routed rows `r` of each expert
    /// (`(counts, rows)` from [`Launcher::moe_route_index`]), operands `[a, b, out]`:
    /// `routed_gemm`, `out[e, r] = a[e, r] · b[e]` (other rows untouched), or with
    /// `weight_grad` `routed_weight_grad`, `out[e] = Σ_r a[e, r]ᵀ · b[e, r]` (`b` = dy), `[E, k,
    /// n]` or (`transpose_w`) `[E, n, k]`, every element written. `packed` flags the operands
    /// held as packed rows (`Routing::packed_flags`).
    pub fn routed(
        &self,
        dt: KernelDType,
        weight_grad: bool,
        [a, b, out]: [u64; 3],
        (counts, rows): (u64, u64),
        r: &RoutedGemm,
        packed: i32,
    ) -> Result<(), CudaError> {
        let (n_tok, k, n) = (i(r.tokens), r.k as i32, r.n as i32);
        let tw = r.transpose_w as i32;
        let (op, cfg) = if weight_grad {
            let cfg = routed_weight_grad_launch(dt, r.k, r.n, r.experts);
            ("routed_weight_grad", cfg)
        } else {
            (
                "routed_gemm",
                routed_gemm_launch(dt, r.tokens, r.n, r.experts),
            )
        };
        launch!(self, entry_name(op, dt), cfg;
            &a, &b, &out, &counts, &rows, &n_tok, &k, &n, &tw, &packed)
    }

    /// Per-row cross-entropy into an f32 `loss[rows]`.
    pub fn cross_entropy(
        &self,
        dt: KernelDType,
        logits: u64,
        labels: u64,
        loss: u64,
        rows: usize,
        vocab: usize,
    ) -> Result<(), CudaError> {
        let (r, v) = (i(rows), i(vocab));
        launch!(self, entry_name("cross_entropy", dt), rows_launch(rows, vocab);
            &logits, &labels, &loss, &r, &v)
    }

    /// Per-row stats `[rows, 3]` (max, sum of exponentials, the label's logit) of one
    /// vocabulary shard: columns `lo .. lo + vocab` of `total`.
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_stats(
        &self,
        dt: KernelDType,
        logits: u64,
        labels: u64,
        stats: u64,
        rows: usize,
        vocab: usize,
        lo: usize,
        total: usize,
    ) -> Result<(), CudaError> {
        let (r, v, lo, t) = (i(rows), i(vocab), i(lo), i(total));
        launch!(self, entry_name("cross_entropy_stats", dt), rows_launch(rows, vocab);
            &logits, &labels, &stats, &r, &v, &lo, &t)
    }

    /// Per-row cross-entropy into an f32 `loss[rows]` from every vocabulary shard's stats
    /// (`[rows, 3 · shards]`).
    pub fn cross_entropy_from_stats(
        &self,
        dt: KernelDType,
        stats: u64,
        labels: u64,
        loss: u64,
        rows: usize,
        shards: usize,
    ) -> Result<(), CudaError> {
        let (r, p) = (i(rows), i(shards));
        launch!(self, entry_name("cross_entropy_from_stats", dt), elementwise_launch(rows);
            &stats, &labels, &loss, &r, &p)
    }

    /// The cross-entropy gradient of one vocabulary shard (columns `lo .. lo + vocab`), scaled
    /// by `scale`, from every shard's stats.
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_shard_grad(
        &self,
        dt: KernelDType,
        logits: u64,
        labels: u64,
        stats: u64,
        dx: u64,
        rows: usize,
        vocab: usize,
        shards: usize,
        lo: usize,
        scale: f32,
    ) -> Result<(), CudaError> {
        let (r, v, p, lo) = (i(rows), i(vocab), i(shards), i(lo));
        launch!(self, entry_name("cross_entropy_shard_grad", dt), rows_launch(rows, vocab);
            &logits, &labels, &stats, &dx, &r, &v, &p, &lo, &scale)
    }

    /// `out[0] = scale · Σ loss` (f32).
    pub fn loss_sum(&self, loss: u64, out: u64, rows: usize, scale: f32) -> Result<(), CudaError> {
        let r = i(rows);
        launch!(self, "loss_sum_f32", loss_sum_launch(); &loss, &out, &r, &scale)
    }

    /// Dtype conversion: `entry` is `cast_f32_bf16`, `cast_bf16_f32` or `round_bf16_f32`.
    pub fn convert(&self, entry: &str, x: u64, out: u64, n: usize) -> Result<(), CudaError> {
        let n64 = i(n);
        launch!(self, entry, elementwise_launch(n); &x, &out, &n64)
    }

    /// `out = x - off` on i32 (wrapping).
    pub fn rank_offset(&self, x: u64, out: u64, n: usize, off: i32) -> Result<(), CudaError> {
        let n64 = i(n);
        launch!(self, "rank_offset_i32", elementwise_launch(n); &x, &out, &n64, &off)
    }

    /// A strided copy of `elem_bytes`-byte elements (2 or 4).
    pub fn strided(
        &self,
        elem_bytes: usize,
        input: u64,
        out: u64,
        spec: &StridedSpec,
    ) -> Result<(), CudaError> {
        if spec.is_empty() {
            return Ok(());
        }
        let entry = if elem_bytes == 2 {
            "strided_copy_b2"
        } else {
            "strided_copy_b4"
        };
        launch!(self, entry, elementwise_launch(spec.len()); &input, &out, spec)
    }

    /// A generated fused elementwise kernel (`f`, generated for `dt`): `out[i] =
    /// expr(in_j[i % len_j])` over `inputs = [(ptr, len)]` (every `len >= 1`).
    pub fn fused(
        &self,
        f: &Kernel,
        dt: KernelDType,
        inputs: &[(u64, usize)],
        out: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        let ptrs: Vec<u64> = inputs.iter().map(|p| p.0).collect();
        let lens: Vec<i64> = inputs.iter().map(|p| i(p.1.max(1))).collect();
        let n64 = i(n);
        // The arguments' sizes, as pushed below, against the kernel's parameters.
        let passed: Vec<usize> = (ptrs.iter().map(std::mem::size_of_val))
            .chain([std::mem::size_of_val(&out), std::mem::size_of_val(&n64)])
            .chain(lens.iter().map(std::mem::size_of_val))
            .collect();
        f.check_args(&passed)?;
        let mut b = self.stream.launch_builder(&f.function);
        for p in &ptrs {
            b.arg(p);
        }
        b.arg(&out).arg(&n64);
        for l in &lens {
            b.arg(l);
        }
        // SAFETY: the generated signature is (in_0.., out, n, len_0..) with one input per
        // entry of `inputs`, exactly as pushed; pointers valid per the module pre-condition.
        unsafe { b.launch(vector_launch(n, dt)) }
            .map(|_| ())
            .map_err(CudaError::driver("launch a fused elementwise kernel"))
    }

    /// `acc += x`.
    pub fn accumulate(&self, dt: KernelDType, acc: u64, x: u64, n: usize) -> Result<(), CudaError> {
        let n64 = i(n);
        launch!(self, entry_name("reduce_accumulate", dt), vector_launch(n, dt); &acc, &x, &n64)
    }

    /// `acc = (acc + x) · scale`.
    pub fn average(
        &self,
        dt: KernelDType,
        acc: u64,
        x: u64,
        n: usize,
        scale: f32,
    ) -> Result<(), CudaError> {
        let n64 = i(n);
        launch!(self, entry_name("reduce_average", dt), vector_launch(n, dt); &acc, &x, &n64, &scale)
    }

    /// `bytes` bytes from `src` to `dst` (device to device).
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 || dst == src {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges are device memory of this context (module pre-condition).
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(
            CudaError::driver(format!("copy {bytes} bytes device to device")),
        )
    }

    /// Sets `bytes` bytes at `dst` to `value`.
    pub fn memset(&self, dst: u64, value: u8, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range is device memory of this context (module pre-condition).
        unsafe { drv::memset_d8_async(dst, value, bytes, self.stream.cu_stream()) }
            .map_err(CudaError::driver(format!("memset {bytes} bytes")))
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))
    }
}
