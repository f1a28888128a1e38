// Shapes shared by the plan tests (test_plan.cpp, test_plan_decode.cpp): a random ProblemShape over every
// option make_plan takes, and the ceiling division the checks use.
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>

#include "runtime/plan.h"

namespace fp4moe::plantest {

inline constexpr ActivationType kGatedActs[] = {ActivationType::Swiglu, ActivationType::Geglu, ActivationType::SwigluBias,
                                                ActivationType::SwigluStep, ActivationType::GegluTanh, ActivationType::Situ};
inline constexpr ActivationType kPlainActs[] = {ActivationType::Gelu, ActivationType::Relu, ActivationType::Silu,
                                                ActivationType::Relu2, ActivationType::Identity};

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }


inline ProblemShape random_shape(std::mt19937_64& rng, int64_t H, int64_t I, int64_t T) {
  ProblemShape s;
  s.T = T;
  s.H = H;
  s.I = I;
  std::uniform_int_distribution<int> coin(0, 1);
  const int64_t E_opts[] = {1, 2, 8, 32, 64, 128, 256, 384, 4096};
  s.E_loc = E_opts[std::uniform_int_distribution<int>(0, 8)(rng)];
  s.E_total = coin(rng) ? s.E_loc : s.E_loc * std::uniform_int_distribution<int64_t>(1, 8)(rng);
  s.k = std::uniform_int_distribution<int64_t>(1, std::min<int64_t>(s.E_total, 16))(rng);
  s.gated = coin(rng);
  s.activation = s.gated ? kGatedActs[rng() % 6] : kPlainActs[rng() % 5];
  s.mode = coin(rng) ? ActMode::A4 : ActMode::A16;
  s.format = coin(rng) ? WeightFormat::BF16 : WeightFormat::NVFP4;
  s.routing_from_logits = coin(rng) && s.E_total <= kMaxExpertsRouting;
  s.has_shared = coin(rng);
  s.shared_I = 16 * std::uniform_int_distribution<int64_t>(1, 256)(rng);
  if (rng() % 4 == 0) s.workspace_budget = std::uniform_int_distribution<int64_t>(1, int64_t(64) << 20)(rng);
  s.has_lora = coin(rng);
  s.max_lora_rank = s.has_lora ? std::uniform_int_distribution<int64_t>(0, kMaxLoraRank)(rng) : 0;
  return s;
}

}  // namespace fp4moe::plantest
