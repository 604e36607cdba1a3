//! `shardc calibrate`: write a device (and cluster) profile fitted to measured GEMM, copy and
//! collective micro-benchmarks. The measurements come from the GPU backend on a GPU machine,
//! or from a JSON file (`--measurements`) of timings taken elsewhere (a cuBLAS sweep,
//! nccl-tests); the format is `shardc::compiler::cost::Measurements`.

use anyhow::{bail, Context};
use clap::Args;
use shardc::compiler::cost::{fit_profile, Cluster, DeviceProfile, Measurements};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// Device profile to start from (its peaks and bandwidths are kept; efficiencies refit).
    #[arg(long, default_value = "h100-sxm")]
    pub base: String,
    /// Also refit this cluster profile's latencies and network efficiency.
    #[arg(long)]
    pub cluster: Option<String>,
    /// Fit measurements from this JSON file instead of measuring on this machine.
    #[arg(long)]
    pub measurements: Option<PathBuf>,
    /// Where to write the device profile (a cluster profile goes next to it, `*-cluster.toml`).
    #[arg(short = 'o', long, default_value = "calibrated.toml")]
    pub output: PathBuf,
}

pub fn run(a: CalibrateArgs) -> anyhow::Result<()> {
    let m: Measurements = match &a.measurements {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?
        }
        None => match shardc::kernels::cuda_available() {
            Err(e) => bail!(
                "calibration needs the CUDA backend and a GPU to run its GEMM, copy and collective micro-benchmarks ({e}); on a machine without one, fit timings measured elsewhere with --measurements FILE"
            ),
            Ok(n) => bail!(
                "found {n} CUDA device(s), but this build's runtime has no CUDA backend to run the GEMM, copy and collective micro-benchmarks yet; fit timings measured with a cuBLAS sweep and nccl-tests with --measurements FILE"
            ),
        },
    };
    let base = DeviceProfile::load(&a.base)?;
    let cluster = match &a.cluster {
        Some(c) => Some(Cluster::resolve(c)?),
        None => None,
    };
    let (mut dev, cprof) = fit_profile(&base, cluster.as_ref().map(|c| &c.profile), &m)?;
    let stem = a
        .output
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "calibrated".into());
    dev.name = stem.clone();
    dev.description = format!("{} (calibrated on {})", base.description, m.device);
    std::fs::write(&a.output, dev.to_toml())
        .with_context(|| format!("writing {}", a.output.display()))?;
    println!(
        "wrote {}: gemm large/medium/small/tiny {:.2}/{:.2}/{:.2}/{:.2}, memory {:.2}, nvlink {:.2}, launch floor {:.1} µs",
        a.output.display(),
        dev.efficiency.gemm_large.value,
        dev.efficiency.gemm_medium.value,
        dev.efficiency.gemm_small.value,
        dev.efficiency.gemm_tiny.value,
        dev.efficiency.memory.value,
        dev.efficiency.nvlink.value,
        dev.launch_floor.value * 1e6
    );
    if let Some(mut c) = cprof {
        let file = a.output.with_file_name(format!("{stem}-cluster.toml"));
        c.name = format!("{stem}-cluster");
        c.device = a
            .output
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        std::fs::write(&file, c.to_toml())
            .with_context(|| format!("writing {}", file.display()))?;
        println!(
            "wrote {}: network efficiency {:.2}, latency {:.1} µs (network) / {:.1} µs (NVLink)",
            file.display(),
            c.network_efficiency.value,
            c.network_latency.value * 1e6,
            c.nvlink_latency.value * 1e6
        );
    }
    Ok(())
}
