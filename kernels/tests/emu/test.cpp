// CPU checks of the kernels under the SIMT emulation in shim.h, against double-precision
// references. Run with ./run.sh (needs g++ >= 12); not part of `cargo test`.
#include "check.h"
#include "attention_ref.h"
#include "cu/embedding.cu"
#include "cu/norm.cu"
#include "cu/rope.cu"
#include "cu/softmax.cu"
#include "cu/elementwise.cu"
#include "cu/cast.cu"
#include "cu/attention.cu"
#include "cu/attention_tc.cu"
#include "cu/attention_decode.cu"
#include "cu/attention_bwd.cu"
#include "cu/moe.cu"
#include "cu/reduce.cu"
#include "cu/loss.cu"
#include "fused_gen.cu"
#include "cu/layout.cu"

void test_cast() {
    auto x = randv(5000, -1e4, 1e4);
    std::vector<float> sp = {0.0f, -0.0f, 1.0f, INFINITY, -INFINITY, NAN, FLT_MAX, 1e-40f, 3.0f, 1.00390625f, 1.01171875f, 1.005859375f};
    x.insert(x.end(), sp.begin(), sp.end());
    for (int i = 0; i < 1000; ++i) { unsigned u = rng(); float f; memcpy(&f, &u, 4); x.push_back(f); }
    std::vector<bf16> out(x.size()); std::vector<float> back(x.size());
    launch({3}, {64}, [&] { cast_f32_bf16(x.data(), out.data(), x.size()); });
    int bad = 0;
    for (size_t i = 0; i < x.size(); ++i) {
        unsigned short w = host_bf16(x[i]);
        if (std::isnan(x[i])) { if (!std::isnan(host_bf16_f(out[i]))) bad++; continue; }
        if (out[i] != w) { if (bad < 3) printf("  cast %a -> %04x want %04x\n", x[i], out[i], w); bad++; }
    }
    printf("%s cast_f32_bf16 (%d mismatches)\n", bad ? "FAIL" : "ok  ", bad); failures += bad != 0;
    launch({2}, {32}, [&] { cast_bf16_f32(out.data(), back.data(), x.size()); });
    std::vector<double> want(x.size()); for (size_t i = 0; i < x.size(); ++i) want[i] = host_bf16_f(out[i]);
    check("cast_bf16_f32", back, want, 0, 0);
}

void test_embedding() {
    const int V = 7, H = 5, N = 6; const long long off = 10;
    auto table = randv(V * H);
    std::vector<int> ids = {10, 16, 9, 17, 12, -1};
    std::vector<float> out(N * H, 99);
    launch({1}, {32}, [&] { embedding_f32(table.data(), ids.data(), out.data(), N, V, H, off); });
    std::vector<double> want(N * H, 0);
    for (int n = 0; n < N; ++n) { long long r = ids[n] - off; if (r >= 0 && r < V) for (int c = 0; c < H; ++c) want[n * H + c] = table[r * H + c]; }
    check("embedding_f32 (offset, out-of-range rows zero)", out, want, 0, 0);
}

void test_norms() {
    const int R = 5, H = 300; const float eps = 1e-5f;
    auto x = randv(R * H), res = randv(R * H), w = randv(H), b = randv(H);
    std::vector<float> out(R * H), sum(R * H);
    launch({2}, {64}, [&] { rmsnorm_f32(x.data(), w.data(), out.data(), R, H, eps); });
    std::vector<double> want(R * H);
    for (int r = 0; r < R; ++r) { double ss = 0; for (int c = 0; c < H; ++c) ss += (double)x[r*H+c]*x[r*H+c];
        double inv = 1 / std::sqrt(ss / H + eps); for (int c = 0; c < H; ++c) want[r*H+c] = x[r*H+c] * inv * w[c]; }
    check("rmsnorm_f32", out, want, 1e-5, 1e-5);
    launch({3}, {96}, [&] { layernorm_f32(x.data(), w.data(), b.data(), out.data(), R, H, eps); });
    for (int r = 0; r < R; ++r) { double m = 0; for (int c = 0; c < H; ++c) m += x[r*H+c]; m /= H;
        double v = 0; for (int c = 0; c < H; ++c) v += (x[r*H+c]-m)*(x[r*H+c]-m); v /= H;
        for (int c = 0; c < H; ++c) want[r*H+c] = (x[r*H+c]-m)/std::sqrt(v+eps)*w[c]+b[c]; }
    check("layernorm_f32", out, want, 1e-5, 1e-5);
    // add_rmsnorm in place on the residual stream (sum_out aliases residual)
    auto resid = res;
    launch({2}, {128}, [&] { add_rmsnorm_f32(x.data(), resid.data(), resid.data(), w.data(), out.data(), R, H, eps); });
    std::vector<double> wsum(R * H);
    for (int r = 0; r < R; ++r) { double ss = 0; for (int c = 0; c < H; ++c) { float s = x[r*H+c] + res[r*H+c]; wsum[r*H+c] = s; ss += (double)s*s; }
        double inv = 1 / std::sqrt(ss / H + eps); for (int c = 0; c < H; ++c) want[r*H+c] = wsum[r*H+c] * inv * w[c]; }
    check("add_rmsnorm_f32 sum (in place)", resid, wsum, 0, 0);
    check("add_rmsnorm_f32 out", out, want, 1e-5, 1e-5);
    // bf16: sum rounded before the norm
    std::vector<bf16> xb(R*H), rb(R*H), wb(H), sb(R*H), ob(R*H);
    for (int i = 0; i < R*H; ++i) { xb[i] = host_bf16(x[i]); rb[i] = host_bf16(res[i]); }
    for (int c = 0; c < H; ++c) wb[c] = host_bf16(w[c]);
    launch({5}, {64}, [&] { add_rmsnorm_bf16(xb.data(), rb.data(), sb.data(), wb.data(), ob.data(), R, H, eps); });
    std::vector<float> gs(R*H), go(R*H);
    for (int r = 0; r < R; ++r) { double ss = 0; for (int c = 0; c < H; ++c) { float s = host_bf16_f(host_bf16(host_bf16_f(xb[r*H+c]) + host_bf16_f(rb[r*H+c]))); wsum[r*H+c] = s; ss += (double)s*s; }
        double inv = 1 / std::sqrt(ss / H + eps); for (int c = 0; c < H; ++c) want[r*H+c] = wsum[r*H+c] * inv * host_bf16_f(wb[c]); }
    for (int i = 0; i < R*H; ++i) { gs[i] = host_bf16_f(sb[i]); go[i] = host_bf16_f(ob[i]); }
    check("add_rmsnorm_bf16 sum", gs, wsum, 0, 0);
    check("add_rmsnorm_bf16 out", go, want, 1e-2, 1e-2);
}

// Rotary reference in double: x [rows of heads x d] rotated in place by pos[bt] * inv[j]
// (style 0 half, 1 interleaved), elements past rot unchanged.
std::vector<double> rope_want(const std::vector<float>& x, const std::vector<int>& pos, const std::vector<float>& inv,
                              int BT, int H, int D, int ROT, int style) {
    std::vector<double> want(x.begin(), x.end());
    for (int bt = 0; bt < BT; ++bt) for (int h = 0; h < H; ++h) {
        int base = (bt*H + h)*D;
        for (int j = 0; j < ROT/2; ++j) {
            int ia = style == 0 ? base + j : base + 2*j, ib = style == 0 ? base + j + ROT/2 : base + 2*j + 1;
            double a = (float)((float)pos[bt] * inv[j]); double c = std::cos(a), s = std::sin(a);
            want[ia] = x[ia]*c - x[ib]*s; want[ib] = x[ib]*c + x[ia]*s;
        }
    }
    return want;
}

void test_rope() {
    const int B = 2, T = 3, N = 2, D = 10, ROT = 6;
    auto x = randv(B*T*N*D); std::vector<int> pos = {0, 5, 100, 7, 1, 3000};
    std::vector<float> inv(ROT / 2); for (int j = 0; j < ROT/2; ++j) inv[j] = 1.0 / std::pow(10000.0, 2.0*j/ROT);
    for (int style = 0; style < 2; ++style) {
        std::vector<float> out = x;  // in place
        if (style == 0) launch({2}, {32}, [&] { rope_half_f32(out.data(), out.data(), pos.data(), inv.data(), B, T, N, D, ROT); });
        else launch({2}, {32}, [&] { rope_interleaved_f32(out.data(), out.data(), pos.data(), inv.data(), B, T, N, D, ROT); });
        std::vector<double> want = rope_want(x, pos, inv, B*T, N, D, ROT, style);
        check(style == 0 ? "rope_half_f32 (partial, in place)" : "rope_interleaved_f32 (partial, in place)", out, want, 1e-5, 1e-5);
    }
}

