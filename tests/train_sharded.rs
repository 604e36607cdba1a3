//! Sharded training steps on thread ranks reproduce the hf-tiny training references (loss,
//! every gradient, the AdamW update per the fixtures' README) for every required mesh and
//! strategy: data parallel (DDP buckets), tensor parallel, sequence parallel on a 2-D mesh,
//! ZeRO stages 1–3 (and fsdp), expert parallel, with gradient accumulation and recomputation.
//! Meshes with 4 data-parallel ranks run the fixture batch with every sequence twice (same
//! mean loss and gradients, a batch of 4).

mod train_support;

use shardc::compiler::autodiff::Recompute;
use shardc::compiler::ir::{Op, ValueRole};
use train_support::{check, grad_diff, run};

/// (mesh, strategies, micro-batches, recompute, times each sequence is repeated)
type Case = (
    &'static str,
    &'static [&'static str],
    usize,
    Recompute,
    usize,
);

const CASES: &[Case] = &[
    ("dp=2", &[], 1, Recompute::None, 1),
    ("dp=4", &[], 1, Recompute::None, 2),
    ("tp=2", &[], 1, Recompute::None, 1),
    // Llama has 2 KV heads: tp=4 replicates them (`Repeat`), exercising its gradient.
    ("tp=4", &[], 1, Recompute::None, 1),
    ("dp=2,tp=2", &["sp"], 1, Recompute::None, 1),
    ("dp=2", &["zero1"], 1, Recompute::None, 1),
    ("dp=2", &["zero2"], 1, Recompute::None, 1),
    ("dp=2", &["zero3"], 1, Recompute::None, 1),
    ("dp=4", &["zero1"], 1, Recompute::None, 2),
    ("dp=4", &["zero2"], 1, Recompute::None, 2),
    ("dp=4", &["zero3"], 1, Recompute::None, 2),
    ("dp=2", &["fsdp"], 1, Recompute::None, 1),
    ("dp=2", &[], 2, Recompute::None, 2),
    ("dp=2", &["zero2"], 2, Recompute::None, 2),
    ("dp=2,tp=2", &["sp", "zero3"], 1, Recompute::None, 1),
    ("dp=2,tp=2", &["sp"], 1, Recompute::Full, 1),
    ("dp=2,tp=2", &["sp"], 1, Recompute::Selective, 1),
    ("dp=2", &["zero3"], 1, Recompute::Full, 1),
];

fn run_cases(model: &str, cases: &[Case]) {
    let unsharded = run(model, "", &[], 1, Recompute::None, 1);
    for &(mesh, extra, mb, rc, dup) in cases {
        let what = format!("{mesh} {extra:?} micro-batches {mb} recompute {rc}");
        let r = run(model, mesh, extra, mb, rc, dup);
        check(model, &what, &r);
        let d = grad_diff(&r, &unsharded);
        assert!(
            d < 1e-5,
            "{model} {what}: gradients differ from the unsharded step by {d}"
        );
    }
}

#[test]
fn llama_sharded_steps_reproduce_the_fixture() {
    run_cases("llama", CASES);
    let r = run("llama", "tp=4", &[], 1, Recompute::None, 1);
    let g = &r.compiled.sharded.graph;
    assert!(g
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::RepeatGrad { .. })));
}

#[test]
fn gpt2_sharded_steps_reproduce_the_fixture() {
    run_cases("gpt2", CASES);
}

#[test]
fn mixtral_sharded_steps_reproduce_the_fixture() {
    let mut cases = CASES.to_vec();
    cases.extend_from_slice(&[
        ("ep=2", &[], 1, Recompute::None, 1),
        ("ep=2,tp=2", &[], 1, Recompute::None, 1),
        ("ep=4", &[], 1, Recompute::None, 2),
        ("dp=2,ep=2", &[], 1, Recompute::Selective, 2),
    ]);
    run_cases("mixtral", &cases);
}

