// CPU backend: checks, params, and the OpenMP kernels of csrc/cpu.
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <climits>
#include <vector>

#include "common.h"
#include "sparse_attn/cpu/attention_cpu.h"
#include "sparse_attn/document_mask.h"
#include "sparse_attn/selection_mask.h"

namespace sparse_attn {
namespace {

// The tile products of the CPU kernels: PyTorch's CPU micro-kernels (oneDNN's brgemm, on AMX for
// bf16 where the CPU has it; otherwise its BLAS).
namespace blas = at::native::cpublas;

void gemm_f32(int m, int n, int k, int64_t lda, int ldb, int ldc, bool add, const float* a, const float* b,
              float* c) {
  blas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, /*is_vnni=*/false);
}

void gemm_bf16(int m, int n, int k, int64_t lda, int ldb, int ldc, bool add, const bf16_t* a, const bf16_t* b,
               float* c) {
  blas::brgemm(m, n, k, lda, ldb, ldc, add, reinterpret_cast<const at::BFloat16*>(a),
               reinterpret_cast<const at::BFloat16*>(b), c, /*is_vnni=*/true);
}

void release_bf16() { blas::brgemm_release(/*is_vnni=*/true); }

// Whether the CPU has bf16 matrix instructions and torch's packing for them is the VNNI pair layout
// the kernels write directly (checked on a probe, so that a different layout in some torch
// falls back to fp32 products instead of computing garbage).
bool bf16_products_usable() {
  if (!blas::could_pack(at::kBFloat16)) return false;
  constexpr int k = 4, n = 16;
  std::vector<uint16_t> b(k * n), packed(k * n);
  for (int i = 0; i < k * n; ++i) b[i] = uint16_t(0x3f80 + i);  // distinct finite values
  blas::pack(k, n, n, n, at::kBFloat16, at::kBFloat16, b.data(), packed.data());
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < n; ++j)
      if (packed[(i / 2) * 2 * n + 2 * j + i % 2] != b[i * n + j]) return false;
  return true;
}

const cpu::TileGemm& tile_gemm() {
  static const cpu::TileGemm gemm{gemm_f32, bf16_products_usable() ? gemm_bf16 : nullptr, release_bf16};
  return gemm;
}

}  // namespace

bool cpu_bf16_products() { return tile_gemm().bf16 != nullptr; }

