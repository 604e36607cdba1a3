//! The training ops on the compute stream: one node's gradient kernels (`train_ops.rs`), the
//! weight gradient as a cuBLASLt GEMM contracting over the rows, and the AdamW step. Each
//! computes what the CPU kernel of the same op (`cpu/train`) computes.
//!
//! Scratch: a weight's norm gradient keeps the rows' statistics there, the attention gradient
//! its f32 `dS`, a bf16 embedding gradient its f32 accumulator, a cross-entropy gradient the
//! rows' stats, an attention-probabilities node under bf16 its f32 mask
//! (`scratch.rs` sizes each; the program reserves the largest). Also the attention backward
//! group of `flash.rs`.
//!
//! Pre: as for `node.rs`; an `AdamWUpdate`'s step is a scalar program input (its value is read
//! on the host when the inputs are uploaded).

use super::flash::{saved_lse_offset, FlashBwd, FlashScratch};
use super::gemm::GemmKey;
use super::ops::Launcher;
use super::program::CudaProgram;
use super::train_ops::{AttnDims, Norm};
use super::{CudaError, GpuDType};
use shardc_compiler::ir::{AttnWrt, CombineWrt, Node, NormWrt, Op, ValueId};

impl CudaProgram {
    /// `[B, T, S, Hq, Hkv, D]` of an attention's `q[B,T,Hq,D]` and `k[B,S,Hkv,D]`.
    fn attn_dims(&self, q: ValueId, k: ValueId) -> AttnDims {
        let (q, k) = (self.shape(q), self.shape(k));
        [q[0], q[1], k[1], q[2], k[2], q[3]]
    }

    /// `(rows, hidden)` of a `[.., hidden]` value.
    fn rows_of(&self, v: ValueId) -> (usize, usize) {
        let h = self.graph.ty(v).last();
        (self.numel(v) / h.max(1), h)
    }

