// Qwen3-Next / Qwen2-MoE layers with a sigmoid-gated shared expert (`mlp.shared_expert.*` and
// `mlp.shared_expert_gate.weight` [1, H]) through the C++ reader: read back bit for bit, run through the CPU operator
// equal to the same weights and gate given directly, TP and EP parts, the routing defaults of both model types, and
// gates the reader refuses naming file and tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "checkpoint_model.h"
#include "fp4moe/checkpoint.h"
#include "fp4moe/moe.h"
#include "test_helpers.h"

using namespace fp4moe;
using fp4moe::testutil::TempDir;
using namespace fp4moe::testutil::checkpoint;  // NOLINT: the checkpoints the tests write

namespace {

constexpr int64_t kE = 4, kH = 64, kI = 32, kSI = 64;

// One Qwen3-Next-like layer: ModelOpt NVFP4 routed and shared experts (the shared one written as a one-expert layer
// renamed to mlp.shared_expert.) and the gate [1, H] in `gate_dtype` ("BF16" or "F32").
struct GatedModel {
  Model m;
  OwnedWeights shared;
  std::vector<uint16_t> gate_bf16;  // what the reader must give for the gate
};

GatedModel make_gated(const std::string& gate_dtype = "BF16", bool with_shared = true) {
  GatedModel g;
  g.m = make_model(Fmt::ModelOpt, 1, kE, kH, kI, 21);
  Model s = make_model(Fmt::ModelOpt, 1, 1, kH, kSI, 22);
  g.shared = s.truth[0];
  const std::string from = "model.layers.0.mlp.experts.0.", to = "model.layers.0.mlp.shared_expert.";
  for (auto& t : s.tensors) {
    if (t.name.compare(0, from.size(), from) != 0) continue;  // its router
    t.name = to + t.name.substr(from.size());
    if (with_shared) g.m.tensors.push_back(t);
  }
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.f, 0.1f);
  std::vector<uint8_t> bytes;
  for (int64_t h = 0; h < kH; ++h) {
    const float v = nd(rng);
    g.gate_bf16.push_back(f32_to_bf16_bits(v));  // RNE, as the reader converts F32
    if (gate_dtype == "F32") {
      const std::vector<uint8_t> b = f32_bytes(v);
      bytes.insert(bytes.end(), b.begin(), b.end());
    } else {
      bytes.push_back(static_cast<uint8_t>(g.gate_bf16.back() & 0xff));
      bytes.push_back(static_cast<uint8_t>(g.gate_bf16.back() >> 8));
    }
  }
  g.m.tensors.push_back({"model.layers.0.mlp.shared_expert_gate.weight", gate_dtype, {1, kH}, bytes});
  return g;
}

void write_gated(const fs::path& dir, const GatedModel& g, const std::string& model_type, const std::string& norm = "") {
  write_model(dir, Fmt::ModelOpt, g.m, 1);
  write_text(dir / "config.json", "{\"model_type\":\"" + model_type + "\",\"hidden_act\":\"silu\",\"num_experts\":" +
                                      std::to_string(kE) + ",\"num_experts_per_tok\":2" + norm + "}");
}

TEST(CheckpointGate, Qwen3NextLayerReadsBackAndRunsAsGivenDirectly) {
  for (const char* dtype : {"BF16", "F32"}) {
    SCOPED_TRACE(dtype);
    TempDir d;
    const GatedModel g = make_gated(dtype);
    write_gated(d.path, g, "qwen3_next");
    const CheckpointLayer l = load_moe_layer(d.path.string(), 0);
    EXPECT_EQ(l.architecture, "Qwen3-Next");
    EXPECT_EQ(l.router.routing_method, RoutingMethod::RenormalizeNaive);  // norm_topk_prob defaults to true
    ASSERT_TRUE(l.has_shared);
    expect_same(l.shared, g.shared);
    EXPECT_EQ(l.shared_expert_gate, g.gate_bf16);
    const MoeWeights direct = prepare_weights(g.m.truth[0].desc(), Backend::CPU);
    const MoeWeights sdirect = prepare_weights(g.shared.desc(), Backend::CPU);
    const std::vector<uint16_t> ours = run_cpu(l.weights, kE, kH, &l.shared_expert, l.shared_expert_gate);
    EXPECT_EQ(ours, run_cpu(direct, kE, kH, &sdirect, g.gate_bf16));
    EXPECT_NE(ours, run_cpu(direct, kE, kH, &sdirect)) << "the gate must change the output";
  }
}

