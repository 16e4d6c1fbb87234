// Top-k of one row of fp32 scores by one CTA, with the selection's contract: the kk largest
// (NaN above everything), ties at the threshold going to the lower index, written ascending.
//
// Scores map to order-preserving 32-bit keys. Long rows with moderate k read the row about once:
//   1. a sample (contiguous runs, 1/16 of the row or less) is copied to shared memory and its
//      quantile gives a threshold that about 1.4 k keys of the row should pass;
//   2. one read of the row copies every key at or above it, with its index, into shared memory:
//      each warp its own contiguous segment of the row, in order, into its own region;
//   3. the exact k-th largest key T among those (three digits over shared memory), then each warp
//      writes its taken keys at an offset known from the per-warp counts: ascending, no sort.
// When the sample misjudges (fewer than k pass, or a warp's region overflows), or the row is short
// or k large, the binned select runs instead: a histogram of the top 11 bits finds the k-th key's
// bin, a second read copies that bin's keys to shared memory, a third writes the result; and if
// that bin alone overflows shared memory (thousands of equal scores), a plain 8-bit radix select.
#pragma once

#include <cstdint>

namespace sparse_attn::cuda {

constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kSelectBits = 11;  // first digit: the top 11 bits
constexpr int kSelectBins = 1 << kSelectBits;
// A warp's region of candidates (the sampled path). 512 keeps the CTA at about 41 KiB of shared
// memory: 5 CTAs per SM (1024 would allow 3).
constexpr int kSelectPerWarp = 512;
constexpr int kSelectCandidates = kSelectWarps * kSelectPerWarp;
constexpr int kSampleRun = 128;  // the sample: runs of 128 keys, at most 32 of them
constexpr int kSampleRuns = kSelectCandidates / kSampleRun;

// Order-preserving map of a float score to an unsigned key (larger score, larger key).
__device__ __forceinline__ uint32_t order_key(float f) {
  if (isnan(f)) return 0xffffffffu;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A filtered selection's sample of a query tile that sees n_kt key tiles: every stride-th tile
// (tiles stride - 1, 2 stride - 1, ...), stride = the plan's filter_stride, halved until the
// sample holds at least 16 tiles (1024 keys; short rows' thresholds need them).
__device__ __forceinline__ int sample_tile_stride(int filter_stride, int n_kt) {
  int stride = filter_stride;
  while (stride > 1 && n_kt / stride < 16) stride /= 2;
  return stride;
}

// The float whose order_key is u (0, below every key, maps to a NaN, which no score is below).
__device__ __forceinline__ float order_key_to_float(uint32_t u) {
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

struct SelectSmem {
  unsigned hist[kSelectBins];
  uint32_t cand_key[kSelectCandidates];
  int cand_idx[kSelectCandidates];
  int seg_above[kSelectWarps], seg_gt[kSelectWarps], seg_eq[kSelectWarps], seg_base[kSelectWarps],
      seg_ties[kSelectWarps], seg_cand[kSelectWarps], warp_counts[kSelectWarps];
  int n_cand, need, overflow;
  uint32_t digit;
};

__device__ __forceinline__ int lane_id() { return threadIdx.x % 32; }

// Exclusive prefix sum of x over the warp's lanes, and the warp total.
__device__ __forceinline__ int warp_exclusive_sum(int x, int& total) {
  int inc = x;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane_id() >= o) inc += y;
  }
  total = __shfl_sync(0xffffffffu, inc, 31);
  return inc - x;
}

// hist[bin] += 1 for the lanes with `active`, one shared atomic per distinct bin of the warp.
// Every lane of the warp calls it.
__device__ __forceinline__ void hist_add(unsigned* hist, unsigned bin, bool active) {
  const unsigned lanes = __ballot_sync(0xffffffffu, active);
  if (active) {
    const unsigned peers = __match_any_sync(lanes, bin);
    if (lane_id() == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
  }
}

// hist_add for a round where most active lanes share one bin (the top bits of keys that mostly
// agree there): the first active lane's bin gets one add for every lane that shares it, each
// other active lane adds its own (no match instruction).
__device__ __forceinline__ void hist_add_major(unsigned* hist, unsigned bin, bool active) {
  const unsigned lanes = __ballot_sync(0xffffffffu, active);
  if (lanes == 0u) return;
  const int leader = __ffs(lanes) - 1;
  const unsigned major = __shfl_sync(0xffffffffu, bin, leader);
  const unsigned same = __ballot_sync(0xffffffffu, active && bin == major);
  if (lane_id() == leader)
    atomicAdd(&hist[major], unsigned(__popc(same)));
  else if (active && bin != major)
    atomicAdd(&hist[bin], 1u);
}

// A key's add to a radix round's histogram of 256 digits (u >> shift) & 255, warp-wide: the top
// round (shift 24) through hist_add, or hist_add_major where one digit is most lanes' (kMajor); the
// later rounds, whose digits spread, by plain adds (they rarely collide, and skip the match).
template <bool kMajor>
__device__ __forceinline__ void radix_hist_add(unsigned* hist, uint32_t u, int shift, bool active) {
  if (shift == 24) {
    if constexpr (kMajor)
      hist_add_major(hist, u >> 24, active);
    else
      hist_add(hist, u >> 24, active);
  } else if (active) {
    atomicAdd(&hist[(u >> shift) & 255u], 1u);
  }
}

// A warp: walking the nbins bins (a multiple of 32) from the top, the bin where the running count
// reaches `need` (at most the histogram's total); `need` becomes the count still to take inside it.
__device__ __forceinline__ uint32_t warp_find_bin(const unsigned* hist, int nbins, int& need) {
  const int lane = lane_id(), per = nbins / 32;
  const int hi = nbins - lane * per;  // this lane's bins: [hi - per, hi), walked downwards
  int sum = 0;
  for (int b = hi - 1; b >= hi - per; --b) sum += int(hist[b]);
  int total;
  const int before = warp_exclusive_sum(sum, total);
  const int src = __ffs(__ballot_sync(0xffffffffu, before + sum >= need)) - 1;
  int n = need - before, b = hi - 1;
  if (lane == src)
    for (; b > hi - per && int(hist[b]) < n; --b) n -= int(hist[b]);
  need = __shfl_sync(0xffffffffu, n, src);
  return uint32_t(__shfl_sync(0xffffffffu, b, src));
}

// Warp 0: warp_find_bin's bin and remaining count written to sm.digit / sm.need.
template <typename Smem>  // SelectSmem, or any state with `digit` and `need`
__device__ __forceinline__ void find_bin(const unsigned* hist, int nbins, int need, Smem& sm) {
  const uint32_t digit = warp_find_bin(hist, nbins, need);
  if (lane_id() == 0) {
    sm.digit = digit;
    sm.need = need;
  }
}

// f(j0, keys[4], ok[4]) over this warp's segment [begin, end) of the row, 4 consecutive scores
// per lane per call, calls in ascending order of j0. The loads of four calls are issued together
// (one 16-byte load each when all 4 scores are in range; `s` is 16-byte aligned and `begin` a
// multiple of 4), so that a warp keeps several loads in flight. The trip count is warp-uniform,
// so f may use warp collectives.
template <typename F>
__device__ __forceinline__ void for_segment(const float* s, int begin, int end, F&& f) {
  constexpr int kUnroll = 4;
  for (int base = begin; base < end; base += 128 * kUnroll) {
    float4 x[kUnroll];
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
      const int j0 = base + 128 * r + 4 * lane_id();
      if (j0 + 3 < end) x[r] = *reinterpret_cast<const float4*>(s + j0);
    }
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
      if (base + 128 * r >= end) break;  // warp-uniform
      const int j0 = base + 128 * r + 4 * lane_id();
      uint32_t u[4];
      bool ok[4];
      if (j0 + 3 < end) {
        u[0] = order_key(x[r].x), u[1] = order_key(x[r].y), u[2] = order_key(x[r].z),
        u[3] = order_key(x[r].w);
        ok[0] = ok[1] = ok[2] = ok[3] = true;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ok[e] = j0 + e < end;
          u[e] = ok[e] ? order_key(s[j0 + e]) : 0u;
        }
      }
      f(j0, u, ok);
    }
  }
}

