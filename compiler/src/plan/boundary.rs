//! The pipeline boundary of a chunk: which inputs are filled by receives and which values are
//! sent, by the names the training compile gives them, and the check that every boundary
//! tensor is sent with the type its receiver expects.
//!
//! A chunk has two programs: its micro-batch's (forward, loss and backward of one
//! micro-batch: it receives the activation and the output's gradient and sends the
//! activation and the input's gradient, unsuffixed, once per micro-batch) and its step's
//! (the optimizer: it receives a tied copy's gradient). A tied copy sends its gradient summed
//! over the micro-batches, the sum of the micro-batch program's `grad.<label>` outputs.

use crate::autodiff::{PIPE_GRAD_IN, PIPE_GRAD_OUT, PIPE_TIED_PREFIX};
use crate::ir::{Graph, Op, ValueId, ValueRole};
use crate::model::{STAGE_INPUT, STAGE_OUTPUT};
use crate::schedule::pp::{Carry, PipelineError};

/// A chunk's two programs: `micro`, run once per micro-batch, and `step`, once per step.
#[derive(Clone, Copy, Debug)]
pub struct ChunkGraphs<'a> {
    /// Forward, loss and backward of one micro-batch.
    pub micro: &'a Graph,
    /// The chunk's optimizer step.
    pub step: &'a Graph,
}

impl<'a> ChunkGraphs<'a> {
    /// The program a `carry` message is received into: the micro-batch's for activations and
    /// gradients, the step's for a tied copy's gradient.
    pub fn receiver(&self, carry: Carry) -> &'a Graph {
        match carry {
            Carry::Tied => self.step,
            _ => self.micro,
        }
    }
}

/// The boundary-type check of the plan verifier and the compiler: every tensor a chunk sends
/// (its activation forward, its input's gradient backward, a tied copy's gradient) is an input
/// of the chunk that receives it, of the same local type (the two run on the same stage-mesh
/// coordinates). Every micro-batch crosses a boundary under the same names, so each carry is
/// checked once. `chunks`: the chunks' programs in model order.
pub fn check_boundary_types(chunks: &[ChunkGraphs]) -> Result<(), PipelineError> {
    let n = chunks.len();
    let mut pairs = Vec::new();
    for b in 0..n.saturating_sub(1) {
        pairs.push((Carry::Act, b));
        pairs.push((Carry::Grad, b));
    }
    if n > 1 && boundary_name(&chunks[0], Carry::Tied).is_some() {
        pairs.push((Carry::Tied, 0));
        pairs.push((Carry::Tied, n - 1));
    }
    for (carry, b) in pairs {
        let (from, to) = (&chunks[carry.sender(b)], &chunks[carry.receiver(b, n)]);
        let sent = sent_value(from, carry).map(|v| from.micro.ty(v).clone());
        let name = boundary_name(to, carry);
        let g = to.receiver(carry);
        let recv = name
            .as_deref()
            .and_then(|x| g.input_named(x))
            .map(|v| g.ty(v).clone());
        if sent.is_none() || sent != recv {
            return Err(PipelineError::Invalid(format!(
                "pipeline boundary {b}: the {carry:?} is sent by chunk {} as {} and received by chunk {} as `{}` {}",
                carry.sender(b),
                sent.map_or("(missing)".into(), |t| t.to_string()),
                carry.receiver(b, n),
                name.unwrap_or_default(),
                recv.map_or("(missing)".into(), |t| t.to_string()),
            )));
        }
    }
    Ok(())
}

/// True for an input of a chunk program that a receive fills: the activation from the
/// previous chunk, the gradient from the next, a tied copy's gradient.
pub fn is_received_input(g: &Graph, v: ValueId) -> bool {
    matches!(&g.node(v).op, Op::Input { name, .. }
        if name.starts_with(STAGE_INPUT) || name.starts_with(PIPE_GRAD_IN)
            || name.starts_with(PIPE_TIED_PREFIX))
}

/// The input a `carry` message fills (of [`ChunkGraphs::receiver`]).
pub fn boundary_name(c: &ChunkGraphs, carry: Carry) -> Option<String> {
    match carry {
        Carry::Act => Some(STAGE_INPUT.to_string()),
        Carry::Grad => Some(PIPE_GRAD_IN.to_string()),
        Carry::Tied => c.step.ids().find_map(|v| match &c.step.node(v).op {
            Op::Input { name, .. } if name.starts_with(PIPE_TIED_PREFIX) => Some(name.clone()),
            _ => None,
        }),
    }
}

/// The output of the micro-batch's program a `carry` message sends (a tied gradient: summed
/// over the micro-batches first).
pub fn sent_value(c: &ChunkGraphs, carry: Carry) -> Option<ValueId> {
    match carry {
        Carry::Act => c.micro.output(STAGE_OUTPUT),
        Carry::Grad => c.micro.output(PIPE_GRAD_OUT),
        Carry::Tied => {
            let name = boundary_name(c, Carry::Tied)?;
            let label = crate::autodiff::tied_label(&name)?;
            c.micro.output(&ValueRole::Gradient.name(label))
        }
    }
}
