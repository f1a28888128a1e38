// NVFP4 host codecs (SPEC §2). Every rounding here is done with exact integer/float steps so
// the result does not depend on the FPU rounding mode or on compiler contraction.
#include "fp4moe/nvfp4.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "fp4moe/types.h"

namespace fp4moe::nvfp4 {
namespace {

[[noreturn]] void invalid(const char* arg, const std::string& what) {
  throw Error(ErrorCode::InvalidArgument, arg, what);
}

// Round a value v in [0, 2^23) to the nearest integer, ties to even. Exact: for such v the
// truncation and the remainder are representable, so no rounding happens on the way.
uint32_t round_half_even(float v) {
  const auto n = static_cast<uint32_t>(v);  // floor for v >= 0
  const float frac = v - static_cast<float>(n);
  if (frac > 0.5f || (frac == 0.5f && (n & 1u))) return n + 1;
  return n;
}

// Shared rounding for a small binary float format with `mant_bits` mantissa bits and
// minimum normal exponent `min_exp`. `a` must be finite, >= 0 and no larger than the
// format's largest finite value (callers saturate first). Returns the magnitude code
// (exponent field << mant_bits | mantissa), the carry out of the mantissa moving into the
// exponent field by plain addition.
uint32_t round_magnitude(float a, int mant_bits, int min_exp) {
  if (a == 0.0f) return 0;
  int e = std::ilogb(a);  // floor(log2 a), exact also for fp32 subnormals
  if (e < min_exp) e = min_exp;  // subnormal range: fixed quantum 2^(min_exp - mant_bits)
  // v = a / 2^e * 2^mant_bits is in [0, 2^(mant_bits+1)); scaling by a power of two is exact.
  const float v = std::ldexp(a, mant_bits - e);
  const uint32_t n = round_half_even(v);  // n == 2^(mant_bits+1) carries into the exponent
  return static_cast<uint32_t>(e - min_exp) * (1u << mant_bits) + n;
}

bool sign_bit(float x) { return std::signbit(x); }

void check_row_args(const void* a, const char* a_name, const void* b, const char* b_name, const void* c,
                    const char* c_name, int64_t K) {
  if (K < 0 || K % kBlock != 0)
    invalid("K", "expected a non-negative multiple of 16, got " + std::to_string(K));
  if (K > 0) {
    if (a == nullptr) invalid(a_name, "null pointer");
    if (b == nullptr) invalid(b_name, "null pointer");
    if (c == nullptr) invalid(c_name, "null pointer");
  }
}

// A scale must be finite and positive, or NaN: NaN is data, not a usage error (the encode scale
// of a token whose amax is NaN/Inf, see global_encode_scale) and makes everything decode to NaN.
void check_scale(const char* name, float s) {
  if (std::isnan(s)) return;
  if (std::isinf(s) || !(s > 0.0f))
    invalid(name, "expected a finite positive scale (or NaN), got " + std::to_string(s));
}

// Quantize one block of 16 values. Returns the E4M3 scale code; writes 16 E2M1 codes.
// A block whose absolute maximum is NaN or Inf, or any block under a NaN encode scale, gets the
// NaN scale (0x7f) and all-zero codes (what e2m1(x * gs / NaN) gives), so the whole block
// decodes to NaN: non-finite input propagates instead of being saturated away.
uint8_t quantize_block(const float* x, float gs, uint8_t* codes) {
  bool non_finite = std::isnan(gs);
  const float amax = block_amax(x, kBlock, &non_finite);
  if (non_finite) {
    for (int i = 0; i < kBlock; ++i) codes[i] = 0;
    return 0x7f;
  }
  // SPEC §2, evaluated left to right in fp32: (gs * amax) / 6.
  const float t = gs * amax;
  const uint8_t sf = e4m3_encode_satfinite(t / 6.0f);
  const float sf_value = e4m3_decode(sf);
  if (sf_value == 0.0f) {
    for (int i = 0; i < kBlock; ++i) codes[i] = 0;
    return sf;
  }
  for (int i = 0; i < kBlock; ++i) {
    const float scaled = x[i] * gs;  // (x * gs) / sf, exact IEEE division
    codes[i] = e2m1_encode(scaled / sf_value);
  }
  return sf;
}

}  // namespace

float block_amax(const float* x, int n, bool* non_finite) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (!std::isfinite(a)) *non_finite = true;
    else if (a > amax) amax = a;
  }
  return amax;
}

