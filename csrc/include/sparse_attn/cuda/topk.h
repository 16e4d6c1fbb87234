// Dynamic top-k on CUDA: selection (exact per-head scores or the lightning indexer) and attention
// over gathered keys. Definitions in topk.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sparse_attn/params.h"

namespace sparse_attn {

// Bytes of the selection's fp32 score workspace, given the bytes of the index tensor it fills:
// chunks of query rows are scored and selected one after another within it. Twice the output,
// at least 256 MiB, at most 2 GiB: memory stays O(Lq * k), and at long context a chunk holds
// enough rows to fill the GPU.
constexpr int64_t topk_select_workspace_bytes(int64_t index_bytes) {
  const int64_t lo = int64_t(256) << 20, hi = int64_t(2) << 30, want = 2 * index_bytes;
  return want < lo ? lo : (want > hi ? hi : want);
}

// Tensor-core scoring (topk_score.cuh): 64-row query tiles against 64-key tiles.
constexpr int kTopkScoreBlockM = 64;
constexpr int kTopkScoreBlockN = 64;

// Padded dimension of the scored dot products (64 or 128).
inline int topk_score_dim(const TopkSelectParams& p) { return (p.indexer ? p.di : p.d) <= 64 ? 64 : 128; }

// True when the tensor-core scorer takes these inputs: 16-bit, dimension <= 128, 16-byte aligned
// rows, and the tile's query heads (HI for the indexer) fit in shared memory.
inline bool topk_score_eligible(const TopkSelectParams& p) {
  if (p.dtype == ScalarKind::kFloat32 || (p.indexer ? p.di : p.d) > 128) return false;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  auto mult8 = [](int64_t a, int64_t b, int64_t c) { return a % 8 == 0 && b % 8 == 0 && c % 8 == 0; };
  const bool layout_ok =
      p.indexer ? aligned(p.iq) && aligned(p.ik) && mult8(p.iq_batch_stride, p.iq_row_stride, p.iq_head_stride) &&
                      mult8(p.ik_batch_stride, p.ik_row_stride, 0)
                : aligned(p.q) && aligned(p.k) && mult8(p.q_batch_stride, p.q_head_stride, p.q_row_stride) &&
                      mult8(p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  const int64_t heads = p.indexer ? p.hi : 1, dim = topk_score_dim(p);
  const int64_t smem = (2 * kTopkScoreBlockN + heads * kTopkScoreBlockM) * dim * 2 + kTopkScoreBlockM * heads * 4;
  return layout_ok && smem <= 200 * 1024;
}

// Scores query tiles [params.tile_begin, params.tile_begin + tiles) into params.scores
// (params.n_splits CTAs per tile); then run_topk_select_ with params.prescored selects.
template <ScalarKind kDtype>
cudaError_t run_topk_score_(const TopkSelectParams& params, int64_t tiles, cudaStream_t stream);

// Selects for rows [params.row_begin, params.row_begin + rows) of (B, Hs, Lq), scoring them into
// params.scores first; or, when params.prescored, for the `rows` = 64 * tiles workspace rows of
// tiles [params.tile_begin, ...) that run_topk_score_ filled.
template <ScalarKind kDtype>
cudaError_t run_topk_select_(const TopkSelectParams& params, int64_t rows, cudaStream_t stream);

// out = softmax over each query's listed keys (params.indices) of scale * q.k, times V.
template <ScalarKind kDtype>
cudaError_t run_gather_fwd_(const AttnFwdParams& params, cudaStream_t stream);

}  // namespace sparse_attn
