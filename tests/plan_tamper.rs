//! Plans read from disk are verified: a tampered, truncated or foreign plan file gives one
//! `error:` line naming what is wrong (the field, node, step, buffer, rank or instruction)
//! through `explain`, `simulate --plan` and `schedule`, never a panic; and no mutation of a
//! real plan makes loading, or the consumers of a plan that loads, panic.

mod common;

use common::{fails_with, run_shardc};

use proptest::prelude::*;
use serde_json::Value;
use shardc::compiler::cost::{chrome_trace, simulate_plan, Cluster, ComputeOptions};
use shardc::compiler::plan::{rehash, Plan};
use shardc::compiler::schedule::pp::PassCosts;
use shardc::compiler::schedule::Step;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Every reader of a plan file refuses `file` with `needles` in its one-line error.
fn every_reader_refuses(file: &Path, needles: &[&str]) {
    let f = file.to_str().unwrap();
    fails_with(&["explain", f], needles);
    fails_with(
        &["simulate", "--plan", f, "--cluster", "dgx-h100x4"],
        needles,
    );
    fails_with(&["schedule", f], needles);
}

fn fixture(model: &str) -> String {
    common::fixtures().join(model).to_string_lossy().to_string()
}

/// Compiled once per test binary: (name, plan JSON text).
fn plans() -> &'static [(&'static str, String)] {
    static PLANS: OnceLock<Vec<(&'static str, String)>> = OnceLock::new();
    PLANS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let llama = fixture("llama");
        let specs: [(&str, Vec<&str>); 3] = [
            (
                "forward tp=2",
                vec!["--mesh", "tp=2", "--batch", "2", "--seq", "8"],
            ),
            (
                "train dp=2,tp=2 sp",
                vec![
                    "--train",
                    "--mesh",
                    "dp=2,tp=2",
                    "--strategy",
                    "sp",
                    "--batch",
                    "2",
                    "--seq",
                    "4",
                ],
            ),
            (
                "train pp=2",
                vec![
                    "--train",
                    "--mesh",
                    "pp=2",
                    "--batch",
                    "2",
                    "--seq",
                    "4",
                    "--micro-batches",
                    "2",
                ],
            ),
        ];
        specs
            .into_iter()
            .map(|(name, flags)| {
                let out = dir.path().join("plan.json");
                let mut args = vec!["compile", llama.as_str()];
                args.extend(flags);
                args.extend(["-o", out.to_str().unwrap()]);
                let (ok, _, err) = run_shardc(&args, &[]);
                assert!(ok, "{name}: {err}");
                (name, std::fs::read_to_string(&out).unwrap())
            })
            .collect()
    })
}

fn plan_value(i: usize) -> Value {
    serde_json::from_str(&plans()[i].1).unwrap()
}

const FORWARD: usize = 0;
const PIPELINE: usize = 2;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Every reader of a plan file refuses plan `v` (written into `dir`) with `needles` in its
/// one-line error.
fn value_refused(dir: &Path, v: &Value, needles: &[&str]) {
    every_reader_refuses(&write_value(dir, v), needles);
}

fn write_value(dir: &Path, v: &Value) -> PathBuf {
    write(
        dir,
        "tampered.json",
        &serde_json::to_string_pretty(v).unwrap(),
    )
}

