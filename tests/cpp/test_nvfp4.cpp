// Tests of the NVFP4 host codecs (SPEC §2). The encoders are checked against hand-worked
// values and against brute-force nearest-value searches written independently here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "fp4moe/nvfp4.h"
#include "fp4moe/types.h"

namespace nv = fp4moe::nvfp4;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- independent references -------------------------------------------------------------------
// E4M3 value from its definition: bias 7, 3 mantissa bits, exponent field 0 = subnormal,
// 0x7f/0xff = NaN.
double e4m3_value_literal(int code) {
  const int s = (code >> 7) & 1, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

// Nearest representable value by exhaustive search; ties go to the even code (mantissa
// LSB 0); beyond the largest magnitude, saturate. Computed in double, where the distances of
// an fp32 input to these grid points are exact.
uint8_t nearest_code(double x, const std::vector<double>& values /*positive codes, index = code*/, uint8_t sign_bit) {
  const double a = std::fabs(x);
  const uint8_t sign = std::signbit(x) ? sign_bit : 0;
  // Saturate first: for huge |x| the distances below would all round to the same double.
  if (a >= values.back()) return static_cast<uint8_t>(sign | (values.size() - 1));
  int best = 0;
  double best_d = std::fabs(a - values[0]);
  for (int c = 1; c < static_cast<int>(values.size()); ++c) {
    const double d = std::fabs(a - values[c]);
    if (d < best_d || (d == best_d && (c % 2 == 0) && (best % 2 == 1))) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

const std::vector<double>& e2m1_positive() {
  static const std::vector<double> v = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return v;
}
const std::vector<double>& e4m3_positive() {  // codes 0x00..0x7e
  static const std::vector<double> v = [] {
    std::vector<double> r;
    for (int c = 0; c < 0x7f; ++c) r.push_back(e4m3_value_literal(c));
    return r;
  }();
  return v;
}
uint8_t e2m1_ref(float x) { return nearest_code(x, e2m1_positive(), 8); }
uint8_t e4m3_ref(float x) { return nearest_code(x, e4m3_positive(), 0x80); }

// SPEC §2 block quantization, literally, with the brute-force encoders above.
void quantize_row_ref(const std::vector<float>& x, float gs, std::vector<uint8_t>& codes, std::vector<uint8_t>& sf) {
  const size_t K = x.size();
  codes.assign(K, 0);
  sf.assign(K / 16, 0);
  for (size_t b = 0; b < K / 16; ++b) {
    float amax = 0;
    for (size_t i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[b * 16 + i]));
    const float t = gs * amax;
    sf[b] = e4m3_ref(t / 6.0f);
    const float s = static_cast<float>(e4m3_value_literal(sf[b]));
    if (s == 0) continue;
    for (size_t i = 0; i < 16; ++i) {
      const float y = x[b * 16 + i] * gs;
      codes[b * 16 + i] = e2m1_ref(y / s);
    }
  }
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<uint8_t> unpack(const std::vector<uint8_t>& packed, size_t K) {
  std::vector<uint8_t> c(K);
  for (size_t k = 0; k < K; ++k) c[k] = nv::nibble(packed.data(), static_cast<int64_t>(k));
  return c;
}

}  // namespace

// ---- E2M1 ----------------------------------------------------------------------------------------
TEST(Nvfp4E2M1, DecodeTableIsSpec) {
  const float table[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    const float v = nv::e2m1_decode(static_cast<uint8_t>(c));
    EXPECT_EQ(v, c < 8 ? table[c] : -table[c - 8]) << "code " << c;
    EXPECT_EQ(std::signbit(v), c >= 8) << "code " << c;
  }
  // Only the low nibble matters.
  EXPECT_EQ(nv::e2m1_decode(0xf7), 6.0f);
}

TEST(Nvfp4E2M1, EveryCodeRoundTrips) {
  for (int c = 0; c < 16; ++c)
    EXPECT_EQ(nv::e2m1_encode(nv::e2m1_decode(static_cast<uint8_t>(c))), c) << "code " << c;
}

TEST(Nvfp4E2M1, HandWorkedTiesAndSaturation) {
  struct Case { float x; uint8_t code; };
  const Case cases[] = {
      {0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6},   // ties to even
      {-0.25f, 8}, {-0.75f, 10}, {-1.25f, 10}, {-1.75f, 12}, {-2.5f, 12}, {-3.5f, 14}, {-5.0f, 14},
      {0.2499f, 0}, {0.2501f, 1}, {0.7499f, 1}, {0.7501f, 2}, {4.99f, 6}, {5.01f, 7},
      {6.0f, 7}, {6.5f, 7}, {7.0f, 7}, {1e30f, 7}, {kInf, 7}, {-6.0f, 15}, {-1e30f, 15}, {-kInf, 15},
      {0.0f, 0}, {-0.0f, 8}, {1e-45f, 0}, {-1e-45f, 8},
  };
  for (const Case& c : cases) EXPECT_EQ(nv::e2m1_encode(c.x), c.code) << "x = " << c.x;
  // NaN has no E2M1 code: documented as +0.
  EXPECT_EQ(nv::e2m1_encode(kNaN), 0);
  EXPECT_EQ(nv::e2m1_encode(-kNaN), 0);
}

TEST(Nvfp4E2M1, MatchesBruteForceOnMidpointsAndRandom) {
  std::vector<float> xs;
  const auto& v = e2m1_positive();
  for (size_t i = 0; i + 1 < v.size(); ++i) {
    const float mid = static_cast<float>((v[i] + v[i + 1]) / 2);
    for (float m : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 10.0f)}) {
      xs.push_back(m);
      xs.push_back(-m);
    }
  }
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-8.0f, 8.0f);
  for (int i = 0; i < 200000; ++i) xs.push_back(u(rng));
  for (int i = 0; i < 200000; ++i) {  // arbitrary bit patterns (NaN excluded)
    uint32_t b = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &b, 4);
    if (!std::isnan(f)) xs.push_back(f);
  }
  int bad = 0;
  for (float x : xs)
    if (nv::e2m1_encode(x) != e2m1_ref(x) && ++bad < 10) ADD_FAILURE() << "x = " << x << " bits " << std::hex << bits(x);
  EXPECT_EQ(bad, 0);
}

