// Attention over gathered keys (top-k attention given its selection): softmax over each query's
// listed keys (params.indices, -1 or out of range = none) of scale * q.k, times V. On Hopper's
// wgmma (gather_wgmma.cuh, 64 heads sharing a selection), the mma.sync tensor cores
// (gather_mma.cuh) or the CUDA cores (here, one warp per query row), as plan_gather says.
#pragma once

#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/element.cuh"
#include "sparse_attn/cuda/gather_fwd.h"
#include "sparse_attn/cuda/gather_mma.cuh"
#include "sparse_attn/cuda/gather_wgmma.cuh"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/softmax_row.h"

namespace sparse_attn::cuda {

constexpr int kGatherWarps = 4;
constexpr int kGatherDimPerLane = 8;  // 256 / 32

// One warp per query row; lanes split the head dimension; keys are visited 32 at a time, lane u
// holding the u-th key's score, with the online softmax of the flash kernels.
template <typename T>
__global__ void __launch_bounds__(kGatherWarps * 32)
    gather_fwd_kernel(__grid_constant__ const AttnFwdParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kGatherWarps + warp;  // over (B, H, Lq)
  if (row >= int64_t(p.b) * p.h * p.lq) return;
  const int i = int(row % p.lq), h = int((row / p.lq) % p.h), b = int(row / (int64_t(p.lq) * p.h));
  const int hk = h / p.h_per_kv;
  const int32_t* idx = p.indices + b * p.idx_batch_stride + (h / p.h_per_idx) * p.idx_head_stride +
                       int64_t(i) * p.idx_row_stride;
  const T* q =
      static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + int64_t(i) * p.q_row_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;

  float qv[kGatherDimPerLane], acc[kGatherDimPerLane];
#pragma unroll
  for (int x = 0; x < kGatherDimPerLane; ++x) {
    const int d = lane + 32 * x;
    qv[x] = d < p.d ? to_f32(q[d]) * p.scale_log2 : 0.f;
    acc[x] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int t0 = 0; t0 < p.topk; t0 += 32) {
    const int jl = t0 + lane < p.topk ? idx[t0 + lane] : -1;
    const bool valid = jl >= 0 && jl < p.lk;
    float s = -INFINITY;
    for (int u = 0; u < 32 && t0 + u < p.topk; ++u) {
      const int j = __shfl_sync(0xffffffffu, jl, u);
      if (j < 0 || j >= p.lk) continue;  // warp-uniform
      const T* kr = k + int64_t(j) * p.k_row_stride;
      float dot = 0.f;
#pragma unroll
      for (int x = 0; x < kGatherDimPerLane; ++x)
        if (lane + 32 * x < p.d) dot = fmaf(qv[x], to_f32(kr[lane + 32 * x]), dot);
      dot = warp_sum(dot);
      if (lane == u) s = dot;
    }
    if (!valid) s = -INFINITY;
    const float m_new = fmaxf(m, warp_max(s));  // NaN stays out of the max ...
    const float m_ref = softmax_ref(m_new);
    const float alpha = exp2f(m - m_ref);
    const float pr = exp2f(s - m_ref);  // ... and reaches l and acc through exp2
    l = l * alpha + warp_sum(pr);
    m = m_new;
#pragma unroll
    for (int x = 0; x < kGatherDimPerLane; ++x) acc[x] *= alpha;
    for (int u = 0; u < 32 && t0 + u < p.topk; ++u) {
      const int j = __shfl_sync(0xffffffffu, jl, u);
      const float pu = __shfl_sync(0xffffffffu, pr, u);
      if (j < 0 || j >= p.lk) continue;
      const T* vr = v + int64_t(j) * p.v_row_stride;
#pragma unroll
      for (int x = 0; x < kGatherDimPerLane; ++x)
        if (lane + 32 * x < p.dv) acc[x] = fmaf(pu, to_f32(vr[lane + 32 * x]), acc[x]);
    }
  }
  const float inv = row_inv(l);
  T* o = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + int64_t(i) * p.o_row_stride;
#pragma unroll
  for (int x = 0; x < kGatherDimPerLane; ++x) {
    if (lane + 32 * x < p.dv) o[lane + 32 * x] = from_f32<T>(acc[x] * inv);
  }
  if (lane == 0) p.lse[(int64_t(b) * p.h + h) * p.lq + i] = row_lse(m, l);
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype>
cudaError_t run_gather_fwd_(const AttnFwdParams& params, const GatherPlan& plan, cudaStream_t stream) {
  if constexpr (kDtype != ScalarKind::kFloat32) {
    if (plan.core == Core::kHopper)
      return plan.head_dim == 64 ? cuda::run_gather_wgmma_<kDtype, 64>(params, stream)
                                 : cuda::run_gather_wgmma_<kDtype, 128>(params, stream);
    if (plan.core == Core::kPortable)
      return plan.head_dim == 64 ? cuda::run_gather_mma_<kDtype, 64>(params, plan.group, plan.shared_stages, stream)
                                 : cuda::run_gather_mma_<kDtype, 128>(params, plan.group, plan.shared_stages, stream);
  }
  using T = typename cuda::ElementOf<kDtype>::type;
  const int64_t rows = int64_t(params.b) * params.h * params.lq;
  const int64_t blocks = (rows + cuda::kGatherWarps - 1) / cuda::kGatherWarps;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  cuda::gather_fwd_kernel<T><<<unsigned(blocks), cuda::kGatherWarps * 32, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace sparse_attn
