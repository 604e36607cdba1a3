//! A deterministic fuzz harness over every input file shardc reads: model `config.json`,
//! safetensors checkpoints, token / attention-mask / position-id files, calibration
//! measurements and cluster / device profiles. Inputs are real valid files mutated (bytes
//! flipped, truncated, numbers made huge, negative or NaN, JSON types changed, keys deleted
//! or duplicated) or generated, with a fixed seed and a fixed number of cases per target.
//!
//! Every case must end without a panic or a hang, and with either a valid result or an error
//! of one line that names the file, field or tensor at fault. In-process cases run on a
//! thread of their own with a deadline; binary cases are killed at theirs. Failures print
//! the case index and what was done to the input; the input is saved under
//! `target/tmp/fuzz-failures/`.
//!
//! Failures found in the config parser and size accounting are kept in [`KNOWN_OTHERS`] with
//! their reproducers: cases that hit them fail (`SHARDC_FUZZ_STRICT=0` only counts them), and
//! `known_others_are_fixed` checks each reproducer is a clean error.

mod common;
mod fuzz;

use fuzz::{
    all_keys, check_bin, check_message, duplicate_key, guarded, json_at, json_paths, known_panic,
    mutate_json, mutate_lines, mutate_text, path_text, reject, run_shardc, s, save_failure,
    scratch, special_value, Known, Outcome, Rng, Saved, Step, Tally, Verdict,
};
use serde_json::{json, Value};
use shardc::compiler::compile::{compile_forward, CompileOptions};
use shardc::compiler::cost::{
    collective_time, fit_profile_report, kernel_time, simulate_plan, Bytes, Cluster,
    CollectiveKind, ComputeOptions, DeviceProfile, GemmShape, GroupTopology, Kernel, Measurements,
    BUILTIN_PROFILES,
};
use shardc::compiler::ir::{DType, Op, ParamSource, TensorType};
use shardc::compiler::model::{build_forward, BuildOptions, ModelConfig, ModelStats};
use shardc::compiler::plan::Plan;
use shardc::compiler::shard::Mesh;
use shardc::runtime::Weights;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Deadline of one in-process case (they take milliseconds; this is for hangs only).
const CASE_TIMEOUT: Duration = Duration::from_secs(20);
/// Deadline of one run of the binary.
const BIN_TIMEOUT: Duration = Duration::from_secs(60);

/// Configs with more decoder layers than this are not built: the model size cap
/// (`model::limits::MAX_LAYERS`) refuses them at parse, so reaching this is the `size-caps`
/// failure.
const MAX_BUILT_LAYERS: usize = 2048;

/// Failures found in code other modules own. Each is counted where it occurs; the owner's fix
/// makes its cases pass, after which the entry goes (and `SHARDC_FUZZ_STRICT=1` runs them).
const KNOWN_OTHERS: &[Known] = &[
    Known {
        id: "size-caps",
        owner: "model config validation (compiler/src/model/config.rs: size caps)",
        file: "",
        msg: "",
        repro: r#"{"model_type":"llama","vocab_size":256,"hidden_size":64,"num_attention_heads":8,"num_hidden_layers":1000000000000,"intermediate_size":176} is accepted; building it never ends"#,
    },
    Known {
        id: "config-kv-heads-zero",
        owner: "model config validation (compiler/src/model/config.rs)",
        file: "compiler/src/model/config.rs",
        msg: "divisor of zero",
        repro: r#"{"model_type":"llama","vocab_size":256,"hidden_size":64,"num_attention_heads":8,"num_key_value_heads":0,"num_hidden_layers":1,"intermediate_size":176} panics: attempt to calculate the remainder with a divisor of zero"#,
    },
    Known {
        id: "config-overflow",
        owner: "model config validation (compiler/src/model/config.rs)",
        file: "compiler/src/model/config.rs",
        msg: "with overflow",
        repro: r#"{"model_type":"gpt2","vocab_size":256,"n_embd":18446744073709551615,"n_head":1,"n_layer":1,"n_positions":8} panics: attempt to multiply with overflow (4 * n_embd)"#,
    },
    Known {
        id: "stats-overflow",
        owner: "model config validation (size caps; panics in compiler/src/model/stats.rs)",
        file: "compiler/src/model/stats.rs",
        msg: "with overflow",
        repro: r#"{"model_type":"llama","vocab_size":128256,"hidden_size":4096000000,"num_attention_heads":32,"num_key_value_heads":8,"num_hidden_layers":32,"intermediate_size":14336} is accepted; inspect panics: attempt to add with overflow"#,
    },
    Known {
        id: "numel-overflow",
        owner: "model config validation (size caps; TensorType::numel in compiler/src/ir/types.rs)",
        file: "compiler/src/ir/types.rs",
        msg: "with overflow",
        repro: r#"{"model_type":"llama","vocab_size":9007199254740993,"hidden_size":8192,"num_attention_heads":64,"num_hidden_layers":1,"intermediate_size":28672} is accepted; inspect panics: attempt to multiply with overflow"#,
    },
];

fn known(id: &str) -> &'static Known {
    KNOWN_OTHERS
        .iter()
        .find(|k| k.id == id)
        .expect("invariant: a KNOWN_OTHERS id")
}

/// Adds one in-process outcome to the tally; a failure saves the input's files `saves`.
fn judge(
    t: &mut Tally,
    case: usize,
    how: &str,
    out: Outcome<Result<Verdict, String>>,
    saves: &[Saved],
) {
    let ok = match out {
        Outcome::Done(Ok(None)) => {
            t.accepted += 1;
            true
        }
        Outcome::Done(Ok(Some(msg))) => {
            t.reject(msg);
            true
        }
        Outcome::Done(Err(e)) => {
            t.fail(case, how, e);
            false
        }
        Outcome::Panic { msg, at } => match known_panic(KNOWN_OTHERS, &msg, &at) {
            Some(k) => {
                t.known(case, how, k);
                true
            }
            None => {
                t.fail(case, how, format!("panicked at {at}: {msg}"));
                false
            }
        },
        Outcome::Hang => {
            t.fail(case, how, format!("no result within {CASE_TIMEOUT:?}"));
            false
        }
    };
    if !ok {
        for &(target, ext, bytes) in saves {
            save_failure(target, case, ext, bytes);
        }
    }
}

/// The [`KNOWN_OTHERS`] entry of a panic the binary printed.
fn known_in_stderr(stderr: &str) -> Option<&'static Known> {
    let at = stderr.split_once("panicked at ")?.1;
    known_panic(KNOWN_OTHERS, at, at)
}

// =============================================================================================
// Model configs.

