// Scores for top-k selection on the tensor cores (mma.sync, sm_80+), written to the selection's
// fp32 workspace; topk_select_kernel then selects from it (params.prescored).
//
// Per CTA: one 64-row query tile (4 warps x 16 rows) and a contiguous share of its visible key
// tiles (params.n_splits CTAs per query tile, so that a chunk of few tiles still fills the GPU).
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
#include "sparse_attn/cuda/smem_tile.cuh"
#include "sparse_attn/cuda/topk.h"

namespace sparse_attn::cuda {

constexpr int kScoreWarps = 4;
constexpr int kScoreThreads = kScoreWarps * 32;
constexpr int kScoreHeadsPerPass = 4;

template <int kDim>
struct ScoreLayout {
  static constexpr int kChunks = kDim / 8;
  static constexpr int kTileBytes = kTopkScoreBlockM * kDim * 2;  // one 64-row tile
  static constexpr int kKBytes = kTopkScoreBlockN * kDim * 2;
  // K ring (2 stages), then the weights (64 x heads fp32), then Q (heads x 64 x kDim).
  static int smem_bytes(int heads) { return 2 * kKBytes + kTopkScoreBlockM * heads * 4 + heads * kTileBytes; }
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

template <ScalarKind kDtype, int kDim>
__global__ void __launch_bounds__(kScoreThreads)
    topk_score_kernel(__grid_constant__ const TopkSelectParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Element = typename ElementOf<kDtype>::type;
  using L = ScoreLayout<kDim>;
  constexpr int kChunks = L::kChunks, kKSteps = kDim / 16, kBM = kTopkScoreBlockM, kBN = kTopkScoreBlockN;
  constexpr uint32_t kRow16 = 16 * kChunks * 16;
  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  const int64_t tile = p.tile_begin + blockIdx.x / p.n_splits;
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
  const int kt_begin = int(int64_t(n_kt) * split / p.n_splits),
            kt_end = int(int64_t(n_kt) * (split + 1) / p.n_splits);
  if (kt_begin >= kt_end) return;

  const uint32_t sK = smem_u32(smem);
  float* sW = reinterpret_cast<float*>(smem + 2 * L::kKBytes);
  const uint32_t sQ = sK + 2 * L::kKBytes + kBM * heads * 4;

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
  auto load_k = [&](int stage, int kt) {
    const int n0 = kt * kBN;
    load_rows<kDim, kBN>(
        sK + stage * L::kKBytes,
        [&](int r) -> const Element* {
          return n0 + r < p.lk ? kbase + int64_t(n0 + r) * k_row_stride : nullptr;
        },
        kbase, d_valid, tid);
  };
  load_k(0, kt_begin);
  cp_async_commit();

  const int r8 = lane % 8;
  const uint32_t q_base = sQ + swz<kChunks>(warp * 16 + ((lane / 8) % 2) * 8 + r8, lane / 16);
  const int row_lo = warp * 16 + g;  // this thread's rows: row_lo and row_lo + 8 of the tile
  float* ws = p.scores + ((tile - p.tile_begin) * kBM + row_lo) * p.scores_stride;

  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const int stage = (kt - kt_begin) % 2;
    cp_async_wait<0>();
    __syncthreads();  // K[kt] (and Q, W) landed; every warp is done with the other stage
    if (kt + 1 < kt_end) load_k(stage ^ 1, kt + 1);
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
          for (int np = 0; np < 2; ++np) ldmatrix_x4(fb[np], swz_step<kk>(k_base + (half * 2 + np) * kRow16));
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
      // Columns n and n + 1 of rows row_lo and row_lo + 8 (the workspace stride is a multiple of 4).
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int n = kt * kBN + half * 32 + ni * 8 + 2 * t;
        if (n < p.lk) {
          *reinterpret_cast<float2*>(ws + n) = make_float2(acc[ni][0], acc[ni][1]);
          *reinterpret_cast<float2*>(ws + 8 * p.scores_stride + n) = make_float2(acc[ni][2], acc[ni][3]);
        }
      }
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
  if (topk_score_dim(params) <= 64)
    return launch(cuda::topk_score_kernel<kDtype, 64>, cuda::ScoreLayout<64>::smem_bytes(heads));
  return launch(cuda::topk_score_kernel<kDtype, 128>, cuda::ScoreLayout<128>::smem_bytes(heads));
}

}  // namespace sparse_attn
