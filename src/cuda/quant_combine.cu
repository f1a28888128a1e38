// Small element-wise kernels: the A4 NVFP4 quantizers (x before GEMM1, a before GEMM2) and the combine.
#include "cuda/kernels.h"
#include "cuda/pdl.cuh"
#include "cuda/nvfp4_device.cuh"
#include "common/shared_gate.h"

namespace fp4moe::cuda_backend {
namespace {

// One 16-element block of row `row` with encode scale gs: NVFP4 values (e2m1 * e4m3, exact in bf16), moved as
// two 16-byte loads and stores (rows are 16-byte aligned: moe_run checks x, the activations are ours). With
// 2-byte accesses a warp's store touched 32 sectors for 64 bytes: ncu, kimi A4 T=1024, 46 us for 15 MB.
__device__ __forceinline__ void quantize_block(const QuantizeParams& p, int row, int b, float gs) {
  const uint4* x = reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(row) * p.ldx + b * 16);
  uint4* y = reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(row) * p.K + b * 16);
  union Block {
    uint4 v[2];
    uint16_t h[16];
  } in, out;
  in.v[0] = x[0];
  in.v[1] = x[1];
  float v[16], q[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = dev::bf16_to_f32(in.h[i]);
  dev::fake_quant_block16(v, gs, q);
#pragma unroll
  for (int i = 0; i < 16; ++i) out.h[i] = dev::f32_to_bf16(q[i]);
  y[0] = out.v[0];
  y[1] = out.v[1];
}

// A given encode scale (x with the per-tensor input_scale, a with the FC2 input scale): one thread per
// 16-element block across all rows. (One block per row left 104 of 128 threads idle on a row of I = 384: A4
// cost kimi_k3_tp8 +13-15 % over A16 at T >= 1024.)
__global__ void quantize_blocks_kernel(QuantizeParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int bpr = p.K / 16;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(p.rows) * bpr) return;
  const int row = static_cast<int>(i / bpr), b = static_cast<int>(i % bpr);
  if (p.row_count && row >= *p.row_count) return;  // rows the permutation did not fill
  if (b == 0 && p.out_scale) p.out_scale[row] = p.scale2;
  quantize_block(p, row, b, p.gs);
}

// Per-row scale (x with per-token scales): one block per row, gs = 2688 / amax (amax over the row, NaN when any
// element is NaN, as the reference), 1 when amax is 0 or not finite.
__global__ void quantize_rows_kernel(QuantizeParams p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int row = blockIdx.x;
  if (p.row_count && row >= *p.row_count) return;  // rows the permutation did not fill
  const uint16_t* x = p.x + static_cast<int64_t>(row) * p.ldx;
  __shared__ float red[32];
  float amax = 0.f;
  bool nan = false;
  for (int i = threadIdx.x; i < p.K; i += blockDim.x) {
    const float v = dev::bf16_to_f32(x[i]);
    nan |= isnan(v);
    amax = fmaxf(amax, fabsf(v));
  }
  if (__syncthreads_or(nan)) amax = NAN;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) amax = fmaxf(amax, red[w]);
  float gs = 1.f;
  if (!(isnan(amax) || isinf(amax) || amax == 0.f)) {
    gs = __fdiv_rn(448.f * 6.f, amax);
    if (isinf(gs)) gs = 3.402823466e38f;
  }
  if (threadIdx.x == 0 && p.out_scale) p.out_scale[row] = __fdiv_rn(1.f, gs);
  for (int b = threadIdx.x; b < p.K / 16; b += blockDim.x) quantize_block(p, row, b, gs);
}

// 0 when the activation parameters (a, b, c) of an expert are in range, else the flag code of the first bad one.
__device__ __forceinline__ int bad_act_values(const CombineParams& p, float a, float b, float c) {
  if (!isfinite(a) || (p.act_positive && !(a > 0.f))) return kErrActAlpha;
  if (!isfinite(b) || (p.act_positive && !(b > 0.f))) return kErrActBeta;
  if (!(c > 0.f)) return kErrActClampLimit;  // +inf = no clamp
  return 0;
}

