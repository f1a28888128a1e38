// The safetensors reader, its JSON parser, and the PEFT fused-experts adapter reader: round trips
// through files written here, and clear errors on malformed files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/moe.h"
#include "test_helpers.h"
#include "fp4moe/peft.h"
#include "fp4moe/quantize.h"
#include "io/json.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "runtime/prepared.h"

using namespace fp4moe;
namespace fs = std::filesystem;
namespace st = fp4moe::safetensors;

namespace {

using fp4moe::testutil::TempDir;


std::vector<uint8_t> bytes_of(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

// A file image from a header string and a data buffer (no validation: for malformed cases).
std::vector<uint8_t> image(const std::string& header, const std::vector<uint8_t>& data,
                           std::optional<uint64_t> len_override = std::nullopt) {
  std::vector<uint8_t> out(8);
  const uint64_t n = len_override ? *len_override : header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  for (char c : header) out.push_back(static_cast<uint8_t>(c));
  for (uint8_t b : data) out.push_back(b);
  return out;
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream o(path, std::ios::binary | std::ios::trunc);
  o.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}
void write_text(const std::string& path, const std::string& s) {
  std::ofstream o(path, std::ios::binary | std::ios::trunc);
  o << s;
}

// Expects f to throw fp4moe::Error whose message contains `needle` (and code `code`).
void expect_error(const std::function<void()>& f, const std::string& needle,
                  ErrorCode code = ErrorCode::InvalidArgument) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

std::vector<uint16_t> rand_bf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<uint16_t> v(n);
  for (auto& b : v) b = f32_to_bf16_bits(d(rng));
  return v;
}

}  // namespace

// ---- JSON ---------------------------------------------------------------------------------------------
TEST(Json, ParsesTheGrammarAndRefusesGarbage) {
  const json::Value v = json::parse(
      R"( {"a": [1, -2, 3.5, 1e3, true, false, null], "s": "x\"\\\/\n\u00e9\ud83d\ude00", "big": 9223372036854775807,
           "huge": 9223372036854775808, "o": {}} )",
      "t");
  ASSERT_TRUE(v.is_object());
  const json::Value* a = json::find(v, "a");
  ASSERT_TRUE(a && a->is_array() && a->size() == 7);
  EXPECT_EQ(json::integer((*a)[0]), 1);
  EXPECT_EQ(json::integer((*a)[1]), -2);
  EXPECT_FALSE(json::integer((*a)[2]));
  EXPECT_EQ((*a)[2].get<double>(), 3.5);
  EXPECT_EQ((*a)[3].get<double>(), 1000.0);
  EXPECT_FALSE(json::integer((*a)[3]));
  EXPECT_TRUE((*a)[4].get<bool>());
  EXPECT_TRUE((*a)[6].is_null());
  EXPECT_EQ(json::find(v, "s")->get<std::string>(), "x\"\\/\n\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ(json::integer(*json::find(v, "big")), INT64_MAX);
  EXPECT_FALSE(json::integer(*json::find(v, "huge")));
  EXPECT_EQ(json::find(v, "nope"), nullptr);
  EXPECT_EQ(json::find(*a, "a"), nullptr);  // not an object
  // Members stay in file order.
  const json::Value ordered = json::parse(R"({"z":1,"a":2,"m":3})", "t");
  std::string order;
  for (const auto& [k, m] : json::members(ordered)) order += k;
  EXPECT_EQ(order, "zam");
  for (const char* bad : {"", "{", "{\"a\":1,}", "[1 2]", "{\"a\":1} x", "{\"a\":1,\"a\":2}", "01", "1.", "-", "\"\\x\"",
                          "\"abc", "tru", "{1:2}", "\"\\ud800\"", "[\"\x01\"]", "nan", "1e"})
    EXPECT_THROW(json::parse(bad, "t"), Error) << bad;
  std::string deep(200, '[');
  deep += std::string(200, ']');
  EXPECT_THROW(json::parse(deep, "t"), Error);
}

