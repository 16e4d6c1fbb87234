// The tensor-core backward (mma.sync, sm_80+) of flash and block-sparse attention.
//
// Per CTA: one tile of kBlockN keys of one (batch, kv head); K and V stay in shared memory, dK and
// dV in registers (each warp owns 16 keys: 8 warps for 128 keys, 4 for 64). The CTA walks the query tiles
// that see its keys (QTilesOf, tile_iter.h) over every query head of the group, so GQA is reduced in place;
// Q, dO and the rows' statistics are double-buffered with cp.async. Per query tile, in the
// transposed layout (rows are keys):
//   S^T = K Q^T, P^T = exp2(S^T * scale_log2 - lse_log2), dP^T = V dO^T,
//   dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q,
// then dS^T goes through shared memory and the warps add dQ = dS K to the fp32 accumulator with
// atomics (a float2 reduction on sm_90), each a 16-row x 32k-column share.
#pragma once

#include <cmath>
#include <cstdint>

#include "sparse_attn/cuda/attn_bwd.h"
#include "sparse_attn/cuda/flash_fwd.cuh"
#include "sparse_attn/cuda/flash_softmax.cuh"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/cuda/smem_tile.cuh"
#include "sparse_attn/tile_iter.h"

namespace sparse_attn::cuda {

template <ScalarKind kDtype_, int kHeadDim_, Variant kVariant, int kBlockN_>
struct AttnBwdTraits {
  static constexpr ScalarKind kDtype = kDtype_;
  using Element = typename ElementOf<kDtype>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBwdBlockM;  // query rows per tile
  static constexpr int kBlockN = kBlockN_;    // keys per CTA, 16 per warp
  static constexpr int kNWarps = kBlockN / 16;
  static constexpr int kRowGroups = kBlockM / 16;               // dQ: 16-row groups of the query tile
  static constexpr int kColGroups = kNWarps / kRowGroups;       // dQ: column groups, one per warp
  static constexpr int kDqChunks = kHeadDim / 32 / kColGroups;  // dQ: 32-column chunks per warp
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row of Q, K, V, dO
  static constexpr int kQTiles = kBlockM / 8;   // n8 tiles of S^T (query columns)
  static constexpr int kDTiles = kHeadDim / 8;  // n8 tiles of dK, dV
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kStatBytes = 2 * kBlockM * 4;  // lse_log2 and delta of a query tile
  // sK, sV, then two buffers of (Q, dO, stats), then dS^T.
  static constexpr int kSmemBytes = 2 * kKVBytes + 2 * (2 * kQBytes + kStatBytes) + kDsBytes;
  using QTiles = typename QTilesOf<kVariant, kBlockM, kBlockN>::type;
  static_assert(kNWarps % kRowGroups == 0 && kDqChunks >= 1, "dQ: warps tile the query tile by 16 x 32 k");
  static_assert(kChunks % 8 == 0 && kBlockM / 8 == 8, "rows of >= 8 chunks; dS^T rows of 8 chunks");
};

// acc (16 x 8 kNT) += A B^T, A: 16 rows x kHeadDim at a_base (ldmatrix addresses of the warp's
// rows), B: 8 kNT rows x kHeadDim at b_base; both row-major in swizzled shared memory.
template <typename Tr, int kNT>
__device__ __forceinline__ void mma_nt(float (&acc)[kNT][4], uint32_t a_base, uint32_t b_base) {
  constexpr uint32_t kRow16 = 16 * Tr::kChunks * 16;
  const uint32_t ab = opaque(a_base), bb = opaque(b_base);
  static_for<Tr::kHeadDim / 16>([&](auto kk_) {
    constexpr int kk = decltype(kk_)::value;
    uint32_t fa[4];
    ldmatrix_x4(fa, swz_step<kk>(ab));
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      uint32_t fb[4];
      ldmatrix_x4(fb, swz_step<kk>(bb + np * kRow16));
      mma_16x8x16<Tr::kDtype>(acc[2 * np], fa, fb[0], fb[1]);
      mma_16x8x16<Tr::kDtype>(acc[2 * np + 1], fa, fb[2], fb[3]);
    }
  });
}

