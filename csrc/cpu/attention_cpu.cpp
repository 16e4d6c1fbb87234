// CPU kernels of every op. Torch-free: they see only the params structs.
// Scores are kept in log2 units (q pre-multiplied by scale * log2 e) so softmax uses exp2;
// the LSE is converted back to the natural log when it is written.
#include "sparse_attn/cpu/attention_cpu.h"

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <omp.h>

#include <functional>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "sparse_attn/cpu/tile_gemm.h"
#include "sparse_attn/numeric.h"
#include "sparse_attn/softmax_row.h"
#include "sparse_attn/tile_iter.h"

namespace sparse_attn::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// SPARSE_ATTN_CPU_GENERIC=1 (read once): the portable loops even where the CPU has AVX-512, so
// that both versions can be tested on one machine.
inline bool cpu_generic() {
  static const bool generic = [] {
    const char* v = std::getenv("SPARSE_ATTN_CPU_GENERIC");
    return v != nullptr && v[0] == '1';
  }();
  return generic;
}

template <typename F>
void dispatch_dtype(ScalarKind dtype, F&& f) {
  switch (dtype) {
    case ScalarKind::kFloat32:
      f(float{});
      break;
    case ScalarKind::kBFloat16:
      f(bf16_t{});
      break;
    case ScalarKind::kFloat16:
      f(fp16_t{});
      break;
  }
}

template <typename T>
inline void load_row(const T* src, int n, float* dst, float mul = 1.f) {
  for (int i = 0; i < n; ++i) dst[i] = to_float(src[i]) * mul;
}

inline float dot(const float* a, const float* b, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline bool all_finite(const float* x, int64_t n) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= std::isfinite(x[i]);
  return ok;
}

inline void axpy(float alpha, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// The inner loops of a (query tile, key tile) step, multiversioned on x86-64: GCC compiles each for
// AVX-512, AVX2 and the baseline, and the loader picks the best the CPU has (the rest of this file
// is compiled for the baseline ISA, so one build runs on every x86-64 CPU). Elsewhere: one version.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SA_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SA_CPU_CLONES
#endif
//
// acc[i][:w] += pc[i] * a[:w] for the four i, where a zero pc[i] adds exactly 0 even against a NaN
// in a; `finite` (a's values are finite) allows plain products, which give the same. Inlined into
// each clone of its callers, so it takes their instruction set.
__attribute__((always_inline)) inline void accumulate4(float (&acc)[4][64], const float (&pc)[4],
                                                       const float* a, int w, bool finite) {
  if (finite) {
    for (int x = 0; x < w; ++x) {
      const float ax = a[x];
      acc[0][x] += pc[0] * ax;
      acc[1][x] += pc[1] * ax;
      acc[2][x] += pc[2] * ax;
      acc[3][x] += pc[3] * ax;
    }
    return;
  }
  for (int x = 0; x < w; ++x) {
    const float ax = a[x];
    acc[0][x] += pc[0] != 0.f ? pc[0] * ax : 0.f;
    acc[1][x] += pc[1] != 0.f ? pc[1] * ax : 0.f;
    acc[2][x] += pc[2] != 0.f ? pc[2] * ax : 0.f;
    acc[3][x] += pc[3] != 0.f ? pc[3] * ax : 0.f;
  }
}

// out[r, :dv] += sum over c < cols of p[r * kBlockN + c] * v[c, :dv] for r < rows, four rows and 64
// columns at a time (the accumulators stay in registers). A zero p (a hidden key) adds exactly 0,
// even where its value is NaN; v_finite (the caller checked v's rows) skips that guard.
SA_CPU_CLONES void pv_tile(const float* p, const float* v, int rows, int cols, int dv, float* out,
                           bool v_finite = false, int ldp = kBlockN) {
  constexpr int W = 64;
  const int N = ldp;
  for (int x0 = 0; x0 < dv; x0 += W) {
    const int w = std::min(W, dv - x0);
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      float acc[4][W] = {};
      for (int c = 0; c < cols; ++c) {
        const float pc[4] = {p[(r + 0) * N + c], p[(r + 1) * N + c], p[(r + 2) * N + c], p[(r + 3) * N + c]};
        if (pc[0] == 0.f && pc[1] == 0.f && pc[2] == 0.f && pc[3] == 0.f) continue;
        accumulate4(acc, pc, v + c * dv + x0, w, v_finite);
      }
      for (int i = 0; i < 4; ++i)
        for (int x = 0; x < w; ++x) out[(r + i) * dv + x0 + x] += acc[i][x];
    }
    for (; r < rows; ++r) {
      float acc[W] = {};
      for (int c = 0; c < cols; ++c) {
        const float pc = p[r * N + c];
        if (pc == 0.f) continue;
        for (int x = 0; x < w; ++x) acc[x] += pc * v[c * dv + x0 + x];
      }
      for (int x = 0; x < w; ++x) out[r * dv + x0 + x] += acc[x];
    }
  }
}

// out[c, :width] += sum over r < rows of p[r * kBlockN + c] * a[r, :width] for c < cols (P^T A: the
// key-side products of the backward), four keys and 64 columns at a time; zero p add exactly 0
// (a_finite: a's rows are finite, so plain products do).
SA_CPU_CLONES void ptv_tile(const float* p, const float* a, int rows, int cols, int width, float* out,
                            bool a_finite = false) {
  constexpr int N = kBlockN, W = 64;
  for (int x0 = 0; x0 < width; x0 += W) {
    const int w = std::min(W, width - x0);
    for (int c0 = 0; c0 < cols; c0 += 4) {
      float acc[4][W] = {};
      for (int r = 0; r < rows; ++r) {
        float pc[4];
        for (int i = 0; i < 4; ++i) pc[i] = c0 + i < cols ? p[r * N + c0 + i] : 0.f;
        if (pc[0] == 0.f && pc[1] == 0.f && pc[2] == 0.f && pc[3] == 0.f) continue;
        accumulate4(acc, pc, a + r * width + x0, w, a_finite);
      }
      for (int i = 0; i < 4 && c0 + i < cols; ++i)
        for (int x = 0; x < w; ++x) out[(c0 + i) * width + x0 + x] += acc[i][x];
    }
  }
}

