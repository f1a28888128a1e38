// Tensor and expert parallelism over a communicator (issue 7, SPEC §1 "I on this rank", §3.1 window, §4).
//
// Tensor parallelism (TP): every rank holds all experts with I/world intermediate rows; the ranks'
// fp32 partial outputs are summed in rank order (an all-gather and our own sum, never a reduction whose
// order depends on the transport) and rounded once to bf16.
// Expert parallelism (EP): every rank holds the window [off, off + E_loc) of the experts and sees all
// tokens; the partial outputs (experts outside the window contribute 0) are summed the same way.
// One process (or, in tests, one thread) per rank; each rank calls the same function with its own
// weights, args and communicator handle.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fp4moe/moe.h"
#include "fp4moe/quantize.h"  // OwnedWeights: host weights with their own storage
#include "fp4moe/types.h"

namespace fp4moe {

// ---- sharding helpers (host tensors) -------------------------------------------------------------
// The TP shard `rank` of `world` of host weights (NVFP4 linear or swizzled scales, or bf16): Is = I/world
// must be a multiple of 16 (whole NVFP4 blocks). Rows [rank*Is, (rank+1)*Is) of each W1 half (either half
// order; non-gated W1: of its one half) with their block scales; columns [rank*Is, ...) of W2 (packed bytes
// and scale columns); per-half scale2 and w2 scale2 unchanged; bias1 sliced like W1's rows; bias2 kept on
// rank 0 only (the all-reduce then adds it once). The result's scales are in the linear layout (desc()
// views its storage).
// Also used for a shared expert (E = 1). Errors name `world`, `rank` or the offending tensor.
OwnedWeights shard_weights_tp(const WeightsDesc& full, int rank, int world);

// Experts [begin, begin + count) of host weights (all of I): the local weights of an EP rank.
OwnedWeights slice_experts(const WeightsDesc& full, int64_t begin, int64_t count);

// An adapter with its own storage; `desc` views the vectors (move-only).
struct ShardedAdapter {
  LoraAdapterDesc desc;
  std::vector<std::vector<uint16_t>> storage;
  ShardedAdapter() = default;
  ShardedAdapter(ShardedAdapter&&) = default;
  ShardedAdapter& operator=(ShardedAdapter&&) = default;
  ShardedAdapter(const ShardedAdapter&) = delete;
  ShardedAdapter& operator=(const ShardedAdapter&) = delete;
};

// The TP shard of a LoRA adapter for layer intermediate size `inter` (the full I) and, when the adapter
// carries shared-expert LoRA, the shared expert's full intermediate size `shared_inter`:
//   gate_up: A replicated (a_gate_up / a_gate, a_up), B rows sharded like W1 (b_gate_up: both halves,
//            gate rows first; b_gate, b_up: rows [rank*Is, ...));
//   down:    A columns sharded (a_down [.., r, I] -> [.., r, Is]: its K dim is I), B replicated.
// The down delta is then added once: rank p computes z_p = a_p . A2_p^T, a partial sum over its Is
// columns, and d_p = z_p . B2^T; the all-reduce gives sum_p d_p = (sum_p z_p) . B2^T = z . B2^T, the
// single-GPU delta. Rounding differs: the single-GPU operator rounds z (and d) to bf16 once, here each
// partial z_p and d_p is rounded (docs/numerics.md "Parallelism" states the tolerance).
ShardedAdapter shard_adapter_tp(const LoraAdapterDesc& full, int64_t inter, int rank, int world,
                              int64_t shared_inter = 0);

// Experts [begin, begin + count) of an adapter (EP): per-expert matrices sliced; SharedOuter's shared A1
// and B2 kept; the shared-expert LoRA kept (moe_run_ep applies the shared expert on rank 0 only).
ShardedAdapter slice_adapter_experts(const LoraAdapterDesc& full, int64_t num_experts, int64_t begin,
                                   int64_t count);

// The SPEC §3.1 window of rank `rank`: contiguous; the first E_total % world ranks get one extra expert.
struct ExpertWindow {
  int64_t offset = 0;  // local_expert_offset
  int64_t count = 0;   // E_loc
};
ExpertWindow expert_window(int64_t num_experts_total, int rank, int world);

// ---- communicators ---------------------------------------------------------------------------------
// Collectives of one rank. Buffers live where the implementation says (host for InProcess, device for
// NCCL). Every reduction sums in rank order 0, 1, ..., world-1 (SPEC §4: deterministic; no atomics).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual Backend device() const = 0;  // where the buffers live
  // data[i] <- sum over ranks (in rank order) of data[i], in place; all ranks end bit-identical.
  virtual void allreduce_sum_f32(float* data, int64_t count) = 0;
  // out [world, count] <- every rank's `in` [count] (rank order). Bytes.
  virtual void allgather(const void* in, void* out, int64_t bytes) = 0;
  // out [count] <- (sum over ranks of in [world * count]) rows [rank*count, (rank+1)*count).
  virtual void reduce_scatter_sum_f32(const float* in, float* out, int64_t count) = 0;
  // out [world, bytes] chunk q <- chunk `rank()` of rank q's `in` [world, bytes] (an all-to-all). Bytes.
  virtual void alltoall(const void* in, void* out, int64_t bytes_per_rank) = 0;
  virtual void barrier() = 0;
  // The CUDA stream the collectives are enqueued on (nullptr for host communicators, which ignore it).
  // moe_run_tp / moe_run_ep set it to args.stream for the call and restore it afterwards.
  virtual void* stream() const { return nullptr; }
  virtual void set_stream(void* stream) { (void)stream; }
  // The CUDA device of a device communicator (-1 for host communicators).
  virtual int cuda_device() const { return -1; }
};

