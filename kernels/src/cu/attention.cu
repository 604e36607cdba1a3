// attention.cu: fused attention, flash-attention style (tiled over keys, online softmax),
// scalar f32 FMA path (no tensor cores), f32 accumulation.
//
// attention_{f32,bf16}(const T* q,          // [B, Tq, Hq, D]
//                      const T* k,          // [B, S, Hkv, D]
//                      const T* v,          // [B, S, Hkv, D]
//                      T* out,              // [B, Tq, Hq, D]
//                      const float* mask,   // [B, S] f32, 1 keep / 0 drop; null = keep all
//                      int batch, int seq_q, int seq_k, int heads_q, int heads_kv,
//                      int head_dim,        // 1..=256
//                      float scale,         // usually 1/sqrt(D)
//                      int causal,          // nonzero: query t sees keys s <= t + q_offset
//                      int window,          // > 0: query t sees keys s with t + q_offset - s < window
//                      int q_offset)        // absolute position of query 0 (0 for prefill,
//                                           // S - 1 when decoding one token against a cache)
// out[b,t,h] = softmax_s(q[b,t,h] . k[b,s,h/(Hq/Hkv)] * scale over visible s) . v[b,s,...]
// (GQA: query head h reads KV head h / (Hq / Hkv); Hq must be a multiple of Hkv).
// A query with no visible key outputs zeros.
// attention_lse_{f32,bf16}: the same with a trailing `float* lse` ([B, Tq, Hq] f32), each query's
// log-sum-exp of its scaled visible scores (-inf when none), for the backward (attention_bwd.cu).
//
// Launch (exactly): blockDim = (128, 1, 1); gridDim = (ceil(Tq / 16), Hq, B);
// dynamic shared memory = (16 + 32) * ceil32(D) * 4 bytes (<= 48 KiB, so no opt-in needed).
// Each block owns 16 queries of one (b, h); each of its 4 warps owns 4 queries. The tiling is
// attention.cuh's, which attention_decode.cu (the split-KV decode path) shares.
// A launch with another block size or an out-of-range head_dim traps (a loud error, not
// silently wrong output); the host-side launch helper validates first.
#include "common.cuh"
#include "attention.cuh"

template <typename T>
__device__ __forceinline__ void attention_impl(const T* q, const T* k, const T* v, T* out,
                                               const float* mask, int batch, int seq_q,
                                               int seq_k, int heads_q, int heads_kv,
                                               int head_dim, float scale, int causal, int window,
                                               int q_offset, float* lse) {
    attn_check_launch(head_dim, heads_q, heads_kv);
    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int t0 = blockIdx.x * ATTN_BLOCK_Q;
    if (b >= batch || h >= heads_q || t0 >= seq_q) return;  // uniform over the block
    const int hk = h / (heads_q / heads_kv);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nchunk = (head_dim + 31) >> 5;

    float m[ATTN_Q_PER_WARP], l[ATTN_Q_PER_WARP], acc[ATTN_Q_PER_WARP][ATTN_MAX_CHUNKS];
    attn_rows(q, k, v, mask, b, seq_q, seq_k, heads_q, heads_kv, head_dim, scale, causal, window,
              q_offset, hk, h, 1, seq_q, t0, 0, seq_k, m, l, acc);

#pragma unroll
    for (int r = 0; r < ATTN_Q_PER_WARP; ++r) {
        const int t = t0 + warp * ATTN_Q_PER_WARP + r;
        if (t >= seq_q) continue;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        const i64 row = ((i64)b * seq_q + t) * heads_q + h;
        const i64 base = row * head_dim;
        if (lse != nullptr && lane == 0) lse[row] = l[r] > 0.0f ? m[r] + logf(l[r]) : -SHARDC_INF;
#pragma unroll
        for (int c = 0; c < ATTN_MAX_CHUNKS; ++c) {
            const int d = lane + 32 * c;
            if (c < nchunk && d < head_dim) store(out, base + d, acc[r][c] * inv);
        }
    }
}

#define SHARDC_ATTENTION(NAME, T)                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                               \
        NAME(const T* q, const T* k, const T* v, T* out, const float* mask, int batch,       \
             int seq_q, int seq_k, int heads_q, int heads_kv, int head_dim, float scale,     \
             int causal, int window, int q_offset) {                                         \
        attention_impl(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, \
                       scale, causal, window, q_offset, nullptr);                            \
    }

SHARDC_ATTENTION(attention_f32, float)
SHARDC_ATTENTION(attention_bf16, bf16)

// The same forward, also writing each query's log-sum-exp of its scaled scores for the backward
// (attention_bwd.cu): lse [B, Tq, Hq] f32, -inf for a query with no visible key. Same launch.
#define SHARDC_ATTENTION_LSE(NAME, T)                                                        \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                               \
        NAME(const T* q, const T* k, const T* v, T* out, const float* mask, int batch,       \
             int seq_q, int seq_k, int heads_q, int heads_kv, int head_dim, float scale,     \
             int causal, int window, int q_offset, float* lse) {                             \
        attention_impl(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, \
                       scale, causal, window, q_offset, lse);                                \
    }

SHARDC_ATTENTION_LSE(attention_lse_f32, float)
SHARDC_ATTENTION_LSE(attention_lse_bf16, bf16)
