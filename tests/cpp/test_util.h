// Shared helpers for the C++ tests: a fast seeded RNG, random bf16 / NVFP4 expert weights with
// owned storage (-> WeightsDesc), NVFP4 and E4M3 codecs written independently of src/format/ (so
// tests of the library do not check it against itself), a double-precision routing oracle,
// reference activations in double, and comparisons.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "fp4moe/moe.h"
#include "fp4moe/types.h"

namespace fp4moe::testutil {

// ---- random numbers --------------------------------------------------------------------------
// splitmix64: fast, deterministic across platforms (std:: distributions are not).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  float uniform(float lo, float hi) { return lo + static_cast<float>(uniform()) * (hi - lo); }
  // Approximately normal (sum of 4 uniforms, variance 1): cheap and deterministic.
  float normal() {
    double a = 0;
    for (int i = 0; i < 4; ++i) a += uniform();
    return static_cast<float>((a - 2.0) * std::sqrt(3.0));
  }
};

inline std::vector<uint16_t> random_bf16_vec(int64_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Rng r(seed);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& b : v) b = f32_to_bf16_bits(r.uniform(lo, hi));
  return v;
}
inline std::vector<float> random_f32_vec(int64_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Rng r(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& f : v) f = r.uniform(lo, hi);
  return v;
}

// ---- independent NVFP4 codecs (SPEC §2) -------------------------------------------------------
inline double e2m1_value(uint8_t code) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (code & 8) ? -mag[code & 7] : mag[code & 7];
}
// float8_e4m3fn: bias 7, 3 mantissa bits, subnormals, no infinities, S.1111.111 is NaN.
inline double e4m3_value(uint8_t code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}
// Nearest representable magnitude among the sorted non-negative `vals` (code = index), ties to the
// even code (the mantissa's last bit), saturating at the largest. Brute force on purpose.
inline int nearest_code(double a, const std::vector<double>& vals) {
  if (a >= vals.back()) return static_cast<int>(vals.size()) - 1;
  int best = 0;
  for (int c = 1; c < static_cast<int>(vals.size()); ++c) {
    const double dc = std::fabs(vals[c] - a), db = std::fabs(vals[best] - a);
    if (dc < db || (dc == db && (c % 2 == 0) && (best % 2 == 1))) best = c;
  }
  return best;
}
inline uint8_t e2m1_encode_ref(float x) {
  static const std::vector<double> vals = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  const int c = nearest_code(std::fabs(static_cast<double>(x)), vals);
  return static_cast<uint8_t>(c | (std::signbit(x) ? 8 : 0));
}
inline uint8_t e4m3_encode_ref(float x) {  // x >= 0 here (block scales)
  static const std::vector<double> vals = [] {
    std::vector<double> v;
    for (int c = 0; c < 127; ++c) v.push_back(e4m3_value(static_cast<uint8_t>(c)));
    return v;
  }();
  return static_cast<uint8_t>(nearest_code(static_cast<double>(x), vals));
}
// Quantize one row with encode scale gs and return the unscaled values e2m1*e4m3 (finite input).
inline std::vector<double> nvfp4_fake_quant_ref(const float* x, int64_t K, float gs) {
  std::vector<double> out(static_cast<size_t>(K));
  for (int64_t b = 0; b < K; b += 16) {
    float amax = 0;
    for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[b + i]));
    const uint8_t sfc = e4m3_encode_ref(gs * amax / 6.0f);
    const float sf = static_cast<float>(e4m3_value(sfc));
    for (int i = 0; i < 16; ++i)
      out[b + i] = sf == 0.f ? 0.0 : e2m1_value(e2m1_encode_ref(x[b + i] * gs / sf)) * sf;
  }
  return out;
}

