//! Every rewrite rule checked by differential execution: random small SPMD programs on random
//! meshes (`tp` ∈ {2, 3, 4}, sometimes with `dp=2`; odd sizes), rewritten with one rule group
//! and extracted with pseudo-random costs that favour rewritten nodes (so arbitrary programs
//! of the e-graph run, not only the cheapest), then run next to the original on thread ranks:
//! every rank's outputs must agree within f32 tolerance. 256 cases per rule (and per group);
//! each must fire in a good share of them and change some programs. The
//! test-only `broken-gather-sink-norm` (a rule without its side condition) must be caught.
//! The cases come from a fixed seed (`SHARDC_PROPTEST_RANDOM=1` draws fresh ones).

mod common;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRng, TestRunner};
use shardc::compiler::ir::{
    AdamWSpec, CombineWrt, DType, Dim, Float, Graph, NormWrt, Op, Role, ShardSpec, TensorType,
    UnaryOp, ValueId,
};
use shardc::compiler::rewrite::{
    canonical_text, rewrite, Objective, RewriteOptions, RuleSelection,
};
use shardc::compiler::shard::{Mesh, ShardedGraph, TensorSharding};
use shardc::runtime::spmd::run_spmd;
use shardc::runtime::{Tensor, Weights};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// One random program: mesh and sizes, then steps `(op, a, b)` replayed by [`Builder`].
#[derive(Clone, Debug)]
struct Case {
    tp: usize,
    dp: bool,
    b: usize,
    t0: usize,
    h0: usize,
    roles: bool,
    steps: Vec<(u8, u16, u16)>,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        2usize..=4,
        any::<bool>(),
        1usize..=2,
        prop::sample::select(vec![1usize, 3]),
        prop::sample::select(vec![1usize, 2, 3]),
        any::<bool>(),
        prop::collection::vec((any::<u8>(), any::<u16>(), any::<u16>()), 3..12),
        any::<u64>(),
    )
        .prop_map(|(tp, dp, b, t0, h0, roles, steps, seed)| Case {
            tp,
            dp: dp && tp <= 3,
            b,
            t0,
            h0,
            roles,
            steps,
            seed,
        })
}

/// The ops a step can add; a group's focus repeats the ones its rules need.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    AllReduce,
    ReduceScatter,
    AllGather,
    LocalSlice,
    Unary,
    Binary,
    Norm,
    MatMul,
    Rope,
    Moe,
    /// A partial sum (a matmul over a sharded contraction), then all-reduced.
    PartialAllReduce,
    /// A gather followed by an op that may sink below it.
    GatherThenOp,
    /// A partial sum reduce-scattered through a linear op.
    ScatterLinear,
    /// A slice of a gather, or a gather of a slice.
    SliceGather,
    /// An elementwise chain, a norm of a sum, a GEMM with an epilogue.
    Fusable,
    /// A gather feeding a GEMM.
    GatherMatMul,
    /// A GEMM feeding a reduce-scatter.
    MatMulScatter,
    /// An all-reduced gradient feeding an AdamW update of replicated weight and moments.
    WeightUpdate,
    /// A gradient op of a training step (norm, bias, mixture of experts) reading gathered
    /// values.
    GatheredGrad,
    /// Per-head work on heads gathered from their ranks: a hidden dim gathered and split into
    /// heads, rotary embedding, attention against replicated or gathered keys and values,
    /// the heads merged back.
    Heads,
    /// An all-reduced value through a linear op (scale, product, MoE combine).
    LinearOfReduce,
    /// A rank's slice of a whole parameter (the checkpoint's embedding table).
    SliceParam,
}

const BASE: [Step; 10] = [
    Step::AllReduce,
    Step::ReduceScatter,
    Step::AllGather,
    Step::LocalSlice,
    Step::Unary,
    Step::Binary,
    Step::Norm,
    Step::MatMul,
    Step::Rope,
    Step::Moe,
];

fn menu(group: &str) -> Vec<Step> {
    let mut m = BASE.to_vec();
    let focus: &[Step] = match group {
        "allreduce-split" => &[Step::PartialAllReduce, Step::AllReduce],
        "gather-sink" | "broken-gather-sink-norm" => {
            &[Step::GatherThenOp, Step::GatherThenOp, Step::GatheredGrad]
        }
        "scatter-hoist" => &[Step::ScatterLinear, Step::ScatterLinear],
        "slice-of-gather" | "gather-of-slice" => &[Step::SliceGather, Step::SliceGather],
        "collective-matmul" => &[Step::GatherMatMul, Step::MatMulScatter],
        "fuse-elementwise" => &[Step::Fusable, Step::Fusable],
        "weight-update-sharding" => &[Step::WeightUpdate, Step::WeightUpdate],
        "layout" => &[
            Step::MatMul,
            Step::Heads,
            Step::LinearOfReduce,
            Step::SliceParam,
        ],
        _ => &[],
    };
    for _ in 0..3 {
        m.extend_from_slice(focus);
    }
    m
}