// ---- E4M3 ----------------------------------------------------------------------------------------
TEST(Nvfp4E4M3, DecodeMatchesDefinition) {
  for (int c = 0; c < 256; ++c) {
    const float v = nv::e4m3_decode(static_cast<uint8_t>(c));
    const double ref = e4m3_value_literal(c);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(v)) << "code " << c;
    } else {
      EXPECT_EQ(static_cast<double>(v), ref) << "code " << c;
      EXPECT_EQ(std::signbit(v), c >= 128) << "code " << c;
    }
  }
  EXPECT_EQ(nv::e4m3_decode(0x7e), 448.0f);
  EXPECT_EQ(nv::e4m3_decode(0xfe), -448.0f);
  EXPECT_EQ(nv::e4m3_decode(0x38), 1.0f);
  EXPECT_EQ(nv::e4m3_decode(0x01), 0.001953125f);   // 2^-9, smallest subnormal
  EXPECT_EQ(nv::e4m3_decode(0x07), 0.013671875f);   // 7 * 2^-9, largest subnormal
  EXPECT_EQ(nv::e4m3_decode(0x08), 0.015625f);      // 2^-6, smallest normal
  EXPECT_TRUE(std::isnan(nv::e4m3_decode(0x7f)));
  EXPECT_TRUE(std::isnan(nv::e4m3_decode(0xff)));
}

TEST(Nvfp4E4M3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    // NaN codes round-trip too: NaN encodes as 0x7f with its sign kept.
    EXPECT_EQ(nv::e4m3_encode_satfinite(nv::e4m3_decode(code)), code) << "code " << c;
  }
}

