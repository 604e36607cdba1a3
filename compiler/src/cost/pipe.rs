//! Pipeline schedules as a discrete-event simulation over stages: GPipe (all forwards, then all
//! backwards), 1F1B (PipeDream-Flush: warm-up forwards, one forward one backward, cool-down
//! backwards) and Megatron-LM's interleaved 1F1B with `v` model chunks per stage (Narayanan et
//! al., SC'21 §2.2), in the op order Megatron-LM's `schedules.py` issues.
//!
//! A forward of micro-batch `mb` on chunk `c` of stage `s` needs the same forward on stage
//! `s − 1` (or, on stage 0, chunk `c − 1` of the last stage); a backward needs the backward on
//! stage `s + 1` (or, on the last stage, the same chunk's forward there, or chunk `c + 1` of
//! stage 0). A stage runs its ops in order, each as soon as the stage is free and its input has
//! arrived (`p2p` after the producer ended). Sends are asynchronous.

use super::units::Seconds;
use super::CostError;
use serde::{Deserialize, Serialize};

/// A pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PipeSchedule {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward one backward (PipeDream-Flush).
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B with this many model chunks per stage.
    Interleaved(usize),
}

impl PipeSchedule {
    /// Model chunks per stage.
    pub fn chunks(self) -> usize {
        match self {
            PipeSchedule::Interleaved(v) => v.max(1),
            _ => 1,
        }
    }
}

/// One op of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PipeOp {
    /// Forward (else backward).
    pub fwd: bool,
    /// Micro-batch.
    pub mb: usize,
    /// Model chunk on this stage.
    pub chunk: usize,
}

