//! `shardc train` end to end: the loss per step, `--export` (a checkpoint transformers and
//! `shardc run` load: the same tensor names and shapes), `--dump-grads` (`grad.<name>` equal
//! to the fixture's gradients), `--save-plan`, sharded runs, and clear errors.

mod common;

mod train_support;

use shardc::compiler::ir::ValueRole;
use shardc::runtime::Weights;
use std::path::Path;

/// `shardc train <fixture model> --tokens <ids> <extra>...`, which must succeed: its stdout.
fn train(model: &str, ids: &str, extra: &[&str]) -> String {
    let dir = train_support::dir(model);
    common::succeeds(&[&["train", dir.to_str().unwrap(), "--tokens", ids], extra].concat())
}

fn tokens_file(dir: &Path, model: &str) -> String {
    let r = train_support::reference(model);
    let rows: Vec<Vec<i32>> = r.ids.chunks(r.seq).map(|c| c.to_vec()).collect();
    let p = dir.join("ids.json");
    std::fs::write(&p, serde_json::to_string(&rows).unwrap()).unwrap();
    p.display().to_string()
}

/// The losses printed, one per step.
fn losses(out: &str) -> Vec<f32> {
    out.lines()
        .filter_map(|l| {
            l.strip_prefix("step ")?
                .split("loss ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

#[test]
fn train_prints_losses_saves_a_loadable_checkpoint_and_dumps_gradients() {
    let tmp = tempfile::tempdir().unwrap();
    for model in ["llama", "gpt2", "mixtral"] {
        let ids = tokens_file(tmp.path(), model);
        let save = tmp.path().join(format!("{model}-trained"));
        let grads = tmp.path().join(format!("{model}-grads.safetensors"));
        let out = train(
            model,
            &ids,
            &[
                "--steps",
                "3",
                "--export",
                save.to_str().unwrap(),
                "--dump-grads",
                grads.to_str().unwrap(),
            ],
        );
        let l = losses(&out);
        let r = train_support::reference(model);
        assert_eq!(l.len(), 3, "{model}: {out}");
        assert!(
            (l[0] - r.loss).abs() < 1e-5,
            "{model}: first loss {} vs {}",
            l[0],
            r.loss
        );
        assert!(
            l[2] < l[1] && l[1] < l[0],
            "{model}: the loss goes down: {l:?}"
        );

        // Same tensor names, shapes and dtype as the checkpoint trained from.
        let orig = Weights::open(train_support::dir(model)).unwrap();
        let saved = Weights::open(&save).unwrap();
        assert_eq!(orig.names(), saved.names(), "{model}: tensor names");
        for n in orig.names() {
            assert_eq!(orig.shape(&n), saved.shape(&n), "{model}: `{n}`");
            assert_eq!(saved.dtype(&n).as_deref(), Some("F32"));
        }
        // `shardc run` loads it (config.json copied alongside).
        let out_json = tmp.path().join("out.json");
        common::succeeds(&[
            "run",
            save.to_str().unwrap(),
            "--tokens",
            &ids,
            "--out",
            out_json.to_str().unwrap(),
        ]);

        // The dumped gradients are the last step's; the first step's equal the fixture's.
        let g = Weights::open(&grads).unwrap();
        let names: Vec<String> = g
            .names()
            .iter()
            .map(|n| ValueRole::gradient_label(n).unwrap().to_string())
            .collect();
        assert_eq!(
            names,
            orig.names(),
            "{model}: one gradient per stored tensor"
        );
    }
    // One step: the dumped gradients match the fixture's.
    let model = "gpt2";
    let ids = tokens_file(tmp.path(), model);
    let grads = tmp.path().join("one.safetensors");
    train(
        model,
        &ids,
        &[
            "--mesh",
            "dp=2",
            "--strategy",
            "zero2",
            "--dump-grads",
            grads.to_str().unwrap(),
        ],
    );
    let g = Weights::open(&grads).unwrap();
    let r = train_support::reference(model);
    for (name, want) in &r.grads {
        let got = g.get(&ValueRole::Gradient.name(name)).unwrap();
        let d = common::max_abs_diff(got.as_f32().unwrap(), want.as_f32().unwrap());
        assert!(d < 1e-5, "`{name}` off by {d}");
    }
}

#[test]
fn sharded_train_reports_the_mesh_and_writes_a_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tokens_file(tmp.path(), "llama");
    let plan = tmp.path().join("plan.json");
    let out = train(
        "llama",
        &ids,
        &[
            "--mesh",
            "tp=2",
            "--strategy",
            "sp",
            "--micro-batches",
            "2",
            "--recompute",
            "selective",
            "--save-plan",
            plan.to_str().unwrap(),
        ],
    );
    assert!(out.contains("mesh tp=2 (tp,sp) on 2 thread ranks"), "{out}");
    let l = losses(&out);
    assert!(
        (l[0] - train_support::reference("llama").loss).abs() < 1e-5,
        "{out}"
    );
    let p =
        shardc::compiler::plan::Plan::from_json(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let m = p.memory.train.expect("training memory in the plan");
    assert!(
        m.param_bytes > 0 && m.grad_bytes > 0 && m.optimizer_bytes > 0 && m.activation_bytes > 0
    );
    assert_eq!(m.activations_per_layer.len(), 3);
    assert!(m.peak_bytes > m.static_bytes);
    assert!(p.comm.expect("communication volume").sent_elements > 0);
}

#[test]
fn bad_training_arguments_are_one_line_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tokens_file(tmp.path(), "llama");
    // Further flags, and what the error says.
    let cases = [
        (
            "--recompute sometimes",
            "unknown recompute mode `sometimes`",
        ),
        ("--mesh dp=3", "batch=2 is not divisible by dp=3"),
        ("--micro-batches 3", "does not split into 3 micro-batches"),
        (
            "--mesh dp=2 --micro-batches 2",
            "micro-batch=1 is not divisible by dp=2",
        ),
        ("--mesh tp=2 --strategy zero2", "needs a `dp` axis"),
        ("--steps 0", "--steps must be at least 1"),
        (
            "--backend tpu",
            "backend `tpu` is not available (available: cpu, cuda)",
        ),
        (
            "--backend cuda --dtype f16",
            "--dtype f16 is not supported by the CUDA backend (f32, bf16)",
        ),
        ("--cuda-graphs", "--cuda-graphs needs --backend cuda"),
    ];
    let model = train_support::dir("llama").display().to_string();
    for (extra, needle) in cases {
        let mut args = vec!["train", &model, "--tokens", &ids];
        args.extend(extra.split_whitespace());
        common::fails_with(&args, &[needle]);
    }
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, "[[1, 2, 999]]").unwrap();
    let args = ["train", &model, "--tokens", bad.to_str().unwrap()];
    common::fails_with(&args, &["token id 999 at [0][2] is out of range"]);
}

/// `--backend cuda` trains on a GPU; on a machine without one it fails first with the clear
/// line naming `--backend cpu`, and a pipeline plan (which the CUDA trainer does not run) is
/// refused by name where there is one.
#[test]
fn cuda_training_without_a_gpu_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tokens_file(tmp.path(), "llama");
    let model = train_support::dir("llama").display().to_string();
    let args = ["train", &model, "--tokens", &ids, "--backend", "cuda"];
    match shardc::runtime::cuda::cuda_device_count() {
        Err(e) => {
            assert!(e.is_unavailable(), "{e}");
            common::fails_with(&args, &["use --backend cpu"]);
        }
        Ok(_) => {
            let mut pp = args.to_vec();
            pp.extend(["--mesh", "pp=2", "--micro-batches", "2"]);
            common::fails_with(&pp, &["pipeline"]);
        }
    }
}
