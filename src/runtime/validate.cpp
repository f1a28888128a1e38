#include "runtime/validate.h"

#include "runtime/plan.h"
#include "runtime/host_tensor.h"

#include <cmath>
#include <sstream>
#include <string>

namespace fp4moe {
using detail::invalid;
namespace {

// A tensor that must be present, of one dtype and shape, contiguous, on the call's device.
void expect(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape, Backend dev,
            int dev_id) {
  if (!t.present()) invalid(name, "is required but absent");
  if (t.dtype != dtype)
    invalid(name, std::string("expected dtype ") + to_string(dtype) + ", got " + to_string(t.dtype));
  bool ok = t.ndim == static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) ok = ok && t.shape[i++] == s;
  if (!ok) invalid(name, "expected shape " + detail::shape_list_str(shape) + ", got " + t.shape_str());
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] < 0 || t.stride[d] < 0) invalid(name, "negative size or stride");
  if (!t.is_contiguous()) invalid(name, "must be contiguous (row-major), got strides that are not");
  if (t.device != dev || (dev == Backend::CUDA && t.device_id != dev_id)) {
    std::string want = dev == Backend::CPU ? "cpu" : "cuda:" + std::to_string(dev_id);
    invalid(name, "expected a tensor on " + want + ", got " + t.shape_str() + (t.device == Backend::CPU ? " on cpu" : ""));
  }
}

void expect_optional(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                     Backend dev, int dev_id) {
  if (t.present()) expect(t, name, dtype, shape, dev, dev_id);
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (!a.present() || !b.present() || a.numel() == 0 || b.numel() == 0) return false;
  if (a.device != b.device || a.device_id != b.device_id) return false;
  auto lo_a = reinterpret_cast<uintptr_t>(a.data), lo_b = reinterpret_cast<uintptr_t>(b.data);
  auto hi_a = lo_a + a.numel() * dtype_size(a.dtype), hi_b = lo_b + b.numel() * dtype_size(b.dtype);
  return lo_a < hi_b && lo_b < hi_a;
}

bool finite_positive(float v) { return std::isfinite(v) && v > 0.f; }

// Values of a host f32 vector: finite (and > 0 when positive).
void check_host_values(const TensorView& t, const char* name, bool positive, bool allow_inf) {
  if (!t.present() || t.device != Backend::CPU) return;  // device values: see docs/api.md
  const float* p = t.as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    float v = p[i];
    bool ok = !std::isnan(v) && (allow_inf || std::isfinite(v)) && (!positive || v > 0.f);
    if (!ok) {
      std::ostringstream os;
      os << "element " << i << " is " << v << "; expected a " << (positive ? "positive " : "")
         << (allow_inf ? "number (inf = none)" : "finite number");
      invalid(name, os.str());
    }
  }
}

// The shared expert's sigmoid gate: bf16 [H] or [1, H] beside a shared expert; host values finite (on the GPU the
// combine checks them, docs/api.md).
void validate_shared_gate(const MoeArgs& a, int64_t H, Backend dev, int dev_id) {
  const TensorView& g = a.shared_expert_gate;
  if (!g.present()) return;
  const char* name = "shared_expert_gate";
  if (!a.shared_expert) invalid(name, "given without a shared expert (shared_expert); the gate scales its output");
  if (g.dtype != DType::BF16)
    invalid(name, std::string("expected dtype bfloat16 (as checkpoints store shared_expert_gate.weight), got ") +
                      to_string(g.dtype));
  if (g.ndim == 2 && g.shape[0] == 1) expect(g, name, DType::BF16, {1, H}, dev, dev_id);
  else if (g.ndim == 1) expect(g, name, DType::BF16, {H}, dev, dev_id);
  else invalid(name, "expected shape [" + std::to_string(H) + "] or [1, " + std::to_string(H) + "], got " + g.shape_str());
  if (g.device != Backend::CPU) return;
  const uint16_t* p = g.as<uint16_t>();
  for (int64_t i = 0; i < H; ++i)
    if (!std::isfinite(bf16_bits_to_f32(p[i])))
      invalid(name, "element " + std::to_string(i) + " is " + std::to_string(bf16_bits_to_f32(p[i])) +
                        "; expected a finite number");
}

}  // namespace

