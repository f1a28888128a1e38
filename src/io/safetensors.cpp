#include "io/safetensors.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>

#include "io/json.h"
#include "io/json_write.h"

namespace fp4moe::safetensors {

namespace {

constexpr uint64_t kMaxHeader = 100ull << 20;  // the format's own limit (100 MB)
constexpr int kMaxRank = 8;

struct DtypeInfo {
  const char* name;
  size_t size;
  bool has;
  DType dtype;
};
constexpr DtypeInfo kDtypes[] = {
    {"F64", 8, true, DType::F64},   {"F32", 4, true, DType::F32},     {"F16", 2, true, DType::F16},
    {"BF16", 2, true, DType::BF16}, {"I64", 8, true, DType::I64},     {"I32", 4, true, DType::I32},
    {"U8", 1, true, DType::U8},     {"F8_E4M3", 1, true, DType::E4M3}, {"I16", 2, false, DType::U8},
    {"U16", 2, false, DType::U8},   {"U32", 4, false, DType::U8},     {"U64", 8, false, DType::U8},
    {"I8", 1, false, DType::U8},    {"BOOL", 1, false, DType::U8},    {"F8_E5M2", 1, false, DType::U8},
};

const DtypeInfo* dtype_info(const std::string& n) {
  for (const auto& d : kDtypes)
    if (n == d.name) return &d;
  return nullptr;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31) v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  return sign ? -v : v;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

File File::open(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::NotFound, "path", "cannot open safetensors file '" + path + "'");
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(0, std::ios::beg);
  File f;
  f.origin_ = path;
  if (size < 0) throw Error(ErrorCode::InvalidArgument, "path", path + ": cannot determine the file size");
  f.file_size_ = static_cast<uint64_t>(size);
  if (f.file_size_ < 8)
    throw Error(ErrorCode::InvalidArgument, "path",
                path + ": expected at least 8 bytes (the header length), got a file of " + std::to_string(size));
  uint8_t len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  if (n > kMaxHeader || n > f.file_size_ - 8)
    throw Error(ErrorCode::InvalidArgument, "path",
                path + ": header length " + std::to_string(n) + " exceeds the file (" + std::to_string(size) +
                    " bytes) or the 100 MB limit");
  std::string header(static_cast<size_t>(n), '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  if (static_cast<uint64_t>(in.gcount()) != n)
    throw Error(ErrorCode::InvalidArgument, "path", path + ": the header could not be read whole");
  f.data_start_ = 8 + n;
  f.parse_header(header);
  return f;
}

File File::from_bytes(std::vector<uint8_t> bytes, const std::string& origin) {
  File f;
  f.origin_ = origin;
  f.file_size_ = bytes.size();
  if (f.file_size_ < 8)
    throw Error(ErrorCode::InvalidArgument, "path",
                origin + ": expected at least 8 bytes (the header length), got " + std::to_string(bytes.size()));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<size_t>(i)];
  if (n > kMaxHeader || n > f.file_size_ - 8)
    throw Error(ErrorCode::InvalidArgument, "path",
                origin + ": header length " + std::to_string(n) + " exceeds the file (" +
                    std::to_string(bytes.size()) + " bytes) or the 100 MB limit");
  f.data_start_ = 8 + n;
  const std::string header(reinterpret_cast<const char*>(bytes.data()) + 8, static_cast<size_t>(n));
  f.image_ = std::move(bytes);
  f.parse_header(header);
  return f;
}

void File::parse_header(const std::string& header) {
  auto bad = [&](const std::string& what) {
    throw Error(ErrorCode::InvalidArgument, "path", origin_ + ": " + what);
  };
  if (header.empty() || header[0] != '{') bad("expected the header to be a JSON object starting with '{'");
  const json::Value root = json::parse(header, "path", origin_);
  if (!root.is_object()) bad("expected the header to be a JSON object");
  const uint64_t data_size = file_size_ - data_start_;
  for (const auto& [name, v] : json::members(root)) {
    if (name == "__metadata__") {
      if (!v.is_object()) bad("expected __metadata__ to be an object, got " + std::string(json::kind_name(v)));
      for (const auto& [k, s] : json::members(v)) {
        if (!s.is_string()) bad("expected __metadata__[\"" + k + "\"] to be a string");
        metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (name.empty()) bad("expected non-empty tensor names");
    if (!v.is_object()) bad(where + ": expected an object, got " + json::kind_name(v));
    for (const auto& kv : json::members(v))
      if (kv.first != "dtype" && kv.first != "shape" && kv.first != "data_offsets")
        bad(where + ": unexpected key \"" + kv.first + "\"");
    const json::Value* dt = json::find(v, "dtype");
    const json::Value* sh = json::find(v, "shape");
    const json::Value* off = json::find(v, "data_offsets");
    if (!dt || !dt->is_string()) bad(where + ": expected a string \"dtype\"");
    if (!sh || !sh->is_array()) bad(where + ": expected an array \"shape\"");
    if (!off || !off->is_array() || off->size() != 2) bad(where + ": expected \"data_offsets\" [begin, end]");
    TensorInfo t;
    t.name = name;
    t.dtype_name = dt->get<std::string>();
    const DtypeInfo* di = dtype_info(t.dtype_name);
    if (!di) bad(where + ": unknown dtype \"" + t.dtype_name + "\"");
    t.elem_size = di->size;
    t.has_dtype = di->has;
    t.dtype = di->dtype;
    if (sh->size() > static_cast<size_t>(kMaxRank))
      bad(where + ": expected at most " + std::to_string(kMaxRank) + " dims, got " + std::to_string(sh->size()));
    uint64_t numel = 1;
    for (const json::Value& d : *sh) {
      const std::optional<int64_t> n = json::integer(d);
      if (!n || *n < 0) bad(where + ": expected non-negative integer sizes in \"shape\"");
      const uint64_t s = static_cast<uint64_t>(*n);
      if (s != 0 && numel > (uint64_t(1) << 56) / s) bad(where + ": shape too large");
      numel *= s;
      t.shape.push_back(*n);
    }
    uint64_t offsets[2];
    for (size_t i = 0; i < 2; ++i) {
      const std::optional<int64_t> o = json::integer((*off)[i]);
      if (!o || *o < 0) bad(where + ": expected non-negative integer data_offsets");
      offsets[i] = static_cast<uint64_t>(*o);
    }
    t.begin = offsets[0];
    t.end = offsets[1];
    if (t.begin > t.end) bad(where + ": data_offsets begin " + std::to_string(t.begin) + " > end " + std::to_string(t.end));
    if (t.end > data_size)
      bad(where + ": data_offsets end " + std::to_string(t.end) + " is past the data buffer (" +
          std::to_string(data_size) + " bytes)");
    const uint64_t bytes = numel * t.elem_size;
    if (t.end - t.begin != bytes)
      bad(where + ": expected " + std::to_string(bytes) + " bytes for " + t.dtype_name + " shape of " +
          std::to_string(numel) + " elements, got data_offsets spanning " + std::to_string(t.end - t.begin));
    tensors_.push_back(std::move(t));
  }
  // No two tensors may share bytes (holes between tensors are tolerated).
  std::vector<const TensorInfo*> order;
  for (const auto& t : tensors_)
    if (t.end > t.begin) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i]->begin < order[i - 1]->end)
      bad("tensors '" + order[i - 1]->name + "' and '" + order[i]->name + "' overlap");
}

const TensorInfo* File::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::vector<uint8_t> File::read(const TensorInfo& t) const {
  // t comes from this file's own validated table; re-check anyway so a foreign TensorInfo cannot read out of bounds.
  if (t.begin > t.end || t.end > file_size_ - data_start_)
    throw Error(ErrorCode::InvalidArgument, t.name, origin_ + ": data_offsets outside the data buffer");
  const size_t n = static_cast<size_t>(t.end - t.begin);
  std::vector<uint8_t> out(n);
  if (!image_.empty()) {
    if (n) std::memcpy(out.data(), image_.data() + data_start_ + t.begin, n);
    return out;
  }
  std::ifstream in(origin_, std::ios::binary);
  if (!in) throw Error(ErrorCode::NotFound, "path", "cannot reopen safetensors file '" + origin_ + "'");
  in.seekg(static_cast<std::streamoff>(data_start_ + t.begin));
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(n));
  if (static_cast<size_t>(in.gcount()) != n)
    throw Error(ErrorCode::InvalidArgument, "path", origin_ + ": tensor '" + t.name + "' could not be read whole (file changed?)");
  return out;
}

