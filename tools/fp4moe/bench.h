// `fp4moe bench`: the benchmark suite (docs/api.md, "Benchmarks"), and the byte / FLOP counting it
// reports with. The counting functions are pure host code, shared with tests/cpp/test_bench_counting.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fp4moe/model_shapes.h"
#include "fp4moe/types.h"

namespace fp4moe {

// argv holds the arguments after the word "bench" (main passes argc - 2, argv + 2).
// Returns 0 when every case ran (a case the backend reports Unsupported counts as ran), 1 when a
// case failed, 2 on a usage error or when the build has no CUDA backend / the machine no GPU.
int run_bench(int argc, char** argv);

namespace bench {

// --activation NAME: sets s's activation and parameters as the GPU tests use them (swiglu 1/0, situ 4/25,
// swiglubias 1.702/1 clamp 7; gated only: the synthetic layers of SPEC §1 are all gated). False for other names.
inline bool activation_variant(const std::string& name, ModelShape& s) {
  if (name == "swiglu") { s.activation = ActivationType::Swiglu; s.alpha = 1.f; s.beta = 0.f; s.clamp_limit = 0.f; }
  else if (name == "situ") { s.activation = ActivationType::Situ; s.alpha = 4.f; s.beta = 25.f; s.clamp_limit = 0.f; }
  else if (name == "swiglubias") { s.activation = ActivationType::SwigluBias; s.alpha = 1.702f; s.beta = 1.f; s.clamp_limit = 7.f; }
  else return false;
  return true;
}

// ---- bytes of one expert's weights --------------------------------------------------------------
// NVFP4 [N, K]: packed codes (K/2 bytes a row) + one e4m3 scale per 16 elements.
inline int64_t nvfp4_matrix_bytes(int64_t N, int64_t K) {
  if (N < 0 || K < 0 || K % 16 != 0) throw std::invalid_argument("nvfp4_matrix_bytes: K must be a multiple of 16");
  return N * (K / 2) + N * (K / 16);
}

// Weight bytes of one expert: W1 [N1, H] and W2 [H, I] (N1 = 2I gated, I otherwise), with the fp32
// global scales for NVFP4 (W1: one per half, W2: one); bf16 weights: 2 bytes an element.
inline int64_t expert_weight_bytes(WeightFormat format, int64_t H, int64_t I, bool gated) {
  if (H <= 0 || I <= 0) throw std::invalid_argument("expert_weight_bytes: H and I must be positive");
  const int64_t N1 = gated ? 2 * I : I;
  if (format == WeightFormat::BF16) return 2 * (N1 * H + H * I);
  // MXFP4: the bytes the kernels read (format/nvfp4_prepared.h: each E8M0 byte stored twice, as NVFP4's four a
  // 64-K block), no global scales.
  if (format == WeightFormat::MXFP4) return nvfp4_matrix_bytes(N1, H) + nvfp4_matrix_bytes(H, I);
  return nvfp4_matrix_bytes(N1, H) + (gated ? 2 : 1) * 4 + nvfp4_matrix_bytes(H, I) + 4;
}

// The shared expert every token runs (E = 1, intermediate size I), with its bf16 gate vector [H] when gated.
inline int64_t shared_expert_bytes(WeightFormat format, int64_t H, int64_t I, bool gated, bool with_gate) {
  return expert_weight_bytes(format, H, I, gated) + (with_gate ? 2 * H : 0);
}

// bf16 bytes of one (adapter, expert) pair of a PEFT-fused rank-r adapter: A1 [r, H], B1 [N1, r],
// A2 [r, I], B2 [H, r].
inline int64_t lora_pair_bytes(int64_t H, int64_t I, bool gated, int64_t r) {
  const int64_t N1 = gated ? 2 * I : I;
  return 2 * (r * H + N1 * r + r * I + H * r);
}

// bf16 bytes of what a shared-outer rank-r adapter shares among all experts (SPEC §5): A1 [r, H] and B2 [H, r].
inline int64_t lora_shared_outer_bytes(int64_t H, int64_t r) { return 2 * (r * H + H * r); }

// bf16 bytes of one (adapter, expert) pair of a shared-outer rank-r adapter: the expert's own B1 [N1, r] and A2 [r, I].
inline int64_t lora_shared_outer_pair_bytes(int64_t I, bool gated, int64_t r) {
  const int64_t N1 = gated ? 2 * I : I;
  return 2 * (N1 * r + r * I);
}

// ---- FLOPs ----------------------------------------------------------------------------------------
// Base operator: each routed (token, slot) pair on a local expert does GEMM1 (N1 x H) and GEMM2 (H x I).
inline double base_flops(int64_t local_slots, int64_t H, int64_t I, bool gated) {
  const double N1 = gated ? 2.0 * I : double(I);
  return 2.0 * double(local_slots) * (N1 * double(H) + double(H) * double(I));
}
// The shared expert on T tokens: its two GEMMs, and the gate's dot product x . g when gated.
inline double shared_expert_flops(int64_t T, int64_t H, int64_t I, bool gated, bool with_gate) {
  return base_flops(T, H, I, gated) + (with_gate ? 2.0 * double(T) * double(H) : 0.0);
}
// LoRA on top: shrink and expand of both projections, for every adapted (token, slot) pair.
inline double lora_flops(int64_t adapted_slots, int64_t H, int64_t I, bool gated, int64_t r) {
  const double N1 = gated ? 2.0 * I : double(I);
  return 2.0 * double(adapted_slots) * double(r) * (double(H) + N1 + double(I) + double(H));
}

// Shared-outer LoRA: the per-expert B1 expand and A2 shrink for every adapted (token, slot) pair, the shared A1
// shrink and B2 expand once per adapted token (SPEC §5: the down expand runs on the token's weighted sum).
inline double lora_flops_shared_outer(int64_t adapted_slots, int64_t adapted_tokens, int64_t H, int64_t I, bool gated,
                                      int64_t r) {
  const double N1 = gated ? 2.0 * I : double(I);
  return 2.0 * double(r) * (double(adapted_slots) * (N1 + double(I)) + double(adapted_tokens) * 2.0 * double(H));
}

// ---- the LoRA cases ---------------------------------------------------------------------------------
// per_expert8: n PEFT-fused adapters, token t on adapter t % n; shared_outer8: the same with shared-outer adapters;
// one_adapter: one PEFT-fused adapter on every token; half_base: n PEFT-fused adapters on the even tokens, the odd
// tokens base.
enum class LoraCase { PerExpert8, SharedOuter8, OneAdapter, HalfBase };
inline constexpr LoraCase kAllLoraCases[] = {LoraCase::PerExpert8, LoraCase::SharedOuter8, LoraCase::OneAdapter,
                                             LoraCase::HalfBase};
inline constexpr int kNumLoraCases = static_cast<int>(std::size(kAllLoraCases));

inline const char* lora_case_name(LoraCase c) {
  switch (c) {
    case LoraCase::PerExpert8: return "per_expert8";
    case LoraCase::SharedOuter8: return "shared_outer8";
    case LoraCase::OneAdapter: return "one_adapter";
    case LoraCase::HalfBase: return "half_base";
  }
  return "?";
}

// Whether the case's adapters are shared-outer; the other cases' are PEFT-fused (every matrix per expert).
inline bool lora_case_shared_outer(LoraCase c) { return c == LoraCase::SharedOuter8; }

// Token t's adapter id in case c with n adapters loaded (-1 = base).
inline std::vector<int32_t> lora_case_adapter_ids(LoraCase c, int64_t T, int n) {
  if (T < 0 || n <= 0) throw std::invalid_argument("lora_case_adapter_ids: T must be >= 0 and n positive");
  std::vector<int32_t> v(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    if (c == LoraCase::OneAdapter) v[t] = 0;
    else if (c == LoraCase::HalfBase) v[t] = t % 2 ? -1 : static_cast<int32_t>((t / 2) % n);
    else v[t] = static_cast<int32_t>(t % n);
  }
  return v;
}

// ---- what a routing touches -------------------------------------------------------------------------
// A LoRA row's median over the row without LoRA of the same shape and T among `rows` (one run), 0 when there is
// none or either did not run. Row: shape, T, lora, status ("ok"), median_us.
template <class Row> double lora_over_base(const std::vector<Row>& rows, const Row& r) {
  if (!r.lora || r.status != "ok") return 0;
  for (const auto& b : rows)
    if (!b.lora && b.status == "ok" && b.shape == r.shape && b.T == r.T && b.median_us > 0) return r.median_us / b.median_us;
  return 0;
}

struct Touch {
  int64_t local_slots = 0;       // (token, slot) pairs whose expert is local
  int64_t touched_experts = 0;   // local experts with at least one such pair
  int64_t adapted_slots = 0;     // local pairs whose token carries an adapter (id >= 0)
  int64_t touched_pairs = 0;     // distinct (adapter, local expert) pairs used
  int64_t adapted_tokens = 0;    // tokens with an adapter and at least one local pair
  int64_t touched_adapters = 0;  // distinct adapters of those tokens
};

// ids: [T, k] global expert ids; local experts are [offset, offset + E_loc). adapter_ids: [T] or empty
// (no LoRA), -1 = base. Ids outside the local range count as remote (they touch nothing here).
inline Touch count_touch(const std::vector<int32_t>& ids, int64_t T, int64_t k, int64_t offset, int64_t E_loc,
                         const std::vector<int32_t>& adapter_ids = {}) {
  if (T < 0 || k <= 0 || E_loc <= 0 || static_cast<int64_t>(ids.size()) != T * k)
    throw std::invalid_argument("count_touch: ids must hold T*k entries, k and E_loc positive");
  if (!adapter_ids.empty() && static_cast<int64_t>(adapter_ids.size()) != T)
    throw std::invalid_argument("count_touch: adapter_ids must hold T entries (or none)");
  Touch t;
  std::vector<char> hit(static_cast<size_t>(E_loc), 0);
  std::set<std::pair<int32_t, int64_t>> pairs;
  std::set<int32_t> adapters;
  for (int64_t i = 0; i < T; ++i) {
    const bool adapted = !adapter_ids.empty() && adapter_ids[i] >= 0;
    bool local = false;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = static_cast<int64_t>(ids[i * k + j]) - offset;
      if (e < 0 || e >= E_loc) continue;
      ++t.local_slots;
      hit[e] = 1;
      local = true;
      if (adapted) {
        ++t.adapted_slots;
        pairs.insert({adapter_ids[i], e});
      }
    }
    if (adapted && local) {
      ++t.adapted_tokens;
      adapters.insert(adapter_ids[i]);
    }
  }
  for (char h : hit) t.touched_experts += h;
  t.touched_pairs = static_cast<int64_t>(pairs.size());
  t.touched_adapters = static_cast<int64_t>(adapters.size());
  return t;
}

// Adapter bytes one routing touches: PEFT-fused, the four matrices of every touched (adapter, expert) pair;
// shared-outer, each used adapter's shared A1 and B2 once and every touched pair's own B1 and A2.
inline int64_t lora_touched_bytes(const Touch& t, bool shared_outer, int64_t H, int64_t I, bool gated, int64_t r) {
  if (!shared_outer) return t.touched_pairs * lora_pair_bytes(H, I, gated, r);
  return t.touched_adapters * lora_shared_outer_bytes(H, r) + t.touched_pairs * lora_shared_outer_pair_bytes(I, gated, r);
}

// Adapter FLOPs of one routing, by layout (lora_flops, lora_flops_shared_outer).
inline double lora_touched_flops(const Touch& t, bool shared_outer, int64_t H, int64_t I, bool gated, int64_t r) {
  if (!shared_outer) return lora_flops(t.adapted_slots, H, I, gated, r);
  return lora_flops_shared_outer(t.adapted_slots, t.adapted_tokens, H, I, gated, r);
}

// ---- statistics ------------------------------------------------------------------------------------
// Percentile p in [0, 100] with linear interpolation between order statistics (p = 50: the median).
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) throw std::invalid_argument("percentile: no samples");
  if (!(p >= 0.0 && p <= 100.0)) throw std::invalid_argument("percentile: p must be in [0, 100]");
  std::sort(v.begin(), v.end());
  const double pos = p / 100.0 * double(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  const double f = pos - double(lo);
  return v[lo] + (v[hi] - v[lo]) * f;
}