// 2^x for x in [-127, 127]: a polynomial on [-1/2, 1/2] (the Taylor series of 2^f to degree 6:
// relative error below 2e-7, as std::exp2's fp32 rounding) times 2^k, so that loops over it
// vectorise. At -127 the power of two's bits are 0, so the result is 0.
__attribute__((always_inline)) inline float exp2_clamped(float x) {
  const float k = std::nearbyint(x);
  const float f = x - k;
  const float poly =
      1.f +
      f * (0.69314718f +
           f * (0.24022651f + f * (0.05550411f + f * (0.00961813f + f * (0.00133336f + f * 0.00015404f)))));
  const int32_t bits = (int32_t(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}

// 2^x for any x: -inf gives 0, NaN stays NaN, results below 2^-126 flush to 0.
__attribute__((always_inline)) inline float exp2_poly(float x) {
  const bool nan = x != x;
  const float xc = nan ? 0.f : (x < -126.f ? -126.f : (x > 127.f ? 127.f : x));
  return nan ? x : (x < -126.f ? 0.f : exp2_clamped(xc));
}

// 2^x for x <= 0 or -inf, not NaN (a softmax row's scores minus its max).
__attribute__((always_inline)) inline float exp2_nonpositive(float x) {
  return exp2_clamped(x < -127.f ? -127.f : x);
}

// A finite float to bf16, rounded to nearest even (from_float without the NaN case).
__attribute__((always_inline)) inline bf16_t bf16_finite(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return bf16_t{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

template <typename T>
const T* q_row(const AttnFwdParams& p, int b, int h, int64_t i) {
  return static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + i * p.q_row_stride;
}
template <typename T>
const T* k_row(const AttnFwdParams& p, int b, int hk, int64_t j) {
  return static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride + j * p.k_row_stride;
}
template <typename T>
const T* v_row(const AttnFwdParams& p, int b, int hk, int64_t j) {
  return static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride + j * p.v_row_stride;
}
template <typename T>
T* o_row(const AttnFwdParams& p, int b, int h, int64_t i) {
  return static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride;
}

// out[c] = bf16(x[c] * mul) for c < n: from_float<bf16_t> written without branches, so that it
// vectorises.
SA_CPU_CLONES void scale_to_bf16(const float* x, float mul, int n, bf16_t* out) {
  uint16_t* o = &out->bits;
  for (int c = 0; c < n; ++c) {
    const uint32_t u = float_bits(x[c] * mul);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet = (u >> 16) | 0x40u;
    o[c] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
}

// out = x * mul as fp16 (vectorised on AVX-512 CPUs; defined with the AVX-512 functions below).
void scale_to_fp16(const float* x, float mul, int n, fp16_t* out);

// Writes out = acc / l and lse for one query row; a row that saw no key gets 0 and -inf.
template <typename T>
void finalize_row(const AttnFwdParams& p, int b, int h, int64_t i, const float* acc, float m, float l) {
  T* out = o_row<T>(p, b, h, i);
  float* lse = p.lse + (int64_t(b) * p.h + h) * p.lq + i;
  const float inv = row_inv(l);  // 0 for a row that saw no key, whose acc is 0
  if constexpr (std::is_same_v<T, bf16_t>)
    scale_to_bf16(acc, inv, p.dv, out);
  else if constexpr (std::is_same_v<T, fp16_t>)
    scale_to_fp16(acc, inv, p.dv, out);
  else
    for (int c = 0; c < p.dv; ++c) out[c] = from_float<T>(acc[c] * inv);
  *lse = row_lse(m, l);
}

// Key tiles per group of the tiled main loop (below).
constexpr int kGroup = 8;
constexpr int kGroupN = kGroup * kBlockN;
// Row strides of the group's scores (fp32) and of P (bf16), and the padding of the bf16 K^T operand's
// rows: each a multiple of 64 bytes (every row starts a cache line) but not of 4 KiB's divisors
// above 128 bytes, so that the 16 rows one matrix tile load or store touches fall into different
// L1 sets (with the unpadded 2 KiB / 1 KiB / 4-16 KiB strides they shared one or two sets, and the
// products ran ~10-20 % slower).
constexpr int kScoreLd = kGroupN + 32;
constexpr int kPLd = kGroupN + 32;
constexpr int kKPad = 32;

// K transposed, one operand for all the slots, so that consecutive tiles' keys are one operand's
// columns: fp32, D rows of k_ld = slots x kBlockN + kKPad keys; bf16 in the VNNI layout, D / 2 rows
// of k_ld pairs. V: column chunk x0 (width w, 64 for the bf16 operand, Dv for fp32) of every
// slot's kBlockN rows, slot after slot, so that the rows of consecutive tiles are one operand.
struct KVCacheLayout {
  int64_t k_elems, v_elems;  // per slot
  int slots, chunk;
  int k_pack;  // K^T's elements per key in a row: 2 (bf16 pairs) or 1 (fp32)
  // Slots per K^T block: the blocks lie one after another, each D rows of k_ld (a product reads the
  // keys of one block, so its rows are short: see tiled_attention).
  int block_slots = 1;
  int k_ld() const { return block_slots * kBlockN + kKPad; }  // in keys (columns)
  int64_t k_block_elems() const { return k_elems / kBlockN * k_ld(); }
  int64_t k_total() const { return (slots + block_slots - 1) / block_slots * k_block_elems(); }
  int64_t k_offset(int slot) const {
    return slot / block_slots * k_block_elems() + int64_t(k_pack) * (slot % block_slots) * kBlockN;
  }
  int64_t v_offset(int slot, int x0) const {
    const int w = std::min(chunk, int(v_elems / kBlockN) - x0);
    return int64_t(x0) * slots * kBlockN + int64_t(slot) * kBlockN * w;
  }
  // bf16 V: the 2 x w values of keys 2i and 2i + 1 in column chunk x0 of a slot, interleaved.
  uint16_t* value_pair(bf16_t* vc, int slot, int x0, int i) const {
    const int w = std::min(chunk, int(v_elems / kBlockN) - x0);
    return reinterpret_cast<uint16_t*>(vc + v_offset(slot, x0)) + int64_t(i) * w * 2;
  }
};

// A key tile (keys n0 .. n0 + cols) as the fp32 products read it: K transposed into kt (D x kBlockN,
// missing keys as zero columns), V as rows into slot `slot` of vc (layout kv; vc == nullptr: fp32
// V is read in place, only checked). Returns whether V is finite.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SA_CPU_AVX512 1
// Whether the AVX-512 versions below may run: the CPU has them (F; for the bf16 products also BW,
// DQ, VL and BF16) and SPARSE_ATTN_CPU_GENERIC is not set.
inline bool use_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && !cpu_generic();
  return ok;
}
inline bool use_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         use_avx512();
  return ok;
}
bool load_kv_f32_avx512(const float* k, int64_t k_stride, const float* v, int64_t v_stride, int cols, int D,
                        int Dv, float* kt, int64_t k_ld, float* vt);
bool load_kv_half_f32_avx512(const bf16_t* k, int64_t k_stride, const bf16_t* v, int64_t v_stride, int cols,
                             int D, int Dv, float* kt, int64_t k_ld, float* vt);
void widen_row_avx512(const bf16_t* src, int n, float* dst);
void widen_row_avx512(const fp16_t* src, int n, float* dst);
void scale_to_fp16_avx512(const float* x, float mul, int n, fp16_t* out);
bool load_kv_half_f32_avx512(const fp16_t* k, int64_t k_stride, const fp16_t* v, int64_t v_stride, int cols,
                             int D, int Dv, float* kt, int64_t k_ld, float* vt);
bool pack_kv_bf16_avx512(const bf16_t* k, int64_t k_stride, const bf16_t* v, int64_t v_stride, int cols,
                         int D, int Dv, bf16_t* kt, bf16_t* vc, const KVCacheLayout& kv, int slot);
void transpose_words_avx512_call(const void* src, int64_t stride, int rows, int words, uint32_t* dst,
                                 int64_t ld);
#endif

// dst[i * ld + c] = word i of row c (row c at src + c * stride bytes) for i < words, c < kBlockN,
// rows c >= rows read as zeros: a tile's 32-bit words transposed (fp32 values, or bf16 pairs in the
// products' VNNI layout). K^T and V^T of the backward, P^T and dS^T, the bf16 K^T of the forward.
SA_CPU_CLONES void transpose_words(const void* src, int64_t stride, int rows, int words, uint32_t* dst,
                                   int64_t ld) {
#ifdef SA_CPU_AVX512
  if (use_avx512()) return transpose_words_avx512_call(src, stride, rows, words, dst, ld);
#endif
  for (int c = 0; c < kBlockN; ++c) {  // each row read contiguously, its words written down a column
    const char* row = static_cast<const char*>(src) + c * stride;
    for (int i = 0; i < words; ++i) {
      uint32_t word = 0;
      if (c < rows) std::memcpy(&word, row + 4 * i, sizeof(word));
      dst[i * ld + c] = word;
    }
  }
}

template <typename T>
bool load_kv_tile(const AttnFwdParams& p, int b, int hk, int n0, int cols, float* kt, float* vc,
                  const KVCacheLayout& kv, int slot) {
#ifdef SA_CPU_AVX512
  if constexpr (std::is_same_v<T, float>)
    if (use_avx512())
      return load_kv_f32_avx512(k_row<T>(p, b, hk, n0), p.k_row_stride, v_row<T>(p, b, hk, n0),
                                p.v_row_stride, cols, p.d, p.dv, kt, kv.k_ld(),
                                vc == nullptr ? nullptr : vc + kv.v_offset(slot, 0));
  if constexpr (std::is_same_v<T, bf16_t> || std::is_same_v<T, fp16_t>)
    if (use_avx512())
      return load_kv_half_f32_avx512(k_row<T>(p, b, hk, n0), p.k_row_stride, v_row<T>(p, b, hk, n0),
                                     p.v_row_stride, cols, p.d, p.dv, kt, kv.k_ld(),
                                     vc + kv.v_offset(slot, 0));
#endif
  constexpr int N = kBlockN;
  const int D = p.d, Dv = p.dv;
  const T* k = k_row<T>(p, b, hk, n0);
  const int64_t stride = p.k_row_stride;
  const int64_t ld = kv.k_ld();
  for (int x = 0; x < D; ++x)  // written contiguously, read across the (L1-resident) rows
    for (int c = 0; c < N; ++c) kt[x * ld + c] = c < cols ? to_float(k[c * stride + x]) : 0.f;
  if constexpr (std::is_same_v<T, float>) {
    if (vc == nullptr) {  // fp32 V in place: only checked
      bool finite = true;
      for (int c = 0; c < cols; ++c) finite &= all_finite(v_row<T>(p, b, hk, n0 + c), Dv);
      return finite;
    }
  }
  float* vt = vc + kv.v_offset(slot, 0);
  for (int c = 0; c < cols; ++c) load_row(v_row<T>(p, b, hk, n0 + c), Dv, &vt[c * Dv]);
  return all_finite(vt, int64_t(cols) * Dv);
}

void scale_to_fp16(const float* x, float mul, int n, fp16_t* out) {
#ifdef SA_CPU_AVX512
  if (use_avx512()) return scale_to_fp16_avx512(x, mul, n, out);
#endif
  for (int c = 0; c < n; ++c) out[c] = from_float<fp16_t>(x[c] * mul);
}

// load_row without a multiplier, vectorised for 16-bit inputs on AVX-512 CPUs.
template <typename T>
void widen_row(const T* src, int n, float* dst) {
#ifdef SA_CPU_AVX512
  if constexpr (std::is_same_v<T, bf16_t> || std::is_same_v<T, fp16_t>)
    if (use_avx512()) return widen_row_avx512(src, n, dst);
#endif
  load_row(src, n, dst);
}

// The same for the bf16 products, written straight into their operand layout (TileGemm::bf16):
// K^T (D x kBlockN) as words at kt[i * kv.k_ld() + n], the word of key n holding its features 2i
// and 2i + 1; V in column chunks of kv.chunk, keys paired the same way. Missing keys are zero. Rows
// k + n * k_stride and v + n * v_stride for n < cols; one vectorised function (the callers are
// templates, which cannot be multiversioned).
SA_CPU_CLONES bool pack_kv_bf16(const bf16_t* k, int64_t k_stride, const bf16_t* v, int64_t v_stride,
                                int cols, int D, int Dv, bf16_t* kt, bf16_t* vc, const KVCacheLayout& kv,
                                int slot) {
  constexpr int N = kBlockN;
  transpose_words(k, 2 * k_stride, cols, D / 2, reinterpret_cast<uint32_t*>(kt), kv.k_ld());
  int bad = 0;  // a NaN or Inf among the values
  for (int x0 = 0; x0 < Dv; x0 += kv.chunk) {
    const int w = std::min(kv.chunk, Dv - x0);
    for (int i = 0; i < N / 2; ++i) {
      uint16_t* o = kv.value_pair(vc, slot, x0, i);
      const int k0 = 2 * i;
      const uint16_t* r0 = k0 < cols ? &v[k0 * v_stride + x0].bits : nullptr;
      const uint16_t* r1 = k0 + 1 < cols ? &v[(k0 + 1) * v_stride + x0].bits : nullptr;
      if (r1 != nullptr) {
        for (int x = 0; x < w; ++x) {
          o[2 * x] = r0[x];
          o[2 * x + 1] = r1[x];
          bad |= ((r0[x] & 0x7f80) == 0x7f80) | ((r1[x] & 0x7f80) == 0x7f80);
        }
      } else {  // the keys' end: the row that exists, zeros after
        for (int x = 0; x < w; ++x) {
          const uint16_t a0 = r0 != nullptr ? r0[x] : 0;
          o[2 * x] = a0;
          o[2 * x + 1] = 0;
          bad |= (a0 & 0x7f80) == 0x7f80;
        }
      }
    }
  }
  return bad == 0;
}

template <typename T>
bool load_kv_tile(const AttnFwdParams& p, int b, int hk, int n0, int cols, bf16_t* kt, bf16_t* vc,
                  const KVCacheLayout& kv, int slot) {
#ifdef SA_CPU_AVX512
  if (use_avx512_bf16())
    return pack_kv_bf16_avx512(k_row<T>(p, b, hk, n0), p.k_row_stride, v_row<T>(p, b, hk, n0), p.v_row_stride,
                               cols, p.d, p.dv, kt, vc, kv, slot);
#endif
  return pack_kv_bf16(k_row<T>(p, b, hk, n0), p.k_row_stride, v_row<T>(p, b, hk, n0), p.v_row_stride, cols,
                      p.d, p.dv, kt, vc, kv, slot);
}

// One online-softmax step of a group: for each of the rows, the scores of the group's key tiles
// (raw products, tile j at columns j * kBlockN, row stride kScoreLd) scaled into log2 units, the
// keys hidden by visible[r * kGroup + j] set to -inf, then P = exp2(s - m_new) in place (and as
// bf16 into p16 when given), acc and l rescaled. A NaN score stays out of the max; exp2 carries it
// into l and the output.
__attribute__((always_inline)) inline void softmax_group_body(float* s, int rows, int tiles, float scale,
                                                              const uint64_t* visible, float* m, float* l,
                                                              float* acc, int dv, bf16_t* p16) {
  constexpr int N = kBlockN;
  const int width = tiles * N;
  for (int r = 0; r < rows; ++r) {
    float* sr = s + int64_t(r) * kScoreLd;
    const uint64_t* vis = visible + r * kGroup;
    bool masked = false;
    for (int j = 0; j < tiles; ++j) masked |= vis[j] != ~0ull;
    float mx = kNegInf;
    int nan = 0;
    if (!masked) {  // one pass and one horizontal reduction over the whole row
#pragma omp simd reduction(max : mx) reduction(| : nan)
      for (int c = 0; c < width; ++c) {
        const float x = sr[c] * scale;
        sr[c] = x;
        mx = x > mx ? x : mx;
        nan |= x != x;
      }
    } else {
      for (int j = 0; j < tiles * 2; ++j) {  // 32 columns a word: 32-bit shifts vectorise, 64-bit ones do not
        const uint32_t word = uint32_t(vis[j / 2] >> (32 * (j % 2)));
        float* sh = sr + 32 * j;
#pragma omp simd reduction(max : mx) reduction(| : nan)
        for (int c = 0; c < 32; ++c) {
          const float x = ((word >> c) & 1u) ? sh[c] * scale : kNegInf;
          sh[c] = x;
          mx = x > mx ? x : mx;
          nan |= x != x;
        }
      }
    }
    const float m_new = std::max(m[r], mx);
    const float m_ref = softmax_ref(m_new);
    const float alpha = std::exp2(m[r] - m_ref);  // 0 when m[r] == -inf
    if (alpha != 1.f) {
      l[r] *= alpha;
      float* ar = acc + int64_t(r) * dv;
#pragma omp simd
      for (int c = 0; c < dv; ++c) ar[c] *= alpha;
    }
    float sum = 0.f;
    bf16_t* pr = p16 != nullptr ? p16 + int64_t(r) * kPLd : nullptr;
    if (nan) {  // the general exponential, which keeps NaN
#pragma omp simd reduction(+ : sum)
      for (int c = 0; c < width; ++c) {
        const float e = exp2_poly(sr[c] - m_ref);
        sr[c] = e;
        sum += e;
      }
      if (pr != nullptr)
        for (int c = 0; c < width; ++c) pr[c] = from_float<bf16_t>(sr[c]);
    } else if (pr != nullptr) {  // P only as the bf16 operand
#pragma omp simd reduction(+ : sum)
      for (int c = 0; c < width; ++c) {
        const float e = exp2_nonpositive(sr[c] - m_ref);
        sum += e;
        pr[c] = bf16_finite(e);
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int c = 0; c < width; ++c) {
        const float e = exp2_nonpositive(sr[c] - m_ref);
        sr[c] = e;
        sum += e;
      }
    }
    l[r] += sum;
    m[r] = m_new;
  }
}

SA_CPU_CLONES void softmax_group(float* s, int rows, int tiles, float scale, const uint64_t* visible,
                                 float* m, float* l, float* acc, int dv, bf16_t* p16) {
  softmax_group_body(s, rows, tiles, scale, visible, m, l, acc, dv, p16);
}

#ifdef SA_CPU_AVX512
// The same in 512-bit vectors (GCC's AVX-512 clone above, under generic tuning, runs most of its
// loops at 256 bits; measured ~3 % of a call at D = 128, docs/PERF_LOG.md), for the fp32
// products on an AVX-512 CPU without AVX512-BF16 (which takes softmax_group_avx512).
__attribute__((target("avx512f,prefer-vector-width=512"))) void softmax_group_zmm(
    float* s, int rows, int tiles, float scale, const uint64_t* visible, float* m, float* l, float* acc,
    int dv, bf16_t* p16) {
  softmax_group_body(s, rows, tiles, scale, visible, m, l, acc, dv, p16);
}
#endif

#ifdef SA_CPU_AVX512
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own AVX-512 reduction intrinsics
#pragma GCC diagnostic ignored "-Wuninitialized"  // and its unpack / shuffle intrinsics (_mm512_undefined)
#define SA_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define SA_AVX512F __attribute__((target("avx512f")))

// 2^x on 16 lanes for x <= 0 (a softmax row's scores minus its max): 2^floor(x) (vscalefps) times a
// polynomial in x - floor(x) (vreduceps), a degree-5 fit on [0, 1) with relative error below
// 2e-7. Below -128 the result is a denormal of at most 2^-128 (an exact 0 where it matters comes
// from the caller's mask).
SA_AVX512_BF16 __attribute__((always_inline)) inline __m512 exp2_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-128.f));
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF);  // x - floor(x)
  __m512 poly = _mm512_set1_ps(0.00187757635f);
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.00898934156f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.0558263175f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.240153611f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.693153083f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.99999994f));
  return _mm512_scalef_ps(poly, x);
}