/// Replays a [`Case`] into an SPMD program with its inputs.
struct Builder {
    g: Graph,
    tp: usize,
    dp: bool,
    roles: bool,
    /// f32 values that later steps may use.
    pool: Vec<ValueId>,
    inputs: BTreeMap<String, Tensor>,
    rng: common::Rng,
}

impl Builder {
    fn ty(&self, shape: &[usize]) -> TensorType {
        let roles = [Role::Batch, Role::Seq, Role::Hidden];
        let dims = shape
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let r = if self.roles && shape.len() == 3 {
                    roles[i]
                } else {
                    Role::Other
                };
                Dim::new(r, s)
            })
            .collect();
        TensorType::new(DType::F32, dims)
    }

    /// An input whose local shape is `local`, split over `tp` along `tp_dim`, and over `dp`
    /// along dim 0 when `data` (activations of a dp mesh).
    fn input(&mut self, local: &[usize], tp_dim: Option<usize>, data: bool, i32s: bool) -> ValueId {
        let name = format!("in{}", self.inputs.len());
        let mut shards = Vec::new();
        let mut global = local.to_vec();
        if data && self.dp && !local.is_empty() {
            shards.push(ShardSpec {
                dim: 0,
                axis: "dp".into(),
                parts: 2,
            });
            global[0] *= 2;
        }
        if let Some(d) = tp_dim {
            shards.push(ShardSpec {
                dim: d,
                axis: "tp".into(),
                parts: self.tp,
            });
            global[d] *= self.tp;
        }
        let n: usize = global.iter().product();
        let t = if i32s {
            let v = (0..n).map(|_| (self.rng.next_u64() % 9) as i32).collect();
            Tensor::i32(global, v)
        } else {
            let v = (0..n).map(|_| self.rng.unit()).collect();
            Tensor::f32(global, v)
        };
        self.inputs.insert(name.clone(), t);
        let mut ty = self.ty(local);
        if i32s {
            ty.dtype = DType::I32;
        }
        self.g
            .add_typed(
                Op::Input {
                    name: name.clone(),
                    shards,
                },
                &[],
                Some(ty),
                name,
            )
            .expect("inputs type-check")
    }

    /// AdamW on a weight shaped like `x` (weight, moments and step replicated inputs; the
    /// second moment a square), its gradient `x` all-reduced over `tp` or `dp`.
    fn weight_update(&mut self, x: ValueId, b: u16) -> Option<ValueId> {
        let shape = self.shape(x);
        let axis = if self.dp && b % 2 == 1 { "dp" } else { "tp" };
        let g = self.add(Op::AllReduce { axis: axis.into() }, &[x])?;
        let w = self.input(&shape, None, false, false);
        let m = self.input(&shape, None, false, false);
        let v = self.input(&shape, None, false, false);
        let v = self.add(Op::Mul, &[v, v])?;
        let t = self.input(&[], None, false, false);
        let t = self.add(Op::Unary(UnaryOp::Exp), &[t])?;
        let m1 = self.add(
            Op::AdamMoment {
                beta: Float(0.9),
                squared: false,
            },
            &[m, g],
        )?;
        let m2 = self.add(
            Op::AdamMoment {
                beta: Float(0.95),
                squared: true,
            },
            &[v, g],
        )?;
        if b % 3 == 0 {
            // The moments are outputs too (as in a training step).
            self.pool.push(m1);
        }
        self.add(Op::AdamWUpdate(AdamWSpec::default()), &[w, m1, m2, t])
    }

    fn add(&mut self, op: Op, ins: &[ValueId]) -> Option<ValueId> {
        let name = format!("v{}", self.g.len());
        self.g.add(op, ins, name).ok()
    }

    fn push(&mut self, v: Option<ValueId>) -> Option<ValueId> {
        if let Some(v) = v {
            self.pool.push(v);
        }
        v
    }

    fn shape(&self, v: ValueId) -> Vec<usize> {
        self.g.ty(v).shape()
    }

    fn pick(&mut self, a: u16) -> ValueId {
        // Recent values more often.
        let n = self.pool.len();
        let back = (a as usize % 3).min(n - 1);
        if a % 4 == 0 {
            self.pool[a as usize % n]
        } else {
            self.pool[n - 1 - back]
        }
    }

    fn divisible(&self, v: ValueId, d: usize) -> bool {
        let s = self.shape(v);
        d < s.len() && s[d] % self.tp == 0
    }

    fn tp_op(&self, kind: u8, d: usize) -> Op {
        let (axis, parts) = ("tp".to_string(), self.tp);
        match kind {
            0 => Op::AllGather {
                axis,
                dim: d,
                parts,
            },
            1 => Op::ReduceScatter {
                axis,
                dim: d,
                parts,
            },
            _ => Op::LocalSlice {
                axis,
                dim: d,
                parts,
            },
        }
    }

    fn sinkable(&mut self, x: ValueId, k: u16) -> Option<ValueId> {
        match k % 6 {
            0 => self.unary(x, k / 6),
            1 => self.binary(x, k / 6),
            2 => self.norm(x, k / 6),
            3 => self.matmul(x, k / 6),
            4 => self.rope(x, None),
            _ => self.moe(x, k / 6),
        }
    }

    fn unary(&mut self, x: ValueId, k: u16) -> Option<ValueId> {
        let op = match k % 6 {
            0 => Op::Unary(UnaryOp::Silu),
            1 => Op::Unary(UnaryOp::GeluTanh),
            2 => Op::Unary(UnaryOp::Relu),
            3 => Op::Unary(UnaryOp::Neg),
            4 => Op::Scale(Float(-1.25)),
            _ => {
                let r = self.shape(x).len();
                Op::Repeat {
                    dim: (k as usize / 6) % r,
                    times: 2,
                }
            }
        };
        self.add(op, &[x])
    }

    fn binary(&mut self, x: ValueId, k: u16) -> Option<ValueId> {
        let op = if k % 2 == 0 { Op::Add } else { Op::Mul };
        let same: Vec<ValueId> = self
            .pool
            .iter()
            .copied()
            .filter(|&v| self.g.ty(v) == self.g.ty(x))
            .collect();
        let s = self.shape(x);
        let partner = match (k / 2) % 4 {
            0 if !same.is_empty() => same[(k as usize / 8) % same.len()],
            1 => {
                // A broadcast bias, replicated (or split over tp: not replicated).
                let last = *s.last()?;
                let split = (k / 8) % 3 == 0;
                self.input(&[last], split.then_some(0), false, false)
            }
            2 => {
                // A full-shape partner, replicated over tp.
                self.input(&s, None, true, false)
            }
            _ => x,
        };
        let (a, b) = if k % 3 == 0 && self.g.ty(partner).rank() == s.len() {
            (partner, x)
        } else {
            (x, partner)
        };
        self.add(op, &[a, b])
    }

    fn norm(&mut self, x: ValueId, k: u16) -> Option<ValueId> {
        let last = *self.shape(x).last()?;
        let split = k % 5 == 4;
        let mut w = || self.input(&[last], split.then_some(0), false, false);
        match k % 4 {
            0 => {
                let w = w();
                self.add(Op::RmsNorm { eps: Float(1e-5) }, &[x, w])
            }
            1 => {
                let (w, b) = (w(), w());
                self.add(Op::LayerNorm { eps: Float(1e-5) }, &[x, w, b])
            }
            2 => self.add(Op::Softmax, &[x]),
            // Every expert kept: a top-k selection would turn the last-bit differences of
            // reordered sums into different choices (a discontinuity, not a wrong rewrite).
            _ => self.add(
                Op::Router {
                    top_k: last,
                    normalize: false,
                },
                &[x],
            ),
        }
    }

    fn matmul(&mut self, x: ValueId, k: u16) -> Option<ValueId> {
        let s = self.shape(x);
        if s.len() < 2 {
            return None;
        }
        let kk = *s.last()?;
        let n = [kk, 2, 3 * self.tp][(k as usize) % 3];
        let tb = k % 2 == 1;
        let local = if tb { vec![n, kk] } else { vec![kk, n] };
        // Replicated, or split over tp along either dim (per-rank weights).
        let split = match (k / 3) % 3 {
            0 => None,
            1 => Some(0),
            _ => Some(1),
        };
        let w = self.input(&local, split, false, false);
        self.add(Op::MatMul { transpose_b: tb }, &[x, w])
    }

    /// Rotary embedding of `x` viewed as one head; with `gather`, the 4-D view is gathered
    /// along that dim (batch or sequence) first, so the rope reads a gather directly.
    fn rope(&mut self, x: ValueId, gather: Option<usize>) -> Option<ValueId> {
        let s = self.shape(x);
        if s.len() != 3 || s[2] % 2 != 0 {
            return None;
        }
        let t4 = TensorType::plain(DType::F32, &[s[0], s[1], 1, s[2]]);
        let mut x4 = self.g.add_typed(Op::Reshape, &[x], Some(t4), "x4").ok()?;
        if let Some(d) = gather {
            x4 = self.add(self.tp_op(0, d), &[x4])?;
        }
        let s4 = self.shape(x4);
        let pos = self.input(&[s4[0], s4[1]], None, false, true);
        let spec = shardc::compiler::ir::RopeSpec {
            theta: Float(1e4),
            style: shardc::compiler::ir::RopeStyle::Half,
            scaling: None,
        };
        let r = self.add(Op::Rope(spec), &[x4, pos])?;
        let t3 = TensorType::plain(DType::F32, &[s4[0], s4[1], s4[3]]);
        self.g.add_typed(Op::Reshape, &[r], Some(t3), "x3").ok()
    }

    /// `x` [.., H] routed to `e` experts by a replicated router weight: the router's logits
    /// and the gates.
    fn routed(&mut self, x: ValueId, e: usize) -> Option<(ValueId, ValueId)> {
        let h = *self.shape(x).last()?;
        let wg = self.input(&[h, e], None, false, false);
        let logits = self.add(Op::MatMul { transpose_b: false }, &[x, wg])?;
        let gates = self.add(
            Op::Router {
                top_k: e,
                normalize: true,
            },
            &[logits],
        )?;
        Some((logits, gates))
    }

    /// `x` [B, T, H] routed to `e` experts (a replicated router weight): the gates and the
    /// dispatched tokens [E, B, T, H].
    fn dispatched(&mut self, x: ValueId, e: usize) -> Option<(ValueId, ValueId)> {
        let (_, gates) = self.routed(x, e)?;
        let d = self.add(Op::Dispatch, &[x, gates])?;
        Some((gates, d))
    }

    fn moe(&mut self, x: ValueId, k: u16) -> Option<ValueId> {
        let s = self.shape(x);
        if s.len() != 3 {
            return None;
        }
        let (h, e) = (s[2], 2);
        let (gates, d) = self.dispatched(x, e)?;
        let split = (k % 2 == 1).then_some(1);
        let we = self.input(&[e, h, h], split, false, false);
        let y = self.add(Op::MatMul { transpose_b: false }, &[d, we])?;
        self.add(Op::Combine, &[y, gates])
    }

    /// A per-rank value shaped `local`, all-gathered over `tp` along `d` (a per-token
    /// gradient arriving gathered).
    fn gathered_input(&mut self, local: &[usize], d: usize) -> Option<ValueId> {
        let x = self.input(local, Some(d), false, false);
        self.add(self.tp_op(0, d), &[x])
    }

    /// A gradient op of a training step on gathered values: `x` gathered along a token dim
    /// (batch or sequence), then a norm's input or weight gradient, a bias gradient, or a
    /// mixture-of-experts gradient (combine wrt either operand, dispatch, router), its
    /// incoming gradient gathered along the same dim.
    fn gathered_grad(&mut self, x: ValueId, b: u16) -> Option<ValueId> {
        let s = self.shape(x);
        if s.len() != 3 {
            return None;
        }
        let d = b as usize % 2;
        let h = s[2];
        let gx = self.add(self.tp_op(0, d), &[x])?;
        let dy = self.gathered_input(&s, d)?;
        let w = self.input(&[h], None, false, false);
        let eps = Float(1e-5);
        let e = 2;
        match (b / 2) % 9 {
            // RmsNorm then LayerNorm, each wrt x then weight.
            k @ 0..=3 => {
                let wrt = [NormWrt::X, NormWrt::Weight][k as usize % 2];
                let op = if k < 2 {
                    Op::RmsNormGrad { eps, wrt }
                } else {
                    Op::LayerNormGrad { eps, wrt }
                };
                self.add(op, &[gx, w, dy])
            }
            4 => self.add(Op::BiasGrad, &[dy, w]),
            5 | 6 => {
                let (_, g) = self.routed(gx, e)?;
                let y = self.add(Op::Dispatch, &[gx, g])?;
                let wrt = if (b / 2) % 9 == 5 {
                    CombineWrt::Y
                } else {
                    CombineWrt::Gates
                };
                self.add(Op::CombineGrad { wrt }, &[y, g, dy])
            }
            7 => {
                let (_, g) = self.routed(gx, e)?;
                let mut local = vec![e];
                local.extend_from_slice(&s);
                let dxe = self.gathered_input(&local, d + 1)?;
                self.add(Op::DispatchGrad, &[dxe, g])
            }
            _ => {
                let (logits, _) = self.routed(gx, e)?;
                let mut local = s.clone();
                local[2] = e;
                let dg = self.gathered_input(&local, d)?;
                self.add(
                    Op::RouterGrad {
                        top_k: e,
                        normalize: true,
                    },
                    &[logits, dg],
                )
            }
        }
    }

    /// Heads gathered from the ranks of `tp` (a column-parallel projection's output), split
    /// out of the hidden dim, turned by rotary embedding, attended against keys and values
    /// (replicated, or gathered heads too), and merged back into the hidden dim.
    fn heads(&mut self, x: ValueId, k: u16) -> Option<ValueId> {
        let s = self.shape(x);
        if s.len() != 3 {
            return None;
        }
        let (b, t, hd, tp) = (s[0], s[1], 2, self.tp);
        let lh = 1 + (k as usize % 2);
        // The hidden dim gathered then split into heads, or the heads gathered.
        let mut q = if (k / 8) % 2 == 0 {
            let q = self.gathered_input(&[b, t, lh * hd], 2)?;
            let heads = TensorType::plain(DType::F32, &[b, t, tp * lh, hd]);
            self.g
                .add_typed(Op::Reshape, &[q], Some(heads), "q4")
                .ok()?
        } else {
            self.gathered_input(&[b, t, lh, hd], 2)?
        };
        if k % 3 != 1 {
            let pos = self.input(&[b, t], None, false, true);
            let spec = shardc::compiler::ir::RopeSpec {
                theta: Float(1e4),
                style: shardc::compiler::ir::RopeStyle::Half,
                scaling: None,
            };
            q = self.add(Op::Rope(spec), &[q, pos])?;
        }
        let mut kv = || -> Option<ValueId> {
            if k % 4 == 3 {
                let l = self.gathered_input(&[b, t, hd], 2)?;
                let ty = TensorType::plain(DType::F32, &[b, t, tp, hd]);
                self.g.add_typed(Op::Reshape, &[l], Some(ty), "kv4").ok()
            } else {
                Some(self.input(&[b, t, tp, hd], None, false, false))
            }
        };
        let (kk, vv) = (kv()?, kv()?);
        let spec = shardc::compiler::ir::AttnSpec {
            causal: k % 2 == 0,
            window: None,
            scale: Float(0.5),
            indexed: false,
        };
        let mut ins = vec![q, kk, vv];
        if k % 5 == 0 {
            ins.push(self.input(&[b, t], None, false, false));
        }
        let o = self.add(Op::Attention(spec), &ins)?;
        let merged = TensorType::plain(DType::F32, &[b, t, tp * lh * hd]);
        self.g.add_typed(Op::Reshape, &[o], Some(merged), "o3").ok()
    }

    /// An all-reduce, then an op linear in the reduced value: a scale, a product with a
    /// replicated factor, or an MoE combine of all-reduced expert outputs.
    fn linear_of_reduce(&mut self, x: ValueId, k: u16) -> Option<ValueId> {
        let ar = |me: &mut Builder, v: ValueId| me.add(Op::AllReduce { axis: "tp".into() }, &[v]);
        match k % 3 {
            0 => {
                let r = ar(self, x)?;
                self.add(Op::Scale(Float(0.5)), &[r])
            }
            1 => {
                let r = ar(self, x)?;
                let s = self.shape(x);
                let f = self.input(&s, None, false, false);
                let ins = if k % 2 == 0 { [r, f] } else { [f, r] };
                self.add(Op::Mul, &ins)
            }
            _ => {
                let s = self.shape(x);
                if s.len() != 3 {
                    return None;
                }
                let (h, e) = (s[2], 2);
                let (gates, d) = self.dispatched(x, e)?;
                let we = self.input(&[e, h, h], None, false, false);
                let y = self.add(Op::MatMul { transpose_b: false }, &[d, we])?;
                let r = ar(self, y)?;
                self.add(Op::Combine, &[r, gates])
            }
        }
    }

    fn step(&mut self, op: Step, a: u16, b: u16) {
        let x = self.pick(a);
        let r = self.shape(x).len();
        let d = b as usize % r;
        let v = match op {
            Step::AllReduce => self.add(Op::AllReduce { axis: "tp".into() }, &[x]),
            Step::ReduceScatter if self.divisible(x, d) => self.add(self.tp_op(1, d), &[x]),
            Step::AllGather => self.add(self.tp_op(0, d), &[x]),
            Step::LocalSlice if self.divisible(x, d) => self.add(self.tp_op(2, d), &[x]),
            Step::Unary => self.unary(x, b),
            Step::Binary => self.binary(x, b),
            Step::Norm => self.norm(x, b),
            Step::MatMul => self.matmul(x, b),
            Step::Rope => self.rope(x, None),
            Step::Moe => self.moe(x, b),
            Step::PartialAllReduce => {
                let p = self.matmul(x, 3 + 9 * (b % 7));
                p.and_then(|p| self.add(Op::AllReduce { axis: "tp".into() }, &[p]))
            }
            Step::GatherThenOp if (b / 4) % 12 == 4 => self.rope(x, Some(d % 2)),
            Step::GatherThenOp => {
                let g = self.add(self.tp_op(0, d), &[x]);
                let g = self.push(g);
                g.and_then(|g| self.sinkable(g, b / 4))
            }
            Step::ScatterLinear => {
                let y = match b % 3 {
                    0 => self.moe(x, 1),
                    1 => self.matmul(x, 3),
                    _ => self.binary(x, 5),
                };
                let y = y.and_then(|y| match b % 3 {
                    1 => self.add(Op::Scale(Float(0.5)), &[y]),
                    _ => Some(y),
                });
                y.and_then(|y| {
                    let dd = (b as usize / 3) % self.shape(y).len();
                    if self.divisible(y, dd) {
                        self.add(self.tp_op(1, dd), &[y])
                    } else {
                        Some(y)
                    }
                })
            }
            Step::SliceGather => {
                let e = (b as usize / 5) % r;
                if b % 2 == 0 {
                    let g = self.add(self.tp_op(0, d), &[x]);
                    g.and_then(|g| {
                        if self.divisible(g, e) {
                            self.add(self.tp_op(2, e), &[g])
                        } else {
                            Some(g)
                        }
                    })
                } else if self.divisible(x, d) {
                    let s = self.add(self.tp_op(2, d), &[x]);
                    s.and_then(|s| self.add(self.tp_op(0, d), &[s]))
                } else {
                    None
                }
            }
            Step::GatherMatMul => {
                let g = self.add(self.tp_op(0, d), &[x]);
                g.and_then(|g| self.matmul(g, b / 4))
            }
            Step::MatMulScatter => {
                let m = self.matmul(x, b / 4);
                m.and_then(|m| {
                    let dd = usize::from(b % 5 == 0);
                    if self.divisible(m, dd) {
                        self.add(self.tp_op(1, dd), &[m])
                    } else if self.divisible(m, 1) {
                        self.add(self.tp_op(1, 1), &[m])
                    } else {
                        Some(m)
                    }
                })
            }
            Step::WeightUpdate => self.weight_update(x, b),
            Step::GatheredGrad => self.gathered_grad(x, b),
            Step::Heads => self.heads(x, b),
            Step::LinearOfReduce => self.linear_of_reduce(x, b),
            Step::SliceParam => {
                let src = shardc::compiler::ir::ParamSource::whole("model.embed_tokens.weight");
                let ty = TensorType::plain(DType::F32, &[256, 64]);
                let p = self
                    .g
                    .add_typed(Op::Param(src), &[], Some(ty), "embed")
                    .ok();
                let d = b as usize % 2;
                p.filter(|&p| self.divisible(p, d)).and_then(|p| {
                    let sl = self.add(self.tp_op(2, d), &[p])?;
                    self.add(Op::Add, &[sl, sl])
                })
            }
            Step::Fusable => match b % 3 {
                0 => {
                    let u = self.binary(x, b / 3);
                    u.and_then(|u| self.unary(u, b / 7))
                }
                1 => {
                    let s = self.add(Op::Add, &[x, x]);
                    let w = self.shape(x).last().copied();
                    match (s, w) {
                        (Some(s), Some(w)) => {
                            let w = self.input(&[w], None, false, false);
                            self.add(Op::RmsNorm { eps: Float(1e-5) }, &[s, w])
                        }
                        _ => None,
                    }
                }
                _ => {
                    let m = self.matmul(x, b / 3);
                    m.and_then(|m| self.binary(m, 2 + 8 * (b / 9)))
                }
            },
            _ => None,
        };
        self.push(v);
    }
}

