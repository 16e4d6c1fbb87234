// Dynamic top-k on CUDA: selection, and attention over the gathered keys. Scores come from the
// tensor-core scorer (topk_score.cuh) when the inputs suit it, else from CUDA-core loops here;
// attention runs on the tensor cores (topk_gather.cuh) for 16-bit inputs with D = Dv <= 128,
// else one warp per query row here.
//
// Selection, one CTA per query row: the row's scores against its visible keys are in a global
// workspace row (the workspace holds a bounded chunk of rows, never B * H * Lq * Lk), and
// radix_select (radix_select.cuh) writes the k largest, ascending, ties to the lower index, NaN
// ranking above everything (it must propagate, not be dropped). A row that sees at most k keys
// takes them all without scoring.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/radix_select.cuh"
#include "sparse_attn/cuda/topk.h"
#include "sparse_attn/cuda/topk_gather.cuh"

namespace sparse_attn::cuda {

template <ScalarKind kDtype> struct TopkElement { using type = float; };
template <> struct TopkElement<ScalarKind::kBFloat16> { using type = __nv_bfloat16; };
template <> struct TopkElement<ScalarKind::kFloat16> { using type = __half; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T>
__global__ void __launch_bounds__(kSelectThreads) topk_select_kernel(__grid_constant__ const TopkSelectParams p) {
  // The selection's state, then the query of the CUDA-core scoring (exact: D floats; indexer:
  // HI * DI + HI floats).
  extern __shared__ __align__(16) char select_smem[];
  SelectSmem& sm = *reinterpret_cast<SelectSmem*>(select_smem);
  float* query_smem = reinterpret_cast<float*>(select_smem + sizeof(SelectSmem));

  int64_t row;  // over (B, Hs, Lq)
  if (p.prescored) {
    const int64_t tile = p.tile_begin + blockIdx.x / 64;
    const int i0 = int(tile % p.n_qtiles) * 64 + int(blockIdx.x % 64);
    if (i0 >= p.lq) return;  // the last tile of a (b, hs) plane is ragged
    row = tile / p.n_qtiles * p.lq + i0;
  } else {
    row = p.row_begin + blockIdx.x;
  }
  const int i = int(row % p.lq), hs = int((row / p.lq) % p.h_sel), b = int(row / (int64_t(p.lq) * p.h_sel));
  float* s = p.scores + int64_t(blockIdx.x) * p.scores_stride;
  int32_t* out = p.out + row * p.topk;
  int nv = p.lk;
  if (p.causal) {
    const int64_t last = int64_t(i) + p.kv_offset + 1;
    nv = int(last < 0 ? 0 : (last > p.lk ? p.lk : last));
  }
  const int kk = p.topk < nv ? p.topk : nv;
  if (kk == nv) {  // every visible key (or none): no scores needed
    for (int x = threadIdx.x; x < p.topk; x += kSelectThreads) out[x] = x < kk ? x : -1;
    return;
  }

  // 1. Scores of the visible keys, unless topk_score wrote them already.
  if (!p.prescored && p.indexer) {
    const T* iq = static_cast<const T*>(p.iq) + b * p.iq_batch_stride + int64_t(i) * p.iq_row_stride;
    const T* iw = static_cast<const T*>(p.iw) + b * p.iw_batch_stride + int64_t(i) * p.iw_row_stride;
    for (int x = threadIdx.x; x < p.hi * p.di; x += kSelectThreads)
      query_smem[x] = to_f32(iq[(x / p.di) * p.iq_head_stride + x % p.di]);
    for (int x = threadIdx.x; x < p.hi; x += kSelectThreads) query_smem[p.hi * p.di + x] = to_f32(iw[x]);
    __syncthreads();
    for (int j = threadIdx.x; j < nv; j += kSelectThreads) {
      const T* kr = static_cast<const T*>(p.ik) + b * p.ik_batch_stride + int64_t(j) * p.ik_row_stride;
      float acc = 0.f;
      for (int hh = 0; hh < p.hi; ++hh) {
        float dot = 0.f;
        for (int d = 0; d < p.di; ++d) dot = fmaf(query_smem[hh * p.di + d], to_f32(kr[d]), dot);
        acc = fmaf(query_smem[p.hi * p.di + hh], fmaxf(dot, 0.f), acc);
      }
      s[j] = acc;
    }
  } else if (!p.prescored) {
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + hs * p.q_head_stride + int64_t(i) * p.q_row_stride;
    const int hk = hs / p.h_per_kv;
    for (int d = threadIdx.x; d < p.d; d += kSelectThreads) query_smem[d] = to_f32(q[d]);
    __syncthreads();
    for (int j = threadIdx.x; j < nv; j += kSelectThreads) {
      const T* kr = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride + int64_t(j) * p.k_row_stride;
      float dot = 0.f;
      for (int d = 0; d < p.d; ++d) dot = fmaf(query_smem[d], to_f32(kr[d]), dot);
      s[j] = dot;
    }
  }
  __syncthreads();

  // 2. Selection (radix_select.cuh).
  radix_select(s, nv, kk, out, sm);
  for (int x = kk + threadIdx.x; x < p.topk; x += kSelectThreads) out[x] = -1;
}

// ---------------------------------------------------------------------------------------------
constexpr int kGatherWarps = 4;
constexpr int kGatherDimPerLane = 8;  // 256 / 32

__device__ __forceinline__ float gather_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float gather_warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// One warp per query row; lanes split the head dimension; keys are visited 32 at a time, lane u
// holding the u-th key's score, with the online softmax of the flash kernels.
template <typename T>
__global__ void __launch_bounds__(kGatherWarps * 32) gather_fwd_kernel(__grid_constant__ const AttnFwdParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kGatherWarps + warp;  // over (B, H, Lq)
  if (row >= int64_t(p.b) * p.h * p.lq) return;
  const int i = int(row % p.lq), h = int((row / p.lq) % p.h), b = int(row / (int64_t(p.lq) * p.h));
  const int hk = h / p.h_per_kv;
  const int32_t* idx =
      p.indices + b * p.idx_batch_stride + (h / p.h_per_idx) * p.idx_head_stride + int64_t(i) * p.idx_row_stride;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + int64_t(i) * p.q_row_stride;
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
      dot = gather_warp_sum(dot);
      if (lane == u) s = dot;
    }
    if (!valid) s = -INFINITY;
    const float m_new = fmaxf(m, gather_warp_max(s));  // NaN stays out of the max ...
    const float m_ref = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m - m_ref);
    const float pr = exp2f(s - m_ref);  // ... and reaches l and acc through exp2
    l = l * alpha + gather_warp_sum(pr);
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
  const float inv = l == 0.f ? 0.f : 1.f / l;
  T* o = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + int64_t(i) * p.o_row_stride;
#pragma unroll
  for (int x = 0; x < kGatherDimPerLane; ++x) {
    const float val = acc[x] * inv;
    if (lane + 32 * x < p.dv) {
      if constexpr (std::is_same_v<T, float>) o[lane + 32 * x] = val;
      else if constexpr (std::is_same_v<T, __nv_bfloat16>) o[lane + 32 * x] = __float2bfloat16(val);
      else o[lane + 32 * x] = __float2half(val);
    }
  }
  if (lane == 0)
    p.lse[(int64_t(b) * p.h + h) * p.lq + i] = l == 0.f ? -INFINITY : (m + log2f(l)) * 0.69314718055994530942f;
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype>
cudaError_t run_topk_select_(const TopkSelectParams& params, int64_t rows, cudaStream_t stream) {
  using T = typename cuda::TopkElement<kDtype>::type;
  if (rows <= 0) return cudaSuccess;
  if (rows > INT_MAX) return cudaErrorInvalidConfiguration;
  const size_t smem = sizeof(cuda::SelectSmem) +
                      sizeof(float) * (params.indexer ? size_t(params.hi) * params.di + params.hi : params.d);
  auto kernel = cuda::topk_select_kernel<T>;
  SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<unsigned(rows), cuda::kSelectThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

template <ScalarKind kDtype>
cudaError_t run_gather_fwd_(const AttnFwdParams& params, cudaStream_t stream) {
  if constexpr (kDtype != ScalarKind::kFloat32) {
    if (cuda::gather_mma_eligible(params))
      return params.d <= 64 ? cuda::run_gather_mma_<kDtype, 64>(params, stream)
                            : cuda::run_gather_mma_<kDtype, 128>(params, stream);
  }
  using T = typename cuda::TopkElement<kDtype>::type;
  const int64_t rows = int64_t(params.b) * params.h * params.lq;
  const int64_t blocks = (rows + cuda::kGatherWarps - 1) / cuda::kGatherWarps;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  cuda::gather_fwd_kernel<T><<<unsigned(blocks), cuda::kGatherWarps * 32, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace sparse_attn
