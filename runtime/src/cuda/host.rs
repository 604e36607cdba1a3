//! Host ↔ device data: owned device allocations, host tensors in their device
//! representation (f32, bf16, i32), uploads and downloads, and the deterministic generator of
//! [`ParamInit::Random`](super::ParamInit::Random).

use super::plan::{GpuDType, Storage};
use super::CudaError;
use crate::weights::round_to;
use crate::Tensor;
use cudarc::driver::{result as drv, CudaSlice, CudaStream, DevicePtr};
use shardc_compiler::ir::DType;
use std::sync::Arc;

/// An owned device allocation and its address.
pub(super) struct DevBuf {
    _buf: CudaSlice<u8>,
    pub(super) ptr: u64,
    pub(super) bytes: usize,
}

pub(super) fn alloc(
    stream: &Arc<CudaStream>,
    bytes: usize,
    what: &str,
) -> Result<DevBuf, CudaError> {
    // SAFETY: every reader of these bytes is ordered after a writer (uploads, kernels), or
    // reads poison by design.
    let buf = unsafe { stream.alloc::<u8>(bytes.max(1)) }
        .map_err(CudaError::driver(format!("alloc {what} ({bytes} bytes)")))?;
    let ptr = {
        let (p, _sync) = buf.device_ptr(stream);
        p
    };
    Ok(DevBuf {
        _buf: buf,
        ptr,
        bytes,
    })
}

/// Host data in its device representation.
pub(super) enum HostData {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
    I32(Vec<i32>),
    /// Launch constants kept in device memory (AdamW's).
    F64(Vec<f64>),
}

impl HostData {
    /// `t` (f32 or i32) as `storage` wants it; `declared` rounds f32 storage of bf16/f16 values.
    pub(super) fn of(t: &Tensor, storage: Storage, declared: DType) -> HostData {
        match (&t.data, storage) {
            (crate::Buffer::I32(v), _) => HostData::I32(v.clone()),
            (crate::Buffer::F32(v), Storage::Float(GpuDType::Bf16)) => {
                HostData::Bf16(v.iter().map(|&x| half::bf16::from_f32(x)).collect())
            }
            (crate::Buffer::F32(v), _) => {
                let mut v = v.clone();
                round_to(declared, &mut v);
                HostData::F32(v)
            }
        }
    }

    /// Bytes of the data.
    pub(super) fn bytes(&self) -> usize {
        match self {
            HostData::F32(v) => 4 * v.len(),
            HostData::Bf16(v) => 2 * v.len(),
            HostData::I32(v) => 4 * v.len(),
            HostData::F64(v) => 8 * v.len(),
        }
    }

    /// A new device buffer holding the data.
    pub(super) fn upload(&self, stream: &Arc<CudaStream>, what: &str) -> Result<DevBuf, CudaError> {
        let buf = alloc(stream, self.bytes(), what)?;
        self.write(stream, &buf, what)?;
        Ok(buf)
    }

    /// Copies the data into `buf` (stream-ordered; a buffer smaller than the data is an error), so a
    /// buffer keeps its address from run to run (what a CUDA graph replay needs).
    pub(super) fn write(
        &self,
        stream: &Arc<CudaStream>,
        buf: &DevBuf,
        what: &str,
    ) -> Result<(), CudaError> {
        self.write_at(stream, buf, 0, what)
    }

    /// Copies the data into `buf` from byte `offset` on (stream-ordered; bytes past the
    /// buffer's end are an error).
    pub(super) fn write_at(
        &self,
        stream: &Arc<CudaStream>,
        buf: &DevBuf,
        offset: usize,
        what: &str,
    ) -> Result<(), CudaError> {
        let bytes = self.bytes();
        let capacity = buf.bytes.saturating_sub(offset);
        if capacity < bytes {
            return Err(CudaError::BufferTooSmall {
                what: what.to_string(),
                bytes,
                capacity,
            });
        }
        if bytes == 0 {
            return Ok(());
        }
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        let s = stream.cu_stream();
        let dst = buf.ptr + offset as u64;
        // SAFETY: `buf` holds at least `offset + bytes` bytes (checked above); a pageable
        // source is staged before the call returns, so the host vector may be dropped afterwards.
        unsafe {
            match self {
                HostData::F32(v) => drv::memcpy_htod_async(dst, v, s),
                HostData::Bf16(v) => drv::memcpy_htod_async(dst, v, s),
                HostData::I32(v) => drv::memcpy_htod_async(dst, v, s),
                HostData::F64(v) => drv::memcpy_htod_async(dst, v, s),
            }
        }
        .map_err(CudaError::driver(format!("upload {what} ({bytes} bytes)")))
    }
}

/// Downloads `n` elements at `ptr` stored as `storage` into a host tensor of `shape`.
pub(super) fn download(
    stream: &Arc<CudaStream>,
    ptr: u64,
    shape: Vec<usize>,
    storage: Storage,
    what: &str,
) -> Result<Tensor, CudaError> {
    let n: usize = shape.iter().product();
    let err = CudaError::driver(format!("download {what}"));
    stream
        .context()
        .bind_to_thread()
        .map_err(CudaError::driver("bind context"))?;
    let s = stream.cu_stream();
    // SAFETY: `ptr` holds `n` elements of `storage` (the value's slot); copies to pageable
    // memory complete before the call returns, and the stream is synchronised below anyway.
    let t = unsafe {
        match storage {
            Storage::I32 => {
                let mut v = vec![0i32; n];
                if n > 0 {
                    drv::memcpy_dtoh_async(&mut v, ptr, s).map_err(err)?;
                }
                Tensor::i32(shape, v)
            }
            Storage::Float(GpuDType::F32) => {
                let mut v = vec![0f32; n];
                if n > 0 {
                    drv::memcpy_dtoh_async(&mut v, ptr, s).map_err(err)?;
                }
                Tensor::f32(shape, v)
            }
            Storage::Float(GpuDType::Bf16) => {
                let mut v = vec![half::bf16::ZERO; n];
                if n > 0 {
                    drv::memcpy_dtoh_async(&mut v, ptr, s).map_err(err)?;
                }
                Tensor::f32(shape, v.iter().map(|x| x.to_f32()).collect())
            }
        }
    };
    stream.synchronize().map_err(CudaError::driver(format!(
        "synchronize after downloading {what}"
    )))?;
    Ok(t)
}

/// A deterministic uniform generator (xorshift64*), for [`ParamInit::Random`].
pub(super) fn random_values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_params_are_deterministic_and_bounded() {
        let a = random_values(7, 1000, 0.5);
        assert_eq!(a, random_values(7, 1000, 0.5));
        assert_ne!(a, random_values(8, 1000, 0.5));
        assert!(a.iter().all(|x| x.abs() <= 0.5));
        let mean = a.iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.05, "{mean}");
    }

    #[test]
    fn host_conversion_rounds_bf16() {
        let t = Tensor::f32(vec![3], vec![1.0, 1.0 + 1.0 / 512.0, -3.3]);
        match HostData::of(&t, Storage::Float(GpuDType::Bf16), DType::F32) {
            HostData::Bf16(v) => assert_eq!(v[1].to_f32(), 1.0),
            _ => panic!("expected bf16"),
        }
        match HostData::of(&t, Storage::Float(GpuDType::F32), DType::Bf16) {
            HostData::F32(v) => assert_eq!(v[1], 1.0),
            _ => panic!("expected f32"),
        }
    }
}