/// Builds the program of `c` for rule group `group`.
fn build(c: &Case, group: &str) -> (ShardedGraph, BTreeMap<String, Tensor>) {
    let mesh_text = if c.dp {
        format!("dp=2,tp={}", c.tp)
    } else {
        format!("tp={}", c.tp)
    };
    let mesh = Mesh::parse(&mesh_text, 8).expect("mesh");
    let mut b = Builder {
        g: Graph::new(),
        tp: c.tp,
        dp: c.dp,
        roles: c.roles,
        pool: Vec::new(),
        inputs: BTreeMap::new(),
        rng: common::Rng(c.seed),
    };
    let (t, h) = (c.tp * c.t0, c.tp * c.h0);
    let x0 = b.input(&[c.b, t, h], None, true, false);
    b.pool.push(x0);
    let x1 = b.input(&[c.b, t / c.tp, h], Some(1), true, false);
    b.pool.push(x1);
    let m = menu(group);
    for &(op, a, s) in &c.steps {
        b.step(m[op as usize % m.len()], a, s);
    }
    let n = b.pool.len();
    let mut outs: BTreeSet<ValueId> = BTreeSet::new();
    outs.insert(b.pool[n - 1]);
    outs.insert(b.pool[(c.seed as usize) % n]);
    for (i, v) in outs.into_iter().enumerate() {
        b.g.set_output(&format!("out{i}"), v);
    }
    let len = b.g.len();
    (
        ShardedGraph {
            graph: b.g,
            shardings: vec![TensorSharding::default(); len],
            provenance: vec![None; len],
            mesh,
        },
        b.inputs,
    )
}

