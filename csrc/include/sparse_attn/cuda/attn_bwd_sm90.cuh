// The backward of flash and block-sparse attention on Hopper (sm_90a): the algorithm of the
// tensor-core kernel (attn_bwd.cuh) on wgmma, TMA and mbarriers.
//
// Per CTA: 128 keys of one (batch, kv head), walking the query tiles that see them (QTilesOf,
// tile_iter.h) over the group's query heads; query tiles of 64 rows, of 128 for the dense family
// at head dim 64 (AttnBwdSm90Traits::kBlockM). Warpgroup 0 is the producer: one thread loads K and V
// once, then Q, dO (TMA) and the rows' statistics (bulk copies) of each query tile into a
// two-stage ring ("full" / "empty" mbarriers). Warpgroups 1 and 2 are consumers, 64 keys each, in
// the transposed layout (rows are keys):
//   S^T = K Q^T and dP^T = V dO^T  (wgmma, both operands K-major in shared memory),
//   P^T, dS^T in registers; dV += P^T dO and dK += dS^T Q (wgmma with A from registers),
//   dS written transposed (stmatrix) as the K-major A of dQ = dS K (B = K, MN-major),
// each consumer computing half of dQ's columns (128-row tiles: every column of its 64 rows) over
// all 128 keys and adding it to the fp32 accumulator by vector reductions. Per tile the products
// are issued so that the exponentials of P^T run under dP^T, dS^T under dV, and dQ's reductions
// under dK. With GQA, a key block's query heads may be shared by head_splits CTAs, which add dK
// and dV in fp32 (AttnBwdParams::head_splits).
//
// Shared memory is 128-byte swizzled as in the forward (flash_fwd_sm90.cuh): a tile of R rows and
// D columns is D / 64 column blocks of R rows x 128 bytes, each 1024-byte aligned.
#pragma once

#include <cuda.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "sparse_attn/cuda/attn_bwd.cuh"
#include "sparse_attn/cuda/ptx_sm90.cuh"
#include "sparse_attn/cuda/tma.h"
#include "sparse_attn/cuda/wgmma.cuh"

