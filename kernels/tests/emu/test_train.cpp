// CPU checks of the training kernels (norm_grad.cu, grad.cu, optim.cu) under the SIMT emulation
// in shim.h, against double-precision references written from the formulas of the CPU
// reference (runtime/src/cpu/train: norm.rs, basic.rs, optim.rs); the optimizer kernels
// against the CPU's own f32 / f64 expressions, bit for bit. Run with ./run.sh train.
#include "check.h"
#include "cu/norm_grad.cu"
#include "cu/grad.cu"
#include "cu/optim.cu"
#include <climits>

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
    const bool any_vec = any_row_vectors(x.p, R, H, w.p);
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
        check(what, as_f32(dw), want_dw, bf ? 1e-2 : 1.5e-6, bf ? 1e-2 : 1e-6);
        check_same_bits(what, "grids 3 and 1 give", dw, dw2);
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
    check(what, as_f32(db), want, bf ? 1e-2 : 2e-6, bf ? 1e-2 : 2e-6);
    check_same_bits(what, "grid 1 gives", db, db2);
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

// ---- grad.cu -----------------------------------------------------------------------------------

// basic.rs `unary_derivative`, in f64.
double d_gelu_tanh(double x) {
    const double k = 0.7978845608028654, inner = k * (x + 0.044715 * x * x * x), t = std::tanh(inner);
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
}
double d_gelu_erf(double x) { return 0.5 * std::erfc(-x * 0.7071067811865476) + x * 0.3989422804014327 * std::exp(-0.5 * x * x); }
double d_silu(double x) { const double s = 1 / (1 + std::exp(-x)); return s * (1 + x * (1 - s)); }
double d_relu(double x) { return x > 0 ? 1 : 0; }
double d_exp(double x) { return std::exp(x); }
double d_neg(double) { return -1; }

struct UnaryGrad {
    const char* name;
    void (*f32)(const float*, const float*, float*, i64);
    void (*bf)(const bf16*, const bf16*, bf16*, i64);
    double (*d)(double);
};
const UnaryGrad UNARY_GRADS[] = {
    {"gelu_tanh", unary_grad_gelu_tanh_f32, unary_grad_gelu_tanh_bf16, d_gelu_tanh},
    {"gelu_erf", unary_grad_gelu_erf_f32, unary_grad_gelu_erf_bf16, d_gelu_erf},
    {"silu", unary_grad_silu_f32, unary_grad_silu_bf16, d_silu},
    {"relu", unary_grad_relu_f32, unary_grad_relu_bf16, d_relu},
    {"exp", unary_grad_exp_f32, unary_grad_exp_bf16, d_exp},
    {"neg", unary_grad_neg_f32, unary_grad_neg_bf16, d_neg},
};

// Every unary gradient on n values (x in [-4, 4] plus the kink, tails and overflow points),
// the buffers `off` elements past a 16-byte boundary; in place over dy when `in_place`.
template <class T> void unary_grad_case(int n, int off, bool in_place) {
    const bool bf = sizeof(T) == 2;
    auto xf = randv(n, -4, 4), gf = randv(n);
    const float special[] = {0.0f, -0.0f, 1e20f, -1e20f, 100.0f, -100.0f, 12.0f, -12.0f, 0.5f};
    for (size_t i = 0; i < sizeof special / sizeof *special && i < (size_t)n; ++i) xf[i * 7 % n] = special[i];
    auto xt = as<T>(xf); auto gt = as<T>(gf);
    const bool aligned = off * sizeof(T) % 16 == 0;
    for (const UnaryGrad& u : UNARY_GRADS) {
        Placed<T> x(xt, off), dy(gt, off), out(std::vector<T>(n), off);
        T* dx = in_place ? dy.p : out.p;
        mark_vec();
        launch({2}, {32}, [&] { if constexpr (sizeof(T) == 2) u.bf(x.p, dy.p, dx, n); else u.f32(x.p, dy.p, dx, n); });
        char what[128]; snprintf(what, sizeof what, "unary_grad_%s_%s n=%d +%d%s", u.name, tname<T>(), n, off, in_place ? " (over dy)" : "");
        check_path(what, aligned);
        std::vector<double> want(n);
        for (int i = 0; i < n; ++i) want[i] = (float)((double)gf[i] * u.d(xf[i]));  // f32, as the CPU's
        check(what, (in_place ? dy : out).f32(n), want, bf ? 1e-2 : 2e-6, bf ? 1e-2 : 4e-6);
    }
}

