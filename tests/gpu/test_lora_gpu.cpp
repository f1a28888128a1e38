// Multi-LoRA in the CUDA MoE pipeline (SPEC §5) against the CPU reference, and its bit-identity
// invariants: zero-B adapters equal base, base tokens in a mixed batch equal base alone, loading and
// unloading adapters never changes other tokens, sub-batches equal the full batch, out-of-range adapter
// ids are dropped and flagged, CUDA graph capture and replay. Each test skips without a GPU.
// Lines starting with "STAT" are collected by tools/device/.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cuda/kernels.h"
#include "runtime/plan.h"
#include "gpu_harness.h"

namespace fp4moe::gputest {
namespace {

constexpr double kRelL2A16 = 1e-2, kRelL2A4 = 3e-2;  // whole output vs the Fp32 reference (as test_moe_gpu)
constexpr double kDeltaA16 = 0.1, kDeltaA4 = 0.3;      // the LoRA contribution alone, per adapter slot

ModelShape model(const char* name) {
  const ModelShape* m = find_model_shape(name);
  if (!m) std::abort();
  return *m;
}

struct AdapterSpec {
  LoraLayout layout = LoraLayout::PeftFused;
  int64_t rank = 8;
  bool zero_b = false;
  bool shared_lora = false;  // also a LoRA on the shared expert (when the layer has one)
  uint64_t seed = 1;
};

// An adapter with owned storage: the routed part from make_synthetic_adapter, plus the shared expert's own.
struct OwnedAdapter {
  SyntheticAdapter a;
  std::vector<uint16_t> sa1, sb1, sa2, sb2;
  int64_t r = 0, H = 0, N1s = 0, Is = 0;
  bool gated = true;
  LoraAdapterDesc desc() {
    LoraAdapterDesc d = a.desc();
    if (!gated) d.a_up = d.b_up = TensorView{};  // PerExpert on a non-gated layer: the gate pair only
    if (!sa1.empty()) {
      d.shared_a_gate_up = make_view(sa1.data(), DType::BF16, {r, H});
      d.shared_b_gate_up = make_view(sb1.data(), DType::BF16, {N1s, r});
      d.shared_a_down = make_view(sa2.data(), DType::BF16, {r, Is});
      d.shared_b_down = make_view(sb2.data(), DType::BF16, {H, r});
    }
    return d;
  }
};

std::unique_ptr<OwnedAdapter> make_adapter(const Layer& l, const AdapterSpec& s) {
  auto o = std::make_unique<OwnedAdapter>();
  o->a = make_synthetic_adapter(l.L, s.rank, s.seed, s.layout, s.zero_b);
  o->gated = l.L.gated;
  if (s.shared_lora && l.has_shared) {
    o->r = s.rank;
    o->H = l.S.H;
    o->Is = l.S.I;
    o->N1s = l.S.gated ? 2 * l.S.I : l.S.I;
    const float sd_b = 0.05f / std::sqrt(static_cast<float>(s.rank));
    o->sa1 = random_bf16(o->r * o->H, s.seed * 11 + 1, 1.f / std::sqrt(static_cast<float>(o->H)));
    o->sa2 = random_bf16(o->r * o->Is, s.seed * 11 + 3, 1.f / std::sqrt(static_cast<float>(o->Is)));
    if (s.zero_b) {
      o->sb1.assign(static_cast<size_t>(o->N1s * o->r), 0);
      o->sb2.assign(static_cast<size_t>(o->H * o->r), 0);
    } else {
      o->sb1 = random_bf16(o->N1s * o->r, s.seed * 11 + 2, sd_b);
      o->sb2 = random_bf16(o->H * o->r, s.seed * 11 + 4, sd_b);
    }
  }
  return o;
}

// The same adapters in a CPU registry (for the reference) and a GPU registry.
struct Registries {
  std::unique_ptr<AdapterRegistry> cpu, gpu;
  Registries(const Layer& l, int slots)
      : cpu(std::make_unique<AdapterRegistry>(l.cpu, slots, l.has_shared ? &l.scpu : nullptr)),
        gpu(std::make_unique<AdapterRegistry>(l.gpu, slots, l.has_shared ? &l.sgpu : nullptr)) {}
  void load(int slot, const Layer& l, const AdapterSpec& s) {
    auto a = make_adapter(l, s);
    const LoraAdapterDesc d = a->desc();
    cpu->load(slot, d);
    gpu->load(slot, d);
  }
  void unload(int slot) {
    cpu->unload(slot);
    gpu->unload(slot);
  }
};

// A GPU call with (or without: reg null) registry LoRA; returns y's bits.
struct LoraCall {
  std::unique_ptr<GpuCall> g;
  DevBuf ids;
  std::vector<uint16_t> run(const Layer& l, const AdapterRegistry* reg, const std::vector<int32_t>& aids,
                            cudaStream_t stream = nullptr) {
    set(reg, aids);
    return run_gpu(l.gpu, *g, stream);
  }
  void set(const AdapterRegistry* reg, const std::vector<int32_t>& aids) {
    if (reg) {
      // Re-used when the size matches: a captured graph keeps pointing at this buffer.
      if (ids.bytes() != aids.size() * sizeof(int32_t)) ids = DevBuf::from(aids);
      else cuda_check_abort(cudaMemcpy(ids.get(), aids.data(), ids.bytes(), cudaMemcpyHostToDevice), "upload ids");
      g->args.adapters = reg;
      g->args.adapter_ids = dview(ids, DType::I32, {static_cast<int64_t>(aids.size())});
    } else {
      g->args.adapters = nullptr;
      g->args.adapter_ids = TensorView{};
    }
  }
};

bool row_equal(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t t, int64_t H) {
  return std::equal(a.begin() + t * H, a.begin() + (t + 1) * H, b.begin() + t * H);
}

// One case against the Fp32 reference (same rounding points): the whole output, then the LoRA
// contribution alone per adapter slot, (y_lora - y_base) on the GPU vs the same difference in the reference.
// Base tokens of the mixed batch must equal the base run bit for bit.
void check_against_reference(const Case& c, const Layer& l, Registries& R, const std::vector<int32_t>& aids,
                             const char* label) {
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, l), DevBuf()};
  const std::vector<uint16_t> y_base = call.run(l, nullptr, aids);
  const std::vector<uint16_t> y = call.run(l, R.gpu.get(), aids);
  EXPECT_EQ(count_poison(y), 0) << label << ": elements of y not written";
  EXPECT_NO_THROW(check_device_errors(0)) << label;
  const int64_t H = in.H;
  for (int64_t t = 0; t < c.T; ++t)
    if (aids[t] < 0) EXPECT_TRUE(row_equal(y, y_base, t, H)) << label << ": base token " << t << " differs from base";

