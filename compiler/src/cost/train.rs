//! Layer (b) of the simulator: one training step from one layer's plan.
//!
//! 1. Compile a two-layer copy of the model on the tensor-parallel mesh (`tp=T`, with `sp`)
//!    for one micro-batch, and cut its plan into three programs: the embedding (before layer
//!    0), layer 0 (a steady-state layer: its input comes from a layer, its output goes to one),
//!    and the head (final norm, `lm_head`, plus vocabulary-parallel cross-entropy; the output
//!    all-gathers an inference plan ends with are dropped).
//! 2. Replay each forward on one tensor-parallel group, with the full mesh's `tp` group
//!    topology; derive its backward ([`Program::derive_backward`]) with recomputation (full:
//!    the layer's forward again first; selective: the attention core) and replay that.
//! 3. A pipeline chunk of `n` layers costs `n` times the layer (plus embedding on the first
//!    chunk, head on the last); ZeRO-3 gathers each layer's parameters before its forward and
//!    backward and reduce-scatters its gradients, prefetched (a layer takes the longer of its
//!    compute and that traffic).
//! 4. The pipeline schedule (any of the compiler's: GPipe, 1F1B, interleaved, ZB-H1) is built
//!    by [`crate::schedule::pp`] and replayed there
//!    ([`crate::schedule::pp::PipelineSchedule::replay_with`]) with each (stage, chunk, pass)'s
//!    duration, and point-to-point transfers of one micro-batch's activations between stages
//!    (scattered over the `tp` ranks and gathered over NVLink, as Megatron-LM does). ZB-H1's
//!    `B` pass is the backward without its weight-gradient GEMMs (`*.wgrad`, and the
//!    all-gathers sequence parallelism repeats for them), its `W` pass those alone, each
//!    replayed on its own ([`Program::split_weight_grad`]): `B` + `W` can exceed the whole
//!    backward, whose collectives overlap the weight-gradient GEMMs.
//! 5. Data-parallel gradient synchronisation (all-reduce; ZeRO-1/2 reduce-scatter and a
//!    parameter all-gather after the optimizer), per-layer buckets overlapped with the last
//!    backward when `overlap_grad_reduce`, the tied-embedding all-reduce between the first and
//!    last stage, and the Adam step (memory-bound, 40 bytes per local parameter).
//!
//! Memory per stage: ZeRO static bytes ([`zero_static`]), activations from
//! [`saved_activations`] times the peak number of in-flight (micro-batch, chunk) pairs from the
//! pipeline simulation, transient working memory, and ZeRO-3 gather buffers.

use super::collective::{collective_time, CollectiveKind, GroupTopology};
use super::memory::{saved_activations, zero_static, MemoryBreakdown, Recompute, SavedOptions};
use super::pipe::PipeSchedule;
use super::profile::Cluster;
use super::program::{Grad, ProgKind, ProgOp, Program, Work, COMPUTE};
use super::replay::{replay, Topology};
use super::report::{SimReport, Simulation, Slice, StageReport, Timeline};
use super::roofline::{
    is_expert_major, kernel_time, routed_fraction, sim_bytes, ComputeOptions, Kernel,
};
use super::simulate::{check_gpus, rank_labels};
use super::units::{Bytes, Seconds};
use super::CostError;
use crate::ir::{Graph, Op, ValueId};
use crate::model::{ModelConfig, ModelStats};
use crate::plan::Plan;
use crate::schedule::pp::{Phase, PipelineSchedule, Replay, Timed};
use crate::shard::Mesh;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// Bytes of HBM traffic per local parameter of a mixed-precision Adam step: bf16 gradient
/// read and fp32 copy (2 + 4), fp32 master weight, momentum, variance and gradient read
/// (16) and written back (12), bf16 weight written (2), grad-norm read (4).
pub const ADAM_BYTES_PER_PARAM: f64 = 40.0;

/// A training configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    /// Sequences per optimizer step.
    pub global_batch: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Full recomputation of the first `k` decoder layers of each pipeline chunk, the others
    /// under `recompute` (Megatron-LM's `--recompute-method block --recompute-num-layers k`);
    /// `None` or 0: every layer under `recompute`.
    pub recompute_layers: Option<usize>,
    /// ZeRO stage over the `dp` axis (0: plain data parallelism).
    pub zero: u8,
    /// Pipeline schedule (ignored without a `pp` axis).
    pub schedule: PipeSchedule,
    /// Overlap the gradient reduction with the last backward (Megatron-Core's
    /// `--overlap-grad-reduce`).
    pub overlap_grad_reduce: bool,
    /// Send `1/tp` of the activations between stages and all-gather them over NVLink
    /// (Megatron-LM's scatter/gather optimisation, SC'21 §4.1).
    pub scatter_gather: bool,
    /// Strategies beyond the mesh axes' defaults (`sp`).
    pub strategies: Vec<String>,
    /// Mixture-of-experts load imbalance: the busiest expert-parallel rank's routed tokens
    /// over the mean (1: perfectly balanced). Its expert GEMMs and all-to-all traffic scale
    /// by it, and every rank waits for it.
    pub moe_imbalance: f64,
    /// Decoder layers per pipeline chunk (`pp × virtual stages` entries; the embedding joins
    /// the first chunk, the head the last); `None`: the compiler's split, balanced by forward
    /// FLOPs (`shardc compile`'s default), so a simulated step is the one that compiles.
    pub stage_layers: Option<Vec<usize>>,
    /// Record each pass and gradient bucket in the stages' timelines (`--trace`), with their
    /// memory over time, and label every rank; a search, which reads only the numbers, leaves
    /// them out.
    pub timelines: bool,
    /// The model's forward FLOPs per token at this sequence length, when the caller has them
    /// (a search computes them once); `None`: computed here.
    pub forward_flops_per_token: Option<u64>,
    /// The compiler's decoder layers per chunk for this chunk count, when the caller has them
    /// (a search splits once per chunk count); ignored with `stage_layers` or another count.
    pub chunk_layers: Option<Vec<usize>>,
}

impl TrainOptions {
    /// Defaults: no recomputation, ZeRO-0, 1F1B, no overlap, scatter/gather on.
    pub fn new(global_batch: usize, micro_batch: usize, seq: usize) -> TrainOptions {
        TrainOptions {
            global_batch,
            micro_batch,
            seq,
            recompute: Recompute::None,
            recompute_layers: None,
            zero: 0,
            schedule: PipeSchedule::OneFOneB,
            overlap_grad_reduce: false,
            scatter_gather: true,
            strategies: Vec::new(),
            moe_imbalance: 1.0,
            stage_layers: None,
            timelines: true,
            forward_flops_per_token: None,
            chunk_layers: None,
        }
    }

    fn names(&self) -> impl Iterator<Item = &str> {
        self.strategies
            .iter()
            .flat_map(|s| s.split(','))
            .map(str::trim)
    }

    fn sp(&self) -> bool {
        self.names().any(|s| s == "sp")
    }

    /// Decoder layers of a chunk of `n` fully recomputed ([`TrainOptions::recompute_layers`]).
    pub fn full_layers(&self, n: usize) -> usize {
        if self.recompute == Recompute::Full {
            n
        } else {
            self.recompute_layers.unwrap_or(0).min(n)
        }
    }

    /// The recomputation as text: `none`, `selective`, `full`, or `full×k+none` (the first
    /// `k` layers of each chunk fully recomputed).
    pub fn recompute_label(&self) -> String {
        match self.recompute_layers {
            Some(k) if k > 0 && self.recompute != Recompute::Full => {
                format!("full×{k}+{}", self.recompute.name())
            }
            _ => self.recompute.name().to_string(),
        }
    }

