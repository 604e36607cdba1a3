//! The e-class analysis. An e-class is "the same local tensor on every rank", so what this
//! module stores per class is invariant over the class's e-nodes:
//!
//! - the local type (shape, dtype; dim roles from the original node when there is one),
//! - `rep`: the mesh axes over which every rank holds the same value (a semantic fact; each
//!   e-node proves a subset of it, and the class holds the union of the proofs),
//! - the layout (`TensorSharding`) relating the local tensor to the logical one,
//! - the per-token dims: the dims along which rows are independent tokens (`seq`, else
//!   `batch`; every dim when the type names no roles).
//!
//! Besides the invariants each class carries bookkeeping for converting back to a graph
//! ([`Meta`]: a name, a layer, an order hint), which prefers the original node's.

use super::lang::{ENode, OpTable};
use crate::ir::{NormWrt, Op, Role, ShardSpec, TensorType, ValueRole};
use crate::shard::{apply_reshard_step, AxisId, Mesh, TensorSharding};
use egg::{Analysis, DidMerge, EGraph, Id};

/// A set of mesh axes, one bit per [`AxisId`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AxisMask(pub u64);

impl AxisMask {
    /// Every axis of `mesh`.
    pub fn all(mesh: &Mesh) -> AxisMask {
        let n = mesh.axes.len().min(63);
        AxisMask((1u64 << n) - 1)
    }
    /// The mask of one axis.
    pub fn of(a: AxisId) -> AxisMask {
        AxisMask(1u64 << a.0.min(63))
    }
    /// True when `a` is in the set.
    pub fn has(self, a: AxisId) -> bool {
        self.0 & AxisMask::of(a).0 != 0
    }
    /// Union.
    pub fn with(self, o: AxisMask) -> AxisMask {
        AxisMask(self.0 | o.0)
    }
    /// Intersection.
    pub fn and(self, o: AxisMask) -> AxisMask {
        AxisMask(self.0 & o.0)
    }
    /// Difference.
    pub fn without(self, o: AxisMask) -> AxisMask {
        AxisMask(self.0 & !o.0)
    }
}

/// Bookkeeping for converting a class back to graph nodes (not a semantic fact).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Node label.
    pub name: String,
    /// Transformer layer.
    pub layer: Option<u32>,
    /// Role in the training step.
    pub role: ValueRole,
    /// Emission-order hint: the original node's index, or for classes made by rules the
    /// latest operand's hint.
    pub anchor: u32,
    /// Creation order (0 for original nodes).
    pub seq: u32,
    /// The class holds a node of the input graph.
    pub original: bool,
    /// The label was made up from an operand's (a collective's or slice's `x.all_gather`, or
    /// the first operand's), not given for the value the class computes.
    pub derived: bool,
}

/// The data of one e-class.
#[derive(Clone, Debug)]
pub struct ClassData {
    /// Local type.
    pub ty: TensorType,
    /// Axes over which the value is replicated (every rank of the axis holds the same value).
    pub rep: AxisMask,
    /// Layout of the local tensor relative to its logical tensor.
    pub sharding: TensorSharding,
    /// Dims along which rows are independent tokens.
    pub token_dims: Vec<usize>,
    /// Bookkeeping.
    pub meta: Meta,
}

/// The analysis: the op interner, the mesh, and the log of e-nodes created by rules.
#[derive(Clone, Debug)]
pub struct SpmdAnalysis {
    /// Interned ops of every e-node.
    pub ops: OpTable,
    /// The mesh the program runs on.
    pub mesh: Mesh,
    /// E-nodes added by rules, with the adding rule (first addition wins), in order.
    pub origins: Vec<(ENode, &'static str)>,
    /// Creation counter for [`Meta::seq`].
    next_seq: u32,
}

/// The e-graph of an SPMD program.
pub type SpmdEGraph = EGraph<ENode, SpmdAnalysis>;

impl SpmdAnalysis {
    /// An empty analysis for programs on `mesh`.
    pub fn new(mesh: Mesh) -> SpmdAnalysis {
        SpmdAnalysis {
            ops: OpTable::default(),
            mesh,
            origins: Vec::new(),
            next_seq: 1,
        }
    }

