// Tensor / expert parallelism on the host, the running half: the in-process communicator and the parallel
// run calls (include/fp4moe/parallel.h). The sharding helpers and the expert window are in parallel_shard.cpp;
// the NCCL communicator lives in src/cuda/parallel_nccl.cu (built only when NCCL is found).
#include "fp4moe/parallel.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

#include "runtime/parallel_device.h"
#include "runtime/prepared.h"
#include "runtime/host_tensor.h"

namespace fp4moe {
using detail::invalid;

// ---- the in-process communicator -------------------------------------------------------------------------
struct InProcessGroup::State {
  int world = 1;
  std::chrono::duration<double> timeout;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<const void*> in;  // per rank, published before the first barrier of a collective
  std::vector<void*> out;

  // Waits until all ranks arrive (a generation barrier); throws if the group is aborted or time runs out.
  void wait_all() {
    std::unique_lock<std::mutex> lock(mu);
    if (aborted) throw Error(ErrorCode::InvalidArgument, "comm", "the in-process group was aborted by another rank");
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lock, timeout, [&] { return generation != gen || aborted; })) {
      aborted = true;
      cv.notify_all();
      throw Error(ErrorCode::InvalidArgument, "comm", "a collective timed out: not every rank arrived");
    }
    if (aborted && generation == gen)
      throw Error(ErrorCode::InvalidArgument, "comm", "the in-process group was aborted by another rank");
  }
};

namespace {
class InProcessComm final : public Communicator {
 public:
  InProcessComm(InProcessGroup::State* s, int rank) : s_(s), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return s_->world; }
  Backend device() const override { return Backend::CPU; }

  void allreduce_sum_f32(float* data, int64_t count) override {
    if (count < 0) invalid("count", "expected >= 0");
    if (count > 0 && !data) invalid("data", "is null");
    // Each rank sums all ranks' buffers in rank order into a private copy, then all write back: every rank
    // computes the same additions in the same order, so all end bit-identical.
    s_->in[rank_] = data;
    s_->wait_all();
    std::vector<float> sum(static_cast<size_t>(count));
    for (int p = 0; p < s_->world; ++p) {
      const float* src = static_cast<const float*>(s_->in[p]);
      if (p == 0) std::copy_n(src, count, sum.data());
      else for (int64_t i = 0; i < count; ++i) sum[i] += src[i];
    }
    s_->wait_all();  // nobody overwrites its buffer before all have read it
    std::copy_n(sum.data(), count, data);
    s_->wait_all();
  }
  void allgather(const void* in, void* out, int64_t bytes) override {
    if (bytes < 0) invalid("bytes", "expected >= 0");
    s_->in[rank_] = in;
    s_->wait_all();
    for (int p = 0; p < s_->world; ++p)
      std::memcpy(static_cast<uint8_t*>(out) + p * bytes, s_->in[p], static_cast<size_t>(bytes));
    s_->wait_all();
  }
  void reduce_scatter_sum_f32(const float* in, float* out, int64_t count) override {
    if (count < 0) invalid("count", "expected >= 0");
    s_->in[rank_] = in;
    s_->wait_all();
    for (int64_t i = 0; i < count; ++i) {
      float acc = 0.f;
      for (int p = 0; p < s_->world; ++p) {
        const float v = static_cast<const float*>(s_->in[p])[rank_ * count + i];
        acc = p == 0 ? v : acc + v;
      }
      out[i] = acc;
    }
    s_->wait_all();
  }
  void alltoall(const void* in, void* out, int64_t bytes_per_rank) override {
    if (bytes_per_rank < 0) invalid("bytes_per_rank", "expected >= 0");
    s_->in[rank_] = in;
    s_->wait_all();
    for (int q = 0; q < s_->world; ++q)
      std::memcpy(static_cast<uint8_t*>(out) + q * bytes_per_rank,
                  static_cast<const uint8_t*>(s_->in[q]) + rank_ * bytes_per_rank, static_cast<size_t>(bytes_per_rank));
    s_->wait_all();
  }
  void barrier() override { s_->wait_all(); }

