// Synthetic layers and adapters with owned storage: the demo, `fp4moe check`, the benchmarks and the
// tests build their inputs here (random NVFP4 codes and scales sized so activations are O(1)).
#pragma once
#include <cstdint>
#include <vector>

#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"

namespace fp4moe {

struct SyntheticLayer {
  int64_t E = 0, H = 0, I = 0;
  bool gated = true;
  WeightFormat format = WeightFormat::NVFP4;
  GateUpOrder order = GateUpOrder::GateFirst;
  std::vector<uint8_t> w1, w1_sf, w2, w2_sf;  // NVFP4 (linear scales) or MXFP4 (e8m0 scales)
  std::vector<uint16_t> w1_bf16, w2_bf16;      // BF16
  std::vector<float> w1_s2, w2_s2;             // NVFP4: [E, 2] per half, [E]
  std::vector<float> bias1, bias2;             // empty unless with_bias
  std::vector<float> alpha, beta, clamp;       // [E] activation parameters (empty = defaults)
  WeightsDesc desc();                          // views into this object's storage
};

// E experts (E_loc of the shape unless `experts` > 0) of `shape`, random but deterministic in `seed`.
SyntheticLayer make_synthetic_layer(const ModelShape& shape, int64_t experts, uint64_t seed,
                                    WeightFormat format = WeightFormat::NVFP4, bool with_bias = false,
                                    GateUpOrder order = GateUpOrder::GateFirst);
// A dense shared expert (E = 1) with intermediate size I.
SyntheticLayer make_synthetic_shared_expert(const ModelShape& shape, int64_t I, uint64_t seed,
                                            WeightFormat format = WeightFormat::NVFP4);

struct SyntheticAdapter {
  LoraLayout layout = LoraLayout::PeftFused;
  int64_t rank = 0;
  float lora_alpha = 0;
  std::vector<uint16_t> a_gate, a_up, b_gate, b_up, a_gate_up, b_gate_up, a_down, b_down;
  int64_t E = 0, H = 0, I = 0, N1 = 0;
  LoraAdapterDesc desc();
};
// zero_b: every B matrix is zero (the adapter must then equal base bit for bit).
SyntheticAdapter make_synthetic_adapter(const SyntheticLayer& layer, int64_t rank, uint64_t seed,
                                        LoraLayout layout = LoraLayout::PeftFused, bool zero_b = false);

// Random bf16 activations ~ N(0, 1) and router logits ~ N(0, 1) (host).
std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed, float stddev = 1.f);
std::vector<float> random_f32(int64_t n, uint64_t seed, float stddev = 1.f);

}  // namespace fp4moe
