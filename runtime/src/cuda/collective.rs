//! Communication on the GPU: the IR's collectives on the comm stream (with chunk packing
//! around them when the collective's dim is not the outermost), and the collective matmuls
//! `AgMatMul` / `MatMulRs` as rings of partial GEMMs on the compute stream overlapped with
//! `send_recv` on the comm stream (the CPU reference's ring, `cpu/collective_matmul.rs`).
//!
//! Ring buffers: `AgMatMul` alternates two receive buffers; a buffer is received into only after
//! the GEMM that read it (the previous step's) finished, so each transfer overlaps one GEMM. `MatMulRs` alternates two partial-sum and
//! two receive buffers with the same rule. Both end by joining the streams both ways, so no
//! comm work of the op outlives it.

use super::gemm::{Epilogue, GemmCache, GemmKey};
use super::ops::Launcher;
use super::program::CudaProgram;
use super::rank::CudaRankCtx;
use super::strided::{split3, StridedSpec};
use super::CudaError;
use crate::comm::{CommError, ReduceOp};
use crate::cuda::comm::device::{
    DeviceBuffer, DeviceCollective, DeviceCollective as Dc, DeviceCommunicator, DeviceDType,
};
use crate::RuntimeError;
use cudarc::driver::{CudaEvent, CudaStream};
use shardc_compiler::ir::{Op, ValueId};
use std::sync::Arc;

impl CudaProgram {
    /// Enqueues one collective on the comm stream (packing chunks around it when the
    /// collective's dim is not the outermost).
    pub(super) fn run_collective(
        &mut self,
        v: ValueId,
        ctx: &CudaRankCtx,
        lm: &Launcher,
    ) -> Result<(), CudaError> {
        let node = self.graph.node(v).clone();
        let axis = node.op.axis().unwrap_or_default().to_string();
        let comm = ctx.comm(&axis)?;
        let x = node.inputs[0];
        let st = self.storage[v.index()];
        let elem = st.size_bytes();
        let in_shape = self.shape(x);
        let send = DeviceBuffer::new(self.ptr(x), self.numel(x), st.device());
        let recv = DeviceBuffer::new(self.ptr(v), self.numel(v), st.device());
        let (a, b) = (
            self.comm_scratch.ptr,
            self.comm_scratch.ptr + self.comm_half,
        );
        let wrap = self.comm_error(v, &axis);
        let check_parts = |parts: usize| check_axis_size(comm, &axis, parts);
        let spec = |s| self.strided_spec(v, s);
        // `send`, or its `parts` chunks along `dim` of `shape` packed at `at` when `dim` is not
        // the outermost.
        let packed = |shape: &[usize], dim: usize, parts: usize, at: u64| {
            if split3(shape, dim).0 == 1 {
                return Ok(send);
            }
            lm.strided(
                elem,
                send.ptr,
                at,
                &spec(StridedSpec::pack_chunks(shape, dim, parts))?,
            )?;
            Ok::<_, CudaError>(DeviceBuffer::new(at, send.len, send.dtype))
        };
        // `issue(recv)`, or, when `dim` of `shape` is not the outermost, `issue` into `at` and
        // its `parts` chunks unpacked into `recv`.
        let unpacked =
            |shape: &[usize],
             dim: usize,
             parts: usize,
             at: u64,
             issue: &dyn Fn(DeviceBuffer) -> Result<(), CudaError>| {
                if split3(shape, dim).0 == 1 {
                    return issue(recv);
                }
                issue(DeviceBuffer::new(at, recv.len, recv.dtype))?;
                lm.strided(
                    elem,
                    at,
                    recv.ptr,
                    &spec(StridedSpec::unpack_chunks(shape, dim, parts))?,
                )
            };
        let s = lm.stream;
        // SAFETY: `send`, `recv` and the scratch halves are live device buffers of the sizes
        // given; they stay allocated until the program is dropped, after the streams drained.
        let issue = |c: Dc| unsafe { comm.enqueue(c, s) }.map_err(&wrap);
        let op = ReduceOp::Sum;
        match &node.op {
            Op::AllReduce { .. } => issue(Dc::AllReduce { send, recv, op }),
            Op::Broadcast { root, .. } => issue(Dc::Broadcast {
                send,
                recv,
                root: *root,
            }),
            Op::ReduceScatter { dim, parts, .. } => {
                check_parts(*parts)?;
                let send = packed(&in_shape, *dim, *parts, a)?;
                issue(Dc::ReduceScatter { send, recv, op })
            }
            Op::AllGather { dim, parts, .. } => {
                check_parts(*parts)?;
                unpacked(&in_shape, *dim, *parts, a, &|recv| {
                    issue(Dc::AllGather { send, recv })
                })
            }
            Op::AllToAll {
                split_dim,
                concat_dim,
                parts,
                ..
            } => {
                check_parts(*parts)?;
                let send = packed(&in_shape, *split_dim, *parts, a)?;
                let mut chunk = in_shape.clone();
                chunk[*split_dim] /= parts;
                unpacked(&chunk, *concat_dim, *parts, b, &|recv| {
                    issue(Dc::AllToAll { send, recv })
                })
            }
            _ => Err(self.unsupported(v, "not a collective")),
        }
    }

