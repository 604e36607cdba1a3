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
//!
//! Pre: none ([`Measurements::check`] runs first). Post: every sample was in range (positive
//! finite times, sizes and rank counts within bounds) and every fitted number inside the
//! profile's plausibility range; a fit outside it (GEMMs faster than the base profile's peak,
//! say) is an error naming the factor, never a clamped value.

use super::collective::CollectiveKind;
use super::profile::{num, ClusterProfile, DeviceProfile, Sourced, EFFICIENCY, LATENCY};
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

/// Seconds a sample may take.
const SECONDS: (f64, f64) = (1e-12, 1e6);
/// GEMM dims (`m`, `n`, `k`).
const MAX_DIM: usize = 1 << 31;
/// Copy and collective sizes, bytes.
const MAX_BYTES: u64 = 1 << 50;
/// Ranks of a collective.
const MAX_RANKS: usize = 1 << 24;

fn bad(msg: String) -> CostError {
    CostError::Calibrate(msg)
}

impl Measurements {
    /// Parses a measurements file's text (the JSON `shardc calibrate` writes) and checks it.
    pub fn from_json(text: &str) -> Result<Measurements, CostError> {
        let m: Measurements =
            serde_json::from_str(text).map_err(|e| bad(format!("malformed JSON: {e}")))?;
        m.check()?;
        Ok(m)
    }

