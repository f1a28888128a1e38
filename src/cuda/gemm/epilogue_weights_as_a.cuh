// The epilogue of the weights-as-A tiles, one token group of 8 at a time. Thread (g, t) holds out(token 2t + {0,1}
// of group i, weight rows n0 + 16r + g and + 8), and the LoRA delta of the same fragment (lora_expand.cuh; here
// B_e rows are the A operand, the tokens' t rows the B operand), one pass per adapter of the group's 8 tokens (a
// pass per adapter of the whole tile would run every group through every adapter of the tile). The B fragments
// of a pass's first k16 step depend on the slot and the weight rows only: kept from the group before when its slot
// is the same (the rows are ordered by adapter, so a tile's groups mostly share one). The per-pair arithmetic
// (epilogue.cuh) takes column pairs (even, odd) of one row: row g + 1's values come from lane + 4.
#pragma once
#include <cstdint>
#include <type_traits>

#include "cuda/gemm/epilogue.cuh"
#include "cuda/gemm/epilogue_a4.cuh"
#include "cuda/lora_expand.cuh"

namespace fp4moe::cuda_backend {

template <class Cfg, class Epi, class Act> struct WeightsAsAEpilogue {
  static constexpr int RG = Cfg::ROW_GROUPS;
  // Tiles of 32+ rows keep each row's first-step t operand in shared memory (lora_lookup_rows' t0); the 8-row
  // tile cannot spare the 256 bytes (five blocks an SM fill its shared memory).
  static constexpr bool kStageT0 = Cfg::BM >= 32;
  const typename Epi::Params& ep;
  const TileRows& tr;
  const dev::LoraRowRef* lora_rows;    // [BM], lora_lookup_rows
  const uint32_t (*lora_t0)[8];        // [BM][8] when kStageT0
  const typename Epi::RowPre* row_pre;  // [BM], Epi::row_pre of each tile row
  int n0, N, gq, t;
  typename Epi::ExpertCtx x;
  int cached_slot = -1, crk = 0;  // warp-uniform: the slot whose B (rank crk, this expert) the fragments hold
  const uint16_t* cB = nullptr;
  uint32_t bfrag0[RG][4];         // its first k16 step's A operand (B rows n0 + 16r + g, + 8)

  __device__ __forceinline__ WeightsAsAEpilogue(const typename Epi::Params& ep_, const TileRows& tr_, int n0_,
                                                const dev::LoraRowRef* rows, const uint32_t (*t0)[8],
                                                const typename Epi::RowPre* pre)
      : ep(ep_), tr(tr_), lora_rows(rows), lora_t0(t0), row_pre(pre), n0(n0_) {
    const int lane = threadIdx.x & 31;
    gq = lane >> 2;
    t = lane & 3;
    x = Epi::template expert_ctx<Act>(ep, tr.expert);
    N = Epi::cols(ep);
  }

  __device__ __forceinline__ void b_rows(int r, const uint16_t*& ba, const uint16_t*& bb) const {
    const int na = n0 + 16 * r + gq, nb8 = na + 8;
    ba = na < N ? cB + static_cast<int64_t>(Epi::template lora_b_row<Act>(ep, na)) * crk : nullptr;
    bb = nb8 < N ? cB + static_cast<int64_t>(Epi::template lora_b_row<Act>(ep, nb8)) * crk : nullptr;
  }
  __device__ __forceinline__ void b_step(const uint16_t* ba, const uint16_t* bb, int k0, uint32_t a[4]) const {
    a[0] = dev::lora_b_pair(ba, crk, k0 + 2 * t);
    a[1] = dev::lora_b_pair(bb, crk, k0 + 2 * t);
    a[2] = dev::lora_b_pair(ba, crk, k0 + 2 * t + 8);
    a[3] = dev::lora_b_pair(bb, crk, k0 + 2 * t + 8);
  }

  // Token group i's LoRA deltas dl (bf16-rounded, +0 for base rows).
  __device__ __forceinline__ void lora_deltas(int i, float (&dl)[RG][4]) {
    const dev::LoraRowRef rr = lora_rows[i * 8 + gq];  // this lane's B column: token gq of the group
    const int sel0 = __shfl_sync(0xffffffffu, rr.slot, 8 * t), sel1 = __shfl_sync(0xffffffffu, rr.slot, 8 * t + 4);
    // The first step's t operand, by the token's own rank: the same values as by the pass's slot rank for the
    // tokens that keep the pass's result; the other columns are discarded.
    uint32_t tb0[2];
    if constexpr (kStageT0) {
      tb0[0] = lora_t0[i * 8 + gq][t];  // k = 2t, 2t + 1
      tb0[1] = lora_t0[i * 8 + gq][t + 4];  // k = 2t + 8, 2t + 9
    } else {
      tb0[0] = dev::lora_t_pair(rr.t, rr.r, 2 * t);
      tb0[1] = dev::lora_t_pair(rr.t, rr.r, 2 * t + 8);
    }
    const int keys[1] = {rr.slot};
    dev::for_each_slot(keys, [&](int s) {
      if (s != cached_slot) {
        const LoraProj& pj = ep.lora.table[s].proj[ep.lora.which];
        cached_slot = s;
        crk = pj.r;
        cB = pj.B + static_cast<int64_t>(tr.expert) * N * crk;
#pragma unroll
        for (int r = 0; r < RG; ++r) {
          const uint16_t *ba, *bb;
          b_rows(r, ba, bb);
          b_step(ba, bb, 0, bfrag0[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < RG; ++r) {
        // One chain over k < crk from +0 (lora_mma's order): the cached first step, then any further steps.
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        dev::mma_bf16_16816(d, bfrag0[r], tb0);
        if (crk > 16) {
          const uint16_t *ba, *bb;
          b_rows(r, ba, bb);
          // A token of another slot reads nothing past its own t row (its columns are discarded anyway).
          const int own_k = rr.slot == s ? crk : 0;
          for (int k0 = 16; k0 < crk; k0 += 16) {
            uint32_t a[4];
            b_step(ba, bb, k0, a);
            const uint32_t b[2] = {dev::lora_t_pair(rr.t, own_k, k0 + 2 * t),
                                   dev::lora_t_pair(rr.t, own_k, k0 + 2 * t + 8)};
            dev::mma_bf16_16816(d, a, b);
          }
        }
        if (sel0 == s) { dl[r][0] = dev::round_to_bf16(d[0]); dl[r][2] = dev::round_to_bf16(d[2]); }
        if (sel1 == s) { dl[r][1] = dev::round_to_bf16(d[1]); dl[r][3] = dev::round_to_bf16(d[3]); }
      }
    });
  }

  // Token group i, its sums ga (ga[r]: row group r).
  __device__ __forceinline__ void group(int i, const float (&ga)[RG][4]) {
    float dl[RG][4];
#pragma unroll
    for (int r = 0; r < RG; ++r) dl[r][0] = dl[r][1] = dl[r][2] = dl[r][3] = 0.f;
    if (ep.lora.table) lora_deltas(i, dl);
    float nb[RG][4], dn[RG][4];
#pragma unroll
    for (int r = 0; r < RG; ++r)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        nb[r][q] = __shfl_down_sync(0xffffffffu, ga[r][q], 4);
        dn[r][q] = __shfl_down_sync(0xffffffffu, dl[r][q], 4);
      }
    if constexpr (std::is_same_v<Epi, Epilogue1> && kGatedAct<Act> && RG == 2) {
      if (ep.a_quant_gs > 0.f) {  // A4 fused (block-uniform)
        fused_a4_store<Act>(ep, row_pre, x, tr, i, n0, ga, nb, dl, dn);
        return;
      }
    }
    if ((gq & 1) == 0) {  // no early exit: the next group's expand needs every lane converged
#pragma unroll
      for (int tk = 0; tk < 2; ++tk) {
        const int row = tr.row0 + i * 8 + 2 * t + tk;
        if (row >= tr.row_end) continue;
        const auto rc = Epi::row_ctx(ep, x, row, row_pre[row - tr.row0]);
#pragma unroll
        for (int r = 0; r < RG; ++r) {
          Epi::template pair<Act>(ep, x, rc, n0 + 16 * r + gq, ga[r][tk], nb[r][tk], dl[r][tk], dn[r][tk]);
          Epi::template pair<Act>(ep, x, rc, n0 + 16 * r + gq + 8, ga[r][2 + tk], nb[r][2 + tk], dl[r][2 + tk],
                                  dn[r][2 + tk]);
        }
      }
    }
  }
};

}  // namespace fp4moe::cuda_backend
