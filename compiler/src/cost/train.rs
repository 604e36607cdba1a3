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
//! 4. The pipeline schedule runs as a per-stage discrete-event simulation ([`run_pipeline`]),
//!    point-to-point transfers of one micro-batch's activations between stages (scattered over
//!    the `tp` ranks and gathered over NVLink, as Megatron-LM does).
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
use super::pipe::{run_pipeline, PipeRun, PipeSchedule};
use super::profile::Cluster;
use super::program::{Grad, ProgKind, ProgOp, Program, Work, COMPUTE};
use super::replay::{replay, Topology};
use super::report::{SimReport, Simulation, Slice, StageReport, Timeline};
use super::roofline::{kernel_time, sim_bytes, ComputeOptions, Kernel};
use super::simulate::{check_gpus, rank_labels};
use super::units::{Bytes, Seconds};
use super::CostError;
use crate::compile::{compile_forward, CompileError, CompileOptions};
use crate::ir::{Graph, Op, ValueId};
use crate::model::{ModelConfig, ModelStats};
use crate::plan::Plan;
use crate::shard::{Mesh, ShardError};
use std::collections::BTreeSet;

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
}

impl TrainOptions {
    /// Defaults: no recomputation, ZeRO-0, 1F1B, no overlap, scatter/gather on.
    pub fn new(global_batch: usize, micro_batch: usize, seq: usize) -> TrainOptions {
        TrainOptions {
            global_batch,
            micro_batch,
            seq,
            recompute: Recompute::None,
            zero: 0,
            schedule: PipeSchedule::OneFOneB,
            overlap_grad_reduce: false,
            scatter_gather: true,
            strategies: Vec::new(),
        }
    }

    fn sp(&self) -> bool {
        self.strategies
            .iter()
            .flat_map(|s| s.split(','))
            .any(|s| s.trim() == "sp")
    }
}

