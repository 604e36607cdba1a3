//! `reshard(from, to)`: the one place where a layout mismatch becomes communication.
//!
//! partial→replicated = AllReduce; partial→sharded = ReduceScatter; sharded→replicated =
//! AllGather; sharded(d)→sharded(e) = AllToAll; replicated→sharded = LocalSlice (no traffic).
//! The returned ops apply in order to the local tensor; each keeps axes major-to-minor order,
//! and when a direct route would break that order the plan falls back to gather-then-slice.

use super::mesh::{AxisId, Mesh};
use super::sharding::TensorSharding;
use crate::ir::Op;

/// The state after applying `op` (one step of a reshard) to a value sharded as `s`.
/// The layout after applying one reshard step `op` to a value laid out as `s`.
pub fn apply_public(mesh: &Mesh, s: &TensorSharding, op: &Op) -> TensorSharding {
    apply(mesh, s, op)
}

fn apply(mesh: &Mesh, s: &TensorSharding, op: &Op) -> TensorSharding {
    let mut s = s.clone();
    let id = |name: &str| mesh.axis(name).expect("invariant: reshard uses mesh axes");
    match op {
        Op::AllReduce { axis } => s.partial.retain(|&a| a != id(axis)),
        Op::ReduceScatter { axis, dim, .. } => {
            s.partial.retain(|&a| a != id(axis));
            s.dims[*dim].push(id(axis));
        }
        Op::AllGather { axis, dim, .. } => s.dims[*dim].retain(|&a| a != id(axis)),
        Op::AllToAll {
            axis,
            split_dim,
            concat_dim,
            ..
        } => {
            s.dims[*concat_dim].retain(|&a| a != id(axis));
            s.dims[*split_dim].push(id(axis));
        }
        Op::LocalSlice { axis, dim, .. } => s.dims[*dim].push(id(axis)),
        _ => unreachable!("invariant: reshard emits only collectives and local slices"),
    }
    s
}

fn name(mesh: &Mesh, a: AxisId) -> String {
    mesh.axis_name(a).to_string()
}

/// The direct route: reductions, then removals (minor-first, all-to-all where the axis moves),
/// then additions. `None` when it does not reach `to` (axis order would differ).
fn direct(mesh: &Mesh, from: &TensorSharding, to: &TensorSharding) -> Option<Vec<Op>> {
    let mut ops = Vec::new();
    let mut cur = from.clone();
    let target_dim = |a: AxisId| to.dims.iter().position(|axes| axes.contains(&a));
    // Partial axes: keep, reduce-scatter into their target dim, or all-reduce.
    for &a in &from.partial {
        if to.partial.contains(&a) {
            continue;
        }
        let op = match target_dim(a) {
            Some(d) => Op::ReduceScatter {
                axis: name(mesh, a),
                dim: d,
                parts: mesh.axis_size(a),
            },
            None => Op::AllReduce {
                axis: name(mesh, a),
            },
        };
        cur = apply(mesh, &cur, &op);
        ops.push(op);
    }
    // Axes leaving a dim, minor-most first.
    loop {
        let mut moved = false;
        for d in 0..cur.dims.len() {
            let Some(&a) = cur.dims[d].last() else {
                continue;
            };
            let keep = to.dims[d].len() >= cur.dims[d].len()
                && to.dims[d][..cur.dims[d].len()] == cur.dims[d][..];
            if keep {
                continue;
            }
            let op = match target_dim(a) {
                Some(e) if e != d => Op::AllToAll {
                    axis: name(mesh, a),
                    split_dim: e,
                    concat_dim: d,
                    parts: mesh.axis_size(a),
                },
                _ if to.partial.contains(&a) => return None,
                _ => Op::AllGather {
                    axis: name(mesh, a),
                    dim: d,
                    parts: mesh.axis_size(a),
                },
            };
            cur = apply(mesh, &cur, &op);
            ops.push(op);
            moved = true;
        }
        if !moved {
            break;
        }
    }
    // Axes to add, major to minor.
    for d in 0..to.dims.len() {
        for &a in &to.dims[d] {
            if cur.dims[d].contains(&a) {
                continue;
            }
            if cur.used_axes().contains(&a) {
                return None;
            }
            let op = Op::LocalSlice {
                axis: name(mesh, a),
                dim: d,
                parts: mesh.axis_size(a),
            };
            cur = apply(mesh, &cur, &op);
            ops.push(op);
        }
    }
    (cur == *to).then_some(ops)
}

