// Dynamic top-k selection on CUDA. Scores come from the tensor-core scorer (topk_score.cuh) when
// the plan says so (plan_select), else from CUDA-core loops here; attention over the selection is
// gather_fwd.cuh's.
//
// Selection, one CTA per query row: the row's scores against its visible keys are in a global
// workspace row (the workspace holds a bounded chunk of rows, never B * H * Lq * Lk), and
// radix_select (radix_select.cuh) writes the k largest, ascending, ties to the lower index, NaN
// ranking above everything (it must propagate, not be dropped). A row that sees at most k keys
// takes them all without scoring.
//
// Filtered selection (params.h, SelectPlan::filter_stride): topk_threshold_kernel makes a row's
// threshold from its sample of scores; topk_candidates_kernel selects among the keys that reached
// it (the candidates hold every key at or above the k-th largest when there are at least k of
// them, so the result is the unfiltered one), marks them in a bitmap of the row's keys and
// writes the marked keys in order; topk_select_kernel (select_mode 3) selects the rows it could
// not decide the unfiltered way.
#pragma once

#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/element.cuh"
#include "sparse_attn/cuda/radix_select.cuh"
#include "sparse_attn/cuda/topk.h"
#include "sparse_attn/plan.h"

namespace sparse_attn::cuda {

// Keys query row i sees.
__device__ __forceinline__ int visible_keys(const TopkSelectParams& p, int i) {
  if (!p.causal) return p.lk;
  const int64_t last = int64_t(i) + p.kv_offset + 1;
  return int(last < 0 ? 0 : (last > p.lk ? p.lk : last));
}

// The row over (B, Hs, Lq) of workspace row w of a tile chunk; false for the padding rows of a
// (b, hs) plane's ragged last tile.
__device__ __forceinline__ bool chunk_row(const TopkSelectParams& p, int64_t w, int64_t& row) {
  const int64_t tile = p.tile_begin + w / kTopkScoreBlockM;
  const int i0 = int(tile % p.n_qtiles) * kTopkScoreBlockM + int(w % kTopkScoreBlockM);
  row = tile / p.n_qtiles * p.lq + i0;
  return i0 < p.lq;
}

// Selection of `row` over (B, Hs, Lq) into p.out from the scores in s, which this CTA writes
// first unless `prescored`.
template <typename T>
__device__ void select_row(const TopkSelectParams& p, int64_t row, float* s, bool prescored, SelectSmem& sm,
                           float* query_smem) {
  const int i = int(row % p.lq), hs = int((row / p.lq) % p.h_sel), b = int(row / (int64_t(p.lq) * p.h_sel));
  int32_t* out = p.out + row * p.topk;
  const int nv = visible_keys(p, i);
  const int kk = p.topk < nv ? p.topk : nv;
  if (kk == nv) {  // every visible key (or none): no scores needed
    for (int x = threadIdx.x; x < p.topk; x += kSelectThreads) out[x] = x < kk ? x : -1;
    return;
  }

  // 1. Scores of the visible keys, unless topk_score wrote them already.
  if (!prescored && p.indexer) {
    const T* iq = static_cast<const T*>(p.iq) + b * p.iq_batch_stride + int64_t(i) * p.iq_row_stride;
    const T* iw = static_cast<const T*>(p.iw) + b * p.iw_batch_stride + int64_t(i) * p.iw_row_stride;
    for (int x = threadIdx.x; x < p.hi * p.di; x += kSelectThreads)
      query_smem[x] = to_f32(iq[(x / p.di) * p.iq_head_stride + x % p.di]);
    for (int x = threadIdx.x; x < p.hi; x += kSelectThreads) query_smem[p.hi * p.di + x] = to_f32(iw[x]);
    __syncthreads();
    for (int j = threadIdx.x; j < nv; j += kSelectThreads) {
      const T* kr = static_cast<const T*>(p.ik) + b * p.ik_batch_stride + int64_t(j) * p.ik_row_stride;
      float acc = 0.f;
      for (int hh = 0; hh < p.hi; ++hh) {
        float dot = 0.f;
        for (int d = 0; d < p.di; ++d) dot = fmaf(query_smem[hh * p.di + d], to_f32(kr[d]), dot);
        acc = fmaf(query_smem[p.hi * p.di + hh], fmaxf(dot, 0.f), acc);
      }
      s[j] = acc;
    }
  } else if (!prescored) {
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + hs * p.q_head_stride +
                 int64_t(i) * p.q_row_stride;
    const int hk = hs / p.h_per_kv;
    for (int d = threadIdx.x; d < p.d; d += kSelectThreads) query_smem[d] = to_f32(q[d]);
    __syncthreads();
    for (int j = threadIdx.x; j < nv; j += kSelectThreads) {
      const T* kr = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride +
                    int64_t(j) * p.k_row_stride;
      float dot = 0.f;
      for (int d = 0; d < p.d; ++d) dot = fmaf(query_smem[d], to_f32(kr[d]), dot);
      s[j] = dot;
    }
  }
  __syncthreads();

  // 2. Selection (radix_select.cuh).
  radix_select(s, nv, kk, out, sm);
  for (int x = kk + threadIdx.x; x < p.topk; x += kSelectThreads) out[x] = -1;
}

// The selection's shared memory: its state, then the query of the CUDA-core scoring (exact: D
// floats; indexer: HI * DI + HI floats).
template <typename T>
__global__ void __launch_bounds__(kSelectThreads)
    topk_select_kernel(__grid_constant__ const TopkSelectParams p) {
  extern __shared__ __align__(16) char select_smem[];
  SelectSmem& sm = *reinterpret_cast<SelectSmem*>(select_smem);
  float* query_smem = reinterpret_cast<float*>(select_smem + sizeof(SelectSmem));
  if (p.select_mode == 3) {  // the filter's undecided rows; this CTA's workspace row is its own
    const int n = *p.fallback_count;
    for (int x = blockIdx.x; x < n; x += gridDim.x) {
      select_row<T>(p, p.fallback_rows[x], p.scores + int64_t(blockIdx.x) * p.scores_stride, false, sm,
                    query_smem);
      __syncthreads();
    }
    return;
  }
  int64_t row;  // over (B, Hs, Lq)
  if (p.prescored) {
    if (!chunk_row(p, blockIdx.x, row)) return;
  } else {
    row = p.row_begin + blockIdx.x;
  }
  select_row<T>(p, row, p.scores + int64_t(blockIdx.x) * p.scores_stride, p.prescored, sm, query_smem);
}

constexpr int kThresholdWarps = 8;  // rows per CTA of topk_threshold_kernel (a warp each)

// A filtered selection's threshold per workspace row, a warp per row: the key (top 16 bits)
// that about cand_target of the row's visible keys should reach, from the rank it has in the row's
// sample; 0 (every key) where the row sees at most half as many keys as its candidates hold (the
// scoring threads' slices of them are uneven by up to a key tile per CTA).
template <typename T>
__global__ void __launch_bounds__(kThresholdWarps * 32)
    topk_threshold_kernel(__grid_constant__ const TopkSelectParams p) {
  __shared__ unsigned hists[kThresholdWarps][256], los[kThresholdWarps][512];
  const int warp = threadIdx.x / 32, lane = lane_id();
  unsigned* hist = hists[warp];
  const int64_t w = int64_t(blockIdx.x) * kThresholdWarps + warp;  // chunks are whole 64-row tiles
  int64_t row;
  if (!chunk_row(p, w, row)) return;
  const int i = int(row % p.lq), nv = visible_keys(p, i);
  // The sample: every stride-th of the key tiles the row's query tile sees (topk_score_kernel's,
  // kMode 1), their keys in order.
  const int m0 = i / kTopkScoreBlockM * kTopkScoreBlockM, rows = min(kTopkScoreBlockM, p.lq - m0);
  const int n_kt = (visible_keys(p, m0 + rows - 1) + kTopkScoreBlockN - 1) / kTopkScoreBlockN;
  const int stride = sample_tile_stride(p.filter_stride, n_kt), n_cols = n_kt / stride * kTopkScoreBlockN;
  auto key_of = [&](int c) {
    return ((c / kTopkScoreBlockN) * stride + stride - 1) * kTopkScoreBlockN + c % kTopkScoreBlockN;
  };
  int in_sample = 0;  // the row's visible keys in the sample
  for (int c0 = 0; c0 < n_cols; c0 += kTopkScoreBlockN)
    in_sample += max(0, min(kTopkScoreBlockN, nv - key_of(c0)));
  int need = int((int64_t(p.cand_target) * in_sample + nv - 1) / nv);
  if (2 * nv <= p.cand_cap || need > in_sample || need < 1) {
    if (lane == 0) p.thresholds[w] = 0u;
    return;
  }
  // The sample's 16-bit keys (the top bits of order_key).
  const uint16_t* s = reinterpret_cast<const uint16_t*>(p.scores) + w * p.scores_stride;
  // f(u, visible) for each sample key u (the top half of a 32-bit key), called warp-uniformly;
  // eight columns of one tile per lane (rows are 16-byte aligned, tiles 64 columns), four loads in
  // flight. Before f, first(u, visible) for the keys of the first 1024 columns, then first_done().
  auto scan = [&](auto&& first, auto&& first_done, auto&& f) {
    for (int c0 = 0; c0 < n_cols; c0 += 1024) {
      uint4 v[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int c = c0 + 256 * r + 8 * lane;
        if (c < n_cols) v[r] = *reinterpret_cast<const uint4*>(s + c);
      }
      auto each = [&](auto&& g) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int c = c0 + 256 * r + 8 * lane, j = c < n_cols ? key_of(c) : nv;
          const uint32_t words[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
#pragma unroll
          for (int e = 0; e < 8; ++e)
            g(e % 2 == 0 ? words[e / 2] << 16 : words[e / 2] & 0xffff0000u, j + e < nv);
        }
      };
      if (c0 == 0) {
        each(first);
        first_done();
      }
      each(f);
    }
  };
  // One pass: the histogram of the keys' top byte, and of the second byte of the keys whose top
  // byte is top_max or one less, top_max the largest among the first 1024 columns. The threshold's
  // rank is a few percent of the row and a top byte spans two binades of scores, so its top byte
  // is nearly always one of the two; otherwise a second pass counts its second byte.
  unsigned* lo = los[warp];
  for (int x = lane; x < 256; x += 32) hist[x] = lo[x] = lo[256 + x] = 0u;
  __syncwarp();
  uint32_t top_max = 0u;
  scan([&](uint32_t u, bool ok) { top_max = ok ? max(top_max, u >> 24) : top_max; },
       [&]() { top_max = __reduce_max_sync(0xffffffffu, top_max); },
       [&](uint32_t u, bool ok) {
         const uint32_t top = u >> 24;
         if (ok && top + 1u >= top_max && top <= top_max)
           atomicAdd(&lo[(top_max - top) * 256 + ((u >> 16) & 255u)], 1u);
         // (The sample's top bits: a few values, one of them most.)
         hist_add_major(hist, top, ok);
       });
  __syncwarp();
  const uint32_t top = warp_find_bin(hist, 256, need);
  uint32_t prefix = top << 24;
  if (top + 1u >= top_max && top <= top_max) {
    prefix |= warp_find_bin(lo + (top_max - top) * 256, 256, need) << 16;
  } else {
    __syncwarp();
    for (int x = lane; x < 256; x += 32) hist[x] = 0u;
    __syncwarp();
    scan([](uint32_t, bool) {}, []() {},
         [&](uint32_t u, bool ok) {
           if (ok && (u >> 24) == top) atomicAdd(&hist[(u >> 16) & 255u], 1u);
         });
    __syncwarp();
    prefix |= warp_find_bin(hist, 256, need) << 16;
  }
  if (lane == 0) p.thresholds[w] = prefix;
}

