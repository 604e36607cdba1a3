//! `shardc search`: the fastest way to train a model on a cluster, by the one cost model.
//!
//! The space ([`enumerate`]): every factorisation of the GPUs into `pp × dp × ep × cp × tp`
//! (tensor parallelism inside a node, dividing the heads; pipeline stages no more than the
//! layers; expert parallelism dividing the experts of a mixture-of-experts model; context
//! parallelism splitting the sequence into its head-tail order), and for each: sequence
//! parallelism on or off under `tp`; ZeRO stage 0–3 where gradients are summed over more than
//! one rank; recomputation none, selective or full; every micro-batch size of the options that
//! divides the batch; the pipeline schedules 1F1B, interleaved (2 chunks) and ZB-H1 with
//! `pp > 1`; the context-parallel exchange all-gather, ring or Ulysses with `cp > 1`.
//!
//! [`SpaceLimits`] restricts the options (sp, ZeRO stages, recomputation, schedules, cp), for
//! instance to Megatron-LM's 2021 recipe; the search is exact on the smaller space.
//!
//! Each candidate is simulated by the analytic training model
//! ([`crate::compile::simulate_training`], what `simulate --train` prints), in parallel over
//! the cores, with what layouts share kept across them ([`TrainMemo`]: each layer plan's
//! timed parts, each pipeline schedule). Two rules prune, and neither can change the ranking.
//! Before anything is simulated: the parameters, gradients and optimizer state a rank holds
//! (ZeRO-sharded, counted at their smallest: every parameter split over `tp × pp × ep`)
//! already exceed the usable memory, so the simulated peak, which adds activations, would too.
//! Before a pipeline is replayed: every candidate's step time is bounded from below (its
//! busiest stage's passes back to back, [`StepBound`]) and candidates are simulated in order
//! of their bounds, 1,024 at a time; once the top is full, a bound above its last step
//! time prunes that candidate and every one after it (their memory, which the bound computes
//! exactly, still counts those that do not fit). Candidates are ranked by step time among
//! those that fit; ties go to the candidate whose text sorts first, so the output is
//! deterministic.

pub mod layers;

pub use layers::{search_layers, LayerSearch, LayerSearchError, LayerSearchOptions};

use crate::autodiff::Recompute;
use crate::compile::{layer_plan, simulate_training};
use crate::cost::{
    layer_plan_spec, zero_static, Cluster, ComputeOptions, PipeSchedule, SimReport, StepBound,
    TrainMemo, TrainOptions,
};
use crate::model::{ModelConfig, ModelStats};
use crate::plan::Plan;
use crate::shard::Mesh;
use rayon::prelude::*;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// What to search over, and for.
#[derive(Clone, Debug)]
pub struct SearchOptions {
    /// GPUs to use (all of them).
    pub gpus: usize,
    /// Sequences per optimizer step.
    pub global_batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batch sizes to try.
    pub micro_batches: Vec<usize>,
    /// Fraction of device memory a plan may use (headroom for the allocator, fragmentation).
    pub memory_fraction: f64,
    /// Candidates to keep in the ranking.
    pub top: usize,
    /// Apply the pruning rule (off: every candidate is simulated, for checking the rule).
    pub prune: bool,
    /// Counters the search advances as it goes, for a caller's progress display.
    pub progress: Option<std::sync::Arc<SearchProgress>>,
    /// Which options each mesh's candidates may take (default: all).
    pub limits: SpaceLimits,
}

/// The options a mesh's candidates may take beyond its factorisation; the search stays exact
/// on the smaller space. The default holds everything; [`SpaceLimits::megatron_2021`] is
/// Megatron-LM's recipe of 2021 (Narayanan et al., SC'21).
#[derive(Clone, Debug, PartialEq)]
pub struct SpaceLimits {
    /// Sequence parallelism off, on (a layout with `tp` > 1 takes each listed).
    pub sp: Vec<bool>,
    /// ZeRO stages (a layout summing gradients over one rank takes 0).
    pub zero: Vec<u8>,
    /// Recomputation modes.
    pub recompute: Vec<Recompute>,
    /// Block recomputation (the first `k` layers of each chunk fully recomputed, the fewest
    /// that fit) for layouts that fit with full recomputation but not without; needs `none`
    /// and `full` among the modes.
    pub recompute_blocks: bool,
    /// Pipeline schedules by kind (`1f1b`, `interleaved`, `zb-h1`) for layouts with `pp` > 1.
    pub schedules: Vec<String>,
    /// Context parallelism: `false` admits `cp` = 1, `true` `cp` > 1.
    pub cp: Vec<bool>,
}