// The same for local expert e's device-given parameters.
__device__ __forceinline__ int bad_act_param(const CombineParams& p, int e) {
  return bad_act_values(p, p.act_alpha ? p.act_alpha[e] : 1.f, p.act_beta ? p.act_beta[e] : 1.f,
                        p.act_clamp_limit ? p.act_clamp_limit[e] : 1.f);
}

// Block 0: the flag code of the first bad expert among all (6/7/8), used by a token or not; 0 when none is bad.
__device__ __forceinline__ int every_expert_code(const CombineParams& p) {
  int code = 0;
#pragma unroll 4
  for (int e = threadIdx.x; e < p.E_loc; e += blockDim.x) {
    const int c = bad_act_param(p, e);
    code = code ? code : c;
  }
  return code;
}

// The local experts and weights of 8 slots of a token, from slot j0: e -1 for another rank's expert, a dropped bad
// id, bad parameters or past k. Every load is issued before any is tested (a test between them made each wait).
constexpr int kBatch = 8;
struct SlotBatch {
  int e[kBatch];
  float w[kBatch];
};
__device__ __forceinline__ SlotBatch load_slots(const CombineParams& p, int t, int j0, bool act_on_device) {
  SlotBatch s;
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    const int64_t entry = static_cast<int64_t>(t) * p.k + j0 + b;
    const int e = j0 + b < p.k ? p.ids[entry] - p.local_offset : -1;
    s.e[b] = e >= 0 && e < p.E_loc ? e : -1;
    s.w[b] = j0 + b < p.k ? p.weights[entry] : 0.f;
  }
  if (act_on_device && p.E_loc > 0) {
    float a[kBatch], bt[kBatch], c[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int e = s.e[b] >= 0 ? s.e[b] : 0;  // expert 0's values for an unused slot: loads need no branch
      a[b] = p.act_alpha ? p.act_alpha[e] : 1.f;
      bt[b] = p.act_beta ? p.act_beta[e] : 1.f;
      c[b] = p.act_clamp_limit ? p.act_clamp_limit[e] : 1.f;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (bad_act_values(p, a[b], bt[b], c[b])) s.e[b] = -1;
  }
  return s;
}

// The shared expert's gate of token t, sigmoid(x_t . g), in the order of common/shared_gate.h: each lane's partial,
// then the xor butterfly (lane 0 folds exactly as gate_host; the others get the same bits). Every warp computes it for
// itself, with no block barrier, before the kernel waits on the GEMMs. bad: g holds a value that is not finite.
__device__ __forceinline__ float shared_gate_of(const CombineParams& p, int t, bool& bad) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  float s = shared_gate::lane_partial(p.x + static_cast<int64_t>(t) * p.H, p.shared_gate, p.H, lane);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
  bool nonfinite = false;
  for (int i = lane; i < p.H; i += 32) nonfinite |= !isfinite(dev::bf16_to_f32(p.shared_gate[i]));
  bad = __any_sync(0xffffffffu, nonfinite);
  return act::sigmoid_ieee(s);
}

