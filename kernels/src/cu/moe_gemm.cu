// moe_gemm.cu: mixture-of-experts expert GEMMs computed only on the tokens routed to each
// expert. The IR's dispatched activations are [E, N, H], expert-major (N = B*T tokens), with
// zero rows where a token's gate for the expert is 0 (moe.cu's dispatch); these kernels list
// each expert's routed tokens once and then multiply only those rows, instead of all E * N;
// the training backward's expert weight gradients likewise sum over those rows only.
//
// moe_route_index_{f32,bf16}(const T* gates, int* counts, int* rows, i64 tokens, int experts)
//     gates [tokens, experts]. For each expert e: counts[e] = the number of tokens n with
//     gates[n * experts + e] != 0, and rows[e * tokens + j] for j < counts[e] = those token
//     indices in ascending order (deterministic); rows [experts, tokens] past counts[e] are
//     left unspecified (not written). Launch: one block per expert, gridDim = (experts, 1, 1),
//     any blockDim.x multiple of 32 (the host uses 256), no dynamic shared memory. The block
//     walks the tokens in chunks of blockDim.x with a block-wide prefix scan of the flags
//     (within a warp by xor shuffles, across warps through shared memory).
//
// moe_route_positions_{f32,bf16}(const T* gates, const int* counts, const int* rows, int* pos,
//                                i64 tokens, int experts)
//     After moe_route_index, the inverse map of the packed rows: pos [tokens, experts],
//     pos[n * experts + e] = counts[0] + ... + counts[e - 1] + j where n is entry j of expert
//     e's list, -1 where gates[n * experts + e] == 0 (what dispatch, combine and their
//     gradients read a packed operand through, moe.cu). Same launch as moe_route_index.
//
// routed_gemm_{f32,bf16}(const T* a,          // [E, tokens, k]
//                        const T* w,          // [E, k, n], or [E, n, k] when transpose_w != 0
//                        T* out,              // [E, tokens, n]
//                        const int* counts,   // [E]          (moe_route_index)
//                        const int* rows,     // [E, tokens]  (moe_route_index)
//                        i64 tokens, int k, int n, int transpose_w, int packed)
//     All row-major contiguous. For every expert e and j < counts[e], with r = rows[e * tokens
//     + j]: out[e, r, :] = a[e, r, :] . w[e] (w[e] read transposed when transpose_w != 0),
//     accumulated in f32, bf16 output rounded to nearest even. Rows of out not listed are not
//     written (the caller zero-fills out first where they are read); rows past counts[e] are
//     never read.
//     Packed operands (bit 0 of `packed`: a, bit 1: out): [rows, k] (or [rows, n]) holding only
//     the routed rows, expert by expert, each expert's in its list's order: expert e's row j is
//     row counts[0] + ... + counts[e - 1] + j (a [E, tokens, ..] operand's is e * tokens + r).
//     A packed operand needs room for counts[0] + ... + counts[E - 1] rows; nothing past them
//     is read or written.
//     Launch (exactly): blockDim = (256, 1, 1); gridDim = (ceil(n / BN), ceil(tokens / BM), E);
//     dynamic shared memory routed_gemm_shared_bytes (launch.rs):
//       bf16: BM = BN = 128, BK = 32; 2 * (128 + 128) * 32 * 2 + 128 * 4 = 33280 bytes.
//       f32:  BM = BN = 64, BK = 16;  16 * (65 + 65) * 4 + 64 * 4 = 8576 bytes.
//     Another block shape traps. bf16 also requires k % 8 == 0, n % 8 == 0 (else it traps) and
//     a, w, out 16-byte aligned (rows are copied 16 bytes at a time with cp.async); the host
//     checks with launch::routed_gemm_supported. f32 takes any sizes and alignment.
//     Within expert e, block (x, y) has the linear index y * gridDim.x + x; the expert's
//     ceil(counts[e] / BM) * ceil(n / BN) output tiles are handed out in that order, row tiles
//     in groups of 8 that sweep the column tiles together (so the weight tiles read by a group
//     are shared in L2), and the blocks past the last tile return at once, so a launch costs
//     about the routed rows, not tokens * E.
//
// Structure of routed_gemm_bf16. A block owns a 128 x 128 tile of out[e]; its 128 token rows
// (rows[e * tokens + m0 ..]) are staged in shared memory, so the A tile is gathered through
// them and the result scattered through them. The K dimension is walked in tiles of 32, the A
// tile (128 rows x 32) and the W tile (32 x 128 for [k, n], 128 x 32 for [n, k]) double-buffered
// in shared memory with cp.async (the next tile in flight while the current one is computed).
// 8 warps as 2 x 4, each owning 64 rows x 32 columns: per 16-wide k step 4 A fragments by
// ldmatrix, 4 B fragments by ldmatrix ([n, k], mma's "col" layout as stored) or ldmatrix.trans
// ([k, n]), 16 mma.sync m16n8k16 into 64 f32 accumulators per lane. Tiles are stored with
// 16-byte chunks swizzled (mma.cuh's tile_swizzle) so every ldmatrix hits 8 distinct bank
// groups. Rows past counts[e], columns past n and k past its end are zero-filled by the copy
// (src-size 0); the stores are guarded (rows by the staged list, columns by n).
//
// routed_gemm_f32 is the same tiling on FMA: 64 x 64 tiles, k in tiles of 16 staged through
// shared memory (transposed, rows padded to 65 floats), each thread 4 x 4 outputs (rows ty +
// 16 i, columns tx + 16 j).
//
// routed_weight_grad_{f32,bf16}(const T* a,          // [E, tokens, k]
//                               const T* dy,         // [E, tokens, n]
//                               T* dw,               // [E, k, n], or [E, n, k] when transpose_w
//                               const int* counts,   // [E]          (moe_route_index)
//                               const int* rows,     // [E, tokens]  (moe_route_index)
//                               i64 tokens, int k, int n, int transpose_w, int packed)
//     a or dy may be packed as in routed_gemm (bit 0 of `packed`: a, bit 1: dy), expert e's
//     row j (its j-th listed token r) read there instead of row r of [E, tokens, ..].
//     The experts' weight gradients on their routed rows: all row-major contiguous; for every
//     expert e, with R_e = { rows[e * tokens + j] : j < counts[e] },
//       dw[e][i][c] (transpose_w == 0) or dw[e][c][i] (transpose_w != 0)
//         = sum over r in R_e of a[e, r, i] * dy[e, r, c],
//     accumulated in f32 without atomics (deterministic; f32 sums each element over the rows in
//     ascending j), bf16 output rounded to nearest even. Every element of dw is written (zeros
//     for an expert with counts[e] == 0); rows of a and dy not in R_e are never read (they may
//     hold anything, NaN included), nor are list entries past counts[e].
//     Launch (exactly): blockDim = (256, 1, 1); gridDim = (ceil(n / BN), ceil(k / BM), E), block
//     (x, y, z) owning the BM x BN tile of dw[z] at k rows y * BM.., n columns x * BN.. (in dw's
//     own layout for transpose_w); dynamic shared memory routed_weight_grad_shared_bytes
//     (launch.rs):
//       bf16: BM = BN = 128, 32 rows a chunk; 2 * 2 * 32 * 128 * 2 + 256 * 4 = 33792 bytes.
//       f32:  BM = BN = 64, 16 rows a chunk;  2 * 16 * 64 * 4 + 256 * 4 = 9216 bytes.
//     Another block shape traps. bf16 requires k % 8 == 0, n % 8 == 0 (else it traps) and a, dy,
//     dw 16-byte aligned (16-byte cp.async copies and stores); the host checks with
//     launch::routed_gemm_supported (both families). f32 takes any sizes and alignment.
//
// Structure of routed_weight_grad_bf16: a GEMM with M = k, N = n and the contraction over the
// expert's routed rows. The list is walked in chunks of 32 rows; the token rows of 256 list
// entries at a time (8 chunks) are staged in shared memory (-1 past counts[e]) and the chunk's
// rows of a (32 x 128 k) and dy (32 x 128 n) are gathered through them with cp.async, double-
// buffered (the next chunk in flight while the current one is computed), zero-filled past
// counts[e], k or n. 8 warps as 2 x 4, each owning 64 k x 32 n of the tile: per 16-row step 4 A
// fragments of aᵀ and 4 B fragments of dy, both by ldmatrix.trans from the row-major tiles (as
// routed_gemm reads [k, n] weights), 16 mma.sync m16n8k16 into 64 f32 accumulators per lane.
// The result is rounded to bf16 into shared memory (the freed chunk buffers) in dw's layout,
// [k][n] or transposed to [n][k], and stored as whole 16-byte chunks, guarded by k and n.
//
// routed_weight_grad_f32 is the same on FMA: 64 x 64 tiles, chunks of 16 rows of a and dy
// staged in shared memory, each thread 4 x 4 outputs (k rows ki + 16 i, n columns ni + 16 q,
// the half warp's 16 lanes along dw's rows so the stores are coalesced in either layout).
#include "common.cuh"
#include "mma.cuh"

