//! Fault handling of multi-process runs: a rank that exits or stalls before its first
//! collective (the `SHARDC_TEST_FAIL_RANK`/`SHARDC_TEST_FAIL_MODE` test hook of `shardc run`)
//! makes every other rank exit non-zero within the communication timeout, with an error naming
//! the rank, the collective, its sequence number and the mesh axis; the launcher stops the
//! rest and names the failing rank. Bad environments and launcher arguments are clear errors.

mod common;

use common::{fails_with_env, free_port, spawn_rank};

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The communication timeout of these tests, in seconds.
const TIMEOUT_S: u64 = 3;
/// Allowance beyond the timeout for process start-up and exit on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(12);

use common::shardc_clean as shardc;

fn llama() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf-tiny/llama")
        .display()
        .to_string()
}

fn tokens(dir: &Path) -> String {
    common::write_file(
        dir,
        "ids.json",
        "[[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]",
    )
}

/// `shardc run` arguments of one rank.
fn run_args(dir: &Path, mesh: &str, timeout_s: u64) -> Vec<String> {
    let out = dir.join("out.json").display().to_string();
    [
        "run",
        &llama(),
        "--tokens",
        &tokens(dir),
        "--mesh",
        mesh,
        "--comm-timeout",
        &timeout_s.to_string(),
        "--out",
        &out,
    ]
    .map(String::from)
    .to_vec()
}

/// A finished process.
struct Done {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

impl Done {
    /// Asserts the process's stderr holds `needle`, naming `what` (the case) otherwise.
    fn assert_stderr_has(&self, what: impl std::fmt::Display, needle: &str) {
        assert!(
            self.stderr.contains(needle),
            "{what}: `{needle}` not in: {}",
            self.stderr
        );
    }

    /// Asserts the last line of the process's stderr (the launcher's verdict) holds `needle`,
    /// naming `what` otherwise.
    fn assert_last_line_has(&self, what: impl std::fmt::Display, needle: &str) {
        let last = self.stderr.lines().last().unwrap_or_default();
        assert!(
            last.contains(needle),
            "{what}: `{needle}` not in the last line of: {}",
            self.stderr
        );
    }
}

/// Waits for `child` at most `limit`, killing it past that (then `None`).
fn wait(mut child: Child, started: Instant, limit: Duration) -> Option<Done> {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stdout = String::new();
            let mut stderr = String::new();
            child
                .stdout
                .take()
                .unwrap()
                .read_to_string(&mut stdout)
                .unwrap();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut stderr)
                .unwrap();
            return Some(Done {
                status,
                stdout,
                stderr,
                elapsed: started.elapsed(),
            });
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `world` ranks by hand (as torchrun would), rank `fail` with the test hook in `mode`.
fn spawn_ranks(dir: &Path, mesh: &str, world: usize, fail: usize, mode: &str) -> Vec<Child> {
    let port = free_port();
    let args = run_args(dir, mesh, TIMEOUT_S); // Once: it writes the tokens file.
    (0..world)
        .map(|rank| {
            let mut c = shardc();
            c.args(&args)
                .env("SHARDC_TEST_FAIL_RANK", fail.to_string())
                .env("SHARDC_TEST_FAIL_MODE", mode);
            spawn_rank(&mut c, rank, world, "127.0.0.1", port)
        })
        .collect()
}

/// `shardc launch --nproc-per-node 2 <flags> -- run …` on `tp=2` (communicator timeout
/// `timeout_s`), rank `fail.0` with the test hook in mode `fail.1`.
fn launch_failing(dir: &Path, flags: &[&str], timeout_s: u64, fail: (usize, &str)) -> Child {
    shardc()
        .args(["launch", "--nproc-per-node", "2"])
        .args(flags)
        .arg("--")
        .args(run_args(dir, "tp=2", timeout_s))
        .env("SHARDC_TEST_FAIL_RANK", fail.0.to_string())
        .env("SHARDC_TEST_FAIL_MODE", fail.1)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Rank `rank`'s error line: a one-line `error:` naming its rank, the collective, its
/// sequence number and mesh axis.
fn assert_documented_error(d: &Done, rank: usize, needles: &[&str]) {
    assert!(!d.status.success(), "rank {rank} should fail: {}", d.stdout);
    assert!(!d.stderr.contains("panicked"), "rank {rank}: {}", d.stderr);
    let line = d
        .stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("rank {rank}: no error line in {}", d.stderr));
    assert!(
        line.starts_with(&format!("error: rank {rank} (mesh coordinates ")),
        "rank {rank}: {line}"
    );
    // `<collective> #<seq> on rank <k> of group `<axis>``.
    let named = [
        "all_reduce #",
        "all_gather #",
        "reduce_scatter #",
        "all_to_all #",
    ]
    .iter()
    .any(|c| line.contains(c));
    assert!(named && line.contains(" of group `"), "rank {rank}: {line}");
    for n in needles {
        assert!(line.contains(n), "rank {rank}: `{n}` not in {line}");
    }
    assert!(
        d.elapsed < Duration::from_secs(TIMEOUT_S) + SLACK,
        "rank {rank} took {:?}",
        d.elapsed
    );
}

#[test]
fn a_crashed_rank_makes_its_peer_fail_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let mut ranks = spawn_ranks(tmp.path(), "tp=2", 2, 1, "exit").into_iter();
    let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
    let limit = Duration::from_secs(TIMEOUT_S) + SLACK;
    let d1 = wait(r1, t0, limit).expect("the crashing rank exits");
    assert_eq!(d1.status.code(), Some(3), "{}", d1.stderr);
    let d0 = wait(r0, t0, limit).expect("rank 0 must not hang");
    assert_documented_error(
        &d0,
        0,
        &["group `tp`", "aborted", "connection to rank 1 lost"],
    );
    assert!(
        !tmp.path().join("out.json").exists(),
        "a failed job wrote --out"
    );
}