/// Equal within f32 tolerance: sums may be reordered (a ring reduce-scatter adds in another
/// order than an all-reduce), so the bound scales with the tensor's largest magnitude, not
/// each element's (a sum that cancels keeps the rounding of its large terms).
fn close(a: &Tensor, b: &Tensor) -> bool {
    if a.shape != b.shape {
        return false;
    }
    match (a.as_f32(), b.as_f32()) {
        (Some(x), Some(y)) => {
            let scale = x
                .iter()
                .chain(y)
                .filter(|v| v.is_finite())
                .fold(0.0f32, |m, v| m.max(v.abs()));
            let tol = 1e-4 * (1.0 + scale);
            x.iter()
                .zip(y)
                .all(|(&p, &q)| (p.is_nan() && q.is_nan()) || p == q || (p - q).abs() <= tol)
        }
        _ => a == b,
    }
}

/// Counters of one group's run.
#[derive(Default)]
struct Stats {
    cases: AtomicUsize,
    fired: AtomicUsize,
    changed: AtomicUsize,
    rules: Mutex<BTreeMap<String, usize>>,
}

fn weights() -> Weights {
    // The programs read one parameter at most (the embedding table, `SliceParam`): the llama
    // fixture's.
    Weights::open(common::fixtures().join("llama")).expect("weights")
}

