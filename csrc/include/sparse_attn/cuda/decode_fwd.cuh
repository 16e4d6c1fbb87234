// KV-cache decode (attention_with_kvcache): a few new query tokens against a long cache, which
// the kernel reads once, at the memory system's speed.
//
// Per CTA: one (batch, K/V head, row chunk, split). The query rows are the H / Hkv heads of the
// group times the Lq new tokens, so every K/V row loaded serves all of them (GQA packing); they
// sit in registers for the whole loop. K and V tiles of 64 keys stream through a ring of
// cp.async stages (decode_stages), addressed row by row through the page table. The four warps
// split each key tile (4, 2 or 1 ways, by how many m16 row tiles there are); each keeps its own
// online softmax, and the warps' states merge through shared memory at the end. With
// num_splits > 1 (split-KV) a CTA covers a contiguous share of the sequence's key tiles and
// writes its normalised O and LSE in fp32; decode_combine_kernel merges the splits. With fewer
// CTAs than pieces (balanced split-KV, the plan's choice where one CTA per piece would load the
// SMs unevenly) each CTA walks an equal run of consecutive pieces, across (batch, K/V head) units.
//
// Lengths are read on the device (cache_seqlens), so nothing here waits for the host and one
// launch replays in a CUDA graph with new lengths and page tables.
#pragma once

#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/decode.h"
#include "sparse_attn/cuda/element.cuh"
#include "sparse_attn/cuda/flash_softmax.cuh"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/cuda/smem_tile.cuh"

namespace sparse_attn::cuda {

constexpr int kDecodeCombineThreads = 128;

template <ScalarKind kDtype_, int kHeadDim_, int kRowTiles_>
struct DecodeTraits {
  static constexpr ScalarKind kDtype = kDtype_;
  using Element = typename ElementOf<kDtype>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRowTiles = kRowTiles_;  // m16 query-row tiles per CTA
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kKeyGroups = kNWarps / kRowTiles;  // warps sharing a row tile, each a key slice
  static constexpr int kBlockN = kDecodeBlockN;
  static constexpr int kWarpKeys = kBlockN / kKeyGroups;
  static constexpr int kNTiles = kWarpKeys / 8;          // n8 tiles of a warp's S
  static constexpr int kDTiles = kHeadDim / 8;           // n8 tiles of O
  static constexpr int kChunks = kHeadDim / 8;           // 16-byte chunks per shared-memory row
  static constexpr int kRowStep = kNThreads / kChunks;   // rows between one thread's tile copies
  static constexpr int kLoadRows = kBlockN / kRowStep;   // rows of a tile one thread copies
  static constexpr int kWarpRowsPerStep = 32 / kChunks;  // rows a warp copies per step
  static constexpr int kRows = 16 * kRowTiles;
  static constexpr int kStages = decode_stages(kHeadDim);
  static constexpr int kTileBytes = kBlockN * kHeadDim * 2;  // one K or V tile
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kSmemBytes = decode_smem_bytes(kHeadDim);
  // The epilogue's merge of the key groups: per warp and lane, O's fragments, m and l of 2 rows.
  static constexpr int kMergeFields = kDTiles * 4 + 4;
  static_assert(kSmemBytes == kStages * kStageBytes && kStages >= 2);
  static_assert(kRows * kHeadDim * 2 <= kStageBytes, "Q is staged in the last stage's slot");
  static_assert(kNWarps * 32 * kMergeFields * 4 <= kSmemBytes);
  static_assert(kNTiles % 2 == 0 && kChunks % 8 == 0 && kNThreads % kChunks == 0 && kChunks <= 32);
  static_assert(kWarpRowsPerStep * kLoadRows == 16, "a warp copies 16 rows of a tile, one per lane pair");
};

// Keys of one sequence: [0, len) hold keys; the rows of this call see at most [lo, hi); the
// CTA's key tiles are entries [0, n_entries) of a list: consecutive tiles from lo, or the tiles of
// the mask's listed blocks.
struct DecodeSeq {
  int len, off, lo, hi, n_entries;
  const int32_t* blocks;  // the mask's block list, or nullptr
  int per_block;          // key tiles per mask block