#define RG_THREADS 256
#define RG_GROUP_M 8
// bf16 (tensor cores)
#define RG_BM 128
#define RG_BN 128
#define RG_BK 32
// f32 (FMA)
#define RGF_BM 64
#define RGF_BN 64
#define RGF_BK 16
#define RGF_PAD (RGF_BM + 1)

// acc[i][j] += sum over kk < RGF_BK of a[kk * a_ld + 16 * i] * b[kk * b_ld + 16 * j]: a thread's
// 4 x 4 outputs of a 64 x 64 f32 tile from the block's k-major shared tiles (`a`, `b` already
// offset to the thread's first row and column), FMAs in kk order. Shared by routed_gemm_f32
// and routed_weight_grad_f32.
__device__ __forceinline__ void rgf_fma_4x4(const float* a, int a_ld, const float* b, int b_ld,
                                            float (&acc)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < RGF_BK; ++kk) {
        float av[4];
        float bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) av[i] = a[kk * a_ld + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[j] = b[kk * b_ld + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
    }
}

// Two blocks per SM: at most 128 registers a thread. The emulator's __launch_bounds__ takes
// one argument.
#ifdef SHARDC_EMU
#define RG_LAUNCH_BOUNDS __launch_bounds__(RG_THREADS)
#else
#define RG_LAUNCH_BOUNDS __launch_bounds__(RG_THREADS, 2)
#endif

