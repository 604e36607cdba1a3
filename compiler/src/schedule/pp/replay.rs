//! A schedule replayed with pass costs: each slot's start and end, per rank its busy time,
//! idle time (the bubble), exposed transfer time and in-flight activations over time, and the
//! renderings (text diagram, Chrome/Perfetto trace). This is the one pipeline replay: the
//! schedule tools time a schedule with uniform [`PassCosts`], the analytic training model
//! (`compile::simulate_training`, replayed by `cost::simulate_training_on`) with each (rank, chunk, pass)'s simulated duration and the
//! point-to-point time of an activation or gradient ([`PipelineSchedule::replay_with`]).
//!
//! Rule: each rank runs its slots in order, a slot starting when the rank is free and its
//! inputs have arrived. A forward of chunk `c` reads the forward of chunk `c − 1`; a backward
//! reads the backward of chunk `c + 1` (the last chunk: its own forward); a weight-gradient
//! pass reads its backward. An input made on another rank arrives `p2p` after its producer
//! ended (sends are asynchronous); the part of that transfer a rank waits for is its exposed
//! point-to-point time, the rest of its idle time until the last slot of any rank ends is its
//! bubble. Post: every (phase, micro-batch, chunk) of the schedule ran exactly once, or
//! [`PipelineError::Deadlock`] names a rank that waits forever.

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

    /// The duration of a `phase` slot, in a schedule that splits the weight gradient out of
    /// the backward (`split`) or not.
    pub fn of(self, phase: Phase, split: bool) -> f64 {
        match phase {
            Phase::F => self.f,
            Phase::B if split => self.b - self.w,
            Phase::B => self.b,
            Phase::W => self.w,
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
    /// When the transfer of its input from another rank started (`None`: a local input).
    pub recv: Option<f64>,
    /// The part of that transfer the rank waited for (exposed point-to-point time).
    pub p2p_wait: f64,
}

/// One rank's totals in a replay.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankTimes {
    /// Its slots in execution order (indices into [`Replay::timeline`] `start..end`).
    slots: std::ops::Range<usize>,
    /// Time running slots.
    pub busy: f64,
    /// When its last slot ends.
    pub end: f64,
    /// Exposed point-to-point time.
    pub p2p_wait: f64,
    /// Peak number of (micro-batch, chunk) forwards whose activations it holds (run, their
    /// backward not yet; a weight-gradient pass's inputs are not counted).
    pub peak_in_flight: usize,
    /// That number over time: (time, in flight) at each change, a forward counting at its
    /// start, a backward at its end.
    pub in_flight: Vec<(f64, usize)>,
}

/// The result of replaying a schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Replay {
    /// Every slot with its times, rank by rank, each rank's in execution order.
    pub timeline: Vec<Timed>,
    /// Time of the last slot's end.
    pub makespan: f64,
    /// The bubble (idle time not spent waiting on a transfer) over the makespan, averaged over
    /// ranks; with free transfers, 1 − busy / (ranks × makespan).
    pub bubble_fraction: f64,
    /// Peak number of micro-batches whose activations a rank holds (forwards run, backwards
    /// not yet), per rank, in units of whole micro-batches (chunk forwards / v).
    pub peak_in_flight: Vec<f64>,
    /// Per rank: busy, end, exposed transfer time and in-flight activations.
    pub ranks: Vec<RankTimes>,
}

impl PipelineSchedule {
    /// Replays the schedule with `costs` per chunk pass (a chunk's cost is the stage cost over
    /// `v`) and zero-latency transfers ([`PipelineSchedule::replay_with`]).
    pub fn replay(&self, costs: PassCosts) -> Result<Replay, PipelineError> {
        let (split, v) = (self.splits_weight_grad(), self.virtual_stages as f64);
        self.replay_with(&|_, phase| costs.of(phase, split) / v, 0.0)
    }

