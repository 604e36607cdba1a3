// attention_bwd.cu: the backward of attention.cu, FlashAttention-2 style: the probabilities are
// recomputed from the forward's log-sum-exp (attention_lse_*), never stored. Scalar f32 FMA,
// f32 accumulation. Shapes and masking rules are attention.cu's: q, out, dout [B, Tq, Hq, D];
// k, v [B, S, Hkv, D]; mask [B, S] f32 (null = keep all); causal with q_offset, window, GQA
// (query head h reads KV head h / (Hq / Hkv)). With P = softmax(scale * q.kᵀ) over the visible
// keys and Di = rowsum(dOi * Oi):
//   dV = Pᵀ.dO,  dS = P * (dO.Vᵀ - Di),  dQ = scale * dS.K,  dK = scale * dSᵀ.Q,
// dK and dV summed over the Hq / Hkv query heads sharing a KV head. Masked keys get zero dK/dV;
// a query with no visible key (lse = -inf) contributes nothing and gets a zero dQ.
//
// Three launches, in this order on one stream:
// 1. attention_bwd_prep_{f32,bf16}(const T* out, const T* dout,
//                                  float* delta,     // [B, Tq, Hq] f32: Di
//                                  float* dq_acc,    // [B, Tq, Hq, D] f32: zeroed here
//                                  i64 rows,         // B * Tq * Hq
//                                  int head_dim)
//    One warp per row, warp-stride loop: any grid, blockDim.x a multiple of 32 (traps
//    otherwise); the launch helper uses 128 threads.
// 2. attention_bwd_{f32,bf16}(const T* q, const T* k, const T* v, const T* dout,
//                             const float* lse,      // [B, Tq, Hq] from attention_lse_*
//                             const float* delta,    // [B, Tq, Hq] from step 1
//                             const float* mask,     // [B, S] or null
//                             float* dq_acc,         // [B, Tq, Hq, D] f32, atomicAdd
//                             T* dk, T* dv,          // [B, S, Hkv, D], fully written
//                             int batch, int seq_q, int seq_k, int heads_q, int heads_kv,
//                             int head_dim,          // 1..=128
//                             float scale, int causal, int window, int q_offset)
//    Launch (exactly): blockDim = (128, 1, 1); gridDim = (ceil(S / 32), Hkv, B); dynamic
//    shared memory = (2 * 32 + 2 * 8) * ceil32(D) * 4 + 2 * 8 * 32 * 4 bytes (<= 42 KiB, so
//    no opt-in). Each block owns 32 keys of one (b, kv head) and walks the query tiles (8
//    queries) of every query head of its group that can see any of its keys: K and V stay in
//    shared memory (XOR-swizzled like attention.cu), dK and dV in registers (warp w owns keys
//    8w..8w+7, lane l dims l, l+32, ...), and each tile's dQ rows go to dq_acc with f32
//    atomicAdd (so dQ's summation order, and its last bits, vary from run to run). Another
//    block size or head_dim traps.
// 3. dQ in the input dtype: for f32, dq_acc may be the dQ tensor itself (nothing to do); for
//    bf16, cast_f32_bf16(dq_acc, dq, B * Tq * Hq * D) (cast.cu).
#include "common.cuh"

#define ABWD_BLOCK_K 32
#define ABWD_BLOCK_Q 8
#define ABWD_THREADS 128
#define ABWD_KEYS_PER_WARP 8    // ABWD_BLOCK_K / 4 warps
#define ABWD_ROWS_PER_WARP 2    // ABWD_BLOCK_Q / 4 warps
#define ABWD_MAX_CHUNKS 4       // head_dim <= 4 * 32

template <typename T>
__device__ __forceinline__ void attention_bwd_prep_impl(const T* out, const T* dout, float* delta,
                                                        float* dq_acc, i64 rows, int head_dim) {
    if (blockDim.x % 32 != 0) __trap();
    const int lane = threadIdx.x & 31;
    const i64 warps = grid_stride() >> 5;
    for (i64 row = global_thread_id() >> 5; row < rows; row += warps) {  // warp-uniform
        const i64 base = row * head_dim;
        float acc = 0.0f;
        for (int d = lane; d < head_dim; d += 32) {
            acc += load(out, base + d) * load(dout, base + d);
            dq_acc[base + d] = 0.0f;
        }
        acc = warp_sum(acc);
        if (lane == 0) delta[row] = acc;
    }
}

