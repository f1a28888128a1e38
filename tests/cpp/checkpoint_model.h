// Small checkpoints for the C++ checkpoint tests: ModelOpt NVFP4 (Qwen3-MoE names) and compressed-tensors
// nvfp4-pack-quantized (Mixtral names) layers written with the project's safetensors writer, the arrays they were
// written from (in the loader's layout), and the checks the tests share.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/checkpoint.h"
#include "fp4moe/moe.h"
#include "fp4moe/quantize.h"
#include "io/json_write.h"
#include "io/safetensors.h"

namespace fp4moe::testutil::checkpoint {

namespace fs = std::filesystem;
namespace st = fp4moe::safetensors;

inline void write_text(const fs::path& p, const std::string& s) {
  std::ofstream o(p, std::ios::binary | std::ios::trunc);
  o << s;
}

inline std::vector<uint8_t> f32_bytes(float v) {
  std::vector<uint8_t> b(4);
  std::memcpy(b.data(), &v, 4);
  return b;
}

enum class Fmt { ModelOpt, CompressedTensors };

// A layer's truth in the loader's own layout: w1 rows gate then up, per-half scale2.
struct Model {
  std::vector<st::WriteTensor> tensors;
  std::vector<OwnedWeights> truth;  // per layer
};

inline Model make_model(Fmt fmt, int layers, int64_t E, int64_t H, int64_t I, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255), sf(0x28, 0x50);  // e4m3 codes of 0.25 .. 8
  std::uniform_real_distribution<float> s2(0.001f, 0.01f), ins(0.01f, 0.05f);
  Model m;
  const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
  const char* mix[3] = {"w1", "w3", "w2"};
  for (int L = 0; L < layers; ++L) {
    const std::string mb = "model.layers." + std::to_string(L) + (fmt == Fmt::ModelOpt ? ".mlp." : ".block_sparse_moe.");
    std::vector<uint8_t> router(static_cast<size_t>(E * H * 2));
    for (auto& b : router) b = static_cast<uint8_t>(byte(rng) & 0x3f);  // small bf16 values
    m.tensors.push_back({mb + "gate.weight", "BF16", {E, H}, router});
    OwnedWeights o;
    o.E = E, o.H = H, o.I = I;
    o.w1.resize(E * 2 * I * H / 2);
    o.w1_scale.resize(E * 2 * I * H / 16);
    o.w1_scale2.resize(2 * E);
    o.w2.resize(E * H * I / 2);
    o.w2_scale.resize(E * H * I / 16);
    o.w2_scale2.resize(E);
    for (int64_t e = 0; e < E; ++e) {
      for (int p = 0; p < 3; ++p) {
        const int64_t n = p < 2 ? I : H, k = p < 2 ? H : I;
        std::vector<uint8_t> w(n * k / 2), s(n * k / 16);
        for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
        for (auto& b : s) b = static_cast<uint8_t>(sf(rng));
        const float scale2 = s2(rng);
        const std::string mod = mb + "experts." + std::to_string(e) + "." + (fmt == Fmt::ModelOpt ? names[p] : mix[p]);
        if (fmt == Fmt::ModelOpt) {
          m.tensors.push_back({mod + ".weight", "U8", {n, k / 2}, w});
          m.tensors.push_back({mod + ".weight_scale", "F8_E4M3", {n, k / 16}, s});
          m.tensors.push_back({mod + ".weight_scale_2", "F32", {}, f32_bytes(scale2)});
          m.tensors.push_back({mod + ".input_scale", "F32", {}, f32_bytes(ins(rng))});
        } else {
          m.tensors.push_back({mod + ".weight_packed", "U8", {n, k / 2}, w});
          m.tensors.push_back({mod + ".weight_scale", "F8_E4M3", {n, k / 16}, s});
          m.tensors.push_back({mod + ".weight_global_scale", "F32", {1}, f32_bytes(1.f / scale2)});
          m.tensors.push_back({mod + ".input_global_scale", "F32", {1}, f32_bytes(1.f / ins(rng))});
        }
        if (p < 2) {
          std::memcpy(o.w1.data() + (e * 2 * I + p * I) * H / 2, w.data(), w.size());
          std::memcpy(o.w1_scale.data() + (e * 2 * I + p * I) * H / 16, s.data(), s.size());
          // compressed-tensors: the loader inverts the stored encode scale in fp32
          o.w1_scale2[2 * e + p] = fmt == Fmt::ModelOpt ? scale2 : 1.f / (1.f / scale2);
        } else {
          std::memcpy(o.w2.data() + e * H * I / 2, w.data(), w.size());
          std::memcpy(o.w2_scale.data() + e * H * I / 16, s.data(), s.size());
          o.w2_scale2[e] = fmt == Fmt::ModelOpt ? scale2 : 1.f / (1.f / scale2);
        }
      }
    }
    m.truth.push_back(std::move(o));
  }
  return m;
}

