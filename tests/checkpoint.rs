//! Sharded checkpoints: state saved on one layout loads bit for bit on any other (fused,
//! transposed and stacked parameters included); training resumed on layout B after saving on
//! layout A equals uninterrupted training on B, on thread ranks and through `launch`; exports
//! are HuggingFace directories that reproduce the weights; a killed save leaves the previous
//! checkpoint; corrupt, missing or truncated chunks are errors naming the tensor and range.

mod common;

use common::{fails_with, fixtures, run_shardc};
use shardc::compiler::compile::{compile, CompileSpec, Job};
use shardc::compiler::model::ModelConfig;
use shardc::compiler::plan::Plan;
use shardc::compiler::shard::Mesh;
use shardc::compiler::train::{Precision, TrainOptions};
use shardc::runtime::checkpoint::{self, Checkpoint, DataPosition, SaveInfo, SavedModel};
use shardc::runtime::train::TrainState;
use shardc::runtime::{Tensor, Weights};
use std::path::{Path, PathBuf};

fn model(name: &str) -> PathBuf {
    fixtures().join(name)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Four sequences of eight tokens.
fn tokens(dir: &Path) -> PathBuf {
    let p = dir.join("t.json");
    std::fs::write(
        &p,
        "[[1,2,3,4,5,6,7,8],[9,10,11,12,13,14,15,16],[3,1,4,1,5,9,2,6],[2,7,1,8,2,8,1,8]]",
    )
    .unwrap();
    p
}

/// A training plan of `name` for `mesh`, `strategies` and `micro` micro-batches (4 × 8).
fn plan(name: &str, mesh: &str, strategies: &[&str], micro: usize) -> Plan {
    let cfg = ModelConfig::from_path(&model(name)).unwrap();
    let parsed = if mesh.is_empty() {
        Mesh::single()
    } else {
        Mesh::parse(mesh, 8).unwrap()
    };
    let mut o = TrainOptions::new(4, 8, parsed);
    o.extra_strategies = strategies.iter().map(|s| s.to_string()).collect();
    o.micro_batches = micro;
    let mut spec = CompileSpec::new(cfg, String::new(), Job::Train(Box::new(o)));
    spec.precision = Precision::f32();
    compile(&spec).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"))
}

/// The model's initial state with distinct, non-zero moments (so a moment read from the
/// wrong place shows) and step 7.
fn state_of(p: &Plan, w: &Weights) -> TrainState {
    let mut st = TrainState::load(p, w).unwrap();
    for (k, (name, t)) in st.m.iter_mut().enumerate() {
        let n = t.numel();
        let salt = name.len() as f32;
        *t = Tensor::f32(
            t.shape.clone(),
            (0..n)
                .map(|i| (i as f32 + salt) * 1e-3 + k as f32)
                .collect(),
        );
    }
    for (k, t) in st.v.values_mut().enumerate() {
        let n = t.numel();
        *t = Tensor::f32(
            t.shape.clone(),
            (0..n)
                .map(|i| 1.0 + (i * 7 % 13) as f32 + k as f32)
                .collect(),
        );
    }
    st.step = 7;
    st
}

fn info(w: &Weights) -> SaveInfo<'_> {
    SaveInfo {
        data: DataPosition {
            next_sample: 28,
            batch: 4,
            seq: 8,
            tokens: "blake3:test".into(),
        },
        model: SavedModel {
            source: "fixture".into(),
            arch: "test".into(),
            config: serde_json::json!({}),
        },
        weights: w,
        before_publish: None,
    }
}