/// The index of the first node of the forward plan's program with op `op`.
fn node_with_op(v: &Value, op: &str) -> usize {
    v["program"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .position(|n| n["op"]["op"] == op)
        .unwrap()
}

#[test]
fn untouched_plans_load_through_every_reader() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in plans() {
        let p = Plan::from_json(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(p.to_json(), *text, "{name}: written again byte for byte");
        let f = write(dir.path(), "plan.json", text);
        let f = f.to_str().unwrap();
        let (ok, out, err) = run_shardc(&["explain", f], &[]);
        assert!(ok && out.contains("collectives"), "{name}: {err}");
        let (ok, out, err) = run_shardc(&["simulate", "--plan", f, "--cluster", "dgx-h100x4"], &[]);
        assert!(ok && !out.is_empty(), "{name}: {err}");
    }
    let f = write(dir.path(), "pp.json", &plans()[PIPELINE].1);
    let (ok, out, err) = run_shardc(&["schedule", f.to_str().unwrap()], &[]);
    assert!(ok && out.contains("send/recv pairs matched"), "{err}");
}

#[test]
fn out_of_range_ids_are_named() {
    let dir = tempfile::tempdir().unwrap();
    // A step computing a node the program does not have.
    let mut v = plan_value(FORWARD);
    let k = v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .position(|s| s["kind"] == "kernel")
        .unwrap();
    v["steps"][k]["value"] = 99_999.into();
    value_refused(
        dir.path(),
        &v,
        &[
            &format!("step {k} (kernel %99999)"),
            "not a node of the program",
        ],
    );
    // An operand past the end.
    let mut v = plan_value(FORWARD);
    let i = node_with_op(&v, "mat_mul");
    v["program"]["nodes"][i]["inputs"][0] = 4_000_000_000u64.into();
    value_refused(
        dir.path(),
        &v,
        &[&format!("program node %{i}"), "operand %4000000000"],
    );
    // Provenance of a collective that is not there.
    let mut v = plan_value(FORWARD);
    v["provenance"]["77777"] = v["provenance"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()
        .clone();
    value_refused(dir.path(), &v, &["plan field `provenance`", "key 77777"]);
    // A layout missing.
    let mut v = plan_value(FORWARD);
    v["shardings"].as_array_mut().unwrap().pop();
    value_refused(dir.path(), &v, &["plan field `shardings`", "entries"]);
    // A buffer of a node that does not exist.
    let mut v = plan_value(FORWARD);
    v["buffers"][3]["value"] = 123_456.into();
    value_refused(dir.path(), &v, &["buffer 3 (%123456)"]);
    // A step on a stream the plan does not name.
    let mut v = plan_value(FORWARD);
    v["steps"][0]["stream"] = 9.into();
    value_refused(dir.path(), &v, &["step 0", "stream 9"]);
    // A collective over an axis the mesh lacks.
    let mut v = plan_value(FORWARD);
    let i = node_with_op(&v, "all_reduce");
    v["program"]["nodes"][i]["op"]["axis"] = "dp".into();
    value_refused(
        dir.path(),
        &v,
        &[
            &format!("program node %{i}"),
            "`dp`",
            "not an axis of mesh tp=2",
        ],
    );
    // A pipeline send to a rank that does not exist, and a node list naming a missing value.
    let mut v = plan_value(PIPELINE);
    let k = v["pipeline_program"][0]
        .as_array()
        .unwrap()
        .iter()
        .position(|o| o.get("send").is_some())
        .unwrap();
    v["pipeline_program"][0][k]["send"]["to"] = 5.into();
    value_refused(
        dir.path(),
        &v,
        &[
            &format!("rank 0, instruction {k}"),
            "rank 5 is not one of the 2 pipeline ranks",
        ],
    );
    let mut v = plan_value(PIPELINE);
    v["pipeline_nodes"][1][0][0] = 31_337.into();
    value_refused(
        dir.path(),
        &v,
        &["chunk 1, pass F", "value %31337", "does not exist"],
    );
}

#[test]
fn edited_shapes_name_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let mut v = plan_value(FORWARD);
    let i = node_with_op(&v, "mat_mul");
    let name = v["program"]["nodes"][i]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let dims = v["program"]["nodes"][i]["ty"]["dims"]
        .as_array_mut()
        .unwrap();
    let last = dims.len() - 1;
    let size = dims[last]["size"].as_u64().unwrap();
    dims[last]["size"] = (size * 2).into();
    value_refused(
        dir.path(),
        &v,
        &[
            &format!("program node %{i} `{name}`"),
            "stored type",
            "but its operands give",
        ],
    );
    // A chunk of a pipeline plan: named by chunk.
    let mut v = plan_value(PIPELINE);
    let nodes = v["chunks"][1]["program"]["nodes"].as_array_mut().unwrap();
    let i = nodes
        .iter()
        .position(|n| n["op"]["op"] == "mat_mul")
        .unwrap();
    nodes[i]["ty"]["dtype"] = "f16".into();
    value_refused(
        dir.path(),
        &v,
        &[&format!("chunk 1 node %{i}"), "stored type f16"],
    );
}

#[test]
fn swapped_steps_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut v = plan_value(FORWARD);
    let plan = Plan::from_json(&plans()[FORWARD].1).unwrap();
    // The first step whose node reads the node of the step right before it.
    let value = |s: &Step| match s {
        Step::Kernel { value, .. } | Step::Gemm { value, .. } => Some(*value),
        _ => None,
    };
    let k = (1..plan.steps.len())
        .find(
            |&k| match (value(&plan.steps[k - 1]), value(&plan.steps[k])) {
                (Some(a), Some(b)) => plan.program.node(b).inputs.contains(&a),
                _ => false,
            },
        )
        .unwrap();
    v["steps"].as_array_mut().unwrap().swap(k - 1, k);
    value_refused(
        dir.path(),
        &v,
        &[
            &format!("step {} (", k - 1),
            "runs before its operand",
            &format!("(scheduled at step {k})"),
        ],
    );
    // A step dropped: its node is never computed.
    let mut v = plan_value(FORWARD);
    let steps = v["steps"].as_array_mut().unwrap();
    let last = steps.iter().rposition(|s| s["kind"] == "kernel").unwrap();
    let node = steps[last]["value"].as_u64().unwrap();
    steps.remove(last);
    // (Named at its first reader, or by itself when nothing reads it.)
    let (_, _, err) = run_shardc(
        &["explain", write_value(dir.path(), &v).to_str().unwrap()],
        &[],
    );
    let needles: [&str; 2] = if err.contains("no step computes it") {
        [&format!("program node %{node}"), "no step computes it"]
    } else {
        [&format!("its operand %{node}"), "(never scheduled)"]
    };
    value_refused(dir.path(), &v, &needles);
}