TEST(Nvfp4E4M3, HandWorkedTiesSubnormalsAndSaturation) {
  const float q = 0.001953125f;  // 2^-9, the subnormal quantum
  struct Case { float x; uint8_t code; };
  const Case cases[] = {
      {1.0625f, 0x38}, {1.1875f, 0x3a}, {1.0625001f, 0x39}, {-1.0625f, 0xb8},  // ties in [1, 2): step 1/8
      {0.5f * q, 0x00}, {1.5f * q, 0x02}, {2.5f * q, 0x02}, {3.5f * q, 0x04},   // subnormal ties to even
      {7.5f * q, 0x08},                                                        // largest subnormal -> min normal
      {0.5000001f * q, 0x01}, {0.4999999f * q, 0x00}, {-1.5f * q, 0x82}, {q, 0x01}, {-q, 0x81},
      {1e-45f, 0x00}, {-1e-45f, 0x80}, {0.0f, 0x00}, {-0.0f, 0x80},
      {432.0f, 0x7e}, {431.99997f, 0x7d}, {416.0f, 0x7d}, {240.0f, 0x77}, {232.0f, 0x76}, {248.0f, 0x78},
      {448.0f, 0x7e}, {449.0f, 0x7e}, {464.0f, 0x7e}, {465.0f, 0x7e}, {1e30f, 0x7e}, {kInf, 0x7e},
      {-448.0f, 0xfe}, {-500.0f, 0xfe}, {-kInf, 0xfe},
  };
  for (const Case& c : cases) EXPECT_EQ(nv::e4m3_encode_satfinite(c.x), c.code) << "x = " << c.x;
  EXPECT_EQ(nv::e4m3_encode_satfinite(kNaN), 0x7f);
  EXPECT_EQ(nv::e4m3_encode_satfinite(-kNaN), 0xff);
}

TEST(Nvfp4E4M3, MatchesBruteForceOnMidpointsAndRandom) {
  std::vector<float> xs;
  const auto& v = e4m3_positive();
  for (size_t i = 0; i + 1 < v.size(); ++i) {
    const float mid = static_cast<float>((v[i] + v[i + 1]) / 2);  // exact in fp32
    for (float m : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
      xs.push_back(m);
      xs.push_back(-m);
    }
  }
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> log2mag(-14.0f, 10.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::exp2(log2mag(rng));
    xs.push_back(i % 2 ? x : -x);
  }
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &b, 4);
    if (!std::isnan(f)) xs.push_back(f);
  }
  int bad = 0;
  for (float x : xs)
    if (nv::e4m3_encode_satfinite(x) != e4m3_ref(x) && ++bad < 10)
      ADD_FAILURE() << "x = " << x << " bits " << std::hex << bits(x);
  EXPECT_EQ(bad, 0);
}

TEST(Nvfp4, ProductOfCodesIsExactInBf16) {
  // SPEC §2: e2m1 * e4m3 has at most 5 significant bits, so decoding to bf16 loses nothing.
  for (int a = 0; a < 16; ++a)
    for (int b = 0; b < 256; ++b) {
      const float p = nv::e2m1_decode(static_cast<uint8_t>(a)) * nv::e4m3_decode(static_cast<uint8_t>(b));
      if (std::isnan(p)) continue;
      EXPECT_EQ(bits(fp4moe::round_bf16(p)), bits(p)) << a << " x " << b;
      EXPECT_EQ(static_cast<double>(p), e2m1_positive()[a & 7] * (a & 8 ? -1 : 1) * e4m3_value_literal(b));
    }
}

// ---- packing ---------------------------------------------------------------------------------------
TEST(Nvfp4, PackingLowNibbleFirst) {
  EXPECT_EQ(nv::pack2(0x3, 0xa), 0xa3);
  EXPECT_EQ(nv::pack2(0x13, 0xfa), 0xa3);  // only the low nibbles are used
  const uint8_t packed[2] = {0xa3, 0x5c};
  EXPECT_EQ(nv::nibble(packed, 0), 0x3);
  EXPECT_EQ(nv::nibble(packed, 1), 0xa);
  EXPECT_EQ(nv::nibble(packed, 2), 0xc);
  EXPECT_EQ(nv::nibble(packed, 3), 0x5);
}

