// Multi-LoRA (SPEC §5) and the bridges through the whole CPU operator against the dense oracle of
// dense_problem.h: every adapter layout in one batch (A16, A4, fp64), a zero-B adapter equal to base bit for bit, the
// base tokens of a mixed batch equal to base alone, the gate_up delta and activation_out bridges, chunking.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "dense_problem.h"
#include "fp4moe/moe.h"
#include "test_util.h"

using namespace fp4moe;
using namespace fp4moe::testutil;

namespace {

// ---- multi-LoRA (SPEC §5) and bridges ------------------------------------------------------------------
namespace lora {

Case lora_case(ActMode mode, Precision prec) {
  // qwen3_30b_a3b_tp4 shape, E reduced 128 -> 16, up_first weights (the registry reorders B1), a shared
  // expert with its own LoRA.
  Case c{.name = "lora qwen3_30b_a3b_tp4", .shape = shape_named("qwen3_30b_a3b_tp4")};
  c.E_total = c.E_loc = 16;
  c.T = 8;
  c.order = GateUpOrder::UpFirst;
  c.bias = true;
  c.mode = mode;
  c.shared = true;
  c.shared_I = 192;
  c.precision = prec;
  if (prec == Precision::Fp64) { c.y_dtype = DType::F64; c.tol = 1e-6; }
  else c.tol = mode == ActMode::A4 ? 2e-2 : 1e-2;
  c.seed = 60;
  return c;
}

// Loads PeftFused (with a shared-expert LoRA) in slot 0, PerExpert in slot 1, SharedOuter in slot 3.
void load_adapters(Problem& p, std::vector<std::unique_ptr<HostAdapter>>& store, bool zero_b) {
  const bool gated = is_gated(p.c.shape.activation);
  store.push_back(std::make_unique<HostAdapter>(LoraLayout::PeftFused, 8, p.c.E_loc, p.H, p.I, gated, 71, zero_b, p.c.shared_I));
  store.push_back(std::make_unique<HostAdapter>(LoraLayout::PerExpert, 4, p.c.E_loc, p.H, p.I, gated, 72, zero_b, 0));
  store.push_back(std::make_unique<HostAdapter>(LoraLayout::SharedOuter, 16, p.c.E_loc, p.H, p.I, gated, 73, zero_b, 0));
  p.registry = std::make_unique<AdapterRegistry>(p.mw, 4, p.c.shared ? &p.msw : nullptr);
  p.host_adapters = {store[0].get(), store[1].get(), nullptr, store[2].get()};
  p.registry->load(0, store[0]->desc());
  p.registry->load(1, store[1]->desc());
  p.registry->load(3, store[2]->desc());
}

void lora_vs_dense(ActMode mode, Precision prec) {
  Problem p(lora_case(mode, prec));
  std::vector<std::unique_ptr<HostAdapter>> store;
  const std::vector<double> base = p.dense();
  load_adapters(p, store, false);
  p.adapter_ids = {-1, 0, 1, 3, 0, 1, 3, -1};
  const std::vector<double> got = p.run(2), want = p.dense();
  const double err = rel_l2(got, want), effect = rel_l2(base, want);
  std::printf("[ lora     ] mode %s %s: rel_l2 %.3e (tol %.0e); LoRA changes y by %.3f\n",
              mode == ActMode::A4 ? "A4" : "A16", prec == Precision::Fp64 ? "Fp64" : "Fp32", err, p.c.tol, effect);
  EXPECT_EQ(count_nonfinite(got), 0u);
  EXPECT_LE(err, p.c.tol);
  EXPECT_GT(effect, 0.05);  // the adapters matter: a dropped delta would fail
  // Per token too (each layout has its own tokens).
  for (int64_t t = 0; t < p.T; ++t) {
    std::vector<double> g(got.begin() + t * p.H, got.begin() + (t + 1) * p.H), w(want.begin() + t * p.H, want.begin() + (t + 1) * p.H);
    EXPECT_LE(rel_l2(g, w), 2 * p.c.tol) << "token " << t << " adapter " << p.adapter_ids[t];
  }
}

TEST(ReferenceLora, AllLayoutsMatchDenseA16) { lora_vs_dense(ActMode::A16, Precision::Fp32); }
TEST(ReferenceLora, AllLayoutsMatchDenseA4) { lora_vs_dense(ActMode::A4, Precision::Fp32); }
TEST(ReferenceLora, AllLayoutsMatchDenseFp64) { lora_vs_dense(ActMode::A16, Precision::Fp64); }

TEST(ReferenceLora, ZeroBAdapterIsBitIdenticalToBase) {
  for (ActMode mode : {ActMode::A16, ActMode::A4}) {
    Problem p(lora_case(mode, Precision::Fp32));
    std::vector<uint8_t> base, with;
    p.run(2, &base);
    std::vector<std::unique_ptr<HostAdapter>> store;
    load_adapters(p, store, /*zero_b=*/true);
    p.adapter_ids = {0, 1, 3, 0, 1, 3, 0, 1};
    p.run(2, &with);
    EXPECT_EQ(base, with) << (mode == ActMode::A4 ? "A4" : "A16");
  }
}

TEST(ReferenceLora, BaseTokensInMixedBatchEqualBase) {
  Problem p(lora_case(ActMode::A16, Precision::Fp32));
  std::vector<uint8_t> base, mixed;
  p.run(2, &base);
  std::vector<std::unique_ptr<HostAdapter>> store;
  load_adapters(p, store, false);
  p.adapter_ids = {-1, 0, -1, 3, 1, -1, 0, -1};
  p.run(2, &mixed);
  for (int64_t t = 0; t < p.T; ++t) {
    const bool same = std::memcmp(base.data() + t * p.H * 2, mixed.data() + t * p.H * 2, p.H * 2) == 0;
    EXPECT_EQ(same, p.adapter_ids[t] < 0) << "token " << t;
  }
  // Unloading a slot no token uses changes nothing.
  std::vector<uint8_t> after;
  p.adapter_ids = {-1, 0, -1, 0, 1, -1, 0, -1};
  p.run(2, &mixed);
  p.registry->unload(3);
  p.run(2, &after);
  EXPECT_EQ(mixed, after);
}

TEST(ReferenceBridges, GateUpDeltaAndActivationOut) {
  // gpt_oss_120b shape (E reduced to 8 of 16: slots on the other rank get activation_out = 0), SwigluBias.
  Case c{.name = "bridges gpt_oss_120b", .shape = shape_named("gpt_oss_120b")};
  c.E_total = 16;
  c.E_loc = 8;
  c.offset = 8;
  c.T = 4;
  c.bias = true;
  c.seed = 80;
  Problem p(c);
  std::vector<uint8_t> plain, zero_bridge;
  p.run(2, &plain);
  p.bridge.assign(p.T * p.k * p.N1, 0);  // an all-zero bridge runs the same pipeline
  p.run(2, &zero_bridge);
  EXPECT_EQ(plain, zero_bridge);

  p.bridge = random_bf16_vec(p.T * p.k * p.N1, 81, -0.5f, 0.5f);
  p.act_out.assign(p.T * p.k * p.I, kBf16Poison);
  std::vector<double> want_act;
  const std::vector<double> got = p.run(2), want = p.dense(&want_act);
  EXPECT_LE(rel_l2(got, want), 1e-2);
  EXPECT_GT(rel_l2(bf16_to_double(std::vector<uint16_t>(reinterpret_cast<uint16_t*>(plain.data()),
                                                        reinterpret_cast<uint16_t*>(plain.data()) + p.T * p.H)),
                   want), 0.02);  // the bridge matters
  EXPECT_EQ(count_poison(p.act_out), 0u);
  const std::vector<double> act = bf16_to_double(p.act_out);
  EXPECT_LE(rel_l2(act, want_act), 1e-2);
  // Non-local slots are exactly 0 in both (the dense leaves them 0).
  int64_t nonlocal = 0;
  for (int64_t s = 0; s < p.T * p.k; ++s) {
    bool zero = true;
    for (int64_t i = 0; i < p.I; ++i) zero = zero && act[s * p.I + i] == 0.0 && want_act[s * p.I + i] == 0.0;
    nonlocal += zero;
  }
  EXPECT_GT(nonlocal, 0);  // the window really drops some slots
}

TEST(ReferenceBridges, BridgeAndRegistryLoraAddUp) {
  Problem p(lora_case(ActMode::A16, Precision::Fp32));
  std::vector<std::unique_ptr<HostAdapter>> store;
  load_adapters(p, store, false);
  p.adapter_ids = {0, 1, 3, -1, 0, 1, 3, -1};
  p.bridge = random_bf16_vec(p.T * p.k * p.N1, 82, -0.5f, 0.5f);
  EXPECT_LE(rel_l2(p.run(2), p.dense()), 1e-2);
}



// Chunking the tokens (reference::run_chunked; run() chunks large batches to bound its memory) changes
// no bit, also with adapters, a bridge and activation_out.
TEST(ReferenceLora, TokenChunksChangeNothing) {
  Problem p(lora_case(ActMode::A4, Precision::Fp32));
  std::vector<std::unique_ptr<HostAdapter>> store;
  load_adapters(p, store, false);
  p.adapter_ids = {0, 1, 3, -1, 0, 1, 3, -1};
  p.bridge = random_bf16_vec(p.T * p.k * p.N1, 83, -0.5f, 0.5f);
  p.act_out.assign(p.T * p.k * p.I, kBf16Poison);
  std::vector<uint8_t> whole;
  p.run(2, &whole);
  const std::vector<uint16_t> act_whole = p.act_out;
  for (int64_t chunk : {int64_t(1), int64_t(3), int64_t(5)}) {
    std::vector<uint16_t> y(p.T * p.H, kBf16Poison);
    std::fill(p.act_out.begin(), p.act_out.end(), kBf16Poison);
    MoeArgs a = p.args(p.x, p.T, p.logits_f.data(), nullptr, y.data(), 2);
    reference::run_chunked(p.mw.impl(), a, p.registry->snapshot(), chunk);
    EXPECT_EQ(0, std::memcmp(y.data(), whole.data(), whole.size())) << "chunk " << chunk;
    EXPECT_EQ(p.act_out, act_whole) << "chunk " << chunk;
  }
}

}  // namespace lora
}  // namespace
