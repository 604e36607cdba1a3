//! CUDA graph replay (`CudaOptions::graphs`) against eager launches, bit for bit: the fixture
//! models, f32 and bf16, fused, with the inputs of the capture and with new inputs written into
//! the same buffers. The refusal of programs that communicate is checked without a GPU.
//!
//! GPU tests: `cargo test -p shardc-runtime --test cuda_graphs -- --include-ignored`.

mod cuda_common;

use cuda_common::*;
use shardc_compiler::ir::{DType, Float, Graph, Op, TensorType, UnaryOp};
use shardc_compiler::model::{build_forward, BuildOptions};
use shardc_runtime::cuda::{graph_blocker, CudaOptions, CudaRankCtx, GpuDType};
use shardc_runtime::Tensor;
use std::collections::BTreeMap;

/// Bit patterns of every output (f32 values as bits, so NaN == NaN and -0 != 0).
fn bits(out: &BTreeMap<String, Tensor>) -> BTreeMap<String, Vec<u32>> {
    out.iter()
        .map(|(k, t)| {
            let b = match (t.as_f32(), t.as_i32()) {
                (Some(v), _) => v.iter().map(|x| x.to_bits()).collect(),
                (None, Some(v)) => v.iter().map(|&x| x as u32).collect(),
                (None, None) => panic!("output `{k}` is neither f32 nor i32"),
            };
            (k.clone(), b)
        })
        .collect()
}

/// `inputs` with every token id moved to the next id of the vocabulary.
fn other_tokens(inputs: &BTreeMap<String, Tensor>, vocab: usize) -> BTreeMap<String, Tensor> {
    let mut out = inputs.clone();
    let ids = out.get_mut("input_ids").expect("the cases have input_ids");
    let v: Vec<i32> = ids
        .as_i32()
        .expect("i32 ids")
        .iter()
        .map(|&x| (x + 1) % vocab as i32)
        .collect();
    *ids = Tensor::i32(ids.shape.clone(), v);
    out
}

#[test]
#[ignore = "needs a GPU"]
fn graph_replay_matches_eager_bit_for_bit() {
    let dev = device();
    let mut checked = 0;
    for case in cases() {
        let (cfg, w) = case.load();
        let g = build_forward(&cfg, BuildOptions::new(case.batch, case.seq)).expect("graph");
        assert!(
            graph_blocker(&g).is_none(),
            "an unsharded forward communicates"
        );
        let next = other_tokens(&case.inputs, cfg.vocab);
        for dt in [GpuDType::F32, GpuDType::Bf16] {
            let what = format!("{} {} {}", case.model, case.name, dt.name());
            let ctx = CudaRankCtx::new();
            let mut eager = prepare(&dev, &g, &w, &ctx, opts(dt, true)).expect("prepare eager");
            let want = bits(&eager.run(&case.inputs, &ctx).expect("eager run"));
            let want_next = bits(&eager.run(&next, &ctx).expect("eager run, other tokens"));
            assert_ne!(
                want, want_next,
                "{what}: the other tokens change the logits"
            );

            let graph_opts = CudaOptions {
                graphs: true,
                ..opts(dt, true)
            };
            let mut p = prepare(&dev, &g, &w, &ctx, graph_opts).expect("prepare graph mode");
            // Run 1 is eager, run 2 captures and launches the graph, run 3 replays it.
            for run in 1..=3 {
                let got = bits(&p.run(&case.inputs, &ctx).expect("graph-mode run"));
                assert_eq!(got, want, "{what}: graph-mode run {run} differs from eager");
                assert_eq!(p.has_graph(), run >= 2, "{what}: captured after run {run}");
            }
            // New values in the same buffers: the replay reads them.
            let got = bits(&p.run(&next, &ctx).expect("graph replay, other tokens"));
            assert!(p.has_graph(), "{what}: the input buffers were reused");
            assert_eq!(got, want_next, "{what}: replay with other tokens differs");
            // And back: nothing of the previous replay leaks.
            let got = bits(&p.run(&case.inputs, &ctx).expect("graph replay"));
            assert_eq!(got, want, "{what}: replay after other tokens differs");
            checked += 1;
        }
    }
    assert_eq!(checked, 2 * 7, "fixture cases × f32/bf16");
}

#[test]
#[ignore = "needs a GPU"]
fn graph_replay_checks_token_ids_on_the_host() {
    let dev = device();
    let case = cases().into_iter().next().expect("a fixture case");
    let (cfg, w) = case.load();
    let g = build_forward(&cfg, BuildOptions::new(case.batch, case.seq)).expect("graph");
    let ctx = CudaRankCtx::new();
    let graph_opts = CudaOptions {
        graphs: true,
        ..opts(GpuDType::F32, true)
    };
    let mut p = prepare(&dev, &g, &w, &ctx, graph_opts).expect("prepare graph mode");
    for _ in 0..2 {
        p.run(&case.inputs, &ctx).expect("graph-mode run");
    }
    assert!(p.has_graph());
    let mut bad = case.inputs.clone();
    let ids = bad.get_mut("input_ids").expect("input_ids");
    let mut v = ids.as_i32().expect("i32").to_vec();
    v[0] = cfg.vocab as i32;
    *ids = Tensor::i32(ids.shape.clone(), v);
    let err = p.run(&bad, &ctx).expect_err("an id past the vocabulary");
    assert!(err.to_string().contains(&cfg.vocab.to_string()), "{err}");
}

#[test]
fn graphs_refuse_programs_that_communicate() {
    let ty = TensorType::plain(DType::F32, &[4, 8]);
    let mut g = Graph::new();
    let x = g.input("x", ty);
    let y = g.add(Op::Unary(UnaryOp::Silu), &[x], "y").expect("silu");
    g.set_output("y", y);
    assert_eq!(graph_blocker(&g), None, "a local program can be captured");
    let ar = g
        .add(Op::AllReduce { axis: "tp".into() }, &[y], "ar")
        .expect("all_reduce");
    let z = g.add(Op::Scale(Float(0.5)), &[ar], "z").expect("scale");
    g.set_output("z", z);
    assert_eq!(graph_blocker(&g), Some(ar), "the all-reduce is named");
}
