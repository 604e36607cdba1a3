//! Bad command-line options: no flag is silently clamped, ignored or left to one winner; sizes
//! that would exhaust memory are refused with the estimate before anything is allocated. Each
//! is a one-line error naming the flag and the value.

mod common;

use common::{fails_with, fails_with_env, run_shardc};

/// `cmd model extra...` for each `(extra, needles)`.
fn each(cmd: &[&str], cases: &[(&[&str], &[&str])]) {
    for (extra, needles) in cases {
        let mut args = cmd.to_vec();
        args.extend_from_slice(extra);
        fails_with(&args, needles);
    }
}

const LLAMA: &str = "tests/fixtures/hf-tiny/llama";
const LLAMA_8B: &str = "models/llama-3-8b.json";

/// Zero sizes are errors, not empty plans or values bumped to 1.
#[test]
fn zero_sizes_are_errors() {
    each(
        &["compile", LLAMA, "-o", "/dev/null", "--seq", "16"],
        &[
            (
                &["--batch", "0"],
                &["--batch: must be at least 1 (found 0)"],
            ),
            (
                &["--gpus-per-node", "0"],
                &["--gpus-per-node: must be at least 1 (found 0)"],
            ),
            (
                &["--train", "--micro-batches", "0"],
                &["--micro-batches: must be at least 1 (found 0)"],
            ),
            (
                &["--train", "--mesh", "pp=3", "--virtual-stages", "0"],
                &["--virtual-stages: must be at least 1 (found 0)"],
            ),
        ],
    );
    each(
        &["compile", LLAMA, "-o", "/dev/null"],
        &[
            (&["--seq", "0"], &["--seq: must be at least 1 (found 0)"]),
            (
                &["--seq", "129"],
                &["--seq: 129 exceeds the model's maximum positions 128"],
            ),
        ],
    );
    each(
        &["simulate", LLAMA, "--mesh", "dp=2"],
        &[
            (
                &["--batch", "0"],
                &["--batch: must be at least 1 (found 0)"],
            ),
            (&["--seq", "0"], &["--seq: must be at least 1 (found 0)"]),
            (
                &["--train", "--seq", "16", "--global-batch", "0"],
                &["--global-batch: must be at least 1 (found 0)"],
            ),
            (
                &["--train", "--seq", "16", "--micro-batch", "0"],
                &["--micro-batch: must be at least 1 (found 0)"],
            ),
        ],
    );
    each(
        &[
            "simulate", LLAMA, "--train", "--seq", "16", "--mesh", "pp=3",
        ],
        &[
            (
                &["--schedule", "interleaved", "--virtual-stages", "0"],
                &["--virtual-stages: must be at least 1 (found 0)"],
            ),
            (
                &["--zero", "7"],
                &["--zero: must be 0, 1, 2 or 3 (found 7)"],
            ),
        ],
    );
    each(
        &["inspect", LLAMA],
        &[
            (&["--seq", "0"], &["--seq: must be at least 1 (found 0)"]),
            (
                &["--seq", "100000000000000"],
                &["--seq: 100000000000000 exceeds the model's maximum positions 128"],
            ),
        ],
    );
    each(
        &["schedule"],
        &[
            (&["--pp", "0"], &["--pp: must be at least 1 (found 0)"]),
            (
                &["--micro-batches", "0"],
                &["--micro-batches: must be at least 1 (found 0)"],
            ),
            (
                &["--schedule", "interleaved", "--virtual-stages", "0"],
                &["--virtual-stages: must be at least 1 (found 0)"],
            ),
        ],
    );
    fails_with(
        &["bench", "collectives", "--iters", "0"],
        &["--iters: must be at least 1 (found 0)"],
    );
    fails_with(
        &[
            "compile",
            LLAMA,
            "-o",
            "/dev/null",
            "--memory-weight",
            "NaN",
        ],
        &["--memory-weight: must be finite and >= 0 (found NaN)"],
    );
    fails_with(
        &["compile", LLAMA, "-o", "/dev/null", "--memory-weight", "-1"],
        &["--memory-weight: must be finite and >= 0 (found -1)"],
    );
}

