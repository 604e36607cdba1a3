//! `shardc search`: every layout of a training step on a cluster simulated by the one cost
//! model; the fastest that fit, what bounds the best, and how the usual hand-picked layouts
//! compare.

use super::args::{at_least, check_seq};
use super::fmt::{bytes, thousands};
use anyhow::{bail, Context};
use clap::Args;
use shardc::compiler::cost::{AttentionImpl, Cluster, ComputeOptions};
use shardc::compiler::ir::DType;
use shardc::compiler::model::ModelConfig;
use shardc::compiler::search::{
    evaluate, search, Candidate, Scored, SearchOptions, SearchProgress, SpaceLimits,
};
use shardc::runtime::output::Outputs;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct SearchArgs {
    /// A `config.json` or model directory (default: the bundled Llama-3-8B config).
    pub model: Option<PathBuf>,
    /// Cluster profile and node count, e.g. `dgx-h100x16` (all its GPUs are used unless
    /// --gpus says fewer).
    #[arg(long, default_value = "dgx-h100")]
    pub cluster: String,
    /// GPUs to use (default: the cluster's); `A..B` sweeps A, 2A, 4A, … up to B and prints
    /// the best layout at each size and the scaling curve.
    #[arg(long)]
    pub gpus: Option<String>,
    /// Sequences per optimizer step.
    #[arg(long, visible_alias = "global-batch", default_value_t = 64)]
    pub batch: usize,
    /// Tokens per sequence (default: min(max positions, 4096)).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Micro-batch sizes to try, comma-separated.
    #[arg(long, default_value = "1,2,4,8")]
    pub micro_batches: String,
    /// Fraction of device memory a layout may use.
    #[arg(long, default_value_t = 0.95)]
    pub memory_fraction: f64,
    /// How many of the best to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Compile the best layout's training step into this plan file (`train --plan` runs it).
    #[arg(short = 'o', long = "output")]
    pub output: Option<PathBuf>,
    /// Replace an existing `-o` file.
    #[arg(long)]
    pub overwrite: bool,
    /// What to search: `presets` (every layout of a training step the presets give, simulated),
    /// `megatron-2021` (those Megatron-LM's 2021 recipe allows: no sp, ZeRO or cp, full
    /// recomputation, 1F1B) or `layers` (research mode: each matmul's layout of the forward
    /// pass chosen by the e-graph on one `--mesh`, compared with the presets on that mesh).
    #[arg(long, default_value = "presets")]
    pub space: String,
    /// Recomputation modes to try (`none`, `selective`, `full`, and `block`: the first k
    /// layers of each chunk fully recomputed, the fewest that fit, for layouts that fit with
    /// `full` but not with `none`), comma-separated.
    #[arg(long, default_value = "none,selective,full,block")]
    pub recompute: String,
    /// ZeRO stages to try (0–3), comma-separated.
    #[arg(long, default_value = "0,1,2,3")]
    pub zero: String,
    /// Pipeline schedules to try (`1f1b`, `interleaved`, `zb-h1`), comma-separated.
    #[arg(long, default_value = "1f1b,interleaved,zb-h1")]
    pub schedules: String,
    /// Sequence parallelism: `on`, `off`, or `on,off` (both tried).
    #[arg(long, default_value = "on,off")]
    pub sp: String,
    /// Context parallelism: `on` (cp > 1), `off` (cp = 1), or `on,off`.
    #[arg(long, default_value = "on,off")]
    pub cp: String,
    /// `--space layers`: the mesh whose `tp` axis the layouts are chosen over (default: one
    /// node's GPUs, `tp=8` on a DGX).
    #[arg(long)]
    pub mesh: Option<String>,
}

