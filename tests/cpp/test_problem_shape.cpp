// problem_shape (src/runtime/problem_shape.h): the one mapping from a call to the plan's ProblemShape, for calls
// with buffers and for shape-only calls (workspace_size before the buffers exist).
#include <gtest/gtest.h>

#include <vector>

#include "fp4moe/fp4moe.h"
#include "fp4moe/synthetic.h"
#include "runtime/problem_shape.h"

namespace fp4moe {
namespace {

constexpr ModelShape kShape = {"ps", 64, 32, 8, 2, RoutingMethod::DeepSeekV3, 2, 1, 2.5f,
                               ActivationType::Situ, 4.f, 25.f, 0.f, 8};

void expect_same(const ProblemShape& a, const ProblemShape& b) {
  EXPECT_EQ(a.T, b.T);
  EXPECT_EQ(a.H, b.H);
  EXPECT_EQ(a.I, b.I);
  EXPECT_EQ(a.E_loc, b.E_loc);
  EXPECT_EQ(a.E_total, b.E_total);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.gated, b.gated);
  EXPECT_EQ(a.activation, b.activation);
  EXPECT_EQ(a.mode, b.mode);
  EXPECT_EQ(a.format, b.format);
  EXPECT_EQ(a.routing_from_logits, b.routing_from_logits);
  EXPECT_EQ(a.n_group, b.n_group);
  EXPECT_EQ(a.has_shared, b.has_shared);
  EXPECT_EQ(a.shared_I, b.shared_I);
  EXPECT_EQ(a.has_lora, b.has_lora);
  EXPECT_EQ(a.max_lora_rank, b.max_lora_rank);
  EXPECT_EQ(a.gemm_config, b.gemm_config);
  EXPECT_EQ(a.workspace_budget, b.workspace_budget);
  EXPECT_EQ(workspace_size(a), workspace_size(b));
}

TEST(ProblemShape, CallWithBuffersAndShapeOnlyCallMapAlike) {
  SyntheticLayer layer = make_synthetic_layer(kShape, 0, 3);
  SyntheticLayer shared = make_synthetic_shared_expert(kShape, 48, 4);
  MoeWeights w = prepare_weights(layer.desc(), Backend::CPU);
  MoeWeights sw = prepare_weights(shared.desc(), Backend::CPU);
  AdapterRegistry reg(w, 4, &sw);
  const int64_t T = 37, E_total = 16;
  std::vector<uint16_t> x(T * kShape.H);
  std::vector<float> logits(T * E_total);
  std::vector<int32_t> ids(T, -1);
  MoeArgs a;
  a.x = make_view(x.data(), DType::BF16, {T, kShape.H});
  a.routing.method = RoutingMethod::DeepSeekV3;
  a.routing.top_k = kShape.k;
  a.routing.n_group = 2;
  a.routing.logits = make_view(logits.data(), DType::F32, {T, E_total});
  a.num_experts_total = E_total;
  a.activation.type = ActivationType::Situ;
  a.mode = ActMode::A4;
  a.shared_expert = &sw;
  a.adapters = &reg;
  a.adapter_ids = make_view(ids.data(), DType::I32, {T});
  a.gemm_tile = GemmTile::WeightsAsA32;
  a.workspace_budget = int64_t(64) << 20;

  ProblemShape want;
  want.T = T;
  want.H = kShape.H;
  want.I = kShape.I;
  want.E_loc = kShape.E;
  want.E_total = E_total;
  want.k = kShape.k;
  want.gated = true;
  want.activation = ActivationType::Situ;
  want.mode = ActMode::A4;
  want.format = WeightFormat::NVFP4;
  want.routing_from_logits = true;
  want.n_group = 2;
  want.has_shared = true;
  want.shared_I = 48;
  want.has_lora = true;
  want.max_lora_rank = 16;
  want.gemm_config = 1;
  want.workspace_budget = int64_t(64) << 20;
  expect_same(problem_shape(w.impl(), a, false, 16, DeviceDesc{}), want);

  // The same call described by shapes alone.
  MoeArgs s = a;
  s.x = make_view(nullptr, DType::BF16, {T, kShape.H});
  s.routing.logits = make_view(nullptr, DType::F32, {T, E_total});
  s.adapters = nullptr;
  s.adapter_ids = TensorView{};
  expect_same(problem_shape(w.impl(), s, true, 16, DeviceDesc{}), want);

  // Precomputed routing: no logits, topk_ids by shape; n_group only counts for DeepSeekV3.
  s.routing.logits = TensorView{};
  s.routing.topk_ids = make_view(nullptr, DType::I32, {T, kShape.k});
  s.routing.method = RoutingMethod::Renormalize;
  want.routing_from_logits = false;
  want.n_group = 1;
  expect_same(problem_shape(w.impl(), s, true, 16, DeviceDesc{}), want);
}

TEST(ProblemShape, WorkspaceSizeOfTheCpuBackendIsZeroAndWeightsAreChecked) {
  SyntheticLayer layer = make_synthetic_layer(kShape, 0, 5);
  MoeWeights w = prepare_weights(layer.desc(), Backend::CPU);
  MoeArgs a;
  a.x = make_view(nullptr, DType::BF16, {8, kShape.H});
  a.routing.top_k = 2;
  EXPECT_EQ(workspace_size(w, a), 0u);
  try {
    (void)workspace_size(MoeWeights{}, a);
    FAIL() << "empty weights accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "weights");
  }
}

}  // namespace
}  // namespace fp4moe
