//! Chrome trace (the JSON Object Format that `chrome://tracing` and Perfetto open): one process
//! per rank, one thread (track) per stream, kernels, collectives and pipeline ops as complete
//! (`"X"`) events with their bytes and FLOPs in `args`, and the rank's memory as a counter.

use super::report::{Simulation, Timeline};
use std::fmt::Write;

fn json_str(s: &str) -> String {
    serde_json::to_string(s).expect("invariant: a string serialises")
}

/// The trace of `sim` for `ranks` (all ranks when `None`).
pub fn chrome_trace(sim: &Simulation, ranks: Option<&[usize]>) -> String {
    timelines_trace(&sim.timelines, &sim.rank_timeline, &sim.rank_labels, ranks)
}

/// The trace of rank timelines (simulated or measured): rank `r` shows
/// `timelines[rank_timeline[r]]`, labelled `rank r <labels[r]>`; `ranks`: all when `None`.
pub fn timelines_trace(
    timelines: &[Timeline],
    rank_timeline: &[u32],
    labels: &[String],
    ranks: Option<&[usize]>,
) -> String {
    let all: Vec<usize> = (0..rank_timeline.len()).collect();
    let ranks = ranks.unwrap_or(&all);
    let mut out = String::from("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    let mut first = true;
    let mut emit = |out: &mut String, ev: String| {
        if !first {
            out.push_str(",\n");
        }
        first = false;
        out.push_str(&ev);
    };
    for &r in ranks {
        let Some(tl) = rank_timeline
            .get(r)
            .and_then(|&ti| timelines.get(ti as usize))
        else {
            continue;
        };
        let label = labels.get(r).cloned().unwrap_or_default();
        emit(
            &mut out,
            format!(
                "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{r},\"args\":{{\"name\":{}}}}}",
                json_str(&format!("rank {r} {label}"))
            ),
        );
        emit(
            &mut out,
            format!(
                "{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{r},\"args\":{{\"sort_index\":{r}}}}}"
            ),
        );
        for (t, name) in tl.tracks.iter().enumerate() {
            emit(
                &mut out,
                format!(
                    "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{r},\"tid\":{t},\"args\":{{\"name\":{}}}}}",
                    json_str(name)
                ),
            );
        }
        for s in &tl.slices {
            let mut ev = String::new();
            write!(
                ev,
                "{{\"ph\":\"X\",\"name\":{},\"cat\":{},\"pid\":{r},\"tid\":{},\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"bytes\":{},\"flops\":{}}}}}",
                json_str(&s.name),
                json_str(&s.cat),
                s.track,
                s.start * 1e6,
                s.dur * 1e6,
                s.bytes,
                s.flops
            )
            .expect("invariant: writing to a String");
            emit(&mut out, ev);
        }
        for &(t, b) in &tl.memory {
            emit(
                &mut out,
                format!(
                    "{{\"ph\":\"C\",\"name\":\"memory\",\"pid\":{r},\"ts\":{:.3},\"args\":{{\"bytes\":{b}}}}}",
                    t * 1e6
                ),
            );
        }
    }
    out.push_str("\n]}\n");
    out
}
