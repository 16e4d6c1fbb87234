// The plan layer: which kernel serves a call, with which tile shape, schedule and options, and
// why. One function per op family decides (plan.cpp); the glue fills the inputs (params, the
// device, the overrides), the launchers obey the plan and decide nothing. Host-only, torch-free
// and CUDA-free, so every build (a CPU-only one too) can plan, and sparse_attn.explain can show a
// plan for a GPU it does not have.
//
// The tile tables below are the kernels' compile-time shapes: the plan chooses among them, the
// launchers instantiate exactly them, and nothing else repeats them.
#pragma once

#include <cstdint>

#include "sparse_attn/params.h"

namespace sparse_attn {

// Which key tiles a query tile visits (tile_iter.h): dense, causal or local (WindowTiles), or
// the listed blocks of a block-sparse mask (BlockSparseTiles).
enum class Variant : int { kWindow = 0, kBlockSparse = 1 };

struct FlashTile {
  int block_m, block_n, warps;
};

// Portable tensor-core core (mma.sync, sm_80+). Block-sparse tiles are 64 keys wide so that 64-
// and 128-wide key blocks divide evenly; a mask of 64-row query blocks runs 64-row tiles.
constexpr FlashTile flash_fwd_tile(int head_dim, Variant v, int block_m) {
  if (v == Variant::kBlockSparse && block_m == 64) return {64, 64, 4};
  if (v == Variant::kWindow && head_dim <= 64) return {128, 128, 4};
  return {128, 64, head_dim >= 256 ? 8 : 4};
}

// Hopper core (wgmma/TMA, sm_90a): 64 query rows per consumer warpgroup plus one producer
// warpgroup; the tiles instantiated for a (head dim, variant). Head dim 64 has half the GEMM work
// per score: three consumers (192 rows) keep the tensor cores busy through the softmax, while
// two (128 rows) quantise better into waves and take 192-key tiles. Block-sparse masks run here
// with 128 x 128 blocks only (one list entry per key tile).
struct FlashTileSet {
  int count;
  FlashTile tiles[3];
};
constexpr FlashTileSet flash_fwd_sm90_tiles(int head_dim, Variant v) {
  if (v == Variant::kWindow && head_dim <= 64) return {3, {{192, 128, 16}, {128, 128, 12}, {128, 192, 12}}};
  return {1, {{128, 128, 12}}};
}

// CUDA-core fp32 core (any head dim up to 256; exact fp32 arithmetic).
constexpr FlashTile flash_fwd_fp32_tile() { return {16, 32, 4}; }

// CPU core: query rows x keys per tile of one thread; block-sparse masks need q_block % 32 == 0
// and kv_block % 64 == 0 (64 and 128 do).
constexpr FlashTile flash_fwd_cpu_tile() { return {64, 64, 1}; }
// Dense and causal attention (no left bound) over at least 1024 queries take 128-row tiles: each
// key/value operand read serves twice the rows (their reads from beyond L2 bound the fp32 products
// at D = 128), at the price of one masked diagonal tile per 128 rows; short or banded rows keep 64.
// On fp32 products from 4096 queries, 256 rows halve those reads again (8-10 % faster at 4k-8k, D =
// 128, on a Xeon without AMX; docs/PERF_LOG.md); the bf16 matrix products keep 128 (not measured).
constexpr int kCpuWideRows = 128;
constexpr int kCpuWidestRows = 256;
inline FlashTile flash_fwd_cpu_tile(Variant v, int lq, int window_left, bool fp32_products) {
  if (v == Variant::kWindow && window_left < 0) {
    if (fp32_products && lq >= 4096) return {kCpuWidestRows, 64, 1};
    if (lq >= 1024) return {kCpuWideRows, 64, 1};
  }
  return flash_fwd_cpu_tile();
}
// Whether the CPU kernels' products run in fp32: every dtype but bf16 on a CPU with bf16 matrix
// instructions (bf16_products) and head dims that fit their operand layout.
constexpr bool cpu_fp32_products(ScalarKind dtype, int d, int dv, bool bf16_products) {
  return !(dtype == ScalarKind::kBFloat16 && bf16_products && d % 16 == 0 && dv % 16 == 0);
}

// The compiled head dimension that serves a head dimension d <= 256 (a multiple of 8): loads
// are predicated on d, so padding costs time but never correctness.
constexpr int padded_head_dim(int d) { return d <= 64 ? 64 : (d <= 128 ? 128 : 256); }

// ---- top-k constants shared by the plan and the top-k kernels ----

// Tensor-core scoring (topk_score.cuh): 64-row query tiles against 64-key tiles.
constexpr int kTopkScoreBlockM = 64;
constexpr int kTopkScoreBlockN = 64;

// Bytes of the selection's fp32 score workspace, given the bytes of the index tensor it fills:
// chunks of query rows are scored and selected one after another within it. Twice the output,
// at least 256 MiB, at most 2 GiB: memory stays O(Lq * k), and at long context a chunk holds
// enough rows to fill the GPU.
constexpr int64_t topk_select_workspace_bytes(int64_t index_bytes) {
  const int64_t lo = int64_t(256) << 20, hi = int64_t(2) << 30, want = 2 * index_bytes;
  return want < lo ? lo : (want > hi ? hi : want);
}

// Padded dimension of the scored dot products (64 or 128).
inline int topk_score_dim(const TopkSelectParams& p) { return (p.indexer ? p.di : p.d) <= 64 ? 64 : 128; }

// Heads per warp of the tensor-core gather (one m16 tile).
constexpr int kGatherMmaRows = 16;
// Warps per CTA of the tensor-core gather (one group of heads each).
constexpr int kGatherMmaWarps = 4;
// Heads per CTA of the Hopper gather (gather_wgmma.cuh: the M = 64 rows of its wgmma tiles).
constexpr int kGatherWgmmaHeads = 64;

// Whether a call's inputs go to kernels that copy 16-byte chunks (every 16-bit flash and
// block-sparse kernel; the tensor-core gather): the glue then copies inputs whose base or
// strides are not 16-byte aligned before the params and the plan are made.
constexpr bool flash_needs_aligned_inputs(ScalarKind dtype) { return dtype != ScalarKind::kFloat32; }
constexpr bool gather_needs_aligned_inputs(ScalarKind dtype, int64_t d, int64_t dv) {
  return dtype != ScalarKind::kFloat32 && d == dv && d <= 128;
}

// ---- inputs of a plan besides the params ----

// kCudaCores: fp32 or gathered attention without tensor cores; kPortable: mma.sync tensor cores
// (sm_80+); kHopper: wgmma/TMA (sm_90a).
enum class Core : int { kCpu = 0, kCudaCores = 1, kPortable = 2, kHopper = 3 };
enum class Schedule : int {
  kPerTile = 0,     // one CTA per query tile, dispatched by the hardware (OpenMP threads on the CPU)
  kRoundRobin = 1,  // persistent CTAs, one per SM, taking tiles in a fixed order (even tiles)
  kDynamic = 2,     // persistent CTAs taking the next tile from a global counter (uneven tiles)
};

// The device a call runs on. cc = 0: the CPU.
struct DeviceInfo {
  int cc = 0;                      // compute capability, major * 10 + minor
  int sms = 0;                     // streaming multiprocessors
  bool sm90_kernels = false;       // this build holds the sm_90a kernels
  bool tma = false;                // the driver can encode TMA descriptors
  bool cpu_bf16_products = false;  // CPU: bf16 matrix instructions (AMX) the CPU kernels use
  double dram_gbps = 0;            // peak DRAM bandwidth, GB/s, from the memory clock and bus (0: unknown)
};

// Overrides of the plan's choices, for tests and benchmarks (set through the private op
// sparse_attn::_set_plan_options; never read from the environment). 0 / -1: decided by the plan.
struct PlanOptions {
  bool portable_only = false;          // never the Hopper core
  int block_m = 0, block_n = 0;        // a Hopper tile of the table (taken where the table has it)
  bool per_tile_grid = false;          // Hopper: one CTA per tile instead of persistent CTAs
  int merge_boundary = -1;             // Hopper: 0 / 1 forces the merged tile boundary off / on
  int64_t select_workspace_bytes = 0;  // top-k selection's score workspace
  int select_filter_stride = 0;        // filtered selection's sample stride (key tiles); -1: never filtered
  int decode_splits = 0;               // attention_with_kvcache's split-KV count (capped at the key tiles)
  int decode_ctas = 0;      // attention_with_kvcache's grid (capped at units * splits); -1: one CTA per piece
  int bwd_head_splits = 0;  // Hopper backward: CTAs per key block's GQA group (a divisor of it)
};

// The process's overrides (one struct, read by every plan; defaults until a test sets them).
PlanOptions& plan_options();

// ---- plans ----

struct FlashPlan {
  Core core = Core::kCpu;
  Variant variant = Variant::kWindow;
  FlashTile tile{};
  Schedule schedule = Schedule::kPerTile;
  int persistent_ctas = 0;      // Hopper, persistent schedules: CTAs of the grid (one per SM)
  bool merge_boundary = false;  // Hopper: a tile's last P V issued with the next tile's first Q K^T
  // Why: the core (and, when the Hopper core is not taken, what kept it out), the tile, the
  // schedule. Static strings.
  const char* why_core = "";
  const char* why_tile = "";
  const char* why_schedule = "";
};

// flash_fwd (Variant::kWindow) and block_sparse_fwd (Variant::kBlockSparse; params carry the
// mask's block sizes) with params as set_params_* filled them.
FlashPlan plan_flash(const AttnFwdParams& params, Variant variant, const DeviceInfo& device,
                     const PlanOptions& options);

struct GatherPlan {
  // kHopper: the wgmma gather (64 heads per CTA); kPortable: the mma.sync gather; kCudaCores: one
  // warp per query row.
  Core core = Core::kCpu;
  int head_dim = 0;  // tensor-core gathers: the compiled head dim (64 or 128)
  // mma.sync gather: query heads per warp (rows of its m16 tile). Also set for kHopper: the
  // backward (gather_bwd.cuh) runs the mma.sync layout.
  int group = 1;
  // mma.sync gathers: four consecutive groups read one kv head and one index set (the run of heads
  // sharing both, gcd(H / Hkv, H / Hi), holds a whole number of four-group blocks), so a CTA's four
  // warps are those groups of one token and share its K/V stages.
  bool shared_stages = false;
  const char* why = "";
};

// gather_fwd: attention over each query's listed keys (params.indices).
GatherPlan plan_gather(const AttnFwdParams& params, const DeviceInfo& device);

// Top-k's backward (gather_bwd.cuh), from its forward's plan: the tensor-core gathers (the Hopper
// wgmma one too) have theirs on the mma.sync layout, a token's heads per warp (four warps of one
// token sharing K/V stages where the forward's do), dK and dV reduced into fp32 accumulators; the
// CUDA-core gather's is the kernel of one query row per warp.
struct GatherBwdPlan {
  Core core = Core::kCpu;  // kPortable (mma.sync), kCudaCores or kCpu
  int head_dim = 0;        // kPortable: the compiled head dim (64 or 128)
  int group = 1;           // kPortable: query heads per warp
  bool shared_stages = false;
  const char* why = "";
};
GatherBwdPlan plan_gather_bwd(const GatherPlan& forward);

// The tensor-core backward of the dense family (reductions in any order, query tiles of block_m rows):
// how many CTAs share each key block's walk over its GQA group's query heads
// (AttnBwdParams::head_splits; a power of two dividing h_per_kv). One CTA walks a key block over
// every head of the group: where few (batch, kv head)s hold many query heads, the heaviest walk
// (a causal mask's first key block) is a large share of an SM's load and the grid's last CTAs run
// it alone. Split where a model of the grid's tail gains 10 %, and for causal-type masks until the
// group's Q and dO fit 32 MiB (plan.cpp).
int plan_bwd_head_splits(const AttnBwdParams& params, const DeviceInfo& device, int block_m);

// The same for block-sparse masks, whose transposed lists (bwd_host.cu) are on the GPU: a rule by
// the group's size and the grid's (plan.cpp).
int plan_bwd_block_sparse_head_splits(const AttnBwdParams& params, const DeviceInfo& device);

// The Hopper backward's head groups for causal-type masks (AttnBwdParams::head_group): as many of
// the grid's y units ((batch, kv head, split), head_splits per kv head) as keep their Q and dO
// within 16 MiB.
int bwd_causal_head_group(const AttnFwdParams& params, int head_splits);

// The tensor-core backward takes 16-bit inputs with Dv == D <= 128 (kHeadDim 64 or 128); the
// CUDA-core kernel the rest.
constexpr bool bwd_tensor_cores(ScalarKind dtype, int64_t d, int64_t dv) {
  return dtype != ScalarKind::kFloat32 && d == dv && d <= 128;
}

// How the backward adds each query tile's dQ: kAtomic, reductions in any order; kOrdered, the
// Hopper dense family's reductions in ascending key-tile order (deterministic mode); kSeparate,
// the key-major kernel computes dK and dV only and a query-major kernel dQ (deterministic mode
// elsewhere).
enum class DqMode : int { kAtomic = 0, kOrdered = 1, kSeparate = 2 };

struct BwdPlan {
  Core core = Core::kCpu;
  int block_m = 64;     // query rows per tile (the tensor-core kernels)
  int block_n = 128;    // keys per CTA
  int head_splits = 1;  // CTAs sharing a key block's walk over its GQA group (AttnBwdParams::head_splits)
  int head_group =
      0;  // grid y units walked key block by key block (AttnBwdParams::head_group; 0: grid order)
  DqMode dq = DqMode::kAtomic;
  const char* why_core = "";
  const char* why_tile = "";
  const char* why_schedule = "";
};

// flash_bwd (Variant::kWindow) and block_sparse_bwd (kBlockSparse; params.fwd carries the mask's
// block sizes) for the forward params a call filled; deterministic: torch's deterministic mode.
// The CUDA glue runs what this returns; explain shows it.
BwdPlan plan_bwd(const AttnBwdParams& params, Variant variant, const DeviceInfo& device,
                 const PlanOptions& options, bool deterministic);

struct SelectPlan {
  bool tensor_core_scoring = false;  // topk_score fills the workspace 64-row query tiles at a time
  int64_t workspace_bytes = 0;       // the fp32 score workspace (bounded: never B * H * Lq * Lk)
  int64_t scores_stride = 0;         // floats per workspace row (>= Lk, a multiple of 4)
  // Tensor-core scoring: query tiles over (B, Hs, ceil(Lq / 64)), per_chunk of them at a time;
  // CUDA-core scoring: rows over (B, Hs, Lq), per_chunk of them at a time.
  int64_t units = 0, per_chunk = 0;
  int n_qtiles = 0;   // query tiles per (b, hs) plane
  int key_tiles = 0;  // 64-key tiles
  int sms = 0;
  // Filtered selection (TopkSelectParams): the sample of every filter_stride-th key tile
  // (sample_stride 16-bit keys per row), candidates per row, and fallback_ctas rows of scores_stride
  // floats for the rows the candidates cannot decide. 0: the scores go through the workspace.
  int filter_stride = 0;
  int cand_cap = 0, cand_target = 0;  // room per row; the candidates its threshold aims at
  int64_t sample_stride = 0;
  int fallback_ctas = 0;
  const char* why = "";
};

// Scoring CTAs per query tile of a filtered selection at most: each has its own slice of a row's
// candidates (cand_cap / n_splits of them).
constexpr int kMaxFilterSplits = 8;

// Shared memory of a filtered selection's candidates kernel (a CTA per row): its state (at most
// kCandidateStateBytes, which topk_select.cuh checks against the state's type), the candidates'
// keys (a bitmap of the row's keys tied at the k-th one takes their place once they are read),
// and a bitmap of the row's keys taken. The plan bounds it, the launcher allocates it.
constexpr int64_t kCandidateStateBytes = 2048;
constexpr int64_t candidate_key_words(int64_t cand_cap, int64_t lk) {
  return cand_cap > (lk + 31) / 32 ? cand_cap : (lk + 31) / 32;
}
constexpr int64_t candidate_smem_bytes(int64_t cand_cap, int64_t lk) {
  return kCandidateStateBytes + candidate_key_words(cand_cap, lk) * 4 + (lk + 31) / 32 * 4;
}

// Byte offsets of a filtered selection's workspace regions for a chunk of `rows` workspace rows
// (each 16-byte aligned): sample, thresholds, candidates, counts (rows x kMaxFilterSplits, then
// the fallback list's length), fallback rows, fallback scores; end = the total.
struct FilterWorkspace {
  int64_t sample = 0, thresholds = 0, cand = 0, counts = 0, fallback_rows = 0, fallback_scores = 0, end = 0;
};
FilterWorkspace filter_workspace(const SelectPlan& plan, int64_t rows);

// topk_select / indexer_select on CUDA (the CPU selects row by row without a workspace).
SelectPlan plan_select(const TopkSelectParams& params, const DeviceInfo& device, const PlanOptions& options);

// CTAs per query tile of a scoring launch of n tiles: about 16 CTAs per SM (4 waves of 4): the
// causal triangle makes CTAs unequal, and few waves leave a ragged last one.
int select_score_splits(const SelectPlan& plan, int64_t n);

// ---- KV-cache decode (attention_with_kvcache; decode_fwd.cuh) ----

// Keys per pipeline stage; the stages of K and V tiles in flight per CTA (about 96 KiB of them:
// two CTAs per H100 SM at head dim 128 keep ~190 KiB of loads in flight, far above what the
// SM's share of HBM bandwidth times latency needs).
constexpr int kDecodeBlockN = 64;
constexpr int kDecodeMaxSplits = 128;  // pieces of a unit's keys the combine merges
constexpr int decode_stages(int head_dim) { return head_dim <= 64 ? 4 : (head_dim <= 128 ? 3 : 2); }
constexpr int decode_smem_bytes(int head_dim) {
  return decode_stages(head_dim) * 2 * kDecodeBlockN * head_dim * 2;
}

struct DecodePlan {
  bool supported = false;  // false: the op's composite path (gather + dense_attention) serves it
  int head_dim = 0;        // the compiled head dim (64, 128, 256)
  int row_tiles =
      1;  // m16 query-row tiles per CTA (1, 2, 4); its 4 warps split each key tile 4/row_tiles ways
  int row_chunks = 1;  // CTAs along the H / Hkv * Lq rows of a K/V head
  int num_splits = 1;  // pieces of each unit's keys (split-KV); > 1 adds the combine kernel
  // CTAs of the grid: one per piece (units * num_splits), or fewer, each taking an equal run of
  // consecutive pieces (balanced split-KV: every SM busy whatever the units' count)
  int64_t num_ctas = 1;
  int ctas_per_sm = 1;
  bool dependent_launch = false;  // sm_90: the combine launched as a programmatic dependent
  int64_t est_key_tiles = 0;      // kDecodeBlockN-key tiles a sequence may hold (capacity, window or mask)
  const char* why = "";
};

// attention_with_kvcache on a CUDA device, from the params (the lengths are on the device: the
// split count comes from the capacity, never from a host read of cache_seqlens).
DecodePlan plan_decode(const DecodeParams& params, const DeviceInfo& device, const PlanOptions& options);

const char* core_name(Core core);
const char* schedule_name(Schedule schedule);
const char* dq_mode_name(DqMode mode);

}  // namespace sparse_attn