// ---- random expert weights ----------------------------------------------------------------------
// Owned storage for E experts of one layer, with the WeightsDesc that views it. Values are sized
// so that h = x.W1^T and o = a.W2^T are O(1) for x ~ U(-1, 1). The two W1 halves get different
// global scales (per-half dequantization is then visible in the output).
struct HostWeights {
  WeightFormat format = WeightFormat::NVFP4;
  GateUpOrder order = GateUpOrder::GateFirst;
  bool gated = true;
  int64_t E = 0, H = 0, I = 0;
  std::vector<uint8_t> w1_q, w1_sf, w2_q, w2_sf;
  std::vector<float> w1_s2, w2_s2;  // [E, 2] (gated) or [E]; [E]
  std::vector<uint16_t> w1_bf, w2_bf;
  std::vector<float> bias1, bias2;
  int64_t n1() const { return gated ? 2 * I : I; }

  // Exact real value of W1[e][n][k] / W2[e][h][i], global scales included, in double.
  double w1(int64_t e, int64_t n, int64_t k) const {
    if (format == WeightFormat::BF16) return bf16_bits_to_f32(w1_bf[(e * n1() + n) * H + k]);
    const int64_t row = e * n1() + n;
    const uint8_t byte = w1_q[row * (H / 2) + k / 2];
    const double s2 = format == WeightFormat::MXFP4 ? 1.0 : gated ? w1_s2[e * 2 + (n >= I ? 1 : 0)] : w1_s2[e];
    return e2m1_value((k & 1) ? byte >> 4 : byte & 15) * scale_value(w1_sf[row * (H / block()) + k / block()], block()) * s2;
  }
  double w2(int64_t e, int64_t h, int64_t i) const {
    if (format == WeightFormat::BF16) return bf16_bits_to_f32(w2_bf[(e * H + h) * I + i]);
    const int64_t row = e * H + h;
    const uint8_t byte = w2_q[row * (I / 2) + i / 2];
    const double s2 = format == WeightFormat::MXFP4 ? 1.0 : w2_s2[e];
    return e2m1_value((i & 1) ? byte >> 4 : byte & 15) * scale_value(w2_sf[row * (I / block()) + i / block()], block()) * s2;
  }
  // Elements a block scale: 16 (NVFP4, E4M3) or 32 (MXFP4, E8M0).
  int64_t block() const { return format == WeightFormat::MXFP4 ? 32 : 16; }
  // Rows of W1 / W2 of expert e in double (for dense oracles that walk a matrix row by row).
  // (e2m1 * e4m3 has at most 5 significant bits, e2m1 * 2^(e-127) 2, so the products below are exact in double.)
  void w1_row(int64_t e, int64_t n, double* out) const {
    if (format == WeightFormat::BF16) {
      for (int64_t k = 0; k < H; ++k) out[k] = bf16_bits_to_f32(w1_bf[(e * n1() + n) * H + k]);
      return;
    }
    const double s2 = format == WeightFormat::MXFP4 ? 1.0 : gated ? w1_s2[e * 2 + (n >= I ? 1 : 0)] : w1_s2[e];
    decode_fp4_row(w1_q.data() + (e * n1() + n) * (H / 2), w1_sf.data() + (e * n1() + n) * (H / block()), H, s2,
                   block(), out);
  }
  void w2_row(int64_t e, int64_t h, double* out) const {
    if (format == WeightFormat::BF16) {
      for (int64_t i = 0; i < I; ++i) out[i] = bf16_bits_to_f32(w2_bf[(e * H + h) * I + i]);
      return;
    }
    const double s2 = format == WeightFormat::MXFP4 ? 1.0 : w2_s2[e];
    decode_fp4_row(w2_q.data() + (e * H + h) * (I / 2), w2_sf.data() + (e * H + h) * (I / block()), I, s2, block(),
                   out);
  }
  // Block scale code c as a double: E4M3 (block 16) or E8M0 2^(c - 127) (block 32; 255 is NaN).
  static double scale_value(uint8_t c, int64_t block) {
    if (block == 16) return e4m3_value(c);
    return c == 255 ? std::nan("") : std::ldexp(1.0, int(c) - 127);
  }
  static void decode_fp4_row(const uint8_t* q, const uint8_t* sf, int64_t K, double s2, int64_t block, double* out) {
    for (int64_t b = 0; b < K / block; ++b) {
      const double sc = scale_value(sf[b], block) * s2;
      for (int64_t i = 0; i < block / 2; ++i) {
        const uint8_t byte = q[b * block / 2 + i];
        out[b * block + 2 * i] = e2m1_value(byte & 15) * sc;
        out[b * block + 2 * i + 1] = e2m1_value(byte >> 4) * sc;
      }
    }
  }