    /// Enqueues training node `v`; `None` when `v` is not a training op.
    pub(super) fn run_train_node(
        &mut self,
        v: ValueId,
        node: &Node,
        l: &Launcher,
    ) -> Option<Result<(), CudaError>> {
        if let Op::WeightGrad { transpose_b } = node.op {
            return Some(self.weight_grad(v, node, transpose_b, l));
        }
        let ins = &node.inputs;
        let out = self.ptr(v);
        let n = self.numel(v);
        let dt = self.dt();
        let p = |k: usize| self.ptr(ins[k]);
        let scratch = self.scratch.ptr;
        Some(match &node.op {
            Op::UnaryGrad(u) => l.unary_grad(*u, dt, p(0), p(1), out, n),
            Op::BiasGrad => l.bias_grad(dt, p(0), out, self.numel(ins[0]) / n.max(1), n),
            Op::RmsNormGrad { eps, wrt } | Op::LayerNormGrad { eps, wrt } => {
                let norm = if matches!(node.op, Op::RmsNormGrad { .. }) {
                    Norm::Rms
                } else {
                    Norm::Layer
                };
                let (rows, h) = self.rows_of(ins[0]);
                match wrt {
                    NormWrt::X => l.norm_grad_dx(norm, dt, p(0), p(1), p(2), out, rows, h, eps.0),
                    NormWrt::Weight => {
                        l.norm_grad_dw(norm, dt, p(0), p(2), scratch, out, rows, h, eps.0)
                    }
                }
            }
            Op::RopeGrad(spec) => self.rope_node(v, spec.style, l),
            Op::AttentionProbs(spec) => {
                let dims = self.attn_dims(ins[0], ins[1]);
                let mask = self.f32_mask(ins.get(2).copied(), scratch, l);
                let q_offset = dims[2] as i64 - dims[1] as i64;
                mask.and_then(|mask| {
                    l.attention_probs(
                        dt,
                        p(0),
                        p(1),
                        mask,
                        out,
                        dims,
                        spec.scale.0,
                        spec.causal,
                        spec.window,
                        q_offset,
                    )
                })
            }
            Op::AttentionGrad { spec, wrt } => {
                // (q, k, v, dy, probs)
                let dims = self.attn_dims(ins[0], ins[1]);
                let scale = spec.scale.0;
                match wrt {
                    AttnWrt::V => l.attention_grad_dv(dt, p(4), p(3), out, dims),
                    AttnWrt::Q | AttnWrt::K => {
                        let wrt_q = *wrt == AttnWrt::Q;
                        let x = if wrt_q { p(1) } else { p(0) };
                        l.attention_grad_ds(dt, p(2), p(3), p(4), scratch, dims)
                            .and_then(|()| {
                                l.attention_grad_qk(wrt_q, dt, scratch, x, out, dims, scale)
                            })
                    }
                }
            }
            Op::EmbeddingGrad => {
                // (ids, dy, table) -> [V, H]
                let (vocab, hidden) = (node.ty.dim(0), node.ty.last());
                let n_ids = self.numel(ins[0]);
                let acc = if self.opts.dtype == GpuDType::F32 {
                    out
                } else {
                    scratch
                };
                l.memset(acc, 0, n * 4)
                    .and_then(|()| l.embedding_grad(dt, p(0), p(1), acc, n_ids, vocab, hidden))
                    .and_then(|()| match self.opts.dtype {
                        GpuDType::F32 => Ok(()),
                        GpuDType::Bf16 => l.convert("cast_f32_bf16", acc, out, n),
                    })
            }
            Op::RouterGrad { top_k, normalize } => {
                let (tokens, experts) = self.rows_of(ins[0]);
                l.router_grad(dt, p(0), p(1), out, tokens, experts, *top_k, *normalize)
            }
            Op::DispatchGrad => {
                // (dxe[E,B,T,H], gates[B,T,E]) -> [B,T,H]
                let (tokens, experts) = self.rows_of(ins[1]);
                let pos = self.positions_of(ins[0]);
                l.dispatch_grad(
                    dt,
                    [p(0), p(1), out, pos],
                    (tokens, experts, node.ty.last()),
                )
            }
            Op::CombineGrad { wrt } => {
                // (y[E,B,T,H], gates[B,T,E], dy[B,T,H])
                let (tokens, experts) = self.rows_of(ins[1]);
                let dims = (tokens, experts, self.graph.ty(ins[2]).last());
                match wrt {
                    CombineWrt::Y => {
                        let pos = self.positions_of(v);
                        l.combine_grad_y(dt, [p(1), p(2), out, pos], dims)
                    }
                    CombineWrt::Gates => {
                        let pos = self.positions_of(ins[0]);
                        l.combine_grad_gates(dt, (p(0), p(1), p(2)), out, pos, dims)
                    }
                }
            }
            Op::CrossEntropyGrad { denom } => {
                // One shard holding the whole vocabulary: its stats, then its gradient.
                let vocab = node.ty.last();
                let rows = self.numel(ins[1]);
                let scale = 1.0 / (*denom).max(1) as f32;
                self.check_host_values(v).and_then(|()| {
                    l.cross_entropy_stats(dt, p(0), p(1), scratch, rows, vocab, 0, vocab)?;
                    l.cross_entropy_shard_grad(
                        dt,
                        p(0),
                        p(1),
                        scratch,
                        out,
                        rows,
                        vocab,
                        1,
                        0,
                        scale,
                    )
                })
            }
            Op::RepeatGrad { dim, times } => {
                let s = node.ty.shape();
                let outer = s[..*dim].iter().product();
                let inner = s[dim + 1..].iter().product();
                l.repeat_grad(dt, p(0), out, outer, s[*dim], *times, inner)
            }
            Op::AdamMoment { beta, squared } => {
                l.adam_moment(dt, p(0), p(1), out, n, beta.0, *squared)
            }
            // The step's constants were written to the node's buffer with the inputs.
            Op::AdamWUpdate(_) => match &self.adamw_consts[v.index()] {
                Some(c) => l.adamw_update(dt, p(0), p(1), p(2), out, n, c.ptr),
                None => Err(self.unsupported(
                    v,
                    "the step count is not a scalar program input (it is read on the host)",
                )),
            },
            _ => return None,
        })
    }

