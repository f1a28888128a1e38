// The CUDA backend as the runtime sees it. Implemented in src/cuda/ (compiled only with nvcc);
// the runtime calls these only when FP4MOE_WITH_CUDA is defined.
#pragma once
#include <cstdint>
#include <memory>

#include "runtime/plan.h"
#include "runtime/prepared.h"

namespace fp4moe::cuda_backend {

// Lays the canonical weights out for the kernels and uploads them to w.device_id.
std::shared_ptr<void> prepare_device_weights(const PreparedWeights& w);
// Uploads an adapter's canonical matrices (for the registry's device copy).
std::shared_ptr<void> prepare_device_adapter(const PreparedAdapter& a, int device_id);
// Runs the operator. Arguments are already validated by the runtime (src/runtime/validate.h);
// tensors are on device w.device_id.
void run(const PreparedWeights& w, const MoeArgs& args, const AdapterSnapshot& adapters);
// Reads and clears the device error flag of device_id; throws DeviceFault when it was set.
void check_device_errors(int device_id);
// The plan's view of device dev (SM count, L2 size, wgmma), its attributes read once.
DeviceDesc device_desc(int dev);
// Number of CUDA devices visible (0 when none or no driver).
int device_count();
// Test hook (fault injection): the n-th checked CUDA call from now on (0: the next) is reported as failed with
// cudaErrorLaunchOutOfResources although it ran; n < 0 disarms it. Process-wide, for single-threaded tests.
void fail_checked_cuda_call(int64_t n);
// Whether an armed fail_checked_cuda_call has not fired yet.
bool checked_cuda_failure_pending();

}  // namespace fp4moe::cuda_backend