// N ranks in one process (threads, one per rank) sharing buffers: for tests and CPU runs. A collective
// waits for all ranks; a rank that does not arrive within `timeout_s` makes the others throw (never hang).
class InProcessGroup {
 public:
  explicit InProcessGroup(int world, double timeout_s = 120.0);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;
  int world() const;
  Communicator& comm(int rank);  // the handle of `rank` (valid while the group lives)
  // Marks the group failed (a rank threw): ranks waiting in a collective throw instead of waiting.
  void abort();

  struct State;

 private:
  std::unique_ptr<State> state_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

// A communicator over an NCCL communicator the caller made (ncclComm_t, passed as void*), its collectives
// enqueued on `stream` (cudaStream_t; nullptr = the legacy default stream). Buffers are device pointers.
// allreduce_sum_f32 is an ncclAllGather into scratch followed by a rank-order sum on the device (not
// ncclAllReduce, whose reduction order depends on the algorithm NCCL picks). Throws Unsupported in a build
// without NCCL (FP4MOE_WITH_NCCL undefined).
std::unique_ptr<Communicator> make_nccl_communicator(void* nccl_comm, void* stream);
bool nccl_available();  // this build has the NCCL path and libnccl could be opened
// Why nccl_available() is false ("" when it is true): no NCCL in this build, or libnccl not found.
std::string nccl_unavailable_reason();

// ---- making an NCCL communicator ---------------------------------------------------------------------
// libnccl.so.2 is opened at run time (dlopen): first the path in the environment variable
// FP4MOE_NCCL_LIBRARY (a file, or a folder holding libnccl.so.2, e.g. the nvidia-nccl pip package's
// nvidia/nccl/lib, which fp4moe.distributed sets), then the loader's search path. Without it (or in a build
// without NCCL) every function below throws Unsupported naming the reason.
constexpr size_t kNcclUniqueIdBytes = 128;  // sizeof(ncclUniqueId)
// A new ncclUniqueId (ncclGetUniqueId), on one rank; every rank of the group then passes it to
// NcclGroupComm. Its 128 bytes travel between processes as they are (a pipe, a file, torch.distributed).
std::vector<uint8_t> nccl_unique_id();

// An NCCL communicator this object owns: ncclCommInitRank(world, id, rank) on CUDA device `device` (a
// collective: blocks until all `world` ranks have called it), ncclCommDestroy on destruction. comm() is the
// fp4moe Communicator over it, enqueuing on `stream` (cudaStream_t; changed per call by moe_run_tp/_ep).
class NcclGroupComm {
 public:
  NcclGroupComm(const std::vector<uint8_t>& unique_id, int world, int rank, int device, void* stream = nullptr);
  ~NcclGroupComm();
  NcclGroupComm(const NcclGroupComm&) = delete;
  NcclGroupComm& operator=(const NcclGroupComm&) = delete;
  Communicator& comm();                            // throws InvalidArgument after destroy()
  void* nccl_comm() const { return nccl_comm_; }  // the ncclComm_t (null after destroy())
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  // ncclCommDestroy now (the destructor then does nothing). Idempotent.
  void destroy();