// acc (16 x 8 kNT, columns from 16 kCol0) += A B, A: 16 x (16 kKS) in registers (A-operand
// layout), B: (16 kKS) rows of kRowChunks chunks at bt_base (ldmatrix.trans addresses), row-major.
template <ScalarKind kDtype, int kRowChunks, int kKS, int kNT, int kCol0>
__device__ __forceinline__ void mma_nn(float (&acc)[kNT][4], const uint32_t (&a)[kKS][4], uint32_t bt_base) {
  constexpr uint32_t kRow16 = 16 * kRowChunks * 16;
  const uint32_t bb = opaque(bt_base);
#pragma unroll
  for (int kk = 0; kk < kKS; ++kk) {
    static_for<kNT / 2>([&](auto dp_) {
      constexpr int dp = decltype(dp_)::value;
      uint32_t r[4];
      ldmatrix_x4_trans(r, swz_step<kCol0 + dp>(bb + kk * kRow16));
      mma_16x8x16<kDtype>(acc[2 * dp], a[kk], r[0], r[1]);
      mma_16x8x16<kDtype>(acc[2 * dp + 1], a[kk], r[2], r[3]);
    });
  }
}

// Adds an m16n8 accumulator tile's two rows of this thread (columns 2t, 2t + 1 of rows lo and hi)
// to fp32 rows in global memory, one 8-byte vector reduction per row on sm_90 (a 16-byte one
// after a swap between lanes t and t ^ 1 measured 3-12 % slower: docs/PERF_LOG.md). row_lo /
// row_hi point at column 8 x of their rows, or are nullptr (skipped).
__device__ __forceinline__ void red_add_rows(float* row_lo, float* row_hi, const float (&acc)[4], int t) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float* dst = half ? row_hi : row_lo;
    if (dst == nullptr) continue;
    dst += 2 * t;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(dst), make_float2(acc[2 * half], acc[2 * half + 1]));
#else
    atomicAdd(dst, acc[2 * half]);
    atomicAdd(dst + 1, acc[2 * half + 1]);
#endif
  }
}

// Adds four floats to 16-byte aligned global memory, atomically per element, no result: one vector
// reduction on sm_90 (the Hopper backward's dQ, top-k's dK and dV), four atomics before.
__device__ __forceinline__ void red_add_f4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
#else
  atomicAdd(dst, v.x);
  atomicAdd(dst + 1, v.y);
  atomicAdd(dst + 2, v.z);
  atomicAdd(dst + 3, v.w);
#endif
}

// Adds two floats to 8-byte aligned global memory, atomically per element, no result.
__device__ __forceinline__ void red_add_f2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// fn(r, col, x, y) for the pairs of a warp's m16 x (8 kNT) accumulator tile times `factor` that
// this thread holds (rows `row` and row + 8, columns 8 nd + 2t and + 1), rows >= rows and
// columns >= cols skipped.
template <int kNT, typename Fn>
__device__ __forceinline__ void for_row_pairs(int row, int rows, int cols, const float (&acc)[kNT][4], float factor,
                                              int t, Fn fn) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row + 8 * half;
    if (r >= rows) continue;
#pragma unroll
    for (int nd = 0; nd < kNT; ++nd) {
      const int col = nd * 8 + 2 * t;
      if (col < cols) fn(r, col, acc[nd][2 * half] * factor, acc[nd][2 * half + 1] * factor);
    }
  }
}

// Adds the tile (for_row_pairs) to fp32 rows of a row-major matrix; `cols` even.
template <int kNT>
__device__ __forceinline__ void red_rows(float* out, int64_t row_stride, int row, int rows, int cols,
                                         const float (&acc)[kNT][4], float factor, int t) {
  for_row_pairs(row, rows, cols, acc, factor, t,
                [&](int r, int col, float x, float y) { red_add_f2(out + int64_t(r) * row_stride + col, x, y); });
}

