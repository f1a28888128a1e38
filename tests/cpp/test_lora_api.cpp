// The LoRA identities of SPEC §4-§5 through the public API (CPU backend): a zero-B adapter equals base bit for
// bit, other slots' loads change nothing, a mixed batch's base tokens equal base alone, and the gate_up bridge
// equals the fused LoRA. The registry's own tests: test_lora.cpp.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")  // the bridge test repeats the reference's fp32 sums exactly
#endif
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "bf16_tensor.h"
#include "fp4moe/moe.h"
#include "fp4moe/quantize.h"
#include "runtime/prepared.h"

using namespace fp4moe;
using fp4moe::testutil::Bf16;
using fp4moe::testutil::rand_bf16;

namespace {

struct ApiLayer {
  int64_t T = 10, H = 64, I = 32, E = 6, k = 2, Is = 48;
  GateUpOrder order;
  OwnedWeights w_own, s_own;
  MoeWeights w, shared;
  std::vector<uint16_t> x;
  std::vector<float> logits;

  explicit ApiLayer(GateUpOrder o, uint32_t seed) : order(o) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.f, 0.1f);
    auto fill = [&](int64_t n) {
      std::vector<float> v(static_cast<size_t>(n));
      for (auto& f : v) f = dist(rng);
      return v;
    };
    QuantizeOptions opt;
    opt.order = o;
    std::vector<float> w1 = fill(E * 2 * I * H), w2 = fill(E * H * I);
    w_own = quantize_weights(make_view(w1.data(), DType::F32, {E, 2 * I, H}), make_view(w2.data(), DType::F32, {E, H, I}),
                             opt);
    std::vector<float> s1 = fill(2 * Is * H), s2 = fill(H * Is);
    opt.order = GateUpOrder::GateFirst;
    s_own = quantize_weights(make_view(s1.data(), DType::F32, {1, 2 * Is, H}),
                             make_view(s2.data(), DType::F32, {1, H, Is}), opt);
    w = prepare_weights(w_own.desc(), Backend::CPU);
    shared = prepare_weights(s_own.desc(), Backend::CPU);
    x.resize(static_cast<size_t>(T * H));
    std::uniform_real_distribution<float> u(-2.f, 2.f);
    for (auto& b : x) b = f32_to_bf16_bits(u(rng));
    logits.resize(static_cast<size_t>(T * E));
    for (auto& l : logits) l = u(rng);
  }

  // Runs the layer on tokens [t0, t0 + n); ids == nullptr: no registry at all.
  std::vector<uint16_t> run(const AdapterRegistry* reg, const std::vector<int32_t>* ids, bool with_shared,
                            const std::vector<uint16_t>* delta = nullptr, int64_t t0 = 0, int64_t n = -1) {
    if (n < 0) n = T;
    std::vector<uint16_t> y(static_cast<size_t>(n * H), 0x7fc1);
    MoeArgs a;
    a.x = make_view(x.data() + t0 * H, DType::BF16, {n, H});
    a.routing.method = RoutingMethod::Renormalize;
    a.routing.top_k = k;
    a.routing.logits = make_view(logits.data() + t0 * E, DType::F32, {n, E});
    a.activation.type = ActivationType::Swiglu;
    a.shared_expert = with_shared ? &shared : nullptr;
    std::vector<int32_t> id_part;
    if (reg) {
      a.adapters = reg;
      id_part.assign(ids->begin() + t0, ids->begin() + t0 + n);
      a.adapter_ids = make_view(id_part.data(), DType::I32, {n});
    }
    if (delta) a.gate_up_lora_delta = make_view(const_cast<uint16_t*>(delta->data()), DType::BF16, {n, k, 2 * I});
    a.y = make_view(y.data(), DType::BF16, {n, H});
    a.num_threads = 2;
    moe_run(w, a);
    return y;
  }
};