  const auto toks = check_tokens(c.T, c.check_tokens);
  const bool a4 = c.mode == ActMode::A4;
  const std::vector<double> ref = run_reference(c, in, l, toks, Precision::Fp32, nullptr, R.cpu.get(), &aids);
  const std::vector<double> ref_base = run_reference(c, in, l, toks, Precision::Fp32);
  const Errors e = compare(y, ref, toks, H);
  EXPECT_EQ(e.nonfinite, 0) << label;
  EXPECT_LE(e.rel_l2, a4 ? kRelL2A4 : kRelL2A16) << label;

  // Per slot: || (y - y_base) - (ref - ref_base) || / || ref - ref_base ||.
  std::map<int32_t, std::array<double, 3>> per_slot;  // num, den, |ref|^2
  for (size_t i = 0; i < toks.size(); ++i) {
    const int64_t t = toks[i];
    if (aids[t] < 0) continue;
    auto& acc = per_slot[aids[t]];
    for (int64_t h = 0; h < H; ++h) {
      const double dg = static_cast<double>(bf16_bits_to_f32(y[t * H + h])) - bf16_bits_to_f32(y_base[t * H + h]);
      const double dr = ref[i * H + h] - ref_base[i * H + h];
      acc[0] += (dg - dr) * (dg - dr);
      acc[1] += dr * dr;
      acc[2] += ref[i * H + h] * ref[i * H + h];
    }
  }
  for (const auto& [slot, acc] : per_slot) {
    const double rel = acc[1] > 0 ? std::sqrt(acc[0] / acc[1]) : std::sqrt(acc[0]);
    const double visible = std::sqrt(acc[1] / std::max(acc[2], 1e-30));
    std::printf("STAT lora %-44s slot %d: delta relL2=%.3e (delta/|y|=%.3e)\n", label, slot, rel, visible);
    if (acc[1] == 0) {
      EXPECT_EQ(acc[0], 0.0) << label << " slot " << slot << ": a zero-B adapter changed the output";
    } else {
      EXPECT_LE(rel, a4 ? kDeltaA4 : kDeltaA16) << label << " slot " << slot;
      EXPECT_GT(visible, 1e-3) << label << " slot " << slot << ": the LoRA delta is too small to test";
    }
  }
  std::printf("STAT lora %-44s T=%-5lld relL2=%.3e cos=%.8f\n", label, static_cast<long long>(c.T), e.rel_l2, e.cosine);
}

