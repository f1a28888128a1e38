// The dense oracle of the reference tests (test_reference_dense.cpp, test_reference_lora.cpp): one case's layer,
// adapters and inputs, owned, run through the public API (CPU backend) and computed densely in double: every local
// expert for every token, masked by a double-precision routing, with the SPEC's quantization points modelled by
// test_util.h's own NVFP4 codec. y is poisoned with NaN bits before each run.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "reference/reference.h"
#include "test_util.h"

namespace fp4moe::testutil {


struct Case {
  std::string name;
  ModelShape shape;
  int64_t E_total = 0, E_loc = 0, offset = 0, T = 4;
  WeightFormat format = WeightFormat::NVFP4;
  GateUpOrder order = GateUpOrder::GateFirst;
  bool bias = false;
  ActMode mode = ActMode::A16;
  bool per_token_x = false;
  bool shared = false;
  WeightFormat shared_format = WeightFormat::NVFP4;
  int64_t shared_I = 0;
  bool shared_params = false;      // give shared_alpha/beta/clamp (else defaults)
  bool shared_gate = false;        // a sigmoid gate g [1, H] on the shared expert (Qwen3-Next)
  bool per_expert_params = false;  // alpha/beta/clamp_limit tensors [E_loc] (values vary per expert)
  bool bf16_logits = false;
  bool routing_bias = false;
  Precision precision = Precision::Fp32;
  DType y_dtype = DType::BF16;
  double tol = 1e-2;
  uint64_t seed = 1;
};

// A LoRA adapter as the user gives it (unfolded B, HuggingFace gate-first rows), with its deltas in double
// straight from SPEC §5: dh = s (x A1^T) B1^T, do = s (a A2^T) B2^T.
struct HostAdapter {
  LoraLayout layout = LoraLayout::PeftFused;
  int64_t r = 0, E = 0, H = 0, I = 0, N1 = 0, sI = 0, sN1 = 0;
  bool gated = true, with_shared = false;
  float lora_alpha = 0;
  std::vector<uint16_t> a_gate, a_up, b_gate, b_up, a_gate_up, b_gate_up, a_down, b_down;
  std::vector<uint16_t> sa1, sb1, sa2, sb2;
  double s() const { return double(lora_alpha) / double(r); }

