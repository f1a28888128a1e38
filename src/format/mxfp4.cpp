// MXFP4 host codecs (SPEC §2). The E2M1 rounding is nvfp4::e2m1_encode's (exact, ties to even); scales are
// powers of two, so dividing by one is exact.
#include "fp4moe/mxfp4.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "fp4moe/nvfp4.h"
#include "fp4moe/types.h"

namespace fp4moe::mxfp4 {
namespace {

void check_row_args(const void* a, const void* b, const void* c, int64_t K) {
  if (K < 0 || K % kBlock != 0)
    throw Error(ErrorCode::InvalidArgument, "K", "expected a non-negative multiple of 32, got " + std::to_string(K));
  if (K > 0 && (a == nullptr || b == nullptr || c == nullptr))
    throw Error(ErrorCode::InvalidArgument, "K", "null pointer");
}

// The E8M0 code of 2^ceil(log2(d)) for d = amax / 6 >= 0: d's exponent field, one up unless d is a power of two.
uint8_t round_up_scale(float d) {
  uint32_t u;
  std::memcpy(&u, &d, 4);
  return static_cast<uint8_t>(((u + 0x007fffffu) & 0x7f800000u) >> 23);
}

uint8_t quantize_block(const float* x, uint8_t* codes) {
  bool non_finite = false;
  const float amax = nvfp4::block_amax(x, kBlock, &non_finite);
  if (non_finite) {
    for (int i = 0; i < kBlock; ++i) codes[i] = 0;
    return kScaleNaN;
  }
  const uint8_t e = round_up_scale(amax / 6.0f);
  for (int i = 0; i < kBlock; ++i)  // e == 0 only for an all-zero block: the codes keep the zeros' signs
    codes[i] = nvfp4::e2m1_encode(e == 0 ? x[i] : std::ldexp(x[i], 127 - static_cast<int>(e)));
  return e;
}

}  // namespace

float e8m0_decode(uint8_t e) {
  if (e == kScaleNaN) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(e) - 127);
}

void quantize_row(const float* x, int64_t K, uint8_t* packed_out, uint8_t* scales_out) {
  check_row_args(x, packed_out, scales_out, K);
  uint8_t codes[kBlock];
  for (int64_t b = 0; b < K / kBlock; ++b) {
    scales_out[b] = quantize_block(x + b * kBlock, codes);
    for (int i = 0; i < kBlock / 2; ++i) packed_out[b * kBlock / 2 + i] = nvfp4::pack2(codes[2 * i], codes[2 * i + 1]);
  }
}

void dequantize_row(const uint8_t* packed, const uint8_t* scales, int64_t K, float* out) {
  check_row_args(packed, scales, out, K);
  for (int64_t i = 0; i < K; ++i)
    out[i] = nvfp4::e2m1_decode(nvfp4::nibble(packed, i)) * e8m0_decode(scales[i / kBlock]);
}

void quantize_matrix(const float* x, int64_t N, int64_t K, uint8_t* packed, uint8_t* scales) {
  for (int64_t n = 0; n < N; ++n) quantize_row(x + n * K, K, packed + n * (K / 2), scales + n * (K / kBlock));
}

void dequantize_matrix(const uint8_t* packed, const uint8_t* scales, int64_t N, int64_t K, float* out) {
  for (int64_t n = 0; n < N; ++n) dequantize_row(packed + n * (K / 2), scales + n * (K / kBlock), K, out + n * K);
}

}  // namespace fp4moe::mxfp4