void test_softmax() {
    const int R = 4, C = 77;
    auto x = randv(R*C, -5, 5);
    for (int c = 0; c < C; ++c) x[2*C + c] = -INFINITY;   // all -inf row
    x[3*C + 5] = -INFINITY;
    std::vector<float> out(R*C);
    launch({3}, {64}, [&] { softmax_f32(x.data(), out.data(), R, C); });
    std::vector<double> want(R*C, 0);
    for (int r = 0; r < R; ++r) { if (r == 2) continue; double m = -INFINITY; for (int c = 0; c < C; ++c) m = std::max(m, (double)x[r*C+c]);
        double s = 0; for (int c = 0; c < C; ++c) s += std::exp(x[r*C+c]-m); for (int c = 0; c < C; ++c) want[r*C+c] = std::exp(x[r*C+c]-m)/s; }
    check("softmax_f32 (incl. all -inf row -> 0)", out, want, 1e-6, 1e-5);
}

void test_elementwise() {
    const int n = 1000, nb = 40;
    auto a = randv(n, -4, 4), b = randv(nb);
    std::vector<float> out(n); std::vector<double> want(n);
    launch({2}, {64}, [&] { add_f32(a.data(), b.data(), out.data(), n, nb); });
    for (int i = 0; i < n; ++i) want[i] = (double)a[i] + b[i % nb];
    check("add_f32 suffix broadcast", out, want, 1e-6, 1e-6);
    launch({2}, {64}, [&] { mul_f32(a.data(), a.data(), out.data(), n, n); });
    for (int i = 0; i < n; ++i) want[i] = (double)a[i] * a[i];
    check("mul_f32 same shape", out, want, 1e-6, 1e-6);
    auto g = randv(n);
    launch({1}, {32}, [&] { swiglu_f32(a.data(), g.data(), out.data(), n); });
    for (int i = 0; i < n; ++i) want[i] = a[i] / (1 + std::exp(-(double)a[i])) * g[i];
    check("swiglu_f32", out, want, 1e-6, 1e-5);
    launch({1}, {32}, [&] { gelu_tanh_f32(a.data(), out.data(), n); });
    for (int i = 0; i < n; ++i) { double x = a[i]; want[i] = 0.5*x*(1+std::tanh(std::sqrt(2/M_PI)*(x+0.044715*x*x*x))); }
    check("gelu_tanh_f32", out, want, 1e-6, 1e-5);
    launch({1}, {32}, [&] { gelu_erf_f32(a.data(), out.data(), n); });
    for (int i = 0; i < n; ++i) { double x = a[i]; want[i] = 0.5*x*(1+std::erf(x/std::sqrt(2.0))); }
    check("gelu_erf_f32", out, want, 1e-6, 1e-5);
    launch({1}, {32}, [&] { scale_f32(a.data(), out.data(), n, -0.25f); });
    for (int i = 0; i < n; ++i) want[i] = a[i] * -0.25;
    check("scale_f32", out, want, 0, 0);
}

// attention reference in double
std::vector<double> attn_ref(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v, const float* mask,
    int B, int T, int S, int Hq, int Hkv, int D, float scale, int causal, int window, int qoff) {
    std::vector<double> out(B*T*Hq*D, 0);
    for (int b = 0; b < B; ++b) for (int t = 0; t < T; ++t) for (int h = 0; h < Hq; ++h) {
        int hk = h / (Hq / Hkv); int tp = t + qoff;
        std::vector<double> sc(S, -INFINITY); double m = -INFINITY;
        for (int s = 0; s < S; ++s) {
            bool vis = (!causal || s <= tp) && (window <= 0 || tp - s < window) && (!mask || mask[b*S+s] != 0);
            if (!vis) continue;
            double d = 0; for (int i = 0; i < D; ++i) d += (double)q[((b*T+t)*Hq+h)*D+i] * k[((b*S+s)*Hkv+hk)*D+i];
            sc[s] = d * scale; m = std::max(m, sc[s]);
        }
        if (m == -INFINITY) continue;
        double l = 0; for (int s = 0; s < S; ++s) if (sc[s] != -INFINITY) l += std::exp(sc[s]-m);
        for (int s = 0; s < S; ++s) if (sc[s] != -INFINITY) { double p = std::exp(sc[s]-m)/l;
            for (int i = 0; i < D; ++i) out[((b*T+t)*Hq+h)*D+i] += p * v[((b*S+s)*Hkv+hk)*D+i]; }
    }
    return out;
}
void attn_case(const char* name, int B, int T, int S, int Hq, int Hkv, int D, int causal, int window, int qoff, bool use_mask, bool bf) {
    auto q = randv(B*T*Hq*D), k = randv(B*S*Hkv*D), v = randv(B*S*Hkv*D);
    std::vector<float> mask(B*S, 1.0f);
    if (use_mask) { for (int s = 0; s < S; ++s) mask[s] = (s % 3 == 1) ? 0.f : 1.f; for (int s = 0; s < S; ++s) mask[(B-1)*S + s] = 0.f; }
    const float scale = 1.0f / std::sqrt((float)D);
    dim3 grid{(unsigned)((T + 15) / 16), (unsigned)Hq, (unsigned)B};
    std::vector<float> got(B*T*Hq*D, 12345.f);
    if (!bf) {
        launch(grid, {128}, [&] { attention_f32(q.data(), k.data(), v.data(), got.data(), use_mask ? mask.data() : nullptr, B, T, S, Hq, Hkv, D, scale, causal, window, qoff); });
        check(name, got, attn_ref(q, k, v, use_mask ? mask.data() : nullptr, B, T, S, Hq, Hkv, D, scale, causal, window, qoff), 1e-5, 1e-4);
    } else {
        auto qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v); std::vector<bf16> ob(got.size());
        launch(grid, {128}, [&] { attention_bf16(qb.data(), kb.data(), vb.data(), ob.data(), use_mask ? mask.data() : nullptr, B, T, S, Hq, Hkv, D, scale, causal, window, qoff); });
        for (size_t i = 0; i < got.size(); ++i) got[i] = host_bf16_f(ob[i]);
        check(name, got, attn_ref(q, k, v, use_mask ? mask.data() : nullptr, B, T, S, Hq, Hkv, D, scale, causal, window, qoff), 1e-2, 1e-2);
    }
}
void test_attention() {
    attn_case("attention_f32 causal GQA D=80 T=S=37", 2, 37, 37, 4, 2, 80, 1, 0, 0, false, false);
    attn_case("attention_f32 causal window=5 mask (batch 1 fully masked) D=64", 2, 19, 19, 2, 1, 64, 1, 5, 0, true, false);
    attn_case("attention_f32 decode T=1 S=70 q_offset=69 D=128", 1, 1, 70, 8, 2, 128, 1, 0, 69, false, false);
    attn_case("attention_f32 non-causal cross S=50 D=3", 1, 17, 50, 3, 3, 3, 0, 0, 0, false, false);
    attn_case("attention_f32 D=256 causal window=40", 1, 33, 33, 2, 2, 256, 1, 40, 0, false, false);
    attn_case("attention_bf16 causal GQA D=96 mask", 2, 21, 21, 4, 1, 96, 1, 0, 0, true, true);
    attn_case("attention_f32 chunk q_offset=32 T=16 S=48", 1, 16, 48, 2, 1, 32, 1, 0, 32, false, false);
}

void test_router() {
    const int N = 7, E = 40;
    for (int topk : {1, 2, 3, 40, 50}) for (int norm = 0; norm < 2; ++norm) {
        auto lg = randv(N*E, -3, 3);
        // ties: token 0 has experts 3, 35, 36 equal maxima; token 1 all equal
        lg[0*E+3] = lg[0*E+35] = lg[0*E+36] = 5.0f;
        for (int e = 0; e < E; ++e) lg[1*E+e] = 0.5f;
        std::vector<float> gates(N*E, 7.f);
        launch({2}, {64}, [&] { router_f32(lg.data(), gates.data(), N, E, topk, norm); });
        std::vector<double> want(N*E, 0);
        for (int n = 0; n < N; ++n) {
            std::vector<double> p(E); double m = -INFINITY; for (int e = 0; e < E; ++e) m = std::max(m, (double)lg[n*E+e]);
            double s = 0; for (int e = 0; e < E; ++e) { p[e] = std::exp(lg[n*E+e]-m); s += p[e]; } for (auto& x : p) x /= s;
            std::vector<int> idx(E); for (int e = 0; e < E; ++e) idx[e] = e;
            std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return lg[n*E+a] > lg[n*E+b]; });
            int k = std::min(topk, E); double ks = 0; for (int i = 0; i < k; ++i) ks += p[idx[i]];
            for (int i = 0; i < k; ++i) want[n*E+idx[i]] = norm ? p[idx[i]]/ks : p[idx[i]];
        }
        char name[64]; snprintf(name, 64, "router_f32 top_k=%d normalize=%d", topk, norm);
        check(name, gates, want, 1e-6, 1e-5);
    }
}

