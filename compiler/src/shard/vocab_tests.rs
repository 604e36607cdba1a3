//! The partitioner's vocabulary-parallel cross-entropy: logits split over one mesh axis along
//! the vocabulary reach the loss and its gradient without being gathered (only per-row stats
//! are), and logits laid out otherwise (whole, or split over an axis of one rank, or over two
//! axes) take the gathering route as before.

use super::{partition, Annotations, Mesh, ReshardReason, ShardedGraph, TensorSharding};
use crate::ir::{dims, DType, Graph, Op, Role, TensorType};

/// `loss = cross_entropy(logits, labels)`, `dlogits = cross_entropy_grad(logits, labels)` on
/// logits `[2, 4, 8]` laid out as `logits`, labels as its leading dims, `dlogits` required in
/// the logits' layout.
fn lowered(mesh: &str, logits: TensorSharding) -> ShardedGraph {
    let mesh = Mesh::parse(mesh, 8).expect("mesh");
    let mut g = Graph::new();
    let bt = [(Role::Batch, 2), (Role::Seq, 4)];
    let lt = TensorType::new(DType::F32, dims(&[bt[0], bt[1], (Role::Vocab, 8)]));
    let x = g.input("logits", lt);
    let y = g.input("labels", TensorType::new(DType::I32, dims(&bt)));
    let loss = g
        .add(Op::CrossEntropy { denom: 6 }, &[x, y], "loss")
        .expect("loss");
    let dx = g
        .add(Op::CrossEntropyGrad { denom: 6 }, &[x, y], "dlogits")
        .expect("dlogits");
    g.set_output("loss", loss);
    g.set_output("dlogits", dx);
    let mut ann = Annotations::default();
    let labels = TensorSharding {
        dims: logits.dims[..2].to_vec(),
        partial: Vec::new(),
    };
    ann.set(x, logits.clone(), "test");
    ann.set(y, labels, "test");
    ann.outputs.insert("dlogits".into(), logits);
    partition(&g, &mesh, &ann).expect("partition")
}

fn split(mesh: &str, spec: &[&[&str]]) -> TensorSharding {
    let mesh = Mesh::parse(mesh, 8).expect("mesh");
    let dims = spec
        .iter()
        .map(|axes| axes.iter().map(|a| mesh.axis(a).expect("axis")).collect())
        .collect();
    TensorSharding {
        dims,
        partial: Vec::new(),
    }
}

fn ops(sg: &ShardedGraph) -> Vec<&'static str> {
    sg.graph.nodes.iter().map(|n| n.op.mnemonic()).collect()
}

fn node<'a>(sg: &'a ShardedGraph, name: &str) -> (&'a crate::ir::Node, &'a TensorSharding) {
    let v = sg
        .graph
        .ids()
        .find(|&v| sg.graph.node(v).name == name)
        .unwrap_or_else(|| panic!("no node `{name}`"));
    (sg.graph.node(v), &sg.shardings[v.index()])
}

