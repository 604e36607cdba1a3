// softmax.cu: softmax over the last dim, one block per row (block-stride over rows).
//
// softmax_{f32,bf16}(const T* x, T* out, i64 rows, i64 cols)
//     out[r, c] = exp(x[r, c] - max_r) / sum_c' exp(x[r, c'] - max_r), accumulated in f32.
//     A row whose entries are all -inf gives zeros (the convention attention uses for a query
//     with no visible key), not NaN. out may alias x.
// Launch: blockDim.x a multiple of 32, at most 1024; any gridDim.x.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void softmax_impl(const T* x, T* out, i64 rows, i64 cols) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = r * cols;
        float m = -SHARDC_INF;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, load(x, base + c));
        m = block_max(m);
        float s = 0.0f;
        if (m != -SHARDC_INF) {
            for (i64 c = threadIdx.x; c < cols; c += blockDim.x) s += expf(load(x, base + c) - m);
        }
        s = block_sum(s);
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const float e = m != -SHARDC_INF ? expf(load(x, base + c) - m) : 0.0f;
            store(out, base + c, e * inv);
        }
    }
}

extern "C" __global__ void softmax_f32(const float* x, float* out, i64 rows, i64 cols) {
    softmax_impl(x, out, rows, cols);
}
extern "C" __global__ void softmax_bf16(const bf16* x, bf16* out, i64 rows, i64 cols) {
    softmax_impl(x, out, rows, cols);
}
