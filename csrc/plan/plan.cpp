// The plan layer's decisions (plan.h): every choice of core, tile shape, schedule and option for
// the attention kernels is made here, once per call, from the params, the device and the
// overrides. Measurements behind the thresholds: docs/PERF_LOG.md.
#include "sparse_attn/plan.h"

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <numeric>
#include <queue>
#include <vector>

#include "sparse_attn/tile_iter.h"

namespace sparse_attn {
namespace {

// TMA wants a 16-byte aligned base and strides that are multiples of 16 bytes (8 elements of a
// 16-bit type); a dimension of size 1 may have any stride (the descriptor replaces it).
bool tma_layout_ok(const void* base, int64_t row_stride, int64_t head_stride, int heads, int64_t batch_stride,
                   int batch) {
  auto ok = [](int64_t stride, int size) { return size == 1 || (stride > 0 && stride % 8 == 0); };
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && row_stride > 0 && row_stride % 8 == 0 &&
         ok(head_stride, heads) && ok(batch_stride, batch);
}

// Why the Hopper core cannot serve this call, or nullptr when it can.
const char* hopper_refusal(const AttnFwdParams& p, Variant v, const DeviceInfo& dev, const PlanOptions& opt) {
  if (dev.cc != 90) return "portable mma.sync core: the device is not compute capability 9.0";
  if (!dev.sm90_kernels)
    return "portable mma.sync core: this build holds no sm_90a kernels (TORCH_CUDA_ARCH_LIST)";
  if (opt.portable_only) return "portable mma.sync core: forced by the plan options";
  if (p.d != p.dv || p.d > 128)
    return "portable mma.sync core: the Hopper core takes head dims up to 128 with Dv == D";
  if (v == Variant::kBlockSparse && (p.q_block != 128 || p.kv_block != 128))
    return "portable mma.sync core: the Hopper core takes block-sparse masks of 128 x 128 blocks only";
  if (!dev.tma) return "portable mma.sync core: the driver cannot encode TMA descriptors";
  const bool aligned = tma_layout_ok(p.q, p.q_row_stride, p.q_head_stride, p.h, p.q_batch_stride, p.b) &&
                       tma_layout_ok(p.k, p.k_row_stride, p.k_head_stride, p.h_kv, p.k_batch_stride, p.b) &&
                       tma_layout_ok(p.v, p.v_row_stride, p.v_head_stride, p.h_kv, p.v_batch_stride, p.b) &&
                       tma_layout_ok(p.o, p.o_row_stride, p.o_head_stride, p.h, p.o_batch_stride, p.b);
  if (!aligned) return "portable mma.sync core: a base or a stride is not 16-byte aligned for TMA";
  return nullptr;
}

// Keys a query row of a band (a window with a left bound) can see; -1 for any other mask.
int64_t band_keys(const AttnFwdParams& p) {
  if (p.window_left < 0) return -1;
  return int64_t(p.window_left) + 1 + (p.window_right >= 0 ? p.window_right : p.lk);
}

// Head dim 64, 128-row tiles, no band: 192-key tiles spread the per-tile work (row maxima, the
// rescale, barriers) over 1.5x the scores, but a ragged last tile computes padding: taken when
// the keys padded to 192 exceed those padded to 128 by at most 5 %. Causal and windowed attention
// keep 128 keys (their diagonal tiles are masked; measured no gain).
bool d64_prefers_192_keys(const AttnFwdParams& p) {
  if (p.window_left >= 0 || p.window_right >= 0) return false;
  const int64_t pad192 = (int64_t(p.lk) + 191) / 192 * 192, pad128 = (int64_t(p.lk) + 127) / 128 * 128;
  return pad192 * 100 <= pad128 * 105;
}

// Head dim 64, dense family: 192-row tiles (three consumers) keep the tensor cores busier per
// tile, 128-row tiles (two, ping-pong) quantise better into waves of one tile per SM. Takes 128
// when its estimated time, rounds x the cost of a 128-row tile relative to a 192-row one, is
// lower (0.72 with 128-key tiles, 0.66 with 192-key tiles: fits to measured times). A band of at
// most 4096 keys per row takes 128 whatever the rounds: its tiles see few key tiles.
void plan_d64_tile(FlashPlan& plan, const AttnFwdParams& p, int sms) {
  if (const int64_t band = band_keys(p); band >= 0 && band <= 4096) {
    plan.tile = FlashTile{128, 128, 12};
    plan.why_tile =
        "head dim 64, a band of at most 4096 keys per row: 128-row tiles (two consumers, ping-pong)";
    return;
  }
  const bool keys192 = d64_prefers_192_keys(p);
  const int64_t bh = int64_t(p.b) * p.h, n = std::max(sms, 1);
  const int64_t rounds192 = ((int64_t(p.lq) + 191) / 192 * bh + n - 1) / n;
  const int64_t rounds128 = ((int64_t(p.lq) + 127) / 128 * bh + n - 1) / n;
  if (rounds128 * (keys192 ? 66 : 72) < rounds192 * 100) {
    plan.tile = keys192 ? FlashTile{128, 192, 12} : FlashTile{128, 128, 12};
    plan.why_tile =
        keys192 ? "head dim 64: 128-row tiles fill the SMs in fewer rounds than 192-row ones; 192-key "
                  "tiles spread the per-tile work (keys padded to 192 within 5 % of those padded to 128)"
                : "head dim 64: 128-row tiles fill the SMs in fewer rounds than 192-row ones; 128-key "
                  "tiles (a masked band, or keys that 192-key tiles would pad by more than 5 %)";
    return;
  }
  plan.tile = FlashTile{192, 128, 16};
  plan.why_tile =
      "head dim 64: 192-row tiles (three consumers) keep the tensor cores busiest at this many tiles";
}

void plan_hopper_tile(FlashPlan& plan, const AttnFwdParams& p, Variant v, const DeviceInfo& dev,
                      const PlanOptions& opt) {
  const FlashTileSet set = flash_fwd_sm90_tiles(padded_head_dim(p.d), v);
  plan.tile = set.tiles[0];
  plan.why_tile = "the Hopper tile of this head dim and variant: 128 query rows (two consumers) x 128 keys";
  if (set.count > 1) plan_d64_tile(plan, p, dev.sms);  // head dim 64, dense family
  if (opt.block_m > 0 || opt.block_n > 0) {
    const int m = opt.block_m > 0 ? opt.block_m : plan.tile.block_m;
    const int n = opt.block_n > 0 ? opt.block_n : plan.tile.block_n;
    for (int i = 0; i < set.count; ++i) {
      if (set.tiles[i].block_m == m && set.tiles[i].block_n == n) {
        plan.tile = set.tiles[i];
        plan.why_tile = "forced by the plan options";
      }
    }
  }
}

}  // namespace

PlanOptions& plan_options() {
  static PlanOptions options;
  return options;
}

FlashPlan plan_flash(const AttnFwdParams& p, Variant v, const DeviceInfo& dev, const PlanOptions& opt) {
  FlashPlan plan;
  plan.variant = v;
  if (dev.cc == 0) {
    plan.core = Core::kCpu;
    plan.tile = flash_fwd_cpu_tile(v, p.lq, p.window_left,
                                   cpu_fp32_products(p.dtype, p.d, p.dv, dev.cpu_bf16_products));
    plan.why_core = "CPU tensors: the OpenMP core";
    plan.why_tile =
        plan.tile.block_m == kCpuWidestRows ? "one thread's tile of scores; 256 query rows (dense or causal, "
                                              ">= 4096 queries, fp32 products): "
                                              "each K/V operand read serves four times the rows"
        : plan.tile.block_m == kCpuWideRows
            ? "one thread's tile of scores; 128 query rows (dense or causal, >= 1024 queries): each "
              "K/V operand read serves twice the rows"
            : "one thread's tile of scores";
    plan.why_schedule = "OpenMP threads take (batch, head, query tile)s dynamically";
    return plan;
  }
  plan.schedule = Schedule::kPerTile;
  plan.why_schedule = "one CTA per query tile";
  if (p.dtype == ScalarKind::kFloat32) {
    plan.core = Core::kCudaCores;
    plan.tile = flash_fwd_fp32_tile();
    plan.why_core = "fp32 inputs: exact fp32 arithmetic on the CUDA cores";
    plan.why_tile = "one warp per 4 query rows, keys 32 at a time";
    return plan;
  }
  if (const char* refusal = hopper_refusal(p, v, dev, opt); refusal != nullptr) {
    plan.core = Core::kPortable;
    plan.tile = flash_fwd_tile(padded_head_dim(p.d), v, v == Variant::kBlockSparse ? p.q_block : 128);
    plan.why_core = refusal;
    plan.why_tile = v == Variant::kBlockSparse ? "the mask's query block; 64-key tiles divide every key block"
                                               : "the portable tile of this head dim";
    return plan;
  }
  plan.core = Core::kHopper;
  plan.persistent_ctas = std::max(dev.sms, 1);
  plan.why_core = "compute capability 9.0, sm_90a kernels, TMA-aligned inputs: the Hopper core";
  plan_hopper_tile(plan, p, v, dev, opt);
  const bool uneven = v == Variant::kBlockSparse || p.window_left >= 0 || p.window_right >= 0;
  if (opt.per_tile_grid) {
    plan.schedule = Schedule::kPerTile;
    plan.why_schedule = "one CTA per tile: forced by the plan options";
  } else if (uneven) {
    plan.schedule = Schedule::kDynamic;
    plan.why_schedule =
        "uneven tiles (causal, window or block-sparse): persistent CTAs take tiles heaviest first from a "
        "counter";
  } else {
    plan.schedule = Schedule::kRoundRobin;
    plan.why_schedule = "even tiles: persistent CTAs, one per SM, round-robin";
  }
  // Merged tile boundary: worth it where tiles are short (block-sparse masks, bands of at most
  // 1024 keys per row); dense and causal attention measured slightly slower with it. Two
  // consumers only: the three-consumer kernel has no turns to merge.
  const int64_t band = band_keys(p);
  const bool short_tiles = v == Variant::kBlockSparse || (band >= 0 && band <= 1024);
  plan.merge_boundary =
      plan.tile.block_m == 128 && (opt.merge_boundary >= 0 ? opt.merge_boundary != 0 : short_tiles);
  return plan;
}

namespace {
int bwd_head_splits_model(const AttnBwdParams& bp, const DeviceInfo& dev, int block_m);
}  // namespace

int bwd_causal_head_group(const AttnFwdParams& p, int head_splits) {
  const int64_t units = int64_t(p.b) * p.h_kv * head_splits;
  const int64_t bytes = int64_t(p.lq) * (p.d + p.dv) * 2 * (p.h_per_kv / head_splits);  // 16-bit Q, dO
  return int(std::clamp<int64_t>((int64_t(16) << 20) / std::max<int64_t>(1, bytes), 1, units));
}

namespace {
// The largest split count <= want that divides the group and keeps the grid's y in range (>= 1).
int usable_head_splits(const AttnFwdParams& p, int want) {
  const int group = p.h_per_kv;
  int splits = std::min(want, std::max(group, 1));
  while (splits > 1 && (group % splits != 0 || int64_t(p.b) * p.h_kv * splits > 65535)) --splits;
  return std::max(splits, 1);
}

// The bwd_head_splits override made usable; 0 when none is set.
int forced_head_splits(const AttnFwdParams& p) {
  const int forced = plan_options().bwd_head_splits;
  return forced <= 0 ? 0 : usable_head_splits(p, forced);
}
}  // namespace

int plan_bwd_head_splits(const AttnBwdParams& bp, const DeviceInfo& dev, int block_m) {
  const AttnFwdParams& p = bp.fwd;
  const int group = p.h_per_kv;
  if (const int forced = forced_head_splits(p); forced > 0) return forced;
  if (group <= 1 || dev.sms <= 0 || p.lk <= 0 || p.lq <= 0) return 1;
  // The model below takes ~0.1-0.3 ms of host time at 2k-8k: once per shape (a training step's
  // shapes repeat), the answers kept (at most 4096 of them).
  using Key = std::array<int64_t, 12>;
  const Key key{p.b,         p.h_kv, group, p.lq,    p.lk,   p.window_left, p.window_right,
                p.kv_offset, p.d,    p.dv,  block_m, dev.sms};
  static std::mutex mutex;
  static std::map<Key, int> known;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = known.find(key); it != known.end()) return it->second;
  }
  const int splits = bwd_head_splits_model(bp, dev, block_m);
  const std::lock_guard<std::mutex> lock(mutex);
  if (known.size() >= 4096) known.clear();
  known.emplace(key, splits);
  return splits;
}