/// Mesh axes: positive sizes, known names, each once, a world that fits; through the shared
/// mesh parser every command (train included) gets the same error.
#[test]
fn bad_meshes_name_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = common::tokens_2x4(tmp.path());
    let out = tmp.path().join("out.json").to_string_lossy().to_string();
    for cmd in [
        &["compile", LLAMA, "-o", "/dev/null"][..],
        &["simulate", LLAMA],
        &["train", LLAMA, "--tokens", &ids],
        &["run", LLAMA, "--tokens", &ids, "--out", &out],
    ] {
        each(
            cmd,
            &[
                (
                    &["--mesh", "dp=0"],
                    &["--mesh \"dp=0\": size of `dp` must be a positive integer (found `0`)"],
                ),
                (
                    &["--mesh", "tp=2,tp=2"],
                    &["--mesh: axis `tp` appears twice"],
                ),
                (
                    &["--mesh", "xx=2"],
                    &["--mesh: unknown mesh axis `xx`; valid axes: dp, tp"],
                ),
                (
                    &["--mesh", "dp=4294967296,tp=4294967296"],
                    &["18446744073709551616 ranks, more than the 1048576 supported"],
                ),
            ],
        );
    }
}

/// Two ZeRO stages (or ZeRO-3 twice, as zero3 and fsdp) are a conflict, not one winner.
#[test]
fn conflicting_strategies_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = common::tokens_2x4(tmp.path());
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--strategy", "zero1,zero3"],
            &["--strategy: `zero1` and `zero3` conflict"],
        ),
        (
            &["--strategy", "zero2,fsdp"],
            &["--strategy: `zero2` and `fsdp` conflict"],
        ),
        (
            &["--strategy", "zero3", "--strategy", "fsdp"],
            &["`zero3` and `fsdp` conflict"],
        ),
    ];
    each(
        &[
            "compile",
            LLAMA,
            "--train",
            "--mesh",
            "dp=2",
            "--seq",
            "16",
            "-o",
            "/dev/null",
        ],
        cases,
    );
    each(&["train", LLAMA, "--tokens", &ids, "--mesh", "dp=2"], cases);
    each(
        &[
            "simulate", LLAMA, "--train", "--seq", "16", "--mesh", "dp=2",
        ],
        cases,
    );
    each(
        &[
            "simulate", LLAMA, "--train", "--seq", "16", "--mesh", "dp=2",
        ],
        &[
            (
                &["--strategy", "zero2", "--zero", "1"],
                &["--zero 1 contradicts --strategy zero2"],
            ),
            (&["--strategy", "magic"], &["unknown strategy `magic`"]),
        ],
    );
}

/// Flags that do not apply to the mode chosen are errors, not ignored.
#[test]
fn flags_of_another_mode_are_errors() {
    each(
        &["simulate", LLAMA, "--mesh", "dp=2"],
        &[
            (
                &["--zero", "1"],
                &["--zero applies to training steps; add --train"],
            ),
            (
                &["--micro-batch", "2"],
                &["--micro-batch applies to training steps"],
            ),
            (
                &["--micro-batches", "2"],
                &["--micro-batches applies to training steps"],
            ),
            (
                &["--schedule", "gpipe"],
                &["--schedule applies to training steps"],
            ),
            (
                &["--train", "--seq", "16", "--micro-batches", "4"],
                &["--micro-batches: give the global batch too"],
            ),
            (
                &["--train", "--seq", "16", "--batch", "4", "--micro-batches", "4"],
                &["--micro-batches 4: the global batch 4 does not split into 4 micro-batches on each of the 2 data-parallel rank(s)"],
            ),
            (
                &["--train", "--seq", "16", "--virtual-stages", "4"],
                &["--virtual-stages 4 applies to --schedule interleaved"],
            ),
            (
                &["--trace-ranks", "0-1"],
                &["--trace-ranks selects the ranks of --trace"],
            ),
        ],
    );
    fails_with(
        &["simulate", "--plan", "plan.json", "--mesh", "dp=2"],
        &["--mesh describes a model to compile; --plan replays a compiled plan"],
    );
    fails_with(
        &["schedule", "--virtual-stages", "3"],
        &["--virtual-stages 3 applies to --schedule interleaved"],
    );
    fails_with(
        &["schedule", "plan.json", "--pp", "3"],
        &["--pp describes a schedule to build; plan.json carries its own"],
    );
    // The shared pipeline schedule refuses virtual stages the schedule would ignore.
    let tmp = tempfile::tempdir().unwrap();
    let ids = common::tokens_2x4(tmp.path());
    fails_with(
        &[
            "train",
            LLAMA,
            "--tokens",
            &ids,
            "--mesh",
            "pp=3",
            "--schedule",
            "1f1b",
            "--virtual-stages",
            "2",
        ],
        &["--virtual-stages 2 needs --schedule interleaved"],
    );
}

