// A selection (of keys or key blocks) as a block-sparse mask (layout: sparse_attn/selection_mask.h),
// the same lists and bits as the CPU builder. One CTA per (query block, group, batch), one thread per query row:
// the thread walks its row's selection, keeps the bits of the key block it is in (two 64-bit
// registers) and puts them into its own words of that block's partial row when the block changes:
// stored while the row ascends (each word written once, over the caller's zeros, nothing read), ORed
// in by fire-and-forget atomics once it has turned back (any order of the selection is right). The
// touched key blocks are a bitmap in shared memory; then each warp checks some of them for fullness
// and the lists are written ascending.
#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/topk.h"

namespace sparse_attn {
namespace cuda {
namespace {

// A row's bits of one block into its words. `first`: the block was not written before (a row that
// has ascended so far), so the words still hold the caller's zeros: stored without reading them.
// Otherwise ORed in by atomics whose result is unused (reductions: no load the thread waits on).
__device__ __forceinline__ void flush_bits(uint32_t* row_words, int words, uint64_t lo, uint64_t hi, bool first) {
  if (first) {
    if (words == 4)
      *reinterpret_cast<uint4*>(row_words) =
          make_uint4(uint32_t(lo), uint32_t(lo >> 32), uint32_t(hi), uint32_t(hi >> 32));
    else
      *reinterpret_cast<uint2*>(row_words) = make_uint2(uint32_t(lo), uint32_t(lo >> 32));
    return;
  }
  auto* w64 = reinterpret_cast<unsigned long long*>(row_words);
  if (lo) atomicOr(w64, (unsigned long long)lo);
  if (words == 4 && hi) atomicOr(w64 + 1, (unsigned long long)hi);
}

// take(entry) for each of a row's k entries in order: 16-byte loads, four in flight (a row's 64
// bytes), where the layout allows.
template <typename Take>
__device__ __forceinline__ void walk_row(const SelectionMaskParams& p, const int32_t* row, Take&& take) {
  int j = 0;
  if (p.idx_row_stride % 4 == 0 && reinterpret_cast<uintptr_t>(p.indices) % 16 == 0 &&
      p.idx_batch_stride % 4 == 0 && p.idx_group_stride % 4 == 0) {
    for (; j + 16 <= p.k; j += 16) {  // four loads in flight before the first is used
      int4 v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = __ldg(reinterpret_cast<const int4*>(row + j + 4 * i));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        take(v[i].x);
        take(v[i].y);
        take(v[i].z);
        take(v[i].w);
      }
    }
    for (; j + 4 <= p.k; j += 4) {
      const int4 v = __ldg(reinterpret_cast<const int4*>(row + j));
      take(v.x);
      take(v.y);
      take(v.z);
      take(v.w);
    }
  }
  for (; j < p.k; ++j) take(__ldg(row + j));
}

// kKvBlock: p.kv_block (64 or 128) as a constant, so a key's block and column are shifts and masks.
template <int kKvBlock>
__global__ void selection_mask_kernel(const SelectionMaskParams p) {
  extern __shared__ uint32_t smem[];
  __shared__ unsigned long long offset_sum;
  const int qb = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int cap = selection_block_cap(qb, p.lq, p.q_block, kKvBlock, p.nkb, p.causal, p.row_offset);
  const int nw = (cap + 31) / 32;
  uint32_t* touched = smem;
  uint32_t* full = smem + nw;
  int* prefix = reinterpret_cast<int*>(smem + 2 * nw);
  for (int i = tid; i < nw; i += nthreads) touched[i] = full[i] = 0;
  if (tid == 0) offset_sum = 0;
  __syncthreads();
  unsigned long long before = 0;  // partial rows of the query blocks before this one
  for (int i = tid; i < qb; i += nthreads)
    before += selection_block_cap(i, p.lq, p.q_block, kKvBlock, p.nkb, p.causal, p.row_offset);
  if (before) atomicAdd(&offset_sum, before);
  __syncthreads();
  const int64_t first_pair = (int64_t(b) * p.g + g) * p.pairs + int64_t(offset_sum);
  constexpr int words = kKvBlock / 32;
  const int rows = min(p.q_block, p.lq - qb * p.q_block);

  if (tid < rows) {
    const int32_t* row = p.indices + b * p.idx_batch_stride + g * p.idx_group_stride +
                         (int64_t(qb) * p.q_block + tid) * p.idx_row_stride;
    int cur = -1;
    bool ascending = true;  // every block so far above the one before: cur not written yet
    uint64_t lo = 0, hi = 0;
    const int64_t row_global = int64_t(qb) * p.q_block + tid;
    const int64_t limit = p.causal ? min(int64_t(p.lk), row_global + p.row_offset + 1) : int64_t(p.lk);
    auto add = [&](int kb, uint64_t lo_bits, uint64_t hi_bits) {
      if (kb != cur) {
        if (cur >= 0) flush_bits(p.words + ((first_pair + cur) * p.q_block + tid) * words, words, lo, hi, ascending);
        ascending = ascending && kb > cur;
        cur = kb;
        lo = hi = 0;
        atomicOr(&touched[kb >> 5], 1u << (kb & 31));
      }
      lo |= lo_bits;
      hi |= hi_bits;
    };
    auto take = [&](int32_t entry) {
      if (entry < 0) return;
      if (p.entry_block == 1) {
        if (entry >= limit) return;
        const int kb = entry / kKvBlock;
        if (kb >= cap) return;
        const int c = entry - kb * kKvBlock;
        add(kb, c < 64 ? 1ull << c : 0ull, c < 64 ? 0ull : 1ull << (c - 64));
      } else {
        const int64_t a = int64_t(entry) * p.entry_block;
        for_key_range(a, a + p.entry_block, limit, kKvBlock, cap, add);
      }
    };
    walk_row(p, row, take);
    if (cur >= 0) flush_bits(p.words + ((first_pair + cur) * p.q_block + tid) * words, words, lo, hi, ascending);
  }
  __syncthreads();  // the rows' words and the touched bitmap, visible to the whole block

  // Fullness: warp w checks the touched blocks kb with kb % warps == w; none can be full when
  // k is below the smallest block's key count (the pass is skipped: it reads every word again).
  const int lane = tid & 31, warp = tid >> 5, warps = nthreads / 32;
  const int smallest = min(kKvBlock, p.lk - (p.nkb - 1) * kKvBlock);
  for (int kb = int64_t(p.k) * p.entry_block >= smallest ? warp : cap; kb < cap; kb += warps) {
    if (!(touched[kb >> 5] >> (kb & 31) & 1)) continue;
    const int keys = min(kKvBlock, p.lk - kb * kKvBlock);
    bool all = true;
    for (int r = lane; r < rows; r += 32) {
      const uint32_t* w = p.words + ((first_pair + kb) * p.q_block + r) * words;
      for (int i = 0; i < words; ++i) {
        const int bits = min(32, max(0, keys - 32 * i));
        const uint32_t want = bits == 32 ? ~0u : (1u << bits) - 1u;
        all = all && (__ldcg(w + i) & want) == want;  // from L2, where the atomics landed
      }
    }
    if (__all_sync(0xffffffffu, all) && lane == 0) atomicOr(&full[kb >> 5], 1u << (kb & 31));
  }
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int i = 0; i < nw; ++i) {
      prefix[i] = run;
      run += __popc(touched[i]);
    }
    for (int hh = 0; hh < p.heads_per_group; ++hh)
      p.kv_num_blocks[(int64_t(b) * p.out_heads + int64_t(g) * p.heads_per_group + hh) * p.nqb + qb] = run;
    prefix[nw] = run;
  }
  __syncthreads();
  const int count = prefix[nw];
  for (int hh = 0; hh < p.heads_per_group; ++hh) {
    const int64_t list = ((int64_t(b) * p.out_heads + int64_t(g) * p.heads_per_group + hh) * p.nqb + qb) * p.max_kb;
    for (int i = tid; i < nw; i += nthreads) {
      uint32_t bits = touched[i];
      int slot = prefix[i];
      while (bits) {
        const int bit = __ffs(bits) - 1;
        bits &= bits - 1;
        const int kb = i * 32 + bit;
        p.kv_indices[list + slot] = kb;
        p.kv_partial[list + slot] = (full[i] >> bit & 1) ? -1 : int32_t(first_pair + kb);
        ++slot;
      }
    }
    for (int s = count + tid; s < p.max_kb; s += nthreads) p.kv_indices[list + s] = p.kv_partial[list + s] = 0;
  }
}

