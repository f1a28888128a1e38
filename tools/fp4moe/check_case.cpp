// The case runner of `fp4moe check` (check_case.h).
#include "check_case.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace fp4moe::check {
namespace {

// Runs the backend under test and passes its output through the test hook.
std::vector<uint16_t> run_backend(const Context& ctx, const Executor& ex, const Config& c, const CallSpec& call) {
  std::vector<uint16_t> y;
  ex.run(c, call, &y, nullptr);
  if (ctx.hooks.on_backend_output) ctx.hooks.on_backend_output(call.label, y);
  return y;
}

// Runs one check body; an exception is that check's failure (with its message), not the harness's end.
template <class F> void guarded(Reporter& rep, const std::string& scope, const std::string& phase,
                                const std::string& name, F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    rep.add(scope, phase, name, false, std::string("error: ") + e.what());
  }
}

// The shared expert's part of the oracle's output (with it minus without it) is its ungated part times
// sigmoid(x_t . g) computed here in double (times 1 without a gate), and both the part and the gate move the output.
void check_shared_expert(const Context& ctx, const ShapeSetup& S, const Executor& oracle, const Config& c,
                         const std::vector<double>& r_base) {
  const bool gated = !S.shared_gate.empty();
  const std::string name = gated ? "shared expert weighted by sigmoid(x . g)" : "shared expert added with weight 1";
  guarded(ctx.rep, c.name, "invariants", name, [&] {
    if (r_base.empty()) throw std::runtime_error("no reference output (its run failed above)");
    CallSpec without{"oracle_without_shared"}, ungated{"oracle_ungated_shared"};
    without.shared = SharedRun::Without;
    ungated.shared = SharedRun::Ungated;
    std::vector<double> r_without, r_ungated;
    oracle.run(c, without, nullptr, &r_without);
    if (gated) oracle.run(c, ungated, nullptr, &r_ungated);
    const int64_t T = S.T, H = S.H;
    double err = 0, part = 0, rest = 0, gate_move = 0, lo = 1, hi = 0;
    for (int64_t t = 0; t < T; ++t) {
      double dot = 0;
      for (int64_t h = 0; h < H && gated; ++h)
        dot += double(bf16_bits_to_f32(S.x[t * H + h])) * double(bf16_bits_to_f32(S.shared_gate[h]));
      const double w = gated ? 1 / (1 + std::exp(-dot)) : 1;
      lo = std::min(lo, w);
      hi = std::max(hi, w);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t i = t * H + h;
        const double got = r_base[i] - r_without[i], full = gated ? r_ungated[i] - r_without[i] : got;
        err += (got - w * full) * (got - w * full);
        part += w * full * w * full;
        rest += r_without[i] * r_without[i];
        gate_move += (got - full) * (got - full);
      }
    }
    const double rel = std::sqrt(err / part), effect = std::sqrt(part / rest);
    const double gate_effect = gated ? std::sqrt(gate_move / part) : kMinEffect;
    ctx.rep.add(c.name, "invariants", name, rel <= kTolSharedWeight && effect >= kMinEffect && gate_effect >= kMinEffect,
                "oracle's shared part vs " + (gated ? "sigmoid(x . g) in [" + fmt("%.3f", lo) + ", " + fmt("%.3f", hi) + "]" : std::string("1")) +
                    " times its ungated part: rel_l2 " + fmt("%.2e", rel) + " (<= " + fmt("%.0e", kTolSharedWeight) +
                    "); effect vs without it " + fmt("%.3e", effect) +
                    (gated ? ", gate's effect " + fmt("%.3e", gate_effect) : std::string()) + " (>= " +
                    fmt("%.0e", kMinEffect) + ")");
  });
}

}  // namespace

std::vector<ActivationType> activations_of(const ModelShape& shape, const Options& opt) {
  if (!opt.activations.empty()) return opt.activations;
  std::vector<ActivationType> acts{shape.activation};
  for (ActivationType a : {ActivationType::Swiglu, ActivationType::Situ})
    if (a != shape.activation) acts.push_back(a);
  return acts;
}

Registries make_registries(ShapeSetup& S, const Executor& dut, const Executor* oracle) {
  Registries r;
  r.dut = dut.make_registry();
  load_adapters(*r.dut, S);
  for (int z = 0; z < kNumZeroB; ++z) r.dut->load(kZeroBSlot0 + z, S.zero_b[z].desc());
  r.dut->load(kBridgeSlot, exact_adapter_desc(S));
  if (oracle) {
    r.oracle = oracle->make_registry();
    load_adapters(*r.oracle, S);
    r.oracle->load(kBridgeSlot, exact_adapter_desc(S));
  }
  return r;
}

