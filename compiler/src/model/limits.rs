//! The sizes shardc accepts and the memory it may plan to use.
//!
//! Two kinds of bounds, both checked before anything is allocated:
//!
//! - **Hard limits** on what the formats and the arithmetic can represent: token and position
//!   ids are int32 ([`MAX_DIM`]), at most [`MAX_LAYERS`] decoder layers (16× the deepest
//!   published model; compile time grows faster than linearly in layers: 1,000 compile in
//!   0.7 s forward and 15 s for a training step, 10,000 in 40 s and ~15 min) and [`MAX_PARAMS`] parameters, at most [`MAX_RANKS`] ranks in a mesh, and
//!   byte counts below [`ACCOUNTING_LIMIT`] so memory accounting cannot overflow.
//! - **A memory budget** ([`MemoryCap`]): what grows with an input (the IR with the layer count
//!   and micro-batches, a pipeline schedule with stages × micro-batches, benchmark buffers with
//!   their size × ranks) is estimated first and refused, with the estimate, when it exceeds the
//!   cap: `SHARDC_MAX_MEMORY` (bytes, optional `K`/`M`/`G`/`T` suffix, powers of 1024) or 3/4
//!   of the machine's physical memory.
//!
//! The estimates are calibrated upper bounds on the resident memory of the structures named
//! (measured on the bundled models), not exact counts.

use std::fmt;
use thiserror::Error;

/// Largest vocabulary, number of positions and model dimension: token and position ids are
/// int32.
pub const MAX_DIM: usize = 1 << 31;
/// Most decoder layers a config may have (bounds compile time as well as memory).
pub const MAX_LAYERS: usize = 2048;
/// Most parameters a config may describe (~1.1 × 10¹⁵, 500× the largest published models),
/// so parameter, gradient and optimizer byte counts fit in 64 bits.
pub const MAX_PARAMS: u128 = 1 << 50;
/// Most ranks in a mesh.
pub const MAX_RANKS: usize = 1 << 20;
/// Byte counts (of one step's activations, of a plan's buffers) stay below this (4 EiB), so
/// sums over tensors, layers and micro-batches fit in 64 bits.
pub const ACCOUNTING_LIMIT: u128 = 1 << 62;

/// The environment variable that sets the memory cap.
pub const MAX_MEMORY_ENV: &str = "SHARDC_MAX_MEMORY";

/// Where the memory cap comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapSource {
    /// `SHARDC_MAX_MEMORY`.
    Env,
    /// 3/4 of `MemTotal` in `/proc/meminfo`.
    PhysicalMemory,
    /// 16 GiB where the physical memory cannot be read.
    Fallback,
}

/// The memory shardc may plan to use for one command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryCap {
    /// Bytes.
    pub bytes: u64,
    /// Where the value comes from.
    pub source: CapSource,
}

impl fmt::Display for MemoryCap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = match self.source {
            CapSource::Env => MAX_MEMORY_ENV.to_string(),
            CapSource::PhysicalMemory => {
                format!("3/4 of physical memory; {MAX_MEMORY_ENV} overrides")
            }
            CapSource::Fallback => format!("default; {MAX_MEMORY_ENV} overrides"),
        };
        write!(f, "{} memory cap ({why})", human_bytes(self.bytes as u128))
    }
}

/// A size or budget that cannot be honoured.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LimitError {
    /// An estimate exceeds the memory cap.
    #[error("{what} would need ~{}, more than the {cap}", human_bytes(*.need))]
    OverBudget {
        /// The input that drives the size and the structure (`num_hidden_layers=…: the IR`).
        what: String,
        /// Estimated bytes.
        need: u128,
        /// The cap.
        cap: MemoryCap,
    },
    /// `SHARDC_MAX_MEMORY` is not a size.
    #[error(
        "{MAX_MEMORY_ENV}=`{0}`: expected a positive size in bytes with an optional K, M, G or T \
         suffix (e.g. 16G)"
    )]
    BadEnv(String),
}

impl MemoryCap {
    /// The cap of this process: `SHARDC_MAX_MEMORY`, else 3/4 of physical memory, else 16 GiB.
    pub fn current() -> Result<MemoryCap, LimitError> {
        if let Some(v) = std::env::var_os(MAX_MEMORY_ENV) {
            let s = v.to_string_lossy();
            return parse_size(&s)
                .map(|bytes| MemoryCap {
                    bytes,
                    source: CapSource::Env,
                })
                .ok_or_else(|| LimitError::BadEnv(s.into_owned()));
        }
        Ok(match physical_memory() {
            Some(total) => MemoryCap {
                bytes: total / 4 * 3,
                source: CapSource::PhysicalMemory,
            },
            None => MemoryCap {
                bytes: 16 << 30,
                source: CapSource::Fallback,
            },
        })
    }

    /// An error naming `what` when `need` bytes exceed the cap.
    pub fn check(self, need: u128, what: impl FnOnce() -> String) -> Result<(), LimitError> {
        if need <= self.bytes as u128 {
            Ok(())
        } else {
            Err(LimitError::OverBudget {
                what: what(),
                need,
                cap: self,
            })
        }
    }
}

