//! What a value of a training step is: [`ValueRole`], given to each node where it is created
//! (autodiff's training-graph builder knows what every node is) and carried by every pass
//! that copies nodes, like the node's layer.
//!
//! This module is also the one place that spells the names of a training program's
//! interface — its inputs and outputs per parameter (`param.<label>`, `grad.<label>`,
//! `adam_m.<label>`, `adam_v.<label>`): [`ValueRole::name`] formats them and
//! [`ValueRole::of_input`] / [`ValueRole::of_output`] parse them. No other code tests a
//! value's role by the prefix of its name.
//!
//! ```
//! use shardc_compiler::ir::ValueRole;
//! let name = ValueRole::Gradient.name("embed");
//! assert_eq!(name, "grad.embed");
//! assert_eq!(ValueRole::of_output(&name), Some((ValueRole::Gradient, "embed")));
//! // `param.<label>` is the weight before the step as an input, after it as an output.
//! assert_eq!(ValueRole::of_input("param.embed"), Some((ValueRole::Parameter, "embed")));
//! assert_eq!(ValueRole::of_output("param.embed"), Some((ValueRole::Update, "embed")));
//! assert_eq!(ValueRole::of_output("loss"), None);
//! ```

use serde::{Deserialize, Serialize};
use std::fmt;

/// The part of a training step a value belongs to. Forward graphs hold only
/// [`ValueRole::Forward`] values. A node the partitioner or the rewriter derives from another
/// (a reshard, a rewritten form) takes that node's role, as it takes its name and layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValueRole {
    /// A forward-pass value (activations, the batch inputs, pipeline boundary values) or any
    /// value of a forward-only graph.
    #[default]
    Forward,
    /// An identity view of a forward value kept for the backward pass (`saved.<name>`): the
    /// activation memory of the step is what these nodes read.
    Saved,
    /// A forward value recomputed in the backward pass (activation checkpointing).
    Recompute,
    /// A backward-pass value: vector-Jacobian products, cotangent sums, a parameter's
    /// backward-phase gather, a micro-batch's gradient sum before the gradient's own node.
    Backward,
    /// A parameter's gradient: per micro-batch, accumulated over micro-batches (the output
    /// and, in a step program, the input `grad.<label>`), or with a tied copy's added.
    Gradient,
    /// A parameter's weight before the step: the input `param.<label>`.
    Parameter,
    /// AdamW's first moment: the input `adam_m.<label>` and its update (the output of the
    /// same name).
    FirstMoment,
    /// AdamW's second moment: the input `adam_v.<label>` and its update (the output of the
    /// same name).
    SecondMoment,
    /// The optimizer's step-count input `step`.
    Step,
    /// A parameter's updated weight: the output `param.<label>`.
    Update,
    /// The loss of a micro-batch or the step.
    Loss,
}

impl ValueRole {
    /// Every role.
    pub const ALL: [ValueRole; 11] = [
        ValueRole::Forward,
        ValueRole::Saved,
        ValueRole::Recompute,
        ValueRole::Backward,
        ValueRole::Gradient,
        ValueRole::Parameter,
        ValueRole::FirstMoment,
        ValueRole::SecondMoment,
        ValueRole::Step,
        ValueRole::Update,
        ValueRole::Loss,
    ];