fn config_sources() -> Vec<(String, Value)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = ["llama", "gpt2", "mixtral"]
        .iter()
        .map(|m| common::fixtures().join(m).join("config.json"))
        .collect();
    let mut models: Vec<PathBuf> = std::fs::read_dir(root.join("models"))
        .expect("models/")
        .map(|e| e.expect("models/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    models.sort();
    files.extend(models);
    files
        .into_iter()
        .map(|p| {
            let v = common::read_json(&p);
            (s(&p), v)
        })
        .collect()
}

const MODEL_TYPES: &[&str] = &["llama", "gpt2", "mistral", "qwen2", "mixtral", "bert", ""];

/// Case `case` of the config target: the text and what was done to it.
fn config_case(case: usize, sources: &[(String, Value)], keys: &[&str]) -> (Vec<u8>, String) {
    let mut rng = Rng::for_case("config", case);
    let (name, base) = rng.pick(sources);
    let short = Path::new(name)
        .strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .map(s)
        .unwrap_or_else(|_| name.clone());
    let mut v = base.clone();
    match rng.below(10) {
        0..=5 => {
            let mut hows = Vec::new();
            for _ in 0..1 + rng.below(3) {
                hows.push(mutate_json(&mut rng, &mut v, keys));
            }
            let text = serde_json::to_vec_pretty(&v).expect("serialise");
            (text, format!("{short}: {}", hows.join("; ")))
        }
        6 => match duplicate_key(&mut rng, &v) {
            Some((text, how)) => (text.into_bytes(), format!("{short}: {how}")),
            None => (serde_json::to_vec(&v).expect("serialise"), short),
        },
        7 | 8 => {
            let mut text = serde_json::to_vec_pretty(&v).expect("serialise");
            let mut hows = Vec::new();
            for _ in 0..1 + rng.below(2) {
                hows.push(mutate_text(&mut rng, &mut text));
            }
            (text, format!("{short}: {}", hows.join("; ")))
        }
        _ => {
            // Generated: a random subset of the known keys with random values.
            let mut m = serde_json::Map::new();
            m.insert("model_type".into(), json!(rng.pick(MODEL_TYPES)));
            for _ in 0..rng.below(20) {
                let k = rng.pick(keys).to_string();
                let x = if rng.chance(0.5) {
                    json!(1 + rng.below(64))
                } else {
                    special_value(&mut rng)
                };
                m.insert(k, x);
            }
            let v = Value::Object(m);
            (
                serde_json::to_vec(&v).expect("serialise"),
                format!("generated {v}"),
            )
        }
    }
}

/// One config case in-process: parse, then (when it parses) build the graph and count what
/// `inspect` prints. see [`fuzz::Verdict`].
fn config_check(path: PathBuf, names: Arc<Vec<String>>) -> Outcome<Result<Verdict, String>> {
    guarded(CASE_TIMEOUT, move || {
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let cfg = match ModelConfig::from_path(&path) {
            Err(e) => return reject(&e.to_string(), &names),
            Ok(c) => c,
        };
        if cfg.layers > MAX_BUILT_LAYERS {
            return Err(format!("size-caps: {} layers", cfg.layers));
        }
        let seq = cfg.max_positions.min(4096);
        match ModelStats::compute(&cfg, seq) {
            Err(e) => reject(&e.to_string(), &names),
            Ok(st) => {
                if st.params == 0 || st.forward_flops_per_token == 0 {
                    return Err(format!(
                        "accepted with {} parameters, {} FLOPs/token",
                        st.params, st.forward_flops_per_token
                    ));
                }
                Ok(None)
            }
        }
    })
}

fn config_names(sources: &[(String, Value)], path: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for (_, v) in sources {
        all_keys(v, &mut names);
    }
    names.extend(
        [
            "model_type",
            "<root>",
            "rope_scaling",
            "rope_type",
            "head_dim",
        ]
        .iter()
        .map(|x| x.to_string()),
    );
    names.push(s(path));
    names.sort();
    names.dedup();
    names
}

/// Every key of the source configs, sorted, once each.
fn config_keys(sources: &[(String, Value)]) -> Vec<String> {
    let mut keys = Vec::new();
    for (_, v) in sources {
        all_keys(v, &mut keys);
    }
    keys.sort();
    keys.dedup();
    keys
}

/// The config targets' inputs: the source configs, every key they use, and the
/// `config.json` each case is written to (in a scratch directory).
struct ConfigTarget {
    sources: Vec<(String, Value)>,
    keys: Vec<String>,
    path: PathBuf,
    _dir: fuzz::Scratch,
}

impl ConfigTarget {
    /// The inputs, with the scratch directory `name`.
    fn new(name: &str) -> ConfigTarget {
        let sources = config_sources();
        let keys = config_keys(&sources);
        let dir = scratch(name);
        let path = dir.join("config.json");
        ConfigTarget {
            sources,
            keys,
            path,
            _dir: dir,
        }
    }

    /// Writes case `case` ([`config_case`]); its text and what was done to it.
    fn write_case(&self, case: usize) -> (Vec<u8>, String) {
        let keys: Vec<&str> = self.keys.iter().map(String::as_str).collect();
        let (text, how) = config_case(case, &self.sources, &keys);
        std::fs::write(&self.path, &text).expect("writing the case");
        (text, how)
    }

    /// What an error may name ([`config_names`]).
    fn names(&self) -> Vec<String> {
        config_names(&self.sources, &self.path)
    }
}

/// Model configs in-process: the parser, the graph builder and `inspect`'s accounting.
#[test]
fn fuzz_model_configs() {
    const CASES: usize = 12000;
    let target = ConfigTarget::new("config");
    let names = Arc::new(target.names());
    Tally::run("model configs", CASES, |t, case| {
        let (text, how) = target.write_case(case);
        match config_check(target.path.clone(), names.clone()) {
            Outcome::Done(Err(e)) if e.starts_with("size-caps") => {
                t.known(case, &how, known("size-caps"));
            }
            out => {
                judge(t, case, &how, out, &[("config", "json", &text)]);
            }
        }
    });
}

/// A few config cases through `shardc inspect`: the same contract at the command line.
#[test]
fn fuzz_model_configs_cli() {
    const CASES: usize = 40;
    let target = ConfigTarget::new("config-cli");
    let names = target.names();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    Tally::run("model configs (shardc inspect)", CASES, |t, case| {
        let (text, how) = target.write_case(10_000 + case);
        // Bounded sizes only: the binary has no per-case deadline of its own.
        if let Ok(Ok(cfg)) =
            serde_json::from_slice::<Value>(&text).map(|v| ModelConfig::from_json(&v))
        {
            if cfg.layers > MAX_BUILT_LAYERS {
                t.known(case, &how, known("size-caps"));
                return;
            }
        }
        let run = run_shardc(&["inspect", &s(&target.path), "--json"], BIN_TIMEOUT);
        if let Some(k) = known_in_stderr(&run.stderr) {
            t.known(case, &how, k);
            return;
        }
        let save = ("config-cli", "json", &text[..]);
        t.judge_bin(case, &how, (&run, &names), save, |run| {
            let v: Value = serde_json::from_str(&run.stdout).unwrap_or(Value::Null);
            if v["params"].as_u64().unwrap_or(0) == 0 {
                Err(format!("accepted, but no parameter count: {}", run.stdout))
            } else {
                Ok(())
            }
        });
    });
}

// =============================================================================================
// Safetensors checkpoints.

/// A rank's mesh coordinates: (axis, coordinate, axis size).
type Coords = Vec<(String, usize, usize)>;

/// One fixture checkpoint and the parameters its graphs load (unsharded, and one rank of a
/// sharded plan), with the coordinates that rank has.
struct Checkpoint {
    model: &'static str,
    bytes: Vec<u8>,
    params: Vec<(ParamSource, TensorType, Coords)>,
    names: Vec<String>,
}

fn checkpoints() -> &'static [Checkpoint] {
    static CK: OnceLock<Vec<Checkpoint>> = OnceLock::new();
    CK.get_or_init(|| {
        [("llama", "tp=2"), ("gpt2", "tp=2"), ("mixtral", "ep=2")]
            .iter()
            .map(|&(model, mesh)| {
                let dir = common::fixtures().join(model);
                let cfg = ModelConfig::from_path(&dir).expect("fixture config");
                let mut params = Vec::new();
                let g = build_forward(&cfg, BuildOptions::new(1, 4)).expect("fixture graph");
                for v in g.params() {
                    let n = g.node(v);
                    if let Op::Param(src) = &n.op {
                        params.push((src.clone(), n.ty.clone(), vec![]));
                    }
                }
                let mesh = Mesh::parse(mesh, 8).expect("mesh");
                let axis = mesh.to_string();
                let axis = axis.split('=').next().expect("axis name").to_string();
                let opts = CompileOptions {
                    batch: 2,
                    seq: 4,
                    mesh,
                    extra_strategies: vec![],
                };
                let c = compile_forward(&cfg, &opts).expect("fixture plan");
                let g = &c.sharded.graph;
                for v in g.params() {
                    let n = g.node(v);
                    if let Op::Param(src) = &n.op {
                        params.push((src.clone(), n.ty.clone(), vec![(axis.clone(), 1, 2)]));
                    }
                }
                let bytes = std::fs::read(dir.join("model.safetensors")).expect("fixture weights");
                let w = Weights::open(&dir).expect("fixture weights");
                let mut names = w.names();
                names.extend(params.iter().map(|(p, _, _)| p.name.clone()));
                Checkpoint {
                    model,
                    bytes,
                    params,
                    names,
                }
            })
            .collect()
    })
}

/// (header length, header JSON, data).
fn split_safetensors(bytes: &[u8]) -> (u64, Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let header = serde_json::from_slice(&bytes[8..8 + n as usize]).expect("fixture header");
    (n, header, bytes[8 + n as usize..].to_vec())
}

