// layout.cu: data movement kernels of the CUDA backend that the kernel registry does not have
// (transpose, slice, concat, repeat, collective packing), the vocabulary-shard id offset, and
// bf16 rounding of f32 data. Grid-stride loops, any launch shape.
//
// strided_copy_b{2,4}(const T* in, T* out, StridedSpec s)
//     For every index (i_0 .. i_{rank-1}) of the iteration shape s.shape (row-major, s.n total):
//       out[s.out_base + sum_d i_d * s.out_stride[d]] =
//           in[s.in_base + sum_d (i_d / s.in_div[d]) * s.in_stride[d]]
//     Strides in elements; in_div >= 1 (repeat_interleave divides the index). b2 moves 2-byte
//     elements (bf16), b4 4-byte ones (f32, i32). in and out must not overlap.
// rank_offset_i32(const int* x, int* out, i64 n, int off)     out = x - off (wrapping)
// round_bf16_f32(const float* x, float* out, i64 n)           out = f32(bf16(x)), nearest even
#include "common.cuh"

#define SHARDC_MAX_RANK 8

struct StridedSpec {
    i64 rank;
    i64 n;
    i64 in_base;
    i64 out_base;
    i64 shape[SHARDC_MAX_RANK];
    i64 in_stride[SHARDC_MAX_RANK];
    i64 in_div[SHARDC_MAX_RANK];
    i64 out_stride[SHARDC_MAX_RANK];
};

// The index is kept as mixed-radix digits over s.shape (innermost last), decomposed once per
// thread with divisions and then advanced by the grid stride's digits with carries: no division
// per element (only for a dim with in_div > 1, a repeat_interleave). Every dim up to
// SHARDC_MAX_RANK is walked (the padding dims have shape 1, strides 0, in_div 1, so their digit
// stays 0), which keeps the digits in registers.
template <typename T>
__device__ __forceinline__ void strided_copy_impl(const T* in, T* out, const StridedSpec& s) {
    const i64 start = global_thread_id(), step = grid_stride();
    if (start >= s.n) return;
    i64 idx[SHARDC_MAX_RANK], inc[SHARDC_MAX_RANK];
    i64 a = start, b = step;
#pragma unroll
    for (int d = SHARDC_MAX_RANK - 1; d >= 0; --d) {
        idx[d] = 0;
        inc[d] = 0;
        if (s.shape[d] != 1) {
            const i64 qa = a / s.shape[d], qb = b / s.shape[d];
            idx[d] = a - qa * s.shape[d];
            inc[d] = b - qb * s.shape[d];
            a = qa;
            b = qb;
        }
    }
    // What is left of b counts whole iterations: when it is not 0, one step ends the loop.
    for (i64 i = start; i < s.n; i += step) {
        i64 src = s.in_base;
        i64 dst = s.out_base;
#pragma unroll
        for (int d = 0; d < SHARDC_MAX_RANK; ++d) {
            const i64 k = s.in_div[d] == 1 ? idx[d] : idx[d] / s.in_div[d];
            src += k * s.in_stride[d];
            dst += idx[d] * s.out_stride[d];
        }
        out[dst] = in[src];
        // idx += inc; a carry out of dim 0 means i + step >= n.
        i64 carry = 0;
#pragma unroll
        for (int d = SHARDC_MAX_RANK - 1; d >= 0; --d) {
            const i64 v = idx[d] + inc[d] + carry;
            carry = v >= s.shape[d] ? 1 : 0;
            idx[d] = v - carry * s.shape[d];
        }
    }
}

extern "C" __global__ void strided_copy_b2(const unsigned short* in, unsigned short* out,
                                           StridedSpec s) {
    strided_copy_impl(in, out, s);
}

extern "C" __global__ void strided_copy_b4(const unsigned int* in, unsigned int* out,
                                           StridedSpec s) {
    strided_copy_impl(in, out, s);
}

extern "C" __global__ void rank_offset_i32(const int* x, int* out, i64 n, int off) {
    for (i64 i = global_thread_id(); i < n; i += grid_stride()) {
        out[i] = (int)((unsigned int)x[i] - (unsigned int)off);
    }
}

extern "C" __global__ void round_bf16_f32(const float* x, float* out, i64 n) {
    for (i64 i = global_thread_id(); i < n; i += grid_stride()) {
        out[i] = bf16_to_f32(f32_to_bf16(x[i]));
    }
}
