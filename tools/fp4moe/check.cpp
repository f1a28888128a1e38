// `fp4moe check`: the validation harness. For each model shape and each (activation, A16/A4) config
// it runs the phases of the original release (individual adapters 8/8, eight adapters in one batch
// 8/8, mixed adapter and base requests 12/12) against an oracle, plus the SPEC §4/§5 invariants
// (zero-B adapters, load/unload, base tokens in a mixed batch, bridges, two process launches).
//
// Oracle: the CPU reference on the same synthetic weights and adapters; Precision::Fp32 when the
// backend under test is CUDA, Precision::Fp64 (an independent, unrounded run) when it is the CPU
// reference itself. Tolerances: docs/numerics.md, "Validation harness".
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")  // the host-side LoRA delta must round exactly like the reference
#endif

#include "check.h"
#include "cli.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fp4moe/build_info.h"
#include "fp4moe/model_shapes.h"
#include "fp4moe/moe.h"
#include "fp4moe/synthetic.h"
#include "runtime/json.h"
#include "runtime/prepared.h"
#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace fp4moe {
namespace {

// ---- tolerances (docs/numerics.md, "Validation harness") ---------------------------------------
struct Tolerance {
  double rel_l2, cosine;
};
// A16: the SPEC's bf16 roundings vs an unrounded run cost ~2.5e-3 relative L2; the bound leaves 4x.
constexpr Tolerance kTolA16{1e-2, 0.9999};
// A4 vs the fp64 A4 reference: fp64 quantizes the unrounded activation to NVFP4 where fp32 first rounds
// it to bf16, so ~1% of FC2 inputs land on a neighbouring E2M1 code: 2-3.6e-2 measured on 2-3 tokens.
constexpr Tolerance kTolA4VsFp64{6e-2, 0.998};
// A4 vs the fp32 A4 reference (CUDA): same roundings, so only summation order differs.
constexpr Tolerance kTolA4VsFp32{2e-2, 0.9998};
// An adapter "has an effect" when the output moves from base by at least this relative L2.
constexpr double kMinEffect = 1e-2;

constexpr int kNumAdapters = 8;
constexpr int kRank = 16;
constexpr int kNumRequests = 12;
// Registry slots: 0..7 the eight adapters, 8..10 zero-B adapters, 11 the exact gate_up-only adapter,
// 12 a scratch slot loaded and unloaded during the load/unload invariant.
constexpr int kZeroBSlot0 = 8, kNumZeroB = 3, kBridgeSlot = 11, kScratchSlot = 12, kNumSlots = 16;
// Phase 3: the adapter of each request (-1 = base).
constexpr int kRequestAdapter[kNumRequests] = {-1, 0, 1, -1, 2, 3, -1, 4, 5, -1, 6, 7};

const char* layout_name(LoraLayout l) {
  switch (l) {
    case LoraLayout::PerExpert: return "per_expert";
    case LoraLayout::PeftFused: return "peft_fused";
    case LoraLayout::SharedOuter: return "shared_outer";
  }
  return "?";
}
LoraLayout adapter_layout(int a) {
  // Mostly PEFT fused (what transformers 5 writes), with SGLang/vLLM per-expert and shared-outer ones.
  static constexpr LoraLayout kLayouts[kNumAdapters] = {
      LoraLayout::PeftFused, LoraLayout::PerExpert,   LoraLayout::SharedOuter, LoraLayout::PeftFused,
      LoraLayout::PeftFused, LoraLayout::PerExpert,   LoraLayout::SharedOuter, LoraLayout::PeftFused};
  return kLayouts[a];
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// FNV-1a 64 over bytes: the fingerprint compared across process launches.
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// ---- options ----------------------------------------------------------------------------------
struct Options {
  std::vector<std::string> shapes;
  std::string backend = "auto";
  int64_t tokens = 0, experts = 0;  // 0: the backend's default
  std::string json_path;
  bool child = false;
  std::vector<ActivationType> activations;  // empty: the shape's own plus SwiGLU/SiTU
  std::vector<ActMode> modes;               // empty: A16 and A4
};

void usage(FILE* f) {
  std::fputs(
      "usage: fp4moe check [--shape NAME ...] [--backend cpu|cuda|auto] [--tokens T] [--experts E]\n"
      "                    [--activations swiglu,situ,...] [--modes a16,a4] [--json FILE]\n"
      "  Runs the validation phases (individual adapters, eight adapters in one batch, mixed adapter and\n"
      "  base requests) and the invariants (zero-B, load/unload, base in a mixed batch, bridges, two\n"
      "  process launches) per shape, activation and A16/A4 mode, against the CPU reference.\n"
      "  Defaults: shapes qwen3_30b_a3b and kimi_k3_tp8; backend auto (CUDA when a GPU is usable);\n"
      "  CPU: 16 experts and 24 tokens (reduced, to end in about a minute); CUDA: the shape's experts, 64 tokens.\n"
      "  --child is internal: the re-launched process prints output hashes.\n",
      f);
}

using cli::split_list;

bool parse_int(const char* s, int64_t& out) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0') return false;
  out = v;
  return true;
}

// Returns "" on success, else the problem.
std::string parse_options(int argc, char** argv, Options& o) {
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i] ? argv[i] : "";
    auto value = [&](std::string& dst) -> bool {
      if (i + 1 >= argc || !argv[i + 1]) return false;
      dst = argv[++i];
      return true;
    };
    std::string v;
    if (a == "--shape") {
      if (!value(v)) return "--shape needs a name";
      for (auto& s : split_list(v)) {
        if (!find_model_shape(s)) {
          std::string known;
          for (const auto& m : kModelShapes) known += std::string(known.empty() ? "" : ", ") + std::string(m.name);
          return "unknown shape '" + s + "' (known: " + known + ")";
        }
        o.shapes.push_back(s);
      }
    } else if (a == "--backend") {
      if (!value(v)) return "--backend needs cpu, cuda or auto";
      v = lower(v);
      if (v != "cpu" && v != "cuda" && v != "auto") return "--backend expects cpu, cuda or auto, got '" + v + "'";
      o.backend = v;
    } else if (a == "--tokens" || a == "--experts") {
      int64_t n = 0;
      if (!value(v) || !parse_int(v.c_str(), n) || n <= 0 || n > (1 << 20))
        return a + " expects a positive integer, got '" + v + "'";
      (a == "--tokens" ? o.tokens : o.experts) = n;
    } else if (a == "--json") {
      if (!value(o.json_path) || o.json_path.empty()) return "--json needs a file name";
    } else if (a == "--child") {
      o.child = true;
    } else if (a == "--activations") {
      if (!value(v)) return "--activations needs a list";
      for (auto& s : split_list(lower(v))) {
        if (s == "swiglu") o.activations.push_back(ActivationType::Swiglu);
        else if (s == "situ") o.activations.push_back(ActivationType::Situ);
        else if (s == "swiglubias" || s == "swiglu_bias") o.activations.push_back(ActivationType::SwigluBias);
        else return "--activations: unknown '" + s + "' (swiglu, situ, swiglubias)";
      }
    } else if (a == "--modes") {
      if (!value(v)) return "--modes needs a list";
      for (auto& s : split_list(lower(v))) {
        if (s == "a16") o.modes.push_back(ActMode::A16);
        else if (s == "a4") o.modes.push_back(ActMode::A4);
        else return "--modes: unknown '" + s + "' (a16, a4)";
      }
    } else if (a == "--help" || a == "-h") {
      return "help";
    } else {
      return "unknown option '" + a + "'";
    }
  }
  if (o.shapes.empty()) o.shapes = {"qwen3_30b_a3b", "kimi_k3_tp8"};
  if (o.modes.empty()) o.modes = {ActMode::A16, ActMode::A4};
  return "";
}

