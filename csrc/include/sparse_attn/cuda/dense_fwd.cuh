// Deliberately the paper's three steps, each a separate pass over device memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/dense_fwd.h"
#include "sparse_attn/cuda/element.cuh"
#include "sparse_attn/tile_iter.h"

namespace sparse_attn::cuda {

constexpr int kSoftmaxThreads = 256;

// Running (max, sum of exp) pair; merges stay exact for -inf entries.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, a.s + b.s};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

// Score j of row (b, h, i) after the causal/band test and the user mask; -inf when hidden.
__device__ __forceinline__ float masked_score(const AttnFwdParams& p, const float* s, int64_t mask_base, int i,
                                              int j) {
  if (!window_visible(i, j, p.kv_offset, p.window_left, p.window_right)) return -INFINITY;
  float x = s[j];
  if (p.mask_kind == DenseMaskKind::kBool) {
    if (!static_cast<const uint8_t*>(p.attn_mask)[mask_base + j]) x = -INFINITY;
  } else if (p.mask_kind == DenseMaskKind::kAdditive) {
    x += static_cast<const float*>(p.attn_mask)[mask_base + j];
  }
  return x;
}

// One CTA per score row: P = softmax(S row), LSE.
template <typename T>
__global__ void __launch_bounds__(kSoftmaxThreads) dense_softmax_kernel(__grid_constant__ const AttnFwdParams p) {
  const int64_t row = blockIdx.x;
  const int i = int(row % p.lq);
  const int h = int((row / p.lq) % p.h);
  const int b = int(row / (int64_t(p.lq) * p.h));
  const float* s = p.scores + row * p.lk;
  T* prob = static_cast<T*>(p.probs) + row * p.lk;
  const int64_t mask_base = int64_t(b) * p.mask_batch_stride + int64_t(h) * p.mask_head_stride +
                            int64_t(i) * p.mask_row_stride;

  MaxSum ms{-INFINITY, 0.f};
  bool nan = false;  // a NaN score is kept out of the max and turns the whole row (and LSE) NaN
  for (int j = threadIdx.x; j < p.lk; j += kSoftmaxThreads) {
    const float x = masked_score(p, s, mask_base, i, j);
    nan |= isnan(x);
    if (x != -INFINITY && !isnan(x)) ms = merge(ms, MaxSum{x, 1.f});
  }
  nan = __syncthreads_or(nan);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)};
    ms = merge(ms, other);
  }
  __shared__ MaxSum warp_ms[kSoftmaxThreads / 32];
  if (threadIdx.x % 32 == 0) warp_ms[threadIdx.x / 32] = ms;
  __syncthreads();
  ms = warp_ms[0];
#pragma unroll
  for (int w = 1; w < kSoftmaxThreads / 32; ++w) ms = merge(ms, warp_ms[w]);

  const bool empty = ms.s == 0.f && !nan;
  const float inv = empty ? 0.f : (nan ? NAN : 1.f / ms.s);
  for (int j = threadIdx.x; j < p.lk; j += kSoftmaxThreads) {
    const float x = masked_score(p, s, mask_base, i, j);
    prob[j] = from_f32<T>(empty ? 0.f : __expf(x - ms.m) * inv);
  }
  if (threadIdx.x == 0) p.lse[row] = empty ? -INFINITY : (nan ? NAN : ms.m + __logf(ms.s));
}

// Short rows (Lk <= 32 * kPerLane): one warp per row, the row held in registers, so S is read
// once and no barrier or shared memory is needed. Same semantics as dense_softmax_kernel.
constexpr int kSoftmaxWarpRows = 8;  // rows (warps) per CTA
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kSoftmaxWarpRows * 32) dense_softmax_warp_kernel(__grid_constant__ const AttnFwdParams p) {
  const int64_t row = int64_t(blockIdx.x) * kSoftmaxWarpRows + threadIdx.x / 32;
  if (row >= int64_t(p.b) * p.h * p.lq) return;
  const int lane = threadIdx.x % 32;
  const int i = int(row % p.lq);
  const int h = int((row / p.lq) % p.h);
  const int b = int(row / (int64_t(p.lq) * p.h));
  const float* s = p.scores + row * p.lk;
  T* prob = static_cast<T*>(p.probs) + row * p.lk;
  const int64_t mask_base = int64_t(b) * p.mask_batch_stride + int64_t(h) * p.mask_head_stride +
                            int64_t(i) * p.mask_row_stride;
  float x[kPerLane];
  float m = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    const int j = u * 32 + lane;
    x[u] = j < p.lk ? masked_score(p, s, mask_base, i, j) : -INFINITY;
    nan |= isnan(x[u]);
    m = x[u] > m ? x[u] : m;  // a NaN score stays out of the max and turns the row NaN
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  nan = __any_sync(0xffffffffu, nan);
  float sum = 0.f;
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    x[u] = x[u] == -INFINITY ? 0.f : __expf(x[u] - m);
    sum += x[u];
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const bool empty = sum == 0.f && !nan;
  const float inv = empty ? 0.f : (nan ? NAN : 1.f / sum);
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    const int j = u * 32 + lane;
    if (j < p.lk) prob[j] = from_f32<T>(x[u] * inv);
  }
  if (lane == 0) p.lse[row] = empty ? -INFINITY : (nan ? NAN : m + __logf(sum));
}

