// The adapter registry: every accepted LoRA layout becomes the canonical PreparedAdapter, whose delta
// (computed here from the canonical matrices) equals the SPEC's delta computed from the original
// matrices; scale folding; refusals; thread safety of load/unload against snapshots. The LoRA identities
// through the public API: test_lora_api.cpp.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "bf16_tensor.h"
#include "fp4moe/moe.h"
#include "fp4moe/quantize.h"
#include "runtime/prepared.h"
#include "test_helpers.h"

using namespace fp4moe;
using fp4moe::testutil::Bf16;
using fp4moe::testutil::expect_error;
using fp4moe::testutil::rand_bf16;

namespace {

std::vector<double> rand_vec(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

MoeWeights make_layer(int64_t E, int64_t H, int64_t I, bool gated, GateUpOrder order, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 0.05f);
  const int64_t N1 = gated ? 2 * I : I;
  std::vector<float> w1(static_cast<size_t>(E * N1 * H)), w2(static_cast<size_t>(E * H * I));
  for (auto& x : w1) x = dist(rng);
  for (auto& x : w2) x = dist(rng);
  QuantizeOptions opt;
  opt.format = WeightFormat::BF16;
  opt.gated = gated;
  opt.order = order;
  OwnedWeights o = quantize_weights(make_view(w1.data(), DType::F32, {E, N1, H}),
                                    make_view(w2.data(), DType::F32, {E, H, I}), opt);
  return prepare_weights(o.desc(), Backend::CPU);
}

// y = M v for a row-major [rows, cols] block of bf16 bits starting at `off`, in double; `mag` gets
// sum |M||v| per row (the scale of the rounding error).
void matvec(const std::vector<uint16_t>& m, int64_t off, int64_t rows, int64_t cols, const std::vector<double>& v,
            std::vector<double>& y, std::vector<double>* mag = nullptr) {
  y.assign(static_cast<size_t>(rows), 0.0);
  if (mag) mag->assign(static_cast<size_t>(rows), 0.0);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const double a = bf16_bits_to_f32(m[static_cast<size_t>(off + i * cols + j)]);
      y[i] += a * v[j];
      if (mag) (*mag)[i] += std::fabs(a * v[j]);
    }
}

// Canonical deltas of PreparedAdapter (the formulas of prepared.h, without intermediate rounding).
std::vector<double> canon_gate_up(const PreparedAdapter& a, int64_t e, const std::vector<double>& x) {
  std::vector<double> t, d;
  matvec(a.A1, (a.a1_shared ? 0 : e) * a.r1 * a.H, a.r1, a.H, x, t);
  matvec(a.B1, e * a.N1 * a.r1, a.N1, a.r1, t, d);
  return d;
}
std::vector<double> canon_down(const PreparedAdapter& a, int64_t e, const std::vector<double>& act) {
  std::vector<double> t, d;
  matvec(a.A2, e * a.r2 * a.I, a.r2, a.I, act, t);
  matvec(a.B2, (a.b2_shared ? 0 : e) * a.H * a.r2, a.H, a.r2, t, d);
  return d;
}

// The SPEC's delta from original matrices: s * B (A x), B given gate rows first for gate_up.
struct Ref {
  std::vector<double> d, mag;
};
Ref ref_lowrank(double s, const Bf16& A, int64_t a_off, const Bf16& B, int64_t b_off, int64_t rows, int64_t r,
                int64_t in, const std::vector<double>& x) {
  std::vector<double> t;
  matvec(A.bits, a_off, r, in, x, t);
  Ref out;
  matvec(B.bits, b_off, rows, r, t, out.d, &out.mag);
  for (auto& v : out.d) v *= s;
  for (auto& v : out.mag) v *= std::fabs(s);
  return out;
}
// Gate-rows-first vector [gate; up] -> the weights' half order.
Ref to_order(const Ref& g, int64_t I, bool gated, GateUpOrder order) {
  if (!gated || order == GateUpOrder::GateFirst) return g;
  Ref o = g;
  for (int64_t i = 0; i < 2 * I; ++i) {
    o.d[(i + I) % (2 * I)] = g.d[i];
    o.mag[(i + I) % (2 * I)] = g.mag[i];
  }
  return o;
}