// 16 bf16 (or fp16) values widened to the fp32 words they are.
template <typename T>
SA_AVX512F __attribute__((always_inline)) inline __m512i widen16(__m256i h) {
  if constexpr (std::is_same_v<T, bf16_t>)
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  else
    return _mm512_castps_si512(_mm512_cvtph_ps(h));
}

// Words i0 .. i0 + 15 of a row as 16 lanes (those past `words` zero): 32-bit words read as they
// are (T = uint32_t), or 16-bit values (bf16_t, fp16_t) widened to the fp32 words they are.
template <typename T>
SA_AVX512F __attribute__((always_inline)) inline __m512i load_words16(const char* row, int i0, int words,
                                                                      __mmask16 wm) {
  if constexpr (std::is_same_v<T, uint32_t>) {
    return _mm512_maskz_loadu_epi32(wm, row + 4 * i0);
  } else {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(row) + i0;
    if (words - i0 >= 16) return widen16<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    alignas(32) uint16_t tail[16] = {};
    for (int i = 0; i < words - i0; ++i) tail[i] = src[i];
    return widen16<T>(_mm256_load_si256(reinterpret_cast<const __m256i*>(tail)));
  }
}

// dst[i * ld + c] = word i of src row c (row c at src + c * stride bytes) for i < words, c <
// kBlockN (rows c >= rows read as zeros): a key tile's 32-bit words transposed (fp32 features, or bf16
// feature pairs; T = bf16_t or fp16_t: 16-bit features, each widened to its fp32 word), 16 x 16 at a
// time (unpacks of 32- and 64-bit elements, then 128-bit lane shuffles).
template <typename T = uint32_t>
SA_AVX512F __attribute__((always_inline)) inline void transpose_words_avx512(const void* src, int64_t stride,
                                                                             int rows, int words,
                                                                             uint32_t* dst, int64_t ld) {
  constexpr int N = kBlockN;
  for (int c0 = 0; c0 < N; c0 += 16) {
    for (int i0 = 0; i0 < words; i0 += 16) {
      const __mmask16 wm = words - i0 >= 16 ? 0xffff : __mmask16((1u << (words - i0)) - 1);
      __m512i r[16], t[16];
      for (int c = 0; c < 16; ++c)
        r[c] = c0 + c < rows
                   ? load_words16<T>(static_cast<const char*>(src) + (c0 + c) * stride, i0, words, wm)
                   : _mm512_setzero_si512();
      for (int c = 0; c < 16; c += 2) {  // 32-bit pairs, then 64-bit, then 128-bit lanes
        t[c] = _mm512_unpacklo_epi32(r[c], r[c + 1]);
        t[c + 1] = _mm512_unpackhi_epi32(r[c], r[c + 1]);
      }
      for (int c = 0; c < 16; c += 4) {
        r[c] = _mm512_unpacklo_epi64(t[c], t[c + 2]);
        r[c + 1] = _mm512_unpackhi_epi64(t[c], t[c + 2]);
        r[c + 2] = _mm512_unpacklo_epi64(t[c + 1], t[c + 3]);
        r[c + 3] = _mm512_unpackhi_epi64(t[c + 1], t[c + 3]);
      }
      for (int c = 0; c < 4; ++c) {  // rows c, c+4, c+8, c+12 hold lanes of the same four words
        t[c] = _mm512_shuffle_i32x4(r[c], r[c + 4], 0x88);
        t[c + 4] = _mm512_shuffle_i32x4(r[c], r[c + 4], 0xdd);
        t[c + 8] = _mm512_shuffle_i32x4(r[c + 8], r[c + 12], 0x88);
        t[c + 12] = _mm512_shuffle_i32x4(r[c + 8], r[c + 12], 0xdd);
      }
      for (int c = 0; c < 4; ++c) {
        // word i0 + 4 * lane_group + c ... assembled from t: lanes (0, 2) and (1, 3) of the pairs
        const __m512i a = _mm512_shuffle_i32x4(t[c], t[c + 8], 0x88);
        const __m512i bq = _mm512_shuffle_i32x4(t[c + 4], t[c + 12], 0x88);
        const __m512i cq = _mm512_shuffle_i32x4(t[c], t[c + 8], 0xdd);
        const __m512i dq = _mm512_shuffle_i32x4(t[c + 4], t[c + 12], 0xdd);
        const int w0 = i0 + c;
        if (w0 < words) _mm512_storeu_si512(dst + w0 * ld + c0, a);
        if (w0 + 4 < words) _mm512_storeu_si512(dst + (w0 + 4) * ld + c0, bq);
        if (w0 + 8 < words) _mm512_storeu_si512(dst + (w0 + 8) * ld + c0, cq);
        if (w0 + 12 < words) _mm512_storeu_si512(dst + (w0 + 12) * ld + c0, dq);
      }
    }
  }
}

// load_kv_tile's fp32 case in AVX-512: K^T by transpose_words_avx512, V's rows copied with their
// exponent bits checked.
SA_AVX512F bool load_kv_f32_avx512(const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                                   int cols, int D, int Dv, float* kt, int64_t k_ld, float* vt) {
  transpose_words_avx512(k, 4 * k_stride, cols, D, reinterpret_cast<uint32_t*>(kt), k_ld);
  const __m512i expo = _mm512_set1_epi32(0x7f800000);
  __mmask16 bad = 0;
  for (int c = 0; c < cols; ++c) {
    const float* src = v + c * v_stride;
    for (int x = 0; x < Dv; x += 16) {
      const __mmask16 m = Dv - x >= 16 ? 0xffff : __mmask16((1u << (Dv - x)) - 1);
      const __m512i r = _mm512_maskz_loadu_epi32(m, src + x);
      bad |= _mm512_mask_cmpeq_epi32_mask(m, _mm512_and_si512(r, expo), expo);
      if (vt != nullptr) _mm512_mask_storeu_epi32(vt + int64_t(c) * Dv + x, m, r);
    }
  }
  return bad == 0;
}

// The same for bf16 or fp16 K and V, widened to the fp32 products' operands (fp16 inputs; bf16 on a
// CPU without bf16 matrix instructions): K^T by transpose_words_avx512's widening form, V's rows
// widened 16 at a time (the scalar loops it replaces were 16 % of a bf16 call at L = 256, D = 128).
template <typename T>
SA_AVX512F __attribute__((always_inline)) inline bool load_kv_half_f32_body(const T* k, int64_t k_stride,
                                                                            const T* v, int64_t v_stride,
                                                                            int cols, int D, int Dv,
                                                                            float* kt, int64_t k_ld,
                                                                            float* vt) {
  transpose_words_avx512<T>(k, 2 * k_stride, cols, D, reinterpret_cast<uint32_t*>(kt), k_ld);
  const __m512i expo = _mm512_set1_epi32(0x7f800000);
  __mmask16 bad = 0;
  int tail_bad = 0;
  for (int c = 0; c < cols; ++c) {
    const uint16_t* src = &v[c * v_stride].bits;
    float* dst = vt + int64_t(c) * Dv;
    int x = 0;
    for (; x + 16 <= Dv; x += 16) {
      const __m512i r = widen16<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x)));
      bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(r, expo), expo);
      _mm512_storeu_si512(dst + x, r);
    }
    for (; x < Dv; ++x) {
      dst[x] = to_float(v[c * v_stride + x]);
      tail_bad |= !std::isfinite(dst[x]);
    }
  }
  return bad == 0 && tail_bad == 0;
}
SA_AVX512F bool load_kv_half_f32_avx512(const bf16_t* k, int64_t k_stride, const bf16_t* v, int64_t v_stride,
                                        int cols, int D, int Dv, float* kt, int64_t k_ld, float* vt) {
  return load_kv_half_f32_body(k, k_stride, v, v_stride, cols, D, Dv, kt, k_ld, vt);
}
SA_AVX512F bool load_kv_half_f32_avx512(const fp16_t* k, int64_t k_stride, const fp16_t* v, int64_t v_stride,
                                        int cols, int D, int Dv, float* kt, int64_t k_ld, float* vt) {
  return load_kv_half_f32_body(k, k_stride, v, v_stride, cols, D, Dv, kt, k_ld, vt);
}

// A row of 16-bit values widened to fp32 (a query row of the fp32 products).
template <typename T>
SA_AVX512F __attribute__((always_inline)) inline void widen_row_body(const T* src, int n, float* dst) {
  int c = 0;
  for (; c + 16 <= n; c += 16)
    _mm512_storeu_si512(dst + c, widen16<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c))));
  for (; c < n; ++c) dst[c] = to_float(src[c]);
}
SA_AVX512F void widen_row_avx512(const bf16_t* src, int n, float* dst) { widen_row_body(src, n, dst); }
SA_AVX512F void widen_row_avx512(const fp16_t* src, int n, float* dst) { widen_row_body(src, n, dst); }

// out = x * mul as fp16, rounded to nearest even by the conversion instruction (what from_float
// computes one value at a time, its subnormals and overflow to inf included).
SA_AVX512F void scale_to_fp16_avx512(const float* x, float mul, int n, fp16_t* out) {
  const __m512 m = _mm512_set1_ps(mul);
  int c = 0;
  for (; c + 16 <= n; c += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c),
                        _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(x + c), m),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; c < n; ++c) out[c] = from_float<fp16_t>(x[c] * mul);
}

// transpose_words in AVX-512.
SA_AVX512F void transpose_words_avx512_call(const void* src, int64_t stride, int rows, int words,
                                            uint32_t* dst, int64_t ld) {
  transpose_words_avx512(src, stride, rows, words, dst, ld);
}

