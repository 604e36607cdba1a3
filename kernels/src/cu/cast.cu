// cast.cu: dtype conversion, grid-stride, any launch shape.
//
// cast_f32_bf16(const float* x, bf16* out, i64 n)   round to nearest even, NaN kept
// cast_bf16_f32(const bf16* x, float* out, i64 n)   exact
#include "common.cuh"

extern "C" __global__ void cast_f32_bf16(const float* x, bf16* out, i64 n) {
    for (i64 i = global_thread_id(); i < n; i += grid_stride()) out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void cast_bf16_f32(const bf16* x, float* out, i64 n) {
    for (i64 i = global_thread_id(); i < n; i += grid_stride()) out[i] = bf16_to_f32(x[i]);
}