#[test]
fn vocab_split_logits_are_never_gathered() {
    let mesh = "tp=2";
    let s = lowered(mesh, split(mesh, &[&[], &[], &["tp"]]));
    let m = &s.mesh;
    // Only the stats cross ranks, once for the loss and its gradient (they read the same
    // logits): [2, 4, 3] per rank gathered into [2, 4, 6].
    let gathers: Vec<_> = s
        .graph
        .nodes
        .iter()
        .filter(|n| n.op.is_collective())
        .collect();
    assert_eq!(gathers.len(), 1, "{:?}", ops(&s));
    let stats = ops(&s)
        .iter()
        .filter(|o| **o == "cross_entropy_stats")
        .count();
    assert_eq!(stats, 1, "{:?}", ops(&s));
    for n in &gathers {
        assert!(matches!(&n.op, Op::AllGather { axis, dim: 2, parts: 2 } if axis == "tp"));
        assert_eq!(n.ty.shape(), [2, 4, 6]);
        let src = s.graph.node(n.inputs[0]);
        assert!(matches!(&src.op, Op::CrossEntropyStats { axis, parts: 2 } if axis == "tp"));
    }
    assert!(!ops(&s).contains(&"cross_entropy") && !ops(&s).contains(&"cross_entropy_grad"));
    // The loss is whole on every rank (no partial sum over tp); the gradient stays split.
    let (loss, ls) = node(&s, "loss");
    assert!(matches!(loss.op, Op::CrossEntropyFromStats { denom: 6 }));
    assert!(ls.is_replicated(), "{}", ls.display(m));
    let (dx, ds) = node(&s, "dlogits");
    assert!(matches!(&dx.op, Op::CrossEntropyShardGrad { axis, denom: 6 } if axis == "tp"));
    assert_eq!(dx.ty.shape(), [2, 4, 4]);
    assert_eq!(ds.display(m), "[-,-,tp]");
    // Each gather says which op needed it.
    let why: Vec<_> = s
        .provenance
        .iter()
        .flatten()
        .map(|p| (p.value.as_str(), p.required_by.clone()))
        .collect();
    assert_eq!(
        why,
        [(
            "loss.stats",
            ReshardReason::Operand {
                node: "loss".into(),
                op: "cross_entropy_from_stats".into(),
                index: 0
            }
        ),]
    );
}

#[test]
fn batch_and_vocab_split_keeps_the_loss_partial_over_the_batch_axis_only() {
    let mesh = "dp=2,tp=2";
    let s = lowered(mesh, split(mesh, &[&["dp"], &[], &["tp"]]));
    let m = &s.mesh;
    let (_, ls) = node(&s, "loss");
    assert_eq!(ls.display(m), "[] partial(dp)");
    let (dx, ds) = node(&s, "dlogits");
    assert_eq!(dx.ty.shape(), [1, 4, 4]);
    assert_eq!(ds.display(m), "[dp,-,tp]");
    let collectives: Vec<_> = s
        .graph
        .nodes
        .iter()
        .filter(|n| n.op.is_collective())
        .map(|n| (n.op.mnemonic(), n.op.axis().unwrap_or(""), n.ty.shape()))
        .collect();
    // The stats gathered over tp (once, for the loss and its gradient); the replicated
    // `loss` output sums the batch halves.
    assert_eq!(
        collectives,
        [
            ("all_gather", "tp", vec![1, 4, 6]),
            ("all_reduce", "dp", vec![])
        ]
    );
}

#[test]
fn logits_not_split_along_the_vocabulary_one_way_are_gathered_as_before() {
    // Split over the batch only: nothing to gather, the plain ops.
    let mesh = "dp=2";
    let s = lowered(mesh, split(mesh, &[&["dp"], &[], &[]]));
    assert!(!ops(&s).contains(&"all_gather"), "{:?}", ops(&s));
    assert!(ops(&s).contains(&"cross_entropy") && ops(&s).contains(&"cross_entropy_grad"));
    // Split over an axis of one rank: nothing is split, the plain ops as before.
    let mesh = "tp=1";
    let s = lowered(mesh, split(mesh, &[&[], &[], &["tp"]]));
    assert!(ops(&s).contains(&"cross_entropy") && ops(&s).contains(&"cross_entropy_grad"));
    assert!(!ops(&s).contains(&"cross_entropy_stats"));
    // Split over two axes along the vocabulary: gathered, as the fixed factor wants.
    let mesh = "dp=2,tp=2";
    let s = lowered(mesh, split(mesh, &[&[], &[], &["dp", "tp"]]));
    assert!(ops(&s).contains(&"cross_entropy") && ops(&s).contains(&"cross_entropy_grad"));
    assert!(!ops(&s).contains(&"cross_entropy_stats"));
    let gathered =
        s.graph.nodes.iter().any(|n| {
            matches!(&n.op, Op::AllGather { dim: 2, .. }) && n.ty.shape() == [2, 4, 8 / 2]
        });
    assert!(gathered, "{:?}", ops(&s));
}
