//! Strategy presets: they only write [`Annotations`] (and choose the KV-head replication
//! factor the graph is built with); propagation and `reshard` do the rest. They compose on a
//! multi-axis mesh.
//!
//! - `dp`: the batch dim of inputs and of the residual stream split over the data axes
//!   (`dp`, and `ep`, whose ranks hold different tokens outside the experts).
//! - `tp` (Megatron): QKV / gate / up column-parallel, O / down row-parallel, vocabulary-parallel
//!   embedding and lm_head; with more `tp` ranks than KV heads, KV heads are replicated.
//! - `sp` (Megatron sequence parallelism): the residual stream, norms and residual adds on
//!   sequence shards of the `tp` axis.
//! - `ep`: MoE experts split over `ep`, tokens dispatched and combined by all-to-all.
//! - `cp` (context parallelism): the sequence split over `cp` for the whole layer. The
//!   attention reads every query's and key's sequence index, so its queries stay split and
//!   its keys and values are gathered (`cp-allgather`, Llama 3's form; the default), or the
//!   heads are split over `cp` instead by all-to-all (`cp-ulysses`, DeepSpeed-Ulysses). With
//!   the head-tail order (the default; `cp-contiguous` turns it off) the sequence is cut into
//!   `2·cp` chunks and rank `i` holds chunks `i` and `2·cp−1−i`, so every rank does the same
//!   causal work.

use super::mesh::{AxisId, Mesh};
use super::partition::Annotations;
use super::sharding::TensorSharding;
use super::ShardError;
use crate::ir::{Graph, Op, SeqOrder, ValueId};
use crate::model::ModelConfig;
use std::fmt;

/// A parallelization strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Strategy {
    /// Data parallel.
    Dp,
    /// Megatron tensor parallel.
    Tp,
    /// Megatron sequence parallel (on the `tp` axis).
    Sp,
    /// Expert parallel.
    Ep,
    /// ZeRO stage 1 (training): optimizer states sharded over `dp`.
    Zero1,
    /// ZeRO stage 2 (training): optimizer states and gradients sharded over `dp`.
    Zero2,
    /// ZeRO stage 3 (training): optimizer states, gradients and parameters sharded over `dp`;
    /// parameters all-gathered before use (forward and backward) and freed after.
    Zero3,
    /// PyTorch FSDP (full sharding): ZeRO stage 3.
    Fsdp,
    /// Context parallelism: the sequence split over `cp` (default variant: all-gather K/V,
    /// head-tail order).
    Cp,
    /// Context parallelism by all-gathering K/V (Llama 3, Megatron `allgather`).
    CpAllGather,
    /// Context parallelism by all-to-all over heads (DeepSpeed-Ulysses, Megatron `a2a`).
    CpUlysses,
    /// Context parallelism by passing K/V blocks round a ring in the forward pass (Ring
    /// Attention, Megatron `p2p`), overlapped with each block's attention; the backward
    /// gathers K/V and reduce-scatters dK/dV as `cp-allgather` does.
    CpRing,
    /// Context parallelism without causal load balancing: rank `i` holds the `i`-th
    /// contiguous part of the sequence.
    CpContiguous,
    /// The `tp` axis without a preset layout: every rank holds and computes the whole model,
    /// the starting point from which the `layout` rewrite rules choose each matmul's layout
    /// (`shardc search --space layers`).
    Replicated,
}

/// How context parallelism exchanges keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpAlgo {
    /// All-gather K and V; the queries stay split (backward: reduce-scatter dK, dV).
    AllGather,
    /// All-to-all Q, K, V from sequence-split to head-split and the output back.
    Ulysses,
    /// K/V blocks passed round the ring, each step's block attention overlapping the next
    /// transfer, partial results merged by log-sum-exp (forward; the backward as `AllGather`).
    Ring,
}