// y_t = sum_j w_tj o_tj in slot order (+ shared, + SharedOuter down delta), fp32 multiply then add (no FMA,
// as the reference), rounded once to bf16, or written as the fp32 sum (y_f32: float32 y, no rounding, as the
// reference's float32 y). One block: 4 outputs a thread of token t = blockIdx.x / blocks_per_token; first: its
// slots 0..7, loaded before the wait.
// gate: the shared expert's gate (gate_bad: drop its term), unused without p.shared_gate.
template <bool kFull>
__device__ __forceinline__ void combine_token(const CombineParams& p, bool act_on_device, int t, const SlotBatch& first,
                                              float gate, bool gate_bad) {
  // The local expert of an entry, -1 when it is another rank's, a dropped bad id or has bad parameters.
  auto local = [&](int64_t entry) {
    const int e = p.ids[entry] - p.local_offset;
    return e < 0 || e >= p.E_loc || (act_on_device && bad_act_param(p, e)) ? -1 : e;
  };
  const int h = (static_cast<int>(blockIdx.x % p.blocks_per_token) * p.threads + threadIdx.x) * 4;
  // SharedOuter down LoRA of this token (block-uniform): z = sum_j w_j t2_j over the local slots in slot
  // order (fp32 multiply, then add), rounded to bf16 into shared memory for the expand below.
  __shared__ float s_z[kMaxLoraRank];
  const uint16_t* b2 = nullptr;
  int r2 = 0;
  if (kFull && p.lora_table) {
    const int slot = p.token_slot[t];
    if (slot >= 0) {
      const LoraProj& pj = p.lora_table[slot].proj[kLoraDown];
      if (pj.r > 0 && pj.b_shared) {
        b2 = pj.B;
        r2 = pj.r;
      }
    }
  }
  if (r2 > 0) {
    for (int i = threadIdx.x; i < r2; i += blockDim.x) {
      float z = 0.f;
      for (int j = 0; j < p.k; ++j) {
        const int64_t entry = static_cast<int64_t>(t) * p.k + j;
        if (local(entry) < 0) continue;
        z = __fadd_rn(z, __fmul_rn(p.weights[entry], p.lora_t2[entry * p.lora_t2_stride + i]));
      }
      s_z[i] = dev::round_to_bf16(z);
    }
    __syncthreads();
  }
  if (h >= p.H) return;
  // Slots in batches of 8, the o rows of a batch loaded before any is used; the sum still runs in slot order.
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j0 = 0; j0 < p.k; j0 += kBatch) {
    const SlotBatch s = j0 == 0 ? first : load_slots(p, t, j0, act_on_device);
    const int* e = s.e;
    const float* w = s.w;
    float4 o[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t entry = static_cast<int64_t>(t) * p.k + j0 + b;
      if (e[b] >= 0) o[b] = __ldcs(reinterpret_cast<const float4*>(p.out + entry * p.H + h));  // read once: evict first
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (e[b] < 0) continue;  // another rank's expert, a dropped bad id or parameter, or past k
      acc[0] = __fadd_rn(acc[0], __fmul_rn(w[b], o[b].x));
      acc[1] = __fadd_rn(acc[1], __fmul_rn(w[b], o[b].y));
      acc[2] = __fadd_rn(acc[2], __fmul_rn(w[b], o[b].z));
      acc[3] = __fadd_rn(acc[3], __fmul_rn(w[b], o[b].w));
    }
  }
  if (kFull && p.shared_out && p.shared_gate && !gate_bad) {  // gate * shared: multiply, then add
    const float4 s = *reinterpret_cast<const float4*>(p.shared_out + static_cast<int64_t>(t) * p.H + h);
    acc[0] = __fadd_rn(acc[0], __fmul_rn(gate, s.x));
    acc[1] = __fadd_rn(acc[1], __fmul_rn(gate, s.y));
    acc[2] = __fadd_rn(acc[2], __fmul_rn(gate, s.z));
    acc[3] = __fadd_rn(acc[3], __fmul_rn(gate, s.w));
  } else if (p.shared_out && !(kFull && p.shared_gate)) {
    const float4 s = *reinterpret_cast<const float4*>(p.shared_out + static_cast<int64_t>(t) * p.H + h);
    acc[0] = __fadd_rn(acc[0], s.x);
    acc[1] = __fadd_rn(acc[1], s.y);
    acc[2] = __fadd_rn(acc[2], s.z);
    acc[3] = __fadd_rn(acc[3], s.w);
  }
  // + the SharedOuter down delta dy = bf16(bf16(z) . B2^T), i ascending; +0 for every other token. B2's rows by
  // 16 bytes where they allow (r a multiple of 8, B2 16-byte aligned: block-uniform): a load a bf16 was most of it.
  float dy[4] = {0.f, 0.f, 0.f, 0.f};
  const bool rows16 = r2 % 8 == 0 && reinterpret_cast<uintptr_t>(b2) % 16 == 0;
  for (int q = 0; q < 4 && r2 > 0; ++q) {
    const uint16_t* brow = b2 + static_cast<int64_t>(h + q) * r2;
    float d = 0.f;
    if (rows16) {
      for (int i0 = 0; i0 < r2; i0 += 8) {
        const uint4 v = *reinterpret_cast<const uint4*>(brow + i0);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint16_t b = static_cast<uint16_t>(j % 2 ? w[j / 2] >> 16 : w[j / 2] & 0xffffu);
          d = __fadd_rn(d, __fmul_rn(s_z[i0 + j], dev::bf16_to_f32(b)));
        }
      }
    } else {
      for (int i = 0; i < r2; ++i) d = __fadd_rn(d, __fmul_rn(s_z[i], dev::bf16_to_f32(brow[i])));
    }
    dy[q] = dev::round_to_bf16(d);
  }
  if (p.y_f32) {
    float* y = p.y_f32 + static_cast<int64_t>(t) * p.H + h;
#pragma unroll
    for (int i = 0; i < 4; ++i) y[i] = __fadd_rn(acc[i], dy[i]);
    return;
  }
  uint16_t* y = p.y + static_cast<int64_t>(t) * p.H + h;
  uint16_t v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = dev::f32_to_bf16(__fadd_rn(acc[i], dy[i]));
  if (reinterpret_cast<uintptr_t>(y) % 8 == 0) {  // one 8-byte store (y's rows are 8-byte aligned when y is)
    *reinterpret_cast<uint2*>(y) = make_uint2(v[0] | (uint32_t{v[1]} << 16), v[2] | (uint32_t{v[3]} << 16));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) y[i] = v[i];
  }
}