  HostAdapter(LoraLayout l, int64_t rank, int64_t E_, int64_t H_, int64_t I_, bool gated_, uint64_t seed, bool zero_b,
              int64_t shared_I)
      : layout(l), r(rank), E(E_), H(H_), I(I_), N1(gated_ ? 2 * I_ : I_), gated(gated_) {
    lora_alpha = 2.f * static_cast<float>(rank);  // s = 2
    Rng g(seed);
    auto A = [&](int64_t n, int64_t K) {
      const float a = static_cast<float>(std::sqrt(3.0 / double(K)));
      std::vector<uint16_t> v(n);
      for (auto& b : v) b = f32_to_bf16_bits(g.uniform(-a, a));
      return v;
    };
    auto B = [&](int64_t n) {
      const float b = static_cast<float>(0.5 / std::sqrt(double(r)));
      std::vector<uint16_t> v(n);
      for (auto& x : v) x = zero_b ? uint16_t(0) : f32_to_bf16_bits(g.uniform(-b, b));
      return v;
    };
    if (l == LoraLayout::PerExpert) {
      a_gate = A(E * r * H, H);
      b_gate = B(E * I * r);
      if (gated) { a_up = A(E * r * H, H); b_up = B(E * I * r); }
    } else {
      a_gate_up = A((l == LoraLayout::SharedOuter ? 1 : E) * r * H, H);
      b_gate_up = B(E * N1 * r);
    }
    a_down = A(E * r * I, I);
    b_down = B((l == LoraLayout::SharedOuter ? 1 : E) * H * r);
    if (shared_I > 0) {
      with_shared = true;
      sI = shared_I;
      sN1 = gated ? 2 * shared_I : shared_I;
      sa1 = A(r * H, H);
      sb1 = B(sN1 * r);
      sa2 = A(r * sI, sI);
      sb2 = B(H * r);
    }
  }
  LoraAdapterDesc desc() {
    LoraAdapterDesc d;
    d.layout = layout;
    d.rank = r;
    d.lora_alpha = lora_alpha;
    if (layout == LoraLayout::PerExpert) {
      d.a_gate = make_view(a_gate.data(), DType::BF16, {E, r, H});
      d.b_gate = make_view(b_gate.data(), DType::BF16, {E, I, r});
      if (gated) {
        d.a_up = make_view(a_up.data(), DType::BF16, {E, r, H});
        d.b_up = make_view(b_up.data(), DType::BF16, {E, I, r});
      }
    } else if (layout == LoraLayout::PeftFused) {
      d.a_gate_up = make_view(a_gate_up.data(), DType::BF16, {E, r, H});
      d.b_gate_up = make_view(b_gate_up.data(), DType::BF16, {E, N1, r});
    } else {
      d.a_gate_up = make_view(a_gate_up.data(), DType::BF16, {r, H});
      d.b_gate_up = make_view(b_gate_up.data(), DType::BF16, {E, N1, r});
    }
    d.a_down = make_view(a_down.data(), DType::BF16, {E, r, I});
    d.b_down = layout == LoraLayout::SharedOuter ? make_view(b_down.data(), DType::BF16, {H, r})
                                                 : make_view(b_down.data(), DType::BF16, {E, H, r});
    if (with_shared) {
      d.shared_a_gate_up = make_view(sa1.data(), DType::BF16, {r, H});
      d.shared_b_gate_up = make_view(sb1.data(), DType::BF16, {sN1, r});
      d.shared_a_down = make_view(sa2.data(), DType::BF16, {r, sI});
      d.shared_b_down = make_view(sb2.data(), DType::BF16, {H, r});
    }
    return d;
  }
  static double bf(uint16_t b) { return bf16_bits_to_f32(b); }
  // s (v . A^T) B^T with A [r, K] at a, B [N, r] (row stride ldb, column offset cb) at b.
  void lowrank(const double* v, int64_t K, const uint16_t* a, const uint16_t* b, int64_t N, int64_t ldb, int64_t cb,
               double* out, bool accumulate) const {
    std::vector<double> t(r, 0.0);
    for (int64_t q = 0; q < r; ++q)
      for (int64_t kk = 0; kk < K; ++kk) t[q] += v[kk] * bf(a[q * K + kk]);
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t q = 0; q < r; ++q) acc += t[q] * bf(b[n * ldb + cb + q]);
      out[n] = (accumulate ? out[n] : 0.0) + s() * acc;
    }
  }
  // Delta of W1's output in gate-first rows; false when this adapter has none for that expert set.
  bool delta_h(int64_t e, bool is_shared, const double* x, std::vector<double>& out) const {
    if (is_shared) {
      if (!with_shared) return false;
      out.assign(sN1, 0.0);
      lowrank(x, H, sa1.data(), sb1.data(), sN1, r, 0, out.data(), false);
      return true;
    }
    out.assign(N1, 0.0);
    if (layout == LoraLayout::PerExpert) {
      lowrank(x, H, a_gate.data() + e * r * H, b_gate.data() + e * I * r, I, r, 0, out.data(), false);
      if (gated) lowrank(x, H, a_up.data() + e * r * H, b_up.data() + e * I * r, I, r, 0, out.data() + I, false);
    } else {
      const uint16_t* a1 = a_gate_up.data() + (layout == LoraLayout::SharedOuter ? 0 : e * r * H);
      lowrank(x, H, a1, b_gate_up.data() + e * N1 * r, N1, r, 0, out.data(), false);
    }
    return true;
  }
  bool delta_o(int64_t e, bool is_shared, const double* a, std::vector<double>& out) const {
    if (is_shared) {
      if (!with_shared) return false;
      lowrank(a, sI, sa2.data(), sb2.data(), H, r, 0, out.data(), false);
      return true;
    }
    const uint16_t* b2 = b_down.data() + (layout == LoraLayout::SharedOuter ? 0 : e * H * r);
    lowrank(a, I, a_down.data() + e * r * I, b2, H, r, 0, out.data(), false);
    return true;
  }
};