/// Sizes that would exhaust memory (or the byte accounting) are refused with the estimate,
/// before the tables, graphs or buffers are allocated.
#[test]
fn sizes_that_would_exhaust_memory_are_refused_with_the_estimate() {
    // A fixed cap, so the outcome does not depend on this machine's memory.
    let cap = [("SHARDC_MAX_MEMORY", "16G")];
    let over = "more than the 16.0 GiB memory cap (SHARDC_MAX_MEMORY)";
    fails_with_env(
        &["schedule", "--pp", "10000"],
        &cap,
        &[
            "--pp 10000 × --micro-batches 8 × --virtual-stages 1: the schedule and its diagram would need ~",
            over,
        ],
    );
    fails_with_env(
        &[
            "schedule",
            "--pp",
            "1000000000000",
            "--micro-batches",
            "1000000000000",
        ],
        &cap,
        &["EiB", over],
    );
    fails_with_env(
        &["bench", "collectives", "--max-bytes", "1T"],
        &cap,
        &[
            "--max-bytes 1099511627776 on 2 ranks: the buffers would need ~8.0 TiB",
            over,
        ],
    );
    fails_with_env(
        &[
            "compile",
            LLAMA_8B,
            "--train",
            "--mesh",
            "pp=2",
            "--batch",
            "1000000000",
            "--micro-batches",
            "1000000000",
            "-o",
            "/dev/null",
        ],
        &cap,
        // (The IR is one micro-batch's whatever the count; the activations are refused.)
        &[
            "--batch 1000000000 × --seq 4096: a step's activations would be ~",
            "EiB",
        ],
    );
    fails_with_env(
        &["simulate", LLAMA_8B, "--train", "--global-batch", "1000000000000"],
        &cap,
        &[
            "--global-batch 1000000000000: 500000000000 micro-batches × pp=1 × 1 chunk(s): the simulated pipeline would need ~",
            over,
        ],
    );
    // Beyond what byte accounting can represent: an error, not an overflow.
    for cmd in [
        &[
            "compile",
            LLAMA_8B,
            "-o",
            "/dev/null",
            "--batch",
            "1000000000000",
        ][..],
        &["simulate", LLAMA_8B, "--batch", "1000000000000"],
    ] {
        fails_with(
            cmd,
            &[
                "--batch 1000000000000 × --seq 4096: a step's activations would be ~",
                "EiB",
            ],
        );
    }
    fails_with(
        &[
            "bench",
            "collectives",
            "--nranks",
            "100000",
            "--max-bytes",
            "8",
        ],
        &["--nranks: at most 1024 ranks"],
    );
    fails_with(
        &["launch", "--nproc-per-node", "100000", "--", "run", "x"],
        &["--nproc-per-node: at most 1024 processes per node (found 100000)"],
    );
    fails_with(
        &[
            "launch",
            "--nproc-per-node",
            "1024",
            "--nnodes",
            "100000",
            "--master-port",
            "29500",
            "--",
            "run",
            "x",
        ],
        &["--nproc-per-node 1024 × --nnodes 100000: 102400000 ranks, more than the 1048576"],
    );
    // Real sizes still pass: a 10,000-rank mesh and a 70B training step.
    let (ok, _, err) = run_shardc(
        &[
            "simulate",
            "models/llama-3-70b.json",
            "--train",
            "--mesh",
            "pp=10,dp=125,tp=8",
            "--cluster",
            "dgx-h100x1250",
            "--global-batch",
            "1000",
            "--seq",
            "4096",
            "--json",
        ],
        &cap,
    );
    assert!(ok, "{err}");
}

