#include "fp4moe/checkpoint.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "fp4moe/parallel.h"  // ExpertWindow
#include "runtime/json.h"
#include "runtime/safetensors.h"

namespace fp4moe {

namespace {

namespace fs = std::filesystem;
namespace st = safetensors;

const char* const kArg = "checkpoint";

[[noreturn]] void fail(const std::string& what, ErrorCode code = ErrorCode::InvalidArgument) {
  throw Error(code, kArg, what);
}

// A message of a lower layer without its "argument '...': " prefix (we name our own argument).
std::string bare(const Error& e) {
  std::string m = e.what();
  const std::string p = "argument '" + e.argument() + "': ";
  return (!e.argument().empty() && m.rfind(p, 0) == 0) ? m.substr(p.size()) : m;
}

std::optional<json::Value> read_json(const fs::path& p) {
  if (!fs::exists(p)) return std::nullopt;
  std::ifstream in(p, std::ios::binary);
  if (!in) fail("cannot open " + p.string(), ErrorCode::NotFound);
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str(), kArg);
  } catch (const Error& e) {
    fail(p.string() + ": not valid JSON (" + bare(e) + ")");
  }
}

const json::Value* member(const json::Value* v, const char* key) { return v && v->is_object() ? v->find(key) : nullptr; }
std::string str_of(const json::Value* v, const std::string& dflt = "") { return v && v->is_string() ? v->str : dflt; }
double num_of(const json::Value* v, double dflt) { return v && v->is_number() ? v->number : dflt; }
bool bool_of(const json::Value* v, bool dflt) { return v && v->is_bool() ? v->boolean : dflt; }
std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// fnmatch-style '*' and '?' (ModelOpt's exclude_modules patterns).
bool glob_match(const char* p, const char* s) {
  for (; *p; ++p, ++s) {
    if (*p == '*') {
      for (const char* t = s;; ++t) {
        if (glob_match(p + 1, t)) return true;
        if (!*t) return false;
      }
    }
    if (!*s || (*p != '?' && *p != *s)) return false;
  }
  return !*s;
}

// ---- quantization config ---------------------------------------------------------------------------------
struct Quant {
  std::string method = "none";  // "modelopt" | "compressed-tensors" | "none"
  std::string algo, source;
  bool a4 = false;
  std::vector<std::string> exclude, targets;
  bool mixed = false;
  std::map<std::string, std::string> layers;

  std::string describe() const {
    if (method == "none") return "none (unquantized)";
    return method + " " + algo + (a4 ? " (W4A4)" : " (W4A16)");
  }
  static bool re_match(const std::string& pat, const std::string& s) {
    try {
      return std::regex_match(s, std::regex(pat));
    } catch (const std::regex_error&) {
      return false;
    }
  }
  bool quantized(const std::string& module) const {
    if (method == "none") return false;
    if (method == "modelopt") {
      for (const auto& p : exclude)
        if (module == p || glob_match(p.c_str(), module.c_str())) return false;
      if (!mixed) return true;
      for (std::string m = module; !m.empty();) {
        auto it = layers.find(m);
        if (it != layers.end()) return it->second == "NVFP4" || it->second == "W4A16_NVFP4";
        const size_t dot = m.rfind('.');
        m = dot == std::string::npos ? "" : m.substr(0, dot);
      }
      return false;
    }
    // compressed-tensors "ignore" and "targets": exact names or "re:" patterns matched from the start
    for (const auto& p : exclude)
      if (p == module || (p.rfind("re:", 0) == 0 && re_match(p.substr(3) + ".*", module))) return false;
    for (const auto& t : targets)
      if (t == "Linear" || t == module || (t.rfind("re:", 0) == 0 && re_match(t.substr(3) + ".*", module)))
        return true;
    return false;
  }
};

Quant modelopt_quant(const json::Value* q, const std::string& src) {
  if (!q || !q->is_object() || !q->find("quant_algo"))
    fail(src + ": expected a ModelOpt quantization section with \"quant_algo\"");
  Quant r;
  r.method = "modelopt";
  r.source = src;
  r.algo = upper(str_of(q->find("quant_algo")));
  const json::Value* gs = q->find("group_size");
  if (gs && !gs->is_null() && !(gs->is_number() && gs->number == 16))
    fail(src + ": expected NVFP4 group_size 16", ErrorCode::Unsupported);
  if (const json::Value* ex = q->find("exclude_modules"); ex && ex->is_array())
    for (const auto& v : ex->array) r.exclude.push_back(str_of(&v));
  if (r.algo == "MIXED_PRECISION") {
    const json::Value* ql = q->find("quantized_layers");
    if (!ql || !ql->is_object()) fail(src + ": MIXED_PRECISION needs a \"quantized_layers\" object");
    r.mixed = true;
    for (const auto& [k, v] : ql->object) {
      const std::string a = upper(v.is_object() ? str_of(v.find("quant_algo")) : str_of(&v));
      r.layers[k] = a;
      if (a == "NVFP4") r.a4 = true;
    }
  } else if (r.algo == "NVFP4") {
    r.a4 = true;
  } else if (r.algo != "W4A16_NVFP4") {
    fail(src + ": unsupported ModelOpt quant_algo '" + str_of(q->find("quant_algo")) +
             "' (fp4moe reads NVFP4, W4A16_NVFP4 and MIXED_PRECISION of those)",
         ErrorCode::Unsupported);
  }
  return r;
}