    /// `WeightGrad`: one cuBLASLt GEMM contracting `a` and `dy` over their rows, or, for
    /// experts' weights whose rows are routed (`routed.rs`), `routed_weight_grad` over the
    /// routed rows only.
    fn weight_grad(
        &mut self,
        v: ValueId,
        node: &Node,
        transpose_b: bool,
        l: &Launcher,
    ) -> Result<(), CudaError> {
        let (a, dy, b) = (node.inputs[0], node.inputs[1], node.inputs[2]);
        if let Some(r) = self.runs_routed(v) {
            let ptrs = [self.ptr(a), self.ptr(dy), self.ptr(v)];
            let packed = self.routing.packed_flags(&self.graph, v);
            return l.routed(self.dt(), true, ptrs, self.route_lists(&r), &r, packed);
        }
        self.no_dense_fallback(v)?;
        let (key, a_is_dy) = GemmKey::for_weight_grad(
            &self.shape(a),
            &self.shape(dy),
            &self.shape(b),
            transpose_b,
            self.opts.dtype,
        )?;
        let (pa, pdy) = (self.ptr(a), self.ptr(dy));
        let (first, second) = if a_is_dy { (pdy, pa) } else { (pa, pdy) };
        let out = self.ptr(v);
        let gemm = self
            .gemm
            .as_mut()
            .expect("invariant: created for graphs with GEMMs");
        // SAFETY: live buffers with the key's sizes; the output is this node's own slot.
        // `gemm` takes cuBLASLt's "B" operand first, then its "A".
        unsafe { gemm.gemm(&key, second, first, None, out, l.stream) }
    }
}

impl CudaProgram {
    /// Issues attention backward group `f` (module docs).
    pub(super) fn run_flash(&self, f: &FlashBwd, l: &Launcher) -> Result<(), CudaError> {
        let probs = self.graph.node(f.probs);
        let Op::AttentionProbs(spec) = &probs.op else {
            unreachable!("invariant: a flash group starts from AttentionProbs")
        };
        // (q, k, v, dy, probs), the same for the three gradients.
        let ins = self.graph.node(f.dq).inputs.clone();
        let (q, k) = (self.shape(ins[0]), self.shape(ins[1]));
        let dims = [q[0], q[1], k[1], q[2], k[2], q[3]];
        if dims.contains(&0) {
            // Nothing to attend: every gradient is zero.
            for v in f.grads() {
                l.memset(self.ptr(v), 0, self.numel(v) * self.elem(v))?;
            }
            return Ok(());
        }
        let layout = FlashScratch::of(&self.graph, f, &self.storage);
        let at = |off: usize| self.scratch.ptr + off as u64;
        let dt = self.dt();
        let mask = self.f32_mask(probs.inputs.get(2).copied(), at(layout.mask), l)?;
        let dq = self.ptr(f.dq);
        // f32: dQ accumulates in its own slot; bf16: in the f32 scratch, cast after.
        let dq_acc = match self.opts.dtype {
            GpuDType::F32 => dq,
            GpuDType::Bf16 => at(layout.dq_acc),
        };
        let p = |i: usize| self.ptr(ins[i]);
        let q_offset = dims[2] as i64 - dims[1] as i64;
        let attn = (spec.scale.0, spec.causal, spec.window, q_offset);
        let tc = self.opts.tensor_core_attention;
        // The forward's output and lse where it kept them, else the forward run again.
        let (out, lse) = match f.forward {
            Some(a) => {
                let o = self.ptr(a);
                (
                    o,
                    o + saved_lse_offset(&self.graph, a, self.opts.dtype) as u64,
                )
            }
            None => {
                let (out, lse) = (at(layout.out), at(layout.lse));
                l.attention_lse(dt, [p(0), p(1), p(2)], out, mask, lse, dims, attn, tc)?;
                (out, lse)
            }
        };
        let delta = at(layout.delta);
        l.attention_bwd_prep(dt, out, p(3), delta, dq_acc, dims)?;
        let grads = (dq_acc, self.ptr(f.dk), self.ptr(f.dv));
        l.attention_bwd(
            dt,
            [p(0), p(1), p(2), p(3)],
            (lse, delta, mask),
            grads,
            dims,
            attn,
            tc,
        )?;
        if self.opts.dtype == GpuDType::Bf16 {
            l.convert("cast_f32_bf16", dq_acc, dq, self.numel(f.dq))?;
        }
        Ok(())
    }
}
