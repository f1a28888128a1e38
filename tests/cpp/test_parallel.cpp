// Tensor and expert parallelism (include/fp4moe/parallel.h) on the CPU backend with the in-process
// communicator: the sharding helpers against an independent decode of the full weights, TP=2/4 and EP=2/3
// against the single-rank operator on the same weights, determinism, and bad input.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <thread>

#include "fp4moe/nvfp4.h"
#include "fp4moe/parallel.h"
#include "test_util.h"
#include "test_helpers.h"

using namespace fp4moe;
using namespace fp4moe::testutil;

namespace {

// A HostWeights (test_util's independent decoder) over a shard's storage.
HostWeights as_host(const OwnedWeights& o, const HostWeights& like) {
  HostWeights h;
  h.format = like.format;
  h.order = like.order;
  h.gated = like.gated;
  h.E = o.E;
  h.H = o.H;
  h.I = o.I;
  if (h.format != WeightFormat::BF16) {
    h.w1_q = o.w1;
    h.w1_sf = o.w1_scale;
    h.w2_q = o.w2;
    h.w2_sf = o.w2_scale;
    h.w1_s2 = o.w1_scale2;
    h.w2_s2 = o.w2_scale2;
  } else {
    h.w1_bf = o.w1_bf16;
    h.w2_bf = o.w2_bf16;
  }
  return h;
}

// Every element of the shard equals the full weights' element at the mapped index (decoded in double).
void check_shard_values(const HostWeights& full, const OwnedWeights& sh, int rank, int world) {
  const HostWeights s = as_host(sh, full);
  const int64_t I = full.I, Is = I / world, H = full.H;
  ASSERT_EQ(s.I, Is);
  ASSERT_EQ(s.E, full.E);
  for (int64_t e = 0; e < full.E; ++e) {
    for (int64_t n = 0; n < s.n1(); ++n) {
      const int64_t src = (full.gated && n >= Is) ? I + rank * Is + (n - Is) : rank * Is + n;
      for (int64_t k = 0; k < H; k += 7) ASSERT_EQ(s.w1(e, n, k), full.w1(e, src, k)) << e << " " << n << " " << k;
    }
    for (int64_t h = 0; h < H; h += 3)
      for (int64_t i = 0; i < Is; ++i) ASSERT_EQ(s.w2(e, h, i), full.w2(e, h, rank * Is + i)) << e << " " << h << " " << i;
  }
  if (!full.bias1.empty())
    for (int64_t e = 0; e < full.E; ++e)
      for (int64_t n = 0; n < s.n1(); ++n) {
        const int64_t src = (full.gated && n >= Is) ? I + rank * Is + (n - Is) : rank * Is + n;
        ASSERT_EQ(sh.bias1[e * s.n1() + n], full.bias1[e * full.n1() + src]);
      }
  if (!full.bias2.empty()) {
    EXPECT_EQ(!sh.bias2.empty(), rank == 0);
    if (rank == 0) EXPECT_EQ(sh.bias2, full.bias2);
  }
}

// PEFT-fused LoRA of one adapter, full size, owned.
struct Lora {
  std::vector<uint16_t> a1, b1, a2, b2;
  LoraAdapterDesc desc;
  Lora(int64_t E, int64_t H, int64_t I, int64_t r, uint64_t seed) {
    a1 = random_bf16_vec(E * r * H, seed, -0.05f, 0.05f);
    b1 = random_bf16_vec(E * 2 * I * r, seed + 1, -0.1f, 0.1f);
    a2 = random_bf16_vec(E * r * I, seed + 2, -0.05f, 0.05f);
    b2 = random_bf16_vec(E * H * r, seed + 3, -0.1f, 0.1f);
    desc.layout = LoraLayout::PeftFused;
    desc.rank = r;
    desc.lora_alpha = 2.f * static_cast<float>(r);
    desc.a_gate_up = make_view(a1.data(), DType::BF16, {E, r, H});
    desc.b_gate_up = make_view(b1.data(), DType::BF16, {E, 2 * I, r});
    desc.a_down = make_view(a2.data(), DType::BF16, {E, r, I});
    desc.b_down = make_view(b2.data(), DType::BF16, {E, H, r});
  }
};

struct Case {
  int64_t E, H, I, k, T, r;
  ActivationType act;
  RoutingMethod routing;
  GateUpOrder order;
  bool bias;
  uint64_t seed;
};

struct Inputs {
  std::vector<uint16_t> x;
  std::vector<float> logits, alpha, beta, bias_e;
  std::vector<int32_t> adapter_ids;
  MoeArgs base(const Case& c, int num_threads) {
    MoeArgs a;
    a.x = make_view(x.data(), DType::BF16, {c.T, c.H});
    a.routing.method = c.routing;
    a.routing.top_k = c.k;
    a.routing.logits = make_view(logits.data(), DType::F32, {c.T, c.E});
    if (c.routing == RoutingMethod::DeepSeekV3) a.routing.bias = make_view(bias_e.data(), DType::F32, {c.E});
    a.num_experts_total = c.E;
    a.activation.type = c.act;
    a.num_threads = num_threads;
    return a;
  }
};

Inputs make_inputs(const Case& c) {
  Inputs in;
  in.x = random_bf16_vec(c.T * c.H, c.seed + 100);
  in.logits = random_f32_vec(c.T * c.E, c.seed + 101, -2.f, 2.f);
  in.bias_e = random_f32_vec(c.E, c.seed + 102, -0.1f, 0.1f);
  in.alpha.assign(static_cast<size_t>(c.E), 4.f);
  in.beta.assign(static_cast<size_t>(c.E), 25.f);
  for (int64_t t = 0; t < c.T; ++t) in.adapter_ids.push_back(t % 3 == 2 ? -1 : static_cast<int32_t>(t % 2));
  return in;
}

void set_act_params(MoeArgs& a, const Case& c, Inputs& in, int64_t off, int64_t n) {
  if (c.act != ActivationType::Situ) return;
  a.activation.alpha = make_view(in.alpha.data() + off, DType::F32, {n});
  a.activation.beta = make_view(in.beta.data() + off, DType::F32, {n});
}


// The single-rank operator on the full weights (with the adapters when with_lora).
std::vector<uint16_t> run_single(const Case& c, HostWeights& hw, Inputs& in, const std::vector<Lora>* loras) {
  MoeWeights w = prepare_weights(hw.desc(), Backend::CPU);
  AdapterRegistry reg(w, 4);
  MoeArgs a = in.base(c, 2);
  set_act_params(a, c, in, 0, c.E);
  if (loras) {
    for (size_t i = 0; i < loras->size(); ++i) reg.load(static_cast<int>(i), (*loras)[i].desc);
    a.adapters = &reg;
    a.adapter_ids = make_view(in.adapter_ids.data(), DType::I32, {c.T});
  }
  std::vector<uint16_t> y(static_cast<size_t>(c.T * c.H));
  a.y = make_view(y.data(), DType::BF16, {c.T, c.H});
  moe_run(w, a);
  return y;
}

// TP over `world` ranks; returns every rank's y (all must be equal).
std::vector<std::vector<uint16_t>> run_tp(const Case& c, HostWeights& hw, Inputs& in, const std::vector<Lora>* loras,
                                          int world, ParallelOutput out = ParallelOutput::AllReduce) {
  InProcessGroup group(world, 60.0);
  const WeightsDesc full = hw.desc();
  std::vector<std::vector<uint16_t>> ys(static_cast<size_t>(world));
  run_ranks(world, [&](int rank) {
    OwnedWeights sh = shard_weights_tp(full, rank, world);
    MoeWeights w = prepare_weights(sh.desc(), Backend::CPU);
    AdapterRegistry reg(w, 4);
    std::vector<ShardedAdapter> keep;
    MoeArgs a = in.base(c, 1);
    set_act_params(a, c, in, 0, c.E);
    if (loras) {
      for (size_t i = 0; i < loras->size(); ++i) {
        keep.push_back(shard_adapter_tp((*loras)[i].desc, c.I, rank, world));
        reg.load(static_cast<int>(i), keep.back().desc);
      }
      a.adapters = &reg;
      a.adapter_ids = make_view(in.adapter_ids.data(), DType::I32, {c.T});
    }
    const int64_t rows = out == ParallelOutput::AllReduce ? c.T : c.T / world;
    auto& y = ys[static_cast<size_t>(rank)];
    y.assign(static_cast<size_t>(rows * c.H), 0);
    a.y = make_view(y.data(), DType::BF16, {rows, c.H});
    try {
      moe_run_tp(w, a, group.comm(rank), out);
    } catch (...) {
      group.abort();
      throw;
    }
  });
  return ys;
}

std::vector<std::vector<uint16_t>> run_ep(const Case& c, HostWeights& hw, Inputs& in, const std::vector<Lora>* loras,
                                          int world) {
  InProcessGroup group(world, 60.0);
  const WeightsDesc full = hw.desc();
  std::vector<std::vector<uint16_t>> ys(static_cast<size_t>(world));
  run_ranks(world, [&](int rank) {
    const ExpertWindow win = expert_window(c.E, rank, world);
    OwnedWeights loc = slice_experts(full, win.offset, win.count);
    MoeWeights w = prepare_weights(loc.desc(), Backend::CPU);
    AdapterRegistry reg(w, 4);
    std::vector<ShardedAdapter> keep;
    MoeArgs a = in.base(c, 1);
    a.local_expert_offset = win.offset;
    set_act_params(a, c, in, win.offset, win.count);
    if (loras) {
      for (size_t i = 0; i < loras->size(); ++i) {
        keep.push_back(slice_adapter_experts((*loras)[i].desc, c.E, win.offset, win.count));
        reg.load(static_cast<int>(i), keep.back().desc);
      }
      a.adapters = &reg;
      a.adapter_ids = make_view(in.adapter_ids.data(), DType::I32, {c.T});
    }
    auto& y = ys[static_cast<size_t>(rank)];
    y.assign(static_cast<size_t>(c.T * c.H), 0);
    a.y = make_view(y.data(), DType::BF16, {c.T, c.H});
    try {
      moe_run_ep(w, a, group.comm(rank));
    } catch (...) {
      group.abort();
      throw;
    }
  });
  return ys;
}

// Runs TP (and EP) and compares with the single-rank operator.
void check_case(const Case& c, std::initializer_list<int> tp_worlds, std::initializer_list<int> ep_worlds,
                bool with_lora, double tol) {
  HostWeights hw = make_weights(c.E, c.H, c.I, c.seed, WeightFormat::NVFP4, c.order, true, c.bias);
  Inputs in = make_inputs(c);
  std::vector<Lora> loras;
  if (with_lora) {
    loras.emplace_back(c.E, c.H, c.I, c.r, c.seed + 7);
    loras.emplace_back(c.E, c.H, c.I, c.r / 2, c.seed + 17);
  }
  const std::vector<Lora>* lp = with_lora ? &loras : nullptr;
  const std::vector<uint16_t> ref = run_single(c, hw, in, lp);
  const std::vector<double> refd = bf16_to_double(ref);
  double ref_norm = 0;
  for (double v : refd) ref_norm += v * v;
  ASSERT_GT(ref_norm, 1e-6) << "the reference output must not be all zeros";
  for (int world : tp_worlds) {
    auto ys = run_tp(c, hw, in, lp, world);
    for (int r = 1; r < world; ++r) EXPECT_EQ(ys[0], ys[static_cast<size_t>(r)]) << "ranks disagree, TP=" << world;
    const double err = rel_l2(bf16_to_double(ys[0]), refd);
    EXPECT_LE(err, tol) << "TP=" << world;
    std::printf("  TP=%d rel L2 vs single rank: %.3g\n", world, err);
    // Deterministic run to run: bit for bit.
    auto again = run_tp(c, hw, in, lp, world);
    EXPECT_EQ(again[0], ys[0]) << "TP=" << world << " not bit-identical across runs";
  }
  for (int world : ep_worlds) {
    auto ys = run_ep(c, hw, in, lp, world);
    for (int r = 1; r < world; ++r) EXPECT_EQ(ys[0], ys[static_cast<size_t>(r)]) << "ranks disagree, EP=" << world;
    const double err = rel_l2(bf16_to_double(ys[0]), refd);
    EXPECT_LE(err, tol) << "EP=" << world;
    std::printf("  EP=%d rel L2 vs single rank: %.3g\n", world, err);
    auto again = run_ep(c, hw, in, lp, world);
    EXPECT_EQ(again[0], ys[0]) << "EP=" << world << " not bit-identical across runs";
  }
}

}  // namespace

