// reduce.cu: local reductions used to build collectives (local-gpu communicator, ring steps).
// Grid-stride, any launch shape, f32 arithmetic with one rounding to T per element.
//
// reduce_add_{f32,bf16}(const T* a, const T* b, T* out, i64 n)       out = a + b (out may alias a or b)
// reduce_accumulate_{f32,bf16}(T* acc, const T* x, i64 n)            acc += x
// reduce_average_{f32,bf16}(T* acc, const T* x, i64 n, float scale)  acc = (acc + x) * scale
//     the last step of a sum-then-average (scale = 1 / ranks), fused so bf16 rounds once.
#include "common.cuh"

// map2 of common.cuh: 16-byte vector accesses where the pointers are aligned.
template <typename T>
__device__ __forceinline__ void reduce_add_impl(const T* a, const T* b, T* out, i64 n) {
    map2(a, b, out, n, n, [](float x, float y) { return x + y; });
}

template <typename T>
__device__ __forceinline__ void reduce_accumulate_impl(T* acc, const T* x, i64 n) {
    map2((const T*)acc, x, acc, n, n, [](float a, float b) { return a + b; });
}

template <typename T>
__device__ __forceinline__ void reduce_average_impl(T* acc, const T* x, i64 n, float scale) {
    map2((const T*)acc, x, acc, n, n, [scale](float a, float b) { return (a + b) * scale; });
}

#define SHARDC_REDUCE_ADD(NAME, T)                                                   \
    extern "C" __global__ void NAME(const T* a, const T* b, T* out, i64 n) {         \
        reduce_add_impl(a, b, out, n);                                               \
    }

SHARDC_REDUCE_ADD(reduce_add_f32, float)
SHARDC_REDUCE_ADD(reduce_add_bf16, bf16)

#define SHARDC_REDUCE_ACCUMULATE(NAME, T)                                            \
    extern "C" __global__ void NAME(T* acc, const T* x, i64 n) {                     \
        reduce_accumulate_impl(acc, x, n);                                           \
    }

SHARDC_REDUCE_ACCUMULATE(reduce_accumulate_f32, float)
SHARDC_REDUCE_ACCUMULATE(reduce_accumulate_bf16, bf16)

#define SHARDC_REDUCE_AVERAGE(NAME, T)                                               \
    extern "C" __global__ void NAME(T* acc, const T* x, i64 n, float scale) {        \
        reduce_average_impl(acc, x, n, scale);                                       \
    }

SHARDC_REDUCE_AVERAGE(reduce_average_f32, float)
SHARDC_REDUCE_AVERAGE(reduce_average_bf16, bf16)