void test_moe() {
    const int N = 6, E = 3, H = 5;
    auto x = randv(N*H); std::vector<float> gates(N*E, 0.f);
    for (int n = 0; n < N; ++n) { gates[n*E + n % E] = 0.7f; gates[n*E + (n+1) % E] = 0.3f; }
    std::vector<float> disp(E*N*H, 9.f);
    launch({2}, {32}, [&] { dispatch_f32(x.data(), gates.data(), disp.data(), N, E, H, nullptr); });
    std::vector<double> want(E*N*H, 0);
    for (int e = 0; e < E; ++e) for (int n = 0; n < N; ++n) if (gates[n*E+e] != 0) for (int c = 0; c < H; ++c) want[(e*N+n)*H+c] = x[n*H+c];
    check("dispatch_f32", disp, want, 0, 0);
    auto y = randv(E*N*H); y[(2*N+0)*H] = NAN;  // expert 2 not routed for token 0: must not leak
    std::vector<float> comb(N*H);
    launch({1}, {32}, [&] { combine_f32(y.data(), gates.data(), comb.data(), N, E, H, nullptr); });
    std::vector<double> wc(N*H, 0);
    for (int n = 0; n < N; ++n) for (int c = 0; c < H; ++c) for (int e = 0; e < E; ++e) if (gates[n*E+e] != 0) wc[n*H+c] += gates[n*E+e] * y[(e*N+n)*H+c];
    check("combine_f32 (unrouted NaN ignored)", comb, wc, 1e-6, 1e-6);
    // Packed: the routed rows only (moe_route_positions' map), 2 spare rows after them.
    int rows = 0;
    const auto pos = packed_positions(gates, N, E, &rows);
    std::vector<float> pd((rows + 2) * H, 9.f);
    launch({2}, {32}, [&] { dispatch_f32(x.data(), gates.data(), pd.data(), N, E, H, pos.data()); });
    std::vector<double> wp((rows + 2) * H, 9.0);
    for (int n = 0; n < N; ++n) for (int e = 0; e < E; ++e) if (pos[n*E+e] >= 0) for (int c = 0; c < H; ++c) wp[pos[n*E+e]*H+c] = x[n*H+c];
    check("dispatch_f32 packed (spare rows untouched)", pd, wp, 0, 0);
    const auto py = pack_rows(y, pos, N, E, H, rows, 2, (float)NAN);
    std::vector<float> pc(N*H);
    launch({1}, {32}, [&] { combine_f32(py.data(), gates.data(), pc.data(), N, E, H, pos.data()); });
    check("combine_f32 packed", pc, wc, 1e-6, 1e-6);
}

void test_reduce_loss() {
    const int n = 333; auto a = randv(n), b = randv(n);
    std::vector<float> out(n); std::vector<double> want(n);
    launch({2}, {32}, [&] { reduce_add_f32(a.data(), b.data(), out.data(), n); });
    for (int i = 0; i < n; ++i) want[i] = a[i] + b[i];
    check("reduce_add_f32", out, want, 1e-6, 0);
    auto acc = a; launch({1}, {64}, [&] { reduce_average_f32(acc.data(), b.data(), n, 0.5f); });
    for (int i = 0; i < n; ++i) want[i] = ((double)a[i] + b[i]) * 0.5;
    check("reduce_average_f32", acc, want, 1e-6, 0);
    const int R = 5, V = 1000; auto lg = randv(R*V, -8, 8); std::vector<int> lab = {3, -100, 999, 0, 1000};
    std::vector<float> loss(R), tot(1);
    launch({2}, {128}, [&] { cross_entropy_f32(lg.data(), lab.data(), loss.data(), R, V); });
    std::vector<double> wl(R, 0);
    for (int r = 0; r < R; ++r) { if (lab[r] < 0) continue; if (lab[r] >= V) { wl[r] = NAN; continue; }
        double m = -INFINITY; for (int c = 0; c < V; ++c) m = std::max(m, (double)lg[r*V+c]);
        double s = 0; for (int c = 0; c < V; ++c) s += std::exp(lg[r*V+c]-m); wl[r] = m + std::log(s) - lg[r*V+lab[r]]; }
    check("cross_entropy_f32 (ignore -100, NaN for label>=V)", loss, wl, 1e-5, 1e-5);
    std::vector<float> l4(loss.begin(), loss.begin() + 4);
    launch({1}, {1024}, [&] { loss_sum_f32(l4.data(), tot.data(), 4, 0.25f); });
    check("loss_sum_f32", tot, {(wl[0]+wl[1]+wl[2]+wl[3])*0.25}, 1e-5, 1e-5);
}

// Vocabulary-parallel cross-entropy: the logits split into P column shards, each shard's stats,
// gathered in rank order, give the unsplit loss and, per shard, its slice of the gradient.
void test_vocab_parallel_loss() {
    const int R = 6, V = 999, P = 3, Vl = V / P;
    auto lg = randv(R*V, -8, 8);
    for (int c = 0; c < V; ++c) lg[5*V+c] = c < Vl ? -INFINITY : lg[5*V+c];  // shard 0 all -inf
    std::vector<int> lab = {3, -100, 998, Vl, 2*Vl - 1, 500};
    std::vector<double> wl(R, 0), lse(R, 0);
    for (int r = 0; r < R; ++r) {
        double m = -INFINITY; for (int c = 0; c < V; ++c) m = std::max(m, (double)lg[r*V+c]);
        double s = 0; for (int c = 0; c < V; ++c) s += std::exp(lg[r*V+c]-m);
        lse[r] = m + std::log(s); if (lab[r] >= 0) wl[r] = lse[r] - lg[r*V+lab[r]]; }
    std::vector<float> gathered(R*3*P);
    const float scale = 0.25f;
    std::vector<std::vector<float>> shards(P);
    for (int p = 0; p < P; ++p) {
        auto& sh = shards[p]; sh.resize(R*Vl);
        for (int r = 0; r < R; ++r) for (int c = 0; c < Vl; ++c) sh[r*Vl+c] = lg[r*V+p*Vl+c];
        std::vector<float> st(R*3);
        launch({4}, {64}, [&] { cross_entropy_stats_f32(sh.data(), lab.data(), st.data(), R, Vl, (i64)p*Vl, V); });
        for (int r = 0; r < R; ++r) for (int k = 0; k < 3; ++k) gathered[(r*P+p)*3+k] = st[r*3+k];
    }
    std::vector<float> loss(R);
    launch({1}, {32}, [&] { cross_entropy_from_stats_f32(gathered.data(), lab.data(), loss.data(), R, P); });
    check("cross_entropy_from_stats_f32 (3 shards, ignore -100, a shard of -inf)", loss, wl, 1e-5, 1e-5);
    for (int p = 0; p < P; ++p) {
        std::vector<float> dx(R*Vl, NAN); std::vector<double> want(R*Vl, 0);
        for (int r = 0; r < R; ++r) for (int c = 0; c < Vl; ++c) if (lab[r] >= 0)
            want[r*Vl+c] = (std::exp(lg[r*V+p*Vl+c] - lse[r]) - (p*Vl + c == lab[r] ? 1.0 : 0.0)) * scale;
        launch({4}, {64}, [&] { cross_entropy_shard_grad_f32(shards[p].data(), lab.data(), gathered.data(), dx.data(), R, Vl, P, (i64)p*Vl, scale); });
        char what[96]; snprintf(what, sizeof what, "cross_entropy_shard_grad_f32 (shard %d of 3)", p);
        check(what, dx, want, 1e-6, 1e-5);
    }
    std::vector<int> bad = {V, 0, 0, 0, 0, 0}; std::vector<float> st(R*3);
    launch({2}, {32}, [&] { cross_entropy_stats_f32(shards[1].data(), bad.data(), st.data(), R, Vl, Vl, V); });
    check("cross_entropy_stats_f32 (NaN for label>=V)", {st[0], st[1], st[2]}, {NAN, NAN, NAN}, 0, 0);
}

// ---- 16-byte vector paths -------------------------------------------------------------------
// Each kernel with a vector path runs on buffers placed at chosen offsets from a 16-byte
// boundary and at lengths off the vector width, and g_vec_accesses tells which path ran: the
// vector path (with its scalar tail), the scalar fallback, or both across rows.

