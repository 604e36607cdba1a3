//! Calibration micro-benchmarks on one GPU: the measurements `shardc calibrate` fits a device
//! profile to (`shardc_compiler::cost::fit_profile`), in the same
//! [`Measurements`] format a `--measurements` JSON file holds.
//!
//! - GEMMs through the backend's cuBLASLt path ([`GemmCache`]), bf16 and f32, at shapes of every
//!   roofline class (large square, a K=1024 projection, a tall MLP shape, medium, small and a
//!   skinny decode shape);
//! - device-to-device copies (`cuMemcpyDtoDAsync`) from 4 KiB (the launch floor) to 1 GiB
//!   (HBM bandwidth);
//! - `all_reduce`, `all_gather` and `reduce_scatter` of the `local-gpu` communicator with 2
//!   virtual ranks on this device, at 64 KiB to 256 MiB (nccl-tests' size convention: the
//!   whole buffer, `recv` for gathers, `send` for reduce-scatters).
//!
//! Every timing is CUDA events around `iters` back-to-back runs on one stream after `warmup`
//! runs, repeated `trials` times; the sample is the median trial's time per run.
//!
//! Caveat: local-gpu ranks share one GPU, so their collectives measure this device's memory
//! system and the host rendezvous, not NVLink; they are recorded as intra-node samples
//! (`network: false`) and `fit_profile` fits NVLink efficiency and latency from them.

use super::gemm::{Epilogue, GemmCache, GemmKey};
use super::ops::Launcher;
use super::plan::GpuDType;
use super::{CudaDevice, CudaError};
use crate::comm::{CommError, ReduceOp};
use crate::cuda::comm::device::{DeviceBuffer, DeviceCollective, DeviceCommunicator, DeviceDType};
use crate::cuda::comm::local_gpu;
use crate::rank::on_threads;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use shardc_compiler::cost::{
    CollectiveKind, CollectiveSample, CopySample, GemmSample, Measurements,
};
use shardc_compiler::ir::DType;
use std::sync::Arc;
use std::time::Duration;

/// What [`measure`] runs.
#[derive(Clone, Debug, PartialEq)]
pub struct CalibrateOptions {
    /// GEMM shapes `(m, n, k)`: `C[m,n] = A[m,k]·B[k,n]`, each run in bf16 and f32.
    pub gemm_shapes: Vec<(usize, usize, usize)>,
    /// Device-to-device copy sizes in bytes.
    pub copy_bytes: Vec<u64>,
    /// Collective sizes in bytes (nccl-tests' convention); empty: no collectives.
    pub collective_bytes: Vec<u64>,
    /// Virtual ranks of the local-gpu group.
    pub ranks: usize,
    /// Untimed runs before each trial's timed ones.
    pub warmup: usize,
    /// Timed runs per trial.
    pub iters: usize,
    /// Trials per measurement (the median is kept).
    pub trials: usize,
    /// Host rendezvous timeout of the local-gpu group.
    pub timeout: Duration,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        CalibrateOptions {
            gemm_shapes: vec![
                (8192, 8192, 8192),
                (4096, 4096, 1024),
                (16384, 1024, 4096),
                (512, 4096, 4096),
                (128, 4096, 4096),
                (16, 8192, 8192),
            ],
            copy_bytes: vec![4 << 10, 64 << 10, 16 << 20, 256 << 20, 1 << 30],
            collective_bytes: vec![64 << 10, 16 << 20, 64 << 20, 256 << 20],
            ranks: 2,
            warmup: 3,
            iters: 10,
            trials: 3,
            timeout: Duration::from_secs(60),
        }
    }
}