Quant ct_quant(const json::Value& qc, const std::string& src) {
  const json::Value* groups = qc.find("config_groups");
  if (!groups || !groups->is_object() || groups->object.empty())
    fail(src + ": compressed-tensors config without \"config_groups\"");
  Quant r;
  r.method = "compressed-tensors";
  r.algo = "nvfp4-pack-quantized";
  r.source = src;
  const std::string top_fmt = str_of(qc.find("format"));
  for (const auto& [name, g] : groups->object) {
    const std::string fmt = str_of(member(&g, "format"), top_fmt);
    if (fmt != "nvfp4-pack-quantized")
      fail(src + ": config group '" + name + "': unsupported compressed-tensors format '" + fmt +
               "' (fp4moe reads nvfp4-pack-quantized)",
           ErrorCode::Unsupported);
    const json::Value* w = member(&g, "weights");
    if (num_of(member(w, "num_bits"), 0) != 4 || str_of(member(w, "type")) != "float" ||
        num_of(member(w, "group_size"), 0) != 16)
      fail(src + ": config group '" + name + "': expected 4-bit float weights in groups of 16", ErrorCode::Unsupported);
    const json::Value* ia = member(&g, "input_activations");
    if (ia && !ia->is_null()) {
      if (num_of(member(ia, "num_bits"), 0) != 4 || str_of(member(ia, "type")) != "float")
        fail(src + ": config group '" + name + "': activations that are neither NVFP4 nor 16-bit",
             ErrorCode::Unsupported);
      r.a4 = true;
    }
    if (const json::Value* t = member(&g, "targets"); t && t->is_array())
      for (const auto& v : t->array) r.targets.push_back(str_of(&v));
  }
  if (const json::Value* ig = qc.find("ignore"); ig && ig->is_array())
    for (const auto& v : ig->array) r.exclude.push_back(str_of(&v));
  return r;
}

// ---- the files -------------------------------------------------------------------------------------------
struct Store {
  fs::path root;
  std::optional<json::Value> config, hfq;
  std::map<std::string, std::string> where;  // tensor -> file name
  std::map<std::string, std::unique_ptr<st::File>> files;
  bool index = false;
  Quant quant;

  explicit Store(const std::string& dir) : root(dir) {
    if (!fs::is_directory(root)) fail(dir + ": expected a checkpoint directory; it does not exist", ErrorCode::NotFound);
    config = read_json(root / "config.json");
    hfq = read_json(root / "hf_quant_config.json");
    detect_quant();
    const fs::path idx = root / "model.safetensors.index.json";
    if (auto doc = read_json(idx)) {
      const json::Value* wm = member(&*doc, "weight_map");
      if (!wm || !wm->is_object()) fail(idx.string() + ": expected an object with a \"weight_map\" {tensor: file}");
      for (const auto& [name, f] : wm->object) {
        if (!f.is_string() || f.str.empty() || f.str.find('/') != std::string::npos || f.str[0] == '.')
          fail(idx.string() + ": tensor '" + name + "' maps to an unusable file name");
        where[name] = f.str;
      }
      index = true;
    } else {
      std::vector<std::string> names;
      for (const auto& e : fs::directory_iterator(root))
        if (e.path().extension() == ".safetensors") names.push_back(e.path().filename().string());
      std::sort(names.begin(), names.end());
      if (names.empty()) fail(dir + ": no *.safetensors file and no model.safetensors.index.json", ErrorCode::NotFound);
      for (const auto& n : names)
        for (const auto& t : file(n).tensors()) {
          if (where.count(t.name)) fail((root / n).string() + ": tensor '" + t.name + "' is also in " + where[t.name]);
          where[t.name] = n;
        }
    }
  }

  void detect_quant() {
    const json::Value* qc = member(config ? &*config : nullptr, "quantization_config");
    if (hfq) {
      const json::Value* q = member(&*hfq, "quantization");
      quant = modelopt_quant(q ? q : &*hfq, (root / "hf_quant_config.json").string());
      return;
    }
    const std::string src = (root / "config.json").string();
    if (!qc) {
      quant.source = src;
      return;
    }
    const std::string m = str_of(qc->find("quant_method"));
    if (m == "modelopt") {
      const json::Value* q = qc->find("quantization");
      quant = modelopt_quant(q ? q : qc, src);
    } else if (m == "compressed-tensors") {
      quant = ct_quant(*qc, src);
    } else {
      fail(src + ": unknown quantization config quant_method='" + m +
               "' (fp4moe reads 'modelopt' NVFP4 and 'compressed-tensors' nvfp4-pack-quantized)",
           ErrorCode::Unsupported);
    }
  }

