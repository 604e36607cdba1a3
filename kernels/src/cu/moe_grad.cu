// moe_grad.cu: gradients of the mixture-of-experts ops of moe.cu (RouterGrad, DispatchGrad,
// CombineGrad), mirroring runtime/src/cpu/train/moe.rs. All arithmetic in f32, bf16 rounded once
// on store; deterministic (fixed summation orders, no atomics). Gates are dense [tokens,
// experts] as the forward router writes them; tokens = B * T; an expert is routed for token n
// when gates[n, e] != 0.
//
// router_grad_{f32,bf16}(const T* logits, const T* dgates, T* dlogits, i64 tokens, int experts,
//                        int top_k, int normalize)
//     logits, dgates, dlogits [tokens, experts]: the gradient of router_* (moe.cu) wrt its
//     logits. p = softmax(logits[n]) and the kept set K (the top min(top_k, experts) p, ties to
//     the lower index) are recomputed exactly as the forward does (common.cuh router_top_k),
//     with S = sum_K p. On K: dp_e = (dg_e - sum_K dg * g) / S with g = p / S (normalize != 0)
//     or dp_e = dg_e; dp_e = 0 off K (dropped experts pass nothing back). Then
//     dlogits = p * (dp - sum_e p_e dp_e). One warp per token (warp-stride over tokens): any
//     blockDim.x multiple of 32; experts <= 1024 (traps otherwise); launch::router_launch.
// dispatch_grad_{f32,bf16}(const T* dxe, const T* gates, T* dx, i64 tokens, int experts,
//                          i64 hidden)
//     dxe [experts, tokens, hidden] -> dx [tokens, hidden]: dx[n, :] = sum over the experts
//     with gates[n, e] != 0 of dxe[e, n, :], in f32, experts in index order (unrouted slots
//     never contribute, even if non-finite). Grid-stride over tokens * hidden.
// combine_grad_y_{f32,bf16}(const T* gates, const T* dy, T* dyy, i64 tokens, int experts,
//                           i64 hidden)
//     dy [tokens, hidden] -> dyy [experts, tokens, hidden]: dyy[e, n, :] = gates[n, e] * dy[n, :]
//     where the gate is non-zero, else 0. Grid-stride over experts * tokens * hidden.
// combine_grad_gates_{f32,bf16}(const T* y, const T* gates, const T* dy, T* dg, i64 tokens,
//                               int experts, i64 hidden)
//     y [experts, tokens, hidden], dy [tokens, hidden] -> dg [tokens, experts]:
//     dg[n, e] = sum_h dy[n, h] * y[e, n, h] where gates[n, e] != 0, else 0 (y there is never
//     read). One warp per (n, e) pair, warp-stride over the tokens * experts pairs (lane l sums
//     h = l, l + 32, ..., then a fixed warp tree): any blockDim.x multiple of 32 (traps
//     otherwise); launch::combine_grad_gates_launch.
//     The two combine gradients take CombineGrad's operands in its order (y, gates, dy), less
//     the one the gradient does not need.
// Each takes a trailing `const int* pos`: null for dense [experts, tokens, hidden] operands, or
// moe_route_positions' map for packed ones (moe.cu's header).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void router_grad_impl(const T* logits, const T* dgates, T* dlogits,
                                                 i64 tokens, int experts, int top_k,
                                                 int normalize) {
    if (blockDim.x % 32 != 0 || experts > 32 * ROUTER_MAX_PER_LANE) __trap();
    const int lane = threadIdx.x & 31;
    const i64 warps_total = grid_stride() >> 5;
    for (i64 n = global_thread_id() >> 5; n < tokens; n += warps_total) {  // warp-uniform
        const T* row = logits + n * experts;
        const T* dg = dgates + n * experts;
        const RouterTopK sel = router_top_k(row, experts, top_k);  // the forward's selection
        const bool renorm = normalize && sel.kept_sum > 0.0f;       // as the forward divides
        auto prob = [&](int e) { return router_prob(row, e, sel.mx, sel.inv_sum); };
        auto kept = [&](int i) { return (sel.taken & (1u << i)) != 0; };

        // sum_K dg * g, the renormalisation's term (g = p / S, the forward's gate). Divided, not
        // multiplied by 1 / S: with top_k = 1, g is exactly 1 and the gradient exactly 0.
        float dot_g = 0.0f;
        if (renorm) {
            for (int e = lane, i = 0; e < experts; e += 32, ++i) {
                if (kept(i)) dot_g += load(dg, e) * (prob(e) / sel.kept_sum);
            }
            dot_g = warp_sum(dot_g);
        }
        // dp on K, 0 elsewhere.
        auto dprob = [&](int e, int i) {
            if (!kept(i)) return 0.0f;
            return renorm ? (load(dg, e) - dot_g) / sel.kept_sum : load(dg, e);
        };
        float dot_p = 0.0f;  // sum_e p_e dp_e
        for (int e = lane, i = 0; e < experts; e += 32, ++i) dot_p += prob(e) * dprob(e, i);
        dot_p = warp_sum(dot_p);
        for (int e = lane, i = 0; e < experts; e += 32, ++i) {
            store(dlogits, n * experts + e, prob(e) * (dprob(e, i) - dot_p));
        }
    }
}

