// Dense f32/bf16 expert weights -> operator weights with owned storage (include/fp4moe/quantize.h).
#include "fp4moe/quantize.h"

#include <algorithm>
#include <cmath>

#include "fp4moe/mxfp4.h"
#include "fp4moe/nvfp4.h"
#include "runtime/host_tensor.h"

namespace fp4moe {
using detail::invalid;

namespace {

// A host view of const storage (OwnedWeights::desc is const; the views are only read).
TensorView host_view(const void* data, DType t, std::initializer_list<int64_t> shape) {
  return make_view(const_cast<void*>(data), t, shape);
}

std::vector<float> read_dense(const TensorView& v, const char* name, std::initializer_list<int64_t> shape) {
  detail::check_view(v, name, {DType::F32, DType::BF16});
  detail::check_shape(v, name, shape);
  std::vector<float> x = detail::gather_f32(v, name);
  for (size_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(x[i]))
      invalid(name, "expected finite values, got " + std::to_string(x[i]) + " at index " + std::to_string(i));
  return x;
}

float amax_of(const float* x, int64_t n) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

// Quantizes rows [row0, row0 + rows) of one expert's [N, K] matrix with one global scale.
float quantize_rows(const float* x, int64_t rows, int64_t K, uint8_t* packed, uint8_t* sf) {
  const float gs = nvfp4::global_encode_scale(amax_of(x, rows * K));
  nvfp4::quantize_matrix(x, rows, K, gs, packed, sf);
  return 1.0f / gs;
}

// Swizzles per-expert linear scales [E, N, K/16] into [E, swizzled_size(N, K/16)].
std::vector<uint8_t> swizzle_all(const std::vector<uint8_t>& linear, int64_t E, int64_t N, int64_t cols) {
  const int64_t size = nvfp4::swizzled_size(N, cols);
  std::vector<uint8_t> out(static_cast<size_t>(E * size), 0);
  for (int64_t e = 0; e < E; ++e)
    nvfp4::swizzle_scales(linear.data() + e * N * cols, N, cols, out.data() + e * size);
  return out;
}

std::vector<uint8_t> unswizzle_all(const std::vector<uint8_t>& swz, int64_t E, int64_t N, int64_t cols) {
  const int64_t size = nvfp4::swizzled_size(N, cols);
  std::vector<uint8_t> out(static_cast<size_t>(E * N * cols));
  for (int64_t e = 0; e < E; ++e)
    nvfp4::unswizzle_scales(swz.data() + e * size, N, cols, out.data() + e * N * cols);
  return out;
}

}  // namespace

OwnedWeights quantize_weights(const TensorView& w1, const TensorView& w2, const QuantizeOptions& opt,
                              const TensorView& bias1, const TensorView& bias2) {
  if (opt.format != WeightFormat::NVFP4 && opt.format != WeightFormat::BF16 && opt.format != WeightFormat::MXFP4)
    invalid("format", "expected NVFP4, BF16 or MXFP4, got " + std::to_string(static_cast<int>(opt.format)));
  if (opt.format == WeightFormat::MXFP4 && opt.scale_layout != ScaleLayout::Linear)
    invalid("scale_layout", "expected Linear for MXFP4 (the 128x4 swizzle is NVFP4's), got Swizzled128x4");
  if (opt.order != GateUpOrder::GateFirst && opt.order != GateUpOrder::UpFirst)
    invalid("order", "expected GateFirst or UpFirst, got " + std::to_string(static_cast<int>(opt.order)));
  if (opt.scale_layout != ScaleLayout::Linear && opt.scale_layout != ScaleLayout::Swizzled128x4)
    invalid("scale_layout", "expected Linear or Swizzled128x4, got " + std::to_string(static_cast<int>(opt.scale_layout)));
  detail::check_view(w1, "w1", {DType::F32, DType::BF16});
  detail::check_view(w2, "w2", {DType::F32, DType::BF16});
  if (w1.ndim != 3) invalid("w1", "expected shape [E, N1, H], got " + detail::view_shape_str(w1));
  if (w2.ndim != 3) invalid("w2", "expected shape [E, H, I], got " + detail::view_shape_str(w2));
  OwnedWeights o;
  o.format = opt.format;
  o.order = opt.order;
  o.scale_layout = opt.scale_layout;
  o.gated = opt.gated;
  o.E = w1.shape[0];
  o.H = w1.shape[2];
  o.I = w2.shape[2];
  const int64_t E = o.E, H = o.H, I = o.I, N1 = o.n1();
  if (E <= 0) invalid("w1", "expected at least one expert, got shape " + detail::view_shape_str(w1));
  const int64_t multiple = opt.format == WeightFormat::MXFP4 ? mxfp4::kBlock : 16;
  const std::string what = " a positive multiple of " + std::to_string(multiple) + ", got ";
  if (H <= 0 || H % multiple) invalid("w1", "expected H (last dim)" + what + std::to_string(H));
  if (I <= 0 || I % multiple) invalid("w2", "expected I (last dim)" + what + std::to_string(I));
  std::vector<float> x1 = read_dense(w1, "w1", {E, N1, H});
  std::vector<float> x2 = read_dense(w2, "w2", {E, H, I});
  if (bias1.present()) o.bias1 = read_dense(bias1, "bias1", {E, N1});
  if (bias2.present()) o.bias2 = read_dense(bias2, "bias2", {E, H});

  if (opt.format == WeightFormat::BF16) {
    o.w1_bf16.resize(x1.size());
    o.w2_bf16.resize(x2.size());
    std::transform(x1.begin(), x1.end(), o.w1_bf16.begin(), f32_to_bf16_bits);
    std::transform(x2.begin(), x2.end(), o.w2_bf16.begin(), f32_to_bf16_bits);
    return o;
  }
  if (opt.format == WeightFormat::MXFP4) {  // no global scale: the E8M0 block scales carry the magnitudes
    o.w1.resize(x1.size() / 2);
    o.w2.resize(x2.size() / 2);
    o.w1_scale.resize(x1.size() / mxfp4::kBlock);
    o.w2_scale.resize(x2.size() / mxfp4::kBlock);
    mxfp4::quantize_matrix(x1.data(), E * N1, H, o.w1.data(), o.w1_scale.data());
    mxfp4::quantize_matrix(x2.data(), E * H, I, o.w2.data(), o.w2_scale.data());
    return o;
  }

  const bool per_half = opt.gated && opt.per_half_scale2;
  o.w1.resize(static_cast<size_t>(E * N1 * H / 2));
  o.w2.resize(static_cast<size_t>(E * H * I / 2));
  std::vector<uint8_t> sf1(static_cast<size_t>(E * N1 * H / 16)), sf2(static_cast<size_t>(E * H * I / 16));
  o.w1_scale2.resize(static_cast<size_t>(per_half ? 2 * E : E));
  o.w2_scale2.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const float* a = x1.data() + e * N1 * H;
    uint8_t* q = o.w1.data() + e * N1 * H / 2;
    uint8_t* s = sf1.data() + e * N1 * H / 16;
    if (per_half) {
      // Each half gets its own global scale, as ModelOpt's separate w1/w3 weight_scale_2.
      o.w1_scale2[2 * e] = quantize_rows(a, I, H, q, s);
      o.w1_scale2[2 * e + 1] = quantize_rows(a + I * H, I, H, q + I * H / 2, s + I * H / 16);
    } else {
      o.w1_scale2[e] = quantize_rows(a, N1, H, q, s);
    }
    o.w2_scale2[e] = quantize_rows(x2.data() + e * H * I, H, I, o.w2.data() + e * H * I / 2,
                                   sf2.data() + e * H * I / 16);
  }
  if (opt.scale_layout == ScaleLayout::Swizzled128x4) {
    o.w1_scale = swizzle_all(sf1, E, N1, H / 16);
    o.w2_scale = swizzle_all(sf2, E, H, I / 16);
  } else {
    o.w1_scale = std::move(sf1);
    o.w2_scale = std::move(sf2);
  }
  return o;
}

