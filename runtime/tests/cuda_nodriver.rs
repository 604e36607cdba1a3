//! CPU-side checks of the CUDA backend, run everywhere (no GPU needed): without a driver every
//! entry point is a clean error (never a panic), and the host-side planning — arena reuse,
//! fused groups, the GEMM plan-cache keys — on real model programs.

use shardc_compiler::compile::{compile, CompileSpec, Job};
use shardc_compiler::compile::{compile_forward, CompileOptions};
use shardc_compiler::ir::Op;
use shardc_compiler::model::{build_forward, BuildOptions, ModelConfig};
use shardc_compiler::shard::Mesh;
use shardc_compiler::train::{Precision, TrainOptions};
use shardc_runtime::cuda::comm::nccl::NcclId;
use shardc_runtime::cuda::{
    cuda_device_count, flash_candidates, plan_arena, plan_memory, Action, CudaDevice, CudaError,
    Epilogue, FusedGroup, GemmKey, GpuDType,
};
use std::collections::HashSet;
use std::path::Path;

fn config(model: &str) -> ModelConfig {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-tiny");
    let root = if built.is_dir() {
        built
    } else {
        Path::new("tests/fixtures/hf-tiny").to_path_buf()
    };
    ModelConfig::from_path(&root.join(model)).expect("fixture config")
}

/// On a machine without libcuda (CI) opening a device is `NoDriver` with the CLI's wording;
/// on a GPU machine it opens, and an out-of-range ordinal is a clean error.
#[test]
fn opening_a_device_never_panics() {
    match cuda_device_count() {
        Err(CudaError::NoDriver) => {
            let e = CudaDevice::open(0).expect_err("no driver");
            assert_eq!(
                e.to_string(),
                "no CUDA driver found (libcuda.so not loadable)"
            );
            assert!(e.is_unavailable());
        }
        Err(other) => {
            assert!(other.is_unavailable(), "{other}");
            assert!(CudaDevice::open(0).is_err());
        }
        Ok(n) => {
            assert!(n > 0);
            let dev = CudaDevice::open(0).expect("device 0");
            assert!(dev.arch().starts_with("sm_"), "{dev:?}");
            assert!(matches!(
                CudaDevice::open(n),
                Err(CudaError::BadOrdinal { ordinal, count }) if ordinal == n && count == n
            ));
        }
    }
}

/// Without libnccl.so creating an NCCL id is a clean error naming the library.
#[test]
fn nccl_without_the_library_is_a_clean_error() {
    match NcclId::new() {
        Ok(id) => assert_ne!(id.0, [0u8; 128], "an id has entropy"),
        Err(e) => {
            assert!(
                e.is_unavailable() || matches!(e, CudaError::NoDevice { .. }),
                "{e}"
            );
            if let CudaError::MissingLibrary { library, .. } = &e {
                assert_eq!(*library, "libnccl");
                assert!(e.to_string().contains("libnccl.so"), "{e}");
            }
        }
    }
}

/// The GEMMs of a tp=2 Llama program share plan-cache keys across layers: one key per
/// distinct (shape, dtype, epilogue), far fewer than GEMMs.
#[test]
fn gemm_plan_keys_are_shared_across_layers() {
    let cfg = config("llama");
    let opts = CompileOptions {
        batch: 2,
        seq: 16,
        mesh: Mesh::parse("tp=2", 8).expect("mesh"),
        extra_strategies: vec![],
    };
    let g = compile_forward(&cfg, &opts).expect("compile").sharded.graph;
    let mut keys = HashSet::new();
    let mut gemms = 0;
    for v in g.ids() {
        let node = g.node(v);
        if let Op::MatMul { transpose_b } = node.op {
            let a = g.ty(node.inputs[0]).shape();
            let b = g.ty(node.inputs[1]).shape();
            keys.insert(
                GemmKey::for_matmul(&a, &b, transpose_b, GpuDType::Bf16, Epilogue::None)
                    .expect("key"),
            );
            gemms += 1;
        }
    }
    // q, k, v, o, gate, up, down per layer plus lm_head: keys do not grow with layers.
    assert_eq!(gemms, 7 * cfg.layers + 1, "GEMMs in the program");
    assert!(
        keys.len() <= 8,
        "{} distinct plans for {gemms} GEMMs",
        keys.len()
    );
}

