// Attention over gathered keys on the tensor cores (mma.sync, sm_80+).
//
// One warp per (batch, query token, group of query heads). The heads of a group read the same
// kv head and the same index set (indexer selection shares one set across every head, GQA/MQA
// shares one kv head across h_per_kv heads), so each selected K/V row is loaded once into shared
// memory and serves the whole group: the group's heads are the 16 rows of the mma tile (padded
// with zero rows when the group is smaller). Keys are visited 32 at a time through a two-stage
// cp.async ring per warp; listed slots that are -1 or out of range are zero-filled and masked.
// Softmax, P packing and the epilogue's normaliser are the flash kernels' (flash_softmax.cuh).
//
// kShared: where four consecutive groups share the kv head and the index set (64 heads of one MQA
// token, say), a CTA's four warps are those four groups of one token and share one ring of K/V
// stages, each warp loading a quarter of every stage: a K/V row crosses L2 once per 64 heads
// instead of once per 16, and the CTA needs 48 KiB of shared memory instead of 144 (D = 128).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "sparse_attn/cuda/cuda_check.h"
#include "sparse_attn/cuda/flash_softmax.cuh"
#include "sparse_attn/cuda/gather_task.cuh"
#include "sparse_attn/cuda/ptx.cuh"
#include "sparse_attn/cuda/smem_tile.cuh"
#include "sparse_attn/plan.h"

namespace sparse_attn::cuda {

constexpr int kGatherMmaKeys = 32;  // keys per stage (4 n8 tiles of S)
constexpr int kGatherMmaStages = 2;

template <int kHeadDim>
struct GatherMmaLayout {
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr int kQBytes = kGatherMmaRows * kHeadDim * 2;
  static constexpr int kKVBytes = kGatherMmaKeys * kHeadDim * 2;
  static constexpr int kWarpBytes = kQBytes + kGatherMmaStages * 2 * kKVBytes;  // Q, then (K, V) per stage
  static constexpr int kSmemBytes = kGatherMmaWarps * kWarpBytes;
  // kShared: the warps' Q, then one ring of (K, V) stages.
  static constexpr int kSharedSmemBytes = kGatherMmaWarps * kQBytes + kGatherMmaStages * 2 * kKVBytes;
};

// group: heads per warp (<= 16; divides H and the run of heads sharing a kv head and an index set).
template <ScalarKind kDtype, int kHeadDim, bool kShared>
__global__ void __launch_bounds__(kGatherMmaWarps * 32)
    gather_mma_kernel(__grid_constant__ const AttnFwdParams p, const int group) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Element = typename ElementOf<kDtype>::type;
  using L = GatherMmaLayout<kHeadDim>;
  constexpr int kChunks = L::kChunks, kDTiles = kHeadDim / 8, kKSteps = kHeadDim / 16;
  constexpr int kRowsPerStep = 32 / kChunks;  // rows one warp-wide 16-byte copy covers
  constexpr uint32_t kRow16 = 16 * kChunks * 16;
  extern __shared__ __align__(128) char smem[];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  int i, h0, b;
  if (!gather_task<kShared>(p, group, warp, i, h0, b)) return;
  const int hk = h0 / p.h_per_kv;

  const uint32_t sQ = smem_u32(smem) + warp * (kShared ? L::kQBytes : L::kWarpBytes);
  auto sK = [&](int stage) {
    return (kShared ? smem_u32(smem) + kGatherMmaWarps * L::kQBytes : sQ + L::kQBytes) +
           stage * 2 * L::kKVBytes;
  };
  auto sV = [&](int stage) { return sK(stage) + L::kKVBytes; };

  const auto [idx, q, k, v] = gather_rows<Element>(p, b, h0, hk, i);

  const int c = lane % kChunks, r0 = lane / kChunks;  // this lane's 16-byte column chunk and first row
  const bool col_ok = c * 8 < p.d;
  // Q: the group's heads; rows past the group are zero (their scores are 0 and never stored).
#pragma unroll
  for (int s = 0; s < kGatherMmaRows / kRowsPerStep; ++s) {
    const int r = r0 + s * kRowsPerStep;
    const bool ok = col_ok && r < group;
    cp_async_16(sQ + swz<kChunks>(r, c), ok ? q + r * p.q_head_stride + c * 8 : q, ok ? 16 : 0);
  }
  cp_async_commit();