template <class T> void norm_case(int R, int H, int offx, int offw, unsigned block) {
    const bool bf = sizeof(T) == 2; const float eps = 1e-5f;
    const double tol = bf ? 1e-2 : 1e-5;
    auto xf = randv(R * H), rf = randv(R * H), wf = randv(H), bfv = randv(H);
    auto xt = as<T>(xf); auto rt = as<T>(rf); auto wt = as<T>(wf); auto bt = as<T>(bfv);
    Placed<T> x(xt, offx), res(rt, offx), w(wt, offw), b(bt, offw), out(std::vector<T>(R * H), offx);
    // Rows that can take vectors: the row start and the weights 16-byte aligned.
    const bool any_vec = any_row_vectors(x.p, R, H, w.p);
    char what[160];
    std::vector<double> want(R * H);
    mark_vec();
    launch({2}, {block}, [&] { CALL_T(T, rmsnorm, x.p, w.p, out.p, R, H, eps); });
    snprintf(what, sizeof what, "rmsnorm_%s H=%d x+%d w+%d block %u", tname<T>(), H, offx, offw, block);
    check_path(what, any_vec);
    for (int r = 0; r < R; ++r) { double ss = 0; for (int c = 0; c < H; ++c) ss += (double)xf[r*H+c]*xf[r*H+c];
        double inv = 1 / std::sqrt(ss / H + eps); for (int c = 0; c < H; ++c) want[r*H+c] = xf[r*H+c] * inv * wf[c]; }
    check(what, out.f32(R * H), want, tol, tol);
    mark_vec();
    launch({3}, {block}, [&] { CALL_T(T, layernorm, x.p, w.p, b.p, out.p, R, H, eps); });
    snprintf(what, sizeof what, "layernorm_%s H=%d x+%d w+%d block %u", tname<T>(), H, offx, offw, block);
    check_path(what, any_vec);
    for (int r = 0; r < R; ++r) { double m = 0; for (int c = 0; c < H; ++c) m += xf[r*H+c]; m /= H;
        double v = 0; for (int c = 0; c < H; ++c) v += (xf[r*H+c]-m)*(xf[r*H+c]-m); v /= H;
        for (int c = 0; c < H; ++c) want[r*H+c] = (xf[r*H+c]-m)/std::sqrt(v+eps)*wf[c]+bfv[c]; }
    check(what, out.f32(R * H), want, tol, tol);
    // add_rmsnorm in place on the residual stream; out aliases x.
    mark_vec();
    launch({2}, {block}, [&] { CALL_T(T, add_rmsnorm, x.p, res.p, res.p, w.p, x.p, R, H, eps); });
    snprintf(what, sizeof what, "add_rmsnorm_%s H=%d x+%d w+%d block %u (sum in place, out over x)", tname<T>(), H, offx, offw, block);
    check_path(what, any_vec);
    std::vector<double> wsum(R * H);
    for (int r = 0; r < R; ++r) { double ss = 0; for (int c = 0; c < H; ++c) { float s = xf[r*H+c] + rf[r*H+c]; if (bf) s = host_bf16_f(host_bf16(s)); wsum[r*H+c] = s; ss += (double)s*s; }
        double inv = 1 / std::sqrt(ss / H + eps); for (int c = 0; c < H; ++c) want[r*H+c] = wsum[r*H+c] * inv * wf[c]; }
    check(what, res.f32(R * H), wsum, 0, 0);
    check(what, x.f32(R * H), want, tol, tol);
}

template <class T> void softmax_case(int R, int C, int off, unsigned block) {
    const double tol = sizeof(T) == 2 ? 1e-2 : 1e-6;
    auto xf = randv(R * C, -5, 5);
    for (int c = 0; c < C; ++c) xf[(R - 1) * C + c] = -INFINITY;  // last row all -inf
    xf[5] = -INFINITY;
    auto xt = as<T>(xf);
    Placed<T> x(xt, off), out(std::vector<T>(R * C), off);
    const bool any_vec = any_row_vectors(x.p, R, C);
    mark_vec();
    launch({2}, {block}, [&] { CALL_T(T, softmax, x.p, out.p, R, C); });
    char what[128]; snprintf(what, sizeof what, "softmax_%s C=%d x+%d block %u (all -inf row)", tname<T>(), C, off, block);
    check_path(what, any_vec);
    std::vector<double> want(R * C, 0);
    for (int r = 0; r < R - 1; ++r) { double m = -INFINITY; for (int c = 0; c < C; ++c) m = std::max(m, (double)xf[r*C+c]);
        double s = 0; for (int c = 0; c < C; ++c) s += std::exp(xf[r*C+c]-m); for (int c = 0; c < C; ++c) want[r*C+c] = std::exp(xf[r*C+c]-m)/s; }
    check(what, out.f32(R * C), want, tol, tol);
}

template <class T> void elementwise_case(int n, int nb, int off) {
    const double tol = sizeof(T) == 2 ? 1e-2 : 1e-6;
    const int N = lanes<T>();
    auto af = randv(n, -4, 4), bfv = randv(n), cf = randv(nb);
    auto at = as<T>(af); auto bt = as<T>(bfv); auto ct = as<T>(cf);
    Placed<T> a(at, off), b(bt, off), c(ct, 0), out(std::vector<T>(n), off);
    const bool aligned = off * sizeof(T) % 16 == 0;
    char what[128]; std::vector<double> want(n);
    // A small grid: every thread takes several grid-stride steps.
    mark_vec();
    launch({2}, {32}, [&] { CALL_T(T, silu, a.p, out.p, n); });
    snprintf(what, sizeof what, "silu_%s n=%d +%d", tname<T>(), n, off); check_path(what, aligned);
    for (int i = 0; i < n; ++i) want[i] = af[i] / (1 + std::exp(-(double)af[i]));
    check(what, out.f32(n), want, tol, tol);
    mark_vec();
    launch({1}, {64}, [&] { CALL_T(T, scale, a.p, out.p, n, -0.25f); });
    snprintf(what, sizeof what, "scale_%s n=%d +%d", tname<T>(), n, off); check_path(what, aligned);
    for (int i = 0; i < n; ++i) want[i] = af[i] * -0.25;
    check(what, out.f32(n), want, sizeof(T) == 2 ? 1e-2 : 0, sizeof(T) == 2 ? 1e-2 : 0);
    mark_vec();
    launch({2}, {32}, [&] { CALL_T(T, swiglu, a.p, b.p, out.p, n); });
    snprintf(what, sizeof what, "swiglu_%s n=%d +%d", tname<T>(), n, off); check_path(what, aligned);
    for (int i = 0; i < n; ++i) want[i] = af[i] / (1 + std::exp(-(double)af[i])) * bfv[i];
    check(what, out.f32(n), want, tol, tol);
    mark_vec();
    launch({2}, {32}, [&] { CALL_T(T, add, a.p, c.p, out.p, n, nb); });
    snprintf(what, sizeof what, "add_%s n=%d nb=%d +%d (broadcast)", tname<T>(), n, nb, off); check_path(what, aligned && (nb == n || nb % N == 0));
    for (int i = 0; i < n; ++i) want[i] = (double)af[i] + cf[i % nb];
    check(what, out.f32(n), want, tol, tol);
    mark_vec();
    launch({3}, {32}, [&] { CALL_T(T, mul, a.p, b.p, a.p, n, n); });
    snprintf(what, sizeof what, "mul_%s n=%d +%d (same shape, in place)", tname<T>(), n, off); check_path(what, aligned);
    for (int i = 0; i < n; ++i) want[i] = (double)af[i] * bfv[i];
    check(what, a.f32(n), want, tol, tol);
}

template <class T> void rope_vec_case(int B, int Tn, int H, int D, int ROT, int off) {
    const double tol = sizeof(T) == 2 ? 1e-2 : 1e-5;
    const int N = lanes<T>();
    auto xf = randv(B*Tn*H*D); auto xt = as<T>(xf);
    std::vector<int> pos(B*Tn); for (int i = 0; i < B*Tn; ++i) pos[i] = (i * 37) % 3001;
    std::vector<float> inv(ROT / 2); for (int j = 0; j < ROT/2; ++j) inv[j] = 1.0 / std::pow(10000.0, 2.0*j/ROT);
    const bool vec = off * sizeof(T) % 16 == 0 && D % N == 0 && (ROT / 2) % N == 0;
    for (int style = 0; style < 2; ++style) {
        Placed<T> x(xt, off);
        mark_vec();
        launch({2}, {32}, [&] {
            if (style == 0) CALL_T(T, rope_half, x.p, x.p, pos.data(), inv.data(), B, Tn, H, D, ROT);
            else CALL_T(T, rope_interleaved, x.p, x.p, pos.data(), inv.data(), B, Tn, H, D, ROT);
        });
        char what[128]; snprintf(what, sizeof what, "rope_%s_%s D=%d rot=%d heads=%d +%d (in place)", style == 0 ? "half" : "interleaved", tname<T>(), D, ROT, H, off);
        check_path(what, vec);
        std::vector<double> want = rope_want(xf, pos, inv, B*Tn, H, D, ROT, style);
        auto got = x.f32(xf.size());
        check(what, got, want, tol, tol);
        // pass-through elements bit for bit
        int bad = 0;
        for (int row = 0; row < B*Tn*H; ++row) for (int c = ROT; c < D; ++c) bad += got[row*D+c] != xf[row*D+c];
        if (bad) { printf("FAIL %s: %d pass-through elements changed\n", what, bad); failures++; }
    }
}