#[test]
fn version_truncation_and_json_errors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let text = &plans()[FORWARD].1;
    let mut v = plan_value(FORWARD);
    v["format_version"] = 1.into();
    value_refused(
        dir.path(),
        &v,
        &["plan format version 1, this shardc reads version 6"],
    );
    every_reader_refuses(
        &write(dir.path(), "cut.json", &text[..text.len() / 2]),
        &["plan file ends early", "truncated"],
    );
    every_reader_refuses(&write(dir.path(), "empty.json", ""), &["empty plan file"]);
    every_reader_refuses(
        &write(dir.path(), "text.json", "layers: 3\n"),
        &["malformed plan: not valid JSON"],
    );
    every_reader_refuses(
        &write(dir.path(), "list.json", "[1, 2]"),
        &["the plan is a JSON array, not an object"],
    );
    let mut v = plan_value(FORWARD);
    v["model"]["layers"] = "three".into();
    value_refused(
        dir.path(),
        &v,
        &["plan field `model`", "invalid type: string \"three\""],
    );
    let mut v = plan_value(FORWARD);
    v["program"]["nodes"][5]["inputs"] = Value::Null;
    value_refused(
        dir.path(),
        &v,
        &["plan field `program.nodes[5]`", "invalid type: null"],
    );
    let mut v = plan_value(FORWARD);
    v.as_object_mut().unwrap().remove("steps");
    value_refused(dir.path(), &v, &["plan field `steps`: missing"]);
    // A name with a line break stays on one line.
    let mut v = plan_value(FORWARD);
    v["format_version"] = "2\nsecond line".into();
    value_refused(
        dir.path(),
        &v,
        &["plan field `format_version`: expected an integer, found a string"],
    );
}

#[test]
fn a_mesh_axis_of_size_zero_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut v = plan_value(FORWARD);
    v["mesh"]["axes"][0]["size"] = 0.into();
    value_refused(dir.path(), &v, &["plan mesh: axis `tp` has size 0"]);
    // A size that disagrees with the collectives partitioned for the axis.
    let mut v = plan_value(FORWARD);
    v["mesh"]["axes"][0]["size"] = 1_000_000.into();
    value_refused(
        dir.path(),
        &v,
        &["in 2 parts, but `tp` has 1000000 ranks in mesh tp=1000000"],
    );
    // A pipeline schedule of more stages than the `pp` axis has.
    let mut v = plan_value(PIPELINE);
    v["pipeline"]["stages"] = 3.into();
    value_refused(
        dir.path(),
        &v,
        &[
            "plan field `pipeline.stages`",
            "3, but the mesh's `pp` axis has 2 ranks",
        ],
    );
    // More layers than the program has.
    let mut v = plan_value(FORWARD);
    v["model"]["layers"] = 4_000_000_000u64.into();
    value_refused(dir.path(), &v, &["plan field `model.layers`"]);
}

