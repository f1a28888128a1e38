// Tile math on the device: NVFP4 decode into mma fragments, E4M3/E2M1 encode for the A4 quantizers,
// bf16 helpers. Numerics mirror src/format/nvfp4.cpp (SPEC §2).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace fp4moe::cuda_backend::dev {

__device__ __forceinline__ float bf16_to_f32(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
// Round to nearest even (NaN stays NaN): the device intrinsic, same as f32_to_bf16_bits on the host.
__device__ __forceinline__ uint16_t f32_to_bf16(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

// E4M3 code -> fp32, exactly: put the 7 magnitude bits where fp32's exponent/mantissa start (the
// value is then 2^-120 times the E4M3 value, fp32 subnormals included) and rescale by 2^120.
__device__ __forceinline__ float e4m3_to_f32(uint32_t code) {
  const float m = __uint_as_float(((code & 0x7fu) << 20) | ((code & 0x80u) << 24));
  return m * 0x1p120f;
}

// Eight E2M1 nibbles (nibble i = element i) -> four bf16x2 words (word i = elements 2i, 2i+1; low half
// first), exact. Magnitudes come from two byte tables through PRMT; the sign bit is moved to bit 15/31.
//   magnitude: 0 0.5 1 1.5 2 3 4 6  -> bf16 0x0000 3F00 3F80 3FC0 4000 4040 4080 40C0
__device__ __forceinline__ void e2m1x8_to_bf16x8(uint32_t w, uint32_t out[4]) {
  constexpr uint32_t kHiLo = 0x3F3F3F00u, kHiHi = 0x40404040u;  // high bytes of magnitudes 0-3, 4-7
  constexpr uint32_t kLoLo = 0xC0800000u, kLoHi = 0xC0804000u;  // low bytes
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t v = half ? (w >> 16) : w;     // nibbles 0-3 of this half
    const uint32_t sel = v & 0x7777u;            // 3-bit magnitude selectors
    const uint32_t hi = __byte_perm(kHiLo, kHiHi, sel);
    const uint32_t lo = __byte_perm(kLoLo, kLoHi, sel);
    uint32_t p01 = __byte_perm(lo, hi, 0x5140);  // (lo0, hi0, lo1, hi1)
    uint32_t p23 = __byte_perm(lo, hi, 0x7362);
    p01 |= ((v & 0x8u) << 12) | ((v & 0x80u) << 24);
    p23 |= ((v & 0x800u) << 4) | ((v & 0x8000u) << 16);
    out[half * 2 + 0] = p01;
    out[half * 2 + 1] = p23;
  }
}

// bf16x2 multiply; exact here (e2m1 * e4m3 has at most 5 significant bits and stays in range).
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t bf16x2_splat_from_f32(float f) {
  const uint32_t b = f32_to_bf16(f);  // exact for E4M3 values
  return b | (b << 16);
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

// Quantizes 16 values with encode scale gs and writes their decoded NVFP4 values e2m1 * e4m3 (no global
// scale; exact in bf16) — quantize_block of src/format/nvfp4.cpp: amax over finite values, a block with a
// NaN or Inf gets the NaN scale (decodes to NaN), sf = e4m3((gs * amax) / 6), q = e2m1((x * gs) / sf).
__device__ __forceinline__ void fake_quant_block16(const float x[16], float gs, float y[16]) {
  float amax = 0.f;
  bool non_finite = false;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float a = fabsf(x[i]);
    if (!isfinite(a)) non_finite = true;
    else amax = fmaxf(amax, a);
  }
  if (non_finite) {
#pragma unroll
    for (int i = 0; i < 16; ++i) y[i] = __uint_as_float(0x7fffffffu);
    return;
  }
  const float t = __fmul_rn(gs, amax);
  const uint32_t sf = f32_to_e4m3_satfinite(__fdiv_rn(t, 6.0f));
  const float sfv = e4m3_to_f32(sf);
  if (sfv == 0.f) {
#pragma unroll
    for (int i = 0; i < 16; ++i) y[i] = 0.f;
    return;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float q = __fdiv_rn(__fmul_rn(x[i], gs), sfv);
    const float v = e2m1_value(e2m1_magnitude(fabsf(q))) * sfv;
    y[i] = signbit(q) ? -v : v;
  }
}

}  // namespace fp4moe::cuda_backend::dev
