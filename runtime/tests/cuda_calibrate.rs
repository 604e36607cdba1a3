//! The calibration micro-benchmarks (`shardc_runtime::cuda::calibrate`) on a real GPU: every
//! sample is finite and positive, no rate exceeds the device's datasheet peak (the oracle:
//! a timing bug that undercounts time shows up as an impossible rate), bf16 GEMMs beat f32
//! ones, and the records survive the `--measurements` JSON format and are accepted by
//! `fit_profile`.
//!
//! Needs a GPU: `cargo test -p shardc-runtime --test cuda_calibrate -- --include-ignored`.

use shardc_compiler::cost::{fit_profile, DeviceProfile, Measurements};
use shardc_compiler::ir::DType;
use shardc_runtime::cuda::calibrate::{measure, CalibrateOptions};
use shardc_runtime::cuda::CudaDevice;

#[test]
#[ignore = "needs a GPU"]
fn quick_calibration_is_plausible_and_fits() {
    let dev = CudaDevice::open(0).unwrap_or_else(|e| panic!("{e}"));
    let o = CalibrateOptions::quick();
    let m = measure(&dev, &o).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(m.device, dev.name());
    assert_eq!(m.gemm.len(), 2 * o.gemm_shapes.len());
    assert_eq!(m.copy.len(), o.copy_bytes.len());
    assert_eq!(m.collectives.len(), 3 * o.collective_bytes.len());
    let ok = |t: f64| t.is_finite() && t > 0.0;
    assert!(m.gemm.iter().all(|g| ok(g.seconds)), "{:?}", m.gemm);
    assert!(m.copy.iter().all(|c| ok(c.seconds)), "{:?}", m.copy);
    assert!(
        m.collectives
            .iter()
            .all(|c| ok(c.seconds) && c.ranks == 2 && !c.network),
        "{:?}",
        m.collectives
    );
    for (c, &b) in m.copy.iter().zip(&o.copy_bytes) {
        assert_eq!(c.bytes, b);
    }

    // Rates against the datasheet of the matching profile (H100 SXM; other GPUs get a
    // generous bound from the H100's numbers, which no current GPU exceeds by 3x).
    let base = DeviceProfile::load("h100-sxm").unwrap_or_else(|e| panic!("{e}"));
    let slack = if dev.name().contains("H100") {
        1.1
    } else {
        3.0
    };
    for g in &m.gemm {
        let rate = 2.0 * (g.m * g.n * g.k) as f64 / g.seconds;
        assert!(
            rate <= slack * base.peak(g.dtype),
            "{g:?}: {rate:e} FLOP/s over the peak"
        );
    }
    for c in &m.copy {
        let bw = 2.0 * c.bytes as f64 / c.seconds;
        assert!(
            bw <= slack * base.hbm_bandwidth.value,
            "{c:?}: {bw:e} B/s over HBM"
        );
    }
    let (bf, f) = (
        m.gemm
            .iter()
            .find(|g| g.dtype == DType::Bf16 && g.m == 2048)
            .expect("bf16 2048^3"),
        m.gemm
            .iter()
            .find(|g| g.dtype == DType::F32 && g.m == 2048)
            .expect("f32 2048^3"),
    );
    assert!(bf.seconds < f.seconds, "bf16 {bf:?} not faster than {f:?}");

    // The `--measurements` format round-trips, and the fitter takes the records.
    let json = serde_json::to_string(&m).expect("serialize");
    let back: Measurements = serde_json::from_str(&json).expect("parse");
    assert_eq!(back, m);
    let (fit, _) = fit_profile(&base, None, &back).unwrap_or_else(|e| panic!("{e}"));
    for e in [
        &fit.efficiency.gemm_large,
        &fit.efficiency.gemm_medium,
        &fit.efficiency.gemm_tiny,
        &fit.efficiency.memory,
        &fit.efficiency.nvlink,
    ] {
        assert!(e.source.contains("shardc calibrate"), "{e:?} not fitted");
        assert!(e.value > 0.0 && e.value <= 1.0, "{e:?}");
    }
    assert!(fit.launch_floor.source.contains("shardc calibrate"));
    assert!(fit.launch_floor.value > 0.0 && fit.launch_floor.value < 1e-3);
}
