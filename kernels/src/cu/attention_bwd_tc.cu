// attention_bwd_tc.cu: the attention backward on tensor cores (FlashAttention-2, Dao 2023,
// Algorithm 2), bf16 inputs, mma.sync m16n8k16 with f32 accumulation. Needs sm_80 or newer
// (mma.sync bf16, ldmatrix, cp.async). A drop-in for attention_bwd_bf16 (attention_bwd.cu):
//
// attention_bwd_tc_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* dout,
//                       const float* lse,      // [B, Tq, Hq] from attention_lse_bf16
//                       const float* delta,    // [B, Tq, Hq] from attention_bwd_prep_bf16
//                       const float* mask,     // [B, S] or null
//                       float* dq_acc,         // [B, Tq, Hq, D] f32, zeroed by the prep; atomicAdd
//                       bf16* dk, bf16* dv,    // [B, S, Hkv, D], fully written
//                       int batch, int seq_q, int seq_k, int heads_q, int heads_kv,
//                       int head_dim,          // 64 or 128 only
//                       float scale, int causal, int window, int q_offset)
// The argument list, the three-launch protocol (attention_lse_bf16, attention_bwd_prep_bf16,
// this kernel, then cast_f32_bf16 of dq_acc) and the semantics are attention_bwd_bf16's: q,
// dout [B, Tq, Hq, D], k, v [B, S, Hkv, D]; GQA (query head h reads KV head h / (Hq / Hkv)),
// causal with q_offset, sliding window, key mask. With P = exp(scale * q.kᵀ - lse) over the
// visible keys and Di = delta:
//   dV = Pᵀ.dO,  dS = P * (dO.Vᵀ - Di),  dQ = scale * dS.K,  dK = scale * dSᵀ.Q,
// dK and dV summed over the query heads of a KV head. A query with no visible key (lse = -inf)
// contributes nothing; keys no query sees get exact zeros. The host picks this kernel for bf16
// on sm_80 or newer when head_dim is 64 or 128 and q, k, v, dout are 16-byte aligned, and
// attention_bwd_bf16 otherwise (shardc_kernels::launch::attention_bwd_kernel).
//
// Launch (exactly): blockDim = (128, 1, 1); gridDim = (ceil(S / 64), Hkv, B); dynamic shared
// memory = (128 D + 4 BQ D + 64 BQ) * 2 + 16 BQ bytes with BQ = 64 for D = 64 and 32 for
// D = 128 (57 KiB and 68.5 KiB: above 48 KiB, so the host must opt in with
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES). q, k, v and dout must be 16-byte aligned
// (rows are copied 16 bytes at a time with cp.async). Another block shape, another head_dim or
// Hq not a multiple of Hkv traps.
//
// Structure. A block owns 64 keys of one (b, kv head): their K and V tiles stay in shared
// memory, and warp w owns keys 16w .. 16w+15, the M dimension of its mma tiles, with their dK
// and dV rows (16 x D f32 each) in registers. The block walks the query tiles (BQ queries) of
// every query head of its GQA group that can see any of its keys (by causality and window);
// each tile's Q and dO are double-buffered in shared memory (the next tile's cp.async copies in
// flight while the current one is computed), its lse and delta rows staged next to them (lse in
// the log2 domain, +inf and 0 for rows that see nothing, so their P is exactly 0). Per tile and
// warp, everything transposed so the warp's keys are the rows:
//   Sᵀ = K Qᵀ            (K fragments by ldmatrix, Q as the B operand by ldmatrix)
//   Pᵀ = exp2(Sᵀ scale log2e - lse log2e), 0 where hidden (mask, causality, window, padding)
//   dV += Pᵀ dO           (Pᵀ rounded to bf16 straight from the Sᵀ registers, as the
//                          forward's P; dO by ldmatrix.trans)
//   dPᵀ = V dOᵀ
//   dSᵀ = Pᵀ (dPᵀ - delta)
//   dK += dSᵀ Q           (dSᵀ rounded to bf16 from registers; Q by ldmatrix.trans)
// and dSᵀ (bf16) goes to shared memory. After a barrier the block computes the tile's
// dQ = dS K: warp w takes 16 queries and 64 dims of the BQ x D product (dS by ldmatrix.trans of
// the stored dSᵀ, K by ldmatrix.trans) and adds scale * dQ to dq_acc with f32 atomicAdd, zeros
// skipped (so dQ's summation order, and its last bits, vary from run to run). A warp skips the
// compute of a tile none of its keys is visible to (writing zeros for its dSᵀ rows). At the end
// dK * scale and dV are rounded to bf16 and stored. Tiles are stored with 16-byte chunk c of row
// r at chunk position c ^ (r % 8) (rows of 64 or 128 bf16; c ^ ((r / 2) % 4) for the 32-query
// dSᵀ rows: mma.cuh's tile_swizzle), so the 8 row addresses of every ldmatrix hit 8 distinct
// bank groups. Rows past the end of q, k, v or dout are zero-filled by the copy (src-size 0):
// padding holds zeros, never stale data, and is masked out.
#include "common.cuh"
#include "mma.cuh"

