// The tensor-core backward of attention over gathered keys (top-k given its selection), the
// forward's layout (gather_mma.cuh): one warp per (batch, query token, group of query heads), the
// group's heads the 16 rows of the mma tile, the listed keys visited 16 at a time through a
// two-stage cp.async ring. Per stage: S = Q K^T, dP = dO V^T, P and dS as in attn_bwd.cuh, then
// dQ += dS K in registers (the token's dQ is complete in its warp), and dK = dS^T Q, dV = P^T dO
// for the stage's listed keys, reduced over the group's heads by the mma, then added to the fp32
// accumulators in 16-key x 32-column blocks staged in shared memory, so that every vector reduction
// adds whole 128-byte lines (P and dS go through shared memory transposed).
//
// kShared (the forward's kShared): where four consecutive groups of 16 heads share the kv head and
// the index set (64 heads of one DeepSeek-like token), a CTA's four warps are those groups of one
// token: they load each stage's K/V rows once (a quarter each), write P^T and dS^T side by side
// (64 heads per key row), and then split dK and dV by columns, each warp's products running over
// all 64 heads (K = 64), so that every (key, column) is reduced into the fp32 accumulators once per
// token instead of once per group: a quarter of the reductions, which bound this kernel.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/attn_bwd.cuh"
#include "sparse_attn/cuda/attn_bwd.h"
#include "sparse_attn/cuda/gather_mma.cuh"

namespace sparse_attn::cuda {

// Keys per stage: 16, half the forward's, so that a warp's shared memory (25 KB at head dim 128)
// lets two CTAs share an SM: 8 warps where 32-key stages fit 4 (docs/PERF_LOG.md).
constexpr int kGatherBwdKeys = 16;

template <int kHeadDim>
struct GatherBwdLayout {
  static constexpr int kChunks = kHeadDim / 8;
  // kShared: the CTA's Q and dO tiles (64 rows each), one ring of (K, V) stages, P^T and dS^T as
  // rows of 64 heads padded to kSharedPRow (ldmatrix reads 8 rows 144 bytes apart: no conflicts),
  // then each warp's reduction rows.
  static constexpr int kSharedPRow = 4 * kGatherMmaRows + 8;
  static constexpr int kSharedPBytes = kGatherBwdKeys * kSharedPRow * 2;
  static constexpr int kQBytes = kGatherMmaRows * kHeadDim * 2;
  static constexpr int kKVBytes = kGatherBwdKeys * kHeadDim * 2;
  static constexpr int kPBytes = kGatherBwdKeys * kGatherMmaRows * 2;  // (keys, heads), 32-byte rows
  // dK or dV of the stage's keys, 32 columns: fp32 rows of 36 (bank spread, 16-byte aligned)
  static constexpr int kRStride = 36;
  static constexpr int kRBytes = kGatherBwdKeys * kRStride * 4;
  // Q, dO, (K, V) per stage, P^T, dS^T, the reduction's rows.
  static constexpr int kWarpBytes = 2 * kQBytes + kGatherMmaStages * 2 * kKVBytes + 2 * kPBytes + kRBytes;
  static constexpr int kSmemBytes = kGatherMmaWarps * kWarpBytes;
  static constexpr int kSharedSmemBytes = kGatherMmaWarps * (2 * kQBytes + kRBytes) +
                                          kGatherMmaStages * 2 * kKVBytes + 2 * kSharedPBytes;
};

template <ScalarKind kDtype, int kHeadDim, bool kShared>
__global__ void __launch_bounds__(kGatherMmaWarps * 32, 2)
    gather_bwd_mma_kernel(__grid_constant__ const AttnBwdParams bp, const int group) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Element = typename ElementOf<kDtype>::type;
  using L = GatherBwdLayout<kHeadDim>;
  constexpr int kChunks = L::kChunks, kDTiles = kHeadDim / 8, kKSteps = kHeadDim / 16;
  constexpr int kKeys = kGatherBwdKeys;
  constexpr int kRowsPerStep = 32 / kChunks;
  const AttnFwdParams& p = bp.fwd;
  extern __shared__ __align__(128) char smem[];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4, r8 = lane % 8;
  int i, h0, b;
  if (!gather_task<kShared>(p, group, warp, i, h0, b)) return;
  const int hk = h0 / p.h_per_kv;

