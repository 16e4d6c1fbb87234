// The flash attention forward kernel on Hopper (sm_90a): the same main loop and key-tile
// iterators as flash_fwd.cuh, on the Hopper machinery.
//
// Persistent CTAs, one per SM, each running query tiles of kBlockM rows of one (batch, head) in
// turn. Warpgroup 0 is the producer and gives most of its registers to the consumers
// (setmaxnreg). In it, one thread is the scheduler: it takes the CTA's next tile (from a global
// atomic counter in tile_of_cta's heaviest-first order, or round-robin when there is none),
// decodes it (batch and head, query block, number of key tiles: for a block-sparse mask, global
// reads) and posts it to a kSchedSlots-entry ring in shared memory a tile ahead of the loader,
// so that neither the loads nor the GEMMs wait for that chain of reads at a tile boundary.
// Another thread is the loader: it issues TMA copies of Q (two buffers: a buffer is refilled as
// soon as its tile's last Q K^T is done, so the next tile's Q loads while the current tile runs)
// and of K and V tiles into a kStages-deep ring of shared-memory buffers, each buffer with a
// "full" mbarrier (TMA transaction bytes) and an "empty" one (one arrival per consumer warp).
// The other warpgroups are consumers, 64 query rows each: S = Q K^T as wgmma with both operands
// in shared memory, the online softmax in registers (flash_softmax.cuh), O += P V as
// wgmma with P from registers. Within a consumer the softmax of tile j overlaps the P V GEMM of
// tile j - 1; with two consumers, named barriers make them take turns issuing GEMMs (ping-pong),
// so one's softmax runs under the other's GEMMs. A tile's last P V is issued in the same turn as
// the next tile's first Q K^T; its output is staged in shared memory once that P V is done (after
// the next tile's row maxima) and stored by TMA.
//
// Shared memory is 128-byte swizzled (TMA writes it that way, wgmma reads it that way): a tile of
// R rows and D columns is D / 64 column blocks of R rows x 128 bytes, each 1024-byte aligned.
#pragma once

#include <cuda.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/flash_fwd.h"
#include "sparse_attn/cuda/flash_mask.cuh"
#include "sparse_attn/cuda/flash_softmax.cuh"
#include "sparse_attn/cuda/hidden_values.cuh"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/cuda/ptx_sm90.cuh"
#include "sparse_attn/cuda/tma.h"
#include "sparse_attn/cuda/wgmma.cuh"
#include "sparse_attn/tile_iter.h"