// ---- checks and their report ----------------------------------------------------------------------
struct CheckRecord {
  std::string scope;  // "shape activation mode"
  std::string phase;
  std::string name;
  bool pass = false;
  std::string detail;
};

class Reporter {
 public:
  explicit Reporter(bool quiet) : quiet_(quiet) {}
  void add(const std::string& scope, const std::string& phase, const std::string& name, bool pass,
           const std::string& detail) {
    records_.push_back({scope, phase, name, pass, detail});
    if (!quiet_) {
      std::printf("%s  %s | %s | %s: %s\n", pass ? "PASS" : "FAIL", scope.c_str(), phase.c_str(), name.c_str(),
                  detail.c_str());
      std::fflush(stdout);
    }
  }
  const std::vector<CheckRecord>& records() const { return records_; }
  int passed() const {
    return static_cast<int>(std::count_if(records_.begin(), records_.end(), [](auto& r) { return r.pass; }));
  }
  int failed() const { return static_cast<int>(records_.size()) - passed(); }
  // "8/8"-style tally of one scope's phase.
  std::string tally(const std::string& scope, const std::string& phase) const {
    int n = 0, p = 0;
    for (auto& r : records_)
      if (r.scope == scope && r.phase == phase) {
        ++n;
        p += r.pass;
      }
    return std::to_string(p) + "/" + std::to_string(n);
  }

 private:
  bool quiet_;
  std::vector<CheckRecord> records_;
};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// Relative L2, cosine and max |difference| of `got` vs `ref` over rows (all rows when `rows` is empty).
struct Stats {
  double rel_l2 = 0, cosine = 1, max_abs = 0;
};
Stats compare_rows(const std::vector<double>& got, const std::vector<double>& ref, int64_t H,
                   const std::vector<int64_t>& rows) {
  double num = 0, den = 0, dot = 0, ng = 0, mx = 0;
  auto row = [&](int64_t t) {
    for (int64_t h = 0; h < H; ++h) {
      const double g = got[t * H + h], r = ref[t * H + h];
      num += (g - r) * (g - r);
      den += r * r;
      dot += g * r;
      ng += g * g;
      mx = std::max(mx, std::fabs(g - r));
      if (std::isnan(g) || std::isnan(r)) mx = NAN;
    }
  };
  if (rows.empty()) {
    for (int64_t t = 0; t < static_cast<int64_t>(got.size()) / H; ++t) row(t);
  } else {
    for (int64_t t : rows) row(t);
  }
  Stats s;
  s.max_abs = mx;
  if (den == 0 && num == 0) return s;  // both zero (e.g. tokens whose experts all live on other ranks)
  s.rel_l2 = std::sqrt(num / std::max(den, 1e-300));
  s.cosine = (ng == 0 || den == 0) ? 0.0 : dot / std::sqrt(ng * den);
  if (std::isnan(num) || std::isnan(dot)) s.rel_l2 = s.cosine = NAN;
  return s;
}
bool within(const Stats& s, const Tolerance& tol) { return s.rel_l2 <= tol.rel_l2 && s.cosine >= tol.cosine && !std::isnan(s.max_abs); }
std::string describe(const Stats& s, const Tolerance& tol) {
  return "rel_l2 " + fmt("%.3e", s.rel_l2) + " (<= " + fmt("%.0e", tol.rel_l2) + "), cos " + fmt("%.7f", s.cosine) +
         " (>= " + fmt("%g", tol.cosine) + "), max|d| " + fmt("%.3e", s.max_abs);
}

// Rows (tokens) where the two bf16 outputs differ in any bit; `rows` empty = all.
int64_t differing_elements(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t H,
                           const std::vector<int64_t>& rows) {
  if (a.size() != b.size()) return -1;
  int64_t n = 0;
  auto row = [&](int64_t t) {
    for (int64_t h = 0; h < H; ++h) n += a[t * H + h] != b[t * H + h];
  };
  if (rows.empty()) {
    for (int64_t t = 0; t < static_cast<int64_t>(a.size()) / H; ++t) row(t);
  } else {
    for (int64_t t : rows) row(t);
  }
  return n;
}

std::vector<double> to_double(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_bits_to_f32(bits[i]);
  return v;
}

// ---- the problem of one shape -------------------------------------------------------------------
struct ShapeSetup {
  const ModelShape* shape = nullptr;
  int64_t E_loc = 0, E_total = 0, offset = 0, T = 0, H = 0, I = 0, k = 0;
  SyntheticLayer layer;
  std::vector<uint16_t> x;
  std::vector<float> logits, router_bias;
  std::vector<SyntheticAdapter> adapters;  // the eight
  std::vector<SyntheticAdapter> zero_b;    // one per layout
  // The gate_up-only adapter of the bridge invariant (PEFT fused, one +-1 per A row and one +-1/8 per B
  // row, scale 1): every product and sum is exact, so its delta is the same whatever the summation order.
  std::vector<uint16_t> exact_a, exact_b;
};

uint64_t shape_seed(const ModelShape& s) { return fnv1a(s.name.data(), s.name.size()) & 0xffffffffull; }

