// moe_gemm.cu's routed_weight_grad_{f32,bf16} under the SIMT emulation, in both weight layouts,
// against double-precision sums over each expert's routed rows (the contract's lists). The
// routing is top-2-like over 3-4 experts with one expert taking every token and one none (its
// dw must come out all zero); every row of a and dy not routed to the expert holds NaN, and the
// list entries past counts[e] name such rows, so any read outside the routed rows shows; dw is
// pre-filled with a sentinel that every element must lose. Sizes are off the tiles (tokens
// 70/130/300, k 40/72/136, n 24/136), and 300 routed rows take 10 bf16 / 19 f32 row chunks and
// a second window of staged row indices. a and dy are also given packed (the routed rows back
// to back, spare NaN rows after them), each and both.
#include "check.h"
#include "cu/moe_gemm.cu"

// Tile sizes of routed_weight_grad (moe_gemm.cu), for the grid: k rows x n columns of dw[e].
template <class T> constexpr int tile_k() { return sizeof(T) == 2 ? RG_BM : RGF_BM; }
template <class T> constexpr int tile_n() { return sizeof(T) == 2 ? RG_BN : RGF_BN; }

// Per-expert ascending token lists [E, N]: expert 0 every token, expert 1 none, each token also
// up to two of the others at random (two draws over all E, draws of 1 dropped). Entries past
// counts[e] are tokens not routed to e (or 0 when e has every token).
void make_routing(int N, int E, std::vector<int>& counts, std::vector<int>& rows) {
    std::vector<char> routed((size_t)E * N, 0);
    std::uniform_int_distribution<int> pick(0, E - 1);
    for (int t = 0; t < N; ++t) {
        routed[t] = 1;
        for (int i = 0; i < 2; ++i) {
            const int e = pick(rng);
            if (e != 1) routed[(size_t)e * N + t] = 1;
        }
    }
    counts.assign(E, 0);
    rows.assign((size_t)E * N, 0);
    for (int e = 0; e < E; ++e) {
        int j = 0;
        for (int t = 0; t < N; ++t)
            if (routed[(size_t)e * N + t]) rows[(size_t)e * N + j++] = t;
        counts[e] = j;
        for (int t = 0; t < N && j < N; ++t)
            if (!routed[(size_t)e * N + t]) rows[(size_t)e * N + j++] = t;
    }
}

