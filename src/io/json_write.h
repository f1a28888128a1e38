// The one writer of JSON string literals in fp4moe: safetensors headers, check, bench and soak reports, and
// messages that show a config's strings. Reading JSON is io/json.h.
#pragma once
#include <string>
#include <string_view>

namespace fp4moe::json {

// `s` as a JSON string literal, quotes included: '"' and '\\' escaped, control characters as \u00XX, other bytes
// as they are.
std::string quote(std::string_view s);

}  // namespace fp4moe::json
