// GPU tests of the CUDA backend against the CPU reference (the oracle). Each test skips with
// "no CUDA device" when there is none. Lines starting with "STAT" are collected by tools/device/.
// Bad GPU-only values, a given workspace and the timings: test_moe_gpu_checks.cpp.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <random>

#include "cuda/kernels.h"
#include "runtime/plan.h"
#include "gpu_harness.h"

namespace fp4moe::gputest {
namespace {

constexpr double kRelL2A16 = 1e-2, kCosA16 = 0.9999;
constexpr double kRelL2A4 = 3e-2, kCosA4 = 0.999;  // vs the Fp32 reference (same rounding points)

// Reference tokens for a shape: about 1.5 G multiply-adds of fp64 reference work per check.
int64_t ref_tokens(const ModelShape& s, int64_t cap = 16) {
  const double per_token = static_cast<double>(s.k) * 3.0 * s.H * s.I;
  return std::max<int64_t>(2, std::min<int64_t>(cap, static_cast<int64_t>(1.5e9 / per_token)));
}

// Runs one case on the GPU and against the reference; returns the errors (and checks them).
// edit (optional) changes the generated inputs before both runs (e.g. structured logits).
Errors check_case(const Case& c, const Layer* given_layer, const char* label, bool print = true,
                  const std::function<void(Inputs&)>& edit = nullptr) {
  std::unique_ptr<Layer> own;
  if (!given_layer) own = make_layer(c);
  const Layer* layer = given_layer ? given_layer : own.get();
  Inputs in = make_inputs(c);
  if (edit) edit(in);
  auto call = make_gpu_call(c, in, *layer);
  const std::vector<uint16_t> y = run_gpu(layer->gpu, *call);
  EXPECT_EQ(count_poison(y), 0) << label << ": elements of y not written";
  const auto toks = check_tokens(c.T, c.check_tokens);
  const bool a4 = c.mode == ActMode::A4;
  std::vector<uint16_t> ref_act;
  const std::vector<double> ref = run_reference(c, in, *layer, toks, a4 ? Precision::Fp32 : Precision::Fp64,
                                                c.act_out ? &ref_act : nullptr);
  const Errors e = compare(y, ref, toks, in.H);
  EXPECT_EQ(e.nonfinite, 0) << label;
  EXPECT_LE(e.rel_l2, a4 ? kRelL2A4 : kRelL2A16) << label;
  EXPECT_GE(e.cosine, a4 ? kCosA4 : kCosA16) << label;
  if (c.act_out) {
    const std::vector<uint16_t> got = call->act_out.download<uint16_t>();
    EXPECT_EQ(count_poison(got), 0) << label << ": activation_out not fully written";
    const int64_t slot = in.k * c.shape.I;
    double num = 0, den = 0;
    for (size_t i = 0; i < toks.size(); ++i)
      for (int64_t q = 0; q < slot; ++q) {
        const double g = bf16_bits_to_f32(got[toks[i] * slot + q]), r = bf16_bits_to_f32(ref_act[i * slot + q]);
        num += (g - r) * (g - r);
        den += r * r;
      }
    EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), 1e-2) << label << ": activation_out";
  }
  if (print)
    std::printf("STAT %-40s T=%-5lld relL2=%.3e cos=%.8f maxabs=%.3e\n", label, static_cast<long long>(c.T), e.rel_l2,
                e.cosine, e.max_abs);
  return e;
}