namespace sparse_attn::cuda {

struct AttnBwdSm90Args {
  AttnBwdParams bp;
  CUtensorMap tma_q, tma_do, tma_k, tma_v;  // Q and dO: boxes of kBlockM rows; K and V: kBlockN
};

// How a CTA's dQ reaches the fp32 accumulator: kNone computes dK and dV only (block-sparse masks'
// deterministic mode, whose dQ has a kernel of its own); kAtomic adds it by reductions in any order;
// kOrdered (the dense family's deterministic mode) adds each query tile's in ascending key-tile
// order (AttnBwdParams::dq_order, OrderedWindowQTiles).
enum class DqMode { kNone, kAtomic, kOrdered };

template <ScalarKind kDtype_, int kHeadDim_, Variant kVariant_, DqMode kDqMode_>
struct AttnBwdSm90Traits {
  static constexpr bool kDq = kDqMode_ != DqMode::kNone;
  static constexpr bool kOrdered = kDqMode_ == DqMode::kOrdered;
  static constexpr DqMode kDqMode = kDqMode_;
  static_assert(!kOrdered || kVariant_ == Variant::kWindow);
  static constexpr Variant kVariant = kVariant_;
  static constexpr ScalarKind kDtype = kDtype_;
  static constexpr int kHeadDim = kHeadDim_;
  // Query rows per tile: 128 for the dense family at head dim 64 (its registers allow S^T and
  // dP^T of 64 keys x 128 queries; the tile's fixed chain, waits, exchange and barriers, then
  // serves twice the products), 64 otherwise.
  static constexpr int kBlockM = kHeadDim_ == 64 && kVariant_ == Variant::kWindow ? 128 : kBwdBlockM;
  static constexpr int kMTiles = kBlockM / 64;  // 64-row tiles of the dQ accumulator per query tile
  static constexpr int kBlockN = 128;           // keys per CTA, 64 per consumer warpgroup
  static_assert(!kOrdered || kBlockN == 128,
                "registration.cpp's _ordered_bwd_walk runs this walk on 64 or 128 x 128 tiles for the tests");
  static constexpr int kStages = 2;
  static constexpr int kNThreads = 384;
  static constexpr int kColBlocks = kHeadDim / 64;
  static constexpr int kQColBytes = kBlockM * 128;
  static constexpr int kKColBytes = kBlockN * 128;
  static constexpr int kQBytes = kColBlocks * kQColBytes;
  static constexpr int kKBytes = kColBlocks * kKColBytes;
  static constexpr int kStatBytes = 2 * kBlockM * 4;  // lse_log2, then delta
  static constexpr int kDsColBytes = kBlockM * 128;   // dS: (query, key), two column blocks of 64 keys
  static constexpr int kDsBytes = 2 * kDsColBytes;
  // dQ per consumer, over all 128 keys: half of the columns of a 64-row tile, or (128-row tiles)
  // every column of its own 64 rows
  static constexpr int kDqCols = kMTiles == 2 ? kHeadDim : kHeadDim / 2;
  // K, V, the stages' Q and dO, two dS buffers, then the stages' statistics.
  static constexpr int kSmemBytes =
      1024 + 2 * kKBytes + 2 * kStages * kQBytes + 2 * kDsBytes + kStages * kStatBytes;
  static_assert(kSmemBytes + 64 <= 227 * 1024);
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(128 * kProducerRegs + 2 * 128 * kConsumerRegs <= kNThreads * ((65536 / kNThreads) & ~7));
  using QTiles = std::conditional_t<kOrdered, OrderedWindowQTiles<kBlockM, kBlockN>,
                                    typename QTilesOf<kVariant, kBlockM, kBlockN>::type>;
  static_assert(kHeadDim == 64 || kHeadDim == 128);
  static_assert(kBwdBlockM == 64 && (kMTiles == 1 || kMTiles == 2));
};

template <typename Tr>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    attn_bwd_sm90_kernel(__grid_constant__ const AttnBwdSm90Args args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStages = Tr::kStages, kHeadDim = Tr::kHeadDim;
  constexpr int kDTiles = kHeadDim / 8;
  const AttnBwdParams& bp = args.bp;
  const AttnFwdParams& p = bp.fwd;
  extern __shared__ char smem_raw[];
  const uint32_t sK = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sV = sK + Tr::kKBytes;
  const uint32_t sQ = sV + Tr::kKBytes;             // kStages buffers
  const uint32_t sdO = sQ + kStages * Tr::kQBytes;  // kStages buffers
  const uint32_t sDs = sdO + kStages * Tr::kQBytes;
  const uint32_t sStat = sDs + 2 * Tr::kDsBytes;  // kStages x (lse_log2[64], delta[64])
  const float* stat_ptr = reinterpret_cast<const float*>(smem_raw + (sStat - smem_u32(smem_raw)));
  // K/V loaded; per stage full and empty; ordered mode: per tile parity, dQ's turn has come ("go",
  // from the sequencer) and the consumers' reductions are issued ("done", one arrival per warp)
  __shared__ alignas(8) uint64_t barriers[1 + 2 * kStages + 4];
  const uint32_t bar_kv = smem_u32(barriers), bar_full = bar_kv + 8, bar_empty = bar_full + 8 * kStages;
  const uint32_t bar_go = bar_empty + 8 * kStages, bar_done = bar_go + 16;

  int n_block, by;
  bwd_tile_of_cta(bp, blockIdx.x, blockIdx.y, gridDim.x, gridDim.y, n_block, by);
  const int split = by % bp.head_splits, bkv = by / bp.head_splits;  // (batch, kv head, split)
  const int b = bkv / p.h_kv, hk = bkv % p.h_kv;
  const int n0 = n_block * kBlockN;
  typename Tr::QTiles tiles(bp, b, hk, n_block);
  if constexpr (Tr::kDqMode == DqMode::kAtomic) {
    if (bp.head_splits > 1) tiles.split_heads(split, bp.head_splits);
  }
  QTilePos first;
  const bool any = tiles.start(first);

  if (threadIdx.x == 0) {
    mbar_init(bar_kv, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full + 8 * s, 1);
      mbar_init(bar_empty + 8 * s, 8);  // one arrival per consumer warp
    }
    if constexpr (Tr::kOrdered) {
      for (int s = 0; s < 2; ++s) {
        mbar_init(bar_go + 8 * s, 1);
        mbar_init(bar_done + 8 * s, 8);
      }
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // ---------------- producer ----------------
    setmaxnreg_dec<Tr::kProducerRegs>();
    if constexpr (Tr::kOrdered) {
      // The sequencer (one thread of warp 1): per tile of the walk, once the consumers have issued
      // the previous tile's reductions, release them (count + 1), then wait until the key tiles
      // before this one have added into this tile's dQ and tell the consumers. The tile's count is
      // read before the wait for the consumers (the release's fence makes that read an acquire), so
      // its latency hides under it. A CTA that waits about a second (a grid run out of order) goes
      // on: the sums stay exact, their order is lost.
      if (threadIdx.x == 32 && any) {
        const int64_t tiles_per_head = bp.lq_pad / kBlockM;
        int* prev = nullptr;
        QTilePos cur = first;
        for (int n = 0;; ++n) {
          int* count = bp.dq_order + (int64_t(b) * p.h + hk * p.h_per_kv + cur.hl) * tiles_per_head + cur.m_block;
          const int rank = tiles.rank(cur);
          int seen = 0;  // (a key tile of rank 0 waits for none)
          if (n > 0) {
            seen = ld_relaxed_gpu(count);  // used after the fence below
            mbar_wait(bar_done + 8 * ((n - 1) % 2), ((n - 1) / 2) & 1);
            release_increment_gpu(prev);
          }
          for (const long long t0 = clock64(); seen < rank && clock64() - t0 < (1ll << 31);) {
            __nanosleep(32);
            seen = ld_acquire_gpu(count);
          }
          mbar_arrive(bar_go + 8 * (n % 2));
          prev = count;
          if (!tiles.advance(cur)) {
            mbar_wait(bar_done + 8 * (n % 2), (n / 2) & 1);
            release_increment_gpu(prev);
            break;
          }
        }
      }
    }
    if (threadIdx.x != 0 || !any) return;
    mbar_expect_tx(bar_kv, 2 * Tr::kKBytes);
#pragma unroll
    for (int c = 0; c < Tr::kColBlocks; ++c) {
      tma_load_4d(sK + c * Tr::kKColBytes, &args.tma_k, bar_kv, c * 64, n0, hk, b);
      tma_load_4d(sV + c * Tr::kKColBytes, &args.tma_v, bar_kv, c * 64, n0, hk, b);
    }
    QTilePos cur = first;
    for (int n = 0;; ++n) {
      const int s = n % kStages;
      mbar_wait(bar_empty + 8 * s, ((n / kStages) & 1) ^ 1);
      mbar_expect_tx(bar_full + 8 * s, 2 * Tr::kQBytes + Tr::kStatBytes);
      const int h = hk * p.h_per_kv + cur.hl, m0 = cur.m_block * kBlockM;
#pragma unroll
      for (int c = 0; c < Tr::kColBlocks; ++c) {
        tma_load_4d(sQ + s * Tr::kQBytes + c * Tr::kQColBytes, &args.tma_q, bar_full + 8 * s, c * 64, m0, h,
                    b);
        tma_load_4d(sdO + s * Tr::kQBytes + c * Tr::kQColBytes, &args.tma_do, bar_full + 8 * s, c * 64, m0, h,
                    b);
      }
      const int64_t row = (int64_t(b) * p.h + h) * bp.lq_pad + m0;
      bulk_load(sStat + s * Tr::kStatBytes, bp.lse_log2 + row, kBlockM * 4, bar_full + 8 * s);
      bulk_load(sStat + s * Tr::kStatBytes + kBlockM * 4, bp.delta + row, kBlockM * 4, bar_full + 8 * s);
      if (!tiles.advance(cur)) break;
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<Tr::kConsumerRegs>();
  // keys n0 + 64 wg .. n0 + 64 wg + 63 (read through a shuffle so the compiler knows it is
  // warp-uniform: the wgmma descriptors below then live in uniform registers)
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0) - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  // This thread's keys: key_row, key_row + 8 (registration.cpp's _block_bwd_visible_bits runs
  // visible_bits_t on this mapping for the tests).
  const int key_row = n0 + wg * 64 + warp * 16 + g;

  float dk[kDTiles * 4], dv[kDTiles * 4];
#pragma unroll
  for (int i = 0; i < kDTiles * 4; ++i) dk[i] = dv[i] = 0.f;

  // S^T = K Q^T (or dP^T = V dO^T) of the query tile in stage s over this warpgroup's 64 keys
  // (K = head dim, 16 per wgmma), each committed as a group of its own: kNq groups of 8 queries.
  constexpr int kNq = kBlockM / 8;
  float st[1][kNq][4], dpt[1][kNq][4];
  auto& st_flat = reinterpret_cast<float (&)[kNq * 4]>(st);
  auto& dpt_flat = reinterpret_cast<float (&)[kNq * 4]>(dpt);
  // wgmma descriptors: one per operand, stepped by adding (byte offset >> 4) to the start-address
  // field (shared addresses stay below 256 KiB, so the 14-bit field never carries).
  const uint64_t k_rows = sw128_desc(sK + wg * 64 * 128, 16, 1024);  // A of S^T: K-major
  const uint64_t v_rows = sw128_desc(sV + wg * 64 * 128, 16, 1024);
  const uint64_t q_kmajor = sw128_desc(sQ, 16, 1024), do_kmajor = sw128_desc(sdO, 16, 1024);
  const uint64_t q_mnmajor = sw128_desc(sQ, Tr::kQColBytes, 1024);  // B of dK and dV
  const uint64_t do_mnmajor = sw128_desc(sdO, Tr::kQColBytes, 1024);
  // A of dQ: dS's rows 64 wg .. with 128-row tiles
  const uint64_t ds_kmajor = sw128_desc(sDs + (Tr::kMTiles == 2 ? wg * 64 * 128 : 0), 16, 1024);
  // B of dQ: K's columns kDqCols * wg ..; at head dim 64 the halves start 64 bytes apart inside
  // its 128-byte swizzled rows (128-row tiles: every column)
  const uint64_t k_cols = sw128_desc(
      sK + (Tr::kMTiles == 2 ? 0 : kHeadDim == 128 ? wg * Tr::kKColBytes : wg * 64), Tr::kKColBytes, 1024);
  auto rows_gemm = [&](float (&acc)[kNq * 4], uint64_t a_desc, uint64_t b_desc) {
    // A: this warpgroup's 64 rows of K (or V); B: the tile's Q (or dO); both K-major.
    wgmma_fence();
    static_for<kHeadDim / 16>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
      constexpr uint32_t off = (kk % 4) * 32;
      Wgmma<Tr::kDtype, kBlockM>::ss(acc, a_desc + (((kk / 4) * Tr::kKColBytes + off) >> 4),
                                b_desc + (((kk / 4) * Tr::kQColBytes + off) >> 4), kk > 0 ? 1 : 0);
    });
    wgmma_commit();
  };

