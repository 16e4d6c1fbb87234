// Attention over gathered keys on Hopper's wgmma (sm_90a), for selections that 64 query heads
// share: one CTA (one warpgroup) per (batch, query token, block of 64 heads), the 64 heads the
// M = 64 rows of every product. Where the heads of a token read one kv head and one index set
// (DeepSeek's sparse attention: 64-128 heads, one latent kv head, one indexer selection), each
// selected K/V row is loaded once into shared memory for all 64 heads and enters S = Q K^T and
// O += P V as wgmma operands, so the tensor cores work on m64n64 / m64nD tiles instead of the
// mma.sync kernel's 16-row ones (gather_mma.cuh).
//
// Keys are visited 64 at a time through a kGatherWgmmaStages-deep ring of (K, V) stages that
// the warpgroup fills itself with cp.async (the rows are scattered, which TMA cannot gather on
// sm_90), written in the 128-byte swizzle wgmma reads; listed slots that are -1 or out of range
// are zero-filled and their scores masked to -inf (only in stages that have such slots). Per
// stage: the softmax of S, P V issued, the next stage's Q K^T issued behind it; once the P V is
// done in every warp (a CTA barrier) its slot takes the stage three ahead. Stages are waited
// for two iterations after their copies are issued; two CTAs per SM (112 KiB of shared memory
// each at D = 128) overlap one's softmax with the other's products. The descriptors are built
// once and stepped by adding offsets. Softmax (scale folded into the exponent, lazily moved
// max), P packing and the normaliser are the flash kernels' (flash_softmax.cuh): a wgmma
// accumulator is, per warp, the m16n8 layout they take. docs/PERF_LOG.md has the measurements.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/element.cuh"
#include "sparse_attn/cuda/flash_softmax.cuh"
#include "sparse_attn/cuda/gather_task.cuh"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/cuda/ptx_sm90.cuh"
#include "sparse_attn/cuda/smem_tile.cuh"
#include "sparse_attn/cuda/wgmma.cuh"
#include "sparse_attn/plan.h"