namespace sparse_attn::cuda {

// Kernel arguments: the family's params, the TMA descriptors of Q, K, V and O, and the plan's
// schedule and options.
struct FlashSm90Args {
  AttnFwdParams p;
  CUtensorMap tma_q, tma_k, tma_v, tma_o;  // tma_o: boxes of kStoreRows rows
  int merge_boundary;     // FlashPlan::merge_boundary (see the kernel)
  int32_t* tile_counter;  // zeroed before the launch (Schedule::kDynamic); nullptr: round-robin
  int4* hidden_records;   // AttnFwdParams::hidden_records
  // Always 1. Ping-pong (two consumers) and the lazy rescale (head dim 128) are on in every plan,
  // but as kernel arguments rather than compile-time constants: with constants ptxas schedules
  // the head dim 128 kernels 2-4 % slower (docs/PERF_LOG.md, "the plan layer").
  int pingpong, lazy_rescale;
};

// kBlockM_: 64 query rows per consumer warpgroup; kBlockN_: keys per tile (128 or 192). The
// launcher instantiates exactly the tiles of flash_fwd_sm90_tiles (plan.h).
template <ScalarKind kDtype_, int kHeadDim_, Variant kVariant, int kBlockM_, int kBlockN_>
struct FlashSm90Traits {
  static constexpr ScalarKind kDtype = kDtype_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kBlockSparse = kVariant != Variant::kWindow;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kConsumers = kBlockM / 64;  // consumer warpgroups
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = 2;
  static constexpr int kQStages = 2;     // Q buffers: the next tile's Q loads a whole tile ahead
  static constexpr int kSchedSlots = 4;  // decoded tiles posted ahead by the scheduler thread
  static constexpr int kNThreads = 128 * (kConsumers + 1);
  static constexpr int kNTiles = kBlockN / 8;   // n8 column tiles of S
  static constexpr int kDTiles = kHeadDim / 8;  // n8 column tiles of O
  static constexpr int kColBlocks = kHeadDim / 64;
  static constexpr int kQColBytes = kBlockM * 128;   // one 64-column block of Q
  static constexpr int kKVColBytes = kBlockN * 128;  // one 64-column block of a K or V tile
  static constexpr int kQBytes = kColBlocks * kQColBytes;
  static constexpr int kKVBytes = kColBlocks * kKVColBytes;
  // Skip O's rescale in tiles where no row of the warp moves its (lazily kept) max: a gain at head
  // dim 128; at 64, whose O is half as wide, the vote costs more than it saves (docs/PERF_LOG.md,
  // "lazy rescale").
  static constexpr bool kLazyRescale = kHeadDim >= 128;
  static constexpr int kBarriers =
      2 * kQStages + 4 * kStages + 2 * kSchedSlots + 1;  // Q, K/V, scheduler rings
  // Q ring, O staging, K and V rings (dynamic), within the 227 KB a block may opt into, less the
  // static barriers.
  static constexpr int kSmemBytes = 1024 + (kQStages + 1) * kQBytes + 2 * kStages * kKVBytes;
  static_assert(kSmemBytes + 8 * kBarriers + 64 <= 227 * 1024);
  // Registers per thread after reallocation: the producer keeps few (32: its tile loop does not
  // spill), the consumers take the rest.
  static constexpr int kProducerRegs = 32, kConsumerRegs = kConsumers == 2 ? 232 : 160;
  // Output rows per TMA store: each warp's 16 at head dim 64 (the epilogue then needs no
  // warpgroup barriers), the warpgroup's 64 at 128, where per-warp stores were slower
  // (docs/PERF_LOG.md, "per-warp output stores").
  static constexpr int kStoreRows = kHeadDim == 64 ? 16 : 64;
  // Block-sparse masks reach this kernel only with 128 x 128 blocks (plan_flash; the launcher
  // checks it): one list entry per key tile.
  using Tiles = typename TilesOf<kVariant, kBlockM, kBlockN, true>::type;
  static_assert(kBlockM % 64 == 0 && (kConsumers == 2 || kConsumers == 3) && kHeadDim % 64 == 0);
  // setmaxnreg moves registers within the CTA's launch allocation (ptxas gives the kernel the most
  // that __launch_bounds__(kNThreads, 1) allows): what the consumers take beyond it must not
  // exceed what the producer gives back, or setmaxnreg.inc waits forever.
  static constexpr int kEntryRegs = (65536 / kNThreads) & ~7;
  static_assert(128 * kProducerRegs + kConsumers * 128 * kConsumerRegs <= kNThreads * kEntryRegs);
};

// The rows noted in a consumer warp's list of hidden_records (head: its first record), computed
// again over exactly the keys they see (hidden_values.cuh) and written over the stored output.
// Out of line, so that the rare code stays out of the kernel's own register allocation (inline it
// measured the same at head dim 64: docs/PERF_LOG.md, "hidden values", variants 8a and 9).
template <typename Tr>
__device__ __noinline__ void fix_noted_rows(const AttnFwdParams& p, const int4* records, int head, int w) {
  constexpr int kConsumerWarps = 4 * Tr::kConsumers;
  const int num_m = (p.lq + Tr::kBlockM - 1) / Tr::kBlockM;
  for (int rec = head; rec >= 0;) {
    const int4 f = records[rec];  // written by this warp
    const int tile = rec / kConsumerWarps, fbh = tile / num_m, m_block = tile % num_m;
    const int fb = fbh / p.h, fh = fbh % p.h, row16 = m_block * Tr::kBlockM + w * 16;
    auto* o = static_cast<typename ElementOf<Tr::kDtype>::type*>(p.o) + fb * p.o_batch_stride + fh * p.o_head_stride;
    recompute_rows<Tr::kDtype, Tr::kHeadDim, Tr::kBlockN, typename Tr::Tiles>(
        p, fb, fh, m_block, row16, uint32_t(f.y), uint32_t(f.z), [&](int r, int col, uint32_t packed) {
          *reinterpret_cast<uint32_t*>(o + int64_t(row16 + r) * p.o_row_stride + col) = packed;
        });
    rec = f.x;
  }
}

template <typename Tr>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    flash_fwd_sm90_kernel(__grid_constant__ const FlashSm90Args args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStages = Tr::kStages, kNTiles = Tr::kNTiles,
                kDTiles = Tr::kDTiles;
  const AttnFwdParams& p = args.p;
  extern __shared__ char smem_raw[];
  const uint32_t sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sO = sQ + Tr::kQStages * Tr::kQBytes;  // output staging, same layout as Q
  const uint32_t sK = sO + Tr::kQBytes;                 // kStages K buffers
  const uint32_t sV = sK + kStages * Tr::kKVBytes;      // kStages V buffers
  // Barriers and the scheduler ring in static shared memory: their addresses are constants, not
  // registers the producer (kProducerRegs) would have to hold.
  __shared__ alignas(8) uint64_t barriers[Tr::kBarriers];
  // The scheduler ring: {tile id, batch * heads + head (-1: no tile), query block, key tiles}.
  __shared__ int4 sched[Tr::kSchedSlots];
  // Per consumer warp: the head of its list of outputs with rows to compute again (-1: none).
  __shared__ int fix_head[4 * Tr::kConsumers];
  const uint32_t bar_q_full = smem_u32(barriers), bar_q_empty = bar_q_full + 8 * Tr::kQStages;
  const uint32_t bar_k_full = bar_q_empty + 8 * Tr::kQStages, bar_k_empty = bar_k_full + 8 * kStages;
  const uint32_t bar_v_full = bar_k_empty + 8 * kStages, bar_v_empty = bar_v_full + 8 * kStages;
  const uint32_t bar_sched_full = bar_v_empty + 8 * kStages;
  const uint32_t bar_sched_empty = bar_sched_full + 8 * Tr::kSchedSlots;
  const uint32_t bar_sched_taken = bar_sched_empty + 8 * Tr::kSchedSlots;
  constexpr int kConsumerWarps = 4 * Tr::kConsumers;
  // Persistent: CTA c starts with tile c of tile_of_cta's order (heaviest first) and then takes
  // the next untaken one, so the producer loads the next tile's Q, K and V while the consumers
  // finish the current one. A tile id >= num_tiles ends the CTA.
  const int num_tiles = int(num_ctas<kBlockM>(p));  // <= INT_MAX (the launcher checks)

  if (threadIdx.x == 0) {
    for (int s = 0; s < Tr::kQStages; ++s) {
      mbar_init(bar_q_full + 8 * s, 1);
      mbar_init(bar_q_empty + 8 * s, kConsumerWarps);
    }
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_k_full + 8 * s, 1);
      mbar_init(bar_v_full + 8 * s, 1);
      mbar_init(bar_k_empty + 8 * s, kConsumerWarps);
      mbar_init(bar_v_empty + 8 * s, kConsumerWarps);
    }
    for (int s = 0; s < Tr::kSchedSlots; ++s) {
      mbar_init(bar_sched_full + 8 * s, 1);
      mbar_init(bar_sched_empty + 8 * s, kConsumerWarps + 1);  // and the loader
    }
    mbar_init(bar_sched_taken, 1);
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    // ---------------- producer ----------------
    setmaxnreg_dec<Tr::kProducerRegs>();
    if (threadIdx.x == 32) {
      // Scheduler: tile sn is claimed once the loader has taken tile sn - 1 (bar_sched_taken
      // completes a phase per tile taken), so a CTA holds no more tiles than it did when the
      // loader claimed them itself (claiming earlier costs the balance of the heaviest-first
      // order); the claim and the decode then overlap the loader's work on tile sn - 1. Slot
      // sn % kSchedSlots is reused once the loader and every consumer warp have read it.
      int tile = blockIdx.x;
      for (int sn = 0;; ++sn) {
        const int slot = sn % Tr::kSchedSlots;
        if (sn > 0) {
          mbar_wait_idle(bar_sched_taken, (sn - 1) & 1);
          // At most num_tiles + gridDim.x - 1 <= 2 * INT_MAX: min keeps it an int.
          tile = int(
              min64(int64_t(gridDim.x) + (args.tile_counter != nullptr ? atomicAdd(args.tile_counter, 1) : tile),
                    num_tiles));
        }
        int4 entry = make_int4(tile, -1, 0, 0);  // past the end, or not a tile
        int bh, m_block;
        if (tile < num_tiles && tile_of_cta<kBlockM>(p, tile, bh, m_block)) {
          const typename Tr::Tiles tiles(p, bh / p.h, bh % p.h, m_block);
          entry = make_int4(tile, bh, m_block, tiles.num_tiles());
        }
        mbar_wait_idle(bar_sched_empty + 8 * slot, ((sn / Tr::kSchedSlots) & 1) ^ 1);
        sched[slot] = entry;
        mbar_arrive(bar_sched_full + 8 * slot);
        if (tile >= num_tiles) break;
      }
    } else if (threadIdx.x == 0) {
      // Loader.
      tma_prefetch_desc(&args.tma_q);
      tma_prefetch_desc(&args.tma_k);
      tma_prefetch_desc(&args.tma_v);
      int kv = 0, qn = 0;  // K/V tiles and Q tiles loaded so far: ring positions and phases
      for (int sn = 0;; ++sn) {
        const int slot = sn % Tr::kSchedSlots;
        mbar_wait(bar_sched_full + 8 * slot, (sn / Tr::kSchedSlots) & 1);
        const int4 entry = sched[slot];
        mbar_arrive(bar_sched_empty + 8 * slot);
        mbar_arrive(bar_sched_taken);
        if (entry.x >= num_tiles) break;
        // No tile, or no key tiles: the consumers write zeros without waiting for anything.
        if (entry.y < 0 || entry.w == 0) continue;
        const int bh = entry.y, m_block = entry.z, n_tiles = entry.w;
        const int b = bh / p.h, h = bh % p.h, hk = h / p.h_per_kv;
        const typename Tr::Tiles tiles(p, b, h, m_block);
        const int qs = qn % Tr::kQStages;
        mbar_wait(bar_q_empty + 8 * qs, ((qn / Tr::kQStages) & 1) ^ 1);
        mbar_expect_tx(bar_q_full + 8 * qs, Tr::kQBytes);
#pragma unroll
        for (int c = 0; c < Tr::kColBlocks; ++c)
          tma_load_4d(sQ + qs * Tr::kQBytes + c * Tr::kQColBytes, &args.tma_q, bar_q_full + 8 * qs, c * 64,
                      m_block * kBlockM, h, b);
        ++qn;
        for (int it = 0; it < n_tiles; ++it, ++kv) {
          const int s = kv % kStages;
          const uint32_t phase = (kv / kStages) & 1;
          const int n0 = tiles.n_block(it) * kBlockN;
          // Ring slot s of K (then of V): wait until the consumers released it, then refill it.
          auto load = [&](uint32_t buf, const CUtensorMap* map, uint32_t full, uint32_t empty) {
            mbar_wait(empty + 8 * s, phase ^ 1);
            mbar_expect_tx(full + 8 * s, Tr::kKVBytes);
#pragma unroll
            for (int c = 0; c < Tr::kColBlocks; ++c)
              tma_load_4d(buf + s * Tr::kKVBytes + c * Tr::kKVColBytes, map, full + 8 * s, c * 64, n0, hk, b);
          };
          load(sK, &args.tma_k, bar_k_full, bar_k_empty);
          load(sV, &args.tma_v, bar_v_full, bar_v_empty);
        }
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<Tr::kConsumerRegs>();
  const int wg = threadIdx.x / 128 - 1;  // query rows wg * 64 .. wg * 64 + 63 of the tile
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  char* smem_o = smem_raw + (sO - smem_u32(smem_raw));
  int kv = 0, qn = 0;
  // Ping-pong (two consumers): warpgroup w issues its GEMMs after named barrier 5 + w, which the
  // other warpgroup arrives at after issuing its own, so the two take strict turns, across tile
  // boundaries too (one warpgroup's epilogue runs under the other's GEMMs). Warpgroup 1 arrives
  // once up front; warpgroup 0 consumes the one arrival left over at the end.
  const bool pingpong = Tr::kConsumers == 2 && args.pingpong != 0;
  // Lazy rescale (Tr::kLazyRescale): a row's running max moves only when a tile's max exceeds it
  // by more than kMaxStale (log2 units), so in most tiles no row of a warp changes its max and the
  // warp skips the rescale of O (64 multiplies per thread at head dim 128).
  const bool lazy = Tr::kLazyRescale && args.lazy_rescale != 0;
  const float max_stale = lazy ? kMaxStale : 0.f;
  if (pingpong && wg == 1) named_barrier_arrive(5, 256);
  // Hidden NaN / Inf values (hidden_values.cuh): the output is checked in the epilogue.
  constexpr bool kCheckHidden = sm90_fwd_checks_hidden_values(Tr::kHeadDim);
  if (kCheckHidden && lane == 0) fix_head[wg * 4 + warp] = -1;
  // Query tiles per (batch, head), for hidden_records' indices: evaluated in the rare branch, not
  // held in a register across the tile loop.
  auto num_m = [&]() {
    int lq = p.lq;
    asm volatile("" : "+r"(lq));  // not hoisted out of the rare branches
    return (lq + kBlockM - 1) / kBlockM;
  };

  // The accumulators outlive their tile: a tile's output is written after the next tile's first
  // Q K^T has been issued, under that GEMM (out_m0 < 0: nothing to write).
  float acc_o[1][kDTiles][4];
  float row_max[1][2], row_sum[1][2];
  auto& o_flat = reinterpret_cast<float (&)[kDTiles * 4]>(acc_o);
  int out_bh = 0, out_m0 = -1;  // (batch, head) and first row of the pending output

  // Epilogue: O / l into this warpgroup's rows of the staging buffer (128-byte swizzled, the
  // layout TMA reads), then one thread per kStoreRows rows (lane 0 of each warp, or thread 0 of
  // the warpgroup) stores them with TMA (rows past Lq and columns past Dv are clipped); LSE
  // directly. The staging rows are rewritten only after the previous store has read them (the
  // storing thread waits for its bulk group, then the others wait for it).
  constexpr bool kWarpStores = Tr::kStoreRows == 16;
  const bool storer = kWarpStores ? lane == 0 : tid == 0;
  const int store_row0 = kWarpStores ? wg * 64 + warp * 16 : wg * 64;  // row of the tile
  auto sync_store_rows = [&]() {
    if constexpr (kWarpStores) __syncwarp();
    else named_barrier(1 + wg, 128);
  };
  auto epilogue = [&]() {
    const int out_b = out_bh / p.h, out_h = out_bh % p.h;
    if (storer) bulk_wait_group<0, true>();
    sync_store_rows();
    [[maybe_unused]] uint32_t probe[2] = {0u, 0u};  // hidden_values.cuh
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float lse;
      const float inv = finish_row(row_max[0][half], row_sum[0][half], lse);
      const int r = wg * 64 + warp * 16 + g + half * 8;  // row of the tile
#pragma unroll
      for (int nd = 0; nd < kDTiles; ++nd) {
        const uint32_t packed = pack2<Tr::kDtype>(acc_o[0][nd][2 * half] * inv, acc_o[0][nd][2 * half + 1] * inv);
        *reinterpret_cast<uint32_t*>(smem_o + (nd / 8) * Tr::kQColBytes + r * 128 + (((nd % 8) ^ (r % 8)) * 16) +
                                     t * 4) = packed;
        if constexpr (kCheckHidden) probe[half] = probe_nonfinite<Tr::kDtype>(probe[half], packed);
      }
      if (t == 0 && out_m0 + r < p.lq) p.lse[(int64_t(out_b) * p.h + out_h) * p.lq + out_m0 + r] = lse;
    }
    // Rows whose output is not finite: noted in this warp's list (a record per query tile and
    // warp), computed again after the last tile (fix_noted_rows). Computing them here, under the
    // next tile's Q K^T, or anywhere in the tile loop cost 5-15 % (the code's registers; ptxas
    // serialised the head dim 64 kernels' wgmmas): docs/PERF_LOG.md, "hidden values".
    if constexpr (kCheckHidden) {
      const uint32_t bad0 = __ballot_sync(0xffffffffu, probe_hit(probe[0]));
      const uint32_t bad1 = __ballot_sync(0xffffffffu, probe_hit(probe[1]));
      if constexpr (Tr::kHeadDim == 128) {
        // Branch on the warp-uniform ballots alone; every lane writes the same record and head
        // (the head read by all lanes before any writes it). A lane == 0 branch on a ballot here
        // made ptxas treat the window kernel's consumer loop as possibly divergent: its tile
        // bookkeeping left the uniform datapath and WARPSYNC / BRA.DIV / BSSY came into the loop
        // (6-13 % slower). In the dense kernel the warp's index is derived here, behind an empty
        // asm: wg * 4 + warp reordered its loop's softmax. Head dim 64 keeps the lane == 0 branch
        // (measured free there; this form timed 4-6 % slower on its causal kernel, near the
        // method's noise): docs/PERF_LOG.md, "hidden values at head dim 128".
        if ((bad0 | bad1) != 0u) {
          int w = wg * 4 + warp;
          if constexpr (!Tr::kBlockSparse) {
            int tx = threadIdx.x;
            asm volatile("" : "+r"(tx));
            w = tx / 32 - 4;  // = wg * 4 + warp
          }
          const int rec = (out_bh * num_m() + out_m0 / kBlockM) * kConsumerWarps + w;
          const int prev = fix_head[w];
          __syncwarp();
          args.hidden_records[rec] = make_int4(prev, int(bad0), int(bad1), 0);
          fix_head[w] = rec;
        }
      } else if ((bad0 | bad1) != 0u && lane == 0) {
        const int w = wg * 4 + warp, rec = (out_bh * num_m() + out_m0 / kBlockM) * kConsumerWarps + w;
        args.hidden_records[rec] = make_int4(fix_head[w], int(bad0), int(bad1), 0);
        fix_head[w] = rec;
      }
    }
    fence_proxy_async();
    sync_store_rows();
    if (storer) {
#pragma unroll
      for (int c = 0; c < Tr::kColBlocks; ++c)
        tma_store_4d(&args.tma_o, sO + c * Tr::kQColBytes + store_row0 * 128, c * 64, out_m0 + store_row0, out_h,
                     out_b);
      bulk_commit_group();
    }
  };
  // The pending output, if any, then fresh accumulators for the tile just started.
  auto flush_and_start = [&]() {
    if (out_m0 >= 0) epilogue();
    softmax_start(acc_o, row_max, row_sum);
  };

  float sc[1][kNTiles][4];
  auto& s_flat = reinterpret_cast<float (&)[kNTiles * 4]>(sc);
  uint32_t pa[1][kBlockN / 16][4];
  auto& pa_flat = reinterpret_cast<uint32_t (&)[kBlockN / 4]>(pa);

  // O += P V of key tile kv + it: kBlockN / 16 wgmmas of K = 16 keys; V is MN-major (head dim
  // contiguous): 16 keys are 16 rows (2048 bytes) of every column block, column blocks
  // kKVColBytes apart. it = -1: the previous tile's last (kv has moved past it).
  auto issue_pv = [&](int it) {
    const int s = (kv + it) % kStages;
    mbar_wait(bar_v_full + 8 * s, ((kv + it) / kStages) & 1);
    wgmma_fence();
    static_for<kBlockN / 16>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
      const uint64_t db = sw128_desc(sV + s * Tr::kKVBytes + kk * 2048, Tr::kKVColBytes, 1024);
      Wgmma<Tr::kDtype, Tr::kHeadDim>::rs(o_flat, pa[0][kk], db);
    });
    wgmma_commit();
  };
  auto release = [&](uint32_t bar, int it) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar + 8 * ((kv + it) % kStages));
  };
  auto turn_begin = [&]() {
    if (pingpong) named_barrier(5 + wg, 256);
  };
  auto turn_end = [&]() {
    if (pingpong) named_barrier_arrive(5 + (1 - wg), 256);
  };
  // After the P V GEMM of key tile kv + it has been waited for: O and P are free again.
  auto pv_retired = [&](int it) {
    fence_regs(o_flat);
    fence_regs(pa_flat);
    release(bar_v_empty, it);
  };
  // Merged tile boundary (args.merge_boundary): a tile's last P V is issued in the same turn as the
  // next tile's first Q K^T instead of in a turn of its own, so a tile of n key tiles costs each
  // consumer n turns, not n + 1, and the tensor cores get no half-size turns at the boundary
  // (the epilogue then runs after the next tile's row maxima, under the other consumer's turn).
  // It pays where tiles are short; plan_flash decides where (docs/PERF_LOG.md, "merged tile
  // boundary"). Two consumers only: the three-consumer kernel (160 registers) spilled with it, and
  // has no turns to merge.
  // pv_pending: the previous tile's last P V is not issued yet.
  const bool merge = Tr::kConsumers == 2 && args.merge_boundary != 0;
  bool pv_pending = false;
  auto retire_pending_alone = [&]() {
    turn_begin();
    issue_pv(-1);
    turn_end();
    wgmma_wait<0>();
    pv_retired(-1);
    pv_pending = false;
  };

  for (int sn = 0;; ++sn) {
    const int slot = sn % Tr::kSchedSlots;
    mbar_wait(bar_sched_full + 8 * slot, (sn / Tr::kSchedSlots) & 1);
    // Every lane reads the slot, then lane 0 releases it.
    const int4 entry = sched[slot];
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_sched_empty + 8 * slot);
    if (entry.x >= num_tiles) break;
    if (entry.y < 0) continue;
    const int bh = entry.y, m_block = entry.z, n_tiles = entry.w;
    const int b = bh / p.h, h = bh % p.h;
    const int m0 = m_block * kBlockM;
    const typename Tr::Tiles tiles(p, b, h, m_block);   // n_tiles: the scheduler's count
    const int row_base = m0 + wg * 64 + warp * 16 + g;  // rows row_base and row_base + 8
    const int qs = qn % Tr::kQStages;
    // This warpgroup's 64 rows of Q buffer qs, within each column block.
    const uint32_t q_rows = sQ + qs * Tr::kQBytes + wg * 64 * 128;

    // S = Q K^T of tile it: kHeadDim / 16 wgmmas of K = 16, both operands K-major. Within a
    // 128-byte swizzle row a K step of 16 elements is +32 bytes of start address. Committed as
    // one group, not waited for.
    auto issue_qk = [&](int it) {
      const int s = (kv + it) % kStages;
      mbar_wait(bar_k_full + 8 * s, ((kv + it) / kStages) & 1);
      wgmma_fence();
      static_for<Tr::kHeadDim / 16>([&](auto kk_) {
        constexpr int kk = decltype(kk_)::value;
        constexpr uint32_t off = (kk % 4) * 32;
        const uint64_t da = sw128_desc(q_rows + (kk / 4) * Tr::kQColBytes + off, 16, 1024);
        const uint64_t db = sw128_desc(sK + s * Tr::kKVBytes + (kk / 4) * Tr::kKVColBytes + off, 16, 1024);
        Wgmma<Tr::kDtype, kBlockN>::ss(s_flat, da, db, kk > 0 ? 1 : 0);
      });
      wgmma_commit();
    };
    // Whether a key tile needs masking, and its mask. A block-sparse mask is global memory: tile
    // it's list entry is read after the turn that issues the Q K^T of tile it - 1 (under that
    // GEMM; the first tile's when the tile starts), its mask words after the turn that issues its
    // own Q K^T, so that neither read waits after S (TileMask), and the bookkeeping stays out of
    // the softmax between S and the next turn. The window variant's masks are arithmetic.
    TileMask<kBlockN> tm;
    auto mask_entry = [&](int it) {
      if constexpr (Tr::kBlockSparse)
        if (it < n_tiles) tiles.entry_of(it, tm.kb, tm.pid);
    };
    auto mask_load = [&](int it) {
      if constexpr (Tr::kBlockSparse)
        if (it < n_tiles) load_tile_mask(tm, tiles, it, row_base);
    };
    auto mask_needed = [&](int it) {
      if constexpr (Tr::kBlockSparse) return tm.need;
      else return tiles.tile_needs_mask(it);
    };
    auto apply_mask = [&](int it, bool need_mask) {
      if constexpr (Tr::kBlockSparse) apply_tile_mask(sc, tm, t);
      else mask_scores<kBlockN>(sc, tiles, it, row_base, t, need_mask);
    };
    // Q buffer qs may be refilled once every warp's last Q K^T of this tile is done.
    auto release_q = [&]() {
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_q_empty + 8 * qs);
    };

    if (n_tiles > 0) {
      mask_entry(0);
      mbar_wait(bar_q_full + 8 * qs, (qn / Tr::kQStages) & 1);
      // The first tile's softmax, against a fresh running max (O is still zero: no rescale).
      // Whether S needs masking, and a block-sparse mask's words, are read before the wait, so
      // that global reads overlap the GEMM instead of following it. The two cases are separate
      // branches, not one with tests of pv_pending inside: ptxas follows each path through such
      // tests on its own, and on the path that pairs "P V issued" with "not waited for" it sees
      // O's registers written under an in-flight wgmma and serialises every wgmma of the kernel
      // (C7515).
      float m_new[1][2], alpha[1][2];
      const float fresh_max[1][2] = {{-INFINITY, -INFINITY}};
      // Once S is ready: free its K buffer (and Q after a single key tile), mask, row maxima.
      auto first_tile_max = [&](bool need_mask) {
        fence_regs(s_flat);
        release(bar_k_empty, 0);
        if (n_tiles == 1) release_q();
        apply_mask(0, need_mask);
        softmax_fold_max(sc, fresh_max, m_new, p.scale_log2, max_stale);
      };
      if (pv_pending) {
        turn_begin();
        issue_qk(0);
        issue_pv(-1);  // the previous tile's last, behind this Q K^T
        turn_end();
        mask_load(0);
        mask_entry(1);
        const bool need_mask = mask_needed(0);
        wgmma_wait<1>();
        first_tile_max(need_mask);
        wgmma_wait<0>();
        pv_retired(-1);
        pv_pending = false;
        flush_and_start();  // the previous tile's output, then fresh accumulators
      } else {
        turn_begin();
        issue_qk(0);
        turn_end();
        mask_load(0);
        mask_entry(1);
        const bool need_mask = mask_needed(0);
        flush_and_start();  // the previous tile's output, under this Q K^T
        wgmma_wait<0>();
        first_tile_max(need_mask);
      }
      softmax_fold_exp<Tr::kDtype>(sc, m_new, row_max, row_sum, alpha, pa, p.scale_log2);
    } else {
      if (pv_pending) retire_pending_alone();
      flush_and_start();  // this tile's output is zeros (LSE -inf)
    }
    // Steady state: the GEMMs of S(it) and of O += P(it - 1) V(it - 1) are in flight together;
    // the softmax of S(it) starts while the tensor cores finish the second. The scale is folded
    // into the exponent (one FFMA per score, the guarded fast path of flash_softmax.cuh; with the
    // lazy rescale, docs/PERF_LOG.md "folded scale").
    for (int it = 1; it < n_tiles; ++it) {
      turn_begin();
      issue_qk(it);
      issue_pv(it - 1);
      turn_end();
      mask_load(it);
      mask_entry(it + 1);
      const bool need_mask = mask_needed(it);
      wgmma_wait<1>();
      fence_regs(s_flat);
      release(bar_k_empty, it);
      if (it == n_tiles - 1) release_q();
      float m_new[1][2], alpha[1][2];
      apply_mask(it, need_mask);
      softmax_fold_max(sc, row_max, m_new, p.scale_log2, max_stale);
      wgmma_wait<0>();  // P V of it - 1, which reads pa
      pv_retired(it - 1);
      softmax_fold_exp<Tr::kDtype>(sc, m_new, row_max, row_sum, alpha, pa, p.scale_log2);
      if (!lazy || rescale_needed(alpha)) rescale_o(acc_o, alpha);
    }
    if (n_tiles > 0) {
      kv += n_tiles;
      ++qn;
      pv_pending = true;
      if (!merge) retire_pending_alone();
    }
    out_bh = bh;
    out_m0 = m0;
  }
  if (pv_pending) retire_pending_alone();
  if (out_m0 >= 0) epilogue();
  if (storer) bulk_wait_group<0, false>();         // the staging buffer lives until the stores finish
  // The noted rows (epilogue), over the outputs the TMA stores have written. With warpgroup
  // stores the barrier orders the storer's wait before every warp's writes.
  if constexpr (kCheckHidden) {
    if (storer) fence_proxy_async_global();
    sync_store_rows();
    if (fix_head[wg * 4 + warp] >= 0) fix_noted_rows<Tr>(p, args.hidden_records, fix_head[wg * 4 + warp], wg * 4 + warp);
  }
  if (pingpong && wg == 0) named_barrier(5, 256);  // warpgroup 1's last arrival
