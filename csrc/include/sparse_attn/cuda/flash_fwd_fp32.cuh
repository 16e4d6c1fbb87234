// fp32 attention on the CUDA cores: the exact (slower) path for float32 inputs, with the same
// tile iterators and online softmax as the tensor-core kernel.
//
// Per CTA: 16 query rows (4 per warp). Lanes split the head dimension (up to 8 values each); a
// tile of 32 keys is scored one key at a time with a warp reduction, after which lane j holds
// the score of key j, so softmax statistics are warp reductions and P V is a broadcast.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/flash_fwd.h"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/softmax_row.h"
#include "sparse_attn/tile_iter.h"

namespace sparse_attn::cuda {

constexpr int kFp32RowsPerWarp = 4;
constexpr int kFp32DimPerLane = 8;  // 256 / 32

template <typename Tiles>
__global__ void __launch_bounds__(128) flash_fwd_fp32_kernel(__grid_constant__ const AttnFwdParams p) {
  constexpr FlashTile kTile = flash_fwd_fp32_tile();
  constexpr int kBlockM = kTile.block_m, kBlockN = kTile.block_n;
  static_assert(kBlockN == 32 && kBlockM == 4 * kFp32RowsPerWarp);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int bh, m_block;
  if (!tile_of_cta<kBlockM>(p, int64_t(blockIdx.x), bh, m_block)) return;
  const int b = bh / p.h, h = bh % p.h, hk = h / p.h_per_kv;
  const int row0 = m_block * kBlockM + warp * kFp32RowsPerWarp;
  const float* k = static_cast<const float*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const float* v = static_cast<const float*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;

  float q[kFp32RowsPerWarp][kFp32DimPerLane], acc[kFp32RowsPerWarp][kFp32DimPerLane];
  float m[kFp32RowsPerWarp], l[kFp32RowsPerWarp];
#pragma unroll
  for (int r = 0; r < kFp32RowsPerWarp; ++r) {
    const float* qr = static_cast<const float*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                      int64_t(row0 + r) * p.q_row_stride;
#pragma unroll
    for (int x = 0; x < kFp32DimPerLane; ++x) {
      const int d = lane + 32 * x;
      q[r][x] = (row0 + r < p.lq && d < p.d) ? qr[d] * p.scale_log2 : 0.f;
      acc[r][x] = 0.f;
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }

  const Tiles tiles(p, b, h, m_block);
  for (int it = 0; it < tiles.num_tiles(); ++it) {
    const int n0 = tiles.n_block(it) * kBlockN;
    float s[kFp32RowsPerWarp];
#pragma unroll
    for (int r = 0; r < kFp32RowsPerWarp; ++r) s[r] = -INFINITY;
    for (int j = 0; j < kBlockN && n0 + j < p.lk; ++j) {
      const float* kr = k + int64_t(n0 + j) * p.k_row_stride;
      float kv[kFp32DimPerLane];
#pragma unroll
      for (int x = 0; x < kFp32DimPerLane; ++x) kv[x] = (lane + 32 * x < p.d) ? kr[lane + 32 * x] : 0.f;
#pragma unroll
      for (int r = 0; r < kFp32RowsPerWarp; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int x = 0; x < kFp32DimPerLane; ++x) dot = fmaf(q[r][x], kv[x], dot);
        dot = warp_sum(dot);
        if (lane == j) s[r] = dot;
      }
    }
    const bool need_mask = tiles.tile_needs_mask(it);
    float pr[kFp32RowsPerWarp];
#pragma unroll
    for (int r = 0; r < kFp32RowsPerWarp; ++r) {
      if (n0 + lane >= p.lk || (need_mask && !((tiles.visible_bits(it, row0 + r) >> lane) & 1u))) s[r] = -INFINITY;
      const float m_new = fmaxf(m[r], warp_max(s[r]));
      const float m_ref = softmax_ref(m_new);
      const float alpha = exp2f(m[r] - m_ref);
      pr[r] = exp2f(s[r] - m_ref);
      l[r] = l[r] * alpha + warp_sum(pr[r]);
      m[r] = m_new;
#pragma unroll
      for (int x = 0; x < kFp32DimPerLane; ++x) acc[r][x] *= alpha;
    }
    for (int j = 0; j < kBlockN && n0 + j < p.lk; ++j) {
      const float* vr = v + int64_t(n0 + j) * p.v_row_stride;
      float vv[kFp32DimPerLane];
#pragma unroll
      for (int x = 0; x < kFp32DimPerLane; ++x) vv[x] = (lane + 32 * x < p.dv) ? vr[lane + 32 * x] : 0.f;
#pragma unroll
      for (int r = 0; r < kFp32RowsPerWarp; ++r) {
        const float pj = __shfl_sync(0xffffffffu, pr[r], j);
        if (pj != 0.f) {
#pragma unroll
          for (int x = 0; x < kFp32DimPerLane; ++x) acc[r][x] = fmaf(pj, vv[x], acc[r][x]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kFp32RowsPerWarp; ++r) {
    if (row0 + r >= p.lq) continue;
    const float inv = row_inv(l[r]);
    float* o = static_cast<float*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + int64_t(row0 + r) * p.o_row_stride;
#pragma unroll
    for (int x = 0; x < kFp32DimPerLane; ++x)
      if (lane + 32 * x < p.dv) o[lane + 32 * x] = acc[r][x] * inv;
    if (lane == 0) p.lse[(int64_t(b) * p.h + h) * p.lq + row0 + r] = row_lse(m[r], l[r]);
  }
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <Variant kVariant>
cudaError_t run_flash_fwd_fp32_(const AttnFwdParams& params, cudaStream_t stream) {
  constexpr FlashTile kTile = flash_fwd_fp32_tile();
  using Tiles = std::conditional_t<kVariant == Variant::kWindow, WindowTiles<kTile.block_m, kTile.block_n>,
                                   BlockSparseTiles<kTile.block_m, kTile.block_n>>;
  const int64_t grid = num_ctas<kTile.block_m>(params);
  if (grid == 0) return cudaSuccess;
  if (grid > INT_MAX) return cudaErrorInvalidConfiguration;
  cuda::flash_fwd_fp32_kernel<Tiles><<<unsigned(grid), kTile.warps * 32, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace sparse_attn
