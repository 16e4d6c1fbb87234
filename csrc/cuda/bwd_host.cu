// Host-side pieces of the backward that are not templates of a kernel family: the transposed
// block-sparse lists (key block -> query blocks), built on the GPU without a host synchronisation
// (a scatter into a zeroed (Bm, Hm, nKb, nQb) matrix, then an in-place compaction of each row in
// ascending query block), the key-major kernels' CTA order from them, and the Hopper kernel's dQ
// put in place.
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

// The Hopper backward's dQ: per (batch * H + head) 64 x 64 fp32 tiles of scale * dQ in wgmma
// fragment order, flat index ((((j * 4 + warp) * 8 + g) * 4 + t) * 2 + e_hi) * 2 + e_lo for row
// 16 warp + 8 e_hi + g and column 8 j + 2 t + e_lo of the tile. One CTA per tile reads it as
// float4s in order (each holding columns c, c + 1 of rows r and r + 8; 256 threads, four each) and writes
// them as pairs of T into dq (B, H, Lq, D) contiguous, rows past Lq and columns past D dropped. (A strided
// torch copy of the permuted view ran at 1.3 TB/s.)
template <typename T, typename T2>
__global__ void dq_from_fragments_kernel(const float4* __restrict__ frag, T* __restrict__ dq, int lq, int d,
                                         int nm, int col_blocks) {
  __shared__ __align__(16) T staged[64][64 + 8];  // the tile in rows (padded: fewer bank conflicts)
  const int m = blockIdx.x / col_blocks, cb = blockIdx.x % col_blocks;
  const int64_t bh = blockIdx.y;
  const float4* tile = frag + ((bh * nm + m) * col_blocks + cb) * 1024;
  float4 x[4];  // all four loads in flight before the first store
#pragma unroll
  for (int u = 0; u < 4; ++u) x[u] = tile[threadIdx.x + 256 * u];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int v = threadIdx.x + 256 * u;
    const int t = v & 3, g = (v >> 2) & 7, warp = (v >> 5) & 3, j = v >> 7;
    const int row = 16 * warp + g, col = 8 * j + 2 * t;
    *reinterpret_cast<T2*>(&staged[row][col]) = T2{from_f32<T>(x[u].x), from_f32<T>(x[u].y)};
    *reinterpret_cast<T2*>(&staged[row + 8][col]) = T2{from_f32<T>(x[u].z), from_f32<T>(x[u].w)};
  }
  __syncthreads();
  // Rows out in 16-byte pieces: 8 per row, two rows of 64 columns per 16 threads.
  T* out = dq + bh * int64_t(lq) * d;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int piece = threadIdx.x + 256 * u, r = piece / 8, c = (piece % 8) * 8;
    const int row = m * 64 + r, col = cb * 64 + c;
    if (row >= lq || col >= d) continue;
    if (col + 8 <= d && d % 8 == 0) {
      *reinterpret_cast<uint4*>(out + int64_t(row) * d + col) =
          *reinterpret_cast<const uint4*>(&staged[r][c]);
    } else {
      for (int e = 0; e < 8 && col + e < d; ++e) out[int64_t(row) * d + col + e] = staged[r][c + e];
    }
  }
}

