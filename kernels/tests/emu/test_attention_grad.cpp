// attention_grad.cu under the SIMT emulation: attention_probs, attention_grad_ds/dq/dk/dv, f32
// and bf16, each against a double-precision reference written from the formulas of
// runtime/src/cpu/train/attention.rs given the same inputs the kernel gets, then the chain
// probs -> ds -> dq/dk/dv against the true gradients of attention (q, k, v, dy in double) and
// O = P.V against the forward kernel attention_*. Rows that see nothing must be exactly zero.
#include "check.h"
#include "cu/attention.cu"
#include "cu/attention_grad.cu"

// check() plus how close the worst value came to the tolerance (1 = at the limit), so the
// tolerances can be kept at about twice the worst error seen.
static double worst_seen = 0;
void check_tol(const char* what, const std::vector<float>& got, const std::vector<double>& want, double atol, double rtol) {
    double w = 0;
    for (size_t i = 0; i < got.size() && i < want.size(); ++i)
        if (std::isfinite(want[i])) w = std::max(w, std::fabs(got[i] - want[i]) / (atol + rtol * std::fabs(want[i])));
    check(what, got, want, atol, rtol);
    printf("       worst at %.2f of the tolerance\n", w);
    worst_seen = std::max(worst_seen, w);
}

// Rows of `width` values whose `live[r]` is 0 must be exactly zero, and some rows must be live.
void check_dead_rows(const char* what, const std::vector<float>& got, const std::vector<char>& live, size_t width) {
    size_t dead = 0, bad = 0, rows = got.size() / width;
    for (size_t r = 0; r < rows; ++r) {
        if (live[r]) continue;
        dead++;
        for (size_t i = 0; i < width; ++i) bad += got[r * width + i] != 0;
    }
    const bool ok = bad == 0 && dead < rows;
    printf("%s %s: %zu of %zu rows dead, %zu nonzero values there\n", ok ? "ok  " : "FAIL", what, dead, rows, bad);
    failures += !ok;
}

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
// The true gradients of attention in double from q, k, v, dy (no intermediate rounding):
// dq, dk, dv, and which key rows any query sees.
struct True { std::vector<double> dq, dk, dv; std::vector<char> kv_seen; };
True true_grads(const Shape& z, const Vis& vis, const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& dy, float scale) {
    std::vector<char> sees;
    const auto p = probs_ref(z, vis, q, k, scale, sees);
    std::vector<float> pf(p.begin(), p.end());  // only for the p != 0 test below
    True g{std::vector<double>(q.size(), 0), std::vector<double>(k.size(), 0), std::vector<double>(k.size(), 0), std::vector<char>((size_t)z.B * z.S * z.Hkv, 0)};
    for (int b = 0; b < z.B; ++b) for (int h = 0; h < z.Hq; ++h) for (int t = 0; t < z.T; ++t) {
        const int j = h / (z.Hq / z.Hkv), row = pidx(z, b, h, t);
        std::vector<double> dp(z.S, 0); double dot = 0;
        for (int s = 0; s < z.S; ++s) if (p[row + s] != 0) {
            for (int i = 0; i < z.D; ++i) dp[s] += (double)dy[qidx(z, b, t, h) + i] * v[kidx(z, b, s, j) + i];
            dot += p[row + s] * dp[s];
        }
        for (int s = 0; s < z.S; ++s) if (p[row + s] != 0) {
            const double ds = p[row + s] * (dp[s] - dot);
            g.kv_seen[kidx(z, b, s, j) / z.D] = 1;
            for (int i = 0; i < z.D; ++i) {
                g.dq[qidx(z, b, t, h) + i] += scale * ds * k[kidx(z, b, s, j) + i];
                g.dk[kidx(z, b, s, j) + i] += scale * ds * q[qidx(z, b, t, h) + i];
                g.dv[kidx(z, b, s, j) + i] += p[row + s] * dy[qidx(z, b, t, h) + i];
            }
        }
    }
    return g;
}

template <typename T> struct Buf;
template <> struct Buf<float> {
    static std::vector<float> from(std::vector<float>& x) { return x; }
    static std::vector<float> back(const std::vector<float>& x) { return x; }
};
template <> struct Buf<bf16> {
    // Rounds x to bf16 in place (the reference then sees exactly the kernel's inputs).
    static std::vector<bf16> from(std::vector<float>& x) {
        std::vector<bf16> r(x.size());
        for (size_t i = 0; i < x.size(); ++i) { r[i] = host_bf16(x[i]); x[i] = host_bf16_f(r[i]); }
        return r;
    }
    static std::vector<float> back(const std::vector<bf16>& x) {
        std::vector<float> r(x.size()); for (size_t i = 0; i < x.size(); ++i) r[i] = host_bf16_f(x[i]); return r;
    }
};

