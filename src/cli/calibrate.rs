//! `shardc calibrate`: write a device (and cluster) profile fitted to measured GEMM, copy and
//! collective micro-benchmarks. The measurements come from the GPU backend on a GPU machine,
//! or from a JSON file (`--measurements`) of timings taken elsewhere (a cuBLAS sweep,
//! nccl-tests); the format is `shardc::compiler::cost::Measurements`.

use anyhow::{bail, Context};
use clap::Args;
use shardc::compiler::cost::{fit_profile_report, Cluster, DeviceProfile, Measurements};
use shardc::runtime::cuda::calibrate::{measure, CalibrateOptions};
use shardc::runtime::cuda::CudaDevice;
use shardc::runtime::output::Outputs;
use std::path::{Path, PathBuf};

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
    /// Allow an output to replace a file this command reads (still atomically).
    #[arg(long)]
    pub overwrite: bool,
}

pub fn run(a: CalibrateArgs) -> anyhow::Result<()> {
    let outputs = Outputs::new(a.overwrite).inputs([
        a.measurements.as_deref(),
        Some(Path::new(&a.base)),
        a.cluster.as_deref().map(Path::new),
    ]);
    outputs.check_file("-o", &a.output)?;
    let m: Measurements = match &a.measurements {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Measurements::from_json(&text).with_context(|| p.display().to_string())?
        }
        None => {
            let m = measure_on_gpu()?;
            print_table(&m);
            let raw = measurements_path(&a.output);
            outputs.write("-o", &raw, serde_json::to_string_pretty(&m)?.as_bytes())?;
            println!("wrote {} (raw measurements)", raw.display());
            m
        }
    };
    let base = DeviceProfile::load(&a.base)?;
    let cluster = match &a.cluster {
        Some(c) => Some(Cluster::resolve(c)?),
        None => None,
    };
    let fit =
        fit_profile_report(&base, cluster.as_ref().map(|c| &c.profile), &m).with_context(|| {
            match &a.measurements {
                Some(p) => format!("fitting {} to {}", p.display(), base.name),
                None => format!("fitting the measurements to {}", base.name),
            }
        })?;
    for note in &fit.capped {
        eprintln!("warning: calibration: {note} (--base {})", base.name);
    }
    let (mut dev, cprof) = (fit.device, fit.cluster);
    let stem = a
        .output
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "calibrated".into());
    dev.name = stem.clone();
    dev.description = format!("{} (calibrated on {})", base.description, m.device);
    outputs.write("-o", &a.output, dev.to_toml().as_bytes())?;
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
        outputs.write("-o", &file, c.to_toml().as_bytes())?;
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

/// `<output>.measurements.json`: where the raw measurements of a GPU run are saved.
fn measurements_path(output: &Path) -> PathBuf {
    let mut s = output.as_os_str().to_owned();
    s.push(".measurements.json");
    PathBuf::from(s)
}

/// Opens GPU 0 and runs the GEMM, copy and collective micro-benchmarks.
fn measure_on_gpu() -> anyhow::Result<Measurements> {
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) if e.is_unavailable() => bail!(
            "calibration needs the CUDA backend and a GPU to run its GEMM, copy and collective micro-benchmarks ({e}); on a machine without one, fit timings measured elsewhere with --measurements FILE"
        ),
        Err(e) => return Err(e).context("opening CUDA device 0"),
    };
    println!(
        "measuring on {} ({}): GEMMs, device copies, local-gpu collectives (2 virtual ranks on this GPU: they time its memory system, not NVLink)",
        dev.name(),
        dev.arch()
    );
    measure(&dev, &CalibrateOptions::default()).context("running the calibration micro-benchmarks")
}

fn print_table(m: &Measurements) {
    println!(
        "{:<16} {:>22} {:>12} {:>14}",
        "benchmark", "size", "time", "rate"
    );
    for g in &m.gemm {
        let tflops = 2.0 * g.m as f64 * g.n as f64 * g.k as f64 / g.seconds / 1e12;
        println!(
            "{:<16} {:>22} {:>9.1} µs {:>8.1} TFLOP/s",
            format!("gemm {:?}", g.dtype).to_lowercase(),
            format!("{}x{}x{}", g.m, g.n, g.k),
            g.seconds * 1e6,
            tflops
        );
    }
    for c in &m.copy {
        println!(
            "{:<16} {:>18} KiB {:>9.1} µs {:>10.1} GB/s",
            "copy d2d",
            c.bytes >> 10,
            c.seconds * 1e6,
            2.0 * c.bytes as f64 / c.seconds / 1e9
        );
    }
    for c in &m.collectives {
        println!(
            "{:<16} {:>18} KiB {:>9.1} µs {:>6.1} GB/s bus",
            format!("{:?} x{}", c.kind, c.ranks),
            c.bytes >> 10,
            c.seconds * 1e6,
            c.bytes as f64 / c.seconds * c.kind.bus_factor(c.ranks) / 1e9
        );
    }
}
