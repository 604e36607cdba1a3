//! Context parallelism (`cp` mesh axis) on thread ranks reproduces transformers' logits for
//! every fixture, every exchange (all-gather K/V, Ulysses) and both sequence orders
//! (head-tail load balancing, contiguous), alone and composed with dp, tp and sp; sequence
//! lengths the order cannot split are refused naming the dimension.

mod common;

use common::compile_options as options;

use shardc::compiler::compile::{compile_forward, CompileError, CompileOptions};
use shardc::compiler::ir::Op;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::shard::{Mesh, ShardError};
use shardc::runtime::{execute, RankCtx, Tensor};

/// (mesh, strategies)
const MESHES: &[(&str, &[&str])] = &[
    ("cp=2", &[]),
    ("cp=4", &[]),
    ("cp=2", &["cp-contiguous"]),
    ("cp=4", &["cp-contiguous"]),
    ("cp=2", &["cp-ulysses"]),
    ("cp=2,tp=2", &[]),
    ("cp=2,tp=2", &["sp"]),
    ("cp=2,tp=2", &["sp", "cp-contiguous"]),
    ("cp=2,tp=2", &["cp-ulysses"]),
    ("dp=2,cp=2", &[]),
    ("dp=2,cp=2", &["cp-ulysses"]),
    ("cp=2", &["cp-allgather"]),
    ("cp=4", &["cp-allgather"]),
    ("cp=4", &["cp-allgather", "cp-contiguous"]),
    ("cp=2,tp=2", &["sp", "cp-allgather"]),
    ("dp=2,cp=2", &["cp-allgather"]),
];

#[test]
fn context_parallel_plans_reproduce_every_fixture() {
    let ran = common::check_every_case(
        MESHES,
        |cfg, case, &(mesh, extra)| {
            match compile_forward(cfg, &options(case.batch, case.seq, mesh, extra)) {
                Ok(c) => Some(c),
                // 37 tokens split over no cp axis; Ulysses needs heads divisible by tp·cp.
                Err(CompileError::Shard(ShardError::ModelIndivisible { .. }))
                    if case.seq % 2 == 1 =>
                {
                    None
                }
                Err(e) => panic!("{} {} {mesh} {extra:?}: {e}", case.model, case.name),
            }
        },
        |_| {},
    );
    // Every mesh divides the four 2 × 16 cases (one per model, a second for llama's left
    // padding); none divides 1 × 37 (refused naming `seq`, or `batch` for dp=2). Exact, so a
    // mesh that silently stops compiling fails here.
    assert_eq!(ran, 4 * MESHES.len(), "context-parallel runs");
}

/// The all-gather exchange gathers K and V (not Q, not the residual stream) once per layer,
/// over cp; Ulysses exchanges Q, K, V and the output by all-to-all instead; the ring passes
/// K/V round inside one op per layer.
#[test]
fn each_exchange_moves_what_it_promises() {
    let cfg = ModelConfig::from_path(&common::fixtures().join("llama")).unwrap();
    let count = |mesh: &str, extra: &[&str]| {
        let c = compile_forward(&cfg, &options(2, 16, mesh, extra)).unwrap();
        let g = &c.sharded.graph;
        let by = |m: &str| {
            g.nodes
                .iter()
                .filter(|n| n.op.mnemonic() == m && n.op.axis() == Some("cp"))
                .count()
        };
        (by("all_gather"), by("all_to_all"), by("ring_attention"))
    };
    let layers = cfg.layers;
    // K and V per layer, and the logits and hidden outputs gathered for the caller (token
    // inputs are whole on every rank, sliced locally: the key mask needs no gather).
    assert_eq!(count("cp=2", &["cp-allgather"]), (2 * layers + 2, 0, 0));
    assert_eq!(
        count("cp=2", &["cp-allgather", "cp-contiguous"]),
        (2 * layers + 2, 0, 0)
    );
    assert_eq!(count("cp=2", &["cp-ulysses"]), (2, 4 * layers, 0));
    // The ring (the default) passes K/V round instead of gathering them: one ring attention
    // per layer.
    assert_eq!(count("cp=4", &["cp-ring"]), (2, 0, layers));
    assert_eq!(count("cp=4", &[]), (2, 0, layers));
    assert_eq!(count("cp=2", &["cp-contiguous"]), (2, 0, layers));
}

