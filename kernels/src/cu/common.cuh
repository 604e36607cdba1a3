// common.cuh: shared helpers for every shardc kernel source.
//
// Self-contained on purpose: no CUDA headers, so NVRTC needs no include path. bf16 is stored
// as `unsigned short` (the top 16 bits of an IEEE f32) and converted with bit casts; all
// arithmetic happens in f32. The Rust side pastes this file in place of the
// `#include "common.cuh"` line of each `.cu` source before compiling.
//
// Conventions used by every kernel:
//   * element counts and offsets are `long long` (i64) so tensors above 2^31 elements work;
//   * elementwise kernels use grid-stride loops, any grid/block shape is valid;
//   * row kernels (norms, softmax, loss) walk rows with a block-stride loop over blockIdx.x and
//     need blockDim.x to be a multiple of 32 and at most 1024;
//   * `*_bf16` entry points read and write bf16 and accumulate in f32;
//   * memory-bound kernels access 16 bytes at a time where the addresses allow it and fall back
//     to scalar accesses where they do not (see "128-bit vector access" below); the results
//     are the same either way.

#ifndef SHARDC_COMMON_CUH
#define SHARDC_COMMON_CUH

typedef unsigned short bf16;
typedef long long i64;

#define SHARDC_INF (__int_as_float(0x7f800000))
#define SHARDC_FULL_MASK 0xffffffffu

// ---- bf16 <-> f32 ---------------------------------------------------------------------------

// Exact: a bf16 is the top half of an f32.
__device__ __forceinline__ float bf16_to_f32(bf16 v) {
    return __uint_as_float(((unsigned int)v) << 16);
}

// Round to nearest, ties to even; NaN stays NaN (quiet bit forced), +-inf stays inf.
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// ---- typed load / store through f32 ---------------------------------------------------------

__device__ __forceinline__ float load(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, i64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, i64 i, float v) { p[i] = f32_to_bf16(v); }

// ---- grid-stride helpers --------------------------------------------------------------------

__device__ __forceinline__ i64 global_thread_id() {
    return (i64)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ i64 grid_stride() {
    return (i64)gridDim.x * blockDim.x;
}

// ---- 128-bit vector access ------------------------------------------------------------------
//
// Memory-bound kernels move 16 bytes per access (VecWidth<T>::N = 4 f32 or 8 bf16 elements)
// where the addresses are 16-byte aligned, and fall back to scalar accesses where they are not
// (a view at an odd element offset, a row whose length is not a multiple of N, a broadcast
// operand whose length is not). Alignment is checked at run time by each kernel. `uint4` is the
// built-in 16-byte aligned vector type: one ld/st.global.v4 per access.

template <typename T> struct VecWidth;
template <> struct VecWidth<float> { static constexpr int N = 4; };
template <> struct VecWidth<bf16> { static constexpr int N = 8; };

// A hook the CPU emulation defines to count vector accesses; nothing on the GPU.
#ifndef SHARDC_VEC_HOOK
#define SHARDC_VEC_HOOK()
#endif

__device__ __forceinline__ bool aligned16(const void* p) {
    return (((unsigned long long)p) & 15ull) == 0;
}

// Pre: p is 16-byte aligned.
__device__ __forceinline__ uint4 ld16(const void* p) {
    SHARDC_VEC_HOOK();
    return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void st16(void* p, uint4 v) {
    SHARDC_VEC_HOOK();
    *reinterpret_cast<uint4*>(p) = v;
}

// 16 raw bytes <-> N f32 lanes (the pointer argument only selects the element type). Element 0
// is the lowest address: the low half of .x for bf16.
__device__ __forceinline__ void unpack16(const float*, uint4 u, float* f) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack16(const bf16*, uint4 u, float* f) {
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}
__device__ __forceinline__ uint4 pack16(const float*, const float* f) {
    uint4 u;
    u.x = __float_as_uint(f[0]);
    u.y = __float_as_uint(f[1]);
    u.z = __float_as_uint(f[2]);
    u.w = __float_as_uint(f[3]);
    return u;
}
__device__ __forceinline__ uint4 pack16(const bf16*, const float* f) {
    unsigned int w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        w[k] = (unsigned int)f32_to_bf16(f[2 * k]) | ((unsigned int)f32_to_bf16(f[2 * k + 1]) << 16);
    }
    uint4 u;
    u.x = w[0];
    u.y = w[1];
    u.z = w[2];
    u.w = w[3];
    return u;
}

// N lanes of p starting at element i, through f32 (pre: p + i is 16-byte aligned).
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, i64 i, float* f) {
    unpack16(p, ld16(p + i), f);
}
template <typename T>
__device__ __forceinline__ void store_vec(T* p, i64 i, const float* f) {
    st16(p + i, pack16(p, f));
}

