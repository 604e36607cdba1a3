//! Replaying a pipeline-parallel training plan on a cluster: every instruction of every
//! pipeline rank is timed from the values the plan lists for it (each chunk program's
//! kernels and in-stage collectives, replayed over the stage mesh like a forward plan), then
//! the instructions run per pipeline rank in order: a pass as soon as the rank is free, a
//! receive when the matching send's transfer has arrived (point-to-point over the `pp` axis's
//! links), sends asynchronous. Memory per stage: the plan's parameter, gradient and optimizer
//! accounting per chunk plus the activations its instructions hold
//! ([`crate::train::activation_peaks`]) at the simulated dtype.

use super::collective::{collective_time, CollectiveKind, GroupTopology};
use super::memory::MemoryBreakdown;
use super::program::Program;
use super::replay::{replay, Topology};
use super::report::{SimReport, Simulation, Slice, StageReport, Timeline};
use super::roofline::{sim_bytes, ComputeOptions};
use super::simulate::{axis_collective_time, check_gpus, rank_labels};
use super::units::Bytes;
use super::{Cluster, CostError};
use crate::ir::{Graph, ValueId};
use crate::plan::Plan;
use crate::schedule::pp::{run_program, Carry, Phase, PipeOp};

/// One pass of a chunk (or its optimizer step) on one rank: its time, FLOPs, and the time of
/// its collectives, all of it and the part compute does not hide.
#[derive(Clone, Copy, Debug, Default)]
struct PassTime {
    time: f64,
    flops: f64,
    comm: f64,
    exposed: f64,
}

impl PassTime {
    /// What `self` (a pair of passes timed together) adds to `first`.
    fn minus(&self, first: &PassTime) -> PassTime {
        PassTime {
            time: (self.time - first.time).max(0.0),
            flops: self.flops - first.flops,
            comm: (self.comm - first.comm).max(0.0),
            exposed: (self.exposed - first.exposed).max(0.0),
        }
    }
}

