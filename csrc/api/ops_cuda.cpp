// CUDA backend: checks, device guard, current stream, params, dispatch to the kernels.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdlib>

#include "common.h"
#include "cuda_common.h"
#include "sparse_attn/cuda/flash_fwd.h"
#include "sparse_attn/cuda/gather_fwd.h"
#include "sparse_attn/cuda/topk.h"
#include "sparse_attn/static_switch.h"

namespace sparse_attn {
namespace {

void check_grid(const QkvShape& s, int block_m) {
  const int64_t tiles = (s.lq + block_m - 1) / block_m * s.b * s.h;
  TORCH_CHECK(tiles <= INT_MAX, "too many query tiles for one launch (", tiles, "); split the batch");
}

struct CudaInputs {
  QkvShape s;
  at::Tensor q, k, v;
};

// Checks the inputs and aligns them for the tensor-core kernels (data = false: only the layout
// an aligned copy would have, for planning without running anything).
CudaInputs prepare(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool data = true) {
  CudaInputs in{check_qkv(query, key, value), query, key, value};
  check_cuda(query);
  if (flash_needs_aligned_inputs(scalar_kind(query.scalar_type()))) {
    check_tensor_core_head_dims(in.s);
    in.q = aligned_copy(query, data);
    in.k = aligned_copy(key, data);
    in.v = aligned_copy(value, data);
  }
  return in;
}

// Runs the flash or block-sparse kernel that plan names; decides nothing.
template <Variant kVariant>
void launch_flash(const AttnFwdParams& params, const FlashPlan& plan, const QkvShape& s, const char* what) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_grid(s, plan.tile.block_m);
  // The Hopper kernel's dynamic tile scheduler counts from zero (a stream-ordered allocation,
  // freed back to the same stream once the launch is queued).
  AttnFwdParams p = params;
  at::Tensor counter;
  if (plan.schedule == Schedule::kDynamic) {
    counter = at::empty({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, c10::cuda::current_device()));
    C10_CUDA_CHECK(cudaMemsetAsync(counter.data_ptr(), 0, sizeof(int32_t), stream));
    p.tile_counter = counter.data_ptr<int32_t>();
  }
  cudaError_t err = cudaErrorInvalidValue;
  switch (plan.core) {
    case Core::kCudaCores: err = run_flash_fwd_fp32_<kVariant>(p, stream); break;
    case Core::kPortable:
      err = SA_HALF_DTYPE_SWITCH(p.dtype, kDtype, [&] {
        return SA_HEADDIM_SWITCH(padded_head_dim(p.d), kHeadDim,
                                 [&] { return run_flash_fwd_<kDtype, kHeadDim, kVariant>(p, plan, stream); });
      });
      break;
    case Core::kHopper:
      err = SA_HALF_DTYPE_SWITCH(p.dtype, kDtype, [&] {
        return SA_HEADDIM_SWITCH(padded_head_dim(p.d), kHeadDim, [&] {
          if constexpr (kHeadDim <= 128) return run_flash_fwd_sm90_<kDtype, kHeadDim, kVariant>(p, plan, stream);
          return cudaErrorInvalidValue;
        });
      });
      break;
    case Core::kCpu: break;
  }
  check_launch(err, what);
}

std::tuple<at::Tensor, at::Tensor> flash_fwd_cuda(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, c10::optional<double> scale,
                                                  bool causal, int64_t window_left, int64_t window_right) {
  CudaInputs in = prepare(query, key, value);
  const c10::cuda::CUDAGuard guard(query.device());
  auto [out, lse] = alloc_outputs(query, in.s);
  AttnFwdParams params = set_params_fwd(in.q, in.k, in.v, out, lse, in.s, resolve_scale(scale, in.s.d));
  set_params_window(params, causal, window_left, window_right);
  if (fill_trivial_outputs(in.s, out, lse)) return {out, lse};
  const FlashPlan plan = plan_flash(params, Variant::kWindow, cuda_device_info(query.get_device()), plan_options());
  launch_flash<Variant::kWindow>(params, plan, in.s, "flash_fwd");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> block_sparse_fwd_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_num_blocks,
    const at::Tensor& kv_indices, const at::Tensor& kv_partial, const at::Tensor& partial_masks,
    int64_t q_block, int64_t kv_block, c10::optional<double> scale,
    const c10::optional<at::Tensor>& q_block_order) {
  check_same_device(query, kv_num_blocks, "kv_num_blocks");  // before the CUDA check blames query
  CudaInputs in = prepare(query, key, value);
  const c10::cuda::CUDAGuard guard(query.device());
  auto [out, lse] = alloc_outputs(query, in.s);
  AttnFwdParams params = set_params_fwd(in.q, in.k, in.v, out, lse, in.s, resolve_scale(scale, in.s.d));
  auto keep = set_params_block_sparse(params, query, in.s, kv_num_blocks, kv_indices, kv_partial, partial_masks,
                                      q_block, kv_block);
  at::Tensor order = set_params_block_order(params, query, q_block_order);
  if (fill_trivial_outputs(in.s, out, lse)) return {out, lse};
  const FlashPlan plan =
      plan_flash(params, Variant::kBlockSparse, cuda_device_info(query.get_device()), plan_options());
  launch_flash<Variant::kBlockSparse>(params, plan, in.s, "block_sparse_fwd");
  return {out, lse};
}

template <typename F>
cudaError_t dtype_dispatch(ScalarKind dtype, F&& f) {
  switch (dtype) {
    case ScalarKind::kFloat32: return f(std::integral_constant<ScalarKind, ScalarKind::kFloat32>{});
    case ScalarKind::kBFloat16: return f(std::integral_constant<ScalarKind, ScalarKind::kBFloat16>{});
    default: return f(std::integral_constant<ScalarKind, ScalarKind::kFloat16>{});
  }
}

std::tuple<at::Tensor, at::Tensor> gather_fwd_cuda(const at::Tensor& query, const at::Tensor& key,
                                                   const at::Tensor& value, const at::Tensor& indices,
                                                   c10::optional<double> scale) {
  const QkvShape s = check_qkv(query, key, value);
  check_same_device(query, indices, "indices");
  check_cuda(query);
  const c10::cuda::CUDAGuard guard(query.device());
  auto [out, lse] = alloc_outputs(query, s);
  // The tensor-core gather copies 16-byte chunks: misaligned inputs it could take are copied.
  const bool align = gather_needs_aligned_inputs(scalar_kind(query.scalar_type()), s.d, s.dv);
  const at::Tensor q = align ? aligned_copy(query, true) : query, k = align ? aligned_copy(key, true) : key,
                   v = align ? aligned_copy(value, true) : value;
  AttnFwdParams params = set_params_fwd(q, k, v, out, lse, s, resolve_scale(scale, s.d));
  set_params_gather(params, query, s, indices);
  if (fill_trivial_outputs(s, out, lse)) return {out, lse};
  const GatherPlan plan = plan_gather(params, cuda_device_info(query.get_device()));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(
      dtype_dispatch(params.dtype, [&](auto dt) { return run_gather_fwd_<dt.value>(params, plan, stream); }),
      "gather_fwd");
  return {out, lse};
}

// Selection runs over bounded chunks of query rows (plan_select), so its workspace is never
// B * H * Lq * Lk. Tensor-core scoring fills the workspace a chunk of 64-row tiles at a time,
// then the select kernel reads it; otherwise the select kernel scores its own row.
at::Tensor run_select(TopkSelectParams& params, at::Tensor out, const at::Tensor& like) {
  const int64_t rows = int64_t(params.b) * params.h_sel * params.lq;
  if (out.numel() == 0 || rows == 0) return out;
  const c10::cuda::CUDAGuard guard(like.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const SelectPlan plan = plan_select(params, cuda_device_info(like.get_device()), plan_options());
  auto select = [&](int64_t n) {
    check_launch(
        dtype_dispatch(params.dtype, [&](auto dt) { return run_topk_select_<dt.value>(params, n, stream); }),
        "topk_select");
  };
  at::Tensor scores = at::empty({plan.workspace_bytes / 4}, like.options().dtype(at::kFloat));
  params.scores = scores.data_ptr<float>();
  params.scores_stride = plan.scores_stride;
  params.prescored = plan.tensor_core_scoring;
  params.n_qtiles = plan.n_qtiles;
  for (int64_t begin = 0; begin < plan.units; begin += plan.per_chunk) {
    const int64_t n = std::min(plan.per_chunk, plan.units - begin);
    if (plan.tensor_core_scoring) {
      params.tile_begin = begin;
      params.n_splits = select_score_splits(plan, n);
      check_launch(SA_HALF_DTYPE_SWITCH(params.dtype, kDtype,
                                        [&] { return run_topk_score_<kDtype>(params, n, stream); }),
                   "topk_score");
      select(n * kTopkScoreBlockM);
    } else {
      params.row_begin = begin;
      select(n);
    }
  }
  return out;
}

at::Tensor topk_select_cuda(const at::Tensor& query, const at::Tensor& key, int64_t k, bool causal) {
  TopkSelectParams params;
  at::Tensor out = set_params_select(params, query, key, k, causal);
  check_cuda(query);
  return run_select(params, out, query);
}

at::Tensor indexer_select_cuda(const at::Tensor& index_query, const at::Tensor& index_key,
                               const at::Tensor& index_weights, int64_t k, bool causal) {
  TopkSelectParams params;
  at::Tensor out = set_params_indexer(params, index_query, index_key, index_weights, k, causal);
  check_cuda(index_query);
  TORCH_CHECK(int64_t(params.hi) * (params.di + 1) * 4 <= 144 * 1024,
              "index_query: HI * (DI + 1) * 4 bytes must fit in shared memory (144 KiB), got HI=", params.hi,
              ", DI=", params.di);
  return run_select(params, out, index_query);
}

// The backward kernels run on the CPU only so far: on CUDA a clear error, not a missing kernel.
[[noreturn]] void backward_not_on_cuda() {
  TORCH_CHECK(false,
              "sparse_attn: the backward pass runs on CPU tensors only so far; the CUDA backward kernels are "
              "not implemented yet (train on the CPU, or use these ops under torch.no_grad() on the GPU)");
  std::abort();  // unreachable: TORCH_CHECK(false) throws
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const c10::optional<at::Tensor>&, c10::optional<double>,
                                                              bool, int64_t, int64_t) {
  backward_not_on_cuda();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_sparse_bwd_cuda(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, int64_t, int64_t, c10::optional<double>) {
  backward_not_on_cuda();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_bwd_cuda(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const at::Tensor&,
                                                               const c10::optional<at::Tensor>&, const at::Tensor&,
                                                               c10::optional<double>) {
  backward_not_on_cuda();
}

// Plans of CUDA inputs (sparse_attn.explain) learn their device from here.
const bool kCudaPlansRegistered = [] {
  set_cuda_device_lookup([](const at::Tensor& like) {
    check_cuda(like);
    return cuda_device_info(like.get_device());
  });
  return true;
}();

}  // namespace

TORCH_LIBRARY_IMPL(sparse_attn, CUDA, m) {
  m.impl("flash_bwd", &flash_bwd_cuda);
  m.impl("block_sparse_bwd", &block_sparse_bwd_cuda);
  m.impl("gather_bwd", &gather_bwd_cuda);
  m.impl("gather_fwd", &gather_fwd_cuda);
  m.impl("topk_select", &topk_select_cuda);
  m.impl("indexer_select", &indexer_select_cuda);
  m.impl("flash_fwd", &flash_fwd_cuda);
  m.impl("block_sparse_fwd", &block_sparse_fwd_cuda);
}

}  // namespace sparse_attn