template <typename T>
__device__ __forceinline__ void attention_bwd_impl(
    const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
    const float* mask, float* dq_acc, T* dk, T* dv, int batch, int seq_q, int seq_k, int heads_q,
    int heads_kv, int head_dim, float scale, int causal, int window, int q_offset) {
    if (blockDim.x != ABWD_THREADS || head_dim <= 0 || head_dim > 32 * ABWD_MAX_CHUNKS ||
        heads_kv <= 0 || heads_q % heads_kv != 0) {
        __trap();
    }
    extern __shared__ float smem[];
    const int dp = (head_dim + 31) & ~31;
    const int nchunk = dp >> 5;
    float* k_s = smem;                              // [32][dp], swizzled
    float* v_s = k_s + ABWD_BLOCK_K * dp;           // [32][dp], swizzled
    float* q_s = v_s + ABWD_BLOCK_K * dp;           // [8][dp], plain
    float* do_s = q_s + ABWD_BLOCK_Q * dp;          // [8][dp], plain
    float* p_s = do_s + ABWD_BLOCK_Q * dp;          // [8][32]: P
    float* ds_s = p_s + ABWD_BLOCK_Q * ABWD_BLOCK_K;  // [8][32]: dS

    const int b = blockIdx.z;
    const int hk = blockIdx.y;
    const int s0 = blockIdx.x * ABWD_BLOCK_K;
    if (b >= batch || hk >= heads_kv || s0 >= seq_k) return;  // uniform over the block
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int group = heads_q / heads_kv;

    attn_load_rows(k_s, k, ABWD_BLOCK_K, s0, seq_k, b, heads_kv, hk, head_dim, dp, true);
    attn_load_rows(v_s, v, ABWD_BLOCK_K, s0, seq_k, b, heads_kv, hk, head_dim, dp, true);

    // Lane j's key in the score phase, and the queries that can see any key of the tile
    // (block-uniform, so the barriers below are safe).
    const int s = s0 + lane;
    const bool key_ok = s < seq_k && (mask == nullptr || mask[(i64)b * seq_k + s] != 0.0f);
    const int s_last = min(s0 + ABWD_BLOCK_K, seq_k) - 1;
    const AttnRange queries = attn_queries_seeing(s0, s_last, seq_q, q_offset, causal, window);
    const int t_begin = queries.begin;
    const int t_end = queries.end;

    float dk_acc[ABWD_KEYS_PER_WARP][ABWD_MAX_CHUNKS], dv_acc[ABWD_KEYS_PER_WARP][ABWD_MAX_CHUNKS];
#pragma unroll
    for (int u = 0; u < ABWD_KEYS_PER_WARP; ++u) {
#pragma unroll
        for (int c = 0; c < ABWD_MAX_CHUNKS; ++c) dk_acc[u][c] = dv_acc[u][c] = 0.0f;
    }

    for (int h = hk * group; h < (hk + 1) * group; ++h) {
        for (int t0 = t_begin; t0 < t_end; t0 += ABWD_BLOCK_Q) {
            __syncthreads();  // previous tile's q, dO, P and dS consumed (K and V loaded)
            attn_load_rows(q_s, q, ABWD_BLOCK_Q, t0, seq_q, b, heads_q, h, head_dim, dp, false);
            attn_load_rows(do_s, dout, ABWD_BLOCK_Q, t0, seq_q, b, heads_q, h, head_dim, dp,
                           false);
            __syncthreads();

            // P and dS: lane j against key s0 + j, warp w for queries w and w + 4.
            const float* k_row = k_s + lane * dp;
            const float* v_row = v_s + lane * dp;
#pragma unroll
            for (int r = 0; r < ABWD_BLOCK_Q / 4; ++r) {
                const int i = warp + 4 * r;
                const int t = t0 + i;
                float sq = 0.0f;
                float dpv = 0.0f;
                for (int d = 0; d < dp; ++d) {
                    sq += q_s[i * dp + d] * k_row[d ^ lane];
                    dpv += do_s[i * dp + d] * v_row[d ^ lane];
                }
                float p = 0.0f;
                float ds = 0.0f;
                if (key_ok && t < t_end && attn_visible(s, t + q_offset, causal, window)) {
                    const i64 row = ((i64)b * seq_q + t) * heads_q + h;
                    const float l = lse[row];
                    if (l != -SHARDC_INF) {  // a visible key implies a finite lse; guard anyway
                        p = expf(sq * scale - l);
                        ds = p * (dpv - delta[row]);
                    }
                }
                p_s[i * ABWD_BLOCK_K + lane] = p;
                ds_s[i * ABWD_BLOCK_K + lane] = ds;
            }
            __syncthreads();

            // dV += Pᵀ.dO and dK += dSᵀ.Q for the warp's 8 keys, lane's dims.
            for (int i = 0; i < ABWD_BLOCK_Q; ++i) {
                float dov[ABWD_MAX_CHUNKS], qv[ABWD_MAX_CHUNKS];
#pragma unroll
                for (int c = 0; c < ABWD_MAX_CHUNKS; ++c) {
                    dov[c] = c < nchunk ? do_s[i * dp + lane + 32 * c] : 0.0f;
                    qv[c] = c < nchunk ? q_s[i * dp + lane + 32 * c] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < ABWD_KEYS_PER_WARP; ++u) {
                    const int j = warp * ABWD_KEYS_PER_WARP + u;
                    const float p = p_s[i * ABWD_BLOCK_K + j];
                    const float ds = ds_s[i * ABWD_BLOCK_K + j];
#pragma unroll
                    for (int c = 0; c < ABWD_MAX_CHUNKS; ++c) {
                        dv_acc[u][c] += p * dov[c];
                        dk_acc[u][c] += ds * qv[c];
                    }
                }
            }

            // dQ rows of the warp's 2 queries: scale * sum_j dS[i][j] * K[j][d], added to dq_acc.
#pragma unroll
            for (int r = 0; r < ABWD_ROWS_PER_WARP; ++r) {
                const int i = warp * ABWD_ROWS_PER_WARP + r;
                const int t = t0 + i;
                if (t >= t_end) continue;  // warp-uniform
                float acc[ABWD_MAX_CHUNKS];
#pragma unroll
                for (int c = 0; c < ABWD_MAX_CHUNKS; ++c) acc[c] = 0.0f;
                for (int j = 0; j < ABWD_BLOCK_K; ++j) {
                    const float ds = ds_s[i * ABWD_BLOCK_K + j];
                    if (ds == 0.0f) continue;  // warp-uniform (a broadcast read)
#pragma unroll
                    for (int c = 0; c < ABWD_MAX_CHUNKS; ++c) {
                        if (c < nchunk) acc[c] += ds * k_s[j * dp + ((lane + 32 * c) ^ j)];
                    }
                }
                const i64 base = (((i64)b * seq_q + t) * heads_q + h) * head_dim;
#pragma unroll
                for (int c = 0; c < ABWD_MAX_CHUNKS; ++c) {
                    const int d = lane + 32 * c;
                    if (c < nchunk && d < head_dim && acc[c] != 0.0f) {
                        atomicAdd(dq_acc + base + d, scale * acc[c]);
                    }
                }
            }
        }
    }

    // Every key of the tile is written, masked or not seen by any query (zeros).
#pragma unroll
    for (int u = 0; u < ABWD_KEYS_PER_WARP; ++u) {
        const int sk = s0 + warp * ABWD_KEYS_PER_WARP + u;
        if (sk >= seq_k) continue;
        const i64 base = (((i64)b * seq_k + sk) * heads_kv + hk) * head_dim;
#pragma unroll
        for (int c = 0; c < ABWD_MAX_CHUNKS; ++c) {
            const int d = lane + 32 * c;
            if (c < nchunk && d < head_dim) {
                store(dk, base + d, scale * dk_acc[u][c]);
                store(dv, base + d, dv_acc[u][c]);
            }
        }
    }
}

