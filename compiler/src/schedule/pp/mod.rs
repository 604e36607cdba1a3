//! Pipeline schedules as data: GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B (Megatron-LM
//! virtual pipeline) and ZB-H1 (Qi et al. 2023, zero-bubble with the weight gradient split
//! out of the backward pass), plus stage partitioning, a replay that times a schedule and
//! checks it cannot deadlock, and renderings (text diagram, Chrome/Perfetto trace). The
//! replay is the compiler's one pipeline replay: `shardc schedule` and the plan verifier time
//! schedules with it, and so does the analytic training model (`compile::simulate_training`, replayed by `cost::simulate_training_on`), with
//! each pass's simulated duration and the point-to-point transfer time.
//!
//! A schedule is, per pipeline rank, the ordered list of [`Slot`]s it executes. Model chunk
//! `j` (of `p·v`) lives on rank `j mod p`; activations of micro-batch `i` flow chunk `j → j+1`
//! (a send/recv pair per boundary) and gradients back.

mod balance;
mod ops;
mod replay;

pub use balance::{balance, parse_stage_layers};
pub use ops::{Carry, PipeOp};
pub use replay::{PassCosts, RankTimes, Replay, Timed};

use serde::{Deserialize, Serialize};
use std::fmt;
use thiserror::Error;

/// Which schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward, one backward (PipeDream-Flush).
    OneFOneB,
    /// 1F1B over `v` model chunks per rank (Megatron-LM interleaved).
    Interleaved,
    /// Zero-bubble ZB-H1: 1F1B with weight-gradient passes deferred into the bubbles.
    ZbH1,
}

impl ScheduleKind {
    /// All kinds, for parsing.
    pub const ALL: [ScheduleKind; 4] = [
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
    ];
    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
        }
    }
    /// Parses a name.
    pub fn from_name(s: &str) -> Result<ScheduleKind, PipelineError> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| PipelineError::UnknownSchedule(s.to_string()))
    }
}

/// The pass a slot runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    /// Forward.
    F,
    /// Backward (input gradient; also the weight gradient unless the schedule splits it).
    B,
    /// Weight gradient (split schedules only).
    W,
}

/// One unit of work on a pipeline rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Slot {
    /// Pass.
    pub phase: Phase,
    /// Micro-batch.
    pub micro: usize,
    /// Model chunk (`0..p·v`); it lives on rank `chunk mod p`.
    pub chunk: usize,
}

/// A schedule that cannot be built or replayed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PipelineError {
    /// Unknown schedule name.
    #[error("unknown pipeline schedule `{0}`; valid: gpipe, 1f1b, interleaved, zb-h1")]
    UnknownSchedule(String),
    /// Bad sizes.
    #[error("{0}")]
    Invalid(String),
    /// A schedule beyond the memory budget.
    #[error(transparent)]
    Limit(#[from] crate::model::LimitError),
    /// The replay found ranks waiting on each other.
    #[error("deadlock: no rank can progress; rank {rank} waits at slot {slot} ({what})")]
    Deadlock {
        /// A stuck rank.
        rank: usize,
        /// Its next slot index.
        slot: usize,
        /// The slot, e.g. `F3 chunk 1`.
        what: String,
    },
}

/// A pipeline schedule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineSchedule {
    /// Kind.
    pub kind: ScheduleKind,
    /// Pipeline ranks `p`.
    pub stages: usize,
    /// Micro-batches `m`.
    pub micro_batches: usize,
    /// Model chunks per rank `v` (1 unless interleaved).
    pub virtual_stages: usize,
    /// Slots of each rank in execution order.
    pub per_rank: Vec<Vec<Slot>>,
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}{} chunk {}", self.phase, self.micro, self.chunk)
    }
}

fn f(micro: usize, chunk: usize) -> Slot {
    Slot {
        phase: Phase::F,
        micro,
        chunk,
    }
}
fn b(micro: usize, chunk: usize) -> Slot {
    Slot {
        phase: Phase::B,
        micro,
        chunk,
    }
}
fn w(micro: usize, chunk: usize) -> Slot {
    Slot {
        phase: Phase::W,
        micro,
        chunk,
    }
}