    /// The strategies of the layer plan: `sp` and the context-parallel variants.
    fn layer_strategies(&self) -> Vec<String> {
        self.names()
            .filter(|s| *s == "sp" || s.starts_with("cp-"))
            .map(str::to_string)
            .collect()
    }
}

/// One pass of a program, timed on a tensor-parallel group.
#[derive(Clone, Copy, Debug, Default)]
struct Pass {
    time: Seconds,
    compute: Seconds,
    comm: Seconds,
    comm_bytes: u64,
    flops: f64,
}

/// One program's forward and derived backward, timed on a tensor-parallel group: the
/// backward whole, and split into its input-gradient and weight-gradient passes
/// ([`Program::split_weight_grad`]) for schedules that run them apart (ZB-H1).
#[derive(Clone, Debug, Default)]
struct Part {
    fwd: Pass,
    bwd: Pass,
    bwd_input: Pass,
    bwd_weight: Pass,
}

impl Part {
    /// The pass a `phase` slot runs; `B` is the input gradient alone when `split`.
    fn pass(&self, phase: Phase, split: bool) -> &Pass {
        match phase {
            Phase::F => &self.fwd,
            Phase::B if split => &self.bwd_input,
            Phase::B => &self.bwd,
            Phase::W => &self.bwd_weight,
        }
    }
}

fn comm_bytes(p: &Program) -> u64 {
    p.ops
        .iter()
        .map(|o| match &o.kind {
            ProgKind::Collective { bytes, .. } => *bytes,
            _ => 0,
        })
        .sum()
}

fn time_pass(p: &Program, topo: &Topology, cluster: &Cluster) -> Result<Pass, CostError> {
    let r = replay(p, topo, cluster, false)?;
    let x = &r.ranks[r.critical_rank()];
    Ok(Pass {
        time: x.end,
        compute: x.compute,
        comm: x.comm,
        comm_bytes: comm_bytes(p),
        flops: p.flops(),
    })
}

/// `fwd`'s part under `recompute`; its forward pass timed into `fwd_pass` once, however many
/// recomputations a caller times (a failed timing is not kept: timed again, it fails again).
fn time_part(
    fwd: &Program,
    fwd_pass: &mut Option<Pass>,
    recompute: Recompute,
    topo: &Topology,
    cluster: &Cluster,
) -> Result<Part, CostError> {
    let bwd = fwd.derive_backward(
        recompute != Recompute::Full,
        recompute == Recompute::Selective,
    );
    let bwd = if recompute == Recompute::Full {
        fwd.without_memory().then(&bwd)
    } else {
        bwd
    };
    let (input, weight) = bwd.split_weight_grad();
    let fwd = match *fwd_pass {
        Some(p) => p,
        None => *fwd_pass.insert(time_pass(fwd, topo, cluster)?),
    };
    Ok(Part {
        fwd,
        bwd: time_pass(&bwd, topo, cluster)?,
        bwd_input: time_pass(&input, topo, cluster)?,
        bwd_weight: time_pass(&weight, topo, cluster)?,
    })
}

fn params_used(g: &Graph, keep: &dyn Fn(ValueId) -> bool) -> BTreeSet<ValueId> {
    let mut s = BTreeSet::new();
    for v in g.ids().filter(|&v| keep(v)) {
        for &i in &g.node(v).inputs {
            if matches!(g.node(i).op, Op::Param(_)) {
                s.insert(i);
            }
        }
    }
    s
}

fn elems(g: &Graph, s: &BTreeSet<ValueId>) -> u64 {
    s.iter().map(|&v| g.ty(v).numel() as u64).sum()
}

/// The plan the training model replays: a two-layer copy of the model compiled for one
/// micro-batch per `ep` rank on the tensor-parallel (and expert-parallel) mesh, `sp` if the
/// step uses it. The compile driver compiles it (`compile::simulate_training`); the cost
/// model never compiles a model.
#[derive(Clone, Debug)]
pub struct LayerPlanSpec {
    /// The model, cut to (at most) two layers.
    pub model: ModelConfig,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// `tp=T` or `ep=E,tp=T`, laid out as `cluster`'s nodes.
    pub mesh: Mesh,
    /// `sp` or nothing.
    pub strategies: Vec<String>,
}

/// The sizes of a checked training configuration.
struct Sizes {
    dp: usize,
    tp: usize,
    pp: usize,
    ep: usize,
    /// Context-parallel ranks (parts of each sequence).
    cp: usize,
    /// Chunks per pipeline rank.
    v: usize,
    schedule: PipeSchedule,
}

/// Checks `t` on `mesh` for `cfg` (axes, divisibility, ranges) and returns the axis sizes.
fn check_training(
    cfg: &ModelConfig,
    mesh: &Mesh,
    t: &TrainOptions,
    cluster: &Cluster,
) -> Result<Sizes, CostError> {
    check_gpus(mesh, cluster)?;
    for a in &mesh.axes {
        if !["dp", "tp", "pp", "ep", "cp"].contains(&a.name.as_str()) && a.size > 1 {
            return Err(CostError::UnsupportedAxis {
                axis: a.name.clone(),
                size: a.size,
            });
        }
    }
    let size = |n: &str| mesh.axis(n).map_or(1, |a| mesh.axis_size(a));
    let (dp, tp, pp, ep, cp) = (size("dp"), size("tp"), size("pp"), size("ep"), size("cp"));
    // Ranks holding different sequences (cp ranks hold parts of the same ones).
    let data = dp * ep;
    if cp > 1 && t.seq % cp != 0 {
        return Err(CostError::Indivisible {
            what: "seq".into(),
            size: t.seq,
            by: "cp".into(),
            parts: cp,
        });
    }
    if ep > 1 {
        let Some(moe) = cfg.moe else {
            return Err(CostError::Train(format!(
                "mesh axis `ep` (size {ep}) splits experts, and this model has none"
            )));
        };
        if moe.experts % ep != 0 {
            return Err(CostError::Indivisible {
                what: "experts".into(),
                size: moe.experts,
                by: "ep".into(),
                parts: ep,
            });
        }
    }
    if !(t.moe_imbalance.is_finite() && t.moe_imbalance >= 1.0) {
        return Err(CostError::Train(format!(
            "MoE load imbalance {} must be a finite ratio of at least 1 (busiest rank over mean)",
            t.moe_imbalance
        )));
    }
    let (schedule, v) = if pp > 1 {
        (t.schedule, t.schedule.chunks())
    } else {
        (PipeSchedule::OneFOneB, 1)
    };
    if t.zero > 3 {
        return Err(CostError::Train(format!(
            "ZeRO stage {} does not exist (0, 1, 2 or 3)",
            t.zero
        )));
    }
    if t.micro_batch == 0 || t.seq == 0 {
        return Err(CostError::Train(
            "micro-batch and sequence length must be positive".into(),
        ));
    }
    if t.global_batch == 0 || t.global_batch % (data * t.micro_batch) != 0 {
        return Err(CostError::Indivisible {
            what: "global batch".into(),
            size: t.global_batch,
            by: if ep > 1 {
                "dp*ep*micro-batch"
            } else {
                "dp*micro-batch"
            }
            .into(),
            parts: data * t.micro_batch,
        });
    }
    Ok(Sizes {
        dp,
        tp,
        pp,
        ep,
        cp,
        v,
        schedule,
    })
}