  const st::File& file(const std::string& fname) {
    auto it = files.find(fname);
    if (it != files.end()) return *it->second;
    const fs::path p = root / fname;
    if (!fs::exists(p)) fail(p.string() + ": the file is missing", ErrorCode::NotFound);
    try {
      auto f = std::make_unique<st::File>(st::File::open(p.string()));
      return *files.emplace(fname, std::move(f)).first->second;
    } catch (const Error& e) {
      fail(bare(e), e.code());
    }
  }

  bool has(const std::string& name) const { return where.count(name) != 0; }
  std::string path_of(const std::string& name) const { return (root / where.at(name)).string(); }

  const st::TensorInfo& info(const std::string& name) {
    auto it = where.find(name);
    if (it == where.end()) fail(root.string() + ": tensor '" + name + "' is missing", ErrorCode::NotFound);
    const st::File& f = file(it->second);
    const st::TensorInfo* t = f.find(name);
    if (!t)
      fail(f.origin() + ": tensor '" + name + "' is missing (the index names this file for it)", ErrorCode::NotFound);
    return *t;
  }

  std::string model_type() const {
    const json::Value* c = config ? &*config : nullptr;
    if (const json::Value* tc = member(c, "text_config"); tc && member(tc, "model_type")) return str_of(member(tc, "model_type"));
    return str_of(member(c, "model_type"));
  }
  const json::Value* text_config() const {
    const json::Value* c = config ? &*config : nullptr;
    const json::Value* tc = member(c, "text_config");
    return tc && tc->is_object() ? tc : c;
  }
};

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// A checked tensor: one of `dtypes`, of `shape` (-1 entries match anything).
const st::TensorInfo& expect(Store& s, const std::string& name, std::initializer_list<const char*> dtypes,
                             const std::vector<int64_t>& shape, const std::string& where = "") {
  const st::TensorInfo& t = s.info(name);
  bool ok = false;
  std::string want;
  for (const char* d : dtypes) {
    ok |= t.dtype_name == d;
    want += (want.empty() ? "" : " or ") + std::string(d);
  }
  if (!ok) fail(s.path_of(name) + ": tensor '" + name + "': expected dtype " + want + ", got " + t.dtype_name);
  bool shape_ok = shape.size() == t.shape.size();
  for (size_t i = 0; shape_ok && i < shape.size(); ++i) shape_ok = shape[i] < 0 || shape[i] == t.shape[i];
  if (!shape_ok) {
    std::string w = "[";
    for (size_t i = 0; i < shape.size(); ++i) w += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
    fail(s.path_of(name) + ": tensor '" + name + "': expected shape " + w + "]" + where + ", got " + shape_str(t.shape));
  }
  return t;
}

const st::TensorInfo& expect_scalar(Store& s, const std::string& name) {
  const st::TensorInfo& t = s.info(name);
  if (t.dtype_name != "F32" || t.numel() != 1)
    fail(s.path_of(name) + ": tensor '" + name + "': expected an F32 scalar ([] or [1]), got " + t.dtype_name + " " +
         shape_str(t.shape));
  return t;
}

// ---- one linear ------------------------------------------------------------------------------------------
struct Linear {
  std::string module;
  bool nvfp4 = false;
  std::string w, scale, scale2, input;  // tensor names ("" when absent)
  bool inverse = false;                 // compressed-tensors stores encode scales
  uint64_t bytes = 0;
};