// Stores the tile (for_row_pairs) as 16-bit rows of a row-major matrix.
template <ScalarKind kDtype, int kNT>
__device__ __forceinline__ void store_rows(typename ElementOf<kDtype>::type* out, int64_t row_stride, int row,
                                           int rows, int cols, const float (&acc)[kNT][4], float factor,
                                           int t) {
  for_row_pairs(row, rows, cols, acc, factor, t, [&](int r, int col, float x, float y) {
    *reinterpret_cast<uint32_t*>(out + int64_t(r) * row_stride + col) = pack2<kDtype>(x, y);
  });
}

// A key tile's dK = scale * sum dS^T Q and dV = sum P^T dO (each thread's rows key_row and + 8 of
// its m16 tiles) into the gradients of K/V head hk as 16-bit rows or, where head_splits CTAs share
// the group's query heads, added to the fp32 accumulators.
template <ScalarKind kDtype, int kNT>
__device__ __forceinline__ void write_dk_dv(const AttnBwdParams& bp, int b, int hk, int key_row,
                                            const float (&dk)[kNT][4], const float (&dv)[kNT][4], int t) {
  const AttnFwdParams& p = bp.fwd;
  const int64_t kv = int64_t(b) * p.h_kv + hk;
  if (bp.head_splits > 1) {
    red_rows(bp.dk_accum + kv * p.lk * p.d, p.d, key_row, p.lk, p.d, dk, p.scale, t);
    red_rows(bp.dv_accum + kv * p.lk * p.dv, p.dv, key_row, p.lk, p.dv, dv, 1.f, t);
    return;
  }
  using Element = typename ElementOf<kDtype>::type;
  store_rows<kDtype>(static_cast<Element*>(bp.dk) + kv * p.lk * p.d, p.d, key_row, p.lk, p.d, dk, p.scale, t);
  store_rows<kDtype>(static_cast<Element*>(bp.dv) + kv * p.lk * p.dv, p.dv, key_row, p.lk, p.dv, dv, 1.f, t);
}