TEST(Json, RefusalsNameTheFileAndThePlace) {
  auto refused = [](const std::string& text) -> std::string {
    try {
      json::parse(text, "config", "dir/config.json");
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
      EXPECT_EQ(e.argument(), "config");
      return e.what();
    }
    ADD_FAILURE() << "accepted: " << text;
    return "";
  };
  EXPECT_NE(refused("{\"a\": tru}").find("dir/config.json: invalid JSON at byte 10 (line 1, column 10): "),
            std::string::npos);
  EXPECT_NE(refused("{\n\"a\": 1,\n\"a\": 2}").find("dir/config.json: invalid JSON: duplicate key \"a\""),
            std::string::npos);
  EXPECT_NE(refused("{\"o\": {\"a\": 1, \"a\": 2}}").find("duplicate key \"a\""), std::string::npos);
  EXPECT_NO_THROW(json::parse(R"({"a": 1, "o": {"a": 2}, "p": [{"a": 3}, {"a": 4}]})", "t"));  // one key, many objects
  // Nesting: a value at most 64 levels down.
  const auto nested = [](int n) { return std::string(size_t(n), '[') + "1" + std::string(size_t(n), ']'); };
  EXPECT_NO_THROW(json::parse(nested(json::kMaxDepth), "t"));
  EXPECT_NE(refused(nested(json::kMaxDepth + 1)).find("nesting deeper than 64"), std::string::npos);
  // Numbers past a double and text that is not UTF-8 are refused as fp4moe errors too.
  EXPECT_NE(refused("[1e400]").find("invalid JSON"), std::string::npos);
  const std::string not_utf8 = refused("[\"\xff\"]");
  EXPECT_NE(not_utf8.find("invalid JSON at byte 3"), std::string::npos);
  EXPECT_EQ(not_utf8.find('\xff'), std::string::npos) << "the message quotes the ill-formed byte";
  EXPECT_STREQ(json::kind_name(json::parse("[]", "t")), "an array");
}

TEST(Json, ALargeObjectReadsInLinearTime) {
  // A checkpoint index of 100,000 tensors (DeepSeek-V3 has 92,000): a search of the members for each key, as an
  // ordered map inserts, is quadratic (about 20 s); reading members in order takes well under a second.
  std::string text = "{\"weight_map\": {";
  const int n = 100000;
  for (int i = 0; i < n; ++i)
    text += (i ? ",\"" : "\"") + std::string("model.layers.") + std::to_string(i / 2000) + ".mlp.experts." +
            std::to_string(i % 2000) + ".down_proj.weight\": \"model-00001-of-00163.safetensors\"";
  text += "}}";
  const auto t0 = std::chrono::steady_clock::now();
  const json::Value v = json::parse(text, "t");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(json::find(v, "weight_map")->size(), size_t(n));
  EXPECT_EQ(json::members(*json::find(v, "weight_map")).back().first, "model.layers.49.mlp.experts.1999.down_proj.weight");
  EXPECT_LT(s, 5.0);
}