  WeightsDesc desc() {
    WeightsDesc d;
    d.format = format;
    d.order = order;
    d.gated = gated;
    d.num_experts = E;
    d.hidden = H;
    d.inter = I;
    const int64_t N1 = n1();
    if (format == WeightFormat::NVFP4) {
      d.w1 = make_view(w1_q.data(), DType::U8, {E, N1, H / 2});
      d.w1_scale = make_view(w1_sf.data(), DType::E4M3, {E, N1, H / 16});
      d.w1_scale2 = gated ? make_view(w1_s2.data(), DType::F32, {E, 2}) : make_view(w1_s2.data(), DType::F32, {E});
      d.w2 = make_view(w2_q.data(), DType::U8, {E, H, I / 2});
      d.w2_scale = make_view(w2_sf.data(), DType::E4M3, {E, H, I / 16});
      d.w2_scale2 = make_view(w2_s2.data(), DType::F32, {E});
    } else if (format == WeightFormat::MXFP4) {
      d.w1 = make_view(w1_q.data(), DType::U8, {E, N1, H / 2});
      d.w1_scale = make_view(w1_sf.data(), DType::U8, {E, N1, H / 32});
      d.w2 = make_view(w2_q.data(), DType::U8, {E, H, I / 2});
      d.w2_scale = make_view(w2_sf.data(), DType::U8, {E, H, I / 32});
    } else {
      d.w1 = make_view(w1_bf.data(), DType::BF16, {E, N1, H});
      d.w2 = make_view(w2_bf.data(), DType::BF16, {E, H, I});
    }
    if (!bias1.empty()) d.bias1 = make_view(bias1.data(), DType::F32, {E, N1});
    if (!bias2.empty()) d.bias2 = make_view(bias2.data(), DType::F32, {E, H});
    return d;
  }
};

// Random NVFP4 codes with block scales in [0.5, 2) (e4m3 codes 0x30..0x3f), global scales chosen so
// the values have rms ~ 1/sqrt(K); or random bf16 values of the same rms.
inline HostWeights make_weights(int64_t E, int64_t H, int64_t I, uint64_t seed,
                                WeightFormat format = WeightFormat::NVFP4,
                                GateUpOrder order = GateUpOrder::GateFirst, bool gated = true,
                                bool with_bias = false) {
  HostWeights w;
  w.format = format;
  w.order = order;
  w.gated = gated;
  w.E = E;
  w.H = H;
  w.I = I;
  const int64_t N1 = w.n1();
  Rng r(seed);
  auto fill_fp4 = [&](std::vector<uint8_t>& q, std::vector<uint8_t>& sf, int64_t rows, int64_t K) {
    q.resize(static_cast<size_t>(rows * K / 2));
    sf.resize(static_cast<size_t>(rows * K / 16));
    for (size_t i = 0; i < q.size(); i += 8) {
      uint64_t v = r.next();
      for (size_t b = 0; b < 8 && i + b < q.size(); ++b) q[i + b] = static_cast<uint8_t>(v >> (8 * b));
    }
    for (auto& s : sf) s = static_cast<uint8_t>(0x30 + (r.next() & 15));
  };
  // rms of a uniform E2M1 code is ~2.93, of a block scale in [0.5, 2) ~1.2.
  auto s2_for = [&](int64_t K) { return static_cast<float>(1.0 / (std::sqrt(double(K)) * 2.93 * 1.2)) * r.uniform(0.7f, 1.4f); };
  // MXFP4: no global scale; E8M0 scales 2^(e0 - 1 .. e0 + 1) around the rms above.
  auto fill_mx = [&](std::vector<uint8_t>& q, std::vector<uint8_t>& sf, int64_t rows, int64_t K) {
    fill_fp4(q, sf, rows, K);
    sf.resize(static_cast<size_t>(rows * K / 32));
    const int e0 = 127 + static_cast<int>(std::lround(std::log2(1.0 / (std::sqrt(double(K)) * 2.93 * 1.2))));
    for (auto& s : sf) s = static_cast<uint8_t>(e0 - 1 + static_cast<int>(r.next() % 3));
  };
  if (format == WeightFormat::MXFP4) {
    fill_mx(w.w1_q, w.w1_sf, E * N1, H);
    fill_mx(w.w2_q, w.w2_sf, E * H, I);
  } else if (format == WeightFormat::NVFP4) {
    fill_fp4(w.w1_q, w.w1_sf, E * N1, H);
    fill_fp4(w.w2_q, w.w2_sf, E * H, I);
    for (int64_t e = 0; e < E; ++e) {
      w.w1_s2.push_back(s2_for(H));
      if (gated) w.w1_s2.push_back(s2_for(H));
      w.w2_s2.push_back(s2_for(I));
    }
  } else {
    auto fill_bf = [&](std::vector<uint16_t>& v, int64_t n, int64_t K) {
      const float a = static_cast<float>(std::sqrt(3.0 / double(K)));
      v.resize(static_cast<size_t>(n));
      for (auto& b : v) b = f32_to_bf16_bits(r.uniform(-a, a));
    };
    fill_bf(w.w1_bf, E * N1 * H, H);
    fill_bf(w.w2_bf, E * H * I, I);
  }
  if (with_bias) {
    w.bias1.resize(static_cast<size_t>(E * N1));
    for (auto& b : w.bias1) b = r.uniform(-0.5f, 0.5f);
    w.bias2.resize(static_cast<size_t>(E * H));
    for (auto& b : w.bias2) b = r.uniform(-0.2f, 0.2f);
  }
  return w;
}