/// Every layout's state round-trips through every other layout's save bit for bit: gpt2's
/// fused QKV and transposed Conv1D weights, mixtral's stacked experts, ZeRO-sharded moments,
/// pipeline chunks (and their tied embedding), expert and tensor splits.
#[test]
fn state_saved_on_any_layout_loads_bit_for_bit_on_any_other() {
    let layouts: &[(&str, &[&str], usize)] = &[
        ("", &[], 1),
        ("dp=2", &["zero1"], 1),
        ("tp=2", &["sp"], 1),
        ("dp=2", &["zero3"], 2),
        ("dp=2,cp=2", &["zero2"], 1),
        ("pp=2", &[], 2),
        ("pp=2,dp=2,tp=2", &[], 2),
    ];
    for name in ["llama", "gpt2", "mixtral"] {
        let w = Weights::open(model(name)).unwrap();
        let mut extra: Vec<(&str, &[&str], usize)> = layouts.to_vec();
        if name == "mixtral" {
            extra.push(("ep=2,tp=2", &["sp"], 1));
        }
        let plans: Vec<Plan> = extra
            .iter()
            .map(|(m, st, k)| plan(name, if m.is_empty() { "" } else { m }, st, *k))
            .collect();
        let truth = state_of(&plans[0], &w);
        let tmp = tempfile::tempdir().unwrap();
        for (i, a) in plans.iter().enumerate() {
            let dir = tmp.path().join(format!("a{i}"));
            checkpoint::save_global(&dir, a, &truth, &info(&w)).unwrap();
            let ck = Checkpoint::open(&dir).unwrap();
            ck.verify_data().unwrap();
            assert_eq!(ck.manifest.step, 7);
            assert_eq!(ck.manifest.files.len(), a.mesh.world_size());
            for b in &plans {
                let got = ck.load_state(b).unwrap();
                assert_eq!(
                    got, truth,
                    "{name}: saved on {} loaded on {}",
                    a.mesh, b.mesh
                );
                // Each rank of b reads its own blocks: equal to the truth there.
                for r in 0..b.mesh.world_size() {
                    // The rank's own blocks alone, as its trainer keeps them.
                    let locals = ck.load_locals(b, r).unwrap();
                    for piece in shardc::compiler::checkpoint::rank_pieces(b, r).unwrap() {
                        let p = &b.train.as_ref().unwrap().params[piece.param];
                        let want = block_of(&truth.of(piece.kind)[&p.label], &piece.block);
                        let local = &locals[&p.chunk][piece.kind.input_of(p)];
                        assert_eq!(local.shape, piece.block.shape);
                        assert_eq!(
                            local.as_f32().unwrap(),
                            &want[..],
                            "{name}: {} rank {r} `{}` {}",
                            b.mesh,
                            p.label,
                            piece.kind
                        );
                    }
                }
            }
        }
    }
}

/// The elements of block `b` of `t`, row-major.
fn block_of(t: &Tensor, b: &shardc::compiler::checkpoint::Block) -> Vec<f32> {
    let data = t.as_f32().unwrap();
    let r = t.shape.len();
    let mut strides = vec![1; r];
    for d in (0..r.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * t.shape[d + 1];
    }
    (0..b.numel())
        .map(|mut i| {
            let mut at = 0;
            for d in (0..r).rev() {
                at += (b.offset[d] + i % b.shape[d]) * strides[d];
                i /= b.shape[d];
            }
            data[at]
        })
        .collect()
}

/// `shardc train MODEL --tokens T ARGS`: the losses it printed by step, and its stdout.
fn train(name: &str, toks: &Path, args: &[&str]) -> (Vec<(u64, f32)>, String) {
    let m = model(name);
    let mut all = vec!["train", s(&m), "--tokens", s(toks)];
    all.extend_from_slice(args);
    let (ok, out, err) = run_shardc(&all, &[]);
    assert!(ok, "{all:?}:\n{out}\n{err}");
    (losses(&out), out)
}