fn join_safetensors(prefix: Option<u64>, header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = prefix.unwrap_or(header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

const DTYPES: &[&str] = &[
    "F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2",
    "E8M0", "F4", "F6_E2M3", "C64", "X", "f32", "",
];

/// A mutation of one tensor entry of a safetensors header.
fn mutate_header(rng: &mut Rng, h: &mut Value) -> String {
    let names: Vec<String> = h
        .as_object()
        .map(|m| m.keys().filter(|k| *k != "__metadata__").cloned().collect())
        .unwrap_or_default();
    if names.is_empty() {
        return "noop".into();
    }
    let name = rng.pick(&names).clone();
    let other = rng.pick(&names).clone();
    let other_entry = h[&other].clone();
    let m = h.as_object_mut().expect("object header");
    let e = m.get_mut(&name).expect("entry");
    let huge: &[i128] = &[0, 1, 2, 3, -1, 1 << 31, 1 << 40, u64::MAX as i128, 1 << 62];
    match rng.below(12) {
        0 | 1 => {
            let d = rng.pick(DTYPES);
            e["dtype"] = json!(d);
            format!("{name}.dtype = {d}")
        }
        2 => {
            let shape = e["shape"].as_array_mut().expect("shape");
            shape.push(json!(1 + rng.below(3)));
            format!("{name}.shape gets a dim")
        }
        3 => {
            let shape = e["shape"].as_array_mut().expect("shape");
            shape.pop();
            format!("{name}.shape loses a dim")
        }
        4 | 5 => {
            let shape = e["shape"].as_array_mut().expect("shape");
            if shape.is_empty() {
                shape.push(json!(0));
                return format!("{name}.shape = [0]");
            }
            let i = rng.below(shape.len());
            let x = *rng.pick(huge);
            shape[i] = serde_json::from_str(&x.to_string()).expect("number");
            format!("{name}.shape[{i}] = {x}")
        }
        6 => {
            let shape = e["shape"].as_array_mut().expect("shape");
            shape.reverse();
            format!("{name}.shape reversed")
        }
        7 | 8 => {
            let off = e["data_offsets"].as_array_mut().expect("offsets");
            let i = rng.below(2);
            let x = off[i].as_i64().unwrap_or(0) as i128;
            let y = match rng.below(5) {
                0 => x + 1,
                1 => x - 4,
                2 => x + 4,
                3 => *rng.pick(huge),
                _ => -x,
            };
            off[i] = serde_json::from_str(&y.to_string()).expect("number");
            format!("{name}.data_offsets[{i}] = {y}")
        }
        9 => {
            e["data_offsets"] = other_entry["data_offsets"].clone();
            format!("{name}.data_offsets = those of {other}")
        }
        10 => {
            let x = m.remove(&name).expect("entry");
            m.insert(format!("{name}.renamed"), x);
            format!("rename {name}")
        }
        _ => {
            m.remove(&name);
            format!("delete {name}")
        }
    }
}

/// Case `case` of the safetensors target: the file bytes, what was done, and which fixture.
fn safetensors_case(case: usize) -> (Vec<u8>, String, usize) {
    let mut rng = Rng::for_case("safetensors", case);
    let cks = checkpoints();
    let which = rng.below(cks.len());
    let ck = &cks[which];
    let (n, mut header, mut data) = split_safetensors(&ck.bytes);
    let model = ck.model;
    let (bytes, how) = match rng.below(12) {
        0..=4 => {
            let mut hows = Vec::new();
            for _ in 0..1 + rng.below(2) {
                hows.push(mutate_header(&mut rng, &mut header));
            }
            let h = serde_json::to_vec(&header).expect("serialise");
            let prefix = rng.chance(0.15).then_some(n);
            (join_safetensors(prefix, &h, &data), hows.join("; "))
        }
        5 => {
            let h = serde_json::to_vec(&header).expect("serialise");
            let len = h.len() as u64;
            let prefix = match rng.below(9) {
                0 => 0,
                1 => 1,
                2 => len - 1,
                3 => len + 1,
                4 => len + 8,
                5 => u64::MAX,
                6 => 1 << 40,
                7 => (h.len() + data.len()) as u64,
                _ => 100_000_001,
            };
            (
                join_safetensors(Some(prefix), &h, &data),
                format!("header length = {prefix} (is {len})"),
            )
        }
        6 => {
            let mut h = serde_json::to_vec(&header).expect("serialise");
            let how = mutate_text(&mut rng, &mut h);
            (
                join_safetensors(None, &h, &data),
                format!("header text: {how}"),
            )
        }
        7 => {
            let how = match rng.below(3) {
                0 => {
                    let k = rng.below(data.len());
                    data.truncate(k);
                    format!("data truncated to {k} bytes")
                }
                1 => {
                    data.extend_from_slice(&[0; 12]);
                    "data extended by 12 bytes".to_string()
                }
                _ => {
                    for _ in 0..8 {
                        let i = rng.below(data.len());
                        data[i] = rng.next_u64() as u8;
                    }
                    "8 data bytes randomised".to_string()
                }
            };
            let h = serde_json::to_vec(&header).expect("serialise");
            (join_safetensors(None, &h, &data), how)
        }
        8 => {
            let mut b = ck.bytes.clone();
            let how = mutate_text(&mut rng, &mut b);
            (b, format!("file: {how}"))
        }
        9 => match duplicate_key(&mut rng, &header) {
            Some((text, how)) => (join_safetensors(None, text.as_bytes(), &data), how),
            None => (ck.bytes.clone(), "unchanged".into()),
        },
        10 => {
            let how = mutate_json(
                &mut rng,
                &mut header,
                &["__metadata__", "dtype", "shape", "data_offsets"],
            );
            let h = serde_json::to_vec(&header).expect("serialise");
            (join_safetensors(None, &h, &data), how)
        }
        _ => {
            let k = rng.below(ck.bytes.len().min(64));
            (
                ck.bytes[..k].to_vec(),
                format!("file truncated to {k} bytes"),
            )
        }
    };
    (bytes, format!("{model}: {how}"), which)
}

/// Opens a checkpoint file and loads every tensor and every parameter of the fixture's graphs
/// from it. `Ok(None)`: all loaded; `Ok(Some(first error))`: errors, each naming a file or tensor.
fn load_everything(path: &Path, ck: &Checkpoint) -> Result<Verdict, String> {
    let mut names: Vec<&str> = ck.names.iter().map(String::as_str).collect();
    let file = s(path);
    names.push(&file);
    let w = match Weights::open(path) {
        Err(e) => return reject(&e.to_string(), &names),
        Ok(w) => w,
    };
    let mut first_err = None;
    let stored = w.names();
    let mut names2 = names.clone();
    names2.extend(stored.iter().map(String::as_str));
    for name in &stored {
        match w.get(name) {
            Err(e) => {
                let msg = e.to_string();
                check_message(&msg, &names2)?;
                first_err.get_or_insert(msg);
            }
            Ok(t) => {
                let want = w.shape(name).unwrap_or_default();
                if t.shape != want || t.numel() != want.iter().product::<usize>() {
                    return Err(format!(
                        "`{name}` loaded as {:?}, stored as {want:?}",
                        t.shape
                    ));
                }
            }
        }
    }
    for (src, ty, coords) in &ck.params {
        let at = |axis: &str| {
            coords
                .iter()
                .find(|(a, _, _)| a == axis)
                .map(|&(_, c, n)| (c, n))
        };
        match w.load(src, ty, &at) {
            Err(e) => {
                let msg = e.to_string();
                check_message(&msg, &names2)?;
                first_err.get_or_insert(msg);
            }
            Ok(t) => {
                if t.shape != ty.shape() || t.as_f32().map_or(0, <[f32]>::len) != ty.numel() {
                    return Err(format!(
                        "`{}` loaded as {:?} for a parameter of shape {:?}",
                        src.name,
                        t.shape,
                        ty.shape()
                    ));
                }
            }
        }
    }
    Ok(first_err)
}

/// Safetensors headers and bytes in-process: opening, every tensor, every parameter view,
/// transpose, stack and shard of the fixtures' graphs.
#[test]
fn fuzz_safetensors() {
    const CASES: usize = 6000;
    let dir = scratch("safetensors");
    Tally::run("safetensors checkpoints", CASES, |t, case| {
        let (bytes, how, which) = safetensors_case(case);
        let path = dir.join(format!("case-{}.safetensors", case % 4));
        std::fs::write(&path, &bytes).expect("writing the case");
        let p = path.clone();
        let out = guarded(CASE_TIMEOUT, move || {
            load_everything(&p, &checkpoints()[which])
        });
        judge(
            t,
            case,
            &how,
            out,
            &[("safetensors", "safetensors", &bytes)],
        );
    });
}

/// A few mutated checkpoints through `shardc run`: the same errors, one line each.
#[test]
fn fuzz_safetensors_cli() {
    const CASES: usize = 30;
    let dir = scratch("safetensors-cli");
    let tok = dir.join("tokens.json");
    std::fs::write(&tok, "[[1,2,3,4]]").expect("writing tokens");
    Tally::run("safetensors checkpoints (shardc run)", CASES, |t, case| {
        let (bytes, how, which) = safetensors_case(20_000 + case);
        let ck = &checkpoints()[which];
        let model = dir.join(ck.model);
        std::fs::create_dir_all(&model).expect("model dir");
        std::fs::copy(
            common::fixtures().join(ck.model).join("config.json"),
            model.join("config.json"),
        )
        .expect("config");
        let file = model.join("model.safetensors");
        std::fs::write(&file, &bytes).expect("writing the case");
        let fs = s(&file);
        let mut names: Vec<&str> = ck.names.iter().map(String::as_str).collect();
        names.push(&fs);
        let args = [
            "run",
            &s(&model),
            "--tokens",
            &s(&tok),
            "--out",
            &s(&dir.join("out.json")),
        ];
        let run = run_shardc(&args, BIN_TIMEOUT);
        let save = ("safetensors-cli", "safetensors", &bytes[..]);
        t.judge_bin(case, &how, (&run, &names), save, |_| Ok(()));
    });
}

/// Sharded-checkpoint indexes (`model.safetensors.index.json`) pointing at the fixture's file,
/// mutated: missing shards, directories, wrong types.
#[test]
fn fuzz_safetensors_index() {
    const CASES: usize = 300;
    let dir = scratch("safetensors-index");
    let ck = &checkpoints()[0];
    std::fs::write(dir.join("model-00001.safetensors"), &ck.bytes).expect("shard");
    std::fs::create_dir_all(dir.join("subdir")).expect("subdir");
    let (_, header, _) = split_safetensors(&ck.bytes);
    let map: serde_json::Map<String, Value> = header
        .as_object()
        .expect("header")
        .keys()
        .filter(|k| *k != "__metadata__")
        .map(|k| (k.clone(), json!("model-00001.safetensors")))
        .collect();
    let base = json!({"metadata": {"total_size": ck.bytes.len()}, "weight_map": map});
    let index = dir.join("model.safetensors.index.json");
    let is = s(&index);
    Tally::run("safetensors index", CASES, |t, case| {
        let mut rng = Rng::for_case("index", case);
        let mut v = base.clone();
        let how = if rng.chance(0.5) {
            let k = rng.pick(&ck.names[..3]).clone();
            let f = rng
                .pick(&[
                    json!("missing.safetensors"),
                    json!(""),
                    json!("."),
                    json!("subdir"),
                    json!("subdir/x.safetensors"),
                    json!(7),
                    json!(null),
                    json!("model.safetensors.index.json"),
                ])
                .clone();
            let how = format!("weight_map.{k} = {f}");
            v["weight_map"][&k] = f;
            how
        } else {
            mutate_json(&mut rng, &mut v, &["weight_map", "metadata"])
        };
        let text = serde_json::to_vec(&v).expect("serialise");
        std::fs::write(&index, &text).expect("writing the case");
        let d = dir.to_path_buf();
        let (is2, root) = (is.clone(), s(&dir));
        let out = guarded(CASE_TIMEOUT, move || -> Result<Verdict, String> {
            let ck = &checkpoints()[0];
            let mut names: Vec<&str> = ck.names.iter().map(String::as_str).collect();
            names.extend([is2.as_str(), root.as_str()]);
            let w = match Weights::open(&d) {
                Err(e) => return reject(&e.to_string(), &names),
                Ok(w) => w,
            };
            for (src, ty, _) in ck.params.iter().filter(|p| p.2.is_empty()) {
                if let Err(e) = w.load(src, ty, &|_| None) {
                    return reject(&e.to_string(), &names);
                }
            }
            Ok(None)
        });
        judge(t, case, &how, out, &[("safetensors-index", "json", &text)]);
    });
}

// ---------------------------------------------------------------------------------------------
// Valid re-encodings load the same numbers.

fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let r = b + 0x7FFF + ((b >> 16) & 1);
    (r >> 16) as u16
}

fn bf16_value(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 → f16 by truncation (weights are far inside the f16 range).
fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let man = b & 0x7f_ffff;
    if exp >= 31 {
        return sign | 0x7c00;
    }
    if exp <= 0 {
        if exp < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        return sign | (m >> (14 - exp) as u32) as u16;
    }
    sign | ((exp as u16) << 10) | (man >> 13) as u16
}

fn f16_value(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let e = i32::from((h >> 10) & 0x1f);
    let m = f32::from(h & 0x3ff);
    if e == 0 {
        sign * m * 2f32.powi(-24)
    } else {
        sign * (1.0 + m / 1024.0) * 2f32.powi(e - 15)
    }
}

/// `...experts.3.w1.weight` → `...experts.{}.w1.weight`.
fn expert_group(name: &str) -> String {
    match name.split_once("experts.") {
        Some((head, rest)) => {
            let tail = rest.trim_start_matches(|c: char| c.is_ascii_digit());
            format!("{head}experts.{{}}{tail}")
        }
        None => name.to_string(),
    }
}

/// Generated checkpoints: every fixture tensor stored as F32, BF16 or F16 at random; every
/// parameter (views, transposes, stacks, shards) loads exactly the stored numbers.
#[test]
fn fuzz_safetensors_reencoded_load_exactly() {
    const CASES: usize = 24;
    let dir = scratch("safetensors-reencoded");
    Tally::run("safetensors re-encodings", CASES, |t, case| {
        let mut rng = Rng::for_case("reencode", case);
        let which = rng.below(checkpoints().len());
        let ck = &checkpoints()[which];
        let st = safetensors::SafeTensors::deserialize(&ck.bytes).expect("fixture");
        let mut stored: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut codecs: std::collections::BTreeMap<String, fn(f32) -> f32> = Default::default();
        let mut tensors = st.tensors();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        // One dtype per stacked group (`experts.{}`): a stacked parameter has one codec.
        let mut group_dtype: std::collections::BTreeMap<String, usize> = Default::default();
        for (name, view) in tensors {
            let group = expert_group(&name);
            let pick = *group_dtype.entry(group).or_insert_with(|| rng.below(3));
            let vals: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let (dtype, data, codec): (_, Vec<u8>, fn(f32) -> f32) = match pick {
                0 => (safetensors::Dtype::F32, view.data().to_vec(), |x| x),
                1 => (
                    safetensors::Dtype::BF16,
                    vals.iter()
                        .flat_map(|&x| bf16_bits(x).to_le_bytes())
                        .collect(),
                    |x| bf16_value(bf16_bits(x)),
                ),
                _ => (
                    safetensors::Dtype::F16,
                    vals.iter()
                        .flat_map(|&x| f16_bits(x).to_le_bytes())
                        .collect(),
                    |x| f16_value(f16_bits(x)),
                ),
            };
            codecs.insert(name.clone(), codec);
            stored.push((name, dtype, view.shape().to_vec(), data));
        }
        let path = dir.join("model.safetensors");
        common::write_safetensors(&path, &stored);
        let orig_path = dir.join("orig.safetensors");
        std::fs::write(&orig_path, &ck.bytes).expect("writing");
        let out = guarded(CASE_TIMEOUT, move || -> Result<Verdict, String> {
            let ck = &checkpoints()[which];
            let w = Weights::open(&path).map_err(|e| e.to_string())?;
            let o = Weights::open(&orig_path).map_err(|e| e.to_string())?;
            for (src, ty, coords) in &ck.params {
                let at = |axis: &str| {
                    coords
                        .iter()
                        .find(|(a, _, _)| a == axis)
                        .map(|&(_, c, n)| (c, n))
                };
                let got = w.load(src, ty, &at).map_err(|e| e.to_string())?;
                let want = o.load(src, ty, &at).map_err(|e| e.to_string())?;
                let codec = codecs[&src.stored_name(0)];
                let (g, wv) = (got.as_f32().unwrap_or(&[]), want.as_f32().unwrap_or(&[]));
                if g.len() != wv.len() {
                    return Err(format!(
                        "`{}`: {} values, expected {}",
                        src.name,
                        g.len(),
                        wv.len()
                    ));
                }
                if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != codec(wv[i]).to_bits()) {
                    return Err(format!(
                        "`{}`[{i}] loaded as {}, stored {} (from {})",
                        src.name,
                        g[i],
                        codec(wv[i]),
                        wv[i]
                    ));
                }
            }
            Ok(None)
        });
        judge(t, case, &format!("{}: re-encoded", ck.model), out, &[]);
    });
}

