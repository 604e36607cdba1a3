//! Compute nodes on the compute stream: one kernel (or cuBLASLt call) per node, the fused
//! groups of `plan.rs`, and the rewriter's fused ops (`FusedElementwise` through a generated
//! kernel, `FusedMatMul` as a GEMM with a cuBLASLt epilogue or a generated epilogue kernel,
//! `AddRmsNorm`).
//!
//! Pre: every operand was produced earlier on the compute stream (or waited for, for
//! collective results); the output slot is free (`CudaProgram::guard` ran).

use super::gemm::{Epilogue, GemmKey};
use super::ops::Launcher;
use super::plan::{attention_scratch, fused_expr, FusedGroup, GpuDType};
use super::program::CudaProgram;
use super::rank::CudaRankCtx;
use super::routed::{routing_gates, Routing};
use super::strided::StridedSpec;
use super::support::check_labels;
use super::CudaError;
use crate::cpu::vocab;
use crate::RuntimeError;
use shardc_compiler::ir::{DType, EwExpr, EwStep, Node, Op, UnaryOp, ValueId, CROSS_ENTROPY_STATS};

/// The cuBLASLt epilogue equal to a `FusedMatMul` epilogue program, if any: `x0 + x1` with a
/// 1-D `x1` of length N (bias), that then `gelu_tanh`, or `gelu_tanh(x0)`.
pub fn cublas_epilogue(
    epilogue: &EwExpr,
    operand_shapes: &[Vec<usize>],
    n: usize,
) -> Option<Epilogue> {
    let bias_ok = operand_shapes.len() == 1 && operand_shapes[0] == [n];
    let gelu = |f: UnaryOp| f == UnaryOp::GeluTanh;
    match epilogue.steps.as_slice() {
        [EwStep::Add { a: 0, b: 1 }] if bias_ok => Some(Epilogue::Bias),
        [EwStep::Add { a: 0, b: 1 }, EwStep::Unary { f, x: 2 }] if bias_ok && gelu(*f) => {
            Some(Epilogue::GeluBias)
        }
        [EwStep::Unary { f, x: 0 }] if operand_shapes.is_empty() && gelu(*f) => {
            Some(Epilogue::Gelu)
        }
        _ => None,
    }
}

impl CudaProgram {
    pub(super) fn dt(&self) -> shardc_kernels::KernelDType {
        self.opts.dtype.kernel()
    }

    pub(super) fn elem(&self, v: ValueId) -> usize {
        self.storage[v.index()].size_bytes()
    }

    /// The host-side checks of node `v`'s integer operands uploaded from the host (token ids
    /// inside the embedding table, labels inside the vocabulary), which the kernels do not
    /// make. Eager launches call it per node; a CUDA graph replay calls it for every node
    /// before replaying, since the captured launches do not run host code.
    pub(super) fn check_host_values(&self, v: ValueId) -> Result<(), CudaError> {
        let node = self.graph.node(v);
        let Some(&ids) = node.inputs.get(1) else {
            return Ok(());
        };
        let Some(host) = &self.host_i32[ids.index()] else {
            return Ok(());
        };
        let vocab_n = self.graph.ty(node.inputs[0]).last();
        match &node.op {
            Op::Embedding if !self.local_ids[ids.index()] => {
                vocab::check_ids(host, self.shape(node.inputs[0])[0])?
            }
            Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => check_labels(host, vocab_n)?,
            Op::CrossEntropyStats { parts, .. } => check_labels(host, vocab_n * parts)?,
            Op::CrossEntropyShardGrad { .. } => {
                let shards = self.graph.ty(node.inputs[2]).last() / CROSS_ENTROPY_STATS;
                check_labels(host, node.ty.last() * shards)?
            }
            _ => {}
        }
        Ok(())
    }