WeightsDesc OwnedWeights::desc() const {
  WeightsDesc d;
  d.format = format;
  d.order = order;
  d.scale_layout = scale_layout;
  d.gated = gated;
  d.num_experts = E;
  d.hidden = H;
  d.inter = I;
  const int64_t N1 = n1();
  if (format == WeightFormat::NVFP4) {
    d.w1 = host_view(w1.data(), DType::U8, {E, N1, H / 2});
    d.w2 = host_view(w2.data(), DType::U8, {E, H, I / 2});
    if (scale_layout == ScaleLayout::Linear) {
      d.w1_scale = host_view(w1_scale.data(), DType::E4M3, {E, N1, H / 16});
      d.w2_scale = host_view(w2_scale.data(), DType::E4M3, {E, H, I / 16});
    } else {
      d.w1_scale = host_view(w1_scale.data(), DType::E4M3, {E, nvfp4::swizzled_size(N1, H / 16)});
      d.w2_scale = host_view(w2_scale.data(), DType::E4M3, {E, nvfp4::swizzled_size(H, I / 16)});
    }
    if (static_cast<int64_t>(w1_scale2.size()) == 2 * E)
      d.w1_scale2 = host_view(w1_scale2.data(), DType::F32, {E, 2});
    else
      d.w1_scale2 = host_view(w1_scale2.data(), DType::F32, {E});
    d.w2_scale2 = host_view(w2_scale2.data(), DType::F32, {E});
  } else if (format == WeightFormat::MXFP4) {
    d.w1 = host_view(w1.data(), DType::U8, {E, N1, H / 2});
    d.w2 = host_view(w2.data(), DType::U8, {E, H, I / 2});
    d.w1_scale = host_view(w1_scale.data(), DType::U8, {E, N1, H / mxfp4::kBlock});
    d.w2_scale = host_view(w2_scale.data(), DType::U8, {E, H, I / mxfp4::kBlock});
  } else {
    d.w1 = host_view(w1_bf16.data(), DType::BF16, {E, N1, H});
    d.w2 = host_view(w2_bf16.data(), DType::BF16, {E, H, I});
  }
  if (!bias1.empty()) d.bias1 = host_view(bias1.data(), DType::F32, {E, N1});
  if (!bias2.empty()) d.bias2 = host_view(bias2.data(), DType::F32, {E, H});
  return d;
}