impl Default for SpaceLimits {
    fn default() -> SpaceLimits {
        SpaceLimits {
            sp: vec![false, true],
            zero: vec![0, 1, 2, 3],
            recompute: vec![Recompute::None, Recompute::Selective, Recompute::Full],
            recompute_blocks: true,
            schedules: vec!["1f1b".into(), "interleaved".into(), "zb-h1".into()],
            cp: vec![false, true],
        }
    }
}

impl SpaceLimits {
    /// Megatron-LM's 2021 recipe: no sequence parallelism, ZeRO or context parallelism, full
    /// recomputation, 1F1B.
    pub fn megatron_2021() -> SpaceLimits {
        SpaceLimits {
            sp: vec![false],
            zero: vec![0],
            recompute: vec![Recompute::Full],
            recompute_blocks: false,
            schedules: vec!["1f1b".into()],
            cp: vec![false],
        }
    }

    /// The limits as text, `sp off; zero 0; recompute full; schedules 1f1b; cp off` (options
    /// that hold everything left out).
    pub fn describe(&self) -> String {
        let full = SpaceLimits::default();
        // Whether the limits keep every option of `all`.
        fn holds<T: PartialEq>(all: &[T], kept: &[T]) -> bool {
            all.iter().all(|x| kept.contains(x))
        }
        let on_off = |v: &[bool]| {
            v.iter()
                .map(|&b| if b { "on" } else { "off" })
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut parts = Vec::new();
        if !holds(&full.sp, &self.sp) {
            parts.push(format!("sp {}", on_off(&self.sp)));
        }
        if !holds(&full.zero, &self.zero) {
            let z: Vec<String> = self.zero.iter().map(u8::to_string).collect();
            parts.push(format!("zero {}", z.join(",")));
        }
        if !holds(&full.recompute, &self.recompute) || !self.recompute_blocks {
            let mut r: Vec<&str> = self.recompute.iter().map(|r| r.name()).collect();
            if self.recompute_blocks {
                r.push("block");
            }
            parts.push(format!("recompute {}", r.join(",")));
        }
        if !holds(&full.schedules, &self.schedules) {
            parts.push(format!("schedules {}", self.schedules.join(",")));
        }
        if !holds(&full.cp, &self.cp) {
            parts.push(format!("cp {}", on_off(&self.cp)));
        }
        parts.join("; ")
    }

    /// True when the space holds every option.
    pub fn is_full(&self) -> bool {
        self.describe().is_empty()
    }
}

/// How far a running search is: read by a caller (another thread) while it runs.
#[derive(Debug, Default)]
pub struct SearchProgress {
    /// Candidates in the space (set once they are enumerated).
    pub candidates: std::sync::atomic::AtomicUsize,
    /// Candidates bounded (or pruned by memory) so far.
    pub bounded: std::sync::atomic::AtomicUsize,
    /// Candidates simulated so far.
    pub simulated: std::sync::atomic::AtomicUsize,
}

impl SearchProgress {
    fn add(counter: &std::sync::atomic::AtomicUsize, n: usize) {
        counter.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

impl SearchOptions {
    /// Defaults: micro-batches 1, 2, 4, 8; 95% of device memory; the top 10.
    pub fn new(gpus: usize, global_batch: usize, seq: usize) -> SearchOptions {
        SearchOptions {
            gpus,
            global_batch,
            seq,
            micro_batches: vec![1, 2, 4, 8],
            memory_fraction: 0.95,
            top: 10,
            prune: true,
            progress: None,
            limits: SpaceLimits::default(),
        }
    }
}

/// One point of the space.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// The mesh, `pp=4,dp=8,tp=8` (axes of size 1 left out; `dp=1` for one GPU).
    pub mesh: String,
    /// Strategies beyond the axes' defaults (`sp`, `zero1`, `cp-ring`, ..).
    pub strategies: Vec<String>,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Activation recomputation.
    pub recompute: String,
    /// ZeRO stage.
    pub zero: u8,
    /// Pipeline schedule (`1f1b` without a pipeline).
    pub schedule: String,
    /// Full recomputation of the first `k` layers of each pipeline chunk, the others under
    /// `recompute` (Megatron-LM's `--recompute-num-layers`): the fewest that fit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_layers: Option<usize>,
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.mesh)?;
        if !self.strategies.is_empty() {
            write!(f, " --strategy {}", self.strategies.join(","))?;
        }
        write!(
            f,
            " --micro-batch {} --recompute {}",
            self.micro_batch, self.recompute
        )?;
        if let Some(k) = self.recompute_layers {
            write!(f, " --recompute-num-layers {k}")?;
        }
        if self.mesh.contains("pp=") {
            match self.schedule.strip_prefix("interleaved(v=") {
                Some(v) => write!(
                    f,
                    " --schedule interleaved --virtual-stages {}",
                    v.trim_end_matches(')')
                )?,
                None => write!(f, " --schedule {}", self.schedule)?,
            }
        }
        Ok(())
    }
}

