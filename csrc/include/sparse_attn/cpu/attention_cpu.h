// CPU kernels (C++ with OpenMP): declarations. Definitions in csrc/cpu/attention_cpu.cpp.
// They read the same params structs as the GPU kernels and follow the same semantics; the
// scores of flash, block-sparse and gather attention never exist beyond one tile per thread.
#pragma once

#include "sparse_attn/cpu/tile_gemm.h"
#include "sparse_attn/params.h"
#include "sparse_attn/plan.h"

namespace sparse_attn::cpu {

// Tile sizes of the CPU main loop (plan.h); block-sparse masks need q_block % kBlockM == 0 and
// kv_block % kBlockN == 0.
constexpr int kBlockM = flash_fwd_cpu_tile().block_m;
constexpr int kBlockN = flash_fwd_cpu_tile().block_n;

// softmax(scale * Q K^T + mask) V through the fp32 score matrix params.scores (B, H, Lq, Lk).
void dense_fwd(const AttnFwdParams& params);
// Tiled online-softmax attention over the band of params.window_* (dense when unbounded).
void flash_fwd(const AttnFwdParams& params, const TileGemm& gemm);
// Attention over the key blocks listed in params.kv_* (exact element masks in partial blocks).
void block_sparse_fwd(const AttnFwdParams& params, const TileGemm& gemm);
// Attention of each query over the keys params.indices lists for it (-1 = none).
void gather_fwd(const AttnFwdParams& params);
// The topk largest-scoring visible keys of each query (ties: lower index), ascending, -1 padded.
void topk_select(const TopkSelectParams& params, const TileGemm& gemm);

// Backward passes: dQ, dK, dV of flash / block-sparse / gathered attention from the forward's
// output and LSE (P recomputed from the LSE, as FlashAttention does). One (batch, kv head) per
// thread, so dK and dV are summed over a GQA group without atomics and bit-identically run to run.
void flash_bwd(const AttnBwdParams& params, const TileGemm& gemm);
void block_sparse_bwd(const AttnBwdParams& params, const TileGemm& gemm);
void gather_bwd(const AttnBwdParams& params);

}  // namespace sparse_attn::cpu
