// The canonical K order (SPEC §4 batch invariance; docs/numerics.md): the one place that defines how every tile
// adds its products, so that the tile, the split-K factor and the chunking never change a bit.
#pragma once
#include <cstdint>

#include "format/nvfp4_prepared.h"
#include "runtime/plan.h"

namespace fp4moe::cuda_backend {

// The canonical K order of every GEMM here (batch invariance, SPEC §4): K is cut into chunks of g.chunk_kb k-blocks
// (whole chunks of kKChunk, or the whole K: plan.h decode_chunk_kb, a function of the layer's shape alone); each
// chunk is one chain of m16n8k16 steps k = 0, 16, 32, ... from a zero accumulator, and an output is the fp32 sum of
// its chunk sums in chunk order. A tile may take a range of chunks (split-K over blocks, split_k.cuh): the chunk sums
// are then added in the same order by the last block.

// The K chunks of KB k-blocks in chunks of cb (the last may be short).
__device__ __forceinline__ int k_chunks(int KB, int cb) { return (KB + cb - 1) / cb; }

// The range of k-blocks [begin, end) of split z of `splits`, in whole chunks of cb; KB = k-blocks of K.
struct KRange {
  int begin, end;
};
__device__ __forceinline__ KRange k_range(int KB, int z, int splits, int cb) {
  const int chunks = k_chunks(KB, cb);
  const int per = (chunks + splits - 1) / splits;
  const int b = min(KB, z * per * cb);
  return KRange{b, min(KB, b + per * cb)};
}

// A finished chunk's chain added to the running sums in chunk order (the first chunk starts them).
template <int N> __device__ __forceinline__ void add_chunk(float (&acc)[N][4], const float (&part)[N][4], bool first) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[i][q] = first ? part[i][q] : __fadd_rn(acc[i][q], part[i][q]);
}
// One float4 of running sums s plus a chunk's part, in that order.
__device__ __forceinline__ float4 add_chunk(float4 s, float4 part) {
  return make_float4(__fadd_rn(s.x, part.x), __fadd_rn(s.y, part.y), __fadd_rn(s.z, part.z), __fadd_rn(s.w, part.w));
}
// The same, the running sums in shared memory: float4 i of them at sums[i * kStride].
template <int kStride, int N>
__device__ __forceinline__ void add_chunk_shared(float4* sums, const float (&part)[N][4], bool first) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float4 v = make_float4(part[i][0], part[i][1], part[i][2], part[i][3]);
    if (!first) v = add_chunk(sums[i * kStride], v);
    sums[i * kStride] = v;
  }
}
// Prepared NVFP4 sums times kProductScale (format/nvfp4_prepared.h): the sums of the true products.
template <int N> __device__ __forceinline__ void unscale_products(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[i][q] *= nvfp4_prepared::kProductScale;
}

}  // namespace fp4moe::cuda_backend
