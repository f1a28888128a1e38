// Tile math on the device: NVFP4 decode into mma fragments, E4M3/E2M1 encode for the A4 quantizers,
// bf16 helpers. Numerics mirror src/format/nvfp4.cpp (SPEC §2).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "format/nvfp4_prepared.h"

namespace fp4moe::cuda_backend::dev {

__device__ __forceinline__ float bf16_to_f32(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
// Round to nearest even (NaN stays NaN): the device intrinsic, same as f32_to_bf16_bits on the host.
__device__ __forceinline__ uint16_t f32_to_bf16(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
// v rounded to bf16 and back (the shrinks' t, the expand's delta, SharedOuter's z and dy).
__device__ __forceinline__ float round_to_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }
// Two floats as bf16x2, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}

// E4M3 code -> fp32, exactly: put the 7 magnitude bits where fp32's exponent/mantissa start (the
// value is then 2^-120 times the E4M3 value, fp32 subnormals included) and rescale by 2^120.
__device__ __forceinline__ float e4m3_to_f32(uint32_t code) {
  const float m = __uint_as_float(((code & 0x7fu) << 20) | ((code & 0x80u) << 24));
  return m * 0x1p120f;
}

// bf16x2 a times the low / high half of p (HMUL2 with a .H0_H0 / .H1_H1 operand).
__device__ __forceinline__ uint32_t bf16x2_mul_lo(uint32_t a, uint32_t p) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), __low2bfloat162(*reinterpret_cast<__nv_bfloat162*>(&p)));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t bf16x2_mul_hi(uint32_t a, uint32_t p) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), __high2bfloat162(*reinterpret_cast<__nv_bfloat162*>(&p)));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// One row's prepared 64-K block for quad lane t (format/nvfp4_prepared.h): w[s][h] = the bf16x2 weights
// (k = 16 s + 2t + 8h, k + 1) times 2^-8, exact. raw: the lane's 8 value bytes; k4: the row's 4 scale bytes
// (E4M3 codes as prepared, or with MX the E8M0 codes of MXFP4, each twice).
template <bool MX = false>
__device__ __forceinline__ void fp4_row_fragments(uint2 raw, uint32_t k4, uint32_t w[4][2]) {
  namespace pf = nvfp4_prepared;
  uint32_t d0[4], d1[4];
  pf::decode_slots(raw.x, d0);
  pf::decode_slots(raw.y, d1);
  const uint32_t p01 = MX ? pf::mx_scale_pair(k4, 0) : pf::scale_pair(k4, 0);
  const uint32_t p23 = MX ? pf::mx_scale_pair(k4, 2) : pf::scale_pair(k4, 2);
  w[0][0] = bf16x2_mul_lo(d0[0], p01);
  w[0][1] = bf16x2_mul_lo(d0[1], p01);
  w[1][0] = bf16x2_mul_hi(d0[2], p01);
  w[1][1] = bf16x2_mul_hi(d0[3], p01);
  w[2][0] = bf16x2_mul_lo(d1[0], p23);
  w[2][1] = bf16x2_mul_lo(d1[1], p23);
  w[3][0] = bf16x2_mul_hi(d1[2], p23);
  w[3][1] = bf16x2_mul_hi(d1[3], p23);
}

// E4M3 round-to-nearest-even, saturating to +-448 (NaN -> 0x7f), as e4m3_encode_satfinite.
__device__ __forceinline__ uint32_t f32_to_e4m3_satfinite(float x) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// E2M1 magnitude code of a >= 0 (finite), round to nearest even, saturating at 6 (as e2m1_encode).
__device__ __forceinline__ uint32_t e2m1_magnitude(float a) {
  if (a <= 0.25f) return 0;
  if (a < 0.75f) return 1;
  if (a <= 1.25f) return 2;
  if (a < 1.75f) return 3;
  if (a <= 2.5f) return 4;
  if (a < 3.5f) return 5;
  if (a <= 5.0f) return 6;
  return 7;
}
// Value of an E2M1 magnitude code (exponent field e = mag >> 1, mantissa bit m = mag & 1).
__device__ __forceinline__ float e2m1_value(uint32_t mag) {
  const uint32_t e = (mag >> 1) & 3u, m = mag & 1u;
  return e == 0 ? 0.5f * static_cast<float>(m) : __uint_as_float(((e + 126u) << 23) | (m << 22));
}

// NVFP4 fake quantization (quantize_block of src/format/nvfp4.cpp): a 16-element block's scale from its amax over
// finite values (a block holding NaN or Inf decodes to NaN), sf = e4m3((gs * amax) / 6), then each value
// q = e2m1((x * gs) / sf), written as its decoded value e2m1 * e4m3 (no global scale; exact in bf16). In two steps,
// so that a block spread over lanes (GEMM1's fused A4 epilogue) and a block in one thread share the arithmetic.
struct QuantBlockScale {
  float sfv;        // the decoded e4m3 scale
  bool non_finite;  // the block holds NaN or Inf: every value NaN
};
__device__ __forceinline__ QuantBlockScale quant_block_scale(float amax_finite, bool non_finite, float gs) {
  QuantBlockScale q;
  q.non_finite = non_finite;
  q.sfv = e4m3_to_f32(f32_to_e4m3_satfinite(__fdiv_rn(__fmul_rn(gs, amax_finite), 6.0f)));
  return q;
}
__device__ __forceinline__ float fake_quant_value(float x, float gs, const QuantBlockScale& s) {
  if (s.non_finite) return __uint_as_float(0x7fffffffu);
  if (s.sfv == 0.f) return 0.f;
  const float q = __fdiv_rn(__fmul_rn(x, gs), s.sfv);
  const float v = e2m1_value(e2m1_magnitude(fabsf(q))) * s.sfv;
  return signbit(q) ? -v : v;
}
// Folds x into a block's (amax over finite |x|, any non-finite) pair.
__device__ __forceinline__ void quant_block_amax(float x, float& amax, bool& non_finite) {
  const float a = fabsf(x);
  if (!isfinite(a)) non_finite = true;
  else amax = fmaxf(amax, a);
}
// 16 values of one block in one thread.
__device__ __forceinline__ void fake_quant_block16(const float x[16], float gs, float y[16]) {
  float amax = 0.f;
  bool non_finite = false;
#pragma unroll
  for (int i = 0; i < 16; ++i) quant_block_amax(x[i], amax, non_finite);
  const QuantBlockScale s = quant_block_scale(amax, non_finite, gs);
#pragma unroll
  for (int i = 0; i < 16; ++i) y[i] = fake_quant_value(x[i], gs, s);
}

}  // namespace fp4moe::cuda_backend::dev
