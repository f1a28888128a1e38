// The weight-preparation step: canonical arrays from every accepted input form, and one refusal per
// validated field, each naming its argument.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "fp4moe/moe.h"
#include "fp4moe/nvfp4.h"
#include "fp4moe/quantize.h"
#include "runtime/prepared.h"

using namespace fp4moe;

namespace {

std::vector<float> random_f32(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Independent decoders of SPEC §2 (written from the SPEC, not from the codec under test).
float ref_e2m1(uint8_t code) {
  static const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return (code & 8) ? -mag[code & 7] : mag[code & 7];
}
float ref_e4m3(uint8_t code) {
  const int sign = code >> 7, exp = (code >> 3) & 0xf, man = code & 7;
  const float v = exp == 0 ? std::ldexp(man / 8.f, -6) : std::ldexp(1.f + man / 8.f, exp - 7);
  return sign ? -v : v;
}
// SPEC §2's swizzled offset formula, on its own.
int64_t ref_swizzled_offset(int64_t m, int64_t c, int64_t cols) {
  const int64_t nC = (cols + 3) / 4;
  return (m / 128) * nC * 512 + (c / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (c % 4);
}

struct Layer {
  int64_t E, H, I;
  bool gated;
  std::vector<float> w1, w2;  // [E, N1, H], [E, H, I]
  int64_t n1() const { return gated ? 2 * I : I; }
  TensorView w1_view() const { return make_view(const_cast<float*>(w1.data()), DType::F32, {E, n1(), H}); }
  TensorView w2_view() const { return make_view(const_cast<float*>(w2.data()), DType::F32, {E, H, I}); }
};

Layer random_layer(int64_t E, int64_t H, int64_t I, bool gated, uint32_t seed) {
  Layer l{E, H, I, gated, {}, {}};
  l.w1 = random_f32(static_cast<size_t>(E * l.n1() * H), seed, 0.05f);
  l.w2 = random_f32(static_cast<size_t>(E * H * I), seed + 1, 0.02f);
  // Make the up half of every expert ~8x larger than its gate half: per-half scales must differ.
  if (gated)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = I * H; i < 2 * I * H; ++i) l.w1[e * 2 * I * H + i] *= 8.f;
  return l;
}

// Expects prepare_weights(d) to throw `code` naming `arg`, with a message saying what was expected.
void expect_refused(const WeightsDesc& d, const std::string& arg, ErrorCode code = ErrorCode::InvalidArgument,
                    Backend backend = Backend::CPU, int device_id = 0) {
  try {
    prepare_weights(d, backend, device_id);
    ADD_FAILURE() << "expected a refusal naming '" << arg << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find("expected"), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Weights, LinearAndSwizzledScalesGiveIdenticalCanonicalArrays) {
  // N1 = 96 and H/16 = 5: neither a multiple of the 128x4 tile, so padding is exercised.
  const Layer l = random_layer(3, 80, 48, true, 11);
  QuantizeOptions opt;
  OwnedWeights lin = quantize_weights(l.w1_view(), l.w2_view(), opt);
  opt.scale_layout = ScaleLayout::Swizzled128x4;
  OwnedWeights swz = quantize_weights(l.w1_view(), l.w2_view(), opt);

  // The produced swizzled buffer follows SPEC §2's formula.
  const int64_t N1 = l.n1(), c1 = l.H / 16;
  const int64_t size1 = nvfp4::swizzled_size(N1, c1);
  ASSERT_EQ(size1, 128 * 8);
  for (int64_t e = 0; e < l.E; ++e)
    for (int64_t n = 0; n < N1; ++n)
      for (int64_t c = 0; c < c1; ++c)
        ASSERT_EQ(swz.w1_scale[e * size1 + ref_swizzled_offset(n, c, c1)], lin.w1_scale[(e * N1 + n) * c1 + c]);

  MoeWeights a = prepare_weights(lin.desc(), Backend::CPU);
  MoeWeights b = prepare_weights(swz.desc(), Backend::CPU);
  // A hand-built swizzled buffer (test's own formula, padding filled with garbage) as a 3-D padded view.
  const int64_t prow = 128, pcol = 8;
  std::vector<uint8_t> hand(static_cast<size_t>(l.E * prow * pcol), 0x33);
  for (int64_t e = 0; e < l.E; ++e)
    for (int64_t n = 0; n < N1; ++n)
      for (int64_t c = 0; c < c1; ++c)
        hand[e * prow * pcol + ref_swizzled_offset(n, c, c1)] = lin.w1_scale[(e * N1 + n) * c1 + c];
  WeightsDesc hd = swz.desc();
  hd.w1_scale = make_view(hand.data(), DType::E4M3, {l.E, prow, pcol});
  MoeWeights c = prepare_weights(hd, Backend::CPU);

  for (const MoeWeights* m : {&a, &b, &c}) {
    const PreparedWeights& p = m->impl();
    EXPECT_EQ(p.w1_q, lin.w1);
    EXPECT_EQ(p.w1_sf, lin.w1_scale);
    EXPECT_EQ(p.w2_q, lin.w2);
    EXPECT_EQ(p.w2_sf, lin.w2_scale);
    EXPECT_EQ(p.w1_s2, lin.w1_scale2);
    EXPECT_EQ(p.w2_s2, lin.w2_scale2);
    EXPECT_EQ(p.E, 3);
    EXPECT_EQ(p.H, 80);
    EXPECT_EQ(p.I, 48);
  }
}

TEST(Weights, QuantizedValuesDecodeCloseToTheOriginal) {
  const Layer l = random_layer(2, 64, 32, true, 12);
  OwnedWeights q = quantize_weights(l.w1_view(), l.w2_view());
  std::vector<float> d1 = dequantize_w1(q), d2 = dequantize_w2(q);
  const int64_t N1 = l.n1();
  double max_rel = 0;
  for (int64_t e = 0; e < l.E; ++e)
    for (int64_t n = 0; n < N1; ++n)
      for (int64_t k = 0; k < l.H; ++k) {
        const int64_t i = (e * N1 + n) * l.H + k;
        const uint8_t code = static_cast<uint8_t>((q.w1[i / 2] >> ((i & 1) * 4)) & 0xf);
        const float s2 = q.w1_scale2[2 * e + (n >= l.I)];
        const float v = ref_e2m1(code) * ref_e4m3(q.w1_scale[i / 16]) * s2;
        ASSERT_EQ(v, d1[i]);
        // Block amax * 1/6 quantization step bound: |err| <= amax_block / 6 * (0.5 + 1/16) roughly; use 1/4.
        float amax = 0;
        for (int64_t j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(l.w1[(i / 16) * 16 + j]));
        EXPECT_LE(std::fabs(v - l.w1[i]), amax / 4 + 1e-12f) << i;
        max_rel = std::max(max_rel, double(std::fabs(v - l.w1[i])) / amax);
      }
  EXPECT_GT(max_rel, 0.0);  // it really quantized
  for (size_t i = 0; i < d2.size(); ++i) {
    float amax = 0;
    for (size_t j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(l.w2[(i / 16) * 16 + j]));
    ASSERT_LE(std::fabs(d2[i] - l.w2[i]), amax / 4 + 1e-12f) << i;
  }
}

TEST(Weights, PerHalfGlobalScales) {
  const Layer l = random_layer(4, 32, 16, true, 13);
  OwnedWeights q = quantize_weights(l.w1_view(), l.w2_view());
  ASSERT_EQ(q.w1_scale2.size(), 8u);
  for (int64_t e = 0; e < l.E; ++e)
    for (int h = 0; h < 2; ++h) {
      float amax = 0;
      for (int64_t i = 0; i < l.I * l.H; ++i)
        amax = std::max(amax, std::fabs(l.w1[e * 2 * l.I * l.H + h * l.I * l.H + i]));
      EXPECT_EQ(q.w1_scale2[2 * e + h], 1.f / (448.f * 6.f / amax));
    }
  EXPECT_GT(q.w1_scale2[1], 4 * q.w1_scale2[0]);  // the up half is larger

  const PreparedWeights p = prepare_weights(q.desc(), Backend::CPU).impl();
  for (int64_t e = 0; e < l.E; ++e) {
    EXPECT_EQ(p.s1(e, 0), q.w1_scale2[2 * e]);
    EXPECT_EQ(p.s1(e, 1), q.w1_scale2[2 * e + 1]);
  }

  // One scale per expert ([E] and [E, 1]) is expanded to both halves.
  QuantizeOptions one;
  one.per_half_scale2 = false;
  OwnedWeights q1 = quantize_weights(l.w1_view(), l.w2_view(), one);
  ASSERT_EQ(q1.w1_scale2.size(), 4u);
  const PreparedWeights p1 = prepare_weights(q1.desc(), Backend::CPU).impl();
  WeightsDesc d = q1.desc();
  d.w1_scale2 = make_view(q1.w1_scale2.data(), DType::F32, {4, 1});
  const PreparedWeights p2 = prepare_weights(d, Backend::CPU).impl();
  for (int64_t e = 0; e < l.E; ++e)
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(p1.s1(e, h), q1.w1_scale2[e]);
      EXPECT_EQ(p2.s1(e, h), q1.w1_scale2[e]);
    }
}

TEST(Weights, UpFirstKeepsRowsAndScalesInTheWeightsOrder) {
  const Layer l = random_layer(2, 32, 16, true, 14);
  QuantizeOptions opt;
  opt.order = GateUpOrder::UpFirst;  // the rows of l.w1 are read as [up; gate]
  OwnedWeights q = quantize_weights(l.w1_view(), l.w2_view(), opt);
  MoeWeights m = prepare_weights(q.desc(), Backend::CPU);
  EXPECT_EQ(m.order(), GateUpOrder::UpFirst);
  const PreparedWeights& p = m.impl();
  EXPECT_EQ(p.w1_q, q.w1);
  // Half 0 (first rows = up here) carries the scale of the first rows.
  for (int64_t e = 0; e < l.E; ++e) {
    EXPECT_EQ(p.s1(e, 0), q.w1_scale2[2 * e]);
    EXPECT_EQ(p.s1(e, 1), q.w1_scale2[2 * e + 1]);
    EXPECT_NE(p.s1(e, 0), p.s1(e, 1));
  }
}

TEST(Weights, NonGatedAndBf16AndBias) {
  const Layer l = random_layer(2, 48, 32, false, 15);
  std::vector<float> b1 = random_f32(2 * 32, 16), b2 = random_f32(2 * 48, 17);
  QuantizeOptions opt;
  opt.gated = false;
  opt.format = WeightFormat::BF16;
  OwnedWeights q = quantize_weights(l.w1_view(), l.w2_view(), opt, make_view(b1.data(), DType::F32, {2, 32}),
                                    make_view(b2.data(), DType::F32, {2, 48}));
  MoeWeights m = prepare_weights(q.desc(), Backend::CPU);
  const PreparedWeights& p = m.impl();
  EXPECT_FALSE(m.gated());
  EXPECT_EQ(m.format(), WeightFormat::BF16);
  EXPECT_EQ(m.backend(), Backend::CPU);
  EXPECT_EQ(m.num_experts(), 2);
  EXPECT_EQ(m.hidden(), 48);
  EXPECT_EQ(m.inter(), 32);
  ASSERT_EQ(p.w1_bf16.size(), l.w1.size());
  for (size_t i = 0; i < l.w1.size(); ++i) ASSERT_EQ(bf16_bits_to_f32(p.w1_bf16[i]), round_bf16(l.w1[i]));
  for (size_t i = 0; i < l.w2.size(); ++i) ASSERT_EQ(bf16_bits_to_f32(p.w2_bf16[i]), round_bf16(l.w2[i]));
  EXPECT_EQ(p.w1_s2, std::vector<float>(2, 1.f));
  EXPECT_EQ(p.w2_s2, std::vector<float>(2, 1.f));
  EXPECT_EQ(p.bias1, b1);
  EXPECT_EQ(p.bias2, b2);

  // Non-gated NVFP4: one scale per expert.
  opt.format = WeightFormat::NVFP4;
  OwnedWeights n = quantize_weights(l.w1_view(), l.w2_view(), opt);
  const PreparedWeights pn = prepare_weights(n.desc(), Backend::CPU).impl();
  ASSERT_EQ(pn.w1_s2.size(), 2u);
  EXPECT_EQ(pn.s1(1, 0), n.w1_scale2[1]);
}

TEST(Weights, StridedViewsAreCopiedWithTheirStrides) {
  const Layer l = random_layer(2, 32, 16, true, 18);
  OwnedWeights q = quantize_weights(l.w1_view(), l.w2_view());
  const int64_t E = 2, N1 = 32, Hb = 16, pad = 5;
  // w1 inside a wider buffer: rows of Hb + pad bytes.
  std::vector<uint8_t> wide(static_cast<size_t>(E * N1 * (Hb + pad)), 0xee);
  for (int64_t r = 0; r < E * N1; ++r)
    for (int64_t k = 0; k < Hb; ++k) wide[r * (Hb + pad) + k] = q.w1[r * Hb + k];
  WeightsDesc d = q.desc();
  d.w1.data = wide.data();
  d.w1.stride[0] = N1 * (Hb + pad);
  d.w1.stride[1] = Hb + pad;
  d.w1.stride[2] = 1;
  // w2_scale2 read through a stride of 3 floats.
  std::vector<float> s2(static_cast<size_t>(3 * E), -1.f);
  for (int64_t e = 0; e < E; ++e) s2[3 * e] = q.w2_scale2[e];
  d.w2_scale2.data = s2.data();
  d.w2_scale2.stride[0] = 3;
  // w2 block scales stored transposed ([E, I/16, H] memory, viewed as [E, H, I/16]).
  const int64_t H = 32, c2 = 1;
  std::vector<uint8_t> t(q.w2_scale.size());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < c2; ++c) t[(e * c2 + c) * H + h] = q.w2_scale[(e * H + h) * c2 + c];
  d.w2_scale.data = t.data();
  d.w2_scale.stride[0] = c2 * H;
  d.w2_scale.stride[1] = 1;
  d.w2_scale.stride[2] = H;
  const PreparedWeights p = prepare_weights(d, Backend::CPU).impl();
  EXPECT_EQ(p.w1_q, q.w1);
  EXPECT_EQ(p.w2_s2, q.w2_scale2);
  EXPECT_EQ(p.w2_sf, q.w2_scale);
}

TEST(Weights, EveryValidatedFieldIsRefusedByName) {
  const Layer l = random_layer(2, 32, 16, true, 19);
  OwnedWeights q = quantize_weights(l.w1_view(), l.w2_view());
  const WeightsDesc good = q.desc();
  ASSERT_NO_THROW(prepare_weights(good, Backend::CPU));
  auto with = [&](const std::function<void(WeightsDesc&)>& f) {
    WeightsDesc d = good;
    f(d);
    return d;
  };
  std::vector<float> nan_s2 = q.w1_scale2;
  nan_s2[3] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> neg_s2 = q.w1_scale2;
  neg_s2[0] = -neg_s2[0];
  std::vector<float> zero_s2 = q.w2_scale2;
  zero_s2[1] = 0.f;
  std::vector<float> inf_s2 = q.w2_scale2;
  inf_s2[0] = std::numeric_limits<float>::infinity();
  std::vector<uint8_t> nan_sf = q.w1_scale;
  nan_sf[7] = 0x7f;
  std::vector<float> bias_bad(2 * 32, 0.f);
  bias_bad[5] = std::numeric_limits<float>::infinity();
  std::vector<float> bias_ok(2 * 32, 0.5f);

  expect_refused(with([](WeightsDesc& d) { d.format = static_cast<WeightFormat>(7); }), "format");
  expect_refused(with([](WeightsDesc& d) { d.order = static_cast<GateUpOrder>(2); }), "order");
  expect_refused(with([](WeightsDesc& d) { d.scale_layout = static_cast<ScaleLayout>(-1); }), "scale_layout");
  expect_refused(with([](WeightsDesc& d) { d.num_experts = 0; }), "num_experts");
  expect_refused(with([](WeightsDesc& d) { d.num_experts = 3; }), "w1");  // shapes say 2
  expect_refused(with([](WeightsDesc& d) { d.hidden = 40; }), "hidden");
  expect_refused(with([](WeightsDesc& d) { d.hidden = -16; }), "hidden");
  expect_refused(with([](WeightsDesc& d) { d.inter = 8; }), "inter");
  expect_refused(with([](WeightsDesc& d) { d.inter = 0; }), "inter");
  expect_refused(with([](WeightsDesc& d) { d.w1 = TensorView{}; }), "w1");
  expect_refused(with([](WeightsDesc& d) { d.w1.dtype = DType::BF16; }), "w1");
  expect_refused(with([](WeightsDesc& d) { d.w1.shape[1] = 16; }), "w1");
  expect_refused(with([](WeightsDesc& d) { d.w1.ndim = 9; }), "w1");
  expect_refused(with([](WeightsDesc& d) { d.w1.shape[2] = -16; }), "w1");
  expect_refused(with([](WeightsDesc& d) { d.w2.shape[2] = 16; }), "w2");
  expect_refused(with([](WeightsDesc& d) { d.w1_scale.shape[2] = 1; }), "w1_scale");
  expect_refused(with([](WeightsDesc& d) { d.w1_scale = TensorView{}; }), "w1_scale");
  expect_refused(with([&](WeightsDesc& d) { d.w1_scale.data = nan_sf.data(); }), "w1_scale");
  expect_refused(with([](WeightsDesc& d) { d.scale_layout = ScaleLayout::Swizzled128x4; }), "w1_scale");
  expect_refused(with([](WeightsDesc& d) { d.w2_scale.dtype = DType::F32; }), "w2_scale");
  expect_refused(with([&](WeightsDesc& d) { d.w1_scale2.data = nan_s2.data(); }), "w1_scale2");
  expect_refused(with([&](WeightsDesc& d) { d.w1_scale2.data = neg_s2.data(); }), "w1_scale2");
  expect_refused(with([](WeightsDesc& d) { d.w1_scale2.shape[1] = 3; }), "w1_scale2");
  expect_refused(with([](WeightsDesc& d) { d.w1_scale2.dtype = DType::BF16; }), "w1_scale2");
  expect_refused(with([&](WeightsDesc& d) { d.w2_scale2.data = zero_s2.data(); }), "w2_scale2");
  expect_refused(with([&](WeightsDesc& d) { d.w2_scale2.data = inf_s2.data(); }), "w2_scale2");
  expect_refused(with([](WeightsDesc& d) { d.w2_scale2.shape[0] = 1; }), "w2_scale2");
  expect_refused(with([&](WeightsDesc& d) { d.bias1 = make_view(bias_bad.data(), DType::F32, {2, 32}); }), "bias1");
  expect_refused(with([&](WeightsDesc& d) { d.bias1 = make_view(bias_ok.data(), DType::F32, {2, 16}); }), "bias1");
  expect_refused(with([&](WeightsDesc& d) { d.bias2 = make_view(bias_ok.data(), DType::I32, {2, 32}); }), "bias2");
  // Non-gated layers take one W1 scale per expert, and a W1 of I rows.
  expect_refused(with([](WeightsDesc& d) { d.gated = false; }), "w1");
  // BF16 weights carry no scales.
  expect_refused(with([](WeightsDesc& d) { d.format = WeightFormat::BF16; d.w1.dtype = DType::BF16; }), "w1");
  {
    QuantizeOptions bo;
    bo.format = WeightFormat::BF16;
    OwnedWeights b = quantize_weights(l.w1_view(), l.w2_view(), bo);
    WeightsDesc d = b.desc();
    d.w1_scale2 = good.w1_scale2;
    expect_refused(d, "w1_scale2");
  }
  // Devices and backends.
  expect_refused(with([](WeightsDesc& d) { d.w2.device = static_cast<Backend>(5); }), "w2");
  expect_refused(good, "backend", ErrorCode::InvalidArgument, static_cast<Backend>(3));
#ifndef FP4MOE_WITH_CUDA
  expect_refused(good, "backend", ErrorCode::Unsupported, Backend::CUDA);
  expect_refused(with([](WeightsDesc& d) { d.w1.device = Backend::CUDA; }), "w1", ErrorCode::Unsupported);
#else
  expect_refused(good, "device_id", ErrorCode::InvalidArgument, Backend::CUDA, -1);
#endif
}

TEST(Weights, QuantizeRefusesBadInput) {
  const Layer l = random_layer(1, 32, 16, true, 20);
  std::vector<float> w1 = l.w1;
  w1[3] = std::numeric_limits<float>::quiet_NaN();
  auto refused = [](const std::function<void()>& f, const std::string& arg) {
    try {
      f();
      ADD_FAILURE() << "expected a refusal naming " << arg;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
  };
  refused([&] { quantize_weights(make_view(w1.data(), DType::F32, {1, 32, 32}), l.w2_view()); }, "w1");
  refused([&] { quantize_weights(l.w1_view(), make_view(const_cast<float*>(l.w2.data()), DType::F32, {1, 32, 8})); },
          "w2");
  refused([&] { quantize_weights(make_view(w1.data(), DType::F32, {1, 32, 24}), l.w2_view()); }, "w1");
  refused([&] { quantize_weights(make_view(w1.data(), DType::I32, {1, 32, 32}), l.w2_view()); }, "w1");
}

TEST(Weights, EmptyMoeWeightsAccessorsThrow) {
  MoeWeights m;
  EXPECT_FALSE(m.valid());
  EXPECT_THROW(m.hidden(), Error);
}

#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>

namespace {
// A device copy of a host vector, freed at scope exit.
struct DeviceBuf {
  void* p = nullptr;
  template <class T> explicit DeviceBuf(const std::vector<T>& v) {
    if (cudaMalloc(&p, v.size() * sizeof(T)) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceBuf() { cudaFree(p); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
};
TensorView on_device(TensorView v, void* p) {
  v.data = p;
  v.device = Backend::CUDA;
  v.device_id = 0;
  return v;
}
}  // namespace

TEST(WeightsCuda, DeviceTensorsAreCopiedToTheHost) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  const Layer l = random_layer(3, 64, 32, true, 21);
  QuantizeOptions opt;
  opt.scale_layout = ScaleLayout::Swizzled128x4;
  OwnedWeights q = quantize_weights(l.w1_view(), l.w2_view(), opt);
  const PreparedWeights host = prepare_weights(q.desc(), Backend::CPU).impl();
  // w1 sits on the device inside a wider buffer (row stride H/2 + 3 bytes).
  const int64_t rows = 3 * 64, hb = 32, ld = hb + 3;
  std::vector<uint8_t> wide(static_cast<size_t>(rows * ld), 0xee);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < hb; ++k) wide[r * ld + k] = q.w1[r * hb + k];
  DeviceBuf w1(wide), w1s(q.w1_scale), w1s2(q.w1_scale2), w2(q.w2), w2s(q.w2_scale), w2s2(q.w2_scale2);
  WeightsDesc d = q.desc();
  d.w1 = on_device(d.w1, w1.p);
  d.w1.stride[0] = 64 * ld;
  d.w1.stride[1] = ld;
  d.w1_scale = on_device(d.w1_scale, w1s.p);
  d.w1_scale2 = on_device(d.w1_scale2, w1s2.p);
  d.w2 = on_device(d.w2, w2.p);
  d.w2_scale = on_device(d.w2_scale, w2s.p);
  d.w2_scale2 = on_device(d.w2_scale2, w2s2.p);
  const PreparedWeights dev = prepare_weights(d, Backend::CPU).impl();
  EXPECT_EQ(dev.w1_q, host.w1_q);
  EXPECT_EQ(dev.w1_sf, host.w1_sf);
  EXPECT_EQ(dev.w1_s2, host.w1_s2);
  EXPECT_EQ(dev.w2_q, host.w2_q);
  EXPECT_EQ(dev.w2_sf, host.w2_sf);
  EXPECT_EQ(dev.w2_s2, host.w2_s2);
  // The CUDA backend gets the same canonical arrays plus its own layout.
  MoeWeights cw = prepare_weights(d, Backend::CUDA, 0);
  EXPECT_EQ(cw.backend(), Backend::CUDA);
  EXPECT_EQ(cw.impl().w1_q, host.w1_q);
  EXPECT_NE(cw.impl().device, nullptr);
  expect_refused(q.desc(), "device_id", ErrorCode::InvalidArgument, Backend::CUDA, n);
}
#endif
