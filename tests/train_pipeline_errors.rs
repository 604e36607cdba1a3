//! Pipeline-parallel training fails with clear errors, never a panic or a hang: configurations
//! the pipeline compiler refuses (ZeRO with tied embeddings split over stages, zero3/fsdp with
//! pp, too many chunks, a bad `--stage-layers`, micro-batch counts that do not fit), `shardc
//! compile` with a `pp` axis, and at run time a rank that never sends (bounded by the timeout)
//! or stops early (reported at once, naming it).

mod common;
mod train_support;

use shardc::compiler::model::ModelConfig;
use shardc::compiler::schedule::pp::{Carry, Phase, PipeOp, ScheduleKind};
use shardc::compiler::train::{compile_pipeline, CompiledPipeline, TrainCompileError};
use shardc::runtime::pipeline::pipeline_step;
use shardc::runtime::train::{TrainError, TrainState};
use shardc::runtime::Weights;
use std::path::Path;
use std::time::{Duration, Instant};
use train_support::{pipe_options, token_batch, Pipe};

/// Expects `shardc args…` to fail with a one-line `error:` (no panic) containing every needle,
/// before any step ran.
fn fails_with(args: &[&str], needles: &[&str]) {
    let out = common::fails_with(args, needles);
    assert!(!out.contains("step 1: loss"), "{args:?} trained: {out}");
}

fn model(name: &str) -> String {
    train_support::dir(name).to_string_lossy().to_string()
}

/// `shardc train <model> --tokens … extra…` must fail naming every needle.
fn train_fails(model_name: &str, extra: &[&str], needles: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let (m, ids) = (model(model_name), common::tokens_4x16(tmp.path()));
    let mut args = vec!["train", m.as_str(), "--tokens", ids.as_str()];
    args.extend_from_slice(extra);
    fails_with(&args, needles);
}

/// `shardc train <model>` on a `pp=2,dp=2` mesh with `--strategy strategy` must fail naming
/// every needle.
fn strategy_fails_with_pp(model_name: &str, strategy: &str, needles: &[&str]) {
    let extra = ["--mesh", "pp=2,dp=2", "--strategy", strategy];
    train_fails(model_name, &extra, needles);
}

/// `shardc train llama` on `pp=2` with the interleaved schedule, `virtual_stages` chunks per
/// rank and `micro_batches`, must fail naming every needle.
fn interleaved_fails(virtual_stages: &str, micro_batches: &str, needles: &[&str]) {
    let extra = [
        "--mesh",
        "pp=2",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        virtual_stages,
        "--micro-batches",
        micro_batches,
    ];
    train_fails("llama", &extra, needles);
}

#[test]
fn tied_embeddings_over_stages_refuse_zero() {
    // gpt2's head reuses the embedding weight: split over stages, the two copies exchange
    // whole gradients, which ZeRO's sharded gradients and optimizer state do not provide.
    for z in ["zero1", "zero2"] {
        let needles = [&format!("`{z}` with tied embeddings"), "plain dp"];
        strategy_fails_with_pp("gpt2", z, &needles);
    }
    // Plain dp and no dp compile (and train: tests/train_pipeline.rs).
    let cfg = ModelConfig::from_path(&train_support::dir("gpt2")).unwrap();
    assert!(cfg.tied, "the gpt2 fixture ties its embeddings");
    for mesh in ["pp=2", "pp=2,dp=2"] {
        compile(&cfg, &pipe(mesh, &[], 1, ScheduleKind::OneFOneB, None), 2).unwrap();
    }
}

#[test]
fn zero3_and_fsdp_are_refused_with_pp() {
    for s in ["zero3", "fsdp"] {
        let needles = [
            &format!("`{s}` with pipeline parallelism"),
            "zero1 or zero2",
        ];
        strategy_fails_with_pp("llama", s, &needles);
    }
    // zero1 and zero2 compose with pp (the message's advice is sound).
    let cfg = llama_cfg();
    for s in ["zero1", "zero2"] {
        let extra = [s];
        compile(
            &cfg,
            &pipe("pp=2,dp=2", &extra, 2, ScheduleKind::OneFOneB, None),
            4,
        )
        .unwrap_or_else(|e| panic!("{s} with pp: {e}"));
    }
}

#[test]
fn too_many_chunks_for_the_model() {
    // 3 layers + embedding + head: at most 5 chunks.
    train_fails(
        "llama",
        &["--mesh", "pp=8"],
        &["8 pipeline chunks", "3 layers", "at most 5"],
    );
    // Interleaving counts chunks, not ranks: pp=2 × 3 virtual stages = 6 chunks.
    interleaved_fails("3", "2", &["6 pipeline chunks", "at most 5"]);
    // 5 chunks fit (a chunk may hold the embedding or head alone).
    let cfg = llama_cfg();
    let c = compile(&cfg, &pipe("pp=5", &[], 1, ScheduleKind::Gpipe, None), 2).unwrap();
    assert_eq!(c.chunks.len(), 5);
}

