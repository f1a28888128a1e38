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

// Records winner bi of round j in the slot registers (slot j lives on lane j % 32).
__device__ __forceinline__ void record_slot(int j, int bi, int my_id[2]) {
  if ((threadIdx.x & 31) != (j & 31)) return;
  if (j < 32) my_id[0] = bi;  // static indices: my_id stays in registers
  else my_id[1] = bi;
}

// The reference's ranking of scores as an unsigned key (higher first): NaN ranks below every number (key 1), -0 ties
// with +0, key 0 = no candidate. Equal keys fall back to the lower id, as in the reference.
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

// The score key of group [base, base + gs) (DeepSeekV3's groups): rank_key of the sum of its two best scores, on one
// warp (lane l holds the group's experts base + l, base + l + 32, ...), the two found by two warp reductions, the
// lower expert first among equal keys. keys: where each expert's key is written as it is made (or nullptr).
__device__ __forceinline__ uint32_t group_key(const float* sel, int base, int gs, uint32_t* keys) {
  const int lane = threadIdx.x & 31;
  uint32_t k0 = 0, k1 = 0;  // this lane's two best keys in the group (0: none), the lower expert first on ties
  int e0 = 0, e1 = 0;
#pragma unroll 1
  for (int e = base + lane; e < base + gs; e += 32) {
    const uint32_t kk = rank_key(sel[e]);
    if (keys) keys[e] = kk;
    const bool g0 = kk > k0, g1 = kk > k1;
    k1 = g0 ? k0 : (g1 ? kk : k1);
    e1 = g0 ? e0 : (g1 ? e : e1);
    k0 = g0 ? kk : k0;
    e0 = g0 ? e : e0;
  }
  int best[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // gs >= 2 (validated): both rounds find an expert
    const uint32_t bk = __reduce_max_sync(0xffffffffu, k0);
    best[r] = static_cast<int>(0xffffu - __reduce_max_sync(0xffffffffu, k0 == bk ? 0xffffu - static_cast<uint32_t>(e0) : 0u));
    if (((best[r] - base) & 31) == lane) { k0 = k1; e0 = e1; k1 = 0; }
  }
  return rank_key(sel[best[0]] + sel[best[1]]);
}

__device__ __forceinline__ float read_logit(const RoutingParams& p, int t, int e) {
  const int64_t off = static_cast<int64_t>(t) * p.E + e;
  return p.logits_bf16 ? dev::bf16_to_f32(static_cast<const uint16_t*>(p.logits)[off])
                       : static_cast<const float*>(p.logits)[off];
}

