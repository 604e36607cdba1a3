//! The verifier: operands defined before use, types equal to what each op infers, outputs
//! defined, names of inputs unique. Run after every pass in debug and test builds.

use super::{Graph, IrError, Op, TensorType};
use std::collections::HashSet;

/// Checks the graph's invariants; returns every error found.
pub fn verify(g: &Graph) -> Result<(), Vec<IrError>> {
    let mut errs = Vec::new();
    let mut input_names = HashSet::new();
    for v in g.ids() {
        let node = g.node(v);
        if let Some(&bad) = node.inputs.iter().find(|i| i.index() >= v.index()) {
            errs.push(IrError::Undefined {
                node: v,
                operand: bad,
            });
            continue;
        }
        if let Op::Input { name, .. } = &node.op {
            if !input_names.insert(name.clone()) {
                errs.push(IrError::Invalid(format!("input {name:?} defined twice")));
            }
        }
        let tys: Vec<&TensorType> = node.inputs.iter().map(|&i| g.ty(i)).collect();
        match node.op.infer(&tys, Some(&node.ty)) {
            Ok(t) if t.dtype == node.ty.dtype && t.same_shape(&node.ty) => {}
            Ok(t) => errs.push(IrError::TypeMismatch {
                node: v,
                op: node.op.mnemonic(),
                declared: node.ty.to_string(),
                inferred: t.to_string(),
            }),
            Err(e) => errs.push(IrError::Invalid(format!("node {v}: {e}"))),
        }
    }
    for (name, v) in &g.outputs {
        if v.index() >= g.len() {
            errs.push(IrError::Invalid(format!(
                "output {name:?} = {v} is not defined"
            )));
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

/// Runs [`verify`] in debug and test builds and panics with every error on failure (a pass
/// produced an ill-formed graph: a compiler bug, never a user error). A no-op in release.
pub fn verify_if_debug(g: &Graph, pass: &str) {
    if cfg!(debug_assertions) {
        if let Err(errs) = verify(g) {
            let list: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
            panic!(
                "invariant: graph after pass `{pass}` fails verification:\n{}",
                list.join("\n")
            );
        }
    }
}
