//! Kernel launches of the training ops: the gradients of the forward kernels (`norm_grad.cu`,
//! `grad.cu`, `attention_grad.cu`, `moe_grad.cu`) and the AdamW step (`optim.cu`), with the
//! argument lists and launch shapes of each file's contract. The same pre-conditions as
//! [`Launcher`]'s forward launches (`ops.rs`).

use super::ops::{i, Launcher};
use super::CudaError;
use cudarc::driver::PushKernelArg;
use shardc_compiler::ir::UnaryOp;
use shardc_kernels::launch::{
    attention_bwd_kernel, attention_bwd_prep_launch, attention_kernel, attention_rows_launch,
    columns_launch, combine_grad_gates_launch, elementwise_launch, router_launch, rows_launch,
    vector_launch,
};
use shardc_kernels::{entry_name, KernelDType};

/// `[batch, seq_q, seq_k, heads_q, heads_kv, head_dim]` of an attention and its gradients.
pub(crate) type AttnDims = [usize; 6];

/// `(scale, causal, window, q_offset)` of an attention.
pub(crate) type AttnMasking = (f32, bool, Option<usize>, i64);

/// `(tokens, experts, hidden)` of a mixture-of-experts gradient.
pub(crate) type MoeDims = (usize, usize, usize);

/// Whether a normalisation subtracts the mean (LayerNorm) or not (RMSNorm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Norm {
    Rms,
    Layer,
}

impl Norm {
    fn center(self) -> i32 {
        (self == Norm::Layer) as i32
    }
}

/// The host-computed constants of one AdamW update (`optim::update`'s, in f64): `decay = 1 −
/// lr·λ`, `step_size = lr / (1 − β₁ᵗ)`, `bc2_sqrt = √(1 − β₂ᵗ)`, and `eps`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AdamWConsts {
    pub decay: f64,
    pub step_size: f64,
    pub bc2_sqrt: f64,
    pub eps: f64,
}

impl AdamWConsts {
    /// The constants in the order `adamw_update_*` reads them from device memory.
    pub fn words(&self) -> [f64; 4] {
        [self.decay, self.step_size, self.bc2_sqrt, self.eps]
    }

    /// The constants of step `t` under `spec`, computed exactly as the CPU reference does.
    pub fn new(spec: &shardc_compiler::ir::AdamWSpec, t: f64) -> AdamWConsts {
        let (lr, b1, b2) = (spec.lr.0 as f64, spec.beta1.0 as f64, spec.beta2.0 as f64);
        AdamWConsts {
            decay: 1.0 - lr * spec.weight_decay.0 as f64,
            step_size: lr / (1.0 - b1.powf(t)),
            bc2_sqrt: (1.0 - b2.powf(t)).sqrt(),
            eps: spec.eps.0 as f64,
        }
    }
}

