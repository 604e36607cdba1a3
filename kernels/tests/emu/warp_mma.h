// C++ versions of the warp-collective wrappers of src/cu/mma.cuh for the SIMT emulation.
// Each lane publishes its operands in its warp slot, the warp meets at its barrier, every lane
// computes its own result from the gathered operands (per the PTX ISA fragment layouts that
// mma.cuh documents), and the warp meets again before the slots can be reused.
// cp.async copies are deferred to the wait_group that covers them (see below).
#pragma once
#define SHARDC_EMU 1
#include <cstdint>

inline void emu_fail(const char* what) { std::fprintf(stderr, "emulator: %s\n", what); std::abort(); }

// The element of an 8x8 matrix whose row starts at `row` (16 bytes of shared memory).
inline float emu_bf16_at(const unsigned short* row, int col) {
    unsigned v = (unsigned)row[col] << 16; float f; std::memcpy(&f, &v, 4); return f;
}
inline float emu_reg_half(unsigned reg, int hi) {
    unsigned v = (hi ? reg >> 16 : reg & 0xffffu) << 16; float f; std::memcpy(&f, &v, 4); return f;
}
// Whether p points into the emulated shared memory at a 16-byte boundary of it.
inline bool emu_shared16(const void* p) {
    const char* c = (const char*)p; const char* base = (const char*)g_smem;
    return c >= base && c + 16 <= base + sizeof g_smem && (c - base) % 16 == 0;
}

inline void mma_bf16_16816(float* acc, const unsigned* a, const unsigned* b) {
    const int lane = threadIdx.x & 31;
    for (int i = 0; i < 4; ++i) tw->frag[lane][i] = a[i];
    tw->frag[lane][4] = b[0]; tw->frag[lane][5] = b[1];
    tw->bar->arrive_and_wait();
    // A[r][k]: lane (r % 8) * 4 + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2.
    auto A = [](int r, int k) { return emu_reg_half(tw->frag[(r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)], k % 2); };
    // B[k][n]: lane n * 4 + (k % 8) / 2, register 4 + (k >= 8), half k % 2.
    auto B = [](int k, int n) { return emu_reg_half(tw->frag[n * 4 + (k % 8) / 2][4 + (k >= 8)], k % 2); };
    const int g = lane >> 2, c = lane & 3;
    float d[4];
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >> 1), n = 2 * c + (i & 1);
        double s = acc[i];
        for (int k = 0; k < 16; ++k) s += (double)A(r, k) * B(k, n);
        d[i] = (float)s;
    }
    tw->bar->arrive_and_wait();
    for (int i = 0; i < 4; ++i) acc[i] = d[i];
}

inline void emu_ldmatrix_x4(unsigned* r, const unsigned short* row, bool trans) {
    const int lane = threadIdx.x & 31;
    if (!emu_shared16(row)) emu_fail("ldmatrix row address not 16-byte aligned shared memory");
    tw->slots[lane] = (unsigned long long)(uintptr_t)row;
    tw->bar->arrive_and_wait();
    auto rowp = [](int m, int i) { return (const unsigned short*)(uintptr_t)tw->slots[m * 8 + i]; };
    const int g = lane >> 2, c = lane & 3;
    unsigned out[4];
    for (int m = 0; m < 4; ++m) {
        unsigned lo, hi;
        if (!trans) { lo = rowp(m, g)[2 * c]; hi = rowp(m, g)[2 * c + 1]; }
        else { lo = rowp(m, 2 * c)[g]; hi = rowp(m, 2 * c + 1)[g]; }
        out[m] = lo | (hi << 16);
    }
    tw->bar->arrive_and_wait();
    for (int m = 0; m < 4; ++m) r[m] = out[m];
}
inline void ldmatrix_x4(unsigned* r, const unsigned short* row) { emu_ldmatrix_x4(r, row, false); }
inline void ldmatrix_x4_trans(unsigned* r, const unsigned short* row) { emu_ldmatrix_x4(r, row, true); }

// cp.async: each copy is queued in this thread's open group; commit closes the group and
// wait_group<N> performs every committed group but the newest N, oldest first. A kernel that
// reads shared memory before waiting for (or without committing) its copies reads stale bytes,
// as it may on the GPU, and the attention checks fail.
struct EmuCopy { unsigned short* dst; const unsigned short* src; int bytes; };
struct EmuCopies {
    std::vector<EmuCopy> open;
    std::vector<std::vector<EmuCopy>> committed;  // oldest first
    ~EmuCopies() { if (!open.empty() || !committed.empty()) emu_fail("a thread exited with cp.async copies never waited for"); }
};
thread_local EmuCopies emu_copies;
inline void cp_async_cg16(unsigned short* dst, const unsigned short* src, int src_bytes) {
    if (!emu_shared16(dst)) emu_fail("cp.async destination not 16-byte aligned shared memory");
    if ((uintptr_t)src % 16 != 0) emu_fail("cp.async source not 16-byte aligned");
    if (src_bytes != 0 && src_bytes != 16) emu_fail("cp.async src_bytes must be 0 or 16 here");
    emu_copies.open.push_back({dst, src, src_bytes});
}
inline void cp_async_commit() {
    emu_copies.committed.push_back(std::move(emu_copies.open));
    emu_copies.open.clear();
}
template <int N> inline void cp_async_wait() {
    auto& groups = emu_copies.committed;
    while (groups.size() > (size_t)N) {
        for (const EmuCopy& c : groups.front()) {
            std::memcpy(c.dst, c.src, c.bytes);
            std::memset((char*)c.dst + c.bytes, 0, 16 - c.bytes);
        }
        groups.erase(groups.begin());
    }
}
