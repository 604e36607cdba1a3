//! Device and cluster profiles: data files (`profiles/*.toml`, embedded), every number with its
//! source. A cluster profile names its device; `--cluster dgx-h100x128` is the `dgx-h100`
//! profile with 128 nodes, and a path to a `.toml` file works wherever a name does.
//!
//! Pre: none. Post: a loaded profile has every number inside its plausibility range
//! (efficiencies in `[1e-4, 1]`, bandwidths, peaks, capacities and latencies within bounds wide
//! enough for any machine and narrow enough that every time the cost model derives stays
//! finite), and a non-empty source for each number (checked by [`DeviceProfile::check`] and
//! [`ClusterProfile::check`]); a resolved [`Cluster`] has at most [`MAX_GPUS`] GPUs. Errors
//! name the profile (its file when loaded from one) and the field.

use super::units::Bytes;
use super::CostError;
use crate::ir::DType;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A number and where it comes from (a datasheet, a paper, a measurement, or "assumed").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sourced<T> {
    /// The value.
    pub value: T,
    /// Its source.
    pub source: String,
}

impl<T> Sourced<T> {
    /// A value with its source.
    pub fn new(value: T, source: impl Into<String>) -> Sourced<T> {
        Sourced {
            value,
            source: source.into(),
        }
    }
}

/// Dense peak FLOP/s by precision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeakFlops {
    /// bfloat16 tensor core, dense.
    pub bf16: Sourced<f64>,
    /// fp16 tensor core, dense.
    pub fp16: Sourced<f64>,
    /// tf32 tensor core, dense.
    pub tf32: Sourced<f64>,
    /// fp32 (CUDA cores).
    pub fp32: Sourced<f64>,
}

/// Fractions of peak that kernel classes reach: the roofline's efficiency factors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Efficiency {
    /// GEMMs whose smallest dim is ≥ 1024.
    pub gemm_large: Sourced<f64>,
    /// GEMMs whose smallest dim is 256..1023.
    pub gemm_medium: Sourced<f64>,
    /// GEMMs whose smallest dim is 64..255.
    pub gemm_small: Sourced<f64>,
    /// GEMMs whose smallest dim is below 64.
    pub gemm_tiny: Sourced<f64>,
    /// Memory-bound kernels: fraction of HBM bandwidth.
    pub memory: Sourced<f64>,
    /// Collectives inside the NVLink domain: busbw as a fraction of per-direction NVLink bandwidth.
    pub nvlink: Sourced<f64>,
}

/// One GPU model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    /// Always `"device"`.
    pub kind: String,
    /// Short name (`h100-sxm`).
    pub name: String,
    /// What it is.
    pub description: String,
    /// Device memory capacity, bytes.
    pub memory_bytes: Sourced<f64>,
    /// HBM bandwidth, bytes/s.
    pub hbm_bandwidth: Sourced<f64>,
    /// NVLink bandwidth per GPU, bytes/s, both directions together (as datasheets quote it).
    pub nvlink_bandwidth: Sourced<f64>,
    /// Minimum time of a kernel (launch + ramp), seconds.
    pub launch_floor: Sourced<f64>,
    /// Dense peak FLOP/s.
    pub peak_flops: PeakFlops,
    /// Efficiency factors.
    pub efficiency: Efficiency,
}

/// A kind of node and its network.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterProfile {
    /// Always `"cluster"`.
    pub kind: String,
    /// Short name (`dgx-h100`).
    pub name: String,
    /// The device profile: a built-in name or a path (relative to this file).
    pub device: String,
    /// What it is.
    pub description: String,
    /// GPUs in one node.
    pub gpus_per_node: Sourced<u32>,
    /// GPUs in one NVLink / NVSwitch domain (≤ a node for DGX systems).
    pub nvlink_domain: Sourced<u32>,
    /// Network adapters per node used for collectives.
    pub nics_per_node: Sourced<u32>,
    /// Bandwidth of one adapter, bytes/s per direction.
    pub nic_bandwidth: Sourced<f64>,
    /// Per-step latency across the network (alpha), seconds.
    pub network_latency: Sourced<f64>,
    /// Per-step latency inside the NVLink domain (alpha), seconds.
    pub nvlink_latency: Sourced<f64>,
    /// Fraction of the adapters' bandwidth collectives reach.
    pub network_efficiency: Sourced<f64>,
}