// ---- E2M1 -----------------------------------------------------------------------------------
float e2m1_decode(uint8_t code) {
  static constexpr float kValues[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kValues[code & 7];
  return (code & 8) ? -v : v;
}

uint8_t e2m1_encode(float x) {
  // NaN has no E2M1 code; it encodes as +0 (docs/numerics.md). In a quantized block NaN is
  // carried by the block scale instead.
  if (std::isnan(x)) return 0;
  const uint8_t sign = sign_bit(x) ? 8 : 0;
  const float a = std::fabs(x);
  if (a >= kE2M1Max) return sign | 7;  // saturate (also +-Inf)
  // E2M1: 1 mantissa bit, minimum normal exponent 0 (bias 1).
  return static_cast<uint8_t>(sign | round_magnitude(a, 1, 0));
}

// ---- E4M3 (float8_e4m3fn) ---------------------------------------------------------------------
float e4m3_decode(uint8_t code) {
  const uint32_t exp = (code >> 3) & 0xf;
  const uint32_t man = code & 7;
  float v;
  if (exp == 0xf && man == 7) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man * 2^-9
  } else {
    v = std::ldexp(static_cast<float>(8 + man), static_cast<int>(exp) - 10);  // (1 + m/8) 2^(e-7)
  }
  return (code & 0x80) ? -v : v;
}

uint8_t e4m3_encode_satfinite(float x) {
  const uint8_t sign = sign_bit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7f;  // NaN keeps its sign, as ml_dtypes and CUDA's cvt
  const float a = std::fabs(x);
  if (a >= kE4M3Max) return sign | 0x7e;  // satfinite: +-448 (also +-Inf)
  // E4M3: 3 mantissa bits, minimum normal exponent -6 (bias 7).
  return static_cast<uint8_t>(sign | round_magnitude(a, 3, -6));
}

// ---- scales, rows, matrices ---------------------------------------------------------------------
float global_encode_scale(float amax) {
  // A NaN/Inf amax comes from data (a token holding NaN/Inf): no scale exists, and NaN lets the
  // quantizers propagate it. A negative amax is a usage error.
  if (std::isnan(amax) || std::isinf(amax)) {
    if (amax < 0.0f) invalid("amax", "expected a non-negative absolute maximum, got -inf");
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (amax < 0.0f) invalid("amax", "expected a non-negative absolute maximum, got " + std::to_string(amax));
  if (amax == 0.0f) return 1.0f;
  const float gs = (kE4M3Max * kE2M1Max) / amax;  // 2688 / amax in fp32
  // A tiny amax (< 2688 / FLT_MAX) would overflow: keep the scale finite.
  return std::isfinite(gs) ? gs : std::numeric_limits<float>::max();
}

void quantize_row(const float* x, int64_t K, float gs, uint8_t* packed_out, uint8_t* sf_out) {
  check_row_args(x, "x", packed_out, "packed_out", sf_out, "sf_out", K);
  check_scale("gs", gs);
  uint8_t codes[kBlock];
  for (int64_t b = 0; b < K / kBlock; ++b) {
    sf_out[b] = quantize_block(x + b * kBlock, gs, codes);
    for (int i = 0; i < kBlock; i += 2) packed_out[b * (kBlock / 2) + i / 2] = pack2(codes[i], codes[i + 1]);
  }
}

void dequantize_row(const uint8_t* packed, const uint8_t* sf, int64_t K, float scale2, float* out) {
  check_row_args(packed, "packed", sf, "sf", out, "out", K);
  check_scale("scale2", scale2);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float s = e4m3_decode(sf[b]);
    for (int i = 0; i < kBlock; ++i) {
      const int64_t k = b * kBlock + i;
      // e2m1 * e4m3 is exact (<= 5 significant bits); one rounding, by scale2.
      out[k] = (e2m1_decode(nibble(packed, k)) * s) * scale2;
    }
  }
}

