// Routing from logits (SPEC §3.1), one warp per token, mirroring src/reference/routing.cpp: fp32 math,
// the same order of operations for the weights, ties to the lower expert id, NaN ranking last.
// Reductions over E (softmax max/sum) use a fixed butterfly, so results are deterministic; they may
// differ from the serial reference sum in the last bit (docs/numerics.md, "CUDA backend").
#include <cuda_bf16.h>

#include "common/activation.h"
#include "cuda/kernels.h"
#include "cuda/mma.cuh"
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

// Top-k over keys[e] (0: not a candidate; taken candidates are set to 0). Lane l's candidates are experts
// l + 32 i; it keeps its best three in order (strict comparisons in id order: the lower id first among equal
// keys). A round is two warp max-reductions (redux.sync: the best key, then the lowest id among the lanes that
// hold it) and the winner's pop; the warp rescans its keys only when a winner has used up its three (rare).
__device__ __forceinline__ void topk_cached(uint32_t* keys, int E, int k, int my_id[2]) {
  constexpr int C = 3;
  const int lane = threadIdx.x & 31;
  uint32_t ck[C];  // the cached candidates' keys, best first (0: none)
  int ce[C];       // and their experts
  int left = 0;    // candidates of this lane not taken yet
  auto rescan = [&] {
#pragma unroll
    for (int c = 0; c < C; ++c) { ck[c] = 0; ce[c] = 0; }
    left = 0;
#pragma unroll 1
    for (int e = lane; e < E; e += 32) {
      const uint32_t kk = keys[e];
      left += kk != 0;
      const bool g0 = kk > ck[0], g1 = kk > ck[1], g2 = kk > ck[2];
      ck[2] = g1 ? ck[1] : (g2 ? kk : ck[2]);
      ce[2] = g1 ? ce[1] : (g2 ? e : ce[2]);
      ck[1] = g0 ? ck[0] : (g1 ? kk : ck[1]);
      ce[1] = g0 ? ce[0] : (g1 ? e : ce[1]);
      ck[0] = g0 ? kk : ck[0];
      ce[0] = g0 ? e : ce[0];
    }
  };
  rescan();
  int cached = min(C, left);  // exact cache entries (this lane's best `cached` candidates)
#pragma unroll 1
  for (int j = 0; j < k; ++j) {
    const uint32_t best = __reduce_max_sync(0xffffffffu, ck[0]);
    const uint32_t mine = best != 0 && ck[0] == best ? 0xffffu - static_cast<uint32_t>(ce[0]) : 0u;
    const uint32_t id = 0xffffu - __reduce_max_sync(0xffffffffu, mine);
    const int bi = best == 0 ? -1 : static_cast<int>(id);
    const bool won = bi >= 0 && (bi & 31) == lane;
    if (won) {
      keys[bi] = 0u;
#pragma unroll
      for (int c = 0; c + 1 < C; ++c) { ck[c] = ck[c + 1]; ce[c] = ce[c + 1]; }
      ck[C - 1] = 0;
      --cached;
      --left;
    }
    if (__any_sync(0xffffffffu, won && cached == 0 && left > 0)) {  // warp-uniform; exact for every lane
      __syncwarp();
      rescan();
      cached = min(C, left);
    }
    record_slot(j, bi, my_id);
  }
}

__device__ __forceinline__ float read_logit(const RoutingParams& p, int t, int e) {
  const int64_t off = static_cast<int64_t>(t) * p.E + e;
  return p.logits_bf16 ? dev::bf16_to_f32(static_cast<const uint16_t*>(p.logits)[off])
                       : static_cast<const float*>(p.logits)[off];
}