/// A simulated candidate.
#[derive(Clone, Debug, Serialize)]
pub struct Scored {
    /// The candidate.
    pub candidate: Candidate,
    /// Seconds per optimizer step.
    pub step_time_s: f64,
    /// Tokens per second per GPU.
    pub tokens_per_s_per_gpu: f64,
    /// Model FLOPs utilisation.
    pub mfu: f64,
    /// Peak memory of the most loaded rank, bytes.
    pub memory_bytes: u64,
    /// Communication nothing overlaps, seconds.
    pub exposed_comm_s: f64,
    /// Idle pipeline time over the step.
    pub bubble_fraction: f64,
    /// Compute-stream busy time, seconds.
    pub compute_s: f64,
}

impl Scored {
    fn of(candidate: Candidate, r: &SimReport) -> Scored {
        Scored {
            candidate,
            step_time_s: r.step_time_s,
            tokens_per_s_per_gpu: r.tokens_per_s / r.gpus.max(1) as f64,
            mfu: r.mfu,
            memory_bytes: r.peak_memory_bytes_per_rank,
            exposed_comm_s: r.exposed_comm_s,
            bubble_fraction: r.bubble_fraction,
            compute_s: r.compute_s,
        }
    }
}

/// What a search found.
#[derive(Clone, Debug, Serialize)]
pub struct SearchReport {
    /// The best candidates that fit, fastest first.
    pub top: Vec<Scored>,
    /// Candidates enumerated.
    pub candidates: usize,
    /// Candidates simulated.
    pub evaluated: usize,
    /// Candidates pruned, by rule.
    pub pruned: BTreeMap<String, usize>,
    /// Simulated candidates that do not fit in memory.
    pub too_big: usize,
    /// Candidates the model refused (a layout the compiler cannot build).
    pub refused: usize,
    /// Wall-clock seconds.
    pub search_time_s: f64,
}

impl SearchReport {
    /// The fastest candidate that fits.
    pub fn best(&self) -> Option<&Scored> {
        self.top.first()
    }
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n % d == 0).collect()
}

/// The candidates of the space (see the module docs), in a fixed order.
pub fn enumerate(cfg: &ModelConfig, cluster: &Cluster, o: &SearchOptions) -> Vec<Candidate> {
    let mut out = Vec::new();
    let node = cluster.gpus_per_node();
    let experts = cfg.moe.map(|m| m.experts);
    for tp in divisors(o.gpus) {
        if tp > node || cfg.heads % tp != 0 || (cfg.kv_heads % tp != 0 && tp % cfg.kv_heads != 0) {
            continue;
        }
        for pp in divisors(o.gpus / tp) {
            if pp > cfg.layers {
                continue;
            }
            for cp in divisors(o.gpus / (tp * pp)) {
                if (cp > 1 && o.seq % (2 * cp) != 0) || !o.limits.cp.contains(&(cp > 1)) {
                    continue;
                }
                for ep in divisors(o.gpus / (tp * pp * cp)) {
                    if ep > 1 && experts.is_none_or(|e| e % ep != 0) {
                        continue;
                    }
                    let dp = o.gpus / (tp * pp * cp * ep);
                    add_meshes(cfg, o, [pp, dp, ep, cp, tp], &mut out);
                }
            }
        }
    }
    out
}

