// DLPack tensors to fp4moe views and NumPy arrays back: the helpers shared by the binding files.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>  // nb::cast<std::string> in every file that uses these helpers

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/types.h"

namespace nb = nanobind;

namespace fp4moe::py {

// Throws InvalidArgument naming `name`.
[[noreturn]] void bad(const std::string& name, const std::string& what);

// Keeps the imported arrays alive for the duration of one call.
struct Keep {
  std::vector<nb::ndarray<nb::ro>> ro;
  std::vector<nb::ndarray<>> rw;
};

// d[name] (an array or a tuple (array, dtype_hint)) as a view; absent when missing or None.
TensorView get(const nb::dict& d, const char* name, Keep& keep, bool writable = false);

// Every key must be one this call knows: a misspelled tensor name must not be ignored silently.
void check_keys(const nb::dict& d, const std::vector<std::string_view>& known, const char* what);

// The tensors of a descriptor struct, by their Python names: one table gives both the accepted keys and
// where each view goes.
template <class Desc> struct ViewField {
  const char* name;
  TensorView Desc::*member;
};

template <class Desc, size_t N>
void read_views(const nb::dict& t, const ViewField<Desc> (&fields)[N], const char* what, Keep& keep, Desc& d) {
  std::vector<std::string_view> names;
  for (const auto& f : fields) names.push_back(f.name);
  check_keys(t, names, what);
  for (const auto& f : fields) d.*(f.member) = get(t, f.name, keep);
}

// A NumPy array that owns a moved-in vector.
template <class T>
nb::object numpy_from(std::vector<T>&& v, std::vector<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  nb::ndarray<nb::numpy, T> arr(owned->data(), shape.size(), shape.data(), owner);
  return nb::cast(arr, nb::rv_policy::reference);
}

// How a tensor converts to a fp4moe TensorView: dtype, device, shape, strides (fp4moe._C._describe).
nb::dict describe(nb::handle obj);

}  // namespace fp4moe::py