/// A concrete machine: a cluster profile, its device and a node count.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// The node and network description.
    pub profile: ClusterProfile,
    /// The GPU.
    pub device: DeviceProfile,
    /// Number of nodes.
    pub nodes: usize,
}

/// Bandwidths (HBM, NVLink, network adapter), bytes/s.
const BANDWIDTH: (f64, f64) = (1e3, 1e16);
/// Peak FLOP/s.
const FLOPS: (f64, f64) = (1e6, 1e21);
/// Device memory, bytes.
const MEMORY: (f64, f64) = (1e3, 1e18);
/// Latencies and the kernel launch floor, seconds.
pub(super) const LATENCY: (f64, f64) = (1e-12, 1e3);
/// Efficiency factors: fractions of a peak.
pub(super) const EFFICIENCY: (f64, f64) = (1e-4, 1.0);
/// GPUs, NVLink domain size and network adapters per node.
const MAX_PER_NODE: u32 = 1 << 16;
/// GPUs in a resolved cluster (nodes × GPUs per node).
pub const MAX_GPUS: usize = 1 << 24;

/// Built-in profiles: (file name, text).
pub const BUILTIN_PROFILES: [(&str, &str); 6] = [
    ("a100-80gb-sxm", include_str!("profiles/a100-80gb-sxm.toml")),
    ("h100-sxm", include_str!("profiles/h100-sxm.toml")),
    ("h200-sxm", include_str!("profiles/h200-sxm.toml")),
    ("dgx-a100", include_str!("profiles/dgx-a100.toml")),
    ("dgx-h100", include_str!("profiles/dgx-h100.toml")),
    ("dgx-h200", include_str!("profiles/dgx-h200.toml")),
];

fn builtin(name: &str) -> Option<&'static str> {
    BUILTIN_PROFILES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
}

fn builtin_names(kind: &str) -> String {
    BUILTIN_PROFILES
        .iter()
        .filter(|(_, t)| t.contains(&format!("kind = \"{kind}\"")))
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The text of a profile: a built-in name or a path. Returns the text and the directory that
/// relative paths inside it resolve against.
fn profile_text(spec: &str, base: Option<&Path>) -> Result<(String, Option<PathBuf>), CostError> {
    if let Some(t) = builtin(spec) {
        return Ok((t.to_string(), None));
    }
    let path = match base {
        Some(b) if Path::new(spec).is_relative() => b.join(spec),
        _ => PathBuf::from(spec),
    };
    if path.exists() || spec.ends_with(".toml") || spec.contains('/') {
        let text = std::fs::read_to_string(&path).map_err(|e| CostError::Profile {
            profile: path.display().to_string(),
            msg: e.to_string(),
        })?;
        return Ok((text, path.parent().map(Path::to_path_buf)));
    }
    Err(CostError::UnknownProfile {
        name: spec.to_string(),
        valid: format!(
            "clusters: {}; devices: {}; or a path to a .toml profile",
            builtin_names("cluster"),
            builtin_names("device")
        ),
    })
}

fn parse<T: serde::de::DeserializeOwned>(name: &str, text: &str) -> Result<T, CostError> {
    toml::from_str(text).map_err(|e| CostError::Profile {
        profile: name.to_string(),
        msg: toml_error(text, &e),
    })
}

/// A TOML error in one line: `line 23, column 20 (`efficiency.memory`): invalid type: ...`.
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let msg = e.message().trim().replace('\n', " ");
    let Some(before) = e.span().and_then(|s| text.get(..s.start)) else {
        return msg;
    };
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    // The key on that line, inside the table the line belongs to.
    let lines: Vec<&str> = text.lines().collect();
    fn table_of(l: &str) -> Option<&str> {
        let l = l.trim();
        (l.starts_with('[') && l.ends_with(']')).then(|| l.trim_matches(['[', ']']).trim())
    }
    let here = lines.get(line - 1).copied().unwrap_or("");
    let key = match table_of(here) {
        Some(t) => Some(t.to_string()),
        None => here
            .split_once('=')
            .map(|(k, _)| k.trim())
            .filter(|k| !k.is_empty())
            .map(|k| {
                match lines[..line.saturating_sub(1).min(lines.len())]
                    .iter()
                    .rev()
                    .find_map(|l| table_of(l))
                {
                    Some(t) => format!("{t}.{k}"),
                    None => k.to_string(),
                }
            }),
    };
    match key {
        Some(k) => format!("line {line}, column {column} (`{k}`): {msg}"),
        None => format!("line {line}, column {column}: {msg}"),
    }
}