template <typename Tr>
__global__ void __launch_bounds__(Tr::kNThreads, 256 / Tr::kNThreads)
    attn_bwd_kernel(__grid_constant__ const AttnBwdParams bp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kChunks = Tr::kChunks, kQTiles = Tr::kQTiles,
                kDTiles = Tr::kDTiles;
  constexpr uint32_t kBufBytes = 2 * Tr::kQBytes + Tr::kStatBytes;
  const AttnFwdParams& p = bp.fwd;
  extern __shared__ __align__(128) char smem[];
  const uint32_t sK = smem_u32(smem), sV = sK + Tr::kKVBytes, sBuf = sV + Tr::kKVBytes;
  const uint32_t sDs = sBuf + 2 * kBufBytes;
  const float* stats = reinterpret_cast<const float*>(smem + 2 * Tr::kKVBytes + 2 * Tr::kQBytes);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4, r8 = lane % 8;
  int n_block, by;
  bwd_tile_of_cta(bp, blockIdx.x, blockIdx.y, gridDim.x, gridDim.y, n_block, by);
  const int split = by % bp.head_splits, bkv = by / bp.head_splits;  // (batch, kv head, split)
  const int b = bkv / p.h_kv, hk = bkv % p.h_kv;
  const int n0 = n_block * kBlockN;
  const Element* k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  load_tile<Tr, kBlockN>(sK, k + int64_t(n0) * p.k_row_stride, p.k_row_stride, p.lk - n0, p.d, tid);
  load_tile<Tr, kBlockN>(sV, v + int64_t(n0) * p.v_row_stride, p.v_row_stride, p.lk - n0, p.dv, tid);
  cp_async_commit();

  typename Tr::QTiles tiles(bp, b, hk, n_block);
  if (bp.head_splits > 1) tiles.split_heads(split, bp.head_splits);
  // Q, dO, lse_log2 and delta of query tile `s` into buffer `buf`.
  auto load_q = [&](const QTilePos& s, int buf) {
    const int h = hk * p.h_per_kv + s.hl, m0 = s.m_block * kBlockM;
    const uint32_t dst = sBuf + buf * kBufBytes;
    const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                       int64_t(m0) * p.q_row_stride;
    const Element* dout = static_cast<const Element*>(bp.dout) + b * bp.do_batch_stride +
                          h * bp.do_head_stride + int64_t(m0) * bp.do_row_stride;
    load_tile<Tr, kBlockM>(dst, q, p.q_row_stride, p.lq - m0, p.d, tid);
    load_tile<Tr, kBlockM>(dst + Tr::kQBytes, dout, bp.do_row_stride, p.lq - m0, p.dv, tid);
    if (tid < 2 * kBlockM / 4) {  // 16-byte chunks of the two statistics (lq_pad rows: always in range)
      const int which = tid / (kBlockM / 4), c = tid % (kBlockM / 4);
      const float* src =
          (which == 0 ? bp.lse_log2 : bp.delta) + (int64_t(b) * p.h + h) * bp.lq_pad + m0 + c * 4;
      cp_async_16(dst + 2 * Tr::kQBytes + which * kBlockM * 4 + c * 16, src, 16);
    }
  };
  QTilePos cur;
  bool have = tiles.start(cur);
  if (have) load_q(cur, 0);
  cp_async_commit();

  float acc_dk[kDTiles][4], acc_dv[kDTiles][4];
#pragma unroll
  for (int i = 0; i < kDTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;

  constexpr uint32_t kRow16 = 16 * kChunks * 16;
  // ldmatrix bases: A rows of this warp's 16 keys (K, V); B rows (Q, dO) non-transposed and
  // transposed; dS^T rows read transposed as dQ's A operand; K transposed as dQ's B operand.
  const uint32_t a_rows = swz<kChunks>(warp * 16 + ((lane / 8) % 2) * 8 + r8, lane / 16);
  const uint32_t b_rows = swz<kChunks>((lane / 16) * 8 + r8, (lane / 8) % 2);
  const uint32_t bt_rows = swz<kChunks>(((lane / 8) % 2) * 8 + r8, lane / 16);
  const int row_group = warp % Tr::kRowGroups, col_group = warp / Tr::kRowGroups;
  const uint32_t ds_a = sDs + swz<kBlockM / 8>((lane / 16) * 8 + r8, 2 * row_group + (lane / 8) % 2);
  const int key_row = n0 + warp * 16 + g;  // this thread's keys: key_row and key_row + 8

  int buf = 0;
  while (have) {
    QTilePos nxt = cur;
    const bool have_next = tiles.advance(nxt);
    cp_async_wait<0>();
    __syncthreads();  // this tile's Q, dO, stats landed; every warp is done with the other buffer and dS^T
    if (have_next) load_q(nxt, buf ^ 1);
    cp_async_commit();

    const uint32_t sQ = sBuf + buf * kBufBytes, sdO = sQ + Tr::kQBytes;
    const float* lse_s = stats + buf * (kBufBytes / 4);
    const float* delta_s = lse_s + kBlockM;
    const int h = hk * p.h_per_kv + cur.hl, m0 = cur.m_block * kBlockM;

    float s[1][kQTiles][4], dp[1][kQTiles][4];
#pragma unroll
    for (int ni = 0; ni < kQTiles; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][ni][e] = dp[0][ni][e] = 0.f;
    mma_nt<Tr, kQTiles>(s[0], sK + a_rows, sQ + b_rows);
    mma_nt<Tr, kQTiles>(dp[0], sV + a_rows, sdO + b_rows);

    // P^T and dS^T. Masked elements (and keys past Lk) get P = 0 and dS = 0, whatever the scores.
    const bool masked = tiles.needs_mask(cur);
#pragma unroll
    for (int ni = 0; ni < kQTiles; ++ni) {
      const float2 lse2 = *reinterpret_cast<const float2*>(lse_s + ni * 8 + 2 * t);
      const float2 dl2 = *reinterpret_cast<const float2*>(delta_s + ni * 8 + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float l = e % 2 ? lse2.y : lse2.x, dl = e % 2 ? dl2.y : dl2.x;
        float pe = exp2f(fmaf(s[0][ni][e], p.scale_log2, -l));
        if (masked && !tiles.visible(cur, m0 + ni * 8 + 2 * t + e % 2, key_row + 8 * (e / 2))) pe = 0.f;
        s[0][ni][e] = pe;
        dp[0][ni][e] = pe != 0.f ? pe * (dp[0][ni][e] - dl) : 0.f;  // NaN != 0: a NaN P propagates
      }
    }
    uint32_t pa[1][kQTiles / 2][4], dsa[1][kQTiles / 2][4];
    pack_p<Tr::kDtype>(s, pa);
    pack_p<Tr::kDtype>(dp, dsa);
    mma_nn<Tr::kDtype, kChunks, kQTiles / 2, kDTiles, 0>(acc_dv, pa[0], sdO + bt_rows);
    mma_nn<Tr::kDtype, kChunks, kQTiles / 2, kDTiles, 0>(acc_dk, dsa[0], sQ + bt_rows);

    if (!bp.dq_separate) {  // (the deterministic mode's own kernel computes dQ)
      // dS^T to shared memory (rows = keys, 8 chunks of 8 queries), then dQ = dS K: each warp adds
      // 16 rows x kDqChunks 32-column chunks.
#pragma unroll
      for (int ni = 0; ni < kQTiles; ++ni)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = warp * 16 + g + 8 * half;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sDs + swz<kBlockM / 8>(r, ni) + t * 4),
                       "r"(dsa[0][ni / 2][(ni % 2) * 2 + half]));
        }
      __syncthreads();
      uint32_t da[kBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        ldmatrix_x4_trans(da[kk], ds_a + kk * (16 * (kBlockM / 8) * 16));
      float* dq = bp.dq_accum + ((int64_t(b) * p.h + h) * p.lq) * p.d;
      const int qrow = m0 + row_group * 16 + g;
      static_for<kDTiles / 4>([&](auto dc_) {
        constexpr int dc = decltype(dc_)::value;
        if (dc / Tr::kDqChunks != col_group) return;  // another warp's columns (warp-uniform)
        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
        mma_nn<Tr::kDtype, kChunks, kBlockN / 16, 4, 2 * dc>(acc, da, sK + bt_rows);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col8 = dc * 32 + i * 8;  // p.d is a multiple of 8: the whole n8 tile exists or none
          const bool ok = col8 < p.d;
          red_add_rows(ok && qrow < p.lq ? dq + int64_t(qrow) * p.d + col8 : nullptr,
                       ok && qrow + 8 < p.lq ? dq + int64_t(qrow + 8) * p.d + col8 : nullptr, acc[i], t);
        }
      });
    }
    cur = nxt;
    have = have_next;
    buf ^= 1;
  }
  cp_async_wait<0>();

  // dK, dV (16 keys per warp).
  write_dk_dv<Tr::kDtype>(bp, b, hk, key_row, acc_dk, acc_dv, t);