std::vector<uint16_t> File::read_bf16(const TensorInfo& t) const {
  const std::vector<uint8_t> raw = read(t);
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<uint16_t> out(n);
  if (t.dtype_name == "BF16") {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(raw[2 * i] | (raw[2 * i + 1] << 8));
  } else if (t.dtype_name == "F32") {
    for (size_t i = 0; i < n; ++i) {
      uint32_t u = 0;
      for (int b = 3; b >= 0; --b) u = (u << 8) | raw[4 * i + static_cast<size_t>(b)];
      float f;
      std::memcpy(&f, &u, 4);
      out[i] = f32_to_bf16_bits(f);
    }
  } else if (t.dtype_name == "F16") {
    for (size_t i = 0; i < n; ++i)
      out[i] = f32_to_bf16_bits(f16_to_f32(static_cast<uint16_t>(raw[2 * i] | (raw[2 * i + 1] << 8))));
  } else {
    throw Error(ErrorCode::InvalidArgument, t.name,
                origin_ + ": expected dtype BF16, F32 or F16, got " + t.dtype_name);
  }
  return out;
}

void write_file(const std::string& path, const std::vector<WriteTensor>& tensors,
                const std::map<std::string, std::string>& metadata) {
  std::string h = "{";
  bool first = true;
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    bool f2 = true;
    for (const auto& [k, v] : metadata) {
      if (!f2) h += ",";
      h += json::quote(k) + ":" + json::quote(v);
      f2 = false;
    }
    h += "}";
    first = false;
  }
  uint64_t off = 0;
  for (const auto& t : tensors) {
    if (!first) h += ",";
    first = false;
    h += json::quote(t.name) + ":{\"dtype\":" + json::quote(t.dtype_name) + ",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i) h += ',';
      h += std::to_string(t.shape[i]);
    }
    h += "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + t.bytes.size()) + "]}";
    off += t.bytes.size();
  }
  h += "}";
  while (h.size() % 8) h += ' ';  // the format's customary alignment of the data buffer
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(ErrorCode::NotFound, "path", "cannot create '" + path + "'");
  uint8_t len[8];
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& t : tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
  if (!out) throw Error(ErrorCode::InvalidArgument, "path", "writing '" + path + "' failed");
}

}  // namespace fp4moe::safetensors