impl CpAlgo {
    /// `allgather` or `ulysses`.
    pub fn name(self) -> &'static str {
        match self {
            CpAlgo::AllGather => "allgather",
            CpAlgo::Ulysses => "ulysses",
            CpAlgo::Ring => "ring",
        }
    }
}

/// The context parallelism of a mesh under some strategies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpLayout {
    /// The `cp` axis.
    pub axis: AxisId,
    /// Its size.
    pub size: usize,
    /// The exchange.
    pub algo: CpAlgo,
    /// The sequence's order (head-tail unless `cp-contiguous`; contiguous under Ulysses,
    /// whose attention sees the whole sequence).
    pub order: SeqOrder,
}

/// The context parallelism `strategies` ask for on `mesh`: `None` without a `cp` axis of
/// more than one rank.
pub fn cp_layout(mesh: &Mesh, strategies: &[Strategy]) -> Option<CpLayout> {
    let axis = mesh.axis("cp")?;
    let size = mesh.axis_size(axis);
    if size < 2 || !strategies.contains(&Strategy::Cp) {
        return None;
    }
    // Ring unless another exchange is named (Megatron-Core's default, `p2p`, too).
    let algo = if strategies.contains(&Strategy::CpUlysses) {
        CpAlgo::Ulysses
    } else if strategies.contains(&Strategy::CpAllGather) {
        CpAlgo::AllGather
    } else {
        CpAlgo::Ring
    };
    let order = if algo == CpAlgo::Ulysses || strategies.contains(&Strategy::CpContiguous) {
        SeqOrder::Contiguous
    } else {
        SeqOrder::HeadTail { parts: size }
    };
    Some(CpLayout {
        axis,
        size,
        algo,
        order,
    })
}

/// The sequence order the model graph is built with (`BuildOptions::cp`): `None` when no
/// attention splits its queries (no context parallelism, or Ulysses).
pub fn cp_build_order(mesh: &Mesh, strategies: &[Strategy]) -> Option<SeqOrder> {
    cp_layout(mesh, strategies)
        .filter(|c| c.algo != CpAlgo::Ulysses)
        .map(|c| c.order)
}

impl Strategy {
    /// All strategies this version implements.
    pub const ALL: [Strategy; 14] = [
        Strategy::Dp,
        Strategy::Tp,
        Strategy::Sp,
        Strategy::Ep,
        Strategy::Zero1,
        Strategy::Zero2,
        Strategy::Zero3,
        Strategy::Fsdp,
        Strategy::Cp,
        Strategy::CpAllGather,
        Strategy::CpUlysses,
        Strategy::CpRing,
        Strategy::CpContiguous,
        Strategy::Replicated,
    ];

