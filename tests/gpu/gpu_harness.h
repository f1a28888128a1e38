// Harness of the GPU tests: device buffers, a synthetic layer prepared for both backends, one call on
// the GPU (outputs poisoned first, a watchdog on completion) and the CPU reference on a token subset.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../../tools/common/device_buffer.h"
#include "cuda/backend.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "fp4moe/synthetic.h"

namespace fp4moe::gputest {

#define FP4MOE_SKIP_WITHOUT_GPU() \
  do {                            \
    if (::fp4moe::cuda_backend::device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

inline void cuda_check_abort(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA failure in test harness: %s: %s\n", what, cudaGetErrorString(e));
    std::abort();
  }
}

// The tests' name for the shared buffer helper (tools/common/device_buffer.h).
using DevBuf = DeviceBuffer;

inline TensorView dview(const DevBuf& b, DType t, std::initializer_list<int64_t> shape) {
  return make_view(b.get(), t, shape, Backend::CUDA, 0);
}

// A model shape of SPEC §1 by name (include/fp4moe/model_shapes.h); aborts on a name it does not know.
inline ModelShape model(const char* name) {
  const ModelShape* m = find_model_shape(name);
  if (!m) std::abort();
  return *m;
}

// One test case: a model shape (possibly with fewer experts), the call's options.
struct Case {
  ModelShape shape;
  int64_t E_loc = 8, E_total = 8, offset = 0, T = 8;
  WeightFormat format = WeightFormat::NVFP4;
  ActMode mode = ActMode::A16;
  GateUpOrder order = GateUpOrder::GateFirst;
  bool bias = false, shared = false, precomputed = false, delta = false, act_out = false;
  int64_t shared_I = 0;
  bool per_token_x_scale = false;
  uint64_t seed = 1;
  int64_t check_tokens = 16;  // reference on at most this many tokens (spread over the batch)
  int gemm_tile = -1;         // MoeArgs::gemm_tile (-1: the plan's choice)
  int64_t workspace_budget = 0;  // MoeArgs::workspace_budget (0: the default)
};

// Weights of a case, prepared for the CPU reference and for the GPU.
struct Layer {
  SyntheticLayer L, S;
  MoeWeights cpu, gpu, scpu, sgpu;
  DevBuf alpha, beta, clamp;
  bool has_shared = false;
};

// edit: changes the synthetic routed experts before both backends prepare them (special values).
inline std::unique_ptr<Layer> make_layer(const Case& c, const std::function<void(SyntheticLayer&)>& edit = {}) {
  auto l = std::make_unique<Layer>();
  l->L = make_synthetic_layer(c.shape, c.E_loc, c.seed, c.format, c.bias, c.order);
  if (edit) edit(l->L);
  WeightsDesc d = l->L.desc();
  l->cpu = prepare_weights(d, Backend::CPU);
  l->gpu = prepare_weights(d, Backend::CUDA, 0);
  if (c.shared) {
    l->S = make_synthetic_shared_expert(c.shape, c.shared_I, c.seed + 77, c.format);
    WeightsDesc sd = l->S.desc();
    l->scpu = prepare_weights(sd, Backend::CPU);
    l->sgpu = prepare_weights(sd, Backend::CUDA, 0);
    l->has_shared = true;
  }
  l->alpha = DevBuf::from(l->L.alpha);
  l->beta = DevBuf::from(l->L.beta);
  l->clamp = DevBuf::from(l->L.clamp);
  return l;
}

// Host inputs of a call.
struct Inputs {
  int64_t T = 0, H = 0, E_total = 0, k = 0, N1 = 0;
  std::vector<uint16_t> x;        // [T, H]
  std::vector<float> logits;      // [T, E_total]
  std::vector<float> bias;        // [E_total]
  std::vector<int32_t> ids;       // precomputed [T, k]
  std::vector<float> weights;     // precomputed [T, k]
  std::vector<uint16_t> delta;    // [T, k, N1]
  float fc1 = 0.f, fc2 = 0.f;
};

inline Inputs make_inputs(const Case& c) {
  Inputs in;
  in.T = c.T;
  in.H = c.shape.H;
  in.E_total = c.E_total;
  in.k = c.shape.k;
  in.N1 = is_gated(c.shape.activation) ? 2 * c.shape.I : c.shape.I;
  in.x = random_bf16(c.T * in.H, c.seed * 3 + 1);
  in.logits = random_f32(c.T * c.E_total, c.seed * 3 + 2);
  in.bias = random_f32(c.E_total, c.seed * 3 + 3, 0.1f);
  if (c.precomputed) {
    std::mt19937_64 rng(c.seed);
    in.ids.resize(c.T * in.k);
    in.weights.resize(c.T * in.k);
    for (int64_t t = 0; t < c.T; ++t) {
      std::vector<int32_t> perm(c.E_total);
      for (int64_t e = 0; e < c.E_total; ++e) perm[e] = static_cast<int32_t>(e);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t j = 0; j < in.k; ++j) {
        in.ids[t * in.k + j] = perm[j];
        in.weights[t * in.k + j] = std::uniform_real_distribution<float>(0.05f, 1.f)(rng);
      }
    }
  }
  if (c.delta) in.delta = random_bf16(c.T * in.k * in.N1, c.seed * 3 + 4, 0.5f);
  float amax = 0.f;
  for (uint16_t b : in.x) amax = std::max(amax, std::fabs(bf16_bits_to_f32(b)));
  in.fc1 = amax / 2688.f;
  in.fc2 = 6.f / 2688.f;
  return in;
}

// The MoeArgs common to both backends; tensors are filled in by the callers.
inline MoeArgs base_args(const Case& c, const Inputs& in) {
  MoeArgs a;
  a.gemm_tile = static_cast<GemmTile>(c.gemm_tile);
  a.workspace_budget = c.workspace_budget;
  a.routing.method = c.shape.routing;
  a.routing.top_k = c.shape.k;
  a.routing.n_group = c.shape.n_group;
  a.routing.topk_group = c.shape.topk_group;
  a.routing.routed_scaling_factor = c.shape.routed_scaling_factor;
  a.num_experts_total = c.E_total;
  a.local_expert_offset = c.offset;
  a.activation.type = c.shape.activation;
  a.mode = c.mode;
  a.fc1_input_scale = in.fc1;
  a.fc2_input_scale = in.fc2;
  a.per_token_x_scale = c.per_token_x_scale;
  return a;
}

inline bool uses_routing_bias(const Case& c) {
  return c.shape.routing == RoutingMethod::DeepSeekV3 || c.shape.routing == RoutingMethod::MiniMax2;
}

// Device-side tensors of one GPU call (kept alive together).
struct GpuCall {
  DevBuf x, logits, bias, ids, weights, delta, y, act_out, workspace;
  MoeArgs args;
};

// The plan's view of a case (for make_plan / workspace_size).
inline ProblemShape problem_shape(const Case& c) {
  ProblemShape ps;
  ps.T = c.T; ps.H = c.shape.H; ps.I = c.shape.I; ps.E_loc = c.E_loc; ps.E_total = c.E_total; ps.k = c.shape.k;
  ps.activation = c.shape.activation; ps.gated = is_gated(c.shape.activation); ps.mode = c.mode; ps.format = c.format;
  ps.has_shared = c.shared; ps.shared_I = c.shared_I; ps.gemm_config = c.gemm_tile;
  ps.workspace_budget = c.workspace_budget;
  ps.n_group = c.shape.routing == RoutingMethod::DeepSeekV3 ? c.shape.n_group : 1;
  ps.routing_sums_experts = c.shape.routing == RoutingMethod::Default || c.shape.routing == RoutingMethod::RenormalizeNaive;
  return ps;
}

// The tokens `sub` of a batch's inputs as a batch of their own (x and logits; not precomputed ids, weights or delta).
inline Inputs sub_inputs(const Inputs& in, const std::vector<int64_t>& sub) {
  Inputs is = in;
  is.T = static_cast<int64_t>(sub.size());
  is.x.clear();
  is.logits.clear();
  for (int64_t t : sub) {
    is.x.insert(is.x.end(), in.x.begin() + t * in.H, in.x.begin() + (t + 1) * in.H);
    is.logits.insert(is.logits.end(), in.logits.begin() + t * in.E_total, in.logits.begin() + (t + 1) * in.E_total);
  }
  return is;
}

inline std::unique_ptr<GpuCall> make_gpu_call(const Case& c, const Inputs& in, const Layer& l) {
  auto g = std::make_unique<GpuCall>();
  const int64_t T = in.T, H = in.H, k = in.k;
  g->args = base_args(c, in);
  MoeArgs& a = g->args;
  g->x = DevBuf::from(in.x);
  a.x = dview(g->x, DType::BF16, {T, H});
  if (c.precomputed) {
    g->ids = DevBuf::from(in.ids);
    g->weights = DevBuf::from(in.weights);
    a.routing.topk_ids = dview(g->ids, DType::I32, {T, k});
    a.routing.topk_weights = dview(g->weights, DType::F32, {T, k});
  } else {
    g->logits = DevBuf::from(in.logits);
    a.routing.logits = dview(g->logits, DType::F32, {T, in.E_total});
    if (uses_routing_bias(c)) {
      g->bias = DevBuf::from(in.bias);
      a.routing.bias = dview(g->bias, DType::F32, {in.E_total});
    }
  }
  if (!l.L.alpha.empty()) a.activation.alpha = dview(l.alpha, DType::F32, {c.E_loc});
  if (!l.L.beta.empty()) a.activation.beta = dview(l.beta, DType::F32, {c.E_loc});
  if (!l.L.clamp.empty()) a.activation.clamp_limit = dview(l.clamp, DType::F32, {c.E_loc});
  if (l.has_shared) a.shared_expert = &l.sgpu;
  if (c.delta) {
    g->delta = DevBuf::from(in.delta);
    a.gate_up_lora_delta = dview(g->delta, DType::BF16, {T, k, in.N1});
  }
  g->y = DevBuf(static_cast<size_t>(T * H * 2));
  a.y = dview(g->y, DType::BF16, {T, H});
  if (c.act_out) {
    g->act_out = DevBuf(static_cast<size_t>(T * k * c.shape.I * 2));
    a.activation_out = dview(g->act_out, DType::BF16, {T, k, c.shape.I});
  }
  return g;
}

// FP4MOE_TEST_LIGHT=1, for runs under compute-sanitizer (every launch 10-100x slower): the tests that repeat one
// kind of case many times run a few of them; every test, tile and activation still runs.
inline bool light_mode() {
  const char* v = std::getenv("FP4MOE_TEST_LIGHT");
  return v != nullptr && std::atoi(v) != 0;
}
inline int repeats(int full, int light) { return light_mode() ? light : full; }

// Waits for the stream with a watchdog: a kernel that does not finish in `seconds` fails the test and
// aborts the binary (a hang must never stall the suite). FP4MOE_TEST_WATCHDOG_SCALE stretches it for runs under
// compute-sanitizer, whose instrumented kernels run many times slower.
inline void sync_with_watchdog(cudaStream_t s, double seconds = 60.0) {
  if (const char* k = std::getenv("FP4MOE_TEST_WATCHDOG_SCALE")) seconds *= std::max(1.0, std::atof(k));
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "stream error: %s\n", cudaGetErrorString(e));
      std::abort();
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
      std::fprintf(stderr, "WATCHDOG: GPU work did not finish within %.0f s (hang)\n", seconds);
      std::fflush(stderr);
      std::abort();
    }
  }
}

