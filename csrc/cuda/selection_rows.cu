// A user's selection (topk_attention(indices=...)) in the op's form, on the GPU: each row's
// distinct non-negative entries ascending, then -1s, as the Python reference `_routes.drop_repeats`
// gives them (the torch.sort of every row this replaced took 6.2 ms on an H100 for 64k rows of 2048
// entries, more than half of the attention it prepares). One CTA per row: the row is read into
// shared memory once; a row already in that form (what topk_attention returns, a selection reused
// across layers) is written back as it is.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/topk.h"

namespace sparse_attn {
namespace cuda {
namespace {

// Rows whose entries are all below kBitmapKeys go through a bitmap of their keys in shared memory
// (each entry one bit; the set bits, read in order, are the row's distinct entries ascending);
// rows with larger entries through CUB's block radix sort over the bits their entries use (4-bit
// digits: 6-bit ones measured 1.4x slower at k = 2048). Either way the distinct entries are
// written ascending from the row's start, then -1s.
constexpr int kBitmapKeys = 1 << 17;

template <int kThreads, int kItems>
__global__ void __launch_bounds__(kThreads) canonical_rows_kernel(const int32_t* in, int32_t* out, int k) {
  using Sort = cub::BlockRadixSort<uint32_t, kThreads, kItems>;
  using Scan = cub::BlockScan<int, kThreads>;
  constexpr int kRow = kThreads * kItems;
  __shared__ union {
    typename Sort::TempStorage sort;
    uint32_t bits[kBitmapKeys / 32];
  } work;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int32_t row[kRow];
  __shared__ int32_t row_max;
  const int tid = threadIdx.x;
  if (tid == 0) row_max = -1;
  const int32_t* src = in + int64_t(blockIdx.x) * k;
  int32_t* dst = out + int64_t(blockIdx.x) * k;
  for (int i = tid; i < k; i += kThreads) row[i] = src[i];
  __syncthreads();
  // In the form already? Entry i against entry i - 1: -1, or ascending after a non-negative one.
  // (And the largest entry: the bitmap's width, or the bits the sort looks at.)
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
  int distinct = 0, pos = 0;  // the row's distinct entries; this thread's first place among them
  if (row_max < kBitmapKeys) {
    const int words = row_max / 32 + 1;  // (row_max = -1: one empty word)
    for (int w = tid; w < words; w += kThreads) work.bits[w] = 0;
    __syncthreads();
    for (int i = tid; i < k; i += kThreads) {
      const int32_t x = row[i];
      if (x >= 0) atomicOr(&work.bits[x / 32], 1u << (x % 32));
    }
    __syncthreads();  // the bitmap is whole; `row` is free
    const int per = (words + kThreads - 1) / kThreads;
    const int w0 = min(tid * per, words), w1 = min(w0 + per, words);
    int count = 0;
    for (int w = w0; w < w1; ++w) count += __popc(work.bits[w]);
    Scan(scan_storage).ExclusiveSum(count, pos, distinct);
    for (int w = w0; w < w1; ++w)
      for (uint32_t m = work.bits[w]; m != 0; m &= m - 1) row[pos++] = w * 32 + __ffs(m) - 1;
  } else {
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
    Sort(work.sort).Sort(keys, 0, bits);
#pragma unroll
    for (int j = 0; j < kItems; ++j) row[tid * kItems + j] = int32_t(keys[j]);
    __syncthreads();
    bool keep[kItems];
    int count = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = tid * kItems + j;
      keep[j] = keys[j] != empty && (i == 0 || uint32_t(row[i - 1]) != keys[j]);
      count += keep[j];
    }
    Scan(scan_storage).ExclusiveSum(count, pos, distinct);
    __syncthreads();  // every thread has read its neighbour's key before the distinct ones replace them
#pragma unroll
    for (int j = 0; j < kItems; ++j)
      if (keep[j]) row[pos++] = int32_t(keys[j]);
  }
  __syncthreads();
  for (int i = tid; i < k; i += kThreads) dst[i] = i < distinct ? row[i] : -1;
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
