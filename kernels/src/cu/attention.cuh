// attention.cuh: the scalar attention core (tiled over keys, online softmax, f32 FMA, f32
// accumulation) shared by attention.cu and attention_decode.cu. Include after common.cuh.
//
// A block of ATTN_THREADS threads owns 16 query rows that all read one KV head hk. Row r
// (r = row0 .. row0 + 15, of `rows` in all) is query t = r / group of query head
// h = h_base + r % group: attention.cu has group 1 (16 queries of one head), attention_decode.cu
// packs the `group` query heads of a GQA group (t-major) so K and V are read once per group.
// Each of the 4 warps owns 4 rows. Key tiles of 32 rows go through shared memory; in the score
// phase lane j owns key j of the tile, in the PV phase lane l owns dims l, l+32, ... Tiles are
// stored with an XOR swizzle (column d of row j at j*Dp + (d ^ j)), which keeps both phases free
// of bank conflicts without padding. Dynamic shared memory: (16 + 32) * ceil32(D) * 4 bytes.
#ifndef SHARDC_ATTENTION_CUH
#define SHARDC_ATTENTION_CUH

#define ATTN_BLOCK_Q 16
#define ATTN_BLOCK_K 32
#define ATTN_THREADS 128
#define ATTN_Q_PER_WARP 4
#define ATTN_MAX_CHUNKS 8  // head_dim <= 8 * 32

// The launch checks both kernels share; traps (a loud error, not silently wrong output).
__device__ __forceinline__ void attn_check_launch(int head_dim, int heads_q, int heads_kv) {
    if (blockDim.x != ATTN_THREADS || head_dim <= 0 || head_dim > 32 * ATTN_MAX_CHUNKS ||
        heads_kv <= 0 || heads_q % heads_kv != 0) {
        __trap();
    }
}

// One block's 16 rows (see the top of the file) against the keys s_lo <= s < s_hi they can see:
// on return the calling warp's rows have row max m (-inf when no key was visible), row sum l
// (0 then) and unnormalised acc[r][c] for dim lane + 32 c. Every thread of the block must call
// it (it synchronises); the arguments must be block-uniform.
template <typename T>
__device__ __forceinline__ void attn_rows(const T* q, const T* k, const T* v, const float* mask,
                                          int b, int seq_q, int seq_k, int heads_q, int heads_kv,
                                          int head_dim, float scale, int causal, int window,
                                          int q_offset, int hk, int h_base, int group, int rows,
                                          int row0, int s_lo, int s_hi,
                                          float m[ATTN_Q_PER_WARP], float l[ATTN_Q_PER_WARP],
                                          float acc[ATTN_Q_PER_WARP][ATTN_MAX_CHUNKS]) {
    extern __shared__ float smem[];
    const int dp = (head_dim + 31) & ~31;
    const int nchunk = dp >> 5;
    float* q_s = smem;                        // [ATTN_BLOCK_Q][dp], plain layout (broadcast reads)
    float* kv_s = smem + ATTN_BLOCK_Q * dp;   // [ATTN_BLOCK_K][dp], swizzled
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;

    for (int idx = threadIdx.x; idx < ATTN_BLOCK_Q * dp; idx += blockDim.x) {
        const int qi = idx / dp;
        const int d = idx - qi * dp;
        const int r = row0 + qi;
        float val = 0.0f;
        if (r < rows && d < head_dim) {
            const int t = r / group;
            const int h = h_base + r % group;
            val = load(q, (((i64)b * seq_q + t) * heads_q + h) * head_dim + d);
        }
        q_s[idx] = val;
    }

    // Keys any row of this block can see (block-uniform, so the barriers below are safe).
    const int t_first = row0 / group;
    const int t_last = (min(row0 + ATTN_BLOCK_Q, rows) - 1) / group;
    const AttnRange keys =
        attn_keys_seen(t_first, t_last, q_offset, causal, window, s_lo, min(s_hi, seq_k));
    const int s_begin = keys.begin;
    const int s_end = keys.end;

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

        // Scores: lane j against key s0 + j, for the warp's 4 rows.
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
            const int row = row0 + warp * ATTN_Q_PER_WARP + r;
            const int tp = row / group + q_offset;
            const bool visible = key_ok && row < rows && attn_visible(s, tp, causal, window);
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
}

#endif  // SHARDC_ATTENTION_CUH
