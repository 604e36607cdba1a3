#!/usr/bin/env bash
# Runs the kernels on the CPU under a small SIMT emulation (shim.h: one thread per CUDA thread,
# barriers for __syncthreads and warp shuffles) and checks them against double-precision
# references (test.cpp). No GPU or CUDA needed, only g++ >= 12 (C++20 <barrier>).
# It checks indexing and algorithms, not GPU-specific behaviour (memory model, timing):
# the GPU tests remain the authority.
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
g++ -std=c++20 -O1 -pthread -w -I "$work" -I "$here" -o "$work/emu" "$here/test.cpp"
"$work/emu"
