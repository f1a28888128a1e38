// The problem of `fp4moe check` (check_setup.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")  // the host-side LoRA delta must round exactly like the reference
#endif

#include "check_setup.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "check_options.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace fp4moe::check {
namespace {

uint64_t shape_seed(const ModelShape& s) { return fnv1a(s.name.data(), s.name.size()) & 0xffffffffull; }

}  // namespace

LoraLayout adapter_layout(int a) {
  // Mostly PEFT fused (what transformers 5 writes), with SGLang/vLLM per-expert and shared-outer ones.
  static constexpr LoraLayout kLayouts[kNumAdapters] = {
      LoraLayout::PeftFused, LoraLayout::PerExpert,   LoraLayout::SharedOuter, LoraLayout::PeftFused,
      LoraLayout::PeftFused, LoraLayout::PerExpert,   LoraLayout::SharedOuter, LoraLayout::PeftFused};
  return kLayouts[a];
}

// FNV-1a 64 over bytes: the fingerprint compared across process launches.
uint64_t fnv1a(const void* data, size_t n, uint64_t h) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

ShapeSetup make_setup(const ModelShape& shape, int64_t experts, int64_t tokens, WeightFormat format) {
  ShapeSetup S;
  S.shape = &shape;
  S.E_loc = std::min(experts, shape.E_loc);
  // Expert parallelism (deepseek_v3_ep8): keep the shape's ratio of all experts to local ones, and
  // put this rank's window away from 0.
  S.E_total = S.E_loc * (shape.E / shape.E_loc);
  S.offset = shape.E > shape.E_loc ? S.E_loc : 0;
  S.T = tokens;
  S.H = shape.H;
  S.I = shape.I;
  S.k = shape.k;
  const uint64_t seed = shape_seed(shape);
  // kimi_k3_tp8's weights are up rows first (FlashInfer trtllm order); the others gate first.
  const GateUpOrder order = shape.routing == RoutingMethod::DeepSeekV3 && shape.n_group == 1 ? GateUpOrder::UpFirst
                                                                                              : GateUpOrder::GateFirst;
  S.layer = make_synthetic_layer(shape, S.E_loc, seed, format,
                                 /*with_bias=*/shape.activation == ActivationType::SwigluBias, order);
  S.x = random_bf16(S.T * S.H, seed + 1);
  S.logits = random_f32(S.T * S.E_total, seed + 2);
  if (shape.routing == RoutingMethod::DeepSeekV3 || shape.routing == RoutingMethod::MiniMax2)
    S.router_bias = random_f32(S.E_total, seed + 3, 0.1f);
  for (int a = 0; a < kNumAdapters; ++a)
    S.adapters.push_back(make_synthetic_adapter(S.layer, kRank, seed + 100 + a, adapter_layout(a)));
  if (shape.shared_I > 0) S.shared = make_synthetic_shared_expert(shape, shape.shared_I, seed + 400, format);
  // Small enough that x . g stays in sigmoid's sloped range, so the gate weighs each token differently.
  if (shape.shared_gate) S.shared_gate = random_bf16(S.H, seed + 401, 0.05f);
  for (LoraLayout l : {LoraLayout::PeftFused, LoraLayout::PerExpert, LoraLayout::SharedOuter})
    S.zero_b.push_back(make_synthetic_adapter(S.layer, kRank, seed + 200 + static_cast<int>(l), l, /*zero_b=*/true));

  const int64_t E = S.E_loc, H = S.H, N1 = S.layer.gated ? 2 * S.I : S.I, r = kRank;
  std::mt19937_64 rng(seed + 300);
  S.exact_a.assign(E * r * H, 0);
  S.exact_b.assign(E * N1 * r, 0);
  const uint16_t one = f32_to_bf16_bits(1.f), eighth = f32_to_bf16_bits(0.125f);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < r; ++i)
      S.exact_a[(e * r + i) * H + static_cast<int64_t>(rng() % H)] = (rng() & 1) ? one : (one | 0x8000);
    for (int64_t n = 0; n < N1; ++n)
      S.exact_b[(e * N1 + n) * r + static_cast<int64_t>(rng() % r)] = (rng() & 1) ? eighth : (eighth | 0x8000);
  }
  return S;
}

