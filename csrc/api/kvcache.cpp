// attention_with_kvcache glue shared by every build: the layout checks, the decode params, the
// route (CUDA kernel or the Python composite path) and the plan text. The CUDA op itself is in
// ops_decode_cuda.cpp.
#include <limits>
#include <sstream>

#include "common.h"

namespace sparse_attn {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

}  // namespace

KvCacheShape check_kvcache(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& cache_seqlens,
                           const c10::optional<at::Tensor>& key, const c10::optional<at::Tensor>& value,
                           const c10::optional<at::Tensor>& block_table,
                           const c10::optional<at::Tensor>& kv_num_blocks,
                           const c10::optional<at::Tensor>& kv_indices, int64_t kv_block) {
  TORCH_CHECK(query.dim() == 4, "query must be 4-D (B, H, Lq, D), got ", query.dim(), "-D");
  TORCH_CHECK(is_supported_dtype(query.scalar_type()),
              "query dtype must be float32, bfloat16 or float16, got ", query.scalar_type());
  KvCacheShape s{};
  s.b = query.size(0);
  s.h = query.size(1);
  s.lq = query.size(2);
  s.d = query.size(3);
  s.paged = block_table.has_value();
  const char* layout = s.paged ? "(num_pages, page_size, Hkv, D)" : "(B, Hkv, Lmax, D)";
  for (const auto& [t, name] : {std::pair{&key_cache, "key_cache"}, std::pair{&value_cache, "value_cache"}}) {
    TORCH_CHECK(t->dim() == 4, name, " must be 4-D ", layout, ", got ", t->dim(), "-D");
    check_same_device(query, *t, name);
    TORCH_CHECK(t->scalar_type() == query.scalar_type(), name, " must have query's dtype ",
                query.scalar_type(), ", got ", t->scalar_type());
    check_last_dim(*t, name);
  }
  TORCH_CHECK(key_cache.sizes().slice(0, 3) == value_cache.sizes().slice(0, 3),
              "key_cache and value_cache must agree in all but the last dimension, got ", key_cache.sizes(),
              " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.size(3) == s.d, "key_cache's head dimension must be query's (", s.d, "), got ",
              key_cache.size(3));
  s.dv = value_cache.size(3);
  check_head_dim(s.d, "query and key_cache");
  check_head_dim(s.dv, "value_cache");
  check_last_dim(query, "query");
  if (s.paged) {
    const at::Tensor& bt = *block_table;
    check_int32(bt, "block_table");
    check_same_device(query, bt, "block_table");
    TORCH_CHECK(bt.dim() == 2 && bt.size(0) == s.b, "block_table must be 2-D (B=", s.b, ", max_pages), got ",
                bt.sizes());
    TORCH_CHECK(bt.size(1) >= 1, "block_table must have at least one page per sequence");
    check_last_dim(bt, "block_table");
    s.num_pages = key_cache.size(0);
    s.page_size = key_cache.size(1);
    s.h_kv = key_cache.size(2);
    s.pages_per_seq = bt.size(1);
    TORCH_CHECK(s.page_size >= 1, "key_cache's page size must be at least 1, got ", s.page_size);
    TORCH_CHECK(s.num_pages <= kInt32Max, "too many pages (", s.num_pages, "); page indices are int32");
  } else {
    TORCH_CHECK(key_cache.size(0) == s.b, "key_cache must have query's batch size ", s.b,
                " in dimension 0, got ", key_cache.size(0), " (a paged cache needs block_table)");
    s.h_kv = key_cache.size(1);
    s.num_pages = s.b;
    s.page_size = key_cache.size(2);
    s.pages_per_seq = 1;
  }
  s.capacity = s.page_size * s.pages_per_seq;
  TORCH_CHECK(s.capacity <= kInt32Max, "a sequence's cache must hold fewer than 2^31 tokens, got ",
              s.capacity);
  TORCH_CHECK(s.lq <= kInt32Max && s.b <= kInt32Max && s.h <= kInt32Max, "sizes must be below 2^31");
  TORCH_CHECK(s.h_kv >= 1 && s.h % s.h_kv == 0, "the number of query heads (", s.h,
              ") must be a multiple of the cache's K/V heads (", s.h_kv, ")");
  check_int32(cache_seqlens, "cache_seqlens");
  check_same_device(query, cache_seqlens, "cache_seqlens");
  TORCH_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == s.b, "cache_seqlens must be 1-D (B=", s.b,
              ",), got ", cache_seqlens.sizes());
  TORCH_CHECK(key.has_value() == value.has_value(),
              "key and value must be given together (new tokens to append)");
  if (key.has_value()) {
    for (const auto& [t, name, dim] : {std::tuple{&*key, "key", s.d}, std::tuple{&*value, "value", s.dv}}) {
      TORCH_CHECK(t->dim() == 4 && t->size(0) == s.b && t->size(1) == s.h_kv && t->size(2) == s.lq &&
                      t->size(3) == dim,
                  name, " must have shape (B, Hkv, Lq, ", name[0] == 'k' ? "D" : "Dv", ") = (", s.b, ", ",
                  s.h_kv, ", ", s.lq, ", ", dim, "), got ", t->sizes());
      check_same_device(query, *t, name);
      TORCH_CHECK(t->scalar_type() == query.scalar_type(), name, " must have query's dtype ",
                  query.scalar_type(), ", got ", t->scalar_type());
      check_last_dim(*t, name);
    }
  }
  TORCH_CHECK(kv_num_blocks.has_value() == kv_indices.has_value(),
              "kv_num_blocks and kv_indices go together");
  if (kv_num_blocks.has_value()) {
    TORCH_CHECK(kv_block == 64 || kv_block == 128, "the mask's key block must be 64 or 128, got ", kv_block);
    const at::Tensor &cnt = *kv_num_blocks, &idx = *kv_indices;
    check_int32(cnt, "mask (kv_num_blocks)");
    check_int32(idx, "mask (kv_indices)");
    check_same_device(query, cnt, "mask");
    check_same_device(query, idx, "mask");
    TORCH_CHECK(cnt.dim() == 3 && (cnt.size(0) == 1 || cnt.size(0) == s.b) &&
                    (cnt.size(1) == 1 || cnt.size(1) == s.h_kv) && cnt.size(2) == 1,
                "a decode mask has one query block and 1 or Hkv=", s.h_kv,
                " heads: kv_num_blocks (1|B, 1|Hkv, 1), got ", cnt.sizes());
    TORCH_CHECK(
        idx.dim() == 4 && idx.size(0) == cnt.size(0) && idx.size(1) == cnt.size(1) && idx.size(2) == 1,
        "kv_indices must have shape (", cnt.size(0), ", ", cnt.size(1), ", 1, max_kv_blocks), got ",
        idx.sizes());
  }
  return s;
}

