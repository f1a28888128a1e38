// Multi-LoRA in the CUDA MoE pipeline (SPEC §5) against the CPU reference, and its bit-identity
// invariants: zero-B adapters equal base, base tokens in a mixed batch equal base alone, loading and
// unloading adapters never changes other tokens, sub-batches equal the full batch, every tile gives the same
// bits. Bad adapter ids, workspaces, CUDA graphs, resident adapters and faults: test_lora_gpu_runtime.cpp.
// Each test skips without a GPU. Lines starting with "STAT" are collected by tools/device/.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/kernels.h"
#include "gpu_harness.h"
#include "lora_harness.h"
#include "runtime/plan.h"

namespace fp4moe::gputest {
namespace {

// ---- the three layouts, ranks 1..64 mixed in one batch ---------------------------------------------------
void load_mixed_layouts(Registries& R, const Layer& layer) {
  const AdapterSpec specs[] = {
      {LoraLayout::PerExpert, 1, false, false, 101},  {LoraLayout::PeftFused, 8, false, false, 102},
      {LoraLayout::SharedOuter, 16, false, false, 103}, {LoraLayout::PerExpert, 64, false, false, 104},
      {LoraLayout::PeftFused, 64, false, false, 105}, {LoraLayout::SharedOuter, 1, false, false, 106},
      {LoraLayout::PerExpert, 16, false, false, 107}, {LoraLayout::SharedOuter, 64, false, false, 108},
  };
  for (int i = 0; i < 8; ++i) R.load(i, layer, specs[i]);
}

void layouts_case(Case c, const char* label) {
  auto layer = make_layer(c);
  Registries R(*layer, 10);
  load_mixed_layouts(R, *layer);
  check_against_reference(c, *layer, R, cycle_ids(c.T, 8), label);
}

// The eight layouts and ranks above on qwen3_30b_a3b experts, one row a variant of the layer.
struct LayoutVariant {
  const char* name;  // the test's name
  const char* label;
  int64_t E_loc, E_total, offset, T;
  ActMode mode;
  GateUpOrder order;
  bool per_token_x_scale;
  WeightFormat format;
  bool bias, delta;
  ActivationType activation;
  uint64_t seed;
};
const LayoutVariant kLayoutVariants[] = {
    {"QwenLayoutsMixedRanksA16", "qwen A16 nvfp4 gate-first", 16, 16, 0, 27, ActMode::A16, GateUpOrder::GateFirst,
     false, WeightFormat::NVFP4, false, false, ActivationType::Swiglu, 31},
    {"QwenLayoutsMixedRanksA4UpFirst", "qwen A4 nvfp4 up-first per-token", 16, 16, 0, 18, ActMode::A4,
     GateUpOrder::UpFirst, true, WeightFormat::NVFP4, false, false, ActivationType::Swiglu, 32},
    // The gate_up_lora_delta bridge and registry LoRA together, on an expert-parallel shard.
    {"QwenBf16BiasExpertParallel", "qwen A16 bf16 bias EP 8/16 + bridge", 8, 16, 4, 18, ActMode::A16,
     GateUpOrder::GateFirst, false, WeightFormat::BF16, true, true, ActivationType::Swiglu, 33},
    {"NonGatedRelu2", "qwen Relu2 (non-gated) A16", 8, 8, 0, 18, ActMode::A16, GateUpOrder::GateFirst, false,
     WeightFormat::NVFP4, false, false, ActivationType::Relu2, 34},
};

void PrintTo(const LayoutVariant& v, std::ostream* os) { *os << v.name; }

class GpuLoraLayouts : public ::testing::TestWithParam<LayoutVariant> {};
TEST_P(GpuLoraLayouts, MatchReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const LayoutVariant& v = GetParam();
  Case c;
  c.shape = model("qwen3_30b_a3b");
  c.shape.activation = v.activation;
  c.E_loc = v.E_loc;
  c.E_total = v.E_total;
  c.offset = v.offset;
  c.T = c.check_tokens = v.T;
  c.mode = v.mode;
  c.order = v.order;
  c.per_token_x_scale = v.per_token_x_scale;
  c.format = v.format;
  c.bias = v.bias;
  c.delta = v.delta;
  c.seed = v.seed;
  layouts_case(c, v.label);
}
INSTANTIATE_TEST_SUITE_P(Qwen, GpuLoraLayouts, ::testing::ValuesIn(kLayoutVariants),
                         [](const ::testing::TestParamInfo<LayoutVariant>& i) { return std::string(i.param.name); });

// Decode with LoRA, one entry a tile (plan.entry_tiles: no permutation, the shrinks by entry), against the reference:
// on qwen3_30b_a3b's full layer of 128 experts, and on an expert-parallel shard whose entries partly go to others.
TEST(GpuLora, DecodeEntryTiles) {
  FP4MOE_SKIP_WITHOUT_GPU();
  struct Variant { int64_t E_loc, offset, T; uint64_t seed; const char* label; };
  for (const Variant& v : {Variant{128, 0, 4, 41, "qwen decode entry tiles"},
                           Variant{64, 32, 3, 42, "qwen decode entry tiles EP 64/128"}}) {
    Case c;
    c.shape = model("qwen3_30b_a3b");
    c.E_loc = v.E_loc;
    c.E_total = 128;
    c.offset = v.offset;
    c.T = c.check_tokens = v.T;
    c.seed = v.seed;
    ProblemShape ps = problem_shape(c);
    ps.has_lora = true;
    ps.max_lora_rank = 64;
    ASSERT_TRUE(make_plan(ps).entry_tiles) << v.label << ": the plan should run entry tiles";
    layouts_case(c, v.label);
  }
}

// Mixtral's I = 14336: the shrink of a (K = I) has 28 chunks of kKChunk, more than one round of the shrink
// kernels' partial sums (src/cuda/lora.cu block_shrink carries the sum across rounds).
TEST(GpuLora, MixtralLongKShrink) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("mixtral_8x7b");
  c.E_loc = c.E_total = 4;
  c.T = 10;
  c.check_tokens = 10;
  c.seed = 35;
  layouts_case(c, "mixtral-like I=14336 A16");
}

// ---- Kimi shape with a shared expert carrying its own LoRA, SiTU, A16 and A4 ------------------------------
void kimi_shared_case(ActMode mode, const char* label) {
  Case c;
  c.shape = model("kimi_k3_tp8");
  c.E_loc = c.E_total = 16;
  c.T = 15;
  c.check_tokens = 15;
  c.mode = mode;
  c.shared = true;
  c.shared_I = 384;
  c.seed = mode == ActMode::A4 ? 42 : 41;
  auto layer = make_layer(c);
  Registries R(*layer, 6);
  R.load(0, *layer, {LoraLayout::PeftFused, 16, false, true, 201});
  R.load(1, *layer, {LoraLayout::PerExpert, 8, false, true, 202});
  R.load(2, *layer, {LoraLayout::SharedOuter, 64, false, true, 203});
  R.load(3, *layer, {LoraLayout::PeftFused, 1, false, false, 204});   // no shared-expert LoRA
  R.load(4, *layer, {LoraLayout::PerExpert, 64, true, true, 205});    // zero B everywhere: equals base
  check_against_reference(c, *layer, R, cycle_ids(c.T, 5), label);
}

TEST(GpuLora, KimiSharedExpertLoraA16) { FP4MOE_SKIP_WITHOUT_GPU(); kimi_shared_case(ActMode::A16, "kimi shared-expert LoRA A16"); }
TEST(GpuLora, KimiSharedExpertLoraA4) { FP4MOE_SKIP_WITHOUT_GPU(); kimi_shared_case(ActMode::A4, "kimi shared-expert LoRA A4"); }

// ---- bit-identity invariants ------------------------------------------------------------------------------
// The tokens `sub` of a batch (inputs in, adapter ids ids, output y) run alone as one batch: each must give its row
// of y bit for bit (what: the failure message's end).
void expect_sub_batch_equal(const Case& c, const Inputs& in, const Layer& layer, Registries& R, const std::vector<int32_t>& ids,
                            const std::vector<int64_t>& sub, const std::vector<uint16_t>& y, const std::string& what) {
  const int64_t H = in.H;
  Case cs = c;
  cs.T = static_cast<int64_t>(sub.size());
  const Inputs is = sub_inputs(in, sub);
  std::vector<int32_t> sids;
  for (int64_t t : sub) sids.push_back(ids[t]);
  LoraCall sc{make_gpu_call(cs, is, layer), DevBuf()};
  const std::vector<uint16_t> ys = sc.run(layer, R.gpu.get(), sids);
  for (size_t i = 0; i < sub.size(); ++i)
    EXPECT_TRUE(std::equal(ys.begin() + i * H, ys.begin() + (i + 1) * H, y.begin() + sub[i] * H))
        << "token " << sub[i] << " (slot " << ids[sub[i]] << ") differs " << what;
}

void invariants(ActMode mode) {
  Case c;
  c.shape = model("qwen3_30b_a3b");
  c.E_loc = c.E_total = 16;
  c.T = 41;
  c.mode = mode;
  c.shared = true;
  c.shared_I = 512;
  c.seed = mode == ActMode::A4 ? 52 : 51;
  const std::string m = mode == ActMode::A4 ? " (A4)" : " (A16)";
  auto layer = make_layer(c);
  Registries R(*layer, 8);
  R.load(0, *layer, {LoraLayout::PeftFused, 16, false, true, 301});
  R.load(1, *layer, {LoraLayout::PerExpert, 8, false, true, 302});
  R.load(2, *layer, {LoraLayout::SharedOuter, 64, false, true, 303});
  R.load(3, *layer, {LoraLayout::PeftFused, 16, true, true, 304});    // zero B
  R.load(4, *layer, {LoraLayout::PerExpert, 8, true, true, 305});     // zero B
  R.load(5, *layer, {LoraLayout::SharedOuter, 4, true, true, 306});   // zero B
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const int64_t T = c.T, H = in.H;

  const std::vector<uint16_t> y_none = call.run(*layer, nullptr, {});
  const std::vector<int32_t> all_base(static_cast<size_t>(T), -1);
  EXPECT_EQ(call.run(*layer, R.gpu.get(), all_base), y_none) << "registry given, every token base" << m;

  const std::vector<int32_t> ids = cycle_ids(T, 6);  // -1, 0..5
  const std::vector<uint16_t> y_mixed = call.run(*layer, R.gpu.get(), ids);
  EXPECT_EQ(count_poison(y_mixed), 0);
  int changed = 0;
  for (int64_t t = 0; t < T; ++t) {
    const bool base_like = ids[t] < 0 || ids[t] >= 3;  // base, or a zero-B adapter
    if (base_like) EXPECT_TRUE(row_equal(y_mixed, y_none, t, H)) << "token " << t << " (slot " << ids[t] << ") differs from base" << m;
    else changed += !row_equal(y_mixed, y_none, t, H);
  }
  EXPECT_EQ(changed, static_cast<int>(std::count_if(ids.begin(), ids.end(), [](int32_t v) { return v >= 0 && v < 3; })))
      << "every token of a non-zero adapter changes" << m;
  EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y_mixed) << "a second call differs" << m;