template <class T>
void weight_grad_case(int E, int N, int K, int Nout, int trans, int packed) {
    const bool bf = sizeof(T) == 2;
    std::vector<int> counts, rows;
    make_routing(N, E, counts, rows);
    auto a = randv((size_t)E * N * K, -1, 1), dy = randv((size_t)E * N * Nout, -1, 1);
    // Rows not routed to their expert: NaN (never to be read).
    std::vector<char> routed((size_t)E * N, 0);
    for (int e = 0; e < E; ++e)
        for (int j = 0; j < counts[e]; ++j) routed[(size_t)e * N + rows[(size_t)e * N + j]] = 1;
    for (size_t row = 0; row < (size_t)E * N; ++row) {
        if (routed[row]) continue;
        for (int i = 0; i < K; ++i) a[row * K + i] = NAN;
        for (int c = 0; c < Nout; ++c) dy[row * Nout + c] = NAN;
    }
    // Packed operands (bit 0: a, bit 1: dy): the routed rows back to back, expert by expert in
    // each list's order (expert e's entry j at counts[0] + ... + counts[e - 1] + j), then 3
    // spare rows of NaN.
    std::vector<int> pos((size_t)N * E, -1);
    int total = 0;
    for (int e = 0; e < E; ++e)
        for (int j = 0; j < counts[e]; ++j) pos[(size_t)rows[(size_t)e * N + j] * E + e] = total++;
    auto pack = [&](const std::vector<T>& dense, int width, bool on) {
        return on ? pack_rows(dense, pos, N, E, width, total, 3, nan_as<T>()) : dense;
    };
    Placed<T> ap(pack(as<T>(a), K, packed & 1), 0), dyp(pack(as<T>(dy), Nout, packed & 2), 0);
    const float sentinel = 1152.0f;  // exact in bf16
    std::vector<float> s((size_t)E * K * Nout, sentinel);
    Placed<T> wp(as<T>(s), 0);
    const dim3 grid{(unsigned)((Nout + tile_n<T>() - 1) / tile_n<T>()),
                    (unsigned)((K + tile_k<T>() - 1) / tile_k<T>()), (unsigned)E};
    launch(grid, {RG_THREADS}, [&] {
        CALL_T(T, routed_weight_grad, ap.p, dyp.p, wp.p, counts.data(), rows.data(), (i64)N, K, Nout, trans, packed);
    });
    const auto dw = wp.f32((size_t)E * K * Nout);
    std::vector<float> got;
    std::vector<double> want;
    size_t empty_nonzero = 0, empty_values = 0, left = 0;
    for (int e = 0; e < E; ++e) {
        for (int i = 0; i < K; ++i) {
            for (int c = 0; c < Nout; ++c) {
                double acc = 0;
                for (int j = 0; j < counts[e]; ++j) {
                    const size_t r = (size_t)e * N + rows[(size_t)e * N + j];
                    acc += (double)a[r * K + i] * dy[r * Nout + c];
                }
                const float v = dw[(size_t)e * K * Nout + (trans ? (size_t)c * K + i : (size_t)i * Nout + c)];
                want.push_back(acc);
                got.push_back(v);
                left += v == sentinel;
                if (counts[e] == 0) {
                    empty_values++;
                    empty_nonzero += v != 0 || std::signbit(v);
                }
            }
        }
    }
    char what[200];
    snprintf(what, sizeof what, "routed_weight_grad_%s E=%d tokens=%d k=%d n=%d transpose_w=%d packed a=%d dy=%d counts",
             tname<T>(), E, N, K, Nout, trans, packed & 1, (packed >> 1) & 1);
    for (int e = 0; e < E; ++e) snprintf(what + strlen(what), sizeof what - strlen(what), " %d", counts[e]);
    // f32: about twice the worst error seen (sums of up to 300 products); bf16: the output
    // rounded to 8 bits.
    check_tol(what, got, want, bf ? 4e-3 : 1e-5, bf ? 4e-3 : 2e-6);
    const bool ok = left == 0 && empty_nonzero == 0 && empty_values > 0;
    printf("%s %s: %zu sentinels left, %zu of %zu values of the empty expert not +0\n", ok ? "ok  " : "FAIL", what,
           left, empty_nonzero, empty_values);
    failures += !ok;
}

int main() {
    // (E, tokens, k, n): one tile of every kind; partial k and n tiles (2 bf16 / 3 f32 column
    // tiles), 300 rows (bf16: 10 chunks of 32, f32: 19 of 16, both past the 256-row window);
    // several bf16 k tiles.
    const int shapes[][4] = {{3, 70, 40, 24}, {4, 300, 72, 136}, {3, 130, 136, 24}};
    for (auto& s : shapes) {
        for (int trans : {0, 1}) {
            weight_grad_case<float>(s[0], s[1], s[2], s[3], trans, 0);
            weight_grad_case<bf16>(s[0], s[1], s[2], s[3], trans, 0);
        }
    }
    // Packed a, packed dy, both; 300 rows cross the staged window.
    for (auto& s : {shapes[0], shapes[1]}) {
        for (int packed : {1, 2, 3}) {
            weight_grad_case<float>(s[0], s[1], s[2], s[3], packed == 2, packed);
            weight_grad_case<bf16>(s[0], s[1], s[2], s[3], packed != 2, packed);
        }
    }
    printf("worst error at %.2f of its tolerance\n", worst_seen);
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
