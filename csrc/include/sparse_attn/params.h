// Parameters of the attention forward family (dense, flash, block-sparse, gather).
// Plain C++: no torch, no CUDA. Filled once by set_params_* in csrc/api and passed by value
// to every kernel (as a __grid_constant__ on the GPU).
#pragma once

#include <cstdint>

namespace sparse_attn {

enum class ScalarKind : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Kinds of element mask accepted by dense_attention.
enum class DenseMaskKind : int { kNone = 0, kBool = 1, kAdditive = 2 };

struct AttnFwdParams {
  // ---- tensors (element strides, last dimension has stride 1) ----
  const void* __restrict__ q;  // (B, H, Lq, D), dtype
  const void* __restrict__ k;  // (B, Hkv, Lk, D), dtype
  const void* __restrict__ v;  // (B, Hkv, Lk, Dv), dtype
  void* __restrict__ o;        // (B, H, Lq, Dv), dtype
  float* __restrict__ lse;     // (B, H, Lq), fp32, contiguous; natural log
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;

  int b, h, h_kv, lq, lk, d, dv;
  int h_per_kv;  // H / Hkv: query head h reads kv head h / h_per_kv
  ScalarKind dtype;

  float scale;       // softmax scale applied to q.k
  float scale_log2;  // scale * log2(e): kernels use exp2

  // ---- visibility of the dense / windowed family ----
  // Key j is visible from query i iff
  //   (window_left  < 0 || j >= i + kv_offset - window_left) &&
  //   (window_right < 0 || j <= i + kv_offset + window_right)
  // kv_offset = Lk - Lq aligns causal masks to the bottom right; causal = (-1, 0).
  int window_left, window_right;
  int kv_offset;

  // ---- dense_attention only ----
  float* __restrict__ scores;          // (B, H, Lq, Lk), fp32 workspace: S = scale * Q K^T
  void* __restrict__ probs;            // (B, H, Lq, Lk), dtype workspace (CUDA: P for the PV product)
  const void* __restrict__ attn_mask;  // broadcast to (B, H, Lq, Lk): uint8 (bool) or fp32 (additive)
  int64_t mask_batch_stride, mask_head_stride, mask_row_stride;  // 0 where broadcast
  DenseMaskKind mask_kind;

  // ---- block_sparse_attention only ----
  // Per (batch, head, query block): the key blocks to visit, ascending. Size-1 batch/head
  // dimensions broadcast through zero strides.
  const int32_t* __restrict__ kv_num_blocks;  // (Bm, Hm, nQb), int32
  const int32_t* __restrict__ kv_indices;     // (Bm, Hm, nQb, maxKb), int32
  const int32_t* __restrict__ kv_partial;  // (Bm, Hm, nQb, maxKb), int32: -1 full, else row of partial_masks
  const int32_t* __restrict__ partial_masks;  // (P, q_block, kv_block / 32), int32 bit words; bit c%32 of
                                              // word c/32
  int64_t bs_batch_stride,
      bs_head_stride;  // strides of kv_num_blocks over (Bm, Hm); indices use * max_kv_blocks
  int q_block, kv_block;
  int num_q_blocks, num_kv_blocks, max_kv_blocks, num_partial;
  // Optional CTA schedule (tile_of_cta): the query blocks, heaviest first, then the number of
  // leading ones that run across every (batch, head) before the rest; nullptr = the default order.
  const int32_t* __restrict__ q_block_order;  // (nQb + 1,), int32

  // ---- Hopper core scheduling ----
  // Optional zeroed int32 in device memory: CTAs of the persistent Hopper kernel take their next
  // query tile from it (atomicAdd), in tile_of_cta's order. nullptr: a static round-robin.
  int32_t* tile_counter;
  // Hopper core: scratch for the rows whose output is not finite (hidden_values.cuh), one 16-byte
  // record per (query tile, consumer warp): num_ctas(block_m) * block_m / 16 int4, 16-byte aligned,
  // not initialised. Required by the Hopper launcher.
  int32_t* hidden_records;