#[test]
fn data_parallel_reduces_gradients_in_ddp_buckets() {
    let r = run("llama", "dp=2", &[], 1, Recompute::None, 1);
    let c = &r.compiled;
    // The tiny model fits DDP's first (1 MiB) bucket: one all-reduce, after the last gradient.
    assert_eq!(c.buckets.len(), 1);
    let g = &c.sharded.graph;
    let ars: Vec<_> = g
        .ids()
        .filter(|&v| matches!(g.node(v).op, Op::AllReduce { .. }))
        .collect();
    assert_eq!(ars.len(), 1, "one bucket all-reduce");
    let bucket = &c.buckets[0];
    assert_eq!(bucket.params.len(), c.train.params.len());
    // Reverse parameter order: lm_head first.
    assert_eq!(bucket.params[0], "lm_head");
    // Issued right after the last gradient is complete, before any optimizer op.
    let first_opt = g
        .ids()
        .find(|&v| {
            let n = g.node(v);
            !matches!(n.op, Op::Input { .. })
                && matches!(
                    n.role,
                    ValueRole::FirstMoment | ValueRole::SecondMoment | ValueRole::Update
                )
        })
        .unwrap();
    assert!(ars[0] < first_opt);
}

#[test]
fn zero_stages_shard_what_they_promise() {
    let count = |r: &train_support::Run, f: &dyn Fn(&Op) -> bool| {
        let g = &r.compiled.sharded.graph;
        g.nodes.iter().filter(|n| f(&n.op)).count()
    };
    let ag = |op: &Op| matches!(op, Op::AllGather { axis, .. } if axis == "dp");
    let rs = |op: &Op| matches!(op, Op::ReduceScatter { axis, .. } if axis == "dp");
    let ar = |op: &Op| matches!(op, Op::AllReduce { axis } if axis == "dp");
    let model = "llama";
    let n = run(model, "", &[], 1, Recompute::None, 1)
        .compiled
        .train
        .params
        .len();
    for (zero, gathers) in [("zero1", n), ("zero2", n), ("zero3", 2 * n)] {
        let r = run(model, "dp=2", &[zero], 1, Recompute::None, 1);
        assert_eq!(count(&r, &ag), gathers, "{zero}: parameter all-gathers");
        assert_eq!(count(&r, &rs), n, "{zero}: gradient reduce-scatters");
        assert_eq!(count(&r, &ar), 0, "{zero}: no all-reduce");
    }
}

/// Megatron's layout in training too: with tp and sp, parameters keep their tensor-parallel
/// shards (no all-gather of a weight over tp, no all-to-all of activations), and every layer's
/// forward has exactly 2 reduce-scatters and 2 all-gathers on tp (the backward mirrors them).
#[test]
fn sequence_parallel_training_keeps_weights_sharded() {
    for (mesh, extra) in [("tp=2", &["sp"][..]), ("dp=2,tp=2", &["sp", "zero1"][..])] {
        let r = run("llama", mesh, extra, 1, Recompute::None, 1);
        let g = &r.compiled.sharded.graph;
        let param_input = |v: shardc::compiler::ir::ValueId| {
            let mut v = v;
            loop {
                match &g.node(v).op {
                    Op::Input { .. } => return g.node(v).role == ValueRole::Parameter,
                    Op::Reshape => v = g.node(v).inputs[0],
                    _ => return false,
                }
            }
        };
        for v in g.ids() {
            let n = g.node(v);
            assert!(
                !matches!(n.op, Op::AllToAll { .. }),
                "{mesh}: all-to-all `{}`",
                n.name
            );
            if let Op::AllGather { axis, .. } = &n.op {
                assert!(
                    !(axis == "tp" && param_input(n.inputs[0])),
                    "{mesh}: weight all-gathered over tp: `{}`",
                    n.name
                );
            }
        }
        // Layer 0: the forward's 2 reduce-scatters and 2 all-gathers on tp; the backward's
        // 2 all-gathers of the incoming gradient, 2 reduce-scatters, and 2 re-gathers of the
        // sharded norm outputs for the weight gradients (Megatron-LM's sequence parallelism).
        let count = |backward: bool, rs: bool| {
            g.ids()
                .filter(|&v| {
                    let n = g.node(v);
                    let bwd = matches!(n.role, ValueRole::Backward | ValueRole::Saved);
                    let kind = match &n.op {
                        Op::ReduceScatter { axis, .. } => axis == "tp" && rs,
                        Op::AllGather { axis, .. } => axis == "tp" && !rs,
                        _ => false,
                    };
                    n.layer == Some(0) && bwd == backward && kind
                })
                .count()
        };
        assert_eq!(
            (count(false, true), count(false, false)),
            (2, 2),
            "{mesh}: forward"
        );
        assert_eq!(
            (count(true, true), count(true, false)),
            (2, 4),
            "{mesh}: backward"
        );
        check("llama", &format!("{mesh} {extra:?}"), &r);
    }
}