/// The `step N: loss X` lines of a run (with or without a rank prefix).
fn losses(out: &str) -> Vec<(u64, f32)> {
    out.lines()
        .filter_map(|l| {
            let l = match l.strip_prefix("[rank ") {
                Some(rest) => rest.split_once("] ")?.1,
                None => l,
            };
            let rest = l.strip_prefix("step ")?;
            let (n, rest) = rest.split_once(": loss ")?;
            Some((n.parse().ok()?, rest.split(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// How two HuggingFace directories' tensors differ (same names and shapes required): the
/// largest elementwise difference, and how many of how many elements differ by more than
/// 1e-6.
fn weight_diff(a: &Path, b: &Path) -> (f32, usize, usize) {
    let (wa, wb) = (Weights::open(a).unwrap(), Weights::open(b).unwrap());
    assert_eq!(wa.names(), wb.names());
    let (mut max, mut off, mut total) = (0.0f32, 0, 0);
    for n in wa.names() {
        let (x, y) = (wa.get(&n).unwrap(), wb.get(&n).unwrap());
        assert_eq!(x.shape, y.shape, "`{n}`");
        for (p, q) in x.as_f32().unwrap().iter().zip(y.as_f32().unwrap()) {
            let d = (p - q).abs();
            assert!(!d.is_nan(), "`{n}`: NaN");
            max = max.max(d);
            off += usize::from(d > 1e-6);
            total += 1;
        }
    }
    (max, off, total)
}

/// A layout's `train` flags.
fn layout(name: &str) -> Vec<&'static str> {
    match name {
        "unsharded" => vec![],
        "dp=2" => vec!["--mesh", "dp=2"],
        "tp=2+sp" => vec!["--mesh", "tp=2", "--strategy", "sp"],
        "dp=2+zero3" => vec!["--mesh", "dp=2", "--strategy", "zero3"],
        "pp=2" => vec!["--mesh", "pp=2", "--micro-batches", "2"],
        "dp=2,tp=2,pp=2" => vec!["--mesh", "pp=2,dp=2,tp=2", "--micro-batches", "2"],
        "ep=2" => vec!["--mesh", "ep=2"],
        "ep=2,tp=2+sp" => vec!["--mesh", "ep=2,tp=2", "--strategy", "sp"],
        "dp=2,cp=2+zero1" => vec!["--mesh", "dp=2,cp=2", "--strategy", "zero1"],
        other => panic!("unknown layout {other}"),
    }
}

/// Train 2 steps on A and save; resume on B for a third: its loss and final weights equal
/// those of 3 uninterrupted steps on B — bit for bit when A is B. Across layouts the
/// reference itself moves: 3 uninterrupted steps on A and on B differ by the layouts' own
/// rounding (tensor parallelism sums in another order), about 2e-6, and AdamW's first
/// updates are ±lr whatever a gradient's size, so an element whose gradient is rounding noise
/// (0.1% of gpt2's) can land ±lr apart. Resumed training is held to that: its loss within
/// 2e-6 of the layouts' difference, at most as many elements more than 1e-6 off as A has
/// (plus 0.01% for step 3), none further off than A's worst plus one flipped update (2·lr).
#[test]
fn training_resumed_on_another_layout_equals_uninterrupted_training_there() {
    let pairs: &[(&str, &str, &str)] = &[
        ("llama", "unsharded", "dp=2"),
        ("llama", "dp=2", "unsharded"),
        ("llama", "dp=2", "tp=2+sp"),
        ("llama", "tp=2+sp", "dp=2"),
        ("llama", "tp=2+sp", "dp=2+zero3"),
        ("llama", "dp=2+zero3", "tp=2+sp"),
        ("llama", "dp=2+zero3", "pp=2"),
        ("llama", "pp=2", "dp=2+zero3"),
        ("llama", "pp=2", "dp=2,tp=2,pp=2"),
        ("llama", "dp=2,tp=2,pp=2", "unsharded"),
        ("llama", "dp=2,tp=2,pp=2", "dp=2,tp=2,pp=2"),
        ("llama", "dp=2,cp=2+zero1", "tp=2+sp"),
        ("llama", "pp=2", "dp=2,cp=2+zero1"),
        ("gpt2", "unsharded", "tp=2+sp"),
        ("gpt2", "tp=2+sp", "dp=2+zero3"),
        ("gpt2", "tp=2+sp", "tp=2+sp"),
        ("mixtral", "unsharded", "ep=2"),
        ("mixtral", "ep=2", "ep=2,tp=2+sp"),
        ("mixtral", "ep=2,tp=2+sp", "dp=2"),
        ("mixtral", "ep=2", "ep=2"),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let toks = tokens(tmp.path());
    let uninterrupted = |m: &str, l: &str, out: &Path| -> f32 {
        if !out.exists() {
            let mut args = layout(l);
            args.extend(["--steps", "3", "--export", s(out)]);
            let (losses, text) = train(m, &toks, &args);
            assert_eq!(losses.len(), 3, "{text}");
            std::fs::write(out.join("loss3"), losses[2].1.to_string()).unwrap();
        }
        std::fs::read_to_string(out.join("loss3"))
            .unwrap()
            .parse()
            .unwrap()
    };
    let mut report = Vec::new();
    for (i, (m, a, b)) in pairs.iter().enumerate() {
        let d = tmp.path().join(format!("p{i}"));
        let (ck, resumed) = (d.join("ck"), d.join("resumed"));
        let (ref_a, ref_b) = (
            tmp.path().join(format!("{m}-{a}")),
            tmp.path().join(format!("{m}-{b}")),
        );
        let (loss_a, loss_b) = (uninterrupted(m, a, &ref_a), uninterrupted(m, b, &ref_b));
        let mut args = layout(a);
        args.extend(["--steps", "2", "--save", s(&ck)]);
        train(m, &toks, &args);
        let mut args = layout(b);
        args.extend(["--resume", s(&ck), "--export", s(&resumed)]);
        let (third, out) = train(m, &toks, &args);
        assert!(
            out.contains("resumed") && out.contains("at step 2"),
            "{out}"
        );
        assert_eq!(third.len(), 1, "{out}");
        assert_eq!(third[0].0, 3, "the resumed run's step is the third: {out}");
        let (dw, off, total) = weight_diff(&ref_b, &resumed);
        if a == b {
            assert_eq!(third[0].1, loss_b, "{m} {a}: resumed on its own layout");
            assert_eq!(dw, 0.0, "{m} {a}: resumed on its own layout");
            report.push(format!("{m} {a} → {b}: bit for bit"));
            continue;
        }
        let (noise_w, noise_off, _) = weight_diff(&ref_a, &ref_b);
        let noise_l = (loss_a - loss_b).abs();
        let dl = (third[0].1 - loss_b).abs();
        assert!(
            dl <= noise_l + 2e-6,
            "{m} {a} → {b}: step 3 loss {} resumed vs {loss_b} uninterrupted ({loss_a} on {a})",
            third[0].1
        );
        assert!(
            off <= noise_off + total.div_ceil(10_000),
            "{m} {a} → {b}: {off} of {total} weights more than 1e-6 off (the layouts: {noise_off})"
        );
        assert!(
            dw <= noise_w.max(1e-6) + 2e-3,
            "{m} {a} → {b}: final weights differ by {dw} (the layouts by {noise_w})"
        );
        report.push(format!(
            "{m} {a} → {b}: Δloss {dl:.1e} (layouts {noise_l:.1e}); weights max Δ {dw:.1e} \
             (layouts {noise_w:.1e}), {off}/{total} > 1e-6 (layouts {noise_off})"
        ));
    }
    eprintln!("{}", report.join("\n"));
}

/// Runs `shardc ARGS` expecting success; its stdout.
fn ok(args: &[&str]) -> String {
    let (good, out, err) = run_shardc(args, &[]);
    assert!(good, "{args:?}:\n{out}\n{err}");
    out
}

/// The bytes of every tensor of a HuggingFace directory, by name, with dtype and shape.
fn tensor_bytes(dir: &Path) -> Vec<(String, String, Vec<usize>, Vec<u8>)> {
    let w = Weights::open(dir).unwrap();
    w.names()
        .into_iter()
        .map(|n| {
            let t = w.get(&n).unwrap();
            let bytes = t
                .as_f32()
                .unwrap()
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            (n.clone(), w.dtype(&n).unwrap(), w.shape(&n).unwrap(), bytes)
        })
        .collect()
}

/// Export of a saved checkpoint is the trained weights bit for bit (the HF directory
/// `train --export` writes from memory), loads in `run` with the same logits, and splits
/// into index-mapped shards that load the same; import → export → import on another mesh →
/// export reproduces the original model bit for bit.
#[test]
fn exports_reproduce_the_weights_and_imports_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let toks = tokens(tmp.path());
    for name in ["llama", "gpt2", "mixtral"] {
        let d = tmp.path().join(name);
        let (ck, live, exp, shards) = (
            d.join("ck"),
            d.join("live"),
            d.join("exported"),
            d.join("shards"),
        );
        let mesh: &[&str] = if name == "mixtral" {
            &["--mesh", "ep=2,tp=2", "--strategy", "sp"]
        } else {
            &["--mesh", "dp=2,tp=2", "--strategy", "sp,zero1"]
        };
        let mut args = mesh.to_vec();
        args.extend(["--steps", "2", "--save", s(&ck), "--export", s(&live)]);
        train(name, &toks, &args);
        ok(&["checkpoint", "export", s(&ck), s(&exp), "--dtype", "f32"]);
        assert_eq!(tensor_bytes(&exp), tensor_bytes(&live), "{name}");
        assert_eq!(
            std::fs::read(exp.join("config.json"))
                .map(|b| serde_json::from_slice::<serde_json::Value>(&b).unwrap())
                .unwrap(),
            serde_json::from_slice::<serde_json::Value>(
                &std::fs::read(model(name).join("config.json")).unwrap()
            )
            .unwrap(),
            "{name}: config.json"
        );
        let out = ok(&[
            "checkpoint",
            "export",
            s(&ck),
            s(&shards),
            "--max-shard-size",
            "100KB",
        ]);
        assert!(out.contains("-of-"), "{out}");
        assert!(shards.join("model.safetensors.index.json").is_file());
        assert!(!shards.join("model.safetensors").exists());
        assert_eq!(
            tensor_bytes(&shards),
            tensor_bytes(&live),
            "{name}: sharded export"
        );
        // `run` on the export equals `run` on the live weights.
        let logits = |m: &Path, tag: &str| -> String {
            let o = d.join(format!("{tag}.json"));
            ok(&["run", s(m), "--tokens", s(&toks), "--out", s(&o)]);
            std::fs::read_to_string(o).unwrap()
        };
        assert_eq!(logits(&exp, "a"), logits(&live, "b"), "{name}: run");
        assert_eq!(logits(&shards, "c"), logits(&live, "b"), "{name}: run");

        // import → export → import (another mesh) → export: the original, bit for bit.
        let (i1, e1, i2, e2) = (d.join("i1"), d.join("e1"), d.join("i2"), d.join("e2"));
        ok(&["checkpoint", "import", s(&model(name)), s(&i1)]);
        ok(&["checkpoint", "export", s(&i1), s(&e1)]);
        ok(&["checkpoint", "import", s(&e1), s(&i2), "--mesh", mesh[1]]);
        ok(&["checkpoint", "export", s(&i2), s(&e2)]);
        assert_eq!(
            tensor_bytes(&e2),
            tensor_bytes(&model(name)),
            "{name}: round trip"
        );
        // Training from the import equals training from the model.
        let (from_model, _) = train(name, &toks, &["--steps", "1"]);
        let (from_import, out) = train(name, &toks, &["--steps", "1", "--resume", s(&i2)]);
        assert!(out.contains("at step 0"), "{out}");
        assert_eq!(from_import, from_model, "{name}");
    }
}

/// `--save-every` keeps a step directory per save and `latest` on the newest; a save killed
/// before publishing leaves the previous step as the latest (and loadable), and the next save
/// of that step replaces the dead one's staging.
#[test]
fn periodic_saves_and_a_killed_save_leave_a_valid_latest() {
    let tmp = tempfile::tempdir().unwrap();
    let toks = tokens(tmp.path());
    let ck = tmp.path().join("ck");
    let (_, out) = train(
        "llama",
        &toks,
        &[
            "--mesh",
            "dp=2",
            "--steps",
            "3",
            "--save",
            s(&ck),
            "--save-every",
            "2",
        ],
    );
    assert_eq!(out.matches("checkpoint of step").count(), 2, "{out}");
    let latest = || std::fs::read_to_string(ck.join("latest")).unwrap();
    assert_eq!(latest().trim(), "step-00000003");
    assert!(ck.join("step-00000002/manifest.json").is_file());
    // Killed after writing step 4's data, before its manifest: step 3 stays the latest.
    let m = model("llama");
    let args = [
        "train",
        s(&m),
        "--tokens",
        s(&toks),
        "--mesh",
        "tp=2",
        "--resume",
        s(&ck),
        "--save",
        s(&ck),
    ];
    let (good, _, err) = run_shardc(&args, &[("SHARDC_TEST_KILL_DURING_SAVE", "1")]);
    assert!(!good, "the hook kills the process: {err}");
    assert_eq!(latest().trim(), "step-00000003");
    assert!(!ck.join("step-00000004").exists());
    let out = ok(&["checkpoint", "inspect", s(&ck)]);
    assert!(out.contains("step 3;"), "{out}");
    // The same through processes: rank 0 dies before publishing.
    let mut launched = vec!["launch", "--nproc-per-node", "2", "--"];
    launched.extend_from_slice(&args);
    let (good, _, _) = run_shardc(&launched, &[("SHARDC_TEST_KILL_DURING_SAVE", "1")]);
    assert!(!good);
    assert_eq!(latest().trim(), "step-00000003");
    // Then a save that completes.
    let out = ok(&args);
    assert!(out.contains("at step 3"), "{out}");
    assert_eq!(latest().trim(), "step-00000004");
    let names: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.contains("step-00000004.partial")),
        "{names:?}"
    );
}

/// Multi-process runs (`shardc launch`): each rank writes its own shards and reads only its
/// own blocks; a checkpoint saved by processes on dp=2 and resumed by processes on tp=2 trains
/// as the thread ranks do, and the two saves hold the same state.
#[test]
fn launched_ranks_save_and_resume_their_own_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let toks = tokens(tmp.path());
    let m = model("llama");
    let (pck, tck) = (tmp.path().join("procs"), tmp.path().join("threads"));
    let base = |mesh: &str, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["train", s(&m), "--tokens", s(&toks), "--mesh", mesh]
            .iter()
            .map(|x| x.to_string())
            .collect();
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let launch = |args: &[String]| -> String {
        let mut v = vec!["launch", "--nproc-per-node", "2", "--"];
        v.extend(args.iter().map(String::as_str));
        ok(&v)
    };
    let threads =
        |args: &[String]| -> String { ok(&args.iter().map(String::as_str).collect::<Vec<_>>()) };
    let save = ["--steps", "2", "--strategy", "zero1", "--save"];
    let mut a = base("dp=2", &save);
    a.push(s(&pck).into());
    let procs_out = launch(&a);
    let mut a = base("dp=2", &save);
    a.push(s(&tck).into());
    let threads_out = threads(&a);
    let (lp, lt) = (losses(&procs_out), losses(&threads_out));
    assert_eq!(lp.len(), 2, "{procs_out}");
    for (p, t) in lp.iter().zip(&lt) {
        assert!((p.1 - t.1).abs() < 2e-6, "{lp:?} vs {lt:?}");
    }
    // The same chunks, the same state (to within the two transports' rounding).
    let (cp, ct) = (
        Checkpoint::open(&pck).unwrap(),
        Checkpoint::open(&tck).unwrap(),
    );
    assert_eq!(cp.manifest.chunks.len(), ct.manifest.chunks.len());
    for (a, b) in cp.manifest.chunks.iter().zip(&ct.manifest.chunks) {
        assert_eq!(
            (&a.tensor, a.kind, &a.offset, a.rank),
            (&b.tensor, b.kind, &b.offset, b.rank)
        );
        let (x, y) = (
            cp.read_block(&a.tensor, a.kind, &a.block()).unwrap(),
            ct.read_block(&b.tensor, b.kind, &b.block()).unwrap(),
        );
        assert!(common::max_abs_diff(&x, &y) < 1e-6, "{}", a.describe());
    }
    // Resumed on tp=2 by processes and by threads: the same third step.
    let resume = |ck: &Path| {
        let mut v = base("tp=2", &["--strategy", "sp", "--resume"]);
        v.push(s(ck).into());
        v
    };
    let lp = losses(&launch(&resume(&pck)));
    let lt = losses(&threads(&resume(&tck)));
    assert_eq!(lp.len(), 1);
    assert_eq!(lp[0].0, 3);
    assert!((lp[0].1 - lt[0].1).abs() < 2e-6, "{lp:?} vs {lt:?}");
}

/// Corrupt, truncated, incomplete, overlapping or foreign checkpoints, and bad flags: one
/// error line naming the file, tensor, range or flag; nothing panics.
#[test]
fn damaged_checkpoints_are_named_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let toks = tokens(tmp.path());
    let good = tmp.path().join("good");
    train("llama", &toks, &["--mesh", "tp=2", "--save", s(&good)]);
    let m = model("llama");
    let resume = |dir: &Path, needles: &[&str]| {
        fails_with(
            &["train", s(&m), "--tokens", s(&toks), "--resume", s(dir)],
            needles,
        );
        fails_with(&["checkpoint", "inspect", s(dir)], needles);
    };
    let copy = |tag: &str| -> PathBuf {
        let d = tmp.path().join(tag);
        let step = d.join("step-00000001");
        std::fs::create_dir_all(&step).unwrap();
        for e in std::fs::read_dir(good.join("step-00000001")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), step.join(e.file_name())).unwrap();
        }
        std::fs::copy(good.join("latest"), d.join("latest")).unwrap();
        d
    };
    let manifest = |d: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(d.join("step-00000001/manifest.json")).unwrap())
            .unwrap()
    };
    let put = |d: &Path, v: &serde_json::Value| {
        std::fs::write(
            d.join("step-00000001/manifest.json"),
            serde_json::to_vec(v).unwrap(),
        )
        .unwrap()
    };
    // A flipped byte: the chunk's checksum names the file, tensor and range.
    let d = copy("flipped");
    let f = d.join("step-00000001/rank-00001.bin");
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();
    resume(
        &d,
        &[
            "rank-00001.bin",
            "fails its checksum",
            "model.",
            "bytes 0..",
        ],
    );
    // A truncated file.
    let d = copy("truncated");
    let f = d.join("step-00000001/rank-00000.bin");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 4)
        .unwrap();
    resume(&d, &["rank-00000.bin", "truncated"]);
    // A missing chunk: the tensor and the elements no chunk holds.
    let d = copy("missing");
    let mut v = manifest(&d);
    let gone = v["chunks"].as_array_mut().unwrap().remove(3);
    put(&d, &v);
    resume(&d, &[gone["tensor"].as_str().unwrap(), "are in no chunk"]);
    // The same chunk listed twice.
    let d = copy("overlap");
    let mut v = manifest(&d);
    let twice = v["chunks"][0].clone();
    v["chunks"].as_array_mut().unwrap().push(twice.clone());
    put(&d, &v);
    resume(&d, &[twice["tensor"].as_str().unwrap(), "overlap"]);
    // A chunk outside its tensor.
    let d = copy("outside");
    let mut v = manifest(&d);
    v["chunks"][0]["offset"][0] = serde_json::json!(100000);
    put(&d, &v);
    resume(&d, &["chunk 0", "outside the tensor's shape"]);
    // Another format version; not JSON; `latest` naming nothing; no checkpoint at all.
    let d = copy("version");
    let mut v = manifest(&d);
    v["format_version"] = serde_json::json!(99);
    put(&d, &v);
    resume(&d, &["format_version", "99"]);
    let d = copy("garbage");
    std::fs::write(d.join("step-00000001/manifest.json"), "{").unwrap();
    resume(&d, &["manifest.json", "not JSON"]);
    let d = copy("dangling");
    std::fs::write(d.join("latest"), "step-00000009\n").unwrap();
    resume(&d, &["latest", "step-00000009"]);
    resume(&tmp.path().join("nowhere"), &["not a checkpoint"]);
    // Another model's checkpoint.
    let g = tmp.path().join("gpt2ck");
    train("gpt2", &toks, &["--save", s(&g)]);
    fails_with(
        &["train", s(&m), "--tokens", s(&toks), "--resume", s(&g)],
        &["gpt2", "llama"],
    );
    // Flags.
    fails_with(
        &[
            "train",
            s(&m),
            "--tokens",
            s(&toks),
            "--save",
            s(&good),
            "--save-every",
            "0",
        ],
        &["--save-every"],
    );
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    fails_with(
        &["train", s(&m), "--tokens", s(&toks), "--save", s(&foreign)],
        &["notes.txt"],
    );
    let out = tmp.path().join("out");
    fails_with(
        &["checkpoint", "export", s(&good), s(&out), "--dtype", "f8"],
        &["--dtype", "f8"],
    );
    fails_with(
        &[
            "checkpoint",
            "export",
            s(&good),
            s(&out),
            "--max-shard-size",
            "5XB",
        ],
        &["--max-shard-size", "XB"],
    );
    fails_with(
        &["checkpoint", "inspect", s(&good), "--to-mesh", "tp=3"],
        &["tp"],
    );
}