impl PipelineSchedule {
    /// Builds a schedule for `p` ranks, `m` micro-batches and `v` chunks per rank (`v` ≥ 1;
    /// above 1 for the interleaved schedule only, which then needs `m % p == 0`). Refuses a
    /// schedule beyond the memory budget before allocating it.
    pub fn new(
        kind: ScheduleKind,
        p: usize,
        m: usize,
        v: usize,
    ) -> Result<PipelineSchedule, PipelineError> {
        if p == 0 || m == 0 {
            return Err(PipelineError::Invalid(format!(
                "a pipeline needs at least one stage and one micro-batch (got pp={p}, micro-batches={m})"
            )));
        }
        if v == 0 {
            return Err(PipelineError::Invalid(
                "--virtual-stages: must be at least 1 (found 0)".into(),
            ));
        }
        if v > 1 && kind != ScheduleKind::Interleaved {
            return Err(PipelineError::Invalid(format!(
                "--virtual-stages {v} needs --schedule interleaved (the {} schedule runs one \
                 chunk per pipeline rank)",
                kind.name()
            )));
        }
        // The slots of every rank, before they are allocated.
        crate::model::check_budget(
            crate::model::product(&[3, p as u128, m as u128, v as u128, 64]),
            || format!("pp={p} × {m} micro-batches × {v} virtual stage(s): the schedule"),
        )?;
        if kind == ScheduleKind::Interleaved && v > 1 && m % p != 0 {
            return Err(PipelineError::Invalid(format!(
                "the interleaved schedule needs micro-batches divisible by pp: {m} % {p} != 0"
            )));
        }
        let per_rank = match kind {
            ScheduleKind::ZbH1 => zb_h1_all(p, m),
            _ => (0..p)
                .map(|s| match kind {
                    ScheduleKind::Gpipe => (0..m)
                        .map(|i| f(i, s))
                        .chain((0..m).map(|i| b(i, s)))
                        .collect(),
                    ScheduleKind::Interleaved => interleaved(s, p, m, v),
                    _ => one_f_one_b(s, p, m),
                })
                .collect(),
        };
        Ok(PipelineSchedule {
            kind,
            stages: p,
            micro_batches: m,
            virtual_stages: v,
            per_rank,
        })
    }

    /// Total model chunks `p·v`.
    pub fn chunks(&self) -> usize {
        self.stages * self.virtual_stages
    }

    /// One line: `1f1b schedule, 4 stages × 1 chunk(s), 8 micro-batches: bubble 0.2727
    /// (uniform stages; 0.3750 of the ideal time as Megatron-LM counts it), peak in-flight
    /// micro-batches per stage [4, 3, 2, 1]`.
    pub fn describe(&self) -> Result<String, PipelineError> {
        let r = self.replay(PassCosts::uniform(1.0))?;
        let peaks: Vec<String> = r.peak_in_flight.iter().map(|x| format!("{x}")).collect();
        // Megatron-LM's bubble time fraction is the idle time over the ideal (busy) time,
        // (p − 1)/m for 1F1B; ours is the idle share of the step, (p − 1)/(m + p − 1).
        let b = r.bubble_fraction;
        let megatron = if b < 1.0 {
            b / (1.0 - b)
        } else {
            f64::INFINITY
        };
        Ok(format!(
            "{} schedule, {} stages × {} chunk(s), {} micro-batches: bubble {:.4} (uniform stages; {:.4} of the ideal time as Megatron-LM counts it), peak in-flight micro-batches per stage [{}]",
            self.kind.name(),
            self.stages,
            self.virtual_stages,
            self.micro_batches,
            b,
            megatron,
            peaks.join(", ")
        ))
    }

    /// True when backward passes leave the weight gradients to separate `W` slots.
    pub fn splits_weight_grad(&self) -> bool {
        self.per_rank.iter().flatten().any(|s| s.phase == Phase::W)
    }