// ---- safetensors -------------------------------------------------------------------------------------------
TEST(Safetensors, RoundTripThroughAFile) {
  TempDir dir;
  const std::vector<uint16_t> bf = rand_bf16(3 * 5, 1);
  std::vector<float> f32(4);
  for (int i = 0; i < 4; ++i) f32[static_cast<size_t>(i)] = 0.1f * float(i) - 0.7f;
  const std::vector<uint8_t> u8 = {1, 2, 3, 250, 7, 9};
  const std::vector<int64_t> i64 = {-5, 1LL << 40};
  st::write_file(dir.file("a.safetensors"),
                 {{"w.bf16", "BF16", {3, 5}, bytes_of(bf.data(), bf.size() * 2)},
                  {"w.f32", "F32", {2, 2}, bytes_of(f32.data(), 16)},
                  {"w.u8", "U8", {6}, u8},
                  {"w.e4m3", "F8_E4M3", {2, 3}, u8},
                  {"w.i64", "I64", {2}, bytes_of(i64.data(), 16)},
                  {"empty", "F32", {0, 4}, {}},
                  {"scalar \"q\"", "F32", {}, bytes_of(f32.data(), 4)}},
                 {{"format", "pt"}});
  const st::File f = st::File::open(dir.file("a.safetensors"));
  ASSERT_EQ(f.tensors().size(), 7u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const auto* t = f.find("w.bf16");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{3, 5}));
  EXPECT_TRUE(t->has_dtype);
  EXPECT_EQ(t->dtype, DType::BF16);
  EXPECT_EQ(f.read_bf16(*t), bf);
  std::vector<uint16_t> f32_as_bf16 = f.read_bf16(*f.find("w.f32"));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(f32_as_bf16[static_cast<size_t>(i)], f32_to_bf16_bits(f32[static_cast<size_t>(i)]));
  EXPECT_EQ(f.read(*f.find("w.u8")), u8);
  EXPECT_EQ(f.find("w.e4m3")->dtype, DType::E4M3);
  EXPECT_EQ(f.read(*f.find("w.i64")), bytes_of(i64.data(), 16));
  EXPECT_EQ(f.find("empty")->numel(), 0);
  EXPECT_TRUE(f.read(*f.find("empty")).empty());
  EXPECT_EQ(f.find("scalar \"q\"")->numel(), 1);
  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_THROW(f.read_bf16(*f.find("w.u8")), Error);

  // The same bytes in memory parse identically.
  std::ifstream in(dir.file("a.safetensors"), std::ios::binary);
  std::vector<uint8_t> all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const st::File g = st::File::from_bytes(all);
  EXPECT_EQ(g.read_bf16(*g.find("w.bf16")), bf);
}

