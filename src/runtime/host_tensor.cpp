#include "runtime/host_tensor.h"

#include <cmath>
#include <cstring>
#include <limits>

#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fp4moe::detail {

void invalid(const std::string& arg, const std::string& what) { throw Error(ErrorCode::InvalidArgument, arg, what); }

std::string shape_list_str(std::initializer_list<int64_t> shape) {
  std::string s = "[";
  bool first = true;
  for (int64_t d : shape) {
    if (!first) s += ", ";
    s += std::to_string(d);
    first = false;
  }
  return s + "]";
}

std::string view_shape_str(const TensorView& v) {
  if (v.ndim < 0 || v.ndim > TensorView::kMaxDims) return "<ndim " + std::to_string(v.ndim) + ">";
  std::string s = "[";
  for (int i = 0; i < v.ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(v.shape[i]);
  }
  return s + "]";
}

void check_view(const TensorView& v, const std::string& name, std::initializer_list<DType> dtypes) {
  if (!v.present()) invalid(name, "expected a tensor, got none");
  if (v.ndim < 0 || v.ndim > TensorView::kMaxDims)
    invalid(name, "expected 0.." + std::to_string(TensorView::kMaxDims) + " dims, got ndim " + std::to_string(v.ndim));
  // Element count must fit comfortably in int64 (and in memory arithmetic with byte sizes).
  int64_t n = 1;
  for (int i = 0; i < v.ndim; ++i) {
    if (v.shape[i] < 0) invalid(name, "expected non-negative sizes, got shape " + view_shape_str(v));
    if (v.shape[i] != 0 && n > (int64_t{1} << 48) / v.shape[i])
      invalid(name, "expected a tensor of at most 2^48 elements, got shape " + view_shape_str(v));
    n *= v.shape[i];
  }
  bool ok = false;
  std::string allowed;
  for (DType d : dtypes) {
    if (d == v.dtype) ok = true;
    if (!allowed.empty()) allowed += " or ";
    allowed += to_string(d);
  }
  if (!ok) invalid(name, "expected dtype " + allowed + ", got " + to_string(v.dtype));
  if (v.device == Backend::CUDA) {
#ifndef FP4MOE_WITH_CUDA
    throw Error(ErrorCode::Unsupported, name, "expected a host tensor (this build has no CUDA), got a CUDA tensor");
#else
    if (v.device_id < 0) invalid(name, "expected a CUDA device id >= 0, got " + std::to_string(v.device_id));
#endif
  } else if (v.device != Backend::CPU) {
    invalid(name, "expected a CPU or CUDA tensor, got device " + std::to_string(static_cast<int>(v.device)));
  }
}

void check_shape(const TensorView& v, const std::string& name, std::initializer_list<int64_t> shape) {
  bool ok = v.ndim == static_cast<int>(shape.size());
  if (ok) {
    int i = 0;
    for (int64_t d : shape) ok = ok && v.shape[i++] == d;
  }
  if (!ok) invalid(name, "expected shape " + shape_list_str(shape) + ", got " + view_shape_str(v));
}

std::vector<uint8_t> gather_bytes(const TensorView& v, const std::string& name) {
  const size_t es = dtype_size(v.dtype);
  const int64_t n = v.numel();
  std::vector<uint8_t> out(static_cast<size_t>(n) * es);
  if (n == 0) return out;

  // Pad to 4 dims (leading size-1 dims) so one loop nest handles every rank.
  int64_t shape[4] = {1, 1, 1, 1}, stride[4] = {0, 0, 0, 0};
  const int pad = 4 - v.ndim;
  for (int i = 0; i < v.ndim; ++i) {
    shape[pad + i] = v.shape[i];
    stride[pad + i] = v.stride[i];
  }
  // Extent of the elements the view touches, relative to data (strides may be negative or zero).
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < 4; ++i) {
    const int64_t span = stride[i] * (shape[i] - 1);
    if (span < 0) lo += span; else hi += span;
  }
  const uint8_t* base = static_cast<const uint8_t*>(v.data);
  std::vector<uint8_t> staging;
  if (v.device == Backend::CUDA) {
#ifdef FP4MOE_WITH_CUDA
    const size_t bytes = static_cast<size_t>(hi - lo + 1) * es;
    staging.resize(bytes);
    cudaError_t err = cudaMemcpy(staging.data(), base + lo * static_cast<int64_t>(es), bytes, cudaMemcpyDefault);
    if (err != cudaSuccess)
      throw Error(ErrorCode::CudaError, name, std::string("copying to the host failed: ") + cudaGetErrorString(err));
    base = staging.data() - lo * static_cast<int64_t>(es);
#else
    throw Error(ErrorCode::Unsupported, name, "expected a host tensor (this build has no CUDA), got a CUDA tensor");
#endif
  }
  const bool inner_contig = stride[3] == 1;
  uint8_t* dst = out.data();
  for (int64_t i0 = 0; i0 < shape[0]; ++i0)
    for (int64_t i1 = 0; i1 < shape[1]; ++i1)
      for (int64_t i2 = 0; i2 < shape[2]; ++i2) {
        const int64_t row = i0 * stride[0] + i1 * stride[1] + i2 * stride[2];
        if (inner_contig) {
          std::memcpy(dst, base + row * static_cast<int64_t>(es), static_cast<size_t>(shape[3]) * es);
          dst += shape[3] * es;
        } else {
          for (int64_t i3 = 0; i3 < shape[3]; ++i3) {
            std::memcpy(dst, base + (row + i3 * stride[3]) * static_cast<int64_t>(es), es);
            dst += es;
          }
        }
      }
  return out;
}

std::vector<float> gather_f32(const TensorView& v, const std::string& name) {
  std::vector<uint8_t> raw = gather_bytes(v, name);
  const size_t n = static_cast<size_t>(v.numel());
  std::vector<float> out(n);
  if (v.dtype == DType::F32) {
    std::memcpy(out.data(), raw.data(), n * 4);
  } else if (v.dtype == DType::BF16) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, raw.data() + 2 * i, 2);
      out[i] = bf16_bits_to_f32(b);
    }
  } else {
    invalid(name, std::string("expected dtype f32 or bf16, got ") + to_string(v.dtype));
  }
  return out;
}

std::vector<uint16_t> gather_u16(const TensorView& v, const std::string& name) {
  if (dtype_size(v.dtype) != 2) invalid(name, std::string("expected a 2-byte dtype, got ") + to_string(v.dtype));
  std::vector<uint8_t> raw = gather_bytes(v, name);
  std::vector<uint16_t> out(static_cast<size_t>(v.numel()));
  std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

std::vector<uint8_t> gather_u8(const TensorView& v, const std::string& name) {
  if (dtype_size(v.dtype) != 1) invalid(name, std::string("expected a 1-byte dtype, got ") + to_string(v.dtype));
  return gather_bytes(v, name);
}

uint16_t f64_to_bf16_bits(double d) {
  if (std::isnan(d)) return f32_to_bf16_bits(std::numeric_limits<float>::quiet_NaN());
  float f = static_cast<float>(d);
  if (std::isfinite(f) && static_cast<double>(f) != d) {
    // Round to odd: truncate toward zero, then set the last bit (marks "inexact" for the next rounding).
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= 1u;
    std::memcpy(&f, &u, 4);
  }
  return f32_to_bf16_bits(f);
}

}  // namespace fp4moe::detail
