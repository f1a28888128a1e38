#include "io/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "fp4moe/types.h"

namespace fp4moe::json {

namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  Parser(std::string_view t, const std::string& what) : t_(t), what_(what) {}

  Value document() {
    skip_ws();
    Value v = value(0);
    skip_ws();
    if (p_ != t_.size()) fail("unexpected trailing characters");
    return v;
  }

 private:
  std::string_view t_;
  const std::string& what_;
  size_t p_ = 0;

  [[noreturn]] void fail(const std::string& msg) const {
    throw Error(ErrorCode::InvalidArgument, what_, "invalid JSON at byte " + std::to_string(p_) + ": " + msg);
  }
  bool at_end() const { return p_ >= t_.size(); }
  char peek() const { return at_end() ? '\0' : t_[p_]; }
  void skip_ws() {
    while (!at_end() && (t_[p_] == ' ' || t_[p_] == '\t' || t_[p_] == '\n' || t_[p_] == '\r')) ++p_;
  }
  void expect(char c) {
    if (peek() != c || at_end()) fail(std::string("expected '") + c + "'");
    ++p_;
  }
  void literal(std::string_view word) {
    if (t_.substr(p_, word.size()) != word) fail("unknown literal");
    p_ += word.size();
  }

  Value value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    if (at_end()) fail("unexpected end of text");
    Value v;
    switch (peek()) {
      case '{': object(v, depth); break;
      case '[': array(v, depth); break;
      case '"': v.kind = Value::Kind::String; v.str = string(); break;
      case 't': literal("true"); v.kind = Value::Kind::Bool; v.boolean = true; break;
      case 'f': literal("false"); v.kind = Value::Kind::Bool; v.boolean = false; break;
      case 'n': literal("null"); v.kind = Value::Kind::Null; break;
      default: number(v); break;
    }
    return v;
  }

  void object(Value& v, int depth) {
    v.kind = Value::Kind::Object;
    expect('{');
    skip_ws();
    if (peek() == '}') { ++p_; return; }
    for (;;) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      std::string key = string();
      for (const auto& kv : v.object)
        if (kv.first == key) fail("duplicate key \"" + key + "\"");
      skip_ws();
      expect(':');
      skip_ws();
      v.object.emplace_back(std::move(key), value(depth + 1));
      skip_ws();
      if (peek() == ',') { ++p_; continue; }
      if (peek() == '}') { ++p_; return; }
      fail("expected ',' or '}'");
    }
  }

  void array(Value& v, int depth) {
    v.kind = Value::Kind::Array;
    expect('[');
    skip_ws();
    if (peek() == ']') { ++p_; return; }
    for (;;) {
      skip_ws();
      v.array.push_back(value(depth + 1));
      skip_ws();
      if (peek() == ',') { ++p_; continue; }
      if (peek() == ']') { ++p_; return; }
      fail("expected ',' or ']'");
    }
  }

  unsigned hex4() {
    if (p_ + 4 > t_.size()) fail("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = t_[p_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= unsigned(c - '0');
      else if (c >= 'a' && c <= 'f') v |= unsigned(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= unsigned(c - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return v;
  }

  static void utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xc0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += char(0xe0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3f));
      out += char(0x80 | (cp & 0x3f));
    } else {
      out += char(0xf0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3f));
      out += char(0x80 | ((cp >> 6) & 0x3f));
      out += char(0x80 | (cp & 0x3f));
    }
  }

  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      const char c = t_[p_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_end()) fail("unterminated escape");
      const char e = t_[p_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xd800 && cp < 0xdc00) {  // a high surrogate must be followed by a low one
            if (t_.substr(p_, 2) != "\\u") fail("lone high surrogate");
            p_ += 2;
            const unsigned lo = hex4();
            if (lo < 0xdc00 || lo >= 0xe000) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          } else if (cp >= 0xdc00 && cp < 0xe000) {
            fail("lone low surrogate");
          }
          utf8(out, cp);
          break;
        }
        default: fail("unknown escape");
      }
    }
  }

  void number(Value& v) {
    const size_t start = p_;
    if (peek() == '-') ++p_;
    if (peek() == '0') {
      ++p_;
    } else if (peek() >= '1' && peek() <= '9') {
      while (peek() >= '0' && peek() <= '9' && !at_end()) ++p_;
    } else {
      fail("unexpected character");
    }
    bool integral = true;
    if (peek() == '.' && !at_end()) {
      integral = false;
      ++p_;
      if (!(peek() >= '0' && peek() <= '9') || at_end()) fail("digit expected after '.'");
      while (peek() >= '0' && peek() <= '9' && !at_end()) ++p_;
    }
    if ((peek() == 'e' || peek() == 'E') && !at_end()) {
      integral = false;
      ++p_;
      if (peek() == '+' || peek() == '-') ++p_;
      if (!(peek() >= '0' && peek() <= '9') || at_end()) fail("digit expected in exponent");
      while (peek() >= '0' && peek() <= '9' && !at_end()) ++p_;
    }
    const std::string text(t_.substr(start, p_ - start));
    v.kind = Value::Kind::Number;
    v.number = std::strtod(text.c_str(), nullptr);
    if (integral) {
      // Exact int64 parse with overflow detection (doubles lose precision past 2^53).
      const bool neg = text[0] == '-';
      uint64_t acc = 0;
      bool overflow = false;
      for (size_t i = neg ? 1 : 0; i < text.size(); ++i) {
        const uint64_t d = uint64_t(text[i] - '0');
        if (acc > (UINT64_MAX - d) / 10) { overflow = true; break; }
        acc = acc * 10 + d;
      }
      const uint64_t limit = neg ? (uint64_t(1) << 63) : (uint64_t(1) << 63) - 1;
      if (!overflow && acc <= limit) {
        v.is_int = true;
        v.integer = neg ? static_cast<int64_t>(0 - acc) : static_cast<int64_t>(acc);
      }
    }
  }
};

}  // namespace

const Value* Value::find(std::string_view key) const {
  if (kind != Kind::Object) return nullptr;
  for (const auto& kv : object)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

Value parse(std::string_view text, const std::string& what) { return Parser(text, what).document(); }

const char* kind_name(Value::Kind k) {
  switch (k) {
    case Value::Kind::Null: return "null";
    case Value::Kind::Bool: return "a boolean";
    case Value::Kind::Number: return "a number";
    case Value::Kind::String: return "a string";
    case Value::Kind::Array: return "an array";
    case Value::Kind::Object: return "an object";
  }
  return "?";
}

std::string quote(std::string_view s) {
  std::string o = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      o += buf;
    } else {
      o += c;
    }
  }
  return o + "\"";
}

}  // namespace fp4moe::json