/// Builds, rewrites, runs and compares one case.
fn check(
    c: &Case,
    group: &str,
    rules: &RuleSelection,
    w: &Weights,
    stats: &Stats,
) -> Result<(), TestCaseError> {
    let (sg, inputs) = build(c, group);
    let opts = RewriteOptions {
        rules: rules.clone(),
        dedup: false,
        objective: Objective::Shuffle(c.seed),
        ..RewriteOptions::default()
    };
    let r = rewrite(&sg, &opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
    stats.cases.fetch_add(1, Ordering::Relaxed);
    if !r.report.fired.is_empty() {
        stats.fired.fetch_add(1, Ordering::Relaxed);
        let mut m = stats.rules.lock().expect("stats");
        for (k, v) in &r.report.fired {
            *m.entry(k.clone()).or_default() += v;
        }
    }
    if canonical_text(&r.sharded.graph) != canonical_text(&sg.graph) {
        stats.changed.fetch_add(1, Ordering::Relaxed);
    }
    let t = Duration::from_secs(20);
    let want = run_spmd(&sg.graph, &sg.mesh, w, &inputs, t)
        .map_err(|e| TestCaseError::reject(format!("original does not run: {e}")))?;
    let got = run_spmd(&r.sharded.graph, &sg.mesh, w, &inputs, t).map_err(|e| {
        TestCaseError::fail(format!("rewritten does not run: {e}\n{}", r.sharded.graph))
    })?;
    for (rank, (a, b)) in want.iter().zip(&got).enumerate() {
        for (name, x) in a {
            let y = &b[name];
            if !close(x, y) {
                let worst = match (x.as_f32(), y.as_f32()) {
                    (Some(p), Some(q)) => common::max_abs_diff(p, q),
                    _ => f32::NAN,
                };
                return Err(TestCaseError::fail(format!(
                    "rank {rank} output {name} differs (max |Δ| {worst:e})\noriginal:\n{}\nrewritten:\n{}",
                    sg.graph, r.sharded.graph
                )));
            }
        }
    }
    Ok(())
}

/// A runner with a fixed seed, so the coverage thresholds below cannot flake; set
/// `SHARDC_PROPTEST_RANDOM=1` to draw fresh programs.
fn runner(cases: u32) -> TestRunner {
    let config = Config {
        cases,
        max_global_rejects: 4 * cases,
        failure_persistence: None,
        ..Config::default()
    };
    if std::env::var_os("SHARDC_PROPTEST_RANDOM").is_some() {
        TestRunner::new(config)
    } else {
        let rng = TestRng::deterministic_rng(config.rng_algorithm);
        TestRunner::new_with_rng(config, rng)
    }
}

/// Runs 256 cases of rule (or group) `rule`, on programs drawn with the focus of `menu_of`,
/// and checks coverage: it fired in at least `min_fired` of the cases.
fn property(rule: &str, menu_of: &str, min_fired: f64) {
    let w = weights();
    let stats = Stats::default();
    let rules = RuleSelection::Named(vec![rule.to_string()]);
    let result = runner(256).run(&case(), |c| check(&c, menu_of, &rules, &w, &stats));
    if let Err(e) = result {
        panic!("{rule}: {e}");
    }
    let n = stats.cases.load(Ordering::Relaxed) as f64;
    let fired = stats.fired.load(Ordering::Relaxed) as f64;
    let changed = stats.changed.load(Ordering::Relaxed) as f64;
    let per_rule = stats.rules.lock().expect("stats").clone();
    eprintln!("{rule}: {n} cases, fired in {fired}, changed {changed}; {per_rule:?}");
    assert!(n >= 256.0, "{rule}: only {n} cases ran");
    assert!(
        fired / n >= min_fired,
        "{rule}: fired in {fired} of {n} cases"
    );
    assert!(changed > 0.0, "{rule}: no program changed");
    let resolved = rules.resolve().expect("rules");
    common::assert_each_counted(&per_rule, resolved.iter().map(|r| r.name()), |name| {
        format!("{rule}: rule {name} never fired")
    });
}

/// One test per rule: `name => (rule, the group whose programs it is drawn on, min share)`.
macro_rules! rule_tests {
    ($($test:ident => ($rule:literal, $menu:literal, $min:literal)),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                property($rule, $menu, $min);
            }
        )*
    };
}