    /// `Rope` or `RopeGrad` node `v` of style `style` (the gradient rotates by the negated
    /// angles: its frequency table, loaded at prepare, is negated).
    pub(super) fn rope_node(
        &self,
        v: ValueId,
        style: shardc_compiler::ir::RopeStyle,
        l: &Launcher,
    ) -> Result<(), CudaError> {
        let node = self.graph.node(v);
        let s = node.ty.shape();
        let inv = self.rope[v.index()]
            .as_ref()
            .expect("invariant: rope tables are loaded")
            .ptr;
        let (x, pos) = (self.ptr(node.inputs[0]), self.ptr(node.inputs[1]));
        l.rope(
            style,
            self.dt(),
            x,
            self.ptr(v),
            pos,
            inv,
            [s[0], s[1], s[2], s[3]],
        )
    }

    /// The device address of attention key mask `mask` as the kernels read it (f32 `[B, S]`):
    /// its own buffer in an f32 run, converted into `at` (scratch) in a bf16 one; 0 for none.
    pub(super) fn f32_mask(
        &self,
        mask: Option<ValueId>,
        at: u64,
        l: &Launcher,
    ) -> Result<u64, CudaError> {
        match mask {
            None => Ok(0),
            Some(m) if self.opts.dtype == GpuDType::F32 => Ok(self.ptr(m)),
            Some(m) => l
                .convert("cast_bf16_f32", self.ptr(m), at, self.numel(m))
                .map(|()| at),
        }
    }

    pub(super) fn unsupported(&self, v: ValueId, detail: impl Into<String>) -> CudaError {
        let node = self.graph.node(v);
        CudaError::Unsupported {
            node: v,
            name: node.name.clone(),
            op: node.op.mnemonic(),
            detail: detail.into(),
        }
    }

    pub(super) fn strided_spec(
        &self,
        v: ValueId,
        spec: Result<StridedSpec, super::strided::RankTooHigh>,
    ) -> Result<StridedSpec, CudaError> {
        spec.map_err(|r| self.unsupported(v, format!("rank {} above 8", r.0)))
    }

