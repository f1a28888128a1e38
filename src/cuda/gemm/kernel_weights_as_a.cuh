// The grouped GEMM kernel of the weights-as-A tiles (decode, small and medium batches: SplitKDecode,
// WeightsAsA16, WeightsAsA32, Wgmma64): the weights are the MMA A operand and the tokens B, so a tile of up to BM
// token rows reads each weight byte once, and the block's many narrow column tiles keep many k-block streams in
// flight. Block (x, y, z) = (m tile, n tile, split of K), or (n tile, split, m tile) in one-band grids
// (GemmProblem::m_last); every thread loads its share and computes. Reads top to bottom: schedule, the epilogue's
// lookups beside the first copies, the mainloop chunk by chunk, split-K, the epilogue group by group.
//
// Assumptions (asserted or guaranteed by the plan): N and K are multiples of 16; the weights use the prepared
// layout of kernels.h; a tile has at most BM rows, in groups of 8 tokens.
//
// Bits: out(row m, col n) = sum over k of A[m][k] * W[n][k] follows the canonical K order (k_order.cuh): per chunk
// the same chain of k16 steps with the same 16 products per step, chunk sums added in order; only the operand
// roles differ from the TokensAsA64 tile, and a split tile adds the same chunk sums in the same order. Steps past
// K multiply zero padding.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/gemm/epilogue_weights_as_a.cuh"
#include "cuda/gemm/k_order.cuh"
#include "cuda/gemm/mainloop_mma_sync.cuh"
#include "cuda/gemm/mainloop_wgmma.cuh"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/scheduler.cuh"
#include "cuda/gemm/split_k.cuh"
#include "cuda/pdl.cuh"

