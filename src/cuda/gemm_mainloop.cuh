// One block tile of the grouped GEMM: acc[BM x BN] = A[rows, 0:K] . B[n0:n0+BN, 0:K]^T, fp32.
// A (bf16 activations, gathered rows) and B (prepared NVFP4 or bf16 weights, kernels.h layout) stream
// through a STAGES-deep cp.async pipeline in K steps of 64; B is decoded from shared memory straight
// into mma.sync B fragments (NVFP4: e2m1 * e4m3 * 2^-8 in bf16, exact; format/nvfp4_prepared.h), A comes in
// with ldmatrix. The kernels multiply the fp32 sums by kProductScale before their epilogues.
// The K order is the same for every tile configuration: each output's sum is the same chain of mma
// steps k = 0, 16, 32, ... whatever BM, so results do not depend on the tile choice (batch invariance).
#pragma once
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/mma.cuh"
#include "cuda/nvfp4_device.cuh"
#include "fp4moe/plan.h"

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

// The (token, slot) entry of permuted row r (dense problems: the row itself).
__device__ __forceinline__ int entry_of(const GemmProblem& g, int r) { return g.row_entry ? g.row_entry[r] : r; }

// The cp.async copies of one pipeline stage, with every address that does not depend on the k-block worked
// out once per tile (the issue slots of a decode GEMM are its bottleneck): A rows (zero past the tile's rows
// and past K), the weight rows [n0, n0 + BN) of the k-block (one contiguous run) and their scales.
template <class C> struct TileLoader {
  static constexpr int B_CHUNKS = (C::B_BYTES / 16 + C::THREADS - 1) / C::THREADS;
  static constexpr int S_CHUNKS = C::SF_BYTES / 16;
  static_assert(S_CHUNKS <= C::THREADS, "one scale chunk per thread at most");
  const uint16_t* a_src[C::A_CHUNKS];  // this thread's A chunk at k = 0 (null: zero fill)
  uint32_t a_dst[C::A_CHUNKS];         // its offset in a stage (swizzled)
  int a_k[C::A_CHUNKS];                // its k within a k-block
  const uint8_t* b_src[B_CHUNKS];      // weight chunk at k-block 0 (null: past N)
  const uint8_t* s_src;                // scale chunk at k-block 0 (null: none for this thread)
  int64_t b_stride, s_stride;          // bytes per k-block
  int K;
  const uint8_t* dummy;                // a valid address for zero-filling copies

  // Row i of the tile is permuted row row0 + i, whose A row is its token (gather_k: entry / k) or itself.
  template <class Rows>
  __device__ __forceinline__ TileLoader(const GemmProblem& g, const Rows& tr, int expert, int n0) {
    const int tid = threadIdx.x;
    K = g.K;
    dummy = g.B.data;
#pragma unroll
    for (int i = 0; i < C::A_CHUNKS; ++i) {
      const int c = tid + i * C::THREADS, row = c >> 3, ch = c & 7;
      const int r = tr.row0 + row;
      a_src[i] = nullptr;
      if (row < C::BM && r < tr.row_end) {
        const int arow = g.gather_k ? entry_of(g, r) / g.gather_k : r;
        a_src[i] = g.A + static_cast<int64_t>(arow) * g.lda + ch * 8;
      }
      a_dst[i] = row * 128 + ((ch ^ (row & 7)) << 4);
      a_k[i] = ch * 8;
    }
    const int N = static_cast<int>(g.B.N);
    const uint8_t* bdata = g.B.data + static_cast<int64_t>(expert) * g.B.expert_data_bytes;
    constexpr int kRowChunks = C::B_ROW_BYTES / 16;
#pragma unroll
    for (int i = 0; i < B_CHUNKS; ++i) {
      const int c = tid + i * C::THREADS;
      const bool ok = c < C::B_BYTES / 16 && n0 + c / kRowChunks < N;
      b_src[i] = ok ? bdata + static_cast<int64_t>(n0) * C::B_ROW_BYTES + c * 16 : nullptr;
    }
    b_stride = static_cast<int64_t>(N) * C::B_ROW_BYTES;
    s_src = nullptr;
    s_stride = static_cast<int64_t>(N) * 4;
    if constexpr (C::FP4) {
      // N is a multiple of 16: a chunk's 4 rows are all in or all out.
      if (tid < S_CHUNKS && n0 + tid * 4 < N)
        s_src = g.B.sf + static_cast<int64_t>(expert) * g.B.expert_sf_bytes + static_cast<int64_t>(n0) * 4 + tid * 16;
    }
  }

  // sstage: the shared-space address of the stage (dev::smem_addr of its first byte).
  __device__ __forceinline__ void load(uint32_t sstage, int kb) const {
    const uint32_t sA = sstage, sB = sA + C::A_BYTES, sSF = sB + C::B_BYTES;
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < C::A_CHUNKS; ++i) {
      if (C::BM * 8 < C::THREADS * (i + 1) && tid + i * C::THREADS >= C::BM * 8) break;  // fewer chunks than threads
      const bool ok = a_src[i] != nullptr && kb * C::BK + a_k[i] < K;
      dev::cp_async16(sA + a_dst[i], ok ? static_cast<const void*>(a_src[i] + kb * C::BK) : dummy, ok);
    }
#pragma unroll
    for (int i = 0; i < B_CHUNKS; ++i) {
      const bool ok = b_src[i] != nullptr;
      if (C::B_BYTES / 16 % C::THREADS != 0 && tid + i * C::THREADS >= C::B_BYTES / 16) break;
      dev::cp_async16(sB + (tid + i * C::THREADS) * 16, ok ? b_src[i] + kb * b_stride : dummy, ok);
    }
    if constexpr (C::FP4) {
      if (tid < S_CHUNKS) dev::cp_async16(sSF + tid * 16, s_src ? s_src + kb * s_stride : dummy, s_src != nullptr);
    }
  }
};