inline void write_model(const fs::path& dir, Fmt fmt, const Model& m, int shards) {
  if (shards == 1) {
    st::write_file((dir / "model.safetensors").string(), m.tensors);
  } else {
    std::string wm;
    for (int i = 0; i < shards; ++i) {
      std::vector<st::WriteTensor> part;
      const std::string fname = "model-0000" + std::to_string(i + 1) + "-of-0000" + std::to_string(shards) + ".safetensors";
      for (size_t t = static_cast<size_t>(i); t < m.tensors.size(); t += static_cast<size_t>(shards)) {
        part.push_back(m.tensors[t]);
        wm += (wm.empty() ? "" : ",") + json::quote(m.tensors[t].name) + ":" + json::quote(fname);
      }
      st::write_file((dir / fname).string(), part);
    }
    write_text(dir / "model.safetensors.index.json", "{\"metadata\":{},\"weight_map\":{" + wm + "}}");
  }
  const int64_t E = m.truth[0].E;
  if (fmt == Fmt::ModelOpt) {
    write_text(dir / "config.json", "{\"model_type\":\"qwen3_moe\",\"hidden_act\":\"silu\",\"num_experts\":" +
                                        std::to_string(E) + ",\"num_experts_per_tok\":2,\"norm_topk_prob\":true}");
    write_text(dir / "hf_quant_config.json",
               "{\"producer\":{\"name\":\"modelopt\"},\"quantization\":{\"quant_algo\":\"NVFP4\",\"group_size\":16,"
               "\"exclude_modules\":[\"lm_head\",\"model.layers.*.mlp.gate\"]}}");
  } else {
    write_text(dir / "config.json",
               "{\"model_type\":\"mixtral\",\"hidden_act\":\"silu\",\"num_local_experts\":" + std::to_string(E) +
                   ",\"num_experts_per_tok\":2,\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
                   "\"format\":\"nvfp4-pack-quantized\",\"config_groups\":{\"group_0\":{\"targets\":[\"Linear\"],"
                   "\"weights\":{\"num_bits\":4,\"type\":\"float\",\"strategy\":\"tensor_group\",\"group_size\":16},"
                   "\"input_activations\":{\"num_bits\":4,\"type\":\"float\",\"strategy\":\"tensor_group\","
                   "\"group_size\":16}}},\"ignore\":[\"lm_head\",\"re:.*block_sparse_moe.gate$\"]}}");
  }
}

// The model without tensor `name` (which must be there).
inline void drop(Model& m, const std::string& name) {
  auto it = std::find_if(m.tensors.begin(), m.tensors.end(), [&](const st::WriteTensor& x) { return x.name == name; });
  ASSERT_NE(it, m.tensors.end()) << name;
  m.tensors.erase(it);
}

// The layer on 5 tokens (RenormalizeNaive top-2, Swiglu), with a shared expert and its gate [H] when given.
inline std::vector<uint16_t> run_cpu(const MoeWeights& w, int64_t E, int64_t H, const MoeWeights* shared = nullptr,
                                     std::vector<uint16_t> gate = {}) {
  const int64_t T = 5;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 0.5f);
  std::vector<uint16_t> x(T * H), y(T * H, 0x7fc0);
  for (auto& v : x) v = f32_to_bf16_bits(nd(rng));
  std::vector<float> logits(T * E);
  for (auto& v : logits) v = nd(rng);
  MoeArgs a;
  a.x = make_view(x.data(), DType::BF16, {T, H});
  a.routing.method = RoutingMethod::RenormalizeNaive;
  a.routing.top_k = 2;
  a.routing.logits = make_view(logits.data(), DType::F32, {T, E});
  a.activation.type = ActivationType::Swiglu;
  a.shared_expert = shared;
  if (!gate.empty()) a.shared_expert_gate = make_view(gate.data(), DType::BF16, {H});
  a.y = make_view(y.data(), DType::BF16, {T, H});
  a.num_threads = 1;
  moe_run(w, a);
  return y;
}

inline void expect_same(const OwnedWeights& a, const OwnedWeights& b) {
  EXPECT_EQ(a.E, b.E);
  EXPECT_EQ(a.I, b.I);
  EXPECT_EQ(a.w1, b.w1);
  EXPECT_EQ(a.w1_scale, b.w1_scale);
  EXPECT_EQ(a.w1_scale2, b.w1_scale2);
  EXPECT_EQ(a.w2, b.w2);
  EXPECT_EQ(a.w2_scale, b.w2_scale);
  EXPECT_EQ(a.w2_scale2, b.w2_scale2);
}

inline void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles, ErrorCode code) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needles[0] << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "message: " << e.what();
  }
}

}  // namespace fp4moe::testutil::checkpoint