// The generated fused kernels of fused_gen.cu (kernels/tests/fused_emu.rs keeps it current).
template <class T> void fused_case(int n, int len1, int len2, int off) {
    const double tol = sizeof(T) == 2 ? 1e-2 : 1e-5;
    const int N = lanes<T>();
    auto af = randv(n, -3, 3), bfv = randv(len1, -2, 2), cf = randv(len2, 0.5, 2);
    auto at = as<T>(af); auto bt = as<T>(bfv); auto ct = as<T>(cf);
    Placed<T> a(at, off), b(bt, 0), c(ct, 0), out(std::vector<T>(n), off);
    const bool aligned = off * sizeof(T) % 16 == 0;
    auto ok_len = [&](int len) { return len == n || len % N == 0; };
    char what[160]; std::vector<double> want(n);
    if constexpr (sizeof(T) == 2) {
        std::vector<float> gf = randv(n); auto gt = as<T>(gf); Placed<T> g(gt, off);
        mark_vec();
        launch({2}, {32}, [&] { fused_swiglu_bf16(a.p, g.p, out.p, n, n, n); });
        snprintf(what, sizeof what, "fused_swiglu_bf16 n=%d +%d", n, off); check_path(what, aligned);
        for (int i = 0; i < n; ++i) want[i] = af[i] / (1 + std::exp(-(double)af[i])) * gf[i];
        check(what, out.f32(n), want, tol, tol);
        mark_vec();
        launch({2}, {32}, [&] { fused_const_bf16(out.p, n); });
        snprintf(what, sizeof what, "fused_const_bf16 n=%d +%d", n, off); check_path(what, aligned);
        check(what, out.f32(n), std::vector<double>(n, 1.5), 0, 0);
    } else {
        mark_vec();
        launch({2}, {32}, [&] { fused_bias_gelu_f32(a.p, b.p, out.p, n, n, len1); });
        snprintf(what, sizeof what, "fused_bias_gelu_f32 n=%d len1=%d +%d", n, len1, off); check_path(what, aligned && ok_len(len1));
        for (int i = 0; i < n; ++i) { double x = (double)af[i] + bfv[i % len1]; want[i] = 0.5*x*(1+std::tanh(std::sqrt(2/M_PI)*(x+0.044715*x*x*x))) * 0.125; }
        check(what, out.f32(n), want, tol, tol);
    }
    // in0 is unused (a null pointer must not be touched); in1, in2 broadcast independently.
    // f32: x1 / x2 - exp(x1); bf16: x2 - neg(x1).
    mark_vec();
    launch({2}, {32}, [&] { CALL_T(T, fused_three, nullptr, b.p, c.p, out.p, n, 1, len1, len2); });
    snprintf(what, sizeof what, "fused_three_%s n=%d len1=%d len2=%d +%d", tname<T>(), n, len1, len2, off);
    check_path(what, aligned && ok_len(len1) && ok_len(len2));
    for (int i = 0; i < n; ++i) { double x1 = bfv[i % len1], x2 = cf[i % len2]; want[i] = sizeof(T) == 2 ? x2 + x1 : x1 / x2 - std::exp(x1); }
    check(what, out.f32(n), want, tol, tol);
}

// ---- layout.cu: the strided copy's digit counter -----------------------------------------
// Host reference of the StridedSpec contract, straight from layout.cu's header.
std::vector<float> strided_ref(const StridedSpec& s, const std::vector<float>& in, size_t out_len) {
    std::vector<float> out(out_len, -7.0f);
    for (i64 i = 0; i < s.n; ++i) {
        i64 rem = i, src = s.in_base, dst = s.out_base;
        for (int d = (int)s.rank - 1; d >= 0; --d) {
            const i64 idx = rem % s.shape[d]; rem /= s.shape[d];
            src += (idx / s.in_div[d]) * s.in_stride[d]; dst += idx * s.out_stride[d];
        }
        out[dst] = in[src];
    }
    return out;
}
StridedSpec spec(std::vector<i64> shape, std::vector<i64> in_stride, std::vector<i64> in_div, std::vector<i64> out_stride, i64 in_base, i64 out_base) {
    StridedSpec s{};
    s.rank = (i64)shape.size(); s.n = 1; s.in_base = in_base; s.out_base = out_base;
    for (int d = 0; d < SHARDC_MAX_RANK; ++d) { s.shape[d] = 1; s.in_stride[d] = 0; s.in_div[d] = 1; s.out_stride[d] = 0; }
    for (size_t d = 0; d < shape.size(); ++d) { s.shape[d] = shape[d]; s.in_stride[d] = in_stride[d]; s.in_div[d] = in_div[d]; s.out_stride[d] = out_stride[d]; s.n *= shape[d]; }
    return s;
}
void test_strided_copy() {
    struct Case { const char* what; StridedSpec s; size_t in_len, out_len; };
    std::vector<Case> cases = {
        // [5, 7, 3] -> transpose of the last two dims: out [5, 3, 7]
        {"transpose [5,7,3] -> [5,3,7]", spec({5, 7, 3}, {21, 3, 1}, {1, 1, 1}, {21, 1, 7}, 0, 0), 105, 105},
        // slice rows 2..6 of a [9, 11] matrix, columns 3..10, into [4, 7] at out offset 5
        {"slice [9,11][2:6,3:10] at out+5", spec({4, 7}, {11, 1}, {1, 1}, {7, 1}, 2 * 11 + 3, 5), 99, 33},
        // repeat_interleave of KV heads: [2, 3, 4] -> [2, 6, 4], head h reads h / 2
        {"repeat_interleave [2,3,4] x2 on dim 1", spec({2, 6, 4}, {12, 4, 1}, {1, 2, 1}, {24, 4, 1}, 0, 0), 24, 48},
        // rank 1, a long run (the grid stride is shorter than n: several steps per thread)
        {"rank 1 copy of 1000 at in+3", spec({1000}, {1}, {1}, {1}, 3, 0), 1003, 1000},
        // rank 6 with a dim of size 1 in the middle
        {"rank 6 [2,3,1,2,5,2] reversed strides", spec({2, 3, 1, 2, 5, 2}, {1, 2, 6, 6, 12, 60}, {1, 1, 1, 1, 1, 1}, {60, 20, 20, 10, 2, 1}, 0, 0), 120, 120},
    };
    for (auto& c : cases) {
        auto in = randv(c.in_len);
        auto want = strided_ref(c.s, in, c.out_len);
        for (unsigned blocks : {1u, 2u, 40u}) {
            std::vector<float> got(c.out_len, -7.0f);
            launch({blocks}, {32}, [&] { strided_copy_b4((const unsigned*)in.data(), (unsigned*)got.data(), c.s); });
            char what[160]; snprintf(what, sizeof what, "strided_copy_b4 %s (grid %u x 32)", c.what, blocks);
            check(what, got, dv(want), 0, 0);
        }
    }
}

// Embedding rows and the collectives' reductions through their vector paths and fallbacks.
template <class T> void embedding_reduce_case(int H, int off) {
    const int V = 9, Nn = 7; const long long id_off = 100;
    auto tf = randv(V * H); auto tt = as<T>(tf);
    Placed<T> table(tt, off), out(std::vector<T>(Nn * H), 0);
    std::vector<int> ids = {100, 108, 99, 109, 104, 104, -3};
    const bool vec = off * sizeof(T) % 16 == 0 && H % lanes<T>() == 0;
    char what[128];
    mark_vec();
    launch({2}, {32}, [&] { CALL_T(T, embedding, table.p, ids.data(), out.p, Nn, V, H, id_off); });
    snprintf(what, sizeof what, "embedding_%s H=%d table+%d (offset, out-of-range rows zero)", tname<T>(), H, off);
    check_path(what, vec);
    std::vector<double> want(Nn * H, 0);
    for (int n = 0; n < Nn; ++n) { long long r = ids[n] - id_off; if (r >= 0 && r < V) for (int c = 0; c < H; ++c) want[n * H + c] = tf[r * H + c]; }
    check(what, out.f32(Nn * H), want, 0, 0);
    const int n = 1003; auto af = randv(n), bfv = randv(n); auto at = as<T>(af); auto bt = as<T>(bfv);
    Placed<T> acc(at, off), x(bt, off);
    mark_vec();
    launch({2}, {32}, [&] { CALL_T(T, reduce_average, acc.p, x.p, n, 0.5f); });
    snprintf(what, sizeof what, "reduce_average_%s n=%d +%d", tname<T>(), n, off);
    check_path(what, off * sizeof(T) % 16 == 0);
    std::vector<double> wa(n); for (int i = 0; i < n; ++i) wa[i] = ((double)af[i] + bfv[i]) * 0.5;
    check(what, acc.f32(n), wa, sizeof(T) == 2 ? 1e-2 : 1e-6, sizeof(T) == 2 ? 1e-2 : 0);
}