Linear plan_linear(Store& s, const std::string& module, int64_t n, int64_t k) {
  const Quant& q = s.quant;
  const bool want_q = q.quantized(module);
  const std::string where = " for a [" + std::to_string(n) + ", " + std::to_string(k) + "] weight";
  Linear l;
  l.module = module;
  auto add = [&](const st::TensorInfo& t) { l.bytes += t.end - t.begin; };
  if (s.has(module + ".weight_packed")) {
    l.w = module + ".weight_packed";
    if (q.method != "compressed-tensors")
      fail(s.path_of(l.w) + ": tensor '" + l.w + "' is compressed-tensors NVFP4 but the checkpoint's quantization config is " +
           q.describe());
    add(expect(s, l.w, {"U8"}, {n, k / 2}, where));
    l.scale = module + ".weight_scale";
    add(expect(s, l.scale, {"F8_E4M3"}, {n, k / 16}, where));
    l.scale2 = module + ".weight_global_scale";
    add(expect_scalar(s, l.scale2));
    if (q.a4) {
      l.input = module + ".input_global_scale";
      if (!s.has(l.input))
        fail(s.path_of(l.w) + ": tensor '" + l.input + "' is missing (the config quantizes activations)", ErrorCode::NotFound);
      add(expect_scalar(s, l.input));
    }
    l.nvfp4 = true;
    l.inverse = true;
  } else if (s.has(module + ".weight")) {
    l.w = module + ".weight";
    const st::TensorInfo& t = s.info(l.w);
    if (t.dtype_name == "U8") {
      if (q.method != "modelopt")
        fail(s.path_of(l.w) + ": tensor '" + l.w + "' is packed uint8 (ModelOpt NVFP4) but the checkpoint's quantization "
             "config is " + q.describe());
      add(expect(s, l.w, {"U8"}, {n, k / 2}, where));
      l.scale = module + ".weight_scale";
      add(expect(s, l.scale, {"F8_E4M3"}, {n, k / 16}, where));
      l.scale2 = module + ".weight_scale_2";
      add(expect_scalar(s, l.scale2));
      if (s.has(module + ".input_scale")) {
        l.input = module + ".input_scale";
        add(expect_scalar(s, l.input));
      } else if (q.a4 && !q.mixed) {
        fail(s.path_of(l.w) + ": tensor '" + module + ".input_scale' is missing (quant_algo " + q.algo +
                 " quantizes activations)",
             ErrorCode::NotFound);
      }
      if (s.has(module + ".pre_quant_scale"))
        fail(s.path_of(l.w) + ": tensor '" + module + ".pre_quant_scale': AWQ-smoothed NVFP4 experts are not supported",
             ErrorCode::Unsupported);
      l.nvfp4 = true;
    } else if (t.dtype_name == "BF16" || t.dtype_name == "F16" || t.dtype_name == "F32") {
      if (s.has(module + ".weight_scale"))
        fail(s.path_of(l.w) + ": tensor '" + module + ".weight_scale' beside a " + t.dtype_name +
                 " weight: an unknown quantization (expected NVFP4 uint8 weights)",
             ErrorCode::Unsupported);
      add(expect(s, l.w, {"BF16", "F16", "F32"}, {n, k}, where));
    } else {
      fail(s.path_of(l.w) + ": tensor '" + l.w + "': expected dtype U8 (NVFP4) or BF16/F16/F32, got " + t.dtype_name);
    }
  } else {
    fail(s.root.string() + ": tensor '" + module + ".weight' is missing", ErrorCode::NotFound);
  }
  if (l.nvfp4 != want_q)
    fail(s.path_of(l.w) + ": tensor '" + l.w + "' is " + (l.nvfp4 ? "NVFP4" : "unquantized") + " but " + q.source + " " +
         (want_q ? "quantizes" : "excludes") + " module '" + module + "'");
  return l;
}

// ---- the layer plan --------------------------------------------------------------------------------------
struct ExpertsPlan {
  bool nvfp4 = false;
  int64_t E = 0, H = 0, I = 0;
  std::vector<std::array<Linear, 3>> experts;  // gate, up, down
  uint64_t bytes = 0;
};

struct LayerPlan {
  std::string prefix, architecture;
  ExpertsPlan routed;
  bool has_shared = false;
  ExpertsPlan shared;
  std::string router, correction_bias;
  uint64_t bytes = 0;
};

// {layer: "<prefix>layers.N.<block>."} of the layers whose tensor names include experts.
std::map<int, std::string> moe_layers(const Store& s) {
  std::map<int, std::string> out;
  for (const auto& [n, f] : s.where) {
    size_t pos = 0;
    while ((pos = n.find("layers.", pos)) != std::string::npos) {
      if (pos > 0 && n[pos - 1] != '.') {
        pos += 7;
        continue;
      }
      size_t p = pos + 7, q = p;
      while (q < n.size() && std::isdigit(static_cast<unsigned char>(n[q]))) ++q;
      if (q == p || q >= n.size() || n[q] != '.' || q - p > 6) break;
      for (const char* blk : {"mlp.", "block_sparse_moe."}) {
        const std::string b = blk;
        if (n.compare(q + 1, b.size(), b) == 0 && n.compare(q + 1 + b.size(), 8, "experts.") == 0) {
          const int L = std::stoi(n.substr(p, q - p));
          const std::string pre = n.substr(0, q + 1 + b.size());
          auto it = out.find(L);
          if (it != out.end() && it->second != pre)
            fail(s.root.string() + ": layer " + std::to_string(L) + " has experts under two prefixes (" + it->second +
                 ", " + pre + ")");
          out[L] = pre;
        }
      }
      break;
    }
  }
  return out;
}

