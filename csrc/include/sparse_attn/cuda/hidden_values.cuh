// A row's output depends only on the keys it can see (DESIGN), also when a key it cannot see holds
// NaN or Inf in its value. In a masked key tile the tensor cores form P V with P = 0 for a hidden
// key, and 0 x NaN = 0 x Inf = NaN, so such a value would reach every row of the tile. The flash
// kernels keep their main loops as they are and check their output instead: NaN propagates
// through every sum, so a row whose output came out finite received no such term and is exact. A
// row whose output is not finite (rare: a non-finite value it sees or one it cannot see, or an
// output past the 16-bit range) is computed again by its warp on the CUDA cores, from the row's
// LSE (the scores alone decide it: hidden scores are -inf before any product with V) over exactly
// the keys the iterator says the row sees. A visible NaN or Inf still propagates, a hidden one
// adds nothing, a row that sees nothing is 0. The check costs one 16-bit FMA per two outputs; the
// recomputation is slow (a right-padded batch with NaN in every padded key, so that every row of
// the padded sequences is computed again: 7-36x the clean time on the H100). Used by the mma.sync
// kernel (flash_fwd.cuh, in its epilogue) and by the Hopper kernel at head dims 64 and 128
// (flash_fwd_sm90.cuh, after its last tile; docs/PERF_LOG.md, "hidden values").
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "sparse_attn/cuda/element.cuh"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/params.h"
#include "sparse_attn/tile_iter.h"

namespace sparse_attn::cuda {

// probe + packed x 0 on both 16-bit halves: 0 while every value folded in is finite, NaN once
// one is not. Inline PTX, so that the compiler cannot fold x x 0 away.
template <ScalarKind kDtype>
__device__ __forceinline__ uint32_t probe_nonfinite(uint32_t probe, uint32_t packed) {
  uint32_t r;
  if constexpr (kDtype == ScalarKind::kBFloat16)
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(packed), "r"(0u), "r"(probe));
  else
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(packed), "r"(0u), "r"(probe));
  return r;
}

__device__ __forceinline__ bool probe_hit(uint32_t probe) { return (probe & 0x7fff7fffu) != 0u; }

// The two 16-bit values of a packed pair (lower address first) in fp32.
template <typename Element>
__device__ __forceinline__ void unpack2(uint32_t w, float& lo, float& hi) {
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  } else {
    __half2 v;
    memcpy(&v, &w, 4);
    const float2 f = __half22float2(v);
    lo = f.x;
    hi = f.y;
  }
}

