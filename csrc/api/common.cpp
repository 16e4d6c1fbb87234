#include "common.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>

#include "sparse_attn/document_mask.h"
#include "sparse_attn/selection_mask.h"

namespace sparse_attn {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

}  // namespace

bool is_supported_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void check_head_dim(int64_t d, const char* what) {
  TORCH_CHECK(d >= 8 && d <= kMaxHeadDim && d % 8 == 0, "head dimension of ", what,
              " must be a multiple of 8 in [8, ", kMaxHeadDim, "], got ", d);
}

void check_last_dim(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, name,
              " must have stride 1 in its last dimension, got strides ", t.strides());
}

void check_int32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
}

ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ScalarKind::kFloat32;
    case at::kBFloat16:
      return ScalarKind::kBFloat16;
    case at::kHalf:
      return ScalarKind::kFloat16;
    default:
      TORCH_CHECK(false, "unsupported dtype ", t, "; supported: float32, bfloat16, float16");
  }
}

void check_tensor_core_head_dims(const QkvShape& s) {
  TORCH_CHECK(s.dv == s.d,
              "on CUDA the value head dimension must equal the query head dimension, got D=", s.d,
              " and Dv=", s.dv);
}

at::Tensor aligned_copy(const at::Tensor& t, bool data) {
  const int64_t elems = 16 / t.element_size();
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t i = 0; ok && i + 1 < t.dim(); ++i) ok = t.size(i) <= 1 || t.stride(i) % elems == 0;
  if (ok) return t;
  return data ? t.clone(at::MemoryFormat::Contiguous) : at::empty(t.sizes(), t.options());
}

QkvShape check_qkv(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(query.dim() == 4, "query must be 4-D (B, H, Lq, D), got ", query.dim(), "-D");
  TORCH_CHECK(key.dim() == 4, "key must be 4-D (B, Hkv, Lk, D), got ", key.dim(), "-D");
  TORCH_CHECK(value.dim() == 4, "value must be 4-D (B, Hkv, Lk, Dv), got ", value.dim(), "-D");
  TORCH_CHECK(key.device() == query.device(), "query and key must be on the same device, got ",
              query.device(), " and ", key.device());
  TORCH_CHECK(value.device() == query.device(), "query and value must be on the same device, got ",
              query.device(), " and ", value.device());
  TORCH_CHECK(is_supported_dtype(query.scalar_type()),
              "query dtype must be float32, bfloat16 or float16, got ", query.scalar_type());
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "query and key must have the same dtype, got ",
              query.scalar_type(), " and ", key.scalar_type());
  TORCH_CHECK(value.scalar_type() == query.scalar_type(), "query and value must have the same dtype, got ",
              query.scalar_type(), " and ", value.scalar_type());

  QkvShape s{query.size(0), query.size(1), key.size(1),  query.size(2),
             key.size(2),   query.size(3), value.size(3)};
  TORCH_CHECK(key.size(0) == s.b && value.size(0) == s.b,
              "query, key and value must have the same batch size, got ", s.b, ", ", key.size(0), ", ",
              value.size(0));
  TORCH_CHECK(value.size(1) == s.h_kv, "key and value must have the same number of heads, got ", s.h_kv,
              " and ", value.size(1));
  TORCH_CHECK(value.size(2) == s.lk, "key and value must have the same sequence length, got ", s.lk, " and ",
              value.size(2));
  TORCH_CHECK(key.size(3) == s.d, "query and key must have the same head dimension, got ", s.d, " and ",
              key.size(3));
  if (s.h_kv == 0) {
    TORCH_CHECK(s.h == 0, "key has 0 heads but query has ", s.h);
  } else {
    TORCH_CHECK(s.h % s.h_kv == 0, "the number of query heads (", s.h,
                ") must be a multiple of the number of key/value heads (", s.h_kv, ")");
  }
  check_head_dim(s.d, "query and key");
  check_head_dim(s.dv, "value");
  check_last_dim(query, "query");
  check_last_dim(key, "key");
  check_last_dim(value, "value");
  TORCH_CHECK(s.lq <= kInt32Max && s.lk <= kInt32Max, "sequence lengths must be below 2^31, got Lq=", s.lq,
              ", Lk=", s.lk);
  TORCH_CHECK(s.b <= kInt32Max && s.h <= kInt32Max, "batch and head counts must be below 2^31");
  return s;
}

void check_same_device(const at::Tensor& query, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == query.device(), name, " must be on the same device as query (", query.device(),
              "), got ", t.device());
}

std::tuple<at::Tensor, at::Tensor> alloc_outputs(const at::Tensor& query, const QkvShape& s) {
  at::Tensor out = at::empty({s.b, s.lq, s.h, s.dv}, query.options()).transpose(1, 2);
  at::Tensor lse = at::empty({s.b, s.h, s.lq}, query.options().dtype(at::kFloat));
  return {out, lse};
}

