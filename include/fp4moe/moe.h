// The fused NVFP4 MoE operator with multi-LoRA (SPEC §3-§6): a prepare step for weights,
// an adapter registry, one run call. Every backend sits behind these types.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fp4moe/types.h"

namespace fp4moe {

// ---- weights ---------------------------------------------------------------------------------
// Raw expert weights as the caller has them. For a layer of E_loc experts, hidden H,
// intermediate I; N1 = 2I for gated activations, I otherwise.
//   NVFP4: w1 u8 [E, N1, H/2], w1_scale e4m3(u8) [E, N1, H/16] (Linear) or [E, swizzled_size(N1, H/16)]
//          (Swizzled128x4, per expert), w1_scale2 f32 [E] or [E, 2] (per half: the weights' half order);
//          w2 u8 [E, H, I/2], w2_scale [E, H, I/16] or swizzled, w2_scale2 f32 [E].
//   MXFP4: w1 u8 [E, N1, H/2], w1_scale e8m0 (u8) [E, N1, H/32], w2 u8 [E, H, I/2], w2_scale [E, H, I/32]
//          (Linear only; no global scale: w1_scale2, w2_scale2 absent); H and I multiples of 32.
//   BF16:  w1 bf16 [E, N1, H], w2 bf16 [E, H, I] (scales absent).
//   bias1 f32 [E, N1] and bias2 f32 [E, H], optional, real units.
// Tensors may live on the host or on the CUDA device; prepare copies what it needs.
struct WeightsDesc {
  WeightFormat format = WeightFormat::NVFP4;
  GateUpOrder order = GateUpOrder::GateFirst;  // required for gated weights; no silent default in the Python API
  ScaleLayout scale_layout = ScaleLayout::Linear;
  bool gated = true;                           // W1 holds two halves (gate, up)
  int64_t num_experts = 0, hidden = 0, inter = 0;
  TensorView w1, w1_scale, w1_scale2;
  TensorView w2, w2_scale, w2_scale2;
  TensorView bias1, bias2;
};

struct PreparedWeights;  // backend-specific storage (src/runtime/prepared.h)

// Weights laid out for one backend. Immutable once made; cheap to copy (shared).
class MoeWeights {
 public:
  MoeWeights() = default;
  Backend backend() const;
  WeightFormat format() const;
  GateUpOrder order() const;
  bool gated() const;
  int64_t num_experts() const;
  int64_t hidden() const;
  int64_t inter() const;
  bool valid() const { return impl_ != nullptr; }
  // The same prepared weights (a copy of this MoeWeights), not merely weights of the same shape.
  bool same_as(const MoeWeights& other) const { return impl_ != nullptr && impl_ == other.impl_; }
  const PreparedWeights& impl() const { return *impl_; }
  explicit MoeWeights(std::shared_ptr<const PreparedWeights> p) : impl_(std::move(p)) {}

 private:
  std::shared_ptr<const PreparedWeights> impl_;
};

// The weight-preparation step, apart from the hot call. device_id selects the GPU for Backend::CUDA.
MoeWeights prepare_weights(const WeightsDesc& desc, Backend backend, int device_id = 0);

// ---- LoRA (SPEC §5) ------------------------------------------------------------------------
enum class LoraLayout : int32_t {
  PerExpert = 0,    // SGLang/vLLM: a_gate, a_up [E, r, H]; b_gate, b_up [E, I, r]
  PeftFused = 1,    // PEFT target_parameters: a_gate_up [E, r, H]; b_gate_up [E, N1, r] (gate rows first)
  SharedOuter = 2,  // a_gate_up [r, H] shared by all experts; b_gate_up [E, N1, r]; b_down [H, r] shared
};
// "per_expert", "peft_fused", "shared_outer": the names Python's layout= takes.
const char* to_string(LoraLayout l);
// All matrices bf16, host or device. Down: a_down [E, r, I], b_down [E, H, r] ([H, r] for SharedOuter).
// Either projection may be absent. The scale s = lora_alpha / r (/ sqrt(r) with rsLoRA) is folded into
// the B matrices at load (rounded once to bf16). For non-gated layers "gate_up" is the single W1 half.
// b_gate_up is always gate rows first (HuggingFace order); the registry reorders to the weights' order.
struct LoraAdapterDesc {
  LoraLayout layout = LoraLayout::PeftFused;
  int64_t rank = 0;
  float lora_alpha = 0.f;
  bool use_rslora = false;
  TensorView a_gate, a_up, b_gate, b_up;  // PerExpert
  TensorView a_gate_up, b_gate_up;        // PeftFused, SharedOuter
  TensorView a_down, b_down;              // all layouts
  // The shared expert's own LoRA (dense): a [r, H], b [N1s, r] gate rows first; a_down [r, Is], b_down [H, r].
  TensorView shared_a_gate_up, shared_b_gate_up, shared_a_down, shared_b_down;
};

struct PreparedAdapter;  // canonical form (src/runtime/prepared.h)

// Slots of resident adapters for one MoE layer (and its optional shared expert). Thread-safe:
// load/unload may run while another thread runs the operator; a run sees the adapters as they
// were when it started. A registry belongs to the prepared weights it was made with (and copies of that
// MoeWeights): moe_run refuses it with any other weights, even of the same shape, and with a shared expert other
// than its own. A TP or EP shard is other weights: give each shard its own registry, loaded with that shard's
// slices of the adapters (shard_adapter_tp, slice_adapter_experts in parallel.h).
class AdapterRegistry {
 public:
  AdapterRegistry(const MoeWeights& layer, int num_slots = 64, const MoeWeights* shared_expert = nullptr);
  ~AdapterRegistry();
  AdapterRegistry(const AdapterRegistry&) = delete;
  AdapterRegistry& operator=(const AdapterRegistry&) = delete;