  // Loading into a free slot and replacing slot 1 changes only slot 1's tokens; unloading back neither.
  R.load(6, *layer, {LoraLayout::SharedOuter, 32, false, true, 307});
  R.load(1, *layer, {LoraLayout::PeftFused, 64, false, true, 308});
  const std::vector<uint16_t> y_reload = call.run(*layer, R.gpu.get(), ids);
  for (int64_t t = 0; t < T; ++t) {
    if (ids[t] == 1) EXPECT_FALSE(row_equal(y_reload, y_mixed, t, H)) << "token " << t << " kept the replaced adapter" << m;
    else EXPECT_TRUE(row_equal(y_reload, y_mixed, t, H)) << "token " << t << " changed by another slot's load" << m;
  }
  R.unload(6);
  EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y_reload) << "unloading an unused slot changed the output" << m;

  // Sub-batches: a token's bits do not depend on the other tokens nor on their adapters. Token 0 alone is base: at
  // decode its a shrink has no LoRA row, and GEMM2 beside that shrink still reads GEMM1's finished a.
  for (const std::vector<int64_t>& sub : {std::vector<int64_t>{0}, std::vector<int64_t>{2}, std::vector<int64_t>{1, 3, 9, 40}})
    expect_sub_batch_equal(c, in, *layer, R, ids, sub, y_reload, "in a sub-batch" + m);
  EXPECT_NO_THROW(check_device_errors(0));
}

