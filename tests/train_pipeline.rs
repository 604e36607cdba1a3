//! Pipeline-parallel training steps on thread ranks reproduce the unsharded step: the hf-tiny
//! llama fixture (loss, every gradient, the AdamW update per the fixtures' README) and a
//! deeper random-weight llama against its own unsharded run, for every schedule, pp = 2 and 4,
//! micro-batches 1..8, and composed with dp / tp / sp / zero1 / zero2 on `pp=2,dp=2,tp=2`.

mod train_support;

use shardc::compiler::ir::AdamWSpec;
use shardc::compiler::schedule::pp::ScheduleKind;
use train_support::{
    check, check_activation_peaks, check_against, deep_llama, fixture_batch, pipe, run_pipeline_on,
    run_unsharded_on, token_batch,
};

const SCHEDULES: [ScheduleKind; 4] = [
    ScheduleKind::Gpipe,
    ScheduleKind::OneFOneB,
    ScheduleKind::Interleaved,
    ScheduleKind::ZbH1,
];

/// The fixture batch (each sequence 4 times: a batch of 8 with the fixture's loss and
/// gradients) through pp = 2 and 4, every schedule, 1, 2, 4 and 8 micro-batches.
#[test]
fn llama_fixture_every_schedule() {
    let dir = train_support::dir("llama");
    let batch = fixture_batch("llama", 4);
    for pp in ["pp=2", "pp=4"] {
        for kind in SCHEDULES {
            for m in [1, 2, 4, 8] {
                let p = pipe(pp, &[], m, kind);
                // The fixture llama has 3 layers: 8 interleaved chunks need the deeper model.
                if kind == ScheduleKind::Interleaved && (pp == "pp=4" || m % 2 != 0) {
                    continue;
                }
                let r = run_pipeline_on(&dir, &p, &batch);
                check("llama", &format!("{pp} {} m={m}", kind.name()), &r);
            }
        }
    }
}

/// An 8-layer random-weight llama against its own unsharded step: pp = 2 and 4, every
/// schedule (interleaved with 2 chunks per rank), micro-batches 1..8 (one sequence each).
#[test]
fn deep_llama_every_schedule_and_micro_batch_count() {
    let dir = deep_llama(8);
    for m in 1..=8 {
        let batch = token_batch(m, 12, 256);
        let base = run_unsharded_on(&dir, &batch);
        for pp in ["pp=2", "pp=4"] {
            let p_size = if pp == "pp=2" { 2 } else { 4 };
            for kind in SCHEDULES {
                if kind == ScheduleKind::Interleaved && m % p_size != 0 {
                    continue;
                }
                let r = run_pipeline_on(&dir, &pipe(pp, &[], m, kind), &batch);
                let what = format!("deep llama {pp} {} m={m}", kind.name());
                check_against(&what, &r, &base, &dir, &AdamWSpec::default());
            }
        }
    }
}

/// `pp=2,dp=2,tp=2` (8 thread ranks) with plain dp/tp, sp, zero1 and zero2, 1F1B and
/// interleaved, against the fixture.
#[test]
fn llama_fixture_pp_dp_tp() {
    let dir = train_support::dir("llama");
    let batch = fixture_batch("llama", 2);
    let extras: [&[&str]; 4] = [&[], &["sp"], &["zero1"], &["zero2"]];
    for extra in extras {
        for (kind, m) in [(ScheduleKind::OneFOneB, 2), (ScheduleKind::ZbH1, 2)] {
            let r = run_pipeline_on(&dir, &pipe("pp=2,dp=2,tp=2", extra, m, kind), &batch);
            check(
                "llama",
                &format!("pp=2,dp=2,tp=2 {extra:?} {} m={m}", kind.name()),
                &r,
            );
        }
    }
    // Interleaved on the deeper model with every stage sharded.
    let deep = deep_llama(8);
    let batch = token_batch(8, 12, 256);
    let base = run_unsharded_on(&deep, &batch);
    for extra in extras {
        let r = run_pipeline_on(
            &deep,
            &pipe("pp=2,dp=2,tp=2", extra, 4, ScheduleKind::Interleaved),
            &batch,
        );
        let what = format!("deep llama pp=2,dp=2,tp=2 {extra:?} interleaved m=4");
        check_against(&what, &r, &base, &deep, &AdamWSpec::default());
    }
}

/// `--stage-layers` places layers where the user says; the step is unchanged.
#[test]
fn stage_layers_override() {
    let dir = deep_llama(8);
    let batch = token_batch(4, 12, 256);
    let base = run_unsharded_on(&dir, &batch);
    let mut p = pipe("pp=4", &[], 4, ScheduleKind::OneFOneB);
    p.stage_layers = Some(vec![1, 3, 3, 1]);
    let r = run_pipeline_on(&dir, &p, &batch);
    let layers: Vec<_> = r
        .compiled
        .chunks
        .iter()
        .map(|c| (c.spec.layers.clone(), c.spec.embed, c.spec.head))
        .collect();
    assert_eq!(
        layers,
        vec![
            (0..1, true, false),
            (1..4, false, false),
            (4..7, false, false),
            (7..8, false, true)
        ]
    );
    check_against(
        "stage layers 1,3,3,1",
        &r,
        &base,
        &dir,
        &AdamWSpec::default(),
    );
}

