// The flash attention forward kernel (mma.sync tensor cores, sm_80+): one main loop for every
// variant; what differs is the key-tile iterator (tile_iter.h).
//
// Per CTA: one query tile of kBlockM rows of one (batch, head). Q stays in shared memory; K and
// V tiles are streamed with cp.async, the V load overlapping Q K^T and the next K load
// overlapping P V. Each warp owns kBlockM / kNWarps query rows; S and O live in registers
// (mma.sync m16n8k16 accumulator layout), softmax statistics in fp32, in log2 units.
#pragma once

#include <cfloat>
#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/flash_fwd.h"
#include "sparse_attn/cuda/flash_mask.cuh"
#include "sparse_attn/cuda/flash_softmax.cuh"
#include "sparse_attn/cuda/hidden_values.cuh"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/cuda/smem_tile.cuh"
#include "sparse_attn/tile_iter.h"

namespace sparse_attn::cuda {

template <ScalarKind kDtype_, int kHeadDim_, Variant kVariant, int kBlockM_>
struct FlashFwdTraits {
  static constexpr ScalarKind kDtype = kDtype_;
  using Element = typename ElementOf<kDtype>::type;
  static constexpr FlashTile kTile = flash_fwd_tile(kHeadDim_, kVariant, kBlockM_);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.warps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kWarpRows = kBlockM / kNWarps;  // query rows per warp
  static constexpr int kMTiles = kWarpRows / 16;       // m16 row tiles per warp
  static constexpr int kNTiles = kBlockN / 8;          // n8 column tiles of S
  static constexpr int kDTiles = kHeadDim / 8;         // n8 column tiles of O
  static constexpr int kChunks = kHeadDim / 8;         // 16-byte chunks per shared-memory row
  static constexpr int kSmemQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kSmemKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kSmemBytes = kSmemQBytes + 2 * kSmemKVBytes;  // Q, K, V
  using Tiles = typename TilesOf<kVariant, kBlockM, kBlockN>::type;
  static_assert(kWarpRows % 16 == 0 && kChunks % 8 == 0 && kNTiles % 2 == 0 &&
                (kBlockN <= 64 || kBlockN % 64 == 0));
};

// kRows x kHeadDim tile from global memory (row stride in elements) into swizzled shared memory;
// rows >= rows_valid and columns >= d_valid are zero-filled, never read. Each thread copies one
// 16-byte column chunk of every kRowStep-th row, walking a pointer so that no per-row offset
// stays live across the main loop.
template <typename Tr, int kRows>
__device__ __forceinline__ void load_tile(uint32_t smem, const typename Tr::Element* gmem, int64_t row_stride,
                                          int rows_valid, int d_valid, int tid) {
  constexpr int kRowStep = Tr::kNThreads / Tr::kChunks;
  static_assert(Tr::kNThreads % Tr::kChunks == 0 && kRows % kRowStep == 0);
  const int c = tid % Tr::kChunks;
  int r = tid / Tr::kChunks;
  const typename Tr::Element* src = gmem + r * row_stride + c * 8;
  const int r0 = r;
  // Destination of step i; the swizzle repeats every 8 rows, so a step of 8k rows is a constant.
  auto dst = [&](int i) {
    return kRowStep % 8 == 0 ? smem + swz<Tr::kChunks>(r0, c) + i * kRowStep * Tr::kChunks * 16
                             : smem + swz<Tr::kChunks>(r0 + i * kRowStep, c);
  };
  if (rows_valid >= kRows && d_valid == Tr::kHeadDim) {  // the common case: no predicates
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i, src += kRowStep * row_stride) cp_async_16(dst(i), src, 16);
    return;
  }
  const bool col_ok = c * 8 < d_valid;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i, r += kRowStep, src += kRowStep * row_stride) {
    const bool ok = col_ok && r < rows_valid;
    cp_async_16(dst(i), ok ? src : gmem, ok ? 16 : 0);
  }
}

