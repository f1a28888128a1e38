// The sigmoid-gated shared expert (Qwen2-MoE, Qwen3-Next; SPEC §3.3): y_t += sigmoid(x_t . g) * shared(x_t).
// The host/device-identical math (exp_ieee, sigmoid_ieee, the logit's fixed order) against double and an independent
// fold of the documented order; the whole CPU operator against the dense double oracle of dense_problem.h (A16, A4,
// Fp64, with LoRA); bad gates named; TP and EP against the single rank; chunks and batches bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "common/activation.h"
#include "common/shared_gate.h"
#include "dense_problem.h"
#include "fp4moe/parallel.h"
#include "reference/reference.h"
#include "test_helpers.h"
#include "test_util.h"

using namespace fp4moe;
using namespace fp4moe::testutil;

namespace {

// ---- the math -----------------------------------------------------------------------------------------------

TEST(SharedGateMath, ExpIeeeWithin4e7OfDouble) {
  double worst = 0;
  for (double v = -87.9; v < 88.7; v += 0.0137) {
    const float f = static_cast<float>(v);
    const double want = std::exp(static_cast<double>(f));
    const double rel = std::fabs(static_cast<double>(act::exp_ieee(f)) - want) / want;
    worst = std::max(worst, rel);
  }
  std::printf("[ exp_ieee ] worst relative error %.3g\n", worst);
  EXPECT_LT(worst, 4e-7);
  EXPECT_EQ(act::exp_ieee(0.f), 1.f);
  EXPECT_EQ(act::exp_ieee(89.f), INFINITY);
  EXPECT_EQ(act::exp_ieee(INFINITY), INFINITY);
  EXPECT_EQ(act::exp_ieee(-88.f), 0.f);
  EXPECT_EQ(act::exp_ieee(-INFINITY), 0.f);
  EXPECT_TRUE(std::isnan(act::exp_ieee(NAN)));
}

TEST(SharedGateMath, SigmoidIeeeWithin3e7OfDouble) {
  double worst = 0;
  for (double v = -30; v < 30; v += 0.00731) {
    const float f = static_cast<float>(v);
    const double want = 1.0 / (1.0 + std::exp(-static_cast<double>(f)));
    worst = std::max(worst, std::fabs(static_cast<double>(act::sigmoid_ieee(f)) - want) / want);
  }
  std::printf("[ sigmoid  ] worst relative error %.3g\n", worst);
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(act::sigmoid_ieee(0.f), 0.5f);
  EXPECT_EQ(act::sigmoid_ieee(INFINITY), 1.f);
  EXPECT_EQ(act::sigmoid_ieee(-INFINITY), 0.f);
  EXPECT_EQ(act::sigmoid_ieee(-200.f), 0.f);
  EXPECT_EQ(act::sigmoid_ieee(200.f), 1.f);
  EXPECT_TRUE(std::isnan(act::sigmoid_ieee(NAN)));
}

// The documented order (docs/numerics.md), written again independently: element i goes to lane (i / 8) % 32, each
// lane adds its elements in index order, then the 32 partials fold pairwise as a binary tree over lanes.
float logit_by_the_doc(const std::vector<uint16_t>& x, const std::vector<uint16_t>& g) {
  std::vector<float> lane(32, 0.f);
  for (size_t i = 0; i < x.size(); ++i) {
    volatile float prod = bf16_bits_to_f32(x[i]) * bf16_bits_to_f32(g[i]);
    lane[(i / 8) % 32] += prod;
  }
  for (size_t width = 32; width > 1; width /= 2)
    for (size_t l = 0; l < width / 2; ++l) lane[l] += lane[l + width / 2];
  return lane[0];
}

TEST(SharedGateMath, GateFollowsTheDocumentedOrder) {
  for (int64_t H : {16, 64, 2048, 2880, 7168}) {
    // Wide dynamic range, so that another order would round differently.
    std::mt19937_64 rng(static_cast<uint64_t>(H));
    std::vector<uint16_t> x(static_cast<size_t>(H)), g(static_cast<size_t>(H));
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::uniform_int_distribution<int> ex(-12, 12);
    for (int64_t i = 0; i < H; ++i) {
      x[i] = f32_to_bf16_bits(std::ldexp(u(rng), ex(rng)));
      g[i] = f32_to_bf16_bits(u(rng) * 0.05f);
    }
    const float z = logit_by_the_doc(x, g);
    const float got = shared_gate::gate_host(x.data(), g.data(), H);
    EXPECT_EQ(got, act::sigmoid_ieee(z)) << "H=" << H;
    // And a serial sum gives another logit on these inputs (the order is a real constraint): for the large H.
    if (H >= 2048) {
      float serial = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        volatile float prod = bf16_bits_to_f32(x[i]) * bf16_bits_to_f32(g[i]);
        serial += prod;
      }
      EXPECT_NE(serial, z) << "H=" << H << ": pick inputs where the order matters";
    }
  }
}

