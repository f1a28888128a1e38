// Checkpoint import (include/fp4moe/checkpoint.h): ModelOpt NVFP4 (Qwen3-MoE names, one shard) and
// compressed-tensors nvfp4-pack-quantized (Mixtral names, sharded with model.safetensors.index.json)
// checkpoints (checkpoint_model.h), read back and compared with the arrays they came from, run through the CPU
// operator bit for bit against the same weights given directly; bad files refused naming file and tensor.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "checkpoint_model.h"
#include "fp4moe/checkpoint.h"
#include "fp4moe/moe.h"
#include "fp4moe/parallel.h"
#include "fp4moe/quantize.h"
#include "io/safetensors.h"
#include "test_helpers.h"

using namespace fp4moe;
namespace fs = std::filesystem;
namespace st = fp4moe::safetensors;

using fp4moe::testutil::TempDir;
using namespace fp4moe::testutil::checkpoint;  // NOLINT: the checkpoints the tests write

TEST(Checkpoint, ModelOptNvfp4OneShard) {
  TempDir d;
  const Model m = make_model(Fmt::ModelOpt, 2, 4, 64, 32, 1);
  write_model(d.path, Fmt::ModelOpt, m, 1);
  for (int L = 0; L < 2; ++L) {
    const CheckpointLayer l = load_moe_layer(d.path.string(), L);
    EXPECT_EQ(l.architecture, "Qwen3-MoE");
    EXPECT_EQ(l.format, WeightFormat::NVFP4);
    EXPECT_EQ(l.mode, ActMode::A4);
    EXPECT_GT(l.fc1_input_scale, 0.f);
    EXPECT_TRUE(l.router.has_routing_method);
    EXPECT_EQ(l.router.routing_method, RoutingMethod::RenormalizeNaive);
    EXPECT_EQ(l.router.top_k, 2);
    EXPECT_EQ(l.router.weight.size(), 4u * 64u);
    expect_same(l.routed, m.truth[static_cast<size_t>(L)]);
    const MoeWeights direct = prepare_weights(m.truth[static_cast<size_t>(L)].desc(), Backend::CPU);
    EXPECT_EQ(run_cpu(l.weights, 4, 64), run_cpu(direct, 4, 64));
  }
}

TEST(Checkpoint, CompressedTensorsShardedIndex) {
  TempDir d;
  const Model m = make_model(Fmt::CompressedTensors, 2, 4, 48, 32, 2);
  write_model(d.path, Fmt::CompressedTensors, m, 3);
  const CheckpointLayer l = load_moe_layer(d.path.string(), 1);
  EXPECT_EQ(l.architecture, "Mixtral");
  EXPECT_EQ(l.quantization, "compressed-tensors nvfp4-pack-quantized (W4A4)");
  EXPECT_EQ(l.router.routing_method, RoutingMethod::Renormalize);
  expect_same(l.routed, m.truth[1]);
  const MoeWeights direct = prepare_weights(m.truth[1].desc(), Backend::CPU);
  EXPECT_EQ(run_cpu(l.weights, 4, 48), run_cpu(direct, 4, 48));
}

TEST(Checkpoint, TensorAndExpertParallelShards) {
  TempDir d;
  const Model m = make_model(Fmt::ModelOpt, 1, 5, 32, 64, 3);
  write_model(d.path, Fmt::ModelOpt, m, 2);
  for (int r = 0; r < 2; ++r) {
    CheckpointOptions o;
    o.tp_rank = r, o.tp_world = 2;
    expect_same(read_moe_layer(d.path.string(), 0, o).routed, shard_weights_tp(m.truth[0].desc(), r, 2));
  }
  for (int r = 0; r < 3; ++r) {
    CheckpointOptions o;
    o.ep_rank = r, o.ep_world = 3;
    const CheckpointLayer l = read_moe_layer(d.path.string(), 0, o);
    const ExpertWindow w = expert_window(5, r, 3);
    EXPECT_EQ(l.local_expert_offset, w.offset);
    expect_same(l.routed, slice_experts(m.truth[0].desc(), w.offset, w.count));
  }
}

// EP in A4 (issue 45): every rank takes the input scales of the whole layer, not the largest of its own experts.
TEST(Checkpoint, ExpertParallelA4TakesTheLayersInputScales) {
  TempDir d;
  const Model m = make_model(Fmt::ModelOpt, 1, 6, 32, 16, 11);
  write_model(d.path, Fmt::ModelOpt, m, 1);
  const CheckpointLayer whole = read_moe_layer(d.path.string(), 0);
  ASSERT_EQ(whole.mode, ActMode::A4);
  std::set<std::pair<float, float>> own;  // each rank's largest input scales of its own experts
  for (int r = 0; r < 3; ++r) {
    CheckpointOptions o;
    o.ep_rank = r, o.ep_world = 3;
    const CheckpointLayer l = read_moe_layer(d.path.string(), 0, o);
    EXPECT_EQ(l.mode, ActMode::A4);
    EXPECT_EQ(l.fc1_input_scale, whole.fc1_input_scale) << "rank " << r;
    EXPECT_EQ(l.fc2_input_scale, whole.fc2_input_scale) << "rank " << r;
    float in1 = 0.f, in2 = 0.f;
    for (const auto& t : m.tensors) {
      const size_t at = t.name.find("experts.");
      if (t.name.size() < 12 || t.name.compare(t.name.size() - 12, 12, ".input_scale") != 0 || at == std::string::npos) continue;
      const int64_t e = std::stoi(t.name.substr(at + 8));
      if (e < l.local_expert_offset || e >= l.local_expert_offset + l.num_local_experts) continue;
      float v;
      std::memcpy(&v, t.bytes.data(), 4);
      float& acc = t.name.find("down_proj") != std::string::npos ? in2 : in1;
      acc = std::max(acc, v);
    }
    own.insert({in1, in2});
  }
  EXPECT_GT(own.size(), 1u) << "the ranks' own maxima must differ for the test to tell the rules apart";
}

