// Packed documents as a block-sparse mask (sparse_attn/document_mask.h), the same lists and bits as
// the CPU builder. One CTA per query block, one thread per row: each finds its row's key interval
// (a binary search of cu_seqlens_q); block reductions give the key-block range and the blocks every
// row sees whole, which are listed full in one parallel step; each other block of the range gets
// its rows' bits (one 16- or 8-byte store per row) if any row sees a key of it.
#include <climits>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/topk.h"
#include "sparse_attn/document_mask.h"

namespace sparse_attn {
namespace cuda {
namespace {

template <int kWords>
__global__ void document_mask_kernel(const DocumentMaskParams p) {
  __shared__ int first, last, lo_max, hi_min;
  const int qb = blockIdx.x, r = threadIdx.x;
  if (r == 0) {
    first = hi_min = INT_MAX;
    last = lo_max = -1;
  }
  __syncthreads();
  const int i = qb * p.q_block + r;
  int64_t lo = 1, hi = 0;  // rows past total_q see nothing and decide nothing
  if (i < p.total_q) document_row_keys(p, i, lo, hi);
  const bool sees = lo <= hi;
  if (sees) {  // keys are < total_k <= INT_MAX
    atomicMin(&first, int(lo));
    atomicMax(&last, int(hi));
    atomicMax(&lo_max, int(lo));
    atomicMin(&hi_min, int(hi));
  }
  const bool all_see = __syncthreads_and(sees || i >= p.total_q) != 0;  // also publishes the atomics
  int32_t* idx = p.kv_indices + int64_t(qb) * p.max_kb;
  int32_t* part = p.kv_partial + int64_t(qb) * p.max_kb;
  int count = 0;
  int64_t slot, slot_end;
  document_partial_rows(p, qb, slot, slot_end);
  if (last >= 0) {
    const int kb_first = first / p.kv_block, kb_last = last / p.kv_block;
    // Blocks every row sees whole: from the first starting at or after the largest lo, to the last
    // ending at or before the smallest hi (the key tail's block ends at total_k).
    int f0 = INT_MAX, f1 = -1;
    if (all_see) {
      f0 = max(kb_first, (lo_max + p.kv_block - 1) / p.kv_block);
      f1 = min(kb_last, hi_min >= p.total_k - 1 ? p.nkb - 1 : (hi_min + 1) / p.kv_block - 1);
    }
    for (int kb = kb_first; kb <= kb_last && count < p.max_kb; ++kb) {
      if (kb == f0 && f0 <= f1) {
        const int n = min(f1 - f0 + 1, p.max_kb - count);
        for (int j = r; j < n; j += blockDim.x) {
          idx[count + j] = f0 + j;
          part[count + j] = -1;
        }
        count += n;
        kb = f1;
        continue;
      }
      const int64_t k_hi = min(int64_t(kb) * p.kv_block + p.kv_block, int64_t(p.total_k)) - 1;
      const int64_t h = min(hi, k_hi);
      const bool mine = lo <= h && max(lo, int64_t(kb) * p.kv_block) <= h;
      if (!__syncthreads_or(mine) || slot >= slot_end) continue;
      uint32_t w[kWords];
#pragma unroll
      for (int j = 0; j < kWords; ++j) w[j] = document_word(lo, h, kb, p.kv_block, j);
      uint32_t* dst = p.words + (slot * p.q_block + r) * kWords;
      if constexpr (kWords == 4)
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      else
        *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
      if (r == 0) {
        idx[count] = kb;
        part[count] = int32_t(slot);
      }
      ++count;
      ++slot;
    }
  }
  if (r == 0) p.kv_num_blocks[qb] = count;
  for (int j = count + r; j < p.max_kb; j += blockDim.x) {
    idx[j] = 0;
    part[j] = -1;
  }
}

}  // namespace
}  // namespace cuda

cudaError_t run_document_mask(const DocumentMaskParams& p, cudaStream_t stream) {
  if (p.nqb == 0) return cudaSuccess;
  if ((p.q_block != 64 && p.q_block != 128) || (p.kv_block != 64 && p.kv_block != 128))
    return cudaErrorInvalidValue;
  if (p.kv_block == 128)
    cuda::document_mask_kernel<4><<<unsigned(p.nqb), unsigned(p.q_block), 0, stream>>>(p);
  else
    cuda::document_mask_kernel<2><<<unsigned(p.nqb), unsigned(p.q_block), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sparse_attn