// pack_kv_bf16 in AVX-512: K^T by 16 x 16 transpositions of 32-bit words (a word holds a key's
// features 2i and 2i + 1), V's key pairs interleaved by one word permutation per 32 columns, the
// values' exponent bits checked in the same pass. Missing keys (cols < kBlockN) read as zeros.
SA_AVX512_BF16 bool pack_kv_bf16_avx512(const bf16_t* k, int64_t k_stride, const bf16_t* v, int64_t v_stride,
                                        int cols, int D, int Dv, bf16_t* kt, bf16_t* vc,
                                        const KVCacheLayout& kv, int slot) {
  constexpr int N = kBlockN;
  uint32_t* kw = reinterpret_cast<uint32_t*>(kt);
  transpose_words_avx512(k, 2 * k_stride, cols, D / 2, kw, kv.k_ld());
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                          38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const __m512i expo = _mm512_set1_epi16(0x7f80);
  __mmask32 bad = 0;
  for (int x0 = 0; x0 < Dv; x0 += kv.chunk) {
    const int w = std::min(kv.chunk, Dv - x0);
    for (int i = 0; i < N / 2; ++i) {
      uint16_t* o = kv.value_pair(vc, slot, x0, i);
      const int k0 = 2 * i;
      for (int x = 0; x < w; x += 32) {
        const __mmask32 m = w - x >= 32 ? ~__mmask32(0) : __mmask32((1u << (w - x)) - 1);
        const __m512i r0 =
            k0 < cols ? _mm512_maskz_loadu_epi16(m, v + k0 * v_stride + x0 + x) : _mm512_setzero_si512();
        const __m512i r1 = k0 + 1 < cols ? _mm512_maskz_loadu_epi16(m, v + (k0 + 1) * v_stride + x0 + x)
                                         : _mm512_setzero_si512();
        bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(r0, expo), expo) |
               _mm512_cmpeq_epi16_mask(_mm512_and_si512(r1, expo), expo);
        const __m512i a = _mm512_permutex2var_epi16(r0, lo_idx, r1);
        const __m512i bq = _mm512_permutex2var_epi16(r0, hi_idx, r1);
        if (w - x >= 32) {
          _mm512_storeu_si512(o + 2 * x, a);
          _mm512_storeu_si512(o + 2 * x + 32, bq);
        } else {  // 16 columns left: their 32 interleaved values are a's
          _mm512_storeu_si512(o + 2 * x, a);
        }
      }
    }
  }
  return bad == 0;
}

// softmax_group in AVX-512 (on CPUs with AVX512-BF16, whose conversion rounds two vectors of P to
// bf16 in one instruction; every CPU with AMX has it), 16 columns a step: the max of the visible
// scores (masked), then P = 2^(s * scale - m) with the hidden columns zeroed, summed and written
// as bf16 only (p16), or as fp32 in place (p16 null: the fp32 products and the guarded P V). Rows
// with a NaN score or no visible finite score take softmax_group.
SA_AVX512_BF16 void softmax_group_avx512(float* s, int rows, int tiles, float scale, const uint64_t* visible,
                                         float* m, float* l, float* acc, int dv, bf16_t* p16) {
  constexpr int N = kBlockN;
  const int width = tiles * N;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r = 0; r < rows; ++r) {
    float* sr = s + int64_t(r) * kScoreLd;
    const uint64_t* vis = visible + r * kGroup;
    __m512 vmax = _mm512_set1_ps(kNegInf);
    __mmask16 nan = 0;
    for (int c = 0; c < width; c += 16) {
      const __mmask16 shown = __mmask16(vis[c / N] >> (c % N));
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + c), vscale);
      // Stored, so that the exponent's s * scale - m is the max's own rounding (computed again,
      // GCC would fuse it into one multiply-subtract: off by up to half an ulp of s * scale, which
      // is 2^8192 at 1e11) and the max's P is 1.
      _mm512_storeu_ps(sr + c, x);
      nan |= _mm512_mask_cmp_ps_mask(shown, x, x, _CMP_UNORD_Q);
      vmax = _mm512_mask_max_ps(vmax, shown, x, vmax);  // a NaN x leaves vmax as it was
    }
    const float mx = _mm512_reduce_max_ps(vmax);
    if (nan || mx == kNegInf) {  // (the row is scaled already)
      softmax_group(sr, 1, tiles, 1.f, vis, m + r, l + r, acc + int64_t(r) * dv, dv,
                    p16 != nullptr ? p16 + int64_t(r) * kPLd : nullptr);
      continue;
    }
    const float m_new = std::max(m[r], mx);       // finite
    const float alpha = std::exp2(m[r] - m_new);  // 0 when m[r] == -inf
    if (alpha != 1.f) {
      l[r] *= alpha;
      float* ar = acc + int64_t(r) * dv;
      for (int c = 0; c < dv; ++c) ar[c] *= alpha;
    }
    const __m512 ref = _mm512_set1_ps(m_new);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    bf16_t* pr = p16 != nullptr ? p16 + int64_t(r) * kPLd : nullptr;
    for (int c = 0; c < width; c += 32) {
      const uint32_t shown = uint32_t(vis[c / N] >> (c % N));
      const __m512 e0 = _mm512_maskz_mov_ps(__mmask16(shown),
                                            exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sr + c), ref)));
      const __m512 e1 = _mm512_maskz_mov_ps(
          __mmask16(shown >> 16), exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sr + c + 16), ref)));
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
      if (pr != nullptr) {
        _mm512_storeu_si512(pr + c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      } else {
        _mm512_storeu_ps(sr + c, e0);
        _mm512_storeu_ps(sr + c + 16, e1);
      }
    }
    l[r] += _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
    m[r] = m_new;
  }
}
#pragma GCC diagnostic pop
#endif

// ---------------------------------------------------------------------------------------------
// The tiled main loop shared by flash and block-sparse attention, on TileGemm products: bf16
// operands on the matrix unit (kAmx), fp32 otherwise.
//
// A 64-query tile walks its key tiles in groups of up to kGroup consecutive tiles (a band or a
// block-sparse row of adjacent blocks is one group per kGroup tiles): S = Q K^T per key tile into
// one rows x (kGroup * kBlockN) score buffer, one online-softmax step over the group, then one
// P V product whose inner dimension is the whole group (a long product runs the matrix unit
// near its peak; 64-key products do not).
//
// Each thread keeps the key tiles of the (batch, kv head) it works on in the products' operand
// form (KVCacheLayout), each converted on first use, so the query tiles of a head (adjacent in
// the work order) share them; above kKVCacheBytes per thread one slot is reconverted per tile
// (groups of one). A value tile holding NaN or Inf takes the guarded product pv_tile, so that a
// hidden key (P exactly 0) adds exactly 0 rather than 0 x NaN.
template <typename Tiles>
struct TileRows;
template <int M, int N>
struct TileRows<WindowTiles<M, N>> {
  static constexpr int value = M;
  static constexpr bool kFromKeyZero = true;  // with no left window bound, rows start at key 0
};
template <int M, int N, bool kTileIsBlock>
struct TileRows<BlockSparseTiles<M, N, kTileIsBlock>> {
  static constexpr int value = M;
  static constexpr bool kFromKeyZero = false;
};

template <typename T, typename Tiles, bool kAmx>
void tiled_attention(const AttnFwdParams& p, const TileGemm& g) {
  using Op = std::conditional_t<kAmx, bf16_t, float>;  // the products' operand type
  constexpr int N = kBlockN;
  constexpr int kBlockM = TileRows<Tiles>::value;  // query rows per tile
  const int num_m = (p.lq + kBlockM - 1) / kBlockM;
  const int64_t work = int64_t(p.b) * p.h * num_m;
  const int D = p.d, Dv = p.dv;
  const int num_n = (p.lk + N - 1) / N;
  constexpr int64_t kKVCacheBytes = int64_t(256) << 20;
  KVCacheLayout kv{int64_t(D) * N, int64_t(N) * Dv, 1, kAmx ? 64 : Dv, kAmx ? 2 : 1};
  const bool cache = int64_t(num_n) * (kv.k_elems + kv.v_elems) * int64_t(sizeof(Op)) <= kKVCacheBytes;
  if (cache) kv.slots = kv.block_slots = num_n;
  // fp32 products over rows that start at key 0 (dense, causal): K^T in blocks of kGroup slots, so
  // that a group's product reads rows of 544 keys instead of the whole head's (4k keys: the S
  // product ran ~10 % slower on a Xeon without AMX, docs/PERF_LOG.md). Groups are cut at the
  // blocks' edges: a row of such tiles (contiguous from key 0) gets at most one more group.
  if (cache && !kAmx && TileRows<Tiles>::kFromKeyZero && p.window_left < 0)
    kv.block_slots = std::min(num_n, kGroup);
  const int group = cache ? kGroup : 1;
  constexpr bool kQInPlace = std::is_same_v<T, Op>;  // Q's rows are the product's operand as they are
  // fp32 V: a group's rows are one operand as they lie (consecutive keys at a fixed stride), so the
  // P V product reads them in place; only a tile holding NaN or Inf is copied, for the guarded
  // product. (It saves the per-thread copy of a head's V, 2 MB at 4k and D = 128; the speed was
  // unchanged: the read, not the copy, was the conversion's cost; docs/PERF_LOG.md.)
  const bool v_in_place = std::is_same_v<T, float> && p.v_row_stride >= Dv && p.v_row_stride <= INT_MAX;
#ifdef SA_CPU_AVX512
  const bool avx512_bf16 = use_avx512_bf16();
#endif
  // Whole heads per scheduling chunk when there are enough of them (each head's K/V converted by
  // one thread), single query tiles otherwise (balance).
  const int chunk = int64_t(p.b) * p.h >= 2 * int64_t(omp_get_max_threads()) ? num_m : 1;
#pragma omp parallel
  {
    ScratchVector<Op> kc(kv.k_total()), vc(v_in_place ? 0 : kv.slots * kv.v_elems),
        qc(kQInPlace ? 0 : kBlockM * D), pc(kAmx ? kBlockM * kPLd : 0);
    ScratchVector<float> s(kBlockM * kScoreLd), acc(kBlockM * Dv), m(kBlockM), l(kBlockM),
        vf(kAmx || v_in_place ? kv.v_elems : 0);
    std::vector<uint64_t> visible(kBlockM * kGroup);
    std::vector<uint8_t> ready(kv.slots, 0), finite(kv.slots, 0);
    int64_t cached_head = -1;
#pragma omp for schedule(dynamic, chunk)
    for (int64_t w = 0; w < work; ++w) {
      const int m_block = int(w % num_m);
      const int h = int((w / num_m) % p.h);
      const int b = int(w / (int64_t(num_m) * p.h));
      const int hk = h / p.h_per_kv;
      if (int64_t(b) * p.h_kv + hk != cached_head) {
        cached_head = int64_t(b) * p.h_kv + hk;
        std::fill(ready.begin(), ready.end(), 0);
      }
      const int m0 = m_block * kBlockM;
      const int rows = std::min(kBlockM, p.lq - m0);
      const Op* qa;
      int64_t lda;
      if constexpr (kQInPlace) {
        qa = reinterpret_cast<const Op*>(q_row<T>(p, b, h, m0));
        lda = p.q_row_stride;
      } else {
        for (int r = 0; r < rows; ++r) widen_row(q_row<T>(p, b, h, m0 + r), D, &qc[r * D]);
        qa = qc.data();
        lda = D;
      }
      std::fill(acc.begin(), acc.begin() + int64_t(rows) * Dv, 0.f);  // the rows this tile has
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);

      const Tiles tiles(p, b, h, m_block);
      const int count = tiles.num_tiles();
      for (int it = 0; it < count;) {
        // The group: tiles it .. it + n - 1, whose key tiles are consecutive (either direction).
        int n = 1;
        const int first = tiles.n_block(it);
        int step = 0;
        while (n < group && it + n < count) {
          const int next = tiles.n_block(it + n);
          const int d = next - tiles.n_block(it + n - 1);
          if ((d != 1 && d != -1) || (step != 0 && d != step) || next < 0 || next >= num_n) break;
          if (next / kv.block_slots != first / kv.block_slots) break;  // one K^T block per product
          step = d;
          ++n;
        }
        const int lo = step < 0 ? first - (n - 1) : first;
        if (first < 0 || first >= num_n) {  // (never produced by the iterators) skip defensively
          it += n;
          continue;
        }
        bool group_finite = true;
        for (int j = 0; j < n; ++j) {
          const int t = it + j, nb = tiles.n_block(t), col = nb - lo;
          const int n0 = nb * N, cols = std::min(N, p.lk - n0);
          const int slot = cache ? nb : 0;
          if (!cache || !ready[slot]) {
            finite[slot] = load_kv_tile<T>(p, b, hk, n0, cols, &kc[kv.k_offset(slot)],
                                           v_in_place ? nullptr : vc.data(), kv, slot);
            ready[slot] = 1;
          }
          group_finite &= finite[slot] != 0;
          const uint64_t in_range = cols >= 64 ? ~0ull : (uint64_t(1) << cols) - 1;
          const bool need_mask = tiles.tile_needs_mask(t);
          for (int r = 0; r < rows; ++r)
            visible[r * kGroup + col] = need_mask ? tiles.visible_bits(t, m0 + r) & in_range : in_range;
        }
        {  // the group's keys are one operand: one product (64 x 512 runs faster than 8 of 64)
          const int slot0 = cache ? lo : 0;
          if constexpr (kAmx)
            g.bf16(rows, n * N, D, lda, kv.k_ld(), kScoreLd, false, qa, &kc[kv.k_offset(slot0)], s.data());
          else
            g.f32(rows, n * N, D, lda, kv.k_ld(), kScoreLd, false, qa, &kc[kv.k_offset(slot0)], s.data());
        }
        bf16_t* p16 = nullptr;  // P as the bf16 product's operand
        if constexpr (kAmx) p16 = group_finite ? pc.data() : nullptr;
#ifdef SA_CPU_AVX512
        if (avx512_bf16)
          softmax_group_avx512(s.data(), rows, n, p.scale_log2, visible.data(), m.data(), l.data(),
                               acc.data(), Dv, p16);
        else if (use_avx512())
          softmax_group_zmm(s.data(), rows, n, p.scale_log2, visible.data(), m.data(), l.data(), acc.data(),
                            Dv, p16);
        else
#endif
          softmax_group(s.data(), rows, n, p.scale_log2, visible.data(), m.data(), l.data(), acc.data(), Dv,
                        p16);
        const int slot0 = cache ? lo : 0;
        const int keys = std::min(n * N, p.lk - lo * N);  // the group's keys that exist
        if (!group_finite) {  // the guarded product, on fp32 values, one tile at a time
          for (int j = 0; j < n; ++j) {
            const int n0 = (lo + j) * N, cols = std::min(N, p.lk - n0);
            const float* v_rows;
            if (kAmx || v_in_place) {
              for (int c = 0; c < cols; ++c) load_row(v_row<T>(p, b, hk, n0 + c), Dv, &vf[c * Dv]);
              v_rows = vf.data();
            } else {
              v_rows = reinterpret_cast<const float*>(&vc[kv.v_offset(cache ? lo + j : 0, 0)]);
            }
            pv_tile(&s[j * N], v_rows, rows, cols, Dv, acc.data(), false, kScoreLd);
          }
        } else if constexpr (kAmx) {
          for (int x0 = 0; x0 < Dv; x0 += kv.chunk) {
            const int wd = std::min(kv.chunk, Dv - x0);
            g.bf16(rows, wd, n * N, kPLd, wd, Dv, true, pc.data(), &vc[kv.v_offset(slot0, x0)], &acc[x0]);
          }
        } else if (v_in_place) {
          g.f32(rows, Dv, keys, kScoreLd, int(p.v_row_stride), Dv, true, s.data(),
                reinterpret_cast<const float*>(v_row<T>(p, b, hk, lo * N)), acc.data());
        } else {
          g.f32(rows, Dv, keys, kScoreLd, Dv, Dv, true, s.data(), &vc[kv.v_offset(slot0, 0)], acc.data());
        }
        it += n;
      }
      for (int r = 0; r < rows; ++r) finalize_row<T>(p, b, h, m0 + r, &acc[r * Dv], m[r], l[r]);
    }
    if constexpr (kAmx) g.release_bf16();
  }
}