    /// Each rank's program: its slots with the transfers around them (an activation is
    /// received before the forward that reads it and sent after the forward that makes it;
    /// gradients likewise backwards), `W` right after `B` where the schedule does not split
    /// them, and each chunk's optimizer step at the end.
    pub fn program(&self) -> Vec<Vec<PipeOp>> {
        let (p, n) = (self.stages, self.chunks());
        let split = self.splits_weight_grad();
        let rank = |c: usize| c % p;
        // The transfer of micro-batch `micro`'s `carry` between chunk `c` and the neighbour
        // chunk `peer`, over the boundary between the two.
        let recv = |carry, micro, c: usize, peer: usize| PipeOp::Recv {
            from: rank(peer),
            carry,
            micro,
            boundary: c.min(peer),
        };
        let send = |carry, micro, c: usize, peer: usize| PipeOp::Send {
            to: rank(peer),
            carry,
            micro,
            boundary: c.min(peer),
        };
        self.per_rank
            .iter()
            .enumerate()
            .map(|(r, slots)| {
                let mut out = Vec::new();
                for &s in slots {
                    let (i, c) = (s.micro, s.chunk);
                    match s.phase {
                        Phase::F => {
                            if c > 0 {
                                out.push(recv(Carry::Act, i, c, c - 1));
                            }
                            out.push(PipeOp::Run(s));
                            if c + 1 < n {
                                out.push(send(Carry::Act, i, c, c + 1));
                            }
                        }
                        Phase::B => {
                            if c + 1 < n {
                                out.push(recv(Carry::Grad, i, c, c + 1));
                            }
                            out.push(PipeOp::Run(s));
                            if !split {
                                out.push(PipeOp::Run(w(i, c)));
                            }
                            if c > 0 {
                                out.push(send(Carry::Grad, i, c, c - 1));
                            }
                        }
                        Phase::W => out.push(PipeOp::Run(s)),
                    }
                }
                out.extend(
                    (0..n)
                        .filter(|&c| rank(c) == r)
                        .map(|chunk| PipeOp::Step { chunk }),
                );
                out
            })
            .collect()
    }

