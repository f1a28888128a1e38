// Making operator weights from dense f32/bf16 expert weights: NVFP4 or MXFP4 quantization per expert (SPEC §2)
// or a plain bf16 copy, with storage owned by the result. Used by the tests, the CLI demo and the
// Python package.
#pragma once
#include <cstdint>
#include <vector>

#include "fp4moe/moe.h"

namespace fp4moe {

struct QuantizeOptions {
  WeightFormat format = WeightFormat::NVFP4;
  // The half order of the given w1 rows (kept as given; recorded in the result).
  GateUpOrder order = GateUpOrder::GateFirst;
  bool gated = true;
  // Gated NVFP4: each half of W1 gets its own global scale (w1_scale2 [E, 2]); otherwise one per expert ([E]).
  bool per_half_scale2 = true;
  // Layout of the produced block scales (Swizzled128x4: [E, swizzled_size(N, K/16)] per tensor).
  ScaleLayout scale_layout = ScaleLayout::Linear;
};

// Expert weights with owned storage. desc() returns views into the vectors below; they stay valid while
// this object lives and its vectors are not resized.
struct OwnedWeights {
  WeightFormat format = WeightFormat::NVFP4;
  GateUpOrder order = GateUpOrder::GateFirst;
  ScaleLayout scale_layout = ScaleLayout::Linear;
  bool gated = true;
  int64_t E = 0, H = 0, I = 0;
  int64_t n1() const { return gated ? 2 * I : I; }

  std::vector<uint8_t> w1, w1_scale;  // NVFP4: [E, N1, H/2], [E, N1, H/16] or [E, swizzled_size(N1, H/16)];
                                      // MXFP4: [E, N1, H/2], [E, N1, H/32] e8m0 (no scale2)
  std::vector<float> w1_scale2;       // NVFP4: [E, 2] (per half, in `order`) or [E]
  std::vector<uint8_t> w2, w2_scale;  // NVFP4: [E, H, I/2], [E, H, I/16] or [E, swizzled_size(H, I/16)];
                                      // MXFP4: [E, H, I/2], [E, H, I/32]
  std::vector<float> w2_scale2;       // NVFP4: [E]
  std::vector<uint16_t> w1_bf16;      // BF16: [E, N1, H]
  std::vector<uint16_t> w2_bf16;      // BF16: [E, H, I]
  std::vector<float> bias1, bias2;    // [E, N1], [E, H] or empty

  WeightsDesc desc() const;
};

// w1 [E, N1, H] and w2 [E, H, I]: f32 or bf16 host tensors (any strides); N1 = 2I when opt.gated.
// bias1 [E, N1] and bias2 [E, H] (f32 or bf16) are optional. NVFP4: per expert (and per half of W1 with
// per_half_scale2) gs = 448*6/amax, scale2 = 1/gs, blocks quantized as SPEC §2. MXFP4: mxfp4::quantize_row
// per row (Linear scales only). H and I must be multiples of 16 (32 for MXFP4); values must be finite. Throws fp4moe::Error naming the argument.
OwnedWeights quantize_weights(const TensorView& w1, const TensorView& w2, const QuantizeOptions& opt = {},
                              const TensorView& bias1 = {}, const TensorView& bias2 = {});

// The values the operator multiplies by (e2m1 * e4m3 * scale2, e2m1 * e8m0, or the bf16 values), as f32:
// W1 [E, N1, H] and W2 [E, H, I].
std::vector<float> dequantize_w1(const OwnedWeights& w);
std::vector<float> dequantize_w2(const OwnedWeights& w);

}  // namespace fp4moe
