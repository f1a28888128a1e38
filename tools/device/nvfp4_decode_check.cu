// Device check of the prepared NVFP4 decode (format/nvfp4_prepared.h, dev::fp4_row_fragments): every E2M1 code
// in every slot times every E4M3 scale code, decoded on the GPU, against the reference codecs. The host test
// tests/cpp/test_nvfp4_prepared.cpp checks the same bits through the host path; this one checks the device
// instructions (PRMT, HMUL2 with subnormal inputs). Build and run on a GPU machine:
//   nvcc -std=c++20 -Isrc -Iinclude -gencode=arch=compute_90a,code=sm_90a tools/device/nvfp4_decode_check.cu \
//        src/format/nvfp4.cpp -o nvfp4_decode_check && ./nvfp4_decode_check
// H200, 2026-11-30: revision 413a351 printed "bad 28480 of 65536" (the step 2-3 scale selector), bbb3cc5 "bad 0".
#include <cstdio>
#include <vector>
#include <cstring>
#include <cmath>
#include <cstdlib>
#include "cuda/nvfp4_device.cuh"
#include "fp4moe/nvfp4.h"
using namespace fp4moe::cuda_backend;
namespace pf = fp4moe::nvfp4_prepared;
__global__ void k(const uint2* raw, const uint32_t* k4, uint32_t* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t w[4][2];
  dev::fp4_row_fragments(raw[i], k4[i], w);
  for (int s = 0; s < 4; ++s) for (int h = 0; h < 2; ++h) out[i * 8 + s * 2 + h] = w[s][h];
}
float bf(uint32_t b) { uint32_t u = (b & 0xffff) << 16; float f; memcpy(&f, &u, 4); return f; }
int main() {  // exit status: 0 when every value matches
  // case i: scale code sc = i / 16, value code c = i % 16 in every slot of both words
  const int n = 256 * 16;
  std::vector<uint2> raw(n); std::vector<uint32_t> k4(n), out(n * 8);
  for (int i = 0; i < n; ++i) {
    int sc = i / 16, c = i % 16;
    auto ps = pf::prepare_scale(sc);
    const uint8_t cc = pf::prepare_value(static_cast<uint8_t>(c), ps);
    uint32_t w[2] = {0, 0};
    for (int s = 0; s < 4; ++s) for (int h = 0; h < 2; ++h) for (int half = 0; half < 2; ++half) pf::place_value(w[s / 2], 2 * (s % 2) + h, half, cc);
    raw[i] = make_uint2(w[0], w[1]);
    k4[i] = ps.code * 0x01010101u;
  }
  auto ck = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) { printf("%s: %s\n", what, cudaGetErrorString(e)); std::exit(2); }
  };
  uint2* draw; uint32_t *dk4, *dout;
  ck(cudaMalloc(&draw, n * 8), "cudaMalloc"); ck(cudaMalloc(&dk4, n * 4), "cudaMalloc"); ck(cudaMalloc(&dout, n * 32), "cudaMalloc");
  ck(cudaMemcpy(draw, raw.data(), n * 8, cudaMemcpyHostToDevice), "cudaMemcpy");
  ck(cudaMemcpy(dk4, k4.data(), n * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  k<<<(n + 127) / 128, 128>>>(draw, dk4, dout, n);
  ck(cudaGetLastError(), "kernel launch");
  ck(cudaMemcpy(out.data(), dout, n * 32, cudaMemcpyDeviceToHost), "cudaMemcpy (result)");
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    int sc = i / 16, c = i % 16;
    float want = fp4moe::nvfp4::e2m1_decode(c) * fp4moe::nvfp4::e4m3_decode(sc);
    for (int j = 0; j < 8; ++j) for (int half = 0; half < 2; ++half) {
      float got = bf(out[i * 8 + j] >> (16 * half)) * 256.f;
      bool ok = std::isnan(want) ? std::isnan(got) : (got == want && std::signbit(got) == std::signbit(want));
      if (!ok && bad++ < 20) printf("sc=%02x c=%x word %d half %d: got %g want %g (bits %08x)\n", sc, c, j, half, got, want, out[i*8+j]);
    }
  }
  printf("bad %d of %d\n", bad, n * 16);
  return bad == 0 ? 0 : 1;
}