// Runs the call on the GPU with y (and activation_out) poisoned with NaN bits first; returns y's bits.
inline std::vector<uint16_t> run_gpu(const MoeWeights& w, GpuCall& g, cudaStream_t stream = nullptr) {
  g.y.fill_byte(0xff);
  if (g.act_out.bytes()) g.act_out.fill_byte(0xff);
  g.args.stream = stream;
  moe_run(w, g.args);
  sync_with_watchdog(stream);
  return g.y.download<uint16_t>();
}

// The tokens the reference checks: all when few, else spread over the batch (first, last, a stride).
inline std::vector<int64_t> check_tokens(int64_t T, int64_t n) {
  std::vector<int64_t> v;
  if (T <= n) {
    for (int64_t t = 0; t < T; ++t) v.push_back(t);
    return v;
  }
  for (int64_t i = 0; i < n; ++i) v.push_back(i * (T - 1) / (n - 1));
  return v;
}

// The CPU reference on the given tokens of the batch (each token's output depends on itself only).
// Fp64: y in double; Fp32: y in bf16 bits widened to double. act_out (optional) [n, k, I] bf16.
// Multi-LoRA: `reg` (a registry on the CPU weights) and the adapter id of every token of the batch.
inline std::vector<double> run_reference(const Case& c, const Inputs& in, const Layer& l, const std::vector<int64_t>& toks,
                                         Precision prec, std::vector<uint16_t>* act_out = nullptr,
                                         const AdapterRegistry* reg = nullptr,
                                         const std::vector<int32_t>* adapter_ids = nullptr) {
  const int64_t n = static_cast<int64_t>(toks.size()), H = in.H, k = in.k, E = in.E_total, N1 = in.N1;
  std::vector<uint16_t> x(n * H);
  std::vector<float> logits(n * E), wts(n * k);
  std::vector<int32_t> ids(n * k);
  std::vector<uint16_t> delta(c.delta ? n * k * N1 : 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = toks[i];
    std::copy_n(in.x.begin() + t * H, H, x.begin() + i * H);
    if (c.precomputed) {
      std::copy_n(in.ids.begin() + t * k, k, ids.begin() + i * k);
      std::copy_n(in.weights.begin() + t * k, k, wts.begin() + i * k);
    } else {
      std::copy_n(in.logits.begin() + t * E, E, logits.begin() + i * E);
    }
    if (c.delta) std::copy_n(in.delta.begin() + t * k * N1, k * N1, delta.begin() + i * k * N1);
  }
  MoeArgs a = base_args(c, in);
  a.x = make_view(x.data(), DType::BF16, {n, H});
  std::vector<float> bias = in.bias;
  if (c.precomputed) {
    a.routing.topk_ids = make_view(ids.data(), DType::I32, {n, k});
    a.routing.topk_weights = make_view(wts.data(), DType::F32, {n, k});
  } else {
    a.routing.logits = make_view(logits.data(), DType::F32, {n, E});
    if (uses_routing_bias(c)) a.routing.bias = make_view(bias.data(), DType::F32, {E});
  }
  std::vector<float> alpha = l.L.alpha, beta = l.L.beta, clamp = l.L.clamp;
  if (!alpha.empty()) a.activation.alpha = make_view(alpha.data(), DType::F32, {c.E_loc});
  if (!beta.empty()) a.activation.beta = make_view(beta.data(), DType::F32, {c.E_loc});
  if (!clamp.empty()) a.activation.clamp_limit = make_view(clamp.data(), DType::F32, {c.E_loc});
  if (l.has_shared) a.shared_expert = &l.scpu;
  if (c.delta) a.gate_up_lora_delta = make_view(delta.data(), DType::BF16, {n, k, N1});
  if (act_out) {
    act_out->assign(n * k * c.shape.I, 0);
    a.activation_out = make_view(act_out->data(), DType::BF16, {n, k, c.shape.I});
  }
  std::vector<int32_t> aids;
  if (reg) {
    for (int64_t t : toks) aids.push_back(adapter_ids ? (*adapter_ids)[t] : -1);
    a.adapters = reg;
    a.adapter_ids = make_view(aids.data(), DType::I32, {n});
  }
  a.precision = prec;
  std::vector<double> y(n * H);
  if (prec == Precision::Fp64) {
    a.y = make_view(y.data(), DType::F64, {n, H});
    moe_run(l.cpu, a);
  } else {
    std::vector<uint16_t> yb(n * H);
    a.y = make_view(yb.data(), DType::BF16, {n, H});
    moe_run(l.cpu, a);
    for (int64_t i = 0; i < n * H; ++i) y[i] = bf16_bits_to_f32(yb[i]);
  }
  return y;
}