/// The plan [`simulate_training_on`] replays for `t` on `mesh` (checked).
pub fn layer_plan_spec(
    cfg: &ModelConfig,
    mesh: &Mesh,
    t: &TrainOptions,
    cluster: &Cluster,
) -> Result<LayerPlanSpec, CostError> {
    let Sizes { tp, ep, cp, .. } = check_training(cfg, mesh, t, cluster)?;
    let mut model = cfg.clone();
    model.layers = cfg.layers.min(2);
    let mut axes = Vec::new();
    if ep > 1 {
        axes.push(format!("ep={ep}"));
    }
    if cp > 1 {
        axes.push(format!("cp={cp}"));
    }
    axes.push(format!("tp={tp}"));
    let text = axes.join(",");
    let layer_mesh = Mesh::parse(&text, cluster.gpus_per_node())
        .map_err(|e| CostError::Train(format!("the layer plan's mesh {text}: {e}")))?;
    Ok(LayerPlanSpec {
        model,
        batch: t.micro_batch * ep,
        seq: t.seq,
        mesh: layer_mesh,
        strategies: t.layer_strategies(),
    })
}

/// Simulates one training step of `cfg` on `mesh` (axes `dp`, `tp`, `pp`, `ep`) on `cluster`
/// from `plan`, the compiled plan [`layer_plan_spec`] describes.
///
/// Expert parallelism (`ep`, a mixture-of-experts model): outside the experts the `ep` ranks
/// hold different tokens, as data-parallel ranks do; each holds `experts / ep` experts, and the
/// tokens routed to them arrive and leave by all-to-all. Dense parameters' gradients are
/// synchronised (and ZeRO-sharded) over `dp × ep`, the experts' over `dp`.
pub fn simulate_training_on(
    cfg: &ModelConfig,
    plan: &Plan,
    source: &str,
    mesh: &Mesh,
    t: &TrainOptions,
    cluster: &Cluster,
    copts: &ComputeOptions,
) -> Result<Simulation, CostError> {
    match simulate(cfg, plan, source, mesh, t, cluster, copts, None, false)? {
        Step::Simulated(sim) => Ok(*sim),
        Step::Bounded(_) => unreachable!("simulated without a bound"),
    }
}

/// A layout's step time bounded from below, and its peak memory, without replaying its
/// pipeline ([`TrainMemo::bound`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepBound {
    /// Seconds per optimizer step, at most the simulated step's: the busiest stage's passes
    /// back to back (a stage runs one at a time), less a relative 10⁻⁹ for rounding.
    pub step_time_s: f64,
    /// Peak memory of the most loaded rank, bytes: the simulated step's (the micro-batches
    /// a stage holds follow from its schedule's order, not the passes' durations).
    pub peak_memory_bytes_per_rank: u64,
}

/// How far [`simulate`] went.
enum Step {
    /// The whole step.
    Simulated(Box<Simulation>),
    /// Its bound, the pipeline not replayed.
    Bounded(StepBound),
}

/// A pipeline schedule with each stage's peak number of (micro-batch, chunk) forwards in
/// flight, as its replay counts them (empty: not counted before the replay).
#[derive(Debug)]
struct Built {
    schedule: PipelineSchedule,
    peak_in_flight: Vec<usize>,
}

/// What the simulated training steps of one model on one cluster, with one set of compute
/// options, share across layouts, kept for a search: each layer plan's parts timed once per
/// configuration that times them differently (the plan, where the `tp`, `ep` and `cp` groups
/// sit, the micro-batch, sequence, recomputation and load imbalance; not `dp`, `pp`, ZeRO or
/// the schedule), and each pipeline schedule built once per stage and micro-batch count.
#[derive(Debug, Default)]
pub struct TrainMemo {
    /// Timed parts by plan key, then by what else times them.
    parts: Mutex<HashMap<String, HashMap<PartsKey, Arc<LayerParts>>>>,
    /// Schedules by (schedule, stages, micro-batches).
    schedules: Mutex<HashMap<(PipeSchedule, usize, usize), Arc<Built>>>,
}

/// What times a layer plan's parts beside the plan (see [`layer_parts`]): the groups, `tp`
/// and `cp`, micro-batch, sequence, recomputation and the load imbalance's bits.
type PartsKey = (LayerGroups, [usize; 4], Recompute, u64);

impl TrainMemo {
    /// An empty memo.
    pub fn new() -> TrainMemo {
        TrainMemo::default()
    }

    /// [`simulate_training_on`], with what this memo keeps; `plan_key` names `plan` (equal
    /// keys, equal plans). The same numbers, layout for layout.
    #[allow(clippy::too_many_arguments)]
    pub fn simulate(
        &self,
        plan_key: &str,
        cfg: &ModelConfig,
        plan: &Plan,
        source: &str,
        mesh: &Mesh,
        t: &TrainOptions,
        cluster: &Cluster,
        copts: &ComputeOptions,
    ) -> Result<Simulation, CostError> {
        let memo = Some((self, plan_key));
        match simulate(cfg, plan, source, mesh, t, cluster, copts, memo, false)? {
            Step::Simulated(sim) => Ok(*sim),
            Step::Bounded(_) => unreachable!("simulated without a bound"),
        }
    }

    /// The layout's step time bounded from below and its peak memory ([`StepBound`]), what
    /// [`TrainMemo::simulate`] computes before the pipeline replay; refused exactly when
    /// `simulate` would be.
    #[allow(clippy::too_many_arguments)]
    pub fn bound(
        &self,
        plan_key: &str,
        cfg: &ModelConfig,
        plan: &Plan,
        mesh: &Mesh,
        t: &TrainOptions,
        cluster: &Cluster,
        copts: &ComputeOptions,
    ) -> Result<StepBound, CostError> {
        let memo = Some((self, plan_key));
        match simulate(cfg, plan, "", mesh, t, cluster, copts, memo, true)? {
            Step::Bounded(b) => Ok(b),
            Step::Simulated(_) => unreachable!("bounded with a memo"),
        }
    }

    /// `plan`'s parts for `t` (what [`layer_parts`] times), timed once.
    #[allow(clippy::too_many_arguments)]
    fn parts(
        &self,
        plan_key: &str,
        cfg: &ModelConfig,
        plan: &Plan,
        t: &TrainOptions,
        [tp, cp]: [usize; 2],
        groups: LayerGroups,
        cluster: &Cluster,
        copts: &ComputeOptions,
    ) -> Result<Arc<LayerParts>, CostError> {
        let key: PartsKey = (
            groups,
            [tp, cp, t.micro_batch, t.seq],
            t.recompute,
            t.moe_imbalance.to_bits(),
        );
        let lock = || self.parts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = lock().get(plan_key).and_then(|m| m.get(&key)) {
            return Ok(p.clone());
        }
        // A search tries every recomputation: all are timed at once, sharing the forwards.
        let mut all = layer_parts(
            cfg,
            plan,
            t,
            [tp, cp],
            groups,
            cluster,
            copts,
            &Recompute::ALL,
        );
        let mut kept = lock();
        let by_key = kept.entry(plan_key.to_string()).or_default();
        let mut asked = None;
        for (rc, parts) in Recompute::ALL.into_iter().zip(all.drain(..)) {
            let parts = match parts {
                Ok(p) => Arc::new(p),
                Err(e) if rc == t.recompute => return Err(e),
                Err(_) => continue,
            };
            let key: PartsKey = (key.0, key.1, rc, key.3);
            let p = by_key.entry(key).or_insert(parts).clone();
            if rc == t.recompute {
                asked = Some(p);
            }
        }
        Ok(asked.expect("invariant: every recomputation is timed"))
    }

