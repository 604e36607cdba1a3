//! Mixture-of-experts GEMMs on the routed tokens only, planned on the host (unit-tested on
//! CPU).
//!
//! The IR keeps MoE dense: `Dispatch(x, gates)` is `[E, B, T, H]` with the rows of the tokens
//! an expert was not chosen for set to zero, and every expert GEMM runs over all `B·T` rows, E
//! times the work of the routed tokens (4× for Mixtral's top-2 of 8). Here a value's rows are
//! known zero wherever its *source*'s gates are zero, by propagation from the sources:
//!
//! - `Dispatch(x, gates)` and `CombineGrad { wrt: y }(y, gates, dy)` (the backward's `dy`
//!   for the expert outputs, zero where the gate is) are sources;
//! - a `MatMul` of zero-row `a` by per-expert weights `[E, .., ..]` keeps them (a zero row
//!   times a matrix);
//! - SiLU, ReLU, GeLU, negation, scaling and casts map 0 to 0; `UnaryGrad(x, dy)` is `dy ·
//!   f'(x)`; a `Mul` by a zero-row operand of the output's shape, an `Add` of two zero-row
//!   values of one source, and a `Reshape` keeping the expert dim first and the row width last
//!   keep them.
//!
//! Every `MatMul` of a zero-row activation by per-expert weights is a [`RoutedGemm`]: the
//! source's gates are turned into per-expert lists of routed token rows right after the source
//! runs (`moe_route_index`, into a buffer of the source's), and the GEMM computes those rows
//! only (`routed_gemm`), writing zeros elsewhere: the dense result exactly, as long as the
//! operands are finite (a non-finite value in a row the gates exclude would turn that row's
//! dense result non-finite, while here it stays zero; the combine skips those rows either way).
//!
//! A `WeightGrad` of per-expert weights `[E, .., ..]` whose `dy` (or else `a`) has zero rows
//! sums over the routed rows only (`routed_weight_grad`): the other rows add nothing.
//!
//! A routed GEMM leaves its unrouted rows unwritten (no zero-fill, whatever the arena held)
//! where nothing reads them ([`Routing::unfilled`]): every reader, followed through
//! row-preserving ops of the same gates' rows, skips the rows the gates exclude — a routed
//! GEMM or weight gradient (which must then run on the routed kernels), `Combine`,
//! `DispatchGrad` or `CombineGrad` of those gates — and the value is no graph output. Mixtral's
//! expert MLP then writes no zeros at all, forward or backward.
//!
//! Packed values ([`Routing::packed`]): a zero-row value whose writer and readers all work on
//! the routed rows only is stored as those rows alone, `tokens · top_k` rows (each token has at
//! most top_k non-zero gates) instead of `E · tokens`: expert e's routed rows back to back from
//! row `counts[0] + … + counts[e − 1]`, in its list's order. Its writer is a routed GEMM (the
//! packed output of `routed_gemm`) or a row-by-row op of packed operands (silu, the SwiGLU
//! product, their gradients: elementwise kernels over the packed rows), and its readers are
//! routed GEMMs and weight gradients (packed operands of the routed kernels) or such row-by-row
//! ops; it is no graph output. The dispatch and the combine's gradient wrt its experts' outputs
//! write packed, and the combine, the dispatch's gradient and the combine's gradient wrt the
//! gates read packed, through the map `pos[token, expert]` of packed rows each routing source's
//! index holds (`moe_route_positions`). So every `[E, tokens, ·]` value of Mixtral's expert
//! MLP is packed, forward and backward: a quarter of the bytes for top-2 of 8.

use super::dtype::GpuDType;
use super::flash::through_reshapes;
use shardc_compiler::ir::{CombineWrt, Graph, Op, UnaryOp, ValueId};
use shardc_kernels::launch::routed_gemm_supported;