// ---- global scale ----------------------------------------------------------------------------------
TEST(Nvfp4, GlobalEncodeScale) {
  EXPECT_EQ(nv::global_encode_scale(2688.0f), 1.0f);
  EXPECT_EQ(nv::global_encode_scale(12.0f), 224.0f);
  EXPECT_EQ(nv::global_encode_scale(0.0f), 1.0f);
  EXPECT_EQ(nv::global_encode_scale(3.0f), 2688.0f / 3.0f);
  EXPECT_EQ(nv::global_encode_scale(1e-40f), std::numeric_limits<float>::max());
  EXPECT_THROW(nv::global_encode_scale(-1.0f), fp4moe::Error);
  EXPECT_THROW(nv::global_encode_scale(-kInf), fp4moe::Error);
  // A token holding NaN/Inf has no scale: NaN, which the quantizers propagate.
  EXPECT_TRUE(std::isnan(nv::global_encode_scale(kNaN)));
  EXPECT_TRUE(std::isnan(nv::global_encode_scale(kInf)));
}

TEST(Nvfp4Block, NaNEncodeScalePropagates) {
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = 0.1f * static_cast<float>(i - 16);
  std::vector<uint8_t> p(16, 0xee), s(2, 0xee);
  nv::quantize_row(x.data(), 32, kNaN, p.data(), s.data());
  EXPECT_EQ(s, (std::vector<uint8_t>{0x7f, 0x7f}));
  EXPECT_EQ(p, std::vector<uint8_t>(16, 0));
  std::vector<float> out(32, 0.0f);
  nv::fake_quantize_row(x.data(), 32, kNaN, kNaN, out.data());
  for (float v : out) EXPECT_TRUE(std::isnan(v));
  nv::dequantize_row(p.data(), s.data(), 32, 1.0f, out.data());
  for (float v : out) EXPECT_TRUE(std::isnan(v));
}

// ---- block quantization ------------------------------------------------------------------------------
namespace {
struct Quantized {
  std::vector<uint8_t> codes, sf;
  std::vector<float> deq;
};
Quantized quantize(const std::vector<float>& x, float gs) {
  const int64_t K = static_cast<int64_t>(x.size());
  std::vector<uint8_t> packed(K / 2, 0xee);
  Quantized q;
  q.sf.assign(K / 16, 0xee);
  nv::quantize_row(x.data(), K, gs, packed.data(), q.sf.data());
  q.codes = unpack(packed, K);
  q.deq.assign(K, -1.0f);
  nv::dequantize_row(packed.data(), q.sf.data(), K, 1.0f / gs, q.deq.data());
  return q;
}
}  // namespace

TEST(Nvfp4Block, HandWorkedUnitScale) {
  // gs = 1, amax = 6: sf = e4m3(1) = 0x38, so the codes are the plain E2M1 roundings.
  const std::vector<float> x = {6, -6, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -5, 0, -0.0f, 3, -0.5f, 4.9f, 5.1f};
  const std::vector<uint8_t> codes = {7, 15, 0, 2, 2, 4, 4, 6, 6, 14, 0, 8, 5, 9, 6, 7};
  const Quantized q = quantize(x, 1.0f);
  EXPECT_EQ(q.sf, std::vector<uint8_t>{0x38});
  EXPECT_EQ(q.codes, codes);
  const std::vector<float> deq = {6, -6, 0, 1, 1, 2, 2, 4, 4, -4, 0, -0.0f, 3, -0.5f, 4, 6};
  EXPECT_EQ(q.deq, deq);
}