/// The space's limits from `--recompute`, `--zero`, `--schedules`, `--sp`, `--cp` (each
/// name checked), or Megatron-LM's 2021 recipe for `--space megatron-2021`.
fn limits(a: &SearchArgs) -> anyhow::Result<SpaceLimits> {
    use shardc::compiler::autodiff::Recompute;
    fn list<T>(
        flag: &str,
        text: &str,
        valid: &str,
        parse: impl Fn(&str) -> Option<T>,
    ) -> anyhow::Result<Vec<T>> {
        let v = text
            .split(',')
            .map(|t| parse(t.trim()).with_context(|| format!("{flag} `{t}`: expected {valid}")))
            .collect::<anyhow::Result<Vec<T>>>()?;
        if v.is_empty() {
            bail!("{flag}: give at least one of {valid}");
        }
        Ok(v)
    }
    let on_off = |t: &str| match t {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    };
    // `block` as `None`: derived from the layouts under `none` and `full`.
    let recompute = list(
        "--recompute",
        &a.recompute,
        "none, selective, full, block",
        |t| match t {
            "block" => Some(None),
            _ => Recompute::from_name(t).map(Some),
        },
    )?;
    let needs = [Some(Recompute::None), Some(Recompute::Full)];
    if recompute.contains(&None) && !needs.iter().all(|n| recompute.contains(n)) {
        bail!("--recompute block derives its layouts from those under none and full: list them too (e.g. none,full,block)");
    }
    let l = SpaceLimits {
        sp: list("--sp", &a.sp, "on, off", on_off)?,
        cp: list("--cp", &a.cp, "on, off", on_off)?,
        zero: list("--zero", &a.zero, "0, 1, 2, 3", |t| {
            t.parse::<u8>().ok().filter(|&z| z <= 3)
        })?,
        recompute: recompute.iter().flatten().copied().collect(),
        recompute_blocks: recompute.contains(&None),
        schedules: list(
            "--schedules",
            &a.schedules,
            "1f1b, interleaved, zb-h1",
            |t| {
                ["1f1b", "interleaved", "zb-h1"]
                    .contains(&t)
                    .then(|| t.to_string())
            },
        )?,
    };
    if a.space == "megatron-2021" {
        if !l.is_full() {
            bail!("--space megatron-2021 sets the options itself; leave --recompute, --zero, --schedules, --sp and --cp out");
        }
        return Ok(SpaceLimits::megatron_2021());
    }
    Ok(l)
}

/// `--space layers`: each matmul's layout of the forward pass chosen by the e-graph.
fn run_layers(a: &SearchArgs, cfg: &ModelConfig, path: &Path, seq: usize) -> anyhow::Result<()> {
    use shardc::compiler::compile::{compile, CompileSpec, Job};
    use shardc::compiler::rewrite::CostModel;
    use shardc::compiler::search::{search_layers, LayerSearchOptions};
    use shardc::compiler::shard::Mesh;
    if a.gpus.is_some() {
        bail!("--gpus sizes the preset search; --space layers searches one --mesh");
    }
    if !limits(a)?.is_full() {
        bail!("--recompute, --zero, --schedules, --sp and --cp limit the preset search; --space layers chooses each matmul's layout");
    }
    let cluster = Cluster::resolve(&a.cluster)?;
    let per_node = cluster.gpus_per_node();
    let text = a.mesh.clone().unwrap_or_else(|| format!("tp={per_node}"));
    let mesh = Mesh::parse(&text, per_node).with_context(|| format!("--mesh `{text}`"))?;
    let outputs = Outputs::new(a.overwrite).inputs([Some(path)]);
    if let Some(out) = &a.output {
        outputs.check_file("-o", out)?;
    }
    let o = LayerSearchOptions {
        batch: a.batch,
        seq,
        mesh,
        cost: CostModel {
            device: cluster.rewrite_device(),
            ..CostModel::default()
        },
        capacity: (a.memory_fraction * cluster.device.memory().0 as f64) as u64,
    };
    let r = search_layers(cfg, &o)?;
    if let Some(out) = &a.output {
        let (opts, rewrite) = r.compile.clone();
        let mut spec =
            CompileSpec::new(cfg.clone(), path.display().to_string(), Job::Forward(opts));
        spec.rewrite = rewrite;
        let plan = compile(&spec)?;
        outputs.write("-o", out, plan.to_json().as_bytes())?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{r}");
        if let Some(out) = &a.output {
            println!(
                "\nwrote {} (run it: shardc run MODEL --plan {} --tokens ...)",
                out.display(),
                out.display()
            );
        }
    }
    Ok(())
}