/// The candidates of one mesh `[pp, dp, ep, cp, tp]`.
fn add_meshes(cfg: &ModelConfig, o: &SearchOptions, sizes: [usize; 5], out: &mut Vec<Candidate>) {
    let [pp, dp, ep, cp, tp] = sizes;
    let names = ["pp", "dp", "ep", "cp", "tp"];
    let mut axes: Vec<String> = names
        .iter()
        .zip(sizes)
        .filter(|&(_, s)| s > 1)
        .map(|(n, s)| format!("{n}={s}"))
        .collect();
    if axes.is_empty() {
        axes.push("dp=1".into());
    }
    let mesh = axes.join(",");
    let data = dp * ep;
    let lim = &o.limits;
    let sps: &[bool] = if tp > 1 { &[false, true] } else { &[false] };
    let sps: Vec<bool> = sps.iter().copied().filter(|s| lim.sp.contains(s)).collect();
    let zeros: &[u8] = if dp * cp > 1 { &[0, 1, 2, 3] } else { &[0] };
    let zeros: Vec<u8> = zeros
        .iter()
        .copied()
        .filter(|z| lim.zero.contains(z))
        .collect();
    let cps: &[&str] = if cp > 1 {
        &["cp-allgather", "cp-ring", "cp-ulysses"]
    } else {
        &[""]
    };
    let mut schedules = vec![PipeSchedule::OneFOneB];
    if pp > 1 {
        if cfg.layers % (2 * pp) == 0 {
            schedules.push(PipeSchedule::Interleaved(2));
        }
        schedules.push(PipeSchedule::ZbH1);
        schedules.retain(|s| lim.schedules.iter().any(|k| k == s.kind().name()));
    }
    for &mb in &o.micro_batches {
        if o.global_batch % (data * mb) != 0 {
            continue;
        }
        // A pipeline needs at least as many micro-batches as stages.
        if pp > 1 && o.global_batch / (data * mb) < pp {
            continue;
        }
        for &sp in &sps {
            for &zero in &zeros {
                for &cpv in cps {
                    for &rc in &lim.recompute {
                        for &schedule in &schedules {
                            let mut strategies = Vec::new();
                            if sp {
                                strategies.push("sp".to_string());
                            }
                            if zero > 0 {
                                strategies.push(format!("zero{zero}"));
                            }
                            if !cpv.is_empty() {
                                strategies.push(cpv.to_string());
                            }
                            out.push(Candidate {
                                mesh: mesh.clone(),
                                strategies,
                                micro_batch: mb,
                                recompute: rc.name().to_string(),
                                zero,
                                schedule: schedule.label(),
                                recompute_layers: None,
                            });
                        }
                    }
                }
            }
        }
    }
}

/// What every candidate's simulation shares: the model's forward FLOPs per token and the
/// compiler's layer split for each pipeline chunk count (both the same for every layout).
#[derive(Default)]
struct Shared {
    forward_flops_per_token: Option<u64>,
    stage_layers: HashMap<usize, Vec<usize>>,
}

impl Shared {
    fn new(
        cfg: &ModelConfig,
        stats: &ModelStats,
        candidates: &[Candidate],
        o: &SearchOptions,
    ) -> Shared {
        let mut s = Shared {
            forward_flops_per_token: Some(stats.forward_flops_per_token),
            ..Shared::default()
        };
        for c in candidates {
            let chunks = size(&c.mesh, "pp") * schedule(c).chunks();
            if chunks > 1 && !s.stage_layers.contains_key(&chunks) {
                if let Ok(specs) = crate::train::chunk_specs(cfg, chunks, o.seq, None) {
                    let layers = specs.iter().map(|c| c.layers.len()).collect();
                    s.stage_layers.insert(chunks, layers);
                }
            }
        }
        s
    }
}