// ---- division by a loop-invariant divisor ---------------------------------------------------

// i / d and i % d for an index that advances by a fixed step (a grid stride): two 64-bit
// divisions when it starts, then an add and a compare per step, none in the loop.
// Pre: d >= 1, i >= 0, step >= 0.
struct DivMod {
    i64 q, r, dq, dr, d;
    __device__ __forceinline__ DivMod() {}
    __device__ __forceinline__ DivMod(i64 i, i64 step, i64 divisor) : d(divisor) {
        q = i / d;
        r = i - q * d;
        dq = step / d;
        dr = step - dq * d;
    }
    __device__ __forceinline__ void advance() {
        q += dq;
        r += dr;
        if (r >= d) {
            r -= d;
            ++q;
        }
    }
};

// ---- row loops over vectors -------------------------------------------------

// Vectors a thread keeps in registers between the passes of a row kernel: a row of up to
// blockDim.x * SHARDC_ROW_CACHE vectors is read from memory once.
#define SHARDC_ROW_CACHE 8

// Calls f(k, v) for every vector v < nv of a row this thread owns (v = threadIdx.x + k *
// blockDim.x, the same vectors in every pass). k < SHARDC_ROW_CACHE is v's register slot, a
// constant once unrolled; vectors past the cache get k == SHARDC_ROW_CACHE.
template <typename F>
__device__ __forceinline__ void for_row_vectors(i64 nv, F f) {
#pragma unroll
    for (int k = 0; k < SHARDC_ROW_CACHE; ++k) {
        const i64 v = threadIdx.x + (i64)k * blockDim.x;
        if (v < nv) f(k, v);
    }
    for (i64 v = threadIdx.x + (i64)SHARDC_ROW_CACHE * blockDim.x; v < nv; v += blockDim.x) {
        f(SHARDC_ROW_CACHE, v);
    }
}

// Row vector v: from the register slot k when it has one, else from memory at row + v * N.
template <typename T>
__device__ __forceinline__ uint4 row_vec(const uint4* cache, int k, const T* row, i64 v) {
    return k < SHARDC_ROW_CACHE ? cache[k] : ld16(row + v * VecWidth<T>::N);
}

// The first pass over a row's nv vectors: loads each (keeping it in its register slot) and
// calls f(v, lanes) with its N f32 lanes.
template <typename T, typename F>
__device__ __forceinline__ void row_first_pass(i64 nv, uint4* cache, const T* row, F f) {
    constexpr int N = VecWidth<T>::N;
    for_row_vectors(nv, [&](int k, i64 v) {
        const uint4 u = ld16(row + v * N);
        if (k < SHARDC_ROW_CACHE) cache[k] = u;
        float x[N];
        unpack16(row, u, x);
        f(v, x);
    });
}

// A later pass: the same vectors from their register slots (memory past the cache); f(v, lanes)
// may overwrite the lanes.
template <typename T, typename F>
__device__ __forceinline__ void row_next_pass(i64 nv, const uint4* cache, const T* row, F f) {
    for_row_vectors(nv, [&](int k, i64 v) {
        float x[VecWidth<T>::N];
        unpack16(row, row_vec(cache, k, row, v), x);
        f(v, x);
    });
}

// This thread's share of sum (x - mean)^2 over a row (the second pass of a LayerNorm's
// statistics): its vectors of the row's first nv from the register cache (memory past it), then
// its scalar elements past nv * N. block_sum of it is the row's sum.
template <typename T>
__device__ __forceinline__ float row_sq_dev(i64 nv, const uint4* cache, const T* row, i64 n,
                                            float mean) {
    constexpr int N = VecWidth<T>::N;
    float sq = 0.0f;
    row_next_pass(nv, cache, row, [&](i64, const float* f) {
#pragma unroll
        for (int e = 0; e < N; ++e) sq += (f[e] - mean) * (f[e] - mean);
    });
    for (i64 c = nv * N + threadIdx.x; c < n; c += blockDim.x) {
        const float d = load(row, c) - mean;
        sq += d * d;
    }
    return sq;
}

// ---- generated fused elementwise kernels ----------------------------------------------------