// |canon - ref| within the single bf16 rounding of s*B (relative 2^-9 per term; 2^-8 for margin).
void expect_close(const std::vector<double>& canon, const Ref& ref, const std::string& what) {
  ASSERT_EQ(canon.size(), ref.d.size()) << what;
  double max_abs = 0;
  for (size_t i = 0; i < canon.size(); ++i) {
    ASSERT_LE(std::fabs(canon[i] - ref.d[i]), std::ldexp(ref.mag[i], -8) + 1e-300)
        << what << " row " << i << ": canonical " << canon[i] << " vs reference " << ref.d[i];
    max_abs = std::max(max_abs, std::fabs(ref.d[i]));
  }
  ASSERT_GT(max_abs, 0.0) << what << ": the test data must not be all zeros";
}

double scale_of(float alpha, int64_t r, bool rs) {
  return rs ? double(alpha) / std::sqrt(double(r)) : double(alpha) / double(r);
}

struct Case {
  bool gated;
  GateUpOrder order;
  LoraLayout layout;
  bool rslora;
};

void check_case(const Case& c) {
  const int64_t E = 3, H = 32, I = 16, r = 4, Is = 32;
  const int64_t N1 = c.gated ? 2 * I : I, N1s = c.gated ? 2 * Is : Is;
  SCOPED_TRACE(::testing::Message() << "gated " << c.gated << " order " << int(c.order) << " layout "
                                    << int(c.layout) << " rslora " << c.rslora);
  MoeWeights layer = make_layer(E, H, I, c.gated, c.order, 1);
  // The shared expert uses the other half order, to show each LoRA follows its own weights.
  const GateUpOrder sorder = c.order == GateUpOrder::GateFirst && c.gated ? GateUpOrder::UpFirst : GateUpOrder::GateFirst;
  MoeWeights shared = make_layer(1, H, Is, c.gated, sorder, 2);
  AdapterRegistry reg(layer, 4, &shared);

  const float alpha = 12.f;
  const double s = scale_of(alpha, r, c.rslora);
  LoraAdapterDesc d;
  d.layout = c.layout;
  d.rank = r;
  d.lora_alpha = alpha;
  d.use_rslora = c.rslora;
  Bf16 ag = rand_bf16({E, r, H}, 10), au = rand_bf16({E, r, H}, 11), bg = rand_bf16({E, I, r}, 12),
       bu = rand_bf16({E, I, r}, 13);
  Bf16 agu = c.layout == LoraLayout::SharedOuter ? rand_bf16({r, H}, 14) : rand_bf16({E, r, H}, 14);
  Bf16 bgu = rand_bf16({E, N1, r}, 15);
  Bf16 ad = rand_bf16({E, r, I}, 16);
  Bf16 bd = c.layout == LoraLayout::SharedOuter ? rand_bf16({H, r}, 17) : rand_bf16({E, H, r}, 17);
  Bf16 sa = rand_bf16({r, H}, 18), sb = rand_bf16({N1s, r}, 19), sad = rand_bf16({r, Is}, 20), sbd = rand_bf16({H, r}, 21);
  if (c.layout == LoraLayout::PerExpert) {
    d.a_gate = ag.view();
    d.b_gate = bg.view();
    if (c.gated) {
      d.a_up = au.view();
      d.b_up = bu.view();
    }
  } else {
    d.a_gate_up = agu.view();
    d.b_gate_up = bgu.view();
  }
  d.a_down = ad.view();
  d.b_down = bd.view();
  d.shared_a_gate_up = sa.view();
  d.shared_b_gate_up = sb.view();
  d.shared_a_down = sad.view();
  d.shared_b_down = sbd.view();
  reg.load(2, d);
  ASSERT_TRUE(reg.loaded(2));
  ASSERT_FALSE(reg.loaded(1));
  const PreparedAdapter& a = *(*reg.snapshot())[2];
  EXPECT_EQ(a.E, E);
  EXPECT_EQ(a.N1, N1);
  EXPECT_EQ(a.rank, r);
  EXPECT_EQ(a.scale, static_cast<float>(s));
  EXPECT_TRUE(a.has_gate_up);
  EXPECT_TRUE(a.has_down);
  EXPECT_EQ(a.a1_shared, c.layout == LoraLayout::SharedOuter);
  EXPECT_EQ(a.b2_shared, c.layout == LoraLayout::SharedOuter);
  EXPECT_EQ(a.r1, c.layout == LoraLayout::PerExpert && c.gated ? 2 * r : r);
  EXPECT_EQ(a.r2, r);

  for (int64_t e = 0; e < E; ++e) {
    const std::vector<double> x = rand_vec(H, 100 + uint32_t(e)), act = rand_vec(I, 200 + uint32_t(e));
    // gate_up.
    Ref ref;
    if (c.layout == LoraLayout::PerExpert) {
      Ref g = ref_lowrank(s, ag, e * r * H, bg, e * I * r, I, r, H, x);
      if (c.gated) {
        Ref u = ref_lowrank(s, au, e * r * H, bu, e * I * r, I, r, H, x);
        g.d.insert(g.d.end(), u.d.begin(), u.d.end());
        g.mag.insert(g.mag.end(), u.mag.begin(), u.mag.end());
      }
      ref = to_order(g, I, c.gated, c.order);
    } else {
      const int64_t a_off = c.layout == LoraLayout::SharedOuter ? 0 : e * r * H;
      ref = to_order(ref_lowrank(s, agu, a_off, bgu, e * N1 * r, N1, r, H, x), I, c.gated, c.order);
    }
    expect_close(canon_gate_up(a, e, x), ref, "gate_up expert " + std::to_string(e));
    // down.
    const int64_t b_off = c.layout == LoraLayout::SharedOuter ? 0 : e * H * r;
    expect_close(canon_down(a, e, act), ref_lowrank(s, ad, e * r * I, bd, b_off, H, r, I, act),
                 "down expert " + std::to_string(e));
  }
  // The shared expert's LoRA, in the shared expert's own half order.
  ASSERT_TRUE(a.has_shared && a.s_has_gate_up && a.s_has_down);
  EXPECT_EQ(a.s_I, Is);
  EXPECT_EQ(a.s_N1, N1s);
  const std::vector<double> x = rand_vec(H, 300), act = rand_vec(Is, 301);
  std::vector<double> t, dh, dd;
  matvec(a.sA1, 0, r, H, x, t);
  matvec(a.sB1, 0, N1s, r, t, dh);
  expect_close(dh, to_order(ref_lowrank(s, sa, 0, sb, 0, N1s, r, H, x), Is, c.gated, sorder), "shared gate_up");
  matvec(a.sA2, 0, r, Is, act, t);
  matvec(a.sB2, 0, H, r, t, dd);
  expect_close(dd, ref_lowrank(s, sad, 0, sbd, 0, H, r, Is, act), "shared down");
}