    /// The plan verifier's pipeline check of `program` (one list per rank): every pass of
    /// every (micro-batch, chunk) runs once, on the chunk's rank, in the order F → B → W, the
    /// optimizer step of a chunk after all its passes; a pass runs after the receive of what
    /// it reads and a send after the pass that makes what it sends; every send is received
    /// and every receive sent, in the same order on each rank pair (FIFO); and the ranks
    /// cannot deadlock: executing the programs with blocking receives and buffered sends
    /// runs every instruction.
    pub fn check_program(&self, program: &[Vec<PipeOp>]) -> Result<(), PipelineError> {
        let (p, m, n) = (self.stages, self.micro_batches, self.chunks());
        let bad = |r: usize, k: usize, op: &PipeOp, msg: String| {
            PipelineError::Invalid(format!("pipeline rank {r}, instruction {k} ({op}): {msg}"))
        };
        if program.len() != p {
            return Err(PipelineError::Invalid(format!(
                "the program has {} ranks, the schedule {p}",
                program.len()
            )));
        }
        // Local order: passes once each, on their rank, F → B → W; transfers next to data.
        let mut ran: std::collections::HashMap<(Phase, usize, usize), usize> = Default::default();
        let mut stepped = std::collections::HashSet::new();
        for (r, ops) in program.iter().enumerate() {
            let mut got: std::collections::HashSet<(Carry, usize, usize)> = Default::default();
            for (k, op) in ops.iter().enumerate() {
                match *op {
                    PipeOp::Run(s) => {
                        let (i, c) = (s.micro, s.chunk);
                        if i >= m || c >= n || c % p != r {
                            return Err(bad(r, k, op, format!("not a pass of rank {r}")));
                        }
                        if ran.insert((s.phase, i, c), r).is_some() {
                            return Err(bad(r, k, op, "runs twice".into()));
                        }
                        let before = match s.phase {
                            Phase::F => None,
                            Phase::B => Some(Phase::F),
                            Phase::W => Some(Phase::B),
                        };
                        if let Some(ph) = before {
                            if !ran.contains_key(&(ph, i, c)) {
                                return Err(bad(r, k, op, format!("runs before {ph:?}{i}")));
                            }
                        }
                        let needs = match s.phase {
                            Phase::F if c > 0 => Some((Carry::Act, i, c - 1)),
                            Phase::B if c + 1 < n => Some((Carry::Grad, i, c)),
                            _ => None,
                        };
                        if let Some(x) = needs {
                            if !got.contains(&x) {
                                return Err(bad(r, k, op, "runs before its input arrives".into()));
                            }
                        }
                        if stepped.contains(&c) {
                            return Err(bad(r, k, op, "runs after the optimizer step".into()));
                        }
                    }
                    PipeOp::Recv {
                        carry,
                        micro,
                        boundary,
                        ..
                    } => {
                        got.insert((carry, micro, boundary));
                    }
                    PipeOp::Send {
                        carry,
                        micro,
                        boundary,
                        ..
                    } => {
                        let (ph, c, micro) = match carry {
                            Carry::Act => (Phase::F, boundary, micro),
                            Carry::Grad => (Phase::B, boundary + 1, micro),
                            // The whole gradient: after the chunk's last weight gradient.
                            Carry::Tied => {
                                let last =
                                    (0..m).find(|&i| ran.get(&(Phase::W, i, boundary)) != Some(&r));
                                (Phase::W, boundary, last.unwrap_or(0))
                            }
                        };
                        if ran.get(&(ph, micro, c)) != Some(&r) {
                            return Err(bad(
                                r,
                                k,
                                op,
                                format!("sent before {ph:?}{micro} of chunk {c} made it"),
                            ));
                        }
                    }
                    PipeOp::Step { chunk } => {
                        let all = (0..m).all(|i| {
                            [Phase::F, Phase::B, Phase::W]
                                .iter()
                                .all(|&ph| ran.contains_key(&(ph, i, chunk)))
                        });
                        if chunk % p != r || !all || !stepped.insert(chunk) {
                            return Err(bad(
                                r,
                                k,
                                op,
                                "not once, on its rank, after all the chunk's passes".into(),
                            ));
                        }
                    }
                }
            }
        }
        for ph in [Phase::F, Phase::B, Phase::W] {
            for i in 0..m {
                for c in 0..n {
                    if !ran.contains_key(&(ph, i, c)) {
                        return Err(PipelineError::Invalid(format!(
                            "{ph:?}{i} of chunk {c} never runs"
                        )));
                    }
                }
            }
        }
        if let Some(c) = (0..n).find(|c| !stepped.contains(c)) {
            return Err(PipelineError::Invalid(format!(
                "chunk {c} has no optimizer step"
            )));
        }
        // Global: execute with FIFO channels per rank pair.
        let left = run_program(
            program,
            |r, k, op, got: Option<(Carry, usize, usize)>| match *op {
                PipeOp::Send {
                    to,
                    carry,
                    micro,
                    boundary,
                } => {
                    if to >= p {
                        return Err(bad(r, k, op, "no such rank".into()));
                    }
                    Ok(Some((carry, micro, boundary)))
                }
                PipeOp::Recv {
                    from,
                    carry,
                    micro,
                    boundary,
                } => match got {
                    Some(x) if x == (carry, micro, boundary) => Ok(None),
                    Some((c2, i2, b2)) => Err(bad(
                        r,
                        k,
                        op,
                        format!(
                            "send/recv mismatch: rank {from} sent {} of micro-batch {i2} \
                         (boundary {b2}) first",
                            match c2 {
                                Carry::Act => "the activation",
                                Carry::Grad => "the gradient",
                                Carry::Tied => "the tied gradient",
                            }
                        ),
                    )),
                    None => Ok(None),
                },
                _ => Ok(None),
            },
        )?;
        if let Some(&(a, b, n)) = left.first() {
            return Err(PipelineError::Invalid(format!(
                "rank {a} sends {n} message(s) rank {b} never receives"
            )));
        }
        Ok(())
    }
}

/// Executes per-rank instructions with a FIFO channel per (sender, receiver) pair, buffered
/// sends and blocking receives, ranks taking turns until each is blocked or done:
/// `visit(rank, index, op, received)` sees every instruction once, in each rank's order; a
/// send's visit returns the message it puts on the channel, a receive's gets the one it takes.
/// Returns the messages never received, as (sender, receiver, count); a
/// [`PipelineError::Deadlock`] when ranks wait on each other.
pub fn run_program<M, E: From<PipelineError>>(
    program: &[Vec<PipeOp>],
    mut visit: impl FnMut(usize, usize, &PipeOp, Option<M>) -> Result<Option<M>, E>,
) -> Result<Vec<(usize, usize, usize)>, E> {
    let p = program.len();
    let mut chan: std::collections::BTreeMap<(usize, usize), std::collections::VecDeque<M>> =
        Default::default();
    let mut pc = vec![0usize; p];
    loop {
        let mut progressed = false;
        for r in 0..p {
            while let Some(op) = program[r].get(pc[r]) {
                match *op {
                    PipeOp::Recv { from, .. } => {
                        let Some(msg) = chan.entry((from, r)).or_default().pop_front() else {
                            break;
                        };
                        visit(r, pc[r], op, Some(msg))?;
                    }
                    PipeOp::Send { to, .. } => {
                        if let Some(msg) = visit(r, pc[r], op, None)? {
                            chan.entry((r, to)).or_default().push_back(msg);
                        }
                    }
                    _ => {
                        visit(r, pc[r], op, None)?;
                    }
                }
                pc[r] += 1;
                progressed = true;
            }
        }
        if (0..p).all(|r| pc[r] == program[r].len()) {
            break;
        }
        if !progressed {
            let r = (0..p)
                .find(|&r| pc[r] < program[r].len())
                .expect("invariant: some rank is not done");
            return Err(PipelineError::Deadlock {
                rank: r,
                slot: pc[r],
                what: program[r][pc[r]].to_string(),
            }
            .into());
        }
    }
    Ok(chan
        .into_iter()
        .filter(|(_, q)| !q.is_empty())
        .map(|((a, b), q)| (a, b, q.len()))
        .collect())
}

