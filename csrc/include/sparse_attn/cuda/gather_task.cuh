// What the gather kernels (gather_mma.cuh, gather_bwd.cuh, gather_wgmma.cuh) share: which task
// a warp or CTA runs and where its rows start.
#pragma once

#include <cstdint>

#include "sparse_attn/params.h"
#include "sparse_attn/plan.h"

namespace sparse_attn::cuda {

// The task of a warp of the mma.sync gathers' CTAs (kGatherMmaWarps warps): query token i of
// batch b, heads h0 .. h0 + group - 1. kShared: the CTA runs (B, groups / 4, Lq), its four warps
// the four consecutive groups of one token; otherwise each warp runs one of (B, groups, Lq),
// false for a warp past the last.
template <bool kShared>
__device__ __forceinline__ bool gather_task(const AttnFwdParams& p, int group, int warp, int& i, int& h0,
                                            int& b) {
  const int groups = p.h / group;
  int hg;
  if constexpr (kShared) {
    const int64_t task = blockIdx.x, quads = groups / kGatherMmaWarps;
    i = int(task % p.lq);
    hg = int((task / p.lq) % quads) * kGatherMmaWarps + warp;
    b = int(task / (int64_t(p.lq) * quads));
  } else {
    const int64_t task = int64_t(blockIdx.x) * kGatherMmaWarps + warp;
    if (task >= int64_t(p.b) * groups * p.lq) return false;
    i = int(task % p.lq), hg = int((task / p.lq) % groups), b = int(task / (int64_t(p.lq) * groups));
  }
  h0 = hg * group;
  return true;
}

// The rows a task reads: its index list, its first head's query row, its kv head's K and V.
template <typename Element>
struct GatherRows {
  const int32_t* idx;
  const Element* q;
  const Element* k;
  const Element* v;
};

template <typename Element>
__device__ __forceinline__ GatherRows<Element> gather_rows(const AttnFwdParams& p, int b, int h0, int hk,
                                                           int i) {
  return {p.indices + b * p.idx_batch_stride + (h0 / p.h_per_idx) * p.idx_head_stride +
              int64_t(i) * p.idx_row_stride,
          static_cast<const Element*>(p.q) + b * p.q_batch_stride + h0 * p.q_head_stride +
              int64_t(i) * p.q_row_stride,
          static_cast<const Element*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride,
          static_cast<const Element*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride};
}

}  // namespace sparse_attn::cuda