// =============================================================================================
// Token, attention-mask and position-id files (through the binary).

const TOKENS: &str = "[[1,2,3,4,5,6,7,8],[9,10,11,12,13,14,15,16]]";
const MASK: &str = "[[0,0,1,1,1,1,1,1],[1,1,1,1,1,1,1,1]]";
const POSITIONS: &str = "[[0,0,0,1,2,3,4,5],[0,1,2,3,4,5,6,7]]";

/// A mutation of a batch × seq JSON matrix, or a generated one with entries below `hi`.
fn matrix_case(rng: &mut Rng, base: &str, hi: usize) -> (Vec<u8>, String) {
    let mut v: Value = serde_json::from_str(base).expect("base matrix");
    match rng.below(12) {
        0..=4 => {
            let mut hows = Vec::new();
            for _ in 0..1 + rng.below(2) {
                hows.push(mutate_json(rng, &mut v, &[]));
            }
            (serde_json::to_vec(&v).expect("serialise"), hows.join("; "))
        }
        5 | 6 => {
            let mut text = serde_json::to_vec(&v).expect("serialise");
            let how = mutate_text(rng, &mut text);
            (text, how)
        }
        7 => {
            // Out-of-range and non-integer entries.
            let paths: Vec<Vec<Step>> = json_paths(&v)
                .into_iter()
                .filter(|p| p.len() == 2)
                .collect();
            let p = rng.pick(&paths).clone();
            let x = rng
                .pick(&[
                    json!(-1),
                    json!(256),
                    json!(128),
                    json!(2),
                    json!(1.0),
                    json!(0.5),
                    json!(u64::MAX),
                    json!(i64::MIN),
                    json!(1e300),
                    json!(2147483648u64),
                ])
                .clone();
            let how = format!("{} = {x}", path_text(&p));
            *json_at(&mut v, &p).expect("path") = x;
            (serde_json::to_vec(&v).expect("serialise"), how)
        }
        _ => {
            // Generated shapes (ragged or empty sometimes), entries in range mostly.
            let b = if rng.chance(0.1) { 0 } else { 1 + rng.below(3) };
            let t = if rng.chance(0.1) { 0 } else { 1 + rng.below(8) };
            let rows: Vec<Value> = (0..b)
                .map(|_| {
                    let t = if rng.chance(0.1) { rng.below(9) } else { t };
                    let row =
                        (0..t).map(|_| json!(if rng.chance(0.97) { rng.below(hi) } else { hi }));
                    Value::Array(row.collect())
                })
                .collect();
            let v = Value::Array(rows);
            (
                serde_json::to_vec(&v).expect("serialise"),
                format!("generated {v}"),
            )
        }
    }
}

