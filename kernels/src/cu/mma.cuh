// mma.cuh: warp-level tensor-core and async-copy primitives (sm_80+), as small wrappers around
// inline PTX. Include after common.cuh (it uses bf16 and f32_to_bf16).
//
// Every wrapper is warp-collective except cp.async: all 32 lanes of the warp must call it
// together (converged), each passing its own registers or row address. Fragment layouts are
// the PTX ISA's ("Matrix Fragments for mma.m16n8k16 with floating point type", "ldmatrix"),
// with g = lane / 4 (groupID) and c = lane % 4 (threadID_in_group); a `unsigned` register holds
// two bf16, the lower-indexed element in the low 16 bits:
//
//   A (16x16, row-major, 4 regs): a[0] = A[g][2c, 2c+1]      a[1] = A[g+8][2c, 2c+1]
//                                 a[2] = A[g][2c+8, 2c+9]    a[3] = A[g+8][2c+8, 2c+9]
//   B (16x8, "col": B[k][n] with k contiguous per n, 2 regs):
//                                 b[0] = B[2c, 2c+1][g]      b[1] = B[2c+8, 2c+9][g]
//   C/D (16x8 f32, 4 floats):     d[0], d[1] = D[g][2c, 2c+1]   d[2], d[3] = D[g+8][2c, 2c+1]
//
//   ldmatrix x4: lane l gives the row address (16 bytes, 16-byte aligned, shared memory) of row
//   l % 8 of 8x8 matrix l / 8. Register i of lane l receives matrix i's M[g][2c, 2c+1]; with
//   .trans it receives M[2c][g] (low) and M[2c+1][g] (high), i.e. the transposed fragment.
//
// Under the SIMT emulator (kernels/tests/emu, which defines SHARDC_EMU) the same names are
// C++ functions that gather the lanes' registers through the warp's barrier; the emulator's
// unit tests check them against these layouts. The tile helpers at the end (swizzled bf16 tiles,
// their cp.async copy, X B from accumulator registers) are built on the wrappers and shared by
// attention_tc.cu and attention_bwd_tc.cu.
#ifndef SHARDC_MMA_CUH
#define SHARDC_MMA_CUH

// Two f32 -> one register of two bf16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
}

#ifndef SHARDC_EMU

// 32-bit shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// acc (16x8 f32, C/D layout) += A (16x16 bf16) * B (16x8 bf16).
__device__ __forceinline__ void mma_bf16_16816(float* acc, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 b16 matrices from shared memory; `row` is this lane's row address (see above).
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const bf16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row))
                 : "memory");
}

// The same, transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const bf16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row))
                 : "memory");
}

// Per thread (not collective): copies `src_bytes` (0 or 16) bytes from global `src` to shared
// `dst` and zero-fills the rest of the 16, asynchronously, bypassing L1 (.cg). Both addresses
// 16-byte aligned; with src_bytes = 0 nothing is read, but `src` must still be a valid address.
__device__ __forceinline__ void cp_async_cg16(bf16* dst, const bf16* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(smem_u32(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}

// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight. Other threads'
// copies become visible only after a following __syncthreads().
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#endif  // !SHARDC_EMU

// ---- bf16 tiles in shared memory and the products on them ----------------------------------

// Element offset of 16-byte chunk `chunk` of row `row` in a tile with rows of W bf16 (W = 32, 64
// or 128): chunk ^ (row % 8) for rows of at least 8 chunks, chunk ^ ((row / 2) % 4) for rows of
// 4 (two rows share a 128-byte bank line), so the 8 row addresses of every ldmatrix hit 8
// distinct bank groups.
template <int W>
__device__ __forceinline__ int tile_swizzle(int row, int chunk) {
    return row * W + ((W >= 64 ? chunk ^ (row & 7) : chunk ^ ((row >> 1) & 3)) << 3);
}

// Starts the copy, by the block's THREADS threads, of the ROWS rows r0 .. r0 + ROWS - 1 of head
// `h` of a [B, seq, heads, D] tensor into `dst` (rows of D, swizzled as above); rows at or past
// `row_end` are zero-filled (src-size 0, nothing read). Closed by the caller's cp_async_commit.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void cp_async_tile(bf16* dst, const bf16* src, int b, int r0,
                                              int row_end, int seq, int heads, int h) {
    constexpr int CHUNKS = D / 8;
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int j = idx / CHUNKS;
        const int ch = idx % CHUNKS;
        const int r = r0 + j;
        const bool ok = r < row_end;
        const bf16* from = ok ? src + (((i64)b * seq + r) * heads + h) * D + ch * 8 : src;
        cp_async_cg16(dst + tile_swizzle<D>(j, ch), from, ok ? 16 : 0);
    }
}

// acc[N][4] = 0: N 8-column blocks of mma accumulators (C layout).
template <int N>
__device__ __forceinline__ void mma_zero(float (*acc)[4]) {
#pragma unroll
    for (int nb = 0; nb < N; ++nb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nb][i] = 0.0f;
    }
}

// Calls f(nb, i, col, half) for each of this lane's accumulators acc[nb][i] of N 8-column blocks
// (C layout): column col = 8 nb + 2c + (i & 1) of row g (half 0) or g + 8 (half 1), with
// half = i / 2. Unrolled, so nb and i index register arrays with constants.
template <int N, typename F>
__device__ __forceinline__ void mma_for_each(int lane, F f) {
    const int c = lane & 3;
#pragma unroll
    for (int nb = 0; nb < N; ++nb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) f(nb, i, nb * 8 + 2 * c + (i & 1), i >> 1);
    }
}

// acc[D / 8][4] (16 rows x D, C layout) += X B, by the warp: X (16 rows x K) is the f32
// accumulators x[K / 8][4] of an earlier mma (C layout), rounded to bf16 as the A operand (the
// A fragment of columns 16 kk .. 16 kk + 15 is blocks 2 kk and 2 kk + 1), and B is the K rows of
// the swizzled tile `b_s` (rows of D) by ldmatrix.trans. attention_tc's O += P V and
// attention_bwd_tc's dV += Pᵀ dO and dK += dSᵀ Q.
template <int D, int K>
__device__ __forceinline__ void mma_acc_xb(float (*acc)[4], const float (*x)[4], const bf16* b_s,
                                           int lane) {
    const int mi = lane >> 3;  // the 8x8 matrix this lane addresses in an ldmatrix.x4
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        unsigned xf[4];
        xf[0] = pack_bf16x2(x[2 * kk][0], x[2 * kk][1]);
        xf[1] = pack_bf16x2(x[2 * kk][2], x[2 * kk][3]);
        xf[2] = pack_bf16x2(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        xf[3] = pack_bf16x2(x[2 * kk + 1][2], x[2 * kk + 1][3]);
#pragma unroll
        for (int nb = 0; nb < D / 8; nb += 2) {
            unsigned bfr[4];  // B fragments of column blocks nb and nb + 1
            const int row = kk * 16 + (mi & 1) * 8 + (lane & 7);
            ldmatrix_x4_trans(bfr, b_s + tile_swizzle<D>(row, nb + (mi >> 1)));
            mma_bf16_16816(acc[nb], xf, bfr);
            mma_bf16_16816(acc[nb + 1], xf, bfr + 2);
        }
    }
}

#endif  // SHARDC_MMA_CUH
