//! Everything a run would otherwise set up lazily, done at prepare time: every kernel module
//! compiled and loaded, the generated fused kernels, the cuBLASLt plans of the program's
//! GEMMs; and a barrier on every communicator before a rank's first run.
//!
//! Why: loading a module or building a GEMM plan while a peer rank's collective kernel spins
//! on the same GPU can stall both (the load waits for the device, the collective for this
//! rank). After [`CudaProgram::warm_up`] and [`CudaProgram::barrier`] every rank enqueues its
//! first collective with nothing left to load. What cannot be foreseen (a GEMM whose operand
//! pointers turn out less aligned than assumed) still builds on first use.

use super::comm::device::{DeviceBuffer, DeviceCollective, DeviceDType};
use super::gemm::{pointer_alignment, Epilogue, GemmKey};
use super::node::cublas_epilogue;
use super::plan::{fused_expr, Action, FusedGroup, SiblingGemms};
use super::program::CudaProgram;
use super::rank::CudaRankCtx;
use super::routed::{RoutedGemm, Routing};
use super::CudaError;
use crate::comm::ReduceOp;
use shardc_compiler::ir::{Node, Op, ValueId};
use shardc_kernels::launch::routed_gemm_supported;

impl CudaProgram {
    /// Loads every kernel module and every fused kernel the program uses and builds the
    /// cuBLASLt plans of its GEMMs. Called by [`CudaProgram::prepare`].
    pub(super) fn warm_up(&mut self) -> Result<(), CudaError> {
        self.dev.preload_kernels();
        let dt = self.opts.dtype;
        let mut keys = Vec::new();
        for v in self.graph.ids() {
            let node = self.graph.node(v).clone();
            match self.fusion.actions[v.index()] {
                Action::Skip => continue,
                Action::Fused(g) => {
                    match &self.fusion.groups[g] {
                        &FusedGroup::Gemm {
                            mm,
                            bias,
                            out,
                            epilogue,
                        } => {
                            let n = self.graph.node(mm).clone();
                            let ptrs = [Some(n.inputs[0]), Some(n.inputs[1]), bias, Some(out)];
                            keys.push(self.matmul_key(&n, epilogue, &ptrs)?);
                        }
                        FusedGroup::Siblings(s) => {
                            let n = self.graph.node(s.mms[0]);
                            let ptrs = [Some(n.inputs[0]), Some(n.inputs[1]), Some(s.mms[0])];
                            keys.push(GemmKey {
                                align: self.alignment(&ptrs),
                                ..self.sibling_key(s)?
                            });
                        }
                        _ => {}
                    }
                    continue;
                }
                Action::Run => {}
            }
            match &node.op {
                // A routed expert GEMM or weight gradient the routed kernels take needs no plan.
                Op::MatMul { .. } | Op::WeightGrad { .. } if self.runs_routed(v).is_some() => {}
                Op::MatMul { .. } => {
                    let ptrs = [Some(node.inputs[0]), Some(node.inputs[1]), Some(v)];
                    keys.push(self.matmul_key(&node, Epilogue::None, &ptrs)?);
                }
                Op::FusedMatMul { epilogue, .. } => {
                    let extra: Vec<Vec<usize>> =
                        node.inputs[2..].iter().map(|&i| self.shape(i)).collect();
                    let b = self.shape(node.inputs[1]);
                    let lt = if b.len() == 2 {
                        cublas_epilogue(epilogue, &extra, node.ty.last())
                    } else {
                        None
                    };
                    let ptrs = [Some(node.inputs[0]), Some(node.inputs[1]), Some(v)];
                    keys.push(self.matmul_key(&node, lt.unwrap_or(Epilogue::None), &ptrs)?);
                    if lt.is_none() {
                        self.preload_fused(epilogue, node.inputs.len() - 1)?;
                    }
                }
                Op::FusedElementwise { expr } => self.preload_fused(expr, node.inputs.len())?,
                Op::WeightGrad { transpose_b } => {
                    let (a, dy, b) = (node.inputs[0], node.inputs[1], node.inputs[2]);
                    let (key, _) = GemmKey::for_weight_grad(
                        &self.shape(a),
                        &self.shape(dy),
                        &self.shape(b),
                        *transpose_b,
                        dt,
                    )?;
                    keys.push(GemmKey {
                        align: self.alignment(&[Some(a), Some(dy), Some(v)]),
                        ..key
                    });
                }
                _ => {}
            }
        }
        if let Some(gemm) = self.gemm.as_mut() {
            for key in &keys {
                gemm.warm(key, &self.compute)?;
            }
        }
        Ok(())
    }

    /// How `v` runs on the routed kernels (`routed.rs`), if it does: a routed GEMM or weight
    /// gradient whose source has an index, with operands the kernel takes. `None` too while an
    /// operand is an input not uploaded yet (at prepare time: its alignment is not known).
    pub(super) fn runs_routed(&self, v: ValueId) -> Option<RoutedGemm> {
        let (gemm, wg) = (
            self.routing.gemms[v.index()],
            self.routing.weight_grads[v.index()],
        );
        let r = gemm.or(wg)?;
        let ins = &self.graph.node(v).inputs;
        let known = |x: ValueId| {
            let pending = matches!(self.graph.node(x).op, Op::Input { .. })
                && self.inputs[x.index()].is_none();
            (!pending).then(|| self.ptr(x))
        };
        let ptrs = [known(ins[0])?, known(ins[1])?, known(v)?];
        let takes = routed_gemm_supported(self.dt(), r.k, r.n, ptrs);
        (self.route_index[r.source.index()].is_some() && takes).then_some(r)
    }