/// One expert GEMM computed on its routed rows: `a [E, tokens, k] · w[e]` (w `[E, k, n]`, or
/// `[E, n, k]` with `transpose_w`) into `[E, tokens, n]`; or, for a weight gradient, `a [E,
/// tokens, k]` and `dy [E, tokens, n]` contracted over the routed rows into `[E, k, n]` (`[E,
/// n, k]` with `transpose_w`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutedGemm {
    /// The source whose gates route the rows (a `Dispatch` or `CombineGrad { wrt: y }`).
    pub source: ValueId,
    /// Experts (the leading dim of both operands).
    pub experts: usize,
    /// Rows per expert (`B·T`).
    pub tokens: usize,
    /// Contraction length.
    pub k: usize,
    /// Output columns.
    pub n: usize,
    /// The weights are `[E, n, k]`.
    pub transpose_w: bool,
}

/// A value stored packed (see the module docs): `rows` rows of `width`, the routed rows of the
/// lists of `source`'s gates, expert by expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packed {
    /// The routing source whose gates route the rows.
    pub source: ValueId,
    /// Rows held (`tokens · top_k`, the most the gates can route).
    pub rows: usize,
    /// Elements per row.
    pub width: usize,
}

impl Packed {
    /// Elements stored.
    pub fn numel(&self) -> usize {
        self.rows * self.width
    }
}

/// The routing of a graph's expert GEMMs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Routing {
    /// Per value: the routed GEMM it is computed as, if any.
    pub gemms: Vec<Option<RoutedGemm>>,
    /// Per value: the routed weight gradient it is computed as, if any.
    pub weight_grads: Vec<Option<RoutedGemm>>,
    /// The sources some routed GEMM reads the routing of, with their `(experts, tokens)`: each
    /// gets an index buffer (`counts[E]`, `rows[E · tokens]` i32), filled when it has run.
    pub sources: Vec<(ValueId, usize, usize)>,
    /// Per routed GEMM whose unrouted rows nothing reads (module docs): the routed GEMMs and
    /// weight gradients among the readers, which must run on the routed kernels for its rows to
    /// be left unwritten; `None` where the rows must be zero-filled.
    pub unfilled: Vec<Option<Vec<ValueId>>>,
    /// Per value: how it is stored packed (module docs), if it is.
    pub packed: Vec<Option<Packed>>,
}

impl Routing {
    /// The routed GEMMs of `g`, its values stored as `dt`, and its packed values (none of
    /// either when `enabled` is false).
    pub fn of(g: &Graph, enabled: bool, dt: GpuDType) -> Routing {
        let mut r = Routing {
            gemms: vec![None; g.len()],
            weight_grads: vec![None; g.len()],
            sources: Vec::new(),
            unfilled: vec![None; g.len()],
            packed: vec![None; g.len()],
        };
        if !enabled {
            return r;
        }
        let zero = zero_rows(g);
        for v in g.ids() {
            let node = g.node(v);
            let a = node.inputs.first().copied();
            // The per-expert weight-shaped value (the MatMul's weights, the weight gradient
            // itself), the `[E, tokens, n]`-shaped one (the MatMul's output, the gradient's dy)
            // and the source of the zero rows.
            let (transpose_b, weight_grad, weight, wide, source) = match node.op {
                Op::MatMul { transpose_b } => (
                    transpose_b,
                    false,
                    node.inputs[1],
                    v,
                    a.and_then(|a| zero[a.index()]),
                ),
                Op::WeightGrad { transpose_b } => {
                    let (a, dy) = (node.inputs[0], node.inputs[1]);
                    let source = zero[dy.index()].or(zero[a.index()]);
                    (transpose_b, true, v, dy, source)
                }
                _ => continue,
            };
            let (Some(source), Some(a)) = (source, a) else {
                continue;
            };
            let (sa, sn) = (g.ty(a).shape(), g.ty(wide).shape());
            let (experts, k, n) = (sa[0], sa[sa.len() - 1], sn[sn.len() - 1]);
            let want = if transpose_b {
                [experts, n, k]
            } else {
                [experts, k, n]
            };
            if g.ty(weight).shape() != want || sn[0] != experts || experts == 0 || k == 0 {
                continue;
            }
            let tokens = g.ty(a).numel() / (experts * k);
            if g.ty(wide).numel() != experts * tokens * n {
                continue;
            }
            r.add(
                g,
                v,
                weight_grad,
                source,
                (experts, tokens, k, n),
                transpose_b,
            );
        }
        r.plan_rows(g, dt);
        r
    }

