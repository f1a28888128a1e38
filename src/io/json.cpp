#include "io/json.h"

#include <limits>
#include <unordered_set>
#include <vector>

#include "fp4moe/types.h"

namespace fp4moe::json {

namespace {

// `m` with each byte of an ill-formed UTF-8 sequence as '?': nlohmann/json quotes the bytes it refused, and a
// message must stay text (Python turns it into a str).
std::string printable(std::string m) {
  for (size_t i = 0; i < m.size();) {
    const auto c = static_cast<unsigned char>(m[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    for (size_t k = 1; k < n; ++k)
      if (i + k >= m.size() || (static_cast<unsigned char>(m[i + k]) & 0xc0) != 0x80) n = 0;
    if (n == 0) {
      m[i++] = '?';
    } else {
      i += n;
    }
  }
  return m;
}

// " at byte N (line L, column C): why" for a parse error, ": why" for nlohmann/json's other refusals (a number
// out of a double's range), its "[json.exception.parse_error.101] " tag left out.
std::string detail_of(const nlohmann::json::exception& e) {
  std::string m = printable(e.what());
  if (const size_t tag = m.find("] "); m.rfind("[json.exception.", 0) == 0 && tag != std::string::npos)
    m = m.substr(tag + 2);
  const auto* pe = dynamic_cast<const nlohmann::json::parse_error*>(&e);
  if (!pe) return ": " + m;
  const std::string at = " at byte " + std::to_string(pe->byte), head = "parse error";
  if (m.rfind(head, 0) != 0) return at + ": " + m;
  m = m.substr(head.size());  // " at line L, column C: why" or ": why"
  if (const size_t colon = m.find(": "); m.rfind(" at ", 0) == 0 && colon != std::string::npos)
    return at + " (" + m.substr(4, colon - 4) + ")" + m.substr(colon);
  return at + m;
}

// Builds the document from nlohmann/json's SAX events and keeps the rules nlohmann/json leaves to its user (it
// takes a key twice, and any depth). Members are appended in file order without ordered_map's search of the members
// for an equal key at each insert, so a header of 100,000 tensors reads in linear time, not quadratic; each object's
// set of keys refuses a key twice.
class Builder : public nlohmann::json_sax<Value> {
 public:
  Builder(const std::string& argument, const std::string& origin)
      : argument_(argument), where_((origin.empty() ? "" : origin + ": ") + "invalid JSON") {}
  Value take() { return std::move(root_); }

  bool null() override { return scalar(Value(nullptr)); }
  bool boolean(bool v) override { return scalar(Value(v)); }
  bool number_integer(number_integer_t v) override { return scalar(Value(v)); }
  bool number_unsigned(number_unsigned_t v) override { return scalar(Value(v)); }
  bool number_float(number_float_t v, const string_t&) override { return scalar(Value(v)); }
  bool string(string_t& v) override { return scalar(Value(std::move(v))); }
  bool binary(binary_t&) override { refuse("binary value"); }
  bool start_object(std::size_t) override {
    open_.push_back(&put(Value::object()));
    keys_.emplace_back();
    return true;
  }
  bool key(string_t& k) override {
    if (!keys_.back().insert(k).second) refuse("duplicate key \"" + k + "\"");
    key_ = std::move(k);
    return true;
  }
  bool end_object() override {
    open_.pop_back();
    keys_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    open_.push_back(&put(Value::array()));
    return true;
  }
  bool end_array() override {
    open_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) override {
    throw Error(ErrorCode::InvalidArgument, argument_, where_ + detail_of(e));
  }

 private:
  std::string argument_;
  std::string where_;  // "<origin>: invalid JSON"
  Value root_;
  std::vector<Value*> open_;  // the containers being read, innermost last
  std::vector<std::unordered_set<std::string>> keys_;  // those of each open object
  std::string key_;  // the key of the member being read

  [[noreturn]] void refuse(const std::string& why) const {
    throw Error(ErrorCode::InvalidArgument, argument_, where_ + ": " + why);
  }
  // Adds `v` where the text has it: the document, the next element of an array or the member key_ of an object.
  Value& put(Value v) {
    if (open_.size() > static_cast<size_t>(kMaxDepth)) refuse("nesting deeper than " + std::to_string(kMaxDepth));
    if (open_.empty()) return root_ = std::move(v);
    Value& c = *open_.back();
    if (c.is_array()) return c.get_ref<Value::array_t&>().emplace_back(std::move(v));
    return c.get_ref<Value::object_t&>().emplace_back(std::move(key_), std::move(v)).second;
  }
  bool scalar(Value v) {
    put(std::move(v));
    return true;
  }
};

}  // namespace

Value parse(std::string_view text, const std::string& argument, const std::string& origin) {
  Builder b(argument, origin);
  Value::sax_parse(text.begin(), text.end(), &b, nlohmann::json::input_format_t::json, /*strict=*/true,
                   /*ignore_comments=*/false);
  return b.take();
}

const Value* find(const Value& v, std::string_view key) {
  if (!v.is_object()) return nullptr;
  for (const auto& [k, member] : v.get_ref<const Value::object_t&>())
    if (k == key) return &member;
  return nullptr;
}

std::optional<int64_t> integer(const Value& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

const char* kind_name(const Value& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float: return "a number";
    case nlohmann::json::value_t::string: return "a string";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::object: return "an object";
    default: return "?";
  }
}

}  // namespace fp4moe::json