  __device__ __forceinline__ int tile(int e) const {
    return blocks != nullptr ? blocks[e / per_block] * per_block + e % per_block : lo / kDecodeBlockN + e;
  }
};

__device__ __forceinline__ int decode_seqlen(const DecodeParams& p, int b) {
  return min(max(p.cache_seqlens[b], 0), p.capacity);
}

__device__ __forceinline__ DecodeSeq decode_seq(const DecodeParams& p, int b, int hkv) {
  DecodeSeq s;
  const int seqlen = decode_seqlen(p, b);
  s.len = min(seqlen + p.lk_new, p.capacity);
  s.off = seqlen + p.lk_new - p.lq;
  s.lo = p.window_left >= 0 ? max(s.off - p.window_left, 0) : 0;
  s.hi = p.window_right >= 0 ? min(s.len, s.off + p.lq + p.window_right) : s.len;
  s.blocks = nullptr;
  s.per_block = 1;
  if (p.kv_indices != nullptr) {
    const int64_t mh = int64_t(b) * p.bs_batch_stride + int64_t(hkv) * p.bs_head_stride;
    s.blocks = p.kv_indices + mh * p.max_kv_blocks;
    s.per_block = p.kv_block / kDecodeBlockN;
    s.n_entries = min(max(p.kv_num_blocks[mh], 0), p.max_kv_blocks) * s.per_block;
  } else {
    s.n_entries = s.hi > s.lo ? (s.hi + kDecodeBlockN - 1) / kDecodeBlockN - s.lo / kDecodeBlockN : 0;
  }
  return s;
}

// Rows of a key tile: a warp copies 16 of them (kWarpRowsPerStep per step, kLoadRows steps); lane
// l < 16 (and l + 16) locates row l of those, so each row's page lookup and address arithmetic is
// done once per warp instead of by each of the kChunks threads that copy a piece of it, and the
// copying threads take the row's offsets by shuffle.
template <typename Tr>
__device__ __forceinline__ int decode_owned_row(int warp, int lane) {
  const int l = lane % 16;
  return warp * Tr::kWarpRowsPerStep + l % Tr::kWarpRowsPerStep + (l / Tr::kWarpRowsPerStep) * Tr::kRowStep;
}

// The page of this lane's row of key tile `tile` (-1: a key outside [key_lo, key_hi), zero-filled).
// Contiguous caches: the sequence itself. Paged caches: a block-table read, issued a tile ahead of
// its use (decode_load_tile checks the value), so its latency hides behind a tile of compute.
template <typename Tr>
__device__ __forceinline__ int decode_fetch_page(const DecodeParams& p, int b, int tile, int key_lo,
                                                 int key_hi, int warp, int lane) {
  const int tok = tile * Tr::kBlockN + decode_owned_row<Tr>(warp, lane);
  if (tok < key_lo || tok >= key_hi) return -1;
  if (p.block_table == nullptr) return b;
  return p.block_table[int64_t(b) * p.bt_batch_stride + tok / p.page_size];
}

// One 64-key tile of K and V into a stage, the rows' pages from decode_fetch_page. Rows of no
// page or of a page outside the cache (and head-dim columns past D) are zero-filled without a
// read, so neither uninitialised cache memory nor a bad block table reaches a sum.
template <typename Tr>
__device__ __forceinline__ void decode_load_tile(const DecodeParams& p, uint32_t sk, int hkv, int tile,
                                                 int page, int tid) {
  using Element = typename Tr::Element;
  const int warp = tid / 32, lane = tid % 32;
  const int c = tid % Tr::kChunks;
  const Element* kc = static_cast<const Element*>(p.k_cache) + hkv * p.k_head_stride + c * 8;
  const Element* vc = static_cast<const Element*>(p.v_cache) + hkv * p.v_head_stride + c * 8;
  // This lane's row: its offsets in the caches, -1 where nothing is read.
  const int tok = tile * Tr::kBlockN + decode_owned_row<Tr>(warp, lane);
  const bool mine_ok = unsigned(page) < unsigned(p.num_pages);
  const int slot = p.block_table == nullptr ? tok : tok % p.page_size;
  const int64_t k_mine = mine_ok ? int64_t(page) * p.k_page_stride + int64_t(slot) * p.k_row_stride : -1;
  const int64_t v_mine = mine_ok ? int64_t(page) * p.v_page_stride + int64_t(slot) * p.v_row_stride : -1;
  const bool col_ok = c * 8 < p.d;
#pragma unroll
  for (int i = 0; i < Tr::kLoadRows; ++i) {
    const int src = i * Tr::kWarpRowsPerStep + lane / Tr::kChunks;
    const int64_t ko = __shfl_sync(0xffffffffu, k_mine, src);
    const int64_t vo = __shfl_sync(0xffffffffu, v_mine, src);
    const bool ok = col_ok && ko >= 0;
    const uint32_t dst = sk + swz<Tr::kChunks>(tid / Tr::kChunks + i * Tr::kRowStep, c);
    cp_async_16(dst, ok ? kc + ko : kc, ok ? 16 : 0);
    cp_async_16(dst + Tr::kTileBytes, ok ? vc + vo : vc, ok ? 16 : 0);
  }
}

// One segment of a CTA's work: pieces [j0, j1) of unit (b, row chunk, K/V head), i.e. its key
// entries [n * j0 / S, n * j1 / S) of n (S = num_splits), into the output (S = 1) or into the
// split partials' slot j0. `last`: the CTA's last segment (it lets the combine be scheduled).
template <typename Tr>
__device__ __forceinline__ void decode_segment(const DecodeParams& p, char* smem, int b, int hkv, int chunk,
                                               int j0, int j1, bool last) {
  using Element = typename Tr::Element;
  constexpr int kChunks = Tr::kChunks, kNTiles = Tr::kNTiles, kDTiles = Tr::kDTiles, kStages = Tr::kStages;
  constexpr uint32_t kRow16 = 16 * kChunks * 16;  // bytes of 16 shared-memory rows
  const uint32_t s0 = smem_u32(smem);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int rt = warp % Tr::kRowTiles, kg = warp / Tr::kRowTiles;
  const int rows = p.h_per_kv * p.lq;  // query rows of the group: head-major, then token

  // Q of the chunk's rows into the last stage's slot (the loop first overwrites it at it = 0).
  {
    const uint32_t sq = s0 + (kStages - 1) * Tr::kStageBytes;
    const int c = tid % kChunks;
    for (int r = tid / kChunks; r < Tr::kRows; r += Tr::kNThreads / kChunks) {
      const int row = chunk * Tr::kRows + r;
      const bool ok = row < rows && c * 8 < p.d;
      const int hh = hkv * p.h_per_kv + (ok ? row / p.lq : 0), i = ok ? row % p.lq : 0;
      const Element* src = static_cast<const Element*>(p.q) + b * p.q_batch_stride + hh * p.q_head_stride +
                           int64_t(i) * p.q_row_stride + c * 8;
      cp_async_16(sq + swz<kChunks>(r, c), src, ok ? 16 : 0);
    }
  }
  // The lengths (and the mask's list) after Q's copy is under way: their reads start the chain of
  // dependent loads before the first K/V copy, so nothing else waits behind them.
  const DecodeSeq seq = decode_seq(p, b, hkv);
  const int e_begin = int(int64_t(seq.n_entries) * j0 / p.num_splits);
  const int n_it = int(int64_t(seq.n_entries) * j1 / p.num_splits) - e_begin;
  int page = -1;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n_it) {
      const int tile = seq.tile(e_begin + st);
      page = decode_fetch_page<Tr>(p, b, tile, seq.lo, seq.hi, warp, lane);
      decode_load_tile<Tr>(p, s0 + st * Tr::kStageBytes, hkv, tile, page, tid);
    }
    cp_async_commit();
  }
  if (kStages - 1 < n_it)
    page = decode_fetch_page<Tr>(p, b, seq.tile(e_begin + kStages - 1), seq.lo, seq.hi, warp, lane);

  // This thread's rows (g and g + 8 of the warp's row tile): the keys each may see.
  int row_lo[2], row_hi[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = chunk * Tr::kRows + rt * 16 + g + 8 * half;
    const int i = row < rows ? row % p.lq : 0;
    row_lo[half] = p.window_left >= 0 ? max(seq.off + i - p.window_left, 0) : 0;
    row_hi[half] = p.window_right >= 0 ? min(seq.off + i + p.window_right, seq.len - 1) : seq.len - 1;
  }

  const int r8 = lane % 8;
  uint32_t qf[Tr::kHeadDim / 16][4];
  cp_async_wait<kStages - 2>();
  __syncthreads();
  {
    const uint32_t qb =
        s0 + (kStages - 1) * Tr::kStageBytes + swz<kChunks>(rt * 16 + ((lane / 8) % 2) * 8 + r8, lane / 16);
    static_for<Tr::kHeadDim / 16>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
      ldmatrix_x4(qf[kk], swz_step<kk>(qb));
    });
  }
  const uint32_t k_off = swz<kChunks>(kg * Tr::kWarpKeys + (lane / 16) * 8 + r8, (lane / 8) % 2);
  const uint32_t v_off =
      Tr::kTileBytes + swz<kChunks>(kg * Tr::kWarpKeys + ((lane / 8) % 2) * 8 + r8, lane / 16);

  float acc_o[1][kDTiles][4];
  float row_max[1][2], row_sum[1][2];
  softmax_start(acc_o, row_max, row_sum);

  for (int it = 0; it < n_it; ++it) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile it landed; every warp is done with the slot refilled below
    if (it + kStages - 1 < n_it) {
      decode_load_tile<Tr>(p, s0 + ((it + kStages - 1) % kStages) * Tr::kStageBytes, hkv,
                           seq.tile(e_begin + it + kStages - 1), page, tid);
      if (it + kStages < n_it)
        page = decode_fetch_page<Tr>(p, b, seq.tile(e_begin + it + kStages), seq.lo, seq.hi, warp, lane);
    }
    cp_async_commit();

    const uint32_t stage = s0 + (it % kStages) * Tr::kStageBytes;
    float s[1][kNTiles][4];
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][ni][e] = 0.f;
    {
      const uint32_t kb = opaque(stage + k_off);
      static_for<Tr::kHeadDim / 16>([&](auto kk_) {
        constexpr int kk = decltype(kk_)::value;
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          uint32_t fb[4];
          ldmatrix_x4(fb, swz_step<kk>(kb + np * kRow16));
          mma_16x8x16<Tr::kDtype>(s[0][2 * np], qf[kk], fb[0], fb[1]);
          mma_16x8x16<Tr::kDtype>(s[0][2 * np + 1], qf[kk], fb[2], fb[3]);
        }
      });
    }
    // Scale to log2 units; keys a row cannot see (or that do not exist) to -inf.
    const int key0 = seq.tile(e_begin + it) * Tr::kBlockN + kg * Tr::kWarpKeys + 2 * t;
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + ni * 8 + (e & 1);
        s[0][ni][e] = key >= row_lo[e / 2] && key <= row_hi[e / 2] ? s[0][ni][e] * p.scale_log2 : -INFINITY;
      }
    {
      float alpha[1][2];
      online_softmax(s, row_max, row_sum, alpha);
      rescale_o(acc_o, alpha);
    }
    uint32_t pa[1][kNTiles / 2][4];
    pack_p<Tr::kDtype>(s, pa);
    const uint32_t vb = opaque(stage + v_off);
    static_for<kNTiles / 2>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
      static_for<kDTiles / 2>([&](auto dp_) {
        constexpr int dp = decltype(dp_)::value;
        uint32_t fv[4];
        ldmatrix_x4_trans(fv, swz_step<dp>(vb + kk * kRow16));
        mma_16x8x16<Tr::kDtype>(acc_o[0][2 * dp], pa[0][kk], fv[0], fv[1]);
        mma_16x8x16<Tr::kDtype>(acc_o[0][2 * dp + 1], pa[0][kk], fv[2], fv[3]);
      });
    });
  }

