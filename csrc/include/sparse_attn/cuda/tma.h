// Host side of TMA: tensor-map descriptors for the Hopper kernels (definitions in
// csrc/cuda/sm90_host.cu; the driver entry point is looked up at run time, so nothing links
// against libcuda).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sparse_attn {

// 4-d map (d, rows, heads, batch), innermost first, of a (batch, heads, rows, d) tensor of 16-bit
// elements with element strides; boxes of 64 x box_rows, 128-byte swizzled, out-of-range
// elements read as zero. cudaErrorNotSupported when the driver lacks TMA or rejects the layout.
cudaError_t encode_bhld_tma(CUtensorMap* map, const void* base, int elem_bytes, int d, int rows, int heads,
                            int batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride, int box_rows);

}  // namespace sparse_attn
