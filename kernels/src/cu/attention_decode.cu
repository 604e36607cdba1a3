// attention_decode.cu: split-KV attention for decoding (flash-decoding): few queries against a
// long KV cache. The ordinary kernels launch ceil(Tq / 16) x Hq x B blocks, each walking all S
// keys, which leaves most SMs idle when Tq is small; here the keys are split into num_splits
// contiguous ranges, one block per (split, KV head group, b), and a second kernel merges the
// splits.
//
// attention_decode_{f32,bf16}(const T* q,          // [B, Tq, Hq, D]
//                             const T* k,          // [B, S, Hkv, D]
//                             const T* v,          // [B, S, Hkv, D]
//                             T* out,              // [B, Tq, Hq, D] (not written)
//                             const float* mask,   // [B, S] f32, 1 keep / 0 drop; null = keep all
//                             int batch, int seq_q, int seq_k, int heads_q, int heads_kv,
//                             int head_dim,        // 1..=256
//                             float scale, int causal, int window, int q_offset,
//                             float* ws,           // workspace, see below
//                             int num_splits)      // >= 1
// attention_decode_combine_{f32,bf16}(the same arguments): reads ws, writes out.
// The arguments other than ws and num_splits, and the result of running both kernels in order
// on one stream, are those of attention_{f32,bf16} (attention.cu): GQA, causal with q_offset,
// sliding window, key mask; a query with no visible key outputs zeros.
//
// Splits. Split i covers keys [i * C, min(S, (i + 1) * C)) with C = ceil32(ceil(S / num_splits));
// trailing splits may be empty. A split in which a query sees no key (empty, masked, outside
// the causal range or the window) records m = -inf, l = 0, acc = 0, and contributes nothing.
//
// Workspace (f32, 4 * B * num_splits * Tq * Hq * (D + 2) bytes; its contents never need
// clearing): with o = ((b * num_splits + i) * Tq + t) * Hq + h and N = B * num_splits * Tq * Hq,
//   ws[o * D + d]       unnormalised sum_s exp(score_s - m) v[s][d] over split i's visible keys,
//   ws[N * D + 2 o]     m, the largest visible score (scale applied), -inf if none,
//   ws[N * D + 2 o + 1] l, sum_s exp(score_s - m).
// The combine computes M = max_i m_i, w_i = exp(m_i - M) (0 for m_i = -inf) and writes
// out = sum_i w_i acc_i / sum_i w_i l_i, or zeros when every m_i is -inf.
//
// Launch (exactly) of attention_decode_*: blockDim = (128, 1, 1);
// gridDim = (num_splits, Hkv * ceil(Tq * G / 16), B) with G = Hq / Hkv; blockIdx.y = hk * tiles
// + tile. A block packs the G query heads of KV head hk (rows t-major, 16 rows of the Tq * G,
// attention.cuh) so each K/V tile is read once per group; dynamic shared memory
// = (16 + 32) * ceil32(D) * 4 bytes, as attention.cu. A launch with another block size, an
// out-of-range head_dim or num_splits < 1 traps.
// Launch of attention_decode_combine_*: any grid (block-stride over the B * Tq * Hq output rows
// along x), blockDim.x a multiple of 32 (threads stride over D); no shared memory.
#include "common.cuh"
#include "attention.cuh"

// Keys per split: ceil(S / num_splits) rounded up to whole key tiles.
__device__ __forceinline__ int attn_split_keys(int seq_k, int num_splits) {
    const int per = (seq_k + num_splits - 1) / num_splits;
    return (per + ATTN_BLOCK_K - 1) / ATTN_BLOCK_K * ATTN_BLOCK_K;
}

