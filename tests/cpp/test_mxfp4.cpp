// MXFP4 weights (SPEC §2): the codec against an independent double computation (every E2M1 code under every
// E8M0 scale; the triton_kernels scale rule and round-to-nearest-even codes), what prepare_weights refuses, and the
// CPU reference operator with MXFP4 experts against the dense double oracle of dense_problem.h (which decodes the
// weights with its own code in test_util.h).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dense_problem.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "fp4moe/mxfp4.h"
#include "fp4moe/nvfp4.h"
#include "fp4moe/quantize.h"
#include "test_helpers.h"
#include "test_util.h"

using namespace fp4moe;
using namespace fp4moe::testutil;

namespace {

// The E2M1 magnitudes in double, by code (test_util's e2m1_value is the oracle's; this is a second spelling).
constexpr double kE2M1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};

// Nearest E2M1 code of v (finite), ties to the even code, saturating at 6: by search over the 8 magnitudes.
uint8_t nearest_e2m1(double v) {
  const double a = std::fabs(v);
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(a - kE2M1[c]), db = std::fabs(a - kE2M1[best]);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(best | (std::signbit(v) ? 8 : 0));
}

// gpt_oss_120b's shape with MXFP4 experts (H = I = 2880: 90 blocks of 32), E reduced 128 -> E.
Case gpt_oss_mxfp4(std::string name, int64_t E) {
  Case c{.name = std::move(name), .shape = shape_named("gpt_oss_120b")};
  c.E_total = c.E_loc = E;
  c.format = WeightFormat::MXFP4;
  return c;
}

TEST(Mxfp4, DecodeEveryCodeUnderEveryScale) {
  for (int e = 0; e < 256; ++e) {
    const float s = mxfp4::e8m0_decode(static_cast<uint8_t>(e));
    if (e == 255) {
      EXPECT_TRUE(std::isnan(s));
      continue;
    }
    EXPECT_EQ(static_cast<double>(s), std::ldexp(1.0, e - 127)) << e;
    uint8_t packed[16], scales[1] = {static_cast<uint8_t>(e)};
    for (int i = 0; i < 16; ++i) packed[i] = static_cast<uint8_t>(i | (((i + 5) & 15) << 4));
    float out[32];
    mxfp4::dequantize_row(packed, scales, 32, out);
    for (int i = 0; i < 32; ++i) {
      const int code = i % 2 == 0 ? i / 2 : ((i / 2 + 5) & 15);
      const double want = (code & 8 ? -1.0 : 1.0) * kE2M1[code & 7] * std::ldexp(1.0, e - 127);
      if (std::fabs(want) > FLT_MAX) {
        EXPECT_TRUE(std::isinf(out[i])) << "e " << e << " code " << code;
      } else {
        EXPECT_EQ(static_cast<double>(out[i]), want) << "e " << e << " code " << code;
        EXPECT_EQ(std::signbit(out[i]), (code & 8) != 0) << "e " << e << " code " << code;  // -0 stays -0
      }
    }
  }
}

TEST(Mxfp4, QuantizerFollowsTritonScaleRuleAndRoundsToNearestEven) {
  Rng r(5);
  std::vector<float> x(32 * 64);
  for (size_t i = 0; i < x.size(); ++i) {
    const int block = static_cast<int>(i / 32);
    x[i] = r.uniform(-1.f, 1.f) * std::ldexp(1.f, block % 40 - 20);  // magnitudes 2^-20 .. 2^19
  }
  for (int i = 0; i < 32; ++i) x[5 * 32 + i] = i % 3 == 0 ? -0.f : 0.f;  // an all-zero block
  for (int i = 0; i < 32; ++i) x[6 * 32 + i] = static_cast<float>(i % 13) * 0.25f;  // exact ties (x/s = 0.25 etc.)
  std::vector<uint8_t> q(x.size() / 2), s(x.size() / 32);
  mxfp4::quantize_row(x.data(), static_cast<int64_t>(x.size()), q.data(), s.data());
  for (size_t b = 0; b < s.size(); ++b) {
    double amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(double(x[b * 32 + i])));
    int e = 0;
    if (amax > 0) {
      const double d = static_cast<double>(static_cast<float>(amax) / 6.0f);  // the rule's fp32 division
      int ex;
      const double m = std::frexp(d, &ex);  // d = m 2^ex, m in [0.5, 1)
      e = 127 + (m == 0.5 ? ex - 1 : ex);   // 2^ceil(log2 d)
    }
    ASSERT_EQ(s[b], e) << "block " << b;
    for (int i = 0; i < 32; ++i) {
      const int64_t k = static_cast<int64_t>(b * 32 + i);
      const uint8_t got = nvfp4::nibble(q.data(), k);
      const uint8_t want = e == 0 ? static_cast<uint8_t>(std::signbit(x[k]) ? 8 : 0)
                                  : nearest_e2m1(double(x[k]) / std::ldexp(1.0, e - 127));
      ASSERT_EQ(got, want) << "block " << b << " element " << i << " x " << x[k];
    }
  }
  EXPECT_EQ(s[5], 0);  // amax 0 gives the scale 2^-127
  // A block holding NaN or Inf gets the NaN scale.
  x[7 * 32 + 3] = NAN;
  x[9 * 32] = -INFINITY;
  mxfp4::quantize_row(x.data(), static_cast<int64_t>(x.size()), q.data(), s.data());
  EXPECT_EQ(s[7], mxfp4::kScaleNaN);
  EXPECT_EQ(s[9], mxfp4::kScaleNaN);
  EXPECT_NE(s[8], mxfp4::kScaleNaN);
}

