// Grouped GEMM instantiations for MXFP4 weights (all tile configs and activations): NVFP4's kernels with the E8M0
// scale decode (TileConfig::MX).
#include "cuda/gemm/dispatch.cuh"

namespace fp4moe::cuda_backend {
void launch_gemm1_mxfp4(int config, ActivationType at, const GemmProblem& g, const Epilogue1Params& e, int n_tiles,
                        int m_tiles, cudaStream_t stream) {
  launch_gemm1_fmt<true, true>(config, at, g, e, n_tiles, m_tiles, stream);
}
void launch_gemm2_mxfp4(int config, const GemmProblem& g, const Epilogue2Params& e, int n_tiles, int m_tiles,
                        cudaStream_t stream) {
  launch_gemm2_fmt<true, true>(config, g, e, n_tiles, m_tiles, stream);
}
}  // namespace fp4moe::cuda_backend
