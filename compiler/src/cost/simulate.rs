//! Layer (a) of the simulator: a compiled plan replayed over every rank (a training plan's
//! micro-batch program once per micro-batch, then its step program), and the memory of a
//! forward plan (what `compile`'s fit check uses).

use super::collective::{collective_time, CollectiveKind, GroupTopology};
use super::memory::MemoryBreakdown;
use super::profile::Cluster;
use super::program::{ProgKind, Program};
use super::replay::{replay, RankReplay, Replay, Topology};
use super::report::{SimReport, Simulation, Slice, Timeline};
use super::roofline::{sim_bytes, ComputeOptions};
use super::units::{Bytes, Seconds};
use super::CostError;
use crate::ir::{DType, Op, ValueId};
use crate::plan::Plan;
use crate::shard::Mesh;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// Memory of each rank of a forward plan at `dtype` (`f32` values costed at `dtype`):
/// parameters, and the activation arena scaled from the plan's `f32` arena.
pub fn forward_plan_memory(plan: &Plan, dtype: DType) -> MemoryBreakdown {
    let g = &plan.program;
    let params: f64 = g.params().map(|v| sim_bytes(g.ty(v), dtype)).sum();
    let scale = dtype.size_bytes() as f64 / DType::F32.size_bytes() as f64;
    MemoryBreakdown {
        params: Bytes(params as u64),
        activations: Bytes((plan.memory.activation_arena_bytes as f64 * scale) as u64),
        ..MemoryBreakdown::default()
    }
}

/// Time of one collective of `bytes` over the group of `mesh`'s axis `axis`: what a plan's
/// collectives take in the replay of its programs.
pub(crate) fn axis_collective_time(
    cluster: &Cluster,
    mesh: &Mesh,
    axis: &str,
    kind: CollectiveKind,
    bytes: u64,
) -> Seconds {
    collective_time(
        cluster,
        kind,
        Bytes(bytes),
        GroupTopology::of_axis(mesh, axis, cluster),
    )
}

/// Checks that the cluster has the mesh's GPUs.
pub(crate) fn check_gpus(mesh: &Mesh, cluster: &Cluster) -> Result<(), CostError> {
    let world = mesh.world_size();
    if world > cluster.gpus() {
        return Err(CostError::TooFewGpus {
            mesh: mesh.to_string(),
            needed: world,
            cluster: cluster.label(),
            available: cluster.gpus(),
            name: cluster.profile.name.clone(),
            nodes: world.div_ceil(cluster.gpus_per_node()),
        });
    }
    Ok(())
}

/// `dp=0,tp=3` for each rank.
pub(crate) fn rank_labels(mesh: &Mesh) -> Vec<String> {
    (0..mesh.world_size())
        .map(|r| mesh.coords_label(r))
        .collect()
}

fn signature(r: &RankReplay) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for o in &r.ops {
        (o.op, o.start.to_bits(), o.end.to_bits()).hash(&mut h);
    }
    for &(t, b) in &r.memory {
        (t.to_bits(), b).hash(&mut h);
    }
    h.finish()
}

/// Distinct rank timelines of a replay, and each rank's index into them.
pub(crate) fn timelines(
    program: &Program,
    rep: &Replay,
    base_memory: u64,
) -> (Vec<Timeline>, Vec<u32>) {
    let mut by_sig: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut reps: Vec<usize> = Vec::new();
    let mut of = Vec::with_capacity(rep.ranks.len());
    for (r, rr) in rep.ranks.iter().enumerate() {
        let sig = signature(rr);
        let cands = by_sig.entry(sig).or_default();
        let found = cands.iter().copied().find(|&t| {
            let o = &rep.ranks[reps[t]];
            o.ops == rr.ops && o.memory == rr.memory
        });
        match found {
            Some(t) => of.push(t as u32),
            None => {
                cands.push(reps.len());
                of.push(reps.len() as u32);
                reps.push(r);
            }
        }
    }
    let tls = reps
        .iter()
        .map(|&r| {
            let rr = &rep.ranks[r];
            let slices = rr
                .ops
                .iter()
                .map(|o| {
                    let op = &program.ops[o.op as usize];
                    let (cat, name, bytes, flops) = match &op.kind {
                        ProgKind::Kernel { work, gemm } => (
                            if *gemm { "gemm" } else { "kernel" },
                            op.label.clone(),
                            work.bytes as u64,
                            work.flops,
                        ),
                        ProgKind::Collective { kind, bytes, axis } => (
                            "collective",
                            format!("{} {}({axis})", op.label, kind.name()),
                            *bytes,
                            0.0,
                        ),
                        _ => ("event", String::new(), 0, 0.0),
                    };
                    Slice {
                        track: op.stream,
                        name,
                        cat: cat.to_string(),
                        start: o.start,
                        dur: o.end - o.start,
                        bytes,
                        flops,
                    }
                })
                .collect();
            Timeline {
                tracks: program.streams.clone(),
                slices,
                memory: rr
                    .memory
                    .iter()
                    .map(|&(t, b)| (t, b + base_memory))
                    .collect(),
            }
        })
        .collect();
    (tls, of)
}

