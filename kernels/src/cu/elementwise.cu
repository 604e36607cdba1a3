// elementwise.cu: unary, scale, binary with suffix broadcast, swiglu. Grid-stride loops, any
// launch shape. Computation in f32, one rounding to T on store. out may alias any input.
//
// {gelu_tanh,gelu_erf,silu,relu,exp,neg}_{f32,bf16}(const T* x, T* out, i64 n)
// scale_{f32,bf16}(const T* x, T* out, i64 n, float c)                out = x * c
// {add,mul}_{f32,bf16}(const T* a, const T* b, T* out, i64 n, i64 nb)
//     out[i] = a[i] op b[i % nb]: b's shape is a suffix of a's (a bias), or equal (nb == n).
// swiglu_{f32,bf16}(const T* a, const T* b, T* out, i64 n)            out = silu(a) * b
#include "common.cuh"

// Every kernel here is map1 / map2 of common.cuh (the loop of the generated fused kernels):
// 16-byte vector accesses where the pointers are aligned (and, for a broadcast, nb is n or a
// multiple of the vector width), scalar otherwise and for the tail; the broadcast index
// advances with the grid stride, no division in the loop.

#define SHARDC_UNARY(NAME, T, FN)                                                    \
    extern "C" __global__ void NAME(const T* x, T* out, i64 n) {                     \
        map1(x, out, n, [](float v) { return FN(v); });                        \
    }

SHARDC_UNARY(gelu_tanh_f32, float, op_gelu_tanh)
SHARDC_UNARY(gelu_tanh_bf16, bf16, op_gelu_tanh)
SHARDC_UNARY(gelu_erf_f32, float, op_gelu_erf)
SHARDC_UNARY(gelu_erf_bf16, bf16, op_gelu_erf)
SHARDC_UNARY(silu_f32, float, op_silu)
SHARDC_UNARY(silu_bf16, bf16, op_silu)
SHARDC_UNARY(relu_f32, float, op_relu)
SHARDC_UNARY(relu_bf16, bf16, op_relu)
SHARDC_UNARY(exp_f32, float, op_exp)
SHARDC_UNARY(exp_bf16, bf16, op_exp)
SHARDC_UNARY(neg_f32, float, op_neg)
SHARDC_UNARY(neg_bf16, bf16, op_neg)

#define SHARDC_SCALE(NAME, T)                                                        \
    extern "C" __global__ void NAME(const T* x, T* out, i64 n, float c) {            \
        map1(x, out, n, [c](float v) { return v * c; });                       \
    }

SHARDC_SCALE(scale_f32, float)
SHARDC_SCALE(scale_bf16, bf16)

#define SHARDC_BINARY(NAME, T, EXPR)                                                 \
    extern "C" __global__ void NAME(const T* a, const T* b, T* out, i64 n, i64 nb) { \
        map2(a, b, out, n, nb, [](float x, float y) { return EXPR; });        \
    }

SHARDC_BINARY(add_f32, float, x + y)
SHARDC_BINARY(add_bf16, bf16, x + y)
SHARDC_BINARY(mul_f32, float, x * y)
SHARDC_BINARY(mul_bf16, bf16, x * y)

#define SHARDC_SWIGLU(NAME, T)                                                       \
    extern "C" __global__ void NAME(const T* a, const T* b, T* out, i64 n) {         \
        map2(a, b, out, n, n, [](float x, float y) { return op_silu(x) * y; }); \
    }

SHARDC_SWIGLU(swiglu_f32, float)
SHARDC_SWIGLU(swiglu_bf16, bf16)