/// The training options of candidate `c` (with what `shared` already knows).
fn train_options(c: &Candidate, o: &SearchOptions, shared: Option<&Shared>) -> TrainOptions {
    let mut t = TrainOptions::new(o.global_batch, c.micro_batch, o.seq);
    t.recompute = Recompute::from_name(&c.recompute).unwrap_or(Recompute::None);
    t.recompute_layers = c.recompute_layers;
    t.zero = c.zero;
    t.strategies = c.strategies.clone();
    t.timelines = false;
    t.schedule = schedule(c);
    if let Some(sh) = shared {
        t.forward_flops_per_token = sh.forward_flops_per_token;
        let chunks = size(&c.mesh, "pp") * t.schedule.chunks();
        t.chunk_layers = sh.stage_layers.get(&chunks).cloned();
    }
    t
}

/// Candidate `c`'s pipeline schedule.
fn schedule(c: &Candidate) -> PipeSchedule {
    [PipeSchedule::ZbH1, PipeSchedule::Interleaved(2)]
        .into_iter()
        .find(|s| s.label() == c.schedule)
        .unwrap_or(PipeSchedule::OneFOneB)
}

/// Size of axis `name` in mesh text `mesh`.
fn size(mesh: &str, name: &str) -> usize {
    mesh.split(',')
        .filter_map(|a| a.split_once('='))
        .find(|(n, _)| *n == name)
        .and_then(|(_, s)| s.parse().ok())
        .unwrap_or(1)
}

/// Whether `c`'s parameters, gradients and optimizer state alone (at their smallest) exceed
/// `capacity` bytes: a lower bound of its peak memory.
fn static_bound_exceeds(c: &Candidate, params: u64, capacity: f64) -> bool {
    let s = |n| size(&c.mesh, n);
    let split = (s("tp") * s("pp") * s("ep")) as u64;
    let psi = params / split.max(1);
    let (w, g, opt) = zero_static(psi, s("dp") * s("ep") * s("cp"), c.zero);
    (w.0 + g.0 + opt.0) as f64 > capacity
}

/// The candidates the pruning rule drops for `cfg` under `o` (for checking the rule).
pub fn pruned_candidates(
    cfg: &ModelConfig,
    cluster: &Cluster,
    o: &SearchOptions,
) -> Vec<Candidate> {
    let Ok(stats) = ModelStats::compute(cfg, o.seq) else {
        return Vec::new();
    };
    let capacity = cluster.device.memory_bytes.value * o.memory_fraction;
    enumerate(cfg, cluster, o)
        .into_iter()
        .filter(|c| static_bound_exceeds(c, stats.params, capacity))
        .collect()
}

/// Candidates simulated at a time between updates of the top's last step time.
const ROUND: usize = 1024;