// ---- the operator against the dense double oracle ---------------------------------------------------------------

Case gated_case(ActMode mode, Precision prec, uint64_t seed) {
  // qwen3_next_80b_a3b: H 2048, I 512, shared I 512, k 10; E reduced 512 -> 16.
  Case c{.name = "qwen3_next gated shared", .shape = shape_named("qwen3_next_80b_a3b")};
  c.E_total = c.E_loc = 16;
  c.T = 5;
  c.mode = mode;
  c.shared = true;
  c.shared_I = c.shape.shared_I;
  c.shared_gate = true;
  c.precision = prec;
  if (prec == Precision::Fp64) {
    c.y_dtype = DType::F64;
    c.tol = 1e-6;
  } else {
    c.tol = mode == ActMode::A4 ? 2e-2 : 1e-2;
  }
  c.seed = seed;
  return c;
}

// The run against the oracle with the gate, and the gate's own effect (an operator that ignored it would fail).
void gated_vs_dense(Problem& p, const std::vector<double>& got) {
  const std::vector<double> want = p.dense();
  std::vector<uint16_t> gate = p.gate;
  p.gate.clear();
  const std::vector<double> ungated = p.dense();
  p.gate = gate;
  const double err = rel_l2(got, want), effect = rel_l2(ungated, want);
  std::printf("[ gated    ] %s %s: rel_l2 %.3e (tol %.0e); the gate moves y by %.3f\n",
              p.c.mode == ActMode::A4 ? "A4" : "A16", p.c.precision == Precision::Fp64 ? "Fp64" : "Fp32", err, p.c.tol,
              effect);
  EXPECT_EQ(count_nonfinite(got), 0u);
  EXPECT_LE(err, p.c.tol);
  EXPECT_GT(effect, 10 * p.c.tol);
}

TEST(SharedGate, Qwen3NextMatchesDenseA16) {
  Problem p(gated_case(ActMode::A16, Precision::Fp32, 90));
  gated_vs_dense(p, p.run(2));
}

TEST(SharedGate, Qwen3NextMatchesDenseA4) {
  Problem p(gated_case(ActMode::A4, Precision::Fp32, 91));
  gated_vs_dense(p, p.run(2));
}

TEST(SharedGate, Qwen3NextMatchesDenseFp64) {
  Problem p(gated_case(ActMode::A16, Precision::Fp64, 92));
  gated_vs_dense(p, p.run(2));
}

TEST(SharedGate, WithLoraOnTheSharedExpertMatchesDense) {
  // The shared expert's own LoRA is part of shared(x): the gate scales it too.
  Problem p(gated_case(ActMode::A16, Precision::Fp32, 93));
  std::vector<std::unique_ptr<HostAdapter>> store;
  const bool gated = is_gated(p.c.shape.activation);
  store.push_back(std::make_unique<HostAdapter>(LoraLayout::PeftFused, 8, p.c.E_loc, p.H, p.I, gated, 94, false,
                                                p.c.shared_I));
  p.registry = std::make_unique<AdapterRegistry>(p.mw, 2, &p.msw);
  p.host_adapters = {store[0].get(), nullptr};
  p.registry->load(0, store[0]->desc());
  p.adapter_ids = {0, -1, 0, 0, -1};
  gated_vs_dense(p, p.run(2));
}

