//! The rewriter on the fixture models, end to end: plain Megatron TP rewritten discovers
//! Megatron sequence parallelism (the `sp` preset's program, compared as canonical text), and
//! every rewritten program (sequence-parallel rules, or every rule: collective matmuls and
//! fused kernels included) reproduces transformers' logits on thread ranks (< 1e-4).

mod common;

use shardc::compiler::compile::{compile_forward, compile_forward_with, CompileOptions};
use shardc::compiler::model::ModelConfig;
use shardc::compiler::rewrite::{Objective, RewriteOptions};
use shardc::compiler::shard::Mesh;
use shardc::runtime::Weights;

fn options(mesh: &str, extra: &str, b: usize, t: usize) -> CompileOptions {
    CompileOptions {
        batch: b,
        seq: t,
        mesh: Mesh::parse(mesh, 8).expect("mesh"),
        extra_strategies: if extra.is_empty() {
            vec![]
        } else {
            vec![extra.to_string()]
        },
    }
}

fn rules(s: &str) -> RewriteOptions {
    RewriteOptions::with_rules(s.parse().expect("rule selection"))
}

#[test]
fn rewritten_plans_reproduce_every_fixture() {
    let mut fired = 0;
    let mut ops: std::collections::BTreeMap<&'static str, usize> = Default::default();
    let variants: Vec<(&str, &str, &str)> = ["tp=2", "tp=4", "dp=2,tp=2"]
        .into_iter()
        .flat_map(|mesh| {
            [("", "sequence-parallel"), ("", "all"), ("sp", "all")]
                .map(|(extra, sel)| (mesh, extra, sel))
        })
        .collect();
    let ran = common::check_every_case(
        &variants,
        |cfg, case, &(mesh, extra, sel)| {
            // Meshes that do not divide this model or case are errors, checked elsewhere.
            let opts = options(mesh, extra, case.batch, case.seq);
            compile_forward_with(cfg, &opts, &rules(sel)).ok()
        },
        |c| {
            let report = c.report.as_ref().expect("rules ran");
            fired += report.fired.values().sum::<usize>();
            for n in &c.sharded.graph.nodes {
                *ops.entry(n.op.mnemonic()).or_default() += 1;
            }
        },
    );
    eprintln!("{ran} runs; ops: {ops:?}");
    assert!(ran >= 30, "only {ran} rewritten runs");
    assert!(fired > 0, "no rule fired");
    // The runs exercise every op the rewriter creates.
    let created = [
        "reduce_scatter",
        "all_gather",
        "ag_matmul",
        "matmul_rs",
        "fused_elementwise",
        "fused_matmul",
    ];
    common::assert_each_counted(&ops, created, |op| format!("no {op} in any rewritten plan"));
}

/// A copy of a fixture model with `layers` decoder layers, layer `l` holding the fixture's
/// layer `l mod n` weights (`layers.<i>.` or `h.<i>.` in the tensor names).
fn deeper(model: &str, layers: usize, dir: &std::path::Path) -> std::path::PathBuf {
    let src = common::fixtures().join(model);
    let out = dir.join(model);
    std::fs::create_dir_all(&out).expect("dir");
    let mut cfg = common::read_json(src.join("config.json"));
    let key = if cfg.get("n_layer").is_some() {
        "n_layer"
    } else {
        "num_hidden_layers"
    };
    let n = cfg[key].as_u64().expect("layers") as usize;
    cfg[key] = serde_json::json!(layers);
    std::fs::write(out.join("config.json"), cfg.to_string()).expect("write config");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("weights");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let layer = ["layers.", "h."].iter().find_map(|p| {
            let i = name.find(p)? + p.len();
            let rest = &name[i..];
            let num: String = rest.chars().take_while(char::is_ascii_digit).collect();
            num.parse::<usize>().ok().map(|l| (i, num.len(), l))
        });
        match layer {
            Some((i, len, l)) => {
                for k in (0..layers).filter(|k| k % n == l) {
                    let renamed = format!("{}{k}{}", &name[..i], &name[i + len..]);
                    tensors.push((
                        renamed,
                        view.dtype(),
                        view.shape().to_vec(),
                        view.data().to_vec(),
                    ));
                }
            }
            None => tensors.push((
                name.clone(),
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )),
        }
    }
    common::write_safetensors(&out.join("model.safetensors"), &tensors);
    out
}

/// Seven layers: the rewriter plans a window of three and replicates layer 1; the program it
/// builds computes, on every rank, what the unsharded model computes.
#[test]
fn replicated_layer_plans_match_the_unsharded_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    let case = common::cases()
        .into_iter()
        .find(|c| c.model == "llama" && c.batch == 2)
        .expect("a llama case");
    for model in ["llama", "gpt2"] {
        let dir = deeper(model, 7, tmp.path());
        let cfg = ModelConfig::from_path(&dir).expect("config");
        let w = Weights::open(&dir).expect("weights");
        let inputs = case.inputs();
        let single = options("tp=1", "", case.batch, case.seq);
        let reference = compile_forward(&cfg, &single).expect("unsharded");
        let want = common::run_ranks(&reference.sharded, &w, &inputs, "unsharded run");
        // The layer search's rules too, from the replicated program: the layouts chosen in
        // the window (by the cost model, or at random) are replicated with each layer's own
        // weights, split as the template's are.
        let layers = shardc::compiler::rewrite::rules::LAYER_SEARCH.join(",");
        let cases = [
            ("", "sequence-parallel", Objective::Model),
            ("", "all", Objective::Model),
            ("replicated", layers.as_str(), Objective::Model),
            ("replicated", layers.as_str(), Objective::Shuffle(3)),
        ];
        for (extra, sel, objective) in cases {
            let opts = options("tp=2", extra, case.batch, case.seq);
            let rw = RewriteOptions {
                objective,
                ..rules(sel)
            };
            let c = compile_forward_with(&cfg, &opts, &rw).expect("rewritten");
            let report = c.report.as_ref().expect("report");
            assert!(
                matches!(
                    report.layers,
                    shardc::compiler::rewrite::LayerPlanning::Window { layers: 7, .. }
                ),
                "{model} {sel}: {:?}",
                report.layers
            );
            let got = common::run_ranks(&c.sharded, &w, &inputs, &format!("{model} {sel}"));
            for (rank, out) in got.iter().enumerate() {
                for name in ["logits", "hidden"] {
                    let (a, b) = (
                        want[0][name].as_f32().expect("f32"),
                        out[name].as_f32().expect("f32"),
                    );
                    let d = case.max_diff(a, b, a.len() / (case.batch * case.seq));
                    assert!(d < 1e-4, "{model} {sel} rank {rank} {name}: max |Δ| {d}");
                }
            }
        }
    }
}
