// The grouped GEMM for few rows per expert (decode and small batches): the weights are the mma A operand
// (16 weight rows per warp) and the tokens the B operand (8 per mma), so a tile of up to 32 rows reads each
// weight byte once, and every warp streams its own 16 rows x 64 K blocks through a private STAGES-deep
// cp.async ring — many independent streams in flight, which is what a bandwidth-bound GEMM needs.
//
// Assumptions (asserted or guaranteed by the plan): N is a multiple of 16; K is a multiple of 16; the
// weights use the prepared layout of kernels.h; A rows are 4-byte aligned (x is 16-byte aligned, lda even).
//
// Bits: out(row m, col n) = sum over k of A[m][k] * W[n][k] runs the same chain of m16n8k16 steps
// k = 0, 16, 32, ... as the mma.sync tile of gemm_mainloop.cuh, with the same 16 products per step; only the
// operand roles are swapped. The result is the same bits (checked on the H200 by the batch-invariance tests,
// which compare this kernel's tokens with the large-tile kernel's). Steps past K multiply zero padding, as there.
#pragma once
#include <cstdint>

#include "cuda/gemm_grouped.cuh"

namespace fp4moe::cuda_backend {

template <int WARPS_, int STAGES_, bool FP4_> struct SkinnyConfig {
  static constexpr int WARPS = WARPS_, STAGES = STAGES_, BK = 64;
  static constexpr int BM = 32;             // rows (tokens) of one tile: four groups of 8
  static constexpr int GROUPS = BM / 8;
  static constexpr int BN = 16 * WARPS;     // weight rows of one block: 16 per warp
  static constexpr bool FP4 = FP4_, WEIGHTS_AS_A = true;
  static constexpr int WARPS_M = 1, WARPS_N = WARPS;  // as plan.h's GemmConfig counts them
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int ROW_BYTES = FP4 ? 32 : 128;  // one weight row's 64 K, prepared
  static constexpr int W_BYTES = 16 * ROW_BYTES;    // one warp's k-block of weights
  static constexpr int SF_BYTES = FP4 ? 16 * 4 : 0;
  static constexpr int STAGE_BYTES = W_BYTES + SF_BYTES;
  static constexpr int WARP_SMEM = STAGES * STAGE_BYTES;
  static constexpr int SMEM_BYTES = WARPS * WARP_SMEM;
  static_assert(W_BYTES % (16 * 32) == 0 && STAGE_BYTES % 16 == 0 && STAGES >= 2, "skinny tile");
};

__device__ __forceinline__ uint32_t ldg_u32(const uint16_t* p) {
  return __ldg(reinterpret_cast<const unsigned int*>(p));
}

// One warp's A fragments (16 weight rows x one k16 step) for the 4 steps of a k-block in shared memory:
// thread (g, t) holds rows g and g + 8 at k = 2t, 2t+1 and 2t+8, 2t+9 — in the prepared layout, the bytes
// that the mma.sync tile reads as B fragments of the same rows.
template <class Cfg>
__device__ __forceinline__ void weight_fragments(const uint8_t* st, int g, int t, uint32_t wa[4][4]) {
  if constexpr (Cfg::FP4) {
    const uint2 r0 = *reinterpret_cast<const uint2*>(st + g * 32 + t * 8);
    const uint2 r1 = *reinterpret_cast<const uint2*>(st + (g + 8) * 32 + t * 8);
    const uint32_t sc0 = *reinterpret_cast<const uint32_t*>(st + Cfg::W_BYTES + g * 4);
    const uint32_t sc1 = *reinterpret_cast<const uint32_t*>(st + Cfg::W_BYTES + (g + 8) * 4);
    uint32_t d0[8], d1[8];
    dev::e2m1x8_to_bf16x8(r0.x, d0);
    dev::e2m1x8_to_bf16x8(r0.y, d0 + 4);
    dev::e2m1x8_to_bf16x8(r1.x, d1);
    dev::e2m1x8_to_bf16x8(r1.y, d1 + 4);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t s0 = dev::bf16x2_splat_from_f32(dev::e4m3_to_f32((sc0 >> (8 * s)) & 0xffu));
      const uint32_t s1 = dev::bf16x2_splat_from_f32(dev::e4m3_to_f32((sc1 >> (8 * s)) & 0xffu));
      wa[s][0] = dev::bf16x2_mul(d0[2 * s], s0);
      wa[s][1] = dev::bf16x2_mul(d1[2 * s], s1);
      wa[s][2] = dev::bf16x2_mul(d0[2 * s + 1], s0);
      wa[s][3] = dev::bf16x2_mul(d1[2 * s + 1], s1);
    }
  } else {
    const uint4 a0 = *reinterpret_cast<const uint4*>(st + g * 128 + t * 32);
    const uint4 a1 = *reinterpret_cast<const uint4*>(st + g * 128 + t * 32 + 16);
    const uint4 b0 = *reinterpret_cast<const uint4*>(st + (g + 8) * 128 + t * 32);
    const uint4 b1 = *reinterpret_cast<const uint4*>(st + (g + 8) * 128 + t * 32 + 16);
    wa[0][0] = a0.x; wa[0][1] = b0.x; wa[0][2] = a0.y; wa[0][3] = b0.y;
    wa[1][0] = a0.z; wa[1][1] = b0.z; wa[1][2] = a0.w; wa[1][3] = b0.w;
    wa[2][0] = a1.x; wa[2][1] = b1.x; wa[2][2] = a1.y; wa[2][3] = b1.y;
    wa[3][0] = a1.z; wa[3][1] = b1.z; wa[3][2] = a1.w; wa[3][3] = b1.w;
  }
}