TEST(CheckpointGate, Qwen2MoeRoutingDefaultsToUnnormalized) {
  TempDir d;
  write_gated(d.path, make_gated(), "qwen2_moe");
  const CheckpointLayer l = read_moe_layer(d.path.string(), 0);
  EXPECT_EQ(l.architecture, "Qwen2-MoE");
  EXPECT_EQ(l.router.routing_method, RoutingMethod::Default);  // transformers' default norm_topk_prob: false
  EXPECT_EQ(l.shared_expert_gate.size(), static_cast<size_t>(kH));
  TempDir d2;
  write_gated(d2.path, make_gated(), "qwen2_moe", ",\"norm_topk_prob\":true");
  EXPECT_EQ(read_moe_layer(d2.path.string(), 0).router.routing_method, RoutingMethod::RenormalizeNaive);
}

TEST(CheckpointGate, TensorParallelKeepsTheWholeGateAndExpertParallelPutsItOnRankZero) {
  TempDir d;
  const GatedModel g = make_gated();
  write_gated(d.path, g, "qwen3_next");
  for (int r = 0; r < 2; ++r) {
    CheckpointOptions o;
    o.tp_rank = r;
    o.tp_world = 2;
    const CheckpointLayer l = read_moe_layer(d.path.string(), 0, o);
    EXPECT_EQ(l.shared.I, kSI / 2);
    EXPECT_EQ(l.shared_expert_gate, g.gate_bf16) << "TP rank " << r;
  }
  for (int r = 0; r < 2; ++r) {
    CheckpointOptions o;
    o.ep_rank = r;
    o.ep_world = 2;
    const CheckpointLayer l = read_moe_layer(d.path.string(), 0, o);
    EXPECT_EQ(l.has_shared, r == 0);
    EXPECT_EQ(l.shared_expert_gate.empty(), r != 0) << "EP rank " << r;
  }
  CheckpointOptions none;
  none.shared_expert = false;
  EXPECT_TRUE(read_moe_layer(d.path.string(), 0, none).shared_expert_gate.empty());
}

TEST(CheckpointGate, BadGatesAreRefusedNamingFileAndTensor) {
  const std::string gate = "model.layers.0.mlp.shared_expert_gate.weight";
  {  // a gate without a shared expert
    TempDir d;
    write_gated(d.path, make_gated("BF16", false), "qwen3_next");
    expect_error([&] { read_moe_layer(d.path.string(), 0); }, {"model.safetensors", gate, "without a shared expert"},
                 ErrorCode::InvalidArgument);
  }
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{kH}, std::vector<int64_t>{2, kH / 2}}) {
    TempDir d;
    GatedModel g = make_gated();
    g.m.tensors.back().shape = shape;
    write_gated(d.path, g, "qwen3_next");
    expect_error([&] { read_moe_layer(d.path.string(), 0); }, {gate, "[1, 64]"}, ErrorCode::InvalidArgument);
  }
  {  // an integer gate
    TempDir d;
    GatedModel g = make_gated();
    g.m.tensors.back().dtype_name = "I16";
    write_gated(d.path, g, "qwen3_next");
    expect_error([&] { read_moe_layer(d.path.string(), 0); }, {gate, "I16"}, ErrorCode::InvalidArgument);
  }
}

TEST(CheckpointGate, InspectSaysTheSharedExpertIsGated) {
  TempDir d;
  write_gated(d.path, make_gated(), "qwen3_next");
  const std::string text = format_checkpoint_info(inspect_checkpoint(d.path.string()));
  EXPECT_NE(text.find("sigmoid-gated"), std::string::npos) << text;
  EXPECT_NE(text.find("would load"), std::string::npos) << text;
}

}  // namespace