TEST(Parallel, ExpertWindow) {
  EXPECT_EQ(expert_window(256, 3, 8).offset, 96);
  EXPECT_EQ(expert_window(256, 3, 8).count, 32);
  // Uneven: 8 experts on 3 ranks -> 3, 3, 2, contiguous and covering.
  int64_t next = 0;
  for (int r = 0; r < 3; ++r) {
    const ExpertWindow w = expert_window(8, r, 3);
    EXPECT_EQ(w.offset, next);
    EXPECT_EQ(w.count, r < 2 ? 3 : 2);
    next += w.count;
  }
  EXPECT_EQ(next, 8);
  expect_error([] { expert_window(8, 3, 3); }, "rank");
  expect_error([] { expert_window(8, -1, 3); }, "rank");
  expect_error([] { expert_window(8, 0, 0); }, "world");
  expect_error([] { expert_window(2, 0, 3); }, "num_experts_total");
}

TEST(Parallel, ShardWeightsMatchesFullWeightsElementwise) {
  for (GateUpOrder order : {GateUpOrder::GateFirst, GateUpOrder::UpFirst})
    for (WeightFormat fmt : {WeightFormat::NVFP4, WeightFormat::BF16, WeightFormat::MXFP4}) {
      HostWeights hw = make_weights(3, 64, 128, 11, fmt, order, true, true);
      for (int world : {1, 2, 4, 8}) {
        if (fmt == WeightFormat::MXFP4 && world == 8) {  // 16 a rank: not whole MXFP4 blocks of 32
          expect_error([&] { shard_weights_tp(hw.desc(), 0, world); }, "world");
          continue;
        }
        for (int rank = 0; rank < world; ++rank) {
          OwnedWeights sh = shard_weights_tp(hw.desc(), rank, world);
          EXPECT_EQ(sh.order, order);
          check_shard_values(hw, sh, rank, world);
        }
      }
    }
  // Non-gated W1 (one half).
  HostWeights ng = make_weights(2, 32, 64, 12, WeightFormat::NVFP4, GateUpOrder::GateFirst, false, true);
  for (int rank = 0; rank < 2; ++rank) check_shard_values(ng, shard_weights_tp(ng.desc(), rank, 2), rank, 2);
}