ExpertsPlan plan_experts(Store& s, const std::string& base, const std::vector<int>& ids, const std::string& what) {
  static const char* const kNames[2][3] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};
  const std::string probe = ids.empty() ? base : base + std::to_string(ids[0]) + ".";
  int fam = -1;
  for (int f = 0; f < 2 && fam < 0; ++f)
    if (s.has(probe + kNames[f][2] + ".weight") || s.has(probe + kNames[f][2] + ".weight_packed")) fam = f;
  if (fam < 0)
    fail(s.root.string() + ": " + what + ": no down projection ('" + probe + "down_proj.weight' or '" + probe + "w2.weight')",
         ErrorCode::NotFound);
  const std::string dn = s.has(probe + kNames[fam][2] + ".weight_packed") ? probe + kNames[fam][2] + ".weight_packed"
                                                                           : probe + kNames[fam][2] + ".weight";
  const st::TensorInfo& d = s.info(dn);
  if (d.shape.size() != 2) fail(s.path_of(dn) + ": tensor '" + dn + "': expected a 2-D weight, got shape " + shape_str(d.shape));
  ExpertsPlan p;
  p.H = d.shape[0];
  p.I = d.shape[1] * (d.dtype_name == "U8" ? 2 : 1);
  if (p.H % 16 || p.I % 16)
    fail(s.path_of(dn) + ": tensor '" + dn + "': H=" + std::to_string(p.H) + " and I=" + std::to_string(p.I) +
         " must be multiples of 16");
  std::set<bool> fmts;
  const std::vector<int> list = ids.empty() ? std::vector<int>{-1} : ids;
  for (int e : list) {
    const std::string m = e < 0 ? base : base + std::to_string(e) + ".";
    std::array<Linear, 3> lin = {plan_linear(s, m + kNames[fam][0], p.I, p.H), plan_linear(s, m + kNames[fam][1], p.I, p.H),
                                 plan_linear(s, m + kNames[fam][2], p.H, p.I)};
    for (const auto& l : lin) {
      fmts.insert(l.nvfp4);
      p.bytes += l.bytes;
    }
    p.experts.push_back(std::move(lin));
  }
  if (fmts.size() > 1)
    fail(s.root.string() + ": " + what + ": some experts are NVFP4 and some unquantized; one layer's experts must share one format");
  p.nvfp4 = *fmts.begin();
  p.E = static_cast<int64_t>(p.experts.size());
  return p;
}

LayerPlan plan_layer(Store& s, int layer) {
  const auto layers = moe_layers(s);
  auto it = layers.find(layer);
  if (it == layers.end()) {
    std::string have;
    int n = 0;
    for (const auto& [L, p] : layers)
      if (n++ < 8) have += (have.empty() ? "" : ", ") + std::to_string(L);
    fail(s.root.string() + ": layer " + std::to_string(layer) + " has no MoE experts (MoE layers: [" + have +
             (layers.size() > 8 ? ", ..." : "") + "])",
         ErrorCode::NotFound);
  }
  LayerPlan p;
  p.prefix = it->second;
  const std::string base = p.prefix + "experts.";
  std::set<int> ids;
  for (const auto& [n, f] : s.where) {
    if (n.compare(0, base.size(), base) != 0) continue;
    size_t q = base.size();
    while (q < n.size() && std::isdigit(static_cast<unsigned char>(n[q]))) ++q;
    if (q > base.size() && q < n.size() && n[q] == '.' && q - base.size() < 7) ids.insert(std::stoi(n.substr(base.size(), q - base.size())));
  }
  if (ids.empty()) {
    if (s.has(base + "gate_up_proj_blocks"))
      fail(s.path_of(base + "gate_up_proj_blocks") + ": tensor '" + base + "gate_up_proj_blocks' is MXFP4 (GPT-OSS release); "
           "fp4moe reads NVFP4 or bf16 experts", ErrorCode::Unsupported);
    if (s.has(base + "gate_up_proj"))
      fail(s.path_of(base + "gate_up_proj") + ": tensor '" + base + "gate_up_proj': fused expert tensors are read by the "
           "Python loader (fp4moe.load_moe_layer), not by the C++ one", ErrorCode::Unsupported);
    fail(s.root.string() + ": layer " + std::to_string(layer) + ": no expert tensors under '" + base + "'", ErrorCode::NotFound);
  }
  std::vector<int> idv(ids.begin(), ids.end());
  for (int i = 0; i < static_cast<int>(idv.size()); ++i)
    if (idv[i] != i)
      fail(s.root.string() + ": tensor '" + base + std::to_string(i) + ".*' is missing (experts 0.." +
               std::to_string(idv.back()) + " expected)",
           ErrorCode::NotFound);
  p.routed = plan_experts(s, base, idv, "layer " + std::to_string(layer) + " experts");
  const std::string mt = s.model_type();
  const bool mixtral_block = p.prefix.size() >= 17 && p.prefix.compare(p.prefix.size() - 17, 17, "block_sparse_moe.") == 0;
  if (mt == "mixtral" || mixtral_block) p.architecture = "Mixtral";
  else if (mt == "qwen3_moe") p.architecture = "Qwen3-MoE";
  else if (mt == "deepseek_v3") p.architecture = "DeepSeek-V3";
  else if (mt == "kimi_k2") p.architecture = "Kimi-K2";
  else p.architecture = mt.empty() ? "per-expert MoE" : mt;
  for (const char* sname : {"shared_experts.", "shared_expert."}) {
    const std::string sb = p.prefix + sname;
    if (!s.has(sb + "down_proj.weight") && !s.has(sb + "down_proj.weight_packed")) continue;
    if (s.has(p.prefix + "shared_expert_gate.weight"))
      fail(s.path_of(p.prefix + "shared_expert_gate.weight") + ": tensor '" + p.prefix +
               "shared_expert_gate.weight': a sigmoid-gated shared expert is not fp4moe's weight-1 shared expert",
           ErrorCode::Unsupported);
    p.shared = plan_experts(s, sb, {}, "layer " + std::to_string(layer) + " shared expert");
    p.has_shared = true;
    if (p.shared.H != p.routed.H)
      fail(s.root.string() + ": layer " + std::to_string(layer) + ": the shared expert's H differs from the experts' H");
  }
  const int64_t E = p.routed.E, H = p.routed.H;
  if (s.has(p.prefix + "gate.weight")) {
    p.router = p.prefix + "gate.weight";
    expect(s, p.router, {"BF16", "F16", "F32"}, {E, H}, " (the router [E, H])");
  }
  if (s.has(p.prefix + "gate.e_score_correction_bias")) {
    p.correction_bias = p.prefix + "gate.e_score_correction_bias";
    expect(s, p.correction_bias, {"BF16", "F16", "F32"}, {E});
  }
  p.bytes = p.routed.bytes + (p.has_shared ? p.shared.bytes : 0);
  for (const std::string& n : {p.router, p.correction_bias})
    if (!n.empty()) p.bytes += s.info(n).end - s.info(n).begin;
  return p;
}

