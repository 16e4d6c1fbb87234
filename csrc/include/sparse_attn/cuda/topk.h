// Dynamic top-k selection on CUDA: exact per-head scores or the lightning indexer. Definitions in
// topk_select.cuh and topk_score.cuh; what runs is plan_select's call (plan.h). Attention over the
// selection: gather_fwd.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sparse_attn/document_mask.h"
#include "sparse_attn/params.h"
#include "sparse_attn/plan.h"
#include "sparse_attn/selection_mask.h"

namespace sparse_attn {

// Scores query tiles [params.tile_begin, params.tile_begin + tiles) into params.scores
// (params.n_splits CTAs per tile); then run_topk_select_ with params.prescored selects.
template <ScalarKind kDtype>
cudaError_t run_topk_score_(const TopkSelectParams& params, int64_t tiles, cudaStream_t stream);

// Selects for rows [params.row_begin, params.row_begin + rows) of (B, Hs, Lq), scoring them into
// params.scores first; or, when params.prescored, for the `rows` = 64 * tiles workspace rows of
// tiles [params.tile_begin, ...) that run_topk_score_ filled.
template <ScalarKind kDtype>
cudaError_t run_topk_select_(const TopkSelectParams& params, int64_t rows, cudaStream_t stream);

// A selection as a block-sparse mask (selection_mask.h): one CTA of q_block threads per
// (query block, group, batch); p.words zeroed beforehand.
cudaError_t run_selection_mask(const SelectionMaskParams& p, cudaStream_t stream);
// _selection_union (selection_mask.h): adds the pairs touched in `samples` query blocks to *count.
cudaError_t run_selection_union(const SelectionMaskParams& p, int samples, unsigned long long* count,
                                cudaStream_t stream);

// A user's selection (rows of k int32 entries) in topk_attention's form: each row's distinct
// non-negative entries ascending, then -1s (selection_rows.cu). One CTA per row; k <=
// kCanonicalSelectionMaxK.
constexpr int kCanonicalSelectionMaxK = 4096;
cudaError_t run_canonical_selection(const int32_t* in, int32_t* out, int64_t rows, int k,
                                    cudaStream_t stream);

// Packed documents as a block-sparse mask (document_mask.h): one CTA of q_block threads per query
// block.
cudaError_t run_document_mask(const DocumentMaskParams& p, cudaStream_t stream);

}  // namespace sparse_attn