TEST(Parallel, ShardOfSwizzledScalesEqualsShardOfLinear) {
  HostWeights hw = make_weights(2, 96, 256, 13);
  const int64_t E = 2, H = 96, I = 256, N1 = 2 * I;
  const int64_t p1 = nvfp4::swizzled_size(N1, H / 16), p2 = nvfp4::swizzled_size(H, I / 16);
  std::vector<uint8_t> s1(static_cast<size_t>(E * p1)), s2(static_cast<size_t>(E * p2));
  for (int64_t e = 0; e < E; ++e) {
    nvfp4::swizzle_scales(hw.w1_sf.data() + e * N1 * (H / 16), N1, H / 16, s1.data() + e * p1);
    nvfp4::swizzle_scales(hw.w2_sf.data() + e * H * (I / 16), H, I / 16, s2.data() + e * p2);
  }
  WeightsDesc sw = hw.desc();
  sw.scale_layout = ScaleLayout::Swizzled128x4;
  sw.w1_scale = make_view(s1.data(), DType::E4M3, {E, p1});
  sw.w2_scale = make_view(s2.data(), DType::E4M3, {E, p2});
  for (int rank = 0; rank < 2; ++rank) {
    OwnedWeights a = shard_weights_tp(hw.desc(), rank, 2), b = shard_weights_tp(sw, rank, 2);
    EXPECT_EQ(b.scale_layout, ScaleLayout::Linear);
    EXPECT_EQ(a.w1_scale, b.w1_scale);
    EXPECT_EQ(a.w2_scale, b.w2_scale);
    EXPECT_EQ(a.w1, b.w1);
    EXPECT_EQ(a.w2, b.w2);
  }
}