// ---- derived metrics of one case --------------------------------------------------------------------
struct Metrics {
  double gbps = 0;              // weight bytes / time
  double ratio_copy = 0;        // gbps / copy ceiling
  double tflops = 0;            // FLOPs / time
  double ratio_gemm = 0;        // tflops / GEMM ceiling
  double floor_mem_us = 0;      // (weight + I/O bytes) / copy ceiling
  double floor_compute_us = 0;  // FLOPs / GEMM ceiling
  double floor_us = 0;          // max of the two (METHOD: the larger of the two times is the floor)
  double time_over_floor = 0;   // time / floor
};

// time_us > 0; ceilings in GB/s and TFLOP/s (<= 0: unknown, the ratios and that floor term stay 0).
inline Metrics derive_metrics(double time_us, double weight_bytes, double io_bytes, double flops, double copy_gbps,
                              double gemm_tflops) {
  if (!(time_us > 0)) throw std::invalid_argument("derive_metrics: time must be positive");
  Metrics m;
  const double s = time_us * 1e-6;
  m.gbps = weight_bytes / s / 1e9;
  m.tflops = flops / s / 1e12;
  if (copy_gbps > 0) {
    m.ratio_copy = m.gbps / copy_gbps;
    m.floor_mem_us = (weight_bytes + io_bytes) / (copy_gbps * 1e9) * 1e6;
  }
  if (gemm_tflops > 0) {
    m.ratio_gemm = m.tflops / gemm_tflops;
    m.floor_compute_us = flops / (gemm_tflops * 1e12) * 1e6;
  }
  m.floor_us = std::max(m.floor_mem_us, m.floor_compute_us);
  m.time_over_floor = m.floor_us > 0 ? time_us / m.floor_us : 0;
  return m;
}

