// Routing from logits (SPEC §3.1), one warp per token, mirroring src/reference/routing.cpp: fp32 math,
// the same order of operations for the weights, ties to the lower expert id, NaN ranking last.
// Reductions over E (softmax max/sum) use a fixed butterfly, so results are deterministic; they may
// differ from the serial reference sum in the last bit (docs/numerics.md, "CUDA backend").
#include <cuda_bf16.h>

#include "common/activation.h"
#include "cuda/kernels.h"
#include "cuda/nvfp4_device.cuh"

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

__device__ __forceinline__ float read_logit(const RoutingParams& p, int t, int e) {
  const int64_t off = static_cast<int64_t>(t) * p.E + e;
  return p.logits_bf16 ? dev::bf16_to_f32(static_cast<const uint16_t*>(p.logits)[off])
                       : static_cast<const float*>(p.logits)[off];
}

__global__ void routing_kernel(RoutingParams p) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * (blockDim.x >> 5) + warp;
  if (t >= p.T) return;
  const int E = p.E, k = p.k;
  float* sel = smem + warp * (E + 64);  // selection score per expert
  float* gsc = sel + E;                 // group scores
  const auto method = static_cast<RoutingMethod>(p.method);

  // Selection scores.
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    const float l = read_logit(p, t, e);
    sel[e] = l;
    m = fmaxf(m, l);
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
    for (int e = lane; e < E; e += 32) {
      const float s = act::sigmoid(sel[e]);
      sel[e] = p.bias ? s + p.bias[e] : s;
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

  // Top-k: k rounds of a warp argmax; the owner lane marks the winner taken.
  int my_id = -1;  // lane j < k keeps slot j's id
  for (int j = 0; j < k; ++j) {
    float bs = 0.f;
    int bi = -1;
    for (int i = 0; i < per_lane; ++i) {
      const int e = lane + 32 * i;
      if (e >= E || ((excluded[i >> 5] >> (i & 31)) & 1)) continue;
      if (bi < 0 || ranks_before(sel[e], e, bs, bi)) { bs = sel[e]; bi = e; }
    }
    warp_best(bs, bi);
    if ((bi & 31) == lane) {
      const int i = bi >> 5;
      excluded[i >> 5] |= 1u << (i & 31);
    }
    if (lane == (j & 31)) my_id = (j < 32) ? bi : my_id;
    if (j >= 32 && lane == 0) p.ids[static_cast<int64_t>(t) * k + j] = bi;  // k > 32: written directly
  }
  if (lane < k && lane < 32) p.ids[static_cast<int64_t>(t) * k + lane] = my_id;
  __syncwarp();

  // Weights, serially in slot order as the reference does.
  if (lane != 0) return;
  const int32_t* ids = p.ids + static_cast<int64_t>(t) * k;
  float* w = p.weights + static_cast<int64_t>(t) * k;
  const float rsf = p.routed_scaling_factor;
  switch (method) {
    case RoutingMethod::Default:
      for (int j = 0; j < k; ++j) w[j] = sel[ids[j]];
      break;
    case RoutingMethod::RenormalizeNaive: {
      float cs = 0.f;
      for (int j = 0; j < k; ++j) cs += sel[ids[j]];
      for (int j = 0; j < k; ++j) w[j] = sel[ids[j]] / cs;
      break;
    }
    case RoutingMethod::Renormalize: {
      const float mx = sel[ids[0]];
      float s = 0.f;
      for (int j = 0; j < k; ++j) { w[j] = expf(sel[ids[j]] - mx); s += w[j]; }
      for (int j = 0; j < k; ++j) w[j] = w[j] / s;
      break;
    }
    case RoutingMethod::TopK:
      for (int j = 0; j < k; ++j) w[j] = sel[ids[j]];
      break;
    case RoutingMethod::Llama4:
    case RoutingMethod::TopKSigmoid:
      for (int j = 0; j < k; ++j) w[j] = act::sigmoid(sel[ids[j]]);
      break;
    case RoutingMethod::Sigmoid:
      for (int j = 0; j < k; ++j) w[j] = sel[ids[j]];
      break;
    case RoutingMethod::SigmoidRenorm: {
      float cs = 0.f;
      for (int j = 0; j < k; ++j) cs += sel[ids[j]];
      for (int j = 0; j < k; ++j) w[j] = sel[ids[j]] / (cs + 1e-20f);
      break;
    }
    case RoutingMethod::DeepSeekV3:
    case RoutingMethod::MiniMax2: {
      float cs = 0.f;
      for (int j = 0; j < k; ++j) cs += act::sigmoid(read_logit(p, t, ids[j]));
      for (int j = 0; j < k; ++j) {
        const float s = act::sigmoid(read_logit(p, t, ids[j]));
        w[j] = method == RoutingMethod::DeepSeekV3 ? __fdiv_rn(__fmul_rn(s, rsf), cs + 1e-20f)
                                                   : __fmul_rn(__fdiv_rn(s, cs + 1e-20f), rsf);
      }
      break;
    }
  }
}

}  // namespace

void launch_routing(const RoutingParams& p, int warps_per_block, size_t smem, cudaStream_t stream) {
  if (p.T <= 0) return;
  const int blocks = (p.T + warps_per_block - 1) / warps_per_block;
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(routing_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "cudaFuncSetAttribute(routing_kernel)");
  routing_kernel<<<blocks, 32 * warps_per_block, smem, stream>>>(p);
  check_launch("routing_kernel");
}

}  // namespace fp4moe::cuda_backend