#[test]
fn a_stalled_rank_makes_every_other_rank_fail_within_the_timeout() {
    // dp=2,tp=2: rank 3 stalls. Rank 2 shares its tp group and times out waiting for it; rank
    // 1 shares its dp group; rank 0 shares neither and learns of it through the aborts.
    let tmp = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let mut ranks = spawn_ranks(tmp.path(), "dp=2,tp=2", 4, 3, "hang");
    let stalled = ranks.pop().unwrap();
    let limit = Duration::from_secs(TIMEOUT_S) + SLACK;
    let done: Vec<Option<Done>> = ranks.into_iter().map(|c| wait(c, t0, limit)).collect();
    let d3 = wait(stalled, t0, Duration::ZERO); // Kills it.
    if let Some(d) = d3 {
        panic!(
            "rank 3 was to stall; it exited ({}): {}",
            d.status, d.stderr
        );
    }
    let done: Vec<Done> = done
        .into_iter()
        .enumerate()
        .map(|(r, d)| d.unwrap_or_else(|| panic!("rank {r} hung")))
        .collect();
    for (rank, d) in done.iter().enumerate() {
        assert_documented_error(d, rank, &[]);
    }
    // Rank 2 waited on rank 3 itself (group-local rank 1 of its tp group [2,3]).
    let e2 = done[2]
        .stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap();
    assert!(
        e2.contains(&format!(
            "timed out after {} ms waiting for rank 1",
            TIMEOUT_S * 1000
        )) && e2.contains("group `tp`")
            && e2.contains("tp:[2,3]"),
        "{e2}"
    );
    // The others failed within about one timeout, not one per hop.
    let slowest = done.iter().map(|d| d.elapsed).max().unwrap();
    assert!(
        slowest < Duration::from_secs(TIMEOUT_S) + SLACK,
        "{slowest:?}"
    );
}

#[test]
fn the_launcher_names_the_failing_rank_and_stops_the_rest() {
    for (mode, needles) in [
        // Rank 1 exits with status 3; rank 0 fails at once ("connection to rank 1 lost"). Both
        // are listed, in the order the launcher saw them exit.
        (
            "exit",
            vec![
                "rank 1 failed (exit status: 3)",
                "rank 0 failed (exit status: 1)",
            ],
        ),
        // Rank 1 stalls; rank 0 times out, then the launcher kills rank 1.
        (
            "hang",
            vec![
                "rank 0 failed (exit status: 1)",
                "ranks [1] were still running",
            ],
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let t0 = Instant::now();
        let child = launch_failing(tmp.path(), &["--grace", "1"], TIMEOUT_S, (1, mode));
        let d = wait(child, t0, Duration::from_secs(TIMEOUT_S + 1) + SLACK)
            .unwrap_or_else(|| panic!("{mode}: the launcher hung"));
        assert!(!d.status.success(), "{mode}");
        let last = d.stderr.lines().last().unwrap_or_default();
        assert!(last.starts_with("error: "), "{mode}: {}", d.stderr);
        for n in &needles {
            d.assert_last_line_has(mode, n);
        }
        // Rank 0's own message came through the launcher, prefixed.
        let prefixed = "[rank 0] error: rank 0 (mesh coordinates tp=0; groups tp:[0,1]): ";
        d.assert_stderr_has(mode, prefixed);
        d.assert_stderr_has(mode, "all_reduce #0 on rank 0 of group `tp`");
    }
}

#[test]
fn the_launcher_kills_a_job_past_its_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    // Both ranks stall (a long comm timeout), so only the job timeout ends it.
    let child = launch_failing(tmp.path(), &["--timeout", "2"], 600, (0, "hang"));
    let d = wait(child, t0, Duration::from_secs(2) + SLACK).expect("the launcher hung");
    assert!(!d.status.success());
    d.assert_last_line_has("timeout", "ran past its timeout of 2s; killed ranks [0, 1]");
}

