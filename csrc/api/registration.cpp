// Op schemas, written once. Each backend registers its kernels in its own file
// (ops_cpu.cpp, ops_cuda.cpp); Python adds the fake (meta) kernels. The _plan_* ops return the
// plan a call would take, without running it (sparse_attn.explain); _set_plan_options sets the
// plan overrides of tests and benchmarks; _ordered_bwd_walk, _block_bwd_visible_bits and
// _bwd_head_splits show the Hopper backward's walks, visibility bits and head splits to the tests.
#include <Python.h>
#include <torch/library.h>

#include <array>
#include <tuple>
#include <vector>

#include "common.h"
#include "sparse_attn/plan.h"
#include "sparse_attn/tile_iter.h"

namespace {

// The walks of the Hopper backward's ordered dQ reductions (OrderedWindowQTiles over its query
// tiles of block_m rows, 64 or 128 as the head dimension has them, and 128-key tiles) for a band
// (window bounds as in AttnFwdParams, bottom-right aligned): (key tiles, longest walk, 3) int32,
// per step (query head in the group, query tile, rank), -1 past a walk's end. The host runs the
// same iterator the kernel does.
template <int kBlockM>
void ordered_walks(const sparse_attn::AttnBwdParams& bp,
                   std::vector<std::vector<std::array<int32_t, 3>>>& walks) {
  for (int n = 0; n < int(walks.size()); ++n) {
    const sparse_attn::OrderedWindowQTiles<kBlockM, 128> tiles(bp, 0, 0, n);
    sparse_attn::QTilePos pos;
    for (bool more = tiles.start(pos); more; more = tiles.advance(pos))
      walks[n].push_back({pos.hl, pos.m_block, tiles.rank(pos)});
  }
}

at::Tensor ordered_bwd_walk(int64_t lq, int64_t lk, int64_t left, int64_t right, int64_t heads,
                            int64_t block_m) {
  TORCH_CHECK(lq > 0 && lk > 0 && heads > 0 && lq <= (1 << 20) && lk <= (1 << 20) && heads <= 64,
              "_ordered_bwd_walk: lq, lk in [1, 2^20] and heads in [1, 64], got ", lq, ", ", lk, ", ", heads);
  TORCH_CHECK(block_m == 64 || block_m == 128, "_ordered_bwd_walk: block_m must be 64 or 128, got ", block_m);
  sparse_attn::AttnBwdParams bp{};
  bp.fwd.lq = int(lq);
  bp.fwd.lk = int(lk);
  bp.fwd.window_left = int(left);
  bp.fwd.window_right = int(right);
  bp.fwd.kv_offset = int(lk - lq);
  bp.fwd.h_per_kv = int(heads);
  const int nkb = int((lk + 127) / 128);
  std::vector<std::vector<std::array<int32_t, 3>>> walks(nkb);
  if (block_m == 64)
    ordered_walks<64>(bp, walks);
  else
    ordered_walks<128>(bp, walks);
  size_t longest = 0;
  for (const auto& w : walks) longest = std::max(longest, w.size());
  at::Tensor out = at::full({nkb, int64_t(longest), 3}, -1, at::kInt);
  int32_t* o = out.data_ptr<int32_t>();
  for (int n = 0; n < nkb; ++n)
    for (size_t i = 0; i < walks[n].size(); ++i)
      for (int c = 0; c < 3; ++c) o[(n * longest + i) * 3 + c] = walks[n][i][c];
  return out;
}

// plan_bwd_head_splits for a flash backward of these sizes (window bounds as in AttnFwdParams,
// bottom-right aligned) on a device of `sms` SMs, for the CPU tests; with block_sparse,
// plan_bwd_block_sparse_head_splits for a mask of 128-key blocks (the bounds unused).
int64_t bwd_head_splits(int64_t b, int64_t h, int64_t h_kv, int64_t lq, int64_t lk, int64_t left,
                        int64_t right, int64_t d, int64_t sms, int64_t block_m, bool block_sparse) {
  TORCH_CHECK(b > 0 && h_kv > 0 && h > 0 && h % h_kv == 0 && lq > 0 && lk > 0 && lq <= (1 << 24) &&
                  lk <= (1 << 24) && d > 0 && d <= 256 && sms > 0 && (block_m == 64 || block_m == 128),
              "_bwd_head_splits: sizes out of range");
  sparse_attn::AttnBwdParams bp{};
  bp.fwd.b = int(b);
  bp.fwd.h = int(h);
  bp.fwd.h_kv = int(h_kv);
  bp.fwd.h_per_kv = int(h / h_kv);
  bp.fwd.lq = int(lq);
  bp.fwd.lk = int(lk);
  bp.fwd.window_left = int(left);
  bp.fwd.window_right = int(right);
  bp.fwd.kv_offset = int(lk - lq);
  bp.fwd.d = bp.fwd.dv = int(d);
  sparse_attn::DeviceInfo dev;
  dev.cc = 90;
  dev.sms = int(sms);
  if (block_sparse) return sparse_attn::plan_bwd_block_sparse_head_splits(bp, dev);
  return sparse_attn::plan_bwd_head_splits(bp, dev, int(block_m));
}

// The visibility bits the Hopper block-sparse backward's consumer threads read per tile
// (BlockSparseQTiles::visible_bits_t, 128-key blocks, 64-row query tiles) for key block n_block
// and the query tile at row m0 of a listed query block at qrow0 (partial mask row pid, -1 full),
// next to the same bits assembled from visible() per element: two (256,) int64 tensors, one word
// per consumer thread (warpgroup, warp, lane). The host runs the code the kernel does.
std::tuple<at::Tensor, at::Tensor> block_bwd_visible_bits(const at::Tensor& partial_masks, int64_t q_block,
                                                          int64_t lk, int64_t n_block, int64_t pid,
                                                          int64_t qrow0, int64_t m0) {
  TORCH_CHECK(partial_masks.dim() == 3 && partial_masks.scalar_type() == at::kInt &&
                  partial_masks.is_contiguous() && partial_masks.device().is_cpu() &&
                  partial_masks.size(1) == q_block && partial_masks.size(2) == 4,
              "_block_bwd_visible_bits: partial_masks must be a contiguous CPU int32 (P, q_block, 4) tensor");
  TORCH_CHECK(q_block == 64 || q_block == 128, "_block_bwd_visible_bits: q_block must be 64 or 128");
  TORCH_CHECK(pid >= -1 && pid < partial_masks.size(0), "_block_bwd_visible_bits: pid out of range");
  TORCH_CHECK(lk > 0 && n_block >= 0 && n_block * 128 < lk && qrow0 >= 0 && qrow0 % q_block == 0 &&
                  m0 >= qrow0 && m0 + 64 <= qrow0 + q_block && m0 % 64 == 0,
              "_block_bwd_visible_bits: the tile must lie in the key block and the query block");
  std::vector<int32_t> lists(size_t(n_block + 1) * 2, 0);  // the transposed lists the iterator points at
  sparse_attn::AttnBwdParams bp{};
  bp.fwd.partial_masks = partial_masks.data_ptr<int32_t>();
  bp.fwd.q_block = int(q_block);
  bp.fwd.kv_block = 128;
  bp.fwd.lk = int(lk);
  bp.fwd.h_per_kv = 1;
  bp.fwd.num_q_blocks = 1;
  bp.q_num_blocks = bp.q_indices = bp.q_partial = lists.data();
  const sparse_attn::BlockSparseQTiles<64, 128> tiles(bp, 0, 0, int(n_block));
  sparse_attn::QTilePos pos{0, int(m0 / 64), int(pid), int(qrow0), 0, 0, 1};
  at::Tensor bits = at::empty({256}, at::kLong), ref = at::empty({256}, at::kLong);
  for (int thread = 0; thread < 256; ++thread) {
    const int wg = thread / 128, warp = thread / 32 % 4, lane = thread % 32, g = lane / 4, t = lane % 4;
    const int key_row = int(n_block) * 128 + wg * 64 + warp * 16 + g;
    uint32_t r = 0;
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 4; ++e)
        if (tiles.visible(pos, int(m0) + 8 * j + 2 * t + e % 2, key_row + 8 * (e / 2)))
          r |= 1u << (4 * j + e);
    bits.data_ptr<int64_t>()[thread] = tiles.visible_bits_t(pos, int(m0) + 2 * t, key_row);
    ref.data_ptr<int64_t>()[thread] = r;
  }
  return {bits, ref};
}

}  // namespace

