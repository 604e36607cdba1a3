// A double-precision reference of the attention gradients for the emulator programs that check
// an attention backward (test.cpp: attention_bwd.cu; test_attention_bwd_tc.cpp:
// attention_bwd_tc.cu; test_attention_grad.cpp: the chain of attention_grad.cu). From the
// formulas alone: P = softmax of the scaled visible scores, O = P.V, Di = rowsum(dOi * Oi),
// dS = P * (dO.Vᵀ - Di), dQ = scale dS.K, dK = scale dSᵀ.Q, dV = Pᵀ.dO (dK, dV summed over the
// query heads of a KV head). Layouts: q, dout [B, T, Hq, D], k, v [B, S, Hkv, D], mask [B, S]
// or null. lse is -inf for a query that sees no key; q_sees (per q row) and kv_seen (per k row)
// say which rows any visible (query, key) pair touches.
#pragma once
#include "check.h"

struct AttnGrads { std::vector<double> lse, dq, dk, dv; std::vector<char> q_sees, kv_seen; };
AttnGrads attn_grad_ref(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
    const std::vector<float>& dout, const float* mask, int B, int T, int S, int Hq, int Hkv, int D,
    float scale, int causal, int window, int qoff) {
    AttnGrads g{std::vector<double>(B*T*Hq, -INFINITY), std::vector<double>(B*T*Hq*D, 0),
                std::vector<double>(B*S*Hkv*D, 0), std::vector<double>(B*S*Hkv*D, 0),
                std::vector<char>(B*T*Hq, 0), std::vector<char>(B*S*Hkv, 0)};
    for (int b = 0; b < B; ++b) for (int t = 0; t < T; ++t) for (int h = 0; h < Hq; ++h) {
        const int hk = h / (Hq / Hkv), tp = t + qoff, row = (b*T+t)*Hq+h;
        const float* qr = &q[row*D]; const float* dor = &dout[row*D];
        auto kr = [&](int s) { return &k[((b*S+s)*Hkv+hk)*D]; };
        auto vr = [&](int s) { return &v[((b*S+s)*Hkv+hk)*D]; };
        std::vector<double> sc(S, -INFINITY); double m = -INFINITY;
        for (int s = 0; s < S; ++s) {
            if (!((!causal || s <= tp) && (window <= 0 || tp - s < window) && (!mask || mask[b*S+s] != 0))) continue;
            double d = 0; for (int i = 0; i < D; ++i) d += (double)qr[i] * kr(s)[i];
            sc[s] = d * scale; m = std::max(m, sc[s]);
        }
        if (m == -INFINITY) continue;
        double l = 0; for (int s = 0; s < S; ++s) if (sc[s] != -INFINITY) l += std::exp(sc[s] - m);
        g.lse[row] = m + std::log(l); g.q_sees[row] = 1;
        std::vector<double> p(S, 0), dp(S, 0), o(D, 0);
        for (int s = 0; s < S; ++s) if (sc[s] != -INFINITY) {
            p[s] = std::exp(sc[s] - g.lse[row]);
            for (int i = 0; i < D; ++i) { o[i] += p[s] * vr(s)[i]; dp[s] += (double)dor[i] * vr(s)[i]; }
        }
        double di = 0; for (int i = 0; i < D; ++i) di += (double)dor[i] * o[i];
        for (int s = 0; s < S; ++s) if (p[s] != 0) {
            const double ds = p[s] * (dp[s] - di);
            const int kv = ((b*S+s)*Hkv+hk)*D; g.kv_seen[kv / D] = 1;
            for (int i = 0; i < D; ++i) {
                g.dq[row*D+i] += scale * ds * kr(s)[i];
                g.dk[kv+i] += scale * ds * qr[i];
                g.dv[kv+i] += p[s] * dor[i];
            }
        }
    }
    return g;
}
