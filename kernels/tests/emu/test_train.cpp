// CPU checks of the training kernels (norm_grad.cu) under the SIMT emulation in shim.h,
// against double-precision references written from the formulas of the CPU reference
// (runtime/src/cpu/train/norm.rs, basic.rs). Run with ./run.sh train.
#include "check.h"
#include "cu/norm_grad.cu"

// Calls the f32 or the bf16 entry point of NAME, by T (in a template on T).
#define CALL_T(T, NAME, ...) \
    do { if constexpr (sizeof(T) == 2) NAME##_bf16(__VA_ARGS__); else NAME##_f32(__VA_ARGS__); } while (0)

// ---- norm_grad.cu ------------------------------------------------------------------------------

// Double references of norm.rs for one row: mean, rstd, and dx.
struct RowRef { double mean, rstd; std::vector<double> xh; };
RowRef row_ref(const float* x, int H, float eps, bool center) {
    RowRef r{0, 0, std::vector<double>(H)};
    if (center) { for (int c = 0; c < H; ++c) r.mean += x[c]; r.mean /= H; }
    double ms = 0; for (int c = 0; c < H; ++c) ms += (x[c] - r.mean) * (x[c] - r.mean);
    r.rstd = 1 / std::sqrt(ms / H + (double)eps);
    for (int c = 0; c < H; ++c) r.xh[c] = (x[c] - r.mean) * r.rstd;
    return r;
}

// Stats, dx and dw of both norms on an R x H problem: x at offx elements past a 16-byte
// boundary (dy and dx too), w at offw; rows take the vector path where they are aligned.
template <class T> void norm_grad_case(int R, int H, int offx, int offw, unsigned block) {
    const bool bf = sizeof(T) == 2; const float eps = 1e-5f;
    // LayerNorm's mean away from 0, so a missing centring shows.
    auto xf = randv(R * H, -1.5f, 2.5f), wf = randv(H), gf = randv(R * H);
    auto xt = as<T>(xf); auto wt = as<T>(wf); auto gt = as<T>(gf);
    Placed<T> x(xt, offx), w(wt, offw), dy(gt, offx), dx(std::vector<T>(R * H), offx);
    bool any_vec = false;
    for (int r = 0; r < R; ++r) any_vec |= ((uintptr_t)(x.p + (size_t)r * H) & 15) == 0 && ((uintptr_t)w.p & 15) == 0 && H >= lanes<T>();
    for (int center : {0, 1}) {
        const char* norm = center ? "layernorm" : "rmsnorm";
        char what[160];
        std::vector<double> want_st(2 * R), want_dx(R * H), want_dw(H, 0);
        for (int r = 0; r < R; ++r) {
            RowRef ref = row_ref(&xf[r * H], H, eps, center);
            want_st[2 * r] = ref.mean; want_st[2 * r + 1] = ref.rstd;
            std::vector<double> g(H); double mg = 0, mgx = 0;
            for (int c = 0; c < H; ++c) { g[c] = (double)gf[r * H + c] * wf[c]; mg += g[c]; mgx += g[c] * ref.xh[c]; }
            mg = center ? mg / H : 0; mgx /= H;
            for (int c = 0; c < H; ++c) {
                want_dx[r * H + c] = ref.rstd * (g[c] - mg - ref.xh[c] * mgx);
                want_dw[c] += gf[r * H + c] * ref.xh[c];
            }
        }
        // Statistics are f32 for either T (bf16 inputs are exact in f32).
        std::vector<float> st(2 * R, NAN);
        mark_vec();
        launch({2}, {block}, [&] { CALL_T(T, norm_stats, x.p, st.data(), R, H, eps, center); });
        snprintf(what, sizeof what, "norm_stats_%s %s R=%d H=%d x+%d block %u", tname<T>(), norm, R, H, offx, block);
        check_path(what, ((uintptr_t)x.p & 15) == 0 && H >= lanes<T>());
        check(what, st, want_st, 2e-7, 2e-7);
        mark_vec();
        launch({3}, {block}, [&] { CALL_T(T, norm_grad_dx, x.p, w.p, dy.p, dx.p, R, H, eps, center); });
        snprintf(what, sizeof what, "norm_grad_dx_%s %s R=%d H=%d x+%d w+%d block %u", tname<T>(), norm, R, H, offx, offw, block);
        check_path(what, any_vec);
        check(what, dx.f32(R * H), want_dx, bf ? 1e-2 : 5e-7, bf ? 1e-2 : 5e-7);
        // dw from the kernel's stats, on two grids: the sums depend only on blockDim.
        std::vector<T> dw(H), dw2(H);
        launch({3}, {96}, [&] { CALL_T(T, norm_grad_dw, x.p, dy.p, st.data(), dw.data(), R, H); });
        launch({1}, {96}, [&] { CALL_T(T, norm_grad_dw, x.p, dy.p, st.data(), dw2.data(), R, H); });
        snprintf(what, sizeof what, "norm_grad_dw_%s %s R=%d H=%d", tname<T>(), norm, R, H);
        check(what, Placed<T>(dw, 0).f32(H), want_dw, bf ? 1e-2 : 1.5e-6, bf ? 1e-2 : 1e-6);
        const bool same = std::memcmp(dw.data(), dw2.data(), H * sizeof(T)) == 0;
        printf("%s %s: grids 3 and 1 give the same bits\n", same ? "ok  " : "FAIL", what); failures += !same;
    }
}

// bias_grad over R x N with a few block shapes (warps = blockDim / 32 stride the rows).
template <class T> void bias_grad_case(int R, int N, unsigned grid, unsigned block) {
    const bool bf = sizeof(T) == 2;
    auto gf = randv(R * N); auto gt = as<T>(gf);
    std::vector<double> want(N, 0);
    for (int r = 0; r < R; ++r) for (int j = 0; j < N; ++j) want[j] += gf[r * N + j];
    std::vector<T> db(N), db2(N);
    launch({grid}, {block}, [&] { CALL_T(T, bias_grad, gt.data(), db.data(), R, N); });
    launch({1}, {block}, [&] { CALL_T(T, bias_grad, gt.data(), db2.data(), R, N); });
    char what[128]; snprintf(what, sizeof what, "bias_grad_%s R=%d N=%d grid %u block %u", tname<T>(), R, N, grid, block);
    check(what, Placed<T>(db, 0).f32(N), want, bf ? 1e-2 : 2e-6, bf ? 1e-2 : 2e-6);
    const bool same = std::memcmp(db.data(), db2.data(), N * sizeof(T)) == 0;
    printf("%s %s: grid 1 gives the same bits\n", same ? "ok  " : "FAIL", what); failures += !same;
}

void test_norm_grad() {
    // H % N != 0 (rows alternate between the vector path and the scalar one), H below the
    // vector width's multiple, a row longer than the register cache (32 threads x 8 vectors),
    // misaligned x or w.
    norm_grad_case<float>(5, 300, 0, 0, 64);
    norm_grad_case<float>(5, 37, 0, 0, 32);
    norm_grad_case<float>(3, 1067, 0, 0, 32);
    norm_grad_case<float>(3, 256, 1, 0, 64);
    norm_grad_case<float>(3, 256, 0, 2, 64);
    norm_grad_case<bf16>(5, 300, 0, 0, 64);
    norm_grad_case<bf16>(5, 37, 0, 0, 32);
    norm_grad_case<bf16>(3, 2056, 0, 0, 32);
    norm_grad_case<bf16>(3, 256, 3, 0, 64);
    bias_grad_case<float>(5, 300, 3, 96);
    bias_grad_case<float>(37, 37, 2, 64);
    bias_grad_case<float>(1, 5, 1, 32);
    bias_grad_case<bf16>(5, 300, 3, 96);
    bias_grad_case<bf16>(37, 37, 2, 256);
}

int main() {
    test_norm_grad();
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