// Everything one case needs, owned, plus the dense oracle.
struct Problem {
  Case c;
  int64_t T, H, I, N1, k;
  HostWeights w, sw;
  MoeWeights mw, msw;
  std::vector<uint16_t> x;
  std::vector<float> logits_f;
  std::vector<uint16_t> logits_bf;
  std::vector<float> rbias;
  std::vector<float> alpha, beta, clamp;  // [E_loc] when per_expert_params
  float fc1 = 0, fc2 = 0;
  // LoRA and bridges (optional).
  std::vector<const HostAdapter*> host_adapters;  // by registry slot
  std::vector<int32_t> adapter_ids;               // [T], -1 = base; empty = no adapters
  std::unique_ptr<AdapterRegistry> registry;
  std::vector<uint16_t> bridge;                   // gate_up_lora_delta [T, k, N1] bf16, or empty
  std::vector<uint16_t> act_out;                  // activation_out [T, k, I] bf16, or empty
  std::vector<uint16_t> gate;                     // shared_expert_gate [1, H] bf16, or empty

  explicit Problem(const Case& cs) : c(cs) {
    T = c.T;
    H = c.shape.H;
    I = c.shape.I;
    k = c.shape.k;
    const bool gated = is_gated(c.shape.activation);
    N1 = gated ? 2 * I : I;
    w = make_weights(c.E_loc, H, I, c.seed * 101 + 1, c.format, c.order, gated, c.bias);
    mw = prepare_weights(w.desc(), Backend::CPU);
    if (c.shared) {
      sw = make_weights(1, H, c.shared_I, c.seed * 101 + 2, c.shared_format, GateUpOrder::GateFirst, gated, false);
      msw = prepare_weights(sw.desc(), Backend::CPU);
      // Logits x . g of std ~0.5-1 for x ~ U(-1, 1): gates spread over (0, 1), none saturated.
      if (c.shared_gate) gate = random_bf16_vec(H, c.seed * 101 + 6, -0.05f, 0.05f);
    }
    x = random_bf16_vec(T * H, c.seed * 101 + 3);
    logits_f = random_f32_vec(T * c.E_total, c.seed * 101 + 4, -3.f, 3.f);
    if (c.bf16_logits) {
      for (float& v : logits_f) v = round_bf16(v);
      for (float v : logits_f) logits_bf.push_back(f32_to_bf16_bits(v));
    }
    if (c.routing_bias) rbias = random_f32_vec(c.E_total, c.seed * 101 + 5, -0.2f, 0.2f);
    if (c.per_expert_params) {
      // Around the model's values, different per expert (a wrong expert index shows).
      for (int64_t e = 0; e < c.E_loc; ++e) {
        const float f = 1.f + 0.125f * static_cast<float>(e % 4);
        alpha.push_back(c.shape.alpha * f);
        beta.push_back(c.shape.beta * f);
        clamp.push_back(c.shape.clamp_limit > 0 ? c.shape.clamp_limit * f : INFINITY);
      }
    }
    // A4 input scales: x ~ U(-1, 1) -> amax 1; a is O(1): a scale for amax 8.
    fc1 = 1.f / 2688.f;
    fc2 = 8.f / 2688.f;
  }