#[test]
fn bad_stage_layers() {
    let mesh = ["--mesh", "pp=2"];
    let with = |sl: &'static str| [mesh[0], mesh[1], "--stage-layers", sl];
    // Wrong count.
    train_fails(
        "llama",
        &with("1,1,1"),
        &["--stage-layers", "3 stages", "the pipeline has 2"],
    );
    // Wrong sum.
    train_fails(
        "llama",
        &with("1,1"),
        &["--stage-layers 1,1", "covers 2 layers", "the model has 3"],
    );
    train_fails(
        "llama",
        &with("2,2"),
        &["covers 4 layers", "the model has 3"],
    );
    // An empty stage.
    train_fails(
        "llama",
        &with("3,0"),
        &["--stage-layers 3,0", "stage 1 has no layers"],
    );
    // Not numbers.
    train_fails("llama", &with("2,x"), &["`x` is not a number"]);
    // Without a pp axis.
    train_fails(
        "llama",
        &["--stage-layers", "2,1"],
        &["need a mesh with a pp axis"],
    );
    // The library checks them too (callers that skip the CLI's parser).
    let cfg = llama_cfg();
    for bad in [vec![1, 1], vec![3, 0], vec![1, 1, 1]] {
        let err = compile(
            &cfg,
            &pipe("pp=2", &[], 1, ScheduleKind::OneFOneB, Some(bad.clone())),
            2,
        )
        .unwrap_err();
        assert!(
            matches!(err, TrainCompileError::Pipeline(_)),
            "{bad:?}: {err:?}"
        );
        assert!(err.to_string().contains("--stage-layers"), "{bad:?}: {err}");
    }
}

#[test]
fn micro_batch_counts_that_do_not_fit() {
    // Interleaved needs micro-batches divisible by pp.
    interleaved_fails("2", "3", &["interleaved", "divisible by pp", "3 % 2"]);
    // The micro-batches must divide the batch (4).
    train_fails(
        "llama",
        &["--mesh", "pp=2", "--micro-batches", "3"],
        &["batch 4 does not split into 3 micro-batches"],
    );
    // … and each micro-batch must split over dp.
    train_fails(
        "llama",
        &["--mesh", "pp=2,dp=2", "--micro-batches", "4"],
        &["micro-batch=1 is not divisible by dp=2"],
    );
    train_fails(
        "llama",
        &["--mesh", "pp=2", "--micro-batches", "0"],
        &["at least one stage and one micro-batch", "micro-batches=0"],
    );
    train_fails(
        "llama",
        &["--mesh", "pp=2", "--schedule", "2f2b"],
        &["unknown pipeline schedule `2f2b`"],
    );
}

#[test]
fn compile_with_pp_points_at_train() {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/llama-3-8b.json");
    fails_with(
        &["compile", path.to_str().unwrap(), "--mesh", "pp=2"],
        &["pp", "shardc train"],
    );
}

// ---------------------------------------------------------------------------------------
// Run-time failures, through the library: a program edited after compilation.

fn llama_cfg() -> ModelConfig {
    ModelConfig::from_path(&train_support::dir("llama")).unwrap()
}

fn pipe<'a>(
    mesh: &'a str,
    extra: &'a [&'a str],
    m: usize,
    schedule: ScheduleKind,
    stage_layers: Option<Vec<usize>>,
) -> Pipe<'a> {
    Pipe {
        mesh,
        extra,
        micro_batches: m,
        schedule,
        virtual_stages: 1,
        stage_layers,
    }
}

fn compile(
    cfg: &ModelConfig,
    p: &Pipe,
    batch: usize,
) -> Result<CompiledPipeline, TrainCompileError> {
    compile_pipeline(cfg, &pipe_options(p, batch, 16))
}

/// One step of `c` on the llama fixture with `timeout`: the result and how long it took.
fn step(c: &CompiledPipeline, timeout: Duration) -> (Result<f32, TrainError>, Duration) {
    step_of(&train_support::dir("llama"), c, timeout)
}