// Is `bits` the bf16 nearest to v (ties: either neighbour at the same distance is accepted only if even)?
bool is_nearest_bf16(uint16_t bits, double v) {
  const double c = bf16_bits_to_f32(bits);
  const double up = bf16_bits_to_f32(static_cast<uint16_t>(bits + 1));
  const double dn = bf16_bits_to_f32(static_cast<uint16_t>(bits - 1));
  const double err = std::fabs(c - v);
  if (err > std::fabs(up - v) || err > std::fabs(dn - v)) return false;
  if ((err == std::fabs(up - v) || err == std::fabs(dn - v)) && (bits & 1)) return false;  // tie -> even
  return true;
}

LoraAdapterDesc fused_desc(const Bf16& A, const Bf16& B, int64_t r, float alpha) {
  LoraAdapterDesc d;
  d.layout = LoraLayout::PeftFused;
  d.rank = r;
  d.lora_alpha = alpha;
  d.a_gate_up = A.view();
  d.b_gate_up = B.view();
  return d;
}


}  // namespace

TEST(Lora, CanonicalFormMatchesOriginalDeltaForEveryLayout) {
  for (bool gated : {true, false})
    for (GateUpOrder order : {GateUpOrder::GateFirst, GateUpOrder::UpFirst}) {
      if (!gated && order == GateUpOrder::UpFirst) continue;
      for (LoraLayout layout : {LoraLayout::PerExpert, LoraLayout::PeftFused, LoraLayout::SharedOuter})
        for (bool rs : {false, true}) check_case({gated, order, layout, rs});
    }
}

