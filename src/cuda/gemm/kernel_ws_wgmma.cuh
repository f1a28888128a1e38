// The grouped GEMM kernel of the warp-specialised wgmma tile (sm_90a, many rows an expert: WgmmaWs128): BM = 128
// tokens x BN weight rows (256 NVFP4, 128 bf16), one block an SM. A producer warpgroup issues every copy (weights
// and scales by bulk copies, tokens by cp.async; WsRing); two math warpgroups, holding the registers the producer
// gives up (setmaxnreg), only decode, multiply and hand stages back (WsWgmmaMath), then run the weights-as-A
// epilogue. Block (x, y) = (m tile, g.ws_sub n tiles) in the band order (grid_tile), the n tiles one after the other
// (one set of row lookups; the producer loads the next one's first stages during the epilogue of the one before).
// Reads top to bottom: schedule, roles, the epilogue's lookups beside the first copies, then each n tile's mainloop
// chunk by chunk and its epilogue group by group. The wgmmas multiply the tile's token rows rounded up
// (with_tile_tokens), not always BM: an expert's last m tile often holds a few rows.
//
// Bits: the canonical K order (k_order.cuh) as every tile: a chunk's chain of k16 steps from zero in registers,
// chunk sums added in chunk order in shared memory (a float4 a thread and accumulator, after the stages). No split-K.
// Without LoRA or A4 fusion the last chunk's sums are written token-major instead (store_token_major), so that the
// epilogue stores whole lines: four adjacent columns a lane.
#pragma once
#include <cstdint>

#include "cuda/gemm/epilogue_weights_as_a.cuh"
#include "cuda/gemm/k_order.cuh"
#include "cuda/gemm/mainloop_ws_wgmma.cuh"
#include "cuda/gemm/pipeline_ws.cuh"
#include "cuda/gemm/scheduler.cuh"
#include "cuda/pdl.cuh"

namespace fp4moe::cuda_backend {

// A tile of G token groups: its wgmma N in steps of 16 tokens, but the 128-token tile's in two (64, 128): with a third
// its 128 accumulators left ptxas too few registers to pipeline the wgmmas (C7511) under the 168 a thread.
template <int G, class F> __device__ __forceinline__ void with_tile_tokens(int groups, F&& f) {
  static_assert(G == 4 || G == 8 || G == 16, "the WS tiles' 32, 64 and 128 tokens");
  if constexpr (G == 4) dev::with_token_groups<2, 4>(groups, f);
  else if constexpr (G == 8) dev::with_token_groups<2, 4, 6, 8>(groups, f);
  else dev::with_token_groups<8, 16>(groups, f);
}

// The registers a thread of each role keeps (setmaxnreg): 128 * kWsProducerRegs + THREADS * kWsMathRegs <= 64 K.
constexpr int kWsProducerRegs = 56, kWsMathRegs = 224;

template <class Cfg, class Epi, class Act>
__global__ void __launch_bounds__(Cfg::BLOCK_THREADS, 1) ws_wgmma_gemm_kernel(GemmProblem g, typename Epi::Params ep) {
  static_assert(Cfg::WS && Cfg::PRODUCER_THREADS == 128 && Cfg::THREADS == 256 && Cfg::WARPS_M == 1,
                "two math warpgroups and a producer warpgroup");
  static_assert(128 * kWsProducerRegs + Cfg::THREADS * kWsMathRegs <= 65536, "register file");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Math = WsWgmmaMath<Cfg>;
  using Epilogue = WeightsAsAEpilogue<Cfg, Epi, Act>;
  constexpr int RG = Math::RG, GROUPS = Math::GROUPS;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = stage_base<Cfg>(smem_raw);
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  TileRows tr;
  int nb;  // the first weight row of the block's first n tile
  if (!block_tile<Cfg::BM>(g, tr, nb, Cfg::BN * g.ws_sub)) return;
  const int KB = static_cast<int>(g.B.Kp / Cfg::BK), CB = g.chunk_kb;
  const int subs = min(g.ws_sub, static_cast<int>((g.B.N - nb + Cfg::BN - 1) / Cfg::BN));  // n tiles with rows
  WsRing<Cfg> ring(smem);

  if (threadIdx.x >= Cfg::THREADS) {  // the producer warpgroup: every n tile's k-blocks through one ring
    dev::regs_dealloc<kWsProducerRegs>();
    typename WsRing<Cfg>::Writer w;
    for (int u = 0; u < subs; ++u) ring.produce(w, g, tr, nb + u * Cfg::BN, KB);
    dev::cp_async_wait<0>();
    return;
  }
  dev::regs_alloc<kWsMathRegs>();

  const typename Epilogue::Rows rows = Epilogue::lookup_rows(g, ep, tr, nb);  // while the first stages load

  // The chunk sums after the stages: accumulator (token group i, row group r) at [i * RG + r][thread].
  float* const sums_base = reinterpret_cast<float*>(smem + Cfg::STAGES * Cfg::STAGE_BYTES);
  float4* sums = reinterpret_cast<float4*>(sums_base) + threadIdx.x;
  const bool tm = Epilogue::token_major(ep);  // the last chunk's sums token-major (block-uniform)
  const int groups = (tr.row_end - tr.row0 + 7) >> 3;  // token groups with rows
  Math math(ring);
  for (int u = 0; u < subs; ++u) {
    const int n0 = nb + u * Cfg::BN;
    const bool idle = n0 + (static_cast<int>(threadIdx.x) >> 7) * 64 * RG >= g.B.N;  // this warpgroup's rows past N
    // The tile's mainloop over NG groups of 8 tokens, its token groups rounded up as with_tile_tokens allows (the
    // wgmma's N), so that an expert's last, short m tile multiplies few columns; the sums of those groups.
    with_tile_tokens<GROUPS>(groups, [&](auto ng) {
      constexpr int NG = decltype(ng)::value;
      float part[RG][NG][4];
      for (int kc = 0; kc < KB; kc += CB) {  // one K chunk: one chain per output
#pragma unroll
        for (int r = 0; r < RG; ++r)
#pragma unroll
          for (int i = 0; i < NG; ++i)
#pragma unroll
            for (int q = 0; q < 4; ++q) part[r][i][q] = 0.f;
        math.template chunk<NG>(part, smem, ring, kc, min(kc + CB, KB), idle);
        if (idle) continue;  // no sums: its columns are never stored
        if (tm && kc + CB >= KB) {
          Epilogue::store_token_major(sums_base, part, kc == 0);
        } else {
#pragma unroll
          for (int r = 0; r < RG; ++r)
            add_chunk_shared<RG * Cfg::THREADS>(sums + r * Cfg::THREADS, part[r], kc == 0);
        }
      }
    });

    Epilogue epi(ep, tr, n0 + (static_cast<int>(threadIdx.x) >> 5) * 16 * RG, rows);
    if (u == 0) dev::named_sync<Cfg::THREADS>();  // the row lookups
    if (tm) epi.quads_from_shared(sums_base, groups);
    else epi.groups_from_shared(sums, groups);
    __syncwarp();  // the warp's lanes have read each other's sums before the next tile's first chunk overwrites them
  }
#else
  (void)g, (void)ep;
  __trap();  // the plan picks this tile on sm_90a devices only (ProblemShape::wgmma)
#endif
}

}  // namespace fp4moe::cuda_backend