TEST(Parallel, ShardAdapterSlicesTheRightRowsAndColumns) {
  const int64_t E = 2, H = 32, I = 64, r = 4;
  Lora l(E, H, I, r, 21);
  const int world = 2;
  for (int rank = 0; rank < world; ++rank) {
    ShardedAdapter s = shard_adapter_tp(l.desc, I, rank, world);
    const int64_t Is = I / world;
    const auto* a1 = s.desc.a_gate_up.as<uint16_t>();
    const auto* b1 = s.desc.b_gate_up.as<uint16_t>();
    const auto* a2 = s.desc.a_down.as<uint16_t>();
    const auto* b2 = s.desc.b_down.as<uint16_t>();
    EXPECT_EQ(s.desc.b_gate_up.shape[1], 2 * Is);
    EXPECT_EQ(s.desc.a_down.shape[2], Is);
    for (int64_t i = 0; i < E * r * H; ++i) ASSERT_EQ(a1[i], l.a1[i]);  // replicated
    for (int64_t i = 0; i < E * H * r; ++i) ASSERT_EQ(b2[i], l.b2[i]);  // replicated
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t n = 0; n < 2 * Is; ++n) {
        const int64_t src = n < Is ? rank * Is + n : I + rank * Is + (n - Is);
        for (int64_t c = 0; c < r; ++c) ASSERT_EQ(b1[(e * 2 * Is + n) * r + c], l.b1[(e * 2 * I + src) * r + c]);
      }
      for (int64_t c = 0; c < r; ++c)
        for (int64_t i = 0; i < Is; ++i) ASSERT_EQ(a2[(e * r + c) * Is + i], l.a2[(e * r + c) * I + rank * Is + i]);
    }
  }
}