TEST(Lora, PerExpertBlockDiagonalHasExactZeros) {
  const int64_t E = 2, H = 16, I = 16, r = 3;
  MoeWeights layer = make_layer(E, H, I, true, GateUpOrder::UpFirst, 3);
  AdapterRegistry reg(layer);
  Bf16 ag = rand_bf16({E, r, H}, 1), au = rand_bf16({E, r, H}, 2), bg = rand_bf16({E, I, r}, 3),
       bu = rand_bf16({E, I, r}, 4);
  LoraAdapterDesc d;
  d.layout = LoraLayout::PerExpert;
  d.rank = r;
  d.lora_alpha = 6.f;
  d.a_gate = ag.view();
  d.a_up = au.view();
  d.b_gate = bg.view();
  d.b_up = bu.view();
  reg.load(0, d);
  const PreparedAdapter& a = *(*reg.snapshot())[0];
  ASSERT_EQ(a.r1, 2 * r);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < 2 * I; ++n)
      for (int64_t c = 0; c < 2 * r; ++c) {
        // UpFirst: rows 0..I-1 are up rows (columns r..2r-1), rows I.. gate rows (columns 0..r-1).
        const bool up_row = n < I, up_col = c >= r;
        const uint16_t v = a.B1[(e * 2 * I + n) * 2 * r + c];
        if (up_row != up_col) {
          ASSERT_EQ(v, 0) << e << " " << n << " " << c;
        } else {
          const Bf16& src = up_row ? bu : bg;
          const uint16_t b = src.bits[(e * I + (n % I)) * r + (c % r)];
          ASSERT_TRUE(is_nearest_bf16(v, 2.0 * bf16_bits_to_f32(b)));
        }
      }
  // A1 = [A_gate; A_up] copied exactly.
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < r * H; ++i) {
      ASSERT_EQ(a.A1[e * 2 * r * H + i], ag.bits[e * r * H + i]);
      ASSERT_EQ(a.A1[e * 2 * r * H + r * H + i], au.bits[e * r * H + i]);
    }
}

TEST(Lora, ScaleIsFoldedIntoBWithOneRounding) {
  const int64_t E = 2, H = 16, I = 16;
  MoeWeights layer = make_layer(E, H, I, true, GateUpOrder::GateFirst, 4);
  AdapterRegistry reg(layer);
  for (bool rs : {false, true})
    for (int64_t r : {1, 3, 7, 64}) {
      const float alpha = 7.f;
      Bf16 A = rand_bf16({E, r, H}, 5), B = rand_bf16({E, 2 * I, r}, 6, 3.f);
      Bf16 A2 = rand_bf16({E, r, I}, 7), B2 = rand_bf16({E, H, r}, 8, 3.f);
      LoraAdapterDesc d = fused_desc(A, B, r, alpha);
      d.use_rslora = rs;
      d.a_down = A2.view();
      d.b_down = B2.view();
      reg.load(1, d);
      const PreparedAdapter& a = *(*reg.snapshot())[1];
      const double s = scale_of(alpha, r, rs);
      EXPECT_EQ(a.scale, static_cast<float>(s));
      EXPECT_EQ(a.A1, A.bits);  // A is never scaled
      EXPECT_EQ(a.A2, A2.bits);
      for (size_t i = 0; i < B.bits.size(); ++i)
        ASSERT_TRUE(is_nearest_bf16(a.B1[i], s * B.at(int64_t(i)))) << "r " << r << " rs " << rs << " i " << i;
      for (size_t i = 0; i < B2.bits.size(); ++i)
        ASSERT_TRUE(is_nearest_bf16(a.B2[i], s * B2.at(int64_t(i)))) << "r " << r << " rs " << rs << " i " << i;
    }
}