bool kvcache_aligned(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  for (const at::Tensor* t : {&key_cache, &value_cache}) {
    const int64_t elems = 16 / t->element_size();
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
    for (int64_t i = 0; i + 1 < t->dim(); ++i)
      if (t->size(i) > 1 && t->stride(i) % elems != 0) return false;
  }
  return true;
}

DecodeParams set_params_decode(const KvCacheShape& s, const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& cache_seqlens,
                               const c10::optional<at::Tensor>& key, const c10::optional<at::Tensor>& value,
                               const c10::optional<at::Tensor>& block_table,
                               const c10::optional<at::Tensor>& kv_num_blocks,
                               const c10::optional<at::Tensor>& kv_indices, int64_t kv_block, double scale,
                               int64_t window_left, int64_t window_right) {
  DecodeParams p = {};
  p.q = query.data_ptr();
  p.q_batch_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.q_row_stride = query.stride(2);
  p.k_cache = key_cache.data_ptr();
  p.v_cache = value_cache.data_ptr();
  // (page, slot, head) strides: a contiguous cache (B, Hkv, Lmax, D) is one page per sequence.
  const int page_dim = 0, slot_dim = s.paged ? 1 : 2, head_dim = s.paged ? 2 : 1;
  p.k_page_stride = key_cache.stride(page_dim);
  p.k_row_stride = key_cache.stride(slot_dim);
  p.k_head_stride = key_cache.stride(head_dim);
  p.v_page_stride = value_cache.stride(page_dim);
  p.v_row_stride = value_cache.stride(slot_dim);
  p.v_head_stride = value_cache.stride(head_dim);
  if (s.paged) {
    p.block_table = block_table->data_ptr<int32_t>();
    p.bt_batch_stride = block_table->stride(0);
  }
  p.num_pages = int(s.num_pages);
  p.page_size = int(s.page_size);
  p.capacity = int(s.capacity);
  p.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  if (key.has_value()) {
    p.k_new = key->data_ptr();
    p.v_new = value->data_ptr();
    p.kn_batch_stride = key->stride(0);
    p.kn_head_stride = key->stride(1);
    p.kn_row_stride = key->stride(2);
    p.vn_batch_stride = value->stride(0);
    p.vn_head_stride = value->stride(1);
    p.vn_row_stride = value->stride(2);
    p.lk_new = int(s.lq);
  }
  p.b = int(s.b);
  p.h = int(s.h);
  p.h_kv = int(s.h_kv);
  p.h_per_kv = int(s.h / s.h_kv);
  p.lq = int(s.lq);
  p.d = int(s.d);
  p.dv = int(s.dv);
  p.dtype = scalar_kind(query.scalar_type());
  p.scale = float(scale);
  p.scale_log2 = float(scale * M_LOG2E);
  p.window_left = int(std::min<int64_t>(window_left, kInt32Max));
  p.window_right = int(std::min<int64_t>(window_right, kInt32Max));
  p.num_splits = 1;
  p.num_ctas = 1;
  p.row_chunks = 1;
  p.chunk_rows = 16;
  if (kv_num_blocks.has_value()) {
    p.kv_num_blocks = kv_num_blocks->data_ptr<int32_t>();
    p.kv_indices = kv_indices->data_ptr<int32_t>();
    p.bs_batch_stride = kv_num_blocks->size(0) == 1 ? 0 : kv_num_blocks->size(1);
    p.bs_head_stride = kv_num_blocks->size(1) == 1 ? 0 : 1;
    p.max_kv_blocks = int(kv_indices->size(3));
    p.kv_block = int(kv_block);
  }
  return p;
}

