// SPEC §6: every bad argument raises an error naming it, and the output is left untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "fp4moe/fp4moe.h"
#include "runtime/plan.h"
#include "fp4moe/synthetic.h"

using namespace fp4moe;

namespace {

constexpr ModelShape kSmall = {"small", 64, 32, 4, 2, RoutingMethod::Renormalize, 1, 1, 1.f,
                               ActivationType::Swiglu, 1.f, 0.f, 0.f, 4};
constexpr uint16_t kPoison = 0x7fc1;  // a NaN payload no computation produces

struct Fixture {
  int64_t T = 5, H = kSmall.H, E = kSmall.E, k = kSmall.k;
  SyntheticLayer layer = make_synthetic_layer(kSmall, 0, 11);
  MoeWeights w = prepare_weights(layer.desc(), Backend::CPU);
  std::vector<uint16_t> x = random_bf16(T * H, 1);
  std::vector<float> logits = random_f32(T * E, 2);
  std::vector<uint16_t> y = std::vector<uint16_t>(T * H, kPoison);
  std::vector<int32_t> ids = std::vector<int32_t>(T, -1);
  std::vector<float> alpha = std::vector<float>(E, 1.f);
  MoeArgs args() {
    MoeArgs a;
    a.x = make_view(x.data(), DType::BF16, {T, H});
    a.routing.method = RoutingMethod::Renormalize;
    a.routing.top_k = k;
    a.routing.logits = make_view(logits.data(), DType::F32, {T, E});
    a.activation.type = ActivationType::Swiglu;
    a.y = make_view(y.data(), DType::BF16, {T, H});
    return a;
  }
  bool untouched() const {
    for (uint16_t v : y)
      if (v != kPoison) return false;
    return true;
  }
};

struct BadCase {
  const char* name;
  std::string argument;  // expected Error::argument()
  ErrorCode code;
  std::function<void(Fixture&, MoeArgs&)> mutate;
};

std::vector<int32_t> g_bad_ids;
std::vector<float> g_bad_w;
std::vector<uint16_t> g_bf16_buf(5 * 2 * 64, 0);
std::vector<float> g_f32_buf(4096, 1.f);

std::vector<BadCase> cases() {
  return {
      {"x_absent", "x", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.x = TensorView{}; }},
      {"x_wrong_dtype", "x", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.x.dtype = DType::F32; }},
      {"x_wrong_hidden", "x", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.x.shape[1] = 48; a.x.stride[0] = 48; }},
      {"x_1d", "x", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.x.ndim = 1; }},
      {"x_strided", "x", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.x.stride[1] = 2; }},
      {"x_on_cuda", "x", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.x.device = Backend::CUDA; }},
      {"y_absent", "y", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.y = TensorView{}; }},
      {"y_wrong_dtype", "y", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.y.dtype = DType::I32; }},
      {"y_wrong_rows", "y", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.y.shape[0] = 4; }},
      {"y_aliases_x", "y", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) {
         // y is checked untouched through f.y, so alias the other way round: x points into y.
         a.x.data = f.y.data();
       }},
      {"top_k_zero", "routing.top_k", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.top_k = 0; }},
      {"top_k_above_E", "routing.top_k", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.top_k = 5; }},
      {"logits_absent", "routing.logits", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.logits = TensorView{}; }},
      {"logits_wrong_width", "routing.logits", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.logits.shape[1] = 3; a.routing.logits.stride[0] = 3; }},
      {"logits_int", "routing.logits", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.logits.dtype = DType::I32; }},
      {"method_out_of_range", "routing.method", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.method = static_cast<RoutingMethod>(42); }},
      {"llama4_k2", "routing.top_k", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.method = RoutingMethod::Llama4; }},
      {"n_group_not_dividing", "routing.n_group", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.method = RoutingMethod::DeepSeekV3; a.routing.n_group = 3; }},
      {"bias_wrong_len", "routing.bias", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.bias = make_view(g_f32_buf.data(), DType::F32, {3}); }},
      {"scaling_nan", "routing.routed_scaling_factor", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.routing.routed_scaling_factor = std::numeric_limits<float>::quiet_NaN(); }},
      {"ids_and_logits", "routing.logits", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) {
         g_bad_ids.assign(f.T * f.k, 0); g_bad_w.assign(f.T * f.k, 0.5f);
         a.routing.topk_ids = make_view(g_bad_ids.data(), DType::I32, {f.T, f.k});
         a.routing.topk_weights = make_view(g_bad_w.data(), DType::F32, {f.T, f.k});
       }},
      {"ids_out_of_range", "routing.topk_ids", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) {
         g_bad_ids.assign(f.T * f.k, 1); g_bad_ids[3] = 4; g_bad_w.assign(f.T * f.k, 0.5f);
         a.routing.logits = TensorView{};
         a.routing.topk_ids = make_view(g_bad_ids.data(), DType::I32, {f.T, f.k});
         a.routing.topk_weights = make_view(g_bad_w.data(), DType::F32, {f.T, f.k});
       }},
      {"ids_negative", "routing.topk_ids", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) {
         g_bad_ids.assign(f.T * f.k, 1); g_bad_ids[0] = -1; g_bad_w.assign(f.T * f.k, 0.5f);
         a.routing.logits = TensorView{};
         a.routing.topk_ids = make_view(g_bad_ids.data(), DType::I32, {f.T, f.k});
         a.routing.topk_weights = make_view(g_bad_w.data(), DType::F32, {f.T, f.k});
       }},
      {"weights_without_ids", "routing.topk_ids", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) {
         g_bad_w.assign(f.T * f.k, 0.5f);
         a.routing.logits = TensorView{};
         a.routing.topk_weights = make_view(g_bad_w.data(), DType::F32, {f.T, f.k});
       }},
      {"total_experts_too_small", "num_experts_total", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.num_experts_total = 2; }},
      {"window_outside", "local_expert_offset", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.num_experts_total = 4; a.local_expert_offset = 1; }},
      {"non_gated_activation", "activation.type", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.activation.type = ActivationType::Relu; }},
      {"activation_out_of_range", "activation.type", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.activation.type = static_cast<ActivationType>(11); }},
      {"alpha_wrong_len", "activation.alpha", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.activation.alpha = make_view(g_f32_buf.data(), DType::F32, {3}); }},
      {"situ_alpha_nonpositive", "activation.alpha", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) {
         f.alpha[2] = 0.f; a.activation.type = ActivationType::Situ;
         a.activation.alpha = make_view(f.alpha.data(), DType::F32, {f.E});
       }},
      {"clamp_nan", "activation.clamp_limit", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) {
         f.alpha[1] = std::numeric_limits<float>::quiet_NaN();
         a.activation.clamp_limit = make_view(f.alpha.data(), DType::F32, {f.E});
       }},
      {"a4_without_scale", "fc1_input_scale", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.mode = ActMode::A4; a.fc2_input_scale = 1.f; }},
      {"a4_fc2_inf", "fc2_input_scale", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.mode = ActMode::A4; a.fc1_input_scale = 1.f; a.fc2_input_scale = std::numeric_limits<float>::infinity(); }},
      {"adapter_ids_without_registry", "adapter_ids", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) { a.adapter_ids = make_view(f.ids.data(), DType::I32, {f.T}); }},
      {"delta_wrong_shape", "gate_up_lora_delta", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) { a.gate_up_lora_delta = make_view(g_bf16_buf.data(), DType::BF16, {f.T, f.k, 32}); }},
      {"activation_out_wrong_dtype", "activation_out", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) { a.activation_out = make_view(g_f32_buf.data(), DType::F32, {f.T, f.k, 32}); }},
      {"activation_out_aliases_y", "activation_out", ErrorCode::InvalidArgument, [](Fixture& f, MoeArgs& a) { a.activation_out = make_view(f.y.data(), DType::BF16, {1, 1, 32}); a.activation_out.shape[0] = f.T; a.activation_out.shape[1] = f.k; a.activation_out.stride[1] = 32; a.activation_out.stride[0] = f.k * 32; }},
      {"fp64_precision_bad_value", "precision", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.precision = static_cast<Precision>(7); }},
      {"negative_threads", "num_threads", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.num_threads = -1; }},
      {"gemm_tile_out_of_range", "gemm_tile", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.gemm_tile = static_cast<GemmTile>(kNumGemmConfigs); }},
      {"gemm_tile_negative", "gemm_tile", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.gemm_tile = static_cast<GemmTile>(-2); }},
      {"workspace_budget_negative", "workspace_budget", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.workspace_budget = -1; }},
      {"workspace_on_cpu", "workspace", ErrorCode::InvalidArgument, [](Fixture&, MoeArgs& a) { a.workspace = make_view(g_bf16_buf.data(), DType::U8, {16}); }},
  };
}