// One token's routing on one warp: sel[E] (scores), keys[E] (the bias first, then the top-k keys), gsc[64] (group
// scores), all in this warp's shared memory. Written as rolled loops over shared memory on purpose: at T = 1 this
// kernel is a single warp whose time follows the code it runs through, not its instruction count (ncu, H200,
// kimi_k3_tp8: "no instruction" stalls ~64 % of the cycles; the fully unrolled register version with fewer
// instructions but more code ran 12 -> 17 us).
// M: the routing method, a template argument so that each method's kernel holds only its own code (a T = 1 call is
// one warp fetching its instructions cold: the branches of the other methods were code it jumped over).
template <RoutingMethod M>
__device__ __forceinline__ void route_token(const RoutingParams& p, int t, float* sel, uint32_t* keys, float* gsc) {
  const int lane = threadIdx.x & 31;
  const int E = p.E, k = p.k;
  constexpr RoutingMethod method = M;
  const bool with_bias = p.bias && (method == RoutingMethod::DeepSeekV3 || method == RoutingMethod::MiniMax2);
  float* bias = reinterpret_cast<float*>(keys);

  // Logits (and the bias) into shared memory, every load in flight at once (cp.async: no register waits on it).
  if (!p.logits_bf16) {
    const float* row = static_cast<const float*>(p.logits) + static_cast<int64_t>(t) * E;
#pragma unroll 1
    for (int e = lane; e < E; e += 32) dev::cp_async4(dev::smem_addr(sel + e), row + e);
  }
  if (with_bias) {
#pragma unroll 1
    for (int e = lane; e < E; e += 32) dev::cp_async4(dev::smem_addr(bias + e), p.bias + e);
  }
  dev::cp_async_commit();
  if (p.logits_bf16) {
    const uint16_t* row = static_cast<const uint16_t*>(p.logits) + static_cast<int64_t>(t) * E;
#pragma unroll 4
    for (int e = lane; e < E; e += 32) sel[e] = dev::bf16_to_f32(row[e]);
  }
  dev::cp_async_wait<0>();
  __syncwarp();

  if (method == RoutingMethod::Default || method == RoutingMethod::RenormalizeNaive) {
    float m = -INFINITY;
#pragma unroll 1
    for (int e = lane; e < E; e += 32) m = fmaxf(m, sel[e]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float sum = 0.f;
#pragma unroll 1
    for (int e = lane; e < E; e += 32) {
      const float v = expf(sel[e] - m);
      sel[e] = v;
      sum += v;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
#pragma unroll 1
    for (int e = lane; e < E; e += 32) sel[e] = sel[e] / sum;
  } else if (method == RoutingMethod::Sigmoid || method == RoutingMethod::SigmoidRenorm) {
#pragma unroll 1
    for (int e = lane; e < E; e += 32) sel[e] = act::sigmoid(sel[e]);
  } else if (method == RoutingMethod::DeepSeekV3 || method == RoutingMethod::MiniMax2) {
    bool bad = false;  // the bias lives on the device only: tested in the loop that adds it (no second pass over E)
#pragma unroll 1
    for (int e = lane; e < E; e += 32) {
      const float s = act::sigmoid(sel[e]);
      if (with_bias) bad |= !isfinite(bias[e]);
      sel[e] = with_bias ? s + bias[e] : s;
    }
    // the first token of the launch flags it (the selection stays in range)
    if (with_bias && t == 0 && p.error_flag && __any_sync(0xffffffffu, bad) && lane == 0)
      atomicExch(p.error_flag, kErrRoutingBias);
  }
  __syncwarp();

  // Candidates: all experts, or those of the best topk_group groups (DeepSeekV3, n_group > 1).
  uint64_t kept = ~uint64_t(0);
  int gs = E;
  if (method == RoutingMethod::DeepSeekV3 && p.n_group > 1) {
    const int G = p.n_group;
    gs = E / G;
    for (int g = lane; g < G; g += 32) {
      int b0 = -1, b1 = -1;
      for (int e = g * gs; e < (g + 1) * gs; ++e) {
        if (b0 < 0 || ranks_before(sel[e], e, sel[b0], b0)) { b1 = b0; b0 = e; }
        else if (b1 < 0 || ranks_before(sel[e], e, sel[b1], b1)) { b1 = e; }
      }
      gsc[g] = sel[b0] + sel[b1];
    }
    __syncwarp();
    kept = 0;
    for (int q = 0; q < p.topk_group; ++q) {
      float bs = 0.f;
      int bi = -1;
      for (int g = lane; g < G; g += 32)
        if (!((kept >> g) & 1) && (bi < 0 || ranks_before(gsc[g], g, bs, bi))) { bs = gsc[g]; bi = g; }
      warp_best(bs, bi);
      kept |= uint64_t(1) << bi;
    }
  }
  __syncwarp();  // the bias in keys[] has been read
  if (kept == ~uint64_t(0)) {  // no group limit: no integer division a candidate (a third of the loop's code)
#pragma unroll 1
    for (int e = lane; e < E; e += 32) keys[e] = rank_key(sel[e]);
  } else {
#pragma unroll 1
    for (int e = lane; e < E; e += 32) keys[e] = ((kept >> (e / gs)) & 1) ? rank_key(sel[e]) : 0u;
  }

  // Top-k: lane l keeps the ids of slots l and l + 32 (k <= 64) in registers, so the weights below never read them
  // back from memory.
  int my_id[2] = {-1, -1};
  topk_cached(keys, E, k, my_id);
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

template <RoutingMethod M> __global__ void routing_kernel(RoutingParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * (blockDim.x >> 5) + warp;
  if (t >= p.T) return;
  float* sel = smem + warp * routing_floats_per_warp(p.E);
  route_token<M>(p, t, sel, reinterpret_cast<uint32_t*>(sel + p.E), sel + 2 * p.E);
}

template <RoutingMethod M> void launch_routing_as(const RoutingParams& p, int warps_per_block, size_t smem,
                                                  cudaStream_t stream) {
  const int blocks = (p.T + warps_per_block - 1) / warps_per_block;
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(routing_kernel<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "cudaFuncSetAttribute(routing_kernel)");
  launch_pdl(routing_kernel<M>, dim3(blocks), dim3(32 * warps_per_block), smem, stream, "routing_kernel", p);
}

}  // namespace

void launch_routing(const RoutingParams& p, int warps_per_block, size_t smem, cudaStream_t stream) {
  if (p.T <= 0) return;
  using R = RoutingMethod;
  switch (static_cast<R>(p.method)) {
    case R::Default: return launch_routing_as<R::Default>(p, warps_per_block, smem, stream);
    case R::Renormalize: return launch_routing_as<R::Renormalize>(p, warps_per_block, smem, stream);
    case R::DeepSeekV3: return launch_routing_as<R::DeepSeekV3>(p, warps_per_block, smem, stream);
    case R::Llama4: return launch_routing_as<R::Llama4>(p, warps_per_block, smem, stream);
    case R::RenormalizeNaive: return launch_routing_as<R::RenormalizeNaive>(p, warps_per_block, smem, stream);
    case R::TopK: return launch_routing_as<R::TopK>(p, warps_per_block, smem, stream);
    case R::SigmoidRenorm: return launch_routing_as<R::SigmoidRenorm>(p, warps_per_block, smem, stream);
    case R::MiniMax2: return launch_routing_as<R::MiniMax2>(p, warps_per_block, smem, stream);
    case R::Sigmoid: return launch_routing_as<R::Sigmoid>(p, warps_per_block, smem, stream);
    case R::TopKSigmoid: return launch_routing_as<R::TopKSigmoid>(p, warps_per_block, smem, stream);
  }
  throw Error(ErrorCode::InvalidArgument, "routing_method", "not a RoutingMethod value");
}

}  // namespace fp4moe::cuda_backend
