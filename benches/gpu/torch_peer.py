#!/usr/bin/env python3
"""PyTorch peer of shardc's `gpu_bench`: the same sections, shapes, dtypes and table columns,
for PyTorch eager and torch.compile (SDPA for attention).

    python3 benches/gpu/torch_peer.py [--quick] [--only SECTION] [--no-compile]

Rows: section, case, dtype, shape, ms (CUDA events, per call after warm-up), metric, value,
% of the section's ceiling (the device-to-device copy for memory-bound rows, the 8192^3 bf16
GEMM for the others). Memory-bound GB/s are *effective*: the minimal bytes the op must move
(the same accounting as gpu_bench), divided by the time. Without PyTorch or a GPU it prints
why and exits with status 2.
"""
import argparse
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("torch_peer.py: PyTorch is not installed (python3 -m pip install torch)", file=sys.stderr)
    sys.exit(2)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336
EPS = 1e-5
ROWS = []
CEIL = {"copy": 0.0, "gemm": 0.0}


def timed(fn, iters, warmup=2):
    """Milliseconds per call of `fn` on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def header():
    print(f"{'section':<10} {'case':<28} {'dtype':<5} {'shape':<22} {'ms':>10} {'metric':>8} {'value':>10} {'% ceil':>9}")


def row(section, case, dtype, shape, ms, metric, value, ceiling):
    pct = "-" if ceiling is None else f"{ceiling:.1f}"
    print(f"{section:<10} {case:<28} {dtype:<5} {shape:<22} {ms:>10.4f} {metric:>8} {value:>10.1f} {pct:>9}", flush=True)
    ROWS.append((section, case, dtype, shape, ms, metric, value, ceiling))


def pct(v, c):
    return None if c <= 0 else 100.0 * v / c


def variants(fn, compile_ok):
    """(label, callable) for eager and, when enabled, torch.compile."""
    out = [("eager", fn)]
    if compile_ok:
        out.append(("compile", torch.compile(fn, dynamic=False)))
    return out


def rms_norm(x, w):
    # HF LlamaRMSNorm: f32 statistics, cast back.
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def llama3_inv_freq(device):
    import math
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device=device) / HEAD_DIM))
    factor, lo, hi, old = 8.0, 1.0, 4.0, 8192.0
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old / lo, old / hi
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def rope(q, pos, inv_freq):
    freqs = pos[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, :, None, :].to(q.dtype), emb.sin()[:, :, None, :].to(q.dtype)
    return q * cos + rotate_half(q) * sin


def sec_copy(a):
    nbytes = (256 if a.quick else 512) << 20
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), 50 if not a.quick else 3)
    gbs = 2 * nbytes / (ms * 1e-3) / 1e9
    CEIL["copy"] = gbs
    row("copy", "device-to-device", "bf16", f"{nbytes >> 20} MiB", ms, "GB/s", gbs, 100.0)


def membound_tokens(a, bytes_per_token):
    """The fewest tokens (a power of two) moving >= 256 MiB, as gpu_bench picks them."""
    if a.quick:
        return 1024
    n = -(-(256 << 20) // bytes_per_token)
    return 1 << (n - 1).bit_length()


def sec_membound(a):
    it = 3 if a.quick else 50
    bf = torch.bfloat16
    t = membound_tokens(a, 4 * HIDDEN * 2)
    x = torch.randn(1, t, HIDDEN, device="cuda", dtype=bf)
    r = torch.randn_like(x)
    w = torch.randn(HIDDEN, device="cuda", dtype=bf)

    def add_rms():
        s = x + r
        return s, rms_norm(s, w)

    bytes_ = 4 * t * HIDDEN * 2
    for label, fn in variants(add_rms, a.compile):
        ms = timed(fn, it)
        gbs = bytes_ / (ms * 1e-3) / 1e9
        row("membound", f"add+rmsnorm {label}", "bf16", f"[{t},{HIDDEN}]", ms, "GB/s", gbs, pct(gbs, CEIL["copy"]))
    t = membound_tokens(a, 3 * FFN * 2)
    gate = torch.randn(1, t, FFN, device="cuda", dtype=bf)
    up = torch.randn_like(gate)
    bytes_ = 3 * t * FFN * 2
    for label, fn in variants(lambda: F.silu(gate) * up, a.compile):
        ms = timed(fn, it)
        gbs = bytes_ / (ms * 1e-3) / 1e9
        row("membound", f"swiglu {label}", "bf16", f"[{t},{FFN}]", ms, "GB/s", gbs, pct(gbs, CEIL["copy"]))
    t = membound_tokens(a, 2 * HEADS * HEAD_DIM * 2)
    q = torch.randn(1, t, HEADS, HEAD_DIM, device="cuda", dtype=bf)
    pos = torch.arange(t, device="cuda")[None, :]
    inv = llama3_inv_freq("cuda")
    bytes_ = 2 * t * HEADS * HEAD_DIM * 2
    for label, fn in variants(lambda: rope(q, pos, inv), a.compile):
        ms = timed(fn, it)
        gbs = bytes_ / (ms * 1e-3) / 1e9
        row("membound", f"rope {label}", "bf16", f"[{t},{HEADS},{HEAD_DIM}]", ms, "GB/s", gbs, pct(gbs, CEIL["copy"]))
    rows = membound_tokens(a, 2 * 4096 * 2)
    s = torch.randn(rows, 4096, device="cuda", dtype=bf) * 4
    bytes_ = 2 * rows * 4096 * 2
    for label, fn in variants(lambda: torch.softmax(s, dim=-1), a.compile):
        ms = timed(fn, it)
        gbs = bytes_ / (ms * 1e-3) / 1e9
        row("membound", f"softmax {label}", "bf16", f"[{rows},4096]", ms, "GB/s", gbs, pct(gbs, CEIL["copy"]))


def gemm_case(m, k, n, dtype, it):
    a_ = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
    ms = timed(lambda: a_ @ w.t(), it)
    return ms, 2 * m * n * k / (ms * 1e-3) / 1e12


def sec_gemm(a):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    it = 3 if a.quick else 10
    big = 4096 if a.quick else 8192
    ms, tf = gemm_case(big, big, big, torch.bfloat16, it)
    CEIL["gemm"] = tf
    row("gemm", "ceiling", "bf16", f"{big}x{big}x{big}", ms, "TFLOP/s", tf, 100.0)
    t = 1024 if a.quick else 4096
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    for name, n, k in [("qkv_proj", qkv, HIDDEN), ("o_proj", HIDDEN, HIDDEN), ("gate_up_proj", 2 * FFN, HIDDEN), ("down_proj", HIDDEN, FFN)]:
        ms, tf = gemm_case(t, k, n, torch.bfloat16, it)
        row("gemm", name, "bf16", f"{t}x{k}x{n}", ms, "TFLOP/s", tf, pct(tf, CEIL["gemm"]))
    f = 1024 if a.quick else 4096
    ms, tf = gemm_case(f, f, f, torch.float32, it)
    row("gemm", "fp32 (no TF32)", "f32", f"{f}x{f}x{f}", ms, "TFLOP/s", tf, None)


def sec_attention(a):
    lens = [1024] if a.quick else [4096, 16384]
    it = 3 if a.quick else 10
    for t in lens:
        q = torch.randn(1, HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ms = timed(fn, it)
        tf = 2 * HEADS * t * t * HEAD_DIM / (ms * 1e-3) / 1e12
        row("attention", f"sdpa causal {t // 1024}k", "bf16", f"1x{t} h{HEADS}/{KV_HEADS} d{HEAD_DIM}", ms, "TFLOP/s", tf, pct(tf, CEIL["gemm"]))
    # The backward alone (SDPA's flash backward, from the saved output and log-sum-exp), 2.5x
    # the causal forward's FLOPs as FlashAttention-2 counts it; gpu_bench's bwd rows include
    # its recomputed forward.
    for t in lens:
        q = torch.randn(1, HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, KV_HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, KV_HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        dout = torch.randn_like(out)
        fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        ms = timed(fn, it)
        tf = 2.5 * 2 * HEADS * t * t * HEAD_DIM / (ms * 1e-3) / 1e12
        row("attention", f"sdpa bwd causal {t // 1024}k", "bf16", f"1x{t} h{HEADS}/{KV_HEADS} d{HEAD_DIM}", ms, "TFLOP/s", tf, pct(tf, CEIL["gemm"]))
        # Forward and backward, as a training step runs them (gpu_bench's fwd+bwd rows: the
        # backward reads the forward's output and lse), 3.5x the causal forward's FLOPs.
        def fwd_bwd():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return torch.autograd.grad(o, (q, k, v), dout)
        ms = timed(fwd_bwd, it)
        tf = 3.5 * 2 * HEADS * t * t * HEAD_DIM / (ms * 1e-3) / 1e12
        row("attention", f"sdpa fwd+bwd causal {t // 1024}k", "bf16", f"1x{t} h{HEADS}/{KV_HEADS} d{HEAD_DIM}", ms, "TFLOP/s", tf, pct(tf, CEIL["gemm"]))


class LlamaLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
        self.q, self.k, self.v = lin(HIDDEN, HEADS * HEAD_DIM), lin(HIDDEN, KV_HEADS * HEAD_DIM), lin(HIDDEN, KV_HEADS * HEAD_DIM)
        self.o = lin(HEADS * HEAD_DIM, HIDDEN)
        self.gate, self.up, self.down = lin(HIDDEN, FFN), lin(HIDDEN, FFN), lin(FFN, HIDDEN)
        self.ln1 = torch.nn.Parameter(torch.ones(HIDDEN))
        self.ln2 = torch.nn.Parameter(torch.ones(HIDDEN))
        self.register_buffer("inv", llama3_inv_freq("cpu"))

    def forward(self, x, pos):
        b, t, _ = x.shape
        n = rms_norm(x, self.ln1)
        q = rope(self.q(n).view(b, t, HEADS, HEAD_DIM), pos, self.inv).transpose(1, 2)
        k = rope(self.k(n).view(b, t, KV_HEADS, HEAD_DIM), pos, self.inv).transpose(1, 2)
        v = self.v(n).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + self.o(a.transpose(1, 2).reshape(b, t, HIDDEN))
        n2 = rms_norm(h, self.ln2)
        return h + self.down(F.silu(self.gate(n2)) * self.up(n2))


def sec_layer(a):
    t = 1024 if a.quick else 4096
    it = 3 if a.quick else 10
    layer = LlamaLayer().to("cuda", torch.bfloat16)
    x = torch.randn(1, t, HIDDEN, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t, device="cuda")[None, :]
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    flops = 2 * t * (HIDDEN * qkv + HIDDEN * HIDDEN + 3 * HIDDEN * FFN) + 2 * HEADS * t * t * HEAD_DIM
    with torch.no_grad():
        for label, fn in variants(lambda: layer(x, pos), a.compile):
            ms = timed(fn, it)
            tf = flops / (ms * 1e-3) / 1e12
            row("layer", f"llama-3-8b layer {label}", "bf16", f"1x{t}", ms, "TFLOP/s", tf, pct(tf, CEIL["gemm"]))


MOE_EXPERTS, MOE_TOP_K = 8, 2


def moe_routed(x, logits, w1, w3, w2):
    """Mixtral's sparse MoE block as transformers runs it: top-2 of softmax, renormalised, then
    per expert the routed tokens gathered, the SwiGLU expert applied, scattered back weighted."""
    probs = torch.softmax(logits.float(), dim=-1)
    gate, sel = torch.topk(probs, MOE_TOP_K, dim=-1)
    gate = (gate / gate.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(MOE_EXPERTS):
        idx, slot = torch.where(sel == e)
        if idx.numel() == 0:
            continue
        h = x[idx]
        y = (F.silu(h @ w1[e].T) * (h @ w3[e].T)) @ w2[e].T
        out.index_add_(0, idx, y * gate[idx, slot, None])
    return out


def moe_dense(x, logits, w1, w3, w2):
    """The same block with every expert over every token (zero gates off the top 2)."""
    probs = torch.softmax(logits.float(), dim=-1)
    gate, sel = torch.topk(probs, MOE_TOP_K, dim=-1)
    gate = gate / gate.sum(dim=-1, keepdim=True)
    dense = torch.zeros_like(probs).scatter(-1, sel, gate).to(x.dtype)  # [t, E]
    h = F.silu(torch.einsum("th,efh->etf", x, w1)) * torch.einsum("th,efh->etf", x, w3)
    y = torch.einsum("etf,ehf->eth", h, w2)
    return torch.einsum("eth,te->th", y, dense)


def sec_moe(a):
    t = 1024 if a.quick else 4096
    it = 3 if a.quick else 10
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, HIDDEN, **kw)
    logits = 2 * torch.randn(t, MOE_EXPERTS, **kw)
    w1 = 0.02 * torch.randn(MOE_EXPERTS, FFN, HIDDEN, **kw)
    w3 = 0.02 * torch.randn(MOE_EXPERTS, FFN, HIDDEN, **kw)
    w2 = 0.02 * torch.randn(MOE_EXPERTS, HIDDEN, FFN, **kw)
    flops = 2 * t * MOE_TOP_K * 3 * HIDDEN * FFN  # the routed work, as gpu_bench counts it
    with torch.no_grad():
        for label, fn in [("routed eager", moe_routed), ("dense eager", moe_dense)]:
            ms = timed(lambda: fn(x, logits, w1, w3, w2), it)
            tf = flops / (ms * 1e-3) / 1e12
            row("moe", f"mixtral experts {label}", "bf16", f"1x{t}", ms, "TFLOP/s", tf, pct(tf, CEIL["gemm"]))


SECTIONS = [
    ("copy", sec_copy),
    ("membound", sec_membound),
    ("gemm", sec_gemm),
    ("attention", sec_attention),
    ("layer", sec_layer),
    ("moe", sec_moe),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--only", choices=[s for s, _ in SECTIONS], help="one section (plus the ceiling it needs)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile variants")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("torch_peer.py: no CUDA device visible to PyTorch; run it on the GPU machine (benches/gpu/README.md)", file=sys.stderr)
        sys.exit(2)
    print(f"# torch_peer on {torch.cuda.get_device_name()} (torch {torch.__version__}), {'quick shapes' if a.quick else 'Llama-3-8B shapes'}")
    header()
    needs = {"membound": "copy", "attention": "gemm", "layer": "gemm", "moe": "gemm"}
    failed = False
    for name, fn in SECTIONS:
        if a.only and name != a.only and needs.get(a.only) != name:
            continue
        try:
            fn(a)
        except Exception as e:  # report and go on with the next section
            print(f"torch_peer.py: section {name} failed: {e}", file=sys.stderr)
            failed = True
    print(f"# {len(ROWS)} rows ('overlap' has no PyTorch peer: it needs shardc's local-gpu ranks)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
