// grad.cu: gradients of the elementwise activations, of repeat_interleave and of the embedding
// table. The semantics are those of the CPU reference (runtime cpu/train/basic.rs), computed
// in f32 with one rounding to T on store. Grid-stride loops, any launch shape.
//
// unary_grad_{gelu_tanh,gelu_erf,silu,relu,exp,neg}_{f32,bf16}(const T* x, const T* dy, T* dx,
//                                                             i64 n)
//     dx = dy * f'(x) for the forward op f of elementwise.cu (x, dy, dx [n]), f' written as
//     basic.rs `unary_derivative` writes it; relu'(x) = 1 where x > 0, else 0 (0 at the kink,
//     PyTorch's threshold_backward). 16-byte vectors where x, dy and dx are aligned (map2).
//     dx may alias x or dy.
// repeat_grad_{f32,bf16}(const T* dy, T* dx, i64 outer, i64 dim, i64 times, i64 inner)
//     dy [outer, dim * times, inner], dx [outer, dim, inner]: dx[o, i, k] = sum over t < times
//     (in order) of dy[o, i * times + t, k], the gradient of `repeat` (repeat_interleave: each
//     index of `dim` repeated `times` times in a row). One thread per dx element, grid-stride.
//     dx must not alias dy.
// embedding_grad_{f32,bf16}(const int* ids, const T* dy, float* acc, i64 n, i64 vocab,
//                           i64 hidden)
//     ids [n] i32, dy [n, hidden], acc [vocab, hidden] f32, zeroed by the caller:
//     acc[ids[i], :] += dy[i, :] by f32 atomicAdd; ids outside [0, vocab) add nothing. One
//     thread per dy element, grid-stride. Repeated ids add in the hardware's order (not
//     deterministic in the last bits); a bf16 table's gradient is acc through cast_f32_bf16.
#include "common.cuh"

// ---- f'(x), in f32 ---------------------------------------------------------------------------

__device__ __forceinline__ float dop_gelu_tanh(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    const float t = tanhf(k * (x + 0.044715f * x * x * x));
    const float dinner = k * (1.0f + 3.0f * 0.044715f * x * x);
    const float sech2 = 1.0f - t * t;
    // sech2 is exactly 0 once |x| > ~5, where x^3 may also have overflowed (0 * inf).
    return 0.5f * (1.0f + t) + (sech2 == 0.0f ? 0.0f : 0.5f * x * sech2 * dinner);
}
__device__ __forceinline__ float dop_gelu_erf(float x) {
    const float cdf = 0.5f * erfcf(-x * 0.7071067811865476f);
    return cdf + x * 0.3989422804014327f * expf(-0.5f * x * x);  // 1/sqrt(2 pi)
}
__device__ __forceinline__ float dop_silu(float x) {
    const float s = 1.0f / (1.0f + expf(-x));
    return s * (1.0f + x * (1.0f - s));
}
__device__ __forceinline__ float dop_relu(float x) { return x > 0.0f ? 1.0f : 0.0f; }
__device__ __forceinline__ float dop_exp(float x) { return expf(x); }
__device__ __forceinline__ float dop_neg(float) { return -1.0f; }

#define SHARDC_UNARY_GRAD(NAME, T, DFN)                                              \
    extern "C" __global__ void NAME(const T* x, const T* dy, T* dx, i64 n) {         \
        map2(x, dy, dx, n, n, [](float v, float g) { return g * DFN(v); });          \
    }

SHARDC_UNARY_GRAD(unary_grad_gelu_tanh_f32, float, dop_gelu_tanh)
SHARDC_UNARY_GRAD(unary_grad_gelu_tanh_bf16, bf16, dop_gelu_tanh)
SHARDC_UNARY_GRAD(unary_grad_gelu_erf_f32, float, dop_gelu_erf)
SHARDC_UNARY_GRAD(unary_grad_gelu_erf_bf16, bf16, dop_gelu_erf)
SHARDC_UNARY_GRAD(unary_grad_silu_f32, float, dop_silu)
SHARDC_UNARY_GRAD(unary_grad_silu_bf16, bf16, dop_silu)
SHARDC_UNARY_GRAD(unary_grad_relu_f32, float, dop_relu)
SHARDC_UNARY_GRAD(unary_grad_relu_bf16, bf16, dop_relu)
SHARDC_UNARY_GRAD(unary_grad_exp_f32, float, dop_exp)
SHARDC_UNARY_GRAD(unary_grad_exp_bf16, bf16, dop_exp)
SHARDC_UNARY_GRAD(unary_grad_neg_f32, float, dop_neg)
SHARDC_UNARY_GRAD(unary_grad_neg_bf16, bf16, dop_neg)

// ---- repeat_grad -----------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void repeat_grad_impl(const T* dy, T* dx, i64 outer, i64 dim,
                                                 i64 times, i64 inner) {
    const i64 total = outer * dim * inner;
    const i64 start = global_thread_id(), step = grid_stride();
    if (start >= total) return;
    // q = o * dim + i, r = k: dy's run for dx[o, i, k] starts at (q * times) * inner + k.
    DivMod qk(start, step, inner);
    for (i64 e = start; e < total; e += step, qk.advance()) {
        const T* src = dy + qk.q * times * inner + qk.r;
        float s = 0.0f;
        for (i64 t = 0; t < times; ++t) s += load(src, t * inner);
        store(dx, e, s);
    }
}

#define SHARDC_REPEAT_GRAD(NAME, T)                                                  \
    extern "C" __global__ void NAME(const T* dy, T* dx, i64 outer, i64 dim,          \
                                    i64 times, i64 inner) {                          \
        repeat_grad_impl(dy, dx, outer, dim, times, inner);                          \
    }

SHARDC_REPEAT_GRAD(repeat_grad_f32, float)
SHARDC_REPEAT_GRAD(repeat_grad_bf16, bf16)

// ---- embedding_grad --------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void embedding_grad_impl(const int* ids, const T* dy, float* acc,
                                                    i64 n, i64 vocab, i64 hidden) {
    const i64 total = n * hidden;
    const i64 start = global_thread_id(), step = grid_stride();
    if (start >= total) return;
    DivMod tc(start, step, hidden);  // q: token, r: column
    for (i64 e = start; e < total; e += step, tc.advance()) {
        const i64 row = ids[tc.q];
        if (row >= 0 && row < vocab) atomicAdd(acc + row * hidden + tc.r, load(dy, e));
    }
}

#define SHARDC_EMBEDDING_GRAD(NAME, T)                                               \
    extern "C" __global__ void NAME(const int* ids, const T* dy, float* acc, i64 n,  \
                                    i64 vocab, i64 hidden) {                         \
        embedding_grad_impl(ids, dy, acc, n, vocab, hidden);                         \
    }

SHARDC_EMBEDDING_GRAD(embedding_grad_f32, float)
SHARDC_EMBEDDING_GRAD(embedding_grad_bf16, bf16)