std::vector<int32_t> cycle_ids(int64_t T, int num_slots) {
  std::vector<int32_t> v(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) v[t] = static_cast<int32_t>(t % (num_slots + 1)) - 1;  // -1, 0, 1, ...
  return v;
}

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

// ---- adapter ids only on the GPU: out of range or naming an empty slot -> dropped to base and flagged -------
TEST(GpuLoraDeviceErrors, BadAdapterIdsSetFlag) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b_tp4");
  c.E_loc = c.E_total = 16;
  c.T = 20;
  c.shared = true;
  c.shared_I = 192;
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  R.load(0, *layer, {LoraLayout::PeftFused, 8, false, true, 401});
  R.load(1, *layer, {LoraLayout::SharedOuter, 16, false, true, 402});
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  check_device_errors(0);  // clean start
  std::vector<int32_t> good = cycle_ids(c.T, 2), bad = good;
  bad[3] = 999;
  bad[7] = -7;
  bad[11] = 2;   // empty slot
  bad[15] = 4;   // == num_slots
  for (int64_t t : {3, 7, 11, 15}) good[t] = -1;
  const std::vector<uint16_t> y_bad = call.run(*layer, R.gpu.get(), bad);
  EXPECT_EQ(count_poison(y_bad), 0);
  try {
    check_device_errors(0);
    ADD_FAILURE() << "expected DeviceFault";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::DeviceFault) << e.what();
    EXPECT_EQ(e.argument(), "adapter_ids") << e.what();
  }
  EXPECT_NO_THROW(check_device_errors(0)) << "the flag is cleared once reported";
  // Dropped tokens run as base; every other token is unaffected.
  EXPECT_EQ(call.run(*layer, R.gpu.get(), good), y_bad);
  EXPECT_NO_THROW(check_device_errors(0)) << "a clean call leaves the flag clear";
}

// ---- a given workspace must be sized with has_lora; many tokens run in chunks with LoRA ------------------------
TEST(GpuLoraWorkspace, GivenWorkspaceAndChunks) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("kimi_k3_tp8");
  c.E_loc = c.E_total = 16;
  c.T = 9000;
  c.check_tokens = 8;
  c.seed = 61;
  c.workspace_budget = int64_t(512) << 20;  // three chunks of 3000 tokens
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  R.load(0, *layer, {LoraLayout::PeftFused, 16, false, false, 601});
  R.load(1, *layer, {LoraLayout::PerExpert, 8, false, false, 602});
  R.load(2, *layer, {LoraLayout::SharedOuter, 16, false, false, 603});
  ProblemShape ps = problem_shape(c);
  const size_t no_lora = workspace_size(ps);
  ps.has_lora = true;  // max_lora_rank 0: sized for rank 64
  const size_t with_lora = workspace_size(ps);
  ASSERT_GT(with_lora, no_lora);
  EXPECT_GT(make_plan(ps).num_chunks, 1);
  check_against_reference(c, *layer, R, cycle_ids(c.T, 3), "kimi chunked T=9000");

  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<int32_t> ids = cycle_ids(c.T, 3);
  const std::vector<uint16_t> y = call.run(*layer, R.gpu.get(), ids);
  DevBuf small(no_lora), big(with_lora);
  call.g->args.workspace = dview(small, DType::U8, {static_cast<int64_t>(small.bytes())});
  try {
    call.run(*layer, R.gpu.get(), ids);
    ADD_FAILURE() << "a workspace sized without LoRA was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "workspace") << e.what();
  }
  call.g->args.workspace = dview(big, DType::U8, {static_cast<int64_t>(big.bytes())});
  EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y) << "given workspace differs from the internal one";
  call.g->args.workspace = TensorView{};
  // One chunk (the default budget): ~4500 rows an expert, ordered by adapter in three segments (permute.cu).
  ps.workspace_budget = 0;
  EXPECT_EQ(make_plan(ps).num_chunks, 1);
  call.g->args.workspace_budget = 0;
  EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y) << "one chunk differs from three";
}

