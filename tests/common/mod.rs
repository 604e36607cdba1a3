//! Shared helpers for the end-to-end tests: fixture loading and comparison.
#![allow(dead_code)]

use serde_json::Value;
use shardc::compiler::compile::Compiled;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::shard::ShardedGraph;
use shardc::runtime::spmd::run_spmd;
use shardc::runtime::{Tensor, Weights};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// `--mesh tp=2 --batch 2 --seq 16`: the small tensor-parallel shape the command-line tests
/// compile and simulate the tiny fixtures at.
pub const TINY_TP2: [&str; 6] = ["--mesh", "tp=2", "--batch", "2", "--seq", "16"];

/// The repository's fixture directory.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny")
}

/// The JSON value in the file at `path`.
pub fn read_json(path: impl AsRef<std::path::Path>) -> Value {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One reference case.
pub struct Case {
    pub model: String,
    pub name: String,
    pub batch: usize,
    pub seq: usize,
    pub ids: Vec<i32>,
    pub mask: Vec<f32>,
    pub pos: Vec<i32>,
    pub logits: Vec<f32>,
    pub hidden: Vec<f32>,
    pub json: Value,
}

fn flat_i64(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()))
        .collect()
}

pub fn flat_f32(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// The sum of a JSON object's unsigned values (a breakdown's parts).
pub fn sum_u64(v: &Value) -> u64 {
    let parts = v.as_object().expect("a JSON object").values();
    parts.map(|x| x.as_u64().expect("an unsigned value")).sum()
}

/// Every `reference_*.json` of every fixture model.
pub fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for model in ["gpt2", "llama", "mixtral"] {
        let dir = fixtures().join(model);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let n = p.file_name().unwrap().to_string_lossy().to_string();
                n.starts_with("reference_") && n.ends_with(".json")
            })
            .collect();
        files.sort();
        for f in files {
            let json = read_json(&f);
            let shape: Vec<usize> = json["logits_shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let (b, t) = (shape[0], shape[1]);
            let ids: Vec<i32> = flat_i64(&json["input_ids"])
                .into_iter()
                .map(|x| x as i32)
                .collect();
            let mask = match json.get("attention_mask") {
                Some(m) => flat_i64(m).into_iter().map(|x| x as f32).collect(),
                None => vec![1.0; b * t],
            };
            let pos = match json.get("position_ids") {
                Some(p) => flat_i64(p).into_iter().map(|x| x as i32).collect(),
                None => (0..b).flat_map(|_| 0..t as i32).collect(),
            };
            out.push(Case {
                model: model.to_string(),
                name: f.file_stem().unwrap().to_string_lossy().to_string(),
                batch: b,
                seq: t,
                ids,
                mask,
                pos,
                logits: flat_f32(&json["logits"]),
                hidden: flat_f32(&json["hidden"]),
                json,
            });
        }
    }
    out
}

impl Case {
    /// The case's fixture model: its config and weights.
    pub fn load_model(&self) -> (ModelConfig, Weights) {
        let dir = fixtures().join(&self.model);
        (
            ModelConfig::from_path(&dir).unwrap(),
            Weights::open(&dir).unwrap(),
        )
    }

    /// The graph inputs.
    pub fn inputs(&self) -> BTreeMap<String, Tensor> {
        let (b, t) = (self.batch, self.seq);
        BTreeMap::from([
            (
                "input_ids".to_string(),
                Tensor::i32(vec![b, t], self.ids.clone()),
            ),
            (
                "position_ids".to_string(),
                Tensor::i32(vec![b, t], self.pos.clone()),
            ),
            (
                "attention_mask".to_string(),
                Tensor::f32(vec![b, t], self.mask.clone()),
            ),
        ])
    }

    /// Max |Δ| over positions whose mask is 1 (rows of `width` values per token).
    pub fn max_diff(&self, got: &[f32], want: &[f32], width: usize) -> f32 {
        assert_eq!(
            got.len(),
            want.len(),
            "{} {}: output size",
            self.model,
            self.name
        );
        let mut m = 0f32;
        for (tok, (g, w)) in got.chunks(width).zip(want.chunks(width)).enumerate() {
            if self.mask[tok] == 0.0 {
                continue;
            }
            for (a, b) in g.iter().zip(w) {
                m = m.max((a - b).abs());
            }
        }
        m
    }

