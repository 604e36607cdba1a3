//! Run-time probes for the CUDA driver and NVRTC (NOTES-cuda.md §1.2).
//!
//! cudarc with `dynamic-loading` panics on the first call into a library it cannot `dlopen`.
//! These probes first ask `is_culib_present()` (a plain `dlopen`, never panics) and then make
//! the first real call under `catch_unwind`, so they return `Err` on a machine without CUDA.
//! (With `panic = "abort"` the `catch_unwind` cannot help; the `dlopen` check still does.)

use crate::{KernelError, Unavailable};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// Number of CUDA devices, or why there are none usable. Never panics without a driver.
pub fn cuda_available() -> Result<usize, KernelError> {
    let unavailable = |reason| KernelError::CudaUnavailable { reason };
    // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's candidate names and drops the
    // handle; it runs no library code beyond the loader's initialisers.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable(Unavailable::LibraryNotFound {
            library: "libcuda",
        }));
    }
    match catch_unwind(cudarc::driver::CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => Ok(usize::try_from(n).expect("invariant: n > 0")),
        Ok(Ok(_)) => Err(unavailable(Unavailable::NoDevices)),
        Ok(Err(error)) => Err(unavailable(Unavailable::Driver { error })),
        Err(payload) => Err(unavailable(Unavailable::Panicked {
            library: "libcuda",
            message: panic_message(payload.as_ref()),
        })),
    }
}

/// The NVRTC version `(major, minor)`, probing for libnvrtc first. Every NVRTC entry point of
/// this crate calls it before touching cudarc's `nvrtc` module.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    static VERSION: OnceLock<(i32, i32)> = OnceLock::new();
    if let Some(v) = VERSION.get() {
        return Ok(*v);
    }
    let unavailable = |reason| KernelError::NvrtcUnavailable { reason };
    // SAFETY: as in `cuda_available`: a `dlopen` probe only.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(unavailable(Unavailable::LibraryNotFound {
            library: "libnvrtc",
        }));
    }
    let call = catch_unwind(AssertUnwindSafe(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both pointers are to live, writable `c_int`s on this stack frame.
        let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        status.result().map(|()| (major, minor))
    }));
    match call {
        Ok(Ok(v)) => Ok(*VERSION.get_or_init(|| v)),
        Ok(Err(error)) => Err(unavailable(Unavailable::Nvrtc {
            library: "libnvrtc",
            error,
        })),
        Err(payload) => Err(unavailable(Unavailable::Panicked {
            library: "libnvrtc",
            message: panic_message(payload.as_ref()),
        })),
    }
}

/// Whether NVRTC can be used in this process.
pub fn nvrtc_available() -> bool {
    nvrtc_version().is_ok()
}

/// The text of a panic payload (`&str` or `String`), or a placeholder.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_owned()
    }
}

/// The NVRTC `--gpu-architecture` for a compute capability, from a fixed table (the arch must
/// be `&'static str` for cudarc). NVRTC 13 compiles for sm_75 and newer.
pub fn arch_for_compute_capability(major: i32, minor: i32) -> Result<&'static str, KernelError> {
    Ok(match (major, minor) {
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (10, 3) => "sm_103",
        (11, 0) => "sm_110",
        (12, 0) => "sm_120",
        (12, 1) => "sm_121",
        _ => return Err(KernelError::UnsupportedArch { major, minor }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a driver the probe must return `Err`, not panic. With a GPU it
    /// returns the device count; either way it must not unwind.
    #[test]
    fn cuda_probe_never_panics() {
        match cuda_available() {
            Ok(n) => assert!(n > 0),
            Err(KernelError::CudaUnavailable { reason }) => {
                assert!(!reason.to_string().is_empty());
            }
            Err(other) => panic!("unexpected error kind: {other}"),
        }
    }

    #[test]
    fn nvrtc_probe_never_panics() {
        match nvrtc_version() {
            Ok((major, _)) => assert!(major >= 12),
            Err(e) => assert!(matches!(e, KernelError::NvrtcUnavailable { .. }), "{e}"),
        }
    }

    #[test]
    fn arch_table() {
        assert_eq!(arch_for_compute_capability(9, 0).ok(), Some("sm_90"));
        assert!(matches!(
            arch_for_compute_capability(6, 1),
            Err(KernelError::UnsupportedArch { major: 6, minor: 1 })
        ));
    }

    #[test]
    fn panic_messages() {
        assert_eq!(panic_message(&"boom"), "boom");
        assert_eq!(panic_message(&String::from("bang")), "bang");
        assert_eq!(panic_message(&3_u8), "(non-string panic payload)");
    }
}
