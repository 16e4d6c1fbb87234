// Declaration of the gathered-attention launcher (definition: gather_fwd.cuh; one explicit
// instantiation per dtype in csrc/instantiations).
#pragma once

#include <cuda_runtime.h>

#include "sparse_attn/params.h"
#include "sparse_attn/plan.h"

namespace sparse_attn {

// out = softmax over each query's listed keys (params.indices) of scale * q.k, times V, on the
// tensor cores or the CUDA cores as plan says.
template <ScalarKind kDtype>
cudaError_t run_gather_fwd_(const AttnFwdParams& params, const GatherPlan& plan, cudaStream_t stream);

}  // namespace sparse_attn
