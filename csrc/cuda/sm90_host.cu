// Host code of the Hopper kernels: their TMA descriptors (whether they run is plan_flash's call).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sparse_attn/cuda/flash_fwd.h"
#include "sparse_attn/cuda/tma.h"

namespace sparse_attn {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return EncodeTiledFn(nullptr);
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

}  // namespace

bool tma_encoder_available() { return encode_tiled() != nullptr; }

bool sm90_kernels_built() {
#if defined(SPARSE_ATTN_SM90A)
  return true;
#else
  return false;
#endif
}

cudaError_t encode_bhld_tma(CUtensorMap* map, const void* base, int elem_bytes, int d, int rows, int heads,
                            int batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride, int box_rows) {
  const EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr || elem_bytes != 2) return cudaErrorNotSupported;
  const int64_t row_bytes = row_stride * elem_bytes;
  const int64_t head_bytes = heads == 1 ? row_bytes * rows : head_stride * elem_bytes;
  const int64_t batch_bytes = batch == 1 ? head_bytes * heads : batch_stride * elem_bytes;
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(row_bytes), cuuint64_t(head_bytes), cuuint64_t(batch_bytes)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  // The kernels only read the raw 16-bit patterns, so one data type serves bf16 and fp16.
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
}

}  // namespace sparse_attn
