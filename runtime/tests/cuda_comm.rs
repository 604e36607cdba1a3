//! The `local-gpu` device communicator (N virtual ranks on one GPU) and the NCCL communicator
//! with a world of one rank: every collective against its definition, bit for bit (the
//! local-gpu reductions add in rank order, emulated on the host), then sharded plans of the
//! hf-tiny models on virtual ranks against transformers' logits, and small graphs with every
//! collective, `RankOffset`, `LocalSlice` and the collective matmuls against the CPU ranks.
//!
//! Needs a GPU: `cargo test -p shardc-runtime --test cuda_comm -- --include-ignored`
//! (the NCCL test also needs `libnccl.so` on the library path, NOTES-cuda.md §1.3).

mod comm_common;
mod cuda_common;

use comm_common::on_threads;
use cuda_common::*;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use shardc_compiler::compile::compile_forward_with;
use shardc_compiler::ir::{DType, Graph, Op, ShardSpec, TensorType};
use shardc_compiler::rewrite::{RewriteOptions, RuleSelection};
use shardc_compiler::shard::Mesh;
use shardc_runtime::comm::ReduceOp;
use shardc_runtime::cuda::comm::device::{
    DeviceBuffer, DeviceCollective, DeviceCollective as Dc, DeviceCommunicator, DeviceDType,
};
use shardc_runtime::cuda::comm::local_gpu::group;
use shardc_runtime::cuda::comm::nccl::{NcclComm, NcclId};
use shardc_runtime::cuda::{run_spmd_local_gpu, CudaDevice, GpuDType, ParamInit};
use shardc_runtime::spmd::run_spmd;
use shardc_runtime::{Tensor, Weights};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(30);

