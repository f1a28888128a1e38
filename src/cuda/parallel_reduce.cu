// The device side of moe_run_tp / moe_run_ep (src/runtime/parallel_device.h): the scratch allocation on the
// stream, the failure flag, and the rank-order sum of the gathered fp32 partials with one rounding into y.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cuda/device_guard.h"
#include "cuda/kernels.h"
#include "cuda/nvfp4_device.cuh"
#include "runtime/parallel_device.h"

namespace fp4moe::parallel_device {
namespace {

using cuda_backend::DeviceGuard;

// Grid-stride over rows * H elements; every thread first reads the world flags (a few cached loads). The sum
// is ((p0 + p1) + p2) + ...: rank order, fp32, no FMA, no atomics; every rank computes the same bits.
__global__ void reduce_to_y_kernel(ReduceToY p, int* error_flag) {
  for (int q = 0; q < p.world; ++q)
    if (p.flags[q * p.flag_stride] != 0.f) {
      if (blockIdx.x == 0 && threadIdx.x == 0) *error_flag = cuda_backend::kErrParallelPeer;
      return;
    }
  const int64_t n = p.rows * p.H;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = p.src[i];
    for (int q = 1; q < p.world; ++q) acc = __fadd_rn(acc, p.src[q * p.rank_stride + i]);
    const int64_t t = i / p.H, h = i - t * p.H;
    const int64_t off = t * p.y_stride0 + h * p.y_stride1;
    if (p.y_bf16) static_cast<uint16_t*>(p.y)[off] = cuda_backend::dev::f32_to_bf16(acc);
    else static_cast<float*>(p.y)[off] = acc;
  }
}

}  // namespace

void* alloc_async(size_t bytes, int device, void* stream) {
  DeviceGuard scope(device);
  void* p = nullptr;
  cuda_backend::check_cuda(cudaMallocAsync(&p, std::max<size_t>(bytes, 256), static_cast<cudaStream_t>(stream)),
                           "cudaMallocAsync (parallel scratch)");
  return p;
}

void free_async(void* p, int device, void* stream) noexcept {
  if (!p) return;
  DeviceGuard scope(device, DeviceGuard::NoThrow{});
  (void)cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
}

void set_flag_async(float* flag, bool failed, int device, void* stream) {
  DeviceGuard scope(device);
  cuda_backend::check_cuda(cudaMemsetAsync(flag, failed ? 0x3f : 0, 64 * sizeof(float), static_cast<cudaStream_t>(stream)),
                           "cudaMemsetAsync (parallel failure flag)");
}

void reduce_to_y(const ReduceToY& p, int device, void* stream) {
  int* err = cuda_backend::device_error_flag(device);
  DeviceGuard scope(device);
  const int64_t n = p.rows * p.H;
  const int threads = 256;
  // At least one block, so that a peer's failure is flagged even for an empty output.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 132 * 16));
  reduce_to_y_kernel<<<static_cast<unsigned>(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(p, err);
  cuda_backend::check_launch("reduce_to_y_kernel (parallel combine)");
}

}  // namespace fp4moe::parallel_device
