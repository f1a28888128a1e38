// The copy and bf16 GEMM ceilings (bench_ceilings.h).
#ifdef FP4MOE_WITH_CUDA
#include "bench_ceilings.h"

#include <vector>

#include "bench.h"

namespace fp4moe::bench {

double measure_copy(Device& d, int64_t& bytes_out) {
  for (size_t mb : {4096, 1024}) {
    try {
      const size_t bytes = mb << 20;
      DeviceBuffer a(bytes), b(bytes);
      CK(cudaMemset(a.get(), 0x5a, bytes));
      std::vector<double> ts;
      for (int i = 0; i < 12; ++i) {
        CK(cudaEventRecord(d.events.at(0), d.stream));
        CK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, d.stream));
        CK(cudaEventRecord(d.events.at(1), d.stream));
        CK(cudaEventSynchronize(d.events.at(1)));
        if (i >= 2) ts.push_back(elapsed_ms(d.events.at(0), d.events.at(1)));
      }
      bytes_out = static_cast<int64_t>(bytes);
      return 2.0 * double(bytes) / (bench::percentile(ts, 50) * 1e-3) / 1e9;  // read + write
    } catch (const Error& e) {
      if (e.code() != ErrorCode::OutOfMemory) throw;
    }
  }
  return 0;
}

double measure_gemm(Device& d, const DeviceBuffer& pool, std::string& method) {
#ifdef FP4MOE_BENCH_HAVE_CUBLAS
  const int n = 8192;
  const size_t elems = size_t(n) * n;
  if (pool.bytes() < 2 * elems * 2) throw Error(ErrorCode::InvalidArgument, "pool", "random pool too small for the GEMM");
  const uint16_t* A = pool.as<uint16_t>();
  const uint16_t* B = A + elems;
  DeviceBuffer C(elems * 2);
  const float alpha = 1.f, beta = 0.f;
  CB(cublasSetPointerMode(d.blas, CUBLAS_POINTER_MODE_HOST));
  std::vector<double> ts;
  for (int i = 0; i < 23; ++i) {
    CK(cudaEventRecord(d.events.at(0), d.stream));
    CB(cublasGemmEx(d.blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, A, CUDA_R_16BF, n, B, CUDA_R_16BF, n, &beta,
                    C.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cudaEventRecord(d.events.at(1), d.stream));
    CK(cudaEventSynchronize(d.events.at(1)));
    if (i >= 3) ts.push_back(elapsed_ms(d.events.at(0), d.events.at(1)));
  }
  method = "cublasGemmEx bf16 x bf16 -> bf16, fp32 accumulation, 8192^3, random N(0,1) data, median of 20";
  return 2.0 * double(n) * n * n / (bench::percentile(ts, 50) * 1e-3) / 1e12;
#else
  (void)d;
  (void)pool;
  method = "unavailable (built without cuBLAS)";
  return 0;
#endif
}

}  // namespace fp4moe::bench
#endif  // FP4MOE_WITH_CUDA
