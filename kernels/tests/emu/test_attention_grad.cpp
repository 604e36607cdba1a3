// attention_grad.cu under the SIMT emulation: attention_probs, attention_grad_ds/dq/dk/dv, f32
// and bf16, each against a double-precision reference written from the formulas of
// runtime/src/cpu/train/attention.rs given the same inputs the kernel gets, then the chain
// probs -> ds -> dq/dk/dv against the true gradients of attention (q, k, v, dy in double) and
// O = P.V against the forward kernel attention_*. Rows that see nothing must be exactly zero.
#include "check.h"
#include "attention_ref.h"
#include "cu/attention.cu"
#include "cu/attention_grad.cu"

struct Shape { int B, T, S, Hq, Hkv, D; };
struct Vis { int causal, window, qoff; const float* mask; };
bool visible(const Shape& z, const Vis& v, int b, int t, int s) {
    const int tp = t + v.qoff;
    return (!v.causal || s <= tp) && (v.window <= 0 || tp - s < v.window) && (!v.mask || v.mask[b * z.S + s] != 0);
}
int pidx(const Shape& z, int b, int h, int t) { return ((b * z.Hq + h) * z.T + t) * z.S; }  // probs/ds row
int qidx(const Shape& z, int b, int t, int h) { return ((b * z.T + t) * z.Hq + h) * z.D; }   // q/dy row
int kidx(const Shape& z, int b, int s, int j) { return ((b * z.S + s) * z.Hkv + j) * z.D; }  // k/v row