// Exclusive prefix sum of x over the CTA in thread order, and the CTA total (every thread calls it).
__device__ __forceinline__ int cta_exclusive_sum(int x, int* warp_sums, int& total) {
  const int warp = threadIdx.x / 32;
  int warp_total;
  int before = warp_exclusive_sum(x, warp_total);
  if (lane_id() == 0) warp_sums[warp] = warp_total;
  __syncthreads();
  total = 0;
#pragma unroll
  for (int w = 0; w < kSelectWarps; ++w) {
    before += w < warp ? warp_sums[w] : 0;
    total += warp_sums[w];
  }
  __syncthreads();
  return before;
}

// Exclusive prefix count of `flag` over the CTA in thread order, and the CTA total.
__device__ __forceinline__ int cta_exclusive_count(bool flag, int* warp_counts, int& total) {
  return cta_exclusive_sum(flag ? 1 : 0, warp_counts, total);
}

// The fallback: four 8-bit histogram passes over the row, then an ordered write.
__device__ inline void radix_select_plain(const float* s, int nv, int kk, int32_t* out, SelectSmem& sm) {
  if (threadIdx.x == 0) {
    sm.digit = 0;
    sm.need = kk;
  }
  uint32_t mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int x = threadIdx.x; x < 256; x += kSelectThreads) sm.hist[x] = 0;
    __syncthreads();
    const uint32_t prefix = sm.digit;
    for (int j = threadIdx.x; j < nv; j += kSelectThreads) {
      const uint32_t u = order_key(s[j]);
      if ((u & mask) == prefix) atomicAdd(&sm.hist[(u >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int need = sm.need, digit = 255;
      for (; digit > 0 && int(sm.hist[digit]) < need; --digit) need -= int(sm.hist[digit]);
      sm.digit = prefix | (uint32_t(digit) << shift);
      sm.need = need;
    }
    mask |= 255u << shift;
    __syncthreads();
  }
  const uint32_t threshold = sm.digit;
  const int ties = sm.need;
  int written = 0, ties_seen = 0;
  for (int base = 0; base < nv; base += kSelectThreads) {
    const int j = base + threadIdx.x;
    const uint32_t u = j < nv ? order_key(s[j]) : 0u;
    const bool eq = j < nv && u == threshold;
    int eq_total;
    const int eq_rank = ties_seen + cta_exclusive_count(eq, sm.warp_counts, eq_total);
    const bool take = j < nv && (u > threshold || (eq && eq_rank < ties));
    int take_total;
    const int pos = written + cta_exclusive_count(take, sm.warp_counts, take_total);
    if (take) out[pos] = j;
    written += take_total;
    ties_seen += eq_total;
  }
}

// Thread 0: each warp's output offset and its share of the `ties` keys equal to the threshold (the
// lowest-indexed first, so earlier segments first), from the per-segment counts of keys above the
// threshold (seg_above + seg_gt) and at it (seg_eq). The caller synchronises before and after.
__device__ __forceinline__ void segment_offsets(int ties, SelectSmem& sm) {
  if (threadIdx.x != 0) return;
  int base = 0;
  for (int w = 0; w < kSelectWarps; ++w) {
    const int t = min(ties, sm.seg_eq[w]);
    ties -= t;
    sm.seg_ties[w] = t;
    sm.seg_base[w] = base;
    base += sm.seg_above[w] + sm.seg_gt[w] + t;
  }
}

// The `need`-th largest key over keys in shared memory, digit by digit: rounds of 11 + 11 + 10
// bits from the top, starting at `round0` with the digits of the earlier rounds in `prefix` (only
// keys matching them count); each_key(f) calls f(key) for the keys this thread owns. Returns the
// key; `need` becomes the number of keys equal to it to take. With round_end < 3 it stops early:
// the key's low bits are then 0 (a lower bound of the key, all that the sample's threshold needs).
template <typename EachKey, typename Smem>  // Smem: SelectSmem, or any state with hist, digit, need
__device__ __forceinline__ uint32_t refine_threshold(EachKey each_key, uint32_t prefix, int round0, int& need,
                                                     Smem& sm, int round_end = 3) {
  constexpr int kShift[3] = {21, 10, 0}, kBinsOf[3] = {2048, 2048, 1024};
  uint32_t known = round0 == 0 ? 0u : ~0u << kShift[round0 - 1];
  for (int round = round0; round < round_end; ++round) {
    const int shift = kShift[round], nbins = kBinsOf[round];
    for (int x = threadIdx.x; x < nbins; x += kSelectThreads) sm.hist[x] = 0;
    __syncthreads();
    each_key([&](uint32_t u) {
      if ((u & known) == prefix) atomicAdd(&sm.hist[(u >> shift) & uint32_t(nbins - 1)], 1u);
    });
    __syncthreads();
    if (threadIdx.x < 32) find_bin(sm.hist, nbins, need, sm);
    __syncthreads();
    prefix |= sm.digit << shift;
    known |= uint32_t(nbins - 1) << shift;
    need = sm.need;
    __syncthreads();  // sm.digit / sm.need are rewritten by the next round
  }
  return prefix;
}

// The binned select (three reads of the row); see the file comment.
__device__ inline void radix_select_binned(const float* s, int nv, int kk, int32_t* out, SelectSmem& sm) {
  const int tid = threadIdx.x, warp = tid / 32, lane = lane_id();
  const int seg = ((nv + kSelectWarps - 1) / kSelectWarps + 3) / 4 * 4;
  const int begin = min(nv, warp * seg), end = min(nv, begin + seg);

  // 1. Histogram of the top 11 bits; the bin of the kk-th largest key.
  for (int x = tid; x < kSelectBins; x += kSelectThreads) sm.hist[x] = 0;
  if (tid < kSelectWarps) sm.seg_gt[tid] = sm.seg_eq[tid] = 0;
  if (tid == 0) sm.n_cand = 0;
  __syncthreads();
  // (Plain adds: a row's scores spread over the bins, and hist_add's match cost more than the
  // collisions it saves.)
  for_segment(s, begin, end, [&](int, const uint32_t (&u)[4], const bool (&ok)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (ok[e]) atomicAdd(&sm.hist[u[e] >> (32 - kSelectBits)], 1u);
  });
  __syncthreads();
  if (warp == 0) find_bin(sm.hist, kSelectBins, kk, sm);
  __syncthreads();
  const uint32_t bin = sm.digit;
  int need = sm.need;
  if (sm.hist[bin] > unsigned(kSelectCandidates)) {  // CTA-uniform
    __syncthreads();
    radix_select_plain(s, nv, kk, out, sm);
    return;
  }

  // 2. The bin's keys to shared memory; keys above the bin counted per segment.
  int above = 0;
  for_segment(s, begin, end, [&](int j0, const uint32_t (&u)[4], const bool (&ok)[4]) {
    bool any = false;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t b = u[e] >> (32 - kSelectBits);
      above += ok[e] && b > bin;
      any |= ok[e] && b == bin;
    }
    if (!__any_sync(0xffffffffu, any)) return;  // the bin is a few % of the row: usually none here
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool cand = ok[e] && (u[e] >> (32 - kSelectBits)) == bin;
      const unsigned lanes = __ballot_sync(0xffffffffu, cand);
      int base = 0;
      if (lane == 0 && lanes != 0) base = atomicAdd(&sm.n_cand, __popc(lanes));
      base = __shfl_sync(0xffffffffu, base, 0);
      if (cand) {
        const int pos = base + __popc(lanes & ((1u << lane) - 1u));
        sm.cand_key[pos] = u[e];
        sm.cand_idx[pos] = j0 + e;
      }
    }
  });
  int above_total;
  warp_exclusive_sum(above, above_total);
  if (lane == 0) sm.seg_above[warp] = above_total;
  __syncthreads();

  // 3. The exact threshold: the remaining 21 bits as an 11-bit and a 10-bit digit.
  const int m = sm.n_cand;
  const uint32_t threshold = refine_threshold(
      [&](auto f) {
        for (int c = tid; c < m; c += kSelectThreads) f(sm.cand_key[c]);
      },
      bin << (32 - kSelectBits), 1, need, sm);  // need = ties at the threshold to take, lowest index first
  for (int c = tid; c < m; c += kSelectThreads) {
    const uint32_t u = sm.cand_key[c];
    const int w = sm.cand_idx[c] / seg;
    if (u > threshold)
      atomicAdd(&sm.seg_gt[w], 1);
    else if (u == threshold)
      atomicAdd(&sm.seg_eq[w], 1);
  }
  __syncthreads();
  segment_offsets(need, sm);
  __syncthreads();

  // 4. Ascending write: each warp its own segment, from its offset.
  int pos = sm.seg_base[warp], eq_seen = 0;
  const int quota = sm.seg_ties[warp];
  for_segment(s, begin, end, [&](int j0, const uint32_t (&u)[4], const bool (&ok)[4]) {
    int n_eq = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) n_eq += ok[e] && u[e] == threshold;
    int eq_total;
    int rank = eq_seen + warp_exclusive_sum(n_eq, eq_total);
    bool take[4];
    int n_take = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool eq = ok[e] && u[e] == threshold;
      take[e] = ok[e] && (u[e] > threshold || (eq && rank < quota));
      rank += eq;
      n_take += take[e];
    }
    int take_total;
    int p = pos + warp_exclusive_sum(n_take, take_total);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (take[e]) out[p++] = j0 + e;
    pos += take_total;
    eq_seen += eq_total;
  });
}