#if __CUDA_ARCH__ >= 900
  // The streaming is done: the combine kernel (a programmatic dependent launch, when split) may be
  // scheduled now; it waits for this grid's completion before reading anything.
  if (last) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  // Merge the key groups of each row tile (their running max m, sum l and O) into key group 0.
  float m_row[2], l_row[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    m_row[half] = row_max[0][half];
    l_row[half] = quad_sum(row_sum[0][half]);
  }
  if constexpr (Tr::kKeyGroups > 1) {
    cp_async_wait<0>();
    __syncthreads();  // every stage is free
    float* mrg = reinterpret_cast<float*>(smem);
    auto at = [&](int w, int f) -> float& { return mrg[(w * Tr::kMergeFields + f) * 32 + lane]; };
    if (kg > 0) {
#pragma unroll
      for (int nd = 0; nd < kDTiles; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) at(warp, nd * 4 + e) = acc_o[0][nd][e];
      at(warp, kDTiles * 4 + 0) = m_row[0];
      at(warp, kDTiles * 4 + 1) = m_row[1];
      at(warp, kDTiles * 4 + 2) = l_row[0];
      at(warp, kDTiles * 4 + 3) = l_row[1];
    }
    __syncthreads();
  }
  if (Tr::kKeyGroups > 1 && kg == 0) {  // key group 0 takes the others' states
    float* mrg = reinterpret_cast<float*>(smem);
    auto at = [&](int w, int f) -> float& { return mrg[(w * Tr::kMergeFields + f) * 32 + lane]; };
    float m_all[2] = {m_row[0], m_row[1]};
#pragma unroll
    for (int k = 1; k < Tr::kKeyGroups; ++k)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        m_all[half] = fmaxf(m_all[half], at(warp + k * Tr::kRowTiles, kDTiles * 4 + half));
    float f[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      f[half] = exp2f(m_row[half] - softmax_ref(m_all[half]));
      l_row[half] *= f[half];
    }
#pragma unroll
    for (int nd = 0; nd < kDTiles; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][nd][e] *= f[e / 2];
#pragma unroll
    for (int k = 1; k < Tr::kKeyGroups; ++k) {
      const int w = warp + k * Tr::kRowTiles;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        f[half] = exp2f(at(w, kDTiles * 4 + half) - softmax_ref(m_all[half]));
        l_row[half] += at(w, kDTiles * 4 + 2 + half) * f[half];
      }
#pragma unroll
      for (int nd = 0; nd < kDTiles; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][nd][e] += at(w, nd * 4 + e) * f[e / 2];
    }
    m_row[0] = m_all[0];
    m_row[1] = m_all[1];
  }

  // Epilogue: O / l and the LSE of each row; to the output, or to the split's fp32 partials.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = chunk * Tr::kRows + rt * 16 + g + 8 * half;
    if (kg != 0 || row >= rows) continue;
    const int hh = hkv * p.h_per_kv + row / p.lq, i = row % p.lq;
    const float lse = row_lse(m_row[half], l_row[half]);
    const float inv = row_inv(l_row[half]);
    const int64_t r = (int64_t(b) * p.h + hh) * p.lq + i;
    if (p.num_splits == 1) {
      Element* o =
          static_cast<Element*>(p.o) + b * p.o_batch_stride + hh * p.o_head_stride + i * p.o_row_stride;
#pragma unroll
      for (int nd = 0; nd < kDTiles; ++nd) {
        const int col = nd * 8 + 2 * t;
        if (col < p.dv)
          *reinterpret_cast<uint32_t*>(o + col) =
              pack2<Tr::kDtype>(acc_o[0][nd][2 * half] * inv, acc_o[0][nd][2 * half + 1] * inv);
      }
      if (t == 0) p.lse[r] = lse;
    } else {
      const int64_t pr = int64_t(j0) * p.b * p.h * p.lq + r;
      float* o = p.o_part + pr * p.dv;
#pragma unroll
      for (int nd = 0; nd < kDTiles; ++nd) {
        const int col = nd * 8 + 2 * t;
        if (col < p.dv)
          *reinterpret_cast<float2*>(o + col) =
              make_float2(acc_o[0][nd][2 * half] * inv, acc_o[0][nd][2 * half + 1] * inv);
      }
      if (t == 0) p.lse_part[pr] = lse;
    }
  }
}

