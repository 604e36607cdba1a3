//! The TCP communicator (ranks as threads, each with its own sockets on 127.0.0.1) against the
//! naive definitions of its collectives and, bit for bit, against the in-process communicator
//! (same algorithms, so same reduction order); plus its failure modes.

mod comm_common;

use comm_common::{
    assert_aborted_promptly, assert_timed_out, bits, cases, input, inputs, naive, on_threads,
    COUNTS, LONG,
};
use shardc_runtime::comm::tcp::TcpComm;
use shardc_runtime::comm::thread::group;
use shardc_runtime::comm::{CollectiveKind, CommError, Communicator, ReduceOp};
use std::net::{SocketAddr, TcpListener};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

/// One labelled output of [`program`], and how to compare it with the naive result.
struct Out {
    label: String,
    /// `Some(op)`: a reduction (exact for Max/Min, else to a tolerance). `None`: exact.
    op: Option<ReduceOp>,
    data: Vec<f32>,
}

fn out(label: String, op: Option<ReduceOp>, data: Vec<f32>) -> Out {
    Out { label, op, data }
}

/// Every collective on every case, as run by one rank of any communicator.
fn program<C: Communicator>(comm: &C) -> Vec<Out> {
    let (rank, n) = (comm.rank(), comm.size());
    let mut outs = Vec::new();
    for (case, &(len, op)) in cases().iter().enumerate() {
        let mut buf = input(case, rank, len, op);
        comm.all_reduce(&mut buf, op).expect("all_reduce");
        outs.push(out(format!("all_reduce {len} {op:?}"), Some(op), buf));

        let root = case % n;
        let send = input(case, rank, len, op);
        let mut recv = vec![f32::NAN; if rank == root { len } else { 0 }];
        comm.reduce(&send, &mut recv, op, root).expect("reduce");
        if rank == root {
            outs.push(out(format!("reduce {len} {op:?}"), Some(op), recv));
        }

        let send = input(case, rank, len * n, op);
        let mut recv = vec![f32::NAN; len];
        comm.reduce_scatter(&send, &mut recv, op)
            .expect("reduce_scatter");
        outs.push(out(format!("reduce_scatter {len} {op:?}"), Some(op), recv));
    }
    for (case, m) in COUNTS.into_iter().enumerate() {
        let root = (case + 1) % n;
        let mut buf = input(case, rank, m, ReduceOp::Sum);
        comm.broadcast(&mut buf, root).expect("broadcast");
        outs.push(out(format!("broadcast {m}"), None, buf));

        let send = input(case, rank, m, ReduceOp::Sum);
        let mut all = vec![f32::NAN; m * n];
        comm.all_gather(&send, &mut all).expect("all_gather");
        outs.push(out(format!("all_gather {m}"), None, all));

        let mut gathered = vec![f32::NAN; if rank == root { m * n } else { 0 }];
        comm.gather(&send, &mut gathered, root).expect("gather");
        if rank == root {
            outs.push(out(format!("gather {m}"), None, gathered));
        }

        let full = input(case, rank, m * n, ReduceOp::Sum);
        let mut recv = vec![f32::NAN; m];
        comm.scatter(&full, &mut recv, root).expect("scatter");
        outs.push(out(format!("scatter {m}"), None, recv));

        let mut recv = vec![f32::NAN; m * n];
        comm.all_to_all(&full, &mut recv).expect("all_to_all");
        outs.push(out(format!("all_to_all {m}"), None, recv));

        let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
        comm.send(&send, right).expect("send");
        let mut recv = vec![f32::NAN; m];
        comm.recv(&mut recv, left).expect("recv");
        outs.push(out(format!("send/recv {m}"), None, recv));
    }
    outs
}

/// What [`program`] must return on `rank` of a group of `n`.
fn expected(rank: usize, n: usize) -> Vec<Out> {
    let mut outs = Vec::new();
    for (case, &(len, op)) in cases().iter().enumerate() {
        let reduced = naive(op, &inputs(case, n, len, op));
        outs.push(out(
            format!("all_reduce {len} {op:?}"),
            Some(op),
            reduced.clone(),
        ));
        if rank == case % n {
            outs.push(out(format!("reduce {len} {op:?}"), Some(op), reduced));
        }
        let reduced = naive(op, &inputs(case, n, len * n, op));
        let mine = reduced[rank * len..(rank + 1) * len].to_vec();
        outs.push(out(format!("reduce_scatter {len} {op:?}"), Some(op), mine));
    }
    for (case, m) in COUNTS.into_iter().enumerate() {
        let root = (case + 1) % n;
        let chunk = |v: &[f32], i: usize| v[i * m..(i + 1) * m].to_vec();
        outs.push(out(
            format!("broadcast {m}"),
            None,
            input(case, root, m, ReduceOp::Sum),
        ));
        let all = inputs(case, n, m, ReduceOp::Sum).concat();
        outs.push(out(format!("all_gather {m}"), None, all.clone()));
        if rank == root {
            outs.push(out(format!("gather {m}"), None, all));
        }
        let fulls = inputs(case, n, m * n, ReduceOp::Sum);
        outs.push(out(format!("scatter {m}"), None, chunk(&fulls[root], rank)));
        let a2a = (0..n).flat_map(|src| chunk(&fulls[src], rank)).collect();
        outs.push(out(format!("all_to_all {m}"), None, a2a));
        let left = (rank + n - 1) % n;
        outs.push(out(
            format!("send/recv {m}"),
            None,
            input(case, left, m, ReduceOp::Sum),
        ));
    }
    outs
}

