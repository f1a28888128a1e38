// The checkpoint reader's configuration: the routing that reproduces a model's router and the experts'
// activation, read from config.json (src/io/checkpoint_files.h).
#include <algorithm>
#include <cmath>
#include <iterator>
#include <optional>
#include <sstream>

#include "io/checkpoint_files.h"
#include "io/json_write.h"

namespace fp4moe::ckpt {

namespace {

// config.json, which a load needs (model type, routing, activation).
const json::Value* config_of(Store& s) {
  if (!s.config)
    fail((s.root / "config.json").string() + ": the file is missing (it gives the model type, the routing and the activation)",
         ErrorCode::NotFound);
  return s.text_config();
}

// A config value as a message shows it.
std::string shown(const json::Value& v) {
  std::ostringstream o;
  if (v.is_number()) o << v.get<double>();
  else if (v.is_string()) o << json::quote(v.get<std::string>());
  else if (v.is_boolean()) o << (v.get<bool>() ? "true" : "false");
  else o << (v.is_null() ? "null" : "an array or object");
  return o.str();
}

// Model types with transformers' DeepSeek-V3 router (sigmoid scores, e_score_correction_bias, expert groups) and the
// defaults of their transformers config classes for the keys a config may leave out.
struct DeepSeekStyle {
  const char* model_type;
  double n_group, topk_group, routed_scaling_factor;
};
constexpr DeepSeekStyle kDeepSeekStyle[] = {{"deepseek_v3", 8, 4, 2.5}, {"deepseek_v32", 8, 4, 2.5},
                                            {"kimi_k2", 8, 4, 2.5},     {"kimi_k25", 8, 4, 2.5},
                                            {"glm4_moe", 1, 1, 1.0}};
constexpr const char* kSoftmaxTopK[] = {"qwen3_moe", "qwen2_moe", "qwen3_next"};  // / sum when norm_topk_prob
constexpr const char* kRenormalize[] = {"mixtral", "gpt_oss"};

}  // namespace

// The routing (SPEC §3.1) that reproduces the model's router, from config.json (keys it leaves out take the
// model's transformers defaults). What the operator could not run is refused here, naming the config key, so that
// a loaded layer's routing always runs.
void routing_of(Store& s, int64_t E, CheckpointRouter& r) {
  const json::Value* c = config_of(s);
  const std::string mt = s.model_type(), src = (s.root / "config.json").string();
  auto refuse = [&](const std::string& key, const std::string& why, ErrorCode code = ErrorCode::InvalidArgument) {
    fail(src + ": " + key + " " + why, code);
  };
  auto int_key = [&](const std::string& key, std::optional<double> dflt) -> int64_t {
    const json::Value* v = member(c, key.c_str());
    if (!v && dflt) return static_cast<int64_t>(*dflt);
    if (!v) refuse(key, "is missing");
    const double x = num_of(v, 0);
    if (!v->is_number() || x != std::floor(x) || std::fabs(x) > 1e9) refuse(key, shown(*v) + ": expected an integer");
    return static_cast<int64_t>(x);
  };
  auto among = [&](const auto& names) {
    return std::any_of(std::begin(names), std::end(names), [&](const char* n) { return mt == n; });
  };
  const DeepSeekStyle* ds = nullptr;
  for (const auto& d : kDeepSeekStyle)
    if (mt == d.model_type) ds = &d;
  std::string ekey;
  if (among(kSoftmaxTopK)) {
    // transformers' default: false for Qwen2-MoE and Qwen3-MoE, true for Qwen3-Next.
    r.routing_method = bool_of(member(c, "norm_topk_prob"), mt == "qwen3_next") ? RoutingMethod::RenormalizeNaive
                                                                                 : RoutingMethod::Default;
    ekey = "num_experts";
  } else if (among(kRenormalize)) {
    r.routing_method = RoutingMethod::Renormalize;
    ekey = "num_local_experts";
  } else if (ds) {
    if (str_of(member(c, "scoring_func"), "sigmoid") != "sigmoid")
      refuse("scoring_func", "'" + str_of(member(c, "scoring_func")) + "': fp4moe's DeepSeekV3 routing scores with sigmoid",
             ErrorCode::Unsupported);
    if (!bool_of(member(c, "norm_topk_prob"), true))
      refuse("norm_topk_prob",
             "false: the router then leaves the chosen weights unnormalized, which no routing method of fp4moe "
             "computes (DeepSeekV3 divides them by their sum, SPEC §3.1)",
             ErrorCode::Unsupported);
    r.routing_method = RoutingMethod::DeepSeekV3;
    ekey = "n_routed_experts";
  } else {
    std::string known;
    for (const char* n : kSoftmaxTopK) known += std::string(known.empty() ? "" : ", ") + n;
    for (const char* n : kRenormalize) known += std::string(", ") + n;
    for (const auto& d : kDeepSeekStyle) known += std::string(", ") + d.model_type;
    refuse("model_type", "'" + mt + "': fp4moe does not know this model's router (it reads " + known + ")",
           ErrorCode::Unsupported);
  }
  r.has_routing_method = true;
  r.num_experts = int_key(ekey, static_cast<double>(E));
  if (r.num_experts != E)
    refuse(ekey, std::to_string(r.num_experts) + ", but the layer's files have " + std::to_string(E) + " experts");
  const std::string kkey = member(c, "num_experts_per_tok") || !member(c, "experts_per_token") ? "num_experts_per_tok"
                                                                                                : "experts_per_token";
  r.top_k = int_key(kkey, std::nullopt);
  if (r.top_k < 1 || r.top_k > E)
    refuse(kkey, std::to_string(r.top_k) + ": expected 1 <= top_k <= " + std::to_string(E) + " (the layer's experts)");
  if (!ds) return;
  const int64_t g = r.n_group = int_key("n_group", ds->n_group), tg = r.topk_group = int_key("topk_group", ds->topk_group);
  if (g < 1 || E % g || (g > 1 && E / g < 2))
    refuse("n_group", std::to_string(g) + ": expected a divisor of the " + std::to_string(E) +
                          " experts leaving at least two per group");
  if (tg < 1 || tg > g) refuse("topk_group", std::to_string(tg) + ": expected 1 <= topk_group <= n_group=" + std::to_string(g));
  if (r.top_k > tg * (E / g))
    refuse(kkey, std::to_string(r.top_k) + ": more than the " + std::to_string(tg * (E / g)) + " experts of topk_group=" +
                     std::to_string(tg) + " groups");
  const json::Value* rsf = member(c, "routed_scaling_factor");
  if (rsf && (!rsf->is_number() || !std::isfinite(num_of(rsf, 0))))
    refuse("routed_scaling_factor", shown(*rsf) + ": expected a finite number");
  r.routed_scaling_factor = static_cast<float>(num_of(rsf, ds->routed_scaling_factor));
}

ActivationType activation_of(Store& s) {
  const json::Value* c = config_of(s);
  if (s.model_type() == "gpt_oss") {  // SwigluBias's defaults are gpt-oss's: alpha 1.702, beta 1, limit 7
    const json::Value* lim = member(c, "swiglu_limit");
    if (lim && num_of(lim, 7.0) != 7.0)
      fail((s.root / "config.json").string() + ": swiglu_limit " + shown(*lim) +
               ": the C++ reader takes SwigluBias's limit 7 (fp4moe.load_moe_layer reads any)",
           ErrorCode::Unsupported);
    return ActivationType::SwigluBias;
  }
  const std::string act = str_of(member(c, "hidden_act"), str_of(member(c, "hidden_activation")));
  if (act == "silu" || act == "swish") return ActivationType::Swiglu;
  if (act == "gelu") return ActivationType::Geglu;
  if (act == "gelu_pytorch_tanh" || act == "gelu_new") return ActivationType::GegluTanh;
  if (act.empty()) fail((s.root / "config.json").string() + ": names no hidden_act (the experts' activation)", ErrorCode::NotFound);
  fail((s.root / "config.json").string() + ": hidden_act '" + act + "' has no fp4moe gated activation", ErrorCode::Unsupported);
}

}  // namespace fp4moe::ckpt
