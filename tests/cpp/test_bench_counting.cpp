// The byte / FLOP counting and statistics of `fp4moe bench` (tools/fp4moe/bench.h), checked against
// independent computations: element-by-element sums, brute-force sets, sorted-sample order statistics.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "../../tools/fp4moe/bench.h"
#include "fp4moe/model_shapes.h"

namespace fp4moe {
namespace {

// Bytes of a [N, K] NVFP4 matrix summed a row at a time: K/2 code bytes and K/16 scale bytes.
int64_t nvfp4_bytes_by_rows(int64_t N, int64_t K) {
  int64_t b = 0;
  for (int64_t n = 0; n < N; ++n) b += K / 2 + K / 16;
  return b;
}

TEST(BenchCounting, ExpertBytesMatchRowSums) {
  for (const auto& s : kModelShapes) {
    const bool gated = is_gated(s.activation);
    const int64_t N1 = gated ? 2 * s.I : s.I;
    const int64_t fp4 = nvfp4_bytes_by_rows(N1, s.H) + nvfp4_bytes_by_rows(s.H, s.I) + (gated ? 3 : 2) * 4;
    EXPECT_EQ(bench::expert_weight_bytes(WeightFormat::NVFP4, s.H, s.I, gated), fp4) << s.name;
    EXPECT_EQ(bench::expert_weight_bytes(WeightFormat::BF16, s.H, s.I, gated), 2 * (N1 * s.H + s.H * s.I)) << s.name;
    // NVFP4 is 4.5 bits an element (+ a few global-scale bytes): 9/32 of bf16.
    const double ratio = double(bench::expert_weight_bytes(WeightFormat::NVFP4, s.H, s.I, gated)) /
                         double(bench::expert_weight_bytes(WeightFormat::BF16, s.H, s.I, gated));
    EXPECT_NEAR(ratio, 9.0 / 32.0, 1e-5) << s.name;
  }
}

TEST(BenchCounting, KnownShapeNumbers) {
  // mixtral_8x7b: W1 [28672, 4096], W2 [4096, 14336] -> 176160768 elements an expert.
  const int64_t elems = 2 * 14336 * 4096 + 4096 * 14336;
  EXPECT_EQ(bench::expert_weight_bytes(WeightFormat::NVFP4, 4096, 14336, true), elems / 2 + elems / 16 + 12);
  // Non-gated: W1 [I, H], one W1 global scale.
  EXPECT_EQ(bench::expert_weight_bytes(WeightFormat::NVFP4, 32, 16, false), (16 * 32 + 32 * 16) * 9 / 16 + 8);
  EXPECT_THROW(bench::nvfp4_matrix_bytes(4, 20), std::invalid_argument);
  EXPECT_THROW(bench::expert_weight_bytes(WeightFormat::NVFP4, 0, 16, true), std::invalid_argument);
}

TEST(BenchCounting, SharedExpertOfQwen3NextCounted) {
  const ModelShape* s = find_model_shape("qwen3_next_80b_a3b");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->shared_I, 512);
  EXPECT_TRUE(s->shared_gate);
  // W1 [1024, 2048] and W2 [2048, 512] NVFP4 with three fp32 global scales, and the bf16 gate [2048].
  const int64_t elems = 1024 * 2048 + 2048 * 512;
  EXPECT_EQ(bench::shared_expert_bytes(WeightFormat::NVFP4, 2048, 512, true, false), elems / 2 + elems / 16 + 12);
  EXPECT_EQ(bench::shared_expert_bytes(WeightFormat::NVFP4, 2048, 512, true, true), elems / 2 + elems / 16 + 12 + 4096);
  // FLOPs of T tokens, counted with loops: the two GEMMs a token and the gate's dot product.
  const int64_t H = 48, I = 32, T = 5;
  int64_t macs = 0;
  for (int64_t t = 0; t < T; ++t) macs += 2 * I * H + H * I + H;
  EXPECT_DOUBLE_EQ(bench::shared_expert_flops(T, H, I, true, true), 2.0 * macs);
  EXPECT_DOUBLE_EQ(bench::shared_expert_flops(T, H, I, true, false), 2.0 * (macs - T * H));
}

TEST(BenchCounting, FlopsCountMultiplyAdds) {
  // Count multiply-adds of the two GEMMs of one pair with loops, then scale by the slots.
  const int64_t H = 48, I = 32;
  for (bool gated : {true, false}) {
    const int64_t N1 = gated ? 2 * I : I;
    int64_t macs = 0;
    for (int64_t n = 0; n < N1; ++n) macs += H;  // GEMM1 row n: H multiply-adds
    for (int64_t h = 0; h < H; ++h) macs += I;   // GEMM2 row h: I multiply-adds
    EXPECT_DOUBLE_EQ(bench::base_flops(7, H, I, gated), 2.0 * 7 * macs);
    const int64_t r = 16;
    const int64_t lora_macs = r * H + N1 * r + r * I + H * r;  // shrink + expand of both projections
    EXPECT_DOUBLE_EQ(bench::lora_flops(5, H, I, gated, r), 2.0 * 5 * lora_macs);
    EXPECT_EQ(bench::lora_pair_bytes(H, I, gated, r), 2 * lora_macs);  // one bf16 element per multiply-add
  }
}

TEST(BenchCounting, TouchAgainstBruteForce) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t T = 1 + rng() % 40, k = 1 + rng() % 6, E = 8 + rng() % 40;
    const int64_t E_loc = 1 + rng() % E, off = rng() % (E - E_loc + 1);
    std::vector<int32_t> ids(T * k), aids(T);
    for (auto& v : ids) v = static_cast<int32_t>(rng() % E);
    for (auto& v : aids) v = static_cast<int32_t>(rng() % 5) - 1;  // -1 = base
    std::set<int64_t> experts;
    std::set<std::pair<int, int64_t>> pairs;
    std::set<int> adapters;
    std::set<int64_t> adapted_tokens;
    int64_t slots = 0, adapted = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t g = ids[t * k + j];
        if (g < off || g >= off + E_loc) continue;
        ++slots;
        experts.insert(g);
        if (aids[t] >= 0) {
          ++adapted;
          pairs.insert({aids[t], g});
          adapters.insert(aids[t]);
          adapted_tokens.insert(t);
        }
      }
    const bench::Touch got = bench::count_touch(ids, T, k, off, E_loc, aids);
    EXPECT_EQ(got.local_slots, slots);
    EXPECT_EQ(got.touched_experts, static_cast<int64_t>(experts.size()));
    EXPECT_EQ(got.adapted_slots, adapted);
    EXPECT_EQ(got.touched_pairs, static_cast<int64_t>(pairs.size()));
    EXPECT_EQ(got.touched_adapters, static_cast<int64_t>(adapters.size()));
    EXPECT_EQ(got.adapted_tokens, static_cast<int64_t>(adapted_tokens.size()));
    const bench::Touch base = bench::count_touch(ids, T, k, off, E_loc);
    EXPECT_EQ(base.local_slots, slots);
    EXPECT_EQ(base.adapted_slots, 0);
    EXPECT_EQ(base.touched_pairs, 0);
    EXPECT_EQ(base.touched_adapters, 0);
    EXPECT_EQ(base.adapted_tokens, 0);
  }
  EXPECT_THROW(bench::count_touch({0, 1, 2}, 2, 2, 0, 4), std::invalid_argument);
  EXPECT_THROW(bench::count_touch({0, 1}, 1, 2, 0, 4, {0, 0}), std::invalid_argument);
}