#[test]
fn an_edit_the_verifier_accepts_is_a_hash_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let original = plan_value(FORWARD);
    let mut v = original.clone();
    v["memory"]["param_bytes"] = 1024.into();
    let recorded = original["hash"].as_str().unwrap();
    assert!(recorded.starts_with("blake3:") && recorded.len() == 7 + 64);
    value_refused(
        dir.path(),
        &v,
        &[
            "plan hash mismatch: the file was edited after compile",
            &format!("expected {recorded}, found blake3:"),
        ],
    );
    // Formatting does not matter: compact JSON of the same plan loads.
    let compact = serde_json::to_string(&original).unwrap();
    let f = write(dir.path(), "compact.json", &compact);
    let (ok, _, err) = run_shardc(&["explain", f.to_str().unwrap()], &[]);
    assert!(ok, "{err}");
    // Re-hashed, the same edit loads (the verifier has nothing against it).
    let f = write(
        dir.path(),
        "rehashed.json",
        &rehash(&serde_json::to_string(&v).unwrap()).unwrap(),
    );
    let (ok, out, err) = run_shardc(&["explain", f.to_str().unwrap()], &[]);
    // 1024 bytes of f32 parameters, reported at the plan's bf16.
    assert!(ok && out.contains("params 512 B"), "{out}{err}");
    // A plan without a hash.
    v.as_object_mut().unwrap().remove("hash");
    value_refused(dir.path(), &v, &["plan has no `hash` field"]);
}

// ---- No panic on any plan file ----

/// One edit of a JSON plan.
#[derive(Clone, Debug)]
enum Mutation {
    /// Adds `delta` to a number (or replaces a non-number by it).
    Bump(usize, i64),
    /// Removes the key of an object member.
    Delete(usize),
    /// Swaps two elements of an array.
    Swap(usize, usize, usize),
    /// Replaces a value by null, a string, a huge or negative number, or an empty container.
    Replace(usize, u8),
    /// Cuts the text at a fraction of its length.
    Truncate(f64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), -3i64..=3).prop_map(|(p, d)| Mutation::Bump(p, d)),
        any::<usize>().prop_map(Mutation::Delete),
        (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(p, a, b)| Mutation::Swap(p, a, b)),
        (any::<usize>(), 0u8..6).prop_map(|(p, k)| Mutation::Replace(p, k)),
        (0.0f64..1.0).prop_map(Mutation::Truncate),
    ]
}

/// Every value of `v` as a JSON pointer, in document order.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                out.push(p.clone());
                pointers(x, p, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                let p = format!("{at}/{i}");
                out.push(p.clone());
                pointers(x, p, out);
            }
        }
        _ => {}
    }
}

fn parent(p: &str) -> (&str, &str) {
    p.rsplit_once('/').expect("a pointer below the root")
}