/// `inspect` prints what the checkpoint holds and the copy to another mesh: an unsharded
/// target reads every stored byte once; every target rank reads at least its own blocks.
#[test]
fn inspect_plans_the_copy_to_another_mesh() {
    let tmp = tempfile::tempdir().unwrap();
    let toks = tokens(tmp.path());
    let ck = tmp.path().join("ck");
    train(
        "llama",
        &toks,
        &[
            "--mesh",
            "dp=2,tp=2",
            "--strategy",
            "sp,zero1",
            "--steps",
            "2",
            "--save",
            s(&ck),
        ],
    );
    let text = ok(&["checkpoint", "inspect", s(&ck), "--to-mesh", "pp=2,tp=2"]);
    for want in [
        "step 2;",
        "next sample 8",
        "saved from: mesh dp=2,tp=2 (dp,tp,sp,zero1), ZeRO 1",
        "rank-00003.bin",
        "checksums match",
        "reshard to mesh pp=2,tp=2",
        "rank 3 (pp=1,tp=1)",
    ] {
        assert!(text.contains(want), "`{want}` not in:\n{text}");
    }
    let json = |extra: &[&str]| -> serde_json::Value {
        let mut a = vec!["checkpoint", "inspect", s(&ck), "--json"];
        a.extend_from_slice(extra);
        serde_json::from_str(&ok(&a)).unwrap()
    };
    let v = json(&[]);
    assert_eq!(v["step"], 2);
    let stored = v["bytes"].as_u64().unwrap();
    let files: u64 = v["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(files, stored);
    let one = json(&["--to-mesh", "dp=1"]);
    let ranks = one["reshard"]["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 1);
    assert_eq!(ranks[0]["bytes"].as_u64().unwrap(), stored);
    let four = json(&["--to-mesh", "tp=4"]);
    let per: Vec<u64> = four["reshard"]["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(per.len(), 4);
    assert!(
        per.iter().all(|&b| b < stored && b * 4 >= stored),
        "{per:?} of {stored}"
    );
}