TEST(GpuLoraInvariants, BitIdentityA16) { FP4MOE_SKIP_WITHOUT_GPU(); invariants(ActMode::A16); }
TEST(GpuLoraInvariants, BitIdentityA4) { FP4MOE_SKIP_WITHOUT_GPU(); invariants(ActMode::A4); }

// Every GEMM tile forced in turn (MoeArgs::gemm_tile) gives the bits y of the plan's own choice; leaves Auto set.
void expect_same_bits_on_every_tile(LoraCall& call, const Layer& layer, Registries& R, const std::vector<int32_t>& ids,
                                    const std::vector<uint16_t>& y) {
  for (int tile = 0; tile < kNumGemmConfigs; ++tile) {
    if (kGemmConfigs[tile].wgmma && !cuda_backend::wgmma_supported_on(0)) continue;
    call.g->args.gemm_tile = static_cast<GemmTile>(tile);
    EXPECT_TRUE(call.run(layer, R.gpu.get(), ids) == y) << "tile " << tile << " differs";
  }
  call.g->args.gemm_tile = GemmTile::Auto;
}

// ---- many adapters in one tile: at 80 rows an expert of nine adapter classes (base and eight slots), ranks 1, 8,
// 16 and 64 and the three layouts, every tile's epilogue runs several adapter passes a token group; against the
// reference, and the same bits on every tile ---------------------------------------------------------------------
TEST(GpuLora, ManyAdaptersATileEveryTile) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b");
  c.E_loc = c.E_total = 16;
  c.T = 160;  // 1280 rows: 80 an expert, of nine adapter classes (base and eight slots)
  c.check_tokens = 12;
  c.seed = 95;
  auto layer = make_layer(c);
  Registries R(*layer, 10);
  load_mixed_layouts(R, *layer);
  const std::vector<int32_t> ids = cycle_ids(c.T, 8);
  check_against_reference(c, *layer, R, ids, "many adapters a tile");
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<uint16_t> y = call.run(*layer, R.gpu.get(), ids);
  EXPECT_EQ(count_poison(y), 0);
  expect_same_bits_on_every_tile(call, *layer, R, ids, y);
  EXPECT_NO_THROW(check_device_errors(0));
}

