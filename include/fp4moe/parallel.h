// Tensor and expert parallelism over a communicator (issue 7, SPEC §1 "I on this rank", §3.1 window, §4).
//
// Tensor parallelism (TP): every rank holds all experts with I/world intermediate rows; the ranks'
// fp32 partial outputs are summed by an all-reduce in rank order and rounded once to bf16.
// Expert parallelism (EP): every rank holds the window [off, off + E_loc) of the experts and sees all
// tokens; the partial outputs (experts outside the window contribute 0) are summed the same way.
// One process (or, in tests, one thread) per rank; each rank calls the same function with its own
// weights, args and communicator handle.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "fp4moe/moe.h"
#include "fp4moe/types.h"

namespace fp4moe {

// ---- sharding helpers (host tensors) -------------------------------------------------------------
// Weights with their own storage; `desc` views the vectors below (move-only so the views stay valid).
struct ShardedWeights {
  WeightsDesc desc;
  std::vector<uint8_t> w1, w1_scale, w2, w2_scale;  // packed bytes / e4m3 codes (NVFP4) or bf16 bytes
  std::vector<float> w1_scale2, w2_scale2, bias1, bias2;
  ShardedWeights() = default;
  ShardedWeights(ShardedWeights&&) = default;
  ShardedWeights& operator=(ShardedWeights&&) = default;
  ShardedWeights(const ShardedWeights&) = delete;
  ShardedWeights& operator=(const ShardedWeights&) = delete;
};

// The TP shard `rank` of `world` of host weights (NVFP4 linear or swizzled scales, or bf16): Is = I/world
// must be a multiple of 16 (whole NVFP4 blocks). Rows [rank*Is, (rank+1)*Is) of each W1 half (either half
// order; non-gated W1: of its one half) with their block scales; columns [rank*Is, ...) of W2 (packed bytes
// and scale columns); per-half scale2 and w2 scale2 unchanged; bias1 sliced like W1's rows; bias2 kept on
// rank 0 only (the all-reduce then adds it once). The result's scales are in the linear layout.
// Also used for a shared expert (E = 1). Errors name `world`, `rank` or the offending tensor.
ShardedWeights shard_weights_tp(const WeightsDesc& full, int rank, int world);

// Experts [begin, begin + count) of host weights (all of I): the local weights of an EP rank.
ShardedWeights slice_experts(const WeightsDesc& full, int64_t begin, int64_t count);

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
  virtual void barrier() = 0;
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
bool nccl_available();  // this build has the NCCL path

// ---- the parallel run calls ------------------------------------------------------------------------
enum class ParallelOutput : int32_t {
  AllReduce = 0,      // every rank gets y [T, H], the full sum
  ReduceScatter = 1,  // rank p gets rows [p*T/world, (p+1)*T/world) of the sum in y [T/world, H]; T % world == 0
};

// TP: `shard` holds this rank's shard (shard_weights_tp), args.adapters a registry on `shard` loaded with
// shard_adapter_tp adapters, args.shared_expert (if any) also TP-sharded. Runs the local operator into an
// fp32 partial y, sums it across ranks in fp32 (rank order) and rounds once to args.y's dtype (bf16, or
// f32 on the CPU). CPU backend with a host communicator; the CUDA backend throws Unsupported (it writes
// only bf16 y today, and a bf16 partial would round twice).
void moe_run_tp(const MoeWeights& shard, const MoeArgs& args, Communicator& comm,
                ParallelOutput output = ParallelOutput::AllReduce);

// EP: `local` holds the window expert_window(args.num_experts_total, rank, world) (slice_experts);
// args.local_expert_offset must equal the window's offset. Tokens are replicated: every rank routes all
// tokens, runs the chosen experts in its window, and the fp32 partials are summed in rank order. The
// shared expert (args.shared_expert, full, not sharded) runs on rank 0 only. Same backends as moe_run_tp.
void moe_run_ep(const MoeWeights& local, const MoeArgs& args, Communicator& comm,
                ParallelOutput output = ParallelOutput::AllReduce);

}  // namespace fp4moe
