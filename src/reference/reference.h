// The CPU reference operator: the oracle every GPU kernel is tested against (SPEC §3, §5).
#pragma once
#include <cstdint>

#include "fp4moe/moe.h"
#include "runtime/prepared.h"

namespace fp4moe::reference {

// Routing (SPEC §3.1) for host tensors. ids [T, k] i32, weights [T, k] f32.
void route(const RoutingArgs& routing, int64_t T, int64_t num_experts_total, int32_t* ids, float* weights);

// The whole operator on host tensors. `args` has been validated (src/runtime/validate.h).
void run(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters);

// run() processing the tokens in chunks of at most max_tokens_per_chunk (run() picks a chunk that
// bounds its buffers to ~256 MiB). The output does not depend on the chunk size (batch invariance).
void run_chunked(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters,
                 int64_t max_tokens_per_chunk);

}  // namespace fp4moe::reference