#else
  __trap();  // not built for sm_90a: the launcher never gets here
#endif
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

namespace cuda {

template <typename Tr>
cudaError_t launch_flash_fwd_sm90(const AttnFwdParams& params, const FlashPlan& plan, cudaStream_t stream) {
  const int64_t tiles = num_ctas<Tr::kBlockM>(params);
  if (tiles == 0) return cudaSuccess;
  if (tiles > INT_MAX) return cudaErrorInvalidConfiguration;
  // Record indices of hidden_records fit an int.
  if (int64_t(params.b) * params.h * ((params.lq + Tr::kBlockM - 1) / Tr::kBlockM) * 4 * Tr::kConsumers > INT_MAX)
    return cudaErrorInvalidConfiguration;
  // Block-sparse: the kernel's iterator takes mask blocks to be its tiles.
  if (Tr::kBlockSparse && (params.q_block != Tr::kBlockM || params.kv_block != Tr::kBlockN))
    return cudaErrorInvalidValue;
  const bool dynamic = plan.schedule == Schedule::kDynamic;
  if (dynamic && params.tile_counter == nullptr) return cudaErrorInvalidValue;
  if (sm90_fwd_checks_hidden_values(Tr::kHeadDim) &&
      (params.hidden_records == nullptr || reinterpret_cast<uintptr_t>(params.hidden_records) % 16 != 0))
    return cudaErrorInvalidValue;
  FlashSm90Args args;
  args.p = params;
  args.tile_counter = dynamic ? params.tile_counter : nullptr;
  args.hidden_records = reinterpret_cast<int4*>(params.hidden_records);
  args.merge_boundary = plan.merge_boundary;
  args.pingpong = 1;
  args.lazy_rescale = 1;
  // Persistent CTAs, one per SM, or one CTA per tile.
  const int grid = plan.schedule == Schedule::kPerTile ? int(tiles) : int(min64(tiles, plan.persistent_ctas));
  const int elem = 2;
  SA_CUDA_TRY(encode_bhld_tma(&args.tma_q, params.q, elem, params.d, params.lq, params.h, params.b,
                              params.q_row_stride, params.q_head_stride, params.q_batch_stride, Tr::kBlockM));
  SA_CUDA_TRY(encode_bhld_tma(&args.tma_k, params.k, elem, params.d, params.lk, params.h_kv, params.b,
                              params.k_row_stride, params.k_head_stride, params.k_batch_stride, Tr::kBlockN));
  SA_CUDA_TRY(encode_bhld_tma(&args.tma_v, params.v, elem, params.dv, params.lk, params.h_kv, params.b,
                              params.v_row_stride, params.v_head_stride, params.v_batch_stride, Tr::kBlockN));
  SA_CUDA_TRY(encode_bhld_tma(&args.tma_o, params.o, elem, params.dv, params.lq, params.h, params.b,
                              params.o_row_stride, params.o_head_stride, params.o_batch_stride, Tr::kStoreRows));
  auto kernel = flash_fwd_sm90_kernel<Tr>;
  SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  kernel<<<grid, Tr::kNThreads, Tr::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// The plan's tile, found in flash_fwd_sm90_tiles(kHeadDim, kVariant) from entry kIndex on.
template <ScalarKind kDtype, int kHeadDim, Variant kVariant, int kIndex>
cudaError_t launch_planned_sm90_tile(const AttnFwdParams& params, const FlashPlan& plan, cudaStream_t stream) {
  constexpr FlashTileSet kSet = flash_fwd_sm90_tiles(kHeadDim, kVariant);
  if constexpr (kIndex >= kSet.count) {
    return cudaErrorInvalidValue;  // the plan named a tile the table does not hold
  } else {
    constexpr FlashTile kTile = kSet.tiles[kIndex];
    if (plan.tile.block_m == kTile.block_m && plan.tile.block_n == kTile.block_n)
      return launch_flash_fwd_sm90<FlashSm90Traits<kDtype, kHeadDim, kVariant, kTile.block_m, kTile.block_n>>(
          params, plan, stream);
    return launch_planned_sm90_tile<kDtype, kHeadDim, kVariant, kIndex + 1>(params, plan, stream);
  }
}

}  // namespace cuda

template <ScalarKind kDtype, int kHeadDim, Variant kVariant>
cudaError_t run_flash_fwd_sm90_(const AttnFwdParams& params, const FlashPlan& plan, cudaStream_t stream) {
  return cuda::launch_planned_sm90_tile<kDtype, kHeadDim, kVariant, 0>(params, plan, stream);
}

}  // namespace sparse_attn
