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
constexpr int kRegsPerLane = 16;  // E <= 512: each lane keeps its candidates' scores in registers

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

// E <= 32 * kRegsPerLane. Each lane keeps its candidates' keys in registers and its best between rounds (only
// the lane that lost it rescans); a round is two warp max-reductions (redux.sync): the best key, then the
// lowest id among the lanes that hold it.
__device__ __forceinline__ void topk_in_registers(const float* sel, int E, int k, uint32_t excluded, int my_id[2]) {
  const int lane = threadIdx.x & 31;
  uint32_t key[kRegsPerLane];  // read-only after this loop (taken candidates leave `avail`): stays in registers
  uint32_t avail = 0;
#pragma unroll
  for (int i = 0; i < kRegsPerLane; ++i) {
    const int e = lane + 32 * i;
    key[i] = e < E ? rank_key(sel[e]) : 0u;
    if (e < E && !((excluded >> i) & 1u)) avail |= 1u << i;
  }
  uint32_t lk = 0;
  int li = 0;
  auto local_best = [&] {
    lk = 0;
    li = 0;
#pragma unroll
    for (int i = 0; i < kRegsPerLane; ++i)
      if (((avail >> i) & 1u) && key[i] > lk) { lk = key[i]; li = i; }  // strict: the lowest id among equals
  };
  local_best();
  for (int j = 0; j < k; ++j) {
    const uint32_t best = __reduce_max_sync(0xffffffffu, lk);
    const uint32_t mine = best != 0 && lk == best ? 0xffffu - static_cast<uint32_t>(lane + 32 * li) : 0u;
    const uint32_t id = 0xffffu - __reduce_max_sync(0xffffffffu, mine);
    const int bi = best == 0 ? -1 : static_cast<int>(id);
    if (bi >= 0 && (bi & 31) == lane) {
      avail &= ~(1u << (bi >> 5));
      local_best();
    }
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

__global__ void routing_kernel(RoutingParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * (blockDim.x >> 5) + warp;
  if (t >= p.T) return;
  const int E = p.E, k = p.k;
  float* sel = smem + warp * (E + 64);  // selection score per expert
  float* gsc = sel + E;                 // group scores
  const auto method = static_cast<RoutingMethod>(p.method);

  // Selection scores. For E <= 32 * kRegsPerLane the logits (and the bias) are loaded into registers first, all
  // loads in flight at once: a decode step's routing is one warp's latency, not work.
  const bool in_regs = E <= 32 * kRegsPerLane;
  const bool with_bias = p.bias && (method == RoutingMethod::DeepSeekV3 || method == RoutingMethod::MiniMax2);
  float bias_r[kRegsPerLane];
  float m = -INFINITY;
  if (in_regs) {
    float l[kRegsPerLane];
#pragma unroll
    for (int i = 0; i < kRegsPerLane; ++i) l[i] = lane + 32 * i < E ? read_logit(p, t, lane + 32 * i) : 0.f;
    if (with_bias) {  // loaded with the logits, not after them (one memory latency less)
#pragma unroll
      for (int i = 0; i < kRegsPerLane; ++i) bias_r[i] = lane + 32 * i < E ? p.bias[lane + 32 * i] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kRegsPerLane; ++i)
      if (lane + 32 * i < E) {
        sel[lane + 32 * i] = l[i];
        m = fmaxf(m, l[i]);
      }
  } else {
    for (int e = lane; e < E; e += 32) {
      const float l = read_logit(p, t, e);
      sel[e] = l;
      m = fmaxf(m, l);
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
    if (in_regs) {
#pragma unroll
      for (int i = 0; i < kRegsPerLane; ++i)
        if (lane + 32 * i < E) {
          const float s = act::sigmoid(sel[lane + 32 * i]);
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
    for (int i = 0; i < per_lane; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !((kept >> (e / gs)) & 1)) excluded[i >> 5] |= 1u << (i & 31);
    }
  }

  // Top-k: k rounds of a warp argmax; lane l keeps the ids of slots l and l + 32 (k <= 64) in registers,
  // so the weights below never read them back from memory.
  int my_id[2] = {-1, -1};
  if (per_lane <= kRegsPerLane) topk_in_registers(sel, E, k, excluded[0], my_id);
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