int plan_bwd_block_sparse_head_splits(const AttnBwdParams& bp, const DeviceInfo& dev) {
  const AttnFwdParams& p = bp.fwd;
  if (const int forced = forced_head_splits(p); forced > 0) return forced;
  // The lists are on the GPU, so the host cannot model each key block's walk as
  // plan_bwd_head_splits does. Measured instead (H200, 16k, D = 64 and 128, forced counts over
  // random 10 %, Longformer, causal, causal documents and causal-window masks; docs/PERF_LOG.md):
  // groups of 8 or more query heads on grids of at most ~4 waves of key blocks gain from walks of
  // two heads per CTA (Longformer's global key block 3-8x, random 1.08-1.30x, causal documents
  // 1.07-1.34x, causal 1.02-1.71x; a uniform causal band loses 4-10 %), groups of 4 and larger
  // grids gain little or lose (the fp32 dK, dV reductions of every CTA).
  const int64_t kvs = int64_t(p.b) * p.h_kv, nkb = (int64_t(p.lk) + 127) / 128;
  if (p.h_per_kv < 8 || dev.sms <= 0 || kvs * nkb > 4 * int64_t(dev.sms)) return 1;
  return usable_head_splits(p, std::min(p.h_per_kv / 2, 8));
}

BwdPlan plan_bwd(const AttnBwdParams& bp, Variant v, const DeviceInfo& dev, const PlanOptions& opt,
                 bool deterministic) {
  const AttnFwdParams& p = bp.fwd;
  BwdPlan plan;
  plan.block_n = v == Variant::kBlockSparse && p.kv_block == 64 ? 64 : 128;
  if (dev.cc == 0) {
    plan.core = Core::kCpu;
    plan.block_n = 64;
    plan.why_core = "CPU tensors: the OpenMP kernels (P recomputed from the LSE)";
    plan.why_tile = "64 query rows x 64 keys per product";
    plan.why_schedule =
        "a thread per (batch, kv head); with fewer of them than threads, a head's query tiles split over "
        "threads whose dK and dV partials are summed in a fixed order (deterministic)";
    return plan;
  }
  if (!bwd_tensor_cores(p.dtype, p.d, p.dv)) {
    plan.core = Core::kCudaCores;
    plan.block_m = 1;
    plan.why_core = "fp32 inputs, Dv != D or D > 128: the CUDA-core kernel";
    plan.why_tile = "one query row per warp";
    plan.why_schedule = "dQ per row; dK and dV summed in fp32 with atomics (not deterministic)";
    return plan;
  }
  const bool hopper = dev.cc == 90 && dev.sm90_kernels && dev.tma && !opt.portable_only &&
                      (v == Variant::kWindow || p.kv_block == 128);
  plan.core = hopper ? Core::kHopper : Core::kPortable;
  plan.why_core = hopper ? "compute capability 9.0, sm_90a kernels, TMA: the Hopper backward (a producer "
                           "warpgroup's TMA, two consumer warpgroups of 64 keys, dK and dV in registers)"
                  : opt.portable_only ? "the portable mma.sync kernel: forced by the plan options"
                  : dev.cc == 90 && v == Variant::kBlockSparse && p.kv_block != 128
                      ? "a mask of 64-key blocks: the portable mma.sync kernel's 64-key CTAs"
                      : "the portable mma.sync kernel (dK and dV in registers)";
  // Head dim 64 in the Hopper dense family: 128-row query tiles (a tile's fixed chain of waits
  // and exchanges serves twice the products; docs/PERF_LOG.md).
  plan.block_m = hopper && v == Variant::kWindow && padded_head_dim(p.d) == 64 ? 128 : 64;
  plan.why_tile = plan.block_m == 128 ? "head dim 64: 128-row query tiles, each CTA's keys held in place"
                                      : "64-row query tiles, each CTA's keys held in place";
  plan.dq = !deterministic                    ? DqMode::kAtomic
            : hopper && v == Variant::kWindow ? DqMode::kOrdered
                                              : DqMode::kSeparate;
  plan.head_splits = plan.dq != DqMode::kAtomic ? 1
                     : v == Variant::kWindow    ? plan_bwd_head_splits(bp, dev, plan.block_m)
                                                : plan_bwd_block_sparse_head_splits(bp, dev);
  // CTAs in head groups (bwd_tile_of_cta: key block by key block over head_group units of the
  // grid's y), as many as keep the group's Q and dO (16-bit) within a budget.
  const int64_t units = int64_t(p.b) * p.h_kv * plan.head_splits;
  if (plan.dq == DqMode::kOrdered) {
    // Ordered reductions: key tile n of a head waits for n - 1 at every query tile, so the CTAs
    // of a head that start together start n turns apart; grouped, a wave holds a few key tiles of
    // each head. About 32 MiB per group, counting one query head per kv head. (H100, B2 H16: all
    // heads in one group ran 1.5-1.8x the default at D = 128, L = 4k-16k; grid order 1.2-1.3x at
    // 4k; this rule 1.0-1.14x from 4k; docs/PERF_LOG.md.)
    const int64_t qdo_bytes = int64_t(p.lq) * (p.d + p.dv) * 2;
    plan.head_group =
        int(std::clamp<int64_t>((int64_t(32) << 20) / std::max<int64_t>(1, qdo_bytes), 1, units));
  } else if (v == Variant::kWindow && p.window_left < 0 && p.window_right >= 0) {
    // Causal-type windows, heaviest key blocks first: a group's Q and dO about 16 MiB, a share of L2.
    plan.head_group = bwd_causal_head_group(p, plan.head_splits);
  }
  plan.why_schedule =
      plan.dq == DqMode::kOrdered ? "one CTA per (key block, batch, kv head); dQ added in ascending key-tile "
                                    "order (deterministic mode), heads grouped by ~32 MiB of Q and dO"
      : plan.dq == DqMode::kSeparate
          ? "one CTA per (key block, batch, kv head) for dK and dV; dQ by a kernel "
            "of its own, without atomics (deterministic mode)"
      : plan.head_splits > 1 ? "one CTA per (key block, batch, kv head, head split): few K/V heads, so a "
                               "key block's walk over its query heads is shared, dK and dV summed in fp32"
      : plan.head_group > 0  ? "one CTA per (key block, batch, kv head), heaviest key blocks first in "
                               "head groups of ~16 MiB of Q and dO; dQ summed in fp32"
                             : "one CTA per (key block, batch, kv head); dQ summed in fp32";
  return plan;
}

