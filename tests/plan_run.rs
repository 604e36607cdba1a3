//! The plan is what runs: a plan file compiled by `shardc compile` and executed by
//! `shardc run --plan` / `shardc train --plan` reproduces transformers' fixtures (forward
//! logits within 1e-4, rewritten plans included; training loss and every gradient within
//! 1e-5) for tp, sp, dp, ep, zero1, zero3 and pipelines (1F1B, interleaved) on thread ranks,
//! and through `shardc launch` in processes. Tokens of another shape, a plan of another model, a plan of
//! the other kind and flags that would recompile are each refused with a named error.

mod common;
mod train_support;

use shardc::compiler::ir::ValueRole;
use shardc::runtime::{Tensor, Weights};
use std::collections::BTreeMap;
use std::path::Path;

fn model(name: &str) -> String {
    common::fixtures().join(name).display().to_string()
}

fn ok(args: &[&str]) -> String {
    let (ok, out, err) = common::run_shardc(args, &[]);
    assert!(ok, "{args:?} failed:\n{out}\n{err}");
    out
}

/// `shardc run MODEL --plan PLAN --tokens IDS --out OUT`, before any further flags.
fn run_plan<'a>(m: &'a str, plan: &'a str, ids: &'a str, out: &'a str) -> Vec<&'a str> {
    vec!["run", m, "--plan", plan, "--tokens", ids, "--out", out]
}

/// `shardc train MODEL --plan PLAN --tokens TOKS`, before any further flags.
fn train_plan<'a>(m: &'a str, plan: &'a str, toks: &'a str) -> Vec<&'a str> {
    vec!["train", m, "--plan", plan, "--tokens", toks]
}

fn write_json(dir: &Path, name: &str, v: &serde_json::Value) -> String {
    let p = dir.join(name);
    std::fs::write(&p, v.to_string()).unwrap();
    p.display().to_string()
}

fn rows<T: serde::Serialize + Copy>(v: &[T], width: usize) -> serde_json::Value {
    serde_json::to_value(v.chunks(width).map(<[T]>::to_vec).collect::<Vec<_>>()).unwrap()
}

/// `shardc compile MODEL --mesh MESH [extra] --batch B --seq T -o DIR/NAME`: the plan's
/// path, or `None` when the mesh does not divide the model or batch.
fn try_compile(
    dir: &Path,
    name: &str,
    m: &str,
    mesh: &str,
    (b, t): (usize, usize),
    extra: &[&str],
) -> Option<String> {
    let plan = dir.join(name).display().to_string();
    let (b, t) = (b.to_string(), t.to_string());
    // Every position's logits, to compare with the fixtures'.
    let mut args = vec![
        "compile",
        m,
        "--mesh",
        mesh,
        "--batch",
        &b,
        "--seq",
        &t,
        "--returns",
        "logits",
    ];
    args.extend_from_slice(extra);
    args.extend(["-o", plan.as_str()]);
    let (ok, _, err) = common::run_shardc(&args, &[]);
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    ok.then_some(plan)
}

/// [`try_compile`] that must succeed.
fn compile(dir: &Path, name: &str, m: &str, mesh: &str, bt: (usize, usize)) -> String {
    try_compile(dir, name, m, mesh, bt, &[]).unwrap_or_else(|| panic!("compile {m} {mesh}"))
}