  int num_slots() const;
  void load(int slot, const LoraAdapterDesc& adapter);  // replaces what the slot held
  void unload(int slot);                                // NotFound if empty
  bool loaded(int slot) const;
  // An immutable snapshot of all slots (nullptr = empty), taken under the lock.
  std::shared_ptr<const std::vector<std::shared_ptr<const PreparedAdapter>>> snapshot() const;
  Backend backend() const;
  // Whether this registry was made for `weights` (the same prepared weights, see MoeWeights::same_as).
  bool made_for(const MoeWeights& weights) const;
  // The shared expert the registry was made with, or nullptr.
  const MoeWeights* shared_expert() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// ---- the run call --------------------------------------------------------------------------------
struct RoutingArgs {
  RoutingMethod method = RoutingMethod::Renormalize;
  int64_t top_k = 0;
  TensorView logits;        // f32 or bf16 [T, E]
  TensorView bias;          // f32 [E], optional (DeepSeekV3, MiniMax2)
  int64_t n_group = 1, topk_group = 1;
  float routed_scaling_factor = 1.f;
  TensorView topk_ids;      // i32 [T, k]: precomputed routing, instead of logits
  TensorView topk_weights;  // f32 [T, k]
};

struct ActivationArgs {
  ActivationType type = ActivationType::Swiglu;
  TensorView alpha, beta, clamp_limit;  // f32 [E_loc] each, optional, real units
};

struct MoeArgs {
  TensorView x;                   // bf16 [T, H]
  RoutingArgs routing;
  int64_t num_experts_total = 0;  // E (logits width); 0 = E_loc
  int64_t local_expert_offset = 0;
  ActivationArgs activation;
  ActMode mode = ActMode::A16;
  // A4: dequant scales (1/gs) of the FC1 input x and the FC2 input a. per_token_x_scale: x's gs per token
  // from its amax instead of fc1_input_scale.
  float fc1_input_scale = 0.f, fc2_input_scale = 0.f;
  bool per_token_x_scale = false;
  // Shared expert: a dense MLP with E=1, same activation type, weight 1; its parameters are scalars.
  const MoeWeights* shared_expert = nullptr;
  float shared_alpha = 1.f, shared_beta = 0.f, shared_clamp_limit = 0.f;  // clamp 0 = none
  bool shared_params_given = false;
  // Sigmoid gate of the shared expert (Qwen2-MoE, Qwen3-Next): y += sigmoid(x_t . g) * shared(x_t) instead of weight 1.
  // bf16 [H] or [1, H] (the checkpoint's shared_expert_gate.weight), on the weights' device; needs shared_expert.
  TensorView shared_expert_gate;
  // Multi-LoRA.
  const AdapterRegistry* adapters = nullptr;
  TensorView adapter_ids;         // i32 [T], -1 = base
  // Bridges.
  TensorView gate_up_lora_delta;  // bf16 [T, k, N1], in
  TensorView activation_out;      // bf16 [T, k, I], out (slots whose expert is not local are written 0)
  // Output and workspace.
  TensorView y;                   // bf16 [T, H], or f32 (the unrounded sum); the reference also takes f64
  TensorView workspace;           // u8, >= workspace_size(); CUDA only; absent = allocate internally. Any
                                  // contents (the call initialises what it reads); one call at a time per workspace
  void* stream = nullptr;         // cudaStream_t
  Precision precision = Precision::Fp32;  // Fp64: CPU reference only
  int num_threads = 0;                    // CPU: 0 = hardware concurrency
  // CUDA: the GEMM tile, Auto = chosen from the rows an expert. Any tile gives the same bits (SPEC §4); forcing
  // one is for tuning and tests. workspace_size must be asked with the same tile.
  GemmTile gemm_tile = GemmTile::Auto;
  // Bytes of workspace the token-proportional buffers may take (0 = the default, 4 GiB): a larger batch runs in
  // equal chunks that fit. workspace_size must be asked with the same budget.
  int64_t workspace_budget = 0;
};

// Runs the operator on the backend of `weights`. Throws fp4moe::Error; y untouched on error.
void moe_run(const MoeWeights& weights, const MoeArgs& args);

// Bytes of `workspace` moe_run needs for `args` on `weights` (0 on the CPU backend). Tensors count by their shape,
// so a view with a shape and no data will do (x [T, H]; routing.logits or routing.topk_ids); the size never
// decreases with T, and with a registry it holds adapters of any rank.
size_t workspace_size(const MoeWeights& weights, const MoeArgs& args);

// Routing alone (the first stage of moe_run), host tensors: ids i32 [T, k], weights f32 [T, k].
void route(const RoutingArgs& routing, int64_t num_experts_total, TensorView topk_ids_out,
           TensorView topk_weights_out);

// Reports (and clears) the device error flag set by bad GPU-only values; throws DeviceFault if set.
void check_device_errors(int device_id = 0);

}  // namespace fp4moe
