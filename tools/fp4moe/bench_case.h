// One case of the bench: a shape's layer and inputs on the device, and one token count without LoRA or in one of
// the LoRA cases, captured in CUDA graphs, replayed and timed.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench.h"
#include "bench_device.h"
#include "bench_options.h"
#include "common/parallel_for.h"
#include "fp4moe/moe.h"
#include "runtime/plan.h"

namespace fp4moe::bench {

// ---- one case's results --------------------------------------------------------------------------------
struct CaseResult {
  std::string shape;
  int64_t T = 0;
  bool lora = false;
  std::string lora_case = "base";  // lora_case_name of the LoRA case, "base" without LoRA
  std::string status = "ok";  // ok | unsupported | error
  std::string message;
  bool graph = true;
  int runs = 0;
  double median_us = 0, p10_us = 0, p90_us = 0, min_us = 0, mean_us = 0;
  // Means over the input sets.
  double local_slots = 0, touched_experts = 0, adapted_slots = 0, touched_pairs = 0, adapted_tokens = 0, touched_adapters = 0;
  double weight_bytes = 0, lora_bytes = 0, io = 0, flops = 0;
  bench::Metrics m;
  std::string output_check;
  MoePlan plan;  // make_plan of the call on the case's device (the JSON reports its tile, chunks, m tiles, splits)
};

// Random N(0, 1) values in parallel chunks (each chunk its own seed: deterministic for a given n).
// gen(len, seed) -> std::vector<T> is random_bf16 or random_f32.
template <class T, class Gen>
std::vector<T> parallel_random(int64_t n, uint64_t seed, Gen gen) {
  const int64_t chunk = int64_t(1) << 22;
  const int64_t nchunks = (n + chunk - 1) / chunk;
  std::vector<T> out(static_cast<size_t>(n));
  parallel_for(nchunks, default_threads(16), [&](int64_t c) {
    const int64_t b = c * chunk, len = std::min(chunk, n - b);
    const std::vector<T> v = gen(len, seed * 1000003 + static_cast<uint64_t>(c));
    std::copy(v.begin(), v.end(), out.begin() + b);
  });
  return out;
}

// ---- the cases of one shape ----------------------------------------------------------------------------
struct Pools {
  DeviceBuffer x;            // bf16 N(0,1)
  int64_t x_elems = 0;
  std::vector<float> logits_host;  // f32 N(0,1)
  DeviceBuffer logits;
  int64_t set_shift_x = 0, set_shift_logits = 0;  // offset between input sets (elements)
};

// The adapters of one layout, in their own registry: the backend sizes its LoRA launches by the loaded slots.
struct AdapterSet {
  std::unique_ptr<AdapterRegistry> registry;  // nullptr: this layout's rows are not run
  std::string status;                         // "" or why they are not
};

struct ShapeCtx {
  const ModelShape* shape = nullptr;
  int64_t E_loc = 0, E_total = 0;
  bool gated = true;
  MoeWeights w;
  MoeWeights shared;          // the shape's shared expert (ModelShape::shared_I > 0), else not valid()
  DeviceBuffer shared_gate;   // its bf16 gate [H] (ModelShape::shared_gate)
  DeviceBuffer alpha, beta, clamp, bias;
  std::vector<float> bias_host;
  AdapterSet peft_fused, shared_outer;
  std::array<DeviceBuffer, kNumLoraCases> adapter_ids;  // by LoraCase, for the largest T
  const AdapterSet& adapters(LoraCase lc) const { return lora_case_shared_outer(lc) ? shared_outer : peft_fused; }
};

// Host routing of one input set (the reference's routing: the same function the kernels compute).
std::vector<int32_t> host_route(const ShapeCtx& c, int64_t T, const float* logits);

// Times T tokens of c's shape in LoRA case lora, or without LoRA (nullopt); touches: one per input set, counted with
// the case's adapter ids; ws is the workspace the cases share (grown when one needs more).
CaseResult run_case(Device& d, ShapeCtx& c, const Pools& pools, int64_t T, std::optional<LoraCase> lora,
                    const Options& o, DeviceBuffer& ws, const std::vector<bench::Touch>& touches);

// Whether the backend runs registry LoRA of this layout for this shape: one token through a one-expert copy of the
// layer. "" when it does, else the error.
std::string probe_lora(const ModelShape& s, WeightFormat format, int dev, LoraLayout layout);

}  // namespace fp4moe::bench