// ---- moe_route_index ---------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void route_index_impl(const T* gates, int* counts, int* rows,
                                                 i64 tokens, int experts) {
    __shared__ int warp_total[32];
    if ((blockDim.x & 31) != 0 || blockDim.y != 1 || blockDim.z != 1) __trap();
    const int e = blockIdx.x;
    if (e >= experts) return;  // uniform over the block
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    int* list = rows + (i64)e * tokens;
    int listed = 0;  // tokens listed by the chunks before this one (the same in every thread)
    for (i64 t0 = 0; t0 < tokens; t0 += blockDim.x) {
        const i64 t = t0 + threadIdx.x;
        const int flag = t < tokens && load(gates, t * experts + e) != 0.0f;
        // Inclusive scan of the warp's flags by xor butterflies: after the step with offset o,
        // `total` is the sum over the aligned 2o lanes around this lane and `incl` this lane's
        // inclusive prefix within them.
        int incl = flag;
        int total = flag;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int other = __shfl_xor_sync(SHARDC_FULL_MASK, total, o);
            if (lane & o) incl += other;
            total += other;
        }
        if (lane == 0) warp_total[warp] = total;
        __syncthreads();
        int before = listed;
        int chunk = 0;
        for (int w = 0; w < warps; ++w) {
            const int s = warp_total[w];
            if (w < warp) before += s;
            chunk += s;
        }
        if (flag) list[before + incl - 1] = (int)t;
        listed += chunk;
        __syncthreads();  // warp_total is rewritten by the next chunk
    }
    if (threadIdx.x == 0) counts[e] = listed;
}

#define SHARDC_MOE_ROUTE_INDEX(NAME, T)                                                     \
    extern "C" __global__ void NAME(const T* gates, int* counts, int* rows, i64 tokens,     \
                                    int experts) {                                          \
        route_index_impl(gates, counts, rows, tokens, experts);                             \
    }

SHARDC_MOE_ROUTE_INDEX(moe_route_index_f32, float)
SHARDC_MOE_ROUTE_INDEX(moe_route_index_bf16, bf16)

// After moe_route_index: pos[n * experts + e] = the packed row of expert e's token n (its
// list position plus counts[0] + ... + counts[e - 1]), -1 where the gate is zero.
template <typename T>
__device__ __forceinline__ void route_positions_impl(const T* gates, const int* counts,
                                                     const int* rows, int* pos, i64 tokens,
                                                     int experts) {
    const int e = blockIdx.x;
    if (e >= experts) return;
    i64 offs = 0;
    for (int i = 0; i < e; ++i) offs += counts[i];
    for (i64 n = threadIdx.x; n < tokens; n += blockDim.x) {
        if (load(gates, n * experts + e) == 0.0f) pos[n * experts + e] = -1;
    }
    const int* list = rows + (i64)e * tokens;
    for (int j = threadIdx.x; j < counts[e]; j += blockDim.x) {
        pos[(i64)list[j] * experts + e] = (int)(offs + j);
    }
}

#define SHARDC_MOE_ROUTE_POSITIONS(NAME, T)                                                 \
    extern "C" __global__ void NAME(const T* gates, const int* counts, const int* rows,     \
                                    int* pos, i64 tokens, int experts) {                    \
        route_positions_impl(gates, counts, rows, pos, tokens, experts);                    \
    }

SHARDC_MOE_ROUTE_POSITIONS(moe_route_positions_f32, float)
SHARDC_MOE_ROUTE_POSITIONS(moe_route_positions_bf16, bf16)

// ---- routed_gemm: tiles -------------------------------------------------------------------------

// The output tile of this block for an expert with `count` routed rows: its first row (in the
// routed list) and first column, or false when the block has none (see the header: the
// expert's tiles in the order of the blocks' linear index, row tiles grouped by RG_GROUP_M).
template <int BM, int BN>
__device__ __forceinline__ bool routed_tile(int count, int n, int* m0, int* n0) {
    const i64 tiles_m = (count + BM - 1) / BM;
    const i64 tiles_n = (n + BN - 1) / BN;
    const i64 id = (i64)blockIdx.y * gridDim.x + blockIdx.x;
    if (id >= tiles_m * tiles_n) return false;
    const i64 per_group = RG_GROUP_M * tiles_n;
    const i64 group = id / per_group;
    const i64 first_m = group * RG_GROUP_M;
    const i64 group_m = min(tiles_m - first_m, (i64)RG_GROUP_M);
    const i64 in_group = id - group * per_group;
    *m0 = (int)(first_m + in_group % group_m) * BM;
    *n0 = (int)(in_group / group_m) * BN;
    return true;
}