template <typename Tr>
__device__ __forceinline__ void decode_walk(const DecodeParams& p, char* smem, int64_t pieces) {
  const int64_t v0 = int64_t(blockIdx.x) * pieces / p.num_ctas;
  const int64_t v1 = (int64_t(blockIdx.x) + 1) * pieces / p.num_ctas;
  for (int64_t v = v0; v < v1;) {
    const int64_t u = v / p.num_splits;
    const int j0 = int(v - u * p.num_splits);
    const int j1 = int(v1 - v < p.num_splits - j0 ? j0 + (v1 - v) : p.num_splits);
    const int hkv = int(u % p.h_kv), chunk = int(u / p.h_kv % p.row_chunks),
              b = int(u / p.h_kv / p.row_chunks);
    if (v != v0) {
      cp_async_wait<0>();
      __syncthreads();  // the previous segment is done with every stage and the merge area
    }
    v += j1 - j0;
    decode_segment<Tr>(p, smem, b, hkv, chunk, j0, j1, v == v1);
  }
}

// Per CTA: pieces [v0, v1) = [c * V / G, (c + 1) * V / G) of the V = units * S pieces (units
// numbered (batch, row chunk, K/V head), unit u's pieces u * S ... u * S + S - 1), so G = num_ctas
// CTAs share the work evenly whatever the units' count (balanced split-KV: a CTA may end one
// unit's keys and start the next's, each segment its own partial slot). With G = V (one piece per
// CTA) the CTA order is K/V head fastest, then split, row chunk, batch instead: the heads of one
// token share its cache rows' neighbourhood in a paged cache ((page, slot, head, D): a head's row
// is one 2 * D-byte piece of every (Hkv * 2 * D)-byte token), so their CTAs run side by side.
// (kBalanced: the walk; else one piece per CTA, a kernel of its own so that path's code is not
// shaped by the walk's.)
template <typename Tr, bool kBalanced>
__global__ void __launch_bounds__(Tr::kNThreads) decode_fwd_kernel(__grid_constant__ const DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) char smem[];
  const int64_t pieces = int64_t(p.b) * p.row_chunks * p.h_kv * p.num_splits;
  if constexpr (!kBalanced) {
    const int hkv = int(blockIdx.x % unsigned(p.h_kv));
    const int rest = int(blockIdx.x / unsigned(p.h_kv));
    const int split = rest % p.num_splits;
    const int chunk = rest / p.num_splits % p.row_chunks, b = rest / p.num_splits / p.row_chunks;
    decode_segment<Tr>(p, smem, b, hkv, chunk, split, split + 1, true);
  } else {
    decode_walk<Tr>(p, smem, pieces);
  }
