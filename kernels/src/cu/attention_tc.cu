// attention_tc.cu: fused attention forward on tensor cores (FlashAttention-2 structure),
// bf16 inputs, mma.sync m16n8k16 with f32 accumulation, online softmax in registers. Needs
// sm_80 or newer (mma.sync bf16, ldmatrix, cp.async).
//
// attention_tc_bf16(const bf16* q,        // [B, Tq, Hq, D]
//                   const bf16* k,        // [B, S, Hkv, D]
//                   const bf16* v,        // [B, S, Hkv, D]
//                   bf16* out,            // [B, Tq, Hq, D]
//                   const float* mask,    // [B, S] f32, 1 keep / 0 drop; null = keep all
//                   int batch, int seq_q, int seq_k, int heads_q, int heads_kv,
//                   int head_dim,         // 64 or 128 only
//                   float scale, int causal, int window, int q_offset)
// The argument list and semantics are those of attention_bf16 (attention.cu): GQA (query head
// h reads KV head h / (Hq / Hkv)), causal (query t sees keys s <= t + q_offset), sliding window
// (t + q_offset - s < window when window > 0), key mask, q_offset for decode and chunked
// prefill; a query with no visible key outputs zeros. The host picks this kernel for bf16 on
// sm_80 or newer when head_dim is 64 or 128 and q, k, v are 16-byte aligned, and attention_bf16
// otherwise (shardc_kernels::launch::attention_kernel).
// attention_tc_lse_bf16: the same with a trailing `float* lse` ([B, Tq, Hq] f32), as
// attention_lse_bf16 (attention.cu): each query's log-sum-exp of its scaled visible scores
// (natural log, -inf when none), for the backward.
//
// Launch (exactly): blockDim = (128, 1, 1); gridDim = (ceil(Tq / 64), Hq, B);
// dynamic shared memory = 640 * D bytes (40 KiB for D = 64, 80 KiB for D = 128: above 48 KiB
// the host must opt in with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).
// q, k and v must be 16-byte aligned (rows are copied 16 bytes at a time with cp.async).
// A launch with another block shape, another head_dim or Hq not a multiple of Hkv traps.
//
// Structure. A block owns 64 queries of one (b, h); warp w owns queries 16w .. 16w+15, the M
// dimension of its mma tiles. The keys the block can see (by causality and window) are walked
// in tiles of 64; K and V tiles are double-buffered in shared memory, the next tile's cp.async
// copies in flight while the current one is computed. Per tile and warp: S = Q K^T (Q
// fragments kept in registers, K fragments by ldmatrix), masking to -inf, the running row max
// and the rescaling of the f32 output accumulator, then P (rounded to bf16, straight from the S
// registers) times V (V fragments by ldmatrix.trans). Row maxima are reduced over the 4 lanes
// of a quad (the lanes holding one row); row sums stay per lane until the end. Scores are kept
// in the log2 domain (scale * log2 e), so exponentials are exp2f. A warp skips the compute of
// a tile none of its queries can see, and the block only walks visible tiles. Tiles are stored
// with 16-byte chunk c of row r at chunk position c ^ (r % 8) (mma.cuh's tile_swizzle), so the
// 8 row addresses of every ldmatrix hit 8 distinct bank groups. Rows past the end of q, k or v
// are zero-filled by the copy (src-size 0), so padding keys hold zeros, never stale data, and
// are masked out.
#include "common.cuh"
#include "mma.cuh"

#define ATC_BLOCK_Q 64
#define ATC_BLOCK_K 64
#define ATC_THREADS 128
#define ATC_WARP_Q 16