struct CandidateSmem {
  unsigned hist[256];
  int warp_sums[kSelectWarps];
  int start[kMaxFilterSplits], count[kMaxFilterSplits];  // the slices' offsets and lengths
  int need;
  uint32_t digit;
};

// topk_candidates_kernel's shared memory is candidate_smem_bytes (plan.h): the state first.
static_assert(sizeof(CandidateSmem) <= kCandidateStateBytes);

// f(position, key, index) for the row's candidates this thread reads: warp w reads slices w,
// w + 8, ..., each lane every 32nd entry of a slice's filled part (3 loads in flight); position =
// the candidate's place in the slices' concatenation.
template <typename F>
__device__ __forceinline__ void for_candidates(const uint2* cand, int n_seg, int cap_t,
                                               const CandidateSmem& sm, F&& f) {
  constexpr int kUnroll = 3;
  const int warp = threadIdx.x / 32, lane = lane_id();
  for (int seg = warp; seg < n_seg; seg += kSelectWarps) {
    const uint2* src = cand + seg * cap_t;
    const int n = sm.count[seg], base = sm.start[seg];
    for (int c0 = lane; c0 < n; c0 += 32 * kUnroll) {
      uint2 v[kUnroll];
#pragma unroll
      for (int r = 0; r < kUnroll; ++r)
        if (c0 + 32 * r < n) v[r] = src[c0 + 32 * r];
#pragma unroll
      for (int r = 0; r < kUnroll; ++r)
        if (c0 + 32 * r < n) f(base + c0 + 32 * r, order_key(__uint_as_float(v[r].x)), int(v[r].y));
    }
  }
}