// The sampled select (one read of the row, plus a 1/16 sample); false when it cannot decide
// (its shared state is then to be reset by the caller's fallback).
__device__ inline bool radix_select_sampled(const float* s, int nv, int kk, int32_t* out, SelectSmem& sm) {
  const int tid = threadIdx.x, warp = tid / 32, lane = lane_id();
  // 1. The sample: runs of kSampleRun keys every `stride` keys; its threshold T0 is the key that
  //    about 1.4 kk keys of the row should reach (its top 22 bits: finer would not change much).
  const int stride = max(2048, ((nv + kSampleRuns - 1) / kSampleRuns + 3) / 4 * 4);
  const int runs = (nv + stride - 1) / stride;
  for (int r = warp; r < runs; r += kSelectWarps) {
    const int j0 = r * stride + 4 * lane;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      sm.cand_key[r * kSampleRun + 4 * lane + e] = j0 + e < nv ? order_key(s[j0 + e]) : 0u;
  }
  if (tid < kSelectWarps) sm.seg_cand[tid] = 0;
  if (tid == 0) sm.overflow = 0;
  __syncthreads();
  const int sampled = runs * kSampleRun;  // padding keys are 0: below every real key
  int need = max(1, int((int64_t(kk) * 7 / 5 * sampled + nv - 1) / nv));
  if (need > sampled) return false;
  const uint32_t t0 = refine_threshold(
      [&](auto f) {
        for (int c = tid; c < sampled; c += kSelectThreads) f(sm.cand_key[c]);
      },
      0u, 0, need, sm, 2);

  // 2. Every key >= T0, with its index, into the warp's region, in the order of the row.
  const int seg = ((nv + kSelectWarps - 1) / kSelectWarps + 3) / 4 * 4;
  const int begin = min(nv, warp * seg), end = min(nv, begin + seg);
  uint32_t* rkey = sm.cand_key + warp * kSelectPerWarp;
  int* ridx = sm.cand_idx + warp * kSelectPerWarp;
  int filled = 0;
  bool full = false;
  for_segment(s, begin, end, [&](int j0, const uint32_t (&u)[4], const bool (&ok)[4]) {
    if (full) return;  // warp-uniform
    int n = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) n += ok[e] && u[e] >= t0;
    int total;
    int pos = filled + warp_exclusive_sum(n, total);
    if (filled + total > kSelectPerWarp) {
      full = true;
      return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (ok[e] && u[e] >= t0) rkey[pos] = u[e], ridx[pos++] = j0 + e;
    filled += total;
  });
  if (lane == 0) {
    sm.seg_cand[warp] = filled;
    if (full) atomicOr(&sm.overflow, 1);
  }
  __syncthreads();
  int m = 0;
#pragma unroll
  for (int w = 0; w < kSelectWarps; ++w) m += sm.seg_cand[w];
  if (sm.overflow != 0 || m < kk) return false;  // CTA-uniform

  // 3. The exact threshold among the candidates (which hold every key >= the kk-th largest).
  const int mine = sm.seg_cand[warp];
  need = kk;
  const uint32_t threshold = refine_threshold(
      [&](auto f) {
        for (int c = lane; c < mine; c += 32) f(rkey[c]);
      },
      0u, 0, need, sm);
  int gt = 0, eq = 0;
  for (int c = lane; c < mine; c += 32) {
    gt += rkey[c] > threshold;
    eq += rkey[c] == threshold;
  }
  int gt_total, eq_total;
  warp_exclusive_sum(gt, gt_total);
  warp_exclusive_sum(eq, eq_total);
  if (lane == 0) sm.seg_above[warp] = 0, sm.seg_gt[warp] = gt_total, sm.seg_eq[warp] = eq_total;
  __syncthreads();
  segment_offsets(need, sm);
  __syncthreads();

  // 4. Each warp writes its taken candidates, in order, from its offset.
  int pos = sm.seg_base[warp], ties_seen = 0;
  const int quota = sm.seg_ties[warp];
  for (int c0 = 0; c0 < mine; c0 += 32) {
    const int c = c0 + lane;
    const uint32_t u = c < mine ? rkey[c] : 0u;
    const bool is_eq = c < mine && u == threshold;
    const unsigned eqs = __ballot_sync(0xffffffffu, is_eq);
    const bool take =
        c < mine && (u > threshold || (is_eq && ties_seen + __popc(eqs & ((1u << lane) - 1u)) < quota));
    const unsigned takes = __ballot_sync(0xffffffffu, take);
    if (take) out[pos + __popc(takes & ((1u << lane) - 1u))] = ridx[c];
    pos += __popc(takes);
    ties_seen += __popc(eqs);
  }
  return true;
}

// out[0, kk) = the selection over s[0, nv) (0 < kk < nv); every thread of the CTA calls it.
__device__ inline void radix_select(const float* s, int nv, int kk, int32_t* out, SelectSmem& sm) {
  // The sampled path wants a sample much larger than its target and candidates that fit with room.
  if (nv >= 8192 && int64_t(kk) * 7 / 5 <= kSelectCandidates * 3 / 4 &&
      radix_select_sampled(s, nv, kk, out, sm))
    return;
  __syncthreads();
  radix_select_binned(s, nv, kk, out, sm);
}

}  // namespace sparse_attn::cuda
