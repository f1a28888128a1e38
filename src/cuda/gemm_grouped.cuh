// The grouped GEMM kernel: scheduling (which expert and rows a block computes) and the epilogues of
// GEMM1 (scales, bias, delta, activation, bf16) and GEMM2 (scale, bias, fp32 o per entry).
#pragma once
#include <type_traits>

#include "common/activation.h"
#include "common/tile_order.h"
#include "cuda/gemm_mainloop.cuh"
#include "cuda/lora_expand.cuh"
#include "cuda/pdl.cuh"

namespace fp4moe::cuda_backend {

template <class A> constexpr bool kGatedAct =
    !(std::is_same_v<A, act::Gelu> || std::is_same_v<A, act::Relu> || std::is_same_v<A, act::Silu> ||
      std::is_same_v<A, act::Relu2> || std::is_same_v<A, act::Identity>);

// Tile -> (expert, rows). Routed: tile_info from the permutation; dense (shared expert): consecutive rows.
struct TileRows {
  int expert, row0, row_end;
};
template <int BM> __device__ __forceinline__ bool resolve_tile(const GemmProblem& g, TileRows& tr, int tile) {
  if (g.tile_info) {
    if (tile >= g.tile_info[2 * g.max_tiles]) return false;  // fewer tiles than the plan's bound
    tr.expert = g.tile_info[2 * tile];
    tr.row0 = g.tile_info[2 * tile + 1];
    tr.row_end = min(tr.row0 + BM, g.expert_offsets[tr.expert + 1]);
  } else {
    tr.expert = 0;
    tr.row0 = tile * BM;
    if (tr.row0 >= g.dense_rows) return false;
    tr.row_end = min(tr.row0 + BM, g.dense_rows);
  }
  return true;
}

// The (m, n) tile of this block of a grid (m tiles, n tiles[, splits]).
__device__ __forceinline__ void grid_tile(int band, int& m, int& n) {
  if (band <= 0) {
    m = static_cast<int>(blockIdx.x);
    n = static_cast<int>(blockIdx.y);
  } else {
    tile_of(static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x), static_cast<int>(gridDim.x),
            static_cast<int>(gridDim.y), band, m, n);
  }
}