LaunchOutputs run_config(const Context& ctx, ShapeSetup& S, const Executor& dut, const Executor& oracle,
                         const Registries& regs, const Config& c) {
  Reporter& rep = ctx.rep;
  const std::string& scope = c.name;
  const Tolerance tol = c.mode == ActMode::A16 ? kTolA16 : (dut.backend() == Backend::CPU ? kTolA4VsFp64 : kTolA4VsFp32);
  const int64_t T = S.T, H = S.H;
  LaunchOutputs out;

  AdapterRegistry* reg = regs.dut.get();
  AdapterRegistry* reg_o = regs.oracle.get();
  const std::vector<int32_t> all_base(T, -1);

  // Without LoRA.
  std::vector<uint16_t> y_base;
  std::vector<double> r_base;
  guarded(rep, scope, "without LoRA", "base vs reference", [&] {
    oracle.run(c, {"oracle_base"}, nullptr, &r_base);
    y_base = run_backend(ctx, dut, c, {"base"});
    const Stats s = compare_rows(to_double(y_base), r_base, H, {});
    rep.add(scope, "without LoRA", "base vs reference", within(s, tol), describe(s, tol));
  });
  out.base = y_base;

  // Phase 1: each adapter alone on all tokens.
  std::vector<std::vector<double>> r_ad(kNumAdapters);
  const std::string p1 = "individual adapters";
  for (int a = 0; a < kNumAdapters; ++a) {
    const std::string name = "adapter " + std::to_string(a) + " (" + to_string(adapter_layout(a)) + ")";
    guarded(rep, scope, p1, name, [&] {
      const std::vector<int32_t> ids(T, a);
      oracle.run(c, {"oracle_adapter", reg_o, &ids}, nullptr, &r_ad[a]);
      const std::vector<uint16_t> y = run_backend(ctx, dut, c, {"adapter" + std::to_string(a), reg, &ids});
      const std::vector<double> yd = to_double(y);
      const Stats s = compare_rows(yd, r_ad[a], H, {});
      if (y_base.empty()) throw std::runtime_error("no base output to measure the adapter's effect against");
      const double effect = compare_rows(yd, to_double(y_base), H, {}).rel_l2;
      const bool ok = within(s, tol) && effect >= kMinEffect;
      rep.add(scope, p1, name, ok, describe(s, tol) + "; effect vs base " + fmt("%.3e", effect) + " (>= " + fmt("%.0e", kMinEffect) + ")");
    });
  }

  // Phase 2: the eight adapters round-robin in one batch; each adapter's tokens vs its reference.
  const std::string p2 = "eight adapters in one batch";
  {
    std::vector<int32_t> ids(T);
    for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>(t % kNumAdapters);
    std::vector<uint16_t> y;
    std::string err;
    try {
      y = run_backend(ctx, dut, c, {"batch8", reg, &ids});
    } catch (const std::exception& e) {
      err = e.what();
    }
    for (int a = 0; a < kNumAdapters; ++a) {
      const std::string name = "adapter " + std::to_string(a) + " tokens";
      if (!err.empty() || r_ad[a].empty()) {
        rep.add(scope, p2, name, false, "error: " + (err.empty() ? std::string("no reference for this adapter") : err));
        continue;
      }
      std::vector<int64_t> rows;
      for (int64_t t = a; t < T; t += kNumAdapters) rows.push_back(t);
      const Stats s = compare_rows(to_double(y), r_ad[a], H, rows);
      rep.add(scope, p2, name, within(s, tol), std::to_string(rows.size()) + " tokens, " + describe(s, tol));
    }
  }

  // Phase 3: twelve requests, base and adapters, in one batch; each request vs its reference.
  const std::string p3 = "mixed adapter and base requests";
  const auto rows = request_rows(T);
  const std::vector<int32_t> req_ids = request_ids(T);
  {
    std::string err;
    try {
      out.requests = run_backend(ctx, dut, c, {"requests12", reg, &req_ids});
    } catch (const std::exception& e) {
      err = e.what();
    }
    for (int q = 0; q < kNumRequests; ++q) {
      const int a = kRequestAdapter[q];
      const std::string name = "request " + std::to_string(q) + " (" + (a < 0 ? std::string("base") : "adapter " + std::to_string(a)) + ")";
      const std::vector<double>& ref = a < 0 ? r_base : r_ad[a];
      if (!err.empty() || ref.empty()) {
        rep.add(scope, p3, name, false, "error: " + (err.empty() ? std::string("no reference") : err));
        continue;
      }
      const Stats s = compare_rows(to_double(out.requests), ref, H, rows[q]);
      rep.add(scope, p3, name, within(s, tol), std::to_string(rows[q].size()) + " tokens, " + describe(s, tol));
    }
  }

  // Invariants (bit for bit).
  const std::string inv = "invariants";
  auto bitwise = [&](const std::string& name, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                     const std::vector<int64_t>& rws, const std::string& what) {
    if (a.empty() || b.empty()) {
      rep.add(scope, inv, name, false, "error: an output is missing (its run failed above)");
      return;
    }
    const int64_t d = differing_elements(a, b, H, rws);
    rep.add(scope, inv, name, d == 0, what + ": " + std::to_string(d) + " differing bf16 values");
  };

  guarded(rep, scope, inv, "zero-B adapters equal base", [&] {
    std::vector<int32_t> ids(T);
    for (int64_t t = 0; t < T; ++t) ids[t] = kZeroBSlot0 + static_cast<int32_t>(t % kNumZeroB);
    const std::vector<uint16_t> y = run_backend(ctx, dut, c, {"zero_b", reg, &ids});
    bitwise("zero-B adapters equal base", y, y_base, {}, "peft_fused/per_expert/shared_outer zero-B vs base, all tokens");
  });

  {
    std::vector<int64_t> base_rows;
    for (int q = 0; q < kNumRequests; ++q)
      if (kRequestAdapter[q] < 0) base_rows.insert(base_rows.end(), rows[q].begin(), rows[q].end());
    bitwise("base tokens in a mixed batch equal base alone", out.requests, y_base, base_rows,
            std::to_string(base_rows.size()) + " base tokens of the 12-request batch vs the base run");
  }

  guarded(rep, scope, inv, "bridge equals fused LoRA", [&] {
    // Precomputed routing (the reference's) so both runs use the same experts, then the exact
    // gate_up-only adapter through the registry vs its delta through gate_up_lora_delta.
    std::vector<int32_t> topk_ids(T * S.k);
    std::vector<float> topk_w(T * S.k);
    RoutingArgs r;
    r.method = S.shape->routing;
    r.top_k = S.k;
    r.logits = make_view(S.logits.data(), DType::F32, {T, S.E_total});
    if (!S.router_bias.empty()) r.bias = make_view(S.router_bias.data(), DType::F32, {S.E_total});
    r.n_group = S.shape->n_group;
    r.topk_group = S.shape->topk_group;
    r.routed_scaling_factor = S.shape->routed_scaling_factor;
    route(r, S.E_total, make_view(topk_ids.data(), DType::I32, {T, S.k}), make_view(topk_w.data(), DType::F32, {T, S.k}));
    const std::vector<int32_t> ids(T, kBridgeSlot);
    const PreparedAdapter& ad = *(*reg_o->snapshot())[kBridgeSlot];
    const std::vector<uint16_t> delta = host_gate_up_delta(S, ad, topk_ids);
    CallSpec fused{"bridge_fused", reg, &ids, nullptr, &topk_ids, &topk_w};
    CallSpec bridge{"bridge_delta", nullptr, nullptr, &delta, &topk_ids, &topk_w};
    const std::vector<uint16_t> y_fused = run_backend(ctx, dut, c, fused);
    const std::vector<uint16_t> y_bridge = run_backend(ctx, dut, c, bridge);
    const double effect = y_base.empty() ? 0 : compare_rows(to_double(y_fused), to_double(y_base), H, {}).rel_l2;
    const int64_t d = differing_elements(y_fused, y_bridge, H, {});
    rep.add(scope, inv, "bridge equals fused LoRA", d == 0 && effect >= kMinEffect,
            "gate_up-only adapter via the registry vs its delta via gate_up_lora_delta: " + std::to_string(d) +
                " differing bf16 values; effect vs base " + fmt("%.3e", effect));
  });

  guarded(rep, scope, inv, "base unchanged by load/unload", [&] {
    // A registry of its own: base through it while empty, then after loading adapters (one of each
    // kind, in several slots) and unloading them all.
    auto lu = dut.make_registry();
    const std::vector<uint16_t> y_before = run_backend(ctx, dut, c, {"base_empty_registry", lu.get(), &all_base});
    lu->load(0, S.adapters[0].desc());
    lu->load(kScratchSlot, S.adapters[kNumAdapters - 1].desc());
    lu->load(kZeroBSlot0, S.zero_b[0].desc());
    lu->load(kScratchSlot, S.adapters[1].desc());  // replaces what the slot held
    for (int s = 0; s < kNumSlots; ++s)
      if (lu->loaded(s)) lu->unload(s);
    const std::vector<uint16_t> y_after = run_backend(ctx, dut, c, {"base_after_unload", lu.get(), &all_base});
    if (y_base.empty()) throw std::runtime_error("no base output (its run failed above)");
    const int64_t d1 = differing_elements(y_before, y_base, H, {});
    const int64_t d2 = differing_elements(y_after, y_base, H, {});
    rep.add(scope, inv, "base unchanged by load/unload", d1 == 0 && d2 == 0,
            "registry-empty before loading vs base: " + std::to_string(d1) + ", after unloading all: " +
                std::to_string(d2) + " differing bf16 values");
  });
  if (S.shared.E > 0) check_shared_expert(ctx, S, oracle, c, r_base);
  return out;
}

LaunchOutputs child_outputs(const Context& ctx, ShapeSetup& S, const Executor& dut, const Registries& regs,
                            const Config& c) {
  const AdapterRegistry* reg = regs.dut.get();
  LaunchOutputs o;
  o.base = run_backend(ctx, dut, c, {"base"});
  const std::vector<int32_t> ids = request_ids(S.T);
  o.requests = run_backend(ctx, dut, c, {"requests12", reg, &ids});
  return o;
}

}  // namespace fp4moe::check
