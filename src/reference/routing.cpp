// Routing (SPEC §3.1) for host tensors: every RoutingMethod, fp32 math, ties to the lower expert id.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "reference/reference.h"
#include "runtime/host_tensor.h"

namespace fp4moe::reference {
using detail::invalid;
namespace {

float sigmoidf(float v) { return 1.f / (1.f + std::exp(-v)); }

// Element (i, j) of a 1-D or 2-D f32/bf16 host view, read through its strides.
float read_f(const TensorView& v, int64_t i, int64_t j) {
  const int64_t off = v.ndim == 1 ? i * v.stride[0] : i * v.stride[0] + j * v.stride[1];
  if (v.dtype == DType::F32) return v.as<const float>()[off];
  return bf16_bits_to_f32(v.as<const uint16_t>()[off]);
}

// "a ranks before b": higher score first; NaN ranks below every number; ties go to the lower id.
// This is a strict weak order, so the selection is deterministic whatever the values.
bool ranks_before(float sa, int64_t ia, float sb, int64_t ib) {
  const bool na = std::isnan(sa), nb = std::isnan(sb);
  if (na != nb) return nb;
  if (!na && sa != sb) return sa > sb;
  return ia < ib;
}

// The k best of `score` among the ids in `cand` (ascending), written in rank order.
void top_k(const std::vector<float>& score, std::vector<int32_t>& cand, int64_t k, int32_t* out) {
  std::partial_sort(cand.begin(), cand.begin() + k, cand.end(),
                    [&](int32_t a, int32_t b) { return ranks_before(score[a], a, score[b], b); });
  std::copy(cand.begin(), cand.begin() + k, out);
}

void check_view2(const TensorView& v, const char* name, int64_t T, int64_t n, std::initializer_list<DType> dt) {
  if (!v.present()) invalid(name, "is required but absent");
  if (v.device != Backend::CPU) invalid(name, "the reference reads host tensors only");
  if (std::find(dt.begin(), dt.end(), v.dtype) == dt.end()) invalid(name, std::string("unexpected dtype ") + to_string(v.dtype));
  if (v.ndim != 2 || v.shape[0] != T || v.shape[1] != n)
    invalid(name, "expected shape [" + std::to_string(T) + ", " + std::to_string(n) + "], got " + v.shape_str());
}

}  // namespace

void route(const RoutingArgs& r, int64_t T, int64_t E, int32_t* ids, float* weights) {
  const int64_t k = r.top_k;
  if (T < 0) invalid("T", "negative token count");
  if (E < 1) invalid("num_experts_total", "expected >= 1, got " + std::to_string(E));
  if (k < 1 || k > E) invalid("routing.top_k", "expected 1 <= top_k <= " + std::to_string(E) + ", got " + std::to_string(k));
  if (T > 0 && (!ids || !weights)) invalid("topk_ids_out", "output pointers are null");

  // Precomputed routing passes through unchanged.
  if (!r.logits.present()) {
    check_view2(r.topk_ids, "routing.topk_ids", T, k, {DType::I32});
    check_view2(r.topk_weights, "routing.topk_weights", T, k, {DType::F32, DType::BF16});
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        ids[t * k + j] = r.topk_ids.as<const int32_t>()[t * r.topk_ids.stride[0] + j * r.topk_ids.stride[1]];
        weights[t * k + j] = read_f(r.topk_weights, t, j);
      }
    return;
  }

  check_view2(r.logits, "routing.logits", T, E, {DType::F32, DType::BF16});
  const bool uses_bias = r.method == RoutingMethod::DeepSeekV3 || r.method == RoutingMethod::MiniMax2;
  if (r.bias.present()) {
    if (r.bias.device != Backend::CPU) invalid("routing.bias", "the reference reads host tensors only");
    if (r.bias.ndim != 1 || r.bias.shape[0] != E || (r.bias.dtype != DType::F32 && r.bias.dtype != DType::BF16))
      invalid("routing.bias", "expected float32 [" + std::to_string(E) + "], got " + r.bias.shape_str());
  }
  if (r.method == RoutingMethod::Llama4 && k != 1) invalid("routing.top_k", "Llama4 routing takes top_k = 1");
  const bool grouped = r.method == RoutingMethod::DeepSeekV3 && r.n_group > 1;
  if (grouped) {
    if (E % r.n_group != 0) invalid("routing.n_group", "must divide the number of experts");
    if (r.topk_group < 1 || r.topk_group > r.n_group) invalid("routing.topk_group", "expected 1 <= topk_group <= n_group");
    if (k > r.topk_group * (E / r.n_group)) invalid("routing.top_k", "top_k exceeds the experts in the kept groups");
  }
  const float rsf = r.routed_scaling_factor;