#[test]
fn compiled_forward_plans_reproduce_the_fixtures() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let meshes: &[(&str, &str, &[&str])] = &[
        ("gpt2", "tp=2", &[]),
        ("gpt2", "dp=2", &[]),
        ("llama", "tp=2", &["--strategy", "sp"]),
        ("llama", "dp=2,tp=2", &[]),
        // The rewriter's collectives and fused kernels run as the plan holds them.
        ("llama", "tp=2", &["--rewrite", "all"]),
        ("mixtral", "ep=2", &[]),
        ("mixtral", "ep=2,tp=2", &["--strategy", "sp"]),
    ];
    let mut ran = 0;
    for case in common::cases() {
        let m = model(&case.model);
        let ids = write_json(d, "ids.json", &rows(&case.ids, case.seq));
        let mask: Vec<i64> = case.mask.iter().map(|&x| x as i64).collect();
        let mask = write_json(d, "mask.json", &rows(&mask, case.seq));
        let pos = write_json(d, "pos.json", &rows(&case.pos, case.seq));
        for &(which, mesh, extra) in meshes.iter().filter(|(w, _, _)| *w == case.model) {
            // A mesh that does not divide this case is an error checked elsewhere.
            let bt = (case.batch, case.seq);
            let Some(plan) = try_compile(d, "plan.json", &m, mesh, bt, extra) else {
                continue;
            };
            let out = d.join("out.json").display().to_string();
            let mut args = run_plan(&m, &plan, &ids, &out);
            args.extend(["--attention-mask", &mask, "--position-ids", &pos]);
            let printed = ok(&args);
            assert!(printed.contains(&format!("mesh {mesh}")), "{printed}");
            let j = common::read_json(&out);
            let tensor = |k: &str| {
                let shape: Vec<usize> =
                    serde_json::from_value(j[format!("{k}_shape")].clone()).unwrap();
                let data: Vec<f32> = serde_json::from_value(j[k].clone()).unwrap();
                Tensor::f32(shape, data)
            };
            let outs = BTreeMap::from([
                ("logits".to_string(), tensor("logits")),
                ("hidden".to_string(), tensor("hidden")),
            ]);
            case.check(
                &outs,
                &format!("{which} {} plan {mesh} {extra:?}", case.name),
            );
            ran += 1;
        }
    }
    assert!(ran >= 8, "only {ran} plan runs");
}

#[test]
fn a_compiled_forward_plan_runs_under_launch() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let case = common::cases()
        .into_iter()
        .find(|c| c.model == "llama" && c.batch == 2 && c.mask.iter().all(|&x| x == 1.0))
        .expect("the llama b2 fixture");
    let m = model("llama");
    let ids = write_json(d, "ids.json", &rows(&case.ids, case.seq));
    let plan = compile(d, "plan.json", &m, "dp=2,tp=2", (case.batch, case.seq));
    let out = d.join("out.json").display().to_string();
    let mut args = vec!["launch", "--nproc-per-node", "4", "--"];
    args.extend(run_plan(&m, &plan, &ids, &out));
    args.extend(["--comm-timeout", "30"]);
    let printed = ok(&args);
    assert!(printed.contains("as rank 0 of 4 processes"), "{printed}");
    let j = common::read_json(&out);
    let logits: Vec<f32> = serde_json::from_value(j["logits"].clone()).unwrap();
    let hidden: Vec<f32> = serde_json::from_value(j["hidden"].clone()).unwrap();
    let shape = |k: &str| serde_json::from_value::<Vec<usize>>(j[k].clone()).unwrap();
    let outs = BTreeMap::from([
        (
            "logits".to_string(),
            Tensor::f32(shape("logits_shape"), logits),
        ),
        (
            "hidden".to_string(),
            Tensor::f32(shape("hidden_shape"), hidden),
        ),
    ]);
    case.check(&outs, "launched plan dp=2,tp=2");
}

/// The fixture's training tokens (`dup` copies of each sequence: the same loss and
/// gradients) as a tokens file.
fn train_tokens(dir: &Path, m: &str, dup: usize) -> String {
    let r = train_support::reference(m);
    let ids: Vec<i32> = r
        .ids
        .chunks(r.seq)
        .flat_map(|row| std::iter::repeat_n(row, dup).flatten().copied())
        .collect();
    write_json(dir, "toks.json", &rows(&ids, r.seq))
}