fn assert_matches(got: &Out, want: &Out, what: &str) {
    assert_eq!(got.label, want.label, "{what}: output order");
    assert_eq!(
        got.data.len(),
        want.data.len(),
        "{what} {}: length",
        got.label
    );
    for (i, (g, w)) in got.data.iter().zip(&want.data).enumerate() {
        let ok = match got.op {
            Some(ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Avg) => {
                (g - w).abs() <= 1e-5 + 1e-5 * w.abs()
            }
            _ => g.to_bits() == w.to_bits(),
        };
        assert!(ok, "{what} {}: element {i}: got {g}, want {w}", got.label);
    }
}

/// Binds one ephemeral 127.0.0.1 listener per rank, then runs `body` on every rank of a
/// group built with [`TcpComm::from_listener`], each in its own thread.
fn run_tcp<R: Send>(size: usize, timeout: Duration, body: impl Fn(TcpComm) -> R + Sync) -> Vec<R> {
    let listeners: Vec<TcpListener> = (0..size)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port"))
        .collect();
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr().expect("local address"))
        .collect();
    on_threads(listeners.into_iter().enumerate(), |(rank, listener)| {
        let comm = TcpComm::from_listener("tp", rank, size, listener, &addrs, timeout)
            .expect("join the group");
        body(comm)
    })
}

#[test]
fn collectives_match_naive_and_the_thread_communicator_bit_for_bit() {
    for size in [2, 3, 4] {
        let tcp = run_tcp(size, LONG, |comm| program(&comm));
        let threads = on_threads(group("tp", size, LONG), |comm| program(&comm));
        for rank in 0..size {
            let want = expected(rank, size);
            assert_eq!(tcp[rank].len(), want.len(), "size {size} rank {rank}");
            for ((got, want), local) in tcp[rank].iter().zip(&want).zip(&threads[rank]) {
                assert_matches(got, want, &format!("size {size} rank {rank}"));
                assert_eq!(
                    bits(&got.data),
                    bits(&local.data),
                    "size {size} rank {rank} {}: tcp and thread differ",
                    got.label
                );
            }
        }
    }
}

#[test]
fn connect_binds_the_given_addresses() {
    // Reserve two ports, then free them for `connect` to bind (a benign race in a test).
    let addrs: Vec<SocketAddr> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect::<Vec<_>>()
        .iter()
        .map(|l| l.local_addr().expect("local address"))
        .collect();
    let outs = on_threads(0..2, |rank| {
        let comm = TcpComm::connect("pp", rank, 2, &addrs, LONG).expect("connect");
        let mut buf = vec![rank as f32 + 1.0; 3];
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .expect("all_reduce");
        buf
    });
    assert_eq!(outs, vec![vec![3.0; 3], vec![3.0; 3]]);
}

#[test]
fn a_missing_rank_times_out_naming_rank_collective_seq_and_group() {
    let timeout = Duration::from_millis(800);
    let done = Barrier::new(3);
    let outs = run_tcp(3, timeout, |comm| {
        let mut buf = [1.0; 5];
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .expect("collective #0");
        let result = (comm.rank() != 2).then(|| {
            let start = Instant::now();
            let err = comm.broadcast(&mut buf, 2).unwrap_err();
            (err, start.elapsed())
        });
        done.wait(); // Rank 2 keeps its sockets open until the others gave up.
        result
    });
    for (rank, (err, elapsed)) in outs.into_iter().flatten().enumerate() {
        let CommError::Timeout {
            kind,
            seq,
            rank: r,
            ref group,
            ..
        } = err
        else {
            panic!("rank {rank}: expected a timeout, got {err}");
        };
        assert_eq!(
            (kind, seq, r, group.as_str()),
            (CollectiveKind::Broadcast, 1, rank, "tp")
        );
        let parts = ["broadcast", "#1", &format!("rank {rank}"), "`tp`"];
        assert_timed_out(rank, &err, elapsed, timeout, &parts);
    }
}

