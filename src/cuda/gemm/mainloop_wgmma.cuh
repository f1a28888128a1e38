// The sm_90a wgmma mainloop of the Wgmma64 tile: each warpgroup multiplies its 64 weight rows (register A: the
// fragments of weight_fragments.cuh) by all BM tokens of the stage (shared B, 128-byte swizzle), one
// wgmma m64nBMk16 a k16 step, one K chunk's chain a call.
#pragma once
#include <cstdint>

#include "cuda/gemm/weight_fragments.cuh"
#include "cuda/wgmma.cuh"

namespace fp4moe::cuda_backend {

template <class Cfg> struct WeightsAsAWgmma {
  static_assert(Cfg::WGMMA && Cfg::BN == 16 * Cfg::WARPS_N, "wgmma: one row group of 16 a warp");
  static constexpr int RG = 1, GROUPS = Cfg::BM / 8, ACCS = GROUPS;
  WarpWeightOffsets<Cfg> wo = WarpWeightOffsets<Cfg>::make();

  // part += the products of k-blocks [kb_begin, kb_end). Every token row is multiplied (rows past the tile are
  // zero-filled, their outputs never stored). A k-block's wgmmas run on while the next k-block is waited for and
  // decoded: two fragment buffers, the wait one k-block later (StagePipe loads one k-block less ahead); k-blocks in
  // pairs with the odd one after (a pair's second k-block under a condition made ptxas serialize every wgmma:
  // C7513).
  template <class Pipe>
  __device__ __forceinline__ void chunk(float (&part)[ACCS][4], const uint8_t* smem, Pipe& pipe, int kb_begin,
                                        int kb_end, int) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const uint64_t desc0 = dev::wgmma_desc_sw128(pipe.sbase());  // stage 0's token rows, k16 step 0
    auto k_block = [&](uint32_t (&w)[4][4]) {
      const uint32_t off = pipe.next() - pipe.sbase();
      const uint8_t* st = smem + off;
      weight_fragments<Cfg>(st + wo.w_off, st + wo.sf_off, w);
      dev::wgmma_fence_acc(part);
      dev::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s)
        dev::Wgmma<Cfg::BM>::rs(part, w[s], dev::wgmma_desc_advance(desc0, off + 32 * s), true);
      dev::wgmma_commit();
      dev::wgmma_wait<1>();  // the k-block before: its stage and fragment buffer are free again
      pipe.release_older();
    };
    uint32_t wa[2][4][4];
    int kb = kb_begin;
    for (; kb + 1 < kb_end; kb += 2) {
      k_block(wa[0]);
      k_block(wa[1]);
    }
    for (; kb < kb_end; ++kb) k_block(wa[0]);  // the odd one (a loop: an if here gave other, untested code)
    dev::wgmma_wait<0>();
    pipe.release_all();
    dev::wgmma_fence_acc(part);
#else
    (void)part, (void)smem, (void)pipe, (void)kb_begin, (void)kb_end;
    __trap();  // the plan picks this tile on sm_90a devices only (ProblemShape::wgmma)
#endif
  }
};

}  // namespace fp4moe::cuda_backend
