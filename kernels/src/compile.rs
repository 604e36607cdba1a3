//! NVRTC compilation to PTX, through the on-disk cache.
//!
//! Pre-condition: none; without libnvrtc every function returns
//! [`KernelError::NvrtcUnavailable`] (the probe runs before any cudarc NVRTC call).
//! Post-condition: the PTX targets `arch`, was built with `-lineinfo`, and a source error comes
//! back as [`KernelError::Compile`] with the NVRTC log and a numbered excerpt.

use crate::cache::{CacheKey, CacheOutcome, PtxCache};
use crate::excerpt::source_excerpt;
use crate::probe::{nvrtc_version, panic_message};
use crate::{KernelError, Unavailable};
use cudarc::nvrtc::result::{self, NvrtcError};
use cudarc::nvrtc::sys;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Options passed on every compile, before the caller's.
pub const ALWAYS_OPTIONS: &[&str] = &["-lineinfo"];

/// PTX text from NVRTC or the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompiledPtx {
    /// Source name it was compiled as.
    pub source_name: String,
    /// Target architecture, e.g. `sm_90`.
    pub arch: &'static str,
    /// The PTX text.
    pub ptx: String,
    /// The cache key it is stored under.
    pub key: CacheKey,
    /// Whether it came from the cache.
    pub cache: CacheOutcome,
}

impl CompiledPtx {
    /// The PTX as cudarc's type, for `CudaContext::load_module`.
    pub fn to_ptx(&self) -> cudarc::nvrtc::Ptx {
        cudarc::nvrtc::Ptx::from_src(self.ptx.clone())
    }

    /// The `.entry` symbols the PTX defines, in order.
    pub fn entries(&self) -> Vec<&str> {
        ptx_entries(&self.ptx)
    }

    /// Whether the PTX defines the kernel `name`.
    pub fn has_entry(&self, name: &str) -> bool {
        self.entries().contains(&name)
    }
}

/// The names after each `.entry` directive of a PTX module.
pub fn ptx_entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|l| {
            let rest = &l[l.find(".entry ")? + ".entry ".len()..];
            let rest = rest.trim_start();
            let end = rest
                .find(|c: char| c == '(' || c.is_whitespace())
                .unwrap_or(rest.len());
            Some(&rest[..end]).filter(|n| !n.is_empty())
        })
        .collect()
}

/// The option list NVRTC receives: [`ALWAYS_OPTIONS`], then `options` (duplicates dropped).
pub fn effective_options(options: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(ALWAYS_OPTIONS.len() + options.len());
    for o in ALWAYS_OPTIONS.iter().chain(options) {
        if !out.iter().any(|x| x == o) {
            out.push((*o).to_owned());
        }
    }
    out
}

/// Compiles `src` (named `source_name`, e.g. `norm.cu`) to PTX for `arch` (e.g. `sm_90`) with
/// `-lineinfo` plus `options`, using the default cache ([`PtxCache::from_env`]).
pub fn compile(
    source_name: &str,
    src: &str,
    arch: &'static str,
    options: &[&str],
) -> Result<CompiledPtx, KernelError> {
    PtxCache::from_env().compile(source_name, src, arch, options)
}

impl PtxCache {
    /// [`compile`] through this cache.
    pub fn compile(
        &self,
        source_name: &str,
        src: &str,
        arch: &'static str,
        options: &[&str],
    ) -> Result<CompiledPtx, KernelError> {
        let version = nvrtc_version()?;
        let options = effective_options(options);
        let key = CacheKey::new(source_name, src, &options, arch, version);
        let done = |ptx, cache| CompiledPtx {
            source_name: source_name.to_owned(),
            arch,
            ptx,
            key,
            cache,
        };
        if let Some(ptx) = self.load(&key) {
            return Ok(done(ptx, CacheOutcome::Hit));
        }
        let ptx = nvrtc_compile(source_name, src, arch, options)?;
        let outcome = self.store(&key, &ptx);
        Ok(done(ptx, outcome))
    }
}

/// Compiles `src` (named `source_name`) for the real architecture `arch` (e.g. `sm_90`) to a
/// CUBIN, with `-lineinfo` plus `options`, no cache. The CUBIN comes out of NVRTC's assembler
/// (ptxas), so malformed inline PTX (`asm(...)`) fails here as [`KernelError::Compile`] with
/// ptxas' log (NVRTC 13.0 also assembles when asked for PTX for a real `sm_XY`, but only
/// this function guarantees it). The bytes load with `cudarc::nvrtc::Ptx::from_binary`.
pub fn compile_cubin(
    source_name: &str,
    src: &str,
    arch: &'static str,
    options: &[&str],
) -> Result<Vec<u8>, KernelError> {
    nvrtc_version()?;
    nvrtc_run(
        source_name,
        src,
        arch,
        effective_options(options),
        Output::Cubin,
    )
}

