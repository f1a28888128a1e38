// The case runner of `fp4moe check`: every phase and invariant of one (shape, activation, mode) config.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "check.h"
#include "check_executor.h"
#include "check_options.h"
#include "check_report.h"
#include "check_setup.h"

namespace fp4moe::check {

// The two outputs hashed across launches: base without adapters, and the mixed-request batch.
struct LaunchOutputs {
  std::vector<uint16_t> base, requests;
  uint64_t hash() const {
    uint64_t h = fnv1a(base.data(), base.size() * 2);
    return fnv1a(requests.data(), requests.size() * 2, h);
  }
};

struct Context {
  const Options& opt;
  const CheckHooks& hooks;
  Backend backend;
  int64_t experts, tokens;
  Reporter& rep;
};

// The activations of a shape's configs: --activations, else its own plus SwiGLU and SiTU.
std::vector<ActivationType> activations_of(const ModelShape& shape, const Options& opt);

// The adapters of one shape, loaded once (converting full-size adapters costs seconds): the backend's
// registry holds the eight, the zero-B ones and the exact bridge adapter; the oracle's the eight and
// the bridge adapter.
struct Registries {
  std::unique_ptr<AdapterRegistry> dut, oracle;
};
Registries make_registries(ShapeSetup& S, const Executor& dut, const Executor* oracle);

// All phases and invariants of one config except the relaunch; returns the outputs to hash.
LaunchOutputs run_config(const Context& ctx, ShapeSetup& S, const Executor& dut, const Executor& oracle,
                         const Registries& regs, const Config& c);

// The child of the relaunch invariant: the same setup, only the hashed runs, one line per config.
LaunchOutputs child_outputs(const Context& ctx, ShapeSetup& S, const Executor& dut, const Registries& regs,
                            const Config& c);

}  // namespace fp4moe::check