// A full adapter in `layout` (both projections and the shared expert's LoRA); zero_b: every B is zero.
struct ApiAdapter {
  Bf16 ag, au, bg, bu, agu, bgu, ad, bd, sa, sb, sad, sbd;
  LoraAdapterDesc d;
  ApiAdapter(const ApiLayer& L, LoraLayout layout, int64_t r, bool zero_b, uint32_t seed, bool gate_up_only = false) {
    const int64_t E = L.E, H = L.H, I = L.I;
    const float bs = zero_b ? 0.f : 0.3f;
    auto B = [&](std::vector<int64_t> shape, uint32_t s) {
      Bf16 t = rand_bf16(std::move(shape), s, 1.f);
      if (zero_b) std::fill(t.bits.begin(), t.bits.end(), uint16_t(0));
      else for (auto& b : t.bits) b = f32_to_bf16_bits(bf16_bits_to_f32(b) * bs);
      return t;
    };
    ag = rand_bf16({E, r, H}, seed + 1, 0.2f);
    au = rand_bf16({E, r, H}, seed + 2, 0.2f);
    bg = B({E, I, r}, seed + 3);
    bu = B({E, I, r}, seed + 4);
    agu = layout == LoraLayout::SharedOuter ? rand_bf16({r, H}, seed + 5, 0.2f) : rand_bf16({E, r, H}, seed + 5, 0.2f);
    bgu = B({E, 2 * I, r}, seed + 6);
    ad = rand_bf16({E, r, I}, seed + 7, 0.2f);
    bd = layout == LoraLayout::SharedOuter ? B({H, r}, seed + 8) : B({E, H, r}, seed + 8);
    sa = rand_bf16({r, H}, seed + 9, 0.2f);
    sb = B({2 * L.Is, r}, seed + 10);
    sad = rand_bf16({r, L.Is}, seed + 11, 0.2f);
    sbd = B({H, r}, seed + 12);
    d.layout = layout;
    d.rank = r;
    d.lora_alpha = 2.f * r;
    if (layout == LoraLayout::PerExpert) {
      d.a_gate = ag.view(); d.a_up = au.view(); d.b_gate = bg.view(); d.b_up = bu.view();
    } else {
      d.a_gate_up = agu.view(); d.b_gate_up = bgu.view();
    }
    if (!gate_up_only) {
      d.a_down = ad.view(); d.b_down = bd.view();
      d.shared_a_gate_up = sa.view(); d.shared_b_gate_up = sb.view();
      d.shared_a_down = sad.view(); d.shared_b_down = sbd.view();
    }
  }
};

std::vector<uint16_t> row(const std::vector<uint16_t>& y, int64_t t, int64_t H) {
  return std::vector<uint16_t>(y.begin() + t * H, y.begin() + (t + 1) * H);
}

}  // namespace

TEST(LoraApi, ZeroBAdapterEqualsBaseBitForBit) {
  for (GateUpOrder order : {GateUpOrder::GateFirst, GateUpOrder::UpFirst}) {
    ApiLayer L(order, 31);
    for (bool with_shared : {false, true}) {
      const std::vector<uint16_t> base = L.run(nullptr, nullptr, with_shared);
      AdapterRegistry reg(L.w, 8, &L.shared);
      std::vector<ApiAdapter> ads;
      int slot = 0;
      for (LoraLayout layout : {LoraLayout::PerExpert, LoraLayout::PeftFused, LoraLayout::SharedOuter}) {
        ads.emplace_back(L, layout, 4, true, 100 + slot);
        reg.load(slot++, ads.back().d);
      }
      for (int s = 0; s < slot; ++s) {
        std::vector<int32_t> ids(static_cast<size_t>(L.T), s);
        EXPECT_EQ(L.run(&reg, &ids, with_shared), base) << "slot " << s << " order " << int(order);
      }
      std::vector<int32_t> none(static_cast<size_t>(L.T), -1);
      EXPECT_EQ(L.run(&reg, &none, with_shared), base);
      // A non-zero adapter does change the output (the identity above is not vacuous).
      ApiAdapter nz(L, LoraLayout::PeftFused, 4, false, 500);
      reg.load(7, nz.d);
      std::vector<int32_t> seven(static_cast<size_t>(L.T), 7);
      EXPECT_NE(L.run(&reg, &seven, with_shared), base);
    }
  }
}

TEST(LoraApi, LoadingAndUnloadingOtherAdaptersChangesNothing) {
  ApiLayer L(GateUpOrder::GateFirst, 32);
  AdapterRegistry reg(L.w, 8, &L.shared);
  ApiAdapter a0(L, LoraLayout::PerExpert, 3, false, 10), a1(L, LoraLayout::SharedOuter, 5, false, 20),
      a2(L, LoraLayout::PeftFused, 8, false, 30), a3(L, LoraLayout::PeftFused, 16, false, 40);
  reg.load(0, a0.d);
  reg.load(1, a1.d);
  std::vector<int32_t> ids = {0, -1, 1, 0, -1, 1, 1, -1, 0, 0};
  const std::vector<uint16_t> before = L.run(&reg, &ids, true);
  reg.load(2, a2.d);
  reg.load(5, a3.d);
  EXPECT_EQ(L.run(&reg, &ids, true), before);
  reg.unload(2);
  EXPECT_EQ(L.run(&reg, &ids, true), before);
  reg.load(3, a2.d);
  reg.unload(5);
  EXPECT_EQ(L.run(&reg, &ids, true), before);
  // Reloading slot 1 with the same adapter gives the same bits again.
  reg.unload(1);
  reg.load(1, a1.d);
  EXPECT_EQ(L.run(&reg, &ids, true), before);
}

