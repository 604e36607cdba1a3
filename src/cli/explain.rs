//! `shardc explain`: per layer, which collective sits where and why.

use super::fmt::bytes;
use anyhow::Context;
use clap::Args;
use shardc::compiler::plan::Plan;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ExplainArgs {
    /// A plan written by `shardc compile`.
    plan: PathBuf,
    /// Only this layer (`-1`: outside layers).
    #[arg(long, allow_hyphen_values = true)]
    layer: Option<i64>,
    /// Every layer, even when identical to layer 0.
    #[arg(long)]
    all: bool,
}

pub fn run(a: ExplainArgs) -> anyhow::Result<()> {
    let plan = Plan::load(&a.plan).with_context(|| format!("reading {}", a.plan.display()))?;
    if let Some(s) = &plan.pipeline {
        println!(
            "pipeline plan: {} chunks under a {} schedule ({} stages, {} micro-batches); chunk 0's program below (`shardc schedule {}` shows the timeline)",
            plan.chunks.len(),
            s.kind.name(),
            s.stages,
            s.micro_batches,
            a.plan.display()
        );
    }
    super::compile::print_summary(&plan);
    println!();
    let by_layer = plan.collectives_by_layer();
    let describe = |v: u32| -> String {
        match plan.provenance.get(&v) {
            Some(p) => format!(
                "`{}` {} → {}; required by {}",
                p.value, p.from, p.to, p.required_by
            ),
            None => "(no provenance recorded)".into(),
        }
    };
    let sig = |l: Option<u32>| -> Vec<(String, u64)> {
        by_layer
            .get(&l)
            .map(|v| v.iter().map(|(o, _, b, _)| (o.clone(), *b)).collect())
            .unwrap_or_default()
    };
    let mut shown_identical = false;
    for (layer, list) in &by_layer {
        if let Some(want) = a.layer {
            let l = layer.map_or(-1, |l| l as i64);
            if l != want {
                continue;
            }
        } else if !a.all {
            if let Some(l) = layer {
                if *l > 0 && sig(Some(*l)) == sig(Some(0)) {
                    if !shown_identical {
                        println!("(layers 1.. identical to layer 0 are not repeated; --all shows them)\n");
                        shown_identical = true;
                    }
                    continue;
                }
            }
        }
        match layer {
            Some(l) => println!("layer {l}:"),
            None => println!("outside layers:"),
        }
        for (op, axis, b, v) in list {
            let node = plan.program.node(*v);
            println!("  {op} over {axis}, {} — `{}`", bytes(*b), node.name);
            println!("      {}", describe(v.0));
        }
        println!();
    }
    Ok(())
}