fn kind_of(name: &str, text: &str) -> Result<String, CostError> {
    let v: toml::Value = parse(name, text)?;
    Ok(v.get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string())
}

/// A number for a message, to 4 significant digits: plain when readable, scientific when tiny
/// or huge (`0.85`, `1000`, `1e16`, `1e-320`).
pub(super) fn num(x: f64) -> String {
    fn trim(s: &str) -> &str {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.')
        } else {
            s
        }
    }
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let a = x.abs();
    if (1e-4..1e7).contains(&a) {
        let digits = (3 - a.log10().floor() as i32).max(0) as usize;
        trim(&format!("{x:.digits$}")).to_string()
    } else {
        let s = format!("{x:.3e}");
        match s.split_once('e') {
            Some((m, e)) => format!("{}e{e}", trim(m)),
            None => s,
        }
    }
}

struct Checker<'a> {
    profile: &'a str,
}

impl Checker<'_> {
    fn err(&self, field: &str, msg: String) -> CostError {
        CostError::Profile {
            profile: self.profile.to_string(),
            msg: format!("`{field}`: {msg}"),
        }
    }
    fn source<T>(&self, field: &str, s: &Sourced<T>) -> Result<(), CostError> {
        if s.source.trim().is_empty() {
            return Err(self.err(field, "every number needs a non-empty `source`".into()));
        }
        Ok(())
    }
    /// A number in `[lo, hi]` (NaN and infinities are outside every range).
    fn within(
        &self,
        field: &str,
        s: &Sourced<f64>,
        (lo, hi): (f64, f64),
        unit: &str,
    ) -> Result<(), CostError> {
        self.source(field, s)?;
        if !(lo..=hi).contains(&s.value) {
            return Err(self.err(
                field,
                format!(
                    "must be in [{}, {}]{unit}, found {}",
                    num(lo),
                    num(hi),
                    num(s.value)
                ),
            ));
        }
        Ok(())
    }
    fn count(&self, field: &str, s: &Sourced<u32>) -> Result<(), CostError> {
        self.source(field, s)?;
        if s.value == 0 || s.value > MAX_PER_NODE {
            return Err(self.err(
                field,
                format!("must be in [1, {MAX_PER_NODE}], found {}", s.value),
            ));
        }
        Ok(())
    }
}

impl DeviceProfile {
    /// A built-in device profile by name, or a device profile file.
    pub fn load(spec: &str) -> Result<DeviceProfile, CostError> {
        let (text, _) = profile_text(spec, None)?;
        DeviceProfile::from_toml(spec, &text)
    }

    /// Parses and checks a device profile.
    pub fn from_toml(name: &str, text: &str) -> Result<DeviceProfile, CostError> {
        let kind = kind_of(name, text)?;
        if kind != "device" {
            return Err(CostError::Profile {
                profile: name.to_string(),
                msg: format!("expected `kind = \"device\"`, found {kind:?}"),
            });
        }
        let d: DeviceProfile = parse(name, text)?;
        d.check_as(name)?;
        Ok(d)
    }

    /// Checks ranges and sources.
    pub fn check(&self) -> Result<(), CostError> {
        self.check_as(&self.name)
    }

