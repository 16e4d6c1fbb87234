// A token selection (B, G, Lq, k) as a block-sparse mask: the key blocks each query block's rows
// select (the union over its rows), each with the exact bits of what every row selected. Top-k's
// "masked block" route runs its selection through the block-sparse kernel this way, so a selected
// key row is loaded once per query tile instead of once per query (see sparse_attn/_plan.py).
//
// An entry is a key, or (entry_block 64 or 128) the keys [e * entry_block, (e + 1) * entry_block);
// under causal each row keeps only the keys it sees.
//
// Layout (that of masks.BlockSparseMask, one partial row per (b, g, query block, key block) the
// query block can see; the causal bound limits which):
//   kv_num_blocks (B, out_heads, nQb), kv_indices / kv_partial (B, out_heads, nQb, max_kb);
//   partial_masks (B * G * pairs, q_block, kv_block / 32), zero where nothing is selected.
// Partial row of (b, g, qb, kb): (b * G + g) * pairs + offset(qb) + kb, offset(qb) the sum of the
// caps of the query blocks before it. A block every row selected whole is listed as full (-1).
// out_heads is 1 when G is 1 (the lists broadcast over heads), else H: the lists of group g are
// written for each of its H / G query heads.
#pragma once

#include <algorithm>
#include <cstdint>

#include "sparse_attn/platform.h"

namespace sparse_attn {

struct SelectionMaskParams {
  const int32_t* indices;  // (B, G, Lq, k) rows; entries < 0 or past the keys are ignored
  int entry_block;         // keys per entry: 1 (an entry is a key) or 64 / 128 (a block of keys)
  int64_t idx_batch_stride, idx_group_stride, idx_row_stride;
  int b, g, lq, k, lk;
  int q_block, kv_block, nqb, nkb, max_kb;
  int heads_per_group, out_heads;
  bool causal;
  int64_t row_offset;  // under causal, local row i sees keys j <= i + row_offset (the rest is dropped)
  int64_t pairs;       // partial rows per (b, g)
  int32_t* kv_num_blocks;
  int32_t* kv_indices;
  int32_t* kv_partial;
  uint32_t* words;  // partial_masks, zeroed by the caller
};

// Key blocks query block qb may list: all of them, or under causal those up to the one holding
// its last row's last visible key.
SA_HD int selection_block_cap(int qb, int lq, int q_block, int kv_block, int nkb, bool causal,
                              int64_t row_offset) {
  if (!causal) return nkb;
  const int64_t last_row =
      (int64_t(qb) + 1) * q_block < lq ? (int64_t(qb) + 1) * q_block - 1 : int64_t(lq) - 1;
  const int64_t last_key = last_row + row_offset;
  if (last_key < 0) return 0;
  const int64_t cap = last_key / kv_block + 1;
  return cap < nkb ? int(cap) : nkb;
}

// The builders: csrc/cpu/selection_mask_cpu.cpp here, run_selection_mask (cuda/topk.h) on CUDA.
// Bits [lo, hi) of a 64-bit word, 0 <= lo < hi <= 64.
SA_HD uint64_t bit_span(int lo, int hi) { return (hi - lo == 64 ? ~0ull : ((1ull << (hi - lo)) - 1)) << lo; }

// The keys [a, e) of one row's entry, clipped to what the row can hold, as (key block, 128-bit
// column bits) runs: calls add(kb, lo_bits, hi_bits) once per key block the range covers.
template <typename Add>
SA_HD void for_key_range(int64_t a, int64_t e, int64_t limit, int kv_block, int cap, Add&& add) {
  if (e > limit) e = limit;
  while (a < e) {
    const int kb = int(a / kv_block);
    if (kb >= cap) return;
    const int64_t first = int64_t(kb) * kv_block;
    const int c0 = int(a - first), c1 = int((e < first + kv_block ? e : first + kv_block) - first);
    const uint64_t lo = c0 < 64 ? bit_span(c0, c1 < 64 ? c1 : 64) : 0ull;
    const uint64_t hi = c1 > 64 ? bit_span(c0 > 64 ? c0 - 64 : 0, c1 - 64) : 0ull;
    add(kb, lo, hi);
    a = first + c1;
  }
}

// _selection_union's query blocks: of `samples` (1..nqb), the i-th is the middle of the i-th of
// `samples` equal parts (every block, in order, when samples == nqb).
SA_HD int union_sample_block(int i, int samples, int nqb) {
  return int((2 * int64_t(i) + 1) * nqb / (2 * int64_t(samples)));
}

namespace cpu {
void selection_mask(const SelectionMaskParams& p);
// The (b, g, query block, key block) pairs a selection touches, over `samples` query blocks
// (union_sample_block): the blocks selection_mask would list there. p's outputs are not used.
int64_t selection_union(const SelectionMaskParams& p, int samples);
// A user's selection (rows of k int32 entries) in topk_attention's form: each row's distinct
// non-negative entries ascending, then -1s (run_canonical_selection on CUDA, cuda/topk.h).
void canonical_selection(const int32_t* in, int32_t* out, int64_t rows, int k);
}  // namespace cpu

}  // namespace sparse_attn