#define ABTC_BLOCK_K 64
#define ABTC_THREADS 128
#define ABTC_WARP_K 16
#define ABTC_LOG2E 1.4426950408889634f

// Queries per tile: 64 for head_dim 64, 32 for head_dim 128. Registers bound it: a lane holds
// D floats of dK and dV (the warp's 16 keys) and BQ more of Sᵀ and dPᵀ. ptxas (NVRTC 13.0,
// sm_90) gives 255 registers and no spills for either width; the loops over the contraction
// dimension that index no register array are kept rolled (`unroll 1`), which is what removes
// the spills at head_dim 128.
template <int D>
struct AbtcTile {
    static constexpr int BQ = D == 64 ? 64 : 32;
};

// Stages lse (log2 domain) and delta of queries t0 .. t0 + BQ - 1 of head h: rows at or past
// t_end, and rows that see no key (lse = -inf), get +inf and 0, so their P and dS are 0.
template <int BQ>
__device__ __forceinline__ void abtc_load_rows(float* lse_s, float* delta_s, const float* lse,
                                               const float* delta, int b, int t0, int t_end,
                                               int seq_q, int heads_q, int h) {
    for (int j = threadIdx.x; j < BQ; j += ABTC_THREADS) {
        const int t = t0 + j;
        float l = -SHARDC_INF;
        float di = 0.0f;
        if (t < t_end) {
            const i64 row = ((i64)b * seq_q + t) * heads_q + h;
            l = lse[row];
            di = delta[row];
        }
        const bool live = l != -SHARDC_INF;
        lse_s[j] = live ? l * ABTC_LOG2E : SHARDC_INF;
        delta_s[j] = live ? di : 0.0f;
    }
}

// acc[QB][4] (16 keys x BQ queries, C layout) = A B^T with A the warp's 16 rows of `a_s` (K or
// V, rows of D) and B the BQ rows of `b_s` (Q or dO): Sᵀ and dPᵀ.
template <int D, int BQ>
__device__ __forceinline__ void abtc_rows_by_queries(float (*acc)[4], const bf16* a_s,
                                                     const bf16* b_s, int kw, int lane) {
    const int mi = lane >> 3;
    mma_zero<BQ / 8>(acc);
#pragma unroll 1
    for (int ks = 0; ks < D / 16; ++ks) {
        unsigned af[4];  // A fragments: keys kw .. kw + 15, dims 16 ks .. 16 ks + 15
        ldmatrix_x4(af, a_s + tile_swizzle<D>(kw + (mi & 1) * 8 + (lane & 7), ks * 2 + (mi >> 1)));
#pragma unroll
        for (int nb = 0; nb < BQ / 8; nb += 2) {
            unsigned bfr[4];  // B fragments of query blocks nb and nb + 1
            const int row = (nb + (mi >> 1)) * 8 + (lane & 7);
            ldmatrix_x4(bfr, b_s + tile_swizzle<D>(row, ks * 2 + (mi & 1)));
            mma_bf16_16816(acc[nb], af, bfr);
            mma_bf16_16816(acc[nb + 1], af, bfr + 2);
        }
    }
}

