// Minimal SIMT emulation of the CUDA features the shardc kernels use: one std::thread per CUDA
// thread, blocks run one at a time, barriers for __syncthreads and for every warp shuffle.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
using std::max;
using std::min;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 gridDim, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)
float g_smem[1 << 16];
struct WarpCtx { std::barrier<>* bar; unsigned long long slots[32]; unsigned frag[32][6]; };
thread_local WarpCtx* tw;
thread_local std::barrier<>* tb;
inline void __syncthreads() { tb->arrive_and_wait(); }
template <class T> T shfl_impl(T v, int src) {
    int lane = threadIdx.x & 31;
    std::memcpy(&tw->slots[lane], &v, sizeof(T));
    tw->bar->arrive_and_wait();
    T r; std::memcpy(&r, &tw->slots[src & 31], sizeof(T));
    tw->bar->arrive_and_wait();
    return r;
}
inline float __shfl_xor_sync(unsigned, float v, int o) { return shfl_impl(v, (threadIdx.x & 31) ^ o); }
inline int __shfl_xor_sync(unsigned, int v, int o) { return shfl_impl(v, (threadIdx.x & 31) ^ o); }
inline float __shfl_sync(unsigned, float v, int s) { return shfl_impl(v, s); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// The explicitly rounded IEEE operations (NVRTC built-ins the optimizer kernels use so that no
// multiply and add are contracted into an FMA): plain operations here, since g++ on x86-64
// without -mfma contracts nothing.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline void __trap() { std::fprintf(stderr, "__trap\n"); std::abort(); }

template <class F> void launch(dim3 grid, dim3 block, F kernel) {
    gridDim = grid; blockDim = block;
    const unsigned n = block.x;
    for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x) {
        std::memset(g_smem, 0xff, sizeof g_smem);  // NaN: no block reads what another left
        std::barrier<> bb(n);
        unsigned nw = (n + 31) / 32;
        std::vector<std::unique_ptr<std::barrier<>>> wb;
        std::vector<WarpCtx> wc(nw);
        for (unsigned w = 0; w < nw; ++w) {
            wb.emplace_back(new std::barrier<>(std::min(32u, n - 32 * w)));
            wc[w].bar = wb.back().get();
        }
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < n; ++t) ts.emplace_back([&, t] {
            threadIdx = dim3{t, 0, 0}; blockIdx = dim3{x, y, z};
            tw = &wc[t / 32]; tb = &bb; kernel();
        });
        for (auto& t : ts) t.join();
    }
}

// 16-byte vector types (built in under NVRTC) and a count of 16-byte accesses, so the tests can
// tell the vector path of a kernel from its scalar fallback.
#include <atomic>
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
std::atomic<long long> g_vec_accesses{0};
#define SHARDC_VEC_HOOK() (g_vec_accesses.fetch_add(1, std::memory_order_relaxed))
#include "warp_mma.h"

// f32 atomicAdd (the attention backward's dQ accumulation): the block's threads run
// concurrently, so the add is a real atomic read-modify-write.
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
