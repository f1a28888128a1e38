// Harness of the LoRA GPU tests (test_lora_gpu.cpp, test_lora_gpu_runtime.cpp): adapters with owned storage (the
// shared expert's LoRA too), the same adapters in a CPU and a GPU registry, a GPU call with registry LoRA, and one
// case checked against the Fp32 reference, the whole output and each adapter slot's contribution alone.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <vector>

#include "cuda/kernels.h"
#include "gpu_harness.h"

namespace fp4moe::gputest {


inline constexpr double kRelL2A16 = 1e-2, kRelL2A4 = 3e-2;  // whole output vs the Fp32 reference (as test_moe_gpu)
inline constexpr double kDeltaA16 = 0.1, kDeltaA4 = 0.3;      // the LoRA contribution alone, per adapter slot

struct AdapterSpec {
  LoraLayout layout = LoraLayout::PeftFused;
  int64_t rank = 8;
  bool zero_b = false;
  bool shared_lora = false;  // also a LoRA on the shared expert (when the layer has one)
  uint64_t seed = 1;
};

// An adapter with owned storage: the routed part from make_synthetic_adapter, plus the shared expert's own.
struct OwnedAdapter {
  SyntheticAdapter a;
  std::vector<uint16_t> sa1, sb1, sa2, sb2;
  int64_t r = 0, H = 0, N1s = 0, Is = 0;
  bool gated = true;
  LoraAdapterDesc desc() {
    LoraAdapterDesc d = a.desc();
    if (!gated) d.a_up = d.b_up = TensorView{};  // PerExpert on a non-gated layer: the gate pair only
    if (!sa1.empty()) {
      d.shared_a_gate_up = make_view(sa1.data(), DType::BF16, {r, H});
      d.shared_b_gate_up = make_view(sb1.data(), DType::BF16, {N1s, r});
      d.shared_a_down = make_view(sa2.data(), DType::BF16, {r, Is});
      d.shared_b_down = make_view(sb2.data(), DType::BF16, {H, r});
    }
    return d;
  }
};

inline std::unique_ptr<OwnedAdapter> make_adapter(const Layer& l, const AdapterSpec& s) {
  auto o = std::make_unique<OwnedAdapter>();
  o->a = make_synthetic_adapter(l.L, s.rank, s.seed, s.layout, s.zero_b);
  o->gated = l.L.gated;
  if (s.shared_lora && l.has_shared) {
    o->r = s.rank;
    o->H = l.S.H;
    o->Is = l.S.I;
    o->N1s = l.S.gated ? 2 * l.S.I : l.S.I;
    const float sd_b = 0.05f / std::sqrt(static_cast<float>(s.rank));
    o->sa1 = random_bf16(o->r * o->H, s.seed * 11 + 1, 1.f / std::sqrt(static_cast<float>(o->H)));
    o->sa2 = random_bf16(o->r * o->Is, s.seed * 11 + 3, 1.f / std::sqrt(static_cast<float>(o->Is)));
    if (s.zero_b) {
      o->sb1.assign(static_cast<size_t>(o->N1s * o->r), 0);
      o->sb2.assign(static_cast<size_t>(o->H * o->r), 0);
    } else {
      o->sb1 = random_bf16(o->N1s * o->r, s.seed * 11 + 2, sd_b);
      o->sb2 = random_bf16(o->H * o->r, s.seed * 11 + 4, sd_b);
    }
  }
  return o;
}

// The same adapters in a CPU registry (for the reference) and a GPU registry.
struct Registries {
  std::unique_ptr<AdapterRegistry> cpu, gpu;
  Registries(const Layer& l, int slots)
      : cpu(std::make_unique<AdapterRegistry>(l.cpu, slots, l.has_shared ? &l.scpu : nullptr)),
        gpu(std::make_unique<AdapterRegistry>(l.gpu, slots, l.has_shared ? &l.sgpu : nullptr)) {}
  void load(int slot, const Layer& l, const AdapterSpec& s) {
    auto a = make_adapter(l, s);
    const LoraAdapterDesc d = a->desc();
    cpu->load(slot, d);
    gpu->load(slot, d);
  }
  void unload(int slot) {
    cpu->unload(slot);
    gpu->unload(slot);
  }
};

// A GPU call with (or without: reg null) registry LoRA; returns y's bits.
struct LoraCall {
  std::unique_ptr<GpuCall> g;
  DevBuf ids;
  std::vector<uint16_t> run(const Layer& l, const AdapterRegistry* reg, const std::vector<int32_t>& aids,
                            cudaStream_t stream = nullptr) {
    set(reg, aids);
    return run_gpu(l.gpu, *g, stream);
  }
  void set(const AdapterRegistry* reg, const std::vector<int32_t>& aids) {
    if (reg) {
      // Re-used when the size matches: a captured graph keeps pointing at this buffer.
      if (ids.bytes() != aids.size() * sizeof(int32_t)) ids = DevBuf::from(aids);
      else cuda_check_abort(cudaMemcpy(ids.get(), aids.data(), ids.bytes(), cudaMemcpyHostToDevice), "upload ids");
      g->args.adapters = reg;
      g->args.adapter_ids = dview(ids, DType::I32, {static_cast<int64_t>(aids.size())});
    } else {
      g->args.adapters = nullptr;
      g->args.adapter_ids = TensorView{};
    }
  }
};

inline bool row_equal(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t t, int64_t H) {
  return std::equal(a.begin() + t * H, a.begin() + (t + 1) * H, b.begin() + t * H);
}

// One case against the Fp32 reference (same rounding points): the whole output, then the LoRA
// contribution alone per adapter slot, (y_lora - y_base) on the GPU vs the same difference in the reference.
// Base tokens of the mixed batch must equal the base run bit for bit.
inline void check_against_reference(const Case& c, const Layer& l, Registries& R, const std::vector<int32_t>& aids,
                             const char* label) {
  Inputs in = make_inputs(c);
  LoraCall call{make_gpu_call(c, in, l), DevBuf()};
  const std::vector<uint16_t> y_base = call.run(l, nullptr, aids);
  const std::vector<uint16_t> y = call.run(l, R.gpu.get(), aids);
  EXPECT_EQ(count_poison(y), 0) << label << ": elements of y not written";
  EXPECT_NO_THROW(check_device_errors(0)) << label;
  const int64_t H = in.H;
  for (int64_t t = 0; t < c.T; ++t)
    if (aids[t] < 0) EXPECT_TRUE(row_equal(y, y_base, t, H)) << label << ": base token " << t << " differs from base";

  const auto toks = check_tokens(c.T, c.check_tokens);
  const bool a4 = c.mode == ActMode::A4;
  const std::vector<double> ref = run_reference(c, in, l, toks, Precision::Fp32, nullptr, R.cpu.get(), &aids);
  const std::vector<double> ref_base = run_reference(c, in, l, toks, Precision::Fp32);
  const Errors e = compare(y, ref, toks, H);
  EXPECT_EQ(e.nonfinite, 0) << label;
  EXPECT_LE(e.rel_l2, a4 ? kRelL2A4 : kRelL2A16) << label;

  // Per slot: || (y - y_base) - (ref - ref_base) || / || ref - ref_base ||.
  std::map<int32_t, std::array<double, 3>> per_slot;  // num, den, |ref|^2
  for (size_t i = 0; i < toks.size(); ++i) {
    const int64_t t = toks[i];
    if (aids[t] < 0) continue;
    auto& acc = per_slot[aids[t]];
    for (int64_t h = 0; h < H; ++h) {
      const double dg = static_cast<double>(bf16_bits_to_f32(y[t * H + h])) - bf16_bits_to_f32(y_base[t * H + h]);
      const double dr = ref[i * H + h] - ref_base[i * H + h];
      acc[0] += (dg - dr) * (dg - dr);
      acc[1] += dr * dr;
      acc[2] += ref[i * H + h] * ref[i * H + h];
    }
  }
  for (const auto& [slot, acc] : per_slot) {
    const double rel = acc[1] > 0 ? std::sqrt(acc[0] / acc[1]) : std::sqrt(acc[0]);
    const double visible = std::sqrt(acc[1] / std::max(acc[2], 1e-30));
    std::printf("STAT lora %-44s slot %d: delta relL2=%.3e (delta/|y|=%.3e)\n", label, slot, rel, visible);
    if (acc[1] == 0) {
      EXPECT_EQ(acc[0], 0.0) << label << " slot " << slot << ": a zero-B adapter changed the output";
    } else {
      EXPECT_LE(rel, a4 ? kDeltaA4 : kDeltaA16) << label << " slot " << slot;
      EXPECT_GT(visible, 1e-3) << label << " slot " << slot << ": the LoRA delta is too small to test";
    }
  }
  std::printf("STAT lora %-44s T=%-5lld relL2=%.3e cos=%.8f\n", label, static_cast<long long>(c.T), e.rel_l2, e.cosine);
}

inline std::vector<int32_t> cycle_ids(int64_t T, int num_slots) {
  std::vector<int32_t> v(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) v[t] = static_cast<int32_t>(t % (num_slots + 1)) - 1;  // -1, 0, 1, ...
  return v;
}

}  // namespace fp4moe::gputest
