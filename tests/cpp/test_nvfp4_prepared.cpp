// The prepared NVFP4 bits of the CUDA kernels (src/format/nvfp4_prepared.h), checked on the host: for every
// E2M1 code in every slot and every E4M3 scale, the kernels' decode (integer ops, then one bf16 multiply, then
// the fp32 sum times kProductScale) gives exactly E2M1 * E4M3 of the reference codecs, signed zeros and NaN
// included; and the same for MXFP4's E8M0 scales (mx_scale_pair) over the range prepare_weights admits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "format/nvfp4_prepared.h"
#include "fp4moe/mxfp4.h"
#include "fp4moe/nvfp4.h"

namespace pf = fp4moe::nvfp4_prepared;
namespace nv = fp4moe::nvfp4;

namespace {

float bf16_bits_to_float(uint32_t b16) {
  const uint32_t u = (b16 & 0xffffu) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
bool is_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0xffffu) == 0;
}

TEST(PreparedNvfp4, SlotsTileTheWord) {
  uint32_t seen = 0;
  for (int j = 0; j < 4; ++j)
    for (int h = 0; h < 2; ++h) {
      uint32_t x = 0;
      pf::place_value(x, j, h, 0xf);
      EXPECT_EQ(__builtin_popcount(x), 4);
      EXPECT_EQ(seen & x, 0u) << "slot " << j << " half " << h << " overlaps";
      seen |= x;
    }
  EXPECT_EQ(seen, 0xffffffffu);
}

TEST(PreparedNvfp4, EveryCodeTimesEveryScaleIsExact) {
  int checked = 0;
  for (int sc = 0; sc < 256; ++sc) {
    const pf::PreparedScale ps = pf::prepare_scale(static_cast<uint8_t>(sc));
    const float scale = nv::e4m3_decode(static_cast<uint8_t>(sc));
    for (int first = 0; first <= 2; first += 2)
      for (int which = 0; which < 2; ++which) {  // the scale as step `first` (low half) or `first + 1` (high)
        uint32_t k4 = 0xa8a8a8a8u;  // other bytes: the code of 1.0, must not leak
        k4 &= ~(0xffu << (8 * (first + which)));
        k4 |= static_cast<uint32_t>(ps.code) << (8 * (first + which));
        const uint32_t pair = pf::scale_pair(k4, first);
        const float s2 = bf16_bits_to_float(which ? pair >> 16 : pair);
        for (int code = 0; code < 16; ++code) {
          const uint8_t c = pf::prepare_value(static_cast<uint8_t>(code), ps);
          const float want = nv::e2m1_decode(static_cast<uint8_t>(code)) * scale;
          for (int j = 0; j < 4; ++j)
            for (int h = 0; h < 2; ++h) {
              uint32_t x = 0;
              pf::place_value(x, j, h, c);
              uint32_t d[4];
              pf::decode_slots(x, d);
              for (int o = 0; o < 4; ++o)
                if (o != j) ASSERT_EQ(d[o], 0u) << "slot " << j << " leaks into slot " << o;
              const float v = bf16_bits_to_float(h ? d[j] >> 16 : d[j]);
              ASSERT_EQ(bf16_bits_to_float(h ? d[j] : d[j] >> 16), 0.f);
              const float prod = v * s2;  // exact on the host; the kernels' bf16 multiply must be too
              const float got = prod * pf::kProductScale;
              if (std::isnan(want)) {
                ASSERT_TRUE(std::isnan(got)) << "scale " << sc << " code " << code;
              } else {
                ASSERT_TRUE(is_bf16(prod)) << "scale " << sc << " code " << code;
                ASSERT_EQ(got, want) << "scale " << sc << " code " << code << " slot " << j << " half " << h;
                ASSERT_EQ(std::signbit(got), std::signbit(want)) << "scale " << sc << " code " << code;
              }
              ++checked;
            }
        }
      }
  }
  EXPECT_EQ(checked, 256 * 2 * 2 * 16 * 8);
}

// The bf16 values the mma sees stay normal or exact subnormal-free: |w| * 2^-8 in [2^-18, 2^4) for nonzero w.
TEST(PreparedNvfp4, ScaledWeightsStayInRange) {
  for (int sc = 1; sc < 127; ++sc) {
    const pf::PreparedScale ps = pf::prepare_scale(static_cast<uint8_t>(sc));
    const float s2 = bf16_bits_to_float(pf::scale_pair(ps.code, 0));
    EXPECT_EQ(s2, nv::e4m3_decode(static_cast<uint8_t>(sc)) * std::ldexp(1.f, 118)) << sc;
    EXPECT_GE(std::fabs(0.5f * std::ldexp(1.f, -126) * s2), std::ldexp(1.f, -18));
    EXPECT_LT(std::fabs(6.f * std::ldexp(1.f, -126) * s2), 16.f);
  }
}

// MXFP4: the prepared row holds each E8M0 code for its two k16 steps ([e0, e0, e1, e1]); every code in every slot
// times every admitted scale is a normal bf16 and, times kProductScale, exactly e2m1 * 2^(e - 127).
TEST(PreparedNvfp4, Mxfp4EveryCodeTimesEveryAdmittedScaleIsExact) {
  int checked = 0;
  for (int e = fp4moe::mxfp4::kMinScaleCode; e <= fp4moe::mxfp4::kMaxScaleCode; ++e) {
    const uint8_t code_e = pf::prepare_mx_scale(static_cast<uint8_t>(e));
    ASSERT_EQ(code_e, e);
    for (int first = 0; first <= 2; first += 2) {
      const uint32_t other = 127u;  // the other block's scale must not leak
      const uint32_t k4 = first == 0 ? (code_e * 0x0101u) | (other * 0x01010000u) : (other * 0x0101u) | (code_e * 0x01010000u);
      const uint32_t pair = pf::mx_scale_pair(k4, first);
      ASSERT_EQ(pair & 0xffffu, pair >> 16) << "the two steps of one block share its scale";
      const float s2 = bf16_bits_to_float(pair);
      ASSERT_EQ(s2, std::ldexp(1.f, e - 127 + 118)) << e;
      for (int code = 0; code < 16; ++code)
        for (int j = 0; j < 4; ++j)
          for (int h = 0; h < 2; ++h) {
            uint32_t x = 0;
            pf::place_value(x, j, h, static_cast<uint8_t>(code));
            uint32_t d[4];
            pf::decode_slots(x, d);
            const float prod = bf16_bits_to_float(h ? d[j] >> 16 : d[j]) * s2;
            const float want = nv::e2m1_decode(static_cast<uint8_t>(code)) * fp4moe::mxfp4::e8m0_decode(static_cast<uint8_t>(e));
            ASSERT_TRUE(is_bf16(prod)) << "e " << e << " code " << code;
            if (code & 7) ASSERT_GE(std::fabs(prod), std::ldexp(1.f, -126)) << "normal bf16: e " << e << " code " << code;
            ASSERT_EQ(prod * pf::kProductScale, want) << "e " << e << " code " << code;
            ASSERT_EQ(std::signbit(prod), std::signbit(want)) << "e " << e << " code " << code;
            ++checked;
          }
    }
  }
  EXPECT_EQ(checked, 127 * 2 * 16 * 8);
  // Outside the range only blocks of zeros are admitted: they are stored under 127, whose products are +-0.
  for (int e : {0, 9, 137, 254}) EXPECT_EQ(pf::prepare_mx_scale(static_cast<uint8_t>(e)), 127);
}

}  // namespace
