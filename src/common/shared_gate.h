// The sigmoid gate of a shared expert (Qwen2-MoE, Qwen3-Next): gate_t = sigmoid(x_t . g), in one fixed fp32 order that
// the CPU reference and the CUDA combine both follow, so the gate has the same bits on both (docs/numerics.md).
#pragma once
#include <cstdint>

#include "common/activation.h"
#include "common/host_device.h"
#include "fp4moe/types.h"

namespace fp4moe::shared_gate {

// The logit is summed by kLanes lanes; lane l owns the groups of kGroup consecutive elements l, l + kLanes, ...
// (a group is one 16-byte load of each operand on the GPU).
constexpr int kLanes = 32, kGroup = 8;

FP4MOE_HD float bf16_value(uint16_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
#else
  return bf16_bits_to_f32(b);
#endif
}

// Lane `lane`'s partial sum: its groups in ascending order, each element's product rounded, then added.
FP4MOE_HD float lane_partial(const uint16_t* x, const uint16_t* g, int64_t H, int lane) {
  float s = 0.f;
  for (int64_t q = lane; q < H / kGroup; q += kLanes)
    for (int i = 0; i < kGroup; ++i)
      s = act::add_rn(s, act::mul_rn(bf16_value(x[q * kGroup + i]), bf16_value(g[q * kGroup + i])));
  return s;
}

// The partials folded by halves, p_l += p_{l + off} for off = 16, 8, 4, 2, 1 (the CUDA combine's xor butterfly gives
// lane 0 exactly this, and every other lane the same bits, since IEEE addition commutes); then the sigmoid.
inline float gate_host(const uint16_t* x, const uint16_t* g, int64_t H) {
  float p[kLanes];
  for (int l = 0; l < kLanes; ++l) p[l] = lane_partial(x, g, H, l);
  for (int off = kLanes / 2; off > 0; off /= 2)
    for (int l = 0; l < off; ++l) p[l] = act::add_rn(p[l], p[l + off]);
  return act::sigmoid_ieee(p[0]);
}

}  // namespace fp4moe::shared_gate