/// Executed, not modelled: activations held on each stage (values of one micro-batch alive
/// after an instruction), pp = 4. GPipe's first stage holds all m micro-batches before the
/// first backward; 1F1B's at most p, whatever m.
#[test]
fn first_stage_activations_gpipe_m_vs_1f1b_p() {
    let dir = deep_llama(8);
    let peak = |kind, m| {
        let batch = token_batch(m, 12, 256);
        run_pipeline_on(&dir, &pipe("pp=4", &[], m, kind), &batch).peak_bytes
    };
    let (g4, g8) = (peak(ScheduleKind::Gpipe, 4), peak(ScheduleKind::Gpipe, 8));
    let (f4, f8) = (
        peak(ScheduleKind::OneFOneB, 4),
        peak(ScheduleKind::OneFOneB, 8),
    );
    eprintln!("GPipe m=4 {g4:?}\nGPipe m=8 {g8:?}\n1F1B m=4 {f4:?}\n1F1B m=8 {f8:?}");
    // One micro-batch's activations on the first stage.
    let a = g8[0] as f64 / 8.0;
    let near = |x: usize, n: f64| (x as f64 - n * a).abs() <= 0.02 * n * a;
    assert!(near(g4[0], 4.0) && near(g8[0], 8.0), "GPipe: {g4:?} {g8:?}");
    assert!(
        near(f8[0], 4.0),
        "1F1B m=8 holds p=4 micro-batches: {f8:?} vs {a} each"
    );
    assert_eq!(f4, f8, "1F1B activations do not grow with m");
    // Later 1F1B stages hold fewer (p − s in flight).
    assert!(f8.windows(2).all(|w| w[0] > w[1]), "{f8:?}");
}

/// The compiler's static account of activation memory per stage equals what the thread
/// runtime measures, byte for byte, for every schedule (and with dp/tp/sp inside stages).
#[test]
fn static_activation_peaks_match_the_runtime() {
    let dir = deep_llama(8);
    let batch = token_batch(8, 12, 256);
    for mesh in ["pp=4", "pp=2,dp=2,tp=2"] {
        let extra: &[&str] = if mesh == "pp=4" { &[] } else { &["sp"] };
        for kind in SCHEDULES {
            let r = run_pipeline_on(&dir, &pipe(mesh, extra, 4, kind), &batch);
            check_activation_peaks(&format!("{mesh} {}", kind.name()), &r);
        }
    }
}

/// Mixtral (MoE) through a pipeline, with expert parallelism inside each stage, and llama
/// with activation recomputation.
#[test]
fn mixtral_and_recompute_through_the_pipeline() {
    let dir = train_support::dir("mixtral");
    let batch = fixture_batch("mixtral", 2);
    for (mesh, m) in [("pp=2", 2), ("pp=2,ep=2", 2)] {
        let r = run_pipeline_on(&dir, &pipe(mesh, &[], m, ScheduleKind::OneFOneB), &batch);
        check("mixtral", &format!("{mesh} 1f1b m={m}"), &r);
    }
    let dir = train_support::dir("llama");
    let batch = fixture_batch("llama", 2);
    for rc in [
        shardc::compiler::autodiff::Recompute::Full,
        shardc::compiler::autodiff::Recompute::Selective,
    ] {
        let p = pipe("pp=2,tp=2", &["sp"], 2, ScheduleKind::ZbH1);
        let mut o = train_support::pipe_options(&p, batch.batch, batch.seq);
        o.recompute = rc;
        let r = train_support::run_pipeline_opts(&dir, &o, &batch);
        check("llama", &format!("pp=2,tp=2 sp recompute {rc}"), &r);
    }
}

