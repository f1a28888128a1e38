// The LoRA slot table of an adapter snapshot on a device, cached per snapshot (see the comment below).
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/backend_parts.h"
#include "cuda/device_guard.h"

namespace fp4moe::cuda_backend {
namespace {

// ---- the device slot table of an adapter snapshot ------------------------------------------------------
// The registry replaces its snapshot (copy-on-write) on every load/unload and hands the same snapshot to
// every call in between, so the kernels' LoraSlot array is built once per snapshot and device, and cached
// here while the snapshot lives (a weak reference: the cache never keeps adapters alive). A call whose
// snapshot is cached makes no CUDA API call for it, so it can be captured in a CUDA graph. A new snapshot
// is uploaded synchronously on a private non-blocking stream, with this thread's capture mode relaxed for
// the allocation, so that even the first call after a load may be captured. Tables of expired snapshots
// are freed at a later call that is not being captured (cudaFree waits for the device, so no kernel still
// reads them). A graph captured with adapters keeps raw pointers to them: capture again after load/unload.
struct LoraTableEntry {
  int device = 0;
  const void* key = nullptr;
  std::weak_ptr<const std::vector<std::shared_ptr<const PreparedAdapter>>> snap;
  LoraSlot* table = nullptr;
};
std::mutex g_lora_mu;
std::vector<LoraTableEntry> g_lora_tables;
std::vector<cudaStream_t> g_lora_upload_streams;  // per device, created on first use

// Restores this thread's stream-capture mode on scope exit.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

LoraProj make_proj(const uint16_t* A, const uint16_t* B, int64_t r, bool present, bool a_shared, bool b_shared) {
  LoraProj pj;
  if (!present || r <= 0 || !A || !B) return pj;
  pj.A = A;
  pj.B = B;
  pj.r = static_cast<int32_t>(r);
  pj.a_shared = a_shared ? 1 : 0;
  pj.b_shared = b_shared ? 1 : 0;
  return pj;
}

}  // namespace

const LoraSlot* lora_table_for(const AdapterSnapshot& snap, int dev, cudaStream_t stream) {
  std::lock_guard<std::mutex> lk(g_lora_mu);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t qe = cudaStreamIsCapturing(stream, &status);
  if (qe != cudaSuccess) (void)cudaGetLastError();  // not sticky: keep it out of the next launch check
  const bool capturing = qe != cudaSuccess || status != cudaStreamCaptureStatusNone;
  if (!capturing) {
    for (size_t i = 0; i < g_lora_tables.size();) {
      if (!g_lora_tables[i].snap.expired()) { ++i; continue; }
      DeviceGuard g(g_lora_tables[i].device);
      (void)cudaFree(g_lora_tables[i].table);
      g_lora_tables.erase(g_lora_tables.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  for (const LoraTableEntry& e : g_lora_tables)
    if (e.device == dev && e.key == snap.get() && e.snap.lock() == snap) return e.table;

  const size_t n = snap->size();
  std::vector<LoraSlot> host(n);
  for (size_t i = 0; i < n; ++i) {
    const PreparedAdapter* a = (*snap)[i].get();
    if (!a) continue;
    const auto* da = static_cast<const DeviceAdapter*>(a->device.get());
    if (!da || da->device_id != dev)
      throw Error(ErrorCode::InvalidArgument, "adapters",
                  "slot " + std::to_string(i) + " was not prepared for the CUDA backend on device " + std::to_string(dev));
    LoraSlot& s = host[i];
    s.loaded = 1;
    s.proj[kLoraGateUp] = make_proj(da->A1, da->B1, a->r1, a->has_gate_up, a->a1_shared, false);
    s.proj[kLoraDown] = make_proj(da->A2, da->B2, a->r2, a->has_down, false, a->b2_shared);
    s.proj[kLoraSharedGateUp] = make_proj(da->sA1, da->sB1, a->s_r, a->has_shared && a->s_has_gate_up, false, false);
    s.proj[kLoraSharedDown] = make_proj(da->sA2, da->sB2, a->s_r, a->has_shared && a->s_has_down, false, false);
  }
  RelaxedCaptureMode relaxed;
  if (static_cast<size_t>(dev) >= g_lora_upload_streams.size()) g_lora_upload_streams.resize(dev + 1, nullptr);
  if (!g_lora_upload_streams[dev])
    check_cuda(cudaStreamCreateWithFlags(&g_lora_upload_streams[dev], cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags (LoRA table upload)");
  void* p = nullptr;
  const cudaError_t e0 = cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(LoraSlot));
  cudaError_t e1 = e0 == cudaSuccess ? cudaMemcpyAsync(p, host.data(), n * sizeof(LoraSlot), cudaMemcpyHostToDevice,
                                                       g_lora_upload_streams[dev])
                                     : e0;
  if (e1 == cudaSuccess) e1 = cudaStreamSynchronize(g_lora_upload_streams[dev]);
  try {
    check_cuda(e0, "cudaMalloc (LoRA slot table)");
    check_cuda(e1, "cudaMemcpyAsync (LoRA slot table)");
  } catch (...) {
    if (p) (void)cudaFree(p);
    throw;
  }
  LoraTableEntry entry;
  entry.device = dev;
  entry.key = snap.get();
  entry.snap = snap;
  entry.table = static_cast<LoraSlot*>(p);
  g_lora_tables.push_back(std::move(entry));
  return g_lora_tables.back().table;
}

}  // namespace fp4moe::cuda_backend