TEST(Safetensors, MalformedFilesGiveClearErrors) {
  TempDir dir;
  const std::vector<uint8_t> data(16, 0xab);
  auto parse = [](std::vector<uint8_t> img) { return [img] { st::File::from_bytes(img, "bad.st"); }; };
  const std::string ok = R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  ASSERT_NO_THROW(st::File::from_bytes(image(ok, data)));

  expect_error(parse({1, 2, 3}), "at least 8 bytes");
  expect_error(parse(image(ok, data, 1 << 20)), "header length");
  expect_error(parse(image(ok, data, static_cast<int64_t>(ok.size()) + 17)), "header length");
  expect_error(parse(image(ok, data, UINT64_MAX - 1)), "header length");
  expect_error(parse(image("[1,2]", {})), "JSON object");
  expect_error(parse(image("{\"t\":", {})), "invalid JSON");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,32]}})", data)), "past the data buffer");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", data)), "begin 16 > end 0");
  expect_error(parse(image(R"({"t":{"dtype":"F99","shape":[2,2],"data_offsets":[0,16]}})", data)), "unknown dtype");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", data)), "expected 24 bytes");
  expect_error(parse(image(R"({"t":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,16]}})", data)), "expected 8 bytes");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}})", data)), "non-negative integer sizes");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[2.5,2],"data_offsets":[0,16]}})", data)), "non-negative integer sizes");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", data)),
               "too large");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0]}})", data)), "data_offsets");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,-16]}})", data)), "data_offsets");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[2,2]}})", data)), "data_offsets");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16],"x":1}})", data)), "unexpected key");
  expect_error(parse(image(R"({"t":[1]})", data)), "expected an object");
  expect_error(parse(image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"t":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", data)),
               "duplicate key");
  expect_error(parse(image(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", data)),
               "overlap");
  expect_error(parse(image(R"({"__metadata__":{"k":1}})", {})), "__metadata__");

  // A real file cut short after writing: its offsets now point past the end.
  std::vector<float> v(64, 1.f);
  st::write_file(dir.file("cut.safetensors"), {{"v", "F32", {64}, bytes_of(v.data(), 256)}});
  const auto full = fs::file_size(dir.file("cut.safetensors"));
  fs::resize_file(dir.file("cut.safetensors"), full - 10);
  expect_error([&] { st::File::open(dir.file("cut.safetensors")); }, "past the data buffer");
  fs::resize_file(dir.file("cut.safetensors"), 5);
  expect_error([&] { st::File::open(dir.file("cut.safetensors")); }, "at least 8 bytes");
  expect_error([&] { st::File::open(dir.file("none.safetensors")); }, "cannot open", ErrorCode::NotFound);
}

// ---- PEFT ------------------------------------------------------------------------------------------------------
namespace {

// Per-expert matrices of one layer and their PEFT storage (SPEC §5).
struct PeftLayer {
  int64_t E = 4, r = 3, H = 32, I = 16;
  std::vector<uint16_t> ag, bg, ad, bd;  // per expert: [E, r, H], [E, 2I, r], [E, r, I], [E, H, r]
  explicit PeftLayer(uint32_t seed) {
    ag = rand_bf16(size_t(E * r * H), seed);
    bg = rand_bf16(size_t(E * 2 * I * r), seed + 1);
    ad = rand_bf16(size_t(E * r * I), seed + 2);
    bd = rand_bf16(size_t(E * H * r), seed + 3);
  }
  // lora_A [r*E, in]: row e*r + c is expert e's row c.
  std::vector<uint16_t> pack_a(const std::vector<uint16_t>& a, int64_t in) const { return a; }
  // lora_B [out, r*E]: element [n][c*E + e] is expert e's B[n][c].
  std::vector<uint16_t> pack_b(const std::vector<uint16_t>& b, int64_t out) const {
    std::vector<uint16_t> p(static_cast<size_t>(out * r * E));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t n = 0; n < out; ++n)
        for (int64_t c = 0; c < r; ++c) p[n * r * E + c * E + e] = b[(e * out + n) * r + c];
    return p;
  }
  void add(std::vector<st::WriteTensor>& ts, const std::string& prefix, bool gate_up, bool down,
           bool nested = true) const {
    const std::string gu = prefix + (nested && down ? "experts.base_layer." : "experts.");
    if (gate_up) {
      ts.push_back({gu + "lora_A.weight", "BF16", {r * E, H}, bytes_of(pack_a(ag, H).data(), ag.size() * 2)});
      const auto b = pack_b(bg, 2 * I);
      ts.push_back({gu + "lora_B.weight", "BF16", {2 * I, r * E}, bytes_of(b.data(), b.size() * 2)});
    }
    if (down) {
      ts.push_back({prefix + "experts.lora_A.weight", "BF16", {r * E, I}, bytes_of(ad.data(), ad.size() * 2)});
      const auto b = pack_b(bd, H);
      ts.push_back({prefix + "experts.lora_B.weight", "BF16", {H, r * E}, bytes_of(b.data(), b.size() * 2)});
    }
  }
};

const char* kConfig = R"({"peft_type": "LORA", "r": 3, "lora_alpha": 6, "use_rslora": false, "target_modules": null,
  "target_parameters": ["experts.gate_up_proj", "experts.down_proj"], "rank_pattern": {}, "alpha_pattern": {}})";

}  // namespace

