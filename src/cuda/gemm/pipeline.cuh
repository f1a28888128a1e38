// The shared-memory pipeline of a block tile: TileLoader issues one k-block's copies (weights and scales by bulk
// copies on an mbarrier per stage on sm_90, tokens by cp.async), StagePipe cycles the STAGES stages, TilePipeline
// is the interface a mainloop sees (next stage, release, finish).
#pragma once
#include <cstdint>

#include "cuda/gemm/scheduler.cuh"
#include "cuda/gemm/tile_config.cuh"
#include "cuda/mma.cuh"

namespace fp4moe::cuda_backend {

// The copies of one k-block of a block tile (both kernels). The weight rows [n0, n0 + BN) of a k-block are one
// contiguous run in the prepared layout, and so are their scales: on sm_90 one thread moves each with a bulk copy
// (the TMA unit) that completes on the stage's mbarrier, so the copy issue costs the other threads nothing (the
// per-thread cp.async issue was a quarter of the decode loop's instructions). Rows past N are not copied (their
// outputs are never stored). Before sm_90 the same runs go by cp.async, 16 bytes a thread, rows past N zero-filled. The
// token rows (gathered; zero past K) always go by cp.async. Every source pointer advances one k-block a load
// and always points into its buffer (a copy that is off reads nothing but still needs a valid address).
// (FP4MOE_GEMM_CP_ASYNC, a test build's define, takes the cp.async path on sm_90 too, so the H200 runs it.)
template <class C> struct TileLoader {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(FP4MOE_GEMM_CP_ASYNC)
  static constexpr bool kBulk = true;
#else
  static constexpr bool kBulk = false;
#endif
  // Every thread of the block loads (a WS tile: its producer warpgroup, after the math threads); tid() is its index
  // among them.
  static constexpr int LT = C::WS ? C::PRODUCER_THREADS : C::THREADS;
  __device__ static int tid() { return static_cast<int>(threadIdx.x) - (C::WS ? C::THREADS : 0); }
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
        bool ok = a_left[i] > 0;
#if FP4MOE_WS_VARIANT == 4 || defined(FP4MOE_DIAG_NOTOK)
        if constexpr (C::WS) ok = false;
#endif
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
// load). The k-blocks go by in units of kPer: next() waits for the unit after the last one returned (one
// cp.async group, one __syncthreads) and issues the copies kAhead k-blocks ahead, into the stages every thread
// finished reading before this unit's __syncthreads: STAGES - kPer ahead, or STAGES - 2 for wgmma tiles, whose
// wgmmas may still read the previous k-block's stage (they are waited for one k-block later, before the
// __syncthreads that frees it). The mma.sync weights-as-A tiles take two k-blocks a unit: the decode loop's time
// is its instructions a weight byte, and the wait and barrier of a k-block were a large share of them.
template <class C> struct StagePipe {
  static constexpr int kPer = C::WEIGHTS_AS_A && !C::WGMMA && C::STAGES % 2 == 0 ? 2 : 1;  // k-blocks a unit
  static constexpr int kAhead = C::STAGES - kPer - (C::WGMMA ? 1 : 0);  // k-blocks loaded ahead of the unit read
  static constexpr int kGroupsAhead = kAhead / kPer;                     // cp.async groups (one a unit)
  static_assert(kAhead >= 1 && kAhead % kPer == 0 && C::STAGES % kPer == 0, "stages");
  uint32_t sbase, bar0;
  int rd = 0, left;  // first stage of the unit to read next, k-blocks still to load
  uint32_t ph = 0;   // parity of the phase of stage rd (and of the unit's other stage) to wait for

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
    for (int u = 0; u < kGroupsAhead; ++u) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int s = u * kPer + i;
        if (s < nkb) ld.load_next(sbase + s * C::STAGE_BYTES, bar0 + 8 * s);
      }
      dev::cp_async_commit();
    }
    left = nkb - kAhead;
  }
  // The shared-space address of the next unit's first stage (its others follow it), the copies landed and visible to
  // every thread. both: the unit's second k-block exists (kPer = 2; a range's last unit may hold one).
  __device__ __forceinline__ uint32_t next(TileLoader<C>& ld, bool both = true) {
    dev::cp_async_wait<kGroupsAhead - 1>();
    // The tokens (cp.async) are read by wgmma (the async proxy): the PTX memory model asks for this fence.
    if constexpr (C::WGMMA) dev::fence_proxy_async();
    __syncthreads();
    const uint32_t sstage = sbase + rd * C::STAGE_BYTES;
    ld.wait_weights(bar0 + 8 * rd, ph);
    if (kPer == 2 && both) ld.wait_weights(bar0 + 8 * (rd + 1), ph);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int w = rd + kAhead + i, wr = w < C::STAGES ? w : w - C::STAGES;
      if (left > 0) ld.load_next(sbase + wr * C::STAGE_BYTES, bar0 + 8 * wr);
      --left;
    }
    dev::cp_async_commit();
    ph ^= rd + kPer == C::STAGES ? 1u : 0u;
    rd = rd + kPer == C::STAGES ? 0 : rd + kPer;
    return sstage;
  }
};

// The copies of a weights-as-A tile: every thread loads its share (TileLoader + StagePipe); next() returns the next
// unit's first stage (kPer k-blocks), and the release calls are no-ops (__syncthreads frees the stages).
template <class C> struct TilePipeline {
  TileLoader<C> ld;
  StagePipe<C> pipe;
  template <class Rows>
  __device__ __forceinline__ TilePipeline(uint8_t* smem, const GemmProblem& g, const Rows& tr, int n0, int kb0,
                                          int nkb)
      : ld(g, tr, n0, kb0), pipe(smem, ld, nkb) {}
  __device__ __forceinline__ uint32_t sbase() const { return pipe.sbase; }
  static constexpr int kPer = StagePipe<C>::kPer;
  __device__ __forceinline__ uint32_t next(bool both = true) { return pipe.next(ld, both); }
  __device__ __forceinline__ void release_older() {}
  __device__ __forceinline__ void release_all() {}
  __device__ __forceinline__ void finish() { dev::cp_async_wait<0>(); }
};

// __syncthreads for the math threads (every thread of the block computes).
template <class C> __device__ __forceinline__ void math_sync() { __syncthreads(); }

}  // namespace fp4moe::cuda_backend
