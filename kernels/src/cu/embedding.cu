// embedding.cu: row lookup `out[n, :] = table[ids[n] - id_offset, :]`.
//
// embedding_{f32,bf16}(const T* table,   // [V, H]
//                      const int* ids,   // [N] (i32 token ids, any leading shape flattened)
//                      T* out,           // [N, H]
//                      i64 n_ids, i64 vocab, i64 hidden,
//                      i64 id_offset)    // first id held by this table (vocab-parallel shard)
// An id whose row `ids[n] - id_offset` falls outside [0, vocab) gives a zero row, so each shard
// of a vocabulary-parallel table contributes only its own rows (then an all-reduce sums them).
// Grid-stride over N * H output elements.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void embedding_impl(const T* table, const int* ids, T* out, i64 n_ids,
                                               i64 vocab, i64 hidden, i64 id_offset) {
    const i64 total = n_ids * hidden;
    for (i64 i = global_thread_id(); i < total; i += grid_stride()) {
        const i64 n = i / hidden;
        const i64 c = i - n * hidden;
        const i64 row = (i64)ids[n] - id_offset;
        if (row >= 0 && row < vocab) {
            out[i] = table[row * hidden + c];
        } else {
            store(out, i, 0.0f);
        }
    }
}

extern "C" __global__ void embedding_f32(const float* table, const int* ids, float* out,
                                         i64 n_ids, i64 vocab, i64 hidden, i64 id_offset) {
    embedding_impl(table, ids, out, n_ids, vocab, hidden, id_offset);
}

extern "C" __global__ void embedding_bf16(const bf16* table, const int* ids, bf16* out,
                                          i64 n_ids, i64 vocab, i64 hidden, i64 id_offset) {
    embedding_impl(table, ids, out, n_ids, vocab, hidden, id_offset);
}
