// The mainloop of the warp-specialised wgmma tile (sm_90a), run by its math warps: wait for a stage, decode this
// warp's weight rows into register A fragments, wgmma them against the stage's BM tokens (shared B), hand the stage
// back. Each warp has RG row groups of 16 weight rows (32 rows for NVFP4, 16 for bf16 weights); row group r of the
// warpgroup's four warps is one m64 wgmma tile, so a warpgroup multiplies 64 * RG weight rows by the stage's first
// 8 * NG of its BM tokens (the tile's rows rounded up: with_tile_tokens, kernel_ws_wgmma.cuh).
//
// The decode of one row group ("unit") runs while the wgmmas of the unit before it run: two fragment buffers, each
// refilled once the unit two back completed (wgmma_wait<1>); one commit group a unit. A stage goes back to the
// producer once the wgmmas of its last unit completed.
#pragma once
#include <cstdint>

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

  // part[r] += the products of k-blocks [kb_begin, kb_end) (a chunk's chain: part is zero at the call) for the
  // stage's first 8 * NG token rows (the wgmma's N; rows past the tile are zero-filled, their outputs never stored).
  // idle (warpgroup-uniform): every weight row of the warpgroup is past N (a layer's last n tile), so it only
  // waits for each stage and hands it back, leaving the SM to the other warpgroup.
  template <int NG>
  __device__ __forceinline__ void chunk(float (&part)[RG][NG][4], const uint8_t* smem, const Ring& ring,
                                        int kb_begin, int kb_end, bool idle) {
    static_assert(NG >= 1 && NG <= GROUPS, "the stage's token rows");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (idle) {
      for (int kb = kb_begin; kb < kb_end; ++kb) {
        const int s = rd.s;
        ring.wait_full(rd);
        ring.release(s);
      }
      return;
    }
    uint32_t wa[2][4][4];
    // One unit: row group r of the stage at offset off (from the ring's base), decoded into w.
    auto unit = [&](uint32_t (&w)[4][4], uint32_t off, int r) {
      weight_fragments<Cfg>(smem + off + w_off[r], smem + off + sf_off[r], w);
      dev::wgmma_fence_acc(part[r]);
      dev::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s)
        dev::Wgmma<8 * NG>::rs(part[r], w[s], dev::wgmma_desc_advance(desc0, off + 32 * s), true);
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
    (void)part, (void)smem, (void)ring, (void)kb_begin, (void)kb_end, (void)idle;
    __trap();  // the plan picks this tile on sm_90a devices only (ProblemShape::wgmma)
#endif
  }

};

}  // namespace fp4moe::cuda_backend