namespace fp4moe::cuda_backend {

// Blocks an SM must hold (sets the register cap): as many as the stages' shared memory lets in (1 KB of it
// reserved per block) on sm_90's 228 KB. Other architectures are not capped: their shared memory differs and
// 228 KB's counts made ptxas spill there. The wgmma tile holds BM / 2 accumulator registers a thread (its chunk
// sums in shared memory): two blocks.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
constexpr int kWeightsAsASmemPerSm = 228 * 1024;
#else
constexpr int kWeightsAsASmemPerSm = 0;
#endif
template <class Cfg> constexpr int kWeightsAsAMinBlocks =
    Cfg::WGMMA ? 2 : std::max(1, kWeightsAsASmemPerSm / (Cfg::SMEM_BYTES + 1024));

// GemmProblem::wait_late: only where the LoRA lookup before the mainloop reads no t values (no staged t0).
template <class Cfg, class Epi, class Act> __device__ __forceinline__ bool waits_late(const GemmProblem& g) {
  return !WeightsAsAEpilogue<Cfg, Epi, Act>::kStageT0 && g.wait_late;
}

// One block tile (rows tr, weight rows [nb, nb + BN), k-blocks kr) through the pipeline `pipe` (TilePipeline), then
// its epilogue; a split tile's blocks but the last return without an epilogue.
template <class Cfg, class Epi, class Act, class Pipe>
__device__ __forceinline__ void weights_as_a_tile(const GemmProblem& g, const typename Epi::Params& ep, uint8_t* smem,
                                                  const TileRows& tr, int nb, KRange kr, int64_t tile_lin,
                                                  Pipe& pipe) {
  using Mainloop = std::conditional_t<Cfg::WGMMA, WeightsAsAWgmma<Cfg>, WeightsAsAMmaSync<Cfg>>;
  using Epilogue = WeightsAsAEpilogue<Cfg, Epi, Act>;
  // RG row groups of 16 weight rows per warp: the token fragments, the loads and the loop are shared by RG
  // decode streams (a decode GEMM is bound by the instructions per weight byte).
  constexpr int RG = Cfg::ROW_GROUPS;
  static_assert(Cfg::WEIGHTS_AS_A && Cfg::WARPS_M == 1 && (RG == 1 || RG == 2) && Cfg::BN == 16 * RG * Cfg::WARPS_N &&
                    Cfg::BM % 8 == 0 && (!Cfg::WGMMA || RG == 1),
                "weights-as-A tile");
  constexpr int GROUPS = Cfg::BM / 8;
  constexpr int ACCS = GROUPS * RG;  // accumulator (token group i, row group r) at i * RG + r
  static_assert(Mainloop::ACCS == ACCS && Epilogue::RG == RG, "one fragment layout");
  const int warp = threadIdx.x >> 5;
  const int n0 = nb + warp * 16 * RG;                  // this warp's first weight row
  const int groups = (tr.row_end - tr.row0 + 7) >> 3;  // token groups with rows (uniform)
  const int KB = static_cast<int>(g.B.Kp / Cfg::BK);

  const typename Epilogue::Rows rows = Epilogue::lookup_rows(g, ep, tr, nb);  // while the first stages load

  const SplitK<Cfg, ACCS> split(g, KB, tile_lin);
  Mainloop mainloop;
  float acc[ACCS][4], part[ACCS][4];
  // wgmma: this thread's chunk sums after the stages (gemm_smem_bytes), float4 a of them at [a][thread]: two
  // register sets of them spilled at the wgmma tile's 128 registers.
  float4* chunk_sums = reinterpret_cast<float4*>(smem + Cfg::STAGES * Cfg::STAGE_BYTES) + threadIdx.x;
#pragma unroll
  for (int a = 0; a < ACCS; ++a)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[a][q] = 0.f;

  const int CB = g.chunk_kb;
  for (int kc = kr.begin; kc < kr.end; kc += CB) {  // one K chunk: one chain per output
#pragma unroll
    for (int a = 0; a < ACCS; ++a)
#pragma unroll
      for (int q = 0; q < 4; ++q) part[a][q] = 0.f;
    const int kc_end = min(kc + CB, kr.end);
    mainloop.chunk(part, smem, pipe, kc, kc_end, groups);
    if (g.split > 1) split.store(kc / CB, part);
    else if constexpr (Cfg::WGMMA) add_chunk_shared<Cfg::THREADS>(chunk_sums, part, kc == kr.begin);
    else add_chunk(acc, part, kc == 0);
  }
  pipe.finish();

  if (g.split > 1)
    if (!split.reduce_last(acc)) return;
  if (waits_late<Cfg, Epi, Act>(g)) {  // the epilogue's expand reads the x shrink's t rows (the predecessor's)
    dev::pdl_wait();
    dev::pdl_launch_dependents();
  }
  if constexpr (Cfg::FP4 && !Cfg::WGMMA) unscale_products(acc);  // wgmma: group by group below

  Epilogue epi(ep, tr, n0, rows);
  math_sync<Cfg>();  // the row lookups (block-uniform: every math thread gets here or none)
  if constexpr (Cfg::WGMMA) {
    epi.groups_from_shared(chunk_sums, groups);
  } else {
#pragma unroll
    for (int i = 0; i < GROUPS; ++i) {
      if (i >= groups) break;
      float ga[RG][4];
#pragma unroll
      for (int r = 0; r < RG; ++r)
#pragma unroll
        for (int q = 0; q < 4; ++q) ga[r][q] = acc[i * RG + r][q];
      epi.group(i, ga);
    }
  }
}

template <class Cfg, class Epi, class Act>
__global__ void __launch_bounds__(Cfg::BLOCK_THREADS, kWeightsAsAMinBlocks<Cfg>)
    weights_as_a_gemm_kernel(GemmProblem g, typename Epi::Params ep) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = stage_base<Cfg>(smem_raw);
  if (!waits_late<Cfg, Epi, Act>(g)) {
    dev::pdl_wait();
    dev::pdl_launch_dependents();
  }
  const int KB = static_cast<int>(g.B.Kp / Cfg::BK);
  int m, n, z;
  int64_t tile_lin;
  if (g.m_last) {  // (n tile, split, m tile): launch_grouped's one-band grids
    n = static_cast<int>(blockIdx.x);
    z = static_cast<int>(blockIdx.y);
    m = static_cast<int>(blockIdx.z);
    tile_lin = static_cast<int64_t>(m) * gridDim.x + n;
  } else {
    grid_tile(g.m_band, m, n);
    z = static_cast<int>(blockIdx.z);
    tile_lin = static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y;
  }
  TileRows tr;
  if (!resolve_tile<Cfg::BM>(g, tr, m)) return;
  const KRange kr = k_range(KB, z, g.split, g.chunk_kb);
  const int nb = n * Cfg::BN;
  TilePipeline<Cfg> pipe(smem, g, tr, nb, kr.begin, kr.end - kr.begin);
  weights_as_a_tile<Cfg, Epi, Act>(g, ep, smem, tr, nb, kr, tile_lin, pipe);
}

}  // namespace fp4moe::cuda_backend