// The tiled loop on the matrix unit where the CPU has bf16 matrix instructions and the head
// dimensions fit its operand layout (multiples of 16), else in fp32.
template <typename T, typename Tiles>
void tiled_attention(const AttnFwdParams& p, const TileGemm& g) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (!cpu_fp32_products(p.dtype, p.d, p.dv, g.bf16 != nullptr))
      return tiled_attention<T, Tiles, true>(p, g);
  }
  tiled_attention<T, Tiles, false>(p, g);
}

// ---------------------------------------------------------------------------------------------
// The naive baseline: the paper's three steps, with S materialised in fp32.
template <typename T>
void dense_impl(const AttnFwdParams& p) {
  const int64_t rows = int64_t(p.b) * p.h * p.lq;
  const int D = p.d, Dv = p.dv;
#pragma omp parallel
  {
    std::vector<float> qf(D), kf(D), vf(Dv), acc(Dv);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < rows; ++w) {
      const int i = int(w % p.lq), h = int((w / p.lq) % p.h), b = int(w / (int64_t(p.lq) * p.h));
      const int hk = h / p.h_per_kv;
      float* srow = p.scores + w * p.lk;
      // 1. S = scale * Q K^T (+ mask)
      load_row(q_row<T>(p, b, h, i), D, qf.data(), p.scale);
      const int64_t mbase =
          int64_t(b) * p.mask_batch_stride + int64_t(h) * p.mask_head_stride + int64_t(i) * p.mask_row_stride;
      for (int j = 0; j < p.lk; ++j) {
        load_row(k_row<T>(p, b, hk, j), D, kf.data());
        float x = dot(qf.data(), kf.data(), D);
        if (p.mask_kind == DenseMaskKind::kBool) {
          if (!static_cast<const uint8_t*>(p.attn_mask)[mbase + j]) x = kNegInf;
        } else if (p.mask_kind == DenseMaskKind::kAdditive) {
          x += static_cast<const float*>(p.attn_mask)[mbase + j];
        }
        srow[j] = window_visible(i, j, p.kv_offset, p.window_left, p.window_right) ? x : kNegInf;
      }
      // 2. P = softmax(S), in place (a NaN score stays out of the max and turns the row NaN)
      float mx = kNegInf;
      bool nan = false;
      for (int j = 0; j < p.lk; ++j) {
        if (srow[j] > mx) mx = srow[j];
        nan |= std::isnan(srow[j]);
      }
      float sum = 0.f;
      if (mx != kNegInf || nan) {
        const float m_ref = mx == kNegInf ? 0.f : mx;
        for (int j = 0; j < p.lk; ++j) {
          srow[j] = std::exp(srow[j] - m_ref);
          sum += srow[j];
        }
        mx = m_ref;
      }
      float* lse = p.lse + w;
      T* out = o_row<T>(p, b, h, i);
      if (sum == 0.f) {  // fully masked row
        *lse = kNegInf;
        for (int c = 0; c < Dv; ++c) out[c] = from_float<T>(0.f);
        continue;
      }
      *lse = mx + std::log(sum);
      // 3. O = P V
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int j = 0; j < p.lk; ++j) {
        if (srow[j] == 0.f) continue;
        load_row(v_row<T>(p, b, hk, j), Dv, vf.data());
        axpy(srow[j] / sum, vf.data(), acc.data(), Dv);
      }
      for (int c = 0; c < Dv; ++c) out[c] = from_float<T>(acc[c]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Top-k's gathered attention, per (batch, group of heads, query row): the heads of a group share
// both the index set and the K/V head (gcd(H / Hi, H / Hkv) consecutive heads: all of a K/V head's
// query heads under the indexer's one set), so each listed K and V row is read and converted once
// for all of them. Two passes per row: the scores and their max, then P = 2^(s - max) times V.
template <typename T>
void gather_impl(const AttnFwdParams& p) {
  const int D = p.d, Dv = p.dv;
  const int group = std::gcd(p.h_per_idx, p.h_per_kv);
  const int groups = p.h / group;
  const int64_t rows = int64_t(p.b) * groups * p.lq;
#pragma omp parallel
  {
    std::vector<float> qf(int64_t(group) * D), kf(D), vf(Dv), acc(int64_t(group) * Dv),
        s(int64_t(group) * p.topk), mx(group), l(group);
    std::vector<char> nan(group);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < rows; ++w) {
      const int i = int(w % p.lq), gi = int((w / p.lq) % groups), b = int(w / (int64_t(p.lq) * groups));
      const int h0 = gi * group, hk = h0 / p.h_per_kv;
      const int32_t* idx = p.indices + b * p.idx_batch_stride + (h0 / p.h_per_idx) * p.idx_head_stride +
                           int64_t(i) * p.idx_row_stride;
      for (int g = 0; g < group; ++g)
        load_row(q_row<T>(p, b, h0 + g, i), D, &qf[int64_t(g) * D], p.scale_log2);
      std::fill(mx.begin(), mx.end(), kNegInf);
      std::fill(nan.begin(), nan.end(), 0);
      for (int t = 0; t < p.topk; ++t) {
        const int j = idx[t];
        const bool ok = j >= 0 && j < p.lk;
        if (ok) load_row(k_row<T>(p, b, hk, j), D, kf.data());
        for (int g = 0; g < group; ++g) {
          const float x = ok ? dot(&qf[int64_t(g) * D], kf.data(), D) : kNegInf;
          s[int64_t(g) * p.topk + t] = x;
          if (x > mx[g]) mx[g] = x;
          nan[g] |= std::isnan(x);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(l.begin(), l.end(), 0.f);
      for (int g = 0; g < group; ++g)
        if (mx[g] == kNegInf && nan[g]) mx[g] = 0.f;  // NaN scores only: let them through
      for (int t = 0; t < p.topk; ++t) {
        if (idx[t] < 0 || idx[t] >= p.lk) continue;
        bool loaded = false;
        for (int g = 0; g < group; ++g) {
          if (mx[g] == kNegInf) continue;  // this head saw no key
          const float pc = std::exp2(s[int64_t(g) * p.topk + t] - mx[g]);
          if (pc == 0.f) continue;
          if (!loaded) {
            load_row(v_row<T>(p, b, hk, idx[t]), Dv, vf.data());
            loaded = true;
          }
          l[g] += pc;
          axpy(pc, vf.data(), &acc[int64_t(g) * Dv], Dv);
        }
      }
      for (int g = 0; g < group; ++g) finalize_row<T>(p, b, h0 + g, i, &acc[int64_t(g) * Dv], mx[g], l[g]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward. For a query row i with LSE l_i (natural log) and D_i = dO_i . O_i - dlse_i, each key j
// it sees has p_ij = exp(scale q_i . k_j - l_i), dp_ij = dO_i . v_j, ds_ij = p_ij (dp_ij - D_i);
// then dV_j += p_ij dO_i, dQ_i += scale ds_ij k_j, dK_j += scale ds_ij q_i. A row that saw no key
// (LSE -inf) has zero gradients.

// The backward's work items: every (batch, kv head), each split over `splits` items when the (batch,
// kv head)s are fewer than the threads (MQA, GQA and single sequences on many cores): enough for the
// threads, at most `units` (the items interleave the head's query-side units) and 256 MiB of fp32
// dK / dV partials. A function of the shape and the thread count only, so the sums are the same run
// to run. run(state, b, hk, split, splits, dk_part, dv_part) does an item with a thread's state
// (make_state(), finish(state) after the thread's last item); unsplit (dk_part == nullptr) it writes dK and
// dV itself, else its partials, summed here in split order (dK times dk_factor).
template <typename T, typename MakeState, typename Run, typename Finish>
void bwd_work_items(const AttnBwdParams& g, int64_t units, float dk_factor, MakeState make_state, Run run,
                    Finish finish) {
  const AttnFwdParams& p = g.fwd;
  const int64_t heads = int64_t(p.b) * p.h_kv, kv_floats = int64_t(p.lk) * (p.d + p.dv);
  const int threads = omp_get_max_threads();
  int splits = 1;
  if (heads < threads && units > 1)
    splits = int(std::min<int64_t>(
        {(threads + heads - 1) / heads, units,
         std::max<int64_t>(1, (int64_t(256) << 20) / std::max<int64_t>(1, heads * kv_floats * 4))}));
  const int64_t work = heads * splits;
  ScratchVector<float> parts(splits > 1 ? work * kv_floats : 0);  // per item: dK, then dV
#pragma omp parallel
  {
    auto state = make_state();
#pragma omp for schedule(dynamic, 1)
    for (int64_t x = 0; x < work; ++x) {
      const int64_t head = x / splits;
      float* part = splits > 1 ? parts.data() + x * kv_floats : nullptr;
      run(state, int(head / p.h_kv), int(head % p.h_kv), int(x % splits), splits, part,
          part != nullptr ? part + int64_t(p.lk) * p.d : nullptr);
    }
    finish(state);
  }
  if (splits == 1) return;
  const int64_t rows_per_chunk = 64, chunks = (p.lk + rows_per_chunk - 1) / rows_per_chunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < heads * chunks; ++c) {
    const int64_t head = c / chunks, r0 = (c % chunks) * rows_per_chunk,
                  r1 = std::min<int64_t>(p.lk, r0 + rows_per_chunk);
    for (int which = 0; which < 2; ++which) {
      const int cols = which == 0 ? p.d : p.dv;
      const int64_t at = which == 0 ? 0 : int64_t(p.lk) * p.d;  // dV after dK in each part
      T* out = static_cast<T*>(which == 0 ? g.dk : g.dv) + head * p.lk * cols;
      const float factor = which == 0 ? dk_factor : 1.f;
      for (int64_t x = r0 * cols; x < r1 * cols; ++x) {
        float sum = 0.f;
        for (int sp = 0; sp < splits; ++sp) sum += parts[(head * splits + sp) * kv_floats + at + x];
        out[x] = from_float<T>(sum * factor);
      }
    }
  }
}

// The backward of one (batch, kv head) row by row (top-k's gathered keys): every query row of its
// group, through `keys(b, h, i, f)` calling f(j) for each key j row i sees.
// (An item of bwd_work_items: the rows r = head * Lq + i of the group with r % splits == split.)
template <typename T, typename Keys>
void attention_bwd_head(const AttnBwdParams& g, int b, int hk, const Keys& keys, std::vector<float>& kf,
                        std::vector<float>& vf, std::vector<float>& dk, std::vector<float>& dv, int split,
                        int splits, float* dk_part, float* dv_part) {
  const AttnFwdParams& p = g.fwd;
  const int D = p.d, Dv = p.dv;
  for (int j = 0; j < p.lk; ++j) {
    load_row(k_row<T>(p, b, hk, j), D, &kf[int64_t(j) * D]);
    load_row(v_row<T>(p, b, hk, j), Dv, &vf[int64_t(j) * Dv]);
  }
  std::fill(dk.begin(), dk.end(), 0.f);
  std::fill(dv.begin(), dv.end(), 0.f);
  std::vector<float> q(D), dq(D), o(Dv), dout(Dv);
  for (int64_t r = split; r < int64_t(p.h_per_kv) * p.lq; r += splits) {
    const int h = hk * p.h_per_kv + int(r / p.lq), i = int(r % p.lq);
    const int64_t row = (int64_t(b) * p.h + h) * p.lq + i;
    const float lse = p.lse[row];
    std::fill(dq.begin(), dq.end(), 0.f);
    T* dq_out = static_cast<T*>(g.dq) + row * D;
    if (lse == kNegInf) {  // the row saw no key: no gradient
      for (int c = 0; c < D; ++c) dq_out[c] = from_float<T>(0.f);
      continue;
    }
    load_row(q_row<T>(p, b, h, i), D, q.data());
    load_row(o_row<T>(p, b, h, i), Dv, o.data());
    load_row(
        static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride + i * g.do_row_stride,
        Dv, dout.data());
    const float d_row = dot(dout.data(), o.data(), Dv) - (g.dlse != nullptr ? g.dlse[row] : 0.f);
    keys(b, h, i, [&](int j) {
      const float* kj = &kf[int64_t(j) * D];
      const float* vj = &vf[int64_t(j) * Dv];
      const float pj = std::exp(p.scale * dot(q.data(), kj, D) - lse);
      axpy(pj, dout.data(), &dv[int64_t(j) * Dv], Dv);
      const float ds = pj * (dot(dout.data(), vj, Dv) - d_row) * p.scale;
      axpy(ds, kj, dq.data(), D);
      axpy(ds, q.data(), &dk[int64_t(j) * D], D);
    });
    for (int c = 0; c < D; ++c) dq_out[c] = from_float<T>(dq[c]);
  }
  if (dk_part != nullptr) {
    std::copy(dk.begin(), dk.end(), dk_part);
    std::copy(dv.begin(), dv.end(), dv_part);
    return;
  }
  T* dk_out = static_cast<T*>(g.dk) + (int64_t(b) * p.h_kv + hk) * p.lk * D;
  T* dv_out = static_cast<T*>(g.dv) + (int64_t(b) * p.h_kv + hk) * p.lk * Dv;
  for (int64_t x = 0; x < int64_t(p.lk) * D; ++x) dk_out[x] = from_float<T>(dk[x]);
  for (int64_t x = 0; x < int64_t(p.lk) * Dv; ++x) dv_out[x] = from_float<T>(dv[x]);
}

// The same backward over the forward's key-tile iterator, as TileGemm products (fp32; S and dP of
// bf16 inputs on the matrix unit): per 64-row query tile and 64-key tile S = Q K^T, P,
// dP = dO V^T, dS, then dV += P^T dO, dK += dS^T Q,
// dQ += dS K (the last three through the guarded pv_tile / ptv_tile where an operand holds NaN or
// Inf). The key tiles of the (batch, kv head) are held transposed (K^T, V^T) and as rows (K, V);
// dK and dV accumulate over the group's query heads, in a fixed order.
struct BwdHeadBuffers {
  AlignedVector<float> kf, vf, kT, vT, dk, dv, qf, dof, o, s, dp, dq, st;
  AlignedVector<bf16_t> kT16, vT16;  // bf16 inputs on the matrix unit: K^T, V^T per key tile, VNNI pairs
  // ... and K, the query tile's Q and dO as row pairs (the B operands of dQ, dK, dV), the A operand
  AlignedVector<bf16_t> kp16, qp16, dop16, a16;
};

// m (rows x cols of bf16, row stride ld) as the matrix unit's B operand of rows_pad rows, zero past
// rows: element (r, c) at out[(r / 2) * 2 * cols + 2 * c + r % 2].
inline void pack_row_pairs(const bf16_t* m, int64_t ld, int rows, int rows_pad, int cols, bf16_t* out) {
  const bf16_t zero{0};
  for (int r = 0; r < rows_pad; r += 2) {
    const bf16_t* r0 = r < rows ? m + int64_t(r) * ld : nullptr;
    const bf16_t* r1 = r + 1 < rows ? m + int64_t(r + 1) * ld : nullptr;
    bf16_t* o = out + int64_t(r) * cols;
    for (int c = 0; c < cols; ++c) {
      o[2 * c] = r0 != nullptr ? r0[c] : zero;
      o[2 * c + 1] = r1 != nullptr ? r1[c] : zero;
    }
  }
}

// t (kBlockN x kBlockM) = the first `rows` rows of x (kBlockM x kBlockN) transposed, zeros after: the
// A operand of the key-side products P^T dO and dS^T Q (the products take no transpose flag).
inline void transpose_tile(const float* x, int rows, float* t) {
  static_assert(kBlockM == kBlockN, "transpose_words reads kBlockN rows");
  transpose_words(x, 4 * kBlockN, rows, kBlockN, reinterpret_cast<uint32_t*>(t), kBlockM);
}

// The backward's P and dS of a (query tile, key tile) step, in place: for r < rows and every
// column, P = 2^(s * scale - lse2[r]) where the key is visible (c < cols and, when visible is
// given, bit c of visible[r]) and 0 elsewhere; then dS = P (dP - delta[r]) where P != 0 and 0
// elsewhere (a hidden key's dP may be NaN). s becomes P, dp becomes dS. 32 columns a word: 32-bit
// shifts vectorise, 64-bit ones do not.
SA_CPU_CLONES void bwd_p_ds_tile(float* s, float* dp, int rows, int cols, float scale,
                                 const uint64_t* visible, const float* lse2, const float* delta) {
  constexpr int N = kBlockN;
  const uint64_t in_range = cols >= 64 ? ~0ull : (uint64_t(1) << cols) - 1;
  for (int r = 0; r < rows; ++r) {
    const uint64_t bits = (visible != nullptr ? visible[r] : ~0ull) & in_range;
    const float ref = lse2[r], d = delta[r];
    for (int half = 0; half < N / 32; ++half) {
      const uint32_t word = uint32_t(bits >> (32 * half));
      float* sh = s + r * N + 32 * half;
      float* dh = dp + r * N + 32 * half;
#pragma omp simd
      for (int c = 0; c < 32; ++c) {
        const float x = ((word >> c) & 1u) ? sh[c] * scale : kNegInf;
        const float pc = exp2_poly(x - ref);
        sh[c] = pc;
        dh[c] = pc != 0.f ? pc * (dh[c] - d) : 0.f;
      }
    }
  }
}

// One work item of the backward: kv head hk of batch b over the (query head, query tile) pairs i of
// its group (i = head * tiles + tile) with i % splits == split. dQ is the item's own; dK and dV are
// written to the outputs when the item is the head's only one (splits == 1), else as fp32 partials
// to dk_part / dv_part for attention_bwd_tiled to sum.
template <typename T, typename Tiles>
void attention_bwd_head_tiled(const AttnBwdParams& g, const TileGemm& gm, int b, int hk, BwdHeadBuffers& w,
                              int split, int splits, float* dk_part, float* dv_part) {
  const AttnFwdParams& p = g.fwd;
  const int D = p.d, Dv = p.dv, N = kBlockN;
  // bf16 inputs on the matrix unit: S = Q K^T and dP = dO V^T (exact products, fp32 sums, as the
  // fp32 path up to the order of the sums), and dV += P^T dO, dK += dS^T Q, dQ += dS K with P and dS
  // rounded to bf16 (as the GPU kernels); fp32 K rows stay for the guarded dQ of non-finite K.
  bool amx = false;
  if constexpr (std::is_same_v<T, bf16_t>) amx = gm.bf16 != nullptr && D % 16 == 0 && Dv % 16 == 0;
  for (int j = 0; j < p.lk; ++j) {
    load_row(k_row<T>(p, b, hk, j), D, &w.kf[int64_t(j) * D]);
    if (!amx) load_row(v_row<T>(p, b, hk, j), Dv, &w.vf[int64_t(j) * Dv]);
  }
  for (int t = 0; t * N < p.lk; ++t) {  // K^T and V^T per key tile (missing keys as zero columns)
    const int cols = std::min(N, p.lk - t * N);
    if constexpr (std::is_same_v<T, bf16_t>) {
      if (amx) {
        transpose_words(k_row<T>(p, b, hk, t * N), 2 * p.k_row_stride, cols, D / 2,
                        reinterpret_cast<uint32_t*>(&w.kT16[int64_t(t) * D * N]), N);
        transpose_words(v_row<T>(p, b, hk, t * N), 2 * p.v_row_stride, cols, Dv / 2,
                        reinterpret_cast<uint32_t*>(&w.vT16[int64_t(t) * Dv * N]), N);
        continue;
      }
    }
    transpose_words(&w.kf[int64_t(t) * N * D], 4 * D, cols, D,
                    reinterpret_cast<uint32_t*>(&w.kT[int64_t(t) * D * N]), N);
    transpose_words(&w.vf[int64_t(t) * N * Dv], 4 * Dv, cols, Dv,
                    reinterpret_cast<uint32_t*>(&w.vT[int64_t(t) * Dv * N]), N);
  }
  if constexpr (std::is_same_v<T, bf16_t>)
    if (amx)
      pack_row_pairs(k_row<T>(p, b, hk, 0), p.k_row_stride, p.lk, int(w.kp16.size() / D), D, w.kp16.data());
  std::fill(w.dk.begin(), w.dk.end(), 0.f);
  std::fill(w.dv.begin(), w.dv.end(), 0.f);
  const bool k_finite = all_finite(w.kf.data(), int64_t(p.lk) * D);
  const int num_m = (p.lq + kBlockM - 1) / kBlockM;
  float lse2[kBlockM], delta[kBlockM];
  uint64_t visible[kBlockM];
  // (interleaved pairs: under a causal mask every split gets early and late query tiles)
  for (int i = split; i < p.h_per_kv * num_m; i += splits) {
    const int h = hk * p.h_per_kv + i / num_m, m_block = i % num_m;
    const int m0 = m_block * kBlockM, rows = std::min(kBlockM, p.lq - m0);
    for (int r = 0; r < rows; ++r) {
      const int64_t row = (int64_t(b) * p.h + h) * p.lq + m0 + r;
      load_row(q_row<T>(p, b, h, m0 + r), D, &w.qf[r * D]);
      load_row(static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride +
                   int64_t(m0 + r) * g.do_row_stride,
               Dv, &w.dof[r * Dv]);
      load_row(o_row<T>(p, b, h, m0 + r), Dv, w.o.data());
      delta[r] = dot(&w.dof[r * Dv], w.o.data(), Dv) - (g.dlse != nullptr ? g.dlse[row] : 0.f);
      const float lse = p.lse[row];  // -inf (no key seen): +inf in log2 units, so every P is 0
      lse2[r] = lse == kNegInf ? std::numeric_limits<float>::infinity() : lse * float(M_LOG2E);
    }
    std::fill(w.dq.begin(), w.dq.end(), 0.f);
    const bool q_finite = all_finite(w.qf.data(), int64_t(rows) * D);
    const bool do_finite = all_finite(w.dof.data(), int64_t(rows) * Dv);
    if constexpr (std::is_same_v<T, bf16_t>) {
      if (amx) {
        pack_row_pairs(q_row<T>(p, b, h, m0), p.q_row_stride, rows, kBlockM, D, w.qp16.data());
        pack_row_pairs(static_cast<const bf16_t*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride +
                           int64_t(m0) * g.do_row_stride,
                       g.do_row_stride, rows, kBlockM, Dv, w.dop16.data());
      }
    }
    const Tiles tiles(p, b, h, m_block);
    for (int it = 0; it < tiles.num_tiles(); ++it) {
      const int nb = tiles.n_block(it), n0 = nb * N, cols = std::min(N, p.lk - n0);
      if (cols <= 0) continue;
      if (amx) {
        if constexpr (std::is_same_v<T, bf16_t>) {
          const bf16_t* dout = static_cast<const bf16_t*>(g.dout) + b * g.do_batch_stride +
                               h * g.do_head_stride + int64_t(m0) * g.do_row_stride;
          gm.bf16(rows, N, D, p.q_row_stride, N, N, false, q_row<T>(p, b, h, m0),
                  &w.kT16[int64_t(nb) * D * N], w.s.data());
          gm.bf16(rows, N, Dv, g.do_row_stride, N, N, false, dout, &w.vT16[int64_t(nb) * Dv * N],
                  w.dp.data());
        }
      } else {
        gm.f32(rows, N, D, D, N, N, false, w.qf.data(), &w.kT[int64_t(nb) * D * N], w.s.data());
        gm.f32(rows, N, Dv, Dv, N, N, false, w.dof.data(), &w.vT[int64_t(nb) * Dv * N], w.dp.data());
      }
      const bool need_mask = tiles.tile_needs_mask(it);
      if (need_mask)
        for (int r = 0; r < rows; ++r) visible[r] = tiles.visible_bits(it, m0 + r);
      bwd_p_ds_tile(w.s.data(), w.dp.data(), rows, cols, p.scale_log2, need_mask ? visible : nullptr, lse2,
                    delta);
      // The products where their operands are finite; otherwise the guarded ones, whose zero P
      // or dS (a hidden key) adds exactly 0 even against a NaN.
      if (amx && do_finite && q_finite && k_finite) {
        transpose_tile(w.s.data(), rows, w.st.data());  // dV += P^T dO
        scale_to_bf16(w.st.data(), 1.f, N * kBlockM, w.a16.data());
        gm.bf16(cols, Dv, kBlockM, kBlockM, Dv, Dv, true, w.a16.data(), w.dop16.data(),
                &w.dv[int64_t(n0) * Dv]);
        transpose_tile(w.dp.data(), rows, w.st.data());  // dK += dS^T Q
        scale_to_bf16(w.st.data(), 1.f, N * kBlockM, w.a16.data());
        gm.bf16(cols, D, kBlockM, kBlockM, D, D, true, w.a16.data(), w.qp16.data(), &w.dk[int64_t(n0) * D]);
        scale_to_bf16(w.dp.data(), 1.f, rows * N, w.a16.data());  // dQ += dS K
        gm.bf16(rows, D, N, N, D, D, true, w.a16.data(), &w.kp16[int64_t(n0) * D], w.dq.data());
        continue;
      }
      if (do_finite) {  // dV += P^T dO
        transpose_tile(w.s.data(), rows, w.st.data());
        gm.f32(cols, Dv, rows, kBlockM, Dv, Dv, true, w.st.data(), w.dof.data(), &w.dv[int64_t(n0) * Dv]);
      } else {
        ptv_tile(w.s.data(), w.dof.data(), rows, cols, Dv, &w.dv[int64_t(n0) * Dv], false);
      }
      if (q_finite) {  // dK += dS^T Q
        transpose_tile(w.dp.data(), rows, w.st.data());
        gm.f32(cols, D, rows, kBlockM, D, D, true, w.st.data(), w.qf.data(), &w.dk[int64_t(n0) * D]);
      } else {
        ptv_tile(w.dp.data(), w.qf.data(), rows, cols, D, &w.dk[int64_t(n0) * D], false);
      }
      if (k_finite) {  // dQ += dS K
        gm.f32(rows, D, cols, N, D, D, true, w.dp.data(), &w.kf[int64_t(n0) * D], w.dq.data());
      } else {
        pv_tile(w.dp.data(), &w.kf[int64_t(n0) * D], rows, cols, D, w.dq.data(), false);
      }
    }
    for (int r = 0; r < rows; ++r) {
      T* dq_out = static_cast<T*>(g.dq) + ((int64_t(b) * p.h + h) * p.lq + m0 + r) * D;
      for (int c = 0; c < D; ++c) dq_out[c] = from_float<T>(w.dq[r * D + c] * p.scale);
    }
  }
  if (dk_part != nullptr) {
    std::copy(w.dk.begin(), w.dk.end(), dk_part);
    std::copy(w.dv.begin(), w.dv.end(), dv_part);
    return;
  }
  T* dk_out = static_cast<T*>(g.dk) + (int64_t(b) * p.h_kv + hk) * p.lk * D;
  T* dv_out = static_cast<T*>(g.dv) + (int64_t(b) * p.h_kv + hk) * p.lk * Dv;
  for (int64_t x = 0; x < int64_t(p.lk) * D; ++x) dk_out[x] = from_float<T>(w.dk[x] * p.scale);
  for (int64_t x = 0; x < int64_t(p.lk) * Dv; ++x) dv_out[x] = from_float<T>(w.dv[x]);
}

template <typename T, typename Tiles>
void attention_bwd_tiled(const AttnBwdParams& g, const TileGemm& gm) {
  const AttnFwdParams& p = g.fwd;
  const int64_t keys = int64_t((p.lk + kBlockN - 1) / kBlockN) * kBlockN;
  const bool amx = std::is_same_v<T, bf16_t> && gm.bf16 != nullptr;
  auto make = [&] {
    BwdHeadBuffers w;
    w.kf.resize(int64_t(p.lk) * p.d);
    w.vf.resize(int64_t(p.lk) * p.dv);
    w.kT.resize(keys * p.d);
    w.vT.resize(keys * p.dv);
    w.dk.resize(w.kf.size());
    w.dv.resize(w.vf.size());
    w.qf.resize(kBlockM * p.d);
    w.dof.resize(kBlockM * p.dv);
    w.o.resize(p.dv);
    w.s.resize(kBlockM * kBlockN);
    w.dp.resize(kBlockM * kBlockN);
    w.dq.resize(kBlockM * p.d);
    w.st.resize(kBlockN * kBlockM);
    if (amx) {
      w.kT16.resize(keys * p.d);
      w.vT16.resize(keys * p.dv);
      w.kp16.resize(keys * p.d);
      w.qp16.resize(kBlockM * p.d);
      w.dop16.resize(kBlockM * p.dv);
      w.a16.resize(kBlockN * kBlockM);
    }
    return w;
  };
  const int pairs = p.h_per_kv * ((p.lq + kBlockM - 1) / kBlockM);
  bwd_work_items<T>(
      g, pairs, p.scale, make,
      [&](BwdHeadBuffers& w, int b, int hk, int split, int splits, float* dk_part, float* dv_part) {
        attention_bwd_head_tiled<T, Tiles>(g, gm, b, hk, w, split, splits, dk_part, dv_part);
      },
      [&](BwdHeadBuffers&) {
        if (amx) gm.release_bf16();
      });
}

template <typename T, typename Keys>
void attention_bwd(const AttnBwdParams& g, const Keys& keys) {
  const AttnFwdParams& p = g.fwd;
  struct State {
    std::vector<float> kf, vf, dk, dv;
  };
  auto make = [&]() -> State {
    State st;
    st.kf.resize(int64_t(p.lk) * p.d);
    st.vf.resize(int64_t(p.lk) * p.dv);
    st.dk.resize(st.kf.size());
    st.dv.resize(st.vf.size());
    return st;
  };
  bwd_work_items<T>(
      g, int64_t(p.h_per_kv) * p.lq, 1.f, make,
      [&](State& st, int b, int hk, int split, int splits, float* dk_part, float* dv_part) {
        attention_bwd_head<T>(g, b, hk, keys, st.kf, st.vf, st.dk, st.dv, split, splits, dk_part, dv_part);
      },
      [](State&) {});
}

// ---------------------------------------------------------------------------------------------
// Selection: scores of each query row against its visible keys, then the top k by (score desc,
// index asc), written ascending by index.
//
// The top k of one row's scores s[0, nv) (score desc, index asc; NaN as +inf), ascending, -1 padded
// to p.topk, into out: the k-th largest key, then one pass in index order takes every key above it
// and as many equal to it as k leaves room for, the lower indices first. (select_row_avx512 below
// is the same selection in AVX-512 intrinsics.)
//
// "larger" in the top-k order: higher score first (lower index on ties); NaN counts as +inf, so a
// NaN key is selected and propagates instead of being silently dropped.
inline uint32_t select_key(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(std::isnan(x) ? std::numeric_limits<float>::infinity() : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline void select_row(const TopkSelectParams& p, const float* s, int64_t nv, std::vector<uint32_t>& keys,
                       int32_t* out) {
  const int kk = int(std::min<int64_t>(p.topk, nv));
  int n = 0;
  if (kk > 0) {
    uint32_t* key = keys.data();
    for (int64_t t = 0; t < nv; ++t) key[t] = select_key(s[t]);
    // The k-th largest key T: the largest value with at least kk keys >= T, bit by bit (each step a
    // count the compiler vectorises, no data-dependent branch).
    uint32_t kth = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t c = kth | (1u << bit);
      int cnt = 0;
#pragma omp simd reduction(+ : cnt)
      for (int64_t t = 0; t < nv; ++t) cnt += key[t] >= c;
      if (cnt >= kk) kth = c;
    }
    int greater = 0;
#pragma omp simd reduction(+ : greater)
    for (int64_t t = 0; t < nv; ++t) greater += key[t] > kth;
    int ties = kk - greater;
    for (int64_t t = 0; t < nv && n < kk; ++t) {  // branch-free writes: the index lands, n moves if taken
      const bool tie = key[t] == kth && ties > 0;
      ties -= tie;
      out[n] = int32_t(t);
      n += (key[t] > kth) | tie;
    }
  }
  std::fill(out + n, out + p.topk, -1);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SA_CPU_AVX512_SELECT 1
#define SA_AVX512_SELECT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
// select_row in AVX-512, without data-dependent branches (the scalar passes mispredict on every
// other key): the keys once into `keys`; the k-th largest key T by a binary search over its 32
// bits (each step one count of the keys at or above a candidate, 16 keys per compare); then one
// pass writes, by compress-store, the indices of the keys above T and of the first ties.
// How many of keys[0, n) are >= c.
SA_AVX512_SELECT int keys_at_least(const uint32_t* keys, int64_t n, uint32_t c) {
  const __m512i vc = _mm512_set1_epi32(int(c));
  int cnt = 0;
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 live = n - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - t)) - 1);
    cnt +=
        __builtin_popcount(_mm512_mask_cmpge_epu32_mask(live, _mm512_maskz_loadu_epi32(live, keys + t), vc));
  }
  return cnt;
}

SA_AVX512_SELECT void select_row_avx512(const TopkSelectParams& p, const float* s, int64_t nv,
                                        std::vector<uint32_t>& keys, int32_t* out) {
  const int kk = int(std::min<int64_t>(p.topk, nv));
  int n = 0;
  if (kk > 0) {
    const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    const __m512i sign = _mm512_set1_epi32(int(0x80000000u)), ones = _mm512_set1_epi32(-1);
    for (int64_t t = 0; t < nv; t += 16) {
      const __mmask16 live = nv - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (nv - t)) - 1);
      __m512 x = _mm512_maskz_loadu_ps(live, s + t);
      x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), inf);  // NaN ranks as +inf
      const __m512i u = _mm512_castps_si512(x);
      const __mmask16 negative = _mm512_movepi32_mask(u);
      const __m512i key = _mm512_mask_xor_epi32(_mm512_or_si512(u, sign), negative, u, ones);
      _mm512_mask_storeu_epi32(keys.data() + t, live, key);
    }
    auto count_at_least = [&](uint32_t c) { return keys_at_least(keys.data(), nv, c); };
    uint32_t kth = 0;  // the largest T with at least kk keys >= T: the k-th largest key
    for (int bit = 31; bit >= 0; --bit)
      if (count_at_least(kth | (1u << bit)) >= kk) kth |= 1u << bit;
    int ties = kk - (kth == 0xffffffffu ? 0 : count_at_least(kth + 1));
    const __m512i vk = _mm512_set1_epi32(int(kth));
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t t = 0; t < nv; t += 16, idx = _mm512_add_epi32(idx, step)) {
      const __mmask16 live = nv - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (nv - t)) - 1);
      const __m512i key = _mm512_maskz_loadu_epi32(live, keys.data() + t);
      const __mmask16 above = _mm512_mask_cmpgt_epu32_mask(live, key, vk);
      __mmask16 equal = _mm512_mask_cmpeq_epu32_mask(live, key, vk);
      int eq = __builtin_popcount(equal);
      while (eq > ties) {  // keep the lowest-index ties only
        equal &= __mmask16(~(0x8000u >> __builtin_clz(uint32_t(equal) << 16)));
        --eq;
      }
      ties -= eq;
      const __mmask16 take = above | equal;
      _mm512_mask_compressstoreu_epi32(out + n, take, idx);
      n += __builtin_popcount(take);
    }
  }
  std::fill(out + n, out + p.topk, -1);
}
#endif

