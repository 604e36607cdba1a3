//! Structure of training graphs (their numerics are checked end to end against the hf-tiny
//! training references in `tests/train_*.rs`).

use super::*;
use crate::ir::{DType, Graph, Op, TensorType, ValueRole};
use crate::model::{build_forward, BuildOptions, ModelConfig};
use std::path::PathBuf;

fn fixture(model: &str) -> ModelConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-tiny");
    ModelConfig::from_path(&root.join(model)).unwrap()
}

fn opts(micro_batches: usize, recompute: Recompute) -> TrainGraphOptions {
    TrainGraphOptions {
        micro_batches,
        denom: 30,
        recompute,
        ..TrainGraphOptions::default()
    }
}

#[test]
fn training_graphs_verify_and_round_trip() {
    for model in ["llama", "gpt2", "mixtral"] {
        let fwd = build_forward(&fixture(model), BuildOptions::new(2, 8)).unwrap();
        for rc in Recompute::ALL {
            for k in [1, 2] {
                let tg = build_train_graph(&fwd, &opts(k, rc)).unwrap();
                crate::ir::verify(&tg.graph).unwrap();
                let text = tg.graph.to_string();
                let back: Graph = text.parse().unwrap();
                assert_eq!(back, tg.graph, "{model} {rc} {k}");
                // Every parameter: an input, a gradient, an update, two moments.
                for p in &tg.params {
                    for out in [
                        ValueRole::Gradient,
                        ValueRole::Update,
                        ValueRole::FirstMoment,
                        ValueRole::SecondMoment,
                    ] {
                        assert!(tg.graph.output(&out.name(&p.label)).is_some());
                    }
                    assert_eq!(p.mb_grads.len(), k);
                    let grad = tg.graph.node(p.grad);
                    assert_eq!(grad.name, ValueRole::Gradient.name(&p.label));
                    assert_eq!(grad.role, ValueRole::Gradient);
                }
                // No node reads a forward parameter any more.
                assert!(tg.graph.nodes.iter().all(|n| !matches!(n.op, Op::Param(_))));
            }
        }
    }
}

#[test]
fn backward_reads_forward_values_only_through_saved_nodes() {
    let fwd = build_forward(&fixture("llama"), BuildOptions::new(2, 8)).unwrap();
    let tg = build_train_graph(&fwd, &opts(1, Recompute::None)).unwrap();
    let g = &tg.graph;
    let forward: Vec<bool> = g
        .ids()
        .map(|v| {
            let n = g.node(v);
            let probs = matches!(n.op, Op::AttentionProbs(_)) && n.role != ValueRole::Recompute;
            tg.fwd_maps[0].contains(&Some(v)) || probs
        })
        .collect();
    for v in g.ids() {
        let n = g.node(v);
        let backward = matches!(n.role, ValueRole::Backward | ValueRole::Gradient);
        if !backward {
            continue;
        }
        for &i in &n.inputs {
            let ni = g.node(i);
            assert!(
                !forward[i.index()] || matches!(ni.op, Op::Input { .. }),
                "`{}` reads forward value `{}` directly",
                n.name,
                ni.name
            );
        }
    }
}

#[test]
fn gather_params_reads_each_parameter_once_per_pass() {
    let fwd = build_forward(&fixture("gpt2"), BuildOptions::new(2, 8)).unwrap();
    let o = TrainGraphOptions {
        gather_params: true,
        sync_grads: true,
        ..opts(2, Recompute::Full)
    };
    let tg = build_train_graph(&fwd, &o).unwrap();
    // Two micro-batches × (forward, backward) per parameter, the tied embedding included.
    assert_eq!(tg.gathers.len(), 4 * tg.params.len());
    for (p, tp) in tg.params.iter().enumerate() {
        let readers: Vec<_> = tg
            .graph
            .ids()
            .filter(|&v| tg.graph.node(v).inputs.contains(&tp.input))
            .collect();
        // The four gathers and the optimizer update.
        assert_eq!(readers.len(), 5, "parameter {p}");
        assert!(matches!(tg.graph.node(tp.mb_grads[0]).op, Op::Reshape));
    }
}

#[test]
fn an_op_without_gradient_rule_is_an_error() {
    let mut g = Graph::new();
    let x = g.input("input_ids", TensorType::plain(DType::I32, &[1, 2]));
    let _ = x;
    let src = crate::ir::ParamSource::whole("w");
    let w = g
        .add_typed(
            Op::Param(src),
            &[],
            Some(TensorType::plain(DType::F32, &[1, 2, 3])),
            "w",
        )
        .unwrap();
    let s = g.add(Op::Softmax, &[w], "probs").unwrap();
    g.set_output("logits", s);
    let err = build_train_graph(&g, &opts(1, Recompute::None)).unwrap_err();
    assert!(
        matches!(&err, AutodiffError::NoGradient { op: "softmax", node, .. } if node == "probs"),
        "{err}"
    );
}
