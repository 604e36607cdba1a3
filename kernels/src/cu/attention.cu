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
// Each block owns 16 queries of one (b, h); each of its 4 warps owns 4 queries. Key tiles of 32
// rows go through shared memory; in the score phase lane j owns key j of the tile, in the PV
// phase lane l owns dims l, l+32, ... Tiles are stored with an XOR swizzle (column d of row j
// at j*Dp + (d ^ j)), which keeps both phases free of bank conflicts without padding.
// A launch with another block size or an out-of-range head_dim traps (a loud error, not
// silently wrong output); the host-side launch helper validates first.
#include "common.cuh"

#define ATTN_BLOCK_Q 16
#define ATTN_BLOCK_K 32
#define ATTN_THREADS 128
#define ATTN_Q_PER_WARP 4
#define ATTN_MAX_CHUNKS 8  // head_dim <= 8 * 32

template <typename T>
__device__ __forceinline__ void attention_impl(const T* q, const T* k, const T* v, T* out,
                                               const float* mask, int batch, int seq_q,
                                               int seq_k, int heads_q, int heads_kv,
                                               int head_dim, float scale, int causal, int window,
                                               int q_offset, float* lse) {
    if (blockDim.x != ATTN_THREADS || head_dim <= 0 || head_dim > 32 * ATTN_MAX_CHUNKS ||
        heads_kv <= 0 || heads_q % heads_kv != 0) {
        __trap();
    }
    extern __shared__ float smem[];
    const int dp = (head_dim + 31) & ~31;
    const int nchunk = dp >> 5;
    float* q_s = smem;                        // [ATTN_BLOCK_Q][dp], plain layout (broadcast reads)
    float* kv_s = smem + ATTN_BLOCK_Q * dp;   // [ATTN_BLOCK_K][dp], swizzled

    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int t0 = blockIdx.x * ATTN_BLOCK_Q;
    if (b >= batch || h >= heads_q || t0 >= seq_q) return;  // uniform over the block
    const int hk = h / (heads_q / heads_kv);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;

    attn_load_rows(q_s, q, ATTN_BLOCK_Q, t0, seq_q, b, heads_q, h, head_dim, dp, false);

    // Keys any query of this tile can see (block-uniform, so the barriers below are safe).
    const int t_last = min(t0 + ATTN_BLOCK_Q, seq_q) - 1;
    int s_begin = 0;
    int s_end = seq_k;
    if (causal) s_end = min(seq_k, t_last + q_offset + 1);
    if (window > 0) s_begin = max(0, t0 + q_offset - window + 1);

    float m[ATTN_Q_PER_WARP], l[ATTN_Q_PER_WARP], acc[ATTN_Q_PER_WARP][ATTN_MAX_CHUNKS];
#pragma unroll
    for (int r = 0; r < ATTN_Q_PER_WARP; ++r) {
        m[r] = -SHARDC_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < ATTN_MAX_CHUNKS; ++c) acc[r][c] = 0.0f;
    }

    for (int s0 = s_begin; s0 < s_end; s0 += ATTN_BLOCK_K) {
        __syncthreads();  // previous V tile fully consumed (and the q tile written)
        attn_load_rows(kv_s, k, ATTN_BLOCK_K, s0, seq_k, b, heads_kv, hk, head_dim, dp, true);
        __syncthreads();

        // Scores: lane j against key s0 + j, for the warp's 4 queries.
        float dot[ATTN_Q_PER_WARP];
#pragma unroll
        for (int r = 0; r < ATTN_Q_PER_WARP; ++r) dot[r] = 0.0f;
        const float* k_row = kv_s + lane * dp;
        const float* q_rows = q_s + warp * ATTN_Q_PER_WARP * dp;
#pragma unroll 4
        for (int d = 0; d < dp; ++d) {
            const float kd = k_row[d ^ lane];
#pragma unroll
            for (int r = 0; r < ATTN_Q_PER_WARP; ++r) dot[r] += q_rows[r * dp + d] * kd;
        }

        const int s = s0 + lane;
        const bool key_ok = s < s_end && (mask == nullptr || mask[(i64)b * seq_k + s] != 0.0f);
        float p[ATTN_Q_PER_WARP];
#pragma unroll
        for (int r = 0; r < ATTN_Q_PER_WARP; ++r) {
            const int t = t0 + warp * ATTN_Q_PER_WARP + r;
            const int tp = t + q_offset;
            const bool visible = key_ok && t < seq_q && attn_visible(s, tp, causal, window);
            const float score = visible ? dot[r] * scale : -SHARDC_INF;
            const float m_new = fmaxf(m[r], warp_max(score));
            float pr = 0.0f;
            float corr = 1.0f;
            if (m_new != -SHARDC_INF) {  // warp-uniform
                pr = visible ? expf(score - m_new) : 0.0f;
                corr = expf(m[r] - m_new);  // 0 when m[r] was -inf
            }
            l[r] = l[r] * corr + warp_sum(pr);
#pragma unroll
            for (int c = 0; c < ATTN_MAX_CHUNKS; ++c) acc[r][c] *= corr;
            m[r] = m_new;
            p[r] = pr;
        }

        __syncthreads();  // everyone done with the K tile
        attn_load_rows(kv_s, v, ATTN_BLOCK_K, s0, seq_k, b, heads_kv, hk, head_dim, dp, true);
        __syncthreads();

        // acc[r][c] += sum_j p_j * v[j][lane + 32 c]
        for (int j = 0; j < ATTN_BLOCK_K; ++j) {
            float vv[ATTN_MAX_CHUNKS];
#pragma unroll
            for (int c = 0; c < ATTN_MAX_CHUNKS; ++c) {
                vv[c] = c < nchunk ? kv_s[j * dp + ((lane + 32 * c) ^ j)] : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < ATTN_Q_PER_WARP; ++r) {
                const float pj = __shfl_sync(SHARDC_FULL_MASK, p[r], j);
                if (pj != 0.0f) {  // warp-uniform; also keeps 0 * inf out of the sum
#pragma unroll
                    for (int c = 0; c < ATTN_MAX_CHUNKS; ++c) acc[r][c] += pj * vv[c];
                }
            }
        }
    }

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

extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attention_f32(const float* q, const float* k, const float* v, float* out, const float* mask,
                  int batch, int seq_q, int seq_k, int heads_q, int heads_kv, int head_dim,
                  float scale, int causal, int window, int q_offset) {
    attention_impl(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, scale,
                   causal, window, q_offset, nullptr);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attention_bf16(const bf16* q, const bf16* k, const bf16* v, bf16* out, const float* mask,
                   int batch, int seq_q, int seq_k, int heads_q, int heads_kv, int head_dim,
                   float scale, int causal, int window, int q_offset) {
    attention_impl(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, scale,
                   causal, window, q_offset, nullptr);
}

// The same forward, also writing each query's log-sum-exp of its scaled scores for the backward
// (attention_bwd.cu): lse [B, Tq, Hq] f32, -inf for a query with no visible key. Same launch.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attention_lse_f32(const float* q, const float* k, const float* v, float* out,
                      const float* mask, int batch, int seq_q, int seq_k, int heads_q,
                      int heads_kv, int head_dim, float scale, int causal, int window,
                      int q_offset, float* lse) {
    attention_impl(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, scale,
                   causal, window, q_offset, lse);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attention_lse_bf16(const bf16* q, const bf16* k, const bf16* v, bf16* out,
                       const float* mask, int batch, int seq_q, int seq_k, int heads_q,
                       int heads_kv, int head_dim, float scale, int causal, int window,
                       int q_offset, float* lse) {
    attention_impl(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, scale,
                   causal, window, q_offset, lse);
}
