// A user's selection (topk_attention(indices=...)) in the op's form, on the GPU: each row of k
// entries ascending, -1 for a repeat (after its first occurrence) or for a negative entry, the
// -1s of negative entries last; the same values as the Python reference `_routes.drop_repeats`
// (a sort of every row), which on an H100 took 6.2 ms for 64k rows of 2048 entries, more than half
// of the attention it prepares. One CTA per row: the row is read into shared memory once; a row
// already in that form (strictly ascending entries, then only -1s: what topk_attention returns,
// a selection reused across layers) is written back as it is; any other row is sorted in shared
// memory by CUB's block radix sort (negative entries as the largest key) and its repeats marked.
#include <cub/block/block_radix_sort.cuh>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/topk.h"

namespace sparse_attn {
namespace cuda {
namespace {

// (CUB's 4-bit digits: 6-bit ones measured 1.4x slower at k = 2048.)
template <int kThreads, int kItems>
__global__ void __launch_bounds__(kThreads) canonical_rows_kernel(const int32_t* in, int32_t* out, int k) {
  using Sort = cub::BlockRadixSort<uint32_t, kThreads, kItems>;
  constexpr int kRow = kThreads * kItems;
  __shared__ typename Sort::TempStorage sort_storage;
  __shared__ int32_t row[kRow];
  __shared__ int32_t row_max;
  const int tid = threadIdx.x;
  if (tid == 0) row_max = -1;
  const int32_t* src = in + int64_t(blockIdx.x) * k;
  int32_t* dst = out + int64_t(blockIdx.x) * k;
  for (int i = tid; i < k; i += kThreads) row[i] = src[i];
  __syncthreads();
  // In the form already? Entry i against entry i - 1: -1, or ascending after a non-negative one.
  // (And the largest entry, so that the sort looks at only the bits the entries use.)
  bool ok = true;
  int32_t mx = -1;
  for (int i = tid; i < k; i += kThreads) {
    const int32_t x = row[i];
    ok &= i == 0 ? x >= -1 : (x == -1 || (x > row[i - 1] && row[i - 1] >= 0));
    mx = max(mx, x);
  }
  if (__syncthreads_and(ok)) {
    for (int i = tid; i < k; i += kThreads) dst[i] = row[i];
    return;
  }
  mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
  mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
  mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
  mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  if (tid % 32 == 0) atomicMax(&row_max, mx);
  __syncthreads();
  // Negative entries (and the padding past k) as row_max + 1, the largest key; bits: its width.
  const uint32_t empty = uint32_t(row_max) + 1u;
  const int bits = 32 - __clz(empty);
  uint32_t keys[kItems];  // blocked: this thread's entries tid * kItems ...
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int i = tid * kItems + j;
    keys[j] = i < k && row[i] >= 0 ? uint32_t(row[i]) : empty;
  }
  __syncthreads();  // every thread has read `row` before the sorted keys replace it
  Sort(sort_storage).Sort(keys, 0, bits);
#pragma unroll
  for (int j = 0; j < kItems; ++j) row[tid * kItems + j] = int32_t(keys[j]);
  __syncthreads();
  for (int i = tid; i < k; i += kThreads) {
    const int32_t x = row[i];
    dst[i] = uint32_t(x) == empty || (i > 0 && row[i - 1] == x) ? -1 : x;
  }
}

template <int kThreads, int kItems>
cudaError_t launch_canonical_rows(const int32_t* in, int32_t* out, int64_t rows, int k, cudaStream_t stream) {
  canonical_rows_kernel<kThreads, kItems><<<unsigned(rows), kThreads, 0, stream>>>(in, out, k);
  return cudaGetLastError();
}

}  // namespace
}  // namespace cuda

cudaError_t run_canonical_selection(const int32_t* in, int32_t* out, int64_t rows, int k,
                                    cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return cudaSuccess;
  if (rows > INT32_MAX || k > kCanonicalSelectionMaxK) return cudaErrorInvalidValue;
  if (k <= 512) return cuda::launch_canonical_rows<128, 4>(in, out, rows, k, stream);
  if (k <= 2048) return cuda::launch_canonical_rows<256, 8>(in, out, rows, k, stream);
  return cuda::launch_canonical_rows<256, 16>(in, out, rows, k, stream);
}

}  // namespace sparse_attn