  MoeArgs args(std::vector<uint16_t>& x_in, int64_t T_run, const float* logits, const uint16_t* logits_b, void* y,
               int threads) const {
    MoeArgs a;
    a.x = make_view(x_in.data(), DType::BF16, {T_run, H});
    a.routing.method = c.shape.routing;
    a.routing.top_k = k;
    if (c.bf16_logits) a.routing.logits = make_view(const_cast<uint16_t*>(logits_b), DType::BF16, {T_run, c.E_total});
    else a.routing.logits = make_view(const_cast<float*>(logits), DType::F32, {T_run, c.E_total});
    if (c.routing_bias) a.routing.bias = make_view(const_cast<float*>(rbias.data()), DType::F32, {c.E_total});
    a.routing.n_group = c.shape.n_group;
    a.routing.topk_group = c.shape.topk_group;
    a.routing.routed_scaling_factor = c.shape.routed_scaling_factor;
    a.num_experts_total = c.E_total;
    a.local_expert_offset = c.offset;
    a.activation.type = c.shape.activation;
    if (c.per_expert_params) {
      a.activation.alpha = make_view(const_cast<float*>(alpha.data()), DType::F32, {c.E_loc});
      a.activation.beta = make_view(const_cast<float*>(beta.data()), DType::F32, {c.E_loc});
      a.activation.clamp_limit = make_view(const_cast<float*>(clamp.data()), DType::F32, {c.E_loc});
    }
    a.mode = c.mode;
    if (c.mode == ActMode::A4) {
      a.fc1_input_scale = fc1;
      a.fc2_input_scale = fc2;
      a.per_token_x_scale = c.per_token_x;
    }
    if (c.shared) {
      a.shared_expert = &msw;
      if (c.shared_params) {
        a.shared_params_given = true;
        a.shared_alpha = 1.25f;
        a.shared_beta = c.shape.activation == ActivationType::Situ ? 3.f : 0.5f;
        a.shared_clamp_limit = 6.f;
      }
      if (!gate.empty()) a.shared_expert_gate = make_view(const_cast<uint16_t*>(gate.data()), DType::BF16, {1, H});
    }
    if (registry) {
      a.adapters = registry.get();
      if (!adapter_ids.empty()) a.adapter_ids = make_view(const_cast<int32_t*>(adapter_ids.data()), DType::I32, {T_run});
    }
    if (!bridge.empty()) a.gate_up_lora_delta = make_view(const_cast<uint16_t*>(bridge.data()), DType::BF16, {T_run, k, N1});
    if (!act_out.empty()) a.activation_out = make_view(const_cast<uint16_t*>(act_out.data()), DType::BF16, {T_run, k, I});
    a.y = make_view(y, c.y_dtype, {T_run, H});
    a.precision = c.precision;
    a.num_threads = threads;
    return a;
  }

  // Runs the library on all T tokens; returns y as double and its raw bytes.
  std::vector<double> run(int threads, std::vector<uint8_t>* raw = nullptr) {
    const size_t es = dtype_size(c.y_dtype);
    std::vector<uint8_t> y(T * H * es);
    // Poison: NaN bits in every element.
    for (int64_t i = 0; i < T * H; ++i) {
      if (c.y_dtype == DType::BF16) std::memcpy(&y[i * es], &kBf16Poison, 2);
      else if (c.y_dtype == DType::F32) { const float n = NAN; std::memcpy(&y[i * es], &n, 4); }
      else { const double n = NAN; std::memcpy(&y[i * es], &n, 8); }
    }
    moe_run(mw, args(x, T, logits_f.data(), logits_bf.data(), y.data(), threads));
    if (raw) *raw = y;
    return to_double(y, T * H);
  }
  std::vector<double> to_double(const std::vector<uint8_t>& y, int64_t n) const {
    std::vector<double> d(n);
    for (int64_t i = 0; i < n; ++i) {
      if (c.y_dtype == DType::BF16) { uint16_t b; std::memcpy(&b, &y[i * 2], 2); d[i] = bf16_bits_to_f32(b); }
      else if (c.y_dtype == DType::F32) { float f; std::memcpy(&f, &y[i * 4], 4); d[i] = f; }
      else std::memcpy(&d[i], &y[i * 8], 8);
    }
    return d;
  }

  ActParams params_of(int64_t e) const {
    ActParams p = default_act_params(c.shape.activation);
    if (c.per_expert_params) {
      p.alpha = alpha[e];
      p.beta = beta[e];
      p.has_limit = std::isfinite(clamp[e]);
      p.limit = clamp[e];
    }
    return p;
  }
  ActParams shared_params() const {
    ActParams p = default_act_params(c.shape.activation);
    if (c.shared_params) {
      p.alpha = 1.25;
      p.beta = c.shape.activation == ActivationType::Situ ? 3.0 : 0.5;
      p.limit = 6.0;
      p.has_limit = true;
    }
    return p;
  }