fn one_f_one_b(s: usize, p: usize, m: usize) -> Vec<Slot> {
    let warm = (p - s - 1).min(m);
    let mut out: Vec<Slot> = (0..warm).map(|i| f(i, s)).collect();
    for i in 0..m - warm {
        out.push(f(warm + i, s));
        out.push(b(i, s));
    }
    out.extend((m - warm..m).map(|i| b(i, s)));
    out
}

/// ZB-H1: the 1F1B order of F and B on every rank; a rank runs a deferred weight-gradient
/// pass W only when its next F or B is not ready yet (filling what 1F1B leaves idle), and the
/// rest at the end. Derived by a greedy replay with F = B = W.
fn zb_h1_all(p: usize, m: usize) -> Vec<Vec<Slot>> {
    let fb: Vec<Vec<Slot>> = (0..p).map(|s| one_f_one_b(s, p, m)).collect();
    let idx = |ph: Phase, i: usize, c: usize| (ph as usize * m + i) * p + c;
    let mut done: Vec<Option<f64>> = vec![None; 3 * m * p];
    let mut next = vec![0usize; p];
    let mut free = vec![0f64; p];
    let mut pending: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); p];
    let mut out: Vec<Vec<Slot>> = vec![Vec::new(); p];
    loop {
        // The rank that can act earliest; an F/B whose input is known, else a pending W.
        let mut best: Option<(f64, usize, bool)> = None;
        for r in 0..p {
            let ready = fb[r].get(next[r]).and_then(
                |&Slot {
                     phase,
                     micro: i,
                     chunk: c,
                 }| match phase {
                    Phase::F if c == 0 => Some(0.0),
                    Phase::F => done[idx(Phase::F, i, c - 1)],
                    Phase::B if c + 1 == p => done[idx(Phase::F, i, c)],
                    _ => done[idx(Phase::B, i, c + 1)]
                        .zip(done[idx(Phase::F, i, c)])
                        .map(|(a, b)| a.max(b)),
                },
            );
            let cand = match ready {
                Some(t) if t <= free[r] || pending[r].is_empty() => {
                    Some((t.max(free[r]), r, false))
                }
                _ if !pending[r].is_empty() => Some((free[r], r, true)),
                _ => None,
            };
            if let Some(c) = cand {
                if best.is_none_or(|b| c.0 < b.0) {
                    best = Some(c);
                }
            }
        }
        let Some((start, r, is_w)) = best else { break };
        let slot = if is_w {
            w(pending[r].pop_front().expect("invariant: pending W"), r)
        } else {
            let s = fb[r][next[r]];
            next[r] += 1;
            if s.phase == Phase::B {
                pending[r].push_back(s.micro);
            }
            s
        };
        free[r] = start + 1.0;
        done[idx(slot.phase, slot.micro, slot.chunk)] = Some(free[r]);
        out[r].push(slot);
    }
    out
}

