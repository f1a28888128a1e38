// MoE layers of checkpoint directories (include/fp4moe/checkpoint.h): the layer plan, the checks of a layer,
// reading this rank's part, and inspect. The files and the config: io/checkpoint_files.h.
#include "fp4moe/checkpoint.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "fp4moe/parallel.h"  // ExpertWindow
#include "io/checkpoint_files.h"

namespace fp4moe {

namespace {

using namespace ckpt;  // NOLINT: the reader's own helpers

// ---- the layer plan --------------------------------------------------------------------------------------
struct ExpertsPlan {
  bool nvfp4 = false;
  bool mxfp4 = false;  // gpt-oss's fused MXFP4 experts (the tensors below instead of `experts`)
  int64_t E = 0, H = 0, I = 0;
  std::vector<std::array<Linear, 3>> experts;  // gate, up, down
  std::string blocks1, scales1, bias1, blocks2, scales2, bias2;  // MXFP4: [E, N, K/32, 16], [E, N, K/32], [E, N]
  uint64_t bytes = 0;
  WeightFormat format() const { return mxfp4 ? WeightFormat::MXFP4 : nvfp4 ? WeightFormat::NVFP4 : WeightFormat::BF16; }
  const char* format_name() const { return mxfp4 ? "mxfp4" : nvfp4 ? "nvfp4" : "bf16"; }
};

struct LayerPlan {
  std::string prefix, architecture;
  ExpertsPlan routed;
  bool has_shared = false;
  ExpertsPlan shared;
  std::string shared_gate;  // Qwen2-MoE / Qwen3-Next: the shared expert's sigmoid gate [1, H], or ""
  std::string router, router_bias, correction_bias;
  uint64_t bytes = 0;
};

// {layer: "<prefix>layers.N.<block>."} of the layers whose tensor names include experts.
std::map<int, std::string> moe_layers(const Store& s) {
  std::map<int, std::string> out;
  for (const auto& [n, f] : s.where) {
    size_t pos = 0;
    while ((pos = n.find("layers.", pos)) != std::string::npos) {
      if (pos > 0 && n[pos - 1] != '.') {
        pos += 7;
        continue;
      }
      size_t p = pos + 7, q = p;
      while (q < n.size() && std::isdigit(static_cast<unsigned char>(n[q]))) ++q;
      if (q == p || q >= n.size() || n[q] != '.' || q - p > 6) break;
      for (const char* blk : {"mlp.", "block_sparse_moe."}) {
        const std::string b = blk;
        if (n.compare(q + 1, b.size(), b) == 0 && n.compare(q + 1 + b.size(), 8, "experts.") == 0) {
          const int L = std::stoi(n.substr(p, q - p));
          const std::string pre = n.substr(0, q + 1 + b.size());
          auto it = out.find(L);
          if (it != out.end() && it->second != pre)
            fail(s.root.string() + ": layer " + std::to_string(L) + " has experts under two prefixes (" + it->second +
                 ", " + pre + ")");
          out[L] = pre;
        }
      }
      break;
    }
  }
  return out;
}

ExpertsPlan plan_experts(Store& s, const std::string& base, const std::vector<int>& ids, const std::string& what) {
  static const char* const kNames[2][3] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};
  const std::string probe = ids.empty() ? base : base + std::to_string(ids[0]) + ".";
  int fam = -1;
  for (int f = 0; f < 2 && fam < 0; ++f)
    if (s.has(probe + kNames[f][2] + ".weight") || s.has(probe + kNames[f][2] + ".weight_packed")) fam = f;
  if (fam < 0)
    fail(s.root.string() + ": " + what + ": no down projection ('" + probe + "down_proj.weight' or '" + probe + "w2.weight')",
         ErrorCode::NotFound);
  const std::string dn = s.has(probe + kNames[fam][2] + ".weight_packed") ? probe + kNames[fam][2] + ".weight_packed"
                                                                           : probe + kNames[fam][2] + ".weight";
  const st::TensorInfo& d = s.info(dn);
  if (d.shape.size() != 2) fail(s.path_of(dn) + ": tensor '" + dn + "': expected a 2-D weight, got shape " + shape_str(d.shape));
  ExpertsPlan p;
  p.H = d.shape[0];
  p.I = d.shape[1] * (d.dtype_name == "U8" ? 2 : 1);
  if (p.H % 16 || p.I % 16)
    fail(s.path_of(dn) + ": tensor '" + dn + "': H=" + std::to_string(p.H) + " and I=" + std::to_string(p.I) +
         " must be multiples of 16");
  const std::vector<int> list = ids.empty() ? std::vector<int>{-1} : ids;
  auto who = [](int e) { return e < 0 ? std::string("the shared expert") : "expert " + std::to_string(e); };
  auto fmt_name = [&](const Linear& l) { return l.nvfp4 ? std::string("NVFP4") : s.info(l.w).dtype_name; };
  std::optional<Linear> first;  // a copy: p.experts grows
  int first_e = 0;
  for (int e : list) {
    const std::string m = e < 0 ? base : base + std::to_string(e) + ".";
    std::array<Linear, 3> lin = {plan_linear(s, m + kNames[fam][0], p.I, p.H), plan_linear(s, m + kNames[fam][1], p.I, p.H),
                                 plan_linear(s, m + kNames[fam][2], p.H, p.I)};
    for (const auto& l : lin) p.bytes += l.bytes;
    p.experts.push_back(std::move(lin));
    for (const auto& l : p.experts.back()) {
      if (!first) {
        first = l, first_e = e;
      } else if (l.nvfp4 != first->nvfp4) {
        fail(s.path_of(l.w) + ": tensor '" + l.w + "' (" + who(e) + ") is " + fmt_name(l) + " but '" + first->w + "' (" +
             who(first_e) + ") is " + fmt_name(*first) + ": the linears of " + what + " must share one format");
      }
    }
  }
  p.nvfp4 = first->nvfp4;
  p.E = static_cast<int64_t>(p.experts.size());
  return p;
}

// gpt-oss's MXFP4 experts under `base` (mlp.experts.): gate_up_proj_{blocks,scales,bias} with 2I rows (gate j at
// row 2j, up j at 2j+1) and down_proj_{blocks,scales,bias}; the format must be the config's (quant_method mxfp4).
ExpertsPlan plan_mxfp4(Store& s, const std::string& base) {
  const std::string gu = base + "gate_up_proj", dn = base + "down_proj";
  if (s.quant.method != "mxfp4")
    fail(s.path_of(gu + "_blocks") + ": tensor '" + gu + "_blocks' is MXFP4 but " + s.quant.source + " says " +
         s.quant.describe() + " (MXFP4 experts need quantization_config.quant_method 'mxfp4')");
  const st::TensorInfo& b1 = s.info(gu + "_blocks");
  if (b1.shape.size() != 4 || b1.shape[3] != 16)
    fail(s.path_of(gu + "_blocks") + ": tensor '" + gu + "_blocks': expected [E, 2I, H/32, 16], got " + shape_str(b1.shape));
  ExpertsPlan p;
  p.mxfp4 = true;
  p.E = b1.shape[0];
  p.H = 32 * b1.shape[2];
  p.I = b1.shape[1] / 2;
  const int64_t E = p.E, H = p.H, n1 = b1.shape[1];
  if (n1 % 2) fail(s.path_of(gu + "_blocks") + ": tensor '" + gu + "_blocks': expected 2I (gate and up) rows, got " + std::to_string(n1));
  const st::TensorInfo& b2 = s.info(dn + "_blocks");
  if (b2.shape.size() != 4 || b2.shape[0] != E || b2.shape[1] != H || 32 * b2.shape[2] != p.I || b2.shape[3] != 16)
    fail(s.path_of(dn + "_blocks") + ": tensor '" + dn + "_blocks': expected " + shape_str({E, H, p.I / 32, 16}) +
         " to match '" + gu + "_blocks' " + shape_str(b1.shape) + ", got " + shape_str(b2.shape));
  p.blocks1 = gu + "_blocks";
  p.blocks2 = dn + "_blocks";
  p.scales1 = gu + "_scales";
  p.scales2 = dn + "_scales";
  expect(s, p.blocks1, {"U8"}, {E, n1, H / 32, 16});
  expect(s, p.scales1, {"U8"}, {E, n1, H / 32}, " to match '" + p.blocks1 + "'");
  expect(s, p.blocks2, {"U8"}, {E, H, p.I / 32, 16});
  expect(s, p.scales2, {"U8"}, {E, H, p.I / 32}, " to match '" + p.blocks2 + "'");
  if (s.has(gu + "_bias")) expect(s, p.bias1 = gu + "_bias", {"BF16", "F16", "F32"}, {E, n1});
  if (s.has(dn + "_bias")) expect(s, p.bias2 = dn + "_bias", {"BF16", "F16", "F32"}, {E, H});
  for (const std::string& n : {p.blocks1, p.scales1, p.bias1, p.blocks2, p.scales2, p.bias2})
    if (!n.empty()) p.bytes += s.info(n).end - s.info(n).begin;
  return p;
}

LayerPlan plan_layer(Store& s, int layer) {
  const auto layers = moe_layers(s);
  auto it = layers.find(layer);
  if (it == layers.end()) {
    std::string have;
    int n = 0;
    for (const auto& [L, p] : layers)
      if (n++ < 8) have += (have.empty() ? "" : ", ") + std::to_string(L);
    fail(s.root.string() + ": layer " + std::to_string(layer) + " has no MoE experts (MoE layers: [" + have +
             (layers.size() > 8 ? ", ..." : "") + "])",
         ErrorCode::NotFound);
  }
  LayerPlan p;
  p.prefix = it->second;
  const std::string base = p.prefix + "experts.";
  std::set<int> ids;
  for (const auto& [n, f] : s.where) {
    if (n.compare(0, base.size(), base) != 0) continue;
    size_t q = base.size();
    while (q < n.size() && std::isdigit(static_cast<unsigned char>(n[q]))) ++q;
    if (q > base.size() && q < n.size() && n[q] == '.' && q - base.size() < 7) ids.insert(std::stoi(n.substr(base.size(), q - base.size())));
  }
  if (ids.empty() && s.has(base + "gate_up_proj_blocks")) {
    p.routed = plan_mxfp4(s, base);
    p.architecture = "GPT-OSS";
  } else if (ids.empty()) {
    if (s.has(base + "gate_up_proj"))
      fail(s.path_of(base + "gate_up_proj") + ": tensor '" + base + "gate_up_proj': fused expert tensors are read by the "
           "Python loader (fp4moe.load_moe_layer), not by the C++ one", ErrorCode::Unsupported);
    fail(s.root.string() + ": layer " + std::to_string(layer) + ": no expert tensors under '" + base + "'", ErrorCode::NotFound);
  }
  if (!p.routed.mxfp4) {
    std::vector<int> idv(ids.begin(), ids.end());
    for (int i = 0; i < static_cast<int>(idv.size()); ++i)
      if (idv[i] != i)
        fail(s.root.string() + ": tensor '" + base + std::to_string(i) + ".*' is missing (experts 0.." +
                 std::to_string(idv.back()) + " expected)",
             ErrorCode::NotFound);
    p.routed = plan_experts(s, base, idv, "layer " + std::to_string(layer) + " experts");
    const std::string mt = s.model_type();
    const bool mixtral_block = p.prefix.size() >= 17 && p.prefix.compare(p.prefix.size() - 17, 17, "block_sparse_moe.") == 0;
    if (mt == "mixtral" || mixtral_block) p.architecture = "Mixtral";
    else if (mt == "qwen3_moe") p.architecture = "Qwen3-MoE";
    else if (mt == "qwen2_moe") p.architecture = "Qwen2-MoE";
    else if (mt == "qwen3_next") p.architecture = "Qwen3-Next";
    else if (mt == "deepseek_v3") p.architecture = "DeepSeek-V3";
    else if (mt == "kimi_k2") p.architecture = "Kimi-K2";
    else p.architecture = mt.empty() ? "per-expert MoE" : mt;
  }
  for (const char* sname : {"shared_experts.", "shared_expert."}) {
    const std::string sb = p.prefix + sname;
    if (!s.has(sb + "down_proj.weight") && !s.has(sb + "down_proj.weight_packed")) continue;
    p.shared = plan_experts(s, sb, {}, "layer " + std::to_string(layer) + " shared expert");
    p.has_shared = true;
    if (p.shared.H != p.routed.H)
      fail(s.root.string() + ": layer " + std::to_string(layer) + ": the shared expert's H differs from the experts' H");
  }
  const int64_t E = p.routed.E, H = p.routed.H;
  const std::string gate = p.prefix + "shared_expert_gate.weight";
  if (s.has(gate)) {  // sigmoid(x . g) scales the shared expert (SPEC §3.3)
    if (!p.has_shared)
      fail(s.path_of(gate) + ": tensor '" + gate + "': a shared-expert gate without a shared expert ('" + p.prefix +
           "shared_expert.down_proj.weight')");
    expect(s, gate, {"BF16", "F16", "F32"}, {1, H}, " (the shared expert's gate [1, H])");
    p.shared_gate = gate;
  }
  for (const char* rname : {"gate.", "router."}) {  // router.: gpt-oss, with a bias
    if (!s.has(p.prefix + rname + "weight")) continue;
    p.router = p.prefix + rname + "weight";
    expect(s, p.router, {"BF16", "F16", "F32"}, {E, H}, " (the router [E, H])");
    if (s.has(p.prefix + rname + "bias")) expect(s, p.router_bias = p.prefix + rname + "bias", {"BF16", "F16", "F32"}, {E});
  }
  if (s.has(p.prefix + "gate.e_score_correction_bias")) {
    p.correction_bias = p.prefix + "gate.e_score_correction_bias";
    expect(s, p.correction_bias, {"BF16", "F16", "F32"}, {E});
  }
  p.bytes = p.routed.bytes + (p.has_shared ? p.shared.bytes : 0);
  for (const std::string& n : {p.router, p.router_bias, p.correction_bias, p.shared_gate})
    if (!n.empty()) p.bytes += s.info(n).end - s.info(n).begin;
  return p;
}

// ---- reading -----------------------------------------------------------------------------------------------
float read_scalar(Store& s, const std::string& name, bool inverse) {
  const std::vector<uint8_t> b = s.file(s.where.at(name)).read(s.info(name));
  float v;
  std::memcpy(&v, b.data(), 4);
  if (!std::isfinite(v) || v <= 0)
    fail(s.path_of(name) + ": tensor '" + name + "': expected a finite positive scale, got " + std::to_string(v));
  return inverse ? 1.f / v : v;
}

// Rows [r0, r0 + nr) of a row-major [rows, row_bytes] byte tensor, columns [c0, c0 + nc) bytes.
void copy_block(const std::vector<uint8_t>& src, int64_t row_bytes, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                uint8_t* dst) {
  for (int64_t r = 0; r < nr; ++r) std::memcpy(dst + r * nc, src.data() + (r0 + r) * row_bytes + c0, static_cast<size_t>(nc));
}

std::vector<float> read_f32(Store& s, const std::string& name);

// The empty weights of ne gated experts of p's format with ts intermediate rows, gate rows first.
OwnedWeights gated_weights(const ExpertsPlan& p, int64_t ne, int64_t ts) {
  OwnedWeights o;
  o.format = p.format();
  o.order = GateUpOrder::GateFirst;
  o.gated = true;
  o.E = ne;
  o.H = p.H;
  o.I = ts;
  return o;
}

// Experts [e0, e0 + ne) of a tensor whose leading dimension is E: only their bytes are read.
std::vector<uint8_t> read_experts_of(Store& s, const std::string& name, int64_t E, int64_t e0, int64_t ne,
                                     uint64_t* bytes) {
  st::TensorInfo t = s.info(name);
  const uint64_t per = (t.end - t.begin) / static_cast<uint64_t>(E);
  t.begin += per * static_cast<uint64_t>(e0);
  t.end = t.begin + per * static_cast<uint64_t>(ne);
  std::vector<uint8_t> b = s.file(s.where.at(name)).read(t);
  *bytes += b.size();
  return b;
}

// gpt-oss MXFP4 experts: the codes and E8M0 scales as they are in the file; W1 rows reordered gate rows first (this
// rank's TP rows of each half), W2's columns cut at block edges (t0 and ts multiples of 32).
OwnedWeights read_mxfp4(Store& s, const ExpertsPlan& p, int64_t e0, int64_t ne, int64_t t0, int64_t ts, bool rank0,
                        uint64_t* bytes) {
  OwnedWeights o = gated_weights(p, ne, ts);
  const int64_t H = p.H, I = p.I, n1 = 2 * ts;
  const std::vector<uint8_t> b1 = read_experts_of(s, p.blocks1, p.E, e0, ne, bytes);
  const std::vector<uint8_t> s1 = read_experts_of(s, p.scales1, p.E, e0, ne, bytes);
  const std::vector<uint8_t> b2 = read_experts_of(s, p.blocks2, p.E, e0, ne, bytes);
  const std::vector<uint8_t> s2 = read_experts_of(s, p.scales2, p.E, e0, ne, bytes);
  o.w1.resize(ne * n1 * H / 2);
  o.w1_scale.resize(ne * n1 * H / 32);
  o.w2.resize(ne * H * ts / 2);
  o.w2_scale.resize(ne * H * ts / 32);
  auto src_row = [&](int64_t r) { return r < ts ? 2 * (t0 + r) : 2 * (t0 + r - ts) + 1; };  // gate j: 2j, up j: 2j+1
  for (int64_t i = 0; i < ne; ++i) {
    for (int64_t r = 0; r < n1; ++r) {
      const int64_t src = i * 2 * I + src_row(r);
      std::memcpy(o.w1.data() + (i * n1 + r) * (H / 2), b1.data() + src * (H / 2), static_cast<size_t>(H / 2));
      std::memcpy(o.w1_scale.data() + (i * n1 + r) * (H / 32), s1.data() + src * (H / 32), static_cast<size_t>(H / 32));
    }
    copy_block(b2, I / 2, i * H, H, t0 / 2, ts / 2, o.w2.data() + i * H * (ts / 2));
    copy_block(s2, I / 32, i * H, H, t0 / 32, ts / 32, o.w2_scale.data() + i * H * (ts / 32));
  }
  if (!p.bias1.empty()) {
    const std::vector<float> b = read_f32(s, p.bias1);
    *bytes += s.info(p.bias1).end - s.info(p.bias1).begin;
    o.bias1.resize(ne * n1);
    for (int64_t i = 0; i < ne; ++i)
      for (int64_t r = 0; r < n1; ++r) o.bias1[i * n1 + r] = b[(e0 + i) * 2 * I + src_row(r)];
  }
  if (!p.bias2.empty() && rank0) {  // SPEC §8: bias2 on TP rank 0 only
    const std::vector<float> b = read_f32(s, p.bias2);
    *bytes += s.info(p.bias2).end - s.info(p.bias2).begin;
    o.bias2.assign(b.begin() + e0 * H, b.begin() + (e0 + ne) * H);
  }
  return o;
}

OwnedWeights read_experts(Store& s, const ExpertsPlan& p, int64_t e0, int64_t ne, int64_t t0, int64_t ts,
                          uint64_t* bytes) {
  OwnedWeights o = gated_weights(p, ne, ts);
  const int64_t H = p.H, I = p.I, n1 = 2 * ts;
  auto raw = [&](const std::string& n) {
    std::vector<uint8_t> b = s.file(s.where.at(n)).read(s.info(n));
    *bytes += b.size();
    return b;
  };
  if (p.nvfp4) {
    o.w1.resize(ne * n1 * H / 2);
    o.w1_scale.resize(ne * n1 * H / 16);
    o.w1_scale2.resize(2 * ne);
    o.w2.resize(ne * H * ts / 2);
    o.w2_scale.resize(ne * H * ts / 16);
    o.w2_scale2.resize(ne);
  } else {
    o.w1_bf16.resize(ne * n1 * H);
    o.w2_bf16.resize(ne * H * ts);
  }
  for (int64_t i = 0; i < ne; ++i) {
    const auto& lin = p.experts[static_cast<size_t>(e0 + i)];
    for (int h = 0; h < 2; ++h) {
      const Linear& l = lin[h];
      if (p.nvfp4) {
        copy_block(raw(l.w), H / 2, t0, ts, 0, H / 2, o.w1.data() + (i * n1 + h * ts) * (H / 2));
        copy_block(raw(l.scale), H / 16, t0, ts, 0, H / 16, o.w1_scale.data() + (i * n1 + h * ts) * (H / 16));
        o.w1_scale2[2 * i + h] = read_scalar(s, l.scale2, l.inverse);
      } else {
        const std::vector<uint16_t> v = s.file(s.where.at(l.w)).read_bf16(s.info(l.w));
        *bytes += s.info(l.w).end - s.info(l.w).begin;
        std::memcpy(o.w1_bf16.data() + (i * n1 + h * ts) * H, v.data() + t0 * H, static_cast<size_t>(ts * H) * 2);
      }
    }
    const Linear& d = lin[2];
    if (p.nvfp4) {
      copy_block(raw(d.w), I / 2, 0, H, t0 / 2, ts / 2, o.w2.data() + i * H * (ts / 2));
      copy_block(raw(d.scale), I / 16, 0, H, t0 / 16, ts / 16, o.w2_scale.data() + i * H * (ts / 16));
      o.w2_scale2[i] = read_scalar(s, d.scale2, d.inverse);
    } else {
      const std::vector<uint16_t> v = s.file(s.where.at(d.w)).read_bf16(s.info(d.w));
      *bytes += s.info(d.w).end - s.info(d.w).begin;
      for (int64_t r = 0; r < H; ++r)
        std::memcpy(o.w2_bf16.data() + (i * H + r) * ts, v.data() + r * I + t0, static_cast<size_t>(ts) * 2);
    }
  }
  return o;
}

// The layer's A4 input scales and mode. The operator takes one per-tensor input scale per GEMM for all experts:
// the largest over every expert of the layer, as vLLM's and SGLang's NVFP4 MoE loaders take it. An EP rank reads
// them all (a few bytes each), so that every rank quantizes the activations alike and the ranks' sum is the
// layer's output. A4 only when every expert carries its input scales; otherwise A16 (the default on Hopper), and
// the reason says which tensor is missing.
struct A4Scales {
  ActMode mode = ActMode::A16;
  std::string reason;  // why A16
  float fc1 = 0.f, fc2 = 0.f;
};

A4Scales a4_scales(Store& s, const ExpertsPlan& p) {
  A4Scales r;
  std::vector<std::string> missing;
  for (const auto& lin : p.experts)
    for (int j = 0; j < 3; ++j) {
      if (!lin[j].nvfp4) continue;
      if (lin[j].input.empty()) {
        missing.push_back(lin[j].input_name);
        continue;
      }
      float& acc = j < 2 ? r.fc1 : r.fc2;
      acc = std::max(acc, read_scalar(s, lin[j].input, lin[j].inverse));
    }
  if (p.mxfp4) {
    r.reason = "MXFP4 experts run in A16 (SPEC §2)";
  } else if (!p.nvfp4) {
    r.reason = "the experts are not quantized";
  } else if (!s.quant.a4) {
    r.reason = s.quant.describe() + " does not quantize activations";
  } else if (!missing.empty()) {
    r.reason = "tensor '" + missing[0] + "' is missing (" + std::to_string(missing.size()) + " of the layer's " +
               std::to_string(3 * p.experts.size()) + " expert linears have no input scale): A4 needs every expert's";
  } else {
    r.mode = ActMode::A4;
  }
  return r;
}

// Every check read_moe_layer makes before it reads the weights, and all that inspect runs: the config (activation,
// routing), the tensors' headers (the layer plan) and every scalar scale of the layer (weight_scale_2 and the input
// scales of all its experts and of the shared expert, a few bytes each, so that every EP rank refuses the same
// layers). Preparing the weights then checks their block scales (no NaN code).
struct Checked {
  ActivationType activation = ActivationType::Swiglu;
  LayerPlan plan;
  CheckpointRouter router;
  A4Scales a4;
};

Checked check_layer(Store& s, int layer, bool shared_expert) {
  Checked c;
  c.activation = activation_of(s);
  c.plan = plan_layer(s, layer);
  routing_of(s, c.plan.routed.E, c.router);
  for (const ExpertsPlan* p : {&c.plan.routed, c.plan.has_shared && shared_expert ? &c.plan.shared : nullptr})
    if (p)
      for (const auto& lin : p->experts)
        for (const Linear& l : lin)
          if (l.nvfp4) read_scalar(s, l.scale2, l.inverse);
  c.a4 = a4_scales(s, c.plan.routed);
  return c;
}

std::vector<float> read_f32(Store& s, const std::string& name) {
  const std::vector<uint16_t> b = s.file(s.where.at(name)).read_bf16(s.info(name));
  if (s.info(name).dtype_name == "F32") {  // keep fp32 values exact
    const std::vector<uint8_t> raw = s.file(s.where.at(name)).read(s.info(name));
    std::vector<float> out(raw.size() / 4);
    std::memcpy(out.data(), raw.data(), raw.size());
    return out;
  }
  std::vector<float> out(b.size());
  for (size_t i = 0; i < b.size(); ++i) out[i] = bf16_bits_to_f32(b[i]);
  return out;
}

}  // namespace

