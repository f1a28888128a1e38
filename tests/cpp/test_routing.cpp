// Routing (SPEC §3.1): each of the 10 methods at hand-worked points, ties to the lower id, DeepSeekV3
// groups and bias, bf16 and strided logits, pass-through of precomputed routing, and random logits
// against the double-precision oracle of test_util.h.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "reference/reference.h"
#include "test_util.h"

using namespace fp4moe;
using namespace fp4moe::testutil;

namespace {

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Routed run_route(RoutingMethod m, std::vector<float> logits, int64_t E, int64_t k, std::vector<float> bias = {},
                 int64_t n_group = 1, int64_t topk_group = 1, float rsf = 1.f) {
  const int64_t T = static_cast<int64_t>(logits.size()) / E;
  RoutingArgs r;
  r.method = m;
  r.top_k = k;
  r.logits = make_view(logits.data(), DType::F32, {T, E});
  if (!bias.empty()) r.bias = make_view(bias.data(), DType::F32, {E});
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.routed_scaling_factor = rsf;
  Routed out{std::vector<int32_t>(T * k), std::vector<float>(T * k)};
  reference::route(r, T, E, out.ids.data(), out.w.data());
  return out;
}

void expect_route(const Routed& got, std::vector<int32_t> ids, std::vector<double> w, double tol = 2e-6) {
  ASSERT_EQ(got.ids, ids);
  for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(got.w[i], w[i], tol * std::max(1.0, std::fabs(w[i]))) << "slot " << i;
}

// l = [0.5, -1, 2, 1, 0], k = 3. Sigmoids: 0.622459, 0.268941, 0.880797, 0.731059, 0.5.
// Softmax over all: 0.125627, 0.028031, 0.563021, 0.207124, 0.076197.
const std::vector<float> kL5 = {0.5f, -1.f, 2.f, 1.f, 0.f};

TEST(Routing, DefaultIsSoftmaxNotRenormalized) {
  expect_route(run_route(RoutingMethod::Default, kL5, 5, 3), {2, 3, 0}, {0.5630212318, 0.2071239361, 0.1256270176});
}
TEST(Routing, RenormalizeIsSoftmaxOverChosen) {
  // softmax([2, 1, 0.5]) = e^0, e^-1, e^-1.5 over their sum 1.591009.
  expect_route(run_route(RoutingMethod::Renormalize, kL5, 5, 3), {2, 3, 0}, {0.6285317192, 0.2312238976, 0.1402443832});
}
TEST(Routing, RenormalizeNaiveDividesSoftmaxByChosenSum) {
  expect_route(run_route(RoutingMethod::RenormalizeNaive, kL5, 5, 3), {2, 3, 0},
               {0.6285317192, 0.2312238976, 0.1402443832});
}
TEST(Routing, TopKWeightsAreLogits) {
  expect_route(run_route(RoutingMethod::TopK, kL5, 5, 3), {2, 3, 0}, {2.0, 1.0, 0.5});
}
TEST(Routing, SigmoidRenorm) {
  expect_route(run_route(RoutingMethod::SigmoidRenorm, kL5, 5, 3), {2, 3, 0}, {0.3942134761, 0.3271958442, 0.2785906797});
}
TEST(Routing, Sigmoid) {
  expect_route(run_route(RoutingMethod::Sigmoid, kL5, 5, 3), {2, 3, 0}, {0.8807970780, 0.7310585786, 0.6224593312});
}
TEST(Routing, TopKSigmoid) {
  expect_route(run_route(RoutingMethod::TopKSigmoid, kL5, 5, 3), {2, 3, 0}, {0.8807970780, 0.7310585786, 0.6224593312});
}
TEST(Routing, Llama4IsTop1WithSigmoid) {
  expect_route(run_route(RoutingMethod::Llama4, kL5, 5, 1), {2}, {0.8807970780});
  EXPECT_THROW(run_route(RoutingMethod::Llama4, kL5, 5, 2), Error);
}
TEST(Routing, DeepSeekV3BiasSelectsUnbiasedWeights) {
  // b = s + bias = 0.622459, 1.068941, 0.380797, 0.731059, 0.6 -> ids 1, 3, 0; w = s * 2.5 / sum(s).
  const std::vector<float> bias = {0.f, 0.8f, -0.5f, 0.f, 0.1f};
  expect_route(run_route(RoutingMethod::DeepSeekV3, kL5, 5, 3, bias, 1, 1, 2.5f), {1, 3, 0},
               {0.4144039487, 1.1264667233, 0.9591293280});
  // Without bias DeepSeekV3 is top-k of sigmoid, renormalized, times the scale.
  expect_route(run_route(RoutingMethod::DeepSeekV3, kL5, 5, 3), {2, 3, 0}, {0.3942134761, 0.3271958442, 0.2785906797});
}
TEST(Routing, MiniMax2) {
  const std::vector<float> bias = {0.f, 0.8f, -0.5f, 0.f, 0.1f};
  expect_route(run_route(RoutingMethod::MiniMax2, kL5, 5, 3, bias, 1, 1, 2.5f), {1, 3, 0},
               {0.4144039487, 1.1264667233, 0.9591293280});
}

TEST(Routing, TiesGoToLowerExpertId) {
  // l = [1, 3, 2, 3]: experts 1 and 3 tie.
  const std::vector<float> l = {1.f, 3.f, 2.f, 3.f};
  for (auto m : {RoutingMethod::Default, RoutingMethod::Renormalize, RoutingMethod::RenormalizeNaive, RoutingMethod::TopK,
                 RoutingMethod::SigmoidRenorm, RoutingMethod::Sigmoid, RoutingMethod::TopKSigmoid,
                 RoutingMethod::DeepSeekV3, RoutingMethod::MiniMax2}) {
    const Routed r = run_route(m, l, 4, 3);
    EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 2})) << to_string(m);
  }
  EXPECT_EQ(run_route(RoutingMethod::Llama4, l, 4, 1).ids, std::vector<int32_t>{1});
  // All equal: 0, 1, 2 in order.
  EXPECT_EQ(run_route(RoutingMethod::TopK, {5.f, 5.f, 5.f, 5.f}, 4, 3).ids, (std::vector<int32_t>{0, 1, 2}));
  // With bias: expert 1 is lifted to the top, then experts 0 and 2 tie exactly on s + bias.
  const Routed b = run_route(RoutingMethod::DeepSeekV3, {2.f, 0.f, 2.f, -1.f}, 4, 2, {0.f, 5.f, 0.f, 0.f});
  EXPECT_EQ(b.ids, (std::vector<int32_t>{1, 0}));
}