template <int D>
__device__ __forceinline__ void attention_bwd_tc_impl(
    const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
    const float* delta, const float* mask, float* dq_acc, bf16* dk, bf16* dv, int batch,
    int seq_q, int seq_k, int heads_q, int heads_kv, float scale, int causal, int window,
    int q_offset) {
    constexpr int BQ = AbtcTile<D>::BQ;
    constexpr int QB = BQ / 8;                // 8-query blocks of a tile
    constexpr int DB = D / 8;                 // 8-dim blocks of a row
    constexpr int QSLABS = BQ / 16;           // 16-query slabs of the dQ product
    constexpr int DQ_DIMS = D * QSLABS / 4;   // dims of a warp's share of dQ (64)
    extern __shared__ float smem[];
    bf16* k_s = (bf16*)smem;                  // [64][D]
    bf16* v_s = k_s + ABTC_BLOCK_K * D;       // [64][D]
    bf16* q_s = v_s + ABTC_BLOCK_K * D;       // [2][BQ][D]
    bf16* do_s = q_s + 2 * BQ * D;            // [2][BQ][D]
    bf16* ds_s = do_s + 2 * BQ * D;           // [64][BQ]: dSᵀ of the current tile
    float* lse_s = (float*)(ds_s + ABTC_BLOCK_K * BQ);  // [2][BQ]
    float* delta_s = lse_s + 2 * BQ;                    // [2][BQ]

    const int b = blockIdx.z;
    const int hk = blockIdx.y;
    const int s0 = blockIdx.x * ABTC_BLOCK_K;
    if (b >= batch || hk >= heads_kv || s0 >= seq_k) return;  // uniform over the block
    const int group = heads_q / heads_kv;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;   // row of the fragments (and row + 8)
    const int c = lane & 3;    // column pair of the fragments
    const int mi = lane >> 3;  // the 8x8 matrix this lane addresses in an ldmatrix.x4

    // The queries that can see any key of the tile (block-uniform: the barriers below are
    // safe), walked in tiles of BQ for each query head of the group.
    const int s_last = min(s0 + ABTC_BLOCK_K, seq_k) - 1;
    const AttnRange queries = attn_queries_seeing(s0, s_last, seq_q, q_offset, causal, window);
    const int t_begin = queries.begin;
    const int t_end = queries.end;
    const int per_head = t_end > t_begin ? (t_end - t_begin + BQ - 1) / BQ : 0;
    const int n_tiles = per_head * group;

    // This warp's keys (rows g and g + 8 of its 16 for this lane).
    const int kw = warp * ABTC_WARP_K;
    const int wk0 = s0 + kw;
    const int wk_last = min(wk0 + ABTC_WARP_K, seq_k) - 1;
    int key[2];
    bool key_ok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        key[r] = wk0 + g + 8 * r;
        key_ok[r] = key[r] < seq_k && (mask == nullptr || mask[(i64)b * seq_k + key[r]] != 0.0f);
    }

    if (n_tiles > 0) {
        const int h0 = hk * group;
        cp_async_tile<D, ABTC_BLOCK_K, ABTC_THREADS>(k_s, k, b, s0, seq_k, seq_k, heads_kv, hk);
        cp_async_tile<D, ABTC_BLOCK_K, ABTC_THREADS>(v_s, v, b, s0, seq_k, seq_k, heads_kv, hk);
        cp_async_tile<D, BQ, ABTC_THREADS>(q_s, q, b, t_begin, t_end, seq_q, heads_q, h0);
        cp_async_tile<D, BQ, ABTC_THREADS>(do_s, dout, b, t_begin, t_end, seq_q, heads_q, h0);
        abtc_load_rows<BQ>(lse_s, delta_s, lse, delta, b, t_begin, t_end, seq_q, heads_q, h0);
    }
    cp_async_commit();

    const float scale_log2 = scale * ABTC_LOG2E;
    float dk_acc[DB][4], dv_acc[DB][4];