// _selection_union (selection_mask.h): one CTA of q_block threads per (sampled query block, group,
// batch), a thread per row walking its entries as the builder does, the key blocks touched marked in
// a shared bitmap; each warp adds its share of the bitmap's bits to *count.
template <int kKvBlock>
__global__ void selection_union_kernel(const SelectionMaskParams p, int samples, unsigned long long* count) {
  extern __shared__ uint32_t touched[];
  const int qb = union_sample_block(blockIdx.x, samples, p.nqb), g = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x;
  const int cap = selection_block_cap(qb, p.lq, p.q_block, kKvBlock, p.nkb, p.causal, p.row_offset);
  const int nw = (cap + 31) / 32;
  for (int i = tid; i < nw; i += blockDim.x) touched[i] = 0;
  __syncthreads();
  const int rows = min(p.q_block, p.lq - qb * p.q_block);
  if (tid < rows) {
    const int64_t row_global = int64_t(qb) * p.q_block + tid;
    const int32_t* row = p.indices + b * p.idx_batch_stride + g * p.idx_group_stride + row_global * p.idx_row_stride;
    const int64_t limit = p.causal ? min(int64_t(p.lk), row_global + p.row_offset + 1) : int64_t(p.lk);
    int cur = -1;
    auto mark = [&](int kb, uint64_t, uint64_t) {
      if (kb == cur) return;
      cur = kb;
      atomicOr(&touched[kb >> 5], 1u << (kb & 31));
    };
    if (p.entry_block == 1) {
      walk_row(p, row, [&](int32_t entry) {
        constexpr int kShift = kKvBlock == 128 ? 7 : 6;
        if (entry < 0 || entry >= limit || (entry >> kShift) >= cap) return;
        mark(entry >> kShift, 0, 0);
      });
    } else {
      walk_row(p, row, [&](int32_t entry) {
        if (entry < 0) return;
        const int64_t a = int64_t(entry) * p.entry_block;
        for_key_range(a, a + p.entry_block, limit, kKvBlock, cap, mark);
      });
    }
  }
  __syncthreads();
  unsigned c = 0;
  for (int i = tid; i < nw; i += blockDim.x) c += __popc(touched[i]);
  for (int o = 16; o; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if ((tid & 31) == 0 && c) atomicAdd(count, (unsigned long long)c);
}

}  // namespace
}  // namespace cuda