/// The loss of the printed `step 1: loss X` (after an optional `[rank 0] ` prefix).
fn first_loss(out: &str) -> f32 {
    out.lines()
        .find_map(|l| {
            let l = l.strip_prefix("[rank 0] ").unwrap_or(l);
            l.strip_prefix("step 1: loss ")?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no loss in:\n{out}"))
}

/// Compiles a training plan of `m` (`dup` copies of the fixture batch) and runs one step of
/// it with `shardc train --plan`; checks the loss and every dumped gradient against the
/// fixture (1e-5). Returns the plan's path.
fn train_plan_step(dir: &Path, m: &str, mesh: &str, dup: usize, extra: &[&str]) -> String {
    let r = train_support::reference(m);
    let md = model(m);
    let b = (r.batch * dup).to_string();
    let plan = dir.join("train.json").display().to_string();
    let mut args = vec![
        "compile", &md, "--train", "--mesh", mesh, "--batch", &b, "--seq", "16",
    ];
    args.extend_from_slice(extra);
    args.extend(["-o", plan.as_str()]);
    ok(&args);
    let toks = train_tokens(dir, m, dup);
    let grads = dir.join("grads.safetensors");
    let mut args = train_plan(&md, &plan, &toks);
    args.extend(["--dump-grads", grads.to_str().unwrap()]);
    let out = ok(&args);
    let what = format!("{m} {mesh} {extra:?}");
    let loss = first_loss(&out);
    assert!(
        (loss - r.loss).abs() < 1e-5,
        "{what}: loss {loss} vs {}",
        r.loss
    );
    let g = Weights::open(&grads).unwrap();
    let mut names = 0;
    for (name, want) in &r.grads {
        let got = g
            .get(&ValueRole::Gradient.name(name))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(got.shape, want.shape, "{what}: `{name}`");
        let d = common::max_abs_diff(got.as_f32().unwrap(), want.as_f32().unwrap());
        assert!(d < 1e-5, "{what}: gradient `{name}` off by {d}");
        names += 1;
    }
    assert_eq!(names, g.names().len(), "{what}: gradient names");
    plan
}

#[test]
fn compiled_training_plans_reproduce_the_fixtures() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // Model, mesh, copies of the fixture batch, further `compile` flags.
    let cases = [
        ("llama", "tp=2", 1, ""),
        ("llama", "tp=2", 1, "--strategy sp"),
        ("llama", "dp=2", 1, ""),
        ("llama", "dp=2", 1, "--strategy zero1 --micro-batches 1"),
        ("llama", "dp=2", 2, "--strategy zero3 --micro-batches 2"),
        ("mixtral", "ep=2", 1, ""),
        ("llama", "pp=2", 1, "--micro-batches 2 --schedule 1f1b"),
        (
            "llama",
            "pp=2",
            1,
            "--micro-batches 2 --schedule interleaved --virtual-stages 2",
        ),
        ("gpt2", "pp=2,dp=2", 2, "--micro-batches 2"),
    ];
    for (m, mesh, dup, extra) in cases {
        let extra: Vec<&str> = extra.split_whitespace().collect();
        train_plan_step(d, m, mesh, dup, &extra);
    }
}

#[test]
fn a_compiled_training_plan_runs_under_launch() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let plan = train_plan_step(d, "llama", "pp=2,dp=2", 2, &["--micro-batches", "2"]);
    let (md, toks) = (model("llama"), train_tokens(d, "llama", 2));
    let mut args = vec!["launch", "--nproc-per-node", "4", "--"];
    args.extend(train_plan(&md, &plan, &toks));
    args.extend(["--timeout", "30"]);
    let out = ok(&args);
    assert!(out.contains("as rank 0 of 4 processes (tcp)"), "{out}");
    let r = train_support::reference("llama");
    let loss = first_loss(&out);
    assert!(
        (loss - r.loss).abs() < 1e-5,
        "launched: loss {loss} vs {}",
        r.loss
    );
}