/// Arena planning on every fixture model: first-fit reuse keeps the peak far below the sum of
/// activations, fusion costs little extra, and no two simultaneously live values share bytes.
#[test]
fn arena_reuse_and_fusion_on_every_fixture_model() {
    for model in ["gpt2", "llama", "mixtral"] {
        let cfg = config(model);
        let g = build_forward(&cfg, BuildOptions::new(2, 16)).expect("graph");
        for dt in [GpuDType::F32, GpuDType::Bf16] {
            let plain = plan_arena(&g, dt);
            let (fused, plan) = plan_memory(&g, dt, true);
            let sum: u64 = plain.slots.iter().flatten().map(|s| s.size).sum();
            assert!(
                plain.total * 3 < sum,
                "{model} {dt}: peak {} vs sum {sum}",
                plain.total
            );
            assert!(
                fused.total <= plain.total * 3 / 2,
                "{model} {dt}: {} vs {}",
                fused.total,
                plain.total
            );
            assert!(!plan.groups.is_empty(), "{model}: no fused group");
            // Reshapes of computed values are views of their root's slot and not run.
            let mut aliased = 0;
            for v in g.ids() {
                let Some(r) = fused.aliases[v.index()] else {
                    assert!(
                        !matches!(g.node(v).op, Op::Reshape)
                            || matches!(
                                g.node(g.node(v).inputs[0]).op,
                                Op::Input { .. } | Op::Param(_)
                            ),
                        "{model}: reshape {v} of a computed value is not an alias"
                    );
                    continue;
                };
                assert!(
                    matches!(g.node(v).op, Op::Reshape),
                    "{model}: {v} is no reshape"
                );
                assert!(
                    !matches!(g.node(r).op, Op::Reshape),
                    "{model}: root {r} is a reshape"
                );
                assert_eq!(
                    fused.slots[v.index()],
                    fused.slots[r.index()],
                    "{model}: {v}"
                );
                assert_eq!(plan.actions[v.index()], Action::Skip, "{model}: {v} runs");
                aliased += 1;
            }
            assert!(aliased > 0, "{model}: no reshape aliased");
            // No two values live at once share bytes (an alias shares its root's, by design).
            assert_eq!(fused.live_overlap(&g), None, "{model} {dt}: values overlap");
            // Every group's tail slot is free of the head's operands (the fused launch reads
            // them while writing the tail).
            for grp in &plan.groups {
                let tail = fused.slots[grp.tail().index()].expect("tail slot");
                for &op in &g.node(grp.head()).inputs {
                    if let Some(s) = fused.slots[op.index()] {
                        assert!(
                            !s.overlaps(&tail),
                            "{model}: {grp:?} tail overlaps operand {op}"
                        );
                    }
                }
                if let FusedGroup::Gemm { bias: Some(b), .. } = grp {
                    assert!(
                        matches!(g.node(*b).op, Op::Param(_)),
                        "{model}: bias must be a parameter"
                    );
                }
            }
        }
    }
}

