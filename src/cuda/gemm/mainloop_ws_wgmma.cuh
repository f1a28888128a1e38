// The mainloop of the warp-specialised wgmma tile (sm_90a), run by its math warps: wait for a stage, decode this
// warp's weight rows into register A fragments, wgmma them against the stage's BM tokens (shared B), hand the stage
// back. Each warp has RG row groups of 16 weight rows (32 rows for NVFP4, 16 for bf16 weights); row group r of the
// warpgroup's four warps is one m64 wgmma tile, so a warpgroup multiplies 64 * RG weight rows by BM tokens.
//
// The decode of one row group ("unit") runs while the wgmmas of the unit before it run: two fragment buffers, each
// refilled once the unit two back completed (wgmma_wait<1>); one commit group a unit. A stage goes back to the
// producer once the wgmmas of its last unit completed.
#pragma once
#include <cstdint>
#include <type_traits>

#include "cuda/gemm/k_order.cuh"
#include "cuda/gemm/pipeline_ws.cuh"
#include "cuda/gemm/weight_fragments.cuh"
#include "cuda/wgmma.cuh"

namespace fp4moe::cuda_backend {

template <class Cfg> struct WsWgmmaMath {
  static constexpr int RG = Cfg::ROW_GROUPS, GROUPS = Cfg::BM / 8;
  static_assert(Cfg::WS && (RG == 1 || RG == 2) && Cfg::BN == 16 * RG * Cfg::WARPS_N, "warp-specialised wgmma tile");
  using Ring = WsRing<Cfg>;
  uint32_t w_off[RG], sf_off[RG];  // this lane's weight and scale bytes of row group r in a stage (dev::opaque)
  uint64_t desc0;                  // the tokens of stage 0, k16 step 0
  typename Ring::Reader rd;

  __device__ __forceinline__ explicit WsWgmmaMath(const Ring& ring) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < RG; ++r) {
      const int row = warp * 16 * RG + 16 * r + gq;
      w_off[r] = dev::opaque(Cfg::A_BYTES + row * Cfg::B_ROW_BYTES + t * (Cfg::FP4 ? 8 : 32));
      sf_off[r] = dev::opaque(Cfg::A_BYTES + Cfg::B_BYTES + row * 4);
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    desc0 = dev::wgmma_desc_sw128(ring.base);
#endif
  }

