// Grouped GEMM instantiations for bf16 weights, the format dispatch of kernels.h and the wgmma device query.
#include <atomic>

#include "cuda/gemm_launch.cuh"

namespace fp4moe::cuda_backend {
void launch_gemm1_nvfp4(int, ActivationType, const GemmProblem&, const Epilogue1Params&, int, int, cudaStream_t);
void launch_gemm2_nvfp4(int, const GemmProblem&, const Epilogue2Params&, int, int, cudaStream_t);

void launch_gemm1(int config, WeightFormat fmt, ActivationType at, const GemmProblem& g, const Epilogue1Params& e,
                  int n_tiles, int m_tiles, cudaStream_t stream) {
  if (fmt == WeightFormat::NVFP4) launch_gemm1_nvfp4(config, at, g, e, n_tiles, m_tiles, stream);
  else launch_gemm1_fmt<false>(config, at, g, e, n_tiles, m_tiles, stream);
}
void launch_gemm2(int config, WeightFormat fmt, const GemmProblem& g, const Epilogue2Params& e, int n_tiles,
                  int m_tiles, cudaStream_t stream) {
  if (fmt == WeightFormat::NVFP4) launch_gemm2_nvfp4(config, g, e, n_tiles, m_tiles, stream);
  else launch_gemm2_fmt<false>(config, g, e, n_tiles, m_tiles, stream);
}
// Whether device dev runs the wgmma tile: compute capability 9.0, with this build's sm_90a code (the build carries
// SASS only, never JIT-ed PTX: FP4MOE_WITH_SM90A is set when FP4MOE_CUDA_ARCHS lists 90a). Cached per device.
bool wgmma_supported_on(int dev) {
#if defined(FP4MOE_WITH_SM90A)
  static std::atomic<int> known[64] = {};  // 0 unknown, 1 yes, 2 no
  if (dev >= 0 && dev < 64 && known[dev].load(std::memory_order_relaxed) != 0) return known[dev].load() == 1;
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
  const bool yes = major == 9 && minor == 0;
  if (dev >= 0 && dev < 64) known[dev].store(yes ? 1 : 2, std::memory_order_relaxed);
  return yes;
#else
  (void)dev;
  return false;
#endif
}
}  // namespace fp4moe::cuda_backend
