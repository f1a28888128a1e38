// FP4MOE_HD: a function compiled for the host and, under nvcc, for the device too (shared CPU/GPU arithmetic).
#pragma once

#if defined(__CUDACC__)
#define FP4MOE_HD __host__ __device__ __forceinline__
#else
#define FP4MOE_HD inline
#endif
