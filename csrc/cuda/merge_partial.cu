// Context parallelism's merge of a partial attention output into another by their LSEs, in place:
// a group of lanes of one warp per row, each taking 16 bytes at a time (one element where the rows
// are not 16-byte aligned); the row's weights from its two LSEs, its elements combined in fp32 and
// written back once (the composite of torch ops it replaces made five passes over fp32 copies).
#include <climits>
#include <cmath>
#include <cstdint>

#include "sparse_attn/cuda/element.cuh"
#include "sparse_attn/cuda/merge.h"

namespace sparse_attn {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// group lanes of a warp per row (a power of two <= 32), each taking kVec elements at a time.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) merge_partial_kernel(MergeParams p, int64_t rows, int group) {
  const int64_t thread = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row = thread / group;
  const int lane = int(thread % group);
  const bool live = row < rows;
  float m0 = -INFINITY, m1 = -INFINITY, *lse = nullptr;
  int64_t o_at = 0, p_at = 0;
  if (live) {
    const int64_t i = row % p.l, hb = row / p.l, h = hb % p.h, b = hb / p.h;
    auto at = [&](const int64_t* s) { return b * s[0] + h * s[1] + i * s[2]; };
    lse = p.lse + at(p.lse_stride);
    m0 = *lse;
    m1 = p.part_lse[at(p.part_lse_stride)];
    o_at = at(p.out_stride);
    p_at = at(p.part_stride);
  }
  const float top = fmaxf(m0, m1);
  const float e0 = __expf(m0 - top), e1 = __expf(m1 - top), total = e0 + e1;
  if (live && top != -INFINITY) {  // else neither part sees a key: out and lse stay
    const float w0 = e0 / total, w1 = e1 / total;
    auto* out = reinterpret_cast<Pack<T, kVec>*>(static_cast<T*>(p.out) + o_at);
    const auto* part = reinterpret_cast<const Pack<T, kVec>*>(static_cast<const T*>(p.part) + p_at);
    for (int64_t c = lane; c < p.d / kVec; c += group) {
      Pack<T, kVec> x = out[c];
      const Pack<T, kVec> y = part[c];
#pragma unroll
      for (int e = 0; e < kVec; ++e) x.v[e] = from_f32<T>(w0 * to_f32(x.v[e]) + w1 * to_f32(y.v[e]));
      out[c] = x;
    }
  }
  __syncwarp();  // every lane of the row (one warp) has read its LSE
  if (live && top != -INFINITY && lane == 0) *lse = top + __logf(total);
}

}  // namespace
}  // namespace cuda

cudaError_t run_merge_partial(const MergeParams& params, cudaStream_t stream) {
  const int64_t rows = params.b * params.h * params.l;
  if (rows == 0 || params.d == 0) return cudaSuccess;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    bool vec = params.d % kVec == 0 && reinterpret_cast<uintptr_t>(params.out) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(params.part) % 16 == 0;
    for (int i = 0; i < 3; ++i)
      vec = vec && params.out_stride[i] % kVec == 0 && params.part_stride[i] % kVec == 0;
    const int64_t chunks = vec ? params.d / kVec : params.d;
    int group = 1;
    while (group < 32 && group < chunks) group *= 2;
    const int64_t blocks = (rows * group + cuda::kThreads - 1) / cuda::kThreads;
    if (blocks > INT32_MAX) return cudaErrorInvalidValue;
    if (vec) {
      cuda::merge_partial_kernel<T, kVec>
          <<<unsigned(blocks), cuda::kThreads, 0, stream>>>(params, rows, group);
    } else {
      cuda::merge_partial_kernel<T, 1><<<unsigned(blocks), cuda::kThreads, 0, stream>>>(params, rows, group);
    }
    return cudaGetLastError();
  };
  switch (params.dtype) {
    case ScalarKind::kBFloat16:
      return launch(__nv_bfloat16{});
    case ScalarKind::kFloat16:
      return launch(__half{});
    default:
      return launch(float{});
  }
}

}  // namespace sparse_attn
