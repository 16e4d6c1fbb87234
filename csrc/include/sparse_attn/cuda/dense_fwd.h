// The naive dense baseline on CUDA: S = scale * Q K^T (cuBLAS, fp32 out), a row softmax kernel
// (mask, causal, LSE) writing P in the input dtype, then O = P V (cuBLAS).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "sparse_attn/params.h"

namespace sparse_attn {

// Bytes of workspace per score element: S in fp32 plus P in the input dtype.
constexpr int dense_workspace_bytes_per_score(ScalarKind dtype) {
  return 4 + (dtype == ScalarKind::kFloat32 ? 4 : 2);
}

// params.scores (fp32) and params.probs (dtype) hold B * H * Lq * Lk elements each.
// Returns cudaSuccess, or the first failure (a cuBLAS failure maps to cudaErrorUnknown and sets
// *cublas_status).
template <ScalarKind kDtype>
cudaError_t run_dense_fwd_(const AttnFwdParams& params, cublasHandle_t handle, cudaStream_t stream,
                           cublasStatus_t* cublas_status);

}  // namespace sparse_attn