  // ---- gather (top-k) attention only ----
  const int32_t* __restrict__ indices;  // (B, Hi, Lq, topk), int32; -1 (or out of range) = no key
  int64_t idx_batch_stride, idx_head_stride, idx_row_stride;
  int h_idx;      // Hi: 1 (shared by all heads), Hkv or H
  int h_per_idx;  // H / Hi
  int topk;
};

// Backward of the attention family: the forward's params (inputs, output, LSE, visibility or
// mask or indices) and the gradients. The gradients are contiguous.
struct AttnBwdParams {
  AttnFwdParams fwd;
  const void* __restrict__ dout;  // (B, H, Lq, Dv), dtype
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  const float* __restrict__ dlse;  // (B, H, Lq), fp32, contiguous; nullptr: the LSE has no gradient
  void* __restrict__ dq;           // (B, H, Lq, D), dtype, contiguous
  void* __restrict__ dk;           // (B, Hkv, Lk, D), dtype, contiguous
  void* __restrict__ dv;           // (B, Hkv, Lk, Dv), dtype, contiguous

  // ---- CUDA workspaces (csrc/include/sparse_attn/cuda/attn_bwd*.cuh) ----
  // Per (batch * H + head, row) of a (B * H, lq_pad) buffer, lq_pad a multiple of 128, written by the
  // preprocess: the LSE in log2 units (+inf for a row with no visible key and for the padding rows,
  // so that every P of such a row is exactly 0) and delta = dO . O - dLSE (0 in the padding).
  float* __restrict__ lse_log2;
  float* __restrict__ delta;
  int lq_pad;
  // dQ in fp32, zeroed, summed with atomics: dQ / scale, (B, H, Lq, D), for the portable kernel; for
  // the Hopper one dQ itself in (B, H, lq_pad / 64, D_pad / 64) tiles of 64 x 64 in wgmma fragment
  // order (ops_cuda.cpp undoes it).
  float* __restrict__ dq_accum;
  // Deterministic mode: dQ comes from its own kernel (attn_bwd_dq.cuh, no atomics) and the key-major
  // kernel (Hopper's or the portable one) computes dK and dV only.
  int dq_separate;
  // Deterministic mode of the Hopper kernel for the dense family (window variant): per
  // (batch * H + head, 64-row query tile) of dq_accum, zeroed, the number of key tiles that have
  // added into that tile; each adds when the count equals its rank, so every element's fp32 sum runs
  // in ascending key-tile order (OrderedWindowQTiles). nullptr: reductions in any order.
  int32_t* __restrict__ dq_order;
  float* __restrict__ dk_accum;  // (B, Hkv, Lk, D) fp32, zeroed (CUDA-core kernel): dK, atomics
  float* __restrict__ dv_accum;  // (B, Hkv, Lk, Dv) fp32, zeroed (CUDA-core kernel): dV, atomics
  // Block-sparse: the mask transposed, per (batch, head, key block) the query blocks that visit
  // it, ascending, and their partial-mask rows (-1 full); built on the GPU (build_q_lists).
  const int32_t* __restrict__ q_num_blocks;  // (Bm, Hm, nKb)
  const int32_t* __restrict__ q_indices;     // (Bm, Hm, nKb, nQb)
  const int32_t* __restrict__ q_partial;     // (Bm, Hm, nKb, nQb)
  int64_t qt_batch_stride, qt_head_stride;   // strides of q_num_blocks over (Bm, Hm), 0 where broadcast
  // Block-sparse: the key-major kernels' CTA order (bwd_tile_of_cta). A permutation of the nKb key
  // blocks whose first *kv_heavy entries (the blocks far more query blocks visit than the mean, e.g.
  // global tokens' keys) run first over every (batch, kv head); nullptr: the grid's order.
  const int32_t* __restrict__ kv_block_order;  // (nKb)
  const int32_t* __restrict__ kv_heavy;        // (1)
  // Causal-type windows (no right bound past the diagonal, none on the left), where key block n
  // is seen by the query tiles from its diagonal on: the key-major kernels' CTAs run in groups of
  // head_group (batch, kv head)s, each group's key blocks in ascending order (heaviest first) over
  // its heads (bwd_tile_of_cta). 0: the grid's order.
  int head_group;
  // Tensor-core kernels: each (batch, kv head)'s key block runs as head_splits CTAs, each over
  // h_per_kv / head_splits of its query heads (plan_bwd_head_splits), which add scale * dK and dV
  // into dk_accum / dv_accum (fp32, zeroed) when head_splits > 1. The grid's y is (batch, kv head,
  // split), split fastest (plan_bwd_block_sparse_head_splits for block-sparse masks).
  int head_splits;
};

// Parameters of top-k selection (exact per-head scores, or the lightning indexer).
struct TopkSelectParams {
  // Exact mode: score(i, j) = q_h[i] . k_h[j]; one index set per query head.
  const void* __restrict__ q;  // (B, H, Lq, D), dtype
  const void* __restrict__ k;  // (B, Hkv, Lk, D), dtype
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  // Indexer mode: score(t, s) = sum_j w[t, j] * relu(qi[t, j] . ki[s]); one index set per token.
  const void* __restrict__ iq;  // (B, Lq, HI, DI), dtype
  const void* __restrict__ ik;  // (B, Lk, DI), dtype
  const void* __restrict__ iw;  // (B, Lq, HI), dtype
  int64_t iq_batch_stride, iq_row_stride, iq_head_stride;
  int64_t ik_batch_stride, ik_row_stride;
  int64_t iw_batch_stride, iw_row_stride;
  int hi, di;

