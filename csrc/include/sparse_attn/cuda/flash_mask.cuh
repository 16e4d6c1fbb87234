// Element masks of the flash kernels' score tiles (mma.sync and wgmma cores alike, the m16n8
// accumulator layout of flash_softmax.cuh): what a key-tile iterator (tile_iter.h) says is not
// visible becomes -inf before the online softmax.
#pragma once

#include <cmath>
#include <cstdint>

#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/tile_iter.h"

namespace sparse_attn::cuda {

// Hides what the tile's iterator says is not visible (S = -inf there), scaled or not. row_base:
// the query row of (mi = 0, half = 0); needed: tiles.tile_needs_mask(it), which a caller may
// evaluate early (a block-sparse mask reads it from global memory) and pass in.
template <int kBlockN, int kMTiles, int kNTiles, typename Tiles>
__device__ __forceinline__ void mask_scores(float (&s)[kMTiles][kNTiles][4], const Tiles& tiles, int it,
                                            int row_base, int t, bool needed) {
  if (!needed) return;
  // Column ni * 8 + 2t + e of the tile is bit (ni * 8 + e) of the row's mask shifted by 2t.
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_base + mi * 16 + half * 8;
      static_for<(kBlockN + 63) / 64>([&](auto c_) {
        constexpr int c64 = decltype(c_)::value * 64;
        constexpr int n_end = (c64 + 64 < kBlockN ? c64 + 64 : kBlockN) / 8;
        const uint64_t bits = tiles.visible_bits(it, row, c64) >> (2 * t);
#pragma unroll
        for (int ni = c64 / 8; ni < n_end; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (!((bits >> ((ni % 8) * 8 + e)) & 1u)) s[mi][ni][2 * half + e] = -INFINITY;
      });
    }
  }
}

// A tile's element mask read ahead of its scores (the Hopper core with a block-sparse mask, whose
// mask words come from global memory: read after the scores, their latency sat on every partial
// block's critical path). Two steps, each issuing loads that the next one consumes much later:
// the iterator's entry_of (the list entry, into kb and pid), then load_tile_mask (the words of a
// thread's two rows, row_base and row_base + 8); apply_tile_mask once S is ready.
template <int kBlockN>
struct TileMask {
  static constexpr int kWords = kBlockN / 32;
  int kb, pid;            // the list entry (tiles.entry_of)
  uint32_t w[2][kWords];  // the rows' mask words (all ones without an element mask)
  int cols;               // columns of the tile that exist (0: an invalid entry, nothing visible)
  bool need;              // tiles.tile_needs_mask(it): an element mask, the keys' ragged tail, or invalid
};

template <int kBlockN, typename Tiles>
__device__ __forceinline__ void load_tile_mask(TileMask<kBlockN>& m, const Tiles& tiles, int it,
                                               int row_base) {
  static_assert(kBlockN % 128 == 0, "rows of 16-byte words");
  constexpr int kVec = TileMask<kBlockN>::kWords / 4;
  const int32_t* words = tiles.row_mask_words(it, m.kb, m.pid, row_base, m.cols);
  m.need = words != nullptr || m.cols < kBlockN;
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      // Rows are 16-byte aligned (set_params_block_sparse aligns the words); row + 8 is 8 rows on.
      const int4 x =
          words != nullptr
              ? __ldg(reinterpret_cast<const int4*>(words + half * 8 * TileMask<kBlockN>::kWords) + v)
              : make_int4(-1, -1, -1, -1);
      m.w[half][4 * v] = uint32_t(x.x);
      m.w[half][4 * v + 1] = uint32_t(x.y);
      m.w[half][4 * v + 2] = uint32_t(x.z);
      m.w[half][4 * v + 3] = uint32_t(x.w);
    }
}

template <int kBlockN, int kNTiles>
__device__ __forceinline__ void apply_tile_mask(float (&s)[1][kNTiles][4], const TileMask<kBlockN>& m,
                                                int t) {
  // The flag is the same in every lane (one tile); branching on a vote makes that visible to the
  // compiler (a plain test was slower on dilated and BigBird masks, docs/PERF_LOG.md).
  if (!__any_sync(0xffffffffu, m.need)) return;
#pragma unroll
  for (int half = 0; half < 2; ++half)
    static_for<kBlockN / 64>([&](auto c_) {
      constexpr int c = decltype(c_)::value;
      const uint64_t word = (uint64_t(m.w[half][2 * c + 1]) << 32) | m.w[half][2 * c];
      const uint64_t bits = (word & bit_range(0, m.cols - 1 - c * 64)) >> (2 * t);
#pragma unroll
      for (int ni = c * 8; ni < c * 8 + 8; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (!((bits >> ((ni % 8) * 8 + e)) & 1u)) s[0][ni][2 * half + e] = -INFINITY;
    });
}

// The same, asking the iterator at the point of masking.
template <int kBlockN, int kMTiles, int kNTiles, typename Tiles>
__device__ __forceinline__ void mask_scores(float (&s)[kMTiles][kNTiles][4], const Tiles& tiles, int it,
                                            int row_base, int t) {
  mask_scores<kBlockN>(s, tiles, it, row_base, t, tiles.tile_needs_mask(it));
}

}  // namespace sparse_attn::cuda