/// The plan verifier checks the per-instruction node lists the plan carries: a value moved
/// before its operand, a value dropped, or a received input computed by a pass is refused.
#[test]
fn plan_verifier_checks_the_node_lists() {
    let dir = deep_llama(8);
    let cfg = shardc::compiler::model::ModelConfig::from_path(&dir).unwrap();
    let o = train_support::pipe_options(&pipe("pp=2", &[], 2, ScheduleKind::OneFOneB), 2, 12);
    let c = shardc::compiler::train::compile_pipeline(&cfg, &o).unwrap();
    let plan = c.plan(
        "deep",
        "llama",
        cfg.layers,
        shardc::compiler::train::Precision::f32(),
    );
    plan.check_pipeline().unwrap();
    // Through JSON and back: still verified.
    let back = shardc::compiler::plan::Plan::from_json(&plan.to_json()).unwrap();
    back.check_pipeline().unwrap();
    // Chunk 0's forward list: run its last value first.
    let mut bad = plan.clone();
    let list = &mut bad.pipeline_nodes[0][0];
    let last = list.pop().unwrap();
    list.insert(0, last);
    let e = bad.check_pipeline().unwrap_err().to_string();
    assert!(e.contains("runs before its operand"), "{e}");
    // A value nobody runs.
    let mut bad = plan.clone();
    bad.pipeline_nodes[0][0].pop();
    let e = bad.check_pipeline().unwrap_err().to_string();
    assert!(
        e.contains("never runs") || e.contains("before its operand"),
        "{e}"
    );
    // A received input computed by a pass of chunk 1.
    let mut bad = plan.clone();
    let v = bad.chunks[1].program.input_named("pipe.act_in").unwrap();
    bad.pipeline_nodes[1][0].insert(0, v);
    let e = bad.check_pipeline().unwrap_err().to_string();
    assert!(e.contains("received input"), "{e}");
    // The node lists are one micro-batch's: the same size for any number of micro-batches.
    let o8 = train_support::pipe_options(&pipe("pp=2", &[], 8, ScheduleKind::OneFOneB), 8, 12);
    let c8 = shardc::compiler::train::compile_pipeline(&cfg, &o8).unwrap();
    assert_eq!(c8.nodes, c.nodes);
    // Stage 1 expecting activations of another size than stage 0 sends.
    let mut bad = plan.clone();
    let g = &mut bad.chunks[1].program;
    let v = g.input_named("pipe.act_in").unwrap();
    g.nodes[v.index()].ty.dims[2].size += 1;
    let e = bad.check_pipeline().unwrap_err().to_string();
    assert!(
        e.contains("pipeline boundary 0") && e.contains("Act"),
        "{e}"
    );
}

/// GPT-2 ties its head to the embedding: split over stages, each end holds a copy, their
/// gradients are exchanged and summed before the (identical) optimizer steps. The fixture's
/// loss, gradients (the tied one summed) and update are reproduced.
#[test]
fn gpt2_tied_embeddings_across_stages() {
    let dir = train_support::dir("gpt2");
    let batch = fixture_batch("gpt2", 2);
    for (mesh, kind, m) in [
        ("pp=2", ScheduleKind::OneFOneB, 2),
        ("pp=2", ScheduleKind::ZbH1, 4),
        ("pp=2", ScheduleKind::Interleaved, 2),
        ("pp=4", ScheduleKind::Gpipe, 4),
        ("pp=2,dp=2", ScheduleKind::OneFOneB, 2),
    ] {
        let r = run_pipeline_on(&dir, &pipe(mesh, &[], m, kind), &batch);
        let c = &r.compiled;
        let n = c.chunks.len();
        assert!(c.chunks[0].spec.embed && !c.chunks[0].spec.head);
        assert!(c.chunks[n - 1].spec.head && !c.chunks[n - 1].spec.embed);
        let copies = c.params().filter(|p| p.label == "embed").count();
        assert_eq!(copies, 2, "{mesh}: the tied table on both ends");
        check("gpt2", &format!("{mesh} {} m={m} (tied)", kind.name()), &r);
    }
}

/// The executed schedule (`PipelineStep::timelines`): every instruction of every rank once,
/// in program order without overlap on a rank, each forward before its backward, and every
/// receive ending after its matching send began on the other stage.
#[test]
fn executed_timelines_follow_the_program() {
    use shardc::compiler::schedule::pp::PipeOp;
    let dir = deep_llama(8);
    let batch = token_batch(8, 12, 256);
    for kind in SCHEDULES {
        let r = run_pipeline_on(&dir, &pipe("pp=4", &[], 8, kind), &batch);
        let (c, step) = (&r.compiled, &r);
        let what = kind.name();
        let mut send_start = std::collections::HashMap::new();
        for (r, tl) in step.timelines.iter().enumerate() {
            let prog = &c.program[r];
            assert_eq!(tl.slices.len(), prog.len(), "{what}: rank {r}");
            let mut end = 0.0f64;
            for (s, op) in tl.slices.iter().zip(prog) {
                assert_eq!(s.name, op.to_string(), "{what}: rank {r}");
                assert!(
                    s.start >= end - 1e-9 && s.dur >= 0.0,
                    "{what}: rank {r} overlaps"
                );
                end = s.start + s.dur;
                if let PipeOp::Send {
                    carry,
                    micro,
                    boundary,
                    ..
                } = op
                {
                    send_start.insert((*carry, *micro, *boundary), s.start);
                }
            }
            // Each forward before its backward.
            let at = |name: &str| tl.slices.iter().position(|s| s.name == name);
            for sl in &tl.slices {
                if let Some(rest) = sl.name.strip_prefix('B') {
                    let f = at(&format!("F{rest}")).unwrap();
                    assert!(f < at(&sl.name).unwrap(), "{what}: {}", sl.name);
                }
            }
        }
        for (r, tl) in step.timelines.iter().enumerate() {
            for (s, op) in tl.slices.iter().zip(&c.program[r]) {
                if let PipeOp::Recv {
                    carry,
                    micro,
                    boundary,
                    ..
                } = op
                {
                    let sent = send_start[&(*carry, *micro, *boundary)];
                    assert!(
                        s.start + s.dur >= sent,
                        "{what}: {} before its send",
                        s.name
                    );
                }
            }
        }
    }
}