// ---- configuration -----------------------------------------------------------------------------------------
void routing_of(Store& s, int64_t E, CheckpointRouter& r) {
  const json::Value* c = s.text_config();
  const std::string mt = s.model_type();
  r.num_experts = E;
  r.top_k = static_cast<int64_t>(num_of(member(c, "num_experts_per_tok"), num_of(member(c, "experts_per_token"), 0)));
  if (mt == "qwen3_moe" || mt == "qwen2_moe") {
    r.has_routing_method = true;
    r.routing_method = bool_of(member(c, "norm_topk_prob"), true) ? RoutingMethod::RenormalizeNaive : RoutingMethod::Default;
    r.num_experts = static_cast<int64_t>(num_of(member(c, "num_experts"), static_cast<double>(E)));
  } else if (mt == "mixtral" || mt == "gpt_oss") {
    r.has_routing_method = true;
    r.routing_method = RoutingMethod::Renormalize;
    r.num_experts = static_cast<int64_t>(num_of(member(c, "num_local_experts"), static_cast<double>(E)));
  } else if (mt == "deepseek_v3" || mt == "kimi_k2") {
    if (str_of(member(c, "scoring_func"), "sigmoid") != "sigmoid")
      fail((s.root / "config.json").string() + ": scoring_func '" + str_of(member(c, "scoring_func")) +
               "': fp4moe's DeepSeekV3 routing scores with sigmoid",
           ErrorCode::Unsupported);
    r.has_routing_method = true;
    r.routing_method = RoutingMethod::DeepSeekV3;
    r.num_experts = static_cast<int64_t>(num_of(member(c, "n_routed_experts"), static_cast<double>(E)));
    r.n_group = std::max<int64_t>(1, static_cast<int64_t>(num_of(member(c, "n_group"), 1)));
    r.topk_group = std::max<int64_t>(1, static_cast<int64_t>(num_of(member(c, "topk_group"), 1)));
    r.routed_scaling_factor = static_cast<float>(num_of(member(c, "routed_scaling_factor"), 1.0));
  }
  if (r.num_experts != E)
    fail((s.root / "config.json").string() + ": " + std::to_string(r.num_experts) + " experts, but the layer's files have " +
         std::to_string(E));
}

ActivationType activation_of(Store& s) {
  const json::Value* c = s.text_config();
  const std::string act = str_of(member(c, "hidden_act"), str_of(member(c, "hidden_activation")));
  if (act == "silu" || act == "swish") return ActivationType::Swiglu;
  if (act == "gelu") return ActivationType::Geglu;
  if (act == "gelu_pytorch_tanh" || act == "gelu_new") return ActivationType::GegluTanh;
  if (act.empty()) fail((s.root / "config.json").string() + ": names no hidden_act (the experts' activation)", ErrorCode::NotFound);
  fail((s.root / "config.json").string() + ": hidden_act '" + act + "' has no fp4moe gated activation", ErrorCode::Unsupported);
}

// ---- reading -----------------------------------------------------------------------------------------------
float read_scalar(Store& s, const std::string& name, bool inverse) {
  const std::vector<uint8_t> b = s.file(s.where.at(name)).read(s.info(name));
  float v;
  std::memcpy(&v, b.data(), 4);
  if (!std::isfinite(v) || v <= 0)
    fail(s.path_of(name) + ": tensor '" + name + "': expected a finite positive scale, got " + std::to_string(v));
  return inverse ? 1.f / v : v;
}

// Rows [r0, r0 + nr) of a row-major [rows, row_bytes] byte tensor, columns [c0, c0 + nc) bytes.
void copy_block(const std::vector<uint8_t>& src, int64_t row_bytes, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                uint8_t* dst) {
  for (int64_t r = 0; r < nr; ++r) std::memcpy(dst + r * nc, src.data() + (r0 + r) * row_bytes + c0, static_cast<size_t>(nc));
}

