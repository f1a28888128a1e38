// The NCCL communicator of include/fp4moe/parallel.h. Built only when CMake found nccl.h
// (FP4MOE_WITH_NCCL); libnccl is opened at run time (dlopen), so binaries built with this file still
// start on machines without NCCL: make_nccl_communicator then throws Unsupported.
//
// Determinism (SPEC §4): every sum is taken in rank order by our own kernel after an NCCL data movement
// (all-gather or grouped send/recv), never by ncclAllReduce / ncclReduceScatter, whose reduction order
// depends on the algorithm and protocol NCCL picks.
#if defined(FP4MOE_WITH_NCCL)
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>
#include <type_traits>
#include <string>

#include "cuda/device_guard.h"
#include "fp4moe/parallel.h"

namespace fp4moe {
namespace {

// The NCCL entry points we use, resolved once from libnccl.so.2.
struct NcclApi {
  bool ok = false;
  std::string why;
  std::string path;  // what was opened
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommCuDevice)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  ncclResult_t (*CommCount)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*CommUserRank)(const ncclComm_t, int*) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
};

const NcclApi& nccl_api() {
  static NcclApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    // FP4MOE_NCCL_LIBRARY first (a file, or a folder with libnccl.so.2: PyTorch's nvidia-nccl pip package
    // keeps it in site-packages/nvidia/nccl/lib, which is not on the loader's path), then the search path.
    std::vector<std::string> tried;
    void* h = nullptr;
    std::string errors;
    auto attempt = [&](const std::string& name) {
      if (h || name.empty()) return;
      h = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
      if (h) {
        api.path = name;
        return;
      }
      const char* e = dlerror();
      errors += "\n  " + name + ": " + (e ? e : "unknown error");
    };
    if (const char* env = std::getenv("FP4MOE_NCCL_LIBRARY"); env && *env) {
      std::string p = env;
      struct stat st {};
      if (stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
        attempt(p + "/libnccl.so.2");
        attempt(p + "/libnccl.so");
      } else {
        attempt(p);
      }
    }
    attempt("libnccl.so.2");
    attempt("libnccl.so");
    if (!h) {
      api.why = "libnccl.so.2 could not be loaded (set FP4MOE_NCCL_LIBRARY to the file or to its folder, e.g. "
                "site-packages/nvidia/nccl/lib of the nvidia-nccl pip package):" + errors;
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn && api.why.empty()) api.why = std::string("libnccl lacks ") + name;
    };
    sym(api.AllGather, "ncclAllGather");
    sym(api.Send, "ncclSend");
    sym(api.Recv, "ncclRecv");
    sym(api.GroupStart, "ncclGroupStart");
    sym(api.GroupEnd, "ncclGroupEnd");
    sym(api.CommCount, "ncclCommCount");
    sym(api.CommUserRank, "ncclCommUserRank");
    sym(api.GetErrorString, "ncclGetErrorString");
    sym(api.GetUniqueId, "ncclGetUniqueId");
    sym(api.CommInitRank, "ncclCommInitRank");
    sym(api.CommDestroy, "ncclCommDestroy");
    sym(api.CommCuDevice, "ncclCommCuDevice");
    sym(api.GetVersion, "ncclGetVersion");
    api.ok = api.why.empty();
  });
  return api;
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw Error(ErrorCode::CudaError, "nccl_comm", std::string(what) + " failed: " + nccl_api().GetErrorString(r));
}
using cuda_backend::check_cuda;
using cuda_backend::DeviceGuard;  // collectives make the communicator's device current (NCCL enqueues on it), best effort

