// The adapter registry (SPEC §5): validates LoRA adapters in any accepted layout and converts them to
// the one canonical PreparedAdapter form of src/runtime/prepared.h, in slots that a running call can
// snapshot without locking against later loads.
#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <string>

#include "fp4moe/moe.h"
#include "runtime/host_tensor.h"
#include "runtime/prepared.h"

#ifdef FP4MOE_WITH_CUDA
#include "cuda/backend.h"
#endif

namespace fp4moe {
using detail::invalid;

namespace {

constexpr int kMaxRank = 64;
constexpr int kMaxSlots = 1 << 16;

// A bf16 matrix stack read from the caller, shape-checked.
std::vector<uint16_t> read_bf16(const TensorView& v, const char* name, std::initializer_list<int64_t> shape) {
  detail::check_view(v, name, {DType::BF16});
  detail::check_shape(v, name, shape);
  return detail::gather_u16(v, name);
}

void require_absent(const TensorView& v, const char* name, const char* layout) {
  if (v.present())
    invalid(name, std::string("expected no tensor for layout ") + layout + ", got one of shape " +
                  detail::view_shape_str(v));
}

// Both halves of an A/B pair must be given together.
bool pair_present(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name) {
  if (a.present() && !b.present()) invalid(b_name, std::string("expected a tensor (") + a_name + " is given), got none");
  if (b.present() && !a.present()) invalid(a_name, std::string("expected a tensor (") + b_name + " is given), got none");
  return a.present();
}

// Folds the scale into a B value with one rounding to bf16 (the product s * b is exact in double).
// A zero stays +0 so that a zero B is exactly the zero matrix whatever the sign of s.
uint16_t fold(double s, uint16_t b) {
  const double v = s * static_cast<double>(bf16_bits_to_f32(b));
  if (v == 0.0) return 0;
  return detail::f64_to_bf16_bits(v);
}

// B given gate rows first, [count, 2 * half, cols] (or [count, half, cols] non-gated): folds the scale and
// writes rows in the weights' half order.
std::vector<uint16_t> fold_reorder(const std::vector<uint16_t>& b, int64_t count, int64_t half, int64_t cols,
                                   bool gated, GateUpOrder order, double s) {
  std::vector<uint16_t> out(b.size());
  const int64_t rows = gated ? 2 * half : half;
  const bool swap = gated && order == GateUpOrder::UpFirst;
  for (int64_t m = 0; m < count; ++m)
    for (int64_t n = 0; n < rows; ++n) {
      // Source row n (gate first) lands at its place in the weights' order.
      const int64_t dst = swap ? (n < half ? n + half : n - half) : n;
      const uint16_t* src = b.data() + (m * rows + n) * cols;
      uint16_t* d = out.data() + (m * rows + dst) * cols;
      for (int64_t c = 0; c < cols; ++c) d[c] = fold(s, src[c]);
    }
  return out;
}

std::vector<uint16_t> fold_all(const std::vector<uint16_t>& b, double s) {
  std::vector<uint16_t> out(b.size());
  for (size_t i = 0; i < b.size(); ++i) out[i] = fold(s, b[i]);
  return out;
}

}  // namespace

struct AdapterRegistry::State {
  MoeWeights layer;
  std::optional<MoeWeights> shared;
  int num_slots = 0;
  mutable std::mutex mu;
  AdapterSnapshot table;  // replaced (never mutated) under mu: copy-on-write