// repeat_grad with dy [outer, dim * times, inner], the run of `times` summed per dx element.
template <class T> void repeat_grad_case(int outer, int dim, int times, int inner) {
    const bool bf = sizeof(T) == 2;
    auto gf = randv((size_t)outer * dim * times * inner); auto gt = as<T>(gf);
    std::vector<T> dx((size_t)outer * dim * inner);
    std::vector<double> want(dx.size());
    for (int o = 0; o < outer; ++o) for (int i = 0; i < dim; ++i) for (int k = 0; k < inner; ++k) {
        double s = 0; for (int t = 0; t < times; ++t) s += gf[((size_t)(o * dim + i) * times + t) * inner + k];
        want[((size_t)o * dim + i) * inner + k] = s;
    }
    launch({2}, {64}, [&] { CALL_T(T, repeat_grad, gt.data(), dx.data(), outer, dim, times, inner); });
    char what[128]; snprintf(what, sizeof what, "repeat_grad_%s [%d, %d x %d, %d]", tname<T>(), outer, dim, times, inner);
    check(what, Placed<T>(dx, 0).f32(dx.size()), want, bf ? 1e-2 : 3e-7, bf ? 1e-2 : 3e-7);
}

// embedding_grad: ids repeated and outside [0, V) (negative, V, far past it); acc starts
// non-zero to show it adds, and rows no id names keep their bits.
template <class T> void embedding_grad_case(int H) {
    const int V = 7;
    std::vector<int> ids = {3, 0, 6, 3, -1, 7, 3, INT_MIN, 100, 6, INT_MAX, 1};
    const int n = ids.size();
    auto gf = randv((size_t)n * H); auto gt = as<T>(gf);
    auto acc = randv((size_t)V * H); const auto acc0 = acc;
    std::vector<double> want = dv(acc0);
    for (int i = 0; i < n; ++i) if (ids[i] >= 0 && ids[i] < V) for (int c = 0; c < H; ++c) want[(size_t)ids[i] * H + c] += gf[(size_t)i * H + c];
    launch({3}, {32}, [&] { CALL_T(T, embedding_grad, ids.data(), gt.data(), acc.data(), n, V, H); });
    char what[128]; snprintf(what, sizeof what, "embedding_grad_%s V=%d H=%d (repeats, ids outside [0, V))", tname<T>(), V, H);
    check(what, acc, want, 4e-7, 4e-7);
    std::vector<float> untouched; std::vector<double> untouched0;
    for (int v : {2, 4, 5}) for (int c = 0; c < H; ++c) { untouched.push_back(acc[v * H + c]); untouched0.push_back(acc0[v * H + c]); }
    snprintf(what, sizeof what, "embedding_grad_%s rows no id names", tname<T>());
    check(what, untouched, untouched0, 0, 0);
}

void test_grad() {
    for (bool in_place : {false, true}) {
        unary_grad_case<float>(1003, 0, in_place);
        unary_grad_case<bf16>(1003, 0, in_place);
    }
    unary_grad_case<float>(1003, 1, false);
    unary_grad_case<float>(5, 0, false);
    unary_grad_case<bf16>(1003, 3, false);
    unary_grad_case<bf16>(13, 0, false);
    repeat_grad_case<float>(3, 5, 3, 7);
    repeat_grad_case<float>(2, 37, 4, 1);
    repeat_grad_case<float>(1, 3, 1, 300);
    repeat_grad_case<bf16>(3, 5, 3, 7);
    repeat_grad_case<bf16>(2, 37, 4, 1);
    embedding_grad_case<float>(37);
    embedding_grad_case<float>(300);
    embedding_grad_case<bf16>(37);
}

// ---- optim.cu ----------------------------------------------------------------------------------

// optim.rs `moment`, in f32 as Rust evaluates it (no contraction: x86-64 without FMA).
float cpu_moment(float m, float g, float beta, bool squared) {
    const float w = (float)(1.0 - (double)beta);
    return squared ? m * beta + w * g * g : m + w * (g - m);
}

