// embedding.cu: row lookup `out[n, :] = table[ids[n] - id_offset, :]`.
//
// embedding_{f32,bf16}(const T* table,   // [V, H]
//                      const int* ids,   // [N] (i32 token ids, any leading shape flattened)
//                      T* out,           // [N, H]
//                      i64 n_ids, i64 vocab, i64 hidden,
//                      i64 id_offset)    // first id held by this table (vocab-parallel shard)
// An id whose row `ids[n] - id_offset` falls outside [0, vocab) gives a zero row, so each shard
// of a vocabulary-parallel table contributes only its own rows (then an all-reduce sums them).
// Grid-stride over the output in units of 16 bytes (N elements; table and out 16-byte aligned,
// hidden a multiple of N) or of single elements otherwise; the (token, column) of a unit
// advances with the grid stride (DivMod), no division in the loop. Rows are copied bit for bit.
#include "common.cuh"

template <typename T, bool VEC>
__device__ __forceinline__ void embedding_units(const T* table, const int* ids, T* out,
                                                i64 n_ids, i64 vocab, i64 hidden,
                                                i64 id_offset) {
    constexpr int W = VEC ? VecWidth<T>::N : 1;
    const i64 per_row = hidden / W;
    const i64 total = n_ids * per_row;
    const i64 start = global_thread_id(), step = grid_stride();
    if (start >= total) return;
    DivMod nc(start, step, per_row);  // q: token, r: unit in the row
    for (i64 i = start; i < total; i += step, nc.advance()) {
        const i64 row = (i64)ids[nc.q] - id_offset;
        const i64 o = nc.q * hidden + nc.r * W;
        const bool hit = row >= 0 && row < vocab;
        if (VEC) {
            uint4 u;
            u.x = u.y = u.z = u.w = 0u;
            if (hit) u = ld16(table + row * hidden + nc.r * W);
            st16(out + o, u);
        } else if (hit) {
            out[o] = table[row * hidden + nc.r];
        } else {
            store(out, o, 0.0f);
        }
    }
}

template <typename T>
__device__ __forceinline__ void embedding_impl(const T* table, const int* ids, T* out, i64 n_ids,
                                               i64 vocab, i64 hidden, i64 id_offset) {
    if (hidden <= 0) return;
    if (aligned16(table) && aligned16(out) && hidden % VecWidth<T>::N == 0) {
        embedding_units<T, true>(table, ids, out, n_ids, vocab, hidden, id_offset);
    } else {
        embedding_units<T, false>(table, ids, out, n_ids, vocab, hidden, id_offset);
    }
}

#define SHARDC_EMBEDDING(NAME, T)                                                      \
    extern "C" __global__ void NAME(const T* table, const int* ids, T* out, i64 n_ids, \
                                    i64 vocab, i64 hidden, i64 id_offset) {            \
        embedding_impl(table, ids, out, n_ids, vocab, hidden, id_offset);              \
    }

SHARDC_EMBEDDING(embedding_f32, float)
SHARDC_EMBEDDING(embedding_bf16, bf16)
