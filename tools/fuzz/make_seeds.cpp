// Writes the seed corpus of fuzz_safetensors (valid inputs the fuzzer mutates from) into a directory:
// a plain safetensors file with several dtypes and metadata, PEFT adapters in the fuzz input layout
// ([options][u16 config length][adapter_config.json][adapter_model.safetensors]), and JSON texts.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "fp4moe/checkpoint.h"
#include "io/peft.h"
#include "io/safetensors.h"

namespace st = fp4moe::safetensors;

namespace {

std::vector<uint8_t> bf16_bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> b(2 * n);
  uint32_t s = seed;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const uint16_t v = static_cast<uint16_t>(0x3c00 + ((s >> 16) & 0x07ff)) | ((s & 1) ? 0x8000 : 0);
    b[2 * i] = static_cast<uint8_t>(v);
    b[2 * i + 1] = static_cast<uint8_t>(v >> 8);
  }
  return b;
}

std::vector<uint8_t> file_image(const std::string& tmp, const std::vector<st::WriteTensor>& ts,
                                const std::map<std::string, std::string>& meta = {}) {
  st::write_file(tmp, ts, meta);
  std::ifstream in(tmp, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void save(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<uint8_t> peft_input(uint8_t options, const std::string& config, const std::vector<uint8_t>& image) {
  std::vector<uint8_t> in{options, static_cast<uint8_t>(config.size()), static_cast<uint8_t>(config.size() >> 8)};
  in.insert(in.end(), config.begin(), config.end());
  in.insert(in.end(), image.begin(), image.end());
  return in;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1], tmp = dir + "/.tmp.safetensors";
  try {
    // A plain file: several dtypes, an empty tensor, metadata.
    std::vector<uint8_t> f32(4 * 6), i32(4 * 3, 7), u8(5, 0xab), f16(2 * 4, 0x3c);
    for (size_t i = 0; i < f32.size(); i += 4) f32[i + 3] = 0x3f;  // 0.5-ish floats
    save(dir + "/plain.safetensors",
         file_image(tmp, {{"w", "BF16", {2, 3}, bf16_bytes(6, 1)}, {"x", "F32", {6}, f32}, {"h", "F16", {2, 2}, f16},
                          {"ids", "I32", {3}, i32}, {"q", "U8", {5}, u8}, {"sf", "F8_E4M3", {1, 5}, u8},
                          {"empty", "F32", {0, 4}, {}}},
                    {{"format", "pt"}, {"note", "seed"}}));

    // PEFT fused-expert adapters: E = 2, r = 2, H = 16, I = 8 (gate_up out 16).
    const int64_t E = 2, r = 2, H = 16, I = 8, N1 = 2 * I;
    const std::string p = "base_model.model.model.layers.0.mlp.";
    const std::vector<st::WriteTensor> both = {
        {p + "experts.base_layer.lora_A.weight", "BF16", {r * E, H}, bf16_bytes(r * E * H, 2)},
        {p + "experts.base_layer.lora_B.weight", "BF16", {N1, r * E}, bf16_bytes(N1 * r * E, 3)},
        {p + "experts.lora_A.weight", "BF16", {r * E, I}, bf16_bytes(r * E * I, 4)},
        {p + "experts.lora_B.weight", "BF16", {H, r * E}, bf16_bytes(H * r * E, 5)}};
    const std::string cfg_both =
        R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "use_rslora": false, "rank_pattern": {}, "alpha_pattern": {},)"
        R"( "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]})";
    const std::vector<uint8_t> img_both = file_image(tmp, both);
    {
      // The seed must reach the deepest code: check that it reads back as a valid adapter.
      fp4moe::PeftReadOptions opt;
      opt.module_prefix = p;
      const auto l = fp4moe::peft::read_experts_lora(st::File::from_bytes(img_both),
                                                     fp4moe::peft::parse_config(cfg_both, "seed"), opt);
      if (!l.has_gate_up || !l.has_down || l.E != E || l.H != H || l.I != I) {
        std::fprintf(stderr, "make_seeds: the PEFT seed does not read back\n");
        return 1;
      }
    }
    save(dir + "/peft_both.bin", peft_input(0x00, cfg_both, img_both));
    save(dir + "/peft_both_disk.bin", peft_input(0x80, cfg_both, img_both));
    save(dir + "/peft_both_offset.bin", peft_input(0x14, cfg_both, img_both));  // offset 1, one local expert

    // gate_up only, lora_A stored as F32 and ".default" keys.
    std::vector<uint8_t> a32(4 * r * E * H);
    for (size_t i = 0; i < a32.size(); i += 4) a32[i + 3] = 0x3e;
    const std::vector<st::WriteTensor> gu = {{p + "experts.lora_A.default.weight", "F32", {r * E, H}, a32},
                                             {p + "experts.lora_B.default.weight", "BF16", {N1, r * E}, bf16_bytes(N1 * r * E, 6)}};
    save(dir + "/peft_gate_up.bin",
         peft_input(0x80, R"({"r": 2, "lora_alpha": 3.5, "use_rslora": true, "target_parameters": ["mlp.experts.gate_up_proj"]})",
                    file_image(tmp, gu)));

    // A checkpoint directory (input bit 0x40): ModelOpt W4A16_NVFP4 experts, E = 2, H = I = 16.
    {
      const std::string cfg =
          R"({"model_type": "qwen3_moe", "hidden_act": "silu", "num_experts": 2, "num_experts_per_tok": 1,)"
          R"( "quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16}})";
      std::vector<st::WriteTensor> ck = {{"model.layers.0.mlp.gate.weight", "BF16", {2, 16}, bf16_bytes(32, 7)}};
      const std::vector<uint8_t> s2 = {0x6f, 0x12, 0x83, 0x3b};  // 0.004f
      for (int e = 0; e < 2; ++e)
        for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
          const std::string m = "model.layers.0.mlp.experts." + std::to_string(e) + "." + proj;
          ck.push_back({m + ".weight", "U8", {16, 8}, std::vector<uint8_t>(128, static_cast<uint8_t>(0x21 + e))});
          ck.push_back({m + ".weight_scale", "F8_E4M3", {16, 1}, std::vector<uint8_t>(16, 0x38)});
          ck.push_back({m + ".weight_scale_2", "F32", {}, s2});
        }
      const std::vector<uint8_t> img = file_image(tmp, ck);
      const std::string cdir = dir + "/.ckpt";
      std::filesystem::create_directories(cdir);
      save(cdir + "/config.json", std::vector<uint8_t>(cfg.begin(), cfg.end()));
      save(cdir + "/model.safetensors", img);
      const fp4moe::CheckpointLayer l = fp4moe::read_moe_layer(cdir, 0);
      std::filesystem::remove_all(cdir);
      if (l.routed.E != 2 || l.routed.H != 16 || l.routed.I != 16) {
        std::fprintf(stderr, "make_seeds: the checkpoint seed does not read back\n");
        return 1;
      }
      save(dir + "/checkpoint_disk.bin", peft_input(0x40, cfg, img));
      save(dir + "/checkpoint_tp_ep.bin", peft_input(0x43, cfg, img));
    }

    // JSON texts.
    const std::string js = R"({"a": [1, -2.5e3, true, false, null, "s\u00e9\n"], "b": {"c": {}}, "d": []})";
    save(dir + "/json.txt", std::vector<uint8_t>(js.begin(), js.end()));
    std::remove(tmp.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
