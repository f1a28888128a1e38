// Device helpers of the CUDA path of moe_run_tp / moe_run_ep (src/runtime/parallel.cpp), implemented in
// src/cuda/parallel_reduce.cu (CUDA builds only). Everything is enqueued on `stream` of `device`; nothing
// synchronises the host.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fp4moe::parallel_device {

// cudaMallocAsync / cudaFreeAsync on the stream (the stream-ordered pool). alloc throws OutOfMemory.
void* alloc_async(size_t bytes, int device, void* stream);
void free_async(void* p, int device, void* stream) noexcept;

// flag[0..63] <- 0 (ok) or a nonzero float (this rank failed), cudaMemsetAsync.
void set_flag_async(float* flag, bool failed, int device, void* stream);

// y[t, h] <- round(sum over p = 0..world-1, in order, of src[p * rank_stride + t * H + h]) for t < rows,
// written with y's strides (elements) as bf16 (one rounding) or f32; when any flags[p * flag_stride] != 0,
// y is not written and the device error flag gets kErrParallelPeer.
struct ReduceToY {
  const float* src = nullptr;
  int world = 1;
  int64_t rank_stride = 0;
  const float* flags = nullptr;
  int64_t flag_stride = 0;
  int64_t rows = 0, H = 0;
  void* y = nullptr;
  bool y_bf16 = true;
  int64_t y_stride0 = 0, y_stride1 = 1;
};
void reduce_to_y(const ReduceToY& p, int device, void* stream);

}  // namespace fp4moe::parallel_device