TEST(Lora, ZeroBStaysExactlyZeroAndProjectionsMayBeAbsent) {
  const int64_t E = 2, H = 16, I = 16, r = 2;
  MoeWeights layer = make_layer(E, H, I, true, GateUpOrder::GateFirst, 5);
  AdapterRegistry reg(layer);
  Bf16 A = rand_bf16({E, r, H}, 1), Bz{std::vector<uint16_t>(size_t(E * 2 * I * r), 0x8000), {E, 2 * I, r}};
  LoraAdapterDesc d = fused_desc(A, Bz, r, -3.f);  // negative scale times -0 must still give +0
  reg.load(0, d);
  const PreparedAdapter& a = *(*reg.snapshot())[0];
  EXPECT_TRUE(a.has_gate_up);
  EXPECT_FALSE(a.has_down);
  EXPECT_TRUE(a.A2.empty());
  for (uint16_t v : a.B1) ASSERT_EQ(v, 0);
  // Down only.
  Bf16 A2 = rand_bf16({E, r, I}, 2), B2 = rand_bf16({E, H, r}, 3);
  LoraAdapterDesc dd;
  dd.rank = r;
  dd.lora_alpha = 1.f;
  dd.a_down = A2.view();
  dd.b_down = B2.view();
  reg.load(1, dd);
  const PreparedAdapter& b = *(*reg.snapshot())[1];
  EXPECT_FALSE(b.has_gate_up);
  EXPECT_TRUE(b.has_down);
  EXPECT_FALSE(b.has_shared);
}

TEST(Lora, BadAdaptersAreRefusedByName) {
  const int64_t E = 2, H = 16, I = 16, r = 2;
  MoeWeights layer = make_layer(E, H, I, true, GateUpOrder::GateFirst, 6);
  AdapterRegistry reg(layer, 4);
  Bf16 A = rand_bf16({E, r, H}, 1), B = rand_bf16({E, 2 * I, r}, 2), Bs = rand_bf16({E, I, r}, 3);
  Bf16 sa = rand_bf16({r, H}, 4), sb = rand_bf16({2 * I, r}, 5);
  const LoraAdapterDesc good = fused_desc(A, B, r, 8.f);
  ASSERT_NO_THROW(reg.load(0, good));
  auto with = [&](const std::function<void(LoraAdapterDesc&)>& f) {
    LoraAdapterDesc d = good;
    f(d);
    return [&reg, d] { reg.load(1, d); };
  };
  expect_error(with([](LoraAdapterDesc& d) { d.rank = 0; }), "rank");
  expect_error(with([](LoraAdapterDesc& d) { d.rank = 65; }), "rank");
  expect_error(with([](LoraAdapterDesc& d) { d.lora_alpha = std::numeric_limits<float>::infinity(); }), "lora_alpha");
  expect_error(with([](LoraAdapterDesc& d) { d.lora_alpha = std::nanf(""); }), "lora_alpha");
  expect_error(with([](LoraAdapterDesc& d) { d.layout = static_cast<LoraLayout>(9); }), "layout");
  expect_error(with([](LoraAdapterDesc& d) { d.a_gate_up.dtype = DType::F32; }), "a_gate_up");
  expect_error(with([](LoraAdapterDesc& d) { d.a_gate_up.shape[2] = 32; }), "a_gate_up");
  expect_error(with([](LoraAdapterDesc& d) { d.rank = 3; }), "a_gate_up");  // shapes carry r = 2
  expect_error(with([&](LoraAdapterDesc& d) { d.b_gate_up = Bs.view(); }), "b_gate_up");  // I rows, not 2I
  expect_error(with([](LoraAdapterDesc& d) { d.b_gate_up = TensorView{}; }), "b_gate_up");
  expect_error(with([](LoraAdapterDesc& d) { d.a_gate_up = TensorView{}; }), "a_gate_up");
  expect_error(with([&](LoraAdapterDesc& d) { d.a_gate = A.view(); }), "a_gate");  // wrong layout's tensor
  expect_error(with([&](LoraAdapterDesc& d) {
                 d.layout = LoraLayout::PerExpert;
                 d.a_gate_up = d.b_gate_up = TensorView{};
                 d.a_gate = A.view();
                 d.b_gate = Bs.view();
               }),
               "a_up");  // gated layer: gate without up
  expect_error(with([&](LoraAdapterDesc& d) { d.layout = LoraLayout::SharedOuter; }), "a_gate_up");  // [E,r,H]
  expect_error(with([&](LoraAdapterDesc& d) { d.a_down = A.view(); }), "b_down");
  expect_error(with([&](LoraAdapterDesc& d) {
                 d.shared_a_gate_up = sa.view();
                 d.shared_b_gate_up = sb.view();
               }),
               "shared_a_gate_up");  // no shared expert in this registry
#ifndef FP4MOE_WITH_CUDA
  expect_error(with([](LoraAdapterDesc& d) { d.a_gate_up.device = Backend::CUDA; }), "a_gate_up",
               ErrorCode::Unsupported);
#endif
  // Slots.
  expect_error([&] { reg.load(4, good); }, "slot");
  expect_error([&] { reg.load(-1, good); }, "slot");
  expect_error([&] { reg.unload(3); }, "slot", ErrorCode::NotFound);
  expect_error([&] { (void)reg.loaded(9); }, "slot");
  expect_error([&] { AdapterRegistry bad(layer, 0); }, "num_slots");
  expect_error([&] { AdapterRegistry bad(MoeWeights{}, 4); }, "layer");
  MoeWeights wide_shared = make_layer(1, 32, 16, true, GateUpOrder::GateFirst, 7);
  expect_error([&] { AdapterRegistry bad(layer, 4, &wide_shared); }, "shared_expert");  // hidden 32 != 16
  // A failed load leaves the slot as it was.
  EXPECT_TRUE(reg.loaded(0));
  EXPECT_FALSE(reg.loaded(1));
  EXPECT_EQ(reg.num_slots(), 4);
  EXPECT_EQ(reg.backend(), Backend::CPU);
}

