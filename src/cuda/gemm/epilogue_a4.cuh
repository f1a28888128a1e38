// GEMM1's epilogue with a's NVFP4 (A4) quantization fused, for the weights-as-A tiles of two row groups a warp.
#pragma once
#include <cstdint>

#include "cuda/gemm/epilogue.cuh"
#include "cuda/nvfp4_device.cuh"

namespace fp4moe::cuda_backend {

// GEMM1's epilogue with a's A4 quantization fused (Epilogue1Params::a_quant_gs; gated activations, two row groups a
// warp): the warp's 32 weight rows n0.. are 16 gate | up pairs, a's columns n0 / 2 .. + 15 — one NVFP4 block (n0 is
// a multiple of 32) — of each of the group's tokens. Lane (g, t) holds gate (g even) or up (g odd) rows of tokens 2t
// and 2t + 1; the pair's lanes swap one token's values, so that the even lane makes token 2t's 4 values of a and the
// odd lane token 2t + 1's (every lane busy: with the even lanes doing both tokens, the fused epilogue cost more
// than the separate quantize launch). The block's amax is taken over the lanes of one
// token (t, g of one parity: xor 8, 16), and each value is quantized as quantize_block does (nvfp4_device.cuh), so
// out holds the same bits as GEMM1 then quantize_blocks_kernel. act_out keeps a. up / dup: the odd lane's values
// (lane + 4), as the caller exchanged them; ga: the group's sums (row group r).
template <class Act, int RG>
__device__ __forceinline__ void fused_a4_store(const Epilogue1Params& ep, const Epilogue1::RowPre* row_pre,
                                               const Epilogue1::ExpertCtx& x, const Epilogue1::ColPre (&cp)[RG][2],
                                               const TileRows& tr, int i, int n0,
                                               const float (&ga)[RG][4], const float (&up)[RG][4],
                                               const float (&dl)[RG][4], const float (&dup)[RG][4]) {
  const int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3, tk = gq & 1;
  // The odd lane's gate values (and LoRA deltas) of token 2t + 1, from the even lane (lane - 4).
  float gate[RG][2], dgate[RG][2];
#pragma unroll
  for (int r = 0; r < RG; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      gate[r][h] = __shfl_up_sync(0xffffffffu, ga[r][2 * h + 1], 4);
      dgate[r][h] = __shfl_up_sync(0xffffffffu, dl[r][2 * h + 1], 4);
    }
  const int row = tr.row0 + i * 8 + 2 * t + tk;
  const bool mine = row < tr.row_end && n0 < ep.N1;  // N1 = 2I: a warp's rows all in or all out
  Epilogue1::RowCtx rc{};
  if (mine) rc = Epilogue1::row_ctx(ep, x, row, row_pre[row - tr.row0]);
  uint16_t ab[RG][2];
  float amax = 0.f;
  bool non_finite = false;
#pragma unroll
  for (int r = 0; r < RG; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = n0 + 16 * r + (gq & ~1) + 8 * h;  // the pair's gate column
      const float g0 = tk ? gate[r][h] : ga[r][2 * h], u0 = tk ? ga[r][2 * h + 1] : up[r][2 * h];
      const float gd = tk ? dgate[r][h] : dl[r][2 * h], ud = tk ? dl[r][2 * h + 1] : dup[r][2 * h];
      ab[r][h] =
          mine ? dev::f32_to_bf16(Epilogue1::gated_value<Act>(ep, x, rc, cp[r][h], col, g0, u0, gd, ud)) : uint16_t{0};
      dev::quant_block_amax(dev::bf16_to_f32(ab[r][h]), amax, non_finite);
    }
#pragma unroll
  for (int m = 8; m <= 16; m <<= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    non_finite = __shfl_xor_sync(0xffffffffu, static_cast<int>(non_finite), m) != 0 || non_finite;
  }
  if (!mine) return;
  const dev::QuantBlockScale qs = dev::quant_block_scale(amax, non_finite, ep.a_quant_gs);
#pragma unroll
  for (int r = 0; r < RG; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float v = dev::fake_quant_value(dev::bf16_to_f32(ab[r][h]), ep.a_quant_gs, qs);
      Epilogue1::store_gated(ep, rc, (n0 + 16 * r + (gq & ~1) + 8 * h) >> 1, dev::f32_to_bf16(v), ab[r][h]);
    }
}

}  // namespace fp4moe::cuda_backend