// Qwen3-30B-A3B-like (H=2048, I=768 split in 2 and 4; E reduced), SwiGLU, RenormalizeNaive, PEFT-fused
// LoRA on two adapters plus base tokens. Tolerance: TP changes only the fp32 summation order of the down
// GEMM over I (partials summed in rank order) and, with LoRA, the bf16 rounding points of the down delta's
// partial shrink z_p and expand d_p; EP changes only the order of the combine sum. A few bf16 ulps on some
// elements -> rel L2 well under 5e-3.
TEST(Parallel, Qwen3LikeTpAndEpWithLoraMatchSingleRank) {
  const Case c{8, 2048, 768, 4, 5, 16, ActivationType::Swiglu, RoutingMethod::RenormalizeNaive,
               GateUpOrder::GateFirst, false, 31};
  check_case(c, {2, 4}, {2}, true, 5e-3);
}

TEST(Parallel, Qwen3LikeTpWithoutLoraAndWithBiasMatchesSingleRank) {
  // Up-first halves and both biases: bias2 must be added exactly once. No LoRA: the only difference is the
  // fp32 summation order, so a tighter bound holds.
  const Case c{6, 2048, 768, 3, 4, 8, ActivationType::Swiglu, RoutingMethod::RenormalizeNaive,
               GateUpOrder::UpFirst, true, 41};
  check_case(c, {2, 4}, {2, 3}, false, 2e-3);
}