// Stages the token rows of list entries m0 .. m0 + ROWS - 1 (-1 past count) in row_s.
template <int ROWS>
__device__ __forceinline__ void stage_rows(int* row_s, const int* list, int m0, int count) {
    for (int j = threadIdx.x; j < ROWS; j += RG_THREADS) {
        row_s[j] = m0 + j < count ? list[m0 + j] : -1;
    }
}

// Where one operand's rows of expert e lie. Dense ([E, tokens, width]): row e * tokens + the
// token. Packed ([rows, width], the experts' routed rows back to back in expert order, each
// expert's in its list's order): row offs_e + the list position, offs_e = counts[0] + ... +
// counts[e - 1].
struct RowMap {
    i64 base;
    bool packed;
};

__device__ __forceinline__ RowMap row_map(const int* counts, int e, i64 tokens, bool packed) {
    i64 offs = 0;
    if (packed) {
        for (int i = 0; i < e; ++i) offs += counts[i];
    }
    return RowMap{packed ? offs : (i64)e * tokens, packed};
}

// The row of list position `pos`, whose token is `token`.
__device__ __forceinline__ i64 map_row(RowMap m, int token, int pos) {
    return m.base + (m.packed ? pos : token);
}

// A warp's 16-wide k step of its 64 x 32 tile: acc[mt][nb] (16 x 8 f32 C fragments) += A
// fragment mt (16 x 16) times B column block nb (16 x 8, block nb's two registers at
// bfr[nb / 2] + 2 * (nb % 2)). Shared by routed_gemm_bf16 and routed_weight_grad_bf16.
__device__ __forceinline__ void rg_mma_4x4(float (&acc)[4][4][4], const unsigned (&af)[4][4],
                                           const unsigned (&bfr)[2][4]) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int nb = 0; nb < 4; ++nb) {
            mma_bf16_16816(acc[mt][nb], af[mt], bfr[nb >> 1] + (nb & 1) * 2);
        }
    }
}

// ---- routed_gemm_bf16: tensor cores ------------------------------------------------------------

// Starts the copies of K tile k0 (A: the block's 128 gathered rows x 32; W: 32 x 128 of [k, n]
// or 128 x 32 of [n, k]) into a_s and b_s, zero-filling whatever lies past count, k or n.
// a_row[i] is this thread's A row (rows aj and aj + 64, chunk ach), null past count.
template <bool TRANS_W>
__device__ __forceinline__ void rg_issue_tile(bf16* a_s, bf16* b_s, const bf16* const* a_row,
                                              const bf16* a, const bf16* w_e, int k0, int k,
                                              int n, int n0) {
    const int tid = threadIdx.x;
    const int aj = tid >> 2;
    const int ach = tid & 3;
    const int kc = k0 + ach * 8;  // first k of this thread's chunk in the 32-wide rows
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const bool ok = a_row[i] != nullptr && kc < k;
        cp_async_cg16(a_s + tile_swizzle<RG_BK>(aj + 64 * i, ach), ok ? a_row[i] + kc : a,
                      ok ? 16 : 0);
    }
    if (TRANS_W) {  // W [n, k]: rows n0 + aj (+ 64) of 32 k, like A
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int col = n0 + aj + 64 * i;
            const bool ok = col < n && kc < k;
            cp_async_cg16(b_s + tile_swizzle<RG_BK>(aj + 64 * i, ach),
                          ok ? w_e + (i64)col * k + kc : w_e, ok ? 16 : 0);
        }
    } else {  // W [k, n]: rows k0 + bj (+ 16) of 128 n, 16 chunks each
        const int bj = tid >> 4;
        const int bch = tid & 15;
        const int col = n0 + bch * 8;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int kr = k0 + bj + 16 * i;
            const bool ok = kr < k && col < n;
            cp_async_cg16(b_s + tile_swizzle<RG_BN>(bj + 16 * i, bch),
                          ok ? w_e + (i64)kr * n + col : w_e, ok ? 16 : 0);
        }
    }
}

