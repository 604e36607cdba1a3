//! One sharding rule per op, in einsum-factor form (Shardy's `OpShardingRule`): each dim of
//! each operand and of the result names a factor; a factor sharded on an axis is sharded so in
//! every tensor that has it; a factor absent from the result (contracted) makes the result a
//! partial sum over its axes; `fixed` factors (reduced by a non-linear function, or needing the
//! whole extent, like attention's sequence) cannot be sharded.
//!
//! Example, `matmul (m,k),(k,n)->(m,n)`: `k` sharded on `tp` in both operands gives a result
//! partial over `tp` (Megatron's row-parallel layer).

use crate::ir::{CombineWrt, NormWrt, Op, TensorType};

/// Which operands may arrive as partial sums (the op is linear in them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartialRule {
    /// None may be partial.
    None,
    /// Every operand partial over the same axes (addition).
    AllSame,
    /// At most one of these operands may be partial (linear in each separately).
    OneOf(Vec<usize>),
}

/// The factor form of one op instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FactorRule {
    /// Factor of each dim of each operand (`None`: the dim must be replicated).
    pub operands: Vec<Vec<Option<usize>>>,
    /// Factor of each result dim.
    pub result: Vec<Option<usize>>,
    /// Number of factors.
    pub factors: usize,
    /// Factors that must stay unsharded.
    pub fixed: Vec<usize>,
    /// Operands that may be partial.
    pub partial: PartialRule,
    /// Operands in the order their shardings are preferred when they disagree (after the
    /// result's own annotation). Parameters come first where the op has one.
    pub priority: Vec<usize>,
}

struct B {
    n: usize,
}

impl B {
    fn fresh(&mut self, k: usize) -> Vec<Option<usize>> {
        let v = (self.n..self.n + k).map(Some).collect();
        self.n += k;
        v
    }
}

fn ident(ranks: &[usize], same: bool) -> FactorRule {
    // Elementwise over equal shapes (or suffix broadcast when `same` is false).
    let r = ranks[0];
    let mut b = B { n: 0 };
    let f = b.fresh(r);
    let operands = ranks.iter().map(|&k| f[r - k..].to_vec()).collect();
    let _ = same;
    FactorRule {
        operands,
        result: f,
        factors: b.n,
        fixed: vec![],
        partial: PartialRule::None,
        priority: (0..ranks.len()).collect(),
    }
}

/// Reshape factors: dims grouped into runs of equal element count on both sides; in each run
/// the major dims share a factor, the other dims are fixed.
fn reshape(inp: &[usize], out: &[usize]) -> FactorRule {
    let mut b = B { n: 0 };
    let mut fi = vec![None; inp.len()];
    let mut fo = vec![None; out.len()];
    let mut fixed = Vec::new();
    let (mut i, mut o) = (0, 0);
    while i < inp.len() || o < out.len() {
        // Size-1 dims on one side form their own fixed runs.
        if i < inp.len() && inp[i] == 1 && !(o < out.len() && out[o] == 1) {
            i += 1;
            continue;
        }
        if o < out.len() && out[o] == 1 && !(i < inp.len() && inp[i] == 1) {
            o += 1;
            continue;
        }
        if i >= inp.len() || o >= out.len() {
            break;
        }
        let (i0, o0) = (i, o);
        let (mut pi, mut po) = (inp[i], out[o]);
        i += 1;
        o += 1;
        while pi != po {
            if pi < po && i < inp.len() {
                pi *= inp[i];
                i += 1;
            } else if po < pi && o < out.len() {
                po *= out[o];
                o += 1;
            } else {
                break;
            }
        }
        let f = b.fresh(1)[0].expect("invariant: fresh factor");
        fi[i0] = Some(f);
        fo[o0] = Some(f);
        for f in fi.iter_mut().take(i).skip(i0 + 1) {
            let g = b.fresh(1)[0].expect("invariant");
            *f = Some(g);
            fixed.push(g);
        }
        for f in fo.iter_mut().take(o).skip(o0 + 1) {
            let g = b.fresh(1)[0].expect("invariant");
            *f = Some(g);
            fixed.push(g);
        }
    }
    FactorRule {
        operands: vec![fi],
        result: fo,
        factors: b.n,
        fixed,
        partial: PartialRule::OneOf(vec![0]),
        priority: vec![0],
    }
}

