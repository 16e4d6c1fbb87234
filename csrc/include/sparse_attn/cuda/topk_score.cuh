// Scores for top-k selection on the tensor cores (mma.sync, sm_80+). kMode 0: every visible key's
// score into the selection's fp32 workspace, from which topk_select_kernel then selects
// (params.prescored). kMode 1: only every filter_stride-th key tile (the sample of a filtered
// selection, params.h). kMode 2: no scores written; each row's keys whose score reaches its
// threshold are appended to the thread's own slice of the row's candidates (a row belongs to one
// quad of threads; each of them sees a quarter of the keys and keeps its count in a register: no
// atomics, no exchange), the rest dropped on chip.
//
// Per CTA: one 64-row query tile (4 warps x 16 rows) and one of every n_splits consecutive key
// tiles it sees (params.n_splits CTAs per query tile, so that a chunk of few tiles still fills the
// GPU; interleaved, with the choice rotated from group to group, so that the splits' shares of a
// causal tile, of any cluster of high scores and of any periodic pattern of them are alike).
// Exact mode: score = q_h . k_hk. Lightning indexer: score = sum_j w[t, j] * relu(qi[t, j] . ki),
// the HI query heads of the tile kept in shared memory, four of them per pass over a key slice so
// that each K fragment serves four heads. Products accumulate in fp32, as in the CUDA-core path;
// on integer-valued inputs both are exact, so selection (and its tie rule) does not depend on
// which path scored.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/cuda/ptx_sm90.cuh"
#include "sparse_attn/cuda/radix_select.cuh"
#include "sparse_attn/cuda/smem_tile.cuh"
#include "sparse_attn/cuda/topk.h"
#include "sparse_attn/cuda/wgmma.cuh"