TEST(Nvfp4Block, HandWorkedScales) {
  {  // gs = 224 (tensor amax 12), block amax 12: sf = e4m3(448) = 0x7e, q = x * 224 / 448 = x / 2.
    std::vector<float> x(16, 0.0f);
    x[0] = 12; x[1] = 1; x[2] = 0.5f; x[3] = -7; x[4] = 2.5f; x[5] = -11;
    const Quantized q = quantize(x, 224.0f);
    EXPECT_EQ(q.sf[0], 0x7e);
    EXPECT_EQ(q.codes[0], 7);    // 6
    EXPECT_EQ(q.codes[1], 1);    // 0.5
    EXPECT_EQ(q.codes[2], 0);    // 0.25 -> 0 (tie to even)
    EXPECT_EQ(q.codes[3], 14);   // -3.5 -> -4 (tie to even)
    EXPECT_EQ(q.codes[4], 2);    // 1.25 -> 1
    EXPECT_EQ(q.codes[5], 15);   // -5.5 -> -6
    EXPECT_FLOAT_EQ(q.deq[0], 12.0f);
    EXPECT_FLOAT_EQ(q.deq[3], -8.0f);
  }
  {  // gs = 1, block amax 9: sf = e4m3(1.5) = 0x3c exactly, q = x / 1.5.
    const std::vector<float> x = {9, 3, 2.25f, 0.75f, 1.5f, 3.75f, -4.5f, 0, 0, 0, 0, 0, 0, 0, 0, -9};
    const Quantized q = quantize(x, 1.0f);
    EXPECT_EQ(q.sf[0], 0x3c);
    const std::vector<uint8_t> expect = {7, 4, 3, 1, 2, 4, 13, 0, 0, 0, 0, 0, 0, 0, 0, 15};
    EXPECT_EQ(q.codes, expect);
  }
  {  // gs = 1, amax 7: 7/6 = 1.1667 rounds down to sf = 1.125 (0x39); 7/1.125 = 6.2 saturates.
    std::vector<float> x(16, 1.0f);
    x[7] = 7;
    const Quantized q = quantize(x, 1.0f);
    EXPECT_EQ(q.sf[0], 0x39);
    EXPECT_EQ(q.codes[7], 7);
    EXPECT_EQ(q.codes[0], 2);  // 1/1.125 = 0.889 -> 1
    EXPECT_FLOAT_EQ(q.deq[7], 6.75f);
  }
  {  // subnormal block scale: amax = 18 * 2^-9, sf = 3 * 2^-9 = code 0x03.
    std::vector<float> x(16, 0.0f);
    x[0] = 18 * 0.001953125f;
    x[1] = -3 * 0.001953125f;
    const Quantized q = quantize(x, 1.0f);
    EXPECT_EQ(q.sf[0], 0x03);
    EXPECT_EQ(q.codes[0], 7);
    EXPECT_EQ(q.codes[1], 10);  // -1
    EXPECT_EQ(q.deq[1], -3 * 0.001953125f);
  }
}

TEST(Nvfp4Block, ZeroBlockAndUnderflowingScale) {
  std::vector<float> x(48, 0.0f);
  // Block 1: amax/6 = 0.0008 < 2^-10 (half the smallest E4M3 subnormal): sf rounds to 0.
  for (int i = 16; i < 32; ++i) x[i] = (i % 2 ? 0.005f : -0.003f);
  // Block 2: ordinary values, so the row is not all zeros.
  for (int i = 32; i < 48; ++i) x[i] = 0.25f * static_cast<float>(i - 40);
  const Quantized q = quantize(x, 1.0f);
  EXPECT_EQ(q.sf[0], 0x00);
  EXPECT_EQ(q.sf[1], 0x00);
  EXPECT_NE(q.sf[2], 0x00);
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(q.codes[i], 0) << i;
    EXPECT_EQ(q.deq[i], 0.0f) << i;
  }
  std::vector<uint8_t> ref_codes, ref_sf;
  quantize_row_ref(x, 1.0f, ref_codes, ref_sf);
  EXPECT_EQ(q.codes, ref_codes);
  EXPECT_EQ(q.sf, ref_sf);
}

