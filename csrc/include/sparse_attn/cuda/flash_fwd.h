// Declarations of the flash attention forward launchers (definitions: flash_fwd.cuh, one
// explicit instantiation per file in csrc/instantiations). The glue includes only this file.
#pragma once

#include <cuda_runtime.h>

#include "sparse_attn/params.h"

namespace sparse_attn {

// Which key tiles a query tile visits (see tile_iter.h).
enum class Variant : int {
  kWindow = 0,          // dense, causal or local: WindowTiles
  kBlockSparse = 1,     // block-sparse with 128-row query blocks
  kBlockSparseM64 = 2,  // block-sparse with 64-row query blocks
};

struct FlashTile {
  int block_m, block_n, warps;
};

// Tile sizes of the tensor-core kernel, used by launcher and instantiations alike. Block-sparse
// tiles are 64 keys wide so that 64- and 128-wide key blocks divide evenly.
constexpr FlashTile flash_fwd_tile(int head_dim, Variant v) {
  if (v == Variant::kBlockSparseM64) return {64, 64, 4};
  if (v == Variant::kWindow && head_dim <= 64) return {128, 128, 4};
  return {128, 64, head_dim >= 256 ? 8 : 4};
}

// Tile sizes of the Hopper (wgmma) kernel: 64 query rows per consumer warpgroup x 128 keys, plus
// one producer warpgroup. Head dim 64 has half the GEMM work per score, so three consumers keep
// the tensor cores busy through the softmax; block-sparse runs here for 128 x 128 mask blocks only.
constexpr FlashTile flash_fwd_sm90_tile(int head_dim, Variant v) {
  return v == Variant::kWindow && head_dim <= 64 ? FlashTile{192, 128, 16} : FlashTile{128, 128, 12};
}

// Tile sizes of the fp32 (CUDA-core) kernel.
constexpr FlashTile flash_fwd_fp32_tile() { return {16, 32, 4}; }

// Tensor-core kernel: kDtype is kBFloat16 or kFloat16; head dims up to kHeadDim (64, 128, 256).
template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_flash_fwd_(const AttnFwdParams& params, cudaStream_t stream);

// Hopper kernel (sm_90a, kHeadDim 64 or 128; kWindow or kBlockSparse). run_flash_fwd_ calls it
// itself when flash_sm90_eligible says so.
template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_flash_fwd_sm90_(const AttnFwdParams& params, cudaStream_t stream);

// True when the current device is compute capability 9.0, this build holds sm_90a code, the
// environment does not say SPARSE_ATTN_SM90=0, and the inputs and the output suit TMA (16-byte
// aligned bases, strides multiples of 8 elements), head dim <= 128, and a block-sparse mask has
// 128 x 128 blocks.
bool flash_sm90_eligible(const AttnFwdParams& params, Variant variant);

// True when the Hopper kernel will run and its tiles are uneven (causal, windowed, block-sparse):
// the caller then passes a zeroed tile_counter, so CTAs take tiles dynamically (heaviest first).
bool flash_sm90_dynamic_schedule(const AttnFwdParams& params, Variant variant);

// Number of SMs of the current device (cached): the persistent Hopper grid.
int current_device_sm_count();

// fp32 inputs (any head dim up to 256): exact fp32 arithmetic on the CUDA cores.
template <Variant kVariant>
cudaError_t run_flash_fwd_fp32_(const AttnFwdParams& params, cudaStream_t stream);

}  // namespace sparse_attn