// ---- every model shape of SPEC §1 x T, with its own activation and routing --------------------------
void model_sweep(const char* name, int64_t E_loc, int64_t E_total, int64_t offset, bool shared) {
  const int64_t Ts[] = {0, 1, 3, 8, 64, 257, 1024, 4096};
  std::unique_ptr<Layer> layer;  // one layer for all T (the synthetic weights are expensive to make)
  for (int64_t T : Ts) {
    Case c;
    c.shape = model(name);
    c.E_loc = E_loc;
    c.E_total = E_total;
    c.offset = offset;
    c.T = T;
    c.shared = shared;
    c.shared_I = c.shape.I;
    c.seed = 1000;
    c.check_tokens = ref_tokens(c.shape);
    if (!layer) layer = make_layer(c);
    const std::string label = std::string(name) + " A16 nvfp4";
    if (T == 0) {
      // T = 0 is legal: nothing is launched, nothing written.
      Inputs in = make_inputs(c);
      auto call = make_gpu_call(c, in, *layer);
      EXPECT_NO_THROW(moe_run(layer->gpu, call->args));
      continue;
    }
    check_case(c, layer.get(), label.c_str());
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(GpuModels, KimiK3Tp8) { FP4MOE_SKIP_WITHOUT_GPU(); model_sweep("kimi_k3_tp8", 32, 32, 0, true); }
TEST(GpuModels, Qwen3_30bA3b) { FP4MOE_SKIP_WITHOUT_GPU(); model_sweep("qwen3_30b_a3b", 16, 16, 0, false); }
TEST(GpuModels, Qwen3_30bA3bTp4) { FP4MOE_SKIP_WITHOUT_GPU(); model_sweep("qwen3_30b_a3b_tp4", 16, 16, 0, false); }
TEST(GpuModels, DeepseekV3Ep8) { FP4MOE_SKIP_WITHOUT_GPU(); model_sweep("deepseek_v3_ep8", 8, 64, 16, false); }
TEST(GpuModels, Mixtral8x7b) { FP4MOE_SKIP_WITHOUT_GPU(); model_sweep("mixtral_8x7b", 8, 8, 0, false); }
TEST(GpuModels, GptOss120b) { FP4MOE_SKIP_WITHOUT_GPU(); model_sweep("gpt_oss_120b", 16, 16, 0, false); }

// ---- every activation x A16/A4 x NVFP4/bf16 on kimi_k3_tp8 and gpt_oss_120b ----------------------------
constexpr ActivationType kAllActs[] = {
    ActivationType::Gelu,     ActivationType::Relu,       ActivationType::Silu,      ActivationType::Swiglu,
    ActivationType::Geglu,    ActivationType::SwigluBias, ActivationType::Relu2,     ActivationType::SwigluStep,
    ActivationType::GegluTanh, ActivationType::Identity,  ActivationType::Situ};

void activation_matrix(const char* name, int64_t T) {
  std::map<std::string, double> worst;
  for (ActivationType at : kAllActs)
    for (int mode = 0; mode < 2; ++mode)
      for (int fmt = 0; fmt < 2; ++fmt) {
        // Light mode: one of the four (mode, format) pairs per activation, each pair taken by some activation.
        if (light_mode() && (static_cast<int>(at) + 2 * mode + fmt) % 4 != 0) continue;
        Case c;
        c.shape = model(name);
        c.shape.activation = at;
        c.shape.alpha = 1.f; c.shape.beta = 0.f; c.shape.clamp_limit = 0.f;
        if (at == ActivationType::Situ) { c.shape.alpha = 4.f; c.shape.beta = 25.f; }
        if (at == ActivationType::SwigluBias) { c.shape.alpha = 1.702f; c.shape.beta = 1.f; c.shape.clamp_limit = 7.f; }
        if (at == ActivationType::SwigluStep) c.shape.clamp_limit = 7.f;
        c.E_loc = c.E_total = std::string(name) == "gpt_oss_120b" ? 4 : 8;  // fewer experts: faster reference
        c.T = T;
        c.mode = mode ? ActMode::A4 : ActMode::A16;
        c.format = fmt ? WeightFormat::BF16 : WeightFormat::NVFP4;
        c.bias = fmt == 1;
        c.order = mode ? GateUpOrder::UpFirst : GateUpOrder::GateFirst;
        c.delta = mode == 0 && fmt == 0;
        c.act_out = fmt == 0;  // A4 too: the bridge is a before the NVFP4 rounding (fused in GEMM1's epilogue or not)
        c.per_token_x_scale = mode == 1 && fmt == 1;
        c.seed = 7 + static_cast<int>(at) * 4 + mode * 2 + fmt;
        c.check_tokens = T;
        const std::string label = std::string(name) + " " + to_string(at) + (mode ? " A4" : " A16") + (fmt ? " bf16" : " nvfp4");
        const Errors e = check_case(c, nullptr, label.c_str());
        std::string key = std::string(to_string(at)) + (mode ? " A4" : " A16");
        worst[key] = std::max(worst[key], e.rel_l2);
      }
  for (const auto& [k, v] : worst) std::printf("STAT worst %-12s %-24s relL2=%.3e\n", name, k.c_str(), v);
}

TEST(GpuActivations, KimiShapeAll) { FP4MOE_SKIP_WITHOUT_GPU(); activation_matrix("kimi_k3_tp8", 12); }
TEST(GpuActivations, GptOssShapeAll) { FP4MOE_SKIP_WITHOUT_GPU(); activation_matrix("gpt_oss_120b", 6); }

// ---- determinism: calls, streams, CUDA graph replay ------------------------------------------------------
TEST(GpuDeterminism, CallsStreamsGraphs) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("kimi_k3_tp8");
  c.E_loc = c.E_total = 32;
  c.T = 257;
  c.shared = true;
  c.shared_I = 384;
  auto layer = make_layer(c);
  Inputs in = make_inputs(c);
  auto call = make_gpu_call(c, in, *layer);
  const auto y1 = run_gpu(layer->gpu, *call);
  const auto y2 = run_gpu(layer->gpu, *call);
  EXPECT_EQ(y1, y2) << "two calls differ";
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  EXPECT_EQ(run_gpu(layer->gpu, *call, s1), y1) << "stream 1 differs";
  EXPECT_EQ(run_gpu(layer->gpu, *call, s2), y1) << "stream 2 differs";

  // CUDA graph: capture one call (workspace given and internal), replay twice.
  for (int own_ws = 0; own_ws < 2; ++own_ws) {
    DevBuf ws(workspace_size(problem_shape(c)));
    call->args.workspace = own_ws ? dview(ws, DType::U8, {static_cast<int64_t>(ws.bytes())}) : TensorView{};
    call->y.fill_byte(0xff);
    call->args.stream = s1;
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    moe_run(layer->gpu, call->args);
    CUDA_OK(cudaStreamEndCapture(s1, &graph));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; ++rep) {
      call->y.fill_byte(0xff);
      CUDA_OK(cudaGraphLaunch(exec, s1));
      sync_with_watchdog(s1);
      EXPECT_EQ(call->y.download<uint16_t>(), y1) << "graph replay " << rep << " (own workspace " << own_ws << ")";
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
  }
  call->args.workspace = TensorView{};
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
}

// Block-scale codes the synthetic layers never make, which the prepared layout re-encodes
// (format/nvfp4_prepared.h): negative, +-0 and subnormal scales, against the reference.
TEST(GpuNvfp4, SpecialScaleCodes) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b");
  c.E_loc = c.E_total = 16;
  c.T = 40;
  c.seed = 4242;
  c.check_tokens = 40;
  auto special = [](std::vector<uint8_t>& sf) {
    for (size_t i = 0; i < sf.size(); ++i) {
      switch (i % 13) {
        case 0: sf[i] |= 0x80; break;                          // negative
        case 4: sf[i] = 0x00; break;                           // +0: the block's values vanish
        case 7: sf[i] = 0x80; break;                           // -0
        case 9: sf[i] = static_cast<uint8_t>(1 + i % 7); break;  // subnormal
        case 11: sf[i] = static_cast<uint8_t>(0x80 | (1 + i % 7)); break;
        default: break;
      }
    }
  };
  auto layer = make_layer(c, [&](SyntheticLayer& L) { special(L.w1_sf); special(L.w2_sf); });
  check_case(c, layer.get(), "qwen3 special scale codes");
  // (A NaN scale code is rejected when the weights are prepared — bad input, tests/cpp/test_weights.cpp.)
}

