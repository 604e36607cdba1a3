//! The in-process communicator against the naive definitions of its collectives, plus its
//! failure modes (timeout, abort, departed rank, size mismatches).
//!
//! Every rank derives every rank's input from a seed, so expected results are computed
//! directly from all inputs; ranks return their outputs and the test thread compares.

mod comm_common;

use comm_common::{
    assert_aborted_promptly, assert_timed_out, bits, cases, input, inputs as all_inputs, naive,
    on_threads, COUNTS, LONG,
};
use shardc_runtime::comm::thread::{group, ThreadComm};
use shardc_runtime::comm::{CollectiveKind, CommError, Communicator, ReduceOp};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

const SIZES: [usize; 6] = [1, 2, 3, 4, 5, 8];
/// Max/Min exactly, the rest to a tolerance (the ring order differs from rank order).
fn assert_close(op: ReduceOp, got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = match op {
            ReduceOp::Max | ReduceOp::Min => g.to_bits() == w.to_bits(),
            _ => (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
        };
        assert!(ok, "{what}: element {i}: got {g}, want {w}");
    }
}

/// Runs `body(comm)` on every rank of a fresh group, each in its own thread; returns the
/// results in rank order.
fn run<R: Send>(size: usize, timeout: Duration, body: impl Fn(ThreadComm) -> R + Sync) -> Vec<R> {
    on_threads(group("tp", size, timeout), body)
}

/// Runs `each(comm, case, item)` for every item of `items` (`case` is its index), in order,
/// on every rank of a group of `size`: outputs[rank][case].
fn per_case<T: Sync, R: Send>(
    size: usize,
    items: &[T],
    each: impl Fn(&ThreadComm, usize, &T) -> R + Sync,
) -> Vec<Vec<R>> {
    run(size, LONG, |comm| {
        let each = |(case, t)| each(&comm, case, t);
        items.iter().enumerate().map(each).collect()
    })
}

/// Every (count, op) case of `all_reduce` on a group of `size`: outputs[rank][case].
fn all_reduce_outputs(size: usize) -> Vec<Vec<Vec<f32>>> {
    per_case(size, &cases(), |comm, case, &(len, op)| {
        let mut buf = input(case, comm.rank(), len, op);
        comm.all_reduce(&mut buf, op).expect("all_reduce");
        buf
    })
}

#[test]
fn all_reduce_matches_naive_and_is_bitwise_identical_across_ranks_and_runs() {
    for size in SIZES {
        let first = all_reduce_outputs(size);
        let second = all_reduce_outputs(size);
        for (case, &(len, op)) in cases().iter().enumerate() {
            let want = naive(op, &all_inputs(case, size, len, op));
            for rank in 0..size {
                let what = format!("size {size} len {len} {op:?} rank {rank}");
                assert_close(op, &first[rank][case], &want, &what);
                assert_eq!(
                    bits(&first[rank][case]),
                    bits(&first[0][case]),
                    "{what}: differs from rank 0"
                );
                assert_eq!(
                    bits(&second[rank][case]),
                    bits(&first[rank][case]),
                    "{what}: differs between runs"
                );
            }
        }
    }
}

#[test]
fn reduce_matches_naive_for_every_root() {
    for size in SIZES {
        let outs = run(size, LONG, |comm| {
            let mut outs = Vec::new();
            for root in 0..comm.size() {
                for (case, &(len, op)) in cases().iter().enumerate() {
                    let send = input(case, comm.rank(), len, op);
                    let mut recv = vec![f32::NAN; if comm.rank() == root { len } else { 0 }];
                    comm.reduce(&send, &mut recv, op, root).expect("reduce");
                    outs.push(recv);
                }
            }
            outs
        });
        for root in 0..size {
            for (case, &(len, op)) in cases().iter().enumerate() {
                let want = naive(op, &all_inputs(case, size, len, op));
                let got = &outs[root][root * cases().len() + case];
                assert_close(
                    op,
                    got,
                    &want,
                    &format!("size {size} root {root} len {len} {op:?}"),
                );
            }
        }
    }
}