 private:
  InProcessGroup::State* s_;
  int rank_;
};
}  // namespace

InProcessGroup::InProcessGroup(int world, double timeout_s) : state_(std::make_unique<State>()) {
  if (world < 1) invalid("world", "expected >= 1, got " + std::to_string(world));
  if (!(timeout_s > 0)) invalid("timeout_s", "expected > 0");
  state_->world = world;
  state_->timeout = std::chrono::duration<double>(timeout_s);
  state_->in.assign(static_cast<size_t>(world), nullptr);
  state_->out.assign(static_cast<size_t>(world), nullptr);
  for (int r = 0; r < world; ++r) comms_.push_back(std::make_unique<InProcessComm>(state_.get(), r));
}
InProcessGroup::~InProcessGroup() = default;
int InProcessGroup::world() const { return state_->world; }
Communicator& InProcessGroup::comm(int rank) {
  if (rank < 0 || rank >= state_->world)
    invalid("rank", "expected in [0, world=" + std::to_string(state_->world) + "), got " + std::to_string(rank));
  return *comms_[static_cast<size_t>(rank)];
}
void InProcessGroup::abort() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->aborted = true;
  state_->cv.notify_all();
}

// ---- the parallel run calls ------------------------------------------------------------------------------
namespace {

constexpr int64_t kFlagFloats = 64;  // the failure-flag block after a partial (256 bytes keep alignment)
int64_t round64(int64_t n) { return (n + 63) / 64 * 64; }

// Layout of the CUDA scratch (floats): [partial: round64(T*H) | flag block 64] then the gathered region:
//   AllReduce:     world x (partial + flag block), rank stride P = round64(T*H) + 64;
//   ReduceScatter: world x (rows*H) chunks (rank stride rows*H), then world x flag block at round64(world*rows*H).
struct ScratchLayout {
  int64_t C = 0, P = 0, gathered = 0, flags = 0, total = 0;
  ScratchLayout(int64_t T, int64_t H, int64_t rows, int world, ParallelOutput output) {
    C = round64(T * H);
    P = C + kFlagFloats;
    gathered = P;
    if (output == ParallelOutput::AllReduce) {
      flags = gathered + C;
      total = P + world * P;
    } else {
      flags = gathered + round64(world * rows * H);
      total = flags + world * kFlagFloats;
    }
  }
};

// The checks of the caller's y and output mode every backend shares (inside the failure agreement).
void check_output(const MoeArgs& args, Backend be, int dev, ParallelOutput output, int64_t world, int64_t& T, int64_t H,
                  int64_t& rows) {
  if (!args.x.present()) invalid("x", "is required but absent");
  if (!args.y.present()) invalid("y", "is required but absent");
  if (args.x.ndim != 2) invalid("x", "expected [T, H], got " + args.x.shape_str());
  T = args.x.shape[0];
  rows = T;
  if (output != ParallelOutput::AllReduce && output != ParallelOutput::ReduceScatter)
    invalid("output", "expected ParallelOutput AllReduce (0) or ReduceScatter (1), got " + std::to_string(static_cast<int>(output)));
  if (output == ParallelOutput::ReduceScatter) {
    if (T % world)
      invalid("x", "ReduceScatter needs T divisible by world=" + std::to_string(world) + ", got T=" + std::to_string(T));
    rows = T / world;
  }
  if (be == Backend::CPU && args.y.device != Backend::CPU) invalid("y", "expected a host tensor (CPU weights)");
  if (be == Backend::CUDA && (args.y.device != Backend::CUDA || args.y.device_id != dev))
    invalid("y", "expected a tensor on cuda:" + std::to_string(dev) + " (the weights' device)");
  if (args.y.dtype != DType::BF16 && args.y.dtype != DType::F32)
    invalid("y", std::string("expected bfloat16 or float32, got ") + to_string(args.y.dtype));
  if (args.y.ndim != 2 || args.y.shape[0] != rows || args.y.shape[1] != H)
    invalid("y", "expected [" + std::to_string(rows) + ", " + std::to_string(H) + "], got " + args.y.shape_str());
  if (args.y.stride[0] < 0 || args.y.stride[1] < 0) invalid("y", "negative strides");
}

#if defined(FP4MOE_WITH_CUDA)
// The CUDA path: see parallel.h (moe_run_tp). All work on args.stream, no host synchronisation.
void run_and_reduce_cuda(const MoeWeights& w, MoeArgs local, const MoeArgs& args, Communicator& comm,
                         ParallelOutput output, const std::function<void()>& precheck, const TensorView& pws) {
  namespace pd = parallel_device;
  const int world = comm.world();
  const int dev = w.impl().device_id;
  // Sizes of the collectives: the same on every rank when the ranks agree on T (documented).
  const int64_t H = w.hidden();
  const int64_t T0 = args.x.present() && args.x.ndim == 2 ? args.x.shape[0] : 0;
  const int64_t rows0 = output == ParallelOutput::ReduceScatter ? T0 / world : T0;
  const ScratchLayout L(T0, H, rows0, world, output);
  const size_t bytes = static_cast<size_t>(L.total) * sizeof(float);

  // The communicator enqueues on args.stream for this call.
  struct StreamScope {
    Communicator& c;
    void* prev;
    StreamScope(Communicator& c_, void* s) : c(c_), prev(c_.stream()) { c.set_stream(s); }
    ~StreamScope() { c.set_stream(prev); }
  } stream_scope(comm, args.stream);
  void* stream = args.stream;

  std::unique_ptr<Error> err;
  auto record = [&](const std::exception_ptr& ep) {
    try {
      std::rethrow_exception(ep);
    } catch (const Error& e) {
      err = std::make_unique<Error>(e);
    } catch (const std::exception& e) {
      err = std::make_unique<Error>(ErrorCode::InvalidArgument, "", e.what());
    }
  };
  // Scratch: the caller's, or allocated on the stream. A bad caller workspace is this rank's error, but the
  // rank still joins the collectives with scratch of its own.
  float* scratch = nullptr;
  struct Owned {
    void* p = nullptr;
    int dev;
    void* stream;
    ~Owned() { pd::free_async(p, dev, stream); }
  } owned{nullptr, dev, stream};
  try {
    if (comm.cuda_device() >= 0 && comm.cuda_device() != dev)
      invalid("comm", "the communicator lives on cuda:" + std::to_string(comm.cuda_device()) + ", the weights on cuda:" +
                      std::to_string(dev));
    if (pws.present()) {
      if (pws.device != Backend::CUDA || pws.device_id != dev)
        invalid("parallel_workspace", "must be on the weights' device cuda:" + std::to_string(dev));
      if (pws.dtype != DType::U8 || pws.ndim != 1 || !pws.is_contiguous())
        invalid("parallel_workspace", "expected a contiguous 1-D uint8 tensor, got " + pws.shape_str());
      if (static_cast<size_t>(pws.numel()) < bytes)
        invalid("parallel_workspace", "expected at least " + std::to_string(bytes) + " bytes (parallel_workspace_size), got " +
                                      std::to_string(pws.numel()));
      if (reinterpret_cast<uintptr_t>(pws.data) % 256)
        invalid("parallel_workspace", "must be aligned to 256 bytes");
      scratch = static_cast<float*>(pws.data);
    }
  } catch (...) {
    record(std::current_exception());
  }
  if (!scratch) {
    owned.p = pd::alloc_async(bytes, dev, stream);  // if even this fails, this rank cannot join: see docs
    scratch = static_cast<float*>(owned.p);
  }
  float* partial = scratch;
  float* gathered = scratch + L.gathered;

  int64_t T = 0, rows = 0;
  if (!err) {
    try {
      if (precheck) precheck();
      check_output(args, Backend::CUDA, dev, output, world, T, H, rows);
      // The local operator into the fp32 partial (the combine writes the unrounded sum).
      local.y = make_view(partial, DType::F32, {T, H}, Backend::CUDA, dev);
      local.stream = stream;
      moe_run(w, local);
    } catch (...) {
      record(std::current_exception());
    }
  }
  // Every rank joins the same collectives, failed or not; the flag travels with the data.
  pd::set_flag_async(partial + L.C, err != nullptr, dev, stream);
  if (output == ParallelOutput::AllReduce) {
    comm.allgather(partial, gathered, L.P * static_cast<int64_t>(sizeof(float)));
  } else {
    comm.allgather(partial + L.C, scratch + L.flags, kFlagFloats * static_cast<int64_t>(sizeof(float)));
    comm.alltoall(partial, gathered, rows0 * H * static_cast<int64_t>(sizeof(float)));
  }
  if (err) throw *err;
  pd::ReduceToY r;
  r.src = gathered;
  r.world = world;
  if (output == ParallelOutput::AllReduce) {
    r.rank_stride = L.P;
    r.flags = gathered + L.C;
    r.flag_stride = L.P;
  } else {
    r.rank_stride = rows * H;
    r.flags = scratch + L.flags;
    r.flag_stride = kFlagFloats;
  }
  r.rows = rows;
  r.H = H;
  r.y = args.y.data;
  r.y_bf16 = args.y.dtype == DType::BF16;
  r.y_stride0 = args.y.stride[0];
  r.y_stride1 = args.y.stride[1];
  pd::reduce_to_y(r, dev, stream);
}
#endif

// `precheck` runs inside the failure agreement (its errors do not leave other ranks waiting).
void run_and_reduce(const MoeWeights& w, MoeArgs local, const MoeArgs& args, Communicator& comm,
                    ParallelOutput output, const std::function<void()>& precheck, const TensorView& pws) {
  const int64_t world = comm.world();
  // Decided identically on every rank (no data involved), so throwing here leaves no rank waiting.
  if (!w.valid()) invalid("weights", "not prepared");
  if (w.backend() != comm.device())
    throw Error(ErrorCode::Unsupported, "comm",
                std::string("weights on the ") + (w.backend() == Backend::CUDA ? "CUDA" : "CPU") +
                    " backend need a " + (w.backend() == Backend::CUDA ? "device communicator (NCCL)" : "host communicator (InProcessGroup)"));
  if (w.backend() == Backend::CUDA) {
#if defined(FP4MOE_WITH_CUDA)
    run_and_reduce_cuda(w, std::move(local), args, comm, output, precheck, pws);
    return;
#else
    throw Error(ErrorCode::Unsupported, "weights", "this build of fp4moe has no CUDA backend");
#endif
  }
  int64_t T = 0, H = w.hidden(), rows = 0;
  std::vector<float> partial;
  // Checks and the local run; a failure on one rank is agreed on by all before any data collective, so no
  // rank waits for one that threw. The failing rank rethrows its own error (same code and argument).
  std::unique_ptr<Error> err;
  try {
    if (precheck) precheck();
    if (pws.present()) invalid("parallel_workspace", "only the CUDA backend takes a parallel workspace");
    check_output(args, Backend::CPU, 0, output, world, T, H, rows);
    // The local operator into an fp32 partial (the reference writes fp32 y without a bf16 rounding).
    partial.assign(static_cast<size_t>(T * H), 0.f);
    local.y = make_view(partial.data(), DType::F32, {T, H});
    moe_run(w, local);
  } catch (const Error& e) {
    err = std::make_unique<Error>(e);
  } catch (const std::exception& e) {
    err = std::make_unique<Error>(ErrorCode::InvalidArgument, "", e.what());
  }
  float failed = err ? 1.f : 0.f;
  comm.allreduce_sum_f32(&failed, 1);
  if (err) throw *err;
  if (failed != 0.f) throw Error(ErrorCode::InvalidArgument, "comm", "another rank's checks or local run failed");
  std::vector<float> sum;
  const float* src;
  if (output == ParallelOutput::AllReduce) {
    comm.allreduce_sum_f32(partial.data(), T * H);
    src = partial.data();
  } else {
    sum.resize(static_cast<size_t>(rows * H));
    comm.reduce_scatter_sum_f32(partial.data(), sum.data(), rows * H);
    src = sum.data();
  }
  // One rounding to the caller's dtype, respecting y's strides.
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = t * args.y.stride[0] + h * args.y.stride[1];
      const float v = src[t * H + h];
      if (args.y.dtype == DType::BF16) args.y.as<uint16_t>()[off] = f32_to_bf16_bits(v);
      else args.y.as<float>()[off] = v;
    }
}

}  // namespace