// The loop of a generated fused kernel (kernels/src/fused.rs) over its K loaded inputs:
// out[i] = expr(x) with x[k] = in[k][i % len[k]] in f32, one rounding to T on store. 16-byte
// vectors over the whole vectors of [0, n) when out and every in[k] are 16-byte aligned and
// every len[k] is n or a multiple of N; scalar accesses for the rest, or for everything
// otherwise. The broadcast indices advance with the grid stride (DivMod). in and len hold K
// entries (none read when K == 0); every len[k] >= 1. Any launch shape.
template <int K, typename T, typename F>
__device__ __forceinline__ void fused_elementwise(const T* const* in, const i64* len, T* out,
                                                  i64 n, F expr) {
    constexpr int N = VecWidth<T>::N;
    constexpr int KS = K > 0 ? K : 1;
    const i64 start = global_thread_id(), step = grid_stride();
    bool vectors = aligned16(out);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        vectors = vectors && aligned16(in[k]) && (len[k] == n || len[k] % N == 0);
    }
    const i64 nv = vectors ? n / N : 0;
    if (start < nv) {
        DivMod j[KS];
#pragma unroll
        for (int k = 0; k < K; ++k) j[k] = DivMod(start * N, step * N, len[k]);
        for (i64 v = start; v < nv; v += step) {
            float x[KS][N], y[N];
#pragma unroll
            for (int k = 0; k < K; ++k) load_vec(in[k], j[k].r, x[k]);
#pragma unroll
            for (int e = 0; e < N; ++e) {
                float lane[KS];
#pragma unroll
                for (int k = 0; k < K; ++k) lane[k] = x[k][e];
                y[e] = expr(lane);
            }
            store_vec(out, v * N, y);
#pragma unroll
            for (int k = 0; k < K; ++k) j[k].advance();
        }
    }
    const i64 first = nv * N + start;
    if (first < n) {
        DivMod j[KS];
#pragma unroll
        for (int k = 0; k < K; ++k) j[k] = DivMod(first, step, len[k]);
        for (i64 i = first; i < n; i += step) {
            float lane[KS];
#pragma unroll
            for (int k = 0; k < K; ++k) lane[k] = load(in[k], j[k].r);
            store(out, i, expr(lane));
#pragma unroll
            for (int k = 0; k < K; ++k) j[k].advance();
        }
    }
}

// out[i] = fn(x[i]) through fused_elementwise.
template <typename T, typename F>
__device__ __forceinline__ void map1(const T* x, T* out, i64 n, F fn) {
    const T* in[] = {x};
    const i64 len[] = {n};
    fused_elementwise<1, T>(in, len, out, n, [&](const float* v) { return fn(v[0]); });
}

// out[i] = fn(a[i], b[i % nb]) through fused_elementwise (nb == n: same shapes). out may alias
// a or b.
template <typename T, typename F>
__device__ __forceinline__ void map2(const T* a, const T* b, T* out, i64 n, i64 nb, F fn) {
    const T* in[] = {a, b};
    const i64 len[] = {n, nb};
    fused_elementwise<2, T>(in, len, out, n, [&](const float* v) { return fn(v[0], v[1]); });
}

// ---- scalar math (f32, precise library functions, no fast-math intrinsics) ------------------

__device__ __forceinline__ float op_gelu_tanh(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float op_gelu_erf(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
}
__device__ __forceinline__ float op_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float op_relu(float x) { return x > 0.0f ? x : 0.0f; }
__device__ __forceinline__ float op_exp(float x) { return expf(x); }
__device__ __forceinline__ float op_neg(float x) { return -x; }

// ---- warp / block reductions ----------------------------------------------------------------

// The two reductions, as the warp and block reductions take them.
struct SumOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// `v` reduced by `op` over the warp (a butterfly: every lane gets the result).
template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(SHARDC_FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp()); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, MaxOp()); }

// `v` reduced by `op` over the whole block, returned to every thread: each warp's result, then
// warp 0 over those (lanes past the block's warps contribute `identity`). Every thread of the
// block must call it (it synchronises). blockDim.x must be a multiple of 32, at most 1024. Safe
// to call repeatedly: the leading barrier protects the scratch slots from the previous call.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float identity, Op op) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nwarps ? scratch[lane] : identity;
        w = warp_reduce(w, op);
        if (lane == 0) scratch[0] = w;
    }
    __syncthreads();
    return scratch[0];
}

// Sum of `v` over the whole block; block_reduce's contract.
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, 0.0f, SumOp()); }

// Maximum of `v` over the whole block; block_reduce's contract.
__device__ __forceinline__ float block_max(float v) {
    return block_reduce(v, -SHARDC_INF, MaxOp());
}

// ---- attention masking -----------------------------------------------------------------------

// Whether query position `tp` (= t + q_offset) sees key `s` under the causal and sliding-window
// rules (the key mask is checked separately): the forward and backward attention kernels share it.
__device__ __forceinline__ bool attn_visible(int s, int tp, int causal, int window) {
    return (!causal || s <= tp) && (window <= 0 || tp - s < window);
}

// A half-open range [begin, end) of keys or of queries.
struct AttnRange {
    int begin, end;
};