// ---- the tiled LoRA shrinks (many rows an expert, many tiles: plan.lora_shrink_tiled) give the per-token and per-row
// kernels' bits: a 2400-token batch (tiled) against sub-batches of its tokens (per-token), every layout mixed -------
TEST(GpuLoraInvariants, TiledShrinkEqualsPerTokenShrink) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("kimi_k3_tp8");
  c.E_loc = c.E_total = 16;
  c.T = 2400;  // 19200 rows: 1200 an expert, 316 tiles of 64
  c.seed = 91;
  auto plan_of = [&](int64_t T) {
    ProblemShape ps = problem_shape(c);
    ps.T = T;
    ps.has_lora = true;
    ps.max_lora_rank = 64;
    return make_plan(ps);
  };
  ASSERT_TRUE(plan_of(c.T).lora_shrink_tiled) << "the full batch should take the tiled shrinks";
  ASSERT_EQ(plan_of(c.T).num_chunks, 1);
  ASSERT_FALSE(plan_of(7).lora_shrink_tiled) << "the 7-token sub-batch should take the per-token shrinks";
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  R.load(0, *layer, {LoraLayout::PeftFused, 16, false, false, 501});
  R.load(1, *layer, {LoraLayout::PerExpert, 64, false, false, 502});
  R.load(2, *layer, {LoraLayout::SharedOuter, 8, false, false, 503});
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<int32_t> ids = cycle_ids(c.T, 3);  // -1, 0, 1, 2
  const std::vector<uint16_t> y = call.run(*layer, R.gpu.get(), ids);
  EXPECT_EQ(count_poison(y), 0);
  // The full batch with every tile forced (MoeArgs::gemm_tile: the plan's 64-token wgmma tile at 1200 rows an expert,
  // the mma.sync tiles it takes for kimi's thin experts, I = 384, below 80): the same bits.
  expect_same_bits_on_every_tile(call, *layer, R, ids, y);
  expect_sub_batch_equal(c, in, *layer, R, ids, {1, 2, 3, 4, 6, 1201, 2399}, y, "with the per-token shrinks");
  EXPECT_NO_THROW(check_device_errors(0));
}

}  // namespace
}  // namespace fp4moe::gputest
