// JSON as the readers of src/io take it (safetensors headers, checkpoint configs, PEFT adapter_config.json):
// nlohmann/json under the readers' rules (RFC 8259, no comments, no duplicate key, bounded nesting, objects in
// file order), every refusal an fp4moe::Error. The writer of JSON string literals is io/json_write.h.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace fp4moe::json {

// A parsed document; an object keeps its members in file order.
using Value = nlohmann::ordered_json;

inline constexpr int kMaxDepth = 64;

// Parses `text`, the whole of it (whitespace around it allowed): RFC 8259, no comments, no key twice in an
// object, nesting at most kMaxDepth deep, every number a finite double. Throws fp4moe::Error (InvalidArgument,
// argument `argument`): "<origin>: invalid JSON at byte N ..." (without "<origin>: " when origin is empty).
Value parse(std::string_view text, const std::string& argument, const std::string& origin = "");

// The members of an object, in file order (`v` must be an object).
inline const Value::object_t& members(const Value& v) { return v.get_ref<const Value::object_t&>(); }
// Member `key` of an object, or nullptr (also when `v` is not an object).
const Value* find(const Value& v, std::string_view key);
// The number when it was written as an integer (no fraction, no exponent) that fits in int64; else nothing.
std::optional<int64_t> integer(const Value& v);
// "null", "a boolean", "a number", "a string", "an array" or "an object", for messages.
const char* kind_name(const Value& v);

}  // namespace fp4moe::json