namespace {

// The plan of a checked call on `device`, with its params when the kernel takes it.
DecodePlan kvcache_plan(const KvCacheShape& s, const DeviceInfo& device, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& key,
                        const c10::optional<at::Tensor>& value, const c10::optional<at::Tensor>& block_table,
                        const c10::optional<at::Tensor>& kv_num_blocks,
                        const c10::optional<at::Tensor>& kv_indices, int64_t kv_block, int64_t window_left,
                        int64_t window_right) {
  if (device.cc == 0) {
    DecodePlan plan;
    plan.why =
        "composite path: CPU tensors (the cache gathered per sequence, then dense_attention with the mask)";
    return plan;
  }
  if (!kvcache_aligned(key_cache, value_cache)) {
    DecodePlan plan;
    plan.why =
        "composite path: a cache's base or strides are not 16-byte aligned (the kernel writes in place)";
    return plan;
  }
  if (s.b == 0 || s.h == 0 || s.lq == 0) {
    DecodePlan plan;
    plan.why = "composite path: nothing to compute";
    return plan;
  }
  // No kernel runs: only shapes, strides and the device matter to the plan (the data pointers of
  // the real tensors stand in for the aligned copies).
  const DecodeParams p =
      set_params_decode(s, query, key_cache, value_cache, cache_seqlens, key, value, block_table,
                        kv_num_blocks, kv_indices, kv_block, 1.0, window_left, window_right);
  return plan_decode(p, device, plan_options());
}

}  // namespace

int64_t kvcache_route(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& key,
                      const c10::optional<at::Tensor>& value, const c10::optional<at::Tensor>& block_table,
                      const c10::optional<at::Tensor>& kv_num_blocks,
                      const c10::optional<at::Tensor>& kv_indices, int64_t kv_block) {
  const KvCacheShape s = check_kvcache(query, key_cache, value_cache, cache_seqlens, key, value, block_table,
                                       kv_num_blocks, kv_indices, kv_block);
  const DeviceInfo device = planned_device(query, 0, 0);
  return kvcache_plan(s, device, query, key_cache, value_cache, cache_seqlens, key, value, block_table,
                      kv_num_blocks, kv_indices, kv_block, -1, -1)
                 .supported
             ? 1
             : 0;
}

std::string explain_kvcache(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& cache_seqlens,
                            const c10::optional<at::Tensor>& key, const c10::optional<at::Tensor>& value,
                            const c10::optional<at::Tensor>& block_table,
                            const c10::optional<at::Tensor>& kv_num_blocks,
                            const c10::optional<at::Tensor>& kv_indices, int64_t kv_block,
                            int64_t window_left, int64_t window_right, int64_t target_cc,
                            int64_t target_sms) {
  const KvCacheShape s = check_kvcache(query, key_cache, value_cache, cache_seqlens, key, value, block_table,
                                       kv_num_blocks, kv_indices, kv_block);
  const DeviceInfo device = planned_device(query, target_cc, target_sms);
  const DecodePlan plan =
      kvcache_plan(s, device, query, key_cache, value_cache, cache_seqlens, key, value, block_table,
                   kv_num_blocks, kv_indices, kv_block, window_left, window_right);
  std::ostringstream out;
  if (!plan.supported) {
    out << "core=" << (device.cc == 0 ? "cpu" : "cublas") << "\nwhy_core=" << plan.why;
    return out.str();
  }
  out << "core=portable\nhead_dim=" << plan.head_dim << "\nrow_tiles=" << plan.row_tiles
      << "\nrow_chunks=" << plan.row_chunks << "\nnum_splits=" << plan.num_splits
      << "\nctas=" << plan.num_ctas
      << "\nbalanced=" << int(plan.num_ctas < s.b * s.h_kv * plan.row_chunks * plan.num_splits)
      << "\nctas_per_sm=" << plan.ctas_per_sm << "\ndependent_launch=" << int(plan.dependent_launch)
      << "\nkey_tiles=" << plan.est_key_tiles << "\nappend=" << int(key.has_value())
      << "\npaged=" << int(s.paged) << "\nwhy_core=" << plan.why;
  return out.str();
}

}  // namespace sparse_attn
