//! Vector-Jacobian products: one rule per forward op, and how the backward pass reads
//! forward values (saved, recomputed, or re-gathered parameters).
//!
//! | forward | gradients |
//! | --- | --- |
//! | `MatMul{tb}(a, b)` | `da = MatMul{!tb}(dy, b)`, `db = WeightGrad{tb}(a, dy, b)` |
//! | `Add(a, b)` | `dy` to both; a broadcast bias `b[N]`: `BiasGrad(dy, b)` |
//! | `Mul(a, b)` | `Mul(dy, b)`, `Mul(dy, a)` |
//! | `Unary(f)(x)`, `Scale(c)(x)`, `Cast(x)` | `UnaryGrad(f)(x, dy)`, `Scale(c)(dy)`, `Cast(dy)` |
//! | `RmsNorm`, `LayerNorm` | `…NormGrad{wrt: x\|weight}(x, w, dy)`, bias `BiasGrad` |
//! | `Rope(x, pos)` | `RopeGrad(dy, pos)` |
//! | `Attention(q, k, v, mask)` | `AttentionGrad{wrt}(q, k, v, dy, probs)` |
//! | `Embedding(table, ids)` | `EmbeddingGrad(ids, dy, table)` |
//! | `Reshape`, `Transpose`, `Repeat` | `Reshape(dy)`, the inverse `Transpose`, `RepeatGrad` |
//! | `Router(l)`, `Dispatch(x, g)`, `Combine(y, g)` | `RouterGrad`, `DispatchGrad` (no gate gradient: routing is piecewise constant), `CombineGrad{wrt: y\|gates}` |
//!
//! Forward activations are read through one `saved.<name>` node each (an identity
//! `Reshape`): the activation memory of the step is exactly what these nodes read, and a
//! value the forward pass all-gathered (sequence parallelism) is saved sharded and gathered
//! again by the backward. With full recomputation, a layer's own values are recomputed
//! (`recompute.<name>`) from the saved layer input instead.

use super::builder::Builder;
use super::{AutodiffError, Recompute};
use crate::ir::{AttnWrt, CombineWrt, DType, NormWrt, Op, ValueId, ValueRole};