    /// Replays the schedule (module docs): `pass(chunk, phase)` is the duration of that pass
    /// of model chunk `chunk` (of `p·v`, on rank `chunk mod p`) for any micro-batch — `B` the
    /// input gradient alone when the schedule splits the weight gradient out
    /// ([`PipelineSchedule::splits_weight_grad`]), the whole backward otherwise — and `p2p`
    /// the transfer time of an input made on another rank. Errors on deadlock (no rank can
    /// progress).
    pub fn replay_with(
        &self,
        pass: &dyn Fn(usize, Phase) -> f64,
        p2p: f64,
    ) -> Result<Replay, PipelineError> {
        let (p, v, m) = (self.stages, self.virtual_stages, self.micro_batches);
        let chunks = p * v;
        let split = self.splits_weight_grad();
        // done[phase][micro][chunk] = end time.
        let idx = |ph: Phase, i: usize, c: usize| (ph as usize * m + i) * chunks + c;
        let mut done: Vec<Option<f64>> = vec![None; 3 * m * chunks];
        let mut next = vec![0usize; p];
        let mut free = vec![0f64; p];
        let mut per_rank: Vec<Vec<Timed>> = self
            .per_rank
            .iter()
            .map(|s| Vec::with_capacity(s.len()))
            .collect();
        loop {
            let mut progressed = false;
            for r in 0..p {
                while let Some(&slot) = self.per_rank[r].get(next[r]) {
                    let Slot {
                        phase,
                        micro: i,
                        chunk: c,
                    } = slot;
                    // When the input is ready, and when its transfer from another rank
                    // started (chunks `c` and `c ± 1` are on different ranks when p > 1).
                    let arrive = |t: f64| if p > 1 { (t + p2p, Some(t)) } else { (t, None) };
                    let input = match phase {
                        Phase::F if c == 0 => Some((0.0, None)),
                        Phase::F => done[idx(Phase::F, i, c - 1)].map(arrive),
                        Phase::B if c + 1 == chunks => done[idx(Phase::F, i, c)].map(|t| (t, None)),
                        Phase::B => done[idx(Phase::B, i, c + 1)]
                            .zip(done[idx(Phase::F, i, c)])
                            .map(|(g, f)| {
                                let (a, recv) = arrive(g);
                                (a.max(f), recv)
                            }),
                        Phase::W => done[idx(Phase::B, i, c)].map(|t| (t, None)),
                    };
                    let Some((ready, recv)) = input else { break };
                    let start = ready.max(free[r]);
                    let p2p_wait = if recv.is_some() && ready > free[r] {
                        (ready - free[r]).min(p2p)
                    } else {
                        0.0
                    };
                    let end = start + pass(c, phase);
                    free[r] = end;
                    done[idx(phase, i, c)] = Some(end);
                    per_rank[r].push(Timed {
                        slot,
                        rank: r,
                        start,
                        end,
                        recv,
                        p2p_wait,
                    });
                    next[r] += 1;
                    progressed = true;
                }
            }
            if (0..p).all(|r| next[r] == self.per_rank[r].len()) {
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
        let ran: usize = per_rank.iter().map(Vec::len).sum();
        if ran != expected {
            return Err(PipelineError::Invalid(format!(
                "schedule runs {ran} slots, expected {expected}"
            )));
        }
        let makespan = free.iter().copied().fold(0.0, f64::max);
        let mut timeline = Vec::with_capacity(ran);
        let mut ranks = Vec::with_capacity(p);
        for slots in per_rank {
            let mut cur = 0usize;
            let mut rank = RankTimes {
                slots: timeline.len()..timeline.len() + slots.len(),
                end: slots.last().map_or(0.0, |t| t.end),
                ..RankTimes::default()
            };
            for t in &slots {
                rank.busy += t.end - t.start;
                rank.p2p_wait += t.p2p_wait;
                // A rank runs one slot at a time, so these times never decrease.
                match t.slot.phase {
                    Phase::F => {
                        cur += 1;
                        rank.in_flight.push((t.start, cur));
                    }
                    Phase::B => {
                        cur = cur.saturating_sub(1);
                        rank.in_flight.push((t.end, cur));
                    }
                    Phase::W => {}
                }
                rank.peak_in_flight = rank.peak_in_flight.max(cur);
            }
            timeline.extend(slots);
            ranks.push(rank);
        }
        let mut out = Replay {
            makespan,
            bubble_fraction: 0.0,
            peak_in_flight: ranks
                .iter()
                .map(|r| r.peak_in_flight as f64 / v as f64)
                .collect(),
            timeline,
            ranks,
        };
        if makespan > 0.0 {
            out.bubble_fraction =
                (0..p).map(|r| out.bubble(r)).sum::<f64>() / (p as f64 * makespan);
        }
        Ok(out)
    }
}

impl Replay {
    /// Rank `r`'s slots in execution order.
    pub fn rank(&self, r: usize) -> &[Timed] {
        &self.timeline[self.ranks[r].slots.clone()]
    }

    /// Rank `r`'s idle time until the last slot of any rank ends, not spent waiting on a
    /// transfer: its bubble.
    pub fn bubble(&self, r: usize) -> f64 {
        let x = &self.ranks[r];
        (self.makespan - x.busy - x.p2p_wait).max(0.0)
    }

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

#[cfg(test)]
mod tests {
    use super::super::ScheduleKind;
    use super::*;

    fn sched(kind: ScheduleKind, p: usize, m: usize, v: usize) -> PipelineSchedule {
        PipelineSchedule::new(kind, p, m, v).unwrap()
    }

    #[test]
    fn one_f_one_b_and_gpipe_with_unequal_passes() {
        let (p, m) = (4, 8);
        let (tf, tb) = (1.0, 2.0);
        let cost = |_: usize, ph: Phase| if ph == Phase::F { tf } else { tb };
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::Gpipe] {
            let r = sched(kind, p, m, 1).replay_with(&cost, 0.0).unwrap();
            let want = (m + p - 1) as f64 * (tf + tb);
            assert!((r.makespan - want).abs() < 1e-9, "{kind:?} {}", r.makespan);
            for s in 0..p {
                assert_eq!(r.ranks[s].busy, m as f64 * (tf + tb));
                assert_eq!(r.rank(s).len(), 2 * m);
                assert!(r.rank(s).iter().all(|t| t.rank == s));
            }
            // Stage 0 holds p micro-batches at its peak under 1F1B, all m under GPipe.
            let peak = if kind == ScheduleKind::Gpipe { m } else { p };
            assert_eq!(r.ranks[0].peak_in_flight, peak);
            assert_eq!(r.ranks[0].in_flight.last().map(|x| x.1), Some(0));
        }
    }

    #[test]
    fn transfers_delay_cross_rank_inputs_and_count_as_exposed() {
        // GPipe, 2 stages, 1 micro-batch, F = 1, B = 2, transfers d: F0 [0, 1] on rank 0,
        // F0 [1 + d, 2 + d] and B0 [2 + d, 4 + d] on rank 1, B0 [4 + 2d, 6 + 2d] on rank 0.
        let d = 0.25;
        let r = sched(ScheduleKind::Gpipe, 2, 1, 1)
            .replay_with(&|_, ph| if ph == Phase::F { 1.0 } else { 2.0 }, d)
            .unwrap();
        assert!((r.makespan - (6.0 + 2.0 * d)).abs() < 1e-12);
        assert_eq!(r.rank(1)[0].recv, Some(1.0));
        assert_eq!(r.rank(0)[0].recv, None);
        for s in 0..2 {
            assert!((r.ranks[s].p2p_wait - d).abs() < 1e-12);
            assert!((r.bubble(s) - (3.0 + d)).abs() < 1e-12);
        }
        // Free transfers: the uniform replay.
        let a = sched(ScheduleKind::Interleaved, 4, 8, 2);
        let u = a.replay(PassCosts::uniform(1.0)).unwrap();
        let w = a.replay_with(&|_, ph| PassCosts::uniform(0.5).of(ph, false), 0.0);
        assert_eq!(u, w.unwrap());
    }

    #[test]
    fn per_chunk_costs_reach_their_rank() {
        // Rank 1's chunk is twice as slow: it sets the pace of the steady state.
        let (p, m) = (2, 4);
        let r = sched(ScheduleKind::OneFOneB, p, m, 1)
            .replay_with(
                &|c, ph| (c + 1) as f64 * PassCosts::uniform(1.0).of(ph, false),
                0.0,
            )
            .unwrap();
        assert_eq!(r.ranks[0].busy, 12.0);
        assert_eq!(r.ranks[1].busy, 24.0);
        assert!(r.bubble(0) > r.bubble(1));
    }

    /// ZB-H1 with F = B = W (Qi et al. 2023, §3): its bubble is (p − 1)·(F + B − W) against
    /// 1F1B's (p − 1)·(F + B + W), a third of it: (p − 1)/3 of a 1F1B pass time F + B + W.
    #[test]
    fn zb_h1_bubble_is_a_third_of_1f1b() {
        for p in [2, 3, 4, 6] {
            for m in [p, 2 * p, 3 * p] {
                let unit = PassCosts::uniform(1.0);
                let zb = sched(ScheduleKind::ZbH1, p, m, 1).replay(unit).unwrap();
                let one = sched(ScheduleKind::OneFOneB, p, m, 1).replay(unit).unwrap();
                // F = B − W = W = 1: a 1F1B pass time F + B (B the whole backward) is 3.
                let (fbw, w) = (unit.f + unit.b, unit.w);
                for s in 0..p {
                    let want = (p - 1) as f64 * (fbw - 2.0 * w);
                    assert!((zb.bubble(s) - want).abs() < 1e-9, "p={p} m={m} s={s}");
                    assert!((zb.bubble(s) - (p - 1) as f64 / 3.0 * fbw).abs() < 1e-9);
                    assert!((one.bubble(s) - (p - 1) as f64 * fbw).abs() < 1e-9);
                }
                assert!((zb.makespan - one.makespan + 2.0 * (p - 1) as f64 * w).abs() < 1e-9);
                assert_eq!(zb.peak_in_flight, one.peak_in_flight);
            }
        }
    }
}
