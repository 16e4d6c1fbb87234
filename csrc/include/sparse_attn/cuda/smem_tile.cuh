// Addressing of tiles in shared memory shared by the mma.sync kernels (flash, gathered attention,
// top-k scoring): rows of 16-byte chunks, swizzled so that ldmatrix reads are conflict-free.
#pragma once

#include <cstdint>

namespace sparse_attn::cuda {

// Byte offset of 16-byte chunk `chunk` of row `row`. The XOR with the row spreads the eight rows
// one ldmatrix phase reads over all 32 banks.
template <int kChunks>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return uint32_t((row * kChunks + (chunk ^ (row & 7))) * 16);
}

// Shared-memory address of chunk `chunk` (a compile-time step) relative to a per-thread base
// `base` = swz(row, c0) for the thread's row and its chunk c0 in {0, 1}: for rows of >= 8 chunks
// the swizzle is linear in the step, so each step costs one XOR with a constant.
template <int kStep>
__device__ __forceinline__ uint32_t swz_step(uint32_t base) {
  return (base ^ uint32_t((kStep & 3) << 5)) + uint32_t((kStep >> 2) << 7);
}

// Hides a value from loop-invariant code motion, so that addresses derived from it are
// recomputed where they are used instead of occupying registers for the whole loop.
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

}  // namespace sparse_attn::cuda
