// moe_gemm.cu under the SIMT emulation: moe_route_index (counts and ascending token lists per
// expert) against a reference written from the contract, and routed_gemm_{f32,bf16} in both
// weight layouts against double-precision products of the listed rows (the unlisted rows of the
// activation NaN), dense or packed (a, out or both: the routed rows back to back, spare rows
// past them), with every unlisted row of out required to keep its sentinel (rows past counts[e] in the list hold other valid token
// indices, so reading them would show). Sizes are off the tiles (tokens 70/260/1100, k 16/40/72,
// n 24/136) and the routing has an expert with every token and one with none.
#include "check.h"
#include "cu/moe_gemm.cu"

// Tile sizes of routed_gemm (moe_gemm.cu), for the grid.
template <class T> constexpr int tile_m() { return sizeof(T) == 2 ? RG_BM : RGF_BM; }
template <class T> constexpr int tile_n() { return sizeof(T) == 2 ? RG_BN : RGF_BN; }

// gates [N, E]: expert 0 routes every token, expert 1 none (when E >= 3), each token also gets
// about two of the others (top-2-like, random); a few zeros are -0.
std::vector<float> make_gates(int N, int E) {
    std::vector<float> g(N * E, 0.f);
    std::uniform_int_distribution<int> pick(0, E - 1);
    std::uniform_real_distribution<float> val(0.05f, 1.0f);
    for (int n = 0; n < N; ++n) {
        g[n * E + 0] = val(rng);
        for (int t = 0; t < 2; ++t) {
            const int e = pick(rng);
            if (E >= 3 && e == 1) continue;
            g[n * E + e] = val(rng);
        }
        if (n % 7 == 3 && E >= 3) g[n * E + 1] = -0.0f;
    }
    return g;
}

// The contract's routing: counts[e] and the ascending token lists [E, N].
void route_ref(const std::vector<float>& g, int N, int E, std::vector<int>& counts, std::vector<int>& rows) {
    counts.assign(E, 0);
    rows.assign((size_t)E * N, 0);
    for (int e = 0; e < E; ++e)
        for (int n = 0; n < N; ++n)
            if (g[n * E + e] != 0) rows[(size_t)e * N + counts[e]++] = n;
}

template <class T>
void route_index_case(int N, int E, unsigned threads) {
    auto g = make_gates(N, E);
    auto gb = as<T>(g);
    std::vector<int> want_counts, want_rows;
    route_ref(g, N, E, want_counts, want_rows);
    std::vector<int> counts(E, -7), rows((size_t)E * N, -7);
    launch({(unsigned)E}, {threads}, [&] { CALL_T(T, moe_route_index, gb.data(), counts.data(), rows.data(), (i64)N, E); });
    int bad = 0;
    for (int e = 0; e < E; ++e) {
        bad += counts[e] != want_counts[e];
        for (int j = 0; j < want_counts[e] && counts[e] == want_counts[e]; ++j)
            bad += rows[(size_t)e * N + j] != want_rows[(size_t)e * N + j];
    }
    printf("%s moe_route_index_%s tokens=%d experts=%d block=%u: counts", bad ? "FAIL" : "ok  ", tname<T>(), N, E, threads);
    for (int e = 0; e < E; ++e) printf(" %d", counts[e]);
    printf(" (%d wrong)\n", bad);
    failures += bad != 0;
    // The packed rows' map from those lists.
    int total = 0;
    const auto want_pos = packed_positions(g, N, E, &total);
    std::vector<int> pos((size_t)N * E, 12345);
    launch({(unsigned)E}, {threads}, [&] { CALL_T(T, moe_route_positions, gb.data(), counts.data(), rows.data(), pos.data(), (i64)N, E); });
    int wrong = 0;
    for (size_t i = 0; i < pos.size(); ++i) wrong += pos[i] != want_pos[i];
    printf("%s moe_route_positions_%s tokens=%d experts=%d: %d routed rows, %d positions wrong\n", wrong ? "FAIL" : "ok  ", tname<T>(), N, E, total, wrong);
    failures += wrong != 0;
}