TEST(SharedGate, GateShapesOneAndTwoDimsAgreeBitForBit) {
  Problem p(gated_case(ActMode::A16, Precision::Fp32, 95));
  std::vector<uint8_t> two, one;
  p.run(2, &two);
  std::vector<uint16_t> y(static_cast<size_t>(p.T * p.H));
  MoeArgs a = p.args(p.x, p.T, p.logits_f.data(), nullptr, y.data(), 2);
  a.shared_expert_gate = make_view(p.gate.data(), DType::BF16, {p.H});
  moe_run(p.mw, a);
  EXPECT_EQ(0, std::memcmp(y.data(), two.data(), two.size()));
}

TEST(SharedGate, ChunksAndBatchesChangeNoBit) {
  Problem p(gated_case(ActMode::A16, Precision::Fp32, 96));
  p.c.T = p.T = 7;
  p.x = random_bf16_vec(p.T * p.H, 961);
  p.logits_f = random_f32_vec(p.T * p.c.E_total, 962, -3.f, 3.f);
  std::vector<uint8_t> whole;
  p.run(2, &whole);
  for (int64_t chunk : {1, 3}) {
    std::vector<uint16_t> y(static_cast<size_t>(p.T * p.H), kBf16Poison);
    const MoeArgs a = p.args(p.x, p.T, p.logits_f.data(), nullptr, y.data(), 2);
    reference::run_chunked(p.mw.impl(), a, nullptr, chunk);
    EXPECT_EQ(0, std::memcmp(y.data(), whole.data(), whole.size())) << "chunk " << chunk;
  }
  const int64_t t = 4;  // one token alone
  std::vector<uint16_t> xt(p.x.begin() + t * p.H, p.x.begin() + (t + 1) * p.H), y(static_cast<size_t>(p.H));
  moe_run(p.mw, p.args(xt, 1, p.logits_f.data() + t * p.c.E_total, nullptr, y.data(), 1));
  EXPECT_EQ(0, std::memcmp(y.data(), whole.data() + t * p.H * 2, p.H * 2));
}

// ---- bad gates -----------------------------------------------------------------------------------------------

TEST(SharedGate, BadGatesAreNamedAndLeaveYUntouched) {
  Problem p(gated_case(ActMode::A16, Precision::Fp32, 97));
  p.c.T = p.T = 2;
  p.x.resize(static_cast<size_t>(p.T * p.H));
  std::vector<uint16_t> y(static_cast<size_t>(p.T * p.H), kBf16Poison);
  const std::vector<uint16_t> poisoned = y;
  std::vector<uint16_t> g = p.gate;
  std::vector<float> gf(static_cast<size_t>(p.H), 0.01f);
  std::vector<uint16_t> longer(static_cast<size_t>(2 * p.H), 0);
  auto call = [&](const std::function<void(MoeArgs&)>& edit) {
    return [&, edit] {
      MoeArgs a = p.args(p.x, p.T, p.logits_f.data(), nullptr, y.data(), 1);
      edit(a);
      moe_run(p.mw, a);
    };
  };
  const char* name = "shared_expert_gate";
  expect_error(call([&](MoeArgs& a) { a.shared_expert = nullptr; }), name);  // a gate without a shared expert
  expect_error(call([&](MoeArgs& a) { a.shared_expert_gate = make_view(gf.data(), DType::F32, {1, p.H}); }), name);
  expect_error(call([&](MoeArgs& a) { a.shared_expert_gate = make_view(g.data(), DType::BF16, {1, p.H - 16}); }), name);
  expect_error(call([&](MoeArgs& a) { a.shared_expert_gate = make_view(g.data(), DType::BF16, {p.H / 2, 2}); }), name);
  expect_error(call([&](MoeArgs& a) { a.shared_expert_gate = make_view(longer.data(), DType::BF16, {2, p.H}); }), name);
  expect_error(call([&](MoeArgs& a) { a.shared_expert_gate = make_view(g.data(), DType::BF16, {1, 1, p.H}); }), name);
  expect_error(call([&](MoeArgs& a) {  // every other element: not contiguous
    a.shared_expert_gate = make_view(longer.data(), DType::BF16, {p.H});
    a.shared_expert_gate.stride[0] = 2;
  }), name);
  expect_error(call([&](MoeArgs& a) {
    a.shared_expert_gate = make_view(g.data(), DType::BF16, {1, p.H}, Backend::CUDA, 0);
  }), name);
  for (uint16_t bad : {uint16_t(0x7fc0), uint16_t(0x7f80), uint16_t(0xff80)}) {  // NaN, +Inf, -Inf
    p.gate[77] = bad;
    expect_error(call([](MoeArgs&) {}), name);
  }
  p.gate = g;
  EXPECT_EQ(y, poisoned);
  // The message says what was expected.
  try {
    call([&](MoeArgs& a) { a.shared_expert_gate = make_view(gf.data(), DType::F32, {1, p.H}); })();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16"), std::string::npos) << e.what();
  }
}

