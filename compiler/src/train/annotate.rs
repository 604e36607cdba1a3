//! Annotations of the training graph: the forward presets' layouts carried over to every
//! micro-batch (and to the gradients of the values they annotate), plus the layouts of
//! parameters, gradients and optimizer state each strategy asks for.

use crate::autodiff::{input_name, TrainGraph};
use crate::ir::{Op, TensorType, ValueId, ValueRole};
use crate::shard::{Annotations, AxisId, Mesh, TensorSharding};

/// `layout` with the ZeRO data axis `dp` added: on the first unsharded dim whose size it
/// divides, else as the minor axis of a sharded dim whose local size it divides; unchanged
/// (replicated over `dp`) when no dim divides.
pub(super) fn zero_layout(
    layout: &TensorSharding,
    dp: AxisId,
    ty: &TensorType,
    mesh: &Mesh,
) -> TensorSharding {
    let n = mesh.axis_size(dp);
    let local = |d: usize| ty.dim(d) / layout.parts(mesh, d).max(1);
    let mut s = layout.clone();
    if s.used_axes().contains(&dp) {
        return s;
    }
    if let Some(d) = (0..ty.rank()).find(|&d| s.dims[d].is_empty() && local(d) % n == 0) {
        s.dims[d].push(dp);
    } else if let Some(d) = (0..ty.rank()).find(|&d| local(d) % n == 0) {
        s.dims[d].push(dp);
    }
    s
}

/// Sets `v`'s layout unless something set it already (the first annotation wins: a node can be
/// the gradient of several values, e.g. both operands of a residual add).
fn set_once(ann: &mut Annotations, v: ValueId, s: TensorSharding, why: String) {
    if !ann.values.contains_key(&v) {
        ann.set(v, s, why);
    }
}

