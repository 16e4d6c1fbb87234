// The pieces of the CUDA backward besides the tensor-core kernel (attn_bwd.h says the order):
// the preprocess and the CUDA-core backward that takes every
// dtype and head dim (fp32, D > 128, Dv != D) and top-k's gathered keys.
#pragma once

#include <cmath>
#include <cstdint>

#include "sparse_attn/cuda/attn_bwd.h"
#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/element.cuh"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/softmax_row.h"
#include "sparse_attn/tile_iter.h"

namespace sparse_attn::cuda {

constexpr int kBwdWarps = 4;            // warps per CTA of the preprocess and the CUDA-core kernel
constexpr int kMaxHeadDimKernel = 256;  // head dims the CUDA-core kernel holds a row of

// The padded (B * H, lq_pad) statistics: lse_log2 (+inf where the row saw no key or lies past Lq,
// so that its P is 0) and delta = dO . O - dLSE; kLanes lanes per row, each a 16-byte chunk of O and
// dO (Dv = kLanes chunks, 16-byte aligned rows), or (kLanes = 0) a warp per row reading elements.
template <typename T, int kLanes>
__global__ void __launch_bounds__(kBwdWarps * 32)
    bwd_preprocess_kernel(__grid_constant__ const AttnBwdParams bp) {
  const AttnFwdParams& p = bp.fwd;
  constexpr int kRowLanes = kLanes > 0 ? kLanes : 32, kRowsPerWarp = 32 / kRowLanes;
  const int lane = threadIdx.x % 32, sub = lane % kRowLanes;
  const int64_t row = (int64_t(blockIdx.x) * kBwdWarps + threadIdx.x / 32) * kRowsPerWarp + lane / kRowLanes;
  const bool in = row < int64_t(p.b) * p.h * bp.lq_pad;  // (every lane takes part in the shuffles)
  const int64_t bh = in ? row / bp.lq_pad : 0;
  const int i = in ? int(row % bp.lq_pad) : p.lq;
  float acc = 0.f;
  if (i < p.lq) {
    const int b = int(bh / p.h), h = int(bh % p.h);
    const T* o =
        static_cast<const T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + int64_t(i) * p.o_row_stride;
    const T* dout = static_cast<const T*>(bp.dout) + b * bp.do_batch_stride + h * bp.do_head_stride +
                    int64_t(i) * bp.do_row_stride;
    if constexpr (kLanes > 0) {
      constexpr int kE = 16 / sizeof(T);  // elements per chunk
      const uint4 ov = *reinterpret_cast<const uint4*>(o + sub * kE);
      const uint4 dv = *reinterpret_cast<const uint4*>(dout + sub * kE);
      const T* oe = reinterpret_cast<const T*>(&ov);
      const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int e = 0; e < kE; ++e) acc += to_f32(oe[e]) * to_f32(de[e]);
    } else {
      for (int c = lane; c < p.dv; c += 32) acc += to_f32(o[c]) * to_f32(dout[c]);
    }
  }
#pragma unroll
  for (int off = kRowLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (!in || sub != 0) return;
  float lse2 = INFINITY, delta = 0.f;
  if (i < p.lq) {
    const int64_t r = bh * p.lq + i;
    delta = acc - (bp.dlse != nullptr ? bp.dlse[r] : 0.f);
    const float lse = p.lse[r];
    lse2 = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
  }
  bp.lse_log2[row] = lse2;
  bp.delta[row] = delta;
}

// One warp per query row: dQ of the row in registers (lane c holds columns c, c + 32, ...), dK and
// dV added to fp32 accumulators. Keys are handled 32 at a time, lane j scoring key j; then each
// visible key's contributions are made lane-parallel over the head dim.
template <typename T, Variant kVariant, bool kGather>
__global__ void __launch_bounds__(kBwdWarps * 32)
    attn_bwd_simt_kernel(__grid_constant__ const AttnBwdParams bp) {
  constexpr int kMaxCols = kMaxHeadDimKernel / 32;
  const AttnFwdParams& p = bp.fwd;
  __shared__ float sq[kBwdWarps][kMaxHeadDimKernel], sdo[kBwdWarps][kMaxHeadDimKernel];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kBwdWarps + warp;
  if (row >= int64_t(p.b) * p.h * p.lq) return;
  const int i = int(row % p.lq);
  const int64_t bh = row / p.lq;
  const int b = int(bh / p.h), h = int(bh % p.h), hk = h / p.h_per_kv;
  const float lse2 = bp.lse_log2[bh * bp.lq_pad + i], delta = bp.delta[bh * bp.lq_pad + i];
  T* dq_out = static_cast<T*>(bp.dq) + row * p.d;
  float dq[kMaxCols];
#pragma unroll
  for (int c = 0; c < kMaxCols; ++c) dq[c] = 0.f;

  if (lse2 != INFINITY) {  // a row that saw no key has no gradient
    const T* q =
        static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + int64_t(i) * p.q_row_stride;
    const T* dout = static_cast<const T*>(bp.dout) + b * bp.do_batch_stride + h * bp.do_head_stride +
                    int64_t(i) * bp.do_row_stride;
    for (int c = lane; c < p.d; c += 32) sq[warp][c] = to_f32(q[c]);
    for (int c = lane; c < p.dv; c += 32) sdo[warp][c] = to_f32(dout[c]);
    __syncwarp();
    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
    float* dk = bp.dk_accum + (int64_t(b) * p.h_kv + hk) * p.lk * p.d;
    float* dv = bp.dv_accum + (int64_t(b) * p.h_kv + hk) * p.lk * p.dv;

    // Lane's key j (visible or not): its P and dS, then every visible key of the 32 in turn.
    auto keys32 = [&](int j, bool vis) {
      float pj = 0.f, dsj = 0.f;
      if (vis) {
        const T* kr = k + int64_t(j) * p.k_row_stride;
        const T* vr = v + int64_t(j) * p.v_row_stride;
        float s = 0.f, dp = 0.f;
        for (int c = 0; c < p.d; ++c) s += sq[warp][c] * to_f32(kr[c]);
        for (int c = 0; c < p.dv; ++c) dp += sdo[warp][c] * to_f32(vr[c]);
        pj = exp2f(s * p.scale_log2 - lse2);
        dsj = pj != 0.f ? pj * (dp - delta) : 0.f;
      }
      unsigned todo = __ballot_sync(0xffffffffu, vis);
      while (todo != 0u) {
        const int src = __ffs(todo) - 1;
        todo &= todo - 1u;
        const int jj = __shfl_sync(0xffffffffu, j, src);
        const float pp = __shfl_sync(0xffffffffu, pj, src), ds = __shfl_sync(0xffffffffu, dsj, src);
        const T* kr = k + int64_t(jj) * p.k_row_stride;
#pragma unroll
        for (int c = 0; c < kMaxCols; ++c) {
          const int col = lane + 32 * c;
          if (col < p.d) {
            dq[c] += ds * to_f32(kr[col]);
            atomicAdd(dk + int64_t(jj) * p.d + col, ds * p.scale * sq[warp][col]);
          }
          if (col < p.dv) atomicAdd(dv + int64_t(jj) * p.dv + col, pp * sdo[warp][col]);
        }
      }
    };

    if constexpr (kGather) {
      const int32_t* idx = p.indices + b * p.idx_batch_stride + (h / p.h_per_idx) * p.idx_head_stride +
                           int64_t(i) * p.idx_row_stride;
      for (int base = 0; base < p.topk; base += 32) {
        const int e = base + lane;
        const int j = e < p.topk ? idx[e] : -1;
        keys32(j, j >= 0 && j < p.lk);
      }
    } else {
      using Tiles = typename TilesOf<kVariant, 1, 32>::type;
      const Tiles tiles(p, b, h, i);
      for (int it = 0; it < tiles.num_tiles(); ++it) {
        const int j = tiles.n_block(it) * 32 + lane;
        const uint64_t bits = tiles.tile_needs_mask(it) ? tiles.visible_bits(it, i) : ~uint64_t(0);
        keys32(j, j < p.lk && ((bits >> lane) & 1u));
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxCols; ++c) {
    const int col = lane + 32 * c;
    if (col < p.d) dq_out[col] = from_f32<T>(dq[c] * p.scale);
  }
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype>
cudaError_t run_bwd_preprocess_(const AttnBwdParams& params, cudaStream_t stream) {
  using T = typename cuda::ElementOf<kDtype>::type;
  const AttnFwdParams& p = params.fwd;
  // 16-byte chunks where every row of O and dO starts 16-byte aligned and holds 8, 16 or 32 of them.
  constexpr int kE = 16 / sizeof(T);
  const auto aligned = [](const void* base, int64_t b, int64_t h, int64_t r) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (b | h | r) % kE == 0;
  };
  const int lanes = p.dv % kE == 0 && (p.dv / kE == 8 || p.dv / kE == 16 || p.dv / kE == 32) ? p.dv / kE : 0;
  const bool vec = lanes > 0 && aligned(p.o, p.o_batch_stride, p.o_head_stride, p.o_row_stride) &&
                   aligned(params.dout, params.do_batch_stride, params.do_head_stride, params.do_row_stride);
  const int64_t rows = int64_t(p.b) * p.h * params.lq_pad;
  const int64_t rows_per_cta = cuda::kBwdWarps * (vec ? 32 / lanes : 1);
  const int64_t grid = (rows + rows_per_cta - 1) / rows_per_cta;
  if (grid == 0) return cudaSuccess;
  if (grid > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 g{unsigned(grid)}, b{unsigned(cuda::kBwdWarps * 32)};
  if (!vec)
    cuda::bwd_preprocess_kernel<T, 0><<<g, b, 0, stream>>>(params);
  else if (lanes == 8)
    cuda::bwd_preprocess_kernel<T, 8><<<g, b, 0, stream>>>(params);
  else if (lanes == 16)
    cuda::bwd_preprocess_kernel<T, 16><<<g, b, 0, stream>>>(params);
  else
    cuda::bwd_preprocess_kernel<T, 32><<<g, b, 0, stream>>>(params);
  return cudaGetLastError();
}

template <ScalarKind kDtype, Variant kVariant, bool kGather>
cudaError_t run_attn_bwd_simt_(const AttnBwdParams& params, cudaStream_t stream) {
  if (params.fwd.d > cuda::kMaxHeadDimKernel || params.fwd.dv > cuda::kMaxHeadDimKernel)
    return cudaErrorInvalidValue;
  const int64_t rows = int64_t(params.fwd.b) * params.fwd.h * params.fwd.lq;
  const int64_t grid = (rows + cuda::kBwdWarps - 1) / cuda::kBwdWarps;
  if (grid == 0) return cudaSuccess;
  if (grid > INT32_MAX) return cudaErrorInvalidConfiguration;
  cuda::attn_bwd_simt_kernel<typename cuda::ElementOf<kDtype>::type, kVariant, kGather>
      <<<unsigned(grid), cuda::kBwdWarps * 32, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace sparse_attn