TEST(Lora, SnapshotsAreImmutable) {
  const int64_t E = 2, H = 16, I = 16, r = 2;
  MoeWeights layer = make_layer(E, H, I, true, GateUpOrder::GateFirst, 8);
  AdapterRegistry reg(layer, 3);
  Bf16 A = rand_bf16({E, r, H}, 1), B = rand_bf16({E, 2 * I, r}, 2);
  AdapterSnapshot before = reg.snapshot();
  reg.load(1, fused_desc(A, B, r, 4.f));
  AdapterSnapshot mid = reg.snapshot();
  reg.unload(1);
  AdapterSnapshot after = reg.snapshot();
  ASSERT_EQ(before->size(), 3u);
  EXPECT_EQ((*before)[1], nullptr);
  ASSERT_NE((*mid)[1], nullptr);
  EXPECT_EQ((*mid)[1]->rank, r);
  EXPECT_EQ((*after)[1], nullptr);
  EXPECT_FALSE(reg.loaded(1));
}

TEST(Lora, LoadUnloadWhileSnapshottingIsSafe) {
  const int64_t E = 2, H = 16, I = 16;
  MoeWeights layer = make_layer(E, H, I, true, GateUpOrder::GateFirst, 9);
  const int slots = 6;
  AdapterRegistry reg(layer, slots);
  Bf16 A2 = rand_bf16({E, 2, H}, 1), B2 = rand_bf16({E, 2 * I, 2}, 2);
  Bf16 A5 = rand_bf16({E, 5, H}, 3), B5 = rand_bf16({E, 2 * I, 5}, 4);
  const LoraAdapterDesc d2 = fused_desc(A2, B2, 2, 4.f), d5 = fused_desc(A5, B5, 5, 4.f);

  std::atomic<bool> done{false};
  std::atomic<int> bad{0};
  std::thread writer([&] {
    for (int it = 0; it < 3000; ++it) {
      const int slot = (it * 7) % slots;
      if (reg.loaded(slot))
        reg.unload(slot);
      else
        reg.load(slot, (it & 1) ? d5 : d2);
    }
    done = true;
  });
  // Keep some snapshots and what they held; they must not change while the writer runs.
  struct Kept {
    AdapterSnapshot snap;
    std::vector<const PreparedAdapter*> ptrs;
    std::vector<uint16_t> first_b;
  };
  std::vector<Kept> kept;
  long taken = 0;
  while (!done || taken < 10) {
    AdapterSnapshot s = reg.snapshot();
    ++taken;
    if (!s || static_cast<int>(s->size()) != slots) {
      ++bad;
      continue;
    }
    Kept k{s, {}, {}};
    for (const auto& p : *s) {
      k.ptrs.push_back(p.get());
      if (p) {
        if (!(p->rank == 2 || p->rank == 5) || p->B1.size() != size_t(E * 2 * I * p->rank)) ++bad;
        k.first_b.push_back(p->B1[0]);
      }
    }
    if (taken % 97 == 0) kept.push_back(std::move(k));
  }
  writer.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GE(taken, 10);
  for (const Kept& k : kept) {
    size_t j = 0;
    for (size_t i = 0; i < k.ptrs.size(); ++i) {
      ASSERT_EQ((*k.snap)[i].get(), k.ptrs[i]);
      if (k.ptrs[i]) {
        ASSERT_EQ(k.ptrs[i]->B1[0], k.first_b[j++]);
      }
    }
  }
  // 3000 toggles over 6 slots: each slot was toggled 500 times, so every slot ends empty.
  for (int s = 0; s < slots; ++s) EXPECT_FALSE(reg.loaded(s));
}

