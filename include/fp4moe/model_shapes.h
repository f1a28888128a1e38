// The model shapes of SPEC §1: one home for the table every test, demo and benchmark uses (the contract's six, then
// additions beyond it).
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

#include "fp4moe/types.h"

namespace fp4moe {

struct ModelShape {
  std::string_view name;
  int64_t H, I, E, k;
  RoutingMethod routing;
  int64_t n_group, topk_group;
  float routed_scaling_factor;
  ActivationType activation;
  float alpha, beta, clamp_limit;  // clamp_limit 0 = none
  int64_t E_loc;                   // experts on this rank (deepseek_v3_ep8: 32 of 256)
  int64_t shared_I = 0;            // the shared expert's intermediate size (0: none)
  bool shared_gate = false;        // the shared expert is sigmoid-gated (shared_expert_gate, Qwen3-Next)
};

inline constexpr std::array<ModelShape, 7> kModelShapes = {{
    {"kimi_k3_tp8", 3584, 384, 384, 8, RoutingMethod::DeepSeekV3, 1, 1, 1.f, ActivationType::Situ, 4.f, 25.f, 0.f, 384},
    {"qwen3_30b_a3b", 2048, 768, 128, 8, RoutingMethod::RenormalizeNaive, 1, 1, 1.f, ActivationType::Swiglu, 1.f, 0.f, 0.f, 128},
    {"qwen3_30b_a3b_tp4", 2048, 192, 128, 8, RoutingMethod::RenormalizeNaive, 1, 1, 1.f, ActivationType::Swiglu, 1.f, 0.f, 0.f, 128},
    {"deepseek_v3_ep8", 7168, 2048, 256, 8, RoutingMethod::DeepSeekV3, 8, 4, 2.5f, ActivationType::Swiglu, 1.f, 0.f, 0.f, 32},
    {"mixtral_8x7b", 4096, 14336, 8, 2, RoutingMethod::Renormalize, 1, 1, 1.f, ActivationType::Swiglu, 1.f, 0.f, 0.f, 8},
    {"gpt_oss_120b", 2880, 2880, 128, 4, RoutingMethod::Renormalize, 1, 1, 1.f, ActivationType::SwigluBias, 1.702f, 1.f, 7.f, 128},
    // Beyond the contract's six: Qwen3-Next-80B-A3B (softmax, top-10, norm_topk_prob), a sigmoid-gated shared expert.
    {"qwen3_next_80b_a3b", 2048, 512, 512, 10, RoutingMethod::RenormalizeNaive, 1, 1, 1.f, ActivationType::Swiglu, 1.f, 0.f, 0.f, 512,
     512, true},
}};

// nullptr when the name is unknown.
inline const ModelShape* find_model_shape(std::string_view name) {
  for (const auto& m : kModelShapes)
    if (m.name == name) return &m;
  return nullptr;
}

}  // namespace fp4moe