  int32_t* __restrict__ out;  // (B, Hs, Lq, topk), int32, contiguous; ascending, -1 padded
  // CUDA path: scores of one chunk of rows in a workspace, (rows, scores_stride) fp32.
  float* __restrict__ scores;
  int64_t scores_stride;  // >= Lk
  int64_t row_begin;      // CUDA-core scoring: first (b, hs, i) row of the chunk in flight
  // Tensor-core scoring (prescored): the chunk is 64-row query tiles [tile_begin, tile_begin + n)
  // of the tiles numbered over (B, Hs, ceil(Lq / 64)); workspace row (tile - tile_begin) * 64 + r
  // holds query row 64 * (tile % n_qtiles) + r, written by topk_score before selection reads it.
  int64_t tile_begin;
  int n_qtiles;
  int n_splits;  // CTAs per tile of the scoring launch, each a contiguous share of the key tiles
  bool prescored;
  // Filtered selection (SelectPlan::filter_stride > 0): the scores never reach memory. Per chunk,
  // topk_score (score_mode 1) scores every filter_stride-th key tile into `scores` (the sample:
  // each score's top 16 key bits (order_key), scores_stride of them per workspace row, all the
  // threshold needs); topk_select (select_mode 1) turns each row's sample
  // into a threshold that about 1.5 k of the row's keys reach; topk_score (score_mode 2) appends
  // the keys at or above it to the row's candidates; topk_select (select_mode 2) selects among
  // them, and rows whose candidates cannot decide (fewer than k, or more than cand_cap) go to a
  // list that topk_select (select_mode 3) selects the unfiltered way, with `scores` then a
  // workspace of full rows, one per CTA.
  int filter_stride = 0;
  int score_mode = 0;   // 0: every key into scores; 1: the sample into scores; 2: candidates
  int select_mode = 0;  // 0: from scores; 1: thresholds; 2: from candidates; 3: the fallback list
  uint32_t* __restrict__ thresholds = nullptr;    // per workspace row: an order key (radix_select.cuh)
  uint32_t* __restrict__ cand = nullptr;          // (rows, cand_cap, 2): score bits, key index
  int* __restrict__ cand_count = nullptr;         // (rows, n_splits): a row's candidates in each CTA's slice
  int64_t* __restrict__ fallback_rows = nullptr;  // rows over (B, Hs, Lq) the candidates could not decide
  int* __restrict__ fallback_count = nullptr;     // the list's length (zeroed per chunk)
  int cand_cap = 0;
  int cand_target = 0;  // candidates a row's threshold aims at (SelectPlan::cand_target)
  int cand_slice = 0;   // candidates per scoring CTA's slice of a row: cand_cap / n_splits
  int b, h, h_kv, lq, lk, d, topk;
  int h_sel;      // heads with their own index set: H (exact) or 1 (indexer)
  int h_per_kv;   // H / Hkv
  int kv_offset;  // Lk - Lq
  bool causal;
  bool indexer;
  ScalarKind dtype;
};

// Attention of a few new query tokens over a KV cache (attention_with_kvcache). A cache row is
// addressed through pages: token t of sequence b lives in page block_table[b][t / page_size],
// slot t % page_size. A contiguous cache (B, Hkv, Lmax, D) is the same with one page per
// sequence (block_table == nullptr: page b, page_size = Lmax).
struct DecodeParams {
  const void* __restrict__ q;  // (B, H, Lq, D), dtype
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  void* k_cache;  // pages of (page_size, Hkv, D) (or (Hkv, Lmax, D)), dtype; written by the append
  void* v_cache;
  int64_t k_page_stride, k_row_stride, k_head_stride;
  int64_t v_page_stride, v_row_stride, v_head_stride;
  const int32_t* __restrict__ block_table;  // (B, max_pages), int32; nullptr = contiguous
  int64_t bt_batch_stride;
  int num_pages, page_size;
  int capacity;                               // tokens a sequence's cache holds
  const int32_t* __restrict__ cache_seqlens;  // (B,), int32: tokens cached before this call
  // Optional new keys / values (B, Hkv, Lq, D), written at cache_seqlens[b] + i before attending
  // (rows that fall outside the cache are dropped; the op's checks refuse them beforehand).
  const void* __restrict__ k_new;
  const void* __restrict__ v_new;
  int64_t kn_batch_stride, kn_head_stride, kn_row_stride;
  int64_t vn_batch_stride, vn_head_stride, vn_row_stride;
  void* __restrict__ o;  // (B, H, Lq, Dv), dtype
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  float* __restrict__ lse;  // (B, H, Lq), fp32, contiguous
  // Split-KV: with num_splits > 1 each split writes its normalised O and LSE here, fp32,
  // (num_splits, B, H, Lq, Dv) and (num_splits, B, H, Lq), and the combine kernel merges them.
  float* __restrict__ o_part;
  float* __restrict__ lse_part;
  int b, h, h_kv, h_per_kv, lq, d, dv;
  ScalarKind dtype;
  float scale, scale_log2;
  // Keys of sequence b: len = min(seqlen + lk_new, capacity) with lk_new = Lq when new keys are
  // appended (else 0); query i sees key j < len with
  //   (window_left < 0 || j >= i + off - window_left) && (window_right < 0 || j <= i + off + window_right)
  // and off = seqlen + lk_new - Lq (bottom-right aligned; causal = (-1, 0)).
  int lk_new;
  int window_left, window_right;
  int num_splits;
  int num_ctas;    // the decode grid: units * num_splits, or fewer (balanced: each CTA several pieces)
  int row_chunks;  // CTAs per (b, kv head) along the H / Hkv * Lq query rows of a group
  int chunk_rows;  // query rows of a row chunk (16 * the plan's row tiles)
  // Optional block-sparse selection of cache blocks (sparse decode): per (b, mask head) the key
  // blocks of kv_block tokens to visit, ascending; mask heads are 1 or Hkv (zero strides broadcast).
  const int32_t* __restrict__ kv_num_blocks;  // (Bm, Hm, 1)
  const int32_t* __restrict__ kv_indices;     // (Bm, Hm, 1, max_kv_blocks)
  int64_t bs_batch_stride, bs_head_stride;
  int max_kv_blocks, kv_block;
};

}  // namespace sparse_attn