template <int D>
__device__ __forceinline__ void attention_tc_impl(const bf16* q, const bf16* k, const bf16* v,
                                                  bf16* out, const float* mask, int batch,
                                                  int seq_q, int seq_k, int heads_q,
                                                  int heads_kv, float scale, int causal,
                                                  int window, int q_offset, float* lse) {
    extern __shared__ float smem[];
    bf16* q_s = (bf16*)smem;                  // [64][D]
    bf16* k_s = q_s + ATC_BLOCK_Q * D;        // [2][64][D]
    bf16* v_s = k_s + 2 * ATC_BLOCK_K * D;    // [2][64][D]

    const int b = blockIdx.z;
    const int h = blockIdx.y;
    const int t0 = blockIdx.x * ATC_BLOCK_Q;
    if (b >= batch || h >= heads_q || t0 >= seq_q) return;  // uniform over the block
    const int hk = h / (heads_q / heads_kv);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;  // row of the fragments (and row + 8)
    const int c = lane & 3;   // column pair of the fragments
    const int mi = lane >> 3;  // the 8x8 matrix this lane addresses in an ldmatrix.x4

    // Keys any query of the block can see (block-uniform: the barriers below are safe).
    const int t_last = min(t0 + ATC_BLOCK_Q, seq_q) - 1;
    const AttnRange keys = attn_keys_seen(t0, t_last, q_offset, causal, window, 0, seq_k);
    const int s_begin = keys.begin;
    const int s_end = keys.end;
    const int n_tiles = s_end > s_begin ? (s_end - s_begin + ATC_BLOCK_K - 1) / ATC_BLOCK_K : 0;

    // This warp's queries: rows g and g + 8 of its 16.
    const int tw0 = t0 + warp * ATC_WARP_Q;
    const int tw_last = min(tw0 + ATC_WARP_Q, seq_q) - 1;
    const int tq[2] = {tw0 + g, tw0 + g + 8};

    cp_async_tile<D, ATC_BLOCK_Q, ATC_THREADS>(q_s, q, b, t0, seq_q, seq_q, heads_q, h);
    cp_async_commit();
    if (n_tiles > 0) {
        cp_async_tile<D, ATC_BLOCK_K, ATC_THREADS>(k_s, k, b, s_begin, s_end, seq_k, heads_kv, hk);
        cp_async_tile<D, ATC_BLOCK_K, ATC_THREADS>(v_s, v, b, s_begin, s_end, seq_k, heads_kv, hk);
    }
    cp_async_commit();

    const float scale_log2 = scale * 1.4426950408889634f;
    unsigned qf[D / 16][4];
    float o[D / 8][4];
    mma_zero<D / 8>(o);
    float row_max[2] = {-SHARDC_INF, -SHARDC_INF};
    float row_sum[2] = {0.0f, 0.0f};  // this lane's share; the quad's sum is taken at the end

    for (int it = 0; it < n_tiles; ++it) {
        const int s0 = s_begin + it * ATC_BLOCK_K;
        const int buf = it & 1;
        if (it + 1 < n_tiles) {
            // The other buffer was released by the barrier that ended the previous iteration.
            const int next = s0 + ATC_BLOCK_K;
            cp_async_tile<D, ATC_BLOCK_K, ATC_THREADS>(k_s + (buf ^ 1) * ATC_BLOCK_K * D, k, b,
                                                       next, s_end, seq_k, heads_kv, hk);
            cp_async_tile<D, ATC_BLOCK_K, ATC_THREADS>(v_s + (buf ^ 1) * ATC_BLOCK_K * D, v, b,
                                                       next, s_end, seq_k, heads_kv, hk);
            cp_async_commit();
            cp_async_wait<1>();  // all but the tile just issued: Q and this tile have landed
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // every thread's copies of this tile visible to all

        if (it == 0) {
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                const int row = warp * ATC_WARP_Q + (mi & 1) * 8 + (lane & 7);
                ldmatrix_x4(qf[ks], q_s + tile_swizzle<D>(row, ks * 2 + (mi >> 1)));
            }
        }

        // Warp-uniform: skip a tile none of this warp's queries sees (state unchanged, exactly
        // as if every score were -inf).
        const bool skip = tw0 >= seq_q || (causal && s0 > tw_last + q_offset) ||
                          (window > 0 && s0 + ATC_BLOCK_K <= tw0 + q_offset - window + 1);
        if (!skip) {
            const bf16* kt = k_s + buf * ATC_BLOCK_K * D;
            const bf16* vt = v_s + buf * ATC_BLOCK_K * D;

            // S = Q K^T: 8 blocks of 8 keys, C layout.
            float s[8][4];
            mma_zero<8>(s);
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
                for (int nb = 0; nb < 8; nb += 2) {
                    unsigned kf[4];  // B fragments of key blocks nb and nb + 1
                    const int row = (nb + (mi >> 1)) * 8 + (lane & 7);
                    ldmatrix_x4(kf, kt + tile_swizzle<D>(row, ks * 2 + (mi & 1)));
                    mma_bf16_16816(s[nb], qf[ks], kf);
                    mma_bf16_16816(s[nb + 1], qf[ks], kf + 2);
                }
            }

            // Mask, scale to the log2 domain, row maxima over the quad.
            float tile_max[2] = {-SHARDC_INF, -SHARDC_INF};
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = s0 + nb * 8 + 2 * c + (i & 1);
                    const int t = tq[i >> 1];
                    const int tp = t + q_offset;
                    const bool visible =
                        key < s_end && t < seq_q && (!causal || key <= tp) &&
                        (window <= 0 || tp - key < window) &&
                        (mask == nullptr || mask[(i64)b * seq_k + key] != 0.0f);
                    const float x = visible ? s[nb][i] * scale_log2 : -SHARDC_INF;
                    s[nb][i] = x;
                    tile_max[i >> 1] = fmaxf(tile_max[i >> 1], x);
                }
            }
            float corr[2];
            float base[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = tile_max[r];
                mx = fmaxf(mx, __shfl_xor_sync(SHARDC_FULL_MASK, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(SHARDC_FULL_MASK, mx, 2));
                const float m_new = fmaxf(row_max[r], mx);
                // While a row has seen no visible key, subtract 0: every exp2f is then of -inf.
                base[r] = m_new == -SHARDC_INF ? 0.0f : m_new;
                corr[r] = exp2f(row_max[r] - base[r]);  // 0 when the old max was -inf
                row_max[r] = m_new;
                row_sum[r] *= corr[r];
            }
#pragma unroll
            for (int nb = 0; nb < D / 8; ++nb) {
#pragma unroll
                for (int i = 0; i < 4; ++i) o[nb][i] *= corr[i >> 1];
            }
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float p = exp2f(s[nb][i] - base[i >> 1]);
                    s[nb][i] = p;
                    row_sum[i >> 1] += p;
                }
            }

            // O += P V, P's A fragments straight from the S registers (mma.cuh).
            mma_acc_xb<D, ATC_BLOCK_K>(o, s, vt, lane);
        }
        __syncthreads();  // this buffer is free for the copy issued next iteration
    }
    cp_async_wait<0>();  // nothing may still be landing when the block exits (n_tiles == 0)

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = row_sum[r];
        l += __shfl_xor_sync(SHARDC_FULL_MASK, l, 1);
        l += __shfl_xor_sync(SHARDC_FULL_MASK, l, 2);
        const int t = tq[r];
        if (t >= seq_q) continue;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const i64 row = ((i64)b * seq_q + t) * heads_q + h;
        const i64 row_base = row * D;
        // The natural-log lse of the scaled scores: row_max and l are in the log2 domain.
        if (lse != nullptr && c == 0) {
            lse[row] = l > 0.0f ? (row_max[r] + log2f(l)) * 0.6931471805599453f : -SHARDC_INF;
        }
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb) {
            const int d = nb * 8 + 2 * c;
            store(out, row_base + d, o[nb][2 * r] * inv);
            store(out, row_base + d + 1, o[nb][2 * r + 1] * inv);
        }
    }
}

