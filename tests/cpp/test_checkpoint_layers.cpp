// What a loaded checkpoint layer means (issue 45), beside test_checkpoint.cpp: exclusions read from a ModelOpt
// config in config.json, routing the config describes (or a refusal naming the key), mixed formats refused naming
// the tensors, the shared expert under EP, and inspect applying the checks of load. Checkpoints come from
// checkpoint_model.h; each test compares with the arrays they were written from or with the whole layer.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "checkpoint_model.h"
#include "fp4moe/checkpoint.h"
#include "test_helpers.h"

using namespace fp4moe;
using fp4moe::testutil::TempDir;
using namespace fp4moe::testutil::checkpoint;  // NOLINT: the checkpoints the tests write

namespace {

// Layer `layer`'s experts (or only expert `expert`) of a ModelOpt model as bf16, as a quantizer's exclusion leaves
// them: each weight becomes BF16 [n, k] and its scales go. Returns the bf16 gate weight of expert 0 (its bits).
std::vector<uint8_t> experts_to_bf16(Model& m, int layer, int expert = -1) {
  const std::string base = "model.layers." + std::to_string(layer) + ".mlp.experts." +
                           (expert < 0 ? std::string() : std::to_string(expert) + ".");
  std::vector<st::WriteTensor> out;
  std::vector<uint8_t> gate0;
  for (auto& t : m.tensors) {
    if (t.name.rfind(base, 0) != 0) {
      out.push_back(t);
      continue;
    }
    if (t.name.size() < 7 || t.name.compare(t.name.size() - 7, 7, ".weight") != 0) continue;  // a scale
    st::WriteTensor w{t.name, "BF16", {t.shape[0], 2 * t.shape[1]}, {}};
    w.bytes.resize(static_cast<size_t>(w.shape[0] * w.shape[1] * 2));
    for (size_t i = 0; i < w.bytes.size(); i += 2) {  // small bf16 values from the packed codes
      w.bytes[i] = t.bytes[i / 4];
      w.bytes[i + 1] = 0x3c;
    }
    if (t.name == base + "0.gate_proj.weight") gate0 = w.bytes;
    out.push_back(std::move(w));
  }
  m.tensors = std::move(out);
  return gate0;
}

// The ModelOpt config in config.json only, in the spelling of ModelOpt's HF export (flat, "ignore").
void modelopt_in_config_json(const fs::path& dir, int64_t E, const std::string& ignore) {
  fs::remove(dir / "hf_quant_config.json");
  write_text(dir / "config.json",
             "{\"model_type\":\"qwen3_moe\",\"hidden_act\":\"silu\",\"num_experts\":" + std::to_string(E) +
                 ",\"num_experts_per_tok\":2,\"norm_topk_prob\":true,\"quantization_config\":{\"quant_method\":"
                 "\"modelopt\",\"quant_algo\":\"NVFP4\",\"producer\":{\"name\":\"modelopt\"},\"ignore\":" + ignore + "}}");
}

}  // namespace

// 3. A ModelOpt config only in config.json: its "ignore" list excludes modules, an entry names a module or one
// that holds it, and "path*" is that module and what it holds (as vLLM reads ModelOpt's patterns).
TEST(CheckpointLayers, ConfigJsonIgnoreExcludesExperts) {
  for (const std::string pattern : {"model.layers.1.mlp.experts*", "model.layers.1.mlp.experts", "model.layers.1*"}) {
    SCOPED_TRACE(pattern);
    TempDir d;
    const int layers = pattern == "model.layers.1*" ? 11 : 2;
    Model m = make_model(Fmt::ModelOpt, layers, 2, 32, 16, 21);
    const std::vector<uint8_t> gate0 = experts_to_bf16(m, 1);
    write_model(d.path, Fmt::ModelOpt, m, 1);
    modelopt_in_config_json(d.path, 2, "[\"lm_head\",\"model.layers.*.mlp.gate\",\"" + pattern + "\"]");
    const CheckpointLayer l1 = read_moe_layer(d.path.string(), 1);
    EXPECT_EQ(l1.format, WeightFormat::BF16);
    EXPECT_EQ(l1.quantization, "modelopt NVFP4 (W4A4)");
    ASSERT_GE(l1.routed.w1_bf16.size() * 2, gate0.size());
    EXPECT_EQ(std::memcmp(l1.routed.w1_bf16.data(), gate0.data(), gate0.size()), 0);  // expert 0's gate rows
    for (const int L : {0, layers - 1}) {  // layer 10 too when the pattern is "model.layers.1*"
      if (L == 1) continue;
      const CheckpointLayer other = read_moe_layer(d.path.string(), L);
      EXPECT_EQ(other.format, WeightFormat::NVFP4);
      expect_same(other.routed, m.truth[static_cast<size_t>(L)]);
    }
    for (const auto& r : inspect_checkpoint(d.path.string()).layers) EXPECT_TRUE(r.loadable) << r.layer << ": " << r.reason;
  }
}

