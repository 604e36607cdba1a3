//! Two NCCL ranks on one GPU, in one process (NCCL ≥ 2.30 with
//! `NCCL_MULTI_RANK_GPU_ENABLE=1`, NOTES-cuda.md §5.2): the world communicator split per mesh
//! axis, every collective against its definition, then tp=2 and tp=2+sp plans of the hf-tiny
//! models against transformers' logits and the CPU thread ranks.
//!
//! Needs a GPU and `libnccl.so` (2.30.x) on the library path:
//! `NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=4 cargo test -p shardc-runtime --test cuda_nccl -- --include-ignored --test-threads=1`
//! (the tests also set both variables themselves before NCCL initialises).

mod comm_common;
mod cuda_common;

use comm_common::on_threads;
use cuda_common::*;
use cudarc::driver::{CudaSlice, DevicePtr};
use shardc_compiler::compile::compile_forward;
use shardc_compiler::shard::Mesh;
use shardc_runtime::comm::ReduceOp;
use shardc_runtime::cuda::comm::device::{
    DeviceBuffer, DeviceCollective as Dc, DeviceCommunicator, DeviceDType,
};
use shardc_runtime::cuda::comm::nccl::{nccl_version, NcclComm, NcclId};
use shardc_runtime::cuda::{run_spmd_nccl_threads, GpuDType, ParamInit};
use shardc_runtime::spmd::run_spmd;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(60);

/// The first NCCL release that runs several ranks on one GPU (`NCCL_MULTI_RANK_GPU_ENABLE`).
const MULTI_RANK_GPU: i32 = 23000;

/// Sets NCCL's multi-rank variables; `false`, with one `SKIPPED` line naming the version, when
/// the installed NCCL is older than 2.30 (PyTorch's wheels ship 2.28, whose init fails with two
/// ranks on one device: a known limit of the machine, not a defect to report as one).
fn multi_rank_env(test: &str) -> bool {
    let v = nccl_version().expect("libnccl.so");
    if v < MULTI_RANK_GPU {
        eprintln!(
            "SKIPPED {test}: NCCL {}.{}.{} runs one rank per GPU; two ranks on one GPU need \
             NCCL >= 2.30 (NOTES-cuda.md §5.2)",
            v / 10000,
            v / 100 % 100,
            v % 100
        );
        return false;
    }
    // Read by NCCL at communicator creation; set before any test creates one.
    std::env::set_var("NCCL_MULTI_RANK_GPU_ENABLE", "1");
    if std::env::var_os("NCCL_MAX_CTAS").is_none() {
        std::env::set_var("NCCL_MAX_CTAS", "4");
    }
    true
}

#[test]
#[ignore = "needs a GPU and libnccl.so ≥ 2.30"]
fn two_ranks_split_per_axis_and_run_every_collective() {
    if !multi_rank_env("two_ranks_split_per_axis_and_run_every_collective") {
        return;
    }
    let dev = device();
    let mesh = Mesh::parse("dp=1,tp=2", 8).expect("mesh");
    let id = NcclId::new().expect("nccl id");
    let n = 1024 + 3;
    let results: Vec<Vec<(String, Vec<f32>)>> = on_threads(0..2, |rank| {
        let world = NcclComm::init(&dev, rank, 2, id, "world", TIMEOUT).expect("init");
        let axes = world.for_mesh(&mesh).expect("split");
        let (name, tp) = &axes[1];
        assert_eq!((name.as_str(), tp.rank(), tp.size()), ("tp", rank, 2));
        assert_eq!((axes[0].1.rank(), axes[0].1.size()), (0, 1));
        let stream = dev.new_stream().expect("stream");
        let x: Vec<f32> = (0..2 * n).map(|i| (i + 1000 * rank) as f32).collect();
        let xs: CudaSlice<f32> = stream.clone_htod(&x).expect("upload");
        let xb = DeviceBuffer::new(xs.device_ptr(&stream).0, 2 * n, DeviceDType::F32);
        let mut out = Vec::new();
        for (what, len) in [
            ("all_reduce", 2 * n),
            ("reduce_scatter", n),
            ("all_gather", 4 * n),
            ("all_to_all", 2 * n),
            ("broadcast", 2 * n),
            ("send_recv", 2 * n),
        ] {
            let ys: CudaSlice<f32> = stream.alloc_zeros(len).expect("alloc");
            let yb = DeviceBuffer::new(ys.device_ptr(&stream).0, len, DeviceDType::F32);
            let (send, recv, op, peer) = (xb, yb, ReduceOp::Sum, 1 - rank);
            let c = match what {
                "all_reduce" => Dc::AllReduce { send, recv, op },
                "reduce_scatter" => Dc::ReduceScatter { send, recv, op },
                "all_gather" => Dc::AllGather { send, recv },
                "all_to_all" => Dc::AllToAll { send, recv },
                "broadcast" => Dc::Broadcast {
                    send,
                    recv,
                    root: 1,
                },
                _ => Dc::SendRecv {
                    send,
                    to: peer,
                    recv,
                    from: peer,
                },
            };
            // SAFETY: both slices live until after the poll loop.
            unsafe { tp.enqueue(c, &stream) }.expect(what);
            while !tp.poll().expect("poll") {
                std::thread::yield_now();
            }
            out.push((what.to_string(), stream.clone_dtoh(&ys).expect("download")));
        }
        out
    });
    let x = |r: usize| -> Vec<f32> { (0..2 * n).map(|i| (i + 1000 * r) as f32).collect() };
    for (rank, res) in results.iter().enumerate() {
        let get = |w: &str| &res.iter().find(|(n, _)| n == w).expect("result").1;
        let sum: Vec<f32> = x(0).iter().zip(x(1)).map(|(a, b)| a + b).collect();
        assert_eq!(get("all_reduce"), &sum, "rank {rank}");
        assert_eq!(
            get("reduce_scatter"),
            &sum[rank * n..(rank + 1) * n].to_vec(),
            "rank {rank}"
        );
        assert_eq!(get("all_gather"), &[x(0), x(1)].concat(), "rank {rank}");
        let a2a = [
            x(0)[rank * n..(rank + 1) * n].to_vec(),
            x(1)[rank * n..(rank + 1) * n].to_vec(),
        ]
        .concat();
        assert_eq!(get("all_to_all"), &a2a, "rank {rank}");
        assert_eq!(get("broadcast"), &x(1), "rank {rank}");
        assert_eq!(get("send_recv"), &x(1 - rank), "rank {rank}");
    }
}