TEST(Nvfp4Block, NonFiniteBlockDecodesToNaNOthersUntouched) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(64);
  for (float& v : x) v = nd(rng);
  std::vector<float> clean = x;
  x[5] = kNaN;
  x[40] = -kInf;
  const Quantized q = quantize(x, 100.0f);
  const Quantized qc = quantize(clean, 100.0f);
  EXPECT_EQ(q.sf[0], 0x7f);
  EXPECT_EQ(q.sf[2], 0x7f);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(q.codes[i], 0) << i;
  for (int i = 32; i < 48; ++i) EXPECT_EQ(q.codes[i], 0) << i;
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(std::isnan(q.deq[i])) << i;
  for (int i = 32; i < 48; ++i) EXPECT_TRUE(std::isnan(q.deq[i])) << i;
  for (int i : {16, 17, 30, 31, 48, 63}) EXPECT_EQ(bits(q.deq[i]), bits(qc.deq[i])) << i;
  EXPECT_EQ(q.sf[1], qc.sf[1]);
  EXPECT_EQ(q.sf[3], qc.sf[3]);
}

TEST(Nvfp4Block, RandomRowsMatchLiteralSpecAndErrorBound) {
  std::mt19937 rng(20240611);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_ratio(-3.0f, 0.0f);
  const int64_t K = 1024;
  double worst_rel = 0;
  for (int row = 0; row < 200; ++row) {
    std::vector<float> x(K);
    for (int64_t b = 0; b < K / 16; ++b) {
      const float mag = std::pow(10.0f, log_ratio(rng));  // blocks of very different size
      for (int i = 0; i < 16; ++i) x[b * 16 + i] = mag * nd(rng);
    }
    if (row % 10 == 0) for (int i = 0; i < 16; ++i) x[16 + i] *= 1e-6f;  // subnormal / underflowing scales
    float amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    const float gs = nv::global_encode_scale(amax);
    const Quantized q = quantize(x, gs);

    std::vector<uint8_t> ref_codes, ref_sf;
    quantize_row_ref(x, gs, ref_codes, ref_sf);
    ASSERT_EQ(q.sf, ref_sf) << "row " << row;
    ASSERT_EQ(q.codes, ref_codes) << "row " << row;

    for (int64_t b = 0; b < K / 16; ++b) {
      float bmax = 0;
      for (int i = 0; i < 16; ++i) bmax = std::max(bmax, std::fabs(x[b * 16 + i]));
      const double sf_exact = static_cast<double>(gs) * bmax / 6;
      if (sf_exact < 0.015625) continue;  // subnormal scales: covered by the bit-exact check above
      for (int i = 0; i < 16; ++i) {
        const int64_t k = b * 16 + i;
        // Half the largest E2M1 step (1, between 4 and 6) is 1/6 of the block maximum; the
        // E4M3 scale rounding (relative <= 1/16) can stretch it by 1/16 at most; saturation
        // when the scale rounds down costs at most 6/(15/16) - 6 = 0.4 < 1 step units.
        const double err = std::fabs(static_cast<double>(x[k]) - q.deq[k]);
        const double rel = err / bmax;
        worst_rel = std::max(worst_rel, rel);
        EXPECT_LE(rel, (1.0 / 6) * (17.0 / 16) + 1e-6) << "row " << row << " k " << k;
      }
    }
  }
  EXPECT_GT(worst_rel, 0.01);  // the data did exercise rounding
}

