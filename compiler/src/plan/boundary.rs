//! The pipeline boundary of a chunk program: which inputs are filled by receives and which
//! values are sent, by the names the training compile gives them, and the check that every
//! boundary tensor is sent with the type its receiver expects.

use crate::autodiff::{input_name, PIPE_GRAD_IN, PIPE_GRAD_OUT, PIPE_TIED_PREFIX};
use crate::ir::{Graph, Op, ValueId};
use crate::model::{STAGE_INPUT, STAGE_OUTPUT};
use crate::schedule::pp::{Carry, PipelineError};

/// The boundary-type check of the plan verifier and the compiler: every tensor a chunk sends
/// (its activation forward, its input's gradient backward, a tied copy's gradient) is an input
/// of the chunk that receives it, of the same local type (the two run on the same stage-mesh
/// coordinates). `graphs`: the chunk programs in model order; `m` micro-batches.
pub fn check_boundary_types(graphs: &[&Graph], m: usize) -> Result<(), PipelineError> {
    let n = graphs.len();
    let mut pairs = Vec::new();
    for b in 0..n.saturating_sub(1) {
        for i in 0..m {
            pairs.push((Carry::Act, b, i));
            pairs.push((Carry::Grad, b, i));
        }
    }
    if n > 1 && boundary_name(graphs[0], Carry::Tied, 0, m).is_some() {
        pairs.push((Carry::Tied, 0, 0));
        pairs.push((Carry::Tied, n - 1, 0));
    }
    for (carry, b, i) in pairs {
        let (from, to) = (graphs[carry.sender(b)], graphs[carry.receiver(b, n)]);
        let sent = sent_value(from, carry, i, m).map(|v| from.ty(v).clone());
        let name = boundary_name(to, carry, i, m);
        let recv = name
            .as_deref()
            .and_then(|x| to.input_named(x))
            .map(|v| to.ty(v).clone());
        if sent.is_none() || sent != recv {
            return Err(PipelineError::Invalid(format!(
                "pipeline boundary {b}: the {carry:?} of micro-batch {i} is sent by chunk {} as {} and received by chunk {} as `{}` {}",
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

/// The input of program `g` a `carry` message of micro-batch `micro` fills.
pub fn boundary_name(g: &Graph, carry: Carry, micro: usize, m: usize) -> Option<String> {
    match carry {
        Carry::Act => Some(input_name(STAGE_INPUT, micro, m)),
        Carry::Grad => Some(input_name(PIPE_GRAD_IN, micro, m)),
        Carry::Tied => g.ids().find_map(|v| match &g.node(v).op {
            Op::Input { name, .. } if name.starts_with(PIPE_TIED_PREFIX) => Some(name.clone()),
            _ => None,
        }),
    }
}

/// The value of program `g` a `carry` message of micro-batch `micro` sends: an output.
pub fn sent_value(g: &Graph, carry: Carry, micro: usize, m: usize) -> Option<ValueId> {
    match carry {
        Carry::Act => g.output(&input_name(STAGE_OUTPUT, micro, m)),
        Carry::Grad => g.output(&input_name(PIPE_GRAD_OUT, micro, m)),
        Carry::Tied => {
            let name = boundary_name(g, Carry::Tied, 0, m)?;
            let label = name.strip_prefix(PIPE_TIED_PREFIX)?;
            g.output(&format!("grad.{label}"))
        }
    }
}
