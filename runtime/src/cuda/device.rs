//! One GPU: the driver probe, the context (event tracking off), the NVRTC arch, and the kernels
//! loaded for it.
//!
//! Pre: none. [`CudaDevice::open`] probes for `libcuda` (a plain `dlopen`) before the first
//! cudarc call, so a machine without a driver gets [`CudaError::NoDriver`], never a panic.
//! Post: the context has cudarc's automatic event tracking disabled (the executor orders its
//! streams with explicit events), and every kernel is compiled by NVRTC for this device's
//! `sm_XY` through the on-disk PTX cache the first time it is asked for.

use super::CudaError;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use shardc_kernels::launch::opt_in_shared_bytes;
use shardc_kernels::{
    arch_for_compute_capability, expand_includes, generate_fused_kernel, source_for_entry,
    FusedExpr, KernelDType,
};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// The backend's own kernels (layout.cu): data movement the registry does not provide.
pub(crate) const LAYOUT_CU: &str = include_str!("layout.cu");
/// NVRTC program name of [`LAYOUT_CU`].
const LAYOUT_NAME: &str = "shardc_layout.cu";
/// Entry points of [`LAYOUT_CU`].
pub(crate) const LAYOUT_ENTRIES: &[&str] = &[
    "strided_copy_b2",
    "strided_copy_b4",
    "rank_offset_i32",
    "round_bf16_f32",
];

/// Number of CUDA devices, or why CUDA cannot be used here. Never panics: `libcuda` is
/// `dlopen`ed before any cudarc call (see `shardc_kernels::cuda_available`).
pub fn cuda_device_count() -> Result<usize, CudaError> {
    shardc_kernels::cuda_available().map_err(CudaError::from_probe)
}

/// A GPU with its context and loaded kernels. Shared (`Arc`) by every rank thread that runs
/// on it.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    capability: (i32, i32),
    sm_count: usize,
    arch: &'static str,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, Kernel>>,
    /// `cuDriverGetVersion` (e.g. 13000), 0 when unknown.
    driver_version: i32,
    preloaded: std::sync::Once,
}

/// A loaded kernel and the byte size of each of its parameters, as the driver reports them
/// (`cuFuncGetParamInfo`, CUDA 12.4+); `None` where the driver cannot say.
#[derive(Clone)]
pub struct Kernel {
    /// Its entry point.
    pub name: Arc<str>,
    /// The function.
    pub function: CudaFunction,
    /// Its parameters' sizes in bytes, in order.
    pub params: Option<Arc<[usize]>>,
}

impl Kernel {
    /// `Ok` when a launch passes arguments of `passed` byte sizes ([`check_launch_args`]).
    pub(crate) fn check_args(&self, passed: &[usize]) -> Result<(), CudaError> {
        check_launch_args(&self.name, self.params.as_deref(), passed)
    }
}

/// The byte size of each parameter of `f` (`cuFuncGetParamInfo`), or `None` when the driver
/// (older than 12.4: `driver_version`) or the function cannot say.
fn param_sizes(f: &CudaFunction, driver_version: i32) -> Option<Arc<[usize]>> {
    if driver_version < 12040 {
        return None;
    }
    let mut sizes = Vec::new();
    for index in 0..1024 {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: a loaded function of a live context; the out-pointers are locals.
        let r = unsafe {
            cudarc::driver::sys::cuFuncGetParamInfo(f.cu_function(), index, &mut offset, &mut size)
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            break;
        }
        sizes.push(size);
    }
    // Every kernel here takes parameters: none reported means the query is not supported.
    (!sizes.is_empty()).then(|| sizes.into())
}