    /// `schedule` on `p` stages for `m` micro-batches, built once, with its peaks in flight.
    /// Replayed once with uniform passes for them: which slots can run depends on the order
    /// alone, so a schedule that replays here replays with any durations.
    fn schedule(
        &self,
        schedule: PipeSchedule,
        p: usize,
        m: usize,
    ) -> Result<Arc<Built>, CostError> {
        let lock = || self.schedules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = lock().get(&(schedule, p, m)) {
            return Ok(s.clone());
        }
        let built = schedule.build(p, m)?;
        let run = built.replay(crate::schedule::pp::PassCosts::uniform(1.0))?;
        let s = Arc::new(Built {
            peak_in_flight: run.ranks.iter().map(|r| r.peak_in_flight).collect(),
            schedule: built,
        });
        Ok(lock().entry((schedule, p, m)).or_insert(s).clone())
    }
}

/// [`simulate_training_on`], reusing what `memo` keeps (with the plan's key) when given;
/// with `bound` and a memo, only up to the step's [`StepBound`].
#[allow(clippy::too_many_arguments)]
fn simulate(
    cfg: &ModelConfig,
    plan: &Plan,
    source: &str,
    mesh: &Mesh,
    t: &TrainOptions,
    cluster: &Cluster,
    copts: &ComputeOptions,
    memo: Option<(&TrainMemo, &str)>,
    bound: bool,
) -> Result<Step, CostError> {
    let Sizes {
        dp,
        tp,
        pp,
        ep,
        cp,
        v,
        schedule,
    } = check_training(cfg, mesh, t, cluster)?;
    let data = dp * ep;
    // Dense gradients are summed, and ZeRO-sharded, over every rank holding other tokens:
    // dp × ep × cp (Megatron's distributed optimizer shards over dp × cp as well).
    let sync = data * cp;
    // Tokens of one micro-batch sequence on a rank.
    let seq_local = t.seq / cp;
    let world = mesh.world_size();
    let sp = t.sp();
    let m = t.global_batch / (data * t.micro_batch);
    // Decoder layers of each global chunk (chunk `gc` runs on stage `gc mod pp`).
    let chunk_layers: Vec<usize> = match &t.chunk_layers {
        Some(c) if c.len() == pp * v && t.stage_layers.is_none() => c.clone(),
        _ => crate::train::chunk_specs(cfg, pp * v, t.seq, t.stage_layers.as_deref())
            .map_err(|e| CostError::Train(e.to_string()))?
            .iter()
            .map(|c| c.layers.len())
            .collect(),
    };
    let stage_layers = |s: usize| -> usize { (0..v).map(|c| chunk_layers[c * pp + s]).sum() };
    let dev = &cluster.device;
    let dt = copts.dtype;

    // 1-2. The two-layer plan's parts, timed on a tensor-parallel group.
    let groups: LayerGroups = [
        GroupTopology::of_axis(mesh, "tp", cluster),
        GroupTopology::of_axis(mesh, "ep", cluster),
        GroupTopology::of_axis(mesh, "cp", cluster),
    ];
    let tp_topo = groups[0];
    // Block recomputation: the fully recomputed layers' part beside the others', and what
    // such a layer saves (its input).
    let blocks = t.recompute != Recompute::Full && t.recompute_layers.unwrap_or(0) > 0;
    let (parts, full) = match memo {
        Some((memo, key)) => {
            let parts_of = |t: &TrainOptions| {
                memo.parts(key, cfg, plan, t, [tp, cp], groups, cluster, copts)
                    .map(|p| LayerParts::clone(&p))
            };
            let full = TrainOptions {
                recompute: Recompute::Full,
                ..t.clone()
            };
            (parts_of(t)?, blocks.then(|| parts_of(&full)).transpose()?)
        }
        None => {
            // Both recomputations in one timing, sharing the forward.
            let rcs: &[Recompute] = if blocks {
                &[t.recompute, Recompute::Full]
            } else {
                &[t.recompute]
            };
            let mut timed =
                layer_parts(cfg, plan, t, [tp, cp], groups, cluster, copts, rcs).into_iter();
            let parts = timed
                .next()
                .expect("invariant: the recomputation is timed")?;
            (parts, timed.next().transpose()?)
        }
    };
    let (mut full_layer, saved_recomputed) = match full {
        Some(p) => (Some(p.layer), p.saved_layer.0),
        None => (None, 0),
    };
    let LayerParts {
        pre,
        mut layer,
        post,
        layer_elems,
        layer_expert,
        pre_elems,
        post_elems,
        shared_elems,
        ep_traffic,
        saved_layer,
        saved_full_layer,
        biggest,
    } = parts;
    let layer_dense = layer_elems - layer_expert;
    let logits = logits_bytes(cfg, t, seq_local, tp);

    // 3. ZeRO-3: each layer's parameters gathered before its forward and backward, its
    // gradients reduce-scattered, prefetched behind the layer's compute.
    let dp_topo = GroupTopology::of_axis(mesh, "dp", cluster);
    let sync_topo = data_group(mesh, cluster);
    let ct = |k: CollectiveKind, b: u64, topo: GroupTopology| {
        collective_time(cluster, k, Bytes(b), topo)
    };
    // A collective over (dense, expert) parameter bytes: the dense part over `dp × ep`, the
    // experts' over `dp` (one after the other on the stream).
    let split_ct = |k: CollectiveKind, dense: u64, expert: u64| {
        let on = |b: u64, n: usize, topo| {
            if b > 0 && n > 1 {
                ct(k, b, topo)
            } else {
                Seconds::ZERO
            }
        };
        let dense_t = on(dense, sync, sync_topo);
        dense_t + on(expert, dp, dp_topo)
    };
    if t.zero == 3 && sync > 1 {
        let bytes = layer_elems * 2;
        let ag = split_ct(CollectiveKind::AllGather, layer_dense * 2, layer_expert * 2);
        let rs = split_ct(
            CollectiveKind::ReduceScatter,
            layer_dense * 2,
            layer_expert * 2,
        );
        // The split backward gathers before its input gradient and reduce-scatters after
        // its weight gradient.
        let add = |p: &mut Pass, t: Seconds, b: u64| {
            p.time = p.time.max(t);
            p.comm += t;
            p.comm_bytes += b;
        };
        for layer in std::iter::once(&mut layer).chain(full_layer.as_mut()) {
            add(&mut layer.fwd, ag, bytes);
            add(&mut layer.bwd, ag + rs, 2 * bytes);
            add(&mut layer.bwd_input, ag, bytes);
            add(&mut layer.bwd_weight, rs, bytes);
        }
    }

    // Chunk costs: the pass a `phase` slot of local chunk `c` of stage `s` runs.
    let last_gc = pp * v - 1;
    let split = schedule == PipeSchedule::ZbH1;
    let chunk = |s: usize, c: usize, ph: Phase, f: &dyn Fn(&Pass) -> f64| -> f64 {
        let gc = c * pp + s;
        let of = |p: &Part| f(p.pass(ph, split));
        let n = chunk_layers[gc];
        let layers = match &full_layer {
            Some(full) => {
                let k = t.full_layers(n);
                (n - k) as f64 * of(&layer) + k as f64 * of(full)
            }
            None => n as f64 * of(&layer),
        };
        layers + if gc == 0 { of(&pre) } else { 0.0 } + if gc == last_gc { of(&post) } else { 0.0 }
    };
    let dur = |s: usize, c: usize, ph: Phase| chunk(s, c, ph, &|p| p.time.0);
    let compute_of = |s: usize, c: usize, ph: Phase| chunk(s, c, ph, &|p| p.compute.0);
    let comm_of = |s: usize, c: usize, ph: Phase| chunk(s, c, ph, &|p| p.comm.0);
    let flops_of = |s: usize, c: usize, ph: Phase| chunk(s, c, ph, &|p| p.flops);
    let comm_bytes_of = |s: usize, c: usize, ph: Phase| chunk(s, c, ph, &|p| p.comm_bytes as f64);

    // 4. The pipeline.
    let act_bytes = (t.micro_batch * seq_local * cfg.hidden * dt.size_bytes()) as u64;
    let pp_topo = GroupTopology::of_axis(mesh, "pp", cluster);
    let hop = if pp_topo.crosses_network() {
        GroupTopology::across(2, 1)
    } else {
        GroupTopology::intra(2)
    };
    let (p2p_bytes, p2p) = if pp > 1 {
        let scattered = sp || (t.scatter_gather && tp > 1);
        let bytes = if scattered {
            act_bytes / tp as u64
        } else {
            act_bytes
        };
        let gather = if scattered && !sp {
            ct(CollectiveKind::AllGather, act_bytes, tp_topo)
        } else {
            Seconds::ZERO
        };
        (bytes, ct(CollectiveKind::SendRecv, bytes, hop) + gather)
    } else {
        (0, Seconds::ZERO)
    };
    // Slot `F`/`B`/`W` of global chunk `gc` runs on stage `gc mod pp` as its local chunk
    // `gc / pp`.
    let built = match memo {
        Some((memo, _)) => memo.schedule(schedule, pp, m)?,
        None => Arc::new(Built {
            schedule: schedule.build(pp, m)?,
            peak_in_flight: Vec::new(),
        }),
    };
    let pass_name = |ph: Phase| match ph {
        Phase::F => "forward",
        Phase::B => "backward",
        Phase::W => "weight-gradient",
    };

    // 5. Gradient synchronisation, embedding all-reduce, optimizer.
    // Per stage: (all, experts') local parameter elements.
    let stage_elems: Vec<(u64, u64)> = (0..pp)
        .map(|s| {
            let mut e = layer_elems * stage_layers(s) as u64;
            if s == 0 {
                e += pre_elems;
            }
            if s == pp - 1 {
                e += post_elems;
                if pp == 1 {
                    e -= shared_elems;
                }
            }
            (e, layer_expert * stage_layers(s) as u64)
        })
        .collect();
    let grad_kind = if t.zero == 0 {
        CollectiveKind::AllReduce
    } else {
        CollectiveKind::ReduceScatter
    };
    let emb_sync = if cfg.tied && pp > 1 {
        ct(CollectiveKind::AllReduce, shared_elems * 2, hop)
    } else {
        Seconds::ZERO
    };
    // A stage's (micro-batch, chunk) in flight holds its largest chunk's saved activations.
    let chunk_act = |s: usize| -> u64 {
        (0..v)
            .map(|c| {
                let n = chunk_layers[c * pp + s];
                let k = if blocks { t.full_layers(n) } else { 0 };
                saved_layer.0 * (n - k) as u64 + saved_recomputed * k as u64
            })
            .max()
            .unwrap_or(0)
    };
    // Stage `s`'s memory with `peak_if` (micro-batch, chunk) pairs in flight at most.
    let memory_of = |s: usize, peak_if: usize| -> MemoryBreakdown {
        let (psi, psi_expert) = stage_elems[s];
        let psi_dense = psi - psi_expert;
        let (w, gr, opt) = {
            let (a, b, c) = zero_static(psi_dense, sync, t.zero);
            let (x, y, z) = zero_static(psi_expert, dp, t.zero);
            (a + x, b + y, c + z)
        };
        let mut transient = 2 * biggest;
        if t.recompute == Recompute::Full || blocks {
            transient += saved_full_layer.0;
        }
        if s == pp - 1 {
            transient = transient.max(2 * logits as u64);
        }
        MemoryBreakdown {
            params: w,
            grads: gr,
            optimizer: opt,
            activations: Bytes(peak_if as u64 * chunk_act(s)),
            transient: Bytes(transient),
            comm_buffers: Bytes(if t.zero == 3 && sync > 1 {
                2 * layer_elems * 2
            } else {
                0
            }),
        }
    };
    if bound && !built.peak_in_flight.is_empty() {
        // Each stage runs every (micro-batch, chunk, pass) of its own once, one at a time.
        let passes: &[Phase] = if split {
            &[Phase::F, Phase::B, Phase::W]
        } else {
            &[Phase::F, Phase::B]
        };
        let busiest = (0..pp)
            .map(|s| {
                let per_micro: f64 = (0..v)
                    .flat_map(|c| passes.iter().map(move |&ph| (c, ph)))
                    .map(|(c, ph)| dur(s, c, ph))
                    .sum();
                m as f64 * per_micro
            })
            .fold(0.0, f64::max);
        let memory = (0..pp)
            .map(|s| memory_of(s, built.peak_in_flight[s]).total().0)
            .max()
            .unwrap_or(0);
        return Ok(Step::Bounded(StepBound {
            step_time_s: busiest * (1.0 - 1e-9),
            peak_memory_bytes_per_rank: memory,
        }));
    }
    let run: Replay = built
        .schedule
        .replay_with(&|gc, ph| dur(gc % pp, gc / pp, ph), p2p.0)?;

    struct StageOut {
        end: f64,
        sync_total: f64,
        sync_exposed: f64,
        optimizer: f64,
        param_ag: f64,
        memory: MemoryBreakdown,
        peak_in_flight: usize,
        timeline: Timeline,
    }
    let mut outs: Vec<StageOut> = Vec::with_capacity(pp);
    for (s, &(psi, psi_expert)) in stage_elems.iter().enumerate() {
        let psi_dense = psi - psi_expert;
        let pipe_end = run.ranks[s].end;
        let mut tl = Timeline {
            tracks: vec!["compute".into(), "comm:pp".into(), "comm:dp".into()],
            ..Timeline::default()
        };
        for e in run.rank(s).iter().filter(|_| t.timelines) {
            let (c, ph, mb) = (e.slot.chunk / pp, e.slot.phase, e.slot.micro);
            tl.slices.push(Slice {
                track: 0,
                name: format!("{ph:?} mb{mb} chunk{c}"),
                cat: pass_name(ph).into(),
                start: e.start,
                dur: e.end - e.start,
                bytes: comm_bytes_of(s, c, ph) as u64,
                flops: flops_of(s, c, ph),
            });
            if let Some(r) = e.recv {
                let what = if ph == Phase::F { "act" } else { "grad" };
                tl.slices.push(Slice {
                    track: 1,
                    name: format!("recv {what} mb{mb}"),
                    cat: "p2p".into(),
                    start: r,
                    dur: p2p.0,
                    bytes: p2p_bytes,
                    flops: 0.0,
                });
            }
        }
        // Gradient reduction: per-layer buckets, ready through the chunk's last backward (its
        // last weight-gradient pass when split) when overlapped, all at the end of the
        // pipeline otherwise.
        let mut sync_free = 0f64;
        let mut sync_total = 0f64;
        let mut param_ag = 0f64;
        if sync > 1 && t.zero < 3 {
            // (ready, dense bytes, expert bytes).
            let mut buckets: Vec<(f64, u64, u64)> = Vec::new();
            for c in 0..v {
                let grads = if split { Phase::W } else { Phase::B };
                let lastb = run
                    .rank(s)
                    .iter()
                    .rev()
                    .find(|e| e.slot.phase == grads && e.slot.chunk / pp == c);
                let (b0, b1) = match (t.overlap_grad_reduce, lastb) {
                    (true, Some(e)) => (e.start, e.end),
                    _ => (pipe_end, pipe_end),
                };
                let n_layers = chunk_layers[c * pp + s];
                for j in 0..n_layers {
                    let ready = b0 + (j + 1) as f64 * (b1 - b0) / n_layers as f64;
                    buckets.push((ready, layer_dense * 2, layer_expert * 2));
                }
                let gc = c * pp + s;
                let mut edge = 0;
                if gc == 0 {
                    edge += pre_elems;
                }
                if gc == last_gc {
                    edge += post_elems - if pp == 1 { shared_elems } else { 0 };
                }
                if edge > 0 {
                    buckets.push((b1, edge * 2, 0));
                }
            }
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            for (ready, dense, expert) in buckets {
                let bytes = dense + expert;
                let d = split_ct(grad_kind, dense, expert).0;
                let start = sync_free.max(ready);
                if t.timelines {
                    tl.slices.push(Slice {
                        track: 2,
                        name: format!("grad {}", grad_kind.name()),
                        cat: "collective".into(),
                        start,
                        dur: d,
                        bytes,
                        flops: 0.0,
                    });
                }
                sync_free = start + d;
                sync_total += d;
            }
            if t.zero >= 1 {
                param_ag = split_ct(CollectiveKind::AllGather, psi_dense * 2, psi_expert * 2).0;
            }
        }
        let mut end = pipe_end.max(sync_free);
        let sync_exposed = (end - pipe_end).max(0.0);
        if (s == 0 || s == pp - 1) && emb_sync.0 > 0.0 {
            tl.slices.push(Slice {
                track: 2,
                name: "embedding grad all_reduce".into(),
                cat: "collective".into(),
                start: end,
                dur: emb_sync.0,
                bytes: shared_elems * 2,
                flops: 0.0,
            });
            end += emb_sync.0;
        }
        let opt_params = if t.zero >= 1 {
            psi_dense.div_ceil(sync as u64) + psi_expert.div_ceil(dp as u64)
        } else {
            psi
        };
        let optimizer = kernel_time(
            dev,
            dt,
            &Kernel::memory(ADAM_BYTES_PER_PARAM * opt_params as f64),
        )
        .0;
        tl.slices.push(Slice {
            track: 0,
            name: "optimizer (adam)".into(),
            cat: "optimizer".into(),
            start: end,
            dur: optimizer,
            bytes: (ADAM_BYTES_PER_PARAM * opt_params as f64) as u64,
            flops: 0.0,
        });
        end += optimizer;
        if param_ag > 0.0 {
            tl.slices.push(Slice {
                track: 2,
                name: "param all_gather".into(),
                cat: "collective".into(),
                start: end,
                dur: param_ag,
                bytes: psi * 2,
                flops: 0.0,
            });
            end += param_ag;
        }
        // Memory.
        let (peak_if, in_flight) = (run.ranks[s].peak_in_flight, &run.ranks[s].in_flight);
        let memory = memory_of(s, peak_if);
        if t.timelines {
            let base = (memory.params + memory.grads + memory.optimizer + memory.comm_buffers).0;
            tl.memory = std::iter::once((0.0, base))
                .chain(
                    in_flight
                        .iter()
                        .map(|&(tm, n)| (tm, base + n as u64 * chunk_act(s))),
                )
                .collect();
        }
        outs.push(StageOut {
            end,
            sync_total,
            sync_exposed,
            optimizer,
            param_ag,
            memory,
            peak_in_flight: peak_if,
            timeline: tl,
        });
    }

    // The report.
    let step = outs.iter().map(|o| o.end).fold(0.0, f64::max);
    let crit = (0..pp)
        .max_by(|&a, &b| outs[a].end.total_cmp(&outs[b].end))
        .unwrap_or(0);
    let per_rank_flops: Vec<f64> = (0..pp)
        .map(|s| {
            run.rank(s)
                .iter()
                .map(|e| flops_of(s, e.slot.chunk / pp, e.slot.phase))
                .sum()
        })
        .collect();
    let flops: f64 = per_rank_flops.iter().sum::<f64>() * (tp * sync) as f64;
    let per_token = match t.forward_flops_per_token {
        Some(f) => f,
        None => {
            ModelStats::compute(cfg, t.seq)
                .map_err(CostError::Model)?
                .forward_flops_per_token
        }
    };
    let tokens = (t.global_batch * t.seq) as f64;
    let model_flops = 3.0 * per_token as f64 * tokens;
    let ce = run.rank(crit);
    let op = |e: &Timed| (crit, e.slot.chunk / pp, e.slot.phase);
    let exposed_in_ops: f64 = ce
        .iter()
        .map(|e| {
            let (s, c, ph) = op(e);
            dur(s, c, ph) - compute_of(s, c, ph)
        })
        .sum();
    let comm_in_ops: f64 = ce
        .iter()
        .map(|e| {
            let (s, c, ph) = op(e);
            comm_of(s, c, ph)
        })
        .sum();
    let remote_ops = ce.iter().filter(|e| e.recv.is_some()).count() as f64;
    let co = &outs[crit];
    let edge_comm = if crit == 0 || crit == pp - 1 {
        emb_sync.0
    } else {
        0.0
    };
    let exposed =
        exposed_in_ops + run.ranks[crit].p2p_wait + co.sync_exposed + edge_comm + co.param_ag;
    let comm_total = comm_in_ops + p2p.0 * remote_ops + co.sync_total + edge_comm + co.param_ag;
    let compute: f64 = ce
        .iter()
        .map(|e| {
            let (s, c, ph) = op(e);
            compute_of(s, c, ph)
        })
        .sum::<f64>()
        + co.optimizer;
    let bubble = (0..pp).map(|s| run.bubble(s)).sum::<f64>() / pp as f64;
    let mut worst = 0;
    for (s, o) in outs.iter().enumerate() {
        if o.memory.total() > outs[worst].memory.total() {
            worst = s;
        }
    }
    let worst_rank = (0..world)
        .find(|&r| stage_of(mesh, r) == worst)
        .unwrap_or(0);
    let device_memory = dev.memory();
    let stages: Vec<StageReport> = (0..pp)
        .map(|s| StageReport {
            stage: s,
            layers: stage_layers(s),
            end_s: outs[s].end,
            busy_s: run.ranks[s].busy,
            bubble_s: run.bubble(s),
            p2p_exposed_s: run.ranks[s].p2p_wait,
            dp_sync_exposed_s: outs[s].sync_exposed,
            peak_in_flight: outs[s].peak_in_flight,
            memory: outs[s].memory,
        })
        .collect();
    let wm = outs[worst].memory;
    let report = SimReport {
        mode: "train".into(),
        model: source.to_string(),
        mesh: mesh.to_string(),
        strategies: {
            let mut s: Vec<String> = mesh
                .axes
                .iter()
                .filter(|a| a.size > 1 && a.name != "pp")
                .map(|a| a.name.clone())
                .collect();
            if pp > 1 {
                s.push("pp".into());
            }
            if sp {
                s.push("sp".into());
            }
            if t.zero > 0 {
                s.push(format!("zero{}", t.zero));
            }
            s
        },
        cluster: cluster.label(),
        device: dev.name.clone(),
        gpus: world,
        dtype: dt.name().into(),
        global_batch: t.global_batch,
        seq: t.seq,
        micro_batch: Some(t.micro_batch),
        micro_batches: Some(m),
        schedule: Some(schedule.label()),
        recompute: Some(t.recompute_label()),
        zero: Some(t.zero),
        compute_s: compute,
        comm_s: comm_total,
        exposed_comm_s: exposed,
        hidden_comm_s: (comm_total - exposed).max(0.0),
        bubble_fraction: if step > 0.0 { bubble / step } else { 0.0 },
        pipeline_s: run.makespan,
        optimizer_s: co.optimizer,
        peak_memory_bytes_per_rank: wm.total().0,
        peak_memory_rank: worst_rank,
        memory_breakdown: wm,
        device_memory_bytes: device_memory.0,
        fits: outs.iter().all(|o| o.memory.total() <= device_memory),
        stages,
        notes: moe_notes(
            cfg,
            t,
            [dp, ep, tp],
            dt.size_bytes(),
            [layer_dense, layer_expert],
            ep_traffic,
        ),
        // The rates: `with_throughput` below.
        ..SimReport::default()
    }
    .with_throughput(step, tokens, flops, model_flops, dev.peak(dt));
    let rank_timeline = (0..world).map(|r| stage_of(mesh, r) as u32).collect();
    Ok(Step::Simulated(Box::new(Simulation {
        report,
        timelines: outs.into_iter().map(|o| o.timeline).collect(),
        rank_timeline,
        rank_labels: if t.timelines {
            rank_labels(mesh)
        } else {
            Vec::new()
        },
    })))
}