/// One program's forward and derived backward, timed on a tensor-parallel group.
#[derive(Clone, Debug, Default)]
struct Part {
    fwd: Seconds,
    fwd_compute: Seconds,
    fwd_comm: Seconds,
    fwd_comm_bytes: u64,
    bwd: Seconds,
    bwd_compute: Seconds,
    bwd_comm: Seconds,
    bwd_comm_bytes: u64,
    fwd_flops: f64,
    bwd_flops: f64,
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

fn time_part(
    fwd: &Program,
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
    let rf = replay(fwd, topo, cluster, false)?;
    let rb = replay(&bwd, topo, cluster, false)?;
    let (f, b) = (&rf.ranks[rf.critical_rank()], &rb.ranks[rb.critical_rank()]);
    Ok(Part {
        fwd: f.end,
        fwd_compute: f.compute,
        fwd_comm: f.comm,
        fwd_comm_bytes: comm_bytes(fwd),
        bwd: b.end,
        bwd_compute: b.compute,
        bwd_comm: b.comm,
        bwd_comm_bytes: comm_bytes(&bwd),
        fwd_flops: fwd.flops(),
        bwd_flops: bwd.flops(),
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

fn compile_error(e: impl Into<ShardError>) -> CostError {
    CostError::Compile(CompileError::Shard(e.into()))
}

/// Simulates one training step of `cfg` on `mesh` (axes `dp`, `tp`, `pp`) on `cluster`.
pub fn simulate_training(
    cfg: &ModelConfig,
    source: &str,
    mesh: &Mesh,
    t: &TrainOptions,
    cluster: &Cluster,
    copts: &ComputeOptions,
) -> Result<Simulation, CostError> {
    check_gpus(mesh, cluster)?;
    for a in &mesh.axes {
        if !["dp", "tp", "pp"].contains(&a.name.as_str()) && a.size > 1 {
            return Err(CostError::UnsupportedAxis {
                axis: a.name.clone(),
                size: a.size,
            });
        }
    }
    let size = |n: &str| mesh.axis(n).map_or(1, |a| mesh.axis_size(a));
    let (dp, tp, pp) = (size("dp"), size("tp"), size("pp"));
    let world = mesh.world_size();
    let sp = t.sp();
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
    if cfg.layers % (pp * v) != 0 {
        return Err(CostError::Indivisible {
            what: "layers".into(),
            size: cfg.layers,
            by: if v > 1 { "pp*virtual-stages" } else { "pp" }.into(),
            parts: pp * v,
        });
    }
    if t.global_batch == 0 || t.global_batch % (dp * t.micro_batch) != 0 {
        return Err(CostError::Indivisible {
            what: "global batch".into(),
            size: t.global_batch,
            by: "dp*micro-batch".into(),
            parts: dp * t.micro_batch,
        });
    }
    let m = t.global_batch / (dp * t.micro_batch);
    let n_layers = cfg.layers / (pp * v);
    let dev = &cluster.device;
    let dt = copts.dtype;

    // 1. The two-layer plan on the tensor-parallel mesh.
    let mut c2 = cfg.clone();
    c2.layers = cfg.layers.min(2);
    let lmesh = Mesh::parse(&format!("tp={tp}"), cluster.gpus_per_node()).map_err(compile_error)?;
    let compiled = compile_forward(
        &c2,
        &CompileOptions {
            batch: t.micro_batch,
            seq: t.seq,
            mesh: lmesh.clone(),
            extra_strategies: if sp { vec!["sp".into()] } else { Vec::new() },
        },
    )?;
    let plan = Plan::new(&compiled, source, cfg.arch.name(), c2.layers);
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
    let outputs: BTreeSet<u32> = plan
        .provenance
        .iter()
        .filter(|(_, p)| matches!(p.required_by, crate::shard::ReshardReason::Output { .. }))
        .map(|(&v, _)| v)
        .collect();
    let keep_layer = |v: ValueId| g.node(v).layer == Some(0);
    let keep_pre = |v: ValueId| g.node(v).layer.is_none() && v.index() < first;
    let keep_post =
        |v: ValueId| g.node(v).layer.is_none() && v.index() > last && !outputs.contains(&v.0);
    let tp_topo = GroupTopology::of_axis(mesh, "tp", cluster);
    let comm = |_: &str, kind: CollectiveKind, bytes: u64| {
        collective_time(cluster, kind, Bytes(bytes), tp_topo)
    };
    let pre_p = Program::from_steps(g, &plan.steps, dev, copts, &keep_pre, &comm);
    let layer_p = Program::from_steps(g, &plan.steps, dev, copts, &keep_layer, &comm);
    let mut post_p = Program::from_steps(g, &plan.steps, dev, copts, &keep_post, &comm);
    // Vocabulary-parallel cross-entropy in fp32: read the logits, exponentiate and normalise
    // (max and sum all-reduced over tp), write the loss; backward writes the logits' gradient.
    let logits = (t.micro_batch * t.seq * cfg.vocab / tp) as f64 * 4.0;
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
                bytes: (t.micro_batch * t.seq * 8) as u64,
            },
            alloc: 0,
            free: 0,
            grad: None,
        });
    }

    // 2. Forward and backward of each part on one tp group, laid out as the full mesh's.
    let topo = Topology::new(&lmesh, cluster).with_axis("tp", tp_topo);
    let layer_rc = t.recompute;
    let edge_rc = if t.recompute == Recompute::Full {
        Recompute::None
    } else {
        t.recompute
    };
    let pre = time_part(&pre_p, edge_rc, &topo, cluster)?;
    let mut layer = time_part(&layer_p, layer_rc, &topo, cluster)?;
    let post = time_part(&post_p, edge_rc, &topo, cluster)?;

    // Parameters (tp-local elements).
    let layer_set = params_used(g, &keep_layer);
    let pre_set = params_used(g, &keep_pre);
    let post_set = params_used(g, &keep_post);
    let layer_elems = elems(g, &layer_set);
    let pre_elems = elems(g, &pre_set);
    let post_elems = elems(g, &post_set);
    let shared_elems = elems(g, &pre_set.intersection(&post_set).copied().collect());