// kimi_k3_tp8's dimensions (H 3584, I 384, gated), rank 16, element counts worked by hand.
TEST(BenchCounting, LoraBytesByLayout) {
  // PEFT-fused pair: A1 16x3584 = 57344, B1 768x16 = 12288, A2 16x384 = 6144, B2 3584x16 = 57344; 133120 bf16.
  EXPECT_EQ(bench::lora_pair_bytes(3584, 384, true, 16), 266240);
  // Shared-outer, once per adapter: A1 57344 + B2 57344 = 114688 bf16; per pair: B1 12288 + A2 6144 = 18432 bf16.
  EXPECT_EQ(bench::lora_shared_outer_bytes(3584, 16), 229376);
  EXPECT_EQ(bench::lora_shared_outer_pair_bytes(384, true, 16), 36864);
  EXPECT_EQ(bench::lora_shared_outer_pair_bytes(384, false, 16), 24576);  // non-gated B1 [I, r]: 6144 + 6144 bf16
  bench::Touch t;
  t.touched_pairs = 10;
  t.touched_adapters = 3;
  EXPECT_EQ(bench::lora_touched_bytes(t, false, 3584, 384, true, 16), 2662400);      // 10 x 266240
  EXPECT_EQ(bench::lora_touched_bytes(t, true, 3584, 384, true, 16), 1056768);       // 3 x 229376 + 10 x 36864
  EXPECT_EQ(bench::lora_touched_bytes(bench::Touch{}, true, 3584, 384, true, 16), 0);  // no adapter used
}