#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>

TEST(LoraCuda, DeviceTensorsAndCudaRegistry) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t E = 2, H = 32, I = 16, r = 4;
  MoeWeights layer = make_layer(E, H, I, true, GateUpOrder::UpFirst, 41);
  Bf16 A = rand_bf16({E, r, H}, 1), B = rand_bf16({E, 2 * I, r}, 2), A2 = rand_bf16({E, r, I}, 3),
       B2 = rand_bf16({E, H, r}, 4);
  LoraAdapterDesc d = fused_desc(A, B, r, 5.f);
  d.a_down = A2.view();
  d.b_down = B2.view();
  AdapterRegistry host_reg(layer, 2);
  host_reg.load(0, d);
  std::vector<void*> bufs;
  auto to_dev = [&](TensorView& v) {
    void* p = nullptr;
    const size_t bytes = size_t(v.numel()) * 2;
    ASSERT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    cudaMemcpy(p, v.data, bytes, cudaMemcpyHostToDevice);
    bufs.push_back(p);
    v.data = p;
    v.device = Backend::CUDA;
  };
  LoraAdapterDesc dd = d;
  to_dev(dd.a_gate_up);
  to_dev(dd.b_gate_up);
  to_dev(dd.a_down);
  to_dev(dd.b_down);
  host_reg.load(1, dd);
  const auto snap = host_reg.snapshot();
  EXPECT_EQ((*snap)[0]->A1, (*snap)[1]->A1);
  EXPECT_EQ((*snap)[0]->B1, (*snap)[1]->B1);
  EXPECT_EQ((*snap)[0]->A2, (*snap)[1]->A2);
  EXPECT_EQ((*snap)[0]->B2, (*snap)[1]->B2);
  // A registry of CUDA weights uploads the canonical form.
  std::vector<float> w1(size_t(E * 2 * I * H), 0.01f), w2(size_t(E * H * I), 0.02f);
  OwnedWeights ow = quantize_weights(make_view(w1.data(), DType::F32, {E, 2 * I, H}),
                                     make_view(w2.data(), DType::F32, {E, H, I}));
  MoeWeights cw = prepare_weights(ow.desc(), Backend::CUDA, 0);
  AdapterRegistry cuda_reg(cw, 2);
  EXPECT_EQ(cuda_reg.backend(), Backend::CUDA);
  cuda_reg.load(1, dd);
  EXPECT_NE((*cuda_reg.snapshot())[1]->device, nullptr);
  for (void* p : bufs) cudaFree(p);
}
#endif