void test_vectors() {
    // Norms: H % N != 0 (rows alternate between the vector path and the scalar fallback), rows
    // longer than a block's register cache (32 threads x 8 vectors), misaligned x or weights.
    norm_case<float>(5, 1067, 0, 0, 32);
    norm_case<float>(4, 300, 0, 0, 64);
    norm_case<float>(3, 256, 1, 0, 64);
    norm_case<float>(3, 256, 0, 2, 64);
    norm_case<bf16>(5, 300, 0, 0, 64);
    norm_case<bf16>(3, 2056, 0, 0, 32);
    norm_case<bf16>(3, 256, 3, 0, 64);
    norm_case<bf16>(3, 264, 0, 4, 96);
    softmax_case<float>(5, 1067, 0, 32);
    softmax_case<float>(4, 64, 3, 64);
    softmax_case<bf16>(4, 77, 0, 64);
    softmax_case<bf16>(3, 2120, 0, 32);
    softmax_case<bf16>(3, 64, 1, 64);
    for (int nb : {1003, 40, 12, 7}) elementwise_case<float>(1003, nb, 0);
    elementwise_case<float>(1003, 40, 1);
    for (int nb : {1003, 40, 12, 7}) elementwise_case<bf16>(1003, nb, 0);
    elementwise_case<bf16>(1003, 40, 4);
    rope_vec_case<float>(2, 3, 3, 64, 48, 0);
    rope_vec_case<float>(1, 3, 2, 40, 40, 0);
    rope_vec_case<float>(2, 3, 3, 64, 48, 2);
    rope_vec_case<bf16>(2, 3, 3, 64, 48, 0);
    rope_vec_case<bf16>(2, 2, 2, 128, 128, 0);
    rope_vec_case<bf16>(1, 3, 2, 40, 40, 0);
    rope_vec_case<bf16>(2, 3, 3, 64, 48, 1);
    fused_case<float>(1003, 1003, 12, 0);
    fused_case<float>(1003, 40, 7, 0);
    fused_case<float>(1003, 40, 12, 1);
    fused_case<bf16>(1003, 1003, 40, 0);
    fused_case<bf16>(1003, 40, 12, 0);
    fused_case<bf16>(1003, 40, 40, 2);
    embedding_reduce_case<float>(12, 0);
    embedding_reduce_case<float>(12, 1);
    embedding_reduce_case<float>(5, 0);
    embedding_reduce_case<bf16>(16, 0);
    embedding_reduce_case<bf16>(16, 3);
    embedding_reduce_case<bf16>(12, 0);
}

// ---- tensor-core wrappers (mma.cuh) alone, against the PTX ISA fragment layouts ----------
// Element i (0..7) of a lane's A fragment, written from the ISA's formula (not the emulator's
// inverse of it): row g for i in {0,1,4,5} else g + 8; column 2c + (i & 1), + 8 for i >= 4.
static void frag_a_rc(int lane, int i, int& r, int& k) {
    const int g = lane >> 2, c = lane & 3;
    r = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
    k = 2 * c + (i & 1) + (i >= 4 ? 8 : 0);
}
// B (16x8): row 2c + (i & 1), + 8 for i >= 2; column g. C/D: row g (i < 2) or g + 8; column 2c + (i & 1).
static void frag_b_rc(int lane, int i, int& k, int& n) { k = 2 * (lane & 3) + (i & 1) + (i >= 2 ? 8 : 0); n = lane >> 2; }
static void frag_c_rc(int lane, int i, int& r, int& n) { r = (lane >> 2) + (i >= 2 ? 8 : 0); n = 2 * (lane & 3) + (i & 1); }

void test_mma_wrappers() {
    // mma.m16n8k16 alone: registers built from the ISA layouts, D = A B + C vs double.
    auto a = randv(16 * 16), bm = randv(16 * 8), cm = randv(16 * 8);
    for (auto& x : a) x = host_bf16_f(host_bf16(x));
    for (auto& x : bm) x = host_bf16_f(host_bf16(x));
    std::vector<float> d(16 * 8, NAN);
    launch({1}, {32}, [&] {
        const int lane = threadIdx.x;
        unsigned ar[4], br[2]; float acc[4];
        for (int reg = 0; reg < 4; ++reg) {
            int r0, k0, r1, k1; frag_a_rc(lane, 2 * reg, r0, k0); frag_a_rc(lane, 2 * reg + 1, r1, k1);
            ar[reg] = pack_bf16x2(a[r0 * 16 + k0], a[r1 * 16 + k1]);
        }
        for (int reg = 0; reg < 2; ++reg) {
            int k0, n0, k1, n1; frag_b_rc(lane, 2 * reg, k0, n0); frag_b_rc(lane, 2 * reg + 1, k1, n1);
            br[reg] = pack_bf16x2(bm[k0 * 8 + n0], bm[k1 * 8 + n1]);
        }
        for (int i = 0; i < 4; ++i) { int r, n; frag_c_rc(lane, i, r, n); acc[i] = cm[r * 8 + n]; }
        mma_bf16_16816(acc, ar, br);
        for (int i = 0; i < 4; ++i) { int r, n; frag_c_rc(lane, i, r, n); d[r * 8 + n] = acc[i]; }
    });
    std::vector<double> want(16 * 8);
    for (int r = 0; r < 16; ++r) for (int n = 0; n < 8; ++n) {
        double s = cm[r * 8 + n]; for (int k = 0; k < 16; ++k) s += (double)a[r * 16 + k] * bm[k * 8 + n];
        want[r * 8 + n] = s;
    }
    check("mma_bf16_16816 (ISA fragment layouts) vs double", d, want, 1e-5, 1e-6);

    // ldmatrix x4 and x4.trans: 4 matrices, rows 48 bytes apart (padded), value = 64 m + 8 row + col.
    const int stride = 24;  // bf16 per row
    for (int trans = 0; trans < 2; ++trans) {
        int bad = 0;
        launch({1}, {32}, [&] {
            const int lane = threadIdx.x;
            bf16* sm = (bf16*)g_smem;
            if (lane == 0) for (int m = 0; m < 4; ++m) for (int r = 0; r < 8; ++r) for (int col = 0; col < 8; ++col)
                sm[(m * 8 + r) * stride + col] = host_bf16((float)(64 * m + 8 * r + col));
            tw->bar->arrive_and_wait();
            unsigned reg[4];
            const bf16* row = sm + ((lane >> 3) * 8 + (lane & 7)) * stride;
            if (trans) ldmatrix_x4_trans(reg, row); else ldmatrix_x4(reg, row);
            const int g = lane >> 2, c = lane & 3;
            for (int m = 0; m < 4; ++m) for (int half = 0; half < 2; ++half) {
                const int r = trans ? 2 * c + half : g, col = trans ? g : 2 * c + half;
                const float want = (float)(64 * m + 8 * r + col);
                if (emu_reg_half(reg[m], half) != want) { if (bad++ < 3) printf("  lane %d reg %d half %d: %g want %g\n", lane, m, half, emu_reg_half(reg[m], half), want); }
            }
        });
        printf("%s %s (%d mismatches)\n", bad ? "FAIL" : "ok  ", trans ? "ldmatrix_x4_trans" : "ldmatrix_x4", bad); failures += bad != 0;
    }

    // cp.async groups: wait_group<1> lands all but the newest group; src_bytes 0 zero-fills.
    {
        std::vector<bf16> src(16, 0x3f80);  // 1.0
        int bad = 0;
        launch({1}, {32}, [&] {
            if (threadIdx.x != 0) return;
            bf16* sm = (bf16*)g_smem;  // NaN-filled before the block
            cp_async_cg16(sm, src.data(), 16); cp_async_commit();
            cp_async_cg16(sm + 8, src.data(), 0); cp_async_commit();
            cp_async_wait<1>();
            bad += sm[0] != 0x3f80 || sm[7] != 0x3f80 || sm[8] != 0xffff;
            cp_async_wait<0>();
            bad += sm[8] != 0 || sm[15] != 0;
        });
        printf("%s cp.async commit/wait_group and zero-fill (%d mismatches)\n", bad ? "FAIL" : "ok  ", bad); failures += bad != 0;
    }

    // The kernel's chain: 16x16 A row-major and B as [k][n] (V-like, ldmatrix.trans) and as
    // [n][k] (K-like, ldmatrix) in shared memory, two mma for a 16x16x16 product.
    std::vector<float> b16 = randv(16 * 16);
    for (auto& x : b16) x = host_bf16_f(host_bf16(x));
    for (int kn = 0; kn < 2; ++kn) {
        std::vector<float> out(16 * 16, NAN);
        launch({1}, {32}, [&] {
            const int lane = threadIdx.x, mi = lane >> 3;
            bf16* sa = (bf16*)g_smem; bf16* sb = sa + 256;
            if (lane == 0) for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) {
                sa[i * 16 + j] = host_bf16(a[i * 16 + j]);
                sb[i * 16 + j] = host_bf16(kn ? b16[j * 16 + i] : b16[i * 16 + j]);  // kn: stored [n][k]
            }
            tw->bar->arrive_and_wait();
            unsigned af[4], bf[4];
            ldmatrix_x4(af, sa + ((mi & 1) * 8 + (lane & 7)) * 16 + (mi >> 1) * 8);
            if (kn) ldmatrix_x4(bf, sb + ((mi >> 1) * 8 + (lane & 7)) * 16 + (mi & 1) * 8);
            else ldmatrix_x4_trans(bf, sb + ((mi & 1) * 8 + (lane & 7)) * 16 + (mi >> 1) * 8);
            float acc[2][4] = {};
            mma_bf16_16816(acc[0], af, bf); mma_bf16_16816(acc[1], af, bf + 2);
            for (int nb = 0; nb < 2; ++nb) for (int i = 0; i < 4; ++i) { int r, n; frag_c_rc(lane, i, r, n); out[r * 16 + nb * 8 + n] = acc[nb][i]; }
        });
        std::vector<double> want2(16 * 16, 0);
        for (int r = 0; r < 16; ++r) for (int n = 0; n < 16; ++n) for (int k = 0; k < 16; ++k) want2[r * 16 + n] += (double)a[r * 16 + k] * b16[k * 16 + n];
        check(kn ? "ldmatrix + mma 16x16x16, B stored [n][k] (ldmatrix)" : "ldmatrix + mma 16x16x16, B stored [k][n] (ldmatrix.trans)", out, want2, 1e-5, 1e-6);
    }
}

