// Torch glue shared by the CPU and CUDA backends: argument checks that name the argument,
// output allocation, and set_params_* that fill the kernels' params structs.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <string>
#include <tuple>

#include "sparse_attn/params.h"
#include "sparse_attn/plan.h"

namespace sparse_attn {

#define SA_CHECK_SHAPE(x, ...)                                                                               \
  TORCH_CHECK((x).sizes() == at::IntArrayRef({__VA_ARGS__}), #x " must have shape (" #__VA_ARGS__ "), got ", \
              (x).sizes())

// Largest head dimension any op supports; every multiple of 8 up to it is accepted.
constexpr int64_t kMaxHeadDim = 256;

// Single-argument checks; the messages name the argument.
bool is_supported_dtype(at::ScalarType t);
void check_head_dim(int64_t d, const char* what);            // a multiple of 8 in [8, kMaxHeadDim]
void check_last_dim(const at::Tensor& t, const char* name);  // unit stride
void check_int32(const at::Tensor& t, const char* name);

struct QkvShape {
  int64_t b, h, h_kv, lq, lk, d, dv;
};

// Checks query/key/value against the layout contract: (B, H, Lq, D), (B, Hkv, Lk, D),
// (B, Hkv, Lk, Dv) on one device, one supported dtype, H a multiple of Hkv, head dims multiples
// of 8 up to kMaxHeadDim, unit last strides.
QkvShape check_qkv(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value);

ScalarKind scalar_kind(at::ScalarType t);

// The tensor-core kernels need Dv == D.
void check_tensor_core_head_dims(const QkvShape& s);

// t itself when its base and strides are 16-byte aligned (what kernels that copy 16-byte chunks
// need), else a contiguous copy; data = false gives an uninitialised tensor of the copy's layout
// instead (for a plan, which reads only pointers and strides).
at::Tensor aligned_copy(const at::Tensor& t, bool data);

// A second tensor argument (mask, indices) must live where the query lives.
void check_same_device(const at::Tensor& query, const at::Tensor& t, const char* name);

// out (B, H, Lq, Dv) stored (B, Lq, H, Dv)-contiguous, and lse (B, H, Lq) fp32.
std::tuple<at::Tensor, at::Tensor> alloc_outputs(const at::Tensor& query, const QkvShape& s);
// Outputs a caller gives in alloc_outputs' place: out (B, H, Lq, Dv) of query's dtype and device,
// unit stride along Dv and 16-byte aligned (base and strides); lse (B, H, Lq) fp32, contiguous.
void check_given_outputs(const at::Tensor& query, const QkvShape& s, const at::Tensor& out,
                         const at::Tensor& lse);

// True when there is nothing to compute; out and lse are then already filled
// (an empty key set gives 0 and -inf), so no kernel is launched.
bool fill_trivial_outputs(const QkvShape& s, at::Tensor& out, at::Tensor& lse);

double resolve_scale(const c10::optional<double>& scale, int64_t d);

AttnFwdParams set_params_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& lse, const QkvShape& s, double scale);

// The backward's params: the forward's (already set; the LSE replaced by a contiguous one) and the
// gradients, checked against the forward's shapes. Returns the contiguous gradients it allocated
// (dq, dk, dv) and the tensors the params point into (grad_out, lse, grad_lse).
struct BwdTensors {
  at::Tensor dq, dk, dv, dout, lse, dlse;
};
BwdTensors set_params_bwd(AttnBwdParams& params, const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                          const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_lse);

// _selection_mask's checks and outputs (sparse_attn/selection_mask.h): indices (B, G, Lq, k) int32
// with G dividing heads; the outputs allocated (partial_masks zeroed) and the params pointing
// into them. Returns (kv_num_blocks, kv_indices, kv_partial, partial_masks).
struct SelectionMaskParams;
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> set_params_selection_mask(
    SelectionMaskParams& params, at::Tensor& indices, int64_t key_length, int64_t heads, int64_t q_block,
    int64_t kv_block, bool causal, int64_t row_offset, int64_t entry_block);