/// `Ok` when a launch of kernel `entry` passes arguments of the sizes the kernel's parameters
/// have (`params`, from [`Kernel::params`]; `None`: not known, not checked), else an error naming
/// the kernel and both lists: what a wrong argument list would otherwise do is read past the
/// argument array or hand a kernel the wrong bytes.
fn check_launch_args(
    entry: &str,
    params: Option<&[usize]>,
    passed: &[usize],
) -> Result<(), CudaError> {
    match params {
        Some(p) if p != passed => Err(CudaError::LaunchArgs {
            entry: entry.to_string(),
            params: p.to_vec(),
            passed: passed.to_vec(),
        }),
        _ => Ok(()),
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaDevice({}: {}, {})",
            self.ordinal, self.name, self.arch
        )
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: probe, primary context, event tracking off, arch.
    pub fn open(ordinal: usize) -> Result<Arc<CudaDevice>, CudaError> {
        let count = cuda_device_count()?;
        if ordinal >= count {
            return Err(CudaError::BadOrdinal { ordinal, count });
        }
        let ctx = match catch_unwind(|| CudaContext::new(ordinal)) {
            Ok(Ok(ctx)) => ctx,
            Ok(Err(e)) => {
                return Err(CudaError::NoDevice {
                    reason: format!("creating the context of device {ordinal}: {e}"),
                })
            }
            Err(_) => return Err(CudaError::NoDriver),
        };
        // SAFETY: called before this context allocated anything; from now on the executor
        // orders every cross-stream use with explicit events (see `program.rs`).
        unsafe { ctx.disable_event_tracking() };
        let capability = ctx
            .compute_capability()
            .map_err(CudaError::driver("query compute capability"))?;
        let name = ctx.name().map_err(CudaError::driver("query device name"))?;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(CudaError::driver("query the SM count"))?;
        let arch = arch_for_compute_capability(capability.0, capability.1)?;
        Ok(Arc::new(CudaDevice {
            ctx,
            ordinal,
            name,
            capability,
            sm_count: usize::try_from(sm_count).unwrap_or(0),
            arch,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            driver_version: {
                let mut v = 0;
                // SAFETY: an out-pointer to a local; the driver is loaded (the context exists).
                let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
                if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                    v
                } else {
                    0
                }
            },
            preloaded: std::sync::Once::new(),
        }))
    }

    /// The context (event tracking disabled).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Marketing name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Streaming multiprocessors (132 on an H100 SXM); 0 if the driver reported a negative count.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// NVRTC target (`sm_90`).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// A new non-blocking stream.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        self.ctx
            .new_stream()
            .map_err(CudaError::driver("create a stream"))
    }

    /// The kernel `entry` (`rmsnorm_bf16`, `strided_copy_b4`, ...), compiling and loading its
    /// source on first use.
    pub fn function(&self, entry: &str) -> Result<CudaFunction, CudaError> {
        self.kernel(entry).map(|k| k.function)
    }

    /// [`CudaDevice::function`] with its parameters' sizes ([`Kernel`]).
    pub fn kernel(&self, entry: &str) -> Result<Kernel, CudaError> {
        if let Some(k) = self.loaded(entry) {
            return Ok(k);
        }
        let module = self.module_for(entry)?;
        let f = module
            .load_function(entry)
            .map_err(CudaError::driver(format!("load kernel {entry}")))?;
        if let Some(bytes) = opt_in_shared_bytes(entry) {
            let what = format!("opt kernel {entry} in to {bytes} bytes of dynamic shared memory");
            let bytes = i32::try_from(bytes).unwrap_or(i32::MAX);
            self.ctx
                .bind_to_thread()
                .map_err(CudaError::driver(what.clone()))?;
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes,
            )
            .map_err(CudaError::driver(what))?;
        }
        Ok(self.remember(entry, f))
    }

    /// Kernel `name` if it is loaded.
    fn loaded(&self, name: &str) -> Option<Kernel> {
        self.functions
            .lock()
            .expect("invariant: kernel table lock not poisoned")
            .get(name)
            .cloned()
    }

    /// Records loaded function `f` as kernel `name`, with its parameters' sizes.
    fn remember(&self, name: &str, f: CudaFunction) -> Kernel {
        let k = Kernel {
            name: name.into(),
            params: param_sizes(&f, self.driver_version),
            function: f,
        };
        self.functions
            .lock()
            .expect("invariant: kernel table lock not poisoned")
            .insert(name.to_owned(), k.clone());
        k
    }

    /// Compiles (through the PTX cache) and loads every kernel family of the registry and the
    /// layout kernels, with every entry point, once per device, so no run loads a module
    /// lazily. A family that does not build for this device (tensor-core kernels on an older
    /// GPU) is skipped at its first failing entry; a run that launches it reports the error.
    pub fn preload_kernels(&self) {
        self.preloaded.call_once(|| {
            let families = shardc_kernels::KERNELS.iter().map(|k| k.entries);
            for entries in families.chain([LAYOUT_ENTRIES]) {
                for e in entries {
                    if self.function(e).is_err() {
                        break;
                    }
                }
            }
        });
    }

    /// The generated kernel of a fused elementwise expression (`shardc_kernels`'
    /// `generate_fused_kernel`), compiled and loaded on first use.
    pub fn fused_function(&self, expr: &FusedExpr, dt: KernelDType) -> Result<Kernel, CudaError> {
        let name = expr.kernel_name(dt);
        if let Some(k) = self.loaded(&name) {
            return Ok(k);
        }
        let src = generate_fused_kernel(&name, expr, dt);
        let ptx = shardc_kernels::compile(&format!("{name}.cu"), &src, self.arch, &[])?.to_ptx();
        let module = catch_unwind(AssertUnwindSafe(|| self.ctx.load_module(ptx)))
            .map_err(|_| CudaError::NoDriver)?
            .map_err(CudaError::driver(format!("load module {name}")))?;
        let f = module
            .load_function(&name)
            .map_err(CudaError::driver(format!("load kernel {name}")))?;
        Ok(self.remember(&name, f))
    }

    /// Compiles (through the PTX cache) and loads the source defining `entry`.
    fn module_for(&self, entry: &str) -> Result<Arc<CudaModule>, CudaError> {
        let layout = LAYOUT_ENTRIES.contains(&entry);
        let key = if layout {
            LAYOUT_NAME
        } else {
            source_for_entry(entry)?.file
        };
        let mut modules = self
            .modules
            .lock()
            .expect("invariant: module table lock not poisoned");
        if let Some(m) = modules.get(key) {
            return Ok(m.clone());
        }
        let ptx = if layout {
            shardc_kernels::compile(LAYOUT_NAME, &expand_includes(LAYOUT_CU), self.arch, &[])?
        } else {
            source_for_entry(entry)?.compile(self.arch)?
        };
        let ptx = ptx.to_ptx();
        let module = catch_unwind(AssertUnwindSafe(|| self.ctx.load_module(ptx)))
            .map_err(|_| CudaError::NoDriver)?
            .map_err(CudaError::driver(format!("load module {key}")))?;
        modules.insert(key, module.clone());
        Ok(module)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launch whose argument sizes differ from the kernel's parameters (a missing, extra or
    /// wrongly sized argument) is an error naming the kernel and both lists; a match, or a
    /// driver that reports no parameters, passes.
    #[test]
    fn launch_arguments_are_checked_against_the_kernel() {
        let params = [8, 8, 8, 8, 4];
        assert!(check_launch_args("k", Some(&params), &[8, 8, 8, 8, 4]).is_ok());
        assert!(check_launch_args("k", None, &[8]).is_ok());
        for passed in [&[8, 8, 8, 8][..], &[8, 8, 8, 8, 4, 8], &[8, 8, 8, 8, 8]] {
            let e =
                check_launch_args("adamw_update_f32", Some(&params), passed).expect_err("mismatch");
            let msg = e.to_string();
            assert!(msg.contains("`adamw_update_f32`"), "{msg}");
            assert!(
                msg.contains("takes 5 parameters of [8, 8, 8, 8, 4] bytes"),
                "{msg}"
            );
            assert!(
                msg.contains(&format!("passes {} of {passed:?}", passed.len())),
                "{msg}"
            );
        }
    }

    /// Without a driver (this CI machine) opening fails cleanly; with one it succeeds.
    #[test]
    fn open_never_panics() {
        match CudaDevice::open(0) {
            Ok(dev) => assert!(dev.arch().starts_with("sm_")),
            Err(e) => assert!(e.is_unavailable(), "{e}"),
        }
    }

    /// NVRTC-gated like `shardc-kernels`' PTX tests: skipped (loudly) without libnvrtc unless
    /// `SHARDC_REQUIRE_NVRTC=1`. Checks every entry and the by-value `StridedSpec` parameter
    /// size against the Rust mirror.
    #[test]
    fn layout_kernels_compile_to_ptx() {
        if shardc_kernels::nvrtc_version().is_err()
            && std::env::var_os("SHARDC_REQUIRE_NVRTC").is_none()
        {
            eprintln!("skipped: libnvrtc not found (kernels/ci-nvrtc.sh installs it)");
            return;
        }
        let ptx = shardc_kernels::PtxCache::disabled()
            .compile(LAYOUT_NAME, &expand_includes(LAYOUT_CU), "sm_90", &[])
            .unwrap_or_else(|e| panic!("{e}"));
        for e in LAYOUT_ENTRIES {
            assert!(ptx.has_entry(e), "{e} missing from the PTX");
        }
        let size = std::mem::size_of::<super::super::strided::StridedSpec>();
        assert!(
            ptx.ptx
                .contains(&format!("strided_copy_b4_param_2[{size}]")),
            "the StridedSpec parameter is not {size} bytes in the PTX"
        );
        // A generated fused kernel of the kind `FusedElementwise` produces.
        let e = FusedExpr::unary(shardc_kernels::FusedUnary::Silu, FusedExpr::input(0))
            * FusedExpr::input(1)
            + FusedExpr::input(2);
        for dt in KernelDType::ALL {
            let name = e.kernel_name(dt);
            let src = generate_fused_kernel(&name, &e, dt);
            let ptx = shardc_kernels::PtxCache::disabled()
                .compile(&format!("{name}.cu"), &src, "sm_90", &[])
                .unwrap_or_else(|err| panic!("{err}"));
            assert!(ptx.has_entry(&name));
        }
    }

    #[test]
    fn layout_entries_are_defined() {
        for e in LAYOUT_ENTRIES {
            assert!(
                LAYOUT_CU.contains(&format!("void {e}(")),
                "{e} missing from layout.cu"
            );
        }
        let src = expand_includes(LAYOUT_CU);
        assert!(!src.lines().any(|l| l.trim_start().starts_with("#include")));
    }
}