    /// Runs the sharded program `sg` of this case's model on every rank of its mesh (a failed
    /// run names `what`) and checks each rank's outputs, as `{label} rank {r}`.
    pub fn check_ranks(&self, sg: &ShardedGraph, w: &Weights, what: &str, label: &str) {
        let outs = run_ranks(sg, w, &self.inputs(), what);
        for (rank, out) in outs.iter().enumerate() {
            self.check(out, &format!("{label} rank {rank}"));
        }
    }

    /// Checks logits and hidden states against the reference (< 1e-4).
    pub fn check(&self, outputs: &BTreeMap<String, Tensor>, what: &str) {
        let logits = outputs["logits"].as_f32().unwrap();
        let hidden = outputs["hidden"].as_f32().unwrap();
        let vocab = self.logits.len() / (self.batch * self.seq);
        let width = self.hidden.len() / (self.batch * self.seq);
        let dl = self.max_diff(logits, &self.logits, vocab);
        let dh = self.max_diff(hidden, &self.hidden, width);
        assert!(
            dl < 1e-4 && dh < 1e-4,
            "{} {} {what}: max |Δlogit| {dl}, max |Δhidden| {dh}",
            self.model,
            self.name
        );
    }
}

/// Checks every fixture case compiled once per variant: `compile` gives the plan of a case
/// for a variant (`None` when the variant does not divide the case), which runs on thread
/// ranks of its mesh, is checked rank by rank and is then handed to `seen`. Returns the runs
/// checked.
pub fn check_every_case<V: std::fmt::Debug>(
    variants: &[V],
    compile: impl Fn(&ModelConfig, &Case, &V) -> Option<Compiled>,
    mut seen: impl FnMut(&Compiled),
) -> usize {
    let mut ran = 0;
    for case in cases() {
        let (cfg, w) = case.load_model();
        for v in variants {
            let Some(c) = compile(&cfg, &case, v) else {
                continue;
            };
            let what = format!("{} {} {v:?}", case.model, case.name);
            case.check_ranks(&c.sharded, &w, &what, &what);
            seen(&c);
            ran += 1;
        }
    }
    ran
}

/// Variables that would turn a plain `shardc run` into a rank (torchrun, Open MPI, PMI) or
/// trigger `shardc run`'s fault-injection test hook.
pub const RANK_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SHARDC_TEST_FAIL_RANK",
    "SHARDC_TEST_FAIL_MODE",
];

/// `shardc` with none of [`RANK_VARS`] inherited and no stdin.
pub fn shardc_clean() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_shardc"));
    for v in RANK_VARS {
        c.env_remove(v);
    }
    c.stdin(std::process::Stdio::null());
    c
}

/// Runs `shardc` as [`shardc_clean`] does, from the repository root, with `env` set and
/// `SHARDC_MAX_MEMORY` cleared unless `env` sets it: (success, stdout, stderr).
pub fn run_shardc(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut c = shardc_clean();
    c.env_remove("SHARDC_MAX_MEMORY");
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Expects `shardc args` to succeed; returns its stdout.
pub fn succeeds(args: &[&str]) -> String {
    let (ok, out, err) = run_shardc(args, &[]);
    assert!(ok, "{args:?} failed: {err}");
    out
}

/// Expects `shardc args` (with `env`) to fail with one `error:` line containing every
/// needle, and no panic; returns its stdout.
pub fn fails_with_env(args: &[&str], env: &[(&str, &str)], needles: &[&str]) -> String {
    let (ok, out, err) = run_shardc(args, env);
    assert!(!ok, "{args:?} should fail:\n{out}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: one line: {err}"
    );
    for n in needles {
        assert!(err.contains(n), "{args:?}: `{n}` not in: {err}");
    }
    out
}

/// [`fails_with_env`] with no extra environment.
pub fn fails_with(args: &[&str], needles: &[&str]) -> String {
    fails_with_env(args, &[], needles)
}

/// Asserts each of `names` was counted at least once in `counts`; `missing` says what a name
/// never counted means (`no ag_matmul in any rewritten plan`).
pub fn assert_each_counted<'a, K>(
    counts: &BTreeMap<K, usize>,
    names: impl IntoIterator<Item = &'a str>,
    missing: impl Fn(&str) -> String,
) where
    K: std::borrow::Borrow<str> + Ord + std::fmt::Debug,
{
    for name in names {
        assert!(
            counts.get(name).copied().unwrap_or(0) > 0,
            "{}: {counts:?}",
            missing(name)
        );
    }
}