/// tp=2 and tp=2+sp plans of every hf-tiny model on two NCCL ranks of one GPU, against
/// transformers' logits (f32) and against the CPU thread ranks.
#[test]
#[ignore = "needs a GPU and libnccl.so ≥ 2.30"]
fn two_nccl_ranks_run_tp_and_sp_plans() {
    if !multi_rank_env("two_nccl_ranks_run_tp_and_sp_plans") {
        return;
    }
    let dev = device();
    let mut ran = 0;
    for case in cases().into_iter().filter(|c| c.batch == 2 && c.seq == 16) {
        let (cfg, w) = case.load();
        for extra in ["", "sp"] {
            let opts = case.options("tp=2", extra);
            let Ok(c) = compile_forward(&cfg, &opts) else {
                continue;
            };
            let cpu = run_spmd(&c.sharded.graph, &opts.mesh, &w, &case.inputs, TIMEOUT)
                .expect("cpu ranks");
            for dt in [GpuDType::F32, GpuDType::Bf16] {
                let outs = run_spmd_nccl_threads(
                    &dev,
                    &c.sharded.graph,
                    &opts.mesh,
                    &ParamInit::Weights(&w),
                    &case.inputs,
                    &opts_for(dt),
                )
                .unwrap_or_else(|e| panic!("{} tp=2 {extra} {dt}: {e}", case.model));
                for (rank, out) in outs.iter().enumerate() {
                    let logits = out["logits"].as_f32().expect("f32");
                    let cpu_logits = cpu[rank]["logits"].as_f32().expect("f32");
                    let what =
                        format!("{} {} tp=2 {extra} {dt} rank {rank}", case.model, case.name);
                    match dt {
                        GpuDType::F32 => {
                            let d = case.max_diff(logits, &case.logits);
                            assert!(d < 1e-3, "{what}: max |Δlogit| vs transformers {d}");
                            let d = case.max_diff(logits, cpu_logits);
                            assert!(d < 1e-3, "{what}: max |Δlogit| vs CPU ranks {d}");
                        }
                        GpuDType::Bf16 => {
                            let l2 = rel_l2(&case.unmasked(logits), &case.unmasked(cpu_logits));
                            assert!(l2 < 2e-2, "{what}: relative L2 {l2}");
                        }
                    }
                }
                ran += 1;
            }
        }
    }
    assert!(ran >= 8, "only {ran} NCCL runs");
}

fn opts_for(dt: GpuDType) -> shardc_runtime::cuda::CudaOptions {
    shardc_runtime::cuda::CudaOptions {
        timeout: TIMEOUT,
        ..cuda_common::opts(dt, true)
    }
}
