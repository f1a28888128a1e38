// One block tile of the grouped GEMM: acc[BM x BN] = A[rows, 0:K] . B[n0:n0+BN, 0:K]^T, fp32.
// A (bf16 activations, gathered rows) and B (prepared NVFP4 or bf16 weights, kernels.h layout) stream
// through a STAGES-deep pipeline in K steps of 64 (TileLoader, StagePipe: B and its scales by bulk copies on
// an mbarrier per stage on sm_90, A by cp.async); B is decoded from shared memory straight
// into mma.sync B fragments (NVFP4: e2m1 * e4m3 * 2^-8 in bf16, exact; format/nvfp4_prepared.h), A comes in
// with ldmatrix. The kernels multiply the fp32 sums by kProductScale before their epilogues.
// The K order is the same for every tile configuration: each output's sum is the same chain of mma
// steps k = 0, 16, 32, ... whatever BM, so results do not depend on the tile choice (batch invariance).
#pragma once
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/mma.cuh"
#include "cuda/nvfp4_device.cuh"
#include "runtime/plan.h"

namespace fp4moe::cuda_backend {

// WEIGHTS_AS_A: the block tile of gemm_skinny.cuh (same stages, tokens as the mma B operand); WGMMA: its sm_90a
// form (wgmma.cuh), stages 1024-byte aligned.
template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int STAGES_, bool FP4_, bool WEIGHTS_AS_A_ = false,
          bool WGMMA_ = false>
struct TileConfig {
  static constexpr int BM = BM_, BN = BN_, BK = 64, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr bool FP4 = FP4_, WEIGHTS_AS_A = WEIGHTS_AS_A_, WGMMA = WGMMA_;
  static constexpr GemmConfig kPlan{BM, BN, BK, WARPS_M, WARPS_N, STAGES, WEIGHTS_AS_A, WGMMA};  // plan.h's view
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int BLOCK_THREADS = THREADS;
  static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;  // warp tile
  static constexpr int MT = WTM / 16, NT = WTN / 8;             // mma tiles per warp
  static constexpr int B_ROW_BYTES = FP4 ? 32 : 128;            // one row's 64 K of prepared weights
  static constexpr int A_BYTES = BM * BK * 2;
  static constexpr int B_BYTES = BN * B_ROW_BYTES;
  static constexpr int SF_BYTES = FP4 ? BN * 4 : 0;
  static constexpr int STAGE_BYTES = static_cast<int>(gemm_stage_bytes(kPlan, FP4));
  static constexpr int SMEM_BYTES = static_cast<int>(gemm_smem_bytes(kPlan, FP4));
  static constexpr int A_CHUNKS = (BM * 8 + THREADS - 1) / THREADS;  // 16-byte A chunks per thread per stage
  static_assert(STAGE_BYTES >= A_BYTES + B_BYTES + SF_BYTES, "stage layout");
  static_assert(BM % (WEIGHTS_AS_A ? 8 : 16 * WARPS_M) == 0 && BN % (8 * WARPS_N) == 0, "warp tiling");
  static_assert((BM * 8) % THREADS == 0 || BM * 8 < THREADS, "A chunks per thread");
  static_assert(B_BYTES % 16 == 0 && SF_BYTES % 16 == 0, "16-byte chunks");
  static_assert(!WGMMA || (WEIGHTS_AS_A && WARPS_N % 4 == 0 && A_BYTES % 1024 == 0), "wgmma: warpgroups, aligned B");
};

// The stages' base in the dynamic shared memory: a wgmma tile's is rounded up to 1024 bytes (SMEM_BYTES holds
// the extra kilobyte), the swizzle atom that the token tile's descriptors assume.
template <class C> __device__ __forceinline__ uint8_t* stage_base(uint8_t* smem) {
  if constexpr (!C::WGMMA) return smem;
  else return smem + ((1024u - (dev::smem_addr(smem) & 1023u)) & 1023u);
}

// The (token, slot) entry of permuted row r (dense problems: the row itself).
__device__ __forceinline__ int entry_of(const GemmProblem& g, int r) { return g.row_entry ? g.row_entry[r] : r; }

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
// The same, the running sums in shared memory: float4 i of them at sums[i * kStride].
template <int kStride, int N>
__device__ __forceinline__ void add_chunk_shared(float4* sums, const float (&part)[N][4], bool first) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float4 v = make_float4(part[i][0], part[i][1], part[i][2], part[i][3]);
    if (!first) {
      const float4 s = sums[i * kStride];
      v = make_float4(__fadd_rn(s.x, v.x), __fadd_rn(s.y, v.y), __fadd_rn(s.z, v.z), __fadd_rn(s.w, v.w));
    }
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

// The copies of one k-block of a block tile (both kernels). The weight rows [n0, n0 + BN) of a k-block are one
// contiguous run in the prepared layout, and so are their scales: on sm_90 one thread moves each with a bulk copy (the TMA unit)
// that completes on the stage's mbarrier, so the copy issue costs the other threads nothing (the per-thread
// cp.async issue was a quarter of the decode loop's instructions). Rows past N are not copied (their outputs are
// never stored). Before sm_90 the same runs go by cp.async, 16 bytes a thread, rows past N zero-filled. The
// token rows (gathered; zero past K) always go by cp.async. Every source pointer advances one k-block a load
// and always points into its buffer (a copy that is off reads nothing but still needs a valid address).
// (FP4MOE_GEMM_CP_ASYNC, a test build's define, takes the cp.async path on sm_90 too, so the H200 runs it.)
template <class C> struct TileLoader {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(FP4MOE_GEMM_CP_ASYNC)
  static constexpr bool kBulk = true;
#else
  static constexpr bool kBulk = false;
#endif
  // Every thread of the block loads; tid() is its index among them.
  static constexpr int LT = C::THREADS;
  __device__ static int tid() { return static_cast<int>(threadIdx.x); }
  static constexpr int B_CHUNKS = kBulk ? 0 : C::B_BYTES / 16 / LT;
  static_assert(kBulk || ((C::B_BYTES / 16) % LT == 0 && C::SF_BYTES / 16 <= LT), "whole weight chunks per thread");
  // The token chunks (16 bytes: 8 a row and k-block) go to warp 0 alone when they are few (8 rows: two a lane),
  // so that the other warps skip the copy issue with one branch; else to every thread. A tile's row i is
  // permuted row row0 + i, whose token row is its entry / gather_k (or the row itself); rows past the tile's end
  // are zero-filled, and so are columns past K.
  static constexpr int A_THREADS = C::BM * 8 <= 64 ? 32 : LT;
  static constexpr int A_CHUNKS = C::BM * 8 / A_THREADS;
  static_assert(C::BM * 8 % A_THREADS == 0, "whole token chunks per thread");
  const uint8_t* a_src[A_CHUNKS];  // this thread's token chunk at the next k-block
  uint32_t a_dst[A_CHUNKS];        // its offset in a stage (swizzled as the ldmatrix rows expect)
  int a_left[A_CHUNKS];            // k-blocks from the next one on that hold data for it (<= 0: zero fill)
  const uint8_t* b_src;            // the weight run at the next k-block
  const uint8_t* s_src;            // the scale run at the next k-block (NVFP4)
  int64_t b_stride, s_stride;      // bytes per k-block
  uint32_t b_bytes, s_bytes;       // sm_90: the runs' bytes (rows < N only)
  uint32_t b_off[B_CHUNKS > 0 ? B_CHUNKS : 1];   // before sm_90: this thread's chunks in the run (past N: row 0's)
  bool b_on[B_CHUNKS > 0 ? B_CHUNKS : 1], s_on;  // before sm_90: chunk inside N (else zero fill)

  // tr: the tile's expert and rows (TileRows); n0: its first weight row; kb0: the first k-block to load.
  template <class Rows>
  __device__ __forceinline__ TileLoader(const GemmProblem& g, const Rows& tr, int n0, int kb0) {
    const int tid = TileLoader::tid();
#pragma unroll
    for (int i = 0; i < A_CHUNKS; ++i) {
      const int c = tid % A_THREADS + i * A_THREADS, row = c >> 3, ch = c & 7;
      const int r = tr.row0 + row;
      const bool ok = row < C::BM && r < tr.row_end;
      const int rr = ok ? r : tr.row0;  // a tile has at least one row
      const int arow = g.gather_k ? entry_of(g, rr) / g.gather_k : rr;
      // k-blocks kb with kb * 64 + ch * 8 < K hold data: kb < ceil((K - ch * 8) / 64).
      a_left[i] = (ok ? (g.K - ch * 8 + C::BK - 1) / C::BK : 0) - kb0;
      a_src[i] = reinterpret_cast<const uint8_t*>(g.A + static_cast<int64_t>(arow) * g.lda + ch * 8) +
                 (a_left[i] > 0 ? static_cast<int64_t>(kb0) * C::BK * 2 : 0);
      a_dst[i] = row * 128 + ((ch ^ (row & 7)) << 4);
    }
    const int N = static_cast<int>(g.B.N);
    const int rows = min(C::BN, N - n0);  // >= 16: no tile starts past N
    b_stride = static_cast<int64_t>(N) * C::B_ROW_BYTES;
    s_stride = static_cast<int64_t>(N) * 4;
    b_src = g.B.data + static_cast<int64_t>(tr.expert) * g.B.expert_data_bytes + kb0 * b_stride +
            static_cast<int64_t>(n0) * C::B_ROW_BYTES;
    s_src = C::FP4 ? g.B.sf + static_cast<int64_t>(tr.expert) * g.B.expert_sf_bytes + kb0 * s_stride +
                         static_cast<int64_t>(n0) * 4
                   : nullptr;
    if constexpr (kBulk) {
      b_bytes = rows * C::B_ROW_BYTES;
      s_bytes = C::FP4 ? rows * 4 : 0;
    } else {
      constexpr int kRowChunks = C::B_ROW_BYTES / 16;
#pragma unroll
      for (int i = 0; i < B_CHUNKS; ++i) {
        const int c = tid + i * LT;
        b_on[i] = c / kRowChunks < rows;
        b_off[i] = (b_on[i] ? c : c % kRowChunks) * 16;
      }
      s_on = C::FP4 && tid * 4 < rows;  // a 16-byte scale chunk is 4 rows; rows is a multiple of 16
      if (s_on) s_src += tid * 16;
    }
  }

  // Issues the copies of the next k-block into the stage at shared address sstage (bulk ones completing on bar).
  __device__ __forceinline__ void load_next(uint32_t sstage, uint32_t bar) {
    const uint32_t sB = sstage + C::A_BYTES, sSF = sB + C::B_BYTES;
    const int tid = TileLoader::tid();
    if (A_THREADS == LT || tid < A_THREADS) {
#pragma unroll
      for (int i = 0; i < A_CHUNKS; ++i) {
        const bool ok = a_left[i] > 0;
        dev::cp_async16(sstage + a_dst[i], a_src[i], ok);
        a_src[i] += ok ? C::BK * 2 : 0;  // an exhausted chunk keeps its last valid address
        --a_left[i];
      }
      if constexpr (kBulk) {
        if (tid == 0) {
          dev::mbar_arrive_expect_tx(bar, b_bytes + s_bytes);
          dev::bulk_copy_g2s(sB, b_src, b_bytes, bar);
          if constexpr (C::FP4) dev::bulk_copy_g2s(sSF, s_src, s_bytes, bar);
        }
      }
    }
    if constexpr (!kBulk) {
      (void)bar;
#pragma unroll
      for (int i = 0; i < B_CHUNKS; ++i)
        dev::cp_async16(sB + (tid + i * LT) * 16, b_src + b_off[i], b_on[i]);
      if constexpr (C::FP4)
        if (tid < C::SF_BYTES / 16) dev::cp_async16(sSF + tid * 16, s_src, s_on);
    }
    b_src += b_stride;
    if constexpr (C::FP4) s_src += s_stride;
  }

  // Waits for the weights of the stage whose barrier is bar, in its phase of the given parity (bulk copies; the
  // cp.async copies are waited for by cp_async_wait).
  __device__ __forceinline__ void wait_weights(uint32_t bar, uint32_t parity) const {
    if constexpr (kBulk) dev::mbar_wait(bar, parity);
    else (void)bar, (void)parity;
  }
};

// The STAGES-deep pipeline of a block tile whose threads all load and all compute: stage s is bytes
// [s * STAGE_BYTES, +STAGE_BYTES) of the dynamic shared memory, its weights complete on barrier s (phase n: its n-th
// load). next() waits for the k-block after the last one returned and issues the copies kAhead k-blocks ahead,
// into the stage of k-block j + kAhead - STAGES: STAGES - 1 ahead (the stage every thread finished reading before
// this k-block's __syncthreads), or STAGES - 2 ahead for wgmma tiles, whose wgmmas may still read the previous
// k-block's stage (they are waited for one k-block later, before the __syncthreads that frees it).
template <class C> struct StagePipe {
  static constexpr int kAhead = C::STAGES - 1 - (C::WGMMA ? 1 : 0);  // k-blocks loaded ahead of the one read
  static_assert(kAhead >= 1, "stages");
  uint32_t sbase, bar0;
  int rd = 0, left;  // stage to read next (the stage to load next is kAhead after it), k-blocks still to load
  uint32_t ph = 0;   // parity of the phase of stage rd to wait for

  __device__ __forceinline__ StagePipe(uint8_t* smem, TileLoader<C>& ld, int nkb) {
    __shared__ __align__(8) uint64_t bars[C::STAGES];
    sbase = dev::smem_addr(smem);
    bar0 = dev::smem_addr(bars);
    if constexpr (TileLoader<C>::kBulk) {
      if (threadIdx.x < C::STAGES) dev::mbar_init(bar0 + 8 * threadIdx.x, 1);
      dev::mbar_init_fence();
      __syncthreads();
    }
#pragma unroll
    for (int s = 0; s < kAhead; ++s) {
      if (s < nkb) ld.load_next(sbase + s * C::STAGE_BYTES, bar0 + 8 * s);
      dev::cp_async_commit();
    }
    left = nkb - kAhead;
  }
  // The shared-space address of the next k-block's stage, its copies landed and visible to every thread.
  __device__ __forceinline__ uint32_t next(TileLoader<C>& ld) {
    dev::cp_async_wait<kAhead - 1>();
    // The tokens (cp.async) are read by wgmma (the async proxy): the PTX memory model asks for this fence (its
    // cost measured on the H200: 2 %, session8-dev run 4).
    if constexpr (C::WGMMA) dev::fence_proxy_async();
    __syncthreads();
    const uint32_t sstage = sbase + rd * C::STAGE_BYTES;
    ld.wait_weights(bar0 + 8 * rd, ph);
    const int wr = rd + kAhead < C::STAGES ? rd + kAhead : rd + kAhead - C::STAGES;
    if (left > 0) ld.load_next(sbase + wr * C::STAGE_BYTES, bar0 + 8 * wr);
    dev::cp_async_commit();
    --left;
    ph ^= rd == C::STAGES - 1 ? 1u : 0u;
    rd = rd == C::STAGES - 1 ? 0 : rd + 1;
    return sstage;
  }
};

// The copies of a skinny tile: every thread loads its share (TileLoader + StagePipe); next() returns the next
// k-block's stage, and the release calls are no-ops (__syncthreads frees the stages).
template <class C> struct TilePipeline {
  TileLoader<C> ld;
  StagePipe<C> pipe;
  template <class Rows>
  __device__ __forceinline__ TilePipeline(uint8_t* smem, const GemmProblem& g, const Rows& tr, int n0, int kb0,
                                          int nkb)
      : ld(g, tr, n0, kb0), pipe(smem, ld, nkb) {}
  __device__ __forceinline__ uint32_t sbase() const { return pipe.sbase; }
  __device__ __forceinline__ uint32_t next() { return pipe.next(ld); }
  __device__ __forceinline__ void release_older() {}
  __device__ __forceinline__ void release_all() {}
  __device__ __forceinline__ void finish() { dev::cp_async_wait<0>(); }
};

// __syncthreads for the math threads (every thread of the block computes).
template <class C> __device__ __forceinline__ void math_sync() { __syncthreads(); }

template <class Cfg> struct MainLoop {
  using C = Cfg;
  float acc[C::MT][C::NT][4];  // the sum over the chunks done
  float part[C::MT][C::NT][4];  // the chain of the current chunk

  // after_issue() runs once the first stages' copies are issued (work to overlap with them, e.g. the LoRA lookups).
  template <class AfterIssue>
  __device__ __forceinline__ void run(uint8_t* smem, TileLoader<C>& ld, int KB, AfterIssue&& after_issue) {
    StagePipe<C> pipe(smem, ld, KB);
    after_issue();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp / C::WARPS_N, wn = warp % C::WARPS_N;
    const int g = lane >> 2, t = lane & 3;

    for (int kb = 0; kb < KB; ++kb) {
      const uint32_t sstage = pipe.next(ld);  // A: ldmatrix's shared-space address
      if (kb % kChunkBlocks == 0) {
#pragma unroll
        for (int i = 0; i < C::MT; ++i)
#pragma unroll
          for (int j = 0; j < C::NT; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) part[i][j][q] = 0.f;
      }
      const uint8_t* sB = smem + (sstage - pipe.sbase) + C::A_BYTES;
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