OwnedWeights read_experts(Store& s, const ExpertsPlan& p, int64_t e0, int64_t ne, int64_t t0, int64_t ts, float* in1,
                          float* in2, uint64_t* bytes) {
  OwnedWeights o;
  o.format = p.nvfp4 ? WeightFormat::NVFP4 : WeightFormat::BF16;
  o.order = GateUpOrder::GateFirst;
  o.gated = true;
  o.E = ne;
  o.H = p.H;
  o.I = ts;
  const int64_t H = p.H, I = p.I, n1 = 2 * ts;
  auto raw = [&](const std::string& n) {
    std::vector<uint8_t> b = s.file(s.where.at(n)).read(s.info(n));
    *bytes += b.size();
    return b;
  };
  if (p.nvfp4) {
    o.w1.resize(ne * n1 * H / 2);
    o.w1_scale.resize(ne * n1 * H / 16);
    o.w1_scale2.resize(2 * ne);
    o.w2.resize(ne * H * ts / 2);
    o.w2_scale.resize(ne * H * ts / 16);
    o.w2_scale2.resize(ne);
  } else {
    o.w1_bf16.resize(ne * n1 * H);
    o.w2_bf16.resize(ne * H * ts);
  }
  for (int64_t i = 0; i < ne; ++i) {
    const auto& lin = p.experts[static_cast<size_t>(e0 + i)];
    for (int h = 0; h < 2; ++h) {
      const Linear& l = lin[h];
      if (p.nvfp4) {
        copy_block(raw(l.w), H / 2, t0, ts, 0, H / 2, o.w1.data() + (i * n1 + h * ts) * (H / 2));
        copy_block(raw(l.scale), H / 16, t0, ts, 0, H / 16, o.w1_scale.data() + (i * n1 + h * ts) * (H / 16));
        o.w1_scale2[2 * i + h] = read_scalar(s, l.scale2, l.inverse);
        if (!l.input.empty()) *in1 = std::max(*in1, read_scalar(s, l.input, l.inverse));
      } else {
        const std::vector<uint16_t> v = s.file(s.where.at(l.w)).read_bf16(s.info(l.w));
        *bytes += s.info(l.w).end - s.info(l.w).begin;
        std::memcpy(o.w1_bf16.data() + (i * n1 + h * ts) * H, v.data() + t0 * H, static_cast<size_t>(ts * H) * 2);
      }
    }
    const Linear& d = lin[2];
    if (p.nvfp4) {
      copy_block(raw(d.w), I / 2, 0, H, t0 / 2, ts / 2, o.w2.data() + i * H * (ts / 2));
      copy_block(raw(d.scale), I / 16, 0, H, t0 / 16, ts / 16, o.w2_scale.data() + i * H * (ts / 16));
      o.w2_scale2[i] = read_scalar(s, d.scale2, d.inverse);
      if (!d.input.empty()) *in2 = std::max(*in2, read_scalar(s, d.input, d.inverse));
    } else {
      const std::vector<uint16_t> v = s.file(s.where.at(d.w)).read_bf16(s.info(d.w));
      *bytes += s.info(d.w).end - s.info(d.w).begin;
      for (int64_t r = 0; r < H; ++r)
        std::memcpy(o.w2_bf16.data() + (i * H + r) * ts, v.data() + r * I + t0, static_cast<size_t>(ts) * 2);
    }
  }
  return o;
}

std::vector<float> read_f32(Store& s, const std::string& name) {
  const std::vector<uint16_t> b = s.file(s.where.at(name)).read_bf16(s.info(name));
  if (s.info(name).dtype_name == "F32") {  // keep fp32 values exact
    const std::vector<uint8_t> raw = s.file(s.where.at(name)).read(s.info(name));
    std::vector<float> out(raw.size() / 4);
    std::memcpy(out.data(), raw.data(), raw.size());
    return out;
  }
  std::vector<float> out(b.size());
  for (size_t i = 0; i < b.size(); ++i) out[i] = bf16_bits_to_f32(b[i]);
  return out;
}

}  // namespace