// The tokens `sub` of the batch (c, in) as a batch of their own give the rows of y they gave in it, bit for bit.
void expect_sub_batch_equal(const Case& c, const Inputs& in, const Layer& layer, const std::vector<uint16_t>& y,
                            const std::vector<int64_t>& sub, const std::string& what) {
  Case cs = c;
  cs.T = static_cast<int64_t>(sub.size());
  const Inputs is = sub_inputs(in, sub);
  auto sc = make_gpu_call(cs, is, layer);
  const auto ys = run_gpu(layer.gpu, *sc);
  for (size_t i = 0; i < sub.size(); ++i)
    EXPECT_TRUE(std::equal(ys.begin() + i * in.H, ys.begin() + (i + 1) * in.H, y.begin() + sub[i] * in.H))
        << "token " << sub[i] << " differs " << what;
}

// ---- batch invariance: a token's bits do not depend on the rest of the batch ------------------------
TEST(GpuBatchInvariance, SubBatchesEqualFullBatch) {
  FP4MOE_SKIP_WITHOUT_GPU();
  // Full batches of 300 tokens over 32 experts (75 rows an expert: the 32-row weights-as-A tile) and of 1100 over 16
  // (550 rows an expert, one chunk: the 64-row tile; both a wgmma tile on an H200; plan.cpp's thresholds) against
  // sub-batches of 1 and 4 tokens (the 8-row tile, split-K), and the full batch again with every tile forced
  // (MoeArgs::gemm_tile): mma.sync and wgmma, tokens as A or B. Modes 0-3: NVFP4 A16 / A4 with a shared expert;
  // mode 4: bf16 weights; mode 5: gpt_oss_120b's experts (600 tokens over 32: 75 rows an expert), whose GEMMs sum K
  // in three chunks of 1024, 1024 and 832 (plan.h decode_chunk_kb) and whose last n tiles leave a warpgroup of the
  // warp-specialised tile without rows.
  const bool wgmma = cuda_backend::wgmma_supported_on(0);
  std::printf("STAT batch invariance: wgmma tile %s\n", wgmma ? "on this device (compared)" : "not on this device");
  for (int mode = 0; mode < 6; ++mode) {
    Case c;
    c.shape = model(mode == 5 ? "gpt_oss_120b" : "kimi_k3_tp8");
    c.E_loc = c.E_total = mode < 2 || mode == 5 ? 32 : 16;
    c.T = mode < 2 ? 300 : mode == 5 ? 600 : 1100;
    c.mode = mode % 2 && mode < 4 ? ActMode::A4 : ActMode::A16;
    c.format = mode == 4 ? WeightFormat::BF16 : WeightFormat::NVFP4;
    c.shared = mode < 4;
    c.shared_I = 384;
    auto layer = make_layer(c);
    Inputs in = make_inputs(c);
    auto call = make_gpu_call(c, in, *layer);
    const auto y = run_gpu(layer->gpu, *call);
    ProblemShape ps = problem_shape(c);
    ps.device.wgmma = wgmma;
    // On a wgmma device the NVFP4 batches take the 128-token warp-specialised tile (75 and 550 rows an expert: from
    // kWsRows); bf16 weights the 64-token wgmma tile.
    const int wgmma_tile = mode == 4 ? 3 : 5;
    const MoePlan full = make_plan(ps);
    EXPECT_EQ(full.gemm_config, wgmma ? wgmma_tile : (mode < 2 || mode == 5 ? 1 : 2))
        << "the full batch's tile (mode " << mode << ")";
    if (mode == 5) {
      EXPECT_EQ(full.chunk1_kb, 16);
      EXPECT_EQ(full.chunk2_kb, 16);
    }
    for (int tile = 0; tile < kNumGemmConfigs; ++tile) {
      if (kGemmConfigs[tile].wgmma && !wgmma) continue;
      Case ct = c;
      ct.gemm_tile = tile;
      auto tc = make_gpu_call(ct, in, *layer);
      EXPECT_TRUE(run_gpu(layer->gpu, *tc) == y) << "tile " << tile << " differs (mode " << mode << ")";
    }
    for (const std::vector<int64_t>& sub : {std::vector<int64_t>{5}, std::vector<int64_t>{5, 17, 40, c.T - 1}})
      expect_sub_batch_equal(c, in, *layer, y, sub, "alone (mode " + std::to_string(mode) + ")");
  }
}

