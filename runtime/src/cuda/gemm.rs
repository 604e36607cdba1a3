//! GEMMs through cuBLASLt with a per-shape plan cache.
//!
//! Row-major `C[M,N] = A[M,K]·B` is computed as the column-major `Cᵀ[N,M] = Bᵀ·Aᵀ`: cuBLASLt's
//! operand "A" is our weight `B` (`[K,N]`, or `[N,K]` with `transpose_b`, which becomes
//! `TRANSA = T`), its operand "B" is our activation `A`, and `m = N`, `n = M`, `k = K`.
//! A batched weight `[E,K,N]` with activations `[E,..,M,K]` uses strided batches.
//!
//! A weight gradient (`WeightGrad`) contracts over the rows instead: row-major `dB[K,N] =
//! Aᵀ·dY` is the column-major `dBᵀ[N,K] = dYᵀ·A`, cuBLASLt's "A" being `dY` (`[N,M]`
//! column-major, as stored) and its "B" being `A` read transposed (`TRANSB = T`), `m = N`,
//! `n = K`, `k = M`; with `transpose_b` (`dB[N,K] = dYᵀ·A`) the two operands swap roles.
//!
//! The cuBLASLt objects (matrix layouts, the matmul descriptor with its epilogue, the
//! heuristic's algorithm) are built once per [`GemmKey`] with `cublaslt::result::*` and
//! cached; a call only sets the bias pointer and launches. f32 runs with
//! `CUBLAS_COMPUTE_32F` (true fp32, no TF32); bf16 with bf16 matrices, f32 compute and f32
//! scale.

use super::dtype::GpuDType;
use super::CudaError;
use crate::RuntimeError;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

/// What cuBLASLt applies to the product before storing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// Plain `C = A·B`.
    None,
    /// `C = A·B + bias` (bias `[N]`, broadcast over rows).
    Bias,
    /// `C = gelu(A·B + bias)`, cuBLASLt's GELU (tanh approximation).
    GeluBias,
    /// `C = gelu(A·B)`.
    Gelu,
}

impl Epilogue {
    fn has_bias(self) -> bool {
        matches!(self, Epilogue::Bias | Epilogue::GeluBias)
    }

    fn cublas(self) -> sys::cublasLtEpilogue_t {
        match self {
            Epilogue::None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
            Epilogue::Gelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
        }
    }
}

/// Everything that determines a cuBLASLt plan: one cache entry. In cuBLASLt's column-major
/// terms (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmKey {
    /// Element type of A, B and C.
    pub dtype: GpuDType,
    /// Rows of the column-major result = our `N`.
    pub m: u64,
    /// Columns of the column-major result = our rows `M` (per batch).
    pub n: u64,
    /// Contraction length `K`.
    pub k: u64,
    /// cuBLASLt's "A" is read transposed (a forward weight stored `[N,K]`, our
    /// `transpose_b`).
    pub transa: bool,
    /// cuBLASLt's "B" is read transposed (a weight gradient's activation or output gradient).
    pub transb: bool,
    /// Leading dim of cuBLASLt's "A" (the weight in a forward GEMM).
    pub lda: i64,
    /// Leading dim of cuBLASLt's "B" (the activation, = K, in a forward GEMM).
    pub ldb: i64,
    /// Leading dim of the result (= N).
    pub ldc: i64,
    /// Batch count (1: not batched).
    pub batch: i32,
    /// Element strides between batches of the weight, activation and result.
    pub strides: (i64, i64, i64),
    /// Epilogue.
    pub epilogue: Epilogue,
    /// Byte alignment (a power of two ≤ 256) every operand pointer has; cuBLASLt's heuristic
    /// assumes 256 unless told, and an algorithm needing more faults. Set per call by
    /// [`GemmCache::gemm`] from the actual pointers.
    pub align: u32,
}