TEST(BenchCounting, LoraFlopsByLayout) {
  // H 48, I 32 gated (N1 64), r 4; 12 adapted slots on 5 adapted tokens.
  bench::Touch t;
  t.adapted_slots = 12;
  t.adapted_tokens = 5;
  // PEFT-fused: each slot 4 x (48 + 64 + 32 + 48) = 768 multiply-adds; 12 x 768 x 2 = 18432.
  EXPECT_DOUBLE_EQ(bench::lora_touched_flops(t, false, 48, 32, true, 4), 18432.0);
  // Shared-outer: each slot 4 x (64 + 32) = 384, each token 4 x (48 + 48) = 384; (12 + 5) x 384 x 2 = 13056.
  EXPECT_DOUBLE_EQ(bench::lora_touched_flops(t, true, 48, 32, true, 4), 13056.0);
}

TEST(BenchCounting, LoraCaseAdapterIds) {
  using bench::LoraCase;
  EXPECT_EQ(bench::lora_case_adapter_ids(LoraCase::PerExpert8, 10, 8), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 0, 1}));
  EXPECT_EQ(bench::lora_case_adapter_ids(LoraCase::SharedOuter8, 3, 8), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(bench::lora_case_adapter_ids(LoraCase::OneAdapter, 4, 8), (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ(bench::lora_case_adapter_ids(LoraCase::HalfBase, 5, 8), (std::vector<int32_t>{0, -1, 1, -1, 2}));
  const std::vector<int32_t> half = bench::lora_case_adapter_ids(LoraCase::HalfBase, 18, 8);
  EXPECT_EQ(half[14], 7);
  EXPECT_EQ(half[16], 0);  // the ninth adapted token wraps to adapter 0
  EXPECT_EQ(half[17], -1);
  EXPECT_TRUE(bench::lora_case_adapter_ids(LoraCase::PerExpert8, 0, 8).empty());
  EXPECT_THROW(bench::lora_case_adapter_ids(LoraCase::PerExpert8, 4, 0), std::invalid_argument);
}

// Four tokens, top-2, four local experts: the touches and adapter bytes of each case worked by hand.
TEST(BenchCounting, LoraCasesOnOneRouting) {
  using bench::LoraCase;
  const std::vector<int32_t> ids = {0, 1, 1, 2, 0, 1, 2, 3};  // token t's experts: ids[2t], ids[2t + 1]
  auto touch = [&](LoraCase c) { return bench::count_touch(ids, 4, 2, 0, 4, bench::lora_case_adapter_ids(c, 4, 8)); };
  // per_expert8, ids 0 1 2 3: pairs (0,0) (0,1) (1,1) (1,2) (2,0) (2,1) (3,2) (3,3).
  const bench::Touch pe = touch(LoraCase::PerExpert8);
  EXPECT_EQ(pe.touched_pairs, 8);
  EXPECT_EQ(pe.touched_adapters, 4);
  EXPECT_EQ(pe.adapted_tokens, 4);
  EXPECT_EQ(pe.adapted_slots, 8);
  EXPECT_EQ(bench::lora_touched_bytes(pe, false, 3584, 384, true, 16), 2129920);  // 8 x 266240
  // shared_outer8: the same touches; 4 x 229376 shared + 8 x 36864 per pair.
  const bench::Touch so = touch(LoraCase::SharedOuter8);
  EXPECT_EQ(bench::lora_touched_bytes(so, true, 3584, 384, true, 16), 1212416);
  // one_adapter: adapter 0 on experts 0, 1, 2, 3.
  const bench::Touch one = touch(LoraCase::OneAdapter);
  EXPECT_EQ(one.touched_pairs, 4);
  EXPECT_EQ(one.touched_adapters, 1);
  EXPECT_EQ(bench::lora_touched_bytes(one, false, 3584, 384, true, 16), 1064960);  // 4 x 266240
  // half_base, ids 0 -1 1 -1: token 0 (adapter 0) and token 2 (adapter 1), both on experts 0 and 1.
  const bench::Touch half = touch(LoraCase::HalfBase);
  EXPECT_EQ(half.touched_pairs, 4);
  EXPECT_EQ(half.touched_adapters, 2);
  EXPECT_EQ(half.adapted_tokens, 2);
  EXPECT_EQ(half.adapted_slots, 4);
  EXPECT_EQ(half.local_slots, 8);
  EXPECT_EQ(half.touched_experts, 4);
}

TEST(BenchOptions, LoraCaseNames) {
  using bench::LoraCase;
  EXPECT_EQ(bench::parse_lora_cases("per_expert8,shared_outer8,one_adapter,half_base"),
            (std::vector<LoraCase>{LoraCase::PerExpert8, LoraCase::SharedOuter8, LoraCase::OneAdapter, LoraCase::HalfBase}));
  EXPECT_EQ(bench::parse_lora_cases("half_base,per_expert8"), (std::vector<LoraCase>{LoraCase::HalfBase, LoraCase::PerExpert8}));
  for (const LoraCase c : bench::kAllLoraCases)
    EXPECT_EQ(bench::parse_lora_cases(bench::lora_case_name(c)), std::vector<LoraCase>{c});
  EXPECT_STREQ(bench::lora_case_name(LoraCase::SharedOuter8), "shared_outer8");
  EXPECT_TRUE(bench::lora_case_shared_outer(LoraCase::SharedOuter8));
  EXPECT_FALSE(bench::lora_case_shared_outer(LoraCase::HalfBase));
  for (const char* bad : {"", "base", "per_expert", "one_adapter,one_adapter", "half_base,"})
    EXPECT_THROW(bench::parse_lora_cases(bad), std::invalid_argument) << bad;
}

TEST(BenchCounting, PercentileOrderStatistics) {
  std::mt19937 rng(5);
  std::vector<double> v(101);
  for (auto& x : v) x = std::uniform_real_distribution<double>(0, 100)(rng);
  std::vector<double> s = v;
  std::sort(s.begin(), s.end());
  // 101 samples: percentile p is exactly the p-th order statistic.
  EXPECT_DOUBLE_EQ(bench::percentile(v, 50), s[50]);
  EXPECT_DOUBLE_EQ(bench::percentile(v, 10), s[10]);
  EXPECT_DOUBLE_EQ(bench::percentile(v, 90), s[90]);
  EXPECT_DOUBLE_EQ(bench::percentile(v, 0), s.front());
  EXPECT_DOUBLE_EQ(bench::percentile(v, 100), s.back());
  // Even count: the median is the mean of the two middle values.
  EXPECT_DOUBLE_EQ(bench::percentile({4, 1, 3, 2}, 50), 2.5);
  EXPECT_DOUBLE_EQ(bench::percentile({7}, 90), 7);
  EXPECT_THROW(bench::percentile({}, 50), std::invalid_argument);
  EXPECT_THROW(bench::percentile({1, 2}, 101), std::invalid_argument);
}

TEST(BenchCounting, DerivedMetrics) {
  // 1 GB of weights in 500 us: 2000 GB/s, half of a 4000 GB/s copy; 5e10 FLOP in 500 us: 100 TFLOP/s.
  const double wb = 1e9, io = 1e8, flops = 5e10;
  const bench::Metrics m = bench::derive_metrics(500.0, wb, io, flops, 4000.0, 800.0);
  EXPECT_NEAR(m.gbps, 2000.0, 1e-9);
  EXPECT_NEAR(m.ratio_copy, 0.5, 1e-12);
  EXPECT_NEAR(m.tflops, 100.0, 1e-9);
  EXPECT_NEAR(m.ratio_gemm, 0.125, 1e-12);
  EXPECT_NEAR(m.floor_mem_us, 1.1e9 / 4e12 * 1e6, 1e-9);  // 275 us
  EXPECT_NEAR(m.floor_compute_us, 62.5, 1e-9);  // 5e10 / 8e14 s
  EXPECT_NEAR(m.floor_us, 275.0, 1e-9);
  EXPECT_NEAR(m.time_over_floor, 500.0 / 275.0, 1e-12);
  // Compute-bound: the compute term is the floor.
  const bench::Metrics c = bench::derive_metrics(1000.0, 1e6, 0, 4e11, 4000.0, 800.0);  // 4e11 / 8e14 s = 500 us
  EXPECT_NEAR(c.floor_us, 500.0, 1e-9);
  // Unknown GEMM ceiling: no ratio, the memory term alone.
  const bench::Metrics u = bench::derive_metrics(1000.0, 4e9, 0, 4e14, 4000.0, 0.0);
  EXPECT_EQ(u.ratio_gemm, 0.0);
  EXPECT_NEAR(u.floor_us, 1000.0, 1e-9);
  EXPECT_NEAR(u.time_over_floor, 1.0, 1e-12);
  EXPECT_THROW(bench::derive_metrics(0.0, 1, 1, 1, 1, 1), std::invalid_argument);
  EXPECT_DOUBLE_EQ(bench::io_bytes(3, 16, 8, true), 3.0 * (32 + 32 + 32 + 4));
}

TEST(BenchCounting, ListParsing) {
  EXPECT_EQ(bench::parse_int_list("1,64,16384"), (std::vector<int64_t>{1, 64, 16384}));
  EXPECT_EQ(bench::parse_int_list("7"), (std::vector<int64_t>{7}));
  for (const char* bad : {"", ",", "1,", ",1", "1,,2", "-1", "1.5", "a", "1 ,2", "9999999999999"})
    EXPECT_THROW(bench::parse_int_list(bad), std::invalid_argument) << bad;
  EXPECT_EQ(bench::split_list("a,b"), (std::vector<std::string>{"a", "b"}));
  EXPECT_THROW(bench::split_list("a,"), std::invalid_argument);
}

TEST(BenchOptions, ActivationVariants) {
  ModelShape s = *find_model_shape("kimi_k3_tp8");
  ASSERT_TRUE(bench::activation_variant("swiglu", s));
  EXPECT_EQ(s.activation, ActivationType::Swiglu);
  EXPECT_EQ(s.alpha, 1.f);
  EXPECT_EQ(s.beta, 0.f);
  ASSERT_TRUE(bench::activation_variant("situ", s));
  EXPECT_EQ(s.activation, ActivationType::Situ);
  EXPECT_EQ(s.alpha, 4.f);
  EXPECT_EQ(s.beta, 25.f);
  ASSERT_TRUE(bench::activation_variant("swiglubias", s));
  EXPECT_EQ(s.activation, ActivationType::SwigluBias);
  EXPECT_EQ(s.clamp_limit, 7.f);
  const ModelShape before = s;
  EXPECT_FALSE(bench::activation_variant("gelu", s));  // non-gated: not offered
  EXPECT_EQ(s.activation, before.activation);
  EXPECT_EQ(s.H, before.H);
}

// The table's "/ base" column: the LoRA row over the same shape and T without LoRA, nothing otherwise.
TEST(BenchTable, LoraOverBase) {
  struct Row {
    std::string shape;
    int64_t T;
    bool lora;
    std::string status;
    double median_us;
  };
  const std::vector<Row> rows = {{"kimi", 64, false, "ok", 250.0}, {"kimi", 64, true, "ok", 330.0},
                                 {"kimi", 1, true, "ok", 47.0},    {"qwen", 64, false, "unsupported", 0.0},
                                 {"qwen", 64, true, "ok", 200.0},  {"kimi", 1, false, "ok", 33.0}};
  EXPECT_DOUBLE_EQ(bench::lora_over_base(rows, rows[1]), 330.0 / 250.0);
  EXPECT_DOUBLE_EQ(bench::lora_over_base(rows, rows[2]), 47.0 / 33.0);  // the base row may come later
  EXPECT_EQ(bench::lora_over_base(rows, rows[0]), 0.0);                 // not a LoRA row
  EXPECT_EQ(bench::lora_over_base(rows, rows[4]), 0.0);                 // its base did not run
}

}  // namespace
}  // namespace fp4moe
