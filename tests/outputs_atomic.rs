//! Writes never lose data: no output replaces a file the command reads (unless `--overwrite`,
//! and then atomically), a failed or killed command leaves no partial file, and a checkpoint is
//! published whole or not at all.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn shardc(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_shardc"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A private copy of the llama fixture (config.json + model.safetensors).
fn model_copy(dir: &Path) -> PathBuf {
    let src = common::fixtures().join("llama");
    let m = dir.join("model");
    fs::create_dir_all(&m).unwrap();
    for f in ["config.json", "model.safetensors"] {
        fs::copy(src.join(f), m.join(f)).unwrap();
    }
    m
}

fn tokens(dir: &Path) -> PathBuf {
    let p = dir.join("ids.json");
    fs::write(&p, "[[1,2,3,4,5,6,7,8],[9,10,11,12,13,14,15,16]]").unwrap();
    p
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| (e.path(), fs::read(e.path()).unwrap_or_default()))
        .collect();
    v.sort();
    v
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A fresh directory with a private copy of the llama fixture and a token file.
struct Setup {
    tmp: tempfile::TempDir,
    model: PathBuf,
    ids: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        let tmp = tempfile::tempdir().unwrap();
        let (model, ids) = (model_copy(tmp.path()), tokens(tmp.path()));
        Setup { tmp, model, ids }
    }

    /// `shardc <cmd> <model> --tokens <ids> <extra>...`.
    fn on_model(&self, cmd: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
        let args = [&[cmd, s(&self.model), "--tokens", s(&self.ids)], extra].concat();
        shardc(&args, env)
    }
}

#[test]
fn train_save_onto_the_model_it_reads_is_refused_and_changes_nothing() {
    let t = Setup::new();
    let model = &t.model;
    let before = snapshot(model);
    let o = t.on_model("train", &["--export", s(model)], &[]);
    assert!(!o.status.success(), "saving over the model must fail");
    let err = stderr(&o);
    assert!(err.starts_with("error: --export"), "{err}");
    assert!(err.contains("would overwrite the input"), "{err}");
    assert!(err.contains("--overwrite"), "{err}");
    assert_eq!(snapshot(model), before, "the model directory changed");
    // Same through a file name: `--dump-grads` onto the weights.
    let st = model.join("model.safetensors");
    let o = t.on_model("train", &["--dump-grads", s(&st)], &[]);
    assert!(stderr(&o).contains("--dump-grads"), "{}", stderr(&o));
    assert_eq!(snapshot(model), before);
}

#[test]
fn overwrite_replaces_the_model_atomically_with_a_loadable_checkpoint() {
    let t = Setup::new();
    let model = &t.model;
    fs::write(model.join("tokenizer.json"), "{}").unwrap();
    let cfg = fs::read(model.join("config.json")).unwrap();
    let w0 = fs::read(model.join("model.safetensors")).unwrap();
    let o = t.on_model("train", &["--export", s(model), "--overwrite"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(fs::read(model.join("config.json")).unwrap(), cfg);
    let w1 = fs::read(model.join("model.safetensors")).unwrap();
    assert_eq!(w1.len(), w0.len());
    assert_ne!(w1, w0, "the trained weights were written");
    assert_eq!(fs::read(model.join("tokenizer.json")).unwrap(), b"{}");
    // Nothing else left beside it, and the new checkpoint runs.
    assert_eq!(fs::read_dir(t.tmp.path()).unwrap().count(), 2);
    let out = t.tmp.path().join("out.json");
    let o = t.on_model("run", &["--out", s(&out)], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn run_out_onto_an_input_is_refused() {
    let t = Setup::new();
    let ids = &t.ids;
    let before = fs::read(ids).unwrap();
    let o = t.on_model("run", &["--out", s(ids)], &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--out"), "{}", stderr(&o));
    assert_eq!(fs::read(ids).unwrap(), before);
    let cfg = t.model.join("config.json");
    let before = fs::read(&cfg).unwrap();
    let o = shardc(&["compile", s(&cfg), "--mesh", "tp=2", "-o", s(&cfg)], &[]);
    assert!(stderr(&o).contains("error: -o"), "{}", stderr(&o));
    assert_eq!(fs::read(&cfg).unwrap(), before);
}

#[test]
fn save_into_a_directory_of_other_files_is_refused() {
    let t = Setup::new();
    let other = t.tmp.path().join("mine");
    fs::create_dir(&other).unwrap();
    fs::write(other.join("notes.txt"), "keep me").unwrap();
    let o = t.on_model("train", &["--export", s(&other)], &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("notes.txt"), "{}", stderr(&o));
    assert_eq!(snapshot(&other).len(), 1);
}

#[test]
fn a_save_killed_before_publishing_leaves_the_previous_checkpoint_intact() {
    let t = Setup::new();
    let ckpt = t.tmp.path().join("ckpt");
    let steps = |n| ["--steps", n, "--export", s(&ckpt)];
    let o = t.on_model("train", &steps("1"), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let first = snapshot(&ckpt);
    // A second run, two steps, killed after writing and before publishing.
    let kill = [("SHARDC_TEST_KILL_DURING_SAVE", "1")];
    let o = t.on_model("train", &steps("2"), &kill);
    assert!(!o.status.success(), "the hook kills the process");
    assert_eq!(snapshot(&ckpt), first, "the previous checkpoint changed");
    // The next save publishes over it (and the dead run's staging is not in the checkpoint).
    let o = t.on_model("train", &steps("2"), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let second = snapshot(&ckpt);
    assert_eq!(second.len(), 2, "{second:?}");
    assert_ne!(second, first);
}

#[test]
fn failed_commands_leave_no_partial_output() {
    let t = Setup::new();
    let out = t.tmp.path().join("out.json");
    // A mesh that does not divide the model: nothing written.
    let o = t.on_model("run", &["--out", s(&out), "--mesh", "tp=3"], &[]);
    assert!(!o.status.success());
    let plan = t.tmp.path().join("plan.json");
    let o = shardc(
        &["compile", s(&t.model), "--mesh", "tp=3", "-o", s(&plan)],
        &[],
    );
    assert!(!o.status.success());
    let names: Vec<String> = fs::read_dir(t.tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let mut names = names;
    names.sort();
    assert_eq!(names, ["ids.json", "model"], "{names:?}");
}
