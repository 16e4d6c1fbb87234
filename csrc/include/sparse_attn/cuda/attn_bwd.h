// Declarations of the CUDA backward launchers (definitions: attn_bwd.cuh, the tensor-core kernel;
// attn_bwd_simt.cuh, the preprocess, the transposed block lists and the CUDA-core kernel). The
// glue includes only this file.
//
// A backward call runs: bwd_preprocess (LSE in log2 units and delta = dO . O - dLSE per row), for
// block-sparse masks build_q_lists (the key block -> query blocks lists), then either the
// tensor-core kernel (dK, dV per key tile; dQ through fp32 atomics), top-k's tensor-core kernel
// (gather_bwd.cuh: dQ per token; dK, dV through fp32 atomics) or the CUDA-core kernel (dQ per
// query row; dK, dV through fp32 atomics), then the glue casts the fp32 accumulators.
#pragma once

#include <cuda_runtime.h>

#include "sparse_attn/params.h"
#include "sparse_attn/plan.h"

namespace sparse_attn {

// Query tile of the tensor-core backward: each CTA owns 128 keys (64 for block-sparse masks of
// 64-key blocks) of one (batch, kv head) and visits 64-row query tiles of every query head of its
// group.
constexpr int kBwdBlockM = 64;

template <ScalarKind kDtype>
cudaError_t run_bwd_preprocess_(const AttnBwdParams& params, cudaStream_t stream);

// Fills q_num_blocks / q_indices / q_partial from the forward's lists; q_indices must be zeroed
// before (it doubles as the scatter matrix). No host synchronisation.
cudaError_t run_build_q_lists(const AttnBwdParams& params, int bm, int hm, int32_t* q_num_blocks,
                              int32_t* q_indices, int32_t* q_partial, cudaStream_t stream);

// The key-major kernels' CTA order (params.kv_block_order, params.kv_heavy; bwd_tile_of_cta) from
// the transposed lists' counts q_num_blocks ((heads = Bm * Hm) x nKb): the key blocks visited more
// than twice the mean first. scratch: nKb ints. One CTA, no host synchronisation.
cudaError_t run_build_kv_order(const int32_t* q_num_blocks, int64_t heads, int nkb, int32_t* order,
                               int32_t* heavy, int32_t* scratch, cudaStream_t stream);

// The Hopper backward's dQ tiles (params.dq_accum, fragment order, col_blocks of 64 columns) cast
// into params.dq (bf16/fp16, (B, H, Lq, D) contiguous, D even); cudaErrorInvalidConfiguration where
// the grid cannot hold B * H.
cudaError_t run_dq_from_fragments(const AttnBwdParams& params, int col_blocks, cudaStream_t stream);

// Tensor-core backward (mma.sync, sm_80+), kHeadDim 64 or 128.
template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_attn_bwd_(const AttnBwdParams& params, cudaStream_t stream);

// Hopper backward (attn_bwd_sm90.cuh, sm_90a with TMA), kHeadDim 64 or 128; block-sparse masks
// of 128-key blocks only (cudaErrorInvalidValue otherwise).
template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_attn_bwd_sm90_(const AttnBwdParams& params, cudaStream_t stream);

// Deterministic mode's dQ (attn_bwd_dq.cuh, mma.sync): no atomics, written to params.dq.
template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_attn_bwd_dq_(const AttnBwdParams& params, cudaStream_t stream);

// Top-k's tensor-core backward (gather_bwd.cuh), the forward's heads per warp (plan_gather's group).
template <ScalarKind kDtype, int kHeadDim>
cudaError_t run_gather_bwd_mma_(const AttnBwdParams& params, int group, bool shared, cudaStream_t stream);

// CUDA-core backward: any dtype and head dims; kGather: top-k (params.fwd.indices).
template <ScalarKind kDtype, Variant kVariant, bool kGather>
cudaError_t run_attn_bwd_simt_(const AttnBwdParams& params, cudaStream_t stream);

}  // namespace sparse_attn
