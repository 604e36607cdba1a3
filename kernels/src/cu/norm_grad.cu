// norm_grad.cu: gradients of the norms over the last dim (RMSNorm, LayerNorm) and the column
// sums behind their weight gradient and the bias gradient. The semantics are those of the CPU
// reference (runtime cpu/train/norm.rs, basic.rs `bias_grad`), computed in f32.
//
// norm_stats_{f32,bf16}(const T* x, float* stats, i64 rows, i64 hidden, float eps, int center)
//     x [rows, hidden], stats [rows, 2] f32: {mean, rstd} of each row, mean = mean(x) when
//     center != 0 (LayerNorm), 0 when center == 0 (RMSNorm); rstd = 1 / sqrt(mean((x - mean)^2)
//     + eps) (biased variance, two passes).
// norm_grad_dx_{f32,bf16}(const T* x, const T* w, const T* dy, T* dx, i64 rows, i64 hidden,
//                         float eps, int center)
//     x, dy, dx [rows, hidden], w [hidden]: the gradient of RMSNorm (center == 0) or LayerNorm
//     (center != 0) wrt x. With mean, rstd as above, xh = (x - mean) * rstd and g = w * dy:
//     dx = rstd * (g - [center] mean(g) - xh * mean(g * xh)). dx must not alias x, w or dy.
//     Both are row kernels: one block per row (block-stride over rows), blockDim.x a multiple of
//     32, at most 1024. A row whose pointers (and w) are 16-byte aligned is read 16 bytes at a
//     time and kept in registers between the passes (common.cuh), the rest is scalar.
// norm_grad_dw_{f32,bf16}(const T* x, const T* dy, const float* stats, T* dw, i64 rows,
//                         i64 hidden)
//     dw[j] = sum_r dy[r, j] * (x[r, j] - mean_r) * rstd_r with {mean_r, rstd_r} = stats[r] from
//     norm_stats: the gradient wrt w of either norm (x, dy [rows, hidden], dw [hidden]).
// bias_grad_{f32,bf16}(const T* dy, T* db, i64 rows, i64 n)
//     db[j] = sum_r dy[r, j] (dy [rows, n], db [n]): the gradient of a bias added by `add`.
//     Both are column reductions without atomics: one block per 32 columns (block-stride over
//     column tiles), blockDim.x a multiple of 32, at most 1024 (`launch::columns_launch`). Lane
//     l of warp k sums column 32 * tile + l over rows k, k + W, k + 2W, ... (W = blockDim.x / 32)
//     in f32, then warp 0 adds the W partial sums in warp order: the result depends only on
//     blockDim.x, the same bits on every run.
#include "common.cuh"

// {mean, rstd} of one row (see norm_stats), by the whole block. The row's nv 16-byte vectors
// are loaded into `cache` (common.cuh's register cache, for the caller's later passes), the
// tail past nv * N is read scalar. center must be the same in every thread.
template <typename T>
__device__ __forceinline__ void row_stats(const T* xr, i64 nv, uint4* cache, i64 hidden,
                                          float eps, int center, float& mean, float& rstd) {
    constexpr int N = VecWidth<T>::N;
    // First pass: the sum of x (LayerNorm: the mean comes first) or of x^2 (RMSNorm: done).
    float s = 0.0f;
    row_first_pass(nv, cache, xr, [&](i64, const float* f) {
#pragma unroll
        for (int e = 0; e < N; ++e) s += center ? f[e] : f[e] * f[e];
    });
    for (i64 c = nv * N + threadIdx.x; c < hidden; c += blockDim.x) {
        const float v = load(xr, c);
        s += center ? v : v * v;
    }
    float ss = block_sum(s);
    mean = 0.0f;
    if (center) {
        mean = ss / (float)hidden;
        ss = block_sum(row_sq_dev(nv, cache, xr, hidden, mean));
    }
    rstd = 1.0f / sqrtf(ss / (float)hidden + eps);
}

template <typename T>
__device__ __forceinline__ void norm_stats_impl(const T* x, float* stats, i64 rows, i64 hidden,
                                                float eps, int center) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * hidden;
        const i64 nv = aligned16(xr) ? hidden / VecWidth<T>::N : 0;
        uint4 cache[SHARDC_ROW_CACHE];
        float mean, rstd;
        row_stats(xr, nv, cache, hidden, eps, center, mean, rstd);
        if (threadIdx.x == 0) {
            stats[2 * r] = mean;
            stats[2 * r + 1] = rstd;
        }
    }
}