template <bool TRANS_W>
__device__ __forceinline__ void routed_gemm_tc(const bf16* a, const bf16* w, bf16* out,
                                               const int* counts, const int* rows, i64 tokens,
                                               int k, int n, int packed) {
    if ((k & 7) != 0 || (n & 7) != 0) __trap();
    extern __shared__ float smem[];
    bf16* a_s = (bf16*)smem;                          // [2][128 x 32]
    bf16* b_s = a_s + 2 * RG_BM * RG_BK;              // [2][32 x 128] or [2][128 x 32]
    int* row_s = (int*)(b_s + 2 * RG_BN * RG_BK);     // [128]

    const int e = blockIdx.z;
    const int count = counts[e];
    int m0, n0;
    if (!routed_tile<RG_BM, RG_BN>(count, n, &m0, &n0)) return;  // uniform over the block

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;   // row of the C fragments (and row + 8)
    const int c = lane & 3;    // column pair of the C fragments
    const int mi = lane >> 3;  // the 8x8 matrix this lane addresses in an ldmatrix.x4
    const int wm = warp >> 2;  // the warp's rows: 64 wm .. 64 wm + 63 of the tile
    const int wn = warp & 3;   // the warp's columns: 32 wn .. 32 wn + 31

    stage_rows<RG_BM>(row_s, rows + (i64)e * tokens, m0, count);
    __syncthreads();

    const RowMap am = row_map(counts, e, tokens, packed & 1);
    const RowMap om = row_map(counts, e, tokens, packed & 2);
    const bf16* w_e = w + (i64)e * k * n;
    const bf16* a_row[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int j = (tid >> 2) + 64 * i;
        const int r = row_s[j];
        a_row[i] = r >= 0 ? a + map_row(am, r, m0 + j) * k : nullptr;
    }

    float acc[4][4][4];  // [m block of 16][n block of 8][C fragment]
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) mma_zero<4>(acc[mt]);

    const int k_tiles = (k + RG_BK - 1) / RG_BK;
    if (k_tiles > 0) {
        rg_issue_tile<TRANS_W>(a_s, b_s, a_row, a, w_e, 0, k, n, n0);
        cp_async_commit();
    }
    for (int it = 0; it < k_tiles; ++it) {
        const int buf = it & 1;
        if (it + 1 < k_tiles) {
            // The other buffer was released by the barrier that ended the previous iteration.
            rg_issue_tile<TRANS_W>(a_s + (buf ^ 1) * RG_BM * RG_BK,
                                   b_s + (buf ^ 1) * RG_BN * RG_BK, a_row, a, w_e,
                                   (it + 1) * RG_BK, k, n, n0);
            cp_async_commit();
            cp_async_wait<1>();  // all but the tile just issued
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // every thread's copies of this tile visible to all

        const bf16* at = a_s + buf * RG_BM * RG_BK;
        const bf16* bt = b_s + buf * RG_BN * RG_BK;
#pragma unroll
        for (int ks = 0; ks < RG_BK / 16; ++ks) {
            unsigned af[4][4];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                const int row = wm * 64 + mt * 16 + (mi & 1) * 8 + (lane & 7);
                ldmatrix_x4(af[mt], at + tile_swizzle<RG_BK>(row, ks * 2 + (mi >> 1)));
            }
            unsigned bfr[2][4];  // B fragments of column blocks 2p and 2p + 1 of the warp's 4
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                if (TRANS_W) {
                    const int row = wn * 32 + (2 * p + (mi >> 1)) * 8 + (lane & 7);
                    ldmatrix_x4(bfr[p], bt + tile_swizzle<RG_BK>(row, ks * 2 + (mi & 1)));
                } else {
                    const int row = ks * 16 + (mi & 1) * 8 + (lane & 7);
                    ldmatrix_x4_trans(bfr[p],
                                      bt + tile_swizzle<RG_BN>(row, wn * 4 + 2 * p + (mi >> 1)));
                }
            }
            rg_mma_4x4(acc, af, bfr);
        }
        __syncthreads();  // this buffer is free for the copy issued next iteration
    }

#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = wm * 64 + mt * 16 + g + 8 * h;
            const int r = row_s[j];
            if (r < 0) continue;
            bf16* orow = out + map_row(om, r, m0 + j) * n;
#pragma unroll
            for (int nb = 0; nb < 4; ++nb) {
                const int col = n0 + wn * 32 + nb * 8 + 2 * c;
                if (col < n) {
                    *(unsigned*)(orow + col) =
                        pack_bf16x2(acc[mt][nb][2 * h], acc[mt][nb][2 * h + 1]);
                }
            }
        }
    }
}

// ---- routed_gemm_f32: FMA ----------------------------------------------------------------------