#[test]
fn broadcast_copies_the_root_buffer_for_every_root() {
    for size in SIZES {
        let outs = run(size, LONG, |comm| {
            let mut outs = Vec::new();
            for root in 0..comm.size() {
                for (case, len) in COUNTS.into_iter().enumerate() {
                    let mut buf = input(case, comm.rank(), len, ReduceOp::Sum);
                    comm.broadcast(&mut buf, root).expect("broadcast");
                    outs.push((root, case, buf));
                }
            }
            outs
        });
        for rank_outs in &outs {
            for (root, case, buf) in rank_outs {
                let want = input(*case, *root, buf.len(), ReduceOp::Sum);
                assert_eq!(
                    bits(buf),
                    bits(&want),
                    "size {size} root {root} case {case}"
                );
            }
        }
    }
}

#[test]
fn gather_and_all_gather_concatenate_in_rank_order() {
    for size in SIZES {
        let outs = per_case(size, &COUNTS, |comm, case, &m| {
            let (rank, n) = (comm.rank(), comm.size());
            let send = input(case, rank, m, ReduceOp::Sum);
            let mut all = vec![f32::NAN; m * n];
            comm.all_gather(&send, &mut all).expect("all_gather");
            let root = case % n;
            let mut gathered = vec![f32::NAN; if rank == root { m * n } else { 0 }];
            comm.gather(&send, &mut gathered, root).expect("gather");
            (case, m, all, gathered)
        });
        for (rank, rank_outs) in outs.iter().enumerate() {
            for (case, m, all, gathered) in rank_outs {
                let want: Vec<f32> = all_inputs(*case, size, *m, ReduceOp::Sum).concat();
                assert_eq!(
                    bits(all),
                    bits(&want),
                    "all_gather size {size} m {m} rank {rank}"
                );
                if rank == case % size {
                    assert_eq!(bits(gathered), bits(&want), "gather size {size} m {m}");
                }
            }
        }
    }
}

#[test]
fn scatter_hands_chunk_i_to_rank_i() {
    for size in SIZES {
        let outs = per_case(size, &COUNTS, |comm, case, &m| {
            let (rank, n) = (comm.rank(), comm.size());
            let root = (case + 1) % n;
            let send = if rank == root {
                input(case, root, m * n, ReduceOp::Sum)
            } else {
                Vec::new()
            };
            let mut recv = vec![f32::NAN; m];
            comm.scatter(&send, &mut recv, root).expect("scatter");
            (case, m, recv)
        });
        for (rank, rank_outs) in outs.iter().enumerate() {
            for (case, m, recv) in rank_outs {
                let root = (case + 1) % size;
                let full = input(*case, root, m * size, ReduceOp::Sum);
                let want = &full[rank * m..(rank + 1) * m];
                assert_eq!(bits(recv), bits(want), "size {size} m {m} rank {rank}");
            }
        }
    }
}

#[test]
fn reduce_scatter_keeps_chunk_i_of_the_reduction_on_rank_i() {
    for size in SIZES {
        let outs = per_case(size, &cases(), |comm, case, &(m, op)| {
            let n = comm.size();
            let send = input(case, comm.rank(), m * n, op);
            let mut recv = vec![f32::NAN; m];
            comm.reduce_scatter(&send, &mut recv, op)
                .expect("reduce_scatter");
            recv
        });
        for (case, &(m, op)) in cases().iter().enumerate() {
            let want = naive(op, &all_inputs(case, size, m * size, op));
            for (rank, rank_outs) in outs.iter().enumerate() {
                let what = format!("size {size} m {m} {op:?} rank {rank}");
                assert_close(op, &rank_outs[case], &want[rank * m..(rank + 1) * m], &what);
            }
        }
    }
}

#[test]
fn all_to_all_transposes_chunks() {
    for size in SIZES {
        let outs = per_case(size, &[0, 1, 3, 7, 50], |comm, case, &m| {
            let n = comm.size();
            let send = input(case, comm.rank(), m * n, ReduceOp::Sum);
            let mut recv = vec![f32::NAN; m * n];
            comm.all_to_all(&send, &mut recv).expect("all_to_all");
            (case, m, recv)
        });
        for (rank, rank_outs) in outs.iter().enumerate() {
            for (case, m, recv) in rank_outs {
                let inputs = all_inputs(*case, size, m * size, ReduceOp::Sum);
                let want: Vec<f32> = (0..size)
                    .flat_map(|src| inputs[src][rank * m..(rank + 1) * m].to_vec())
                    .collect();
                assert_eq!(bits(recv), bits(&want), "size {size} m {m} rank {rank}");
            }
        }
    }
}