// One row's selection: the AVX-512 select where the CPU has it.
inline void select_row_best(const TopkSelectParams& p, const float* s, int64_t nv,
                            std::vector<uint32_t>& keys, int32_t* out) {
#ifdef SA_CPU_AVX512_SELECT
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                             !cpu_generic();
  if (avx512) return select_row_avx512(p, s, nv, keys, out);
#endif
  select_row(p, s, nv, keys, out);
}

// Exact mode: per (batch, head, tile of kSelRows query rows) the scores Q K^T of the keys the tile's
// last row sees, as TileGemm products against K^T (fp32, D x Lk, converted once per (batch, kv
// head) and thread), then each row's selection. Memory: O(kSelRows x Lk + D x Lk) per thread.
constexpr int kSelRows = 32;

template <typename T>
void select_exact(const TopkSelectParams& p, const TileGemm& g) {
  const int num_m = (p.lq + kSelRows - 1) / kSelRows;
  const int64_t work = int64_t(p.b) * p.h_sel * num_m;
  const int D = p.d;
  const int64_t ldk = (int64_t(p.lk) + 15) / 16 * 16;
#pragma omp parallel
  {
    AlignedVector<float> qf(kSelRows * D), kT(D * ldk), s(kSelRows * ldk);
    std::vector<uint32_t> keys(p.lk);
    int64_t cached = -1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < work; ++w) {
      const int mb = int(w % num_m), hs = int((w / num_m) % p.h_sel), b = int(w / (int64_t(num_m) * p.h_sel));
      const int hk = hs / p.h_per_kv, i0 = mb * kSelRows, rows = std::min(kSelRows, p.lq - i0);
      const T* kb = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
      if (int64_t(b) * p.h_kv + hk != cached) {
        cached = int64_t(b) * p.h_kv + hk;
        for (int x = 0; x < D; ++x)
          for (int64_t t = 0; t < p.lk; ++t) kT[x * ldk + t] = to_float(kb[t * p.k_row_stride + x]);
      }
      for (int r = 0; r < rows; ++r)
        load_row(static_cast<const T*>(p.q) + b * p.q_batch_stride + hs * p.q_head_stride +
                     int64_t(i0 + r) * p.q_row_stride,
                 D, &qf[r * D]);
      int64_t nv_max = p.lk;
      if (p.causal) nv_max = std::clamp<int64_t>(int64_t(i0 + rows - 1) + p.kv_offset + 1, 0, p.lk);
      for (int64_t c0 = 0; c0 < nv_max; c0 += 512) {
        const int n = int(std::min<int64_t>(512, nv_max - c0));
        g.f32(rows, n, D, D, int(ldk), int(ldk), false, qf.data(), &kT[c0], &s[c0]);
      }
      for (int r = 0; r < rows; ++r) {
        const int i = i0 + r;
        int64_t nv = p.lk;
        if (p.causal) nv = std::clamp<int64_t>(int64_t(i) + p.kv_offset + 1, 0, p.lk);
        const int64_t row = (int64_t(b) * p.h_sel + hs) * p.lq + i;
        select_row_best(p, &s[r * ldk], nv, keys, p.out + row * p.topk);
      }
    }
  }
}