    /// The ring of `axis` (of `parts` ranks) for node `v`, computing on `cs`.
    fn ring<'a>(
        &self,
        v: ValueId,
        ctx: &CudaRankCtx<'a>,
        axis: &str,
        parts: usize,
        cs: &'a CudaStream,
    ) -> Result<Ring<'a>, CudaError> {
        let comm = ctx.comm(axis)?;
        check_axis_size(comm, axis, parts)?;
        Ok(Ring {
            comm,
            n: parts,
            r: comm.rank(),
            dtype: self.storage[v.index()].device(),
            cs,
            ms: self.comm.clone(),
            wrap: Box::new(self.comm_error(v, axis)),
        })
    }

    fn comm_error(&self, v: ValueId, axis: &str) -> impl Fn(CommError) -> CudaError + 'static {
        let node = self.graph.node(v);
        let (name, op, axis) = (node.name.clone(), node.op.mnemonic(), axis.to_string());
        move |e| CudaError::Comm {
            node: v,
            name: name.clone(),
            op,
            axis: axis.clone(),
            source: Box::new(e),
        }
    }

    /// A collective matmul (`AgMatMul`, `MatMulRs`) as a ring (module docs).
    pub(super) fn ring_matmul(
        &mut self,
        v: ValueId,
        ctx: &CudaRankCtx,
        l: &Launcher,
    ) -> Result<(), CudaError> {
        let node = self.graph.node(v).clone();
        let Some(m) = node.op.ring_matmul() else {
            return Err(self.unsupported(v, "not a collective matmul"));
        };
        let ring = self.ring(v, ctx, m.axis, m.parts, l.stream)?;
        let mm = RingOperands {
            v,
            x: node.inputs[0],
            w: node.inputs[1],
            dim: m.dim,
            transpose_b: m.transpose_b,
            elem: self.storage[v.index()].size_bytes(),
        };
        if m.gather {
            self.ag_matmul(&mm, &ring, l)
        } else {
            self.matmul_rs(&mm, &ring, l)
        }
    }

    /// `AgMatMul`: `matmul(all_gather(x, dim), w)` as a ring (module docs).
    fn ag_matmul(&mut self, mm: &RingOperands, ring: &Ring, l: &Launcher) -> Result<(), CudaError> {
        let (v, x, dim, elem) = (mm.v, mm.x, mm.dim, mm.elem);
        let (n, r) = (ring.n, ring.r);
        let x_len = self.numel(x);
        let out_shape = self.shape(v);
        if dim + 1 >= out_shape.len() || n == 0 {
            return Err(self.unsupported(v, "the ring dim must be a row dim"));
        }
        let mut chunk_out = out_shape.clone();
        chunk_out[dim] /= n;
        let chunk_len: usize = chunk_out.iter().product();
        let key = GemmKey::for_matmul(
            &self.shape(x),
            &self.shape(mm.w),
            mm.transpose_b,
            self.opts.dtype,
            Epilogue::None,
        )?;
        let out = self.ptr(v);
        let direct = split3(&out_shape, dim).0 == 1;
        let prod = if direct { out } else { self.scratch.ptr };
        let half = (x_len * elem).div_ceil(256) as u64 * 256;
        let bufs = [self.ring.ptr, self.ring.ptr + half];
        let (cs, ms) = (ring.cs, &*ring.ms);
        let wptr = self.ptr(mm.w);
        wait(ms, &event(cs)?)?; // x is ready
        let mut cur = self.ptr(x);
        let mut recv_done: Vec<CudaEvent> = Vec::new();
        let mut gemm_done: Vec<CudaEvent> = Vec::new();
        for s in 0..n {
            let src = (r + n - s) % n;
            if s + 1 < n {
                let next = bufs[s % 2];
                if s >= 2 {
                    // `next` is bufs[s % 2] = bufs[(s - 2) % 2], the operand of step s - 1's GEMM.
                    wait(ms, &gemm_done[s - 1])?;
                }
                // SAFETY: `cur` (x or a ring buffer) and `next` are live device buffers of x_len
                // elements; the ring buffers outlive the program's streams.
                unsafe { ring.shift(cur, next, x_len) }?;
                recv_done.push(event(ms)?);
            }
            if s >= 1 {
                wait(cs, &recv_done[s - 1])?;
            }
            let dst = prod + (src * chunk_len * elem) as u64;
            // SAFETY: `cur` holds a chunk of x, `dst` a chunk of the product (output or scratch).
            unsafe { self.gemm_cache().gemm(&key, cur, wptr, None, dst, cs) }?;
            gemm_done.push(event(cs)?);
            if s + 1 < n {
                cur = bufs[s % 2];
            }
        }
        if !direct {
            let spec = self.strided_spec(v, StridedSpec::unpack_chunks(&chunk_out, dim, n))?;
            l.strided(elem, prod, out, &spec)?;
        }
        ring.join()
    }

    /// `MatMulRs`: `reduce_scatter(matmul(x, w), dim)` as a ring (module docs).
    fn matmul_rs(&mut self, mm: &RingOperands, ring: &Ring, l: &Launcher) -> Result<(), CudaError> {
        let (v, x, dim, elem) = (mm.v, mm.x, mm.dim, mm.elem);
        let (n, r) = (ring.n, ring.r);
        let xs = self.shape(x);
        if dim + 1 >= xs.len() || n == 0 || xs[dim] % n != 0 {
            return Err(self.unsupported(v, "the ring dim must be a row dim divisible by the axis"));
        }
        let rows = xs[dim] / n;
        let mut x_chunk = xs.clone();
        x_chunk[dim] = rows;
        let x_chunk_len: usize = x_chunk.iter().product();
        let out = self.ptr(v);
        let p_len = self.numel(v);
        let key = GemmKey::for_matmul(
            &x_chunk,
            &self.shape(mm.w),
            mm.transpose_b,
            self.opts.dtype,
            Epilogue::None,
        )?;
        let direct = split3(&xs, dim).0 == 1;
        let q = (p_len * elem).div_ceil(256) as u64 * 256;
        let pbuf = [self.ring.ptr, self.ring.ptr + q];
        let rbuf = [self.ring.ptr + 2 * q, self.ring.ptr + 3 * q];
        let (cs, ms) = (ring.cs, &*ring.ms);
        let (xptr, wptr) = (self.ptr(x), self.ptr(mm.w));
        let dt = self.dt();
        let mut sr_done: Vec<CudaEvent> = Vec::new();
        for s in 0..n {
            let c = (r + 2 * n - s - 1) % n;
            let a = if direct {
                xptr + (c * x_chunk_len * elem) as u64
            } else {
                let spec = self.strided_spec(v, StridedSpec::slice(&xs, dim, c * rows, rows))?;
                l.strided(elem, xptr, self.scratch.ptr, &spec)?;
                self.scratch.ptr
            };
            let last = s + 1 == n;
            let dst = if last { out } else { pbuf[s % 2] };
            if s >= 2 && !last {
                wait(cs, &sr_done[s - 2])?; // pbuf[s % 2] was sent at step s - 2
            }
            // SAFETY: `a` holds a row chunk of x, `dst` a partial product of p_len elements.
            unsafe { self.gemm_cache().gemm(&key, a, wptr, None, dst, cs) }?;
            if s > 0 {
                wait(cs, &sr_done[s - 1])?;
                l.accumulate(dt, dst, rbuf[(s - 1) % 2], p_len)?;
            }
            if !last {
                wait(ms, &event(cs)?)?;
                // SAFETY: ring buffers of p_len elements, live for the program's lifetime.
                unsafe { ring.shift(dst, rbuf[s % 2], p_len) }?;
                sr_done.push(event(ms)?);
            }
        }
        ring.join()
    }

    fn gemm_cache(&mut self) -> &mut GemmCache {
        self.gemm
            .as_mut()
            .expect("invariant: created for graphs with GEMMs")
    }
}