  // part[r] += the products of k-blocks [kb_begin, kb_end) (a chunk's chain: part is zero at the call). Every
  // token row is multiplied (rows past the tile are zero-filled, their outputs never stored).
  __device__ __forceinline__ void chunk(float (&part)[RG][GROUPS][4], const uint8_t* smem, const Ring& ring,
                                        int kb_begin, int kb_end) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    uint32_t wa[2][4][4];
    // One unit: row group r of the stage at offset off (from the ring's base), decoded into w.
    auto unit = [&](uint32_t (&w)[4][4], uint32_t off, int r) {
#if FP4MOE_WS_VARIANT == 5 || defined(FP4MOE_DIAG_NODEC)
      {
        const uint4 v = *reinterpret_cast<const uint4*>(smem + ((off + w_off[r]) & ~15u));
        const uint32_t f = *reinterpret_cast<const uint32_t*>(smem + off + sf_off[r]);
        for (int a = 0; a < 4; ++a) w[a][0] = v.x ^ f, w[a][1] = v.y, w[a][2] = v.z, w[a][3] = v.w;
      }
#else
      weight_fragments<Cfg>(smem + off + w_off[r], smem + off + sf_off[r], w);
#endif
      dev::wgmma_fence_acc(part[r]);
      dev::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s)
        dev::Wgmma<Cfg::BM>::rs(part[r], w[s], dev::wgmma_desc_advance(desc0, off + 32 * s), true);
      dev::wgmma_commit();
    };
    auto next_stage = [&](uint32_t& off) {
      const int s = rd.s;
      off = ring.wait_full(rd) - ring.base;
      return s;
    };
    int kb = kb_begin;
    if constexpr (RG == 2) {
      // A k-block's two units: buffer r for row group r. Before unit (kb, 1) the units up to (kb - 1, 1) are done:
      // the stage before is free.
      int prev = -1;
#if FP4MOE_WS_VARIANT == 7
      // Three fragment buffers: a unit's decode waits for the unit three back; stage kb - 2 goes back before (kb, 0).
      uint32_t wc[4][4];
      int prev2 = -1;
      auto kblock = [&](uint32_t (&w0)[4][4], uint32_t (&w1)[4][4]) {
        uint32_t off;
        const int s = next_stage(off);
        dev::wgmma_wait<2>();
        if (prev2 >= 0) ring.release(prev2);
        prev2 = prev;
        prev = s;
        unit(w0, off, 0);
        dev::wgmma_wait<2>();
        unit(w1, off, 1);
      };
      for (; kb + 2 < kb_end; kb += 3) {
        kblock(wa[0], wa[1]);
        kblock(wc, wa[0]);
        kblock(wa[1], wc);
      }
      if (kb < kb_end) kblock(wa[0], wa[1]), ++kb;
      if (kb < kb_end) kblock(wc, wa[0]), ++kb;
      dev::wgmma_wait<0>();
      if (prev2 >= 0) ring.release(prev2);
#else
      for (; kb < kb_end; ++kb) {
        uint32_t off;
        const int s = next_stage(off);
        dev::wgmma_wait<1>();
        unit(wa[0], off, 0);
        dev::wgmma_wait<1>();
        if (prev >= 0) ring.release(prev);
        prev = s;
        unit(wa[1], off, 1);
      }
      dev::wgmma_wait<0>();
#endif
      if (prev >= 0) ring.release(prev);
    } else {
      // A unit a k-block, in pairs (buffers 0, 1); the odd one after. After unit kb's issue the unit before is done.
      int prev = -1;
      auto one = [&](uint32_t (&w)[4][4]) {
        uint32_t off;
        const int s = next_stage(off);
        unit(w, off, 0);
        dev::wgmma_wait<1>();
        if (prev >= 0) ring.release(prev);
        prev = s;
      };
      for (; kb + 1 < kb_end; kb += 2) {
        one(wa[0]);
        one(wa[1]);
      }
      for (; kb < kb_end; ++kb) one(wa[0]);  // (a loop: an if here gave other, untested code)
      dev::wgmma_wait<0>();
      if (prev >= 0) ring.release(prev);
    }
#pragma unroll
    for (int r = 0; r < RG; ++r) dev::wgmma_fence_acc(part[r]);
#else
    (void)part, (void)smem, (void)ring, (void)kb_begin, (void)kb_end;
    __trap();  // the plan picks this tile on sm_90a devices only (ProblemShape::wgmma)
