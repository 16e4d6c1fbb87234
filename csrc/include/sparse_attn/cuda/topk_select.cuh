// Dynamic top-k selection on CUDA. Scores come from the tensor-core scorer (topk_score.cuh) when
// the plan says so (plan_select), else from CUDA-core loops here; attention over the selection is
// gather_fwd.cuh's.
//
// Selection, one CTA per query row: the row's scores against its visible keys are in a global
// workspace row (the workspace holds a bounded chunk of rows, never B * H * Lq * Lk), and
// radix_select (radix_select.cuh) writes the k largest, ascending, ties to the lower index, NaN
// ranking above everything (it must propagate, not be dropped). A row that sees at most k keys
// takes them all without scoring.
#pragma once

#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/element.cuh"
#include "sparse_attn/cuda/radix_select.cuh"
#include "sparse_attn/cuda/topk.h"

namespace sparse_attn::cuda {

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

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype>
cudaError_t run_topk_select_(const TopkSelectParams& params, int64_t rows, cudaStream_t stream) {
  using T = typename cuda::ElementOf<kDtype>::type;
  if (rows <= 0) return cudaSuccess;
  if (rows > INT_MAX) return cudaErrorInvalidConfiguration;
  const size_t smem = sizeof(cuda::SelectSmem) +
                      sizeof(float) * (params.indexer ? size_t(params.hi) * params.di + params.hi : params.d);
  auto kernel = cuda::topk_select_kernel<T>;
  SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<unsigned(rows), cuda::kSelectThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace sparse_attn