ShapeSetup make_setup(const ModelShape& shape, int64_t experts, int64_t tokens) {
  ShapeSetup S;
  S.shape = &shape;
  S.E_loc = std::min(experts, shape.E_loc);
  // Expert parallelism (deepseek_v3_ep8): keep the shape's ratio of all experts to local ones, and
  // put this rank's window away from 0.
  S.E_total = S.E_loc * (shape.E / shape.E_loc);
  S.offset = shape.E > shape.E_loc ? S.E_loc : 0;
  S.T = tokens;
  S.H = shape.H;
  S.I = shape.I;
  S.k = shape.k;
  const uint64_t seed = shape_seed(shape);
  // kimi_k3_tp8's weights are up rows first (FlashInfer trtllm order); the others gate first.
  const GateUpOrder order = shape.routing == RoutingMethod::DeepSeekV3 && shape.n_group == 1 ? GateUpOrder::UpFirst
                                                                                              : GateUpOrder::GateFirst;
  S.layer = make_synthetic_layer(shape, S.E_loc, seed, WeightFormat::NVFP4,
                                 /*with_bias=*/shape.activation == ActivationType::SwigluBias, order);
  S.x = random_bf16(S.T * S.H, seed + 1);
  S.logits = random_f32(S.T * S.E_total, seed + 2);
  if (shape.routing == RoutingMethod::DeepSeekV3 || shape.routing == RoutingMethod::MiniMax2)
    S.router_bias = random_f32(S.E_total, seed + 3, 0.1f);
  for (int a = 0; a < kNumAdapters; ++a)
    S.adapters.push_back(make_synthetic_adapter(S.layer, kRank, seed + 100 + a, adapter_layout(a)));
  for (LoraLayout l : {LoraLayout::PeftFused, LoraLayout::PerExpert, LoraLayout::SharedOuter})
    S.zero_b.push_back(make_synthetic_adapter(S.layer, kRank, seed + 200 + static_cast<int>(l), l, /*zero_b=*/true));

  const int64_t E = S.E_loc, H = S.H, N1 = S.layer.gated ? 2 * S.I : S.I, r = kRank;
  std::mt19937_64 rng(seed + 300);
  S.exact_a.assign(E * r * H, 0);
  S.exact_b.assign(E * N1 * r, 0);
  const uint16_t one = f32_to_bf16_bits(1.f), eighth = f32_to_bf16_bits(0.125f);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < r; ++i)
      S.exact_a[(e * r + i) * H + static_cast<int64_t>(rng() % H)] = (rng() & 1) ? one : (one | 0x8000);
    for (int64_t n = 0; n < N1; ++n)
      S.exact_b[(e * N1 + n) * r + static_cast<int64_t>(rng() % r)] = (rng() & 1) ? eighth : (eighth | 0x8000);
  }
  return S;
}

LoraAdapterDesc exact_adapter_desc(ShapeSetup& S) {
  LoraAdapterDesc d;
  d.layout = LoraLayout::PeftFused;
  d.rank = kRank;
  d.lora_alpha = static_cast<float>(kRank);  // scale 1
  const int64_t N1 = S.layer.gated ? 2 * S.I : S.I;
  d.a_gate_up = make_view(S.exact_a.data(), DType::BF16, {S.E_loc, kRank, S.H});
  d.b_gate_up = make_view(S.exact_b.data(), DType::BF16, {S.E_loc, N1, kRank});
  return d;  // no down projection: a gate_up-only adapter
}

// One (activation, mode) configuration of a shape.
struct Config {
  ActivationType act = ActivationType::Swiglu;
  ActMode mode = ActMode::A16;
  std::vector<float> alpha, beta, clamp;  // [E_loc] each, empty = the activation's defaults
  float fc1_scale = 0, fc2_scale = 0;     // A4 dequant scales (1/gs)
  std::string name;                       // "qwen3_30b_a3b swiglu A16"
};

Config make_config(const ShapeSetup& S, ActivationType act, ActMode mode) {
  Config c;
  c.act = act;
  c.mode = mode;
  const int64_t E = S.E_loc;
  if (act == S.shape->activation) {
    c.alpha = S.layer.alpha;
    c.beta = S.layer.beta;
    c.clamp = S.layer.clamp;
  }
  if (act == ActivationType::Situ) {
    // Kimi-K3's alpha 4, beta 25, varied per expert (the original note: per-expert beta).
    c.alpha.resize(E);
    c.beta.resize(E);
    for (int64_t e = 0; e < E; ++e) {
      c.alpha[e] = 4.f + 0.25f * static_cast<float>(e % 4);
      c.beta[e] = 25.f - static_cast<float>(e % 5);
    }
    c.clamp.clear();
  }
  if (mode == ActMode::A4) {
    float amax = 0;
    for (uint16_t v : S.x) amax = std::max(amax, std::fabs(bf16_bits_to_f32(v)));
    c.fc1_scale = amax / (448.f * 6.f);
    // The FC2 input is O(1) with tails to ~10 for both activations on these weights; larger values
    // saturate identically in the backend and the oracle.
    c.fc2_scale = 12.f / (448.f * 6.f);
  }
  c.name = std::string(S.shape->name) + " " + lower(to_string(act)) + (mode == ActMode::A4 ? " A4" : " A16");
  return c;
}

// What one run takes besides the config: adapters, bridge input, routing form.
struct CallSpec {
  std::string label;
  const AdapterRegistry* registry = nullptr;
  const std::vector<int32_t>* adapter_ids = nullptr;
  const std::vector<uint16_t>* delta = nullptr;  // gate_up_lora_delta [T, k, N1]
  const std::vector<int32_t>* topk_ids = nullptr;  // precomputed routing (with topk_weights)
  const std::vector<float>* topk_weights = nullptr;
};

// Host pointers of every input, turned into views on the executor's device.
struct HostInputs {
  const void *x, *logits, *bias, *alpha, *beta, *clamp, *ids, *delta, *topk_ids, *topk_w;
};