// ---- CUDA graphs: capture after a warm call, and the first call after a load captured directly -----------------
TEST(GpuLoraGraphs, CaptureAndReplay) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b");
  c.E_loc = c.E_total = 16;
  c.T = 33;
  c.shared = true;
  c.shared_I = 256;
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  R.load(0, *layer, {LoraLayout::PerExpert, 16, false, true, 501});
  R.load(1, *layer, {LoraLayout::SharedOuter, 8, false, true, 502});
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<int32_t> ids = cycle_ids(c.T, 3);  // slot 2 loaded below
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // Captures one call on s (the call's arguments as set); null when the capture failed (recorded).
  auto capture = [&](const char* what) -> cudaGraphExec_t {
    call.g->args.stream = s;
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess) << what;
    std::string err;
    try {
      moe_run(layer->gpu, call.g->args);
    } catch (const Error& e) {
      err = e.what();
    }
    const cudaError_t end = cudaStreamEndCapture(s, &graph);
    EXPECT_TRUE(err.empty()) << what << ": moe_run failed under capture: " << err;
    EXPECT_EQ(end, cudaSuccess) << what << ": " << cudaGetErrorString(end);
    if (!err.empty() || end != cudaSuccess || !graph) {
      (void)cudaGetLastError();
      return nullptr;
    }
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess) << what;
    (void)cudaGraphDestroy(graph);
    return exec;
  };
  auto replay = [&](cudaGraphExec_t exec, const std::vector<uint16_t>& expect, const char* what) {
    for (int rep = 0; rep < 2; ++rep) {
      call.g->y.fill_byte(0xff);
      ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess) << what;
      sync_with_watchdog(s);
      EXPECT_EQ(call.g->y.download<uint16_t>(), expect) << what << ": replay " << rep;
    }
  };

  // 1. After a warm call (the snapshot's slot table is cached: nothing but launches in the capture).
  const std::vector<uint16_t> y1 = call.run(*layer, R.gpu.get(), ids, s);
  if (cudaGraphExec_t exec = capture("warm snapshot")) {
    replay(exec, y1, "warm snapshot");
    CUDA_OK(cudaGraphExecDestroy(exec));
  }
  // Slot 2 is still empty here, so the tokens that name it ran as base and raised the flag (SPEC §6).
  EXPECT_THROW(check_device_errors(0), Error) << "tokens naming the empty slot 2 must set the error flag";
  // 2. A load makes a new snapshot; the first call that sees it is captured (its slot table is uploaded
  //    during the capture), then replayed against a plain call.
  R.load(2, *layer, {LoraLayout::PeftFused, 32, false, false, 503});
  call.set(R.gpu.get(), ids);
  cudaGraphExec_t exec = capture("first call after a load");
  const std::vector<uint16_t> y2 = call.run(*layer, R.gpu.get(), ids, s);
  EXPECT_NE(y2, y1) << "the adapter loaded into slot 2 changed nothing";
  if (exec) {
    replay(exec, y2, "first call after a load");
    CUDA_OK(cudaGraphExecDestroy(exec));
  }
  EXPECT_NO_THROW(check_device_errors(0));
  CUDA_OK(cudaStreamDestroy(s));
}