// Importing sparse_attn._C runs the static registrations below; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(sparse_attn, m) {
  m.def(
      "dense_fwd(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float? scale=None, "
      "bool causal=False) -> (Tensor out, Tensor lse)");
  m.def(
      "flash_fwd(Tensor query, Tensor key, Tensor value, float? scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1) -> (Tensor out, Tensor lse)");
  m.def(
      "block_sparse_fwd(Tensor query, Tensor key, Tensor value, Tensor kv_num_blocks, Tensor kv_indices, "
      "Tensor kv_partial, Tensor partial_masks, int q_block, int kv_block, float? scale=None, "
      "Tensor? q_block_order=None) -> (Tensor out, Tensor lse)");
  m.def(
      "_flash_fwd_out(Tensor query, Tensor key, Tensor value, Tensor(a!) out, Tensor(b!) lse, "
      "float? scale=None, bool causal=False, int window_left=-1, int window_right=-1) -> ()");
  m.def(
      "gather_fwd(Tensor query, Tensor key, Tensor value, Tensor indices, float? scale=None) "
      "-> (Tensor out, Tensor lse)");
  m.def("topk_select(Tensor query, Tensor key, int k, bool causal=False) -> Tensor");
  m.def(
      "indexer_select(Tensor index_query, Tensor index_key, Tensor index_weights, int k, "
      "bool causal=False) -> Tensor");

  // A selection (B, G, Lq, k) of keys (entry_block 1) or key blocks as a block-sparse mask
  // (sparse_attn/selection_mask.h): top-k's masked-block route. Under causal, local row i sees keys
  // j <= i + row_offset.
  m.def(
      "_selection_mask(Tensor indices, int key_length, int heads, int q_block, int kv_block, bool causal, "
      "int row_offset, int entry_block=1) -> (Tensor kv_num_blocks, Tensor kv_indices, Tensor kv_partial, "
      "Tensor partial_masks)");

  // How many (b, g, query block, key block) pairs a selection touches, over `samples` evenly spaced
  // query blocks (-1: all; sparse_attn/selection_mask.h): the block pairs _selection_mask would
  // list there, without building it (the masked route's cost model). A 0-d int64 tensor.
  m.def(
      "_selection_union(Tensor indices, int key_length, int q_block, int kv_block, bool causal, int "
      "row_offset, "
      "int entry_block=1, int samples=-1) -> Tensor");

  // A user's selection (..., k) in topk_attention's form: each row's distinct non-negative entries
  // ascending, then -1s (CPU: sparse_attn/selection_mask.h; CUDA, k <= 4096: sparse_attn/cuda/topk.h;
  // the reference: _routes.drop_repeats).
  m.def("_canonical_selection(Tensor indices) -> Tensor");

  // Packed sequences (cu_seqlens_q / _k) as one block-sparse mask (sparse_attn/document_mask.h):
  // flash_attention_varlen's one-launch route. Query block qb's partial rows are
  // partial_offsets[qb] ... partial_offsets[qb + 1] - 1 of the num_partial rows; lists of max_kb.
  m.def(
      "_document_mask(Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor partial_offsets, int num_partial, "
      "int total_q, int total_k, int q_block, int kv_block, int window_left, int window_right, int max_kb) "
      "-> "
      "(Tensor kv_num_blocks, Tensor kv_indices, Tensor kv_partial, Tensor partial_masks)");

  // Context parallelism's merge of a partial output (part, part_lse) into (out, lse) by their LSEs,
  // in place, summed in fp32 and rounded once (CUDA; the CPU path composes torch ops).
  m.def("_merge_partial_(Tensor(a!) out, Tensor(b!) lse, Tensor part, Tensor part_lse) -> ()");

  // attention_with_kvcache on CUDA (the CPU and other layouts take the Python composite path):
  // appends key/value into the caches in place, then attends over cache + new tokens.
  m.def(
      "kvcache_fwd(Tensor query, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor cache_seqlens, "
      "Tensor? key=None, Tensor? value=None, Tensor? block_table=None, Tensor? kv_num_blocks=None, "
      "Tensor? kv_indices=None, int kv_block=0, float? scale=None, int window_left=-1, int window_right=-1) "
      "-> (Tensor out, Tensor lse)");

  // Top-k decode's block selection on CUDA (kvcache_topk_mask; the CPU selects with torch ops):
  // per sequence the k highest block scores, sinks and newest blocks kept, ascending.
  m.def(
      "_decode_block_select(Tensor block_scores, Tensor cache_seqlens, int k, int block_size, int sinks, "
      "int recent) -> (Tensor counts, Tensor indices)");

  // Backward passes (autograd in sparse_attn/_meta.py): dQ, dK, dV from the forward's inputs,
  // output and LSE, the output's gradient and (optionally) the LSE's.
  m.def(
      "flash_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      "Tensor? grad_lse=None, float? scale=None, bool causal=False, int window_left=-1, int window_right=-1) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  m.def(
      "block_sparse_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      "Tensor? grad_lse, Tensor kv_num_blocks, Tensor kv_indices, Tensor kv_partial, Tensor partial_masks, "
      "int q_block, int kv_block, float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor "
      "grad_value)");
  m.def(
      "gather_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      "Tensor? grad_lse, Tensor indices, float? scale=None) -> (Tensor grad_query, Tensor grad_key, "
      "Tensor grad_value)");

  // The checks every attention op makes of query, key and value (check_qkv), for Python code
  // that reads them before any kernel does.
  m.def("_check_inputs(Tensor query, Tensor key, Tensor value) -> ()");

  // target_cc > 0: plan for a GPU of that compute capability with target_sms SMs instead of the
  // inputs' device.
  m.def(
      "_plan_flash(Tensor query, Tensor key, Tensor value, bool causal=False, int window_left=-1, "
      "int window_right=-1, int target_cc=0, int target_sms=0) -> str",
      &sparse_attn::explain_flash);
  m.def(
      "_plan_bwd(Tensor query, Tensor key, Tensor value, bool block_sparse=False, bool causal=False, int "
      "window_left=-1, int window_right=-1, int q_block=128, int kv_block=128, bool deterministic=False, int "
      "target_cc=0, int target_sms=0) -> str",
      &sparse_attn::explain_bwd);
  m.def(
      "_plan_block_sparse(Tensor query, Tensor key, Tensor value, int q_block, int kv_block, int "
      "target_cc=0, "
      "int target_sms=0) -> str",
      &sparse_attn::explain_block_sparse);
  m.def(
      "_plan_gather(Tensor query, Tensor key, Tensor value, int index_heads, int target_cc=0, "
      "int target_sms=0) -> str",
      &sparse_attn::explain_gather);
  m.def(
      "_plan_gather_bwd(Tensor query, Tensor key, Tensor value, int index_heads, int target_cc=0, "
      "int target_sms=0) -> str",
      &sparse_attn::explain_gather_bwd);
  m.def(
      "_plan_select(Tensor query, Tensor key, int k, bool causal=False, int target_cc=0, int target_sms=0) "
      "-> str",
      &sparse_attn::explain_select);
  m.def(
      "_plan_indexer_select(Tensor index_query, Tensor index_key, Tensor index_weights, int k, bool "
      "causal=False, "
      "int target_cc=0, int target_sms=0) -> str",
      &sparse_attn::explain_indexer_select);
  m.def(
      "_kvcache_route(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cache_seqlens, Tensor? key, "
      "Tensor? value, Tensor? block_table, Tensor? kv_num_blocks, Tensor? kv_indices, int kv_block) -> int",
      &sparse_attn::kvcache_route);
  m.def(
      "_plan_kvcache(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cache_seqlens, Tensor? key, "
      "Tensor? value, Tensor? block_table, Tensor? kv_num_blocks, Tensor? kv_indices, int kv_block, "
      "int window_left=-1, int window_right=-1, int target_cc=0, int target_sms=0) -> str",
      &sparse_attn::explain_kvcache);
  m.def("_ordered_bwd_walk(int lq, int lk, int left, int right, int heads, int block_m=64) -> Tensor",
        &ordered_bwd_walk);
  m.def(
      "_bwd_head_splits(int b, int h, int h_kv, int lq, int lk, int left, int right, int d, int sms, int "
      "block_m, bool block_sparse=False) -> int",
      &bwd_head_splits);
  m.def(
      "_block_bwd_visible_bits(Tensor partial_masks, int q_block, int lk, int n_block, int pid, int qrow0, "
      "int m0) "
      "-> (Tensor, Tensor)",
      &block_bwd_visible_bits);
  m.def(
      "_set_plan_options(bool portable_only=False, int block_m=0, int block_n=0, bool per_tile_grid=False, "
      "int merge_boundary=-1, int select_workspace_bytes=0, int decode_splits=0, int select_filter_stride=0, "
      "int bwd_head_splits=0, int decode_ctas=0) -> ()",
      [](bool portable_only, int64_t block_m, int64_t block_n, bool per_tile_grid, int64_t merge_boundary,
         int64_t select_workspace_bytes, int64_t decode_splits, int64_t select_filter_stride,
         int64_t bwd_head_splits, int64_t decode_ctas) {
        sparse_attn::PlanOptions& o = sparse_attn::plan_options();
        o.portable_only = portable_only;
        o.block_m = int(block_m);
        o.block_n = int(block_n);
        o.per_tile_grid = per_tile_grid;
        o.merge_boundary = int(merge_boundary);
        o.select_workspace_bytes = select_workspace_bytes;
        o.decode_splits = int(decode_splits);
        o.select_filter_stride = int(select_filter_stride);
        o.bwd_head_splits = int(bwd_head_splits);
        o.decode_ctas = int(decode_ctas);
      });
}

// Every backend with real tensors (fake tensors get the Python fake: nothing to check).
TORCH_LIBRARY_IMPL(sparse_attn, CompositeExplicitAutograd, m) {
  m.impl("_check_inputs", [](const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
    sparse_attn::check_qkv(query, key, value);
  });
}