void fake_quantize_row(const float* x, int64_t K, float gs, float scale2, float* out) {
  check_row_args(x, "x", out, "out", x, "x", K);
  check_scale("gs", gs);
  check_scale("scale2", scale2);
  // Block by block through local buffers, so out may alias x.
  uint8_t codes[kBlock];
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float s = e4m3_decode(quantize_block(x + b * kBlock, gs, codes));
    for (int i = 0; i < kBlock; ++i) out[b * kBlock + i] = (e2m1_decode(codes[i]) * s) * scale2;
  }
}

void quantize_matrix(const float* x, int64_t N, int64_t K, float gs, uint8_t* packed, uint8_t* sf_linear) {
  if (N < 0) invalid("N", "expected N >= 0, got " + std::to_string(N));
  check_row_args(x, "x", packed, "packed", sf_linear, "sf_linear", N == 0 ? 0 : K);
  if (K % kBlock != 0 || K < 0) invalid("K", "expected a non-negative multiple of 16, got " + std::to_string(K));
  check_scale("gs", gs);
  for (int64_t n = 0; n < N; ++n)
    quantize_row(x + n * K, K, gs, packed + n * (K / 2), sf_linear + n * (K / kBlock));
}

void dequantize_matrix(const uint8_t* packed, const uint8_t* sf_linear, int64_t N, int64_t K, float scale2,
                       float* out) {
  if (N < 0) invalid("N", "expected N >= 0, got " + std::to_string(N));
  check_row_args(packed, "packed", sf_linear, "sf_linear", out, "out", N == 0 ? 0 : K);
  if (K % kBlock != 0 || K < 0) invalid("K", "expected a non-negative multiple of 16, got " + std::to_string(K));
  check_scale("scale2", scale2);
  for (int64_t n = 0; n < N; ++n)
    dequantize_row(packed + n * (K / 2), sf_linear + n * (K / kBlock), K, scale2, out + n * K);
}

// ---- 128x4 swizzled scale layout ----------------------------------------------------------------
int64_t swizzled_rows(int64_t rows) {
  if (rows < 0) invalid("rows", "expected rows >= 0, got " + std::to_string(rows));
  return (rows + 127) / 128 * 128;
}

int64_t swizzled_cols(int64_t cols) {
  if (cols < 0) invalid("cols", "expected cols >= 0, got " + std::to_string(cols));
  return (cols + 3) / 4 * 4;
}

int64_t swizzled_size(int64_t rows, int64_t cols) { return swizzled_rows(rows) * swizzled_cols(cols); }

int64_t swizzled_offset(int64_t m, int64_t c, int64_t cols) {
  const int64_t padded_cols = swizzled_cols(cols);
  if (m < 0) invalid("m", "expected a row index >= 0, got " + std::to_string(m));
  if (c < 0 || c >= padded_cols)
    invalid("c", "expected a scale column in [0, " + std::to_string(padded_cols) + "), got " + std::to_string(c));
  const int64_t nC = padded_cols / 4;  // ceil(cols / 4) tiles of 4 scale columns
  // One 512-byte tile holds 128 rows x 4 columns: row m%32 picks a 16-byte line, the 32-row
  // group (m%128)/32 a 4-byte slot in it, c%4 the byte.
  return (m / 128) * nC * 512 + (c / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (c % 4);
}

void swizzle_scales(const uint8_t* linear, int64_t rows, int64_t cols, uint8_t* swizzled) {
  const int64_t size = swizzled_size(rows, cols);
  if (size == 0) return;
  if (swizzled == nullptr) invalid("swizzled", "null pointer");
  if (rows * cols > 0 && linear == nullptr) invalid("linear", "null pointer");
  std::memset(swizzled, 0, static_cast<size_t>(size));
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < cols; ++c) swizzled[swizzled_offset(m, c, cols)] = linear[m * cols + c];
}

void unswizzle_scales(const uint8_t* swizzled, int64_t rows, int64_t cols, uint8_t* linear) {
  swizzled_size(rows, cols);  // validates rows and cols
  if (rows * cols == 0) return;
  if (swizzled == nullptr) invalid("swizzled", "null pointer");
  if (linear == nullptr) invalid("linear", "null pointer");
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < cols; ++c) linear[m * cols + c] = swizzled[swizzled_offset(m, c, cols)];
}

}  // namespace fp4moe::nvfp4
