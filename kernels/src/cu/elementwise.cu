// elementwise.cu: unary, scale, binary with suffix broadcast, swiglu. Grid-stride loops, any
// launch shape. Computation in f32, one rounding to T on store. out may alias any input.
//
// {gelu_tanh,gelu_erf,silu,relu,exp,neg}_{f32,bf16}(const T* x, T* out, i64 n)
// scale_{f32,bf16}(const T* x, T* out, i64 n, float c)                out = x * c
// {add,mul}_{f32,bf16}(const T* a, const T* b, T* out, i64 n, i64 nb)
//     out[i] = a[i] op b[i % nb]: b's shape is a suffix of a's (a bias), or equal (nb == n).
// swiglu_{f32,bf16}(const T* a, const T* b, T* out, i64 n)            out = silu(a) * b
#include "common.cuh"

// Every kernel here is the loop of the generated fused kernels (fused_elementwise in
// common.cuh) over its one or two inputs: 16-byte vector accesses over the whole vectors of
// [0, n) when all its pointers are 16-byte aligned (and, for a broadcast, nb is n or a multiple
// of the vector width), then scalar accesses for the rest; otherwise scalar throughout. The
// broadcast index advances with the grid stride, no division in the loop.

template <typename T, typename F>
__device__ __forceinline__ void unary_impl(const T* x, T* out, i64 n, F fn) {
    const T* in[] = {x};
    const i64 len[] = {n};
    fused_elementwise<1, T>(in, len, out, n, [&](const float* v) { return fn(v[0]); });
}

// out[i] = fn(a[i], b[i % nb]) (nb == n: same shapes).
template <typename T, typename F>
__device__ __forceinline__ void binary_impl(const T* a, const T* b, T* out, i64 n, i64 nb, F fn) {
    const T* in[] = {a, b};
    const i64 len[] = {n, nb};
    fused_elementwise<2, T>(in, len, out, n, [&](const float* v) { return fn(v[0], v[1]); });
}

#define SHARDC_UNARY(NAME, T, FN)                                                    \
    extern "C" __global__ void NAME(const T* x, T* out, i64 n) {                     \
        unary_impl(x, out, n, [](float v) { return FN(v); });                        \
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
        unary_impl(x, out, n, [c](float v) { return v * c; });                       \
    }

SHARDC_SCALE(scale_f32, float)
SHARDC_SCALE(scale_bf16, bf16)

#define SHARDC_BINARY(NAME, T, EXPR)                                                 \
    extern "C" __global__ void NAME(const T* a, const T* b, T* out, i64 n, i64 nb) { \
        binary_impl(a, b, out, n, nb, [](float x, float y) { return EXPR; });        \
    }

SHARDC_BINARY(add_f32, float, x + y)
SHARDC_BINARY(add_bf16, bf16, x + y)
SHARDC_BINARY(mul_f32, float, x * y)
SHARDC_BINARY(mul_bf16, bf16, x * y)

#define SHARDC_SWIGLU(NAME, T)                                                       \
    extern "C" __global__ void NAME(const T* a, const T* b, T* out, i64 n) {         \
        binary_impl(a, b, out, n, n, [](float x, float y) { return op_silu(x) * y; }); \
    }

SHARDC_SWIGLU(swiglu_f32, float)
SHARDC_SWIGLU(swiglu_bf16, bf16)