#ifdef FP4MOE_WITH_CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::CudaError, "", std::string("fp4moe check: ") + what + ": " + cudaGetErrorString(e));
}
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const void* host, size_t bytes) {
    if (!host || bytes == 0) return;
    cuda_check(cudaMalloc(&ptr_, bytes), "cudaMalloc");
    cuda_check(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to the device");
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};
#endif

// The backend under test or the oracle: prepared weights and the run call on one device.
class Executor {
 public:
  Executor(Backend backend, Precision precision, const ShapeSetup& S)
      : backend_(backend), precision_(precision), S_(S) {
    WeightsDesc d = const_cast<SyntheticLayer&>(S.layer).desc();
    weights_ = prepare_weights(d, backend, 0);
  }
  Backend backend() const { return backend_; }
  std::unique_ptr<AdapterRegistry> make_registry() const {
    return std::make_unique<AdapterRegistry>(weights_, kNumSlots);
  }

  // Runs and returns the output as bf16 bits (bits != nullptr, bf16 y) or as doubles (f64/f32 y on
  // the CPU: the oracle keeps its output unrounded).
  void run(const Config& c, const CallSpec& call, std::vector<uint16_t>* bits, std::vector<double>* values) const {
    const int64_t T = S_.T, H = S_.H;
    HostInputs in{S_.x.data(),
                  S_.logits.data(),
                  S_.router_bias.empty() ? nullptr : S_.router_bias.data(),
                  c.alpha.empty() ? nullptr : c.alpha.data(),
                  c.beta.empty() ? nullptr : c.beta.data(),
                  c.clamp.empty() ? nullptr : c.clamp.data(),
                  call.adapter_ids ? call.adapter_ids->data() : nullptr,
                  call.delta ? call.delta->data() : nullptr,
                  call.topk_ids ? call.topk_ids->data() : nullptr,
                  call.topk_weights ? call.topk_weights->data() : nullptr};
    if (backend_ == Backend::CPU) {
      if (bits) {
        bits->assign(T * H, 0x7fc0);  // NaN: a row the run failed to write shows up
        MoeArgs a = make_args(c, call, in, Backend::CPU);
        a.y = make_view(bits->data(), DType::BF16, {T, H});
        moe_run(weights_, a);
      } else {
        MoeArgs a = make_args(c, call, in, Backend::CPU);
        if (precision_ == Precision::Fp64) {
          values->assign(T * H, NAN);
          a.y = make_view(values->data(), DType::F64, {T, H});
          moe_run(weights_, a);
        } else {
          std::vector<float> y(T * H, NAN);
          a.y = make_view(y.data(), DType::F32, {T, H});
          moe_run(weights_, a);
          values->assign(y.begin(), y.end());
        }
      }
      return;
    }
#ifdef FP4MOE_WITH_CUDA
    if (!bits) throw Error(ErrorCode::InvalidArgument, "", "fp4moe check: the CUDA executor returns bf16 only");
    const int64_t E = S_.E_loc, Et = S_.E_total, k = S_.k, N1 = S_.layer.gated ? 2 * S_.I : S_.I;
    DeviceBuffer dx(in.x, T * H * 2), dl(call.topk_ids ? nullptr : in.logits, T * Et * 4),
        db(call.topk_ids ? nullptr : in.bias, Et * 4), dal(in.alpha, E * 4), dbe(in.beta, E * 4), dcl(in.clamp, E * 4),
        di(in.ids, T * 4), dd(in.delta, T * k * N1 * 2), dti(in.topk_ids, T * k * 4), dtw(in.topk_w, T * k * 4);
    bits->assign(T * H, 0x7fc0);
    DeviceBuffer dy(bits->data(), T * H * 2);
    HostInputs dev{dx.get(), dl.get(), db.get(), dal.get(), dbe.get(), dcl.get(), di.get(), dd.get(), dti.get(), dtw.get()};
    MoeArgs a = make_args(c, call, dev, Backend::CUDA);
    a.y = make_view(dy.get(), DType::BF16, {T, H}, Backend::CUDA, 0);
    moe_run(weights_, a);
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after moe_run");
    check_device_errors(0);
    cuda_check(cudaMemcpy(bits->data(), dy.get(), T * H * 2, cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
#else
    throw Error(ErrorCode::Unsupported, "backend", "this build of fp4moe has no CUDA backend");
#endif
  }

 private:
  MoeArgs make_args(const Config& c, const CallSpec& call, const HostInputs& in, Backend dev) const {
    const int64_t T = S_.T, H = S_.H, E = S_.E_loc, Et = S_.E_total, k = S_.k, N1 = S_.layer.gated ? 2 * S_.I : S_.I;
    auto view = [&](const void* p, DType t, std::initializer_list<int64_t> shape) {
      return p ? make_view(const_cast<void*>(p), t, shape, dev, 0) : TensorView{};
    };
    MoeArgs a;
    a.x = view(in.x, DType::BF16, {T, H});
    a.routing.method = S_.shape->routing;
    a.routing.top_k = k;
    a.routing.n_group = S_.shape->n_group;
    a.routing.topk_group = S_.shape->topk_group;
    a.routing.routed_scaling_factor = S_.shape->routed_scaling_factor;
    if (call.topk_ids) {
      a.routing.topk_ids = view(in.topk_ids, DType::I32, {T, k});
      a.routing.topk_weights = view(in.topk_w, DType::F32, {T, k});
    } else {
      a.routing.logits = view(in.logits, DType::F32, {T, Et});
      a.routing.bias = view(in.bias, DType::F32, {Et});
    }
    a.num_experts_total = Et;
    a.local_expert_offset = S_.offset;
    a.activation.type = c.act;
    a.activation.alpha = view(in.alpha, DType::F32, {E});
    a.activation.beta = view(in.beta, DType::F32, {E});
    a.activation.clamp_limit = view(in.clamp, DType::F32, {E});
    a.mode = c.mode;
    a.fc1_input_scale = c.fc1_scale;
    a.fc2_input_scale = c.fc2_scale;
    if (call.registry) {
      a.adapters = call.registry;
      a.adapter_ids = view(in.ids, DType::I32, {T});
    }
    a.gate_up_lora_delta = view(in.delta, DType::BF16, {T, k, N1});
    a.precision = precision_;
    return a;
  }

  Backend backend_;
  Precision precision_;
  const ShapeSetup& S_;
  MoeWeights weights_;
};

// The gate_up delta [T, k, N1] of one adapter, computed on the host from its canonical form exactly
// as the reference computes it: dh = bf16(bf16(x . A1_e^T) . B1_e^T), fp32 sums in index order.
std::vector<uint16_t> host_gate_up_delta(const ShapeSetup& S, const PreparedAdapter& ad, const std::vector<int32_t>& ids) {
  const int64_t T = S.T, H = S.H, k = S.k, N1 = ad.N1, r1 = ad.r1;
  std::vector<uint16_t> out(T * k * N1, 0);
  std::vector<float> tmp(static_cast<size_t>(r1));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t * k + j] - S.offset;
      if (e < 0 || e >= S.E_loc) continue;  // another rank's expert: the slot is skipped anyway
      const uint16_t* A = ad.A1.data() + (ad.a1_shared ? 0 : e) * r1 * H;
      const uint16_t* B = ad.B1.data() + e * N1 * r1;
      for (int64_t i = 0; i < r1; ++i) {
        float acc = 0;
        for (int64_t h = 0; h < H; ++h) acc += bf16_bits_to_f32(S.x[t * H + h]) * bf16_bits_to_f32(A[i * H + h]);
        tmp[i] = round_bf16(acc);
      }
      for (int64_t n = 0; n < N1; ++n) {
        float acc = 0;
        for (int64_t i = 0; i < r1; ++i) acc += tmp[i] * bf16_bits_to_f32(B[n * r1 + i]);
        out[(t * k + j) * N1 + n] = f32_to_bf16_bits(acc);
      }
    }
  return out;
}

// Phase 3's requests: contiguous groups of tokens.
std::vector<std::vector<int64_t>> request_rows(int64_t T) {
  std::vector<std::vector<int64_t>> rows(kNumRequests);
  for (int q = 0; q < kNumRequests; ++q)
    for (int64_t t = q * T / kNumRequests; t < (q + 1) * T / kNumRequests; ++t) rows[q].push_back(t);
  return rows;
}
std::vector<int32_t> request_ids(int64_t T) {
  std::vector<int32_t> ids(T);
  const auto rows = request_rows(T);
  for (int q = 0; q < kNumRequests; ++q)
    for (int64_t t : rows[q]) ids[t] = kRequestAdapter[q];
  return ids;
}

void load_adapters(AdapterRegistry& reg, ShapeSetup& S) {
  for (int a = 0; a < kNumAdapters; ++a) reg.load(a, S.adapters[a].desc());
}

// The two outputs hashed across launches: base without adapters, and the mixed-request batch.
struct LaunchOutputs {
  std::vector<uint16_t> base, requests;
  uint64_t hash() const {
    uint64_t h = fnv1a(base.data(), base.size() * 2);
    return fnv1a(requests.data(), requests.size() * 2, h);
  }
};

struct Context {
  const Options& opt;
  const CheckHooks& hooks;
  Backend backend;
  int64_t experts, tokens;
  Reporter& rep;
};

// Runs the backend under test and passes its output through the test hook.
std::vector<uint16_t> run_backend(const Context& ctx, const Executor& ex, const Config& c, const CallSpec& call) {
  std::vector<uint16_t> y;
  ex.run(c, call, &y, nullptr);
  if (ctx.hooks.on_backend_output) ctx.hooks.on_backend_output(call.label, y);
  return y;
}

std::vector<ActivationType> activations_of(const ModelShape& shape, const Options& opt) {
  if (!opt.activations.empty()) return opt.activations;
  std::vector<ActivationType> acts{shape.activation};
  for (ActivationType a : {ActivationType::Swiglu, ActivationType::Situ})
    if (a != shape.activation) acts.push_back(a);
  return acts;
}

// Runs one check body; an exception is that check's failure (with its message), not the harness's end.
template <class F> void guarded(Reporter& rep, const std::string& scope, const std::string& phase,
                                const std::string& name, F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    rep.add(scope, phase, name, false, std::string("error: ") + e.what());
  }
}

