// The backend under test or the oracle of `fp4moe check`: one call on the CPU or a CUDA device.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "check_setup.h"
#include "fp4moe/moe.h"

namespace fp4moe::check {

// How a run uses the shape's shared expert: as the shape has it, without its gate (weight 1), or not at all.
enum class SharedRun { AsShape, Ungated, Without };

// What one run takes besides the config: adapters, bridge input, routing form.
struct CallSpec {
  std::string label;
  const AdapterRegistry* registry = nullptr;
  const std::vector<int32_t>* adapter_ids = nullptr;
  const std::vector<uint16_t>* delta = nullptr;  // gate_up_lora_delta [T, k, N1]
  const std::vector<int32_t>* topk_ids = nullptr;  // precomputed routing (with topk_weights)
  const std::vector<float>* topk_weights = nullptr;
  SharedRun shared = SharedRun::AsShape;
};

// Host pointers of every input, turned into views on the executor's device.
struct HostInputs {
  const void *x, *logits, *bias, *alpha, *beta, *clamp, *ids, *delta, *topk_ids, *topk_w, *shared_gate;
};

// The backend under test or the oracle: prepared weights and the run call on one device.
class Executor {
 public:
  Executor(Backend backend, Precision precision, const ShapeSetup& S);
  Backend backend() const { return backend_; }
  std::unique_ptr<AdapterRegistry> make_registry() const {
    return std::make_unique<AdapterRegistry>(weights_, kNumSlots);
  }

  // Runs and returns the output as bf16 bits (bits != nullptr, bf16 y) or as doubles (f64/f32 y on
  // the CPU: the oracle keeps its output unrounded).
  void run(const Config& c, const CallSpec& call, std::vector<uint16_t>* bits, std::vector<double>* values) const;

 private:
  MoeArgs make_args(const Config& c, const CallSpec& call, const HostInputs& in, Backend dev) const;

  Backend backend_;
  Precision precision_;
  const ShapeSetup& S_;
  MoeWeights weights_;
  MoeWeights shared_;  // valid() when the shape has a shared expert
};

}  // namespace fp4moe::check
