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

}  // namespace sparse_attn
