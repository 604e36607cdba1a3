// attention_grad.cu: the attention backward of the IR with materialised probabilities
// (AttentionProbs, then AttentionGrad wrt q, k, v), the simple kernels that mirror
// runtime/src/cpu/train/attention.rs. f32 FMA, f32 accumulation, bf16 rounded once on store;
// deterministic (fixed summation orders, no atomics). The fast path that never stores the
// probabilities is attention_bwd.cu.
//
// Layouts: q, dy, dq [B, T, Hq, D]; k, v, dk, dv [B, S, Hkv, D]; probs [B, Hq, T, S] in the
// element type; ds [B, Hq, T, S] f32; mask [B, S] f32, 0 hides a key, anything else keeps it;
// null keeps all.
// GQA: query head h reads KV head g(h) = h / (Hq / Hkv); Hq must be a multiple of Hkv (traps
// otherwise). Query t sits at position t + q_offset and sees key s when the mask keeps s and
// common.cuh's attn_visible(s, t + q_offset, causal, window) holds (causal: s <= t + q_offset;
// window > 0: t + q_offset - s < window), exactly the forward kernels' rule. Positions must fit
// in an int, as in the forward (traps otherwise); a window beyond 2^31 - 1 means none.
//
// attention_probs_{f32,bf16}(const T* q, const T* k, const float* mask, T* probs, i64 B, i64 T,
//                            i64 S, i64 Hq, i64 Hkv, i64 D, float scale, int causal,
//                            i64 window, i64 q_offset)
//     probs[b,h,t,:] = softmax over the visible s of scale * q[b,t,h,:].k[b,s,g(h),:] (max
//     subtracted, f32 sum); hidden keys exactly 0; a query with no visible key gets a row of
//     zeros.
// attention_grad_ds_{f32,bf16}(const T* v, const T* dy, const T* probs, float* ds, i64 B,
//                              i64 T, i64 S, i64 Hq, i64 Hkv, i64 D)
//     With P = probs[b,h,t,:] and dP[s] = dy[b,t,h,:].v[b,s,g(h),:] (only where P[s] != 0):
//     ds[b,h,t,s] = P[s] * (dP[s] - sum_s' P[s'] dP[s']), exactly 0 where P[s] == 0 (so
//     nothing in v at a hidden key can leak in).
//     Both row kernels: one block per (b, h, t) row, block-stride over the B * Hq * T rows (any
//     grid); blockDim.x a multiple of 32, at most 1024 (traps otherwise). A thread owns keys
//     threadIdx.x + i * blockDim.x and keeps the first SHARDC_ROW_CACHE of them in registers
//     between the row's passes (keys beyond are recomputed), so S <= 8 * blockDim.x reads each
//     k or v row once; launch::attention_rows_launch.
// attention_grad_dq_{f32,bf16}(const float* ds, const T* k, T* dq, i64 B, i64 T, i64 S, i64 Hq,
//                              i64 Hkv, i64 D, float scale)
//     dq[b,t,h,d] = scale * sum_s ds[b,h,t,s] * k[b,s,g(h),d], s ascending.
// attention_grad_dk_{f32,bf16}(const float* ds, const T* q, T* dk, i64 B, i64 T, i64 S, i64 Hq,
//                              i64 Hkv, i64 D, float scale)
//     dk[b,s,j,d] = scale * sum over the query heads h of group j (ascending), then t
//     ascending, of ds[b,h,t,s] * q[b,t,h,d].
// attention_grad_dv_{f32,bf16}(const T* probs, const T* dy, T* dv, i64 B, i64 T, i64 S, i64 Hq,
//                              i64 Hkv, i64 D)
//     dv[b,s,j,d] = sum over h of group j, then t, of probs[b,h,t,s] * dy[b,t,h,d].
//     The three sums skip zero weights (ds or P == 0), as the CPU reference does, so hidden
//     keys and queries that see nothing give exact zeros. One thread per output element,
//     grid-stride (any launch shape; launch::elementwise_launch over the output's elements).
#include "common.cuh"

#define AG_INT_MAX 0x7fffffffll

