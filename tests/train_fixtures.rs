//! One `shardc train` step, unsharded, reproduces transformers' training references
//! (`tests/fixtures/hf-tiny/*/train_b2_s16.*`): loss, every gradient, and the AdamW update as
//! the fixtures' README prescribes — with and without activation recomputation, and with
//! gradient accumulation over two micro-batches.

mod train_support;

use shardc::compiler::autodiff::Recompute;
use shardc::compiler::ir::{Graph, Node, Op, ValueRole};
use train_support::{check, grad_diff, run, Run};

const MODELS: [&str; 3] = ["llama", "gpt2", "mixtral"];

/// The names of `g`'s nodes that `keep` accepts, in graph order.
fn names_where(g: &Graph, keep: impl Fn(&Node) -> bool) -> Vec<&str> {
    g.nodes
        .iter()
        .filter(|n| keep(n))
        .map(|n| n.name.as_str())
        .collect()
}

/// The names of the values `r`'s step recomputes.
fn recomputed_names(r: &Run) -> Vec<&str> {
    names_where(&r.compiled.sharded.graph, |n| {
        n.role == ValueRole::Recompute
    })
}

/// The attention layers of `r`'s forward pass.
fn attention_layers(r: &Run) -> usize {
    r.compiled
        .forward
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Attention(_)))
        .count()
}

#[test]
fn one_step_reproduces_every_fixture() {
    for model in MODELS {
        let r = run(model, "", &[], 1, Recompute::None, 1);
        check(model, "unsharded", &r);
    }
}

#[test]
fn recomputation_changes_the_graph_not_the_numbers() {
    for model in MODELS {
        let none = run(model, "", &[], 1, Recompute::None, 1);
        let g = &none.compiled.sharded.graph;
        let probs = names_where(g, |n| matches!(n.op, Op::AttentionProbs(_)));
        // No recomputation: the probabilities are computed in the forward pass and saved.
        assert!(!probs.is_empty() && probs.iter().all(|n| n.ends_with(".attn.sdpa.probs")));
        assert!(g.nodes.iter().all(|n| n.role != ValueRole::Recompute));
        for rc in [Recompute::Full, Recompute::Selective] {
            let other = run(model, "", &[], 1, rc, 1);
            check(model, rc.name(), &other);
            // Deterministic kernels: recomputed values are bit-identical.
            assert_eq!(grad_diff(&none, &other), 0.0, "{model} {rc}");
            assert_eq!(none.loss, other.loss);
            let g = &other.compiled.sharded.graph;
            let recomputed = recomputed_names(&other);
            match rc {
                // Only the attention probabilities, once per layer.
                Recompute::Selective => {
                    let layers = attention_layers(&none);
                    assert_eq!(recomputed.len(), layers, "{model}: {recomputed:?}");
                    assert!(recomputed.iter().all(|n| n.ends_with(".attn.sdpa.probs")));
                }
                // Every layer's forward ops (norms, projections, attention, MLP) again.
                _ => {
                    for want in [
                        "attn_norm",
                        "attn.q_proj",
                        "attn.sdpa",
                        "mlp_norm",
                        "residual",
                    ] {
                        assert!(
                            recomputed
                                .iter()
                                .any(|n| n.starts_with("recompute.layers.0.") && n.contains(want)),
                            "{model}: no recomputed {want} in {recomputed:?}"
                        );
                    }
                    // Only layer inputs are saved from the layers' forward.
                    for n in g.nodes.iter().filter(|n| {
                        n.role == ValueRole::Saved
                            && g.node(n.inputs[0]).name.starts_with("layers.")
                    }) {
                        assert!(
                            n.name.ends_with(".residual"),
                            "{model}: {} saved under full recompute",
                            n.name
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn two_micro_batches_accumulate_the_same_gradients() {
    for model in MODELS {
        let r = run(model, "", &[], 2, Recompute::None, 1);
        check(model, "2 micro-batches", &r);
        // One program per micro-batch, run twice: its size does not depend on the count.
        let split = r
            .compiled
            .split
            .as_ref()
            .expect("a step without a pipeline is split");
        assert!(split.micro.graph.input_named("input_ids").is_some());
        assert!(split.micro.graph.input_named("input_ids.mb1").is_none());
        assert_eq!(r.compiled.options.micro_batches, 2);
    }
}

/// Block recomputation (`--recompute-num-layers 1`): the first layer recomputed fully, the
/// others under the given mode; the numbers are those of no recomputation, bit for bit. On a
/// pipeline, each chunk's first layer.
#[test]
fn block_recomputation_recomputes_the_first_layers_only() {
    for model in MODELS {
        let none = run(model, "", &[], 1, Recompute::None, 1);
        for base in [Recompute::None, Recompute::Selective] {
            let r = train_support::run_with(model, "", &[], 1, base, 1, |o| {
                o.recompute_layers = Some(1)
            });
            check(model, &format!("block 1 + {base}"), &r);
            assert_eq!(grad_diff(&none, &r), 0.0, "{model} block 1 + {base}");
            let g = &r.compiled.sharded.graph;
            let recomputed = recomputed_names(&r);
            // Layer 0 whole; later layers only their attention probabilities (selective).
            assert!(
                recomputed
                    .iter()
                    .any(|n| n.starts_with("recompute.layers.0.") && n.contains("mlp")),
                "{model}: {recomputed:?}"
            );
            for n in &recomputed {
                let first = n.starts_with("recompute.layers.0.");
                let probs = n.ends_with(".attn.sdpa.probs");
                assert!(
                    first || (base == Recompute::Selective && probs),
                    "{model} {base}: {n}"
                );
            }
            // Layers after the first keep their probabilities under no recomputation.
            let saved_probs = g
                .nodes
                .iter()
                .filter(|n| matches!(n.op, Op::AttentionProbs(_)) && n.role != ValueRole::Recompute)
                .count();
            let layers = attention_layers(&none);
            let want = if base == Recompute::None {
                layers - 1
            } else {
                0
            };
            assert_eq!(saved_probs, want, "{model} {base}");
        }
    }
    // A pipeline of two stages: each chunk's first layer recomputed, the step unchanged.
    let dir = train_support::dir("llama");
    let batch = train_support::fixture_batch("llama", 4);
    let p = train_support::pipe(
        "pp=2",
        &[],
        2,
        shardc::compiler::schedule::pp::ScheduleKind::OneFOneB,
    );
    let mut o = train_support::pipe_options(&p, batch.batch, batch.seq);
    o.recompute_layers = Some(1);
    let r = train_support::run_pipeline_opts(&dir, &o, &batch);
    check("llama", "pp=2 block 1", &r);
    let mut firsts = std::collections::BTreeSet::new();
    for chunk in &r.compiled.chunks {
        for n in chunk
            .train
            .sharded
            .graph
            .nodes
            .iter()
            .filter(|n| n.role == ValueRole::Recompute)
        {
            firsts.insert(n.layer);
        }
    }
    assert_eq!(
        firsts.len(),
        2,
        "one recomputed layer per chunk: {firsts:?}"
    );
}
