// Thin wrappers over the Hopper (sm_90a) instructions of the wgmma core: mbarriers, bulk tensor
// copies (TMA), wgmma fences and shared-memory matrix descriptors, register reallocation.
// Bodies are empty when compiled for another architecture; the launcher never runs them there.
#pragma once

#include <cstdint>

namespace sparse_attn::cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SA_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define SA_SM90_ASM(...) \
  do {                   \
  } while (0)
#endif

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  SA_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_init_fence() {
  SA_SM90_ASM("fence.mbarrier_init.release.cluster;\n" :: : "memory");
}
// Arrive and add `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  SA_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  SA_SM90_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// True once the phase of parity `parity` has completed (a fresh barrier is in phase 0, so parity 1
// counts as completed); the hardware may suspend the thread a while before answering false.
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 1;
  SA_SM90_ASM(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar),
      "r"(parity) : "memory");
  return done != 0;
}
// Blocks until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// The same for a thread off the critical path: it sleeps between polls, so that it takes few
// issue slots from the warps it shares a scheduler with.
__device__ __forceinline__ void mbar_wait_idle(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) __nanosleep(256);
}

// Tile of a 4-d tensor map at coordinates (c0 innermost .. c3) into shared memory; completion
// is signalled on `bar` as transaction bytes (the whole box, out-of-range elements zero-filled).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  SA_SM90_ASM(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// Contiguous bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from global
// to shared memory, completion signalled on `bar` as transaction bytes.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  SA_SM90_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// The ordered reductions' counters (AttnBwdParams::dq_order): a load with acquire semantics at GPU
// scope (what other CTAs released before it is visible after it), and an increment that releases
// everything this CTA did before it (fence.acq_rel is cumulative: other threads' reductions that
// an mbarrier ordered before this thread's fence are released with it).
__device__ __forceinline__ int ld_acquire_gpu(const int* src) {
  int v = 0;
  SA_SM90_ASM("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(src) : "memory");
  return v;
}
__device__ __forceinline__ int ld_relaxed_gpu(const int* src) {  // acquires with a later fence.acq_rel
  int v = 0;
  SA_SM90_ASM("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(src) : "memory");
  return v;
}
__device__ __forceinline__ void release_increment_gpu(int* dst) {
  SA_SM90_ASM(
      "fence.acq_rel.gpu;\n"
      "red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(dst) : "memory");
}
// Four 8x8 16-bit matrices from registers (mma.sync's fragment layout: lane l holds row l / 4,
// columns 2 (l % 4) and 2 (l % 4) + 1 of each) to shared memory transposed: row i of matrix j
// in memory is column i of the fragment, at the address lane 8 j + i gives.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  SA_SM90_ASM("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
              "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// Bulk tensor store of a box from shared memory (written by this CTA, made visible to the async
// proxy by fence_proxy_async and a barrier) to global memory; out-of-range elements are not
// written. Completion is tracked per issuing thread in bulk groups.
__device__ __forceinline__ void tma_store_4d(const void* tmap, uint32_t src, int c0, int c1, int c2, int c3) {
  SA_SM90_ASM("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                  reinterpret_cast<uint64_t>(tmap)),
              "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void bulk_commit_group() {
  SA_SM90_ASM("cp.async.bulk.commit_group;\n" :: : "memory");
}
// This thread's bulk groups: all but the newest N have finished reading their shared memory
// (kRead) or finished entirely.
template <int N, bool kRead>
__device__ __forceinline__ void bulk_wait_group() {
  if constexpr (kRead)
    SA_SM90_ASM("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
  else
    SA_SM90_ASM("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const void* tmap) {
  SA_SM90_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// Shared memory written by ordinary stores, next read or overwritten by the async proxy
// (wgmma, TMA), or the reverse.
__device__ __forceinline__ void fence_proxy_async() {
  SA_SM90_ASM("fence.proxy.async.shared::cta;\n" :: : "memory");
}

// This thread's bulk-async (TMA) writes to global memory, waited for, ordered before the generic
// stores that follow (its own, and through a barrier other threads').
__device__ __forceinline__ void fence_proxy_async_global() {
  SA_SM90_ASM("fence.proxy.async.global;\n" :: : "memory");
}

__device__ __forceinline__ void wgmma_fence() { SA_SM90_ASM("wgmma.fence.sync.aligned;\n" :: : "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  SA_SM90_ASM("wgmma.commit_group.sync.aligned;\n" :: : "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  SA_SM90_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads or writes of registers that an in-flight wgmma owns
// across this point (the asm statements are volatile, so they stay in order).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  SA_SM90_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  SA_SM90_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Named barrier over `threads` threads (id 0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// wgmma shared-memory matrix descriptor for a 128-byte-swizzled operand: start address, leading
// and stride byte offsets (K-major: stride = bytes between 8-row groups, leading unused; MN-major:
// leading = bytes between 64-element column blocks, stride = bytes between 8-row groups).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t leading, uint32_t stride) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((leading >> 4) & 0x3FFF) << 16) |
         (uint64_t((stride >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

}  // namespace sparse_attn::cuda
