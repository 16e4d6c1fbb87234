// Declaration of the KV-cache decode launcher (definition: decode_fwd.cuh; one explicit
// instantiation per dtype and head dim in csrc/instantiations).
#pragma once

#include <cuda_runtime.h>

#include "sparse_attn/params.h"
#include "sparse_attn/plan.h"

namespace sparse_attn {

// attention_with_kvcache: the append of the new keys and values (when given), the split-KV
// attention over the cache, and the combine of the splits, as plan says.
template <ScalarKind kDtype, int kHeadDim>
cudaError_t run_decode_fwd_(const DecodeParams& params, const DecodePlan& plan, cudaStream_t stream);

// Top-k decode's block selection (decode_select.cu): for each of the b rows of block scores
// (b, nkb) fp32, the kk highest (the first `sinks` and the `recent` newest blocks of a sequence of
// lens[row] tokens always, blocks past it never), ascending, into indices (b, kk), and the blocks
// that hold tokens among them into counts (b,). work: (b, ld) fp32 scratch, ld a multiple of 4.
cudaError_t run_decode_block_select(const float* scores, float* work, int64_t ld, const int32_t* lens, int b,
                                    int nkb, int block_size, int kk, int sinks, int recent, int32_t* counts,
                                    int32_t* indices, cudaStream_t stream);

}  // namespace sparse_attn
