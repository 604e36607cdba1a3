//! Non-finite numbers are errors, never output: optimizer flags outside their domains are
//! refused before anything runs; NaN or infinite weights are refused at load; `run` refuses
//! non-finite logits or hidden states instead of writing JSON `null`; training stops at the
//! first non-finite loss, gradient or updated weight, naming the step (and micro-batch, or
//! stored tensor), on every rank, and writes nothing (`--export`, `--dump-grads`).

mod common;

use common::{fails_with, run_shardc, shardc_clean};
use safetensors::SafeTensors;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::schedule::pp::ScheduleKind;
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{
    compile_pipeline, compile_train, PipelineOptions, Precision, TrainOptions,
};
use shardc::runtime::pipeline::pipeline_step;
use shardc::runtime::train::{train_step, Batch, TrainError, TrainState};
use shardc::runtime::Weights;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn llama() -> PathBuf {
    common::fixtures().join("llama")
}

/// Four sequences of eight tokens (two micro-batches of two, or one per `dp` rank).
fn tokens(dir: &Path) -> String {
    common::write_file(
        dir,
        "batch.json",
        "[[1,2,3,4,5,6,7,8],[9,10,11,12,13,14,15,16],[3,1,4,1,5,9,2,6],[2,7,1,8,2,8,1,8]]",
    )
}

/// A copy of the llama fixture in `dir`: every stored tensor through `edit` (name, f32
/// values), the config through `config`.
fn edited_model(
    dir: &Path,
    edit: impl Fn(&str, &mut [f32]),
    config: impl Fn(&mut serde_json::Value),
) -> String {
    let src = llama();
    std::fs::create_dir_all(dir).unwrap();
    let mut cfg = common::read_json(src.join("config.json"));
    config(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<common::RawTensor> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let mut v: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            edit(&name, &mut v);
            let data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            (name, safetensors::Dtype::F32, view.shape().to_vec(), data)
        })
        .collect();
    common::write_safetensors(&dir.join("model.safetensors"), &tensors);
    dir.display().to_string()
}

/// The llama fixture in `dir` with every value of weight `name` set to `value`.
fn filled_model(dir: &Path, name: &str, value: f32) -> String {
    edited_model(
        dir,
        |n, v| {
            if n == name {
                v.fill(value);
            }
        },
        |_| {},
    )
}

#[test]
fn optimizer_and_run_flags_outside_their_domains_name_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tokens(tmp.path());
    let model = llama().display().to_string();
    // Further flags, and what the error says.
    let cases = [
        ("--lr NaN", "--lr: must be finite and > 0 (found NaN)"),
        ("--lr inf", "--lr: must be finite and > 0 (found inf)"),
        ("--lr=-1e-3", "--lr: must be finite and > 0 (found -0.001)"),
        ("--lr 0", "--lr: must be finite and > 0 (found 0)"),
        ("--beta1 1.5", "--beta1: must be in [0, 1) (found 1.5)"),
        ("--beta1=-0.1", "--beta1: must be in [0, 1) (found -0.1)"),
        ("--beta2 1.0", "--beta2: must be in [0, 1) (found 1)"),
        ("--beta2 NaN", "--beta2: must be in [0, 1) (found NaN)"),
        ("--eps 0", "--eps: must be finite and > 0 (found 0)"),
        ("--eps inf", "--eps: must be finite and > 0 (found inf)"),
        (
            "--weight-decay=-0.1",
            "--weight-decay: must be finite and >= 0 (found -0.1)",
        ),
        (
            "--weight-decay NaN",
            "--weight-decay: must be finite and >= 0 (found NaN)",
        ),
        ("--steps 0", "--steps must be at least 1 (found 0)"),
        ("--timeout 0", "--timeout must be at least 1 (found 0)"),
        (
            "--mesh pp=2 --virtual-stages 0",
            "--virtual-stages must be at least 1 (found 0)",
        ),
    ];
    let save = tmp.path().join("ckpt");
    let save_s = save.display().to_string();
    for (extra, needle) in cases {
        let mut args = vec!["train", &model, "--tokens", &ids, "--export", &save_s];
        args.extend(extra.split_whitespace());
        let out = fails_with(&args, &[needle]);
        assert!(!out.contains("step 1"), "{extra:?}: it trained:\n{out}");
        assert!(!save.exists(), "{extra:?}: a checkpoint was written");
    }
    // Checked before the model is even read.
    fails_with(
        &[
            "train",
            "/definitely/missing",
            "--tokens",
            &ids,
            "--beta2",
            "1",
        ],
        &["--beta2"],
    );
    // `run`'s float flag.
    let out = tmp.path().join("out.json").display().to_string();
    for t in ["0", "NaN", "inf", "-1"] {
        let (ok, _, err) = run_shardc(
            &[
                "run",
                &model,
                "--tokens",
                &ids,
                "--out",
                &out,
                &format!("--comm-timeout={t}"),
            ],
            &[],
        );
        assert!(!ok && err.contains("--comm-timeout"), "{t}: {err}");
        assert!(!err.contains("panicked"), "{t}: {err}");
    }
}

