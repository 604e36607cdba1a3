//! Calibration: fit a profile's efficiency factors and latencies from micro-benchmark
//! measurements (GEMMs by shape, device copies, collectives by size). `shardc calibrate`
//! measures them with the GPU backend and writes the fitted profile; measurements taken
//! elsewhere (nccl-tests, a cuBLAS sweep) can be fitted from a JSON file.
//!
//! Fits: each GEMM class's efficiency is the median of `2mnk / t / peak` over its samples; the
//! memory efficiency the median of `2·bytes / t / hbm` over copies of at least 64 MiB; the
//! launch floor the fastest copy of at most 64 KiB; NVLink efficiency the median of nccl-tests'
//! `busbw / (NVLink per direction)` over intra-node collectives of at least 64 MiB, and its
//! latency the median of `t / ring steps` over ones of at most 64 KiB; the network the same
//! against the adapters' per-GPU share.

use super::collective::CollectiveKind;
use super::profile::{ClusterProfile, DeviceProfile, Sourced};
use super::roofline::GemmClass;
use super::roofline::GemmShape;
use super::CostError;
use crate::ir::DType;
use serde::{Deserialize, Serialize};

/// One GEMM timing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmSample {
    /// Output rows.
    pub m: usize,
    /// Output columns.
    pub n: usize,
    /// Contracted dim.
    pub k: usize,
    /// Element type.
    pub dtype: DType,
    /// Seconds per GEMM.
    pub seconds: f64,
}

/// One device-to-device copy timing (`bytes` read and `bytes` written).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CopySample {
    /// Buffer size.
    pub bytes: u64,
    /// Seconds per copy.
    pub seconds: f64,
}

/// One collective timing (nccl-tests' size and time).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollectiveSample {
    /// Which collective.
    pub kind: CollectiveKind,
    /// Ranks.
    pub ranks: usize,
    /// nccl-tests size.
    pub bytes: u64,
    /// Seconds per collective.
    pub seconds: f64,
    /// The ranks span nodes (one rank per node).
    pub network: bool,
}

/// A calibration run's measurements.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Measurements {
    /// What was measured (device name as the driver reports it).
    pub device: String,
    /// GEMMs.
    #[serde(default)]
    pub gemm: Vec<GemmSample>,
    /// Copies.
    #[serde(default)]
    pub copy: Vec<CopySample>,
    /// Collectives.
    #[serde(default)]
    pub collectives: Vec<CollectiveSample>,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite() && *x > 0.0);
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

const BIG: u64 = 64 << 20;
const SMALL: u64 = 64 << 10;

