// DeviceBuffer: memory that a tool or a test owns for the tensors of its calls, on a CUDA device or, for a run
// on the CPU backend, on the host. Every CUDA call is checked; a failure throws fp4moe::Error naming the call.
// Header-only, for the fp4moe CLI, fp4moe_soak, fp4moe_parallel_check and the GPU tests alike.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "fp4moe/types.h"
#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fp4moe {

#ifdef FP4MOE_WITH_CUDA
// An allocation failure is OutOfMemory so that a caller can retry smaller; the error is cleared either way.
inline void check_buffer_call(cudaError_t e, const char* call, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error(e == cudaErrorMemoryAllocation ? ErrorCode::OutOfMemory : ErrorCode::CudaError, "",
              std::string(call) + " (" + what + "): " + cudaGetErrorString(e));
}
#endif

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Never a null pointer, even for 0 bytes: a present, empty tensor must stay "present".
  explicit DeviceBuffer(size_t bytes, Backend where = Backend::CUDA) : where_(where), bytes_(bytes) {
    const size_t n = std::max<size_t>(bytes, 256);
    if (where == Backend::CPU) {
      p_ = ::operator new(n, std::align_val_t(256));
      return;
    }
#ifdef FP4MOE_WITH_CUDA
    const cudaError_t e = cudaMalloc(&p_, n);
    if (e != cudaSuccess) {
      p_ = nullptr;
      check_buffer_call(e, "cudaMalloc", (std::to_string(bytes) + " bytes").c_str());
    }
#else
    throw Error(ErrorCode::Unsupported, "", "this build has no CUDA backend");
#endif
  }
  static DeviceBuffer from(const void* host, size_t bytes, Backend where = Backend::CUDA) {
    DeviceBuffer b(bytes, where);
    b.upload(host, bytes);
    return b;
  }
  template <class T> static DeviceBuffer from(const std::vector<T>& v, Backend where = Backend::CUDA) {
    return from(v.data(), v.size() * sizeof(T), where);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : where_(o.where_), p_(o.p_), bytes_(o.bytes_) {
    o.p_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(where_, o.where_);
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (!p_) return;
    if (where_ == Backend::CPU) {
      ::operator delete(p_, std::align_val_t(256));
      return;
    }
#ifdef FP4MOE_WITH_CUDA
    (void)cudaFree(p_);
#endif
  }

  Backend where() const { return where_; }
  void* get() const { return p_; }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }
  TensorView view(DType t, std::initializer_list<int64_t> shape, int device_id = 0) const {
    return make_view(p_, t, shape, where_, device_id);
  }

  // Copies n bytes from the host, complete when this returns (the source may be a temporary); on `stream` when given.
  void upload(const void* src, size_t n, void* stream = nullptr) { copy(p_, src, n, true, stream); }
  // Sets the first n bytes to `byte`: at once, or queued on `stream` when given.
  void fill(int byte, size_t n, void* stream = nullptr) {
    if (n == 0) return;
    fits(n, "fill");
    if (where_ == Backend::CPU) {
      std::memset(p_, byte, n);
      return;
    }
#ifdef FP4MOE_WITH_CUDA
    const auto s = static_cast<cudaStream_t>(stream);
    if (!s) check_buffer_call(cudaMemset(p_, byte, n), "cudaMemset", "fill");
    else check_buffer_call(cudaMemsetAsync(p_, byte, n, s), "cudaMemsetAsync", "fill");
#else
    (void)stream;
#endif
  }
  void fill_byte(int byte) { fill(byte, bytes_); }

  // Copies the first n bytes to the host once the work queued so far (on `stream` when given) is done.
  void download_to(void* dst, size_t n, void* stream = nullptr) const { copy(dst, p_, n, false, stream); }
  // The first n elements (all of them by default) as a host vector.
  template <class T> std::vector<T> download(size_t n = static_cast<size_t>(-1), void* stream = nullptr) const {
    if (n == static_cast<size_t>(-1)) n = bytes_ / sizeof(T);
    std::vector<T> v(n);
    download_to(v.data(), n * sizeof(T), stream);
    return v;
  }

 private:
  void copy(void* dst, const void* src, size_t n, bool to_device, void* stream) const {
    if (n == 0) return;
    const char* what = to_device ? "upload" : "download";
    fits(n, what);
    if (where_ == Backend::CPU) {
      std::memcpy(dst, src, n);
      return;
    }
#ifdef FP4MOE_WITH_CUDA
    const cudaMemcpyKind kind = to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    const auto s = static_cast<cudaStream_t>(stream);
    if (!s) {
      check_buffer_call(cudaMemcpy(dst, src, n, kind), "cudaMemcpy", what);
      return;
    }
    check_buffer_call(cudaMemcpyAsync(dst, src, n, kind, s), "cudaMemcpyAsync", what);
    check_buffer_call(cudaStreamSynchronize(s), "cudaStreamSynchronize", what);
#else
    (void)stream;
#endif
  }
  void fits(size_t n, const char* what) const {
    if (n > bytes_)
      throw Error(ErrorCode::InvalidArgument, "", std::string("DeviceBuffer ") + what + ": " + std::to_string(n) +
                                                      " bytes, the buffer holds " + std::to_string(bytes_));
  }

  Backend where_ = Backend::CUDA;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace fp4moe