#[test]
fn launched_ranks_refuse_bad_flags_too() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tokens(tmp.path());
    let model = llama().display().to_string();
    let out = shardc_clean()
        .args(["launch", "--nproc-per-node", "2", "--", "train", &model])
        .args(["--tokens", &ids, "--mesh", "dp=2", "--lr", "NaN"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for r in 0..2 {
        assert!(
            err.contains(&format!(
                "[rank {r}] error: --lr: must be finite and > 0 (found NaN)"
            )),
            "{err}"
        );
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn non_finite_weights_are_refused_at_load_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let ids = tokens(d);
    let model = edited_model(
        &d.join("nan"),
        |name, v| {
            if name == "model.layers.0.self_attn.q_proj.weight" {
                v[17] = f32::NAN;
                v[20] = f32::INFINITY;
                v[30] = f32::NAN;
            }
        },
        |_| {},
    );
    let want = "tensor model.layers.0.self_attn.q_proj.weight has 3 non-finite values (first at index 17: NaN)";
    let out = d.join("out.json");
    let out_s = out.display().to_string();
    for mesh in [&[][..], &["--mesh", "tp=2"]] {
        let mut args = vec!["run", &model, "--tokens", &ids, "--out", &out_s];
        args.extend_from_slice(mesh);
        fails_with(&args, &["model.safetensors", want]);
        assert!(!out.exists(), "{mesh:?}: an output was written");
    }
    let save = d.join("ckpt").display().to_string();
    for mesh in [&[][..], &["--mesh", "dp=2,tp=2"]] {
        let mut args = vec!["train", &model, "--tokens", &ids, "--export", &save];
        args.extend_from_slice(mesh);
        fails_with(&args, &[want]);
        assert!(
            !d.join("ckpt").exists(),
            "{mesh:?}: a checkpoint was written"
        );
    }
    // One infinite value among finite ones: counted and located.
    let one = edited_model(
        &d.join("inf"),
        |name, v| {
            if name == "model.norm.weight" {
                v[63] = f32::NEG_INFINITY;
            }
        },
        |_| {},
    );
    fails_with(
        &["run", &one, "--tokens", &ids, "--out", &out_s],
        &["tensor model.norm.weight has 1 non-finite value (first at index 63: -inf)"],
    );
}

#[test]
fn non_finite_outputs_are_refused_not_written_as_null() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let ids = tokens(d);
    let out = d.join("out.json");
    let out_s = out.display().to_string();
    // Finite weights whose logits overflow f32.
    let huge = filled_model(&d.join("huge"), "lm_head.weight", 3e38);
    for mesh in [&[][..], &["--mesh", "tp=2"]] {
        let mut args = vec!["run", &huge, "--tokens", &ids, "--out", &out_s];
        args.extend_from_slice(mesh);
        fails_with(
            &args,
            &["output `logits` [4, 8, 256] has 8192 non-finite values (first at [0, 0, 0]: inf)"],
        );
        assert!(!out.exists(), "{mesh:?}: an output was written");
    }
    // A negative norm epsilon takes the square root of negative numbers: refused when the
    // config is read or when the outputs come out NaN, never written.
    let eps = edited_model(
        &d.join("eps"),
        |_, _| {},
        |c| c["rms_norm_eps"] = (-1.0).into(),
    );
    fails_with(&["run", &eps, "--tokens", &ids, "--out", &out_s], &[]);
    assert!(!out.exists(), "an output was written");
    // The sound fixture still runs and writes only numbers.
    let model = llama().display().to_string();
    let (ok, _, err) = run_shardc(&["run", &model, "--tokens", &ids, "--out", &out_s], &[]);
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(!text.contains("null"), "{text}");
}

/// `train` with `extra` and `--export`/`--dump-grads` into `d`, which already holds an earlier
/// checkpoint: it fails naming `needle`, prints the steps before, and leaves both outputs as
/// they were.
fn diverges(d: &Path, ids: &str, extra: &[&str], needle: &str, steps_before: usize) {
    let ckpt = d.join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    std::fs::write(ckpt.join("config.json"), "before").unwrap();
    std::fs::write(ckpt.join("model.safetensors"), "before").unwrap();
    let grads = d.join("grads.safetensors");
    let model = llama().display().to_string();
    let (ckpt_s, grads_s) = (ckpt.display().to_string(), grads.display().to_string());
    let mut args = vec!["train", &model, "--tokens", ids, "--export", &ckpt_s];
    args.extend(["--dump-grads", &grads_s]);
    args.extend_from_slice(extra);
    let out = fails_with(&args, &[needle]);
    for s in 1..=steps_before {
        assert!(
            out.contains(&format!("step {s}: loss ")),
            "{extra:?}:\n{out}"
        );
    }
    assert!(
        !out.contains(&format!("step {}: loss", steps_before + 1)),
        "{extra:?}:\n{out}"
    );
    let mut kept: Vec<_> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    kept.sort();
    assert_eq!(
        kept,
        [
            ("config.json".into(), b"before".to_vec()),
            ("model.safetensors".into(), b"before".to_vec())
        ],
        "{extra:?}: the checkpoint directory changed"
    );
    assert!(!grads.exists(), "{extra:?}: gradients were written");
}

#[test]
fn diverging_training_stops_at_the_step_and_saves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tokens(tmp.path());
    let meshes: [&[&str]; 4] = [
        &[],
        &["--mesh", "dp=2,tp=2"],
        &["--mesh", "pp=2", "--micro-batches", "2"],
        &[
            "--mesh",
            "pp=2,dp=2",
            "--micro-batches",
            "2",
            "--strategy",
            "zero1",
        ],
    ];
    for mesh in meshes {
        // A huge learning rate: step 1 is fine, its update blows the weights up, step 2's
        // forward pass overflows.
        let mut extra = vec!["--lr", "1e30", "--steps", "5"];
        extra.extend_from_slice(mesh);
        diverges(
            tmp.path(),
            &ids,
            &extra,
            "step 2, micro-batch 0: loss is NaN",
            1,
        );
        // The last step's update overflows (the loss and gradients are finite): nothing of it
        // is kept.
        let mut extra = vec!["--lr", "3e38", "--weight-decay", "1"];
        extra.extend_from_slice(mesh);
        diverges(
            tmp.path(),
            &ids,
            &extra,
            "step 1: model.embed_tokens.weight after the optimizer update is -inf",
            0,
        );
    }
}