void check_given_outputs(const at::Tensor& query, const QkvShape& s, const at::Tensor& out,
                         const at::Tensor& lse) {
  TORCH_CHECK(out.device() == query.device() && out.scalar_type() == query.scalar_type(),
              "out must have query's dtype and device (", query.scalar_type(), ", ", query.device(),
              "), got ", out.scalar_type(), ", ", out.device());
  TORCH_CHECK(out.dim() == 4 && out.size(0) == s.b && out.size(1) == s.h && out.size(2) == s.lq &&
                  out.size(3) == s.dv,
              "out must be (B, H, Lq, Dv) = (", s.b, ", ", s.h, ", ", s.lq, ", ", s.dv, "), got ",
              out.sizes());
  const int64_t align = 16 / int64_t(out.element_size());
  TORCH_CHECK(out.stride(3) == 1 && out.stride(0) % align == 0 && out.stride(1) % align == 0 &&
                  out.stride(2) % align == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "out must have unit stride along Dv and 16-byte aligned base and strides, got strides ",
              out.strides());
  TORCH_CHECK(lse.device() == query.device() && lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                  lse.size(0) == s.b && lse.size(1) == s.h && lse.size(2) == s.lq && lse.is_contiguous(),
              "lse must be a contiguous float32 (B, H, Lq) = (", s.b, ", ", s.h, ", ", s.lq,
              ") tensor on query's device, got ", lse.scalar_type(), " ", lse.sizes());
}

bool fill_trivial_outputs(const QkvShape& s, at::Tensor& out, at::Tensor& lse) {
  if (s.b == 0 || s.h == 0 || s.lq == 0) return true;
  if (s.lk == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return true;
  }
  return false;
}

double resolve_scale(const c10::optional<double>& scale, int64_t d) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(double(d));
}

AttnFwdParams set_params_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& lse, const QkvShape& s, double scale) {
  AttnFwdParams params = {};
  params.q = q.data_ptr();
  params.k = k.data_ptr();
  params.v = v.data_ptr();
  params.o = out.data_ptr();
  params.lse = lse.data_ptr<float>();
  params.q_batch_stride = q.stride(0);
  params.q_head_stride = q.stride(1);
  params.q_row_stride = q.stride(2);
  params.k_batch_stride = k.stride(0);
  params.k_head_stride = k.stride(1);
  params.k_row_stride = k.stride(2);
  params.v_batch_stride = v.stride(0);
  params.v_head_stride = v.stride(1);
  params.v_row_stride = v.stride(2);
  params.o_batch_stride = out.stride(0);
  params.o_head_stride = out.stride(1);
  params.o_row_stride = out.stride(2);
  params.b = int(s.b);
  params.h = int(s.h);
  params.h_kv = int(s.h_kv);
  params.lq = int(s.lq);
  params.lk = int(s.lk);
  params.d = int(s.d);
  params.dv = int(s.dv);
  params.h_per_kv = s.h_kv > 0 ? int(s.h / s.h_kv) : 1;
  params.dtype = scalar_kind(q.scalar_type());
  params.scale = float(scale);
  params.scale_log2 = float(scale * M_LOG2E);
  params.window_left = -1;
  params.window_right = -1;
  params.kv_offset = int(s.lk - s.lq);
  params.mask_kind = DenseMaskKind::kNone;
  return params;
}

BwdTensors set_params_bwd(AttnBwdParams& params, const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                          const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_lse) {
  check_same_device(query, grad_out, "grad_out");
  check_same_device(query, out, "out");
  check_same_device(query, lse, "lse");
  TORCH_CHECK(grad_out.sizes() == out.sizes() && out.size(0) == query.size(0) &&
                  out.size(1) == query.size(1) && out.size(2) == query.size(2) &&
                  out.size(3) == value.size(3),
              "grad_out and out must have the output's shape (B, H, Lq, Dv), got ", grad_out.sizes(), " and ",
              out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(),
              "grad_out and out must have the query's dtype");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == query.size(0) &&
                  lse.size(1) == query.size(1) && lse.size(2) == query.size(2),
              "lse must be float32 (B, H, Lq), got ", lse.scalar_type(), " ", lse.sizes());
  BwdTensors t;
  t.dout = grad_out.stride(-1) == 1 ? grad_out : grad_out.contiguous();
  t.lse = lse.contiguous();
  params.fwd.lse = t.lse.data_ptr<float>();
  params.dout = t.dout.data_ptr();
  params.do_batch_stride = t.dout.stride(0);
  params.do_head_stride = t.dout.stride(1);
  params.do_row_stride = t.dout.stride(2);
  params.dlse = nullptr;
  if (grad_lse.has_value() && grad_lse->defined()) {
    check_same_device(query, *grad_lse, "grad_lse");
    TORCH_CHECK(grad_lse->sizes() == lse.sizes(), "grad_lse must have the LSE's shape ", lse.sizes(),
                ", got ", grad_lse->sizes());
    t.dlse = grad_lse->to(at::kFloat).contiguous();
    params.dlse = t.dlse.data_ptr<float>();
  }
  t.dq = at::empty(query.sizes(), query.options());
  t.dk = at::empty(key.sizes(), key.options());
  t.dv = at::empty(value.sizes(), value.options());
  params.dq = t.dq.data_ptr();
  params.dk = t.dk.data_ptr();
  params.dv = t.dv.data_ptr();
  return t;
}

void set_params_window(AttnFwdParams& params, bool causal, int64_t window_left, int64_t window_right) {
  TORCH_CHECK(window_left >= -1, "window_left must be -1 (unbounded) or >= 0, got ", window_left);
  TORCH_CHECK(window_right >= -1, "window_right must be -1 (unbounded) or >= 0, got ", window_right);
  if (causal) window_right = 0;
  // A bound that reaches past every key is no bound; clamping keeps the index math in int32.
  if (window_left >= params.lk) window_left = -1;
  if (window_right >= params.lq) window_right = -1;
  params.window_left = int(window_left);
  params.window_right = int(window_right);
}

