// Host code of the Hopper kernels: when to use them, and their TMA descriptors.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

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

// Compute capability of device `dev` as major * 10 + minor, cached (the attribute query is cheap,
// but this runs on every launch).
int compute_capability(int dev) {
  static int cache[64] = {};
  if (dev < 0 || dev >= 64) return 0;
  if (cache[dev] == 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
      return 0;
    cache[dev] = major * 10 + minor;
  }
  return cache[dev];
}

// TMA wants a 16-byte aligned base and strides that are multiples of 16 bytes; a dimension of
// size 1 may have any stride (encode_bhld_tma replaces it).
bool tma_layout_ok(const void* base, int64_t row_stride, int64_t head_stride, int heads, int64_t batch_stride,
                   int batch) {
  auto ok = [](int64_t stride, int size) { return size == 1 || (stride > 0 && stride % 8 == 0); };
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && row_stride > 0 && row_stride % 8 == 0 &&
         ok(head_stride, heads) && ok(batch_stride, batch);
}

}  // namespace

bool flash_sm90_eligible(const AttnFwdParams& p, Variant variant) {
#if defined(SPARSE_ATTN_SM90A)
  if (const char* env = std::getenv("SPARSE_ATTN_SM90"); env != nullptr && env[0] == '0') return false;
  if (variant == Variant::kBlockSparseM64) return false;
  if (variant == Variant::kBlockSparse && (p.q_block != 128 || p.kv_block != 128)) return false;
  if (p.dtype == ScalarKind::kFloat32 || p.d != p.dv || p.d > 128 || p.d % 8 != 0) return false;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || compute_capability(dev) != 90) return false;
  return encode_tiled() != nullptr &&
         tma_layout_ok(p.q, p.q_row_stride, p.q_head_stride, p.h, p.q_batch_stride, p.b) &&
         tma_layout_ok(p.k, p.k_row_stride, p.k_head_stride, p.h_kv, p.k_batch_stride, p.b) &&
         tma_layout_ok(p.v, p.v_row_stride, p.v_head_stride, p.h_kv, p.v_batch_stride, p.b) &&
         tma_layout_ok(p.o, p.o_row_stride, p.o_head_stride, p.h, p.o_batch_stride, p.b);
#else
  (void)p;
  (void)variant;
  return false;
#endif
}

bool flash_sm90_dynamic_schedule(const AttnFwdParams& p, Variant variant) {
  const bool uneven = variant == Variant::kBlockSparse || p.window_left >= 0 || p.window_right >= 0;
  return uneven && flash_sm90_eligible(p, variant);
}

int current_device_sm_count() {
  static int cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 1;
  if (cache[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) return 1;
    cache[dev] = n;
  }
  return cache[dev];
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
