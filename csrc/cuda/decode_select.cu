// Top-k decode's block selection (kvcache_topk_mask): per sequence, the k cache blocks with the
// highest score, the first `sinks` and the `recent` newest blocks always, none past the sequence's
// length; written ascending as a decode mask's lists. One CTA per sequence, radix_select.cuh's
// selection over the row (no host synchronisation, one launch).
#include <climits>
#include <cmath>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/decode.h"
#include "sparse_attn/cuda/radix_select.cuh"

namespace sparse_attn {
namespace cuda {
namespace {

__global__ void __launch_bounds__(kSelectThreads)
    decode_block_select_kernel(const float* __restrict__ scores, float* __restrict__ work, int64_t ld,
                               const int32_t* __restrict__ lens, int nkb, int block_size, int kk, int sinks,
                               int recent, int32_t* __restrict__ counts, int32_t* __restrict__ indices) {
  __shared__ SelectSmem sm;
  const int b = blockIdx.x;
  const int64_t cap = int64_t(nkb) * block_size;
  const int64_t len = min(max(int64_t(lens[b]), int64_t(0)), cap);
  const int nb = int((len + block_size - 1) / block_size);  // blocks holding tokens
  float* row = work + b * ld;
  for (int j = threadIdx.x; j < nkb; j += blockDim.x) {
    const float s = scores[int64_t(b) * nkb + j];
    row[j] = j >= nb ? -INFINITY : ((j < sinks || j > nb - 1 - recent) ? INFINITY : s);
  }
  __syncthreads();  // the block's own global writes, visible to its threads
  int32_t* out = indices + int64_t(b) * kk;
  if (kk < nkb) {
    radix_select(row, nkb, kk, out, sm);
  } else {
    for (int j = threadIdx.x; j < kk; j += blockDim.x) out[j] = j;
  }
  if (threadIdx.x == 0) counts[b] = min(kk, nb);  // blocks past the length sort last
}

}  // namespace
}  // namespace cuda

cudaError_t run_decode_block_select(const float* scores, float* work, int64_t ld, const int32_t* lens, int b,
                                    int nkb, int block_size, int kk, int sinks, int recent, int32_t* counts,
                                    int32_t* indices, cudaStream_t stream) {
  if (b == 0) return cudaSuccess;
  if (kk <= 0 || kk > nkb || ld % 4 != 0) return cudaErrorInvalidValue;
  cuda::decode_block_select_kernel<<<unsigned(b), cuda::kSelectThreads, 0, stream>>>(
      scores, work, ld, lens, nkb, block_size, kk, sinks, recent, counts, indices);
  return cudaGetLastError();
}

}  // namespace sparse_attn