__device__ __forceinline__ void attention_tc_entry(const bf16* q, const bf16* k, const bf16* v,
                                                   bf16* out, const float* mask, int batch,
                                                   int seq_q, int seq_k, int heads_q,
                                                   int heads_kv, int head_dim, float scale,
                                                   int causal, int window, int q_offset,
                                                   float* lse) {
    if (blockDim.x != ATC_THREADS || blockDim.y != 1 || blockDim.z != 1 || heads_kv <= 0 ||
        heads_q % heads_kv != 0) {
        __trap();
    }
    if (head_dim == 64) {
        attention_tc_impl<64>(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv,
                              scale, causal, window, q_offset, lse);
    } else if (head_dim == 128) {
        attention_tc_impl<128>(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv,
                               scale, causal, window, q_offset, lse);
    } else {
        __trap();
    }
}

extern "C" __global__ void __launch_bounds__(ATC_THREADS)
    attention_tc_bf16(const bf16* q, const bf16* k, const bf16* v, bf16* out,
                      const float* mask, int batch, int seq_q, int seq_k, int heads_q,
                      int heads_kv, int head_dim, float scale, int causal, int window,
                      int q_offset) {
    attention_tc_entry(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv, head_dim,
                       scale, causal, window, q_offset, nullptr);
}

// The same forward, also writing each query's natural-log log-sum-exp of its scaled scores for
// the backward (attention_bwd.cu, attention_bwd_tc.cu) or a later one (a training step keeps
// it with the output): lse [B, Tq, Hq] f32, -inf for a query with no visible key. The
// trailing argument and its meaning are attention_lse_bf16's (attention.cu). Same launch.
extern "C" __global__ void __launch_bounds__(ATC_THREADS)
    attention_tc_lse_bf16(const bf16* q, const bf16* k, const bf16* v, bf16* out,
                          const float* mask, int batch, int seq_q, int seq_k, int heads_q,
                          int heads_kv, int head_dim, float scale, int causal, int window,
                          int q_offset, float* lse) {
    attention_tc_entry(q, k, v, out, mask, batch, seq_q, seq_k, heads_q, heads_kv, head_dim,
                       scale, causal, window, q_offset, lse);
}
