// One block tile of the grouped GEMM: acc[BM x BN] = A[rows, 0:K] . B[n0:n0+BN, 0:K]^T, fp32.
// A (bf16 activations, gathered rows) and B (prepared NVFP4 or bf16 weights, kernels.h layout) stream
// through a STAGES-deep cp.async pipeline in K steps of 64; B is decoded from shared memory straight
// into mma.sync B fragments (NVFP4: e2m1 * e4m3 in bf16, exact), A comes in with ldmatrix.
// The K order is the same for every tile configuration: each output's sum is the same chain of mma
// steps k = 0, 16, 32, ... whatever BM, so results do not depend on the tile choice (batch invariance).
#pragma once
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/mma.cuh"
#include "cuda/nvfp4_device.cuh"

namespace fp4moe::cuda_backend {

// WEIGHTS_AS_A: the block tile of gemm_skinny.cuh (same stages, tokens as the mma B operand).
template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int STAGES_, bool FP4_, bool WEIGHTS_AS_A_ = false>
struct TileConfig {
  static constexpr int BM = BM_, BN = BN_, BK = 64, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr bool FP4 = FP4_, WEIGHTS_AS_A = WEIGHTS_AS_A_;
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;  // warp tile
  static constexpr int MT = WTM / 16, NT = WTN / 8;             // mma tiles per warp
  static constexpr int B_ROW_BYTES = FP4 ? 32 : 128;            // one row's 64 K of prepared weights
  static constexpr int A_BYTES = BM * BK * 2;
  static constexpr int B_BYTES = BN * B_ROW_BYTES;
  static constexpr int SF_BYTES = FP4 ? BN * 4 : 0;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES + SF_BYTES;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;
  static constexpr int A_CHUNKS = (BM * 8 + THREADS - 1) / THREADS;  // 16-byte A chunks per thread per stage
  static_assert(BM % (WEIGHTS_AS_A ? 8 : 16 * WARPS_M) == 0 && BN % (8 * WARPS_N) == 0, "warp tiling");
  static_assert((BM * 8) % THREADS == 0 || BM * 8 < THREADS, "A chunks per thread");
  static_assert(B_BYTES % 16 == 0 && SF_BYTES % 16 == 0, "16-byte chunks");
};

// Per-thread view of the A rows it loads (fixed over the K loop).
template <class Cfg> struct ARows {
  const uint16_t* ptr[Cfg::A_CHUNKS];  // row start (null: row outside the tile's rows)
};

// Issues the cp.async copies of stage `stage` <- k-block kb: A rows (zero past the tile's rows and past K),
// the weight rows [n0, n0 + BN) of the k-block (one contiguous run) and their scales.
template <class C>
__device__ __forceinline__ void load_tile_stage(uint8_t* smem, int stage, int kb, const ARows<C>& arows, int K,
                                                const DeviceMatrix& B, const uint8_t* bdata, const uint8_t* bsf, int n0) {
  const int tid = threadIdx.x;
  const int N = static_cast<int>(B.N);
  uint8_t* sA = smem + stage * C::STAGE_BYTES;
  uint8_t* sB = sA + C::A_BYTES;
  uint8_t* sSF = sB + C::B_BYTES;
#pragma unroll
  for (int i = 0; i < C::A_CHUNKS; ++i) {
    const int c = tid + i * C::THREADS;
    if (C::BM * 8 < C::THREADS && c >= C::BM * 8) break;  // small tiles: fewer A chunks than threads
    const int row = c >> 3, ch = c & 7;
    const int k = kb * C::BK + ch * 8;
    const bool valid = arows.ptr[i] != nullptr && k < K;
    const uint16_t* src = valid ? arows.ptr[i] + k : nullptr;
    dev::cp_async16(sA + row * 128 + ((ch ^ (row & 7)) << 4), valid ? src : reinterpret_cast<const uint16_t*>(B.data), valid);
  }
  const uint8_t* gB = bdata + (static_cast<int64_t>(kb) * N + n0) * C::B_ROW_BYTES;
  constexpr int kRowChunks = C::B_ROW_BYTES / 16;
#pragma unroll
  for (int c = tid; c < C::B_BYTES / 16; c += C::THREADS) {
    const bool valid = n0 + c / kRowChunks < N;
    dev::cp_async16(sB + c * 16, valid ? gB + c * 16 : B.data, valid);
  }
  if constexpr (C::FP4) {
    const uint8_t* gS = bsf + (static_cast<int64_t>(kb) * N + n0) * 4;
    for (int c = tid; c < C::SF_BYTES / 16; c += C::THREADS) {
      const bool valid = n0 + c * 4 < N;  // N is a multiple of 16: a chunk's 4 rows are all in or out
      dev::cp_async16(sSF + c * 16, valid ? gS + c * 16 : B.data, valid);
    }
  }
}

// The (token, slot) entry of permuted row r (dense problems: the row itself).
__device__ __forceinline__ int entry_of(const GemmProblem& g, int r) { return g.row_entry ? g.row_entry[r] : r; }

// The A rows of a tile for this thread's chunks: row i of the tile is permuted row row0 + i, whose A row is
// its token (gather_k: entry / k) or itself.
template <class Cfg, class Rows>
__device__ __forceinline__ ARows<Cfg> tile_arows(const GemmProblem& g, const Rows& tr) {
  ARows<Cfg> arows;
#pragma unroll
  for (int i = 0; i < Cfg::A_CHUNKS; ++i) {
    const int r = tr.row0 + ((threadIdx.x + i * Cfg::THREADS) >> 3);
    arows.ptr[i] = nullptr;
    if (r < tr.row_end) {
      const int arow = g.gather_k ? entry_of(g, r) / g.gather_k : r;
      arows.ptr[i] = g.A + static_cast<int64_t>(arow) * g.lda;
    }
  }
  return arows;
}

template <class Cfg> struct MainLoop {
  using C = Cfg;
  float acc[C::MT][C::NT][4];

  // A: row i of the tile lives at arows.ptr (per chunk), B: this expert's matrix, columns from n0.
  __device__ __forceinline__ void run(uint8_t* smem, const ARows<C>& arows, int K, const DeviceMatrix& B, int expert,
                                      int n0) {
#pragma unroll
    for (int i = 0; i < C::MT; ++i)
#pragma unroll
      for (int j = 0; j < C::NT; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

    const int tid = threadIdx.x;
    const int KB = static_cast<int>(B.Kp / C::BK);
    const uint8_t* bdata = B.data + static_cast<int64_t>(expert) * B.expert_data_bytes;
    const uint8_t* bsf = C::FP4 ? B.sf + static_cast<int64_t>(expert) * B.expert_sf_bytes : nullptr;
    auto load_stage = [&](int stage, int kb) { load_tile_stage<C>(smem, stage, kb, arows, K, B, bdata, bsf, n0); };

#pragma unroll
    for (int s = 0; s < C::STAGES - 1; ++s) {
      if (s < KB) load_stage(s, s);
      dev::cp_async_commit();
    }

    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp / C::WARPS_N, wn = warp % C::WARPS_N;
    const int g = lane >> 2, t = lane & 3;

    for (int kb = 0; kb < KB; ++kb) {
      dev::cp_async_wait<C::STAGES - 2>();
      __syncthreads();
      {
        const int nk = kb + C::STAGES - 1;
        if (nk < KB) load_stage(nk % C::STAGES, nk);
        dev::cp_async_commit();
      }
      const uint8_t* sA = smem + (kb % C::STAGES) * C::STAGE_BYTES;
      const uint8_t* sB = sA + C::A_BYTES;
      const uint8_t* sSF = sB + C::B_BYTES;

      // B fragments of this warp for the 4 k16 steps.
      uint32_t bfrag[C::NT][4][2];
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        const int row = wn * C::WTN + nt * 8 + g;
        if constexpr (C::FP4) {
          const uint2 raw = *reinterpret_cast<const uint2*>(sB + row * 32 + t * 8);
          const uint32_t sc = *reinterpret_cast<const uint32_t*>(sSF + row * 4);
          uint32_t d[8];
          dev::e2m1x8_to_bf16x8(raw.x, d);
          dev::e2m1x8_to_bf16x8(raw.y, d + 4);
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const uint32_t s2 = dev::bf16x2_splat_from_f32(dev::e4m3_to_f32((sc >> (8 * s)) & 0xffu));
            bfrag[nt][s][0] = dev::bf16x2_mul(d[2 * s], s2);
            bfrag[nt][s][1] = dev::bf16x2_mul(d[2 * s + 1], s2);
          }
        } else {
          const uint4 q0 = *reinterpret_cast<const uint4*>(sB + row * 128 + t * 32);
          const uint4 q1 = *reinterpret_cast<const uint4*>(sB + row * 128 + t * 32 + 16);
          bfrag[nt][0][0] = q0.x; bfrag[nt][0][1] = q0.y;
          bfrag[nt][1][0] = q0.z; bfrag[nt][1][1] = q0.w;
          bfrag[nt][2][0] = q1.x; bfrag[nt][2][1] = q1.y;
          bfrag[nt][3][0] = q1.z; bfrag[nt][3][1] = q1.w;
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t afrag[C::MT][4];
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
          const int arow = wm * C::WTM + mt * 16 + (lane & 15);
          const int ch = 2 * s + (lane >> 4);
          dev::ldmatrix_x4(afrag[mt], sA + arow * 128 + ((ch ^ (arow & 7)) << 4));
        }
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < C::NT; ++nt) dev::mma_bf16_16816(acc[mt][nt], afrag[mt], bfrag[nt][s]);
      }
    }
    dev::cp_async_wait<0>();
  }
};

}  // namespace fp4moe::cuda_backend
