//! `shardc launch` runs a sharded plan in real processes (one per rank, TCP communicators)
//! and reproduces, bit for bit, the same plan on thread ranks, and transformers' logits within
//! 1e-4; ranks started by hand with torchrun's variables do the same.

mod common;

use shardc::runtime::Tensor;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

use common::shardc_clean as shardc;

fn ok(out: Output, what: &str) -> (String, String) {
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{o}\n{e}",
        out.status
    );
    (o, e)
}

fn case() -> common::Case {
    common::cases()
        .into_iter()
        .find(|c| c.model == "llama" && c.name == "reference_b2_s16")
        .expect("fixture llama reference_b2_s16")
}

fn llama() -> String {
    common::fixtures().join("llama").display().to_string()
}

fn write_tokens(dir: &Path, case: &common::Case) -> String {
    let p = dir.join("ids.json");
    std::fs::write(&p, case.json["input_ids"].to_string()).unwrap();
    p.display().to_string()
}

/// Logits and hidden states of an `--out` file, as the executor's outputs.
fn read_out(path: &Path) -> BTreeMap<String, Tensor> {
    let v = common::read_json(path);
    let t = |name: &str| {
        let shape = v[format!("{name}_shape")]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let data = v[name]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        Tensor::f32(shape, data)
    };
    BTreeMap::from([
        ("logits".to_string(), t("logits")),
        ("hidden".to_string(), t("hidden")),
    ])
}

/// The thread-rank run of the same plan.
fn thread_run(dir: &Path, tokens: &str, mesh: &str) -> BTreeMap<String, Tensor> {
    let out = dir.join(format!("threads-{mesh}.json"));
    let o = shardc()
        .args(["run", &llama(), "--tokens", tokens, "--mesh", mesh, "--out"])
        .arg(&out)
        .output()
        .unwrap();
    ok(o, "thread-rank run");
    read_out(&out)
}

/// Every rank's `job <hex>` (the rendezvous' bootstrap bytes) from the ranks' stdout.
fn job_ids(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|l| l.split("job ").nth(1))
        .map(|rest| {
            rest.chars()
                .take_while(char::is_ascii_hexdigit)
                .collect::<String>()
        })
        .collect()
}

fn check_launch(nproc: usize, mesh: &str) {
    let case = case();
    let tmp = tempfile::tempdir().unwrap();
    let tokens = write_tokens(tmp.path(), &case);
    let out = tmp.path().join("launched.json");
    let o = shardc()
        .args(["launch", "--nproc-per-node", &nproc.to_string(), "--"])
        .args(["run", &llama(), "--tokens", &tokens, "--mesh", mesh])
        .args(["--backend", "cpu", "--comm-timeout", "60", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let (stdout, _) = ok(o, &format!("launch {nproc} × {mesh}"));
    // Every rank ran, in its own process, and printed through the launcher's prefix.
    for r in 0..nproc {
        assert!(
            stdout.contains(&format!("[rank {r}] ")),
            "no output of rank {r}:\n{stdout}"
        );
    }
    assert!(
        stdout.contains(&format!("as rank 0 of {nproc} processes (tcp")),
        "{stdout}"
    );
    // The rendezvous handed every rank the same bootstrap bytes (16 random bytes).
    let ids = job_ids(&stdout);
    assert_eq!(ids.len(), nproc, "{stdout}");
    assert_eq!(ids[0].len(), 32, "{stdout}");
    assert!(ids.iter().all(|j| j == &ids[0]), "{ids:?}");

    let launched = read_out(&out);
    case.check(&launched, &format!("launch {nproc} × {mesh}"));
    // Same algorithms, same reduction order: bit-identical to the thread ranks.
    let threads = thread_run(tmp.path(), &tokens, mesh);
    for name in ["logits", "hidden"] {
        assert_eq!(
            launched[name].as_f32().unwrap(),
            threads[name].as_f32().unwrap(),
            "{name}: launched {mesh} differs from thread ranks"
        );
    }
}

#[test]
fn launch_tp2_matches_thread_ranks_and_transformers() {
    check_launch(2, "tp=2");
}

#[test]
fn launch_dp2_tp2_matches_thread_ranks_and_transformers() {
    check_launch(4, "dp=2,tp=2");
}

/// Context parallelism in processes: the head-tail order's permutations and the K/V
/// all-gathers over cp run as on thread ranks.
#[test]
fn launch_dp2_cp2_matches_thread_ranks_and_transformers() {
    check_launch(4, "dp=2,cp=2");
}

/// Ranks started by another launcher (here by hand, as torchrun would) with the variables.
#[test]
fn ranks_started_with_torchrun_variables() {
    let case = case();
    let tmp = tempfile::tempdir().unwrap();
    let tokens = write_tokens(tmp.path(), &case);
    let out = tmp.path().join("out.json");
    let port = common::free_port();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut c = shardc();
            c.args(["run", &llama(), "--tokens", &tokens, "--mesh", "tp=2"])
                .args(["--comm-timeout", "60", "--out"])
                .arg(&out)
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", "2");
            common::spawn_rank(&mut c, rank, 2, "localhost", port)
        })
        .collect();
    let mut outs = Vec::new();
    for (rank, c) in children.into_iter().enumerate() {
        let (o, _) = ok(c.wait_with_output().unwrap(), &format!("rank {rank}"));
        outs.push(o);
    }
    assert!(outs[1].contains("rank 1 (tp=1) of 2 done"), "{}", outs[1]);
    assert_eq!(job_ids(&outs[0]), job_ids(&outs[1]));
    case.check(&read_out(&out), "torchrun-style tp=2");
}

/// A launched rank under `--backend cuda` runs on the GPU of its `LOCAL_RANK`. Before any
/// rendezvous it fails with one clear line: without a driver, naming `--backend cpu`; with one,
/// for a local rank past the node's GPUs, naming the rank and `--nproc-per-node`.
#[test]
fn cuda_ranks_open_the_gpu_of_their_local_rank() {
    let case = case();
    let tmp = tempfile::tempdir().unwrap();
    let tokens = write_tokens(tmp.path(), &case);
    let out = tmp.path().join("out.json").display().to_string();
    let port = common::free_port().to_string();
    let run = |local_rank: usize, needles: &[&str]| {
        let local = local_rank.to_string();
        let env = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", local.as_str()),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", port.as_str()),
        ];
        let args = [
            "run",
            &llama(),
            "--tokens",
            &tokens,
            "--mesh",
            "tp=2",
            "--backend",
            "cuda",
            "--out",
            &out,
        ];
        common::fails_with_env(&args, &env, needles);
    };
    match shardc::runtime::cuda::cuda_device_count() {
        Ok(n) => run(n, &["rank 1 is local rank", "--nproc-per-node"]),
        Err(e) => {
            assert!(e.is_unavailable(), "{e}");
            run(1, &["--backend cpu"]);
        }
    }
    assert!(!Path::new(&out).exists(), "no output written");
}
