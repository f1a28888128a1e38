// The executor of `fp4moe check` (check_executor.h).
#include "check_executor.h"

#include <cmath>
#include <initializer_list>

#ifdef FP4MOE_WITH_CUDA
#include <cuda_runtime.h>

#include "../common/device_buffer.h"
#endif

namespace fp4moe::check {
namespace {

#ifdef FP4MOE_WITH_CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::CudaError, "", std::string("fp4moe check: ") + what + ": " + cudaGetErrorString(e));
}
// A device copy of host data; no buffer (an absent tensor) when there is none.
DeviceBuffer device_copy(const void* host, size_t bytes) {
  return host && bytes ? DeviceBuffer::from(host, bytes) : DeviceBuffer();
}
#endif

}  // namespace

Executor::Executor(Backend backend, Precision precision, const ShapeSetup& S)
    : backend_(backend), precision_(precision), S_(S) {
  WeightsDesc d = const_cast<SyntheticLayer&>(S.layer).desc();
  weights_ = prepare_weights(d, backend, 0);
  if (S.shared.E > 0) shared_ = prepare_weights(const_cast<SyntheticLayer&>(S.shared).desc(), backend, 0);
}

void Executor::run(const Config& c, const CallSpec& call, std::vector<uint16_t>* bits, std::vector<double>* values) const {
  const int64_t T = S_.T, H = S_.H;
  HostInputs in{S_.x.data(),
                S_.logits.data(),
                S_.router_bias.empty() ? nullptr : S_.router_bias.data(),
                c.alpha.empty() ? nullptr : c.alpha.data(),
                c.beta.empty() ? nullptr : c.beta.data(),
                c.clamp.empty() ? nullptr : c.clamp.data(),
                call.adapter_ids ? call.adapter_ids->data() : nullptr,
                call.delta ? call.delta->data() : nullptr,
                call.topk_ids ? call.topk_ids->data() : nullptr,
                call.topk_weights ? call.topk_weights->data() : nullptr,
                S_.shared_gate.empty() ? nullptr : S_.shared_gate.data()};
  if (backend_ == Backend::CPU) {
    if (bits) {
      bits->assign(T * H, 0x7fc0);  // NaN: a row the run failed to write shows up
      MoeArgs a = make_args(c, call, in, Backend::CPU);
      a.y = make_view(bits->data(), DType::BF16, {T, H});
      moe_run(weights_, a);
    } else {
      MoeArgs a = make_args(c, call, in, Backend::CPU);
      if (precision_ == Precision::Fp64) {
        values->assign(T * H, NAN);
        a.y = make_view(values->data(), DType::F64, {T, H});
        moe_run(weights_, a);
      } else {
        std::vector<float> y(T * H, NAN);
        a.y = make_view(y.data(), DType::F32, {T, H});
        moe_run(weights_, a);
        values->assign(y.begin(), y.end());
      }
    }
    return;
  }
#ifdef FP4MOE_WITH_CUDA
  if (!bits) throw Error(ErrorCode::InvalidArgument, "", "fp4moe check: the CUDA executor returns bf16 only");
  const int64_t E = S_.E_loc, Et = S_.E_total, k = S_.k, N1 = S_.layer.gated ? 2 * S_.I : S_.I;
  const DeviceBuffer dx = device_copy(in.x, T * H * 2), dl = device_copy(call.topk_ids ? nullptr : in.logits, T * Et * 4),
                     db = device_copy(call.topk_ids ? nullptr : in.bias, Et * 4), dal = device_copy(in.alpha, E * 4),
                     dbe = device_copy(in.beta, E * 4), dcl = device_copy(in.clamp, E * 4), di = device_copy(in.ids, T * 4),
                     dd = device_copy(in.delta, T * k * N1 * 2), dti = device_copy(in.topk_ids, T * k * 4),
                     dtw = device_copy(in.topk_w, T * k * 4), dg = device_copy(in.shared_gate, H * 2);
  bits->assign(T * H, 0x7fc0);
  const DeviceBuffer dy = device_copy(bits->data(), T * H * 2);
  HostInputs dev{dx.get(),  dl.get(), db.get(),  dal.get(), dbe.get(), dcl.get(),
                 di.get(),  dd.get(), dti.get(), dtw.get(), dg.get()};
  MoeArgs a = make_args(c, call, dev, Backend::CUDA);
  a.y = make_view(dy.get(), DType::BF16, {T, H}, Backend::CUDA, 0);
  moe_run(weights_, a);
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after moe_run");
  check_device_errors(0);
  dy.download_to(bits->data(), T * H * 2);
#else
  throw Error(ErrorCode::Unsupported, "backend", "this build of fp4moe has no CUDA backend");
#endif
}

MoeArgs Executor::make_args(const Config& c, const CallSpec& call, const HostInputs& in, Backend dev) const {
  const int64_t T = S_.T, H = S_.H, E = S_.E_loc, Et = S_.E_total, k = S_.k, N1 = S_.layer.gated ? 2 * S_.I : S_.I;
  auto view = [&](const void* p, DType t, std::initializer_list<int64_t> shape) {
    return p ? make_view(const_cast<void*>(p), t, shape, dev, 0) : TensorView{};
  };
  MoeArgs a;
  a.x = view(in.x, DType::BF16, {T, H});
  a.routing.method = S_.shape->routing;
  a.routing.top_k = k;
  a.routing.n_group = S_.shape->n_group;
  a.routing.topk_group = S_.shape->topk_group;
  a.routing.routed_scaling_factor = S_.shape->routed_scaling_factor;
  if (call.topk_ids) {
    a.routing.topk_ids = view(in.topk_ids, DType::I32, {T, k});
    a.routing.topk_weights = view(in.topk_w, DType::F32, {T, k});
  } else {
    a.routing.logits = view(in.logits, DType::F32, {T, Et});
    a.routing.bias = view(in.bias, DType::F32, {Et});
  }
  a.num_experts_total = Et;
  a.local_expert_offset = S_.offset;
  a.activation.type = c.act;
  a.activation.alpha = view(in.alpha, DType::F32, {E});
  a.activation.beta = view(in.beta, DType::F32, {E});
  a.activation.clamp_limit = view(in.clamp, DType::F32, {E});
  a.mode = c.mode;
  a.fc1_input_scale = c.fc1_scale;
  a.fc2_input_scale = c.fc2_scale;
  if (call.registry) {
    a.adapters = call.registry;
    a.adapter_ids = view(in.ids, DType::I32, {T});
  }
  a.gate_up_lora_delta = view(in.delta, DType::BF16, {T, k, N1});
  if (shared_.valid() && call.shared != SharedRun::Without) {
    a.shared_expert = &shared_;
    if (call.shared == SharedRun::AsShape) a.shared_expert_gate = view(in.shared_gate, DType::BF16, {H});
  }
  a.precision = precision_;
  return a;
}

}  // namespace fp4moe::check