namespace {

// plan_bwd_head_splits' model (group > 1).
int bwd_head_splits_model(const AttnBwdParams& bp, const DeviceInfo& dev, int block_m) {
  const AttnFwdParams& p = bp.fwd;
  const int group = p.h_per_kv;
  const int64_t kvs = int64_t(p.b) * p.h_kv;
  // Each key block's walk: query tiles (the kernel's iterator, WindowQTiles) per query head.
  const int nkb = (p.lk + 127) / 128;
  std::vector<int64_t> tiles(nkb);
  for (int n = 0; n < nkb; ++n) {
    if (block_m == 128) {
      const WindowQTiles<128, 128> w(bp, 0, 0, n);
      tiles[n] = w.m_end - w.m_begin;
    } else {
      const WindowQTiles<64, 128> w(bp, 0, 0, n);
      tiles[n] = w.m_end - w.m_begin;
    }
  }
  const int64_t total = std::accumulate(tiles.begin(), tiles.end(), int64_t(0)) * kvs * group;
  const int64_t heaviest = *std::max_element(tiles.begin(), tiles.end()) * group;
  // The grid in the kernel's order (bwd_tile_of_cta, the head groups ops_cuda.cpp picks) dealt to
  // the SMs as they free up, a CTA costing its query tiles plus a fixed half tile (K, V, launch) and,
  // split, about a tile per 64 columns of dK and dV added in fp32 (H200: 16/2 heads at 8k, causal,
  // D = 128: 3.51 / 3.04 / 2.75 / 2.77 ms at 1 / 2 / 4 / 8 CTAs per group; this model: 1 / 0.83 /
  // 0.68 / 0.69). Split where the model gains 10 %: below that, the reductions' traffic and the
  // extra launches outweighed it at 2k, and non-causal grids lost 2-3 %.
  const bool causal_type = p.window_left < 0 && p.window_right >= 0;
  const int64_t qdo_bytes = int64_t(p.lq) * (p.d + p.dv) * 2;
  // (Not modelled where many CTAs hold no heavy walk, MHA-like grids: their tail is short already;
  // nor past 2^16 CTAs.)
  const bool model =
      total > 0 && double(heaviest) * 8 * dev.sms > double(total) && kvs * nkb * group <= (1 << 16);
  const auto makespan = [&](int splits) {
    const int64_t units = kvs * splits;
    const int64_t per = group / splits;
    const double extra = 0.5 + (splits > 1 ? (p.d + p.dv) / 128.0 : 0.0);
    const int64_t head_group = causal_type ? bwd_causal_head_group(p, splits) : 0;
    std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
    for (int i = 0; i < dev.sms; ++i) free_at.push(0.0);
    const auto run = [&](int n) {
      const double t = free_at.top();
      free_at.pop();
      free_at.push(t + double(tiles[n] * per) + extra);
    };
    if (head_group > 0) {
      for (int64_t g0 = 0; g0 < units; g0 += head_group)
        for (int n = 0; n < nkb; ++n)
          for (int64_t u = g0; u < std::min(units, g0 + head_group); ++u) run(n);
    } else {
      for (int64_t u = 0; u < units; ++u)
        for (int n = 0; n < nkb; ++n) run(n);
    }
    double end = 0.0;
    while (!free_at.empty()) {
      end = std::max(end, free_at.top());
      free_at.pop();
    }
    return end;
  };
  int best = 1;
  if (model) {
    const double base = makespan(1);
    double best_time = base;
    for (int splits = 2; splits <= group && group % splits == 0 && kvs * splits <= 65535; splits *= 2) {
      const double t = makespan(splits);
      if (t < best_time * 0.98) {
        best = splits;
        best_time = t;
      }
    }
    if (best_time > 0.9 * base) best = 1;
  }
  // Causal-type masks whose group's Q and dO pass 32 MiB: a short walk (a late key block) moves to
  // the next head long before a long one, so the CTAs of a key block group spread over every head's
  // Q and dO and miss L2; a share of the heads keeps them near each other (H200, causal, D = 128,
  // 16k, 64 MiB per group: 16/2 heads 5.65 / 5.05 / 5.06 ms, 64/8 heads 22.5 / 20.2 / 20.7 ms at
  // 1 / 2 / 4 CTAs per group; the model above sees no tail there).
  if (causal_type)
    while (best < group && group % (2 * best) == 0 && kvs * 2 * best <= 65535 &&
           qdo_bytes * group / best > (int64_t(32) << 20))
      best *= 2;
  return best;
}

}  // namespace