// The epilogues work on pairs of adjacent outputs (col even, col + 1) of one row, so that every kernel
// (the mma.sync tile below, the weights-as-A tile of gemm_skinny.cuh) shares one arithmetic per output:
// expert_ctx once per tile, row_ctx once per row, pair per two columns (raw fp32 accumulators and the
// bf16-rounded LoRA deltas of lora_expand.cuh in, +0 deltas without LoRA). cols(p) is the output width
// and lora_b_row(p, n) the row of the adapter's B that feeds output column n (prepared order -> B's order).
struct Epilogue1 {
  using Params = Epilogue1Params;
  struct ExpertCtx {
    act::Params prm;
    float s_even, s_odd;
    int e;
  };
  struct RowCtx {
    int r, entry;
    float a_even, a_odd;
  };
  __device__ __forceinline__ static int cols(const Params& p) { return p.N1; }
  // Prepared W1 row n of a gated activation is gate row n/2 (even n) or up row n/2 (odd n); B1 keeps the
  // weights' half order.
  template <class Act> __device__ __forceinline__ static int lora_b_row(const Params& p, int n) {
    if constexpr (!kGatedAct<Act>) return n;
    const int j = n >> 1;
    return ((n & 1) == 0) == p.gate_first ? j : p.I + j;
  }
  template <class Act> __device__ __forceinline__ static ExpertCtx expert_ctx(const Params& p, int e) {
    ExpertCtx x;
    x.e = e;
    x.prm = p.defaults;
    if (p.alpha) x.prm.alpha = p.alpha[e];
    if (p.beta) x.prm.beta = p.beta[e];
    if (p.limit) { x.prm.limit = p.limit[e]; x.prm.has_limit = isfinite(x.prm.limit); }
    x.s_even = p.s_even[e];
    x.s_odd = kGatedAct<Act> ? p.s_odd[e] : x.s_even;
    return x;
  }
  // A row's loads (row_pre: its entry and token scale, a chain of two) apart from its arithmetic (row_ctx), so that a
  // kernel may load them before its mainloop (gemm_skinny.cuh).
  struct RowPre {
    int entry;
    float rs;
  };
  __device__ __forceinline__ static RowPre row_pre(const Params& p, const GemmProblem& g, int r) {
    const int entry = entry_of(g, r);
    return RowPre{entry, p.row_scale ? p.row_scale[entry / p.token_div] : 1.f};
  }
  __device__ __forceinline__ static RowCtx row_ctx(const Params&, const ExpertCtx& x, int r, const RowPre& pre) {
    RowCtx rc;
    rc.r = r;
    rc.entry = pre.entry;
    rc.a_even = __fmul_rn(x.s_even, pre.rs);
    rc.a_odd = __fmul_rn(x.s_odd, pre.rs);
    return rc;
  }
  __device__ __forceinline__ static RowCtx row_ctx(const Params& p, const GemmProblem& g, const ExpertCtx& x, int r) {
    return row_ctx(p, x, r, row_pre(p, g, r));
  }
  // A gated activation's a at column col / 2 (col even, < N1: the pair gate | up in the prepared order), in
  // float before its bf16 rounding.
  template <class Act>
  __device__ __forceinline__ static float gated_value(const Params& p, const ExpertCtx& x, const RowCtx& rc, int col,
                                                      float c0, float c1, float l0, float l1) {
    float h0 = __fmul_rn(c0, rc.a_even);
    float h1 = __fmul_rn(c1, rc.a_odd);
    if (p.bias) {
      h0 = __fadd_rn(h0, p.bias[static_cast<int64_t>(x.e) * p.N1 + col]);
      h1 = __fadd_rn(h1, p.bias[static_cast<int64_t>(x.e) * p.N1 + col + 1]);
    }
    const int j = col >> 1;
    float dg = 0.f, du = 0.f;
    if (p.delta) {
      const uint16_t* d = p.delta + static_cast<int64_t>(rc.entry) * p.N1;
      dg = dev::bf16_to_f32(d[p.gate_first ? j : p.I + j]);
      du = dev::bf16_to_f32(d[p.gate_first ? p.I + j : j]);
    }
    h0 = __fadd_rn(h0, dg);
    h1 = __fadd_rn(h1, du);
    // The LoRA delta, always added (+0 for base rows).
    h0 = __fadd_rn(h0, l0);
    h1 = __fadd_rn(h1, l1);
    return Act::apply(h0, h1, x.prm);
  }
  // Stores a gated a at column j: out (GEMM2's input: a, or its NVFP4 values when GEMM1 quantizes) and the bridge
  // act_out (a).
  __device__ __forceinline__ static void store_gated(const Params& p, const RowCtx& rc, int j, uint16_t out,
                                                     uint16_t a) {
    p.out[static_cast<int64_t>(rc.r) * p.I + j] = out;
    if (p.act_out) p.act_out[static_cast<int64_t>(rc.entry) * p.I + j] = a;
  }
  template <class Act>
  __device__ __forceinline__ static void pair(const Params& p, const ExpertCtx& x, const RowCtx& rc, int col, float c0,
                                              float c1, float l0, float l1) {
    if (col >= p.N1) return;
    const int e = x.e, r = rc.r, entry = rc.entry;
    if constexpr (kGatedAct<Act>) {
      const uint16_t a = dev::f32_to_bf16(gated_value<Act>(p, x, rc, col, c0, c1, l0, l1));
      store_gated(p, rc, col >> 1, a, a);
    } else {
      float h0 = __fmul_rn(c0, rc.a_even);
      float h1 = __fmul_rn(c1, rc.a_odd);
      if (p.bias) {
        h0 = __fadd_rn(h0, p.bias[static_cast<int64_t>(e) * p.N1 + col]);
        h1 = __fadd_rn(h1, p.bias[static_cast<int64_t>(e) * p.N1 + col + 1]);
      }
      float d0 = 0.f, d1 = 0.f;
      if (p.delta) {
        const uint16_t* d = p.delta + static_cast<int64_t>(entry) * p.N1;
        d0 = dev::bf16_to_f32(d[col]);
        d1 = dev::bf16_to_f32(d[col + 1]);
      }
      h0 = __fadd_rn(h0, d0);
      h1 = __fadd_rn(h1, d1);
      h0 = __fadd_rn(h0, l0);
      h1 = __fadd_rn(h1, l1);
      const uint32_t a = static_cast<uint32_t>(dev::f32_to_bf16(Act::apply(h0, 0.f, x.prm))) |
                         (static_cast<uint32_t>(dev::f32_to_bf16(Act::apply(h1, 0.f, x.prm))) << 16);
      *reinterpret_cast<uint32_t*>(p.out + static_cast<int64_t>(r) * p.I + col) = a;
      if (p.act_out) {  // the caller's tensor may be only 2-byte aligned
        p.act_out[static_cast<int64_t>(entry) * p.I + col] = static_cast<uint16_t>(a & 0xffffu);
        p.act_out[static_cast<int64_t>(entry) * p.I + col + 1] = static_cast<uint16_t>(a >> 16);
      }
    }
  }
};

