//! `shardc inspect --json`, a bare `shardc compile` (the README's first command) and
//! `shardc explain` on its plan.

mod common;

use std::process::Command;

fn shardc_in(dir: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn inspect_json_gives_published_counts() {
    let root = env!("CARGO_MANIFEST_DIR");
    for (file, want) in [
        ("models/gpt2.json", 124_439_808u64),
        ("models/llama-2-7b.json", 6_738_415_616),
        ("models/llama-3-8b.json", 8_030_261_248),
        ("models/mixtral-8x7b.json", 46_702_792_704),
        ("tests/fixtures/hf-tiny/llama", 165_312),
    ] {
        let out = shardc_in(root.as_ref(), &["inspect", file, "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["params"].as_u64(), Some(want), "{file}");
        assert_eq!(
            v["memory_bytes"]["training_adamw_mixed"].as_u64(),
            Some(16 * want)
        );
        assert_eq!(v["memory_bytes"]["inference_bf16"].as_u64(), Some(2 * want));
        let parts = common::sum_u64(&v["params_by_component"]);
        assert_eq!(parts, want, "{file}: components add up");
        assert_eq!(
            v["flops_per_token"]["training"].as_u64(),
            v["flops_per_token"]["forward"].as_u64().map(|f| 3 * f)
        );
    }
    let text = shardc_in(root.as_ref(), &["inspect"]);
    assert!(text.contains("8,030,261,248 parameters"), "{text}");
}

#[test]
fn bare_compile_writes_the_default_plan_and_explain_reads_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = shardc_in(tmp.path(), &["compile"]);
    assert!(out.contains("llama-3-8b"), "{out}");
    assert!(out.contains("mesh dp=2,tp=4"), "{out}");
    assert!(out.contains("strategies dp,tp,sp"), "{out}");
    assert!(out.contains("every layer identical, 4 per layer"), "{out}");
    let plan = tmp.path().join("plan.json");
    assert!(plan.exists());
    let ex = shardc_in(tmp.path(), &["explain", "plan.json", "--layer", "0"]);
    // Each collective of layer 0 with its provenance: which op's rule required it.
    assert_eq!(ex.matches("reduce_scatter over tp").count(), 2, "{ex}");
    assert_eq!(ex.matches("all_gather over tp").count(), 2, "{ex}");
    assert!(
        ex.contains("required by operand 0 of `layers.0.attn.q_proj` (matmul)"),
        "{ex}"
    );
    assert!(ex.contains("residual stream"), "{ex}");
}
