// The weight-preparation step (SPEC §2, §6): validates a WeightsDesc field by field and fills the
// canonical host arrays of PreparedWeights (src/runtime/prepared.h); the CUDA backend adds its layout.
#include <cmath>
#include <memory>
#include <string>

#include "fp4moe/moe.h"
#include "fp4moe/mxfp4.h"
#include "fp4moe/nvfp4.h"
#include "runtime/host_tensor.h"
#include "runtime/prepared.h"

#ifdef FP4MOE_WITH_CUDA
#include "cuda/backend.h"
#endif

namespace fp4moe {
using detail::invalid;

// ---- MoeWeights accessors --------------------------------------------------------------------------
namespace {
const PreparedWeights& checked(const std::shared_ptr<const PreparedWeights>& p) {
  if (!p) throw Error(ErrorCode::InvalidArgument, "weights", "expected prepared weights, got an empty MoeWeights");
  return *p;
}
}  // namespace

Backend MoeWeights::backend() const { return checked(impl_).backend; }
WeightFormat MoeWeights::format() const { return checked(impl_).format; }
GateUpOrder MoeWeights::order() const { return checked(impl_).order; }
bool MoeWeights::gated() const { return checked(impl_).gated; }
int64_t MoeWeights::num_experts() const { return checked(impl_).E; }
int64_t MoeWeights::hidden() const { return checked(impl_).H; }
int64_t MoeWeights::inter() const { return checked(impl_).I; }

// ---- prepare_weights -------------------------------------------------------------------------------
namespace {

void check_dim(int64_t v, const char* name, int64_t multiple) {
  if (v <= 0 || v % multiple != 0)
    invalid(name, "expected a positive multiple of " + std::to_string(multiple) +
                      (multiple == 32 ? " (whole MXFP4 blocks)" : "") + ", got " + std::to_string(v));
  if (v > (int64_t{1} << 24)) invalid(name, "expected at most 2^24, got " + std::to_string(v));
}

void check_absent(const TensorView& v, const char* name, const char* why) {
  if (v.present()) invalid(name, std::string("expected no tensor (") + why + "), got one of shape " +
                                 detail::view_shape_str(v));
}

// Block scales of one weight tensor [E, N, K]: linear [E, N, K/16] or swizzled per expert
// ([E, swizzled_size] or [E, padded rows, padded cols]). Returns linear e4m3 codes [E, N, K/16].
std::vector<uint8_t> read_block_scales(const TensorView& v, const char* name, ScaleLayout layout, int64_t E,
                                       int64_t N, int64_t K) {
  detail::check_view(v, name, {DType::E4M3, DType::U8});
  const int64_t cols = K / nvfp4::kBlock;
  std::vector<uint8_t> linear;
  if (layout == ScaleLayout::Linear) {
    detail::check_shape(v, name, {E, N, cols});
    linear = detail::gather_u8(v, name);
  } else {
    const int64_t prow = nvfp4::swizzled_rows(N), pcol = nvfp4::swizzled_cols(cols);
    const int64_t size = nvfp4::swizzled_size(N, cols);
    const bool flat = v.ndim == 2 && v.shape[0] == E && v.shape[1] == size;
    const bool padded = v.ndim == 3 && v.shape[0] == E && v.shape[1] == prow && v.shape[2] == pcol;
    if (!flat && !padded)
      invalid(name, "expected swizzled 128x4 scales of shape " + detail::shape_list_str({E, size}) + " or " +
                    detail::shape_list_str({E, prow, pcol}) + ", got " + detail::view_shape_str(v));
    std::vector<uint8_t> swz = detail::gather_u8(v, name);
    linear.resize(static_cast<size_t>(E * N * cols));
    for (int64_t e = 0; e < E; ++e)
      nvfp4::unswizzle_scales(swz.data() + e * size, N, cols, linear.data() + e * N * cols);
  }
  // 0x7f / 0xff are NaN in float8_e4m3fn: a NaN block scale would poison whole rows silently.
  for (size_t i = 0; i < linear.size(); ++i) {
    if ((linear[i] & 0x7f) == 0x7f) {
      const int64_t idx = static_cast<int64_t>(i);
      invalid(name, "expected finite e4m3 block scales, got a NaN code at expert " + std::to_string(idx / (N * cols)) +
                    ", row " + std::to_string((idx / cols) % N) + ", block " + std::to_string(idx % cols));
    }
  }
  return linear;
}

// MXFP4 block scales [E, N, K/32] (E8M0 codes) of the codes q [E, N, K/2]: 255 (NaN) is refused, and so is a
// scale outside the exactly decoded range (mxfp4::kMinScaleCode ... kMaxScaleCode) over a block with a nonzero code.
std::vector<uint8_t> read_mx_scales(const TensorView& v, const char* name, const std::vector<uint8_t>& q, int64_t E,
                                    int64_t N, int64_t K) {
  detail::check_view(v, name, {DType::U8});
  const int64_t cols = K / mxfp4::kBlock;
  detail::check_shape(v, name, {E, N, cols});
  std::vector<uint8_t> s = detail::gather_u8(v, name);
  for (size_t i = 0; i < s.size(); ++i) {
    bool nonzero = false;
    for (int b = 0; b < mxfp4::kBlock / 2; ++b) nonzero |= (q[i * mxfp4::kBlock / 2 + b] & 0x77) != 0;
    if (mxfp4::scale_accepted(s[i], nonzero)) continue;
    const int64_t idx = static_cast<int64_t>(i);
    const std::string where = " at expert " + std::to_string(idx / (N * cols)) + ", row " +
                              std::to_string((idx / cols) % N) + ", block " + std::to_string(idx % cols);
    if (s[i] == mxfp4::kScaleNaN) invalid(name, "expected E8M0 block scales, got the NaN code 255" + where);
    invalid(name, "expected E8M0 scales " + std::to_string(mxfp4::kMinScaleCode) + ".." +
                      std::to_string(mxfp4::kMaxScaleCode) + " (2^-117 .. 2^9, decoded exactly) over nonzero values, got " +
                      std::to_string(s[i]) + where);
  }
  return s;
}

// Global dequant scales: f32 [E] (or [E, 1]), or [E, 2] when per_half_allowed. Finite and > 0.
std::vector<float> read_scale2(const TensorView& v, const char* name, int64_t E, bool per_half_allowed,
                               bool* per_half) {
  detail::check_view(v, name, {DType::F32});
  const bool one = (v.ndim == 1 && v.shape[0] == E) || (v.ndim == 2 && v.shape[0] == E && v.shape[1] == 1);
  const bool two = per_half_allowed && v.ndim == 2 && v.shape[0] == E && v.shape[1] == 2;
  if (!one && !two)
    invalid(name, std::string("expected shape ") + detail::shape_list_str({E}) +
                  (per_half_allowed ? " or " + detail::shape_list_str({E, 2}) : std::string()) + ", got " +
                  detail::view_shape_str(v));
  *per_half = two;
  std::vector<float> s = detail::gather_f32(v, name);
  for (size_t i = 0; i < s.size(); ++i)
    if (!std::isfinite(s[i]) || !(s[i] > 0.f))
      invalid(name, "expected finite scales > 0, got " + std::to_string(s[i]) + " at index " + std::to_string(i));
  return s;
}

std::vector<float> read_bias(const TensorView& v, const char* name, int64_t E, int64_t N) {
  if (!v.present()) return {};
  detail::check_view(v, name, {DType::F32, DType::BF16});
  detail::check_shape(v, name, {E, N});
  std::vector<float> b = detail::gather_f32(v, name);
  for (size_t i = 0; i < b.size(); ++i)
    if (!std::isfinite(b[i])) invalid(name, "expected finite values, got " + std::to_string(b[i]) + " at index " +
                                            std::to_string(i));
  return b;
}

}  // namespace

MoeWeights prepare_weights(const WeightsDesc& d, Backend backend, int device_id) {
  // Enums first: garbage values from a C cast must not reach the switch statements below.
  if (d.format != WeightFormat::NVFP4 && d.format != WeightFormat::BF16 && d.format != WeightFormat::MXFP4)
    invalid("format", "expected NVFP4, BF16 or MXFP4, got " + std::to_string(static_cast<int>(d.format)));
  if (d.order != GateUpOrder::GateFirst && d.order != GateUpOrder::UpFirst)
    invalid("order", "expected GateFirst or UpFirst, got " + std::to_string(static_cast<int>(d.order)));
  if (d.scale_layout != ScaleLayout::Linear && d.scale_layout != ScaleLayout::Swizzled128x4)
    invalid("scale_layout", "expected Linear or Swizzled128x4, got " + std::to_string(static_cast<int>(d.scale_layout)));
  if (backend != Backend::CPU && backend != Backend::CUDA)
    invalid("backend", "expected CPU or CUDA, got " + std::to_string(static_cast<int>(backend)));
#ifndef FP4MOE_WITH_CUDA
  if (backend == Backend::CUDA)
    throw Error(ErrorCode::Unsupported, "backend", "expected CPU (this build has no CUDA backend), got CUDA");
#else
  if (backend == Backend::CUDA) {
    const int n = cuda_backend::device_count();
    if (device_id < 0 || device_id >= n)
      invalid("device_id", "expected a CUDA device in [0, " + std::to_string(n) + "), got " + std::to_string(device_id));
  }
#endif
  if (d.num_experts <= 0 || d.num_experts > (int64_t{1} << 20))
    invalid("num_experts", "expected 1..2^20, got " + std::to_string(d.num_experts));
  const int64_t multiple = d.format == WeightFormat::MXFP4 ? mxfp4::kBlock : 16;
  check_dim(d.hidden, "hidden", multiple);
  check_dim(d.inter, "inter", multiple);

  auto p = std::make_shared<PreparedWeights>();
  p->backend = backend;
  p->device_id = backend == Backend::CUDA ? device_id : 0;
  p->format = d.format;
  p->order = d.order;
  p->gated = d.gated;
  p->E = d.num_experts;
  p->H = d.hidden;
  p->I = d.inter;
  const int64_t E = p->E, H = p->H, I = p->I, N1 = p->n1();

  if (d.format == WeightFormat::NVFP4) {
    detail::check_view(d.w1, "w1", {DType::U8});
    detail::check_shape(d.w1, "w1", {E, N1, H / 2});
    detail::check_view(d.w2, "w2", {DType::U8});
    detail::check_shape(d.w2, "w2", {E, H, I / 2});
    p->w1_sf = read_block_scales(d.w1_scale, "w1_scale", d.scale_layout, E, N1, H);
    p->w2_sf = read_block_scales(d.w2_scale, "w2_scale", d.scale_layout, E, H, I);
    bool per_half = false, unused = false;
    std::vector<float> s1 = read_scale2(d.w1_scale2, "w1_scale2", E, d.gated, &per_half);
    p->w2_s2 = read_scale2(d.w2_scale2, "w2_scale2", E, false, &unused);
    if (d.gated) {
      p->w1_s2.resize(static_cast<size_t>(2 * E));
      for (int64_t e = 0; e < E; ++e) {
        p->w1_s2[2 * e] = per_half ? s1[2 * e] : s1[e];
        p->w1_s2[2 * e + 1] = per_half ? s1[2 * e + 1] : s1[e];
      }
    } else {
      p->w1_s2 = std::move(s1);
    }
    p->w1_q = detail::gather_u8(d.w1, "w1");
    p->w2_q = detail::gather_u8(d.w2, "w2");
  } else if (d.format == WeightFormat::MXFP4) {
    if (d.scale_layout != ScaleLayout::Linear)
      invalid("scale_layout", "expected Linear for MXFP4 weights (the 128x4 swizzle is NVFP4's), got Swizzled128x4");
    detail::check_view(d.w1, "w1", {DType::U8});
    detail::check_shape(d.w1, "w1", {E, N1, H / 2});
    detail::check_view(d.w2, "w2", {DType::U8});
    detail::check_shape(d.w2, "w2", {E, H, I / 2});
    check_absent(d.w1_scale2, "w1_scale2", "MXFP4 weights have no global scale");
    check_absent(d.w2_scale2, "w2_scale2", "MXFP4 weights have no global scale");
    p->w1_q = detail::gather_u8(d.w1, "w1");
    p->w2_q = detail::gather_u8(d.w2, "w2");
    p->w1_sf = read_mx_scales(d.w1_scale, "w1_scale", p->w1_q, E, N1, H);
    p->w2_sf = read_mx_scales(d.w2_scale, "w2_scale", p->w2_q, E, H, I);
    p->w1_s2.assign(static_cast<size_t>(d.gated ? 2 * E : E), 1.f);
    p->w2_s2.assign(static_cast<size_t>(E), 1.f);
  } else {
    detail::check_view(d.w1, "w1", {DType::BF16});
    detail::check_shape(d.w1, "w1", {E, N1, H});
    detail::check_view(d.w2, "w2", {DType::BF16});
    detail::check_shape(d.w2, "w2", {E, H, I});
    check_absent(d.w1_scale, "w1_scale", "bf16 weights have no block scales");
    check_absent(d.w2_scale, "w2_scale", "bf16 weights have no block scales");
    check_absent(d.w1_scale2, "w1_scale2", "bf16 weights have no global scale");
    check_absent(d.w2_scale2, "w2_scale2", "bf16 weights have no global scale");
    p->w1_bf16 = detail::gather_u16(d.w1, "w1");
    p->w2_bf16 = detail::gather_u16(d.w2, "w2");
    p->w1_s2.assign(static_cast<size_t>(d.gated ? 2 * E : E), 1.f);
    p->w2_s2.assign(static_cast<size_t>(E), 1.f);
  }
  p->bias1 = read_bias(d.bias1, "bias1", E, N1);
  p->bias2 = read_bias(d.bias2, "bias2", E, H);

#ifdef FP4MOE_WITH_CUDA
  if (backend == Backend::CUDA) p->device = cuda_backend::prepare_device_weights(*p);
#endif
  return MoeWeights(std::move(p));
}

}  // namespace fp4moe