#endif
  }

  // The whole K of an RG == 2 tile, its chunk sums added into `sums` (add_chunk_shared, RG float4 a thread apart);
  // a chain starts from zero by the wgmma's scale-d. NBUF fragment buffers: a unit's decode waits for the unit NBUF
  // back (its buffer); a stage goes back once the units reading it completed. OVERLAP (NBUF = 2): row group 0's chain
  // is added while row group 1's last wgmmas run, row group 1's while the next chunk's first unit runs; else both
  // once the wgmmas drained.
  template <int NBUF, bool OVERLAP>
  __device__ __forceinline__ void all_chunks(float4* sums, const uint8_t* smem, const Ring& ring, int KB) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(RG == 2 && (NBUF == 2 || NBUF == 3) && (!OVERLAP || NBUF == 2), "fragment buffers");
    float part[RG][GROUPS][4];
    uint32_t wa[NBUF][4][4];
    auto unit = [&](uint32_t (&w)[4][4], uint32_t off, int r, bool acc) {
#if FP4MOE_WS_VARIANT == 5 || defined(FP4MOE_DIAG_NODEC)
      {
        const uint4 v = *reinterpret_cast<const uint4*>(smem + ((off + w_off[r]) & ~15u));
        const uint32_t f = *reinterpret_cast<const uint32_t*>(smem + off + sf_off[r]);
        for (int a = 0; a < 4; ++a) w[a][0] = v.x ^ f, w[a][1] = v.y, w[a][2] = v.z, w[a][3] = v.w;
      }
#else
      weight_fragments<Cfg>(smem + off + w_off[r], smem + off + sf_off[r], w);
#endif
      dev::wgmma_fence_acc(part[r]);
      dev::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s)
        dev::Wgmma<Cfg::BM>::rs(part[r], w[s], dev::wgmma_desc_advance(desc0, off + 32 * s), acc || s > 0);
      dev::wgmma_commit();
    };
    // Row group r's finished chain of chunk c added to the sums (its wgmmas completed).
    auto flush = [&](int r, int c) {
      dev::wgmma_fence_acc(part[r]);
      add_chunk_shared<RG * Cfg::THREADS>(sums + r * Cfg::THREADS, part[r], c == 0);
    };
    int prev = -1, prev2 = -1;  // the stages of the k-blocks before, not yet handed back
    // k-block kb into buffers w0 (row group 0) and w1 (row group 1). Two buffers: stage kb - 1 goes back before unit
    // (kb, 1); three: stage kb - 2 before unit (kb, 0).
    auto kblock = [&](auto overlap_t, int kb, uint32_t (&w0)[4][4], uint32_t (&w1)[4][4]) {
      constexpr bool overlap = decltype(overlap_t)::value;  // a chunk boundary, flushed row group by row group
      const int s = rd.s;
#ifdef FLUSH_FIRST
      if constexpr (overlap) {
        dev::wgmma_wait<1>();  // unit (kb - 1, 0) done
        flush(0, kb / kChunkBlocks - 1);
      }
#endif
      const uint32_t off = ring.wait_full(rd) - ring.base;
      const bool start = kb % kChunkBlocks == 0;  // a chunk's first k-block: its chains start from zero
      if constexpr (overlap) {
#ifndef FLUSH_FIRST
        dev::wgmma_wait<1>();  // unit (kb - 1, 0) done
        flush(0, kb / kChunkBlocks - 1);
#endif
      } else if (!OVERLAP && start && kb > 0) {
        dev::wgmma_wait<0>();
        flush(0, kb / kChunkBlocks - 1);
        flush(1, kb / kChunkBlocks - 1);
      } else {
        dev::wgmma_wait<NBUF - 1>();
      }
      if constexpr (NBUF == 3) {
        if (prev2 >= 0) ring.release(prev2);
        prev2 = prev;
        prev = s;
      }
      unit(w0, off, 0, !start);
      if constexpr (NBUF == 2 || overlap) dev::wgmma_wait<1>();  // unit (kb - 1, 1) done
      else dev::wgmma_wait<2>();
      if constexpr (NBUF == 2) {
        if (prev >= 0) ring.release(prev);
        prev = s;
      }
      if constexpr (overlap) flush(1, kb / kChunkBlocks - 1);
      unit(w1, off, 1, !start);
    };
    using Plain = std::false_type;
    int kb = 0;
    if constexpr (OVERLAP) {
      // A chunk's last k-block and the next chunk's first in straight-line code (so that the compiler sees which
      // wgmmas a wait leaves in flight when a chain is read), the others in a loop.
      for (;;) {
        const int last = min(KB, (kb / kChunkBlocks + 1) * kChunkBlocks) - 1;
        for (; kb < last; ++kb) kblock(Plain{}, kb, wa[0], wa[1]);
        kblock(Plain{}, kb++, wa[0], wa[1]);
        if (kb == KB) break;
        kblock(std::true_type{}, kb++, wa[0], wa[1]);
        if (kb == KB) break;
      }
    } else if constexpr (NBUF == 2) {
      for (; kb < KB; ++kb) kblock(Plain{}, kb, wa[0], wa[1]);
    } else {
      // The buffers of units 2 kb and 2 kb + 1 repeat every three k-blocks.
      for (; kb + 2 < KB; kb += 3) {
        kblock(Plain{}, kb, wa[0], wa[1]);
        kblock(Plain{}, kb + 1, wa[2], wa[0]);
        kblock(Plain{}, kb + 2, wa[1], wa[2]);
      }
      if (kb < KB) kblock(Plain{}, kb++, wa[0], wa[1]);
      if (kb < KB) kblock(Plain{}, kb++, wa[2], wa[0]);
    }
    dev::wgmma_wait<0>();
    if (prev2 >= 0) ring.release(prev2);
    if (prev >= 0) ring.release(prev);
    const int last = (KB - 1) / kChunkBlocks;
    flush(0, last);
    flush(1, last);
#else
    (void)sums, (void)smem, (void)ring, (void)KB;
    __trap();  // the plan picks this tile on sm_90a devices only (ProblemShape::wgmma)
#endif
  }

};

}  // namespace fp4moe::cuda_backend
