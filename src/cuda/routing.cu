// Routing from logits (SPEC §3.1), one warp per token, mirroring src/reference/routing.cpp: fp32 math,
// the same order of operations for the weights, ties to the lower expert id, NaN ranking last.
// Reductions over E (softmax max/sum) use a fixed butterfly, so results are deterministic; they may
// differ from the serial reference sum in the last bit (docs/numerics.md, "CUDA backend").
#include <cuda_bf16.h>

#include "common/activation.h"
#include "cuda/kernels.h"
#include "cuda/nvfp4_device.cuh"
#include "cuda/pdl.cuh"

namespace fp4moe::cuda_backend {
namespace {

// "a ranks before b" of the reference: higher first, NaN below every number, ties to the lower id.
__device__ __forceinline__ bool ranks_before(float sa, int ia, float sb, int ib) {
  const bool na = isnan(sa), nb = isnan(sb);
  if (na != nb) return nb;
  if (!na && sa != sb) return sa > sb;
  return ia < ib;
}

// Warp-wide best (score, id) by ranks_before; id < 0 means "none". Every lane gets the result.
__device__ __forceinline__ void warp_best(float& s, int& id) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float so = __shfl_xor_sync(0xffffffffu, s, off);
    const int io = __shfl_xor_sync(0xffffffffu, id, off);
    if (io >= 0 && (id < 0 || ranks_before(so, io, s, id))) { s = so; id = io; }
  }
}

constexpr int kMaxPerLane = 4096 / 32;  // plan.h kMaxExpertsRouting
constexpr int kMaskWords = kMaxPerLane / 32;
constexpr int kMaxRegsPerLane = 16;  // E <= 512: each lane keeps its candidates' scores in registers

// Records winner bi of round j in the slot registers (slot j lives on lane j % 32).
__device__ __forceinline__ void record_slot(int j, int bi, int my_id[2]) {
  if ((threadIdx.x & 31) != (j & 31)) return;
  if (j < 32) my_id[0] = bi;  // static indices: my_id stays in registers
  else my_id[1] = bi;
}

// The order of ranks_before over scores as an unsigned key (higher first): NaN ranks below every number
// (key 1), -0 ties with +0, key 0 = no candidate. Equal keys fall back to the lower id, as ranks_before.
__device__ __forceinline__ uint32_t rank_key(float s) {
  if (isnan(s)) return 1u;
  const uint32_t u = __float_as_uint(s == 0.f ? 0.f : s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// E <= 32 * R. Lane l's candidates are experts l + 32 i (i < R), their keys in registers. Each lane keeps its
// best three available candidates in order (C slots; strict comparisons in id order, so the lower id first among
// equal keys); a round is two warp max-reductions (redux.sync: the best key, then the lowest id among the lanes
// that hold it) and the winner's pop. Only when a winner has used up its three does the warp rescan (rare: a lane
// wins a third time). At T = 1 the routing kernel is one warp's instruction chain (ncu, H200: ~8.7 cycles an
// instruction, kimi_k3_tp8 2289 instructions, 952 of them the rescans of a per-round local best).
template <int R>
__device__ __forceinline__ void topk_in_registers(const float* sel, int E, int k, uint32_t excluded, int my_id[2]) {
  constexpr int C = 3;
  const int lane = threadIdx.x & 31;
  uint32_t key[R];  // read-only after this loop (taken candidates leave `avail`): stays in registers
  uint32_t avail = 0;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int e = lane + 32 * i;
    key[i] = e < E ? rank_key(sel[e]) : 0u;
    if (e < E && !((excluded >> i) & 1u)) avail |= 1u << i;
  }
  uint32_t ck[C];  // the cached candidates' keys, best first (0: none)
  int ci[C];       // and their register indices
  int depth = 0;   // cached entries that are still exact (the lane's best `depth` available candidates)
  auto refill = [&] {
#pragma unroll
    for (int c = 0; c < C; ++c) { ck[c] = 0; ci[c] = 0; }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const uint32_t kk = ((avail >> i) & 1u) ? key[i] : 0u;
      const bool g0 = kk > ck[0], g1 = kk > ck[1], g2 = kk > ck[2];
      ck[2] = g1 ? ck[1] : (g2 ? kk : ck[2]);
      ci[2] = g1 ? ci[1] : (g2 ? i : ci[2]);
      ck[1] = g0 ? ck[0] : (g1 ? kk : ck[1]);
      ci[1] = g0 ? ci[0] : (g1 ? i : ci[1]);
      ck[0] = g0 ? kk : ck[0];
      ci[0] = g0 ? i : ci[0];
    }
    depth = min(C, __popc(avail));
  };
  refill();
  for (int j = 0; j < k; ++j) {
    const uint32_t best = __reduce_max_sync(0xffffffffu, ck[0]);
    const uint32_t mine = best != 0 && ck[0] == best ? 0xffffu - static_cast<uint32_t>(lane + 32 * ci[0]) : 0u;
    const uint32_t id = 0xffffu - __reduce_max_sync(0xffffffffu, mine);
    const int bi = best == 0 ? -1 : static_cast<int>(id);
    const bool won = bi >= 0 && (bi & 31) == lane;
    if (won) {
      avail &= ~(1u << ci[0]);
#pragma unroll
      for (int c = 0; c + 1 < C; ++c) { ck[c] = ck[c + 1]; ci[c] = ci[c + 1]; }
      ck[C - 1] = 0;
      --depth;
    }
    if (__any_sync(0xffffffffu, won && depth == 0 && avail != 0)) refill();  // warp-uniform; exact for every lane
    record_slot(j, bi, my_id);
  }
}

