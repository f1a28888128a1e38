// The plan's view of one call: the single mapping from (weights, MoeArgs) to ProblemShape, shared by the CUDA
// backend, `fp4moe bench`, the Python bindings and workspace_size.
#pragma once
#include <cstdint>

#include "fp4moe/moe.h"
#include "runtime/plan.h"
#include "runtime/prepared.h"

namespace fp4moe {

// Tensors count by their shape: a view with a shape and no data describes a tensor for sizing (workspace_size
// before the buffers exist). lora_rank: the largest adapter rank of the call's registry (0: unknown, sized for
// the largest); LoRA is on when args.adapters is given or `with_lora` says so. device: the device the call runs on
// (ProblemShape::device).
ProblemShape problem_shape(const PreparedWeights& weights, const MoeArgs& args, bool with_lora, int64_t lora_rank,
                           const DeviceDesc& device);

// Workspace bytes of a call (sizing only, any backend's weights), on the weights' device: a forced wgmma tile is
// sized as on a device that runs it. The public workspace_size(weights, args), the bindings and fp4moe_soak size through it.
size_t call_workspace_size(const PreparedWeights& weights, const MoeArgs& args, bool with_lora, int64_t lora_rank);

}  // namespace fp4moe