// The adapters of one shape, loaded once (converting full-size adapters costs seconds): the backend's
// registry holds the eight, the zero-B ones and the exact bridge adapter; the oracle's the eight and
// the bridge adapter.
struct Registries {
  std::unique_ptr<AdapterRegistry> dut, oracle;
};
Registries make_registries(ShapeSetup& S, const Executor& dut, const Executor* oracle) {
  Registries r;
  r.dut = dut.make_registry();
  load_adapters(*r.dut, S);
  for (int z = 0; z < kNumZeroB; ++z) r.dut->load(kZeroBSlot0 + z, S.zero_b[z].desc());
  r.dut->load(kBridgeSlot, exact_adapter_desc(S));
  if (oracle) {
    r.oracle = oracle->make_registry();
    load_adapters(*r.oracle, S);
    r.oracle->load(kBridgeSlot, exact_adapter_desc(S));
  }
  return r;
}

// All phases and invariants of one config except the relaunch; returns the outputs to hash.
LaunchOutputs run_config(const Context& ctx, ShapeSetup& S, const Executor& dut, const Executor& oracle,
                         const Registries& regs, const Config& c) {
  Reporter& rep = ctx.rep;
  const std::string& scope = c.name;
  const Tolerance tol = c.mode == ActMode::A16 ? kTolA16 : (dut.backend() == Backend::CPU ? kTolA4VsFp64 : kTolA4VsFp32);
  const int64_t T = S.T, H = S.H;
  LaunchOutputs out;

  AdapterRegistry* reg = regs.dut.get();
  AdapterRegistry* reg_o = regs.oracle.get();
  const std::vector<int32_t> all_base(T, -1);

  // Without LoRA.
  std::vector<uint16_t> y_base;
  std::vector<double> r_base;
  guarded(rep, scope, "without LoRA", "base vs reference", [&] {
    oracle.run(c, {"oracle_base"}, nullptr, &r_base);
    y_base = run_backend(ctx, dut, c, {"base"});
    const Stats s = compare_rows(to_double(y_base), r_base, H, {});
    rep.add(scope, "without LoRA", "base vs reference", within(s, tol), describe(s, tol));
  });
  out.base = y_base;

  // Phase 1: each adapter alone on all tokens.
  std::vector<std::vector<double>> r_ad(kNumAdapters);
  const std::string p1 = "individual adapters";
  for (int a = 0; a < kNumAdapters; ++a) {
    const std::string name = "adapter " + std::to_string(a) + " (" + layout_name(adapter_layout(a)) + ")";
    guarded(rep, scope, p1, name, [&] {
      const std::vector<int32_t> ids(T, a);
      oracle.run(c, {"oracle_adapter", reg_o, &ids}, nullptr, &r_ad[a]);
      const std::vector<uint16_t> y = run_backend(ctx, dut, c, {"adapter" + std::to_string(a), reg, &ids});
      const std::vector<double> yd = to_double(y);
      const Stats s = compare_rows(yd, r_ad[a], H, {});
      if (y_base.empty()) throw std::runtime_error("no base output to measure the adapter's effect against");
      const double effect = compare_rows(yd, to_double(y_base), H, {}).rel_l2;
      const bool ok = within(s, tol) && effect >= kMinEffect;
      rep.add(scope, p1, name, ok, describe(s, tol) + "; effect vs base " + fmt("%.3e", effect) + " (>= " + fmt("%.0e", kMinEffect) + ")");
    });
  }

  // Phase 2: the eight adapters round-robin in one batch; each adapter's tokens vs its reference.
  const std::string p2 = "eight adapters in one batch";
  {
    std::vector<int32_t> ids(T);
    for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>(t % kNumAdapters);
    std::vector<uint16_t> y;
    std::string err;
    try {
      y = run_backend(ctx, dut, c, {"batch8", reg, &ids});
    } catch (const std::exception& e) {
      err = e.what();
    }
    for (int a = 0; a < kNumAdapters; ++a) {
      const std::string name = "adapter " + std::to_string(a) + " tokens";
      if (!err.empty() || r_ad[a].empty()) {
        rep.add(scope, p2, name, false, "error: " + (err.empty() ? std::string("no reference for this adapter") : err));
        continue;
      }
      std::vector<int64_t> rows;
      for (int64_t t = a; t < T; t += kNumAdapters) rows.push_back(t);
      const Stats s = compare_rows(to_double(y), r_ad[a], H, rows);
      rep.add(scope, p2, name, within(s, tol), std::to_string(rows.size()) + " tokens, " + describe(s, tol));
    }
  }

  // Phase 3: twelve requests, base and adapters, in one batch; each request vs its reference.
  const std::string p3 = "mixed adapter and base requests";
  const auto rows = request_rows(T);
  const std::vector<int32_t> req_ids = request_ids(T);
  {
    std::string err;
    try {
      out.requests = run_backend(ctx, dut, c, {"requests12", reg, &req_ids});
    } catch (const std::exception& e) {
      err = e.what();
    }
    for (int q = 0; q < kNumRequests; ++q) {
      const int a = kRequestAdapter[q];
      const std::string name = "request " + std::to_string(q) + " (" + (a < 0 ? std::string("base") : "adapter " + std::to_string(a)) + ")";
      const std::vector<double>& ref = a < 0 ? r_base : r_ad[a];
      if (!err.empty() || ref.empty()) {
        rep.add(scope, p3, name, false, "error: " + (err.empty() ? std::string("no reference") : err));
        continue;
      }
      const Stats s = compare_rows(to_double(out.requests), ref, H, rows[q]);
      rep.add(scope, p3, name, within(s, tol), std::to_string(rows[q].size()) + " tokens, " + describe(s, tol));
    }
  }

  // Invariants (bit for bit).
  const std::string inv = "invariants";
  auto bitwise = [&](const std::string& name, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                     const std::vector<int64_t>& rws, const std::string& what) {
    if (a.empty() || b.empty()) {
      rep.add(scope, inv, name, false, "error: an output is missing (its run failed above)");
      return;
    }
    const int64_t d = differing_elements(a, b, H, rws);
    rep.add(scope, inv, name, d == 0, what + ": " + std::to_string(d) + " differing bf16 values");
  };

  guarded(rep, scope, inv, "zero-B adapters equal base", [&] {
    std::vector<int32_t> ids(T);
    for (int64_t t = 0; t < T; ++t) ids[t] = kZeroBSlot0 + static_cast<int32_t>(t % kNumZeroB);
    const std::vector<uint16_t> y = run_backend(ctx, dut, c, {"zero_b", reg, &ids});
    bitwise("zero-B adapters equal base", y, y_base, {}, "peft_fused/per_expert/shared_outer zero-B vs base, all tokens");
  });

  {
    std::vector<int64_t> base_rows;
    for (int q = 0; q < kNumRequests; ++q)
      if (kRequestAdapter[q] < 0) base_rows.insert(base_rows.end(), rows[q].begin(), rows[q].end());
    bitwise("base tokens in a mixed batch equal base alone", out.requests, y_base, base_rows,
            std::to_string(base_rows.size()) + " base tokens of the 12-request batch vs the base run");
  }

  guarded(rep, scope, inv, "bridge equals fused LoRA", [&] {
    // Precomputed routing (the reference's) so both runs use the same experts, then the exact
    // gate_up-only adapter through the registry vs its delta through gate_up_lora_delta.
    std::vector<int32_t> topk_ids(T * S.k);
    std::vector<float> topk_w(T * S.k);
    RoutingArgs r;
    r.method = S.shape->routing;
    r.top_k = S.k;
    r.logits = make_view(S.logits.data(), DType::F32, {T, S.E_total});
    if (!S.router_bias.empty()) r.bias = make_view(S.router_bias.data(), DType::F32, {S.E_total});
    r.n_group = S.shape->n_group;
    r.topk_group = S.shape->topk_group;
    r.routed_scaling_factor = S.shape->routed_scaling_factor;
    route(r, S.E_total, make_view(topk_ids.data(), DType::I32, {T, S.k}), make_view(topk_w.data(), DType::F32, {T, S.k}));
    const std::vector<int32_t> ids(T, kBridgeSlot);
    const PreparedAdapter& ad = *(*reg_o->snapshot())[kBridgeSlot];
    const std::vector<uint16_t> delta = host_gate_up_delta(S, ad, topk_ids);
    CallSpec fused{"bridge_fused", reg, &ids, nullptr, &topk_ids, &topk_w};
    CallSpec bridge{"bridge_delta", nullptr, nullptr, &delta, &topk_ids, &topk_w};
    const std::vector<uint16_t> y_fused = run_backend(ctx, dut, c, fused);
    const std::vector<uint16_t> y_bridge = run_backend(ctx, dut, c, bridge);
    const double effect = y_base.empty() ? 0 : compare_rows(to_double(y_fused), to_double(y_base), H, {}).rel_l2;
    const int64_t d = differing_elements(y_fused, y_bridge, H, {});
    rep.add(scope, inv, "bridge equals fused LoRA", d == 0 && effect >= kMinEffect,
            "gate_up-only adapter via the registry vs its delta via gate_up_lora_delta: " + std::to_string(d) +
                " differing bf16 values; effect vs base " + fmt("%.3e", effect));
  });

  guarded(rep, scope, inv, "base unchanged by load/unload", [&] {
    // A registry of its own: base through it while empty, then after loading adapters (one of each
    // kind, in several slots) and unloading them all.
    auto lu = dut.make_registry();
    const std::vector<uint16_t> y_before = run_backend(ctx, dut, c, {"base_empty_registry", lu.get(), &all_base});
    lu->load(0, S.adapters[0].desc());
    lu->load(kScratchSlot, S.adapters[kNumAdapters - 1].desc());
    lu->load(kZeroBSlot0, S.zero_b[0].desc());
    lu->load(kScratchSlot, S.adapters[1].desc());  // replaces what the slot held
    for (int s = 0; s < kNumSlots; ++s)
      if (lu->loaded(s)) lu->unload(s);
    const std::vector<uint16_t> y_after = run_backend(ctx, dut, c, {"base_after_unload", lu.get(), &all_base});
    if (y_base.empty()) throw std::runtime_error("no base output (its run failed above)");
    const int64_t d1 = differing_elements(y_before, y_base, H, {});
    const int64_t d2 = differing_elements(y_after, y_base, H, {});
    rep.add(scope, inv, "base unchanged by load/unload", d1 == 0 && d2 == 0,
            "registry-empty before loading vs base: " + std::to_string(d1) + ", after unloading all: " +
                std::to_string(d2) + " differing bf16 values");
  });
  return out;
}