  // Slot u of a stage holds the key listed at idx[t0 + u], which lane u loads.
  const int n_stages = (p.topk + kGatherMmaKeys - 1) / kGatherMmaKeys;
  auto load_index = [&](int chunk) {
    const int pos = chunk * kGatherMmaKeys + lane;
    return chunk < n_stages && pos < p.topk ? __ldg(idx + pos) : -1;
  };
  // kShared: warp w loads slots [8 w, 8 w + 8) of each stage.
  constexpr int kLoadRows = kShared ? kGatherMmaKeys / kGatherMmaWarps : kGatherMmaKeys;
  const int u0 = kShared ? warp * kLoadRows : 0;
  auto issue = [&](int stage, int jl) {
#pragma unroll
    for (int s = 0; s < kLoadRows / kRowsPerStep; ++s) {
      const int u = u0 + r0 + s * kRowsPerStep;
      const int j = __shfl_sync(0xffffffffu, jl, u);
      const bool ok = col_ok && j >= 0 && j < p.lk;
      cp_async_16(sK(stage) + swz<kChunks>(u, c), ok ? k + int64_t(j) * p.k_row_stride + c * 8 : k,
                  ok ? 16 : 0);
      cp_async_16(sV(stage) + swz<kChunks>(u, c), ok ? v + int64_t(j) * p.v_row_stride + c * 8 : v,
                  ok ? 16 : 0);
    }
    cp_async_commit();
  };
  auto valid_slots = [&](int jl) { return __ballot_sync(0xffffffffu, jl >= 0 && jl < p.lk); };

  int jl = load_index(0);
  uint32_t valid_cur = 0, valid_next = 0;  // bit u: slot u of the stage holds a key
  if (n_stages > 0) {
    valid_cur = valid_slots(jl);
    issue(0, jl);
  }
  jl = load_index(1);

  float acc_o[1][kDTiles][4];
  float row_max[1][2], row_sum[1][2];
  softmax_start(acc_o, row_max, row_sum);

