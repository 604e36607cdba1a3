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
//     head_dim and rot_dim must be even. out may alias x (each thread owns a whole pair).
// Grid-stride over batch * seq * heads * head_dim / 2 pairs.
#include "common.cuh"

template <typename T, bool INTERLEAVED>
__device__ __forceinline__ void rope_impl(const T* x, T* out, const int* pos,
                                          const float* inv_freq, i64 batch, i64 seq, i64 heads,
                                          i64 head_dim, i64 rot_dim) {
    const i64 half_d = head_dim / 2;
    const i64 half_rot = rot_dim / 2;
    const i64 total = batch * seq * heads * half_d;
    for (i64 i = global_thread_id(); i < total; i += grid_stride()) {
        const i64 row = i / half_d;        // (b, t, h) flattened
        const i64 j = i - row * half_d;    // pair index within the head
        const i64 bt = row / heads;        // (b, t) flattened, indexes pos
        const i64 base = row * head_dim;
        if (j < half_rot) {
            i64 ia, ib;
            if (INTERLEAVED) {
                ia = base + 2 * j;
                ib = ia + 1;
            } else {
                ia = base + j;
                ib = base + j + half_rot;
            }
            const float angle = (float)pos[bt] * inv_freq[j];
            float s, c;
            sincosf(angle, &s, &c);
            const float a = load(x, ia);
            const float b = load(x, ib);
            store(out, ia, a * c - b * s);
            store(out, ib, b * c + a * s);
        } else {
            // Pass-through pair: the two elements rot_dim + 2 (j - half_rot) and the next.
            const i64 ia = base + rot_dim + 2 * (j - half_rot);
            out[ia] = x[ia];
            out[ia + 1] = x[ia + 1];
        }
    }
}

extern "C" __global__ void rope_half_f32(const float* x, float* out, const int* pos,
                                         const float* inv_freq, i64 batch, i64 seq, i64 heads,
                                         i64 head_dim, i64 rot_dim) {
    rope_impl<float, false>(x, out, pos, inv_freq, batch, seq, heads, head_dim, rot_dim);
}
extern "C" __global__ void rope_half_bf16(const bf16* x, bf16* out, const int* pos,
                                          const float* inv_freq, i64 batch, i64 seq, i64 heads,
                                          i64 head_dim, i64 rot_dim) {
    rope_impl<bf16, false>(x, out, pos, inv_freq, batch, seq, heads, head_dim, rot_dim);
}
extern "C" __global__ void rope_interleaved_f32(const float* x, float* out, const int* pos,
                                                const float* inv_freq, i64 batch, i64 seq,
                                                i64 heads, i64 head_dim, i64 rot_dim) {
    rope_impl<float, true>(x, out, pos, inv_freq, batch, seq, heads, head_dim, rot_dim);
}
extern "C" __global__ void rope_interleaved_bf16(const bf16* x, bf16* out, const int* pos,
                                                 const float* inv_freq, i64 batch, i64 seq,
                                                 i64 heads, i64 head_dim, i64 rot_dim) {
    rope_impl<bf16, true>(x, out, pos, inv_freq, batch, seq, heads, head_dim, rot_dim);
}