#else
  __trap();  // built for an architecture without bf16 mma.sync: the launcher never gets here
#endif
}

// The splits of one row (rows numbered (b * H + h) * Lq + i) merged by one CTA: lse = log sum_s
// exp(lse_s), O = sum_s exp(lse_s - lse) O_s. Warp 0 turns the splits' LSEs into weights (shared
// memory); then the threads share the row's 4-column slices, several threads per slice, each summing
// a strided share of the splits with independent loads (the partials sit in L2: the sum is
// latency-bound, so the loads go out together, the first 16 before the weights are known), the
// shares meeting in shared memory. (Merging in the
// decode kernel instead, by the CTA that finishes a unit's splits last, measured slower: one CTA
// then merges all of a unit's rows.)
template <typename Element>
__global__ void __launch_bounds__(kDecodeCombineThreads)
    decode_combine_kernel(__grid_constant__ const DecodeParams p) {
  __shared__ float weight[kDecodeMaxSplits];
  __shared__ int slot[kDecodeMaxSplits];
  __shared__ float4 share[kDecodeCombineThreads];
  const int tid = threadIdx.x, lane = tid % 32;
  const int64_t row = blockIdx.x;
  const int64_t split_stride = int64_t(p.b) * p.h * p.lq;
  // The row's unit and the slots its pieces wrote (decode_fwd_kernel's walk): the CTAs c0 ... c1
  // that held its pieces [x0, x0 + S), the first from slot 0, each later one from where it began.
  // (One piece per CTA: slots 0 ... S - 1.)
  int n_splits;
  {
    const int i = int(row % p.lq), hh = int(row / p.lq % p.h), b = int(row / p.lq / p.h);
    const int r = (hh % p.h_per_kv) * p.lq + i;
    const int64_t u = (int64_t(b) * p.row_chunks + r / p.chunk_rows) * p.h_kv + hh / p.h_per_kv;
    const int64_t pieces = int64_t(p.b) * p.row_chunks * p.h_kv * p.num_splits, ctas = p.num_ctas;
    const int64_t x0 = u * p.num_splits;
    const int64_t c0 = ((x0 + 1) * ctas - 1) / pieces, c1 = ((x0 + p.num_splits) * ctas - 1) / pieces;
    n_splits = int(c1 - c0 + 1);
    if (tid < n_splits) slot[tid] = tid == 0 ? 0 : int((c0 + tid) * pieces / ctas - x0);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the decode kernel (sm_90): resident while it runs,
  // waiting here until its partials are complete.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  __syncthreads();
  const int cols4 = p.dv / 4, groups = kDecodeCombineThreads / cols4;  // threads per 4-column slice
  const int c = tid % cols4, sg = tid / cols4;
  const float* part = p.o_part + row * p.dv + 4 * c;
  // The first kAhead of this thread's partials loaded before the weights are known: their L2
  // round trip overlaps warp 0's (the LSEs').
  constexpr int kAhead = 16;
  float4 ahead[kAhead];
#pragma unroll
  for (int j = 0; j < kAhead; ++j) {
    const int s = sg + j * groups;
    ahead[j] = sg < groups && s < n_splits
                   ? *reinterpret_cast<const float4*>(part + slot[s] * split_stride * p.dv)
                   : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (tid < 32) {
    constexpr int kPerLane = kDecodeMaxSplits / 32;
    float lse_s[kPerLane];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int s = j * 32 + lane;
      lse_s[j] = s < n_splits ? p.lse_part[slot[s] * split_stride + row] : -INFINITY;
      m = fmaxf(m, lse_s[j]);
    }
    m = warp_max(m);
    const float ref = m == -INFINITY ? 0.f : m;
    float l = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      lse_s[j] = __expf(lse_s[j] - ref);  // the weight; 0 past n_splits
      l += lse_s[j];
    }
    l = warp_sum(l);
    const float inv = l == 0.f ? 0.f : 1.f / l;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) weight[j * 32 + lane] = lse_s[j] * inv;
    if (lane == 0) p.lse[row] = l == 0.f ? -INFINITY : ref + __logf(l);
  }
  __syncthreads();
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (sg < groups) {
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const float w = weight[min(sg + j * groups, kDecodeMaxSplits - 1)];  // 0 past n_splits
      acc.x += w * ahead[j].x;
      acc.y += w * ahead[j].y;
      acc.z += w * ahead[j].z;
      acc.w += w * ahead[j].w;
    }
