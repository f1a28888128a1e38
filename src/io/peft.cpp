// PEFT adapters for transformers 5 fused MoE experts (SPEC §5) -> LoraAdapterDesc (PeftFused).
#include "io/peft.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include "io/json.h"
#include "runtime/host_tensor.h"

namespace fp4moe {
using detail::invalid;

namespace {

TensorView owned_view(const std::vector<uint16_t>& v, std::initializer_list<int64_t> shape) {
  TensorView t;
  t.data = const_cast<uint16_t*>(v.data());
  t.dtype = DType::BF16;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int k = t.ndim - 1; k >= 0; --k) {
    t.stride[k] = st;
    st *= t.shape[k];
  }
  return t;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Which fused-expert parameter a target_parameters entry names ("" when neither).
std::string target_kind(const std::string& t) {
  if (t == "gate_up_proj" || ends_with(t, ".gate_up_proj")) return "gate_up";
  if (t == "down_proj" || ends_with(t, ".down_proj")) return "down";
  return "";
}

const safetensors::TensorInfo* find_weight(const safetensors::File& f, const std::string& base, const char* ab) {
  if (const auto* t = f.find(base + "lora_" + ab + ".weight")) return t;
  return f.find(base + "lora_" + ab + ".default.weight");
}

// One target's A [r*E, in] and B [out, r*E], split per local expert into [El, r, in] and [El, out, r].
struct Split {
  int64_t in = 0, out = 0;
  std::vector<uint16_t> a, b;
};

Split split_target(const safetensors::File& f, const std::string& base, const std::string& target, int64_t r,
                   int64_t* num_experts, const PeftReadOptions& opt, int64_t* num_local) {
  const auto* A = find_weight(f, base, "A");
  const auto* B = find_weight(f, base, "B");
  if (!A || !B)
    throw Error(ErrorCode::NotFound, "module_prefix",
                f.origin() + ": expected tensor '" + base + "lora_" + (A ? "B" : "A") + ".weight' (target '" + target +
                    "' of adapter_config.json), not found");
  for (const auto* t : {A, B})
    if (t->shape.size() != 2)
      invalid(t->name, f.origin() + ": expected a 2-D LoRA matrix, got " + std::to_string(t->shape.size()) + " dims");
  const int64_t rows = A->shape[0], in = A->shape[1], out = B->shape[0];
  if (rows <= 0 || in <= 0 || out <= 0) invalid(A->name, f.origin() + ": expected non-empty LoRA matrices");
  if (rows % r != 0)
    invalid(A->name, f.origin() + ": expected r*E rows with r = " + std::to_string(r) + " (adapter_config.json), got " +
                     std::to_string(rows));
  if (B->shape[1] != rows)
    invalid(B->name, f.origin() + ": expected shape [out, " + std::to_string(rows) + "] to match lora_A's r*E, got [" +
                     std::to_string(out) + ", " + std::to_string(B->shape[1]) + "]");
  const int64_t E = rows / r;
  if (*num_experts == 0) *num_experts = E;
  if (E != *num_experts)
    invalid(A->name, f.origin() + ": expected r*E = " + std::to_string(r * *num_experts) + " rows (E = " +
                     std::to_string(*num_experts) + "), got " + std::to_string(rows));
  const int64_t off = opt.expert_offset;
  if (off < 0 || off >= E)
    invalid("expert_offset", "expected 0.." + std::to_string(E - 1) + ", got " + std::to_string(off));
  const int64_t El = opt.num_local_experts == 0 ? E - off : opt.num_local_experts;
  if (El <= 0 || off + El > E)
    invalid("num_local_experts", "expected 1.." + std::to_string(E - off) + " (experts from offset " + std::to_string(off) +
                                 " of " + std::to_string(E) + "), got " + std::to_string(opt.num_local_experts));
  *num_local = El;

  const std::vector<uint16_t> a = f.read_bf16(*A), b = f.read_bf16(*B);
  Split s;
  s.in = in;
  s.out = out;
  s.a.resize(static_cast<size_t>(El * r * in));
  s.b.resize(static_cast<size_t>(El * out * r));
  for (int64_t le = 0; le < El; ++le) {
    const int64_t e = off + le;
    // A.reshape(E, r, in)[e]: rows e*r .. e*r + r - 1.
    std::copy_n(a.data() + e * r * in, r * in, s.a.data() + le * r * in);
    // B.reshape(out, r, E)[:, :, e]: column c*E + e of B is column c of expert e.
    for (int64_t n = 0; n < out; ++n)
      for (int64_t c = 0; c < r; ++c) s.b[(le * out + n) * r + c] = b[n * rows + c * E + e];
  }
  return s;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::NotFound, "path", "cannot open '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

namespace peft {

PeftConfig parse_config(std::string_view text, const std::string& origin) {
  const json::Value root = json::parse(text, "adapter_config", origin);
  auto field = [&](const char* name) { return origin + ": field '" + name + "'"; };
  if (!root.is_object()) invalid("adapter_config", origin + ": expected a JSON object");
  PeftConfig c;
  if (const json::Value* t = json::find(root, "peft_type"); t && !t->is_null())
    if (!t->is_string() || t->get<std::string>() != "LORA")
      throw Error(ErrorCode::Unsupported, "peft_type", field("peft_type") + ": expected \"LORA\"");
  const json::Value* r = json::find(root, "r");
  const std::optional<int64_t> rank = r ? json::integer(*r) : std::nullopt;
  if (!rank || *rank <= 0) invalid("r", field("r") + ": expected a positive integer");
  c.r = *rank;
  if (const json::Value* a = json::find(root, "lora_alpha"); a && !a->is_null()) {
    if (!a->is_number() || !std::isfinite(a->get<double>()))
      invalid("lora_alpha", field("lora_alpha") + ": expected a finite number");
    c.lora_alpha = static_cast<float>(a->get<double>());
    if (!std::isfinite(c.lora_alpha)) invalid("lora_alpha", field("lora_alpha") + ": expected a value that fits in fp32");
  }
  if (const json::Value* u = json::find(root, "use_rslora"); u && !u->is_null()) {
    if (!u->is_boolean()) invalid("use_rslora", field("use_rslora") + ": expected true or false");
    c.use_rslora = u->get<bool>();
  }
  for (const char* unsupported_flag : {"use_dora", "lora_bias"})
    if (const json::Value* u = json::find(root, unsupported_flag); u && u->is_boolean() && u->get<bool>())
      throw Error(ErrorCode::Unsupported, unsupported_flag, field(unsupported_flag) + ": expected false (not supported)");
  for (const char* pattern : {"rank_pattern", "alpha_pattern"})
    if (const json::Value* p = json::find(root, pattern); p && !p->is_null()) {
      if (!p->is_object()) invalid(pattern, field(pattern) + ": expected an object");
      if (!p->empty())
        throw Error(ErrorCode::Unsupported, pattern,
                    field(pattern) + ": expected it empty (per-module ranks or alphas are not supported)");
    }
  if (const json::Value* t = json::find(root, "target_parameters"); t && !t->is_null()) {
    if (!t->is_array()) invalid("target_parameters", field("target_parameters") + ": expected an array of strings");
    for (const json::Value& s : *t) {
      if (!s.is_string()) invalid("target_parameters", field("target_parameters") + ": expected an array of strings");
      c.target_parameters.push_back(s.get<std::string>());
    }
  }
  return c;
}

PeftExpertsLora read_experts_lora(const safetensors::File& f, const PeftConfig& c, const PeftReadOptions& opt) {
  if (c.r <= 0) invalid("r", "expected a positive rank, got " + std::to_string(c.r));
  if (opt.num_experts < 0) invalid("num_experts", "expected >= 0, got " + std::to_string(opt.num_experts));
  std::vector<std::string> targets;
  for (const std::string& t : c.target_parameters)
    if (!target_kind(t).empty()) targets.push_back(t);
  if (targets.empty())
    invalid("target_parameters", f.origin() + ": expected targets naming the fused experts' gate_up_proj and/or down_proj");
  if (targets.size() > 2 || (targets.size() == 2 && target_kind(targets[0]) == target_kind(targets[1])))
    invalid("target_parameters", "expected at most one gate_up_proj and one down_proj target, got " +
                                 std::to_string(targets.size()) + " expert targets");

  PeftExpertsLora out;
  out.rank = c.r;
  out.lora_alpha = c.lora_alpha;
  out.use_rslora = c.use_rslora;
  int64_t E = opt.num_experts, El = 0;
  const int64_t n = static_cast<int64_t>(targets.size());
  Split gu, dn;
  const std::string base = opt.module_prefix + "experts.";
  if (n == 1) {
    Split s = split_target(f, base, targets[0], c.r, &E, opt, &El);
    if (target_kind(targets[0]) == "gate_up") {
      out.has_gate_up = true;
      gu = std::move(s);
    } else {
      out.has_down = true;
      dn = std::move(s);
    }
  } else {
    // PEFT wraps the experts module once per target (the inner wrapper's tensors under "base_layer."), but the
    // target list it saves does not keep the wrapping order (seen both ways with PEFT 0.21), so the shapes
    // decide: gate_up's A reads H = down's B output, and gate_up's B writes 2I = twice down's A input. Exactly
    // one assignment can fit (both would need H = 2H).
    Split inner = split_target(f, base + "base_layer.", targets[0] + " or " + targets[1], c.r, &E, opt, &El);
    Split outer = split_target(f, base, targets[0] + " or " + targets[1], c.r, &E, opt, &El);
    const auto fits = [](const Split& g, const Split& d) { return g.in == d.out && g.out == 2 * d.in; };
    if (fits(inner, outer)) {
      gu = std::move(inner);
      dn = std::move(outer);
    } else if (fits(outer, inner)) {
      gu = std::move(outer);
      dn = std::move(inner);
    } else {
      invalid("target_parameters", f.origin() + ": the two expert LoRA pairs (in " + std::to_string(inner.in) + " -> out " +
                                   std::to_string(inner.out) + ", in " + std::to_string(outer.in) + " -> out " +
                                   std::to_string(outer.out) +
                                   ") do not fit gate_up [2I, H] and down [H, I] of one layer");
    }
    out.has_gate_up = out.has_down = true;
  }
  out.E = El;
  if (out.has_gate_up) {
    out.H = gu.in;
    out.N1 = gu.out;
    out.I = gu.out / 2;  // transformers' fused experts are gated; the registry checks against the layer
  }
  if (out.has_down) {
    if (out.has_gate_up && dn.out != out.H)
      invalid("target_parameters", f.origin() + ": gate_up lora_A has in = " + std::to_string(out.H) +
                                   " but down lora_B has out = " + std::to_string(dn.out) +
                                   " (both should be the hidden size; is the nesting order of the targets as listed?)");
    if (out.has_gate_up && out.N1 != 2 * dn.in)
      invalid("target_parameters", f.origin() + ": gate_up lora_B has " + std::to_string(out.N1) +
                                   " rows, expected 2 * " + std::to_string(dn.in) + " (twice down's in)");
    out.H = dn.out;
    out.I = dn.in;
  }
  out.a_gate_up = std::move(gu.a);
  out.b_gate_up = std::move(gu.b);
  out.a_down = std::move(dn.a);
  out.b_down = std::move(dn.b);
  return out;
}

std::vector<std::string> list_expert_modules(const safetensors::File& f) {
  std::set<std::string> found;
  for (const auto& t : f.tensors()) {
    const std::string& name = t.name;
    size_t pos = 0;
    while ((pos = name.find("experts.", pos)) != std::string::npos) {
      if (pos == 0 || name[pos - 1] == '.') {
        std::string rest = name.substr(pos + 8);
        while (rest.rfind("base_layer.", 0) == 0) rest = rest.substr(11);
        if (rest == "lora_A.weight" || rest == "lora_B.weight" || rest == "lora_A.default.weight" ||
            rest == "lora_B.default.weight")
          found.insert(name.substr(0, pos));
      }
      pos += 8;
    }
  }
  return {found.begin(), found.end()};
}

}  // namespace peft

PeftConfig read_peft_config(const std::string& path) {
  return peft::parse_config(read_text(path), path);
}

PeftExpertsLora read_peft_experts_lora(const std::string& dir, const PeftReadOptions& options) {
  const PeftConfig c = read_peft_config(dir + "/adapter_config.json");
  const safetensors::File f = safetensors::File::open(dir + "/adapter_model.safetensors");
  return peft::read_experts_lora(f, c, options);
}

std::vector<std::string> list_peft_expert_modules(const std::string& dir) {
  return peft::list_expert_modules(safetensors::File::open(dir + "/adapter_model.safetensors"));
}

LoraAdapterDesc PeftExpertsLora::desc() const {
  LoraAdapterDesc d;
  d.layout = LoraLayout::PeftFused;
  d.rank = rank;
  d.lora_alpha = lora_alpha;
  d.use_rslora = use_rslora;
  if (has_gate_up) {
    d.a_gate_up = owned_view(a_gate_up, {E, rank, H});
    d.b_gate_up = owned_view(b_gate_up, {E, N1, rank});
  }
  if (has_down) {
    d.a_down = owned_view(a_down, {E, rank, I});
    d.b_down = owned_view(b_down, {E, H, rank});
  }
  return d;
}

}  // namespace fp4moe