// The entry points by element type, so one case body runs both.
void probs_t(const float* q, const float* k, const float* m, float* p, const Shape& z, float sc, int c, int w, int o) { attention_probs_f32(q, k, m, p, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, sc, c, w, o); }
void probs_t(const bf16* q, const bf16* k, const float* m, bf16* p, const Shape& z, float sc, int c, int w, int o) { attention_probs_bf16(q, k, m, p, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, sc, c, w, o); }
void fwd_t(const float* q, const float* k, const float* v, float* out, const float* m, const Shape& z, float sc, int c, int w, int o) { attention_f32(q, k, v, out, m, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, sc, c, w, o); }
void fwd_t(const bf16* q, const bf16* k, const bf16* v, bf16* out, const float* m, const Shape& z, float sc, int c, int w, int o) { attention_bf16(q, k, v, out, m, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, sc, c, w, o); }
void ds_t(const float* v, const float* dy, const float* p, float* ds, const Shape& z) { attention_grad_ds_f32(v, dy, p, ds, z.B, z.T, z.S, z.Hq, z.Hkv, z.D); }
void ds_t(const bf16* v, const bf16* dy, const bf16* p, float* ds, const Shape& z) { attention_grad_ds_bf16(v, dy, p, ds, z.B, z.T, z.S, z.Hq, z.Hkv, z.D); }
void dq_t(const float* ds, const float* k, float* dq, const Shape& z, float sc) { attention_grad_dq_f32(ds, k, dq, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, sc); }
void dq_t(const float* ds, const bf16* k, bf16* dq, const Shape& z, float sc) { attention_grad_dq_bf16(ds, k, dq, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, sc); }
void dk_t(const float* ds, const float* q, float* dk, const Shape& z, float sc) { attention_grad_dk_f32(ds, q, dk, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, sc); }
void dk_t(const float* ds, const bf16* q, bf16* dk, const Shape& z, float sc) { attention_grad_dk_bf16(ds, q, dk, z.B, z.T, z.S, z.Hq, z.Hkv, z.D, sc); }
void dv_t(const float* p, const float* dy, float* dv, const Shape& z) { attention_grad_dv_f32(p, dy, dv, z.B, z.T, z.S, z.Hq, z.Hkv, z.D); }
void dv_t(const bf16* p, const bf16* dy, bf16* dv, const Shape& z) { attention_grad_dv_bf16(p, dy, dv, z.B, z.T, z.S, z.Hq, z.Hkv, z.D); }

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
    auto qb = Buf<T>::from(q), kb = Buf<T>::from(k), vb = Buf<T>::from(v), dyb = Buf<T>::from(dy);
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
    launch({row_grid}, {row_threads}, [&] { probs_t(qb.data(), kb.data(), mp, pb.data(), z, scale, causal, window, qoff); });
    const auto p = Buf<T>::back(pb);
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
        launch(fwd, {128}, [&] { fwd_t(qb.data(), kb.data(), vb.data(), ob.data(), mp, z, scale, causal, window, qoff); });
        std::vector<double> o(q.size(), 0);
        for (int b = 0; b < z.B; ++b) for (int h = 0; h < z.Hq; ++h) for (int t = 0; t < z.T; ++t) for (int s = 0; s < z.S; ++s)
            for (int i = 0; i < z.D; ++i) o[qidx(z, b, t, h) + i] += (double)p[pidx(z, b, h, t) + s] * v[kidx(z, b, s, h / (z.Hq / z.Hkv)) + i];
        snprintf(what, sizeof what, "attention_%s == probs.v %s", dt, name); check_tol(what, Buf<T>::back(ob), o, tol_o[0], tol_o[1]);
    }

    // attention_grad_ds, from the kernel's probabilities
    std::vector<float> ds(np, 7.f);
    launch({row_grid}, {row_threads}, [&] { ds_t(vb.data(), dyb.data(), pb.data(), ds.data(), z); });
    snprintf(what, sizeof what, "attention_grad_ds_%s %s", dt, name); check_tol(what, ds, ds_ref(z, v, dy, p), tol_ds[0], tol_ds[1]);
    check_dead_rows(what, ds, sees, z.S);

    // attention_grad_dq / dk / dv, from the kernel's ds and probabilities
    std::vector<T> dqb(q.size(), (T)7), dkb(k.size(), (T)7), dvb(k.size(), (T)7);
    launch({3}, {64}, [&] { dq_t(ds.data(), kb.data(), dqb.data(), z, scale); });
    launch({2}, {96}, [&] { dk_t(ds.data(), qb.data(), dkb.data(), z, scale); });
    launch({4}, {32}, [&] { dv_t(pb.data(), dyb.data(), dvb.data(), z); });
    const auto dq = Buf<T>::back(dqb), dk = Buf<T>::back(dkb), dv = Buf<T>::back(dvb);
    snprintf(what, sizeof what, "attention_grad_dq_%s %s", dt, name); check_tol(what, dq, dq_ref(z, ds, k, scale), atol, rtol);
    std::vector<char> q_sees(sees.size());  // sees by q row (b, t, h), not probs row (b, h, t)
    for (int b = 0; b < z.B; ++b) for (int h = 0; h < z.Hq; ++h) for (int t = 0; t < z.T; ++t)
        q_sees[(b * z.T + t) * z.Hq + h] = sees[(b * z.Hq + h) * z.T + t];
    check_dead_rows(what, dq, q_sees, z.D);
    snprintf(what, sizeof what, "attention_grad_dk_%s %s", dt, name); check_tol(what, dk, dkv_ref(z, ds, q, scale), atol, rtol);
    snprintf(what, sizeof what, "attention_grad_dv_%s %s", dt, name); check_tol(what, dv, dkv_ref(z, p, dy, 1.0), atol, rtol);

    // The chain against the true gradients (f32 only: bf16 rounds P between the steps).
    const auto g = true_grads(z, vis, q, k, v, dy, scale);
    if (!bf) {
        snprintf(what, sizeof what, "chain dq %s", name); check_tol(what, dq, g.dq, 6e-7, 6e-6);
        snprintf(what, sizeof what, "chain dk %s", name); check_tol(what, dk, g.dk, 6e-7, 6e-6);
        snprintf(what, sizeof what, "chain dv %s", name); check_tol(what, dv, g.dv, 6e-7, 6e-6);
    }
    snprintf(what, sizeof what, "attention_grad_dk_%s %s", dt, name); check_dead_rows(what, dk, g.kv_seen, z.D);
    snprintf(what, sizeof what, "attention_grad_dv_%s %s", dt, name); check_dead_rows(what, dv, g.kv_seen, z.D);
}