/// What an NVRTC run hands back.
#[derive(Clone, Copy)]
enum Output {
    Ptx,
    Cubin,
}

/// One NVRTC run giving PTX text, no cache. The caller has probed NVRTC.
fn nvrtc_compile(
    source_name: &str,
    src: &str,
    arch: &'static str,
    options: Vec<String>,
) -> Result<String, KernelError> {
    let bytes = nvrtc_run(source_name, src, arch, options, Output::Ptx)?;
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    Ok(String::from_utf8_lossy(&bytes[..end]).into_owned())
}

/// One NVRTC run: create, compile with `options` and `--gpu-architecture=<arch>`, fetch the
/// PTX or CUBIN, destroy. The caller has probed NVRTC.
fn nvrtc_run(
    source_name: &str,
    src: &str,
    arch: &'static str,
    mut options: Vec<String>,
    output: Output,
) -> Result<Vec<u8>, KernelError> {
    let kernel = || source_name.to_owned();
    let c_string = |what, text: &str| {
        CString::new(text).map_err(|e| KernelError::NulByte {
            kernel: kernel(),
            what,
            offset: e.nul_position(),
        })
    };
    let src_c = c_string("source", src)?;
    let name_c = c_string("name", source_name)?;
    for option in &options {
        c_string("options", option)?;
    }
    options.push(format!("--gpu-architecture={arch}"));
    let nvrtc = |stage, error| KernelError::Nvrtc {
        kernel: kernel(),
        stage,
        error,
    };
    // cudarc panics (rather than erring) on a missing symbol.
    let run = catch_unwind(AssertUnwindSafe(|| {
        let prog = result::create_program(&src_c, Some(&name_c))
            .map_err(|e| nvrtc("create program", e))?;
        // SAFETY: `prog` was created above and is destroyed only after this block; `src_c`
        // and `name_c` outlive it.
        let body = unsafe {
            match result::compile_program(prog, &options) {
                Err(_) => match result::get_program_log(prog) {
                    Ok(log) => {
                        let log = c_text(&log);
                        Err(KernelError::Compile {
                            kernel: kernel(),
                            source_excerpt: source_excerpt(src, &log),
                            log,
                        })
                    }
                    Err(e) => Err(nvrtc("get log", e)),
                },
                Ok(()) => match output {
                    Output::Ptx => result::get_ptx(prog)
                        .map(|p| p.iter().map(|&c| c as u8).collect())
                        .map_err(|e| nvrtc("get PTX", e)),
                    Output::Cubin => get_cubin(prog).map_err(|e| nvrtc("get CUBIN", e)),
                },
            }
        };
        // SAFETY: `prog` is live and not used after this call.
        let destroyed = unsafe { result::destroy_program(prog) };
        let bytes = body?;
        destroyed.map_err(|e| nvrtc("destroy program", e))?;
        Ok(bytes)
    }));
    run.unwrap_or_else(|payload| {
        Err(KernelError::NvrtcUnavailable {
            reason: Unavailable::Panicked {
                library: "libnvrtc",
                message: panic_message(payload.as_ref()),
            },
        })
    })
}

/// The text of a NUL-terminated NVRTC buffer (the log).
fn c_text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The CUBIN of a program compiled for a real architecture.
///
/// # Safety
/// `prog` is a live program on which compilation succeeded.
unsafe fn get_cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `prog` is live (caller); `size` is a writable usize.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }.result()?;
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lineinfo_always_first_and_once() {
        assert_eq!(effective_options(&[]), vec!["-lineinfo"]);
        assert_eq!(
            effective_options(&["-std=c++17", "-lineinfo", "-std=c++17"]),
            vec!["-lineinfo", "-std=c++17"]
        );
    }

    #[test]
    fn entries_from_ptx_text() {
        let ptx = "\
.version 9.0
.target sm_90
.address_size 64

\t// .globl\tembedding_f32
.visible .entry embedding_f32(
\t.param .u64 embedding_f32_param_0
)
.visible .entry embedding_bf16(
.entry local_one (
";
        assert_eq!(
            ptx_entries(ptx),
            vec!["embedding_f32", "embedding_bf16", "local_one"]
        );
    }

    #[test]
    fn compile_without_nvrtc_is_a_clean_error() {
        // Meaningful only where libnvrtc is absent; elsewhere tests/ptx.rs covers compiling.
        if nvrtc_version().is_err() {
            let err = PtxCache::disabled()
                .compile("x.cu", "extern \"C\" __global__ void f() {}", "sm_90", &[])
                .expect_err("no NVRTC here");
            assert!(matches!(err, KernelError::NvrtcUnavailable { .. }), "{err}");
        }
    }
}