namespace sparse_attn::cuda {

constexpr int kScoreWarps = 4;
constexpr int kScoreThreads = kScoreWarps * 32;
constexpr int kScoreHeadsPerPass = 4;

template <int kDim>
struct ScoreLayout {
  static constexpr int kChunks = kDim / 8;
  static constexpr int kTileBytes = kTopkScoreBlockM * kDim * 2;  // one 64-row tile
  static constexpr int kKBytes = kTopkScoreBlockN * kDim * 2;
  // K ring (2 stages), then Q (heads x 64 x kDim; 1024-byte aligned, as wgmma's swizzle wants),
  // then the weights (64 x heads fp32), then (filtered scoring) each row's staged candidates.
  // Candidates a row stages in shared memory (8 bytes each): 48 keeps 3 CTAs per SM at 4 indexer
  // heads (73 KiB each); 32 flushed more often, 1.02x the time at 64k (docs/PERF_LOG.md).
  static constexpr int kStage = 48;
  static int smem_bytes(int heads, bool filtered) {
    return 2 * kKBytes + heads * kTileBytes + kTopkScoreBlockM * heads * 4 +
           (filtered ? kTopkScoreBlockM * kStage * 8 : 0);
  }
};

// rows x kDim tile (row pointers from row_ptr(r), nullptr = zero row) into swizzled shared memory;
// `safe` is any valid address, passed for the zero-filled copies (which read nothing).
template <int kDim, int kRows, typename Element, typename RowPtr>
__device__ __forceinline__ void load_rows(uint32_t smem, RowPtr row_ptr, const Element* safe, int d_valid,
                                          int tid) {
  constexpr int kChunks = kDim / 8, kRowStep = kScoreThreads / kChunks;
  const int c = tid % kChunks;
#pragma unroll
  for (int r = tid / kChunks; r < kRows; r += kRowStep) {
    const Element* src = row_ptr(r);
    const bool ok = src != nullptr && c * 8 < d_valid;
    cp_async_16(smem + swz<kChunks>(r, c), ok ? src + c * 8 : safe, ok ? 16 : 0);
  }
}

// kHeadPairs (lightning indexer, two or more heads): the wgmma path keeps two heads' products in
// registers, so it takes 3 CTAs per SM, not 4 (an indexer's shared memory holds it to 3 anyway at
// 4 heads).
template <ScalarKind kDtype, int kDim, int kMode, bool kHeadPairs>
__global__ void __launch_bounds__(kScoreThreads, kDim == 64 ? (kHeadPairs ? 3 : 4) : 1)
    topk_score_kernel(__grid_constant__ const TopkSelectParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Element = typename ElementOf<kDtype>::type;
  using L = ScoreLayout<kDim>;
  constexpr int kChunks = L::kChunks, kKSteps = kDim / 16, kBM = kTopkScoreBlockM, kBN = kTopkScoreBlockN;
  constexpr uint32_t kRow16 = 16 * kChunks * 16;
  extern __shared__ __align__(1024) char smem[];
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kWgmma =
      kDim == 64;  // sm_90a: the warpgroup MMA (its 128-byte swizzle is swz's for 64 dims)
#else
  constexpr bool kWgmma = false;
#endif
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  // The launch's tiles last first: in a causal plane the later tiles see more keys, so the long
  // CTAs start first and the short ones fill the last wave.
  const int64_t tile = p.tile_begin + (gridDim.x / p.n_splits - 1 - blockIdx.x / p.n_splits);
  const int split = int(blockIdx.x % p.n_splits);
  const int64_t plane = tile / p.n_qtiles;  // (b, hs)
  const int hs = int(plane % p.h_sel), b = int(plane / p.h_sel);
  const int m0 = int(tile % p.n_qtiles) * kBM;
  const int rows = min(kBM, p.lq - m0);
  const int heads = p.indexer ? p.hi : 1;
  const int d_valid = p.indexer ? p.di : p.d;

  // Key tiles this CTA scores: its share of those any row of the tile can see.
  int64_t nv = p.lk;
  if (p.causal) {
    const int64_t last = int64_t(m0) + rows + p.kv_offset;
    nv = last < 0 ? 0 : (last < p.lk ? last : p.lk);
  }
  const int n_kt = int((nv + kBN - 1) / kBN);
  // Iterations: key tiles, or in the sample's mode tiles stride - 1 + stride * it.
  const int stride = kMode == 1 ? sample_tile_stride(p.filter_stride, n_kt) : 1;
  const int n_it = n_kt / stride;
  // This CTA's i-th tile: one of every n_splits consecutive ones, which one rotated from group to
  // group by a hash of the group. (A fixed split + i * n_splits sent every high score of a row to
  // one split's slice of its candidates, and the row to the fallback, whenever the scores had a
  // period of n_splits tiles: a position component of that wavelength.)
  // (The rotation: 16 bits of a multiplicative hash of the group scaled to [0, n_splits), no
  // integer division in the loop.)
  auto tile_of = [&](int i) {
    const int rot = int((((unsigned(i) * 2654435761u) >> 16) * unsigned(p.n_splits)) >> 16);
    const int x = split + rot;
    return i * p.n_splits + (x >= p.n_splits ? x - p.n_splits : x);
  };
  const int groups = n_it / p.n_splits;
  const int my_n = groups + (tile_of(groups) < n_it ? 1 : 0);  // tiles of this CTA
  if (my_n == 0) {
    if (kMode == 2 && tid < kBM)  // its slices are empty
      p.cand_count[((tile - p.tile_begin) * kBM + tid) * p.n_splits + split] = 0;
    return;
  }

  const uint32_t sK = smem_u32(smem);
  const uint32_t sQ = sK + 2 * L::kKBytes;
  float* sW = reinterpret_cast<float*>(smem + 2 * L::kKBytes + heads * L::kTileBytes);

  const Element* kbase;
  int64_t k_row_stride;
  if (p.indexer) {
    kbase = static_cast<const Element*>(p.ik) + b * p.ik_batch_stride;
    k_row_stride = p.ik_row_stride;
    const Element* iq =
        static_cast<const Element*>(p.iq) + b * p.iq_batch_stride + int64_t(m0) * p.iq_row_stride;
    for (int j = 0; j < heads; ++j)
      load_rows<kDim, kBM>(
          sQ + j * L::kTileBytes,
          [&](int r) -> const Element* {
            return r < rows ? iq + r * p.iq_row_stride + j * p.iq_head_stride : nullptr;
          },
          iq, d_valid, tid);
    const Element* iw =
        static_cast<const Element*>(p.iw) + b * p.iw_batch_stride + int64_t(m0) * p.iw_row_stride;
    for (int x = tid; x < kBM * heads; x += kScoreThreads) {
      const int r = x / heads, j = x % heads;
      float w = 0.f;
      if (r < rows) {
        if constexpr (kDtype == ScalarKind::kBFloat16)
          w = __bfloat162float(iw[r * p.iw_row_stride + j]);
        else
          w = __half2float(iw[r * p.iw_row_stride + j]);
      }
      sW[x] = w;
    }
  } else {
    const int hk = hs / p.h_per_kv;
    kbase = static_cast<const Element*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
    k_row_stride = p.k_row_stride;
    const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + hs * p.q_head_stride +
                       int64_t(m0) * p.q_row_stride;
    load_rows<kDim, kBM>(
        sQ, [&](int r) -> const Element* { return r < rows ? q + r * p.q_row_stride : nullptr; }, q, d_valid,
        tid);
  }
  // K tile rows: this thread's 16-byte chunk kc of rows kr0, kr0 + kKRowStep, ... of the tile,
  // its pointers stepped from one per-thread base (one 64-bit multiply per tile, not per row).
  constexpr int kKRowStep = kScoreThreads / kChunks;
  const int kc = tid % kChunks, kr0 = tid / kChunks;
  const bool k_col_ok = kc * 8 < d_valid;
  const Element* const k_thread = kbase + int64_t(kr0) * k_row_stride + kc * 8;
  const int64_t k_step = int64_t(kKRowStep) * k_row_stride;
  auto load_k = [&](int stage, int it) {
    const int n0 = (it * stride + stride - 1) * kBN;
    const Element* src = k_thread + int64_t(n0) * k_row_stride;
    const uint32_t dst = sK + stage * L::kKBytes;
#pragma unroll
    for (int x = 0; x < kBN / kKRowStep; ++x) {
      const int r = kr0 + x * kKRowStep;
      const bool ok = k_col_ok && n0 + r < p.lk;
      cp_async_16(dst + swz<kChunks>(r, kc), ok ? src + x * k_step : kbase, ok ? 16 : 0);
    }
  };
  load_k(0, tile_of(0));
  cp_async_commit();
  const uint64_t desc_q0 = sw128_desc(sQ, 16, 1024), desc_k0 = sw128_desc(sK, 16, 1024);

  const int r8 = lane % 8;
  const uint32_t q_base = sQ + swz<kChunks>(warp * 16 + ((lane / 8) % 2) * 8 + r8, lane / 16);
  const int row_lo = warp * 16 + g;  // this thread's rows: row_lo and row_lo + 8 of the tile
  const int64_t wrow = (tile - p.tile_begin) * kBM + row_lo;
  float* ws = p.scores + wrow * p.scores_stride;
  // The filter's per-row state: the keys a row sees, its threshold as a float (a score is taken
  // unless it is below: NaN always; the threshold "every key" is a NaN), this thread's slice of
  // its candidates and how many it took.
  // (Few registers: the 64-dim kernels are at their launch bounds.) Row row_lo + 8 sees
  // min(nv0 + 8, Lk) keys when causal; the padding rows of a ragged tile are never read. A row's
  // candidates are staged in shared memory (kStage of them) and written to this CTA's slice of
  // the row's candidates by the row's quad, 32 contiguous bytes per row and store instruction;
  // `staged` and `flushed` (the same in the quad's 4 lanes) count them.
  int nv0 = p.lk, staged[2] = {0, 0}, flushed[2] = {0, 0};
  float row_min[2] = {0.f, 0.f};
  uint2* const stage_buf =
      reinterpret_cast<uint2*>(smem + 2 * L::kKBytes + heads * L::kTileBytes + kBM * heads * 4) +
      row_lo * L::kStage;
  if constexpr (kMode == 2) {
    if (p.causal) {
      const int64_t last = int64_t(m0) + row_lo + p.kv_offset + 1;
      nv0 = int(last < 0 ? 0 : (last < p.lk ? last : p.lk));
    }
    row_min[0] = order_key_to_float(p.thresholds[wrow]);
    row_min[1] = order_key_to_float(p.thresholds[wrow + 8]);
  }
  // Every quad's staged candidates of row rr to its slice, the whole warp at once (called
  // warp-uniformly): once one quad's stage is full the warp runs this anyway (a branch of any of
  // its lanes), and emptying every quad's stage there spaces the flushes out. (Flushing only the
  // full quad's, the warp flushed in about half of its emit steps, and its four warps, which meet
  // at the next wgmma, waited there for the one that flushed most: 13 % of the stall samples;
  // the scorer took 1.16x the time, docs/PERF_LOG.md.)
  auto flush = [&](int rr) {
    __syncwarp();
    uint2* dst = reinterpret_cast<uint2*>(p.cand) + (wrow + 8 * rr) * p.cand_cap + split * p.cand_slice;
    for (int e = t; e < staged[rr]; e += 4)
      if (flushed[rr] + e < p.cand_slice) dst[flushed[rr] + e] = stage_buf[rr * 8 * L::kStage + e];
    __syncwarp();
    flushed[rr] += staged[rr];
    staged[rr] = 0;
  };

  // The scores of keys kt * 64 + half * 32 + [0, 32) of this thread's rows (mma.sync's m16n8
  // accumulator layout per 8 keys) to the workspace, the sample or the candidates.
  auto emit = [&](int kt, int half, const float (&acc)[4][4]) {
    if constexpr (kMode == 2) {
      // Keys n and n + 1 of rows row_lo and row_lo + 8 that the row sees and that are not below
      // its threshold: staged after the row's earlier ones (the quad's prefix sum places them);
      // the stage flushed first where they would not fit.
      const int n0 = kt * kBN + half * 32 + 2 * t;
      const bool inside = n0 - 2 * t + 32 <= nv0;  // every key of the 32 visible to both rows
      const int nv1 = p.causal ? min(nv0 + 8, p.lk) : p.lk;
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        uint32_t take = 0u;
#pragma unroll
        for (int x = 0; x < 8; ++x) {
          const int n = n0 + (x / 2) * 8 + x % 2;
          if (!(acc[x / 2][rr * 2 + x % 2] < row_min[rr]) && (inside || n < (rr == 0 ? nv0 : nv1)))
            take |= 1u << x;
        }
        const int mine = __popc(take);
        int incl = mine;
#pragma unroll
        for (int o = 1; o < 4; o *= 2) {
          const int y = __shfl_up_sync(0xffffffffu, incl, o, 4);
          if (t >= o) incl += y;
        }
        const int total = __shfl_sync(0xffffffffu, incl, 3, 4);
        if (__any_sync(0xffffffffu, staged[rr] + total > L::kStage)) flush(rr);  // warp-uniform
        // (A pointer stepped per store: an index recomputed per value cost 3 more instructions.)
        uint2* dst = stage_buf + rr * 8 * L::kStage + (staged[rr] + incl - mine);
#pragma unroll
        for (int x = 0; x < 8; ++x)
          if (take & (1u << x))
            *dst++ =
                make_uint2(__float_as_uint(acc[x / 2][rr * 2 + x % 2]), uint32_t(n0 + (x / 2) * 8 + x % 2));
        staged[rr] += total;
      }
    } else if constexpr (kMode == 1) {
      // The sample: columns n and n + 1 of rows row_lo and row_lo + 8 as 16-bit keys (the top bits
      // of order_key, all the threshold needs), one 32-bit store each; its columns are its tiles'
      // keys in order.
      uint16_t* ks = reinterpret_cast<uint16_t*>(p.scores) + wrow * p.scores_stride;
      auto pair = [](float a, float b) { return (order_key(a) >> 16) | (order_key(b) & 0xffff0000u); };
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int n = kt * kBN + half * 32 + ni * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(ks + n) = pair(acc[ni][0], acc[ni][1]);
        *reinterpret_cast<uint32_t*>(ks + 8 * p.scores_stride + n) = pair(acc[ni][2], acc[ni][3]);
      }
    } else {
      // Columns n and n + 1 of rows row_lo and row_lo + 8 (the workspace stride is a multiple
      // of 4).
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int n = kt * kBN + half * 32 + ni * 8 + 2 * t;
        if (n < p.lk) {
          *reinterpret_cast<float2*>(ws + n) = make_float2(acc[ni][0], acc[ni][1]);
          *reinterpret_cast<float2*>(ws + 8 * p.scores_stride + n) = make_float2(acc[ni][2], acc[ni][3]);
        }
      }
    }
  };

  if constexpr (kWgmma) {
    // One warpgroup: S_j = Q_j K^T (64 x 64: 4 wgmmas of K = 16 from the swizzled tiles) per head
    // j, folded into acc (relu, weight) once it lands; with kHeadPairs two heads at a time, head
    // j + 1's products running under head j's fold. Software-pipelined over the key tiles: the
    // next tile's first heads are issued before this tile's emit (which reads acc only), so their
    // products run under the threshold tests and stores; every wgmma is waited for inside the
    // iteration that issued it (one in flight across the loop's back edge makes ptxas serialise
    // them). The SM's other CTAs fill the remaining waits.
    // (Descriptors stepped by adding offsets >> 4: shared addresses stay below 2^18, so the
    // 14-bit address field never carries.)
    float acc[32], sj[32], sb[32];
    auto issue = [&](float (&r)[32], int j, int stage) {
      const uint64_t desc_q = desc_q0 + ((j * L::kTileBytes) >> 4);
      const uint64_t desc_k = desc_k0 + ((stage * L::kKBytes) >> 4);
      wgmma_fence();
      static_for<kKSteps>([&](auto kk_) {
        constexpr int kk = decltype(kk_)::value;
        Wgmma<kDtype, 64>::ss(r, desc_q + (kk * 32 >> 4), desc_k + (kk * 32 >> 4), kk > 0 ? 1 : 0);
      });
      wgmma_commit();
    };
    // acc = w_j relu(S_j) (the first head: fmaf onto +0, as the CUDA-core path's first step, so
    // that the scores' bits do not depend on the path) or acc += w_j relu(S_j).
    auto fold = [&](float (&r)[32], int j, bool first) {
      fence_regs(r);
      if (!p.indexer) {
#pragma unroll
        for (int x = 0; x < 32; ++x) acc[x] = r[x];
      } else {
        const float w0 = sW[row_lo * heads + j], w1 = sW[(row_lo + 8) * heads + j];
#pragma unroll
        for (int x = 0; x < 32; ++x)
          acc[x] = fmaf(x % 4 < 2 ? w0 : w1, fmaxf(r[x], 0.f), first ? 0.f : acc[x]);
      }
    };
    auto wait_tile = [&]() {  // K of the next tile landed; every warp done with the other stage
      cp_async_wait<0>();
      fence_proxy_async();  // cp.async's writes, next read by wgmma
      __syncthreads();
    };
    // A tile's first heads (two with kHeadPairs: every launch of it has >= 2), issued where the
    // previous tile ends, and folded.
    constexpr int kFirst = kHeadPairs ? 2 : 1;
    auto issue_first = [&](int stage) {
      issue(sj, 0, stage);
      if constexpr (kHeadPairs) issue(sb, 1, stage);
    };
    auto fold_first = [&]() {
      if constexpr (kHeadPairs)
        wgmma_wait<1>();
      else
        wgmma_wait<0>();
      fold(sj, 0, true);
      if constexpr (kHeadPairs) {
        wgmma_wait<0>();
        fold(sb, 1, false);
      }
    };
    wait_tile();
    if (1 < my_n) load_k(1, tile_of(1));
    cp_async_commit();
    issue_first(0);
    fold_first();
    for (int i = 0; i < my_n; ++i) {
      const int stage = i % 2;
      for (int j = kFirst; j < heads; j += kHeadPairs ? 2 : 1) {  // the tile's other heads
        issue(sj, j, stage);
        if (kHeadPairs && j + 1 < heads) {
          issue(sb, j + 1, stage);
          wgmma_wait<1>();
          fold(sj, j, false);
          wgmma_wait<0>();
          fold(sb, j + 1, false);
        } else {
          wgmma_wait<0>();
          fold(sj, j, false);
        }
      }
      // The next tile's first heads (after the last tile: products of the stale stage, discarded,
      // so that no wgmma's issue or wait depends on a branch), under this tile's emit where that
      // pays: the filtered emit (threshold tests and staging; 0.97x the time of `indexer_select` at 64k),
      // with the registers of 3 CTAs per SM (kHeadPairs; at 4 the emit beside them spills). The unfiltered
      // emit (stores of every score) ran 1-2 % slower with them in flight.
      constexpr bool kUnderEmit = kHeadPairs && kMode == 2;
      wait_tile();
      if (i + 2 < my_n) load_k(stage, tile_of(i + 2));
      cp_async_commit();
      if constexpr (kUnderEmit) issue_first(stage ^ 1);
      const int kt = tile_of(i);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float a4[4][4];
#pragma unroll
        for (int x = 0; x < 16; ++x) a4[x / 4][x % 4] = acc[half * 16 + x];
        emit(kt, half, a4);
      }
      if constexpr (!kUnderEmit) issue_first(stage ^ 1);
      fold_first();
    }
  } else {
    for (int i = 0; i < my_n; ++i) {
      const int kt = tile_of(i), stage = i % 2;
      cp_async_wait<0>();
      __syncthreads();  // K[kt] (and Q, W) landed; every warp is done with the other stage
      if (i + 1 < my_n) load_k(stage ^ 1, tile_of(i + 1));
      cp_async_commit();
      const uint32_t k_base = sK + stage * L::kKBytes + swz<kChunks>((lane / 16) * 8 + r8, (lane / 8) % 2);

#pragma unroll
      for (int half = 0; half < kBN / 32; ++half) {  // 32 keys at a time
        float acc[4][4];
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[ni][e] = 0.f;
        for (int j0 = 0; j0 < heads; j0 += kScoreHeadsPerPass) {
          float s[kScoreHeadsPerPass][4][4];
#pragma unroll
          for (int jj = 0; jj < kScoreHeadsPerPass; ++jj)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
#pragma unroll
              for (int e = 0; e < 4; ++e) s[jj][ni][e] = 0.f;
          static_for<kKSteps>([&](auto kk_) {
            constexpr int kk = decltype(kk_)::value;
            uint32_t fb[2][4];
#pragma unroll
            for (int np = 0; np < 2; ++np)
              ldmatrix_x4(fb[np], swz_step<kk>(k_base + (half * 2 + np) * kRow16));
#pragma unroll
            for (int jj = 0; jj < kScoreHeadsPerPass; ++jj) {
              if (j0 + jj < heads) {
                uint32_t fa[4];
                ldmatrix_x4(fa, swz_step<kk>(q_base + (j0 + jj) * L::kTileBytes));
#pragma unroll
                for (int np = 0; np < 2; ++np) {
                  mma_16x8x16<kDtype>(s[jj][2 * np], fa, fb[np][0], fb[np][1]);
                  mma_16x8x16<kDtype>(s[jj][2 * np + 1], fa, fb[np][2], fb[np][3]);
                }
              }
            }
          });
#pragma unroll
          for (int jj = 0; jj < kScoreHeadsPerPass; ++jj) {
            if (j0 + jj >= heads) continue;
            if (!p.indexer) {
#pragma unroll
              for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[ni][e] = s[jj][ni][e];
              continue;
            }
            const float w0 = sW[row_lo * heads + j0 + jj], w1 = sW[(row_lo + 8) * heads + j0 + jj];
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[ni][e] = fmaf(e < 2 ? w0 : w1, fmaxf(s[jj][ni][e], 0.f), acc[ni][e]);
          }
        }
        emit(kt, half, acc);
      }
    }
  }
  if constexpr (kMode == 2) {
    flush(0);
    flush(1);
    if (t == 0) {
      p.cand_count[wrow * p.n_splits + split] = flushed[0];
      p.cand_count[(wrow + 8) * p.n_splits + split] = flushed[1];
    }
  }
