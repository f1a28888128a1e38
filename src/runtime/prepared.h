// Canonical, backend-independent forms of prepared weights and adapters. The CPU reference reads
// the host arrays; the CUDA backend adds its own packed layout in `device`.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "fp4moe/moe.h"

namespace fp4moe {

struct PreparedWeights {
  Backend backend = Backend::CPU;
  int device_id = 0;
  WeightFormat format = WeightFormat::NVFP4;
  GateUpOrder order = GateUpOrder::GateFirst;
  bool gated = true;
  int64_t E = 0, H = 0, I = 0;
  int64_t n1() const { return gated ? 2 * I : I; }

  // Host copies, always in the weights' half order, scales in the linear layout.
  std::vector<uint8_t> w1_q;    // NVFP4, MXFP4: [E, N1, H/2]
  std::vector<uint8_t> w1_sf;   // NVFP4: [E, N1, H/16] e4m3 codes; MXFP4: [E, N1, H/32] e8m0 codes
  std::vector<float> w1_s2;     // [E, 2]: scale of the first half, of the second half (equal when one given);
                                // [E, 1] for non-gated. 1 for bf16 and MXFP4.
  std::vector<uint8_t> w2_q;    // NVFP4, MXFP4: [E, H, I/2]
  std::vector<uint8_t> w2_sf;   // NVFP4: [E, H, I/16]; MXFP4: [E, H, I/32]
  std::vector<float> w2_s2;     // [E]
  std::vector<uint16_t> w1_bf16;  // BF16: [E, N1, H]
  std::vector<uint16_t> w2_bf16;  // BF16: [E, H, I]
  std::vector<float> bias1;     // [E, N1] or empty
  std::vector<float> bias2;     // [E, H] or empty

  // Scale of half `h` (0 = first rows, 1 = second rows) of expert e's W1.
  float s1(int64_t e, int h) const { return gated ? w1_s2[e * 2 + h] : w1_s2[e]; }

  std::shared_ptr<void> device;  // backend-specific (CUDA: src/cuda/)
};

// An adapter in one canonical form: per expert e,
//   gate_up: dh = bf16( bf16(x . A1_e^T) . B1_e^T ),  A1_e [r1, H], B1_e [N1, r1] (weights' half order)
//   down:    do = bf16( bf16(a . A2_e^T) . B2_e^T ),  A2_e [r2, I], B2_e [H, r2]
// with the scale folded into B1/B2. PerExpert layouts become r1 = 2r with A1 = [A_gate; A_up] and
// B1 block-diagonal (the zero blocks add exact zeros). SharedOuter keeps a single A1 (a1_shared) and a
// single B2 (b2_shared), and its down delta is taken once per token on sum_j w_j (a_j . A2_e^T).
struct PreparedAdapter {
  int64_t E = 0, H = 0, I = 0, N1 = 0;
  LoraLayout layout = LoraLayout::PeftFused;
  int64_t rank = 0;  // the adapter's r
  float scale = 0;   // s_a (already folded into B1/B2)
  bool has_gate_up = false, has_down = false;
  int64_t r1 = 0, r2 = 0;
  bool a1_shared = false, b2_shared = false;
  std::vector<uint16_t> A1;  // [a1_shared ? 1 : E, r1, H]
  std::vector<uint16_t> B1;  // [E, N1, r1]
  std::vector<uint16_t> A2;  // [E, r2, I]
  std::vector<uint16_t> B2;  // [b2_shared ? 1 : E, H, r2]
  // The shared expert's own LoRA (dense, E = 1): same formulas, never "shared outer".
  bool has_shared = false;
  int64_t s_r = 0, s_I = 0, s_N1 = 0;
  bool s_has_gate_up = false, s_has_down = false;
  std::vector<uint16_t> sA1, sB1, sA2, sB2;  // [r, H], [N1s, r], [r, Is], [H, r]

  std::shared_ptr<void> device;  // backend-specific copy
};

using AdapterSnapshot = std::shared_ptr<const std::vector<std::shared_ptr<const PreparedAdapter>>>;

}  // namespace fp4moe
