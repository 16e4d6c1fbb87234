// A token selection as a block-sparse mask on the CPU (layout: sparse_attn/selection_mask.h).
// One task per (batch, group, query block); the same lists and bits as the CUDA builder.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sparse_attn/selection_mask.h"

namespace sparse_attn {
namespace cpu {

namespace {

// fn(r, row, limit) for each row r of query block qb of (b, g): its entries, and the keys before
// limit it may see.
template <typename Fn>
void for_each_row(const SelectionMaskParams& p, int b, int g, int qb, Fn&& fn) {
  const int rows = std::min(p.q_block, p.lq - qb * p.q_block);
  for (int r = 0; r < rows; ++r) {
    const int64_t row_global = int64_t(qb) * p.q_block + r;
    const int32_t* row =
        p.indices + b * p.idx_batch_stride + g * p.idx_group_stride + row_global * p.idx_row_stride;
    fn(r, row, p.causal ? std::min<int64_t>(p.lk, row_global + p.row_offset + 1) : int64_t(p.lk));
  }
}

}  // namespace

void selection_mask(const SelectionMaskParams& p) {
  const int words = p.kv_block / 32;
  const int64_t tasks = int64_t(p.b) * p.g * p.nqb;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int qb = int(t % p.nqb), g = int(t / p.nqb % p.g), b = int(t / p.nqb / p.g);
    const int cap = selection_block_cap(qb, p.lq, p.q_block, p.kv_block, p.nkb, p.causal, p.row_offset);
    int64_t offset = 0;
    for (int i = 0; i < qb; ++i)
      offset += selection_block_cap(i, p.lq, p.q_block, p.kv_block, p.nkb, p.causal, p.row_offset);
    const int64_t first_pair = (int64_t(b) * p.g + g) * p.pairs + offset;
    std::vector<char> touched(size_t(cap), 0);
    const int rows = std::min(p.q_block, p.lq - qb * p.q_block);
    for_each_row(p, b, g, qb, [&](int r, const int32_t* row, int64_t limit) {
      auto add = [&](int kb, uint64_t lo, uint64_t hi) {
        touched[kb] = 1;
        uint32_t* w = p.words + ((first_pair + kb) * p.q_block + r) * words;
        const uint32_t part[4] = {uint32_t(lo), uint32_t(lo >> 32), uint32_t(hi), uint32_t(hi >> 32)};
        for (int i = 0; i < words; ++i) w[i] |= part[i];
      };
      if (p.entry_block == 1) {  // keys: one bit each, no range arithmetic
        const int shift = p.kv_block == 128 ? 7 : 6;
        uint32_t* row_words = p.words + (first_pair * p.q_block + r) * words;
        const int64_t pair_words = int64_t(p.q_block) * words;
        for (int j = 0; j < p.k; ++j) {
          const int32_t key = row[j];
          if (key < 0 || key >= limit || (key >> shift) >= cap) continue;
          const int kb = key >> shift, c = key & (p.kv_block - 1);
          touched[kb] = 1;
          row_words[kb * pair_words + (c >> 5)] |= 1u << (c & 31);
        }
        return;
      }
      for (int j = 0; j < p.k; ++j) {
        if (row[j] < 0) continue;
        const int64_t a = int64_t(row[j]) * p.entry_block;
        for_key_range(a, a + p.entry_block, limit, p.kv_block, cap, add);
      }
    });
    // Full blocks: every row of the block (rows past Lq count as full) selects every key before Lk.
    int count = 0;
    for (int kb = 0; kb < cap; ++kb) {
      if (!touched[kb]) continue;
      const int keys = std::min(p.kv_block, p.lk - kb * p.kv_block);
      bool full = int64_t(p.k) * p.entry_block >= keys;
      for (int r = 0; r < rows && full; ++r)
        for (int w = 0; w < words && full; ++w) {
          const int bits = std::min(32, std::max(0, keys - 32 * w));
          const uint32_t want = bits == 32 ? ~0u : (1u << bits) - 1u;
          full = (p.words[((first_pair + kb) * p.q_block + r) * words + w] & want) == want;
        }
      for (int hh = 0; hh < p.heads_per_group; ++hh) {
        const int64_t list = (int64_t(b) * p.out_heads + int64_t(g) * p.heads_per_group + hh) * p.nqb + qb;
        p.kv_indices[list * p.max_kb + count] = kb;
        p.kv_partial[list * p.max_kb + count] = full ? -1 : int32_t(first_pair + kb);
      }
      ++count;
    }
    for (int hh = 0; hh < p.heads_per_group; ++hh) {
      const int64_t list = (int64_t(b) * p.out_heads + int64_t(g) * p.heads_per_group + hh) * p.nqb + qb;
      p.kv_num_blocks[list] = count;
      for (int s = count; s < p.max_kb; ++s) {
        p.kv_indices[list * p.max_kb + s] = 0;
        p.kv_partial[list * p.max_kb + s] = 0;
      }
    }
  }
}

int64_t selection_union(const SelectionMaskParams& p, int samples) {
  const int64_t tasks = int64_t(p.b) * p.g * samples;
  int64_t total = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : total)
  for (int64_t t = 0; t < tasks; ++t) {
    const int qb = union_sample_block(int(t % samples), samples, p.nqb);
    const int g = int(t / samples % p.g), b = int(t / samples / p.g);
    const int cap = selection_block_cap(qb, p.lq, p.q_block, p.kv_block, p.nkb, p.causal, p.row_offset);
    std::vector<char> touched(size_t(cap), 0);
    for_each_row(p, b, g, qb, [&](int, const int32_t* row, int64_t limit) {
      for (int j = 0; j < p.k; ++j) {
        if (row[j] < 0) continue;
        const int64_t a = int64_t(row[j]) * p.entry_block;
        for_key_range(a, a + p.entry_block, limit, p.kv_block, cap,
                      [&](int kb, uint64_t, uint64_t) { touched[kb] = 1; });
      }
    });
    total += std::count(touched.begin(), touched.end(), char(1));
  }
  return total;
}

// Rows already in the form (strictly ascending entries, then only -1s) are copied; others sorted,
// their repeats and negative entries dropped, -1s after.
void canonical_selection(const int32_t* in, int32_t* out, int64_t rows, int k) {
#pragma omp parallel
  {
    std::vector<int32_t> keys(size_t(k > 0 ? k : 0));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* src = in + r * k;
      int32_t* dst = out + r * k;
      bool ok = k == 0 || src[0] >= -1;
      for (int i = 1; i < k && ok; ++i) ok = src[i] == -1 || (src[i] > src[i - 1] && src[i - 1] >= 0);
      if (ok) {
        std::copy(src, src + k, dst);
        continue;
      }
      const auto end = std::copy_if(src, src + k, keys.begin(), [](int32_t x) { return x >= 0; });
      std::sort(keys.begin(), end);
      const auto last = std::unique(keys.begin(), end);
      std::fill(std::copy(keys.begin(), last, dst), dst + k, -1);
    }
  }
}

}  // namespace cpu
}  // namespace sparse_attn
