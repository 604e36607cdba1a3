// rope.cu: rotary position embedding of every head, angles in f32.
//
// rope_half_{f32,bf16}(const T* x, T* out, const int* pos, const float* inv_freq,
//                      i64 batch, i64 seq, i64 heads, i64 head_dim, i64 rot_dim)
// rope_interleaved_{f32,bf16}(same arguments)
//     x, out [batch, seq, heads, head_dim]; pos [batch, seq] i32; inv_freq [rot_dim / 2] f32.
//     For pair j < rot_dim/2, angle = pos[b, t] * inv_freq[j]:
//       half (HF `rotate_half`, GPT-NeoX):  elements (j, j + rot_dim/2)
//       interleaved (GPT-J, Meta):          elements (2j, 2j + 1)
//       (a, b) -> (a cos - b sin, b cos + a sin)
//     Elements at or past rot_dim (partial rotary) are copied unchanged.
//     inv_freq is computed on the host, so llama3 / linear scaling cost nothing here.
//     head_dim and rot_dim must be even. out may alias x (each thread owns whole pairs).
// Grid-stride over work units: in the vector form (x and out 16-byte aligned, head_dim and
// rot_dim / 2 multiples of N = VecWidth<T>::N) a unit rotates N elements and their N partners
// (half) or N adjacent elements (interleaved) with 16-byte accesses, or copies N pass-through
// elements; in the scalar form a unit is one pair. The (row, unit) and (b·seq + t) indices
// advance with the grid stride (DivMod): no 64-bit division in the loop.
#include "common.cuh"

// Lanes [0, E) of p at element i: one 16-byte access when VEC, scalar loads otherwise.
template <bool VEC, int E, typename T>
__device__ __forceinline__ void rope_load(const T* p, i64 i, float* f) {
    if (VEC) {
        load_vec(p, i, f);
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) f[e] = load(p, i + e);
    }
}
template <bool VEC, int E, typename T>
__device__ __forceinline__ void rope_store(T* p, i64 i, const float* f) {
    if (VEC) {
        store_vec(p, i, f);
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) store(p, i + e, f[e]);
    }
}

template <typename T, bool INTERLEAVED, bool VEC>
__device__ __forceinline__ void rope_units(const T* x, T* out, const int* pos,
                                           const float* inv_freq, i64 rows, i64 heads,
                                           i64 head_dim, i64 rot_dim) {
    constexpr int N = VecWidth<T>::N;
    // Elements a rotation unit reads from each of its one (interleaved) or two (half) runs,
    // and elements a pass-through unit copies.
    constexpr int E = VEC ? N : (INTERLEAVED ? 2 : 1);
    constexpr int P = VEC ? N : 2;
    const i64 half_rot = rot_dim / 2;
    const i64 rot_units = (INTERLEAVED ? rot_dim : half_rot) / E;
    const i64 units = rot_units + (head_dim - rot_dim) / P;
    const i64 total = rows * units;
    const i64 start = global_thread_id(), step = grid_stride();
    if (start >= total) return;
    DivMod ru(start, step, units);          // q: row (b, t, h) flattened; r: unit in the row
    DivMod bt(start, step, units * heads);  // q: (b, t) flattened, indexes pos
    for (i64 i = start; i < total; i += step, ru.advance(), bt.advance()) {
        const i64 base = ru.q * head_dim;
        const i64 u = ru.r;
        if (u < rot_units) {
            const float p = (float)pos[bt.q];
            float a[E], b[E];
            if (INTERLEAVED) {
                // Elements base + u·E .. + E: pairs (2m, 2m + 1), pair index u·E/2 + m.
                float v[E];
                rope_load<VEC, E>(x, base + u * E, v);
#pragma unroll
                for (int m = 0; m < E / 2; ++m) {
                    float sn, cs;
                    sincosf(p * inv_freq[u * E / 2 + m], &sn, &cs);
                    a[m] = v[2 * m];
                    b[m] = v[2 * m + 1];
                    v[2 * m] = a[m] * cs - b[m] * sn;
                    v[2 * m + 1] = b[m] * cs + a[m] * sn;
                }
                rope_store<VEC, E>(out, base + u * E, v);
            } else {
                // Elements base + j and base + j + rot_dim/2 for j in u·E .. + E.
                const i64 j0 = u * E;
                rope_load<VEC, E>(x, base + j0, a);
                rope_load<VEC, E>(x, base + j0 + half_rot, b);
                float ra[E], rb[E];
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    float sn, cs;
                    sincosf(p * inv_freq[j0 + e], &sn, &cs);
                    ra[e] = a[e] * cs - b[e] * sn;
                    rb[e] = b[e] * cs + a[e] * sn;
                }
                rope_store<VEC, E>(out, base + j0, ra);
                rope_store<VEC, E>(out, base + j0 + half_rot, rb);
            }
        } else {
            // Pass-through: P elements from rot_dim + P·(u - rot_units), copied bit for bit.
            const i64 ia = base + rot_dim + P * (u - rot_units);
            if (VEC) {
                st16(out + ia, ld16(x + ia));
            } else {
#pragma unroll
                for (int e = 0; e < P; ++e) out[ia + e] = x[ia + e];
            }
        }
    }
}

template <typename T, bool INTERLEAVED>
__device__ __forceinline__ void rope_impl(const T* x, T* out, const int* pos,
                                          const float* inv_freq, i64 batch, i64 seq, i64 heads,
                                          i64 head_dim, i64 rot_dim) {
    constexpr int N = VecWidth<T>::N;
    const i64 rows = batch * seq * heads;
    if (rows <= 0 || head_dim <= 0) return;
    if (aligned16(x) && aligned16(out) && head_dim % N == 0 && (rot_dim / 2) % N == 0) {
        rope_units<T, INTERLEAVED, true>(x, out, pos, inv_freq, rows, heads, head_dim, rot_dim);
    } else {
        rope_units<T, INTERLEAVED, false>(x, out, pos, inv_freq, rows, heads, head_dim, rot_dim);
    }
}

#define SHARDC_ROPE(NAME, T, INTERLEAVED)                                                      \
    extern "C" __global__ void NAME(const T* x, T* out, const int* pos, const float* inv_freq, \
                                    i64 batch, i64 seq, i64 heads, i64 head_dim,               \
                                    i64 rot_dim) {                                             \
        rope_impl<T, INTERLEAVED>(x, out, pos, inv_freq, batch, seq, heads, head_dim,          \
                                  rot_dim);                                                    \
    }

SHARDC_ROPE(rope_half_f32, float, false)
SHARDC_ROPE(rope_half_bf16, bf16, false)
SHARDC_ROPE(rope_interleaved_f32, float, true)
SHARDC_ROPE(rope_interleaved_bf16, bf16, true)