// The child of the relaunch invariant: the same setup, only the hashed runs, one line per config.
LaunchOutputs child_outputs(const Context& ctx, ShapeSetup& S, const Executor& dut, const Registries& regs,
                            const Config& c) {
  const AdapterRegistry* reg = regs.dut.get();
  LaunchOutputs o;
  o.base = run_backend(ctx, dut, c, {"base"});
  const std::vector<int32_t> ids = request_ids(S.T);
  o.requests = run_backend(ctx, dut, c, {"requests12", reg, &ids});
  return o;
}

// Re-runs this executable as `check --child ...` and returns its stdout ("" plus `err` on failure).
std::string relaunch(const std::vector<std::string>& args, std::string& err) {
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) {
    err = "cannot read /proc/self/exe";
    return "";
  }
  exe[n] = '\0';
  int fds[2];
  if (pipe(fds) != 0) {
    err = "pipe failed";
    return "";
  }
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    err = "fork failed";
    close(fds[0]);
    close(fds[1]);
    return "";
  }
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> av;
    av.push_back(exe);
    for (const auto& a : args) av.push_back(const_cast<char*>(a.c_str()));
    av.push_back(nullptr);
    execv(exe, av.data());
    _exit(127);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t r = read(fds[0], buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    err = "child exited with status " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    return "";
  }
  return out;
}