#[test]
fn huge_finite_weights_overflow_the_first_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let ids = tokens(d);
    // Finite but huge: the norm scale overflows the hidden states, and the loss.
    let model = filled_model(&d.join("big"), "model.norm.weight", 1e38);
    for mesh in [&[][..], &["--mesh", "dp=2,tp=2"]] {
        let mut args = vec!["train", &model, "--tokens", &ids, "--steps", "3"];
        args.extend_from_slice(mesh);
        fails_with(&args, &["step 1, micro-batch 0: loss is "]);
    }
}

#[test]
fn launched_ranks_all_fail_on_a_non_finite_step() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tokens(tmp.path());
    let model = llama().display().to_string();
    let cases: [(&str, &[&str], &str); 3] = [
        (
            "dp=2",
            &["--lr", "1e30", "--steps", "4"],
            "step 2, micro-batch 0: loss is NaN",
        ),
        (
            "pp=2",
            &[
                "--micro-batches",
                "2",
                "--lr",
                "3e38",
                "--weight-decay",
                "1",
            ],
            "step 1: model.embed_tokens.weight after the optimizer update is -inf",
        ),
        (
            "dp=2,tp=2",
            &["--lr", "3e38", "--weight-decay", "1"],
            "step 1: model.embed_tokens.weight after the optimizer update is -inf",
        ),
    ];
    for (mesh, extra, needle) in cases {
        let n: usize = mesh
            .split(',')
            .map(|a| a.split_once('=').unwrap().1.parse::<usize>().unwrap())
            .product();
        let nproc = n.to_string();
        let out = shardc_clean()
            .args([
                "launch",
                "--nproc-per-node",
                &nproc,
                "--timeout",
                "120",
                "--",
            ])
            .args(["train", &model, "--tokens", &ids, "--mesh", mesh])
            .args(["--timeout", "30"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{mesh}: {err}");
        assert!(!err.contains("panicked"), "{mesh}: {err}");
        assert!(
            err.lines().last().unwrap().starts_with("error: rank "),
            "{mesh}: {err}"
        );
        // Every rank fails (none left waiting), the first with the root cause.
        for r in 0..n {
            assert!(
                err.contains(&format!("[rank {r}] error: ")),
                "{mesh}: {err}"
            );
        }
        assert!(err.contains(needle), "{mesh}: {err}");
    }
}

/// The executor names the micro-batch of a non-finite loss from the training graph's
/// `mb<k>.` node prefix: micro-batch 1's loss alone is NaN here (a NaN embedding row of a
/// token only it reads, put into the state directly: a checkpoint with it is refused).
#[test]
fn the_micro_batch_of_a_non_finite_loss_is_named() {
    let dir = llama();
    let cfg = ModelConfig::from_path(&dir).unwrap();
    let w = Weights::open(&dir).unwrap();
    let mut ids: Vec<i32> = (0..32).map(|i| i % 50 + 1).collect();
    ids[3 * 8 + 5] = 200;
    let batch = Batch::causal_lm(ids, 4, 8);
    let poison = |state: &mut TrainState, params: Vec<&shardc::compiler::autodiff::TrainParam>| {
        let embed = params
            .iter()
            .find(|p| p.source.name == "model.embed_tokens.weight")
            .unwrap();
        let t = state.params.get_mut(&embed.label).unwrap();
        let h = t.shape[1];
        if let shardc::runtime::Buffer::F32(v) = &mut t.data {
            v[200 * h..201 * h].fill(f32::NAN);
        }
    };
    // The weights' bits (NaN included) by label.
    let bits = |state: &TrainState| -> Vec<(String, Vec<u32>)> {
        state
            .params
            .iter()
            .map(|(l, t)| {
                (
                    l.clone(),
                    t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect(),
                )
            })
            .collect()
    };
    let expect = |what: &str, r: Result<(), TrainError>| match r {
        Err(TrainError::NonFinite {
            step: 1,
            micro: Some(1),
            what: w,
            value,
        }) => assert!(w == "loss" && value.is_nan(), "{what}: {w} {value}"),
        other => panic!("{what}: {other:?}"),
    };
    for mesh in ["", "dp=2"] {
        let mesh = if mesh.is_empty() {
            Mesh::single()
        } else {
            Mesh::parse(mesh, 8).unwrap()
        };
        let mut o = TrainOptions::new(4, 8, mesh.clone());
        o.micro_batches = 2;
        let c = compile_train(&cfg, &o).unwrap();
        let plan = c.plan("", cfg.arch.name(), cfg.layers, Precision::f32());
        let mut state = TrainState::load(&plan, &w).unwrap();
        poison(&mut state, c.train.params.iter().collect());
        let before = bits(&state);
        let r = train_step(&plan, &mut state, &batch, &w, Duration::from_secs(30));
        expect(&mesh.to_string(), r.map(|_| ()));
        assert_eq!(state.step, 0, "{mesh}: a failed step counted");
        assert!(
            bits(&state) == before,
            "{mesh}: a failed step changed the weights"
        );
    }
    for (mesh, schedule) in [
        ("pp=2", ScheduleKind::OneFOneB),
        ("pp=2,dp=2", ScheduleKind::Gpipe),
    ] {
        let mut o = TrainOptions::new(4, 8, Mesh::parse(mesh, 8).unwrap());
        o.micro_batches = 2;
        o.pipeline = PipelineOptions {
            schedule,
            virtual_stages: 1,
            stage_layers: None,
        };
        let c = compile_pipeline(&cfg, &o).unwrap();
        let plan = c.plan("", cfg.arch.name(), cfg.layers, Precision::f32());
        let mut state = TrainState::load(&plan, &w).unwrap();
        poison(&mut state, c.params().collect());
        let before = bits(&state);
        let r = pipeline_step(&plan, &mut state, &batch, Duration::from_secs(30), &w);
        expect(mesh, r.map(|_| ()));
        assert_eq!(state.step, 0, "{mesh}: a failed step counted");
        assert!(
            bits(&state) == before,
            "{mesh}: a failed step changed the weights"
        );
    }
}