// The checks every entry shares; traps (a loud error, not silently wrong output).
__device__ __forceinline__ void ag_check_heads(i64 heads_q, i64 heads_kv) {
    if (heads_kv <= 0 || heads_q % heads_kv != 0) __trap();
}

// The row kernels' block shape (block_sum / block_max need whole warps, at most 1024 threads).
__device__ __forceinline__ void ag_check_block() {
    if (blockDim.x % 32 != 0 || blockDim.x > 1024) __trap();
}

// Row `row` of a [B, Hq, T, ...] tensor as (b, h, t).
struct AgRow {
    i64 b, h, t;
    __device__ __forceinline__ AgRow(i64 row, i64 seq_q, i64 heads_q) {
        t = row % seq_q;
        const i64 bh = row / seq_q;
        h = bh % heads_q;
        b = bh / heads_q;
    }
};

// Element i of a [B, L, H, D] tensor (q, dy, dq with L = T; k, v, dk, dv with L = S) as
// (b, l, h, d).
struct AgElem {
    i64 b, l, h, d;
    __device__ __forceinline__ AgElem(i64 i, i64 len, i64 heads, i64 head_dim) {
        d = i % head_dim;
        const i64 blh = i / head_dim;
        h = blh % heads;
        const i64 bl = blh / heads;
        l = bl % len;
        b = bl / len;
    }
};

// sum_d x[d] * y[d] in f32, d ascending.
template <typename T>
__device__ __forceinline__ float ag_dot(const T* x, const T* y, i64 head_dim) {
    float acc = 0.0f;
    for (i64 d = 0; d < head_dim; ++d) acc += load(x, d) * load(y, d);
    return acc;
}

template <typename T>
__device__ __forceinline__ void attention_probs_impl(const T* q, const T* k, const float* mask,
                                                     T* probs, i64 batch, i64 seq_q, i64 seq_k,
                                                     i64 heads_q, i64 heads_kv, i64 head_dim,
                                                     float scale, int causal, i64 window,
                                                     i64 q_offset) {
    ag_check_heads(heads_q, heads_kv);
    ag_check_block();
    // Positions are ints in attn_visible, as in the forward kernels.
    if (seq_k > AG_INT_MAX || seq_q + q_offset > AG_INT_MAX || q_offset < -AG_INT_MAX) __trap();
    const int win = window <= 0 ? 0 : window > AG_INT_MAX ? (int)AG_INT_MAX : (int)window;
    const i64 group = heads_q / heads_kv;
    const i64 rows = batch * heads_q * seq_q;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {  // block-uniform
        const AgRow r(row, seq_q, heads_q);
        const T* q_row = q + ((r.b * seq_q + r.t) * heads_q + r.h) * head_dim;
        const T* k_head = k + (r.b * seq_k * heads_kv + r.h / group) * head_dim;
        const float* mask_row = mask == nullptr ? nullptr : mask + r.b * seq_k;
        const int tp = (int)(r.t + q_offset);
        // The scaled score of key s, -inf where the query cannot see it.
        auto score = [&](i64 s) {
            const bool visible = (mask_row == nullptr || mask_row[s] != 0.0f) &&
                                 attn_visible((int)s, tp, causal, win);
            if (!visible) return -SHARDC_INF;
            return ag_dot(q_row, k_head + s * heads_kv * head_dim, head_dim) * scale;
        };
        float cache[SHARDC_ROW_CACHE];
        float mx = -SHARDC_INF;
        for_row_vectors(seq_k, [&](int c, i64 s) {
            const float x = score(s);
            if (c < SHARDC_ROW_CACHE) cache[c] = x;
            mx = fmaxf(mx, x);
        });
        mx = block_max(mx);
        T* out = probs + row * seq_k;
        if (mx == -SHARDC_INF) {  // no visible key (block-uniform): a row of zeros
            for (i64 s = threadIdx.x; s < seq_k; s += blockDim.x) store(out, s, 0.0f);
            continue;
        }
        // exp(score - max), 0 for a hidden key.
        auto unnormalised = [&](float x) { return x == -SHARDC_INF ? 0.0f : expf(x - mx); };
        float sum = 0.0f;
        for_row_vectors(seq_k, [&](int c, i64 s) {
            const float e = unnormalised(c < SHARDC_ROW_CACHE ? cache[c] : score(s));
            if (c < SHARDC_ROW_CACHE) cache[c] = e;
            sum += e;
        });
        const float l = block_sum(sum);  // >= 1: the max key contributes exp(0)
        for_row_vectors(seq_k, [&](int c, i64 s) {
            const float e = c < SHARDC_ROW_CACHE ? cache[c] : unnormalised(score(s));
            store(out, s, e / l);
        });
    }
}