#pragma unroll 8
    for (int s = sg + kAhead * groups; s < n_splits; s += groups) {
      const float4 v = *reinterpret_cast<const float4*>(part + slot[s] * split_stride * p.dv);
      acc.x += weight[s] * v.x;
      acc.y += weight[s] * v.y;
      acc.z += weight[s] * v.z;
      acc.w += weight[s] * v.w;
    }
  }
  share[tid] = acc;
  __syncthreads();
  if (sg != 0) return;
  for (int gi = 1; gi < groups; ++gi) {
    const float4 v = share[gi * cols4 + c];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  const int i = int(row % p.lq), hh = int(row / p.lq % p.h), b = int(row / p.lq / p.h);
  Element* o =
      static_cast<Element*>(p.o) + b * p.o_batch_stride + hh * p.o_head_stride + i * p.o_row_stride + 4 * c;
  o[0] = from_f32<Element>(acc.x);
  o[1] = from_f32<Element>(acc.y);
  o[2] = from_f32<Element>(acc.z);
  o[3] = from_f32<Element>(acc.w);
}

// The new keys and values into the cache at cache_seqlens[b] + i. One CTA per (b, i); rows
// past the cache or in a page outside it are dropped.
template <typename Element>
__global__ void __launch_bounds__(128) decode_append_kernel(__grid_constant__ const DecodeParams p) {
  const int b = int(blockIdx.x / unsigned(p.lq)), i = int(blockIdx.x % unsigned(p.lq));
  const int tok = decode_seqlen(p, b) + i;
  if (tok >= p.capacity) return;
  const int64_t page =
      p.block_table == nullptr ? b : p.block_table[int64_t(b) * p.bt_batch_stride + tok / p.page_size];
  if (page < 0 || page >= p.num_pages) return;
  const int slot = p.block_table == nullptr ? tok : tok % p.page_size;
  const int kc = p.d / 8, vcn = p.dv / 8;
  for (int idx = threadIdx.x; idx < p.h_kv * (kc + vcn); idx += blockDim.x) {
    const int hk = idx / (kc + vcn), c = idx % (kc + vcn);
    if (c < kc) {
      const Element* src = static_cast<const Element*>(p.k_new) + b * p.kn_batch_stride +
                           hk * p.kn_head_stride + i * p.kn_row_stride + c * 8;
      Element* dst = static_cast<Element*>(p.k_cache) + page * p.k_page_stride +
                     int64_t(slot) * p.k_row_stride + hk * p.k_head_stride + c * 8;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      const int cv = c - kc;
      const Element* src = static_cast<const Element*>(p.v_new) + b * p.vn_batch_stride +
                           hk * p.vn_head_stride + i * p.vn_row_stride + cv * 8;
      Element* dst = static_cast<Element*>(p.v_cache) + page * p.v_page_stride +
                     int64_t(slot) * p.v_row_stride + hk * p.v_head_stride + cv * 8;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    }
  }
}