template <typename Tr>
__global__ void __launch_bounds__(Tr::kNThreads) flash_fwd_kernel(__grid_constant__ const AttnFwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kMTiles = Tr::kMTiles, kNTiles = Tr::kNTiles,
                kDTiles = Tr::kDTiles, kChunks = Tr::kChunks;
  extern __shared__ __align__(128) char smem[];
  const uint32_t sQ = smem_u32(smem);
  const uint32_t sK = sQ + Tr::kSmemQBytes;
  const uint32_t sV = sK + Tr::kSmemKVBytes;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // mma accumulator: rows g and g + 8, columns 2t, 2t + 1
  int bh, m_block;
  if (!tile_of_cta<kBlockM>(p, int64_t(blockIdx.x), bh, m_block)) return;
  const int b = bh / p.h, h = bh % p.h, hk = h / p.h_per_kv;
  const int m0 = m_block * kBlockM;
  const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                     int64_t(m0) * p.q_row_stride;
  const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;

  const typename Tr::Tiles tiles(p, b, h, m_block);
  const int n_tiles = tiles.num_tiles();

  load_tile<Tr, kBlockM>(sQ, q, p.q_row_stride, p.lq - m0, p.d, tid);
  cp_async_commit();
  if (n_tiles > 0) {
    const int n0 = tiles.n_block(0) * kBlockN;
    load_tile<Tr, kBlockN>(sK, k + int64_t(n0) * p.k_row_stride, p.k_row_stride, p.lk - n0, p.d, tid);
  }
  cp_async_commit();

  float acc_o[kMTiles][kDTiles][4];
  float row_max[kMTiles][2], row_sum[kMTiles][2];
  softmax_start(acc_o, row_max, row_sum);
  const int warp_row0 = warp * Tr::kWarpRows;
  // Per-thread ldmatrix bases (see swz_step): Q rows of this warp, K rows, V rows (transposed).
  const int r8 = lane % 8;
  const uint32_t q_base = sQ + swz<kChunks>(warp_row0 + ((lane / 8) % 2) * 8 + r8, lane / 16);
  const uint32_t k_base = sK + swz<kChunks>((lane / 16) * 8 + r8, (lane / 8) % 2);
  const uint32_t v_base = sV + swz<kChunks>(((lane / 8) % 2) * 8 + r8, lane / 16);
  constexpr uint32_t kRow16 = 16 * kChunks * 16;  // bytes of 16 shared-memory rows

  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = tiles.n_block(it) * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K[it] (and Q) landed; every warp is done with V[it - 1]
    load_tile<Tr, kBlockN>(sV, v + int64_t(n0) * p.v_row_stride, p.v_row_stride, p.lk - n0, p.dv, tid);
    cp_async_commit();

    // S = Q K^T. Fragments of k-slice kk + 1 are loaded before the MMAs of slice kk (the
    // loads and MMAs are volatile, so this source order is the issue order).
    float s[kMTiles][kNTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;
    {
      const uint32_t qb = opaque(q_base), kb = opaque(k_base);
      uint32_t fa[2][kMTiles][4], fb[2][kNTiles / 2][4];
      auto load_slice = [&](auto kk_) {
        constexpr int kk = decltype(kk_)::value;
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) ldmatrix_x4(fa[kk % 2][mi], swz_step<kk>(qb + mi * kRow16));
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) ldmatrix_x4(fb[kk % 2][np], swz_step<kk>(kb + np * kRow16));
      };
      load_slice(std::integral_constant<int, 0>{});
      static_for<Tr::kHeadDim / 16>([&](auto kk_) {
        constexpr int kk = decltype(kk_)::value;
        if constexpr (kk + 1 < Tr::kHeadDim / 16) load_slice(std::integral_constant<int, kk + 1>{});
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
            mma_16x8x16<Tr::kDtype>(s[mi][2 * np], fa[kk % 2][mi], fb[kk % 2][np][0], fb[kk % 2][np][1]);
            mma_16x8x16<Tr::kDtype>(s[mi][2 * np + 1], fa[kk % 2][mi], fb[kk % 2][np][2], fb[kk % 2][np][3]);
          }
        }
      });
    }

    scale_scores(s, p.scale_log2);
    mask_scores<kBlockN>(s, tiles, it, m0 + warp_row0 + g, t);
    {
      float alpha[kMTiles][2];
      online_softmax(s, row_max, row_sum, alpha);
      rescale_o(acc_o, alpha);
    }

    cp_async_wait<0>();
    __syncthreads();  // V[it] landed; every warp is done with K[it]
    if (it + 1 < n_tiles) {
      const int n1 = tiles.n_block(it + 1) * kBlockN;
      load_tile<Tr, kBlockN>(sK, k + int64_t(n1) * p.k_row_stride, p.k_row_stride, p.lk - n1, p.d, tid);
    }
    cp_async_commit();

    // O += P V. P is packed to 16 bits once (its layout is mma's A-operand layout); V fragments
    // stream through a ring of kVRing ldmatrix results, each loaded kVRing steps before its use.
    uint32_t pa[kMTiles][kBlockN / 16][4];
    pack_p<Tr::kDtype>(s, pa);
    {
      constexpr int kPairs = kDTiles / 2;              // ldmatrix.x4 per 16 keys
      constexpr int kSteps = (kBlockN / 16) * kPairs;  // (key slice, column pair) steps
      constexpr int kVRing = kPairs < 8 ? kPairs : 8;
      const uint32_t vb = opaque(v_base);
      uint32_t ring[kVRing][4];
      auto load_v = [&](auto j_) {
        constexpr int j = decltype(j_)::value;
        ldmatrix_x4_trans(ring[j % kVRing], swz_step<j % kPairs>(vb + (j / kPairs) * kRow16));
      };
      static_for<kVRing>(load_v);
      static_for<kSteps>([&](auto j_) {
        constexpr int j = decltype(j_)::value, kk = j / kPairs, dp = j % kPairs;
        const uint32_t b0 = ring[j % kVRing][0], b1 = ring[j % kVRing][1], b2 = ring[j % kVRing][2],
                       b3 = ring[j % kVRing][3];
        if constexpr (j + kVRing < kSteps) load_v(std::integral_constant<int, j + kVRing>{});
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          mma_16x8x16<Tr::kDtype>(acc_o[mi][2 * dp], pa[mi][kk], b0, b1);
          mma_16x8x16<Tr::kDtype>(acc_o[mi][2 * dp + 1], pa[mi][kk], b2, b3);
        }
      });
    }
  }

  // Epilogue: O / l through shared memory (Q's space) for 16-byte coalesced stores; LSE.
  cp_async_wait<0>();
  __syncthreads();
  char* smem_o = smem;
  auto staged = [&](int r, int col) {  // column col of tile row r
    return reinterpret_cast<uint32_t*>(smem_o + swz<kChunks>(r, col / 8) + (col % 8) * 2);
  };
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    uint32_t probe[2] = {0u, 0u};  // hidden_values.cuh
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float lse;
      const float inv = finish_row(row_max[mi][half], row_sum[mi][half], lse);
      const int r = warp_row0 + mi * 16 + g + half * 8;