#[test]
fn send_recv_match_in_order_per_pair_and_interleave_with_collectives() {
    let outs = run(4, LONG, |comm| {
        let (rank, n) = (comm.rank(), comm.size());
        let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
        // Three messages around the ring, then one all_reduce, then one more message.
        for k in 0..3 {
            comm.send(&[rank as f32, k as f32], right).expect("send");
        }
        let mut got = Vec::new();
        for _ in 0..3 {
            let mut buf = [f32::NAN; 2];
            comm.recv(&mut buf, left).expect("recv");
            got.extend(buf);
        }
        let mut sum = [1.0];
        comm.all_reduce(&mut sum, ReduceOp::Sum)
            .expect("all_reduce");
        // Rank 0 also receives a message from every rank, out of arrival order.
        if rank != 0 {
            comm.send(&[10.0 * rank as f32], 0).expect("send to 0");
        } else {
            for src in (1..n).rev() {
                let mut buf = [0.0];
                comm.recv(&mut buf, src).expect("recv from src");
                got.push(buf[0]);
            }
        }
        (got, sum[0])
    });
    for (rank, (got, sum)) in outs.iter().enumerate() {
        let left = ((rank + 3) % 4) as f32;
        let mut want = vec![left, 0.0, left, 1.0, left, 2.0];
        if rank == 0 {
            want.extend([30.0, 20.0, 10.0]);
        }
        assert_eq!(got, &want, "rank {rank}");
        assert_eq!(*sum, 4.0);
    }
}

#[test]
fn a_missing_rank_times_out_naming_rank_collective_seq_and_group() {
    let timeout = Duration::from_millis(200);
    let done = Barrier::new(3);
    let outs = run(3, timeout, |comm| {
        let mut warmup = [1.0; 5];
        comm.all_reduce(&mut warmup, ReduceOp::Sum)
            .expect("collective #0");
        let result = if comm.rank() == 2 {
            None // Rank 2 never calls collective #1 but keeps its handle alive.
        } else {
            let start = Instant::now();
            let mut buf = [1.0; 5];
            let err = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
            Some((err, start.elapsed()))
        };
        done.wait();
        result
    });
    for (rank, out) in outs.into_iter().enumerate().take(2) {
        let (err, elapsed) = out.expect("ranks 0 and 1 call the collective");
        let CommError::Timeout {
            kind,
            seq,
            rank: r,
            waiting_for,
            ref group,
            timeout_ms,
        } = err
        else {
            panic!("rank {rank}: expected a timeout, got {err}");
        };
        assert_eq!(
            (kind, seq, r, group.as_str(), timeout_ms),
            (CollectiveKind::AllReduce, 1, rank, "tp", 200)
        );
        if rank == 0 {
            assert_eq!(waiting_for, 2, "rank 0 waits on its ring neighbour");
        }
        let parts = [
            "all_reduce",
            "#1",
            &format!("rank {rank}"),
            "`tp`",
            "200 ms",
        ];
        assert_timed_out(rank, &err, elapsed, timeout, &parts);
    }
}

#[test]
fn abort_wakes_every_waiting_rank_promptly() {
    let outs = run(4, LONG, |comm| {
        let start = Instant::now();
        if comm.rank() == 0 {
            thread::sleep(Duration::from_millis(50));
            comm.abort("rank 0 hit an OOM");
            let mut buf = [0.0; 3];
            // The aborting rank's own next collective fails too.
            return (comm.broadcast(&mut buf, 0).unwrap_err(), start.elapsed());
        }
        let mut buf = [1.0; 9];
        (
            comm.all_reduce(&mut buf, ReduceOp::Max).unwrap_err(),
            start.elapsed(),
        )
    });
    assert_aborted_promptly(outs, &["rank 0", "OOM"]);
}