fn mask_is_binary(text: &[u8]) -> bool {
    serde_json::from_slice::<Value>(text).is_ok_and(|v| {
        v.as_array().is_some_and(|rows| {
            rows.iter().all(|r| {
                r.as_array().is_some_and(|r| {
                    r.iter()
                        .all(|x| x.as_i64().is_some_and(|x| x == 0 || x == 1))
                })
            })
        })
    })
}

/// Token, attention-mask and position-id files through `shardc run`: a bad file is one clear
/// error, a good one gives finite logits of the right shape.
#[test]
fn fuzz_token_files_run() {
    const CASES: usize = 120;
    let dir = scratch("tokens-run");
    let model = s(&common::fixtures().join("llama"));
    let (tok, mask, pos, out) = (
        dir.join("tokens.json"),
        dir.join("mask.json"),
        dir.join("pos.json"),
        dir.join("out.json"),
    );
    let (ts, ms, ps) = (s(&tok), s(&mask), s(&pos));
    let names = [
        ts.as_str(),
        ms.as_str(),
        ps.as_str(),
        "token id",
        "position id",
        "attention mask",
        "sequence length",
    ];
    Tally::run("token files (shardc run)", CASES, |t, case| {
        let mut rng = Rng::for_case("tokens-run", case);
        let mut files = [
            TOKENS.as_bytes().to_vec(),
            MASK.as_bytes().to_vec(),
            POSITIONS.as_bytes().to_vec(),
        ];
        let which = *rng.pick(&[0, 0, 1, 2]);
        let (text, how) = matrix_case(
            &mut rng,
            [TOKENS, MASK, POSITIONS][which],
            [256, 2, 8][which],
        );
        files[which] = text;
        let how = format!("{}: {how}", ["tokens", "mask", "positions"][which]);
        for (p, b) in [&tok, &mask, &pos].iter().zip(&files) {
            std::fs::write(p, b).expect("writing the case");
        }
        let _ = std::fs::remove_file(&out);
        let out_s = s(&out);
        let mut args = vec!["run", &model, "--tokens", &ts, "--out", &out_s];
        // The mask and position ids go along when they are the mutated file, or sometimes.
        let with_mask = which == 1 || rng.chance(0.3);
        if with_mask {
            args.extend(["--attention-mask", &ms]);
        }
        if which == 2 || rng.chance(0.3) {
            args.extend(["--position-ids", &ps]);
        }
        let run = run_shardc(&args, BIN_TIMEOUT);
        let save = ("tokens-run", "json", &files[which][..]);
        t.judge_bin(case, &how, (&run, &names), save, |_| {
            if with_mask && !mask_is_binary(&files[1]) {
                return Err("accepted an attention mask that is not all 0 and 1".into());
            }
            let v: Value = std::fs::read_to_string(&out)
                .ok()
                .and_then(|x| serde_json::from_str(&x).ok())
                .unwrap_or(Value::Null);
            let shape = v["logits_shape"].clone();
            let tokens: Value = serde_json::from_slice(&files[0]).unwrap_or(Value::Null);
            let (b, tl) = (
                tokens.as_array().map_or(0, Vec::len),
                tokens[0].as_array().map_or(0, Vec::len),
            );
            let finite = v["logits"].as_array().is_some_and(|a| {
                a.len() == b * tl * 256 && a.iter().all(|x| x.as_f64().is_some_and(f64::is_finite))
            });
            if shape == json!([b, tl, 256]) && finite {
                Ok(())
            } else {
                Err(format!("accepted {b}×{tl} tokens, but out.json has logits of shape {shape}, all finite: {finite}"))
            }
        });
    });
}

/// Token files through `shardc train`.
#[test]
fn fuzz_token_files_train() {
    const CASES: usize = 60;
    let dir = scratch("tokens-train");
    let model = s(&common::fixtures().join("llama"));
    let tok = dir.join("tokens.json");
    let ts = s(&tok);
    let names = [
        ts.as_str(),
        "token id",
        "sequence length",
        "sequences of",
        "batch",
    ];
    Tally::run("token files (shardc train)", CASES, |t, case| {
        let mut rng = Rng::for_case("tokens-train", case);
        let (text, how) = matrix_case(&mut rng, TOKENS, 256);
        std::fs::write(&tok, &text).expect("writing the case");
        let run = run_shardc(
            &["train", &model, "--tokens", &ts, "--steps", "1"],
            BIN_TIMEOUT,
        );
        let save = ("tokens-train", "json", &text[..]);
        t.judge_bin(case, &how, (&run, &names), save, |run| {
            let lower = run.stdout.to_lowercase();
            if lower.contains("loss") && !lower.contains("nan") && !lower.contains("inf") {
                Ok(())
            } else {
                Err(format!("accepted, but: {}", run.stdout))
            }
        });
    });
}