TEST(Peft, ReadsFusedExpertsPerSpecReshape) {
  TempDir dir;
  PeftLayer l0(10), l1(20);
  std::vector<st::WriteTensor> ts;
  l0.add(ts, "base_model.model.model.layers.0.mlp.", true, true);
  l1.add(ts, "base_model.model.model.layers.1.mlp.", true, true);
  st::write_file(dir.file("adapter_model.safetensors"), ts);
  write_text(dir.file("adapter_config.json"), kConfig);

  EXPECT_EQ(list_peft_expert_modules(dir.path.string()),
            (std::vector<std::string>{"base_model.model.model.layers.0.mlp.", "base_model.model.model.layers.1.mlp."}));
  const PeftConfig c = read_peft_config(dir.file("adapter_config.json"));
  EXPECT_EQ(c.r, 3);
  EXPECT_EQ(c.lora_alpha, 6.f);
  EXPECT_EQ(c.target_parameters.size(), 2u);

  PeftReadOptions opt;
  opt.module_prefix = "base_model.model.model.layers.1.mlp.";
  opt.num_experts = 4;
  const PeftExpertsLora p = read_peft_experts_lora(dir.path.string(), opt);
  EXPECT_EQ(p.E, 4);
  EXPECT_EQ(p.H, 32);
  EXPECT_EQ(p.I, 16);
  EXPECT_EQ(p.N1, 32);
  EXPECT_EQ(p.rank, 3);
  EXPECT_TRUE(p.has_gate_up && p.has_down);
  EXPECT_EQ(p.a_gate_up, l1.ag);
  EXPECT_EQ(p.b_gate_up, l1.bg);
  EXPECT_EQ(p.a_down, l1.ad);
  EXPECT_EQ(p.b_down, l1.bd);

  // Expert parallelism: experts [1, 3).
  opt.expert_offset = 1;
  opt.num_local_experts = 2;
  opt.num_experts = 0;  // inferred
  const PeftExpertsLora q = read_peft_experts_lora(dir.path.string(), opt);
  EXPECT_EQ(q.E, 2);
  const int64_t r = 3, H = 32, I = 16;
  EXPECT_EQ(q.a_gate_up, std::vector<uint16_t>(l1.ag.begin() + 1 * r * H, l1.ag.begin() + 3 * r * H));
  EXPECT_EQ(q.b_gate_up, std::vector<uint16_t>(l1.bg.begin() + 1 * 2 * I * r, l1.bg.begin() + 3 * 2 * I * r));
  EXPECT_EQ(q.b_down, std::vector<uint16_t>(l1.bd.begin() + 1 * H * r, l1.bd.begin() + 3 * H * r));

  // The result loads into a registry of a matching layer (E = 2 local experts, H = 32, I = 16).
  std::vector<float> w1(2 * 32 * 32, 0.01f), w2(2 * 32 * 16, 0.02f);
  QuantizeOptions qo;
  qo.format = WeightFormat::BF16;
  OwnedWeights ow = quantize_weights(make_view(w1.data(), DType::F32, {2, 32, 32}),
                                     make_view(w2.data(), DType::F32, {2, 32, 16}), qo);
  MoeWeights w = prepare_weights(ow.desc(), Backend::CPU);
  AdapterRegistry reg(w, 2);
  reg.load(0, q.desc());
  const PreparedAdapter& a = *(*reg.snapshot())[0];
  EXPECT_EQ(a.scale, 2.f);
  EXPECT_EQ(a.A1, q.a_gate_up);
  EXPECT_EQ(bf16_bits_to_f32(a.B1[5]), 2.f * bf16_bits_to_f32(q.b_gate_up[5]));  // power-of-two scale: exact
}

