// Grouped GEMM instantiations for NVFP4 weights (all tile configs and activations).
#include "cuda/gemm/dispatch.cuh"

namespace fp4moe::cuda_backend {
void launch_gemm1_nvfp4(int config, ActivationType at, const GemmProblem& g, const Epilogue1Params& e, int n_tiles,
                        int m_tiles, cudaStream_t stream) {
  launch_gemm1_fmt<true>(config, at, g, e, n_tiles, m_tiles, stream);
}
void launch_gemm2_nvfp4(int config, const GemmProblem& g, const Epilogue2Params& e, int n_tiles, int m_tiles,
                        cudaStream_t stream) {
  launch_gemm2_fmt<true>(config, g, e, n_tiles, m_tiles, stream);
}
}  // namespace fp4moe::cuda_backend