/// One step of `c` on the model in `dir` with `timeout`: the result and how long it took.
fn step_of(
    dir: &Path,
    c: &CompiledPipeline,
    timeout: Duration,
) -> (Result<f32, TrainError>, Duration) {
    let w = Weights::open(dir).unwrap();
    let cfg = shardc::compiler::model::ModelConfig::from_path(dir).unwrap();
    let plan = train_support::pipe_plan_of(c, &cfg);
    let mut state = TrainState::load(&plan, &w).unwrap();
    let batch = token_batch(c.options.batch, c.options.seq, 256);
    let t0 = Instant::now();
    let r = pipeline_step(&plan, &mut state, &batch, timeout, &w).map(|s| s.output.loss);
    (r, t0.elapsed())
}

/// Expects the step `(result, time taken)` to have failed within 5 s, without a panic, with
/// an error naming every needle; `what` says which step, for the messages.
fn fails_promptly((r, took): (Result<f32, TrainError>, Duration), what: &str, needles: &[&str]) {
    assert!(
        took < Duration::from_secs(5),
        "{what}: not reported promptly, took {took:?}"
    );
    let err = r.expect_err(what).to_string();
    assert!(!err.contains("panicked"), "{what}: {err}");
    for needle in needles {
        assert!(err.contains(needle), "{what}: `{needle}` not in: {err}");
    }
}

/// The unmodified program trains (the edits below are what break it).
#[test]
fn the_unedited_program_runs() {
    let c = compile(
        &llama_cfg(),
        &pipe("pp=2", &[], 1, ScheduleKind::OneFOneB, None),
        2,
    )
    .unwrap();
    let (r, _) = step(&c, Duration::from_secs(10));
    let loss = r.unwrap();
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
}

#[test]
fn a_rank_that_never_sends_times_out_naming_the_receive() {
    // One micro-batch: stage 0 runs F0, then (send removed) waits for the gradient; stage 1
    // waits for the activation from the start, so its receive times out first, and its
    // hang-up then ends stage 0's wait. Both waits would time out within about as long as
    // stage 0 takes to load and run F0, so that is made long: 11 of 12 layers on stage 0
    // (with 3 layers, the two timeouts race and either rank may report first).
    let dir = train_support::deep_llama(12);
    let cfg = ModelConfig::from_path(&dir).unwrap();
    let mut c = compile(
        &cfg,
        &pipe("pp=2", &[], 1, ScheduleKind::OneFOneB, Some(vec![11, 1])),
        8,
    )
    .unwrap();
    let k = c.program[0]
        .iter()
        .position(|o| matches!(o, PipeOp::Send { .. }))
        .expect("stage 0 sends");
    assert!(matches!(
        c.program[0][k],
        PipeOp::Send {
            carry: Carry::Act,
            micro: 0,
            ..
        }
    ));
    c.program[0].remove(k);
    assert!(
        c.schedule.check_program(&c.program).is_err(),
        "the verifier sees the missing send"
    );
    // Bounded by the timeout.
    fails_promptly(
        step_of(&dir, &c, Duration::from_secs(1)),
        "a step missing a send",
        &[
            "rank 1 (mesh coordinates pp=1)",
            "recv activation of micro-batch 0",
            "from rank 0",
            "timed out after 1000 ms",
        ],
    );
}

#[test]
fn a_rank_that_stops_early_is_named_and_its_peer_does_not_wait() {
    // Stage 0 runs its first pass and returns: stage 1 must not wait out the timeout, and the
    // error names stage 0.
    for (mesh, batch) in [("pp=2", 2), ("pp=2,dp=2", 4)] {
        let mut c = compile(
            &llama_cfg(),
            &pipe(mesh, &[], 2, ScheduleKind::OneFOneB, None),
            batch,
        )
        .unwrap();
        let first_run = c.program[0]
            .iter()
            .position(|o| matches!(o, PipeOp::Run(s) if s.phase == Phase::F))
            .expect("stage 0 runs");
        c.program[0].truncate(first_run + 1);
        // Reported promptly, not after the 30 s timeout; the root cause, not the peer's
        // knock-on `pipeline rank 0 stopped`.
        fails_promptly(
            step(&c, Duration::from_secs(30)),
            &format!("{mesh}: a step whose rank stopped"),
            &[
                "rank 0 (mesh coordinates pp=0",
                "end of instructions",
                "chunk 0 never ran its optimizer step",
            ],
        );
    }
}

#[test]
fn a_rank_that_skips_its_optimizer_step_is_an_error() {
    // Every transfer completes; stage 0 just never finishes its chunk.
    let mut c = compile(
        &llama_cfg(),
        &pipe("pp=2", &[], 2, ScheduleKind::Gpipe, None),
        2,
    )
    .unwrap();
    c.program[0].retain(|o| !matches!(o, PipeOp::Step { .. }));
    fails_promptly(
        step(&c, Duration::from_secs(30)),
        "missing outputs",
        &["rank 0", "chunk 0 never ran its optimizer step"],
    );
}