    /// Checks every sample: times finite and in `[1e-12, 1e6]` s, GEMM dims in `[1, 2³¹]`,
    /// sizes in `[1, 2⁵⁰]` bytes, collectives over `[2, 2²⁴]` ranks. Errors name the sample
    /// and field (`gemm[2].seconds`).
    pub fn check(&self) -> Result<(), CostError> {
        let seconds = |at: String, t: f64| {
            if (SECONDS.0..=SECONDS.1).contains(&t) {
                Ok(())
            } else {
                Err(bad(format!(
                    "{at}.seconds: must be in [{}, {}], found {}",
                    num(SECONDS.0),
                    num(SECONDS.1),
                    num(t)
                )))
            }
        };
        let size = |at: String, b: u64| {
            if (1..=MAX_BYTES).contains(&b) {
                Ok(())
            } else {
                Err(bad(format!(
                    "{at}.bytes: must be in [1, {MAX_BYTES}], found {b}"
                )))
            }
        };
        for (i, g) in self.gemm.iter().enumerate() {
            for (f, d) in [("m", g.m), ("n", g.n), ("k", g.k)] {
                if !(1..=MAX_DIM).contains(&d) {
                    return Err(bad(format!(
                        "gemm[{i}].{f}: must be in [1, {MAX_DIM}], found {d}"
                    )));
                }
            }
            seconds(format!("gemm[{i}]"), g.seconds)?;
        }
        for (i, c) in self.copy.iter().enumerate() {
            size(format!("copy[{i}]"), c.bytes)?;
            seconds(format!("copy[{i}]"), c.seconds)?;
        }
        for (i, c) in self.collectives.iter().enumerate() {
            if !(2..=MAX_RANKS).contains(&c.ranks) {
                return Err(bad(format!(
                    "collectives[{i}].ranks: must be in [2, {MAX_RANKS}], found {}",
                    c.ranks
                )));
            }
            size(format!("collectives[{i}]"), c.bytes)?;
            seconds(format!("collectives[{i}]"), c.seconds)?;
        }
        Ok(())
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// A fitted latency or launch floor, refused outside `range`: a fit outside the profile's
/// range means the samples are wrong.
fn fitted(what: &str, x: f64, range: (f64, f64), hint: &str) -> Result<f64, CostError> {
    if (range.0..=range.1).contains(&x) {
        return Ok(x);
    }
    Err(bad(format!(
        "{what}: fitted {} is outside [{}, {}]; {hint}",
        num(x),
        num(range.0),
        num(range.1)
    )))
}

/// How far above a peak a fitted efficiency may come and be capped at 1 (with a note) rather
/// than refused: boost clocks beat datasheet peaks by a few percent, local-gpu collectives
/// (virtual ranks on one GPU) time its memory rather than NVLink, and a newer GPU measured
/// against an older base profile beats that profile's bandwidths. Beyond this the samples or
/// the base profile are wrong.
pub const MAX_OVERSHOOT: f64 = 2.0;

/// A fit: the profiles and the factors capped at 1, each as a sentence for a warning.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileFit {
    /// The fitted device profile.
    pub device: DeviceProfile,
    /// The fitted cluster profile, when one was given.
    pub cluster: Option<ClusterProfile>,
    /// Efficiencies measured above their peak and written as 1 (their sources say so too).
    pub capped: Vec<String>,
}

const BIG: u64 = 64 << 20;
const SMALL: u64 = 64 << 10;

/// Fits `base` (and `cluster`, when given) to `m`. Factors without samples keep their base
/// value and source. See [`fit_profile_report`] for what is refused and what is capped.
pub fn fit_profile(
    base: &DeviceProfile,
    cluster: Option<&ClusterProfile>,
    m: &Measurements,
) -> Result<(DeviceProfile, Option<ClusterProfile>), CostError> {
    let f = fit_profile_report(base, cluster, m)?;
    Ok((f.device, f.cluster))
}

/// Fits `base` (and `cluster`) to `m`, after [`Measurements::check`]. An efficiency in
/// `[1e-4, 1]` is taken as measured; one in `(1, MAX_OVERSHOOT]` is written as 1 with its
/// measured value in the source and a note in [`ProfileFit::capped`]; anything else, and a
/// latency or launch floor outside the profile's range, is an error naming the factor.
pub fn fit_profile_report(
    base: &DeviceProfile,
    cluster: Option<&ClusterProfile>,
    m: &Measurements,
) -> Result<ProfileFit, CostError> {
    m.check()?;
    if m.gemm.is_empty() && m.copy.is_empty() && m.collectives.is_empty() {
        return Err(CostError::Calibrate(
            "no measurements (gemm, copy and collectives are all empty)".into(),
        ));
    }
    let mut d = base.clone();
    let mut capped = Vec::new();
    let src = |what: String| format!("measured by `shardc calibrate` on {}: {what}", m.device);
    // An efficiency factor from the median `x` of its samples, against the base's `peak`.
    let mut efficiency = |what: String, x: f64, peak: &str| -> Result<Sourced<f64>, CostError> {
        let (lo, hi) = EFFICIENCY;
        if (lo..=hi).contains(&x) {
            return Ok(Sourced::new(x, src(what)));
        }
        if x > hi && x <= MAX_OVERSHOOT {
            capped.push(format!(
                "{what}: {} of the base profile's {peak}, written as 1",
                num(x)
            ));
            return Ok(Sourced::new(
                hi,
                src(format!("{what}; measured {}, capped at 1", num(x))),
            ));
        }
        Err(bad(format!(
            "{what}: {} of the base profile's {peak} is outside [{}, {MAX_OVERSHOOT}] \
             (check the samples' `seconds`, or --base)",
            num(x),
            num(lo)
        )))
    };
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
            *slot = efficiency(format!("median of {n} {class:?} GEMMs"), e, "peak FLOP/s")?;
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
        d.efficiency.memory = efficiency(
            format!("median of {n} copies >= 64 MiB"),
            e,
            "HBM bandwidth",
        )?;
    }
    if let Some(t) = m
        .copy
        .iter()
        .filter(|c| c.bytes <= SMALL)
        .map(|c| c.seconds)
        .min_by(f64::total_cmp)
    {
        let t = fitted(
            "launch floor (fastest copy <= 64 KiB)",
            t,
            LATENCY,
            "check the copies' `seconds`",
        )?;
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
        d.efficiency.nvlink = efficiency(
            format!("median busbw of {n} intra-node collectives >= 64 MiB"),
            bw / base.nvlink_per_direction(),
            "NVLink bandwidth per direction",
        )?;
    }
    d.check()?;
    let c = match cluster {
        None => None,
        Some(c) => {
            let mut c = c.clone();
            let hint = "check the collectives' `seconds`";
            let latencies = [
                (false, "NVLink", "intra-node", &mut c.nvlink_latency),
                (true, "network", "inter-node", &mut c.network_latency),
            ];
            for (inter, name, place, field) in latencies {
                if let Some(a) = alpha(inter) {
                    let what = format!(
                        "{name} latency (median per step of {place} collectives <= 64 KiB)"
                    );
                    let a = fitted(&what, a, LATENCY, hint)?;
                    *field = Sourced::new(a, src(format!("median per-step latency, {place}")));
                }
            }
            let share =
                c.nic_bandwidth.value * c.nics_per_node.value as f64 / c.gpus_per_node.value as f64;
            let net = busbw(true, &|b| b >= BIG);
            let n = net.len();
            if let Some(bw) = median(net) {
                c.network_efficiency = efficiency(
                    format!("median busbw of {n} inter-node collectives >= 64 MiB"),
                    bw / share,
                    "network bandwidth per GPU",
                )?;
            }
            c.check()?;
            Some(c)
        }
    };
    Ok(ProfileFit {
        device: d,
        cluster: c,
        capped,
    })
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