    // 3. ZeRO-3: each layer's parameters gathered before its forward and backward, its
    // gradients reduce-scattered, prefetched behind the layer's compute.
    let dp_topo = GroupTopology::of_axis(mesh, "dp", cluster);
    let ct = |k: CollectiveKind, b: u64, topo: GroupTopology| {
        collective_time(cluster, k, Bytes(b), topo)
    };
    if t.zero == 3 && dp > 1 {
        let bytes = layer_elems * 2;
        let ag = ct(CollectiveKind::AllGather, bytes, dp_topo);
        let rs = ct(CollectiveKind::ReduceScatter, bytes, dp_topo);
        layer.fwd = layer.fwd.max(ag);
        layer.bwd = layer.bwd.max(ag + rs);
        layer.fwd_comm += ag;
        layer.bwd_comm += ag + rs;
        layer.fwd_comm_bytes += bytes;
        layer.bwd_comm_bytes += 2 * bytes;
    }

    // Chunk costs.
    let last_gc = pp * v - 1;
    let chunk = |s: usize, c: usize, f: &dyn Fn(&Part) -> f64| -> f64 {
        let gc = c * pp + s;
        n_layers as f64 * f(&layer)
            + if gc == 0 { f(&pre) } else { 0.0 }
            + if gc == last_gc { f(&post) } else { 0.0 }
    };
    let dur = |s: usize, c: usize, fwd: bool| {
        chunk(s, c, &|p: &Part| if fwd { p.fwd.0 } else { p.bwd.0 })
    };
    let compute_of = |s: usize, c: usize, fwd: bool| {
        chunk(s, c, &|p: &Part| {
            if fwd {
                p.fwd_compute.0
            } else {
                p.bwd_compute.0
            }
        })
    };
    let comm_of = |s: usize, c: usize, fwd: bool| {
        chunk(s, c, &|p: &Part| {
            if fwd {
                p.fwd_comm.0
            } else {
                p.bwd_comm.0
            }
        })
    };
    let flops_of = |s: usize, c: usize, fwd: bool| {
        chunk(s, c, &|p: &Part| {
            if fwd {
                p.fwd_flops
            } else {
                p.bwd_flops
            }
        })
    };
    let comm_bytes_of = |s: usize, c: usize, fwd: bool| {
        chunk(s, c, &|p: &Part| {
            (if fwd {
                p.fwd_comm_bytes
            } else {
                p.bwd_comm_bytes
            }) as f64
        })
    };