  // kShared: the warps' Q tiles are the 16-row slices of one 64-row tile (likewise dO), so that
  // dK = dS^T Q runs over all 64 heads; P^T and dS^T rows hold the 64 heads, this warp's at
  // columns 16 warp ...
  constexpr int kPRow = kShared ? L::kSharedPRow : kGatherMmaRows;  // elements per P^T row
  const uint32_t base = smem_u32(smem);
  const uint32_t sQ = kShared ? base + warp * L::kQBytes : base + warp * L::kWarpBytes;
  const uint32_t sdO = kShared ? sQ + kGatherMmaWarps * L::kQBytes : sQ + L::kQBytes;
  const uint32_t sKV = kShared ? base + 2 * kGatherMmaWarps * L::kQBytes : sdO + L::kQBytes;
  auto sK = [&](int stage) { return sKV + stage * 2 * L::kKVBytes; };
  auto sV = [&](int stage) { return sK(stage) + L::kKVBytes; };
  const uint32_t sP = sKV + kGatherMmaStages * 2 * L::kKVBytes,
                 sDs = sP + (kShared ? L::kSharedPBytes : L::kPBytes);
  char* pP = smem + (sP - base);
  char* pDs = smem + (sDs - base);
  float* rows32 = kShared ? reinterpret_cast<float*>(smem + (sDs - base) + L::kSharedPBytes) + warp * (L::kRBytes / 4)
                          : reinterpret_cast<float*>(pDs + L::kPBytes);
  const int p_col = kShared ? warp * kGatherMmaRows : 0;  // this warp's heads in a P^T row

  const auto [idx, q, k, v] = gather_rows<Element>(p, b, h0, hk, i);
  const Element* dout = static_cast<const Element*>(bp.dout) + b * bp.do_batch_stride +
                        h0 * bp.do_head_stride + int64_t(i) * bp.do_row_stride;
  float* dk_acc = bp.dk_accum + (int64_t(b) * p.h_kv + hk) * p.lk * p.d;
  float* dv_acc = bp.dv_accum + (int64_t(b) * p.h_kv + hk) * p.lk * p.dv;

  const int c = lane % kChunks, r0 = lane / kChunks;
  const bool col_ok = c * 8 < p.d;
#pragma unroll
  for (int s = 0; s < kGatherMmaRows / kRowsPerStep; ++s) {
    const int r = r0 + s * kRowsPerStep;
    const bool ok = col_ok && r < group;
    cp_async_16(sQ + swz<kChunks>(r, c), ok ? q + r * p.q_head_stride + c * 8 : q, ok ? 16 : 0);
    cp_async_16(sdO + swz<kChunks>(r, c), ok ? dout + r * bp.do_head_stride + c * 8 : dout, ok ? 16 : 0);
  }
  cp_async_commit();
  // This thread's rows g and g + 8: LSE (log2) and delta; rows past the group have P = 0.
  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    const int64_t at = (int64_t(b) * p.h + h0 + r) * bp.lq_pad + i;
    lse2[half] = r < group ? bp.lse_log2[at] : INFINITY;
    delta[half] = r < group ? bp.delta[at] : 0.f;
  }

  const int n_stages = (p.topk + kKeys - 1) / kKeys;
  auto load_index = [&](int chunk) {
    const int pos = chunk * kKeys + lane;
    const int j = lane < kKeys && chunk < n_stages && pos < p.topk ? __ldg(idx + pos) : -1;
    return j >= 0 && j < p.lk ? j : -1;
  };
  // kShared: warp w copies slots [kKeys / 4 * w, kKeys / 4 * (w + 1)) of each stage.
  constexpr int kLoadKeys = kShared ? kKeys / kGatherMmaWarps : kKeys;
  static_assert(kLoadKeys % kRowsPerStep == 0);
  const int u0 = kShared ? warp * kLoadKeys : 0;
  auto issue = [&](int stage, int jl) {
#pragma unroll
    for (int s = 0; s < kLoadKeys / kRowsPerStep; ++s) {
      const int u = u0 + r0 + s * kRowsPerStep;
      const int j = __shfl_sync(0xffffffffu, jl, u);
      const bool ok = col_ok && j >= 0;
      cp_async_16(sK(stage) + swz<kChunks>(u, c), ok ? k + int64_t(j) * p.k_row_stride + c * 8 : k,
                  ok ? 16 : 0);
      cp_async_16(sV(stage) + swz<kChunks>(u, c), ok ? v + int64_t(j) * p.v_row_stride + c * 8 : v,
                  ok ? 16 : 0);
    }
    cp_async_commit();
  };

  int j_cur = load_index(0), j_next = -1;  // lane u: the key of slot u of the current / next stage
  if (n_stages > 0) issue(0, j_cur);
  int j_ahead = load_index(1);

  float acc_dq[kDTiles][4];
