// Internal entry points of the PEFT reader (the public ones are in include/fp4moe/peft.h): the same
// logic on an already opened safetensors file and an in-memory config, for tests and tools.
#pragma once
#include <string>
#include <string_view>

#include "fp4moe/peft.h"
#include "io/safetensors.h"

namespace fp4moe::peft {

PeftConfig parse_config(std::string_view json_text, const std::string& origin);
PeftExpertsLora read_experts_lora(const safetensors::File& file, const PeftConfig& config,
                                  const PeftReadOptions& options);
std::vector<std::string> list_expert_modules(const safetensors::File& file);

}  // namespace fp4moe::peft