/// `Ok` when the communicator of `axis` has `parts` ranks, else [`RuntimeError::AxisSize`].
fn check_axis_size(
    comm: &dyn DeviceCommunicator,
    axis: &str,
    parts: usize,
) -> Result<(), CudaError> {
    if comm.size() == parts {
        Ok(())
    } else {
        Err(RuntimeError::AxisSize {
            axis: axis.to_string(),
            expected: parts,
            found: comm.size(),
        }
        .into())
    }
}

/// A collective matmul's node `v`, its operands `x` and `w`, the ring dim, whether `w` is
/// transposed, and the element size.
#[derive(Clone, Copy)]
struct RingOperands {
    v: ValueId,
    x: ValueId,
    w: ValueId,
    dim: usize,
    transpose_b: bool,
    elem: usize,
}

/// The ring a collective matmul runs on: the axis' communicator with this rank's place `r` of
/// `n`, the compute stream `cs`, the comm stream `ms`, and the error of a failed transfer.
struct Ring<'a> {
    comm: &'a dyn DeviceCommunicator,
    n: usize,
    r: usize,
    dtype: DeviceDType,
    cs: &'a CudaStream,
    ms: Arc<CudaStream>,
    wrap: Box<dyn Fn(CommError) -> CudaError>,
}

impl Ring<'_> {
    /// On the comm stream: `len` elements at `send` to the next rank, as many from the
    /// previous rank into `recv`.
    ///
    /// # Safety
    /// `send` and `recv` are live device buffers of `len` elements until the comm stream ran
    /// the transfer.
    unsafe fn shift(&self, send: u64, recv: u64, len: usize) -> Result<(), CudaError> {
        let (n, r) = (self.n, self.r);
        let send = DeviceBuffer::new(send, len, self.dtype);
        let recv = DeviceBuffer::new(recv, len, self.dtype);
        let (to, from) = ((r + 1) % n, (r + n - 1) % n);
        let shift = DeviceCollective::SendRecv {
            send,
            to,
            recv,
            from,
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.comm.enqueue(shift, &self.ms) }.map_err(&self.wrap)
    }

    /// Joins the streams both ways, so no comm work of the op outlives it.
    fn join(&self) -> Result<(), CudaError> {
        wait(&self.ms, &event(self.cs)?)?;
        wait(self.cs, &event(&self.ms)?)
    }
}

fn event(s: &CudaStream) -> Result<CudaEvent, CudaError> {
    s.record_event(None)
        .map_err(CudaError::driver("record a ring event"))
}

fn wait(s: &CudaStream, e: &CudaEvent) -> Result<(), CudaError> {
    s.wait(e)
        .map_err(CudaError::driver("wait for a ring event"))
}