    /// Text name.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Dp => "dp",
            Strategy::Tp => "tp",
            Strategy::Sp => "sp",
            Strategy::Ep => "ep",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Zero3 => "zero3",
            Strategy::Fsdp => "fsdp",
            Strategy::Cp => "cp",
            Strategy::CpAllGather => "cp-allgather",
            Strategy::CpUlysses => "cp-ulysses",
            Strategy::CpRing => "cp-ring",
            Strategy::CpContiguous => "cp-contiguous",
            Strategy::Replicated => "replicated",
        }
    }

    /// The ZeRO stage of a ZeRO strategy (`fsdp` is stage 3); 0 for the others.
    pub fn zero_stage(self) -> u8 {
        match self {
            Strategy::Zero1 => 1,
            Strategy::Zero2 => 2,
            Strategy::Zero3 | Strategy::Fsdp => 3,
            _ => 0,
        }
    }

    /// Parses a name.
    pub fn from_name(s: &str) -> Result<Strategy, ShardError> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| ShardError::UnknownStrategy {
                name: s.to_string(),
                valid: Strategy::ALL.map(Strategy::name).join(", "),
            })
    }

    /// The default strategy of a mesh axis name.
    pub fn for_axis(axis: &str) -> Option<Strategy> {
        match axis {
            "dp" => Some(Strategy::Dp),
            "tp" => Some(Strategy::Tp),
            "ep" => Some(Strategy::Ep),
            "cp" => Some(Strategy::Cp),
            _ => None,
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The strategies for a mesh: one per axis from its name, plus `extra` (e.g. `sp`), sorted
/// and deduplicated. Errors name an axis with no strategy, a strategy without its axis, or two
/// ZeRO stages.
pub fn resolve(mesh: &Mesh, extra: &[String]) -> Result<Vec<Strategy>, ShardError> {
    resolve_inner(mesh, extra, false)
}

/// [`resolve`] for the stages of a pipeline: the `pp` axis is the pipeline's own, the
/// strategies apply inside each stage.
pub fn resolve_stage(mesh: &Mesh, extra: &[String]) -> Result<Vec<Strategy>, ShardError> {
    resolve_inner(mesh, extra, true)
}

fn resolve_inner(
    mesh: &Mesh,
    extra: &[String],
    pipeline: bool,
) -> Result<Vec<Strategy>, ShardError> {
    let mut out = Vec::new();
    for a in &mesh.axes {
        match Strategy::for_axis(&a.name) {
            Some(s) => out.push(s),
            None if a.size == 1 || (pipeline && a.name == "pp") => {}
            None if a.name == "pp" => {
                return Err(ShardError::Unsupported(format!(
                    "mesh axis `pp` ({}) splits the model into pipeline stages: it applies to \
                     training steps (`shardc train --mesh pp=...`), whose stages the pipeline \
                     compiler builds",
                    a.size
                )))
            }
            None => {
                return Err(ShardError::Unsupported(format!(
                    "mesh axis `{}` has no strategy in this version (supported axes: dp, tp, \
                     ep, cp)",
                    a.name
                )))
            }
        }
    }
    for e in extra {
        for name in e.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            out.push(Strategy::from_name(name)?);
        }
    }
    // A context-parallel variant implies context parallelism.
    if out.iter().any(|s| {
        matches!(
            s,
            Strategy::CpAllGather | Strategy::CpUlysses | Strategy::CpRing | Strategy::CpContiguous
        )
    }) {
        out.push(Strategy::Cp);
    }
    out.sort();
    out.dedup();
    // `replicated` takes the `tp` axis's preset away (and sequence parallelism with it).
    if out.contains(&Strategy::Replicated) {
        if out.contains(&Strategy::Sp) {
            return Err(ShardError::ConflictingStrategies {
                first: "replicated".into(),
                second: "sp".into(),
                choose: "sequence parallelism needs the tp preset's layout; under `replicated` \
                         the layout rules find it (--rewrite layout,sequence-parallel)"
                    .into(),
            });
        }
        out.retain(|&s| s != Strategy::Tp);
    }
    let exchanges: Vec<&Strategy> = out
        .iter()
        .filter(|s| {
            matches!(
                s,
                Strategy::CpAllGather | Strategy::CpUlysses | Strategy::CpRing
            )
        })
        .collect();
    if let [a, b, ..] = exchanges[..] {
        return Err(ShardError::ConflictingStrategies {
            first: a.name().to_string(),
            second: b.name().to_string(),
            choose: "choose one context-parallel exchange (--cp-algo allgather, ring or ulysses)"
                .into(),
        });
    }
    // One ZeRO stage: zero1, zero2, zero3 and fsdp (= zero3) exclude each other.
    if let [a, b, ..] = out
        .iter()
        .filter(|s| s.zero_stage() > 0)
        .collect::<Vec<_>>()[..]
    {
        return Err(ShardError::ConflictingStrategies {
            first: a.name().to_string(),
            second: b.name().to_string(),
            choose: "choose one ZeRO stage (zero1, zero2, zero3 or fsdp, which is zero3)".into(),
        });
    }
    for s in &out {
        let needs = match s {
            Strategy::Dp | Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3 | Strategy::Fsdp => {
                "dp"
            }
            Strategy::Tp | Strategy::Sp | Strategy::Replicated => "tp",
            Strategy::Ep => "ep",
            Strategy::Cp
            | Strategy::CpAllGather
            | Strategy::CpUlysses
            | Strategy::CpRing
            | Strategy::CpContiguous => "cp",
        };
        // ZeRO shards over dp and cp: either axis will do.
        let zero_on_cp = s.zero_stage() > 0 && mesh.axis("cp").is_some();
        if mesh.axis(needs).is_none() && !zero_on_cp {
            return Err(ShardError::Unsupported(format!(
                "strategy `{s}` needs a `{needs}` axis in the mesh (mesh is {mesh})"
            )));
        }
    }
    Ok(out)
}

/// Model-level divisibility checks, with the dimension and sizes in the message.
pub fn check_model(
    cfg: &ModelConfig,
    mesh: &Mesh,
    strategies: &[Strategy],
    batch: usize,
    seq: usize,
) -> Result<(), ShardError> {
    let size = |n: &str| mesh.axis(n).map(|a| mesh.axis_size(a)).unwrap_or(1);
    let need = |what: &str, n: usize, axis: &str, p: usize| -> Result<(), ShardError> {
        if p > 1 && n % p != 0 {
            Err(ShardError::ModelIndivisible {
                what: what.to_string(),
                size: n,
                axis: axis.to_string(),
                parts: p,
            })
        } else {
            Ok(())
        }
    };
    if strategies.contains(&Strategy::Ep) && cfg.moe.is_none() {
        return Err(ShardError::Unsupported(format!(
            "strategy `ep` needs a mixture-of-experts model; {} has none",
            cfg.arch.name()
        )));
    }
    let data = data_parts(mesh, strategies);
    need("batch", batch, &data.1, data.0)?;
    if strategies.contains(&Strategy::Tp) {
        let tp = size("tp");
        need("heads", cfg.heads, "tp", tp)?;
        if cfg.kv_heads % tp != 0 && tp % cfg.kv_heads != 0 {
            return Err(ShardError::ModelIndivisible {
                what: "kv_heads (and tp is not a multiple of it)".into(),
                size: cfg.kv_heads,
                axis: "tp".into(),
                parts: tp,
            });
        }
        need("ffn", cfg.ffn, "tp", tp)?;
        need("vocab", cfg.vocab, "tp", tp)?;
        if strategies.contains(&Strategy::Sp) {
            need("seq", seq, "tp", tp)?;
        }
    }
    if let (true, Some(moe)) = (strategies.contains(&Strategy::Ep), cfg.moe) {
        need("experts", moe.experts, "ep", size("ep"))?;
    }
    if let Some(cp) = cp_layout(mesh, strategies) {
        let n = cp.size;
        match cp.order {
            SeqOrder::HeadTail { .. } => {
                need("seq (head-tail order: 2·cp chunks)", seq, "cp", 2 * n)?
            }
            SeqOrder::Contiguous => need("seq", seq, "cp", n)?,
        }
        if strategies.contains(&Strategy::Sp) {
            need("seq", seq, "cp*tp", n * size("tp"))?;
        }
        if cp.algo == CpAlgo::Ulysses {
            let split = n * if strategies.contains(&Strategy::Tp) {
                size("tp")
            } else {
                1
            };
            need("heads (cp-ulysses splits them)", cfg.heads, "tp*cp", split)?;
            if cfg.kv_heads % split != 0 && split % cfg.kv_heads != 0 {
                return Err(ShardError::ModelIndivisible {
                    what: "kv_heads (cp-ulysses splits them; and tp*cp is not a multiple of it)"
                        .into(),
                    size: cfg.kv_heads,
                    axis: "tp*cp".into(),
                    parts: split,
                });
            }
        }
    }
    Ok(())
}

/// How many times each KV head is repeated so heads split evenly over `tp`.
pub fn kv_repeat(cfg: &ModelConfig, mesh: &Mesh, strategies: &[Strategy]) -> usize {
    let size = |n: &str| mesh.axis(n).map(|a| mesh.axis_size(a)).unwrap_or(1);
    let tp = if strategies.contains(&Strategy::Tp) {
        size("tp")
    } else {
        1
    };
    // Ulysses splits the heads over cp too.
    let cp = match cp_layout(mesh, strategies) {
        Some(c) if c.algo == CpAlgo::Ulysses => c.size,
        _ => 1,
    };
    let split = tp * cp;
    if cfg.kv_heads % split == 0 || split % cfg.kv_heads != 0 {
        1
    } else {
        split / cfg.kv_heads
    }
}

/// The axes that split the batch (`dp`, and `ep` outside the experts).
pub(crate) fn data_axes(mesh: &Mesh, strategies: &[Strategy]) -> Vec<AxisId> {
    mesh.axis_ids()
        .filter(|&a| match mesh.axis_name(a) {
            "dp" => strategies.contains(&Strategy::Dp),
            "ep" => strategies.contains(&Strategy::Ep),
            _ => false,
        })
        .collect()
}

fn data_parts(mesh: &Mesh, strategies: &[Strategy]) -> (usize, String) {
    let axes = data_axes(mesh, strategies);
    let p = axes.iter().map(|&a| mesh.axis_size(a)).product();
    let names: Vec<&str> = axes.iter().map(|&a| mesh.axis_name(a)).collect();
    (p, names.join("*"))
}

/// Writes the annotations of `strategies` for a graph built by [`crate::model::build_forward`].
pub fn annotate(g: &Graph, mesh: &Mesh, strategies: &[Strategy]) -> Annotations {
    let mut ann = Annotations::default();
    let data = data_axes(mesh, strategies);
    let tp = mesh
        .axis("tp")
        .filter(|_| strategies.contains(&Strategy::Tp));
    let ep = mesh
        .axis("ep")
        .filter(|_| strategies.contains(&Strategy::Ep));
    let sp = strategies.contains(&Strategy::Sp);
    let cp = cp_layout(mesh, strategies);
    let users = g.users();
    let named = |n: &str| g.ids().find(|&u| g.node(u).name == n);
    let embed_out = named("embed.add_pos").or_else(|| named("embed.lookup"));
    let stream = |rank: usize| {
        let mut s = TensorSharding::replicated(rank);
        s.dims[0] = data.clone();
        if let Some(c) = cp {
            s.dims[1].push(c.axis);
        }
        if sp {
            if let Some(t) = tp {
                s.dims[1].push(t);
            }
        }
        s
    };
    let stream_why = match (sp, cp.is_some()) {
        (true, true) => "residual stream: batch over data axes, sequence over cp then tp (sp)",
        (true, false) => "residual stream: batch over data axes, sequence over tp (sp)",
        (false, true) => "residual stream: batch over data axes, sequence over cp",
        (false, false) => "residual stream: batch over data axes",
    };
    // Context parallelism: `[B,T,..]` tokens split over cp along the sequence (in the
    // head-tail order once permuted into it).
    let tokens = |rank: usize| {
        let mut s = TensorSharding::replicated(rank);
        s.dims[0] = data.clone();
        if let Some(c) = cp {
            s.dims[1] = vec![c.axis];
        }
        s
    };
    for v in g.ids() {
        let node = g.node(v);
        let name = node.name.as_str();
        match &node.op {
            // A pipeline stage's activations arrive split over cp along the sequence. The
            // token inputs stay whole along it: every consumer slices its part locally, and
            // attention's key mask is read whole without a gather.
            Op::Input { .. }
                if cp.is_some()
                    && node.ty.rank() > 2
                    && node.ty.dims[1].role == crate::ir::Role::Seq =>
            {
                ann.set(
                    v,
                    tokens(node.ty.rank()),
                    "cp: batch over the data axes, sequence over cp",
                );
            }
            Op::Input { .. } if !data.is_empty() => {
                ann.set(
                    v,
                    TensorSharding::split(node.ty.rank(), 0, &data),
                    "dp: batch split over the data axes",
                );
            }
            Op::Attention(_) if cp.is_some() => {
                // q, k and v split along the sequence, so their gradients return to it where
                // attention's backward leaves them (dK, dV partial sums reduce-scattered;
                // Ulysses' head-split gradients all-to-all'd back), not after the
                // projections' backward widens them to the hidden size.
                for &x in &node.inputs[..3] {
                    let mut s = tokens(g.ty(x).rank());
                    if let Some(t) = tp {
                        s.dims[2] = vec![t];
                    }
                    ann.set(
                        x,
                        s,
                        "cp: queries, keys and values split along the sequence",
                    );
                }
                if cp.is_some_and(|c| c.algo == CpAlgo::Ulysses) {
                    let mut s = TensorSharding::replicated(node.ty.rank());
                    s.dims[0] = data.clone();
                    s.dims[2] = tp.into_iter().collect();
                    s.dims[2].extend(cp.map(|c| c.axis));
                    ann.set(v, s, "cp-ulysses: heads over tp then cp, whole sequence");
                }
            }
            Op::Param(_) => {
                if let Some((s, why)) = param_layout(g, &users, v, tp, ep) {
                    ann.set(v, s, why);
                }
            }
            _ => {}
        }
        // The residual stream: embedding output, residual adds and the branches added to them.
        if name.ends_with(".residual") || Some(v) == embed_out {
            ann.set(v, stream(node.ty.rank()), stream_why);
            if name.ends_with(".residual") {
                let branch = node.inputs[1];
                ann.set(
                    branch,
                    stream(g.ty(branch).rank()),
                    format!("branch added to the {stream_why}"),
                );
            }
        }
    }
    ann
}

/// The tp / ep layout of a parameter, from the matmul that uses it.
fn param_layout(
    g: &Graph,
    users: &[Vec<ValueId>],
    v: ValueId,
    tp: Option<AxisId>,
    ep: Option<AxisId>,
) -> Option<(TensorSharding, String)> {
    let node = g.node(v);
    let label = node.name.as_str();
    let rank = node.ty.rank();
    let mut s = TensorSharding::replicated(rank);
    let mut why = Vec::new();
    if rank == 3 {
        if let Some(e) = ep {
            s.dims[0] = vec![e];
            why.push("ep: experts split");
        }
    }
    if let Some(t) = tp {
        let column = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
            .iter()
            .any(|p| label.contains(&format!(".{p}.")));
        let row = label.contains(".o_proj.") || label.contains(".down_proj.");
        let vocab = label == "embed" || label == "lm_head";
        let is_bias = label.ends_with(".bias");
        let kv = label.contains(".k_proj.") || label.contains(".v_proj.");
        // With replicated KV heads (the graph repeats them) the projection is whole on every rank.
        let repeated_kv = kv && g.ids().any(|u| matches!(g.node(u).op, Op::Repeat { .. }));
        if vocab {
            s.dims[0] = vec![t];
            why.push("tp: vocabulary-parallel");
        } else if (column || row) && !repeated_kv {
            // The matmul consuming this weight (directly, or through the bias add).
            let mm = users[v.index()].iter().find_map(|&u| match g.node(u).op {
                Op::MatMul { transpose_b } => Some(transpose_b),
                _ => None,
            });
            if is_bias {
                if column {
                    s.dims[0] = vec![t];
                    why.push("tp: column-parallel bias");
                }
            } else if let Some(tb) = mm {
                // Dims of the weight: [.., K, N] or [.., N, K] when transposed.
                let (k, n) = if tb {
                    (rank - 1, rank - 2)
                } else {
                    (rank - 2, rank - 1)
                };
                if column {
                    s.dims[n] = vec![t];
                    why.push("tp: column-parallel");
                } else {
                    s.dims[k] = vec![t];
                    why.push("tp: row-parallel");
                }
            }
        }
    }
    (!why.is_empty()).then(|| (s, why.join(", ")))
}
