// CUDA backend of dense_attention: the naive baseline through cuBLAS (torch's handle, so the
// GEMMs use torch's workspace and stream).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>

#include "common.h"
#include "cuda_common.h"
#include "sparse_attn/cuda/dense_fwd.h"

namespace sparse_attn {
namespace {

// Free device memory as the caching allocator sees it: the driver's free memory plus blocks the
// allocator holds but does not use.
int64_t free_device_bytes(int device) {
  size_t free_b = 0, total_b = 0;
  check_launch(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return int64_t(free_b) + stats.reserved_bytes[agg].current - stats.allocated_bytes[agg].current;
}

std::tuple<at::Tensor, at::Tensor> dense_fwd_cuda(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value,
                                                  const c10::optional<at::Tensor>& attn_mask,
                                                  c10::optional<double> scale, bool causal) {
  const QkvShape s = check_qkv(query, key, value);
  if (attn_mask.has_value() && attn_mask->defined()) check_same_device(query, *attn_mask, "attn_mask");
  check_cuda(query);
  const c10::cuda::CUDAGuard guard(query.device());
  auto [out, lse] = alloc_outputs(query, s);
  AttnFwdParams params = set_params_fwd(query, key, value, out, lse, s, resolve_scale(scale, s.d));
  set_params_window(params, causal, -1, -1);
  at::Tensor mask = set_params_dense_mask(params, query, s, attn_mask);
  if (fill_trivial_outputs(s, out, lse)) return {out, lse};
  TORCH_CHECK(s.b * s.h * s.lq <= INT_MAX, "dense_attention: B*H*Lq must be below 2^31");
  const int64_t scores = s.b * s.h * s.lq * s.lk;
  const int64_t need = scores * dense_workspace_bytes_per_score(params.dtype);
  const int64_t avail = free_device_bytes(query.get_device());
  TORCH_CHECK_WITH(OutOfMemoryError, need <= avail, "dense_attention materialises the ", s.b, "x", s.h, "x", s.lq,
                   "x", s.lk, " score matrix and needs ", double(need) / (1 << 30), " GiB of workspace, but only ",
                   double(avail) / (1 << 30), " GiB of device memory is free; use flash_attention instead");
  at::Tensor ws_scores = at::empty({scores}, query.options().dtype(at::kFloat));
  at::Tensor ws_probs = at::empty({scores}, query.options());
  params.scores = ws_scores.data_ptr<float>();
  params.probs = ws_probs.data_ptr();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  cudaError_t err;
  switch (params.dtype) {
    case ScalarKind::kFloat32: err = run_dense_fwd_<ScalarKind::kFloat32>(params, handle, stream, &status); break;
    case ScalarKind::kBFloat16: err = run_dense_fwd_<ScalarKind::kBFloat16>(params, handle, stream, &status); break;
    default: err = run_dense_fwd_<ScalarKind::kFloat16>(params, handle, stream, &status); break;
  }
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "dense_fwd: cuBLAS failed with status ", int(status));
  check_launch(err, "dense_fwd");
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(sparse_attn, CUDA, m) { m.impl("dense_fwd", &dense_fwd_cuda); }

}  // namespace sparse_attn