    /// The device addresses of the counts and row lists of `r`'s routing source.
    pub(super) fn route_lists(&self, r: &RoutedGemm) -> (u64, u64) {
        let index = self.route_index[r.source.index()]
            .as_ref()
            .map_or(0, |b| b.ptr);
        let [counts, rows, _] = Routing::index_parts(index, r.experts, r.tokens);
        (counts, rows)
    }

    /// The packed rows' map (`pos[tokens · E]`, `moe_route_positions`) a dispatch, combine or
    /// gradient of them goes through for its `[E, tokens, ·]` operand `x`: 0 (none) when `x` is
    /// dense.
    pub(super) fn positions_of(&self, x: ValueId) -> u64 {
        let Some(p) = self.routing.packed[x.index()] else {
            return 0;
        };
        let Some(&(_, experts, tokens)) = self.routing.sources.iter().find(|s| s.0 == p.source)
        else {
            return 0;
        };
        self.route_index[p.source.index()]
            .as_ref()
            .map_or(0, |b| Routing::index_parts(b.ptr, experts, tokens)[2])
    }

    /// The GEMM of sibling group `s`: its weights and outputs `w_stride` / `out_stride` apart.
    pub(super) fn sibling_key(&self, s: &SiblingGemms) -> Result<GemmKey, CudaError> {
        let node = self.graph.node(s.mms[0]);
        let Op::MatMul { transpose_b } = node.op else {
            unreachable!("invariant: sibling groups are MatMuls")
        };
        let (a, w) = (node.inputs[0], node.inputs[1]);
        let w_elem = self.storage[w.index()].size_bytes() as u64;
        let out_elem = self.storage[s.mms[0].index()].size_bytes() as u64;
        let key = GemmKey::for_matmul(
            &self.shape(a),
            &self.shape(w),
            transpose_b,
            self.opts.dtype,
            Epilogue::None,
        )?;
        Ok(key.siblings(
            s.mms.len(),
            (s.w_stride / w_elem) as i64,
            (s.out_stride / out_elem) as i64,
        )?)
    }

    /// The GEMM key of MatMul-headed `node` with `epilogue`, aligned for the known pointers
    /// among `ptrs`.
    fn matmul_key(
        &self,
        node: &Node,
        epilogue: Epilogue,
        ptrs: &[Option<ValueId>],
    ) -> Result<GemmKey, CudaError> {
        let transpose_b = match node.op {
            Op::MatMul { transpose_b } | Op::FusedMatMul { transpose_b, .. } => transpose_b,
            _ => unreachable!("invariant: called for MatMul and FusedMatMul"),
        };
        let key = GemmKey::for_matmul(
            &self.shape(node.inputs[0]),
            &self.shape(node.inputs[1]),
            transpose_b,
            self.opts.dtype,
            epilogue,
        )?;
        Ok(GemmKey {
            align: self.alignment(ptrs),
            ..key
        })
    }

    /// The alignment [`GemmCache::gemm`](super::gemm::GemmCache) will compute from these
    /// values' addresses; an input (not uploaded yet) counts as its buffer's 256 bytes.
    fn alignment(&self, values: &[Option<ValueId>]) -> u32 {
        let ptrs: Vec<u64> = values
            .iter()
            .flatten()
            .filter(|&&v| !matches!(self.graph.node(v).op, Op::Input { .. }))
            .map(|&v| self.ptr(v))
            .collect();
        pointer_alignment(&ptrs)
    }

    fn preload_fused(
        &self,
        expr: &shardc_compiler::ir::EwExpr,
        operands: usize,
    ) -> Result<(), CudaError> {
        if let Some(fe) = fused_expr(expr, operands, self.opts.dtype) {
            self.dev.fused_function(&fe, self.dt())?;
        }
        Ok(())
    }

    /// Waits until every rank of every group of `ctx` has reached this point: a one-element
    /// all-reduce on each communicator, waited for with the watchdog. A rank that failed to
    /// prepare has aborted its communicators, so its peers fail here, naming the collective,
    /// instead of inside the program.
    pub fn barrier(&self, ctx: &CudaRankCtx) -> Result<(), CudaError> {
        let (send, recv) = (
            self.comm_scratch.ptr,
            self.comm_scratch.ptr + self.comm_half,
        );
        for (axis, comm) in ctx.comms() {
            let c = DeviceCollective::AllReduce {
                send: DeviceBuffer::new(send, 1, DeviceDType::F32),
                recv: DeviceBuffer::new(recv, 1, DeviceDType::F32),
                op: ReduceOp::Sum,
            };
            // SAFETY: both halves of the collective scratch hold at least 256 bytes and live
            // until the program is dropped, after its streams drained.
            unsafe { comm.enqueue(c, &self.comm) }.map_err(|e| CudaError::CommPoll {
                axis: axis.to_string(),
                source: Box::new(e),
            })?;
        }
        self.compute
            .join(&self.comm)
            .map_err(CudaError::driver("join the comm stream after the barrier"))?;
        self.synchronize(ctx)
    }
}