// ---- 64 resident adapters at the full qwen3_30b_a3b layer, and load/unload racing the operator ---------------
// 64 adapters (mixed layouts, ranks 1..64) stay resident; one batch names every one of them and is checked
// against the reference. Then one thread loads and unloads two other slots over and over while this thread
// runs the operator on a non-blocking stream: every output must equal the first bit for bit (SPEC §5:
// a running batch holds its snapshot), and nothing may crash.
TEST(GpuLoraResident, SixtyFourAdaptersAndConcurrentLoads) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b");
  c.E_loc = c.E_total = c.shape.E;  // the full layer: 128 experts
  c.T = 192;
  c.check_tokens = 24;
  c.seed = 71;
  auto layer = make_layer(c);
  constexpr int kResident = 64, kSlots = kResident + 2;
  Registries R(*layer, kSlots);
  size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  const LoraLayout layouts[3] = {LoraLayout::PeftFused, LoraLayout::PerExpert, LoraLayout::SharedOuter};
  const int64_t ranks[6] = {16, 1, 64, 8, 32, 4};
  for (int i = 0; i < kResident; ++i)
    R.load(i, *layer, {layouts[i % 3], ranks[i % 6], false, false, static_cast<uint64_t>(700 + i)});
  size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  std::printf("STAT lora resident: %d adapters on the GPU, %.1f MB of device memory\n", kResident,
              (static_cast<double>(free0) - static_cast<double>(free1)) / 1e6);
  std::vector<int32_t> ids(static_cast<size_t>(c.T));
  for (int64_t t = 0; t < c.T; ++t) ids[t] = t % 3 == 2 ? -1 : static_cast<int32_t>((t * 7) % kResident);
  check_against_reference(c, *layer, R, ids, "qwen full E=128, 64 resident adapters");

  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::vector<uint16_t> y0 = call.run(*layer, R.gpu.get(), ids, s);
  std::atomic<bool> stop{false};
  std::atomic<int> loads{0};
  std::string writer_error;
  // The writer owns its adapters' storage only for the duration of a load (the registry copies).
  std::thread writer([&] {
    try {
      for (uint64_t i = 0; !stop.load(); ++i) {
        const int slot = kResident + static_cast<int>(i % 2);
        R.gpu->load(slot, make_adapter(*layer, {layouts[i % 3], ranks[i % 6], false, false, 900 + i})->desc());
        R.gpu->unload(slot);
        loads.fetch_add(1);
      }
    } catch (const std::exception& e) {
      writer_error = e.what();
    }
  });
  int differing = 0, calls = 0;
  const auto t_end = std::chrono::steady_clock::now() + std::chrono::seconds(repeats(8, 2));
  while (std::chrono::steady_clock::now() < t_end || loads.load() < 4) {
    differing += call.run(*layer, R.gpu.get(), ids, s) != y0;
    ++calls;
    if (calls > 100000) break;
  }
  stop = true;
  writer.join();
  std::printf("STAT lora concurrent: %d calls while %d load+unload pairs ran in another thread, %d differing\n", calls,
              loads.load(), differing);
  EXPECT_TRUE(writer_error.empty()) << writer_error;
  EXPECT_GE(loads.load(), 4);
  EXPECT_EQ(differing, 0) << "a load/unload in another thread changed a running batch's output";
  EXPECT_NO_THROW(check_device_errors(0));
  CUDA_OK(cudaStreamDestroy(s));
}

// ---- faults: a failing CUDA call, exhausted device memory ---------------------------------------------
// Every checked CUDA call of a LoRA call (a fresh slot table each time: a reload of the same adapter before it) is
// made to fail in turn: the call reports CudaError, and afterwards the registry and the weights still give the
// clean call's bits.
TEST(GpuFaults, EveryCheckedCudaCallFailsInTurn) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b_tp4");
  c.E_loc = c.E_total = 16;
  c.T = 48;
  c.shared = true;
  c.shared_I = 64;
  c.seed = 71;
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  const AdapterSpec spec0{LoraLayout::PeftFused, 16, false, true, 711};
  R.load(0, *layer, spec0);
  R.load(1, *layer, {LoraLayout::SharedOuter, 8, false, false, 712});
  auto a0 = make_adapter(*layer, spec0);
  const std::vector<int32_t> ids = cycle_ids(c.T, 2);
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<uint16_t> y0 = call.run(*layer, R.gpu.get(), ids);
  check_device_errors(0);
  int failures = 0, n = 0;
  for (;; ++n) {
    ASSERT_LT(n, 10000) << "the countdown never ran out";
    cuda_backend::fail_checked_cuda_call(n);
    bool threw = false;
    try {
      R.gpu->load(0, a0->desc());  // a new snapshot: the next call uploads its slot table
      call.run(*layer, R.gpu.get(), ids);
    } catch (const Error& e) {
      threw = true;
      EXPECT_EQ(e.code(), ErrorCode::CudaError) << e.what();
    }
    const bool pending = cuda_backend::checked_cuda_failure_pending();
    cuda_backend::fail_checked_cuda_call(-1);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(threw, !pending) << "call " << n << ": an injected failure must be reported, and only then";
    if (!threw) break;  // n is past the last checked call of a load + call
    ++failures;
    EXPECT_TRUE(R.gpu->loaded(0) && R.gpu->loaded(1));
    EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y0) << "after a failure at checked call " << n;
    EXPECT_NO_THROW(check_device_errors(0));
  }
  EXPECT_GT(failures, 10);
  std::printf("GpuFaults: %d checked CUDA calls in a load + LoRA call, each failed once; all recovered\n", failures);
}

