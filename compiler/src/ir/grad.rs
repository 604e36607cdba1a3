//! The training ops: vector-Jacobian products of the forward ops (`…Grad`, plus
//! `AttentionProbs`, the saved or recomputed softmax of attention) and the AdamW optimizer
//! step. Their attribute types and type rules live here; [`Op`] lists them and documents
//! each op's semantics, and `shardc-runtime`'s CPU kernels define them.
//!
//! Every `…Grad` op computes the gradient of one operand of its forward op from the upstream
//! gradient `dy` (the loss's gradient wrt the forward op's result). Operands a gradient does
//! not read numerically (a parameter that only fixes the result's shape and layout) are still
//! passed, so the sharding rule can lay the gradient out like the parameter.

use super::{DType, Float, IrError, Op, TensorType, CROSS_ENTROPY_STATS};
use serde::{Deserialize, Serialize};

/// Which operand of a norm a gradient is taken with respect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormWrt {
    /// The normalised input `x`.
    X,
    /// The scale `w`.
    Weight,
}

/// Which operand of attention a gradient is taken with respect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnWrt {
    /// Queries.
    Q,
    /// Keys.
    K,
    /// Values.
    V,
}

/// Which operand of `Combine` a gradient is taken with respect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CombineWrt {
    /// The expert outputs `y`.
    Y,
    /// The gates.
    Gates,
}

text_names!(NormWrt { X => "x", Weight => "weight" });

text_names!(AttnWrt { Q => "q", K => "k", V => "v" });

impl AttnWrt {
    /// The index of the differentiated operand in `(q, k, v, ..)`.
    pub fn operand(self) -> usize {
        self as usize
    }
}

text_names!(CombineWrt { Y => "y", Gates => "gates" });

/// AdamW hyperparameters (PyTorch's `torch.optim.AdamW`: decoupled weight decay, bias
/// correction; weight decay applied to every parameter it updates).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AdamWSpec {
    /// Learning rate.
    pub lr: Float,
    /// First-moment decay β₁.
    pub beta1: Float,
    /// Second-moment decay β₂.
    pub beta2: Float,
    /// ε added to the bias-corrected √v.
    pub eps: Float,
    /// Decoupled weight decay λ (the parameter is scaled by 1 − lr·λ).
    pub weight_decay: Float,
}

impl Default for AdamWSpec {
    /// lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1.
    fn default() -> AdamWSpec {
        AdamWSpec {
            lr: Float(1e-3),
            beta1: Float(0.9),
            beta2: Float(0.95),
            eps: Float(1e-8),
            weight_decay: Float(0.1),
        }
    }
}

/// An AdamW hyperparameter outside its domain: `name` is the [`AdamWSpec`] field (`lr`,
/// `beta1`, `beta2`, `eps`, `weight_decay`).
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
#[error("{name}: must be {requirement} (found {found})")]
pub struct AdamWError {
    /// The field.
    pub name: &'static str,
    /// Its domain, in words (`finite and > 0`, `in [0, 1)`).
    pub requirement: &'static str,
    /// The value given.
    pub found: f32,
}

impl AdamWSpec {
    /// Checks every hyperparameter against its domain, in field order: `lr` and `eps` finite
    /// and > 0, `beta1` and `beta2` in [0, 1), `weight_decay` finite and ≥ 0. Outside them
    /// the step divides by zero or diverges (NaN weights after the first update).
    pub fn validate(&self) -> Result<(), AdamWError> {
        let positive = |x: f32| x.is_finite() && x > 0.0;
        let checks: [(&'static str, f32, &'static str, bool); 5] = [
            ("lr", self.lr.0, "finite and > 0", positive(self.lr.0)),
            (
                "beta1",
                self.beta1.0,
                "in [0, 1)",
                (0.0..1.0).contains(&self.beta1.0),
            ),
            (
                "beta2",
                self.beta2.0,
                "in [0, 1)",
                (0.0..1.0).contains(&self.beta2.0),
            ),
            ("eps", self.eps.0, "finite and > 0", positive(self.eps.0)),
            (
                "weight_decay",
                self.weight_decay.0,
                "finite and >= 0",
                self.weight_decay.0.is_finite() && self.weight_decay.0 >= 0.0,
            ),
        ];
        match checks.into_iter().find(|c| !c.3) {
            Some((name, found, requirement, _)) => Err(AdamWError {
                name,
                requirement,
                found,
            }),
            None => Ok(()),
        }
    }
}

fn err(op: &'static str, detail: String) -> IrError {
    IrError::Shape { op, detail }
}

/// Checks gathered cross-entropy stats against the labels: `stats[.., 3·P]` f32 with P ≥ 1
/// and the labels' leading dims.
pub(super) fn check_stats(
    op: &'static str,
    stats: &TensorType,
    labels: &TensorType,
) -> Result<(), IrError> {
    let ok = stats.dtype == DType::F32
        && stats.rank() == labels.rank() + 1
        && stats.shape()[..labels.rank()] == labels.shape()[..]
        && stats.last() > 0
        && stats.last() % CROSS_ENTROPY_STATS == 0;
    if ok {
        Ok(())
    } else {
        Err(err(
            op,
            format!(
                "stats {stats} must be f32 [.., {CROSS_ENTROPY_STATS}·shards] over labels {labels}"
            ),
        ))
    }
}

