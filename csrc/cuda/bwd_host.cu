// The backward's transposed block-sparse lists (key block -> query blocks), built on the GPU
// without a host synchronisation: a scatter into a zeroed (Bm, Hm, nKb, nQb) matrix, then an
// in-place compaction of each row in ascending query block.
#include "sparse_attn/cuda/attn_bwd_simt.cuh"

namespace sparse_attn {
namespace cuda {
namespace {

// Transposed lists, step 1: every valid entry (query block qb lists key block kb with partial row
// pid) marks cell (kb, qb) of the zeroed scatter matrix (Bm, Hm, nKb, nQb) with pid + 2.
__global__ void scatter_q_lists_kernel(__grid_constant__ const AttnFwdParams p, int64_t rows,
                                       int32_t* cells) {
  const int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= rows * p.max_kv_blocks) return;
  const int64_t row = x / p.max_kv_blocks;  // (bm, hm, qb) of the contiguous forward lists
  const int e = int(x % p.max_kv_blocks);
  const int c = p.kv_num_blocks[row];
  if (e >= c) return;
  const int kb = p.kv_indices[x], pid = p.kv_partial[x];
  if (kb < 0 || kb >= p.num_kv_blocks || pid < -1 || pid >= p.num_partial) return;
  const int64_t head = row / p.num_q_blocks;
  const int qb = int(row % p.num_q_blocks);
  cells[(head * p.num_kv_blocks + kb) * p.num_q_blocks + qb] = pid + 2;
}

// Step 2: one warp per (bm, hm, kb) compacts its row of cells in ascending qb, in place.
__global__ void compact_q_lists_kernel(int64_t rows, int nqb, int32_t* indices, int32_t* partial,
                                       int32_t* counts) {
  const int64_t row = int64_t(blockIdx.x) * kBwdWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  int32_t* idx = indices + row * nqb;
  int32_t* part = partial + row * nqb;
  int count = 0;
  for (int base = 0; base < nqb; base += 32) {
    const int qb = base + lane;
    const int32_t cell = qb < nqb ? idx[qb] : 0;
    const unsigned present = __ballot_sync(0xffffffffu, cell != 0);
    if (cell != 0) {
      const int slot = count + __popc(present & ((1u << lane) - 1u));
      idx[slot] = qb;  // slot <= qb: the cells this warp still reads are never overwritten
      part[slot] = cell - 2;
    }
    count += __popc(present);
    __syncwarp();
  }
  if (lane == 0) counts[row] = count;
}

}  // namespace
}  // namespace cuda

cudaError_t run_build_q_lists(const AttnBwdParams& params, int bm, int hm, int32_t* q_num_blocks,
                              int32_t* q_indices, int32_t* q_partial, cudaStream_t stream) {
  const AttnFwdParams& p = params.fwd;
  const int64_t fwd_rows = int64_t(bm) * hm * p.num_q_blocks;
  const int64_t entries = fwd_rows * p.max_kv_blocks;
  if (entries > 0) {
    const int64_t grid = (entries + 255) / 256;
    if (grid > INT32_MAX) return cudaErrorInvalidConfiguration;
    cuda::scatter_q_lists_kernel<<<unsigned(grid), 256, 0, stream>>>(p, fwd_rows, q_indices);
    SA_CUDA_TRY(cudaGetLastError());
  }
  const int64_t rows = int64_t(bm) * hm * p.num_kv_blocks;
  const int64_t grid = (rows + cuda::kBwdWarps - 1) / cuda::kBwdWarps;
  if (grid == 0) return cudaSuccess;
  if (grid > INT32_MAX) return cudaErrorInvalidConfiguration;
  cuda::compact_q_lists_kernel<<<unsigned(grid), cuda::kBwdWarps * 32, 0, stream>>>(
      rows, p.num_q_blocks, q_indices, q_partial, q_num_blocks);
  return cudaGetLastError();
}

}  // namespace sparse_attn
