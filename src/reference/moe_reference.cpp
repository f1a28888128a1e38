// The CPU reference operator (SPEC §3.2, §5): the oracle every GPU kernel is tested against.
//
// Structure: route; prepare each token's GEMM1 input (bf16 x, or its NVFP4 rounding in A4); group the
// (token, slot) pairs by local expert into jobs; threads take jobs, decode the expert's W1/W2 one
// group of rows at a time and run every pair of the job through steps 1-5; finally each token is
// combined in slot order. Every pair is computed by the same arithmetic whatever job, tile lane or
// thread it lands in, so the result depends neither on the thread count nor on the other tokens.
//
// Numerics (docs/numerics.md, "Reference operator"): products are rounded to the accumulator type and
// added in index order (no FMA contraction); Acc = float for Precision::Fp32, double for Fp64.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/activation.h"
#include "common/parallel_for.h"
#include "common/shared_gate.h"
#include "fp4moe/mxfp4.h"
#include "fp4moe/nvfp4.h"
#include "reference/moe_reference.h"
#include "reference/reference.h"
#include "runtime/host_tensor.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace fp4moe::reference {
namespace {

constexpr int kLanes = 4;   // pairs computed side by side (independent accumulators)
constexpr int kRows = 4;    // weight rows decoded and used together
constexpr int64_t kMaxPairsPerJob = 64;

// Decoding tables: value of each byte's two E2M1 nibbles, and of each E4M3 and E8M0 code.
struct Tables {
  float lo[256], hi[256], e4m3[256], e8m0[256];
  Tables() {
    for (int b = 0; b < 256; ++b) {
      lo[b] = nvfp4::e2m1_decode(static_cast<uint8_t>(b & 0xf));
      hi[b] = nvfp4::e2m1_decode(static_cast<uint8_t>(b >> 4));
      e4m3[b] = nvfp4::e4m3_decode(static_cast<uint8_t>(b));
      e8m0[b] = mxfp4::e8m0_decode(static_cast<uint8_t>(b));
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

// One [N, K] weight matrix of one expert, NVFP4, MXFP4 or bf16, in the canonical host arrays.
struct Mat {
  bool fp4 = true;
  int block = 16;                // elements a scale: 16 (NVFP4, E4M3) or 32 (MXFP4, E8M0)
  const uint8_t* q = nullptr;    // [N, K/2]
  const uint8_t* sf = nullptr;   // [N, K/block]
  const uint16_t* bf = nullptr;  // [N, K]
  int64_t N = 0, K = 0;

  // Row n as exact values e2m1*e4m3 or e2m1*e8m0 (a global scale is applied to the accumulator) or bf16.
  template <class Acc> void decode_row(int64_t n, Acc* out) const {
    if (fp4) {
      const Tables& tb = tables();
      const float* scale = block == 16 ? tb.e4m3 : tb.e8m0;
      const uint8_t* qr = q + n * (K / 2);
      const uint8_t* sr = sf + n * (K / block);
      for (int64_t b = 0; b < K / block; ++b) {
        const float s = scale[sr[b]];
        for (int i = 0; i < block / 2; ++i) {
          const uint8_t byte = qr[b * block / 2 + i];
          out[b * block + 2 * i] = static_cast<Acc>(tb.lo[byte] * s);  // exact: <= 5 significant bits, in range
          out[b * block + 2 * i + 1] = static_cast<Acc>(tb.hi[byte] * s);
        }
      }
    } else {
      const uint16_t* r = bf + n * K;
      for (int64_t k = 0; k < K; ++k) out[k] = static_cast<Acc>(bf16_bits_to_f32(r[k]));
    }
  }
};

// Expert e's W1 [N1, H] or W2 [H, I] (its quantized codes and scales, or bf16 values).
Mat mat_of(const PreparedWeights& w, int64_t e, bool w1) {
  Mat m;
  m.fp4 = is_fp4(w.format);
  m.block = w.format == WeightFormat::MXFP4 ? mxfp4::kBlock : nvfp4::kBlock;
  m.N = w1 ? w.n1() : w.H;
  m.K = w1 ? w.H : w.I;
  if (m.fp4) {
    m.q = (w1 ? w.w1_q : w.w2_q).data() + e * m.N * (m.K / 2);
    m.sf = (w1 ? w.w1_sf : w.w2_sf).data() + e * m.N * (m.K / m.block);
  } else {
    m.bf = (w1 ? w.w1_bf16 : w.w2_bf16).data() + e * m.N * m.K;
  }
  return m;
}

// out[p][n] = sum_k x_p[k] * W[n][k] for the pairs of one job, fp accumulation in index order k.
// xt holds the inputs lane-interleaved per tile: tile t, element k, lane l at ((t*K)+k)*kLanes + l.
template <class Acc>
void gemm(const Mat& W, const std::vector<Acc>& xt, int64_t npairs, Acc* out, int64_t ldo) {
  const int64_t K = W.K, N = W.N, ntiles = (npairs + kLanes - 1) / kLanes;
  std::vector<Acc> rows(static_cast<size_t>(kRows * K));
  for (int64_t n0 = 0; n0 < N; n0 += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, N - n0));
    for (int r = 0; r < nr; ++r) W.decode_row(n0 + r, rows.data() + r * K);
    for (int64_t t = 0; t < ntiles; ++t) {
      const Acc* x = xt.data() + t * K * kLanes;
      Acc acc[kRows][kLanes] = {};
      if (nr == kRows) {
        for (int64_t k = 0; k < K; ++k)
          for (int r = 0; r < kRows; ++r) {
            const Acc wv = rows[r * K + k];
            for (int l = 0; l < kLanes; ++l) acc[r][l] += wv * x[k * kLanes + l];
          }
      } else {
        for (int r = 0; r < nr; ++r)
          for (int64_t k = 0; k < K; ++k)
            for (int l = 0; l < kLanes; ++l) acc[r][l] += rows[r * K + k] * x[k * kLanes + l];
      }
      for (int l = 0; l < kLanes; ++l) {
        const int64_t p = t * kLanes + l;
        if (p >= npairs) break;
        for (int r = 0; r < nr; ++r) out[p * ldo + n0 + r] = acc[r][l];
      }
    }
  }
}

// out[n] = sum_k v[k] * M[n][k] (bf16 matrix M [N, K]), index order; for the small LoRA products.
template <class Acc> void small_matvec(const Acc* v, const uint16_t* M, int64_t N, int64_t K, Acc* out) {
  for (int64_t n = 0; n < N; ++n) {
    Acc acc = 0;
    const uint16_t* row = M + n * K;
    for (int64_t k = 0; k < K; ++k) acc += v[k] * static_cast<Acc>(bf16_bits_to_f32(row[k]));
    out[n] = acc;
  }
}

// The bf16 rounding points of the SPEC: applied in Fp32 mode, skipped in Fp64 mode.
template <class Acc> Acc rnd(Acc v) {
  if constexpr (sizeof(Acc) == sizeof(float)) return round_bf16(v);
  else return v;
}
template <class Acc> uint16_t to_bf16_bits(Acc v) {
  if constexpr (sizeof(Acc) == sizeof(float)) return f32_to_bf16_bits(v);
  else return detail::f64_to_bf16_bits(v);
}

// Element i of a 1-D f32 view (through its stride).
float read1(const TensorView& v, int64_t i) { return v.as<const float>()[i * v.stride[0]]; }

// The LoRA matrices one expert set uses for one token (nullptr = none).
struct LoraUse {
  const uint16_t* A1 = nullptr; const uint16_t* B1 = nullptr; int64_t r1 = 0;  // [r1, H], [N1, r1]
  const uint16_t* A2 = nullptr; const uint16_t* B2 = nullptr; int64_t r2 = 0;  // [r2, I], [H, r2] (B2 null: shared outer)
};

// One expert set (the routed experts or the shared expert) with what its jobs need.
struct ExpertSet {
  const PreparedWeights* w = nullptr;
  bool shared = false;  // the shared expert: weight 1, slot = -1, scalar activation parameters
  act::Params shared_params;
};

struct Job {
  const ExpertSet* set;
  int64_t e;                 // local expert
  std::vector<int64_t> pairs;  // routed: t*k + j; shared: t
};

template <class Acc> class Runner {
 public:
  Runner(const PreparedWeights& w, const MoeArgs& a, const AdapterSnapshot& snap) : w_(w), a_(a), snap_(snap) {}

  void run();
  void check() { setup(); }  // the argument checks alone (routing included); writes nothing

 private:
  void setup();
  void prepare_inputs();
  void run_job(const Job& job);
  LoraUse lora_for(int64_t t, const ExpertSet& set, int64_t e) const;
  const PreparedAdapter* adapter_of(int64_t t) const {
    if (adapter_.empty() || adapter_[t] < 0) return nullptr;
    return (*snap_)[adapter_[t]].get();
  }
  void combine(int64_t t);
  Acc shared_gate(int64_t t) const;

  const PreparedWeights& w_;
  const MoeArgs& a_;
  const AdapterSnapshot& snap_;
  int64_t T_ = 0, H_ = 0, I_ = 0, N1_ = 0, E_loc_ = 0, E_ = 0, k_ = 0, off_ = 0;
  bool a4_ = false;
  std::vector<int32_t> ids_;
  std::vector<float> wts_;
  std::vector<int32_t> adapter_;        // per token, -1 = base
  std::vector<float> xb_;               // [T, H] bf16 values of x (LoRA input; GEMM1 input in A16)
  std::vector<float> xq_;               // [T, H] A4: NVFP4 values e2m1*e4m3 of x (unscaled)
  std::vector<float> in_scale_;         // [T] the FC1 input dequant scale (1 in A16)
  std::vector<Acc> pair_out_;           // [T*k, H] o_tj (already with bias and the down LoRA delta)
  std::vector<Acc> shared_out_;         // [T, H]
  std::vector<Acc> outer_u_;            // [T*k, r2max]: bf16(a . A2_e^T) of shared-outer adapters
  int64_t r2max_ = 0;
  ExpertSet routed_, shared_;
};

template <class Acc> void Runner<Acc>::setup() {
  T_ = a_.x.shape[0];
  H_ = w_.H;
  I_ = w_.I;
  N1_ = w_.n1();
  E_loc_ = w_.E;
  E_ = a_.num_experts_total > 0 ? a_.num_experts_total : E_loc_;
  k_ = a_.routing.top_k;
  off_ = a_.local_expert_offset;
  a4_ = a_.mode == ActMode::A4;

  // Every argument was checked by validate_moe_args (src/runtime/validate.cpp), the one home of those checks.

  // Routing first, then the expert window.
  ids_.assign(static_cast<size_t>(T_ * k_), 0);
  wts_.assign(static_cast<size_t>(T_ * k_), 0.f);
  route(a_.routing, T_, E_, ids_.data(), wts_.data());

  routed_.w = &w_;
  if (a_.shared_expert) {
    const PreparedWeights& s = a_.shared_expert->impl();
    shared_.w = &s;
    shared_.shared = true;
    const ActivationType at = a_.activation.type;
    shared_.shared_params = a_.shared_params_given
        ? act::resolve_params(at, true, a_.shared_alpha, true, a_.shared_beta, a_.shared_clamp_limit > 0.f,
                              a_.shared_clamp_limit)
        : act::resolve_params(at, false, 0.f, false, 0.f, false, 0.f);
  }

  // Adapters: per token slot of the snapshot this run uses (ids and slot shapes checked by validate_moe_args).
  if (a_.adapter_ids.present() && snap_) {
    const TensorView& v = a_.adapter_ids;
    adapter_.resize(static_cast<size_t>(T_));
    for (int64_t t = 0; t < T_; ++t) {
      adapter_[t] = v.as<const int32_t>()[t * v.stride[0]];
      const PreparedAdapter* ad = adapter_of(t);
      if (ad && ad->has_down && ad->b2_shared) r2max_ = std::max(r2max_, ad->r2);
    }
  }
}

// GEMM1 inputs per token. A4: x (bf16) quantized with gs = 1/fc1_input_scale, or per token
// gs_t = global_encode_scale(amax_t); the dequant scale 1/gs goes to the per-half scales.
template <class Acc> void Runner<Acc>::prepare_inputs() {
  xb_.resize(static_cast<size_t>(T_ * H_));
  const uint16_t* x = a_.x.as<const uint16_t>();
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t h = 0; h < H_; ++h) xb_[t * H_ + h] = bf16_bits_to_f32(x[t * a_.x.stride[0] + h * a_.x.stride[1]]);
  in_scale_.assign(static_cast<size_t>(T_), 1.f);
  if (!a4_) return;
  xq_.resize(xb_.size());
  std::vector<uint8_t> q(static_cast<size_t>(H_ / 2)), sf(static_cast<size_t>(H_ / 16));
  const Tables& tb = tables();
  for (int64_t t = 0; t < T_; ++t) {
    const float* row = xb_.data() + t * H_;
    float gs;
    if (a_.per_token_x_scale) {
      float amax = 0.f;
      for (int64_t h = 0; h < H_; ++h) amax = std::isnan(row[h]) || std::isnan(amax) ? NAN : std::max(amax, std::fabs(row[h]));
      gs = nvfp4::global_encode_scale(amax);
      in_scale_[t] = 1.f / gs;
    } else {
      gs = 1.f / a_.fc1_input_scale;
      in_scale_[t] = a_.fc1_input_scale;
    }
    nvfp4::quantize_row(row, H_, gs, q.data(), sf.data());
    for (int64_t h = 0; h < H_; ++h)
      xq_[t * H_ + h] = ((h & 1) ? tb.hi[q[h / 2]] : tb.lo[q[h / 2]]) * tb.e4m3[sf[h / 16]];
  }
}

template <class Acc> LoraUse Runner<Acc>::lora_for(int64_t t, const ExpertSet& set, int64_t e) const {
  LoraUse u;
  const PreparedAdapter* ad = adapter_of(t);
  if (!ad) return u;
  if (set.shared) {
    if (!ad->has_shared) return u;
    if (ad->s_has_gate_up) { u.A1 = ad->sA1.data(); u.B1 = ad->sB1.data(); u.r1 = ad->s_r; }
    if (ad->s_has_down) { u.A2 = ad->sA2.data(); u.B2 = ad->sB2.data(); u.r2 = ad->s_r; }
    return u;
  }
  if (ad->has_gate_up) {
    u.r1 = ad->r1;
    u.A1 = ad->A1.data() + (ad->a1_shared ? 0 : e) * ad->r1 * H_;
    u.B1 = ad->B1.data() + e * N1_ * ad->r1;
  }
  if (ad->has_down) {
    u.r2 = ad->r2;
    u.A2 = ad->A2.data() + e * ad->r2 * I_;
    u.B2 = ad->b2_shared ? nullptr : ad->B2.data() + e * H_ * ad->r2;
  }
  return u;
}

template <class Acc> void Runner<Acc>::run_job(const Job& job) {
  const PreparedWeights& W = *job.set->w;
  const bool shared = job.set->shared;
  const int64_t e = job.e, H = H_, I = W.I, N1 = W.n1(), np = static_cast<int64_t>(job.pairs.size());
  const int64_t ntiles = (np + kLanes - 1) / kLanes;
  const bool gated = W.gated;
  const ActivationType at = a_.activation.type;
  auto token_of = [&](int64_t p) { return shared ? job.pairs[p] : job.pairs[p] / k_; };

  // Activation parameters of this expert.
  act::Params prm = job.set->shared_params;
  if (!shared) {
    const ActivationArgs& aa = a_.activation;
    prm = act::resolve_params(at, aa.alpha.present(), aa.alpha.present() ? read1(aa.alpha, e) : 0.f,
                              aa.beta.present(), aa.beta.present() ? read1(aa.beta, e) : 0.f,
                              aa.clamp_limit.present(), aa.clamp_limit.present() ? read1(aa.clamp_limit, e) : 0.f);
  }

  // Step 1: GEMM1 on the (A4: NVFP4-rounded) inputs.
  std::vector<Acc> xt(static_cast<size_t>(ntiles * H * kLanes), Acc(0));
  const std::vector<float>& xin = a4_ ? xq_ : xb_;
  for (int64_t p = 0; p < np; ++p) {
    const float* row = xin.data() + token_of(p) * H;
    Acc* dst = xt.data() + (p / kLanes) * H * kLanes + (p % kLanes);
    for (int64_t h = 0; h < H; ++h) dst[h * kLanes] = static_cast<Acc>(row[h]);
  }
  std::vector<Acc> hbuf(static_cast<size_t>(np * N1));
  gemm<Acc>(mat_of(W, e, true), xt, np, hbuf.data(), N1);

  // Steps 2-4 per pair, then the GEMM2 input tiles.
  std::vector<Acc> at_tiles(static_cast<size_t>(ntiles * I * kLanes), Acc(0));
  std::vector<Acc> a_val(static_cast<size_t>(I)), a_lora(static_cast<size_t>(I));
  std::vector<Acc> tmp, dvec(static_cast<size_t>(std::max(N1, H)));
  std::vector<float> a_f(static_cast<size_t>(I));
  std::vector<uint8_t> q(static_cast<size_t>(I / 2)), sf(static_cast<size_t>(I / 16));
  std::vector<LoraUse> lora(static_cast<size_t>(np));
  std::vector<std::vector<Acc>> t2(static_cast<size_t>(np));  // down LoRA shrink per pair
  const Tables& tb = tables();
  const float gs2 = a4_ ? 1.f / a_.fc2_input_scale : 1.f;
  for (int64_t p = 0; p < np; ++p) {
    const int64_t t = token_of(p);
    lora[p] = lora_for(t, *job.set, e);
    const LoraUse& L = lora[p];
    Acc* hrow = hbuf.data() + p * N1;

    // Step 2: per-half scale (times the FC1 input scale in A4), bias, bridge delta, LoRA delta.
    for (int half = 0; half < (gated ? 2 : 1); ++half) {
      const int64_t n_half = gated ? I : N1;
      const Acc alpha = static_cast<Acc>(W.s1(e, half)) * static_cast<Acc>(in_scale_[t]);
      for (int64_t n = half * n_half; n < (half + 1) * n_half; ++n) hrow[n] = hrow[n] * alpha;
    }
    if (!W.bias1.empty())
      for (int64_t n = 0; n < N1; ++n) hrow[n] += static_cast<Acc>(W.bias1[e * N1 + n]);
    if (!shared) {
      const TensorView& d = a_.gate_up_lora_delta;
      const int64_t j = job.pairs[p] % k_;
      for (int64_t n = 0; n < N1; ++n) {
        const Acc dv = d.present() ? static_cast<Acc>(bf16_bits_to_f32(
                                         d.as<const uint16_t>()[t * d.stride[0] + j * d.stride[1] + n * d.stride[2]]))
                                   : Acc(0);
        hrow[n] += dv;  // always added (+0 when absent) so that "no bridge" is one pipeline
      }
    }
    std::fill(dvec.begin(), dvec.begin() + N1, Acc(0));
    if (L.A1) {
      // t = bf16(x . A1^T) [r1], dh = bf16(t . B1^T) [N1], on the bf16 x (also in A4).
      std::vector<Acc> xv(xb_.begin() + t * H, xb_.begin() + (t + 1) * H);
      tmp.resize(static_cast<size_t>(L.r1));
      small_matvec<Acc>(xv.data(), L.A1, L.r1, H, tmp.data());
      for (auto& v : tmp) v = rnd(v);
      small_matvec<Acc>(tmp.data(), L.B1, N1, L.r1, dvec.data());
      for (int64_t n = 0; n < N1; ++n) dvec[n] = rnd(dvec[n]);
    }
    for (int64_t n = 0; n < N1; ++n) hrow[n] += dvec[n];  // +0 for base tokens: zero-B adapters equal base

    // Step 3: activation on real-valued (g, u) in the weights' half order.
    const int64_t g_off = (W.order == GateUpOrder::GateFirst) ? 0 : I;
    const int64_t u_off = (W.order == GateUpOrder::GateFirst) ? I : 0;
    for (int64_t i = 0; i < I; ++i) {
      a_val[i] = gated ? act::apply<Acc>(at, hrow[g_off + i], hrow[u_off + i], prm) : act::apply<Acc>(at, hrow[i], Acc(0), prm);
      a_lora[i] = rnd(a_val[i]);  // the bf16 a (A16 GEMM2 input; LoRA input in both modes)
    }
    if (!shared && a_.activation_out.present()) {
      const TensorView& d = a_.activation_out;
      const int64_t j = job.pairs[p] % k_;
      uint16_t* out = d.as<uint16_t>();
      for (int64_t i = 0; i < I; ++i) out[t * d.stride[0] + j * d.stride[1] + i * d.stride[2]] = to_bf16_bits(a_val[i]);
    }
    // Step 4: A4 rounds a to bf16, then to NVFP4 with encode scale 1/fc2_input_scale. The bf16 step is part of the
    // A4 definition (SPEC §3.2 step 4), so Fp64 keeps it too: otherwise the two precisions land on different
    // block scales for a few blocks and differ by far more than their accumulation error.
    Acc* dst = at_tiles.data() + (p / kLanes) * I * kLanes + (p % kLanes);
    if (a4_) {
      for (int64_t i = 0; i < I; ++i) a_f[i] = round_bf16(static_cast<float>(a_lora[i]));
      nvfp4::quantize_row(a_f.data(), I, gs2, q.data(), sf.data());
      for (int64_t i = 0; i < I; ++i)
        dst[i * kLanes] = static_cast<Acc>(((i & 1) ? tb.hi[q[i / 2]] : tb.lo[q[i / 2]]) * tb.e4m3[sf[i / 16]]);
    } else {
      for (int64_t i = 0; i < I; ++i) dst[i * kLanes] = a_lora[i];
    }

    // Down LoRA shrink (its expand needs o, below; shared-outer keeps the shrink for the combine).
    if (L.A2) {
      tmp.resize(static_cast<size_t>(L.r2));
      small_matvec<Acc>(a_lora.data(), L.A2, L.r2, I, tmp.data());
      for (auto& v : tmp) v = rnd(v);
      if (!L.B2) std::copy(tmp.begin(), tmp.end(), outer_u_.begin() + job.pairs[p] * r2max_);
      t2[p].assign(tmp.begin(), tmp.end());
    }
  }

  // Step 5: GEMM2, scale (times fc2_input_scale in A4), bias, down LoRA delta.
  Acc* out_base = shared ? shared_out_.data() : pair_out_.data();
  std::vector<Acc> obuf(static_cast<size_t>(np * H));
  gemm<Acc>(mat_of(W, e, false), at_tiles, np, obuf.data(), H);
  const Acc s_dn = static_cast<Acc>(W.w2_s2[e]) * static_cast<Acc>(a4_ ? a_.fc2_input_scale : 1.f);
  for (int64_t p = 0; p < np; ++p) {
    const LoraUse& L = lora[p];
    Acc* o = obuf.data() + p * H;
    for (int64_t h = 0; h < H; ++h) o[h] = o[h] * s_dn;
    if (!W.bias2.empty())
      for (int64_t h = 0; h < H; ++h) o[h] += static_cast<Acc>(W.bias2[e * H + h]);
    std::fill(dvec.begin(), dvec.begin() + H, Acc(0));
    if (L.A2 && L.B2) {
      small_matvec<Acc>(t2[p].data(), L.B2, H, L.r2, dvec.data());
      for (int64_t h = 0; h < H; ++h) dvec[h] = rnd(dvec[h]);
    }
    Acc* dst = out_base + job.pairs[p] * H;
    for (int64_t h = 0; h < H; ++h) dst[h] = o[h] + dvec[h];  // +0 for base tokens
  }
}

template <class Acc> void Runner<Acc>::combine(int64_t t) {
  std::vector<Acc> acc(static_cast<size_t>(H_), Acc(0));
  for (int64_t j = 0; j < k_; ++j) {
    const int64_t e = ids_[t * k_ + j] - off_;
    if (e < 0 || e >= E_loc_) continue;  // another rank's expert
    const Acc wt = static_cast<Acc>(wts_[t * k_ + j]);
    const Acc* o = pair_out_.data() + (t * k_ + j) * H_;
    for (int64_t h = 0; h < H_; ++h) acc[h] += wt * o[h];
  }
  if (shared_.w && a_.shared_expert_gate.present()) {
    const Acc gate = shared_gate(t);  // fp32 multiply, then add (SPEC §3.3)
    const Acc* o = shared_out_.data() + t * H_;
    for (int64_t h = 0; h < H_; ++h) acc[h] += gate * o[h];
  } else if (shared_.w) {
    const Acc* o = shared_out_.data() + t * H_;
    for (int64_t h = 0; h < H_; ++h) acc[h] += o[h];
  }
  // Shared-outer down LoRA: z = sum_j w_j * bf16(a_j . A2_e^T) (slot order, local experts), then
  // delta_y = bf16(bf16(z) . B2^T). Always added (+0 for base tokens).
  std::vector<Acc> dy(static_cast<size_t>(H_), Acc(0));
  const PreparedAdapter* ad = adapter_of(t);
  if (ad && ad->has_down && ad->b2_shared) {
    std::vector<Acc> z(static_cast<size_t>(ad->r2), Acc(0));
    for (int64_t j = 0; j < k_; ++j) {
      const int64_t e = ids_[t * k_ + j] - off_;
      if (e < 0 || e >= E_loc_) continue;
      const Acc wt = static_cast<Acc>(wts_[t * k_ + j]);
      const Acc* u = outer_u_.data() + (t * k_ + j) * r2max_;
      for (int64_t r = 0; r < ad->r2; ++r) z[r] += wt * u[r];
    }
    for (auto& v : z) v = rnd(v);
    small_matvec<Acc>(z.data(), ad->B2.data(), H_, ad->r2, dy.data());
    for (auto& v : dy) v = rnd(v);
  }
  for (int64_t h = 0; h < H_; ++h) acc[h] += dy[h];

  const TensorView& y = a_.y;
  for (int64_t h = 0; h < H_; ++h) {
    const int64_t off = t * y.stride[0] + h * y.stride[1];
    switch (y.dtype) {
      case DType::BF16: y.as<uint16_t>()[off] = to_bf16_bits(acc[h]); break;
      case DType::F32: y.as<float>()[off] = static_cast<float>(acc[h]); break;
      default: y.as<double>()[off] = static_cast<double>(acc[h]); break;
    }
  }
}

// sigmoid(x_t . g): Fp32 in the fixed order of common/shared_gate.h (the CUDA combine's bits); Fp64 a serial double
// sum and the exact sigmoid.
template <class Acc> Acc Runner<Acc>::shared_gate(int64_t t) const {
  const uint16_t* x = a_.x.as<const uint16_t>() + t * a_.x.stride[0];
  const uint16_t* g = a_.shared_expert_gate.as<const uint16_t>();
  if constexpr (sizeof(Acc) == sizeof(float)) {
    return shared_gate::gate_host(x, g, H_);
  } else {
    double z = 0.0;
    for (int64_t h = 0; h < H_; ++h) z += double(bf16_bits_to_f32(x[h])) * double(bf16_bits_to_f32(g[h]));
    return 1.0 / (1.0 + std::exp(-z));
  }
}

template <class Acc> void Runner<Acc>::run() {
  setup();
  if (T_ == 0) return;
  prepare_inputs();
  pair_out_.assign(static_cast<size_t>(T_ * k_ * H_), Acc(0));
  if (shared_.w) shared_out_.assign(static_cast<size_t>(T_ * H_), Acc(0));
  outer_u_.assign(static_cast<size_t>(T_ * k_ * r2max_), Acc(0));

  // Jobs: the pairs of each local expert in (token, slot) order, in chunks; then the shared expert.
  std::vector<std::vector<int64_t>> by_expert(static_cast<size_t>(E_loc_));
  for (int64_t p = 0; p < T_ * k_; ++p) {
    const int64_t e = ids_[p] - off_;
    if (e >= 0 && e < E_loc_) by_expert[e].push_back(p);
  }
  std::vector<Job> jobs;
  auto add_jobs = [&](const ExpertSet* set, int64_t e, const std::vector<int64_t>& pairs) {
    for (size_t b = 0; b < pairs.size(); b += kMaxPairsPerJob) {
      const size_t end = std::min(pairs.size(), b + static_cast<size_t>(kMaxPairsPerJob));
      jobs.push_back(Job{set, e, std::vector<int64_t>(pairs.begin() + b, pairs.begin() + end)});
    }
  };
  for (int64_t e = 0; e < E_loc_; ++e) add_jobs(&routed_, e, by_expert[e]);
  if (shared_.w) {
    std::vector<int64_t> all(static_cast<size_t>(T_));
    for (int64_t t = 0; t < T_; ++t) all[t] = t;
    add_jobs(&shared_, 0, all);
  }
  // Larger jobs first for a better balance (the order changes no result).
  std::stable_sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.pairs.size() > b.pairs.size(); });

  const int threads = a_.num_threads > 0 ? a_.num_threads : default_threads(1 << 16);

  // activation_out: slots whose expert lives on another rank are written 0.
  if (a_.activation_out.present()) {
    const TensorView& d = a_.activation_out;
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t j = 0; j < k_; ++j) {
        const int64_t e = ids_[t * k_ + j] - off_;
        if (e >= 0 && e < E_loc_) continue;
        for (int64_t i = 0; i < I_; ++i) d.as<uint16_t>()[t * d.stride[0] + j * d.stride[1] + i * d.stride[2]] = 0;
      }
  }
  parallel_for(static_cast<int64_t>(jobs.size()), threads, [&](int64_t i) { run_job(jobs[i]); });
  parallel_for(T_, threads, [&](int64_t t) { combine(t); });
}

}  // namespace

template <class Acc> void run_tokens(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters) {
  Runner<Acc>(w, args, adapters).run();
}
template <class Acc> void check_tokens(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters) {
  Runner<Acc>(w, args, adapters).check();
}
template void run_tokens<float>(const PreparedWeights&, const MoeArgs&, const AdapterSnapshot&);
template void run_tokens<double>(const PreparedWeights&, const MoeArgs&, const AdapterSnapshot&);
template void check_tokens<float>(const PreparedWeights&, const MoeArgs&, const AdapterSnapshot&);
template void check_tokens<double>(const PreparedWeights&, const MoeArgs&, const AdapterSnapshot&);

}  // namespace fp4moe::reference
