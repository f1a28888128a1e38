// The block tiles of the grouped GEMM: TileConfig (one tile's geometry and shared-memory stage layout) and
// TileOf<GemmTile>, which makes each tile the plan can choose from its row of runtime/plan.h kGemmConfigs.
#pragma once
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/mma.cuh"
#include "runtime/plan.h"

namespace fp4moe::cuda_backend {

// One block tile's geometry and stage layout. WEIGHTS_AS_A: the weights are the mma A operand and the tokens B
// (kernel_weights_as_a.cuh); WGMMA: its sm_90a form (wgmma.cuh), stages 1024-byte aligned; WS: warp-specialised
// (kernel_ws_wgmma.cuh), THREADS math threads and a producer warpgroup after them.
// MX: MXFP4 weights, NVFP4's prepared layout with E8M0 scale bytes (format/nvfp4_prepared.h); only the decode differs.
template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int STAGES_, bool FP4_, bool WEIGHTS_AS_A_ = false,
          bool WGMMA_ = false, bool WS_ = false, bool MX_ = false>
struct TileConfig {
  static constexpr int BM = BM_, BN = BN_, BK = 64, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr bool FP4 = FP4_, WEIGHTS_AS_A = WEIGHTS_AS_A_, WGMMA = WGMMA_, WS = WS_, MX = MX_;
  static_assert(!MX || FP4, "MXFP4 is a 4-bit format");
  // plan.h's view (a WS tile's bf16 form: the plan's row names twice the weight rows, gemm_bn)
  static constexpr GemmConfig kPlan{BM, WS && !FP4 ? 2 * BN : BN, BK, WARPS_M, WARPS_N, STAGES, WEIGHTS_AS_A,
                                    WGMMA, WS};
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int PRODUCER_THREADS = WS ? 128 : 0;
  static constexpr int BLOCK_THREADS = THREADS + PRODUCER_THREADS;
  static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;  // warp tile
  static constexpr int MT = WTM / 16, NT = WTN / 8;             // mma tiles per warp
  static constexpr int ROW_GROUPS = WEIGHTS_AS_A ? WTN / 16 : 0;  // weights-as-A: groups of 16 weight rows a warp
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
  static_assert(!WS || (WGMMA && STAGE_BYTES % 1024 == 0), "warp-specialised: a wgmma tile");
};

// The stages' base in the dynamic shared memory: a wgmma tile's is rounded up to 1024 bytes (SMEM_BYTES holds
// the extra kilobyte), the swizzle atom that the token tile's descriptors assume.
template <class C> __device__ __forceinline__ uint8_t* stage_base(uint8_t* smem) {
  if constexpr (!C::WGMMA) return smem;
  else return smem + ((1024u - (dev::smem_addr(smem) & 1023u)) & 1023u);
}

// The tile the plan names `tile` (runtime/plan.h kGemmConfigs, the one table of tile parameters) for one weight
// format. WEIGHTS_AS_A tiles (kernel_weights_as_a.cuh): BM tokens x BN = 16 * RG * WARPS_N weight rows (RG row
// groups of 16 a warp), a stage laid out as the TokensAsA64 tile's (tokens in sA, weights and scales in sB / sSF).
// WGMMA (sm_90a, RG = 1): each warpgroup multiplies its 64 weight rows (register A) by all BM tokens (shared B),
// one wgmma m64nBMk16 a k16 step, into the same fragments as BM / 8 token groups of mma.sync.
// WS (sm_90a): a producer warpgroup and WARPS_N / 4 math warpgroups, each 128 weight rows (64 for bf16 weights) x
// BM tokens.
template <GemmTile tile, bool FP4, bool MX = false, GemmConfig g = kGemmConfigs[static_cast<int>(tile)]>
using TileOf = TileConfig<g.bm, gemm_bn(g, FP4), g.warps_m, g.warps_n, gemm_stages(g, FP4), FP4, g.weights_as_a,
                          g.wgmma, g.ws, MX>;
static_assert(kNumGemmConfigs == 8 && static_cast<int>(GemmTile::SplitKDecode) == 0 &&
                  static_cast<int>(GemmTile::WeightsAsA32) == 1 && static_cast<int>(GemmTile::TokensAsA64) == 2 &&
                  static_cast<int>(GemmTile::Wgmma64) == 3 && static_cast<int>(GemmTile::WeightsAsA16) == 4 &&
                  static_cast<int>(GemmTile::WgmmaWs128) == 5 && static_cast<int>(GemmTile::WgmmaWs64) == 6 &&
                  static_cast<int>(GemmTile::WgmmaWs32) == 7,
              "GemmTile names the rows of kGemmConfigs");
constexpr bool every_tile_steps_64() {
  for (const GemmConfig& c : kGemmConfigs)
    if (c.bk != 64) return false;
  return true;
}
static_assert(every_tile_steps_64(), "TileConfig's K step");

}  // namespace fp4moe::cuda_backend