/// Searches the space for `cfg` on `cluster` (see the module docs).
pub fn search(
    cfg: &ModelConfig,
    source: &str,
    cluster: &Cluster,
    o: &SearchOptions,
    copts: &ComputeOptions,
) -> Result<SearchReport, crate::model::ModelError> {
    let start = std::time::Instant::now();
    let candidates = enumerate(cfg, cluster, o);
    let stats = ModelStats::compute(cfg, o.seq)?;
    let params = stats.params;
    let capacity = cluster.device.memory_bytes.value * o.memory_fraction;
    let (kept, pruned): (Vec<&Candidate>, Vec<&Candidate>) = candidates
        .iter()
        .partition(|c| !(o.prune && static_bound_exceeds(c, params, capacity)));
    let progress = |f: &dyn Fn(&SearchProgress)| {
        if let Some(p) = &o.progress {
            f(p);
        }
    };
    progress(&|p| {
        SearchProgress::add(&p.candidates, candidates.len());
        SearchProgress::add(&p.bounded, pruned.len());
    });
    // Each candidate's two-layer plan: it depends on the layer's mesh (tp, cp, ep), sp, the
    // cp exchange and the micro-batch, not on dp, pp, ZeRO, recomputation or the schedule, so
    // the distinct ones are compiled once each.
    let shared = Shared::new(cfg, &stats, &candidates, o);
    let prepared: Vec<Option<(Mesh, TrainOptions, String)>> = kept
        .par_iter()
        .map(|c| {
            let mesh = Mesh::parse(&c.mesh, cluster.gpus_per_node()).ok()?;
            let t = train_options(c, o, Some(&shared));
            let spec = layer_plan_spec(cfg, &mesh, &t, cluster).ok()?;
            let key = format!(
                "{} {}x{} {}",
                spec.mesh,
                spec.batch,
                spec.seq,
                spec.strategies.join(",")
            );
            Some((mesh, t, key))
        })
        .collect();
    let mut specs: BTreeMap<String, crate::cost::LayerPlanSpec> = BTreeMap::new();
    for (mesh, t, key) in prepared.iter().flatten() {
        if !specs.contains_key(key) {
            if let Ok(spec) = layer_plan_spec(cfg, mesh, t, cluster) {
                specs.insert(key.clone(), spec);
            }
        }
    }
    let plans: HashMap<String, Plan> = specs
        .into_par_iter()
        .filter_map(|(key, spec)| layer_plan(cfg, source, &spec).ok().map(|p| (key, p)))
        .collect();
    // Each plan's parts are timed once per configuration that times them differently, each
    // pipeline schedule built once. Every candidate's step time is bounded from below and its
    // memory computed before any pipeline is replayed; candidates are then simulated in order
    // of their bounds, a round at a time, until the top is full and the next bound exceeds
    // its last step time: neither that candidate nor any after it can enter the top.
    let memo = TrainMemo::new();
    let bounds: Vec<Option<StepBound>> = prepared
        .par_iter()
        .map(|p| {
            progress(&|p| SearchProgress::add(&p.bounded, 1));
            let (mesh, t, key) = p.as_ref()?;
            let plan = plans.get(key)?;
            memo.bound(key, cfg, plan, mesh, t, cluster, copts).ok()
        })
        .collect();
    // Block recomputation: for a layout that fits with full recomputation but not without,
    // the first k layers of each chunk fully recomputed, k the fewest that fit (a step's time
    // grows with k and its memory falls, so that k is the best of the family).
    let mut kept: Vec<Candidate> = kept.into_iter().cloned().collect();
    let (mut prepared, mut bounds) = (prepared, bounds);
    let lim = &o.limits;
    let mut blocks = 0;
    if lim.recompute_blocks
        && lim.recompute.contains(&Recompute::None)
        && lim.recompute.contains(&Recompute::Full)
    {
        let fits = |b: &StepBound| b.peak_memory_bytes_per_rank as f64 <= capacity;
        let fits_at = |i: usize| bounds[i].as_ref().is_some_and(fits);
        let family = |c: &Candidate| {
            Candidate {
                recompute: String::new(),
                ..c.clone()
            }
            .to_string()
        };
        let full_at: HashMap<String, usize> = (0..kept.len())
            .filter(|&i| kept[i].recompute == "full")
            .map(|i| (family(&kept[i]), i))
            .collect();
        let todo: Vec<usize> = (0..kept.len())
            .filter(|&i| {
                kept[i].recompute == "none"
                    && bounds[i].is_some()
                    && !fits_at(i)
                    && full_at.get(&family(&kept[i])).is_some_and(|&j| fits_at(j))
            })
            .collect();
        let found: Vec<Option<(usize, usize, StepBound)>> = todo
            .par_iter()
            .map(|&i| {
                let (mesh, t, key) = prepared[i].as_ref()?;
                let plan = plans.get(key)?;
                let most = t
                    .chunk_layers
                    .as_ref()
                    .and_then(|c| c.iter().max().copied())
                    .unwrap_or(cfg.layers);
                let at = |k: usize| {
                    let tk = TrainOptions {
                        recompute_layers: Some(k),
                        ..t.clone()
                    };
                    memo.bound(key, cfg, plan, mesh, &tk, cluster, copts).ok()
                };
                // The fewest k in 1..most that fit (most − 1 fitting, or none does).
                let (mut lo, mut hi) = (1, most.checked_sub(1)?);
                let mut best = at(hi).filter(fits).filter(|_| lo <= hi)?;
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    match at(mid).filter(fits) {
                        Some(b) => {
                            best = b;
                            hi = mid;
                        }
                        None => lo = mid + 1,
                    }
                }
                Some((i, hi, best))
            })
            .collect();
        for (i, k, b) in found.into_iter().flatten() {
            let c = Candidate {
                recompute_layers: Some(k),
                ..kept[i].clone()
            };
            let p = prepared[i].as_ref().map(|(mesh, t, key)| {
                let t = TrainOptions {
                    recompute_layers: Some(k),
                    ..t.clone()
                };
                (mesh.clone(), t, key.clone())
            });
            kept.push(c);
            prepared.push(p);
            bounds.push(Some(b));
            blocks += 1;
        }
        progress(&|p| SearchProgress::add(&p.candidates, blocks));
    }
    let mut refused = bounds.iter().filter(|b| b.is_none()).count();
    let lower = |i: usize| bounds[i].map_or(f64::INFINITY, |b| b.step_time_s);
    let mut order: Vec<usize> = (0..kept.len()).filter(|&i| bounds[i].is_some()).collect();
    order.sort_by(|&a, &b| lower(a).total_cmp(&lower(b)).then(a.cmp(&b)));
    let top = o.top.max(1);
    let mut fit: Vec<Scored> = Vec::new();
    let mut too_big = 0;
    let mut next = 0;
    while next < order.len() {
        let last = match fit.get(top - 1) {
            Some(s) if o.prune => s.step_time_s,
            _ => f64::INFINITY,
        };
        let within = order[next..].partition_point(|&i| lower(i) <= last);
        if within == 0 {
            break;
        }
        let end = next + within.min(ROUND);
        let results: Vec<Option<Scored>> = order[next..end]
            .par_iter()
            .map(|&i| {
                progress(&|p| SearchProgress::add(&p.simulated, 1));
                let (mesh, t, key) = prepared[i].as_ref()?;
                let plan = plans.get(key)?;
                memo.simulate(key, cfg, plan, source, mesh, t, cluster, copts)
                    .ok()
                    .map(|s| Scored::of(kept[i].clone(), &s.report))
            })
            .collect();
        for r in results {
            match r {
                Some(s) if s.memory_bytes as f64 <= capacity => fit.push(s),
                Some(_) => too_big += 1,
                None => refused += 1,
            }
        }
        fit.sort_by(|a, b| {
            a.step_time_s
                .total_cmp(&b.step_time_s)
                .then_with(|| a.candidate.to_string().cmp(&b.candidate.to_string()))
        });
        fit.truncate(top);
        next = end;
    }
    // The bound's memory is the simulated step's.
    let bounded = &order[next..];
    too_big += bounded
        .iter()
        .filter_map(|&i| bounds[i])
        .filter(|b| b.peak_memory_bytes_per_rank as f64 > capacity)
        .count();
    let mut pruned_by = BTreeMap::new();
    if !pruned.is_empty() {
        pruned_by.insert("static memory bound".to_string(), pruned.len());
    }
    if !bounded.is_empty() {
        pruned_by.insert("step-time bound".to_string(), bounded.len());
    }
    Ok(SearchReport {
        top: fit,
        candidates: candidates.len() + blocks,
        evaluated: kept.len() - bounded.len(),
        pruned: pruned_by,
        too_big,
        refused,
        search_time_s: start.elapsed().as_secs_f64(),
    })
}

/// Simulates one candidate (the hand-picked layouts a search compares with).
pub fn evaluate(
    cfg: &ModelConfig,
    source: &str,
    cluster: &Cluster,
    o: &SearchOptions,
    copts: &ComputeOptions,
    c: &Candidate,
) -> Option<Scored> {
    let mesh = Mesh::parse(&c.mesh, cluster.gpus_per_node()).ok()?;
    let t = train_options(c, o, None);
    simulate_training(cfg, source, &mesh, &t, cluster, copts)
        .ok()
        .map(|s| Scored::of(c.clone(), &s.report))
}
