//! What a forward plan returns (`--returns`): the last position's logits (compile's and
//! simulate's default: a vocabulary-parallel plan gathers `1/T` of the logits), every
//! position's (run's default), the final hidden states alone, or the causal-LM loss (the
//! partitioner's vocabulary-parallel cross-entropy: no logits gathered). Checked against the
//! every-position run on thread ranks and the transformers loss, unsharded and sharded.

mod common;

use common::{fails_with, gib_after, run_shardc, TINY_TP2};

const LLAMA: &str = "tests/fixtures/hf-tiny/llama";

fn run(dir: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let ids = dir.join("ids.json");
    std::fs::write(&ids, "[[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]").unwrap();
    let out = dir.join("out.json");
    let mut args = vec![
        "run",
        LLAMA,
        "--tokens",
        ids.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--overwrite",
    ];
    args.extend_from_slice(extra);
    common::succeeds(&args);
    common::read_json(&out)
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn last_and_hidden_are_slices_of_the_full_forward() {
    let dir = tempfile::tempdir().unwrap();
    for mesh in [
        &[][..],
        &["--mesh", "tp=2", "--strategy", "sp"],
        &["--mesh", "dp=2,tp=2"],
    ] {
        let full = run(dir.path(), mesh);
        let shape: Vec<usize> = serde_json::from_value(full["logits_shape"].clone()).unwrap();
        let [b, t, v] = shape[..] else {
            panic!("{shape:?}")
        };
        let logits = floats(&full["logits"]);
        let mut with = mesh.to_vec();
        with.extend_from_slice(&["--returns", "last"]);
        let last = run(dir.path(), &with);
        assert_eq!(
            last["logits_shape"],
            serde_json::json!([b, 1, v]),
            "{mesh:?}"
        );
        let want: Vec<f32> = (0..b)
            .flat_map(|i| logits[(i * t + t - 1) * v..(i * t + t) * v].to_vec())
            .collect();
        let d = common::max_abs_diff(&floats(&last["logits"]), &want);
        assert!(d < 1e-5, "{mesh:?}: last-position logits differ by {d}");
        let mut with = mesh.to_vec();
        with.extend_from_slice(&["--returns", "hidden"]);
        let hidden = run(dir.path(), &with);
        assert!(hidden.get("logits").is_none());
        assert_eq!(hidden["hidden_shape"], full["hidden_shape"]);
        let d = common::max_abs_diff(&floats(&hidden["hidden"]), &floats(&full["hidden"]));
        assert!(d < 1e-5, "{mesh:?}: hidden states differ by {d}");
    }
}

/// The default plan no longer gathers every position's logits: on Llama-3-8B, `dp=2,tp=4`
/// with sp, the per-rank traffic drops by the logits' gathers.
#[test]
fn compile_returns_the_last_position_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let traffic = |extra: &[&str]| -> (String, serde_json::Value) {
        let p = dir.path().join("p.json");
        let mut args = vec!["compile", "-o", p.to_str().unwrap(), "--overwrite"];
        args.extend_from_slice(extra);
        let out = common::succeeds(&args);
        let line = out
            .lines()
            .find(|l| l.starts_with("total per forward"))
            .unwrap()
            .to_string();
        let plan = common::read_json(&p);
        (line, plan)
    };
    let gib = |l: &str| gib_after(l, ", ");
    let (last, plan) = traffic(&[]);
    let (all, _) = traffic(&["--returns", "logits"]);
    assert!(gib(&last) < 0.7 * gib(&all), "{last} vs {all}");
    // The program's `logits` output is one position.
    let outputs = plan["program"]["outputs"].as_array().unwrap();
    let logits = outputs.iter().find(|o| o[0] == "logits").unwrap()[1]
        .as_u64()
        .unwrap();
    let node = &plan["program"]["nodes"][logits as usize];
    let dims = node["ty"]["dims"].as_array().unwrap();
    assert_eq!(dims[1]["size"], 1, "{node}");
}

#[test]
fn returns_is_refused_where_it_does_not_apply() {
    fails_with(
        &["compile", LLAMA, "--returns", "everything"],
        &["--returns `everything`: expected logits, last, hidden, loss"],
    );
    fails_with(
        &["compile", LLAMA, "--train", "--returns", "last"],
        &["--returns is what a forward plan returns"],
    );
    fails_with(
        &["simulate", "--train", "--returns", "last"],
        &["--returns is what a forward plan returns"],
    );
}

/// `--returns loss` on the fixture's tokens: the causal-LM loss transformers computed (the
/// training fixture's, at the same weights), unsharded, under tensor parallelism (the loss
/// vocabulary-parallel: no all-gather of logits in the plan), with sp and data parallelism,
/// and through a compiled plan file. A mask is refused by name (the loss is averaged over
/// every predicted position).
#[test]
fn the_loss_is_the_transformers_loss_on_every_mesh() {
    let fixture = std::path::Path::new(LLAMA);
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture.join("reference_b2_s16.json")).unwrap(),
    )
    .unwrap();
    let train = common::read_json(fixture.join("train_b2_s16.json"));
    let want = train["loss"].as_f64().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, reference["input_ids"].to_string()).unwrap();
    let out = dir.path().join("loss.json");
    let ids_s = ids.to_str().unwrap();
    let out_s = out.to_str().unwrap();
    let run = [
        "run",
        LLAMA,
        "--tokens",
        ids_s,
        "--out",
        out_s,
        "--overwrite",
    ];
    let loss_of = |extra: &[&str]| -> f64 {
        let (ok, _, err) = run_shardc(&[&run[..], extra].concat(), &[]);
        assert!(ok, "{extra:?}: {err}");
        let v = common::read_json(&out);
        v["loss"].as_f64().unwrap()
    };
    let meshes: [&[&str]; 4] = [
        &[],
        &["--mesh", "tp=2"],
        &["--mesh", "tp=4"],
        &["--mesh", "dp=2,tp=2", "--strategy", "sp"],
    ];
    for m in meshes {
        let mut extra = vec!["--returns", "loss"];
        extra.extend_from_slice(m);
        let got = loss_of(&extra);
        assert!((got - want).abs() < 1e-5, "{m:?}: loss {got} vs {want}");
    }
    // Through a plan file; its tensor-parallel program gathers no logits.
    let plan = dir.path().join("loss-plan.json");
    let plan_s = plan.to_str().unwrap();
    let args = [
        &["compile", LLAMA],
        &TINY_TP2[..],
        &["--returns", "loss", "-o", plan_s],
    ]
    .concat();
    let (ok, _, err) = run_shardc(&args, &[]);
    assert!(ok, "{err}");
    let p = common::read_json(&plan);
    for n in p["program"]["nodes"].as_array().unwrap() {
        let gathers_vocab = n["op"]["op"] == "all_gather"
            && n["ty"]["dims"]
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d["role"] == "vocab");
        assert!(!gathers_vocab, "{n}");
    }
    let got = loss_of(&["--plan", plan_s]);
    assert!((got - want).abs() < 1e-5, "plan: loss {got} vs {want}");
    let mask = dir.path().join("mask.json");
    std::fs::write(&mask, serde_json::json!(vec![vec![1; 16]; 2]).to_string()).unwrap();
    fails_with(
        &[
            &run[..],
            &[
                "--returns",
                "loss",
                "--attention-mask",
                mask.to_str().unwrap(),
            ],
        ]
        .concat(),
        &["--attention-mask with a plan returning the loss"],
    );
}
