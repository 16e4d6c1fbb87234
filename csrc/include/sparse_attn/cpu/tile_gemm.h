// The matrix products of the CPU main loops. The torch glue supplies them (csrc/api/ops_cpu.cpp:
// PyTorch's CPU micro-kernels, oneDNN's brgemm on AMX or AVX-512 where the CPU has them), so the
// kernels stay torch-free while a tile product runs at the machine's GEMM speed.
#pragma once

#include <cstddef>
#include <new>
#include <utility>
#include <vector>

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

// Buffers the products read or write: 64-byte aligned, so that every row of a 64-byte multiple
// stride starts a cache line (the matrix unit's tile loads and stores of misaligned rows touch two
// lines each: AMX bf16 products ran at ~40 % of their aligned speed on std::vector's 16-byte
// alignment).
// kZeroed false: elements are left uninitialised (default-initialised) where std::vector would
// zero them, for scratch buffers that are written before they are read.
template <typename T, bool kZeroed = true>
struct CacheLineAllocator {
  using value_type = T;
  template <typename U>
  struct rebind {
    using other = CacheLineAllocator<U, kZeroed>;
  };
  static constexpr std::align_val_t kAlign{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U, kZeroed>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* ptr, std::size_t) { ::operator delete(ptr, kAlign); }
  template <typename U, typename... Args>
  void construct(U* ptr, Args&&... args) {
    if constexpr (sizeof...(Args) == 0 && !kZeroed)
      ::new (static_cast<void*>(ptr)) U;
    else
      ::new (static_cast<void*>(ptr)) U(std::forward<Args>(args)...);
  }
  template <typename U>
  bool operator==(const CacheLineAllocator<U, kZeroed>&) const {
    return true;
  }
};

template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;
template <typename T>
using ScratchVector = std::vector<T, CacheLineAllocator<T, false>>;

}  // namespace sparse_attn::cpu
