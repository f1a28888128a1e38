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
template <class T> FP4MOE_HD T gelu_erf(T v) { return T(0.5) * v * (T(1) + erf_(v * T(0.70710678118654752440))); }
template <class T> FP4MOE_HD T gelu_tanh(T v) {
  return T(0.5) * v * (T(1) + tanh_(T(0.79788456080286535588) * (v + T(0.044715) * v * v * v)));
}
// NaN-propagating min/max (fminf/fmaxf would drop a NaN input: SPEC §6 wants NaN to reach the output).
template <class T> FP4MOE_HD T min_(T a, T b) { return (a < b || a != a) ? a : b; }
template <class T> FP4MOE_HD T max_(T a, T b) { return (a > b || a != a) ? a : b; }
template <class T> FP4MOE_HD T clampv(T v, T lo, T hi) { return min_(max_(v, lo), hi); }

// SiTU's float math without branches. In the GEMM1 epilogue the library tanhf / expf / IEEE division each
// branch (range cases, the division's slow path), so the compiler runs a thread's activations one after the
// other; SiTU (two tanh, three divisions) then cost 3.6-4.2 % of kimi_k3_tp8 at T = 64 and 1024 over SwiGLU on
// the H200. These forms are within ~2e-6 relative of the exact
// functions (tests/cpp/test_activation.cpp, SituFastFloatMath: against double), far below the bf16 rounding of a.
// double (the oracle) keeps the library functions.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float exp_fast(float v) { return __expf(v); }
__device__ __forceinline__ float div_fast(float a, float b) { return __fdividef(a, b); }  // 0 for |b| > 2^126
#else
inline float exp_fast(float v) { return std::exp(v); }
inline float div_fast(float a, float b) { return a / b; }
#endif
// tanh: an odd Taylor polynomial below 1/8 (relative error < 2e-9), 1 - 2 / (e^{2|v|} + 1) above (no
// cancellation worse than 7x there), the sign put back; NaN stays NaN, +-inf gives +-1.
FP4MOE_HD float tanh_fast(float v) {
  const float av = fabsf(v), s = av * av;
  const float poly = av * (1.f + s * (-1.f / 3.f + s * (2.f / 15.f + s * (-17.f / 315.f))));
  const float big = 1.f - div_fast(2.f, exp_fast(2.f * av) + 1.f);
  return copysignf(av < 0.125f ? poly : big, v);
}
FP4MOE_HD double tanh_fast(double v) { return ::tanh(v); }
FP4MOE_HD float sigmoid_fast(float v) { return div_fast(1.f, 1.f + exp_fast(-v)); }
FP4MOE_HD double sigmoid_fast(double v) { return sigmoid(v); }
FP4MOE_HD double div_fast(double a, double b) { return a / b; }

// ---- bit-identical float math on the host and the device --------------------------------------------------
// One IEEE fp32 operation, rounded on its own: never fused into an FMA (nvcc fuses a*b+c by default; a host compiler
// may too) nor replaced by an approximation, so a formula written with these gives the same bits on both sides.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float pow2_bits(int n) { return __int_as_float((n + 127) << 23); }
#else
inline float mul_rn(float a, float b) {
  volatile float p = a * b;  // stored, so no later add can contract with it
  return p;
}
inline float add_rn(float a, float b) { return a + b; }
inline float div_rn(float a, float b) { return a / b; }
inline float pow2_bits(int n) {
  const uint32_t u = static_cast<uint32_t>(n + 127) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#endif

// e^v from mul_rn / add_rn only (no library exp, whose last bit differs between glibc and CUDA): Cody-Waite
// reduction v = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial in Horner form, scaled by 2^n in two
// exact steps. Within 4e-7 relative of e^v (tests/cpp/test_activation.cpp); 0 below e^-88, +inf from e^89.
FP4MOE_HD float exp_ieee(float v) {
  if (v != v) return v;
  if (v >= 89.f) return INFINITY;
  if (v <= -88.f) return 0.f;
  const float n = floorf(add_rn(mul_rn(v, 0x1.715476p+0f), 0.5f));  // round(v / ln2)
  // ln2 = hi + lo, hi with 17 significant bits: n * hi is exact for |n| <= 128.
  const float r = add_rn(add_rn(v, -mul_rn(n, 0x1.62e4p-1f)), -mul_rn(n, 0x1.7f7d1cp-20f));
  float p = 0x1.a01a02p-13f;  // 1/7!, 1/6!, ..., 1/2!, 1, 1
  p = add_rn(mul_rn(p, r), 0x1.6c16c2p-10f);
  p = add_rn(mul_rn(p, r), 0x1.111112p-7f);
  p = add_rn(mul_rn(p, r), 0x1.555556p-5f);
  p = add_rn(mul_rn(p, r), 0x1.555556p-3f);
  p = add_rn(mul_rn(p, r), 0.5f);
  p = add_rn(mul_rn(p, r), 1.f);
  p = add_rn(mul_rn(p, r), 1.f);
  const int ni = static_cast<int>(n), half = ni / 2;  // n in [-127, 128]: both factors are normal floats
  return mul_rn(mul_rn(p, pow2_bits(half)), pow2_bits(ni - half));
}
// sigmoid(v) = 1 / (1 + e^-v) with exp_ieee and IEEE division: the same bits on the host and the device.
FP4MOE_HD float sigmoid_ieee(float v) { return div_rn(1.f, add_rn(1.f, exp_ieee(-v))); }

struct Gelu { template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { return gelu_erf(h); } };
struct Relu { template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { return max_(h, T(0)); } };
struct Silu { template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { return h * sigmoid_fast(h); } };
struct Relu2 {
  template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { T r = max_(h, T(0)); return r * r; }
};
struct Identity { template <class T> FP4MOE_HD static T apply(T h, T, const Params&) { return h; } };
// Swiglu and SwigluBias: g*sigmoid(alpha g)*(u+beta), clamped first when a limit is set. The sigmoids of Silu,
// Swiglu and SwigluStep take the branch-free float form (as SiTU, above): the same values on the host.
struct Swiglu {
  template <class T> FP4MOE_HD static T apply(T g, T u, const Params& p) {
    if (p.has_limit) { g = min_(g, T(p.limit)); u = clampv(u, T(-p.limit), T(p.limit)); }
    return g * sigmoid_fast(T(p.alpha) * g) * (u + T(p.beta));
  }
};
struct Geglu { template <class T> FP4MOE_HD static T apply(T g, T u, const Params&) { return gelu_erf(g) * u; } };
struct GegluTanh { template <class T> FP4MOE_HD static T apply(T g, T u, const Params&) { return gelu_tanh(g) * u; } };
struct SwigluStep {
  template <class T> FP4MOE_HD static T apply(T g, T u, const Params& p) {
    T L = T(p.limit);
    return min_(g * sigmoid_fast(g), L) * clampv(u, -L, L);
  }
};
// SiTU (Kimi-K3): [alpha tanh(g/alpha) sigmoid(g)] * [beta tanh(u/beta)], optional clamp as Swiglu.
struct Situ {
  template <class T> FP4MOE_HD static T apply(T g, T u, const Params& p) {
    if (p.has_limit) { g = min_(g, T(p.limit)); u = clampv(u, T(-p.limit), T(p.limit)); }
    T a = T(p.alpha), b = T(p.beta);
    return (a * tanh_fast(div_fast(g, a)) * sigmoid_fast(g)) * (b * tanh_fast(div_fast(u, b)));
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
