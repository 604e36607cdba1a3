// moe_grad.cu under the SIMT emulation: router_grad, dispatch_grad, combine_grad_y and
// combine_grad_gates, f32 and bf16, against double-precision references written from the
// formulas of runtime/src/cpu/train/moe.rs; the experts router_grad keeps must be exactly those
// the forward router_* (moe.cu) routes, ties included.
#include "check.h"
#include "cu/moe.cu"
#include "cu/moe_grad.cu"

// RouterGrad from the CPU formula: p = softmax(logits) in double, kept = the top_k by value,
// ties to the lower index (equal logits give equal probabilities), S = sum_K p; dp_e =
// (dg_e - sum_K dg g) / S on K (normalize) or dg_e (not), 0 off K; dlogits = p (dp - p.dp).
std::vector<double> router_grad_ref(const std::vector<float>& lg, const std::vector<float>& dg, int N, int E, int topk, int norm, std::vector<char>& kept) {
    std::vector<double> out(N * E);
    kept.assign(N * E, 0);
    for (int n = 0; n < N; ++n) {
        const float* l = &lg[n * E]; const float* d = &dg[n * E];
        double m = -INFINITY; for (int e = 0; e < E; ++e) m = std::max(m, (double)l[e]);
        std::vector<double> p(E); double z = 0;
        for (int e = 0; e < E; ++e) { p[e] = std::exp(l[e] - m); z += p[e]; }
        for (auto& x : p) x /= z;
        std::vector<int> idx(E); for (int e = 0; e < E; ++e) idx[e] = e;
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return l[a] > l[b]; });
        const int k = std::min(topk, E);
        double s = 0; for (int i = 0; i < k; ++i) { kept[n * E + idx[i]] = 1; s += p[idx[i]]; }
        std::vector<double> dp(E, 0);
        double dot = 0; for (int i = 0; i < k; ++i) dot += d[idx[i]] * p[idx[i]] / s;
        for (int i = 0; i < k; ++i) dp[idx[i]] = norm ? (d[idx[i]] - dot) / s : d[idx[i]];
        double pdp = 0; for (int e = 0; e < E; ++e) pdp += p[e] * dp[e];
        for (int e = 0; e < E; ++e) out[n * E + e] = p[e] * (dp[e] - pdp);
    }
    return out;
}

template <typename T>
void router_case(int E, int topk, int norm) {
    const bool bf = sizeof(T) == 2;
    const int N = 7;
    auto lg = randv(N * E, -3, 3), dg = randv(N * E);
    // Ties: token 0 has experts 1, 2, 3 at the maximum; token 1 has every expert equal; token 2
    // has expert 0 first and experts 2 and 3 tied second.
    lg[0 * E + 1] = lg[0 * E + 2] = lg[0 * E + 3] = 4.0f;
    for (int e = 0; e < E; ++e) lg[1 * E + e] = 0.5f;
    lg[2 * E + 0] = 4.0f; lg[2 * E + 2] = lg[2 * E + 3] = 3.5f;
    for (int e = 0; e < E; ++e) if (e != 0 && e != 2 && e != 3) lg[2 * E + e] = std::min(lg[2 * E + e], 3.0f);
    auto lgb = as<T>(lg), dgb = as<T>(dg);
    std::vector<T> out(N * E, (T)7), gates(N * E, (T)7);
    launch({2}, {64}, [&] { CALL_T(T, router_grad, lgb.data(), dgb.data(), out.data(), N, E, topk, norm); });
    launch({1}, {96}, [&] { CALL_T(T, router, lgb.data(), gates.data(), N, E, topk, norm); });
    std::vector<char> kept;
    const auto want = router_grad_ref(lg, dg, N, E, topk, norm, kept);
    char what[128];
    snprintf(what, sizeof what, "router_grad_%s experts=%d top_k=%d normalize=%d", bf ? "bf16" : "f32", E, topk, norm);
    // f32: about twice the worst error seen; bf16: the output rounded to 8 bits.
    check_tol(what, as_f32(out), want, bf ? 2.5e-3 : 5e-8, bf ? 2.5e-3 : 5e-7);
    // The forward routes exactly the reference's kept experts (so the backward's selection,
    // which is the forward's code, is the CPU's too).
    const auto g = as_f32(gates);
    int wrong = 0;
    for (int i = 0; i < N * E; ++i) wrong += (g[i] != 0) != (kept[i] != 0);
    printf("%s %s: forward gates on the kept experts (%d differ)\n", wrong ? "FAIL" : "ok  ", what, wrong);
    failures += wrong != 0;
}

// gates [N, E] with the routing of a top-2 router: two non-zero experts per token (every
// second token only one), the rest 0.
std::vector<float> routed_gates(int N, int E) {
    std::vector<float> g(N * E, 0.f);
    for (int n = 0; n < N; ++n) {
        g[n * E + n % E] = 0.625f + 0.01f * n;
        if (n % 2 == 0) g[n * E + (n * 3 + 1) % E] = 0.375f - 0.01f * n;
    }
    return g;
}