// ---- 200 random shapes (H, I random multiples of 16, incl. 3584, 2880, 1040) under a watchdog ------
TEST(GpuRandomShapes, TwoHundred) {
  FP4MOE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(2024);
  const int64_t named[] = {3584, 2880, 1040};
  const RoutingMethod methods[] = {RoutingMethod::Default,  RoutingMethod::Renormalize,   RoutingMethod::DeepSeekV3,
                                   RoutingMethod::Llama4,   RoutingMethod::RenormalizeNaive, RoutingMethod::TopK,
                                   RoutingMethod::SigmoidRenorm, RoutingMethod::MiniMax2, RoutingMethod::Sigmoid,
                                   RoutingMethod::TopKSigmoid};
  double worst = 0;
  const int n_shapes = repeats(200, 24);
  for (int i = 0; i < n_shapes; ++i) {
    auto dim = [&]() -> int64_t {
      const int r = static_cast<int>(rng() % 8);
      if (r < 3) return named[r];
      return 16 * std::uniform_int_distribution<int64_t>(1, 128)(rng);
    };
    Case c;
    c.shape = model("qwen3_30b_a3b");
    c.shape.H = dim();
    c.shape.I = dim();
    c.shape.activation = kAllActs[rng() % 11];
    c.shape.alpha = 1.f; c.shape.beta = c.shape.activation == ActivationType::Situ ? 2.f : 0.f; c.shape.clamp_limit = 0.f;
    c.E_loc = std::uniform_int_distribution<int64_t>(1, 4)(rng);
    c.E_total = c.E_loc + (rng() % 2) * std::uniform_int_distribution<int64_t>(1, 8)(rng);
    c.offset = std::uniform_int_distribution<int64_t>(0, c.E_total - c.E_loc)(rng);
    c.shape.routing = methods[rng() % 10];
    c.shape.k = c.shape.routing == RoutingMethod::Llama4 ? 1 : std::uniform_int_distribution<int64_t>(1, std::min<int64_t>(c.E_total, 4))(rng);
    c.shape.n_group = 1;
    c.T = std::uniform_int_distribution<int64_t>(1, 6)(rng);
    c.format = rng() % 2 ? WeightFormat::BF16 : WeightFormat::NVFP4;
    c.mode = rng() % 3 == 0 ? ActMode::A4 : ActMode::A16;
    c.precomputed = rng() % 3 == 0;
    c.bias = rng() % 2;
    c.order = rng() % 2 ? GateUpOrder::UpFirst : GateUpOrder::GateFirst;
    c.shared = rng() % 4 == 0;
    c.shared_I = 16 * std::uniform_int_distribution<int64_t>(1, 64)(rng);
    c.seed = 5000 + i;
    c.check_tokens = c.T;
    char label[160];
    std::snprintf(label, sizeof label, "random#%d H=%lld I=%lld E=%lld/%lld k=%lld %s %s %s", i,
                  static_cast<long long>(c.shape.H), static_cast<long long>(c.shape.I), static_cast<long long>(c.E_loc),
                  static_cast<long long>(c.E_total), static_cast<long long>(c.shape.k), to_string(c.shape.activation),
                  c.mode == ActMode::A4 ? "A4" : "A16", c.format == WeightFormat::BF16 ? "bf16" : "nvfp4");
    if (i % 50 == 0) { std::printf("random shapes: case %d\n", i); std::fflush(stdout); }
    const Errors e = check_case(c, nullptr, label, false);
    if (c.mode == ActMode::A16) worst = std::max(worst, e.rel_l2);
    if (HasFailure()) { std::printf("failed at %s\n", label); return; }
  }
  std::printf("STAT random-shapes worst A16 relL2=%.3e\n", worst);
}