// Any E: k sweeps over the scores in shared memory; the owner lane marks the winner taken.
__device__ __forceinline__ void topk_from_shared(const float* sel, int E, int k, uint32_t excluded[kMaskWords],
                                                 int my_id[2]) {
  const int lane = threadIdx.x & 31;
  const int per_lane = (E + 31) / 32;
  for (int j = 0; j < k; ++j) {
    float bs = 0.f;
    int bi = -1;
    for (int i = 0; i < per_lane; ++i) {
      const int e = lane + 32 * i;
      if (e >= E || ((excluded[i >> 5] >> (i & 31)) & 1)) continue;
      if (bi < 0 || ranks_before(sel[e], e, bs, bi)) { bs = sel[e]; bi = e; }
    }
    warp_best(bs, bi);
    if (bi >= 0 && (bi & 31) == lane) {
      const int i = bi >> 5;
      excluded[i >> 5] |= 1u << (i & 31);
    }
    record_slot(j, bi, my_id);
  }
}

__device__ __forceinline__ float read_logit(const RoutingParams& p, int t, int e) {
  const int64_t off = static_cast<int64_t>(t) * p.E + e;
  return p.logits_bf16 ? dev::bf16_to_f32(static_cast<const uint16_t*>(p.logits)[off])
                       : static_cast<const float*>(p.logits)[off];
}