// AttentionProbs: masked softmax of scale q.k over the visible keys, zeros for a query that sees none.
std::vector<double> probs_ref(const Shape& z, const Vis& vis, const std::vector<float>& q, const std::vector<float>& k, float scale, std::vector<char>& sees) {
    std::vector<double> p((size_t)z.B * z.Hq * z.T * z.S, 0);
    sees.assign((size_t)z.B * z.Hq * z.T, 0);
    for (int b = 0; b < z.B; ++b) for (int h = 0; h < z.Hq; ++h) for (int t = 0; t < z.T; ++t) {
        const int j = h / (z.Hq / z.Hkv), row = pidx(z, b, h, t);
        std::vector<double> sc(z.S, -INFINITY); double m = -INFINITY;
        for (int s = 0; s < z.S; ++s) {
            if (!visible(z, vis, b, t, s)) continue;
            double d = 0; for (int i = 0; i < z.D; ++i) d += (double)q[qidx(z, b, t, h) + i] * k[kidx(z, b, s, j) + i];
            sc[s] = d * scale; m = std::max(m, sc[s]);
        }
        if (m == -INFINITY) continue;
        sees[row / z.S] = 1;
        double l = 0; for (int s = 0; s < z.S; ++s) if (sc[s] != -INFINITY) l += std::exp(sc[s] - m);
        for (int s = 0; s < z.S; ++s) if (sc[s] != -INFINITY) p[row + s] = std::exp(sc[s] - m) / l;
    }
    return p;
}
// AttentionGrad's dS from the given probabilities: P * (dP - rowsum(P * dP)), dP = dy.v where P != 0.
std::vector<double> ds_ref(const Shape& z, const std::vector<float>& v, const std::vector<float>& dy, const std::vector<float>& p) {
    std::vector<double> ds(p.size(), 0);
    for (int b = 0; b < z.B; ++b) for (int h = 0; h < z.Hq; ++h) for (int t = 0; t < z.T; ++t) {
        const int j = h / (z.Hq / z.Hkv), row = pidx(z, b, h, t);
        std::vector<double> dp(z.S, 0); double dot = 0;
        for (int s = 0; s < z.S; ++s) {
            if (p[row + s] == 0) continue;
            for (int i = 0; i < z.D; ++i) dp[s] += (double)dy[qidx(z, b, t, h) + i] * v[kidx(z, b, s, j) + i];
            dot += p[row + s] * dp[s];
        }
        for (int s = 0; s < z.S; ++s) ds[row + s] = p[row + s] * (dp[s] - dot);
    }
    return ds;
}
// dq = scale dS.K from the given dS.
std::vector<double> dq_ref(const Shape& z, const std::vector<float>& ds, const std::vector<float>& k, float scale) {
    std::vector<double> dq((size_t)z.B * z.T * z.Hq * z.D, 0);
    for (int b = 0; b < z.B; ++b) for (int h = 0; h < z.Hq; ++h) for (int t = 0; t < z.T; ++t) for (int s = 0; s < z.S; ++s)
        for (int i = 0; i < z.D; ++i) dq[qidx(z, b, t, h) + i] += (double)scale * ds[pidx(z, b, h, t) + s] * k[kidx(z, b, s, h / (z.Hq / z.Hkv)) + i];
    return dq;
}
// dk = scale dSᵀ.Q (w = ds, x = q) or dv = Pᵀ.dO (w = probs, x = dy), summed over each group's heads.
std::vector<double> dkv_ref(const Shape& z, const std::vector<float>& w, const std::vector<float>& x, double scale) {
    std::vector<double> out((size_t)z.B * z.S * z.Hkv * z.D, 0);
    for (int b = 0; b < z.B; ++b) for (int h = 0; h < z.Hq; ++h) for (int t = 0; t < z.T; ++t) for (int s = 0; s < z.S; ++s)
        for (int i = 0; i < z.D; ++i) out[kidx(z, b, s, h / (z.Hq / z.Hkv)) + i] += scale * w[pidx(z, b, h, t) + s] * x[qidx(z, b, t, h) + i];
    return out;
}
// mask_kind 1: in batch 0 key 0 and every third key hidden (a causal query 0 sees nothing),
// every other batch row hidden entirely.
template <typename T>
void grad_case(const char* name, Shape z, int causal, int window, int qoff, int mask_kind, unsigned row_grid, unsigned row_threads) {
    const bool bf = sizeof(T) == 2;
    const char* dt = bf ? "bf16" : "f32";
    auto q = randv((size_t)z.B * z.T * z.Hq * z.D), k = randv((size_t)z.B * z.S * z.Hkv * z.D);
    auto v = randv(k.size()), dy = randv(q.size(), -1, 1);
    std::vector<float> mask((size_t)z.B * z.S, 1.0f);
    if (mask_kind) {
        for (int s = 0; s < z.S; ++s) mask[s] = (s % 3 == 1 || s == 0) ? 0.f : 1.f;
        for (int b = 1; b < z.B; ++b) for (int s = 0; s < z.S; ++s) mask[b * z.S + s] = 0.f;
    }
    const float* mp = mask_kind ? mask.data() : nullptr;
    const Vis vis{causal, window, qoff, mp};
    const float scale = 1.0f / std::sqrt((float)z.D);
    auto qb = as<T>(q), kb = as<T>(k), vb = as<T>(v), dyb = as<T>(dy);
    const size_t np = (size_t)z.B * z.Hq * z.T * z.S;
    // Tolerances (atol, rtol) at about twice the worst error seen. bf16: the inputs are exact
    // (rounded before the references), the outputs rounded to 8 bits; ds is f32 either way.
    const double tol_p[2] = {bf ? 2e-3 : 1e-7, bf ? 4e-3 : 1e-6};
    const double tol_o[2] = {bf ? 7e-3 : 2e-7, bf ? 7e-3 : 2e-6};
    const double tol_ds[2] = {5e-7, 5e-6};
    const double atol = bf ? 5e-3 : 5e-7, rtol = bf ? 5e-3 : 5e-6;  // dq, dk, dv
    char what[256];

    // attention_probs
    std::vector<T> pb(np, (T)7);
    launch({row_grid}, {row_threads}, [&] { CALL_T(T, attention_probs, qb.data(), kb.data(), mp, pb.data(), z.B, z.T, z.S, z.Hq, z.Hkv, z.D, scale, causal, window, qoff); });
    const auto p = as_f32(pb);
    std::vector<char> sees;
    const auto want_p = probs_ref(z, vis, q, k, scale, sees);
    snprintf(what, sizeof what, "attention_probs_%s %s", dt, name); check_tol(what, p, want_p, tol_p[0], tol_p[1]);
    check_dead_rows(what, p, sees, z.S);
    // Hidden keys exactly 0.
    size_t leaks = 0;
    for (int b = 0; b < z.B; ++b) for (int h = 0; h < z.Hq; ++h) for (int t = 0; t < z.T; ++t) for (int s = 0; s < z.S; ++s)
        leaks += !visible(z, vis, b, t, s) && p[pidx(z, b, h, t) + s] != 0;
    printf("%s %s: %zu hidden keys with nonzero probability\n", leaks ? "FAIL" : "ok  ", what, leaks); failures += leaks != 0;

    // O = P.V equals the forward kernel's output (the same visibility and softmax).
    {
        std::vector<T> ob(q.size());
        const dim3 fwd{(unsigned)((z.T + 15) / 16), (unsigned)z.Hq, (unsigned)z.B};
        launch(fwd, {128}, [&] { CALL_T(T, attention, qb.data(), kb.data(), vb.data(), ob.data(), mp, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, scale, causal, window, qoff); });
        std::vector<double> o(q.size(), 0);
        for (int b = 0; b < z.B; ++b) for (int h = 0; h < z.Hq; ++h) for (int t = 0; t < z.T; ++t) for (int s = 0; s < z.S; ++s)
            for (int i = 0; i < z.D; ++i) o[qidx(z, b, t, h) + i] += (double)p[pidx(z, b, h, t) + s] * v[kidx(z, b, s, h / (z.Hq / z.Hkv)) + i];
        snprintf(what, sizeof what, "attention_%s == probs.v %s", dt, name); check_tol(what, as_f32(ob), o, tol_o[0], tol_o[1]);
    }

    // attention_grad_ds, from the kernel's probabilities
    std::vector<float> ds(np, 7.f);
    launch({row_grid}, {row_threads}, [&] { CALL_T(T, attention_grad_ds, vb.data(), dyb.data(), pb.data(), ds.data(), z.B, z.T, z.S, z.Hq, z.Hkv, z.D); });
    snprintf(what, sizeof what, "attention_grad_ds_%s %s", dt, name); check_tol(what, ds, ds_ref(z, v, dy, p), tol_ds[0], tol_ds[1]);
    check_dead_rows(what, ds, sees, z.S);

    // attention_grad_dq / dk / dv, from the kernel's ds and probabilities
    std::vector<T> dqb(q.size(), (T)7), dkb(k.size(), (T)7), dvb(k.size(), (T)7);
    launch({3}, {64}, [&] { CALL_T(T, attention_grad_dq, ds.data(), kb.data(), dqb.data(), z.B, z.T, z.S, z.Hq, z.Hkv, z.D, scale); });
    launch({2}, {96}, [&] { CALL_T(T, attention_grad_dk, ds.data(), qb.data(), dkb.data(), z.B, z.T, z.S, z.Hq, z.Hkv, z.D, scale); });
    launch({4}, {32}, [&] { CALL_T(T, attention_grad_dv, pb.data(), dyb.data(), dvb.data(), z.B, z.T, z.S, z.Hq, z.Hkv, z.D); });
    const auto dq = as_f32(dqb), dk = as_f32(dkb), dv = as_f32(dvb);
    const auto g = attn_grad_ref(q, k, v, dy, mp, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, scale, causal, window, qoff);
    snprintf(what, sizeof what, "attention_grad_dq_%s %s", dt, name); check_tol(what, dq, dq_ref(z, ds, k, scale), atol, rtol);
    check_dead_rows(what, dq, g.q_sees, z.D);
    snprintf(what, sizeof what, "attention_grad_dk_%s %s", dt, name); check_tol(what, dk, dkv_ref(z, ds, q, scale), atol, rtol);
    snprintf(what, sizeof what, "attention_grad_dv_%s %s", dt, name); check_tol(what, dv, dkv_ref(z, p, dy, 1.0), atol, rtol);

    // The chain against the true gradients (f32 only: bf16 rounds P between the steps).
    if (!bf) {
        snprintf(what, sizeof what, "chain dq %s", name); check_tol(what, dq, g.dq, 6e-7, 6e-6);
        snprintf(what, sizeof what, "chain dk %s", name); check_tol(what, dk, g.dk, 6e-7, 6e-6);
        snprintf(what, sizeof what, "chain dv %s", name); check_tol(what, dv, g.dv, 6e-7, 6e-6);
    }
    snprintf(what, sizeof what, "attention_grad_dk_%s %s", dt, name); check_dead_rows(what, dk, g.kv_seen, z.D);
    snprintf(what, sizeof what, "attention_grad_dv_%s %s", dt, name); check_dead_rows(what, dv, g.kv_seen, z.D);
}