// 4. Routing as the config describes it: glm4_moe is DeepSeek-V3's router with its own scaling factor; what no
// routing method computes (norm_topk_prob false) or the operator would refuse is refused at load, naming the key.
TEST(CheckpointLayers, RoutingFromTheConfig) {
  TempDir d;
  const Model m = make_model(Fmt::ModelOpt, 1, 4, 32, 16, 22);
  write_model(d.path, Fmt::ModelOpt, m, 1);
  const std::string dir = d.path.string();
  auto config = [&](const std::string& fields) {
    write_text(d.path / "config.json", "{\"hidden_act\":\"silu\",\"n_routed_experts\":4,\"num_experts\":4," + fields + "}");
  };
  config(R"("model_type":"glm4_moe","num_experts_per_tok":2,"n_group":1,"topk_group":1,"norm_topk_prob":true,)"
         R"("routed_scaling_factor":2.5)");
  const CheckpointLayer l = load_moe_layer(dir, 0);
  EXPECT_TRUE(l.router.has_routing_method);
  EXPECT_EQ(l.router.routing_method, RoutingMethod::DeepSeekV3);
  EXPECT_EQ(l.router.routed_scaling_factor, 2.5f);
  EXPECT_EQ(l.router.n_group, 1);
  EXPECT_EQ(l.router.top_k, 2);
  config(R"("model_type":"deepseek_v3","num_experts_per_tok":2,"n_group":2,"topk_group":1,"norm_topk_prob":false)");
  expect_error([&] { read_moe_layer(dir, 0); }, {"config.json: norm_topk_prob false"}, ErrorCode::Unsupported);
  EXPECT_NE(inspect_checkpoint(dir).layers[0].reason.find("norm_topk_prob"), std::string::npos);
  config(R"("model_type":"deepseek_v3","num_experts_per_tok":2,"n_group":3,"topk_group":1)");
  expect_error([&] { read_moe_layer(dir, 0); }, {"config.json: n_group 3"}, ErrorCode::InvalidArgument);
  config(R"("model_type":"deepseek_v3","num_experts_per_tok":2,"n_group":2,"topk_group":3)");
  expect_error([&] { read_moe_layer(dir, 0); }, {"config.json: topk_group 3"}, ErrorCode::InvalidArgument);
  config(R"("model_type":"qwen3_moe","num_experts_per_tok":5)");
  expect_error([&] { read_moe_layer(dir, 0); }, {"config.json: num_experts_per_tok 5"}, ErrorCode::InvalidArgument);
  config(R"("model_type":"qwen3_moe")");
  expect_error([&] { read_moe_layer(dir, 0); }, {"config.json: num_experts_per_tok is missing"},
               ErrorCode::InvalidArgument);
  config(R"("model_type":"olmoe","num_experts_per_tok":2)");
  expect_error([&] { read_moe_layer(dir, 0); }, {"config.json: model_type 'olmoe'"}, ErrorCode::Unsupported);
  config(R"("model_type":"qwen3_moe","num_experts_per_tok":2)");  // transformers' default: norm_topk_prob false
  EXPECT_EQ(read_moe_layer(dir, 0).router.routing_method, RoutingMethod::Default);
}

// 5. A checkpoint without config.json: NotFound naming the file (not an error about the activation).
TEST(CheckpointLayers, MissingConfigJsonIsNotFound) {
  TempDir d;
  const Model m = make_model(Fmt::ModelOpt, 1, 2, 32, 16, 23);
  write_model(d.path, Fmt::ModelOpt, m, 1);
  fs::remove(d.path / "config.json");
  expect_error([&] { read_moe_layer(d.path.string(), 0); }, {(d.path / "config.json").string() + ": the file is missing"},
               ErrorCode::NotFound);
  const CheckpointInfo info = inspect_checkpoint(d.path.string());
  ASSERT_EQ(info.layers.size(), 1u);
  EXPECT_NE(info.layers[0].reason.find("config.json: the file is missing"), std::string::npos) << info.layers[0].reason;
}

