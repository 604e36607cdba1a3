//! Every command of the README's `sh` blocks runs as written, in order, in a scratch directory
//! that holds the repository's `models/` and `tests/` (the paths the commands name), with
//! `shardc` on the PATH. Skipped, and why: `cargo test` (this is it), and the multi-node
//! `launch` line whose command is elided (`-- run ...`). The calibration command reads
//! `timings.json`, measurements taken elsewhere: the test writes one.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The commands of the README's `sh` blocks, continuation lines joined, comments dropped.
fn commands(readme: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_sh = false;
    let mut cur = String::new();
    for line in readme.lines() {
        if let Some(tag) = line.strip_prefix("```") {
            in_sh = !in_sh && tag.trim() == "sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let t = line.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(head) => {
                cur.push_str(head);
                cur.push(' ');
            }
            None => {
                cur.push_str(t);
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    out
}

fn link(from: &Path, to: &Path) {
    std::os::unix::fs::symlink(from, to).unwrap();
}

#[test]
fn readme_commands_run_as_written() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let cmds = commands(&readme);
    assert!(cmds.len() > 30, "{cmds:#?}");
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    link(Path::new(env!("CARGO_BIN_EXE_shardc")), &bin.join("shardc"));
    for d in ["models", "tests"] {
        link(&root.join(d), &dir.path().join(d));
    }
    let timings = serde_json::json!({
        "device": "NVIDIA H100 80GB HBM3",
        "gemm": [{"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "seconds": 0.00185}],
    });
    std::fs::write(dir.path().join("timings.json"), timings.to_string()).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut ran = 0;
    for cmd in &cmds {
        if cmd.starts_with("cargo test") || cmd.contains("-- run ...") {
            continue;
        }
        // The first command builds and runs the binary through cargo: the same binary here.
        let cmd = cmd.replace("cargo run --release --", "shardc");
        let out = Command::new("bash")
            .args(["-e", "-o", "pipefail", "-c", &cmd])
            .current_dir(dir.path())
            .env("PATH", &path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "README command failed: {cmd}\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ran += 1;
    }
    assert!(ran + 2 >= cmds.len());
}