// Device memory exhausted by another allocation: a call whose workspace cannot be allocated reports OutOfMemory
// with y untouched, an adapter that cannot be uploaded leaves its slot as it was, and once memory is back the
// same call gives the same bits.
TEST(GpuFaults, DeviceMemoryExhausted) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("kimi_k3_tp8");
  c.E_loc = c.E_total = 32;
  c.T = 16384;  // ~1 GB of workspace
  c.check_tokens = 4;
  c.seed = 72;
  auto layer = make_layer(c);
  Registries R(*layer, 4);
  R.load(0, *layer, {LoraLayout::PerExpert, 16, false, false, 721});
  const std::vector<int32_t> ids = cycle_ids(c.T, 1);
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, *layer), DevBuf()};
  const std::vector<uint16_t> y0 = call.run(*layer, R.gpu.get(), ids);
  auto big = make_adapter(*layer, {LoraLayout::PerExpert, 64, false, false, 722});
  // Take all but ~24 MB of the device (the stream-ordered pool trimmed first, so it holds nothing in reserve).
  CUDA_OK(cudaDeviceSynchronize());
  cudaMemPool_t pool;
  CUDA_OK(cudaDeviceGetDefaultMemPool(&pool, 0));
  CUDA_OK(cudaMemPoolTrimTo(pool, 0));
  std::vector<void*> filler;
  // Allocates until at most `keep` bytes are free (in chunks down to 64 KB); returns the bytes left free.
  auto fill_to = [&](size_t keep) -> size_t {
    for (size_t chunk = size_t(1) << 32; chunk >= (size_t(1) << 16);) {
      size_t free_b = 0, total_b = 0;
      EXPECT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
      if (free_b < keep + chunk) { chunk /= 2; continue; }
      void* p = nullptr;
      if (cudaMalloc(&p, chunk) != cudaSuccess) { (void)cudaGetLastError(); chunk /= 2; continue; }
      filler.push_back(p);
    }
    size_t free_b = 0, total_b = 0;
    EXPECT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
    return free_b;
  };
  std::printf("STAT memory test: %.1f MB free for the call\n", fill_to(size_t(24) << 20) / 1e6);
  call.g->y.fill_byte(0xff);
  try {
    moe_run(layer->gpu, call.g->args);
    ADD_FAILURE() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::OutOfMemory) << e.what();
  }
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(count_poison(call.g->y.download<uint16_t>()), c.T * c.shape.H) << "y untouched";
  // The failed call may have returned memory of its own: the load gets at most 2 MB.
  std::printf("STAT memory test: %.1f MB free for the load\n", fill_to(size_t(2) << 20) / 1e6);
  try {
    R.gpu->load(2, big->desc());  // 32 experts x rank 64: ~60 MB of matrices
    ADD_FAILURE() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::OutOfMemory) << e.what();
  }
  EXPECT_FALSE(R.gpu->loaded(2)) << "a failed load leaves the slot as it was";
  for (void* p : filler) CUDA_OK(cudaFree(p));
  EXPECT_EQ(call.run(*layer, R.gpu.get(), ids), y0) << "the next call after memory came back";
  EXPECT_NO_THROW(check_device_errors(0));
}

}  // namespace
}  // namespace fp4moe::gputest