CheckpointLayer read_moe_layer(const std::string& dir, int layer, const CheckpointOptions& opt) {
  Store s(dir);
  const Checked c = check_layer(s, layer, opt.shared_expert);
  const LayerPlan& p = c.plan;
  const ExpertsPlan& R = p.routed;
  CheckpointLayer out;
  out.layer = layer;
  out.architecture = p.architecture;
  out.quantization = s.quant.describe();
  out.format = R.format();
  out.activation = c.activation;
  out.router = c.router;
  if (opt.ep_world < 1 || opt.ep_rank < 0 || opt.ep_rank >= opt.ep_world || opt.ep_world > R.E)
    throw Error(ErrorCode::InvalidArgument, "ep_world",
                "expected 0 <= ep_rank < ep_world <= E=" + std::to_string(R.E) + ", got ep_rank=" +
                    std::to_string(opt.ep_rank) + ", ep_world=" + std::to_string(opt.ep_world));
  // expert_window of parallel.h: contiguous, the first E % world ranks get one more
  ExpertWindow win;
  win.count = R.E / opt.ep_world + (opt.ep_rank < R.E % opt.ep_world ? 1 : 0);
  win.offset = opt.ep_rank * (R.E / opt.ep_world) + std::min<int64_t>(opt.ep_rank, R.E % opt.ep_world);
  auto tp_rows = [&](int64_t I) {
    if (opt.tp_world < 1 || opt.tp_rank < 0 || opt.tp_rank >= opt.tp_world)
      throw Error(ErrorCode::InvalidArgument, "tp_rank", "expected 0 <= tp_rank < tp_world");
    const int64_t block = R.mxfp4 ? 32 : 16;  // whole MXFP4 blocks of 32
    if (I % opt.tp_world || (I / opt.tp_world) % block)
      throw Error(ErrorCode::InvalidArgument, "tp_world",
                  "I=" + std::to_string(I) + " split over tp_world=" + std::to_string(opt.tp_world) +
                      " must give a multiple of " + std::to_string(block) + " per rank");
    const int64_t ts = I / opt.tp_world;
    return std::pair<int64_t, int64_t>(opt.tp_rank * ts, ts);
  };
  const auto [t0, ts] = tp_rows(R.I);
  out.routed = R.mxfp4 ? read_mxfp4(s, R, win.offset, win.count, t0, ts, opt.tp_rank == 0, &out.bytes_read)
                       : read_experts(s, R, win.offset, win.count, t0, ts, &out.bytes_read);
  if (p.has_shared && opt.shared_expert && opt.ep_rank == 0) {  // under EP on rank 0 only (SPEC §8)
    const auto [s0, ss] = tp_rows(p.shared.I);
    out.shared = read_experts(s, p.shared, 0, 1, s0, ss, &out.bytes_read);
    out.has_shared = true;
    if (!p.shared_gate.empty()) {  // whole on every TP rank: x . g runs over the full H
      out.shared_expert_gate = s.file(s.where.at(p.shared_gate)).read_bf16(s.info(p.shared_gate));
      out.bytes_read += s.info(p.shared_gate).end - s.info(p.shared_gate).begin;
    }
  }
  if (!p.router.empty()) out.router.weight = read_f32(s, p.router);
  if (!p.router_bias.empty()) out.router.bias = read_f32(s, p.router_bias);
  if (!p.correction_bias.empty()) out.router.e_score_correction_bias = read_f32(s, p.correction_bias);
  out.fc1_input_scale = c.a4.fc1;
  out.fc2_input_scale = c.a4.fc2;
  out.mode = c.a4.mode;
  out.mode_reason = c.a4.reason;
  out.num_experts = R.E;
  out.local_expert_offset = win.offset;
  out.num_local_experts = win.count;
  return out;
}

