// Reading PEFT LoRA adapters for HuggingFace transformers 5 fused MoE experts (SPEC §5):
// adapter_config.json + adapter_model.safetensors -> a LoraAdapterDesc (PeftFused) with owned storage.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/moe.h"

namespace fp4moe {

// The parts of adapter_config.json fp4moe uses.
struct PeftConfig {
  int64_t r = 0;
  float lora_alpha = 8.f;  // PEFT's default when the file leaves it out
  bool use_rslora = false;
  std::vector<std::string> target_parameters;  // e.g. "experts.gate_up_proj", "experts.down_proj"
};
// Reads and checks adapter_config.json (r > 0, finite lora_alpha, no rank/alpha patterns, no DoRA).
// Throws fp4moe::Error: NotFound when missing, InvalidArgument / Unsupported naming the field.
PeftConfig read_peft_config(const std::string& config_json_path);

struct PeftReadOptions {
  // Key prefix of the MoE block whose experts to read, up to (not including) "experts.",
  // e.g. "base_model.model.model.layers.3.mlp.". See list_peft_expert_modules().
  std::string module_prefix;
  int64_t num_experts = 0;        // E of the model; 0: inferred from lora_A rows / r
  int64_t expert_offset = 0;      // expert parallelism: read experts [offset, offset + num_local)
  int64_t num_local_experts = 0;  // 0: all experts from offset on
};

// One MoE layer's LoRA, per local expert, in the PeftFused layout of LoraAdapterDesc:
// a_gate_up [E, r, H], b_gate_up [E, N1, r] (gate rows first, as transformers' gate_up_proj),
// a_down [E, r, I], b_down [E, H, r]; bf16 bits (F32/F16 files are rounded to nearest even).
struct PeftExpertsLora {
  int64_t E = 0, H = 0, I = 0, N1 = 0, rank = 0;
  float lora_alpha = 0.f;
  bool use_rslora = false;
  bool has_gate_up = false, has_down = false;
  std::vector<uint16_t> a_gate_up, b_gate_up, a_down, b_down;

  // Views into the vectors above (valid while this object lives), ready for AdapterRegistry::load.
  LoraAdapterDesc desc() const;
};

// dir holds adapter_config.json and adapter_model.safetensors. Per SPEC §5, PEFT stores per target
// lora_A [r*E, in] and lora_B [out, r*E]; expert e's A is A.reshape(E, r, in)[e] and its B is
// B.reshape(out, r, E)[:, :, e]. With both targets, the one listed first in target_parameters is
// wrapped innermost: its keys carry "experts.base_layer." (gate_up in the usual order), the other's
// "experts.".
PeftExpertsLora read_peft_experts_lora(const std::string& dir, const PeftReadOptions& options);

// The module prefixes (as PeftReadOptions::module_prefix) that carry fused-expert LoRA keys.
std::vector<std::string> list_peft_expert_modules(const std::string& dir);

}  // namespace fp4moe