// ---- routing oracle in double (SPEC §3.1) ------------------------------------------------------
// Returns ids [T, k] and weights [T, k] in rank order (higher score first, ties to the lower id).
struct RoutingResult {
  std::vector<int32_t> ids;
  std::vector<double> w;
};
inline RoutingResult route_double(RoutingMethod m, const std::vector<double>& logits, int64_t T, int64_t E, int64_t k,
                                  const std::vector<double>& bias = {}, int64_t n_group = 1, int64_t topk_group = 1,
                                  double rsf = 1.0) {
  RoutingResult res;
  res.ids.resize(static_cast<size_t>(T * k));
  res.w.resize(static_cast<size_t>(T * k));
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  for (int64_t t = 0; t < T; ++t) {
    const double* l = logits.data() + t * E;
    std::vector<double> score(l, l + E), val(E);
    std::vector<bool> allowed(static_cast<size_t>(E), true);
    double mx = *std::max_element(l, l + E), z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - mx);
    for (int64_t e = 0; e < E; ++e) {
      const double p = std::exp(l[e] - mx) / z;
      switch (m) {
        case RoutingMethod::Default: case RoutingMethod::RenormalizeNaive: score[e] = val[e] = p; break;
        case RoutingMethod::Sigmoid: case RoutingMethod::SigmoidRenorm: score[e] = val[e] = sig(l[e]); break;
        case RoutingMethod::DeepSeekV3: case RoutingMethod::MiniMax2:
          val[e] = sig(l[e]);
          score[e] = val[e] + (bias.empty() ? 0.0 : bias[e]);
          break;
        default: score[e] = val[e] = l[e]; break;
      }
    }
    if (m == RoutingMethod::DeepSeekV3 && n_group > 1) {
      const int64_t gsz = E / n_group;
      std::vector<std::pair<double, int64_t>> gs;
      for (int64_t g = 0; g < n_group; ++g) {
        std::vector<double> v(score.begin() + g * gsz, score.begin() + (g + 1) * gsz);
        std::sort(v.rbegin(), v.rend());
        gs.push_back({-(v[0] + v[1]), g});  // sort ascending on the negated score, then the id
      }
      std::sort(gs.begin(), gs.end());
      std::fill(allowed.begin(), allowed.end(), false);
      for (int64_t i = 0; i < topk_group; ++i)
        for (int64_t e = gs[i].second * gsz; e < (gs[i].second + 1) * gsz; ++e) allowed[e] = true;
    }
    std::vector<int64_t> order;
    for (int64_t e = 0; e < E; ++e) if (allowed[e]) order.push_back(e);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[a] > score[b]; });
    double sum = 0, mk = val[order[0]], zk = 0;
    for (int64_t j = 0; j < k; ++j) { sum += val[order[j]]; zk += std::exp(val[order[j]] - mk); }
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[j];
      double w;
      switch (m) {
        case RoutingMethod::Default: case RoutingMethod::Sigmoid: case RoutingMethod::TopK: w = val[e]; break;
        case RoutingMethod::Renormalize: w = std::exp(val[e] - mk) / zk; break;
        case RoutingMethod::RenormalizeNaive: w = val[e] / sum; break;
        case RoutingMethod::SigmoidRenorm: w = val[e] / (sum + 1e-20); break;
        case RoutingMethod::DeepSeekV3: case RoutingMethod::MiniMax2: w = val[e] * rsf / (sum + 1e-20); break;
        default: w = sig(val[e]); break;  // Llama4, TopKSigmoid
      }
      res.ids[t * k + j] = static_cast<int32_t>(e);
      res.w[t * k + j] = w;
    }
  }
  return res;
}