template <bool TRANS_W>
__device__ __forceinline__ void routed_gemm_fma(const float* a, const float* w, float* out,
                                                const int* counts, const int* rows, i64 tokens,
                                                int k, int n, int packed) {
    extern __shared__ float smem[];
    float* a_s = smem;                      // [16][65]: a_s[kk][j] = A[row j][k0 + kk]
    float* b_s = a_s + RGF_BK * RGF_PAD;    // [16][65]: b_s[kk][col] = W[k0 + kk][n0 + col]
    int* row_s = (int*)(b_s + RGF_BK * RGF_PAD);  // [64]

    const int e = blockIdx.z;
    const int count = counts[e];
    int m0, n0;
    if (!routed_tile<RGF_BM, RGF_BN>(count, n, &m0, &n0)) return;  // uniform over the block

    const int tid = threadIdx.x;
    const int tx = tid & 15;  // columns tx + 16 j
    const int ty = tid >> 4;  // rows ty + 16 i

    stage_rows<RGF_BM>(row_s, rows + (i64)e * tokens, m0, count);
    __syncthreads();

    const RowMap am = row_map(counts, e, tokens, packed & 1);
    const RowMap om = row_map(counts, e, tokens, packed & 2);
    const float* w_e = w + (i64)e * k * n;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    }

    for (int k0 = 0; k0 < k; k0 += RGF_BK) {
        // 64 x 16 of A and 16 x 64 of W, 4 elements a thread each, zeros past the ends.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tid + RG_THREADS * i;
            const int j = idx >> 4;   // row of A, or column of a [n, k] W
            const int kk = idx & 15;  // k within the tile, 16 consecutive per row
            const int r = row_s[j];
            const bool kin = k0 + kk < k;
            a_s[kk * RGF_PAD + j] = r >= 0 && kin ? a[map_row(am, r, m0 + j) * k + k0 + kk] : 0.0f;
            if (TRANS_W) {
                const int col = n0 + j;
                b_s[kk * RGF_PAD + j] = col < n && kin ? w_e[(i64)col * k + k0 + kk] : 0.0f;
            } else {
                const int kr = idx >> 6;   // k within the tile
                const int cc = idx & 63;   // column, 64 consecutive per k
                const bool ok = k0 + kr < k && n0 + cc < n;
                b_s[kr * RGF_PAD + cc] = ok ? w_e[(i64)(k0 + kr) * n + n0 + cc] : 0.0f;
            }
        }
        __syncthreads();
        rgf_fma_4x4(a_s + ty, RGF_PAD, b_s + tx, RGF_PAD, acc);
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = row_s[ty + 16 * i];
        if (r < 0) continue;
        float* orow = out + map_row(om, r, m0 + ty + 16 * i) * n;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = n0 + tx + 16 * j;
            if (col < n) orow[col] = acc[i][j];
        }
    }
}


// ---- routed_weight_grad: tiles ------------------------------------------------------------------

// The K loop of routed_weight_grad walks the expert's routed list in chunks of BK rows; the
// token rows of RWG_WINDOW consecutive list entries (one per thread) are staged in shared
// memory at a time (-1 past count), refreshed every RWG_WINDOW / BK chunks.
#define RWG_WINDOW RG_THREADS

// ---- routed_weight_grad_bf16: tensor cores -----------------------------------------------------

// Starts the copies of the row chunk whose staged token rows are rw[0 .. RG_BK - 1] (-1 past
// count), list positions pos0 ..: A tile = a's row (am) k0 .. k0 + 127, D tile = dy's row (dm)
// n0 .. n0 + 127, both RG_BK x 128 (rows of 16 chunks), zero-filled where the row is -1 or the
// chunk lies past k or n.
__device__ __forceinline__ void rwg_issue_chunk(bf16* a_s, bf16* d_s, const int* rw, int pos0,
                                                const bf16* a, RowMap am, const bf16* dy,
                                                RowMap dm, int k, int n, int k0, int n0) {
    const int tid = threadIdx.x;
    const int bj = tid >> 4;   // rows bj and bj + 16 of the chunk
    const int bch = tid & 15;  // 16-byte chunk of the row
    const int kc = k0 + bch * 8;
    const int nc = n0 + bch * 8;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int j = bj + 16 * i;
        const int r = rw[j];
        const bool aok = r >= 0 && kc < k;
        const bool dok = r >= 0 && nc < n;
        cp_async_cg16(a_s + tile_swizzle<RG_BM>(j, bch),
                      aok ? a + map_row(am, r, pos0 + j) * k + kc : a, aok ? 16 : 0);
        cp_async_cg16(d_s + tile_swizzle<RG_BN>(j, bch),
                      dok ? dy + map_row(dm, r, pos0 + j) * n + nc : dy, dok ? 16 : 0);
    }
}