namespace {

void check_cpu(const at::Tensor& query) {
  TORCH_CHECK(query.device().is_cpu(), "expected CPU tensors, got ", query.device());
}

std::tuple<at::Tensor, at::Tensor> dense_fwd_cpu(const at::Tensor& query, const at::Tensor& key,
                                                 const at::Tensor& value,
                                                 const c10::optional<at::Tensor>& attn_mask,
                                                 c10::optional<double> scale, bool causal) {
  const QkvShape s = check_qkv(query, key, value);
  check_cpu(query);
  auto [out, lse] = alloc_outputs(query, s);
  AttnFwdParams params = set_params_fwd(query, key, value, out, lse, s, resolve_scale(scale, s.d));
  set_params_window(params, causal, -1, -1);
  at::Tensor mask = set_params_dense_mask(params, query, s, attn_mask);
  if (fill_trivial_outputs(s, out, lse)) return {out, lse};
  at::Tensor scores = at::empty({s.b, s.h, s.lq, s.lk}, query.options().dtype(at::kFloat));
  params.scores = scores.data_ptr<float>();
  cpu::dense_fwd(params);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> flash_fwd_cpu(const at::Tensor& query, const at::Tensor& key,
                                                 const at::Tensor& value, c10::optional<double> scale,
                                                 bool causal, int64_t window_left, int64_t window_right) {
  const QkvShape s = check_qkv(query, key, value);
  check_cpu(query);
  auto [out, lse] = alloc_outputs(query, s);
  AttnFwdParams params = set_params_fwd(query, key, value, out, lse, s, resolve_scale(scale, s.d));
  set_params_window(params, causal, window_left, window_right);
  if (fill_trivial_outputs(s, out, lse)) return {out, lse};
  cpu::flash_fwd(params, tile_gemm());
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> block_sparse_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_num_blocks,
    const at::Tensor& kv_indices, const at::Tensor& kv_partial, const at::Tensor& partial_masks,
    int64_t q_block, int64_t kv_block, c10::optional<double> scale,
    const c10::optional<at::Tensor>& q_block_order) {
  const QkvShape s = check_qkv(query, key, value);
  check_cpu(query);
  auto [out, lse] = alloc_outputs(query, s);
  AttnFwdParams params = set_params_fwd(query, key, value, out, lse, s, resolve_scale(scale, s.d));
  auto keep = set_params_block_sparse(params, query, s, kv_num_blocks, kv_indices, kv_partial, partial_masks,
                                      q_block, kv_block);
  set_params_block_order(params, query, q_block_order);  // checked; OpenMP schedules dynamically
  params.q_block_order = nullptr;
  if (fill_trivial_outputs(s, out, lse)) return {out, lse};
  cpu::block_sparse_fwd(params, tile_gemm());
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> gather_fwd_cpu(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, const at::Tensor& indices,
                                                  c10::optional<double> scale) {
  const QkvShape s = check_qkv(query, key, value);
  check_cpu(query);
  auto [out, lse] = alloc_outputs(query, s);
  AttnFwdParams params = set_params_fwd(query, key, value, out, lse, s, resolve_scale(scale, s.d));
  set_params_gather(params, query, s, indices);
  if (fill_trivial_outputs(s, out, lse)) return {out, lse};
  cpu::gather_fwd(params);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> selection_mask_cpu(
    const at::Tensor& indices, int64_t key_length, int64_t heads, int64_t q_block, int64_t kv_block,
    bool causal, int64_t row_offset, int64_t entry_block) {
  check_cpu(indices);
  at::Tensor idx = indices;
  SelectionMaskParams params;
  auto out = set_params_selection_mask(params, idx, key_length, heads, q_block, kv_block, causal, row_offset,
                                       entry_block);
  cpu::selection_mask(params);
  return out;
}

at::Tensor selection_union_cpu(const at::Tensor& indices, int64_t key_length, int64_t q_block,
                               int64_t kv_block, bool causal, int64_t row_offset, int64_t entry_block,
                               int64_t samples) {
  check_cpu(indices);
  at::Tensor idx = indices;
  SelectionMaskParams params;
  const int n = set_params_selection_union(params, idx, key_length, q_block, kv_block, causal, row_offset,
                                           entry_block, samples);
  return at::scalar_tensor(cpu::selection_union(params, n), indices.options().dtype(at::kLong));
}

at::Tensor canonical_selection_cpu(const at::Tensor& indices) {
  check_cpu(indices);
  TORCH_CHECK(indices.scalar_type() == at::kInt, "indices must be int32, got ", indices.scalar_type());
  TORCH_CHECK(indices.dim() >= 1, "indices must have a last dimension");
  const at::Tensor in = indices.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t k = in.size(-1);
  TORCH_CHECK(k <= INT_MAX, "indices: rows of at most 2^31 - 1 entries, got ", k);
  cpu::canonical_selection(in.data_ptr<int32_t>(), out.data_ptr<int32_t>(), k == 0 ? 0 : in.numel() / k,
                           int(k));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> document_mask_cpu(
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const at::Tensor& partial_offsets,
    int64_t num_partial, int64_t total_q, int64_t total_k, int64_t q_block, int64_t kv_block,
    int64_t window_left, int64_t window_right, int64_t max_kb) {
  check_cpu(cu_seqlens_q);
  DocumentMaskParams params;
  auto out = set_params_document_mask(params, cu_seqlens_q, cu_seqlens_k, partial_offsets, num_partial,
                                      total_q, total_k, q_block, kv_block, window_left, window_right, max_kb);
  cpu::document_mask(params);
  return out;
}

at::Tensor topk_select_cpu(const at::Tensor& query, const at::Tensor& key, int64_t k, bool causal) {
  TopkSelectParams params;
  at::Tensor out = set_params_select(params, query, key, k, causal);
  check_cpu(query);
  if (out.numel() > 0) cpu::topk_select(params, tile_gemm());
  return out;
}

at::Tensor indexer_select_cpu(const at::Tensor& index_query, const at::Tensor& index_key,
                              const at::Tensor& index_weights, int64_t k, bool causal) {
  TopkSelectParams params;
  at::Tensor out = set_params_indexer(params, index_query, index_key, index_weights, k, causal);
  check_cpu(index_query);
  if (out.numel() > 0) cpu::topk_select(params, tile_gemm());
  return out;
}

// The backward ops: the forward's params from its inputs and output, then the gradients.
struct BwdCall {
  AttnBwdParams params;
  QkvShape s;
  BwdTensors t;
};

BwdCall prepare_bwd(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                    const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                    const c10::optional<at::Tensor>& grad_lse, c10::optional<double> scale) {
  BwdCall c;
  c.s = check_qkv(query, key, value);
  check_cpu(query);
  c.params = {};
  c.params.fwd = set_params_fwd(query, key, value, out, lse, c.s, resolve_scale(scale, c.s.d));
  c.t = set_params_bwd(c.params, query, key, value, out, lse, grad_out, grad_lse);
  return c;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& grad_lse,
    c10::optional<double> scale, bool causal, int64_t window_left, int64_t window_right) {
  BwdCall c = prepare_bwd(grad_out, query, key, value, out, lse, grad_lse, scale);
  set_params_window(c.params.fwd, causal, window_left, window_right);
  if (query.numel() + key.numel() > 0) cpu::flash_bwd(c.params, tile_gemm());
  return {c.t.dq, c.t.dk, c.t.dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_sparse_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& grad_lse,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices, const at::Tensor& kv_partial,
    const at::Tensor& partial_masks, int64_t q_block, int64_t kv_block, c10::optional<double> scale) {
  BwdCall c = prepare_bwd(grad_out, query, key, value, out, lse, grad_lse, scale);
  auto keep = set_params_block_sparse(c.params.fwd, query, c.s, kv_num_blocks, kv_indices, kv_partial,
                                      partial_masks, q_block, kv_block);
  if (query.numel() + key.numel() > 0) cpu::block_sparse_bwd(c.params, tile_gemm());
  return {c.t.dq, c.t.dk, c.t.dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& grad_lse,
    const at::Tensor& indices, c10::optional<double> scale) {
  BwdCall c = prepare_bwd(grad_out, query, key, value, out, lse, grad_lse, scale);
  set_params_gather(c.params.fwd, query, c.s, indices);
  if (query.numel() + key.numel() > 0) cpu::gather_bwd(c.params);
  return {c.t.dq, c.t.dk, c.t.dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(sparse_attn, CPU, m) {
  m.impl("flash_bwd", &flash_bwd_cpu);
  m.impl("block_sparse_bwd", &block_sparse_bwd_cpu);
  m.impl("gather_bwd", &gather_bwd_cpu);
  m.impl("dense_fwd", &dense_fwd_cpu);
  m.impl("flash_fwd", &flash_fwd_cpu);
  m.impl("block_sparse_fwd", &block_sparse_fwd_cpu);
  m.impl("gather_fwd", &gather_fwd_cpu);
  m.impl("topk_select", &topk_select_cpu);
  m.impl("_selection_mask", &selection_mask_cpu);
  m.impl("_selection_union", &selection_union_cpu);
  m.impl("_canonical_selection", &canonical_selection_cpu);
  m.impl("_document_mask", &document_mask_cpu);
  m.impl("indexer_select", &indexer_select_cpu);
}

}  // namespace sparse_attn
