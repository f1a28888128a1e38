// A bf16 tensor owned by a test, and a random one: the adapters' matrices of the LoRA tests (test_lora.cpp,
// test_lora_api.cpp).
#pragma once
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "fp4moe/types.h"

namespace fp4moe::testutil {


// A bf16 tensor owned by the test.
struct Bf16 {
  std::vector<uint16_t> bits;
  std::vector<int64_t> shape;
  TensorView view() const {
    TensorView v;
    v.data = const_cast<uint16_t*>(bits.data());
    v.dtype = DType::BF16;
    v.ndim = static_cast<int>(shape.size());
    int64_t st = 1;
    for (int i = v.ndim - 1; i >= 0; --i) {
      v.shape[i] = shape[i];
      v.stride[i] = st;
      st *= shape[i];
    }
    return v;
  }
  double at(int64_t i) const { return bf16_bits_to_f32(bits[static_cast<size_t>(i)]); }
};

inline Bf16 rand_bf16(std::vector<int64_t> shape, uint32_t seed, float scale = 0.5f) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  Bf16 t{std::vector<uint16_t>(static_cast<size_t>(n)), std::move(shape)};
  for (auto& b : t.bits) b = f32_to_bf16_bits(dist(rng));
  return t;
}

}  // namespace fp4moe::testutil