/// Replays pipeline plan `plan` (one with a schedule) on `cluster`.
pub fn simulate_pipeline_plan(
    plan: &Plan,
    cluster: &Cluster,
    opts: &ComputeOptions,
) -> Result<Simulation, CostError> {
    let sched = plan
        .pipeline
        .as_ref()
        .ok_or_else(|| CostError::Replay("the plan has no pipeline schedule".into()))?;
    plan.check_pipeline()
        .map_err(|e| CostError::Replay(e.to_string()))?;
    let mesh = &plan.mesh;
    check_gpus(mesh, cluster)?;
    let (p, m) = (sched.stages, sched.micro_batches);
    let stage_mesh = mesh.without_axis("pp");
    let topo = Topology::new(&stage_mesh, cluster);
    let dev = &cluster.device;
    let comm = |axis: &str, kind: CollectiveKind, bytes: u64| {
        axis_collective_time(cluster, &stage_mesh, axis, kind, bytes)
    };
    let chunks = plan
        .chunk_graphs()
        .map_err(|e| CostError::Replay(e.to_string()))?;
    let steps: Vec<_> = plan
        .chunks
        .iter()
        .map(|c| crate::schedule::schedule(&c.program))
        .collect();
    // Duration and FLOPs (per rank) of each chunk's passes (`F`, `B`, `W`: the same for every
    // micro-batch) and of its optimizer step.
    let time = |g: &Graph, steps: &[crate::schedule::Step], keep: &[bool]| {
        let prog = Program::from_steps(g, steps, dev, opts, &|v| keep[v.index()], &comm);
        let rep = replay(&prog, &topo, cluster, false)?;
        let r = &rep.ranks[rep.critical_rank()];
        Ok::<_, CostError>(PassTime {
            time: rep.end().0,
            flops: prog.flops(),
            comm: r.comm.0,
            exposed: r.exposed_comm().0.min(r.comm.0),
        })
    };
    let mut passes: Vec<[PassTime; 3]> = Vec::with_capacity(plan.chunks.len());
    let mut paired_w: Vec<PassTime> = Vec::with_capacity(plan.chunks.len());
    let mut optimizer: Vec<PassTime> = Vec::with_capacity(plan.chunks.len());
    for (c, ch) in plan.chunks.iter().enumerate() {
        let g = &ch.program;
        let lists = &plan.pipeline_nodes[c];
        let mut d = [PassTime::default(); 3];
        let mut keep = vec![false; g.len()];
        for (k, list) in lists.iter().enumerate() {
            keep.fill(false);
            for v in list {
                keep[v.index()] = true;
            }
            d[k] = time(g, &steps[c], &keep)?;
        }
        // A weight-gradient pass right after its backward (schedules that do not split them)
        // runs with it as one pass on the GPU: the backward's collectives overlap the
        // weight-gradient GEMMs. Time the pair and give W what the pair adds.
        for v in &lists[1] {
            keep[v.index()] = true;
        }
        let both = time(g, &steps[c], &keep)?;
        paired_w.push(both.minus(&d[1]));
        passes.push(d);
        let st = ch.step.as_ref().map(|s| (&s.program, &s.steps));
        optimizer.push(match st {
            Some((g, steps)) => time(g, steps, &vec![true; g.len()])?,
            None => PassTime::default(),
        });
    }
    let mut dur: Vec<Vec<PassTime>> = Vec::with_capacity(p);
    for ops in &plan.pipeline_program {
        let mut d: Vec<PassTime> = Vec::with_capacity(ops.len());
        for (k, op) in ops.iter().enumerate() {
            d.push(match *op {
                PipeOp::Run(s) => {
                    let after_b = k.checked_sub(1).map(|j| ops[j]).is_some_and(|o| {
                        matches!(o, PipeOp::Run(b) if b.phase == Phase::B
                            && (b.micro, b.chunk) == (s.micro, s.chunk))
                    });
                    if s.phase == Phase::W && after_b {
                        paired_w[s.chunk]
                    } else {
                        passes[s.chunk][crate::train::phase_index(s.phase)]
                    }
                }
                PipeOp::Step { chunk } => optimizer[chunk],
                _ => PassTime::default(),
            });
        }
        dur.push(d);
    }

    // The pipeline: instructions in order per rank, FIFO transfers per rank pair.
    let pp_link = GroupTopology::of_axis(mesh, "pp", cluster);
    let transfer = |c: usize, carry: Carry| -> (f64, u64) {
        let g: &Graph = chunks[c].micro;
        let bytes = crate::train::sent_value(&chunks[c], carry)
            .map_or(0.0, |v: ValueId| sim_bytes(g.ty(v), opts.dtype));
        let t = collective_time(
            cluster,
            CollectiveKind::SendRecv,
            Bytes(bytes as u64),
            pp_link,
        );
        (t.0, bytes as u64)
    };
    let mut now = vec![0.0f64; p];
    let mut busy = vec![0.0f64; p];
    let mut p2p_wait = vec![0.0f64; p];
    // Collective time inside each rank's passes, and the part of it not hidden by compute.
    let mut pass_comm = vec![0.0f64; p];
    let mut pass_exposed = vec![0.0f64; p];
    let mut slices: Vec<Vec<Slice>> = vec![Vec::new(); p];
    // A message is (arrival, transfer time).
    run_program::<(f64, f64), CostError>(&plan.pipeline_program, |r, k, op, got| {
        let mut pass = |name: String, cat: &str, now: &mut f64| {
            let PassTime {
                time: d,
                flops,
                comm,
                exposed,
            } = dur[r][k];
            pass_comm[r] += comm;
            pass_exposed[r] += exposed;
            slices[r].push(Slice {
                track: 0,
                name,
                cat: cat.into(),
                start: *now,
                dur: d,
                bytes: 0,
                flops,
            });
            *now += d;
            busy[r] += d;
        };
        match *op {
            PipeOp::Recv { .. } => {
                if let Some((arrival, t)) = got.filter(|&(a, _)| a > now[r]) {
                    // The wait the transfer itself adds (the rest is the pipeline's).
                    p2p_wait[r] += (arrival - now[r]).min(t);
                    now[r] = arrival;
                }
                Ok(None)
            }
            PipeOp::Send {
                carry, boundary, ..
            } => {
                // (A tied copy's gradient is the micro-batches' sum, complete by now.)
                let (t, bytes) = transfer(carry.sender(boundary), carry);
                slices[r].push(Slice {
                    track: 1,
                    name: op.to_string(),
                    cat: "p2p".into(),
                    start: now[r],
                    dur: t,
                    bytes,
                    flops: 0.0,
                });
                Ok(Some((now[r] + t, t)))
            }
            PipeOp::Run(_) | PipeOp::Step { .. } => {
                pass(op.to_string(), op.category(), &mut now[r]);
                Ok(None)
            }
        }
    })?;
    let step = now.iter().cloned().fold(0.0, f64::max);

    // Memory per stage at the simulated dtype.
    let act = crate::train::activation_peaks(
        &chunks,
        &plan.pipeline_program,
        &plan.pipeline_nodes,
        opts.dtype.size_bytes() as f64,
    );
    let stage_world = stage_mesh.world_size();
    let in_flight = sched
        .replay(crate::schedule::pp::PassCosts::uniform(1.0))
        .map(|r| r.peak_in_flight)
        .unwrap_or_default();
    let mut stages = Vec::with_capacity(p);
    let mut total_flops = 0.0;
    for r in 0..p {
        let mut mem = MemoryBreakdown {
            activations: Bytes(act[r]),
            ..MemoryBreakdown::default()
        };
        let mut layers = 0;
        for c in plan.chunks.iter().filter(|c| c.stage == r) {
            layers += c.layers[1] - c.layers[0];
            match &c.memory.train {
                Some(t) => {
                    mem.params += Bytes(t.param_bytes);
                    mem.grads += Bytes(t.grad_bytes);
                    mem.optimizer += Bytes(t.optimizer_bytes);
                    mem.comm_buffers += Bytes(t.comm_buffer_bytes);
                }
                None => mem.params += Bytes(c.memory.param_bytes),
            }
        }
        total_flops += dur[r].iter().map(|d| d.flops).sum::<f64>() * stage_world as f64;
        let p2p_exposed: f64 = p2p_wait[r].min(step);
        stages.push(StageReport {
            stage: r,
            layers,
            end_s: now[r],
            busy_s: busy[r],
            bubble_s: (step - busy[r]).max(0.0),
            p2p_exposed_s: p2p_exposed,
            dp_sync_exposed_s: 0.0,
            peak_in_flight: in_flight.get(r).map_or(0, |x| x.ceil() as usize),
            memory: mem,
        });
    }
    let world = mesh.world_size();
    let (worst, peak_mem) = stages.iter().map(|s| s.memory.total()).enumerate().fold(
        (0, Bytes::ZERO),
        |acc, (i, b)| if b > acc.1 { (i, b) } else { acc },
    );
    let memory = stages.get(worst).map(|s| s.memory).unwrap_or_default();
    let bubble = if step > 0.0 {
        1.0 - busy.iter().sum::<f64>() / (p as f64 * step)
    } else {
        0.0
    };
    let peak = dev.peak(opts.dtype);
    let tokens = (plan.model.batch * plan.model.seq) as f64;
    let crit = (0..p)
        .max_by(|&a, &b| busy[a].total_cmp(&busy[b]))
        .unwrap_or(0);
    let device_memory = dev.memory();
    let base = super::simulate::plan_report(plan, cluster, opts).with_throughput(
        step,
        tokens,
        total_flops,
        total_flops,
        peak,
    );
    let report = SimReport {
        mode: "pipeline".into(),
        schedule: Some(sched.kind.name().into()),
        micro_batches: Some(m),
        compute_s: busy[crit] - pass_exposed[crit],
        comm_s: pass_comm[crit] + p2p_wait[crit],
        exposed_comm_s: pass_exposed[crit] + p2p_wait[crit],
        hidden_comm_s: (pass_comm[crit] - pass_exposed[crit]).max(0.0),
        bubble_fraction: bubble,
        pipeline_s: step,
        optimizer_s: 0.0,
        peak_memory_bytes_per_rank: peak_mem.0,
        peak_memory_rank: worst,
        memory_breakdown: memory,
        device_memory_bytes: device_memory.0,
        fits: peak_mem <= device_memory,
        stages,
        ..base
    };
    let timelines: Vec<Timeline> = slices
        .into_iter()
        .map(|s| Timeline {
            tracks: vec!["compute".into(), "p2p".into()],
            slices: s,
            memory: Vec::new(),
        })
        .collect();
    let pp = mesh.axis("pp").map_or(0, |a| a.0 as usize);
    let rank_timeline = (0..world)
        .map(|r| mesh.coords(r).get(pp).copied().unwrap_or(0) as u32)
        .collect();
    Ok(Simulation {
        report,
        timelines,
        rank_timeline,
        rank_labels: rank_labels(mesh),
    })
}