void validate_routing(const RoutingArgs& r, int64_t T, int64_t E_total, Backend dev, int dev_id) {
  const int64_t k = r.top_k;
  if (k < 1 || k > E_total)
    invalid("routing.top_k", "expected 1 <= top_k <= " + std::to_string(E_total) + ", got " + std::to_string(k));
  if (k > 64) invalid("routing.top_k", "at most 64 experts per token are supported, got " + std::to_string(k));
  const bool pre = r.topk_ids.present() || r.topk_weights.present();
  if (pre) {
    if (r.logits.present()) invalid("routing.logits", "give either logits or precomputed topk_ids/topk_weights, not both");
    expect(r.topk_ids, "routing.topk_ids", DType::I32, {T, k}, dev, dev_id);
    expect(r.topk_weights, "routing.topk_weights", DType::F32, {T, k}, dev, dev_id);
    if (dev == Backend::CPU) {
      const int32_t* ids = r.topk_ids.as<int32_t>();
      for (int64_t i = 0; i < T * k; ++i)
        if (ids[i] < 0 || ids[i] >= E_total)
          invalid("routing.topk_ids", "element " + std::to_string(i) + " is " + std::to_string(ids[i]) +
                                       ", expected an expert id in [0, " + std::to_string(E_total) + ")");
    }
    return;
  }
  if (!r.logits.present()) invalid("routing.logits", "absent: give logits or precomputed topk_ids/topk_weights");
  if (r.logits.dtype != DType::F32 && r.logits.dtype != DType::BF16)
    invalid("routing.logits", std::string("expected float32 or bfloat16, got ") + to_string(r.logits.dtype));
  expect(r.logits, "routing.logits", r.logits.dtype, {T, E_total}, dev, dev_id);
  expect_optional(r.bias, "routing.bias", DType::F32, {E_total}, dev, dev_id);
  check_host_values(r.bias, "routing.bias", false, false);
  if (!std::isfinite(r.routed_scaling_factor))
    invalid("routing.routed_scaling_factor", "must be finite");
  const int v = static_cast<int>(r.method);
  if (v < 0 || v > 9) invalid("routing.method", "expected a RoutingMethod value 0..9, got " + std::to_string(v));
  if (r.method == RoutingMethod::Llama4 && k != 1) invalid("routing.top_k", "Llama4 routing takes top_k = 1");
  if (r.n_group < 1 || E_total % r.n_group != 0)
    invalid("routing.n_group", "must be >= 1 and divide the number of experts " + std::to_string(E_total) + ", got " +
                                std::to_string(r.n_group));
  if (r.method == RoutingMethod::DeepSeekV3 && r.n_group > 1) {
    if (r.topk_group < 1 || r.topk_group > r.n_group)
      invalid("routing.topk_group", "expected 1 <= topk_group <= n_group, got " + std::to_string(r.topk_group));
    if (E_total / r.n_group < 2) invalid("routing.n_group", "each group needs at least 2 experts");
    if (k > r.topk_group * (E_total / r.n_group))
      invalid("routing.top_k", "top_k exceeds the experts in the kept groups");
  }
}