at::Tensor set_params_dense_mask(AttnFwdParams& params, const at::Tensor& query, const QkvShape& s,
                                 const c10::optional<at::Tensor>& attn_mask) {
  params.mask_kind = DenseMaskKind::kNone;
  if (!attn_mask.has_value() || !attn_mask->defined()) return at::Tensor();
  const at::Tensor& m = *attn_mask;
  check_same_device(query, m, "attn_mask");
  const bool is_bool = m.scalar_type() == at::kBool;
  TORCH_CHECK(is_bool || at::isFloatingType(m.scalar_type()),
              "attn_mask must be bool (True = attend) or floating point (added to the scores), got ",
              m.scalar_type());
  const std::vector<int64_t> target{s.b, s.h, s.lq, s.lk};
  bool ok = m.dim() <= 4;
  for (int64_t i = 0; ok && i < m.dim(); ++i) {
    const int64_t sz = m.size(m.dim() - 1 - i), want = target[3 - i];
    ok = sz == 1 || sz == want;
  }
  TORCH_CHECK(ok, "attn_mask of shape ", m.sizes(),
              " cannot be broadcast to (B, H, Lq, Lk) = ", at::IntArrayRef(target));
  at::Tensor mm = is_bool ? m : m.to(at::kFloat);
  mm = mm.expand(target);
  if (mm.stride(3) != 1) mm = mm.contiguous();
  params.attn_mask = mm.data_ptr();
  params.mask_batch_stride = mm.stride(0);
  params.mask_head_stride = mm.stride(1);
  params.mask_row_stride = mm.stride(2);
  params.mask_kind = is_bool ? DenseMaskKind::kBool : DenseMaskKind::kAdditive;
  return mm;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> set_params_block_sparse(
    AttnFwdParams& params, const at::Tensor& query, const QkvShape& s, const at::Tensor& kv_num_blocks,
    const at::Tensor& kv_indices, const at::Tensor& kv_partial, const at::Tensor& partial_masks,
    int64_t q_block, int64_t kv_block) {
  TORCH_CHECK(q_block == 64 || q_block == 128, "q_block must be 64 or 128, got ", q_block);
  TORCH_CHECK(kv_block == 64 || kv_block == 128, "kv_block must be 64 or 128, got ", kv_block);
  const std::pair<const at::Tensor*, const char*> all[] = {{&kv_num_blocks, "kv_num_blocks"},
                                                           {&kv_indices, "kv_indices"},
                                                           {&kv_partial, "kv_partial"},
                                                           {&partial_masks, "partial_masks"}};
  for (const auto& [t, name] : all) {
    check_int32(*t, name);
    check_same_device(query, *t, name);
  }
  const int64_t nqb = (s.lq + q_block - 1) / q_block, nkb = (s.lk + kv_block - 1) / kv_block;
  TORCH_CHECK(kv_num_blocks.dim() == 3, "kv_num_blocks must be 3-D (B|1, H|1, num_q_blocks), got ",
              kv_num_blocks.sizes());
  const int64_t bm = kv_num_blocks.size(0), hm = kv_num_blocks.size(1);
  TORCH_CHECK(bm == 1 || bm == s.b, "the mask's batch dimension must be 1 or B=", s.b, ", got ", bm);
  TORCH_CHECK(hm == 1 || hm == s.h, "the mask's head dimension must be 1 or H=", s.h, ", got ", hm);
  TORCH_CHECK(kv_num_blocks.size(2) == nqb, "the mask has ", kv_num_blocks.size(2),
              " query blocks but Lq=", s.lq, " with q_block=", q_block, " needs ", nqb,
              "; build the mask for this sequence length");
  TORCH_CHECK(kv_indices.dim() == 4 && kv_indices.size(0) == bm && kv_indices.size(1) == hm &&
                  kv_indices.size(2) == nqb,
              "kv_indices must have shape (", bm, ", ", hm, ", ", nqb, ", max_kv_blocks), got ",
              kv_indices.sizes());
  TORCH_CHECK(kv_partial.sizes() == kv_indices.sizes(), "kv_partial must have the shape of kv_indices ",
              kv_indices.sizes(), ", got ", kv_partial.sizes());
  TORCH_CHECK(
      partial_masks.dim() == 3 && partial_masks.size(1) == q_block && partial_masks.size(2) == kv_block / 32,
      "partial_masks must have shape (P, ", q_block, ", ", kv_block / 32, "), got ", partial_masks.sizes());
  TORCH_CHECK(partial_masks.size(0) <= kInt32Max / (q_block * kv_block / 32), "too many partial blocks");

  at::Tensor cnt = kv_num_blocks.contiguous(), idx = kv_indices.contiguous(), part = kv_partial.contiguous(),
             bits = partial_masks.contiguous();
  // The Hopper kernel reads a row of mask words as 16-byte loads (load_tile_mask).
  if (reinterpret_cast<uintptr_t>(bits.data_ptr()) % 16 != 0) bits = bits.clone();
  params.kv_num_blocks = cnt.data_ptr<int32_t>();
  params.kv_indices = idx.data_ptr<int32_t>();
  params.kv_partial = part.data_ptr<int32_t>();
  params.partial_masks = bits.data_ptr<int32_t>();
  params.bs_batch_stride = bm == 1 ? 0 : hm * nqb;
  params.bs_head_stride = hm == 1 ? 0 : nqb;
  params.q_block = int(q_block);
  params.kv_block = int(kv_block);
  params.num_q_blocks = int(nqb);
  params.num_kv_blocks = int(nkb);
  params.max_kv_blocks = int(idx.size(3));
  params.num_partial = int(bits.size(0));
  return {cnt, idx, part, bits};
}

at::Tensor set_params_block_order(AttnFwdParams& params, const at::Tensor& query,
                                  const c10::optional<at::Tensor>& q_block_order) {
  params.q_block_order = nullptr;
  if (!q_block_order.has_value() || !q_block_order->defined()) return at::Tensor();
  const at::Tensor& order = *q_block_order;
  check_int32(order, "q_block_order");
  check_same_device(query, order, "q_block_order");
  TORCH_CHECK(order.dim() == 1 && order.size(0) == params.num_q_blocks + 1, "q_block_order must have shape (",
              params.num_q_blocks + 1, ",) (nQb + 1), got ", order.sizes());
  // No device check of the values (that would synchronise): the kernel skips any value outside
  // [0, nQb) (tile_of_cta), so a malformed order cannot read out of range; block_sparse_attention
  // always passes a permutation (an argsort) and a count in [0, nQb], which is what every output
  // row needs.
  at::Tensor c = order.contiguous();
  params.q_block_order = c.data_ptr<int32_t>();
  return c;
}

void set_params_gather(AttnFwdParams& params, const at::Tensor& query, const QkvShape& s,
                       const at::Tensor& indices) {
  check_int32(indices, "indices");
  check_same_device(query, indices, "indices");
  TORCH_CHECK(indices.dim() == 4, "indices must be 4-D (B, Hi, Lq, k), got ", indices.sizes());
  const int64_t hi = indices.size(1);
  const bool heads_ok = s.h == 0 ? hi <= 1 : (hi >= 1 && s.h % hi == 0);
  TORCH_CHECK(indices.size(0) == s.b && indices.size(2) == s.lq && heads_ok,
              "indices must have shape (B=", s.b, ", Hi, Lq=", s.lq, ", k) with H=", s.h,
              " a multiple of Hi, got ", indices.sizes());
  TORCH_CHECK(indices.stride(3) == 1 || indices.size(3) <= 1,
              "indices must have stride 1 in its last dimension");
  TORCH_CHECK(indices.size(3) <= kInt32Max, "k must be below 2^31");
  params.indices = indices.data_ptr<int32_t>();
  params.idx_batch_stride = indices.stride(0);
  params.idx_head_stride = indices.stride(1);
  params.idx_row_stride = indices.stride(2);
  params.h_idx = int(hi);
  params.h_per_idx = hi > 0 ? int(s.h / hi) : 1;
  params.topk = int(indices.size(3));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> set_params_document_mask(
    DocumentMaskParams& params, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const at::Tensor& partial_offsets, int64_t num_partial, int64_t total_q, int64_t total_k, int64_t q_block,
    int64_t kv_block, int64_t window_left, int64_t window_right, int64_t max_kb) {
  check_int32(cu_seqlens_q, "cu_seqlens_q");
  check_int32(cu_seqlens_k, "cu_seqlens_k");
  check_same_device(cu_seqlens_q, cu_seqlens_k, "cu_seqlens_k");
  check_same_device(cu_seqlens_q, partial_offsets, "partial_offsets");
  TORCH_CHECK(
      cu_seqlens_q.dim() == 1 && cu_seqlens_q.numel() >= 1 && cu_seqlens_k.sizes() == cu_seqlens_q.sizes(),
      "cu_seqlens_q and cu_seqlens_k must be 1-D (B + 1,) of one size, got ", cu_seqlens_q.sizes(), " and ",
      cu_seqlens_k.sizes());
  TORCH_CHECK((q_block == 64 || q_block == 128) && (kv_block == 64 || kv_block == 128),
              "q_block and kv_block must be 64 or 128, got ", q_block, " and ", kv_block);
  TORCH_CHECK(total_q >= 0 && total_q <= INT_MAX && total_k >= 0 && total_k <= INT_MAX,
              "total_q and total_k must be in [0, 2^31), got ", total_q, " and ", total_k);
  TORCH_CHECK(window_left >= -1 && window_right >= -1 && window_left <= INT_MAX && window_right <= INT_MAX,
              "window_left and window_right must be -1 (unbounded) or non-negative ints");
  const int64_t b = cu_seqlens_q.numel() - 1;
  const int64_t nqb = (total_q + q_block - 1) / q_block, nkb = (total_k + kv_block - 1) / kv_block;
  TORCH_CHECK(b > 0 || total_q == 0, "total_q must be 0 for an empty batch, got ", total_q);
  TORCH_CHECK(partial_offsets.scalar_type() == at::kLong && partial_offsets.dim() == 1 &&
                  partial_offsets.numel() == nqb + 1,
              "partial_offsets must be int64 (nQb + 1 = ", nqb + 1, ",), got ", partial_offsets.scalar_type(),
              " ", partial_offsets.sizes());
  TORCH_CHECK(cu_seqlens_q.is_contiguous() && cu_seqlens_k.is_contiguous() && partial_offsets.is_contiguous(),
              "cu_seqlens_q, cu_seqlens_k and partial_offsets must be contiguous");
  TORCH_CHECK(max_kb >= 0 && max_kb <= nkb && num_partial >= 0, "max_kb must be in [0, ", nkb,
              "] and num_partial >= 0, got ", max_kb, " and ", num_partial);
  const auto i32 = cu_seqlens_q.options().dtype(at::kInt);
  at::Tensor num = at::empty({1, 1, nqb}, i32);
  at::Tensor kvi = at::empty({1, 1, nqb, max_kb}, i32);
  at::Tensor kvp = at::empty({1, 1, nqb, max_kb}, i32);
  at::Tensor words = at::zeros({num_partial, q_block, kv_block / 32}, i32);  // rows not used stay 0
  params = {};
  params.cu_q = cu_seqlens_q.data_ptr<int32_t>();
  params.cu_k = cu_seqlens_k.data_ptr<int32_t>();
  params.partial_offsets = partial_offsets.data_ptr<int64_t>();
  params.num_partial = num_partial;
  params.b = int(b);
  params.total_q = int(total_q);
  params.total_k = int(total_k);
  params.q_block = int(q_block);
  params.kv_block = int(kv_block);
  params.nqb = int(nqb);
  params.nkb = int(nkb);
  params.max_kb = int(max_kb);
  params.window_left = int(window_left);
  params.window_right = int(window_right);
  params.kv_num_blocks = num.data_ptr<int32_t>();
  params.kv_indices = kvi.data_ptr<int32_t>();
  params.kv_partial = kvp.data_ptr<int32_t>();
  params.words = reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>());
  return {num, kvi, kvp, words};
}

namespace {

// The checks and geometry _selection_mask and _selection_union share: params but the outputs.
// Returns (partial rows per (b, g), the longest list).
std::pair<int64_t, int64_t> selection_geometry(SelectionMaskParams& params, at::Tensor& indices,
                                               int64_t key_length, int64_t heads, int64_t q_block,
                                               int64_t kv_block, bool causal, int64_t row_offset,
                                               int64_t entry_block) {
  check_int32(indices, "indices");
  TORCH_CHECK(entry_block == 1 || entry_block == 64 || entry_block == 128,
              "entry_block must be 1 (keys), 64 or 128 (key blocks), got ", entry_block);
  TORCH_CHECK(indices.dim() == 4, "indices must be 4-D (B, G, Lq, k), got ", indices.sizes());
  TORCH_CHECK((q_block == 64 || q_block == 128) && (kv_block == 64 || kv_block == 128),
              "q_block and kv_block must be 64 or 128, got ", q_block, " and ", kv_block);
  TORCH_CHECK(key_length > 0 && key_length <= INT_MAX, "key_length must be in [1, 2^31), got ", key_length);
  const int64_t b = indices.size(0), g = indices.size(1), lq = indices.size(2), k = indices.size(3);
  TORCH_CHECK(g > 0 && heads > 0 && heads % g == 0, "heads (", heads, ") must be a multiple of the groups (",
              g, ")");
  TORCH_CHECK(lq <= INT_MAX && k <= INT_MAX && b <= 65535 && g <= 65535,
              "indices too large: ", indices.sizes());
  const int64_t nkb = (key_length + kv_block - 1) / kv_block, nqb = (lq + q_block - 1) / q_block;
  // The CUDA builder keeps three bits per key block in 48 KiB of shared memory.
  TORCH_CHECK(nkb <= 4095 * 32, "key_length ", key_length, " has more than ", 4095 * 32, " key blocks of ",
              kv_block);
  indices = indices.stride(-1) == 1 ? indices : indices.contiguous();
  int64_t pairs = 0, max_kb = 0;
  for (int64_t qb = 0; qb < nqb; ++qb) {
    const int cap =
        selection_block_cap(int(qb), int(lq), int(q_block), int(kv_block), int(nkb), causal, row_offset);
    pairs += cap;
    max_kb = std::max<int64_t>(max_kb, cap);
  }
  const int64_t out_heads = g == 1 ? 1 : heads;
  params = {};
  params.indices = indices.data_ptr<int32_t>();
  params.entry_block = int(entry_block);
  params.idx_batch_stride = indices.stride(0);
  params.idx_group_stride = indices.stride(1);
  params.idx_row_stride = indices.stride(2);
  params.b = int(b);
  params.g = int(g);
  params.lq = int(lq);
  params.k = int(k);
  params.lk = int(key_length);
  params.q_block = int(q_block);
  params.kv_block = int(kv_block);
  params.nqb = int(nqb);
  params.nkb = int(nkb);
  params.max_kb = int(max_kb);
  params.heads_per_group = int(out_heads / g);
  params.out_heads = int(out_heads);
  params.causal = causal;
  params.row_offset = row_offset;
  params.pairs = pairs;
  return {pairs, max_kb};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> set_params_selection_mask(
    SelectionMaskParams& params, at::Tensor& indices, int64_t key_length, int64_t heads, int64_t q_block,
    int64_t kv_block, bool causal, int64_t row_offset, int64_t entry_block) {
  const auto [pairs, max_kb] = selection_geometry(params, indices, key_length, heads, q_block, kv_block,
                                                  causal, row_offset, entry_block);
  const auto i32 = indices.options().dtype(at::kInt);
  at::Tensor num = at::empty({params.b, params.out_heads, params.nqb}, i32);
  at::Tensor kvi = at::empty({params.b, params.out_heads, params.nqb, max_kb}, i32);
  at::Tensor kvp = at::empty({params.b, params.out_heads, params.nqb, max_kb}, i32);
  at::Tensor words = at::zeros({params.b * params.g * pairs, q_block, kv_block / 32}, i32);
  params.kv_num_blocks = num.data_ptr<int32_t>();
  params.kv_indices = kvi.data_ptr<int32_t>();
  params.kv_partial = kvp.data_ptr<int32_t>();
  params.words = reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>());
  return {num, kvi, kvp, words};
}

int set_params_selection_union(SelectionMaskParams& params, at::Tensor& indices, int64_t key_length,
                               int64_t q_block, int64_t kv_block, bool causal, int64_t row_offset,
                               int64_t entry_block, int64_t samples) {
  const int64_t groups = indices.dim() == 4 ? std::max<int64_t>(1, indices.size(1)) : 1;
  selection_geometry(params, indices, key_length, groups, q_block, kv_block, causal, row_offset, entry_block);
  TORCH_CHECK(samples == -1 || (samples >= 1 && samples <= params.nqb),
              "samples must be -1 (every query block) or in [1, ", params.nqb, "], got ", samples);
  return samples == -1 ? params.nqb : int(samples);
}

at::Tensor set_params_select(TopkSelectParams& params, const at::Tensor& query, const at::Tensor& key,
                             int64_t k, bool causal) {
  const QkvShape s = check_qkv(query, key, key);
  TORCH_CHECK(k > 0, "k must be positive, got ", k);
  const int64_t kk = std::min(k, s.lk);
  at::Tensor out = at::empty({s.b, s.h, s.lq, kk}, query.options().dtype(at::kInt));
  params = {};
  params.q = query.data_ptr();
  params.k = key.data_ptr();
  params.q_batch_stride = query.stride(0);
  params.q_head_stride = query.stride(1);
  params.q_row_stride = query.stride(2);
  params.k_batch_stride = key.stride(0);
  params.k_head_stride = key.stride(1);
  params.k_row_stride = key.stride(2);
  params.out = out.data_ptr<int32_t>();
  params.b = int(s.b);
  params.h = int(s.h);
  params.h_kv = int(s.h_kv);
  params.lq = int(s.lq);
  params.lk = int(s.lk);
  params.d = int(s.d);
  params.topk = int(kk);
  params.h_sel = int(s.h);
  params.h_per_kv = s.h_kv > 0 ? int(s.h / s.h_kv) : 1;
  params.kv_offset = int(s.lk - s.lq);
  params.causal = causal;
  params.indexer = false;
  params.dtype = scalar_kind(query.scalar_type());
  return out;
}

at::Tensor set_params_indexer(TopkSelectParams& params, const at::Tensor& index_query,
                              const at::Tensor& index_key, const at::Tensor& index_weights, int64_t k,
                              bool causal) {
  TORCH_CHECK(index_query.dim() == 4, "index_query must be 4-D (B, Lq, HI, DI), got ", index_query.sizes());
  TORCH_CHECK(index_key.dim() == 3, "index_key must be 3-D (B, Lk, DI), got ", index_key.sizes());
  TORCH_CHECK(index_weights.dim() == 3, "index_weights must be 3-D (B, Lq, HI), got ", index_weights.sizes());
  check_same_device(index_query, index_key, "index_key");
  check_same_device(index_query, index_weights, "index_weights");
  TORCH_CHECK(is_supported_dtype(index_query.scalar_type()),
              "index_query dtype must be float32, bfloat16 or float16, got ", index_query.scalar_type());
  TORCH_CHECK(index_key.scalar_type() == index_query.scalar_type() &&
                  index_weights.scalar_type() == index_query.scalar_type(),
              "index_query, index_key and index_weights must have the same dtype");
  const int64_t b = index_query.size(0), lq = index_query.size(1), hi = index_query.size(2),
                di = index_query.size(3), lk = index_key.size(1);
  TORCH_CHECK(index_key.size(0) == b && index_key.size(2) == di, "index_key must have shape (B=", b,
              ", Lk, DI=", di, "), got ", index_key.sizes());
  SA_CHECK_SHAPE(index_weights, b, lq, hi);
  TORCH_CHECK(hi >= 1, "index_query needs at least one indexer head");
  check_head_dim(di, "index_query and index_key");
  check_last_dim(index_query, "index_query");
  check_last_dim(index_key, "index_key");
  check_last_dim(index_weights, "index_weights");
  TORCH_CHECK(k > 0, "k must be positive, got ", k);
  TORCH_CHECK(lq <= kInt32Max && lk <= kInt32Max, "sequence lengths must be below 2^31");
  const int64_t kk = std::min(k, lk);
  at::Tensor out = at::empty({b, 1, lq, kk}, index_query.options().dtype(at::kInt));
  params = {};
  params.iq = index_query.data_ptr();
  params.ik = index_key.data_ptr();
  params.iw = index_weights.data_ptr();
  params.iq_batch_stride = index_query.stride(0);
  params.iq_row_stride = index_query.stride(1);
  params.iq_head_stride = index_query.stride(2);
  params.ik_batch_stride = index_key.stride(0);
  params.ik_row_stride = index_key.stride(1);
  params.iw_batch_stride = index_weights.stride(0);
  params.iw_row_stride = index_weights.stride(1);
  params.hi = int(hi);
  params.di = int(di);
  params.out = out.data_ptr<int32_t>();
  params.b = int(b);
  params.h = 1;
  params.h_kv = 1;
  params.lq = int(lq);
  params.lk = int(lk);
  params.topk = int(kk);
  params.h_sel = 1;
  params.h_per_kv = 1;
  params.kv_offset = int(lk - lq);
  params.causal = causal;
  params.indexer = true;
  params.dtype = scalar_kind(index_query.scalar_type());
  return out;
}

// ---------------------------------------------------------------------------------------- plans

namespace {

std::string describe(const FlashPlan& plan) {
  std::ostringstream out;
  out << "core=" << core_name(plan.core) << "\ntile=" << plan.tile.block_m << "x" << plan.tile.block_n
      << "\nschedule=" << schedule_name(plan.schedule);
  if (plan.core != Core::kCpu) out << "\nwarps=" << plan.tile.warps;
  if (plan.core == Core::kHopper) out << "\nmerge_boundary=" << int(plan.merge_boundary);
  out << "\nwhy_core=" << plan.why_core << "\nwhy_tile=" << plan.why_tile
      << "\nwhy_schedule=" << plan.why_schedule;
  return out.str();
}

std::string describe(const BwdPlan& plan) {
  std::ostringstream out;
  const bool tensor_cores = plan.core == Core::kHopper || plan.core == Core::kPortable;
  out << "core=" << core_name(plan.core) << "\ntile=" << plan.block_m << "x" << plan.block_n << "\nschedule="
      << (tensor_cores              ? "key_blocks"
          : plan.core == Core::kCpu ? "query_tiles"
                                    : "rows");
  if (tensor_cores)
    out << "\nhead_splits=" << plan.head_splits << "\nhead_group=" << plan.head_group
        << "\ndq=" << dq_mode_name(plan.dq);
  out << "\nwhy_core=" << plan.why_core << "\nwhy_tile=" << plan.why_tile
      << "\nwhy_schedule=" << plan.why_schedule;
  return out.str();
}

std::string nothing_to_compute() {
  return "core=none\nwhy_core=nothing to compute (no batch, head or query, or no key: output 0, LSE -inf); "
         "no "
         "kernel runs";
}

// The params the op would fill, on the layout it would run on (CUDA: aligned for the tensor cores).
struct PlannedInputs {
  QkvShape s;
  AttnFwdParams params;
  at::Tensor out, lse, q, k, v;
};

PlannedInputs plan_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const DeviceInfo& device, bool aligned) {
  PlannedInputs in{check_qkv(query, key, value), {}, {}, {}, query, key, value};
  if (device.cc > 0 && aligned) {
    check_tensor_core_head_dims(in.s);
    in.q = aligned_copy(query, false);
    in.k = aligned_copy(key, false);
    in.v = aligned_copy(value, false);
  }
  std::tie(in.out, in.lse) = alloc_outputs(query, in.s);
  in.params = set_params_fwd(in.q, in.k, in.v, in.out, in.lse, in.s, 1.0);
  return in;
}

bool is_trivial(const QkvShape& s) { return s.b == 0 || s.h == 0 || s.lq == 0 || s.lk == 0; }

}  // namespace

namespace {

CudaDeviceLookup cuda_device_lookup = nullptr;

}  // namespace

DeviceInfo planned_device(const at::Tensor& like, int64_t target_cc, int64_t target_sms) {
  if (target_cc > 0) {
    DeviceInfo device;
    device.cc = int(target_cc);
    device.sms = int(target_sms);
    device.sm90_kernels = true;
    device.tma = true;
    // explain's targets are an H100 SXM (sm90) and an A100 SXM 80 GB (sm80): their peak DRAM
    // bandwidth, as the device query reports it (memory clock x bus width x 2), for the plans
    // that read it (plan_decode's balanced grid).
    device.dram_gbps = target_cc >= 90 ? 3352.3 : 2039.0;
    return device;
  }
  if (!like.is_cuda()) {
    DeviceInfo cpu;
    cpu.cpu_bf16_products = cpu_bf16_products();
    return cpu;
  }
  TORCH_CHECK(cuda_device_lookup != nullptr, "this build of sparse_attn has no CUDA kernels");
  return cuda_device_lookup(like);
}

void set_cuda_device_lookup(CudaDeviceLookup lookup) { cuda_device_lookup = lookup; }

std::string explain_flash(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          bool causal, int64_t window_left, int64_t window_right, int64_t target_cc,
                          int64_t target_sms) {
  const DeviceInfo device = planned_device(query, target_cc, target_sms);
  const bool aligned = flash_needs_aligned_inputs(scalar_kind(query.scalar_type()));
  PlannedInputs in = plan_inputs(query, key, value, device, aligned);
  set_params_window(in.params, causal, window_left, window_right);
  if (is_trivial(in.s)) return nothing_to_compute();
  return describe(plan_flash(in.params, Variant::kWindow, device, plan_options()));
}

std::string explain_block_sparse(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 int64_t q_block, int64_t kv_block, int64_t target_cc, int64_t target_sms) {
  TORCH_CHECK(q_block == 64 || q_block == 128, "q_block must be 64 or 128, got ", q_block);
  TORCH_CHECK(kv_block == 64 || kv_block == 128, "kv_block must be 64 or 128, got ", kv_block);
  const DeviceInfo device = planned_device(query, target_cc, target_sms);
  const bool aligned = flash_needs_aligned_inputs(scalar_kind(query.scalar_type()));
  PlannedInputs in = plan_inputs(query, key, value, device, aligned);
  in.params.q_block = int(q_block);
  in.params.kv_block = int(kv_block);
  if (is_trivial(in.s)) return nothing_to_compute();
  return describe(plan_flash(in.params, Variant::kBlockSparse, device, plan_options()));
}

std::string explain_bwd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        bool block_sparse, bool causal, int64_t window_left, int64_t window_right,
                        int64_t q_block, int64_t kv_block, bool deterministic, int64_t target_cc,
                        int64_t target_sms) {
  const DeviceInfo device = planned_device(query, target_cc, target_sms);
  PlannedInputs in = plan_inputs(query, key, value, device, /*aligned=*/false);
  if (block_sparse) {
    TORCH_CHECK(q_block == 64 || q_block == 128, "q_block must be 64 or 128, got ", q_block);
    TORCH_CHECK(kv_block == 64 || kv_block == 128, "kv_block must be 64 or 128, got ", kv_block);
    in.params.q_block = int(q_block);
    in.params.kv_block = int(kv_block);
  } else {
    set_params_window(in.params, causal, window_left, window_right);
  }
  if (is_trivial(in.s)) return nothing_to_compute();
  AttnBwdParams bp{};
  bp.fwd = in.params;
  return describe(plan_bwd(bp, block_sparse ? Variant::kBlockSparse : Variant::kWindow, device,
                           plan_options(), deterministic));
}

