// loss.cu: cross-entropy forward.
//
// cross_entropy_{f32,bf16}(const T* logits, const int* labels, float* loss, i64 rows, i64 vocab)
//     logits [rows, vocab], labels [rows] i32, loss [rows] f32:
//     loss[r] = logsumexp(logits[r]) - logits[r, labels[r]] (f32), 0 where labels[r] < 0
//     (ignored position), NaN where labels[r] >= vocab (a bug upstream, made visible).
//     One block per row (block-stride): blockDim.x a multiple of 32, at most 1024.
// loss_sum_f32(const float* loss, float* out, i64 rows, float scale)
//     out[0] = scale * sum(loss), e.g. scale = 1 / number of predicted tokens.
//     Launch with exactly one block (blockDim.x a multiple of 32, at most 1024).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void cross_entropy_impl(const T* logits, const int* labels, float* loss,
                                                   i64 rows, i64 vocab) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const int label = labels[r];
        if (label < 0) {  // block-uniform
            if (threadIdx.x == 0) loss[r] = 0.0f;
            continue;
        }
        const i64 base = r * vocab;
        float m = -SHARDC_INF;
        for (i64 c = threadIdx.x; c < vocab; c += blockDim.x) m = fmaxf(m, load(logits, base + c));
        m = block_max(m);
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < vocab; c += blockDim.x) s += expf(load(logits, base + c) - m);
        s = block_sum(s);
        if (threadIdx.x == 0) {
            loss[r] = (i64)label < vocab ? m + logf(s) - load(logits, base + label)
                                         : __int_as_float(0x7fc00000);
        }
    }
}

extern "C" __global__ void cross_entropy_f32(const float* logits, const int* labels, float* loss,
                                             i64 rows, i64 vocab) {
    cross_entropy_impl(logits, labels, loss, rows, vocab);
}
extern "C" __global__ void cross_entropy_bf16(const bf16* logits, const int* labels, float* loss,
                                              i64 rows, i64 vocab) {
    cross_entropy_impl(logits, labels, loss, rows, vocab);
}

extern "C" __global__ void loss_sum_f32(const float* loss, float* out, i64 rows, float scale) {
    float s = 0.0f;
    for (i64 i = threadIdx.x; i < rows; i += blockDim.x) s += loss[i];
    s = block_sum(s);
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = s * scale;
}