// Indexer mode (one index set per token): score(t, s) = sum_j w[t, j] * relu(qi[t, j] . ki[s]).
// Per (batch, tile of kSelRows rows), for each indexer head j the products Qi_j Ki^T as TileGemm
// products against Ki^T (fp32, DI x Lk, converted once per batch element and thread), folded into
// the scores as w * relu(.), then each row's selection.
template <typename T>
void select_indexer(const TopkSelectParams& p, const TileGemm& g) {
  const int num_m = (p.lq + kSelRows - 1) / kSelRows;
  const int64_t work = int64_t(p.b) * num_m;
  const int DI = p.di;
  const int64_t ldk = (int64_t(p.lk) + 15) / 16 * 16;
#pragma omp parallel
  {
    AlignedVector<float> qf(kSelRows * DI), wf(kSelRows * p.hi), kT(DI * ldk), prod(kSelRows * ldk),
        s(kSelRows * ldk);
    std::vector<uint32_t> keys(p.lk);
    int cached = -1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < work; ++w) {
      const int mb = int(w % num_m), b = int(w / num_m);
      const int i0 = mb * kSelRows, rows = std::min(kSelRows, p.lq - i0);
      if (b != cached) {
        cached = b;
        const T* ik = static_cast<const T*>(p.ik) + b * p.ik_batch_stride;
        for (int x = 0; x < DI; ++x)
          for (int64_t t = 0; t < p.lk; ++t) kT[x * ldk + t] = to_float(ik[t * p.ik_row_stride + x]);
      }
      int64_t nv_max = p.lk;
      if (p.causal) nv_max = std::clamp<int64_t>(int64_t(i0 + rows - 1) + p.kv_offset + 1, 0, p.lk);
      const T* iw = static_cast<const T*>(p.iw) + b * p.iw_batch_stride;
      for (int r = 0; r < rows; ++r) load_row(iw + int64_t(i0 + r) * p.iw_row_stride, p.hi, &wf[r * p.hi]);
      for (int r = 0; r < rows; ++r) std::fill(&s[r * ldk], &s[r * ldk] + nv_max, 0.f);
      for (int j = 0; j < p.hi; ++j) {
        const T* iq = static_cast<const T*>(p.iq) + b * p.iq_batch_stride + j * p.iq_head_stride;
        for (int r = 0; r < rows; ++r) load_row(iq + int64_t(i0 + r) * p.iq_row_stride, DI, &qf[r * DI]);
        for (int64_t c0 = 0; c0 < nv_max; c0 += 512) {
          const int n = int(std::min<int64_t>(512, nv_max - c0));
          g.f32(rows, n, DI, DI, int(ldk), int(ldk), false, qf.data(), &kT[c0], &prod[c0]);
        }
        for (int r = 0; r < rows; ++r) {
          const float wj = wf[r * p.hi + j];
          float* sr = &s[r * ldk];
          const float* pr = &prod[r * ldk];
          // relu as std::max(x, 0) is (NaN propagating), written as a select the compiler vectorises
#pragma omp simd
          for (int64_t t = 0; t < nv_max; ++t) sr[t] += wj * (pr[t] < 0.f ? 0.f : pr[t]);
        }
      }
      for (int r = 0; r < rows; ++r) {
        const int i = i0 + r;
        int64_t nv = p.lk;
        if (p.causal) nv = std::clamp<int64_t>(int64_t(i) + p.kv_offset + 1, 0, p.lk);
        select_row_best(p, &s[r * ldk], nv, keys, p.out + (int64_t(b) * p.lq + i) * p.topk);
      }
    }
  }
}

}  // namespace