  std::vector<float> l(E), s(E), sel(E);
  std::vector<int32_t> cand;
  for (int64_t t = 0; t < T; ++t) {
    int32_t* id = ids + t * k;
    float* w = weights + t * k;
    for (int64_t e = 0; e < E; ++e) l[e] = read_f(r.logits, t, e);
    cand.resize(E);
    std::iota(cand.begin(), cand.end(), 0);

    switch (r.method) {
      case RoutingMethod::Default:
      case RoutingMethod::RenormalizeNaive: {
        // Softmax over all E: max, exp(l - max) in index order, sum in index order, divide.
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t e = 0; e < E; ++e) m = std::max(m, l[e]);
        float sum = 0.f;
        for (int64_t e = 0; e < E; ++e) { s[e] = std::exp(l[e] - m); sum += s[e]; }
        for (int64_t e = 0; e < E; ++e) s[e] = s[e] / sum;
        top_k(s, cand, k, id);
        if (r.method == RoutingMethod::Default) {
          for (int64_t j = 0; j < k; ++j) w[j] = s[id[j]];
        } else {
          float cs = 0.f;
          for (int64_t j = 0; j < k; ++j) cs += s[id[j]];
          for (int64_t j = 0; j < k; ++j) w[j] = s[id[j]] / cs;
        }
        break;
      }
      case RoutingMethod::Renormalize: {
        top_k(l, cand, k, id);
        // Softmax over the chosen k (slot order): the max is the first slot's logit.
        float m = l[id[0]], sum = 0.f;
        for (int64_t j = 0; j < k; ++j) { w[j] = std::exp(l[id[j]] - m); sum += w[j]; }
        for (int64_t j = 0; j < k; ++j) w[j] = w[j] / sum;
        break;
      }
      case RoutingMethod::TopK:
        top_k(l, cand, k, id);
        for (int64_t j = 0; j < k; ++j) w[j] = l[id[j]];
        break;
      case RoutingMethod::Llama4:
      case RoutingMethod::TopKSigmoid:
        top_k(l, cand, k, id);
        for (int64_t j = 0; j < k; ++j) w[j] = sigmoidf(l[id[j]]);
        break;
      case RoutingMethod::Sigmoid:
      case RoutingMethod::SigmoidRenorm: {
        for (int64_t e = 0; e < E; ++e) s[e] = sigmoidf(l[e]);
        top_k(s, cand, k, id);
        if (r.method == RoutingMethod::Sigmoid) {
          for (int64_t j = 0; j < k; ++j) w[j] = s[id[j]];
        } else {
          float cs = 0.f;
          for (int64_t j = 0; j < k; ++j) cs += s[id[j]];
          for (int64_t j = 0; j < k; ++j) w[j] = s[id[j]] / (cs + 1e-20f);
        }
        break;
      }
      case RoutingMethod::DeepSeekV3:
      case RoutingMethod::MiniMax2: {
        for (int64_t e = 0; e < E; ++e) {
          s[e] = sigmoidf(l[e]);
          sel[e] = s[e] + ((uses_bias && r.bias.present()) ? read_f(r.bias, e, 0) : 0.f);
        }
        if (grouped) {
          // Group score = the sum of its two largest biased scores; keep the best topk_group groups.
          const int64_t G = r.n_group, gs = E / G;
          std::vector<float> gscore(G);
          std::vector<int32_t> members(gs), gcand(G), kept(r.topk_group);
          for (int64_t g = 0; g < G; ++g) {
            std::iota(members.begin(), members.end(), static_cast<int32_t>(g * gs));
            int32_t best2[2];
            top_k(sel, members, 2, best2);
            gscore[g] = sel[best2[0]] + sel[best2[1]];
          }
          std::iota(gcand.begin(), gcand.end(), 0);
          top_k(gscore, gcand, r.topk_group, kept.data());
          std::sort(kept.begin(), kept.end());
          cand.clear();
          for (int32_t g : kept)
            for (int64_t e = g * gs; e < (g + 1) * gs; ++e) cand.push_back(static_cast<int32_t>(e));
        }
        top_k(sel, cand, k, id);
        float cs = 0.f;
        for (int64_t j = 0; j < k; ++j) cs += s[id[j]];
        if (r.method == RoutingMethod::DeepSeekV3) {
          for (int64_t j = 0; j < k; ++j) w[j] = s[id[j]] * rsf / (cs + 1e-20f);
        } else {
          for (int64_t j = 0; j < k; ++j) w[j] = s[id[j]] / (cs + 1e-20f) * rsf;
        }
        break;
      }
      default:
        invalid("routing.method", "unknown routing method " + std::to_string(static_cast<int>(r.method)));
    }
  }
}

}  // namespace fp4moe::reference