fn arity(
    op: &'static str,
    inputs: &[&TensorType],
    n: usize,
    e: &'static str,
) -> Result<(), IrError> {
    if inputs.len() == n {
        Ok(())
    } else {
        Err(IrError::Arity {
            op,
            expected: e,
            found: inputs.len(),
        })
    }
}

fn same(op: &'static str, a: &TensorType, b: &TensorType, what: &str) -> Result<(), IrError> {
    if a.same_shape(b) && a.dtype == b.dtype {
        Ok(())
    } else {
        Err(err(op, format!("{what}: {a} and {b} differ")))
    }
}

fn want_i32(op: &'static str, t: &TensorType, operand: usize) -> Result<(), IrError> {
    if t.dtype == DType::I32 {
        Ok(())
    } else {
        Err(IrError::DType {
            op,
            operand,
            expected: DType::I32,
            found: t.dtype,
        })
    }
}

/// The result type of a training op (`None` for every other op).
pub(super) fn infer(op: &Op, inputs: &[&TensorType]) -> Option<Result<TensorType, IrError>> {
    let m = op.mnemonic();
    let r = match op {
        Op::UnaryGrad(_) => arity(m, inputs, 2, "2")
            .and_then(|_| same(m, inputs[0], inputs[1], "x and dy"))
            .map(|_| inputs[0].clone()),
        Op::BiasGrad => arity(m, inputs, 2, "2").and_then(|_| {
            let (dy, b) = (inputs[0], inputs[1]);
            if b.rank() != 1 || dy.rank() < 1 || dy.last() != b.dim(0) || dy.dtype != b.dtype {
                return Err(err(
                    m,
                    format!("bias {b} does not match the last dim of {dy}"),
                ));
            }
            Ok(b.clone())
        }),
        Op::WeightGrad { transpose_b } => arity(m, inputs, 3, "3").and_then(|_| {
            let (a, dy, b) = (inputs[0], inputs[1], inputs[2]);
            // The forward product a·b must have dy's type.
            let y = Op::MatMul {
                transpose_b: *transpose_b,
            }
            .infer(&[a, b], None)
            .map_err(|e| err(m, e.to_string()))?;
            same(m, &y, dy, "a·b and dy")?;
            Ok(b.clone())
        }),
        Op::RmsNormGrad { wrt, .. } | Op::LayerNormGrad { wrt, .. } => arity(m, inputs, 3, "3")
            .and_then(|_| {
                let (x, w, dy) = (inputs[0], inputs[1], inputs[2]);
                same(m, x, dy, "x and dy")?;
                if w.rank() != 1 || x.rank() < 1 || w.dim(0) != x.last() {
                    return Err(err(
                        m,
                        format!("weight {w} does not match the last dim of {x}"),
                    ));
                }
                Ok(match wrt {
                    NormWrt::X => x.clone(),
                    NormWrt::Weight => w.clone(),
                })
            }),
        Op::RopeGrad(spec) => Op::Rope(*spec)
            .infer(inputs, None)
            .map_err(|e| err(m, e.to_string())),
        Op::AttentionProbs(spec) => {
            let idx = if spec.indexed { 2 } else { 0 };
            if inputs.len() != 2 + idx && inputs.len() != 3 + idx {
                return Some(Err(IrError::Arity {
                    op: m,
                    expected: if spec.indexed { "4 or 5" } else { "2 or 3" },
                    found: inputs.len(),
                }));
            }
            let (q, k) = (inputs[0], inputs[1]);
            let mut fwd = vec![q, k, k];
            fwd.extend(inputs.iter().skip(2).copied());
            Op::Attention(*spec)
                .infer(&fwd, None)
                .map_err(|e| err(m, e.to_string()))
                .map(|_| TensorType::new(q.dtype, vec![q.dims[0], q.dims[2], q.dims[1], k.dims[1]]))
        }
        Op::AttentionGrad { spec, wrt } => arity(m, inputs, 5, "5").and_then(|_| {
            let (q, k, v, dy, p) = (inputs[0], inputs[1], inputs[2], inputs[3], inputs[4]);
            // The probabilities hold the masks and indices: the shapes are q's, k's and v's.
            let plain = super::AttnSpec {
                indexed: false,
                ..*spec
            };
            Op::Attention(plain)
                .infer(&[q, k, v], None)
                .map_err(|e| err(m, e.to_string()))?;
            same(m, q, dy, "q and dy")?;
            let want = [q.dim(0), q.dim(2), q.dim(1), k.dim(1)];
            if p.shape() != want {
                return Err(err(
                    m,
                    format!("probs {p} must be [B, Hq, T, S] = {want:?}"),
                ));
            }
            Ok(inputs[wrt.operand()].clone())
        }),
        Op::EmbeddingGrad => arity(m, inputs, 3, "3").and_then(|_| {
            let (ids, dy, table) = (inputs[0], inputs[1], inputs[2]);
            want_i32(m, ids, 0)?;
            let ok = table.rank() == 2
                && dy.rank() == ids.rank() + 1
                && dy.shape()[..ids.rank()] == ids.shape()[..]
                && dy.last() == table.dim(1)
                && dy.dtype == table.dtype;
            if !ok {
                return Err(err(
                    m,
                    format!("expects ids[..], dy[.., H], table[V, H]: {ids}, {dy}, {table}"),
                ));
            }
            Ok(table.clone())
        }),
        Op::RouterGrad { top_k, normalize } => arity(m, inputs, 2, "2").and_then(|_| {
            same(m, inputs[0], inputs[1], "logits and dgates")?;
            Op::Router {
                top_k: *top_k,
                normalize: *normalize,
            }
            .infer(&inputs[..1], None)
            .map_err(|e| err(m, e.to_string()))
        }),
        Op::DispatchGrad => arity(m, inputs, 2, "2").and_then(|_| {
            Op::Combine
                .infer(inputs, None)
                .map_err(|e| err(m, e.to_string()))
        }),
        Op::CombineGrad { wrt } => arity(m, inputs, 3, "3").and_then(|_| {
            let (y, g, dy) = (inputs[0], inputs[1], inputs[2]);
            let out = Op::Combine
                .infer(&[y, g], None)
                .map_err(|e| err(m, e.to_string()))?;
            same(m, &out, dy, "combined result and dy")?;
            Ok(match wrt {
                CombineWrt::Y => y.clone(),
                CombineWrt::Gates => g.clone(),
            })
        }),
        Op::CrossEntropyGrad { .. } => arity(m, inputs, 2, "2").and_then(|_| {
            Op::CrossEntropy { denom: 1 }
                .infer(inputs, None)
                .map_err(|e| err(m, e.to_string()))
                .map(|_| inputs[0].clone())
        }),
        Op::CrossEntropyShardGrad { .. } => arity(m, inputs, 3, "3").and_then(|_| {
            Op::CrossEntropy { denom: 1 }
                .infer(&inputs[..2], None)
                .map_err(|e| err(m, e.to_string()))?;
            check_stats(m, inputs[2], inputs[1])?;
            Ok(inputs[0].clone())
        }),
        Op::RepeatGrad { dim, times } => arity(m, inputs, 1, "1").and_then(|_| {
            let x = inputs[0];
            x.part(*dim, *times)
                .ok_or_else(|| err(m, format!("dim {dim} of {x} is not a multiple of {times}")))
        }),
        Op::AdamMoment { .. } => arity(m, inputs, 2, "2")
            .and_then(|_| same(m, inputs[0], inputs[1], "moment and gradient"))
            .map(|_| inputs[0].clone()),
        Op::AdamWUpdate(_) => arity(m, inputs, 4, "4").and_then(|_| {
            same(m, inputs[0], inputs[1], "parameter and first moment")?;
            same(m, inputs[0], inputs[2], "parameter and second moment")?;
            if inputs[3].rank() != 0 || inputs[3].dtype != DType::F32 {
                return Err(err(m, format!("step {} must be f32[]", inputs[3])));
            }
            Ok(inputs[0].clone())
        }),
        _ => return None,
    };
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_validate_names_the_first_field_out_of_its_domain() {
        assert_eq!(AdamWSpec::default().validate(), Ok(()));
        // Each case puts one field out of its domain.
        type Spoil = fn(&mut AdamWSpec);
        let bad: [(Spoil, &str); 7] = [
            (
                |a| a.lr = Float(f32::NAN),
                "lr: must be finite and > 0 (found NaN)",
            ),
            (
                |a| a.lr = Float(f32::INFINITY),
                "lr: must be finite and > 0 (found inf)",
            ),
            (
                |a| a.beta1 = Float(1.5),
                "beta1: must be in [0, 1) (found 1.5)",
            ),
            (
                |a| a.beta2 = Float(1.0),
                "beta2: must be in [0, 1) (found 1)",
            ),
            (
                |a| a.beta2 = Float(-0.1),
                "beta2: must be in [0, 1) (found -0.1)",
            ),
            (
                |a| a.eps = Float(0.0),
                "eps: must be finite and > 0 (found 0)",
            ),
            (
                |a| a.weight_decay = Float(-1.0),
                "weight_decay: must be finite and >= 0 (found -1)",
            ),
        ];
        for (spoil, want) in bad {
            let mut a = AdamWSpec::default();
            spoil(&mut a);
            assert_eq!(a.validate().unwrap_err().to_string(), want);
        }
        // β = 0 (no momentum) and no weight decay are valid.
        let mut a = AdamWSpec::default();
        (a.beta1, a.beta2, a.weight_decay) = (Float(0.0), Float(0.0), Float(0.0));
        assert_eq!(a.validate(), Ok(()));
    }
}
