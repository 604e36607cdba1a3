//! `shardc search` on the configurations of Megatron-LM SC'21 Table 1 (Narayanan et al.): for
//! each row (GPT model, GPUs, global batch, sequence 2,048 on DGX A100s), the search's best
//! layout against the published layout, both under the same cost model and the simulator's
//! 2021 settings (fp16, unfused attention with dropout, as `tests/simulate_models.rs` checks the
//! table with); and the best of the space Megatron-LM's 2021 recipe allows (`--space
//! megatron-2021`: no sp, ZeRO or cp, full recomputation, 1F1B), which the published layout
//! should be close to.
//!
//! `cargo run --release -p shardc-benches --bin search_sc21` prints the BENCHMARKS.md table.

use shardc_compiler::cost::{gpt_config, MEGATRON_SC21_TABLE1};
use shardc_compiler::cost::{AttentionImpl, Cluster, ComputeOptions};
use shardc_compiler::ir::DType;
use shardc_compiler::search::{evaluate, search, Candidate, SearchOptions, SpaceLimits};
use std::time::Instant;

fn main() {
    let copts = ComputeOptions {
        dtype: DType::F16,
        attention: AttentionImpl::Unfused,
        dropout: true,
        fuse_elementwise: true,
    };
    println!(
        "| params (B) | GPUs | batch | published layout | its step | 2021 space's best | its step | published vs it | search's best | best step | published vs best | candidates | search |"
    );
    println!(
        "| ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"
    );
    for r in MEGATRON_SC21_TABLE1 {
        let cfg = gpt_config(r.layers, r.hidden, r.heads, 51200, 2048).expect("config");
        let cluster = Cluster::resolve_for("dgx-a100", r.gpus).expect("cluster");
        let dp = r.gpus / (r.tp * r.pp);
        let mut o = SearchOptions::new(r.gpus, r.batch, 2048);
        o.top = 1;
        // The published layout: Megatron's 2021 recipe (no sp, no ZeRO, full recomputation,
        // micro-batch 1 when pipelining, 4 without; 1F1B).
        let mut mesh = Vec::new();
        for (n, s) in [("pp", r.pp), ("dp", dp), ("tp", r.tp)] {
            if s > 1 {
                mesh.push(format!("{n}={s}"));
            }
        }
        let published = Candidate {
            mesh: mesh.join(","),
            strategies: Vec::new(),
            micro_batch: if r.pp == 1 { 4 } else { 1 },
            recompute: "full".into(),
            zero: 0,
            schedule: "1f1b".into(),
            recompute_layers: None,
        };
        let theirs = evaluate(&cfg, "gpt", &cluster, &o, &copts, &published);
        let t0 = Instant::now();
        let report = search(&cfg, "gpt", &cluster, &o, &copts).expect("search");
        let secs = t0.elapsed().as_secs_f64();
        let best = report.best().expect("a layout fits");
        let (their_step, gap) = match &theirs {
            Some(s) => (
                format!("{:.2} s", s.step_time_s),
                format!("{:+.1}%", (s.step_time_s / best.step_time_s - 1.0) * 100.0),
            ),
            None => ("does not fit".into(), "—".into()),
        };
        // The best of 2021's recipe, searched over the same meshes and micro-batches.
        let mut o21 = o.clone();
        o21.limits = SpaceLimits::megatron_2021();
        let best21 = search(&cfg, "gpt", &cluster, &o21, &copts).expect("2021 search");
        let (b21, b21_step, gap21) = match (best21.best(), &theirs) {
            (Some(b), Some(s)) => (
                b.candidate.to_string(),
                format!("{:.2} s", b.step_time_s),
                format!("{:+.1}%", (s.step_time_s / b.step_time_s - 1.0) * 100.0),
            ),
            (Some(b), None) => (
                b.candidate.to_string(),
                format!("{:.2} s", b.step_time_s),
                "—".into(),
            ),
            (None, _) => ("none fits".into(), "—".into(), "—".into()),
        };
        println!(
            "| {} | {} | {} | {published} | {their_step} | {b21} | {b21_step} | {gap21} | {} | {:.2} s | {gap} | {} | {secs:.2} s |",
            r.params_b, r.gpus, r.batch, best.candidate, best.step_time_s, report.candidates
        );
    }
}