// The canonical K order of every GEMM here (batch invariance, SPEC §4): K is cut into chunks of
// kKChunk (plan.h); each chunk is one chain of m16n8k16 steps k = 0, 16, 32, ... from a zero accumulator, and
// an output is the fp32 sum of its chunk sums in chunk order. A tile may take a range of chunks
// (split-K over blocks, gemm_skinny.cuh): the chunk sums are then added in the same order by the last block.
constexpr int kChunkBlocks = static_cast<int>(kKChunk / 64);

// The range of k-blocks [begin, end) of split z of `splits`, in whole chunks; KB = k-blocks of K.
struct KRange {
  int begin, end;
};
__device__ __forceinline__ KRange k_range(int KB, int z, int splits) {
  const int chunks = (KB + kChunkBlocks - 1) / kChunkBlocks;
  const int per = (chunks + splits - 1) / splits;
  const int b = min(KB, z * per * kChunkBlocks);
  return KRange{b, min(KB, b + per * kChunkBlocks)};
}

// A finished chunk's chain added to the running sums in chunk order (the first chunk starts them).
template <int N> __device__ __forceinline__ void add_chunk(float (&acc)[N][4], const float (&part)[N][4], bool first) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[i][q] = first ? part[i][q] : __fadd_rn(acc[i][q], part[i][q]);
}
// Prepared NVFP4 sums times kProductScale (format/nvfp4_prepared.h): the sums of the true products.
template <int N> __device__ __forceinline__ void unscale_products(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[i][q] *= nvfp4_prepared::kProductScale;
}

template <class Cfg> struct MainLoop {
  using C = Cfg;
  float acc[C::MT][C::NT][4];  // the sum over the chunks done
  float part[C::MT][C::NT][4];  // the chain of the current chunk

  __device__ __forceinline__ void run(uint8_t* smem, const TileLoader<C>& ld, int KB) {
    const int tid = threadIdx.x;
    const uint32_t sbase = dev::smem_addr(smem);
#pragma unroll
    for (int s = 0; s < C::STAGES - 1; ++s) {
      if (s < KB) ld.load(sbase + s * C::STAGE_BYTES, s);
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
        if (nk < KB) ld.load(sbase + (nk % C::STAGES) * C::STAGE_BYTES, nk);
        dev::cp_async_commit();
      }
      if (kb % kChunkBlocks == 0) {
#pragma unroll
        for (int i = 0; i < C::MT; ++i)
#pragma unroll
          for (int j = 0; j < C::NT; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) part[i][j][q] = 0.f;
      }
      const uint32_t sstage = sbase + (kb % C::STAGES) * C::STAGE_BYTES;  // A: ldmatrix's shared-space address
      const uint8_t* sB = smem + (kb % C::STAGES) * C::STAGE_BYTES + C::A_BYTES;
      const uint8_t* sSF = sB + C::B_BYTES;

      // B fragments of this warp for the 4 k16 steps.
      uint32_t bfrag[C::NT][4][2];
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        const int row = wn * C::WTN + nt * 8 + g;
        if constexpr (C::FP4) {
          uint32_t w[4][2];
          dev::fp4_row_fragments(*reinterpret_cast<const uint2*>(sB + row * 32 + t * 8),
                                 *reinterpret_cast<const uint32_t*>(sSF + row * 4), w);
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            bfrag[nt][s][0] = w[s][0];
            bfrag[nt][s][1] = w[s][1];
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
          dev::ldmatrix_x4(afrag[mt], sstage + arow * 128 + ((ch ^ (arow & 7)) << 4));
        }
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < C::NT; ++nt) dev::mma_bf16_16816(part[mt][nt], afrag[mt], bfrag[nt][s]);
      }
      if (kb % kChunkBlocks == kChunkBlocks - 1 || kb == KB - 1) {  // chunk done: add it in chunk order
#pragma unroll
        for (int i = 0; i < C::MT; ++i) add_chunk(acc[i], part[i], kb < kChunkBlocks);
      }
    }
    dev::cp_async_wait<0>();
    if constexpr (C::FP4) {
#pragma unroll
      for (int i = 0; i < C::MT; ++i) unscale_products(acc[i]);
    }
  }
};

}  // namespace fp4moe::cuda_backend