// ---- activations in double (SPEC §3.2 step 3), written from the table -------------------------
struct ActParams {
  double alpha = 1, beta = 0, limit = 0;
  bool has_limit = false;
};
// The SPEC's defaults when the caller gives no parameters.
inline ActParams default_act_params(ActivationType t) {
  ActParams p;
  // The API carries parameters as float: GPT-OSS's 1.702 is float(1.702).
  if (t == ActivationType::SwigluBias) { p.alpha = static_cast<double>(1.702f); p.beta = 1; p.limit = 7; p.has_limit = true; }
  if (t == ActivationType::SwigluStep) { p.limit = 7; p.has_limit = true; }
  if (t == ActivationType::Situ) { p.alpha = 1; p.beta = 1; }
  return p;
}
inline double act_double(ActivationType t, double g, double u, const ActParams& p) {
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  auto gelu = [](double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); };
  auto gelu_t = [](double v) {
    return 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
  };
  switch (t) {
    case ActivationType::Gelu: return gelu(g);
    case ActivationType::Relu: return g > 0 ? g : 0;
    case ActivationType::Silu: return g * sig(g);
    case ActivationType::Relu2: return g > 0 ? g * g : 0;
    case ActivationType::Identity: return g;
    case ActivationType::Geglu: return gelu(g) * u;
    case ActivationType::GegluTanh: return gelu_t(g) * u;
    case ActivationType::SwigluStep: {
      const double L = p.limit;
      return std::min(g * sig(g), L) * std::clamp(u, -L, L);
    }
    case ActivationType::Swiglu: case ActivationType::SwigluBias:
      if (p.has_limit) { g = std::min(g, p.limit); u = std::clamp(u, -p.limit, p.limit); }
      return g * sig(p.alpha * g) * (u + p.beta);
    case ActivationType::Situ:
      if (p.has_limit) { g = std::min(g, p.limit); u = std::clamp(u, -p.limit, p.limit); }
      return p.alpha * std::tanh(g / p.alpha) * sig(g) * p.beta * std::tanh(u / p.beta);
  }
  return NAN;
}

// ---- comparisons ------------------------------------------------------------------------------
// ||a - ref|| / ||ref|| (L2); infinity when a holds a NaN.
inline double rel_l2(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i])) return std::numeric_limits<double>::infinity();
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}
inline std::vector<double> bf16_to_double(const std::vector<uint16_t>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = bf16_bits_to_f32(v[i]);
  return d;
}
constexpr uint16_t kBf16Poison = 0x7fc1;  // a NaN payload no computation produces
inline size_t count_poison(const std::vector<uint16_t>& v) {
  return static_cast<size_t>(std::count(v.begin(), v.end(), kBf16Poison));
}
inline size_t count_nonfinite(const std::vector<double>& v) {
  return static_cast<size_t>(std::count_if(v.begin(), v.end(), [](double d) { return !std::isfinite(d); }));
}

}  // namespace fp4moe::testutil
