//! The rendezvous store and process groups, with ranks as threads of this test: every rank
//! receives the same table and rank 0's bootstrap bytes; inconsistent or missing ranks are
//! errors naming them, within the timeout; a process group's communicators reduce over the
//! right ranks.

mod common;

use common::free_port;

use shardc::compiler::shard::Mesh;
use shardc::runtime::comm::{Communicator, ReduceOp};
use shardc::runtime::launch::{
    plan_fingerprint, ProcessGroup, Rendezvous, RendezvousServer, RendezvousTable, WorldEnv,
};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(20);

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Rank `r` of `world` registers `[r + 1000, r + 2000]` as its addresses (and 128 bytes, like an
/// `ncclUniqueId`, which only rank 0's count).
fn register(
    port: u16,
    r: usize,
    world: usize,
    timeout: Duration,
) -> Result<RendezvousTable, String> {
    let bootstrap: Vec<u8> = (0..128).map(|i| (i * 7 + r * 31) as u8).collect();
    let rv =
        Rendezvous::connect("127.0.0.1", port, r, world, timeout).map_err(|e| e.to_string())?;
    assert!(rv.local_ip().is_loopback());
    rv.exchange(
        b"plan",
        &[addr(1000 + r as u16), addr(2000 + r as u16)],
        Some(&bootstrap),
    )
    .map_err(|e| e.to_string())
}

/// Registers `ranks` of a world of `world` with the store on `port` at once, each on a thread
/// of its own; their results in the order of `ranks`.
fn register_all(
    port: u16,
    ranks: &[usize],
    world: usize,
    timeout: Duration,
) -> Vec<Result<RendezvousTable, String>> {
    on_threads(ranks.iter().copied(), |r| register(port, r, world, timeout))
}

/// Runs `f(item)` for every item, each on a thread of its own; the results in item order.
fn on_threads<T: Send, R: Send>(
    items: impl IntoIterator<Item = T>,
    f: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    let f = &f;
    thread::scope(|s| {
        let hs: Vec<_> = items.into_iter().map(|t| s.spawn(move || f(t))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn every_rank_receives_the_same_table_and_bootstrap_bytes() {
    let world = 6;
    let server = RendezvousServer::start("127.0.0.1", 0, world, LONG).unwrap();
    let port = server.local_addr().port();
    // Register in reverse order, from threads.
    let ranks: Vec<usize> = (0..world).rev().collect();
    let tables: Vec<RendezvousTable> = register_all(port, &ranks, world, LONG)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    server.wait().unwrap();
    let want_bootstrap: Vec<u8> = (0..128).map(|i| (i * 7) as u8).collect();
    for t in &tables {
        assert_eq!(t, &tables[0]);
        assert_eq!(
            t.bootstrap, want_bootstrap,
            "rank 0's bytes, not another rank's"
        );
        for (r, a) in t.addrs.iter().enumerate() {
            assert_eq!(a, &vec![addr(1000 + r as u16), addr(2000 + r as u16)]);
        }
    }
}

#[test]
fn junk_connections_are_ignored() {
    let server = RendezvousServer::start("127.0.0.1", 0, 2, LONG).unwrap();
    let port = server.local_addr().port();
    let mut junk = TcpStream::connect(addr(port)).unwrap();
    junk.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let _silent = TcpStream::connect(addr(port)).unwrap();
    let tables: Vec<_> = register_all(port, &[0, 1], 2, LONG)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(tables[0], tables[1]);
    server.wait().unwrap();
}

#[test]
fn missing_ranks_time_out_naming_them() {
    let timeout = Duration::from_millis(500);
    let t0 = Instant::now();
    let server = RendezvousServer::start("127.0.0.1", 0, 4, timeout).unwrap();
    let port = server.local_addr().port();
    let errs: Vec<String> = register_all(port, &[0, 2], 4, timeout)
        .into_iter()
        .map(Result::unwrap_err)
        .collect();
    for e in &errs {
        assert!(
            e.contains("waiting for ranks [1, 3] to register (registered: [0, 2])"),
            "{e}"
        );
    }
    assert!(server.wait().is_err());
    assert!(
        t0.elapsed() < timeout + Duration::from_secs(5),
        "{:?}",
        t0.elapsed()
    );
}

#[test]
fn inconsistent_registrations_fail_every_rank() {
    // Two processes claim rank 1. The store answers every rank with the cause (latecomers
    // too, until its deadline).
    let server = RendezvousServer::start("127.0.0.1", 0, 3, Duration::from_secs(2)).unwrap();
    let port = server.local_addr().port();
    let errs: Vec<String> = register_all(port, &[0, 1, 1], 3, LONG)
        .into_iter()
        .map(Result::unwrap_err)
        .collect();
    for e in &errs {
        assert!(e.contains("rank 1 registered twice"), "{e}");
    }
    let e = server.wait().unwrap_err().to_string();
    assert!(e.contains("registered twice"), "{e}");

    // A rank with another world size.
    let server = RendezvousServer::start("127.0.0.1", 0, 2, Duration::from_secs(2)).unwrap();
    let port = server.local_addr().port();
    let e = register(port, 1, 3, LONG).unwrap_err();
    assert!(
        e.contains("rank 1 registered with a world size of 3 but the store (rank 0) expects 2"),
        "{e}"
    );
    assert!(server.wait().is_err());
}

#[test]
fn no_store_is_a_clear_error_within_the_timeout() {
    let port = free_port();
    let t0 = Instant::now();
    let e = Rendezvous::connect("127.0.0.1", port, 1, 2, Duration::from_millis(300))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("rendezvous at 127.0.0.1:{port}")),
        "{e}"
    );
    assert!(
        e.contains("no store answered") && e.contains("is rank 0 running"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    let e = Rendezvous::connect("no-such-host.invalid", port, 1, 2, LONG)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot resolve `no-such-host.invalid`"), "{e}");
}

#[test]
fn store_port_in_use_is_named() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let e = RendezvousServer::start("127.0.0.1", port, 2, LONG)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&format!("port {port} is already in use")), "{e}");
}

fn env(rank: usize, world: usize, port: u16) -> WorldEnv {
    WorldEnv {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

/// Four "processes" (threads) on a dp=2,tp=2 mesh: rank 0 hosts the store, each rank gets a
/// communicator per axis, and each reduces over exactly the ranks of its group.
#[test]
fn process_groups_connect_each_mesh_axis() {
    let mesh = Mesh::parse("dp=2,tp=2", 8).unwrap();
    let port = free_port();
    let nccl_id: Vec<u8> = (0..128).map(|i| i as u8 ^ 0x5a).collect();
    let results = on_threads(0..4, |rank| {
        // Only rank 0's bootstrap bytes count.
        let mine = if rank == 0 {
            Some(&nccl_id[..])
        } else {
            Some(&b"ignored"[..])
        };
        let pg = ProcessGroup::connect(&env(rank, 4, port), &mesh, b"plan", mine, LONG).unwrap();
        let g = pg.groups();
        assert_eq!((g[0].axis.as_str(), g[1].axis.as_str()), ("dp", "tp"));
        let mut dp = [rank as f32];
        g[0].comm.all_reduce(&mut dp, ReduceOp::Sum).unwrap();
        let mut tp = [rank as f32];
        g[1].comm.all_reduce(&mut tp, ReduceOp::Sum).unwrap();
        pg.barrier().unwrap();
        (
            pg.rank(),
            pg.bootstrap().to_vec(),
            pg.groups_text(),
            dp[0],
            tp[0],
        )
    });
    // Row-major ranks: dp groups {0,2} {1,3}; tp groups {0,1} {2,3}.
    let want = [
        ("dp:[0,2] tp:[0,1]", 2.0, 1.0),
        ("dp:[1,3] tp:[0,1]", 4.0, 1.0),
        ("dp:[0,2] tp:[2,3]", 2.0, 5.0),
        ("dp:[1,3] tp:[2,3]", 4.0, 5.0),
    ];
    for (r, (rank, bootstrap, groups, dp, tp)) in results.into_iter().enumerate() {
        assert_eq!(rank, r);
        assert_eq!(bootstrap, nccl_id, "rank {r}");
        assert_eq!((groups.as_str(), dp, tp), want[r], "rank {r}");
    }
}

#[test]
fn the_default_bootstrap_is_a_shared_random_job_id() {
    let mesh = Mesh::parse("tp=3", 8).unwrap();
    let run = || -> Vec<Vec<u8>> {
        let port = free_port();
        on_threads(0..3, |rank| {
            let pg =
                ProcessGroup::connect(&env(rank, 3, port), &mesh, b"plan", None, LONG).unwrap();
            pg.bootstrap().to_vec()
        })
    };
    let (a, b) = (run(), run());
    assert_eq!(a[0].len(), 16);
    assert!(a.iter().all(|x| x == &a[0]) && b.iter().all(|x| x == &b[0]));
    assert_ne!(a[0], b[0], "two jobs drew the same id");
}

#[test]
fn a_mesh_of_another_size_is_refused_before_connecting() {
    let mesh = Mesh::parse("tp=2", 8).unwrap();
    let e = ProcessGroup::connect(&env(0, 4, free_port()), &mesh, b"plan", None, LONG)
        .unwrap_err()
        .to_string();
    assert_eq!(e, "mesh tp=2 has 2 ranks but WORLD_SIZE is 4");
}

#[test]
fn a_rank_with_another_plan_is_refused_at_the_rendezvous() {
    let mesh = Mesh::parse("tp=3", 8).unwrap();
    let port = free_port();
    let errors = on_threads(0..3, |rank| {
        let plan = plan_fingerprint(if rank == 2 { b"plan B" } else { b"plan A" });
        ProcessGroup::connect(&env(rank, 3, port), &mesh, &plan, None, LONG)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    });
    let (a, b) = (
        plan_fingerprint(b"plan A")[..8]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<String>(),
        plan_fingerprint(b"plan B")[..8]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<String>(),
    );
    for e in &errors {
        // Rank 2 is named against another rank, in whichever order they registered.
        assert!(e.contains("rank 2 "), "{e}");
        assert!(e.contains("joined with plan"), "{e}");
        assert!(e.contains(&a) && e.contains(&b), "{e}");
        assert!(e.contains("same plan"), "{e}");
    }
}
