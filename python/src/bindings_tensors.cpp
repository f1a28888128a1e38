// DLPack import for the extension: arrays (or (array, dtype_hint) tuples) to TensorViews, without a copy.
#include "bindings_tensors.h"

#include <algorithm>
#include <cstdint>
#include <string>

namespace fp4moe::py {

[[noreturn]] void bad(const std::string& name, const std::string& what) {
  throw Error(ErrorCode::InvalidArgument, name, what);
}

namespace {

constexpr int kNoHint = -1;
constexpr uint8_t kDLFloat8_e4m3fn = 10;  // DLPack 1.1 code (nb::dlpack::dtype_code::Float8_E4M3FN)

// DLPack dtype -> fp4moe::DType; hint (a DType value) reinterprets an integer view of the same width.
DType dtype_from_dlpack(nb::dlpack::dtype t, int hint, const std::string& name) {
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  if (t.lanes != 1) bad(name, "expected a tensor with one lane per element, got " + std::to_string(t.lanes));
  if (hint != kNoHint) {
    if (hint < 0 || hint > static_cast<int>(DType::I64)) bad(name, "internal: bad dtype hint " + std::to_string(hint));
    const DType want = static_cast<DType>(hint);
    if (static_cast<size_t>(t.bits) != 8 * dtype_size(want))
      bad(name, std::string("expected a ") + std::to_string(8 * dtype_size(want)) + "-bit view for " + to_string(want) +
                    ", got " + std::to_string(t.bits) + " bits");
    return want;
  }
  using C = nb::dlpack::dtype_code;
  if (code == C::Float && t.bits == 32) return DType::F32;
  if (code == C::Float && t.bits == 64) return DType::F64;
  if (code == C::Float && t.bits == 16) return DType::F16;
  if (code == C::Bfloat && t.bits == 16) return DType::BF16;
  if (code == C::UInt && t.bits == 8) return DType::U8;
  if (code == C::Int && t.bits == 32) return DType::I32;
  if (code == C::Int && t.bits == 64) return DType::I64;
  if (t.code == kDLFloat8_e4m3fn && t.bits == 8) return DType::E4M3;
  bad(name, "unsupported dtype (DLPack code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
                " bits); expected float32, bfloat16, float16, float64, uint8, int32, int64 or float8_e4m3fn");
}

template <class Arr>
TensorView view_from(const Arr& a, int hint, const std::string& name) {
  TensorView v;
  if (a.ndim() > static_cast<size_t>(TensorView::kMaxDims))
    bad(name, "expected at most " + std::to_string(TensorView::kMaxDims) + " dimensions, got " +
                  std::to_string(a.ndim()));
  v.dtype = dtype_from_dlpack(a.dtype(), hint, name);
  const int dev = a.device_type();
  if (dev == nb::device::cpu::value || dev == nb::device::cuda_host::value) {
    v.device = Backend::CPU;
    v.device_id = 0;
  } else if (dev == nb::device::cuda::value || dev == nb::device::cuda_managed::value) {
    v.device = Backend::CUDA;
    v.device_id = a.device_id();
  } else {
    throw Error(ErrorCode::Unsupported, name, "expected a tensor on cpu or cuda, got DLPack device type " +
                                                  std::to_string(dev));
  }
  v.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = a.shape(static_cast<size_t>(i));
    v.stride[i] = a.stride(static_cast<size_t>(i));
  }
  // No element is addressed in an empty tensor: NumPy reports strides 0 there; make them row-major.
  if (v.numel() == 0) {
    int64_t st = 1;
    for (int i = v.ndim - 1; i >= 0; --i) {
      v.stride[i] = st;
      st *= v.shape[i] > 0 ? v.shape[i] : 1;
    }
  }
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  // An empty tensor may carry a null pointer; "absent" must stay distinct from "empty".
  if (v.data == nullptr) {
    static uint8_t empty_sentinel[16];
    v.data = empty_sentinel;
  }
  return v;
}

std::string py_type_name(nb::handle h) { return nb::cast<std::string>(nb::str(h.type().attr("__name__"))); }

// obj is an array or a tuple (array, dtype_hint). None -> absent view.
TensorView to_view(nb::handle obj, const std::string& name, bool writable, Keep& keep) {
  if (obj.is_none()) return {};
  int hint = kNoHint;
  nb::handle arr = obj;
  if (nb::isinstance<nb::tuple>(obj)) {
    nb::tuple t = nb::borrow<nb::tuple>(obj);
    if (t.size() != 2) bad(name, "internal: expected (array, dtype_hint)");
    arr = t[0];
    hint = t[1].is_none() ? kNoHint : nb::cast<int>(t[1]);
    if (arr.is_none()) return {};
  }
  if (writable) {
    nb::ndarray<> a;
    if (!nb::try_cast(arr, a, false))
      bad(name, "expected a writable tensor supporting DLPack or the buffer protocol, got " + py_type_name(arr));
    keep.rw.push_back(a);
    return view_from(a, hint, name);
  }
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(arr, a, false))
    bad(name, "expected a tensor supporting DLPack or the buffer protocol, got " + py_type_name(arr));
  keep.ro.push_back(a);
  return view_from(a, hint, name);
}

}  // namespace

TensorView get(const nb::dict& d, const char* name, Keep& keep, bool writable) {
  if (!d.contains(name)) return {};
  return to_view(d[name], name, writable, keep);
}

void check_keys(const nb::dict& d, const std::vector<std::string_view>& known, const char* what) {
  for (auto [k, v] : d) {
    const std::string key = nb::cast<std::string>(k);
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string list;
    for (const std::string_view n : known) list += std::string(list.empty() ? "" : ", ") + std::string(n);
    bad(key, std::string("unknown tensor for ") + what + "; expected one of: " + list);
  }
}

nb::dict describe(nb::handle obj) {
  Keep keep;
  TensorView v = to_view(obj, "tensor", false, keep);
  nb::dict d;
  d["dtype"] = static_cast<int>(v.dtype);
  d["dtype_name"] = std::string(to_string(v.dtype));
  d["device"] = v.device == Backend::CPU ? "cpu" : "cuda";
  d["device_id"] = v.device_id;
  nb::list shape, stride;
  for (int i = 0; i < v.ndim; ++i) {
    shape.append(v.shape[i]);
    stride.append(v.stride[i]);
  }
  d["shape"] = nb::tuple(shape);
  d["strides"] = nb::tuple(stride);
  d["data_ptr"] = reinterpret_cast<uintptr_t>(v.data);
  return d;
}

}  // namespace fp4moe::py