TEST(Nvfp4Block, FakeQuantizeAndMatrixAgreeWithRows) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const int64_t N = 5, K = 96;
  std::vector<float> x(N * K);
  for (float& v : x) v = nd(rng);
  const float gs = nv::global_encode_scale(20.0f), scale2 = 1.0f / gs;
  std::vector<uint8_t> packed(N * K / 2), sf(N * K / 16);
  nv::quantize_matrix(x.data(), N, K, gs, packed.data(), sf.data());
  std::vector<float> deq(N * K);
  nv::dequantize_matrix(packed.data(), sf.data(), N, K, scale2, deq.data());
  for (int64_t n = 0; n < N; ++n) {
    std::vector<uint8_t> p(K / 2), s(K / 16);
    nv::quantize_row(x.data() + n * K, K, gs, p.data(), s.data());
    EXPECT_TRUE(std::equal(p.begin(), p.end(), packed.begin() + n * K / 2));
    EXPECT_TRUE(std::equal(s.begin(), s.end(), sf.begin() + n * K / 16));
    std::vector<float> fq(K);
    nv::fake_quantize_row(x.data() + n * K, K, gs, scale2, fq.data());
    for (int64_t k = 0; k < K; ++k) EXPECT_EQ(bits(fq[k]), bits(deq[n * K + k]));
    // In place.
    std::vector<float> inplace(x.begin() + n * K, x.begin() + (n + 1) * K);
    nv::fake_quantize_row(inplace.data(), K, gs, scale2, inplace.data());
    EXPECT_EQ(inplace, fq);
  }
}

TEST(Nvfp4Block, RejectsBadArguments) {
  std::vector<float> x(32, 1.0f), out(32);
  std::vector<uint8_t> p(16), s(2);
  auto arg_of = [](auto&& fn) {
    try {
      fn();
    } catch (const fp4moe::Error& e) {
      EXPECT_EQ(e.code(), fp4moe::ErrorCode::InvalidArgument);
      return e.argument();
    }
    return std::string("<no error>");
  };
  EXPECT_EQ(arg_of([&] { nv::quantize_row(x.data(), 15, 1.0f, p.data(), s.data()); }), "K");
  EXPECT_EQ(arg_of([&] { nv::quantize_row(x.data(), -16, 1.0f, p.data(), s.data()); }), "K");
  EXPECT_EQ(arg_of([&] { nv::quantize_row(x.data(), 32, 0.0f, p.data(), s.data()); }), "gs");
  EXPECT_EQ(arg_of([&] { nv::quantize_row(x.data(), 32, -2.0f, p.data(), s.data()); }), "gs");
  EXPECT_EQ(arg_of([&] { nv::quantize_row(x.data(), 32, -kInf, p.data(), s.data()); }), "gs");
  EXPECT_EQ(arg_of([&] { nv::dequantize_row(p.data(), s.data(), 32, kInf, out.data()); }), "scale2");
  EXPECT_EQ(arg_of([&] { nv::quantize_row(x.data(), 32, kInf, p.data(), s.data()); }), "gs");
  EXPECT_EQ(arg_of([&] { nv::quantize_row(nullptr, 32, 1.0f, p.data(), s.data()); }), "x");
  EXPECT_EQ(arg_of([&] { nv::dequantize_row(p.data(), s.data(), 32, -1.0f, out.data()); }), "scale2");
  EXPECT_EQ(arg_of([&] { nv::dequantize_row(p.data(), nullptr, 32, 1.0f, out.data()); }), "sf");
  EXPECT_EQ(arg_of([&] { nv::fake_quantize_row(x.data(), 32, 1.0f, 0.0f, out.data()); }), "scale2");
  EXPECT_EQ(arg_of([&] { nv::quantize_matrix(x.data(), -1, 16, 1.0f, p.data(), s.data()); }), "N");
  EXPECT_EQ(arg_of([&] { nv::quantize_matrix(x.data(), 2, 8, 1.0f, p.data(), s.data()); }), "K");
  EXPECT_EQ(arg_of([&] { nv::dequantize_matrix(p.data(), s.data(), 1, 17, 1.0f, out.data()); }), "K");
  EXPECT_EQ(arg_of([&] { nv::swizzled_offset(0, 4, 3); }), "c");
  EXPECT_EQ(arg_of([&] { nv::swizzled_offset(-1, 0, 3); }), "m");
  EXPECT_EQ(arg_of([&] { nv::swizzled_rows(-1); }), "rows");
  // Empty inputs are fine and touch nothing.
  nv::quantize_row(nullptr, 0, 1.0f, nullptr, nullptr);
  nv::quantize_matrix(nullptr, 0, 32, 1.0f, nullptr, nullptr);
}