rule_tests! {
    allreduce_split => ("allreduce-split", "allreduce-split", 0.5),
    slice_of_gather => ("slice-of-gather", "slice-of-gather", 0.2),
    gather_of_slice => ("gather-of-slice", "gather-of-slice", 0.2),
    gather_slice_to_all_to_all => ("gather-slice-to-all-to-all", "slice-of-gather", 0.2),
    gather_sink_norm => ("gather-sink-norm", "gather-sink", 0.1),
    gather_sink_elementwise => ("gather-sink-elementwise", "gather-sink", 0.2),
    gather_sink_binary => ("gather-sink-binary", "gather-sink", 0.2),
    gather_sink_matmul => ("gather-sink-matmul", "gather-sink", 0.2),
    gather_sink_reshape => ("gather-sink-reshape", "gather-sink", 0.05),
    gather_sink_rope => ("gather-sink-rope", "gather-sink", 0.05),
    gather_sink_moe => ("gather-sink-moe", "gather-sink", 0.1),
    gather_sink_norm_grad => ("gather-sink-norm-grad", "gather-sink", 0.05),
    gather_sink_param_grad => ("gather-sink-param-grad", "gather-sink", 0.05),
    scatter_hoist => ("scatter-hoist", "scatter-hoist", 0.3),
    ag_matmul => ("ag-matmul", "collective-matmul", 0.3),
    matmul_rs => ("matmul-rs", "collective-matmul", 0.3),
    fuse_elementwise => ("fuse-elementwise", "fuse-elementwise", 0.3),
    gemm_epilogue => ("gemm-epilogue", "fuse-elementwise", 0.3),
    add_rms_norm => ("add-rms-norm", "fuse-elementwise", 0.3),
    weight_update_sharding => ("weight-update-sharding", "weight-update-sharding", 0.3),
    tp_column => ("tp-column", "layout", 0.2),
    tp_row => ("tp-row", "layout", 0.2),
    slice_leaf => ("slice-leaf", "layout", 0.05),
    gather_sink_reshape_split => ("gather-sink-reshape-split", "layout", 0.1),
    gather_sink_rope_heads => ("gather-sink-rope-heads", "layout", 0.05),
    gather_sink_attention => ("gather-sink-attention", "layout", 0.05),
    reduce_sink_linear => ("reduce-sink-linear", "layout", 0.1),
    // Each group's rules together (they enable one another).
    group_sequence_parallel => ("sequence-parallel", "gather-sink", 0.5),
    group_collective_matmul => ("collective-matmul", "collective-matmul", 0.5),
    group_fuse_elementwise => ("fuse-elementwise", "fuse-elementwise", 0.5),
    group_layout => ("layout", "layout", 0.5),
}

