// Packed documents as a block-sparse mask on the CPU (sparse_attn/document_mask.h): the same lists
// and bits as the CUDA builder. One task per query block.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "sparse_attn/document_mask.h"

namespace sparse_attn {
namespace cpu {

void document_mask(const DocumentMaskParams& p) {
  const int words = p.kv_block / 32;
#pragma omp parallel for schedule(dynamic, 4)
  for (int qb = 0; qb < p.nqb; ++qb) {
    const int rows = std::min(p.q_block, p.total_q - qb * p.q_block);
    std::vector<int64_t> lo(size_t(p.q_block), 1), hi(size_t(p.q_block), 0);  // rows past total_q: none
    int64_t first = INT64_MAX, last = -1, lo_max = -1, hi_min = INT64_MAX;
    bool all_see = true;  // every row of the block sees some key
    for (int r = 0; r < rows; ++r) {
      document_row_keys(p, qb * p.q_block + r, lo[r], hi[r]);
      if (lo[r] > hi[r]) {
        all_see = false;
        continue;
      }
      first = std::min(first, lo[r]);
      last = std::max(last, hi[r]);
      lo_max = std::max(lo_max, lo[r]);
      hi_min = std::min(hi_min, hi[r]);
    }
    int32_t* idx = p.kv_indices + int64_t(qb) * p.max_kb;
    int32_t* part = p.kv_partial + int64_t(qb) * p.max_kb;
    int count = 0;
    int64_t slot, slot_end;
    document_partial_rows(p, qb, slot, slot_end);
    if (last >= 0) {
      for (int kb = int(first / p.kv_block); kb <= int(last / p.kv_block) && count < p.max_kb; ++kb) {
        const int64_t k_lo = int64_t(kb) * p.kv_block;
        const int64_t k_hi = std::min<int64_t>(k_lo + p.kv_block, p.total_k) - 1;
        if (all_see && lo_max <= k_lo && hi_min >= k_hi) {
          idx[count] = kb;
          part[count++] = -1;
          continue;
        }
        bool any = false;
        for (int r = 0; r < rows && !any; ++r)
          any = lo[r] <= std::min(hi[r], k_hi) && std::max(lo[r], k_lo) <= hi[r];
        if (!any || slot >= slot_end) continue;
        uint32_t* w = p.words + slot * p.q_block * words;
        for (int r = 0; r < p.q_block; ++r)
          for (int i = 0; i < words; ++i)
            w[r * words + i] = document_word(lo[r], std::min(hi[r], k_hi), kb, p.kv_block, i);
        idx[count] = kb;
        part[count++] = int32_t(slot++);
      }
    }
    p.kv_num_blocks[qb] = count;
    for (int s = count; s < p.max_kb; ++s) {
      idx[s] = 0;
      part[s] = -1;
    }
  }
}

}  // namespace cpu
}  // namespace sparse_attn
