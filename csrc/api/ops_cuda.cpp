// CUDA backend: checks, device guard, current stream, params, dispatch to the kernels.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdlib>

#include "common.h"
#include "cuda_common.h"
#include "sparse_attn/cuda/attn_bwd.h"
#include "sparse_attn/cuda/flash_fwd.h"
#include "sparse_attn/cuda/gather_fwd.h"
#include "sparse_attn/cuda/merge.h"
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
CudaInputs prepare(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   bool data = true) {
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
  // The Hopper kernel's scratch (a stream-ordered allocation, freed back to the same stream once
  // the launch is queued): its dynamic tile scheduler's counter, which counts from zero, then, at
  // the head dims whose output it checks, one 16-byte record per (query tile, consumer warp) for
  // rows whose output is not finite.
  AttnFwdParams p = params;
  at::Tensor scratch;
  if (plan.core == Core::kHopper) {
    const int64_t records = sm90_fwd_checks_hidden_values(padded_head_dim(p.d))
                                ? int64_t(s.b) * s.h * ((s.lq + plan.tile.block_m - 1) / plan.tile.block_m) *
                                      (plan.tile.block_m / 16)
                                : 0;
    scratch = at::empty({4 + 4 * records},
                        at::TensorOptions().dtype(at::kInt).device(at::kCUDA, c10::cuda::current_device()));
    p.hidden_records = records > 0 ? scratch.data_ptr<int32_t>() + 4 : nullptr;
    if (plan.schedule == Schedule::kDynamic) {
      C10_CUDA_CHECK(cudaMemsetAsync(scratch.data_ptr(), 0, sizeof(int32_t), stream));
      p.tile_counter = scratch.data_ptr<int32_t>();
    }
  }
  cudaError_t err = cudaErrorInvalidValue;
  switch (plan.core) {
    case Core::kCudaCores:
      err = run_flash_fwd_fp32_<kVariant>(p, stream);
      break;
    case Core::kPortable:
      err = SA_HALF_DTYPE_SWITCH(p.dtype, kDtype, [&] {
        return SA_HEADDIM_SWITCH(padded_head_dim(p.d), kHeadDim,
                                 [&] { return run_flash_fwd_<kDtype, kHeadDim, kVariant>(p, plan, stream); });
      });
      break;
    case Core::kHopper:
      err = SA_HALF_DTYPE_SWITCH(p.dtype, kDtype, [&] {
        return SA_HEADDIM_SWITCH(padded_head_dim(p.d), kHeadDim, [&] {
          if constexpr (kHeadDim <= 128)
            return run_flash_fwd_sm90_<kDtype, kHeadDim, kVariant>(p, plan, stream);
          return cudaErrorInvalidValue;
        });
      });
      break;
    case Core::kCpu:
      break;
  }
  check_launch(err, what);
}

// The flash kernel into out and lse (flash_fwd's, or the caller's).
void run_flash_window(const CudaInputs& in, at::Tensor& out, at::Tensor& lse, c10::optional<double> scale,
                      bool causal, int64_t window_left, int64_t window_right) {
  AttnFwdParams params = set_params_fwd(in.q, in.k, in.v, out, lse, in.s, resolve_scale(scale, in.s.d));
  set_params_window(params, causal, window_left, window_right);
  if (fill_trivial_outputs(in.s, out, lse)) return;
  const FlashPlan plan =
      plan_flash(params, Variant::kWindow, cuda_device_info(in.q.get_device()), plan_options());
  launch_flash<Variant::kWindow>(params, plan, in.s, "flash_fwd");
}

std::tuple<at::Tensor, at::Tensor> flash_fwd_cuda(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, c10::optional<double> scale,
                                                  bool causal, int64_t window_left, int64_t window_right) {
  CudaInputs in = prepare(query, key, value);
  const c10::cuda::CUDAGuard guard(query.device());
  auto [out, lse] = alloc_outputs(query, in.s);
  run_flash_window(in, out, lse, scale, causal, window_left, window_right);
  return {out, lse};
}

