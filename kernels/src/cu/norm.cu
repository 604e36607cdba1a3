// norm.cu: normalisations over the last dim, one block per row (block-stride over rows).
// Launch: blockDim.x a multiple of 32, at most 1024 (256 is a good default); any gridDim.x,
// ideally min(rows, a few blocks per SM). Statistics accumulate in f32.
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

template <typename T>
__device__ __forceinline__ void rmsnorm_impl(const T* x, const T* w, T* out, i64 rows, i64 hidden,
                                             float eps) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = r * hidden;
        float ss = 0.0f;
        for (i64 c = threadIdx.x; c < hidden; c += blockDim.x) {
            const float v = load(x, base + c);
            ss += v * v;
        }
        ss = block_sum(ss);
        const float inv = rsqrtf(ss / (float)hidden + eps);
        for (i64 c = threadIdx.x; c < hidden; c += blockDim.x) {
            store(out, base + c, load(x, base + c) * inv * load(w, c));
        }
    }
}

template <typename T>
__device__ __forceinline__ void layernorm_impl(const T* x, const T* w, const T* b, T* out,
                                               i64 rows, i64 hidden, float eps) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = r * hidden;
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < hidden; c += blockDim.x) s += load(x, base + c);
        const float mean = block_sum(s) / (float)hidden;
        float sq = 0.0f;
        for (i64 c = threadIdx.x; c < hidden; c += blockDim.x) {
            const float d = load(x, base + c) - mean;
            sq += d * d;
        }
        const float inv = rsqrtf(block_sum(sq) / (float)hidden + eps);
        for (i64 c = threadIdx.x; c < hidden; c += blockDim.x) {
            store(out, base + c, (load(x, base + c) - mean) * inv * load(w, c) + load(b, c));
        }
    }
}

// No __restrict__: sum_out may alias x or residual. Each thread re-reads only the elements it
// wrote itself, so the second pass needs no barrier.
template <typename T>
__device__ __forceinline__ void add_rmsnorm_impl(const T* x, const T* residual, T* sum_out,
                                                 const T* w, T* out, i64 rows, i64 hidden,
                                                 float eps) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = r * hidden;
        float ss = 0.0f;
        for (i64 c = threadIdx.x; c < hidden; c += blockDim.x) {
            store(sum_out, base + c, load(x, base + c) + load(residual, base + c));
            const float v = load(sum_out, base + c);  // the rounded sum
            ss += v * v;
        }
        ss = block_sum(ss);
        const float inv = rsqrtf(ss / (float)hidden + eps);
        for (i64 c = threadIdx.x; c < hidden; c += blockDim.x) {
            store(out, base + c, load(sum_out, base + c) * inv * load(w, c));
        }
    }
}

extern "C" __global__ void rmsnorm_f32(const float* x, const float* w, float* out, i64 rows,
                                       i64 hidden, float eps) {
    rmsnorm_impl(x, w, out, rows, hidden, eps);
}
extern "C" __global__ void rmsnorm_bf16(const bf16* x, const bf16* w, bf16* out, i64 rows,
                                        i64 hidden, float eps) {
    rmsnorm_impl(x, w, out, rows, hidden, eps);
}

extern "C" __global__ void layernorm_f32(const float* x, const float* w, const float* b,
                                         float* out, i64 rows, i64 hidden, float eps) {
    layernorm_impl(x, w, b, out, rows, hidden, eps);
}
extern "C" __global__ void layernorm_bf16(const bf16* x, const bf16* w, const bf16* b, bf16* out,
                                          i64 rows, i64 hidden, float eps) {
    layernorm_impl(x, w, b, out, rows, hidden, eps);
}

extern "C" __global__ void add_rmsnorm_f32(const float* x, const float* residual, float* sum_out,
                                           const float* w, float* out, i64 rows, i64 hidden,
                                           float eps) {
    add_rmsnorm_impl(x, residual, sum_out, w, out, rows, hidden, eps);
}
extern "C" __global__ void add_rmsnorm_bf16(const bf16* x, const bf16* residual, bf16* sum_out,
                                            const bf16* w, bf16* out, i64 rows, i64 hidden,
                                            float eps) {
    add_rmsnorm_impl(x, residual, sum_out, w, out, rows, hidden, eps);
}
