// A small, strict JSON parser for the files fp4moe reads itself (safetensors headers, PEFT
// adapter_config.json). RFC 8259 grammar, bounded nesting depth, no trailing garbage. And the one
// string-literal writer of the JSON that fp4moe writes (safetensors headers, check and bench reports).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fp4moe::json {

struct Value {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  double number = 0;
  bool is_int = false;  // the number was written as an integer that fits in int64
  int64_t integer = 0;
  std::string str;
  std::vector<Value> array;
  std::vector<std::pair<std::string, Value>> object;  // in file order; duplicate keys are refused

  bool is_null() const { return kind == Kind::Null; }
  bool is_object() const { return kind == Kind::Object; }
  bool is_array() const { return kind == Kind::Array; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Number; }
  bool is_bool() const { return kind == Kind::Bool; }
  // Member of an object, or nullptr.
  const Value* find(std::string_view key) const;
};

// Parses `text` (the whole of it, surrounding whitespace allowed). Throws fp4moe::Error
// (InvalidArgument, argument `what`) with the byte offset of the problem.
Value parse(std::string_view text, const std::string& what);

const char* kind_name(Value::Kind k);

// `s` as a JSON string literal, quotes included: '"' and '\\' escaped, control characters as \u00XX.
std::string quote(std::string_view s);

}  // namespace fp4moe::json
