//! Plans: byte-identical for the same inputs, JSON round trip, the collective-order check, and
//! the per-rank activation savings of sequence parallelism.

use shardc_compiler::compile::{compile_forward, CompileOptions};
use shardc_compiler::model::ModelConfig;
use shardc_compiler::plan::{Plan, PlanError};
use shardc_compiler::shard::Mesh;
use std::path::PathBuf;

fn plan(model: &str, mesh: &str, extra: &[&str], b: usize, t: usize) -> Plan {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = if model.ends_with(".json") {
        root.join("models").join(model)
    } else {
        root.join("tests/fixtures/hf-tiny").join(model)
    };
    let cfg = ModelConfig::from_path(&p).unwrap();
    let opts = CompileOptions {
        batch: b,
        seq: t,
        mesh: Mesh::parse(mesh, 8).unwrap(),
        extra_strategies: extra.iter().map(|s| s.to_string()).collect(),
    };
    let c = compile_forward(&cfg, &opts).unwrap();
    Plan::new(&c, model, cfg.arch.name(), cfg.layers)
}

/// Every kind of forward plan the compiler makes: model, mesh and extra strategies.
const KINDS: &[(&str, &str, &[&str])] = &[
    ("llama", "dp=2,tp=2", &["sp"]),
    ("mixtral", "ep=2,tp=2", &[]),
    ("gpt2", "tp=2", &[]),
    ("llama-3-8b.json", "dp=2,tp=4", &["sp"]),
];

#[test]
fn same_inputs_give_byte_identical_plans() {
    for &(model, mesh, extra) in KINDS {
        let a = plan(model, mesh, extra, 2, 16).to_json();
        let b = plan(model, mesh, extra, 2, 16).to_json();
        assert_eq!(a, b, "{model} {mesh}");
        assert!(a.contains("\"format_version\": 6"));
    }
}

#[test]
fn plan_json_round_trips() {
    let p = plan("llama", "dp=2,tp=2", &["sp"], 2, 16);
    let back = Plan::from_json(&p.to_json()).unwrap();
    assert_eq!(back, p);
    assert_eq!(back.to_json(), p.to_json());
    let mut v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
    v["format_version"] = 99.into();
    assert!(matches!(
        Plan::from_json(&v.to_string()),
        Err(PlanError::Version { found: 99, .. })
    ));
    assert!(matches!(
        Plan::from_json("{"),
        Err(PlanError::Truncated { line: 1, .. })
    ));
    assert!(matches!(Plan::from_json("plan"), Err(PlanError::Json(_))));
    assert!(matches!(Plan::from_json(" \n"), Err(PlanError::Empty)));
}

/// The hash covers the content, not the formatting: compact JSON of a plan loads; a changed
/// value that the verifier accepts does not, until re-hashed.
#[test]
fn the_content_hash_catches_edits_not_formatting() {
    let p = plan("llama", "tp=2", &[], 2, 16);
    let mut v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
    assert_eq!(v["hash"], shardc_compiler::plan::content_hash(&v).as_str());
    assert_eq!(Plan::from_json(&v.to_string()).unwrap(), p);
    v["model"]["source"] = "elsewhere".into();
    assert!(matches!(
        Plan::from_json(&v.to_string()),
        Err(PlanError::HashMismatch { .. })
    ));
    let back = Plan::from_json(&shardc_compiler::plan::rehash(&v.to_string()).unwrap()).unwrap();
    assert_eq!(back.model.source, "elsewhere");
}

/// Every kind of forward plan passes the verifier it is loaded with.
#[test]
fn compiled_plans_verify() {
    for &(model, mesh, extra) in KINDS {
        let p = plan(model, mesh, extra, 2, 16);
        p.verify().unwrap_or_else(|e| panic!("{model} {mesh}: {e}"));
        Plan::from_json(&p.to_json()).unwrap_or_else(|e| panic!("{model} {mesh}: {e}"));
    }
}

#[test]
fn collective_order_check_catches_divergent_ranks() {
    let p = plan("llama", "dp=2,tp=2", &["sp"], 2, 16);
    p.check_collective_order().unwrap();
    // Rank 3 skips its last tp collective: the check names the axis, group and position.
    let err = p
        .check_collective_order_with(&|r| {
            let mut s = p.collectives_of(r);
            if r == 3 {
                s.get_mut("tp").unwrap().pop();
            }
            s
        })
        .unwrap_err();
    let n = p.collectives_of(0)["tp"].len();
    match &err {
        PlanError::CollectiveOrder {
            axis,
            group,
            b,
            pos,
            right,
            ..
        } => {
            assert_eq!(
                (axis.as_str(), group.as_slice(), *b, *pos),
                ("tp", &[2, 3][..], 3, n - 1)
            );
            assert_eq!(right, "nothing");
        }
        e => panic!("unexpected {e}"),
    }
    // Rank 1 swaps two dp collectives of different sizes.
    let err = p
        .check_collective_order_with(&|r| {
            let mut s = p.collectives_of(r);
            if r == 1 {
                let dp = s.get_mut("dp").unwrap();
                let k = dp.len();
                dp.swap(0, k - 1);
            }
            s
        })
        .unwrap_err();
    assert!(err.to_string().contains("`dp`"), "{err}");
}