CallShape validate_moe_args(const MoeWeights& weights, const MoeArgs& a, const AdapterSnapshot& adapters) {
  if (!weights.valid()) invalid("weights", "not prepared (call prepare_weights first)");
  const PreparedWeights& w = weights.impl();
  const Backend dev = w.backend;
  const int dev_id = w.device_id;
  CallShape s;
  s.H = w.H;
  s.I = w.I;
  s.N1 = w.n1();
  s.E_loc = w.E;

  // x and T.
  if (!a.x.present()) invalid("x", "is required but absent");
  if (a.x.ndim != 2) invalid("x", "expected a 2-D tensor [T, H], got " + a.x.shape_str());
  s.T = a.x.shape[0];
  expect(a.x, "x", DType::BF16, {s.T, s.H}, dev, dev_id);

  // Output.
  if (!a.y.present()) invalid("y", "is required but absent");
  // bf16: the sum rounded once. float32 (both backends): the same fp32 sum, not rounded (moe_run_tp / moe_run_ep
  // run their local operator into such a partial). float64: the CPU reference only.
  const bool y_ok = a.y.dtype == DType::BF16 || a.y.dtype == DType::F32 || (dev == Backend::CPU && a.y.dtype == DType::F64);
  if (!y_ok)
    invalid("y", std::string("expected bfloat16 or float32") + (dev == Backend::CPU ? " (or float64 on the CPU)" : "") +
                  ", got " + to_string(a.y.dtype));
  expect(a.y, "y", a.y.dtype, {s.T, s.H}, dev, dev_id);
  if (overlaps(a.x, a.y)) invalid("y", "overlaps x; the output must not alias an input");

  // Experts and the expert-parallel window.
  s.E_total = a.num_experts_total == 0 ? s.E_loc : a.num_experts_total;
  if (s.E_total < s.E_loc)
    invalid("num_experts_total", "expected >= the " + std::to_string(s.E_loc) + " local experts, got " + std::to_string(s.E_total));
  if (a.local_expert_offset < 0 || a.local_expert_offset + s.E_loc > s.E_total)
    invalid("local_expert_offset", "window [" + std::to_string(a.local_expert_offset) + ", +" + std::to_string(s.E_loc) +
                                    ") is outside [0, " + std::to_string(s.E_total) + ")");
  validate_routing(a.routing, s.T, s.E_total, dev, dev_id);
  s.k = a.routing.top_k;

  // Activation.
  const int av = static_cast<int>(a.activation.type);
  if (av < 0 || av > 10) invalid("activation.type", "expected an ActivationType value 0..10, got " + std::to_string(av));
  if (is_gated(a.activation.type) != w.gated)
    invalid("activation.type", std::string(to_string(a.activation.type)) + (w.gated ? " is not gated but the weights hold gate and up halves"
                                                                                : " is gated but the weights hold a single W1 half"));
  const bool situ = a.activation.type == ActivationType::Situ;
  expect_optional(a.activation.alpha, "activation.alpha", DType::F32, {s.E_loc}, dev, dev_id);
  expect_optional(a.activation.beta, "activation.beta", DType::F32, {s.E_loc}, dev, dev_id);
  expect_optional(a.activation.clamp_limit, "activation.clamp_limit", DType::F32, {s.E_loc}, dev, dev_id);
  check_host_values(a.activation.alpha, "activation.alpha", situ, false);
  check_host_values(a.activation.beta, "activation.beta", situ, false);
  check_host_values(a.activation.clamp_limit, "activation.clamp_limit", true, true);

  // Mode.
  if (a.mode != ActMode::A16 && a.mode != ActMode::A4) invalid("mode", "expected A16 (0) or A4 (1)");
  if (a.mode == ActMode::A4) {
    if (!a.per_token_x_scale && !finite_positive(a.fc1_input_scale))
      invalid("fc1_input_scale", "A4 mode needs a finite positive scale (or per_token_x_scale), got " + std::to_string(a.fc1_input_scale));
    if (!finite_positive(a.fc2_input_scale))
      invalid("fc2_input_scale", "A4 mode needs a finite positive scale, got " + std::to_string(a.fc2_input_scale));
    // A4 is the W4A4 numerics of NVFP4 checkpoints; MXFP4 checkpoints (gpt-oss) carry no activation scales.
    const bool mx = w.format == WeightFormat::MXFP4 ||
                    (a.shared_expert && a.shared_expert->valid() && a.shared_expert->impl().format == WeightFormat::MXFP4);
    if (mx) throw Error(ErrorCode::Unsupported, "mode", "A4 takes NVFP4 or bf16 weights; MXFP4 weights run in A16");
  }

  // Shared expert.
  if (a.shared_expert) {
    if (!a.shared_expert->valid()) invalid("shared_expert", "not prepared");
    const PreparedWeights& se = a.shared_expert->impl();
    if (se.backend != dev || se.device_id != dev_id) invalid("shared_expert", "lives on another backend or device than the weights");
    if (se.E != 1) invalid("shared_expert", "expected one expert, got " + std::to_string(se.E));
    if (se.H != s.H) invalid("shared_expert", "hidden size " + std::to_string(se.H) + " differs from the layer's " + std::to_string(s.H));
    if (se.gated != w.gated) invalid("shared_expert", "gated-ness differs from the routed experts'");
    if (a.shared_params_given) {
      // Each parameter named for itself: finite (and > 0 for Situ); the clamp >= 0 (0 = none) or +inf.
      if (!std::isfinite(a.shared_alpha) || (situ && a.shared_alpha <= 0.f))
        invalid("shared_alpha", "expected a finite value (> 0 for Situ), got " + std::to_string(a.shared_alpha));
      if (!std::isfinite(a.shared_beta) || (situ && a.shared_beta <= 0.f))
        invalid("shared_beta", "expected a finite value (> 0 for Situ), got " + std::to_string(a.shared_beta));
      if (std::isnan(a.shared_clamp_limit) || a.shared_clamp_limit < 0.f)
        invalid("shared_clamp_limit", "expected >= 0 (0 = none) or +inf, got " + std::to_string(a.shared_clamp_limit));
    }
  }

  validate_shared_gate(a, s.H, dev, dev_id);

  // LoRA.
  if (a.adapter_ids.present() && !a.adapters) invalid("adapter_ids", "given without an adapter registry (adapters)");
  if (a.adapters) {
    if (a.adapters->backend() != dev) invalid("adapters", "registry lives on another backend than the weights");
    // Slots hold matrices laid out for the registry's own weights (half order, experts): any other weights are
    // refused, even of the same shape.
    if (!a.adapters->made_for(weights))
      invalid("adapters", "was made for other weights; a registry belongs to the MoeWeights it was constructed with "
                          "(make one per layer, and per TP/EP shard)");
    if (a.shared_expert && a.adapters->shared_expert() && !a.adapters->shared_expert()->same_as(*a.shared_expert))
      invalid("adapters", "was made with another shared expert than the call's shared_expert");
    expect(a.adapter_ids, "adapter_ids", DType::I32, {s.T}, dev, dev_id);
    // Every loaded slot must fit this layer and the call's shared expert (a registry made with none may still meet one).
    for (size_t i = 0; i < adapters->size(); ++i) {
      const PreparedAdapter* ad = (*adapters)[i].get();
      if (!ad) continue;
      const std::string slot = "slot " + std::to_string(i);
      if (ad->E != s.E_loc || ad->H != s.H || ad->I != s.I || ad->N1 != s.N1)
        invalid("adapters", slot + " was prepared for another layer shape");
      if (ad->has_shared && a.shared_expert &&
          (ad->s_I != a.shared_expert->impl().I || ad->s_N1 != a.shared_expert->impl().n1()))
        invalid("adapters", slot + ": its shared-expert LoRA does not match the shared expert");
    }
    if (dev == Backend::CPU) {
      const int32_t* ids = a.adapter_ids.as<int32_t>();
      const int64_t slots = static_cast<int64_t>(adapters->size());
      for (int64_t t = 0; t < s.T; ++t) {
        const int32_t id = ids[t];
        if (id < -1 || id >= slots)
          invalid("adapter_ids", "element " + std::to_string(t) + " is " + std::to_string(id) + ", expected -1 or a slot in [0, " +
                                  std::to_string(slots) + ")");
        if (id >= 0 && !(*adapters)[id])
          throw Error(ErrorCode::NotFound, "adapter_ids", "element " + std::to_string(t) + " names slot " + std::to_string(id) +
                                                              ", which holds no adapter");
      }
    }
  }

  // Bridges.
  expect_optional(a.gate_up_lora_delta, "gate_up_lora_delta", DType::BF16, {s.T, s.k, s.N1}, dev, dev_id);
  expect_optional(a.activation_out, "activation_out", DType::BF16, {s.T, s.k, s.I}, dev, dev_id);
  if (overlaps(a.activation_out, a.y)) invalid("activation_out", "overlaps y");
  if (overlaps(a.activation_out, a.x)) invalid("activation_out", "overlaps x");

  // Backend-specific.
  if (a.precision != Precision::Fp32 && a.precision != Precision::Fp64) invalid("precision", "expected Fp32 or Fp64");
  if (a.precision == Precision::Fp64 && dev != Backend::CPU) invalid("precision", "Fp64 is a CPU-reference mode");
  if (a.num_threads < 0) invalid("num_threads", "must be >= 0");
  // Any backend: a tile index out of range is a bad argument (the CPU reference has no tiles and ignores a valid
  // one; whether the device runs the wgmma tile is the CUDA plan's check).
  check_gemm_tile(static_cast<int>(a.gemm_tile));
  if (a.workspace_budget < 0) invalid("workspace_budget", "expected >= 0 bytes (0 = the default)");
  if (a.workspace.present()) {
    if (dev != Backend::CUDA) invalid("workspace", "only the CUDA backend takes a workspace");
    if (a.workspace.dtype != DType::U8 || a.workspace.ndim != 1) invalid("workspace", "expected a 1-D uint8 tensor, got " + a.workspace.shape_str());
    if (a.workspace.device != Backend::CUDA || a.workspace.device_id != dev_id) invalid("workspace", "must be on the weights' device");
  }
  return s;
}

}  // namespace fp4moe