/// One batch vocabulary: `--batch` and `--global-batch` are one flag everywhere, and a
/// micro-batch is given by its count (`--micro-batches`) or its size per data-parallel rank
/// (`--micro-batch`), with the same meaning in `compile --train`, `train` and
/// `simulate --train`.
#[test]
fn batch_flags_mean_the_same_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let plan = |extra: &[&str]| {
        let out = dir.path().join("p.json");
        let mut args = vec![
            "compile",
            "tests/fixtures/hf-tiny/llama",
            "--train",
            "--mesh",
            "dp=2",
            "--seq",
            "8",
            "-o",
            out.to_str().unwrap(),
            "--overwrite",
        ];
        args.extend_from_slice(extra);
        common::succeeds(&args);
        std::fs::read_to_string(&out).unwrap()
    };
    // 8 sequences over dp=2: 2 micro-batches of 2 sequences per rank, said either way.
    let by_count = plan(&["--batch", "8", "--micro-batches", "2"]);
    let by_size = plan(&["--global-batch", "8", "--micro-batch", "2"]);
    assert_eq!(by_count, by_size);
    fails_with(
        &[
            "compile",
            "tests/fixtures/hf-tiny/llama",
            "--train",
            "--mesh",
            "dp=2",
            "--batch",
            "8",
            "--micro-batch",
            "3",
        ],
        &["--micro-batch 3: the global batch 8 does not split"],
    );
    // train: the token file's 4 sequences over dp=2 in micro-batches of 1 = 2 micro-batches.
    let tokens = dir.path().join("t.json");
    std::fs::write(
        &tokens,
        "[[1,2,3,4,5,6,7,8],[9,10,11,12,13,14,15,16],[3,1,4,1,5,9,2,6],[2,7,1,8,2,8,1,8]]",
    )
    .unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "tests/fixtures/hf-tiny/llama",
            "--tokens",
            tokens.to_str().unwrap(),
            "--mesh",
            "dp=2",
            "--steps",
            "2",
        ];
        args.extend_from_slice(extra);
        let out = common::succeeds(&args);
        // The losses and the header, not the step times.
        out.lines()
            .map(|l| l.split(" (").next().unwrap_or(l).to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        train(&["--micro-batch", "1"]),
        train(&["--micro-batches", "2"])
    );
    // simulate: --batch is --global-batch in both modes; counts and sizes agree.
    let sim = |extra: &[&str]| {
        let mut args = vec![
            "simulate",
            "models/llama-3-8b.json",
            "--train",
            "--mesh",
            "dp=4",
            "--seq",
            "2048",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = common::succeeds(&args);
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let a = sim(&["--global-batch", "32", "--micro-batch", "2"]);
    let b = sim(&["--batch", "32", "--micro-batches", "4"]);
    assert_eq!(a, b);
    assert_eq!(a["micro_batches"], 4);
    let (ok, fwd_a, _) = run_shardc(
        &[
            "simulate",
            "models/llama-3-8b.json",
            "--batch",
            "4",
            "--seq",
            "512",
            "--json",
        ],
        &[],
    );
    let (ok2, fwd_b, _) = run_shardc(
        &[
            "simulate",
            "models/llama-3-8b.json",
            "--global-batch",
            "4",
            "--seq",
            "512",
            "--json",
        ],
        &[],
    );
    assert!(ok && ok2);
    assert_eq!(fwd_a, fwd_b);
}
