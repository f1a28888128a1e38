// The grouped GEMM kernel of the TokensAsA64 tile (large batches): block (x, y) = (m tile, n tile); every thread
// loads and computes. Reads top to bottom: schedule, LoRA lookups beside the first copies, mainloop, epilogue.
#pragma once
#include "cuda/gemm/epilogue_tokens_as_a.cuh"
#include "cuda/gemm/lora_rows.cuh"
#include "cuda/gemm/mainloop_mma_sync.cuh"
#include "cuda/gemm/scheduler.cuh"
#include "cuda/pdl.cuh"

namespace fp4moe::cuda_backend {

template <class Cfg, class Epi, class Act>
__global__ void __launch_bounds__(Cfg::THREADS) tokens_as_a_gemm_kernel(GemmProblem g, typename Epi::Params ep) {
  extern __shared__ __align__(128) uint8_t smem[];
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  TileRows tr;
  int n0;
  if (!block_tile<Cfg::BM, Cfg::BN>(g, tr, n0)) return;

  TileLoader<Cfg> ld(g, tr, n0, 0);
  __shared__ dev::LoraRowRef s_lora_rows[Cfg::BM];
  __shared__ uint32_t s_lora_t0[Cfg::BM][8];
  TokensAsAMainloop<Cfg> ml;
  ml.run(smem, ld, static_cast<int>(g.B.Kp / Cfg::BK), g.chunk_kb, [&] {
    if (ep.lora.table) lora_lookup_rows<Cfg, Epi, Act>(g, ep, tr, n0, s_lora_rows, s_lora_t0);
  });
  tile_epilogue<Cfg, Epi, Act>(ep, g, ml, tr, n0, s_lora_rows, s_lora_t0);
}

}  // namespace fp4moe::cuda_backend