// Kimi-K3-like: H=3584 (not a multiple of 1024), I=384 split in 2, SiTU α=4 β=25 per expert, DeepSeekV3
// routing with a bias, LoRA.
TEST(Parallel, KimiLikeTp2AndEp2WithLoraMatchSingleRank) {
  const Case c{6, 3584, 384, 3, 4, 8, ActivationType::Situ, RoutingMethod::DeepSeekV3, GateUpOrder::GateFirst,
               false, 51};
  check_case(c, {2}, {2}, true, 5e-3);
}

TEST(Parallel, ReduceScatterGivesEachRankItsRowsOfTheAllReduce) {
  const Case c{4, 256, 128, 2, 4, 8, ActivationType::Swiglu, RoutingMethod::Renormalize, GateUpOrder::GateFirst,
               true, 61};
  HostWeights hw = make_weights(c.E, c.H, c.I, c.seed, WeightFormat::NVFP4, c.order, true, c.bias);
  Inputs in = make_inputs(c);
  auto full = run_tp(c, hw, in, nullptr, 2);
  auto rs = run_tp(c, hw, in, nullptr, 2, ParallelOutput::ReduceScatter);
  const size_t half = static_cast<size_t>(c.T / 2 * c.H);
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(std::equal(rs[r].begin(), rs[r].end(), full[0].begin() + r * half)) << "rank " << r;
}

TEST(Parallel, InProcessAllReduceSumsInRankOrder) {
  // Values chosen so that the order of the fp32 additions changes the result: rank order ((1e8 + 1) + -1e8)
  // + 1 = 1 (1e8 + 1 rounds to 1e8), other orders give 0 or 2.
  const float vals[4] = {1e8f, 1.f, -1e8f, 1.f};
  InProcessGroup g(4);
  std::vector<float> out(4);
  run_ranks(4, [&](int r) {
    float v = vals[r];
    g.comm(r).allreduce_sum_f32(&v, 1);
    out[static_cast<size_t>(r)] = v;
  });
  for (float v : out) EXPECT_EQ(v, ((1e8f + 1.f) + -1e8f) + 1.f);
  InProcessGroup g2(2);
  run_ranks(2, [&](int r) {
    const float mine[2] = {static_cast<float>(r + 1), static_cast<float>(10 * (r + 1))};
    std::vector<float> all(4);
    g2.comm(r).allgather(mine, all.data(), 2 * sizeof(float));
    EXPECT_EQ(all, (std::vector<float>{1, 10, 2, 20}));
  });
}

TEST(Parallel, InProcessCollectiveTimesOutInsteadOfHanging) {
  InProcessGroup g(2, 0.2);
  float v = 1.f;
  expect_error([&] { g.comm(0).allreduce_sum_f32(&v, 1); }, "comm");
}