impl Builder<'_> {
    /// Where `d` (a gradient wrt forward operand `u`) goes: a parameter's contributions, an
    /// activation's cotangents, or nowhere (inputs and integer values).
    fn contribute(&mut self, u: ValueId, d: ValueId) {
        let node = self.fwd.node(u);
        if let Some(p) = self.param_of[u.index()] {
            self.pgrads[p].push(d);
        } else if (!matches!(node.op, Op::Input { .. }) || self.diff_input == Some(u))
            && node.ty.dtype != DType::I32
        {
            self.ct[u.index()].push(d);
        }
    }

    /// True when forward operand `u` can receive a gradient.
    fn differentiable(&self, u: ValueId) -> bool {
        let node = self.fwd.node(u);
        (!matches!(node.op, Op::Input { .. }) || self.diff_input == Some(u))
            && node.ty.dtype != DType::I32
    }

    /// The `saved.*` node of train value `x` (created on first use, in the current layer).
    pub(super) fn saved_node(&mut self, x: ValueId) -> Result<ValueId, AutodiffError> {
        if let Some(&s) = self.saved.get(&x) {
            return Ok(s);
        }
        let node = self.g.node(x);
        let name = match node.name.strip_prefix(self.prefix.as_str()) {
            Some(rest) => format!("{}saved.{rest}", self.prefix),
            None => format!("saved.{}", node.name),
        };
        let ty = node.ty.clone();
        let s = self.add_as(
            ValueRole::Saved,
            Op::Reshape,
            &[x],
            Some(ty),
            name,
            self.cur_layer,
        )?;
        self.saved.insert(x, s);
        Ok(s)
    }

    /// Forward value `u` as the backward pass reads it: inputs directly, parameters through
    /// their backward use, a value of the current layer recomputed (full recomputation),
    /// anything else through its saved node.
    pub(super) fn saved_fwd(&mut self, u: ValueId) -> Result<ValueId, AutodiffError> {
        let node = self.fwd.node(u);
        if let Some(p) = self.param_of[u.index()] {
            return self.param_use(p, true);
        }
        if matches!(node.op, Op::Input { .. }) {
            return Ok(self.map[u.index()].expect("invariant: inputs are mapped"));
        }
        let full =
            |l: u32| self.opts.recompute == Recompute::Full || self.opts.full_layers.contains(&l);
        if node.layer.is_some_and(full) && node.layer == self.cur_layer {
            return self.recompute(u);
        }
        let x = self.map[u.index()].expect("invariant: forward values are mapped");
        self.saved_node(x)
    }

    /// Recomputes forward value `u` of the current layer in the backward pass.
    fn recompute(&mut self, u: ValueId) -> Result<ValueId, AutodiffError> {
        if let Some(&x) = self.recomputed.get(&u) {
            return Ok(x);
        }
        let node = self.fwd.node(u);
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &i in &node.inputs {
            let ni = self.fwd.node(i);
            let x = if self.param_of[i.index()].is_some() || matches!(ni.op, Op::Input { .. }) {
                self.saved_fwd(i)?
            } else if ni.layer == node.layer {
                self.recompute(i)?
            } else {
                // The layer's input: a checkpoint.
                let x = self.map[i.index()].expect("invariant: forward values are mapped");
                self.saved_node(x)?
            };
            inputs.push(x);
        }
        let declared = node.op.needs_declared_type().then(|| node.ty.clone());
        let name = format!("{}recompute.{}", self.prefix, node.name);
        let op = node.op.clone();
        let x = self.add_as(
            ValueRole::Recompute,
            op,
            &inputs,
            declared,
            name,
            node.layer,
        )?;
        self.recomputed.insert(u, x);
        Ok(x)
    }

    fn no_grad(&self, v: ValueId, detail: &str) -> AutodiffError {
        let node = self.fwd.node(v);
        AutodiffError::NoGradient {
            op: node.op.mnemonic(),
            node: node.name.clone(),
            detail: detail.to_string(),
        }
    }

    /// Emits the gradients of forward node `v`'s operands given `dy`, its gradient.
    pub(super) fn vjp(&mut self, v: ValueId, dy: ValueId) -> Result<(), AutodiffError> {
        let fwd = self.fwd;
        let node = fwd.node(v);
        let x = node.inputs.clone();
        let layer = node.layer;
        let base = format!("{}bwd.{}", self.prefix, node.name);
        let n = |s: &str| format!("{base}.{s}");
        match &node.op {
            Op::MatMul { transpose_b } => {
                let (a, b) = (x[0], x[1]);
                let bv = self.saved_fwd(b)?;
                if self.differentiable(a) {
                    let tb = !*transpose_b;
                    let da = self.add(
                        Op::MatMul { transpose_b: tb },
                        &[dy, bv],
                        None,
                        n("da"),
                        layer,
                    )?;
                    self.contribute(a, da);
                }
                if self.differentiable(b) {
                    let av = self.saved_fwd(a)?;
                    let op = Op::WeightGrad {
                        transpose_b: *transpose_b,
                    };
                    let db = self.add(op, &[av, dy, bv], None, n("db"), layer)?;
                    self.contribute(b, db);
                }
            }
            Op::Add => {
                let (a, b) = (x[0], x[1]);
                let (ta, tb) = (fwd.ty(a), fwd.ty(b));
                self.contribute(a, dy);
                if ta.same_shape(tb) {
                    self.contribute(b, dy);
                } else if tb.rank() == 1 {
                    if self.differentiable(b) {
                        let bv = self.saved_fwd(b)?;
                        let db = self.add(Op::BiasGrad, &[dy, bv], None, n("dbias"), layer)?;
                        self.contribute(b, db);
                    }
                } else {
                    return Err(self.no_grad(v, "broadcast of an operand of rank > 1"));
                }
            }
            Op::Mul => {
                let (a, b) = (x[0], x[1]);
                if !fwd.ty(a).same_shape(fwd.ty(b)) {
                    return Err(self.no_grad(v, "broadcast product"));
                }
                let (av, bv) = (self.saved_fwd(a)?, self.saved_fwd(b)?);
                if self.differentiable(a) {
                    let da = self.add(Op::Mul, &[dy, bv], None, n("da"), layer)?;
                    self.contribute(a, da);
                }
                if self.differentiable(b) {
                    let db = self.add(Op::Mul, &[dy, av], None, n("db"), layer)?;
                    self.contribute(b, db);
                }
            }
            Op::Unary(u) => {
                let xv = self.saved_fwd(x[0])?;
                let d = self.add(Op::UnaryGrad(*u), &[xv, dy], None, n("dx"), layer)?;
                self.contribute(x[0], d);
            }
            Op::Scale(c) => {
                let d = self.add(Op::Scale(*c), &[dy], None, n("dx"), layer)?;
                self.contribute(x[0], d);
            }
            Op::Cast(_) => {
                let dt = fwd.ty(x[0]).dtype;
                let d = self.add(Op::Cast(dt), &[dy], None, n("dx"), layer)?;
                self.contribute(x[0], d);
            }
            Op::RmsNorm { eps } | Op::LayerNorm { eps } => {
                let rms = matches!(node.op, Op::RmsNorm { .. });
                let xv = self.saved_fwd(x[0])?;
                let wv = self.saved_fwd(x[1])?;
                for (wrt, operand, s) in [(NormWrt::X, x[0], "dx"), (NormWrt::Weight, x[1], "dw")] {
                    if !self.differentiable(operand) {
                        continue;
                    }
                    let op = if rms {
                        Op::RmsNormGrad { eps: *eps, wrt }
                    } else {
                        Op::LayerNormGrad { eps: *eps, wrt }
                    };
                    let d = self.add(op, &[xv, wv, dy], None, n(s), layer)?;
                    self.contribute(operand, d);
                }
                if !rms && self.differentiable(x[2]) {
                    let bv = self.saved_fwd(x[2])?;
                    let db = self.add(Op::BiasGrad, &[dy, bv], None, n("dbias"), layer)?;
                    self.contribute(x[2], db);
                }
            }
            Op::Rope(spec) => {
                let pos = self.saved_fwd(x[1])?;
                let d = self.add(Op::RopeGrad(*spec), &[dy, pos], None, n("dx"), layer)?;
                self.contribute(x[0], d);
            }
            Op::Attention(spec) => {
                let (q, k, vv) = (
                    self.saved_fwd(x[0])?,
                    self.saved_fwd(x[1])?,
                    self.saved_fwd(x[2])?,
                );
                let probs = match self.probs.get(&v).copied() {
                    Some(p) => self.saved_node(p)?,
                    None => {
                        let mut qk = vec![q, k];
                        for &m in x.iter().skip(3) {
                            qk.push(self.saved_fwd(m)?);
                        }
                        let name = format!("{}recompute.{}.probs", self.prefix, node.name);
                        let op = Op::AttentionProbs(*spec);
                        self.add_as(ValueRole::Recompute, op, &qk, None, name, layer)?
                    }
                };
                for (wrt, s) in [(AttnWrt::Q, "dq"), (AttnWrt::K, "dk"), (AttnWrt::V, "dv")] {
                    let operand = x[wrt.operand()];
                    if !self.differentiable(operand) {
                        continue;
                    }
                    let op = Op::AttentionGrad { spec: *spec, wrt };
                    let d = self.add(op, &[q, k, vv, dy, probs], None, n(s), layer)?;
                    self.contribute(operand, d);
                }
            }
            Op::Embedding => {
                let (table, ids) = (x[0], x[1]);
                if self.differentiable(table) {
                    let idv = self.saved_fwd(ids)?;
                    let tv = self.saved_fwd(table)?;
                    let d =
                        self.add(Op::EmbeddingGrad, &[idv, dy, tv], None, n("dtable"), layer)?;
                    self.contribute(table, d);
                }
            }
            Op::Reshape => {
                let ty = fwd.ty(x[0]).clone();
                let d = self.add(Op::Reshape, &[dy], Some(ty), n("dx"), layer)?;
                self.contribute(x[0], d);
            }
            Op::Transpose { perm } => {
                let mut inv = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                let d = self.add(Op::Transpose { perm: inv }, &[dy], None, n("dx"), layer)?;
                self.contribute(x[0], d);
            }
            Op::SeqPermute {
                dim,
                order,
                inverse,
            } => {
                let op = Op::SeqPermute {
                    dim: *dim,
                    order: *order,
                    inverse: !inverse,
                };
                let d = self.add(op, &[dy], None, n("dx"), layer)?;
                self.contribute(x[0], d);
            }
            Op::Repeat { dim, times } => {
                let op = Op::RepeatGrad {
                    dim: *dim,
                    times: *times,
                };
                let d = self.add(op, &[dy], None, n("dx"), layer)?;
                self.contribute(x[0], d);
            }
            Op::Router { top_k, normalize } => {
                let lv = self.saved_fwd(x[0])?;
                let op = Op::RouterGrad {
                    top_k: *top_k,
                    normalize: *normalize,
                };
                let d = self.add(op, &[lv, dy], None, n("dlogits"), layer)?;
                self.contribute(x[0], d);
            }
            Op::Dispatch => {
                let gv = self.saved_fwd(x[1])?;
                let d = self.add(Op::DispatchGrad, &[dy, gv], None, n("dx"), layer)?;
                self.contribute(x[0], d);
            }
            Op::Combine => {
                let (yv, gv) = (self.saved_fwd(x[0])?, self.saved_fwd(x[1])?);
                for (wrt, operand, s) in [
                    (CombineWrt::Y, x[0], "dy"),
                    (CombineWrt::Gates, x[1], "dgates"),
                ] {
                    let d = self.add(Op::CombineGrad { wrt }, &[yv, gv, dy], None, n(s), layer)?;
                    self.contribute(operand, d);
                }
            }
            _ => return Err(self.no_grad(v, "this op has no gradient rule")),
        }
        Ok(())
    }
}
