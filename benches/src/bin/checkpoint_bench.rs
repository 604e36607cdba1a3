//! Checkpoint save and resume throughput on a synthetic Llama of about 1 GB of f32 weights
//! (12 layers, hidden 1024, vocabulary 32,000: 268 M parameters), against a plain copy and
//! a plain read of the same bytes.
//!
//! `cargo run --release -p shardc-benches --bin checkpoint_bench [-- DIR]` (DIR: where to write,
//! default a temporary directory; it needs about 9 GB). Saves hold weights and both AdamW
//! moments: 3 × the model's bytes.

use shardc_compiler::compile::{compile, CompileSpec, Job};
use shardc_compiler::model::ModelConfig;
use shardc_compiler::plan::Plan;
use shardc_compiler::shard::Mesh;
use shardc_compiler::train::{Precision, TrainOptions};
use shardc_runtime::checkpoint::{self, Checkpoint, DataPosition, SaveInfo, SavedModel};
use shardc_runtime::train::{save_safetensors, TrainState};
use shardc_runtime::{Tensor, Weights};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

const CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "hidden_size": 1024,
  "intermediate_size": 4096,
  "num_attention_heads": 16,
  "num_key_value_heads": 16,
  "head_dim": 64,
  "num_hidden_layers": 12,
  "vocab_size": 32000,
  "max_position_embeddings": 2048,
  "rms_norm_eps": 1e-05,
  "hidden_act": "silu",
  "tie_word_embeddings": false,
  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}
}"#;

fn plan(cfg: &ModelConfig, mesh: &str, strategies: &[&str]) -> Plan {
    let mesh = if mesh.is_empty() {
        Mesh::single()
    } else {
        Mesh::parse(mesh, 8).expect("mesh")
    };
    let mut o = TrainOptions::new(mesh.data_ranks(), 8, mesh);
    o.extra_strategies = strategies.iter().map(|s| s.to_string()).collect();
    let mut spec = CompileSpec::new(cfg.clone(), String::new(), Job::Train(Box::new(o)));
    spec.precision = Precision::f32();
    compile(&spec).expect("compile")
}

/// The synthetic model: small finite values, not all equal.
fn write_model(dir: &Path) -> u64 {
    std::fs::create_dir_all(dir).expect("dir");
    std::fs::write(dir.join("config.json"), CONFIG).expect("config");
    let (h, f, v, l) = (1024usize, 4096usize, 32000usize, 12usize);
    let mut t = BTreeMap::new();
    let mut fill = |name: String, shape: Vec<usize>| {
        let n: usize = shape.iter().product();
        let data = (0..n).map(|i| ((i % 251) as f32 - 125.0) * 1e-4).collect();
        t.insert(name, Tensor::f32(shape, data));
    };
    fill("model.embed_tokens.weight".into(), vec![v, h]);
    fill("lm_head.weight".into(), vec![v, h]);
    fill("model.norm.weight".into(), vec![h]);
    for i in 0..l {
        let p = format!("model.layers.{i}");
        for w in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            fill(format!("{p}.self_attn.{w}.weight"), vec![h, h]);
        }
        fill(format!("{p}.mlp.gate_proj.weight"), vec![f, h]);
        fill(format!("{p}.mlp.up_proj.weight"), vec![f, h]);
        fill(format!("{p}.mlp.down_proj.weight"), vec![h, f]);
        fill(format!("{p}.input_layernorm.weight"), vec![h]);
        fill(format!("{p}.post_attention_layernorm.weight"), vec![h]);
    }
    let bytes = t.values().map(|x| x.numel() as u64 * 4).sum();
    save_safetensors(&dir.join("model.safetensors"), &t).expect("save model");
    bytes
}

fn mbs(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e6
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").metadata().expect("meta").len())
        .sum()
}

fn main() {
    let root: PathBuf = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("shardc-checkpoint-bench"));
    let _ = std::fs::remove_dir_all(&root);
    let model = root.join("model");
    let t0 = Instant::now();
    let model_bytes = write_model(&model);
    println!(
        "model: {:.2} GB of f32 weights written in {:.1} s",
        model_bytes as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    let cfg = ModelConfig::from_path(&model).expect("config");
    let weights = Weights::open(&model).expect("weights");
    let info = SaveInfo {
        data: DataPosition {
            next_sample: 0,
            batch: 1,
            seq: 8,
            tokens: String::new(),
        },
        model: SavedModel {
            source: model.display().to_string(),
            arch: "llama".into(),
            config: serde_json::from_str(CONFIG).expect("json"),
        },
        weights: &weights,
        before_publish: None,
    };
    println!("| layout saved | state | save | MB/s | resume (unsharded) | MB/s | resume per rank (tp=4, each rank its blocks) | MB/s |");
    println!("|---|---|---|---|---|---|---|---|");
    let target = plan(&cfg, "tp=4", &["sp"]);
    let unsharded = plan(&cfg, "", &[]);
    let mut state = TrainState::load(&unsharded, &weights).expect("state");
    state.step = 1;
    for (mesh, strategies) in [
        ("", &[][..]),
        ("tp=4", &["sp"][..]),
        ("dp=4", &["zero3"][..]),
    ] {
        let p = plan(&cfg, mesh, strategies);
        let dir = root.join(format!("ck-{}", if mesh.is_empty() { "1" } else { mesh }));
        let t = Instant::now();
        let step = checkpoint::save_global(&dir, &p, &state, &info).expect("save");
        let save = t.elapsed().as_secs_f64();
        let bytes = dir_bytes(&step);
        let t = Instant::now();
        let ck = Checkpoint::open(&dir).expect("open");
        let back = ck.load_state(&unsharded).expect("load");
        let resume = t.elapsed().as_secs_f64();
        assert_eq!(back.params, state.params, "resumed weights");
        drop(back);
        let t = Instant::now();
        let ck = Checkpoint::open(&dir).expect("open");
        let mut read = 0u64;
        for r in 0..target.mesh.world_size() {
            let part = ck.load_locals(&target, r).expect("load rank");
            read += part.values().map(|l| l.len() as u64).sum::<u64>();
        }
        let per_rank = t.elapsed().as_secs_f64();
        assert!(read > 0);
        println!(
            "| {} | {:.2} GB | {save:.2} s | {:.0} | {resume:.2} s | {:.0} | {per_rank:.2} s (4 ranks, one after another) | {:.0} |",
            if mesh.is_empty() { "unsharded".to_string() } else { format!("{mesh} {}", strategies.join(",")) },
            bytes as f64 / 1e9,
            mbs(bytes, save),
            mbs(bytes, resume),
            mbs(bytes, per_rank),
        );
    }
    // Plain copies of the same bytes: the unsharded checkpoint's data file.
    let src = root
        .join("ck-1")
        .join("step-00000001")
        .join("rank-00000.bin");
    let len = std::fs::metadata(&src).expect("src").len();
    let dst = root.join("copy.bin");
    let t = Instant::now();
    std::fs::copy(&src, &dst).expect("copy");
    std::fs::File::open(&dst)
        .expect("open")
        .sync_all()
        .expect("sync");
    let copy = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let all = std::fs::read(&src).expect("read");
    let read = t.elapsed().as_secs_f64();
    assert_eq!(all.len() as u64, len);
    println!(
        "plain copy of the {:.2} GB data file (fs::copy + fsync): {copy:.2} s, {:.0} MB/s; plain read into memory: {read:.2} s, {:.0} MB/s",
        len as f64 / 1e9,
        mbs(len, copy),
        mbs(len, read)
    );
    let _ = std::fs::remove_dir_all(&root);
}
