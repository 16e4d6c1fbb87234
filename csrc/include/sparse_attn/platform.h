// Host/device qualifiers shared by code that runs on both the CPU and the GPU.
#pragma once

#if defined(__CUDACC__)
#define SA_HD __host__ __device__ __forceinline__
#else
#define SA_HD inline
#endif