// The first digit of a candidates row: its key's top 16 bits against the row's threshold (whose
// low 16 bits are zero; base = its top 16 bits - 1), bins 1-254 the exact 16-bit prefixes from the
// threshold's up; bin 0 takes every lower key (-0.0 passes a +0.0 threshold's float test), bin
// 255 every higher one (NaN among them). Candidates crowd just above the threshold, so the 256 bins spread
// them where the plain top byte (shared by nearly all) would not.
__device__ __forceinline__ unsigned candidate_bin(uint32_t key, int base) {
  return unsigned(min(max(int(key >> 16) - base, 0), 255));
}

// Selection among a workspace row's candidates (every visible key not below its threshold, in
// the slices of its scoring threads; scores as float bits).
//
// The k-th largest key is found a digit at a time, 8 bits per round, and the search stops at the
// first digit whose bin the row takes whole (its count equals what is still needed): the taken
// keys are then those at or above the bin's lower bound and no ties are split. The first digit
// is candidate_bin's, counted while the candidates are read (where the row has a threshold and the
// k-th key lands in an exact bin); otherwise the key's top byte, as for any row.
// (At most 48 registers: five CTAs per SM where the shared memory allows them, as at 64k and 128k
// keys.)
template <typename T>
__global__ void __launch_bounds__(kSelectThreads, 5)
    topk_candidates_kernel(__grid_constant__ const TopkSelectParams p) {
  extern __shared__ __align__(16) char cand_smem[];
  CandidateSmem& sm = *reinterpret_cast<CandidateSmem*>(cand_smem);
  uint32_t* keys = reinterpret_cast<uint32_t*>(cand_smem + kCandidateStateBytes);
  uint32_t* above = keys + candidate_key_words(p.cand_cap, p.lk);
  uint32_t* at = keys;  // once the keys are read
  const int tid = threadIdx.x, warp = tid / 32, lane = lane_id();
  int64_t row;
  if (!chunk_row(p, blockIdx.x, row)) return;
  const int nv = visible_keys(p, int(row % p.lq));
  const int kk = p.topk < nv ? p.topk : nv;
  int32_t* out = p.out + row * p.topk;
  if (kk == nv) {
    for (int x = tid; x < p.topk; x += kSelectThreads) out[x] = x < kk ? x : -1;
    return;
  }
  // The slices: one per scoring CTA of the row's query tile.
  const int n_seg = p.n_splits, cap_t = p.cand_slice;
  const int mine = tid < n_seg ? p.cand_count[int64_t(blockIdx.x) * n_seg + tid] : 0;
  int count;
  const int off = cta_exclusive_sum(mine, sm.warp_sums, count);
  if (__syncthreads_or(mine > cap_t) || count < kk) {  // the fallback decides this row
    if (tid == 0) p.fallback_rows[atomicAdd(p.fallback_count, 1)] = row;
    return;
  }
  if (tid < n_seg) sm.start[tid] = off, sm.count[tid] = mine;
  const int words = (nv + 31) / 32;
  for (int x = tid; x < words; x += kSelectThreads) above[x] = 0u;
  const uint32_t row_threshold = p.thresholds[blockIdx.x];
  const bool spread = row_threshold >= (2u << 16);  // a threshold, and a bin below it
  const int base = int(row_threshold >> 16) - 1;
  for (int x = tid; x < 256; x += kSelectThreads) sm.hist[x] = 0u;
  __syncthreads();
  const uint2* cand = reinterpret_cast<const uint2*>(p.cand) + int64_t(blockIdx.x) * p.cand_cap;
  for_candidates(cand, n_seg, cap_t, sm, [&](int x, uint32_t key, int) {
    keys[x] = key;
    if (spread) atomicAdd(&sm.hist[candidate_bin(key, base)], 1u);
  });
  __syncthreads();

  // The kk-th largest key: `threshold` its known bits (`known`), `need` the keys still to take
  // among those that share them; `whole`: every key sharing them is taken.
  int need = kk, shift = 24;
  uint32_t threshold = 0u, known = 0u;
  bool whole = false;
  if (spread) {
    if (warp == 0) find_bin(sm.hist, 256, need, sm);
    __syncthreads();
    const unsigned bin = sm.digit;
    if (bin >= 1u && bin <= 254u) {
      threshold = uint32_t(base + int(bin)) << 16;
      known = 0xffff0000u;
      whole = sm.hist[bin] == unsigned(sm.need);
      need = sm.need;
      shift = 8;
    }
    __syncthreads();  // sm.hist is cleared below
  }
  for (; shift >= 0 && !whole; shift -= 8) {
    for (int x = tid; x < 256; x += kSelectThreads) sm.hist[x] = 0u;
    __syncthreads();
    for (int c0 = warp * 32; c0 < count; c0 += kSelectThreads) {
      const int c = c0 + lane;
      const uint32_t u = c < count ? keys[c] : 0u;
      // (The candidates' top bits, which nearly all share: hist_add measured faster here than
      // hist_add_major.)
      radix_hist_add<false>(sm.hist, u, shift, c < count && (u & known) == threshold);
    }
    __syncthreads();
    if (warp == 0) find_bin(sm.hist, 256, need, sm);
    __syncthreads();
    threshold |= sm.digit << shift;
    known |= 255u << shift;
    whole = sm.hist[sm.digit] == unsigned(sm.need);
    need = sm.need;
    __syncthreads();  // sm.digit / sm.need are rewritten by the next round
  }
  // Ties to split (the bin of the kk-th key is a single key value taken in part): marked apart,
  // in the keys' place (the rounds ended with a barrier).
  const bool ties = !whole;
  if (ties) {
    for (int x = tid; x < words; x += kSelectThreads) at[x] = 0u;
    __syncthreads();
  }
  // Taken: keys at or above `cut` (the bin's lower bound, or past the tied key; 2^32: none).
  const uint64_t cut = uint64_t(threshold) + (whole ? 0u : 1u);
  for_candidates(cand, n_seg, cap_t, sm, [&](int, uint32_t key, int j) {
    if (key >= cut)
      atomicOr(&above[j / 32], 1u << (j % 32));
    else if (key == threshold && ties)
      atomicOr(&at[j / 32], 1u << (j % 32));
  });
  __syncthreads();

  // Each thread its own contiguous words: ties taken in key order up to `need`, then every marked
  // key staged in order in shared memory (over the keys, no longer read) and written out whole.
  const int per = (words + kSelectThreads - 1) / kSelectThreads;
  const int w0 = min(words, tid * per), w1 = min(words, w0 + per);
  int n_take = 0;
  if (ties) {
    int n_at = 0;
    for (int x = w0; x < w1; ++x) n_at += __popc(at[x]);
    int total;
    int tie_rank = cta_exclusive_sum(n_at, sm.warp_sums, total);
    for (int x = w0; x < w1; ++x) {
      uint32_t word = above[x], t_bits = at[x];
      while (t_bits != 0u && tie_rank < need) {
        word |= t_bits & (~t_bits + 1u);  // the lowest tie bit
        t_bits &= t_bits - 1u;
        ++tie_rank;
      }
      above[x] = word;
      n_take += __popc(word);
    }
  } else {
    for (int x = w0; x < w1; ++x) n_take += __popc(above[x]);
  }
  int total;
  int pos = cta_exclusive_sum(n_take, sm.warp_sums, total);
  // (In the keys' place: at least cand_cap entries, which the plan makes >= 2.5 k; the ties' bits
  // were read before the barrier in cta_exclusive_sum.)
  int* staged = reinterpret_cast<int*>(keys);
  for (int x = w0; x < w1; ++x) {
    for (uint32_t word = above[x]; word != 0u; word &= word - 1u) staged[pos++] = x * 32 + __ffs(word) - 1;
  }
  __syncthreads();
  for (int x = tid; x < p.topk; x += kSelectThreads) out[x] = x < kk ? staged[x] : -1;
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype>
cudaError_t run_topk_select_(const TopkSelectParams& params, int64_t rows, cudaStream_t stream) {
  using T = typename cuda::ElementOf<kDtype>::type;
  if (rows <= 0) return cudaSuccess;
  if (rows > INT_MAX) return cudaErrorInvalidConfiguration;
  auto launch = [&](auto kernel, size_t smem) -> cudaError_t {
    SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<unsigned(rows), cuda::kSelectThreads, smem, stream>>>(params);
    return cudaGetLastError();
  };
  if (params.select_mode == 1) {  // a warp per row
    cuda::topk_threshold_kernel<T><<<unsigned((rows + cuda::kThresholdWarps - 1) / cuda::kThresholdWarps),
                                     cuda::kThresholdWarps * 32, 0, stream>>>(params);
    return cudaGetLastError();
  }
  if (params.select_mode == 2)
    return launch(cuda::topk_candidates_kernel<T>, size_t(candidate_smem_bytes(params.cand_cap, params.lk)));
  return launch(cuda::topk_select_kernel<T>,
                sizeof(cuda::SelectSmem) +
                    sizeof(float) * (params.indexer ? size_t(params.hi) * params.di + params.hi : params.d));
}

}  // namespace sparse_attn