// Bytes the call must move besides weights: x read and y written (bf16 [T, H]), fp32 logits [T, E_total]
// read, and the i32 adapter ids when given.
inline double io_bytes(int64_t T, int64_t H, int64_t E_total, bool with_adapter_ids) {
  return double(T) * (2.0 * H + 2.0 * H + 4.0 * E_total + (with_adapter_ids ? 4.0 : 0.0));
}

// "1,8,64" -> {1, 8, 64}; throws std::invalid_argument on anything else (empty items, signs, junk).
inline std::vector<int64_t> parse_int_list(const std::string& s) {
  std::vector<int64_t> out;
  size_t i = 0;
  while (i <= s.size()) {
    const size_t j = s.find(',', i);
    const std::string item = s.substr(i, j == std::string::npos ? std::string::npos : j - i);
    if (item.empty() || item.size() > 12 || item.find_first_not_of("0123456789") != std::string::npos)
      throw std::invalid_argument("expected a comma-separated list of non-negative integers, got '" + s + "'");
    out.push_back(std::stoll(item));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (true) {
    const size_t j = s.find(',', i);
    std::string item = s.substr(i, j == std::string::npos ? std::string::npos : j - i);
    if (item.empty()) throw std::invalid_argument("empty item in list '" + s + "'");
    out.push_back(item);
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

// "per_expert8,half_base" -> the cases in that order; throws std::invalid_argument on an unknown or repeated name.
inline std::vector<LoraCase> parse_lora_cases(const std::string& s) {
  std::vector<LoraCase> out;
  for (const std::string& name : split_list(s)) {
    const LoraCase* found = nullptr;
    for (const LoraCase& c : kAllLoraCases)
      if (name == lora_case_name(c)) found = &c;
    if (!found)
      throw std::invalid_argument("unknown LoRA case '" + name + "' (per_expert8, shared_outer8, one_adapter, half_base)");
    if (std::find(out.begin(), out.end(), *found) != out.end())
      throw std::invalid_argument("LoRA case '" + name + "' listed twice");
    out.push_back(*found);
  }
  return out;
}

}  // namespace bench
}  // namespace fp4moe