GatherPlan plan_gather(const AttnFwdParams& p, const DeviceInfo& dev) {
  GatherPlan plan;
  if (dev.cc == 0) {
    plan.why = "CPU tensors: one thread per query row";
    return plan;
  }
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  auto mult8 = [](int64_t bs, int64_t hs, int64_t rs) { return bs % 8 == 0 && hs % 8 == 0 && rs % 8 == 0; };
  const bool shape_ok = p.dtype != ScalarKind::kFloat32 && p.d == p.dv && p.d <= 128;
  const bool layout_ok = aligned(p.q) && aligned(p.k) && aligned(p.v) && aligned(p.o) &&
                         mult8(p.q_batch_stride, p.q_head_stride, p.q_row_stride) &&
                         mult8(p.k_batch_stride, p.k_head_stride, p.k_row_stride) &&
                         mult8(p.v_batch_stride, p.v_head_stride, p.v_row_stride) &&
                         mult8(p.o_batch_stride, p.o_head_stride, p.o_row_stride);
  if (!shape_ok || !layout_ok) {
    plan.core = Core::kCudaCores;
    plan.why = p.dtype == ScalarKind::kFloat32 ? "fp32 inputs: one warp per query row on the CUDA cores"
               : !shape_ok ? "head dim above 128 or Dv != D: one warp per query row on the CUDA cores"
                           : "rows not 16-byte aligned: one warp per query row on the CUDA cores";
    return plan;
  }
  plan.core = Core::kPortable;
  plan.head_dim = p.d <= 64 ? 64 : 128;
  // Heads per warp: the longest aligned run of heads sharing a kv head and an index set
  // (gcd(H / Hkv, H / Hi)), cut to its largest divisor <= 16.
  const int run = std::max(std::gcd(p.h_per_kv, p.h_per_idx), 1);
  plan.group = std::min(run, kGatherMmaRows);
  while (run % plan.group != 0) --plan.group;
  plan.shared_stages = run % (kGatherMmaWarps * plan.group) == 0;
  plan.why = "tensor cores: each selected K/V row is loaded once for the query heads that share it";
  // Runs of 64 heads (DeepSeek-style sparse attention: one kv head, one index set): the wgmma
  // gather, a token's 64 heads the M = 64 rows of every product.
  if (dev.cc == 90 && dev.sm90_kernels && !plan_options().portable_only && run % kGatherWgmmaHeads == 0 &&
      (p.d == 64 || p.d == 128)) {
    plan.core = Core::kHopper;
    plan.head_dim = p.d;
    plan.why =
        "Hopper wgmma: a token's 64 heads share each selected K/V row and every product (64-row tiles)";
  }
  return plan;
}