std::string act_list(const std::vector<ActivationType>& acts) {
  std::string s;
  for (auto a : acts) s += std::string(s.empty() ? "" : ",") + lower(to_string(a));
  return s;
}

void run_shape(const Context& ctx, const ModelShape& shape) {
  ShapeSetup S = make_setup(shape, ctx.experts > 0 ? ctx.experts : shape.E_loc, ctx.tokens);
  const bool cpu = ctx.backend == Backend::CPU;
  const std::vector<ActivationType> acts = activations_of(shape, ctx.opt);
  if (!ctx.opt.child) {
    const std::string reduced = S.E_loc < shape.E_loc ? " (reduced from " + std::to_string(shape.E_loc) + ")" : "";
    std::printf("== %s: H=%lld I=%lld k=%lld, %lld local experts%s, router over %lld (local window at %lld), T=%lld tokens, "
                "%s routing, %s weights, backend %s vs the CPU reference (%s)\n",
                std::string(shape.name).c_str(), (long long)S.H, (long long)S.I, (long long)S.k, (long long)S.E_loc,
                reduced.c_str(), (long long)S.E_total, (long long)S.offset, (long long)S.T,
                to_string(shape.routing), S.layer.order == GateUpOrder::UpFirst ? "up-first NVFP4" : "gate-first NVFP4",
                cpu ? "CPU reference (fp32)" : "CUDA", cpu ? "fp64" : "fp32");
    std::fflush(stdout);
  }
  const Executor dut(ctx.backend, Precision::Fp32, S);
  std::unique_ptr<Executor> oracle;
  if (!ctx.opt.child) oracle = std::make_unique<Executor>(Backend::CPU, cpu ? Precision::Fp64 : Precision::Fp32, S);

  std::vector<Config> configs;
  for (ActivationType a : acts)
    for (ActMode m : ctx.opt.modes) configs.push_back(make_config(S, a, m));

  const Registries regs = make_registries(S, dut, oracle.get());
  if (ctx.opt.child) {
    for (const Config& c : configs) {
      std::string line = "hash " + c.name + " ";
      try {
        line += hex64(child_outputs(ctx, S, dut, regs, c).hash());
      } catch (const std::exception& e) {
        line += std::string("error ") + e.what();
      }
      std::printf("%s\n", line.c_str());
    }
    return;
  }

  // Identical output across two process launches: the child recomputes the hashed runs first (so
  // that each config's tally below includes this invariant).
  std::vector<std::string> args{"check", "--child", "--shape", std::string(shape.name), "--backend", cpu ? "cpu" : "cuda",
                                "--tokens", std::to_string(S.T), "--experts", std::to_string(S.E_loc),
                                "--activations", act_list(acts), "--modes", ""};
  for (ActMode m : ctx.opt.modes) args.back() += std::string(args.back().empty() ? "" : ",") + (m == ActMode::A4 ? "a4" : "a16");
  std::string relaunch_err;
  std::map<std::string, std::string> child_hash;
  {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string child_out = relaunch(args, relaunch_err);
    std::istringstream is(child_out);
    for (std::string line; std::getline(is, line);) {
      if (line.rfind("hash ", 0) != 0) continue;
      const size_t sp = line.rfind(' ');  // "hash <config name with spaces> <hex>"
      child_hash[line.substr(5, sp - 5)] = line.substr(sp + 1);
    }
    std::printf("-- re-launched process (check --child) done in %.1f s%s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                relaunch_err.empty() ? "" : (": " + relaunch_err).c_str());
    std::fflush(stdout);
  }

  for (const Config& c : configs) {
    const auto t0 = std::chrono::steady_clock::now();
    const LaunchOutputs o = run_config(ctx, S, dut, *oracle, regs, c);
    const std::string name = "identical output across two process launches";
    auto other = child_hash.find(c.name);
    if (!relaunch_err.empty()) {
      ctx.rep.add(c.name, "invariants", name, false, "error: " + relaunch_err);
    } else if (o.base.empty() || o.requests.empty()) {
      ctx.rep.add(c.name, "invariants", name, false, "error: this process's runs failed");
    } else if (other == child_hash.end()) {
      ctx.rep.add(c.name, "invariants", name, false, "error: the child printed no hash for this config");
    } else {
      const std::string mine = hex64(o.hash());
      ctx.rep.add(c.name, "invariants", name, mine == other->second,
                  "hash of base + 12-request outputs: this process " + mine + ", re-launched process " + other->second);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("-- %s: without LoRA %s, individual adapters %s, eight adapters in one batch %s, mixed adapter and "
                "base requests %s, invariants %s (%.1f s)\n",
                c.name.c_str(), ctx.rep.tally(c.name, "without LoRA").c_str(),
                ctx.rep.tally(c.name, "individual adapters").c_str(),
                ctx.rep.tally(c.name, "eight adapters in one batch").c_str(),
                ctx.rep.tally(c.name, "mixed adapter and base requests").c_str(),
                ctx.rep.tally(c.name, "invariants").c_str(), secs);
    std::fflush(stdout);
  }
}

bool write_json(const std::string& path, const Reporter& rep, const std::string& backend, int64_t experts, int64_t tokens) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  const BuildInfo bi = build_info();
  std::fprintf(f, "{\n  \"tool\": \"fp4moe check\",\n  \"version\": %s,\n  \"source_hash\": %s,\n",
               json::quote(bi.version).c_str(), json::quote(bi.source_hash).c_str());
  std::fprintf(f, "  \"backend\": %s,\n  \"experts\": %lld,\n  \"tokens\": %lld,\n", json::quote(backend).c_str(), (long long)experts,
               (long long)tokens);
  std::fprintf(f, "  \"passed\": %d,\n  \"failed\": %d,\n  \"checks\": [\n", rep.passed(), rep.failed());
  const auto& r = rep.records();
  for (size_t i = 0; i < r.size(); ++i)
    std::fprintf(f, "    {\"scope\": %s, \"phase\": %s, \"name\": %s, \"pass\": %s, \"detail\": %s}%s\n",
                 json::quote(r[i].scope).c_str(), json::quote(r[i].phase).c_str(), json::quote(r[i].name).c_str(),
                 r[i].pass ? "true" : "false", json::quote(r[i].detail).c_str(), i + 1 < r.size() ? "," : "");
  std::fprintf(f, "  ]\n}\n");
  return std::fclose(f) == 0;
}

}  // namespace