impl fmt::Display for GemmKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} [{}x{}]{}·[{}x{}]{} batch {} {:?}",
            match self.dtype {
                GpuDType::F32 => "f32",
                GpuDType::Bf16 => "bf16",
            },
            self.n,
            self.k,
            if self.transb { "ᵀ" } else { "" },
            self.k,
            self.m,
            if self.transa { "ᵀ" } else { "" },
            self.batch,
            self.epilogue
        )
    }
}

impl GemmKey {
    /// The key of `MatMul { transpose_b }` with operand shapes `a` (`[.., M, K]`, or
    /// `[E, .., M, K]` when batched) and `b` (`[K,N]`/`[N,K]`, or `[E,K,N]`/`[E,N,K]`).
    pub fn for_matmul(
        a: &[usize],
        b: &[usize],
        transpose_b: bool,
        dtype: GpuDType,
        epilogue: Epilogue,
    ) -> Result<GemmKey, RuntimeError> {
        let err = |reason| RuntimeError::Shape {
            op: "matmul",
            shapes: vec![a.to_vec(), b.to_vec()],
            reason,
        };
        if a.len() < 2 || !(b.len() == 2 || b.len() == 3) {
            return Err(err("expects a[.., M, K] and b of rank 2 or 3"));
        }
        let br = b.len();
        let (kb, n) = if transpose_b {
            (b[br - 1], b[br - 2])
        } else {
            (b[br - 2], b[br - 1])
        };
        let k = a[a.len() - 1];
        if k != kb {
            return Err(err("contracted dims differ"));
        }
        let (batch, rows) = if br == 3 {
            if a.len() < 3 || a[0] != b[0] {
                return Err(err("batched operands need the same leading dim"));
            }
            (b[0], a[1..a.len() - 1].iter().product::<usize>())
        } else {
            (1, a[..a.len() - 1].iter().product::<usize>())
        };
        if batch > i32::MAX as usize {
            return Err(err("batch count beyond i32"));
        }
        if epilogue != Epilogue::None && batch != 1 {
            return Err(err("epilogues apply to unbatched GEMMs only"));
        }
        let strides = if batch > 1 {
            ((k * n) as i64, (rows * k) as i64, (rows * n) as i64)
        } else {
            (0, 0, 0)
        };
        Ok(GemmKey {
            dtype,
            m: n as u64,
            n: rows as u64,
            k: k as u64,
            transa: transpose_b,
            transb: false,
            lda: if transpose_b { k as i64 } else { n as i64 },
            ldb: k as i64,
            ldc: n as i64,
            batch: batch as i32,
            strides,
            epilogue,
            align: 256,
        })
    }

    /// This unbatched, epilogue-free GEMM run `count` times in one call (sibling `MatMul`s,
    /// `plan::SiblingGemms`): every run reads the same activation (batch stride 0), the weights
    /// lie `w_stride` elements apart and the results `out_stride` elements apart.
    pub fn siblings(
        self,
        count: usize,
        w_stride: i64,
        out_stride: i64,
    ) -> Result<GemmKey, RuntimeError> {
        let err = |reason| RuntimeError::Shape {
            op: "matmul",
            shapes: vec![vec![self.n as usize, self.k as usize], vec![count]],
            reason,
        };
        if self.batch != 1 || self.epilogue != Epilogue::None {
            return Err(err("sibling GEMMs are unbatched and take no epilogue"));
        }
        let weight = (self.m * self.k) as i64;
        let result = (self.m * self.n) as i64;
        if count < 2 || count > i32::MAX as usize || w_stride < weight || out_stride < result {
            return Err(err(
                "sibling strides must keep the weights and results apart",
            ));
        }
        Ok(GemmKey {
            batch: count as i32,
            strides: (w_stride, 0, out_stride),
            ..self
        })
    }

