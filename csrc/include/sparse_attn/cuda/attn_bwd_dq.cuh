// dQ of flash and block-sparse attention with no atomics (the deterministic mode): per CTA one
// 64-row query tile of one (batch, head), the forward's key-tile iterator in its fixed order, and
// dQ in registers. Per key tile: S = Q K^T, P = exp2(S * scale_log2 - lse_log2), dP = dO V^T,
// dS = P (dP - delta), dQ += dS K (mma.sync, sm_80+; K and V double-buffered with cp.async).
// The key-major kernels then skip dQ (AttnBwdParams::dq_separate), so a backward recomputes S and
// dP once more than the default's.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "sparse_attn/cuda/attn_bwd.cuh"
#include "sparse_attn/cuda/flash_mask.cuh"

namespace sparse_attn::cuda {

template <ScalarKind kDtype_, int kHeadDim_, Variant kVariant>
struct AttnBwdDqTraits {
  static constexpr ScalarKind kDtype = kDtype_;
  using Element = typename ElementOf<kDtype>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4, kNThreads = 128;
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kTileBytes = 64 * kHeadDim * 2;
  static constexpr int kSmemBytes = 6 * kTileBytes;  // Q, dO, two (K, V) buffers
  using Tiles = typename TilesOf<kVariant, kBlockM, kBlockN>::type;
};

template <typename Tr>
__global__ void __launch_bounds__(Tr::kNThreads)
    attn_bwd_dq_kernel(__grid_constant__ const AttnBwdParams bp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kChunks = Tr::kChunks, kDTiles = Tr::kDTiles;
  const AttnFwdParams& p = bp.fwd;
  extern __shared__ __align__(128) char smem[];
  const uint32_t sQ = smem_u32(smem), sdO = sQ + Tr::kTileBytes, sKV = sdO + Tr::kTileBytes;
  auto sK = [&](int buf) { return sKV + buf * 2 * Tr::kTileBytes; };
  auto sV = [&](int buf) { return sK(buf) + Tr::kTileBytes; };

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4, r8 = lane % 8;
  int bh, m_block;
  if (!tile_of_cta<kBlockM>(p, int64_t(blockIdx.x), bh, m_block)) return;
  const int b = bh / p.h, h = bh % p.h, hk = h / p.h_per_kv;
  const int m0 = m_block * kBlockM;
  const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                     int64_t(m0) * p.q_row_stride;
  const Element* dout = static_cast<const Element*>(bp.dout) + b * bp.do_batch_stride +
                        h * bp.do_head_stride + int64_t(m0) * bp.do_row_stride;
  const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  const typename Tr::Tiles tiles(p, b, h, m_block);
  const int n_tiles = tiles.num_tiles();

  load_tile<Tr, kBlockM>(sQ, q, p.q_row_stride, p.lq - m0, p.d, tid);
  load_tile<Tr, kBlockM>(sdO, dout, bp.do_row_stride, p.lq - m0, p.dv, tid);
  auto load_kv = [&](int it, int buf) {
    const int n0 = tiles.n_block(it) * kBlockN;
    load_tile<Tr, kBlockN>(sK(buf), k + int64_t(n0) * p.k_row_stride, p.k_row_stride, p.lk - n0, p.d, tid);
    load_tile<Tr, kBlockN>(sV(buf), v + int64_t(n0) * p.v_row_stride, p.v_row_stride, p.lk - n0, p.dv, tid);
  };
  if (n_tiles > 0) load_kv(0, 0);
  cp_async_commit();

  // This thread's rows: warp * 16 + g and + 8.
  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t at = int64_t(bh) * bp.lq_pad + m0 + warp * 16 + g + 8 * half;
    lse2[half] = bp.lse_log2[at];
    delta[half] = bp.delta[at];
  }
  float acc[kDTiles][4];
#pragma unroll
  for (int i = 0; i < kDTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
  const uint32_t a_rows = swz<kChunks>(warp * 16 + ((lane / 8) % 2) * 8 + r8, lane / 16);
  const uint32_t b_rows = swz<kChunks>((lane / 16) * 8 + r8, (lane / 8) % 2);
  const uint32_t bt_rows = swz<kChunks>(((lane / 8) % 2) * 8 + r8, lane / 16);

  for (int it = 0; it < n_tiles; ++it) {
    const int buf = it % 2;
    cp_async_wait<0>();
    __syncthreads();  // tile it landed; every warp is done with the other buffer
    if (it + 1 < n_tiles) load_kv(it + 1, buf ^ 1);
    cp_async_commit();

    float s[1][kBlockN / 8][4], dp[1][kBlockN / 8][4];
#pragma unroll
    for (int ni = 0; ni < kBlockN / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][ni][e] = dp[0][ni][e] = 0.f;
    mma_nt<Tr, kBlockN / 8>(s[0], sQ + a_rows, sK(buf) + b_rows);
    mma_nt<Tr, kBlockN / 8>(dp[0], sdO + a_rows, sV(buf) + b_rows);
    mask_scores<kBlockN>(s, tiles, it, m0 + warp * 16 + g, t);
#pragma unroll
    for (int ni = 0; ni < kBlockN / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2f(fmaf(s[0][ni][e], p.scale_log2, -lse2[e / 2]));
        dp[0][ni][e] = pe != 0.f ? pe * (dp[0][ni][e] - delta[e / 2]) : 0.f;
      }
    uint32_t dsa[1][kBlockN / 16][4];
    pack_p<Tr::kDtype>(dp, dsa);
    mma_nn<Tr::kDtype, kChunks, kBlockN / 16, kDTiles, 0>(acc, dsa[0], sK(buf) + bt_rows);
  }
  cp_async_wait<0>();

  Element* dq = static_cast<Element*>(bp.dq) + (int64_t(bh) * p.lq + m0) * p.d;
  store_rows<Tr::kDtype>(dq, p.d, warp * 16 + g, p.lq - m0, p.d, acc, p.scale, t);
#else
  __trap();
#endif
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_attn_bwd_dq_(const AttnBwdParams& params, cudaStream_t stream) {
  using Tr = cuda::AttnBwdDqTraits<kDtype, kHeadDim, kVariant>;
  const int64_t grid = num_ctas<Tr::kBlockM>(params.fwd);
  if (grid == 0) return cudaSuccess;
  if (grid > INT_MAX) return cudaErrorInvalidConfiguration;
  auto kernel = cuda::attn_bwd_dq_kernel<Tr>;
  SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  kernel<<<unsigned(grid), Tr::kNThreads, Tr::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace sparse_attn