/// [`MemoryCap::current`] then [`MemoryCap::check`].
pub fn check_budget(need: u128, what: impl FnOnce() -> String) -> Result<(), LimitError> {
    MemoryCap::current()?.check(need, what)
}

/// `MemTotal` of `/proc/meminfo`, in bytes.
fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line
        .trim_start_matches("MemTotal:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// Parses a positive size in bytes: `8`, `64K`, `64M`, `1G`, `1GiB`, `2T`, `512B` (binary
/// multiples). `None` for anything else, zero included.
pub fn parse_size(s: &str) -> Option<u64> {
    let upper = s.trim().to_ascii_uppercase();
    let body = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (digits, shift) = match body.chars().last() {
        Some('K') => (&body[..body.len() - 1], 10),
        Some('M') => (&body[..body.len() - 1], 20),
        Some('G') => (&body[..body.len() - 1], 30),
        Some('T') => (&body[..body.len() - 1], 40),
        _ => (body, 0),
    };
    let digits = digits.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .filter(|&n| n > 0)
}

/// `x` divided by `base` while its magnitude is at least `base` and a larger unit is left
/// (of `units`, the first being 1): the scaled value and its unit's index.
pub fn scale_to_unit(x: f64, base: f64, units: usize) -> (f64, usize) {
    let (mut x, mut u) = (x, 0);
    while x.abs() >= base && u + 1 < units {
        x /= base;
        u += 1;
    }
    (x, u)
}

/// `17.6 GiB`, `3.0 PiB`, `1.2e6 EiB`.
pub fn human_bytes(b: u128) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let (x, u) = scale_to_unit(b as f64, 1024.0, UNITS.len());
    if u == 0 {
        format!("{b} B")
    } else if x >= 1e4 {
        format!("{x:.1e} {}", UNITS[u])
    } else {
        format!("{x:.1} {}", UNITS[u])
    }
}

/// What an IR estimate is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrWork {
    /// The forward graph alone (`inspect`, an unsharded `run`).
    Graph,
    /// A forward plan: the logical and the SPMD graph, the schedule and the plan.
    Forward,
    /// A training step of `micro_batches` micro-batches: forward, backward and optimizer per
    /// micro-batch, partitioned, and the plan (every chunk of a pipeline together).
    Train {
        /// Micro-batches per step.
        micro_batches: usize,
    },
}

/// Estimated bytes of building, replaying and drawing a pipeline schedule of `stages` ×
/// `micro_batches` × `virtual_stages` (`shardc schedule`): the passes, and the diagram's grid
/// of stages × time cells (one string per cell); `trace` adds the Perfetto events.
pub fn schedule_bytes(
    stages: usize,
    micro_batches: usize,
    virtual_stages: usize,
    trace: bool,
) -> u128 {
    let (p, m, v) = (
        stages as u128,
        micro_batches as u128,
        virtual_stages as u128,
    );
    let passes = product(&[3, p, m, v]);
    // Makespan in cells: at most 3 units per pass of the busiest stage plus the fill and drain.
    let cells = product(&[3, m, v]).saturating_add(3 * p);
    let per_pass = if trace { 4 << 10 } else { 256 };
    product(&[passes, per_pass]).saturating_add(product(&[p, cells, 96]))
}

/// Estimated bytes of the simulator's pipeline of `stages` × `micro_batches` ×
/// `virtual_stages` (`shardc simulate --train`): its forward, backward and (zero-bubble
/// schedules) weight-gradient passes, counted as three for every schedule.
pub fn simulated_pipeline_bytes(
    stages: usize,
    micro_batches: usize,
    virtual_stages: usize,
) -> u128 {
    product(&[
        3 * 512,
        stages as u128,
        micro_batches as u128,
        virtual_stages as u128,
    ])
}

/// The saturating product of `xs`.
pub fn product(xs: &[u128]) -> u128 {
    xs.iter().fold(1u128, |a, &x| a.saturating_mul(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("8"), Some(8));
        assert_eq!(parse_size("64K"), Some(64 << 10));
        assert_eq!(parse_size("64m"), Some(64 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("2T"), Some(2 << 40));
        assert_eq!(parse_size("512b"), Some(512));
        for bad in ["0", "", "x", "-1", "+1", "1.5G", "G", "99999999999T"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(1 << 60), "1.0 EiB");
        assert!(
            human_bytes(u128::MAX).ends_with("EiB"),
            "{}",
            human_bytes(u128::MAX)
        );
    }

    #[test]
    fn over_budget_names_the_input_and_the_cap() {
        let cap = MemoryCap {
            bytes: 1 << 30,
            source: CapSource::Env,
        };
        assert!(cap.check(1 << 30, || unreachable!()).is_ok());
        let e = cap.check(3 << 30, || "n=3: the table".into()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "n=3: the table would need ~3.0 GiB, more than the 1.0 GiB memory cap (SHARDC_MAX_MEMORY)"
        );
    }
}