template <typename T>
__device__ __forceinline__ void attention_grad_ds_impl(const T* v, const T* dy, const T* probs,
                                                       float* ds, i64 batch, i64 seq_q,
                                                       i64 seq_k, i64 heads_q, i64 heads_kv,
                                                       i64 head_dim) {
    ag_check_heads(heads_q, heads_kv);
    ag_check_block();
    const i64 group = heads_q / heads_kv;
    const i64 rows = batch * heads_q * seq_q;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {  // block-uniform
        const AgRow r(row, seq_q, heads_q);
        const T* dy_row = dy + ((r.b * seq_q + r.t) * heads_q + r.h) * head_dim;
        const T* v_head = v + (r.b * seq_k * heads_kv + r.h / group) * head_dim;
        const T* p_row = probs + row * seq_k;
        // dP[s] = dy . v[s], only needed (and only computed) where P[s] != 0.
        auto dp = [&](i64 s) { return ag_dot(dy_row, v_head + s * heads_kv * head_dim, head_dim); };
        float cache[SHARDC_ROW_CACHE];
        float acc = 0.0f;
        for_row_vectors(seq_k, [&](int c, i64 s) {
            const float p = load(p_row, s);
            const float x = p != 0.0f ? dp(s) : 0.0f;
            if (c < SHARDC_ROW_CACHE) cache[c] = x;
            acc += p * x;
        });
        const float dot = block_sum(acc);  // sum_s P[s] dP[s]
        float* ds_row = ds + row * seq_k;
        for_row_vectors(seq_k, [&](int c, i64 s) {
            const float p = load(p_row, s);
            float val = 0.0f;
            if (p != 0.0f) val = p * ((c < SHARDC_ROW_CACHE ? cache[c] : dp(s)) - dot);
            ds_row[s] = val;
        });
    }
}

template <typename T>
__device__ __forceinline__ void attention_grad_dq_impl(const float* ds, const T* k, T* dq,
                                                       i64 batch, i64 seq_q, i64 seq_k,
                                                       i64 heads_q, i64 heads_kv, i64 head_dim,
                                                       float scale) {
    ag_check_heads(heads_q, heads_kv);
    const i64 group = heads_q / heads_kv;
    const i64 total = batch * seq_q * heads_q * head_dim;
    for (i64 i = global_thread_id(); i < total; i += grid_stride()) {
        const auto [b, t, h, d] = AgElem(i, seq_q, heads_q, head_dim);
        const float* ds_row = ds + ((b * heads_q + h) * seq_q + t) * seq_k;
        const T* k_col = k + (b * seq_k * heads_kv + h / group) * head_dim + d;
        float acc = 0.0f;
        for (i64 s = 0; s < seq_k; ++s) {
            const float w = ds_row[s];
            if (w != 0.0f) acc += w * load(k_col, s * heads_kv * head_dim);
        }
        store(dq, i, scale * acc);
    }
}

