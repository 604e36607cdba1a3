// attention_bwd_tc.cu under the SIMT emulation (mma.sync, ldmatrix and cp.async from
// warp_mma.h): the three-launch backward (attention_lse_bf16, attention_bwd_prep_bf16,
// attention_bwd_tc_bf16) against double-precision gradients written from the formulas, and
// against the scalar attention_bwd_bf16 on the same inputs, lse and delta. Whole and partial
// 64-key and query tiles, chunk and decode q_offset, GQA, causal or not, window, a key mask
// hiding whole rows; head_dim 64 and 128. Queries that see nothing and keys no query sees must
// be exactly zero.
#include "check.h"
#include "cu/attention.cu"
#include "cu/attention_bwd.cu"
#include "cu/attention_bwd_tc.cu"

// check() plus how close the worst value came to the tolerance (1 = at the limit), so the
// tolerances can be kept at about twice the worst error seen.
static double worst_seen = 0;
void check_tol(const char* what, const std::vector<float>& got, const std::vector<double>& want, double atol, double rtol) {
    double w = 0;
    for (size_t i = 0; i < got.size() && i < want.size(); ++i)
        w = std::max(w, std::fabs(got[i] - want[i]) / (atol + rtol * std::fabs(want[i])));
    check(what, got, want, atol, rtol);
    printf("       worst at %.2f of the tolerance\n", w);
    worst_seen = std::max(worst_seen, w);
}

// Rows of D values whose `live[r]` is 0 must be exactly zero, and some rows must be live.
void check_dead_rows(const char* what, const std::vector<float>& got, const std::vector<char>& live, int D) {
    size_t dead = 0, bad = 0, rows = got.size() / D;
    for (size_t r = 0; r < rows; ++r) {
        if (live[r]) continue;
        dead++;
        for (int d = 0; d < D; ++d) bad += got[r * D + d] != 0;
    }
    const bool ok = bad == 0 && dead < rows;
    printf("%s %s: %zu of %zu rows see nothing, %zu nonzero values there\n", ok ? "ok  " : "FAIL", what, dead, rows, bad);
    failures += !ok;
}

struct Case { const char* name; int B, T, S, Hq, Hkv, D, causal, window, qoff, mask_kind; };

// The gradients from the formulas alone, in double: over the visible keys of each query,
// P = softmax(scale q.kᵀ), O = P.V, Di = rowsum(dO * O), dS = P * (dO.Vᵀ - Di),
// dQ = scale dS.K, dK = scale dSᵀ.Q, dV = Pᵀ.dO (dK, dV summed over a KV head's query heads).
struct Grads { std::vector<double> dq, dk, dv; std::vector<char> q_live, kv_live; };
Grads reference(const Case& z, const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                const std::vector<float>& dout, const float* mask, double scale) {
    const int D = z.D;
    Grads g{std::vector<double>((size_t)z.B * z.T * z.Hq * D, 0), std::vector<double>((size_t)z.B * z.S * z.Hkv * D, 0),
            std::vector<double>((size_t)z.B * z.S * z.Hkv * D, 0), std::vector<char>(z.B * z.T * z.Hq, 0),
            std::vector<char>(z.B * z.S * z.Hkv, 0)};
    for (int b = 0; b < z.B; ++b) for (int t = 0; t < z.T; ++t) for (int h = 0; h < z.Hq; ++h) {
        const int hk = h / (z.Hq / z.Hkv), tp = t + z.qoff, row = (b * z.T + t) * z.Hq + h;
        auto kr = [&](int s) { return &k[((size_t)(b * z.S + s) * z.Hkv + hk) * D]; };
        auto vr = [&](int s) { return &v[((size_t)(b * z.S + s) * z.Hkv + hk) * D]; };
        const float* qr = &q[(size_t)row * D];
        const float* dor = &dout[(size_t)row * D];
        std::vector<int> keys;
        for (int s = 0; s < z.S; ++s)
            if ((!z.causal || s <= tp) && (z.window <= 0 || tp - s < z.window) && (!mask || mask[b * z.S + s] != 0)) keys.push_back(s);
        if (keys.empty()) continue;
        g.q_live[row] = 1;
        std::vector<double> sc(keys.size()), dp(keys.size(), 0);
        double m = -INFINITY;
        for (size_t j = 0; j < keys.size(); ++j) {
            double d = 0;
            for (int i = 0; i < D; ++i) d += (double)qr[i] * kr(keys[j])[i];
            sc[j] = d * scale;
            m = std::max(m, sc[j]);
        }
        double l = 0;
        for (double x : sc) l += std::exp(x - m);
        const double lse = m + std::log(l);
        double di = 0;
        for (size_t j = 0; j < keys.size(); ++j) {
            for (int i = 0; i < D; ++i) dp[j] += (double)dor[i] * vr(keys[j])[i];
            di += std::exp(sc[j] - lse) * dp[j];  // rowsum(dO * O) = sum_j P_j dP_j
        }
        for (size_t j = 0; j < keys.size(); ++j) {
            const double p = std::exp(sc[j] - lse), ds = p * (dp[j] - di);
            const size_t kv = ((size_t)(b * z.S + keys[j]) * z.Hkv + hk);
            g.kv_live[kv] = 1;
            for (int i = 0; i < D; ++i) {
                g.dq[(size_t)row * D + i] += scale * ds * kr(keys[j])[i];
                g.dk[kv * D + i] += scale * ds * qr[i];
                g.dv[kv * D + i] += p * dor[i];
            }
        }
    }
    return g;
}

