// The LoRA lookups a tile makes before its mainloop, for its epilogue's expand (lora_expand.cuh).
#pragma once
#include <cstdint>

#include "cuda/gemm/scheduler.cuh"
#include "cuda/lora_expand.cuh"

namespace fp4moe::cuda_backend {

// LoRA before the mainloop (both GEMM kernels): each tile row's LoraRowRef (lora_row_ref: a chain of three dependent
// loads, row -> entry, token -> slot, slot -> table) into rows[BM], by the block's last BM threads (warp 0 issues
// the first stage's token copies). Each such row also asks L2 for its share (BN / BM weight rows) of its slot's B
// rows for output columns [nb, nb + BN): the epilogue's B loads then wait on L2, not HBM (a large layer's adapters
// do not stay in L2 between calls). Rows of one slot together cover all the block's B rows; a tile of mixed slots
// covers part of each. The epilogue must __syncthreads() before reading rows.
// With t0 (not null), the row's first 16 t values as bf16x2 words (t0[i][w] = (t[2w], t[2w + 1]), zero at k >= r)
// go to shared memory too: the first k16 step's t operand without a global load in the epilogue.
template <class Cfg, class Epi, class Act>
__device__ __forceinline__ void lora_lookup_rows(const GemmProblem& g, const typename Epi::Params& ep,
                                                 const TileRows& tr, int nb, dev::LoraRowRef* rows,
                                                 uint32_t (*t0)[8] = nullptr) {
  static_assert(Cfg::THREADS >= Cfg::BM, "one thread a tile row");
  const int i = Cfg::THREADS - 1 - static_cast<int>(threadIdx.x);
  if (i >= Cfg::BM) return;
  dev::LoraRowRef rr;
  if (tr.row0 + i < tr.row_end) rr = dev::lora_row_ref(ep.lora, entry_of(g, tr.row0 + i), ep.token_div);
  rows[i] = rr;
  if (t0) {
#pragma unroll
    for (int w = 0; w < 8; ++w) t0[i][w] = dev::lora_t_pair(rr.t, rr.r, 2 * w);
  }
  if (rr.slot < 0) return;
  constexpr int kRowsEach = (Cfg::BN + Cfg::BM - 1) / Cfg::BM;
  const int N = Epi::cols(ep);
  const uint16_t* B = ep.lora.table[rr.slot].proj[ep.lora.which].B + static_cast<int64_t>(tr.expert) * N * rr.r;
#pragma unroll
  for (int q = 0; q < kRowsEach; ++q) {
    const int j = i * kRowsEach + q, n = nb + j;
    if (j >= Cfg::BN || n >= N) break;
    const uint16_t* row = B + static_cast<int64_t>(Epi::template lora_b_row<Act>(ep, n)) * rr.r;
    dev::prefetch_l2(row);
    dev::prefetch_l2(row + rr.r - 1);
  }
}

}  // namespace fp4moe::cuda_backend