  // Per tile, in the order the tensor cores take them (one warpgroup): S^T | dP^T (P^T's
  // exponentials meanwhile) | dV (dS^T meanwhile) | dQ | dK (dQ's reductions meanwhile). Issuing
  // the next tile's S^T before this tile's dQ is reduced made ptxas serialise every wgmma of the
  // kernel (docs/PERF_LOG.md).
  QTilePos cur = first;
  bool have = any;
  if (any) mbar_wait(bar_kv, 0);
  for (int n = 0; have; ++n) {
    const int s = n % kStages, phase = (n / kStages) & 1;
    const int h = hk * p.h_per_kv + cur.hl, m_block = cur.m_block, m0 = m_block * kBlockM;
    const uint32_t stage_off = s * (Tr::kQBytes >> 4);  // the stage's Q and dO, in descriptor units
    mbar_wait(bar_full + 8 * s, phase);
    rows_gemm(st_flat, k_rows, q_kmajor + stage_off);
    rows_gemm(dpt_flat, v_rows, do_kmajor + stage_off);
    wgmma_wait<1>();  // S^T (dP^T runs on)
    fence_regs(st_flat);

    // P^T (masked elements and keys past Lk: 0).
    const float* lse_s = stat_ptr + s * (Tr::kStatBytes / 4);
    const float* delta_s = lse_s + kBlockM;
    // keep(j, e): whether element (j, e) may be nonzero. Windows and causal rows: two copies, tiles
    // without a hidden element test none. Block-sparse: one copy on the thread's visibility bits
    // (all set in a full block), read from the mask once per tile (a copy per kind of tile made
    // ptxas spill; visible() per element issued 2.4x the dense tile's instructions).
    auto probabilities = [&](auto keep) {
#pragma unroll
      for (int j = 0; j < kNq; ++j) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse_s + j * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pe = exp2f(fmaf(st[0][j][e], p.scale_log2, -(e % 2 ? l2.y : l2.x)));
          st[0][j][e] = keep(j, e) ? pe : 0.f;
        }
      }
    };
    // dS^T = P^T (dP^T - delta) of the queries in 8-query groups [j0, j1); hidden elements 0 (their
    // dP^T may be made of hidden values).
    auto dscores = [&](auto keep, int j0, int j1) {
#pragma unroll
      for (int j = j0; j < j1; ++j) {
        const float2 d2 = *reinterpret_cast<const float2*>(delta_s + j * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float ds = st[0][j][e] * (dpt[0][j][e] - (e % 2 ? d2.y : d2.x));
          dpt[0][j][e] = keep(j, e) ? ds : 0.f;
        }
      }
    };
    auto all = [](int, int) { return true; };
    [[maybe_unused]] uint32_t vis = 0;
    [[maybe_unused]] bool masked = false;
    if constexpr (Tr::kVariant == Variant::kBlockSparse) {
      vis = tiles.visible_bits_t(cur, m0 + 2 * t, key_row);
      probabilities([&](int j, int e) { return ((vis >> (4 * j + e)) & 1u) != 0; });
    } else {
      masked = tiles.needs_mask(cur);
      if (masked)
        probabilities([&](int j, int e) {
          return tiles.visible(cur, m0 + j * 8 + 2 * t + e % 2, key_row + 8 * (e / 2));
        });
      else
        probabilities(all);
    }
    uint32_t pa[1][kNq / 2][4], dsa[1][kNq / 2][4];
    auto& pa_flat = reinterpret_cast<uint32_t (&)[kNq * 2]>(pa);
    auto& dsa_flat = reinterpret_cast<uint32_t (&)[kNq * 2]>(dsa);

    // dV += P^T dO (K = the tile's queries, B MN-major: 16 query rows = 2048 bytes) in kParts
    // commit groups, each part's P^T packed just before it, and the part's dS^T computed under
    // it (after the first part, dP^T waited for). With 128-row tiles the two parts keep P^T's
    // packed second half and the fp32 of the first apart (packed at once, with S^T and dP^T
    // live, they made ptxas spill and serialise the wgmmas).
    constexpr int kParts = Tr::kMTiles, kPartK = kBlockM / 16 / kParts;
    static_for<kParts>([&](auto c_) {
      constexpr int c = decltype(c_)::value;
#pragma unroll
      for (int kk = c * kPartK; kk < (c + 1) * kPartK; ++kk) {
        pa[0][kk][0] = pack2<Tr::kDtype>(st[0][2 * kk][0], st[0][2 * kk][1]);
        pa[0][kk][1] = pack2<Tr::kDtype>(st[0][2 * kk][2], st[0][2 * kk][3]);
        pa[0][kk][2] = pack2<Tr::kDtype>(st[0][2 * kk + 1][0], st[0][2 * kk + 1][1]);
        pa[0][kk][3] = pack2<Tr::kDtype>(st[0][2 * kk + 1][2], st[0][2 * kk + 1][3]);
      }
      wgmma_fence();
      static_for<kPartK>([&](auto k_) {
        constexpr int kk = c * kPartK + decltype(k_)::value;
        Wgmma<Tr::kDtype, kHeadDim>::rs(dv, pa[0][kk], do_mnmajor + stage_off + kk * (2048 >> 4));
      });
      wgmma_commit();
      if constexpr (c == 0) {
        wgmma_wait<1>();  // dP^T (dV runs on)
        fence_regs(dpt_flat);
      }
      constexpr int j0 = 2 * c * kPartK, j1 = 2 * (c + 1) * kPartK;
      if constexpr (Tr::kVariant == Variant::kBlockSparse) {
        // read again rather than held across dV (one register more made ptxas spill at D = 128)
        vis = tiles.visible_bits_t(cur, m0 + 2 * t, key_row);
        dscores([&](int j, int e) { return ((vis >> (4 * j + e)) & 1u) != 0; }, j0, j1);
      } else if (masked) {
        dscores([&](int j, int e) { return st[0][j][e] != 0.f; }, j0, j1);
      } else {
        dscores(all, j0, j1);
      }
    });
    pack_p<Tr::kDtype>(dpt, dsa);

    // dS (query, key) into shared memory, K-major for dQ: column block wg of this tile's buffer,
    // 16 keys per warp. The buffers alternate: the one written here was last read by the dQ of two
    // tiles ago, which both warpgroups waited for before the barrier that the previous tile's dQ
    // waited at.
    const uint32_t ds_buf = sDs + (n % 2) * Tr::kDsBytes;
    float dqa[Tr::kDqCols / 2];
    if constexpr (Tr::kDq) {
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        const int mi = lane / 8, q = kk * 16 + 8 * (mi / 2) + lane % 8, chunk = 2 * warp + mi % 2;
        stmatrix_x4_trans(ds_buf + wg * Tr::kDsColBytes + q * 128 + ((chunk ^ (q & 7)) * 16), dsa[0][kk]);
      }
      fence_proxy_async();
      named_barrier(1, 256);  // both halves of dS written

      // dQ (64 queries x kDqCols columns from kDqCols * wg; 128-row tiles: queries 64 wg .., every
      // column) = dS K over all 128 keys: one reduction per 64-row tile and column half (two per
      // tile of the accumulator would double its traffic).
      const uint64_t ds_desc = ds_kmajor + (n % 2) * (Tr::kDsBytes >> 4);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        Wgmma<Tr::kDtype, Tr::kDqCols>::ss_mn(dqa, ds_desc + (((kk / 4) * Tr::kDsColBytes + (kk % 4) * 32) >> 4),
                                              k_cols + kk * (2048 >> 4), kk > 0 ? 1 : 0);
      wgmma_commit();
    }

    // dK += dS^T Q.
    wgmma_fence();
    static_for<kBlockM / 16>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
      Wgmma<Tr::kDtype, kHeadDim>::rs(dk, dsa[0][kk], q_mnmajor + stage_off + kk * (2048 >> 4));
    });
    wgmma_commit();
    have = tiles.advance(cur);

    if constexpr (Tr::kDq) {
      wgmma_wait<1>();  // dV and dQ (dK runs on)
      fence_regs(dqa);
      // dQ added to the fp32 accumulator by vector reductions (red.global.add.v4.f32), which
      // hold each 64 x 64 tile in fragment order: float4 j of thread T at (j * 128 + T) * 16 bytes
      // (AttnBwdParams), so every warp's reduction covers 512 contiguous bytes. A warpgroup's
      // column half is the float4s from wg * kDqCols / 8. (Staging the tile in shared memory for
      // one TMA bulk reduction, a proxy fence and two barriers per tile, measured 6-8 % slower at
      // head dim 64 and no faster at 128.)
      const int m_tile = Tr::kMTiles == 2 ? 2 * m_block + wg : m_block;  // 64-row tile of the accumulator
      float* dst = bp.dq_accum + ((int64_t(b) * p.h + h) * (bp.lq_pad / 64) + m_tile) * 64 * kHeadDim +
                   (Tr::kMTiles == 2 ? 0 : wg * 64 * Tr::kDqCols) + tid * 4;
      if constexpr (Tr::kOrdered) mbar_wait(bar_go + 8 * (n % 2), (n / 2) & 1);  // this tile's turn
#pragma unroll
      for (int j = 0; j < Tr::kDqCols / 8; ++j)  // scale * dQ: the glue only reorders and casts
        red_add_f4(dst + j * 512, make_float4(dqa[4 * j] * p.scale, dqa[4 * j + 1] * p.scale,
                                              dqa[4 * j + 2] * p.scale, dqa[4 * j + 3] * p.scale));
      if constexpr (Tr::kOrdered) {  // the warp's reductions issued: the sequencer may release them
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_done + 8 * (n % 2));
      }
    }
    wgmma_wait<0>();  // dK: P^T and dS^T's registers, Q and dO of stage s are free
    fence_regs(dk);
    fence_regs(dv);
    fence_regs(pa_flat);
    fence_regs(dsa_flat);
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_empty + 8 * s);
  }

  // dK = scale * sum dS^T Q, dV = sum P^T dO.
  write_dk_dv<Tr::kDtype>(bp, b, hk, key_row, reinterpret_cast<const float (&)[kDTiles][4]>(dk),
                          reinterpret_cast<const float (&)[kDTiles][4]>(dv), t);