/// Megatron's vocabulary-parallel cross-entropy: with the logits split over `tp` along the
/// vocabulary, the step (plain and rewritten) gathers only each row's stats (3 floats per row
/// and rank), never a logits-sized tensor, the gradient wrt the logits comes out split like
/// the logits, and loss and gradients still reproduce the fixture.
#[test]
fn vocab_parallel_loss_gathers_stats_not_logits() {
    use shardc::compiler::ir::Role;
    use shardc::compiler::model::ModelConfig;
    use shardc::compiler::rewrite::RewriteOptions;
    let model = "llama";
    let vocab = ModelConfig::from_path(&train_support::dir(model))
        .unwrap()
        .vocab;
    let fixture = train_support::reference(model);
    let unsharded = run(model, "", &[], 1, Recompute::None, 1);
    let cases: &[(&str, &[&str], &str)] = &[
        ("tp=2", &[], "none"),
        ("tp=4", &[], "none"),
        ("dp=2,tp=2", &["sp"], "none"),
        ("tp=2", &[], "all"),
    ];
    for &(mesh, extra, rules) in cases {
        let what = format!("{mesh} {extra:?} --rewrite {rules}");
        let r = train_support::run_with(model, mesh, extra, 1, Recompute::None, 1, |o| {
            o.rewrite = RewriteOptions::with_rules(rules.parse().expect("rules"));
        });
        check(model, &what, &r);
        let d = grad_diff(&r, &unsharded);
        assert!(d < 1e-5, "{what}: gradients differ by {d}");
        let s = &r.compiled.sharded;
        let (g, mesh_) = (&s.graph, &s.mesh);
        let tp = mesh_.axis("tp").unwrap();
        let parts = mesh_.axis_size(tp);
        let dp = mesh_.axis("dp").map_or(1, |a| mesh_.axis_size(a));
        // The logits of this rank's rows, whole: what gathering them would move.
        let logits_bytes = fixture.batch / dp * fixture.seq * vocab * 4;
        let (mut stats, mut grads) = (0, 0);
        for v in g.ids() {
            let n = g.node(v);
            match &n.op {
                Op::AllGather { dim, .. }
                | Op::AllToAll {
                    concat_dim: dim, ..
                } => {
                    let src = g.ty(n.inputs[0]);
                    assert!(
                        src.dims[*dim].role != Role::Vocab,
                        "{what}: `{}` gathers {src} along the vocabulary",
                        n.name
                    );
                    assert_ne!(n.ty.size_bytes(), logits_bytes, "{what}: `{}`", n.name);
                }
                Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => {
                    panic!("{what}: `{}` is not vocabulary-parallel", n.name)
                }
                Op::CrossEntropyStats { parts: p, .. } => {
                    assert_eq!(*p, parts);
                    stats += 1;
                }
                Op::CrossEntropyShardGrad { .. } => {
                    assert_eq!(s.shardings[v.index()].dims.last(), Some(&vec![tp]));
                    assert_eq!(n.ty.last(), vocab / parts, "{what}");
                    grads += 1;
                }
                _ => {}
            }
        }
        // One set of stats, shared by the loss and its gradient (the backward pass reads the
        // saved view of the same logits).
        assert_eq!((stats, grads), (1, 1), "{what}");
    }
}