class BadInput : public ::testing::TestWithParam<size_t> {};

TEST_P(BadInput, RaisesNamingTheArgumentAndLeavesOutputUntouched) {
  const BadCase c = cases()[GetParam()];
  Fixture f;
  MoeArgs a = f.args();
  c.mutate(f, a);
  try {
    moe_run(f.w, a);
    FAIL() << c.name << ": no error raised";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), c.argument) << c.name << ": " << e.what();
    EXPECT_EQ(e.code(), c.code) << c.name << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(c.argument), std::string::npos) << "message must name the argument";
  }
  EXPECT_TRUE(f.untouched()) << c.name << ": output was written";
}

INSTANTIATE_TEST_SUITE_P(AllCases, BadInput, ::testing::Range<size_t>(0, cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& i) { return std::string(cases()[i.param].name); });

TEST(BadInputBaseline, TheFixtureRunsWhenNothingIsWrong) {
  Fixture f;
  MoeArgs a = f.args();
  moe_run(f.w, a);
  EXPECT_FALSE(f.untouched());
  for (uint16_t v : f.y) EXPECT_TRUE(std::isfinite(bf16_bits_to_f32(v)));
}

TEST(BadInputBaseline, EmptyBatchIsLegal) {
  Fixture f;
  f.T = 0;
  MoeArgs a = f.args();
  EXPECT_NO_THROW(moe_run(f.w, a));
}

