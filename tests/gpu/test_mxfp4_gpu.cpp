// GPU tests of MXFP4 weights (SPEC §2): the GEMMs decode the E8M0 scales of the prepared layout
// (format/nvfp4_prepared.h mx_scale_pair). Against the fp64 CPU reference on the same codes (A16 relative L2 <= 2.5e-3),
// every GEMM tile forced through gemm_tile bit for bit equal to the plan's tile (SPEC §4), sub-batches equal to the
// full batch, scales at both ends of the decoded range, and a LoRA adapter. Each test skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cuda/kernels.h"
#include "fp4moe/mxfp4.h"
#include "gpu_harness.h"
#include "runtime/plan.h"

namespace fp4moe::gputest {
namespace {

constexpr double kRelL2 = 2.5e-3, kCos = 0.99999;

Case mx_case(const char* shape, int64_t E, int64_t T, bool shared = false) {
  Case c;
  c.shape = model(shape);
  c.E_loc = c.E_total = E;
  c.T = T;
  c.format = WeightFormat::MXFP4;
  c.bias = c.shape.activation == ActivationType::SwigluBias;
  c.shared = shared;
  c.shared_I = c.shape.I;
  c.seed = 4600;
  c.check_tokens = 12;
  return c;
}

// The GPU output of (c, in) on `layer`, checked against the fp64 reference.
std::vector<uint16_t> run_checked(const Case& c, const Inputs& in, const Layer& layer, const std::string& label) {
  auto call = make_gpu_call(c, in, layer);
  const std::vector<uint16_t> y = run_gpu(layer.gpu, *call);
  EXPECT_EQ(count_poison(y), 0) << label << ": elements of y not written";
  const auto toks = check_tokens(c.T, c.check_tokens);
  const Errors e = compare(y, run_reference(c, in, layer, toks, Precision::Fp64), toks, in.H);
  EXPECT_EQ(e.nonfinite, 0) << label;
  EXPECT_LE(e.rel_l2, kRelL2) << label;
  EXPECT_GE(e.cosine, kCos) << label;
  std::printf("STAT %-44s T=%-5lld relL2=%.3e cos=%.8f\n", label.c_str(), static_cast<long long>(c.T), e.rel_l2,
              e.cosine);
  return y;
}

// gpt_oss_120b (H = I = 2880, SwigluBias with its clamp, biases) at decode and prefill sizes: the plan's tile
// against the reference, then every tile forced, each bit for bit the plan's output.
TEST(GpuMxfp4, GptOss120bEveryTileSameBitsAndMatchesReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const bool wgmma = cuda_backend::wgmma_supported_on(0);
  for (int64_t T : {int64_t(1), int64_t(8), int64_t(300), int64_t(1100)}) {
    const Case c = mx_case("gpt_oss_120b", 16, T);
    auto layer = make_layer(c);
    const Inputs in = make_inputs(c);
    const std::string label = "gpt_oss_120b mxfp4 A16 T=" + std::to_string(T);
    const std::vector<uint16_t> y = run_checked(c, in, *layer, label);
    for (int tile = 0; tile < kNumGemmConfigs; ++tile) {
      if (kGemmConfigs[tile].wgmma && !wgmma) continue;
      Case ct = c;
      ct.gemm_tile = tile;
      auto tc = make_gpu_call(ct, in, *layer);
      EXPECT_TRUE(run_gpu(layer->gpu, *tc) == y) << label << ": tile " << tile << " differs from the plan's";
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// Every tile on a shape whose H is not a multiple of 64 (288: the last k-block half padding) and an MXFP4 shared
// expert, against the reference tile by tile.
TEST(GpuMxfp4, PaddedKBlockAndSharedExpertOnEveryTile) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const bool wgmma = cuda_backend::wgmma_supported_on(0);
  Case c = mx_case("qwen3_30b_a3b_tp4", 8, 96, true);
  c.shape.H = 288;
  c.shared_I = 96;
  auto layer = make_layer(c);
  const Inputs in = make_inputs(c);
  for (int tile = -1; tile < kNumGemmConfigs; ++tile) {
    if (tile >= 0 && kGemmConfigs[tile].wgmma && !wgmma) continue;
    Case ct = c;
    ct.gemm_tile = tile;
    run_checked(ct, in, *layer, "H=288 mxfp4 shared tile " + std::to_string(tile));
  }
}

// A token's bits do not depend on the batch: sub-batches of 1 and 4 tokens (the decode tiles, split-K) equal their
// rows of a 1100-token batch (the wgmma tiles).
TEST(GpuMxfp4, SubBatchesEqualFullBatch) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const Case c = mx_case("gpt_oss_120b", 8, 1100);
  auto layer = make_layer(c);
  const Inputs in = make_inputs(c);
  auto call = make_gpu_call(c, in, *layer);
  const std::vector<uint16_t> y = run_gpu(layer->gpu, *call);
  for (const std::vector<int64_t>& sub : {std::vector<int64_t>{5}, std::vector<int64_t>{5, 17, 40, c.T - 1}}) {
    Case cs = c;
    cs.T = static_cast<int64_t>(sub.size());
    const Inputs is = sub_inputs(in, sub);
    auto sc = make_gpu_call(cs, is, *layer);
    const auto ys = run_gpu(layer->gpu, *sc);
    for (size_t i = 0; i < sub.size(); ++i)
      EXPECT_TRUE(std::equal(ys.begin() + i * in.H, ys.begin() + (i + 1) * in.H, y.begin() + sub[i] * in.H))
          << "token " << sub[i] << " differs alone";
  }
}

// Scales at both ends of the decoded range (E8M0 10 and 136: 2^-117 and 2^9) and blocks of zeros under scales
// outside it (0, 9, 137, 254), against the reference (whose products are exact in fp64). The magnitudes are extreme, so
// only the blocks of ordinary scales set the output's size; the ends must still decode exactly, not to NaN or 0.
TEST(GpuMxfp4, ScalesAtTheEndsOfTheRange) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Case c = mx_case("qwen3_30b_a3b_tp4", 8, 64);
  auto edit = [](SyntheticLayer& L) {
    auto special = [](std::vector<uint8_t>& q, std::vector<uint8_t>& sf) {
      for (size_t i = 0; i < sf.size(); ++i) {
        switch (i % 11) {
          case 3: sf[i] = 136; for (int b = 0; b < 16; ++b) q[i * 16 + b] &= 0x11; break;  // +-0.5 or 0 at 2^9
          case 6: sf[i] = fp4moe::mxfp4::kMinScaleCode; break;
          case 8: sf[i] = static_cast<uint8_t>(i % 2 ? 0 : 254); for (int b = 0; b < 16; ++b) q[i * 16 + b] &= 0x88; break;
          case 9: sf[i] = static_cast<uint8_t>(i % 2 ? 9 : 137); for (int b = 0; b < 16; ++b) q[i * 16 + b] = 0; break;
          default: break;
        }
      }
    };
    special(L.w1, L.w1_sf);
    special(L.w2, L.w2_sf);
  };
  auto layer = make_layer(c, edit);
  const Inputs in = make_inputs(c);
  auto call = make_gpu_call(c, in, *layer);
  const std::vector<uint16_t> y = run_gpu(layer->gpu, *call);
  const auto toks = check_tokens(c.T, c.check_tokens);
  const Errors e = compare(y, run_reference(c, in, *layer, toks, Precision::Fp64), toks, in.H);
  EXPECT_EQ(e.nonfinite, 0);
  EXPECT_LE(e.rel_l2, 1e-2);  // the 2^9 blocks make a few outputs large; bf16 roundings of a dominate
  std::printf("STAT mxfp4 range ends relL2=%.3e cos=%.8f\n", e.rel_l2, e.cosine);
}

}  // namespace
}  // namespace fp4moe::gputest