void dense_fwd(const AttnFwdParams& p) {
  dispatch_dtype(p.dtype, [&](auto t) { dense_impl<decltype(t)>(p); });
}

void flash_fwd(const AttnFwdParams& p, const TileGemm& g) {
  const int rows = flash_fwd_cpu_tile(Variant::kWindow, p.lq, p.window_left,
                                      cpu_fp32_products(p.dtype, p.d, p.dv, g.bf16 != nullptr))
                       .block_m;
  if (rows == kCpuWidestRows)
    dispatch_dtype(p.dtype,
                   [&](auto t) { tiled_attention<decltype(t), WindowTiles<kCpuWidestRows, kBlockN>>(p, g); });
  else if (rows == kCpuWideRows)
    dispatch_dtype(p.dtype,
                   [&](auto t) { tiled_attention<decltype(t), WindowTiles<kCpuWideRows, kBlockN>>(p, g); });
  else
    dispatch_dtype(p.dtype,
                   [&](auto t) { tiled_attention<decltype(t), WindowTiles<kBlockM, kBlockN>>(p, g); });
}

void block_sparse_fwd(const AttnFwdParams& p, const TileGemm& g) {
  dispatch_dtype(p.dtype,
                 [&](auto t) { tiled_attention<decltype(t), BlockSparseTiles<kBlockM, kBlockN>>(p, g); });
}

void gather_fwd(const AttnFwdParams& p) {
  dispatch_dtype(p.dtype, [&](auto t) { gather_impl<decltype(t)>(p); });
}

void flash_bwd(const AttnBwdParams& g, const TileGemm& gm) {
  dispatch_dtype(g.fwd.dtype,
                 [&](auto t) { attention_bwd_tiled<decltype(t), WindowTiles<kBlockM, kBlockN>>(g, gm); });
}

void block_sparse_bwd(const AttnBwdParams& g, const TileGemm& gm) {
  dispatch_dtype(g.fwd.dtype, [&](auto t) {
    attention_bwd_tiled<decltype(t), BlockSparseTiles<kBlockM, kBlockN>>(g, gm);
  });
}

void gather_bwd(const AttnBwdParams& g) {
  const AttnFwdParams& p = g.fwd;
  auto listed = [&p](int b, int h, int i, auto&& f) {
    const int32_t* idx = p.indices + b * p.idx_batch_stride + (h / p.h_per_idx) * p.idx_head_stride +
                         int64_t(i) * p.idx_row_stride;
    for (int t = 0; t < p.topk; ++t)
      if (idx[t] >= 0 && idx[t] < p.lk) f(idx[t]);
  };
  dispatch_dtype(p.dtype, [&](auto t) { attention_bwd<decltype(t)>(g, listed); });
}

void topk_select(const TopkSelectParams& p, const TileGemm& g) {
  dispatch_dtype(p.dtype, [&](auto t) {
    if (p.indexer)
      select_indexer<decltype(t)>(p, g);
    else
      select_exact<decltype(t)>(p, g);
  });
}

}  // namespace sparse_attn::cpu