#pragma unroll
  for (int nd = 0; nd < kDTiles; ++nd)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dq[nd][e] = 0.f;
  constexpr uint32_t kRow16 = 16 * kChunks * 16;
  const uint32_t a_base = swz<kChunks>(((lane / 8) % 2) * 8 + r8, lane / 16);   // A rows (Q, dO)
  const uint32_t b_base = swz<kChunks>((lane / 16) * 8 + r8, (lane / 8) % 2);   // B rows (K, V)
  const uint32_t bt_base = swz<kChunks>(((lane / 8) % 2) * 8 + r8, lane / 16);  // B transposed

  // A 16-key x 32-column block of dK or dV (mma fragments) added to the fp32 accumulator rows
  // through shared memory, so that each reduction adds whole 128-byte lines: four rows of 32 columns
  // per warp instruction (red.v4; the fragments' own layout, 32 bytes of 16 rows per instruction,
  // added 1.3 TB/s in a microbenchmark where whole lines added 1.8, and 2.0 against 3.3 TB/s with
  // the accumulators in L2: docs/PERF_LOG.md).
  // Columns 32 dc .. of the stage's keys 16 mt ..; cols (D == Dv) a multiple of 8, so that four
  // columns lie wholly inside or past it.
  auto reduce_rows = [&](const float (&acc)[4][4], float* accum, int cols, int mt, int dc) {
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<float2*>(rows32 + (g + 8 * half) * L::kRStride + x * 8 + 2 * t) =
            make_float2(acc[x][2 * half], acc[x][2 * half + 1]);
    __syncwarp();
    const int c4 = (lane % 8) * 4, col = dc * 32 + c4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * i + lane / 8;
      const int key = __shfl_sync(0xffffffffu, j_cur, mt * 16 + r);
      const float4 val = *reinterpret_cast<const float4*>(rows32 + r * L::kRStride + c4);
      if (key >= 0 && col < cols) red_add_f4(accum + int64_t(key) * cols + col, val);
    }
    __syncwarp();  // read before the next block is written
  };

  for (int it = 0; it < n_stages; ++it) {
    const int stage = it % kGatherMmaStages;
    if (it + 1 < n_stages) {
      j_next = j_ahead;
      issue((it + 1) % kGatherMmaStages, j_next);
      j_ahead = load_index(it + 2);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if constexpr (kShared)
      __syncthreads();  // every warp's quarter of the stage landed
    else
      __syncwarp();

    float s[1][kKeys / 8][4], dp[1][kKeys / 8][4];
#pragma unroll
    for (int ni = 0; ni < kKeys / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][ni][e] = dp[0][ni][e] = 0.f;
    static_for<kKSteps>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
      uint32_t qf[4], df[4];  // reloaded per stage: holding them would spill
      ldmatrix_x4(qf, swz_step<kk>(sQ + a_base));
      ldmatrix_x4(df, swz_step<kk>(sdO + a_base));
#pragma unroll
      for (int np = 0; np < kKeys / 16; ++np) {
        uint32_t fk[4], fv[4];
        ldmatrix_x4(fk, swz_step<kk>(sK(stage) + b_base + np * kRow16));
        ldmatrix_x4(fv, swz_step<kk>(sV(stage) + b_base + np * kRow16));
        mma_16x8x16<kDtype>(s[0][2 * np], qf, fk[0], fk[1]);
        mma_16x8x16<kDtype>(s[0][2 * np + 1], qf, fk[2], fk[3]);
        mma_16x8x16<kDtype>(dp[0][2 * np], df, fv[0], fv[1]);
        mma_16x8x16<kDtype>(dp[0][2 * np + 1], df, fv[2], fv[3]);
      }
    });
    const unsigned valid = __ballot_sync(0xffffffffu, j_cur >= 0);