    /// Enqueues one node on the compute stream.
    pub(super) fn run_node(
        &mut self,
        v: ValueId,
        ctx: &CudaRankCtx,
        l: &Launcher,
    ) -> Result<(), CudaError> {
        let node = self.graph.node(v).clone();
        let ins = &node.inputs;
        let out = self.ptr(v);
        let n = self.numel(v);
        let dt = self.dt();
        let x = ins.first().map(|&i| self.ptr(i)).unwrap_or(0);
        match &node.op {
            Op::Reshape => l.copy(out, x, n * self.elem(v)),
            Op::Transpose { perm } => {
                let spec =
                    self.strided_spec(v, StridedSpec::transpose(&self.shape(ins[0]), perm))?;
                l.strided(self.elem(v), x, out, &spec)
            }
            Op::Slice { dim, start, len } => {
                let spec = self.strided_spec(
                    v,
                    StridedSpec::slice(&self.shape(ins[0]), *dim, *start, *len),
                )?;
                l.strided(self.elem(v), x, out, &spec)
            }
            Op::LocalSlice { axis, dim, parts } => {
                let coord = crate::rank::part_coord(self.coord(axis)?, axis, *parts)?;
                let shape = self.shape(ins[0]);
                let chunk = shape[*dim] / parts;
                let spec =
                    self.strided_spec(v, StridedSpec::slice(&shape, *dim, coord * chunk, chunk))?;
                l.strided(self.elem(v), x, out, &spec)
            }
            Op::Concat { dim } => {
                let out_shape = node.ty.shape();
                let mut offset = 0;
                for &i in ins {
                    let s = self.shape(i);
                    let spec =
                        self.strided_spec(v, StridedSpec::place(&s, &out_shape, *dim, offset))?;
                    l.strided(self.elem(v), self.ptr(i), out, &spec)?;
                    offset += s[*dim];
                }
                Ok(())
            }
            Op::Repeat { dim, times } => {
                let spec =
                    self.strided_spec(v, StridedSpec::repeat(&self.shape(ins[0]), *dim, *times))?;
                l.strided(self.elem(v), x, out, &spec)
            }
            Op::RankOffset { axis, stride } => {
                let (coord, _) = self.coord(axis)?;
                l.rank_offset(x, out, n, (coord * stride) as i32)
            }
            Op::Embedding => {
                let table = self.shape(ins[0]);
                self.check_host_values(v)?;
                l.embedding(
                    dt,
                    x,
                    self.ptr(ins[1]),
                    out,
                    self.numel(ins[1]),
                    table[0],
                    table[1],
                )
            }
            Op::MatMul { .. } if self.routed_gemm(v, l)? => Ok(()),
            Op::MatMul { transpose_b } => {
                let key = GemmKey::for_matmul(
                    &self.shape(ins[0]),
                    &self.shape(ins[1]),
                    *transpose_b,
                    self.opts.dtype,
                    Epilogue::None,
                )?;
                let w = self.ptr(ins[1]);
                let gemm = self
                    .gemm
                    .as_mut()
                    .expect("invariant: created for graphs with MatMul");
                // SAFETY: pointers of live buffers with the key's sizes; out is its own slot.
                unsafe { gemm.gemm(&key, x, w, None, out, l.stream) }
            }
            Op::Add | Op::Mul => {
                let op = if matches!(node.op, Op::Add) {
                    "add"
                } else {
                    "mul"
                };
                l.binary(op, dt, x, self.ptr(ins[1]), out, n, self.numel(ins[1]))
            }
            Op::Unary(u) => l.unary(*u, dt, x, out, n),
            Op::Scale(c) => l.scale(dt, x, out, n, c.0),
            Op::Cast(to) => match (self.opts.dtype, to) {
                (GpuDType::F32, DType::Bf16) => l.convert("round_bf16_f32", x, out, n),
                (_, DType::F32 | DType::Bf16) => l.copy(out, x, n * self.elem(v)),
                _ => Err(self.unsupported(v, format!("cast to {to}"))),
            },
            Op::RmsNorm { eps } => {
                let h = node.ty.last();
                l.rmsnorm(dt, x, self.ptr(ins[1]), out, n / h.max(1), h, eps.0)
            }
            Op::LayerNorm { eps } => {
                let h = node.ty.last();
                l.layernorm(
                    dt,
                    x,
                    self.ptr(ins[1]),
                    self.ptr(ins[2]),
                    out,
                    n / h.max(1),
                    h,
                    eps.0,
                )
            }
            Op::Rope(spec) => self.rope_node(v, spec.style, l),
            Op::Attention(spec) => {
                let (q, k) = (self.shape(ins[0]), self.shape(ins[1]));
                let scratch = attention_scratch(
                    &self.graph,
                    &node,
                    self.dev.sm_count(),
                    self.opts.split_kv_attention,
                );
                let mask = self.f32_mask(ins.get(3).copied(), self.scratch.ptr, l)?;
                let dims = [q[0], q[1], k[1], q[2], k[2], q[3]];
                let q_offset = k[1] as i64 - q[1] as i64;
                // A backward group reads this output and its lse rows (flash.rs).
                if let Some(at) = self.fusion.saved_lse(&self.graph, v, self.opts.dtype) {
                    let masking = (spec.scale.0, spec.causal, spec.window, q_offset);
                    let (k, vv) = (self.ptr(ins[1]), self.ptr(ins[2]));
                    let lse = out + at as u64;
                    let tc = self.opts.tensor_core_attention;
                    return l.attention_lse(dt, [x, k, vv], out, mask, lse, dims, masking, tc);
                }
                let workspace = (
                    self.scratch.ptr + scratch.workspace_offset as u64,
                    scratch.workspace_bytes,
                );
                l.attention(
                    dt,
                    x,
                    self.ptr(ins[1]),
                    self.ptr(ins[2]),
                    out,
                    mask,
                    dims,
                    spec.scale.0,
                    spec.causal,
                    spec.window,
                    q_offset,
                    self.opts.tensor_core_attention,
                    workspace,
                )
            }
            Op::Softmax => {
                let c = node.ty.last();
                l.softmax(dt, x, out, n / c.max(1), c)
            }
            Op::Router { top_k, normalize } => {
                let e = node.ty.last();
                l.router(dt, x, out, n / e.max(1), e, *top_k, *normalize)
            }
            Op::Dispatch | Op::Combine => {
                // (tokens, experts, hidden) of `x[B,T,H]` and gates `[B,T,E]` (dispatch), or
                // of `x[E,B,T,H]` (combine).
                let s = self.shape(ins[0]);
                let (op, dims) = if node.op == Op::Dispatch {
                    ("dispatch", (s[0] * s[1], self.shape(ins[1])[2], s[2]))
                } else {
                    ("combine", (s[1] * s[2], s[0], s[3]))
                };
                let (tokens, experts, hidden) = dims;
                // The [E, tokens, H] side: the dispatch's output, the combine's input.
                let expert_major = if node.op == Op::Dispatch { v } else { ins[0] };
                let pos = self.positions_of(expert_major);
                l.moe_move(
                    op,
                    dt,
                    [x, self.ptr(ins[1]), out, pos],
                    tokens,
                    experts,
                    hidden,
                )
            }
            Op::CrossEntropy { denom } => {
                let vocab_n = self.graph.ty(ins[0]).last();
                let rows = self.numel(ins[1]);
                self.check_host_values(v)?;
                let loss = self.scratch.ptr;
                l.cross_entropy(dt, x, self.ptr(ins[1]), loss, rows, vocab_n)?;
                self.loss_sum(loss, out, rows, *denom, l)
            }
            Op::CrossEntropyStats { axis, parts } => {
                let coord = crate::rank::part_coord(self.coord(axis)?, axis, *parts)?;
                let vocab_n = self.graph.ty(ins[0]).last();
                let total = vocab_n * parts;
                let rows = self.numel(ins[1]);
                self.check_host_values(v)?;
                let labels = self.ptr(ins[1]);
                let lo = coord * vocab_n;
                l.cross_entropy_stats(dt, x, labels, out, rows, vocab_n, lo, total)
            }
            Op::CrossEntropyFromStats { denom } => {
                let shards = self.graph.ty(ins[0]).last() / CROSS_ENTROPY_STATS;
                let rows = self.numel(ins[1]);
                let loss = self.scratch.ptr;
                l.cross_entropy_from_stats(dt, x, self.ptr(ins[1]), loss, rows, shards)?;
                self.loss_sum(loss, out, rows, *denom, l)
            }
            Op::CrossEntropyShardGrad { axis, denom } => {
                let (coord, size) = self.coord(axis)?;
                let vocab_n = node.ty.last();
                let shards = self.graph.ty(ins[2]).last() / CROSS_ENTROPY_STATS;
                if coord >= shards {
                    return Err(RuntimeError::AxisSize {
                        axis: axis.clone(),
                        expected: shards,
                        found: size,
                    }
                    .into());
                }
                let rows = self.numel(ins[1]);
                self.check_host_values(v)?;
                let (labels, stats) = (self.ptr(ins[1]), self.ptr(ins[2]));
                let scale = 1.0 / (*denom).max(1) as f32;
                let lo = coord * vocab_n;
                l.cross_entropy_shard_grad(
                    dt, x, labels, stats, out, rows, vocab_n, shards, lo, scale,
                )
            }
            Op::FusedElementwise { expr } => {
                let operands: Vec<(u64, usize)> =
                    ins.iter().map(|&i| (self.ptr(i), self.numel(i))).collect();
                self.fused_elementwise(v, expr, &operands, out, n, l)
            }
            Op::FusedMatMul {
                transpose_b,
                epilogue,
            } => self.fused_matmul(v, &node, *transpose_b, epilogue, l),
            Op::AddRmsNorm { eps } => {
                let h = node.ty.last();
                // The sum is not a value of the graph: it goes to scratch.
                let sum = self.scratch.ptr;
                let (a, b, w) = (x, self.ptr(ins[1]), self.ptr(ins[2]));
                l.add_rmsnorm(dt, a, b, sum, w, out, n / h.max(1), h, eps.0)
            }
            Op::AgMatMul { .. } | Op::MatMulRs { .. } => self.ring_matmul(v, ctx, l),
            _ => self
                .run_train_node(v, &node, l)
                .unwrap_or_else(|| Err(self.unsupported(v, "no CUDA kernel for this op"))),
        }
    }

