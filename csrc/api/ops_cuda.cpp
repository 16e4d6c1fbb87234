// CUDA backend: checks, device guard, current stream, params, dispatch to the kernels.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>

#include "common.h"
#include "cuda_common.h"
#include "sparse_attn/cuda/flash_fwd.h"
#include "sparse_attn/cuda/topk.h"
#include "sparse_attn/static_switch.h"

namespace sparse_attn {
namespace {

// The tensor-core kernels copy 16-byte chunks: a base pointer or a stride that is not a
// multiple of 16 bytes gets an aligned copy (any layout from a transformer layer already is).
at::Tensor aligned(const at::Tensor& t) {
  const int64_t elems = 16 / t.element_size();
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t i = 0; ok && i + 1 < t.dim(); ++i) ok = t.size(i) <= 1 || t.stride(i) % elems == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

void check_grid(const QkvShape& s, int block_m) {
  const int64_t tiles = (s.lq + block_m - 1) / block_m * s.b * s.h;
  TORCH_CHECK(tiles <= INT_MAX, "too many query tiles for one launch (", tiles, "); split the batch");
}

struct CudaInputs {
  QkvShape s;
  at::Tensor q, k, v;
};

CudaInputs prepare(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  CudaInputs in{check_qkv(query, key, value), query, key, value};
  check_cuda(query);
  if (query.scalar_type() != at::kFloat) {
    TORCH_CHECK(in.s.dv == in.s.d, "on CUDA the value head dimension must equal the query head dimension, got D=",
                in.s.d, " and Dv=", in.s.dv);
    in.q = aligned(query);
    in.k = aligned(key);
    in.v = aligned(value);
  }
  return in;
}

template <Variant kVariant>
void launch_flash(const AttnFwdParams& params, const QkvShape& s, const char* what) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (params.dtype == ScalarKind::kFloat32) {
    check_grid(s, flash_fwd_fp32_tile().block_m);
    err = run_flash_fwd_fp32_<kVariant == Variant::kWindow ? Variant::kWindow : Variant::kBlockSparse>(params,
                                                                                                        stream);
  } else {
    check_grid(s, flash_fwd_tile(padded_head_dim(params.d), kVariant).block_m);
    err = SA_HALF_DTYPE_SWITCH(params.dtype, kDtype, [&] {
      return SA_HEADDIM_SWITCH(padded_head_dim(params.d), kHeadDim,
                               [&] { return run_flash_fwd_<kDtype, kHeadDim, kVariant>(params, stream); });
    });
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
  launch_flash<Variant::kWindow>(params, in.s, "flash_fwd");
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
  if (q_block == 128) {
    launch_flash<Variant::kBlockSparse>(params, in.s, "block_sparse_fwd");
  } else {
    launch_flash<Variant::kBlockSparseM64>(params, in.s, "block_sparse_fwd");
  }
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
  AttnFwdParams params = set_params_fwd(query, key, value, out, lse, s, resolve_scale(scale, s.d));
  set_params_gather(params, query, s, indices);
  if (fill_trivial_outputs(s, out, lse)) return {out, lse};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(dtype_dispatch(params.dtype, [&](auto dt) { return run_gather_fwd_<dt.value>(params, stream); }),
               "gather_fwd");
  return {out, lse};
}

// Selection runs over bounded chunks of query rows, so its workspace is never B * H * Lq * Lk.
at::Tensor run_select(TopkSelectParams& params, at::Tensor out, const at::Tensor& like) {
  const int64_t rows = int64_t(params.b) * params.h_sel * params.lq;
  if (out.numel() == 0 || rows == 0) return out;
  const c10::cuda::CUDAGuard guard(like.device());
  const int64_t chunk = std::min(rows, topk_select_rows_per_chunk(params.lk));
  at::Tensor scores = at::empty({chunk, std::max<int64_t>(params.lk, 1)}, like.options().dtype(at::kFloat));
  params.scores = scores.data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t begin = 0; begin < rows; begin += chunk) {
    params.row_begin = begin;
    const int64_t n = std::min(chunk, rows - begin);
    check_launch(
        dtype_dispatch(params.dtype, [&](auto dt) { return run_topk_select_<dt.value>(params, n, stream); }),
        "topk_select");
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
  TORCH_CHECK(int64_t(params.hi) * (params.di + 1) * 4 <= 200 * 1024,
              "index_query: HI * (DI + 1) * 4 bytes must fit in shared memory (200 KiB), got HI=", params.hi,
              ", DI=", params.di);
  return run_select(params, out, index_query);
}

}  // namespace

TORCH_LIBRARY_IMPL(sparse_attn, CUDA, m) {
  m.impl("gather_fwd", &gather_fwd_cuda);
  m.impl("topk_select", &topk_select_cuda);
  m.impl("indexer_select", &indexer_select_cuda);
  m.impl("flash_fwd", &flash_fwd_cuda);
  m.impl("block_sparse_fwd", &block_sparse_fwd_cuda);
}

}  // namespace sparse_attn