struct Epilogue2 {
  using Params = Epilogue2Params;
  struct ExpertCtx {
    float s;
    int e;
  };
  struct RowCtx {
    float* orow;
  };
  __device__ __forceinline__ static int cols(const Params& p) { return p.H; }
  template <class Act> __device__ __forceinline__ static int lora_b_row(const Params&, int n) { return n; }
  template <class Act> __device__ __forceinline__ static ExpertCtx expert_ctx(const Params& p, int e) {
    return ExpertCtx{__fmul_rn(p.s2[e], p.in_scale), e};
  }
  struct RowPre {
    int entry;
  };
  __device__ __forceinline__ static RowPre row_pre(const Params&, const GemmProblem& g, int r) {
    return RowPre{entry_of(g, r)};
  }
  __device__ __forceinline__ static RowCtx row_ctx(const Params& p, const ExpertCtx&, int, const RowPre& pre) {
    return RowCtx{p.out + static_cast<int64_t>(pre.entry) * p.H};
  }
  __device__ __forceinline__ static RowCtx row_ctx(const Params& p, const GemmProblem& g, const ExpertCtx& x, int r) {
    return row_ctx(p, x, r, row_pre(p, g, r));
  }
  template <class Act>
  __device__ __forceinline__ static void pair(const Params& p, const ExpertCtx& x, const RowCtx& rc, int col, float c0,
                                              float c1, float l0, float l1) {
    if (col >= p.H) return;
    float o0 = __fmul_rn(c0, x.s);
    float o1 = __fmul_rn(c1, x.s);
    if (p.bias) {
      o0 = __fadd_rn(o0, p.bias[static_cast<int64_t>(x.e) * p.H + col]);
      o1 = __fadd_rn(o1, p.bias[static_cast<int64_t>(x.e) * p.H + col + 1]);
    }
    // The down LoRA delta, always added (+0 for base rows, which turns -0 into +0 as the reference).
    *reinterpret_cast<float2*>(rc.orow + col) = make_float2(__fadd_rn(o0, l0), __fadd_rn(o1, l1));
  }
};

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