GatherBwdPlan plan_gather_bwd(const GatherPlan& forward) {
  GatherBwdPlan plan;
  if (forward.core == Core::kPortable || forward.core == Core::kHopper) {
    plan.core = Core::kPortable;
    plan.head_dim = forward.head_dim;
    plan.group = forward.group;
    plan.shared_stages = forward.shared_stages;
    plan.why =
        plan.shared_stages
            ? "mma.sync: a token's heads per warp, four warps of one token sharing its K/V stages; dK and "
              "dV of a stage reduced once for all of them (fp32 vector reductions), dQ in registers"
            : "mma.sync: a token's heads per warp; dK and dV reduced into fp32 accumulators (vector "
              "reductions), dQ in registers";
  } else if (forward.core == Core::kCudaCores) {
    plan.core = Core::kCudaCores;
    plan.why = "CUDA cores: one query row per warp, dK and dV summed in fp32 with atomics";
  } else {
    plan.why = "CPU tensors: P recomputed from the LSE, one thread per query row";
  }
  return plan;
}

namespace {
// Units per chunk: the fewest chunks of at most `most` units, as even as they can be (a last
// chunk of a few units leaves most of the GPU idle in each of its launches: at 64k, k = 2048 the
// filtered selection's 1024 query tiles fit 254 to a chunk, which made 4 x 254 + 8).
int64_t even_chunk(int64_t units, int64_t most) {
  most = std::clamp<int64_t>(most, 1, std::max<int64_t>(units, 1));
  const int64_t chunks = (units + most - 1) / most;
  return (units + chunks - 1) / std::max<int64_t>(chunks, 1);
}
}  // namespace