// The keys of [s_lo, s_hi) that some query t_first .. t_last (at position t + q_offset) may see
// by attn_visible's rules: a forward block's key walk.
__device__ __forceinline__ AttnRange attn_keys_seen(int t_first, int t_last, int q_offset,
                                                    int causal, int window, int s_lo, int s_hi) {
    AttnRange r{s_lo, s_hi};
    if (causal) r.end = min(r.end, t_last + q_offset + 1);
    if (window > 0) r.begin = max(r.begin, t_first + q_offset - window + 1);
    return r;
}

// The queries of [0, seq_q) that may see some key s_first .. s_last by attn_visible's rules: a
// backward block's query walk.
__device__ __forceinline__ AttnRange attn_queries_seeing(int s_first, int s_last, int seq_q,
                                                         int q_offset, int causal, int window) {
    AttnRange r{0, seq_q};
    if (causal) r.begin = max(0, s_first - q_offset);
    if (window > 0) r.end = min(seq_q, s_last + window - q_offset);
    return r;
}

// Rows [r0, r0 + nrows) of a [B, rows, heads, head_dim] tensor at (b, h) into f32 shared memory
// dst [nrows][dp], by the whole block: row j, column d at j * dp + d, or j * dp + (d ^ j) with
// `swizzle` (conflict-free for both a lane-per-row and a lane-per-column read; dp a multiple of
// 32). Rows past `rows` and columns past head_dim are zero.
template <typename T>
__device__ __forceinline__ void attn_load_rows(float* dst, const T* src, int nrows, int r0,
                                               int rows, int b, int heads, int h, int head_dim,
                                               int dp, bool swizzle) {
    for (int idx = threadIdx.x; idx < nrows * dp; idx += blockDim.x) {
        const int j = idx / dp;
        const int d = idx - j * dp;
        const int r = r0 + j;
        float val = 0.0f;
        if (r < rows && d < head_dim) {
            val = load(src, (((i64)b * rows + r) * heads + h) * head_dim + d);
        }
        dst[j * dp + (swizzle ? (d ^ j) : d)] = val;
    }
}

// ---- MoE routing -----------------------------------------------------------------------------

// Largest expert count of the router (a lane's `taken` bits cover experts lane + 32 i, i < 32).
#define ROUTER_MAX_PER_LANE 32  // experts <= 32 * 32

// One token's top-k selection (moe.cu's router and moe_grad.cu's router_grad share it, so the
// backward keeps exactly the experts the forward kept): the softmax's max `mx` and `inv_sum`
// (p_e = router_prob(row, e, mx, inv_sum), in f32), the kept experts as bits of `taken` (bit i:
// expert lane + 32 i of the calling lane) and `kept_sum`, their probabilities summed in
// selection order (descending). min(top_k, experts) experts are kept, the largest p first,
// ties to the lower expert index. Every lane of the warp calls it with the same row (it
// shuffles); experts <= 32 * ROUTER_MAX_PER_LANE.
struct RouterTopK {
    float mx, inv_sum, kept_sum;
    unsigned int taken;
};

template <typename T>
__device__ __forceinline__ float router_prob(const T* row, int e, float mx, float inv_sum) {
    return expf(load(row, e) - mx) * inv_sum;
}

template <typename T>
__device__ __forceinline__ RouterTopK router_top_k(const T* row, int experts, int top_k) {
    const int lane = threadIdx.x & 31;
    RouterTopK r;
    float mx = -SHARDC_INF;
    for (int e = lane; e < experts; e += 32) mx = fmaxf(mx, load(row, e));
    r.mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < experts; e += 32) sum += expf(load(row, e) - r.mx);
    r.inv_sum = 1.0f / warp_sum(sum);

    r.taken = 0;
    r.kept_sum = 0.0f;
    const int k = min(top_k, experts);
    for (int it = 0; it < k; ++it) {
        // Best untaken expert of this lane (first max, so the lower index wins ties).
        float best = -1.0f;
        int best_e = 0x7fffffff;
        for (int e = lane, i = 0; e < experts; e += 32, ++i) {
            if (r.taken & (1u << i)) continue;
            const float p = router_prob(row, e, r.mx, r.inv_sum);
            if (p > best) {
                best = p;
                best_e = e;
            }
        }
        // Warp argmax with ties to the lower index.
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(SHARDC_FULL_MASK, best, o);
            const int oe = __shfl_xor_sync(SHARDC_FULL_MASK, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        if (best_e == 0x7fffffff) break;  // nothing left (cannot happen while it < experts)
        if ((best_e & 31) == lane) r.taken |= 1u << (best_e >> 5);
        r.kept_sum += best;
    }
    return r;
}

// The row of expert e's token n in an [experts, tokens, ..] operand: dense, or packed (pos).
__device__ __forceinline__ i64 expert_row(const int* pos, i64 n, int e, i64 tokens,
                                         int experts) {
    return pos != nullptr ? (i64)pos[n * experts + e] : (i64)e * tokens + n;
}

#endif  // SHARDC_COMMON_CUH