/// Megatron-LM's interleaved schedule: forward k (0..m·v) runs chunk `(k / p) mod v` of
/// micro-batch `(k / (p·v))·p + k mod p`; backwards visit chunks in reverse.
fn interleaved(s: usize, p: usize, m: usize, v: usize) -> Vec<Slot> {
    let total = m * v;
    let fwd = |k: usize| {
        let group = k / (p * v);
        let local = (k / p) % v;
        (group * p + k % p, local * p + s)
    };
    let bwd = |k: usize| {
        let group = k / (p * v);
        let local = v - 1 - (k / p) % v;
        (group * p + k % p, local * p + s)
    };
    // Megatron-LM: with as many micro-batches as stages, every forward is warm-up.
    let warm = if v == 1 {
        (p - s - 1).min(m)
    } else if m == p {
        total
    } else {
        ((p - s - 1) * 2 + (v - 1) * p).min(total)
    };
    let mut out: Vec<Slot> = (0..warm)
        .map(|k| {
            let (i, c) = fwd(k);
            f(i, c)
        })
        .collect();
    for k in 0..total - warm {
        let (i, c) = fwd(warm + k);
        out.push(f(i, c));
        let (i, c) = bwd(k);
        out.push(b(i, c));
    }
    out.extend((total - warm..total).map(|k| {
        let (i, c) = bwd(k);
        b(i, c)
    }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bubble(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Replay {
        PipelineSchedule::new(kind, p, m, v)
            .unwrap()
            .replay(PassCosts::uniform(1.0))
            .unwrap()
    }

    /// With uniform passes, the bubble of `kind` (`v` chunks per stage) is the textbook
    /// `(p − 1)/(v·m + p − 1)`.
    fn assert_textbook_bubble(kind: ScheduleKind, p: usize, m: usize, v: usize) {
        let want = (p - 1) as f64 / (v * m + p - 1) as f64;
        let got = bubble(kind, p, m, v).bubble_fraction;
        assert!(
            (got - want).abs() < 1e-9,
            "{kind:?} p={p} v={v} m={m}: {got} vs {want}"
        );
    }

    #[test]
    fn gpipe_and_1f1b_bubble_is_textbook() {
        for p in 1..=6 {
            for m in 1..=8 {
                for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
                    assert_textbook_bubble(kind, p, m, 1);
                }
            }
        }
    }

    #[test]
    fn interleaved_bubble_is_textbook() {
        for p in [2, 3, 4] {
            for v in [1, 2, 3] {
                for m in [p, 2 * p, 3 * p] {
                    assert_textbook_bubble(ScheduleKind::Interleaved, p, m, v);
                }
            }
        }
    }

    #[test]
    fn in_flight_micro_batches() {
        for p in 1..=5 {
            for m in 1..=8 {
                let g = bubble(ScheduleKind::Gpipe, p, m, 1);
                assert_eq!(g.peak_in_flight[0], m as f64);
                let o = bubble(ScheduleKind::OneFOneB, p, m, 1);
                assert_eq!(o.peak_in_flight[0], p.min(m) as f64, "p={p} m={m}");
                assert!(o.peak_in_flight.iter().all(|&x| x <= p as f64));
            }
        }
    }

    #[test]
    fn zero_bubble_beats_1f1b_at_the_same_memory() {
        for p in [2, 4] {
            for m in [4, 8] {
                let zb = bubble(ScheduleKind::ZbH1, p, m, 1);
                let one = bubble(ScheduleKind::OneFOneB, p, m, 1);
                assert!(
                    zb.bubble_fraction < one.bubble_fraction,
                    "p={p} m={m}: {} vs {}",
                    zb.bubble_fraction,
                    one.bubble_fraction
                );
                assert_eq!(zb.peak_in_flight[0], one.peak_in_flight[0]);
                eprintln!(
                    "p={p} m={m}: zb-h1 {:.3} vs 1f1b {:.3}",
                    zb.bubble_fraction, one.bubble_fraction
                );
            }
        }
    }

    #[test]
    fn programs_of_every_schedule_pass_the_check() {
        for kind in ScheduleKind::ALL {
            for p in 1..=4 {
                for m in 1..=8 {
                    for v in [1, 2, 3] {
                        let Ok(s) = PipelineSchedule::new(kind, p, m, v) else {
                            continue;
                        };
                        let prog = s.program();
                        s.check_program(&prog)
                            .unwrap_or_else(|e| panic!("{kind:?} p={p} m={m} v={v}: {e}"));
                        // Every send has its receive: one pair per boundary and direction.
                        let sends = prog
                            .iter()
                            .flatten()
                            .filter(|o| matches!(o, PipeOp::Send { .. }));
                        assert_eq!(sends.count(), 2 * m * (s.chunks() - 1));
                    }
                }
            }
        }
    }

    #[test]
    fn the_program_check_finds_mismatches_deadlocks_and_missing_passes() {
        let s = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        let good = s.program();
        // Rank 1 receives micro-batch 1 before micro-batch 0: a FIFO mismatch.
        let mut swapped = good.clone();
        let recvs: Vec<usize> = (0..swapped[1].len())
            .filter(|&k| {
                matches!(
                    swapped[1][k],
                    PipeOp::Recv {
                        carry: Carry::Act,
                        ..
                    }
                )
            })
            .collect();
        let (a, b) = (recvs[0], recvs[1]);
        let (x, y) = (swapped[1][a], swapped[1][b]);
        swapped[1][a] = y;
        swapped[1][b] = x;
        let e = s.check_program(&swapped).unwrap_err().to_string();
        assert!(
            e.contains("runs before its input arrives") || e.contains("mismatch"),
            "{e}"
        );
        // Rank 0 holds back its activations until the end: it waits for a gradient that
        // needs them, rank 1 for the activations — a deadlock.
        let mut dead = good.clone();
        let (sends, rest): (Vec<PipeOp>, Vec<PipeOp>) = dead[0]
            .iter()
            .partition(|o| matches!(o, PipeOp::Send { .. }));
        dead[0] = rest.into_iter().chain(sends).collect();
        let e = s.check_program(&dead).unwrap_err();
        assert!(matches!(e, PipelineError::Deadlock { rank: 0, .. }), "{e}");
        // A dropped receive leaves a message unread (or starves a pass).
        let mut dropped = good.clone();
        let k = dropped[1]
            .iter()
            .rposition(|o| matches!(o, PipeOp::Recv { .. }))
            .unwrap();
        dropped[1].remove(k);
        assert!(s.check_program(&dropped).is_err());
        // A missing optimizer step.
        let mut no_step = good;
        no_step[1].pop();
        assert!(s.check_program(&no_step).is_err());
    }

    #[test]
    fn a_bad_order_is_a_deadlock() {
        let mut s = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        // The last stage runs B1 before F1: it waits on itself.
        s.per_rank[1] = vec![f(0, 1), b(1, 1), f(1, 1), b(0, 1)];
        let e = s.replay(PassCosts::uniform(1.0)).unwrap_err();
        assert!(matches!(e, PipelineError::Deadlock { .. }), "{e}");
        assert!(e.to_string().contains("waits at slot"), "{e}");
    }

    #[test]
    fn balance_and_override() {
        assert_eq!(balance(&[1.0; 32], 4).unwrap(), vec![8, 8, 8, 8]);
        // Embedding and head make the outer stages heavier.
        let mut c = vec![1.0; 30];
        c[0] += 1.0;
        c[29] += 1.5;
        let s = balance(&c, 4).unwrap();
        assert_eq!(s.iter().sum::<usize>(), 30);
        assert!(s[0] < s[1] && s[3] < s[2], "{s:?}");
        assert!(balance(&[1.0; 3], 4).is_err());
        // Splits with the same bottleneck: the even one (not 1 + 3 + 3 + 3 + 2).
        let mut c = vec![1.0; 11];
        c.push(1.2);
        assert_eq!(balance(&c, 4).unwrap(), vec![3, 3, 3, 3]);
        // A minimal bottleneck first, then the spread.
        let mut c = vec![1.0; 80];
        c.push(1.24);
        let mut s = balance(&c, 8).unwrap();
        s.sort();
        assert_eq!(s, vec![10, 10, 10, 10, 10, 10, 10, 11]);
        assert_eq!(
            parse_stage_layers("9,8,8,7", 32, 4).unwrap(),
            vec![9, 8, 8, 7]
        );
        assert!(parse_stage_layers("9,8,8", 32, 4).is_err());
        assert!(parse_stage_layers("9,8,8,8", 32, 4)
            .unwrap_err()
            .to_string()
            .contains("33"));
    }

    #[test]
    fn diagram_shows_idle_slots() {
        let r = bubble(ScheduleKind::OneFOneB, 2, 2, 1);
        let d = r.diagram(2, 1.0, false);
        assert_eq!(d.lines().count(), 2);
        assert!(d.lines().nth(1).unwrap().starts_with("stage 1 | ."), "{d}");
        assert!(d.contains("B1"));
    }
}