// The epilogue of one mma.sync block tile: thread (lane) holds acc[mt][nt][2*half + {0,1}] = output
// (row wm*WTM + mt*16 + lane/4 + 8*half, columns wn*WTN + nt*8 + 2*(lane%4) + {0,1}). The LoRA delta of each
// m16n8 fragment has the same layout: tokens' t rows as the A operand, B_e rows (one per column) as B.
template <class Cfg, class Epi, class Act>
__device__ __forceinline__ void tile_epilogue(const typename Epi::Params& p, const GemmProblem& g,
                                              const MainLoop<Cfg>& ml, const TileRows& tr, int n0,
                                              const dev::LoraRowRef* lora_rows, const uint32_t (*lora_t0)[8]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
  const int wm = warp / Cfg::WARPS_N, wn = warp % Cfg::WARPS_N;
  const int N = Epi::cols(p);
  const auto x = Epi::template expert_ctx<Act>(p, tr.expert);
  if (p.lora.table) __syncthreads();  // lora_rows (block-uniform)
#pragma unroll
  for (int mt = 0; mt < Cfg::MT; ++mt) {
    typename Epi::RowCtx rc[2];
    dev::LoraRowRef rr[2];
    int lr[2] = {0, 0};  // the rows' indices in the tile (lora_rows, lora_t0)
    bool valid[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = tr.row0 + wm * Cfg::WTM + mt * 16 + gq + half * 8;
      valid[half] = r < tr.row_end;
      if (!valid[half]) continue;
      rc[half] = Epi::row_ctx(p, g, x, r);
      lr[half] = r - tr.row0;
      if (p.lora.table) rr[half] = lora_rows[lr[half]];
    }
    // The LoRA deltas of the warp's 16 x WTN outputs of this mt: one pass per adapter present in the 16 rows.
    float dl[Cfg::NT][4];
#pragma unroll
    for (int nt = 0; nt < Cfg::NT; ++nt) dl[nt][0] = dl[nt][1] = dl[nt][2] = dl[nt][3] = 0.f;
    if (p.lora.table) {
      const int keys[2] = {rr[0].slot, rr[1].slot};
      dev::for_each_slot(keys, [&](int s) {
        const LoraProj& pj = p.lora.table[s].proj[p.lora.which];
        const int rk = pj.r;
        const uint16_t* B = pj.B + static_cast<int64_t>(tr.expert) * N * rk;
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; ++nt) {
          const int n = n0 + wn * Cfg::WTN + nt * 8 + gq;  // this lane's B column
          const uint16_t* brow = n < N ? B + static_cast<int64_t>(Epi::template lora_b_row<Act>(p, n)) * rk : nullptr;
          float d[4];
          dev::lora_mma(
              d, rk,
              [&](int k0, uint32_t a[4]) {
                if (k0 == 0) {  // staged by lora_lookup_rows (by each row's own rank: other rows are discarded)
                  a[0] = lora_t0[lr[0]][t];
                  a[1] = lora_t0[lr[1]][t];
                  a[2] = lora_t0[lr[0]][t + 4];
                  a[3] = lora_t0[lr[1]][t + 4];
                  return;
                }
                // A row of another slot reads nothing past its own t row (its result is discarded anyway).
                const int k_0 = rr[0].slot == s ? rk : 0, k_1 = rr[1].slot == s ? rk : 0;
                a[0] = dev::lora_t_pair(rr[0].t, k_0, k0 + 2 * t);
                a[1] = dev::lora_t_pair(rr[1].t, k_1, k0 + 2 * t);
                a[2] = dev::lora_t_pair(rr[0].t, k_0, k0 + 2 * t + 8);
                a[3] = dev::lora_t_pair(rr[1].t, k_1, k0 + 2 * t + 8);
              },
              [&](int k0, uint32_t b[2]) {
                b[0] = dev::lora_b_pair(brow, rk, k0 + 2 * t);
                b[1] = dev::lora_b_pair(brow, rk, k0 + 2 * t + 8);
              });
          if (rr[0].slot == s) { dl[nt][0] = dev::round_to_bf16(d[0]); dl[nt][1] = dev::round_to_bf16(d[1]); }
          if (rr[1].slot == s) { dl[nt][2] = dev::round_to_bf16(d[2]); dl[nt][3] = dev::round_to_bf16(d[3]); }
        }
      });
    }
#pragma unroll
    for (int nt = 0; nt < Cfg::NT; ++nt) {
      const int col = n0 + wn * Cfg::WTN + nt * 8 + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half)
        if (valid[half])
          Epi::template pair<Act>(p, x, rc[half], col, ml.acc[mt][nt][2 * half], ml.acc[mt][nt][2 * half + 1],
                                  dl[nt][2 * half], dl[nt][2 * half + 1]);
    }
  }
}

template <class Cfg, class Epi, class Act>
__global__ void __launch_bounds__(Cfg::THREADS) grouped_gemm_kernel(GemmProblem g, typename Epi::Params ep) {
  extern __shared__ __align__(128) uint8_t smem[];
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  int m, n;
  grid_tile(g.m_band, m, n);
  TileRows tr;
  if (!resolve_tile<Cfg::BM>(g, tr, m)) return;
  const int n0 = n * Cfg::BN;

  TileLoader<Cfg> ld(g, tr, n0, 0);
  __shared__ dev::LoraRowRef s_lora_rows[Cfg::BM];
  __shared__ uint32_t s_lora_t0[Cfg::BM][8];
  MainLoop<Cfg> ml;
  ml.run(smem, ld, static_cast<int>(g.B.Kp / Cfg::BK), [&] {
    if (ep.lora.table) lora_lookup_rows<Cfg, Epi, Act>(g, ep, tr, n0, s_lora_rows, s_lora_t0);
  });
  tile_epilogue<Cfg, Epi, Act>(ep, g, ml, tr, n0, s_lora_rows, s_lora_t0);
}

}  // namespace fp4moe::cuda_backend
