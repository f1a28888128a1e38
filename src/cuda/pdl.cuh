// Programmatic dependent launch (sm_90+): a kernel launched with launch_pdl may be scheduled while the kernel
// before it in the stream finishes, and waits in pdl_wait() until that kernel's results are visible. A decode
// step is a chain of small kernels, so their launch latencies are a large part of it. Every kernel launched
// this way calls pdl_wait() before it reads what its predecessor writes, and pdl_launch_dependents() (which lets
// the next kernel in) only after it: so when a kernel starts, every kernel before its predecessor has finished.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "cuda/kernels.h"

namespace fp4moe::cuda_backend {
namespace dev {
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
}  // namespace dev

// Whether the current device has programmatic dependent launch (compute capability 9.0 and later; the wheel also
// carries sm_80/89 code, where the attribute is left out). One cudaGetDevice per launch.
inline bool pdl_supported() {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  return compute_capability(dev) >= 90;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization allowed where supported.
template <class... KernelArgs, class... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                const char* what, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_supported() ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what);
}

}  // namespace fp4moe::cuda_backend