  // One expert (e of `ew`) on all tokens, in double: o[t][H]. xin holds the GEMM1 inputs (unscaled
  // NVFP4 values in A4) and in_scale their dequant scales. slot[t] is the slot by which token t chose
  // this expert (-1: not chosen; the LoRA, bridge and activation_out parts are then skipped).
  void dense_expert(const HostWeights& ew, int64_t e, bool is_shared, const ActParams& p, const std::vector<double>& xin,
                    const std::vector<double>& in_scale, const std::vector<int64_t>& slot, std::vector<double>& o,
                    std::vector<double>* act_out) const {
    const int64_t Ie = ew.I, N1e = ew.n1();
    const bool gated = ew.gated;
    std::vector<double> h(T * N1e), row(std::max(H, Ie));
    for (int64_t n = 0; n < N1e; ++n) {
      ew.w1_row(e, n, row.data());
      for (int64_t t = 0; t < T; ++t) h[t * N1e + n] = dot(xin.data() + t * H, row.data(), H) * in_scale[t];
    }
    std::vector<double> a(T * Ie), a_lora(T * Ie), dh_hf(N1e);
    for (int64_t t = 0; t < T; ++t) {
      double* ht = h.data() + t * N1e;
      if (!ew.bias1.empty())
        for (int64_t n = 0; n < N1e; ++n) ht[n] += ew.bias1[e * N1e + n];
      const HostAdapter* ad = adapter_of(t);
      if (slot[t] >= 0 && !is_shared && !bridge.empty())
        for (int64_t n = 0; n < N1e; ++n) ht[n] += bf16_bits_to_f32(bridge[(t * k + slot[t]) * N1e + n]);
      if (slot[t] >= 0 && ad && ad->delta_h(e, is_shared, xb_row(t).data(), dh_hf)) {
        for (int64_t n = 0; n < N1e; ++n) {
          // The adapter's rows are gate first; the weights' may be up first.
          const int64_t hf = (!gated || ew.order == GateUpOrder::GateFirst) ? n : (n < Ie ? n + Ie : n - Ie);
          ht[n] += dh_hf[hf];
        }
      }
      const int64_t go = ew.order == GateUpOrder::GateFirst ? 0 : Ie, uo = ew.order == GateUpOrder::GateFirst ? Ie : 0;
      std::vector<float> af(Ie);
      for (int64_t i = 0; i < Ie; ++i) {
        double v = gated ? act_double(c.shape.activation, ht[go + i], ht[uo + i], p) : act_double(c.shape.activation, ht[i], 0, p);
        if (act_out && slot[t] >= 0) (*act_out)[(t * k + slot[t]) * Ie + i] = v;
        if (c.precision == Precision::Fp32) v = round_bf16(static_cast<float>(v));
        a[t * Ie + i] = a_lora[t * Ie + i] = v;
        af[i] = round_bf16(static_cast<float>(v));  // A4 quantizes the bf16 a in both precisions (SPEC §3.2 step 4)
      }
      if (c.mode == ActMode::A4) {
        const std::vector<double> q = nvfp4_fake_quant_ref(af.data(), Ie, 1.f / fc2);
        for (int64_t i = 0; i < Ie; ++i) a[t * Ie + i] = q[i] * fc2;
      }
    }
    o.assign(T * H, 0.0);
    for (int64_t hh = 0; hh < H; ++hh) {
      ew.w2_row(e, hh, row.data());
      for (int64_t t = 0; t < T; ++t)
        o[t * H + hh] = dot(a.data() + t * Ie, row.data(), Ie) + (ew.bias2.empty() ? 0.0 : ew.bias2[e * H + hh]);
    }
    std::vector<double> d(H);
    for (int64_t t = 0; t < T; ++t) {
      const HostAdapter* ad = adapter_of(t);
      if (slot[t] >= 0 && ad && ad->delta_o(e, is_shared, a_lora.data() + t * Ie, d))
        for (int64_t hh = 0; hh < H; ++hh) o[t * H + hh] += d[hh];
    }
  }
  static double dot(const double* a, const double* b, int64_t n) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int64_t i = 0; i < n; i += 4) {
      s0 += a[i] * b[i]; s1 += a[i + 1] * b[i + 1]; s2 += a[i + 2] * b[i + 2]; s3 += a[i + 3] * b[i + 3];
    }
    return (s0 + s1) + (s2 + s3);
  }
  std::vector<double> xb_row(int64_t t) const {
    std::vector<double> r(H);
    for (int64_t h = 0; h < H; ++h) r[h] = bf16_bits_to_f32(x[t * H + h]);
    return r;
  }
  const HostAdapter* adapter_of(int64_t t) const {
    if (adapter_ids.empty() || adapter_ids[t] < 0) return nullptr;
    return host_adapters[adapter_ids[t]];
  }

  // sigmoid(x_t . g) in double, from the bf16 x (not its NVFP4 rounding in A4).
  double gate_double(int64_t t) const {
    double z = 0.0;
    for (int64_t hh = 0; hh < H; ++hh) z += double(bf16_bits_to_f32(x[t * H + hh])) * double(bf16_bits_to_f32(gate[hh]));
    return 1.0 / (1.0 + std::exp(-z));
  }

  // The dense oracle: y[t] = sum over local experts chosen by t of w * o_e(t) (+ shared expert).
  // act_out, when given, receives [T, k, I] the activation of each chosen local slot (0 elsewhere).
  std::vector<double> dense(std::vector<double>* act_out = nullptr) const {
    std::vector<double> xin(T * H), in_scale(T, 1.0);
    for (int64_t i = 0; i < T * H; ++i) xin[i] = bf16_bits_to_f32(x[i]);
    if (c.mode == ActMode::A4) {
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> xf(xin.begin() + t * H, xin.begin() + (t + 1) * H);
        float gs = 1.f / fc1;
        in_scale[t] = fc1;
        if (c.per_token_x) {
          float amax = 0;
          for (float v : xf) amax = std::max(amax, std::fabs(v));
          gs = 2688.f / amax;
          in_scale[t] = 1.f / gs;
        }
        const std::vector<double> q = nvfp4_fake_quant_ref(xf.data(), H, gs);
        std::copy(q.begin(), q.end(), xin.begin() + t * H);
      }
    }
    const std::vector<double> ld(logits_f.begin(), logits_f.end()), bd(rbias.begin(), rbias.end());
    const RoutingResult r = route_double(c.shape.routing, ld, T, c.E_total, k, bd, c.shape.n_group, c.shape.topk_group,
                                         c.shape.routed_scaling_factor);
    if (act_out) act_out->assign(T * k * I, 0.0);
    std::vector<double> y(T * H, 0.0), o;
    for (int64_t e = 0; e < c.E_loc; ++e) {
      std::vector<int64_t> slot(T, -1);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < k; ++j)
          if (r.ids[t * k + j] == e + c.offset) slot[t] = j;
      dense_expert(w, e, false, params_of(e), xin, in_scale, slot, o, act_out);
      for (int64_t t = 0; t < T; ++t)
        if (slot[t] >= 0)
          for (int64_t hh = 0; hh < H; ++hh) y[t * H + hh] += r.w[t * k + slot[t]] * o[t * H + hh];
    }
    if (c.shared) {
      dense_expert(sw, 0, true, shared_params(), xin, in_scale, std::vector<int64_t>(T, 0), o, nullptr);
      for (int64_t t = 0; t < T; ++t) {
        const double gt = gate.empty() ? 1.0 : gate_double(t);
        for (int64_t hh = 0; hh < H; ++hh) y[t * H + hh] += gt * o[t * H + hh];
      }
    }
    return y;
  }
};

inline ModelShape shape_named(const char* name) {
  const ModelShape* s = find_model_shape(name);
  if (!s) throw std::runtime_error(std::string("unknown shape ") + name);
  return *s;
}

}  // namespace fp4moe::testutil