// Before the wait it reads only what the call was given and what the routing wrote: every kernel of the chain lets
// the next one start only after its own wait, so when this one starts all but its predecessor have finished, and
// the loads of slots and parameters overlap the GEMM's tail (a decode token's combine is those loads' latency).
template <bool kFull>
__global__ void __launch_bounds__(128) combine_kernel(CombineParams p) {
  const bool act_on_device = kFull && (p.act_alpha || p.act_beta || p.act_clamp_limit);
  const int t = static_cast<int>(static_cast<int64_t>(blockIdx.x) / p.blocks_per_token);
  if (t >= p.T) return;  // block-uniform
  const SlotBatch first = load_slots(p, t, 0, act_on_device);
  const int every = act_on_device && blockIdx.x == 0 ? every_expert_code(p) : 0;
  bool gate_bad = false;
  const float gate = kFull && p.shared_gate ? shared_gate_of(p, t, gate_bad) : 1.f;
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  if (every) atomicExch(p.error_flag, every);
  if (gate_bad && blockIdx.x == 0 && threadIdx.x == 0) atomicExch(p.error_flag, kErrSharedGate);
  combine_token<kFull>(p, act_on_device, t, first, gate, gate_bad);
}

}  // namespace

void launch_quantize(const QuantizeParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return;
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.out)) % 16 != 0 || p.ldx % 8 != 0 || p.K % 16 != 0)
    throw Error(ErrorCode::Unsupported, "x", "the A4 quantizer needs 16-byte aligned rows and K a multiple of 16");
  if (p.per_row_scale) {
    launch_pdl(quantize_rows_kernel, dim3(static_cast<unsigned>(p.rows)), dim3(128), 0, stream, "quantize_rows_kernel", p);
  } else {
    const int64_t blocks = (static_cast<int64_t>(p.rows) * (p.K / 16) + 255) / 256;
    launch_pdl(quantize_blocks_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, "quantize_blocks_kernel",
               p);
  }
}

void launch_combine(const CombineParams& p, cudaStream_t stream) {
  if (p.T <= 0) return;
  const int64_t blocks = static_cast<int64_t>(p.T) * p.blocks_per_token;
  // The common call (no per-expert activation parameters, LoRA or shared-expert gate) in a kernel of its own: the
  // full one's registers (128 a thread) halved its occupancy.
  if (p.act_alpha || p.act_beta || p.act_clamp_limit || p.lora_table || p.shared_gate)
    launch_pdl(combine_kernel<true>, dim3(static_cast<unsigned>(blocks)), dim3(p.threads), 0, stream, "combine_kernel", p);
  else
    launch_pdl(combine_kernel<false>, dim3(static_cast<unsigned>(blocks)), dim3(p.threads), 0, stream, "combine_kernel", p);
}

}  // namespace fp4moe::cuda_backend