#pragma unroll
    for (int ni = 0; ni < kKeys / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int slot = ni * 8 + 2 * t + e % 2;
        float pe = exp2f(fmaf(s[0][ni][e], p.scale_log2, -lse2[e / 2]));
        if (!((valid >> slot) & 1u)) pe = 0.f;
        s[0][ni][e] = pe;
        dp[0][ni][e] = pe != 0.f ? pe * (dp[0][ni][e] - delta[e / 2]) : 0.f;
      }
    uint32_t pa[1][kKeys / 16][4], dsa[1][kKeys / 16][4];
    pack_p<kDtype>(s, pa);
    pack_p<kDtype>(dp, dsa);
    // dQ += dS K.
    mma_nn<kDtype, kChunks, kKeys / 16, kDTiles, 0>(acc_dq, dsa[0], sK(stage) + bt_base);
    // P and dS transposed into shared memory: (key, head) rows of 16 heads.
#pragma unroll
    for (int ni = 0; ni < kKeys / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int slot = ni * 8 + 2 * t + e % 2, head = p_col + g + 8 * (e / 2);
        const int at = (slot * kPRow + head) * 2;
        *reinterpret_cast<Element*>(pP + at) = from_f32<Element>(s[0][ni][e]);
        *reinterpret_cast<Element*>(pDs + at) = from_f32<Element>(dp[0][ni][e]);
      }
    if constexpr (kShared) {
      __syncthreads();  // every warp's P^T and dS^T columns are written
      // dK = dS^T Q and dV = P^T dO over the token's 64 heads (K = 64), each warp its share of
      // the (tensor, 32-column block)s.
      constexpr int kDc = kDTiles / 4;
#pragma unroll
      for (int mt = 0; mt < kKeys / 16; ++mt) {
        uint32_t ap[4][4], ad[4][4];
#pragma unroll
        for (int kh = 0; kh < 4; ++kh) {
          const uint32_t arow =
              uint32_t(((mt * 16 + ((lane / 8) % 2) * 8 + r8) * kPRow + kh * 16 + (lane / 16) * 8) * 2);
          ldmatrix_x4(ap[kh], sP + arow);
          ldmatrix_x4(ad[kh], sDs + arow);
        }
        const uint32_t q_tile = base + bt_base, do_tile = base + kGatherMmaWarps * L::kQBytes + bt_base;
        static_for<2 * kDc>([&](auto blk_) {
          constexpr int blk = decltype(blk_)::value, dc = blk % kDc;
          if (blk % kGatherMmaWarps != warp) return;
          float a[4][4];
#pragma unroll
          for (int x = 0; x < 4; ++x)
#pragma unroll
            for (int e = 0; e < 4; ++e) a[x][e] = 0.f;
          if constexpr (blk < kDc) {
            mma_nn<kDtype, kChunks, 4, 4, 2 * dc>(a, ad, q_tile);
#pragma unroll
            for (int x = 0; x < 4; ++x)
#pragma unroll
              for (int e = 0; e < 4; ++e) a[x][e] *= p.scale;
            reduce_rows(a, dk_acc, p.d, mt, dc);
          } else {
            mma_nn<kDtype, kChunks, 4, 4, 2 * dc>(a, ap, do_tile);
            reduce_rows(a, dv_acc, p.dv, mt, dc);
          }
        });
      }
      j_cur = j_next;
      __syncthreads();  // every warp is done with this stage and with P^T, dS^T before they are refilled
      continue;
    }
    __syncwarp();
    // dK = dS^T Q and dV = P^T dO for the stage's slots (16-key m tiles), 32 columns at a time.
