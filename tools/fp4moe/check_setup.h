// The problem `fp4moe check` runs: a shape's synthetic layer, inputs and adapters, the (activation, mode)
// configs, and the requests of phase 3.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "fp4moe/synthetic.h"
#include "runtime/prepared.h"

namespace fp4moe::check {

inline constexpr int kNumAdapters = 8;
inline constexpr int kRank = 16;
inline constexpr int kNumRequests = 12;
// Registry slots: 0..7 the eight adapters, 8..10 zero-B adapters, 11 the exact gate_up-only adapter,
// 12 a scratch slot loaded and unloaded during the load/unload invariant.
inline constexpr int kZeroBSlot0 = 8, kNumZeroB = 3, kBridgeSlot = 11, kScratchSlot = 12, kNumSlots = 16;
// Phase 3: the adapter of each request (-1 = base).
inline constexpr int kRequestAdapter[kNumRequests] = {-1, 0, 1, -1, 2, 3, -1, 4, 5, -1, 6, 7};

// The layout of adapter a of the eight.
LoraLayout adapter_layout(int a);

// FNV-1a 64 over bytes: the fingerprint compared across process launches.
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull);
// v as 16 hex digits.
std::string hex64(uint64_t v);

// ---- the problem of one shape -------------------------------------------------------------------
struct ShapeSetup {
  const ModelShape* shape = nullptr;
  int64_t E_loc = 0, E_total = 0, offset = 0, T = 0, H = 0, I = 0, k = 0;
  SyntheticLayer layer;
  std::vector<uint16_t> x;
  std::vector<float> logits, router_bias;
  std::vector<SyntheticAdapter> adapters;  // the eight
  std::vector<SyntheticAdapter> zero_b;    // one per layout
  // The gate_up-only adapter of the bridge invariant (PEFT fused, one +-1 per A row and one +-1/8 per B
  // row, scale 1): every product and sum is exact, so its delta is the same whatever the summation order.
  std::vector<uint16_t> exact_a, exact_b;
  SyntheticLayer shared;              // the shape's shared expert (ModelShape::shared_I > 0), else E = 0
  std::vector<uint16_t> shared_gate;  // its bf16 sigmoid gate [H] (ModelShape::shared_gate), else empty
};

// The shape with at most `experts` local experts and `tokens` tokens, everything seeded by the shape's name.
ShapeSetup make_setup(const ModelShape& shape, int64_t experts, int64_t tokens,
                      WeightFormat format = WeightFormat::NVFP4);
// The exact gate_up-only adapter of S as a registry descriptor.
LoraAdapterDesc exact_adapter_desc(ShapeSetup& S);

// One (activation, mode) configuration of a shape.
struct Config {
  ActivationType act = ActivationType::Swiglu;
  ActMode mode = ActMode::A16;
  std::vector<float> alpha, beta, clamp;  // [E_loc] each, empty = the activation's defaults
  float fc1_scale = 0, fc2_scale = 0;     // A4 dequant scales (1/gs)
  std::string name;                       // "qwen3_30b_a3b swiglu A16"
};

Config make_config(const ShapeSetup& S, ActivationType act, ActMode mode);

// The gate_up delta [T, k, N1] of one adapter, computed on the host from its canonical form exactly
// as the reference computes it: dh = bf16(bf16(x . A1_e^T) . B1_e^T), fp32 sums in index order.
std::vector<uint16_t> host_gate_up_delta(const ShapeSetup& S, const PreparedAdapter& ad, const std::vector<int32_t>& ids);

// Phase 3's requests: contiguous groups of tokens.
std::vector<std::vector<int64_t>> request_rows(int64_t T);
// The adapter id of every token of phase 3's batch.
std::vector<int32_t> request_ids(int64_t T);

// The eight adapters into slots 0..7.
void load_adapters(AdapterRegistry& reg, ShapeSetup& S);

}  // namespace fp4moe::check
