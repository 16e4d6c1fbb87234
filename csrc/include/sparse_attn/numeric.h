// Host-side conversions between fp32 and the 16-bit storage formats (bf16, fp16), so the CPU
// kernels need neither torch nor compiler extensions. Round to nearest even; NaN stays NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace sparse_attn {

struct bf16_t { uint16_t bits; };
struct fp16_t { uint16_t bits; };

inline uint32_t float_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float bits_float(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bits_float(uint32_t(x.bits) << 16); }

inline float to_float(fp16_t x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // Subnormal half: normalise into a float.
    exp = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
    return bits_float(sign | (exp << 23) | ((mant & 0x3ffu) << 13));
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }

template <> inline bf16_t from_float<bf16_t>(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{uint16_t(u >> 16)};
}

template <> inline fp16_t from_float<fp16_t>(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return fp16_t{uint16_t(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u))};
  if (a >= 0x477ff000u) return fp16_t{uint16_t(sign | 0x7c00u)};  // rounds past 65504
  if (a < 0x38800000u) {
    // Below the smallest normal half (2^-14): the mantissa is round(|x| * 2^24).
    const float m = std::nearbyint(bits_float(a) * 16777216.0f);
    return fp16_t{uint16_t(sign | uint16_t(m))};
  }
  uint32_t h = (((a >> 23) - 112) << 10) | ((a & 0x7fffffu) >> 13);
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return fp16_t{uint16_t(sign | h)};
}

}  // namespace sparse_attn