    /// The id of mesh axis `name`, if the mesh has it.
    pub fn axis(&self, name: &str) -> Option<AxisId> {
        self.mesh.axis(name)
    }
}

/// The per-token dims of a type: `seq` dims, else `batch` dims; every dim when the type
/// names no roles at all.
pub fn token_dims(ty: &TensorType) -> Vec<usize> {
    for role in [Role::Seq, Role::Batch] {
        let v: Vec<usize> = (0..ty.rank())
            .filter(|&d| ty.dims[d].role == role)
            .collect();
        if !v.is_empty() {
            return v;
        }
    }
    if ty.dims.iter().all(|d| d.role == Role::Other) {
        (0..ty.rank()).collect()
    } else {
        Vec::new()
    }
}

fn shards_layout(mesh: &Mesh, shards: &[ShardSpec], rank: usize) -> (TensorSharding, AxisMask) {
    let mut s = TensorSharding::replicated(rank);
    let mut rep = AxisMask::all(mesh);
    for sp in shards {
        if let Some(a) = mesh.axis(&sp.axis) {
            if let Some(d) = s.dims.get_mut(sp.dim) {
                d.push(a);
            }
            rep = rep.without(AxisMask::of(a));
        }
    }
    (s, rep)
}

fn axis_mask(mesh: &Mesh, name: &str) -> AxisMask {
    mesh.axis(name).map_or(AxisMask(0), AxisMask::of)
}

/// The axes over which the result of `op` is replicated, given its operands'.
pub fn rep_of(mesh: &Mesh, op: &Op, children: &[AxisMask]) -> AxisMask {
    let all = children
        .iter()
        .fold(AxisMask::all(mesh), |acc, &r| acc.and(r));
    match op {
        Op::Param(src) => shards_layout(mesh, &src.shards, 0).1,
        Op::Input { shards, .. } => shards_layout(mesh, shards, 0).1,
        Op::AllReduce { axis } | Op::AllGather { axis, .. } | Op::Broadcast { axis, .. } => {
            all.with(axis_mask(mesh, axis))
        }
        Op::ReduceScatter { axis, .. }
        | Op::LocalSlice { axis, .. }
        | Op::RankOffset { axis, .. }
        | Op::CrossEntropyStats { axis, .. }
        | Op::CrossEntropyShardGrad { axis, .. }
        | Op::AllToAll { axis, .. }
        | Op::MatMulRs { axis, .. } => all.without(axis_mask(mesh, axis)),
        Op::AgMatMul { axis, .. } => {
            let x = children.first().copied().unwrap_or_default();
            let w = children.get(1).copied().unwrap_or_default();
            x.with(axis_mask(mesh, axis)).and(w)
        }
        _ => all,
    }
}

/// Applies one collective (or local slice) to a layout; unknown axes leave it unchanged.
fn step(mesh: &Mesh, s: &TensorSharding, op: &Op) -> TensorSharding {
    let fits = |d: usize| d < s.dims.len();
    let ok = match op {
        Op::AllReduce { axis } => mesh.axis(axis).is_some(),
        Op::ReduceScatter { axis, dim, .. }
        | Op::AllGather { axis, dim, .. }
        | Op::LocalSlice { axis, dim, .. } => mesh.axis(axis).is_some() && fits(*dim),
        Op::AllToAll {
            axis,
            split_dim,
            concat_dim,
            ..
        } => mesh.axis(axis).is_some() && fits(*split_dim) && fits(*concat_dim),
        _ => false,
    };
    if ok {
        apply_reshard_step(mesh, s, op)
    } else {
        s.clone()
    }
}

/// The layout of a matmul's result from its operands' (`b` of rank `b_rank`).
fn matmul_layout(
    a: &TensorSharding,
    b: &TensorSharding,
    b_rank: usize,
    tb: bool,
) -> TensorSharding {
    let r = a.dims.len();
    let mut dims: Vec<Vec<AxisId>> = a.dims[..r.saturating_sub(1)].to_vec();
    let n_dim = if tb { b_rank - 2 } else { b_rank - 1 };
    dims.push(b.dims.get(n_dim).cloned().unwrap_or_default());
    let mut partial = a.partial.clone();
    for &p in b.partial.iter().chain(a.dims.last().into_iter().flatten()) {
        if !partial.contains(&p) {
            partial.push(p);
        }
    }
    TensorSharding { dims, partial }
}

/// The layout of the result of `op` from its operands' layouts and types.
pub fn derive_sharding(
    mesh: &Mesh,
    op: &Op,
    children: &[&TensorSharding],
    child_tys: &[&TensorType],
    out: &TensorType,
) -> TensorSharding {
    let first = || {
        children
            .first()
            .filter(|s| s.dims.len() == out.rank())
            .map(|s| (*s).clone())
            .unwrap_or_else(|| TensorSharding::replicated(out.rank()))
    };
    let b_rank = || child_tys.get(1).map_or(2, |t| t.rank());
    match op {
        Op::Param(src) => shards_layout(mesh, &src.shards, out.rank()).0,
        Op::Input { shards, .. } => shards_layout(mesh, shards, out.rank()).0,
        Op::AllReduce { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGather { .. }
        | Op::AllToAll { .. }
        | Op::LocalSlice { .. } => children
            .first()
            .map(|s| step(mesh, s, op))
            .unwrap_or_else(|| TensorSharding::replicated(out.rank())),
        Op::MatMul { transpose_b } | Op::FusedMatMul { transpose_b, .. } if children.len() >= 2 => {
            matmul_layout(children[0], children[1], b_rank(), *transpose_b)
        }
        Op::AgMatMul { .. } | Op::MatMulRs { .. } if children.len() == 2 => {
            let r = op.ring_matmul().expect("invariant: a collective matmul");
            let c = r.collective();
            if r.gather {
                let g = step(mesh, children[0], &c);
                matmul_layout(&g, children[1], b_rank(), r.transpose_b)
            } else {
                let p = matmul_layout(children[0], children[1], b_rank(), r.transpose_b);
                step(mesh, &p, &c)
            }
        }
        // Sums over every leading dim of the incoming gradient (a norm gradient's last
        // operand, a bias gradient's first): the result is laid out like that gradient's
        // trailing dims, a partial sum over the axes that split the summed rows.
        Op::RmsNormGrad {
            wrt: NormWrt::Weight,
            ..
        }
        | Op::LayerNormGrad {
            wrt: NormWrt::Weight,
            ..
        }
        | Op::BiasGrad => match if matches!(op, Op::BiasGrad) {
            children.first()
        } else {
            children.last()
        } {
            Some(dy) if dy.dims.len() >= out.rank() => {
                let lead = dy.dims.len() - out.rank();
                let mut partial = dy.partial.clone();
                for &a in dy.dims[..lead].iter().flatten() {
                    if !partial.contains(&a) {
                        partial.push(a);
                    }
                }
                partial.sort();
                TensorSharding {
                    dims: dy.dims[lead..].to_vec(),
                    partial,
                }
            }
            _ => TensorSharding::replicated(out.rank()),
        },
        _ => first(),
    }
}

impl Analysis<ENode> for SpmdAnalysis {
    type Data = ClassData;

    fn make(eg: &mut SpmdEGraph, enode: &ENode, _id: Id) -> ClassData {
        let key = eg.analysis.ops.get(enode.op).clone();
        let kids: Vec<&ClassData> = enode.children.iter().map(|&c| &eg[c].data).collect();
        let tys: Vec<&TensorType> = kids.iter().map(|d| &d.ty).collect();
        let ty = key
            .op
            .infer(&tys, key.declared.as_ref())
            .expect("invariant: only well-typed e-nodes are added");
        let mesh = &eg.analysis.mesh;
        let reps: Vec<AxisMask> = kids.iter().map(|d| d.rep).collect();
        let rep = rep_of(mesh, &key.op, &reps);
        let shs: Vec<&TensorSharding> = kids.iter().map(|d| &d.sharding).collect();
        let sharding = derive_sharding(mesh, &key.op, &shs, &tys, &ty);
        let (name, layer, role) = match kids.first() {
            Some(k) if key.op.is_collective() || matches!(key.op, Op::LocalSlice { .. }) => (
                format!("{}.{}", k.meta.name, key.op.mnemonic()),
                k.meta.layer,
                k.meta.role,
            ),
            Some(k) => (k.meta.name.clone(), k.meta.layer, k.meta.role),
            None => (String::new(), None, ValueRole::Forward),
        };
        let anchor = kids.iter().map(|d| d.meta.anchor).max().unwrap_or(0);
        let token = token_dims(&ty);
        let seq = eg.analysis.next_seq;
        eg.analysis.next_seq = seq.saturating_add(1);
        ClassData {
            ty,
            rep,
            sharding,
            token_dims: token,
            meta: Meta {
                name,
                layer,
                role,
                anchor,
                seq,
                original: false,
                derived: true,
            },
        }
    }

    fn merge(&mut self, a: &mut ClassData, b: ClassData) -> DidMerge {
        let rep = a.rep.with(b.rep);
        let mut a_changed = rep != a.rep;
        let b_changed = rep != b.rep;
        a.rep = rep;
        // The original node's bookkeeping wins, then a label given for the value over one made
        // up from an operand's (a residual sum on shards first made as the slice of the whole
        // sum keeps the sum's label, as the partitioner names it), then the earliest created.
        let b_wins = match (a.meta.original, b.meta.original) {
            (false, true) => true,
            (true, false) => false,
            (true, true) => b.meta.anchor < a.meta.anchor,
            (false, false) => match (a.meta.derived, b.meta.derived) {
                (true, false) => true,
                (false, true) => false,
                _ => b.meta.seq < a.meta.seq,
            },
        };
        if b_wins {
            a.meta = b.meta;
            a.ty = b.ty;
            if a.sharding != b.sharding {
                a.sharding = b.sharding;
                a_changed = true;
            }
        }
        DidMerge(a_changed, b_changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Dim};

    #[test]
    fn token_dims_prefer_seq() {
        let t = TensorType::new(
            DType::F32,
            vec![
                Dim::new(Role::Batch, 2),
                Dim::new(Role::Seq, 4),
                Dim::new(Role::Hidden, 8),
            ],
        );
        assert_eq!(token_dims(&t), vec![1]);
        let t = TensorType::new(
            DType::F32,
            vec![Dim::new(Role::Batch, 2), Dim::new(Role::Hidden, 8)],
        );
        assert_eq!(token_dims(&t), vec![0]);
        assert_eq!(
            token_dims(&TensorType::plain(DType::F32, &[3, 5])),
            vec![0, 1]
        );
        let t = TensorType::new(DType::F32, vec![Dim::new(Role::Hidden, 8)]);
        assert!(token_dims(&t).is_empty());
    }

    #[test]
    fn replication_facts() {
        let mesh = Mesh::parse("dp=2,tp=2", 8).expect("mesh");
        let (dp, tp) = (AxisMask::of(AxisId(0)), AxisMask::of(AxisId(1)));
        let all = AxisMask::all(&mesh);
        let ar = Op::AllReduce { axis: "tp".into() };
        assert_eq!(rep_of(&mesh, &ar, &[dp]), all);
        assert_eq!(rep_of(&mesh, &ar, &[AxisMask(0)]), tp);
        let ls = Op::LocalSlice {
            axis: "tp".into(),
            dim: 0,
            parts: 2,
        };
        assert_eq!(rep_of(&mesh, &ls, &[all]), dp);
        assert_eq!(rep_of(&mesh, &Op::Add, &[all, dp]), dp);
        let input = Op::Input {
            name: "x".into(),
            shards: vec![ShardSpec {
                dim: 0,
                axis: "dp".into(),
                parts: 2,
            }],
        };
        assert_eq!(rep_of(&mesh, &input, &[]), tp);
    }
}