    /// `out = Σ loss / denom` over the f32 per-row `loss[rows]` in the compute scratch, in the
    /// backend's dtype (the f32 sum goes through the scratch after the losses under bf16).
    fn loss_sum(
        &self,
        loss: u64,
        out: u64,
        rows: usize,
        denom: usize,
        l: &Launcher,
    ) -> Result<(), CudaError> {
        let scale = 1.0 / denom.max(1) as f32;
        if self.opts.dtype == GpuDType::F32 {
            l.loss_sum(loss, out, rows, scale)
        } else {
            let sum = loss + (rows as u64 * 4).div_ceil(256) * 256;
            l.loss_sum(loss, sum, rows, scale)?;
            l.convert("cast_f32_bf16", sum, out, 1)
        }
    }

    /// Runs MatMul `v` as a routed expert GEMM (`routed.rs`) when it is one and the kernel
    /// takes its operands; `false`: run it densely.
    fn routed_gemm(&self, v: ValueId, l: &Launcher) -> Result<bool, CudaError> {
        let Some(r) = self.runs_routed(v) else {
            self.no_dense_fallback(v)?;
            return Ok(false);
        };
        let node = self.graph.node(v);
        let (a, w, out) = (
            self.ptr(node.inputs[0]),
            self.ptr(node.inputs[1]),
            self.ptr(v),
        );
        // Rows no expert takes are zero (the dense result there), unless nothing reads them
        // and the readers relied on for that run routed too (`Routing::unfilled`), or the
        // output is packed (it holds the routed rows only).
        let packed = self.routing.packed_flags(&self.graph, v);
        let unread = packed & 2 != 0
            || self.routing.unfilled[v.index()]
                .as_ref()
                .is_some_and(|must| must.iter().all(|&u| self.runs_routed(u).is_some()));
        if !unread {
            l.memset(out, 0, self.numel(v) * self.elem(v))?;
        }
        l.routed(
            self.dt(),
            false,
            [a, w, out],
            self.route_lists(&r),
            &r,
            packed,
        )?;
        Ok(true)
    }