#pragma unroll
    for (int mt = 0; mt < kKeys / 16; ++mt) {
      uint32_t ap[1][4], ad[1][4];
      const uint32_t arow =
          uint32_t(((mt * 16 + ((lane / 8) % 2) * 8 + r8) * kGatherMmaRows + (lane / 16) * 8) * 2);
      ldmatrix_x4(ap[0], sP + arow);
      ldmatrix_x4(ad[0], sDs + arow);
      static_for<kDTiles / 4>([&](auto dc_) {
        constexpr int dc = decltype(dc_)::value;
        float ak[4][4], av[4][4];
#pragma unroll
        for (int x = 0; x < 4; ++x)
#pragma unroll
          for (int e = 0; e < 4; ++e) ak[x][e] = av[x][e] = 0.f;
        mma_nn<kDtype, kChunks, 1, 4, 2 * dc>(ak, ad, sQ + bt_base);
        mma_nn<kDtype, kChunks, 1, 4, 2 * dc>(av, ap, sdO + bt_base);
#pragma unroll
        for (int x = 0; x < 4; ++x)
#pragma unroll
          for (int e = 0; e < 4; ++e) ak[x][e] *= p.scale;
        reduce_rows(ak, dk_acc, p.d, mt, dc);
        reduce_rows(av, dv_acc, p.dv, mt, dc);
      });
    }
    j_cur = j_next;
    __syncwarp();  // every lane is done with this stage and with P^T, dS^T before they are refilled
  }
  cp_async_wait<0>();

  // dQ = scale * sum dS K, rows of the group only (head r of the group: row stride Lq * D).
  Element* dq = static_cast<Element*>(bp.dq) + ((int64_t(b) * p.h + h0) * p.lq + i) * p.d;
  store_rows<kDtype>(dq, int64_t(p.lq) * p.d, g, group, p.d, acc_dq, p.scale, t);
#else
  __trap();
#endif
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype, int kHeadDim>
cudaError_t run_gather_bwd_mma_(const AttnBwdParams& params, int group, bool shared, cudaStream_t stream) {
  const AttnFwdParams& p = params.fwd;
  const int64_t tasks = int64_t(p.b) * (p.h / group) * p.lq;
  const int64_t blocks = (tasks + kGatherMmaWarps - 1) / kGatherMmaWarps;  // exact when shared
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  // Shared stages (GatherPlan::shared_stages) for groups of 16 heads: P^T and dS^T rows hold 64.
  shared = shared && group == kGatherMmaRows;
  auto launch = [&](auto kernel, int smem) -> cudaError_t {
    SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<unsigned(blocks), kGatherMmaWarps * 32, smem, stream>>>(params, group);
    return cudaGetLastError();
  };
  if (shared)
    return launch(cuda::gather_bwd_mma_kernel<kDtype, kHeadDim, true>,
                  cuda::GatherBwdLayout<kHeadDim>::kSharedSmemBytes);
  return launch(cuda::gather_bwd_mma_kernel<kDtype, kHeadDim, false>, cuda::GatherBwdLayout<kHeadDim>::kSmemBytes);
}

}  // namespace sparse_attn