// The ids and weights of token t from its chosen experts (lane l holds the ids of slots l and l + 32, k <= 64) and
// its scores sel[E] (shared memory), on one warp: the same code for a warp a token and a block a token.
template <RoutingMethod M>
__device__ __forceinline__ void route_weights(const RoutingParams& p, int t, const float* sel, const int (&my_id)[2]) {
  const int lane = threadIdx.x & 31;
  const int k = p.k;
  constexpr RoutingMethod method = M;
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
#pragma unroll 1
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

// One token's routing on one warp: sel[E] (scores) and keys[E] (the bias first, then the top-k keys), both in this
// warp's shared memory. Written as rolled loops over shared memory on purpose: at T = 1 this
// kernel is a single warp whose time follows the code it runs through, not its instruction count (ncu, H200,
// kimi_k3_tp8: "no instruction" stalls ~64 % of the cycles; the fully unrolled register version with fewer
// instructions but more code ran 12 -> 17 us).
// M: the routing method, a template argument so that each method's kernel holds only its own code (a T = 1 call is
// one warp fetching its instructions cold: the branches of the other methods were code it jumped over).
template <RoutingMethod M>
__device__ __forceinline__ void route_token(const RoutingParams& p, int t, float* sel, uint32_t* keys) {
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
  if (method == RoutingMethod::DeepSeekV3 && p.n_group > 1) {
    // One group at a time over the whole warp (group_key), where one lane scanning a group was a serial chain of
    // shared loads. The group's keys are written as they are made; those of the groups not kept are zeroed below.
    const int G = p.n_group, gs = E / G;
    uint32_t gkey[2] = {0u, 0u};  // lane l: the score keys of groups l and l + 32 (G <= 64)
#pragma unroll 1
    for (int g = 0; g < G; ++g) {
      const uint32_t sk = group_key(sel, g * gs, gs, keys);
      if ((g & 31) == lane) {
        if (g < 32) gkey[0] = sk;  // static indices: gkey stays in registers
        else gkey[1] = sk;
      }
    }
    uint64_t kept = 0;
#pragma unroll 1
    for (int q = 0; q < p.topk_group; ++q) {  // the best group left: highest key, the lower group id on ties
      const bool hi = gkey[1] > gkey[0];
      const uint32_t mk = hi ? gkey[1] : gkey[0];
      const uint32_t bk = __reduce_max_sync(0xffffffffu, mk);
      const int mg = lane + (hi ? 32 : 0);
      const int bg = static_cast<int>(0xffffu - __reduce_max_sync(0xffffffffu, mk == bk ? 0xffffu - static_cast<uint32_t>(mg) : 0u));
      if ((bg & 31) == lane) {
        if (bg < 32) gkey[0] = 0u;
        else gkey[1] = 0u;
      }
      kept |= uint64_t(1) << bg;
    }
    __syncwarp();
#pragma unroll 1
    for (int g = 0; g < G; ++g) {
      if ((kept >> g) & 1) continue;
#pragma unroll 1
      for (int e = g * gs + lane; e < (g + 1) * gs; e += 32) keys[e] = 0u;
    }
  } else {
#pragma unroll 1
    for (int e = lane; e < E; e += 32) keys[e] = rank_key(sel[e]);
  }
  __syncwarp();

  // Top-k: lane l keeps the ids of slots l and l + 32 (k <= 64) in registers, so the weights below never read them
  // back from memory.
  int my_id[2] = {-1, -1};
  topk_cached(keys, E, k, my_id);
  route_weights<M>(p, t, sel, my_id);
}

template <RoutingMethod M> __global__ void routing_kernel(RoutingParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  if (blockIdx.x == 0)  // entry tiles: the counters the permutation would have zeroed (the GEMMs wait for this kernel)
    for (int c = static_cast<int>(threadIdx.x); c < p.num_counters; c += static_cast<int>(blockDim.x)) p.zero_counters[c] = 0;
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * (blockDim.x >> 5) + warp;
  if (t >= p.T) return;
  float* sel = smem + warp * routing_floats_per_warp(p.E);
  route_token<M>(p, t, sel, reinterpret_cast<uint32_t*>(sel + p.E));
}

// A block a token (a few tokens, MoePlan::routing_warps_per_token): thread e scores expert e (E <= 32 x warps),
// each warp ranks its 32 keys by shuffles and keeps its best min(k, 32), then every kept candidate counts the
// better ones among all warps' (a 64-bit key: the score key, then the lower id); the k best take their slots.
// DeepSeekV3's groups first: a warp a group (group_key), then each expert's group kept or not by its rank among the
// group keys. The same order as topk_cached (ties to the lower id, NaN last), and route_weights makes the weights:
// the bits of a warp a token. One warp walked E / 32 experts (kimi_k3_tp8: 12) or the G groups in series there.
template <RoutingMethod M> __global__ void routing_block_kernel(RoutingParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  if (blockIdx.x == 0)  // entry tiles: as routing_kernel
    for (int c = static_cast<int>(threadIdx.x); c < p.num_counters; c += static_cast<int>(blockDim.x)) p.zero_counters[c] = 0;
  static_assert(M != RoutingMethod::Default && M != RoutingMethod::RenormalizeNaive, "no sum over the experts");
  constexpr RoutingMethod method = M;
  extern __shared__ uint64_t smem64[];
  const int E = p.E, k = p.k, kk = min(k, 32), t = static_cast<int>(blockIdx.x);
  const int e = static_cast<int>(threadIdx.x), lane = e & 31, warp = e >> 5, W = static_cast<int>(blockDim.x >> 5);
  float* sel = reinterpret_cast<float*>(smem64);
  uint64_t* cand = smem64 + (E + 1) / 2;   // [W][kk]
  int* s_ids = reinterpret_cast<int*>(cand + W * kk);  // [k], then DeepSeekV3's group keys [n_group]
  const bool with_bias = p.bias && (method == RoutingMethod::DeepSeekV3 || method == RoutingMethod::MiniMax2);

  // Scores and keys (the warp kernel's arithmetic, an expert a thread).
  uint32_t key = 0;  // 0: no expert
  bool bad = false;
  if (e < E) {
    const float x = read_logit(p, t, e);
    float v = x;
    if (method == RoutingMethod::Sigmoid || method == RoutingMethod::SigmoidRenorm) {
      v = act::sigmoid(x);
    } else if (method == RoutingMethod::DeepSeekV3 || method == RoutingMethod::MiniMax2) {
      const float sg = act::sigmoid(x);
      if (with_bias) {
        const float b = p.bias[e];
        bad = !isfinite(b);
        v = sg + b;
      } else {
        v = sg;
      }
    }
    sel[e] = v;
    key = rank_key(v);
  }
  if (with_bias && t == 0 && p.error_flag && __syncthreads_or(bad) && e == 0) atomicExch(p.error_flag, kErrRoutingBias);
  if constexpr (method == RoutingMethod::DeepSeekV3) {
    if (p.n_group > 1) {  // candidates: the experts of the best topk_group groups (a warp a group, then a rank each)
      const int G = p.n_group, gs = E / G;
      uint32_t* gkeys = reinterpret_cast<uint32_t*>(s_ids + k);  // [G]
      __syncthreads();
#pragma unroll 1
      for (int g = warp; g < G; g += W) {
        const uint32_t sk = group_key(sel, g * gs, gs, nullptr);
        if (lane == 0) gkeys[g] = sk;
      }
      __syncthreads();
      if (e < E) {  // kept: fewer than topk_group groups rank above its group (a higher key, or equal and a lower id)
        const int g = e / gs;
        const uint32_t mk = gkeys[g];
        int above = 0;
#pragma unroll 4
        for (int h = 0; h < G; ++h) above += gkeys[h] > mk || (gkeys[h] == mk && h < g);
        if (above >= p.topk_group) key = 0u;
      }
    }
  }
  // This warp's rank of its key (the better keys, then the equal ones of lower id: lower lanes).
  int r = 0;
#pragma unroll 1
  for (int j = 0; j < 32; ++j) {
    const uint32_t kj = __shfl_sync(0xffffffffu, key, j);
    r += kj > key || (kj == key && j < lane);
  }
  const uint64_t mine = (static_cast<uint64_t>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(e));
  if (r < kk) cand[warp * kk + r] = mine;  // ranks are a permutation of 0..31: every slot of the list is written
  __syncthreads();
  const int nc = W * kk;
  if (e < nc) {
    const uint64_t c = cand[e];
    int better = 0;
#pragma unroll 4
    for (int j = 0; j < nc; ++j) better += cand[j] > c;
    if ((c >> 32) != 0 && better < k) s_ids[better] = static_cast<int>(0xffffffffu - static_cast<uint32_t>(c));
  }
  __syncthreads();
  if (warp != 0) return;
  int my_id[2] = {-1, -1};
  if (lane < k) my_id[0] = s_ids[lane];
  if (lane + 32 < k) my_id[1] = s_ids[lane + 32];
  route_weights<M>(p, t, sel, my_id);
}

// A block a token (warps_per_token > 0, never asked for a method with a sum over the experts) or warps_per_block
// tokens a block.
template <RoutingMethod M> void launch_routing_as(const RoutingParams& p, int warps_per_block, int warps_per_token,
                                                  size_t smem, cudaStream_t stream) {
  if (warps_per_token > 0) {
    if constexpr (M == RoutingMethod::Default || M == RoutingMethod::RenormalizeNaive)
      throw Error(ErrorCode::Unsupported, "routing_method", "a block a token needs a method without a sum over the experts");
    else
      launch_pdl(routing_block_kernel<M>, dim3(p.T), dim3(32 * warps_per_token), smem, stream, "routing_block_kernel", p);
    return;
  }
  const int blocks = (p.T + warps_per_block - 1) / warps_per_block;
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(routing_kernel<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "cudaFuncSetAttribute(routing_kernel)");
  launch_pdl(routing_kernel<M>, dim3(blocks), dim3(32 * warps_per_block), smem, stream, "routing_kernel", p);
}

}  // namespace