    #[test]
    fn fits_above_the_peak_are_capped_loudly_or_refused() {
        let c = Cluster::resolve("dgx-h100x2").unwrap();
        let n = 4096usize;
        let gemm = |speedup: f64| Measurements {
            device: "x".into(),
            gemm: vec![GemmSample {
                m: n,
                n,
                k: n,
                dtype: DType::Bf16,
                seconds: 2.0 * (n as f64).powi(3) / (speedup * c.device.peak(DType::Bf16)),
            }],
            ..Measurements::default()
        };
        // 5% over the datasheet peak (boost clocks): written as 1, and said so.
        let f = fit_profile_report(&c.device, None, &gemm(1.05)).unwrap();
        assert_eq!(f.device.efficiency.gemm_large.value, 1.0);
        assert!(f
            .device
            .efficiency
            .gemm_large
            .source
            .contains("measured 1.05"));
        assert!(f
            .device
            .efficiency
            .gemm_large
            .source
            .contains("capped at 1"));
        assert_eq!(f.capped.len(), 1);
        assert!(
            f.capped[0].contains("Large GEMMs: 1.05 of the base profile's peak FLOP/s"),
            "{:?}",
            f.capped
        );
        // Three times the peak: a wrong time or a wrong base, refused.
        let e = fit_profile(&c.device, None, &gemm(3.0))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("median of 1 Large GEMMs: 3 of the base profile's peak FLOP/s is outside [0.0001, 2]"),
            "{e}"
        );
    }

    #[test]
    fn bad_samples_name_their_field() {
        let text = r#"{"device": "x",
            "gemm": [{"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16", "seconds": 2.3e-4}],
            "copy": [{"bytes": 4096, "seconds": 4e-6}],
            "collectives": [{"kind": "all_reduce", "ranks": 8, "bytes": 4096, "seconds": 1e-5, "network": false}]}"#;
        assert!(Measurements::from_json(text).is_ok());
        for (from, to, field) in [
            ("2.3e-4", "0", "gemm[0].seconds"),
            ("\"k\": 4096", "\"k\": 0", "gemm[0].k"),
            ("4e-6", "1e300", "copy[0].seconds"),
            (
                "\"bytes\": 4096, \"seconds\": 4e-6",
                "\"bytes\": 0, \"seconds\": 4e-6",
                "copy[0].bytes",
            ),
            ("\"ranks\": 8", "\"ranks\": 1", "collectives[0].ranks"),
            ("2.3e-4", "\"fast\"", "malformed JSON"),
        ] {
            let e = Measurements::from_json(&text.replace(from, to))
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
    }
}