CheckpointInfo inspect_checkpoint(const std::string& dir) {
  Store s(dir);
  CheckpointInfo info;
  info.path = s.root.string();
  info.model_type = s.model_type();
  info.quantization = s.quant.describe();
  info.index = s.index;
  info.tensors = static_cast<int64_t>(s.where.size());
  std::set<std::string> files;
  for (const auto& [n, f] : s.where) files.insert(f);
  info.files.assign(files.begin(), files.end());
  for (const auto& f : info.files) {
    std::error_code ec;
    const auto sz = fs::file_size(s.root / f, ec);
    if (!ec) info.bytes += sz;
  }
  for (const auto& [L, pre] : moe_layers(s)) {
    CheckpointLayerInfo r;
    r.layer = L;
    auto describe = [&](const LayerPlan& p) {
      r.architecture = p.architecture;
      r.format = p.routed.format_name();
      r.experts = p.routed.E;
      r.hidden = p.routed.H;
      r.inter = p.routed.I;
      r.bytes = p.bytes;
      if (p.has_shared)
        r.shared = std::string(p.shared.nvfp4 ? "nvfp4" : "bf16") + " I=" + std::to_string(p.shared.I) +
                   (p.shared_gate.empty() ? "" : ", sigmoid-gated");
      r.router = !p.router.empty();
      r.correction_bias = !p.correction_bias.empty();
    };
    try {
      const Checked c = check_layer(s, L, true);  // the checks of read_moe_layer
      describe(c.plan);
      r.routing = to_string(c.router.routing_method);
      r.top_k = c.router.top_k;
      r.mode = c.a4.mode == ActMode::A4 ? "a4" : "a16";
      r.mode_reason = c.a4.reason;
      r.loadable = true;
    } catch (const Error& e) {  // inspect reports what read_moe_layer would refuse
      r.loadable = false;
      r.reason = bare(e);
      try {  // and describes the layer as far as its tensors go
        describe(plan_layer(s, L));
      } catch (const Error&) {
      }
    }
    info.layers.push_back(std::move(r));
  }
  return info;
}