// The exact output of query `row` of (b, h) in fp32, computed by the whole warp over the keys
// that `tiles` (the row's query tile) says it sees; lse: the row's natural-log LSE from the main
// loop. Lane l returns columns 2 (l + 32 c) and 2 (l + 32 c) + 1 in out[c]. 32 keys at a time:
// each lane scores one key (its K row and the Q row in 16-byte loads), then the warp adds the
// visible keys' p V over coalesced rows of V. Only for rows whose output was not finite.
template <typename Element, int kHeadDim, int kBlockN, typename Tiles>
__device__ __forceinline__ void exact_row(const AttnFwdParams& p, const Tiles& tiles, int b, int h, int row,
                                          float lse, float (&out)[kHeadDim / 64][2]) {
  constexpr int kPairs = kHeadDim / 64;
  static_assert(kBlockN % 32 == 0);
  const int lane = threadIdx.x % 32, hk = h / p.h_per_kv;
  const Element* qr = static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                      int64_t(row) * p.q_row_stride;
  const Element* kh = static_cast<const Element*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const Element* vh = static_cast<const Element*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
#pragma unroll
  for (int c = 0; c < kPairs; ++c) out[c][0] = out[c][1] = 0.f;
  if (lse == -INFINITY) return;  // the row sees no key
  const float lse2 = lse * float(M_LOG2E);
  const int n_tiles = tiles.num_tiles();
#pragma unroll 1
  for (int it = 0; it < n_tiles; ++it) {
    const int64_t n0 = int64_t(tiles.n_block(it)) * kBlockN;
    const bool need = tiles.tile_needs_mask(it);
#pragma unroll 1
    for (int col0 = 0; col0 < kBlockN; col0 += 32) {
      uint32_t word = need ? uint32_t(tiles.visible_bits(it, row, col0 & ~63) >> (col0 & 32)) : ~0u;
      float pr = 0.f;
      if ((word >> lane) & 1u) {
        // Rows are 16-byte aligned and D is a multiple of 8 (the launchers' contract).
        const Element* kr = kh + (n0 + col0 + lane) * p.k_row_stride;
        float dot = 0.f;
#pragma unroll 1
        for (int c = 0; c < p.d; c += 8) {
          const uint4 kv = __ldg(reinterpret_cast<const uint4*>(kr + c));
          const uint4 qv = __ldg(reinterpret_cast<const uint4*>(qr + c));
          const uint32_t kw[4] = {kv.x, kv.y, kv.z, kv.w}, qw[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float k0, k1, q0, q1;
            unpack2<Element>(kw[e], k0, k1);
            unpack2<Element>(qw[e], q0, q1);
            dot += q0 * k0 + q1 * k1;
          }
        }
        pr = exp2f(dot * p.scale_log2 - lse2);
      }
#pragma unroll 1
      while (word != 0u) {
        const int j = __ffs(word) - 1;
        word &= word - 1;
        const float pj = __shfl_sync(0xffffffffu, pr, j);
        const Element* vr = vh + (n0 + col0 + j) * p.v_row_stride;
#pragma unroll
        for (int c = 0; c < kPairs; ++c) {
          const int col = 2 * (lane + 32 * c);
          if (col < p.dv) {
            float v0, v1;
            unpack2<Element>(__ldg(reinterpret_cast<const unsigned int*>(vr + col)), v0, v1);
            out[c][0] += pj * v0;
            out[c][1] += pj * v1;
          }
        }
      }
    }
  }
}

// The rows of a warp's m16 tile whose output was not finite, computed again: bad0 and bad1 are
// the warp's ballots of probe_hit for rows g and g + 8 (a row's values, and so its probes, lie
// in lanes 4 g .. 4 g + 3). Each row is computed by exact_row with the iterator
// Tiles(p, b, h, m_block) of its query tile and its LSE as the main loop wrote it to p.lse, then
// written through write(r, col, packed): r < 16 the row within the m16 tile, col an even column
// < Dv. row16: the query row of r = 0. Rows past Lq are skipped. Called by the whole warp.
template <ScalarKind kDtype, int kHeadDim, int kBlockN, typename Tiles, typename Write>
__device__ __forceinline__ void recompute_rows(const AttnFwdParams& p, int b, int h, int m_block, int row16,
                                               uint32_t bad0, uint32_t bad1, Write&& write) {
  using Element = typename ElementOf<kDtype>::type;
  const int lane = threadIdx.x % 32;
  const Tiles tiles(p, b, h, m_block);
  __syncwarp();  // the lanes' staged values and LSEs are written before a row is rewritten
#pragma unroll 1
  for (int r = 0; r < 16; ++r) {
    const uint32_t bad = r < 8 ? bad0 : bad1;
    if (((bad >> (4 * (r % 8))) & 0xfu) == 0u || row16 + r >= p.lq) continue;
    const float lse = p.lse[(int64_t(b) * p.h + h) * p.lq + row16 + r];
    float out[kHeadDim / 64][2];
    exact_row<Element, kHeadDim, kBlockN>(p, tiles, b, h, row16 + r, lse, out);
#pragma unroll
    for (int c = 0; c < kHeadDim / 64; ++c) {
      const int col = 2 * (lane + 32 * c);
      if (col < p.dv) write(r, col, pack2<kDtype>(out[c][0], out[c][1]));
    }
  }
  __syncwarp();
}

}  // namespace sparse_attn::cuda
