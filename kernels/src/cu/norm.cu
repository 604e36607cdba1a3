// norm.cu: normalisations over the last dim, one block per row (block-stride over rows).
// Launch: blockDim.x a multiple of 32, at most 1024 (256 is a good default); any gridDim.x,
// ideally min(rows, a few blocks per SM). Statistics accumulate in f32. One read of x per row
// when the row fits in registers (blockDim.x * SHARDC_ROW_CACHE vectors of 16 bytes).
//
// rmsnorm_{f32,bf16}(const T* x, const T* w, T* out, i64 rows, i64 hidden, float eps)
//     out = x / sqrt(mean(x^2) + eps) * w                       x, out [rows, hidden]; w [hidden]
// layernorm_{f32,bf16}(const T* x, const T* w, const T* b, T* out, i64 rows, i64 hidden, float eps)
//     out = (x - mean) / sqrt(var + eps) * w + b                 (biased variance, two passes)
// add_rmsnorm_{f32,bf16}(const T* x, const T* residual, T* sum_out, const T* w, T* out,
//                        i64 rows, i64 hidden, float eps)
//     sum_out = x + residual (rounded to T), out = rmsnorm(sum_out) * w.
//     The norm reads the rounded sum, exactly as the unfused `add` then `rmsnorm` would.
//     sum_out may alias x or residual (in-place residual stream); out may alias x.
#include "common.cuh"

// Each row takes the vector path (16-byte accesses, the row kept in registers between passes,
// see common.cuh) when every row pointer and the weights are 16-byte aligned, then finishes the
// last hidden % N elements with scalar accesses; otherwise the whole row is scalar. Which path a
// row takes can change from row to row (hidden % N != 0), never the result.

// The second pass of both RMSNorms: out = x / sqrt(ss / hidden + eps) * w over one row (its nv
// vectors from the register cache, then the scalar tail).
template <typename T>
__device__ __forceinline__ void rms_scale_row(float ss, i64 nv, const uint4* cache, const T* xr,
                                              const T* w, T* outr, i64 hidden, float eps) {
    constexpr int N = VecWidth<T>::N;
    const float inv = rsqrtf(ss / (float)hidden + eps);
    row_next_pass(nv, cache, xr, [&](i64 v, float* f) {
        float g[N];
        load_vec(w, v * N, g);
#pragma unroll
        for (int e = 0; e < N; ++e) f[e] = f[e] * inv * g[e];
        store_vec(outr, v * N, f);
    });
    for (i64 c = nv * N + threadIdx.x; c < hidden; c += blockDim.x) {
        store(outr, c, load(xr, c) * inv * load(w, c));
    }
}

template <typename T>
__device__ __forceinline__ void rmsnorm_impl(const T* x, const T* w, T* out, i64 rows, i64 hidden,
                                             float eps) {
    constexpr int N = VecWidth<T>::N;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * hidden;
        T* outr = out + r * hidden;
        const i64 nv = aligned16(xr) && aligned16(outr) && aligned16(w) ? hidden / N : 0;
        uint4 cache[SHARDC_ROW_CACHE];
        float ss = 0.0f;
        row_first_pass(nv, cache, xr, [&](i64, const float* f) {
#pragma unroll
            for (int e = 0; e < N; ++e) ss += f[e] * f[e];
        });
        for (i64 c = nv * N + threadIdx.x; c < hidden; c += blockDim.x) {
            const float v = load(xr, c);
            ss += v * v;
        }
        rms_scale_row(block_sum(ss), nv, cache, xr, w, outr, hidden, eps);
    }
}