/// A layer plan's parts timed for one configuration: what [`simulate_training_on`] derives
/// from the plan before the data-parallel, pipeline and ZeRO arithmetic.
#[derive(Clone, Debug)]
struct LayerParts {
    pre: Part,
    layer: Part,
    post: Part,
    /// The layer's parameters, tp-local elements: all, and the experts' among them.
    layer_elems: u64,
    layer_expert: u64,
    /// The embedding's and the head's parameters, and those both use (tied).
    pre_elems: u64,
    post_elems: u64,
    shared_elems: u64,
    /// The layer's expert-parallel traffic as simulated: (collectives, bytes, time) forward.
    ep_traffic: (usize, u64, f64),
    /// Activations a layer saves for its backward under the recomputation, and without.
    saved_layer: Bytes,
    saved_full_layer: Bytes,
    /// The largest value of a layer.
    biggest: u64,
}

/// The groups of a mesh's `tp`, `ep` and `cp` axes (rank 0's) on a cluster.
type LayerGroups = [GroupTopology; 3];

/// Times `plan`'s parts for `t` under each of `recomputes` (`t`'s own ignored; steps 1 and 2
/// of the module docs): the forward and derived backward of the embedding, a layer and the
/// head on one tensor-parallel group laid out as `groups` (`tp`, `ep`, `cp`) say, with `tp`
/// and `cp` the mesh's sizes; their parameters; a layer's saved activations. Each result is
/// the one that recomputation alone gives; the forwards, which none changes, are timed once.
#[allow(clippy::too_many_arguments)]
fn layer_parts(
    cfg: &ModelConfig,
    plan: &Plan,
    t: &TrainOptions,
    [tp, cp]: [usize; 2],
    [tp_topo, ep_topo, cp_topo]: LayerGroups,
    cluster: &Cluster,
    copts: &ComputeOptions,
    recomputes: &[Recompute],
) -> Vec<Result<LayerParts, CostError>> {
    let seq_local = t.seq / cp;
    let lmesh = &plan.mesh;
    let dev = &cluster.device;
    let dt = copts.dtype;
    // 1. The two-layer plan on the tensor-parallel mesh (with the expert-parallel axis: one
    //    micro-batch per `ep` rank).
    let g = &plan.program;
    let first = g
        .ids()
        .find(|&v| g.node(v).layer.is_some())
        .map_or(0, |v| v.index());
    let last = g
        .ids()
        .filter(|&v| g.node(v).layer.is_some())
        .last()
        .map_or(0, |v| v.index());
    // What only presents the outputs to an inference caller — their gathers and context
    // parallelism's return to natural order — is not part of a training step.
    let users = g.users();
    let mut presentation = vec![false; g.len()];
    let output_ids: BTreeSet<ValueId> = g.outputs.iter().map(|(_, v)| *v).collect();
    for i in (0..g.len()).rev() {
        let v = ValueId(i as u32);
        let op = &g.node(v).op;
        let moves = op.is_collective() || matches!(op, Op::SeqPermute { inverse: true, .. });
        let u = &users[v.index()];
        presentation[v.index()] = moves
            && (output_ids.contains(&v)
                || (!u.is_empty() && u.iter().all(|x| presentation[x.index()])));
    }
    let keep_layer = |v: ValueId| g.node(v).layer == Some(0);
    let keep_pre = |v: ValueId| g.node(v).layer.is_none() && v.index() < first;
    let keep_post =
        |v: ValueId| g.node(v).layer.is_none() && v.index() > last && !presentation[v.index()];
    let comm = |axis: &str, kind: CollectiveKind, bytes: u64| {
        let topo = match axis {
            "ep" => ep_topo,
            "cp" => cp_topo,
            _ => tp_topo,
        };
        collective_time(cluster, kind, Bytes(bytes), topo)
    };
    let pre_p = Program::from_steps(g, &plan.steps, dev, copts, &keep_pre, &comm);
    let mut layer_p = Program::from_steps(g, &plan.steps, dev, copts, &keep_layer, &comm);
    if t.moe_imbalance > 1.0 {
        imbalance(&mut layer_p, t.moe_imbalance);
    }
    // The layer's expert-parallel traffic as simulated: (collectives, bytes, time) forward.
    let ep_traffic = layer_p
        .ops
        .iter()
        .filter_map(|o| match &o.kind {
            ProgKind::Collective { axis, kind, bytes } if axis == "ep" => Some((
                *bytes,
                collective_time(cluster, *kind, Bytes(*bytes), ep_topo),
            )),
            _ => None,
        })
        .fold((0usize, 0u64, 0.0f64), |(n, b, s), (x, d)| {
            (n + 1, b + x, s + d.0)
        });
    let mut post_p = Program::from_steps(g, &plan.steps, dev, copts, &keep_post, &comm);
    // Vocabulary-parallel cross-entropy in fp32: read the logits, exponentiate and normalise
    // (max and sum all-reduced over tp), write the loss; backward writes the logits' gradient.
    let logits = logits_bytes(cfg, t, seq_local, tp);
    let ce = Kernel::memory(3.0 * logits);
    let ce_b = Kernel::memory(2.0 * logits);
    post_p.ops.push(ProgOp {
        stream: COMPUTE,
        label: "loss.cross_entropy".into(),
        kind: ProgKind::Kernel {
            work: Work {
                time: kernel_time(dev, dt, &ce),
                flops: 0.0,
                bytes: ce.bytes,
            },
            gemm: false,
        },
        alloc: 0,
        free: 0,
        grad: Some(Grad {
            dgrad: Work {
                time: kernel_time(dev, dt, &ce_b),
                flops: 0.0,
                bytes: ce_b.bytes,
            },
            wgrad: None,
            regather: None,
            exchange: None,
            attention: false,
        }),
    });
    if tp > 1 {
        post_p.ops.push(ProgOp {
            stream: COMPUTE,
            label: "loss.max_sum".into(),
            kind: ProgKind::Collective {
                axis: "tp".into(),
                kind: CollectiveKind::AllReduce,
                bytes: (t.micro_batch * seq_local * 8) as u64,
            },
            alloc: 0,
            free: 0,
            grad: None,
        });
    }

    // 2. Forward and backward of each part on one tp group, laid out as the full mesh's.
    let topo = Topology::new(lmesh, cluster)
        .with_axis("tp", tp_topo)
        .with_axis("ep", ep_topo)
        .with_axis("cp", cp_topo);
    // Each program's forward pass, timed when first needed.
    let [mut pre_f, mut layer_f, mut post_f]: [Option<Pass>; 3] = [None; 3];

    // Parameters (tp-local elements).
    let layer_set = params_used(g, &keep_layer);
    let pre_set = params_used(g, &keep_pre);
    let post_set = params_used(g, &keep_post);
    let layer_elems = elems(g, &layer_set);
    // Experts' weights `[experts, out, in]` (local: `experts / ep` of them), synchronised
    // over `dp` alone; the router's `[experts, hidden]` is replicated, a dense parameter.
    let layer_expert = elems(
        g,
        &layer_set
            .iter()
            .copied()
            .filter(|&v| g.ty(v).rank() == 3 && is_expert_major(g.ty(v)))
            .collect(),
    );
    let pre_elems = elems(g, &pre_set);
    let post_elems = elems(g, &post_set);
    let shared_elems = elems(g, &pre_set.intersection(&post_set).copied().collect());

    // Activations a layer saves for its backward under a recomputation.
    let saved = |recompute: Recompute| {
        let o = SavedOptions {
            dtype: dt,
            attention: copts.attention,
            dropout: copts.dropout,
            recompute,
        };
        saved_activations(g, 0, &o)
    };
    let saved_full_layer = saved(Recompute::None);
    // The largest value of a layer; a dense `[experts, ..]` one at its routed fraction.
    let routed = routed_fraction(g);
    let biggest = g
        .ids()
        .filter(|&v| keep_layer(v))
        .map(|v| {
            let b = sim_bytes(g.ty(v), dt);
            let routed_b = if is_expert_major(g.ty(v)) {
                b * routed
            } else {
                b
            };
            routed_b as u64
        })
        .max()
        .unwrap_or(0);
    // The embedding's and head's parts by their recomputation (full recomputation is the
    // layers'; the edges then recompute nothing).
    let mut edges: Vec<(Recompute, Part, Part)> = Vec::new();
    let mut one = |layer_rc: Recompute| -> Result<LayerParts, CostError> {
        let edge_rc = if layer_rc == Recompute::Full {
            Recompute::None
        } else {
            layer_rc
        };
        let kept = edges.iter().find(|e| e.0 == edge_rc).cloned();
        let (pre, layer, post) = match kept {
            Some((_, pre, post)) => {
                let layer = time_part(&layer_p, &mut layer_f, layer_rc, &topo, cluster)?;
                (pre, layer, post)
            }
            None => {
                let pre = time_part(&pre_p, &mut pre_f, edge_rc, &topo, cluster)?;
                let layer = time_part(&layer_p, &mut layer_f, layer_rc, &topo, cluster)?;
                let post = time_part(&post_p, &mut post_f, edge_rc, &topo, cluster)?;
                edges.push((edge_rc, pre.clone(), post.clone()));
                (pre, layer, post)
            }
        };
        let saved_layer = saved(layer_rc);
        Ok(LayerParts {
            pre,
            layer,
            post,
            layer_elems,
            layer_expert,
            pre_elems,
            post_elems,
            shared_elems,
            ep_traffic,
            saved_layer,
            saved_full_layer,
            biggest,
        })
    };
    recomputes.iter().map(|&rc| one(rc)).collect()
}