/// Host data of one rank, as f32 or as bf16 bits.
#[derive(Clone, Debug, PartialEq)]
enum Data {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Data {
    fn random(rng: &mut Rng, n: usize, dt: DeviceDType) -> Data {
        let v: Vec<f32> = (0..n).map(|_| rng.sym(2.0)).collect();
        match dt {
            DeviceDType::Bf16 => Data::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            _ => Data::F32(v),
        }
    }
    fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::Bf16(v) => v.len(),
        }
    }
    fn dtype(&self) -> DeviceDType {
        match self {
            Data::F32(_) => DeviceDType::F32,
            Data::Bf16(_) => DeviceDType::Bf16,
        }
    }
    fn f32s(&self) -> Vec<f32> {
        match self {
            Data::F32(v) => v.clone(),
            Data::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
    fn from_f32(v: Vec<f32>, dt: DeviceDType) -> Data {
        match dt {
            DeviceDType::Bf16 => Data::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            _ => Data::F32(v),
        }
    }
    fn chunk(&self, i: usize, c: usize) -> Data {
        match self {
            Data::F32(v) => Data::F32(v[i * c..(i + 1) * c].to_vec()),
            Data::Bf16(v) => Data::Bf16(v[i * c..(i + 1) * c].to_vec()),
        }
    }
}

/// A device copy of `Data` and its buffer descriptor.
enum Dev {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

impl Dev {
    fn upload(s: &Arc<CudaStream>, d: &Data) -> Dev {
        match d {
            Data::F32(v) => Dev::F32(s.clone_htod(v).expect("upload")),
            Data::Bf16(v) => Dev::Bf16(s.clone_htod(v).expect("upload")),
        }
    }
    fn zeros(s: &Arc<CudaStream>, n: usize, dt: DeviceDType) -> Dev {
        match dt {
            DeviceDType::Bf16 => Dev::Bf16(s.alloc_zeros(n).expect("alloc")),
            _ => Dev::F32(s.alloc_zeros(n).expect("alloc")),
        }
    }
    fn buf(&self, s: &CudaStream) -> DeviceBuffer {
        match self {
            Dev::F32(x) => DeviceBuffer::new(x.device_ptr(s).0, x.len(), DeviceDType::F32),
            Dev::Bf16(x) => DeviceBuffer::new(x.device_ptr(s).0, x.len(), DeviceDType::Bf16),
        }
    }
    fn download(&self, s: &Arc<CudaStream>) -> Data {
        match self {
            Dev::F32(x) => Data::F32(s.clone_dtoh(x).expect("download")),
            Dev::Bf16(x) => Data::Bf16(s.clone_dtoh(x).expect("download")),
        }
    }
}

/// The local-gpu reduction, emulated: `acc = src_0; acc = round(acc + src_j)` in rank order,
/// the last step of an average `round((acc + src_last) · 1/n)`.
fn reduce_like_local_gpu(srcs: &[Data], op: ReduceOp) -> Data {
    let dt = srcs[0].dtype();
    let round = |x: f32| match dt {
        DeviceDType::Bf16 => bf16::from_f32(x).to_f32(),
        _ => x,
    };
    let n = srcs.len();
    let mut acc = srcs[0].f32s();
    for (j, s) in srcs.iter().enumerate().skip(1) {
        for (a, b) in acc.iter_mut().zip(s.f32s()) {
            *a = if op == ReduceOp::Avg && j == n - 1 {
                round((*a + b) * (1.0 / n as f32))
            } else {
                round(*a + b)
            };
        }
    }
    Data::from_f32(acc, dt)
}

/// The collective a rank issues, given its communicator and its send and receive buffers.
type Call = fn(&dyn DeviceCommunicator, DeviceBuffer, DeviceBuffer) -> DeviceCollective;

/// Enqueues `call(comm, send, recv)` on `stream`.
fn enqueue(
    comm: &dyn DeviceCommunicator,
    send: DeviceBuffer,
    recv: DeviceBuffer,
    stream: &CudaStream,
    call: impl Fn(&dyn DeviceCommunicator, DeviceBuffer, DeviceBuffer) -> DeviceCollective,
) {
    let c = call(comm, send, recv);
    // SAFETY: the callers' buffers live until after their poll loops.
    unsafe { comm.enqueue(c, stream) }.unwrap_or_else(|e| panic!("{}: {e}", c.kind()));
}

/// Runs `call(comm, send, recv)` on every rank of a fresh local-gpu group (own stream per
/// rank), waits through `poll`, and returns every rank's `recv`.
fn local_gpu_collective(
    dev: &Arc<CudaDevice>,
    sends: &[Data],
    recv_len: usize,
    call: impl Fn(&dyn DeviceCommunicator, DeviceBuffer, DeviceBuffer) -> DeviceCollective + Sync,
) -> Vec<Data> {
    let call = &call;
    let n = sends.len();
    let comms = group(dev, "tp", n, TIMEOUT);
    on_threads(comms.into_iter().zip(sends), |(c, send)| {
        let stream = dev.new_stream().expect("stream");
        let x = Dev::upload(&stream, send);
        let y = Dev::zeros(&stream, recv_len, send.dtype());
        stream.synchronize().expect("sync");
        enqueue(&c, x.buf(&stream), y.buf(&stream), &stream, call);
        while !c.poll().expect("poll") {
            std::thread::yield_now();
        }
        stream.synchronize().expect("sync");
        y.download(&stream)
    })
}

#[test]
#[ignore = "needs a GPU"]
fn local_gpu_collectives_match_their_definitions() {
    let dev = device();
    let mut rng = Rng::new(11);
    for n in [2, 4] {
        for dt in [DeviceDType::F32, DeviceDType::Bf16] {
            for len in [3 * n, 50 * n, 4096 * n] {
                let sends: Vec<Data> = (0..n).map(|_| Data::random(&mut rng, len, dt)).collect();
                // all_reduce sum / avg
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    let want = reduce_like_local_gpu(&sends, op);
                    let got = local_gpu_collective(&dev, &sends, len, |_, send, recv| {
                        Dc::AllReduce { send, recv, op }
                    });
                    for (r, got) in got.iter().enumerate() {
                        assert_eq!(
                            got, &want,
                            "all_reduce {op:?} n={n} {dt} len={len} rank {r}"
                        );
                    }
                }
                // reduce_scatter
                let c = len / n;
                let got = local_gpu_collective(&dev, &sends, c, |_, send, recv| {
                    let op = ReduceOp::Sum;
                    Dc::ReduceScatter { send, recv, op }
                });
                for (r, g) in got.iter().enumerate() {
                    let chunks: Vec<Data> = sends.iter().map(|d| d.chunk(r, c)).collect();
                    assert_eq!(
                        g,
                        &reduce_like_local_gpu(&chunks, ReduceOp::Sum),
                        "reduce_scatter rank {r}"
                    );
                }
                // all_gather
                let got = local_gpu_collective(&dev, &sends, len * n, |_, send, recv| {
                    Dc::AllGather { send, recv }
                });
                let cat: Vec<f32> = sends.iter().flat_map(|d| d.f32s()).collect();
                for g in &got {
                    assert_eq!(g.f32s(), cat, "all_gather n={n} {dt}");
                }
                // all_to_all
                let got = local_gpu_collective(&dev, &sends, len, |_, send, recv| Dc::AllToAll {
                    send,
                    recv,
                });
                for (r, g) in got.iter().enumerate() {
                    let want: Vec<f32> = sends.iter().flat_map(|d| d.chunk(r, c).f32s()).collect();
                    assert_eq!(g.f32s(), want, "all_to_all rank {r}");
                }
                // broadcast from rank 1
                let got = local_gpu_collective(&dev, &sends, len, |_, send, recv| Dc::Broadcast {
                    send,
                    recv,
                    root: 1,
                });
                for g in &got {
                    assert_eq!(g, &sends[1], "broadcast");
                }
                // ring send_recv: rank r receives rank r-1's data
                let got = local_gpu_collective(&dev, &sends, len, |c, send, recv| {
                    let (r, n) = (c.rank(), c.size());
                    let (to, from) = ((r + 1) % n, (r + n - 1) % n);
                    Dc::SendRecv {
                        send,
                        to,
                        recv,
                        from,
                    }
                });
                for (r, g) in got.iter().enumerate() {
                    assert_eq!(g, &sends[(r + n - 1) % n], "send_recv rank {r}");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn local_gpu_mismatch_and_timeout_fail_cleanly() {
    let dev = device();
    // Rank 1 never arrives: rank 0 times out naming it; nothing hangs.
    let comms = group(&dev, "tp", 2, Duration::from_millis(300));
    let stream = dev.new_stream().expect("stream");
    let x = Dev::upload(&stream, &Data::F32(vec![1.0; 8]));
    let y = Dev::zeros(&stream, 8, DeviceDType::F32);
    let sum = Dc::AllReduce {
        send: x.buf(&stream),
        recv: y.buf(&stream),
        op: ReduceOp::Sum,
    };
    let e = unsafe { comms[0].enqueue(sum, &stream) }.expect_err("peer missing");
    let text = e.to_string();
    assert!(
        text.contains("timed out") && text.contains("rank 1") && text.contains("`tp`"),
        "{text}"
    );
    // The group is aborted for the other rank too.
    let e = unsafe { comms[1].enqueue(sum, &stream) }.expect_err("aborted");
    assert!(e.to_string().contains("aborted"), "{e}");
}

#[test]
#[ignore = "needs a GPU and libnccl.so"]
fn nccl_world_of_one_runs_every_collective() {
    let dev = device();
    let comm = NcclComm::init(
        &dev,
        0,
        1,
        NcclId::new().expect("nccl id"),
        "world",
        TIMEOUT,
    )
    .expect("nccl init");
    let stream = dev.new_stream().expect("stream");
    let mut rng = Rng::new(12);
    for dt in [DeviceDType::F32, DeviceDType::Bf16] {
        let d = Data::random(&mut rng, 783, dt);
        let x = Dev::upload(&stream, &d);
        let calls: [(&str, Call); 6] = [
            ("all_reduce", |_, send, recv| {
                let op = ReduceOp::Sum;
                Dc::AllReduce { send, recv, op }
            }),
            ("reduce_scatter", |_, send, recv| {
                let op = ReduceOp::Sum;
                Dc::ReduceScatter { send, recv, op }
            }),
            ("all_gather", |_, send, recv| Dc::AllGather { send, recv }),
            ("all_to_all", |_, send, recv| Dc::AllToAll { send, recv }),
            ("broadcast", |_, send, recv| Dc::Broadcast {
                send,
                recv,
                root: 0,
            }),
            ("send_recv", |_, send, recv| Dc::SendRecv {
                send,
                to: 0,
                recv,
                from: 0,
            }),
        ];
        for (name, call) in calls {
            let y = Dev::zeros(&stream, d.len(), dt);
            enqueue(&comm, x.buf(&stream), y.buf(&stream), &stream, call);
            while !comm.poll().expect("poll") {
                std::thread::yield_now();
            }
            assert_eq!(y.download(&stream), d, "{name} {dt}");
        }
    }
    // f16 moves too.
    let h: Vec<half::f16> = (0..50)
        .map(|i| half::f16::from_f32(i as f32 * 0.25))
        .collect();
    let x: CudaSlice<half::f16> = stream.clone_htod(&h).expect("upload");
    let y: CudaSlice<half::f16> = stream.alloc_zeros(50).expect("alloc");
    let (xb, yb) = (
        DeviceBuffer::new(x.device_ptr(&stream).0, 50, DeviceDType::F16),
        DeviceBuffer::new(y.device_ptr(&stream).0, 50, DeviceDType::F16),
    );
    enqueue(&comm, xb, yb, &stream, |_, send, recv| {
        let op = ReduceOp::Sum;
        Dc::AllReduce { send, recv, op }
    });
    while !comm.poll().expect("poll") {}
    assert_eq!(stream.clone_dtoh(&y).expect("download"), h);
}

/// Sharded plans of every hf-tiny model on virtual ranks of one GPU (local-gpu), tp=2 and
/// tp=4 (plus sp and the rewriter's fused plans), against transformers' logits.
#[test]
#[ignore = "needs a GPU"]
fn local_gpu_tp_plans_reproduce_the_fixtures() {
    let dev = device();
    let mut ran = 0;
    for case in cases().into_iter().filter(|c| c.batch == 2 && c.seq == 16) {
        let (cfg, w) = case.load();
        for (mesh, extra, rewrite) in [
            ("tp=2", "", false),
            ("tp=4", "", false),
            ("tp=2", "sp", false),
            ("tp=2", "sp", true),
        ] {
            let opts = case.options(mesh, extra);
            let rw = RewriteOptions {
                rules: if rewrite {
                    RuleSelection::All
                } else {
                    RuleSelection::None
                },
                ..RewriteOptions::default()
            };
            let Ok(c) = compile_forward_with(&cfg, &opts, &rw) else {
                continue; // meshes that do not divide the model are checked elsewhere
            };
            for dt in [GpuDType::F32, GpuDType::Bf16] {
                let outs = run_spmd_local_gpu(
                    &dev,
                    &c.sharded.graph,
                    &opts.mesh,
                    &ParamInit::Weights(&w),
                    &case.inputs,
                    &cuda_common::opts(dt, true),
                )
                .unwrap_or_else(|e| {
                    panic!("{} {mesh} {extra} rewrite={rewrite} {dt}: {e}", case.model)
                });
                for (rank, out) in outs.iter().enumerate() {
                    let logits = out["logits"].as_f32().expect("f32");
                    let what = format!(
                        "{} {} {mesh} {extra} rewrite={rewrite} {dt} rank {rank}",
                        case.model, case.name
                    );
                    match dt {
                        GpuDType::F32 => {
                            let d = case.max_diff(logits, &case.logits);
                            assert!(d < 1e-3, "{what}: max |Δlogit| {d}");
                        }
                        GpuDType::Bf16 => {
                            let l2 = rel_l2(&case.unmasked(logits), &case.unmasked(&case.logits));
                            assert!(l2 < 2e-2, "{what}: relative L2 {l2}");
                        }
                    }
                }
                ran += 1;
            }
        }
    }
    assert!(ran >= 16, "only {ran} sharded GPU runs");
}

/// Runs `g` on the CPU thread ranks of `mesh` (a `tp` mesh) and, in f32 and bf16, on local-gpu
/// ranks: every rank's every output matches the CPU's (under bf16 the CPU's rounded to bf16
/// when `round_cpu`).
fn local_gpu_matches_cpu_ranks(
    g: &Graph,
    mesh: &Mesh,
    weights: &Weights,
    inputs: &BTreeMap<String, Tensor>,
    round_cpu: bool,
) {
    let (dev, parts) = (device(), mesh.world_size());
    let cpu = run_spmd(g, mesh, weights, inputs, TIMEOUT).expect("cpu ranks");
    for dt in [GpuDType::F32, GpuDType::Bf16] {
        let gpu = run_spmd_local_gpu(
            &dev,
            g,
            mesh,
            &ParamInit::Weights(weights),
            inputs,
            &opts(dt, true),
        )
        .unwrap_or_else(|e| panic!("tp={parts} {dt}: {e}"));
        let (a, r) = match dt {
            GpuDType::F32 => (1e-5, 1e-5),
            GpuDType::Bf16 => (5e-2, 5e-2),
        };
        for (rank, (go, co)) in gpu.iter().zip(&cpu).enumerate() {
            for (name, want) in co {
                let want = if dt == GpuDType::Bf16 && round_cpu {
                    round_bf16(want)
                } else {
                    want.clone()
                };
                let what = format!("tp={parts} {dt} rank {rank} {name}");
                assert_close(&what, &go[name], &want, a, r);
            }
        }
    }
}

/// A graph with every collective (dims that need packing included), `RankOffset`,
/// `LocalSlice` and the collective matmuls, on 2 and 4 virtual ranks, against CPU thread ranks.
#[test]
#[ignore = "needs a GPU"]
fn local_gpu_collective_ops_and_collective_matmuls_match_cpu_ranks() {
    for parts in [2, 4] {
        let mesh = Mesh::parse(&format!("tp={parts}"), 8).expect("mesh");
        let shard = |dim| {
            vec![ShardSpec {
                dim,
                axis: "tp".into(),
                parts,
            }]
        };
        let mut g = Graph::new();
        let x = g
            .add_typed(
                Op::Input {
                    name: "x".into(),
                    shards: shard(0),
                },
                &[],
                Some(TensorType::plain(DType::F32, &[2, 8, 12])),
                "x",
            )
            .expect("x");
        let ids = g
            .add_typed(
                Op::Input {
                    name: "ids".into(),
                    shards: shard(0),
                },
                &[],
                Some(TensorType::plain(DType::I32, &[2, 8])),
                "ids",
            )
            .expect("ids");
        let tp = || "tp".to_string();
        let outs = [
            ("ar", Op::AllReduce { axis: tp() }, x),
            (
                "rs",
                Op::ReduceScatter {
                    axis: tp(),
                    dim: 1,
                    parts,
                },
                x,
            ),
            (
                "ag",
                Op::AllGather {
                    axis: tp(),
                    dim: 2,
                    parts,
                },
                x,
            ),
            (
                "a2a",
                Op::AllToAll {
                    axis: tp(),
                    split_dim: 1,
                    concat_dim: 2,
                    parts,
                },
                x,
            ),
            (
                "bc",
                Op::Broadcast {
                    axis: tp(),
                    root: 1,
                },
                x,
            ),
            (
                "ls",
                Op::LocalSlice {
                    axis: tp(),
                    dim: 2,
                    parts,
                },
                x,
            ),
            (
                "ro",
                Op::RankOffset {
                    axis: tp(),
                    stride: 5,
                },
                ids,
            ),
            (
                "ag_ids",
                Op::AllGather {
                    axis: tp(),
                    dim: 1,
                    parts,
                },
                ids,
            ),
        ];
        for (name, op, arg) in outs {
            let v = g.add(op, &[arg], name).expect(name);
            g.set_output(name, v);
        }
        let w = param(&mut g, "w", &[24, 12]);
        let agmm = g
            .add(
                Op::AgMatMul {
                    axis: tp(),
                    dim: 1,
                    parts,
                    transpose_b: true,
                },
                &[x, w],
                "agmm",
            )
            .expect("agmm");
        g.set_output("agmm", agmm);
        let w2 = param(&mut g, "w2", &[12, 24]);
        let mmrs = g
            .add(
                Op::MatMulRs {
                    axis: tp(),
                    dim: 1,
                    parts,
                    transpose_b: true,
                },
                &[agmm, w2],
                "mmrs",
            )
            .expect("mmrs");
        g.set_output("mmrs", mmrs);
        let mut rng = Rng::new(13);
        let dir = tempfile::tempdir().expect("tempdir");
        let weights = checkpoint(
            dir.path(),
            &[
                (
                    "w",
                    vec![24, 12],
                    rng.tensor(&[24, 12], 0.5).as_f32().unwrap().to_vec(),
                ),
                (
                    "w2",
                    vec![12, 24],
                    rng.tensor(&[12, 24], 0.5).as_f32().unwrap().to_vec(),
                ),
            ],
        );
        let inputs = BTreeMap::from([
            ("x".to_string(), rng.tensor(&[2 * parts, 8, 12], 1.0)),
            ("ids".to_string(), rng.ids(&[2 * parts, 8], 0, 100)),
        ]);
        local_gpu_matches_cpu_ranks(&g, &mesh, &weights, &inputs, true);
    }
}

/// Vocabulary-parallel cross-entropy on 2 and 4 virtual ranks against CPU thread ranks: each
/// rank's stats of its logits shard, the stats gathered, the loss and the rank's gradient.
#[test]
#[ignore = "needs a GPU"]
fn local_gpu_vocab_parallel_cross_entropy_matches_cpu_ranks() {
    for parts in [2, 4] {
        let mesh = Mesh::parse(&format!("tp={parts}"), 8).expect("mesh");
        let vocab = 783 * parts;
        let mut g = Graph::new();
        let logits = g
            .add_typed(
                Op::Input {
                    name: "logits".into(),
                    shards: vec![ShardSpec {
                        dim: 2,
                        axis: "tp".into(),
                        parts,
                    }],
                },
                &[],
                Some(TensorType::plain(DType::F32, &[2, 7, vocab])),
                "logits",
            )
            .expect("logits");
        let labels = g.input("labels", TensorType::plain(DType::I32, &[2, 7]));
        let tp = || "tp".to_string();
        let stats = g
            .add(
                Op::CrossEntropyStats { axis: tp(), parts },
                &[logits, labels],
                "stats",
            )
            .expect("stats");
        let gathered = Op::AllGather {
            axis: tp(),
            dim: 2,
            parts,
        };
        let gathered = g.add(gathered, &[stats], "gathered").expect("gather");
        let loss = Op::CrossEntropyFromStats { denom: 13 };
        let loss = g.add(loss, &[gathered, labels], "loss").expect("loss");
        let dx = Op::CrossEntropyShardGrad {
            axis: tp(),
            denom: 13,
        };
        let dx = g.add(dx, &[logits, labels, gathered], "dx").expect("dx");
        for (name, v) in [("stats", stats), ("loss", loss), ("dx", dx)] {
            g.set_output(name, v);
        }
        let mut rng = Rng::new(17);
        let mut ids = rng.ids(&[2, 7], 0, vocab as i32);
        if let shardc_runtime::Buffer::I32(l) = &mut ids.data {
            l[3] = -100; // ignored position
            l[4] = (vocab - 1) as i32; // the last shard's last column
        }
        let inputs = BTreeMap::from([
            ("logits".to_string(), rng.tensor(&[2, 7, vocab], 6.0)),
            ("labels".to_string(), ids),
        ]);
        let dir = tempfile::tempdir().expect("tempdir");
        let weights = checkpoint(dir.path(), &[]);
        local_gpu_matches_cpu_ranks(&g, &mesh, &weights, &inputs, false);
    }
}