/// A missing rank: the rendezvous times out naming it.
#[test]
fn a_rank_that_never_starts_fails_the_rendezvous() {
    let tmp = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let mut c = shardc();
    c.args(run_args(tmp.path(), "tp=2", 1));
    let child = spawn_rank(&mut c, 0, 2, "127.0.0.1", free_port());
    let d = wait(child, t0, Duration::from_secs(1) + SLACK).expect("rank 0 hung");
    assert!(!d.status.success());
    d.assert_stderr_has(
        "rank 0",
        "waiting for ranks [1] to register (registered: [0])",
    );
}

#[test]
fn bad_environments_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let args = run_args(tmp.path(), "tp=2", 1);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let full = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let without = |var: &str| -> Vec<(&str, &str)> {
        full.iter().copied().filter(|(k, _)| *k != var).collect()
    };
    let with = |var: &'static str, value: &'static str| -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = full.iter().copied().filter(|(k, _)| *k != var).collect();
        v.push((var, value));
        v
    };
    for var in ["WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"] {
        fails_with_env(&args, &without(var), &[&format!("{var} is not set")]);
    }
    for (var, value, needles) in [
        ("RANK", "one", &["RANK=`one`", "non-negative integer"][..]),
        ("RANK", "2", &["RANK=`2`", "below WORLD_SIZE=2"]),
        ("MASTER_PORT", "http", &["MASTER_PORT=`http`", "TCP port"]),
        (
            "WORLD_SIZE",
            "4",
            &["mesh tp=2 has 2 ranks but WORLD_SIZE is 4"],
        ),
    ] {
        fails_with_env(&args, &with(var, value), needles);
    }
    let no_mesh: Vec<&str> = args
        .iter()
        .copied()
        .filter(|a| *a != "--mesh" && *a != "tp=2")
        .collect();
    fails_with_env(&no_mesh, &full, &["rank 0 of 2", "no --mesh"]);
    // A one-rank world connects to itself; then the test hook rejects an unknown mode.
    let one = run_args(tmp.path(), "tp=1", 10);
    let one: Vec<&str> = one.iter().map(String::as_str).collect();
    let port = free_port().to_string();
    fails_with_env(
        &one,
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port),
            ("SHARDC_TEST_FAIL_RANK", "0"),
            ("SHARDC_TEST_FAIL_MODE", "explode"),
        ],
        &["SHARDC_TEST_FAIL_MODE must be `exit` or `hang`", "explode"],
    );
}

#[test]
fn bad_launcher_arguments_are_named() {
    let run = ["--", "run", "x", "--tokens", "t", "--out", "o"];
    let launch = |extra: &[&str]| -> Vec<String> {
        ["launch"]
            .iter()
            .chain(extra)
            .chain(&run)
            .map(|s| s.to_string())
            .collect()
    };
    let check = |extra: &[&str], needles: &[&str]| {
        let a = launch(extra);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        fails_with_env(&a, &[], needles);
    };
    check(
        &["--nproc-per-node", "0"],
        &["--nproc-per-node must be at least 1"],
    );
    check(
        &[
            "--nproc-per-node",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--master-port",
            "1234",
        ],
        &["--node-rank 2 must be below --nnodes 2"],
    );
    check(
        &["--nproc-per-node", "1", "--nnodes", "2"],
        &["--master-port"],
    );
    // Argument syntax errors are clap's (with a usage hint).
    for (args, needle) in [
        (
            &[
                "launch",
                "--nproc-per-node",
                "1",
                "--timeout",
                "0",
                "--",
                "run",
            ][..],
            "`0` must be a positive number of seconds",
        ),
        (&["launch", "--nproc-per-node", "1"][..], "<COMMAND>"),
    ] {
        let out = shardc().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn a_rank_with_another_plan_is_refused_at_the_rendezvous() {
    // Rank 1 runs with `--strategy sp`, rank 0 without: different programs, which would
    // deadlock or compute garbage together. Both fail at the rendezvous, naming the plans.
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let args = run_args(tmp.path(), "tp=2", TIMEOUT_S);
    let t0 = Instant::now();
    let children: Vec<Child> = (0..2)
        .map(|rank| {
            let mut c = shardc();
            c.args(&args);
            if rank == 1 {
                c.args(["--strategy", "sp"]);
            }
            spawn_rank(&mut c, rank, 2, "127.0.0.1", port)
        })
        .collect();
    let limit = Duration::from_secs(TIMEOUT_S) + SLACK;
    for (rank, c) in children.into_iter().enumerate() {
        let d = wait(c, t0, limit).expect("no rank may hang");
        assert!(!d.status.success(), "rank {rank}: {}", d.stdout);
        assert!(!d.stderr.contains("panicked"), "rank {rank}: {}", d.stderr);
        d.assert_stderr_has(format_args!("rank {rank}"), "joined with plan");
        d.assert_stderr_has(format_args!("rank {rank}"), "same plan");
    }
    assert!(!tmp.path().join("out.json").exists());
}