#else
  __trap();  // not built for sm_90a: the launcher never gets here
#endif
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

namespace cuda {
template <typename Tr>
cudaError_t launch_attn_bwd_sm90(const AttnBwdParams& params, cudaStream_t stream) {
  const AttnFwdParams& p = params.fwd;
  if (Tr::kVariant == Variant::kBlockSparse && p.kv_block != Tr::kBlockN) return cudaErrorInvalidValue;
  if (params.head_splits < 1 || (Tr::kDqMode != DqMode::kAtomic && params.head_splits != 1) ||
      p.h_per_kv % params.head_splits != 0 || (params.head_splits > 1 && params.dk_accum == nullptr))
    return cudaErrorInvalidValue;
  const int64_t units = int64_t(p.b) * p.h_kv * params.head_splits;  // (batch, kv head, split)
  if (units > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid((p.lk + Tr::kBlockN - 1) / Tr::kBlockN, unsigned(units));
  if (grid.x == 0 || grid.y == 0) return cudaSuccess;
  AttnBwdSm90Args args;
  args.bp = params;
  SA_CUDA_TRY(encode_bhld_tma(&args.tma_q, p.q, 2, p.d, p.lq, p.h, p.b, p.q_row_stride, p.q_head_stride,
                              p.q_batch_stride, Tr::kBlockM));
  SA_CUDA_TRY(encode_bhld_tma(&args.tma_do, params.dout, 2, p.dv, p.lq, p.h, p.b, params.do_row_stride,
                              params.do_head_stride, params.do_batch_stride, Tr::kBlockM));
  SA_CUDA_TRY(encode_bhld_tma(&args.tma_k, p.k, 2, p.d, p.lk, p.h_kv, p.b, p.k_row_stride, p.k_head_stride,
                              p.k_batch_stride, Tr::kBlockN));
  SA_CUDA_TRY(encode_bhld_tma(&args.tma_v, p.v, 2, p.dv, p.lk, p.h_kv, p.b, p.v_row_stride, p.v_head_stride,
                              p.v_batch_stride, Tr::kBlockN));
  auto kernel = attn_bwd_sm90_kernel<Tr>;
  SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  kernel<<<grid, Tr::kNThreads, Tr::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}
}  // namespace cuda

// The deterministic mode: dq_order (the dense family) orders the reductions, dq_separate (block-sparse
// masks) takes the instantiation without dQ.
template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_attn_bwd_sm90_(const AttnBwdParams& params, cudaStream_t stream) {
  using cuda::AttnBwdSm90Traits, cuda::DqMode;
  if constexpr (kVariant == Variant::kWindow) {
    if (params.dq_separate) return cudaErrorInvalidValue;
    if (params.dq_order != nullptr)
      return cuda::launch_attn_bwd_sm90<AttnBwdSm90Traits<kDtype, kHeadDim, kVariant, DqMode::kOrdered>>(params,
                                                                                                         stream);
  } else {
    if (params.dq_order != nullptr) return cudaErrorInvalidValue;
    if (params.dq_separate)
      return cuda::launch_attn_bwd_sm90<AttnBwdSm90Traits<kDtype, kHeadDim, kVariant, DqMode::kNone>>(params,
                                                                                                      stream);
  }
  return cuda::launch_attn_bwd_sm90<AttnBwdSm90Traits<kDtype, kHeadDim, kVariant, DqMode::kAtomic>>(params,
                                                                                                    stream);
}

}  // namespace sparse_attn