#[test]
fn a_rank_that_drops_its_comm_makes_the_others_error_not_hang() {
    let timeout = Duration::from_secs(3);
    let outs = run_tcp(4, timeout, |comm| {
        let mut buf = vec![1.0; 1000];
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .expect("collective #0");
        if comm.rank() == 2 {
            return None; // Drops its communicator between collectives of the others.
        }
        let start = Instant::now();
        let result = (0..3).try_for_each(|_| comm.all_reduce(&mut buf, ReduceOp::Sum));
        Some((result.unwrap_err(), start.elapsed()))
    });
    let mut names_rank_2 = false;
    for (err, elapsed) in outs.into_iter().flatten() {
        assert!(
            elapsed < timeout + Duration::from_secs(1),
            "{err} after {elapsed:?}"
        );
        if let CommError::Aborted { reason, .. } = &err {
            names_rank_2 |= reason.contains("rank 2");
        }
    }
    assert!(names_rank_2, "some rank should name the departed rank 2");
}

#[test]
fn abort_reaches_every_rank_promptly() {
    let outs = run_tcp(3, LONG, |comm| {
        let start = Instant::now();
        if comm.rank() == 1 {
            thread::sleep(Duration::from_millis(50));
            comm.abort("rank 1 ran out of memory");
            let mut buf = [0.0; 2];
            return (
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err(),
                start.elapsed(),
            );
        }
        let mut buf = [0.0; 2];
        (comm.broadcast(&mut buf, 1).unwrap_err(), start.elapsed())
    });
    assert_aborted_promptly(outs, &["rank 1", "out of memory"]);
}

#[test]
fn setup_failures_are_transport_errors() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("local address");
    let err = TcpComm::from_listener("tp", 2, 2, listener, &[addr, addr], LONG).unwrap_err();
    assert!(
        matches!(err, CommError::Transport(ref m) if m.contains("rank < size")),
        "{err}"
    );

    // Rank 0 never shows up: rank 1 retries until its timeout.
    let dead = TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead_addr = dead.local_addr().expect("local address");
    drop(dead);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addrs = [dead_addr, listener.local_addr().expect("local address")];
    let timeout = Duration::from_millis(200);
    let start = Instant::now();
    let err = TcpComm::from_listener("tp", 1, 2, listener, &addrs, timeout).unwrap_err();
    assert!(start.elapsed() >= timeout && start.elapsed() < timeout * 10);
    assert!(
        matches!(err, CommError::Transport(ref m) if m.contains("rank 0") && m.contains("timed out")),
        "{err}"
    );
}

#[test]
fn handles_are_send() {
    fn assert_send<T: Send>() {}
    assert_send::<TcpComm>();
}

/// Joins a 2-rank group as rank 1 by hand (the handshake of the wire format), sends `bytes`
/// and closes; returns rank 0's error from an all_reduce.
fn rank_0_error_after_rank_1_sends(bytes: Vec<u8>) -> CommError {
    use std::io::{Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = vec![
        listener.local_addr().unwrap(),
        "127.0.0.1:9".parse().unwrap(),
    ];
    let peer = thread::spawn({
        let to = addrs[0];
        move || {
            let mut s = std::net::TcpStream::connect(to).unwrap();
            let mut hello = b"SHDC".to_vec();
            hello.extend_from_slice(&2u32.to_le_bytes());
            for n in [1u64, 2, 2] {
                hello.extend_from_slice(&n.to_le_bytes());
            }
            hello.extend_from_slice(b"tp");
            s.write_all(&hello).unwrap();
            let mut ack = [0u8; 4];
            s.read_exact(&mut ack).unwrap();
            assert_eq!(&ack, b"SHOK");
            s.write_all(&bytes).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            // Hold the socket open until rank 0 has read what it needs.
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
        }
    });
    let comm = TcpComm::from_listener("tp", 0, 2, listener, &addrs, LONG).unwrap();
    let start = Instant::now();
    let mut buf = vec![1.0f32; 100];
    let e = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{e} took too long"
    );
    drop(comm);
    peer.join().unwrap();
    e
}

/// A data frame: the header (type 0, collective kind, checksum `check`, seq 0, `len` f32s)
/// and then `payload`, whatever its size.
fn data_frame(check: u32, len: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8, 0, 0, 0];
    h.extend_from_slice(&check.to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(payload);
    h
}

/// Checks that rank 0's error after rank 1 sends `frame` says each of `needles`.
fn rank_0_fails_saying(frame: Vec<u8>, needles: &[&str]) {
    let e = rank_0_error_after_rank_1_sends(frame).to_string();
    for needle in needles {
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn a_corrupted_frame_aborts_naming_the_sender() {
    rank_0_fails_saying(
        data_frame(0x1234_5678, 50, &[0x3f; 200]),
        &["rank 1 sent a corrupt frame", "checksum"],
    );
}

#[test]
fn a_truncated_frame_aborts_naming_the_sender_and_the_bytes() {
    rank_0_fails_saying(
        data_frame(0, 100, &[0; 40]),
        &[
            "rank 1 sent a truncated frame",
            "40 of its 400 payload bytes",
        ],
    );
}