/// The head-tail order permutes the token inputs on entry and the outputs on exit; attention
/// reads every query's and key's sequence index.
#[test]
fn head_tail_order_permutes_inputs_and_outputs() {
    let cfg = ModelConfig::from_path(&common::fixtures().join("llama")).unwrap();
    let c = compile_forward(&cfg, &options(2, 16, "cp=2", &[])).unwrap();
    let g = &c.logical;
    let permutes: Vec<(bool, &str)> = g
        .nodes
        .iter()
        .filter_map(|n| match n.op {
            Op::SeqPermute { inverse, .. } => Some((inverse, n.name.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(permutes.iter().filter(|p| !p.0).count(), 3, "{permutes:?}");
    assert_eq!(permutes.iter().filter(|p| p.0).count(), 2, "{permutes:?}");
    assert!(g
        .nodes
        .iter()
        .all(|n| !matches!(n.op, Op::Attention(s) if !s.indexed)));
    let c = compile_forward(&cfg, &options(2, 16, "cp=2", &["cp-contiguous"])).unwrap();
    assert!(!c
        .logical
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::SeqPermute { .. })));
}

fn refused(cfg: &ModelConfig, opts: CompileOptions, why: &str) -> String {
    match compile_forward(cfg, &opts) {
        Ok(_) => panic!("compiled, but {why}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn sequences_the_order_cannot_split_are_refused_by_name() {
    let cfg = ModelConfig::from_path(&common::fixtures().join("llama")).unwrap();
    let e = refused(
        &cfg,
        options(2, 12, "cp=4", &[]),
        "12 tokens do not split into 8 chunks",
    );
    assert!(
        e.contains("seq") && e.contains("cp=8") && e.contains("head-tail"),
        "{e}"
    );
    let e = refused(
        &cfg,
        options(2, 10, "cp=4", &["cp-contiguous"]),
        "10 tokens do not split over 4 ranks",
    );
    assert!(e.contains("seq=10") && e.contains("cp=4"), "{e}");
    // Ulysses splits heads: llama's 8 query heads do not split over 16 ranks.
    let e = refused(
        &cfg,
        options(2, 16, "cp=16", &["cp-ulysses"]),
        "8 heads over 16 ranks",
    );
    assert!(e.contains("heads") && e.contains("tp*cp=16"), "{e}");
    let e = refused(
        &cfg,
        options(2, 16, "cp=2", &["cp-ulysses", "cp-allgather"]),
        "two exchanges",
    );
    assert!(e.contains("conflict") && e.contains("--cp-algo"), "{e}");
}

mod train_support;

/// Training steps with context parallelism reproduce the fixtures' loss, gradients and AdamW
/// update (and the unsharded step's gradients within 1e-5), for every exchange and order,
/// composed with dp, tp and sp, with and without recomputation.
#[test]
fn context_parallel_training_steps_reproduce_the_fixtures() {
    use shardc::compiler::autodiff::Recompute;
    use train_support::{check, grad_diff, run};
    let cases: &[(&str, &[&str], Recompute)] = &[
        ("cp=2", &[], Recompute::None),
        ("cp=4", &[], Recompute::None),
        ("cp=2", &["cp-contiguous"], Recompute::None),
        ("cp=2", &["cp-ulysses"], Recompute::None),
        ("cp=2,tp=2", &["sp"], Recompute::None),
        ("cp=2,tp=2", &["cp-ulysses"], Recompute::None),
        ("dp=2,cp=2", &[], Recompute::None),
        ("dp=2,cp=2", &["zero3"], Recompute::None),
        // ZeRO shards over dp × cp, and over cp alone without dp.
        ("dp=2,cp=2", &["zero2"], Recompute::None),
        ("cp=2", &["zero1"], Recompute::None),
        ("cp=2", &[], Recompute::Full),
        ("cp=2", &[], Recompute::Selective),
        ("cp=2", &["cp-allgather"], Recompute::None),
        ("cp=4", &["cp-allgather"], Recompute::Selective),
        (
            "dp=2,cp=2",
            &["cp-allgather", "cp-contiguous"],
            Recompute::Full,
        ),
    ];
    for model in ["llama", "gpt2", "mixtral"] {
        let unsharded = run(model, "", &[], 1, Recompute::None, 1);
        for &(mesh, extra, rc) in cases {
            let what = format!("{mesh} {extra:?} recompute {rc}");
            let r = run(model, mesh, extra, 1, rc, 1);
            check(model, &what, &r);
            let d = grad_diff(&r, &unsharded);
            assert!(d < 1e-5, "{model} {what}: gradients differ by {d}");
        }
    }
}

/// A Mistral-style model (sliding window of 5, GQA) with random weights: context-parallel
/// forward logits and training steps equal the unsharded ones, for both orders and both
/// exchanges; the window follows the head-tail permutation.
#[test]
fn sliding_window_follows_the_sequence_order() {
    use shardc::compiler::autodiff::Recompute;
    use shardc::compiler::train::TrainOptions;
    use train_support::{check_against, random_model, run_pipeline_opts, token_batch};
    let tmp = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": 5, "hidden_act": "silu", "tie_word_embeddings": false
    });
    let (cfg, w) = random_model(tmp.path(), config, 16);
    assert_eq!(cfg.window, Some(5));
    let batch = token_batch(2, 16, cfg.vocab);
    let mut inputs = std::collections::BTreeMap::new();
    let bt = vec![2, 16];
    inputs.insert(
        "input_ids".into(),
        Tensor::i32(bt.clone(), batch.ids.clone()),
    );
    let pos = Tensor::i32(bt.clone(), batch.positions.clone());
    inputs.insert("position_ids".into(), pos);
    inputs.insert("attention_mask".into(), Tensor::f32(bt, batch.mask.clone()));
    let forward = |mesh: &str, extra: &[&str]| {
        let opts = options(2, 16, mesh, extra);
        let c = compile_forward(&cfg, &opts).unwrap();
        if opts.mesh.axes.is_empty() {
            let out = execute(&c.sharded.graph, &w, &inputs, &RankCtx::new()).unwrap();
            return out["logits"].as_f32().unwrap().to_vec();
        }
        let outs = common::run_ranks(&c.sharded, &w, &inputs, &opts.mesh.to_string());
        outs[0]["logits"].as_f32().unwrap().to_vec()
    };
    let base = forward("", &[]);
    for (mesh, extra) in [
        ("cp=2", &[][..]),
        ("cp=4", &[]),
        ("cp=4", &["cp-contiguous"]),
        ("cp=2", &["cp-ulysses"]),
        ("cp=2,tp=2", &["sp"]),
    ] {
        let d = common::max_abs_diff(&forward(mesh, extra), &base);
        assert!(d < 1e-4, "{mesh} {extra:?}: logits differ by {d}");
    }
    let unsharded = train_support::run_unsharded_on(tmp.path(), &batch);
    for (mesh, extra) in [("cp=2", &[][..]), ("cp=4", &[]), ("cp=2", &["cp-ulysses"])] {
        let mut o = TrainOptions::new(2, 16, Mesh::parse(mesh, 8).unwrap());
        o.extra_strategies = extra.iter().map(|s| s.to_string()).collect();
        o.recompute = Recompute::Selective;
        let r = train_support::run_opts_on(tmp.path(), &o, &batch);
        let what = format!("mistral {mesh} {extra:?}");
        check_against(&what, &r, &unsharded, tmp.path(), &o.adamw);
    }
    // Pipeline stages pass the permuted activations on: pp=2 with cp=2.
    let one_f_one_b = shardc::compiler::schedule::pp::ScheduleKind::OneFOneB;
    let mut o = train_support::pipe_options(
        &train_support::pipe("pp=2,cp=2", &[], 2, one_f_one_b),
        2,
        16,
    );
    o.recompute = Recompute::None;
    let r = run_pipeline_opts(tmp.path(), &o, &batch);
    check_against("mistral pp=2,cp=2", &r, &unsharded, tmp.path(), &o.adamw);
}

/// Pipeline stages with context parallelism reproduce the llama fixture.
#[test]
fn pipeline_stages_compose_with_context_parallelism() {
    use shardc::compiler::schedule::pp::ScheduleKind;
    use train_support::{check, fixture_batch, pipe, run_pipeline_on};
    let batch = fixture_batch("llama", 2);
    for (mesh, extra) in [("pp=2,cp=2", &[][..]), ("pp=2,cp=2", &["cp-ulysses"])] {
        let p = pipe(mesh, extra, 2, ScheduleKind::OneFOneB);
        let r = run_pipeline_on(&train_support::dir("llama"), &p, &batch);
        check("llama", &format!("{mesh} {extra:?}"), &r);
    }
}

/// Activation memory per rank, as the thread runtime measures it, divides by cp: a pipeline
/// stage's peak of a 2 × 128-token step (attention probabilities dominate) on pp=2 alone and
/// with cp=2 and cp=4, and the compiler's static account equals the measurement.
#[test]
fn activation_memory_per_rank_divides_by_cp() {
    use shardc::compiler::schedule::pp::ScheduleKind;
    use train_support::{deep_llama, pipe, run_pipeline_on, token_batch};
    let dir = deep_llama(4);
    let batch = token_batch(2, 128, 256);
    let peak = |mesh: &'static str| {
        let p = pipe(mesh, &[], 2, ScheduleKind::OneFOneB);
        let r = run_pipeline_on(&dir, &p, &batch);
        train_support::check_activation_peaks(mesh, &r);
        *r.peak_bytes.iter().max().unwrap() as f64
    };
    let one = peak("pp=2");
    let two = peak("pp=2,cp=2") / one;
    let four = peak("pp=2,cp=4") / one;
    eprintln!("activation peak per rank: cp=2 {two:.3}, cp=4 {four:.3} of cp=1 ({one} bytes)");
    assert!((0.45..0.6).contains(&two), "cp=2 holds {two:.3} of cp=1");
    assert!((0.22..0.35).contains(&four), "cp=4 holds {four:.3} of cp=1");
}

/// Traffic per layer per rank equals ANCHORS' formulas (C.2): all-gather K/V sends
/// (N−1)/N · V_KV forward (V_KV = 2·b·s·h_kv·e), and backward gathers K/V again and
/// reduce-scatters dK/dV (twice that); Ulysses sends (N−1)/N · b·(s/N)·(2h + 2h_kv)·e
/// forward, and backward exchanges the saved q, k, v and output again before the gradients
/// (twice that); the ring sends (N−1)/N · V_KV round inside its op, and its backward K once
/// more, then K, V and their dK/dV accumulators (2.5 times that). Activations are saved
/// split, as Megatron saves K/V: memory ÷cp.
#[test]
fn traffic_per_layer_matches_the_formulas() {
    use shardc::compiler::autodiff::Recompute;
    use shardc::compiler::ir::ValueRole;
    let cfg = ModelConfig::from_path(&common::fixtures().join("llama")).unwrap();
    let (b, s) = (2usize, 16usize);
    let e = 4.0; // the CPU plan's f32 bytes
    let h = (cfg.heads * cfg.head_dim) as f64;
    let h_kv = (cfg.kv_heads * cfg.head_dim) as f64;
    for n in [2usize, 4] {
        let nf = n as f64;
        let v_kv = 2.0 * (b * s) as f64 * h_kv * e;
        let ulysses = (nf - 1.0) / nf * (b * s) as f64 / nf * (2.0 * h + 2.0 * h_kv) * e;
        for (extra, fwd_want, bwd_want) in [
            // Backward: K and V gathered again (kept split, as Megatron keeps them) and
            // dK, dV reduce-scattered.
            (
                &["cp-allgather"][..],
                (nf - 1.0) / nf * v_kv,
                2.0 * (nf - 1.0) / nf * v_kv,
            ),
            // Backward: the saved q, k, v and output exchanged again, then the gradients.
            (&["cp-ulysses"][..], ulysses, 2.0 * ulysses),
            // The ring sends its blocks round (N−1 steps of V_KV/N, inside the op); with
            // selective recomputation nothing else gathers K/V in the forward. Its backward
            // goes round twice: K for the softmax statistics, then K, V and their dK/dV
            // accumulators (counted as the all-gather and reduce-scatter they replace).
            (
                &["cp-ring"][..],
                (nf - 1.0) / nf * v_kv,
                2.5 * (nf - 1.0) / nf * v_kv,
            ),
        ] {
            if n == 4 && extra.contains(&"cp-ulysses") {
                continue; // 2 KV heads: Ulysses replicates them at cp=4
            }
            let mut o = shardc::compiler::train::TrainOptions::new(
                b,
                s,
                Mesh::parse(&format!("cp={n}"), 8).unwrap(),
            );
            o.extra_strategies = extra.iter().map(|x| x.to_string()).collect();
            o.recompute = if extra.contains(&"cp-ring") {
                Recompute::Selective
            } else {
                Recompute::None
            };
            let c = shardc::compiler::train::compile_train(&cfg, &o).unwrap();
            let g = &c.sharded.graph;
            // Bytes each rank sends: (N−1)/N of the larger side of the collective.
            let (mut fwd, mut bwd) = (0.0, 0.0);
            for v in g.ids() {
                let node = g.node(v);
                // The attention exchange (the parameter gradients' all-reduce over cp is the
                // data-parallel-like sync, not the attention's traffic).
                let exchange = matches!(
                    node.op,
                    Op::AllGather { .. }
                        | Op::ReduceScatter { .. }
                        | Op::AllToAll { .. }
                        | Op::RingAttention { .. }
                        | Op::RingAttentionGrad { .. }
                );
                if node.layer != Some(0) || node.op.axis() != Some("cp") || !exchange {
                    continue;
                }
                let local = match node.op {
                    // The K and V blocks of every rank pass through.
                    Op::RingAttention { parts, .. } => {
                        (g.ty(node.inputs[1]).numel() + g.ty(node.inputs[2]).numel()) as f64
                            * (parts as f64)
                            * e
                    }
                    Op::RingAttentionGrad { parts, .. } => {
                        (3 * g.ty(node.inputs[1]).numel() + 2 * g.ty(node.inputs[2]).numel()) as f64
                            * (parts as f64)
                            * e
                    }
                    _ => g.ty(node.inputs[0]).numel().max(node.ty.numel()) as f64 * e,
                };
                let sent = (nf - 1.0) / nf * local;
                match node.role {
                    ValueRole::Forward => fwd += sent,
                    _ => bwd += sent,
                }
            }
            let what = format!("cp={n} {extra:?}");
            assert!(
                (fwd - fwd_want).abs() < 1e-6,
                "{what}: forward {fwd} vs {fwd_want}"
            );
            assert!(
                (bwd - bwd_want).abs() < 1e-6,
                "{what}: backward {bwd} vs {bwd_want}"
            );
        }
    }
}

/// ZeRO shards the optimizer state over dp × cp (Megatron's distributed optimizer): on
/// `dp=2,cp=2` every moment a rank holds is a quarter of its parameter, on `cp=2` alone a half.
#[test]
fn zero_shards_the_optimizer_state_over_dp_and_cp() {
    use shardc::compiler::autodiff::Recompute;
    use train_support::run;
    for (mesh, parts) in [("dp=2,cp=2", 4), ("cp=2", 2)] {
        let r = run("llama", mesh, &["zero1"], 1, Recompute::None, 1);
        let g = &r.compiled.sharded.graph;
        let mut checked = 0;
        for p in &r.compiled.train.params {
            let m = g
                .input_named(&format!("adam_m.{}", p.label))
                .unwrap_or_else(|| panic!("{mesh}: no first moment of `{}`", p.label));
            if p.ty.numel() % parts == 0 {
                assert_eq!(
                    g.ty(m).numel() * parts,
                    p.ty.numel(),
                    "{mesh}: `{}`'s first moment",
                    p.label
                );
                checked += 1;
            }
        }
        assert!(checked > 10, "{mesh}: {checked} moments checked");
    }
}