impl CalibrateOptions {
    /// A fast configuration for tests: one shape per GEMM class, small copies and collectives
    /// (still one copy of 64 MiB so the memory efficiency is fitted).
    pub fn quick() -> Self {
        CalibrateOptions {
            gemm_shapes: vec![(2048, 2048, 2048), (256, 1024, 1024), (16, 2048, 2048)],
            copy_bytes: vec![64 << 10, 64 << 20],
            collective_bytes: vec![64 << 10, 64 << 20],
            warmup: 1,
            iters: 3,
            trials: 1,
            ..CalibrateOptions::default()
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds per run of `run`: `trials` times (`warmup` untimed runs, then `iters` runs between
/// two timing events on `stream`), the median trial.
fn time_runs(
    stream: &Arc<CudaStream>,
    o: &CalibrateOptions,
    mut run: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    let iters = o.iters.max(1);
    let mut trials = Vec::with_capacity(o.trials.max(1));
    for _ in 0..o.trials.max(1) {
        for _ in 0..o.warmup {
            run()?;
        }
        let start = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::driver("record timing event"))?;
        for _ in 0..iters {
            run()?;
        }
        let end = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::driver("record timing event"))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(CudaError::driver("read timing events"))?;
        trials.push(f64::from(ms) * 1e-3 / iters as f64);
    }
    Ok(median(trials))
}

/// `bytes` bytes of uninitialised device memory on `stream`.
fn alloc(stream: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>, CudaError> {
    // SAFETY: benchmark buffers; every one is filled (memset) before it is read.
    unsafe { stream.alloc::<u8>(bytes) }.map_err(CudaError::driver(format!("alloc {bytes} bytes")))
}

fn ptr(s: &CudaSlice<u8>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

/// GEMM timings: every shape of `o`, bf16 then f32.
pub fn measure_gemms(dev: &CudaDevice, o: &CalibrateOptions) -> Result<Vec<GemmSample>, CudaError> {
    let stream = dev.new_stream()?;
    let mut cache = GemmCache::new(&stream, dev.compute_capability().0)?;
    let l = Launcher::new(dev, &stream);
    let mut out = Vec::new();
    for (dt, gdt, size) in [
        (DType::Bf16, GpuDType::Bf16, 2),
        (DType::F32, GpuDType::F32, 4),
    ] {
        for &(m, n, k) in &o.gemm_shapes {
            let key = GemmKey::for_matmul(&[m, k], &[k, n], false, gdt, Epilogue::None)?;
            let (a, b, c) = (
                alloc(&stream, m * k * size)?,
                alloc(&stream, k * n * size)?,
                alloc(&stream, m * n * size)?,
            );
            let (pa, pb, pc) = (ptr(&a, &stream), ptr(&b, &stream), ptr(&c, &stream));
            // 0x3c bytes: small normal values in both bf16 (0.0115) and f32.
            l.memset(pa, 0x3c, m * k * size)?;
            l.memset(pb, 0x3c, k * n * size)?;
            let seconds = time_runs(&stream, o, || {
                // SAFETY: a, b, c are live allocations of this context with the sizes the key
                // implies; c does not overlap a or b.
                unsafe { cache.gemm(&key, pa, pb, None, pc, &stream) }
            })?;
            stream
                .synchronize()
                .map_err(CudaError::driver("synchronize after GEMMs"))?;
            drop((a, b, c));
            out.push(GemmSample {
                m,
                n,
                k,
                dtype: dt,
                seconds,
            });
        }
    }
    Ok(out)
}

/// Device-to-device copy timings at every size of `o`.
pub fn measure_copies(
    dev: &CudaDevice,
    o: &CalibrateOptions,
) -> Result<Vec<CopySample>, CudaError> {
    let stream = dev.new_stream()?;
    let l = Launcher::new(dev, &stream);
    let mut out = Vec::new();
    for &bytes in &o.copy_bytes {
        let n = bytes as usize;
        let (src, dst) = (alloc(&stream, n)?, alloc(&stream, n)?);
        let (ps, pd) = (ptr(&src, &stream), ptr(&dst, &stream));
        l.memset(ps, 0x3c, n)?;
        let seconds = time_runs(&stream, o, || l.copy(pd, ps, n))?;
        stream
            .synchronize()
            .map_err(CudaError::driver("synchronize after copies"))?;
        drop((src, dst));
        out.push(CopySample { bytes, seconds });
    }
    Ok(out)
}

fn comm_err(e: CommError) -> CudaError {
    CudaError::CommPoll {
        axis: "calibrate".into(),
        source: Box::new(e),
    }
}

/// One local-gpu rank's timings of every collective and size of `o` (bf16 buffers).
fn rank_collectives(
    dev: &CudaDevice,
    comm: &local_gpu::LocalGpuComm,
    o: &CalibrateOptions,
) -> Result<Vec<CollectiveSample>, CudaError> {
    let stream = dev.new_stream()?;
    let l = Launcher::new(dev, &stream);
    let r = o.ranks;
    let dt = DeviceDType::Bf16;
    let mut out = Vec::new();
    for kind in [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
    ] {
        for &bytes in &o.collective_bytes {
            // Whole-buffer elements, a multiple of the rank count.
            let total = (bytes as usize / dt.size_bytes()).max(r) / r * r;
            let (send_len, recv_len) = match kind {
                CollectiveKind::AllGather => (total / r, total),
                CollectiveKind::ReduceScatter => (total, total / r),
                _ => (total, total),
            };
            let sb = alloc(&stream, send_len * dt.size_bytes())?;
            let rb = alloc(&stream, recv_len * dt.size_bytes())?;
            let send = DeviceBuffer::new(ptr(&sb, &stream), send_len, dt);
            let recv = DeviceBuffer::new(ptr(&rb, &stream), recv_len, dt);
            l.memset(send.ptr, 0x3c, send.bytes())?;
            let op = ReduceOp::Sum;
            let c = match kind {
                CollectiveKind::AllGather => DeviceCollective::AllGather { send, recv },
                CollectiveKind::ReduceScatter => DeviceCollective::ReduceScatter { send, recv, op },
                _ => DeviceCollective::AllReduce { send, recv, op },
            };
            let seconds = time_runs(&stream, o, || {
                // SAFETY: send and recv are live allocations of this context of the sizes
                // given; they are freed only after the stream is synchronized below.
                unsafe { comm.enqueue(c, &stream) }.map_err(comm_err)
            })?;
            stream
                .synchronize()
                .map_err(CudaError::driver("synchronize after collectives"))?;
            comm.poll().map_err(comm_err)?;
            drop((sb, rb));
            out.push(CollectiveSample {
                kind,
                ranks: r,
                bytes: (total * dt.size_bytes()) as u64,
                seconds,
                network: false,
            });
        }
    }
    Ok(out)
}

/// Collective timings of a local-gpu group of `o.ranks` virtual ranks on `dev` (one host
/// thread per rank); each sample is the slowest rank's time.
pub fn measure_collectives(
    dev: &Arc<CudaDevice>,
    o: &CalibrateOptions,
) -> Result<Vec<CollectiveSample>, CudaError> {
    if o.collective_bytes.is_empty() || o.ranks < 2 {
        return Ok(Vec::new());
    }
    let comms = local_gpu::group(dev, "calibrate", o.ranks, o.timeout);
    let per_rank = on_threads(comms, |comm| {
        let r = rank_collectives(dev, &comm, o);
        if let Err(e) = &r {
            comm.abort(&e.to_string());
        }
        r
    });
    let mut ranks = Vec::with_capacity(per_rank.len());
    for r in per_rank {
        ranks.push(r.unwrap_or_else(|_| {
            Err(comm_err(CommError::Transport(
                "a calibration rank thread panicked".into(),
            )))
        })?);
    }
    let mut out = ranks.swap_remove(0);
    for other in &ranks {
        for (s, t) in out.iter_mut().zip(other) {
            s.seconds = s.seconds.max(t.seconds);
        }
    }
    Ok(out)
}

/// Runs every micro-benchmark of `o` on `dev`: the measurements `fit_profile` consumes.
pub fn measure(dev: &Arc<CudaDevice>, o: &CalibrateOptions) -> Result<Measurements, CudaError> {
    Ok(Measurements {
        device: dev.name().to_string(),
        gemm: measure_gemms(dev, o)?,
        copy: measure_copies(dev, o)?,
        collectives: measure_collectives(dev, o)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_compiler::cost::GemmClass;
    use shardc_compiler::cost::GemmShape;

    #[test]
    fn default_shapes_cover_every_gemm_class_and_the_fit_thresholds() {
        let o = CalibrateOptions::default();
        for opts in [&o, &CalibrateOptions::quick()] {
            let classes: Vec<GemmClass> = opts
                .gemm_shapes
                .iter()
                .map(|&(m, n, k)| GemmShape { m, n, k, batch: 1 }.class())
                .collect();
            for c in [GemmClass::Large, GemmClass::Medium, GemmClass::Tiny] {
                assert!(classes.contains(&c), "{c:?} missing");
            }
            // A copy >= 64 MiB (memory efficiency) and one <= 64 KiB (launch floor).
            assert!(opts.copy_bytes.iter().any(|&b| b >= 64 << 20));
            assert!(opts.copy_bytes.iter().any(|&b| b <= 64 << 10));
            assert!(opts.collective_bytes.iter().any(|&b| b >= 64 << 20));
            assert!(opts.collective_bytes.iter().any(|&b| b <= 64 << 10));
        }
        assert!(o.copy_bytes.iter().any(|&b| b >= 256 << 20));
        assert!(o.gemm_shapes.contains(&(8192, 8192, 8192)));
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
