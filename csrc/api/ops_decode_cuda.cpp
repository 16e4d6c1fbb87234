// CUDA glue of attention_with_kvcache: checks, the plan, the split workspaces, the launch. The
// lengths and the page table stay on the device: nothing here synchronises with it.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>

#include "common.h"
#include "cuda_common.h"
#include "sparse_attn/cuda/decode.h"
#include "sparse_attn/static_switch.h"

namespace sparse_attn {
namespace {

std::tuple<at::Tensor, at::Tensor> kvcache_fwd_cuda(
    const at::Tensor& query, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& cache_seqlens,
    const c10::optional<at::Tensor>& key, const c10::optional<at::Tensor>& value,
    const c10::optional<at::Tensor>& block_table, const c10::optional<at::Tensor>& kv_num_blocks,
    const c10::optional<at::Tensor>& kv_indices, int64_t kv_block, c10::optional<double> scale,
    int64_t window_left, int64_t window_right) {
  const KvCacheShape s = check_kvcache(query, key_cache, value_cache, cache_seqlens, key, value, block_table,
                                       kv_num_blocks, kv_indices, kv_block);
  check_cuda(query);
  const c10::cuda::CUDAGuard guard(query.device());
  TORCH_CHECK(
      kvcache_aligned(key_cache, value_cache),
      "key_cache and value_cache must be 16-byte aligned (base and strides) for the CUDA decode kernel");
  const at::Tensor q = aligned_copy(query, true);
  c10::optional<at::Tensor> k_new, v_new, bt, cnt, idx;
  if (key.has_value()) {
    k_new = aligned_copy(*key, true);
    v_new = aligned_copy(*value, true);
  }
  if (block_table.has_value()) bt = block_table->stride(1) == 1 ? *block_table : block_table->contiguous();
  if (kv_num_blocks.has_value()) {
    cnt = kv_num_blocks->contiguous();
    idx = kv_indices->contiguous();
  }
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const QkvShape qs{s.b, s.h, s.h_kv, s.lq, s.capacity, s.d, s.dv};
  auto [out, lse] = alloc_outputs(query, qs);
  DecodeParams p = set_params_decode(s, q, key_cache, value_cache, seqlens, k_new, v_new, bt, cnt, idx,
                                     kv_block, resolve_scale(scale, s.d), window_left, window_right);
  if (s.b == 0 || s.h == 0 || s.lq == 0) return {out, lse};
  const DecodePlan plan = plan_decode(p, cuda_device_info(query.get_device()), plan_options());
  TORCH_CHECK(plan.supported, "attention_with_kvcache: no CUDA decode kernel for this call (", plan.why, ")");
  p.o = out.data_ptr();
  p.o_batch_stride = out.stride(0);
  p.o_head_stride = out.stride(1);
  p.o_row_stride = out.stride(2);
  p.lse = lse.data_ptr<float>();
  at::Tensor o_part, lse_part;
  if (plan.num_splits > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    o_part = at::empty({plan.num_splits, s.b, s.h, s.lq, s.dv}, f32);
    lse_part = at::empty({plan.num_splits, s.b, s.h, s.lq}, f32);
    p.o_part = o_part.data_ptr<float>();
    p.lse_part = lse_part.data_ptr<float>();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = SA_HALF_DTYPE_SWITCH(p.dtype, kDtype, [&] {
    return SA_HEADDIM_SWITCH(plan.head_dim, kHeadDim,
                             [&] { return run_decode_fwd_<kDtype, kHeadDim>(p, plan, stream); });
  });
  check_launch(err, "kvcache_fwd");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> decode_block_select_cuda(const at::Tensor& block_scores,
                                                            const at::Tensor& cache_seqlens, int64_t k,
                                                            int64_t block_size, int64_t sinks,
                                                            int64_t recent) {
  TORCH_CHECK(block_scores.is_cuda() && block_scores.scalar_type() == at::kFloat && block_scores.dim() == 2,
              "block_scores must be a CUDA float32 tensor (B, num_blocks), got ", block_scores.sizes());
  check_int32(cache_seqlens, "cache_seqlens");
  check_same_device(block_scores, cache_seqlens, "cache_seqlens");
  const int64_t b = block_scores.size(0), nkb = block_scores.size(1);
  TORCH_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == b, "cache_seqlens must be (B=", b, ",)");
  TORCH_CHECK(k > 0 && nkb > 0 && b <= INT_MAX && nkb <= INT_MAX, "k and the block count must be positive");
  TORCH_CHECK(block_size > 0 && sinks >= 0 && recent >= 0,
              "block_size must be positive, sinks and recent >= 0");
  const c10::cuda::CUDAGuard guard(block_scores.device());
  const int64_t kk = std::min(k, nkb), ld = (nkb + 3) / 4 * 4;
  const auto i32 = block_scores.options().dtype(at::kInt);
  at::Tensor counts = at::empty({b}, i32), indices = at::empty({b, kk}, i32);
  at::Tensor work = at::empty({b, ld}, block_scores.options());
  const at::Tensor scores = block_scores.contiguous(), lens = cache_seqlens.contiguous();
  check_launch(run_decode_block_select(scores.data_ptr<float>(), work.data_ptr<float>(), ld,
                                       lens.data_ptr<int32_t>(), int(b), int(nkb), int(block_size), int(kk),
                                       int(std::min<int64_t>(sinks, INT_MAX)),
                                       int(std::min<int64_t>(recent, INT_MAX)), counts.data_ptr<int32_t>(),
                                       indices.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream()),
               "decode_block_select");
  return {counts, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(sparse_attn, CUDA, m) {
  m.impl("kvcache_fwd", &kvcache_fwd_cuda);
  m.impl("_decode_block_select", &decode_block_select_cuda);
}

}  // namespace sparse_attn