// flash_fwd into the caller's out (a view of a larger tensor: varlen's packed output, so that no
// sequence's result is copied) and lse.
void flash_fwd_out_cuda(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        at::Tensor& out, at::Tensor& lse, c10::optional<double> scale, bool causal,
                        int64_t window_left, int64_t window_right) {
  CudaInputs in = prepare(query, key, value);
  check_given_outputs(query, in.s, out, lse);
  const c10::cuda::CUDAGuard guard(query.device());
  run_flash_window(in, out, lse, scale, causal, window_left, window_right);
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
  auto keep = set_params_block_sparse(params, query, in.s, kv_num_blocks, kv_indices, kv_partial,
                                      partial_masks, q_block, kv_block);
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
    case ScalarKind::kFloat32:
      return f(std::integral_constant<ScalarKind, ScalarKind::kFloat32>{});
    case ScalarKind::kBFloat16:
      return f(std::integral_constant<ScalarKind, ScalarKind::kBFloat16>{});
    default:
      return f(std::integral_constant<ScalarKind, ScalarKind::kFloat16>{});
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
  auto score = [&](int64_t n) {
    check_launch(SA_HALF_DTYPE_SWITCH(params.dtype, kDtype,
                                      [&] { return run_topk_score_<kDtype>(params, n, stream); }),
                 "topk_score");
  };
  at::Tensor scores = at::empty({plan.workspace_bytes / 4}, like.options().dtype(at::kFloat));
  params.scores = scores.data_ptr<float>();
  params.scores_stride = plan.scores_stride;
  params.prescored = plan.tensor_core_scoring;
  params.n_qtiles = plan.n_qtiles;
  if (plan.filter_stride > 0) {
    // Filtered (params.h): per chunk, the sample, thresholds, candidates, selection among them,
    // then the rows they could not decide.
    char* base = static_cast<char*>(scores.data_ptr());
    const FilterWorkspace w = filter_workspace(plan, plan.per_chunk * kTopkScoreBlockM);
    params.filter_stride = plan.filter_stride;
    params.cand_cap = plan.cand_cap;
    params.cand_target = plan.cand_target;
    params.thresholds = reinterpret_cast<uint32_t*>(base + w.thresholds);
    params.cand = reinterpret_cast<uint32_t*>(base + w.cand);
    params.cand_count = reinterpret_cast<int*>(base + w.counts);
    params.fallback_rows = reinterpret_cast<int64_t*>(base + w.fallback_rows);
    SelectPlan sample_plan = plan;
    sample_plan.key_tiles = std::max(1, plan.key_tiles / plan.filter_stride);
    for (int64_t begin = 0; begin < plan.units; begin += plan.per_chunk) {
      const int64_t n = std::min(plan.per_chunk, plan.units - begin), rows_c = n * kTopkScoreBlockM;
      params.tile_begin = begin;
      params.fallback_count = params.cand_count + rows_c * kMaxFilterSplits;
      C10_CUDA_CHECK(cudaMemsetAsync(params.fallback_count, 0, sizeof(int), stream));
      params.scores = reinterpret_cast<float*>(base + w.sample);
      params.scores_stride = plan.sample_stride;
      params.score_mode = 1;
      params.n_splits = select_score_splits(sample_plan, n);
      score(n);
      params.select_mode = 1;
      select(rows_c);
      params.score_mode = 2;
      params.n_splits = std::min(select_score_splits(plan, n), kMaxFilterSplits);
      params.cand_slice = plan.cand_cap / params.n_splits;
      score(n);
      params.select_mode = 2;
      select(rows_c);
      params.scores = reinterpret_cast<float*>(base + w.fallback_scores);
      params.scores_stride = plan.scores_stride;
      params.select_mode = 3;
      select(plan.fallback_ctas);
    }
    return out;
  }
  for (int64_t begin = 0; begin < plan.units; begin += plan.per_chunk) {
    const int64_t n = std::min(plan.per_chunk, plan.units - begin);
    if (plan.tensor_core_scoring) {
      params.tile_begin = begin;
      params.n_splits = select_score_splits(plan, n);
      score(n);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> document_mask_cuda(
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const at::Tensor& partial_offsets,
    int64_t num_partial, int64_t total_q, int64_t total_k, int64_t q_block, int64_t kv_block,
    int64_t window_left, int64_t window_right, int64_t max_kb) {
  check_cuda(cu_seqlens_q);
  const c10::cuda::CUDAGuard guard(cu_seqlens_q.device());
  DocumentMaskParams params;
  auto out = set_params_document_mask(params, cu_seqlens_q, cu_seqlens_k, partial_offsets, num_partial,
                                      total_q, total_k, q_block, kv_block, window_left, window_right, max_kb);
  check_launch(run_document_mask(params, c10::cuda::getCurrentCUDAStream()), "document_mask");
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> selection_mask_cuda(
    const at::Tensor& indices, int64_t key_length, int64_t heads, int64_t q_block, int64_t kv_block,
    bool causal, int64_t row_offset, int64_t entry_block) {
  check_cuda(indices);
  const c10::cuda::CUDAGuard guard(indices.device());
  at::Tensor idx = indices;
  SelectionMaskParams params;
  auto out = set_params_selection_mask(params, idx, key_length, heads, q_block, kv_block, causal, row_offset,
                                       entry_block);
  check_launch(run_selection_mask(params, c10::cuda::getCurrentCUDAStream()), "selection_mask");
  return out;
}

at::Tensor selection_union_cuda(const at::Tensor& indices, int64_t key_length, int64_t q_block,
                                int64_t kv_block, bool causal, int64_t row_offset, int64_t entry_block,
                                int64_t samples) {
  check_cuda(indices);
  const c10::cuda::CUDAGuard guard(indices.device());
  at::Tensor idx = indices;
  SelectionMaskParams params;
  const int n = set_params_selection_union(params, idx, key_length, q_block, kv_block, causal, row_offset,
                                           entry_block, samples);
  at::Tensor count = at::zeros({}, indices.options().dtype(at::kLong));
  check_launch(
      run_selection_union(params, n, reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()),
                          c10::cuda::getCurrentCUDAStream()),
      "selection_union");
  return count;
}

at::Tensor canonical_selection_cuda(const at::Tensor& indices) {
  check_cuda(indices);
  TORCH_CHECK(indices.scalar_type() == at::kInt, "indices must be int32, got ", indices.scalar_type());
  TORCH_CHECK(indices.dim() >= 1 && indices.size(-1) <= kCanonicalSelectionMaxK, "indices: rows of at most ",
              kCanonicalSelectionMaxK, " entries, got shape ", indices.sizes());
  const c10::cuda::CUDAGuard guard(indices.device());
  const at::Tensor in = indices.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t k = in.size(-1), rows = k == 0 ? 0 : in.numel() / k;
  check_launch(run_canonical_selection(in.data_ptr<int32_t>(), out.data_ptr<int32_t>(), rows, int(k),
                                       c10::cuda::getCurrentCUDAStream()),
               "canonical_selection");
  return out;
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

// ---- backward (attn_bwd.h says the sequence of kernels) ----

// The inputs of a backward call, aligned for the tensor-core kernel where it runs, and the
// params filled from them.
struct CudaBwdCall {
  QkvShape s;
  bool tensor_cores = false;
  at::Tensor q, k, v, dout;
  AttnBwdParams params{};
  BwdTensors t;
};

CudaBwdCall prepare_bwd(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                        const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                        const c10::optional<at::Tensor>& grad_lse, c10::optional<double> scale, bool gather) {
  CudaBwdCall c;
  c.s = check_qkv(query, key, value);
  check_cuda(query);
  const ScalarKind dtype = scalar_kind(query.scalar_type());
  c.tensor_cores =
      gather ? gather_needs_aligned_inputs(dtype, c.s.d, c.s.dv) : bwd_tensor_cores(dtype, c.s.d, c.s.dv);
  c.q = c.tensor_cores ? aligned_copy(query, true) : query;
  c.k = c.tensor_cores ? aligned_copy(key, true) : key;
  c.v = c.tensor_cores ? aligned_copy(value, true) : value;
  c.dout = c.tensor_cores && grad_out.sizes() == out.sizes() ? aligned_copy(grad_out, true) : grad_out;
  c.params.fwd = set_params_fwd(c.q, c.k, c.v, out, lse, c.s, resolve_scale(scale, c.s.d));
  c.t = set_params_bwd(c.params, c.q, c.k, c.v, out, lse, c.dout, grad_lse);
  return c;
}

// Runs the backward kernels for a call whose forward params (window, mask or indices) are set.
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_bwd(CudaBwdCall& c, Variant variant, bool gather,
                                                       const char* what) {
  const QkvShape& s = c.s;
  if (s.b * s.h * s.lq == 0 || s.lk == 0) {  // nothing visible anywhere: zero gradients
    c.t.dq.zero_();
    c.t.dk.zero_();
    c.t.dv.zero_();
    return {c.t.dq, c.t.dk, c.t.dv};
  }
  // Deterministic mode: the Hopper kernel adds the dense family's dQ in a fixed order
  // (AttnBwdParams::dq_order); the other tensor-core paths of flash and block-sparse attention
  // compute dQ in a kernel of its own, without atomics; top-k and the CUDA-core kernel sum with
  // atomics.
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  if (deterministic && !(c.tensor_cores && !gather))
    at::globalContext().alertNotDeterministic(std::string(what) + " on CUDA with top-k, fp32 or D > 128");
  const c10::cuda::CUDAGuard guard(c.q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AttnBwdParams& bp = c.params;
  const auto f32 = c.q.options().dtype(at::kFloat);
  // Rows of the statistics: whole 128-row mask blocks, so that every query tile a kernel visits
  // (a block-sparse mask block may reach past Lq) reads and reduces inside its (batch, head).
  bp.lq_pad = int((s.lq + 127) / 128 * 128);
  at::Tensor stats = at::empty({2, s.b * s.h, bp.lq_pad}, f32);
  bp.lse_log2 = stats.data_ptr<float>();
  bp.delta = bp.lse_log2 + s.b * s.h * bp.lq_pad;
  check_launch(
      dtype_dispatch(bp.fwd.dtype, [&](auto dt) { return run_bwd_preprocess_<dt.value>(bp, stream); }),
      "backward preprocess");
  if (c.tensor_cores && !gather) {
    TORCH_CHECK(s.b * s.h_kv <= 65535, what, ": B * Hkv must be at most 65535, got ", s.b * s.h_kv);
    // The kernel, its tiles, head splits and groups and the dQ mode (plan_bwd, which explain shows).
    const BwdPlan plan =
        plan_bwd(bp, variant, cuda_device_info(c.q.get_device()), plan_options(), deterministic);
    const bool hopper = plan.core == Core::kHopper;
    const bool ordered = plan.dq == DqMode::kOrdered;
    const bool separate = plan.dq == DqMode::kSeparate;
    if (!hopper) {  // the portable kernel's 64-key tiles are not the mask's key blocks
      bp.kv_block_order = nullptr;
      bp.kv_heavy = nullptr;
    }
    bp.head_splits = plan.head_splits;
    bp.head_group = plan.head_group;
    at::Tensor dk_split, dv_split;
    bp.dk_accum = bp.dv_accum = nullptr;
    if (bp.head_splits > 1) {
      dk_split = at::zeros({s.b, s.h_kv, s.lk, s.d}, f32);
      dv_split = at::zeros({s.b, s.h_kv, s.lk, s.dv}, f32);
      bp.dk_accum = dk_split.data_ptr<float>();
      bp.dv_accum = dv_split.data_ptr<float>();
    }
    // dQ in fp32: Hopper's in 64 x 64 tiles (b, h, query tile, column block) holding the wgmma
    // fragments in order (j, warp, g, t, e), undone below; the portable kernel's dQ / scale as
    // (B, H, Lq, D).
    const int64_t col_blocks = padded_head_dim(s.d) / 64;
    at::Tensor dq_accum = separate ? at::Tensor()
                          : hopper ? at::zeros({s.b, s.h, bp.lq_pad / 64, col_blocks, 8, 4, 8, 4, 2, 2}, f32)
                                   : at::zeros({s.b, s.h, s.lq, s.d}, f32);
    bp.dq_accum = separate ? nullptr : dq_accum.data_ptr<float>();
    bp.dq_separate = separate ? 1 : 0;
    at::Tensor dq_order =
        ordered ? at::zeros({s.b * s.h * (bp.lq_pad / 64)}, c.q.options().dtype(at::kInt)) : at::Tensor();
    bp.dq_order = ordered ? dq_order.data_ptr<int32_t>() : nullptr;
    check_launch(
        SA_HALF_DTYPE_SWITCH(
            bp.fwd.dtype, kDtype,
            [&] {
              return SA_HEADDIM_SWITCH(padded_head_dim(s.d), kHeadDim, [&] {
                if constexpr (kHeadDim <= 128) {
                  if (variant == Variant::kWindow)
                    return hopper ? run_attn_bwd_sm90_<kDtype, kHeadDim, Variant::kWindow>(bp, stream)
                                  : run_attn_bwd_<kDtype, kHeadDim, Variant::kWindow>(bp, stream);
                  return hopper ? run_attn_bwd_sm90_<kDtype, kHeadDim, Variant::kBlockSparse>(bp, stream)
                                : run_attn_bwd_<kDtype, kHeadDim, Variant::kBlockSparse>(bp, stream);
                }
                return cudaErrorInvalidValue;
              });
            }),
        what);
    if (bp.head_splits > 1) {
      c.t.dk.copy_(dk_split);
      c.t.dv.copy_(dv_split);
    }
    if (separate) {
      check_launch(SA_HALF_DTYPE_SWITCH(
                       bp.fwd.dtype, kDtype,
                       [&] {
                         return SA_HEADDIM_SWITCH(padded_head_dim(s.d), kHeadDim, [&] {
                           if constexpr (kHeadDim <= 128) {
                             return variant == Variant::kWindow
                                        ? run_attn_bwd_dq_<kDtype, kHeadDim, Variant::kWindow>(bp, stream)
                                        : run_attn_bwd_dq_<kDtype, kHeadDim, Variant::kBlockSparse>(bp,
                                                                                                    stream);
                           }
                           return cudaErrorInvalidValue;
                         });
                       }),
                   what);
    } else if (hopper && bp.fwd.b * int64_t(bp.fwd.h) <= 65535) {
      // The tiles hold scale * dQ in fragment order; one kernel casts them into params.dq.
      check_launch(run_dq_from_fragments(bp, int(col_blocks), stream), "backward dQ");
    } else if (hopper) {
      // The tiles hold scale * dQ in fragment order: row m * 64 + 16 warp + 8 e_hi + g, column
      // 64 block + 8 j + 2 t + e_lo. One strided copy (with the cast) puts them in place.
      const int64_t nm = bp.lq_pad / 64;
      const at::Tensor frag = dq_accum.permute({0, 1, 2, 5, 8, 6, 3, 4, 7, 9});
      const std::vector<int64_t> split{s.b, s.h, nm, 4, 2, 8, col_blocks, 8, 4, 2};
      if (s.lq == bp.lq_pad && s.d == col_blocks * 64) {
        c.t.dq.view(split).copy_(frag);
      } else {
        at::Tensor full = at::empty({s.b, s.h, bp.lq_pad, col_blocks * 64}, c.t.dq.options());
        full.view(split).copy_(frag);
        c.t.dq.copy_(full.slice(2, 0, s.lq).slice(3, 0, s.d));
      }
    } else {
      c.t.dq.copy_(dq_accum.mul_(bp.fwd.scale));
    }
  } else {
    at::Tensor dk_accum = at::zeros({s.b, s.h_kv, s.lk, s.d}, f32),
               dv_accum = at::zeros({s.b, s.h_kv, s.lk, s.dv}, f32);
    bp.dk_accum = dk_accum.data_ptr<float>();
    bp.dv_accum = dv_accum.data_ptr<float>();
    // Top-k: the plan layer's backward of the forward's plan (plan_gather_bwd).
    const GatherBwdPlan plan =
        gather ? plan_gather_bwd(plan_gather(bp.fwd, cuda_device_info(c.q.get_device()))) : GatherBwdPlan{};
    if (gather && plan.core == Core::kPortable) {
      check_launch(SA_HALF_DTYPE_SWITCH(bp.fwd.dtype, kDtype,
                                        [&] {
                                          return plan.head_dim == 64
                                                     ? run_gather_bwd_mma_<kDtype, 64>(
                                                           bp, plan.group, plan.shared_stages, stream)
                                                     : run_gather_bwd_mma_<kDtype, 128>(
                                                           bp, plan.group, plan.shared_stages, stream);
                                        }),
                   what);
    } else {
      check_launch(dtype_dispatch(
                       bp.fwd.dtype,
                       [&](auto dt) {
                         if (gather) return run_attn_bwd_simt_<dt.value, Variant::kWindow, true>(bp, stream);
                         return variant == Variant::kWindow
                                    ? run_attn_bwd_simt_<dt.value, Variant::kWindow, false>(bp, stream)
                                    : run_attn_bwd_simt_<dt.value, Variant::kBlockSparse, false>(bp, stream);
                       }),
                   what);
    }
    c.t.dk.copy_(dk_accum);
    c.t.dv.copy_(dv_accum);
  }
  return {c.t.dq, c.t.dk, c.t.dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& grad_lse,
    c10::optional<double> scale, bool causal, int64_t window_left, int64_t window_right) {
  CudaBwdCall c = prepare_bwd(grad_out, query, key, value, out, lse, grad_lse, scale, false);
  set_params_window(c.params.fwd, causal, window_left, window_right);
  return run_bwd(c, Variant::kWindow, false, "flash_bwd");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_sparse_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& grad_lse,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices, const at::Tensor& kv_partial,
    const at::Tensor& partial_masks, int64_t q_block, int64_t kv_block, c10::optional<double> scale) {
  check_same_device(query, kv_num_blocks, "kv_num_blocks");
  CudaBwdCall c = prepare_bwd(grad_out, query, key, value, out, lse, grad_lse, scale, false);
  auto keep = set_params_block_sparse(c.params.fwd, query, c.s, kv_num_blocks, kv_indices, kv_partial,
                                      partial_masks, q_block, kv_block);
  // The transposed lists (key block -> query blocks), built on the GPU.
  AttnBwdParams& bp = c.params;
  const int64_t bm = kv_num_blocks.size(0), hm = kv_num_blocks.size(1);
  const int64_t nqb = bp.fwd.num_q_blocks, nkb = bp.fwd.num_kv_blocks;
  const auto i32 = query.options().dtype(at::kInt);
  at::Tensor q_num = at::empty({bm, hm, nkb}, i32), q_idx = at::zeros({bm, hm, nkb, nqb}, i32),
             q_part = at::empty({bm, hm, nkb, nqb}, i32);
  if (q_num.numel() > 0) {
    const c10::cuda::CUDAGuard guard(query.device());
    check_launch(run_build_q_lists(bp, int(bm), int(hm), q_num.data_ptr<int32_t>(), q_idx.data_ptr<int32_t>(),
                                   q_part.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()),
                 "block_sparse_bwd (transposed lists)");
  }
  bp.q_num_blocks = q_num.data_ptr<int32_t>();
  bp.q_indices = q_idx.data_ptr<int32_t>();
  bp.q_partial = q_part.data_ptr<int32_t>();
  bp.qt_batch_stride = bm == 1 ? 0 : hm * nkb;
  bp.qt_head_stride = hm == 1 ? 0 : nkb;
  // The key-major kernel's CTA order: key blocks visited by more than twice the mean number of
  // query blocks first (bwd_tile_of_cta), computed on the GPU (no synchronisation).
  at::Tensor order;
  if (q_num.numel() > 0) {
    order = at::empty({2 * nkb + 1}, i32);  // order, scratch, heavy count
    int32_t* base = order.data_ptr<int32_t>();
    const c10::cuda::CUDAGuard guard(query.device());
    check_launch(run_build_kv_order(q_num.data_ptr<int32_t>(), bm * hm, int(nkb), base, base + 2 * nkb,
                                    base + nkb, c10::cuda::getCurrentCUDAStream()),
                 "block_sparse_bwd (CTA order)");
    bp.kv_block_order = base;
    bp.kv_heavy = base + 2 * nkb;
  }
  return run_bwd(c, Variant::kBlockSparse, false, "block_sparse_bwd");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& grad_lse,
    const at::Tensor& indices, c10::optional<double> scale) {
  check_same_device(query, indices, "indices");
  CudaBwdCall c = prepare_bwd(grad_out, query, key, value, out, lse, grad_lse, scale, true);
  set_params_gather(c.params.fwd, query, c.s, indices);
  return run_bwd(c, Variant::kWindow, true, "gather_bwd");
}

// Context parallelism's LSE merge of a partial output into out / lse, in place (merge.h).
void merge_partial_cuda(at::Tensor& out, at::Tensor& lse, const at::Tensor& part,
                        const at::Tensor& part_lse) {
  TORCH_CHECK(out.dim() == 4 && part.sizes() == out.sizes(),
              "out and part must be (B, H, L, D) of one shape, got ", out.sizes(), " and ", part.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.sizes() == out.sizes().slice(0, 3) && part_lse.sizes() == lse.sizes(),
              "lse and part_lse must be (B, H, L) = ", out.sizes().slice(0, 3), ", got ", lse.sizes(),
              " and ", part_lse.sizes());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && part_lse.scalar_type() == at::kFloat,
              "lse and part_lse must be float32");
  TORCH_CHECK(part.scalar_type() == out.scalar_type(), "part must have out's dtype ", out.scalar_type(),
              ", got ", part.scalar_type());
  TORCH_CHECK(out.size(3) == 0 || (out.stride(3) == 1 && part.stride(3) == 1),
              "out and part must have unit stride along D");
  check_cuda(out);
  check_same_device(out, lse, "lse");
  check_same_device(out, part, "part");
  check_same_device(out, part_lse, "part_lse");
  const c10::cuda::CUDAGuard guard(out.device());
  MergeParams p{};
  p.dtype = scalar_kind(out.scalar_type());
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.part = part.data_ptr();
  p.part_lse = part_lse.data_ptr<float>();
  p.b = out.size(0), p.h = out.size(1), p.l = out.size(2), p.d = out.size(3);
  for (int i = 0; i < 3; ++i) {
    p.out_stride[i] = out.stride(i);
    p.lse_stride[i] = lse.stride(i);
    p.part_stride[i] = part.stride(i);
    p.part_lse_stride[i] = part_lse.stride(i);
  }
  check_launch(run_merge_partial(p, c10::cuda::getCurrentCUDAStream()), "merge_partial");
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
  m.impl("_selection_mask", &selection_mask_cuda);
  m.impl("_selection_union", &selection_union_cuda);
  m.impl("_document_mask", &document_mask_cuda);
  m.impl("_canonical_selection", &canonical_selection_cuda);
  m.impl("indexer_select", &indexer_select_cuda);
  m.impl("flash_fwd", &flash_fwd_cuda);
  m.impl("_flash_fwd_out", &flash_fwd_out_cuda);
  m.impl("block_sparse_fwd", &block_sparse_fwd_cuda);
  m.impl("_merge_partial_", &merge_partial_cuda);
}

}  // namespace sparse_attn