// ---- the routing top-k where random logits do not reach: winners clustered on one lane (each lane caches its
// best three candidates; a fourth win makes the warp rescan), exact ties within and across lanes (the lower id
// first) and across expert groups, every E up to 2048 and k up to 64, against the reference's selection through
// the whole layer ----------
TEST(GpuRandomShapes, RoutingClusteredWinnersAndTies) {
  FP4MOE_SKIP_WITHOUT_GPU();
  struct R { RoutingMethod method; int64_t E, k, n_group, topk_group; bool random_bias; };  // else a zero bias
  const R rs[] = {{RoutingMethod::RenormalizeNaive, 256, 32, 1, 1, false}, {RoutingMethod::DeepSeekV3, 256, 8, 8, 4, true},
                  {RoutingMethod::DeepSeekV3, 384, 24, 1, 1, false},     {RoutingMethod::TopK, 1024, 40, 1, 1, false},
                  {RoutingMethod::Sigmoid, 2048, 64, 1, 1, false},       {RoutingMethod::Default, 100, 64, 1, 1, false},
                  // groups of 32, 40 and 8 experts with tied group scores (the lower group id first), 64 groups
                  {RoutingMethod::DeepSeekV3, 256, 8, 8, 4, false},      {RoutingMethod::DeepSeekV3, 160, 8, 4, 2, false},
                  {RoutingMethod::DeepSeekV3, 64, 6, 8, 3, false},       {RoutingMethod::DeepSeekV3, 2048, 16, 64, 5, false},
                  // a block a token (E 129..512, no groups, no sum over the experts): warps' lists of 32, 32 and 8;
                  // and 100 experts, a warp a token
                  {RoutingMethod::TopK, 512, 40, 1, 1, false},          {RoutingMethod::Sigmoid, 320, 64, 1, 1, false},
                  {RoutingMethod::MiniMax2, 256, 8, 1, 1, true},        {RoutingMethod::Renormalize, 100, 24, 1, 1, false}};
  int n = 0;
  for (const R& r : rs) {
    Case c;
    c.shape = model("qwen3_30b_a3b");
    c.shape.H = 128;
    c.shape.I = 64;
    c.shape.routing = r.method;
    c.shape.k = r.k;
    c.shape.n_group = r.n_group;
    c.shape.topk_group = r.topk_group;
    c.E_loc = c.E_total = r.E;
    c.T = 5;
    c.check_tokens = c.T;
    c.seed = 7100 + n++;
    char label[96];
    std::snprintf(label, sizeof label, "clustered %s E=%lld k=%lld groups=%lld", to_string(r.method),
                  static_cast<long long>(r.E), static_cast<long long>(r.k), static_cast<long long>(r.n_group));
    // Token t ranks lanes from (7 t) % 32 on: expert e = lane + 32 i scores 4 - 0.25 rank(lane) - 0.0625 (i / 2),
    // exact in fp32, so experts 2j and 2j+1 of a lane tie, and a lane's fifth pair ties the next lane's first.
    check_case(c, nullptr, label, true, [&](Inputs& in) {
      for (int64_t t = 0; t < in.T; ++t)
        for (int64_t e = 0; e < in.E_total; ++e) {
          const int64_t rank = ((e % 32) - 7 * t % 32 + 32) % 32, i = e / 32;
          in.logits[t * in.E_total + e] = 4.f - 0.25f * static_cast<float>(rank) - 0.0625f * static_cast<float>(i / 2);
        }
      if (!r.random_bias) std::fill(in.bias.begin(), in.bias.end(), 0.f);  // DeepSeekV3's bias would break the ties
    });
    if (HasFailure()) return;
  }
}