TEST(Parallel, BadInputNamesTheArgument) {
  HostWeights hw = make_weights(2, 64, 768, 71);
  const WeightsDesc d = hw.desc();
  expect_error([&] { shard_weights_tp(d, 0, 5); }, "world");   // 768 % 5 != 0
  expect_error([&] { shard_weights_tp(d, 0, 32); }, "world");  // 24 per rank: not whole 16-blocks
  expect_error([&] { shard_weights_tp(d, 2, 2); }, "rank");
  expect_error([&] { shard_weights_tp(d, -1, 2); }, "rank");
  expect_error([&] { shard_weights_tp(d, 0, 0); }, "world");
  WeightsDesc bad_w1 = d;
  bad_w1.w1.shape[1] = 10;
  expect_error([&] { shard_weights_tp(bad_w1, 0, 2); }, "w1");
  Lora l(2, 64, 768, 4, 72);
  expect_error([&] { shard_adapter_tp(l.desc, 768, 0, 32); }, "world");
  expect_error([&] { shard_adapter_tp(l.desc, 768, 3, 2); }, "rank");
  expect_error([&] { shard_adapter_tp(l.desc, 760, 0, 2); }, "inter");
  expect_error([&] { slice_experts(d, 1, 2); }, "begin");
  expect_error([&] { make_nccl_communicator(nullptr, nullptr); }, "nccl_comm",
                   nccl_available() ? ErrorCode::InvalidArgument : ErrorCode::Unsupported);

  // EP: rank 0 passes a local_expert_offset that is not its window: it names the argument, rank 1 (correct
  // arguments) learns of the failure instead of waiting.
  const Case c{4, 64, 32, 2, 2, 4, ActivationType::Swiglu, RoutingMethod::Renormalize, GateUpOrder::GateFirst,
               false, 73};
  HostWeights small = make_weights(c.E, c.H, c.I, c.seed);
  Inputs in = make_inputs(c);
  InProcessGroup g(2, 30.0);
  {
    OwnedWeights l0 = slice_experts(small.desc(), 0, 2), l1 = slice_experts(small.desc(), 2, 2);
    MoeWeights e0 = prepare_weights(l0.desc(), Backend::CPU), e1 = prepare_weights(l1.desc(), Backend::CPU);
    std::vector<uint16_t> ya(static_cast<size_t>(c.T * c.H), 0x7fc1), yb(static_cast<size_t>(c.T * c.H), 0x7fc1);
    std::vector<std::string> names(2);
    run_ranks(2, [&](int r) {
      MoeArgs a = in.base(c, 1);
      a.y = make_view(r == 0 ? ya.data() : yb.data(), DType::BF16, {c.T, c.H});
      a.local_expert_offset = r == 0 ? 1 : 2;
      try {
        moe_run_ep(r == 0 ? e0 : e1, a, g.comm(r));
      } catch (const Error& e) {
        names[static_cast<size_t>(r)] = e.argument();
      }
    });
    EXPECT_EQ(names[0], "local_expert_offset");
    EXPECT_EQ(names[1], "comm");
    EXPECT_EQ(std::count(yb.begin(), yb.end(), 0x7fc1), c.T * c.H);
  }
  // TP: a y of the wrong shape is reported by the rank that has it; the other rank learns of the failure.
  OwnedWeights s0 = shard_weights_tp(small.desc(), 0, 2), s1 = shard_weights_tp(small.desc(), 1, 2);
  MoeWeights w0 = prepare_weights(s0.desc(), Backend::CPU), w1 = prepare_weights(s1.desc(), Backend::CPU);
  std::vector<uint16_t> y0(static_cast<size_t>(c.T * c.H), 0x7fc1), y1(static_cast<size_t>(c.T * c.H), 0x7fc1);
  std::vector<std::string> args(2);
  run_ranks(2, [&](int r) {
    MoeArgs ar = in.base(c, 1);
    ar.y = r == 0 ? make_view(y0.data(), DType::BF16, {c.T, c.H}) : make_view(y1.data(), DType::BF16, {c.T, c.H - 16});
    try {
      moe_run_tp(r == 0 ? w0 : w1, ar, g.comm(r));
    } catch (const Error& e) {
      args[static_cast<size_t>(r)] = e.argument();
    }
  });
  EXPECT_EQ(args[0], "comm");
  EXPECT_EQ(args[1], "y");
  EXPECT_EQ(std::count(y0.begin(), y0.end(), 0x7fc1), c.T * c.H) << "y must stay untouched on error";
  EXPECT_EQ(std::count(y1.begin(), y1.end(), 0x7fc1), c.T * c.H);
}