/// Every rule the registry holds (test-only ones aside; `layout` ones, which `all` leaves
/// out, included) has a test above.
#[test]
fn every_rule_has_a_property_test() {
    let source = include_str!("rewrite_rules.rs");
    for r in shardc::compiler::rewrite::rules::list() {
        if r.test_only {
            continue;
        }
        let entry = format!("(\"{}\", ", r.name);
        assert!(source.contains(&entry), "no property test for {}", r.name);
    }
}

/// The whole rule set at once, on the same random programs.
#[test]
fn all_rules_together_are_sound() {
    let w = weights();
    let stats = Stats::default();
    let result = runner(128).run(&case(), |c| {
        check(&c, "all", &RuleSelection::All, &w, &stats)
    });
    if let Err(e) = result {
        panic!("all: {e}");
    }
    assert!(stats.fired.load(Ordering::Relaxed) > 64);
}

/// A rule without its side condition is caught by the same property.
#[test]
fn a_broken_rule_is_caught() {
    let w = weights();
    let stats = Stats::default();
    let rules = RuleSelection::Named(vec!["broken-gather-sink-norm".into()]);
    let result = runner(1024).run(&case(), |c| {
        check(&c, "broken-gather-sink-norm", &rules, &w, &stats)
    });
    let err = result.expect_err("the broken rule went unnoticed");
    assert!(err.to_string().contains("differs"), "{err}");
}
