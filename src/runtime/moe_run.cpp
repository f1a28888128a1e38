// The one run call: validate everything, take the adapter snapshot, hand over to the backend.
#include "reference/reference.h"
#include "runtime/validate.h"
#ifdef FP4MOE_WITH_CUDA
#include "cuda/backend.h"
#endif

namespace fp4moe {

void moe_run(const MoeWeights& weights, const MoeArgs& args) {
  // One snapshot for validation and for the run: a concurrent load/unload cannot change this call.
  AdapterSnapshot snap = args.adapters ? args.adapters->snapshot() : nullptr;
  const CallShape s = validate_moe_args(weights, args, snap);
  if (s.T == 0) return;  // legal: empty output
  const PreparedWeights& w = weights.impl();
  if (w.backend == Backend::CPU) {
    reference::run(w, args, snap);
    return;
  }
#ifdef FP4MOE_WITH_CUDA
  cuda_backend::run(w, args, snap);
#else
  throw Error(ErrorCode::Unsupported, "weights", "this build of fp4moe has no CUDA backend");
#endif
}

void route(const RoutingArgs& routing, int64_t num_experts_total, TensorView ids_out, TensorView weights_out) {
  const int64_t T = routing.logits.present() ? routing.logits.shape[0]
                                             : (routing.topk_ids.present() ? routing.topk_ids.shape[0] : 0);
  validate_routing(routing, T, num_experts_total, Backend::CPU, 0);
  if (!ids_out.present() || ids_out.dtype != DType::I32 || ids_out.numel() != T * routing.top_k || !ids_out.is_contiguous())
    throw Error(ErrorCode::InvalidArgument, "topk_ids_out", "expected a contiguous int32 [T, k] host tensor");
  if (!weights_out.present() || weights_out.dtype != DType::F32 || weights_out.numel() != T * routing.top_k ||
      !weights_out.is_contiguous())
    throw Error(ErrorCode::InvalidArgument, "topk_weights_out", "expected a contiguous float32 [T, k] host tensor");
  reference::route(routing, T, num_experts_total, ids_out.as<int32_t>(), weights_out.as<float>());
}

void check_device_errors(int device_id) {
#ifdef FP4MOE_WITH_CUDA
  if (cuda_backend::device_count() > 0) cuda_backend::check_device_errors(device_id);
#else
  (void)device_id;
#endif
}

}  // namespace fp4moe