/// The fields of a replayed plan's report that the plan and the cluster give (mode `forward`
/// or `train`, the batch, a training plan's micro-batches, recomputation and ZeRO stage);
/// the numbers are zero, for the replay to fill.
pub(crate) fn plan_report(plan: &Plan, cluster: &Cluster, opts: &ComputeOptions) -> SimReport {
    let mesh = &plan.mesh;
    let train = plan.train.as_ref();
    // Sequences per micro-batch per data-parallel rank, as the training model counts them.
    let data_parts = mesh.data_ranks();
    let dev = &cluster.device;
    SimReport {
        mode: if train.is_some() { "train" } else { "forward" }.into(),
        model: plan.model.source.clone(),
        mesh: mesh.to_string(),
        strategies: plan.strategies.clone(),
        cluster: cluster.label(),
        device: dev.name.clone(),
        gpus: mesh.world_size(),
        dtype: opts.dtype.name().into(),
        global_batch: plan.model.batch,
        seq: plan.model.seq,
        micro_batch: train.map(|t| plan.model.batch / t.micro_batches.max(1) / data_parts.max(1)),
        micro_batches: train.map(|t| t.micro_batches),
        schedule: train.map(|_| "none".into()),
        recompute: train.map(|t| t.recompute.name().into()),
        zero: train.map(|t| t.zero_stage),
        device_memory_bytes: dev.memory().0,
        fits: true,
        ..SimReport::default()
    }
}

/// Replays a compiled plan over every rank of its mesh on `cluster` (a pipeline plan through
/// [`super::simulate_pipeline_plan`]).
pub fn simulate_plan(
    plan: &Plan,
    cluster: &Cluster,
    opts: &ComputeOptions,
) -> Result<Simulation, CostError> {
    let mesh = &plan.mesh;
    if plan.pipeline.is_some() {
        return super::simulate_pipeline_plan(plan, cluster, opts);
    }
    check_gpus(mesh, cluster)?;
    let dev = &cluster.device;
    let comm = |axis: &str, kind: CollectiveKind, bytes: u64| {
        axis_collective_time(cluster, mesh, axis, kind, bytes)
    };
    // A training micro-batch's inputs (parameters, tokens) and outputs (gradients, which
    // accumulate into the step's buffers; the loss) are static state, accounted apart.
    let g = &plan.program;
    let training = plan.step.is_some() && plan.train.is_some();
    let mut outputs = vec![false; g.len()];
    for &(_, v) in &g.outputs {
        outputs[v.index()] = true;
    }
    let resident =
        |v: ValueId| training && (outputs[v.index()] || matches!(g.node(v).op, Op::Input { .. }));
    let mut program =
        Program::from_steps_with(g, &plan.steps, dev, opts, &|_| true, &comm, &resident);
    let topo = Topology::new(mesh, cluster);
    // A training step: the micro-batch's program once per micro-batch, then the step's
    // (gradient synchronisation left after the last micro-batch, AdamW, updating the static
    // state in place), timed alone too.
    let mut step_program_s = 0.0;
    if let (Some(st), Some(t)) = (&plan.step, &plan.train) {
        let step = Program::from_steps(&st.program, &st.steps, dev, opts, &|_| true, &comm)
            .without_memory();
        step_program_s = replay(&step, &topo, cluster, false)?.end().0;
        let micro = std::mem::take(&mut program);
        program = Program::concat(std::iter::repeat_n(&micro, t.micro_batches).chain([&step]));
    }
    let rep = replay(&program, &topo, cluster, true)?;
    let world = mesh.world_size();
    let step = rep.end().0;
    let params = Bytes(
        g.ids()
            .filter(|&v| matches!(g.node(v).op, Op::Param(_)))
            .map(|v| sim_bytes(g.ty(v), opts.dtype))
            .sum::<f64>() as u64,
    );
    let crit = rep.critical_rank();
    let cr = &rep.ranks[crit];
    // The first rank with the largest peak.
    let (mut worst, mut worst_live) = (0, Bytes::ZERO);
    for (i, r) in rep.ranks.iter().enumerate() {
        if r.peak_live > worst_live {
            (worst, worst_live) = (i, r.peak_live);
        }
    }
    // A training plan: parameters, gradients and optimizer state as the compiler accounted
    // them (its precision); the activations, working memory and collective outputs (ZeRO-3's
    // gathered parameters included) are the replay's live bytes, each value held from its
    // kernel to its last reader.
    let train_memory = plan.memory.train.as_ref().filter(|_| plan.train.is_some());
    let memory = match train_memory {
        Some(t) => MemoryBreakdown {
            params: Bytes(t.param_bytes),
            grads: Bytes(t.grad_bytes),
            optimizer: Bytes(t.optimizer_bytes),
            activations: worst_live,
            ..MemoryBreakdown::default()
        },
        None => MemoryBreakdown {
            params,
            activations: worst_live,
            ..MemoryBreakdown::default()
        },
    };
    let static_bytes = (memory.total().0).saturating_sub(worst_live.0);
    let flops = program.flops() * world as f64;
    let tokens = (plan.model.batch * plan.model.seq) as f64;
    let peak = dev.peak(opts.dtype);
    let exposed = cr.exposed_comm().0.min(cr.comm.0);
    let (tls, of) = timelines(&program, &rep, static_bytes);
    let device_memory = dev.memory();
    let train = plan.train.as_ref();
    let base = plan_report(plan, cluster, opts).with_throughput(step, tokens, flops, flops, peak);
    let report = SimReport {
        compute_s: cr.compute.0,
        comm_s: cr.comm.0,
        exposed_comm_s: exposed,
        hidden_comm_s: (cr.comm.0 - exposed).max(0.0),
        bubble_fraction: 0.0,
        pipeline_s: if train.is_some() {
            (step - step_program_s).max(0.0)
        } else {
            0.0
        },
        optimizer_s: step_program_s,
        peak_memory_bytes_per_rank: memory.total().0,
        peak_memory_rank: worst,
        memory_breakdown: memory,
        device_memory_bytes: device_memory.0,
        fits: memory.total() <= device_memory,
        ..base
    };
    Ok(Simulation {
        report,
        timelines: tls,
        rank_timeline: of,
        rank_labels: rank_labels(mesh),
    })
}