TEST(BadInputBaseline, UnpreparedWeightsAreRefused) {
  Fixture f;
  MoeArgs a = f.args();
  try {
    moe_run(MoeWeights{}, a);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "weights");
  }
  EXPECT_TRUE(f.untouched());
}

}  // namespace

namespace {
TEST(BadInputBaseline, RegistryOfAnotherLayerIsRefused) {
  Fixture f;
  constexpr ModelShape kOther = {"other", 64, 48, 4, 2, RoutingMethod::Renormalize, 1, 1, 1.f,
                                 ActivationType::Swiglu, 1.f, 0.f, 0.f, 4};
  SyntheticLayer other = make_synthetic_layer(kOther, 0, 12);
  MoeWeights w_other = prepare_weights(other.desc(), Backend::CPU);
  AdapterRegistry reg(w_other, 4);
  SyntheticAdapter ad = make_synthetic_adapter(other, 4, 13);
  reg.load(1, ad.desc());
  MoeArgs a = f.args();
  a.adapters = &reg;
  a.adapter_ids = make_view(f.ids.data(), DType::I32, {f.T});  // all base: the slot's shape alone must fail
  try {
    moe_run(f.w, a);
    FAIL() << "a registry prepared for another layer was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "adapters") << e.what();
  }
  EXPECT_TRUE(f.untouched());
}
}  // namespace

