// The epilogue of the weights-as-A tiles, one token group of 8 at a time. Thread (g, t) holds out(token 2t + {0,1}
// of group i, weight rows n0 + 16r + g and + 8), and the LoRA delta of the same fragment (lora_expand.cuh; here
// B_e rows are the A operand, the tokens' t rows the B operand), one pass per adapter of the group's 8 tokens (a
// pass per adapter of the whole tile would run every group through every adapter of the tile). The B fragments
// of a pass's first k16 step depend on the slot and the weight rows only: kept from the group before when its slot
// is the same (the rows are ordered by adapter, so a tile's groups mostly share one). The per-pair arithmetic
// (epilogue.cuh) takes column pairs (even, odd) of one token: lanes g and g + 1 (lane ^ 4) split a pair's tokens.
#pragma once
#include <cstdint>
#include <type_traits>

#include "cuda/gemm/epilogue.cuh"
#include "cuda/gemm/epilogue_a4.cuh"
#include "cuda/gemm/k_order.cuh"
#include "cuda/gemm/lora_rows.cuh"
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
  // The warp-specialised tile has registers to spare in its epilogue (the other tiles spilled with these uses): in
  // groups_from_shared it keeps its lanes' column constants (cp, else made a group at a time) and reads the next
  // group's sums ahead; without LoRA or A4 fusion it takes the token-major form (quads_from_shared) instead.
  static constexpr bool kSpareRegs = Cfg::WS;
  typename Epi::ColPre cp[kSpareRegs ? RG : 1][2];  // column pairs n0 + (gq & ~1) + 16r + 8h, the same every group
  int cached_slot = -1, crk = 0;  // warp-uniform: the slot whose B (rank crk, this expert) the fragments hold
  const uint16_t* cB = nullptr;
  uint32_t bfrag0[RG][4];         // its first k16 step's A operand (B rows n0 + 16r + g, + 8)

  // Each tile row's lookups in shared memory: LoRA slot and shrink row (and its B rows asked of L2), Epi::row_pre.
  struct Rows {
    const dev::LoraRowRef* lora;
    const uint32_t (*t0)[8];
    const typename Epi::RowPre* pre;
  };
  // Made while the first stages load: in the epilogue they were chains of dependent loads per token group (which
  // the fused A4 epilogue's lane exchanges kept from overlapping). Read after a barrier of the math threads.
  __device__ __forceinline__ static Rows lookup_rows(const GemmProblem& g, const typename Epi::Params& ep,
                                                     const TileRows& tr, int nb) {
    __shared__ dev::LoraRowRef s_lora_rows[Cfg::BM];
    __shared__ uint32_t s_lora_t0[kStageT0 ? Cfg::BM : 1][8];
    __shared__ typename Epi::RowPre s_row_pre[Cfg::BM];
    if (ep.lora.table) lora_lookup_rows<Cfg, Epi, Act>(g, ep, tr, nb, s_lora_rows, kStageT0 ? s_lora_t0 : nullptr);
    const int i = Cfg::THREADS - 1 - static_cast<int>(threadIdx.x);
    if (i < Cfg::BM && tr.row0 + i < tr.row_end) s_row_pre[i] = Epi::row_pre(ep, g, tr.row0 + i);
    return Rows{s_lora_rows, s_lora_t0, s_row_pre};
  }

  __device__ __forceinline__ WeightsAsAEpilogue(const typename Epi::Params& ep_, const TileRows& tr_, int n0_,
                                                const Rows& rows)
      : ep(ep_), tr(tr_), lora_rows(rows.lora), lora_t0(rows.t0), row_pre(rows.pre), n0(n0_) {
    const int lane = threadIdx.x & 31;
    gq = lane >> 2;
    t = lane & 3;
    x = Epi::template expert_ctx<Act>(ep, tr.expert);
    N = Epi::cols(ep);
  }
  __device__ __forceinline__ void col_pres(typename Epi::ColPre (&c)[RG][2]) const {
#pragma unroll
    for (int r = 0; r < RG; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) c[r][h] = Epi::col_pre(ep, x, n0 + (gq & ~1) + 16 * r + 8 * h);
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

  // The token groups with rows, their chunk sums in shared memory (accumulator (group i, row group r) at
  // sums[(i * RG + r) * THREADS]), in a rolled loop: unrolled over the groups with its LoRA passes, the epilogue was
  // most of a wgmma kernel's code (bench/NOTES.md, Version 11).
  // With kSpareRegs the next group's sums are read before this group's stores (the compiler keeps loads after them).
  __device__ __forceinline__ void groups_from_shared(const float4* sums, int groups) {
    if constexpr (kSpareRegs) col_pres(cp);
    float4 next[RG];
    auto read = [&](int i) {
#pragma unroll
      for (int r = 0; r < RG; ++r) next[r] = sums[(i * RG + r) * Cfg::THREADS];
    };
    if constexpr (kSpareRegs) read(0);
#pragma unroll 1
    for (int i = 0; i < groups; ++i) {
      if constexpr (!kSpareRegs) read(i);
      float ga[RG][4];
#pragma unroll
      for (int r = 0; r < RG; ++r) {
        ga[r][0] = next[r].x, ga[r][1] = next[r].y, ga[r][2] = next[r].z, ga[r][3] = next[r].w;
      }
      if constexpr (kSpareRegs) read(min(i + 1, groups - 1));
      if constexpr (Cfg::FP4) unscale_products(ga);
      group(i, ga);
    }
  }

  // GEMM1 quantizes a for GEMM2 in this epilogue (epilogue_a4.cuh: gated, two row groups a warp); block-uniform.
  static constexpr bool kA4Fusable = std::is_same_v<Epi, Epilogue1> && kGatedAct<Act> && RG == 2;
  __device__ __forceinline__ static bool a4_fused(const typename Epi::Params& ep) {
    if constexpr (kA4Fusable) return ep.a_quant_gs > 0.f;
    return false;
  }

  // The token-major form of the WS tile (no LoRA deltas, no A4 fusion; block-uniform). The last chunk's sums go
  // token-major into the warp's own float4 slots of each (group i, row group r): 8 token rows of 16 columns, the
  // rows rotated by r and the halves of odd row pairs swapped (the writes 2-way, the reads free of bank conflicts).
  // Each lane then stores four adjacent columns of a token: a warp's store covers 8 / RG tokens' 16 * RG columns.
  __device__ __forceinline__ static bool token_major(const typename Epi::Params& ep) {
    return kSpareRegs && !ep.lora.table && !a4_fused(ep);
  }
  // Float index in the sums of warp w's (group i, row group r, token j of the group, column c of the row group).
  __device__ __forceinline__ static int tm_at(int i, int r, int w, int j, int c) {
    const int row = (j + r) & 7;
    return ((i * RG + r) * Cfg::THREADS + w * 32) * 4 + row * 16 + (c ^ (((row >> 1) & 1) << 3));
  }
  // The last chunk: part += the running sums (the order of add_chunk_shared), then written token-major.
  template <int GROUPS>
  __device__ __forceinline__ static void store_token_major(float* base, float (&part)[RG][GROUPS][4], bool first) {
    const int w = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
    const int g = lane >> 2, t = lane & 3;
    if (!first) {
      const float4* own = reinterpret_cast<const float4*>(base) + threadIdx.x;
#pragma unroll
      for (int r = 0; r < RG; ++r)
#pragma unroll
        for (int i = 0; i < GROUPS; ++i) {
          const float4 v = add_chunk(own[(i * RG + r) * Cfg::THREADS],
                                     make_float4(part[r][i][0], part[r][i][1], part[r][i][2], part[r][i][3]));
          part[r][i][0] = v.x, part[r][i][1] = v.y, part[r][i][2] = v.z, part[r][i][3] = v.w;
        }
    }
    __syncwarp();  // every lane has read its slots before the warp writes over them
#pragma unroll
    for (int r = 0; r < RG; ++r)
#pragma unroll
      for (int i = 0; i < GROUPS; ++i)
#pragma unroll
        for (int q = 0; q < 4; ++q) base[tm_at(i, r, w, 2 * t + (q & 1), g + 8 * (q >> 1))] = part[r][i][q];
    __syncwarp();
  }
  // The groups from the token-major sums: the warp's 16 * RG columns of a token are 4 * RG lanes' four columns
  // each (lane l: columns n0 + 4 * (l % (4 * RG)) ... + 3), so a group is RG steps of 8 / RG tokens.
  __device__ __forceinline__ void quads_from_shared(const float* base, int groups) {
    constexpr int kLanesPerToken = 4 * RG, kSteps = RG;
    const int lane = static_cast<int>(threadIdx.x) & 31, w = static_cast<int>(threadIdx.x) >> 5;
    const int q = lane % kLanesPerToken, r = q >> 2, c = 4 * (q & 3), col = n0 + 16 * r + c;
    const int j0 = lane / kLanesPerToken;  // the lane's token of each step: j0 + step * (8 / RG)
    const typename Epi::ColPre cq[2] = {Epi::col_pre(ep, x, col), Epi::col_pre(ep, x, col + 2)};
    float4 v[kSteps];
    auto read = [&](int i) {
#pragma unroll
      for (int h = 0; h < kSteps; ++h)
        v[h] = *reinterpret_cast<const float4*>(base + tm_at(i, r, w, j0 + h * (8 / RG), c));
    };
    read(0);
#pragma unroll 1
    for (int i = 0; i < groups; ++i) {
      float o[kSteps][4];
#pragma unroll
      for (int h = 0; h < kSteps; ++h) o[h][0] = v[h].x, o[h][1] = v[h].y, o[h][2] = v[h].z, o[h][3] = v[h].w;
      read(min(i + 1, groups - 1));
      if constexpr (Cfg::FP4) unscale_products(o);
#pragma unroll
      for (int h = 0; h < kSteps; ++h) {
        const int row = tr.row0 + i * 8 + j0 + h * (8 / RG);
        if (row < tr.row_end) {
          const auto rc = Epi::row_ctx(ep, x, row, row_pre[row - tr.row0]);
          Epi::template quad<Act>(ep, x, rc, cq, col, o[h]);
        }
      }
    }
  }

  // Token group i, its sums ga (ga[r]: row group r). A pair (rows 2m, 2m + 1) of a token is split between lanes
  // gq = 2m and 2m + 1 (lane ^ 4): the even lane takes token 2t, the odd lane token 2t + 1, each receiving the
  // other's row by one shuffle, so that every lane runs the pair arithmetic of half the pairs (with every pair on
  // the even lanes, half of each warp idled through the epilogue's arithmetic).
  __device__ __forceinline__ void group(int i, const float (&ga)[RG][4]) {
    float dl[RG][4];
#pragma unroll
    for (int r = 0; r < RG; ++r) dl[r][0] = dl[r][1] = dl[r][2] = dl[r][3] = 0.f;
    const bool lora = ep.lora.table != nullptr;  // block-uniform
    if (lora) lora_deltas(i, dl);
    typename Epi::ColPre cg[RG][2];
    if constexpr (kSpareRegs) {
#pragma unroll
      for (int r = 0; r < RG; ++r) cg[r][0] = cp[r][0], cg[r][1] = cp[r][1];
    } else {
      col_pres(cg);
    }
    if constexpr (kA4Fusable) {
      if (a4_fused(ep)) {
        float nb[RG][4], dn[RG][4];
#pragma unroll
        for (int r = 0; r < RG; ++r)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            nb[r][q] = __shfl_down_sync(0xffffffffu, ga[r][q], 4);
            dn[r][q] = __shfl_down_sync(0xffffffffu, dl[r][q], 4);
          }
        fused_a4_store<Act>(ep, row_pre, x, cg, tr, i, n0, ga, nb, dl, dn);
        return;
      }
    }
    const int tk = gq & 1;  // this lane's token of the pair: 2t + tk
    const int row = tr.row0 + i * 8 + 2 * t + tk;
    float c[RG][2][2], l[RG][2][2];  // [r][h: rows +0 / +8][row 2m, 2m + 1]
#pragma unroll
    for (int r = 0; r < RG; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Each lane sends the value of the token its partner takes (selects: no indexing by the lane's parity).
        const float own = tk ? ga[r][2 * h + 1] : ga[r][2 * h];
        const float got = __shfl_xor_sync(0xffffffffu, tk ? ga[r][2 * h] : ga[r][2 * h + 1], 4);
        c[r][h][0] = tk ? got : own;
        c[r][h][1] = tk ? own : got;
        l[r][h][0] = l[r][h][1] = 0.f;
        if (lora) {
          const float down = tk ? dl[r][2 * h + 1] : dl[r][2 * h];
          const float dgot = __shfl_xor_sync(0xffffffffu, tk ? dl[r][2 * h] : dl[r][2 * h + 1], 4);
          l[r][h][0] = tk ? dgot : down;
          l[r][h][1] = tk ? down : dgot;
        }
      }
    if (row < tr.row_end) {  // no early exit: the next group's shuffles need every lane converged
      const auto rc = Epi::row_ctx(ep, x, row, row_pre[row - tr.row0]);
      const int col0 = n0 + (gq & ~1);
#pragma unroll
      for (int r = 0; r < RG; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          Epi::template pair<Act>(ep, x, rc, cg[r][h], col0 + 16 * r + 8 * h, c[r][h][0], c[r][h][1], l[r][h][0],
                                  l[r][h][1]);
    }
  }
};

}  // namespace fp4moe::cuda_backend
