// One case of the bench: a shape's layer and inputs on the device, and one token count with or without LoRA,
// captured in CUDA graphs, replayed and timed.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench.h"
#include "bench_device.h"
#include "bench_options.h"
#include "common/parallel_for.h"
#include "fp4moe/moe.h"

namespace fp4moe::bench {

// ---- one case's results --------------------------------------------------------------------------------
struct CaseResult {
  std::string shape;
  int64_t T = 0;
  bool lora = false;
  std::string status = "ok";  // ok | unsupported | error
  std::string message;
  bool graph = true;
  int runs = 0;
  double median_us = 0, p10_us = 0, p90_us = 0, min_us = 0, mean_us = 0;
  double local_slots = 0, touched_experts = 0, adapted_slots = 0, touched_pairs = 0;  // means over the input sets
  double weight_bytes = 0, lora_bytes = 0, io = 0, flops = 0;
  bench::Metrics m;
  std::string output_check;
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

struct ShapeCtx {
  const ModelShape* shape = nullptr;
  int64_t E_loc = 0, E_total = 0;
  bool gated = true;
  MoeWeights w;
  DeviceBuffer alpha, beta, clamp, bias;
  std::vector<float> bias_host;
  std::unique_ptr<AdapterRegistry> registry;  // nullptr: no LoRA rows
  std::string lora_status;                    // "" or why there are no LoRA rows
  DeviceBuffer adapter_ids;
};

// Host routing of one input set (the reference's routing: the same function the kernels compute).
std::vector<int32_t> host_route(const ShapeCtx& c, int64_t T, const float* logits);

// Times T tokens of c's shape, with LoRA or without; ws is the workspace the cases share (grown when one needs more).
CaseResult run_case(Device& d, ShapeCtx& c, const Pools& pools, int64_t T, bool lora, const Options& o,
                    DeviceBuffer& ws, const std::vector<bench::Touch>& touches);

// Every token adapted: adapter t % 8.
std::vector<int32_t> adapter_ids_for(int64_t T);

// Whether the backend runs registry LoRA for this shape: one token through a one-expert copy of the layer.
std::string probe_lora(const ModelShape& s, WeightFormat format, int dev);

}  // namespace fp4moe::bench