/// The largest `|a[i] − b[i]|` over the pairs of `a` and `b`; NaN when any difference is.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |m, d| {
            if m.is_nan() || d.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}

/// The number in `line` between the first `marker` and the ` GiB` after it
/// (`gib_after("params 1.5 GiB", "params ")` is 1.5).
pub fn gib_after(line: &str, marker: &str) -> f64 {
    line.split(marker)
        .nth(1)
        .unwrap()
        .split(" GiB")
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Writes `text` to `dir/name`; returns its path as text (for a command line).
pub fn write_file(dir: &std::path::Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().to_string()
}

/// Two sequences of 4 token ids, written to `dir/ids.json`; returns its path.
pub fn tokens_2x4(dir: &std::path::Path) -> String {
    let p = dir.join("ids.json");
    std::fs::write(&p, "[[1, 2, 3, 4], [5, 6, 7, 8]]").unwrap();
    p.to_string_lossy().to_string()
}

/// Four sequences of 16 token ids below 256 (every fixture's vocabulary is at least 256),
/// written to `dir/toks.json`; returns its path.
pub fn tokens_4x16(dir: &std::path::Path) -> String {
    let rows: Vec<Vec<usize>> = (0..4)
        .map(|b| (0..16).map(|t| ((b * 16 + t) * 7919 + 13) % 256).collect())
        .collect();
    let p = dir.join("toks.json");
    std::fs::write(&p, serde_json::to_string(&rows).unwrap()).unwrap();
    p.to_string_lossy().to_string()
}

/// A tensor to write: name, dtype, shape, little-endian bytes.
pub type RawTensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// Writes `tensors` as the safetensors file `path`.
pub fn write_safetensors(path: &std::path::Path, tensors: &[RawTensor]) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, dt, s, d)| {
            let view = safetensors::tensor::TensorView::new(*dt, s.clone(), d).expect("view");
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("writing safetensors");
}

/// Starts `c` as rank `rank` of `world`, by hand as torchrun would (RANK, WORLD_SIZE,
/// MASTER_ADDR `addr`, MASTER_PORT `port`), with stdout and stderr piped.
pub fn spawn_rank(
    c: &mut std::process::Command,
    rank: usize,
    world: usize,
    addr: &str,
    port: u16,
) -> std::process::Child {
    c.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", addr)
        .env("MASTER_PORT", port.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// A TCP port free on 127.0.0.1 now (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Forward compile options: `batch` × `seq` on `mesh` (`""` for one rank) with `extra`
/// strategies.
pub fn compile_options(
    batch: usize,
    seq: usize,
    mesh: &str,
    extra: &[&str],
) -> shardc::compiler::compile::CompileOptions {
    use shardc::compiler::shard::Mesh;
    shardc::compiler::compile::CompileOptions {
        batch,
        seq,
        mesh: if mesh.is_empty() {
            Mesh::single()
        } else {
            Mesh::parse(mesh, 8).unwrap()
        },
        extra_strategies: extra.iter().map(|s| s.to_string()).collect(),
    }
}

/// Every rank's outputs of the sharded program `sg` on thread ranks of its mesh, fed the
/// global `inputs` (each rank takes its shard); a failure panics naming `what`.
pub fn run_ranks(
    sg: &ShardedGraph,
    w: &Weights,
    inputs: &BTreeMap<String, Tensor>,
    what: &str,
) -> Vec<BTreeMap<String, Tensor>> {
    run_spmd(&sg.graph, &sg.mesh, w, inputs, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// SplitMix64: a small pseudo-random stream, the same on every platform.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`, in steps of `2^-23`.
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}
