#include "runtime/problem_shape.h"

#include "runtime/host_tensor.h"
#ifdef FP4MOE_WITH_CUDA
#include "cuda/backend.h"
#endif

namespace fp4moe {
namespace {
bool given(const TensorView& v) { return v.present() || v.ndim > 0; }
}  // namespace

ProblemShape problem_shape(const PreparedWeights& w, const MoeArgs& a, bool with_lora, int64_t lora_rank,
                           const DeviceDesc& device) {
  const RoutingArgs& r = a.routing;
  ProblemShape s;
  s.T = a.x.ndim > 0 ? a.x.shape[0] : 0;
  s.H = w.H;
  s.I = w.I;
  s.E_loc = w.E;
  s.E_total = a.num_experts_total == 0 ? w.E : a.num_experts_total;
  s.k = r.top_k;
  s.gated = w.gated;
  s.activation = a.activation.type;
  s.mode = a.mode;
  s.format = w.format;
  s.routing_from_logits = given(r.logits) || !given(r.topk_ids);
  s.n_group = r.method == RoutingMethod::DeepSeekV3 ? r.n_group : 1;
  s.routing_sums_experts = r.method == RoutingMethod::Default || r.method == RoutingMethod::RenormalizeNaive;
  s.has_shared = a.shared_expert != nullptr;
  s.shared_I = a.shared_expert ? a.shared_expert->impl().I : 0;
  s.has_lora = with_lora || a.adapters != nullptr;
  s.max_lora_rank = s.has_lora ? lora_rank : 0;
  s.device = device;
  s.gemm_config = static_cast<int>(a.gemm_tile);
  s.workspace_budget = a.workspace_budget;
  return s;
}

size_t call_workspace_size(const PreparedWeights& weights, const MoeArgs& args, bool with_lora, int64_t lora_rank) {
  const int tile = static_cast<int>(args.gemm_tile);
  check_gemm_tile(tile);
  // The weights' device: split-K's partial sums depend on its SM count.
  DeviceDesc device;
#ifdef FP4MOE_WITH_CUDA
  if (weights.backend == Backend::CUDA) device = cuda_backend::device_desc(weights.device_id);
#endif
  device.wgmma = device.wgmma || (tile >= 0 && kGemmConfigs[tile].wgmma);
  return workspace_size(problem_shape(weights, args, with_lora, lora_rank, device));
}

size_t workspace_size(const MoeWeights& weights, const MoeArgs& args) {
  if (!weights.valid()) detail::invalid("weights", "not prepared (call prepare_weights first)");
  if (weights.backend() != Backend::CUDA) return 0;
  // Rank unknown (sized for the largest), so that adapters loaded later still fit.
  return call_workspace_size(weights.impl(), args, false, 0);
}

}  // namespace fp4moe