#else
  __trap();  // built for an architecture without bf16 mma.sync: the launcher never gets here
#endif
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

namespace cuda {
template <typename Tr>
cudaError_t launch_attn_bwd(const AttnBwdParams& params, cudaStream_t stream) {
  const AttnFwdParams& p = params.fwd;
  if (params.head_splits < 1 || (params.dq_separate && params.head_splits != 1) ||
      p.h_per_kv % params.head_splits != 0 || (params.head_splits > 1 && params.dk_accum == nullptr))
    return cudaErrorInvalidValue;
  const int64_t units = int64_t(p.b) * p.h_kv * params.head_splits;  // (batch, kv head, split)
  if (units > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid((p.lk + Tr::kBlockN - 1) / Tr::kBlockN, unsigned(units));
  if (grid.x == 0 || grid.y == 0) return cudaSuccess;
  auto kernel = cuda::attn_bwd_kernel<Tr>;
  SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  kernel<<<grid, Tr::kNThreads, Tr::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}
}  // namespace cuda

// 128 keys per CTA (8 warps), or 64 (4 warps) for block-sparse masks of 64-key blocks.
template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_attn_bwd_(const AttnBwdParams& params, cudaStream_t stream) {
  if (kVariant == Variant::kBlockSparse && params.fwd.kv_block == 64)
    return cuda::launch_attn_bwd<cuda::AttnBwdTraits<kDtype, kHeadDim, kVariant, 64>>(params, stream);
  return cuda::launch_attn_bwd<cuda::AttnBwdTraits<kDtype, kHeadDim, kVariant, 128>>(params, stream);
}

}  // namespace sparse_attn