namespace {

// The gathered attention's plan for these inputs; false: nothing to compute.
bool planned_gather(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    int64_t index_heads, int64_t target_cc, int64_t target_sms, GatherPlan& plan) {
  const QkvShape s = check_qkv(query, key, value);
  TORCH_CHECK(index_heads >= 1 && s.h % index_heads == 0, "the selection's heads must divide H=", s.h,
              ", got ", index_heads);
  const DeviceInfo device = planned_device(query, target_cc, target_sms);
  const bool aligned = gather_needs_aligned_inputs(scalar_kind(query.scalar_type()), s.d, s.dv);
  PlannedInputs in = plan_inputs(query, key, value, device, aligned);
  in.params.h_idx = int(index_heads);
  in.params.h_per_idx = int(s.h / index_heads);
  if (is_trivial(in.s)) return false;
  plan = plan_gather(in.params, device);
  return true;
}

}  // namespace

std::string explain_gather(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           int64_t index_heads, int64_t target_cc, int64_t target_sms) {
  GatherPlan plan;
  if (!planned_gather(query, key, value, index_heads, target_cc, target_sms, plan))
    return nothing_to_compute();
  std::ostringstream out;
  out << "core=" << core_name(plan.core);
  if (plan.core == Core::kPortable)
    out << "\nhead_dim=" << plan.head_dim << "\nheads_per_warp=" << plan.group
        << "\nshared_stages=" << int(plan.shared_stages);
  if (plan.core == Core::kHopper)
    out << "\nhead_dim=" << plan.head_dim << "\nheads_per_cta=" << kGatherWgmmaHeads;
  out << "\nwhy_core=" << plan.why;
  return out.str();
}