// ---- tensor and expert parallelism ---------------------------------------------------------------------------

// A small gated layer (H 256, I 128, 8 experts top-3, shared I 64) for the parallel runs.
Case small_gated_case() {
  const ModelShape s{"small", 256, 128, 8, 3, RoutingMethod::RenormalizeNaive, 1, 1, 1.f, ActivationType::Swiglu, 1.f,
                     0.f, 0.f, 8, 64, true};
  Case c{.name = "small gated", .shape = s};
  c.E_total = c.E_loc = 8;
  c.T = 6;
  c.shared = true;
  c.shared_I = s.shared_I;
  c.shared_gate = true;
  c.seed = 98;
  return c;
}

TEST(SharedGate, TpAndEpMatchSingleRank) {
  Problem p(small_gated_case());
  std::vector<uint8_t> single;
  p.run(1, &single);
  const std::vector<double> ref = p.to_double(single, p.T * p.H);
  const std::vector<uint16_t> gate = p.gate;
  p.gate.clear();
  std::vector<uint8_t> plain;
  p.run(1, &plain);
  p.gate = gate;
  EXPECT_GT(rel_l2(p.to_double(plain, p.T * p.H), ref), 0.05) << "the gate must matter";
  // One parallel run: every rank's weights and shared expert from make(rank), y per rank.
  auto parallel = [&](int world, const std::function<void(int, MoeWeights&, MoeWeights&, MoeArgs&, Communicator&)>& run) {
    InProcessGroup group(world, 60.0);
    std::vector<std::vector<uint16_t>> ys(static_cast<size_t>(world));
    run_ranks(world, [&](int rank) {
      auto& y = ys[static_cast<size_t>(rank)];
      y.assign(static_cast<size_t>(p.T * p.H), 0);
      MoeArgs a = p.args(p.x, p.T, p.logits_f.data(), nullptr, y.data(), 1);
      MoeWeights w, sw;
      run(rank, w, sw, a, group.comm(rank));
    });
    for (int r = 1; r < world; ++r) EXPECT_EQ(ys[0], ys[static_cast<size_t>(r)]) << "world " << world;
    return rel_l2(bf16_to_double(ys[0]), ref);
  };
  for (int world : {2, 4}) {  // TP: the layer and the shared expert sharded, the gate whole on every rank
    const double err = parallel(world, [&](int rank, MoeWeights& w, MoeWeights& sw, MoeArgs& a, Communicator& comm) {
      const OwnedWeights sh = shard_weights_tp(p.w.desc(), rank, world), ssh = shard_weights_tp(p.sw.desc(), rank, world);
      w = prepare_weights(sh.desc(), Backend::CPU);
      sw = prepare_weights(ssh.desc(), Backend::CPU);
      a.shared_expert = &sw;
      moe_run_tp(w, a, comm);
    });
    std::printf("[ gated    ] TP=%d rel L2 vs single rank %.3g\n", world, err);
    EXPECT_LE(err, 5e-3) << "TP=" << world;
  }
  for (int world : {2, 3}) {  // EP: every rank is given the shared expert and its gate; rank 0 alone adds them
    const double err = parallel(world, [&](int rank, MoeWeights& w, MoeWeights&, MoeArgs& a, Communicator& comm) {
      const ExpertWindow win = expert_window(p.c.E_total, rank, world);
      const OwnedWeights loc = slice_experts(p.w.desc(), win.offset, win.count);
      w = prepare_weights(loc.desc(), Backend::CPU);
      a.local_expert_offset = win.offset;
      moe_run_ep(w, a, comm);
    });
    std::printf("[ gated    ] EP=%d rel L2 vs single rank %.3g\n", world, err);
    EXPECT_LE(err, 5e-3) << "EP=" << world;
  }
}

}  // namespace
