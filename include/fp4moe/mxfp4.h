// MXFP4 (SPEC §2): E2M1 elements packed as NVFP4's, one E8M0 power-of-two scale per 32 elements along K, no
// global scale. Host-side codecs; the kernels decode the same codes (format/nvfp4_prepared.h).
#pragma once
#include <cstdint>

namespace fp4moe::mxfp4 {

constexpr int kBlock = 32;             // elements per E8M0 scale
constexpr uint8_t kScaleNaN = 0xff;    // E8M0 255 is NaN: refused when weights are prepared
// The scale codes whose blocks every backend decodes exactly (SPEC §2): 2^-117 ... 2^9. A block holding any
// nonzero code under a scale outside them is refused at preparation; all-zero blocks take any scale but 255.
constexpr int kMinScaleCode = 10;
constexpr int kMaxScaleCode = 136;

// 2^(e - 127) exactly (e = 0 is the fp32 subnormal 2^-127); NaN for 255.
float e8m0_decode(uint8_t e);
// Whether block scale e with codes `any_nonzero` is accepted by prepare_weights.
inline bool scale_accepted(uint8_t e, bool any_nonzero) {
  return e != kScaleNaN && (!any_nonzero || (e >= kMinScaleCode && e <= kMaxScaleCode));
}

// Quantizes one row of K elements (K a multiple of 32). Scale as triton_kernels' downcast_to_mxfp (the quantizer
// transformers uses for gpt-oss, its default ROUND_UP): e = the exponent of 2^ceil(log2(amax / 6)) (amax / 6 one
// fp32 division; amax = 0 gives e = 0); codes e2m1_rne(x / 2^(e - 127)), saturating at +-6 (reached only where
// amax / 6 rounds down onto a power of two). A block holding NaN or Inf gets the NaN scale 255 and zero codes.
void quantize_row(const float* x, int64_t K, uint8_t* packed_out /*K/2*/, uint8_t* scales_out /*K/32*/);
// value = e2m1 * 2^(e - 127), exact in fp32 for every code but 255 (NaN) and the scales whose values overflow.
void dequantize_row(const uint8_t* packed, const uint8_t* scales, int64_t K, float* out);
// Matrices [N, K]: packed [N, K/2], scales [N, K/32].
void quantize_matrix(const float* x, int64_t N, int64_t K, uint8_t* packed, uint8_t* scales);
void dequantize_matrix(const uint8_t* packed, const uint8_t* scales, int64_t N, int64_t K, float* out);

}  // namespace fp4moe::mxfp4