/// The factor rule of `op` with operand types `ins` and result type `out`. `None` for ops
/// that never appear in a logical graph (collectives, fused ops, the vocabulary-parallel
/// cross-entropy the partitioner lowers to).
pub fn rule(op: &Op, ins: &[&TensorType], out: &TensorType) -> Option<FactorRule> {
    let ranks: Vec<usize> = ins.iter().map(|t| t.rank()).collect();
    let mut b = B { n: 0 };
    Some(match op {
        Op::Input { .. } | Op::Param(_) | Op::SeqIndex { .. } => FactorRule {
            operands: vec![],
            result: b.fresh(out.rank()),
            factors: b.n,
            fixed: vec![],
            partial: PartialRule::None,
            priority: vec![],
        },
        Op::Unary(_) | Op::Softmax | Op::Router { .. } => {
            let mut r = ident(&ranks, true);
            if !matches!(op, Op::Unary(_)) {
                let last = r.result.last().copied().flatten();
                r.fixed.extend(last);
            }
            r
        }
        Op::Scale(_) | Op::Cast(_) => {
            let mut r = ident(&ranks, true);
            r.partial = PartialRule::OneOf(vec![0]);
            r
        }
        Op::RankOffset { .. } => ident(&ranks, true),
        Op::Add | Op::Mul => {
            let mut r = ident(&ranks, false);
            r.partial = if matches!(op, Op::Add) && ranks[0] == ranks[1] {
                PartialRule::AllSame
            } else if matches!(op, Op::Mul) {
                PartialRule::OneOf(vec![0, 1])
            } else {
                PartialRule::None
            };
            r
        }
        Op::RmsNorm { .. } | Op::LayerNorm { .. } => {
            let f = b.fresh(ranks[0]);
            let h = *f.last().expect("invariant: norm input has a last dim");
            let mut operands = vec![f.clone()];
            for _ in 1..ins.len() {
                operands.push(vec![h]);
            }
            FactorRule {
                operands,
                result: f,
                factors: b.n,
                fixed: vec![h.expect("invariant")],
                partial: PartialRule::None,
                priority: (0..ins.len()).collect(),
            }
        }
        Op::Rope(_) => {
            let f = b.fresh(4);
            FactorRule {
                operands: vec![f.clone(), f[..2].to_vec()],
                result: f.clone(),
                factors: b.n,
                fixed: vec![f[3].expect("invariant")],
                partial: PartialRule::None,
                priority: vec![0, 1],
            }
        }
        Op::Attention(spec) => {
            // q [b,t,h,d], k/v [b,s,h',d], mask [b,s], qidx [t], kidx [s]; heads of q and kv
            // share a factor. The queries' sequence splits only when the op reads their
            // indices (context parallelism); the keys' never does (they are gathered).
            let f = b.fresh(4); // b, t, h, d
            let s = b.fresh(1)[0];
            let kv = vec![f[0], s, f[2], f[3]];
            let mut operands = vec![f.clone(), kv.clone(), kv];
            let (mask, index) = spec.extra(&ins[3..]);
            if mask.is_some() {
                operands.push(vec![f[0], s]);
            }
            if index.is_some() {
                operands.extend([vec![f[1]], vec![s]]);
            }
            let mut fixed = vec![f[3].expect("invariant"), s.expect("invariant")];
            if !spec.indexed {
                fixed.push(f[1].expect("invariant"));
            }
            FactorRule {
                operands,
                result: f.clone(),
                factors: b.n,
                fixed,
                partial: PartialRule::None,
                priority: (0..ins.len()).collect(),
            }
        }
        Op::SeqPermute { dim, .. } => {
            let mut r = ident(&ranks, true);
            r.fixed.push(r.result[*dim].expect("invariant"));
            r.partial = PartialRule::OneOf(vec![0]);
            r
        }
        Op::Embedding => {
            // table [v, h], ids [..] -> [.., h]; v contracted (with ids made shard-local).
            let vh = b.fresh(2);
            let ids = b.fresh(ranks[1]);
            let mut result = ids.clone();
            result.push(vh[1]);
            FactorRule {
                operands: vec![vh, ids],
                result,
                factors: b.n,
                fixed: vec![],
                partial: PartialRule::None,
                priority: vec![0, 1],
            }
        }
        Op::MatMul { transpose_b } => {
            let a = b.fresh(ranks[0]);
            let k = a[ranks[0] - 1];
            let n = b.fresh(1)[0];
            let mut bb = if *transpose_b { vec![n, k] } else { vec![k, n] };
            if ranks[1] == 3 {
                bb.insert(0, a[0]);
            }
            let mut result = a.clone();
            *result.last_mut().expect("invariant") = n;
            FactorRule {
                operands: vec![a, bb],
                result,
                factors: b.n,
                fixed: vec![],
                partial: PartialRule::OneOf(vec![0, 1]),
                priority: vec![1, 0],
            }
        }
        Op::Reshape => reshape(&ins[0].shape(), &out.shape()),
        Op::Transpose { perm } => {
            let f = b.fresh(ranks[0]);
            FactorRule {
                operands: vec![f.clone()],
                result: perm.iter().map(|&p| f[p]).collect(),
                factors: b.n,
                fixed: vec![],
                partial: PartialRule::OneOf(vec![0]),
                priority: vec![0],
            }
        }
        Op::Slice { dim, .. } | Op::Concat { dim } => {
            let mut r = ident(&ranks, true);
            r.fixed.push(r.result[*dim].expect("invariant"));
            r.partial = if matches!(op, Op::Slice { .. }) {
                PartialRule::OneOf(vec![0])
            } else {
                PartialRule::AllSame
            };
            r
        }
        Op::Repeat { .. } => {
            let mut r = ident(&ranks, true);
            r.partial = PartialRule::OneOf(vec![0]);
            r
        }
        Op::Dispatch => {
            // x [b,t,h], gates [b,t,e] -> [e,b,t,h]
            let f = b.fresh(4); // b t h e
            FactorRule {
                operands: vec![f[..3].to_vec(), vec![f[0], f[1], f[3]]],
                result: vec![f[3], f[0], f[1], f[2]],
                factors: b.n,
                fixed: vec![],
                partial: PartialRule::OneOf(vec![0]),
                priority: vec![1, 0],
            }
        }
        Op::Combine => {
            // y [e,b,t,h], gates [b,t,e] -> [b,t,h]; e contracted.
            let f = b.fresh(4); // e b t h
            FactorRule {
                operands: vec![f.clone(), vec![f[1], f[2], f[0]]],
                result: f[1..].to_vec(),
                factors: b.n,
                fixed: vec![],
                partial: PartialRule::OneOf(vec![0]),
                priority: vec![1, 0],
            }
        }
        Op::CrossEntropy { .. } => {
            // logits [.., v], labels [..] -> []: the leading dims are summed over.
            let lead = b.fresh(ranks[1]);
            let v = b.fresh(1)[0];
            let mut l = lead.clone();
            l.push(v);
            FactorRule {
                operands: vec![l, lead],
                result: vec![],
                factors: b.n,
                fixed: vec![v.expect("invariant")],
                partial: PartialRule::None,
                priority: vec![0, 1],
            }
        }
        Op::AllReduce { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGather { .. }
        | Op::AllToAll { .. }
        | Op::Broadcast { .. }
        | Op::LocalSlice { .. }
        | Op::CrossEntropyStats { .. }
        | Op::CrossEntropyFromStats { .. }
        | Op::CrossEntropyShardGrad { .. }
        | Op::FusedElementwise { .. }
        | Op::FusedMatMul { .. }
        | Op::AddRmsNorm { .. }
        | Op::AgMatMul { .. }
        | Op::MatMulRs { .. }
        | Op::RingAttention { .. }
        | Op::RingAttentionGrad { .. } => return None,
        crate::training_ops!() => train_rule(op, &ranks),
    })
}

/// Rules of the training ops. A gradient has the factors of the operand it differentiates;
/// factors of the forward op that it sums over are contracted (so a weight gradient of a
/// batch-split activation is a partial sum over the data axes), and the forward op's fixed
/// factors stay fixed. Parameter-gradient ops read the parameter first, so the gradient is
/// laid out like the parameter.
fn train_rule(op: &Op, ranks: &[usize]) -> FactorRule {
    let mut b = B { n: 0 };
    let f = |i: Option<usize>| i.expect("invariant: fresh factor");
    let mk = |operands: Vec<Vec<Option<usize>>>,
              result: Vec<Option<usize>>,
              n: usize,
              fixed: Vec<usize>,
              partial: PartialRule,
              priority: Vec<usize>| FactorRule {
        operands,
        result,
        factors: n,
        fixed,
        partial,
        priority,
    };
    match op {
        // Elementwise over equal shapes.
        Op::UnaryGrad(_) | Op::AdamMoment { .. } => ident(ranks, true),
        Op::RepeatGrad { .. } => {
            let mut r = ident(ranks, true);
            r.partial = PartialRule::OneOf(vec![0]);
            r
        }
        Op::RouterGrad { .. } => {
            let mut r = ident(ranks, true);
            r.fixed.extend(r.result.last().copied().flatten());
            r
        }
        Op::AdamWUpdate(_) => {
            // (w, m, v, step[]): elementwise over w, m, v; the step is a scalar.
            let x = b.fresh(ranks[0]);
            let ops = vec![x.clone(), x.clone(), x.clone(), vec![]];
            mk(ops, x, b.n, vec![], PartialRule::None, vec![0, 1, 2, 3])
        }
        Op::BiasGrad => {
            // (dy[.., n], bias[n]) -> [n]: the leading dims are summed.
            let x = b.fresh(ranks[0]);
            let n = *x.last().expect("invariant: dy has a last dim");
            let ops = vec![x, vec![n]];
            mk(
                ops,
                vec![n],
                b.n,
                vec![],
                PartialRule::OneOf(vec![0]),
                vec![1, 0],
            )
        }
        Op::WeightGrad { transpose_b } => {
            // (a[.., m, k], dy[.., m, n], w) -> w: (k, n) or (n, k), batched (e, ..).
            let a = b.fresh(ranks[0]);
            let k = a[ranks[0] - 1];
            let n = b.fresh(1)[0];
            let mut dy = a.clone();
            *dy.last_mut().expect("invariant: rank >= 2") = n;
            let mut w = if *transpose_b { vec![n, k] } else { vec![k, n] };
            if ranks[2] == 3 {
                w.insert(0, a[0]);
            }
            let ops = vec![a, dy, w.clone()];
            mk(ops, w, b.n, vec![], PartialRule::None, vec![2, 1, 0])
        }
        Op::RmsNormGrad { wrt, .. } | Op::LayerNormGrad { wrt, .. } => {
            // (x, w[h], dy) -> dx (x's factors) or dw ([h], leading dims summed).
            let x = b.fresh(ranks[0]);
            let h = *x.last().expect("invariant: norm input has a last dim");
            let result = match wrt {
                NormWrt::X => x.clone(),
                NormWrt::Weight => vec![h],
            };
            let ops = vec![x.clone(), vec![h], x];
            mk(
                ops,
                result,
                b.n,
                vec![f(h)],
                PartialRule::None,
                vec![1, 0, 2],
            )
        }
        Op::RopeGrad(_) => {
            let x = b.fresh(4);
            let ops = vec![x.clone(), x[..2].to_vec()];
            let fixed = vec![f(x[3])];
            mk(ops, x, b.n, fixed, PartialRule::OneOf(vec![0]), vec![0, 1])
        }
        Op::AttentionProbs(spec) | Op::AttentionGrad { spec, .. } => {
            // q [b,t,h,d], k/v [b,s,h',d], dy [b,t,h,d], mask [b,s], probs [b,h,t,s],
            // qidx [t], kidx [s]. Queries split like the forward op's (context parallelism).
            let q = b.fresh(4);
            let s = b.fresh(1)[0];
            let kv = vec![q[0], s, q[2], q[3]];
            let probs = vec![q[0], q[2], q[1], s];
            let mut fixed = vec![f(q[3]), f(s)];
            if !spec.indexed {
                fixed.push(f(q[1]));
            }
            match op {
                Op::AttentionGrad { wrt, .. } => {
                    let ops = vec![q.clone(), kv.clone(), kv, q, probs];
                    let result = ops[wrt.operand()].clone();
                    mk(
                        ops,
                        result,
                        b.n,
                        fixed,
                        PartialRule::None,
                        vec![0, 1, 2, 3, 4],
                    )
                }
                _ => {
                    let mut ops = vec![q.clone(), kv];
                    let rest: Vec<usize> = (2..ranks.len()).collect();
                    let (mask, index) = spec.extra(&rest);
                    if mask.is_some() {
                        ops.push(vec![probs[0], s]);
                    }
                    if index.is_some() {
                        ops.extend([vec![q[1]], vec![s]]);
                    }
                    let prio = (0..ranks.len()).collect();
                    mk(ops, probs, b.n, fixed, PartialRule::None, prio)
                }
            }
        }
        Op::EmbeddingGrad => {
            // (ids[..], dy[.., h], table[v, h]) -> [v, h]: the ids' dims are summed.
            let ids = b.fresh(ranks[0]);
            let vh = b.fresh(2);
            let mut dy = ids.clone();
            dy.push(vh[1]);
            let ops = vec![ids, dy, vh.clone()];
            mk(
                ops,
                vh,
                b.n,
                vec![],
                PartialRule::OneOf(vec![1]),
                vec![2, 1, 0],
            )
        }
        Op::DispatchGrad => {
            // (dxe [e,b,t,h], gates [b,t,e]) -> [b,t,h]; e summed.
            let x = b.fresh(4);
            let ops = vec![x.clone(), vec![x[1], x[2], x[0]]];
            let r = x[1..].to_vec();
            mk(ops, r, b.n, vec![], PartialRule::OneOf(vec![0]), vec![1, 0])
        }
        Op::CombineGrad { wrt } => {
            // (y [e,b,t,h], gates [b,t,e], dy [b,t,h]) -> dy_e [e,b,t,h] | dgates [b,t,e].
            let y = b.fresh(4);
            let g = vec![y[1], y[2], y[0]];
            let result = match wrt {
                CombineWrt::Y => y.clone(),
                CombineWrt::Gates => g.clone(),
            };
            let ops = vec![y.clone(), g, y[1..].to_vec()];
            mk(ops, result, b.n, vec![], PartialRule::None, vec![1, 0, 2])
        }
        Op::CrossEntropyGrad { .. } => {
            // (logits [.., v], labels [..]) -> [.., v]; v whole (softmax over it).
            let lead = b.fresh(ranks[1]);
            let v = b.fresh(1)[0];
            let mut l = lead.clone();
            l.push(v);
            mk(
                vec![l.clone(), lead],
                l,
                b.n,
                vec![f(v)],
                PartialRule::None,
                vec![0, 1],
            )
        }
        _ => unreachable!("invariant: train_rule is called for training ops only"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;

    fn t(shape: &[usize]) -> TensorType {
        TensorType::plain(DType::F32, shape)
    }

    #[test]
    fn matmul_contracts_k() {
        let r = rule(
            &Op::MatMul { transpose_b: true },
            &[&t(&[2, 3, 4]), &t(&[5, 4])],
            &t(&[2, 3, 5]),
        )
        .unwrap();
        let k = r.operands[0][2];
        assert_eq!(r.operands[1], vec![r.result[2], k]);
        assert!(!r.result.contains(&k));
    }

    #[test]
    fn reshape_maps_major_dims() {
        let r = reshape(&[2, 3, 12], &[2, 3, 4, 3]);
        assert_eq!(r.operands[0][2], r.result[2]);
        assert!(r.fixed.contains(&r.result[3].unwrap()));
        let r = reshape(&[2, 3, 4, 3], &[2, 3, 12]);
        assert_eq!(r.operands[0][2], r.result[2]);
        assert!(r.fixed.contains(&r.operands[0][3].unwrap()));
    }

    #[test]
    fn attention_ties_heads() {
        let q = t(&[1, 8, 4, 2]);
        let k = t(&[1, 8, 2, 2]);
        let m = t(&[1, 8]);
        let r = rule(
            &Op::Attention(crate::ir::AttnSpec {
                causal: true,
                window: None,
                scale: crate::ir::Float(1.0),
                indexed: false,
            }),
            &[&q, &k, &k, &m],
            &q,
        )
        .unwrap();
        assert_eq!(r.operands[0][2], r.operands[1][2]);
        assert!(r.fixed.contains(&r.operands[1][1].unwrap()));
    }
}
