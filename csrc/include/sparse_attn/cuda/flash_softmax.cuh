// The online softmax of the flash kernels (mma.sync and wgmma cores alike): both hold a score
// tile S and the output O in registers in the m16n8 accumulator layout (a thread owns rows g and
// g + 8 of every 16-row tile, columns 8 * j + 2t and 8 * j + 2t + 1 of every n8 tile j), so one
// implementation serves both. Statistics are fp32, in log2 units.
#pragma once

#include <cmath>
#include <cstdint>

#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/softmax_row.h"

namespace sparse_attn::cuda {

// How far (log2 units) a tile's row max may exceed the running max before the running max moves,
// where a kernel keeps it lazily (softmax_fold_max's max_stale): the terms stay <= 2^8.
constexpr float kMaxStale = 8.f;

// S *= scale_log2 (raw scores to log2 units), for online_softmax.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void scale_scores(float (&s)[kMTiles][kNTiles][4], float scale_log2) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][ni][e] *= scale_log2;
}

// The max of each row of S over the tile (all four threads of the quad get it).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void tile_row_max(const float (&s)[kMTiles][kNTiles][4], float (&mx)[kMTiles][2]) {
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
}

// One online-softmax step over a scaled (scale_scores, then mask_scores) tile S in log2 units:
// the new running max, S replaced by exp2(S - max), the running sum rescaled and accumulated (per
// thread; the quad reduction of the sum is left to the epilogue), and alpha, the factor O must be
// rescaled by (rescale_o). The largest term of every row is exactly 1, at any magnitude. Phase by
// phase over all rows, so that the dependency chains of different rows interleave.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void online_softmax(float (&s)[kMTiles][kNTiles][4], float (&row_max)[kMTiles][2],
                                               float (&row_sum)[kMTiles][2], float (&alpha)[kMTiles][2]) {
  float mx[kMTiles][2], m_ref[kMTiles][2];
  tile_row_max(s, mx);
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m_new = fmaxf(row_max[mi][half], mx[mi][half]);
      // A row with nothing visible so far keeps m = -inf; exp2 then uses 0 as reference.
      m_ref[mi][half] = softmax_ref(m_new);
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

// P = exp2(S * e_scale - ref) packed to 16 bits in the A-operand layout of pack_p, and its row
// sums (per thread).
template <ScalarKind kDtype, int kMTiles, int kNTiles>
__device__ __forceinline__ void exp_pack(const float (&s)[kMTiles][kNTiles][4], float e_scale,
                                         const float (&ref)[kMTiles][2],
                                         uint32_t (&pa)[kMTiles][kNTiles / 2][4], float (&sum)[kMTiles][2]) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) sum[mi][0] = sum[mi][1] = 0.f;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float p0 = exp2f(fmaf(s[mi][ni][2 * half], e_scale, -ref[mi][half]));
        const float p1 = exp2f(fmaf(s[mi][ni][2 * half + 1], e_scale, -ref[mi][half]));
        sum[mi][half] += p0 + p1;
        pa[mi][ni / 2][(ni % 2) * 2 + half] = pack2<kDtype>(p0, p1);
      }
}