/// Fits `base` (and `cluster`, when given) to `m`. Factors without samples keep their base
/// value and source.
pub fn fit_profile(
    base: &DeviceProfile,
    cluster: Option<&ClusterProfile>,
    m: &Measurements,
) -> Result<(DeviceProfile, Option<ClusterProfile>), CostError> {
    let mut d = base.clone();
    let src = |what: String| format!("measured by `shardc calibrate` on {}: {what}", m.device);
    let frac = |x: f64| x.clamp(1e-3, 1.0);
    for class in [
        GemmClass::Large,
        GemmClass::Medium,
        GemmClass::Small,
        GemmClass::Tiny,
    ] {
        let samples: Vec<f64> = m
            .gemm
            .iter()
            .filter(|s| {
                GemmShape {
                    m: s.m,
                    n: s.n,
                    k: s.k,
                    batch: 1,
                }
                .class()
                    == class
            })
            .map(|s| 2.0 * s.m as f64 * s.n as f64 * s.k as f64 / s.seconds / base.peak(s.dtype))
            .collect();
        let n = samples.len();
        if let Some(e) = median(samples) {
            let slot = match class {
                GemmClass::Large => &mut d.efficiency.gemm_large,
                GemmClass::Medium => &mut d.efficiency.gemm_medium,
                GemmClass::Small => &mut d.efficiency.gemm_small,
                GemmClass::Tiny => &mut d.efficiency.gemm_tiny,
            };
            *slot = Sourced::new(frac(e), src(format!("median of {n} {class:?} GEMMs")));
        }
    }
    let big: Vec<f64> = m
        .copy
        .iter()
        .filter(|c| c.bytes >= BIG)
        .map(|c| 2.0 * c.bytes as f64 / c.seconds / base.hbm_bandwidth.value)
        .collect();
    let n = big.len();
    if let Some(e) = median(big) {
        d.efficiency.memory = Sourced::new(frac(e), src(format!("median of {n} copies >= 64 MiB")));
    }
    if let Some(t) = m
        .copy
        .iter()
        .filter(|c| c.bytes <= SMALL && c.seconds > 0.0)
        .map(|c| c.seconds)
        .min_by(f64::total_cmp)
    {
        d.launch_floor = Sourced::new(t, src("fastest copy <= 64 KiB".into()));
    }
    let busbw = |network: bool, pred: &dyn Fn(u64) -> bool| -> Vec<f64> {
        m.collectives
            .iter()
            .filter(|c| c.network == network && pred(c.bytes) && c.ranks > 1)
            .map(|c| c.bytes as f64 / c.seconds * c.kind.bus_factor(c.ranks))
            .collect()
    };
    let alpha = |network: bool| -> Option<f64> {
        median(
            m.collectives
                .iter()
                .filter(|c| c.network == network && c.bytes <= SMALL && c.ranks > 1)
                .map(|c| c.seconds / c.kind.ring_steps(c.ranks))
                .collect(),
        )
    };
    let nv = busbw(false, &|b| b >= BIG);
    let n = nv.len();
    if let Some(bw) = median(nv) {
        d.efficiency.nvlink = Sourced::new(
            frac(bw / base.nvlink_per_direction()),
            src(format!(
                "median busbw of {n} intra-node collectives >= 64 MiB"
            )),
        );
    }
    d.check()?;
    let c = match cluster {
        None => None,
        Some(c) => {
            let mut c = c.clone();
            if let Some(a) = alpha(false) {
                c.nvlink_latency =
                    Sourced::new(a, src("median per-step latency, intra-node".into()));
            }
            if let Some(a) = alpha(true) {
                c.network_latency =
                    Sourced::new(a, src("median per-step latency, inter-node".into()));
            }
            let share =
                c.nic_bandwidth.value * c.nics_per_node.value as f64 / c.gpus_per_node.value as f64;
            let net = busbw(true, &|b| b >= BIG);
            let n = net.len();
            if let Some(bw) = median(net) {
                c.network_efficiency = Sourced::new(
                    frac(bw / share),
                    src(format!(
                        "median busbw of {n} inter-node collectives >= 64 MiB"
                    )),
                );
            }
            c.check()?;
            Some(c)
        }
    };
    if m.gemm.is_empty() && m.copy.is_empty() && m.collectives.is_empty() {
        return Err(CostError::Calibrate(
            "no measurements (gemm, copy and collectives are all empty)".into(),
        ));
    }
    Ok((d, c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::profile::Cluster;
    use crate::cost::{collective_time, kernel_time, Bytes, GroupTopology, Kernel};

    #[test]
    fn fit_recovers_a_known_device() {
        // Measurements generated by a device whose factors we know; the fit recovers them.
        let c = Cluster::resolve("dgx-h100x2").unwrap();
        let mut truth = c.device.clone();
        truth.efficiency.gemm_large.value = 0.61;
        truth.efficiency.memory.value = 0.77;
        truth.efficiency.nvlink.value = 0.66;
        let mut tc = c.clone();
        tc.device = truth.clone();
        let mut m = Measurements {
            device: "synthetic".into(),
            ..Measurements::default()
        };
        for n in [2048usize, 4096, 8192] {
            let shape = GemmShape {
                m: n,
                n,
                k: n,
                batch: 1,
            };
            let k = Kernel::gemm(shape, 0.0);
            m.gemm.push(GemmSample {
                m: n,
                n,
                k: n,
                dtype: DType::Bf16,
                seconds: kernel_time(&truth, DType::Bf16, &k).0,
            });
        }
        for b in [64u64 << 20, 256 << 20, 1 << 30] {
            let k = Kernel::memory(2.0 * b as f64);
            m.copy.push(CopySample {
                bytes: b,
                seconds: kernel_time(&truth, DType::Bf16, &k).0,
            });
        }
        for b in [64u64 << 20, 1 << 30] {
            m.collectives.push(CollectiveSample {
                kind: CollectiveKind::AllReduce,
                ranks: 8,
                bytes: b,
                seconds: collective_time(
                    &tc,
                    CollectiveKind::AllReduce,
                    Bytes(b),
                    GroupTopology::intra(8),
                )
                .0,
                network: false,
            });
        }
        let (fit, _) = fit_profile(&c.device, Some(&c.profile), &m).unwrap();
        assert!((fit.efficiency.gemm_large.value - 0.61).abs() < 1e-9);
        assert!((fit.efficiency.memory.value - 0.77).abs() < 1e-9);
        assert!((fit.efficiency.nvlink.value - 0.66).abs() < 0.01);
        assert!(fit.efficiency.memory.source.contains("shardc calibrate"));
        // Unmeasured factors keep their base values.
        assert_eq!(fit.efficiency.gemm_tiny, c.device.efficiency.gemm_tiny);
        assert!(fit_profile(&c.device, None, &Measurements::default()).is_err());
    }
}