int run_check_with_hooks(int argc, char** argv, const CheckHooks& hooks) {
  Options opt;
  const std::string perr = parse_options(argc, argv, opt);
  if (perr == "help") {
    usage(stdout);
    return 0;
  }
  if (!perr.empty()) {
    std::fprintf(stderr, "fp4moe check: %s\n", perr.c_str());
    usage(stderr);
    return 2;
  }
  const bool have_gpu = cuda_device_count() > 0;
  Backend backend = Backend::CPU;
  if (opt.backend == "cuda" || (opt.backend == "auto" && have_gpu)) {
    if (!have_gpu) {
      std::fprintf(stderr, "fp4moe check: --backend cuda, but %s\n",
                   build_info().with_cuda ? "no CUDA device is usable" : "this build has no CUDA backend");
      return 2;
    }
    backend = Backend::CUDA;
  }
  const bool cpu = backend == Backend::CPU;
  const int64_t tokens = opt.tokens > 0 ? opt.tokens : (cpu ? 24 : 64);
  const int64_t experts = opt.experts > 0 ? opt.experts : (cpu ? 16 : 0);  // 0: the shape's
  if (tokens < kNumRequests) {
    std::fprintf(stderr, "fp4moe check: --tokens must be >= %d (one token per request of phase 3), got %lld\n",
                 kNumRequests, (long long)tokens);
    return 2;
  }
  for (const auto& name : opt.shapes) {
    const ModelShape& s = *find_model_shape(name);
    const int64_t e = experts > 0 ? std::min(experts, s.E_loc) : s.E_loc;
    const int64_t et = e * (s.E / s.E_loc);
    if (s.k > et || (s.n_group > 1 && (et % s.n_group != 0 || et / s.n_group < 2 || s.k > s.topk_group * (et / s.n_group)))) {
      std::fprintf(stderr, "fp4moe check: --experts %lld is too few for %s (top-%lld, %lld groups)\n", (long long)e,
                   name.c_str(), (long long)s.k, (long long)s.n_group);
      return 2;
    }
  }

  Reporter rep(opt.child);
  const Context ctx{opt, hooks, backend, experts, tokens, rep};
  const auto t0 = std::chrono::steady_clock::now();
  if (!opt.child) {
    std::printf("fp4moe check: backend %s, %s, %lld tokens; oracle: CPU reference in %s\n",
                cpu ? "cpu (the reference in fp32)" : "cuda",
                experts > 0 ? ("reduced to " + std::to_string(experts) + " experts per shape (--experts)").c_str()
                            : "each shape's own expert count",
                (long long)tokens, cpu ? "fp64 (Precision::Fp64)" : "fp32");
    const Tolerance a4 = cpu ? kTolA4VsFp64 : kTolA4VsFp32;
    std::printf("tolerances: A16 rel_l2 <= %g and cos >= %g; A4 (vs the %s A4 reference) rel_l2 <= %g and cos >= %g; "
                "adapter effect vs base >= %g; invariants bit for bit\n",
                kTolA16.rel_l2, kTolA16.cosine, cpu ? "fp64" : "fp32", a4.rel_l2, a4.cosine, kMinEffect);
    std::fflush(stdout);
  }
  for (const auto& name : opt.shapes) {
    try {
      run_shape(ctx, *find_model_shape(name));
    } catch (const std::exception& e) {
      // Setup failed (weights, adapters): one failing check stands for the whole shape.
      if (opt.child) {
        std::printf("error %s\n", e.what());
        return 1;
      }
      rep.add(name, "setup", "prepare weights and adapters", false, std::string("error: ") + e.what());
    }
  }
  if (opt.child) return 0;

  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("fp4moe check finished in %.1f s\n", secs);
  if (!opt.json_path.empty() && !write_json(opt.json_path, rep, cpu ? "cpu" : "cuda", experts, tokens))
    rep.add("harness", "output", "write --json " + opt.json_path, false, "cannot write the file");
  std::printf("%d passed, %d failed\n", rep.passed(), rep.failed());
  std::fflush(stdout);
  return rep.failed() == 0 && rep.passed() > 0 ? 0 : 1;
}

int run_check(int argc, char** argv) { return run_check_with_hooks(argc, argv, CheckHooks{}); }

}  // namespace fp4moe