// The online softmax with the scale folded into the exponent, for the kernels whose softmax
// competes with their GEMMs for issue slots: each exponent is one FFMA, fma(s, scale, -max),
// instead of a multiply and a subtraction. S holds the raw masked scores (scale_log2 * S is the
// log2-unit score) and stays intact; P goes to pa. Two halves, so that the caller can wait for
// other work in between: softmax_fold_max (the new running max) and softmax_fold_exp (P, alpha,
// the running sum).
//
// The max is taken over the raw scores and scaled once per row, rounded upward, so each exponent
// is exactly <= 0 and, for the row's largest score, >= -ulp(max): with |max| < 2^20 that is
// >= -1/8, so nothing overflows, the largest term stays >= 2^-1/8, and the shift the rounding
// introduces is common to the row's numerator and sum. Otherwise (a zero or negative scale, or
// magnitudes where one ulp of the max is no longer small: bf16 inputs of 133120, a zero or negative scale), the warp redoes
// the tile from S the way online_softmax does (scale first; masked entries stay -inf whatever the
// scale's sign). The check runs after the exponentials, so that it adds no latency to them.
//
// max_stale > 0 (log2 units, kMaxStale): the running max moves only when the tile's max exceeds it
// by more than max_stale, so alpha is exactly 1 in most tiles and the caller may skip the rescale
// of O (rescale_needed); the terms are then <= 2^max_stale instead of <= 1 (exponents <= max_stale
// + one rounding), which changes nothing but rounding: O and the sum carry the same factor, and
// fp32 and bf16 keep their relative precision at either size.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void softmax_fold_max(const float (&s)[kMTiles][kNTiles][4],
                                                 const float (&row_max)[kMTiles][2],
                                                 float (&m_new)[kMTiles][2], float scale_log2,
                                                 float max_stale = 0.f) {
  tile_row_max(s, m_new);
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m = __fmul_ru(m_new[mi][half], scale_log2);
      m_new[mi][half] = max_stale > 0.f ? (m > row_max[mi][half] + max_stale ? m : row_max[mi][half])
                                        : fmaxf(row_max[mi][half], m);
    }
}

template <ScalarKind kDtype, int kMTiles, int kNTiles>
__device__ __forceinline__ void softmax_fold_exp(float (&s)[kMTiles][kNTiles][4], float (&m_new)[kMTiles][2],
                                                 float (&row_max)[kMTiles][2], float (&row_sum)[kMTiles][2],
                                                 float (&alpha)[kMTiles][2],
                                                 uint32_t (&pa)[kMTiles][kNTiles / 2][4], float scale_log2) {
  float ref[kMTiles][2], sum[kMTiles][2];
  bool fold = scale_log2 > 0.f;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m = m_new[mi][half];
      fold = fold && m < 0x1p20f && (m > -0x1p20f || m == -INFINITY);
      ref[mi][half] = softmax_ref(m);
    }
  exp_pack<kDtype>(s, scale_log2, ref, pa, sum);
  if (!__all_sync(0xffffffffu, fold)) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[mi][ni][e] = s[mi][ni][e] == -INFINITY ? -INFINITY : s[mi][ni][e] * scale_log2;
    tile_row_max(s, m_new);
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        m_new[mi][half] = fmaxf(row_max[mi][half], m_new[mi][half]);
        ref[mi][half] = softmax_ref(m_new[mi][half]);
      }
    exp_pack<kDtype>(s, 1.f, ref, pa, sum);
  }
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      alpha[mi][half] = exp2f(row_max[mi][half] - ref[mi][half]);
      row_max[mi][half] = m_new[mi][half];
      row_sum[mi][half] = row_sum[mi][half] * alpha[mi][half] + sum[mi][half];
    }
}

// The state of a row block before its first tile: O = 0, running max -inf, running sum 0.
template <int kMTiles, int kDTiles>
__device__ __forceinline__ void softmax_start(float (&acc_o)[kMTiles][kDTiles][4],
                                              float (&row_max)[kMTiles][2], float (&row_sum)[kMTiles][2]) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int nd = 0; nd < kDTiles; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][nd][e] = 0.f;
    row_max[mi][0] = row_max[mi][1] = -INFINITY;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }
}

// Whether any row of the warp has alpha != 1 (warp-uniform, so that skipping the rescale does not
// diverge).
template <int kMTiles>
__device__ __forceinline__ bool rescale_needed(const float (&alpha)[kMTiles][2]) {
  bool any = false;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) any = any || alpha[mi][0] != 1.f || alpha[mi][1] != 1.f;
  return __any_sync(0xffffffffu, any);
}

template <int kMTiles, int kDTiles>
__device__ __forceinline__ void rescale_o(float (&acc_o)[kMTiles][kDTiles][4],
                                          const float (&alpha)[kMTiles][2]) {
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
__device__ __forceinline__ void pack_p(const float (&s)[kMTiles][kNTiles][4],
                                       uint32_t (&pa)[kMTiles][kNTiles / 2][4]) {
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
  lse = row_lse(row_max, l);
  return row_inv(l);
}

}  // namespace sparse_attn::cuda
