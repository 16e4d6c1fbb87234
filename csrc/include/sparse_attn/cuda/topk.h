// Dynamic top-k on CUDA: selection (exact per-head scores or the lightning indexer) and attention
// over gathered keys. Definitions in topk.cuh.
#pragma once

#include <cuda_runtime.h>

#include "sparse_attn/params.h"

namespace sparse_attn {

// Rows of the selection's score workspace per launch: memory is rows * Lk * 4 bytes.
constexpr int64_t topk_select_rows_per_chunk(int64_t lk) {
  const int64_t budget = int64_t(256) << 20;  // 256 MiB
  const int64_t rows = budget / (lk * 4 > 0 ? lk * 4 : 1);
  return rows < 1 ? 1 : (rows > 65536 ? 65536 : rows);
}

// Selects for rows [params.row_begin, params.row_begin + rows) of (B, Hs, Lq), using
// params.scores (rows x Lk fp32) as workspace.
template <ScalarKind kDtype>
cudaError_t run_topk_select_(const TopkSelectParams& params, int64_t rows, cudaStream_t stream);

// out = softmax over each query's listed keys (params.indices) of scale * q.k, times V.
template <ScalarKind kDtype>
cudaError_t run_gather_fwd_(const AttnFwdParams& params, cudaStream_t stream);

}  // namespace sparse_attn