/// The ops that turn a value sharded as `from` into one sharded as `to` (empty when equal).
/// Returns `None` only for `to` that cannot be reached (an axis made partial out of nothing).
pub fn reshard(mesh: &Mesh, from: &TensorSharding, to: &TensorSharding) -> Option<Vec<Op>> {
    if from == to {
        return Some(Vec::new());
    }
    if to.partial.iter().any(|a| !from.partial.contains(a)) {
        return None;
    }
    if let Some(ops) = direct(mesh, from, to) {
        return Some(ops);
    }
    // Fallback: replicate (keeping partials that stay), then slice.
    let mut mid = TensorSharding::replicated(from.dims.len());
    mid.partial = from
        .partial
        .iter()
        .copied()
        .filter(|a| to.partial.contains(a))
        .collect();
    let mut ops = direct(mesh, from, &mid)?;
    ops.extend(direct(mesh, &mid, to)?);
    Some(ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh() -> Mesh {
        Mesh::parse("dp=2,tp=4", 8).unwrap()
    }
    fn a(m: &Mesh, n: &str) -> AxisId {
        m.axis(n).unwrap()
    }
    fn r(rank: usize) -> TensorSharding {
        TensorSharding::replicated(rank)
    }
    fn p(m: &Mesh, rank: usize, n: &str) -> TensorSharding {
        TensorSharding {
            dims: vec![vec![]; rank],
            partial: vec![a(m, n)],
        }
    }
    fn s(m: &Mesh, rank: usize, d: usize, n: &str) -> TensorSharding {
        TensorSharding::split(rank, d, &[a(m, n)])
    }
    fn names(ops: &[Op]) -> Vec<String> {
        ops.iter()
            .map(|o| match o {
                Op::AllReduce { axis } => format!("all_reduce({axis})"),
                Op::ReduceScatter { axis, dim, .. } => format!("reduce_scatter({axis},{dim})"),
                Op::AllGather { axis, dim, .. } => format!("all_gather({axis},{dim})"),
                Op::AllToAll {
                    axis,
                    split_dim,
                    concat_dim,
                    ..
                } => format!("all_to_all({axis},{split_dim}<-{concat_dim})"),
                Op::LocalSlice { axis, dim, .. } => format!("local_slice({axis},{dim})"),
                _ => unreachable!(),
            })
            .collect()
    }
    fn route(m: &Mesh, from: &TensorSharding, to: &TensorSharding) -> Vec<String> {
        let ops = reshard(m, from, to).expect("reachable");
        // Applying the ops must land exactly on `to`.
        let end = ops.iter().fold(from.clone(), |st, op| apply(m, &st, op));
        assert_eq!(&end, to, "route {:?}", names(&ops));
        names(&ops)
    }

    #[test]
    fn replicated_to_replicated_is_empty() {
        let m = mesh();
        assert!(route(&m, &r(3), &r(3)).is_empty());
    }

    #[test]
    fn replicated_to_sharded_is_local_slice() {
        let m = mesh();
        for d in 0..3 {
            assert_eq!(
                route(&m, &r(3), &s(&m, 3, d, "tp")),
                vec![format!("local_slice(tp,{d})")]
            );
        }
    }

    #[test]
    fn sharded_to_replicated_is_all_gather() {
        let m = mesh();
        for d in 0..3 {
            assert_eq!(
                route(&m, &s(&m, 3, d, "tp"), &r(3)),
                vec![format!("all_gather(tp,{d})")]
            );
        }
    }

    #[test]
    fn partial_to_replicated_is_all_reduce() {
        let m = mesh();
        assert_eq!(route(&m, &p(&m, 3, "tp"), &r(3)), vec!["all_reduce(tp)"]);
    }

    #[test]
    fn partial_to_sharded_is_reduce_scatter() {
        let m = mesh();
        for d in 0..3 {
            assert_eq!(
                route(&m, &p(&m, 3, "tp"), &s(&m, 3, d, "tp")),
                vec![format!("reduce_scatter(tp,{d})")]
            );
        }
    }

    #[test]
    fn sharded_to_sharded_other_dim_is_all_to_all() {
        let m = mesh();
        for d in 0..3 {
            for e in 0..3 {
                let got = route(&m, &s(&m, 3, d, "tp"), &s(&m, 3, e, "tp"));
                if d == e {
                    assert!(got.is_empty());
                } else {
                    assert_eq!(got, vec![format!("all_to_all(tp,{e}<-{d})")]);
                }
            }
        }
    }

    #[test]
    fn partial_stays_partial() {
        let m = mesh();
        assert!(route(&m, &p(&m, 2, "tp"), &p(&m, 2, "tp")).is_empty());
        let mut to = s(&m, 2, 0, "dp");
        to.partial = vec![a(&m, "tp")];
        assert_eq!(route(&m, &p(&m, 2, "tp"), &to), vec!["local_slice(dp,0)"]);
    }

    #[test]
    fn to_partial_from_nothing_is_unreachable() {
        let m = mesh();
        assert!(reshard(&m, &r(2), &p(&m, 2, "tp")).is_none());
        assert!(reshard(&m, &s(&m, 2, 0, "tp"), &p(&m, 2, "tp")).is_none());
    }

    #[test]
    fn two_axes_on_one_dim() {
        let m = mesh();
        let both = TensorSharding::split(2, 0, &[a(&m, "dp"), a(&m, "tp")]);
        assert_eq!(
            route(&m, &both, &r(2)),
            vec!["all_gather(tp,0)", "all_gather(dp,0)"]
        );
        assert_eq!(
            route(&m, &r(2), &both),
            vec!["local_slice(dp,0)", "local_slice(tp,0)"]
        );
        assert_eq!(
            route(&m, &s(&m, 2, 0, "dp"), &both),
            vec!["local_slice(tp,0)"]
        );
        // tp major, dp minor → from dp only: order would break, so gather then slice.
        let rev = TensorSharding::split(2, 0, &[a(&m, "tp"), a(&m, "dp")]);
        assert_eq!(
            route(&m, &s(&m, 2, 0, "dp"), &rev),
            vec!["all_gather(dp,0)", "local_slice(tp,0)", "local_slice(dp,0)"]
        );
    }

    #[test]
    fn mixed_partial_and_sharded() {
        let m = mesh();
        let mut from = s(&m, 2, 0, "dp");
        from.partial = vec![a(&m, "tp")];
        let to = TensorSharding::split(2, 1, &[a(&m, "tp")]);
        assert_eq!(
            route(&m, &from, &to),
            vec!["reduce_scatter(tp,1)", "all_gather(dp,0)"]
        );
    }
}
