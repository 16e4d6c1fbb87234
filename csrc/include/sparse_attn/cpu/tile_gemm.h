// The matrix products of the CPU main loops. The torch glue supplies them (csrc/api/ops_cpu.cpp:
// PyTorch's CPU micro-kernels, oneDNN's brgemm on AMX or AVX-512 where the CPU has them), so the
// kernels stay torch-free while a tile product runs at the machine's GEMM speed.
#pragma once

#include "sparse_attn/numeric.h"

namespace sparse_attn::cpu {

struct TileGemm {
  // c (m x n, row stride ldc) = a (m x k, row stride lda) * b (k x n, row stride ldb), plus c's
  // old value when add; fp32 throughout.
  void (*f32)(int m, int n, int k, int64_t lda, int ldb, int ldc, bool add, const float* a, const float* b,
              float* c);
  // The same with bf16 a, and b in pairs of rows (VNNI): element (i, j) of b at
  // b[(i / 2) * 2 * ldb + 2 * j + i % 2], k even; n a multiple of 16; fp32 c. Null
  // where the CPU has no bf16 matrix instructions: bf16 then runs through f32.
  void (*bf16)(int m, int n, int k, int64_t lda, int ldb, int ldc, bool add, const bf16_t* a, const bf16_t* b,
               float* c);
  // Ends a thread's run of bf16 products (releases the matrix unit's state).
  void (*release_bf16)();
};

}  // namespace sparse_attn::cpu