// dk (w = ds, x = q) and dv (w = probs, x = dy): out[b,s,j,d] = out_scale * sum over the query
// heads h of KV head j and the queries t of w[b,h,t,s] * x[b,t,h,d].
template <typename W, typename T>
__device__ __forceinline__ void attention_grad_kv_impl(const W* w, const T* x, T* out, i64 batch,
                                                       i64 seq_q, i64 seq_k, i64 heads_q,
                                                       i64 heads_kv, i64 head_dim,
                                                       float out_scale) {
    ag_check_heads(heads_q, heads_kv);
    const i64 group = heads_q / heads_kv;
    const i64 total = batch * seq_k * heads_kv * head_dim;
    for (i64 i = global_thread_id(); i < total; i += grid_stride()) {
        const auto [b, s, j, d] = AgElem(i, seq_k, heads_kv, head_dim);
        float acc = 0.0f;
        for (i64 h = j * group; h < (j + 1) * group; ++h) {
            const W* w_col = w + (b * heads_q + h) * seq_q * seq_k + s;
            const T* x_col = x + (b * seq_q * heads_q + h) * head_dim + d;
            for (i64 t = 0; t < seq_q; ++t) {
                const float wt = load(w_col, t * seq_k);
                if (wt != 0.0f) acc += wt * load(x_col, t * heads_q * head_dim);
            }
        }
        store(out, i, out_scale * acc);
    }
}

#define SHARDC_ATTENTION_PROBS(NAME, T)                                                       \
    extern "C" __global__ void NAME(const T* q, const T* k, const float* mask, T* probs,      \
                                    i64 batch, i64 seq_q, i64 seq_k, i64 heads_q,             \
                                    i64 heads_kv, i64 head_dim, float scale, int causal,      \
                                    i64 window, i64 q_offset) {                               \
        attention_probs_impl(q, k, mask, probs, batch, seq_q, seq_k, heads_q, heads_kv,       \
                             head_dim, scale, causal, window, q_offset);                      \
    }

SHARDC_ATTENTION_PROBS(attention_probs_f32, float)
SHARDC_ATTENTION_PROBS(attention_probs_bf16, bf16)

#define SHARDC_ATTENTION_GRAD_DS(NAME, T)                                                     \
    extern "C" __global__ void NAME(const T* v, const T* dy, const T* probs, float* ds,       \
                                    i64 batch, i64 seq_q, i64 seq_k, i64 heads_q,             \
                                    i64 heads_kv, i64 head_dim) {                             \
        attention_grad_ds_impl(v, dy, probs, ds, batch, seq_q, seq_k, heads_q, heads_kv,      \
                               head_dim);                                                     \
    }

SHARDC_ATTENTION_GRAD_DS(attention_grad_ds_f32, float)
SHARDC_ATTENTION_GRAD_DS(attention_grad_ds_bf16, bf16)

// One signature for dq (x = k, attention_grad_dq_impl) and dk (x = q, attention_grad_kv_impl).
#define SHARDC_ATTENTION_GRAD_DQ_DK(NAME, T, IMPL)                                            \
    extern "C" __global__ void NAME(const float* ds, const T* x, T* dx, i64 batch, i64 seq_q, \
                                    i64 seq_k, i64 heads_q, i64 heads_kv, i64 head_dim,       \
                                    float scale) {                                            \
        IMPL(ds, x, dx, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, scale);             \
    }

SHARDC_ATTENTION_GRAD_DQ_DK(attention_grad_dq_f32, float, attention_grad_dq_impl)
SHARDC_ATTENTION_GRAD_DQ_DK(attention_grad_dq_bf16, bf16, attention_grad_dq_impl)
SHARDC_ATTENTION_GRAD_DQ_DK(attention_grad_dk_f32, float, attention_grad_kv_impl)
SHARDC_ATTENTION_GRAD_DQ_DK(attention_grad_dk_bf16, bf16, attention_grad_kv_impl)

#define SHARDC_ATTENTION_GRAD_DV(NAME, T)                                                     \
    extern "C" __global__ void NAME(const T* probs, const T* dy, T* dv, i64 batch, i64 seq_q, \
                                    i64 seq_k, i64 heads_q, i64 heads_kv, i64 head_dim) {     \
        attention_grad_kv_impl(probs, dy, dv, batch, seq_q, seq_k, heads_q, heads_kv,         \
                               head_dim, 1.0f);                                               \
    }

SHARDC_ATTENTION_GRAD_DV(attention_grad_dv_f32, float)
SHARDC_ATTENTION_GRAD_DV(attention_grad_dv_bf16, bf16)
