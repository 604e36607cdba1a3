//! `shardc schedule`: a pipeline schedule as a text diagram (one row per stage, F/B/W per
//! micro-batch, idle as dots), its bubble fraction and peak in-flight micro-batches, and a
//! Perfetto trace.

use super::args::at_least;
use anyhow::{bail, Context};
use clap::Args;
use shardc::compiler::model::{check_budget, schedule_bytes};
use shardc::compiler::plan::Plan;
use shardc::compiler::schedule::pp::{PassCosts, PipeOp, PipelineSchedule, ScheduleKind};
use shardc::runtime::output::Outputs;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ScheduleArgs {
    /// A plan with a pipeline schedule (else the schedule is built from the flags).
    plan: Option<PathBuf>,
    /// Pipeline stages [default: 4].
    #[arg(long)]
    pp: Option<usize>,
    /// Micro-batches per step [default: 8].
    #[arg(long)]
    micro_batches: Option<usize>,
    /// gpipe, 1f1b, interleaved or zb-h1 [default: 1f1b].
    #[arg(long)]
    schedule: Option<String>,
    /// Model chunks per stage (interleaved) [default: 2].
    #[arg(long)]
    virtual_stages: Option<usize>,
    /// Write a Chrome/Perfetto trace here.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Allow `--trace` to replace a file this command reads (still atomically).
    #[arg(long)]
    overwrite: bool,
}

/// The schedule the flags describe, checked: sizes ≥ 1, virtual stages for the interleaved
/// schedule only, the schedule and its diagram within the memory budget.
fn from_flags(a: &ScheduleArgs) -> anyhow::Result<PipelineSchedule> {
    let kind = ScheduleKind::from_name(a.schedule.as_deref().unwrap_or("1f1b"))?;
    let (p, m) = (a.pp.unwrap_or(4), a.micro_batches.unwrap_or(8));
    at_least("--pp", p, 1)?;
    at_least("--micro-batches", m, 1)?;
    let v = match (kind, a.virtual_stages) {
        (ScheduleKind::Interleaved, v) => v.unwrap_or(2),
        (_, None) => 1,
        (_, Some(v)) if v <= 1 => v,
        (_, Some(v)) => bail!(
            "--virtual-stages {v} applies to --schedule interleaved (the {} schedule runs one \
             chunk per pipeline rank)",
            kind.name()
        ),
    };
    at_least("--virtual-stages", v, 1)?;
    check_budget(schedule_bytes(p, m, v, a.trace.is_some()), || {
        format!(
            "--pp {p} × --micro-batches {m} × --virtual-stages {v}: the schedule and its diagram"
        )
    })?;
    Ok(PipelineSchedule::new(kind, p, m, v)?)
}

pub fn run(a: ScheduleArgs) -> anyhow::Result<()> {
    let outputs = Outputs::new(a.overwrite).inputs([a.plan.as_deref()]);
    if let Some(t) = &a.trace {
        outputs.check_file("--trace", t)?;
    }
    let sched = match &a.plan {
        Some(p) => {
            let given = [
                (a.pp.is_some(), "--pp"),
                (a.micro_batches.is_some(), "--micro-batches"),
                (a.schedule.is_some(), "--schedule"),
                (a.virtual_stages.is_some(), "--virtual-stages"),
            ];
            if let Some((_, f)) = given.iter().find(|(g, _)| *g) {
                bail!(
                    "{f} describes a schedule to build; {} carries its own (drop {f} or the plan)",
                    p.display()
                );
            }
            // Loading verifies the plan, its pipeline program included.
            let plan = Plan::load(p).with_context(|| format!("reading {}", p.display()))?;
            let sched = plan.pipeline.clone().with_context(|| {
                format!(
                    "{} has no pipeline schedule (its mesh has no pp axis)",
                    p.display()
                )
            })?;
            let pairs = plan
                .pipeline_program
                .iter()
                .flatten()
                .filter(|o| matches!(o, PipeOp::Send { .. }))
                .count();
            println!(
                "{}: mesh {}, {} chunks; verified: {pairs} send/recv pairs matched in order, no deadlock, boundary types agree",
                p.display(),
                plan.mesh,
                plan.chunks.len()
            );
            for ch in &plan.chunks {
                println!(
                    "  {} ({} parameter bytes per rank)",
                    ch.placement(),
                    ch.memory.param_bytes
                );
            }
            sched
        }
        None => from_flags(&a)?,
    };
    let replay = sched.replay(PassCosts::uniform(1.0))?;
    let unit = 1.0 / sched.virtual_stages as f64;
    println!(
        "{} schedule: {} stages, {} micro-batches{}; forward = 1 unit per stage, backward = 2{}",
        sched.kind.name(),
        sched.stages,
        sched.micro_batches,
        if sched.virtual_stages > 1 {
            format!(", {} chunks per stage", sched.virtual_stages)
        } else {
            String::new()
        },
        if sched.kind == ScheduleKind::ZbH1 {
            " (B = 1 input-gradient + W = 1 weight-gradient)"
        } else {
            ""
        }
    );
    println!(
        "{}",
        replay.diagram(sched.stages, unit, sched.virtual_stages > 1)
    );
    let peaks: Vec<String> = replay
        .peak_in_flight
        .iter()
        .map(|x| format!("{x}"))
        .collect();
    println!(
        "makespan {} units, bubble fraction {:.4}, peak in-flight micro-batches per stage [{}]",
        replay.makespan,
        replay.bubble_fraction,
        peaks.join(", ")
    );
    if let Some(t) = &a.trace {
        // One unit = 1 ms in the trace.
        let json = replay.trace_events(sched.stages, 1000.0);
        outputs.write("--trace", t, serde_json::to_string(&json)?.as_bytes())?;
        println!("wrote {} (open in https://ui.perfetto.dev)", t.display());
    }
    Ok(())
}