// out[i] = ((in[0][i] + in[1][i]) + in[2][i]) + ...: rank order, one thread per element, no atomics.
__global__ void rank_order_sum(const float* __restrict__ in, int world, long long count, float* __restrict__ out) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    float acc = in[i];
    for (int p = 1; p < world; ++p) acc = __fadd_rn(acc, in[p * count + i]);
    out[i] = acc;
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream) : comm_(comm), stream_(stream) {
    nccl_check(nccl_api().CommCount(comm_, &world_), "ncclCommCount");
    nccl_check(nccl_api().CommUserRank(comm_, &rank_), "ncclCommUserRank");
    nccl_check(nccl_api().CommCuDevice(comm_, &device_), "ncclCommCuDevice");
  }
  ~NcclCommunicator() override {
    if (scratch_) cudaFree(scratch_);
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Backend device() const override { return Backend::CUDA; }
  void* stream() const override { return stream_; }
  void set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }
  int cuda_device() const override { return device_; }

  void allreduce_sum_f32(float* data, int64_t count) override {
    DeviceGuard dev_scope(device_, DeviceGuard::NoThrow{});
    check_count(count, data);
    if (count == 0) return;
    float* all = scratch(static_cast<size_t>(world_) * count);
    nccl_check(nccl_api().AllGather(data, all, static_cast<size_t>(count), ncclFloat32, comm_, stream_), "ncclAllGather");
    launch_sum(all, count, data);
  }
  void allgather(const void* in, void* out, int64_t bytes) override {
    DeviceGuard dev_scope(device_, DeviceGuard::NoThrow{});
    if (bytes < 0) throw Error(ErrorCode::InvalidArgument, "bytes", "expected >= 0");
    if (bytes == 0) return;
    nccl_check(nccl_api().AllGather(in, out, static_cast<size_t>(bytes), ncclUint8, comm_, stream_), "ncclAllGather");
  }
  void reduce_scatter_sum_f32(const float* in, float* out, int64_t count) override {
    DeviceGuard dev_scope(device_, DeviceGuard::NoThrow{});
    check_count(count, out);
    if (count == 0) return;
    // Chunk `rank_` of every rank's `in`, gathered in rank order, then summed in rank order.
    float* mine = scratch(static_cast<size_t>(world_) * count);
    const NcclApi& n = nccl_api();
    nccl_check(n.GroupStart(), "ncclGroupStart");
    for (int q = 0; q < world_; ++q) {
      nccl_check(n.Send(in + static_cast<int64_t>(q) * count, static_cast<size_t>(count), ncclFloat32, q, comm_, stream_),
                 "ncclSend");
      nccl_check(n.Recv(mine + static_cast<int64_t>(q) * count, static_cast<size_t>(count), ncclFloat32, q, comm_, stream_),
                 "ncclRecv");
    }
    nccl_check(n.GroupEnd(), "ncclGroupEnd");
    launch_sum(mine, count, out);
  }
  void alltoall(const void* in, void* out, int64_t bytes_per_rank) override {
    DeviceGuard dev_scope(device_, DeviceGuard::NoThrow{});
    if (bytes_per_rank < 0) throw Error(ErrorCode::InvalidArgument, "bytes_per_rank", "expected >= 0");
    if (bytes_per_rank == 0) return;
    const NcclApi& n = nccl_api();
    const size_t b = static_cast<size_t>(bytes_per_rank);
    nccl_check(n.GroupStart(), "ncclGroupStart");
    for (int q = 0; q < world_; ++q) {
      nccl_check(n.Send(static_cast<const uint8_t*>(in) + q * b, b, ncclUint8, q, comm_, stream_), "ncclSend");
      nccl_check(n.Recv(static_cast<uint8_t*>(out) + q * b, b, ncclUint8, q, comm_, stream_), "ncclRecv");
    }
    nccl_check(n.GroupEnd(), "ncclGroupEnd");
  }
  void barrier() override {
    DeviceGuard dev_scope(device_, DeviceGuard::NoThrow{});
    float* s = scratch(static_cast<size_t>(world_) + 1);
    nccl_check(nccl_api().AllGather(s + world_, s, 1, ncclFloat32, comm_, stream_), "ncclAllGather");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  static void check_count(int64_t count, const void* p) {
    if (count < 0) throw Error(ErrorCode::InvalidArgument, "count", "expected >= 0");
    if (count > 0 && !p) throw Error(ErrorCode::InvalidArgument, "data", "is null");
  }
  // Scratch of at least n floats, grown on demand (stream-ordered: freeing waits for pending work).
  float* scratch(size_t n) {
    if (n > scratch_n_) {
      if (scratch_) {
        check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
        check_cuda(cudaFree(scratch_), "cudaFree");
        scratch_ = nullptr;
        scratch_n_ = 0;
      }
      check_cuda(cudaMalloc(&scratch_, n * sizeof(float)), "cudaMalloc (communicator scratch)");
      scratch_n_ = n;
    }
    return scratch_;
  }
  void launch_sum(const float* all, int64_t count, float* out) {
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads, 65535);
    rank_order_sum<<<static_cast<unsigned>(blocks), threads, 0, stream_>>>(all, world_, count, out);
    check_cuda(cudaGetLastError(), "rank_order_sum launch");
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0, world_ = 1, device_ = -1;
  float* scratch_ = nullptr;
  size_t scratch_n_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(void* nccl_comm, void* stream) {
  const NcclApi& api = nccl_api();
  if (!api.ok) throw Error(ErrorCode::Unsupported, "nccl_comm", api.why);
  if (!nccl_comm) throw Error(ErrorCode::InvalidArgument, "nccl_comm", "is null (pass the caller's ncclComm_t)");
  return std::make_unique<NcclCommunicator>(static_cast<ncclComm_t>(nccl_comm), static_cast<cudaStream_t>(stream));
}

bool nccl_available() { return nccl_api().ok; }
std::string nccl_unavailable_reason() { return nccl_api().ok ? std::string() : nccl_api().why; }

std::vector<uint8_t> nccl_unique_id() {
  static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "ncclUniqueId size");
  const NcclApi& api = nccl_api();
  if (!api.ok) throw Error(ErrorCode::Unsupported, "nccl", api.why);
  ncclUniqueId id;
  nccl_check(api.GetUniqueId(&id), "ncclGetUniqueId");
  std::vector<uint8_t> out(kNcclUniqueIdBytes);
  std::memcpy(out.data(), &id, kNcclUniqueIdBytes);
  return out;
}