struct Errors {
  double rel_l2 = 0, cosine = 1, max_abs = 0;
  int64_t nonfinite = 0;
};

// GPU rows `toks` of y (bf16 bits [T, H]) against the reference rows [n, H].
inline Errors compare(const std::vector<uint16_t>& y, const std::vector<double>& ref, const std::vector<int64_t>& toks,
                      int64_t H) {
  double num = 0, den = 0, dot = 0, ng = 0;
  Errors e;
  for (size_t i = 0; i < toks.size(); ++i)
    for (int64_t h = 0; h < H; ++h) {
      const double g = bf16_bits_to_f32(y[toks[i] * H + h]), r = ref[i * H + h];
      if (!std::isfinite(g)) { ++e.nonfinite; continue; }
      num += (g - r) * (g - r);
      den += r * r;
      dot += g * r;
      ng += g * g;
      e.max_abs = std::max(e.max_abs, std::fabs(g - r));
    }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  e.cosine = (den > 0 && ng > 0) ? dot / std::sqrt(den * ng) : (num == 0 ? 1.0 : 0.0);
  return e;
}

// check_device_errors must report a DeviceFault naming `argument`, then clear the flag.
inline void expect_device_fault(const char* argument) {
  try {
    check_device_errors(0);
    ADD_FAILURE() << "expected DeviceFault naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::DeviceFault) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
  EXPECT_NO_THROW(check_device_errors(0)) << "the flag is cleared once reported";
}

// Number of elements still carrying the poison (0xffff): not written by the kernels.
inline int64_t count_poison(const std::vector<uint16_t>& v) {
  int64_t n = 0;
  for (uint16_t b : v) n += b == 0xffff;
  return n;
}

}  // namespace fp4moe::gputest
