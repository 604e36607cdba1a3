//! A corpus of bad inputs across every subcommand. Each case must end promptly with a non-zero
//! exit, no panic or abort, one `error:` line naming the offending thing, and no output file
//! left behind. The test runs every case and reports all failures at once.

mod common;

use serde_json::{json, Value};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// No case may run longer than this (a case that would hang or allocate without bound).
const LIMIT: Duration = Duration::from_secs(60);

struct Env {
    dir: PathBuf,
}

impl Env {
    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    fn write(&self, name: &str, text: &str) -> String {
        let p = self.dir.join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    /// A model directory: the llama fixture's weights with `edit` applied to its config.
    fn model(&self, name: &str, edit: impl Fn(&mut Value)) -> String {
        let src = common::fixtures().join("llama");
        let dir = self.dir.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg = common::read_json(src.join("config.json"));
        edit(&mut cfg);
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        dir.display().to_string()
    }
}

fn llama() -> String {
    common::fixtures().join("llama").display().to_string()
}

/// One case: arguments and the words its error must contain.
struct Case {
    args: Vec<String>,
    needles: Vec<&'static str>,
}

fn case(args: &[&str], needles: &[&'static str]) -> Case {
    Case {
        args: args.iter().map(|s| s.to_string()).collect(),
        needles: needles.to_vec(),
    }
}

/// One case per bad `(flag, value)`: `prefix… flag value suffix…`, its error naming the flag.
fn flag_cases(prefix: &[&str], bad: &[(&'static str, &str)], suffix: &[&str]) -> Vec<Case> {
    bad.iter()
        .map(|&(flag, value)| {
            let args = [prefix, &[flag, value], suffix].concat();
            case(&args, &[flag.trim_start_matches("--")])
        })
        .collect()
}

/// Runs a case; `Err(why)` if it broke a rule. Outputs it left are reported and removed.
fn check(c: &Case, outputs: &[&Path]) -> Result<(), String> {
    let r = run_case(c);
    let left: Vec<String> = outputs
        .iter()
        .filter(|o| o.exists())
        .map(|o| {
            let _ = std::fs::remove_file(o).or_else(|_| std::fs::remove_dir_all(o));
            o.display().to_string()
        })
        .collect();
    match (r, left.is_empty()) {
        (Err(why), _) => Err(why),
        (Ok(()), false) => Err(format!("left {} behind", left.join(", "))),
        (Ok(()), true) => Ok(()),
    }
}

fn run_case(c: &Case) -> Result<(), String> {
    let t0 = Instant::now();
    let mut child = common::shardc_clean()
        .args(&c.args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("still running after {LIMIT:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    if status.success() {
        return Err("exited 0".into());
    }
    match status.code() {
        None => return Err(format!("killed by a signal ({status}): {err}")),
        Some(101) => return Err(format!("panicked: {err}")),
        Some(_) => {}
    }
    if err.contains("panicked") || err.contains("memory allocation") {
        return Err(format!("crashed: {err}"));
    }
    let Some(line) = err.lines().find(|l| l.starts_with("error: ")) else {
        return Err(format!("no `error:` line: {err}"));
    };
    for n in &c.needles {
        if !err.contains(n) {
            return Err(format!("`{n}` not named: {line}"));
        }
    }
    Ok(())
}

#[test]
fn every_bad_input_is_a_named_error() {
    let tmp = tempfile::tempdir().unwrap();
    let e = Env {
        dir: tmp.path().to_path_buf(),
    };
    let m = llama();
    std::fs::create_dir_all(e.dir.join("out")).unwrap();
    let ids = e.write("ids.json", "[[1,2,3,4,5,6,7,8],[9,10,11,12,13,14,15,16]]");
    let out = e.path("out/result.json");
    let plan_out = e.path("out/plan.json");
    let ckpt = e.path("out/ckpt");
    let trace = e.path("out/trace.json");

    let mut cases: Vec<Case> = Vec::new();

    // ---- Configs (inspect, compile, simulate, run): the field is named.
    // Each sets the field at a path to a bad value, or removes it (`None`).
    let bad_configs: Vec<(&str, &[&str], Option<Value>)> = vec![
        ("kv0", &["num_key_value_heads"], Some(json!(0))),
        ("kv3", &["num_key_value_heads"], Some(json!(3))),
        ("heads0", &["num_attention_heads"], Some(json!(0))),
        ("hidden0", &["hidden_size"], Some(json!(0))),
        ("layers0", &["num_hidden_layers"], Some(json!(0))),
        ("inter0", &["intermediate_size"], Some(json!(0))),
        ("vocab0", &["vocab_size"], Some(json!(0))),
        ("vocab1", &["vocab_size"], Some(json!(1))),
        ("eps-neg", &["rms_norm_eps"], Some(json!(-1.0))),
        ("eps0", &["rms_norm_eps"], Some(json!(0.0))),
        (
            "theta0",
            &["rope_parameters", "rope_theta"],
            Some(json!(0.0)),
        ),
        (
            "theta-neg",
            &["rope_parameters", "rope_theta"],
            Some(json!(-5.0)),
        ),
        ("act", &["hidden_act"], Some(json!("swish9"))),
        ("hidden-str", &["hidden_size"], Some(json!("abc"))),
        ("hidden-neg", &["hidden_size"], Some(json!(-64))),
        ("hidden-float", &["hidden_size"], Some(json!(64.5))),
        (
            "layers-huge",
            &["num_hidden_layers"],
            Some(json!(1_000_000_000_000u64)),
        ),
        ("maxpos0", &["max_position_embeddings"], Some(json!(0))),
        ("headdim0", &["head_dim"], Some(json!(0))),
        ("type", &["model_type"], Some(json!("bert"))),
        ("no-type", &["model_type"], None),
        ("no-hidden", &["hidden_size"], None),
    ];
    for (name, path, value) in &bad_configs {
        let field = path.last().expect("a field path");
        let dir = e.model(name, |c| match value {
            Some(v) => *path.iter().fold(c, |c, k| &mut c[*k]) = v.clone(),
            None => {
                c.as_object_mut().unwrap().remove(*field);
            }
        });
        let cfg = format!("{dir}/config.json");
        cases.push(case(&["inspect", &cfg], &[field]));
        cases.push(case(
            &["compile", &cfg, "--mesh", "tp=2", "-o", &plan_out],
            &[field],
        ));
        cases.push(case(&["simulate", &cfg, "--mesh", "tp=2"], &[field]));
        cases.push(case(
            &["run", &dir, "--tokens", &ids, "--out", &out],
            &[field],
        ));
    }
    let not_json = e.write("broken/config.json", "{\"model_type\": \"llama\",");
    cases.push(case(&["inspect", &not_json], &["config.json"]));
    let empty = e.write("empty/config.json", "");
    cases.push(case(&["inspect", &empty], &["config.json"]));
    let array = e.write("array/config.json", "[1, 2]");
    cases.push(case(&["inspect", &array], &["config.json"]));
    cases.push(case(
        &["inspect", "/nonexistent/config.json"],
        &["/nonexistent"],
    ));

    // ---- Token files.
    for (name, text, needle) in [
        ("t-empty.json", "", "t-empty.json"),
        ("t-notjson.json", "[[1,2,", "t-notjson.json"),
        ("t-flat.json", "[1,2,3]", "t-flat.json"),
        ("t-ragged.json", "[[1,2,3],[4,5]]", "t-ragged.json"),
        ("t-neg.json", "[[1,-2,3,4]]", "[0][1]"),
        ("t-big.json", "[[1,2,3,9999]]", "9999"),
        ("t-float.json", "[[1,2.5,3,4]]", "t-float.json"),
        ("t-str.json", "[[\"a\",\"b\"]]", "t-str.json"),
        ("t-none.json", "[]", "t-none.json"),
        ("t-emptyrow.json", "[[]]", "token"),
    ] {
        let t = e.write(name, text);
        cases.push(case(&["run", &m, "--tokens", &t, "--out", &out], &[needle]));
        cases.push(case(&["train", &m, "--tokens", &t], &[needle]));
    }
    let long: Vec<String> = (0..200).map(|i| (i % 250).to_string()).collect();
    let long = e.write("t-long.json", &format!("[[{}]]", long.join(",")));
    cases.push(case(
        &["run", &m, "--tokens", &long, "--out", &out],
        &["128"],
    ));
    let one = e.write("t-one.json", "[[1],[2]]");
    cases.push(case(&["train", &m, "--tokens", &one], &["at least 2"]));
    let mask = e.write("mask.json", "[[1,1,1]]");
    cases.push(case(
        &[
            "run",
            &m,
            "--tokens",
            &ids,
            "--attention-mask",
            &mask,
            "--out",
            &out,
        ],
        &["mask"],
    ));
    cases.push(case(
        &[
            "run",
            &m,
            "--tokens",
            "/nonexistent/ids.json",
            "--out",
            &out,
        ],
        &["/nonexistent/ids.json"],
    ));

    // ---- Meshes and strategies, in every subcommand that takes them.
    for (mesh, needle) in [
        ("tp=3", "tp=3"),
        ("dp=0", "dp"),
        ("tp=0", "tp"),
        ("tp", "tp"),
        ("tp=x", "tp"),
        ("tp=2,tp=2", "tp"),
        ("", "mesh"),
        ("dp=-1", "dp"),
        ("tp=99999999999999999999", "tp"),
    ] {
        cases.push(case(
            &["run", &m, "--tokens", &ids, "--out", &out, "--mesh", mesh],
            &[needle],
        ));
        cases.push(case(
            &["train", &m, "--tokens", &ids, "--mesh", mesh],
            &[needle],
        ));
        cases.push(case(
            &["compile", &m, "--mesh", mesh, "-o", &plan_out],
            &[needle],
        ));
    }
    for (strategy, needle) in [
        ("warp", "warp"),
        ("zero1,zero3", "zero"),
        ("zero2,fsdp", "fsdp"),
        ("zero9", "zero9"),
    ] {
        cases.push(case(
            &[
                "train",
                &m,
                "--tokens",
                &ids,
                "--mesh",
                "dp=2",
                "--strategy",
                strategy,
            ],
            &[needle],
        ));
        cases.push(case(
            &[
                "compile",
                &m,
                "--mesh",
                "dp=2",
                "--strategy",
                strategy,
                "-o",
                &plan_out,
            ],
            &[needle],
        ));
    }

    // ---- Training hyper-parameters and options.
    cases.extend(flag_cases(
        &["train", &m, "--tokens", &ids],
        &[
            ("--lr", "NaN"),
            ("--lr", "inf"),
            ("--lr", "0"),
            ("--lr", "-1"),
            ("--beta1", "1.5"),
            ("--beta1", "-0.1"),
            ("--beta1", "NaN"),
            ("--beta2", "1.0"),
            ("--beta2", "2"),
            ("--eps", "0"),
            ("--eps", "-1e-8"),
            ("--eps", "NaN"),
            ("--weight-decay", "-0.1"),
            ("--weight-decay", "NaN"),
            ("--steps", "0"),
            ("--micro-batches", "0"),
            ("--micro-batches", "3"),
            ("--recompute", "most"),
            ("--virtual-stages", "0"),
            ("--timeout", "0"),
        ],
        &[],
    ));
    cases.extend(flag_cases(
        &[
            "train",
            &m,
            "--tokens",
            &ids,
            "--mesh",
            "pp=2",
            "--micro-batches",
            "2",
        ],
        &[
            ("--schedule", "zigzag"),
            ("--stage-layers", "1,1"),
            ("--stage-layers", "a,b"),
            ("--virtual-stages", "0"),
        ],
        &[],
    ));
    let nan_model = e.model("nanw", |_| {});
    {
        // A NaN in one weight: named by tensor.
        let p = Path::new(&nan_model).join("model.safetensors");
        let mut bytes = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let at = 8 + n + 4 * 10;
        bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        std::fs::write(&p, bytes).unwrap();
    }
    cases.push(case(
        &["run", &nan_model, "--tokens", &ids, "--out", &out],
        &["non-finite"],
    ));
    cases.push(case(
        &["train", &nan_model, "--tokens", &ids, "--export", &ckpt],
        &["non-finite"],
    ));
    cases.push(case(
        &[
            "train", &m, "--tokens", &ids, "--lr", "1e30", "--steps", "4", "--export", &ckpt,
        ],
        &["step"],
    ));
    cases.push(case(
        &["train", &m, "--tokens", &ids, "--export", &m],
        &["--export"],
    ));
    cases.push(case(
        &["run", &m, "--tokens", &ids, "--out", &ids],
        &["--out"],
    ));

    // ---- Forward/plan options.
    cases.extend(flag_cases(
        &["compile", &m, "--mesh", "tp=2"],
        &[
            ("--batch", "0"),
            ("--seq", "0"),
            ("--gpus-per-node", "0"),
            ("--rewrite", "no-such-rule"),
            ("--cluster", "no-such-cluster"),
            ("--batch", "-1"),
        ],
        &["-o", &plan_out],
    ));
    for (plan, needle) in [
        ("/nonexistent-dir/plan.json", "/nonexistent-dir"),
        (e.dir.to_str().unwrap(), "directory"),
    ] {
        cases.push(case(
            &["compile", &m, "--mesh", "tp=2", "-o", plan],
            &[needle],
        ));
    }
    cases.extend(flag_cases(
        &[
            "simulate",
            "models/llama-3-8b.json",
            "--train",
            "--mesh",
            "pp=2,dp=2,tp=2",
        ],
        &[
            ("--cluster", "no-such-cluster"),
            ("--global-batch", "0"),
            ("--micro-batch", "0"),
            ("--recompute", "most"),
            ("--schedule", "zigzag"),
            ("--virtual-stages", "0"),
            ("--dtype", "f7"),
            ("--attention", "magic"),
            ("--trace-ranks", "5-2"),
        ],
        &["--trace", &trace],
    ));

    // ---- Plans.
    let garbage = e.write("garbage-plan.json", "{\"format_version\": 1");
    let wrong = e.write("wrong-plan.json", "{\"format_version\": 999999}");
    let empty_plan = e.write("empty-plan.json", "");
    for p in [&garbage, &wrong, &empty_plan] {
        cases.push(case(&["explain", p], &["plan"]));
        cases.push(case(&["simulate", "--plan", p], &["plan"]));
        cases.push(case(&["schedule", p], &["plan"]));
    }
    cases.push(case(
        &["explain", "/nonexistent/plan.json"],
        &["/nonexistent"],
    ));

    // ---- Schedules, benches, launches, calibrations.
    cases.extend(flag_cases(
        &["schedule"],
        &[
            ("--pp", "0"),
            ("--pp", "10000000"),
            ("--micro-batches", "0"),
            ("--micro-batches", "100000000"),
            ("--schedule", "zigzag"),
            ("--virtual-stages", "0"),
        ],
        &["--trace", &trace],
    ));
    cases.extend(flag_cases(
        &["bench", "collectives", "--max-bytes", "1M"],
        &[
            ("--max-bytes", "1T"),
            ("--nranks", "0"),
            ("--iters", "0"),
            ("--step-factor", "1"),
            ("--comm", "carrier-pigeon"),
            ("--min-bytes", "2M"),
        ],
        &[],
    ));
    cases.extend(flag_cases(
        &["launch"],
        &[
            ("--nproc-per-node", "0"),
            ("--nnodes", "0"),
            ("--node-rank", "5"),
        ],
        &["--", "inspect", &m],
    ));
    let meas = e.write("meas.json", "{\"device\": 3}");
    cases.push(case(
        &[
            "calibrate",
            "--measurements",
            &meas,
            "-o",
            &e.path("out/cal.toml"),
        ],
        &["meas.json"],
    ));
    let toml = e.write("bad-cluster.toml", "name = 3\n[[[");
    cases.push(case(
        &["simulate", "models/llama-3-8b.json", "--cluster", &toml],
        &["bad-cluster.toml"],
    ));

    let outputs: Vec<PathBuf> = [&out, &plan_out, &ckpt, &trace]
        .iter()
        .map(PathBuf::from)
        .collect();
    let outputs: Vec<&Path> = outputs.iter().map(PathBuf::as_path).collect();
    let total = cases.len();
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|c| {
            check(c, &outputs)
                .err()
                .map(|why| format!("shardc {}\n    {why}", c.args.join(" ")))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {total} bad inputs were not clear errors:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!("{total} bad inputs, each a named error");
}