/// The ops stage `stage` of `p` runs for `m` micro-batches, in order: the schedule's slots
/// ([`crate::schedule::pp::PipelineSchedule`], the one source of schedule orders), with
/// chunks numbered per stage.
pub fn stage_order(schedule: PipeSchedule, p: usize, m: usize, stage: usize) -> Vec<PipeOp> {
    use crate::schedule::pp::{Phase, PipelineSchedule, ScheduleKind};
    let (kind, v) = match schedule {
        PipeSchedule::Gpipe => (ScheduleKind::Gpipe, 1),
        PipeSchedule::OneFOneB => (ScheduleKind::OneFOneB, 1),
        PipeSchedule::Interleaved(v) => (ScheduleKind::Interleaved, v.max(1)),
    };
    let Ok(s) = PipelineSchedule::new(kind, p.max(1), m.max(1), v) else {
        return Vec::new();
    };
    s.per_rank
        .get(stage)
        .map(|slots| {
            slots
                .iter()
                .map(|x| PipeOp {
                    fwd: x.phase == Phase::F,
                    mb: x.micro,
                    chunk: x.chunk / p.max(1),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A timed op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PipeEvent {
    /// The op.
    pub op: PipeOp,
    /// Start, seconds.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
    /// Time it waited for its input's transfer (exposed point-to-point communication).
    pub p2p_wait: f64,
    /// When its input's transfer from another stage started (`None`: local input).
    pub recv: Option<f64>,
}

/// The simulated pipeline.
#[derive(Clone, Debug, PartialEq)]
pub struct PipeRun {
    /// Per stage, its ops in order with times.
    pub stages: Vec<Vec<PipeEvent>>,
    /// When the last op ends.
    pub makespan: Seconds,
}

impl PipeRun {
    /// Busy time of a stage.
    pub fn busy(&self, stage: usize) -> f64 {
        self.stages[stage].iter().map(|e| e.end - e.start).sum()
    }

    /// When a stage's last op ends.
    pub fn stage_end(&self, stage: usize) -> f64 {
        self.stages[stage].last().map_or(0.0, |e| e.end)
    }

    /// Exposed point-to-point time of a stage.
    pub fn p2p_exposed(&self, stage: usize) -> f64 {
        self.stages[stage].iter().map(|e| e.p2p_wait).sum()
    }

    /// Idle time of a stage until the pipeline flushes (the last op of any stage ends), not
    /// spent waiting on a transfer: the bubble.
    pub fn bubble(&self, stage: usize) -> f64 {
        (self.makespan.0 - self.busy(stage) - self.p2p_exposed(stage)).max(0.0)
    }

    /// Peak number of (micro-batch, chunk) activations a stage holds, and its timeline of
    /// (time, in flight) changes.
    pub fn in_flight(&self, stage: usize) -> (usize, Vec<(f64, usize)>) {
        let mut deltas: Vec<(f64, i64)> = Vec::new();
        for e in &self.stages[stage] {
            if e.op.fwd {
                deltas.push((e.start, 1));
            } else {
                deltas.push((e.end, -1));
            }
        }
        // Frees before allocations at the same instant.
        deltas.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut cur = 0i64;
        let mut peak = 0i64;
        let mut tl = Vec::new();
        for (t, d) in deltas {
            cur += d;
            peak = peak.max(cur);
            tl.push((t, cur.max(0) as usize));
        }
        (peak.max(0) as usize, tl)
    }
}

/// Runs `schedule` on `p` stages with `m` micro-batches. `dur(stage, chunk, fwd)` is an op's
/// time; `p2p` the transfer time between consecutive stages.
pub fn run_pipeline(
    schedule: PipeSchedule,
    p: usize,
    m: usize,
    dur: &dyn Fn(usize, usize, bool) -> f64,
    p2p: f64,
) -> Result<PipeRun, CostError> {
    let v = schedule.chunks();
    if p == 0 || m == 0 {
        return Err(CostError::Train(
            "a pipeline needs at least one stage and one micro-batch".into(),
        ));
    }
    if v > 1 && m % p != 0 {
        return Err(CostError::Train(format!(
            "the interleaved schedule needs the micro-batches per pipeline ({m}) to be a multiple of the pipeline stages ({p})"
        )));
    }
    let orders: Vec<Vec<PipeOp>> = (0..p).map(|s| stage_order(schedule, p, m, s)).collect();
    let idx = |s: usize, c: usize, mb: usize| (s * v + c) * m + mb;
    let mut fwd_end = vec![f64::NAN; p * v * m];
    let mut bwd_end = vec![f64::NAN; p * v * m];
    let mut pos = vec![0usize; p];
    let mut free = vec![0f64; p];
    let mut stages: Vec<Vec<PipeEvent>> = vec![Vec::new(); p];
    let total: usize = orders.iter().map(Vec::len).sum();
    let mut done = 0;
    while done < total {
        let mut progressed = false;
        for s in 0..p {
            while let Some(&op) = orders[s].get(pos[s]) {
                // The producer of this op's input and whether it is on another stage.
                let (dep, remote) = if op.fwd {
                    if s > 0 {
                        (Some(fwd_end[idx(s - 1, op.chunk, op.mb)]), true)
                    } else if op.chunk > 0 {
                        (Some(fwd_end[idx(p - 1, op.chunk - 1, op.mb)]), p > 1)
                    } else {
                        (None, false)
                    }
                } else if s + 1 < p {
                    (Some(bwd_end[idx(s + 1, op.chunk, op.mb)]), true)
                } else if op.chunk + 1 < v {
                    (Some(bwd_end[idx(0, op.chunk + 1, op.mb)]), p > 1)
                } else {
                    (Some(fwd_end[idx(s, op.chunk, op.mb)]), false)
                };
                let (ready, recv) = match dep {
                    Some(t) if t.is_nan() => break,
                    Some(t) if remote => (t + p2p, Some(t)),
                    Some(t) => (t, None),
                    None => (0.0, None),
                };
                let start = free[s].max(ready);
                let p2p_wait = if remote && ready > free[s] {
                    (ready - free[s]).min(p2p)
                } else {
                    0.0
                };
                let end = start + dur(s, op.chunk, op.fwd);
                if op.fwd {
                    fwd_end[idx(s, op.chunk, op.mb)] = end;
                } else {
                    bwd_end[idx(s, op.chunk, op.mb)] = end;
                }
                stages[s].push(PipeEvent {
                    op,
                    start,
                    end,
                    p2p_wait,
                    recv,
                });
                free[s] = end;
                pos[s] += 1;
                done += 1;
                progressed = true;
            }
        }
        if !progressed {
            return Err(CostError::Train(format!(
                "pipeline schedule {schedule:?} deadlocks with {p} stages and {m} micro-batches"
            )));
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    Ok(PipeRun {
        stages,
        makespan: Seconds(makespan),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
        let (p, m) = (4, 8);
        let (tf, tb) = (1.0, 2.0);
        let run = run_pipeline(
            PipeSchedule::OneFOneB,
            p,
            m,
            &|_, _, f| if f { tf } else { tb },
            0.0,
        )
        .unwrap();
        let expect = (m + p - 1) as f64 * (tf + tb);
        assert!((run.makespan.0 - expect).abs() < 1e-9, "{}", run.makespan.0);
        for s in 0..p {
            assert_eq!(run.busy(s), m as f64 * (tf + tb));
        }
        // Stage 0 holds p micro-batches at its peak (1F1B), not m (GPipe).
        assert_eq!(run.in_flight(0).0, p);
        let g = run_pipeline(
            PipeSchedule::Gpipe,
            p,
            m,
            &|_, _, f| if f { tf } else { tb },
            0.0,
        )
        .unwrap();
        assert!((g.makespan.0 - expect).abs() < 1e-9);
        assert_eq!(g.in_flight(0).0, m);
    }

    #[test]
    fn interleaving_divides_the_bubble_by_v() {
        let (p, m, v) = (4, 8, 2);
        let (tf, tb) = (1.0, 2.0);
        let run = run_pipeline(
            PipeSchedule::Interleaved(v),
            p,
            m,
            &|_, _, f| (if f { tf } else { tb }) / v as f64,
            0.0,
        )
        .unwrap();
        let ideal = m as f64 * (tf + tb);
        let bubble = (p - 1) as f64 * (tf + tb) / v as f64;
        assert!(
            (run.makespan.0 - (ideal + bubble)).abs() < 1e-9,
            "{} vs {}",
            run.makespan.0,
            ideal + bubble
        );
        assert!(run_pipeline(PipeSchedule::Interleaved(2), 4, 6, &|_, _, _| 1.0, 0.0).is_err());
    }

    #[test]
    fn orders_cover_every_op_once() {
        for sched in [
            PipeSchedule::Gpipe,
            PipeSchedule::OneFOneB,
            PipeSchedule::Interleaved(3),
        ] {
            let (p, m) = (4, 8);
            for s in 0..p {
                let o = stage_order(sched, p, m, s);
                let mut seen = std::collections::BTreeSet::new();
                for op in &o {
                    assert!(seen.insert((op.fwd, op.mb, op.chunk)), "{sched:?} {op:?}");
                }
                assert_eq!(o.len(), 2 * m * sched.chunks());
            }
        }
    }
}
