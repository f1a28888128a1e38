// Helpers shared by the weight-preparation step and the adapter registry: argument checks that
// name the argument, and copying (possibly strided, possibly device-resident) views into
// contiguous host vectors.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "fp4moe/types.h"

namespace fp4moe::detail {

// Throws Error(InvalidArgument) naming the argument `arg`: the one such helper of the library's sources.
[[noreturn]] void invalid(const std::string& arg, const std::string& what);

// "[a, b, c]" for a shape list.
std::string shape_list_str(std::initializer_list<int64_t> shape);
// The view's shape as "[a, b, c]" (independent of TensorView::shape_str so these checks stand alone).
std::string view_shape_str(const TensorView& v);

// Throws InvalidArgument naming `name` unless v is present, has a sane ndim/shape, lives on a supported
// device (CUDA views raise Unsupported in a CPU-only build), and has one of the dtypes given.
void check_view(const TensorView& v, const std::string& name, std::initializer_list<DType> dtypes);
// Throws InvalidArgument naming `name` unless v's shape equals `shape` exactly.
void check_shape(const TensorView& v, const std::string& name, std::initializer_list<int64_t> shape);

// Copies the elements of v (any strides, host or CUDA device) into a contiguous row-major byte
// vector of numel * dtype_size bytes. `name` is used in errors.
std::vector<uint8_t> gather_bytes(const TensorView& v, const std::string& name);

// Typed conveniences. The dtype must already have been checked.
std::vector<float> gather_f32(const TensorView& v, const std::string& name);      // f32 or bf16 -> f32
std::vector<uint16_t> gather_u16(const TensorView& v, const std::string& name);   // bf16 bits
std::vector<uint8_t> gather_u8(const TensorView& v, const std::string& name);     // u8 / e4m3 codes


// Rounds a double to bf16 (nearest, ties to even) with a single rounding: first to float with
// round-to-odd (float keeps >= 2 extra bits, so the final rounding is correct), then RNE to bf16.
uint16_t f64_to_bf16_bits(double d);

}  // namespace fp4moe::detail
