#include "fp4moe/synthetic.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "fp4moe/mxfp4.h"
#include "fp4moe/nvfp4.h"

namespace fp4moe {
namespace {

// RMS of the 8 E2M1 magnitudes drawn uniformly: sqrt(68.5 / 8).
constexpr float kE2M1Rms = 2.9261f;

// Random NVFP4 rows: uniform codes (eight per 64-bit draw), block scales uniform over the 16 E4M3 codes in
// [0.5, 2) (0x30..0x3f), so the value rms is ~kE2M1Rms. Cheap on purpose: the full kimi_k3_tp8 layer is 0.8 GB.
void random_nvfp4(std::mt19937_64& rng, int64_t rows, int64_t K, std::vector<uint8_t>& q, std::vector<uint8_t>& sf) {
  q.resize(rows * K / 2);
  sf.resize(rows * K / 16);
  auto fill = [&](std::vector<uint8_t>& v, uint8_t mask, uint8_t base) {
    for (size_t i = 0; i < v.size(); i += 8) {
      uint64_t r = rng();
      for (size_t j = i; j < std::min(v.size(), i + 8); ++j, r >>= 8) v[j] = static_cast<uint8_t>(base | (r & mask));
    }
  };
  fill(q, 0xff, 0);
  fill(sf, 0x0f, 0x30);
}

// Random MXFP4 rows: uniform codes, E8M0 scales uniform over 2^-1, 1, 2 times the power of two nearest
// `magnitude` (MXFP4 has no global scale, so the block scales carry the layer's magnitude).
void random_mxfp4(std::mt19937_64& rng, int64_t rows, int64_t K, float magnitude, std::vector<uint8_t>& q,
                  std::vector<uint8_t>& sf) {
  q.resize(rows * K / 2);
  sf.resize(rows * K / mxfp4::kBlock);
  for (size_t i = 0; i < q.size(); i += 8) {
    uint64_t r = rng();
    for (size_t j = i; j < std::min(q.size(), i + 8); ++j, r >>= 8) q[j] = static_cast<uint8_t>(r);
  }
  const int e0 = 127 + static_cast<int>(std::lround(std::log2(magnitude)));
  std::uniform_int_distribution<int> step(-1, 1);
  for (auto& e : sf) e = static_cast<uint8_t>(e0 + step(rng));
}

// Random bf16 values with the given standard deviation: uniform on [-sqrt(3) sd, sqrt(3) sd] (same variance as
// a normal, and several times cheaper to draw; synthetic adapters hold ~10^8 values).
void random_bf16_matrix(std::mt19937_64& rng, int64_t n, float stddev, std::vector<uint16_t>& out) {
  out.resize(n);
  const float scale = stddev * 1.7320508f / 2147483648.f;  // int32 range -> [-sqrt(3) sd, sqrt(3) sd)
  for (int64_t i = 0; i < n; i += 2) {
    const uint64_t r = rng();
    out[i] = f32_to_bf16_bits(static_cast<float>(static_cast<int32_t>(r)) * scale);
    if (i + 1 < n) out[i + 1] = f32_to_bf16_bits(static_cast<float>(static_cast<int32_t>(r >> 32)) * scale);
  }
}

SyntheticLayer make_layer(int64_t E, int64_t H, int64_t I, bool gated, uint64_t seed, WeightFormat format,
                          bool with_bias, GateUpOrder order) {
  SyntheticLayer L;
  L.E = E; L.H = H; L.I = I; L.gated = gated; L.format = format; L.order = order;
  std::mt19937_64 rng(seed);
  const int64_t N1 = gated ? 2 * I : I;
  // Scale so that each W1 output and each W2 output has unit variance for unit-variance inputs.
  const float s1 = 1.f / (kE2M1Rms * std::sqrt(static_cast<float>(H)));
  const float s2 = 1.f / (kE2M1Rms * std::sqrt(static_cast<float>(I)));
  std::uniform_real_distribution<float> jitter(0.8f, 1.25f);
  if (format == WeightFormat::NVFP4) {
    random_nvfp4(rng, E * N1, H, L.w1, L.w1_sf);
    random_nvfp4(rng, E * H, I, L.w2, L.w2_sf);
    L.w1_s2.resize(E * 2);
    for (auto& v : L.w1_s2) v = s1 * jitter(rng);  // each half its own scale (SPEC §2)
    L.w2_s2.resize(E);
    for (auto& v : L.w2_s2) v = s2 * jitter(rng);
  } else if (format == WeightFormat::MXFP4) {
    random_mxfp4(rng, E * N1, H, s1, L.w1, L.w1_sf);
    random_mxfp4(rng, E * H, I, s2, L.w2, L.w2_sf);
  } else {
    random_bf16_matrix(rng, E * N1 * H, 1.f / std::sqrt(static_cast<float>(H)), L.w1_bf16);
    random_bf16_matrix(rng, E * H * I, 1.f / std::sqrt(static_cast<float>(I)), L.w2_bf16);
  }
  if (with_bias) {
    std::normal_distribution<float> nd(0.f, 0.1f);
    L.bias1.resize(E * N1);
    for (auto& v : L.bias1) v = nd(rng);
    L.bias2.resize(E * H);
    for (auto& v : L.bias2) v = nd(rng);
  }
  return L;
}

}  // namespace

WeightsDesc SyntheticLayer::desc() {
  WeightsDesc d;
  d.format = format;
  d.order = order;
  d.scale_layout = ScaleLayout::Linear;
  d.gated = gated;
  d.num_experts = E; d.hidden = H; d.inter = I;
  const int64_t N1 = gated ? 2 * I : I;
  if (format == WeightFormat::NVFP4) {
    d.w1 = make_view(w1.data(), DType::U8, {E, N1, H / 2});
    d.w1_scale = make_view(w1_sf.data(), DType::E4M3, {E, N1, H / 16});
    d.w1_scale2 = gated ? make_view(w1_s2.data(), DType::F32, {E, 2}) : make_view(w1_s2.data(), DType::F32, {E});
    d.w2 = make_view(w2.data(), DType::U8, {E, H, I / 2});
    d.w2_scale = make_view(w2_sf.data(), DType::E4M3, {E, H, I / 16});
    d.w2_scale2 = make_view(w2_s2.data(), DType::F32, {E});
  } else if (format == WeightFormat::MXFP4) {
    d.w1 = make_view(w1.data(), DType::U8, {E, N1, H / 2});
    d.w1_scale = make_view(w1_sf.data(), DType::U8, {E, N1, H / mxfp4::kBlock});
    d.w2 = make_view(w2.data(), DType::U8, {E, H, I / 2});
    d.w2_scale = make_view(w2_sf.data(), DType::U8, {E, H, I / mxfp4::kBlock});
  } else {
    d.w1 = make_view(w1_bf16.data(), DType::BF16, {E, N1, H});
    d.w2 = make_view(w2_bf16.data(), DType::BF16, {E, H, I});
  }
  if (!bias1.empty()) d.bias1 = make_view(bias1.data(), DType::F32, {E, N1});
  if (!bias2.empty()) d.bias2 = make_view(bias2.data(), DType::F32, {E, H});
  return d;
}

SyntheticLayer make_synthetic_layer(const ModelShape& shape, int64_t experts, uint64_t seed, WeightFormat format,
                                    bool with_bias, GateUpOrder order) {
  const int64_t E = experts > 0 ? experts : shape.E_loc;
  SyntheticLayer L = make_layer(E, shape.H, shape.I, is_gated(shape.activation), seed, format, with_bias, order);
  L.alpha.assign(E, shape.alpha);
  L.beta.assign(E, shape.beta);
  if (shape.clamp_limit > 0) L.clamp.assign(E, shape.clamp_limit);
  return L;
}

SyntheticLayer make_synthetic_shared_expert(const ModelShape& shape, int64_t I, uint64_t seed, WeightFormat format) {
  return make_layer(1, shape.H, I, is_gated(shape.activation), seed, format, false, GateUpOrder::GateFirst);
}

LoraAdapterDesc SyntheticAdapter::desc() {
  LoraAdapterDesc d;
  d.layout = layout;
  d.rank = rank;
  d.lora_alpha = lora_alpha;
  const int64_t r = rank;
  auto bf = [](std::vector<uint16_t>& v, std::initializer_list<int64_t> s) { return make_view(v.data(), DType::BF16, s); };
  switch (layout) {
    case LoraLayout::PerExpert:
      d.a_gate = bf(a_gate, {E, r, H});
      d.a_up = bf(a_up, {E, r, H});
      d.b_gate = bf(b_gate, {E, I, r});
      d.b_up = bf(b_up, {E, I, r});
      break;
    case LoraLayout::PeftFused:
      d.a_gate_up = bf(a_gate_up, {E, r, H});
      d.b_gate_up = bf(b_gate_up, {E, N1, r});
      break;
    case LoraLayout::SharedOuter:
      d.a_gate_up = bf(a_gate_up, {r, H});
      d.b_gate_up = bf(b_gate_up, {E, N1, r});
      break;
  }
  d.a_down = bf(a_down, {E, r, I});
  d.b_down = layout == LoraLayout::SharedOuter ? bf(b_down, {H, r}) : bf(b_down, {E, H, r});
  return d;
}

SyntheticAdapter make_synthetic_adapter(const SyntheticLayer& L, int64_t rank, uint64_t seed, LoraLayout layout,
                                        bool zero_b) {
  SyntheticAdapter A;
  A.layout = layout;
  A.rank = rank;
  A.lora_alpha = 2.f * static_cast<float>(rank);  // scale 2
  A.E = L.E; A.H = L.H; A.I = L.I; A.N1 = L.gated ? 2 * L.I : L.I;
  std::mt19937_64 rng(seed);
  const float sa1 = 1.f / std::sqrt(static_cast<float>(L.H)), sa2 = 1.f / std::sqrt(static_cast<float>(L.I));
  // B scaled so the delta is ~10% of the base activations.
  const float sb = zero_b ? 0.f : 0.05f / std::sqrt(static_cast<float>(rank));
  auto fill = [&](std::vector<uint16_t>& v, int64_t n, float sd) {
    if (sd == 0.f) v.assign(n, 0);
    else random_bf16_matrix(rng, n, sd, v);
  };
  const int64_t E = L.E, H = L.H, I = L.I, r = rank;
  switch (layout) {
    case LoraLayout::PerExpert:
      fill(A.a_gate, E * r * H, sa1);
      fill(A.a_up, E * r * H, sa1);
      fill(A.b_gate, E * I * r, sb);
      fill(A.b_up, E * I * r, sb);
      break;
    case LoraLayout::PeftFused:
      fill(A.a_gate_up, E * r * H, sa1);
      fill(A.b_gate_up, E * A.N1 * r, sb);
      break;
    case LoraLayout::SharedOuter:
      fill(A.a_gate_up, r * H, sa1);
      fill(A.b_gate_up, E * A.N1 * r, sb);
      break;
  }
  fill(A.a_down, E * r * I, sa2);
  fill(A.b_down, (layout == LoraLayout::SharedOuter ? 1 : E) * H * r, sb);
  return A;
}

std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> v;
  random_bf16_matrix(rng, n, stddev, v);
  return v;
}

std::vector<float> random_f32(int64_t n, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

}  // namespace fp4moe