#[test]
fn sequence_parallel_divides_norm_and_residual_activations_by_tp() {
    for tp in [2usize, 4] {
        let mesh = format!("tp={tp}");
        let plain = plan("llama-3-8b.json", &mesh, &[], 2, 64);
        let sp = plan("llama-3-8b.json", &mesh, &["sp"], 2, 64);
        assert_eq!(
            plain.norm_residual_bytes(),
            tp as u64 * sp.norm_residual_bytes(),
            "tp={tp}"
        );
    }
}

#[test]
fn per_rank_params_shrink_with_tp() {
    let one = plan("llama", "dp=2", &[], 2, 16).memory.param_bytes;
    let two = plan("llama", "tp=2", &[], 2, 16).memory.param_bytes;
    // Everything but norms (replicated) halves.
    assert!(two < one && two * 2 > one, "{one} vs {two}");
}

/// A training plan of the llama fixture on `mesh` (a pipeline when it has `pp`).
fn train_plan(mesh: &str, extra: &[&str], micro_batches: usize) -> Plan {
    use shardc_compiler::train::{compile_pipeline, compile_train, Precision, TrainOptions};
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let cfg = ModelConfig::from_path(&root.join("tests/fixtures/hf-tiny/llama")).unwrap();
    let mut o = TrainOptions::new(4, 16, Mesh::parse(mesh, 8).unwrap());
    o.extra_strategies = extra.iter().map(|s| s.to_string()).collect();
    o.micro_batches = micro_batches;
    let (arch, layers, p) = ("llama", cfg.layers, Precision::f32());
    if mesh.contains("pp") {
        compile_pipeline(&cfg, &o)
            .unwrap()
            .plan("llama", arch, layers, p)
    } else {
        compile_train(&cfg, &o)
            .unwrap()
            .plan("llama", arch, layers, p)
    }
}

/// An edit of a plan's JSON.
type Edit = fn(&mut serde_json::Value);

#[test]
fn training_plans_carry_a_verified_training_section() {
    for (mesh, extra, k) in [("dp=2,tp=2", vec!["zero1"], 2), ("pp=2,dp=2", vec![], 2)] {
        let p = train_plan(mesh, &extra, k);
        let t = p.train.as_ref().expect("a training section");
        assert_eq!(t.micro_batches, k);
        assert_eq!(t.denom, 4 * 15);
        assert!(t
            .params
            .iter()
            .any(|q| q.source.name == "model.embed_tokens.weight"));
        if mesh.contains("pp") {
            // Every chunk's parameters, each in the chunk that holds it.
            let chunks: std::collections::BTreeSet<usize> =
                t.params.iter().map(|q| q.chunk).collect();
            assert_eq!(chunks.len(), p.chunks.len(), "{mesh}");
        }
        let json = p.to_json();
        assert_eq!(Plan::from_json(&json).unwrap(), p, "{mesh}");
        assert_eq!(json, p.to_json(), "{mesh}: deterministic");
        // A name that is not an input of the program, a chunk that does not exist, a type that
        // is not the program's: named errors, no panic.
        let edits: [(&str, Edit, &str); 4] = [
            (
                "param",
                |v| v["train"]["params"][0]["param"] = "param.nope".into(),
                "`param.nope` of `",
            ),
            (
                "grad",
                |v| v["train"]["params"][1]["grad"] = "loss.x".into(),
                "is not an output",
            ),
            (
                "chunk",
                |v| v["train"]["params"][0]["chunk"] = 9.into(),
                "program 9 does not exist",
            ),
            (
                "ty",
                |v| v["train"]["params"][0]["ty"]["dims"][0]["size"] = 7.into(),
                "train.params[0].ty",
            ),
        ];
        for (what, edit, needle) in edits {
            let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
            edit(&mut v);
            let text = shardc_compiler::plan::rehash(&v.to_string()).unwrap();
            let e = Plan::from_json(&text).expect_err(what).to_string();
            assert!(e.contains(needle), "{mesh} {what}: {e}");
        }
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["train"]["micro_batches"] = 3.into();
        let text = shardc_compiler::plan::rehash(&v.to_string()).unwrap();
        let e = Plan::from_json(&text).unwrap_err().to_string();
        assert!(
            e.contains("plan field `train.micro_batches`"),
            "{mesh}: {e}"
        );
    }
}
