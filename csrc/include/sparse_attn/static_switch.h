// Run-time values to compile-time template arguments. Each switch matches exact values and
// reports the bad value in its default branch; at most three are nested per launch site.
#pragma once

#include <stdexcept>
#include <string>

#include "sparse_attn/params.h"

#define SA_BOOL_SWITCH(COND, NAME, ...)     \
  [&] {                                     \
    if (COND) {                             \
      constexpr static bool NAME = true;    \
      return __VA_ARGS__();                 \
    } else {                                \
      constexpr static bool NAME = false;   \
      return __VA_ARGS__();                 \
    }                                       \
  }()

// Tensor-core dtypes only (fp16, bf16); fp32 has its own path.
#define SA_HALF_DTYPE_SWITCH(DTYPE, NAME, ...)                                                  \
  [&] {                                                                                         \
    switch (DTYPE) {                                                                            \
      case ::sparse_attn::ScalarKind::kBFloat16: {                                              \
        constexpr static ::sparse_attn::ScalarKind NAME = ::sparse_attn::ScalarKind::kBFloat16; \
        return __VA_ARGS__();                                                                   \
      }                                                                                         \
      case ::sparse_attn::ScalarKind::kFloat16: {                                               \
        constexpr static ::sparse_attn::ScalarKind NAME = ::sparse_attn::ScalarKind::kFloat16;  \
        return __VA_ARGS__();                                                                   \
      }                                                                                         \
      default:                                                                                  \
        throw std::invalid_argument("tensor-core kernels take bfloat16 or float16, got dtype " \
                                    + std::to_string(int(DTYPE)));                              \
    }                                                                                           \
  }()

// Compiled head dimensions: 64, 128, 256 (smaller multiples of 8 are padded up, see
// padded_head_dim in plan.h).
#define SA_HEADDIM_SWITCH(HEADDIM, NAME, ...)                                             \
  [&] {                                                                                   \
    switch (HEADDIM) {                                                                    \
      case 64: { constexpr static int NAME = 64; return __VA_ARGS__(); }                  \
      case 128: { constexpr static int NAME = 128; return __VA_ARGS__(); }                \
      case 256: { constexpr static int NAME = 256; return __VA_ARGS__(); }                \
      default:                                                                            \
        throw std::invalid_argument("no kernel for head dimension " + std::to_string(HEADDIM)); \
    }                                                                                     \
  }()
