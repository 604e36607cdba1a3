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
// unit tests check them against these layouts.
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
#endif  // SHARDC_MMA_CUH