template <bool TRANS_W>
__device__ __forceinline__ void routed_weight_grad_tc(const bf16* a, const bf16* dy, bf16* dw,
                                                      const int* counts, const int* rows,
                                                      i64 tokens, int k, int n, int packed) {
    if ((k & 7) != 0 || (n & 7) != 0) __trap();
    extern __shared__ float smem[];
    bf16* a_s = (bf16*)smem;                        // [2][32 rows x 128 k]
    bf16* d_s = a_s + 2 * RG_BK * RG_BM;            // [2][32 rows x 128 n]
    int* row_s = (int*)(d_s + 2 * RG_BK * RG_BN);   // [RWG_WINDOW]

    const int e = blockIdx.z;
    const int k0 = blockIdx.y * RG_BM;
    const int n0 = blockIdx.x * RG_BN;
    if (k0 >= k || n0 >= n) return;  // uniform over the block (only for a grid too large)
    const int count = counts[e];
    const int* list = rows + (i64)e * tokens;
    const RowMap am = row_map(counts, e, tokens, packed & 1);
    const RowMap dm = row_map(counts, e, tokens, packed & 2);

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;   // row of the C fragments (and row + 8)
    const int c = lane & 3;    // column pair of the C fragments
    const int mi = lane >> 3;  // the 8x8 matrix this lane addresses in an ldmatrix.x4
    const int wm = warp >> 2;  // the warp's k rows: 64 wm .. 64 wm + 63 of the tile
    const int wn = warp & 3;   // the warp's n columns: 32 wn .. 32 wn + 31

    float acc[4][4][4];  // [k block of 16][n block of 8][C fragment]
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) mma_zero<4>(acc[mt]);

    const int chunks = (count + RG_BK - 1) / RG_BK;
    if (chunks > 0) {
        stage_rows<RWG_WINDOW>(row_s, list, 0, count);
        __syncthreads();
        rwg_issue_chunk(a_s, d_s, row_s, 0, a, am, dy, dm, k, n, k0, n0);
        cp_async_commit();
    }
    for (int it = 0; it < chunks; ++it) {
        const int buf = it & 1;
        if (it + 1 < chunks) {
            const int j1 = (it + 1) * RG_BK;
            if (j1 % RWG_WINDOW == 0) {
                // The window's last rows were read when chunk `it` was issued, before the
                // barriers of the previous iteration.
                stage_rows<RWG_WINDOW>(row_s, list, j1, count);
                __syncthreads();
            }
            // The other buffer was released by the barrier that ended the previous iteration.
            rwg_issue_chunk(a_s + (buf ^ 1) * RG_BK * RG_BM, d_s + (buf ^ 1) * RG_BK * RG_BN,
                            row_s + j1 % RWG_WINDOW, j1, a, am, dy, dm, k, n, k0, n0);
            cp_async_commit();
            cp_async_wait<1>();  // all but the chunk just issued
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // every thread's copies of this chunk visible to all

        const bf16* at = a_s + buf * RG_BK * RG_BM;
        const bf16* dt = d_s + buf * RG_BK * RG_BN;
#pragma unroll
        for (int ks = 0; ks < RG_BK / 16; ++ks) {
            // A = aᵀ (k x rows): the tile holds it transposed (rows x k), so ldmatrix.trans;
            // matrix mi covers rows ks * 16 + 8 (mi >> 1) .. + 7 and k 8 (mi & 1) .. + 7.
            unsigned af[4][4];
            const int arow = ks * 16 + (mi >> 1) * 8 + (lane & 7);
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                ldmatrix_x4_trans(af[mt],
                                  at + tile_swizzle<RG_BM>(arow, wm * 8 + mt * 2 + (mi & 1)));
            }
            // B = dy (rows x n), as routed_gemm's [k, n] weights.
            unsigned bfr[2][4];  // B fragments of column blocks 2p and 2p + 1 of the warp's 4
            const int brow = ks * 16 + (mi & 1) * 8 + (lane & 7);
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                ldmatrix_x4_trans(bfr[p],
                                  dt + tile_swizzle<RG_BN>(brow, wn * 4 + 2 * p + (mi >> 1)));
            }
            rg_mma_4x4(acc, af, bfr);
        }
        __syncthreads();  // this buffer is free for the copy issued next iteration
    }

    // The 128 x 128 tile goes through shared memory (bf16, swizzled, in dw's layout: k rows of
    // n, or n rows of k), so the global stores are whole 16-byte chunks. The tile buffers are
    // free: the loop ended with a barrier (and no chunk means they were never used).
    bf16* o_s = a_s;  // 128 x 128: the A and D buffers, both halves
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int kl = wm * 64 + mt * 16 + g + 8 * h;
#pragma unroll
            for (int nb = 0; nb < 4; ++nb) {
                const int nl = wn * 32 + nb * 8 + 2 * c;
                const float v0 = acc[mt][nb][2 * h];
                const float v1 = acc[mt][nb][2 * h + 1];
                if (TRANS_W) {
                    o_s[tile_swizzle<RG_BM>(nl, kl >> 3) + (kl & 7)] = f32_to_bf16(v0);
                    o_s[tile_swizzle<RG_BM>(nl + 1, kl >> 3) + (kl & 7)] = f32_to_bf16(v1);
                } else {
                    *(unsigned*)(o_s + tile_swizzle<RG_BN>(kl, nl >> 3) + (nl & 7)) =
                        pack_bf16x2(v0, v1);
                }
            }
        }
    }
    __syncthreads();
    // dw[e] rows r0 + rr (up to `rows_end`) of `width`, chunks from column c0 (up to `cols_end`)
    const int r0 = TRANS_W ? n0 : k0;
    const int c0 = TRANS_W ? k0 : n0;
    const int rows_end = TRANS_W ? n : k;
    const int width = TRANS_W ? k : n;
    bf16* dw_e = dw + (i64)e * k * n;
    for (int idx = tid; idx < RG_BM * (RG_BN / 8); idx += RG_THREADS) {
        const int rr = idx >> 4;
        const int ch = idx & 15;
        const int row = r0 + rr;
        const int col = c0 + ch * 8;
        if (row < rows_end && col < width) {
            *(uint4*)(dw_e + (i64)row * width + col) =
                *(const uint4*)(o_s + tile_swizzle<RG_BN>(rr, ch));
        }
    }
}

