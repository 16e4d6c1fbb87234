// The online softmax of the flash kernels (mma.sync and wgmma cores alike): both hold a score
// tile S and the output O in registers in the m16n8 accumulator layout (a thread owns rows g and
// g + 8 of every 16-row tile, columns 8 * j + 2t and 8 * j + 2t + 1 of every n8 tile j), so one
// implementation serves both. Statistics are fp32, in log2 units.
#pragma once

#include <cmath>
#include <cstdint>

#include "sparse_attn/cuda/ptx.cuh"

namespace sparse_attn::cuda {

// S *= scale_log2, then hides what the tile's iterator says is not visible. Scores are scaled
// before the max is taken: folding the scale into exp2 as one FFMA leaves a rounding residual of
// up to half an ulp of |score * scale| against the separately rounded max, which overflows exp2
// at large magnitudes (TESTING.md 3.3 #27). row_base: the query row of (mi = 0, half = 0).
template <int kBlockN, int kMTiles, int kNTiles, typename Tiles>
__device__ __forceinline__ void scale_and_mask(float (&s)[kMTiles][kNTiles][4], const Tiles& tiles, int it,
                                               int row_base, int t, float scale_log2) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][ni][e] *= scale_log2;
  if (!tiles.tile_needs_mask(it)) return;
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

// One online-softmax step over a scaled, masked tile: the new running max, S replaced by
// exp2(S - max), the running sum rescaled and accumulated (per thread; the quad reduction of the
// sum is left to the epilogue), and alpha, the factor O must be rescaled by (rescale_o). Phase by
// phase over all rows, so that the dependency chains of different rows interleave.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void online_softmax(float (&s)[kMTiles][kNTiles][4], float (&row_max)[kMTiles][2],
                                               float (&row_sum)[kMTiles][2], float (&alpha)[kMTiles][2]) {
  float mx[kMTiles][2], m_ref[kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      mx[mi][half] = -INFINITY;
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
        mx[mi][half] = fmaxf(mx[mi][half], fmaxf(s[mi][ni][2 * half], s[mi][ni][2 * half + 1]));
    }
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) mx[mi][half] = quad_max(mx[mi][half]);
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m_new = fmaxf(row_max[mi][half], mx[mi][half]);
      // A row with nothing visible so far keeps m = -inf; exp2 then uses 0 as reference.
      m_ref[mi][half] = m_new == -INFINITY ? 0.f : m_new;
      alpha[mi][half] = exp2f(row_max[mi][half] - m_ref[mi][half]);
      row_max[mi][half] = m_new;
      row_sum[mi][half] *= alpha[mi][half];
    }
  }
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][ni][e] = exp2f(s[mi][ni][e] - m_ref[mi][e / 2]);
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = 0.f;
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni) sum += s[mi][ni][2 * half] + s[mi][ni][2 * half + 1];
      row_sum[mi][half] += sum;
    }
}

template <int kMTiles, int kDTiles>
__device__ __forceinline__ void rescale_o(float (&acc_o)[kMTiles][kDTiles][4], const float (&alpha)[kMTiles][2]) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int nd = 0; nd < kDTiles; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][nd][e] *= alpha[mi][e / 2];
}

// P = S packed to 16 bits in the A-operand layout of a 16-key slice (mma.sync m16n8k16 and
// wgmma's register A alike): the accumulators of n8 tiles 2kk and 2kk + 1.
template <ScalarKind kDtype, int kMTiles, int kNTiles>
__device__ __forceinline__ void pack_p(const float (&s)[kMTiles][kNTiles][4], uint32_t (&pa)[kMTiles][kNTiles / 2][4]) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk) {
      pa[mi][kk][0] = pack2<kDtype>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
      pa[mi][kk][1] = pack2<kDtype>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
      pa[mi][kk][2] = pack2<kDtype>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
      pa[mi][kk][3] = pack2<kDtype>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
    }
  }
}

// The row's final normaliser 1 / l (0 for an empty row; NaN stays NaN) and natural-log LSE
// (-inf for an empty row), from the per-thread running max and sum.
__device__ __forceinline__ float finish_row(float row_max, float row_sum, float& lse) {
  const float l = quad_sum(row_sum);
  lse = l == 0.f ? -INFINITY : (row_max + __log2f(l)) * 0.69314718055994530942f;
  return l == 0.f ? 0.f : 1.f / l;
}

}  // namespace sparse_attn::cuda
