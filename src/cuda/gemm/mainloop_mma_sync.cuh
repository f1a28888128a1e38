// The mma.sync mainloops (m16n8k16, bf16 in, fp32 sums; every architecture from sm_80).
// TokensAsAMainloop, the TokensAsA64 tile: acc[BM x BN] = A[rows, 0:K] . B[n0:n0+BN, 0:K]^T, the tokens as the A
// operand (ldmatrix) and the weights decoded from shared memory straight into B fragments (NVFP4: e2m1 * e4m3 *
// 2^-8 in bf16, exact; format/nvfp4_prepared.h).
// WeightsAsAMmaSync, the SplitKDecode, WeightsAsA16 and WeightsAsA32 tiles: the weights as A (weight_fragments.cuh),
// the tokens as B, one K chunk's chain a call.
#pragma once
#include <cstdint>

#include "cuda/gemm/k_order.cuh"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/weight_fragments.cuh"
#include "cuda/nvfp4_device.cuh"

namespace fp4moe::cuda_backend {

template <class Cfg> struct TokensAsAMainloop {
  using C = Cfg;
  float acc[C::MT][C::NT][4];  // the sum over the chunks done
  float part[C::MT][C::NT][4];  // the chain of the current chunk

  // after_issue() runs once the first stages' copies are issued (work to overlap with them, e.g. the LoRA lookups).
  template <class AfterIssue>
  __device__ __forceinline__ void run(uint8_t* smem, TileLoader<C>& ld, int KB, int CB, AfterIssue&& after_issue) {
    StagePipe<C> pipe(smem, ld, KB);
    after_issue();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp / C::WARPS_N, wn = warp % C::WARPS_N;
    const int g = lane >> 2, t = lane & 3;

    for (int kb = 0, kin = 0; kb < KB; ++kb) {  // kin: kb's place in its chunk
      const uint32_t sstage = pipe.next(ld);  // A: ldmatrix's shared-space address
      if (kin == 0) {
#pragma unroll
        for (int i = 0; i < C::MT; ++i)
#pragma unroll
          for (int j = 0; j < C::NT; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) part[i][j][q] = 0.f;
      }
      const uint8_t* sB = smem + (sstage - pipe.sbase) + C::A_BYTES;
      const uint8_t* sSF = sB + C::B_BYTES;

      // B fragments of this warp for the 4 k16 steps.
      uint32_t bfrag[C::NT][4][2];
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        const int row = wn * C::WTN + nt * 8 + g;
        if constexpr (C::FP4) {
          uint32_t w[4][2];
          dev::fp4_row_fragments<C::MX>(*reinterpret_cast<const uint2*>(sB + row * 32 + t * 8),
                                        *reinterpret_cast<const uint32_t*>(sSF + row * 4), w);
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            bfrag[nt][s][0] = w[s][0];
            bfrag[nt][s][1] = w[s][1];
          }
        } else {
          const uint4 q0 = *reinterpret_cast<const uint4*>(sB + row * 128 + t * 32);
          const uint4 q1 = *reinterpret_cast<const uint4*>(sB + row * 128 + t * 32 + 16);
          bfrag[nt][0][0] = q0.x; bfrag[nt][0][1] = q0.y;
          bfrag[nt][1][0] = q0.z; bfrag[nt][1][1] = q0.w;
          bfrag[nt][2][0] = q1.x; bfrag[nt][2][1] = q1.y;
          bfrag[nt][3][0] = q1.z; bfrag[nt][3][1] = q1.w;
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t afrag[C::MT][4];
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
          const int arow = wm * C::WTM + mt * 16 + (lane & 15);
          const int ch = 2 * s + (lane >> 4);
          dev::ldmatrix_x4(afrag[mt], sstage + arow * 128 + ((ch ^ (arow & 7)) << 4));
        }
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < C::NT; ++nt) dev::mma_bf16_16816(part[mt][nt], afrag[mt], bfrag[nt][s]);
      }
      if (++kin == CB || kb == KB - 1) {  // chunk done: add it in chunk order
#pragma unroll
        for (int i = 0; i < C::MT; ++i) add_chunk(acc[i], part[i], kb < CB);
        kin = 0;
      }
    }
    dev::cp_async_wait<0>();
    if constexpr (C::FP4) {
#pragma unroll
      for (int i = 0; i < C::MT; ++i) unscale_products(acc[i]);
    }
  }
};

// The weights-as-A mma.sync mainloop: each warp's RG row groups of 16 weight rows times the tile's token groups of
// 8 (BM / 8 of them, the first `groups` holding rows), accumulator (token group i, row group r) at i * RG + r.
template <class Cfg> struct WeightsAsAMmaSync {
  static constexpr int RG = Cfg::ROW_GROUPS, GROUPS = Cfg::BM / 8, ACCS = GROUPS * RG;
  // This lane's ldmatrix rows (tokens i*8 + lane%8, k chunks 4h + lane/8, swizzled as TileLoader stores them).
  uint32_t tok_off[GROUPS][2];
  WarpWeightOffsets<Cfg> wo;

  __device__ __forceinline__ WeightsAsAMmaSync() {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < GROUPS; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = i * 8 + (lane & 7), ch = 4 * h + (lane >> 3);
        tok_off[i][h] = dev::opaque(row * 128 + ((ch ^ (row & 7)) << 4));
      }
    wo = WarpWeightOffsets<Cfg>::make();
  }

  // part += the products of k-blocks [kb_begin, kb_end) (one chunk's chain, in k order), the stages from pipe,
  // Pipe::kPer k-blocks a unit.
  template <class Pipe>
  __device__ __forceinline__ void chunk(float (&part)[ACCS][4], const uint8_t* smem, Pipe& pipe, int kb_begin,
                                        int kb_end, int groups) {
    static_assert(kKChunkKb % Pipe::kPer == 0, "a unit never spans two chunks (only a range's last one is short)");
    for (int kb = kb_begin; kb < kb_end; kb += Pipe::kPer) {
      const bool both = kb + 1 < kb_end;
      const uint32_t sunit = pipe.next(both);
#pragma unroll
      for (int u = 0; u < Pipe::kPer; ++u) {
        if (u > 0 && !both) break;
        k_block(part, smem, pipe.sbase(), sunit + u * Cfg::STAGE_BYTES, groups);
      }
    }
  }

  // part += one k-block's products from the stage at shared address sstage.
  __device__ __forceinline__ void k_block(float (&part)[ACCS][4], const uint8_t* smem, uint32_t sbase, uint32_t sstage,
                                          int groups) {
    const uint8_t* st = smem + (sstage - sbase);
    uint32_t wa[RG][4][4];
#pragma unroll
    for (int r = 0; r < RG; ++r)
      weight_fragments<Cfg>(st + wo.w_off + r * 16 * Cfg::B_ROW_BYTES, st + wo.sf_off + r * 64, wa[r]);
#pragma unroll
    for (int i = 0; i < GROUPS; ++i) {
      if (i >= groups) break;
      // Tokens i*8 .. i*8+7 as B fragments, two k16 steps per ldmatrix.x4 (matrix j = k chunk 4h + j), shared
      // by the row groups.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t b[4];
        dev::ldmatrix_x4(b, sstage + tok_off[i][h]);
#pragma unroll
        for (int r = 0; r < RG; ++r) {
          dev::mma_bf16_16816(part[i * RG + r], wa[r][2 * h], b);
          dev::mma_bf16_16816(part[i * RG + r], wa[r][2 * h + 1], b + 2);
        }
      }
    }
  }
};

}  // namespace fp4moe::cuda_backend
