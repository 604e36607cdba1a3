#!/usr/bin/env bash
# Builds what the GPU machine runs (it has no Rust toolchain): `gpu_bench`, the `shardc` CLI and
# every `cuda_*` GPU test binary of shardc-runtime (runtime/tests/cuda_*.rs), release, stripped,
# into .gpu-bin/ at the repository root.
# Run it on any x86-64 machine with the toolchain (no GPU needed), then carry .gpu-bin to the
# GPU machine and run benches/gpu/run_on_device.sh there (see benches/gpu/README.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
out="$root/.gpu-bin"
mkdir -p "$out"
cargo build --release -p shardc-benches --bin gpu_bench
cargo build --release --bin shardc
cp target/release/gpu_bench target/release/shardc "$out/"
for f in runtime/tests/cuda_*.rs; do
    t="$(basename "$f" .rs)"
    exe="$(cargo test --release -p shardc-runtime --test "$t" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' | tail -n 1)"
    [[ -n "$exe" ]] || { echo "build.sh: no executable for test $t" >&2; exit 1; }
    cp "$exe" "$out/$t"
done
strip "$out"/* 2>/dev/null || true
du -sh "$out"
echo "built into $out; keep it out of git (e.g. echo /.gpu-bin/ >> .git/info/exclude) and carry it"