    /// Text name (`forward`, `saved`, ..., `first_moment`), as the text IR prints it.
    pub fn as_str(self) -> &'static str {
        match self {
            ValueRole::Forward => "forward",
            ValueRole::Saved => "saved",
            ValueRole::Recompute => "recompute",
            ValueRole::Backward => "backward",
            ValueRole::Gradient => "gradient",
            ValueRole::Parameter => "parameter",
            ValueRole::FirstMoment => "first_moment",
            ValueRole::SecondMoment => "second_moment",
            ValueRole::Step => "step",
            ValueRole::Update => "update",
            ValueRole::Loss => "loss",
        }
    }

    /// Parses a text name.
    pub fn from_name(s: &str) -> Option<ValueRole> {
        ValueRole::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// True for [`ValueRole::Forward`] (the default, not printed or serialized).
    pub fn is_forward(&self) -> bool {
        *self == ValueRole::Forward
    }

    /// True for the optimizer's moments (inputs, updates and their reshards).
    pub fn is_moment(self) -> bool {
        matches!(self, ValueRole::FirstMoment | ValueRole::SecondMoment)
    }

    /// The interface-name prefix of a role that has one per parameter.
    fn prefix(self) -> Option<&'static str> {
        Some(match self {
            ValueRole::Parameter | ValueRole::Update => "param.",
            ValueRole::Gradient => "grad.",
            ValueRole::FirstMoment => "adam_m.",
            ValueRole::SecondMoment => "adam_v.",
            _ => return None,
        })
    }

    /// The program input or output that carries parameter `label` in this role:
    /// `param.<label>` (a [`ValueRole::Parameter`] input, a [`ValueRole::Update`] output),
    /// `grad.<label>`, `adam_m.<label>`, `adam_v.<label>`.
    ///
    /// # Panics
    /// For a role with no per-parameter interface value (a bug in the caller).
    pub fn name(self, label: &str) -> String {
        let p = self
            .prefix()
            .expect("invariant: only per-parameter roles name interface values");
        format!("{p}{label}")
    }

    fn parse(name: &str, roles: [ValueRole; 4]) -> Option<(ValueRole, &str)> {
        roles.into_iter().find_map(|r| {
            let p = r.prefix().expect("invariant: per-parameter roles");
            name.strip_prefix(p).map(|label| (r, label))
        })
    }

    /// The role and parameter label of program input `name`, when it is a per-parameter
    /// input ([`ValueRole::Parameter`], [`ValueRole::FirstMoment`],
    /// [`ValueRole::SecondMoment`], or a step program's [`ValueRole::Gradient`]).
    pub fn of_input(name: &str) -> Option<(ValueRole, &str)> {
        ValueRole::parse(
            name,
            [
                ValueRole::Parameter,
                ValueRole::Gradient,
                ValueRole::FirstMoment,
                ValueRole::SecondMoment,
            ],
        )
    }

    /// The role and parameter label of program output `name`, when it is a per-parameter
    /// output ([`ValueRole::Gradient`], [`ValueRole::Update`], [`ValueRole::FirstMoment`],
    /// [`ValueRole::SecondMoment`]).
    pub fn of_output(name: &str) -> Option<(ValueRole, &str)> {
        ValueRole::parse(
            name,
            [
                ValueRole::Update,
                ValueRole::Gradient,
                ValueRole::FirstMoment,
                ValueRole::SecondMoment,
            ],
        )
    }

    /// The parameter label of gradient input or output `name` (`grad.<label>`).
    pub fn gradient_label(name: &str) -> Option<&str> {
        match ValueRole::of_output(name) {
            Some((ValueRole::Gradient, label)) => Some(label),
            _ => None,
        }
    }
}

impl fmt::Display for ValueRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::ValueRole;

    #[test]
    fn names_round_trip() {
        for r in ValueRole::ALL {
            assert_eq!(ValueRole::from_name(r.as_str()), Some(r));
            let Some(_) = r.prefix() else { continue };
            let n = r.name("layers.0.mlp.w");
            let back = if r == ValueRole::Parameter {
                ValueRole::of_input(&n)
            } else {
                ValueRole::of_output(&n)
            };
            assert_eq!(back, Some((r, "layers.0.mlp.w")), "{n}");
        }
        assert_eq!(ValueRole::of_input("input_ids"), None);
        assert_eq!(ValueRole::of_output("pipe.loss"), None);
        assert_eq!(ValueRole::gradient_label("grad.embed"), Some("embed"));
        assert_eq!(ValueRole::gradient_label("param.embed"), None);
    }
}
