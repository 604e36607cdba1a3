// optim.cu: the AdamW step (PyTorch's torch.optim.AdamW, single-tensor path), bit-identical in
// f32 to the CPU reference (runtime cpu/train/optim.rs): every operation is an explicitly
// rounded intrinsic (__fadd_rn, __dmul_rn, ...), so NVRTC cannot contract a multiply and an add
// into an FMA, and the operations are those of the Rust expressions, in their order.
// Grid-stride, any launch shape; 16-byte vectors where the pointers are aligned.
//
// adam_moment_{f32,bf16}(const T* m, const T* g, T* out, i64 n, float beta, float one_minus_beta,
//                        int squared)
//     m, g, out [n]; with w = one_minus_beta, which the host computes as (float)(1 - (double)beta)
//     (optim.rs `moment`), in f32:
//       squared == 0: out = m + w * (g - m)            (the first moment: PyTorch's lerp_)
//       squared != 0: out = (m * beta) + ((w * g) * g)  (the second: mul_(beta).addcmul_(g, g, w))
//     out may alias m or g.
// adamw_update_{f32,bf16}(const T* w, const T* m, const T* v, T* out, i64 n,
//                         const double* consts)
//     w, m, v, out [n]; consts = {decay, step_size, bc2_sqrt, eps} in device memory (written
//     by the host before each step, so a captured CUDA graph reads each step's values); in f64
//     from the exactly widened inputs:
//       out = (w * decay) - ((step_size * m) / (sqrt(v) / bc2_sqrt + eps))
//     rounded to f32 (then to bf16 for T = bf16, as the CPU's f32 result cast to bf16). The host
//     computes, in f64 as optim.rs `update` does: decay = 1 - lr * weight_decay,
//     step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t). out may alias w, m or v.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void adam_moment_impl(const T* m, const T* g, T* out, i64 n,
                                                 float beta, float w, int squared) {
    if (squared) {
        map2(m, g, out, n, n, [beta, w](float a, float b) {
            return __fadd_rn(__fmul_rn(a, beta), __fmul_rn(__fmul_rn(w, b), b));
        });
    } else {
        map2(m, g, out, n, n,
             [w](float a, float b) { return __fadd_rn(a, __fmul_rn(w, __fsub_rn(b, a))); });
    }
}

template <typename T>
__device__ __forceinline__ void adamw_update_impl(const T* w, const T* m, const T* v, T* out,
                                                  i64 n, const double* consts) {
    const double decay = consts[0], step_size = consts[1], bc2_sqrt = consts[2], eps = consts[3];
    const T* in[] = {w, m, v};
    const i64 len[] = {n, n, n};
    fused_elementwise<3, T>(in, len, out, n, [=](const float* x) {
        const double denom = __dadd_rn(__ddiv_rn(sqrt((double)x[2]), bc2_sqrt), eps);
        const double step = __ddiv_rn(__dmul_rn(step_size, (double)x[1]), denom);
        return (float)__dsub_rn(__dmul_rn((double)x[0], decay), step);
    });
}

#define SHARDC_ADAM_MOMENT(NAME, T)                                                    \
    extern "C" __global__ void NAME(const T* m, const T* g, T* out, i64 n, float beta, \
                                    float one_minus_beta, int squared) {               \
        adam_moment_impl(m, g, out, n, beta, one_minus_beta, squared);                 \
    }

SHARDC_ADAM_MOMENT(adam_moment_f32, float)
SHARDC_ADAM_MOMENT(adam_moment_bf16, bf16)

#define SHARDC_ADAMW_UPDATE(NAME, T)                                                   \
    extern "C" __global__ void NAME(const T* w, const T* m, const T* v, T* out, i64 n, \
                                    const double* consts) {                            \
        adamw_update_impl(w, m, v, out, n, consts);                                    \
    }

SHARDC_ADAMW_UPDATE(adamw_update_f32, float)
SHARDC_ADAMW_UPDATE(adamw_update_bf16, bf16)
