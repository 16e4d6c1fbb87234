// Element types of the CUDA kernels: the storage type of each ScalarKind, and conversions between
// it and the fp32 the kernels compute in.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "sparse_attn/params.h"

namespace sparse_attn::cuda {

template <ScalarKind kDtype>
struct ElementOf;
template <>
struct ElementOf<ScalarKind::kFloat32> {
  using type = float;
};
template <>
struct ElementOf<ScalarKind::kBFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct ElementOf<ScalarKind::kFloat16> {
  using type = __half;
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half(x);
}

}  // namespace sparse_attn::cuda
