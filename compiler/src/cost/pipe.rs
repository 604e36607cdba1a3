//! The analytic training model's pipeline schedule: which of the compiler's schedules
//! ([`crate::schedule::pp`]: GPipe, 1F1B, Megatron-LM's interleaved 1F1B with `v` model chunks
//! per stage, ZB-H1) a step runs. It builds that schedule; the schedule module's one replay
//! ([`PipelineSchedule::replay_with`]) times it with the model's per-(stage, chunk, pass)
//! durations and point-to-point transfer time.

use super::CostError;
use crate::schedule::pp::{PipelineSchedule, ScheduleKind};
use serde::{Deserialize, Serialize};

/// A pipeline schedule of the analytic training model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PipeSchedule {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward one backward (PipeDream-Flush).
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B with this many model chunks per stage.
    Interleaved(usize),
    /// Zero-bubble ZB-H1: 1F1B with each backward split into its input gradient (`B`) and its
    /// weight gradient (`W`), the `W` passes deferred into what 1F1B leaves idle.
    ZbH1,
}

impl PipeSchedule {
    /// Model chunks per stage.
    pub fn chunks(self) -> usize {
        match self {
            PipeSchedule::Interleaved(v) => v.max(1),
            _ => 1,
        }
    }

    /// The compiler's kind of this schedule.
    pub fn kind(self) -> ScheduleKind {
        match self {
            PipeSchedule::Gpipe => ScheduleKind::Gpipe,
            PipeSchedule::OneFOneB => ScheduleKind::OneFOneB,
            PipeSchedule::Interleaved(_) => ScheduleKind::Interleaved,
            PipeSchedule::ZbH1 => ScheduleKind::ZbH1,
        }
    }

    /// The schedule of `kind` (`v` chunks per stage for the interleaved one; ignored by the
    /// others).
    pub fn of(kind: ScheduleKind, v: usize) -> PipeSchedule {
        match kind {
            ScheduleKind::Gpipe => PipeSchedule::Gpipe,
            ScheduleKind::OneFOneB => PipeSchedule::OneFOneB,
            ScheduleKind::Interleaved => PipeSchedule::Interleaved(v),
            ScheduleKind::ZbH1 => PipeSchedule::ZbH1,
        }
    }

    /// The report's name: `gpipe`, `1f1b`, `interleaved(v=2)`, `zb-h1`.
    pub fn label(self) -> String {
        match self {
            PipeSchedule::Interleaved(v) => format!("interleaved(v={v})"),
            s => s.kind().name().to_string(),
        }
    }

    /// Its slots on `p` stages for `m` micro-batches.
    pub fn build(self, p: usize, m: usize) -> Result<PipelineSchedule, CostError> {
        PipelineSchedule::new(self.kind(), p, m, self.chunks())
            .map_err(|e| CostError::Train(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_compiler_schedule_has_an_analytic_one() {
        for kind in ScheduleKind::ALL {
            let s = PipeSchedule::of(kind, 2);
            assert_eq!(s.kind(), kind);
            let built = s.build(4, 8).unwrap();
            assert_eq!(built.virtual_stages, s.chunks());
        }
        assert_eq!(PipeSchedule::Interleaved(3).label(), "interleaved(v=3)");
        assert_eq!(PipeSchedule::ZbH1.label(), "zb-h1");
        // The interleaved schedule needs whole rounds of micro-batches.
        assert!(PipeSchedule::Interleaved(2).build(4, 6).is_err());
    }
}