    // 4. The pipeline.
    let act_bytes = (t.micro_batch * t.seq * cfg.hidden * dt.size_bytes()) as u64;
    let pp_topo = GroupTopology::of_axis(mesh, "pp", cluster);
    let hop = if pp_topo.crosses_network() {
        GroupTopology {
            ranks: 2,
            per_domain: 1,
            domains: 2,
        }
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
    let run: PipeRun = run_pipeline(schedule, pp, m, &dur, p2p.0)?;

    // 5. Gradient synchronisation, embedding all-reduce, optimizer.
    let stage_elems: Vec<u64> = (0..pp)
        .map(|s| {
            let mut e = layer_elems * (n_layers * v) as u64;
            if s == 0 {
                e += pre_elems;
            }
            if s == pp - 1 {
                e += post_elems;
                if pp == 1 {
                    e -= shared_elems;
                }
            }
            e
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
    let saved_opts = SavedOptions {
        dtype: dt,
        attention: copts.attention,
        dropout: copts.dropout,
        recompute: t.recompute,
    };
    let saved_layer = saved_activations(g, 0, &saved_opts);
    let saved_full_layer = saved_activations(
        g,
        0,
        &SavedOptions {
            recompute: Recompute::None,
            ..saved_opts
        },
    );
    let biggest = g
        .ids()
        .filter(|&v| keep_layer(v))
        .map(|v| sim_bytes(g.ty(v), dt) as u64)
        .max()
        .unwrap_or(0);
    let chunk_act = saved_layer.0 * n_layers as u64;

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
    for (s, &psi) in stage_elems.iter().enumerate() {
        let pipe_end = run.stage_end(s);
        let mut tl = Timeline {
            tracks: vec!["compute".into(), "comm:pp".into(), "comm:dp".into()],
            ..Timeline::default()
        };
        for e in &run.stages[s] {
            let (c, f) = (e.op.chunk, e.op.fwd);
            tl.slices.push(Slice {
                track: 0,
                name: format!("{} mb{} chunk{}", if f { "F" } else { "B" }, e.op.mb, c),
                cat: if f { "forward" } else { "backward" }.into(),
                start: e.start,
                dur: e.end - e.start,
                bytes: comm_bytes_of(s, c, f) as u64,
                flops: flops_of(s, c, f),
            });
            if let Some(r) = e.recv {
                tl.slices.push(Slice {
                    track: 1,
                    name: format!("recv {} mb{}", if f { "act" } else { "grad" }, e.op.mb),
                    cat: "p2p".into(),
                    start: r,
                    dur: p2p.0,
                    bytes: p2p_bytes,
                    flops: 0.0,
                });
            }
        }
        // Gradient reduction: per-layer buckets, ready through the chunk's last backward when
        // overlapped, all at the end of the pipeline otherwise.
        let mut sync_free = 0f64;
        let mut sync_total = 0f64;
        let mut param_ag = 0f64;
        if dp > 1 && t.zero < 3 {
            let mut buckets: Vec<(f64, u64)> = Vec::new();
            for c in 0..v {
                let lastb = run.stages[s]
                    .iter()
                    .rev()
                    .find(|e| !e.op.fwd && e.op.chunk == c);
                let (b0, b1) = match (t.overlap_grad_reduce, lastb) {
                    (true, Some(e)) => (e.start, e.end),
                    _ => (pipe_end, pipe_end),
                };
                for j in 0..n_layers {
                    let ready = b0 + (j + 1) as f64 * (b1 - b0) / n_layers as f64;
                    buckets.push((ready, layer_elems * 2));
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
                    buckets.push((b1, edge * 2));
                }
            }
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            for (ready, bytes) in buckets {
                let d = ct(grad_kind, bytes, dp_topo).0;
                let start = sync_free.max(ready);
                tl.slices.push(Slice {
                    track: 2,
                    name: format!("grad {}", grad_kind.name()),
                    cat: "collective".into(),
                    start,
                    dur: d,
                    bytes,
                    flops: 0.0,
                });
                sync_free = start + d;
                sync_total += d;
            }
            if t.zero >= 1 {
                param_ag = ct(CollectiveKind::AllGather, psi * 2, dp_topo).0;
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
            psi.div_ceil(dp as u64)
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
        let (w, gr, opt) = zero_static(psi, dp, t.zero);
        let (peak_if, in_flight) = run.in_flight(s);
        let mut transient = 2 * biggest;
        if t.recompute == Recompute::Full {
            transient += saved_full_layer.0;
        }
        if s == pp - 1 {
            transient = transient.max(2 * logits as u64);
        }
        let memory = MemoryBreakdown {
            params: w,
            grads: gr,
            optimizer: opt,
            activations: Bytes(peak_if as u64 * chunk_act),
            transient: Bytes(transient),
            comm_buffers: Bytes(if t.zero == 3 && dp > 1 {
                2 * layer_elems * 2
            } else {
                0
            }),
        };
        let base = (w + gr + opt + memory.comm_buffers).0;
        tl.memory = std::iter::once((0.0, base))
            .chain(
                in_flight
                    .iter()
                    .map(|&(tm, n)| (tm, base + n as u64 * chunk_act)),
            )
            .collect();
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
            run.stages[s]
                .iter()
                .map(|e| flops_of(s, e.op.chunk, e.op.fwd))
                .sum()
        })
        .collect();
    let flops: f64 = per_rank_flops.iter().sum::<f64>() * (tp * dp) as f64;
    let stats = ModelStats::compute(cfg, t.seq).map_err(|e| CostError::Compile(e.into()))?;
    let tokens = (t.global_batch * t.seq) as f64;
    let model_flops = 3.0 * stats.forward_flops_per_token as f64 * tokens;
    let per_gpu = |f: f64| {
        if step > 0.0 {
            f / step / world as f64
        } else {
            0.0
        }
    };
    let ce = &run.stages[crit];
    let exposed_in_ops: f64 = ce
        .iter()
        .map(|e| dur(crit, e.op.chunk, e.op.fwd) - compute_of(crit, e.op.chunk, e.op.fwd))
        .sum();
    let comm_in_ops: f64 = ce.iter().map(|e| comm_of(crit, e.op.chunk, e.op.fwd)).sum();
    let remote_ops = ce.iter().filter(|e| e.recv.is_some()).count() as f64;
    let co = &outs[crit];
    let edge_comm = if crit == 0 || crit == pp - 1 {
        emb_sync.0
    } else {
        0.0
    };
    let exposed =
        exposed_in_ops + run.p2p_exposed(crit) + co.sync_exposed + edge_comm + co.param_ag;
    let comm_total = comm_in_ops + p2p.0 * remote_ops + co.sync_total + edge_comm + co.param_ag;
    let compute: f64 = ce
        .iter()
        .map(|e| compute_of(crit, e.op.chunk, e.op.fwd))
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
            layers: n_layers * v,
            end_s: outs[s].end,
            busy_s: run.busy(s),
            bubble_s: run.bubble(s),
            p2p_exposed_s: run.p2p_exposed(s),
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
        schedule: Some(match schedule {
            PipeSchedule::Gpipe => "gpipe".to_string(),
            PipeSchedule::OneFOneB => "1f1b".to_string(),
            PipeSchedule::Interleaved(v) => format!("interleaved(v={v})"),
        }),
        recompute: Some(
            match t.recompute {
                Recompute::None => "none",
                Recompute::Selective => "selective",
                Recompute::Full => "full",
            }
            .into(),
        ),
        zero: Some(t.zero),
        step_time_s: step,
        tokens_per_s: if step > 0.0 { tokens / step } else { 0.0 },
        flops_per_step: flops,
        model_flops_per_step: model_flops,
        tflops_per_gpu: per_gpu(flops) / 1e12,
        model_tflops_per_gpu: per_gpu(model_flops) / 1e12,
        mfu: per_gpu(model_flops) / dev.peak(dt),
        compute_s: compute,
        comm_s: comm_total,
        exposed_comm_s: exposed,
        hidden_comm_s: (comm_total - exposed).max(0.0),
        bubble_fraction: if step > 0.0 { bubble / step } else { 0.0 },
        pipeline_s: run.makespan.0,
        optimizer_s: co.optimizer,
        peak_memory_bytes_per_rank: wm.total().0,
        peak_memory_rank: worst_rank,
        memory_breakdown: wm,
        device_memory_bytes: device_memory.0,
        fits: outs.iter().all(|o| o.memory.total() <= device_memory),
        stages,
    };
    let rank_timeline = (0..world).map(|r| stage_of(mesh, r) as u32).collect();
    Ok(Simulation {
        report,
        timelines: outs.into_iter().map(|o| o.timeline).collect(),
        rank_timeline,
        rank_labels: rank_labels(mesh),
    })
}

/// The pipeline stage of `rank`.
fn stage_of(mesh: &Mesh, rank: usize) -> usize {
    mesh.axis("pp")
        .map_or(0, |a| mesh.coords(rank)[a.0 as usize])
}
