// The CUDA backend's error handling, cached device queries and the per-device error flag that kernels raise for
// bad values that live only on the GPU (reported by check_device_errors).
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/backend.h"
#include "cuda/device_guard.h"
#include "cuda/kernels.h"

namespace fp4moe::cuda_backend {

// ---- errors ---------------------------------------------------------------------------------------
namespace {
std::atomic<int64_t> g_fail_in{-1};  // fail_checked_cuda_call's countdown; -1: off
}  // namespace

void fail_checked_cuda_call(int64_t n) { g_fail_in.store(n < 0 ? -1 : n); }
bool checked_cuda_failure_pending() { return g_fail_in.load() >= 0; }

void check_cuda(cudaError_t e, const char* what) {
  // One relaxed load on the hot path; the countdown only runs while a test armed it.
  if (e == cudaSuccess && g_fail_in.load(std::memory_order_relaxed) >= 0 && g_fail_in.fetch_sub(1) == 0)
    e = cudaErrorLaunchOutOfResources;
  if (e == cudaSuccess) return;
  // A failed call also sets the thread's last error: cleared here, or the next launch check (cudaGetLastError)
  // would report this failure again (an allocation failure made the next good call fail).
  (void)cudaGetLastError();
  const std::string msg = std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
  if (e == cudaErrorMemoryAllocation) throw Error(ErrorCode::OutOfMemory, "", msg);
  throw Error(ErrorCode::CudaError, "", msg);
}

void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// ---- device queries (asked on every call / launch: cached per device) -----------------------------------
namespace {
// One positive device attribute, asked of the driver once per device (0 in `known`: not asked yet).
template <class Query> int cached_per_device(std::atomic<int> (&known)[64], int dev, Query query) {
  if (dev >= 0 && dev < 64) {
    const int v = known[dev].load(std::memory_order_relaxed);
    if (v != 0) return v;
  }
  const int v = query();
  if (dev >= 0 && dev < 64) known[dev].store(v, std::memory_order_relaxed);
  return v;
}
}  // namespace

int compute_capability(int dev) {
  static std::atomic<int> known[64] = {};  // major * 10 + minor
  return cached_per_device(known, dev, [dev] {
    int major = 0, minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
    return major * 10 + minor;
  });
}

int sm_count(int dev) {
  static std::atomic<int> known[64] = {};
  return cached_per_device(known, dev, [dev] {
    int sms = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute(SMs)");
    return sms;
  });
}

DeviceDesc device_desc(int dev) {
  static std::atomic<int> l2[64] = {};
  DeviceDesc d;
  d.sm_count = sm_count(dev);
  d.l2_bytes = cached_per_device(l2, dev, [dev] {
    int bytes = 0;
    check_cuda(cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, dev), "cudaDeviceGetAttribute(L2 size)");
    return bytes;
  });
  d.wgmma = wgmma_supported_on(dev);
  return d;
}

// The build carries SASS only, never JIT-ed PTX: FP4MOE_WITH_SM90A is set when FP4MOE_CUDA_ARCHS lists 90a.
bool wgmma_supported_on(int dev) {
#if defined(FP4MOE_WITH_SM90A)
  return compute_capability(dev) == 90;
#else
  (void)dev;
  return false;
#endif
}

namespace {
std::mutex g_flag_mu;
std::vector<int*> g_flags;
}  // namespace

int* device_error_flag(int device_id) {
  std::lock_guard<std::mutex> lk(g_flag_mu);
  if (device_id < 0) throw Error(ErrorCode::InvalidArgument, "device_id", "negative device id");
  if (static_cast<size_t>(device_id) >= g_flags.size()) g_flags.resize(device_id + 1, nullptr);
  if (!g_flags[device_id]) {
    DeviceGuard guard(device_id);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, 16);
    if (e == cudaSuccess) e = cudaMemset(p, 0, 16);
    try {
      check_cuda(e, "cudaMalloc/cudaMemset (device error flag)");
    } catch (...) {
      if (p) (void)cudaFree(p);
      throw;
    }
    g_flags[device_id] = static_cast<int*>(p);
  }
  return g_flags[device_id];
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

void check_device_errors(int device_id) {
  int* flag = device_error_flag(device_id);
  DeviceGuard guard(device_id);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (check_device_errors)");
  int v = 0;
  check_cuda(cudaMemcpy(&v, flag, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy (device error flag)");
  if (v == 0) return;
  check_cuda(cudaMemset(flag, 0, sizeof(int)), "cudaMemset (device error flag)");
  if (v == kErrTopkIds)
    throw Error(ErrorCode::DeviceFault, "routing.topk_ids",
                "a precomputed expert id on the GPU was outside [0, num_experts_total); its (token, slot) was dropped");
  if (v == kErrAdapterIds)
    throw Error(ErrorCode::DeviceFault, "adapter_ids",
                "an adapter id on the GPU was not -1 nor a loaded slot of the registry; that token ran without LoRA");
  if (v == kErrParallelPeer)
    throw Error(ErrorCode::DeviceFault, "comm",
                "another rank of a parallel call (moe_run_tp / moe_run_ep) failed; this rank's y was left untouched");
  if (v == kErrRoutingBias)
    throw Error(ErrorCode::DeviceFault, "routing.bias",
                "the routing bias on the GPU held a value that is not finite; the experts chosen (and so every "
                "token's output) were unspecified, though in range");
  if (v == kErrSharedGate)
    throw Error(ErrorCode::DeviceFault, "shared_expert_gate",
                "the shared expert's gate on the GPU held a value that is not finite; the shared expert's term was "
                "dropped from every token's output");
  if (v == kErrActAlpha || v == kErrActBeta || v == kErrActClampLimit) {
    const char* name = v == kErrActAlpha ? "activation.alpha" : v == kErrActBeta ? "activation.beta" : "activation.clamp_limit";
    throw Error(ErrorCode::DeviceFault, name,
                std::string("a per-expert value on the GPU was out of range (") +
                    (v == kErrActClampLimit ? "expected > 0 or +inf" : "expected finite, and > 0 for Situ") +
                    "); every (token, slot) routed to that expert was dropped from the output");
  }
  throw Error(ErrorCode::DeviceFault, "", "internal: the permutation produced more tiles than planned (code " +
                                              std::to_string(v) + ")");
}

}  // namespace fp4moe::cuda_backend