void launch_routing(const RoutingParams& p, int warps_per_block, int warps_per_token, size_t smem,
                    cudaStream_t stream) {
  if (p.T <= 0) return;
  using R = RoutingMethod;
  switch (static_cast<R>(p.method)) {
    case R::Default: return launch_routing_as<R::Default>(p, warps_per_block, warps_per_token, smem, stream);
    case R::Renormalize: return launch_routing_as<R::Renormalize>(p, warps_per_block, warps_per_token, smem, stream);
    case R::DeepSeekV3: return launch_routing_as<R::DeepSeekV3>(p, warps_per_block, warps_per_token, smem, stream);
    case R::Llama4: return launch_routing_as<R::Llama4>(p, warps_per_block, warps_per_token, smem, stream);
    case R::RenormalizeNaive: return launch_routing_as<R::RenormalizeNaive>(p, warps_per_block, warps_per_token, smem, stream);
    case R::TopK: return launch_routing_as<R::TopK>(p, warps_per_block, warps_per_token, smem, stream);
    case R::SigmoidRenorm: return launch_routing_as<R::SigmoidRenorm>(p, warps_per_block, warps_per_token, smem, stream);
    case R::MiniMax2: return launch_routing_as<R::MiniMax2>(p, warps_per_block, warps_per_token, smem, stream);
    case R::Sigmoid: return launch_routing_as<R::Sigmoid>(p, warps_per_block, warps_per_token, smem, stream);
    case R::TopKSigmoid: return launch_routing_as<R::TopKSigmoid>(p, warps_per_block, warps_per_token, smem, stream);
  }
  throw Error(ErrorCode::InvalidArgument, "routing_method", "not a RoutingMethod value");
}

}  // namespace fp4moe::cuda_backend
