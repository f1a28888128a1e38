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

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <string>

#include "fp4moe/parallel.h"

namespace fp4moe {
namespace {

// The NCCL entry points we use, resolved once from libnccl.so.2.
struct NcclApi {
  bool ok = false;
  std::string why;
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
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
      const char* e = dlerror();
      api.why = std::string("libnccl.so.2 could not be loaded: ") + (e ? e : "unknown error");
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
    api.ok = api.why.empty();
  });
  return api;
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw Error(ErrorCode::CudaError, "nccl_comm", std::string(what) + " failed: " + nccl_api().GetErrorString(r));
}
void cuda_check(cudaError_t r, const char* what) {
  if (r == cudaErrorMemoryAllocation) throw Error(ErrorCode::OutOfMemory, "", std::string(what) + ": out of memory");
  if (r != cudaSuccess) throw Error(ErrorCode::CudaError, "", std::string(what) + ": " + cudaGetErrorString(r));
}

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
  }
  ~NcclCommunicator() override {
    if (scratch_) cudaFree(scratch_);
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Backend device() const override { return Backend::CUDA; }

  void allreduce_sum_f32(float* data, int64_t count) override {
    check_count(count, data);
    if (count == 0) return;
    float* all = scratch(static_cast<size_t>(world_) * count);
    nccl_check(nccl_api().AllGather(data, all, static_cast<size_t>(count), ncclFloat32, comm_, stream_), "ncclAllGather");
    launch_sum(all, count, data);
  }
  void allgather(const void* in, void* out, int64_t bytes) override {
    if (bytes < 0) throw Error(ErrorCode::InvalidArgument, "bytes", "expected >= 0");
    if (bytes == 0) return;
    nccl_check(nccl_api().AllGather(in, out, static_cast<size_t>(bytes), ncclUint8, comm_, stream_), "ncclAllGather");
  }
  void reduce_scatter_sum_f32(const float* in, float* out, int64_t count) override {
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
  void barrier() override {
    float* s = scratch(static_cast<size_t>(world_) + 1);
    nccl_check(nccl_api().AllGather(s + world_, s, 1, ncclFloat32, comm_, stream_), "ncclAllGather");
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
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
        cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
        cuda_check(cudaFree(scratch_), "cudaFree");
        scratch_ = nullptr;
        scratch_n_ = 0;
      }
      cuda_check(cudaMalloc(&scratch_, n * sizeof(float)), "cudaMalloc (communicator scratch)");
      scratch_n_ = n;
    }
    return scratch_;
  }
  void launch_sum(const float* all, int64_t count, float* out) {
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads, 65535);
    rank_order_sum<<<static_cast<unsigned>(blocks), threads, 0, stream_>>>(all, world_, count, out);
    cuda_check(cudaGetLastError(), "rank_order_sum launch");
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0, world_ = 1;
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

}  // namespace fp4moe
#endif  // FP4MOE_WITH_NCCL