// ---- routing a token on a block (MoePlan::routing_warps_per_token, up to kRoutingBlockTokens tokens) gives the bits
// of a warp a token (above): a 100-token batch against sub-batches of its tokens, kimi's 384 experts (12 warps, 8
// of them local) and deepseek_v3_ep8's 256 in 8 groups (8 warps, a group each), each with its DeepSeekV3 bias, the
// same with a bias that is not finite (the flag); and against the reference -----------------------------------------
TEST(GpuBatchInvariance, BlockRoutingEqualsWarpRouting) {
  FP4MOE_SKIP_WITHOUT_GPU();
  struct R { const char* shape; int64_t E_total, offset; int warps; };
  for (const R& r : {R{"kimi_k3_tp8", 384, 40, 12}, R{"deepseek_v3_ep8", 256, 96, 8}}) {
    SCOPED_TRACE(r.shape);
    Case c;
    c.shape = model(r.shape);
    c.E_loc = 8;
    c.E_total = r.E_total;
    c.offset = r.offset;
    c.T = 100;
    c.seed = 7300;
    ProblemShape ps = problem_shape(c);
    ASSERT_EQ(make_plan(ps).routing_warps_per_token, 0) << "the full batch should route a warp a token";
    ps.T = 4;
    ASSERT_EQ(make_plan(ps).routing_warps_per_token, r.warps) << "the sub-batches should route a block a token";
    auto layer = make_layer(c);
    Inputs in = make_inputs(c);
    auto call = make_gpu_call(c, in, *layer);
    const auto y = run_gpu(layer->gpu, *call);
    for (const std::vector<int64_t>& sub : {std::vector<int64_t>{0}, std::vector<int64_t>{3, 50, 64, 99}})
      expect_sub_batch_equal(c, in, *layer, y, sub, "routed on a block");
    Case cr = c;
    cr.T = 6;
    cr.check_tokens = cr.T;
    check_case(cr, nullptr, (std::string(r.shape) + " routed on a block").c_str(), true);
    check_device_errors(0);
    Inputs bad = sub_inputs(in, {0, 1, 2});
    bad.bias[200] = NAN;
    Case cb = c;
    cb.T = 3;
    auto bc = make_gpu_call(cb, bad, *layer);
    EXPECT_EQ(count_poison(run_gpu(layer->gpu, *bc)), 0);
    try {
      check_device_errors(0);
      ADD_FAILURE() << "expected DeviceFault for a NaN bias";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "routing.bias") << e.what();
    }
  }
}