TEST(Routing, DeepSeekV3Groups) {
  // E = 8 in 4 groups of 2, keep 2 groups, k = 3. Expert 5 has the largest logit but its group
  // {4, 5} scores sigmoid(-3) + sigmoid(3) = 1.0 < groups {2, 3} (1.6198) and {0, 1} (1.4058).
  const std::vector<float> l = {0.1f, 2.f, 1.5f, 1.4f, -3.f, 3.f, 0.f, 0.2f};
  std::vector<double> s;
  for (float v : l) s.push_back(1.0 / (1.0 + std::exp(-double(v))));
  const double sum = s[1] + s[2] + s[3];
  expect_route(run_route(RoutingMethod::DeepSeekV3, l, 8, 3, {}, 4, 2, 2.5f), {1, 2, 3},
               {s[1] * 2.5 / sum, s[2] * 2.5 / sum, s[3] * 2.5 / sum});
  // n_group = 1 picks expert 5 first.
  EXPECT_EQ(run_route(RoutingMethod::DeepSeekV3, l, 8, 3).ids, (std::vector<int32_t>{5, 1, 2}));
  // Groups scored on biased scores: a bias lifts group {6, 7} above {0, 1}.
  const Routed b = run_route(RoutingMethod::DeepSeekV3, l, 8, 3, {0, 0, 0, 0, 0, 0, 0.5f, 0.5f}, 4, 2, 1.f);
  EXPECT_EQ(b.ids, (std::vector<int32_t>{7, 6, 2}));
  // Equal group scores go to the lower group id: groups {0, 1} and {2, 3} tie; keep group 0.
  EXPECT_EQ(run_route(RoutingMethod::DeepSeekV3, {1.f, 2.f, 2.f, 1.f}, 4, 1, {}, 2, 1).ids, std::vector<int32_t>{1});
}