LoraAdapterDesc exact_adapter_desc(ShapeSetup& S) {
  LoraAdapterDesc d;
  d.layout = LoraLayout::PeftFused;
  d.rank = kRank;
  d.lora_alpha = static_cast<float>(kRank);  // scale 1
  const int64_t N1 = S.layer.gated ? 2 * S.I : S.I;
  d.a_gate_up = make_view(S.exact_a.data(), DType::BF16, {S.E_loc, kRank, S.H});
  d.b_gate_up = make_view(S.exact_b.data(), DType::BF16, {S.E_loc, N1, kRank});
  return d;  // no down projection: a gate_up-only adapter
}

Config make_config(const ShapeSetup& S, ActivationType act, ActMode mode) {
  Config c;
  c.act = act;
  c.mode = mode;
  const int64_t E = S.E_loc;
  if (act == S.shape->activation) {
    c.alpha = S.layer.alpha;
    c.beta = S.layer.beta;
    c.clamp = S.layer.clamp;
  }
  if (act == ActivationType::Situ) {
    // Kimi-K3's alpha 4, beta 25, varied per expert (the original note: per-expert beta).
    c.alpha.resize(E);
    c.beta.resize(E);
    for (int64_t e = 0; e < E; ++e) {
      c.alpha[e] = 4.f + 0.25f * static_cast<float>(e % 4);
      c.beta[e] = 25.f - static_cast<float>(e % 5);
    }
    c.clamp.clear();
  }
  if (mode == ActMode::A4) {
    float amax = 0;
    for (uint16_t v : S.x) amax = std::max(amax, std::fabs(bf16_bits_to_f32(v)));
    c.fc1_scale = amax / (448.f * 6.f);
    // The FC2 input is O(1) with tails to ~10 for both activations on these weights; larger values
    // saturate identically in the backend and the oracle.
    c.fc2_scale = 12.f / (448.f * 6.f);
  }
  c.name = std::string(S.shape->name) + " " + lower(to_string(act)) + (mode == ActMode::A4 ? " A4" : " A16");
  return c;
}

std::vector<uint16_t> host_gate_up_delta(const ShapeSetup& S, const PreparedAdapter& ad, const std::vector<int32_t>& ids) {
  const int64_t T = S.T, H = S.H, k = S.k, N1 = ad.N1, r1 = ad.r1;
  std::vector<uint16_t> out(T * k * N1, 0);
  std::vector<float> tmp(static_cast<size_t>(r1));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t * k + j] - S.offset;
      if (e < 0 || e >= S.E_loc) continue;  // another rank's expert: the slot is skipped anyway
      const uint16_t* A = ad.A1.data() + (ad.a1_shared ? 0 : e) * r1 * H;
      const uint16_t* B = ad.B1.data() + e * N1 * r1;
      for (int64_t i = 0; i < r1; ++i) {
        float acc = 0;
        for (int64_t h = 0; h < H; ++h) acc += bf16_bits_to_f32(S.x[t * H + h]) * bf16_bits_to_f32(A[i * H + h]);
        tmp[i] = round_bf16(acc);
      }
      for (int64_t n = 0; n < N1; ++n) {
        float acc = 0;
        for (int64_t i = 0; i < r1; ++i) acc += tmp[i] * bf16_bits_to_f32(B[n * r1 + i]);
        out[(t * k + j) * N1 + n] = f32_to_bf16_bits(acc);
      }
    }
  return out;
}

std::vector<std::vector<int64_t>> request_rows(int64_t T) {
  std::vector<std::vector<int64_t>> rows(kNumRequests);
  for (int q = 0; q < kNumRequests; ++q)
    for (int64_t t = q * T / kNumRequests; t < (q + 1) * T / kNumRequests; ++t) rows[q].push_back(t);
  return rows;
}
std::vector<int32_t> request_ids(int64_t T) {
  std::vector<int32_t> ids(T);
  const auto rows = request_rows(T);
  for (int q = 0; q < kNumRequests; ++q)
    for (int64_t t : rows[q]) ids[t] = kRequestAdapter[q];
  return ids;
}

void load_adapters(AdapterRegistry& reg, ShapeSetup& S) {
  for (int a = 0; a < kNumAdapters; ++a) reg.load(a, S.adapters[a].desc());
}

}  // namespace fp4moe::check
