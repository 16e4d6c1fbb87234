// Helpers shared by the CUDA glue files: launch checks and what the plans need of a device.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <array>
#include <mutex>

#include "sparse_attn/cuda/flash_fwd.h"
#include "sparse_attn/plan.h"

namespace sparse_attn {

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

// What the plans need to know of CUDA device `device` (queried once per device and process).
inline DeviceInfo cuda_device_info(int device) {
  static std::array<DeviceInfo, 64> cache;
  static std::array<std::once_flag, 64> once;
  TORCH_CHECK(device >= 0 && device < 64, "CUDA device index out of range: ", device);
  std::call_once(once[device], [&] {
    int major = 0, minor = 0, sms = 0, mem_khz = 0, bus_bits = 0;
    check_launch(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                 "cudaDeviceGetAttribute");
    check_launch(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                 "cudaDeviceGetAttribute");
    check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                 "cudaDeviceGetAttribute");
    // Peak DRAM bandwidth (double data rate); a device that does not report it leaves 0.
    if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
      (void)cudaGetLastError();
      mem_khz = bus_bits = 0;
    }
    DeviceInfo& info = cache[device];
    info.cc = major * 10 + minor;
    info.sms = sms;
    info.dram_gbps = 2.0 * mem_khz * 1e3 * (bus_bits / 8) / 1e9;
    info.sm90_kernels = sm90_kernels_built();
    info.tma = tma_encoder_available();
  });
  return cache[device];
}

inline void check_cuda(const at::Tensor& query) {
  TORCH_CHECK(query.is_cuda(), "expected CUDA tensors, got ", query.device());
  const int cc = cuda_device_info(query.get_device()).cc;
  TORCH_CHECK(cc >= 80, "sparse_attn's CUDA kernels need compute capability 8.0 or newer, got ", cc / 10, ".",
              cc % 10);
}

}  // namespace sparse_attn
