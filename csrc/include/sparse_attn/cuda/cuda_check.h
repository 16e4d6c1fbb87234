// Error handling for the torch-free CUDA layer: launchers return cudaError_t, never throw.
#pragma once

#include <cuda_runtime.h>

#define SA_CUDA_TRY(expr)                        \
  do {                                           \
    cudaError_t sa_err_ = (expr);                \
    if (sa_err_ != cudaSuccess) return sa_err_;  \
  } while (0)
