// Host side of the grouped GEMMs: picks the kernel for (tile, weight format, activation) and launches it.
// Included by one .cu per weight format (gemm_nvfp4.cu, gemm_mxfp4.cu, gemm_bf16.cu) so the instantiations compile in
// parallel.
#pragma once
#include <algorithm>

#include "cuda/gemm/kernel_tokens_as_a.cuh"
#include "cuda/gemm/kernel_weights_as_a.cuh"
#include "cuda/gemm/kernel_ws_wgmma.cuh"
#include "cuda/gemm/tile_config.cuh"

namespace fp4moe::cuda_backend {

// The host's A4 fusion flag (kernels.h gemm_a4_fusable) must name exactly the tiles whose kernel quantizes a
// (weights_as_a_gemm_kernel with two row groups of 16 a warp: epilogue_a4.cuh), or a would reach GEMM2
// unquantized or twice.
template <GemmTile T, bool FP4> constexpr bool a4_fusion_matches_in() {
  using C = TileOf<T, FP4>;
  constexpr int I = static_cast<int>(T);
  constexpr bool kernel_fuses = C::WEIGHTS_AS_A && C::BN == 32 * C::WARPS_N;
  return gemm_a4_fusable(I, ActivationType::Swiglu, FP4) == kernel_fuses &&
         !gemm_a4_fusable(I, ActivationType::Silu, FP4);
}
template <GemmTile T> constexpr bool a4_fusion_matches() {  // in both weight formats
  return a4_fusion_matches_in<T, true>() && a4_fusion_matches_in<T, false>();
}
static_assert(a4_fusion_matches<GemmTile::SplitKDecode>() && a4_fusion_matches<GemmTile::WeightsAsA32>() &&
                  a4_fusion_matches<GemmTile::TokensAsA64>() && a4_fusion_matches<GemmTile::Wgmma64>() &&
                  a4_fusion_matches<GemmTile::WeightsAsA16>() && a4_fusion_matches<GemmTile::WgmmaWs128>() &&
                  a4_fusion_matches<GemmTile::WgmmaWs64>() && a4_fusion_matches<GemmTile::WgmmaWs32>(),
              "gemm_a4_fusable differs from the kernels' fused A4 epilogue");

template <class Cfg, class Epi, class Act>
void launch_grouped(const GemmProblem& g, const typename Epi::Params& ep, int n_tiles, int m_tiles,
                    cudaStream_t stream) {
  if (n_tiles <= 0 || m_tiles <= 0) return;
  auto kernel = [] {
    if constexpr (Cfg::WS) return ws_wgmma_gemm_kernel<Cfg, Epi, Act>;
    else if constexpr (Cfg::WEIGHTS_AS_A) return weights_as_a_gemm_kernel<Cfg, Epi, Act>;
    else return tokens_as_a_gemm_kernel<Cfg, Epi, Act>;
  }();
  if (Cfg::SMEM_BYTES > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM_BYTES),
               "cudaFuncSetAttribute(grouped_gemm_kernel)");
  // split-K: the weights-as-A tiles without a producer only
  const unsigned splits = Cfg::WEIGHTS_AS_A && !Cfg::WS ? static_cast<unsigned>(g.split) : 1u;
  GemmProblem gl = g;
  // A decode grid's m tiles are a bound: under expert parallelism most hold no rows. With the m tile slowest the
  // blocks that have work are the first dispatched, not spread among the empty ones.
  gl.m_last = g.m_last && Cfg::WEIGHTS_AS_A && !Cfg::WS && g.m_band <= 0 && m_tiles <= 65535 ? 1 : 0;
  // A warp-specialised block runs g.ws_sub n tiles of its m tile (the plan's MoePlan::ws_sub1 ...).
  gl.ws_sub = Cfg::WS ? g.ws_sub : 1;
  const int grid_n = (n_tiles + gl.ws_sub - 1) / gl.ws_sub;
  const dim3 grid = gl.m_last ? dim3(static_cast<unsigned>(grid_n), splits, static_cast<unsigned>(m_tiles))
                              : dim3(static_cast<unsigned>(m_tiles), static_cast<unsigned>(grid_n), splits);
  launch_pdl(kernel, grid, dim3(Cfg::BLOCK_THREADS), Cfg::SMEM_BYTES, stream, "grouped_gemm_kernel", gl, ep);
}

// Calls f with a value of the tile type that the plan's tile index `config` names (TileOf, one weight format).
template <bool FP4, bool MX, class F> void with_tile(int config, F&& f) {
  switch (static_cast<GemmTile>(config)) {
    case GemmTile::SplitKDecode: f(TileOf<GemmTile::SplitKDecode, FP4, MX>{}); break;
    case GemmTile::WeightsAsA32: f(TileOf<GemmTile::WeightsAsA32, FP4, MX>{}); break;
    case GemmTile::TokensAsA64: f(TileOf<GemmTile::TokensAsA64, FP4, MX>{}); break;
    case GemmTile::WeightsAsA16: f(TileOf<GemmTile::WeightsAsA16, FP4, MX>{}); break;
    case GemmTile::WgmmaWs128: f(TileOf<GemmTile::WgmmaWs128, FP4, MX>{}); break;
    case GemmTile::WgmmaWs64: f(TileOf<GemmTile::WgmmaWs64, FP4, MX>{}); break;
    case GemmTile::WgmmaWs32: f(TileOf<GemmTile::WgmmaWs32, FP4, MX>{}); break;
    default: f(TileOf<GemmTile::Wgmma64, FP4, MX>{}); break;
  }
}

// The instantiations of one weight format (MX: MXFP4): every tile for GEMM1 x every activation, and for GEMM2.
template <bool FP4, bool MX = false>
void launch_gemm1_fmt(int config, ActivationType at, const GemmProblem& g, const Epilogue1Params& e, int n_tiles,
                      int m_tiles, cudaStream_t stream) {
  act::dispatch(at, [&](auto fn) {
    with_tile<FP4, MX>(config, [&](auto tile) {
      launch_grouped<decltype(tile), Epilogue1, decltype(fn)>(g, e, n_tiles, m_tiles, stream);
    });
  });
}

template <bool FP4, bool MX = false>
void launch_gemm2_fmt(int config, const GemmProblem& g, const Epilogue2Params& e, int n_tiles, int m_tiles,
                      cudaStream_t stream) {
  with_tile<FP4, MX>(config, [&](auto tile) {
    launch_grouped<decltype(tile), Epilogue2, act::Identity>(g, e, n_tiles, m_tiles, stream);
  });
}

}  // namespace fp4moe::cuda_backend