template <typename T>
__device__ __forceinline__ void dispatch_grad_impl(const T* dxe, const T* gates, T* dx,
                                                   i64 tokens, int experts, i64 hidden,
                                                   const int* pos) {
    const i64 total = tokens * hidden;
    for (i64 i = global_thread_id(); i < total; i += grid_stride()) {
        const i64 n = i / hidden;
        const i64 c = i - n * hidden;
        float acc = 0.0f;
        for (int e = 0; e < experts; ++e) {
            if (load(gates, n * experts + e) != 0.0f) {
                acc += load(dxe, expert_row(pos, n, e, tokens, experts) * hidden + c);
            }
        }
        store(dx, i, acc);
    }
}

template <typename T>
__device__ __forceinline__ void combine_grad_y_impl(const T* gates, const T* dy, T* dyy,
                                                    i64 tokens, int experts, i64 hidden,
                                                    const int* pos) {
    if (pos != nullptr) {  // the routed rows only
        for (i64 i = global_thread_id(); i < tokens * hidden; i += grid_stride()) {
            const i64 n = i / hidden;
            for (int e = 0; e < experts; ++e) {
                const int p = pos[n * experts + e];
                if (p >= 0) {
                    store(dyy, (i64)p * hidden + (i - n * hidden),
                          load(gates, n * experts + e) * load(dy, i));
                }
            }
        }
        return;
    }
    const i64 per_expert = tokens * hidden;
    const i64 total = (i64)experts * per_expert;
    for (i64 i = global_thread_id(); i < total; i += grid_stride()) {
        const i64 e = i / per_expert;
        const i64 j = i - e * per_expert;  // (n, c) in dy
        const i64 n = j / hidden;
        const float g = load(gates, n * experts + e);
        store(dyy, i, g != 0.0f ? g * load(dy, j) : 0.0f);
    }
}

template <typename T>
__device__ __forceinline__ void combine_grad_gates_impl(const T* y, const T* gates, const T* dy,
                                                        T* dg, i64 tokens, int experts,
                                                        i64 hidden, const int* pos) {
    if (blockDim.x % 32 != 0) __trap();
    const int lane = threadIdx.x & 31;
    const i64 warps_total = grid_stride() >> 5;
    const i64 pairs = tokens * experts;
    for (i64 i = global_thread_id() >> 5; i < pairs; i += warps_total) {  // warp-uniform
        const i64 n = i / experts;
        const i64 e = i - n * experts;
        float acc = 0.0f;
        if (load(gates, i) != 0.0f) {  // warp-uniform
            const T* y_row = y + expert_row(pos, n, (int)e, tokens, experts) * hidden;
            const T* dy_row = dy + n * hidden;
            for (i64 c = lane; c < hidden; c += 32) acc += load(dy_row, c) * load(y_row, c);
            acc = warp_sum(acc);
        }
        if (lane == 0) store(dg, i, acc);
    }
}

#define SHARDC_ROUTER_GRAD(NAME, T)                                                      \
    extern "C" __global__ void NAME(const T* logits, const T* dgates, T* dlogits,        \
                                    i64 tokens, int experts, int top_k, int normalize) { \
        router_grad_impl(logits, dgates, dlogits, tokens, experts, top_k, normalize);    \
    }

SHARDC_ROUTER_GRAD(router_grad_f32, float)
SHARDC_ROUTER_GRAD(router_grad_bf16, bf16)

// One signature for dispatch_grad (a = dxe, b = gates, out = dx; dispatch_grad_impl) and
// combine_grad_y (a = gates, b = dy, out = dyy; combine_grad_y_impl).
#define SHARDC_DISPATCH_COMBINE_GRAD(NAME, T, IMPL)                                      \
    extern "C" __global__ void NAME(const T* a, const T* b, T* out, i64 tokens,          \
                                    int experts, i64 hidden, const int* pos) {           \
        IMPL(a, b, out, tokens, experts, hidden, pos);                                   \
    }

SHARDC_DISPATCH_COMBINE_GRAD(dispatch_grad_f32, float, dispatch_grad_impl)
SHARDC_DISPATCH_COMBINE_GRAD(dispatch_grad_bf16, bf16, dispatch_grad_impl)
SHARDC_DISPATCH_COMBINE_GRAD(combine_grad_y_f32, float, combine_grad_y_impl)
SHARDC_DISPATCH_COMBINE_GRAD(combine_grad_y_bf16, bf16, combine_grad_y_impl)

#define SHARDC_COMBINE_GRAD_GATES(NAME, T)                                               \
    extern "C" __global__ void NAME(const T* y, const T* gates, const T* dy, T* dg,      \
                                    i64 tokens, int experts, i64 hidden, const int* pos) { \
        combine_grad_gates_impl(y, gates, dy, dg, tokens, experts, hidden, pos);         \
    }

SHARDC_COMBINE_GRAD_GATES(combine_grad_gates_f32, float)
SHARDC_COMBINE_GRAD_GATES(combine_grad_gates_bf16, bf16)
