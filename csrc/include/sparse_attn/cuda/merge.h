// Declaration of the partial-output merge (merge_partial.cu): context parallelism's LSE merge of a
// partial attention output into another, in place.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sparse_attn/params.h"

namespace sparse_attn {

// out (B, H, L, D) and lse (B, H, L) fp32 merged in place with a partial over other keys, part
// (B, H, L, D) of out's dtype and part_lse (B, H, L) fp32: per row, lse' = log(e^lse + e^part_lse),
// out' = e^(lse - lse') out + e^(part_lse - lse') part, summed in fp32 and rounded once. A row
// where both LSEs are -inf keeps out and lse. Strides in elements; the last dim of out and part
// has stride 1.
struct MergeParams {
  ScalarKind dtype;
  void* out;
  float* lse;
  const void* part;
  const float* part_lse;
  int64_t b, h, l, d;
  int64_t out_stride[3], lse_stride[3], part_stride[3], part_lse_stride[3];  // (B, H, L)
};

cudaError_t run_merge_partial(const MergeParams& params, cudaStream_t stream);

}  // namespace sparse_attn