int64_t parallel_workspace_size(int64_t T, int64_t H, int world, ParallelOutput output) {
  if (T < 0) invalid("T", "expected >= 0, got " + std::to_string(T));
  if (H < 1) invalid("H", "expected >= 1, got " + std::to_string(H));
  if (world < 1) invalid("world", "expected >= 1, got " + std::to_string(world));
  if (output == ParallelOutput::ReduceScatter && T % world)
    invalid("T", "ReduceScatter needs T divisible by world=" + std::to_string(world) + ", got " + std::to_string(T));
  const ScratchLayout L(T, H, output == ParallelOutput::ReduceScatter ? T / world : T, world, output);
  return L.total * static_cast<int64_t>(sizeof(float));
}

void moe_run_tp(const MoeWeights& shard, const MoeArgs& args, Communicator& comm, ParallelOutput output,
                const TensorView& parallel_workspace) {
  run_and_reduce(shard, args, args, comm, output, nullptr, parallel_workspace);
}

void moe_run_ep(const MoeWeights& local, const MoeArgs& args, Communicator& comm, ParallelOutput output,
                const TensorView& parallel_workspace) {
  if (!local.valid()) invalid("weights", "not prepared");
  auto precheck = [&] {
    const int64_t E = args.num_experts_total;
    if (E < 1) invalid("num_experts_total", "expected the model's E (>= 1) for expert parallelism, got " + std::to_string(E));
    const ExpertWindow win = expert_window(E, comm.rank(), comm.world());
    if (args.local_expert_offset != win.offset)
      invalid("local_expert_offset", "expected " + std::to_string(win.offset) + " (expert_window of rank " +
                                     std::to_string(comm.rank()) + "), got " + std::to_string(args.local_expert_offset));
    if (local.num_experts() != win.count)
      invalid("weights", "expected " + std::to_string(win.count) + " local experts (expert_window), got " +
                         std::to_string(local.num_experts()));
  };
  MoeArgs a = args;
  if (comm.rank() != 0) {  // the shared expert (and its gate) is added once, on rank 0
    a.shared_expert = nullptr;
    a.shared_expert_gate = TensorView{};
  }
  run_and_reduce(local, a, args, comm, output, precheck, parallel_workspace);
}

#if !defined(FP4MOE_WITH_NCCL)
namespace {
const char* kNoNccl =
    "this build of fp4moe has no NCCL communicator (FP4MOE_WITH_NCCL undefined: a CPU-only build, or nccl.h was "
    "not found when it was configured)";
}
std::unique_ptr<Communicator> make_nccl_communicator(void*, void*) {
  throw Error(ErrorCode::Unsupported, "nccl_comm", kNoNccl);
}
bool nccl_available() { return false; }
std::string nccl_unavailable_reason() { return kNoNccl; }
std::vector<uint8_t> nccl_unique_id() { throw Error(ErrorCode::Unsupported, "nccl", kNoNccl); }
NcclGroupComm::NcclGroupComm(const std::vector<uint8_t>&, int, int, int, void*) {
  throw Error(ErrorCode::Unsupported, "nccl", kNoNccl);
}
NcclGroupComm::~NcclGroupComm() = default;
void NcclGroupComm::destroy() {}
Communicator& NcclGroupComm::comm() { throw Error(ErrorCode::Unsupported, "nccl", kNoNccl); }
#endif

}  // namespace fp4moe