#define SHARDC_ATTENTION_BWD_PREP(NAME, T)                                                    \
    extern "C" __global__ void NAME(const T* out, const T* dout, float* delta, float* dq_acc, \
                                    i64 rows, int head_dim) {                                 \
        attention_bwd_prep_impl(out, dout, delta, dq_acc, rows, head_dim);                    \
    }

SHARDC_ATTENTION_BWD_PREP(attention_bwd_prep_f32, float)
SHARDC_ATTENTION_BWD_PREP(attention_bwd_prep_bf16, bf16)

#define SHARDC_ATTENTION_BWD(NAME, T)                                                         \
    extern "C" __global__ void __launch_bounds__(ABWD_THREADS)                                \
        NAME(const T* q, const T* k, const T* v, const T* dout, const float* lse,             \
             const float* delta, const float* mask, float* dq_acc, T* dk, T* dv, int batch,   \
             int seq_q, int seq_k, int heads_q, int heads_kv, int head_dim, float scale,      \
             int causal, int window, int q_offset) {                                          \
        attention_bwd_impl(q, k, v, dout, lse, delta, mask, dq_acc, dk, dv, batch, seq_q,     \
                           seq_k, heads_q, heads_kv, head_dim, scale, causal, window,         \
                           q_offset);                                                         \
    }

SHARDC_ATTENTION_BWD(attention_bwd_f32, float)
SHARDC_ATTENTION_BWD(attention_bwd_bf16, bf16)
