// The epilogue of the TokensAsA64 tile: the LoRA expand of each m16 row group and the per-pair arithmetic of
// epilogue.cuh.
#pragma once
#include <cstdint>

#include "cuda/gemm/epilogue.cuh"
#include "cuda/gemm/mainloop_mma_sync.cuh"
#include "cuda/lora_expand.cuh"

namespace fp4moe::cuda_backend {

// The epilogue of one mma.sync block tile: thread (lane) holds acc[mt][nt][2*half + {0,1}] = output
// (row wm*WTM + mt*16 + lane/4 + 8*half, columns wn*WTN + nt*8 + 2*(lane%4) + {0,1}). The LoRA delta of each
// m16n8 fragment has the same layout: tokens' t rows as the A operand, B_e rows (one per column) as B.
template <class Cfg, class Epi, class Act>
__device__ __forceinline__ void tile_epilogue(const typename Epi::Params& p, const GemmProblem& g,
                                              const TokensAsAMainloop<Cfg>& ml, const TileRows& tr, int n0,
                                              const dev::LoraRowRef* lora_rows, const uint32_t (*lora_t0)[8]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
  const int wm = warp / Cfg::WARPS_N, wn = warp % Cfg::WARPS_N;
  const int N = Epi::cols(p);
  const auto x = Epi::template expert_ctx<Act>(p, tr.expert);
  if (p.lora.table) __syncthreads();  // lora_rows (block-uniform)
#pragma unroll
  for (int mt = 0; mt < Cfg::MT; ++mt) {
    typename Epi::RowCtx rc[2];
    dev::LoraRowRef rr[2];
    int lr[2] = {0, 0};  // the rows' indices in the tile (lora_rows, lora_t0)
    bool valid[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = tr.row0 + wm * Cfg::WTM + mt * 16 + gq + half * 8;
      valid[half] = r < tr.row_end;
      if (!valid[half]) continue;
      rc[half] = Epi::row_ctx(p, g, x, r);
      lr[half] = r - tr.row0;
      if (p.lora.table) rr[half] = lora_rows[lr[half]];
    }
    // The LoRA deltas of the warp's 16 x WTN outputs of this mt: one pass per adapter present in the 16 rows.
    float dl[Cfg::NT][4];
#pragma unroll
    for (int nt = 0; nt < Cfg::NT; ++nt) dl[nt][0] = dl[nt][1] = dl[nt][2] = dl[nt][3] = 0.f;
    if (p.lora.table) {
      const int keys[2] = {rr[0].slot, rr[1].slot};
      dev::for_each_slot(keys, [&](int s) {
        const LoraProj& pj = p.lora.table[s].proj[p.lora.which];
        const int rk = pj.r;
        const uint16_t* B = pj.B + static_cast<int64_t>(tr.expert) * N * rk;
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; ++nt) {
          const int n = n0 + wn * Cfg::WTN + nt * 8 + gq;  // this lane's B column
          const uint16_t* brow = n < N ? B + static_cast<int64_t>(Epi::template lora_b_row<Act>(p, n)) * rk : nullptr;
          float d[4];
          dev::lora_mma(
              d, rk,
              [&](int k0, uint32_t a[4]) {
                if (k0 == 0) {  // staged by lora_lookup_rows (by each row's own rank: other rows are discarded)
                  a[0] = lora_t0[lr[0]][t];
                  a[1] = lora_t0[lr[1]][t];
                  a[2] = lora_t0[lr[0]][t + 4];
                  a[3] = lora_t0[lr[1]][t + 4];
                  return;
                }
                // A row of another slot reads nothing past its own t row (its result is discarded anyway).
                const int k_0 = rr[0].slot == s ? rk : 0, k_1 = rr[1].slot == s ? rk : 0;
                a[0] = dev::lora_t_pair(rr[0].t, k_0, k0 + 2 * t);
                a[1] = dev::lora_t_pair(rr[1].t, k_1, k0 + 2 * t);
                a[2] = dev::lora_t_pair(rr[0].t, k_0, k0 + 2 * t + 8);
                a[3] = dev::lora_t_pair(rr[1].t, k_1, k0 + 2 * t + 8);
              },
              [&](int k0, uint32_t b[2]) {
                b[0] = dev::lora_b_pair(brow, rk, k0 + 2 * t);
                b[1] = dev::lora_b_pair(brow, rk, k0 + 2 * t + 8);
              });
          if (rr[0].slot == s) { dl[nt][0] = dev::round_to_bf16(d[0]); dl[nt][1] = dev::round_to_bf16(d[1]); }
          if (rr[1].slot == s) { dl[nt][2] = dev::round_to_bf16(d[2]); dl[nt][3] = dev::round_to_bf16(d[3]); }
        }
      });
    }
#pragma unroll
    for (int nt = 0; nt < Cfg::NT; ++nt) {
      const int col = n0 + wn * Cfg::WTN + nt * 8 + 2 * t;
      const auto cp = Epi::col_pre(p, x, col);
#pragma unroll
      for (int half = 0; half < 2; ++half)
        if (valid[half])
          Epi::template pair<Act>(p, x, rc[half], cp, col, ml.acc[mt][nt][2 * half], ml.acc[mt][nt][2 * half + 1],
                                  dl[nt][2 * half], dl[nt][2 * half + 1]);
    }
  }
}

}  // namespace fp4moe::cuda_backend
