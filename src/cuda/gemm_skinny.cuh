// The grouped GEMM up to a few hundred rows per expert (decode, small and medium batches: plan.cpp picks it up to
// 512 expected rows an expert): the weights are the mma A operand (one or two groups of 16 weight rows per warp)
// and the tokens the B operand (8 per mma), so a tile of up to 32 token rows reads each weight byte once, and the
// block's many narrow column tiles keep many k-block streams in flight.
// Tokens and weights come through the STAGES shared-memory stages of gemm_mainloop.cuh (TileLoader: the weights
// by bulk copies on sm_90, the tokens by cp.async). When the grid is small (decode), the plan splits a tile's K
// chunks over gridDim.z blocks (kernels.h GemmProblem::split).
//
// Assumptions (asserted or guaranteed by the plan): N and K are multiples of 16; the weights use the
// prepared layout of kernels.h; a tile has at most BM (8 or 32) rows, in groups of 8 tokens.
//
// Bits: out(row m, col n) = sum over k of A[m][k] * W[n][k] follows the canonical K order of gemm_mainloop.cuh
// (per chunk the same chain of m16n8k16 steps with the same 16 products per step, chunk sums added in order);
// only the operand roles are swapped, and a split tile adds the same chunk sums in the same order. The result
// is the same bits (checked on the H200 by the batch-invariance tests, which compare this kernel's tokens with
// the large-tile kernel's). Steps past K multiply zero padding, as there.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/gemm_grouped.cuh"
#include "cuda/pdl.cuh"
#include "cuda/wgmma.cuh"

namespace fp4moe::cuda_backend {

// BM tokens x BN = 16 * RG * WARPS weight rows a block (RG row groups of 16 per warp); a stage is laid out as the
// mma.sync tile's (tokens in sA, weights and scales in sB / sSF), so the tokens stream with the weights.
// WGMMA (sm_90a, RG = 1): each warpgroup multiplies its 64 weight rows (register A, the same fragments) by all BM
// tokens (shared B) with one wgmma m64nBMk16 a k16 step; the accumulators are the same fragments as BM / 8 token
// groups of mma.sync, so the split-K and epilogue code below serve both.
template <int BM, int WARPS, int STAGES, bool FP4, int RG = 2, bool WGMMA = false>
using SkinnyConfig = TileConfig<BM, 16 * RG * WARPS, 1, WARPS, STAGES, FP4, true, WGMMA>;

// One warp's A fragments (16 weight rows x one k16 step) for the 4 steps of a k-block in shared memory:
// thread (g, t) holds rows g and g + 8 at k = 2t, 2t+1 and 2t+8, 2t+9 — in the prepared layout, the bytes
// that the mma.sync tile reads as B fragments of the same rows. st: the thread's bytes of row g (row g's start +
// t * 8 for NVFP4, + t * 32 for bf16); sf: row g's 4 scale bytes.
template <class Cfg>
__device__ __forceinline__ void weight_fragments(const uint8_t* st, const uint8_t* sf, uint32_t wa[4][4]) {
  constexpr int kRow8 = 8 * Cfg::B_ROW_BYTES;  // row g + 8
  if constexpr (Cfg::FP4) {
    uint32_t w0[4][2], w1[4][2];
    dev::fp4_row_fragments(*reinterpret_cast<const uint2*>(st), *reinterpret_cast<const uint32_t*>(sf), w0);
    dev::fp4_row_fragments(*reinterpret_cast<const uint2*>(st + kRow8), *reinterpret_cast<const uint32_t*>(sf + 32),
                           w1);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      wa[s][0] = w0[s][0];
      wa[s][1] = w1[s][0];
      wa[s][2] = w0[s][1];
      wa[s][3] = w1[s][1];
    }
  } else {
    const uint4 a0 = *reinterpret_cast<const uint4*>(st);
    const uint4 a1 = *reinterpret_cast<const uint4*>(st + 16);
    const uint4 b0 = *reinterpret_cast<const uint4*>(st + kRow8);
    const uint4 b1 = *reinterpret_cast<const uint4*>(st + kRow8 + 16);
    wa[0][0] = a0.x; wa[0][1] = b0.x; wa[0][2] = a0.y; wa[0][3] = b0.y;
    wa[1][0] = a0.z; wa[1][1] = b0.z; wa[1][2] = a0.w; wa[1][3] = b0.w;
    wa[2][0] = a1.x; wa[2][1] = b1.x; wa[2][2] = a1.y; wa[2][3] = b1.y;
    wa[3][0] = a1.z; wa[3][1] = b1.z; wa[3][2] = a1.w; wa[3][3] = b1.w;
  }
}

