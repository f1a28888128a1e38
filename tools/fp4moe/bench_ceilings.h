// The ceilings each case is compared with, measured in the same run: device-to-device copy bandwidth and bf16
// GEMM throughput (cuBLAS).
#pragma once
#include <cstdint>
#include <string>

#include "bench_device.h"

namespace fp4moe::bench {

struct Ceilings {
  double copy_gbps = 0;
  int64_t copy_bytes = 0;
  double gemm_tflops = 0;
  std::string gemm_method;
};

// GB/s (bytes read + written) of a 4 GiB device-to-device copy, 1 GiB when that does not fit, 0 when neither
// does; bytes_out: the size copied.
double measure_copy(Device& d, int64_t& bytes_out);
// bf16 x bf16 -> bf16, fp32 accumulation, 8192^3 on random data (operands: windows of the random pool).
double measure_gemm(Device& d, const DeviceBuffer& pool, std::string& method);

}  // namespace fp4moe::bench