template <class Cfg, class Epi, class Act>
__global__ void __launch_bounds__(Cfg::THREADS) skinny_gemm_kernel(GemmProblem g, typename Epi::Params ep) {
  extern __shared__ __align__(128) uint8_t smem[];
  TileRows tr;
  if (!resolve_tile<Cfg::BM>(g, tr)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
  const int N = static_cast<int>(g.B.N);
  const int n0 = (static_cast<int>(blockIdx.y) * Cfg::WARPS + warp) * 16;
  if (n0 >= N) return;  // no block-wide barrier below: warps are independent
  const int groups = (tr.row_end - tr.row0 + 7) >> 3;

  // Token g of each group of 8 (null: past the tile's rows; its B fragment is zero).
  const uint16_t* xrow[Cfg::GROUPS];
#pragma unroll
  for (int i = 0; i < Cfg::GROUPS; ++i) {
    const int r = tr.row0 + i * 8 + gq;
    xrow[i] = nullptr;
    if (r < tr.row_end) {
      const int arow = g.gather_k ? entry_of(g, r) / g.gather_k : r;
      xrow[i] = g.A + static_cast<int64_t>(arow) * g.lda;
    }
  }

  const int K = g.K, KB = static_cast<int>(g.B.Kp / Cfg::BK);
  uint8_t* ring = smem + warp * Cfg::WARP_SMEM;
  const uint8_t* wsrc = g.B.data + static_cast<int64_t>(tr.expert) * g.B.expert_data_bytes +
                        static_cast<int64_t>(n0) * Cfg::ROW_BYTES;
  const uint8_t* ssrc = Cfg::FP4 ? g.B.sf + static_cast<int64_t>(tr.expert) * g.B.expert_sf_bytes + n0 * 4 : nullptr;
  const int64_t wstride = static_cast<int64_t>(N) * Cfg::ROW_BYTES, sstride = static_cast<int64_t>(N) * 4;
  // A k-block of this warp's 16 rows is one contiguous run (kernels.h layout).
  auto load = [&](int stage, int kb) {
    uint8_t* d = ring + stage * Cfg::STAGE_BYTES;
    const uint8_t* s = wsrc + kb * wstride;
#pragma unroll
    for (int c = lane; c < Cfg::W_BYTES / 16; c += 32) dev::cp_async16(d + c * 16, s + c * 16, true);
    if constexpr (Cfg::FP4)
      if (lane < 4) dev::cp_async16(d + Cfg::W_BYTES + lane * 16, ssrc + kb * sstride + lane * 16, true);
  };
#pragma unroll
  for (int s = 0; s < Cfg::STAGES - 1; ++s) {
    if (s < KB) load(s, s);
    dev::cp_async_commit();
  }

  float acc[Cfg::GROUPS][4];
#pragma unroll
  for (int i = 0; i < Cfg::GROUPS; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[i][q] = 0.f;

  for (int kb = 0; kb < KB; ++kb) {
    dev::cp_async_wait<Cfg::STAGES - 2>();
    __syncwarp();  // stage kb landed for every lane; every lane is done with stage kb - 1
    {
      const int nk = kb + Cfg::STAGES - 1;
      if (nk < KB) load(nk % Cfg::STAGES, nk);
      dev::cp_async_commit();
    }
    uint32_t wa[4][4];
    weight_fragments<Cfg>(ring + (kb % Cfg::STAGES) * Cfg::STAGE_BYTES, gq, t, wa);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int k = kb * Cfg::BK + s * 16;
#pragma unroll
      for (int i = 0; i < Cfg::GROUPS; ++i) {
        if (i >= groups) break;
        uint32_t b[2] = {0u, 0u};
        if (xrow[i] && k < K) {
          b[0] = ldg_u32(xrow[i] + k + 2 * t);
          b[1] = ldg_u32(xrow[i] + k + 2 * t + 8);
        }
        dev::mma_bf16_16816(acc[i], wa[s], b);
      }
    }
  }
  dev::cp_async_wait<0>();

  // Thread (g, t) holds out(token 2t + {0,1} of group i, weight rows n0 + g and n0 + g + 8). The epilogue
  // takes column pairs (even, odd) of one row: row g + 1's values come from lane + 4.
  float nb[Cfg::GROUPS][4];
#pragma unroll
  for (int i = 0; i < Cfg::GROUPS; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) nb[i][q] = __shfl_down_sync(0xffffffffu, acc[i][q], 4);
  if (gq & 1) return;
  const auto x = Epi::template expert_ctx<Act>(ep, tr.expert);
#pragma unroll
  for (int i = 0; i < Cfg::GROUPS; ++i) {
    if (i >= groups) break;
#pragma unroll
    for (int tk = 0; tk < 2; ++tk) {
      const int r = tr.row0 + i * 8 + 2 * t + tk;
      if (r >= tr.row_end) continue;
      const auto rc = Epi::row_ctx(ep, g, x, r);
      Epi::template pair<Act>(ep, x, rc, n0 + gq, acc[i][tk], nb[i][tk]);
      Epi::template pair<Act>(ep, x, rc, n0 + gq + 8, acc[i][2 + tk], nb[i][2 + tk]);
    }
  }
}

}  // namespace fp4moe::cuda_backend