TEST(Routing, Bf16AndStridedLogits) {
  // Two tokens whose logits live in every other column of a [2, 2E] buffer, as bf16.
  const int64_t T = 2, E = 6, k = 2;
  std::vector<uint16_t> buf(T * 2 * E, f32_to_bf16_bits(100.f));  // padding would win if read
  const float vals[T][E] = {{0.25f, -1.f, 1.5f, 0.5f, 1.5f, -2.f}, {3.f, 2.f, 1.f, 0.f, -1.f, -2.f}};
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) buf[t * 2 * E + 2 * e] = f32_to_bf16_bits(vals[t][e]);
  RoutingArgs r;
  r.method = RoutingMethod::Renormalize;
  r.top_k = k;
  r.logits.data = buf.data();
  r.logits.dtype = DType::BF16;
  r.logits.ndim = 2;
  r.logits.shape[0] = T;
  r.logits.shape[1] = E;
  r.logits.stride[0] = 2 * E;
  r.logits.stride[1] = 2;
  std::vector<int32_t> ids(T * k);
  std::vector<float> w(T * k);
  reference::route(r, T, E, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{2, 4, 0, 1}));
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  EXPECT_NEAR(w[2], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
}

TEST(Routing, PrecomputedPassesThrough) {
  const int64_t T = 2, k = 3;
  std::vector<int32_t> ids_in = {4, 0, 2, 1, 3, 5};
  std::vector<float> w_in = {0.5f, -0.25f, 1e-3f, 2.f, 0.f, 7.f};
  RoutingArgs r;
  r.top_k = k;
  r.method = RoutingMethod::DeepSeekV3;  // ignored without logits
  r.topk_ids = make_view(ids_in.data(), DType::I32, {T, k});
  r.topk_weights = make_view(w_in.data(), DType::F32, {T, k});
  std::vector<int32_t> ids(T * k);
  std::vector<float> w(T * k);
  reference::route(r, T, 6, ids.data(), w.data());
  EXPECT_EQ(ids, ids_in);
  EXPECT_EQ(w, w_in);
}

TEST(Routing, BadArgumentsThrow) {
  std::vector<int32_t> ids(8);
  std::vector<float> w(8);
  RoutingArgs r;
  r.top_k = 2;
  EXPECT_THROW(reference::route(r, 1, 4, ids.data(), w.data()), Error);  // neither logits nor ids
  std::vector<float> l(4, 0.f);
  r.logits = make_view(l.data(), DType::F32, {1, 4});
  r.top_k = 5;
  EXPECT_THROW(reference::route(r, 1, 4, ids.data(), w.data()), Error);  // k > E
  r.top_k = 2;
  EXPECT_THROW(reference::route(r, 1, 5, ids.data(), w.data()), Error);  // logits width != E
  r.method = RoutingMethod::DeepSeekV3;
  r.n_group = 3;
  EXPECT_THROW(reference::route(r, 1, 4, ids.data(), w.data()), Error);  // groups do not divide E
}

// Every method on random logits (and bias) against the double oracle: same ids, weights to 1e-5.
TEST(Routing, RandomLogitsMatchDoubleOracle) {
  const int64_t T = 16, E = 32, k = 6;
  const std::vector<float> lf = random_f32_vec(T * E, 7, -4.f, 4.f);
  const std::vector<float> bf = random_f32_vec(E, 8, -0.3f, 0.3f);
  const std::vector<double> ld(lf.begin(), lf.end()), bd(bf.begin(), bf.end());
  for (int m = 0; m <= 9; ++m) {
    const auto method = static_cast<RoutingMethod>(m);
    const int64_t kk = method == RoutingMethod::Llama4 ? 1 : k;
    for (int64_t n_group : {int64_t(1), int64_t(8)}) {
      if (n_group > 1 && method != RoutingMethod::DeepSeekV3) continue;
      const bool biased = method == RoutingMethod::DeepSeekV3 || method == RoutingMethod::MiniMax2;
      const Routed got = run_route(method, lf, E, kk, biased ? bf : std::vector<float>{}, n_group, n_group > 1 ? 3 : 1, 1.5f);
      const RoutingResult want = route_double(method, ld, T, E, kk, biased ? bd : std::vector<double>{}, n_group,
                                              n_group > 1 ? 3 : 1, 1.5);
      EXPECT_EQ(got.ids, want.ids) << to_string(method) << " n_group " << n_group;
      for (size_t i = 0; i < want.w.size(); ++i)
        EXPECT_NEAR(got.w[i], want.w[i], 1e-5 * std::max(1.0, std::fabs(want.w[i]))) << to_string(method) << " slot " << i;
    }
  }
}

}  // namespace