    /// An expert GEMM or weight gradient about to run densely: an error when it reads or writes
    /// a packed value (those hold the routed rows only, which the routed kernels alone address;
    /// they fall back only when an operand's address is not 16-byte aligned).
    pub(super) fn no_dense_fallback(&self, v: ValueId) -> Result<(), CudaError> {
        if !self.routing.touches_packed(&self.graph, v) {
            return Ok(());
        }
        Err(self.unsupported(
            v,
            "an operand holds packed expert rows but the routed kernel does not take this call \
             (an operand's address is not 16-byte aligned); run with routed experts off",
        ))
    }

    /// Before routing source `v` (a `Dispatch` or `CombineGrad { wrt: y }`) runs: its gates'
    /// per-expert lists of routed rows, for the routed GEMMs that read them, and the packed
    /// rows' map, for the source itself when it writes packed and for what reads packed values.
    pub(super) fn index_routes(&self, v: ValueId, l: &Launcher) -> Result<(), CudaError> {
        let Some(index) = &self.route_index[v.index()] else {
            return Ok(());
        };
        let Some(&(_, experts, tokens)) = self.routing.sources.iter().find(|s| s.0 == v) else {
            return Ok(());
        };
        let gates = self.ptr(routing_gates(&self.graph, v));
        let parts = Routing::index_parts(index.ptr, experts, tokens);
        l.moe_route_index(self.dt(), gates, parts, tokens, experts)
    }