// 5. Experts of one layer in two formats (an exclusion naming one expert): refused naming the expert and tensor.
TEST(CheckpointLayers, MixedExpertFormatsNameExpertAndTensor) {
  TempDir d;
  Model m = make_model(Fmt::ModelOpt, 1, 4, 32, 16, 24);
  experts_to_bf16(m, 0, 3);
  write_model(d.path, Fmt::ModelOpt, m, 1);
  write_text(d.path / "hf_quant_config.json",
             R"({"quantization":{"quant_algo":"NVFP4","exclude_modules":["lm_head","model.layers.*.mlp.gate",)"
             R"("model.layers.0.mlp.experts.3*"]}})");
  const std::string odd = "model.layers.0.mlp.experts.3.gate_proj.weight";
  expect_error([&] { read_moe_layer(d.path.string(), 0); },
               {(d.path / "model.safetensors").string() + ": tensor '" + odd + "' (expert 3) is BF16 but",
                "experts.0.gate_proj.weight' (expert 0) is NVFP4"},
               ErrorCode::InvalidArgument);
  EXPECT_NE(inspect_checkpoint(d.path.string()).layers[0].reason.find("'" + odd + "' (expert 3)"), std::string::npos);
}

// 5. inspect runs the checks of load: a zero weight_scale_2 is refused by both, and by every EP rank.
TEST(CheckpointLayers, InspectRunsTheChecksOfLoad) {
  TempDir d;
  Model m = make_model(Fmt::ModelOpt, 2, 4, 32, 16, 25);
  const std::string zero = "model.layers.1.mlp.experts.2.down_proj.weight_scale_2";
  for (auto& t : m.tensors)
    if (t.name == zero) t.bytes = f32_bytes(0.f);
  write_model(d.path, Fmt::ModelOpt, m, 1);
  const std::string dir = d.path.string();
  expect_error([&] { read_moe_layer(dir, 1); }, {"tensor '" + zero + "': expected a finite positive scale"},
               ErrorCode::InvalidArgument);
  CheckpointOptions rank0;  // experts 0 and 1 only
  rank0.ep_rank = 0, rank0.ep_world = 2;
  expect_error([&] { read_moe_layer(dir, 1, rank0); }, {zero}, ErrorCode::InvalidArgument);
  const CheckpointInfo info = inspect_checkpoint(dir);
  ASSERT_EQ(info.layers.size(), 2u);
  EXPECT_TRUE(info.layers[0].loadable) << info.layers[0].reason;
  EXPECT_FALSE(info.layers[1].loadable);
  EXPECT_NE(info.layers[1].reason.find(zero), std::string::npos) << info.layers[1].reason;
  EXPECT_EQ(info.layers[1].format, "nvfp4");  // a refused layer is still described
}

// 5. Under EP the shared expert is read on rank 0 only (SPEC §8): summing the ranks' outputs counts it once.
TEST(CheckpointLayers, ExpertParallelSharedExpertOnRankZero) {
  TempDir d;
  Model m = make_model(Fmt::ModelOpt, 1, 4, 32, 16, 26);
  const std::string sb = "model.layers.0.mlp.shared_experts.";
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
    const bool down = std::string(proj) == "down_proj";
    st::WriteTensor t{sb + proj + ".weight", "BF16", {down ? 32 : 16, down ? 16 : 32}, std::vector<uint8_t>(1024)};
    for (size_t i = 1; i < t.bytes.size(); i += 2) t.bytes[i] = 0x3c;  // bf16 values near 0.01
    m.tensors.push_back(std::move(t));
  }
  write_model(d.path, Fmt::ModelOpt, m, 1);
  write_text(d.path / "hf_quant_config.json",
             R"({"quantization":{"quant_algo":"NVFP4","exclude_modules":["model.layers.*.mlp.gate","*shared_experts*"]}})");
  EXPECT_TRUE(read_moe_layer(d.path.string(), 0).has_shared);
  for (int r = 0; r < 2; ++r) {
    CheckpointOptions o;
    o.ep_rank = r, o.ep_world = 2;
    const CheckpointLayer l = load_moe_layer(d.path.string(), 0, o);
    EXPECT_EQ(l.has_shared, r == 0) << "rank " << r;
    EXPECT_EQ(l.shared_expert.valid(), r == 0) << "rank " << r;
  }
}
