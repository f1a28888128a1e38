// Makes a device current for a scope and restores the previous one at its end (the backend's calls, the parallel
// reduce, the NCCL communicator and the destructors that free device memory all switch this way).
#pragma once
#include <cuda_runtime.h>

#include "cuda/kernels.h"

namespace fp4moe::cuda_backend {

class DeviceGuard {
 public:
  // Checked: throws (CudaError) when the device cannot be queried or made current.
  explicit DeviceGuard(int dev) {
    check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != dev) check_cuda(cudaSetDevice(dev), "cudaSetDevice");
  }
  // Unchecked, for destructors and best-effort paths: when the current device cannot be queried, or dev < 0,
  // nothing is switched (and nothing restored).
  struct NoThrow {};
  DeviceGuard(int dev, NoThrow) noexcept {
    if (dev < 0 || cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    else if (prev_ != dev) (void)cudaSetDevice(dev);
  }
  ~DeviceGuard() {
    int cur = -1;
    if (prev_ >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

}  // namespace fp4moe::cuda_backend
