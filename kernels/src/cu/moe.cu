// moe.cu: mixture-of-experts routing, dispatch and combine.
//
// router_{f32,bf16}(const T* logits, T* gates, i64 tokens, int experts, int top_k, int normalize)
//     logits, gates [tokens, experts]. p = softmax(logits[n]) in f32; the top_k largest p are
//     kept (ties go to the lower expert index), all other gates are 0; with normalize != 0 the
//     kept gates are divided by their sum (Mixtral), else they stay softmax probabilities.
//     One warp per token (grid-stride over warps): any blockDim.x multiple of 32; experts <= 1024.
// dispatch_{f32,bf16}(const T* x, const T* gates, T* out, i64 tokens, int experts, i64 hidden)
//     x [tokens, hidden] (tokens = B*T), gates [tokens, experts], out [experts, tokens, hidden]:
//     out[e, n, :] = x[n, :] where gates[n, e] != 0, else zeros. Grid-stride.
// combine_{f32,bf16}(const T* y, const T* gates, T* out, i64 tokens, int experts, i64 hidden)
//     y [experts, tokens, hidden] -> out[n, :] = sum_e gates[n, e] * y[e, n, :], in f32, experts
//     in index order; experts with a zero gate are skipped (so garbage there cannot leak in).
//     Grid-stride.
#include "common.cuh"

#define ROUTER_MAX_PER_LANE 32  // experts <= 32 * 32

template <typename T>
__device__ __forceinline__ void router_impl(const T* logits, T* gates, i64 tokens, int experts,
                                            int top_k, int normalize) {
    if (experts > 32 * ROUTER_MAX_PER_LANE) __trap();
    const int lane = threadIdx.x & 31;
    const i64 warps_total = grid_stride() >> 5;
    for (i64 n = global_thread_id() >> 5; n < tokens; n += warps_total) {
        const T* row = logits + n * experts;
        // Lane owns experts lane, lane + 32, ...; bit i of `taken` marks expert lane + 32 i.
        float mx = -SHARDC_INF;
        for (int e = lane; e < experts; e += 32) mx = fmaxf(mx, load(row, e));
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int e = lane; e < experts; e += 32) sum += expf(load(row, e) - mx);
        const float inv_sum = 1.0f / warp_sum(sum);

        unsigned int taken = 0;
        float kept_sum = 0.0f;
        const int k = min(top_k, experts);
        for (int it = 0; it < k; ++it) {
            // Best untaken expert of this lane (first max, so the lower index wins ties).
            float best = -1.0f;
            int best_e = 0x7fffffff;
            for (int e = lane, i = 0; e < experts; e += 32, ++i) {
                if (taken & (1u << i)) continue;
                const float p = expf(load(row, e) - mx) * inv_sum;
                if (p > best) {
                    best = p;
                    best_e = e;
                }
            }
            // Warp argmax with ties to the lower index.
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ob = __shfl_xor_sync(SHARDC_FULL_MASK, best, o);
                const int oe = __shfl_xor_sync(SHARDC_FULL_MASK, best_e, o);
                if (ob > best || (ob == best && oe < best_e)) {
                    best = ob;
                    best_e = oe;
                }
            }
            if (best_e == 0x7fffffff) break;  // nothing left (cannot happen while it < experts)
            if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
            kept_sum += best;
        }
        const float scale = normalize && kept_sum > 0.0f ? 1.0f / kept_sum : 1.0f;
        for (int e = lane, i = 0; e < experts; e += 32, ++i) {
            const float p = (taken & (1u << i)) ? expf(load(row, e) - mx) * inv_sum * scale : 0.0f;
            store(gates, n * experts + e, p);
        }
    }
}

template <typename T>
__device__ __forceinline__ void dispatch_impl(const T* x, const T* gates, T* out, i64 tokens,
                                              int experts, i64 hidden) {
    const i64 total = (i64)experts * tokens * hidden;
    for (i64 i = global_thread_id(); i < total; i += grid_stride()) {
        const i64 row = i / hidden;  // (e, n)
        const i64 c = i - row * hidden;
        const i64 e = row / tokens;
        const i64 n = row - e * tokens;
        if (load(gates, n * experts + e) != 0.0f) {
            out[i] = x[n * hidden + c];
        } else {
            store(out, i, 0.0f);
        }
    }
}

template <typename T>
__device__ __forceinline__ void combine_impl(const T* y, const T* gates, T* out, i64 tokens,
                                             int experts, i64 hidden) {
    const i64 total = tokens * hidden;
    for (i64 i = global_thread_id(); i < total; i += grid_stride()) {
        const i64 n = i / hidden;
        float accum = 0.0f;
        for (int e = 0; e < experts; ++e) {
            const float g = load(gates, n * experts + e);
            if (g != 0.0f) accum += g * load(y, (i64)e * total + i);
        }
        store(out, i, accum);
    }
}

extern "C" __global__ void router_f32(const float* logits, float* gates, i64 tokens, int experts,
                                      int top_k, int normalize) {
    router_impl(logits, gates, tokens, experts, top_k, normalize);
}
extern "C" __global__ void router_bf16(const bf16* logits, bf16* gates, i64 tokens, int experts,
                                       int top_k, int normalize) {
    router_impl(logits, gates, tokens, experts, top_k, normalize);
}

extern "C" __global__ void dispatch_f32(const float* x, const float* gates, float* out,
                                        i64 tokens, int experts, i64 hidden) {
    dispatch_impl(x, gates, out, tokens, experts, hidden);
}
extern "C" __global__ void dispatch_bf16(const bf16* x, const bf16* gates, bf16* out, i64 tokens,
                                         int experts, i64 hidden) {
    dispatch_impl(x, gates, out, tokens, experts, hidden);
}

extern "C" __global__ void combine_f32(const float* y, const float* gates, float* out,
                                       i64 tokens, int experts, i64 hidden) {
    combine_impl(y, gates, out, tokens, experts, hidden);
}
extern "C" __global__ void combine_bf16(const bf16* y, const bf16* gates, bf16* out, i64 tokens,
                                        int experts, i64 hidden) {
    combine_impl(y, gates, out, tokens, experts, hidden);
}