// Three passes over a row after its statistics: x from its register cache, dy loaded once into
// a second cache, w read where needed (it is shared by every row, so it stays in cache).
template <typename T>
__device__ __forceinline__ void norm_grad_dx_impl(const T* x, const T* w, const T* dy, T* dx,
                                                  i64 rows, i64 hidden, float eps, int center) {
    constexpr int N = VecWidth<T>::N;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * hidden;
        const T* dyr = dy + r * hidden;
        T* dxr = dx + r * hidden;
        const bool vectors = aligned16(xr) && aligned16(dyr) && aligned16(dxr) && aligned16(w);
        const i64 nv = vectors ? hidden / N : 0;
        uint4 cx[SHARDC_ROW_CACHE], cg[SHARDC_ROW_CACHE];
        float mean, rstd;
        row_stats(xr, nv, cx, hidden, eps, center, mean, rstd);
        // sum(g) and sum(g * xh).
        float sg = 0.0f, sgx = 0.0f;
        for_row_vectors(nv, [&](int k, i64 v) {
            float xf[N], gf[N], wf[N];
            unpack16(xr, row_vec(cx, k, xr, v), xf);
            const uint4 u = ld16(dyr + v * N);
            if (k < SHARDC_ROW_CACHE) cg[k] = u;
            unpack16(dyr, u, gf);
            load_vec(w, v * N, wf);
#pragma unroll
            for (int e = 0; e < N; ++e) {
                const float g = wf[e] * gf[e];
                sg += g;
                sgx += g * ((xf[e] - mean) * rstd);
            }
        });
        for (i64 c = nv * N + threadIdx.x; c < hidden; c += blockDim.x) {
            const float g = load(w, c) * load(dyr, c);
            sg += g;
            sgx += g * ((load(xr, c) - mean) * rstd);
        }
        const float mean_g = center ? block_sum(sg) / (float)hidden : 0.0f;
        const float mean_gx = block_sum(sgx) / (float)hidden;
        for_row_vectors(nv, [&](int k, i64 v) {
            float xf[N], gf[N], wf[N];
            unpack16(xr, row_vec(cx, k, xr, v), xf);
            unpack16(dyr, row_vec(cg, k, dyr, v), gf);
            load_vec(w, v * N, wf);
#pragma unroll
            for (int e = 0; e < N; ++e) {
                const float g = wf[e] * gf[e];
                xf[e] = rstd * (g - mean_g - ((xf[e] - mean) * rstd) * mean_gx);
            }
            store_vec(dxr, v * N, xf);
        });
        for (i64 c = nv * N + threadIdx.x; c < hidden; c += blockDim.x) {
            const float g = load(w, c) * load(dyr, c);
            store(dxr, c, rstd * (g - mean_g - ((load(xr, c) - mean) * rstd) * mean_gx));
        }
    }
}

// out[j] = sum_r term(r, j) for j < n, r < rows, in the fixed order described at the top.
// term(r, j) returns the f32 contribution of row r to column j.
template <typename T, typename F>
__device__ __forceinline__ void column_sums(T* out, i64 rows, i64 n, F term) {
    __shared__ float partial[32][32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    for (i64 c0 = (i64)blockIdx.x * 32; c0 < n; c0 += (i64)gridDim.x * 32) {
        const i64 j = c0 + lane;
        float s = 0.0f;
        if (j < n) {
#pragma unroll 4
            for (i64 r = warp; r < rows; r += warps) s += term(r, j);
        }
        __syncthreads();  // the previous tile's partial sums are read
        partial[warp][lane] = s;
        __syncthreads();
        if (warp == 0 && j < n) {
            float t = 0.0f;
            for (int k = 0; k < warps; ++k) t += partial[k][lane];
            store(out, j, t);
        }
    }
}

template <typename T>
__device__ __forceinline__ void norm_grad_dw_impl(const T* x, const T* dy, const float* stats,
                                                  T* dw, i64 rows, i64 hidden) {
    column_sums(dw, rows, hidden, [&](i64 r, i64 j) {
        const i64 i = r * hidden + j;
        return load(dy, i) * ((load(x, i) - stats[2 * r]) * stats[2 * r + 1]);
    });
}

template <typename T>
__device__ __forceinline__ void bias_grad_impl(const T* dy, T* db, i64 rows, i64 n) {
    column_sums(db, rows, n, [&](i64 r, i64 j) { return load(dy, r * n + j); });
}

#define SHARDC_NORM_STATS(NAME, T)                                                        \
    extern "C" __global__ void NAME(const T* x, float* stats, i64 rows, i64 hidden,       \
                                    float eps, int center) {                              \
        norm_stats_impl(x, stats, rows, hidden, eps, center);                             \
    }

SHARDC_NORM_STATS(norm_stats_f32, float)
SHARDC_NORM_STATS(norm_stats_bf16, bf16)

#define SHARDC_NORM_GRAD_DX(NAME, T)                                                      \
    extern "C" __global__ void NAME(const T* x, const T* w, const T* dy, T* dx, i64 rows, \
                                    i64 hidden, float eps, int center) {                  \
        norm_grad_dx_impl(x, w, dy, dx, rows, hidden, eps, center);                       \
    }

SHARDC_NORM_GRAD_DX(norm_grad_dx_f32, float)
SHARDC_NORM_GRAD_DX(norm_grad_dx_bf16, bf16)

#define SHARDC_NORM_GRAD_DW(NAME, T)                                                      \
    extern "C" __global__ void NAME(const T* x, const T* dy, const float* stats, T* dw,   \
                                    i64 rows, i64 hidden) {                               \
        norm_grad_dw_impl(x, dy, stats, dw, rows, hidden);                                \
    }

SHARDC_NORM_GRAD_DW(norm_grad_dw_f32, float)
SHARDC_NORM_GRAD_DW(norm_grad_dw_bf16, bf16)

#define SHARDC_BIAS_GRAD(NAME, T)                                                         \
    extern "C" __global__ void NAME(const T* dy, T* db, i64 rows, i64 n) {                \
        bias_grad_impl(dy, db, rows, n);                                                  \
    }

SHARDC_BIAS_GRAD(bias_grad_f32, float)
SHARDC_BIAS_GRAD(bias_grad_bf16, bf16)