// The cases, each run in f32 and in bf16.
struct GradCase { const char* name; Shape z; int causal, window, qoff, mask_kind; unsigned row_grid, row_threads; };
const GradCase CASES[] = {
    // name, {B, T, S, Hq, Hkv, D}, causal, window, q_offset, mask, row grid, row threads
    {"causal GQA 2:1 D=64 T=S=37", {1, 37, 37, 2, 1, 64}, 1, 0, 0, 0, 5, 64},
    {"non-causal GQA 4:2 D=40 T=S=37 B=2", {2, 37, 37, 4, 2, 40}, 0, 0, 0, 0, 7, 32},
    {"causal window=7 mask (batch 1 hidden, query 0 sees none) GQA 4:2 D=40 T=S=37", {2, 37, 37, 4, 2, 40}, 1, 7, 0, 1, 6, 64},
    {"causal chunk T=17 S=41 q_offset=24 GQA 2:1 D=64", {1, 17, 41, 2, 1, 64}, 1, 0, 24, 0, 4, 64},
    {"decode T=1 S=50 q_offset=49 window=20 GQA 4:2 mask D=64", {2, 1, 50, 4, 2, 64}, 1, 20, 49, 1, 3, 32},
    // S past the register cache (32 threads x 8 keys): keys beyond are recomputed.
    {"causal T=6 S=300 q_offset=294 window=280 GQA 2:1 D=40 (keys past the row cache)", {1, 6, 300, 2, 1, 40}, 1, 280, 294, 0, 2, 32},
};

int main() {
    for (const GradCase& c : CASES) {
        grad_case<float>(c.name, c.z, c.causal, c.window, c.qoff, c.mask_kind, c.row_grid, c.row_threads);
        grad_case<bf16>(c.name, c.z, c.causal, c.window, c.qoff, c.mask_kind, c.row_grid, c.row_threads);
    }
    printf("worst error at %.2f of its tolerance\n", worst_seen);
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