// One expert whose W1 block 0 of row 0 holds scale `e` and codes `code` (all other blocks: scale 120, codes random).
HostWeights one_block_weights(uint8_t e, uint8_t code) {
  HostWeights w = make_weights(1, 64, 64, 3, WeightFormat::MXFP4);
  w.w1_sf[0] = e;
  for (int i = 0; i < 16; ++i) w.w1_q[i] = nvfp4::pack2(code, code);
  return w;
}

TEST(Mxfp4, PrepareRefusesNaNScalesAndScalesOutsideTheExactRange) {
  auto prep = [](HostWeights w) { return prepare_weights(w.desc(), Backend::CPU); };
  try {
    prep(one_block_weights(255, 0));
    ADD_FAILURE() << "E8M0 255 accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.argument(), "w1_scale");
    EXPECT_NE(std::string(err.what()).find("255"), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("expert 0, row 0, block 0"), std::string::npos) << err.what();
  }
  HostWeights w2nan = make_weights(2, 64, 64, 3, WeightFormat::MXFP4);
  w2nan.w2_sf.back() = 255;
  expect_error([&] { prep(w2nan); }, "w2_scale");
  // Nonzero codes: only 10 .. 136 (2^-117 .. 2^9) are decoded exactly by every backend.
  for (int e : {0, 1, 9, 137, 200, 254}) expect_error([&] { prep(one_block_weights(static_cast<uint8_t>(e), 1)); }, "w1_scale");
  for (int e : {10, 127, 136}) EXPECT_NO_THROW(prep(one_block_weights(static_cast<uint8_t>(e), 9)));
  // A block of zeros (either sign) takes any scale but 255.
  for (int e : {0, 9, 137, 254}) {
    EXPECT_NO_THROW(prep(one_block_weights(static_cast<uint8_t>(e), 0)));
    EXPECT_NO_THROW(prep(one_block_weights(static_cast<uint8_t>(e), 8)));
  }
}

TEST(Mxfp4, PrepareRefusesWhatMxfp4DoesNotHave) {
  HostWeights w = make_weights(2, 64, 96, 4, WeightFormat::MXFP4);
  std::vector<float> s2 = {1.f, 1.f};
  WeightsDesc d = w.desc();
  d.w1_scale2 = make_view(s2.data(), DType::F32, {2});
  expect_error([&] { prepare_weights(d, Backend::CPU); }, "w1_scale2");
  d = w.desc();
  d.w2_scale2 = make_view(s2.data(), DType::F32, {2});
  expect_error([&] { prepare_weights(d, Backend::CPU); }, "w2_scale2");
  d = w.desc();
  d.scale_layout = ScaleLayout::Swizzled128x4;
  expect_error([&] { prepare_weights(d, Backend::CPU); }, "scale_layout");
  d = w.desc();
  d.w1_scale = make_view(w.w1_sf.data(), DType::E4M3, {2, 192, 2});
  expect_error([&] { prepare_weights(d, Backend::CPU); }, "w1_scale");
  // H and I must hold whole blocks of 32.
  HostWeights h48 = make_weights(1, 64, 64, 4, WeightFormat::MXFP4);
  d = h48.desc();
  d.hidden = 48;
  expect_error([&] { prepare_weights(d, Backend::CPU); }, "hidden");
  d = h48.desc();
  d.inter = 80;
  expect_error([&] { prepare_weights(d, Backend::CPU); }, "inter");
}

TEST(Mxfp4, A4IsRefusedNamingMode) {
  Case c = gpt_oss_mxfp4("mxfp4 A4", 4);
  c.T = 2;
  c.mode = ActMode::A4;
  Problem p(c);
  expect_error([&] { p.run(1); }, "mode", ErrorCode::Unsupported);
}

void check_dense(const Case& c) {
  SCOPED_TRACE(c.name);
  Problem p(c);
  const std::vector<double> got = p.run(2), want = p.dense();
  EXPECT_EQ(count_nonfinite(got), 0u);
  const double err = rel_l2(got, want);
  std::printf("[ mxfp4    ] %-44s rel_l2 %.3e (tol %.1e)\n", c.name.c_str(), err, c.tol);
  EXPECT_LE(err, c.tol);
  double norm = 0;
  for (double v : want) norm += v * v;
  EXPECT_GT(std::sqrt(norm / want.size()), 1e-2);  // the oracle can tell
}