  const int r8 = lane % 8;
  uint32_t qf[kKSteps][4];
  for (int it = 0; it < n_stages; ++it) {
    const int stage = it % kGatherMmaStages;
    if (it + 1 < n_stages) {  // refill the other stage (its previous keys were consumed last step)
      valid_next = valid_slots(jl);
      issue((it + 1) % kGatherMmaStages, jl);
      jl = load_index(it + 2);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if constexpr (kShared)
      __syncthreads();  // every warp's quarter of the stage landed
    else
      __syncwarp();
    if (it == 0) {
      const uint32_t q_base = sQ + swz<kChunks>(((lane / 8) % 2) * 8 + r8, lane / 16);
      static_for<kKSteps>([&](auto kk_) {
        constexpr int kk = decltype(kk_)::value;
        ldmatrix_x4(qf[kk], swz_step<kk>(q_base));
      });
    }

    // S = Q K^T over the stage's 32 keys.
    float s[1][kGatherMmaKeys / 8][4];
#pragma unroll
    for (int ni = 0; ni < kGatherMmaKeys / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][ni][e] = 0.f;
    const uint32_t k_base = sK(stage) + swz<kChunks>((lane / 16) * 8 + r8, (lane / 8) % 2);
    static_for<kKSteps>([&](auto kk_) {
      constexpr int kk = decltype(kk_)::value;
#pragma unroll
      for (int np = 0; np < kGatherMmaKeys / 16; ++np) {
        uint32_t fb[4];
        ldmatrix_x4(fb, swz_step<kk>(k_base + np * kRow16));
        mma_16x8x16<kDtype>(s[0][2 * np], qf[kk], fb[0], fb[1]);
        mma_16x8x16<kDtype>(s[0][2 * np + 1], qf[kk], fb[2], fb[3]);
      }
    });
    // Scale; hide empty slots (column ni * 8 + 2t + e of the stage is slot ni * 8 + 2t + e).
    const uint32_t vbits = valid_cur;
    valid_cur = valid_next;
#pragma unroll
    for (int ni = 0; ni < kGatherMmaKeys / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int slot = ni * 8 + 2 * t + (e % 2);
        s[0][ni][e] = (vbits >> slot) & 1u ? s[0][ni][e] * p.scale_log2 : -INFINITY;
      }
    {
      float alpha[1][2];
      online_softmax(s, row_max, row_sum, alpha);
      rescale_o(acc_o, alpha);
    }
    uint32_t pa[1][kGatherMmaKeys / 16][4];
    pack_p<kDtype>(s, pa);
    const uint32_t v_base = sV(stage) + swz<kChunks>(((lane / 8) % 2) * 8 + r8, lane / 16);
    static_for<(kGatherMmaKeys / 16) * (kDTiles / 2)>([&](auto j_) {
      constexpr int j = decltype(j_)::value, kk = j / (kDTiles / 2), dp = j % (kDTiles / 2);
      uint32_t fb[4];
      ldmatrix_x4_trans(fb, swz_step<dp>(v_base + kk * kRow16));
      mma_16x8x16<kDtype>(acc_o[0][2 * dp], pa[0][kk], fb[0], fb[1]);
      mma_16x8x16<kDtype>(acc_o[0][2 * dp + 1], pa[0][kk], fb[2], fb[3]);
    });
    if constexpr (kShared)
      __syncthreads();  // every warp is done with this stage before it is refilled
    else
      __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  __syncwarp();

  // Epilogue: O / l staged through the warp's Q space for 16-byte stores; LSE.
  char* so = smem + warp * (kShared ? L::kQBytes : L::kWarpBytes);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float lse;
    const float inv = finish_row(row_max[0][half], row_sum[0][half], lse);
    const int r = g + half * 8;
#pragma unroll
    for (int nd = 0; nd < kDTiles; ++nd)
      *reinterpret_cast<uint32_t*>(so + swz<kChunks>(r, nd) + t * 4) =
          pack2<kDtype>(acc_o[0][nd][2 * half] * inv, acc_o[0][nd][2 * half + 1] * inv);
    if (t == 0 && r < group) p.lse[(int64_t(b) * p.h + h0 + r) * p.lq + i] = lse;
  }
  __syncwarp();
  Element* o =
      static_cast<Element*>(p.o) + b * p.o_batch_stride + h0 * p.o_head_stride + int64_t(i) * p.o_row_stride;
#pragma unroll
  for (int s = 0; s < kGatherMmaRows / kRowsPerStep; ++s) {
    const int r = r0 + s * kRowsPerStep;
    if (r < group && c * 8 < p.dv)
      *reinterpret_cast<uint4*>(o + r * p.o_head_stride + c * 8) =
          *reinterpret_cast<const uint4*>(so + swz<kChunks>(r, c));
  }
#else
  __trap();  // built for an architecture without bf16 mma.sync: the launcher never gets here
#endif
}

template <ScalarKind kDtype, int kHeadDim>
cudaError_t run_gather_mma_(const AttnFwdParams& p, int group, bool shared, cudaStream_t stream) {
  const int64_t tasks = int64_t(p.b) * (p.h / group) * p.lq;
  const int64_t blocks = (tasks + kGatherMmaWarps - 1) / kGatherMmaWarps;  // exact when shared
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  auto launch = [&](auto kernel, int smem) -> cudaError_t {
    SA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<unsigned(blocks), kGatherMmaWarps * 32, smem, stream>>>(p, group);
    return cudaGetLastError();
  };
  if (shared)
    return launch(gather_mma_kernel<kDtype, kHeadDim, true>, GatherMmaLayout<kHeadDim>::kSharedSmemBytes);
  return launch(gather_mma_kernel<kDtype, kHeadDim, false>, GatherMmaLayout<kHeadDim>::kSmemBytes);
}

}  // namespace sparse_attn::cuda
