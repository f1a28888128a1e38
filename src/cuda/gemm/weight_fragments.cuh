// The weights of a stage as mma A fragments: what both weights-as-A mainloops (mma.sync and wgmma) read.
#pragma once
#include <cstdint>

#include "cuda/mma.cuh"
#include "cuda/nvfp4_device.cuh"

namespace fp4moe::cuda_backend {

// A lane's NVFP4 bytes of one row group and k-block (rows g and g + 8: values and scale words), read from shared
// memory apart from their decode so that a mainloop can issue the reads before it waits on the tensor cores.
struct Fp4Bytes {
  uint2 v0, v1;
  uint32_t s0, s1;
};
template <class Cfg> __device__ __forceinline__ Fp4Bytes fp4_bytes(const uint8_t* st, const uint8_t* sf) {
  constexpr int kRow8 = 8 * Cfg::B_ROW_BYTES;  // row g + 8
  return Fp4Bytes{*reinterpret_cast<const uint2*>(st), *reinterpret_cast<const uint2*>(st + kRow8),
                  *reinterpret_cast<const uint32_t*>(sf), *reinterpret_cast<const uint32_t*>(sf + 32)};
}
__device__ __forceinline__ void fp4_fragments(const Fp4Bytes& b, uint32_t wa[4][4]) {
  uint32_t w0[4][2], w1[4][2];
  dev::fp4_row_fragments(b.v0, b.s0, w0);
  dev::fp4_row_fragments(b.v1, b.s1, w1);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    wa[s][0] = w0[s][0];
    wa[s][1] = w1[s][0];
    wa[s][2] = w0[s][1];
    wa[s][3] = w1[s][1];
  }
}

// One warp's A fragments (16 weight rows x one k16 step) for the 4 steps of a k-block in shared memory:
// thread (g, t) holds rows g and g + 8 at k = 2t, 2t+1 and 2t+8, 2t+9 — in the prepared layout, the bytes
// that the mma.sync tile reads as B fragments of the same rows. st: the thread's bytes of row g (row g's start +
// t * 8 for NVFP4, + t * 32 for bf16); sf: row g's 4 scale bytes.
template <class Cfg>
__device__ __forceinline__ void weight_fragments(const uint8_t* st, const uint8_t* sf, uint32_t wa[4][4]) {
  constexpr int kRow8 = 8 * Cfg::B_ROW_BYTES;  // row g + 8
  if constexpr (Cfg::FP4) {
    fp4_fragments(fp4_bytes<Cfg>(st, sf), wa);
  } else {
    const uint4 a0 = *reinterpret_cast<const uint4*>(st);
    const uint4 a1 = *reinterpret_cast<const uint4*>(st + 16);
    const uint4 b0 = *reinterpret_cast<const uint4*>(st + kRow8);
    const uint4 b1 = *reinterpret_cast<const uint4*>(st + kRow8 + 16);
    wa[0][0] = a0.x; wa[0][1] = b0.x; wa[0][2] = a0.y; wa[0][3] = b0.y;
    wa[1][0] = a0.z; wa[1][1] = b0.z; wa[1][2] = a0.w; wa[1][3] = b0.w;
    wa[2][0] = a1.x; wa[2][1] = b1.x; wa[2][2] = a1.y; wa[2][3] = b1.y;
    wa[3][0] = a1.z; wa[3][1] = b1.z; wa[3][2] = a1.w; wa[3][3] = b1.w;
  }
}

// This lane's weight and scale bytes in a stage (weight_fragments' st and sf for its warp's first row group), held in
// registers (dev::opaque), not worked out again from threadIdx in every k-block: the loop's time is its instruction
// count.
template <class Cfg> struct WarpWeightOffsets {
  static constexpr int RG = Cfg::ROW_GROUPS;
  uint32_t w_off, sf_off;
  __device__ __forceinline__ static WarpWeightOffsets make() {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
    WarpWeightOffsets o;
    o.w_off = dev::opaque(Cfg::A_BYTES + (warp * RG * 16 + gq) * Cfg::B_ROW_BYTES + t * (Cfg::FP4 ? 8 : 32));
    o.sf_off = dev::opaque(Cfg::A_BYTES + Cfg::B_BYTES + (warp * RG * 16 + gq) * 4);
    return o;
  }
};

}  // namespace fp4moe::cuda_backend
