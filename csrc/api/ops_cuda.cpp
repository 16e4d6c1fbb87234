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
    // The Hopper kernel's dynamic tile scheduler counts from zero (a stream-ordered allocation,
    // freed back to the same stream once the launch is queued).
    AttnFwdParams p = params;
    at::Tensor counter;
    if (flash_sm90_dynamic_schedule(p, kVariant)) {
      counter = at::empty({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, c10::cuda::current_device()));
      C10_CUDA_CHECK(cudaMemsetAsync(counter.data_ptr(), 0, sizeof(int32_t), stream));
      p.tile_counter = counter.data_ptr<int32_t>();
    }
    err = SA_HALF_DTYPE_SWITCH(p.dtype, kDtype, [&] {
      return SA_HEADDIM_SWITCH(padded_head_dim(p.d), kHeadDim,
                               [&] { return run_flash_fwd_<kDtype, kHeadDim, kVariant>(p, stream); });
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
  // The tensor-core gather (16-bit, D = Dv <= 128) copies 16-byte chunks: align its inputs.
  const bool mma = query.scalar_type() != at::kFloat && s.d == s.dv && s.d <= 128;
  const at::Tensor q = mma ? aligned(query) : query, k = mma ? aligned(key) : key, v = mma ? aligned(value) : value;
  AttnFwdParams params = set_params_fwd(q, k, v, out, lse, s, resolve_scale(scale, s.d));
  set_params_gather(params, query, s, indices);
  if (fill_trivial_outputs(s, out, lse)) return {out, lse};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(dtype_dispatch(params.dtype, [&](auto dt) { return run_gather_fwd_<dt.value>(params, stream); }),
               "gather_fwd");
  return {out, lse};
}

// Bytes of the selection's score workspace; SPARSE_ATTN_TOPK_WORKSPACE_BYTES overrides the
// default (tests shrink it to run the multi-chunk path at small sizes).
int64_t select_workspace_bytes(const TopkSelectParams& p) {
  const char* env = std::getenv("SPARSE_ATTN_TOPK_WORKSPACE_BYTES");
  const int64_t v = env != nullptr ? std::atoll(env) : 0;
  return v > 0 ? v : topk_select_workspace_bytes(int64_t(p.b) * p.h_sel * p.lq * p.topk * 4);
}

// Selection runs over bounded chunks of query rows, so its workspace is never B * H * Lq * Lk.
// Tensor-core scoring fills the workspace a chunk of 64-row tiles at a time, then the select
// kernel reads it; otherwise the select kernel scores its own row on the CUDA cores.
at::Tensor run_select(TopkSelectParams& params, at::Tensor out, const at::Tensor& like) {
  const int64_t rows = int64_t(params.b) * params.h_sel * params.lq;
  if (out.numel() == 0 || rows == 0) return out;
  const c10::cuda::CUDAGuard guard(like.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t budget = select_workspace_bytes(params);
  auto select = [&](int64_t n) {
    check_launch(
        dtype_dispatch(params.dtype, [&](auto dt) { return run_topk_select_<dt.value>(params, n, stream); }),
        "topk_select");
  };
  const int64_t stride = (params.lk + 3) / 4 * 4;
  const int64_t tile_bytes = int64_t(kTopkScoreBlockM) * stride * 4;
  if (topk_score_eligible(params) && tile_bytes <= budget) {
    params.prescored = true;
    params.n_qtiles = int((params.lq + kTopkScoreBlockM - 1) / kTopkScoreBlockM);
    const int64_t tiles = int64_t(params.b) * params.h_sel * params.n_qtiles;
    const int64_t per_chunk = std::min(tiles, budget / tile_bytes);
    at::Tensor scores = at::empty({per_chunk * kTopkScoreBlockM, stride}, like.options().dtype(at::kFloat));
    params.scores = scores.data_ptr<float>();
    params.scores_stride = stride;
    int sms = 0;
    check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, like.get_device()),
                 "cudaDeviceGetAttribute");
    const int64_t key_tiles = (params.lk + kTopkScoreBlockN - 1) / kTopkScoreBlockN;
    for (int64_t begin = 0; begin < tiles; begin += per_chunk) {
      const int64_t n = std::min(per_chunk, tiles - begin);
      params.tile_begin = begin;
      // About 16 CTAs per SM (4 waves of 4): the causal triangle makes CTAs unequal, and few waves
      // leave a ragged last one.
      params.n_splits = int(std::clamp<int64_t>((16 * sms + n - 1) / n, 1, key_tiles));
      check_launch(SA_HALF_DTYPE_SWITCH(params.dtype, kDtype,
                                        [&] { return run_topk_score_<kDtype>(params, n, stream); }),
                   "topk_score");
      select(n * kTopkScoreBlockM);
    }
    return out;
  }
  const int64_t chunk = std::clamp<int64_t>(budget / (stride * 4), 1, rows);
  at::Tensor scores = at::empty({chunk, stride}, like.options().dtype(at::kFloat));
  params.scores = scores.data_ptr<float>();
  params.scores_stride = stride;
  for (int64_t begin = 0; begin < rows; begin += chunk) {
    params.row_begin = begin;
    select(std::min(chunk, rows - begin));
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

}  // namespace

TORCH_LIBRARY_IMPL(sparse_attn, CUDA, m) {
  m.impl("gather_fwd", &gather_fwd_cuda);
  m.impl("topk_select", &topk_select_cuda);
  m.impl("indexer_select", &indexer_select_cuda);
  m.impl("flash_fwd", &flash_fwd_cuda);
  m.impl("block_sparse_fwd", &block_sparse_fwd_cuda);
}

}  // namespace sparse_attn