TEST(LoraApi, MixedBatchBaseTokensEqualBaseAlone) {
  ApiLayer L(GateUpOrder::UpFirst, 33);
  AdapterRegistry reg(L.w, 4, &L.shared);
  ApiAdapter a0(L, LoraLayout::PerExpert, 2, false, 50), a1(L, LoraLayout::SharedOuter, 7, false, 60),
      a2(L, LoraLayout::PeftFused, 64, false, 70);
  reg.load(0, a0.d);
  reg.load(1, a1.d);
  reg.load(3, a2.d);
  std::vector<int32_t> ids = {-1, 0, 1, -1, 3, 3, -1, 1, 0, -1};
  for (bool with_shared : {false, true}) {
    const std::vector<uint16_t> mixed = L.run(&reg, &ids, with_shared);
    const std::vector<uint16_t> base = L.run(nullptr, nullptr, with_shared);
    for (int64_t t = 0; t < L.T; ++t) {
      if (ids[t] >= 0) {
        EXPECT_NE(row(mixed, t, L.H), row(base, t, L.H)) << "token " << t << " should carry its adapter";
        continue;
      }
      EXPECT_EQ(row(mixed, t, L.H), row(base, t, L.H)) << "token " << t;
      const std::vector<uint16_t> alone = L.run(nullptr, nullptr, with_shared, nullptr, t, 1);
      EXPECT_EQ(row(mixed, t, L.H), alone) << "token " << t;
    }
  }
}

TEST(LoraApi, GateUpBridgeEqualsFusedLora) {
  for (GateUpOrder order : {GateUpOrder::GateFirst, GateUpOrder::UpFirst})
    for (LoraLayout layout : {LoraLayout::PerExpert, LoraLayout::PeftFused, LoraLayout::SharedOuter}) {
      ApiLayer L(order, 34);
      AdapterRegistry reg(L.w, 2);
      ApiAdapter ad(L, layout, 6, false, 80, /*gate_up_only=*/true);
      reg.load(1, ad.d);
      std::vector<int32_t> ids(static_cast<size_t>(L.T), 1);
      const std::vector<uint16_t> fused = L.run(&reg, &ids, false);

      // The bridge delta, computed here from the canonical adapter with the SPEC's roundings:
      // t = bf16(x . A1_e^T), dh = bf16(t . B1_e^T), fp32 sums in index order.
      std::vector<int32_t> topk(static_cast<size_t>(L.T * L.k));
      std::vector<float> topw(static_cast<size_t>(L.T * L.k));
      RoutingArgs ra;
      ra.method = RoutingMethod::Renormalize;
      ra.top_k = L.k;
      ra.logits = make_view(L.logits.data(), DType::F32, {L.T, L.E});
      route(ra, L.E, make_view(topk.data(), DType::I32, {L.T, L.k}), make_view(topw.data(), DType::F32, {L.T, L.k}));
      const PreparedAdapter& a = *(*reg.snapshot())[1];
      const int64_t N1 = 2 * L.I;
      std::vector<uint16_t> delta(static_cast<size_t>(L.T * L.k * N1));
      for (int64_t t = 0; t < L.T; ++t)
        for (int64_t j = 0; j < L.k; ++j) {
          const int64_t e = topk[t * L.k + j];
          const uint16_t* A1 = a.A1.data() + (a.a1_shared ? 0 : e) * a.r1 * L.H;
          const uint16_t* B1 = a.B1.data() + e * N1 * a.r1;
          std::vector<float> tv(static_cast<size_t>(a.r1));
          for (int64_t c = 0; c < a.r1; ++c) {
            float acc = 0.f;
            for (int64_t h = 0; h < L.H; ++h) {
              const float p = bf16_bits_to_f32(L.x[t * L.H + h]) * bf16_bits_to_f32(A1[c * L.H + h]);
              acc += p;
            }
            tv[c] = round_bf16(acc);
          }
          for (int64_t n = 0; n < N1; ++n) {
            float acc = 0.f;
            for (int64_t c = 0; c < a.r1; ++c) {
              const float p = tv[c] * bf16_bits_to_f32(B1[n * a.r1 + c]);
              acc += p;
            }
            delta[(t * L.k + j) * N1 + n] = f32_to_bf16_bits(acc);
          }
        }
      const std::vector<uint16_t> bridged = L.run(nullptr, nullptr, false, &delta);
      EXPECT_EQ(bridged, fused) << "order " << int(order) << " layout " << int(layout);
      EXPECT_NE(bridged, L.run(nullptr, nullptr, false)) << "the delta must matter";
    }
}