// Blocks an SM must hold (sets the register cap): as many as the stages' shared memory lets in (1 KB of it
// reserved per block). On sm_90 (228 KB: NVFP4 config 0: 5, config 1: 4; bf16: 1); left to itself, ptxas gave
// NVFP4 config 1 137 registers (3 blocks). Other architectures are not capped: their shared memory differs
// (sm_80 164 KB, sm_89 / sm_120 100 KB) and 228 KB's counts made ptxas spill there. The 64-token wgmma tile holds
// BM / 2 accumulator registers a thread (its chunk sums in shared memory): two blocks.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
constexpr int kSkinnySmemPerSm = 228 * 1024;
#else
constexpr int kSkinnySmemPerSm = 0;
#endif
template <class Cfg> constexpr int kSkinnyMinBlocks =
    Cfg::WGMMA ? 2 : std::max(1, kSkinnySmemPerSm / (Cfg::SMEM_BYTES + 1024));

// GEMM1's epilogue with a's A4 quantization fused (Epilogue1Params::a_quant_gs; gated activations, two row groups a
// warp): the warp's 32 weight rows n0.. are 16 gate | up pairs, a's columns n0 / 2 .. + 15 — one NVFP4 block (n0 is
// a multiple of 32) — of each of the group's tokens. Lane (g, t) holds gate (g even) or up (g odd) rows of tokens 2t
// and 2t + 1; the pair's lanes swap one token's values, so that the even lane makes token 2t's 4 values of a and the
// odd lane token 2t + 1's (every lane busy: with the even lanes doing both tokens, the fused epilogue cost more
// than the separate quantize launch, kimi_k3_tp8 A4 T=1024 +37 us). The block's amax is taken over the lanes of one
// token (t, g of one parity: xor 8, 16), and each value is quantized as quantize_block does (nvfp4_device.cuh), so
// out holds the same bits as GEMM1 then quantize_blocks_kernel. act_out keeps a. up / dup: the odd lane's values
// (lane + 4), as the caller exchanged them; ga: the group's sums (row group r).
template <class Act, int RG>
__device__ __forceinline__ void fused_a4_store(const Epilogue1Params& ep, const Epilogue1::RowPre* row_pre,
                                               const Epilogue1::ExpertCtx& x, const TileRows& tr, int i, int n0,
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
      ab[r][h] = mine ? dev::f32_to_bf16(Epilogue1::gated_value<Act>(ep, x, rc, col, g0, u0, gd, ud)) : uint16_t{0};
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

// One block tile (rows tr, weight rows [nb, nb + BN), k-blocks kr) through the pipeline `pipe` (TilePipeline), then
// its epilogue; a split tile's blocks but the last return without an epilogue.
template <class Cfg, class Epi, class Act, class Pipe>
__device__ __forceinline__ void skinny_tile(const GemmProblem& g, const typename Epi::Params& ep, uint8_t* smem,
                                            const TileRows& tr, int nb, KRange kr, Pipe& pipe) {
  // RG row groups of 16 weight rows per warp: the token fragments, the loads and the loop are shared by RG
  // decode streams (a decode GEMM is bound by the instructions per weight byte).
  constexpr int RG = Cfg::BN / (16 * Cfg::WARPS_N);
  static_assert(Cfg::WEIGHTS_AS_A && Cfg::WARPS_M == 1 && (RG == 1 || RG == 2) && Cfg::BN == 16 * RG * Cfg::WARPS_N &&
                    Cfg::BM % 8 == 0 && (!Cfg::WGMMA || RG == 1),
                "skinny tile");
  constexpr int GROUPS = Cfg::BM / 8;
  constexpr int ACCS = GROUPS * RG;  // accumulator (token group i, row group r) at i * RG + r
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
  const int n0 = nb + warp * 16 * RG;                  // this warp's first weight row
  const int groups = (tr.row_end - tr.row0 + 7) >> 3;  // token groups with rows (uniform)
  const int KB = static_cast<int>(g.B.Kp / Cfg::BK);

  // LoRA: each tile row's slot and shrink row (and its B rows asked of L2) while the first stages load; the
  // epilogue reads them after the loop. In the epilogue, group by group, the lookups made each group's expand wait
  // one more chain: kimi_k3_tp8 T=4096's GEMM2 took 1760 us with LoRA against 872 without (ncu).
  // Tiles of 32+ rows also keep each row's first-step t operand in shared memory (lora_lookup_rows' t0); the 8-row
  // tile cannot spare the 256 bytes (five blocks an SM fill its shared memory to 1.1 KB).
  constexpr bool kStageT0 = Cfg::BM >= 32;
  __shared__ dev::LoraRowRef s_lora_rows[Cfg::BM];
  __shared__ uint32_t s_lora_t0[kStageT0 ? Cfg::BM : 1][8];
  if (ep.lora.table)
    lora_lookup_rows<Cfg, Epi, Act>(g, ep, tr, nb, s_lora_rows,
                                    kStageT0 ? s_lora_t0 : nullptr);
  // Likewise each tile row's epilogue loads (Epi::row_pre: entry, token scale): in the epilogue they were a chain of
  // dependent loads per token group, which the A4 fused epilogue's lane exchanges kept from overlapping (kimi_k3_tp8
  // A4 T=1024: GEMM1 +58 us with them in the epilogue, ncu).
  __shared__ typename Epi::RowPre s_row_pre[Cfg::BM];
  {
    const int i = Cfg::THREADS - 1 - static_cast<int>(threadIdx.x);
    if (i < Cfg::BM && tr.row0 + i < tr.row_end) s_row_pre[i] = Epi::row_pre(ep, g, tr.row0 + i);
  }

  // Split-K: this block's chunk sums go to partials[tile][chunk][thread]
  // (tile = blockIdx.x, y).
  const int chunks = (KB + kChunkBlocks - 1) / kChunkBlocks;
  const int64_t tile_lin = static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y;
  auto partial_at = [&](int chunk) {
    return reinterpret_cast<float4*>(g.partials) + ((tile_lin * chunks + chunk) * Cfg::THREADS + threadIdx.x) * ACCS;
  };

  // This lane's ldmatrix rows (tokens i*8 + lane%8, k chunks 4h + lane/8, swizzled as TileLoader stores them),
  // and its weight and scale bytes in a stage (weight_fragments). Held in registers (dev::opaque), not worked out
  // again from threadIdx in every k-block: the loop's time is its instruction count.
  uint32_t tok_off[GROUPS][2];
#pragma unroll
  for (int i = 0; i < GROUPS; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = i * 8 + (lane & 7), ch = 4 * h + (lane >> 3);
      tok_off[i][h] = dev::opaque(row * 128 + ((ch ^ (row & 7)) << 4));
    }
  const uint32_t w_off =
      dev::opaque(Cfg::A_BYTES + (warp * RG * 16 + gq) * Cfg::B_ROW_BYTES + t * (Cfg::FP4 ? 8 : 32));
  const uint32_t sf_off = dev::opaque(Cfg::A_BYTES + Cfg::B_BYTES + (warp * RG * 16 + gq) * 4);

  float acc[ACCS][4], part[ACCS][4];
  // wgmma: this thread's chunk sums after the stages (gemm_smem_bytes), float4 a of them at [a][thread].
  float4* chunk_sums = reinterpret_cast<float4*>(smem + Cfg::STAGES * Cfg::STAGE_BYTES) + threadIdx.x;
#pragma unroll
  for (int a = 0; a < ACCS; ++a)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[a][q] = 0.f;

  for (int kc = kr.begin; kc < kr.end; kc += kChunkBlocks) {  // one K chunk: one chain per output
#pragma unroll
    for (int a = 0; a < ACCS; ++a)
#pragma unroll
      for (int q = 0; q < 4; ++q) part[a][q] = 0.f;
    const int kc_end = min(kc + kChunkBlocks, kr.end);
    if constexpr (Cfg::WGMMA) {
      // One wgmma a k16 step: D[64 rows][BM tokens] += A (the warp's fragments) . B (the stage's token rows, 32
      // bytes a step); every token row is multiplied (rows past the tile are zero-filled, their outputs never
      // stored). A k-block's wgmmas run on while the next k-block is waited for and decoded: two fragment buffers,
      // the wait one k-block later (StagePipe loads one k-block less ahead); k-blocks in pairs with the odd one
      // after (a pair's second k-block under a condition made ptxas serialize every wgmma: C7513). The chunk sums
      // live in shared memory (two register sets spilled at 128 registers). H200: 1-2.6 % faster than waiting
      // for each k-block's wgmmas before the next.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      const uint64_t desc0 = dev::wgmma_desc_sw128(pipe.sbase());  // stage 0's token rows, k16 step 0
      auto k_block = [&](uint32_t (&w)[4][4]) {
        const uint32_t off = pipe.next() - pipe.sbase();
        const uint8_t* st = smem + off;
        weight_fragments<Cfg>(st + w_off, st + sf_off, w);
        dev::wgmma_fence_acc(part);
        dev::wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; ++s)
          dev::Wgmma<Cfg::BM>::rs(part, w[s], dev::wgmma_desc_advance(desc0, off + 32 * s), true);
        dev::wgmma_commit();
        dev::wgmma_wait<1>();  // the k-block before: its stage and fragment buffer are free again
        pipe.release_older();
      };
      uint32_t wa[2][4][4];
      int kb = kc;
      for (; kb + 1 < kc_end; kb += 2) {
        k_block(wa[0]);
        k_block(wa[1]);
      }
      for (; kb < kc_end; ++kb) k_block(wa[0]);  // the odd one (a loop: an if here gave other, untested code)
      dev::wgmma_wait<0>();
      pipe.release_all();
      dev::wgmma_fence_acc(part);
#else
      __trap();  // the plan picks this tile on sm_90a devices only (ProblemShape::wgmma)
#endif
    } else {
      for (int kb = kc; kb < kc_end; ++kb) {
        const uint32_t sstage = pipe.next();
        const uint8_t* st = smem + (sstage - pipe.sbase());
        uint32_t wa[RG][4][4];
#pragma unroll
        for (int r = 0; r < RG; ++r)
          weight_fragments<Cfg>(st + w_off + r * 16 * Cfg::B_ROW_BYTES, st + sf_off + r * 64, wa[r]);
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
    }
    if (g.split > 1) {  // chunk done
      float4* dst = partial_at(kc / kChunkBlocks);
#pragma unroll
      for (int a = 0; a < ACCS; ++a) dst[a] = make_float4(part[a][0], part[a][1], part[a][2], part[a][3]);
    } else if constexpr (Cfg::WGMMA) {
      add_chunk_shared<Cfg::THREADS>(chunk_sums, part, kc == kr.begin);
    } else {
      add_chunk(acc, part, kc == 0);
    }
  }
  pipe.finish();

  if (g.split > 1) {  // the last block of the tile adds every chunk sum in chunk order
    __shared__ int last;
    __threadfence();
    math_sync<Cfg>();
    if (threadIdx.x == 0) {
      const int done = atomicAdd(g.counters + tile_lin, 1);
      last = done == g.split - 1;
      if (last) g.counters[tile_lin] = 0;  // ready for the next call
    }
    math_sync<Cfg>();
    if (!last) return;
    __threadfence();
    for (int c = 0; c < chunks; ++c) {
      const float4* src = partial_at(c);
#pragma unroll
      for (int a = 0; a < ACCS; ++a) {
        const float4 v = __ldcg(src + a);
        const float p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[a][q] = c == 0 ? p[q] : __fadd_rn(acc[a][q], p[q]);
      }
    }
  }
  if constexpr (Cfg::FP4 && !Cfg::WGMMA) unscale_products(acc);  // wgmma: group by group below

  // Thread (g, t) holds out(token 2t + {0,1} of group i, weight rows n0 + 16r + g and + 8), and the LoRA delta of
  // the same fragment (lora_expand.cuh; here B_e rows are the A operand, the tokens' t rows the B operand), one
  // pass per adapter of the group's 8 tokens (a pass per adapter of the whole tile instead ran every group through
  // every adapter of the tile: kimi T=1024 with LoRA 1540 -> 1879 us). The B fragments of a pass's first k16 step
  // depend on the slot and the weight rows only: kept from the group before when its slot is the same (the rows
  // are ordered by adapter, so a tile's groups mostly share one), not loaded again. The epilogue takes column
  // pairs (even, odd) of one row: row g + 1's values come from lane + 4.
  const auto x = Epi::template expert_ctx<Act>(ep, tr.expert);
  const int N = Epi::cols(ep);
  math_sync<Cfg>();  // s_lora_rows, s_row_pre (block-uniform: every math thread gets here or none)
  int cached_slot = -1, crk = 0;  // warp-uniform: the slot whose B (rank crk, this expert) the fragments hold
  const uint16_t* cB = nullptr;
  uint32_t bfrag0[RG][4];         // its first k16 step's A operand (B rows n0 + 16r + g, + 8)
  auto b_rows = [&](int r, const uint16_t*& ba, const uint16_t*& bb) {
    const int na = n0 + 16 * r + gq, nb8 = na + 8;
    ba = na < N ? cB + static_cast<int64_t>(Epi::template lora_b_row<Act>(ep, na)) * crk : nullptr;
    bb = nb8 < N ? cB + static_cast<int64_t>(Epi::template lora_b_row<Act>(ep, nb8)) * crk : nullptr;
  };
  auto b_step = [&](const uint16_t* ba, const uint16_t* bb, int k0, uint32_t a[4]) {
    a[0] = dev::lora_b_pair(ba, crk, k0 + 2 * t);
    a[1] = dev::lora_b_pair(bb, crk, k0 + 2 * t);
    a[2] = dev::lora_b_pair(ba, crk, k0 + 2 * t + 8);
    a[3] = dev::lora_b_pair(bb, crk, k0 + 2 * t + 8);
  };
  // Token group i, its sums ga (ga[r]: accumulator i * RG + r).
  auto epilogue_group = [&](int i, const float (&ga)[RG][4]) {
    float dl[RG][4];
#pragma unroll
    for (int r = 0; r < RG; ++r) dl[r][0] = dl[r][1] = dl[r][2] = dl[r][3] = 0.f;
    if (ep.lora.table) {
      const dev::LoraRowRef rr = s_lora_rows[i * 8 + gq];  // this lane's B column: token gq of the group
      const int sel0 = __shfl_sync(0xffffffffu, rr.slot, 8 * t), sel1 = __shfl_sync(0xffffffffu, rr.slot, 8 * t + 4);
      // The first step's t operand, by the token's own rank: the same values as by the pass's slot rank for the
      // tokens that keep the pass's result; the other columns are discarded.
      uint32_t tb0[2];
      if constexpr (kStageT0) {
        tb0[0] = s_lora_t0[i * 8 + gq][t];  // k = 2t, 2t + 1
        tb0[1] = s_lora_t0[i * 8 + gq][t + 4];  // k = 2t + 8, 2t + 9
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
              const uint32_t b[2] = {dev::lora_t_pair(rr.t, own_k, k0 + 2 * t), dev::lora_t_pair(rr.t, own_k, k0 + 2 * t + 8)};
              dev::mma_bf16_16816(d, a, b);
            }
          }
          if (sel0 == s) { dl[r][0] = dev::round_to_bf16(d[0]); dl[r][2] = dev::round_to_bf16(d[2]); }
          if (sel1 == s) { dl[r][1] = dev::round_to_bf16(d[1]); dl[r][3] = dev::round_to_bf16(d[3]); }
        }
      });
    }
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
        fused_a4_store<Act>(ep, s_row_pre, x, tr, i, n0, ga, nb, dl, dn);
        return;
      }
    }
    if ((gq & 1) == 0) {  // no early exit: the next group's expand needs every lane converged
#pragma unroll
      for (int tk = 0; tk < 2; ++tk) {
        const int row = tr.row0 + i * 8 + 2 * t + tk;
        if (row >= tr.row_end) continue;
        const auto rc = Epi::row_ctx(ep, x, row, s_row_pre[row - tr.row0]);
#pragma unroll
        for (int r = 0; r < RG; ++r) {
          Epi::template pair<Act>(ep, x, rc, n0 + 16 * r + gq, ga[r][tk], nb[r][tk], dl[r][tk], dn[r][tk]);
          Epi::template pair<Act>(ep, x, rc, n0 + 16 * r + gq + 8, ga[r][2 + tk], nb[r][2 + tk], dl[r][2 + tk],
                                  dn[r][2 + tk]);
        }
      }
    }
  };
  if constexpr (Cfg::WGMMA) {
    // A rolled loop, the sums read from shared memory group by group: unrolled over the groups (with its LoRA
    // passes) the epilogue was most of the kernel's code, and instruction fetch stalled on it.
#pragma unroll 1
    for (int i = 0; i < groups; ++i) {
      const float4 v = chunk_sums[i * Cfg::THREADS];  // RG = 1: accumulator i
      float ga[RG][4] = {{v.x, v.y, v.z, v.w}};
      if constexpr (Cfg::FP4) unscale_products(ga);
      epilogue_group(i, ga);
    }
  } else {
#pragma unroll
    for (int i = 0; i < GROUPS; ++i) {
      if (i >= groups) break;
      float ga[RG][4];
#pragma unroll
      for (int r = 0; r < RG; ++r)
#pragma unroll
        for (int q = 0; q < 4; ++q) ga[r][q] = acc[i * RG + r][q];
      epilogue_group(i, ga);
    }
  }
}


// The grouped GEMM kernel of the weights-as-A tiles: block (x, y, z) = (m tile, n tile, split), every thread loading
// its share.
template <class Cfg, class Epi, class Act>
__global__ void __launch_bounds__(Cfg::BLOCK_THREADS, kSkinnyMinBlocks<Cfg>)
    skinny_gemm_kernel(GemmProblem g, typename Epi::Params ep) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = stage_base<Cfg>(smem_raw);
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int KB = static_cast<int>(g.B.Kp / Cfg::BK);
  int m, n;
  grid_tile(g.m_band, m, n);
  TileRows tr;
  if (!resolve_tile<Cfg::BM>(g, tr, m)) return;
  const KRange kr = k_range(KB, static_cast<int>(blockIdx.z), g.split);
  const int nb = n * Cfg::BN;
  TilePipeline<Cfg> pipe(smem, g, tr, nb, kr.begin, kr.end - kr.begin);
  skinny_tile<Cfg, Epi, Act>(g, ep, smem, tr, nb, kr, pipe);
}

}  // namespace fp4moe::cuda_backend
