//! Plans carry their compute dtype: `compile` accounts memory and traffic in it (bf16 by
//! default, as a GPU runs the plan; `--dtype f32` for the CPU reference's), the fit check and
//! `simulate --plan` use it, the plan file records it, a non-float one is refused at load,
//! and the CPU reference says that it runs f32.

mod common;

use common::{fails_with, gib_after, run_shardc};
use shardc::compiler::plan::{rehash, Plan};

const L70: &str = "models/llama-3-70b.json";

fn compile(dir: &std::path::Path, name: &str, extra: &[&str]) -> (String, Plan) {
    let out = dir.join(name);
    let mut args = vec![
        "compile",
        L70,
        "--mesh",
        "tp=4",
        "--batch",
        "2",
        "--seq",
        "1024",
        "--allow-oom",
        "-o",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (ok, stdout, err) = run_shardc(&args, &[]);
    assert!(ok, "{err}");
    (stdout, Plan::load(&out).unwrap())
}

/// `per rank (DTYPE…): params X GiB` → X.
fn params_gib(summary: &str) -> f64 {
    let l = summary
        .lines()
        .find(|l| l.starts_with("per rank ("))
        .unwrap_or_else(|| panic!("{summary}"));
    gib_after(l, "params ")
}

#[test]
fn plans_are_accounted_in_their_compute_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let (bf16_out, bf16) = compile(dir.path(), "bf16.json", &[]);
    let (f32_out, f32) = compile(dir.path(), "f32.json", &["--dtype", "f32"]);
    assert_eq!(bf16.dtype.name(), "bf16");
    assert_eq!(f32.dtype.name(), "f32");
    assert!(
        bf16_out.contains("per rank (bf16; the CPU reference runs f32)"),
        "{bf16_out}"
    );
    assert!(f32_out.contains("per rank (f32)"), "{f32_out}");
    // The same program; its parameters at 2 and 4 bytes: Llama-3-70B's 70.55 B over tp=4
    // (embedding and head split too, norms replicated).
    assert_eq!(bf16.program, f32.program);
    let (b, f) = (params_gib(&bf16_out), params_gib(&f32_out));
    assert!((f / b - 2.0).abs() < 1e-3, "{b} {f}");
    assert!(
        (b - 70.55e9 * 2.0 / 4.0 / (1u64 << 30) as f64).abs() < 0.1,
        "{b}"
    );
    // The plan file records a 16-bit dtype; an f32 plan is the field's default.
    let text = std::fs::read_to_string(dir.path().join("bf16.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["dtype"], "bf16");
    let v32 = common::read_json(dir.path().join("f32.json"));
    assert!(v32.get("dtype").is_none());
    // simulate --plan replays in the plan's dtype unless told otherwise.
    let sim = |p: &str, extra: &[&str]| {
        let path = dir.path().join(p);
        let mut args = vec!["simulate", "--plan", path.to_str().unwrap(), "--json"];
        args.extend_from_slice(extra);
        let (ok, out, err) = run_shardc(&args, &[]);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    assert_eq!(sim("bf16.json", &[])["dtype"], "bf16");
    assert_eq!(sim("f32.json", &[])["dtype"], "f32");
    assert_eq!(sim("f32.json", &["--dtype", "bf16"])["dtype"], "bf16");
    // A tampered dtype is named.
    let mut bad = v.clone();
    bad["dtype"] = "i32".into();
    let p = dir.path().join("bad.json");
    std::fs::write(&p, rehash(&bad.to_string()).unwrap()).unwrap();
    let e = Plan::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("dtype") && e.contains("not a floating-point type"),
        "{e}"
    );
    fails_with(
        &["compile", "tests/fixtures/hf-tiny/llama", "--dtype", "int8"],
        &["--dtype `int8`: expected bf16 or f32"],
    );
}

/// The fit check uses the plan's dtype: Llama-3-70B on one GPU needs 131.4 GiB of bf16
/// weights (and its activations), not 262.8 GiB of f32 ones.
#[test]
fn the_fit_check_counts_the_compute_dtype() {
    let e = fails_with(
        &[
            "compile",
            L70,
            "--mesh",
            "tp=1",
            "-o",
            "/nonexistent/p.json",
        ],
        &["plan does not fit", "params 131.4"],
    );
    assert!(!e.contains("262."), "{e}");
}

#[test]
fn the_cpu_reference_says_it_runs_f32() {
    let dir = tempfile::tempdir().unwrap();
    let ids = common::tokens_2x4(dir.path());
    let out = dir.path().join("out.json");
    let (ok, stdout, err) = run_shardc(
        &[
            "run",
            "tests/fixtures/hf-tiny/llama",
            "--tokens",
            &ids,
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(ok, "{err}");
    assert!(stdout.contains("(CPU reference, f32)"), "{stdout}");
}