int main() {
    // name, {B, T, S, Hq, Hkv, D}, causal, window, q_offset, mask, row grid, row threads
    const char* c1 = "causal GQA 2:1 D=64 T=S=37";
    grad_case<float>(c1, {1, 37, 37, 2, 1, 64}, 1, 0, 0, 0, 5, 64);
    grad_case<bf16>(c1, {1, 37, 37, 2, 1, 64}, 1, 0, 0, 0, 5, 64);
    const char* c2 = "non-causal GQA 4:2 D=40 T=S=37 B=2";
    grad_case<float>(c2, {2, 37, 37, 4, 2, 40}, 0, 0, 0, 0, 7, 32);
    grad_case<bf16>(c2, {2, 37, 37, 4, 2, 40}, 0, 0, 0, 0, 7, 32);
    const char* c3 = "causal window=7 mask (batch 1 hidden, query 0 sees none) GQA 4:2 D=40 T=S=37";
    grad_case<float>(c3, {2, 37, 37, 4, 2, 40}, 1, 7, 0, 1, 6, 64);
    grad_case<bf16>(c3, {2, 37, 37, 4, 2, 40}, 1, 7, 0, 1, 6, 64);
    const char* c4 = "causal chunk T=17 S=41 q_offset=24 GQA 2:1 D=64";
    grad_case<float>(c4, {1, 17, 41, 2, 1, 64}, 1, 0, 24, 0, 4, 64);
    grad_case<bf16>(c4, {1, 17, 41, 2, 1, 64}, 1, 0, 24, 0, 4, 64);
    const char* c5 = "decode T=1 S=50 q_offset=49 window=20 GQA 4:2 mask D=64";
    grad_case<float>(c5, {2, 1, 50, 4, 2, 64}, 1, 20, 49, 1, 3, 32);
    grad_case<bf16>(c5, {2, 1, 50, 4, 2, 64}, 1, 20, 49, 1, 3, 32);
    // S past the register cache (32 threads x 8 keys): keys beyond are recomputed.
    const char* c6 = "causal T=6 S=300 q_offset=294 window=280 GQA 2:1 D=40 (keys past the row cache)";
    grad_case<float>(c6, {1, 6, 300, 2, 1, 40}, 1, 280, 294, 0, 2, 32);
    grad_case<bf16>(c6, {1, 6, 300, 2, 1, 40}, 1, 280, 294, 0, 2, 32);
    printf("worst error at %.2f of its tolerance\n", worst_seen);
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