template <typename T>
__device__ __forceinline__ void attention_decode_impl(const T* q, const T* k, const T* v,
                                                      const float* mask, int batch, int seq_q,
                                                      int seq_k, int heads_q, int heads_kv,
                                                      int head_dim, float scale, int causal,
                                                      int window, int q_offset, float* ws,
                                                      int num_splits) {
    attn_check_launch(head_dim, heads_q, heads_kv);
    if (num_splits < 1) __trap();
    const int group = heads_q / heads_kv;
    const int rows = seq_q * group;
    const int tiles = (rows + ATTN_BLOCK_Q - 1) / ATTN_BLOCK_Q;
    const int split = blockIdx.x;
    const int hk = blockIdx.y / tiles;
    const int row0 = (blockIdx.y % tiles) * ATTN_BLOCK_Q;
    const int b = blockIdx.z;
    if (b >= batch || hk >= heads_kv || split >= num_splits) return;  // uniform over the block
    const int chunk = attn_split_keys(seq_k, num_splits);
    const int s_lo = min(split * chunk, seq_k);
    const int s_hi = min(s_lo + chunk, seq_k);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nchunk = (head_dim + 31) >> 5;

    float m[ATTN_Q_PER_WARP], l[ATTN_Q_PER_WARP], acc[ATTN_Q_PER_WARP][ATTN_MAX_CHUNKS];
    attn_rows(q, k, v, mask, b, seq_q, seq_k, heads_q, heads_kv, head_dim, scale, causal, window,
              q_offset, hk, hk * group, group, rows, row0, s_lo, s_hi, m, l, acc);

    const i64 n_rows = (i64)batch * num_splits * seq_q * heads_q;
#pragma unroll
    for (int r = 0; r < ATTN_Q_PER_WARP; ++r) {
        const int row = row0 + warp * ATTN_Q_PER_WARP + r;
        if (row >= rows) continue;
        const int t = row / group;
        const int h = hk * group + row % group;
        const i64 o = (((i64)b * num_splits + split) * seq_q + t) * heads_q + h;
#pragma unroll
        for (int c = 0; c < ATTN_MAX_CHUNKS; ++c) {
            const int d = lane + 32 * c;
            if (c < nchunk && d < head_dim) ws[o * head_dim + d] = acc[r][c];
        }
        if (lane == 0) {
            ws[n_rows * head_dim + 2 * o] = m[r];
            ws[n_rows * head_dim + 2 * o + 1] = l[r];
        }
    }
}

template <typename T>
__device__ __forceinline__ void attention_combine_impl(T* out, int batch, int seq_q, int heads_q,
                                                       int head_dim, const float* ws,
                                                       int num_splits) {
    const i64 out_rows = (i64)batch * seq_q * heads_q;
    const i64 per_split = (i64)seq_q * heads_q;
    const i64 n_rows = out_rows * num_splits;
    const float* ml = ws + n_rows * head_dim;
    for (i64 row = blockIdx.x; row < out_rows; row += gridDim.x) {
        const i64 b = row / per_split;
        const i64 th = row - b * per_split;  // t * Hq + h
        // Row o of split i: (b * num_splits + i) * per_split + th.
        float m_all = -SHARDC_INF;
        for (int i = 0; i < num_splits; ++i) {
            m_all = fmaxf(m_all, ml[2 * ((b * num_splits + i) * per_split + th)]);
        }
        float l_all = 0.0f;
        if (m_all != -SHARDC_INF) {
            for (int i = 0; i < num_splits; ++i) {
                const i64 o = (b * num_splits + i) * per_split + th;
                if (ml[2 * o] != -SHARDC_INF) l_all += expf(ml[2 * o] - m_all) * ml[2 * o + 1];
            }
        }
        const float inv = l_all > 0.0f ? 1.0f / l_all : 0.0f;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            if (inv != 0.0f) {
                for (int i = 0; i < num_splits; ++i) {
                    const i64 o = (b * num_splits + i) * per_split + th;
                    if (ml[2 * o] != -SHARDC_INF) {
                        sum += expf(ml[2 * o] - m_all) * ws[o * head_dim + d];
                    }
                }
            }
            store(out, row * head_dim + d, sum * inv);
        }
    }
}

#define SHARDC_ATTENTION_DECODE(NAME, T)                                                     \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                               \
        NAME(const T* q, const T* k, const T* v, T* out, const float* mask, int batch,       \
             int seq_q, int seq_k, int heads_q, int heads_kv, int head_dim, float scale,     \
             int causal, int window, int q_offset, float* ws, int num_splits) {              \
        attention_decode_impl(q, k, v, mask, batch, seq_q, seq_k, heads_q, heads_kv,         \
                              head_dim, scale, causal, window, q_offset, ws, num_splits);    \
    }

SHARDC_ATTENTION_DECODE(attention_decode_f32, float)
SHARDC_ATTENTION_DECODE(attention_decode_bf16, bf16)

#define SHARDC_ATTENTION_DECODE_COMBINE(NAME, T)                                             \
    extern "C" __global__ void NAME(                                                         \
        const T* q, const T* k, const T* v, T* out, const float* mask, int batch, int seq_q, \
        int seq_k, int heads_q, int heads_kv, int head_dim, float scale, int causal,         \
        int window, int q_offset, float* ws, int num_splits) {                               \
        attention_combine_impl(out, batch, seq_q, heads_q, head_dim, ws, num_splits);        \
    }

SHARDC_ATTENTION_DECODE_COMBINE(attention_decode_combine_f32, float)
SHARDC_ATTENTION_DECODE_COMBINE(attention_decode_combine_bf16, bf16)