/// Bytes of one micro-batch's fp32 logits on a rank: `seq_local` tokens a sequence, the
/// vocabulary split over `tp`.
fn logits_bytes(cfg: &ModelConfig, t: &TrainOptions, seq_local: usize, tp: usize) -> f64 {
    (t.micro_batch * seq_local * cfg.vocab / tp) as f64 * 4.0
}

/// The mixture-of-experts arithmetic of an expert-parallel step, per rank and layer (empty
/// for a dense model or without `ep`): routed tokens, expert GEMM FLOPs, all-to-all bytes and
/// where each parameter's gradient is synchronised.
fn moe_notes(
    cfg: &ModelConfig,
    t: &TrainOptions,
    [dp, ep, tp]: [usize; 3],
    dtype_bytes: usize,
    [dense, expert]: [u64; 2],
    (a2a_count, a2a_bytes, a2a_time): (usize, u64, f64),
) -> Vec<String> {
    let Some(moe) = cfg.moe.filter(|_| ep > 1) else {
        return Vec::new();
    };
    let tokens = (t.micro_batch * t.seq) as f64;
    let routed = tokens * moe.top_k as f64;
    let busiest = routed * t.moe_imbalance;
    let (h, f) = (cfg.hidden as f64, cfg.ffn as f64);
    let gemm = 6.0 * h * f * busiest / tp as f64;
    let a2a = busiest * h * dtype_bytes as f64;
    let gib = |x: f64| x / (1u64 << 30) as f64;
    vec![
        format!(
            "moe: {} experts, top-{} routing; ep={ep}: {} expert(s) per rank; outside the experts \
             the ep ranks hold different tokens, as dp ranks do",
            moe.experts,
            moe.top_k,
            moe.experts / ep
        ),
        format!(
            "moe: per rank and micro-batch, {tokens:.0} tokens × top-{} = {routed:.0} routed \
             token-slots; the busiest rank's experts get {busiest:.0} (load imbalance {:.2})",
            moe.top_k, t.moe_imbalance
        ),
        format!(
            "moe: expert GEMMs per layer (gate, up, down) forward = 3 × 2 × hidden {h:.0} × ffn \
             {f:.0} × {busiest:.0} / tp {tp} = {:.3} TFLOP; backward 2×",
            gemm / 1e12
        ),
        format!(
            "moe: all-to-all per layer, dispatch and combine each ≈ {busiest:.0} × hidden {h:.0} × \
             {dtype_bytes} B = {:.3} GiB per tp group ({:.3} GiB per rank with tp {tp}); \
             simulated: {a2a_count} collectives, {:.3} GiB per rank, {:.3} ms forward (the \
             backward the same)",
            gib(a2a),
            gib(a2a / tp as f64),
            gib(a2a_bytes as f64),
            a2a_time * 1e3
        ),
        format!(
            "moe: parameters per layer and rank: dense {:.3} GiB (gradients over dp×ep = {}), \
             experts {:.3} GiB (gradients over dp = {dp})",
            gib(dense as f64 * 2.0),
            dp * ep,
            gib(expert as f64 * 2.0)
        ),
    ]
}