// =============================================================================================
// Calibration measurements.

/// Measurements a DGX H100 could have produced (about 60% of bf16 peak on large GEMMs).
const MEASUREMENTS: &str = r#"{
  "device": "NVIDIA H100 80GB HBM3",
  "gemm": [
    {"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16", "seconds": 2.32e-4},
    {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "seconds": 1.80e-3},
    {"m": 512, "n": 4096, "k": 4096, "dtype": "bf16", "seconds": 3.6e-5},
    {"m": 128, "n": 4096, "k": 4096, "dtype": "bf16", "seconds": 1.3e-5},
    {"m": 16, "n": 4096, "k": 4096, "dtype": "f32", "seconds": 1.4e-5}
  ],
  "copy": [
    {"bytes": 268435456, "seconds": 2.0e-4},
    {"bytes": 1073741824, "seconds": 7.9e-4},
    {"bytes": 4096, "seconds": 4.0e-6}
  ],
  "collectives": [
    {"kind": "all_reduce", "ranks": 8, "bytes": 268435456, "seconds": 1.5e-3, "network": false},
    {"kind": "all_gather", "ranks": 8, "bytes": 32768, "seconds": 9.0e-6, "network": false},
    {"kind": "all_reduce", "ranks": 2, "bytes": 268435456, "seconds": 6.7e-3, "network": true},
    {"kind": "all_reduce", "ranks": 2, "bytes": 32768, "seconds": 1.2e-5, "network": true}
  ]
}"#;

const MEASUREMENT_KEYS: &[&str] = &[
    "device",
    "gemm",
    "copy",
    "collectives",
    "m",
    "n",
    "k",
    "dtype",
    "seconds",
    "bytes",
    "kind",
    "ranks",
    "network",
];

fn measurements_case(case: usize) -> (Vec<u8>, String) {
    let mut rng = Rng::for_case("measurements", case);
    let mut v: Value = serde_json::from_str(MEASUREMENTS).expect("base measurements");
    match rng.below(10) {
        0..=6 => {
            let mut hows = Vec::new();
            for _ in 0..1 + rng.below(3) {
                hows.push(mutate_json(&mut rng, &mut v, MEASUREMENT_KEYS));
            }
            (
                serde_json::to_vec_pretty(&v).expect("serialise"),
                hows.join("; "),
            )
        }
        7 => match duplicate_key(&mut rng, &v) {
            Some((text, how)) => (text.into_bytes(), how),
            None => (MEASUREMENTS.as_bytes().to_vec(), "unchanged".into()),
        },
        _ => {
            let mut text = serde_json::to_vec_pretty(&v).expect("serialise");
            let how = mutate_text(&mut rng, &mut text);
            (text, how)
        }
    }
}

/// Parses and fits one measurements file as `shardc calibrate --measurements` does.
fn fit_measurements(text: &[u8], name: &str) -> Result<Verdict, String> {
    let mut names: Vec<&str> = MEASUREMENT_KEYS.to_vec();
    names.push(name);
    let text = match std::str::from_utf8(text) {
        Ok(t) => t,
        Err(e) => return reject(&format!("{name}: not UTF-8: {e}"), &names),
    };
    let m = match Measurements::from_json(text) {
        Err(e) => return reject(&format!("{name}: {e}"), &names),
        Ok(m) => m,
    };
    let c = Cluster::resolve("dgx-h100").map_err(|e| e.to_string())?;
    match fit_profile_report(&c.device, Some(&c.profile), &m) {
        Err(e) => reject(&e.to_string(), &names),
        Ok(fit) => {
            let (d, cp) = (&fit.device, &fit.cluster);
            // Capping is never silent: each capped factor is noted, and says so in its source.
            let mut sources = vec![
                &d.efficiency.gemm_large,
                &d.efficiency.gemm_medium,
                &d.efficiency.gemm_small,
                &d.efficiency.gemm_tiny,
                &d.efficiency.memory,
                &d.efficiency.nvlink,
            ];
            if let Some(c) = cp {
                sources.push(&c.network_efficiency);
            }
            let marked = sources
                .iter()
                .filter(|s| s.source.contains("capped at 1"))
                .count();
            if marked != fit.capped.len()
                || sources
                    .iter()
                    .any(|s| s.source.contains("capped at 1") && s.value != 1.0)
            {
                return Err(format!(
                    "{marked} sources say capped, {} notes: {:?}",
                    fit.capped.len(),
                    fit.capped
                ));
            }
            d.check()
                .map_err(|e| format!("fitted device fails its check: {e}"))?;
            let e = &d.efficiency;
            for (f, x) in [
                ("gemm_large", e.gemm_large.value),
                ("gemm_medium", e.gemm_medium.value),
                ("gemm_small", e.gemm_small.value),
                ("gemm_tiny", e.gemm_tiny.value),
                ("memory", e.memory.value),
                ("nvlink", e.nvlink.value),
                ("launch_floor", d.launch_floor.value),
            ] {
                if !(x.is_finite() && x > 0.0) {
                    return Err(format!("fitted {f} = {x}"));
                }
            }
            DeviceProfile::from_toml("fitted", &d.to_toml())
                .map_err(|e| format!("the fitted profile does not load back: {e}"))?;
            if let Some(cp) = cp {
                cp.check()
                    .map_err(|e| format!("fitted cluster fails its check: {e}"))?;
            }
            // Accepted samples are physical: positive finite times, non-empty work.
            let times = m
                .gemm
                .iter()
                .map(|g| g.seconds)
                .chain(m.copy.iter().map(|c| c.seconds))
                .chain(m.collectives.iter().map(|c| c.seconds));
            if let Some(t) = times.into_iter().find(|t| !(t.is_finite() && *t > 0.0)) {
                return Err(format!("accepted a sample of {t} seconds"));
            }
            if m.gemm.iter().any(|g| g.m * g.n * g.k == 0)
                || m.copy.iter().any(|c| c.bytes == 0)
                || m.collectives.iter().any(|c| c.bytes == 0 || c.ranks < 2)
            {
                return Err("accepted an empty GEMM, copy or collective".into());
            }
            Ok(None)
        }
    }
}

/// Calibration measurements in-process: parsing and the profile fit.
#[test]
fn fuzz_calibration_measurements() {
    const CASES: usize = 10000;
    Tally::run("calibration measurements", CASES, |t, case| {
        let (text, how) = measurements_case(case);
        let bytes = text.clone();
        let out = guarded(CASE_TIMEOUT, move || {
            fit_measurements(&bytes, "timings.json")
        });
        judge(t, case, &how, out, &[("measurements", "json", &text)]);
    });
}

/// A few measurement files through `shardc calibrate --measurements`.
#[test]
fn fuzz_calibration_measurements_cli() {
    const CASES: usize = 30;
    let dir = scratch("measurements-cli");
    let file = dir.join("timings.json");
    let out = dir.join("fitted.toml");
    let fs = s(&file);
    let mut names: Vec<&str> = MEASUREMENT_KEYS.to_vec();
    names.push(&fs);
    Tally::run(
        "calibration measurements (shardc calibrate)",
        CASES,
        |t, case| {
            let (text, how) = measurements_case(50_000 + case);
            std::fs::write(&file, &text).expect("writing the case");
            let args = [
                "calibrate",
                "--measurements",
                &fs,
                "--cluster",
                "dgx-h100",
                "-o",
                &s(&out),
            ];
            let run = run_shardc(&args, BIN_TIMEOUT);
            let save = ("measurements-cli", "json", &text[..]);
            t.judge_bin(case, &how, (&run, &names), save, |_| {
                std::fs::read_to_string(&out)
                    .map_err(|e| e.to_string())
                    .and_then(|x| DeviceProfile::from_toml("fitted", &x).map_err(|e| e.to_string()))
                    .map(drop)
                    .map_err(|e| format!("accepted, but the profile written does not load: {e}"))
            });
        },
    );
}

// =============================================================================================
// Cluster and device profiles.

/// Whether a profile case is a cluster profile (with its device file, if any) rather than a
/// device profile alone.
fn is_cluster_case(text: &[u8], device: &Option<Vec<u8>>) -> bool {
    String::from_utf8_lossy(text).contains("kind = \"cluster\"") || device.is_some()
}