/// The annotations of training graph `tg` built from a forward graph annotated `fwd_ann`.
pub(super) fn train_annotations(
    tg: &TrainGraph,
    fwd_ann: &Annotations,
    mesh: &Mesh,
    zero: u8,
) -> Annotations {
    let mut ann = Annotations::default();
    // ZeRO shards over the ranks that sum each gradient: `dp`, and `cp` (its ranks saw other
    // tokens of the same sequences), as Megatron's distributed optimizer shards over dp × cp.
    let zero_axes: Vec<AxisId> = ["dp", "cp"]
        .iter()
        .filter_map(|n| mesh.axis(n))
        .filter(|&a| zero > 0 && mesh.axis_size(a) > 1)
        .collect();
    let over = zero_axes
        .iter()
        .map(|&a| mesh.axis_name(a))
        .collect::<Vec<_>>()
        .join("×");
    let mut param_layout = Vec::with_capacity(tg.params.len());
    for p in &tg.params {
        let rank = p.ty.rank();
        let layout = fwd_ann
            .values
            .get(&p.fwd)
            .cloned()
            .unwrap_or_else(|| TensorSharding::replicated(rank));
        let why = fwd_ann
            .why
            .get(&p.fwd)
            .cloned()
            .unwrap_or_else(|| "replicated".into());
        let opt = zero_axes
            .iter()
            .fold(layout.clone(), |l, &a| zero_layout(&l, a, &p.ty, mesh));
        let storage = if zero == 3 {
            opt.clone()
        } else {
            layout.clone()
        };
        let label = &p.label;
        let stage = format!("zero{zero}");
        let storage_why = if zero == 3 {
            format!("{stage}: parameter stored sharded over {over} ({why})")
        } else {
            format!("parameter ({why})")
        };
        ann.set(p.input, storage.clone(), storage_why);
        match zero {
            0 => ann.set(
                p.grad,
                layout.clone(),
                format!("gradient reduced like its parameter when complete ({why})"),
            ),
            1 => {}
            _ => {
                for &g in &p.mb_grads {
                    let why =
                        format!("{stage}: gradient reduce-scattered over {over} when complete");
                    ann.set(g, opt.clone(), why);
                }
            }
        }
        let opt_why = if zero > 0 {
            format!("{stage}: optimizer state sharded over {over}")
        } else {
            format!("optimizer state like its parameter ({why})")
        };
        for v in [p.m_in, p.v_in, p.m_out, p.v_out, p.update] {
            ann.set(v, opt.clone(), opt_why.clone());
        }
        ann.outputs.insert(ValueRole::Update.name(label), storage);
        ann.outputs
            .insert(ValueRole::FirstMoment.name(label), opt.clone());
        ann.outputs.insert(ValueRole::SecondMoment.name(label), opt);
        param_layout.push((layout, why));
    }
    for &(node, p) in &tg.gathers {
        let (layout, why) = &param_layout[p];
        ann.set(
            node,
            layout.clone(),
            format!("zero3: parameter all-gathered over {over} before use ({why})"),
        );
    }
    // The forward presets, per micro-batch; the same layouts for the gradients.
    let params: Vec<ValueId> = tg.params.iter().map(|p| p.fwd).collect();
    for (k, map) in tg.fwd_maps.iter().enumerate() {
        for (&v, s) in &fwd_ann.values {
            if params.contains(&v) {
                continue;
            }
            let why = fwd_ann.why.get(&v).cloned().unwrap_or_default();
            if let Some(x) = map[v.index()] {
                set_once(&mut ann, x, s.clone(), why.clone());
                // An annotated attention's saved probabilities `[b, h, t, s]` follow its
                // batch, heads and queries (Ulysses: heads split, not gathered for them).
                if matches!(tg.graph.node(x).op, Op::Attention(_)) {
                    let q = tg.graph.node(x).inputs[0];
                    let probs = tg.graph.ids().filter(|&p| {
                        matches!(tg.graph.node(p).op, Op::AttentionProbs(_))
                            && tg.graph.node(p).inputs[0] == q
                    });
                    let layout = TensorSharding {
                        dims: vec![
                            s.dims[0].clone(),
                            s.dims[2].clone(),
                            s.dims[1].clone(),
                            Vec::new(),
                        ],
                        partial: Vec::new(),
                    };
                    for p in probs.collect::<Vec<_>>() {
                        set_once(
                            &mut ann,
                            p,
                            layout.clone(),
                            format!("probabilities of: {why}"),
                        );
                    }
                }
            }
            if let Some(c) = tg.cotangents[k][v.index()] {
                set_once(
                    &mut ann,
                    c,
                    s.clone(),
                    format!("gradient of a value laid out by: {why}"),
                );
            }
        }
        // Labels are laid out like the token ids (the positions in a pipeline chunk
        // without the embedding).
        let ids = tg
            .graph
            .input_named(&input_name("input_ids", k, tg.micro_batches))
            .or_else(|| {
                tg.graph
                    .input_named(&input_name("position_ids", k, tg.micro_batches))
            });
        let labels = tg
            .graph
            .input_named(&input_name("labels", k, tg.micro_batches));
        if let (Some(ids), Some(labels)) = (ids, labels) {
            if let Some(s) = ann.values.get(&ids).cloned() {
                let why = ann.why.get(&ids).cloned().unwrap_or_default();
                ann.set(labels, s, why);
            }
        }
    }
    ann
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;

    #[test]
    fn zero_layout_picks_a_free_dividing_dim() {
        let m = Mesh::parse("dp=2,tp=2", 8).unwrap();
        let (dp, tp) = (m.axis("dp").unwrap(), m.axis("tp").unwrap());
        let ty = TensorType::plain(DType::F32, &[3, 8]);
        // dim 0 (3) does not divide: dim 1.
        let s = zero_layout(&TensorSharding::replicated(2), dp, &ty, &m);
        assert_eq!(s.dims, vec![vec![], vec![dp]]);
        // dim 1 sharded on tp, dim 0 indivisible: dp minor on dim 1 (8 / 2 = 4 divides).
        let s = zero_layout(&TensorSharding::split(2, 1, &[tp]), dp, &ty, &m);
        assert_eq!(s.dims, vec![vec![], vec![tp, dp]]);
        // Nothing divides: unchanged.
        let ty = TensorType::plain(DType::F32, &[3]);
        let s = zero_layout(&TensorSharding::replicated(1), dp, &ty, &m);
        assert!(s.is_replicated());
    }
}
