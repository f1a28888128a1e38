// nvfp4_codec: a small command-line front end to the NVFP4 host codecs (src/format/nvfp4.cpp),
// used by tests/python/test_nvfp4_ml_dtypes.py to compare our encoders with ml_dtypes.
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "fp4moe/nvfp4.h"

namespace {

namespace nv = fp4moe::nvfp4;

const char* kUsage =
    "usage:\n"
    "  nvfp4_codec encode IN OUT_E2M1 OUT_E4M3\n"
    "      IN: raw little-endian fp32 values (a file, or '-' for stdin).\n"
    "      Writes one byte per input value to each output: the E2M1 code (0..15, bit 3 = sign;\n"
    "      round to nearest even, saturating at +-6) and the E4M3 (float8_e4m3fn) code\n"
    "      (round to nearest even, saturating at +-448, NaN -> 0x7f with the sign kept).\n"
    "  nvfp4_codec decode OUT_E2M1 OUT_E4M3\n"
    "      Writes the value of every E2M1 code (16 fp32, code order) and of every E4M3 code\n"
    "      (256 fp32, code order) as raw little-endian fp32.\n"
    "  nvfp4_codec quantize IN K GS OUT_PACKED OUT_SF\n"
    "      IN: an [N, K] fp32 matrix (K a multiple of 16); GS: the encode scale (a decimal or\n"
    "      hex float). Writes the packed E2M1 matrix [N, K/2] and the linear E4M3 block\n"
    "      scales [N, K/16] (SPEC §2).\n"
    "  nvfp4_codec --help\n"
    "Exit status: 0 on success, 2 on a usage error, 1 on an I/O or argument error.\n";

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "nvfp4_codec: %s\n", what.c_str());
  std::exit(1);
}

std::vector<uint8_t> read_all(const std::string& path) {
  FILE* f = path == "-" ? stdin : std::fopen(path.c_str(), "rb");
  if (f == nullptr) fail("cannot open '" + path + "' for reading");
  std::vector<uint8_t> bytes;
  uint8_t buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.insert(bytes.end(), buf, buf + n);
  const bool err = std::ferror(f) != 0;
  if (f != stdin) std::fclose(f);
  if (err) fail("error reading '" + path + "'");
  return bytes;
}

void write_all(const std::string& path, const void* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) fail("cannot open '" + path + "' for writing");
  const bool ok = std::fwrite(data, 1, size, f) == size;
  if (std::fclose(f) != 0 || !ok) fail("error writing '" + path + "'");
}

uint32_t swap_if_big(uint32_t u) {
  if constexpr (std::endian::native == std::endian::big) return __builtin_bswap32(u);
  return u;
}

std::vector<float> read_f32(const std::string& path) {
  const std::vector<uint8_t> bytes = read_all(path);
  if (bytes.size() % 4 != 0) fail("'" + path + "' holds " + std::to_string(bytes.size()) + " bytes, not a multiple of 4");
  std::vector<float> values(bytes.size() / 4);
  for (size_t i = 0; i < values.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, bytes.data() + 4 * i, 4);
    u = swap_if_big(u);
    std::memcpy(&values[i], &u, 4);
  }
  return values;
}

void write_f32(const std::string& path, const std::vector<float>& values) {
  std::vector<uint32_t> words(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    std::memcpy(&words[i], &values[i], 4);
    words[i] = swap_if_big(words[i]);
  }
  write_all(path, words.data(), words.size() * 4);
}

int cmd_encode(const std::string& in, const std::string& out_e2m1, const std::string& out_e4m3) {
  const std::vector<float> x = read_f32(in);
  std::vector<uint8_t> e2m1(x.size()), e4m3(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    e2m1[i] = nv::e2m1_encode(x[i]);
    e4m3[i] = nv::e4m3_encode_satfinite(x[i]);
  }
  write_all(out_e2m1, e2m1.data(), e2m1.size());
  write_all(out_e4m3, e4m3.data(), e4m3.size());
  return 0;
}

int cmd_decode(const std::string& out_e2m1, const std::string& out_e4m3) {
  std::vector<float> e2m1(16), e4m3(256);
  for (int c = 0; c < 16; ++c) e2m1[c] = nv::e2m1_decode(static_cast<uint8_t>(c));
  for (int c = 0; c < 256; ++c) e4m3[c] = nv::e4m3_decode(static_cast<uint8_t>(c));
  write_f32(out_e2m1, e2m1);
  write_f32(out_e4m3, e4m3);
  return 0;
}

int cmd_quantize(const std::string& in, const std::string& k_str, const std::string& gs_str,
                 const std::string& out_packed, const std::string& out_sf) {
  char* end = nullptr;
  const long long K = std::strtoll(k_str.c_str(), &end, 10);
  if (end == k_str.c_str() || *end != '\0' || K <= 0 || K % nv::kBlock != 0)
    fail("K must be a positive multiple of 16, got '" + k_str + "'");
  const float gs = std::strtof(gs_str.c_str(), &end);
  if (end == gs_str.c_str() || *end != '\0') fail("GS must be a number, got '" + gs_str + "'");
  const std::vector<float> x = read_f32(in);
  if (x.size() % static_cast<size_t>(K) != 0)
    fail("the input holds " + std::to_string(x.size()) + " values, not a multiple of K=" + k_str);
  const int64_t N = static_cast<int64_t>(x.size()) / K;
  std::vector<uint8_t> packed(static_cast<size_t>(N * K / 2)), sf(static_cast<size_t>(N * K / nv::kBlock));
  nv::quantize_matrix(x.data(), N, K, gs, packed.data(), sf.data());
  write_all(out_packed, packed.data(), packed.size());
  write_all(out_sf, sf.data(), sf.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  if (args[0] == "--help" || args[0] == "-h") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  try {
    if (args[0] == "encode" && args.size() == 4) return cmd_encode(args[1], args[2], args[3]);
    if (args[0] == "decode" && args.size() == 3) return cmd_decode(args[1], args[2]);
    if (args[0] == "quantize" && args.size() == 6) return cmd_quantize(args[1], args[2], args[3], args[4], args[5]);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  std::fputs(kUsage, stderr);
  return 2;
}