/// The mutated plan text.
fn apply(text: &str, v: &Value, ptrs: &[String], m: &Mutation) -> String {
    let mut v = v.clone();
    match *m {
        Mutation::Truncate(f) => {
            let mut cut = (text.len() as f64 * f) as usize;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            return text[..cut].to_string();
        }
        Mutation::Bump(i, d) => {
            let x = v.pointer_mut(&ptrs[i % ptrs.len()]).unwrap();
            *x = match x.as_i64() {
                Some(n) => n.saturating_add(d).into(),
                None => match x.as_u64() {
                    Some(n) => n.saturating_add_signed(d).into(),
                    None => d.into(),
                },
            };
        }
        Mutation::Delete(i) => {
            let (up, key) = parent(&ptrs[i % ptrs.len()]);
            let key = key.replace("~1", "/").replace("~0", "~");
            match v.pointer_mut(up).unwrap() {
                Value::Object(o) => {
                    o.remove(&key);
                }
                Value::Array(a) => {
                    a.remove(key.parse::<usize>().unwrap());
                }
                _ => unreachable!("a parent is a container"),
            }
        }
        Mutation::Swap(i, a, b) => {
            // The innermost array at or above the pointer.
            let mut p = ptrs[i % ptrs.len()].as_str();
            loop {
                if let Some(Value::Array(arr)) = v.pointer_mut(p) {
                    if !arr.is_empty() {
                        let n = arr.len();
                        arr.swap(a % n, b % n);
                    }
                    break;
                }
                if p.is_empty() {
                    break;
                }
                p = parent(p).0;
            }
        }
        Mutation::Replace(i, k) => {
            let x = v.pointer_mut(&ptrs[i % ptrs.len()]).unwrap();
            *x = match k {
                0 => Value::Null,
                1 => "x\ny".into(),
                2 => u64::MAX.into(),
                3 => (-1i64).into(),
                4 => Value::Array(Vec::new()),
                _ => Value::Object(Default::default()),
            };
        }
    }
    serde_json::to_string(&v).unwrap()
}

/// What `explain`, `simulate --plan` and `schedule` do with a loaded plan, in process.
fn consume(plan: &Plan) {
    // explain (and its summary)
    let by_layer = plan.collectives_by_layer();
    for list in by_layer.values() {
        for (_, _, _, v) in list {
            let _ = &plan.program.node(*v).name;
            let _ = plan.provenance.get(&v.0);
        }
    }
    let _ = plan.norm_residual_bytes();
    let _ = plan.mesh.world_size();
    let layers = plan.model.layers as u32;
    assert!(
        (layers as usize)
            <= plan.program.len() + plan.chunks.iter().map(|c| c.program.len()).sum::<usize>()
    );
    for l in 0..layers {
        let _ = by_layer.get(&Some(l));
    }
    // simulate --plan
    let Ok(cluster) = Cluster::resolve_for("dgx-h100", plan.mesh.world_size()) else {
        return;
    };
    let opts = ComputeOptions::default();
    if let Ok(sim) = simulate_plan(plan, &cluster, &opts) {
        let _ = chrome_trace(&sim, None);
        let _ = serde_json::to_string(&sim.report).unwrap();
    }
    // schedule
    if let Some(s) = &plan.pipeline {
        let r = s.replay(PassCosts::uniform(1.0)).unwrap();
        let _ = r.diagram(
            s.stages,
            1.0 / s.virtual_stages as f64,
            s.virtual_stages > 1,
        );
        let _ = r.trace_events(s.stages, 1000.0);
    }
}

fn parsed() -> &'static [(Value, Vec<String>)] {
    static P: OnceLock<Vec<(Value, Vec<String>)>> = OnceLock::new();
    P.get_or_init(|| {
        plans()
            .iter()
            .map(|(_, t)| {
                let v: Value = serde_json::from_str(t).unwrap();
                let mut ptrs = Vec::new();
                pointers(&v, String::new(), &mut ptrs);
                (v, ptrs)
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A mutated plan either loads or is refused with a message; re-hashed (so that only the
    /// verifier judges it), the same holds, and a plan that loads goes through every consumer.
    #[test]
    fn no_mutation_of_a_plan_panics(which in 0usize..3, m in mutation()) {
        let (v, ptrs) = &parsed()[which];
        let text = apply(&plans()[which].1, v, ptrs, &m);
        match Plan::from_json(&text) {
            Ok(p) => consume(&p),
            Err(e) => prop_assert!(!e.to_string().trim().is_empty()),
        }
        if let Ok(stamped) = rehash(&text) {
            match Plan::from_json(&stamped) {
                Ok(p) => consume(&p),
                Err(e) => {
                    let msg = e.to_string();
                    prop_assert!(!msg.trim().is_empty() && !msg.contains('\n'), "{msg}");
                    prop_assert!(!msg.contains("hash mismatch"), "{msg}");
                }
            }
        }
    }
}