template <class T>
void gemm_case(int E, int N, int K, int Nout, int trans, int packed) {
    const bool bf = sizeof(T) == 2;
    auto g = make_gates(N, E);
    std::vector<int> counts, rows;
    route_ref(g, N, E, counts, rows);
    // Past counts[e]: valid token indices the kernel must not read (it would write those rows).
    for (int e = 0; e < E; ++e)
        for (int j = counts[e]; j < N; ++j) rows[(size_t)e * N + j] = (j * 5 + e) % N;
    auto a = randv((size_t)E * N * K, -1, 1), w = randv((size_t)E * K * Nout, -1, 1);
    // Unrouted rows of a hold NaN (what an upstream routed GEMM that did not write them may
    // leave there): reading one would turn a result non-finite.
    for (int e = 0; e < E; ++e)
        for (int n = 0; n < N; ++n)
            if (g[(size_t)n * E + e] == 0)
                for (int kk = 0; kk < K; ++kk) a[((size_t)e * N + n) * K + kk] = NAN;
    // Packed operands: the routed rows back to back (expert by expert, each list's order), then
    // 3 spare rows (NaN in a, the sentinel in out) that must stay unread and unwritten.
    int total = 0;
    const auto pos = packed_positions(g, N, E, &total);
    const size_t cap = total + 3;
    auto dense_row = [&](int e, int j) { return (size_t)e * N + rows[(size_t)e * N + j]; };
    auto out_row = [&](int e, int j) {
        return packed & 2 ? (size_t)pos[(size_t)rows[(size_t)e * N + j] * E + e] : dense_row(e, j);
    };
    auto at = as<T>(a);  // rounds a to T in place
    Placed<T> ap(packed & 1 ? pack_rows(at, pos, N, E, K, total, 3, nan_as<T>()) : at, 0);
    Placed<T> wp(as<T>(w), 0);
    const float sentinel = 1152.0f;  // exact in bf16
    const size_t out_rows = packed & 2 ? cap : (size_t)E * N;
    std::vector<float> s(out_rows * Nout, sentinel);
    Placed<T> op(as<T>(s), 0);
    const dim3 grid{(unsigned)((Nout + tile_n<T>() - 1) / tile_n<T>()),
                    (unsigned)((N + tile_m<T>() - 1) / tile_m<T>()), (unsigned)E};
    launch(grid, {RG_THREADS}, [&] {
        CALL_T(T, routed_gemm, ap.p, wp.p, op.p, counts.data(), rows.data(), (i64)N, K, Nout, trans, packed);
    });
    const auto out = op.f32(out_rows * Nout);
    // Routed rows against the double reference; every other row untouched.
    std::vector<float> got;
    std::vector<double> want;
    std::vector<char> listed(out_rows, 0);
    for (int e = 0; e < E; ++e) {
        for (int j = 0; j < counts[e]; ++j) {
            const size_t r = dense_row(e, j), o = out_row(e, j);
            listed[o] = 1;
            for (int c = 0; c < Nout; ++c) {
                double acc = 0;
                for (int kk = 0; kk < K; ++kk) {
                    const double wv = trans ? w[((size_t)e * Nout + c) * K + kk] : w[((size_t)e * K + kk) * Nout + c];
                    acc += (double)a[r * K + kk] * wv;
                }
                want.push_back(acc);
                got.push_back(out[o * Nout + c]);
            }
        }
    }
    char what[200];
    snprintf(what, sizeof what, "routed_gemm_%s E=%d tokens=%d k=%d n=%d transpose_w=%d packed a=%d out=%d",
             tname<T>(), E, N, K, Nout, trans, packed & 1, (packed >> 1) & 1);
    // f32: about twice the worst error seen; bf16: the output rounded to 8 bits.
    check_tol(what, got, want, bf ? 4e-3 : 2e-6, bf ? 4e-3 : 2e-6);
    size_t touched = 0, unlisted = 0;
    for (size_t row = 0; row < out_rows; ++row) {
        if (listed[row]) continue;
        unlisted++;
        for (int c = 0; c < Nout; ++c) touched += out[row * Nout + c] != sentinel;
    }
    const bool ok = touched == 0 && unlisted > 0;
    printf("%s %s: %zu unlisted rows, %zu values written there\n", ok ? "ok  " : "FAIL", what, unlisted, touched);
    failures += !ok;
}

int main() {
    // Tokens off the block (256) and a block narrower than the tokens; an expert with every
    // token (0) and one with none (1).
    for (auto [N, E, threads] : {std::tuple{300, 5, 256u}, std::tuple{70, 3, 96u}, std::tuple{256, 4, 256u}, std::tuple{1, 3, 32u}}) {
        route_index_case<float>(N, E, threads);
        route_index_case<bf16>(N, E, threads);
    }
    // (E, tokens, k, n): one row tile; partial k and n tiles; several row tiles (expert 0 with
    // 260 tokens: 3 bf16 / 5 f32 row tiles); more row tiles than a group of 8 (1100 tokens).
    const int shapes[][4] = {{3, 70, 40, 24}, {3, 70, 72, 136}, {4, 260, 40, 136}, {3, 1100, 16, 136}};
    for (auto& s : shapes) {
        for (int trans : {0, 1}) {
            gemm_case<float>(s[0], s[1], s[2], s[3], trans, 0);
            gemm_case<bf16>(s[0], s[1], s[2], s[3], trans, 0);
        }
    }
    // Packed a, packed out, both (the rows of an expert back to back, offsets from counts).
    for (auto& s : {shapes[1], shapes[2]}) {
        for (int packed : {1, 2, 3}) {
            gemm_case<float>(s[0], s[1], s[2], s[3], packed == 2, packed);
            gemm_case<bf16>(s[0], s[1], s[2], s[3], packed != 2, packed);
        }
    }
    printf("worst error at %.2f of its tolerance\n", worst_seen);
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