// ---- 128x4 swizzled layout ----------------------------------------------------------------------------
namespace {
// SPEC §2 read literally, with K = 16 * cols: nC = ceil(K/16/4).
int64_t spec_offset(int64_t m, int64_t c, int64_t K) {
  const int64_t nC = (K / 16 + 3) / 4;
  return (m / 128) * nC * 512 + (c / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (c % 4);
}
}  // namespace

TEST(Nvfp4Swizzle, OffsetFormulaAndBijection) {
  EXPECT_EQ(nv::swizzled_offset(0, 0, 5), 0);
  EXPECT_EQ(nv::swizzled_offset(0, 1, 5), 1);
  EXPECT_EQ(nv::swizzled_offset(1, 0, 5), 16);
  EXPECT_EQ(nv::swizzled_offset(32, 0, 5), 4);
  EXPECT_EQ(nv::swizzled_offset(0, 4, 5), 512);
  EXPECT_EQ(nv::swizzled_offset(128, 0, 5), 1024);  // nC = 2 tiles of 512 per 128 rows
  EXPECT_EQ(nv::swizzled_offset(127, 3, 5), 31 * 16 + 3 * 4 + 3);
  const int64_t shapes[][2] = {{1, 1}, {127, 3}, {128, 4}, {129, 5}, {200, 7}, {256, 8}, {300, 13}, {33, 180}};
  for (const auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1];
    const int64_t pr = nv::swizzled_rows(rows), pc = nv::swizzled_cols(cols);
    EXPECT_EQ(pr % 128, 0);
    EXPECT_EQ(pc % 4, 0);
    EXPECT_LT(pr - rows, 128);
    EXPECT_LT(pc - cols, 4);
    EXPECT_EQ(nv::swizzled_size(rows, cols), pr * pc);
    std::vector<int> hits(pr * pc, 0);
    for (int64_t m = 0; m < pr; ++m)
      for (int64_t c = 0; c < pc; ++c) {
        const int64_t off = nv::swizzled_offset(m, c, cols);
        ASSERT_EQ(off, spec_offset(m, c, cols * 16)) << rows << "x" << cols << " m " << m << " c " << c;
        ASSERT_GE(off, 0);
        ASSERT_LT(off, pr * pc);
        ++hits[off];
      }
    for (int h : hits) ASSERT_EQ(h, 1) << rows << "x" << cols;
  }
}

TEST(Nvfp4Swizzle, RoundTripAndZeroPadding) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> byte(1, 255);  // never 0, so padding is recognizable
  const int64_t shapes[][2] = {{1, 1}, {7, 3}, {127, 3}, {128, 4}, {129, 5}, {200, 7}, {300, 13}, {0, 5}, {5, 0}};
  for (const auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1];
    std::vector<uint8_t> linear(rows * cols);
    for (auto& b : linear) b = static_cast<uint8_t>(byte(rng));
    const int64_t size = nv::swizzled_size(rows, cols);
    std::vector<uint8_t> sw(size, 0xaa);
    nv::swizzle_scales(linear.data(), rows, cols, sw.data());
    // Every real entry sits where the SPEC formula says; everything else is 0.
    std::vector<bool> real(size, false);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t off = spec_offset(m, c, cols * 16);
        EXPECT_EQ(sw[off], linear[m * cols + c]);
        real[off] = true;
      }
    for (int64_t i = 0; i < size; ++i)
      if (!real[i]) {
        ASSERT_EQ(sw[i], 0) << rows << "x" << cols << " offset " << i;
      }
    std::vector<uint8_t> back(rows * cols, 0);
    nv::unswizzle_scales(sw.data(), rows, cols, back.data());
    EXPECT_EQ(back, linear) << rows << "x" << cols;
  }
}