    /// The key of `WeightGrad { transpose_b }(a, dy, b)`: `a` `[.., M, K]` (or `[E, .., M,
    /// K]`), `dy` `[.., M, N]` (or `[E, .., M, N]`), the gradient `b` `[K,N]`/`[N,K]` (or
    /// `[E,K,N]`/`[E,N,K]`), summed over the rows. Returns the key and whether cuBLASLt's "A"
    /// operand is `dy` (`false`: it is `a`); the other operand is its "B".
    pub fn for_weight_grad(
        a: &[usize],
        dy: &[usize],
        b: &[usize],
        transpose_b: bool,
        dtype: GpuDType,
    ) -> Result<(GemmKey, bool), RuntimeError> {
        let err = |reason| RuntimeError::Shape {
            op: "weight_grad",
            shapes: vec![a.to_vec(), dy.to_vec(), b.to_vec()],
            reason,
        };
        let ar = a.len();
        if ar < 2
            || dy.len() != ar
            || a[..ar - 1] != dy[..ar - 1]
            || !(b.len() == 2 || b.len() == 3)
        {
            return Err(err("expects a[.., M, K], dy[.., M, N], b of rank 2 or 3"));
        }
        let (k, n) = (a[ar - 1], dy[ar - 1]);
        let br = b.len();
        let want = if transpose_b { [n, k] } else { [k, n] };
        let batch = if br == 3 { b[0] } else { 1 };
        if b[br - 2..] != want[..] || (br == 3 && (ar < 3 || a[0] != batch)) {
            return Err(err("b's shape does not fit a and dy"));
        }
        if batch > i32::MAX as usize {
            return Err(err("batch count beyond i32"));
        }
        let rows = a[..ar - 1].iter().product::<usize>() / batch.max(1);
        // Column-major: the result is bᵀ, [want[1], want[0]]; its "A" is the operand whose
        // columns are the result's rows.
        let (m, nn, a_is_dy) = if transpose_b {
            (k, n, false)
        } else {
            (n, k, true)
        };
        let strides = if batch > 1 {
            let (sa, sb) = if a_is_dy {
                (rows * n, rows * k)
            } else {
                (rows * k, rows * n)
            };
            (sa as i64, sb as i64, (k * n) as i64)
        } else {
            (0, 0, 0)
        };
        let key = GemmKey {
            dtype,
            m: m as u64,
            n: nn as u64,
            k: rows as u64,
            transa: false,
            transb: true,
            lda: m as i64,
            ldb: nn as i64,
            ldc: m as i64,
            batch: batch as i32,
            strides,
            epilogue: Epilogue::None,
            align: 256,
        };
        Ok((key, a_is_dy))
    }

    /// Multiply-adds × 2: the GEMM's floating-point operations.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * self.batch as f64
    }

    fn data_type(&self) -> sys::cudaDataType {
        match self.dtype {
            GpuDType::F32 => sys::cudaDataType_t::CUDA_R_32F,
            GpuDType::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        }
    }
}

/// The largest power of two ≤ 256 dividing every pointer.
pub fn pointer_alignment(ptrs: &[u64]) -> u32 {
    let bits = ptrs.iter().fold(256u64, |acc, &p| acc | p);
    1u32 << bits.trailing_zeros().min(8)
}