TEST(Peft, SingleTargetAndF32Storage) {
  TempDir dir;
  PeftLayer l(30);
  std::vector<st::WriteTensor> ts;
  l.add(ts, "m.", true, false);  // gate_up only: keys carry "experts." without base_layer
  // Store lora_A in F32: it is rounded to bf16 on read (values are bf16 already, so exactly).
  std::vector<float> a32(l.ag.size());
  for (size_t i = 0; i < a32.size(); ++i) a32[i] = bf16_bits_to_f32(l.ag[i]);
  ts[0] = {"m.experts.lora_A.weight", "F32", {l.r * l.E, l.H}, bytes_of(a32.data(), a32.size() * 4)};
  st::write_file(dir.file("adapter_model.safetensors"), ts);
  write_text(dir.file("adapter_config.json"),
             R"({"r": 3, "lora_alpha": 12.5, "use_rslora": true, "target_parameters": ["mlp.experts.gate_up_proj"]})");
  PeftReadOptions opt;
  opt.module_prefix = "m.";
  const PeftExpertsLora p = read_peft_experts_lora(dir.path.string(), opt);
  EXPECT_TRUE(p.has_gate_up);
  EXPECT_FALSE(p.has_down);
  EXPECT_TRUE(p.use_rslora);
  EXPECT_EQ(p.lora_alpha, 12.5f);
  EXPECT_EQ(p.a_gate_up, l.ag);
  EXPECT_EQ(p.b_gate_up, l.bg);
  const LoraAdapterDesc d = p.desc();
  EXPECT_FALSE(d.a_down.present());
  EXPECT_EQ(d.a_gate_up.shape[0], 4);
  EXPECT_EQ(d.b_gate_up.shape[1], 32);
}

TEST(Peft, BadConfigsAndMissingTensorsAreReported) {
  const std::string origin = "adapter_config.json";
  auto cfg = [&](const std::string& text) { return [text, origin] { peft::parse_config(text, origin); }; };
  expect_error(cfg("{}"), "'r'");
  expect_error(cfg(R"({"r": 0})"), "'r'");
  expect_error(cfg(R"({"r": 2.5})"), "'r'");
  expect_error(cfg(R"({"r": 4, "lora_alpha": "x"})"), "lora_alpha");
  expect_error(cfg(R"({"r": 4, "lora_alpha": 1e300})"), "lora_alpha");
  expect_error(cfg(R"({"r": 4, "use_rslora": 1})"), "use_rslora");
  expect_error(cfg(R"({"r": 4, "rank_pattern": {"x": 8}})"), "rank_pattern", ErrorCode::Unsupported);
  expect_error(cfg(R"({"r": 4, "use_dora": true})"), "use_dora", ErrorCode::Unsupported);
  expect_error(cfg(R"({"r": 4, "peft_type": "IA3"})"), "peft_type", ErrorCode::Unsupported);
  expect_error(cfg(R"({"r": 4, "target_parameters": [1]})"), "target_parameters");
  expect_error(cfg("not json"), "invalid JSON");

  TempDir dir;
  PeftLayer l(40);
  std::vector<st::WriteTensor> ts;
  l.add(ts, "m.", true, true);
  st::write_file(dir.file("ok.safetensors"), ts);
  const st::File f = st::File::open(dir.file("ok.safetensors"));
  PeftConfig c = peft::parse_config(kConfig, origin);
  PeftReadOptions opt;
  opt.module_prefix = "m.";
  ASSERT_NO_THROW(peft::read_experts_lora(f, c, opt));
  opt.module_prefix = "layers.7.";
  expect_error([&] { peft::read_experts_lora(f, c, opt); }, "not found", ErrorCode::NotFound);
  opt.module_prefix = "m.";
  opt.num_experts = 5;
  expect_error([&] { peft::read_experts_lora(f, c, opt); }, "E = 5");
  opt.num_experts = 0;
  opt.expert_offset = 4;
  expect_error([&] { peft::read_experts_lora(f, c, opt); }, "expected 0..3");
  opt.expert_offset = 2;
  opt.num_local_experts = 3;
  expect_error([&] { peft::read_experts_lora(f, c, opt); }, "expected 1..2");
  opt = PeftReadOptions{};
  opt.module_prefix = "m.";
  PeftConfig c5 = c;
  c5.r = 5;  // 12 rows are not r*E
  expect_error([&] { peft::read_experts_lora(f, c5, opt); }, "r*E rows");
  PeftConfig none = c;
  none.target_parameters = {"self_attn.q_proj.weight"};
  expect_error([&] { peft::read_experts_lora(f, none, opt); }, "target");
  // PEFT saves the target list in either order for the same nesting: the shapes decide, so the swapped list
  // reads the same matrices.
  PeftConfig swapped = c;
  std::swap(swapped.target_parameters[0], swapped.target_parameters[1]);
  {
    const PeftExpertsLora a = peft::read_experts_lora(f, c, opt), b = peft::read_experts_lora(f, swapped, opt);
    EXPECT_EQ(a.a_gate_up, b.a_gate_up);
    EXPECT_EQ(a.b_gate_up, b.b_gate_up);
    EXPECT_EQ(a.a_down, b.a_down);
    EXPECT_EQ(a.b_down, b.b_down);
    EXPECT_EQ(a.H, b.H);
    EXPECT_EQ(a.I, b.I);
  }
  // Two pairs that fit no (gate_up, down) assignment: down's B output is not gate_up's input.
  {
    std::vector<st::WriteTensor> odd = ts;
    for (auto& t : odd)
      if (t.name == "m.experts.lora_B.weight") {
        t.shape[0] += 16;
        t.bytes.resize(static_cast<size_t>(t.shape[0] * t.shape[1] * 2), 0);
      }
    st::write_file(dir.file("nofit.safetensors"), odd);
    expect_error([&] { peft::read_experts_lora(st::File::open(dir.file("nofit.safetensors")), c, opt); }, "do not fit");
  }

  // Wrong dtype and inconsistent B shape inside an otherwise valid file.
  std::vector<st::WriteTensor> bad = ts;
  bad[0].dtype_name = "I16";  // same byte size, wrong kind
  st::write_file(dir.file("i16.safetensors"), bad);
  expect_error([&] { peft::read_experts_lora(st::File::open(dir.file("i16.safetensors")), c, opt); }, "expected dtype BF16");
  bad = ts;
  bad[1].shape = {2 * l.I * 2, l.r * l.E / 2};  // same bytes, columns not r*E
  st::write_file(dir.file("bshape.safetensors"), bad);
  expect_error([&] { peft::read_experts_lora(st::File::open(dir.file("bshape.safetensors")), c, opt); }, "r*E");
  expect_error([&] { read_peft_experts_lora(dir.file("nowhere"), opt); }, "cannot open", ErrorCode::NotFound);
}