#[test]
fn a_dropped_rank_fails_its_peers_fast() {
    let outs = run(3, LONG, |comm| {
        let mut buf = [2.0; 4];
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .expect("collective #0");
        if comm.rank() == 1 {
            drop(comm);
            return None;
        }
        let start = Instant::now();
        let err = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        Some((err, start.elapsed()))
    });
    let mut names_rank_1 = false;
    for (err, elapsed) in outs.into_iter().flatten() {
        assert!(elapsed < Duration::from_secs(5), "{err} after {elapsed:?}");
        let CommError::Aborted { ref reason, .. } = err else {
            panic!("expected Aborted, got {err}");
        };
        names_rank_1 |= reason.contains("rank 1 left");
    }
    assert!(names_rank_1, "some rank should name the departed rank 1");
}

#[test]
fn misuse_is_an_error_not_a_panic() {
    let comms = group("dp", 3, Duration::from_millis(100));
    let c = &comms[1];
    let size_err = |r: Result<(), CommError>, kind: CollectiveKind| match r {
        Err(CommError::Size {
            kind: k,
            rank: 1,
            detail,
        }) if k == kind => detail,
        other => panic!("{kind}: expected a size error, got {other:?}"),
    };
    let d = size_err(
        c.all_gather(&[0.0; 2], &mut [0.0; 5]),
        CollectiveKind::AllGather,
    );
    assert!(d.contains('5') && d.contains('2') && d.contains('3'), "{d}");
    size_err(
        c.reduce_scatter(&[0.0; 7], &mut [0.0; 2], ReduceOp::Sum),
        CollectiveKind::ReduceScatter,
    );
    size_err(
        c.all_to_all(&[0.0; 4], &mut [0.0; 4]),
        CollectiveKind::AllToAll,
    );
    size_err(
        c.all_to_all(&[0.0; 3], &mut [0.0; 6]),
        CollectiveKind::AllToAll,
    );
    size_err(
        c.gather(&[0.0; 2], &mut [0.0; 2], 1),
        CollectiveKind::Gather,
    );
    size_err(
        c.scatter(&[0.0; 2], &mut [0.0; 2], 1),
        CollectiveKind::Scatter,
    );
    size_err(
        c.reduce(&[0.0; 2], &mut [0.0; 3], ReduceOp::Sum, 1),
        CollectiveKind::Reduce,
    );
    let bad_peer = |r: Result<(), CommError>, peer: usize| {
        assert!(
            matches!(r, Err(CommError::BadPeer { rank: 1, peer: p, size: 3, .. }) if p == peer),
            "peer {peer}: {r:?}"
        )
    };
    bad_peer(c.broadcast(&mut [0.0], 3), 3);
    bad_peer(c.reduce(&[0.0], &mut [0.0], ReduceOp::Min, 7), 7);
    bad_peer(c.gather(&[0.0], &mut [0.0; 3], 3), 3);
    bad_peer(c.scatter(&[0.0; 3], &mut [0.0], 9), 9);
    bad_peer(c.send(&[0.0], 1), 1); // To itself.
    bad_peer(c.recv(&mut [0.0], 3), 3);
}

#[test]
fn mismatched_sizes_across_ranks_are_reported() {
    let outs = run(2, Duration::from_millis(200), |comm| {
        let mut buf = vec![1.0; 4 + comm.rank()];
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err()
    });
    // Rank 1 splits 5 elements as 3 + 2 and expects chunk 0 (3 elements) from rank 0, which
    // splits 4 as 2 + 2 and sends 2. Rank 0 then waits for a message rank 1 never sends.
    match &outs[1] {
        CommError::Size {
            kind: CollectiveKind::AllReduce,
            rank: 1,
            detail,
        } => {
            assert!(
                detail.contains("received 2 elements from rank 0 where 3"),
                "{detail}"
            )
        }
        other => panic!("expected a size error on rank 1, got {other}"),
    }
    assert!(
        matches!(
            outs[0],
            CommError::Aborted { .. } | CommError::Timeout { .. }
        ),
        "{}",
        outs[0]
    );
}

#[test]
fn handles_are_send() {
    fn assert_send<T: Send>() {}
    assert_send::<ThreadComm>();
}