// Both moments for three betas, out separate or over m, buffers `off` elements past a 16-byte
// boundary; bit-identical to cpu_moment (rounded once to bf16 for bf16).
template <class T> void adam_moment_case(int n, int off) {
    auto mf = randv(n, -1, 1), gf = randv(n, -3, 3);
    mf[0] = 0; gf[1] = 0; gf[2] = 1e-20f; mf[3] = 1e30f; gf[4] = 1e19f;
    auto mt = as<T>(mf); auto gt = as<T>(gf);
    const bool aligned = off * sizeof(T) % 16 == 0;
    for (float beta : {0.9f, 0.95f, 0.999f}) for (int squared : {0, 1}) for (bool in_place : {false, true}) {
        Placed<T> m(mt, off), g(gt, off), out(std::vector<T>(n), off);
        T* o = in_place ? m.p : out.p;
        const float w = (float)(1.0 - (double)beta);
        mark_vec();
        launch({2}, {32}, [&] { CALL_T(T, adam_moment, m.p, g.p, o, n, beta, w, squared); });
        char what[128]; snprintf(what, sizeof what, "adam_moment_%s beta %g squared %d n=%d +%d%s", tname<T>(), beta, squared, n, off, in_place ? " (over m)" : "");
        check_path(what, aligned);
        std::vector<double> want(n);
        for (int i = 0; i < n; ++i) {
            const float r = cpu_moment(mf[i], gf[i], beta, squared);
            want[i] = sizeof(T) == 2 ? host_bf16_f(host_bf16(r)) : r;
        }
        check(what, (in_place ? m : out).f32(n), want, 0, 0);
    }
}

// optim.rs `update` for step t, f64 from the f32 spec values, rounded to f32.
struct AdamW { double decay, step_size, bc2_sqrt, eps; };
AdamW adamw_scalars(float lr, float beta1, float beta2, float eps, float wd, float t) {
    const double l = lr, b1 = beta1, b2 = beta2;
    return {1.0 - l * (double)wd, l / (1.0 - std::pow(b1, (double)t)), std::sqrt(1.0 - std::pow(b2, (double)t)), (double)eps};
}
float cpu_update(float w, float m, float v, const AdamW& s) {
    const double denom = std::sqrt((double)v) / s.bc2_sqrt + s.eps;
    return (float)((double)w * s.decay - s.step_size * (double)m / denom);
}

template <class T> void adamw_update_case(int n, int off) {
    auto wf = randv(n, -2, 2), mf = randv(n, -1e-2f, 1e-2f), vf = randv(n, 0, 1e-3f);
    vf[0] = 0; mf[1] = 0; vf[2] = 0; mf[2] = 0; vf[3] = 1e-30f; wf[4] = 0;
    auto wt = as<T>(wf); auto mt = as<T>(mf); auto vt = as<T>(vf);
    const bool aligned = off * sizeof(T) % 16 == 0;
    const AdamW steps[] = {adamw_scalars(1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1), adamw_scalars(3e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, 7),
                           adamw_scalars(1e-2f, 0.8f, 0.99f, 1e-6f, 0.01f, 1000)};
    for (const AdamW& s : steps) for (bool in_place : {false, true}) {
        Placed<T> w(wt, off), m(mt, off), v(vt, off), out(std::vector<T>(n), off);
        T* o = in_place ? w.p : out.p;
        mark_vec();
        const double consts[4] = {s.decay, s.step_size, s.bc2_sqrt, s.eps};
        launch({2}, {32}, [&] { CALL_T(T, adamw_update, w.p, m.p, v.p, o, n, consts); });
        char what[160]; snprintf(what, sizeof what, "adamw_update_%s decay %.3g step_size %.3g bc2_sqrt %.3g n=%d +%d%s", tname<T>(), s.decay, s.step_size, s.bc2_sqrt, n, off, in_place ? " (over w)" : "");
        check_path(what, aligned);
        std::vector<double> want(n);
        for (int i = 0; i < n; ++i) {
            const float r = cpu_update(wf[i], mf[i], vf[i], s);
            want[i] = sizeof(T) == 2 ? host_bf16_f(host_bf16(r)) : r;
        }
        check(what, (in_place ? w : out).f32(n), want, 0, 0);
    }
}

void test_optim() {
    adam_moment_case<float>(1003, 0);
    adam_moment_case<float>(1003, 1);
    adam_moment_case<bf16>(1003, 0);
    adam_moment_case<bf16>(1003, 5);
    adamw_update_case<float>(1003, 0);
    adamw_update_case<float>(1003, 3);
    adamw_update_case<bf16>(1003, 0);
    adamw_update_case<bf16>(1003, 2);
}

int main() {
    test_norm_grad();
    test_grad();
    test_optim();
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
