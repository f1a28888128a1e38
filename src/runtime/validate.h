// Argument checks of SPEC §6, done on the host before anything is launched or written.
#pragma once
#include <cstdint>

#include "fp4moe/moe.h"
#include "runtime/prepared.h"

namespace fp4moe {

// The sizes of one validated call.
struct CallShape {
  int64_t T = 0, H = 0, I = 0, N1 = 0, E_loc = 0, E_total = 0, k = 0;
};

// Throws fp4moe::Error naming the argument; returns the sizes when every argument is valid.
// `adapters` is the snapshot the run will use (so ids are checked against what runs).
CallShape validate_moe_args(const MoeWeights& weights, const MoeArgs& args, const AdapterSnapshot& adapters);

// Checks of routing arguments alone (shared by moe_run and route()).
void validate_routing(const RoutingArgs& r, int64_t T, int64_t E_total, Backend device, int device_id);

}  // namespace fp4moe