template <typename T>
cudaError_t launch_dense_softmax(const AttnFwdParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.b) * p.h * p.lq;
  const unsigned warp_blocks = unsigned((rows + kSoftmaxWarpRows - 1) / kSoftmaxWarpRows);
  if (p.lk <= 32 * 8) {
    dense_softmax_warp_kernel<T, 8><<<warp_blocks, kSoftmaxWarpRows * 32, 0, stream>>>(p);
  } else if (p.lk <= 32 * 32) {
    dense_softmax_warp_kernel<T, 32><<<warp_blocks, kSoftmaxWarpRows * 32, 0, stream>>>(p);
  } else if (p.lk <= 32 * 64) {
    dense_softmax_warp_kernel<T, 64><<<warp_blocks, kSoftmaxWarpRows * 32, 0, stream>>>(p);
  } else if (p.lk <= 32 * 128) {
    dense_softmax_warp_kernel<T, 128><<<warp_blocks, kSoftmaxWarpRows * 32, 0, stream>>>(p);
  } else {
    dense_softmax_kernel<T><<<unsigned(rows), kSoftmaxThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
struct CublasType;
template <> struct CublasType<float> { static constexpr cudaDataType_t value = CUDA_R_32F; };
template <> struct CublasType<__nv_bfloat16> { static constexpr cudaDataType_t value = CUDA_R_16BF; };
template <> struct CublasType<__half> { static constexpr cudaDataType_t value = CUDA_R_16F; };

// Row-major products through column-major cuBLAS: a row-major (r x c) matrix with row stride ld
// is the column-major (c x r) matrix with leading dimension ld.
template <typename T>
cudaError_t dense_fwd_impl(const AttnFwdParams& p, cublasHandle_t handle, cudaStream_t stream,
                           cublasStatus_t* status) {
  constexpr cudaDataType_t kType = CublasType<T>::value;
  // fp32 inputs get exact fp32 products (no TF32), as the contract promises for fp32.
  const cublasComputeType_t compute =
      kType == CUDA_R_32F ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  const int g = p.h_per_kv;
  const int64_t plane = int64_t(p.lq) * p.lk;
  const float one = 1.f, zero = 0.f, scale = p.scale;
  auto fail = [&](cublasStatus_t st) {
    *status = st;
    return cudaErrorUnknown;
  };
  *status = cublasSetStream(handle, stream);
  if (*status != CUBLAS_STATUS_SUCCESS) return cudaErrorUnknown;
  // 1. S^T (Lk x Lq) = K (Lk x D) Q^T (D x Lq), one batched call per (batch, member of a GQA group);
  //    the batch runs over the key heads.
  for (int b = 0; b < p.b; ++b) {
    for (int j = 0; j < g; ++j) {
      const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride;
      const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + j * p.q_head_stride;
      float* s = p.scores + (int64_t(b) * p.h + j) * plane;
      const cublasStatus_t st = cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_T, CUBLAS_OP_N, p.lk, p.lq, p.d, &scale, k, kType, int(p.k_row_stride),
          p.k_head_stride, q, kType, int(p.q_row_stride), g * p.q_head_stride, &zero, s, CUDA_R_32F, p.lk,
          g * plane, p.h_kv, compute, CUBLAS_GEMM_DEFAULT);
      if (st != CUBLAS_STATUS_SUCCESS) return fail(st);
    }
  }
  // 2. P = softmax(S) row by row.
  SA_CUDA_TRY(launch_dense_softmax<T>(p, stream));
  // 3. O^T (Dv x Lq) = V^T (Dv x Lk) P^T (Lk x Lq).
  for (int b = 0; b < p.b; ++b) {
    for (int j = 0; j < g; ++j) {
      const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride;
      const T* prob = static_cast<const T*>(p.probs) + (int64_t(b) * p.h + j) * plane;
      T* o = static_cast<T*>(p.o) + b * p.o_batch_stride + j * p.o_head_stride;
      const cublasStatus_t st = cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_N, CUBLAS_OP_N, p.dv, p.lq, p.lk, &one, v, kType, int(p.v_row_stride),
          p.v_head_stride, prob, kType, p.lk, g * plane, &zero, o, kType, int(p.o_row_stride),
          g * p.o_head_stride, p.h_kv, compute, CUBLAS_GEMM_DEFAULT);
      if (st != CUBLAS_STATUS_SUCCESS) return fail(st);
    }
  }
  return cudaSuccess;
}

template <ScalarKind kDtype> struct DenseElement { using type = float; };
template <> struct DenseElement<ScalarKind::kBFloat16> { using type = __nv_bfloat16; };
template <> struct DenseElement<ScalarKind::kFloat16> { using type = __half; };

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype>
cudaError_t run_dense_fwd_(const AttnFwdParams& params, cublasHandle_t handle, cudaStream_t stream,
                           cublasStatus_t* cublas_status) {
  if (int64_t(params.b) * params.h * params.lq == 0 || params.lk == 0) return cudaSuccess;
  return cuda::dense_fwd_impl<typename cuda::DenseElement<kDtype>::type>(params, handle, stream, cublas_status);
}

}  // namespace sparse_attn