#[test]
fn plans_that_do_not_fit_the_run_are_named_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let (llama, gpt2) = (model("llama"), model("gpt2"));
    let fwd = compile(d, "fwd.json", &llama, "tp=2", (2, 16));
    let train = d.join("train.json").display().to_string();
    ok(&[
        "compile", &llama, "--train", "--mesh", "dp=2", "--batch", "2", "--seq", "16", "-o", &train,
    ]);
    let toks = train_tokens(d, "llama", 1);
    let short = write_json(
        d,
        "short.json",
        &serde_json::json!([[1, 2, 3, 4], [5, 6, 7, 8]]),
    );
    let small = write_json(d, "small.json", &rows(&(1..=32).collect::<Vec<i32>>(), 16));
    let out = d.join("out.json").display().to_string();
    // Tokens of another shape than the plan's.
    common::fails_with(
        &[
            "run", &llama, "--plan", &fwd, "--tokens", &short, "--out", &out,
        ],
        &["are [2, 4]", "compiled for batch 2 × seq 16"],
    );
    common::fails_with(
        &["train", &llama, "--plan", &train, "--tokens", &short],
        &["are [2, 4]", "compiled for batch 2 × seq 16"],
    );
    // A plan of another model: another architecture, or another depth.
    common::fails_with(
        &[
            "run", &gpt2, "--plan", &fwd, "--tokens", &small, "--out", &out,
        ],
        &["compiled for another model", "llama with 3 layers"],
    );
    let deep = train_support::deep_llama(4).display().to_string();
    common::fails_with(
        &["train", &deep, "--plan", &train, "--tokens", &toks],
        &["compiled for another model", "with 4 layers"],
    );
    // The same architecture and depth with another vocabulary: named by tensor.
    let gpt2_plan = compile(d, "gpt2.json", &gpt2, "tp=2", (2, 16));
    let narrow = d.join("narrow");
    std::fs::create_dir_all(&narrow).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixtures().join("gpt2/config.json")).unwrap(),
    )
    .unwrap();
    let vocab = cfg["vocab_size"].as_u64().unwrap() as usize;
    cfg["vocab_size"] = (vocab - 1).into();
    std::fs::write(narrow.join("config.json"), cfg.to_string()).unwrap();
    let w = Weights::open(common::fixtures().join("gpt2")).unwrap();
    let mut tensors = BTreeMap::new();
    let mut cut = String::new();
    for n in w.names() {
        let t = w.get(&n).unwrap();
        let t = if t.shape.first() == Some(&vocab) {
            cut = n.clone();
            let per: usize = t.shape[1..].iter().product();
            let mut shape = t.shape.clone();
            shape[0] -= 1;
            Tensor::f32(shape, t.as_f32().unwrap()[..(vocab - 1) * per].to_vec())
        } else {
            t
        };
        tensors.insert(n, t);
    }
    shardc::runtime::train::save_safetensors(&narrow.join("model.safetensors"), &tensors).unwrap();
    common::fails_with(
        &[
            "run",
            narrow.to_str().unwrap(),
            "--plan",
            &gpt2_plan,
            "--tokens",
            &small,
            "--out",
            &out,
        ],
        &["compiled for another model", &format!("`{cut}`")],
    );
    // The other kind of plan.
    common::fails_with(
        &["train", &llama, "--plan", &fwd, "--tokens", &toks],
        &["is a forward plan"],
    );
    common::fails_with(
        &[
            "run", &llama, "--plan", &train, "--tokens", &toks, "--out", &out,
        ],
        &["is a training plan"],
    );
    // Flags that describe a plan to compile, given with a compiled one.
    for (flag, value) in [("--mesh", "dp=2"), ("--strategy", "sp")] {
        common::fails_with(
            &[
                "run", &llama, "--plan", &fwd, "--tokens", &toks, "--out", &out, flag, value,
            ],
            &[&format!(
                "{flag} describes a plan to compile; --plan runs a compiled plan"
            )],
        );
    }
    for (flag, value) in [
        ("--mesh", "dp=2"),
        ("--strategy", "zero1"),
        ("--micro-batches", "2"),
        ("--recompute", "full"),
        ("--schedule", "gpipe"),
        ("--lr", "0.01"),
    ] {
        common::fails_with(
            &[
                "train", &llama, "--plan", &train, "--tokens", &toks, flag, value,
            ],
            &[&format!(
                "{flag} describes a plan to compile; --plan runs a compiled plan"
            )],
        );
    }
    // A plan file that is not one.
    common::fails_with(
        &["train", &llama, "--plan", &toks, "--tokens", &toks],
        &["plan", "toks.json"],
    );
}
