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
//
// Vocabulary-parallel cross-entropy (Megatron's): the logits are split over ranks along the
// vocabulary; a rank holds columns lo .. lo + vocab of the `total` of the whole vocabulary,
// and the `shards` ranks exchange only 3 numbers per row and rank (the stats).
// cross_entropy_stats_{f32,bf16}(const T* logits, const int* labels, T* stats, i64 rows,
//                                i64 vocab, i64 lo, i64 total)
//     logits [rows, vocab], labels [rows] i32, stats [rows, 3]: {m, s, t} with m the row's max,
//     s = sum(exp(x - m)) (0 for a row of -inf), t the logit of the label when
//     lo <= label < lo + vocab, else 0; all three NaN where labels[r] >= total.
//     One block per row (block-stride): blockDim.x a multiple of 32, at most 1024.
// cross_entropy_from_stats_{f32,bf16}(const T* stats, const int* labels, float* loss,
//                                     i64 rows, i64 shards)
//     stats [rows, 3 * shards] (every shard's stats in rank order), loss [rows] f32:
//     loss[r] = M + log(sum_i s_i exp(m_i - M)) - sum_i t_i with M = max_i m_i, 0 where
//     labels[r] < 0. Grid-stride over rows: any launch shape.
// cross_entropy_shard_grad_{f32,bf16}(const T* logits, const int* labels, const T* stats,
//                                     T* dx, i64 rows, i64 vocab, i64 shards, i64 lo,
//                                     float scale)
//     dx[r, j] = (exp(x - lse) - (lo + j == label)) * scale with lse the row's log-sum-exp
//     from its gathered stats (as above), zero rows where labels[r] < 0.
//     One block per row (block-stride): blockDim.x a multiple of 32, at most 1024.
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


extern "C" __global__ void loss_sum_f32(const float* loss, float* out, i64 rows, float scale) {
    float s = 0.0f;
    for (i64 i = threadIdx.x; i < rows; i += blockDim.x) s += loss[i];
    s = block_sum(s);
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = s * scale;
}

template <typename T>
__device__ __forceinline__ void cross_entropy_stats_impl(const T* logits, const int* labels,
                                                         T* stats, i64 rows, i64 vocab, i64 lo,
                                                         i64 total) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const int label = labels[r];
        const i64 base = r * vocab;
        float m = -SHARDC_INF;
        for (i64 c = threadIdx.x; c < vocab; c += blockDim.x) m = fmaxf(m, load(logits, base + c));
        m = block_max(m);
        float s = 0.0f;
        if (m != -SHARDC_INF) {  // block-uniform
            for (i64 c = threadIdx.x; c < vocab; c += blockDim.x) s += expf(load(logits, base + c) - m);
        }
        s = block_sum(s);
        if (threadIdx.x == 0) {
            const i64 y = (i64)label;
            float t = (y >= lo && y < lo + vocab) ? load(logits, base + (y - lo)) : 0.0f;
            if (y >= total) {
                const float nan = __int_as_float(0x7fc00000);
                m = nan;
                s = nan;
                t = nan;
            }
            store(stats, 3 * r, m);
            store(stats, 3 * r + 1, s);
            store(stats, 3 * r + 2, t);
        }
    }
}

// The log-sum-exp of a row and its label's logit from the row's gathered stats.
template <typename T>
__device__ __forceinline__ void stats_lse(const T* st, i64 shards, float* lse, float* target) {
    float m = -SHARDC_INF;
    for (i64 i = 0; i < shards; ++i) m = fmaxf(m, load(st, 3 * i));
    float s = 0.0f, t = 0.0f;
    for (i64 i = 0; i < shards; ++i) {
        const float si = load(st, 3 * i + 1);
        if (si != 0.0f) s += si * expf(load(st, 3 * i) - m);
        t += load(st, 3 * i + 2);
    }
    *lse = m + logf(s);
    *target = t;
}

template <typename T>
__device__ __forceinline__ void cross_entropy_from_stats_impl(const T* stats, const int* labels,
                                                              float* loss, i64 rows, i64 shards) {
    for (i64 r = global_thread_id(); r < rows; r += grid_stride()) {
        if (labels[r] < 0) {
            loss[r] = 0.0f;
            continue;
        }
        float lse, t;
        stats_lse(stats + 3 * shards * r, shards, &lse, &t);
        loss[r] = lse - t;
    }
}

template <typename T>
__device__ __forceinline__ void cross_entropy_shard_grad_impl(const T* logits, const int* labels,
                                                              const T* stats, T* dx, i64 rows,
                                                              i64 vocab, i64 shards, i64 lo,
                                                              float scale) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const int label = labels[r];
        const i64 base = r * vocab;
        if (label < 0) {  // block-uniform
            for (i64 c = threadIdx.x; c < vocab; c += blockDim.x) store(dx, base + c, 0.0f);
            continue;
        }
        float lse, t;
        stats_lse(stats + 3 * shards * r, shards, &lse, &t);
        for (i64 c = threadIdx.x; c < vocab; c += blockDim.x) {
            const float p = expf(load(logits, base + c) - lse);
            const float hot = (lo + c == (i64)label) ? 1.0f : 0.0f;
            store(dx, base + c, (p - hot) * scale);
        }
    }
}

#define SHARDC_CROSS_ENTROPY_STATS(NAME, T)                                                 \
    extern "C" __global__ void NAME(const T* logits, const int* labels, T* stats, i64 rows, \
                                    i64 vocab, i64 lo, i64 total) {                         \
        cross_entropy_stats_impl(logits, labels, stats, rows, vocab, lo, total);            \
    }

SHARDC_CROSS_ENTROPY_STATS(cross_entropy_stats_f32, float)
SHARDC_CROSS_ENTROPY_STATS(cross_entropy_stats_bf16, bf16)

// One signature for cross_entropy (in = logits, n = vocab; cross_entropy_impl) and
// cross_entropy_from_stats (in = stats, n = shards; cross_entropy_from_stats_impl).
#define SHARDC_CROSS_ENTROPY(NAME, T, IMPL)                                                 \
    extern "C" __global__ void NAME(const T* in, const int* labels, float* loss, i64 rows,  \
                                    i64 n) {                                                \
        IMPL(in, labels, loss, rows, n);                                                    \
    }

SHARDC_CROSS_ENTROPY(cross_entropy_f32, float, cross_entropy_impl)
SHARDC_CROSS_ENTROPY(cross_entropy_bf16, bf16, cross_entropy_impl)
SHARDC_CROSS_ENTROPY(cross_entropy_from_stats_f32, float, cross_entropy_from_stats_impl)
SHARDC_CROSS_ENTROPY(cross_entropy_from_stats_bf16, bf16, cross_entropy_from_stats_impl)

#define SHARDC_CROSS_ENTROPY_SHARD_GRAD(NAME, T)                                            \
    extern "C" __global__ void NAME(const T* logits, const int* labels, const T* stats,     \
                                    T* dx, i64 rows, i64 vocab, i64 shards, i64 lo,         \
                                    float scale) {                                          \
        cross_entropy_shard_grad_impl(logits, labels, stats, dx, rows, vocab, shards, lo,   \
                                      scale);                                               \
    }

SHARDC_CROSS_ENTROPY_SHARD_GRAD(cross_entropy_shard_grad_f32, float)
SHARDC_CROSS_ENTROPY_SHARD_GRAD(cross_entropy_shard_grad_bf16, bf16)