cudaError_t run_selection_mask(const SelectionMaskParams& p, cudaStream_t stream) {
  if (int64_t(p.b) * p.g * p.nqb == 0) return cudaSuccess;
  if ((p.q_block != 64 && p.q_block != 128) || (p.kv_block != 64 && p.kv_block != 128) || p.g > 65535 ||
      p.b > 65535)
    return cudaErrorInvalidValue;
  const int nw = (p.nkb + 31) / 32;
  const size_t smem = size_t(3 * nw + 1) * sizeof(uint32_t);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(unsigned(p.nqb), unsigned(p.g), unsigned(p.b));
  if (p.kv_block == 128)
    cuda::selection_mask_kernel<128><<<grid, unsigned(p.q_block), smem, stream>>>(p);
  else
    cuda::selection_mask_kernel<64><<<grid, unsigned(p.q_block), smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_selection_union(const SelectionMaskParams& p, int samples, unsigned long long* count,
                                cudaStream_t stream) {
  if (int64_t(p.b) * p.g * samples == 0) return cudaSuccess;
  if ((p.q_block != 64 && p.q_block != 128) || (p.kv_block != 64 && p.kv_block != 128) || p.g > 65535 ||
      p.b > 65535 || samples > p.nqb)
    return cudaErrorInvalidValue;
  const size_t smem = size_t((p.nkb + 31) / 32) * sizeof(uint32_t);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(unsigned(samples), unsigned(p.g), unsigned(p.b));
  if (p.kv_block == 128)
    cuda::selection_union_kernel<128><<<grid, unsigned(p.q_block), smem, stream>>>(p, samples, count);
  else
    cuda::selection_union_kernel<64><<<grid, unsigned(p.q_block), smem, stream>>>(p, samples, count);
  return cudaGetLastError();
}

}  // namespace sparse_attn