template <typename T>
void dispatch_combine_case(int E) {
    const bool bf = sizeof(T) == 2;
    const char* dt = bf ? "bf16" : "f32";
    const int N = 6, H = 37;
    auto gates = routed_gates(N, E), dxe = randv(E * N * H), dy = randv(N * H), y = randv(E * N * H);
    // Unrouted slots hold garbage that must not leak in (token 1 is not routed to expert 0).
    dxe[(0 * N + 1) * H + 3] = NAN; y[(0 * N + 1) * H + 5] = NAN;
    auto gb = as<T>(gates), dxeb = as<T>(dxe), dyb = as<T>(dy), yb = as<T>(y);
    // (atol, rtol) at about twice the worst error seen (bf16: outputs rounded to 8 bits): the
    // copies and short sums, then the dot products over hidden.
    const double tol[2] = {bf ? 5e-3 : 1.5e-8, bf ? 5e-3 : 1.5e-7};
    const double tol_dot[2] = {bf ? 5e-3 : 4e-7, bf ? 5e-3 : 4e-6};
    char what[128];

    // Packed operands (moe_route_positions' map): the routed rows only, then 2 spare NaN rows.
    int prow = 0;
    const auto pos = packed_positions(gates, N, E, &prow);
    auto pack = [&](const std::vector<T>& dense) { return pack_rows(dense, pos, N, E, H, prow, 2, nan_as<T>()); };
    for (bool packed : {false, true}) {
    const int* pp = packed ? pos.data() : nullptr;
    const char* how = packed ? " packed" : "";
    std::vector<T> dxe_in = packed ? pack(dxeb) : dxeb, y_in = packed ? pack(yb) : yb;
    std::vector<T> dx(N * H, (T)7);
    launch({3}, {32}, [&] { CALL_T(T, dispatch_grad, dxe_in.data(), gb.data(), dx.data(), N, E, H, pp); });
    std::vector<double> want_dx(N * H, 0);
    for (int n = 0; n < N; ++n) for (int e = 0; e < E; ++e) if (gates[n * E + e] != 0)
        for (int c = 0; c < H; ++c) want_dx[n * H + c] += dxe[(e * N + n) * H + c];
    snprintf(what, sizeof what, "dispatch_grad_%s%s experts=%d (unrouted NaN ignored)", dt, how, E); check_tol(what, as_f32(dx), want_dx, tol[0], tol[1]);

    std::vector<T> dyy(E * N * H, (T)7);
    launch({2}, {64}, [&] { CALL_T(T, combine_grad_y, gb.data(), dyb.data(), dyy.data(), N, E, H, pp); });
    std::vector<double> want_dyy(E * N * H, 0);
    for (int e = 0; e < E; ++e) for (int n = 0; n < N; ++n) if (gates[n * E + e] != 0)
        for (int c = 0; c < H; ++c) want_dyy[(e * N + n) * H + c] = (double)gates[n * E + e] * dy[n * H + c];
    if (packed) {  // the packed rows, and the initial values past them (never written)
        const auto untouched = as_f32(std::vector<T>(E * N * H, (T)7));
        std::vector<double> w(untouched.begin(), untouched.end());
        for (int n = 0; n < N; ++n) for (int e = 0; e < E; ++e) if (pos[n * E + e] >= 0)
            for (int c = 0; c < H; ++c) w[(size_t)pos[n * E + e] * H + c] = want_dyy[((size_t)e * N + n) * H + c];
        want_dyy = w;
    }
    snprintf(what, sizeof what, "combine_grad_y_%s%s experts=%d", dt, how, E); check_tol(what, as_f32(dyy), want_dyy, tol[0], tol[1]);

    std::vector<T> dg(N * E, (T)7);
    launch({2}, {64}, [&] { CALL_T(T, combine_grad_gates, y_in.data(), gb.data(), dyb.data(), dg.data(), N, E, H, pp); });
    std::vector<double> want_dg(N * E, 0);
    for (int n = 0; n < N; ++n) for (int e = 0; e < E; ++e) if (gates[n * E + e] != 0)
        for (int c = 0; c < H; ++c) want_dg[n * E + e] += (double)dy[n * H + c] * y[(e * N + n) * H + c];
    snprintf(what, sizeof what, "combine_grad_gates_%s%s experts=%d (unrouted NaN ignored)", dt, how, E); check_tol(what, as_f32(dg), want_dg, tol_dot[0], tol_dot[1]);
    // Unrouted entries exactly zero (dense: dyy's unrouted rows too).
    const auto gy = as_f32(dyy), gg = as_f32(dg);
    int bad = 0;
    for (int n = 0; n < N; ++n) for (int e = 0; e < E; ++e) if (gates[n * E + e] == 0) {
        bad += gg[n * E + e] != 0;
        if (!packed) for (int c = 0; c < H; ++c) bad += gy[(e * N + n) * H + c] != 0;
    }
    printf("%s combine_grad_%s%s experts=%d: %d nonzero values at unrouted slots\n", bad ? "FAIL" : "ok  ", dt, how, E, bad);
    failures += bad != 0;
    }
}

int main() {
    for (int E : {4, 8}) for (int topk : {1, 2}) for (int norm : {0, 1}) {
        router_case<float>(E, topk, norm);
        router_case<bf16>(E, topk, norm);
    }
    for (int E : {4, 8}) {
        dispatch_combine_case<float>(E);
        dispatch_combine_case<bf16>(E);
    }
    printf("worst error at %.2f of its tolerance\n", worst_seen);
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