    /// Fills [`Routing::unfilled`] and [`Routing::packed`] for the routed GEMMs of `g`.
    fn plan_rows(&mut self, g: &Graph, dt: GpuDType) {
        let walk = ReaderWalk {
            g,
            zero: zero_rows(g),
            users: g.users(),
        };
        self.unfilled = g
            .ids()
            .map(|v| {
                self.gemms[v.index()]?;
                let mut must = Vec::new();
                walk.unread(self, v, &mut must).then_some(must)
            })
            .collect();
        self.packed = walk.packed(self, dt);
    }

    /// Elements value `v` of `g` occupies on the device: its packed rows, or all of it.
    pub fn stored_numel(&self, g: &Graph, v: ValueId) -> usize {
        self.packed[v.index()].map_or_else(|| g.ty(v).numel(), |p| p.numel())
    }

    /// `packed` flags of routed GEMM or weight gradient `v` for `moe_gemm.cu` (bit 0: its `a`
    /// is packed; bit 1: its output, or a weight gradient's `dy`).
    pub fn packed_flags(&self, g: &Graph, v: ValueId) -> i32 {
        let ins = &g.node(v).inputs;
        let second = if self.weight_grads[v.index()].is_some() {
            ins[1]
        } else {
            v
        };
        i32::from(self.packed[ins[0].index()].is_some())
            | (i32::from(self.packed[second.index()].is_some()) << 1)
    }

    /// Whether routed GEMM or weight gradient `v` reads or writes a packed value (and so has
    /// no dense fallback).
    pub fn touches_packed(&self, g: &Graph, v: ValueId) -> bool {
        (self.gemms[v.index()].is_some() || self.weight_grads[v.index()].is_some())
            && self.packed_flags(g, v) != 0
    }

    /// Records `v` as a routed GEMM (or weight gradient) of `source`'s rows, when the source's
    /// gates are `[.., E]` over the same tokens.
    fn add(
        &mut self,
        g: &Graph,
        v: ValueId,
        weight_grad: bool,
        source: ValueId,
        (experts, tokens, k, n): (usize, usize, usize, usize),
        transpose_w: bool,
    ) {
        if g.ty(routing_gates(g, source)).numel() != experts * tokens {
            return;
        }
        let gemm = RoutedGemm {
            source,
            experts,
            tokens,
            k,
            n,
            transpose_w,
        };
        let slot = if weight_grad {
            &mut self.weight_grads
        } else {
            &mut self.gemms
        };
        slot[v.index()] = Some(gemm);
        if !self.sources.iter().any(|&(s, _, _)| s == source) {
            self.sources.push((source, experts, tokens));
        }
    }

    /// Keeps only the sources `runs` accepts (those the executor runs as nodes of their own,
    /// after which it fills their index) and the routed GEMMs of those, and plans the rows of
    /// graph `g` (stored as `dt`) again for them.
    pub fn keep_sources(&mut self, g: &Graph, dt: GpuDType, runs: impl Fn(ValueId) -> bool) {
        self.sources.retain(|&(s, _, _)| runs(s));
        let kept = |x: &mut Option<RoutedGemm>| {
            if x.is_some_and(|r| !runs(r.source)) {
                *x = None;
            }
        };
        self.gemms.iter_mut().for_each(&kept);
        self.weight_grads.iter_mut().for_each(&kept);
        self.plan_rows(g, dt);
    }

    /// Bytes of the index buffer of a source with `experts` and `tokens`: `counts[E]`, the
    /// lists `rows[E · tokens]` and the packed rows' map `pos[tokens · E]` (i32).
    pub fn index_bytes(experts: usize, tokens: usize) -> usize {
        4 * (experts + 2 * experts * tokens)
    }

    /// The device addresses of the three parts of an index buffer at `base` (see
    /// [`Routing::index_bytes`]): `[counts, rows, pos]`.
    pub fn index_parts(base: u64, experts: usize, tokens: usize) -> [u64; 3] {
        let rows = base + 4 * experts as u64;
        [base, rows, rows + 4 * (experts * tokens) as u64]
    }
}