impl Launcher<'_> {
    /// `dx = dy · f'(x)`.
    pub fn unary_grad(
        &self,
        u: UnaryOp,
        dt: KernelDType,
        x: u64,
        dy: u64,
        dx: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let n64 = i(n);
        let entry = entry_name(&format!("unary_grad_{}", u.name()), dt);
        launch!(self, entry, vector_launch(n, dt); &x, &dy, &dx, &n64)
    }

    /// `db[j] = Σ_r dy[r, j]` over `rows` rows of `n`.
    pub fn bias_grad(
        &self,
        dt: KernelDType,
        dy: u64,
        db: u64,
        rows: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let (r, n64) = (i(rows), i(n));
        launch!(self, entry_name("bias_grad", dt), columns_launch(rows, n); &dy, &db, &r, &n64)
    }

    /// The gradient of a normalisation wrt `x`, row by row.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_grad_dx(
        &self,
        norm: Norm,
        dt: KernelDType,
        x: u64,
        w: u64,
        dy: u64,
        dx: u64,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let (r, h, c) = (i(rows), i(hidden), norm.center());
        launch!(self, entry_name("norm_grad_dx", dt), rows_launch(rows, hidden);
            &x, &w, &dy, &dx, &r, &h, &eps, &c)
    }

    /// The gradient of a normalisation wrt its weight: each row's statistics into the f32
    /// `stats[rows, 2]` (scratch), then the column sums of `dy ⊙ x̂`.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_grad_dw(
        &self,
        norm: Norm,
        dt: KernelDType,
        x: u64,
        dy: u64,
        stats: u64,
        dw: u64,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let (r, h, c) = (i(rows), i(hidden), norm.center());
        launch!(self, entry_name("norm_stats", dt), rows_launch(rows, hidden);
            &x, &stats, &r, &h, &eps, &c)?;
        launch!(self, entry_name("norm_grad_dw", dt), columns_launch(rows, hidden);
            &x, &dy, &stats, &dw, &r, &h)
    }

    /// `dx[o, i, k] = Σ_t dy[o, i·times + t, k]`, the gradient of `Repeat`.
    #[allow(clippy::too_many_arguments)]
    pub fn repeat_grad(
        &self,
        dt: KernelDType,
        dy: u64,
        dx: u64,
        outer: usize,
        dim: usize,
        times: usize,
        inner: usize,
    ) -> Result<(), CudaError> {
        let (o, d, t, n) = (i(outer), i(dim), i(times), i(inner));
        launch!(self, entry_name("repeat_grad", dt), elementwise_launch(outer * dim * inner);
            &dy, &dx, &o, &d, &t, &n)
    }

    /// `acc[ids[n]] += dy[n]` into the zeroed f32 `acc[vocab, hidden]`.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_grad(
        &self,
        dt: KernelDType,
        ids: u64,
        dy: u64,
        acc: u64,
        n_ids: usize,
        vocab: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        let (n, v, h) = (i(n_ids), i(vocab), i(hidden));
        launch!(self, entry_name("embedding_grad", dt), elementwise_launch(n_ids * hidden);
            &ids, &dy, &acc, &n, &v, &h)
    }

    /// `probs[b, h, t, s]`, the attention's softmax as the forward computes it (`mask` an f32
    /// `[B, S]` pointer or 0).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_probs(
        &self,
        dt: KernelDType,
        q: u64,
        k: u64,
        mask: u64,
        probs: u64,
        dims: AttnDims,
        scale: f32,
        causal: bool,
        window: Option<usize>,
        q_offset: i64,
    ) -> Result<(), CudaError> {
        let [b, t, s, hq, hkv, d] = dims.map(i);
        let causal = causal as i32;
        let window = window.map_or(0, |w| w.min(i64::MAX as usize) as i64);
        let rows = dims[0] * dims[3] * dims[1];
        launch!(self, entry_name("attention_probs", dt), attention_rows_launch(rows, dims[2]);
            &q, &k, &mask, &probs, &b, &t, &s, &hq, &hkv, &d, &scale, &causal, &window, &q_offset)
    }

    /// `ds = P ⊙ (dP − rowsum(P ⊙ dP))` into the f32 `ds[B, Hq, T, S]` (scratch).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_grad_ds(
        &self,
        dt: KernelDType,
        v: u64,
        dy: u64,
        probs: u64,
        ds: u64,
        dims: AttnDims,
    ) -> Result<(), CudaError> {
        let [b, t, s, hq, hkv, d] = dims.map(i);
        let rows = dims[0] * dims[3] * dims[1];
        launch!(self, entry_name("attention_grad_ds", dt), attention_rows_launch(rows, dims[2]);
            &v, &dy, &probs, &ds, &b, &t, &s, &hq, &hkv, &d)
    }

    /// `dq = scale · ds · k` (`wrt_q`) or `dk = scale · dsᵀ · q` summed over a KV head's
    /// query heads, from the f32 `ds`; `x` is `k` or `q`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_grad_qk(
        &self,
        wrt_q: bool,
        dt: KernelDType,
        ds: u64,
        x: u64,
        out: u64,
        dims: AttnDims,
        scale: f32,
    ) -> Result<(), CudaError> {
        let [b, t, s, hq, hkv, d] = dims.map(i);
        let (op, n) = if wrt_q {
            ("attention_grad_dq", dims[0] * dims[1] * dims[3] * dims[5])
        } else {
            ("attention_grad_dk", dims[0] * dims[2] * dims[4] * dims[5])
        };
        launch!(self, entry_name(op, dt), elementwise_launch(n);
            &ds, &x, &out, &b, &t, &s, &hq, &hkv, &d, &scale)
    }

    /// `dv = Pᵀ · dy` summed over a KV head's query heads.
    pub fn attention_grad_dv(
        &self,
        dt: KernelDType,
        probs: u64,
        dy: u64,
        dv: u64,
        dims: AttnDims,
    ) -> Result<(), CudaError> {
        let [b, t, s, hq, hkv, d] = dims.map(i);
        let n = dims[0] * dims[2] * dims[4] * dims[5];
        launch!(self, entry_name("attention_grad_dv", dt), elementwise_launch(n);
            &probs, &dy, &dv, &b, &t, &s, &hq, &hkv, &d)
    }

    /// The attention forward of `[q, k, v]` into `out`, also writing each query's f32
    /// log-sum-exp into `lse[B, T, Hq]` (for the backward): `attention_tc_lse_bf16` where
    /// `tensor_core` allows and the call is supported, else `attention_lse_{dtype}`
    /// (`launch::attention_kernel` with `lse`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_lse(
        &self,
        dt: KernelDType,
        [q, k, v]: [u64; 3],
        out: u64,
        mask: u64,
        lse: u64,
        dims: AttnDims,
        masking: AttnMasking,
        tensor_core: bool,
    ) -> Result<(), CudaError> {
        let [b, t, s, hq, hkv, d] = dims;
        let major = self.dev.compute_capability().0;
        let (entry, cfg) =
            attention_kernel(dt, major, tensor_core, true, [b, t, hq, hkv, d], [q, k, v])?;
        let [b, t, s, hq, hkv, d] = [b, t, s, hq, hkv, d].map(|x| x as i32);
        let (scale, causal, window, off) = int_masking(masking);
        launch!(self, entry, cfg;
            &q, &k, &v, &out, &mask, &b, &t, &s, &hq, &hkv, &d, &scale, &causal, &window, &off,
            &lse)
    }

    /// `delta = rowsum(dout ⊙ out)` per query row (f32) and the f32 dQ accumulator zeroed.
    pub fn attention_bwd_prep(
        &self,
        dt: KernelDType,
        out: u64,
        dout: u64,
        delta: u64,
        dq_acc: u64,
        dims: AttnDims,
    ) -> Result<(), CudaError> {
        let rows = dims[0] * dims[1] * dims[3];
        let (r, d) = (i(rows), dims[5] as i32);
        launch!(self, entry_name("attention_bwd_prep", dt), attention_bwd_prep_launch(rows);
            &out, &dout, &delta, &dq_acc, &r, &d)
    }

    /// The FlashAttention-2 backward pass of `[q, k, v, dout]` given the forward's
    /// `(lse, delta, mask)`: dK and dV written, dQ added into the f32 `dq_acc`. With
    /// `tensor_core`, bf16 calls the tensor-core kernel supports (head_dim 64 or 128, sm_80+,
    /// 16-byte aligned operands) run `attention_bwd_tc_bf16`, the rest the scalar
    /// `attention_bwd_{dtype}` (`launch::attention_bwd_kernel`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_bwd(
        &self,
        dt: KernelDType,
        [q, k, v, dout]: [u64; 4],
        (lse, delta, mask): (u64, u64, u64),
        (dq_acc, dk, dv): (u64, u64, u64),
        dims: AttnDims,
        masking: AttnMasking,
        tensor_core: bool,
    ) -> Result<(), CudaError> {
        let [b, t, s, hq, hkv, d] = dims;
        let major = self.dev.compute_capability().0;
        let (entry, cfg) =
            attention_bwd_kernel(dt, major, tensor_core, [b, s, hq, hkv, d], [q, k, v, dout])?;
        let [b, t, s, hq, hkv, d] = [b, t, s, hq, hkv, d].map(|x| x as i32);
        let (scale, causal, window, off) = int_masking(masking);
        launch!(self, entry, cfg;
            &q, &k, &v, &dout, &lse, &delta, &mask, &dq_acc, &dk, &dv, &b, &t, &s, &hq, &hkv, &d,
            &scale, &causal, &window, &off)
    }

    /// The gradient of the router wrt its logits.
    #[allow(clippy::too_many_arguments)]
    pub fn router_grad(
        &self,
        dt: KernelDType,
        logits: u64,
        dgates: u64,
        dlogits: u64,
        tokens: usize,
        experts: usize,
        top_k: usize,
        normalize: bool,
    ) -> Result<(), CudaError> {
        let cfg = router_launch(tokens, experts)?;
        let (n, e, k, norm) = (i(tokens), experts as i32, top_k as i32, normalize as i32);
        launch!(self, entry_name("router_grad", dt), cfg;
            &logits, &dgates, &dlogits, &n, &e, &k, &norm)
    }

    /// `dx[n] = Σ_e dxe[e, n]` over the experts a token was sent to.
    pub fn dispatch_grad(
        &self,
        dt: KernelDType,
        [dxe, gates, dx, pos]: [u64; 4],
        (tokens, experts, hidden): MoeDims,
    ) -> Result<(), CudaError> {
        let (n, e, h) = (i(tokens), experts as i32, i(hidden));
        launch!(self, entry_name("dispatch_grad", dt), elementwise_launch(tokens * hidden);
            &dxe, &gates, &dx, &n, &e, &h, &pos)
    }

    /// The gradient of `combine` wrt the expert outputs: `dyy[e, n] = gates[n, e] · dy[n]`.
    pub fn combine_grad_y(
        &self,
        dt: KernelDType,
        [gates, dy, dyy, pos]: [u64; 4],
        (tokens, experts, hidden): MoeDims,
    ) -> Result<(), CudaError> {
        let (n, e, h) = (i(tokens), experts as i32, i(hidden));
        // Packed: one thread per (token, column), over the token's experts.
        let total = if pos == 0 { experts } else { 1 } * tokens * hidden;
        launch!(self, entry_name("combine_grad_y", dt), elementwise_launch(total);
            &gates, &dy, &dyy, &n, &e, &h, &pos)
    }

    /// The gradient of `combine` wrt the gates: `dg[n, e] = dy[n] · y[e, n]` where kept.
    pub fn combine_grad_gates(
        &self,
        dt: KernelDType,
        (y, gates, dy): (u64, u64, u64),
        dg: u64,
        pos: u64,
        (tokens, experts, hidden): MoeDims,
    ) -> Result<(), CudaError> {
        let (n, e, h) = (i(tokens), experts as i32, i(hidden));
        launch!(self, entry_name("combine_grad_gates", dt), combine_grad_gates_launch(tokens, experts);
            &y, &gates, &dy, &dg, &n, &e, &h, &pos)
    }

    /// An Adam moment update: `m + (1 − β)(g − m)`, or `β·m + (1 − β)·g²` when `squared`.
    #[allow(clippy::too_many_arguments)]
    pub fn adam_moment(
        &self,
        dt: KernelDType,
        m: u64,
        g: u64,
        out: u64,
        n: usize,
        beta: f32,
        squared: bool,
    ) -> Result<(), CudaError> {
        let n64 = i(n);
        // As the CPU reference computes the weight: in f64, rounded once.
        let one_minus = (1.0 - beta as f64) as f32;
        let sq = squared as i32;
        launch!(self, entry_name("adam_moment", dt), vector_launch(n, dt);
            &m, &g, &out, &n64, &beta, &one_minus, &sq)
    }

    /// The AdamW parameter update from the updated moments, its step's constants read from
    /// `consts` (device memory holding [`AdamWConsts::words`]).
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_update(
        &self,
        dt: KernelDType,
        w: u64,
        m: u64,
        v: u64,
        out: u64,
        n: usize,
        consts: u64,
    ) -> Result<(), CudaError> {
        let n64 = i(n);
        launch!(self, entry_name("adamw_update", dt), vector_launch(n, dt);
            &w, &m, &v, &out, &n64, &consts)
    }
}

/// The int arguments of the attention kernels: `(scale, causal, window (0: none), q_offset)`.
fn int_masking((scale, causal, window, q_offset): AttnMasking) -> (f32, i32, i32, i32) {
    let window = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
    (scale, causal as i32, window, q_offset as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_compiler::ir::{AdamWSpec, Float};

    #[test]
    fn adamw_constants_are_the_cpu_references() {
        let spec = AdamWSpec {
            lr: Float(3e-4),
            weight_decay: Float(0.1),
            ..AdamWSpec::default()
        };
        let c = AdamWConsts::new(&spec, 1.0);
        let (lr, b1, b2) = (3e-4f32 as f64, spec.beta1.0 as f64, spec.beta2.0 as f64);
        assert_eq!(c.decay, 1.0 - lr * (0.1f32 as f64));
        assert_eq!(c.step_size, lr / (1.0 - b1));
        assert_eq!(c.bc2_sqrt, (1.0 - b2).sqrt());
        assert_eq!(c.eps, spec.eps.0 as f64);
        // Bias corrections vanish as t grows.
        let late = AdamWConsts::new(&spec, 1e6);
        assert!((late.step_size - lr).abs() < 1e-12 && (late.bc2_sqrt - 1.0).abs() < 1e-12);
    }
}
