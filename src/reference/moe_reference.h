// The reference Runner (moe_reference.cpp) for moe_reference_run.cpp; Acc = float (Fp32) or double (Fp64).
#pragma once
#include "fp4moe/moe.h"
#include "runtime/prepared.h"

namespace fp4moe::reference {

// One pass over every token of args (args small enough for its buffers).
template <class Acc> void run_tokens(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters);
// The argument checks alone (routing included); writes nothing.
template <class Acc> void check_tokens(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters);

}  // namespace fp4moe::reference
