//! A schedule replayed with pass costs: each slot's start and end, the bubble, the peak of
//! micro-batches in flight per rank, and the renderings (text diagram, Chrome/Perfetto trace).

use super::{Phase, PipelineError, PipelineSchedule, Slot};

/// Durations of the passes of one chunk, in any unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PassCosts {
    /// Forward.
    pub f: f64,
    /// Backward (input + weight gradient when not split).
    pub b: f64,
    /// Weight gradient when split (ZB); the backward then costs `b − w`.
    pub w: f64,
}

impl PassCosts {
    /// The usual ratio: backward = 2 × forward; split evenly for zero-bubble schedules.
    pub fn uniform(forward: f64) -> PassCosts {
        PassCosts {
            f: forward,
            b: 2.0 * forward,
            w: forward,
        }
    }
}

/// One executed slot, timed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed {
    /// The slot.
    pub slot: Slot,
    /// Rank.
    pub rank: usize,
    /// Start.
    pub start: f64,
    /// End.
    pub end: f64,
}

/// The result of replaying a schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Replay {
    /// Every slot with its times.
    pub timeline: Vec<Timed>,
    /// Time of the last slot's end.
    pub makespan: f64,
    /// Idle time over total time, averaged over ranks.
    pub bubble_fraction: f64,
    /// Peak number of micro-batches whose activations a rank holds (forwards run, backwards
    /// not yet), per rank, in units of whole micro-batches (chunk forwards / v).
    pub peak_in_flight: Vec<f64>,
}

impl PipelineSchedule {
    /// Replays the schedule with `costs` per chunk pass (a chunk's cost is the stage cost over
    /// `v`) and zero-latency transfers: each rank runs its slots in order, a slot starting when
    /// the rank is free and its inputs have arrived. Errors on deadlock (no rank can progress).
    pub fn replay(&self, costs: PassCosts) -> Result<Replay, PipelineError> {
        let (p, v, m) = (self.stages, self.virtual_stages, self.micro_batches);
        let chunks = p * v;
        let split = self.per_rank.iter().flatten().any(|s| s.phase == Phase::W);
        let dur = |ph: Phase| -> f64 {
            let c = match ph {
                Phase::F => costs.f,
                Phase::B if split => costs.b - costs.w,
                Phase::B => costs.b,
                Phase::W => costs.w,
            };
            c / v as f64
        };
        // done[phase][micro][chunk] = end time.
        let idx = |ph: Phase, i: usize, c: usize| (ph as usize * m + i) * chunks + c;
        let mut done: Vec<Option<f64>> = vec![None; 3 * m * chunks];
        let mut next = vec![0usize; p];
        let mut free = vec![0f64; p];
        let mut timeline = Vec::new();
        let mut in_flight = vec![0i64; p];
        let mut peak = vec![0i64; p];
        loop {
            let mut progressed = false;
            let mut all_done = true;
            for r in 0..p {
                while let Some(&slot) = self.per_rank[r].get(next[r]) {
                    all_done = false;
                    let Slot {
                        phase,
                        micro: i,
                        chunk: c,
                    } = slot;
                    let dep = match phase {
                        Phase::F if c == 0 => Some(0.0),
                        Phase::F => done[idx(Phase::F, i, c - 1)],
                        Phase::B if c + 1 == chunks => done[idx(Phase::F, i, c)],
                        Phase::B => done[idx(Phase::B, i, c + 1)]
                            .zip(done[idx(Phase::F, i, c)])
                            .map(|(a, b)| a.max(b)),
                        Phase::W => done[idx(Phase::B, i, c)],
                    };
                    let Some(ready) = dep else { break };
                    let start = ready.max(free[r]);
                    let end = start + dur(phase);
                    free[r] = end;
                    done[idx(phase, i, c)] = Some(end);
                    timeline.push(Timed {
                        slot,
                        rank: r,
                        start,
                        end,
                    });
                    match phase {
                        Phase::F => in_flight[r] += 1,
                        Phase::B => in_flight[r] -= 1,
                        Phase::W => {}
                    }
                    peak[r] = peak[r].max(in_flight[r]);
                    next[r] += 1;
                    progressed = true;
                }
                if next[r] < self.per_rank[r].len() {
                    all_done = false;
                }
            }
            if all_done {
                break;
            }
            if !progressed {
                let r = (0..p)
                    .find(|&r| next[r] < self.per_rank[r].len())
                    .expect("invariant: a rank has work");
                return Err(PipelineError::Deadlock {
                    rank: r,
                    slot: next[r],
                    what: self.per_rank[r][next[r]].to_string(),
                });
            }
        }
        // Every (phase, micro, chunk) ran exactly once.
        let expected = if split { 3 } else { 2 } * m * chunks;
        if timeline.len() != expected {
            return Err(PipelineError::Invalid(format!(
                "schedule runs {} slots, expected {expected}",
                timeline.len()
            )));
        }
        let makespan = timeline.iter().map(|t| t.end).fold(0.0, f64::max);
        let busy: f64 = timeline.iter().map(|t| t.end - t.start).sum();
        Ok(Replay {
            makespan,
            bubble_fraction: 1.0 - busy / (p as f64 * makespan),
            peak_in_flight: peak.iter().map(|&x| x as f64 / v as f64).collect(),
            timeline,
        })
    }
}

impl Replay {
    /// A text diagram: one row per rank, one cell per `unit` of time, `F3`/`B3`/`W3` for the
    /// micro-batch running (chunk shown as a suffix when interleaved), `.` when idle.
    pub fn diagram(&self, stages: usize, unit: f64, interleaved: bool) -> String {
        let cells = (self.makespan / unit).round() as usize;
        let width = self
            .timeline
            .iter()
            .map(|t| label(t, stages, interleaved).len())
            .max()
            .unwrap_or(2);
        let mut rows = vec![vec![format!("{:>width$}", ".", width = width); cells]; stages];
        for t in &self.timeline {
            let (a, z) = (
                (t.start / unit).round() as usize,
                (t.end / unit).round() as usize,
            );
            for cell in rows[t.rank].iter_mut().take(z.min(cells)).skip(a) {
                *cell = format!("{:>width$}", label(t, stages, interleaved), width = width);
            }
        }
        rows.iter()
            .enumerate()
            .map(|(r, row)| format!("stage {r:<2}|{}|", row.join(" ")))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Chrome trace events (Perfetto): one process per rank, slices named by pass.
    pub fn trace_events(&self, stages: usize, us_per_unit: f64) -> serde_json::Value {
        let mut events: Vec<serde_json::Value> = (0..stages)
            .map(|r| {
                serde_json::json!({"ph": "M", "pid": r, "name": "process_name",
                    "args": {"name": format!("pipeline stage {r}")}})
            })
            .collect();
        for t in &self.timeline {
            events.push(serde_json::json!({
                "ph": "X", "pid": t.rank, "tid": 0,
                "name": format!("{:?}{}", t.slot.phase, t.slot.micro),
                "ts": t.start * us_per_unit, "dur": (t.end - t.start) * us_per_unit,
                "args": {"micro_batch": t.slot.micro, "chunk": t.slot.chunk},
            }));
        }
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }
}

fn label(t: &Timed, stages: usize, interleaved: bool) -> String {
    let base = format!("{:?}{}", t.slot.phase, t.slot.micro);
    if interleaved {
        format!("{base}.{}", t.slot.chunk / stages)
    } else {
        base
    }
}
