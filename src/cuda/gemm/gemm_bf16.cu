// Grouped GEMM instantiations for bf16 weights, and the format dispatch of kernels.h.
#include "cuda/gemm/dispatch.cuh"

namespace fp4moe::cuda_backend {
void launch_gemm1_nvfp4(int, ActivationType, const GemmProblem&, const Epilogue1Params&, int, int, cudaStream_t);
void launch_gemm2_nvfp4(int, const GemmProblem&, const Epilogue2Params&, int, int, cudaStream_t);
void launch_gemm1_mxfp4(int, ActivationType, const GemmProblem&, const Epilogue1Params&, int, int, cudaStream_t);
void launch_gemm2_mxfp4(int, const GemmProblem&, const Epilogue2Params&, int, int, cudaStream_t);

void launch_gemm1(int config, WeightFormat fmt, ActivationType at, const GemmProblem& g, const Epilogue1Params& e,
                  int n_tiles, int m_tiles, cudaStream_t stream) {
  if (fmt == WeightFormat::NVFP4) launch_gemm1_nvfp4(config, at, g, e, n_tiles, m_tiles, stream);
  else if (fmt == WeightFormat::MXFP4) launch_gemm1_mxfp4(config, at, g, e, n_tiles, m_tiles, stream);
  else launch_gemm1_fmt<false>(config, at, g, e, n_tiles, m_tiles, stream);
}
void launch_gemm2(int config, WeightFormat fmt, const GemmProblem& g, const Epilogue2Params& e, int n_tiles,
                  int m_tiles, cudaStream_t stream) {
  if (fmt == WeightFormat::NVFP4) launch_gemm2_nvfp4(config, g, e, n_tiles, m_tiles, stream);
  else if (fmt == WeightFormat::MXFP4) launch_gemm2_mxfp4(config, g, e, n_tiles, m_tiles, stream);
  else launch_gemm2_fmt<false>(config, g, e, n_tiles, m_tiles, stream);
}
}  // namespace fp4moe::cuda_backend
