// Declarations of the flash attention forward launchers (definitions: flash_fwd.cuh,
// flash_fwd_sm90.cuh, flash_fwd_fp32.cuh; one explicit instantiation per file in
// csrc/instantiations). The glue includes only this file. Every launcher runs what its plan
// (plan.h) says; none decides.
#pragma once

#include <cuda_runtime.h>

#include "sparse_attn/params.h"
#include "sparse_attn/plan.h"

namespace sparse_attn {

// Portable tensor-core core (mma.sync, sm_80+): kDtype kBFloat16 or kFloat16, head dims up to
// kHeadDim (64, 128, 256), the tile plan.tile (flash_fwd_tile).
template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_flash_fwd_(const AttnFwdParams& params, const FlashPlan& plan, cudaStream_t stream);

// Hopper core (sm_90a, kHeadDim 64 or 128): the tile, schedule and options of the plan
// (plan.tile one of flash_fwd_sm90_tiles; a dynamic schedule needs params.tile_counter zeroed).
template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_flash_fwd_sm90_(const AttnFwdParams& params, const FlashPlan& plan, cudaStream_t stream);

// Whether the Hopper core at this (padded) head dim checks its output for hidden NaN / Inf values
// and so needs params.hidden_records (hidden_values.cuh): at 64 and 128, the head dims it is built
// for (docs/PERF_LOG.md, "hidden values").
constexpr bool sm90_fwd_checks_hidden_values(int head_dim) { return head_dim == 64 || head_dim == 128; }

// fp32 inputs (any head dim up to 256): exact fp32 arithmetic on the CUDA cores.
template <Variant kVariant>
cudaError_t run_flash_fwd_fp32_(const AttnFwdParams& params, cudaStream_t stream);

// True when the driver can encode TMA descriptors (the Hopper core needs them).
bool tma_encoder_available();

// True when this build holds the Hopper kernels (TORCH_CUDA_ARCH_LIST with 9.0a).
bool sm90_kernels_built();

}  // namespace sparse_attn