    /// Enqueues one fused group on the compute stream.
    pub(super) fn run_group(&mut self, group: &FusedGroup, l: &Launcher) -> Result<(), CudaError> {
        let dt = self.dt();
        match group {
            FusedGroup::Gemm {
                mm,
                bias,
                out,
                epilogue,
            } => {
                let node = self.graph.node(*mm);
                let (a, b) = (node.inputs[0], node.inputs[1]);
                let Op::MatMul { transpose_b } = node.op else {
                    unreachable!("invariant: a GEMM group starts at a MatMul")
                };
                let key = GemmKey::for_matmul(
                    &self.shape(a),
                    &self.shape(b),
                    transpose_b,
                    self.opts.dtype,
                    *epilogue,
                )?;
                let (pa, pb, po) = (self.ptr(a), self.ptr(b), self.ptr(*out));
                let pbias = bias.map(|x| self.ptr(x));
                let gemm = self
                    .gemm
                    .as_mut()
                    .expect("invariant: created for graphs with MatMul");
                // SAFETY: live buffers with the key's sizes; the output slot was checked free
                // of every value live between the MatMul and the group's tail (plan.rs).
                unsafe { gemm.gemm(&key, pa, pb, pbias, po, l.stream) }
            }
            FusedGroup::AddRmsNorm { add, norm } => {
                let a = self.graph.node(*add);
                let nn = self.graph.node(*norm);
                let Op::RmsNorm { eps } = nn.op else {
                    unreachable!("invariant: add+rmsnorm ends at an RmsNorm")
                };
                let h = nn.ty.last();
                let rows = nn.ty.numel() / h.max(1);
                l.add_rmsnorm(
                    dt,
                    self.ptr(a.inputs[0]),
                    self.ptr(a.inputs[1]),
                    self.ptr(*add),
                    self.ptr(nn.inputs[1]),
                    self.ptr(*norm),
                    rows,
                    h,
                    eps.0,
                )
            }
            FusedGroup::Siblings(s) => {
                let node = self.graph.node(s.mms[0]);
                let (a, w) = (node.inputs[0], node.inputs[1]);
                let key = self.sibling_key(s)?;
                let (pa, pw, po) = (self.ptr(a), self.ptr(w), self.ptr(s.mms[0]));
                let gemm = self
                    .gemm
                    .as_mut()
                    .expect("invariant: created for graphs with MatMul");
                // SAFETY: the members' weights were uploaded `w_stride` apart from the
                // first's (`load_params`) and their outputs planned as one block, `out_stride`
                // apart (plan.rs), each checked free of every value live from the head on.
                unsafe { gemm.gemm(&key, pa, pw, None, po, l.stream) }
            }
            FusedGroup::AttentionBwd(f) => self.run_flash(f, l),
            FusedGroup::SwiGlu { mul, gate, up, .. } => l.swiglu(
                dt,
                self.ptr(*gate),
                self.ptr(*up),
                self.ptr(*mul),
                self.numel(*mul),
            ),
        }
    }

    /// `FusedElementwise`: one generated kernel.
    fn fused_elementwise(
        &self,
        v: ValueId,
        expr: &EwExpr,
        operands: &[(u64, usize)],
        out: u64,
        n: usize,
        l: &Launcher,
    ) -> Result<(), CudaError> {
        let fe = fused_expr(expr, operands.len(), self.opts.dtype)
            .ok_or_else(|| self.unsupported(v, "a cast inside the fused program"))?;
        let k = fe.num_inputs();
        let f = self.dev.fused_function(&fe, self.dt())?;
        l.fused(&f, self.dt(), &operands[..k], out, n)
    }

