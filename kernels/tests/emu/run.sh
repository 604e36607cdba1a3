#!/usr/bin/env bash
# Runs the kernels on the CPU under a small SIMT emulation (shim.h: one thread per CUDA thread,
# barriers for __syncthreads and warp shuffles) and checks them against double-precision
# references. Each test*.cpp is its own program (check.h holds their shared helpers); every one
# is built and run, and the script fails if any of them does. No GPU or CUDA needed, only
# g++ >= 12 (C++20 <barrier>). It checks indexing and algorithms, not GPU-specific behaviour
# (memory model, timing): the GPU tests remain the authority.
# Usage: run.sh [NAME ...] runs only test_NAME.cpp (or test.cpp for `test`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/cu"
# The runtime's own data-movement kernels (layout.cu) run here too.
for f in "$here"/../../src/cu/* "$here"/../../../runtime/src/cuda/layout.cu; do
    # Dynamic shared memory becomes a static buffer in the emulation.
    sed 's/extern __shared__ float smem\[\];/float* smem = g_smem;/' "$f" >"$work/cu/$(basename "$f")"
done
if [ "$#" -gt 0 ]; then
    tests=()
    for n in "$@"; do
        if [ "$n" = test ]; then tests+=("$here/test.cpp"); else tests+=("$here/test_$n.cpp"); fi
    done
else
    tests=("$here"/test*.cpp)
fi
failed=0
for t in "${tests[@]}"; do
    name="$(basename "$t" .cpp)"
    g++ -std=c++20 -O1 -pthread -w -I "$work" -I "$here" -o "$work/$name" "$t"
    if ! "$work/$name" >"$work/$name.log" 2>&1; then
        failed=$((failed + 1))
        grep -E '^FAIL|__trap' "$work/$name.log" || true
    fi
    printf '%-24s %s\n' "$name" "$(tail -n 1 "$work/$name.log")"
done
echo "$failed program(s) failed of ${#tests[@]}"
[ "$failed" -eq 0 ]