// One token's routing on one warp. R > 0: E <= 32 R, the scores in R registers a lane (a size per E bucket, so
// a small E runs no idle unrolled steps); R = 0: any E, the scores in shared memory only.
template <int R>
__device__ __forceinline__ void route_token(const RoutingParams& p, int t, float* sel, float* gsc) {
  constexpr bool in_regs = R > 0;
  constexpr int RR = in_regs ? R : 1;
  const int lane = threadIdx.x & 31;
  const int E = p.E, k = p.k;
  const auto method = static_cast<RoutingMethod>(p.method);

  // Selection scores. In registers the logits (and the bias) are loaded first, all loads in flight at once: a
  // decode step's routing is one warp's latency, not work.
  const bool with_bias = p.bias && (method == RoutingMethod::DeepSeekV3 || method == RoutingMethod::MiniMax2);
  float l[RR], bias_r[RR];
  float m = -INFINITY;
  if constexpr (in_regs) {
#pragma unroll
    for (int i = 0; i < R; ++i) l[i] = lane + 32 * i < E ? read_logit(p, t, lane + 32 * i) : 0.f;
    if (with_bias) {  // loaded with the logits, not after them (one memory latency less)
#pragma unroll
      for (int i = 0; i < R; ++i) bias_r[i] = lane + 32 * i < E ? p.bias[lane + 32 * i] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (lane + 32 * i < E) {
        sel[lane + 32 * i] = l[i];
        m = fmaxf(m, l[i]);
      }
  } else {
    for (int e = lane; e < E; e += 32) {
      const float v = read_logit(p, t, e);
      sel[e] = v;
      m = fmaxf(m, v);
    }
  }
  float sum = 0.f;
  if (method == RoutingMethod::Default || method == RoutingMethod::RenormalizeNaive) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    for (int e = lane; e < E; e += 32) {
      const float v = expf(sel[e] - m);
      sel[e] = v;
      sum += v;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    for (int e = lane; e < E; e += 32) sel[e] = sel[e] / sum;
  } else if (method == RoutingMethod::Sigmoid || method == RoutingMethod::SigmoidRenorm) {
    for (int e = lane; e < E; e += 32) sel[e] = act::sigmoid(sel[e]);
  } else if (method == RoutingMethod::DeepSeekV3 || method == RoutingMethod::MiniMax2) {
    if constexpr (in_regs) {
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (lane + 32 * i < E) {
          const float s = act::sigmoid(l[i]);
          sel[lane + 32 * i] = with_bias ? s + bias_r[i] : s;
        }
    } else {
      for (int e = lane; e < E; e += 32) {
        const float s = act::sigmoid(sel[e]);
        sel[e] = p.bias ? s + p.bias[e] : s;
      }
    }
  }
  __syncwarp();

  // Candidates: all experts, or those of the best topk_group groups (DeepSeekV3, n_group > 1).
  uint32_t excluded[kMaskWords];  // bit i of word w: expert lane + 32 * (32 w + i) is not a candidate
#pragma unroll
  for (int w = 0; w < kMaskWords; ++w) excluded[w] = 0;
  const int per_lane = (E + 31) / 32;
  if (method == RoutingMethod::DeepSeekV3 && p.n_group > 1) {
    const int G = p.n_group, gs = E / G;
    for (int g = lane; g < G; g += 32) {
      int b0 = -1, b1 = -1;
      for (int e = g * gs; e < (g + 1) * gs; ++e) {
        if (b0 < 0 || ranks_before(sel[e], e, sel[b0], b0)) { b1 = b0; b0 = e; }
        else if (b1 < 0 || ranks_before(sel[e], e, sel[b1], b1)) { b1 = e; }
      }
      gsc[g] = sel[b0] + sel[b1];
    }
    __syncwarp();
    uint64_t kept = 0;
    for (int q = 0; q < p.topk_group; ++q) {
      float bs = 0.f;
      int bi = -1;
      for (int g = lane; g < G; g += 32)
        if (!((kept >> g) & 1) && (bi < 0 || ranks_before(gsc[g], g, bs, bi))) { bs = gsc[g]; bi = g; }
      warp_best(bs, bi);
      kept |= uint64_t(1) << bi;
    }
    if constexpr (in_regs) {  // one mask word, static indices: no local memory
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int e = lane + 32 * i;
        if (e < E && !((kept >> (e / gs)) & 1)) excluded[0] |= 1u << i;
      }
    } else {
      for (int i = 0; i < per_lane; ++i) {
        const int e = lane + 32 * i;
        if (e < E && !((kept >> (e / gs)) & 1)) excluded[i >> 5] |= 1u << (i & 31);
      }
    }
  }

  // Top-k: k rounds of a warp argmax; lane l keeps the ids of slots l and l + 32 (k <= 64) in registers,
  // so the weights below never read them back from memory.
  int my_id[2] = {-1, -1};
  if constexpr (in_regs) topk_in_registers<R>(sel, E, k, excluded[0], my_id);
  else topk_from_shared(sel, E, k, excluded, my_id);
  int* ids = p.ids + static_cast<int64_t>(t) * k;
  float* w = p.weights + static_cast<int64_t>(t) * k;
  // Weights, in parallel over the slots; the sums over slots run in slot order (the reference's order)
  // on every lane through shuffles. v: the value each slot's weight is made from.
  float v[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (lane + 32 * h >= k) continue;
    const int id = my_id[h];
    ids[lane + 32 * h] = id;
    v[h] = (method == RoutingMethod::DeepSeekV3 || method == RoutingMethod::MiniMax2) ? act::sigmoid(read_logit(p, t, id))
                                                                                       : sel[id];
  }
  auto slot_sum = [&](const float x[2]) {  // sum over slots 0, 1, ..., k-1 of x, left to right
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc += __shfl_sync(0xffffffffu, j < 32 ? x[0] : x[1], j & 31);
    return acc;
  };
  float out[2] = {v[0], v[1]};
  const float rsf = p.routed_scaling_factor;
  switch (method) {
    case RoutingMethod::Default:
    case RoutingMethod::TopK:
    case RoutingMethod::Sigmoid:
      break;
    case RoutingMethod::RenormalizeNaive: {
      const float cs = slot_sum(v);
      for (int h = 0; h < 2; ++h) out[h] = v[h] / cs;
      break;
    }
    case RoutingMethod::Renormalize: {  // softmax over the chosen k; the max is slot 0's logit
      const float mx = __shfl_sync(0xffffffffu, v[0], 0);
      for (int h = 0; h < 2; ++h) out[h] = expf(v[h] - mx);
      const float sum = slot_sum(out);
      for (int h = 0; h < 2; ++h) out[h] = out[h] / sum;
      break;
    }
    case RoutingMethod::Llama4:
    case RoutingMethod::TopKSigmoid:
      for (int h = 0; h < 2; ++h) out[h] = act::sigmoid(v[h]);
      break;
    case RoutingMethod::SigmoidRenorm: {
      const float cs = slot_sum(v);
      for (int h = 0; h < 2; ++h) out[h] = v[h] / (cs + 1e-20f);
      break;
    }
    case RoutingMethod::DeepSeekV3:
    case RoutingMethod::MiniMax2: {
      const float cs = slot_sum(v);
      for (int h = 0; h < 2; ++h)
        out[h] = method == RoutingMethod::DeepSeekV3 ? __fdiv_rn(__fmul_rn(v[h], rsf), cs + 1e-20f)
                                                     : __fmul_rn(__fdiv_rn(v[h], cs + 1e-20f), rsf);
      break;
    }
  }
  for (int h = 0; h < 2; ++h)
    if (lane + 32 * h < k) w[lane + 32 * h] = out[h];
}

__global__ void routing_kernel(RoutingParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * (blockDim.x >> 5) + warp;
  if (t >= p.T) return;
  float* sel = smem + warp * (p.E + 64);  // selection score per expert
  float* gsc = sel + p.E;                 // group scores
  const int per_lane = (p.E + 31) / 32;
  if (per_lane <= 4) route_token<4>(p, t, sel, gsc);
  else if (per_lane <= 8) route_token<8>(p, t, sel, gsc);
  else if (per_lane <= 12) route_token<12>(p, t, sel, gsc);
  else if (per_lane <= kMaxRegsPerLane) route_token<kMaxRegsPerLane>(p, t, sel, gsc);
  else route_token<0>(p, t, sel, gsc);
}

}  // namespace

void launch_routing(const RoutingParams& p, int warps_per_block, size_t smem, cudaStream_t stream) {
  if (p.T <= 0) return;
  const int blocks = (p.T + warps_per_block - 1) / warps_per_block;
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(routing_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "cudaFuncSetAttribute(routing_kernel)");
  launch_pdl(routing_kernel, dim3(blocks), dim3(32 * warps_per_block), smem, stream, "routing_kernel", p);
}

}  // namespace fp4moe::cuda_backend
