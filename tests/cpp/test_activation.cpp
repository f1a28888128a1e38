// Activations (SPEC §3.2 step 3, src/common/activation.h): each of the 11 types at hand-worked points
// (values computed with Python's math module), in float and double, parameter defaults, clamps; and a
// sweep against the independent double implementation of test_util.h.
#include <gtest/gtest.h>

#include <cmath>

#include "common/activation.h"
#include "test_util.h"

using namespace fp4moe;
using testutil::act_double;

namespace {

// Parameters as the operator resolves them when the caller gives none.
act::Params defaults(ActivationType t) { return act::resolve_params(t, false, 0, false, 0, false, 0); }
act::Params given(ActivationType t, float a, float b, float L) { return act::resolve_params(t, true, a, true, b, true, L); }

void expect_act(ActivationType t, double g, double u, const act::Params& p, double want) {
  const double tol = 1e-12 * std::max(1.0, std::fabs(want));
  EXPECT_NEAR(act::apply<double>(t, g, u, p), want, tol) << to_string(t) << " g=" << g << " u=" << u;
  const float f = act::apply<float>(t, static_cast<float>(g), static_cast<float>(u), p);
  EXPECT_NEAR(f, want, 2e-6 * std::max(1.0, std::fabs(want))) << to_string(t) << " (float) g=" << g << " u=" << u;
}

TEST(Activation, NonGated) {
  const auto G = ActivationType::Gelu, R = ActivationType::Relu, S = ActivationType::Silu, R2 = ActivationType::Relu2,
             Id = ActivationType::Identity;
  expect_act(G, 1.0, 0, defaults(G), 0.8413447460685429);
  expect_act(G, -0.5, 0, defaults(G), -0.15426876936299344);
  expect_act(G, 2.5, 0, defaults(G), 2.4844758366855597);
  expect_act(R, 1.25, 0, defaults(R), 1.25);
  expect_act(R, -3.0, 0, defaults(R), 0.0);
  expect_act(S, 1.5, 0, defaults(S), 1.2263617142904655);
  expect_act(S, -2.0, 0, defaults(S), -0.2384058440442351);
  expect_act(R2, 1.5, 0, defaults(R2), 2.25);
  expect_act(R2, -1.5, 0, defaults(R2), 0.0);
  expect_act(Id, -0.375, 0, defaults(Id), -0.375);
  // The u argument is ignored by non-gated activations.
  EXPECT_EQ(act::apply<double>(S, 1.5, 123.0, defaults(S)), act::apply<double>(S, 1.5, -7.0, defaults(S)));
  EXPECT_FALSE(is_gated(G) || is_gated(R) || is_gated(S) || is_gated(R2) || is_gated(Id));
}

TEST(Activation, Swiglu) {
  const auto t = ActivationType::Swiglu;
  // Defaults alpha 1, beta 0, no clamp: g * sigmoid(g) * u.
  const act::Params d = defaults(t);
  EXPECT_EQ(d.alpha, 1.f);
  EXPECT_EQ(d.beta, 0.f);
  EXPECT_FALSE(d.has_limit);
  expect_act(t, 1.5, -0.75, d, -0.919771285717849);
  expect_act(t, 30.0, 20.0, d, 30.0 * 20.0 / (1.0 + std::exp(-30.0)));  // no clamp by default
  // alpha 2, beta 0.5: 1.5 * sigmoid(3) * (-0.75 + 0.5).
  act::Params p = act::resolve_params(t, true, 2.f, true, 0.5f, false, 0.f);
  expect_act(t, 1.5, -0.75, p, -0.3572152975584125);
  // Clamp L = 1: g -> min(g, 1) = 1, u -> clamp(-3) = -1: sigmoid(1) * -1.
  expect_act(t, 1.5, -3.0, given(t, 1.f, 0.f, 1.f), -0.7310585786300049);
  // The gate is clamped from above only.
  expect_act(t, -5.0, 0.5, given(t, 1.f, 0.f, 1.f), -5.0 / (1.0 + std::exp(5.0)) * 0.5);
}

TEST(Activation, SwigluBiasDefaultsAreGptOss) {
  const auto t = ActivationType::SwigluBias;
  const act::Params d = defaults(t);
  EXPECT_FLOAT_EQ(d.alpha, 1.702f);
  EXPECT_FLOAT_EQ(d.beta, 1.f);
  EXPECT_TRUE(d.has_limit);
  EXPECT_FLOAT_EQ(d.limit, 7.f);
  // g = 8 -> 7, u = 9 -> 7: 7 sigmoid(1.702*7) (7 + 1) (with alpha = float(1.702), as the API carries it).
  expect_act(t, 8.0, 9.0, d, 7.0 * (1.0 / (1.0 + std::exp(-double(1.702f) * 7.0))) * 8.0);
  expect_act(t, 0.5, -0.25, d, 0.5 * (1.0 / (1.0 + std::exp(-double(1.702f) * 0.5))) * 0.75);
  // Given parameters replace the defaults one by one.
  act::Params p = act::resolve_params(t, false, 0.f, true, 0.f, false, 0.f);
  expect_act(t, 0.5, -0.25, p, 0.5 * (1.0 / (1.0 + std::exp(-double(1.702f) * 0.5))) * -0.25);
}

TEST(Activation, Geglu) {
  expect_act(ActivationType::Geglu, 1.0, 2.0, defaults(ActivationType::Geglu), 1.6826894921370859);
  expect_act(ActivationType::GegluTanh, 1.0, 2.0, defaults(ActivationType::GegluTanh), 1.6823839812165535);
  expect_act(ActivationType::GegluTanh, -1.3, 0.5, defaults(ActivationType::GegluTanh), -0.0630354938413453);
}

TEST(Activation, SwigluStepDefaultLimit7) {
  const auto t = ActivationType::SwigluStep;
  const act::Params d = defaults(t);
  EXPECT_TRUE(d.has_limit);
  EXPECT_FLOAT_EQ(d.limit, 7.f);
  // min(silu(10), 7) * clamp(-9, -7, 7) = 7 * -7.
  expect_act(t, 10.0, -9.0, d, -49.0);
  expect_act(t, 1.0, 2.0, d, 1.4621171572600098);
  // Limit 2: min(silu(3) = 2.857, 2) * clamp(5) = 2 * 2.
  expect_act(t, 3.0, 5.0, act::resolve_params(t, false, 0, false, 0, true, 2.f), 4.0);
}

TEST(Activation, SituKimi) {
  const auto t = ActivationType::Situ;
  const act::Params d = defaults(t);
  EXPECT_EQ(d.alpha, 1.f);
  EXPECT_EQ(d.beta, 1.f);  // SiTU's beta default is 1, not Swiglu's 0
  EXPECT_FALSE(d.has_limit);
  expect_act(t, 1.0, 0.5, d, 0.2572929424501846);
  const act::Params k = act::resolve_params(t, true, 4.f, true, 25.f, false, 0.f);
  expect_act(t, 3.0, 10.0, k, 22.987917512856885);
  expect_act(t, -6.0, 40.0, k, -0.20627776653973373);
  // With clamp L = 5: g = 8 -> 5, u = -30 -> -5.
  expect_act(t, 8.0, -30.0, given(t, 4.f, 25.f, 5.f), -16.63096693407082);
  // A non-finite clamp limit means no clamp.
  EXPECT_FALSE(given(t, 4.f, 25.f, INFINITY).has_limit);
}

// SiTU's branch-free float tanh / sigmoid (the host build of the device forms: std::exp and IEEE division where
// the device uses __expf / __fdividef) against double: relative error <= 3e-6 over [-60, 60], exact signs and
// zeros, NaN kept, +-1 at +-inf; and SiTU in float against its double over a grid that crosses the
// polynomial / exponential switch at |g / alpha| = 1/8.
TEST(Activation, SituFastFloatMath) {
  double worst_t = 0, worst_s = 0;
  for (double v = -60.0; v <= 60.0; v += 0.001953125 * 1.37) {
    const float f = static_cast<float>(v);
    const double tv = std::tanh(static_cast<double>(f)), sv = 1.0 / (1.0 + std::exp(-static_cast<double>(f)));
    worst_t = std::max(worst_t, std::fabs(act::tanh_fast(f) - tv) / std::max(std::fabs(tv), 1e-30));
    if (sv > 1e-30) worst_s = std::max(worst_s, std::fabs(act::sigmoid_fast(f) - sv) / sv);
  }
  EXPECT_LE(worst_t, 3e-6);
  EXPECT_LE(worst_s, 3e-6);
  for (float v : {1e-30f, 1e-6f, 0.1249f, 0.125f, 0.1251f, 3.0f}) {
    EXPECT_NEAR(act::tanh_fast(v), std::tanh(static_cast<double>(v)), 3e-6 * std::tanh(static_cast<double>(v))) << v;
    EXPECT_EQ(act::tanh_fast(-v), -act::tanh_fast(v)) << v;
  }
  EXPECT_EQ(act::tanh_fast(0.f), 0.f);
  EXPECT_TRUE(std::signbit(act::tanh_fast(-0.f)));
  EXPECT_EQ(act::tanh_fast(INFINITY), 1.f);
  EXPECT_EQ(act::tanh_fast(-INFINITY), -1.f);
  EXPECT_TRUE(std::isnan(act::tanh_fast(NAN)));
  EXPECT_EQ(act::sigmoid_fast(-INFINITY), 0.f);
  EXPECT_EQ(act::sigmoid_fast(INFINITY), 1.f);
  const auto t = ActivationType::Situ;
  const act::Params k = act::resolve_params(t, true, 4.f, true, 25.f, false, 0.f);
  for (double g = -12.0; g <= 12.0; g += 0.0731)
    for (double u = -80.0; u <= 80.0; u += 0.977) {
      const double want = act::apply<double>(t, static_cast<float>(g), static_cast<float>(u), k);
      const float f = act::apply<float>(t, static_cast<float>(g), static_cast<float>(u), k);
      EXPECT_NEAR(f, want, 5e-6 * std::fabs(want) + 1e-30) << "g=" << g << " u=" << u;
    }
}

// Every type on a grid of points against the test's own double implementation.
TEST(Activation, SweepAgainstIndependentDouble) {
  for (int ti = 0; ti <= 10; ++ti) {
    const auto t = static_cast<ActivationType>(ti);
    for (int with_params = 0; with_params < 2; ++with_params) {
      act::Params p = with_params ? given(t, 1.5f, 0.75f, 3.f) : defaults(t);
      testutil::ActParams q = testutil::default_act_params(t);
      if (with_params) { q.alpha = 1.5; q.beta = 0.75; q.limit = 3; q.has_limit = true; }
      for (double g = -9.0; g <= 9.0; g += 0.37)
        for (double u = -11.0; u <= 11.0; u += 1.13) {
          const double want = act_double(t, g, u, q);
          EXPECT_NEAR(act::apply<double>(t, g, u, p), want, 1e-12 * std::max(1.0, std::fabs(want)))
              << to_string(t) << " g=" << g << " u=" << u << " params=" << with_params;
        }
    }
  }
}

TEST(Activation, NanPropagates) {
  for (int ti = 0; ti <= 10; ++ti) {
    const auto t = static_cast<ActivationType>(ti);
    EXPECT_TRUE(std::isnan(act::apply<float>(t, NAN, 1.f, defaults(t)))) << to_string(t);
    if (is_gated(t)) EXPECT_TRUE(std::isnan(act::apply<float>(t, 1.f, NAN, defaults(t)))) << to_string(t) << " (up)";
  }
}

}  // namespace