// _selection_union's checks (those of _selection_mask) and params; returns the query blocks to
// measure (samples, or every one for -1).
int set_params_selection_union(SelectionMaskParams& params, at::Tensor& indices, int64_t key_length,
                               int64_t q_block, int64_t kv_block, bool causal, int64_t row_offset,
                               int64_t entry_block, int64_t samples);

// _document_mask's checks and outputs (sparse_attn/document_mask.h): cu_seqlens_q / _k (B + 1,)
// int32 and partial_offsets (nQb + 1,) int64 on one device; the outputs allocated and the params
// pointing into them. Returns (kv_num_blocks, kv_indices, kv_partial, partial_masks).
struct DocumentMaskParams;
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> set_params_document_mask(
    DocumentMaskParams& params, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const at::Tensor& partial_offsets, int64_t num_partial, int64_t total_q, int64_t total_k, int64_t q_block,
    int64_t kv_block, int64_t window_left, int64_t window_right, int64_t max_kb);

// Visible band from the user's causal flag and window; -1 is unbounded.
void set_params_window(AttnFwdParams& params, bool causal, int64_t window_left, int64_t window_right);

// dense_attention's optional mask, broadcast to (B, H, Lq, Lk). Returns the tensor that must
// stay alive while the kernel runs (uint8 for bool masks, fp32 for additive masks).
at::Tensor set_params_dense_mask(AttnFwdParams& params, const at::Tensor& query, const QkvShape& s,
                                 const c10::optional<at::Tensor>& attn_mask);

// Block-sparse metadata (shape/dtype/device checks only; values are re-checked in the kernel).
// Returns the contiguous copies the params point into.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> set_params_block_sparse(
    AttnFwdParams& params, const at::Tensor& query, const QkvShape& s, const at::Tensor& kv_num_blocks,
    const at::Tensor& kv_indices, const at::Tensor& kv_partial, const at::Tensor& partial_masks,
    int64_t q_block, int64_t kv_block);

// Optional heaviest-first schedule of the query blocks (a permutation of 0..nQb-1, int32).
// Returns the contiguous tensor the params point into.
at::Tensor set_params_block_order(AttnFwdParams& params, const at::Tensor& query,
                                  const c10::optional<at::Tensor>& q_block_order);

void set_params_gather(AttnFwdParams& params, const at::Tensor& query, const QkvShape& s,
                       const at::Tensor& indices);

// Selection params and the (B, Hs, Lq, k) index tensor it fills.
at::Tensor set_params_select(TopkSelectParams& params, const at::Tensor& query, const at::Tensor& key,
                             int64_t k, bool causal);
at::Tensor set_params_indexer(TopkSelectParams& params, const at::Tensor& index_query,
                              const at::Tensor& index_key, const at::Tensor& index_weights, int64_t k,
                              bool causal);

// ---- plans (sparse_attn.explain): "key=value" lines, the format _plan.py reads ----

// Set by the CUDA backend (when built): what the plans need to know of a CUDA tensor's device.
using CudaDeviceLookup = DeviceInfo (*)(const at::Tensor& like);
void set_cuda_device_lookup(CudaDeviceLookup lookup);

// The device a plan is made for: the tensor's (the CPU: cc = 0), or with target_cc > 0 a GPU of
// that compute capability with target_sms SMs.
DeviceInfo planned_device(const at::Tensor& like, int64_t target_cc, int64_t target_sms);
// Whether the CPU kernels run bf16 products on the CPU's bf16 matrix instructions (ops_cpu.cpp).
bool cpu_bf16_products();

// The plans flash_fwd / block_sparse_fwd / gather_fwd / topk_select / indexer_select would take
// for these inputs (their checks included), without running anything: on the inputs' device, or
// with target_cc > 0 on a GPU of that compute capability with target_sms SMs (a build with its
// kernels, a driver with TMA). The ops sparse_attn::_plan_* (registration.cpp).
std::string explain_flash(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          bool causal, int64_t window_left, int64_t window_right, int64_t target_cc,
                          int64_t target_sms);