/// Runs `f` (a search with options `o`); when it takes more than a second and stderr is a
/// terminal, a progress line there (candidates bounded of those in the space, simulated,
/// seconds), cleared at the end.
fn with_progress<T>(o: &mut SearchOptions, f: impl FnOnce(&SearchOptions) -> T) -> T {
    use std::io::{IsTerminal, Write};
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    use std::sync::Arc;
    if !std::io::stderr().is_terminal() {
        return f(o);
    }
    let p = Arc::new(SearchProgress::default());
    o.progress = Some(p.clone());
    let done = Arc::new(AtomicBool::new(false));
    let t0 = std::time::Instant::now();
    let shown = {
        let (p, done) = (p.clone(), done.clone());
        std::thread::spawn(move || {
            let mut shown = false;
            while !done.load(Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(200));
                if done.load(Relaxed) || t0.elapsed().as_secs_f64() < 1.0 {
                    continue;
                }
                eprint!(
                    "\rsearching: {} of {} candidates bounded, {} simulated, {:.1} s",
                    p.bounded.load(Relaxed),
                    p.candidates.load(Relaxed),
                    p.simulated.load(Relaxed),
                    t0.elapsed().as_secs_f64()
                );
                let _ = std::io::stderr().flush();
                shown = true;
            }
            shown
        })
    };
    let r = f(o);
    done.store(true, Relaxed);
    if shown.join().unwrap_or(false) {
        eprint!("\r\x1b[2K");
    }
    o.progress = None;
    r
}

/// The GPU counts `--gpus` names: one count, or `A..B` for A, 2A, 4A, … up to B (default:
/// the cluster's GPUs).
fn gpu_counts(flag: Option<&str>, cluster: usize) -> anyhow::Result<Vec<usize>> {
    let parse = |t: &str| -> anyhow::Result<usize> {
        let n: usize = t.trim().parse().map_err(|_| {
            anyhow::anyhow!("--gpus `{t}`: expected a GPU count or a range A..B (e.g. 64..1024)")
        })?;
        at_least("--gpus", n, 1)?;
        Ok(n)
    };
    let Some(text) = flag else {
        return Ok(vec![cluster]);
    };
    let Some((lo, hi)) = text.split_once("..") else {
        return Ok(vec![parse(text)?]);
    };
    let (lo, hi) = (parse(lo)?, parse(hi)?);
    if hi < lo {
        bail!("--gpus {text}: the range ends below its start");
    }
    let mut out = Vec::new();
    let mut n = lo;
    while n <= hi {
        out.push(n);
        n *= 2;
    }
    Ok(out)
}

/// `--gpus A..B`: the best layout at each size, and how throughput scales from the first.
fn sweep(
    cfg: &ModelConfig,
    source: &str,
    cluster: &Cluster,
    base: &SearchOptions,
    copts: &ComputeOptions,
    sizes: &[usize],
    json: bool,
) -> anyhow::Result<()> {
    let mut rows: Vec<(usize, Option<Scored>, f64, usize)> = Vec::new();
    for &gpus in sizes {
        let mut o = base.clone();
        o.gpus = gpus;
        o.top = 1;
        let r = with_progress(&mut o, |o| search(cfg, source, cluster, o, copts))?;
        rows.push((gpus, r.best().cloned(), r.search_time_s, r.candidates));
    }
    // Throughput (tokens/s) relative to the first size that fits.
    let first = rows
        .iter()
        .find_map(|(g, s, ..)| s.as_ref().map(|s| (*g, s.tokens_per_s_per_gpu * *g as f64)));
    let scale = |g: usize, s: &Scored| -> Option<(f64, f64)> {
        let (g0, t0) = first?;
        let speedup = s.tokens_per_s_per_gpu * g as f64 / t0;
        Some((speedup, speedup / (g as f64 / g0 as f64)))
    };
    if json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|(g, s, t, n)| {
                let (speedup, efficiency) = s.as_ref().and_then(|s| scale(*g, s)).unzip();
                serde_json::json!({
                    "gpus": g, "best": s, "candidates": n, "search_time_s": t,
                    "speedup": speedup, "efficiency": efficiency,
                })
            })
            .collect();
        let out = serde_json::json!({
            "model": source, "cluster": cluster.label(), "global_batch": base.global_batch,
            "seq": base.seq, "sweep": v,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{source} on {} ({}): the best layout at each size, global batch {} × seq {}",
        cluster.label(),
        cluster.profile.name,
        base.global_batch,
        base.seq
    );
    println!(
        "{:>7}  {:>9}  {:>9}  {:>6}  {:>10}  {:>8}  {:>10}  {:>7}  best layout",
        "GPUs", "step", "tok/s/GPU", "MFU", "mem/GPU", "speed-up", "efficiency", "search"
    );
    for (g, s, t, _) in &rows {
        match s {
            Some(s) => {
                let (speedup, eff) = scale(*g, s).unwrap_or((1.0, 1.0));
                println!(
                    "{:>7}  {:>7.3} s  {:>9}  {:>5.1}%  {:>10}  {:>7.2}×  {:>9.1}%  {:>5.2} s  {}",
                    thousands(*g as u64),
                    s.step_time_s,
                    thousands(s.tokens_per_s_per_gpu.round() as u64),
                    100.0 * s.mfu,
                    bytes(s.memory_bytes),
                    speedup,
                    100.0 * eff,
                    t,
                    s.candidate
                );
            }
            None => println!("{:>7}  no layout fits ({t:.2} s)", thousands(*g as u64)),
        }
    }
    Ok(())
}