// A W4A4 checkpoint whose expert has no input_scale (calibration never reached it) loads in A16, saying why.
TEST(Checkpoint, ExpertWithoutInputScaleLoadsA16) {
  TempDir d;
  Model m = make_model(Fmt::ModelOpt, 1, 4, 32, 16, 12);
  const std::string gone = "model.layers.0.mlp.experts.3.down_proj.input_scale";
  drop(m, gone);
  write_model(d.path, Fmt::ModelOpt, m, 1);
  const CheckpointLayer l = load_moe_layer(d.path.string(), 0);
  EXPECT_EQ(l.mode, ActMode::A16);
  EXPECT_NE(l.mode_reason.find(gone), std::string::npos) << l.mode_reason;
  expect_same(l.routed, m.truth[0]);
  const CheckpointInfo info = inspect_checkpoint(d.path.string());
  ASSERT_EQ(info.layers.size(), 1u);
  EXPECT_TRUE(info.layers[0].loadable) << info.layers[0].reason;
  EXPECT_EQ(info.layers[0].mode, "a16");
  EXPECT_NE(format_checkpoint_info(info).find("mode a16 (" + l.mode_reason + ")"), std::string::npos)
      << format_checkpoint_info(info);
}

TEST(Checkpoint, BadFilesNameFileAndTensor) {
  TempDir d;
  Model m = make_model(Fmt::ModelOpt, 1, 2, 32, 16, 4);
  const std::string dir = d.path.string(), file = (d.path / "model.safetensors").string();
  auto rewrite = [&](const std::function<void(std::vector<st::WriteTensor>&)>& edit) {
    Model c = m;
    edit(c.tensors);
    write_model(d.path, Fmt::ModelOpt, c, 1);
  };
  auto find = [](std::vector<st::WriteTensor>& t, const std::string& n) -> st::WriteTensor& {
    for (auto& x : t)
      if (x.name == n) return x;
    throw std::runtime_error("no " + n);
  };
  const std::string scale = "model.layers.0.mlp.experts.1.up_proj.weight_scale";
  rewrite([&](auto& t) { t.erase(std::find_if(t.begin(), t.end(), [&](auto& x) { return x.name == scale; })); });
  expect_error([&] { read_moe_layer(dir, 0); }, {"tensor '" + scale + "' is missing"}, ErrorCode::NotFound);

  rewrite([&](auto& t) { find(t, scale).dtype_name = "U8"; });
  expect_error([&] { read_moe_layer(dir, 0); }, {file, "tensor '" + scale + "': expected dtype F8_E4M3, got U8"},
               ErrorCode::InvalidArgument);

  const std::string w = "model.layers.0.mlp.experts.1.down_proj.weight";
  rewrite([&](auto& t) {
    auto& x = find(t, w);
    x.shape = {16, 16};
    x.bytes.resize(256);
  });
  expect_error([&] { read_moe_layer(dir, 0); }, {file, "tensor '" + w + "': expected shape [32, 8]"},
               ErrorCode::InvalidArgument);

  rewrite([](auto&) {});
  {  // truncated: the reader names the tensor past the end
    std::ifstream in(file, std::ios::binary);
    std::vector<char> all((std::istreambuf_iterator<char>(in)), {});
    all.resize(all.size() - 40);
    std::ofstream(file, std::ios::binary | std::ios::trunc).write(all.data(), static_cast<std::streamsize>(all.size()));
  }
  expect_error([&] { read_moe_layer(dir, 0); }, {file, "is past the data buffer"}, ErrorCode::InvalidArgument);

  rewrite([](auto&) {});
  write_text(d.path / "hf_quant_config.json", "{\"quantization\":{\"quant_algo\":\"FP8\"}}");
  expect_error([&] { read_moe_layer(dir, 0); }, {"hf_quant_config.json: unsupported ModelOpt quant_algo 'FP8'"},
               ErrorCode::Unsupported);
  fs::remove(d.path / "hf_quant_config.json");
  write_text(d.path / "config.json", "{\"model_type\":\"qwen3_moe\",\"hidden_act\":\"silu\","
                                     "\"quantization_config\":{\"quant_method\":\"awq\"}}");
  expect_error([&] { read_moe_layer(dir, 0); }, {"config.json: unknown quantization config quant_method='awq'"},
               ErrorCode::Unsupported);
}

TEST(Checkpoint, InspectListsLoadsAndRefusals) {
  TempDir d;
  Model m = make_model(Fmt::ModelOpt, 3, 4, 32, 16, 5);
  const std::string gone = "model.layers.1.mlp.experts.3.down_proj.weight_scale_2";
  drop(m, gone);
  write_model(d.path, Fmt::ModelOpt, m, 2);
  const CheckpointInfo info = inspect_checkpoint(d.path.string());
  ASSERT_EQ(info.layers.size(), 3u);
  EXPECT_TRUE(info.index);
  EXPECT_TRUE(info.layers[0].loadable);
  EXPECT_EQ(info.layers[0].format, "nvfp4");
  EXPECT_EQ(info.layers[0].experts, 4);
  EXPECT_FALSE(info.layers[1].loadable);
  EXPECT_NE(info.layers[1].reason.find(gone), std::string::npos) << info.layers[1].reason;
  const std::string text = format_checkpoint_info(info);
  EXPECT_NE(text.find("2 of 3 MoE layers would load"), std::string::npos) << text;
  EXPECT_NE(text.find("quantization: modelopt NVFP4 (W4A4)"), std::string::npos) << text;
}
