// moe.cu: mixture-of-experts routing, dispatch and combine.
//
// router_{f32,bf16}(const T* logits, T* gates, i64 tokens, int experts, int top_k, int normalize)
//     logits, gates [tokens, experts]. p = softmax(logits[n]) in f32; the top_k largest p are
//     kept (ties go to the lower expert index), all other gates are 0; with normalize != 0 the
//     kept gates are divided by their sum (Mixtral), else they stay softmax probabilities.
//     One warp per token (grid-stride over warps): any blockDim.x multiple of 32; experts <= 1024.
// dispatch_{f32,bf16}(const T* x, const T* gates, T* out, i64 tokens, int experts, i64 hidden,
//                     const int* pos)
//     x [tokens, hidden] (tokens = B*T), gates [tokens, experts], out [experts, tokens, hidden]:
//     out[e, n, :] = x[n, :] where gates[n, e] != 0, else zeros. Grid-stride.
// combine_{f32,bf16}(const T* y, const T* gates, T* out, i64 tokens, int experts, i64 hidden,
//                    const int* pos)
//     y [experts, tokens, hidden] -> out[n, :] = sum_e gates[n, e] * y[e, n, :], in f32, experts
//     in index order; experts with a zero gate are skipped (so garbage there cannot leak in).
//     Grid-stride.
// With pos (moe_gemm.cu's moe_route_positions: pos[n * experts + e] = the packed row of token n
// at expert e, -1 where the gate is 0), the [experts, tokens, hidden] operand is packed instead:
// its (e, n) row is row pos[n * experts + e], and a packed dispatch writes the routed rows only.
// Null pos: dense. The same holds for the gradients of moe_grad.cu.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void router_impl(const T* logits, T* gates, i64 tokens, int experts,
                                            int top_k, int normalize) {
    if (experts > 32 * ROUTER_MAX_PER_LANE) __trap();
    const int lane = threadIdx.x & 31;
    const i64 warps_total = grid_stride() >> 5;
    for (i64 n = global_thread_id() >> 5; n < tokens; n += warps_total) {
        const T* row = logits + n * experts;
        const RouterTopK sel = router_top_k(row, experts, top_k);  // common.cuh
        const float scale = normalize && sel.kept_sum > 0.0f ? 1.0f / sel.kept_sum : 1.0f;
        for (int e = lane, i = 0; e < experts; e += 32, ++i) {
            const float p = (sel.taken & (1u << i))
                                ? router_prob(row, e, sel.mx, sel.inv_sum) * scale
                                : 0.0f;
            store(gates, n * experts + e, p);
        }
    }
}

template <typename T>
__device__ __forceinline__ void dispatch_impl(const T* x, const T* gates, T* out, i64 tokens,
                                              int experts, i64 hidden, const int* pos) {
    if (pos != nullptr) {  // each x element to its routed rows
        for (i64 i = global_thread_id(); i < tokens * hidden; i += grid_stride()) {
            const i64 n = i / hidden;
            for (int e = 0; e < experts; ++e) {
                const int p = pos[n * experts + e];
                if (p >= 0) out[(i64)p * hidden + (i - n * hidden)] = x[i];
            }
        }
        return;
    }
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
                                             int experts, i64 hidden, const int* pos) {
    const i64 total = tokens * hidden;
    for (i64 i = global_thread_id(); i < total; i += grid_stride()) {
        const i64 n = i / hidden;
        const i64 c = i - n * hidden;
        float accum = 0.0f;
        for (int e = 0; e < experts; ++e) {
            const float g = load(gates, n * experts + e);
            if (g != 0.0f) {
                accum += g * load(y, expert_row(pos, n, e, tokens, experts) * hidden + c);
            }
        }
        store(out, i, accum);
    }
}

#define SHARDC_ROUTER(NAME, T)                                                          \
    extern "C" __global__ void NAME(const T* logits, T* gates, i64 tokens, int experts, \
                                    int top_k, int normalize) {                         \
        router_impl(logits, gates, tokens, experts, top_k, normalize);                  \
    }

SHARDC_ROUTER(router_f32, float)
SHARDC_ROUTER(router_bf16, bf16)

// One signature for dispatch (in = x, dispatch_impl) and combine (in = y, combine_impl).
#define SHARDC_DISPATCH_COMBINE(NAME, T, IMPL)                                          \
    extern "C" __global__ void NAME(const T* in, const T* gates, T* out, i64 tokens,    \
                                    int experts, i64 hidden, const int* pos) {          \
        IMPL(in, gates, out, tokens, experts, hidden, pos);                             \
    }

SHARDC_DISPATCH_COMBINE(dispatch_f32, float, dispatch_impl)
SHARDC_DISPATCH_COMBINE(dispatch_bf16, bf16, dispatch_impl)
SHARDC_DISPATCH_COMBINE(combine_f32, float, combine_impl)
SHARDC_DISPATCH_COMBINE(combine_bf16, bf16, combine_impl)
