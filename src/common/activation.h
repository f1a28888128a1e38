// Activations of SPEC §3.2 as small functors shared by the CPU reference and the CUDA epilogue.
// Inputs are real-valued (each half already scaled); T is float (kernels, reference Fp32) or double.
#pragma once
#include <cmath>

#include "common/host_device.h"
#include "fp4moe/types.h"

namespace fp4moe::act {

// Per-expert parameters after defaults are applied (resolve_params).
struct Params {
  float alpha = 1.f, beta = 0.f;
  float limit = 0.f;      // clamp limit L
  bool has_limit = false;
};

// Defaults of SPEC §3.2 for parameters the caller did not give (given_* false).
inline Params resolve_params(ActivationType t, bool given_alpha, float alpha, bool given_beta, float beta,
                             bool given_limit, float limit) {
  Params p;
  switch (t) {
    case ActivationType::SwigluBias: p.alpha = 1.702f; p.beta = 1.f; p.limit = 7.f; p.has_limit = true; break;
    case ActivationType::SwigluStep: p.limit = 7.f; p.has_limit = true; break;
    case ActivationType::Situ: p.alpha = 1.f; p.beta = 1.f; break;
    default: break;
  }
  if (given_alpha) p.alpha = alpha;
  if (given_beta) p.beta = beta;
  if (given_limit) { p.limit = limit; p.has_limit = std::isfinite(limit); }
  return p;
}

// Precision-explicit math: float calls the float functions, double the double ones.
FP4MOE_HD float exp_(float v) { return expf(v); }
FP4MOE_HD double exp_(double v) { return ::exp(v); }
FP4MOE_HD float erf_(float v) { return erff(v); }
FP4MOE_HD double erf_(double v) { return ::erf(v); }
FP4MOE_HD float tanh_(float v) { return tanhf(v); }
FP4MOE_HD double tanh_(double v) { return ::tanh(v); }

template <class T> FP4MOE_HD T sigmoid(T v) { return T(1) / (T(1) + exp_(-v)); }
template <class T> FP4MOE_HD T silu(T v) { return v * sigmoid(v); }
template <class T> FP4MOE_HD T gelu_erf(T v) { return T(0.5) * v * (T(1) + erf_(v * T(0.70710678118654752440))); }
template <class T> FP4MOE_HD T gelu_tanh(T v) {
  return T(0.5) * v * (T(1) + tanh_(T(0.79788456080286535588) * (v + T(0.044715) * v * v * v)));
}
// NaN-propagating min/max (fminf/fmaxf would drop a NaN input: SPEC §6 wants NaN to reach the output).
template <class T> FP4MOE_HD T min_(T a, T b) { return (a < b || a != a) ? a : b; }
template <class T> FP4MOE_HD T max_(T a, T b) { return (a > b || a != a) ? a : b; }
template <class T> FP4MOE_HD T clampv(T v, T lo, T hi) { return min_(max_(v, lo), hi); }

struct Gelu { template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { return gelu_erf(h); } };
struct Relu { template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { return max_(h, T(0)); } };
struct Silu { template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { return silu(h); } };
struct Relu2 {
  template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { T r = max_(h, T(0)); return r * r; }
};
struct Identity { template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { return h; } };
// Swiglu and SwigluBias: g*sigmoid(alpha g)*(u+beta), clamped first when a limit is set.
struct Swiglu {
  template <class T> FP4MOE_HD static T apply(T g, T u, const Params& p) {
    if (p.has_limit) { g = min_(g, T(p.limit)); u = clampv(u, T(-p.limit), T(p.limit)); }
    return g * sigmoid(T(p.alpha) * g) * (u + T(p.beta));
  }
};
struct Geglu { template <class T> FP4MOE_HD static T apply(T g, T u, const Params&) { return gelu_erf(g) * u; } };
struct GegluTanh { template <class T> FP4MOE_HD static T apply(T g, T u, const Params&) { return gelu_tanh(g) * u; } };
struct SwigluStep {
  template <class T> FP4MOE_HD static T apply(T g, T u, const Params& p) {
    T L = T(p.limit);
    return min_(silu(g), L) * clampv(u, -L, L);
  }
};
// SiTU (Kimi-K3): [alpha tanh(g/alpha) sigmoid(g)] * [beta tanh(u/beta)], optional clamp as Swiglu.
struct Situ {
  template <class T> FP4MOE_HD static T apply(T g, T u, const Params& p) {
    if (p.has_limit) { g = min_(g, T(p.limit)); u = clampv(u, T(-p.limit), T(p.limit)); }
    T a = T(p.alpha), b = T(p.beta);
    return (a * tanh_(g / a) * sigmoid(g)) * (b * tanh_(u / b));
  }
};

// Calls f.template operator()<Functor>() for the activation t (one switch, shared by all callers).
template <class F> FP4MOE_HD auto dispatch(ActivationType t, F&& f) {
  switch (t) {
    case ActivationType::Gelu: return f(Gelu{});
    case ActivationType::Relu: return f(Relu{});
    case ActivationType::Silu: return f(Silu{});
    case ActivationType::Swiglu: return f(Swiglu{});
    case ActivationType::Geglu: return f(Geglu{});
    case ActivationType::SwigluBias: return f(Swiglu{});
    case ActivationType::Relu2: return f(Relu2{});
    case ActivationType::SwigluStep: return f(SwigluStep{});
    case ActivationType::GegluTanh: return f(GegluTanh{});
    case ActivationType::Identity: return f(Identity{});
    case ActivationType::Situ: default: return f(Situ{});
  }
}

// Scalar entry point (host): a = act(g, u) for gated, act(h) for non-gated (u ignored).
template <class T> inline T apply(ActivationType t, T g, T u, const Params& p) {
  return dispatch(t, [&](auto fn) { return decltype(fn)::apply(g, u, p); });
}

}  // namespace fp4moe::act