/// The cached cuBLASLt objects of one [`GemmKey`].
struct GemmPlan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for GemmPlan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by cuBLASLt for this plan and is destroyed once.
        // Errors at teardown are ignored (nothing can be done about them).
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A cuBLASLt handle, its workspace and the plan cache. One per executor (not shared between
/// threads: the cached descriptors are mutated per call for the bias pointer).
pub struct GemmCache {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    workspace_ptr: u64,
    plans: HashMap<GemmKey, GemmPlan>,
    misses: usize,
    hits: usize,
}

// SAFETY: the handle and descriptors are plain cuBLASLt objects usable from any thread; the
// cache is used by one thread at a time (`&mut self`).
unsafe impl Send for GemmCache {}

impl Drop for GemmCache {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created by `create_handle`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// Workspace size cuBLASLt gets: 32 MiB on Hopper and newer, 4 MiB before (as cudarc).
fn workspace_bytes(major: i32) -> usize {
    if major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

impl GemmCache {
    /// Probes `libcublasLt`, creates a handle and a workspace on `stream`.
    pub fn new(stream: &Arc<CudaStream>, major: i32) -> Result<GemmCache, CudaError> {
        // SAFETY: a `dlopen` probe only.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::MissingLibrary {
                library: "libcublasLt",
                hint:
                    "install the CUDA 13 cuBLAS (libcublasLt.so.13) and put it on LD_LIBRARY_PATH",
            });
        }
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context for cuBLASLt"))?;
        let handle = std::panic::catch_unwind(lt::create_handle)
            .map_err(|_| CudaError::MissingLibrary {
                library: "libcublasLt",
                hint: "cudarc could not load a cuBLASLt symbol (version mismatch?)",
            })?
            .map_err(|error| CudaError::Cublas {
                op: "create handle",
                gemm: String::new(),
                error,
            })?;
        let bytes = workspace_bytes(major);
        // SAFETY: the workspace is scratch memory for cuBLASLt; its contents never matter.
        let workspace = unsafe { stream.alloc::<u8>(bytes) }.map_err(CudaError::driver(
            format!("alloc cuBLASLt workspace ({bytes} bytes)"),
        ))?;
        let workspace_ptr = {
            let (p, _sync) = workspace.device_ptr(stream);
            p
        };
        Ok(GemmCache {
            handle,
            workspace,
            workspace_ptr,
            plans: HashMap::new(),
            misses: 0,
            hits: 0,
        })
    }

    /// `(plans built, calls served from the cache)`.
    pub fn stats(&self) -> (usize, usize) {
        (self.misses, self.hits)
    }

    /// Builds the plan of `key` now (on `stream`'s context) unless it is cached, so the first
    /// [`GemmCache::gemm`] with that key finds it.
    pub fn warm(&mut self, key: &GemmKey, stream: &CudaStream) -> Result<(), CudaError> {
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context for cuBLASLt"))?;
        if !self.plans.contains_key(key) {
            let p = self.build(key)?;
            self.misses += 1;
            self.plans.insert(*key, p);
        }
        Ok(())
    }

    /// Builds the plan of `key` if it is not cached yet.
    fn plan(&mut self, key: &GemmKey) -> Result<&GemmPlan, CudaError> {
        if self.plans.contains_key(key) {
            self.hits += 1;
        } else {
            let p = self.build(key)?;
            self.misses += 1;
            self.plans.insert(*key, p);
        }
        Ok(self.plans.get(key).expect("invariant: inserted above"))
    }

    fn build(&self, key: &GemmKey) -> Result<GemmPlan, CudaError> {
        let gemm = key.to_string();
        let err = |op: &'static str| {
            let gemm = gemm.clone();
            move |error| CudaError::Cublas { op, gemm, error }
        };
        let ty = key.data_type();
        let (a_rows, a_cols) = if key.transa {
            (key.k, key.m)
        } else {
            (key.m, key.k)
        };
        let layout = |rows, cols, ld, stride: i64| -> Result<_, CudaError> {
            let l = lt::create_matrix_layout(ty, rows, cols, ld).map_err(err("create layout"))?;
            if key.batch > 1 {
                // SAFETY: `l` is a live layout; the attribute buffers are live locals of the
                // sizes cuBLASLt expects (int32 count, int64 stride).
                unsafe {
                    lt::set_matrix_layout_attribute(
                        l,
                        sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        (&key.batch) as *const i32 as *const c_void,
                        std::mem::size_of::<i32>(),
                    )
                    .map_err(err("set batch count"))?;
                    lt::set_matrix_layout_attribute(
                        l,
                        sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        (&stride) as *const i64 as *const c_void,
                        std::mem::size_of::<i64>(),
                    )
                    .map_err(err("set batch stride"))?;
                }
            }
            Ok(l)
        };
        let a = layout(a_rows, a_cols, key.lda, key.strides.0)?;
        let (b_rows, b_cols) = if key.transb {
            (key.n, key.k)
        } else {
            (key.k, key.n)
        };
        let b = layout(b_rows, b_cols, key.ldb, key.strides.1)?;
        let c = layout(key.m, key.n, key.ldc, key.strides.2)?;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(err("create matmul desc"))?;
        // Build the plan now so that Drop frees what exists if a later step fails.
        let mut plan = GemmPlan {
            desc,
            a,
            b,
            c,
            // SAFETY: an all-zero algo is a valid "unset" value; it is overwritten below.
            algo: unsafe { std::mem::zeroed() },
        };
        let transa: i32 = key.transa as i32;
        let transb: i32 = key.transb as i32;
        let epi = key.epilogue.cublas();
        // SAFETY: live descriptor; attribute buffers are live locals of the documented sizes
        // (int32 transpose flags, uint32 epilogue enum).
        unsafe {
            let set = |attr, p: *const c_void, n| {
                lt::set_matmul_desc_attribute(plan.desc, attr, p, n)
                    .map_err(err("set matmul attribute"))
            };
            set(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transa) as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )?;
            set(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                (&transb) as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )?;
            set(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&epi) as *const sys::cublasLtEpilogue_t as *const c_void,
                std::mem::size_of::<sys::cublasLtEpilogue_t>(),
            )?;
        }
        let pref = lt::create_matmul_pref().map_err(err("create preference"))?;
        let ws = self.workspace.len();
        let align: u32 = key.align;
        // SAFETY: live preference; `ws` and `align` are live locals of the documented types
        // (size_t, uint32); the heuristic reads live handles.
        let heuristic = unsafe {
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let set_align = |attr| {
                lt::set_matmul_pref_attribute(
                    pref,
                    attr,
                    (&align) as *const u32 as *const c_void,
                    std::mem::size_of::<u32>(),
                )
            };
            let r = lt::set_matmul_pref_attribute(
                pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws) as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .and_then(|()| set_align(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES))
            .and_then(|()| set_align(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES))
            .and_then(|()| set_align(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES))
            .and_then(|()| set_align(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES))
            .and_then(|()| lt::get_matmul_algo_heuristic(self.handle, plan.desc, a, b, c, c, pref));
            let _ = lt::destroy_matmul_pref(pref);
            r.map_err(err("algorithm heuristic"))?
        };
        plan.algo = heuristic.algo;
        Ok(plan)
    }

    /// Enqueues `out = epilogue(act · weight [+ bias])` on `stream`.
    ///
    /// # Safety
    /// `weight`, `act`, `out` (and `bias` when the key has one) are device pointers of this
    /// context holding the sizes the key implies; `out` does not overlap the inputs.
    pub unsafe fn gemm(
        &mut self,
        key: &GemmKey,
        act: u64,
        weight: u64,
        bias: Option<u64>,
        out: u64,
        stream: &CudaStream,
    ) -> Result<(), CudaError> {
        let (handle, ws_ptr, ws_len) = (self.handle, self.workspace_ptr, self.workspace.len());
        let key = &GemmKey {
            align: pointer_alignment(&[act, weight, out, bias.unwrap_or(0)]),
            ..*key
        };
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context for cuBLASLt"))?;
        let plan = self.plan(key)?;
        let err = |op: &'static str| {
            move |error| CudaError::Cublas {
                op,
                gemm: key.to_string(),
                error,
            }
        };
        if key.epilogue.has_bias() {
            let ptr: u64 = bias.unwrap_or(0);
            lt::set_matmul_desc_attribute(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                (&ptr) as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
            .map_err(err("set bias pointer"))?;
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        lt::matmul(
            handle,
            plan.desc,
            (&alpha) as *const f32 as *const c_void,
            (&beta) as *const f32 as *const c_void,
            weight as *const c_void,
            plan.a,
            act as *const c_void,
            plan.b,
            out as *const c_void,
            plan.c,
            out as *mut c_void,
            plan.c,
            &plan.algo,
            ws_ptr as *mut c_void,
            ws_len,
            stream.cu_stream() as sys::cudaStream_t,
        )
        .map_err(err("matmul"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn linear_layer_key() {
        // y[2,16,64 -> 176] = x · W[176,64]ᵀ
        let k = GemmKey::for_matmul(
            &[2, 16, 64],
            &[176, 64],
            true,
            GpuDType::Bf16,
            Epilogue::None,
        )
        .unwrap();
        assert_eq!((k.m, k.n, k.k), (176, 32, 64));
        assert_eq!(
            (k.lda, k.ldb, k.ldc, k.transa, k.batch),
            (64, 64, 176, true, 1)
        );
        assert_eq!(k.flops(), 2.0 * 176.0 * 32.0 * 64.0);
        // Not transposed: the weight is [K, N], leading dim N.
        let k =
            GemmKey::for_matmul(&[5, 64], &[64, 3], false, GpuDType::F32, Epilogue::Bias).unwrap();
        assert_eq!((k.m, k.n, k.k, k.lda, k.transa), (3, 5, 64, 3, false));
    }

    #[test]
    fn batched_key_has_strides() {
        // experts: a [E=4, B=2, T=16, H=64] · w [4, F=128, 64]ᵀ
        let k = GemmKey::for_matmul(
            &[4, 2, 16, 64],
            &[4, 128, 64],
            true,
            GpuDType::F32,
            Epilogue::None,
        )
        .unwrap();
        assert_eq!((k.m, k.n, k.k, k.batch), (128, 32, 64, 4));
        assert_eq!(k.strides, (128 * 64, 32 * 64, 32 * 128));
        assert!(GemmKey::for_matmul(
            &[4, 2, 64],
            &[3, 128, 64],
            true,
            GpuDType::F32,
            Epilogue::None
        )
        .is_err());
        assert!(GemmKey::for_matmul(
            &[4, 2, 64],
            &[4, 128, 64],
            true,
            GpuDType::F32,
            Epilogue::Bias
        )
        .is_err());
        assert!(
            GemmKey::for_matmul(&[2, 63], &[64, 3], false, GpuDType::F32, Epilogue::None).is_err()
        );
    }

    #[test]
    fn weight_grad_keys_contract_over_the_rows() {
        // dW[64,176] = x[2,16,64]ᵀ · dy[2,16,176]: cuBLASLt computes dWᵀ = dyᵀ·x, its "A"
        // dy as stored ([176, 32] column-major), its "B" x read transposed.
        let (k, a_is_dy) = GemmKey::for_weight_grad(
            &[2, 16, 64],
            &[2, 16, 176],
            &[64, 176],
            false,
            GpuDType::F32,
        )
        .unwrap();
        assert!(a_is_dy);
        assert_eq!(
            (k.m, k.n, k.k, k.transa, k.transb),
            (176, 64, 32, false, true)
        );
        assert_eq!((k.lda, k.ldb, k.ldc, k.batch), (176, 64, 176, 1));
        // A weight stored [N, K] (a linear layer's [176, 64]): dW = dyᵀ·x, so "A" is x.
        let (k, a_is_dy) = GemmKey::for_weight_grad(
            &[2, 16, 64],
            &[2, 16, 176],
            &[176, 64],
            true,
            GpuDType::Bf16,
        )
        .unwrap();
        assert!(!a_is_dy);
        assert_eq!(
            (k.m, k.n, k.k, k.lda, k.ldb, k.ldc),
            (64, 176, 32, 64, 176, 64)
        );
        assert_eq!(k.flops(), 2.0 * 64.0 * 176.0 * 32.0);
        // Experts: x[E=4, 2, 16, 64], dy[4, 2, 16, 128], dW[4, 128, 64] per expert.
        let (k, _) = GemmKey::for_weight_grad(
            &[4, 2, 16, 64],
            &[4, 2, 16, 128],
            &[4, 128, 64],
            true,
            GpuDType::F32,
        )
        .unwrap();
        assert_eq!((k.m, k.n, k.k, k.batch), (64, 128, 32, 4));
        assert_eq!(k.strides, (32 * 64, 32 * 128, 64 * 128));
        for (a, dy, b) in [
            (&[2, 16, 64][..], &[2, 16, 176][..], &[176, 64][..]),
            (&[2, 16, 64], &[2, 15, 176], &[64, 176]),
            (&[4, 2, 64], &[4, 2, 128], &[3, 64, 128]),
            (&[64], &[176], &[64, 176]),
        ] {
            assert!(
                GemmKey::for_weight_grad(a, dy, b, false, GpuDType::F32).is_err(),
                "{a:?} {dy:?} {b:?}"
            );
        }
    }

    #[test]
    fn alignment_of_pointers() {
        assert_eq!(
            pointer_alignment(&[0x7f00_0000_0000, 0x7f00_0000_1000]),
            256
        );
        assert_eq!(pointer_alignment(&[0x7f00_0000_0000, 0x7f00_0000_0010]), 16);
        assert_eq!(pointer_alignment(&[0x7f00_0000_0002]), 2);
        let k =
            GemmKey::for_matmul(&[3, 4], &[4, 5], false, GpuDType::F32, Epilogue::None).unwrap();
        assert_ne!(k, GemmKey { align: 4, ..k }, "alignment is part of the key");
    }

    #[test]
    fn sibling_keys_batch_one_activation_over_strided_weights() {
        // k and v of a GQA layer: x [2, 16, 64] by two [32, 64] weights (transposed).
        let one = GemmKey::for_matmul(
            &[2, 16, 64],
            &[32, 64],
            true,
            GpuDType::Bf16,
            Epilogue::None,
        )
        .unwrap();
        let k = one.siblings(2, 32 * 64, 32 * 32).unwrap();
        assert_eq!((k.batch, k.strides), (2, (32 * 64, 0, 32 * 32)));
        assert_eq!((k.m, k.n, k.k, k.transa), (one.m, one.n, one.k, one.transa));
        assert_ne!(k, one, "a sibling GEMM has its own plan");
        // Overlapping weights or results, a single member, a batched or epilogue base: refused.
        assert!(one.siblings(2, 32 * 64 - 1, 32 * 32).is_err());
        assert!(one.siblings(2, 32 * 64, 32 * 32 - 1).is_err());
        assert!(one.siblings(1, 32 * 64, 32 * 32).is_err());
        let batched = GemmKey::for_matmul(
            &[2, 16, 64],
            &[2, 64, 32],
            false,
            GpuDType::F32,
            Epilogue::None,
        )
        .unwrap();
        assert!(batched.siblings(2, 1 << 20, 1 << 20).is_err());
        let bias =
            GemmKey::for_matmul(&[16, 64], &[32, 64], true, GpuDType::F32, Epilogue::Bias).unwrap();
        assert!(bias.siblings(2, 1 << 20, 1 << 20).is_err());
    }

    #[test]
    fn cache_keys_separate_what_changes_the_plan() {
        let key = |a: &[usize], dt, epi| GemmKey::for_matmul(a, &[176, 64], true, dt, epi).unwrap();
        let mut set = HashSet::new();
        // Same shapes from different layers/ranks share one plan.
        assert!(set.insert(key(&[2, 16, 64], GpuDType::F32, Epilogue::None)));
        assert!(!set.insert(key(&[32, 64], GpuDType::F32, Epilogue::None)));
        // dtype, epilogue and row count each get their own.
        assert!(set.insert(key(&[2, 16, 64], GpuDType::Bf16, Epilogue::None)));
        assert!(set.insert(key(&[2, 16, 64], GpuDType::F32, Epilogue::Bias)));
        assert!(set.insert(key(&[2, 16, 64], GpuDType::F32, Epilogue::GeluBias)));
        assert!(set.insert(key(&[1, 37, 64], GpuDType::F32, Epilogue::None)));
        assert_eq!(set.len(), 5);
    }
}
