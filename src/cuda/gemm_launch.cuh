// Host side of the grouped GEMMs: picks the instantiation for (tile config, weight format, activation)
// and launches it. Included by one .cu per weight format so the instantiations compile in parallel.
#pragma once
#include <algorithm>

#include "cuda/gemm_grouped.cuh"
#include "cuda/gemm_skinny.cuh"

namespace fp4moe::cuda_backend {

// The tile configurations of plan.h's kGemmConfigs, by index.
template <int Config, bool FP4> struct ConfigOf;
template <bool FP4> struct ConfigOf<0, FP4> { using type = SkinnyConfig<8, 4, 8, FP4>; };
template <bool FP4> struct ConfigOf<1, FP4> { using type = SkinnyConfig<32, 4, 6, FP4>; };
template <bool FP4> struct ConfigOf<2, FP4> { using type = TileConfig<64, 128, 2, 4, 3, FP4>; };
template <bool FP4> struct ConfigOf<3, FP4> { using type = SkinnyConfig<64, 8, 4, FP4, 1, true>; };
// The table above must match plan.h (the plan sizes grids and shared memory from kGemmConfigs).
template <int I> constexpr bool matches_plan() {
  using C = typename ConfigOf<I, true>::type;
  constexpr GemmConfig g = kGemmConfigs[I];
  return C::BM == g.bm && C::BN == g.bn && C::BK == g.bk && C::WARPS_M == g.warps_m && C::WARPS_N == g.warps_n &&
         C::STAGES == gemm_stages(g, true) && ConfigOf<I, false>::type::STAGES == gemm_stages(g, false) &&
         C::WEIGHTS_AS_A == g.weights_as_a && C::WGMMA == g.wgmma;
}
static_assert(kNumGemmConfigs == 4 && matches_plan<0>() && matches_plan<1>() && matches_plan<2>() && matches_plan<3>(),
              "ConfigOf differs from plan.h kGemmConfigs");
// The host's A4 fusion flag (kernels.h gemm_a4_fusable) must name exactly the tiles whose kernel quantizes a
// (skinny_gemm_kernel: weights as A, two row groups of 16 a warp), or a would reach GEMM2 unquantized or twice.
template <int I> constexpr bool a4_fusion_matches() {
  using C = typename ConfigOf<I, true>::type;
  constexpr bool kernel_fuses = C::WEIGHTS_AS_A && C::BN == 32 * C::WARPS_N;
  return gemm_a4_fusable(I, ActivationType::Swiglu) == kernel_fuses && !gemm_a4_fusable(I, ActivationType::Silu);
}
static_assert(a4_fusion_matches<0>() && a4_fusion_matches<1>() && a4_fusion_matches<2>() && a4_fusion_matches<3>(),
              "gemm_a4_fusable differs from the kernels' fused A4 epilogue");

template <class Cfg, class Epi, class Act>
void launch_grouped(const GemmProblem& g, const typename Epi::Params& ep, int n_tiles, int m_tiles, cudaStream_t stream) {
  if (n_tiles <= 0 || m_tiles <= 0) return;
  auto kernel = [] {
    if constexpr (Cfg::WEIGHTS_AS_A) return skinny_gemm_kernel<Cfg, Epi, Act>;
    else return grouped_gemm_kernel<Cfg, Epi, Act>;
  }();
  if (Cfg::SMEM_BYTES > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM_BYTES),
               "cudaFuncSetAttribute(grouped_gemm_kernel)");
  const unsigned splits = Cfg::WEIGHTS_AS_A ? static_cast<unsigned>(g.split) : 1u;  // split-K: skinny tiles only
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles), splits);
  launch_pdl(kernel, grid, dim3(Cfg::BLOCK_THREADS), Cfg::SMEM_BYTES, stream, "grouped_gemm_kernel", g, ep);
}

template <bool FP4> void launch_gemm1_fmt(int config, ActivationType at, const GemmProblem& g, const Epilogue1Params& e,
                                          int n_tiles, int m_tiles, cudaStream_t stream) {
  act::dispatch(at, [&](auto fn) {
    using Act = decltype(fn);
    switch (config) {
      case 0: launch_grouped<typename ConfigOf<0, FP4>::type, Epilogue1, Act>(g, e, n_tiles, m_tiles, stream); break;
      case 1: launch_grouped<typename ConfigOf<1, FP4>::type, Epilogue1, Act>(g, e, n_tiles, m_tiles, stream); break;
      case 2: launch_grouped<typename ConfigOf<2, FP4>::type, Epilogue1, Act>(g, e, n_tiles, m_tiles, stream); break;
      default: launch_grouped<typename ConfigOf<3, FP4>::type, Epilogue1, Act>(g, e, n_tiles, m_tiles, stream); break;
    }
  });
}

template <bool FP4> void launch_gemm2_fmt(int config, const GemmProblem& g, const Epilogue2Params& e, int n_tiles,
                                          int m_tiles, cudaStream_t stream) {
  switch (config) {
    case 0: launch_grouped<typename ConfigOf<0, FP4>::type, Epilogue2, act::Identity>(g, e, n_tiles, m_tiles, stream); break;
    case 1: launch_grouped<typename ConfigOf<1, FP4>::type, Epilogue2, act::Identity>(g, e, n_tiles, m_tiles, stream); break;
    case 2: launch_grouped<typename ConfigOf<2, FP4>::type, Epilogue2, act::Identity>(g, e, n_tiles, m_tiles, stream); break;
    default: launch_grouped<typename ConfigOf<3, FP4>::type, Epilogue2, act::Identity>(g, e, n_tiles, m_tiles, stream); break;
  }
}

}  // namespace fp4moe::cuda_backend