SelectPlan plan_select(const TopkSelectParams& p, const DeviceInfo& dev, const PlanOptions& opt) {
  SelectPlan plan;
  const int64_t rows = int64_t(p.b) * p.h_sel * p.lq;
  const int64_t budget = opt.select_workspace_bytes > 0 ? opt.select_workspace_bytes
                                                        : topk_select_workspace_bytes(rows * p.topk * 4);
  plan.scores_stride = (int64_t(p.lk) + 3) / 4 * 4;
  plan.sms = std::max(dev.sms, 1);
  plan.key_tiles = int((int64_t(p.lk) + kTopkScoreBlockN - 1) / kTopkScoreBlockN);
  const int64_t tile_bytes = int64_t(kTopkScoreBlockM) * plan.scores_stride * 4;
  // The tensor-core scorer takes 16-bit inputs of dimension <= 128 with 16-byte aligned rows,
  // when the tile's query heads (HI for the indexer) fit in shared memory and a tile's scores fit
  // in the workspace.
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  auto mult8 = [](int64_t a, int64_t b, int64_t c) { return a % 8 == 0 && b % 8 == 0 && c % 8 == 0; };
  const bool layout_ok = p.indexer ? aligned(p.iq) && aligned(p.ik) &&
                                         mult8(p.iq_batch_stride, p.iq_row_stride, p.iq_head_stride) &&
                                         mult8(p.ik_batch_stride, p.ik_row_stride, 0)
                                   : aligned(p.q) && aligned(p.k) &&
                                         mult8(p.q_batch_stride, p.q_head_stride, p.q_row_stride) &&
                                         mult8(p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  const int64_t heads = p.indexer ? p.hi : 1, dim = topk_score_dim(p);
  const int64_t smem =
      (2 * kTopkScoreBlockN + heads * kTopkScoreBlockM) * dim * 2 + kTopkScoreBlockM * heads * 4;
  const bool tensor_cores =
      p.dtype != ScalarKind::kFloat32 && (p.indexer ? p.di : p.d) <= 128 && layout_ok && smem <= 200 * 1024;
  if (tensor_cores && tile_bytes <= budget) {
    plan.tensor_core_scoring = true;
    plan.n_qtiles = int((int64_t(p.lq) + kTopkScoreBlockM - 1) / kTopkScoreBlockM);
    plan.units = int64_t(p.b) * p.h_sel * plan.n_qtiles;
    plan.per_chunk = even_chunk(plan.units, budget / tile_bytes);
    plan.workspace_bytes = plan.per_chunk * tile_bytes;
    plan.why =
        "tensor-core scoring of 64-row query tiles into a bounded workspace, then a radix select per row";
    // Filtered: the scores stay on chip, each row keeping the keys at or above a threshold from
    // a sample of its scores: about T = max(1.5 k, min(2048, Lk / 8)) of them, in room for
    // 5 T / 3 + 1024 (a row that sees at most half of that keeps every key; the scoring CTAs'
    // slices of the room are uneven by up to a key tile each). The sample, every S-th key tile,
    // holds about T / S = 192 keys above the threshold (its relative error about 1 / sqrt(192) =
    // 7 %, against margins of 33 % below T (for 1.5 k) and 67 % above: a row's candidates decide
    // its selection but about once in 10^5 rows); T's floor of 2048 keeps the sample, and the
    // threshold kernel's pass over it, at most an eighth of the row where k is small. Taken by
    // default when the candidates are at most a quarter of the row. The candidates' bitmap of the
    // row's keys bounds Lk.
    const int kk = std::min(p.topk, p.lk);
    const int target = std::max(3 * kk / 2, std::min(2048, p.lk / 8));
    const int cap = (5 * target + 2) / 3 + 1024;
    int stride = opt.select_filter_stride;
    if (stride == 0) {
      stride = 1;
      while (stride * 2 <= std::min(target / 192, 64)) stride *= 2;
      if (stride < 2 || int64_t(p.lk) < 4 * int64_t(cap)) stride = 0;
    }
    if (stride > 0 && kk > 0) {
      const int64_t cand_smem = candidate_smem_bytes(cap, p.lk);
      SelectPlan f = plan;
      f.filter_stride = stride;
      f.cand_cap = cap;
      f.cand_target = target;
      // A query tile's sample: at least 16 tiles where it sees that many (sample_tile_stride), so
      // under 32 where the plan's stride leaves fewer.
      f.sample_stride = std::max<int64_t>(32, (plan.key_tiles + stride - 1) / stride) * kTopkScoreBlockN;
      const int64_t rows_total = plan.units * kTopkScoreBlockM;
      f.fallback_ctas = int(std::clamp<int64_t>(budget / 4 / (plan.scores_stride * 4), 1,
                                                std::min<int64_t>(4 * int64_t(plan.sms), rows_total)));
      const int64_t fixed = filter_workspace(f, 0).end;
      const int64_t per_tile = filter_workspace(f, kTopkScoreBlockM).end - fixed;
      // (The filtered scorer stages 64 rows x 32 candidates, 16 KiB, next to its tiles.)
      if (cand_smem <= 200 * 1024 && smem + 16 * 1024 <= 200 * 1024 && p.lk >= 1024 &&
          fixed + per_tile <= budget) {
        f.per_chunk = std::max<int64_t>(1, std::min(plan.units, (budget - fixed) / per_tile));
        while (f.per_chunk > 1 && filter_workspace(f, f.per_chunk * kTopkScoreBlockM).end > budget)
          --f.per_chunk;
        f.per_chunk = even_chunk(plan.units, f.per_chunk);
        f.workspace_bytes = filter_workspace(f, f.per_chunk * kTopkScoreBlockM).end;
        f.why =
            "tensor-core scoring of 64-row query tiles; each row keeps the keys at or above a threshold "
            "from a sample of its scores (no scores in memory), then a radix select among them";
        return f;
      }
    }
    return plan;
  }
  plan.units = rows;
  plan.per_chunk = even_chunk(std::max<int64_t>(rows, 1), budget / (plan.scores_stride * 4));
  plan.workspace_bytes = plan.per_chunk * plan.scores_stride * 4;
  plan.why = tensor_cores
                 ? "the workspace holds less than one 64-row tile: each select CTA scores its own row"
                 : "fp32, dimension above 128, misaligned rows or too many indexer heads: each select CTA "
                   "scores its own row on the CUDA cores";
  return plan;
}

FilterWorkspace filter_workspace(const SelectPlan& plan, int64_t rows) {
  auto up = [](int64_t x) { return (x + 15) / 16 * 16; };
  FilterWorkspace w;
  w.sample = 0;
  w.thresholds = up(w.sample + rows * plan.sample_stride * 2);
  w.cand = up(w.thresholds + rows * 4);
  w.counts = up(w.cand + rows * plan.cand_cap * 8);
  w.fallback_rows = up(w.counts + (rows * kMaxFilterSplits + 1) * 4);
  w.fallback_scores = up(w.fallback_rows + rows * 8);
  w.end = up(w.fallback_scores + int64_t(plan.fallback_ctas) * plan.scores_stride * 4);
  return w;
}

int select_score_splits(const SelectPlan& plan, int64_t n) {
  return int(std::clamp<int64_t>((16 * int64_t(plan.sms) + n - 1) / std::max<int64_t>(n, 1), 1,
                                 std::max(plan.key_tiles, 1)));
}

// What one SM's decode CTA streams from DRAM, GB/s (H100 SXM, 1.98 GHz: 72 units of 8k-32k keys,
// one CTA each, 39.5-41.7 GB/s per CTA; 38 puts 80 units, where the walk gained 0.4-2.4 %, below
// the DRAM-saturating count and 88, where it lost up to 2.6 %, above it).
constexpr double kDecodeSmGbps = 38.0;

DecodePlan plan_decode(const DecodeParams& p, const DeviceInfo& dev, const PlanOptions& options) {
  DecodePlan plan;
  if (dev.cc < 80) {
    plan.why = "composite path: the decode kernel needs compute capability 8.0 or newer";
    return plan;
  }
  if (p.dtype == ScalarKind::kFloat32 || p.d != p.dv) {
    plan.why = "composite path: the decode kernel takes bf16/fp16 with Dv == D";
    return plan;
  }
  plan.head_dim = padded_head_dim(p.d);
  // Shared memory per SM: 228 KiB on sm_90, 164 KiB on sm_80/87, 100 KiB on the other sm_8x.
  const int smem_per_sm = dev.cc >= 90 ? 228 << 10 : ((dev.cc == 80 || dev.cc == 87) ? 164 << 10 : 100 << 10);
  const int smem = decode_smem_bytes(plan.head_dim) + (1 << 10);
  if (smem > smem_per_sm) {
    plan.why =
        "composite path: the decode kernel's stages of this head dim exceed the device's shared memory";
    return plan;
  }
  plan.supported = true;
  plan.ctas_per_sm = std::min(smem_per_sm / smem, 16);
  const int rows = p.h_per_kv * p.lq;  // query rows that share a K/V head's loads
  plan.row_tiles = rows <= 16 ? 1 : (rows <= 32 ? 2 : 4);
  plan.row_chunks = (rows + 16 * plan.row_tiles - 1) / (16 * plan.row_tiles);
  // Keys a sequence may attend to, bounded by the capacity, a window with a left bound, or a mask.
  int64_t keys = p.capacity;
  if (p.window_left >= 0 && p.window_right >= 0)
    keys = std::min<int64_t>(keys, int64_t(p.window_left) + p.window_right + p.lq);
  else if (p.window_left >= 0)
    keys = std::min<int64_t>(keys, int64_t(p.window_left) + p.lq);
  if (p.kv_indices != nullptr) keys = std::min<int64_t>(keys, int64_t(p.max_kv_blocks) * p.kv_block);
  plan.est_key_tiles = std::max<int64_t>((keys + kDecodeBlockN - 1) / kDecodeBlockN, 1);
  // Split-KV: as many CTAs as divide the SMs evenly among the units, one per SM (it streams at
  // the HBM rate; a second wave, or an uneven one, only adds partials and a longer tail: H100,
  // one token, B = 1 (8 units) 16 splits 0.4-1.3 % faster than a full wave of 33, B = 12 at 8k
  // (96 units) unsplit 4.2 % faster than 2 splits, 17 or 24 splits 2-6 % slower than 16) -- two
  // per SM where the reads scatter, pages shorter than a key tile or a block mask's blocks, whose
  // latency a second CTA hides (pages of 1 and 16 tokens 3-5 % faster so, 64 equal, 256 1.5-2 %
  // slower; 128-token mask blocks 0-10 % faster; docs/PERF_LOG.md); each split with at least 4
  // key tiles (a CTA's start-up is worth about that much streaming), and the splits' fp32
  // partials (written, then read back by the combine from L2: 8 bytes per output element) no
  // more bytes than the cache they summarise.
  const int64_t units = int64_t(p.b) * p.h_kv * plan.row_chunks;
  const int64_t chunk_rows = std::min<int64_t>(rows, 16 * plan.row_tiles);
  const int64_t cache_bytes = plan.est_key_tiles * kDecodeBlockN * (p.d + p.dv) * 2;
  const bool scattered = p.kv_indices != nullptr || (p.block_table != nullptr && p.page_size < kDecodeBlockN);
  const int64_t slots = int64_t(dev.sms) * (scattered ? plan.ctas_per_sm : 1);
  int64_t splits = units >= dev.sms ? 1 : std::max<int64_t>(slots / std::max<int64_t>(units, 1), 1);
  splits = std::min<int64_t>({splits, plan.est_key_tiles / 4, cache_bytes / (chunk_rows * p.dv * 8), 64});
  if (options.decode_splits > 0)
    splits = std::min<int64_t>({options.decode_splits, plan.est_key_tiles, kDecodeMaxSplits});
  plan.num_splits = int(std::max<int64_t>(splits, 1));
  plan.num_ctas = units * plan.num_splits;
  // Balanced split-KV (decode_fwd_kernel's walk): G CTAs, each an equal run of the units' pieces,
  // where one CTA per piece leaves the SMs unevenly loaded. (a) Fewer CTAs than the SMs that
  // saturate DRAM (an SM streams ~38-40 GB/s): the grid is one CTA per SM (H100, 72 units: 8k /
  // 32k keys 1.004 / 1.025x, paged 1.13-1.15x). (b) Between 1 and 1.75 CTAs per SM: the SMs
  // holding two CTAs end last; two per SM, equal (144-192 units 1.025-1.12x). Elsewhere the
  // walk's costs (a pipeline refilled per unit it enters, the combine: ~8 us at 128 units, 8k
  // keys) outweigh it (96-128 and 256 units: 0.97-0.99x).
  // Only where reads do not scatter and a unit has one row tile (at most 16 query rows: the
  // measured case; several new tokens per sequence were not measured with the walk); with
  // S = G / gcd(units, G) pieces per unit every CTA gets the same number of pieces, each at least
  // a key tile, each CTA at least 16 key tiles, and the partials' buffer (S per row) at most an
  // eighth of the cache's bytes.
  const bool walk_allowed =
      !scattered && plan.row_tiles == 1 && options.decode_splits == 0 && options.decode_ctas == 0;
  const int64_t plain_ctas = plan.num_ctas;
  int64_t walk_ctas = 0;
  if (walk_allowed && plain_ctas < dev.sms && plain_ctas < 0.92 * dev.dram_gbps / kDecodeSmGbps)
    walk_ctas = dev.sms;
  else if (walk_allowed && units > dev.sms && units * 4 <= int64_t(dev.sms) * 7 && plan.ctas_per_sm >= 2)
    walk_ctas = 2 * int64_t(dev.sms);
  if (walk_ctas > 0) {
    const int64_t s_walk = std::min<int64_t>(walk_ctas / std::gcd(units, walk_ctas), plan.est_key_tiles);
    const int64_t rows_total = int64_t(p.b) * p.h * p.lq;
    if (s_walk <= kDecodeMaxSplits && units * plan.est_key_tiles >= 16 * walk_ctas &&
        s_walk * rows_total * p.dv * 4 * 8 <= cache_bytes * units) {
      plan.num_splits = int(s_walk);
      plan.num_ctas = std::min<int64_t>(walk_ctas, units * s_walk);
    }
  }
  if (options.decode_ctas > 0) plan.num_ctas = std::min<int64_t>(options.decode_ctas, plan.num_ctas);
  plan.dependent_launch = dev.cc >= 90 && plan.num_splits > 1;
  if (plan.num_ctas < units * plan.num_splits)
    plan.why =
        "balanced split-KV: one CTA per piece would load the SMs unevenly (or too few of them to "
        "saturate DRAM), so each of the CTAs takes an equal run of the (batch, K/V head) pairs' "
        "key pieces, across pairs, and a combine kernel merges the pieces' LSEs";
  else if (plan.num_splits > 1)
    plan.why =
        "split-KV: (batch, K/V head) pairs leave SMs without a CTA, so each splits "
        "its keys (one CTA per SM, two where the reads scatter) and a combine kernel merges the "
        "splits' LSEs";
  else
    plan.why =
        "one CTA per (batch, K/V head, row chunk): the pairs give every SM a CTA "
        "(or the keys are few), no combine";
  return plan;
}

const char* core_name(Core core) {
  switch (core) {
    case Core::kCpu:
      return "cpu";
    case Core::kCudaCores:
      return "cuda_cores";
    case Core::kPortable:
      return "portable";
    case Core::kHopper:
      return "hopper";
  }
  return "?";
}

const char* dq_mode_name(DqMode mode) {
  constexpr const char* kNames[] = {"atomic", "ordered", "separate"};  // DqMode's values in order
  const int i = int(mode);
  return i >= 0 && i < 3 ? kNames[i] : "?";
}

const char* schedule_name(Schedule schedule) {
  switch (schedule) {
    case Schedule::kPerTile:
      return "per_tile";
    case Schedule::kRoundRobin:
      return "round_robin";
    case Schedule::kDynamic:
      return "dynamic";
  }
  return "?";
}

}  // namespace sparse_attn
