// The per-output arithmetic of the two GEMMs' epilogues, shared by every tile: GEMM1 (scales, bias, delta, LoRA
// delta, activation, bf16 a and the bridge act_out) and GEMM2 (scale, bias, LoRA delta, fp32 o per entry).
#pragma once
#include <cstdint>
#include <type_traits>

#include "common/activation.h"
#include "cuda/gemm/scheduler.cuh"
#include "cuda/nvfp4_device.cuh"

namespace fp4moe::cuda_backend {

template <class A> constexpr bool kGatedAct =
    !(std::is_same_v<A, act::Gelu> || std::is_same_v<A, act::Relu> || std::is_same_v<A, act::Silu> ||
      std::is_same_v<A, act::Relu2> || std::is_same_v<A, act::Identity>);

// The epilogues work on pairs of adjacent outputs (col even, col + 1) of one row, so that every kernel
// (epilogue_tokens_as_a.cuh, epilogue_weights_as_a.cuh) shares one arithmetic per output:
// expert_ctx once per tile, row_ctx once per row, col_pre once per column pair (a tile's threads keep their columns
// from row to row), pair per two columns (raw fp32 accumulators and the bf16-rounded LoRA deltas of
// lora_expand.cuh in, +0 deltas without LoRA). cols(p) is the output width
// and lora_b_row(p, n) the row of the adapter's B that feeds output column n (prepared order -> B's order).
// A pair's column constants: whether col < N, and the bias of expert e at col and col + 1 (+0 without: the delta
// added after it turns -0 into +0 anyway). Tiles whose threads keep their columns make them once a tile.
struct EpilogueColPre {
  float b0, b1;
  bool in;
};
__device__ __forceinline__ EpilogueColPre epilogue_col_pre(const float* bias, int e, int N, int col) {
  EpilogueColPre c{0.f, 0.f, col < N};
  if (bias && c.in) {
    c.b0 = bias[static_cast<int64_t>(e) * N + col];
    c.b1 = bias[static_cast<int64_t>(e) * N + col + 1];
  }
  return c;
}

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
  // kernel may load them before its mainloop (kernel_weights_as_a.cuh).
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
  using ColPre = EpilogueColPre;
  __device__ __forceinline__ static ColPre col_pre(const Params& p, const ExpertCtx& x, int col) {
    return epilogue_col_pre(p.bias, x.e, p.N1, col);
  }
  // A gated activation's a at column col / 2 (col even, < N1: the pair gate | up in the prepared order), in
  // float before its bf16 rounding.
  template <class Act>
  __device__ __forceinline__ static float gated_value(const Params& p, const ExpertCtx& x, const RowCtx& rc,
                                                      const ColPre& cp, int col, float c0, float c1, float l0,
                                                      float l1) {
    const int j = col >> 1;
    float h0, h1;
    pre_act(p, rc, cp, p.gate_first ? j : p.I + j, p.gate_first ? p.I + j : j, c0, c1, l0, l1, h0, h1);
    return Act::apply(h0, h1, x.prm);
  }
  // A pair's activation inputs: scaled sums, bias, the bridge delta (its row's columns d0, d1), the LoRA delta
  // (always added: +0 for base rows), in that order.
  __device__ __forceinline__ static void pre_act(const Params& p, const RowCtx& rc, const ColPre& cp, int d0, int d1,
                                                 float c0, float c1, float l0, float l1, float& h0, float& h1) {
    h0 = __fadd_rn(__fmul_rn(c0, rc.a_even), cp.b0);
    h1 = __fadd_rn(__fmul_rn(c1, rc.a_odd), cp.b1);
    float e0 = 0.f, e1 = 0.f;
    if (p.delta) {
      const uint16_t* d = p.delta + static_cast<int64_t>(rc.entry) * p.N1;
      e0 = dev::bf16_to_f32(d[d0]);
      e1 = dev::bf16_to_f32(d[d1]);
    }
    h0 = __fadd_rn(h0, e0);
    h1 = __fadd_rn(h1, e1);
    h0 = __fadd_rn(h0, l0);
    h1 = __fadd_rn(h1, l1);
  }
  // Stores a gated a at column j: out (GEMM2's input: a, or its NVFP4 values when GEMM1 quantizes) and the bridge
  // act_out (a).
  __device__ __forceinline__ static void store_gated(const Params& p, const RowCtx& rc, int j, uint16_t out,
                                                     uint16_t a) {
    p.out[static_cast<int64_t>(rc.r) * p.I + j] = out;
    if (p.act_out) p.act_out[static_cast<int64_t>(rc.entry) * p.I + j] = a;
  }
  // A non-gated activation's a at columns col, col + 1 (bf16, the even one in the low half).
  template <class Act>
  __device__ __forceinline__ static uint32_t plain_pair(const Params& p, const ExpertCtx& x, const RowCtx& rc,
                                                        const ColPre& cp, int col, float c0, float c1, float l0,
                                                        float l1) {
    float h0, h1;
    pre_act(p, rc, cp, col, col + 1, c0, c1, l0, l1, h0, h1);
    return dev::pack_bf16x2(Act::apply(h0, 0.f, x.prm), Act::apply(h1, 0.f, x.prm));
  }
  __device__ __forceinline__ static void store_act_out(const Params& p, const RowCtx& rc, int j, uint32_t a) {
    if (p.act_out) {  // the caller's tensor may be only 2-byte aligned
      p.act_out[static_cast<int64_t>(rc.entry) * p.I + j] = static_cast<uint16_t>(a & 0xffffu);
      p.act_out[static_cast<int64_t>(rc.entry) * p.I + j + 1] = static_cast<uint16_t>(a >> 16);
    }
  }
  template <class Act>
  __device__ __forceinline__ static void pair(const Params& p, const ExpertCtx& x, const RowCtx& rc, const ColPre& cp,
                                              int col, float c0, float c1, float l0, float l1) {
    if (!cp.in) return;
    if constexpr (kGatedAct<Act>) {
      const uint16_t a = dev::f32_to_bf16(gated_value<Act>(p, x, rc, cp, col, c0, c1, l0, l1));
      store_gated(p, rc, col >> 1, a, a);
    } else {
      const uint32_t a = plain_pair<Act>(p, x, rc, cp, col, c0, c1, l0, l1);
      *reinterpret_cast<uint32_t*>(p.out + static_cast<int64_t>(rc.r) * p.I + col) = a;
      store_act_out(p, rc, col, a);
    }
  }
  // Four adjacent columns col ... col + 3 (col % 4 == 0; N1 % 4 == 0, so a quad is wholly in range or out) without
  // LoRA deltas, cp the column constants of its two pairs: the pair arithmetic, one store of a.
  template <class Act>
  __device__ __forceinline__ static void quad(const Params& p, const ExpertCtx& x, const RowCtx& rc,
                                              const ColPre (&cp)[2], int col, const float (&c)[4]) {
    if (!cp[0].in) return;
    if constexpr (kGatedAct<Act>) {
      const uint32_t a = dev::pack_bf16x2(gated_value<Act>(p, x, rc, cp[0], col, c[0], c[1], 0.f, 0.f),
                                          gated_value<Act>(p, x, rc, cp[1], col + 2, c[2], c[3], 0.f, 0.f));
      *reinterpret_cast<uint32_t*>(p.out + static_cast<int64_t>(rc.r) * p.I + (col >> 1)) = a;  // col / 2 even
      store_act_out(p, rc, col >> 1, a);
    } else {
      const uint32_t a0 = plain_pair<Act>(p, x, rc, cp[0], col, c[0], c[1], 0.f, 0.f);
      const uint32_t a1 = plain_pair<Act>(p, x, rc, cp[1], col + 2, c[2], c[3], 0.f, 0.f);
      *reinterpret_cast<uint2*>(p.out + static_cast<int64_t>(rc.r) * p.I + col) = make_uint2(a0, a1);
      store_act_out(p, rc, col, a0);
      store_act_out(p, rc, col + 2, a1);
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
  using ColPre = EpilogueColPre;
  __device__ __forceinline__ static ColPre col_pre(const Params& p, const ExpertCtx& x, int col) {
    return epilogue_col_pre(p.bias, x.e, p.H, col);
  }
  template <class Act>
  __device__ __forceinline__ static void pair(const Params& p, const ExpertCtx& x, const RowCtx& rc, const ColPre& cp,
                                              int col, float c0, float c1, float l0, float l1) {
    if (!cp.in) return;
    *reinterpret_cast<float2*>(rc.orow + col) = make_float2(value(x, c0, cp.b0, l0), value(x, c1, cp.b1, l1));
  }
  // One output: the scaled sum, the bias, then the down LoRA delta, always added (+0 for base rows, which turns -0
  // into +0 as the reference).
  __device__ __forceinline__ static float value(const ExpertCtx& x, float c, float b, float l) {
    return __fadd_rn(__fadd_rn(__fmul_rn(c, x.s), b), l);
  }
  // Four adjacent columns (col % 4 == 0, H % 4 == 0) without LoRA deltas: one 16-byte store.
  template <class Act>
  __device__ __forceinline__ static void quad(const Params&, const ExpertCtx& x, const RowCtx& rc,
                                              const ColPre (&cp)[2], int col, const float (&c)[4]) {
    if (!cp[0].in) return;
    *reinterpret_cast<float4*>(rc.orow + col) = make_float4(value(x, c[0], cp[0].b0, 0.f), value(x, c[1], cp[0].b1, 0.f),
                                                            value(x, c[2], cp[1].b0, 0.f), value(x, c[3], cp[1].b1, 0.f));
  }
};

}  // namespace fp4moe::cuda_backend