std::string explain_block_sparse(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 int64_t q_block, int64_t kv_block, int64_t target_cc, int64_t target_sms);
// The backward of flash_fwd (block_sparse false: the window or causal bounds) or of
// block_sparse_fwd (the mask's block sizes) in torch's deterministic mode or not.
std::string explain_bwd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        bool block_sparse, bool causal, int64_t window_left, int64_t window_right,
                        int64_t q_block, int64_t kv_block, bool deterministic, int64_t target_cc,
                        int64_t target_sms);
std::string explain_gather(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           int64_t index_heads, int64_t target_cc, int64_t target_sms);
// The backward of gather_fwd (plan_gather_bwd of its plan).
std::string explain_gather_bwd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               int64_t index_heads, int64_t target_cc, int64_t target_sms);
std::string explain_select(const at::Tensor& query, const at::Tensor& key, int64_t k, bool causal,
                           int64_t target_cc, int64_t target_sms);
std::string explain_indexer_select(const at::Tensor& index_query, const at::Tensor& index_key,
                                   const at::Tensor& index_weights, int64_t k, bool causal, int64_t target_cc,
                                   int64_t target_sms);

// ---- attention_with_kvcache ----

struct KvCacheShape {
  int64_t b, h, h_kv, lq, d, dv;
  bool paged;
  int64_t num_pages, page_size, pages_per_seq;  // contiguous: B, Lmax, 1
  int64_t capacity;                             // tokens one sequence's cache holds
};

// Checks the inputs of attention_with_kvcache against its layout contract (shapes, dtypes,
// devices, strides; never the values of cache_seqlens or block_table, which may live on a GPU).
KvCacheShape check_kvcache(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& cache_seqlens,
                           const c10::optional<at::Tensor>& key, const c10::optional<at::Tensor>& value,
                           const c10::optional<at::Tensor>& block_table,
                           const c10::optional<at::Tensor>& kv_num_blocks,
                           const c10::optional<at::Tensor>& kv_indices, int64_t kv_block);

// The decode params of a checked call (everything but the output, LSE and split workspaces).
// query, key and value must already be the tensors the kernel reads (aligned copies).
DecodeParams set_params_decode(const KvCacheShape& s, const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& cache_seqlens,
                               const c10::optional<at::Tensor>& key, const c10::optional<at::Tensor>& value,
                               const c10::optional<at::Tensor>& block_table,
                               const c10::optional<at::Tensor>& kv_num_blocks,
                               const c10::optional<at::Tensor>& kv_indices, int64_t kv_block, double scale,
                               int64_t window_left, int64_t window_right);

// Whether the caches are laid out for the decode kernel's 16-byte copies (the kernel writes into
// them, so they cannot be copied aside).
bool kvcache_aligned(const at::Tensor& key_cache, const at::Tensor& value_cache);

// sparse_attn::_kvcache_route: 1 when the CUDA decode kernel serves the call, 0 when the op's
// composite path does. sparse_attn::_plan_kvcache: the plan as "key=value" lines.
int64_t kvcache_route(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& key,
                      const c10::optional<at::Tensor>& value, const c10::optional<at::Tensor>& block_table,
                      const c10::optional<at::Tensor>& kv_num_blocks,
                      const c10::optional<at::Tensor>& kv_indices, int64_t kv_block);
std::string explain_kvcache(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& cache_seqlens,
                            const c10::optional<at::Tensor>& key, const c10::optional<at::Tensor>& value,
                            const c10::optional<at::Tensor>& block_table,
                            const c10::optional<at::Tensor>& kv_num_blocks,
                            const c10::optional<at::Tensor>& kv_indices, int64_t kv_block,
                            int64_t window_left, int64_t window_right, int64_t target_cc, int64_t target_sms);

}  // namespace sparse_attn