#pragma unroll
    for (int nb = 0; nb < DB; ++nb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) dk_acc[nb][i] = dv_acc[nb][i] = 0.0f;
    }

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        const int h = hk * group + it / per_head;
        const int t0 = t_begin + (it % per_head) * BQ;
        if (it + 1 < n_tiles) {
            // The other buffers were released by the barrier that ended the previous iteration.
            const int hn = hk * group + (it + 1) / per_head;
            const int tn = t_begin + ((it + 1) % per_head) * BQ;
            cp_async_tile<D, BQ, ABTC_THREADS>(q_s + (buf ^ 1) * BQ * D, q, b, tn, t_end, seq_q,
                                               heads_q, hn);
            cp_async_tile<D, BQ, ABTC_THREADS>(do_s + (buf ^ 1) * BQ * D, dout, b, tn, t_end, seq_q,
                                               heads_q, hn);
            abtc_load_rows<BQ>(lse_s + (buf ^ 1) * BQ, delta_s + (buf ^ 1) * BQ, lse, delta, b,
                               tn, t_end, seq_q, heads_q, hn);
            cp_async_commit();
            cp_async_wait<1>();  // all but the tile just issued: K, V and this tile have landed
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // every thread's copies (and lse/delta stores) of this tile visible

        const bf16* qt = q_s + buf * BQ * D;
        const bf16* dot = do_s + buf * BQ * D;
        const float* lt = lse_s + buf * BQ;
        const float* dt = delta_s + buf * BQ;
        const int t_last = min(t0 + BQ, t_end) - 1;

        // Warp-uniform: skip a tile none of whose queries sees any of this warp's keys (every P,
        // hence every dS, would be 0).
        const bool skip = wk0 >= seq_k || (causal && wk0 > t_last + q_offset) ||
                          (window > 0 && t0 + q_offset - wk_last >= window);
        if (!skip) {
            // Sᵀ, then Pᵀ in place.
            float st[QB][4];
            abtc_rows_by_queries<D, BQ>(st, k_s, qt, kw, lane);
            mma_for_each<QB>(lane, [&](int nb, int i, int j, int r) {
                const bool vis =
                    key_ok[r] && attn_visible(key[r], t0 + j + q_offset, causal, window);
                st[nb][i] = vis ? exp2f(st[nb][i] * scale_log2 - lt[j]) : 0.0f;
            });
            mma_acc_xb<D, BQ>(dv_acc, st, dot, lane);  // dV += Pᵀ dO

            // dPᵀ, then dSᵀ in place.
            float dst[QB][4];
            abtc_rows_by_queries<D, BQ>(dst, v_s, dot, kw, lane);
            mma_for_each<QB>(lane, [&](int nb, int i, int j, int) {
                dst[nb][i] = st[nb][i] * (dst[nb][i] - dt[j]);
            });
            mma_acc_xb<D, BQ>(dk_acc, dst, qt, lane);  // dK += dSᵀ Q

            // dSᵀ rows of the warp's keys to shared memory, two queries per 32-bit store.
#pragma unroll
            for (int nb = 0; nb < QB; ++nb) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    *(unsigned*)(ds_s + tile_swizzle<BQ>(kw + g + 8 * r, nb) + 2 * c) =
                        pack_bf16x2(dst[nb][2 * r], dst[nb][2 * r + 1]);
                }
            }
        } else {
#pragma unroll
            for (int nb = 0; nb < QB; ++nb) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    *(unsigned*)(ds_s + tile_swizzle<BQ>(kw + g + 8 * r, nb) + 2 * c) = 0u;
                }
            }
        }
        __syncthreads();  // the tile's dSᵀ complete

        // dQ = dS K: warp w takes queries 16 (w % QSLABS) .. + 15 and DQ_DIMS dims from
        // DQ_DIMS * (w / QSLABS); its rows past t_end have nothing to add (warp-uniform skip).
        const int qs = warp % QSLABS;
        const int d0 = (warp / QSLABS) * DQ_DIMS;
        if (t0 + qs * 16 < t_end) {
            float acc[DQ_DIMS / 8][4];
            mma_zero<DQ_DIMS / 8>(acc);
#pragma unroll 1
            for (int kk = 0; kk < ABTC_BLOCK_K / 16; ++kk) {
                unsigned af[4];  // A = dS (queries x keys 16 kk ..): the stored dSᵀ, transposed
                ldmatrix_x4_trans(af, ds_s + tile_swizzle<BQ>(kk * 16 + (mi >> 1) * 8 + (lane & 7),
                                                              qs * 2 + (mi & 1)));
#pragma unroll
                for (int nb = 0; nb < DQ_DIMS / 8; nb += 2) {
                    unsigned bfr[4];  // B = K (keys x dims), dim blocks nb and nb + 1
                    const int row = kk * 16 + (mi & 1) * 8 + (lane & 7);
                    ldmatrix_x4_trans(bfr, k_s + tile_swizzle<D>(row, d0 / 8 + nb + (mi >> 1)));
                    mma_bf16_16816(acc[nb], af, bfr);
                    mma_bf16_16816(acc[nb + 1], af, bfr + 2);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int t = t0 + qs * 16 + g + 8 * r;
                if (t >= t_end) continue;
                const i64 base = (((i64)b * seq_q + t) * heads_q + h) * D + d0;
#pragma unroll
                for (int nb = 0; nb < DQ_DIMS / 8; ++nb) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float x = acc[nb][2 * r + e];
                        if (x != 0.0f) atomicAdd(dq_acc + base + nb * 8 + 2 * c + e, scale * x);
                    }
                }
            }
        }
        __syncthreads();  // dSᵀ and this tile's buffers free for the next iteration
    }
    cp_async_wait<0>();  // nothing may still be landing when the block exits (n_tiles == 0)

    // Every key of the tile is written, masked or not seen by any query (zeros).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (key[r] >= seq_k) continue;
        const i64 base = (((i64)b * seq_k + key[r]) * heads_kv + hk) * D;
