// gpt-oss's MXFP4 checkpoint layout read by the C++ reader (read_moe_layer / load_moe_layer): quant_method "mxfp4",
// mlp.experts.{gate_up,down}_proj_{blocks,scales,bias} with gate and up rows interleaved, mlp.router.{weight,bias}.
// The checkpoint is written here with the project's safetensors writer; the expected arrays are built from the
// written bytes by this test's own row mapping (gate j = row 2j, up j = row 2j + 1), whole, TP and EP.
#include <gtest/gtest.h>

#include <random>

#include "checkpoint_model.h"
#include "fp4moe/checkpoint.h"
#include "test_helpers.h"

using namespace fp4moe;
namespace ck = fp4moe::testutil::checkpoint;
namespace st = fp4moe::safetensors;

namespace {

struct GptOss {
  int64_t E, H, I;
  std::vector<uint8_t> b1, s1, b2, s2;  // [E, 2I, H/32, 16], [E, 2I, H/32], [E, H, I/32, 16], [E, H, I/32]
  std::vector<float> bias1, bias2, rbias;  // bf16 values in the file
};

std::vector<uint8_t> bf16_bytes(std::vector<float>& v, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<uint8_t> out(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t b = f32_to_bf16_bits(u(rng));
    v[i] = bf16_bits_to_f32(b);
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

GptOss write_gpt_oss(const std::filesystem::path& dir, int64_t E, int64_t H, int64_t I, const std::string& quant_method) {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> byte(0, 255), scale(118, 124);
  GptOss g{E, H, I, {}, {}, {}, {}, {}, {}, {}};
  auto fill = [&](std::vector<uint8_t>& v, size_t n, bool sc) {
    v.resize(n);
    for (auto& b : v) b = static_cast<uint8_t>(sc ? scale(rng) : byte(rng));
  };
  fill(g.b1, E * 2 * I * H / 2, false);
  fill(g.s1, E * 2 * I * H / 32, true);
  fill(g.b2, E * H * I / 2, false);
  fill(g.s2, E * H * I / 32, true);
  g.bias1.resize(E * 2 * I);
  g.bias2.resize(E * H);
  g.rbias.resize(E);
  std::vector<float> router(E * H);
  const std::string mb = "model.layers.0.mlp.";
  std::vector<st::WriteTensor> t = {
      {mb + "experts.gate_up_proj_blocks", "U8", {E, 2 * I, H / 32, 16}, g.b1},
      {mb + "experts.gate_up_proj_scales", "U8", {E, 2 * I, H / 32}, g.s1},
      {mb + "experts.gate_up_proj_bias", "BF16", {E, 2 * I}, bf16_bytes(g.bias1, rng)},
      {mb + "experts.down_proj_blocks", "U8", {E, H, I / 32, 16}, g.b2},
      {mb + "experts.down_proj_scales", "U8", {E, H, I / 32}, g.s2},
      {mb + "experts.down_proj_bias", "BF16", {E, H}, bf16_bytes(g.bias2, rng)},
      {mb + "router.weight", "BF16", {E, H}, bf16_bytes(router, rng)},
      {mb + "router.bias", "BF16", {E}, bf16_bytes(g.rbias, rng)}};
  std::filesystem::create_directories(dir);
  st::write_file((dir / "model.safetensors").string(), t);
  ck::write_text(dir / "config.json", "{\"model_type\":\"gpt_oss\",\"hidden_act\":\"silu\",\"num_local_experts\":" +
                                          std::to_string(E) + ",\"num_experts_per_tok\":2,\"swiglu_limit\":7.0,"
                                          "\"quantization_config\":{\"quant_method\":\"" + quant_method + "\"}}");
  return g;
}

// What the reader must give for experts [e0, e0 + ne), TP rows [t0, t0 + ts): W1 gate rows then up rows.
OwnedWeights expected(const GptOss& g, int64_t e0, int64_t ne, int64_t t0, int64_t ts, bool rank0) {
  OwnedWeights o;
  o.format = WeightFormat::MXFP4;
  o.E = ne, o.H = g.H, o.I = ts;
  const int64_t H = g.H, I = g.I;
  for (int64_t e = e0; e < e0 + ne; ++e) {
    for (int half = 0; half < 2; ++half)
      for (int64_t j = t0; j < t0 + ts; ++j) {
        const int64_t row = e * 2 * I + 2 * j + half;  // interleaved in the file
        o.w1.insert(o.w1.end(), g.b1.begin() + row * H / 2, g.b1.begin() + (row + 1) * H / 2);
        o.w1_scale.insert(o.w1_scale.end(), g.s1.begin() + row * H / 32, g.s1.begin() + (row + 1) * H / 32);
        o.bias1.push_back(g.bias1[row]);
      }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = e * H + h;
      o.w2.insert(o.w2.end(), g.b2.begin() + row * I / 2 + t0 / 2, g.b2.begin() + row * I / 2 + (t0 + ts) / 2);
      o.w2_scale.insert(o.w2_scale.end(), g.s2.begin() + row * I / 32 + t0 / 32,
                        g.s2.begin() + row * I / 32 + (t0 + ts) / 32);
      if (rank0) o.bias2.push_back(g.bias2[row]);
    }
  }
  return o;
}

void expect_weights(const OwnedWeights& got, const OwnedWeights& want) {
  EXPECT_EQ(got.format, WeightFormat::MXFP4);
  EXPECT_EQ(got.order, GateUpOrder::GateFirst);
  ck::expect_same(got, want);
  EXPECT_EQ(got.bias1, want.bias1);
  EXPECT_EQ(got.bias2, want.bias2);
}

TEST(CheckpointMxfp4, GptOssLayoutLoadsAsWritten) {
  testutil::TempDir tmp;
  const GptOss g = write_gpt_oss(tmp.path / "g", 4, 64, 96, "mxfp4");
  CheckpointLayer l = load_moe_layer((tmp.path / "g").string(), 0);
  EXPECT_EQ(l.architecture, "GPT-OSS");
  EXPECT_EQ(l.format, WeightFormat::MXFP4);
  EXPECT_EQ(l.quantization, "mxfp4 (W4A16)");
  EXPECT_EQ(l.activation, ActivationType::SwigluBias);
  EXPECT_EQ(l.mode, ActMode::A16);
  EXPECT_EQ(l.router.routing_method, RoutingMethod::Renormalize);
  EXPECT_EQ(l.router.bias, g.rbias);
  expect_weights(l.routed, expected(g, 0, 4, 0, 96, true));
  EXPECT_EQ(l.weights.format(), WeightFormat::MXFP4);
  // The loaded layer computes what the same arrays prepared directly compute, bit for bit.
  const OwnedWeights want = expected(g, 0, 4, 0, 96, true);
  const MoeWeights direct = prepare_weights(want.desc(), Backend::CPU);
  EXPECT_EQ(ck::run_cpu(l.weights, 4, 64), ck::run_cpu(direct, 4, 64));
}

TEST(CheckpointMxfp4, TpAndEpReadTheirPart) {
  testutil::TempDir tmp;
  const GptOss g = write_gpt_oss(tmp.path / "g", 5, 64, 128, "mxfp4");
  const std::string d = (tmp.path / "g").string();
  for (int rank = 0; rank < 2; ++rank) {
    CheckpointOptions o;
    o.tp_rank = rank, o.tp_world = 2;
    const CheckpointLayer l = read_moe_layer(d, 0, o);
    expect_weights(l.routed, expected(g, 0, 5, rank * 64, 64, rank == 0));
  }
  CheckpointOptions o;
  o.tp_world = 8;  // 16 a rank: not whole blocks of 32
  testutil::expect_error([&] { read_moe_layer(d, 0, o); }, "tp_world");
  for (int rank = 0; rank < 2; ++rank) {
    CheckpointOptions e;
    e.ep_rank = rank, e.ep_world = 2;
    const CheckpointLayer l = read_moe_layer(d, 0, e);
    EXPECT_EQ(l.local_expert_offset, rank == 0 ? 0 : 3);
    expect_weights(l.routed, expected(g, rank == 0 ? 0 : 3, rank == 0 ? 3 : 2, 0, 128, true));
    EXPECT_LT(l.bytes_read, read_moe_layer(d, 0).bytes_read);  // only this rank's experts
  }
}

TEST(CheckpointMxfp4, ConfigAndTensorsMustAgree) {
  testutil::TempDir tmp;
  write_gpt_oss(tmp.path / "g", 2, 64, 64, "modelopt");
  ck::write_text(tmp.path / "g" / "config.json",
                 "{\"model_type\":\"gpt_oss\",\"hidden_act\":\"silu\",\"num_local_experts\":2,\"num_experts_per_tok\":2}");
  ck::expect_error([&] { read_moe_layer((tmp.path / "g").string(), 0); },
                   {"gate_up_proj_blocks' is MXFP4 but", "none (unquantized)"}, ErrorCode::InvalidArgument);
  const CheckpointInfo info = inspect_checkpoint((tmp.path / "g").string());
  ASSERT_EQ(info.layers.size(), 1u);
  EXPECT_FALSE(info.layers[0].loadable);
}

}  // namespace