std::string explain_gather_bwd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               int64_t index_heads, int64_t target_cc, int64_t target_sms) {
  GatherPlan forward;
  if (!planned_gather(query, key, value, index_heads, target_cc, target_sms, forward))
    return nothing_to_compute();
  const GatherBwdPlan plan = plan_gather_bwd(forward);
  std::ostringstream out;
  out << "core=" << core_name(plan.core);
  if (plan.core == Core::kPortable)
    out << "\nhead_dim=" << plan.head_dim << "\nheads_per_warp=" << plan.group
        << "\nshared_stages=" << int(plan.shared_stages);
  out << "\nwhy_core=" << plan.why;
  return out.str();
}

namespace {

std::string describe_select(const TopkSelectParams& params, const DeviceInfo& device) {
  std::ostringstream out;
  if (device.cc == 0) {
    out << "core=cpu\nwhy_core=CPU tensors: each row scored and selected by one thread (no workspace)";
    return out.str();
  }
  const SelectPlan plan = plan_select(params, device, plan_options());
  out << "core=" << (plan.tensor_core_scoring ? "portable" : "cuda_cores")
      << "\nworkspace_bytes=" << plan.workspace_bytes
      << "\nchunks=" << (plan.units + plan.per_chunk - 1) / std::max<int64_t>(plan.per_chunk, 1)
      << "\nfilter_stride=" << plan.filter_stride << "\ncandidates=" << plan.cand_cap
      << "\nwhy_core=" << plan.why;
  return out.str();
}

}  // namespace

std::string explain_select(const at::Tensor& query, const at::Tensor& key, int64_t k, bool causal,
                           int64_t target_cc, int64_t target_sms) {
  TopkSelectParams params;
  set_params_select(params, query, key, k, causal);
  return describe_select(params, planned_device(query, target_cc, target_sms));
}

std::string explain_indexer_select(const at::Tensor& index_query, const at::Tensor& index_key,
                                   const at::Tensor& index_weights, int64_t k, bool causal, int64_t target_cc,
                                   int64_t target_sms) {
  TopkSelectParams params;
  set_params_indexer(params, index_query, index_key, index_weights, k, causal);
  return describe_select(params, planned_device(index_query, target_cc, target_sms));
}

}  // namespace sparse_attn
