// The bits of prepared NVFP4 weights (the CUDA backend's kernel layout, src/cuda/kernels.h), host and device:
// how the preparation step encodes a 64-K row segment and how a kernel turns it into bf16 mma fragments.
//
// Why re-encode: the GEMMs of few tokens are bound by the instructions that decode weights (ncu, H200: ~300
// per warp and 512 weight bytes with the plain E2M1/E4M3 bytes). Laid out as below, one quad lane decodes its
// 32 values and 8 scales in 44 + 8 integer instructions plus 16 bf16x2 multiplies.
//
// Values. Lane t of a quad holds, per row and 64-K block, two 32-bit words; word w (w = 0, 1) holds k16 steps
// s = 2w, 2w+1, and in it slot j = 2 (s % 2) + h holds the bf16x2 pair (k = 16 s + 2t + 8h, k + 1) as
// (low, high). A slot's value keeps its 3 magnitude bits (E2M1 code & 7) at kMagBit[j] and its sign at
// kSignBit[j] (high value: + 16). Moved into bf16 bits 6..8 and 15, the magnitude bits read as E2M1 * 2^-126
// (exponent field = E2M1 exponent; the code 0.5 becomes the bf16 subnormal 2^-127) — decode_slots.
//
// Scales. A block scale byte becomes k = (e << 3) | f for |scale| = 2^(e - 21) (1 + f/8) (subnormal E4M3
// normalised, e in 12..29); k = 0xff is NaN. The bf16 0x7000 | (k << 4) is then |scale| * 2^118 exactly, so a
// slot times its scale is E2M1 * |scale| * 2^-8: exact in bf16 (at most 6 significant bits, 2^-18 .. 2^4).
// The scale's sign moves into the 16 values' signs; a zero scale zeroes their magnitudes (signs kept), so
// every product keeps the sign and zero of E2M1 * E4M3. The kernels multiply the fp32 sums by 2^8
// (kProductScale): powers of two, so the sums are those of the true products unless they leave fp32's range.
//
// MXFP4 shares the values' layout; a row's 4 scale bytes of a 64-K block are its two E8M0 codes, each twice (steps
// 0, 1 and 2, 3). Only the scale-to-bf16 step differs (mx_scale_pair): the bf16 (e + 118) << 7 is 2^(e - 127) *
// 2^118, the same factor as above, so kProductScale holds for both. It is a normal bf16 and a slot times it is
// exact for e in mxfp4::kMinScaleCode .. kMaxScaleCode (10 .. 136), the range prepare_weights admits over nonzero
// values; an all-zero block under another scale is stored with 127 (its products are +-0 whatever the scale).
#pragma once
#include <cstdint>

#include "common/host_device.h"
#include "fp4moe/mxfp4.h"

namespace fp4moe::nvfp4_prepared {

constexpr float kProductScale = 256.f;  // true sum = mma sum * 2^8
constexpr int kMagBit[4] = {6, 3, 0, 9};
constexpr int kSignBit[4] = {15, 12, 13, 14};
constexpr uint32_t kMagMask = 0x01C001C0u, kSignMask = 0x80008000u;

// The four slots of word x as bf16x2 bit patterns (value * 2^-126, sign included).
FP4MOE_HD void decode_slots(uint32_t x, uint32_t d[4]) {
  d[0] = x & (kMagMask | kSignMask);                                     // already in place
  d[1] = (x << 3) & (kMagMask | kSignMask);                              // magnitude and sign 3 bits up
  d[2] = ((x << 6) & kMagMask) | ((x << 2) & kSignMask);
  d[3] = ((x >> 3) & kMagMask) | ((x << 1) & kSignMask);
}

// PRMT: byte n of the result is byte (selector nibble n) of the 8 bytes y:x (the host emulates it).
FP4MOE_HD uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, selector);
#else
  const uint64_t xy = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<uint32_t>((xy >> (8 * ((selector >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
#endif
}

// Scales of steps `first` and `first + 1` (bytes of a row's scale word) as one bf16x2: |scale| * 2^118 each.
// PRMT places the two bytes (and zero bytes above them), one IMAD shifts them under 0x7000.
FP4MOE_HD uint32_t scale_pair(uint32_t k4, int first) {
  return byte_perm(k4, 0u, 0x4140u + 0x0101u * static_cast<uint32_t>(first)) * 16u + 0x70007000u;
}

// MXFP4: the E8M0 codes of steps `first` and `first + 1` as one bf16x2: 2^(e - 127) * 2^118 each.
FP4MOE_HD uint32_t mx_scale_pair(uint32_t k4, int first) {
  return byte_perm(k4, 0u, 0x4140u + 0x0101u * static_cast<uint32_t>(first)) * 128u + 0x3B003B00u;
}

// ---- host side: the encoder --------------------------------------------------------------------------------
struct PreparedScale {
  uint8_t code;     // k above
  bool negative;    // flip the block's value signs
  bool zero;        // zero the block's magnitudes
};
inline PreparedScale prepare_scale(uint8_t e4m3) {
  const uint32_t mag = e4m3 & 0x7fu;
  const bool negative = (e4m3 & 0x80u) != 0;
  if (mag == 0x7f) return {0xff, false, false};            // NaN: every value decodes to NaN
  if (mag == 0) return {static_cast<uint8_t>(21u << 3), negative, true};  // any scale; the values become +-0
  uint32_t e = mag >> 3, f = mag & 7u;
  int x = static_cast<int>(e) - 7;                         // |scale| = 2^x (1 + f/8) for normal codes
  if (e == 0) {                                            // subnormal f * 2^-9: normalise
    x = -9;
    while (f < 8) { f <<= 1; --x; }
    x += 3;
    f &= 7u;
  }
  return {static_cast<uint8_t>(((x + 21) << 3) | static_cast<int>(f)), negative, false};
}

// E2M1 code c of a block under scale ps, as stored: the scale's sign moved into it, zeroed under a zero scale.
inline uint8_t prepare_value(uint8_t c, const PreparedScale& ps) {
  if (ps.negative) c ^= 8u;
  if (ps.zero) c &= 8u;
  return c;
}

// The stored E8M0 code of an MXFP4 block (mx_scale_pair): e itself, or 127 outside the exactly decoded range, which
// prepare_weights admits only over blocks of zeros.
inline uint8_t prepare_mx_scale(uint8_t e) {
  return e >= mxfp4::kMinScaleCode && e <= mxfp4::kMaxScaleCode ? e : static_cast<uint8_t>(127);
}

// Puts E2M1 code c (sign bit 3) of slot j, half h (0 low, 1 high) into word x.
inline void place_value(uint32_t& x, int j, int h, uint8_t c) {
  x |= static_cast<uint32_t>(c & 7u) << (kMagBit[j] + 16 * h);
  x |= static_cast<uint32_t>((c >> 3) & 1u) << (kSignBit[j] + 16 * h);
}

}  // namespace fp4moe::nvfp4_prepared