#else
  __trap();  // built for an architecture without bf16 mma.sync: the launcher never gets here
#endif
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype>
cudaError_t run_topk_score_(const TopkSelectParams& params, int64_t tiles, cudaStream_t stream) {
  const int64_t grid = tiles * params.n_splits;
  if (grid <= 0) return cudaSuccess;
  if (grid > INT_MAX) return cudaErrorInvalidConfiguration;
  const int heads = params.indexer ? params.hi : 1;
  auto launch = [&](auto kernel, int smem) -> cudaError_t {
    SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<unsigned(grid), cuda::kScoreThreads, smem, stream>>>(params);
    return cudaGetLastError();
  };
  auto by_dim = [&](auto mode) {
    constexpr int kMode = decltype(mode)::value;
    if (topk_score_dim(params) <= 64 && heads >= 2)
      return launch(cuda::topk_score_kernel<kDtype, 64, kMode, true>,
                    cuda::ScoreLayout<64>::smem_bytes(heads, kMode == 2));
    if (topk_score_dim(params) <= 64)
      return launch(cuda::topk_score_kernel<kDtype, 64, kMode, false>,
                    cuda::ScoreLayout<64>::smem_bytes(heads, kMode == 2));
    return launch(cuda::topk_score_kernel<kDtype, 128, kMode, false>,
                  cuda::ScoreLayout<128>::smem_bytes(heads, kMode == 2));
  };
  if (params.score_mode == 1) return by_dim(std::integral_constant<int, 1>{});
  if (params.score_mode == 2) return by_dim(std::integral_constant<int, 2>{});
  return by_dim(std::integral_constant<int, 0>{});
}

}  // namespace sparse_attn