    /// [`DeviceProfile::check`], errors naming the profile `label` (its file, say).
    fn check_as(&self, label: &str) -> Result<(), CostError> {
        let c = Checker { profile: label };
        c.within("memory_bytes", &self.memory_bytes, MEMORY, " bytes")?;
        c.within("hbm_bandwidth", &self.hbm_bandwidth, BANDWIDTH, " bytes/s")?;
        c.within(
            "nvlink_bandwidth",
            &self.nvlink_bandwidth,
            BANDWIDTH,
            " bytes/s",
        )?;
        c.within("launch_floor", &self.launch_floor, LATENCY, " s")?;
        let p = &self.peak_flops;
        c.within("peak_flops.bf16", &p.bf16, FLOPS, " FLOP/s")?;
        c.within("peak_flops.fp16", &p.fp16, FLOPS, " FLOP/s")?;
        c.within("peak_flops.tf32", &p.tf32, FLOPS, " FLOP/s")?;
        c.within("peak_flops.fp32", &p.fp32, FLOPS, " FLOP/s")?;
        let e = &self.efficiency;
        c.within("efficiency.gemm_large", &e.gemm_large, EFFICIENCY, "")?;
        c.within("efficiency.gemm_medium", &e.gemm_medium, EFFICIENCY, "")?;
        c.within("efficiency.gemm_small", &e.gemm_small, EFFICIENCY, "")?;
        c.within("efficiency.gemm_tiny", &e.gemm_tiny, EFFICIENCY, "")?;
        c.within("efficiency.memory", &e.memory, EFFICIENCY, "")?;
        c.within("efficiency.nvlink", &e.nvlink, EFFICIENCY, "")?;
        Ok(())
    }

    /// Dense tensor-core peak for a compute dtype (fp32 means tf32 tensor cores, as PyTorch
    /// and cuBLAS use for f32 GEMMs by default on Ampere and later).
    pub fn peak(&self, dtype: DType) -> f64 {
        match dtype {
            DType::Bf16 => self.peak_flops.bf16.value,
            DType::F16 => self.peak_flops.fp16.value,
            DType::F32 | DType::I32 => self.peak_flops.tf32.value,
        }
    }

    /// Device memory.
    pub fn memory(&self) -> Bytes {
        Bytes(self.memory_bytes.value as u64)
    }

    /// NVLink bandwidth per direction, bytes/s.
    pub fn nvlink_per_direction(&self) -> f64 {
        self.nvlink_bandwidth.value / 2.0
    }

    /// The profile as TOML (what `shardc calibrate` writes).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("invariant: a device profile serialises")
    }
}

impl ClusterProfile {
    /// The profile as TOML (what `shardc calibrate` writes).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("invariant: a cluster profile serialises")
    }

    /// Checks ranges and sources.
    pub fn check(&self) -> Result<(), CostError> {
        self.check_as(&self.name)
    }

    /// [`ClusterProfile::check`], errors naming the profile `label` (its file, say).
    fn check_as(&self, label: &str) -> Result<(), CostError> {
        let c = Checker { profile: label };
        c.count("gpus_per_node", &self.gpus_per_node)?;
        c.count("nvlink_domain", &self.nvlink_domain)?;
        c.count("nics_per_node", &self.nics_per_node)?;
        c.within("nic_bandwidth", &self.nic_bandwidth, BANDWIDTH, " bytes/s")?;
        c.within("network_latency", &self.network_latency, LATENCY, " s")?;
        c.within("nvlink_latency", &self.nvlink_latency, LATENCY, " s")?;
        c.within(
            "network_efficiency",
            &self.network_efficiency,
            EFFICIENCY,
            "",
        )?;
        if self.nvlink_domain.value > self.gpus_per_node.value {
            return Err(c.err(
                "nvlink_domain",
                format!(
                    "{} GPUs exceeds gpus_per_node = {} (multi-node NVLink domains are not modelled)",
                    self.nvlink_domain.value, self.gpus_per_node.value
                ),
            ));
        }
        Ok(())
    }
}