namespace sparse_attn::cuda {

constexpr int kGatherWgmmaKeys = 64;  // keys per stage: N of S, K of P V
constexpr int kGatherWgmmaStages = 3;

template <int kHeadDim>
struct GatherWgmmaLayout {
  // Q and every K or V stage are 64 rows x kHeadDim columns, 128-byte swizzled: kHeadDim / 64
  // column blocks of 64 rows x 128 bytes each (1024-byte aligned).
  static constexpr int kColBytes = 64 * 128;
  static constexpr int kTileBytes = (kHeadDim / 64) * kColBytes;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K, then V
  static constexpr int kValidOffset = kTileBytes + kGatherWgmmaStages * kStageBytes;
  // Q, the stages, then each stage's 64-bit mask of filled slots.
  static constexpr int kSmemBytes = kValidOffset + kGatherWgmmaStages * 8;
};

// Byte offset of 16-byte chunk c of row r in a swizzled 64-row tile (the layout TMA's 128-byte
// swizzle writes): column block c / 8, chunk c % 8 XOR r % 8 within the row's 128 bytes.
__device__ __forceinline__ uint32_t sw128_offset(int r, int c) {
  return uint32_t((c / 8) * (64 * 128) + r * 128 + (((c % 8) ^ (r % 8)) * 16));
}

template <ScalarKind kDtype, int kHeadDim>
__global__ void __launch_bounds__(128, 2) gather_wgmma_kernel(__grid_constant__ const AttnFwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename ElementOf<kDtype>::type;
  using L = GatherWgmmaLayout<kHeadDim>;
  constexpr int kStages = kGatherWgmmaStages;
  constexpr int kChunks = kHeadDim / 8;          // 16-byte chunks per row
  constexpr int kRowsPerPass = 128 / kChunks;    // rows the warpgroup's 128 copies cover
  constexpr int kPasses = 64 / kRowsPerPass;     // copies per thread and 64-row tile
  constexpr int kNTiles = kGatherWgmmaKeys / 8;  // n8 tiles of S
  constexpr int kDTiles = kHeadDim / 8;          // n8 tiles of O
  static_assert(kHeadDim == 64 || kHeadDim == 128);
  extern __shared__ __align__(1024) char smem_gw[];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, t = lane % 4, g = lane / 4;
  const int hblocks = p.h / kGatherWgmmaHeads;
  const int64_t task = blockIdx.x;  // over (B, head blocks, Lq), the token fastest
  const int i = int(task % p.lq);
  const int h0 = int((task / p.lq) % hblocks) * kGatherWgmmaHeads;
  const int b = int(task / (int64_t(p.lq) * hblocks));
  const int hk = h0 / p.h_per_kv;

  const uint32_t sQ = smem_u32(smem_gw);
  auto sK = [&](int buf) { return sQ + L::kTileBytes + buf * L::kStageBytes; };
  auto sV = [&](int buf) { return sK(buf) + L::kTileBytes; };
  uint32_t* s_valid = reinterpret_cast<uint32_t*>(smem_gw + L::kValidOffset);

  const auto [idx, q, k, v] = gather_rows<Element>(p, b, h0, hk, i);

  // This thread copies 16-byte chunk c of rows r0, r0 + kRowsPerPass, ... of every tile: at
  // byte offsets dst0 + s * kRowsPerPass * 128 (kRowsPerPass is a multiple of 8, so every row of
  // the thread has the same swizzle).
  const int c = tid % kChunks, r0 = tid / kChunks;
  const uint32_t dst0 = sw128_offset(r0, c);
  static_assert(kRowsPerPass % 8 == 0);
#pragma unroll
  for (int s = 0; s < kPasses; ++s) {
    const int r = r0 + s * kRowsPerPass;  // head h0 + r
    cp_async_16(sQ + dst0 + s * kRowsPerPass * 128, q + r * p.q_head_stride + c * 8, 16);
  }
  const Element* kc = k + c * 8;
  const Element* vc = v + c * 8;

  // Slot u of stage st holds the key listed at idx[64 st + u]; every warp reads the stage's 64
  // entries, lane l entries l and l + 32 (ia, ib), a stage before their copies are issued, and
  // passes each copying thread its rows' keys.
  const int n_stages = (p.topk + kGatherWgmmaKeys - 1) / kGatherWgmmaKeys;
  int ia = -1, ib = -1;
  auto load_index = [&](int st) {
    const int pos = st * kGatherWgmmaKeys + lane;
    ia = st < n_stages && pos < p.topk ? __ldg(idx + pos) : -1;
    ib = st < n_stages && pos + 32 < p.topk ? __ldg(idx + pos + 32) : -1;
  };
  // Stage st (< n_stages) into ring slot buf from the entries in ia, ib; an empty slot copies 0
  // bytes (zero-fill) from row 0. The slot's mask of filled entries goes to s_valid.
  auto issue = [&](int buf) {
    const uint32_t lo = __ballot_sync(0xffffffffu, ia >= 0 && ia < p.lk);
    const uint32_t hi = __ballot_sync(0xffffffffu, ib >= 0 && ib < p.lk);
    if (tid == 0) {
      s_valid[2 * buf] = lo;
      s_valid[2 * buf + 1] = hi;
    }
    const uint32_t dk = sK(buf) + dst0, dv = sV(buf) + dst0;
#pragma unroll
    for (int s = 0; s < kPasses; ++s) {
      // Rows of pass s lie all below 32 or all above.
      const int j = __shfl_sync(0xffffffffu, s * kRowsPerPass < 32 ? ia : ib, (r0 + s * kRowsPerPass) % 32);
      const bool ok = j >= 0 && j < p.lk;
      const int64_t jj = ok ? j : 0;
      const int bytes = ok ? 16 : 0;
      cp_async_16(dk + s * kRowsPerPass * 128, kc + jj * p.k_row_stride, bytes);
      cp_async_16(dv + s * kRowsPerPass * 128, vc + jj * p.v_row_stride, bytes);
    }
  };
  // Groups: Q with stage 0, then one per stage (empty past the last), so that group it is stage it.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n_stages) {
      load_index(st);
      issue(st);
    }
    cp_async_commit();
  }
  load_index(kStages - 1);

  float acc_o[1][kDTiles][4];
  float row_max[1][2], row_sum[1][2];
  softmax_start(acc_o, row_max, row_sum);
  auto& o_flat = reinterpret_cast<float (&)[kDTiles * 4]>(acc_o);
  float sc[1][kNTiles][4];
  auto& s_flat = reinterpret_cast<float (&)[kNTiles * 4]>(sc);
  uint32_t pa[1][kNTiles / 2][4];
  auto& pa_flat = reinterpret_cast<uint32_t (&)[kNTiles * 2]>(pa);
  // Matrix descriptors built once and stepped by adding byte offsets >> 4 to their address field
  // (shared addresses stay below 2^18, so the 14-bit field never carries).
  const uint64_t desc_q = sw128_desc(sQ, 16, 1024), desc_k = sw128_desc(sK(0), 16, 1024),
                 desc_v = sw128_desc(sV(0), L::kColBytes, 1024);

  // S = Q K^T of the stage in ring slot `slot`: both operands K-major; a K step of 16 elements
  // is +32 bytes within a 128-byte row.
  auto issue_s = [&](int slot) {
    const uint32_t stage_off = uint32_t(slot) * L::kStageBytes;
    wgmma_fence();
    static_for<kHeadDim / 16>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
      constexpr uint32_t off = (kk / 4) * L::kColBytes + (kk % 4) * 32;
      Wgmma<kDtype, kGatherWgmmaKeys>::ss(s_flat, desc_q + (off >> 4), desc_k + ((stage_off + off) >> 4),
                                          kk > 0 ? 1 : 0);
    });
    wgmma_commit();
  };
  // O += P V of the stage in `slot`: P from registers; V MN-major (head dim contiguous): 16 keys
  // are 16 rows (2048 bytes) of every column block, the column blocks kColBytes apart.
  auto issue_pv = [&](int slot) {
    const uint32_t stage_off = uint32_t(slot) * L::kStageBytes;
    wgmma_fence();
    static_for<kGatherWgmmaKeys / 16>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
      Wgmma<kDtype, kHeadDim>::rs(o_flat, pa[0][kk], desc_v + ((stage_off + kk * 2048) >> 4));
    });
    wgmma_commit();
  };
  // Once S of the stage in `slot` is done: hide empty slots (column 8 ni + 2t + e % 2 of S is
  // entry 8 ni + 2t + e % 2), in the stages that have any (a row's last stage when k is not a
  // multiple of 64, rows with fewer keys); the online softmax with the scale in the exponent and
  // a lazily moved max, so that O is rescaled only in stages where a row's max moves
  // (flash_softmax.cuh); P to pa.
  auto softmax_of = [&](int slot) {
    const uint32_t lo = s_valid[2 * slot], hi = s_valid[2 * slot + 1];
    if ((lo & hi) != 0xffffffffu) {
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int entry = ni * 8 + 2 * t + (e % 2);
          const uint32_t word = ni < kNTiles / 2 ? lo : hi;
          if (!((word >> (entry % 32)) & 1u)) sc[0][ni][e] = -INFINITY;
        }
    }
    float m_new[1][2], alpha[1][2];
    softmax_fold_max(sc, row_max, m_new, p.scale_log2, kMaxStale);
    softmax_fold_exp<kDtype>(sc, m_new, row_max, row_sum, alpha, pa, p.scale_log2);
    if (rescale_needed(alpha)) rescale_o(acc_o, alpha);
  };
  // This thread's part of stage it landed, visible to wgmma; the barrier: every part landed.
  auto stage_landed = [&]() {
    cp_async_wait<kStages - 2>();
    fence_proxy_async();
    __syncthreads();
  };

  // Stage it's P V runs under the CTA barrier and the Q K^T of stage it + 1, which is issued
  // behind it; the wait for the P V (wgmma groups retire in order) comes before the barrier that
  // frees its slot for stage it + 3, and before the next softmax touches O and P.
  if (n_stages > 0) {
    stage_landed();
    if (kStages - 1 < n_stages) issue(kStages - 1);
    cp_async_commit();
    load_index(kStages);
    issue_s(0);
    wgmma_wait<0>();
    fence_regs(s_flat);
  }
  int slot = 0;  // ring slot of stage it; stage it + kStages takes it next
  for (int it = 0; it < n_stages; ++it) {
    softmax_of(slot);
    issue_pv(slot);
    const int next = slot == kStages - 1 ? 0 : slot + 1;
    if (it + 1 < n_stages) {
      stage_landed();
      issue_s(next);
      wgmma_wait<1>();  // the P V
      fence_regs(o_flat);
      fence_regs(pa_flat);
      __syncthreads();  // every warp's P V is done: its slot takes stage it + kStages
      if (it + kStages < n_stages) issue(slot);
      cp_async_commit();
      load_index(it + kStages + 1);
      wgmma_wait<0>();  // Q K^T of stage it + 1
      fence_regs(s_flat);
    } else {
      wgmma_wait<0>();
      fence_regs(o_flat);
    }
    slot = next;
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp's products are done: Q's buffer takes the output

  // Epilogue: O / l staged in Q's buffer (rows of kChunks 16-byte chunks, swizzled) for 16-byte
  // stores; LSE.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float lse;
    const float inv = finish_row(row_max[0][half], row_sum[0][half], lse);
    const int r = warp * 16 + g + half * 8;
#pragma unroll
    for (int nd = 0; nd < kDTiles; ++nd)
      *reinterpret_cast<uint32_t*>(smem_gw + swz<kChunks>(r, nd) + t * 4) =
          pack2<kDtype>(acc_o[0][nd][2 * half] * inv, acc_o[0][nd][2 * half + 1] * inv);
    if (t == 0) p.lse[(int64_t(b) * p.h + h0 + r) * p.lq + i] = lse;
  }
  __syncthreads();
  Element* o =
      static_cast<Element*>(p.o) + b * p.o_batch_stride + h0 * p.o_head_stride + int64_t(i) * p.o_row_stride;
#pragma unroll
  for (int s = 0; s < kPasses; ++s) {
    const int r = r0 + s * kRowsPerPass;
    *reinterpret_cast<uint4*>(o + r * p.o_head_stride + c * 8) =
        *reinterpret_cast<const uint4*>(smem_gw + swz<kChunks>(r, c));
  }
#else
  __trap();  // not built for sm_90a: the launcher never gets here
#endif
}

template <ScalarKind kDtype, int kHeadDim>
cudaError_t run_gather_wgmma_(const AttnFwdParams& p, cudaStream_t stream) {
  const int64_t blocks = int64_t(p.b) * (p.h / kGatherWgmmaHeads) * p.lq;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  constexpr int smem = GatherWgmmaLayout<kHeadDim>::kSmemBytes;
  auto kernel = gather_wgmma_kernel<kDtype, kHeadDim>;
  SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<unsigned(blocks), 128, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sparse_attn::cuda