// ---- expert parallelism with every token routed to the rank: the plan expects few tiles with rows (split-K for
// them, the m-last grid order) and the batch fills every local expert's ---------------------------------------
TEST(GpuExpertParallel, EveryTokenOnTheRank) {
  FP4MOE_SKIP_WITHOUT_GPU();
  int n = 0;
  for (int64_t T : {4, 20}) {
    Case c;
    c.shape = model("qwen3_30b_a3b");
    c.shape.routing = RoutingMethod::Default;
    c.E_loc = 8;
    c.E_total = 256;
    c.offset = 16;
    c.T = T;
    c.check_tokens = c.T;
    c.seed = 7300 + n++;
    const MoePlan p = make_plan(problem_shape(c));
    ASSERT_EQ(c.shape.k, c.E_loc);  // so each local expert gets every token
    const int64_t filled = c.E_loc * ((T + p.gemm.bm - 1) / p.gemm.bm);
    ASSERT_TRUE(p.gemm_m_last) << "T=" << T;
    ASSERT_LT(2 * p.split_m_tiles, filled) << "T=" << T << ": the plan expects most of the filled tiles";
    char label[64];
    std::snprintf(label, sizeof label, "every token on the rank T=%lld", static_cast<long long>(T));
    check_case(c, nullptr, label, true, [&](Inputs& in) {
      for (int64_t t = 0; t < in.T; ++t)
        for (int64_t e = c.offset; e < c.offset + c.E_loc; ++e) in.logits[t * in.E_total + e] += 8.f;
    });
    if (HasFailure()) return;
  }
}

// ---- many tokens: the plan splits the batch into chunks --------------------------------------------------
TEST(GpuChunks, LargeBatchChunked) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("kimi_k3_tp8");
  c.E_loc = c.E_total = 32;
  c.T = 9000;
  c.check_tokens = 12;
  c.workspace_budget = int64_t(512) << 20;  // 4439 tokens a chunk: three chunks of 3000
  EXPECT_EQ(make_plan(problem_shape(c)).num_chunks, 3);
  check_case(c, nullptr, "kimi chunked");
  // The same bits in one chunk (the default budget) and in chunks of 3000 or 1 (SPEC §4: a token's arithmetic
  // does not depend on its batch).
  auto layer = make_layer(c);
  Inputs in = make_inputs(c);
  const auto y = run_gpu(layer->gpu, *make_gpu_call(c, in, *layer));
  Case one = c;
  one.workspace_budget = 0;
  EXPECT_EQ(make_plan(problem_shape(one)).num_chunks, 1);
  EXPECT_TRUE(run_gpu(layer->gpu, *make_gpu_call(one, in, *layer)) == y) << "one chunk differs from three";
  Case tiny = c;
  tiny.T = 40;
  tiny.workspace_budget = 1;  // one token a chunk
  std::vector<int64_t> picks;
  for (int64_t t = 0; t < tiny.T; ++t) picks.push_back(t * 211);
  const Inputs it = sub_inputs(in, picks);
  EXPECT_EQ(make_plan(problem_shape(tiny)).num_chunks, 40);
  const auto yt = run_gpu(layer->gpu, *make_gpu_call(tiny, it, *layer));
  for (int64_t i = 0; i < tiny.T; ++i)
    EXPECT_TRUE(std::equal(yt.begin() + i * in.H, yt.begin() + (i + 1) * in.H, y.begin() + picks[i] * in.H))
        << "token " << picks[i] << " differs in a one-token chunk";
}

// ---- shared expert with A4 per-token x scales --------------------------------------------------------------
TEST(GpuSharedExpert, QwenA4PerToken) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c;
  c.shape = model("qwen3_30b_a3b");
  c.E_loc = c.E_total = 16;
  c.T = 24;
  c.mode = ActMode::A4;
  c.per_token_x_scale = true;
  c.shared = true;
  c.shared_I = 512;
  check_case(c, nullptr, "qwen shared A4 per-token");
  c.mode = ActMode::A16;
  check_case(c, nullptr, "qwen shared A16");
}

}  // namespace
}  // namespace fp4moe::gputest