std::vector<double> dv_of(const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); }
std::vector<float> from_bf16(const std::vector<bf16>& x) {
    std::vector<float> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = host_bf16_f(x[i]);
    return r;
}

void run_case(const Case& z) {
    const int B = z.B, T = z.T, S = z.S, Hq = z.Hq, Hkv = z.Hkv, D = z.D;
    auto q = randv((size_t)B * T * Hq * D), k = randv((size_t)B * S * Hkv * D), v = randv((size_t)B * S * Hkv * D);
    auto dout = randv((size_t)B * T * Hq * D, -1, 1);
    auto qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v), dob = to_bf16(dout);
    std::vector<float> mask(B * S, 1.0f);
    if (z.mask_kind) {  // every third key and key 0 dropped (causal query 0 sees none), last batch all dropped
        for (int s = 0; s < S; ++s) mask[s] = (s % 3 == 1 || s == 0) ? 0.f : 1.f;
        if (B > 1) for (int s = 0; s < S; ++s) mask[(B - 1) * S + s] = 0.f;
    }
    const float* mp = z.mask_kind ? mask.data() : nullptr;
    const float scale = 1.0f / std::sqrt((float)D);
    const int rows = B * T * Hq, nq = rows * D, nk = B * S * Hkv * D;

    // The forward's lse and output, then delta (and the zeroed dQ accumulator).
    std::vector<float> lse(rows, 7.f), delta(rows, 7.f), dq_acc(nq, 7.f);
    std::vector<bf16> out(nq);
    launch({(unsigned)((T + 15) / 16), (unsigned)Hq, (unsigned)B}, {128}, [&] {
        attention_lse_bf16(qb.data(), kb.data(), vb.data(), out.data(), mp, B, T, S, Hq, Hkv, D, scale, z.causal, z.window, z.qoff, lse.data()); });
    launch({3}, {128}, [&] { attention_bwd_prep_bf16(out.data(), dob.data(), delta.data(), dq_acc.data(), rows, D); });
    const std::vector<float> dq_zero = dq_acc;

    // The tensor-core backward: dk, dv start at 12288, a value the kernel must overwrite.
    std::vector<bf16> dk(nk, 0x4640), dv(nk, 0x4640);
    launch({(unsigned)((S + 63) / 64), (unsigned)Hkv, (unsigned)B}, {128}, [&] {
        attention_bwd_tc_bf16(qb.data(), kb.data(), vb.data(), dob.data(), lse.data(), delta.data(), mp,
            dq_acc.data(), dk.data(), dv.data(), B, T, S, Hq, Hkv, D, scale, z.causal, z.window, z.qoff); });
    const auto got_dk = from_bf16(dk), got_dv = from_bf16(dv);

    // The scalar kernel on the same inputs, lse and delta.
    std::vector<float> sdq = dq_zero;
    std::vector<bf16> sdk(nk, 0x4640), sdv(nk, 0x4640);
    launch({(unsigned)((S + 31) / 32), (unsigned)Hkv, (unsigned)B}, {128}, [&] {
        attention_bwd_bf16(qb.data(), kb.data(), vb.data(), dob.data(), lse.data(), delta.data(), mp,
            sdq.data(), sdk.data(), sdv.data(), B, T, S, Hq, Hkv, D, scale, z.causal, z.window, z.qoff); });

    const Grads want = reference(z, q, k, v, dout, mp, scale);
    // dQ is the f32 accumulator (before the protocol's cast to bf16); dK and dV are bf16.
    // P and dS enter the mma as bf16 (8 bits), as FlashAttention-2 does. About twice the worst
    // error seen (1e-2 + 1e-2|w| passes with the worst value, a dK, at 0.65 of it).
    const double atol = 1.3e-2, rtol = 1.3e-2;
    char what[240];
    snprintf(what, sizeof what, "attention_bwd_tc_bf16 %s dQ vs double", z.name);
    check_tol(what, dq_acc, want.dq, atol, rtol);
    check_dead_rows(what, dq_acc, want.q_live, D);
    snprintf(what, sizeof what, "attention_bwd_tc_bf16 %s dK vs double", z.name);
    check_tol(what, got_dk, want.dk, atol, rtol);
    check_dead_rows(what, got_dk, want.kv_live, D);
    snprintf(what, sizeof what, "attention_bwd_tc_bf16 %s dV vs double", z.name);
    check_tol(what, got_dv, want.dv, atol, rtol);
    check_dead_rows(what, got_dv, want.kv_live, D);
    snprintf(what, sizeof what, "attention_bwd_tc_bf16 %s dQ vs attention_bwd_bf16", z.name);
    check_tol(what, dq_acc, dv_of(sdq), atol, rtol);
    snprintf(what, sizeof what, "attention_bwd_tc_bf16 %s dK vs attention_bwd_bf16", z.name);
    check_tol(what, got_dk, dv_of(from_bf16(sdk)), atol, rtol);
    snprintf(what, sizeof what, "attention_bwd_tc_bf16 %s dV vs attention_bwd_bf16", z.name);
    check_tol(what, got_dv, dv_of(from_bf16(sdv)), atol, rtol);
}

