//! CPU kernels of the training ops: the gradients of the forward ops (`…Grad`,
//! `AttentionProbs`) and the AdamW step. They define the semantics written in
//! `shardc_compiler::ir::Op`; every gradient is checked against central finite differences of
//! its forward kernel in this module's tests.
//!
//! Gradients accumulate in f64 and round once to f32, so they are at least as accurate as
//! PyTorch's float32 autograd (the fixtures' reference). Shapes are re-checked and reported as
//! [`RuntimeError::Shape`], never a panic.

mod attention;
pub(crate) mod basic;
mod moe;
mod norm;
mod optim;

#[cfg(test)]
mod check;

use super::arity;
use crate::cpu::attention::Keys;
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::Op;

/// Evaluates a training op; `None` for every other op.
pub(crate) fn eval(op: &Op, inputs: &[&Tensor]) -> Option<Result<Tensor, RuntimeError>> {
    let m = op.mnemonic();
    let want = |n: usize| arity(m, inputs, n);
    let i = inputs;
    Some(match op {
        Op::UnaryGrad(u) => want(2).and_then(|_| basic::unary_grad(*u, i[0], i[1])),
        Op::BiasGrad => want(2).and_then(|_| basic::bias_grad(i[0], i[1])),
        Op::WeightGrad { transpose_b } => {
            want(3).and_then(|_| basic::weight_grad(i[0], i[1], i[2], *transpose_b))
        }
        Op::RmsNormGrad { eps, wrt } => {
            want(3).and_then(|_| norm::norm_grad(i[0], i[1], i[2], eps.0, false, *wrt))
        }
        Op::LayerNormGrad { eps, wrt } => {
            want(3).and_then(|_| norm::norm_grad(i[0], i[1], i[2], eps.0, true, *wrt))
        }
        Op::RopeGrad(spec) => want(2).and_then(|_| basic::rope_grad(i[0], i[1], spec)),
        Op::AttentionProbs(spec) => {
            Keys::after(m, spec, i, 2).and_then(|keys| attention::probs(i[0], i[1], keys, spec))
        }
        Op::AttentionGrad { spec, wrt } => {
            want(5).and_then(|_| attention::grad(i[0], i[1], i[2], i[3], i[4], spec, *wrt))
        }
        Op::EmbeddingGrad => want(3).and_then(|_| basic::embedding_grad(i[0], i[1], i[2])),
        Op::RouterGrad { top_k, normalize } => {
            want(2).and_then(|_| moe::router_grad(i[0], i[1], *top_k, *normalize))
        }
        Op::DispatchGrad => want(2).and_then(|_| moe::dispatch_grad(i[0], i[1])),
        Op::CombineGrad { wrt } => want(3).and_then(|_| moe::combine_grad(i[0], i[1], i[2], *wrt)),
        Op::CrossEntropyGrad { denom } => {
            want(2).and_then(|_| basic::cross_entropy_grad(i[0], i[1], *denom))
        }
        Op::RepeatGrad { dim, times } => {
            want(1).and_then(|_| basic::repeat_grad(i[0], *dim, *times))
        }
        Op::AdamMoment { beta, squared } => {
            want(2).and_then(|_| optim::moment(i[0], i[1], beta.0, *squared))
        }
        Op::AdamWUpdate(spec) => want(4).and_then(|_| optim::update(i[0], i[1], i[2], i[3], spec)),
        _ => return None,
    })
}