TEST(Safetensors, RandomCorruptionNeverReadsOutOfBounds) {
  // Valid image, then random byte flips / truncations: parsing either succeeds (and every tensor reads
  // back with its declared size) or throws fp4moe::Error. Run under ASan this also proves no stray reads.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
      R"("b":{"dtype":"F32","shape":[3],"data_offsets":[12,24]},"c":{"dtype":"U8","shape":[4,2],"data_offsets":[24,32]}})";
  std::vector<uint8_t> data(32);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 1);
  const std::vector<uint8_t> good = image(header, data);
  ASSERT_EQ(st::File::from_bytes(good).tensors().size(), 3u);
  std::mt19937 rng(123);
  int ok = 0, refused = 0;
  for (int it = 0; it < 3000; ++it) {
    std::vector<uint8_t> b = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t pos = rng() % b.size();
      // Bias toward structural characters and digits so the JSON stays near-valid.
      static const char kChars[] = "0123456789[]{},:\"-. eE";
      b[pos] = (rng() & 1) ? static_cast<uint8_t>(kChars[rng() % (sizeof kChars - 1)]) : static_cast<uint8_t>(rng());
    }
    if (rng() % 8 == 0) b.resize(rng() % b.size());
    try {
      const st::File f = st::File::from_bytes(b);
      for (const auto& t : f.tensors()) {
        const std::vector<uint8_t> bytes = f.read(t);
        ASSERT_EQ(bytes.size(), static_cast<size_t>(t.numel()) * t.elem_size);
      }
      ++ok;
    } catch (const Error&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 100);
  EXPECT_GT(ok, 0);
}