// The key-major kernels' CTA order (bwd_tile_of_cta): one CTA of 256 threads. visits[kb] = the
// most query blocks any (bm, hm) lists for key block kb; the key blocks visited more than twice the
// mean go first, in ascending order, then the others, in ascending order; *heavy = how many went
// first. scratch: nKb ints (the visits).
__global__ void __launch_bounds__(1024)
    build_kv_order_kernel(const int32_t* __restrict__ q_num, int64_t heads, int nkb,
                          int32_t* __restrict__ order, int32_t* __restrict__ heavy,
                          int32_t* __restrict__ visits) {
  __shared__ int64_t warp_sums[32];
  __shared__ int warp_counts[32];
  __shared__ int running[2];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  int64_t total = 0;
  for (int kb = tid; kb < nkb; kb += blockDim.x) {
    int v = 0;
    for (int64_t hd = 0; hd < heads; ++hd) v = max(v, q_num[hd * nkb + kb]);
    visits[kb] = v;
    total += v;
  }
  for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (lane == 0) warp_sums[warp] = total;
  if (tid < 2) running[tid] = 0;
  __syncthreads();
  if (tid == 0) {
    int64_t sum = 0;
    for (int w = 0; w < int(blockDim.x / 32); ++w) sum += warp_sums[w];
    warp_sums[0] = 2 * sum;  // heavy: visits * nkb > 2 * sum (twice the mean, in integers)
  }
  __syncthreads();
  const int64_t twice = warp_sums[0];
  int n_heavy = 0;
  for (int base = 0; base < nkb; base += blockDim.x) {
    const int kb = base + tid;
    n_heavy += __syncthreads_count(kb < nkb && int64_t(visits[kb]) * nkb > twice);
  }
  // Stable partition, chunk by chunk: a warp's prefix by ballot, the warps' by shared memory.
  for (int base = 0; base < nkb; base += blockDim.x) {
    const int kb = base + tid;
    const bool live = kb < nkb;
    const bool h = live && int64_t(visits[kb]) * nkb > twice;
    const unsigned hb = __ballot_sync(0xffffffffu, h), lb = __ballot_sync(0xffffffffu, live && !h);
    const unsigned below = (1u << lane) - 1u;
    if (lane == 0) warp_counts[warp] = __popc(hb) | (__popc(lb) << 16);
    __syncthreads();
    int before_h = running[0], before_l = running[1];
    for (int w = 0; w < warp; ++w) {
      before_h += warp_counts[w] & 0xffff;
      before_l += warp_counts[w] >> 16;
    }
    if (h) order[before_h + __popc(hb & below)] = kb;
    if (live && !h) order[n_heavy + before_l + __popc(lb & below)] = kb;
    __syncthreads();
    if (tid == 0) {
      for (int w = 0; w < int(blockDim.x / 32); ++w) {
        running[0] += warp_counts[w] & 0xffff;
        running[1] += warp_counts[w] >> 16;
      }
    }
    __syncthreads();
  }
  if (tid == 0) *heavy = n_heavy;
}

}  // namespace
}  // namespace cuda

cudaError_t run_build_kv_order(const int32_t* q_num_blocks, int64_t heads, int nkb, int32_t* order,
                               int32_t* heavy, int32_t* scratch, cudaStream_t stream) {
  if (nkb == 0) return cudaSuccess;
  cuda::build_kv_order_kernel<<<1, 256, 0, stream>>>(q_num_blocks, heads, nkb, order, heavy, scratch);
  return cudaGetLastError();
}

cudaError_t run_dq_from_fragments(const AttnBwdParams& params, int col_blocks, cudaStream_t stream) {
  const AttnFwdParams& p = params.fwd;
  const int nm = params.lq_pad / 64;
  const int64_t tiles = int64_t(nm) * col_blocks, heads = int64_t(p.b) * p.h;
  if (tiles == 0 || heads == 0) return cudaSuccess;
  if (tiles > INT32_MAX || heads > 65535 || p.d % 2 != 0) return cudaErrorInvalidConfiguration;
  const dim3 grid{unsigned(tiles), unsigned(heads)};
  const auto* frag = reinterpret_cast<const float4*>(params.dq_accum);
  if (p.dtype == ScalarKind::kBFloat16) {
    cuda::dq_from_fragments_kernel<__nv_bfloat16, __nv_bfloat162>
        <<<grid, 256, 0, stream>>>(frag, static_cast<__nv_bfloat16*>(params.dq), p.lq, p.d, nm, col_blocks);
  } else if (p.dtype == ScalarKind::kFloat16) {
    cuda::dq_from_fragments_kernel<__half, __half2>
        <<<grid, 256, 0, stream>>>(frag, static_cast<__half*>(params.dq), p.lq, p.d, nm, col_blocks);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

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