/// Writes a cluster case to `cluster_path`, and its device file, if any, to `device_path`.
fn write_cluster_case(
    cluster_path: &Path,
    device_path: &Path,
    text: &[u8],
    device: &Option<Vec<u8>>,
) {
    std::fs::write(cluster_path, text).expect("writing the case");
    if let Some(d) = device {
        std::fs::write(device_path, d).expect("writing the case");
    }
}

/// What an error about the cluster profile at `cluster` and its device at `device` may name.
fn cluster_names<'a>(cluster: &'a str, device: &'a str) -> Vec<&'a str> {
    let mut names = PROFILE_FIELDS.to_vec();
    names.extend([cluster, device, "h100-sxm"]);
    names
}

fn profile_case(case: usize) -> (Vec<u8>, Option<Vec<u8>>, String) {
    let mut rng = Rng::for_case("profile", case);
    let (name, text) = *rng.pick(&BUILTIN_PROFILES);
    let is_cluster = text.contains("kind = \"cluster\"");
    let mutate = |rng: &mut Rng, text: &str| -> (Vec<u8>, String) {
        if rng.chance(0.8) {
            let mut t = text.to_string();
            let mut hows = Vec::new();
            for _ in 0..1 + rng.below(2) {
                let (n, h) = mutate_lines(rng, &t);
                t = n;
                hows.push(h);
            }
            (t.into_bytes(), hows.join("; "))
        } else {
            let mut b = text.as_bytes().to_vec();
            let h = mutate_text(rng, &mut b);
            (b, h)
        }
    };
    if is_cluster {
        if rng.chance(0.4) {
            // The cluster names a device file, which is the mutated one.
            let dev = BUILTIN_PROFILES[1].1;
            let (d, how) = mutate(&mut rng, dev);
            let c = text
                .lines()
                .map(|l| {
                    if l.starts_with("device = ") {
                        "device = \"device.toml\""
                    } else {
                        l
                    }
                })
                .collect::<Vec<_>>()
                .join("\n");
            (
                c.into_bytes(),
                Some(d),
                format!("{name} with h100-sxm device: {how}"),
            )
        } else {
            let (c, how) = mutate(&mut rng, text);
            (c, None, format!("{name}: {how}"))
        }
    } else {
        let (d, how) = mutate(&mut rng, text);
        (d, None, format!("{name}: {how}"))
    }
}

/// A small forward plan to replay on every cluster that loads.
fn tiny_plan() -> &'static Plan {
    static PLAN: OnceLock<Plan> = OnceLock::new();
    PLAN.get_or_init(|| {
        let cfg = ModelConfig::from_path(&common::fixtures().join("llama")).expect("fixture");
        let opts = CompileOptions {
            batch: 2,
            seq: 16,
            mesh: Mesh::parse("dp=2,tp=2", 8).expect("mesh"),
            extra_strategies: vec![],
        };
        let c = compile_forward(&cfg, &opts).expect("plan");
        Plan::new(&c, "llama", cfg.arch.name(), cfg.layers)
    })
}

const PROFILE_FIELDS: &[&str] = &[
    "kind",
    "name",
    "device",
    "description",
    "gpus_per_node",
    "nvlink_domain",
    "nics_per_node",
    "nic_bandwidth",
    "network_latency",
    "nvlink_latency",
    "network_efficiency",
    "memory_bytes",
    "hbm_bandwidth",
    "nvlink_bandwidth",
    "launch_floor",
    "peak_flops",
    "efficiency",
    "bf16",
    "fp16",
    "tf32",
    "fp32",
    "gemm_large",
    "gemm_medium",
    "gemm_small",
    "gemm_tiny",
    "memory",
    "nvlink",
    "value",
    "source",
];

/// Loads one profile case and, when it loads, times collectives, GEMMs and a plan on it.
fn use_profile(
    cluster: Option<&Path>,
    device_text: Option<String>,
    names: &[&str],
) -> Result<Verdict, String> {
    let c = match (cluster, device_text) {
        (Some(p), _) => match Cluster::resolve(&s(p)) {
            Err(e) => return reject(&e.to_string(), names),
            Ok(c) => c,
        },
        (None, Some(text)) => match DeviceProfile::from_toml("device.toml", &text) {
            Err(e) => return reject(&e.to_string(), names),
            Ok(d) => {
                let mut c = Cluster::resolve("dgx-h100x2").map_err(|e| e.to_string())?;
                c.device = d;
                c
            }
        },
        (None, None) => return Err("no profile".into()),
    };
    let finite = |what: &str, x: f64| -> Result<(), String> {
        if x.is_finite() && x >= 0.0 {
            Ok(())
        } else {
            Err(format!("accepted profile gives {what} = {x}"))
        }
    };
    for kind in [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::AllToAll,
    ] {
        for bytes in [1u64 << 10, 1 << 30] {
            let intra = collective_time(
                &c,
                kind,
                Bytes(bytes),
                GroupTopology::intra(c.gpus_per_node().min(8)),
            );
            finite("a collective time", intra.0)?;
        }
    }
    let k = Kernel::gemm(
        GemmShape {
            m: 4096,
            n: 4096,
            k: 4096,
            batch: 1,
        },
        0.0,
    );
    finite("a GEMM time", kernel_time(&c.device, DType::Bf16, &k).0)?;
    let c = c.with_nodes(1);
    if c.gpus() >= 4 {
        match simulate_plan(tiny_plan(), &c, &ComputeOptions::default()) {
            Err(e) => check_message(&e.to_string(), names)?,
            Ok(sim) => {
                let r = &sim.report;
                finite("step_time_s", r.step_time_s)?;
                finite("tokens_per_s", r.tokens_per_s)?;
                finite("mfu", r.mfu)?;
                if r.step_time_s <= 0.0 || r.mfu > 1.0 {
                    return Err(format!(
                        "accepted profile gives step time {} s, MFU {}",
                        r.step_time_s, r.mfu
                    ));
                }
            }
        }
    }
    Ok(None)
}

/// Cluster and device profiles in-process: parsing, checks, and the cost model on them.
#[test]
fn fuzz_cluster_profiles() {
    const CASES: usize = 6000;
    let dir = scratch("profiles");
    Tally::run("cluster and device profiles", CASES, |t, case| {
        let (text, device, how) = profile_case(case);
        let cluster_path = dir.join("cluster.toml");
        let device_path = dir.join("device.toml");
        let out = if is_cluster_case(&text, &device) {
            write_cluster_case(&cluster_path, &device_path, &text, &device);
            let (cp, dp) = (cluster_path.clone(), device_path.clone());
            guarded(CASE_TIMEOUT, move || {
                let (a, b) = (s(&cp), s(&dp));
                use_profile(Some(&cp), None, &cluster_names(&a, &b))
            })
        } else {
            let text = String::from_utf8_lossy(&text).to_string();
            guarded(CASE_TIMEOUT, move || {
                let mut names = PROFILE_FIELDS.to_vec();
                names.push("device.toml");
                use_profile(None, Some(text), &names)
            })
        };
        let mut saves = vec![("profiles", "toml", &text[..])];
        saves.extend(device.as_deref().map(|d| ("profiles", "device.toml", d)));
        judge(t, case, &how, out, &saves);
    });
}

/// A few cluster files through `shardc simulate --cluster FILE`.
#[test]
fn fuzz_cluster_profiles_cli() {
    const CASES: usize = 30;
    let dir = scratch("profiles-cli");
    let model = s(&common::fixtures().join("llama"));
    let cluster_path = dir.join("cluster.toml");
    let device_path = dir.join("device.toml");
    let (cs, ds) = (s(&cluster_path), s(&device_path));
    let names = cluster_names(&cs, &ds);
    let mut t = Tally::new("cluster profiles (shardc simulate)");
    let mut case = 0;
    let mut n = 0;
    while n < CASES {
        let (text, device, how) = profile_case(90_000 + case);
        case += 1;
        if !is_cluster_case(&text, &device) {
            continue;
        }
        n += 1;
        write_cluster_case(&cluster_path, &device_path, &text, &device);
        t.cases += 1;
        let args = [
            &["simulate", &model, "--cluster", &cs],
            &common::TINY_TP2[..],
        ]
        .concat();
        let run = run_shardc(&args, BIN_TIMEOUT);
        let save = ("profiles-cli", "toml", &text[..]);
        t.judge_bin(case, &how, (&run, &names), save, |run| {
            let low = run.stdout.to_lowercase();
            if low.contains("nan") || low.contains("inf ") {
                Err(format!("accepted, but: {}", run.stdout))
            } else {
                Ok(())
            }
        });
    }
    t.finish();
}

