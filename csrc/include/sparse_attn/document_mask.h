// Packed documents (a varlen batch) as one block-sparse mask: row i of the packed queries, in
// sequence d, sees the keys of sequence d in its row's visible band (bottom-right aligned per
// sequence, as flash_attention_varlen: causal is window (-1, 0)). flash_attention_varlen runs a
// batch of many sequences this way, one launch of the block-sparse kernel (forward and backward)
// instead of one per run of equal lengths.
//
// Each row's visible keys are one interval [lo, hi] of packed key positions, and both ends are
// non-decreasing in the row (sequences are in order; within one the band slides right), so a
// query block's key blocks are one range [first row's lo, last row's hi] (blocks of it no row sees
// are left out). Its blocks that every row of the query block sees whole (between the rows'
// largest lo and smallest hi) are full; the others get partial rows of their own.
//
// Layout: that of masks.BlockSparseMask with one mask head and batch, kv_num_blocks (1, 1, nQb),
// kv_indices / kv_partial (1, 1, nQb, max_kb); query block qb's partial rows are
// partial_offsets[qb] ... partial_offsets[qb + 1] - 1 of partial_masks (P, q_block, kv_block / 32),
// the host's bound on how many it may need (document_mask_bounds in sparse_attn/_varlen.py); rows
// it does not use stay zero (the glue allocates them zeroed) and are never listed.
#pragma once

#include <cstdint>

#include "sparse_attn/platform.h"

namespace sparse_attn {

struct DocumentMaskParams {
  const int32_t* cu_q;             // (B + 1,) packed query offsets, non-decreasing from 0 to total_q
  const int32_t* cu_k;             // (B + 1,) packed key offsets, from 0 to total_k
  const int64_t* partial_offsets;  // (nQb + 1,) first partial row of each query block
  int64_t num_partial;             // P: rows of partial_masks (the builders write no others)
  int b, total_q, total_k;
  int q_block, kv_block, nqb, nkb, max_kb;
  int window_left, window_right;  // -1: unbounded
  int32_t* kv_num_blocks;
  int32_t* kv_indices;
  int32_t* kv_partial;
  uint32_t* words;  // partial_masks
};

// The keys packed row i sees: [lo, hi] (lo > hi: none).
SA_HD void document_row_keys(const DocumentMaskParams& p, int i, int64_t& lo, int64_t& hi) {
  int a = 0, e = p.b - 1;  // the sequence: the last d with cu_q[d] <= i (and cu_q[d + 1] > i)
  while (a < e) {
    const int mid = (a + e + 1) / 2;
    if (p.cu_q[mid] <= i)
      a = mid;
    else
      e = mid - 1;
  }
  const int64_t q0 = p.cu_q[a], lq = int64_t(p.cu_q[a + 1]) - q0;
  const int64_t k0 = p.cu_k[a], lk = int64_t(p.cu_k[a + 1]) - k0;
  const int64_t pos = i - q0 + lk - lq;  // the row's diagonal key, local
  int64_t l = 0, h = lk - 1;
  if (p.window_left >= 0 && pos - p.window_left > l) l = pos - p.window_left;
  if (p.window_right >= 0 && pos + p.window_right < h) h = pos + p.window_right;
  // Within the packed keys whatever cu_seqlens hold (the Python caller checks them on the host).
  lo = k0 + l > 0 ? k0 + l : 0;
  hi = k0 + h < p.total_k - 1 ? k0 + h : int64_t(p.total_k) - 1;
}

// Query block qb's partial rows: [begin, end) within [0, P).
SA_HD void document_partial_rows(const DocumentMaskParams& p, int qb, int64_t& begin, int64_t& end) {
  begin = p.partial_offsets[qb] > 0 ? p.partial_offsets[qb] : 0;
  end = p.partial_offsets[qb + 1] < p.num_partial ? p.partial_offsets[qb + 1] : p.num_partial;
}

// The bits of the keys [lo, hi] within key block kb, in words of 32 (word w: keys 32 w ...).
SA_HD uint32_t document_word(int64_t lo, int64_t hi, int kb, int kv_block, int w) {
  const int64_t first = int64_t(kb) * kv_block + 32 * w;
  const int64_t a = lo > first ? lo - first : 0, e = hi - first;  // bits [a, e]
  if (lo > hi || e < 0 || a > 31) return 0u;
  const int top = e > 31 ? 31 : int(e);
  const uint32_t upto = top == 31 ? ~0u : (1u << (top + 1)) - 1u;
  return upto & ~((1u << a) - 1u);
}

namespace cpu {
void document_mask(const DocumentMaskParams& p);
}  // namespace cpu

}  // namespace sparse_attn
