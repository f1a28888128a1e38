// The checkpoint reader's files: config files, quantization configs, the tensor table of a directory's
// safetensors shards, checked tensor headers and one linear's tensors (src/io/checkpoint_files.h).
#include "io/checkpoint_files.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <regex>
#include <sstream>

namespace fp4moe::ckpt {

[[noreturn]] void fail(const std::string& what, ErrorCode code) { throw Error(code, kArg, what); }

std::string bare(const Error& e) {
  std::string m = e.what();
  const std::string p = "argument '" + e.argument() + "': ";
  return (!e.argument().empty() && m.rfind(p, 0) == 0) ? m.substr(p.size()) : m;
}

const json::Value* member(const json::Value* v, const char* key) { return v ? json::find(*v, key) : nullptr; }
std::string str_of(const json::Value* v, const std::string& dflt) { return v && v->is_string() ? v->get<std::string>() : dflt; }
double num_of(const json::Value* v, double dflt) { return v && v->is_number() ? v->get<double>() : dflt; }
bool bool_of(const json::Value* v, bool dflt) { return v && v->is_boolean() ? v->get<bool>() : dflt; }

namespace {

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

// Whether a ModelOpt exclude_modules / ignore entry covers `module` (a linear), as vLLM reads them: an fnmatch
// pattern naming the module or one that holds it (vLLM matches the MoE block "...mlp.experts"), and a trailing
// "path*" (ModelOpt's spelling) the module at path and what it holds, so "model.layers.1*" is not layer 10.
bool modelopt_excludes(std::string pattern, const std::string& module) {
  if (pattern.size() >= 2 && pattern.back() == '*' && pattern[pattern.size() - 2] != '.') pattern.pop_back();
  for (std::string m = module; !m.empty();) {
    if (glob_match(pattern.c_str(), m.c_str())) return true;
    const size_t dot = m.rfind('.');
    m = dot == std::string::npos ? "" : m.substr(0, dot);
  }
  return false;
}

bool re_match(const std::string& pat, const std::string& s) {
  try {
    return std::regex_match(s, std::regex(pat));
  } catch (const std::regex_error&) {
    return false;
  }
}

Quant modelopt_quant(const json::Value* q, const std::string& src) {
  if (!member(q, "quant_algo"))
    fail(src + ": expected a ModelOpt quantization section with \"quant_algo\"");
  Quant r;
  r.method = "modelopt";
  r.source = src;
  r.algo = upper(str_of(member(q, "quant_algo")));
  const json::Value* gs = member(q, "group_size");
  if (gs && !gs->is_null() && num_of(gs, 0) != 16)
    fail(src + ": expected NVFP4 group_size 16", ErrorCode::Unsupported);
  // "exclude_modules" in hf_quant_config.json, "ignore" in config.json (ModelOpt's export, as vLLM reads them)
  for (const char* key : {"exclude_modules", "ignore"})
    if (const json::Value* ex = member(q, key); ex && ex->is_array())
      for (const auto& v : *ex) r.exclude.push_back(str_of(&v));
  if (r.algo == "MIXED_PRECISION") {
    const json::Value* ql = member(q, "quantized_layers");
    if (!ql || !ql->is_object()) fail(src + ": MIXED_PRECISION needs a \"quantized_layers\" object");
    r.mixed = true;
    for (const auto& [k, v] : json::members(*ql)) {
      const std::string a = upper(v.is_object() ? str_of(member(&v, "quant_algo")) : str_of(&v));
      r.layers[k] = a;
      if (a == "NVFP4") r.a4 = true;
    }
  } else if (r.algo == "NVFP4") {
    r.a4 = true;
  } else if (r.algo != "W4A16_NVFP4") {
    fail(src + ": unsupported ModelOpt quant_algo '" + str_of(member(q, "quant_algo")) +
             "' (fp4moe reads NVFP4, W4A16_NVFP4 and MIXED_PRECISION of those)",
         ErrorCode::Unsupported);
  }
  return r;
}

Quant ct_quant(const json::Value& qc, const std::string& src) {
  const json::Value* groups = member(&qc, "config_groups");
  if (!groups || !groups->is_object() || groups->empty())
    fail(src + ": compressed-tensors config without \"config_groups\"");
  Quant r;
  r.method = "compressed-tensors";
  r.algo = "nvfp4-pack-quantized";
  r.source = src;
  const std::string top_fmt = str_of(member(&qc, "format"));
  for (const auto& [name, g] : json::members(*groups)) {
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
      for (const auto& v : *t) r.targets.push_back(str_of(&v));
  }
  if (const json::Value* ig = member(&qc, "ignore"); ig && ig->is_array())
    for (const auto& v : *ig) r.exclude.push_back(str_of(&v));
  return r;
}

}  // namespace

// ---- quantization config ---------------------------------------------------------------------------------
std::string Quant::describe() const {
  if (method == "none") return "none (unquantized)";
  if (method == "mxfp4") return "mxfp4 (W4A16)";
  return method + " " + algo + (a4 ? " (W4A4)" : " (W4A16)");
}

bool Quant::quantized(const std::string& module) const {
  if (method == "none" || method == "mxfp4") return false;  // mxfp4 quantizes only gpt-oss's fused experts
  if (method == "modelopt") {
    for (const auto& p : exclude)
      if (modelopt_excludes(p, module)) return false;
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

// ---- the files -------------------------------------------------------------------------------------------
Store::Store(const std::string& dir) : root(dir) {
  if (!fs::is_directory(root)) fail(dir + ": expected a checkpoint directory; it does not exist", ErrorCode::NotFound);
  config = read_json(root / "config.json");
  hfq = read_json(root / "hf_quant_config.json");
  detect_quant();
  const fs::path idx = root / "model.safetensors.index.json";
  if (auto doc = read_json(idx)) {
    const json::Value* wm = member(&*doc, "weight_map");
    if (!wm || !wm->is_object()) fail(idx.string() + ": expected an object with a \"weight_map\" {tensor: file}");
    for (const auto& [name, f] : json::members(*wm)) {
      const std::string fname = str_of(&f);
      if (fname.empty() || fname.find('/') != std::string::npos || fname[0] == '.')
        fail(idx.string() + ": tensor '" + name + "' maps to an unusable file name");
      where[name] = fname;
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

void Store::detect_quant() {
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
  const std::string m = str_of(member(qc, "quant_method"));
  if (m == "modelopt") {
    const json::Value* q = member(qc, "quantization");
    quant = modelopt_quant(q ? q : qc, src);
  } else if (m == "compressed-tensors") {
    quant = ct_quant(*qc, src);
  } else if (m == "mxfp4") {
    quant.method = "mxfp4";
    quant.algo = "MXFP4";
    quant.source = src;
  } else {
    fail(src + ": unknown quantization config quant_method='" + m +
             "' (fp4moe reads 'modelopt' NVFP4, 'compressed-tensors' nvfp4-pack-quantized and 'mxfp4' gpt-oss experts)",
         ErrorCode::Unsupported);
  }
}

const st::File& Store::file(const std::string& fname) {
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

const st::TensorInfo& Store::info(const std::string& name) {
  auto it = where.find(name);
  if (it == where.end()) fail(root.string() + ": tensor '" + name + "' is missing", ErrorCode::NotFound);
  const st::File& f = file(it->second);
  const st::TensorInfo* t = f.find(name);
  if (!t)
    fail(f.origin() + ": tensor '" + name + "' is missing (the index names this file for it)", ErrorCode::NotFound);
  return *t;
}

std::string Store::model_type() const {
  const json::Value* c = config ? &*config : nullptr;
  if (const json::Value* tc = member(c, "text_config"); tc && member(tc, "model_type")) return str_of(member(tc, "model_type"));
  return str_of(member(c, "model_type"));
}
const json::Value* Store::text_config() const {
  const json::Value* c = config ? &*config : nullptr;
  const json::Value* tc = member(c, "text_config");
  return tc && tc->is_object() ? tc : c;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// A checked tensor: one of `dtypes`, of `shape` (-1 entries match anything).
const st::TensorInfo& expect(Store& s, const std::string& name, std::initializer_list<const char*> dtypes,
                             const std::vector<int64_t>& shape, const std::string& where) {
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
Linear plan_linear(Store& s, const std::string& module, int64_t n, int64_t k) {
  const Quant& q = s.quant;
  const bool want_q = q.quantized(module);
  const std::string where = " for a [" + std::to_string(n) + ", " + std::to_string(k) + "] weight";
  Linear l;
  l.module = module;
  auto add = [&](const st::TensorInfo& t) { l.bytes += t.end - t.begin; };
  // The NVFP4 tensors of l.w under one producer's names: block scales, global scale, input scale (read if asked).
  auto nvfp4 = [&](const char* scale2, const char* input, bool read_input) {
    add(expect(s, l.w, {"U8"}, {n, k / 2}, where));
    l.scale = module + ".weight_scale";
    add(expect(s, l.scale, {"F8_E4M3"}, {n, k / 16}, where));
    l.scale2 = module + scale2;
    add(expect_scalar(s, l.scale2));
    l.input_name = module + input;  // absent: the layer runs A16 (checkpoint.cpp a4_scales)
    if (read_input && s.has(l.input_name)) {
      l.input = l.input_name;
      add(expect_scalar(s, l.input));
    }
    l.nvfp4 = true;
  };
  if (s.has(module + ".weight_packed")) {
    l.w = module + ".weight_packed";
    if (q.method != "compressed-tensors")
      fail(s.path_of(l.w) + ": tensor '" + l.w + "' is compressed-tensors NVFP4 but the checkpoint's quantization config is " +
           q.describe());
    nvfp4(".weight_global_scale", ".input_global_scale", q.a4);
    l.inverse = true;
  } else if (s.has(module + ".weight")) {
    l.w = module + ".weight";
    const st::TensorInfo& t = s.info(l.w);
    if (t.dtype_name == "U8") {
      if (q.method != "modelopt")
        fail(s.path_of(l.w) + ": tensor '" + l.w + "' is packed uint8 (ModelOpt NVFP4) but the checkpoint's quantization "
             "config is " + q.describe());
      nvfp4(".weight_scale_2", ".input_scale", true);
      if (s.has(module + ".pre_quant_scale"))
        fail(s.path_of(l.w) + ": tensor '" + module + ".pre_quant_scale': AWQ-smoothed NVFP4 experts are not supported",
             ErrorCode::Unsupported);
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

}  // namespace fp4moe::ckpt
