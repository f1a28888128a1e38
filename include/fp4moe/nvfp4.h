// NVFP4 (SPEC §2): E2M1 elements, E4M3 block scales over 16 elements along K, one fp32
// global scale per tensor. Host-side codecs; the kernels decode with the same tables.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fp4moe::nvfp4 {

constexpr int kBlock = 16;              // elements per E4M3 block scale
constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;

// E2M1: 4-bit code (bit 3 = sign) <-> value.
float e2m1_decode(uint8_t code);
// Round to nearest, ties to even, saturating at +-6 (NaN: see docs/numerics.md).
uint8_t e2m1_encode(float x);
// E4M3 (float8_e4m3fn: finite, max 448, 0x7f/0xff are NaN).
float e4m3_decode(uint8_t code);
// Round to nearest even, saturating to +-448 (NaN -> 0x7f with its sign kept).
uint8_t e4m3_encode_satfinite(float x);

// Nibble packing: element 2i is the low nibble, 2i+1 the high one.
inline uint8_t pack2(uint8_t lo, uint8_t hi) { return static_cast<uint8_t>((lo & 0xf) | ((hi & 0xf) << 4)); }
inline uint8_t nibble(const uint8_t* packed, int64_t i) {
  return static_cast<uint8_t>((packed[i >> 1] >> ((i & 1) * 4)) & 0xf);
}

// The largest finite |x[i]| of n values (0 when none); *non_finite is set when one is NaN or +-Inf.
float block_amax(const float* x, int n, bool* non_finite);

// Encode scale for a tensor whose absolute maximum is amax: gs = 448*6/amax (amax==0 -> 1; NaN/+Inf amax -> NaN).
float global_encode_scale(float amax);

// Quantize one row of K elements (K multiple of 16) with encode scale gs:
// sf = e4m3(gs*amax_block/6); q = e2m1(x*gs/sf) (0 when sf decodes to 0). Exact IEEE division.
void quantize_row(const float* x, int64_t K, float gs, uint8_t* packed_out /*K/2*/, uint8_t* sf_out /*K/16*/);
// Decode one row: value = e2m1 * e4m3 * scale2 (scale2 = 1/gs).
void dequantize_row(const uint8_t* packed, const uint8_t* sf, int64_t K, float scale2, float* out);
// Quantize a row and decode it again (the A4 "fake quant" of SPEC §3.2 step 4).
void fake_quantize_row(const float* x, int64_t K, float gs, float scale2, float* out);

// Matrices [N, K]: packed [N, K/2], scales linear [N, K/16].
void quantize_matrix(const float* x, int64_t N, int64_t K, float gs, uint8_t* packed, uint8_t* sf_linear);
void dequantize_matrix(const uint8_t* packed, const uint8_t* sf_linear, int64_t N, int64_t K, float scale2,
                       float* out);

// 128x4 swizzled scale layout (SPEC §2). rows = N, cols = K/16.
int64_t swizzled_rows(int64_t rows);       // rows padded to a multiple of 128
int64_t swizzled_cols(int64_t cols);       // cols padded to a multiple of 4
int64_t swizzled_size(int64_t rows, int64_t cols);
int64_t swizzled_offset(int64_t m, int64_t c, int64_t cols);
// Padding bytes of the swizzled buffer are written as 0.
void swizzle_scales(const uint8_t* linear, int64_t rows, int64_t cols, uint8_t* swizzled);
void unswizzle_scales(const uint8_t* swizzled, int64_t rows, int64_t cols, uint8_t* linear);

}  // namespace fp4moe::nvfp4