namespace {
// Two layers of one shape whose gate/up orders differ: B's registry holds B's half order, so using it with A's
// weights would apply the gate LoRA to the up half. It is refused, naming adapters, with y untouched.
TEST(BadInputBaseline, RegistryOfAnotherLayerOfTheSameShapeIsRefused) {
  Fixture f;
  SyntheticLayer other = make_synthetic_layer(kSmall, 0, 21, WeightFormat::NVFP4, false, GateUpOrder::UpFirst);
  MoeWeights w_other = prepare_weights(other.desc(), Backend::CPU);
  AdapterRegistry reg_other(w_other, 4);
  SyntheticAdapter ad = make_synthetic_adapter(other, 4, 22);
  reg_other.load(0, ad.desc());
  std::vector<int32_t> ids(static_cast<size_t>(f.T), 0);
  MoeArgs a = f.args();
  a.adapters = &reg_other;
  a.adapter_ids = make_view(ids.data(), DType::I32, {f.T});
  try {
    moe_run(f.w, a);
    FAIL() << "a registry made for another layer of the same shape was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "adapters") << e.what();
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
  }
  EXPECT_TRUE(f.untouched());
  // The same layer prepared twice is two weights: its registry belongs to one of them.
  MoeWeights w_again = prepare_weights(f.layer.desc(), Backend::CPU);
  AdapterRegistry reg_again(w_again, 4);
  a.adapters = &reg_again;
  EXPECT_THROW(moe_run(f.w, a), Error);
  EXPECT_TRUE(f.untouched());
  // A copy of the MoeWeights is the same weights: its registry is accepted (all tokens base here).
  std::vector<int32_t> base(static_cast<size_t>(f.T), -1);
  MoeWeights copy = f.w;
  AdapterRegistry reg_own(copy, 4);
  a.adapters = &reg_own;
  a.adapter_ids = make_view(base.data(), DType::I32, {f.T});
  EXPECT_NO_THROW(moe_run(f.w, a));
  EXPECT_FALSE(f.untouched());
}

// A registry made with one shared expert is refused beside another shared expert.
TEST(BadInputBaseline, RegistryOfAnotherSharedExpertIsRefused) {
  Fixture f;
  SyntheticLayer s1 = make_synthetic_shared_expert(kSmall, 32, 31);
  SyntheticLayer s2 = make_synthetic_shared_expert(kSmall, 32, 32);
  MoeWeights sw1 = prepare_weights(s1.desc(), Backend::CPU), sw2 = prepare_weights(s2.desc(), Backend::CPU);
  AdapterRegistry reg(f.w, 4, &sw1);
  MoeArgs a = f.args();
  a.adapters = &reg;
  a.adapter_ids = make_view(f.ids.data(), DType::I32, {f.T});
  a.shared_expert = &sw2;
  try {
    moe_run(f.w, a);
    FAIL() << "a registry made with another shared expert was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "adapters") << e.what();
  }
  EXPECT_TRUE(f.untouched());
  a.shared_expert = &sw1;
  EXPECT_NO_THROW(moe_run(f.w, a));
}
}  // namespace

namespace {
// Each shared-expert parameter out of range is named for itself, y untouched.
TEST(BadInputBaseline, SharedExpertParametersAreNamedEachForItself) {
  Fixture f;
  SyntheticLayer s = make_synthetic_shared_expert(kSmall, 32, 41);
  MoeWeights sw = prepare_weights(s.desc(), Backend::CPU);
  struct Bad {
    const char* argument;
    float alpha, beta, clamp;
  };
  for (const Bad b : {Bad{"shared_alpha", NAN, 0.f, 0.f}, Bad{"shared_beta", 1.f, INFINITY, 0.f},
                      Bad{"shared_clamp_limit", 1.f, 0.f, -1.f}, Bad{"shared_clamp_limit", 1.f, 0.f, NAN}}) {
    MoeArgs a = f.args();
    a.shared_expert = &sw;
    a.shared_params_given = true;
    a.shared_alpha = b.alpha;
    a.shared_beta = b.beta;
    a.shared_clamp_limit = b.clamp;
    try {
      moe_run(f.w, a);
      ADD_FAILURE() << b.argument << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), b.argument) << e.what();
    }
    EXPECT_TRUE(f.untouched());
  }
}
}  // namespace