// gpt_oss_120b, 8 experts, SwigluBias with its clamp, biases. A16 against the double oracle on the decoded
// weights: the bf16 roundings of a and of y remain (~1e-3).
TEST(Mxfp4, ReferenceGptOss120bA16MatchesDense) {
  Case c = gpt_oss_mxfp4("gpt_oss_120b mxfp4 A16 bias", 8);
  c.bias = true;
  c.T = 6;
  c.tol = 2.5e-3;
  c.seed = 11;
  check_dense(c);
  c.name += " Fp64";
  c.precision = Precision::Fp64;
  c.y_dtype = DType::F64;
  c.tol = 1e-6;
  check_dense(c);
}

TEST(Mxfp4, ReferenceUpFirstEpWindowAndMxfp4SharedExpert) {
  Case c{.name = "qwen3_30b_a3b_tp4 mxfp4 up_first EP shared", .shape = shape_named("qwen3_30b_a3b_tp4")};
  c.E_total = 16;
  c.E_loc = 8;
  c.offset = 8;
  c.format = WeightFormat::MXFP4;
  c.order = GateUpOrder::UpFirst;
  c.shared = true;
  c.shared_format = WeightFormat::MXFP4;
  c.shared_I = 256;
  c.per_expert_params = true;
  c.tol = 2.5e-3;
  c.seed = 12;
  check_dense(c);
}

TEST(Mxfp4, ReferenceWithLoraMatchesDense) {
  Case c = gpt_oss_mxfp4("gpt_oss_120b mxfp4 LoRA", 4);
  c.T = 4;
  c.tol = 1e-2;  // the bf16 roundings of the LoRA intermediates (SPEC §5), as test_reference_lora.cpp
  c.seed = 13;
  Problem p(c);
  const std::vector<double> base = p.dense();
  HostAdapter ad(LoraLayout::PeftFused, 8, c.E_loc, p.H, p.I, true, 14, false, 0);
  p.registry = std::make_unique<AdapterRegistry>(p.mw, 2);
  p.registry->load(1, ad.desc());
  p.host_adapters = {nullptr, &ad};
  p.adapter_ids = {1, -1, 1, 1};
  const std::vector<double> got = p.run(2), want = p.dense();
  EXPECT_LE(rel_l2(got, want), c.tol);
  EXPECT_GT(rel_l2(base, want), 0.05);  // the adapter matters
}

TEST(Mxfp4, ReferenceIsBatchInvariantBitForBit) {
  Case c = gpt_oss_mxfp4("gpt_oss_120b mxfp4 invariance", 8);
  c.bias = true;
  c.T = 7;
  c.seed = 15;
  Problem p(c);
  std::vector<uint8_t> batch;
  p.run(2, &batch);
  for (int64_t t : {int64_t(0), int64_t(3), p.T - 1}) {
    std::vector<uint16_t> xt(p.x.begin() + t * p.H, p.x.begin() + (t + 1) * p.H);
    std::vector<uint16_t> y(p.H, kBf16Poison);
    moe_run(p.mw, p.args(xt, 1, p.logits_f.data() + t * p.c.E_total, nullptr, y.data(), 1));
    EXPECT_EQ(0, std::memcmp(y.data(), batch.data() + t * p.H * 2, p.H * 2)) << "token " << t;
  }
}

TEST(Mxfp4, QuantizeWeightsRoundTripsAndPrepares) {
  const int64_t E = 2, H = 64, I = 96;
  std::vector<float> w1 = random_f32_vec(E * 2 * I * H, 21, -0.05f, 0.05f), w2 = random_f32_vec(E * H * I, 22, -0.1f, 0.1f);
  QuantizeOptions opt;
  opt.format = WeightFormat::MXFP4;
  OwnedWeights q = quantize_weights(make_view(w1.data(), DType::F32, {E, 2 * I, H}),
                                    make_view(w2.data(), DType::F32, {E, H, I}), opt);
  ASSERT_EQ(q.w1_scale.size(), static_cast<size_t>(E * 2 * I * H / 32));
  EXPECT_TRUE(q.w1_scale2.empty());
  const std::vector<float> d1 = dequantize_w1(q), d2 = dequantize_w2(q);
  auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
      den += double(b[i]) * b[i];
    }
    return std::sqrt(num / den);
  };
  EXPECT_LT(rel(d1, w1), 0.15);  // 4-bit values with power-of-two scales
  EXPECT_LT(rel(d2, w2), 0.15);
  EXPECT_NO_THROW(prepare_weights(q.desc(), Backend::CPU));
  opt.scale_layout = ScaleLayout::Swizzled128x4;
  expect_error([&] { quantize_weights(make_view(w1.data(), DType::F32, {E, 2 * I, H}),
                                      make_view(w2.data(), DType::F32, {E, H, I}), opt); }, "scale_layout");
}

}  // namespace