// Zero rows (of width D) exactly where the reference has them, and not every row zero.
void check_zero_rows(const char* what, const std::vector<float>& got, const std::vector<double>& want, int D) {
    size_t zero_want = 0, zero_got = 0, mism = 0;
    for (size_t row = 0; row < got.size() / D; ++row) {
        bool zw = true, zg = true;
        for (int d = 0; d < D; ++d) { zw = zw && want[row * D + d] == 0; zg = zg && got[row * D + d] == 0; }
        zero_want += zw; zero_got += zg; mism += zw != zg;
    }
    const bool ok = mism == 0 && zero_want < got.size() / D;
    printf("%s %s: %zu of %zu rows zero (want %zu)\n", ok ? "ok  " : "FAIL", what, zero_got, got.size() / D, zero_want);
    failures += !ok;
}

// ---- attention_tc_bf16 vs a double reference and vs the scalar kernel ----------------------
void attn_tc_case(const char* name, int B, int T, int S, int Hq, int Hkv, int D, int causal, int window, int qoff, int mask_kind) {
    auto q = randv(B*T*Hq*D), k = randv(B*S*Hkv*D), v = randv(B*S*Hkv*D);
    auto qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v);
    std::vector<float> mask(B*S, 1.0f);
    if (mask_kind) {  // every third key dropped, key 0 dropped (query 0 of a causal case sees nothing), last batch all dropped
        for (int s = 0; s < S; ++s) mask[s] = (s % 3 == 1 || s == 0) ? 0.f : 1.f;
        if (B > 1) for (int s = 0; s < S; ++s) mask[(B-1)*S + s] = 0.f;
    }
    const float* mp = mask_kind ? mask.data() : nullptr;
    const float scale = 1.0f / std::sqrt((float)D);
    std::vector<bf16> ob(B*T*Hq*D, 0x4640);  // 12288: a value the kernel must overwrite
    launch({(unsigned)((T + 63) / 64), (unsigned)Hq, (unsigned)B}, {128}, [&] {
        attention_tc_bf16(qb.data(), kb.data(), vb.data(), ob.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff); });
    std::vector<float> got(ob.size()); for (size_t i = 0; i < ob.size(); ++i) got[i] = host_bf16_f(ob[i]);
    auto want = attn_ref(q, k, v, mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff);
    char what[200];
    snprintf(what, sizeof what, "attention_tc_bf16 %s vs double", name);
    check(what, got, want, 1e-2, 1e-2);
    // The same inputs through the scalar f32 kernel (same rounding of the inputs).
    std::vector<float> sc(got.size(), 12345.f);
    launch({(unsigned)((T + 15) / 16), (unsigned)Hq, (unsigned)B}, {128}, [&] {
        attention_f32(q.data(), k.data(), v.data(), sc.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff); });
    snprintf(what, sizeof what, "attention_tc_bf16 %s vs attention_f32", name);
    check(what, got, dv(sc), 1e-2, 1e-2);
    snprintf(what, sizeof what, "attention_tc_bf16 %s", name);
    check_zero_rows(what, got, want, D);
    // The lse entry: the same output to the bit, and each query's lse (natural log) against
    // the double reference (-inf exactly where a query sees no key).
    std::vector<bf16> ob2(ob.size(), 0x4640);
    std::vector<float> lse(B*T*Hq, 7.f);
    launch({(unsigned)((T + 63) / 64), (unsigned)Hq, (unsigned)B}, {128}, [&] {
        attention_tc_lse_bf16(qb.data(), kb.data(), vb.data(), ob2.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff, lse.data()); });
    snprintf(what, sizeof what, "attention_tc_lse_bf16 %s output", name);
    check(what, as_f32(ob2), dv(got), 0, 0);
    const auto grads = attn_grad_ref(q, k, v, std::vector<float>(q.size(), 0.f), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff);
    snprintf(what, sizeof what, "attention_tc_lse_bf16 %s lse", name);
    check(what, lse, grads.lse, 1e-4, 1e-4);
}
void test_attention_tc() {
    // name, B, T, S, Hq, Hkv, D, causal, window, q_offset, mask
    attn_tc_case("D=64 causal GQA T=S=77", 1, 77, 77, 2, 1, 64, 1, 0, 0, 0);
    attn_tc_case("D=128 non-causal T=S=70", 1, 70, 70, 2, 2, 128, 0, 0, 0, 0);
    attn_tc_case("D=64 causal window=20 mask (batch 1 all dropped, query 0 sees none)", 2, 50, 50, 2, 1, 64, 1, 20, 0, 1);
    attn_tc_case("D=128 decode T=1 S=150 q_offset=149 GQA 4:1", 1, 1, 150, 4, 1, 128, 1, 0, 149, 0);
    attn_tc_case("D=128 chunk T=40 S=104 q_offset=64 causal", 1, 40, 104, 2, 1, 128, 1, 0, 64, 0);
    attn_tc_case("D=64 cross non-causal T=20 S=130 mask", 2, 20, 130, 1, 1, 64, 0, 0, 0, 1);
    attn_tc_case("D=64 causal window=70 T=S=140 (tile skipping)", 1, 140, 140, 1, 1, 64, 1, 70, 0, 0);
    attn_tc_case("D=128 causal T=S=128 (whole tiles) GQA 4:2 B=2", 2, 128, 128, 4, 2, 128, 1, 0, 0, 0);
}

// ---- split-KV decode (attention_decode_* + attention_decode_combine_*) vs double and attention_f32
void attn_decode_case(const char* name, int B, int T, int S, int Hq, int Hkv, int D, int causal, int window, int qoff, int mask_kind, int splits, bool bf) {
    auto q = randv(B*T*Hq*D), k = randv(B*S*Hkv*D), v = randv(B*S*Hkv*D);
    std::vector<bf16> qb, kb, vb;
    if (bf) { qb = to_bf16(q); kb = to_bf16(k); vb = to_bf16(v); }
    std::vector<float> mask(B*S, 1.0f);
    // 1: every third key dropped and the keys of the first two splits' worth (whole splits
    // hidden); 2: as 1, and the last batch entirely dropped (every split empty there).
    const int chunk = ((S + splits - 1) / splits + 31) / 32 * 32;
    if (mask_kind) for (int b = 0; b < B; ++b) for (int s = 0; s < S; ++s)
        mask[b*S + s] = (s % 3 == 1 || s < 2 * chunk || (mask_kind == 2 && b == B - 1)) ? 0.f : 1.f;
    const float* mp = mask_kind ? mask.data() : nullptr;
    const float scale = 1.0f / std::sqrt((float)D);
    const int G = Hq / Hkv, tiles = (T * G + 15) / 16;
    std::vector<float> ws((size_t)B * splits * T * Hq * (D + 2), NAN);  // NaN: every slot is written
    std::vector<float> got(B*T*Hq*D, 12345.f);
    std::vector<bf16> ob(got.size(), 0x4640);
    dim3 grid{(unsigned)splits, (unsigned)(Hkv * tiles), (unsigned)B};
    if (!bf) {
        launch(grid, {128}, [&] { attention_decode_f32(q.data(), k.data(), v.data(), got.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff, ws.data(), splits); });
        launch({3}, {64}, [&] { attention_decode_combine_f32(q.data(), k.data(), v.data(), got.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff, ws.data(), splits); });
    } else {
        launch(grid, {128}, [&] { attention_decode_bf16(qb.data(), kb.data(), vb.data(), ob.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff, ws.data(), splits); });
        launch({3}, {64}, [&] { attention_decode_combine_bf16(qb.data(), kb.data(), vb.data(), ob.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff, ws.data(), splits); });
        for (size_t i = 0; i < ob.size(); ++i) got[i] = host_bf16_f(ob[i]);
    }
    const double tol = bf ? 1e-2 : 1e-5;
    auto want = attn_ref(q, k, v, mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff);
    char what[240];
    snprintf(what, sizeof what, "attention_decode_%s splits=%d %s vs double", bf ? "bf16" : "f32", splits, name);
    check(what, got, want, tol, bf ? 1e-2 : 1e-4);
    std::vector<float> sc(got.size(), 12345.f);
    launch({(unsigned)((T + 15) / 16), (unsigned)Hq, (unsigned)B}, {128}, [&] {
        attention_f32(q.data(), k.data(), v.data(), sc.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff); });
    snprintf(what, sizeof what, "attention_decode_%s splits=%d %s vs attention_f32", bf ? "bf16" : "f32", splits, name);
    check(what, got, dv(sc), tol, bf ? 1e-2 : 1e-4);
    snprintf(what, sizeof what, "attention_decode %s splits=%d", name, splits);
    check_zero_rows(what, got, want, D);
}
void test_attention_decode() {
    // name, B, T, S, Hq, Hkv, D, causal, window, q_offset, mask, splits, bf16
    for (int splits : {1, 3, 7}) {
        attn_decode_case("T=1 S=333 causal q_offset=S-1 GQA 4:1 D=128", 1, 1, 333, 4, 1, 128, 1, 0, 332, 0, splits, false);
        attn_decode_case("T=4 S=517 causal q_offset=S-4 GQA 8:2 D=64 bf16", 2, 4, 517, 8, 2, 64, 1, 0, 513, 0, splits, true);
    }
    attn_decode_case("T=1 S=450 window=100 GQA 4:1 D=64", 1, 1, 450, 4, 1, 64, 1, 100, 449, 0, 7, false);
    attn_decode_case("T=4 S=300 causal window=70 GQA 8:2 D=80", 1, 4, 300, 8, 2, 80, 1, 70, 296, 0, 3, false);
    attn_decode_case("T=4 S=400 mask hides splits 0-1 GQA 4:1 D=128 bf16", 1, 4, 400, 4, 1, 128, 1, 0, 396, 1, 7, true);
    attn_decode_case("T=1 S=350 mask, batch 1 all hidden (all splits empty) D=64", 2, 1, 350, 2, 2, 64, 0, 0, 0, 2, 3, false);
    attn_decode_case("T=5 S=300 13 splits of 32 keys, the last 3 empty, non-causal GQA 8:2 D=64", 1, 5, 300, 8, 2, 64, 0, 0, 0, 0, 13, false);
}