#pragma unroll
        for (int nb = 0; nb < DB; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int d = nb * 8 + 2 * c + e;
                store(dk, base + d, scale * dk_acc[nb][2 * r + e]);
                store(dv, base + d, dv_acc[nb][2 * r + e]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(ABTC_THREADS)
    attention_bwd_tc_bf16(const bf16* q, const bf16* k, const bf16* v, const bf16* dout,
                          const float* lse, const float* delta, const float* mask,
                          float* dq_acc, bf16* dk, bf16* dv, int batch, int seq_q, int seq_k,
                          int heads_q, int heads_kv, int head_dim, float scale, int causal,
                          int window, int q_offset) {
    if (blockDim.x != ABTC_THREADS || blockDim.y != 1 || blockDim.z != 1 || heads_kv <= 0 ||
        heads_q % heads_kv != 0) {
        __trap();
    }
    if (head_dim == 64) {
        attention_bwd_tc_impl<64>(q, k, v, dout, lse, delta, mask, dq_acc, dk, dv, batch, seq_q,
                                  seq_k, heads_q, heads_kv, scale, causal, window, q_offset);
    } else if (head_dim == 128) {
        attention_bwd_tc_impl<128>(q, k, v, dout, lse, delta, mask, dq_acc, dk, dv, batch,
                                   seq_q, seq_k, heads_q, heads_kv, scale, causal, window,
                                   q_offset);
    } else {
        __trap();
    }
}
