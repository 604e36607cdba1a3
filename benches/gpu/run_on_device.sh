#!/usr/bin/env bash
# On the GPU machine, from the repository root: finds libnvrtc/libcublasLt/libnccl (CUDA
# toolkit or pip wheels), then runs the GPU tests, gpu_bench and torch_peer.py. Logs and tables
# go to $OUT (the device tool's output folder) or /tmp/shardc-gpu.
#
#   bash benches/gpu/run_on_device.sh [all|test|cli|bench] [--quick]
#
# `cli` (part of `test`): `shardc run` and `shardc train` with --backend cuda against --backend
# cpu on the hf-tiny fixtures, unsharded and on tp=2 virtual ranks (logits within 1e-3,
# losses within 1e-4, f32), and 5 training steps with --cuda-graphs against eager ones (the
# same printed losses).
#
# Binaries come from .gpu-bin/ (benches/gpu/build.sh), or $SHARDC_GPU_BIN.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
what="${1:-all}"
quick="${2:-}"
out="${OUT:-/tmp/shardc-gpu}"
bin="${SHARDC_GPU_BIN:-$root/.gpu-bin}"
mkdir -p "$out"

# Libraries. cudarc dlopens libnvrtc.so.13 / libcublasLt.so.13 (CUDA 13) and libnccl.so
# (the unversioned name: the wheel only ships libnccl.so.2, so link it).
libs=/tmp/shardc-libs
mkdir -p "$libs"
site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)"
paths=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    "$site/nvidia/cu13/lib" "$site/nvidia/cublas/lib" "$site/nvidia/cuda_nvrtc/lib" \
    "$site/nvidia/nccl/lib"; do
    [[ -d "$d" ]] && paths+=("$d")
done
nccl="$(ls "$site"/nvidia/nccl/lib/libnccl.so* /usr/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null | head -n 1)"
[[ -n "$nccl" ]] && ln -sf "$nccl" "$libs/libnccl.so"
joined="$(IFS=:; echo "${paths[*]}")"
export LD_LIBRARY_PATH="$libs${joined:+:$joined}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SHARDC_CACHE_DIR=/tmp/shardc-cache
export SHARDC_FIXTURES="$root/tests/fixtures/hf-tiny"
{
    nvidia-smi -L || true
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "libnccl: ${nccl:-not found}"
    python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' 2>/dev/null || true
} 2>&1 | tee "$out/env.txt"

status=0
if [[ "$what" == all || "$what" == test ]]; then
    # Every GPU test binary build.sh made; cuda_nccl below, with its environment.
    for exe in "$bin"/cuda_*; do
        t="$(basename "$exe")"
        [[ "$t" == cuda_nccl ]] && continue
        "$exe" --include-ignored --test-threads=1 2>&1 | tee "$out/$t.log" || status=1
    done
    # Two NCCL ranks on one GPU need NCCL >= 2.30 and this variable (NOTES-cuda.md §5.2).
    NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS="${NCCL_MAX_CTAS:-4}" \
        "$bin/cuda_nccl" --include-ignored --test-threads=1 2>&1 | tee "$out/cuda_nccl.log" || status=1
fi
if [[ "$what" == all || "$what" == test || "$what" == cli ]]; then
    cli="$out/cli"
    mkdir -p "$cli"
    {
        for model in llama gpt2 mixtral; do
            dir="tests/fixtures/hf-tiny/$model"
            python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["input_ids"]))' \
                "$dir/reference_b2_s16.json" >"$cli/$model-ids.json"
            for mesh in "" "--mesh tp=2"; do
                tag="$model${mesh:+-tp2}"
                for backend in cpu cuda; do
                    "$bin/shardc" run "$dir" --tokens "$cli/$model-ids.json" $mesh --backend "$backend" \
                        --out "$cli/$tag-$backend.json" --overwrite || echo "$tag run $backend" >>"$cli/failed"
                    "$bin/shardc" train "$dir" --tokens "$cli/$model-ids.json" $mesh --steps 3 \
                        --backend "$backend" >"$cli/$tag-$backend-train.txt" || echo "$tag train $backend" >>"$cli/failed"
                done
                python3 - "$cli/$tag" <<'PY'
import json, re, sys
tag = sys.argv[1]
a, b = (json.load(open(f"{tag}-{x}.json")) for x in ("cpu", "cuda"))
flat = lambda v: [x for r in v for x in (flat(r) if isinstance(r, list) else [r])]
d = max(abs(x - y) for x, y in zip(flat(a["logits"]), flat(b["logits"])))
loss = lambda x: [float(m) for m in re.findall(r"loss ([-0-9.e]+)", open(f"{tag}-{x}-train.txt").read())]
la, lb = loss("cpu"), loss("cuda")
dl = max(abs(x - y) for x, y in zip(la, lb)) if la and len(la) == len(lb) else float("inf")
ok = d < 1e-3 and dl < 1e-4
print(f"{tag}: run max |dlogit| {d:.2e}, train losses cpu {la} cuda {lb} (max diff {dl:.2e}): {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
                [[ $? -eq 0 ]] || echo "$tag compare" >>"$cli/failed"
            done
            # Five steps eager and with --cuda-graphs (steps 3-5 replayed): the same losses.
            for graphs in "" "--cuda-graphs"; do
                "$bin/shardc" train "$dir" --tokens "$cli/$model-ids.json" --steps 5 --backend cuda \
                    $graphs >"$cli/$model-graphs${graphs:+-on}.txt" || echo "$model train $graphs" >>"$cli/failed"
            done
            a="$(grep -o 'loss [-0-9.e]*' "$cli/$model-graphs.txt")"
            b="$(grep -o 'loss [-0-9.e]*' "$cli/$model-graphs-on.txt")"
            if [[ -n "$a" && "$a" == "$b" ]]; then
                echo "$model: 5 training steps with --cuda-graphs print the eager losses: ok"
            else
                echo "$model: --cuda-graphs losses [$b] differ from eager [$a]: FAILED"
                echo "$model graphs compare" >>"$cli/failed"
            fi
        done
    } 2>&1 | tee "$out/cli.log"
    # The block ran in a pipeline's subshell: its failures come back through this file.
    [[ -s "$cli/failed" ]] && status=1
fi
if [[ "$what" == all || "$what" == bench ]]; then
    "$bin/gpu_bench" $quick 2>&1 | tee "$out/gpu_bench.txt" || status=1
    PYTHONUNBUFFERED=1 python3 benches/gpu/torch_peer.py $quick 2>&1 | tee "$out/torch_peer.txt" || status=1
fi
exit $status