// ---- routed_weight_grad_f32: FMA ---------------------------------------------------------------

template <bool TRANS_W>
__device__ __forceinline__ void routed_weight_grad_fma(const float* a, const float* dy,
                                                       float* dw, const int* counts,
                                                       const int* rows, i64 tokens, int k,
                                                       int n, int packed) {
    extern __shared__ float smem[];
    float* a_s = smem;                          // [16][64]: a_s[j][i] = a[e, row j, k0 + i]
    float* d_s = a_s + RGF_BK * RGF_BM;         // [16][64]: d_s[j][c] = dy[e, row j, n0 + c]
    int* row_s = (int*)(d_s + RGF_BK * RGF_BN); // [RWG_WINDOW]

    const int e = blockIdx.z;
    const int k0 = blockIdx.y * RGF_BM;
    const int n0 = blockIdx.x * RGF_BN;
    if (k0 >= k || n0 >= n) return;  // uniform over the block (only for a grid too large)
    const int count = counts[e];
    const int* list = rows + (i64)e * tokens;
    const RowMap am = row_map(counts, e, tokens, packed & 1);
    const RowMap dm = row_map(counts, e, tokens, packed & 2);

    // Thread tid owns k rows ki + 16 i and n columns ni + 16 q; the 16 lanes of a half warp
    // run along dw's rows (n for [k, n], k for [n, k]), so the stores are coalesced.
    const int tid = threadIdx.x;
    const int ki = TRANS_W ? tid & 15 : tid >> 4;
    const int ni = TRANS_W ? tid >> 4 : tid & 15;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    }

    for (int j0 = 0; j0 < count; j0 += RGF_BK) {
        if (j0 % RWG_WINDOW == 0) {
            // The previous window was last read before the barrier that ended the last chunk.
            stage_rows<RWG_WINDOW>(row_s, list, j0, count);
            __syncthreads();
        }
        // 16 rows x 64 of a and of dy, 4 elements a thread each, zeros past the ends.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tid + RG_THREADS * i;
            const int j = idx >> 6;    // row of the chunk
            const int cc = idx & 63;   // k (a) or n (dy) within the tile
            const int r = row_s[j0 % RWG_WINDOW + j];
            a_s[idx] = r >= 0 && k0 + cc < k ? a[map_row(am, r, j0 + j) * k + k0 + cc] : 0.0f;
            d_s[idx] = r >= 0 && n0 + cc < n ? dy[map_row(dm, r, j0 + j) * n + n0 + cc] : 0.0f;
        }
        __syncthreads();
        rgf_fma_4x4(a_s + ki, RGF_BM, d_s + ni, RGF_BN, acc);
        __syncthreads();
    }

    float* dw_e = dw + (i64)e * k * n;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int kr = k0 + ki + 16 * i;
        if (kr >= k) continue;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int col = n0 + ni + 16 * q;
            if (col >= n) continue;
            if (TRANS_W) {
                dw_e[(i64)col * k + kr] = acc[i][q];
            } else {
                dw_e[(i64)kr * n + col] = acc[i][q];
            }
        }
    }
}

// One signature for the four GEMM entries (a, the weights or dy, the output, the routing lists,
// sizes, layout); IMPL is routed_gemm_fma / routed_gemm_tc (f32 / bf16) or routed_weight_grad_fma
// / routed_weight_grad_tc.
#define SHARDC_ROUTED(NAME, T, IMPL)                                                          \
    extern "C" __global__ void RG_LAUNCH_BOUNDS NAME(const T* a, const T* b, T* out,          \
                                                     const int* counts, const int* rows,      \
                                                     i64 tokens, int k, int n,                \
                                                     int transpose_w, int packed) {           \
        if (blockDim.x != RG_THREADS || blockDim.y != 1 || blockDim.z != 1) __trap();         \
        if (transpose_w) {                                                                    \
            IMPL<true>(a, b, out, counts, rows, tokens, k, n, packed);                        \
        } else {                                                                              \
            IMPL<false>(a, b, out, counts, rows, tokens, k, n, packed);                       \
        }                                                                                     \
    }

SHARDC_ROUTED(routed_gemm_f32, float, routed_gemm_fma)
SHARDC_ROUTED(routed_gemm_bf16, bf16, routed_gemm_tc)
SHARDC_ROUTED(routed_weight_grad_f32, float, routed_weight_grad_fma)
SHARDC_ROUTED(routed_weight_grad_bf16, bf16, routed_weight_grad_tc)