impl Cluster {
    /// Resolves `<profile>[xNODES]`: a built-in cluster name or a `.toml` path, optionally
    /// followed by `x` and a node count (`dgx-h100x128`). Without a count, `nodes` is 1.
    pub fn resolve(spec: &str) -> Result<Cluster, CostError> {
        let (name, nodes) = split_nodes(spec)?;
        let (text, dir) = profile_text(name, None)?;
        let kind = kind_of(name, &text)?;
        if kind == "device" {
            return Err(CostError::UnknownProfile {
                name: name.to_string(),
                valid: format!(
                    "`{name}` is a device profile; --cluster takes a cluster profile ({}) that names its device",
                    builtin_names("cluster")
                ),
            });
        }
        if kind != "cluster" {
            return Err(CostError::Profile {
                profile: name.to_string(),
                msg: format!("expected `kind = \"cluster\"`, found {kind:?}"),
            });
        }
        let profile: ClusterProfile = parse(name, &text)?;
        profile.check_as(name)?;
        let nodes = nodes.unwrap_or(1);
        let gpus = nodes.checked_mul(profile.gpus_per_node.value as usize);
        if gpus.is_none_or(|g| g > MAX_GPUS) {
            return Err(CostError::Profile {
                profile: spec.to_string(),
                msg: format!(
                    "{nodes} nodes × {} GPUs exceeds the {MAX_GPUS} GPUs a cluster may have",
                    profile.gpus_per_node.value
                ),
            });
        }
        if profile.device.trim().is_empty() {
            return Err(CostError::Profile {
                profile: name.to_string(),
                msg: format!(
                    "`device` is empty: name a device profile ({}) or a .toml file",
                    builtin_names("device")
                ),
            });
        }
        let (dtext, _) = profile_text(&profile.device, dir.as_deref())?;
        // Errors in a device file name the file as the user would find it.
        let dname = match dir.as_deref() {
            Some(d)
                if builtin(&profile.device).is_none()
                    && Path::new(&profile.device).is_relative() =>
            {
                d.join(&profile.device).display().to_string()
            }
            _ => profile.device.clone(),
        };
        let device = DeviceProfile::from_toml(&dname, &dtext)?;
        Ok(Cluster {
            profile,
            device,
            nodes,
        })
    }

    /// As [`Cluster::resolve`], but without an explicit node count the cluster gets just
    /// enough nodes for `gpus` ranks.
    pub fn resolve_for(spec: &str, gpus: usize) -> Result<Cluster, CostError> {
        let explicit = split_nodes(spec)?.1.is_some();
        let c = Cluster::resolve(spec)?;
        if explicit {
            Ok(c)
        } else {
            let n = gpus.div_ceil(c.gpus_per_node()).max(1);
            Ok(c.with_nodes(n))
        }
    }

    /// The same cluster with `n` nodes.
    pub fn with_nodes(mut self, n: usize) -> Cluster {
        self.nodes = n.max(1);
        self
    }

    /// GPUs in one node.
    pub fn gpus_per_node(&self) -> usize {
        self.profile.gpus_per_node.value as usize
    }

    /// Total GPUs.
    pub fn gpus(&self) -> usize {
        self.nodes * self.gpus_per_node()
    }

    /// Network bandwidth one GPU gets when every GPU of its node communicates at once
    /// (the node's adapters shared evenly), bytes/s per direction, after efficiency.
    pub fn net_bw_per_gpu(&self) -> f64 {
        let p = &self.profile;
        p.nic_bandwidth.value * p.nics_per_node.value as f64 / p.gpus_per_node.value as f64
            * p.network_efficiency.value
    }

    /// NVLink busbw one GPU reaches in a collective, bytes/s per direction, after efficiency.
    pub fn nvlink_bw(&self) -> f64 {
        self.device.nvlink_per_direction() * self.device.efficiency.nvlink.value
    }

    /// The peak rates the rewriter's extractor costs nodes with: the device's dense peaks
    /// (bf16, fp32), HBM bandwidth and launch floor, NVLink per direction and each GPU's share
    /// of its node's network adapters, with the profile's per-step latencies (the raw rates:
    /// the extractor compares programs, the simulator applies the efficiencies). PCIe, which
    /// profiles do not describe, stays a Gen5 x16 link.
    pub fn rewrite_device(&self) -> crate::rewrite::cost::DeviceProfile {
        use crate::rewrite::cost::{DeviceProfile as Rates, LinkProfile};
        let (d, p) = (&self.device, &self.profile);
        let per_us = |x: f64| x / 1e6;
        Rates {
            name: d.name.clone(),
            flops_per_us_16: per_us(d.peak_flops.bf16.value),
            flops_per_us_32: per_us(d.peak_flops.fp32.value),
            hbm_bytes_per_us: per_us(d.hbm_bandwidth.value),
            launch_us: d.launch_floor.value * 1e6,
            nvlink: LinkProfile {
                bytes_per_us: per_us(d.nvlink_per_direction()),
                latency_us: p.nvlink_latency.value * 1e6,
            },
            ib: LinkProfile {
                bytes_per_us: per_us(
                    p.nic_bandwidth.value * p.nics_per_node.value as f64
                        / p.gpus_per_node.value as f64,
                ),
                latency_us: p.network_latency.value * 1e6,
            },
            pcie: Rates::h100_sxm().pcie,
        }
    }