/// A training program's attention backward is planned as flash groups: every `AttentionProbs`
/// skipped and given no bytes, its three gradients issued at the first of them with slots that
/// overlap neither each other nor anything the launches read; the arena keeps its invariant and
/// shrinks by the probabilities. Without fusion the materialised path keeps them.
#[test]
fn training_programs_plan_the_attention_backward_without_probabilities() {
    for (model, mesh) in [
        ("llama", ""),
        ("gpt2", ""),
        ("mixtral", ""),
        ("llama", "tp=2"),
    ] {
        let cfg = config(model);
        let mesh_v = if mesh.is_empty() {
            Mesh::single()
        } else {
            Mesh::parse(mesh, 8).expect("mesh")
        };
        let mut spec = CompileSpec::new(
            cfg.clone(),
            model,
            Job::Train(Box::new(TrainOptions::new(2, 64, mesh_v))),
        );
        spec.precision = Precision::f32();
        let g = compile(&spec).expect("training plan").program;
        let what = format!("{model} `{mesh}`");
        assert_eq!(flash_candidates(&g).len(), cfg.layers, "{what}");
        for dt in [GpuDType::F32, GpuDType::Bf16] {
            let (fused, plan) = plan_memory(&g, dt, true);
            let (plain, unfused) = plan_memory(&g, dt, false);
            assert!(
                !unfused
                    .groups
                    .iter()
                    .any(|grp| matches!(grp, FusedGroup::AttentionBwd(_))),
                "{what}: no flash group without fusion"
            );
            assert!(
                fused.total < plain.total,
                "{what} {dt}: {} vs {}",
                fused.total,
                plain.total
            );
            let mut groups = 0;
            for (i, grp) in plan.groups.iter().enumerate() {
                let FusedGroup::AttentionBwd(f) = grp else {
                    continue;
                };
                groups += 1;
                assert_eq!(plan.actions[f.probs.index()], Action::Skip, "{what}");
                assert_eq!(
                    fused.slots[f.probs.index()],
                    None,
                    "{what}: probs have bytes"
                );
                assert_eq!(plan.actions[f.head().index()], Action::Fused(i), "{what}");
                let slots: Vec<_> = f
                    .grads()
                    .iter()
                    .map(|v| fused.slots[v.index()].expect("gradient slot"))
                    .collect();
                for (a, sa) in slots.iter().enumerate() {
                    for sb in &slots[a + 1..] {
                        assert!(!sa.overlaps(sb), "{what}: gradients share bytes");
                    }
                    let mut read = g.node(f.head()).inputs.clone();
                    read.extend(g.node(f.probs).inputs.get(2));
                    for op in read {
                        if let Some(s) = fused.slots[op.index()] {
                            assert!(!s.overlaps(sa), "{what}: a gradient overlaps operand {op}");
                        }
                    }
                }
                for v in f.grads() {
                    if v != f.head() {
                        assert_eq!(plan.actions[v.index()], Action::Skip, "{what}");
                    }
                }
            }
            assert_eq!(groups, cfg.layers, "{what} {dt}");
            assert_eq!(fused.live_overlap(&g), None, "{what} {dt}: values overlap");
        }
    }
}

/// The activation arena of a Llama-3-8B training step on one GPU (bf16, batch 1, all 32
/// layers, 2048 and 4096 tokens): the attention backward as flash groups against the materialised
/// probabilities. Prints the figures BENCHMARKS.md quotes; asserts the probabilities' bytes
/// are what the flash groups save at least.
#[test]
#[ignore = "seconds: run with --ignored --nocapture for the benchmark figure"]
fn llama3_8b_training_arena_with_and_without_the_flash_backward() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/llama-3-8b.json");
    let cfg = ModelConfig::from_path(&path).expect("llama-3-8b config");
    for t in [2048, 4096] {
        let mut spec = CompileSpec::new(
            cfg.clone(),
            "llama-3-8b",
            Job::Train(Box::new(TrainOptions::new(1, t, Mesh::single()))),
        );
        spec.precision = Precision::f32();
        let g = compile(&spec).expect("training plan").program;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let (flash, _) = plan_memory(&g, GpuDType::Bf16, true);
        let (plain, _) = plan_memory(&g, GpuDType::Bf16, false);
        let probs: u64 = g
            .ids()
            .filter(|&v| matches!(g.node(v).op, Op::AttentionProbs(_)))
            .map(|v| g.ty(v).numel() as u64 * 2)
            .sum();
        println!(
            "llama-3-8b, {} layers, 1x{t}, bf16: arena {:.2} GiB with the flash backward, \
             {:.2} GiB with the probabilities materialised ({:.2} GiB of probabilities)",
            cfg.layers,
            gib(flash.total),
            gib(plain.total),
            gib(probs)
        );
        assert!(
            plain.total - flash.total >= probs / 2,
            "{} vs {}",
            flash.total,
            plain.total
        );
    }
}