int main() {
    // name, B, T, S, Hq, Hkv, D, causal, window, q_offset, mask
    const Case cases[] = {
        {"D=64 causal T=S=128 (whole tiles) GQA 2:1", 1, 128, 128, 2, 1, 64, 1, 0, 0, 0},
        {"D=128 non-causal T=S=130 GQA 4:2 B=2", 2, 130, 130, 4, 2, 128, 0, 0, 0, 0},
        {"D=64 causal chunk T=17 S=41 q_offset=24", 1, 17, 41, 2, 1, 64, 1, 0, 24, 0},
        {"D=128 decode T=1 S=70 q_offset=69 GQA 4:1", 1, 1, 70, 4, 1, 128, 1, 0, 69, 0},
        {"D=64 causal window=9 T=S=130 mask (batch 1 all dropped, query 0 sees none) B=2", 2, 130, 130, 2, 1, 64, 1, 9, 0, 1},
        {"D=128 causal T=S=128 (whole tiles) GQA 4:2 mask B=2", 2, 128, 128, 4, 2, 128, 1, 0, 0, 1},
        {"D=64 non-causal window=9 T=S=70 GQA 4:1", 1, 70, 70, 4, 1, 64, 0, 9, 0, 0},
        {"D=128 causal chunk T=17 S=41 q_offset=24 window=9", 1, 17, 41, 2, 2, 128, 1, 9, 24, 0},
    };
    for (const Case& z : cases) run_case(z);
    printf("worst error seen at %.2f of the tolerance\n", worst_seen);
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