    /// `"dgx-h100x128"`.
    pub fn label(&self) -> String {
        format!("{}x{}", self.profile.name, self.nodes)
    }
}

/// `dgx-h100x128` → (`dgx-h100`, Some(128)); `dgx-h100` → (`dgx-h100`, None).
fn split_nodes(spec: &str) -> Result<(&str, Option<usize>), CostError> {
    if let Some((name, n)) = spec.rsplit_once('x') {
        if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) && !name.is_empty() {
            let nodes: usize = n.parse().map_err(|_| CostError::Profile {
                profile: spec.to_string(),
                msg: format!("node count `{n}` is not a number"),
            })?;
            if nodes == 0 {
                return Err(CostError::Profile {
                    profile: spec.to_string(),
                    msg: "node count must be positive".into(),
                });
            }
            return Ok((name, Some(nodes)));
        }
    }
    Ok((spec, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_load_and_carry_sources() {
        for (name, text) in BUILTIN_PROFILES {
            if text.contains("kind = \"device\"") {
                let d = DeviceProfile::load(name).unwrap();
                assert_eq!(d.name, name);
                assert!(d.peak_flops.bf16.source.contains("datasheet"));
            } else {
                let c = Cluster::resolve(&format!("{name}x4")).unwrap();
                assert_eq!(c.nodes, 4);
                assert_eq!(c.gpus(), 32);
            }
        }
        let a100 = DeviceProfile::load("a100-80gb-sxm").unwrap();
        assert_eq!(a100.peak(DType::Bf16), 312e12);
        assert_eq!(a100.hbm_bandwidth.value, 2039e9);
        let h100 = DeviceProfile::load("h100-sxm").unwrap();
        assert_eq!(h100.peak(DType::Bf16), 989.4e12);
        assert_eq!(h100.hbm_bandwidth.value, 3.35e12);
        assert_eq!(h100.nvlink_bandwidth.value, 900e9);
        // The rewriter's default rates are the DGX H100 profile's.
        let rw = Cluster::resolve("dgx-h100").unwrap().rewrite_device();
        let h = crate::rewrite::cost::DeviceProfile::h100_sxm();
        let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-12;
        assert_eq!(rw.name, h.name);
        for (a, b) in [
            (rw.flops_per_us_16, h.flops_per_us_16),
            (rw.flops_per_us_32, h.flops_per_us_32),
            (rw.hbm_bytes_per_us, h.hbm_bytes_per_us),
            (rw.launch_us, h.launch_us),
            (rw.nvlink.bytes_per_us, h.nvlink.bytes_per_us),
            (rw.nvlink.latency_us, h.nvlink.latency_us),
            (rw.ib.bytes_per_us, h.ib.bytes_per_us),
            (rw.ib.latency_us, h.ib.latency_us),
        ] {
            assert!(close(a, b), "{a} vs {b}");
        }
        let a100 = Cluster::resolve("dgx-a100").unwrap().rewrite_device();
        assert!(close(a100.flops_per_us_16, 312e6));
        let h200 = DeviceProfile::load("h200-sxm").unwrap();
        assert_eq!(h200.hbm_bandwidth.value, 4.8e12);
        assert_eq!(h200.memory(), Bytes(141_000_000_000));
    }

    #[test]
    fn node_suffix_and_errors() {
        assert_eq!(
            split_nodes("dgx-h100x128").unwrap(),
            ("dgx-h100", Some(128))
        );
        assert_eq!(split_nodes("dgx-h100").unwrap(), ("dgx-h100", None));
        assert!(split_nodes("dgx-h100x0").is_err());
        let e = Cluster::resolve("nope").unwrap_err().to_string();
        assert!(e.contains("dgx-h100"), "{e}");
        let e = Cluster::resolve("h100-sxm").unwrap_err().to_string();
        assert!(e.contains("device profile"), "{e}");
    }

    #[test]
    fn missing_source_is_rejected() {
        let text = BUILTIN_PROFILES[1].1.replace(
            "source = \"NVIDIA H100 datasheet: 3.35 TB/s GPU memory bandwidth (H100 SXM)\"",
            "source = \"\"",
        );
        let e = DeviceProfile::from_toml("x", &text)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hbm_bandwidth") && e.contains("source"), "{e}");
        let text = BUILTIN_PROFILES[1].1.replace("value = 0.85", "value = 1.5");
        let e = DeviceProfile::from_toml("x", &text)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`efficiency.memory`: must be in [0.0001, 1], found 1.5"),
            "{e}"
        );
    }

    #[test]
    fn user_profile_by_path_round_trips() {
        let dir = std::env::temp_dir().join(format!("shardc-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut d = DeviceProfile::load("h100-sxm").unwrap();
        d.name = "my-gpu".into();
        d.hbm_bandwidth.value = 1e12;
        std::fs::write(dir.join("my-gpu.toml"), d.to_toml()).unwrap();
        let cluster = BUILTIN_PROFILES[4]
            .1
            .replace("device = \"h100-sxm\"", "device = \"my-gpu.toml\"");
        std::fs::write(dir.join("c.toml"), cluster).unwrap();
        let c = Cluster::resolve(&format!("{}x2", dir.join("c.toml").display())).unwrap();
        assert_eq!(c.device, d);
        assert_eq!(c.nodes, 2);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn implausible_numbers_name_the_file_and_field() {
        let dir = std::env::temp_dir().join(format!("shardc-profile-range-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Positive and finite, yet every HBM transfer would take forever.
        let dev = dir.join("dev.toml");
        let text = BUILTIN_PROFILES[1]
            .1
            .replace("value = 3.35e12", "value = 1e-320");
        std::fs::write(&dev, text).unwrap();
        let e = DeviceProfile::load(&dev.display().to_string())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dev.toml") && e.contains("`hbm_bandwidth`") && e.contains("1e-320"),
            "{e}"
        );
        // A latency that makes every collective infinite.
        let c = dir.join("c.toml");
        let text = BUILTIN_PROFILES[4]
            .1
            .replace("value = 5e-6", "value = 1e308");
        std::fs::write(&c, text).unwrap();
        let e = Cluster::resolve(&c.display().to_string())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("c.toml") && e.contains("`network_latency`"),
            "{e}"
        );
        // The device of a cluster is named.
        let text = BUILTIN_PROFILES[4]
            .1
            .replace("device = \"h100-sxm\"", "device = \"\"");
        std::fs::write(&c, text).unwrap();
        let e = Cluster::resolve(&c.display().to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`device` is empty"), "{e}");
        // Nodes × GPUs per node stays countable.
        let e = Cluster::resolve("dgx-h100x1000000000000")
            .unwrap_err()
            .to_string();
        assert!(e.contains("1000000000000 nodes"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn numbers_in_messages() {
        for (x, s) in [
            (0.85, "0.85"),
            (1000.0, "1000"),
            (1e16, "1e16"),
            (1e-320, "1e-320"),
            (1.1000000000000003, "1.1"),
            (-0.0015, "-0.0015"),
            (7.234969503402736e-7, "7.235e-7"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(num(x), s);
        }
    }

    #[test]
    fn toml_errors_name_the_line_and_key() {
        let text = BUILTIN_PROFILES[1]
            .1
            .replace("value = 0.85", "value = \"x\"");
        let e = DeviceProfile::from_toml("x.toml", &text)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("profile `x.toml`: line ")
                && e.contains("(`efficiency.memory`): invalid type")
                && !e.contains('\n'),
            "{e}"
        );
    }
}
