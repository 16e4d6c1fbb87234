"""fp32 reduction throughput into random 512-byte rows: the top-k backward's dK / dV pattern.

Three instruction shapes add 16-key x 128-column blocks of 1.0 into random rows of two fp32
accumulators (as dK and dV): float2 atomics as mma fragments lie (32 bytes of 16 rows per warp
instruction), `red.global.add.v4.f32` after a lane-pair exchange (the same lines), and `v4` of one
512-byte row per instruction (whole lines). Prints TB/s of fp32 added, with the accumulators past
L2 (64 MiB) and inside it (16 MiB). Needs a CUDA GPU of compute capability 9.0 and nvcc (the
kernels are compiled at run time); docs/PERF_LOG.md has the H100's figures.

    python tools/bench_reductions.py
"""

import sys

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__device__ __forceinline__ unsigned mix(unsigned x) {
  x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
  return x;
}
__device__ __forceinline__ void red4(float* d, float a) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(d), "f"(a) : "memory");
}

// Each warp adds blocks of 16 random rows x 128 columns (as dK and as dV).
template <int kMode>
__global__ void add_rows(float* dk, float* dv, int nrows, long long blocks) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const long long warps = (long long)gridDim.x * blockDim.x / 32;
  for (long long blk = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32; blk < blocks; blk += warps) {
    const int key0 = mix(unsigned(blk * 16 + g)) % nrows, key1 = mix(unsigned(blk * 16 + g + 8)) % nrows;
    if (kMode == 0) {  // float2 pairs: rows g and g + 8, 8 bytes per thread and column tile
      for (int col8 = 0; col8 < 128; col8 += 8)
        for (int half = 0; half < 2; ++half) {
          const long long at = (long long)(half ? key1 : key0) * 128 + col8 + 2 * t;
          atomicAdd(reinterpret_cast<float2*>(dk + at), make_float2(1.f, 1.f));
          atomicAdd(reinterpret_cast<float2*>(dv + at), make_float2(1.f, 1.f));
        }
    } else if (kMode == 1) {  // v4 after a lane-pair exchange: even t row g, odd t row g + 8
      const long long row = (long long)((t & 1) ? key1 : key0) * 128 + 2 * (t & 2);
      for (int col8 = 0; col8 < 128; col8 += 8) {
        red4(dk + row + col8, 1.f);
        red4(dv + row + col8, 1.f);
      }
    } else {  // v4, one 512-byte row per warp instruction
      for (int r = 0; r < 16; ++r) {
        const long long row = (long long)(mix(unsigned(blk * 16 + r)) % nrows) * 128 + lane * 4;
        red4(dk + row, 1.f);
        red4(dv + row, 1.f);
      }
    }
  }
}

double run(int mode, torch::Tensor dk, torch::Tensor dv, long long rows) {
  const long long blocks = rows / 16;
  const int nrows = dk.size(0);
  auto launch = [&] {
    auto kernel = mode == 0 ? add_rows<0> : mode == 1 ? add_rows<1> : add_rows<2>;
    kernel<<<132 * 16, 128>>>(dk.data_ptr<float>(), dv.data_ptr<float>(), nrows, blocks);
  };
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  launch();
  cudaEventRecord(e0);
  for (int i = 0; i < 3; ++i) launch();
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  return ms / 3;
}
"""

SHAPES = ((0, "float2 pairs, rows g and g + 8"), (1, "v4 after a lane-pair exchange"), (2, "v4, a 512-byte row each"))


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("tools/bench_reductions.py needs a CUDA GPU of compute capability 9.0 or newer", file=sys.stderr)
        return 1
    ext = load_inline(
        "sparse_attn_bench_reductions",
        cpp_sources="double run(int mode, torch::Tensor dk, torch::Tensor dv, long long rows);",
        cuda_sources=SOURCE,
        functions=["run"],
        extra_cuda_cflags=["-O3", "-arch=sm_90a"],
    )
    rows = 1 << 24  # (query, key) pairs, 1 KiB of fp32 each (dK and dV rows)
    print(torch.cuda.get_device_name())
    for nrows in (65536, 16384):
        dk = torch.zeros(nrows, 128, device="cuda")
        dv = torch.zeros_like(dk)
        for mode, name in SHAPES:
            ms = ext.run(mode, dk, dv, rows)
            tbs = rows * 1024 / ms / 1e9
            print(f"accumulators {nrows * 1024 >> 20} MiB, {name}: {ms:.2f} ms, {tbs:.2f} TB/s added")
    return 0


if __name__ == "__main__":
    sys.exit(main())