/// The group of rank 0 over the axes whose ranks hold different tokens (`dp`, `ep`, `cp`).
fn data_group(mesh: &Mesh, cluster: &Cluster) -> GroupTopology {
    let data: Vec<_> = crate::shard::DATA_AXES
        .iter()
        .chain(&["cp"])
        .filter_map(|n| mesh.axis(n))
        .collect();
    GroupTopology::of_members(
        &mesh.group_of_first(&data),
        cluster.profile.nvlink_domain.value as usize,
    )
}

/// Scales a layer's mixture-of-experts work by load imbalance `f`: the expert GEMMs and
/// elementwise ops (`*.moe.*` kernels but the router) and the all-to-all traffic over `ep` of
/// the busiest rank, which every rank waits for.
fn imbalance(p: &mut Program, f: f64) {
    for op in &mut p.ops {
        let moe = op.label.contains(".moe.") && !op.label.contains("router");
        match &mut op.kind {
            ProgKind::Kernel { work, .. } if moe => {
                work.time = Seconds(work.time.0 * f);
                if let Some(g) = &mut op.grad {
                    g.dgrad.time = Seconds(g.dgrad.time.0 * f);
                    if let Some(w) = &mut g.wgrad {
                        w.time = Seconds(w.time.0 * f);
                    }
                }
            }
            ProgKind::Collective { axis, bytes, .. } if axis == "ep" => {
                *bytes = (*bytes as f64 * f) as u64;
            }
            _ => {}
        }
    }
}

/// The pipeline stage of `rank`.
fn stage_of(mesh: &Mesh, rank: usize) -> usize {
    mesh.axis("pp")
        .map_or(0, |a| rank / mesh.stride(a) % mesh.axis_size(a))
}