template <typename Tr>
cudaError_t launch_decode(const DecodeParams& p, const DecodePlan& plan, cudaStream_t stream) {
  const int64_t pieces = int64_t(p.b) * p.h_kv * plan.row_chunks * plan.num_splits;
  const int64_t grid = plan.num_ctas;
  if (grid < 1 || grid > pieces || pieces > INT_MAX) return cudaErrorInvalidConfiguration;
  auto kernel = grid == pieces ? decode_fwd_kernel<Tr, false> : decode_fwd_kernel<Tr, true>;
  SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  kernel<<<unsigned(grid), Tr::kNThreads, Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sparse_attn::cuda

namespace sparse_attn {

template <ScalarKind kDtype, int kHeadDim>
cudaError_t run_decode_fwd_(const DecodeParams& params, const DecodePlan& plan, cudaStream_t stream) {
  using Element = typename cuda::ElementOf<kDtype>::type;
  if (plan.head_dim != kHeadDim) return cudaErrorInvalidValue;
  DecodeParams p = params;
  p.num_splits = plan.num_splits;
  p.num_ctas = int(plan.num_ctas);
  p.row_chunks = plan.row_chunks;
  p.chunk_rows = 16 * plan.row_tiles;
  if (p.k_new != nullptr && p.lq > 0) {
    cuda::decode_append_kernel<Element><<<unsigned(p.b * p.lq), 128, 0, stream>>>(p);
    SA_CUDA_TRY(cudaGetLastError());
  }
  cudaError_t err = cudaErrorInvalidValue;
  switch (plan.row_tiles) {
    case 1:
      err = cuda::launch_decode<cuda::DecodeTraits<kDtype, kHeadDim, 1>>(p, plan, stream);
      break;
    case 2:
      err = cuda::launch_decode<cuda::DecodeTraits<kDtype, kHeadDim, 2>>(p, plan, stream);
      break;
    case 4:
      err = cuda::launch_decode<cuda::DecodeTraits<kDtype, kHeadDim, 4>>(p, plan, stream);
      break;
    default:
      break;
  }
  SA_CUDA_TRY(err);
  if (p.num_splits > kDecodeMaxSplits) return cudaErrorInvalidValue;
  if (p.num_splits > 1) {
    const int64_t rows = int64_t(p.b) * p.h * p.lq;
    if (rows > INT_MAX || p.dv % 4 != 0 || p.dv / 4 > cuda::kDecodeCombineThreads)
      return cudaErrorInvalidConfiguration;
    // On sm_90 the combine is a programmatic dependent launch: its CTAs are scheduled as the decode
    // kernel's finish (griddepcontrol.wait holds them until all of its memory operations are
    // visible), which takes the second launch's latency off the critical path.
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(unsigned(rows));
    config.blockDim = dim3(cuda::kDecodeCombineThreads);
    config.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = plan.dependent_launch ? 1 : 0;
    SA_CUDA_TRY(cudaLaunchKernelEx(&config, cuda::decode_combine_kernel<Element>, p));
    SA_CUDA_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

}  // namespace sparse_attn
