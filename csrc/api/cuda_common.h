// Helpers shared by the CUDA glue files. Needs only the CUDA runtime and c10/cuda headers.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

namespace sparse_attn {

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

inline void check_cuda(const at::Tensor& query) {
  TORCH_CHECK(query.is_cuda(), "expected CUDA tensors, got ", query.device());
  int major = 0, minor = 0;
  check_launch(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, query.get_device()),
               "cudaDeviceGetAttribute");
  check_launch(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, query.get_device()),
               "cudaDeviceGetAttribute");
  TORCH_CHECK(major >= 8, "sparse_attn's CUDA kernels need compute capability 8.0 or newer, got ", major, ".",
              minor);
}

}  // namespace sparse_attn