CheckpointLayer read_moe_layer(const std::string& dir, int layer, const CheckpointOptions& opt) {
  Store s(dir);
  const ActivationType act = activation_of(s);
  const LayerPlan p = plan_layer(s, layer);
  const ExpertsPlan& R = p.routed;
  CheckpointLayer out;
  out.layer = layer;
  out.architecture = p.architecture;
  out.quantization = s.quant.describe();
  out.format = R.nvfp4 ? WeightFormat::NVFP4 : WeightFormat::BF16;
  out.activation = act;
  routing_of(s, R.E, out.router);
  if (opt.ep_world < 1 || opt.ep_rank < 0 || opt.ep_rank >= opt.ep_world || opt.ep_world > R.E)
    throw Error(ErrorCode::InvalidArgument, "ep_world",
                "expected 0 <= ep_rank < ep_world <= E=" + std::to_string(R.E) + ", got ep_rank=" +
                    std::to_string(opt.ep_rank) + ", ep_world=" + std::to_string(opt.ep_world));
  // expert_window of parallel.h: contiguous, the first E % world ranks get one more
  ExpertWindow win;
  win.count = R.E / opt.ep_world + (opt.ep_rank < R.E % opt.ep_world ? 1 : 0);
  win.offset = opt.ep_rank * (R.E / opt.ep_world) + std::min<int64_t>(opt.ep_rank, R.E % opt.ep_world);
  auto tp_rows = [&](int64_t I) {
    if (opt.tp_world < 1 || opt.tp_rank < 0 || opt.tp_rank >= opt.tp_world)
      throw Error(ErrorCode::InvalidArgument, "tp_rank", "expected 0 <= tp_rank < tp_world");
    if (I % opt.tp_world || (I / opt.tp_world) % 16)
      throw Error(ErrorCode::InvalidArgument, "tp_world",
                  "I=" + std::to_string(I) + " split over tp_world=" + std::to_string(opt.tp_world) +
                      " must give a multiple of 16 per rank");
    const int64_t ts = I / opt.tp_world;
    return std::pair<int64_t, int64_t>(opt.tp_rank * ts, ts);
  };
  const auto [t0, ts] = tp_rows(R.I);
  float in1 = 0.f, in2 = 0.f;
  out.routed = read_experts(s, R, win.offset, win.count, t0, ts, &in1, &in2, &out.bytes_read);
  if (p.has_shared && opt.shared_expert) {
    const auto [s0, ss] = tp_rows(p.shared.I);
    float u1 = 0.f, u2 = 0.f;
    out.shared = read_experts(s, p.shared, 0, 1, s0, ss, &u1, &u2, &out.bytes_read);
    out.has_shared = true;
  }
  if (!p.router.empty()) out.router.weight = read_f32(s, p.router);
  if (!p.correction_bias.empty()) out.router.e_score_correction_bias = read_f32(s, p.correction_bias);
  out.fc1_input_scale = in1;
  out.fc2_input_scale = in2;
  out.mode = (R.nvfp4 && s.quant.a4 && in1 > 0 && in2 > 0) ? ActMode::A4 : ActMode::A16;
  out.num_experts = R.E;
  out.local_expert_offset = win.offset;
  out.num_local_experts = win.count;
  return out;
}

CheckpointInfo inspect_checkpoint(const std::string& dir) {
  Store s(dir);
  CheckpointInfo info;
  info.path = s.root.string();
  info.model_type = s.model_type();
  info.quantization = s.quant.describe();
  info.index = s.index;
  info.tensors = static_cast<int64_t>(s.where.size());
  std::set<std::string> files;
  for (const auto& [n, f] : s.where) files.insert(f);
  info.files.assign(files.begin(), files.end());
  for (const auto& f : info.files) {
    std::error_code ec;
    const auto sz = fs::file_size(s.root / f, ec);
    if (!ec) info.bytes += sz;
  }
  for (const auto& [L, pre] : moe_layers(s)) {
    CheckpointLayerInfo r;
    r.layer = L;
    try {
      const LayerPlan p = plan_layer(s, L);
      r.architecture = p.architecture;
      r.format = p.routed.nvfp4 ? "nvfp4" : "bf16";
      r.experts = p.routed.E;
      r.hidden = p.routed.H;
      r.inter = p.routed.I;
      r.bytes = p.bytes;
      if (p.has_shared) r.shared = std::string(p.shared.nvfp4 ? "nvfp4" : "bf16") + " I=" + std::to_string(p.shared.I);
      r.router = !p.router.empty();
      r.correction_bias = !p.correction_bias.empty();
      activation_of(s);
      CheckpointRouter rt;
      routing_of(s, p.routed.E, rt);
      r.routing = rt.has_routing_method ? to_string(rt.routing_method) : "";
      r.top_k = rt.top_k;
      r.loadable = true;
    } catch (const Error& e) {  // inspect reports what read_moe_layer would refuse
      r.loadable = false;
      r.reason = bare(e);
    }
    info.layers.push_back(std::move(r));
  }
  return info;
}

std::string format_checkpoint_info(const CheckpointInfo& info) {
  std::ostringstream o;
  o << "checkpoint " << info.path << "\n";
  o << "  files: " << info.files.size() << " safetensors" << (info.index ? " (model.safetensors.index.json)" : "") << ", "
    << info.tensors << " tensors, " << info.bytes << " bytes\n";
  o << "  model_type: " << (info.model_type.empty() ? "unknown" : info.model_type) << "; quantization: " << info.quantization
    << "\n";
  o << "  MoE layers: " << info.layers.size() << "\n";
  int n = 0;
  for (const auto& r : info.layers) {
    o << "  layer " << r.layer << ":";
    if (!r.format.empty())
      o << " " << r.architecture << ", " << r.format << ", E=" << r.experts << " H=" << r.hidden << " I=" << r.inter << ", "
        << r.bytes << " bytes, shared expert: " << (r.shared.empty() ? "none" : r.shared)
        << ", router: " << (r.router ? "yes" : "no") << (r.correction_bias ? " + e_score_correction_bias" : "");
    if (r.loadable && !r.routing.empty()) o << ", routing " << r.routing << " top_k " << r.top_k;
    o << "\n    " << (r.loadable ? "would load" : "refused: " + r.reason) << "\n";
    n += r.loadable;
  }
  o << "  " << n << " of " << info.layers.size() << " MoE layers would load\n";
  return o.str();
}

}  // namespace fp4moe
