//! What the communicator tests share: seeded inputs, the naive (sequential rank-order)
//! reductions they are checked against, the (count, op) cases, and a thread per rank (the
//! GPU communicator tests and the CPU kernel tests' two-rank runs use that too).

#![allow(dead_code)]

use shardc_runtime::comm::{CommError, ReduceOp};
use std::thread;
use std::time::Duration;

pub const COUNTS: [usize; 7] = [0, 1, 3, 7, 50, 783, 4097];
pub const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Avg,
];
/// Generous: only a failing test ever waits this long.
pub const LONG: Duration = Duration::from_secs(20);

/// xorshift64*: a tiny seeded RNG.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [lo, hi).
    pub fn f32_in(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

/// Rank `rank`'s input for case `case`: values near ±1 for `Prod` so products stay tame.
pub fn input(case: usize, rank: usize, len: usize, op: ReduceOp) -> Vec<f32> {
    let mut rng = Rng::new(case as u64 * 1000 + rank as u64 + 1);
    (0..len)
        .map(|_| match op {
            ReduceOp::Prod => {
                let sign = if rng.next() & 1 == 0 { 1.0 } else { -1.0 };
                sign * rng.f32_in(0.5, 1.5)
            }
            _ => rng.f32_in(-2.0, 2.0),
        })
        .collect()
}

/// Every rank's input for case `case` on a group of `size`.
pub fn inputs(case: usize, size: usize, len: usize, op: ReduceOp) -> Vec<Vec<f32>> {
    (0..size).map(|r| input(case, r, len, op)).collect()
}

/// Sequential rank-order reduction of `inputs`.
pub fn naive(op: ReduceOp, inputs: &[Vec<f32>]) -> Vec<f32> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        for (a, b) in acc.iter_mut().zip(x) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => *a + b,
                ReduceOp::Prod => *a * b,
                ReduceOp::Max => a.max(*b),
                ReduceOp::Min => a.min(*b),
            };
        }
    }
    if op == ReduceOp::Avg {
        acc.iter_mut().for_each(|a| *a /= inputs.len() as f32);
    }
    acc
}

/// Every (count, op) case.
pub fn cases() -> Vec<(usize, ReduceOp)> {
    COUNTS
        .iter()
        .flat_map(|&len| OPS.iter().map(move |&op| (len, op)))
        .collect()
}

/// Runs `body(item)` for every item (a rank's communicator, or what it is built from), each
/// in its own thread; the results in item order.
pub fn on_threads<T: Send, R: Send>(
    items: impl IntoIterator<Item = T>,
    body: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    let body = &body;
    thread::scope(|s| {
        let handles: Vec<_> = items
            .into_iter()
            .map(|t| s.spawn(move || body(t)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// The bit patterns of `v`, for exact comparisons.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Checks each rank's `(error, elapsed)`: an [`CommError::Aborted`] naming that rank, whose
/// reason holds every needle, within 5 s of the abort.
pub fn assert_aborted_promptly(outs: Vec<(CommError, Duration)>, needles: &[&str]) {
    for (rank, (err, elapsed)) in outs.into_iter().enumerate() {
        let CommError::Aborted {
            rank: r,
            ref reason,
            ..
        } = err
        else {
            panic!("rank {rank}: expected Aborted, got {err}");
        };
        assert_eq!(r, rank);
        for n in needles {
            assert!(reason.contains(n), "`{n}` not in: {reason}");
        }
        assert!(
            elapsed < Duration::from_secs(5),
            "rank {rank} took {elapsed:?}"
        );
    }
}

/// Checks rank `rank`'s timeout `err`: its message holds every part, and it came after the
/// group's `timeout` (and within 1.5 s of it).
pub fn assert_timed_out(
    rank: usize,
    err: &CommError,
    elapsed: Duration,
    timeout: Duration,
    parts: &[&str],
) {
    let msg = err.to_string();
    for part in parts {
        assert!(msg.contains(part), "`{msg}` lacks `{part}`");
    }
    assert!(elapsed >= timeout, "rank {rank} gave up early: {elapsed:?}");
    assert!(
        elapsed < timeout + Duration::from_millis(1500),
        "rank {rank} too slow: {elapsed:?}"
    );
}