/// The gates input of routing source `s` (`Dispatch`'s second operand, `CombineGrad`'s).
pub fn routing_gates(g: &Graph, s: ValueId) -> ValueId {
    g.node(s).inputs[1]
}

/// The ops that compute a row of their result from the same row of their operands (for the
/// operands of the result's shape; a reshape that keeps the expert dim and the row width):
/// elementwise maps and products, and views.
fn row_by_row(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_)
            | Op::Scale(_)
            | Op::Cast(_)
            | Op::UnaryGrad(_)
            | Op::Mul
            | Op::Add
            | Op::Reshape
    )
}

/// The `top_k` of the router whose output `gates` is (through shape-keeping reshapes).
fn top_k(g: &Graph, gates: ValueId) -> Option<usize> {
    match g.node(gates).op {
        Op::Router { top_k, .. } => Some(top_k),
        _ => None,
    }
}

/// How a reader reads the unrouted rows of one of its operands (see [`ReaderWalk::reader`]).
enum Reader {
    /// It skips them: a combine, the dispatch's gradient or a combine's gradient of the same
    /// gates (moe.cu, moe_grad.cu; the gradient wrt y reads no y at all).
    Skips,
    /// A routed GEMM (by its activation) or weight gradient of the same gates: it skips them
    /// on the routed kernels.
    Routed(RoutedGemm),
    /// Each row of its result from the same row of the operand, of the same gates' rows: a
    /// row-by-row op of operands of its shape (a reshape keeping the rows), or a dense expert
    /// GEMM by its activation. What the operand holds there lands in the result's unrouted
    /// rows.
    RowByRow,
    /// It reads them.
    Reads,
}

/// Which values' unrouted rows are read by nothing ([`Routing::unfilled`]), and which values
/// can be stored packed ([`Routing::packed`]).
struct ReaderWalk<'a> {
    g: &'a Graph,
    zero: Vec<Option<ValueId>>,
    users: Vec<Vec<ValueId>>,
}

