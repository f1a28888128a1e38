// Split-K of a weights-as-A tile over g.split blocks (the plan splits when a decode grid is small): each block
// stores its chunk sums to partials[tile][chunk][thread]; the tile's last block to finish adds all of them in
// chunk order, the canonical K order (k_order.cuh), and runs the epilogue.
#pragma once
#include <cstdint>

#include "cuda/gemm/k_order.cuh"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/kernels.h"

namespace fp4moe::cuda_backend {

template <class Cfg, int ACCS> struct SplitK {
  const GemmProblem& g;
  int chunks;        // K chunks of the whole K
  int64_t tile_lin;  // this tile's index among the grid's (m, n) tiles: m * n_tiles + n
  __device__ __forceinline__ SplitK(const GemmProblem& g_, int KB, int64_t tile_lin_)
      : g(g_), chunks(k_chunks(KB, g_.chunk_kb)), tile_lin(tile_lin_) {}

  __device__ __forceinline__ float4* partial_at(int chunk) const {
    return reinterpret_cast<float4*>(g.partials) + ((tile_lin * chunks + chunk) * Cfg::THREADS + threadIdx.x) * ACCS;
  }
  __device__ __forceinline__ void store(int chunk, const float (&part)[ACCS][4]) const {
    float4* dst = partial_at(chunk);
#pragma unroll
    for (int a = 0; a < ACCS; ++a) dst[a] = make_float4(part[a][0], part[a][1], part[a][2], part[a][3]);
  }
  // In the tile's last block: acc = the sum of every chunk's sums in chunk order, true. In the others: false.
  // The block's partial stores reach thread 0 through the barrier, and its fences around the count publish them and
  // order the last block's reads (the pattern of a grid barrier): one thread fences, not every thread. The partials
  // are read past L1 (__ldcg).
  __device__ __forceinline__ bool reduce_last(float (&acc)[ACCS][4]) const {
    __shared__ int last;
    math_sync<Cfg>();
    if (threadIdx.x == 0) {
      __threadfence();
      const int done = atomicAdd(g.counters + tile_lin, 1);
      last = done == g.split - 1;
      if (last) {
        g.counters[tile_lin] = 0;  // ready for the next call
        __threadfence();
      }
    }
    math_sync<Cfg>();
    if (!last) return false;
    for (int c = 0; c < chunks; ++c) {
      const float4* src = partial_at(c);
#pragma unroll
      for (int a = 0; a < ACCS; ++a) {
        const float4 v = __ldcg(src + a);
        const float p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[a][q] = c == 0 ? p[q] : __fadd_rn(acc[a][q], p[q]);
      }
    }
    return true;
  }
};

}  // namespace fp4moe::cuda_backend
