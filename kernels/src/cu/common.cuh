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
//   * `*_bf16` entry points read and write bf16 and accumulate in f32.

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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SHARDC_FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(SHARDC_FULL_MASK, v, o));
    return v;
}

// Sum of `v` over the whole block, returned to every thread. Every thread of the block must
// call it (it synchronises). blockDim.x must be a multiple of 32, at most 1024. Safe to call
// repeatedly: the leading barrier protects the scratch slots from the previous call.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nwarps ? scratch[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) scratch[0] = w;
    }
    __syncthreads();
    return scratch[0];
}

// Maximum of `v` over the whole block; same contract as `block_sum`.
__device__ __forceinline__ float block_max(float v) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nwarps ? scratch[lane] : -SHARDC_INF;
        w = warp_max(w);
        if (lane == 0) scratch[0] = w;
    }
    __syncthreads();
    return scratch[0];
}

#endif  // SHARDC_COMMON_CUH