    /// `FusedMatMul`: the GEMM with a cuBLASLt epilogue when one matches, else the plain GEMM
    /// into the output followed by the epilogue kernel in place.
    fn fused_matmul(
        &mut self,
        v: ValueId,
        node: &Node,
        transpose_b: bool,
        epilogue: &EwExpr,
        l: &Launcher,
    ) -> Result<(), CudaError> {
        let ins = &node.inputs;
        let (a, b) = (self.shape(ins[0]), self.shape(ins[1]));
        let extra: Vec<Vec<usize>> = ins[2..].iter().map(|&i| self.shape(i)).collect();
        let n = node.ty.last();
        let lt = if b.len() == 2 {
            cublas_epilogue(epilogue, &extra, n)
        } else {
            None
        };
        let out = self.ptr(v);
        let key = GemmKey::for_matmul(
            &a,
            &b,
            transpose_b,
            self.opts.dtype,
            lt.unwrap_or(Epilogue::None),
        )?;
        let (pa, pb) = (self.ptr(ins[0]), self.ptr(ins[1]));
        let bias = ins.get(2).map(|&i| self.ptr(i));
        let gemm = self
            .gemm
            .as_mut()
            .expect("invariant: created for graphs with GEMMs");
        // SAFETY: live buffers with the key's sizes; the output is this node's slot.
        unsafe { gemm.gemm(&key, pa, pb, bias.filter(|_| lt.is_some()), out, l.stream) }?;
        if lt.is_some() {
            return Ok(());
        }
        let mut operands = vec![(out, node.ty.numel())];
        operands.extend(ins[2..].iter().map(|&i| (self.ptr(i), self.numel(i))));
        self.fused_elementwise(v, epilogue, &operands, out, node.ty.numel(), l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_compiler::ir::Float;

    #[test]
    fn ir_programs_become_kernel_expressions() {
        let e = EwExpr {
            steps: vec![
                EwStep::Unary {
                    f: UnaryOp::Silu,
                    x: 0,
                },
                EwStep::Mul { a: 2, b: 1 },
                EwStep::Scale {
                    c: Float(0.5),
                    x: 3,
                },
            ],
        };
        let f = fused_expr(&e, 2, GpuDType::F32).unwrap();
        assert_eq!(f.to_string(), "mul(mul(silu(x0), x1), 0.5)");
        let cast = EwExpr {
            steps: vec![EwStep::Cast {
                to: DType::Bf16,
                x: 0,
            }],
        };
        assert!(fused_expr(&cast, 1, GpuDType::F32).is_none());
        assert_eq!(
            fused_expr(&cast, 1, GpuDType::Bf16).unwrap().to_string(),
            "x0"
        );
        assert!(fused_expr(&EwExpr { steps: vec![] }, 1, GpuDType::F32).is_none());
    }

    #[test]
    fn epilogues_map_to_cublaslt_only_when_equal() {
        let bias = EwExpr {
            steps: vec![EwStep::Add { a: 0, b: 1 }],
        };
        assert_eq!(
            cublas_epilogue(&bias, &[vec![64]], 64),
            Some(Epilogue::Bias)
        );
        // A bias of another shape (a residual [T, N]) is not a cuBLASLt bias.
        assert_eq!(cublas_epilogue(&bias, &[vec![16, 64]], 64), None);
        let gelu_bias = EwExpr {
            steps: vec![
                EwStep::Add { a: 0, b: 1 },
                EwStep::Unary {
                    f: UnaryOp::GeluTanh,
                    x: 2,
                },
            ],
        };
        assert_eq!(
            cublas_epilogue(&gelu_bias, &[vec![64]], 64),
            Some(Epilogue::GeluBias)
        );
        let erf = EwExpr {
            steps: vec![EwStep::Unary {
                f: UnaryOp::GeluErf,
                x: 0,
            }],
        };
        assert_eq!(cublas_epilogue(&erf, &[], 64), None);
    }
}