Communicator& NcclGroupComm::comm() {
  if (!comm_) throw Error(ErrorCode::InvalidArgument, "comm", "the NCCL communicator was destroyed");
  return *comm_;
}

NcclGroupComm::NcclGroupComm(const std::vector<uint8_t>& unique_id, int world, int rank, int device, void* stream)
    : device_(device), rank_(rank), world_(world) {
  const NcclApi& api = nccl_api();
  if (!api.ok) throw Error(ErrorCode::Unsupported, "nccl", api.why);
  if (unique_id.size() != kNcclUniqueIdBytes)
    throw Error(ErrorCode::InvalidArgument, "unique_id",
                "expected " + std::to_string(kNcclUniqueIdBytes) + " bytes (an ncclUniqueId), got " +
                    std::to_string(unique_id.size()));
  if (world < 1) throw Error(ErrorCode::InvalidArgument, "world", "expected >= 1, got " + std::to_string(world));
  if (rank < 0 || rank >= world)
    throw Error(ErrorCode::InvalidArgument, "rank",
                "expected in [0, world=" + std::to_string(world) + "), got " + std::to_string(rank));
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (device < 0 || device >= count)
    throw Error(ErrorCode::InvalidArgument, "device",
                "expected a CUDA device in [0, " + std::to_string(count) + "), got " + std::to_string(device));
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), kNcclUniqueIdBytes);
  ncclComm_t c = nullptr;
  ncclResult_t r;
  {
    DeviceGuard guard(device);
    r = api.CommInitRank(&c, world, id, rank);
  }
  nccl_check(r, "ncclCommInitRank");
  nccl_comm_ = c;
  try {
    comm_ = std::make_unique<NcclCommunicator>(c, static_cast<cudaStream_t>(stream));
  } catch (...) {
    (void)api.CommDestroy(c);
    nccl_comm_ = nullptr;
    throw;
  }
}

void NcclGroupComm::destroy() {
  if (!nccl_comm_) return;
  comm_.reset();  // frees the communicator's scratch first
  {
    DeviceGuard guard(device_, DeviceGuard::NoThrow{});
    (void)nccl_api().CommDestroy(static_cast<ncclComm_t>(nccl_comm_));
  }
  nccl_comm_ = nullptr;
}

NcclGroupComm::~NcclGroupComm() { destroy(); }

}  // namespace fp4moe
#endif  // FP4MOE_WITH_NCCL