// ---- attention backward (attention_bwd.cu) vs a double reference of the gradients ----------
void attn_bwd_case(const char* name, int B, int T, int S, int Hq, int Hkv, int D, int causal, int window, int qoff, int mask_kind, bool bf) {
    auto q = randv(B*T*Hq*D), k = randv(B*S*Hkv*D), v = randv(B*S*Hkv*D), dout = randv(B*T*Hq*D, -1, 1);
    std::vector<float> mask(B*S, 1.0f);
    if (mask_kind) {  // every third key and key 0 dropped (causal query 0 sees none), last batch all dropped
        for (int s = 0; s < S; ++s) mask[s] = (s % 3 == 1 || s == 0) ? 0.f : 1.f;
        if (B > 1) for (int s = 0; s < S; ++s) mask[(B-1)*S + s] = 0.f;
    }
    const float* mp = mask_kind ? mask.data() : nullptr;
    const float scale = 1.0f / std::sqrt((float)D);
    const int rows = B*T*Hq, nq = rows*D, nk = B*S*Hkv*D;
    std::vector<float> lse(rows, 7.f), delta(rows, 7.f), dq_acc(nq, 7.f), got_dq(nq), got_dk(nk), got_dv(nk);
    const dim3 fwd{(unsigned)((T + 15) / 16), (unsigned)Hq, (unsigned)B}, bwd{(unsigned)((S + 31) / 32), (unsigned)Hkv, (unsigned)B};
    if (!bf) {
        std::vector<float> out(nq), dk(nk, 7.f), dv(nk, 7.f);
        launch(fwd, {128}, [&] { attention_lse_f32(q.data(), k.data(), v.data(), out.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff, lse.data()); });
        launch({2}, {64}, [&] { attention_bwd_prep_f32(out.data(), dout.data(), delta.data(), dq_acc.data(), rows, D); });
        launch(bwd, {128}, [&] { attention_bwd_f32(q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), mp,
            dq_acc.data(), dk.data(), dv.data(), B, T, S, Hq, Hkv, D, scale, causal, window, qoff); });
        got_dq = dq_acc; got_dk = dk; got_dv = dv;
    } else {
        auto qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v), dob = to_bf16(dout);
        std::vector<bf16> out(nq), dq(nq), dk(nk, 0x4640), dv(nk, 0x4640);
        launch(fwd, {128}, [&] { attention_lse_bf16(qb.data(), kb.data(), vb.data(), out.data(), mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff, lse.data()); });
        launch({3}, {32}, [&] { attention_bwd_prep_bf16(out.data(), dob.data(), delta.data(), dq_acc.data(), rows, D); });
        launch(bwd, {128}, [&] { attention_bwd_bf16(qb.data(), kb.data(), vb.data(), dob.data(), lse.data(), delta.data(), mp,
            dq_acc.data(), dk.data(), dv.data(), B, T, S, Hq, Hkv, D, scale, causal, window, qoff); });
        launch({2}, {64}, [&] { cast_f32_bf16(dq_acc.data(), dq.data(), nq); });
        for (int i = 0; i < nq; ++i) got_dq[i] = host_bf16_f(dq[i]);
        for (int i = 0; i < nk; ++i) { got_dk[i] = host_bf16_f(dk[i]); got_dv[i] = host_bf16_f(dv[i]); }
    }
    const auto want = attn_grad_ref(q, k, v, dout, mp, B, T, S, Hq, Hkv, D, scale, causal, window, qoff);
    // bf16: inputs exact (rounded before the reference), the forward's output and the
    // gradients rounded to bf16 (8 bits). About twice the worst error seen (f32 1e-5 + 1e-4|w|
    // passes, bf16 4e-3 + 4e-3|w| fails one dK value).
    const double atol = bf ? 1e-2 : 2e-5, rtol = bf ? 1e-2 : 2e-4;
    const char* dt = bf ? "bf16" : "f32";
    char what[240];
    snprintf(what, sizeof what, "attention_lse_%s %s lse", dt, name); check(what, lse, want.lse, 1e-5, 1e-5);
    snprintf(what, sizeof what, "attention_bwd_%s %s dQ", dt, name); check(what, got_dq, want.dq, atol, rtol); check_dead_rows(what, got_dq, want.q_sees, D);
    snprintf(what, sizeof what, "attention_bwd_%s %s dK", dt, name); check(what, got_dk, want.dk, atol, rtol); check_dead_rows(what, got_dk, want.kv_seen, D);
    snprintf(what, sizeof what, "attention_bwd_%s %s dV", dt, name); check(what, got_dv, want.dv, atol, rtol); check_dead_rows(what, got_dv, want.kv_seen, D);
}
void test_attention_bwd() {
    // name, B, T, S, Hq, Hkv, D, causal, window, q_offset, mask, bf16
    attn_bwd_case("causal GQA 2:1 D=64 T=S=37", 1, 37, 37, 2, 1, 64, 1, 0, 0, 0, false);
    attn_bwd_case("non-causal GQA 4:2 D=40 T=S=45 B=2", 2, 45, 45, 4, 2, 40, 0, 0, 0, 0, false);
    attn_bwd_case("causal window=7 mask (batch 1 all dropped, query 0 sees none) D=64", 2, 29, 29, 2, 1, 64, 1, 7, 0, 1, false);
    attn_bwd_case("causal chunk T=17 S=41 q_offset=24 D=40", 1, 17, 41, 2, 1, 40, 1, 0, 24, 0, false);
    attn_bwd_case("non-causal cross T=9 S=70 mask D=128", 2, 9, 70, 2, 2, 128, 0, 0, 0, 1, false);
    attn_bwd_case("causal window=10 T=S=70 (query-tile skipping) D=64", 1, 70, 70, 1, 1, 64, 1, 10, 0, 0, false);
    attn_bwd_case("decode T=1 S=50 q_offset=49 GQA 4:1 D=64", 1, 1, 50, 4, 1, 64, 1, 0, 49, 0, false);
    attn_bwd_case("causal GQA 4:2 mask D=64 T=S=33", 2, 33, 33, 4, 2, 64, 1, 0, 0, 1, true);
    attn_bwd_case("causal T=12 S=30 q_offset=18 window=9 D=40", 1, 12, 30, 2, 1, 40, 1, 9, 18, 0, true);
}

int main() {
    test_cast(); test_embedding(); test_norms(); test_rope(); test_softmax(); test_elementwise();
    test_attention(); test_router(); test_moe(); test_reduce_loss(); test_vocab_parallel_loss();
    test_vectors(); test_strided_copy();
    test_mma_wrappers(); test_attention_tc(); test_attention_decode();
    test_attention_bwd();
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