#pragma unroll
      for (int nd = 0; nd < kDTiles; ++nd) {
        const uint32_t packed = pack2<Tr::kDtype>(acc_o[mi][nd][2 * half] * inv, acc_o[mi][nd][2 * half + 1] * inv);
        *staged(r, nd * 8 + 2 * t) = packed;
        probe[half] = probe_nonfinite<Tr::kDtype>(probe[half], packed);
      }
      if (t == 0 && m0 + r < p.lq) p.lse[(int64_t(b) * p.h + h) * p.lq + m0 + r] = lse;
    }
    // Rows whose output is not finite, computed again over exactly the keys they see.
    const uint32_t bad0 = __ballot_sync(0xffffffffu, probe_hit(probe[0]));
    const uint32_t bad1 = __ballot_sync(0xffffffffu, probe_hit(probe[1]));
    if ((bad0 | bad1) != 0u) {
      const int row16 = warp_row0 + mi * 16;
      recompute_rows<Tr::kDtype, Tr::kHeadDim, kBlockN, typename Tr::Tiles>(
          p, b, h, m_block, m0 + row16, bad0, bad1,
          [&](int r, int col, uint32_t packed) { *staged(row16 + r, col) = packed; });
    }
  }
  __syncthreads();
  Element* o = static_cast<Element*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride;
#pragma unroll
  for (int i = 0; i < kBlockM * kChunks / Tr::kNThreads; ++i) {
    const int idx = i * Tr::kNThreads + tid;
    const int r = idx / kChunks, c = idx % kChunks;
    if (m0 + r < p.lq && c * 8 < p.dv) {
      *reinterpret_cast<uint4*>(o + int64_t(m0 + r) * p.o_row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(smem_o + swz<kChunks>(r, c));
    }
  }
#else
  __trap();  // built for an architecture without bf16 mma.sync: the launcher never gets here
#endif
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

namespace cuda {

template <typename Tr>
cudaError_t launch_flash_fwd(const AttnFwdParams& params, cudaStream_t stream) {
  const int64_t grid = num_ctas<Tr::kBlockM>(params);
  if (grid == 0) return cudaSuccess;
  if (grid > INT_MAX) return cudaErrorInvalidConfiguration;
  auto kernel = flash_fwd_kernel<Tr>;
  SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  kernel<<<unsigned(grid), Tr::kNThreads, Tr::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace cuda

template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_flash_fwd_(const AttnFwdParams& params, const FlashPlan& plan, cudaStream_t stream) {
  // Block-sparse masks of 64-row query blocks run 64-row tiles; everything else 128-row ones.
  if constexpr (kVariant == Variant::kBlockSparse) {
    if (plan.tile.block_m == 64)
      return cuda::launch_flash_fwd<cuda::FlashFwdTraits<kDtype, kHeadDim, kVariant, 64>>(params, stream);
  }
  if (plan.tile.block_m != 128) return cudaErrorInvalidValue;  // a tile no instantiation holds
  return cuda::launch_flash_fwd<cuda::FlashFwdTraits<kDtype, kHeadDim, kVariant, 128>>(params, stream);
}

}  // namespace sparse_attn
