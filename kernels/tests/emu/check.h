// Shared helpers of the emulator tests (each test_*.cpp is its own program): a seeded RNG,
// the tolerance checks against double references, the host bf16 rounding, calling a kernel's
// f32 or bf16 entry point by type, and buffers placed at chosen offsets from a 16-byte boundary
// with the count telling a kernel's vector path from its scalar fallback.
#pragma once
#include "shim.h"
#include <random>
#include <cfloat>
static int failures = 0;
static std::mt19937 rng(42);
std::vector<float> randv(size_t n, float lo = -2, float hi = 2) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n); for (auto& x : v) x = d(rng); return v;
}
void check(const char* what, const std::vector<float>& got, const std::vector<double>& want, double atol, double rtol) {
    double worst = 0; size_t wi = 0; bool bad = false;
    if (got.size() != want.size()) { printf("FAIL %s size\n", what); failures++; return; }
    for (size_t i = 0; i < got.size(); ++i) {
        double g = got[i], w = want[i];
        if (std::isnan(w) && std::isnan(g)) continue;
        if (std::isinf(w) && g == w) continue;
        double err = std::fabs(g - w);
        if (!(err <= atol + rtol * std::fabs(w))) { if (!bad || err > worst) { worst = err; wi = i; } bad = true; }
    }
    if (bad) { printf("FAIL %s: at %zu got %g want %g\n", what, wi, got[wi], want[wi]); failures++; }
    else printf("ok   %s (%zu values)\n", what, got.size());
}
// check() plus how close the worst value came to the tolerance (1 = at the limit), so the
// tolerances can be kept at about twice the worst error seen (`worst_seen`, over the program).
static double worst_seen = 0;
void check_tol(const char* what, const std::vector<float>& got, const std::vector<double>& want, double atol, double rtol) {
    double w = 0;
    for (size_t i = 0; i < got.size() && i < want.size(); ++i)
        if (std::isfinite(want[i])) w = std::max(w, std::fabs(got[i] - want[i]) / (atol + rtol * std::fabs(want[i])));
    check(what, got, want, atol, rtol);
    printf("       worst at %.2f of the tolerance\n", w);
    worst_seen = std::max(worst_seen, w);
}
// Rows of `width` values whose `live[r]` is 0 (nothing visible to them) must be exactly zero,
// and some rows must be live (a case where everything is zero tests nothing).
void check_dead_rows(const char* what, const std::vector<float>& got, const std::vector<char>& live, size_t width) {
    size_t dead = 0, bad = 0, rows = got.size() / width;
    for (size_t r = 0; r < rows; ++r) {
        if (live[r]) continue;
        dead++;
        for (size_t i = 0; i < width; ++i) bad += got[r * width + i] != 0;
    }
    const bool ok = bad == 0 && dead < rows;
    printf("%s %s: %zu of %zu rows see nothing, %zu nonzero values there\n", ok ? "ok  " : "FAIL", what, dead, rows, bad);
    failures += !ok;
}
// host bf16 reference: nearest with ties to even, computed by comparing candidates in double
unsigned short host_bf16(float f) {
    if (std::isnan(f)) { unsigned u; memcpy(&u, &f, 4); return (u >> 16) | 0x40; }
    unsigned u; memcpy(&u, &f, 4);
    unsigned short lo = u >> 16, hi = lo + 1;
    // bf16 value in double; the pattern past the largest finite one counts as 2^128 (IEEE
    // rounding with an unbounded exponent, then overflow to inf).
    auto val = [](unsigned short b) { if ((b & 0x7fff) == 0x7f80) return std::copysign(std::ldexp(1.0, 128), (b & 0x8000) ? -1.0 : 1.0);
        unsigned v = (unsigned)b << 16; float r; memcpy(&r, &v, 4); return (double)r; };
    if ((u & 0xffff) == 0) return lo;
    double dl = std::fabs((double)f - val(lo)), dh = std::fabs(val(hi) - (double)f);
    if (dl < dh) return lo; if (dh < dl) return hi; return (lo & 1) ? hi : lo;
}
float host_bf16_f(unsigned short b) { unsigned v = (unsigned)b << 16; float r; memcpy(&r, &v, 4); return r; }
std::vector<double> dv(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// ---- 16-byte vector paths: buffers at chosen offsets, and which path a kernel took ----------
// A copy of v placed `off` elements past a 16-byte boundary.
template <class T> struct Placed {
    std::vector<T> buf; T* p;
    Placed(const std::vector<T>& v, int off) : buf(v.size() + 16 + off) {
        const size_t skip = ((16 - ((uintptr_t)buf.data() & 15)) & 15) / sizeof(T);
        p = buf.data() + skip + off;
        std::copy(v.begin(), v.end(), p);
    }
    std::vector<float> f32(size_t n) const {
        std::vector<float> r(n);
        for (size_t i = 0; i < n; ++i) { if constexpr (sizeof(T) == 2) r[i] = host_bf16_f(p[i]); else r[i] = p[i]; }
        return r;
    }
};
// Rounds x to bf16 in place (so references see the kernel's inputs) and returns the bf16 bits.
std::vector<unsigned short> to_bf16(std::vector<float>& x) {
    std::vector<unsigned short> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) { r[i] = host_bf16(x[i]); x[i] = host_bf16_f(r[i]); }
    return r;
}
template <class T> std::vector<T> as(std::vector<float>& x) {
    if constexpr (sizeof(T) == 2) return to_bf16(x); else return x;
}
// The f32 values of a kernel's T buffer (bf16 widened, exactly).
template <class T> std::vector<float> as_f32(const std::vector<T>& x) {
    std::vector<float> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) { if constexpr (sizeof(T) == 2) r[i] = host_bf16_f(x[i]); else r[i] = x[i]; }
    return r;
}
// Calls the f32 or the bf16 entry point of NAME, by T (in a template on T).
#define CALL_T(T, NAME, ...) \
    do { if constexpr (sizeof(T) == 2) NAME##_bf16(__VA_ARGS__); else NAME##_f32(__VA_ARGS__); } while (0)
long long g_vec_mark = 0;
void mark_vec() { g_vec_mark = g_vec_accesses.load(); }
// Fails unless 16-byte accesses happened since mark_vec() exactly when `want`.
void check_path(const char* what, bool want) {
    const long long n = g_vec_accesses.load() - g_vec_mark;
    if ((n > 0) != want) { printf("FAIL %s: %lld vector accesses, wanted %s\n", what, n, want ? "some" : "none"); failures++; }
    else printf("ok   %s: %s path (%lld vector accesses)\n", what, want ? "vector" : "scalar", n);
}
template <class T> constexpr int lanes() { return 16 / sizeof(T); }
// Whether some of the R rows of H elements at x can take a row kernel's vector path: the row
// start (and w, the weights, unless null) 16-byte aligned and H at least one vector.
template <class T> bool any_row_vectors(const T* x, int R, int H, const void* w = nullptr) {
    bool any = false;
    for (int r = 0; r < R; ++r) any |= ((uintptr_t)(x + (size_t)r * H) & 15) == 0 && ((uintptr_t)w & 15) == 0 && H >= lanes<T>();
    return any;
}
// Fails unless a and b hold the same bits (a kernel's result on two launch shapes that must not
// change it); `how` names the two.
template <class T> void check_same_bits(const char* what, const char* how, const std::vector<T>& a, const std::vector<T>& b) {
    const bool same = a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
    printf("%s %s: %s the same bits\n", same ? "ok  " : "FAIL", what, how); failures += !same;
}
template <class T> const char* tname() { return sizeof(T) == 2 ? "bf16" : "f32"; }

// The packed row of each (token n, expert e) that gates [N, E] route (expert by expert, each
// expert's tokens ascending: moe_route_positions' map), -1 where the gate is zero; *rows gets
// how many there are.
std::vector<int> packed_positions(const std::vector<float>& g, int N, int E, int* rows) {
    std::vector<int> pos((size_t)N * E, -1);
    int next = 0;
    for (int e = 0; e < E; ++e)
        for (int n = 0; n < N; ++n)
            if (g[(size_t)n * E + e] != 0) pos[(size_t)n * E + e] = next++;
    *rows = next;
    return pos;
}

// A packed [E, N, width] operand made from `dense`: packed row pos[n * E + e] (packed_positions'
// map) holds dense row e * N + n, for the `rows` routed rows; then `spare` rows of `fill`.
template <class T>
std::vector<T> pack_rows(const std::vector<T>& dense, const std::vector<int>& pos, int N, int E,
                         int width, int rows, int spare, T fill) {
    std::vector<T> p((size_t)(rows + spare) * width, fill);
    for (int n = 0; n < N; ++n)
        for (int e = 0; e < E; ++e)
            if (pos[(size_t)n * E + e] >= 0)
                std::copy_n(dense.begin() + ((size_t)e * N + n) * width, width,
                            p.begin() + (size_t)pos[(size_t)n * E + e] * width);
    return p;
}

// NaN as a T (f32, or bf16 bits).
template <class T> T nan_as() {
    std::vector<float> v{NAN};
    return as<T>(v)[0];
}
