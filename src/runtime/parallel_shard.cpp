// Tensor / expert parallelism on the host, the sharding half: cutting a layer's weights and adapters into
// TP shards or EP expert slices, and the expert window of a rank (include/fp4moe/parallel.h). Host memory only;
// the communicators and the parallel run calls are in parallel.cpp.
#include "fp4moe/parallel.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "fp4moe/mxfp4.h"
#include "fp4moe/nvfp4.h"
#include "runtime/host_tensor.h"

namespace fp4moe {
using detail::invalid;

namespace {

void check_rank_world(int rank, int world) {
  if (world < 1) invalid("world", "expected >= 1, got " + std::to_string(world));
  if (rank < 0 || rank >= world)
    invalid("rank", "expected in [0, world=" + std::to_string(world) + "), got " + std::to_string(rank));
}

// A host, contiguous tensor of the expected dtype size and shape (numel when `shape` is empty).
void check_host(const TensorView& v, const char* name, size_t elem_size, std::initializer_list<int64_t> shape) {
  if (!v.present()) invalid(name, "is required but absent");
  if (v.device != Backend::CPU) invalid(name, "expected a host tensor (the sharding helpers read host memory)");
  if (dtype_size(v.dtype) != elem_size)
    invalid(name, std::string("expected ") + std::to_string(elem_size) + "-byte elements, got " + to_string(v.dtype));
  if (!v.is_contiguous()) invalid(name, "expected a contiguous tensor");
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  if (v.numel() != n) {
    std::string want = "[";
    for (int64_t s : shape) want += std::to_string(s) + ",";
    want.back() = ']';
    invalid(name, "expected shape " + want + " (" + std::to_string(n) + " elements), got " + v.shape_str());
  }
}

struct Range {
  int64_t begin, len;
};

// Selects `ranges` (concatenated, in order) along dimension `dim` of a contiguous tensor `shape` of
// `es`-byte elements. Returns the bytes of the result (contiguous).
std::vector<uint8_t> select(const void* src, size_t es, const std::vector<int64_t>& shape, int dim,
                            const std::vector<Range>& ranges) {
  int64_t outer = 1, inner = static_cast<int64_t>(es);
  for (int i = 0; i < dim; ++i) outer *= shape[i];
  for (size_t i = dim + 1; i < shape.size(); ++i) inner *= shape[i];
  int64_t out_len = 0;
  for (const Range& r : ranges) out_len += r.len;
  std::vector<uint8_t> out(static_cast<size_t>(outer * out_len * inner));
  const auto* s = static_cast<const uint8_t*>(src);
  uint8_t* d = out.data();
  for (int64_t o = 0; o < outer; ++o)
    for (const Range& r : ranges) {
      const size_t n = static_cast<size_t>(r.len * inner);
      std::memcpy(d, s + (o * shape[dim] + r.begin) * inner, n);
      d += n;
    }
  return out;
}

template <class T> std::vector<T> as_vec(const std::vector<uint8_t>& b) {
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// Linear e4m3 codes [E, N, K/16] of a weight's block scales (linear or swizzled per expert).
std::vector<uint8_t> linear_scales(const TensorView& sc, const char* name, ScaleLayout layout, int64_t E, int64_t N,
                                   int64_t Kb) {
  if (layout == ScaleLayout::Linear) {
    check_host(sc, name, 1, {E, N, Kb});
    const auto* p = sc.as<uint8_t>();
    return std::vector<uint8_t>(p, p + E * N * Kb);
  }
  const int64_t per = nvfp4::swizzled_size(N, Kb);
  check_host(sc, name, 1, {E, per});
  std::vector<uint8_t> lin(static_cast<size_t>(E * N * Kb));
  for (int64_t e = 0; e < E; ++e) nvfp4::unswizzle_scales(sc.as<uint8_t>() + e * per, N, Kb, lin.data() + e * N * Kb);
  return lin;
}

std::vector<float> copy_f32(const TensorView& v, const char* name, int64_t n) {
  check_host(v, name, 4, {n});
  if (v.dtype != DType::F32) invalid(name, std::string("expected float32, got ") + to_string(v.dtype));
  return std::vector<float>(v.as<float>(), v.as<float>() + n);
}

void check_common(const WeightsDesc& d) {
  if (d.num_experts < 1) invalid("num_experts", "expected >= 1, got " + std::to_string(d.num_experts));
  if (d.hidden < 16 || d.hidden % 16) invalid("hidden", "expected a positive multiple of 16, got " + std::to_string(d.hidden));
  if (d.inter < 16 || d.inter % 16) invalid("inter", "expected a positive multiple of 16, got " + std::to_string(d.inter));
  if (d.format == WeightFormat::MXFP4 && (d.hidden % mxfp4::kBlock || d.inter % mxfp4::kBlock))
    invalid(d.hidden % mxfp4::kBlock ? "hidden" : "inter", "expected a multiple of 32 (whole MXFP4 blocks)");
}

// Copies / slices a WeightsDesc. rows1: W1 row ranges per half-block; cols2: W2 column range (elements);
// experts: expert range; keep_bias2: whether bias2 survives.
OwnedWeights cut(const WeightsDesc& d, Range experts, int64_t Inew, const std::vector<Range>& rows1, Range cols2,
                 bool keep_bias2) {
  check_common(d);
  const int64_t E = d.num_experts, H = d.hidden, I = d.inter, N1 = d.gated ? 2 * I : I;
  const int64_t En = experts.len;
  const std::vector<Range> ex = {experts};
  OwnedWeights o;
  o.format = d.format;
  o.order = d.order;
  o.scale_layout = ScaleLayout::Linear;
  o.gated = d.gated;
  o.E = En;
  o.H = H;
  o.I = Inew;
  auto both = [&](const void* src, size_t es, std::vector<int64_t> shape, int dim, const std::vector<Range>& r) {
    std::vector<uint8_t> a = select(src, es, shape, 0, ex);
    shape[0] = En;
    return select(a.data(), es, shape, dim, r);
  };
  if (is_fp4(d.format)) {
    const int64_t bs = d.format == WeightFormat::MXFP4 ? mxfp4::kBlock : nvfp4::kBlock;  // elements a block scale
    const ScaleLayout layout = d.format == WeightFormat::MXFP4 ? ScaleLayout::Linear : d.scale_layout;
    check_host(d.w1, "w1", 1, {E, N1, H / 2});
    check_host(d.w2, "w2", 1, {E, H, I / 2});
    o.w1 = both(d.w1.data, 1, {E, N1, H / 2}, 1, rows1);
    const std::vector<uint8_t> s1 = linear_scales(d.w1_scale, "w1_scale", layout, E, N1, H / bs);
    o.w1_scale = both(s1.data(), 1, {E, N1, H / bs}, 1, rows1);
    o.w2 = both(d.w2.data, 1, {E, H, I / 2}, 2, {{cols2.begin / 2, cols2.len / 2}});
    const std::vector<uint8_t> s2 = linear_scales(d.w2_scale, "w2_scale", layout, E, H, I / bs);
    o.w2_scale = both(s2.data(), 1, {E, H, I / bs}, 2, {{cols2.begin / bs, cols2.len / bs}});
  }
  if (d.format == WeightFormat::NVFP4) {
    // scale2: [E, 2] per half or [E]; copied as given (per expert, unchanged by a TP shard).
    const int64_t per = d.w1_scale2.present() && d.w1_scale2.numel() == 2 * E ? 2 : 1;
    o.w1_scale2 = copy_f32(d.w1_scale2, "w1_scale2", per * E);
    o.w1_scale2.erase(o.w1_scale2.begin(), o.w1_scale2.begin() + experts.begin * per);
    o.w1_scale2.resize(static_cast<size_t>(En * per));
    o.w2_scale2 = copy_f32(d.w2_scale2, "w2_scale2", E);
    o.w2_scale2 = std::vector<float>(o.w2_scale2.begin() + experts.begin, o.w2_scale2.begin() + experts.begin + En);
  } else if (d.format == WeightFormat::BF16) {
    check_host(d.w1, "w1", 2, {E, N1, H});
    check_host(d.w2, "w2", 2, {E, H, I});
    o.w1_bf16 = as_vec<uint16_t>(both(d.w1.data, 2, {E, N1, H}, 1, rows1));
    o.w2_bf16 = as_vec<uint16_t>(both(d.w2.data, 2, {E, H, I}, 2, {cols2}));
  }
  if (d.bias1.present()) {
    check_host(d.bias1, "bias1", 4, {E, N1});
    o.bias1 = as_vec<float>(both(d.bias1.data, 4, {E, N1}, 1, rows1));
  }
  if (d.bias2.present()) {
    check_host(d.bias2, "bias2", 4, {E, H});
    if (keep_bias2) o.bias2 = as_vec<float>(select(d.bias2.data, 4, {E, H}, 0, ex));
  }
  return o;
}

int64_t tp_inter(int64_t I, int world, int64_t block = 16) {
  if (I % world != 0 || (I / world) % block != 0)
    invalid("world", "I=" + std::to_string(I) + " split over world=" + std::to_string(world) + " must give a multiple of " +
                     std::to_string(block) + " per rank (whole " + (block == 32 ? "MXFP4 blocks of 32" : "NVFP4 blocks of 16") +
                     " elements)");
  return I / world;
}

// Adapter tensors: copies a bf16 host tensor selection into the adapter's storage and returns its view.
struct AdapterBuilder {
  ShardedAdapter& o;
  TensorView take(const TensorView& v, const char* name, std::vector<int64_t> shape, int dim,
                  const std::vector<Range>& ranges) {
    if (!v.present()) return TensorView{};
    if (v.device != Backend::CPU) invalid(name, "expected a host tensor");
    if (v.dtype != DType::BF16) invalid(name, std::string("expected bfloat16, got ") + to_string(v.dtype));
    if (!v.is_contiguous()) invalid(name, "expected a contiguous tensor");
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    if (v.numel() != n) invalid(name, "expected " + std::to_string(n) + " elements, got shape " + v.shape_str());
    o.storage.push_back(as_vec<uint16_t>(select(v.data, 2, shape, dim, ranges)));
    int64_t out_len = 0;
    for (const Range& r : ranges) out_len += r.len;
    shape[dim] = out_len;
    TensorView t;
    t.data = o.storage.back().data();
    t.dtype = DType::BF16;
    t.ndim = static_cast<int>(shape.size());
    int64_t st = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      t.shape[i] = shape[i];
      t.stride[i] = st;
      st *= shape[i];
    }
    return t;
  }
};

// Leading dims of a tensor, for adapters whose E / H we infer from their own shapes.
int64_t dim_of(const TensorView& v, int i) { return v.present() && i < v.ndim ? v.shape[i] : 0; }

}  // namespace

// ---- sharding -----------------------------------------------------------------------------------------
OwnedWeights shard_weights_tp(const WeightsDesc& full, int rank, int world) {
  check_rank_world(rank, world);
  check_common(full);
  const int64_t I = full.inter, Is = tp_inter(I, world, full.format == WeightFormat::MXFP4 ? mxfp4::kBlock : 16);
  std::vector<Range> rows1 = {{rank * Is, Is}};
  if (full.gated) rows1.push_back({I + rank * Is, Is});  // the second half, whatever the half order
  return cut(full, {0, full.num_experts}, Is, rows1, {rank * Is, Is}, rank == 0);
}

OwnedWeights slice_experts(const WeightsDesc& full, int64_t begin, int64_t count) {
  check_common(full);
  if (begin < 0 || count < 1 || begin + count > full.num_experts)
    invalid("begin", "expert range [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                     ") not inside [0, " + std::to_string(full.num_experts) + ")");
  std::vector<Range> rows1 = {{0, full.gated ? 2 * full.inter : full.inter}};
  return cut(full, {begin, count}, full.inter, rows1, {0, full.inter}, true);
}

ShardedAdapter shard_adapter_tp(const LoraAdapterDesc& d, int64_t inter, int rank, int world, int64_t shared_inter) {
  check_rank_world(rank, world);
  if (inter < 16 || inter % 16) invalid("inter", "expected a positive multiple of 16, got " + std::to_string(inter));
  const int64_t I = inter, Is = tp_inter(I, world), r = d.rank;
  if (r < 1) invalid("rank", "the adapter's LoRA rank must be >= 1, got " + std::to_string(r));
  ShardedAdapter o;
  o.desc = d;
  AdapterBuilder b{o};
  auto keep = [&](const TensorView& v, const char* name) {
    if (!v.present()) return TensorView{};
    std::vector<int64_t> shape(v.shape, v.shape + v.ndim);
    return b.take(v, name, shape, 0, {{0, shape[0]}});
  };
  const std::vector<Range> halves = {{rank * Is, Is}, {I + rank * Is, Is}};
  const std::vector<Range> one = {{rank * Is, Is}};
  if (d.layout == LoraLayout::PerExpert) {
    const int64_t E = dim_of(d.b_gate, 0) ? dim_of(d.b_gate, 0) : dim_of(d.a_down, 0);
    o.desc.a_gate = keep(d.a_gate, "a_gate");
    o.desc.a_up = keep(d.a_up, "a_up");
    o.desc.b_gate = b.take(d.b_gate, "b_gate", {E, I, r}, 1, one);
    o.desc.b_up = b.take(d.b_up, "b_up", {E, I, r}, 1, one);
  } else {
    o.desc.a_gate_up = keep(d.a_gate_up, "a_gate_up");
    const int64_t E = dim_of(d.b_gate_up, 0);
    if (d.b_gate_up.present()) {
      const int64_t N1 = dim_of(d.b_gate_up, 1);
      if (N1 != I && N1 != 2 * I) invalid("b_gate_up", "expected [E, 2I or I, r] with I=" + std::to_string(I) + ", got " + d.b_gate_up.shape_str());
      o.desc.b_gate_up = b.take(d.b_gate_up, "b_gate_up", {E, N1, r}, 1, N1 == 2 * I ? halves : one);
    }
  }
  // down: A2's K dim is I -> columns sharded; B2 replicated.
  if (d.a_down.present()) {
    const int64_t E = dim_of(d.a_down, 0);
    o.desc.a_down = b.take(d.a_down, "a_down", {E, r, I}, 2, one);
  }
  o.desc.b_down = keep(d.b_down, "b_down");
  // The shared expert's LoRA, sharded like the shared expert (shard_weights_tp with E = 1).
  const bool has_shared = d.shared_a_gate_up.present() || d.shared_a_down.present();
  if (has_shared) {
    if (shared_inter < 16 || shared_inter % 16)
      invalid("shared_inter", "the adapter has shared-expert LoRA: expected the shared expert's full I (multiple of 16), got " +
                              std::to_string(shared_inter));
    const int64_t SI = shared_inter, SIs = tp_inter(SI, world);
    o.desc.shared_a_gate_up = keep(d.shared_a_gate_up, "shared_a_gate_up");
    if (d.shared_b_gate_up.present()) {
      const int64_t N1 = dim_of(d.shared_b_gate_up, 0);
      if (N1 != SI && N1 != 2 * SI) invalid("shared_b_gate_up", "expected [2I or I, r], got " + d.shared_b_gate_up.shape_str());
      const std::vector<Range> sh = N1 == 2 * SI ? std::vector<Range>{{rank * SIs, SIs}, {SI + rank * SIs, SIs}}
                                                 : std::vector<Range>{{rank * SIs, SIs}};
      o.desc.shared_b_gate_up = b.take(d.shared_b_gate_up, "shared_b_gate_up", {N1, r}, 0, sh);
    }
    if (d.shared_a_down.present())
      o.desc.shared_a_down = b.take(d.shared_a_down, "shared_a_down", {r, SI}, 1, {{rank * SIs, SIs}});
    o.desc.shared_b_down = keep(d.shared_b_down, "shared_b_down");
  }
  return o;
}

ShardedAdapter slice_adapter_experts(const LoraAdapterDesc& d, int64_t num_experts, int64_t begin, int64_t count) {
  if (num_experts < 1) invalid("num_experts", "expected >= 1, got " + std::to_string(num_experts));
  if (begin < 0 || count < 1 || begin + count > num_experts)
    invalid("begin", "expert range [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                     ") not inside [0, " + std::to_string(num_experts) + ")");
  ShardedAdapter o;
  o.desc = d;
  AdapterBuilder b{o};
  auto per_expert = [&](const TensorView& v, const char* name) {
    if (!v.present()) return TensorView{};
    if (v.ndim < 2 || v.shape[0] != num_experts)
      invalid(name, "expected a leading expert dim of " + std::to_string(num_experts) + ", got " + v.shape_str());
    std::vector<int64_t> shape(v.shape, v.shape + v.ndim);
    return b.take(v, name, shape, 0, {{begin, count}});
  };
  auto keep = [&](const TensorView& v, const char* name) {
    if (!v.present()) return TensorView{};
    std::vector<int64_t> shape(v.shape, v.shape + v.ndim);
    return b.take(v, name, shape, 0, {{0, shape[0]}});
  };
  const bool shared_outer = d.layout == LoraLayout::SharedOuter;
  o.desc.a_gate = per_expert(d.a_gate, "a_gate");
  o.desc.a_up = per_expert(d.a_up, "a_up");
  o.desc.b_gate = per_expert(d.b_gate, "b_gate");
  o.desc.b_up = per_expert(d.b_up, "b_up");
  o.desc.a_gate_up = shared_outer ? keep(d.a_gate_up, "a_gate_up") : per_expert(d.a_gate_up, "a_gate_up");
  o.desc.b_gate_up = per_expert(d.b_gate_up, "b_gate_up");
  o.desc.a_down = per_expert(d.a_down, "a_down");
  o.desc.b_down = shared_outer ? keep(d.b_down, "b_down") : per_expert(d.b_down, "b_down");
  o.desc.shared_a_gate_up = keep(d.shared_a_gate_up, "shared_a_gate_up");
  o.desc.shared_b_gate_up = keep(d.shared_b_gate_up, "shared_b_gate_up");
  o.desc.shared_a_down = keep(d.shared_a_down, "shared_a_down");
  o.desc.shared_b_down = keep(d.shared_b_down, "shared_b_down");
  return o;
}

ExpertWindow expert_window(int64_t num_experts_total, int rank, int world) {
  check_rank_world(rank, world);
  if (num_experts_total < world)
    invalid("num_experts_total", "expected >= world=" + std::to_string(world) + " (every rank holds an expert), got " +
                                 std::to_string(num_experts_total));
  const int64_t base = num_experts_total / world, extra = num_experts_total % world;
  ExpertWindow w;
  w.count = base + (rank < extra ? 1 : 0);
  w.offset = rank * base + std::min<int64_t>(rank, extra);
  return w;
}

}  // namespace fp4moe
