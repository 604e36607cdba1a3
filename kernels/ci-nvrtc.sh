#!/usr/bin/env bash
# Installs NVRTC for CUDA 13.0 from PyPI into DIR (idempotent) and prints the LD_LIBRARY_PATH
# value to use (DIR's lib directory, then any existing LD_LIBRARY_PATH). No GPU or driver needed.
#
#   export LD_LIBRARY_PATH="$(kernels/ci-nvrtc.sh /tmp/nvrtc)"
#   SHARDC_REQUIRE_NVRTC=1 cargo test -p shardc-kernels
#
# The versions match cudarc's `cuda-13000` bindings (libnvrtc.so.13); nvidia-cuda-runtime brings
# the CUDA 13.0 headers (cuda_bf16.h, ...) for anyone who needs them. The kernels themselves
# include no CUDA header. Progress goes to stderr; stdout carries only the path.
set -euo pipefail

dir="${1:?usage: $0 DIR}"
nvrtc_version="13.0.88"
runtime_version="13.0.96"
lib="$dir/nvidia/cu13/lib"

installed() {
    [[ -e "$lib/libnvrtc.so.13" && -e "$lib/libnvrtc-builtins.so.13.0" ]] &&
        [[ -d "$dir/nvidia_cuda_nvrtc-$nvrtc_version.dist-info" ]] &&
        [[ -d "$dir/nvidia_cuda_runtime-$runtime_version.dist-info" ]]
}

if ! installed; then
    pip="${PIP:-python3 -m pip}"
    $pip install --quiet --disable-pip-version-check --no-deps --upgrade --target "$dir" \
        "nvidia-cuda-nvrtc==$nvrtc_version" "nvidia-cuda-runtime==$runtime_version" >&2
    installed || { echo "ci-nvrtc.sh: install into $dir did not produce $lib/libnvrtc.so.13" >&2; exit 1; }
fi

echo "$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