impl ReaderWalk<'_> {
    /// The gates whose zeros make `x`'s rows zero (through shape-keeping reshapes: a training
    /// step's backward reads the saved gates through one).
    fn gates(&self, x: ValueId) -> Option<ValueId> {
        self.zero[x.index()].map(|s| through_reshapes(self.g, routing_gates(self.g, s)))
    }

    /// How `u` reads the unrouted rows of its operand `x`, whose rows `gates` route.
    fn reader(&self, routing: &Routing, x: ValueId, u: ValueId, gates: ValueId) -> Reader {
        let g = self.g;
        let node = g.node(u);
        let only_at = |i: usize| {
            node.inputs
                .iter()
                .enumerate()
                .all(|(j, &y)| y != x || j == i)
        };
        let routed = |r: Option<RoutedGemm>| {
            r.filter(|r| through_reshapes(g, routing_gates(g, r.source)) == gates)
        };
        let same_rows = self.gates(u) == Some(gates);
        match node.op {
            Op::Combine | Op::DispatchGrad | Op::CombineGrad { .. }
                if only_at(0) && through_reshapes(g, node.inputs[1]) == gates =>
            {
                Reader::Skips
            }
            Op::MatMul { .. } if only_at(0) => match routed(routing.gemms[u.index()]) {
                Some(r) => Reader::Routed(r),
                None if same_rows => Reader::RowByRow,
                None => Reader::Reads,
            },
            Op::WeightGrad { .. } if node.inputs.get(2) != Some(&x) => {
                routed(routing.weight_grads[u.index()]).map_or(Reader::Reads, Reader::Routed)
            }
            ref op if row_by_row(op) => {
                let rows_kept = matches!(node.op, Op::Reshape) || g.ty(x).same_shape(&node.ty);
                if same_rows && rows_kept {
                    Reader::RowByRow
                } else {
                    Reader::Reads
                }
            }
            _ => Reader::Reads,
        }
    }

    /// Whether no reader of `x`'s unrouted rows sees them (garbage there changes nothing the
    /// program computes): `x` is no graph output and every reader skips those rows or is a
    /// row-preserving op of the same gates' rows whose own unrouted rows nothing reads. The
    /// routed GEMMs and weight gradients relied on (they skip the rows only on the routed
    /// kernels) are pushed onto `must`.
    fn unread(&self, routing: &Routing, x: ValueId, must: &mut Vec<ValueId>) -> bool {
        let g = self.g;
        let Some(gates) = self.gates(x) else {
            return false;
        };
        if g.outputs.iter().any(|&(_, o)| o == x) {
            return false;
        }
        self.users[x.index()]
            .iter()
            .all(|&u| match self.reader(routing, x, u, gates) {
                Reader::Skips => true,
                Reader::Routed(_) => {
                    must.push(u);
                    true
                }
                Reader::RowByRow => self.unread(routing, u, must),
                Reader::Reads => false,
            })
    }

    /// The values of `g` stored packed (module docs): every candidate, then those whose writer
    /// or a reader does not take packed rows dropped until none is.
    fn packed(&self, routing: &Routing, dt: GpuDType) -> Vec<Option<Packed>> {
        let g = self.g;
        let is_output = |v: ValueId| g.outputs.iter().any(|&(_, o)| o == v);
        // The routed kernels run this GEMM's shape (bf16 wants k, n multiples of 8; pointers
        // are aligned: arena slots, packed rows of such widths, device allocations).
        let takes = |r: RoutedGemm| routed_gemm_supported(dt.kernel(), r.k, r.n, [0; 3]);
        let mut packed: Vec<Option<Packed>> = vec![None; g.len()];
        for v in g.ids() {
            let (Some(source), Some(gates)) = (self.zero[v.index()], self.gates(v)) else {
                continue;
            };
            let node = g.node(v);
            let writer = match node.op {
                Op::MatMul { .. } => routing.gemms[v.index()].is_some_and(takes),
                // Through the packed rows' map (moe.cu, moe_grad.cu).
                Op::Dispatch | Op::CombineGrad { .. } => true,
                ref op => row_by_row(op),
            };
            let shape = node.ty.shape();
            let (Some(&experts), Some(&width), Some(top_k)) =
                (shape.first(), shape.last(), top_k(g, gates))
            else {
                continue;
            };
            let indexed = routing.sources.iter().any(|&(s, _, _)| s == source);
            let empty = experts == 0 || width == 0;
            if !writer || !indexed || empty || is_output(v) || shape.len() < 3 || top_k >= experts {
                continue;
            }
            let tokens = node.ty.numel() / (experts * width);
            packed[v.index()] = Some(Packed {
                source,
                rows: tokens * top_k,
                width,
            });
        }
        loop {
            let mut changed = false;
            for v in g.ids() {
                if packed[v.index()].is_none() {
                    continue;
                }
                let node = g.node(v);
                let Some(gates) = self.gates(v) else {
                    continue;
                };
                let ok_packed =
                    |x: ValueId| packed[x.index()].is_some() && self.gates(x) == Some(gates);
                // A row-by-row writer reads packed operands of its own shape only.
                let writes = matches!(
                    node.op,
                    Op::MatMul { .. } | Op::Dispatch | Op::CombineGrad { .. }
                ) || node.inputs.iter().all(|&x| {
                    ok_packed(x) && (matches!(node.op, Op::Reshape) || g.ty(x).same_shape(&node.ty))
                });
                let read = self.users[v.index()].iter().all(|&u| {
                    match self.reader(routing, v, u, gates) {
                        Reader::Skips => true,
                        Reader::Routed(r) => takes(r),
                        Reader::RowByRow => ok_packed(u),
                        Reader::Reads => false,
                    }
                });
                if !(writes && read) {
                    packed[v.index()] = None;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        packed
    }
}

/// Per value, the source whose zero gates make the value's `(expert, token)` rows zero (see
/// the module docs), or `None`.
pub fn zero_rows(g: &Graph) -> Vec<Option<ValueId>> {
    let mut zero: Vec<Option<ValueId>> = vec![None; g.len()];
    for v in g.ids() {
        let node = g.node(v);
        let ins = &node.inputs;
        let of = |i: usize| ins.get(i).and_then(|x| zero[x.index()]);
        let same_shape = |i: usize| ins.get(i).is_some_and(|&x| g.ty(x).same_shape(&node.ty));
        zero[v.index()] = match &node.op {
            Op::Dispatch => Some(v),
            Op::CombineGrad { wrt: CombineWrt::Y } => Some(v),
            Op::MatMul { .. } => {
                let (a, w) = (g.ty(ins[0]).shape(), g.ty(ins[1]).shape());
                of(0).filter(|_| w.len() == 3 && a.len() >= 3 && a[0] == w[0])
            }
            Op::Unary(UnaryOp::Silu | UnaryOp::Relu | UnaryOp::GeluTanh | UnaryOp::GeluErf)
            | Op::Unary(UnaryOp::Neg)
            | Op::Scale(_)
            | Op::Cast(_) => of(0),
            Op::UnaryGrad(_) => of(1).filter(|_| same_shape(1)),
            Op::Mul => of(0)
                .filter(|_| same_shape(0))
                .or_else(|| of(1).filter(|_| same_shape(1))),
            Op::Add => of(0).filter(|&s| of(1) == Some(s) && same_shape(0) && same_shape(1)),
            Op::Reshape => {
                let (i, o) = (g.ty(ins[0]).shape(), node.ty.shape());
                of(0).filter(|_| {
                    i.len() >= 2 && o.len() >= 2 && i[0] == o[0] && i.last() == o.last()
                })
            }
            _ => None,
        };
    }
    zero
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::fixture;
    use shardc_compiler::compile::{compile, CompileSpec, Job};
    use shardc_compiler::model::{build_forward, BuildOptions};
    use shardc_compiler::shard::Mesh;
    use shardc_compiler::train::{Precision, TrainOptions};

    fn names(g: &Graph, r: &Routing) -> Vec<String> {
        g.ids()
            .filter(|v| r.gemms[v.index()].is_some())
            .map(|v| g.node(v).name.clone())
            .collect()
    }

    #[test]
    fn mixtral_forward_routes_its_three_expert_gemms_per_layer() {
        let cfg = fixture("mixtral");
        let g = build_forward(&cfg, BuildOptions::new(2, 8)).unwrap();
        let r = Routing::of(&g, true, GpuDType::F32);
        let routed = names(&g, &r);
        assert_eq!(routed.len(), 3 * cfg.layers, "{routed:?}");
        for proj in ["gate_proj", "up_proj", "down_proj"] {
            assert!(routed.iter().any(|n| n.ends_with(proj)), "{routed:?}");
        }
        // One index per layer, from its dispatch; E = 4 experts, 16 tokens.
        assert_eq!(r.sources.len(), cfg.layers);
        for &(s, e, t) in &r.sources {
            assert!(matches!(g.node(s).op, Op::Dispatch));
            assert_eq!((e, t), (4, 16));
        }
        let down = g
            .ids()
            .find(|&v| g.node(v).name.ends_with("0.moe.down_proj"))
            .unwrap();
        let gemm = r.gemms[down.index()].unwrap();
        assert_eq!((gemm.k, gemm.n, gemm.transpose_w), (128, 64, true));
        // Disabled, or a dense model: nothing routed.
        assert!(Routing::of(&g, false, GpuDType::F32)
            .gemms
            .iter()
            .all(Option::is_none));
        let llama = build_forward(&fixture("llama"), BuildOptions::new(2, 8)).unwrap();
        assert!(Routing::of(&llama, true, GpuDType::F32).sources.is_empty());
    }

    /// The fixture Mixtral's unsharded f32 training step.
    fn mixtral_training() -> (shardc_compiler::model::ModelConfig, Graph) {
        let cfg = fixture("mixtral");
        let mut spec = CompileSpec::new(
            cfg.clone(),
            "mixtral",
            Job::Train(Box::new(TrainOptions::new(2, 8, Mesh::single()))),
        );
        spec.precision = Precision::f32();
        (cfg, compile(&spec).unwrap().program)
    }

    #[test]
    fn mixtral_training_routes_the_backward_data_gemms_too() {
        let (cfg, g) = mixtral_training();
        let r = Routing::of(&g, true, GpuDType::F32);
        let routed = names(&g, &r);
        // Forward: gate, up, down; backward: the three activation gradients (`.da`).
        assert_eq!(routed.len(), 6 * cfg.layers, "{routed:?}");
        assert_eq!(
            routed.iter().filter(|n| n.ends_with(".da")).count(),
            3 * cfg.layers
        );
        assert_eq!(r.sources.len(), 2 * cfg.layers);
        // The three expert weight gradients too, over the rows of the backward's source.
        let wg: Vec<RoutedGemm> = g.ids().filter_map(|v| r.weight_grads[v.index()]).collect();
        assert_eq!(wg.len(), 3 * cfg.layers);
        for w in &wg {
            assert!(matches!(g.node(w.source).op, Op::CombineGrad { .. }));
            assert!(w.transpose_w, "HF expert weights are [E, out, in]");
        }
        // Every other weight gradient stays dense.
        for v in g.ids() {
            if matches!(g.node(v).op, Op::WeightGrad { .. }) && r.weight_grads[v.index()].is_none()
            {
                assert_eq!(g.ty(g.node(v).inputs[2]).rank(), 2, "{}", g.node(v).name);
            }
        }
    }

    /// Mixtral training: every `[E, tokens, ·]` value is packed (`tokens · top_k` rows), and
    /// each expert GEMM and weight gradient is told which of its operands are.
    #[test]
    fn mixtral_training_packs_its_expert_values() {
        let (cfg, g) = mixtral_training();
        let r = Routing::of(&g, true, GpuDType::Bf16);
        let by_name = |name: &str| {
            g.ids()
                .find(|&v| g.node(v).name == name)
                .unwrap_or_else(|| panic!("{name}"))
        };
        let packed = |name: &str| r.packed[by_name(name).index()];
        // 16 tokens, top-2 of 4 experts: 32 rows instead of 64.
        for (name, width) in [
            ("layers.0.moe.dispatch", cfg.hidden),
            ("layers.0.moe.gate_proj", cfg.ffn),
            ("layers.0.moe.up_proj", cfg.ffn),
            ("layers.0.moe.act", cfg.ffn),
            ("layers.0.moe.gate_mul", cfg.ffn),
            ("layers.0.moe.down_proj", cfg.hidden),
            ("bwd.layers.0.moe.combine.dy", cfg.hidden),
            ("bwd.layers.0.moe.down_proj.da", cfg.ffn),
            ("bwd.layers.0.moe.act.dx", cfg.ffn),
            ("bwd.layers.0.moe.up_proj.da", cfg.hidden),
        ] {
            let p = packed(name).unwrap_or_else(|| panic!("{name} not packed"));
            assert_eq!((p.rows, p.width), (32, width), "{name}");
        }
        // Every expert GEMM and weight gradient reads and writes packed rows ((a, out) for
        // GEMMs, (a, dy) for weight gradients).
        for name in [
            "layers.0.moe.gate_proj",
            "layers.0.moe.down_proj",
            "bwd.layers.0.moe.down_proj.da",
            "bwd.layers.0.moe.up_proj.da",
            "grad.layers.0.moe.down_proj.weight",
            "grad.layers.0.moe.up_proj.weight",
        ] {
            assert_eq!(r.packed_flags(&g, by_name(name)), 3, "{name}");
        }
        // Their device footprint follows.
        let gate = by_name("layers.0.moe.gate_proj");
        assert_eq!(r.stored_numel(&g, gate) * 2, g.ty(gate).numel());
        // Without routing nothing is packed.
        let off = Routing::of(&g, false, GpuDType::Bf16);
        assert!(off.packed.iter().all(Option::is_none));
    }

    #[test]
    fn propagation_stops_where_zero_rows_are_not_kept() {
        use shardc_compiler::ir::{DType, TensorType};
        let mut g = Graph::new();
        let f = |s: &[usize]| TensorType::plain(DType::F32, s);
        let x = g.input("x", f(&[1, 6, 8]));
        let gates = g.input("gates", f(&[1, 6, 2]));
        let d = g.add(Op::Dispatch, &[x, gates], "d").unwrap();
        let w = g.param("w", f(&[2, 8, 4]));
        let mm = g
            .add(Op::MatMul { transpose_b: false }, &[d, w], "mm")
            .unwrap();
        let e = g.add(Op::Unary(UnaryOp::Exp), &[mm], "exp").unwrap();
        let s = g.add(Op::Unary(UnaryOp::Silu), &[mm], "silu").unwrap();
        let bias = g.param("bias", f(&[4]));
        let b = g.add(Op::Add, &[s, bias], "biased").unwrap();
        let w2 = g.param("w2", f(&[2, 4, 8]));
        let after_exp = g
            .add(Op::MatMul { transpose_b: false }, &[e, w2], "m2")
            .unwrap();
        let after_bias = g
            .add(Op::MatMul { transpose_b: false }, &[b, w2], "m3")
            .unwrap();
        let after_silu = g
            .add(Op::MatMul { transpose_b: false }, &[s, w2], "m4")
            .unwrap();
        let z = zero_rows(&g);
        assert_eq!(z[mm.index()], Some(d));
        assert_eq!(z[s.index()], Some(d));
        assert_eq!(z[e.index()], None, "exp(0) = 1");
        assert_eq!(z[b.index()], None, "a bias fills the zero rows");
        let r = Routing::of(&g, true, GpuDType::F32);
        assert!(r.gemms[mm.index()].is_some());
        assert!(r.gemms[after_silu.index()].is_some());
        assert!(r.gemms[after_exp.index()].is_none());
        assert!(r.gemms[after_bias.index()].is_none());
        assert_eq!(r.sources, vec![(d, 2, 6)]);
        // Unrouted rows left unwritten only where nothing reads them: `mm`'s are read by exp
        // and by the bias add (whose rows are not zero); `m4` has no reader.
        assert_eq!(r.unfilled[mm.index()], None);
        assert_eq!(r.unfilled[after_silu.index()], Some(vec![]));
        assert_eq!(r.unfilled[d.index()], None, "only routed GEMMs");
        // Through silu into a routed GEMM (which must then run routed) and a combine of the
        // same gates: unread; a combine of other gates, or an output, reads them.
        let mut g2 = g.clone();
        let other = g2.input("other", f(&[1, 6, 2]));
        let m5 = g2
            .add(Op::MatMul { transpose_b: false }, &[d, w], "m5")
            .unwrap();
        let s5 = g2.add(Op::Unary(UnaryOp::Silu), &[m5], "s5").unwrap();
        let m6 = g2
            .add(Op::MatMul { transpose_b: false }, &[s5, w2], "m6")
            .unwrap();
        let c6 = g2.add(Op::Combine, &[m6, gates], "c6").unwrap();
        g2.set_output("c6", c6);
        let m7 = g2
            .add(Op::MatMul { transpose_b: false }, &[d, w], "m7")
            .unwrap();
        let c7 = g2.add(Op::Combine, &[m7, other], "c7").unwrap();
        g2.set_output("c7", c7);
        let r2 = Routing::of(&g2, true, GpuDType::F32);
        assert_eq!(r2.unfilled[m5.index()], Some(vec![m6]));
        assert_eq!(r2.unfilled[m6.index()], Some(vec![]));
        assert_eq!(r2.unfilled[m7.index()], None, "combined by other gates");
        let m8 = g2
            .add(Op::MatMul { transpose_b: false }, &[d, w], "m8")
            .unwrap();
        g2.add(Op::Softmax, &[m8], "sm8").unwrap();
        let r2 = Routing::of(&g2, true, GpuDType::F32);
        assert_eq!(r2.unfilled[m8.index()], None, "a softmax reads every row");
        g2.set_output("m6", m6);
        let r2 = Routing::of(&g2, true, GpuDType::F32);
        assert_eq!(r2.unfilled[m6.index()], None, "an output");
        assert_eq!(r2.unfilled[m5.index()], Some(vec![m6]));
        // A source the executor would not run by itself takes its GEMMs with it.
        let mut r = r;
        r.keep_sources(&g, GpuDType::F32, |s| s != d);
        assert!(r.sources.is_empty());
        assert!(r.gemms.iter().all(Option::is_none));
    }
}