 private:
  void* nccl_comm_ = nullptr;
  int device_ = 0, rank_ = 0, world_ = 1;
  std::unique_ptr<Communicator> comm_;
};

// ---- the parallel run calls ------------------------------------------------------------------------
enum class ParallelOutput : int32_t {
  AllReduce = 0,      // every rank gets y [T, H], the full sum
  ReduceScatter = 1,  // rank p gets rows [p*T/world, (p+1)*T/world) of the sum in y [T/world, H]; T % world == 0
};

// Device scratch of one CUDA moe_run_tp / moe_run_ep call, bytes (256-byte aligned): this rank's fp32 partial
// [T, H] with a failure flag, and every rank's partial (all-gather) or every rank's chunk for this rank
// (ReduceScatter). Pass `parallel_workspace` (uint8 [>= this], on the weights' device, 256-byte aligned) to
// take it from the caller; without it the call allocates it on args.stream (cudaMallocAsync, freed with
// cudaFreeAsync: the stream-ordered pool, no host synchronisation). 0 for the CPU backend.
int64_t parallel_workspace_size(int64_t T, int64_t H, int world, ParallelOutput output = ParallelOutput::AllReduce);

// TP: `shard` holds this rank's shard (shard_weights_tp), args.adapters a registry on `shard` loaded with
// shard_adapter_tp adapters, args.shared_expert (if any) also TP-sharded. Runs the local operator into an
// fp32 partial y (no rounding), sums the partials across ranks in fp32 in rank order and rounds once to
// args.y's dtype (bf16, or f32: no rounding). Every rank ends with the same bits.
//   CPU backend: host tensors and a host communicator (InProcessGroup).
//   CUDA backend: device tensors on the weights' device and a device communicator (NCCL) of that device.
//     Everything is enqueued on args.stream (the communicator's stream is switched for the call); no host
//     synchronisation. The partials travel by ncclAllGather (ReduceScatter: a grouped ncclSend/ncclRecv
//     all-to-all) and are summed by our kernel in rank order, rounding once into args.y (any strides).
// Failure agreement: all ranks always join the same collectives, so no rank waits for one that threw. CPU:
// a flag all-reduce before the data collective; every rank throws (the failing one its own error, the others
// InvalidArgument naming `comm`). CUDA: the flag rides with the partial; the failing rank throws its own
// error after joining, the others leave y untouched and set the device error flag, which the next
// check_device_errors reports (DeviceFault naming `comm`). Ranks must agree on T (the collectives' sizes).
void moe_run_tp(const MoeWeights& shard, const MoeArgs& args, Communicator& comm,
                ParallelOutput output = ParallelOutput::AllReduce, const TensorView& parallel_workspace = {});

// EP: `local` holds the window expert_window(args.num_experts_total, rank, world) (slice_experts);
// args.local_expert_offset must equal the window's offset. Tokens are replicated: every rank routes all
// tokens, runs the chosen experts in its window, and the fp32 partials are summed in rank order. The
// shared expert (args.shared_expert, full, not sharded) runs on rank 0 only. Same backends, streams, scratch
// and failure agreement as moe_run_tp.
void moe_run_ep(const MoeWeights& local, const MoeArgs& args, Communicator& comm,
                ParallelOutput output = ParallelOutput::AllReduce, const TensorView& parallel_workspace = {});

}  // namespace fp4moe