template <typename T>
__device__ __forceinline__ void layernorm_impl(const T* x, const T* w, const T* b, T* out,
                                               i64 rows, i64 hidden, float eps) {
    constexpr int N = VecWidth<T>::N;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * hidden;
        T* outr = out + r * hidden;
        const bool vectors = aligned16(xr) && aligned16(outr) && aligned16(w) && aligned16(b);
        const i64 nv = vectors ? hidden / N : 0;
        uint4 cache[SHARDC_ROW_CACHE];
        float s = 0.0f;
        row_first_pass(nv, cache, xr, [&](i64, const float* f) {
#pragma unroll
            for (int e = 0; e < N; ++e) s += f[e];
        });
        for (i64 c = nv * N + threadIdx.x; c < hidden; c += blockDim.x) s += load(xr, c);
        const float mean = block_sum(s) / (float)hidden;
        const float sq = row_sq_dev(nv, cache, xr, hidden, mean);
        const float inv = rsqrtf(block_sum(sq) / (float)hidden + eps);
        row_next_pass(nv, cache, xr, [&](i64 v, float* f) {
            float g[N], h[N];
            load_vec(w, v * N, g);
            load_vec(b, v * N, h);
#pragma unroll
            for (int e = 0; e < N; ++e) f[e] = (f[e] - mean) * inv * g[e] + h[e];
            store_vec(outr, v * N, f);
        });
        for (i64 c = nv * N + threadIdx.x; c < hidden; c += blockDim.x) {
            store(outr, c, (load(xr, c) - mean) * inv * load(w, c) + load(b, c));
        }
    }
}

// No __restrict__: sum_out may alias x or residual. Each thread re-reads only the elements it
// wrote itself (the same vectors and tail elements in both passes), so the second pass needs
// no barrier.
template <typename T>
__device__ __forceinline__ void add_rmsnorm_impl(const T* x, const T* residual, T* sum_out,
                                                 const T* w, T* out, i64 rows, i64 hidden,
                                                 float eps) {
    constexpr int N = VecWidth<T>::N;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = r * hidden;
        const T* xr = x + base;
        const T* rr = residual + base;
        T* sr = sum_out + base;
        T* outr = out + base;
        const bool vectors = aligned16(xr) && aligned16(rr) && aligned16(sr) &&
                             aligned16(outr) && aligned16(w);
        const i64 nv = vectors ? hidden / N : 0;
        uint4 cache[SHARDC_ROW_CACHE];
        float ss = 0.0f;
        for_row_vectors(nv, [&](int k, i64 v) {
            float f[N], g[N];
            load_vec(xr, v * N, f);
            load_vec(rr, v * N, g);
#pragma unroll
            for (int e = 0; e < N; ++e) f[e] += g[e];
            const uint4 u = pack16(sr, f);  // the sum rounded to T
            st16(sr + v * N, u);
            if (k < SHARDC_ROW_CACHE) cache[k] = u;
            unpack16(sr, u, f);
#pragma unroll
            for (int e = 0; e < N; ++e) ss += f[e] * f[e];
        });
        for (i64 c = nv * N + threadIdx.x; c < hidden; c += blockDim.x) {
            store(sr, c, load(xr, c) + load(rr, c));
            const float v = load(sr, c);  // the rounded sum
            ss += v * v;
        }
        rms_scale_row(block_sum(ss), nv, cache, (const T*)sr, w, outr, hidden, eps);
    }
}

#define SHARDC_RMSNORM(NAME, T)                                                            \
    extern "C" __global__ void NAME(const T* x, const T* w, T* out, i64 rows, i64 hidden,  \
                                    float eps) {                                           \
        rmsnorm_impl(x, w, out, rows, hidden, eps);                                        \
    }

SHARDC_RMSNORM(rmsnorm_f32, float)
SHARDC_RMSNORM(rmsnorm_bf16, bf16)

#define SHARDC_LAYERNORM(NAME, T)                                                          \
    extern "C" __global__ void NAME(const T* x, const T* w, const T* b, T* out, i64 rows,  \
                                    i64 hidden, float eps) {                               \
        layernorm_impl(x, w, b, out, rows, hidden, eps);                                   \
    }

SHARDC_LAYERNORM(layernorm_f32, float)
SHARDC_LAYERNORM(layernorm_bf16, bf16)

#define SHARDC_ADD_RMSNORM(NAME, T)                                                        \
    extern "C" __global__ void NAME(const T* x, const T* residual, T* sum_out, const T* w, \
                                    T* out, i64 rows, i64 hidden, float eps) {             \
        add_rmsnorm_impl(x, residual, sum_out, w, out, rows, hidden, eps);                 \
    }

SHARDC_ADD_RMSNORM(add_rmsnorm_f32, float)
SHARDC_ADD_RMSNORM(add_rmsnorm_bf16, bf16)