std::vector<float> dequantize_w1(const OwnedWeights& w) {
  const int64_t E = w.E, H = w.H, N1 = w.n1();
  std::vector<float> out(static_cast<size_t>(E * N1 * H));
  if (w.format == WeightFormat::BF16) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_bits_to_f32(w.w1_bf16[i]);
    return out;
  }
  if (w.format == WeightFormat::MXFP4) {
    mxfp4::dequantize_matrix(w.w1.data(), w.w1_scale.data(), E * N1, H, out.data());
    return out;
  }
  const std::vector<uint8_t> sf =
      w.scale_layout == ScaleLayout::Linear ? w.w1_scale : unswizzle_all(w.w1_scale, E, N1, H / 16);
  const bool per_half = static_cast<int64_t>(w.w1_scale2.size()) == 2 * E;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N1; ++n) {
      const float s2 = per_half ? w.w1_scale2[2 * e + (n >= w.I ? 1 : 0)] : w.w1_scale2[e];
      nvfp4::dequantize_row(w.w1.data() + (e * N1 + n) * H / 2, sf.data() + (e * N1 + n) * H / 16, H, s2,
                            out.data() + (e * N1 + n) * H);
    }
  return out;
}

std::vector<float> dequantize_w2(const OwnedWeights& w) {
  const int64_t E = w.E, H = w.H, I = w.I;
  std::vector<float> out(static_cast<size_t>(E * H * I));
  if (w.format == WeightFormat::BF16) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_bits_to_f32(w.w2_bf16[i]);
    return out;
  }
  if (w.format == WeightFormat::MXFP4) {
    mxfp4::dequantize_matrix(w.w2.data(), w.w2_scale.data(), E * H, I, out.data());
    return out;
  }
  const std::vector<uint8_t> sf =
      w.scale_layout == ScaleLayout::Linear ? w.w2_scale : unswizzle_all(w.w2_scale, E, H, I / 16);
  for (int64_t e = 0; e < E; ++e)
    nvfp4::dequantize_matrix(w.w2.data() + e * H * I / 2, sf.data() + e * H * I / 16, H, I, w.w2_scale2[e],
                             out.data() + e * H * I);
  return out;
}

}  // namespace fp4moe
