// softmax.cu: softmax over the last dim, one block per row (block-stride over rows).
//
// softmax_{f32,bf16}(const T* x, T* out, i64 rows, i64 cols)
//     out[r, c] = exp(x[r, c] - max_r) / sum_c' exp(x[r, c'] - max_r), accumulated in f32.
//     A row whose entries are all -inf gives zeros (the convention attention uses for a query
//     with no visible key), not NaN. out may alias x.
// Launch: blockDim.x a multiple of 32, at most 1024; any gridDim.x.
#include "common.cuh"

// A row takes the vector path (16-byte accesses, x read once while the row fits in registers)
// when its x and out rows are 16-byte aligned; the last cols % N elements, or the whole row
// otherwise, are scalar.
template <typename T>
__device__ __forceinline__ void softmax_impl(const T* x, T* out, i64 rows, i64 cols) {
    constexpr int N = VecWidth<T>::N;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        T* outr = out + r * cols;
        const i64 nv = aligned16(xr) && aligned16(outr) ? cols / N : 0;
        uint4 cache[SHARDC_ROW_CACHE];
        float m = -SHARDC_INF;
        row_first_pass(nv, cache, xr, [&](i64, const float* f) {
#pragma unroll
            for (int e = 0; e < N; ++e) m = fmaxf(m, f[e]);
        });
        for (i64 c = nv * N + threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, load(xr, c));
        m = block_max(m);
        const bool live = m != -SHARDC_INF;
        float s = 0.0f;
        if (live) {
            row_next_pass(nv, cache, xr, [&](i64, const float* f) {
#pragma unroll
                for (int e = 0; e < N; ++e) s += expf(f[e] - m);
            });
            for (i64 c = nv * N + threadIdx.x; c < cols; c += blockDim.x) s += expf(load(xr, c) - m);
        }
        s = block_sum(s);
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        row_next_pass(nv, cache, xr, [&](i64 v, float* f) {
#pragma unroll
            for (int e = 0; e < N; ++e) f[e] = (live ? expf(f[e] - m) : 0.0f) * inv;
            store_vec(outr, v * N, f);
        });
        for (i64 c = nv * N + threadIdx.x; c < cols; c += blockDim.x) {
            const float e = live ? expf(load(xr, c) - m) : 0.0f;
            store(outr, c, e * inv);
        }
    }
}

#define SHARDC_SOFTMAX(NAME, T)                                                      \
    extern "C" __global__ void NAME(const T* x, T* out, i64 rows, i64 cols) {        \
        softmax_impl(x, out, rows, cols);                                            \
    }

SHARDC_SOFTMAX(softmax_f32, float)
SHARDC_SOFTMAX(softmax_bf16, bf16)
