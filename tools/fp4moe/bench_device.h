// The device side of one bench run: checked CUDA and cuBLAS calls, CUDA events, the stream and the L2 flush.
#pragma once
#include <cuda_runtime.h>
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
#include <cublas_v2.h>
#endif

#include <string>
#include <vector>

#include "../common/device_buffer.h"
#include "fp4moe/types.h"

namespace fp4moe::bench {

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(ErrorCode::CudaError, "", std::string(what) + ": " + cudaGetErrorString(e));
}
#define CK(call) ck((call), #call)

#ifdef FP4MOE_BENCH_HAVE_CUBLAS
inline void cb(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw Error(ErrorCode::CudaError, "", std::string(what) + ": cuBLAS status " + std::to_string(int(s)));
}
#define CB(call) cb((call), #call)
#endif

// Event pairs, reused across cases.
class EventPool {
 public:
  ~EventPool() {
    for (auto e : ev_) (void)cudaEventDestroy(e);
  }
  cudaEvent_t at(size_t i) {
    while (ev_.size() <= i) {
      cudaEvent_t e;
      CK(cudaEventCreate(&e));
      ev_.push_back(e);
    }
    return ev_[i];
  }

 private:
  std::vector<cudaEvent_t> ev_;
};

inline float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

// The device-side helpers of one run: stream, events, L2 flush, cuBLAS.
struct Device {
  int id = 0;
  cudaStream_t stream = nullptr;
  EventPool events;
  DeviceBuffer flush_buf;
  std::string flush_method;
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
  cublasHandle_t blas = nullptr;
  DeviceBuffer flush_result;
#endif
  explicit Device(int dev) : id(dev) {
    CK(cudaSetDevice(dev));
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    flush_buf = DeviceBuffer(size_t(256) << 20);
    CK(cudaMemset(flush_buf.get(), 0x3c, flush_buf.bytes()));  // 0x3c3c3c3c: a finite float
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
    CB(cublasCreate(&blas));
    CB(cublasSetStream(blas, stream));
    flush_result = DeviceBuffer(256);
    flush_method = "read of 256 MB (cublasSasum) before each timed replay, not timed";
#else
    flush_method = "cudaMemsetAsync of 256 MB before each timed replay, not timed (no cuBLAS in this build)";
#endif
  }
  ~Device() {
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
    if (blas) (void)cublasDestroy(blas);
#endif
    if (stream) (void)cudaStreamDestroy(stream);
  }
  void flush_l2() {
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
    CB(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_DEVICE));
    CB(cublasSasum(blas, static_cast<int>(flush_buf.bytes() / 4), flush_buf.as<float>(), 1, flush_result.as<float>()));
#else
    CK(cudaMemsetAsync(flush_buf.get(), 0x3c, flush_buf.bytes(), stream));
#endif
  }
};

}  // namespace fp4moe::bench