std::string format_checkpoint_info(const CheckpointInfo& info) {
  std::ostringstream o;
  o << "checkpoint " << info.path << "\n";
  o << "  files: " << info.files.size() << " safetensors" << (info.index ? " (model.safetensors.index.json)" : "") << ", "
    << info.tensors << " tensors, " << info.bytes << " bytes\n";
  o << "  model_type: " << (info.model_type.empty() ? "unknown" : info.model_type) << "; quantization: " << info.quantization
    << "\n";
  o << "  MoE layers: " << info.layers.size() << "\n";
  int n = 0;
  for (const auto& r : info.layers) {
    o << "  layer " << r.layer << ":";
    if (!r.format.empty())
      o << " " << r.architecture << ", " << r.format << ", E=" << r.experts << " H=" << r.hidden << " I=" << r.inter << ", "
        << r.bytes << " bytes, shared expert: " << (r.shared.empty() ? "none" : r.shared)
        << ", router: " << (r.router ? "yes" : "no") << (r.correction_bias ? " + e_score_correction_bias" : "");
    if (r.loadable && !r.routing.empty()) o << ", routing " << r.routing << " top_k " << r.top_k;
    if (r.loadable)
      o << "\n    would load, mode " << r.mode << (r.mode_reason.empty() ? "" : " (" + r.mode_reason + ")") << "\n";
    else
      o << "\n    refused: " << r.reason << "\n";
    n += r.loadable;
  }
  o << "  " << n << " of " << info.layers.size() << " MoE layers would load\n";
  return o.str();
}

}  // namespace fp4moe