fn row(i: usize, s: &Scored) -> String {
    format!(
        "{:>3}  {:>9.3} s  {:>9}  {:>5.1}%  {:>10}  {:>9.3} s  {:>5.1}%  {}",
        i + 1,
        s.step_time_s,
        thousands(s.tokens_per_s_per_gpu.round() as u64),
        100.0 * s.mfu,
        bytes(s.memory_bytes),
        s.exposed_comm_s,
        100.0 * s.bubble_fraction,
        s.candidate
    )
}

/// The hand-picked layouts users start from: Megatron-style (tensor parallelism over the node
/// with sp, ZeRO-1 data parallelism, selective recomputation; pipeline stages added until the
/// static state fits) and FSDP alone.
fn hand_layouts(cfg: &ModelConfig, gpus: usize, node: usize) -> Vec<(&'static str, Candidate)> {
    let mut tp = node.min(gpus);
    while tp > 1 && (cfg.heads % tp != 0 || gpus % tp != 0) {
        tp /= 2;
    }
    let mut out = Vec::new();
    for pp in [1, 2, 4, 8, 16] {
        if gpus % (tp * pp) != 0 || pp > cfg.layers {
            break;
        }
        let dp = gpus / (tp * pp);
        let mut axes = Vec::new();
        if pp > 1 {
            axes.push(format!("pp={pp}"));
        }
        if dp > 1 {
            axes.push(format!("dp={dp}"));
        }
        if tp > 1 {
            axes.push(format!("tp={tp}"));
        }
        let mut strategies = Vec::new();
        if tp > 1 {
            strategies.push("sp".to_string());
        }
        if dp > 1 {
            strategies.push("zero1".to_string());
        }
        out.push((
            "Megatron-style",
            Candidate {
                mesh: axes.join(","),
                strategies,
                micro_batch: 1,
                recompute: "selective".into(),
                zero: u8::from(dp > 1),
                schedule: "1f1b".into(),
                recompute_layers: None,
            },
        ));
    }
    out.push((
        "FSDP only",
        Candidate {
            mesh: format!("dp={gpus}"),
            strategies: vec!["fsdp".into()],
            micro_batch: 1,
            recompute: "selective".into(),
            zero: 3,
            schedule: "1f1b".into(),
            recompute_layers: None,
        },
    ));
    out
}