  std::shared_ptr<const PreparedAdapter> convert(const LoraAdapterDesc& d) const;
};

AdapterRegistry::AdapterRegistry(const MoeWeights& layer, int num_slots, const MoeWeights* shared_expert)
    : state_(std::make_unique<State>()) {
  if (!layer.valid()) invalid("layer", "expected prepared weights, got an empty MoeWeights");
  if (num_slots <= 0 || num_slots > kMaxSlots)
    invalid("num_slots", "expected 1.." + std::to_string(kMaxSlots) + ", got " + std::to_string(num_slots));
  if (shared_expert) {
    if (!shared_expert->valid()) invalid("shared_expert", "expected prepared weights, got an empty MoeWeights");
    const PreparedWeights& s = shared_expert->impl();
    const PreparedWeights& l = layer.impl();
    if (s.E != 1) invalid("shared_expert", "expected a single (dense) expert, got " + std::to_string(s.E) + " experts");
    if (s.H != l.H)
      invalid("shared_expert", "expected hidden " + std::to_string(l.H) + " (the layer's), got " + std::to_string(s.H));
    if (s.gated != l.gated)
      invalid("shared_expert", std::string("expected ") + (l.gated ? "gated" : "non-gated") + " weights like the layer's");
    if (s.backend != l.backend || s.device_id != l.device_id)
      invalid("shared_expert", "expected the layer's backend and device");
    state_->shared = *shared_expert;
  }
  state_->layer = layer;
  state_->num_slots = num_slots;
  state_->table = std::make_shared<const std::vector<std::shared_ptr<const PreparedAdapter>>>(
      static_cast<size_t>(num_slots));
}

AdapterRegistry::~AdapterRegistry() = default;

int AdapterRegistry::num_slots() const { return state_->num_slots; }
Backend AdapterRegistry::backend() const { return state_->layer.backend(); }
bool AdapterRegistry::made_for(const MoeWeights& weights) const { return state_->layer.same_as(weights); }
const MoeWeights* AdapterRegistry::shared_expert() const { return state_->shared ? &*state_->shared : nullptr; }

std::shared_ptr<const PreparedAdapter> AdapterRegistry::State::convert(const LoraAdapterDesc& d) const {
  const PreparedWeights& w = layer.impl();
  if (d.layout != LoraLayout::PerExpert && d.layout != LoraLayout::PeftFused && d.layout != LoraLayout::SharedOuter)
    invalid("layout", "expected PerExpert, PeftFused or SharedOuter, got " + std::to_string(static_cast<int>(d.layout)));
  if (d.rank < 1 || d.rank > kMaxRank)
    invalid("rank", "expected 1.." + std::to_string(kMaxRank) + ", got " + std::to_string(d.rank));
  if (!std::isfinite(d.lora_alpha)) invalid("lora_alpha", "expected a finite value, got " + std::to_string(d.lora_alpha));

  auto a = std::make_shared<PreparedAdapter>();
  const int64_t E = w.E, H = w.H, I = w.I, N1 = w.n1(), r = d.rank;
  a->E = E;
  a->H = H;
  a->I = I;
  a->N1 = N1;
  a->layout = d.layout;
  a->rank = r;
  const double s = d.use_rslora ? static_cast<double>(d.lora_alpha) / std::sqrt(static_cast<double>(r))
                                : static_cast<double>(d.lora_alpha) / static_cast<double>(r);
  a->scale = static_cast<float>(s);
  a->a1_shared = d.layout == LoraLayout::SharedOuter;
  a->b2_shared = d.layout == LoraLayout::SharedOuter;

  // ---- gate_up -----------------------------------------------------------------------------------
  if (d.layout == LoraLayout::PerExpert) {
    require_absent(d.a_gate_up, "a_gate_up", "PerExpert");
    require_absent(d.b_gate_up, "b_gate_up", "PerExpert");
    const bool g = pair_present(d.a_gate, "a_gate", d.b_gate, "b_gate");
    bool u = false;
    if (w.gated) {
      u = pair_present(d.a_up, "a_up", d.b_up, "b_up");
      if (g != u) invalid(g ? "a_up" : "a_gate", "expected gate and up LoRA together (gated layer), got only one");
    } else {
      require_absent(d.a_up, "a_up", "PerExpert on a non-gated layer");
      require_absent(d.b_up, "b_up", "PerExpert on a non-gated layer");
    }
    if (g) {
      std::vector<uint16_t> ag = read_bf16(d.a_gate, "a_gate", {E, r, H});
      std::vector<uint16_t> bg = read_bf16(d.b_gate, "b_gate", {E, I, r});
      a->has_gate_up = true;
      if (!w.gated) {
        a->r1 = r;
        a->A1 = std::move(ag);
        a->B1 = fold_all(bg, s);
      } else {
        std::vector<uint16_t> au = read_bf16(d.a_up, "a_up", {E, r, H});
        std::vector<uint16_t> bu = read_bf16(d.b_up, "b_up", {E, I, r});
        const int64_t r1 = 2 * r;
        a->r1 = r1;
        // A1_e = [A_gate_e; A_up_e]: rows 0..r-1 feed the gate block of B1, rows r..2r-1 the up block.
        a->A1.resize(static_cast<size_t>(E * r1 * H));
        for (int64_t e = 0; e < E; ++e) {
          std::copy_n(ag.data() + e * r * H, r * H, a->A1.data() + e * r1 * H);
          std::copy_n(au.data() + e * r * H, r * H, a->A1.data() + e * r1 * H + r * H);
        }
        // B1_e block-diagonal in the weights' half order; the off-diagonal blocks are exact zeros.
        a->B1.assign(static_cast<size_t>(E * N1 * r1), 0);
        const int64_t gate_row0 = w.order == GateUpOrder::GateFirst ? 0 : I;
        const int64_t up_row0 = w.order == GateUpOrder::GateFirst ? I : 0;
        for (int64_t e = 0; e < E; ++e)
          for (int64_t i = 0; i < I; ++i)
            for (int64_t c = 0; c < r; ++c) {
              a->B1[(e * N1 + gate_row0 + i) * r1 + c] = fold(s, bg[(e * I + i) * r + c]);
              a->B1[(e * N1 + up_row0 + i) * r1 + r + c] = fold(s, bu[(e * I + i) * r + c]);
            }
      }
    }
  } else {
    const char* lname = d.layout == LoraLayout::PeftFused ? "PeftFused" : "SharedOuter";
    require_absent(d.a_gate, "a_gate", lname);
    require_absent(d.a_up, "a_up", lname);
    require_absent(d.b_gate, "b_gate", lname);
    require_absent(d.b_up, "b_up", lname);
    if (pair_present(d.a_gate_up, "a_gate_up", d.b_gate_up, "b_gate_up")) {
      a->has_gate_up = true;
      a->r1 = r;
      if (d.layout == LoraLayout::PeftFused)
        a->A1 = read_bf16(d.a_gate_up, "a_gate_up", {E, r, H});
      else
        a->A1 = read_bf16(d.a_gate_up, "a_gate_up", {r, H});
      std::vector<uint16_t> b = read_bf16(d.b_gate_up, "b_gate_up", {E, N1, r});
      a->B1 = fold_reorder(b, E, I, r, w.gated, w.order, s);
    }
  }

  // ---- down ----------------------------------------------------------------------------------------
  if (pair_present(d.a_down, "a_down", d.b_down, "b_down")) {
    a->has_down = true;
    a->r2 = r;
    a->A2 = read_bf16(d.a_down, "a_down", {E, r, I});
    if (d.layout == LoraLayout::SharedOuter)
      a->B2 = fold_all(read_bf16(d.b_down, "b_down", {H, r}), s);
    else
      a->B2 = fold_all(read_bf16(d.b_down, "b_down", {E, H, r}), s);
  }

  // ---- the shared expert's own LoRA (dense, E = 1) ----------------------------------------------------
  const bool sg = pair_present(d.shared_a_gate_up, "shared_a_gate_up", d.shared_b_gate_up, "shared_b_gate_up");
  const bool sd = pair_present(d.shared_a_down, "shared_a_down", d.shared_b_down, "shared_b_down");
  if (sg || sd) {
    if (!shared)
      invalid(sg ? "shared_a_gate_up" : "shared_a_down",
          "expected no shared-expert LoRA (the registry was built without a shared expert), got one");
    const PreparedWeights& sw = shared->impl();
    a->has_shared = true;
    a->s_r = r;
    a->s_I = sw.I;
    a->s_N1 = sw.n1();
    if (sg) {
      a->s_has_gate_up = true;
      a->sA1 = read_bf16(d.shared_a_gate_up, "shared_a_gate_up", {r, H});
      std::vector<uint16_t> b = read_bf16(d.shared_b_gate_up, "shared_b_gate_up", {sw.n1(), r});
      a->sB1 = fold_reorder(b, 1, sw.I, r, sw.gated, sw.order, s);
    }
    if (sd) {
      a->s_has_down = true;
      a->sA2 = read_bf16(d.shared_a_down, "shared_a_down", {r, sw.I});
      a->sB2 = fold_all(read_bf16(d.shared_b_down, "shared_b_down", {H, r}), s);
    }
  }

#ifdef FP4MOE_WITH_CUDA
  if (w.backend == Backend::CUDA) a->device = cuda_backend::prepare_device_adapter(*a, w.device_id);
#endif
  return a;
}

const char* to_string(LoraLayout l) {
  switch (l) {
    case LoraLayout::PerExpert: return "per_expert";
    case LoraLayout::PeftFused: return "peft_fused";
    case LoraLayout::SharedOuter: return "shared_outer";
  }
  return "?";
}

void AdapterRegistry::load(int slot, const LoraAdapterDesc& adapter) {
  if (slot < 0 || slot >= state_->num_slots)
    invalid("slot", "expected 0.." + std::to_string(state_->num_slots - 1) + ", got " + std::to_string(slot));
  // Convert outside the lock: it copies and (for CUDA) uploads, and must not stall snapshot().
  std::shared_ptr<const PreparedAdapter> prepared = state_->convert(adapter);
  std::lock_guard<std::mutex> lock(state_->mu);
  auto next = std::make_shared<std::vector<std::shared_ptr<const PreparedAdapter>>>(*state_->table);
  (*next)[static_cast<size_t>(slot)] = std::move(prepared);
  state_->table = std::move(next);
}

void AdapterRegistry::unload(int slot) {
  if (slot < 0 || slot >= state_->num_slots)
    invalid("slot", "expected 0.." + std::to_string(state_->num_slots - 1) + ", got " + std::to_string(slot));
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!(*state_->table)[static_cast<size_t>(slot)])
    throw Error(ErrorCode::NotFound, "slot", "expected a loaded adapter in slot " + std::to_string(slot) + ", got an empty slot");
  auto next = std::make_shared<std::vector<std::shared_ptr<const PreparedAdapter>>>(*state_->table);
  (*next)[static_cast<size_t>(slot)].reset();
  state_->table = std::move(next);
}

bool AdapterRegistry::loaded(int slot) const {
  if (slot < 0 || slot >= state_->num_slots)
    invalid("slot", "expected 0.." + std::to_string(state_->num_slots - 1) + ", got " + std::to_string(slot));
  std::lock_guard<std::mutex> lock(state_->mu);
  return (*state_->table)[static_cast<size_t>(slot)] != nullptr;
}

AdapterSnapshot AdapterRegistry::snapshot() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->table;
}

}  // namespace fp4moe