// =============================================================================================
// Regressions: one test per fix the fuzzer led to, through the binary.

/// Runs `shardc args...`, expects one `error: ` line containing every needle.
fn fails_with(args: &[&str], needles: &[&str]) {
    let run = run_shardc(args, BIN_TIMEOUT);
    let msg = match check_bin(&run, needles) {
        Ok(Some(msg)) => msg,
        Ok(None) => panic!("{args:?} should fail; stdout: {}", run.stdout),
        Err(e) => panic!("{args:?}: {e}"),
    };
    for n in needles {
        assert!(msg.contains(n), "{args:?}: `{n}` not in: {msg}");
    }
}

#[test]
fn attention_mask_values_other_than_0_and_1_are_refused() {
    let dir = scratch("regress-mask");
    let (ids, mask) = (dir.join("ids.json"), dir.join("mask.json"));
    std::fs::write(&ids, "[[1,2,3,4]]").unwrap();
    std::fs::write(&mask, "[[1,7,1,1]]").unwrap();
    let (m, i, o) = (s(&mask), s(&ids), s(&dir.join("out.json")));
    let model = s(&common::fixtures().join("llama"));
    fails_with(
        &[
            "run",
            &model,
            "--tokens",
            &i,
            "--attention-mask",
            &m,
            "--out",
            &o,
        ],
        &[
            "attention mask",
            &m,
            "[0][1] = 7 is not 0 (padding) or 1 (keep)",
        ],
    );
}

/// A copy of the llama fixture whose model.safetensors is `bytes`.
fn llama_with(dir: &Path, bytes: &[u8]) -> (String, String) {
    let model = dir.join("llama");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        common::fixtures().join("llama/config.json"),
        model.join("config.json"),
    )
    .unwrap();
    std::fs::write(model.join("model.safetensors"), bytes).unwrap();
    std::fs::write(dir.join("ids.json"), "[[1,2,3,4]]").unwrap();
    (s(&model), s(&model.join("model.safetensors")))
}

#[test]
fn truncated_checkpoints_say_how_much_is_missing() {
    let dir = scratch("regress-truncated");
    let bytes = std::fs::read(common::fixtures().join("llama/model.safetensors")).unwrap();
    let (_, _, data) = split_safetensors(&bytes);
    let (model, file) = llama_with(&dir, &bytes[..bytes.len() - 10]);
    let (ids, out) = (s(&dir.join("ids.json")), s(&dir.join("out.json")));
    let need = format!(
        "truncated: the header's tensors need {} bytes of data, the file holds {}",
        data.len(),
        data.len() - 10
    );
    fails_with(
        &["run", &model, "--tokens", &ids, "--out", &out],
        &[&file, &need],
    );
}

#[test]
fn checkpoint_header_errors_name_the_tensor() {
    let dir = scratch("regress-header");
    let bytes = std::fs::read(common::fixtures().join("llama/model.safetensors")).unwrap();
    let (_, mut header, data) = split_safetensors(&bytes);
    let name = "model.norm.weight";
    header[name]["dtype"] = json!("BF16");
    let h = serde_json::to_vec(&header).unwrap();
    let (model, _) = llama_with(&dir, &join_safetensors(None, &h, &data));
    let (ids, out) = (s(&dir.join("ids.json")), s(&dir.join("out.json")));
    fails_with(
        &["run", &model, "--tokens", &ids, "--out", &out],
        &[&format!(
            "tensor `{name}`: BF16 [64] needs 128 bytes but data_offsets"
        )],
    );
    header[name]["shape"] = json!([-64]);
    let h = serde_json::to_vec(&header).unwrap();
    let (model, _) = llama_with(&dir, &join_safetensors(None, &h, &data));
    fails_with(
        &["run", &model, "--tokens", &ids, "--out", &out],
        &[&format!("tensor `{name}`: invalid value: integer `-64`")],
    );
}

#[test]
fn implausible_cluster_numbers_are_refused() {
    let dir = scratch("regress-cluster");
    let file = dir.join("c.toml");
    let text = BUILTIN_PROFILES[4]
        .1
        .replace("value = 50e9", "value = 1e-320");
    std::fs::write(&file, text).unwrap();
    let f = s(&file);
    let model = s(&common::fixtures().join("llama"));
    fails_with(
        &[
            "simulate",
            &model,
            "--cluster",
            &f,
            "--mesh",
            "tp=2",
            "--seq",
            "16",
        ],
        &[
            &f,
            "`nic_bandwidth`: must be in [1000, 1e16] bytes/s, found 1e-320",
        ],
    );
}

#[test]
fn calibration_faster_than_the_peak_is_refused() {
    let dir = scratch("regress-calibrate");
    let file = dir.join("timings.json");
    // 4096³ and 8192³ GEMMs at 137 and 611 PFLOP/s on a 989 TFLOP/s device.
    let text = MEASUREMENTS
        .replace("\"seconds\": 2.32e-4", "\"seconds\": 1e-6")
        .replace("\"seconds\": 1.80e-3", "\"seconds\": 1.8e-6");
    std::fs::write(&file, text).unwrap();
    let (f, o) = (s(&file), s(&dir.join("fit.toml")));
    fails_with(
        &["calibrate", "--measurements", &f, "-o", &o],
        &[&f, "median of 2 Large GEMMs", "is outside [0.0001, 2]"],
    );
    // 10% over the peak (a boost clock): written as 1, with a warning and a source saying so.
    let t = 2.0 * 4096f64.powi(3) / (1.1 * 989.4e12);
    let text = MEASUREMENTS
        .replace("\"seconds\": 2.32e-4", &format!("\"seconds\": {t}"))
        .replace("\"seconds\": 1.80e-3", &format!("\"seconds\": {}", 8.0 * t));
    std::fs::write(&file, text).unwrap();
    let run = run_shardc(&["calibrate", "--measurements", &f, "-o", &o], BIN_TIMEOUT);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stderr.starts_with("warning: calibration: median of 2 Large GEMMs: 1.1 of the base profile's peak FLOP/s, written as 1"),
        "{}",
        run.stderr
    );
    let fitted = std::fs::read_to_string(&o).unwrap();
    assert!(fitted.contains("measured 1.1, capped at 1"), "{fitted}");
    let text = MEASUREMENTS.replace("\"seconds\": 1.3e-5", "\"seconds\": 0");
    std::fs::write(&file, text).unwrap();
    fails_with(
        &["calibrate", "--measurements", &f, "-o", &o],
        &[&f, "gemm[3].seconds: must be in [1e-12, 1000000], found 0"],
    );
}

// =============================================================================================

/// Each [`KNOWN_OTHERS`] reproducer gives a clean error (they all panicked or hung once).
#[test]
fn known_others_are_fixed() {
    let mut still = Vec::new();
    for k in KNOWN_OTHERS {
        let (Some(a), Some(b)) = (k.repro.find('{'), k.repro.rfind('}')) else {
            still.push(format!("{}: no JSON reproducer", k.id));
            continue;
        };
        let v: Value = serde_json::from_str(&k.repro[a..=b]).expect("repro JSON");
        let mut names = Vec::new();
        all_keys(&v, &mut names);
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let out = guarded(CASE_TIMEOUT, move || match ModelConfig::from_json(&v) {
            Err(e) => Some(e.to_string()),
            Ok(cfg) => ModelStats::compute(&cfg, 16).err().map(|e| e.to_string()),
        });
        match out {
            Outcome::Done(Some(msg)) => {
                if let Err(e) = check_message(&msg, &names) {
                    still.push(format!("{}: {e}", k.id));
                }
            }
            Outcome::Done(None) => still.push(format!("{}: accepted", k.id)),
            other => still.push(format!("{}: {other:?}", k.id)),
        }
    }
    assert!(still.is_empty(), "not fixed yet:\n{}", still.join("\n"));
}