pub fn run(a: SearchArgs) -> anyhow::Result<()> {
    let path = a.model.clone().unwrap_or_else(super::default_model);
    let cfg = ModelConfig::from_path(&path)?;
    let seq = a.seq.unwrap_or(cfg.max_positions.min(4096));
    check_seq("--seq", seq, &cfg)?;
    at_least("--batch", a.batch, 1)?;
    at_least("--top", a.top, 1)?;
    if !(a.memory_fraction > 0.0 && a.memory_fraction <= 1.0) {
        bail!("--memory-fraction {}: must be in (0, 1]", a.memory_fraction);
    }
    match a.space.as_str() {
        "presets" | "megatron-2021" => {
            if a.mesh.is_some() {
                bail!("--mesh is the mesh of --space layers; the preset search chooses the mesh");
            }
        }
        "layers" => return run_layers(&a, &cfg, &path, seq),
        other => bail!("--space `{other}`: expected presets, megatron-2021 or layers"),
    }
    let cluster = Cluster::resolve(&a.cluster)?;
    let sizes = gpu_counts(a.gpus.as_deref(), cluster.gpus())?;
    for &gpus in &sizes {
        if gpus > cluster.gpus() {
            bail!(
                "--gpus {gpus}: the cluster {} has {} GPUs (give more nodes: {}x{})",
                cluster.label(),
                cluster.gpus(),
                cluster.profile.name,
                gpus.div_ceil(cluster.gpus_per_node())
            );
        }
    }
    let gpus = sizes[0];
    let micro_batches = a
        .micro_batches
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|&m| m > 0))
        .collect::<Option<Vec<_>>>()
        .with_context(|| {
            format!(
                "--micro-batches `{}`: expected positive integers, comma-separated",
                a.micro_batches
            )
        })?;
    let mut o = SearchOptions::new(gpus, a.batch, seq);
    o.micro_batches = micro_batches;
    o.memory_fraction = a.memory_fraction;
    o.top = a.top;
    o.limits = limits(&a)?;
    let copts = ComputeOptions {
        dtype: DType::Bf16,
        attention: AttentionImpl::Flash,
        dropout: false,
        fuse_elementwise: true,
    };
    let source = path.display().to_string();
    if sizes.len() > 1 {
        if a.output.is_some() {
            bail!("-o compiles one layout: give one --gpus count, not a sweep");
        }
        return sweep(&cfg, &source, &cluster, &o, &copts, &sizes, a.json);
    }
    let outputs = Outputs::new(a.overwrite).inputs([Some(path.as_path())]);
    if let Some(out) = &a.output {
        outputs.check_file("-o", out)?;
    }
    let r = with_progress(&mut o, |o| search(&cfg, &source, &cluster, o, &copts))?;
    if let (Some(out), Some(best)) = (&a.output, r.best()) {
        write_plan(
            &cfg,
            &source,
            &best.candidate,
            a.batch,
            seq,
            &cluster,
            out,
            &outputs,
        )?;
    }
    let hand: Vec<(&str, Candidate, Option<Scored>)> =
        hand_layouts(&cfg, gpus, cluster.gpus_per_node())
            .into_iter()
            .map(|(what, c)| {
                let s = evaluate(&cfg, &source, &cluster, &o, &copts, &c);
                (what, c, s)
            })
            .collect();
    if a.json {
        let hand_json: Vec<serde_json::Value> = hand
            .iter()
            .map(|(what, c, s)| serde_json::json!({"layout": what, "candidate": c, "result": s}))
            .collect();
        let v = serde_json::json!({
            "model": source,
            "cluster": cluster.label(),
            "gpus": gpus,
            "global_batch": a.batch,
            "seq": seq,
            "best": r.best(),
            "top": r.top,
            "candidates": r.candidates,
            "evaluated": r.evaluated,
            "pruned": r.pruned,
            "too_big": r.too_big,
            "refused": r.refused,
            "search_time_s": r.search_time_s,
            "limits": o.limits.describe(),
            "hand_layouts": hand_json,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{source}: {gpus} GPUs of {} ({}), global batch {} × seq {seq}",
        cluster.label(),
        cluster.profile.name,
        a.batch
    );
    let pruned: usize = r.pruned.values().sum();
    let by_rule = if r.pruned.is_empty() {
        String::new()
    } else {
        let rules: Vec<String> = r.pruned.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        format!(" ({})", rules.join(", "))
    };
    println!(
        "searched {} candidates in {:.2} s ({:.0}/s on {} threads): {} simulated, {} pruned{}, \
         {} do not fit, {} refused by the compiler",
        r.candidates,
        r.search_time_s,
        r.evaluated as f64 / r.search_time_s.max(1e-9),
        rayon_threads(),
        r.evaluated,
        pruned,
        by_rule,
        r.too_big,
        r.refused
    );
    if !o.limits.is_full() {
        println!("space limited to: {}", o.limits.describe());
    }
    let Some(best) = r.best() else {
        println!(
            "no layout fits in {:.0}% of device memory",
            100.0 * a.memory_fraction
        );
        return Ok(());
    };
    println!("\n  #       step   tok/s/GPU    MFU   mem/GPU   exposed comm  bubble  layout");
    for (i, s) in r.top.iter().enumerate() {
        println!("{}", row(i, s));
    }
    println!(
        "\nbest: shardc simulate {source} --train --mesh {} --global-batch {} --seq {seq} \
         --cluster {}",
        best.candidate, a.batch, a.cluster
    );
    let step = best.step_time_s;
    println!(
        "  bounded by: compute {:.3} s ({:.0}% of the step), exposed communication {:.3} s, \
         pipeline bubble {:.1}%, memory {} of {}",
        best.compute_s,
        100.0 * best.compute_s / step.max(1e-12),
        best.exposed_comm_s,
        100.0 * best.bubble_fraction,
        bytes(best.memory_bytes),
        bytes((cluster.device.memory_bytes.value * a.memory_fraction) as u64)
    );
    for s in r.top.iter().skip(1).take(3) {
        println!(
            "  vs {}: {:+.1}% step time ({:+.3} s compute, {:+.3} s exposed comm, {:+.1} points bubble)",
            s.candidate,
            100.0 * (s.step_time_s / step - 1.0),
            s.compute_s - best.compute_s,
            s.exposed_comm_s - best.exposed_comm_s,
            100.0 * (s.bubble_fraction - best.bubble_fraction)
        );
    }
    println!("\nhand-picked layouts:");
    let cap = cluster.device.memory_bytes.value * a.memory_fraction;
    for (what, c, s) in &hand {
        match s {
            Some(s) if s.memory_bytes as f64 <= cap => println!(
                "  {what:<15} {c}: {:.3} s, {:+.1}% vs best",
                s.step_time_s,
                100.0 * (s.step_time_s / step - 1.0)
            ),
            Some(s) => println!(
                "  {what:<15} {c}: does not fit ({} per GPU)",
                bytes(s.memory_bytes)
            ),
            None => println!("  {what:<15} {c}: refused by the compiler"),
        }
    }
    Ok(())
}

/// Compiles candidate `c`'s training step (global batch `batch` × `seq`) and writes its plan.
#[allow(clippy::too_many_arguments)]
fn write_plan(
    cfg: &ModelConfig,
    source: &str,
    c: &Candidate,
    batch: usize,
    seq: usize,
    cluster: &Cluster,
    out: &Path,
    outputs: &Outputs,
) -> anyhow::Result<()> {
    use shardc::compiler::autodiff::Recompute;
    use shardc::compiler::compile::{compile, CompileSpec, Job};
    use shardc::compiler::schedule::pp::ScheduleKind;
    use shardc::compiler::shard::Mesh;
    use shardc::compiler::train::{PipelineOptions, TrainOptions};
    let mesh = Mesh::parse(&c.mesh, cluster.gpus_per_node())?;
    let mut t = TrainOptions::new(batch, seq, mesh);
    t.extra_strategies = c.strategies.clone();
    t.micro_batches = batch / (t.mesh.data_ranks() * c.micro_batch);
    t.recompute = Recompute::from_name(&c.recompute).unwrap_or(Recompute::None);
    t.recompute_layers = c.recompute_layers;
    if c.mesh.contains("pp=") {
        let (kind, v) = match c.schedule.as_str() {
            "zb-h1" => (ScheduleKind::ZbH1, 1),
            s if s.starts_with("interleaved") => (ScheduleKind::Interleaved, 2),
            _ => (ScheduleKind::OneFOneB, 1),
        };
        t.pipeline = PipelineOptions {
            schedule: kind,
            virtual_stages: v,
            stage_layers: None,
        };
    }
    let plan = compile(&CompileSpec::new(
        cfg.clone(),
        source,
        Job::Train(Box::new(t)),
    ))?;
    outputs.write("-o", out, plan.to_json().as_bytes())?;
    eprintln!("wrote {} (the best layout's training plan)", out.display());
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
